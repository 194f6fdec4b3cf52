"""The preflight adapter protocol (``rlguard.preflight.adapter``) over a constructed ``trl.GRPOTrainer`` or
``trl.RLOOTrainer`` (TRL's two online RL trainers; ``SUPPORTED_TRAINERS``).

Nothing to write per trainer: every function runs TRL's own code on the suite's copies of the policy, with the
trainer's own subclass, configuration and reward functions: ``_generate_and_score_completions`` (generation,
rewards, advantages with ``scale_rewards`` and ``multi_objective_aggregation``, reference log-probs),
``_get_per_token_logps_and_entropies`` (TRL's fused log-prob head, temperature included), ``_compute_loss``
(``loss_type``, ``beta``, clipping, the entropy bonus), ``training_step`` and ``_prepare_inputs`` (buffering,
shuffling and slicing of the generation batch, ``num_iterations``, ``steps_per_generation``), gradient
accumulation and ``max_grad_norm`` clipping. Per-token tensors, which TRL keeps over the completion only
(``[B, C]``), are placed into the protocol's ``[B, T-1]`` layout aligned to ``ids[:, 1:]`` with ``ids =
cat(prompt_ids, completion_ids)``.

Ground truth comes from the sampler, not from the trainer's own bookkeeping: the tokens ``_generate`` returned
are the policy's tokens (``policy_tokens``), and the log-probs the sampler drew them with are read from
``generate``'s processed scores (temperature, top-k/top-p and the other logits processors applied).

To bind the trainer to a copy, the adapter sets ``trainer.model`` (and ``model_wrapped``, ``ref_model``,
``optimizer``) for the duration of one call and restores them after; the few methods it observes
(``_generate``, ``_calculate_rewards``, the copy's ``generate``) are wrapped on the instance and the wrappers
removed after the call. The update loop replays ``transformers.Trainer``'s inner loop (``training_step`` per
micro-batch, clip, ``optimizer.step()``, ``model.zero_grad()``) without callbacks, logging or checkpoints.

A PEFT policy (a ``peft_config`` given to the trainer, or a ``PeftModel``) is copied whole, adapter structure
included (TRL's fused head sits on its base model). TRL's reference is then the policy itself with the adapter
off (or its frozen ``"ref"`` adapter active), not a model: ``make_reference`` returns a ``PeftReference``, and
the reference's log-probs and logits come from TRL's own reference pass (``_generate_and_score_completions``
replayed on the batch's completions and rewards). The parameters meant to train are the adapter's.
"""

from __future__ import annotations

import contextlib
import os
import copy
import tempfile
from collections import defaultdict
from dataclasses import dataclass, replace
from typing import Callable

import torch
import torch.nn.functional as F
from accelerate.utils import is_peft_model
from trl import GRPOTrainer, RLOOTrainer
from trl.trainer import utils as trl_utils

from rlguard.integrations.trl._version import unsupported_peft
from rlguard.preflight.adapter import TrainerFault

_MISSING = object()
# Trainer attributes a call may set; restored afterwards.
_BOUND = ("model", "model_wrapped", "ref_model", "optimizer", "_step", "_buffered_inputs", "_metrics",
          "current_gradient_accumulation_steps", "beta", "_entropy_bonus_enabled", "_logs")


# TRL's online RL trainers the adapter and the callback drive (a user's subclass of either included). RLOO shares
# GRPO's generation, scoring and training loop; it differs where its loss does: sequence-level old log-probs
# (``old_logps`` [B], the masked sum of the per-token ones), the KL applied as a reward penalty at generation
# (``rewards - beta * sum(old - ref)``) rather than a loss term, no entropy bonus, and no tool rollouts.
SUPPORTED_TRAINERS = (GRPOTrainer, RLOOTrainer)
SUPPORTED_NAMES = " or ".join(f"trl.{cls.__name__}" for cls in SUPPORTED_TRAINERS)


class TRLPreflightError(ValueError):
    """The trainer's configuration is one the TRL preflight does not support (it says which and why)."""


class TRLTrainerFault(TRLPreflightError, TrainerFault):
    """The trainer does something wrong that stops a check (reported as that check's failure)."""


class UnsupportedTrainerError(TRLPreflightError, TypeError):
    """A trainer of a class rlguard's TRL integration does not drive (DPOTrainer, SFTTrainer, ...)."""


def supported_trainer(trainer, what: str = "trainer") -> type:
    """``trainer``'s TRL base class among ``SUPPORTED_TRAINERS``; ``UnsupportedTrainerError`` naming them if none."""
    for cls in SUPPORTED_TRAINERS:
        if isinstance(trainer, cls):
            return cls
    raise UnsupportedTrainerError(
        f"the {what} is a {type(trainer).__module__}.{type(trainer).__name__}: rlguard's TRL integration supports "
        f"{SUPPORTED_NAMES} (or a subclass of either)")


class PeftReference:
    """TRL's KL reference of a PEFT policy: ``policy`` itself with the adapter off (or its ``"ref"`` adapter
    active), as ``_generate_and_score_completions`` computes it when the trainer has no ``ref_model``.

    Not a model of its own: the adapter's ``logits`` and log-probs of it replay TRL's reference pass on
    ``policy`` as it is at that moment (after an update: the updated adapter switched off again).
    """

    def __init__(self, policy: torch.nn.Module):
        self.policy = policy

    def __repr__(self) -> str:
        return f"PeftReference({type(self.policy).__name__}, adapter off)"


def fused_target(model: torch.nn.Module) -> torch.nn.Module:
    """The module TRL's fused log-prob head patches: the base model of a PEFT model, else the model."""
    return model.get_base_model() if is_peft_model(model) else model


