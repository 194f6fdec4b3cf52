"""Symptom rules over a training history (a list of metric rows, one per step).

Each rule reads the whole history (levels, trends between the first and the last window of steps, comparisons
between metrics) and returns a ``Symptom`` or None. A rule needs some metric names (``Rule.requires``); when one
is missing from the log, that rule alone is disabled, and the report says why (``Report.off_reasons``). Every
threshold is a named field of ``Thresholds`` whose default comes from the healthy ranges of the debugging
chapter's dashboard (seed 000) and the catalog. What is worth knowing about the log but names no fault (a metric
that stops being logged) is a report note, not a symptom (``Report.notes``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from rlguard.catalog import (
    ACCUMULATION_SCALE, ADVANTAGE_SIGN, ENTROPY_BONUS_SIGN, KL_SIGN, LENGTH_BIAS, LOGITS_LABEL_SHIFT,
    MASK_NOT_SHIFTED, OLD_LOGP_RECOMPUTED, REFERENCE_ALIAS, SAMPLER_TRAINER_MISMATCH,
)
from rlguard.diagnose.metrics import finite, is_number


@dataclass(frozen=True)
class Thresholds:
    """Named thresholds of the symptom rules. Healthy references are the chapter's healthy run."""

    # Trend rules compare the mean of the first `window` steps with the mean of the last `window` steps
    # (the chapter's own reading: "first 4 steps -> last 4 steps"), and wait for `min_trend_steps` steps.
    window: int = 4
    min_trend_steps: int = 8

    # logp_gap: sampler and trainer log-probs of the same tokens agree to < 1e-4 in fp32 (healthy: ~1e-8).
    logp_gap_max: float = 1e-4
    # A mean gap above this many nats means the two sides score different tokens (a shift: RLG001/RLG012),
    # not one distribution at another temperature or precision (RLG007, typically 1e-3 .. 0.2).
    logp_gap_misaligned: float = 0.5
    logp_gap_min_steps: int = 2  # steps above logp_gap_max before the rule fires (all steps if fewer logged)

    # ratio_max == 1 and clip_frac == 0 at every step: the ratio never left 1 (healthy ratio_max 1.03 .. 1.3).
    ratio_one_tol: float = 1e-6
    ratio_one_min_steps: int = 3

    # Entropy collapse: the last window's entropy at most this fraction of the first window's (healthy run:
    # 0.53 -> 0.2, a fraction of 0.37; entropy penalty: 0.45 -> 0.03) ...
    entropy_collapse_frac: float = 0.25
    # ... while the groups lose their signal: last-window zero_adv_frac at least this (healthy: 0.3 .. 0.4) ...
    zero_adv_high: float = 0.75
    # ... and the reward has not risen by reward_rise (zero_adv_frac -> 1 because every episode passes is success).
    reward_rise: float = 0.2

    # Reward hacking: reward rises by >= reward_rise while the held-out pass rate falls by >= eval_drop, or
    # does not rise at all while a reward-hacking extra (hack_keys) rises by >= hack_rise (the chapter's
    # public-test reward: reward 0.27 -> 0.97, held-out 0.175 -> 0, hardcode 0.125 -> 0.97).
    eval_drop: float = 0.1
    hack_keys: tuple[str, ...] = ("hardcode",)
    hack_rise: float = 0.2

    # Learning rate too high: approx_kl within the first `early_steps` steps above approx_kl_high. Healthy
    # first steps: 3e-3 (chapter) .. 3e-2 (reference trainer); lr 10x: 0.31 (chapter) .. 0.84 (reference).
    # 0.1 nats/token is 30x the chapter's healthy range and twice the largest usual PPO target_kl (0.05).
    approx_kl_high: float = 0.1
    early_steps: int = 3
    # ... with malformed output rising right after (when logged): its peak within early_steps + window steps
    # >= malformed_rise_factor x step 0 and >= step 0 + malformed_rise_abs (healthy: stays < 0.1).
    malformed_rise_factor: float = 2.0
    malformed_rise_abs: float = 0.1

    # Length bias: failing episodes' length grows by >= length_fail_growth (first -> last window) and by at
    # least length_growth_gap times the growth of passing episodes' length (length bias: 20.8 -> 33.9 while
    # passing 14.3 -> 12.7; healthy 12 turns: 16.1 -> 12.8; reference trainer's variable-length task: 4.6 -> 9.2
    # while passing 3.8 -> 4.1, healthy 4.6 -> 4.9).
    length_fail_growth: float = 1.3
    length_growth_gap: float = 1.3

    # Reward falls: the last window's mean reward at least reward_drop_abs below the first window's and at most
    # (1 - reward_drop_rel) of it (advantages negated: 0.125 -> 0.027; healthy: rises).
    reward_drop_abs: float = 0.05
    reward_drop_rel: float = 0.5

    # KL to the reference with a KL coefficient set: exactly 0 (|kl_ref| <= kl_ref_zero_tol at >= kl_ref_min_steps
    # steps), or, after min_trend_steps, no more than kl_ref_vs_approx_kl x one update's own drift (approx_kl)
    # over the last window. A frozen reference's KL accumulates the drift of every update (chapter KL 0.1:
    # 0.014 -> 0.057 with approx_kl ~4e-4; reference trainer: 0 -> 1.2 with approx_kl ~0.05); a "reference"
    # that is the live policy, or its snapshot at the start of each update, stays at one update's drift.
    kl_ref_zero_tol: float = 1e-10
    kl_ref_min_steps: int = 2
    kl_ref_vs_approx_kl: float = 2.0

    # Dead update: grad_norm at most this at dead_min_steps steps (healthy: 0.15 .. 0.3).
    grad_zero_tol: float = 1e-12
    dead_min_steps: int = 2

    def replace(self, **changes: Any) -> "Thresholds":
        known = {f.name: f for f in fields(self)}
        for name in changes:
            if name not in known:
                raise KeyError(f"unknown threshold {name!r}; known: {', '.join(known)}")
        return Thresholds(**{**asdict(self), **changes})

    @staticmethod
    def parse(assignments: Sequence[str], base: "Thresholds | None" = None) -> "Thresholds":
        """``["logp_gap_max=1e-3", "window=6"]`` -> Thresholds, converting each value to the field's type."""
        base = base or Thresholds()
        types = {f.name: type(getattr(base, f.name)) for f in fields(base)}
        changes: dict[str, Any] = {}
        for text in assignments:
            name, sep, value = text.partition("=")
            name = name.strip()
            if not sep or name not in types:
                raise KeyError(f"bad threshold {text!r}: expected NAME=VALUE with NAME one of {', '.join(types)}")
            kind = types[name]
            if kind is tuple:
                changes[name] = tuple(v.strip() for v in value.split(",") if v.strip())
            else:
                try:
                    changes[name] = kind(float(value)) if kind is int else kind(value)
                except ValueError:
                    raise ValueError(f"bad threshold {text!r}: {value!r} is not a {kind.__name__}") from None
        return base.replace(**changes)


