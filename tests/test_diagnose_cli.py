"""`rlguard diagnose` and the live Monitor on synthetic histories."""

from __future__ import annotations

import json
import warnings

import pytest
from test_diagnose_rules import fault, healthy

from rlguard.cli import main as rlguard_main
from rlguard.diagnose import MetricsLogger, Monitor, SymptomError, SymptomWarning, Thresholds, read_history
from rlguard.diagnose.cli import diagnose_main


def _write(tmp_path, rows, name="run.jsonl"):
    path = tmp_path / name
    with MetricsLogger(path) as log:
        for row in rows:
            log(row)
    return str(path)


def test_healthy_log_exits_0_and_lists_what_it_looked_at(tmp_path, capsys):
    assert rlguard_main(["diagnose", _write(tmp_path, healthy())]) == 0
    out = capsys.readouterr().out
    assert "no symptom found in 24 steps" in out
    assert "looked at:" in out and "logp_gap" in out and "zero_adv_frac" in out


def test_fault_log_exits_1_with_json_findings(tmp_path, capsys):
    rows, _ = fault("sampler_temp")
    assert diagnose_main([_write(tmp_path, rows), "--format", "json"]) == 1
    findings = json.loads(capsys.readouterr().out)
    assert [f["rule"] for f in findings] == ["logp_gap", "dead_update"]
    first = findings[0]
    assert set(first) >= {"rule", "codes", "steps", "evidence", "advice"}
    assert first["codes"][0] == "RLG007" and first["steps"][0] == 0 and first["evidence"]["logp_gap_median"] > 1e-4


def test_json_for_a_healthy_log_is_an_empty_list(tmp_path, capsys):
    assert diagnose_main([_write(tmp_path, healthy()), "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out) == []


def test_text_output_names_codes_steps_evidence_and_advice(tmp_path, capsys):
    rows, _ = fault("stale_old_logp")
    assert diagnose_main([_write(tmp_path, rows)]) == 1
    out = capsys.readouterr().out
    assert "ratio_stuck_at_one [RLG002]" in out and "steps: 0-23" in out
    assert "evidence:" in out and "check:" in out and "torch.no_grad" in out


def test_threshold_override_on_the_command_line(tmp_path, capsys):
    rows, _ = fault("sampler_temp")
    path = _write(tmp_path, rows)
    assert diagnose_main([path, "-t", "logp_gap_max=1", "-t", "dead_min_steps=100", "--format", "json"]) == 0
    capsys.readouterr()
    assert diagnose_main([path, "-t", "bogus=1"]) == 2
    assert "bad threshold 'bogus=1'" in capsys.readouterr().err
    assert diagnose_main([path, "-t", "window=x"]) == 2
    assert "not a int" in capsys.readouterr().err


def test_kl_coef_option(tmp_path, capsys):
    rows, _ = fault("ref_is_policy")
    rows = [{k: v for k, v in r.items() if k != "kl_coef"} for r in rows]
    path = _write(tmp_path, rows)
    assert diagnose_main([path, "--kl-coef", "0"]) == 0
    assert diagnose_main([path, "--kl-coef", "0.1"]) == 1
    assert "kl_ref_zero [RLG008]" in capsys.readouterr().out


def test_missing_file_and_malformed_line_exit_2_without_traceback(tmp_path, capsys):
    assert rlguard_main(["diagnose", str(tmp_path / "missing.jsonl")]) == 2
    err = capsys.readouterr().err
    assert "missing.jsonl: no such file" in err and "Traceback" not in err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"step": 0, "reward": 0.1}\n{"step": 1, "reward": 0.2\n')
    assert rlguard_main(["diagnose", str(bad)]) == 2
    err = capsys.readouterr().err
    assert f"{bad}:2: not valid JSON" in err and "Traceback" not in err
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert diagnose_main([str(empty)]) == 2
    assert "no rows" in capsys.readouterr().err


def test_usage_errors_exit_2(capsys):
    assert diagnose_main([]) == 2
    assert diagnose_main(["x.jsonl", "--format", "xml"]) == 2
    assert diagnose_main(["--list-rules", "x"]) == 0
    assert "logp_gap_max = 0.0001" in capsys.readouterr().out


def test_plot_option_writes_a_png(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    rows, _ = fault("entropy_sign")
    out = tmp_path / "sub" / "plot.png"
    assert diagnose_main([_write(tmp_path, rows), "--plot", str(out)]) == 1
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 20_000
    assert f"plot: {out}" in capsys.readouterr().out


def test_csv_log_diagnoses_like_jsonl(tmp_path, capsys):
    rows, _ = fault("mask_shift")
    keys = sorted({k for r in rows for k in r})
    lines = [",".join(keys)] + [",".join(str(r.get(k, "")) for k in keys) for r in rows]
    path = tmp_path / "run.csv"
    path.write_text("\n".join(lines) + "\n")
    assert diagnose_main([str(path), "--format", "json"]) == 1
    assert json.loads(capsys.readouterr().out)[0]["codes"][0] == "RLG001"


# --- the live monitor -------------------------------------------------------------------------------------------

def test_monitor_warns_once_per_rule_per_window(tmp_path):
    rows, _ = fault("mask_shift")
    monitor = Monitor(window=10, log_path=tmp_path / "live.jsonl")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for row in rows:
            monitor.step(row)
    monitor.close()
    alerts = [w for w in caught if issubclass(w.category, SymptomWarning)]
    assert [step for step, _ in monitor.alerts] == [0, 10, 20]  # a gap of 3.7 nats at the only step, then every 10
    assert len(alerts) == 3 and "logp_gap RLG001" in str(alerts[0].message)
    assert len(read_history(tmp_path / "live.jsonl")) == 24


def test_monitor_stays_quiet_on_a_healthy_run():
    monitor = Monitor(on_symptom="raise")
    for row in healthy():
        assert monitor.step(row) == []
    assert monitor.alerts == []


def test_monitor_raise_stops_at_the_first_firing_step():
    rows, _ = fault("stale_old_logp")
    monitor = Monitor(on_symptom="raise")
    with pytest.raises(SymptomError) as err:
        for row in rows:
            monitor.step(row)
    assert err.value.step == 2 and err.value.symptom.codes == ["RLG002"]  # 3 steps = Thresholds.ratio_one_min_steps


def test_monitor_callback_and_thresholds():
    rows, _ = fault("entropy_sign")
    seen = []
    monitor = Monitor(Thresholds(entropy_collapse_frac=0.5), on_symptom=lambda s, step: seen.append((s.rule, step)),
                      window=5)
    for row in rows:
        monitor(row)
    assert seen and seen[0][0] == "entropy_collapse" and all(b - a >= 5 for (_, a), (_, b) in zip(seen, seen[1:]))
    with pytest.raises(ValueError):
        Monitor(on_symptom="shout")