def adapter_parameter_names(model: torch.nn.Module) -> set[str]:
    """The parameters of a PEFT model's active adapter(s): what training is meant to change (LoRA's ``lora_A`` /
    ``lora_B``, ``modules_to_save`` copies, ...), read from PEFT's layers rather than from ``requires_grad``
    (which a faulty trainer may switch on for a base weight). Empty for a model without PEFT."""
    if not is_peft_model(model):
        return set()
    active = list(model.active_adapters)
    names: set[str] = set()
    for prefix, module in model.named_modules():
        attrs = getattr(module, "adapter_layer_names", None)  # PEFT's tuner layers and auxiliary wrappers
        if not attrs:
            continue
        for attr in attrs:
            container = getattr(module, attr, None)
            if not isinstance(container, (torch.nn.ModuleDict, torch.nn.ParameterDict)):
                continue
            for adapter in active:
                if adapter not in container:
                    continue
                item = container[adapter]
                base = f"{prefix}.{attr}.{adapter}" if prefix else f"{attr}.{adapter}"
                if isinstance(item, torch.nn.Parameter):
                    names.add(base)
                else:
                    names.update(f"{base}.{n}" for n, _ in item.named_parameters())
    return names


@dataclass
class GenerationBatch:
    """One generation batch: TRL's loss dict and what the sampler and the reward functions saw."""

    inputs: dict  # what _generate_and_score_completions returned (prompt/completion ids and masks, advantages, ...)
    rewards: torch.Tensor  # [B] the weighted sum of the reward functions, as TRL logs it
    generated: torch.Tensor  # bool [B, C]: completion tokens the sampler produced (and that are meant to train)
    sampler_logps: torch.Tensor  # [B, C] log-probs of those tokens under the sampler's processed distribution
    prompt_rows: list  # the dataset rows the batch was generated from (each prompt G times)
    generate_output: tuple | None = None  # what ``_generate`` returned (replayed by TRL's reference pass)
    rewards_per_func: torch.Tensor | None = None  # what ``_calculate_rewards`` returned
    # RLOO keeps only sequence-level old log-probs in its dict: the per-token ones (old, and the reference's when
    # beta != 0) its generation computed them from, observed in that call, each [B, C]
    scored: dict | None = None

    @property
    def prompt_len(self) -> int:
        return self.inputs["prompt_ids"].shape[1]


# ---------------------------------------------------------------------------------------------- TRL's model patch


def _fused_patch(module: torch.nn.Module):
    """TRL's ``add_fused_lm_head`` patch on ``module`` -> the arguments it was applied with, or None.

    The patch is an instance ``forward``; when accelerate has wrapped it for mixed precision (``prepare_model``
    of the reference), TRL's is kept in ``_original_forward``.
    """
    for attr in ("_original_forward", "forward"):
        func = getattr(module.__dict__.get(attr), "__func__", None)
        code = getattr(func, "__code__", None)
        if code is None or code.co_name != "_fused_forward" or func.__closure__ is None:
            continue
        cells = dict(zip(code.co_freevars, func.__closure__))
        try:
            return {name: cells[name].cell_contents for name in ("temperature", "cast_lm_head_to_fp32", "outputs")}
        except KeyError:  # pragma: no cover - another TRL's patch: refused by the version check already
            return None
    return None


_INSTANCE_PATCHES = ("forward", "_original_forward")


def copy_patched_model(model: torch.nn.Module, memo: dict | None = None) -> torch.nn.Module:
    """A deep copy of a model TRL has patched, with the patch applied again to the copy.

    TRL's fused log-prob head replaces ``forward`` on the instance with a closure over the *original* model's
    bound ``forward`` (and accelerate may wrap that for autocast): a plain ``copy.deepcopy`` would run the
    original's weights whenever the copy is called without ``fused_lm_head=True`` (generation). The instance
    patches are taken off during the copy and put back; the copy gets TRL's patch again, with the same
    temperature and outputs, and no autocast wrapper (TRL's own calls run under ``accelerator.autocast()``).
    ``memo`` is ``deepcopy``'s (to keep aliasing with another model).
    """
    patched = []
    for name, module in model.named_modules():
        params = _fused_patch(module)
        if params is not None:
            saved = {k: module.__dict__.pop(k) for k in _INSTANCE_PATCHES if k in module.__dict__}
            patched.append((name, saved, params))
    try:
        new = copy.deepcopy(model, memo if memo is not None else {})
    finally:
        for name, saved, _ in patched:
            model.get_submodule(name).__dict__.update(saved)
    for name, _, params in patched:
        target = new.get_submodule(name)
        if _fused_patch(target) is None:  # an alias kept by the memo is patched already
            trl_utils.add_fused_lm_head(target, **params)
    return new


# ---------------------------------------------------------------------------------------------- the adapter


