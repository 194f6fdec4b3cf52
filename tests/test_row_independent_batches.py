"""``@row_independent`` (RLG016) and ``@permutation_invariant`` (RLG019) on object batches (dotted paths into a
dataclass or an object, a batch split by ``select_rows``), the default padding side read from the batch's layout,
the checked row by cadence (the last row first), and a batch that cannot be split: logged once, never silent."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import pytest
import torch

from rlguard.catalog import PADDING_LEAK, ROWS_OUT_OF_STEP
from rlguard.contracts import ContractDefinitionError, ContractViolation, permutation_invariant, row_independent
from rlguard.reference.model import ModelConfig, build_model

from contracts_helpers import padded_rows

torch.set_num_threads(1)
PAD = 0


def _model(dtype=torch.float32):
    return build_model(ModelConfig(vocab_size=12, d_model=16, n_layers=1), seed=0).to(dtype)


def _gather(logits, ids):
    return logits[:, :-1].float().log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)


def _right_padded():
    return padded_rows("right", PAD)


def _left_padded():
    return padded_rows("left", PAD)


@dataclass
class Episodes:
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    advantages: torch.Tensor
    group_size: int = 4
    note: str = "a field that is not batch-shaped"


@dataclass(frozen=True)
class FrozenEpisodes:
    input_ids: torch.Tensor
    attention_mask: torch.Tensor


def _episodes(cls=Episodes, **kw):
    ids, mask = _right_padded()
    if cls is FrozenEpisodes:
        return cls(ids, mask)
    return cls(ids, mask, torch.tensor([1.0, -0.5, 0.25, -0.75]), **kw)


# -- @row_independent on a dataclass batch -------------------------------------------------------------------
@row_independent(ids="batch.input_ids", mask="batch.attention_mask", every=1)
def healthy_logps(model, batch):
    return _gather(model(batch.input_ids), batch.input_ids)


@row_independent(ids="batch.input_ids", mask="batch.attention_mask", every=1)
def leaky_logps(model, batch):
    logits = model(batch.input_ids)
    return _gather(logits - logits.mean(0, keepdim=True), batch.input_ids)  # each row reads its neighbours


@pytest.mark.parametrize("cls", [Episodes, FrozenEpisodes])
def test_row_independent_dataclass_batch_healthy_passes_and_a_leak_fails(cls, caplog):
    model, batch = _model(), _episodes(cls)
    with caplog.at_level(logging.WARNING, logger="rlguard.contracts"):
        for _ in range(4):  # every row in turn
            out = healthy_logps(model, batch)
    assert "not checked" not in caplog.text and "switched off" not in caplog.text, caplog.text
    assert torch.equal(out, _gather(model(batch.input_ids), batch.input_ids))
    assert batch.input_ids.shape == (4, 9)  # the caller's batch is left as it was
    with pytest.raises(ContractViolation) as ei:
        leaky_logps(model, batch)
    assert ei.value.code == PADDING_LEAK and "alone in its batch" in str(ei.value), str(ei.value)


def test_row_independent_nested_path_into_an_object_and_its_dict():
    class Proto:  # verl's DataProto shape: the tensors in a dict at .batch, other things beside
        def __init__(self, ids, mask):
            self.batch = {"input_ids": ids, "attention_mask": mask}
            self.meta_info = {"temperature": 1.0}

    @row_independent(ids="data.batch['input_ids']", mask="data.batch['attention_mask']", every=1)
    def leaky(model, data):
        logits = model(data.batch["input_ids"])
        return _gather(logits - logits.mean(0, keepdim=True), data.batch["input_ids"])

    with pytest.raises(ContractViolation) as ei:
        leaky(_model(), Proto(*_right_padded()))
    assert ei.value.code == PADDING_LEAK


# -- @permutation_invariant on a dataclass batch ---------------------------------------------------------------
def _loss(model, batch, sort_for_forward=False):
    ids, mask, adv = batch.input_ids, batch.attention_mask[:, 1:].float(), batch.advantages
    if sort_for_forward:  # the fault: rows sorted by length for the forward, the advantages left as they were
        order = mask.sum(-1).argsort(stable=True)
        ids, mask = ids[order], mask[order]
    logp = _gather(model(ids), ids)
    return -(logp * adv[:, None] * mask).sum() / mask.sum()


def test_permutation_invariant_dataclass_batch_healthy_passes_and_rows_out_of_step_fails(caplog):
    model, batch = _model(), _episodes()
    healthy = permutation_invariant(_loss, key="batch.input_ids", every=1)
    faulty = permutation_invariant(lambda model, batch: _loss(model, batch, True), key="batch.input_ids", every=1)
    with caplog.at_level(logging.WARNING, logger="rlguard.contracts"):
        for _ in range(3):
            assert torch.equal(healthy(model, batch), _loss(model, batch))
    assert "not checked" not in caplog.text, caplog.text
    with pytest.raises(ContractViolation) as ei:
        faulty(model, batch)
    assert ei.value.code == ROWS_OUT_OF_STEP and "another order" in str(ei.value), str(ei.value)


def test_group_size_from_a_dataclass_batch_is_left_to_the_int():
    model, batch = _model(), _episodes()
    checked = permutation_invariant(_loss, key="batch['input_ids']", group_size=2, every=1)
    checked(model, batch)  # get_field reads attributes through the bracket form too


# -- a batch that cannot be split: select_rows, else logged once -----------------------------------------------
class Opaque:
    """A batch whose fields are views of one private record: nothing rlguard can take rows of field by field."""

    def __init__(self, ids, mask, adv):
        self._record = (ids, mask, adv)

    input_ids = property(lambda self: self._record[0])
    attention_mask = property(lambda self: self._record[1])
    advantages = property(lambda self: self._record[2])


def _opaque_select(batch, rows):
    return Opaque(batch.input_ids[rows], batch.attention_mask[rows], batch.advantages[rows])


def _opaque():
    ids, mask = _right_padded()
    return Opaque(ids, mask, torch.tensor([1.0, -0.5, 0.25, -0.75]))


class Slotted:
    __slots__ = ("input_ids", "attention_mask", "advantages")

    def __init__(self, ids, mask, adv):
        self.input_ids, self.attention_mask, self.advantages = ids, mask, adv


def test_a_slots_batch_is_split_by_its_fields():
    ids, mask = _right_padded()
    batch = Slotted(ids, mask, torch.tensor([1.0, -0.5, 0.25, -0.75]))
    leaky = row_independent(leaky_logps.__wrapped__, ids="batch.input_ids", mask="batch.attention_mask", every=1)
    with pytest.raises(ContractViolation, match="alone in its batch"):
        leaky(_model(), batch)
    faulty = permutation_invariant(lambda model, batch: _loss(model, batch, True), key="batch.input_ids", every=1)
    with pytest.raises(ContractViolation) as ei:
        faulty(_model(), batch)
    assert ei.value.code == ROWS_OUT_OF_STEP


def test_an_unsplittable_batch_is_logged_once_not_silently_passed(caplog):
    leaky = row_independent(leaky_logps.__wrapped__, ids="batch.input_ids", mask="batch.attention_mask", every=1)
    faulty = permutation_invariant(lambda model, batch: _loss(model, batch, True), key="batch.input_ids", every=1)
    model, batch = _model(), _opaque()
    with caplog.at_level(logging.WARNING, logger="rlguard.contracts"):
        for _ in range(3):
            leaky(model, batch)
            faulty(model, batch)
    assert caplog.text.count("cannot be split by row") == 1, caplog.text
    assert caplog.text.count("cannot be permuted by row") == 1, caplog.text
    assert "select_rows" in caplog.text and "'batch' (Opaque)" in caplog.text


def test_select_rows_splits_what_fields_cannot(caplog):
    leaky = row_independent(leaky_logps.__wrapped__, ids="batch.input_ids", mask="batch.attention_mask", every=1,
                            select_rows=_opaque_select)
    faulty = permutation_invariant(lambda model, batch: _loss(model, batch, True), key="batch.input_ids", every=1,
                                   select_rows=_opaque_select)
    healthy = permutation_invariant(_loss, key="batch.input_ids", every=1, select_rows=_opaque_select)
    model, batch = _model(), _opaque()
    healthy(model, batch)
    with caplog.at_level(logging.WARNING, logger="rlguard.contracts"), pytest.raises(ContractViolation) as ei:
        leaky(model, batch)  # the neighbour check: its padded re-call cannot be built for this type
    assert ei.value.code == PADDING_LEAK and "alone in its batch" in str(ei.value)
    assert "only the neighbour check runs" in caplog.text
    with pytest.raises(ContractViolation) as ei:
        faulty(model, batch)
    assert ei.value.code == ROWS_OUT_OF_STEP


def test_a_path_that_finds_nothing_is_logged_once(caplog):
    checked = row_independent(lambda model, batch: _gather(model(batch.input_ids), batch.input_ids),
                              ids="batch.ids", mask=None, every=1)
    with caplog.at_level(logging.WARNING, logger="rlguard.contracts"):
        checked(_model(), _episodes())
        checked(_model(), _episodes())
    assert caplog.text.count("batch.ids is missing, not [B, T] token ids: not checked") == 1, caplog.text


def test_misconfigured_paths_fail_at_decoration_naming_the_argument():
    def f(model, batch):
        return None

    with pytest.raises(ContractDefinitionError, match=r"row_independent\(ids='bacth.input_ids'\).*parameters: "
                                                      r"model, batch"):
        row_independent(f, ids="bacth.input_ids")
    with pytest.raises(ContractDefinitionError, match=r"row_independent\(mask='batch\.\.mask'\)"):
        row_independent(f, ids="batch.input_ids", mask="batch..mask")
    with pytest.raises(ContractDefinitionError, match=r"permutation_invariant\(key='batch\[input_ids\]'\)"):
        permutation_invariant(f, key="batch[input_ids]")
    with pytest.raises(ContractDefinitionError, match="select_rows"):
        row_independent(select_rows="rows")
    with pytest.raises(ContractDefinitionError, match="select_rows"):
        permutation_invariant(select_rows=3)
    with pytest.raises(ContractDefinitionError, match="'auto', 'both', 'right' or 'left'"):
        row_independent(side="up")


# -- the default side: read from the batch's layout ------------------------------------------------------------
def test_default_catches_a_left_padded_leak_without_mask_or_position_ids():
    """Left-padded rows scored without the mask and the position ids their padding needs: the default (no side
    given) pads on the left as the batch is, and sees the row move."""
    model, (ids, mask) = _model(), _left_padded()

    @row_independent(every=1)
    def mask_passed_not_used(model, input_ids, attention_mask):
        return _gather(model(input_ids), input_ids)

    @row_independent(mask=None, every=1)
    def no_mask_at_all(model, input_ids):
        return _gather(model(input_ids), input_ids)

    for fn, args in ((mask_passed_not_used, (ids, mask)), (no_mask_at_all, (ids,))):
        with pytest.raises(ContractViolation) as ei:
            fn(model, *args)
        assert ei.value.code == PADDING_LEAK and "left padding" in str(ei.value), str(ei.value)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_default_passes_healthy_left_and_right_padded_scorers(dtype):
    model = _model(dtype)

    @row_independent(every=1)
    def left_healthy(model, input_ids, attention_mask):
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        return _gather(model(input_ids, attention_mask=attention_mask, position_ids=position_ids), input_ids)

    @row_independent(every=1)
    def right_healthy(model, input_ids, attention_mask):  # causal: right padding never reaches earlier positions
        return _gather(model(input_ids), input_ids)

    for _ in range(4):
        left_healthy(model, *_left_padded())
        right_healthy(model, *_right_padded())


def test_mixed_layout_and_side_both_re_score_both_sides():
    """Left-padded prompts before right-padded completions: the default re-scores with both paddings (3 re-calls),
    as side='both' always does; one-sided layouts keep 2."""
    calls = []

    def scorer(model, input_ids, attention_mask):
        calls.append(tuple(input_ids.shape))
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        return _gather(model(input_ids, attention_mask=attention_mask, position_ids=position_ids), input_ids)

    ids, mask = _right_padded()
    ids, mask = torch.cat([torch.full((4, 2), PAD), ids], 1), torch.cat([torch.zeros(4, 2, dtype=mask.dtype), mask], 1)
    ids[0, :2], mask[0, :2] = 3, 1  # row 0's prompt is the longest: no left padding
    model = _model()
    row_independent(scorer, every=1)(model, ids, mask)
    assert calls == [(4, 11), (1, 11), (1, 19), (1, 19)], calls
    calls.clear()
    row_independent(scorer, every=1, side="both")(model, *_right_padded())
    assert calls == [(4, 9), (1, 9), (1, 17), (1, 17)], calls
    calls.clear()
    row_independent(scorer, every=1)(model, *_right_padded())
    assert calls == [(4, 9), (1, 9), (1, 17)], calls


# -- the checked row by cadence ----------------------------------------------------------------------------
def test_first_checked_call_checks_the_last_row_so_a_packed_leak_is_caught_at_once():
    """Rows packed into one causal sequence with no mask between them: row 0 reads nothing before it, every
    other row reads its predecessors. The first checked call takes the last row, then each row in turn."""
    seen = []

    @row_independent(mask=None, every=16)
    def packed(model, input_ids):
        b, t = input_ids.shape
        seen.append(b)
        logits = model(input_ids.reshape(1, b * t)).reshape(b, t, -1)
        return _gather(logits, input_ids)

    ids = _right_padded()[0][:, :6]
    ids[ids == PAD] = 5
    with pytest.raises(ContractViolation) as ei:
        packed(_model(), ids)  # call 1: checked
    assert ei.value.code == PADDING_LEAK and "row 3's values change" in str(ei.value), str(ei.value)


def test_checked_rows_rotate_from_the_last():
    rows = []

    @row_independent(mask=None, every=2)
    def scorer(model, input_ids):
        if len(input_ids) == 1:
            rows.append(next(i for i in range(len(ids)) if torch.equal(ids[i], input_ids[0, :6])))
        return _gather(model(input_ids), input_ids)

    ids = torch.arange(1, 5).view(-1, 1).repeat(1, 6)  # four distinct rows, no padding
    model = _model()
    for _ in range(10):
        scorer(model, ids)
    assert rows == [3, 3, 2, 2, 1, 1, 0, 0, 3, 3], rows  # the alone and the padded re-call of calls 1, 3, 5, ...


def test_checks_leave_parameters_bit_identical_and_the_batch_untouched():
    model, batch = _model(), _episodes()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ids_before = batch.input_ids.clone()
    permutation_invariant(_loss, key="batch.input_ids", every=1)(model, batch).backward()
    grads_checked = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    _loss(model, batch).backward()
    assert all(torch.equal(a, p.grad) for a, p in zip(grads_checked, model.parameters()))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert torch.equal(batch.input_ids, ids_before) and dataclasses.is_dataclass(batch)
