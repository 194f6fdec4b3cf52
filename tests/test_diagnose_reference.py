"""Validation on the reference GRPO trainer: recorded logs of the healthy run and of each fault
(tests/data/diagnose/, written by scripts/record_diagnose_logs.py) -> `rlguard diagnose` names the right cause and
nothing for the healthy runs; the plots in docs/img are drawn from them; the Monitor runs inside the trainer loop."""

from __future__ import annotations

import importlib.util
import json
import warnings
from pathlib import Path

import pytest

from rlguard.diagnose import Monitor, SymptomError, SymptomWarning, diagnose, read_history
from rlguard.diagnose.cli import diagnose_main

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "tests" / "data" / "diagnose"
IMG = ROOT / "docs" / "img"

# run -> (rules expected to fire, the first one being the likeliest cause; its first code or None)
EXPECTED: dict[str, tuple[list[str], str | None]] = {
    "healthy": ([], None),
    "healthy_ent_bonus": ([], None),
    "healthy_varlen": ([], None),
    "mask_shift": (["logp_gap"], "RLG001"),
    "stale_old_logp": (["ratio_stuck_at_one"], "RLG002"),
    "entropy_sign": (["entropy_collapse"], "RLG004"),
    "sign_flip": (["reward_falls"], "RLG005"),
    # The sampler's colder distribution also collapses the policy, as in the chapter (entropy 0.47 -> 0.16,
    # zero_adv_frac -> 1); the gap is named first.
    "sampler_temp": (["logp_gap", "entropy_collapse"], "RLG007"),
    "ref_is_policy": (["kl_ref_zero"], "RLG008"),
    "lr_high": (["approx_kl_early"], None),
    "public_reward": (["reward_hacking"], None),
    # On the variable-length task (failing episodes can grow: a PASSED/FAILED report, then up to 16 probes) the
    # length-biased loss shows as failing episodes growing while passing ones do not, and so does accumulating
    # length-sorted microbatches of 4 episodes each normalised on its own: the same symptom, named by both codes.
    "length_bias": (["length_bias"], "RLG010"),
    "accum_local_varlen": (["length_bias"], "RLG010"),
    # Not visible on the dashboard (docs/diagnose.md, "What the metrics cannot show"): on the default task, whose
    # episode length is fixed by its turns, accumulation over length-sorted microbatches trains almost like the
    # healthy run, as in the chapter; an entropy penalty of 0.001 (the trainer's default ent_coef) changes
    # nothing. Preflight's `accumulation` and `entropy_direction` checks catch them.
    "accum_local": ([], None),
    "entropy_sign_tiny": ([], None),
}
# codes that must be among the first finding's codes (a symptom with more than one possible cause)
ALSO_NAMED: dict[str, str] = {"accum_local_varlen": "RLG006"}