class GRPOAdapter:
    """rlguard's preflight adapter over a constructed ``trl.GRPOTrainer`` or ``trl.RLOOTrainer`` (the user's
    subclass of either included).

    ``trainer``: constructed, not yet trained (its ``model`` is the policy as training starts). ``factory``:
    the function that built it, optional; with it the ``reproducible`` check compares two short real runs of
    ``trainer.train()`` on fresh trainers. ``seed`` fixes the prompts and the sampling of the batch.
    ``autocast``: run TRL's code under the trainer's mixed precision (bf16/fp16) as it trains; by default the
    preflight runs it in float32, so that the suite's tolerances (a log-prob gap below 1e-4, ...) measure the
    trainer's logic and not bf16 rounding.
    """

    def __init__(self, trainer, factory: Callable[[], object] | None = None, seed: int = 0,
                 autocast: bool = False):
        self.trainer_class = supported_trainer(trainer)
        self.rloo = self.trainer_class is RLOOTrainer
        unsupported_configuration(trainer)
        self.trainer = trainer
        self.factory = factory
        self.seed = seed
        self.autocast = autocast
        self.group_size = trainer.num_generations
        self.pad_id = trainer._tokenizer.pad_token_id
        self.peft = is_peft_model(trainer.model)
        if self.peft:  # the frozen_params check's intended set: the adapter's parameters, not requires_grad
            self.trainable_names = adapter_parameter_names
        # what generation stops on and TRL's completion mask is cut at (the tokenizer's EOS and the generation
        # config's): stop_token_trained checks the first one of each completion is trained
        self.stop_token_ids = tuple(int(i) for i in getattr(trainer, "eos_token_ids", None)
                                    or [trainer._tokenizer.eos_token_id] if i is not None)

    # TRL's training_step accumulates whole generation batches in its own shuffled order: rows_in_step's
    # backward over pairs of rows has nothing to reorder (its loss and batch permutations still run)
    whole_batch_backward = True

    def _peft_base_path(self) -> str | None:
        model = self.trainer.model
        config = model.peft_config[model.active_adapters[0]]
        path = config.base_model_name_or_path
        return path if isinstance(path, str) and path and (os.path.isdir(path) or not os.path.isabs(path)) else None

    # -- configuration ----------------------------------------------------------------------------------------
    @property
    def micro_steps_per_generation(self) -> int:
        return self.trainer.args.steps_per_generation * self.trainer.num_iterations

    @property
    def optimizer_steps_per_generation(self) -> int:
        ga = self.trainer.args.gradient_accumulation_steps
        return -(-self.micro_steps_per_generation // ga)

    def not_applicable(self) -> dict[str, str]:
        """Checks that cannot apply to this trainer's configuration, with the reason."""
        t, out = self.trainer, {}
        if t.beta == 0.0:
            reason = ("beta == 0: the loss has no KL term (TRL uses no reference: with PEFT it would be the base "
                      "model with the adapter off)" if self.peft else
                      "beta == 0: the loss has no KL term (TRL builds no reference model)")
            out["kl_positive"] = out["kl_direction"] = reason
        elif self.rloo:  # kl_positive still applies: it compares the stepped policy with the reference
            out["kl_direction"] = (
                "RLOO applies the KL as a reward penalty at generation (rewards - beta * sum(old - ref)), not as a "
                "loss term: there is no KL term of the loss to probe")
        if self.rloo:
            out["entropy_direction"] = "RLOO's loss has no entropy bonus"
        elif not t._entropy_bonus_enabled:
            out["entropy_direction"] = "entropy_coef == 0: GRPO's loss has no entropy bonus"
        if self.optimizer_steps_per_generation == 1:
            out["old_logp_frozen"] = (
                f"one optimizer step per generation (num_iterations={t.num_iterations}, steps_per_generation="
                f"{t.args.steps_per_generation}, gradient_accumulation_steps={t.args.gradient_accumulation_steps}):"
                " the ratio is 1 by construction")
        out["grads_zeroed"] = ("the optimizer loop is transformers.Trainer's (model.zero_grad() before training and "
                               "after every step), which the preflight replays: it would test its own replay")
        if self.peft and self._peft_base_path() is None:
            out["reload"] = ("the PEFT model's base_model_name_or_path is not a folder or model id TRL can load "
                             "the base model from, so a saved adapter cannot be loaded back onto it")
        if self.factory is None:
            out["reproducible"] = "no trainer factory to build two fresh trainers from (rlguard check --trl gives one)"
        return out

    def documented_deviations(self) -> dict[str, str]:
        """TRL's documented settings that differ from one pass over the batch by design."""
        t, out = self.trainer, {}
        args = t.args
        if not self.rloo and args.loss_type == "bnpo" and args.gradient_accumulation_steps > 1:
            out["accumulation"] = (
                f"loss_type='bnpo' with gradient_accumulation_steps={args.gradient_accumulation_steps}: TRL documents "
                "bnpo as normalised by the active tokens of each local micro-batch, so accumulated micro-batches "
                "weigh their tokens unequally (RLG006's signature, by this setting's design); loss_type='dapo' (the "
                "default) normalises by the whole generation batch's tokens")
        return out

    # -- models -------------------------------------------------------------------------------------------------
    def copy_model(self, model):
        return copy_patched_model(model)

    def build_model(self):
        return copy_patched_model(self.trainer.model)

    def make_reference(self, model):
        """The trainer's reference, copied so that it relates to ``model`` as it relates to ``trainer.model``
        (the same object if it is the policy, shared tensors where it shares them)."""
        t = self.trainer
        if t.beta == 0.0:
            return None
        if t.ref_model is None:  # PEFT: TRL computes the reference with the policy's adapter off
            return PeftReference(model) if self.peft else None
        return copy_patched_model(t.ref_model, _correspondence(t.model, model))

    def make_optimizer(self, model):
        """The optimizer the trainer's ``create_optimizer`` builds for ``model`` (or, when the trainer was given
        one, the same class and groups over ``model``'s parameters); refused if it holds other parameters."""
        t = self.trainer
        if t.optimizer is None:
            with self._bound(model, self.make_reference(model)) as t:  # never the trainer's own reference
                t.optimizer = None
                optimizer = t.create_optimizer(model)
        else:  # the user passed optimizers=(opt, scheduler)
            mapping = _correspondence(t.model, model)
            groups = []
            for group in t.optimizer.param_groups:
                params = [mapping.get(id(p), p) for p in group["params"]]
                groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": params})
            inner = getattr(t.optimizer, "optimizer", t.optimizer)  # accelerate's AcceleratedOptimizer
            optimizer = type(inner)(groups, **inner.defaults)
        own = {id(p) for p in model.parameters()}
        foreign = sum(id(p) not in own for group in optimizer.param_groups for p in group["params"])
        if foreign:
            raise TRLTrainerFault(
                f"the trainer's optimizer holds {foreign} parameter(s) that are not the policy's (the reference's? "
                "see RLG008): optimizer.step() would train them; build it over model.parameters() only")
        return optimizer

    # -- the batch ------------------------------------------------------------------------------------------------
    def _prompt_rows(self, seed: int) -> list:
        t = self.trainer
        n_prompts = t.args.per_device_train_batch_size * t.args.steps_per_generation // t.num_generations
        data = t.train_dataset
        if hasattr(data, "__len__") and hasattr(data, "__getitem__"):
            order = torch.randperm(len(data), generator=torch.Generator().manual_seed(seed)).tolist()
            picks = [data[order[i % len(order)]] for i in range(n_prompts)]
        else:  # an IterableDataset: the first prompts of the stream
            picks = []
            for row in data:
                picks.append(row)
                if len(picks) == n_prompts:
                    break
        return [dict(row) for row in picks for _ in range(t.num_generations)]

    def make_batch(self, model, seed):
        t = self.trainer
        rows = self._prompt_rows(seed)
        seen: dict = {}
        reference = self.make_reference(model)
        calls: list = []
        with self._bound(model, reference) as t, torch.random.fork_rng(), \
                _observe(t, "_generate", seen), _observe(t, "_calculate_rewards", seen), _sampler(model, seen), \
                _scoring_calls(t, calls):
            torch.manual_seed(seed)
            model.train()
            inputs = t._generate_and_score_completions([dict(r) for r in rows])
        batch = self._batch(inputs, seen, rows)
        if self.rloo:
            batch.scored = _rloo_scored(calls, model, reference)
        return batch

    def _batch(self, inputs: dict, seen: dict, rows: list) -> GenerationBatch:
        t = self.trainer
        completion_ids = inputs["completion_ids"]
        device = completion_ids.device
        b, c = completion_ids.shape
        generated = policy_written(t, seen["_generate"], c).to(device)
        rewards_per_func = seen["_calculate_rewards"].float()
        rewards = (rewards_per_func * t.reward_weights.to(rewards_per_func.device).unsqueeze(0)).nansum(dim=1)
        steps = seen["scores"]
        sampler = torch.zeros(b, c, device=device)
        for j in range(min(c, len(steps))):
            logp = steps[j].float().log_softmax(-1).to(device)
            sampler[:, j] = logp.gather(-1, completion_ids[:, j, None]).squeeze(-1)
        sampler = sampler.masked_fill(~generated, 0.0)
        if "sampling_per_token_logps" in inputs:  # a sampler that reports its own log-probs
            sampler = inputs["sampling_per_token_logps"].float()
        return GenerationBatch(inputs, rewards.to(device), generated, sampler, rows,
                               generate_output=copy.deepcopy(seen["_generate"]),
                               rewards_per_func=seen["_calculate_rewards"].detach().clone())

    # -- the protocol's views of the batch -----------------------------------------------------------------------
    def _per_token(self, batch: GenerationBatch, completion: torch.Tensor) -> torch.Tensor:
        return per_token(batch.prompt_len, completion)

    def token_ids(self, batch):
        return torch.cat([batch.inputs["prompt_ids"], batch.inputs["completion_ids"]], dim=1)

    def _attention(self, batch):
        return torch.cat([batch.inputs["prompt_mask"], batch.inputs["completion_mask"]], dim=1)

    def policy_tokens(self, batch):
        prompt = torch.zeros_like(batch.inputs["prompt_ids"], dtype=torch.bool)
        return torch.cat([prompt, batch.generated], dim=1)

    def rewards(self, batch):
        return batch.rewards

    def sampler_log_probs(self, batch):
        return self._per_token(batch, batch.sampler_logps)

    def action_mask(self, batch):
        mask = batch.inputs["completion_mask"]
        if "tool_mask" in batch.inputs:
            mask = mask * batch.inputs["tool_mask"]
        return self._per_token(batch, mask.float())

    def advantages(self, batch):
        adv = batch.inputs["advantages"]
        if adv.dim() != 1:
            raise TRLPreflightError(f"advantages of shape {tuple(adv.shape)}: the preflight checks one per episode")
        return adv

    def _completion_logps(self, model, batch, ids=None):
        if isinstance(model, PeftReference):
            return self._reference_pass(model, batch)["logps"]
        t = self.trainer
        with self._bound(model) as t:
            logps, _, _ = t._get_per_token_logps_and_entropies(
                model, self.token_ids(batch) if ids is None else ids, self._attention(batch),
                batch.inputs["completion_ids"].shape[1], batch_size=t.args.per_device_train_batch_size)
        return logps

    def log_probs(self, model, batch):
        return self._per_token(batch, self._completion_logps(model, batch).float())

    def old_log_probs(self, model, batch):
        if self.rloo:
            return self._per_token(batch, self._rloo_old_per_token(batch).float())
        old = batch.inputs.get("old_per_token_logps")
        if old is None:  # TRL then uses the current log-probs, detached (fully on-policy)
            return self.log_probs(model, batch).detach()
        return self._per_token(batch, old.float())

    def _rloo_old_per_token(self, batch: GenerationBatch) -> torch.Tensor:
        """[B, C]: the old log-probs RLOO's loss uses, per token. Its loss reads the sequence-level ``old_logps``
        (the masked sum of the per-token old log-probs its generation computed); where a row's ``old_logps`` is
        not that sum (a subclass changed it), the difference is spread over the row's completion tokens, so that
        the per-token view sums to what the loss really uses (and keeps its autograd history, if any)."""
        seq = batch.inputs["old_logps"]
        mask = batch.inputs["completion_mask"].to(seq.dtype)
        observed = (batch.scored or {}).get("old")
        if observed is None or observed.shape != mask.shape:
            observed = torch.zeros_like(mask)
        observed = observed.to(seq.dtype)
        gap = seq - (observed * mask).sum(1)
        return observed + (gap / mask.sum(1).clamp(min=1))[:, None] * mask

    def ref_log_probs(self, ref_model, batch):
        """The reference log-probs TRL's generation computed for the batch, as its KL reads them (GRPO's
        ``ref_per_token_logps``; RLOO's, observed in that call, for the reward's KL penalty)."""
        ref = (batch.scored or {}).get("ref") if self.rloo else batch.inputs.get("ref_per_token_logps")
        if ref is None:
            with torch.no_grad():
                return self.log_probs(ref_model, batch)
        return self._per_token(batch, ref.float())

    def logits(self, model, batch):
        if isinstance(model, PeftReference):
            return self._reference_pass(model, batch)["logits"]
        with self._bound(model) as t, t.accelerator.autocast():
            out = model(input_ids=self.token_ids(batch), attention_mask=self._attention(batch))
        return out.logits[:, :-1].float() / t.temperature

    def pad_batch(self, batch, extra):
        inputs = dict(batch.inputs)
        fill = {"completion_ids": self.pad_id}
        for key in ("completion_ids", "completion_mask", "tool_mask", "old_per_token_logps", "ref_per_token_logps",
                    "sampling_per_token_logps", "importance_sampling_ratio"):
            value = inputs.get(key)
            if torch.is_tensor(value) and value.dim() == 2 and value.shape[1] == batch.generated.shape[1]:
                inputs[key] = F.pad(value, (0, extra), value=fill.get(key, 0))
        scored = None if batch.scored is None else {k: F.pad(v, (0, extra)) for k, v in batch.scored.items()}
        return replace(batch, inputs=inputs, generated=F.pad(batch.generated, (0, extra), value=False),
                       sampler_logps=F.pad(batch.sampler_logps, (0, extra), value=0.0), scored=scored)

    def pad_prompts(self, batch, extra):
        """The batch with ``extra`` more columns of prompt padding where TRL puts it: on the left."""
        inputs = dict(batch.inputs)
        inputs["prompt_ids"] = F.pad(inputs["prompt_ids"], (extra, 0), value=self.pad_id)
        inputs["prompt_mask"] = F.pad(inputs["prompt_mask"], (extra, 0), value=0)
        return replace(batch, inputs=inputs, generate_output=None)

    def select_rows(self, batch, rows):
        """The batch restricted to ``rows`` (padding_leak's neighbours, rows_in_step's permutation)."""
        rows = torch.as_tensor(rows)
        inputs = self._rows(batch, rows)
        inputs.pop("num_items_in_batch", None)
        # padded as TRL pads a batch of these rows alone: the prompts' left padding only as wide as they need
        keep = inputs["prompt_mask"].bool().any(0)
        first = int(keep.int().argmax()) if keep.any() else 0
        inputs["prompt_ids"], inputs["prompt_mask"] = inputs["prompt_ids"][:, first:], inputs["prompt_mask"][:, first:]
        return replace(batch, inputs=inputs, rewards=batch.rewards[rows], generated=batch.generated[rows],
                       sampler_logps=batch.sampler_logps[rows], prompt_rows=[batch.prompt_rows[i] for i in rows],
                       generate_output=None,  # a generation replay is of the whole batch only
                       rewards_per_func=None if batch.rewards_per_func is None else batch.rewards_per_func[rows],
                       scored=None if batch.scored is None else {k: v[rows] for k, v in batch.scored.items()})

    def scoring_passes(self, model, batch) -> dict:
        """TRL's own scoring of the batch as training runs it: ``_generate_and_score_completions`` again, its
        generation and rewards replayed, the model in train mode as ``Trainer.train`` leaves it -> the old and
        reference log-probs it computes (those it computes: none when it needs no old log-probs and beta is 0)."""
        if batch.generate_output is None or batch.rewards_per_func is None:
            return {}
        with self._bound(model, self.make_reference(model)) as t, torch.no_grad(), _replaying(t, batch):
            model.train()
            out = t._generate_and_score_completions([dict(r) for r in batch.prompt_rows])
        return {f"TRL's {key}": out[key].float() for key in ("old_per_token_logps", "ref_per_token_logps", "old_logps")
                if torch.is_tensor(out.get(key))}

    def _reference_pass(self, ref: PeftReference, batch: GenerationBatch) -> dict:
        """TRL's own reference pass of a PEFT policy over ``batch``: ``_generate_and_score_completions`` on
        ``ref.policy``, its ``_generate`` and ``_calculate_rewards`` returning what they returned for the batch, so
        that TRL switches the adapter off (``use_adapter``) and computes ``ref_per_token_logps`` as in training.
        -> ``logps`` [B, C] (TRL's) and ``logits`` [B, T-1, V] (the model's, temperature applied, in the adapter
        state of that same call)."""
        if batch.generate_output is None or batch.rewards_per_func is None:
            raise TRLPreflightError("the batch does not hold the generation to replay TRL's reference pass on")
        model = ref.policy
        calls: list = []
        was_training = model.training
        with self._bound(model, None) as t, torch.random.fork_rng(), torch.no_grad(), \
                _replaying(t, batch), _logps_calls(t, calls):
            torch.manual_seed(self.seed)
            model.train()
            try:
                out = t._generate_and_score_completions([dict(r) for r in batch.prompt_rows])
            finally:
                model.train(was_training)
        ref_logps = out.get("ref_per_token_logps")
        found = [logits for logps, logits in calls if logps is ref_logps]
        if ref_logps is None or not found:
            raise TRLPreflightError("TRL's reference log-probs of the PEFT model did not come from "
                                    "_get_per_token_logps_and_entropies: the reference could not be observed")
        return {"logps": ref_logps.float(), "logits": found[-1]}

    # -- loss, backward, update ----------------------------------------------------------------------------------
    def _rows(self, batch: GenerationBatch, rows) -> dict:
        rows = torch.as_tensor(rows)
        b = batch.inputs["prompt_ids"].shape[0]
        out = {}
        for key, value in batch.inputs.items():
            if torch.is_tensor(value) and value.dim() >= 1 and value.shape[0] == b:
                out[key] = value[rows]
            elif isinstance(value, list) and len(value) == b:
                out[key] = [value[i] for i in rows.tolist()]
            else:
                out[key] = value
        mask = out["completion_mask"] * out["tool_mask"] if "tool_mask" in out else out["completion_mask"]
        out["num_items_in_batch"] = mask.sum()
        return out

    def loss(self, model, batch, rows, ref_model=None, term="total"):
        """``_compute_loss`` over ``rows`` in TRL's evaluation mode, which normalises them as one batch (no
        gradient-accumulation scaling). ``term``: the KL term alone (advantages zeroed, no entropy bonus) or the
        entropy bonus alone (advantages zeroed, ``beta`` 0), each as TRL's loss adds it."""
        t = self.trainer
        if term != "total" and self.rloo:  # RLOO's loss is the clipped surrogate alone (see not_applicable)
            return None
        if term == "kl" and t.beta == 0.0 or term == "entropy" and not t._entropy_bonus_enabled:
            return None
        inputs = self._rows(batch, rows)
        if self.rloo:  # its KL to the reference is in the advantages already
            pass
        elif isinstance(ref_model, PeftReference) and t.beta != 0.0:
            inputs["ref_per_token_logps"] = self._reference_pass(ref_model, batch)["logps"][torch.as_tensor(rows)]
        elif ref_model is not None and t.beta != 0.0:
            with torch.no_grad():
                sub = replace(batch, inputs=inputs)
                inputs["ref_per_token_logps"] = self._completion_logps(ref_model, sub)
        if term != "total":
            inputs["advantages"] = torch.zeros_like(inputs["advantages"])
        with self._bound(model) as t:
            if term == "kl":
                t._entropy_bonus_enabled = False
            elif term == "entropy":
                t.beta = 0.0
            was_training = model.training
            model.eval()  # TRL's mode follows trainer.model.training
            try:
                return t._compute_loss(model, inputs)
            finally:
                model.train(was_training)

    def backward(self, model, batch, rows, ref_model=None):
        """One pass over the generation batch through ``training_step``, accumulated as one optimizer step."""
        if sorted(torch.as_tensor(rows).tolist()) != list(range(batch.inputs["prompt_ids"].shape[0])):
            raise ValueError("the TRL adapter accumulates whole generation batches: rows must be every row")
        spg = self.trainer.args.steps_per_generation
        self._micro_steps(model, batch, n_steps=spg, accumulate=spg)

    def update(self, model, optimizer, ref_model, batch):
        """One generation's worth of training: ``steps_per_generation * num_iterations`` micro-steps, an
        optimizer step every ``gradient_accumulation_steps``, as ``transformers.Trainer`` runs them."""
        t = self.trainer
        ratios: list = []
        with _ratio_probe(t, self.trainer_class, ratios):
            self._micro_steps(model, batch, n_steps=self.micro_steps_per_generation,
                              accumulate=t.args.gradient_accumulation_steps, optimizer=optimizer, ref_model=ref_model)
        if not ratios:
            raise TRLPreflightError(f"the trainer's loss never reached {self.trainer_class.__name__}._compute_loss: "
                                    "the PPO ratio of the update could not be measured")
        return {"ratio_max": max(r[0] for r in ratios), "ratio_min": min(r[1] for r in ratios)}

    def _micro_steps(self, model, batch, n_steps, accumulate, optimizer=None, ref_model=_MISSING):
        with self._bound(model, ref_model) as t, torch.random.fork_rng(), _feeding(t, batch):
            torch.manual_seed(self.seed)  # TRL shuffles the generation batch: the same order on every call
            t.optimizer = optimizer
            t._step, t._buffered_inputs = 0, None
            model.train()
            model.zero_grad()
            for step in range(n_steps):
                sync = (step + 1) % accumulate == 0 or step + 1 == n_steps
                t.current_gradient_accumulation_steps = accumulate
                t.accelerator.gradient_state._set_sync_gradients(sync)
                t.training_step(model, [dict(r) for r in batch.prompt_rows], None)
                if sync and optimizer is not None:
                    if t.args.max_grad_norm is not None and t.args.max_grad_norm > 0:
                        t._clip_grad_norm(model)
                    optimizer.step()
                    model.zero_grad()

    # -- checkpoints and short runs ---------------------------------------------------------------------------
    def save(self, model, path):
        with self._bound(model) as t:
            t.save_model(str(path))

    def load(self, path):
        t = self.trainer
        kwargs = dict(t.args.model_init_kwargs or {})
        kwargs.setdefault("dtype", t.model.dtype)
        kwargs.setdefault("attn_implementation", t.model.config._attn_implementation)
        with torch.random.fork_rng():  # PEFT initialises the adapter from the global RNG before loading it
            if self.peft:  # save_model wrote the adapter: load the base model, then the adapter onto it
                from peft import PeftModel

                base = trl_utils.create_model_from_path(self._peft_base_path(), **kwargs)
                model = PeftModel.from_pretrained(base, str(path), is_trainable=True)
            else:
                model = trl_utils.create_model_from_path(str(path), **kwargs)
        if t.args.disable_dropout:
            trl_utils.disable_dropout_in_model(model)
        params = _fused_patch(fused_target(t.model))
        if params is not None:
            trl_utils.add_fused_lm_head(fused_target(model), **params)
        return model

    def run_signature(self, seed, steps):
        """Rewards, losses and gradient norms of ``steps`` real ``trainer.train()`` steps of a fresh trainer
        from the factory (no callbacks but the flow control, nothing saved or reported)."""
        from transformers.trainer_callback import DefaultFlowCallback
        from transformers.trainer_utils import set_seed

        trainer = self.factory()
        with tempfile.TemporaryDirectory() as tmp:
            args = trainer.args
            args.max_steps, args.output_dir, args.logging_steps = steps, tmp, 1
            args.save_strategy, args.eval_strategy, args.push_to_hub = "no", "no", False
            trainer.log_completions = False
            handler = trainer.callback_handler
            handler.callbacks = [cb for cb in handler.callbacks if isinstance(cb, DefaultFlowCallback)]
            set_seed(seed)
            trainer.train()
        keys = ("reward", "loss", "grad_norm", "completions/mean_length")
        return [tuple(row.get(k) for k in keys) for row in trainer.state.log_history if "reward" in row]

    # -- binding the trainer to the suite's copies ------------------------------------------------------------------
    @contextlib.contextmanager
    def _bound(self, model, ref_model=_MISSING):
        t = self.trainer
        saved = {k: t.__dict__.get(k, _MISSING) for k in _BOUND}
        t.model = t.model_wrapped = model
        if ref_model is not _MISSING:  # TRL's PEFT reference is no model: ref_model stays None
            t.ref_model = None if isinstance(ref_model, PeftReference) else ref_model
        t._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}  # the preflight logs nothing
        if "_logs" in t.__dict__:  # nor adds its completions to the trainer's completions table
            t._logs = copy.deepcopy(t.__dict__["_logs"])
        native_amp = t.accelerator.native_amp
        if not self.autocast:
            t.accelerator.native_amp = False  # accelerator.autocast() is then a no-op: float32
        try:
            yield t
        finally:
            t.accelerator.native_amp = native_amp
            for key, value in saved.items():
                if value is _MISSING:
                    t.__dict__.pop(key, None)
                else:
                    t.__dict__[key] = value


