"""Symptom rules on synthetic histories shaped after the debugging chapter's dashboard (seed 000): its healthy
run's values and each fault's first-4 -> last-4 trajectories. Each rule: fires on its fault, stays quiet on the
healthy run and on a near miss, and is disabled (alone) when a metric it needs is missing."""

from __future__ import annotations

import math
import random

import pytest

from rlguard.diagnose import RULES, Thresholds, diagnose


def ramp(a: float, b: float, n: int) -> list[float]:
    return [a + (b - a) * i / max(n - 1, 1) for i in range(n)]


def noisy(values, scale, seed, lo=None, hi=None):
    rng = random.Random(seed)
    out = [v + rng.gauss(0, scale) for v in values]
    return [min(max(v, lo if lo is not None else -math.inf), hi if hi is not None else math.inf) for v in out]


def healthy(n: int = 24, seed: int = 0, eval_every: int = 8) -> list[dict]:
    """The chapter's healthy run: reward 0.19 -> 0.66, held-out 0.1 -> 0.7, entropy 0.53 -> 0.2, approx_kl 3e-3
    at step 0 then 1e-4 .. 7e-4, ratio_max 1.03 .. 1.27, clip_frac small early then 0, logp_gap ~1e-8."""
    rng = random.Random(seed)
    reward = noisy(ramp(0.19, 0.66, n), 0.03, seed, 0, 1)
    evals = dict(zip(sorted({*range(0, n, eval_every), n - 1}), ramp(0.1, 0.7, len({*range(0, n, eval_every), n - 1}))))
    rows = []
    for t in range(n):
        row = {
            "step": t,
            "reward": reward[t],
            "pass_rate": reward[t],
            "entropy": 0.2 + 0.33 * math.exp(-t / 8) + rng.gauss(0, 0.01),
            "approx_kl": 3.2e-3 if t == 0 else rng.uniform(1e-4, 7e-4),
            "clip_frac": [0.0139, 0.004, 0.001][t] if t < 3 else 0.0,
            "ratio_max": rng.uniform(1.03, 1.27),
            "ratio_min": rng.uniform(0.8, 0.95),
            "grad_norm": rng.uniform(0.155, 0.288),
            "length": rng.uniform(11, 14.4),
            "length_pass": 13.9 - 0.7 * t / n + rng.gauss(0, 0.3),
            "length_fail": 16.1 - 3.3 * t / n + rng.gauss(0, 0.4),
            "zero_adv_frac": rng.choice([0.125, 0.25, 0.375, 0.5]),
            "logp_gap": rng.uniform(7e-9, 5e-8),
            "turns": 3.5 + 0.8 * t / n,
            "reads": 0.3 + 0.8 * t / n,
            "malformed": rng.uniform(0.03, 0.1),
            "hardcode": max(0.0, 0.08 - 0.01 * t),
        }
        if t in evals:
            row["eval_pass"] = evals[t]
        rows.append(row)
    return rows


def with_series(rows, **columns):
    """Rows with some columns replaced (a list per column, or a function of the step)."""
    out = []
    for i, row in enumerate(rows):
        new = dict(row)
        for key, col in columns.items():
            new[key] = col(i) if callable(col) else col[i]
        out.append(new)
    return out


def with_eval(rows, values):
    """Held-out pass rates at the rows that have one, in order."""
    it = iter(values)
    return [dict(r, eval_pass=next(it)) if "eval_pass" in r else r for r in rows]


