"""`rlguard diagnose` on TRL's own logs: a trainer_state.json, its log_history list alone, and JSON lines of
TRL's on_log dicts, read under rlguard's names (eval rows and the end-of-training summary skipped); a metric that
TRL stops logging (NaN written as null) is a report note; bad input is a clear error naming file and line.

The logs are built here the way TRL 1.16's GRPOTrainer writes them (its metric names, transformers' `loss`,
`grad_norm`, `learning_rate`, `epoch`, `step`, eval rows prefixed `eval_`, the summary's `train_*`); the last
test trains a real tiny GRPOTrainer and diagnoses its own log_history."""

from __future__ import annotations

import json
import math
import warnings

import pytest

from rlguard.catalog import REFERENCE_ALIAS
from rlguard.diagnose import METRICS, HistoryError, diagnose, read_history
from rlguard.diagnose.cli import diagnose_main
from rlguard.diagnose.trl_logs import TRL_METRICS, TRL_NOT_LOGGED

STEPS = 24
REWARD_FUNC = "accuracy"


def grpo_entry(step: int, *, kl: float | None = None, reward: float | None = None) -> dict:
    """One training row of GRPOTrainer's log_history (logging_steps=1, beta != 0, loss_type="dapo"): a healthy
    run's trends (reward rises, kl grows from 0 at the first step, entropy falls slowly)."""
    t = step / STEPS
    reward = 0.2 + 0.4 * t if reward is None else reward
    kl = 0.002 * (step - 1) if kl is None else kl
    rewards = {f"rewards/{REWARD_FUNC}/mean": reward, f"rewards/{REWARD_FUNC}/std": 0.3}
    if math.isnan(reward):  # TRL logs a metric that is NaN at every step of the interval as None
        rewards = {key: None for key in rewards}
        reward_std = reward = None
    else:
        reward_std = 0.3
    return {
        "loss": 0.01 * math.sin(step), "grad_norm": 0.3 + 0.02 * (step % 3), "learning_rate": 1e-6 * (1 - t),
        "num_tokens": 900.0 * step, "completions/mean_length": 40.0 + 0.5 * step, "completions/min_length": 12.0,
        "completions/max_length": 64.0, "completions/clipped_ratio": 0.125,
        "completions/mean_terminated_length": 38.0, "completions/min_terminated_length": 12.0,
        "completions/max_terminated_length": 60.0, **rewards, "reward": reward, "reward_std": reward_std,
        "frac_reward_zero_std": 0.25 if step % 2 else 0.125, "kl": kl, "entropy": 1.2 - 0.01 * step,
        "clip_ratio/low_mean": 0.0, "clip_ratio/high_mean": 0.0, "clip_ratio/region_mean": 0.0,
        "clip_ratio/low_min": 0.0, "clip_ratio/high_max": 0.0, "step_time": 2.5, "epoch": t, "step": step,
    }


def eval_entry(step: int) -> dict:
    """An evaluation row: TRL's names prefixed eval_, with transformers' eval_loss and speed metrics."""
    return {"eval_loss": 0.02, "eval_reward": 0.0, "eval_reward_std": 0.0, "eval_kl": 0.0, "eval_entropy": 0.1,
            "eval_completions/mean_length": 3.0, "eval_frac_reward_zero_std": 1.0, "eval_runtime": 1.5,
            "eval_samples_per_second": 10.7, "eval_steps_per_second": 1.3, "epoch": step / STEPS, "step": step}


def summary_entry(flushed: dict | None = None) -> dict:
    """The end-of-training summary (with the metrics TRL flushes into it when the last step was not logged)."""
    return {**(flushed or {}), "train_runtime": 61.2, "train_samples_per_second": 12.5,
            "train_steps_per_second": 0.39, "total_flos": 0.0, "train_loss": 0.004, "epoch": 1.0, "step": STEPS}


