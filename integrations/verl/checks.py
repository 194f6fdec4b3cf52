"""The contracts at verl's seams, built with ``rlguard.contracts``: one checker per kind of verl function.

verl's math lives in a few functions of ``verl.trainer.ppo.core_algos`` that every trainer path calls: a policy
loss from ``POLICY_LOSS_REGISTRY``, an advantage estimator from ``ADV_ESTIMATOR_REGISTRY``, ``agg_loss`` and
``kl_penalty``. Their tensors are per response token, ``[B, R]`` (B episodes, R response tokens, right-padded
with ``response_mask`` 0), or one value per episode (``[B]``). Each checker below is a ``@contract`` function
whose parameters are the verl function's tensors and whose ``body`` argument is the verl call itself: the
contract checks the inputs, runs the body once, checks what it returned and returns it unchanged.

What is checked (codes from ``rlguard.catalog``):

- policy losses: ``old_log_prob``, ``log_prob``, ``advantages``, ``response_mask`` and ``rollout_is_weights`` all
  ``[B, R]`` (RLG000 naming the argument); no autograd on the old log-probs, the advantages and the IS weights
  (RLG003); finite inputs and a finite scalar loss;
- advantage estimators: the rewards, mask, values, baselines and old log-probs of the call agree in shape; the
  advantages and returns ``[B, R]``, finite, without autograd (RLG003); for the group-relative estimators
  (``GROUP_RELATIVE``, and by default a user's estimator that takes ``index``), each group of ``index`` (verl's
  ``uid``: the samples of one prompt) has mean advantage 0 (RLG009: ``CentredPerIndex``);
- ``agg_loss``: ``loss_mat`` and ``loss_mask`` of one shape, a finite result; ``loss_agg_mode ==
  "seq-mean-token-mean"`` is a per-sequence token mean, noted once (RLG010, information, never raised);
- ``kl_penalty``: ``logprob`` and ``ref_logprob`` of one shape, the reference without autograd (RLG003), a
  finite result.
"""

# No `from __future__ import annotations` here: the checkers' annotations name local markers (``centred``),
# which @contract must see as objects, not as strings to resolve in this module.
import inspect
import math
from typing import Annotated, Any, Optional

import numpy as np
import torch
from jaxtyping import Float
from torch import Tensor

from rlguard.catalog import GROUP_BASELINE, TENSOR_CONTRACT
from rlguard.contracts import Finite, Loss, Mask, NoGrad, contract
from rlguard.contracts.markers import Marker, Probe, eps_of

# Per-token tensors over the response, and one value per episode.
PER_TOKEN = Float[Tensor, "B R"]
PER_EPISODE = Float[Tensor, "B"]
TARGET = Annotated[PER_TOKEN, NoGrad(), Finite()]  # a constant of the loss: no gradient may flow through it

# Estimators whose advantages are centred on each group of ``index``, and how: "sequence" (the mean over the
# group's episodes of each episode's advantage is 0) or "token" (the mean over the group's response tokens is 0:
# OPO's baseline is the length-weighted mean reward). Read from verl 0.9.1's core_algos.
GROUP_RELATIVE = {"grpo": "sequence", "grpo_vectorized": "sequence", "rloo": "sequence",
                  "rloo_vectorized": "sequence", "gpg": "sequence", "opo": "token"}
# verl's estimators that take ``index`` but are not centred per group by design, with the reason (the preflight
# reports its group_mean check as skipped with it).
NOT_GROUP_CENTRED = {
    "gae": "GAE's baseline is the critic's value, and its advantages are whitened over the whole batch",
    "reinforce_plus_plus": "REINFORCE++ whitens the returns over the whole batch (no groups)",
    "reinforce_plus_plus_baseline": "REINFORCE++-baseline subtracts the group mean, then whitens over the whole "
                                    "batch: its groups are not centred after the whitening, by design",
    "remax": "ReMax's baseline is the reward of a greedy rollout of the same prompt, per episode",
    "grpo_passk": "Pass@k gives a non-zero advantage to the best episode of each group only",
    "gdpo": "GDPO normalises each reward per group, then whitens their weighted sum over the whole batch",
    "optimal_token_baseline": "the optimal token baseline is per token, weighted by path variance",
    "tir_optimal_token_baseline": "the optimal token baseline is per token, weighted by path variance",
}
WEIGHTINGS = ("sequence", "token")