def _record_script():
    spec = importlib.util.spec_from_file_location("record_diagnose_logs", ROOT / "scripts" / "record_diagnose_logs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_recorded_run_has_a_log_and_an_expectation():
    pytest.importorskip("torch")
    runs = _record_script().RUNS
    assert set(runs) == set(EXPECTED)
    for name, (cfg, fault, steps) in runs.items():
        rows = read_history(DATA / f"{name}.jsonl")
        assert len(rows) == steps and rows[0]["kl_coef"] == cfg.kl_coef
    # the chapter's seven faults, a learning rate 10x, the length-biased loss and the public-test reward
    faults = {fault for _, fault, _ in runs.values()}
    assert {"mask_shift", "stale_old_logp", "entropy_sign", "sign_flip", "accum_local", "sampler_temp",
            "ref_is_policy"} <= faults
    configs = {name: cfg for name, (cfg, _, _) in runs.items()}
    assert configs["lr_high"].lr == 10 * configs["healthy"].lr
    assert configs["length_bias"].loss_mode == "seq_mean_token_mean" and configs["public_reward"].reward == "public"
    # the variable-length runs differ from their healthy twin only in the loss mode or the fault
    from dataclasses import replace

    assert configs["length_bias"] == replace(configs["healthy_varlen"], loss_mode="seq_mean_token_mean")
    assert configs["accum_local_varlen"] == configs["healthy_varlen"] and runs["accum_local_varlen"][1] == "accum_local"
    assert configs["healthy_varlen"].task.review_tokens > 0 and configs["healthy"].task.review_tokens == 0


@pytest.mark.parametrize("name", list(EXPECTED))
def test_diagnose_names_the_cause_of_each_recorded_run(name, capsys):
    rules, code = EXPECTED[name]
    code_rc = diagnose_main([str(DATA / f"{name}.jsonl"), "--format", "json"])
    findings = json.loads(capsys.readouterr().out)
    assert [f["rule"] for f in findings] == rules
    assert code_rc == (1 if rules else 0)
    if rules:
        assert findings[0]["codes"][:1] == ([code] if code else [])
        assert findings[0]["steps"] and findings[0]["evidence"]
    if name in ALSO_NAMED:
        assert ALSO_NAMED[name] in findings[0]["codes"]


def test_length_bias_runs_grow_failing_episodes_and_the_healthy_twin_does_not():
    """The numbers behind the length_bias findings: failing episodes' policy tokens, first 4 -> last 4 steps."""
    def growth(name, key):
        values = [row[key] for row in read_history(DATA / f"{name}.jsonl") if row[key] > 0]
        return (sum(values[-4:]) / 4) / (sum(values[:4]) / 4)

    assert growth("healthy_varlen", "length_fail") < 1.15 and growth("healthy_varlen", "thinks") < 1
    for name in ["length_bias", "accum_local_varlen"]:
        assert growth(name, "length_fail") > 1.5 and growth(name, "thinks") > 2  # the probes after the report


def test_learning_rate_and_hacking_are_named_in_words(capsys):
    """The two causes without a catalog code say what they are."""
    for name, cause in [("lr_high", "learning rate too high"), ("public_reward", "reward hacking")]:
        assert diagnose_main([str(DATA / f"{name}.jsonl")]) == 1
        assert cause in capsys.readouterr().out


PLOTS = ["healthy", "sampler_temp", "stale_old_logp", "lr_high", "public_reward", "length_bias"]  # docs/diagnose.md


def test_plots_of_the_recorded_runs_for_the_docs():
    pytest.importorskip("matplotlib")
    from rlguard.diagnose.plot import plot_history

    for name in PLOTS:
        history = read_history(DATA / f"{name}.jsonl")
        report = diagnose(history)
        out = IMG / f"diagnose_{name}.png"
        drawn = plot_history(history, report, out, title=f"reference trainer, {name.replace('_', ' ')}")
        assert out.read_bytes()[:4] == b"\x89PNG" and out.stat().st_size > 30_000
        for symptom in report.symptoms:  # each rule's own curves are on the figure, where its markers go
            assert set(symptom.metrics) & set(drawn), (name, symptom.rule)


# --- the monitor inside the reference trainer's loop (a few small steps) ----------------------------------------

def _small_cfg(**changes):
    torch = pytest.importorskip("torch")
    torch.set_num_threads(1)
    from dataclasses import replace

    from rlguard.reference.trainer import GRPOConfig

    return replace(GRPOConfig(prompts_per_step=4, group_size=4, warm_start_steps=0, n_heldout=8, eval_every=100),
                   **changes)


def test_monitor_stops_the_trainer_when_the_ratio_never_leaves_one():
    from rlguard.reference.trainer import train

    monitor = Monitor(on_symptom="raise")
    with pytest.raises(SymptomError) as err:
        train(_small_cfg(), fault="stale_old_logp", steps=6, on_step=monitor.step)
    assert err.value.step == 2 and err.value.symptom.rule == "ratio_stuck_at_one"  # after 3 steps at ratio 1
    assert len(monitor.history) == 3


def test_monitor_warns_and_logs_inside_the_trainer_loop(tmp_path):
    from rlguard.reference.trainer import train

    cfg = _small_cfg()
    monitor = Monitor(on_symptom="warn", window=10, log_path=tmp_path / "live.jsonl")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history = train(cfg, fault="mask_shift", steps=3, on_step=monitor.step)
    monitor.close()
    alerts = [w for w in caught if issubclass(w.category, SymptomWarning)]
    assert len(alerts) == 1 and "logp_gap RLG001" in str(alerts[0].message)  # once per window, from step 0
    assert [r["step"] for r in read_history(tmp_path / "live.jsonl")] == [r["step"] for r in history] == [0, 1, 2]

    quiet = Monitor(on_symptom="raise", kl_coef=cfg.kl_coef)
    train(cfg, steps=3, on_step=quiet.step)  # the healthy trainer: no alert in its first steps
    assert quiet.alerts == []
