"""The adapter hooks for framework integrations: ``not_applicable()`` (checks skipped with a reason) and
``copy_model`` (how the suite copies a model), on the class-based example trainer."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from rlguard.preflight.report import markdown, table  # noqa: E402
from rlguard.preflight.suite import TrainerError, run_suite  # noqa: E402

torch.set_num_threads(1)
EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
if str(EXAMPLES) not in sys.path:
    sys.path.insert(0, str(EXAMPLES))

ONLY = ["mask_policy", "group_mean", "kl_positive", "kl_direction"]


def _adapter(**hooks):
    from trl_style_grpo import TRLStyleAdapter

    adapter = TRLStyleAdapter()
    for name, fn in hooks.items():
        setattr(adapter, name, fn)
    return adapter


def test_not_applicable_checks_are_skipped_with_the_reason_and_not_run():
    ran = []
    adapter = _adapter(not_applicable=lambda: {"kl_positive": "beta is 0: no KL term"})
    original = adapter.make_reference
    adapter.make_reference = lambda model: ran.append("make_reference") or original(model)
    report = run_suite(adapter, only=["mask_policy", "kl_positive"])
    kl = {c.name: c for c in report.checks}["kl_positive"]
    assert kl.skipped and kl.passed and kl.code == "RLG008"
    assert kl.hint == "skipped: beta is 0: no KL term"
    assert ran == []  # the check's update (and its reference) never ran
    assert report.passed and report.skipped == ["kl_positive"]
    assert "all checks passed (1 skipped: kl_positive)" in table(report)
    assert "| kl_positive | - | - | skip | RLG008 | skipped: beta is 0: no KL term |" in markdown(report)
    assert report.to_dict()["checks"][1]["skipped"] is True


def test_a_failed_check_is_still_failed_beside_a_skipped_one():
    from trl_style_grpo import TRLStyleAdapter

    class NegatedGroups(TRLStyleAdapter):
        def advantages(self, batch):
            return batch["advantages"] + 1.0  # not centred

    adapter = NegatedGroups()
    adapter.not_applicable = lambda: {"kl_direction": "no KL"}
    report = run_suite(adapter, only=["group_mean", "kl_direction"])
    assert report.failed == ["group_mean"] and report.skipped == ["kl_direction"]
    assert "1 check(s) failed: group_mean (1 skipped: kl_direction)" in table(report)


def test_not_applicable_naming_an_unknown_check_is_a_trainer_error():
    adapter = _adapter(not_applicable=lambda: {"kl_positve": "typo"})
    with pytest.raises(TrainerError, match="unknown check.*kl_positve"):
        run_suite(adapter, only=["mask_policy"])


def test_copy_model_is_used_for_every_copy_the_suite_makes():
    copies = []

    def copy_model(model):
        copies.append(model)
        return copy.deepcopy(model)

    adapter = _adapter(copy_model=copy_model)
    report = run_suite(adapter, only=["kl_positive", "kl_direction", "accumulation"])
    assert report.passed, table(report)
    # kl_positive's update copies once (the stepped model), kl_direction three times (its frozen reference, the
    # moved policy, and the stepped copy of the one step length this healthy KL needs), accumulation once
    assert len(copies) == 5


def test_without_copy_model_the_suite_deep_copies():
    adapter = _adapter()
    assert not hasattr(adapter, "copy_model")
    assert run_suite(adapter, only=["kl_direction"]).passed