def fault(name: str) -> tuple[list[dict], dict]:
    """(history, diagnose kwargs) of a fault as the chapter shows it."""
    if name == "mask_shift":
        h = healthy()
        return with_series(h, logp_gap=noisy(ramp(3.75, 3.1, 24), 0.1, 1), ratio_max=ramp(1.23, 2.96, 24),
                           clip_frac=ramp(0.013, 0.044, 24), grad_norm=ramp(0.48, 1.5, 24),
                           entropy=ramp(0.58, 0.8, 24)), {}
    if name == "stale_old_logp":
        h = healthy(seed=2)
        return with_series(h, ratio_max=lambda t: 1.0, ratio_min=lambda t: 1.0, clip_frac=lambda t: 0.0,
                           approx_kl=lambda t: 0.0), {}
    if name == "sampler_temp":
        h = healthy(seed=3)
        h = with_series(h, logp_gap=ramp(0.075, 0.0285, 24), ratio_max=ramp(2.65, 2.96, 24),
                        reward=noisy(ramp(0.227, 0.156, 24), 0.02, 3, 0, 1), entropy=ramp(0.47, 0.156, 24),
                        zero_adv_frac=[min(1.0, 0.28 + 0.05 * t) for t in range(24)],
                        grad_norm=[0.2 if t < 18 else 0.0 for t in range(24)],
                        approx_kl=ramp(0.05, 0.01, 24))
        return with_eval(h, [0.15, 0.15, 0.15, 0.15]), {}
    if name == "sign_flip":
        h = healthy(n=8, seed=4)
        h = with_series(h, reward=noisy(ramp(0.14, 0.02, 8), 0.01, 4, 0, 1), turns=ramp(4.21, 5.48, 8))
        return with_eval(h, [0.1, 0.03]), {}
    if name == "lr_high":
        h = healthy(n=8, seed=5)
        h = with_series(h, approx_kl=[0.3098, 0.0642, 0.0049, 0.0024, 0.0038, 0.0021, 0.0018, 0.0009],
                        malformed=[0.06, 0.5, 0.9, 1.6, 2.2, 2.6, 2.9, 3.0], entropy=ramp(0.417, 1.08, 8),
                        reward=ramp(0.05, 0.0, 8))
        return with_eval(h, [0.1, 0.0]), {}
    if name == "entropy_sign":
        h = healthy(seed=6)
        h = with_series(h, reward=noisy([0.176] * 24, 0.02, 6, 0, 1), entropy=ramp(0.445, 0.0268, 24),
                        zero_adv_frac=ramp(0.344, 0.9, 24))
        return with_eval(h, [0.1, 0.15, 0.2, 0.2]), {}
    if name == "length_bias":
        h = healthy(n=16, seed=7)
        return with_series(h, length_fail=noisy(ramp(20.8, 33.9, 16), 0.5, 7),
                           length_pass=noisy(ramp(14.3, 12.7, 16), 0.3, 8)), {}
    if name == "public_reward":
        h = healthy(seed=8)
        h = with_series(h, reward=noisy(ramp(0.27, 0.97, 24), 0.02, 8, 0, 1), hardcode=ramp(0.125, 0.97, 24),
                        entropy=ramp(0.565, 0.092, 24), zero_adv_frac=ramp(0.3, 0.9, 24))
        return with_eval(h, [0.175, 0.125, 0.025, 0.0]), {}
    if name == "ref_is_policy":
        h = healthy(n=8, seed=9)
        return with_series(h, kl_ref=lambda t: 0.0, kl_coef=lambda t: 0.1), {}
    if name == "dead":
        h = healthy(seed=10)
        return with_series(h, grad_norm=[0.2] * 12 + [0.0] * 12), {}
    raise KeyError(name)


EXPECTED = {  # fault -> the first (likeliest) rule and its first code
    "mask_shift": ("logp_gap", "RLG001"),
    "stale_old_logp": ("ratio_stuck_at_one", "RLG002"),
    "sampler_temp": ("logp_gap", "RLG007"),
    "sign_flip": ("reward_falls", "RLG005"),
    "lr_high": ("approx_kl_early", None),
    "entropy_sign": ("entropy_collapse", "RLG004"),
    "length_bias": ("length_bias", "RLG010"),
    "public_reward": ("reward_hacking", None),
    "ref_is_policy": ("kl_ref_zero", "RLG008"),
    "dead": ("dead_update", None),
}


def fired(report) -> list[str]:
    return [s.rule for s in report.symptoms]


@pytest.mark.parametrize("seed", range(5))
def test_healthy_run_has_no_symptom(seed):
    report = diagnose(healthy(seed=seed))
    assert report.ok, [s.to_json() for s in report.symptoms]
    assert not report.disabled.get("logp_gap") and "reward" in report.looked_at