def policy_written(trainer, generated_output: tuple, width: int) -> torch.Tensor:
    """bool [B, width]: the completion tokens the sampler wrote and the trainer is meant to train.

    ``generated_output`` is what ``trainer._generate`` returned (its completion ids, and the tool mask of
    multi-turn rollouts: tool-output tokens are not the policy's). Truncated completions are excluded when the
    trainer is configured with ``mask_truncated_completions``: they are deliberately not trained.
    """
    if len(generated_output) == 3:  # RLOOTrainer: (prompt_ids, completion_ids, completions), no tool rollouts
        completion_ids_list, tool_mask_list = generated_output[1], None
    else:  # GRPOTrainer: (prompt_ids, completion_ids, tool_mask, completions, ...)
        _, completion_ids_list, tool_mask_list, *_ = generated_output
    out = torch.zeros(len(completion_ids_list), width, dtype=torch.bool)
    eos_and_pad = [*trainer.eos_token_ids, trainer._tokenizer.pad_token_id]
    for i, ids in enumerate(completion_ids_list):
        n = min(len(ids), width)
        out[i, :n] = True
        if tool_mask_list is not None:
            out[i, :n] &= torch.as_tensor(list(tool_mask_list[i])[:n]).bool()
        if trainer.mask_truncated_completions and ids and ids[-1] not in eos_and_pad:
            out[i] = False
    return out


