"""One dashboard row per training step, with the debugging chapter's metric names.

``step_row`` turns a step's sampled episodes (rewards, action masks, pass flags, turns) and the update's
statistics into a flat ``{name: float}`` row that ``rlguard diagnose`` reads. Inputs may be torch tensors,
numpy arrays or plain lists; torch is never imported here.

The names (the chapter's taxonomy) are fixed so that a log written by the chapter's own ``log_metrics`` reads
directly; ``METRICS`` documents each one.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

# name -> what it is and a healthy run's range (the chapter's healthy run, 24 steps, group size 8).
METRICS: dict[str, str] = {
    "step": "the training step (0-based); rows are ordered by it",
    "reward": "mean reward of the step's sampled episodes (healthy: rises, 0.19 -> 0.66)",
    "pass_rate": "fraction of sampled episodes that pass the hidden (true) check",
    "eval_pass": "held-out pass rate, logged every few steps (healthy: rises with reward, 0.1 -> 0.7)",
    "entropy": "mean per-token policy entropy on trained tokens, nats (healthy: falls slowly, 0.53 -> 0.2)",
    "approx_kl": "mean KL(old || new) estimate over the update's minibatches (healthy: 1e-4 .. 3e-3)",
    "clip_frac": "fraction of trained tokens whose ratio was clipped (healthy: small, nonzero early)",
    "ratio_max": "largest pi/pi_old ratio seen in the update (healthy: 1.03 .. 1.3)",
    "ratio_min": "smallest pi/pi_old ratio seen in the update (healthy: 0.7 .. 0.97)",
    "grad_norm": "gradient norm before clipping, mean over optimizer steps (healthy: 0.15 .. 0.3)",
    "length": "policy tokens per episode (sum of the action mask per episode, mean)",
    "length_pass": "policy tokens per passing episode (0 when no episode passed)",
    "length_fail": "policy tokens per failing episode (0 when every episode passed)",
    "zero_adv_frac": "fraction of groups whose rewards are all equal: no learning signal (healthy: 0 .. 0.6)",
    "logp_gap": "mean |trainer log-prob - sampler log-prob| on trained tokens (healthy fp32: ~1e-8)",
    "kl_ref": "KL to the frozen reference policy (0 when no KL term; grows from 0 when one is set)",
    "kl_coef": "the KL coefficient of the run (a config scalar; lets the kl_ref rule know a KL term is set)",
    "turns": "environment turns per episode",
    "reads": "extra (task-specific): read actions per episode",
    "malformed": "extra (task-specific): malformed / invalid actions per episode (healthy: < 0.2)",
    "hardcode": "extra (task-specific): fraction of episodes that take the reward-hacking shortcut",
}

# Update statistics copied from the trainer's stats dict when present.
UPDATE_KEYS = ("entropy", "approx_kl", "clip_frac", "ratio_max", "ratio_min", "grad_norm", "logp_gap", "kl_ref",
               "loss")


def _as_list(x: Any) -> list:
    """A flat Python list from a tensor, array, scalar or nested sequence."""
    if x is None:
        return []
    if hasattr(x, "detach"):  # torch tensor
        x = x.detach().cpu()
    if hasattr(x, "tolist"):
        x = x.tolist()
    if isinstance(x, (int, float, bool)):
        return [x]
    out: list = []
    for item in x:
        out.extend(_as_list(item) if isinstance(item, (list, tuple)) or hasattr(item, "tolist") else [item])
    return out


def _rows(x: Any) -> list[list[float]]:
    """A list of per-episode rows from a [B, T] tensor/array or a list of per-episode sequences."""
    if hasattr(x, "detach"):
        x = x.detach().cpu()
    if hasattr(x, "tolist"):
        x = x.tolist()
    return [[float(v) for v in _as_list(row)] for row in x]


def scalar(x: Any) -> float:
    """A Python float from a number, 0-d tensor or 1-element array."""
    if hasattr(x, "detach"):
        x = x.detach().cpu()
    if hasattr(x, "item"):
        return float(x.item())
    return float(x)


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def step_row(
    step: int,
    rewards: Any,
    *,
    group_size: int | None = None,
    passed: Any = None,
    action_mask: Any = None,
    lengths: Any = None,
    turns: Any = None,
    update: Mapping[str, Any] | None = None,
    trainer_logp: Any = None,
    sampler_logp: Any = None,
    eval_pass: float | None = None,
    episodes: Any = None,
    extras: Callable[[Any], Mapping[str, Any]] | Mapping[str, Any] | None = None,
    config: Mapping[str, Any] | None = None,
) -> dict[str, float]:
    """One step's flat metrics row.

    ``rewards`` [B]: one reward per sampled episode, groups of ``group_size`` contiguous (``zero_adv_frac``
    needs ``group_size``). ``passed`` [B]: bool per episode (true task success, not the reward; gives
    ``pass_rate``, ``length_pass``, ``length_fail``). ``action_mask`` [B, T-1] (policy tokens; its row sums are
    the episode lengths) or ``lengths`` [B]. ``turns`` [B]. ``update``: the update's statistics (any of
    ``UPDATE_KEYS`` and any other numeric entries, copied as they are). ``trainer_logp`` and ``sampler_logp``
    [B, T-1] with ``action_mask``: computes ``logp_gap`` unless ``update`` has it. ``eval_pass``: held-out pass
    rate when evaluated this step. ``extras``: a callback ``extras(episodes) -> {name: number}`` (or a ready
    dict) for task-specific metrics such as ``reads``, ``malformed``, ``hardcode``. ``config``: run scalars to
    record, e.g. ``{"kl_coef": 0.1}``.
    """
    r = [float(v) for v in _as_list(rewards)]
    if not r:
        raise ValueError("step_row: rewards is empty")
    n = len(r)
    row: dict[str, float] = {"step": int(step), "reward": _mean(r)}
    if group_size:
        if n % group_size:
            raise ValueError(f"step_row: {n} rewards do not split into groups of {group_size}")
        groups = [r[i:i + group_size] for i in range(0, n, group_size)]
        row["zero_adv_frac"] = sum(max(g) == min(g) for g in groups) / len(groups)

    lens: list[float] | None = None
    mask_rows = _rows(action_mask) if action_mask is not None else None
    if mask_rows is not None:
        lens = [sum(m) for m in mask_rows]
    elif lengths is not None:
        lens = [float(v) for v in _as_list(lengths)]
    if lens is not None:
        if len(lens) != n:
            raise ValueError(f"step_row: {len(lens)} episode lengths for {n} rewards")
        row["length"] = _mean(lens)

    if passed is not None:
        p = [bool(v) for v in _as_list(passed)]
        if len(p) != n:
            raise ValueError(f"step_row: {len(p)} pass flags for {n} rewards")
        row["pass_rate"] = sum(p) / n
        if lens is not None:
            row["length_pass"] = _mean([ln for ln, ok in zip(lens, p) if ok])
            row["length_fail"] = _mean([ln for ln, ok in zip(lens, p) if not ok])

    if turns is not None:
        row["turns"] = _mean([float(v) for v in _as_list(turns)])

    for key, value in (update or {}).items():
        try:
            row[key] = scalar(value)
        except (TypeError, ValueError):
            continue  # non-numeric stats (names, lists) are not dashboard metrics

    if "logp_gap" not in row and trainer_logp is not None and sampler_logp is not None:
        if mask_rows is None:
            raise ValueError("step_row: logp_gap needs action_mask with trainer_logp and sampler_logp")
        gaps = [abs(a - b) for ta, sa, m in zip(_rows(trainer_logp), _rows(sampler_logp), mask_rows)
                for a, b, keep in zip(ta, sa, m) if keep > 0]
        row["logp_gap"] = _mean(gaps)

    if eval_pass is not None:
        row["eval_pass"] = scalar(eval_pass)

    if extras is not None:
        got = extras(episodes) if callable(extras) else extras
        for key, value in dict(got).items():
            if key in row:
                raise ValueError(f"step_row: extra {key!r} would overwrite a built-in metric")
            row[key] = scalar(value)

    for key, value in (config or {}).items():
        row.setdefault(key, scalar(value))
    return row


def is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def finite(x: Any) -> bool:
    return is_number(x) and math.isfinite(x)


def keys_of(history: Iterable[Mapping[str, Any]]) -> list[str]:
    """Every metric name that appears in a history, in first-seen order."""
    seen: dict[str, None] = {}
    for row in history:
        for key in row:
            seen.setdefault(key, None)
    return list(seen)
