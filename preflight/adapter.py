"""The adapter protocol: the handful of functions the preflight suite needs from a trainer.

An adapter is any object (an instance, a class with a no-argument constructor, or a module of functions) with
the attributes below. Shapes: ``ids`` [B, T] whole episodes (prompt, policy and environment tokens) with right
padding; per-token tensors are [B, T-1] and aligned to ``ids[:, 1:]``; ``B = P * G`` with the G samples of each
prompt contiguous. Every function must be deterministic (same inputs, same outputs) and must not change the
model it is given except where stated.

Required
--------
``group_size: int``                         G, samples per prompt.
``build_model() -> nn.Module``              a fresh policy as the trainer starts from it (frozen parts frozen).
``make_batch(model, seed) -> batch``        one real batch from the trainer's own sampler; any object.
``token_ids(batch) -> [B, T]``              the episodes' token ids.
``policy_tokens(batch) -> bool [B, T]``     ground truth from the environment: True where the policy wrote.
``rewards(batch) -> [B]``                   the episodes' rewards.
``sampler_log_probs(batch) -> [B, T-1]``    log-probs of the sampled tokens, stored at sampling time.
``old_log_probs(model, batch) -> [B, T-1]`` the behaviour log-probs the update will use (the ratio's denominator).
``logits(model, batch) -> [B, T-1, V]``     the trainer's next-token logits (temperature applied).
``log_probs(model, batch) -> [B, T-1]``     the trainer's own log-probs of ``ids[:, 1:]`` (its gather path).
``action_mask(batch) -> [B, T-1]``          the trainer's loss mask.
``advantages(batch) -> [B]``                the trainer's advantages.
``loss(model, batch, rows, ref_model=None, term="total") -> scalar``
                                            the loss of ``rows`` (a 1-D long tensor of row indices) in one pass,
                                            normalised as one minibatch; with a ``ref_model``, reference
                                            log-probs recomputed from it (never the batch's stored ones).
                                            ``term``: ``"total"``; ``"entropy"`` / ``"kl"``: only that term as
                                            it enters the loss (its sign and coefficient), or ``None`` when the
                                            trainer has no such term.
``backward(model, batch, rows, ref_model=None)``
                                            the trainer's own backward of one minibatch (with its gradient
                                            accumulation), no optimizer step.
``make_reference(model) -> ref_model | None`` the KL reference as the trainer makes it (None: no KL term).
``make_optimizer(model) -> optimizer``      the optimizer as the trainer makes it.
``update(model, optimizer, ref_model, batch) -> dict``
                                            one full update (epochs x minibatches) in place; the dict reports
                                            ``ratio_max`` and ``ratio_min`` over all its minibatches.

Optional (the check is skipped without it)
------------------------------------------
``trainable_names(model) -> set[str]``      parameters meant to train (default: those with requires_grad
                                            on the model ``build_model`` returns, read before any trainer
                                            code runs on it).
``pad_batch(batch, extra) -> batch``        the same batch with ``extra`` columns of right padding (default:
                                            pads every tensor of a dict batch whose dim 1 is T or T-1).
``pad_prompts(batch, extra) -> batch``      the batch with ``extra`` more columns of padding where the trainer
                                            pads its prompts (left-padded prompts: on the left, the per-token
                                            tensors then ``extra`` columns longer at the front); padding_leak
                                            uses it as well as ``pad_batch``.
``select_rows(batch, rows) -> batch``       the batch restricted to, and ordered by, ``rows`` (a 1-D long tensor)
                                            (default: indexes every tensor, list and tuple of a dict batch whose
                                            first dim is B); padding_leak and rows_in_step need it.
``ref_log_probs(ref_model, batch) -> [B, T-1]`` / ``returns(batch) -> [B]``
                                            the reference's log-probs and the returns as the trainer computes
                                            them: targets_detached checks they carry no autograd graph.
``scoring_passes(model, batch) -> dict``    the trainer's own old-policy/reference scoring of ``batch``, run
                                            as training runs it (its modes), name -> tensor: scoring_eval_mode
                                            runs it twice and compares (besides old_log_probs / log_probs).
``whole_batch_backward``                    True when ``backward`` takes only every row, in the trainer's own
                                            order: rows_in_step then skips its backward over pairs of rows.
``documented_deviations() -> dict``        check name -> the trainer's own documented setting that produces that
                                            check's fault signature by design (e.g. a framework's per-micro-batch
                                            normalisation): a failure of that check is reported as a warning
                                            (``warn``) naming the setting, not as a finding.
``stop_token_ids``                          the ids that end a completion (an attribute or a method; an int or
                                            a sequence): stop_token_trained checks the first one of each
                                            completion is in the loss mask (skipped without it).
``save(model, path)`` / ``load(path) -> model``  (default: ``state_dict`` into ``build_model()``).
``run_signature(seed, steps) -> list``      a short training run's per-step signature (rewards, lengths, ...).
``greedy_rollout(model, seed) -> list``     the sampling path with the noise off (greedy) on fixed tasks ...
``evaluate_greedy(model, seed) -> list``    ... and the plain evaluation path on the same tasks.

Optional (hooks for framework integrations)
-------------------------------------------
``copy_model(model) -> model``              an independent copy (default: ``copy.deepcopy``); for models whose
                                            framework patches instance methods with closures over the original.
``not_applicable() -> dict[str, str]``      checks that cannot apply to this trainer's configuration, each with
                                            the reason (no entropy term, no KL term, one optimizer step per
                                            batch); they are reported as skipped with that reason, not run.
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from typing import Any, Protocol, runtime_checkable

REQUIRED = (
    "group_size", "build_model", "make_batch", "token_ids", "policy_tokens", "rewards", "sampler_log_probs",
    "old_log_probs", "logits", "log_probs", "action_mask", "advantages", "loss", "backward", "make_reference",
    "make_optimizer", "update",
)
OPTIONAL = ("trainable_names", "pad_batch", "select_rows", "stop_token_ids", "ref_log_probs", "returns", "scoring_passes", "whole_batch_backward", "documented_deviations", "pad_prompts", "save", "load", "run_signature",
            "greedy_rollout", "evaluate_greedy", "copy_model", "not_applicable")


@runtime_checkable
class TrainerAdapter(Protocol):
    """Static description of the required part of the protocol (see the module docstring)."""

    group_size: int

    def build_model(self) -> Any: ...
    def make_batch(self, model, seed: int) -> Any: ...
    def token_ids(self, batch) -> Any: ...
    def policy_tokens(self, batch) -> Any: ...
    def rewards(self, batch) -> Any: ...
    def sampler_log_probs(self, batch) -> Any: ...
    def old_log_probs(self, model, batch) -> Any: ...
    def logits(self, model, batch) -> Any: ...
    def log_probs(self, model, batch) -> Any: ...
    def action_mask(self, batch) -> Any: ...
    def advantages(self, batch) -> Any: ...
    def loss(self, model, batch, rows, ref_model=None, term: str = "total") -> Any: ...
    def backward(self, model, batch, rows, ref_model=None) -> Any: ...
    def make_reference(self, model) -> Any: ...
    def make_optimizer(self, model) -> Any: ...
    def update(self, model, optimizer, ref_model, batch) -> dict: ...


class TrainerFault(Exception):
    """Raised by an adapter when the trainer does something wrong that stops a check from running on (an
    optimizer over the reference's parameters): the check is reported as failed, with this message as its hint,
    under the check's code. Any other exception inside a check is an rlguard error, not a finding."""


class AdapterError(Exception):
    """The adapter could not be loaded, or lacks a required function."""


def missing(adapter) -> list[str]:
    return [name for name in REQUIRED if not hasattr(adapter, name)]


def import_object(spec: str) -> Any:
    """``"package.module:attr.sub"`` (or ``"package.module"``) -> that object, without calling it.

    The current directory is put on ``sys.path`` first, as ``python -m`` would. ``AdapterError`` when the module
    does not import or has no such attribute.
    """
    module_name, _, attr = spec.partition(":")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 - any import-time failure means the trainer can't be built
        raise AdapterError(f"cannot import {module_name!r}: {type(exc).__name__}: {exc}") from exc
    obj: Any = module
    for part in filter(None, attr.split(".")):
        if not hasattr(obj, part):
            raise AdapterError(f"{module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    return obj


def load_adapter(spec: str):
    """``"package.module:attr"`` (or ``"package.module"``: the module's functions) -> the adapter object.

    ``attr`` may be an adapter instance, a class or a no-argument factory. The current directory is put on
    ``sys.path`` first, as ``python -m`` would.
    """
    obj = import_object(spec)
    if inspect.isclass(obj) or (callable(obj) and not hasattr(obj, "build_model")):
        try:
            obj = obj()
        except Exception as exc:  # noqa: BLE001
            raise AdapterError(f"calling {spec!r} failed: {type(exc).__name__}: {exc}") from exc
    absent = missing(obj)
    if absent:
        raise AdapterError(f"{spec!r} is not a preflight adapter: missing {', '.join(absent)}")
    return obj