@pytest.mark.parametrize("name", list(EXPECTED))
def test_fault_names_its_cause_first(name):
    history, kwargs = fault(name)
    report = diagnose(history, **kwargs)
    rule, code = EXPECTED[name]
    assert report.symptoms, f"{name}: nothing fired"
    first = report.symptoms[0]
    assert first.rule == rule, fired(report)
    assert first.codes[:1] == ([code] if code else [])
    assert first.steps and all(isinstance(s, int) for s in first.steps)
    assert first.evidence and first.advice


def test_every_rule_has_a_firing_case():
    covered = {EXPECTED[name][0] for name in EXPECTED}
    assert covered | {"non_finite"} == {r.name for r in RULES}


def test_fault_reports_stay_specific():
    """Each fault fires its own rule and only the symptoms the chapter shows with it."""
    allowed = {"sampler_temp": {"logp_gap", "dead_update"}, "lr_high": {"approx_kl_early"},
               "mask_shift": {"logp_gap"}, "stale_old_logp": {"ratio_stuck_at_one"},
               "entropy_sign": {"entropy_collapse"}, "public_reward": {"reward_hacking"},
               "sign_flip": {"reward_falls"}, "length_bias": {"length_bias"}, "ref_is_policy": {"kl_ref_zero"}}
    for name, ok in allowed.items():
        history, kwargs = fault(name)
        assert set(fired(diagnose(history, **kwargs))) <= ok, (name, fired(diagnose(history, **kwargs)))


# --- near misses: each rule stays quiet just outside its symptom ------------------------------------------------

def test_logp_gap_quiet_below_threshold_and_on_a_single_spike():
    h = with_series(healthy(), logp_gap=lambda t: 5e-5)
    assert "logp_gap" not in fired(diagnose(h))
    spike = with_series(healthy(), logp_gap=lambda t: 0.3 if t == 5 else 1e-8)
    assert "logp_gap" not in fired(diagnose(spike))
    assert "logp_gap" in fired(diagnose(spike, Thresholds(logp_gap_min_steps=1)))


def test_logp_gap_size_orders_the_codes():
    small = diagnose(with_series(healthy(), logp_gap=lambda t: 0.05)).symptoms[0]
    large = diagnose(with_series(healthy(), logp_gap=lambda t: 2.0)).symptoms[0]
    assert small.codes[0] == "RLG007" and large.codes[0] == "RLG001"
    assert set(small.codes) == set(large.codes) == {"RLG001", "RLG007", "RLG012"}


def test_ratio_stuck_quiet_when_one_step_moves_or_clips():
    h, _ = fault("stale_old_logp")
    moved = with_series(h, ratio_max=lambda t: 1.02 if t == 20 else 1.0)
    clipped = with_series(h, clip_frac=lambda t: 0.01 if t == 3 else 0.0)
    assert "ratio_stuck_at_one" not in fired(diagnose(moved))
    assert "ratio_stuck_at_one" not in fired(diagnose(clipped))
    assert "ratio_stuck_at_one" not in fired(diagnose(h[:2]))  # too few steps to say "every step"


def test_entropy_collapse_quiet_when_reward_rises_or_groups_keep_signal():
    h, _ = fault("entropy_sign")
    solving = with_series(h, reward=ramp(0.2, 0.95, 24))  # groups agree because every sample passes
    keeps_signal = with_series(h, zero_adv_frac=lambda t: 0.4)
    mild = with_series(h, entropy=ramp(0.445, 0.2, 24))
    for variant in (solving, keeps_signal, mild):
        assert "entropy_collapse" not in fired(diagnose(variant))


def test_reward_hacking_quiet_when_held_out_rises_with_reward():
    h, _ = fault("public_reward")
    assert "reward_hacking" not in fired(diagnose(with_eval(h, [0.175, 0.4, 0.6, 0.8])))
    hack = diagnose(h).symptoms[0]
    assert hack.evidence["hardcode"][1] > hack.evidence["hardcode"][0]
    assert "hardcode" in hack.advice