def log_history(eval_every: int = 8, **entry) -> list[dict]:
    rows = []
    for step in range(1, STEPS + 1):
        rows.append(grpo_entry(step, **{k: f(step) for k, f in entry.items()}))
        if step % eval_every == 0:
            rows.append(eval_entry(step))
    return rows + [summary_entry()]


def trainer_state(history: list[dict]) -> dict:
    """TrainerState as transformers saves it (the fields around log_history)."""
    return {"best_global_step": None, "best_metric": None, "best_model_checkpoint": None, "epoch": 1.0,
            "eval_steps": 8, "global_step": STEPS, "is_hyper_param_search": False, "is_local_process_zero": True,
            "is_world_process_zero": True, "log_history": history, "logging_steps": 1, "max_steps": STEPS,
            "num_input_tokens_seen": 0, "num_train_epochs": 1, "save_steps": 500, "stateful_callbacks": {},
            "total_flos": 0.0, "train_batch_size": 8, "trial_name": None, "trial_params": None}


def write_state(tmp_path, history: list[dict], name: str = "trainer_state.json") -> str:
    path = tmp_path / name
    # as TrainerState.save_to_json writes it
    path.write_text(json.dumps(trainer_state(history), indent=2, sort_keys=True) + "\n")
    return str(path)


def train_entries(history: list[dict]) -> list[dict]:
    return [e for e in history if "reward" in e or "kl" in e]


def fired(argv, capsys) -> tuple[int, list[dict], str]:
    code = diagnose_main([*argv, "--format", "json"])
    captured = capsys.readouterr()
    return code, json.loads(captured.out), captured.err


# --- the name map ---------------------------------------------------------------------------------------------

def test_the_map_targets_rlguard_names_and_keeps_truncation_apart_from_the_clip():
    assert set(TRL_METRICS.values()) <= set(METRICS)
    assert TRL_METRICS["kl"] == "kl_ref" and TRL_METRICS["clip_ratio/region_mean"] == "clip_frac"
    # TRL's clipped_ratio is the fraction of truncated completions, and its importance-sampling ratio is vLLM's
    # weight pi_old / pi_vllm: neither is the PPO clip or ratio
    assert not {"completions/clipped_ratio", "sampling/importance_sampling_ratio/max"} & set(TRL_METRICS)
    assert set(TRL_NOT_LOGGED) <= set(METRICS)


# --- trainer_state.json ---------------------------------------------------------------------------------------

def test_healthy_grpo_trainer_state_reads_under_rlguard_names_and_has_no_symptom(tmp_path, capsys):
    history = log_history()
    path = write_state(tmp_path, history)
    rows = read_history(path)
    train = train_entries(history)
    assert rows.source == "trl" and [r["step"] for r in rows] == [e["step"] for e in train]
    first = rows[0]
    assert first["kl_ref"] == train[0]["kl"] and first["clip_frac"] == train[0]["clip_ratio/region_mean"]
    assert first["zero_adv_frac"] == train[0]["frac_reward_zero_std"]
    assert first["length"] == train[0]["completions/mean_length"]
    assert first[f"rewards/{REWARD_FUNC}/mean"] == train[0][f"rewards/{REWARD_FUNC}/mean"]  # kept as it is
    assert first["completions/clipped_ratio"] == train[0]["completions/clipped_ratio"]
    assert not any(k.startswith(("eval_", "train_")) for r in rows for k in r)
    assert rows.renamed["kl_ref"] == "kl"

    assert diagnose_main([path]) == 0
    out = capsys.readouterr().out
    assert f"no symptom found in {len(train)} steps" in out and "note:" not in out
    # the rules TRL's log cannot feed are off, each with the reason
    assert f"ratio_stuck_at_one: the log has no ratio_max ({TRL_NOT_LOGGED['ratio_max']})" in out
    assert f"approx_kl_early: the log has no approx_kl ({TRL_NOT_LOGGED['approx_kl']})" in out
    assert f"reward_hacking: the log has no eval_pass ({TRL_NOT_LOGGED['eval_pass']})" in out
    # the rules it feeds run
    report = diagnose(rows)
    assert {"kl_ref_zero", "entropy_collapse", "reward_falls", "dead_update", "non_finite"}.isdisjoint(
        report.disabled)