@dataclass
class Symptom:
    rule: str
    codes: list[str]
    steps: list[int]
    evidence: dict[str, Any]
    advice: str
    cause: str = ""  # the likely cause in words (the catalog's name, or e.g. "reward hacking" where no code)
    metrics: tuple[str, ...] = ()  # the metric curves that show it (the plot marks these)

    def to_json(self) -> dict:
        return {"rule": self.rule, "codes": list(self.codes), "steps": list(self.steps),
                "evidence": dict(self.evidence), "advice": self.advice, "cause": self.cause,
                "metrics": list(self.metrics)}


# --- history helpers -------------------------------------------------------------------------------------------

Points = list[tuple[int, float]]


def series(history: Sequence[Mapping[str, Any]], key: str) -> Points:
    """(step, value) of each row that logged ``key`` with a finite number."""
    return [(int(row.get("step", i)), float(row[key])) for i, row in enumerate(history)
            if key in row and finite(row[key])]


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


def ends(points: Points, window: int) -> tuple[float, float, int]:
    """(mean of the first w values, mean of the last w values, w) with w = min(window, len // 2)."""
    w = max(1, min(window, len(points) // 2))
    return _mean([v for _, v in points[:w]]), _mean([v for _, v in points[-w:]]), w


def _g(x: float) -> float:
    """A number rounded to 4 significant digits for the evidence."""
    return float(f"{x:.4g}") if math.isfinite(x) else x


@dataclass(frozen=True)
class Context:
    """What the rules know about the run beyond its metrics."""

    kl_coef: float | None = None
    source: str | None = None  # the log's kind: "trl" for TRL's logs (rlguard.diagnose.log.History.source)


@dataclass(frozen=True)
class Rule:
    name: str
    title: str  # one line: the symptom
    requires: tuple[str, ...]  # metric names the rule cannot run without
    metrics: tuple[str, ...]  # every metric it reads: the required ones and the optional evidence
    check: Callable[[Sequence[Mapping[str, Any]], Thresholds, Context], Symptom | None]


RULES: list[Rule] = []


def rule(name: str, title: str, requires: tuple[str, ...], metrics: tuple[str, ...] | None = None):
    def register(fn):
        RULES.append(Rule(name, title, requires, metrics or requires, fn))
        return fn
    return register


def _enough(points: Points, th: Thresholds) -> bool:
    return len(points) >= th.min_trend_steps


# --- the rules, most specific first (the first symptom of a report is the likeliest root cause) ------------------

@rule("logp_gap", "trainer and sampler log-probs of the same tokens disagree", ("logp_gap",))
def logp_gap_rule(history, th: Thresholds, ctx: Context) -> Symptom | None:
    pts = series(history, "logp_gap")
    if not pts:
        return None
    high = [(s, v) for s, v in pts if v > th.logp_gap_max]
    if len(high) < min(th.logp_gap_min_steps, len(pts)):
        return None
    median = sorted(v for _, v in high)[len(high) // 2]
    misaligned = median > th.logp_gap_misaligned
    if misaligned:
        codes = [MASK_NOT_SHIFTED, LOGITS_LABEL_SHIFT, SAMPLER_TRAINER_MISMATCH]
        cause = "a shift: the trained tokens' log-probs are not the sampled tokens' (mask or logits/labels)"
        advice = ("The gap is nats per token, so the trainer scores other tokens than the sampler did. Check that "
                  "the action mask is aligned to ids[:, 1:] (RLG001) and that logits[:, :-1] are gathered against "
                  "ids[:, 1:] (RLG012); run `rlguard check` for the mask-ownership invariant.")
    else:
        codes = [SAMPLER_TRAINER_MISMATCH, LOGITS_LABEL_SHIFT, MASK_NOT_SHIFTED]
        cause = "sampler-trainer mismatch: old log-probs come from another distribution (temperature, precision)"
        advice = ("The sampler's distribution differs from the trainer's: compare the sampling temperature, top-p/"
                  "top-k and precision with the trainer's, and check logits are divided by the same temperature "
                  "(RLG007). The ratio is then not 1 before the first step.")
    return Symptom("logp_gap", codes, [s for s, _ in high],
                   {"logp_gap_median": _g(median), "logp_gap_max_seen": _g(max(v for _, v in high)),
                    "steps_above": len(high), "steps_logged": len(pts), "threshold": th.logp_gap_max,
                    "misaligned_above": th.logp_gap_misaligned},
                   advice, cause, ("logp_gap", "ratio_max"))


@rule("ratio_stuck_at_one", "the PPO ratio never leaves 1 and nothing is clipped", ("ratio_max", "clip_frac"),
      ("ratio_max", "clip_frac", "ratio_min", "grad_norm"))
def ratio_stuck_rule(history, th: Thresholds, ctx: Context) -> Symptom | None:
    rmax, clip = series(history, "ratio_max"), series(history, "clip_frac")
    rmin = series(history, "ratio_min")
    if len(rmax) < th.ratio_one_min_steps or len(clip) < th.ratio_one_min_steps:
        return None
    if any(abs(v - 1.0) > th.ratio_one_tol for _, v in rmax) or any(v != 0 for _, v in clip):
        return None
    if rmin and any(abs(v - 1.0) > th.ratio_one_tol for _, v in rmin):
        return None
    grad = series(history, "grad_norm")
    evidence = {"ratio_max_range": [_g(min(v for _, v in rmax)), _g(max(v for _, v in rmax))],
                "clip_frac_max": _g(max(v for _, v in clip)), "steps": len(rmax), "tolerance": th.ratio_one_tol}
    if grad:
        evidence["grad_norm_median"] = _g(sorted(v for _, v in grad)[len(grad) // 2])
    return Symptom("ratio_stuck_at_one", [OLD_LOGP_RECOMPUTED], [s for s, _ in rmax], evidence,
                   "Old log-probs are recomputed from the current weights inside the update loop, so every "
                   "minibatch sees ratio 1 and clipping never acts (RLG002): compute old_logp once per batch under "
                   "torch.no_grad() before the epoch loop. (A trainer that takes exactly one optimizer step per "
                   "batch has ratio 1 by construction; then disable this rule.)",
                   "old log-probs recomputed every minibatch", ("ratio_max", "clip_frac"))


@rule("kl_ref_zero", "KL to the reference stays at 0 (or at one update's drift) although a KL coefficient is set",
      ("kl_ref",), ("kl_ref", "kl_coef", "approx_kl", "logp_gap"))
def kl_ref_zero_rule(history, th: Thresholds, ctx: Context) -> Symptom | None:
    kl = series(history, "kl_ref")
    coef = ctx.kl_coef
    if coef is None:
        logged = series(history, "kl_coef")
        coef = max(v for _, v in logged) if logged else None  # None: the chapter logs kl_ref only with a KL term
    if (coef is not None and coef <= 0) or len(kl) < th.kl_ref_min_steps:
        return None
    # TRL's log has no beta, but TRL logs `kl` only when beta != 0: a KL term is known to be set
    unknown = ("not in TRL's log; set, since TRL logs kl only when beta != 0" if ctx.source == "trl"
               else "not logged; assumed set because kl_ref is logged")
    evidence: dict[str, Any] = {"kl_coef": coef if coef is not None else unknown}
    if all(abs(v) <= th.kl_ref_zero_tol for _, v in kl):
        evidence.update(kl_ref_max_abs=_g(max(abs(v) for _, v in kl)), steps=len(kl), tolerance=th.kl_ref_zero_tol)
        steps = [s for s, _ in kl]
    else:
        drift = series(history, "approx_kl")
        if not (_enough(kl, th) and _enough(drift, th)):
            return None
        _, k1, w = ends(kl, th.window)
        _, d1, _ = ends(drift, th.window)
        if k1 > th.kl_ref_vs_approx_kl * d1:
            return None
        gap = dict(series(history, "logp_gap"))
        if any(gap.get(s, 0.0) > th.logp_gap_max for s, _ in drift[-w:]):
            return None  # approx_kl then measures the sampler/trainer gap, not one update's drift
        evidence.update(kl_ref_last=_g(k1), approx_kl_last=_g(d1), kl_ref_vs_approx_kl=th.kl_ref_vs_approx_kl,
                        kl_ref_range=[_g(min(v for _, v in kl)), _g(max(v for _, v in kl))])
        steps = [s for s, _ in kl[-w:]]
    return Symptom("kl_ref_zero", [REFERENCE_ALIAS], steps, evidence,
                   "The KL term compares the policy with itself: the reference is the live policy (ref = model, a "
                   "shallow copy, shared storage, the reference in the optimizer) or its log-probs are recomputed "
                   "from the live weights (RLG008). Build it once with copy.deepcopy(model).eval() and "
                   "requires_grad_(False); a frozen reference's KL grows as training moves away from it.",
                   "the KL reference is the live policy", ("kl_ref", "approx_kl"))


@rule("non_finite", "a metric is NaN or infinite", ())
def non_finite_rule(history, th: Thresholds, ctx: Context) -> Symptom | None:
    bad: dict[str, list[int]] = {}
    for i, row in enumerate(history):
        for key, value in row.items():
            if is_number(value) and not math.isfinite(value):
                bad.setdefault(key, []).append(int(row.get("step", i)))
    if not bad:
        return None
    steps = sorted({s for v in bad.values() for s in v})
    return Symptom("non_finite", [], steps, {"first_step": steps[0], "metrics": {k: len(v) for k, v in bad.items()}},
                   "Look at the first non-finite step: a token mean over an all-zero mask (0/0), log of a zero "
                   "probability, an exploding ratio (learning rate too high), or fp16 overflow.",
                   "numerical blow-up", tuple(bad))


@rule("approx_kl_early", "approx_kl in the first steps one to two orders of magnitude above its healthy range",
      ("approx_kl",), ("approx_kl", "malformed", "entropy", "logp_gap"))
def approx_kl_early_rule(history, th: Thresholds, ctx: Context) -> Symptom | None:
    kl = series(history, "approx_kl")
    early = kl[:th.early_steps]
    high = [(s, v) for s, v in early if v > th.approx_kl_high]
    if not high:
        return None
    gap = dict(series(history, "logp_gap"))
    if any(gap.get(s, 0.0) > th.logp_gap_max for s, _ in high):
        return None  # approx_kl then measures the sampler/trainer gap, not the step size (see logp_gap)
    evidence: dict[str, Any] = {"approx_kl_early": [_g(v) for _, v in early], "threshold": th.approx_kl_high}
    bad = series(history, "malformed")
    if bad:
        start = bad[0][1]
        peak = max(v for _, v in bad[1:th.early_steps + th.window] or bad[:1])
        evidence["malformed"] = [_g(start), _g(peak)]
        if not (peak >= th.malformed_rise_factor * start and peak >= start + th.malformed_rise_abs):
            return None
    ent = series(history, "entropy")
    if len(ent) >= 2:
        first, last, _ = ends(ent, th.window)
        evidence["entropy"] = [_g(first), _g(last)]
    return Symptom("approx_kl_early", [], [s for s, _ in high], evidence,
                   "The first updates move the policy far more than a healthy step (approx_kl ~1e-3): lower the "
                   "learning rate (by 3-10x), add warm-up, or lower max_grad_norm; malformed output rising means the "
                   "policy has forgotten the format.", "learning rate too high", ("approx_kl", "malformed", "entropy"))


@rule("entropy_collapse", "entropy collapses while groups lose their signal (zero_adv_frac -> 1)",
      ("entropy", "zero_adv_frac"), ("entropy", "zero_adv_frac", "reward"))
def entropy_collapse_rule(history, th: Thresholds, ctx: Context) -> Symptom | None:
    ent, zero = series(history, "entropy"), series(history, "zero_adv_frac")
    if not (_enough(ent, th) and _enough(zero, th)):
        return None
    e0, e1, _ = ends(ent, th.window)
    _, z1, _ = ends(zero, th.window)
    if e0 <= 0 or e1 > th.entropy_collapse_frac * e0 or z1 < th.zero_adv_high:
        return None
    evidence: dict[str, Any] = {"entropy": [_g(e0), _g(e1)], "entropy_frac": _g(e1 / e0),
                                "zero_adv_frac_last": _g(z1), "entropy_collapse_frac": th.entropy_collapse_frac,
                                "zero_adv_high": th.zero_adv_high}
    rew = series(history, "reward")
    if len(rew) >= 2:
        r0, r1, _ = ends(rew, th.window)
        evidence["reward"] = [_g(r0), _g(r1)]
        if r1 - r0 >= th.reward_rise:
            return None  # the groups agree because the policy solves the task: convergence, not collapse
    steps = [s for s, v in ent if v <= th.entropy_collapse_frac * e0]
    return Symptom("entropy_collapse", [ENTROPY_BONUS_SIGN], steps, evidence,
                   "The policy turns deterministic without getting better, so every group's samples agree and the "
                   "advantages vanish. Check the entropy term's sign: an entropy bonus must be subtracted from a "
                   "minimised loss (RLG004); also check the sampling temperature.",
                   "policy collapse: an entropy penalty (bonus with the wrong sign), or sampling colder than training",
                   ("entropy", "zero_adv_frac", "reward"))


@rule("reward_hacking", "reward rises while the held-out pass rate falls (or stays flat as a hacking extra rises)",
      ("reward", "eval_pass"),
      ("reward", "eval_pass", "hardcode"))
def reward_hacking_rule(history, th: Thresholds, ctx: Context) -> Symptom | None:
    rew, ev = series(history, "reward"), series(history, "eval_pass")
    if not _enough(rew, th) or len(ev) < 2:
        return None
    r0, r1, _ = ends(rew, th.window)
    e0, e1 = ev[0][1], ev[-1][1]
    if r1 - r0 < th.reward_rise or e1 > e0:
        return None
    evidence: dict[str, Any] = {"reward": [_g(r0), _g(r1)], "eval_pass": [_g(e0), _g(e1)],
                                "reward_rise": th.reward_rise, "eval_drop": th.eval_drop}
    rising = []
    for key in th.hack_keys:
        pts = series(history, key)
        if len(pts) >= 2:
            h0, h1, _ = ends(pts, th.window)
            evidence[key] = [_g(h0), _g(h1)]
            if h1 - h0 >= th.hack_rise:
                rising.append(key)
    if e0 - e1 < th.eval_drop and not rising:
        return None  # held-out flat and no hacking extra rose: not enough to call it hacking
    advice = ("The reward pays for something other than the task: compare what it checks with the held-out "
              "success criterion (public vs hidden tests), and read a few high-reward episodes.")
    if rising:
        advice += f" {', '.join(rising)} rose with the reward: the policy takes that shortcut."
    steps = [s for s, v in ev[1:] if v <= e0 - th.eval_drop] if e0 - e1 >= th.eval_drop else \
        [s for s, v in ev[1:] if v <= e0]
    return Symptom("reward_hacking", [], steps, evidence, advice, "reward hacking",
                   ("reward", "eval_pass", *[k for k in th.hack_keys if series(history, k)]))


@rule("length_bias", "failing episodes grow much longer while passing ones do not", ("length_fail", "length_pass"),
      ("length_fail", "length_pass"))
def length_bias_rule(history, th: Thresholds, ctx: Context) -> Symptom | None:
    fail = series(history, "length_fail")
    # A passing episode has at least one policy token: 0 means no episode passed at that step.
    passing = [(s, v) for s, v in series(history, "length_pass") if v > 0]
    fail = [(s, v) for s, v in fail if v > 0]
    if not (_enough(fail, th) and len(passing) >= 2 * th.window):
        return None
    f0, f1, _ = ends(fail, th.window)
    p0, p1, _ = ends(passing, th.window)
    fail_growth, pass_growth = f1 / f0, p1 / p0
    if fail_growth < th.length_fail_growth or fail_growth < th.length_growth_gap * pass_growth:
        return None
    steps = [s for s, v in fail if v >= th.length_fail_growth * f0]
    return Symptom("length_bias", [LENGTH_BIAS, ACCUMULATION_SCALE], steps,
                   {"length_fail": [_g(f0), _g(f1)], "length_pass": [_g(p0), _g(p1)],
                    "fail_growth": _g(fail_growth), "pass_growth": _g(pass_growth),
                    "length_fail_growth": th.length_fail_growth, "length_growth_gap": th.length_growth_gap},
                   "Tokens of long episodes weigh less in the loss, so failing episodes are punished less per token "
                   "and grow. Check the loss aggregation: one token mean over the whole batch, not a mean of "
                   "per-sequence token means (RLG010), and gradient accumulation that averages per-microbatch "
                   "means (RLG006).", "length-biased loss aggregation", ("length_fail", "length_pass"))


@rule("reward_falls", "reward falls from where it started", ("reward",), ("reward", "eval_pass"))
def reward_falls_rule(history, th: Thresholds, ctx: Context) -> Symptom | None:
    rew = series(history, "reward")
    if not _enough(rew, th):
        return None
    r0, r1, _ = ends(rew, th.window)
    if r0 - r1 < th.reward_drop_abs or r1 > (1 - th.reward_drop_rel) * r0:
        return None
    evidence: dict[str, Any] = {"reward": [_g(r0), _g(r1)], "reward_drop_abs": th.reward_drop_abs,
                                "reward_drop_rel": th.reward_drop_rel}
    ev = series(history, "eval_pass")
    if len(ev) >= 2:
        evidence["eval_pass"] = [_g(ev[0][1]), _g(ev[-1][1])]
    steps = [s for s, v in rew if v <= (1 - th.reward_drop_rel) * r0]
    return Symptom("reward_falls", [ADVANTAGE_SIGN, KL_SIGN], steps, evidence,
                   "The updates push the policy away from rewarded behaviour: check the sign of the advantages and "
                   "of the surrogate (loss = -(ratio * A)), the PPO clip's min/max (RLG005) and the KL term's sign "
                   "(RLG011); `rlguard check` tests that log pi rises where A > 0.",
                   "the update has the wrong sign", ("reward", "eval_pass"))


@rule("dead_update", "grad_norm is 0: the update changes nothing", ("grad_norm",), ("grad_norm", "zero_adv_frac"))
def dead_update_rule(history, th: Thresholds, ctx: Context) -> Symptom | None:
    grad = series(history, "grad_norm")
    dead = [s for s, v in grad if abs(v) <= th.grad_zero_tol]
    if len(dead) < min(th.dead_min_steps, len(grad)) or not dead:
        return None
    zero = dict(series(history, "zero_adv_frac"))
    no_signal = [s for s in dead if zero.get(s) == 1.0]
    evidence: dict[str, Any] = {"dead_steps": len(dead), "steps_logged": len(grad), "tolerance": th.grad_zero_tol}
    if zero:
        evidence["dead_steps_with_zero_adv_frac_1"] = len(no_signal)
    if no_signal and len(no_signal) == len(dead):
        advice = ("Every group's rewards are equal at these steps, so every advantage is 0 and there is no "
                  "gradient: the policy collapsed or the task is out of reach (see the other symptoms).")
    else:
        advice = ("No gradient reaches the weights: check that the loss is not computed on detached tensors, "
                  "that the action mask is not all zero, that the advantages are not all zero, and that the "
                  "optimizer holds the trained parameters.")
    return Symptom("dead_update", [], dead, evidence, advice, "dead update", ("grad_norm", "zero_adv_frac"))


@dataclass
class Report:
    symptoms: list[Symptom]
    looked_at: list[str]  # metric names found in the log
    disabled: dict[str, list[str]] = field(default_factory=dict)  # rule -> the metric names it missed
    steps: int = 0
    off_reasons: dict[str, str] = field(default_factory=dict)  # rule -> why it is off, in words
    notes: list[str] = field(default_factory=list)  # what the report's reader should know: metrics that stop

    @property
    def ok(self) -> bool:
        return not self.symptoms

    def to_json(self) -> list[dict]:
        return [s.to_json() for s in self.symptoms]


@dataclass(frozen=True)
class Stopped:
    """A metric logged at its usual interval up to ``last_step`` and never again from ``first_missing`` on."""

    metric: str
    last_step: int
    first_missing: int
    rows_missing: int
    null: bool  # the rows from first_missing on hold it as null (not merely leave it out)


def _null_steps(history: Sequence[Mapping[str, Any]], nulls: Mapping[str, Sequence[int]]) -> dict[str, set[int]]:
    """metric -> steps where it is null: the reader's record and any None left in the rows themselves."""
    out = {key: set(steps) for key, steps in nulls.items()}
    for i, row in enumerate(history):
        for key, value in row.items():
            if value is None:
                out.setdefault(key, set()).add(int(row.get("step", i)))
    return out


def stopped_metrics(history: Sequence[Mapping[str, Any]],
                    nulls: Mapping[str, Sequence[int]] | None = None) -> list[Stopped]:
    """Metrics that stop being logged before the log ends: logged at >= 2 rows, then missing (absent or null)
    from some row to the last, over more rows than any gap between its earlier values (so a metric logged every
    few steps, such as eval_pass, stops only when its silence outlasts its interval)."""
    last: dict[str, int] = {}  # metric -> index of the last row with a number for it
    widest_gap: dict[str, int] = {}  # metric -> most rows without it between two rows with it
    for i, row in enumerate(history):
        for key, value in row.items():
            if key != "step" and is_number(value):
                if key in last:
                    widest_gap[key] = max(widest_gap.get(key, 0), i - last[key] - 1)
                last[key] = i
    end = len(history) - 1
    candidates = [k for k, i in last.items() if k in widest_gap and end - i > widest_gap[k]]
    if not candidates:
        return []
    steps = [int(row.get("step", i)) for i, row in enumerate(history)]
    null_at = _null_steps(history, nulls or {})
    found = []
    for key in candidates:
        i = last[key]
        null = all(s in null_at.get(key, ()) for s in steps[i + 1:])
        found.append(Stopped(key, steps[i], steps[i + 1], end - i, null))
    return found


def _stopped_notes(stops: Sequence[Stopped], ran: Sequence[Rule], source: str | None,
                   renamed: Mapping[str, str]) -> list[str]:
    """One note per group of metrics that stop together (TRL's reward, reward_std and per-function rewards go null
    at the same step), the metrics the rules read first, and the rules that then see only the earlier steps."""
    groups: dict[tuple, list[Stopped]] = {}
    for stop in stops:
        groups.setdefault((stop.first_missing, stop.last_step, stop.rows_missing, stop.null), []).append(stop)
    read = {m for r in ran for m in r.metrics}
    notes = []
    for (first_missing, last_step, rows_missing, null), group in groups.items():
        group = sorted(group, key=lambda g: g.metric not in read)  # stable: log order within each part
        names = ", ".join(f"{g.metric} (the log's {renamed[g.metric]})" if g.metric in renamed else g.metric
                          for g in group)
        text = (f"{names} stopped being logged at step {first_missing}: {'null' if null else 'absent'} in the "
                f"{rows_missing} row(s) from there to the end")
        if null and source == "trl":
            text += " (TRL logs a metric that is NaN at every step of a logging interval as null)"
        readers = [r.name for r in ran if any(g.metric in r.metrics for g in group)]
        if readers:
            text += (f"; the rules that read {'it' if len(group) == 1 else 'them'} see the steps up to {last_step} "
                     f"only: {', '.join(readers)}")
        notes.append(text)
    return notes


def _off_reason(missing: Sequence[str], reasons: Mapping[str, str], all_null: set[str]) -> str:
    """Why a rule is off: the metrics it needs and does not find, each group with why the log lacks it (when
    known), e.g. "the log has no length_fail, length_pass (TRL does not split completion lengths ...)"."""
    groups: dict[str, list[str]] = {}
    for metric in missing:
        why = "null at every step" if metric in all_null else reasons.get(metric, "")
        groups.setdefault(why, []).append(metric)
    return "the log has " + "; ".join(f"no {', '.join(metrics)}" + (f" ({why})" if why else "")
                                      for why, metrics in groups.items())


def diagnose(history: Sequence[Mapping[str, Any]], thresholds: Thresholds | None = None,
             kl_coef: float | None = None, rules: Sequence[Rule] | None = None) -> Report:
    """Run every rule whose metrics the history has -> Report (symptoms in rule order, likeliest cause first).

    ``history``: rows, or a ``rlguard.diagnose.log.History`` (what ``read_history`` returns), whose ``source``,
    ``nulls``, ``renamed`` and ``missing_reasons`` word the report's notes and the reasons of the rules that are off.
    """
    th = thresholds or Thresholds()
    source = getattr(history, "source", None)
    nulls: Mapping[str, Sequence[int]] = getattr(history, "nulls", {})
    ctx = Context(kl_coef=kl_coef, source=source)
    present = {k for row in history for k, v in row.items() if is_number(v)}  # a key only ever null is not logged
    all_null = set(_null_steps(history, nulls)) - present
    reasons: Mapping[str, str] = getattr(history, "missing_reasons", {})
    active = RULES if rules is None else rules
    symptoms, disabled, off_reasons, ran = [], {}, {}, []
    for r in active:
        missing = [k for k in r.requires if k not in present]
        if missing:
            disabled[r.name] = missing
            off_reasons[r.name] = _off_reason(missing, reasons, all_null)
            continue
        ran.append(r)
        found = r.check(history, th, ctx)
        if found is not None:
            symptoms.append(found)
    notes = _stopped_notes(stopped_metrics(history, nulls), ran, source, getattr(history, "renamed", {}))
    return Report(symptoms, sorted(present - {"step"}), disabled, len(history), off_reasons, notes)