def per_token(prompt_len: int, completion: torch.Tensor) -> torch.Tensor:
    """[B, C] over the completion -> [B, P+C-1] aligned to ``ids[:, 1:]`` of ``ids = cat(prompt, completion)``
    (zeros over the prompt): TRL's per-token tensors in the layout of rlguard's contracts and checks."""
    b, c = completion.shape[:2]
    out = completion.new_zeros((b, prompt_len + c - 1) + tuple(completion.shape[2:]))
    out[:, prompt_len - 1:] = completion
    return out


def _correspondence(original: torch.nn.Module, copy_: torch.nn.Module) -> dict:
    """``deepcopy`` memo mapping ``original``'s modules, parameters and buffers onto ``copy_``'s."""
    memo: dict = {}
    for (_, a), (_, b) in zip(original.named_modules(remove_duplicate=False),
                              copy_.named_modules(remove_duplicate=False)):
        memo[id(a)] = b
    pairs = zip(list(original.named_parameters(remove_duplicate=False))
                + list(original.named_buffers(remove_duplicate=False)),
                list(copy_.named_parameters(remove_duplicate=False)) + list(copy_.named_buffers(remove_duplicate=False)))
    for (_, a), (_, b) in pairs:
        memo[id(a)] = b
    memo[id(memo)] = [original]  # deepcopy's keep-alive list: the originals outlive the copy
    return memo