def test_kl_exactly_zero_with_beta_set_is_the_reference_alias(tmp_path, capsys):
    history = log_history(kl=lambda step: 0.0)  # the reference is the policy: TRL's k3 KL is exactly 0
    path = write_state(tmp_path, history)
    code, findings, _ = fired([path, "--kl-coef", "0.04"], capsys)
    assert code == 1 and findings[0]["rule"] == "kl_ref_zero" and findings[0]["codes"] == [REFERENCE_ALIAS]
    assert findings[0]["steps"] == [e["step"] for e in train_entries(history)]
    assert findings[0]["evidence"]["kl_coef"] == 0.04
    assert diagnose_main([path]) == 1  # without --kl-coef: TRL logs `kl` only when beta != 0
    out = capsys.readouterr().out
    assert f"kl_ref_zero [{REFERENCE_ALIAS}]" in out and "TRL logs kl only when beta != 0" in out
    code, findings, _ = fired([path, "--kl-coef", "0"], capsys)
    assert "kl_ref_zero" not in [f["rule"] for f in findings]


def test_a_healthy_runs_kl_at_zero_on_the_first_step_only_is_not_the_alias(tmp_path, capsys):
    code, findings, _ = fired([write_state(tmp_path, log_history()), "--kl-coef", "0.04"], capsys)
    assert code == 0 and findings == []


def test_a_reward_that_goes_nan_is_null_and_the_report_notes_where_it_stopped(tmp_path, capsys):
    stop = 15
    history = log_history(reward=lambda step: math.nan if step >= stop else 0.2 + 0.01 * step)
    path = write_state(tmp_path, history)
    assert '"reward": null' in (tmp_path / "trainer_state.json").read_text()
    rows = read_history(path)
    late = [e["step"] for e in train_entries(history) if e["step"] >= stop]
    assert rows.nulls["reward"] == late and all("reward" not in r for r in rows if r["step"] >= stop)

    code = diagnose_main([path])
    out = capsys.readouterr().out
    assert code == 0
    (note,) = [line for line in out.splitlines() if line.startswith("  note: ")]
    # one note for the metrics that stop together, those the rules read first
    stopped = ["reward", "reward_std", f"rewards/{REWARD_FUNC}/mean", f"rewards/{REWARD_FUNC}/std"]
    assert note.startswith(f"  note: {stopped[0]}, ") and all(name in note for name in stopped)
    assert f"stopped being logged at step {stop}: null in the {len(late)} row(s)" in note
    assert "TRL logs a metric that is NaN at every step of a logging interval as null" in note
    assert f"see the steps up to {stop - 1} only: " in note and "reward_falls" in note
    assert "reward_hacking" not in note  # off anyway: TRL logs no eval_pass
    assert "kl_ref" not in note  # the other metrics go on

    code, findings, err = fired([path], capsys)  # JSON: stdout stays the list of symptoms, the notes go to stderr
    assert findings == [] and f"rlguard diagnose: {note.strip()}" in err


def test_a_metric_that_stops_appearing_is_noted_but_one_logged_every_few_steps_is_not(tmp_path):
    history = [{"step": s, "reward": 0.1 * s, "eval_pass": 0.5} if s % 4 == 0 else {"step": s, "reward": 0.1 * s}
               for s in range(12)]
    assert diagnose(history).notes == []  # eval_pass: its last silence (9-11) is no longer than its interval
    stopped = [{k: v for k, v in row.items() if k != "reward" or row["step"] < 7} for row in history]
    (note,) = diagnose(stopped).notes
    assert note.startswith("reward stopped being logged at step 7: absent in the 5 row(s)")