def test_approx_kl_early_needs_the_early_steps_and_rising_malformed():
    h, _ = fault("lr_high")
    late = with_series(h, approx_kl=[0.001, 0.001, 0.001, 0.3, 0.06, 0.002, 0.002, 0.001])
    assert "approx_kl_early" not in fired(diagnose(late))
    flat_malformed = with_series(h, malformed=lambda t: 0.06)
    assert "approx_kl_early" not in fired(diagnose(flat_malformed))
    no_malformed = [{k: v for k, v in r.items() if k != "malformed"} for r in h]
    assert "approx_kl_early" in fired(diagnose(no_malformed))  # approx_kl alone when malformed is not logged


def test_approx_kl_early_defers_to_logp_gap():
    """With old log-probs from another distribution, approx_kl measures the gap, not the step size."""
    h, _ = fault("lr_high")
    gapped = with_series(h, logp_gap=lambda t: 0.05)
    assert fired(diagnose(gapped))[0] == "logp_gap"
    assert "approx_kl_early" not in fired(diagnose(gapped))


def test_length_bias_quiet_when_both_lengths_grow_together():
    h, _ = fault("length_bias")
    both = with_series(h, length_pass=ramp(14.3, 23.0, 16))
    no_pass = with_series(h, length_pass=lambda t: 0.0)  # nothing passed: no comparison possible
    assert "length_bias" not in fired(diagnose(both))
    assert "length_bias" not in fired(diagnose(no_pass))


def test_reward_falls_quiet_on_noise_and_small_drops():
    h = with_series(healthy(), reward=noisy([0.3] * 24, 0.03, 11, 0, 1))
    assert "reward_falls" not in fired(diagnose(h))
    h2 = with_series(healthy(), reward=ramp(0.227, 0.156, 24))  # the sampler_temp drift: -30%, not -50%
    assert "reward_falls" not in fired(diagnose(h2))


def test_kl_ref_zero_needs_a_kl_coefficient():
    h, _ = fault("ref_is_policy")
    no_kl = with_series(h, kl_coef=lambda t: 0.0)
    assert "kl_ref_zero" not in fired(diagnose(no_kl))
    assert "kl_ref_zero" in fired(diagnose(no_kl, kl_coef=0.1))  # the caller says a KL term is set
    assert "kl_ref_zero" not in fired(diagnose(h, kl_coef=0.0))
    working = with_series(h, kl_ref=ramp(0.0, 0.057, 8))  # healthy KL 0.1: starts at 0, then grows
    assert "kl_ref_zero" not in fired(diagnose(working))
    unknown = [{k: v for k, v in r.items() if k != "kl_coef"} for r in h]  # the chapter logs kl_ref only with KL
    s = diagnose(unknown).symptoms[0]
    assert s.rule == "kl_ref_zero" and "assumed" in str(s.evidence["kl_coef"])


def test_dead_update_quiet_on_one_zero_step_and_names_missing_signal():
    one = with_series(healthy(), grad_norm=lambda t: 0.0 if t == 7 else 0.2)
    assert "dead_update" not in fired(diagnose(one))
    h, _ = fault("dead")
    no_signal = with_series(h, zero_adv_frac=lambda t: 1.0 if t >= 12 else 0.25)
    s = diagnose(no_signal).symptoms[0]
    assert s.steps == list(range(12, 24)) and "advantage is 0" in s.advice
    assert "detached" in diagnose(h).symptoms[0].advice


def test_non_finite_metrics_fire_and_name_the_step():
    h = with_series(healthy(), grad_norm=lambda t: math.nan if t >= 5 else 0.2)
    s = [s for s in diagnose(h).symptoms if s.rule == "non_finite"][0]
    assert s.steps[0] == 5 and s.evidence["metrics"] == {"grad_norm": 19}


# --- missing metrics disable only the rules that need them -------------------------------------------------------

@pytest.mark.parametrize("name", list(EXPECTED))
def test_missing_key_disables_only_rules_that_need_it(name):
    history, kwargs = fault(name)
    full = {s.rule: s.to_json() for s in diagnose(history, **kwargs).symptoms}
    rule = next(r for r in RULES if r.name == EXPECTED[name][0])
    for key in rule.requires:
        dropped = [{k: v for k, v in row.items() if k != key} for row in history]
        report = diagnose(dropped, **kwargs)
        got = {s.rule: s.to_json() for s in report.symptoms}
        assert rule.name not in got and key in report.disabled[rule.name]
        for other in RULES:
            if key in other.requires:
                assert other.name in report.disabled
            elif key not in other.metrics:  # rules that never read the key: same result as before
                assert got.get(other.name) == full.get(other.name), (key, other.name)