@contextlib.contextmanager
def _observe(trainer, name: str, seen: dict):
    """Wrap ``trainer.<name>`` on the instance for one call: its result is kept in ``seen[name]``."""
    bound = getattr(trainer, name)

    def observed(*args, **kwargs):
        result = bound(*args, **kwargs)
        seen[name] = result
        return result

    setattr(trainer, name, observed)
    try:
        yield
    finally:
        trainer.__dict__.pop(name, None)


@contextlib.contextmanager
def _sampler(model, seen: dict):
    """Keep the processed scores of ``model.generate`` (the distribution each sampled token was drawn from)."""
    generate = model.generate
    seen["scores"] = ()

    def generate_with_scores(*args, **kwargs):
        config = kwargs.get("generation_config")
        if config is not None:  # TRL passes one: ask it (a copy) for the scores, not a second set of arguments
            config = copy.deepcopy(config)
            config.output_scores = config.return_dict_in_generate = True
            kwargs["generation_config"] = config
        else:
            kwargs.update(output_scores=True, return_dict_in_generate=True)
        out = generate(*args, **kwargs)
        seen["scores"] = tuple(s.detach() for s in out.scores)
        return out.sequences

    model.generate = generate_with_scores
    try:
        yield
    finally:
        model.__dict__.pop("generate", None)