def test_eval_rows_and_the_summary_are_not_training_steps(tmp_path):
    history = log_history(eval_every=4)
    # the summary with metrics TRL flushed into it (the last step not a logging step) is skipped as well
    history[-1] = summary_entry(flushed={k: v for k, v in grpo_entry(STEPS).items() if k not in ("loss", "step")})
    # include_num_input_tokens_seen: transformers adds train_* speed metrics to every training row
    for entry in history[:-1]:
        if "reward" in entry:
            entry.update(train_runtime=1.0, train_tokens_per_second=900.0)
    rows = read_history(write_state(tmp_path, history))
    assert len(rows) == len(train_entries(history[:-1])) == STEPS
    assert not any(k.startswith(("eval_", "train_")) for r in rows for k in r)
    report = diagnose(rows)
    assert report.ok and report.notes == []  # a summary read as a row would look like every metric stopping


def test_log_history_list_alone_reads_like_the_trainer_state(tmp_path):
    history = log_history()
    listed = tmp_path / "log_history.json"
    listed.write_text(json.dumps(history, indent=2))
    assert read_history(listed) == read_history(write_state(tmp_path, history))
    one_line = tmp_path / "state_one_line.json"
    one_line.write_text(json.dumps(trainer_state(history)))
    assert read_history(one_line) == read_history(listed)


def test_jsonl_of_on_log_dicts_reads_as_trls_log(tmp_path, capsys):
    history = log_history(kl=lambda step: 0.0)
    path = tmp_path / "on_log.jsonl"
    # on_log receives the logs without "step" (transformers adds it to log_history only)
    path.write_text("".join(json.dumps({k: v for k, v in e.items() if k != "step"}) + "\n" for e in history))
    rows = read_history(path)
    state_rows = read_history(write_state(tmp_path, history))
    assert rows.source == "trl" and len(rows) == len(state_rows)
    assert [r["step"] for r in rows] == list(range(len(rows)))  # the line order, as for any JSONL without step
    assert [{k: v for k, v in r.items() if k != "step"} for r in rows] == \
           [{k: v for k, v in r.items() if k != "step"} for r in state_rows]
    code, findings, _ = fired([str(path), "--kl-coef", "0.1"], capsys)
    assert code == 1 and findings[0]["rule"] == "kl_ref_zero" and findings[0]["codes"] == [REFERENCE_ALIAS]

    with_steps = tmp_path / "on_log_steps.jsonl"
    with_steps.write_text("".join(json.dumps(e) + "\n" for e in history))
    assert read_history(with_steps) == state_rows


def test_rlguard_jsonl_is_not_read_as_trls(tmp_path):
    path = tmp_path / "run.jsonl"
    path.write_text('{"step": 0, "reward": 0.1, "eval_pass": 0.2}\n{"step": 1, "reward": 0.2}\n')
    rows = read_history(path)
    assert rows.source == "jsonl" and rows[0] == {"step": 0, "reward": 0.1, "eval_pass": 0.2}


# --- bad input ------------------------------------------------------------------------------------------------

def _line_of(text: str, token: str) -> int:
    return text[:text.index(token)].count("\n") + 1


