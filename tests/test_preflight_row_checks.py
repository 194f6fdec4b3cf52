"""The preflight checks of RLG016-RLG019 beyond the healthy example: rows_in_step in bfloat16 (a healthy trainer
passes, a faulty one still fails), and the skip paths of padding_leak, rows_in_step and stop_token_trained, each
with its reason."""

from __future__ import annotations

import sys
from collections.abc import Mapping
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from rlguard.catalog import ROWS_OUT_OF_STEP  # noqa: E402
from rlguard.preflight.suite import run_suite  # noqa: E402
from rlguard.reference.adapter import ReferenceAdapter  # noqa: E402

torch.set_num_threads(1)
EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
if str(EXAMPLES) not in sys.path:
    sys.path.insert(0, str(EXAMPLES))

from trl_style_grpo import TinyGRPOTrainer, TRLStyleAdapter  # noqa: E402


def _one(adapter, check: str):
    (result,) = run_suite(adapter, only=[check]).checks
    return result


class BF16(TRLStyleAdapter):
    """The TRL-style example with its model (and so its reference and its scoring) in bfloat16."""

    def build_model(self):
        return super().build_model().to(torch.bfloat16)


class SortedForTheForward(TinyGRPOTrainer):
    """RLG019: the minibatch length-sorted into its accumulation chunks for the forward, the advantages taken
    from the unsorted chunks."""

    def accumulate(self, inputs, rows):
        num_items = inputs["completion_mask"][rows].sum().clamp(min=1)
        ratios = []
        by_length = rows[inputs["completion_mask"][rows].sum(-1).argsort(stable=True)]
        steps = self.args.gradient_accumulation_steps
        for part, chunk in zip(by_length.chunk(steps), rows.chunk(steps)):
            sub = {k: v[part] for k, v in inputs.items()}
            sub["advantages"] = inputs["advantages"][chunk]  # the fault: the unsorted order
            loss = self.compute_loss(self.model, sub, num_items)
            loss.backward()
            ratios.append(self._last_ratio)
        return torch.cat(ratios)


class BF16RowsOutOfStep(BF16):
    def _trainer(self, model):
        return SortedForTheForward(model, self.args, self.spec)


class BF16Reference(ReferenceAdapter):
    def build_model(self):
        return super().build_model().to(torch.bfloat16)


# ------------------------------------------------------------------------------- rows_in_step in bfloat16


def test_rows_in_step_healthy_bf16_trainer_passes():
    """Reordered sums in bfloat16 round by ~1e-3 relative: a float32 tolerance (1e-4) failed a healthy trainer."""
    result = _one(BF16(), "rows_in_step")
    assert result.passed and not result.skipped, result
    assert 1e-5 < result.value < 2e-2 and result.tolerance == "< 2e-2", result


def test_rows_in_step_float32_keeps_its_tolerance():
    result = _one(TRLStyleAdapter(), "rows_in_step")
    assert result.passed and result.tolerance == "< 1e-4", result


@pytest.mark.parametrize("adapter", [BF16RowsOutOfStep, lambda: BF16Reference("rows_out_of_step")],
                         ids=["trl_style", "reference"])
def test_rows_in_step_faulty_bf16_trainer_fails_with_rlg019(adapter):
    result = _one(adapter(), "rows_in_step")
    assert not result.passed and not result.skipped and result.code == ROWS_OUT_OF_STEP, result
    assert result.value > 0.1 and "allowed 2e-2" in result.hint, result


# ------------------------------------------------------------------------------- skip paths, with their reason


class Box(Mapping):
    """A batch that reads like a dict but is not one."""

    def __init__(self, data):
        self._data = dict(data)

    def __getitem__(self, key):
        return self._data[key]

    def __iter__(self):
        return iter(self._data)

    def __len__(self):
        return len(self._data)


class BoxedBatch(TRLStyleAdapter):
    def make_batch(self, model, seed):
        return Box(super().make_batch(model, seed))


def test_padding_leak_skips_a_non_dict_batch_without_select_rows():
    adapter = BoxedBatch()
    assert not hasattr(adapter, "select_rows")
    result = _one(adapter, "padding_leak")
    assert result.skipped and result.passed, result
    assert "not a dict" in result.hint and "select_rows(batch, rows)" in result.hint, result.hint


def test_padding_leak_skips_a_non_deterministic_scorer():
    class Jittery(TRLStyleAdapter):
        calls = 0

        def log_probs(self, model, batch):
            Jittery.calls += 1
            return super().log_probs(model, batch) + 1e-3 * Jittery.calls

    result = _one(Jittery(), "padding_leak")
    assert result.skipped and result.passed, result
    assert "not deterministic" in result.hint and "two scorings of the same batch differ" in result.hint, result.hint


def test_rows_in_step_skips_when_rows_depend_on_their_neighbours():
    """Packed rows that attend to each other (pack_no_mask): no reordering can be judged."""
    result = _one(ReferenceAdapter("pack_no_mask"), "rows_in_step")
    assert result.skipped and result.passed, result
    assert "depend on their batch neighbours" in result.hint and "cannot be judged" in result.hint, result.hint


@pytest.mark.parametrize("declared", [None, (), lambda: None], ids=["none", "empty", "method_none"])
def test_stop_token_trained_skips_without_stop_token_ids(declared):
    adapter = TRLStyleAdapter()
    adapter.stop_token_ids = declared
    result = _one(adapter, "stop_token_trained")
    assert result.skipped and result.passed, result
    assert result.hint == "skipped: the adapter declares no stop_token_ids", result.hint