@contextlib.contextmanager
def _feeding(trainer, batch: GenerationBatch):
    """TRL's ``_prepare_inputs`` runs as in training, but its generation returns ``batch`` (a fresh dict)."""
    trainer._generate_and_score_completions = lambda _rows: dict(batch.inputs)
    try:
        yield
    finally:
        trainer.__dict__.pop("_generate_and_score_completions", None)


@contextlib.contextmanager
def _replaying(trainer, batch: GenerationBatch):
    """TRL's ``_generate`` and ``_calculate_rewards`` return what they returned for ``batch`` (copies)."""
    trainer._generate = lambda *_a, **_k: copy.deepcopy(batch.generate_output)
    trainer._calculate_rewards = lambda *_a, **_k: batch.rewards_per_func.clone()
    try:
        yield
    finally:
        trainer.__dict__.pop("_generate", None)
        trainer.__dict__.pop("_calculate_rewards", None)


@contextlib.contextmanager
def _logps_calls(trainer, calls: list):
    """Each ``_get_per_token_logps_and_entropies`` call -> ``(its log-probs, the model's logits in that call)``:
    the logits are read inside the call, in the adapter state TRL put the model in for it."""
    logps_of = trainer._get_per_token_logps_and_entropies

    def observed(model, input_ids, attention_mask, *args, **kwargs):
        out = logps_of(model, input_ids, attention_mask, *args, **kwargs)
        with trainer.accelerator.autocast():
            logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
        calls.append((out[0], logits[:, :-1].float() / trainer.temperature))
        return out

    trainer._get_per_token_logps_and_entropies = observed
    try:
        yield
    finally:
        trainer.__dict__.pop("_get_per_token_logps_and_entropies", None)


@contextlib.contextmanager
def _scoring_calls(trainer, calls: list):
    """Each ``_get_per_token_logps_and_entropies`` call made with autograd off -> ``(model, its log-probs)``."""
    logps_of = trainer._get_per_token_logps_and_entropies

    def observed(model, *args, **kwargs):
        out = logps_of(model, *args, **kwargs)
        if not torch.is_grad_enabled():
            calls.append((model, out[0]))
        return out

    trainer._get_per_token_logps_and_entropies = observed
    try:
        yield
    finally:
        trainer.__dict__.pop("_get_per_token_logps_and_entropies", None)


def _rloo_scored(calls: list, policy, reference) -> dict:
    """RLOO generation's per-token scorings: its first no-grad pass of the policy is the old log-probs; a pass
    of the reference model (or, for a PEFT policy, the policy's second pass: the adapter off) the reference's."""
    policy_calls = [logps for model, logps in calls if model is policy]
    out = {"old": policy_calls[0]} if policy_calls else {}
    ref_calls = [logps for model, logps in calls if reference is not None and model is reference]
    if ref_calls:
        out["ref"] = ref_calls[0]
    elif isinstance(reference, PeftReference) and len(policy_calls) > 1:
        out["ref"] = policy_calls[1]
    return out