def group_weighting(name: str, fn, declared: dict | None = None) -> str | None:
    """How estimator ``name``'s advantages are centred per ``index`` group ("sequence", "token"), or None when
    they are not: the user's declaration first (``install(group_relative={name: ...})``), then verl's own
    estimators as read from its source, then, for an estimator verl does not ship, whether it takes ``index``
    (an estimator is given the groups to compute a group baseline)."""
    if declared and name in declared:
        weighting = declared[name]
        if weighting not in (*WEIGHTINGS, None, False):
            raise ValueError(f"group_relative[{name!r}] must be 'sequence', 'token' or None, got {weighting!r}")
        return weighting or None
    if name in GROUP_RELATIVE:
        return GROUP_RELATIVE[name]
    if name in NOT_GROUP_CENTRED:
        return None
    try:
        return "sequence" if "index" in inspect.signature(fn).parameters else None
    except (TypeError, ValueError):
        return None


def group_codes(index: Any, device: torch.device) -> tuple[torch.Tensor, np.ndarray]:
    """verl's ``index`` (a numpy array of uids, a list, or a tensor) -> (group number of each row [B], the
    distinct labels in group-number order)."""
    if isinstance(index, torch.Tensor):
        labels, inverse = torch.unique(index.detach().reshape(-1).cpu(), return_inverse=True)
        return inverse.to(device), labels.numpy()
    labels, inverse = np.unique(np.asarray(index).reshape(-1), return_inverse=True)
    return torch.from_numpy(inverse.reshape(-1).astype(np.int64)).to(device), labels


class CentredPerIndex(Marker):
    """RLG009 on verl's advantages ``[B, R]`` (or ``[B]``): every group of ``index`` has mean advantage 0.

    verl groups episodes by ``index`` (the ``uid`` of their prompt), in any order and of any size, so the
    groups are read from it rather than from a contiguous ``[P, G]`` layout (``GroupCentred``'s). ``weighting``:
    "sequence" (an episode's advantage is its mean over its response tokens; the group's episodes average to 0)
    or "token" (the group's response tokens average to 0). A group of one episode is skipped: verl gives it no
    baseline by design. Tolerance as ``GroupCentred``'s: ``|mean| <= rtol * max|value|`` over the group, ``rtol``
    sqrt(eps) of the advantages' dtype unless given.
    """

    code = GROUP_BASELINE
    value_check = True

    def __init__(self, index: str = "index", mask: str | None = "response_mask", weighting: str = "sequence",
                 rtol: float | None = None) -> None:
        if weighting not in WEIGHTINGS:
            raise ValueError(f"CentredPerIndex(weighting={weighting!r}): one of {WEIGHTINGS}")
        self.index, self.mask, self.weighting, self.rtol = index, mask, weighting, rtol

    def _bind(self, site) -> None:
        self._ref(site, self.index, "index")
        self._ref(site, self.mask, "mask")

    def probe(self, x: Any, call) -> Probe | Any:
        index = self._get(call, "index")
        if not isinstance(x, torch.Tensor) or index is None or x.numel() == 0 or not x.is_floating_point():
            return None
        if len(index) != x.shape[0]:
            return self._fail(f"index has {len(index)} entries for {x.shape[0]} rows of advantages", x, call,
                              "index must hold one group id (uid) per episode, in the rows' order", TENSOR_CONTRACT)
        stats = self._group_stats(x.detach(), self._get(call, "mask"), index)
        rtol = self.rtol if self.rtol is not None else math.sqrt(eps_of(x.dtype))
        mean, scale, rows = stats["mean"], stats["scale"], stats["rows"]
        bad = ((mean.abs() > scale * rtol) & (rows >= 2)).any()
        return Probe(bad, lambda h: self._explain(x, call, stats, rtol) if h[0] else None)

    def _group_stats(self, x: torch.Tensor, mask: Any, index: Any) -> dict:
        """Per group: the mean advantage (as ``weighting`` says), the largest |advantage|, the number of episodes
        with at least one response token; and the same mean over the whole batch."""
        codes, labels = group_codes(index, x.device)
        rows = x.reshape(x.shape[0], -1)
        if isinstance(mask, torch.Tensor) and mask.numel() == rows.numel():
            masked = rows * mask.detach().reshape(rows.shape).to(rows.dtype)
            row_n = mask.detach().reshape(rows.shape).sum(-1).to(torch.float64)
        else:  # one advantage per episode ([B]), or no mask: every value counts
            masked = rows
            row_n = torch.full((rows.shape[0],), float(rows.shape[1]), dtype=torch.float64, device=x.device)
        # one pass over [B, R], accumulated in float32 (torch's pairwise sums: a few eps of the values, far below
        # the tolerance's sqrt(eps)); the per-row and per-group arithmetic in float64
        accumulate = torch.float64 if x.dtype == torch.float64 else torch.float32
        row_sum = masked.sum(-1, dtype=accumulate).to(torch.float64)
        row_abs = masked.abs().amax(-1).to(torch.float64)
        valid = (row_n > 0).to(torch.float64)
        zeros = row_sum.new_zeros(len(labels))
        if self.weighting == "sequence":  # each episode's mean advantage, each episode counted once
            values, weights = row_sum / row_n.clamp(min=1), valid
        else:  # each episode's token sum, weighed by its token count
            values, weights = row_sum, row_n
        total = zeros.index_add(0, codes, values * valid)
        count = zeros.index_add(0, codes, weights)
        return {"mean": total / count.clamp(min=1e-300), "scale": zeros.scatter_reduce(0, codes, row_abs, "amax"),
                "rows": zeros.index_add(0, codes, valid), "labels": labels,
                "batch_mean": float((values * valid).sum() / weights.sum().clamp(min=1e-300))}

    def _explain(self, x: torch.Tensor, call, stats: dict, rtol: float):
        mean, scale, rows = stats["mean"], stats["scale"], stats["rows"]
        excess = torch.where(rows >= 2, mean.abs() - scale * rtol, torch.full_like(mean, -math.inf))
        g = int(excess.argmax())
        worst_scale = float(scale.max()) if scale.numel() else 0.0
        if abs(stats["batch_mean"]) <= rtol * worst_scale:
            hint = "centred over the whole batch, not per index group (a batch mean instead of each group's)?"
        else:
            hint = "no baseline subtracted per group (advantages = rewards?), or index is not the prompts' uid"
        label = str(stats["labels"][g])
        label = label if len(label) <= 40 else label[:37] + "..."
        return self._fail(
            f"group {label!r} of index ({int(rows[g])} episodes) has mean advantage {float(mean[g]):.4g} "
            f"({self.weighting}-weighted) with max|value| {float(scale[g]):.4g}; every group's mean must be 0 "
            f"(|mean| <= {rtol:.2g} x max|value|); {len(stats['labels'])} groups, batch mean "
            f"{stats['batch_mean']:.4g}", x, call, hint + " see RLG009")


