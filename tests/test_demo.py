"""`rlguard demo`: the faults x checks matrix on the reference trainer, computed once for the module."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

from rlguard.preflight.checks import CHECKS  # noqa: E402
from rlguard.preflight.cli import demo_main  # noqa: E402
from rlguard.reference.faults import FAULTS  # noqa: E402

torch.set_num_threads(1)

# Each fault: every check it fails (its expected check first). Anything else failing is a regression.
EXPECTED_FAILS = {
    "mask_shift": {"mask_policy", "padding_invariant"},
    "stale_old_logp": {"old_logp_frozen"},
    "entropy_sign": {"entropy_direction"},
    "sign_flip": {"advantage_direction"},
    "accum_local": {"accumulation"},
    "sampler_temp": {"sampler_logp", "ratio_one"},
    "ref_is_policy": {"kl_positive"},
    "group_mean_batch": {"group_mean"},
    "kl_sign": {"kl_direction"},
    "label_shift": {"labels_shifted", "sampler_logp", "ratio_one"},
    "no_zero_grad": {"grads_zeroed"},
    "trains_frozen": {"frozen_params"},
    # a forward whose rows read each other disagrees with the sampler (which scores each row alone) and with the
    # one-pass loss of other microbatches: inherent, not accidental; rows_in_step skips (neighbours decide)
    "pack_no_mask": {"padding_leak", "sampler_logp", "ratio_one", "accumulation"},
    "pad_is_eos": {"stop_token_trained"},
    "ref_train_mode": {"scoring_eval_mode"},
    # advantages paired with other rows in the accumulated backward: it cannot equal the one-pass gradient
    "rows_out_of_step": {"rows_in_step", "accumulation"},
}


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo")
    rc = demo_main(["--out", str(out), "-q"])
    data = json.loads((out / "matrix.json").read_text())
    data["rc"] = rc
    data["md"] = (out / "matrix.md").read_text()
    return data


def test_matrix_files(matrix):
    assert matrix["checks"] == list(CHECKS)
    assert list(matrix["rows"]) == ["healthy", *FAULTS]
    for row in matrix["rows"].values():
        assert set(row) == {"failed_checks", "lint_codes"}
    assert "| healthy |" in matrix["md"] and "## Verdicts" in matrix["md"]


def test_healthy_passes_every_check(matrix):
    assert matrix["rows"]["healthy"]["failed_checks"] == []


@pytest.mark.parametrize("fault", list(FAULTS))
def test_fault_fails_expected_checks(matrix, fault):
    failed = set(matrix["rows"][fault]["failed_checks"])
    assert FAULTS[fault].expected_check in failed
    assert failed == EXPECTED_FAILS[fault]


def test_expected_table_covers_every_fault():
    assert set(EXPECTED_FAILS) == set(FAULTS)
    for name, fails in EXPECTED_FAILS.items():
        assert FAULTS[name].expected_check in fails


@pytest.mark.parametrize("fault", list(FAULTS))
def test_expected_check_reports_the_fault_code(fault):
    """The check expected to catch a fault reports that fault's own catalog code."""
    check = FAULTS[fault].expected_check
    assert CHECKS[check][1] == FAULTS[fault].code, (fault, check, CHECKS[check][1], FAULTS[fault].code)


def _lint_rules() -> set[str]:
    lint = pytest.importorskip("rlguard.lint", reason="the linter's Python API is not available")
    return set(lint.all_rules())


def test_healthy_trainer_is_lint_clean(matrix):
    _lint_rules()
    assert matrix["rows"]["healthy"]["lint_codes"] == []


@pytest.mark.parametrize("fault", [f.name for f in FAULTS.values() if f.statically_visible])
def test_linter_reports_the_fault_code(matrix, fault):
    code = FAULTS[fault].code
    if code not in _lint_rules():
        pytest.skip(f"the linter has no rule for {code} yet")
    assert code in matrix["rows"][fault]["lint_codes"]


def test_demo_exit_code_reflects_expectations(matrix):
    rows = matrix["rows"]
    lint_ok = all(FAULTS[f].code in rows[f]["lint_codes"] for f in FAULTS if FAULTS[f].statically_visible)
    lint_ok = lint_ok and not rows["healthy"]["lint_codes"]
    assert matrix["rc"] == (0 if lint_ok else 1)