def test_chapter_log_without_optional_metrics_still_reads():
    """A log with only a few of the chapter's columns runs the rules it can and lists the rest as off."""
    h = [{"step": r["step"], "reward": r["reward"], "logp_gap": 2.0} for r in healthy()]
    report = diagnose(h)
    assert fired(report) == ["logp_gap"]
    assert report.disabled["ratio_stuck_at_one"] == ["ratio_max", "clip_frac"]
    assert "reward_falls" not in report.disabled


# --- thresholds --------------------------------------------------------------------------------------------------

def test_thresholds_are_overridable():
    h, _ = fault("sampler_temp")
    assert "logp_gap" not in fired(diagnose(h, Thresholds(logp_gap_max=1.0)))
    th = Thresholds.parse(["logp_gap_max=1", "window=6", "hack_keys=hardcode,exploit"])
    assert th.logp_gap_max == 1.0 and th.window == 6 and th.hack_keys == ("hardcode", "exploit")
    with pytest.raises(KeyError):
        Thresholds.parse(["no_such=1"])
    with pytest.raises(ValueError):
        Thresholds.parse(["window=abc"])


def test_kl_ref_that_never_accumulates_fires_like_an_exact_zero():
    """A reference snapshotted from the live policy at each update: kl_ref stays at one update's drift."""
    h, _ = fault("ref_is_policy")
    h = healthy(n=16, seed=12)
    snapshot = with_series(h, kl_coef=lambda t: 0.02, approx_kl=lambda t: 0.05,
                           kl_ref=noisy([-0.03] * 16, 0.02, 12))
    s = diagnose(snapshot).symptoms[0]
    assert s.rule == "kl_ref_zero" and s.steps == list(range(12, 16)) and s.evidence["approx_kl_last"] == 0.05
    frozen = with_series(snapshot, kl_ref=ramp(0.0, 1.2, 16))  # a frozen reference: KL grows past the drift
    assert "kl_ref_zero" not in fired(diagnose(frozen))
    assert "kl_ref_zero" not in fired(diagnose(snapshot[:7]))  # too early to call a trend


def test_reward_hacking_with_flat_held_out_needs_a_rising_hack_extra():
    """The base policy passes nothing held-out, so it cannot fall: reward up, held-out flat at 0, hardcode up."""
    h, _ = fault("public_reward")
    flat = with_eval(h, [0.0, 0.0, 0.0, 0.0])
    s = diagnose(flat).symptoms[0]
    assert s.rule == "reward_hacking" and s.evidence["eval_pass"] == [0.0, 0.0]
    no_hack = with_series(flat, hardcode=lambda t: 0.05)
    assert "reward_hacking" not in fired(diagnose(no_hack))  # flat held-out alone is not hacking
    assert "reward_hacking" in fired(diagnose(with_series(h, hardcode=lambda t: 0.05)))  # a held-out fall is


def test_approx_kl_early_reads_the_malformed_spike_right_after_the_jump():
    """A run that recovers: malformed jumps in the steps after the big update, then falls back."""
    h, _ = fault("lr_high")
    recovered = with_series(h, malformed=[0.004, 1.14, 0.65, 0.39, 0.14, 0.09, 0.07, 0.05])
    assert fired(diagnose(recovered))[0] == "approx_kl_early"
    healthy_kl = with_series(recovered, approx_kl=[0.03, 0.014, 0.005, 0.007, 0.007, 0.003, 0.005, 0.009])
    assert "approx_kl_early" not in fired(diagnose(healthy_kl))  # the reference trainer's healthy first steps


def test_kl_ref_drift_comparison_defers_to_logp_gap():
    h = with_series(healthy(n=16, seed=13), kl_coef=lambda t: 0.02, kl_ref=ramp(0.0, 0.07, 16),
                    approx_kl=lambda t: 38.0, logp_gap=lambda t: 8.6)  # the shifted mask's approx_kl
    assert fired(diagnose(h)) == ["logp_gap"]