def _bad_cases():
    entries = log_history()[:3]
    not_a_dict = json.dumps({"log_history": [entries[0], 12345.5, entries[1]]}, indent=2)
    bad_value = json.dumps({"log_history": [entries[0], {**entries[1], "reward": [0.1, 0.2]}]}, indent=2)
    listed_bad = json.dumps([entries[0], entries[1], ["not", "a", "dict"]], indent=2)
    not_a_list = json.dumps({"global_step": 3, "log_history": {"step": 1}}, indent=2)
    return [
        ("no_log_history", json.dumps({"global_step": 3, "best_metric": None}, indent=2), 1,
         'a JSON object without "log_history"'),
        ("not_a_list", not_a_list, _line_of(not_a_list, '"log_history"'),
         '"log_history" is a JSON object, not a list'),
        ("entry_not_a_dict", not_a_dict, _line_of(not_a_dict, "12345.5"),
         "log_history[1] is a JSON number, not an object"),
        ("bad_value", bad_value, _line_of(bad_value, '"reward": ['), "log_history[1]: value of 'reward' is [0.1, 0.2]"),
        ("list_entry_not_a_dict", listed_bad, _line_of(listed_bad, '"not"') - 1, "entry 2 is a JSON array"),
        ("truncated", json.dumps({"log_history": entries}, indent=2)[:400], None, "not valid JSON"),
        ("a_number", "3.5\n", 1, "expected a JSON object"),
        ("eval_only", json.dumps({"log_history": [eval_entry(8), summary_entry()]}, indent=2), None,
         "no training rows"),
    ]


@pytest.mark.parametrize("name, text, line, message", _bad_cases(), ids=[c[0] for c in _bad_cases()])
def test_bad_trl_logs_name_the_file_and_line_without_a_traceback(tmp_path, capsys, name, text, line, message):
    path = tmp_path / f"{name}.json"
    path.write_text(text)
    with pytest.raises(HistoryError, match=message.replace("[", r"\[").replace("]", r"\]")) as err:
        read_history(path)
    if line is not None:
        assert err.value.line == line and str(err.value).startswith(f"{path}:{line}: ")
    else:
        assert str(err.value).startswith(f"{path}")
    assert diagnose_main([str(path)]) == 2
    captured = capsys.readouterr()
    assert message in captured.err and "Traceback" not in captured.err


def test_a_bad_row_in_trls_jsonl_names_its_line(tmp_path):
    path = tmp_path / "on_log.jsonl"
    path.write_text(json.dumps(grpo_entry(1)) + "\n" + json.dumps({**grpo_entry(2), "kl": True}) + "\n")
    with pytest.raises(HistoryError, match="value of 'kl' is True") as err:
        read_history(path)
    assert err.value.line == 2


# --- a real TRL run -------------------------------------------------------------------------------------------

@pytest.mark.trl
@pytest.mark.slow
def test_a_real_grpo_trainers_log_history_diagnoses(tmp_path, capsys):
    """A tiny GRPOTrainer with its reference set to the policy, and its healthy twin: each state saved as
    trainer_state.json the way transformers saves a checkpoint's, then diagnosed."""
    pytest.importorskip("trl")
    torch = pytest.importorskip("torch")
    import trl_helpers as h  # noqa: PLC0415 - needs torch and TRL

    from rlguard.integrations.trl.callback import TRL_METRICS as CALLBACK_METRICS  # noqa: PLC0415

    assert CALLBACK_METRICS is TRL_METRICS  # the callback and `rlguard diagnose` share one map
    torch.set_num_threads(1)
    fault = h.fault_classes()["ref_is_policy"]
    logs = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name, trainer in (("ref_is_policy", fault.faulty_trainer()), ("healthy", fault.healthy_trainer())):
            trainer.args.max_steps = 4
            trainer.train()
            logs[name] = tmp_path / f"{name}_trainer_state.json"
            trainer.state.save_to_json(str(logs[name]))
            assert [r["step"] for r in read_history(logs[name])] == \
                   [e["step"] for e in trainer.state.log_history if "kl" in e]

    code, findings, _ = fired([str(logs["ref_is_policy"]), "--kl-coef", str(fault.config["beta"])], capsys)
    assert code == 1 and findings[0]["rule"] == "kl_ref_zero" and findings[0]["codes"] == [REFERENCE_ALIAS]
    code, findings, _ = fired([str(logs["healthy"]), "--kl-coef", str(fault.config["beta"])], capsys)
    assert "kl_ref_zero" not in [f["rule"] for f in findings]