@contextlib.contextmanager
def _ratio_probe(trainer, base: type, ratios: list):
    """Record (max, min) of the PPO ratio each ``base._compute_loss`` call of ``trainer`` uses (``base``: its
    TRL class, ``GRPOTrainer`` or ``RLOOTrainer``).

    The probe sits on ``base`` itself for the duration of the update, so that it sees the inputs the loss
    really gets, after any override of ``_compute_loss`` or ``_prepare_inputs`` in the user's subclass. The
    log-probs are the ones the loss computes (its first call of ``_get_per_token_logps_and_entropies`` with
    autograd on), not a second forward pass.
    """
    original = base.__dict__["_compute_loss"]
    frames: list = []

    def probed(self, model, inputs):
        if self is not trainer:
            return original(self, model, inputs)
        frame = {"inputs": inputs, "logps": None}
        frames.append(frame)
        try:
            return original(self, model, inputs)
        finally:
            frames.pop()
            if frame["logps"] is not None:
                ratios.append(_ratio_range(frame["inputs"], frame["logps"]))

    logps_of = trainer._get_per_token_logps_and_entropies

    def observed_logps(*args, **kwargs):
        out = logps_of(*args, **kwargs)
        if frames and frames[-1]["logps"] is None and torch.is_grad_enabled():
            frames[-1]["logps"] = out[0].detach()
        return out

    base._compute_loss = probed
    trainer._get_per_token_logps_and_entropies = observed_logps
    try:
        yield
    finally:
        base._compute_loss = original
        trainer.__dict__.pop("_get_per_token_logps_and_entropies", None)


def _ratio_range(inputs: dict, logps: torch.Tensor) -> tuple[float, float]:
    mask = inputs["completion_mask"] * inputs["tool_mask"] if "tool_mask" in inputs else inputs["completion_mask"]
    if "old_logps" in inputs:  # RLOO: one ratio per sequence, of the masked sums
        rows = mask.bool().any(1)
        if not rows.any():
            return 1.0, 1.0
        ratio = torch.exp((logps.float() * mask).sum(1) - inputs["old_logps"].detach().float())[rows]
        return float(ratio.max()), float(ratio.min())
    old = inputs.get("old_per_token_logps")
    if old is None or not mask.any():  # TRL then uses logps.detach(): the ratio is exactly 1
        return 1.0, 1.0
    ratio = torch.exp(logps.float() - old.float())[mask.bool()]
    return float(ratio.max()), float(ratio.min())


# ---------------------------------------------------------------------------------------------- configuration


def unsupported_configuration(trainer) -> None:
    """``TRLPreflightError`` for configurations the preflight cannot run faithfully (each names the setting)."""
    t, args = trainer, trainer.args
    problems = []
    if t.accelerator.num_processes > 1 or t.is_deepspeed_enabled or t.is_fsdp_enabled:
        problems.append("more than one process (or DeepSpeed/FSDP): run the preflight in one process")
    if t.use_vllm:
        problems.append("use_vllm=True: the preflight samples with the transformers generation path; set "
                        "use_vllm=False in the trainer it builds")
    if getattr(t, "use_transformers_continuous_batching", False):
        problems.append("use_transformers_continuous_batching=True")
    if getattr(t, "tools", None) or getattr(t, "environment_factories", None) is not None \
            or getattr(t, "rollout_func", None) is not None:
        problems.append("tools, environment_factory or rollout_func (multi-turn rollouts are not supported yet)")
    if getattr(t, "_is_vlm", False):
        problems.append("a vision-language model")
    if is_peft_model(t.model) and unsupported_peft() is not None:
        problems.append(unsupported_peft())
    if is_peft_model(t.model) and any(getattr(c, "is_prompt_learning", False) for c in t.model.peft_config.values()):
        problems.append("a prompt-learning PEFT method (prefix/prompt tuning: only adapters on the model's layers, "
                        "such as LoRA, are supported)")
    if getattr(args, "cast_lm_head_to_fp32", False):
        problems.append("cast_lm_head_to_fp32=True (TRL patches lm_head with a closure over the original module, "
                        "so a copy of the model would run the original's head)")
    if _fused_patch(fused_target(t.model)) is None:
        problems.append("the model has no TRL fused log-prob head (was it replaced after the trainer was built?)")
    if problems:
        raise TRLPreflightError("the TRL preflight does not support " + "; ".join(problems))


# ---------------------------------------------------------------------------------------------- entry points


def load_trainer_factory(spec: str) -> Callable[[], object]:
    """``"module:function"`` -> the function (the current directory first on ``sys.path``, as ``python -m``)."""
    from rlguard.preflight.adapter import import_object

    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"expected MODULE:FUNCTION, e.g. my_script:make_trainer, got {spec!r}")
    factory = import_object(spec)
    if not callable(factory):
        raise TypeError(f"{spec!r} is not callable: it must be a function returning a {SUPPORTED_NAMES}")
    return factory


def adapter_from_factory(factory: Callable[[], object], seed: int = 0) -> GRPOAdapter:
    trainer = factory()
    supported_trainer(trainer, what="trainer the factory returned")
    return GRPOAdapter(trainer, factory=factory, seed=seed)


def preflight(trainer_or_factory, seed: int = 0, only=None, progress=None):
    """Run rlguard's preflight suite on a ``GRPOTrainer`` or ``RLOOTrainer`` (or a function returning one)
    -> ``Report``."""
    from rlguard.preflight.suite import run_suite

    from transformers import Trainer

    if callable(trainer_or_factory) and not isinstance(trainer_or_factory, Trainer):
        adapter = adapter_from_factory(trainer_or_factory, seed=seed)
    else:  # a constructed trainer (UnsupportedTrainerError naming the supported classes if it is another kind)
        adapter = GRPOAdapter(trainer_or_factory, seed=seed)
    return run_suite(adapter, seed=seed, only=only, progress=progress)