# ---------------------------------------------------------------------------------------------- the checkers
# Each takes the verl function's tensors by name and ``body`` (the verl call), runs it once and returns what it
# returned. ``where`` names the function in messages ("verl policy loss 'vanilla' [rank 1 of 4, role actor]").

def _named(fn, where: str, check_every: int):
    fn.__qualname__ = fn.__name__ = where
    return contract(fn, check_every=check_every, typechecker=None)


def policy_loss_checker(where: str, check_every: int = 1):
    def check(old_log_prob: TARGET, log_prob: Annotated[PER_TOKEN, Finite()], advantages: TARGET,
              response_mask: Mask[Tensor, "B R"], rollout_is_weights: Optional[TARGET] = None,
              body: Any = None) -> tuple[Annotated[Loss, Finite()], Any]:
        return body()

    return _named(check, where, check_every)


def estimator_checker(where: str, weighting: str | None, check_every: int = 1):
    centred = (CentredPerIndex(weighting=weighting),) if weighting else ()

    def check(token_level_rewards: Annotated[PER_TOKEN, Finite()], response_mask: Mask[Tensor, "B R"],
              index: Any = None, values: Optional[Annotated[PER_TOKEN, Finite()]] = None,
              old_log_probs: Optional[TARGET] = None, sum_pi_squared: Optional[PER_TOKEN] = None,
              reward_baselines: Optional[Annotated[PER_EPISODE, Finite()]] = None,
              rollout_is_weights: Optional[TARGET] = None, body: Any = None,
              ) -> tuple[Annotated[(PER_TOKEN, NoGrad(), Finite(), *centred)], TARGET]:
        return body()

    return _named(check, where, check_every)


def agg_loss_checker(where: str, check_every: int = 1):
    def check(loss_mat: Float[Tensor, "*dims"], loss_mask: Mask[Tensor, "*dims"],
              body: Any = None) -> Annotated[Loss, Finite()]:
        return body()

    return _named(check, where, check_every)


def kl_penalty_checker(where: str, check_every: int = 1):
    def check(logprob: Annotated[Float[Tensor, "*dims"], Finite()],
              ref_logprob: Annotated[Float[Tensor, "*dims"], NoGrad(), Finite()],
              body: Any = None) -> Annotated[Float[Tensor, "*dims"], Finite()]:
        return body()

    return _named(check, where, check_every)


# The arguments each checker reads, by verl's parameter names (the estimators' optional ones only when given).
POLICY_LOSS_ARGS = ("old_log_prob", "log_prob", "advantages", "response_mask", "rollout_is_weights")
ESTIMATOR_ARGS = ("token_level_rewards", "response_mask", "index", "values", "old_log_probs", "sum_pi_squared",
                  "reward_baselines", "rollout_is_weights")
AGG_LOSS_ARGS = ("loss_mat", "loss_mask")
KL_PENALTY_ARGS = ("logprob", "ref_logprob")
