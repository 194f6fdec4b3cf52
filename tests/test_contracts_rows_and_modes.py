"""The runtime checks of RLG016-RLG019: a violating and a healthy call for each, float32 and bfloat16 where a
tolerance decides, misconfiguration caught when the decorator is applied, and rlguard's own failures logged and
switched off without stopping the call."""

from __future__ import annotations

import functools
import logging
from types import SimpleNamespace
from typing import Annotated

import pytest
import torch
from torch import nn

from rlguard.catalog import PADDING_LEAK, ROWS_OUT_OF_STEP, STOP_TOKEN_UNTRAINED, TRAIN_MODE_SCORING
from rlguard.contracts import (
    ActionMask, Advantages, ContractDefinitionError, ContractViolation, EvalMode, FollowsRewards, Guard, LogProbs,
    RowsInStep, UpdateDirection,
    StopTokenInMask, TokenIds, contract, mode, permutation_invariant, row_independent,
)
from rlguard.contracts import invariance
from rlguard.reference.model import ModelConfig, build_model, disable_dropout

from contracts_helpers import padded_rows

torch.set_num_threads(1)
EOS, PAD = 9, 0


def _model(dropout: float = 0.0, dtype=torch.float32, seed: int = 0):
    return build_model(ModelConfig(vocab_size=12, d_model=16, n_layers=1, dropout=dropout), seed=seed).to(dtype)


# -- StopTokenInMask (RLG017) ------------------------------------------------------------------------------
@contract
def mask_from_pad(ids: TokenIds, pad_id: int) -> Annotated[ActionMask, StopTokenInMask(ids="ids", stop_ids=EOS)]:
    return (ids[:, 1:] != pad_id).float()


@contract
def mask_through_first_stop(ids: TokenIds) -> Annotated[ActionMask, StopTokenInMask(ids="ids", stop_ids=EOS)]:
    """Completion tokens (after the 2-token prompt) up to and including the first EOS."""
    tokens = ids[:, 1:]
    after_stop = (tokens == EOS).int().cumsum(-1) - (tokens == EOS).int() > 0
    return ((torch.arange(tokens.shape[1]) >= 1) & ~after_stop).float()


PADDED_WITH_EOS = torch.tensor([[1, 2, 3, 4, EOS, EOS, EOS], [1, 2, 5, EOS, EOS, EOS, EOS]])


def test_pad_is_eos_mask_drops_the_stop_token():
    with pytest.raises(ContractViolation) as ei:
        mask_from_pad(PADDED_WITH_EOS, EOS)
    e = ei.value
    assert e.code == STOP_TOKEN_UNTRAINED
    assert "2 of 2 completions" in str(e) and "row 0, column 3, token 9" in str(e), str(e)
    assert "pad_token_id" in str(e)


def test_mask_through_the_first_stop_passes_whatever_the_pad():
    assert mask_through_first_stop(PADDED_WITH_EOS)[0].tolist() == [0, 1, 1, 1, 0, 0]
    mask_from_pad(PADDED_WITH_EOS, PAD)  # pad 0 != eos: the EOS stays in


def test_several_stop_ids_and_a_cut_before_the_stop():
    @contract
    def cut(ids: TokenIds, stops: tuple) -> Annotated[ActionMask, StopTokenInMask(ids="ids", stop_ids="stops")]:
        tokens = ids[:, 1:]
        stopped = torch.isin(tokens, torch.tensor(stops)).int().cumsum(-1) > 0  # the stop itself left out
        return (~stopped & (torch.arange(tokens.shape[1]) >= 1)).float()

    ids = torch.tensor([[1, 2, 3, 7, PAD, PAD], [1, 2, 3, 4, EOS, PAD]])
    with pytest.raises(ContractViolation) as ei:
        cut(ids, (EOS, 7))
    assert ei.value.code == STOP_TOKEN_UNTRAINED and "stop ids [9, 7]" in str(ei.value)


def test_completion_only_layout_and_truncated_rows():
    @contract
    def response_mask(responses: torch.Tensor, m: torch.Tensor, eos: int) -> Annotated[
            torch.Tensor, StopTokenInMask(ids="responses", stop_ids="eos")]:
        return m

    responses = torch.tensor([[4, 5, EOS, EOS], [4, 5, 6, 7]])  # row 1 truncated: no stop, nothing to check
    response_mask(responses, torch.tensor([[1.0, 1, 1, 0], [1, 1, 1, 1]]), EOS)
    with pytest.raises(ContractViolation):
        response_mask(responses, torch.tensor([[1.0, 1, 0, 0], [1, 1, 1, 1]]), EOS)


def test_a_shifted_mask_is_left_to_the_alignment_checks():
    """A hole at the stop with the next position trained is a mask moved by one token (RLG001), not a cut."""
    @contract
    def shifted(ids: TokenIds, m: torch.Tensor) -> Annotated[ActionMask, StopTokenInMask(ids="ids", stop_ids=EOS)]:
        return m

    ids = torch.tensor([[1, 2, EOS, 3, 4, PAD]])
    shifted(ids, torch.tensor([[0.0, 0, 1, 1, 0]]))  # column 1 (the EOS) out, column 2 in


def test_stop_token_marker_misconfigured_fails_at_decoration():
    def f(ids: TokenIds) -> ActionMask:
        return ids[:, 1:].float()

    for bad in (True, [], ["a"], 1.5):
        with pytest.raises(ContractDefinitionError, match="stop_ids"):
            contract(f, markers={"return": StopTokenInMask(ids="ids", stop_ids=bad)})
    with pytest.raises(ContractDefinitionError, match="no parameter 'input_ids'"):
        @contract
        def g(ids: TokenIds) -> Annotated[ActionMask, StopTokenInMask(ids="input_ids", stop_ids=EOS)]:
            return ids[:, 1:].float()


# -- EvalMode and the Guard's scoring forwards (RLG018) ----------------------------------------------------
@contract
def score(ref: Annotated[nn.Module, EvalMode()], ids: TokenIds) -> torch.Tensor:
    return ref(ids)


IDS = torch.tensor([[1, 2, 3, 4, 5], [1, 3, 3, 4, PAD]])


def test_scoring_in_train_mode_with_dropout_is_flagged():
    ref = _model(dropout=0.1)
    with pytest.raises(ContractViolation) as ei:
        score(ref, IDS)
    assert ei.value.code == TRAIN_MODE_SCORING
    assert "'blocks.0.attn_drop' (p=0.1)" in str(ei.value) and "model.eval()" in str(ei.value)


def test_scoring_in_eval_mode_or_without_dropout_passes():
    score(_model(dropout=0.1).eval(), IDS)
    score(disable_dropout(_model(dropout=0.1)), IDS)  # train mode, every rate 0
    score(_model(), IDS)


def test_functional_dropout_attribute_counts():
    class Attention(nn.Module):  # Hugging Face style: a float rate applied with F.dropout when training
        def __init__(self):
            super().__init__()
            self.attention_dropout = 0.1
            self.proj = nn.Linear(4, 4)

        def forward(self, ids):
            return self.proj(torch.ones(len(ids), 4))

    with pytest.raises(ContractViolation, match="attention_dropout|Attention"):
        score(Attention(), IDS)
    score(Attention().eval(), IDS)


def test_only_no_grad_checks_scoring_calls_only():
    @contract
    def forward(model: Annotated[nn.Module, EvalMode(only_no_grad=True)], ids: TokenIds) -> torch.Tensor:
        return model(ids)

    m = _model(dropout=0.1)
    forward(m, IDS)  # a training forward: dropout belongs there
    with torch.no_grad(), pytest.raises(ContractViolation):
        forward(m, IDS)


def test_eval_mode_on_a_tensor_argument_fails_at_decoration():
    with pytest.raises(ContractDefinitionError, match="EvalMode checks a model object"):
        @contract
        def f(ids: Annotated[TokenIds, EvalMode()]) -> None:
            return None


def _guard(policy, reference):
    return Guard(policy=policy, reference=reference, optimizer=torch.optim.SGD(policy.parameters(), lr=0.1))


def test_guard_flags_a_reference_forward_with_dropout_on():
    policy, ref = disable_dropout(_model(dropout=0.1)), _model(dropout=0.1, seed=1).requires_grad_(False)
    with _guard(policy, ref) as g:
        with pytest.raises(ContractViolation) as ei:
            with torch.no_grad():
                ref(IDS)
        assert ei.value.code == TRAIN_MODE_SCORING and "forward of the reference" in str(ei.value)
        ref.eval()
        with g.update(), torch.no_grad():
            ref(IDS)
    ref.train()
    ref(IDS)  # the guard closed: its hooks are gone


def test_guard_flags_policy_forwards_without_autograd_only():
    policy, ref = _model(dropout=0.1), _model(seed=1).eval().requires_grad_(False)
    with _guard(policy, ref) as g:
        with g.update():
            policy(IDS).sum().backward()  # a training forward with dropout: fine
        with pytest.raises(ContractViolation, match="scoring forward of the policy"):
            with torch.no_grad():
                policy(IDS)


def test_guard_scoring_check_failing_itself_is_switched_off(monkeypatch, caplog):
    policy, ref = disable_dropout(_model(dropout=0.1)), _model(dropout=0.1, seed=1)
    calls = []

    def broken(*a, **k):
        calls.append(1)
        raise RuntimeError("boom")

    with _guard(policy, ref):
        monkeypatch.setattr(invariance, "active_dropout", broken)
        with caplog.at_level(logging.WARNING, logger="rlguard.contracts"):
            ref(IDS)
            ref(IDS)
    assert len(calls) == 1 and "switched off" in caplog.text and "RuntimeError: boom" in caplog.text


def test_guard_warn_mode_reports_and_goes_on(caplog):
    policy, ref = disable_dropout(_model(dropout=0.1)), _model(dropout=0.1, seed=1)
    with _guard(policy, ref), mode("warn"), caplog.at_level(logging.WARNING):
        out = ref(IDS)
    assert out.shape == (2, 5, 12) and "RLG018" in caplog.text


# -- row_independent (RLG016) ------------------------------------------------------------------------------
def _gather(logits, ids):
    return logits[:, :-1].float().log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)


@row_independent(mask="attention_mask", every=1)
def healthy_logps(model, input_ids, attention_mask):
    return _gather(model(input_ids), input_ids)


@row_independent(mask="attention_mask", every=1)
def batch_normalised_logps(model, input_ids, attention_mask):
    logits = model(input_ids)
    return _gather(logits - logits.mean(0, keepdim=True), input_ids)  # each row reads its neighbours


@row_independent(mask="attention_mask", every=1, side="left")
def left_padded_logps(model, input_ids, attention_mask):
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    return _gather(model(input_ids, attention_mask=attention_mask, position_ids=position_ids), input_ids)


@row_independent(mask="attention_mask", every=1, side="left")
def left_padded_logps_no_mask(model, input_ids, attention_mask):
    return _gather(model(input_ids), input_ids)  # the mask and position ids its left padding needs: not passed


def _right_padded():
    return padded_rows("right", PAD)


def _left_padded():
    return padded_rows("left", PAD)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_independent_healthy_right_and_left_padding(dtype):
    model = _model(dtype=dtype)
    ids, mask = _right_padded()
    for _ in range(4):  # every row in turn
        healthy_logps(model, ids, mask)
    ids, mask = _left_padded()
    for _ in range(4):
        left_padded_logps(model, ids, mask)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_independent_catches_a_neighbour_leak_and_a_padding_leak(dtype):
    model = _model(dtype=dtype)
    with pytest.raises(ContractViolation) as ei:
        batch_normalised_logps(model, *_right_padded())
    assert ei.value.code == PADDING_LEAK and "alone in its batch" in str(ei.value), str(ei.value)
    ids, mask = _left_padded()
    with pytest.raises(ContractViolation) as ei:
        for _ in range(4):  # the longest row has no padding to shift; the others do
            left_padded_logps_no_mask(model, ids, mask)
    assert ei.value.code == PADDING_LEAK and "left padding" in str(ei.value), str(ei.value)


def test_row_independent_cadence_output_and_rng():
    calls = []

    @row_independent(mask="attention_mask", every=3)
    def counted(model, input_ids, attention_mask):
        calls.append(len(input_ids))
        return _gather(model(input_ids), input_ids)

    model, (ids, mask) = _model(), _right_padded()
    plain = _gather(model(ids), ids)
    torch.manual_seed(3)
    before = torch.get_rng_state()
    outs = [counted(model, ids, mask) for _ in range(6)]
    assert torch.equal(before, torch.get_rng_state())
    assert all(torch.equal(o, plain) for o in outs)
    assert calls == [4, 1, 1, 4, 4, 4, 1, 1, 4, 4]  # the re-calls (one row, then padded) at calls 1 and 4


def test_row_independent_skips_while_dropout_is_on(caplog):
    model = _model(dropout=0.5)
    with caplog.at_level(logging.WARNING):
        batch_normalised_logps(model, *_right_padded())  # would be a leak, but two passes cannot agree anyway
    assert "not checked while dropout is on" in caplog.text


def test_row_independent_failing_itself_is_switched_off(caplog):
    @row_independent(mask="attention_mask", every=1)
    def needs_two_rows(model, input_ids, attention_mask):
        if len(input_ids) < 2:
            raise ValueError("at least two rows")
        return _gather(model(input_ids), input_ids)

    model, (ids, mask) = _model(), _right_padded()
    with caplog.at_level(logging.WARNING):
        out = needs_two_rows(model, ids, mask)
        needs_two_rows(model, ids, mask)
    assert out.shape == (4, 8)
    assert caplog.text.count("switched off") == 1 and "ValueError: at least two rows" in caplog.text


def test_row_independent_batch_dict_and_tuple_output():
    @row_independent(ids="batch['input_ids']", mask="batch['attention_mask']", every=1, output=0)
    def logps_and_entropy(model, batch):
        logits = model(batch["input_ids"])
        return _gather(logits, batch["input_ids"]), logits.float().softmax(-1).amax(-1)

    ids, mask = _right_padded()
    logps_and_entropy(_model(), {"input_ids": ids, "attention_mask": mask})


def test_row_independent_misconfigured_fails_at_decoration():
    with pytest.raises(ContractDefinitionError, match="parameters: model, input_ids"):
        row_independent(ids="ids")(lambda model, input_ids: None)
    with pytest.raises(ContractDefinitionError, match="'right' or 'left'"):
        row_independent(side="up")
    with pytest.raises(ContractDefinitionError, match="every"):
        row_independent(every=0)


def test_row_independent_off_mode_calls_through():
    model, (ids, mask) = _model(), _right_padded()
    with mode("off"):
        batch_normalised_logps(model, ids, mask)


# -- RowsInStep (RLG019) -----------------------------------------------------------------------------------
IN_STEP = RowsInStep(key="ids")


@contract
def collate(ids: TokenIds, old_logp: Annotated[LogProbs, IN_STEP], adv: Annotated[Advantages, IN_STEP]) -> None:
    return None


@contract
def loss(ids: TokenIds, old_logp: Annotated[LogProbs, IN_STEP], adv: Annotated[Advantages, IN_STEP],
         mask: ActionMask) -> torch.Tensor:
    return ((old_logp * mask).sum(-1) * adv).sum()


def _episodes(seed=0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 12, (6, 5), generator=gen)
    return ids, torch.randn(6, 4, generator=gen), torch.randn(6, generator=gen), torch.ones(6, 4)


def test_rows_in_step_consistent_permutation_passes_and_a_lagging_field_fails():
    policy = _model()
    ids, old, adv, mask = _episodes()
    with _guard(policy, None) as g:
        collate(ids, old, adv)
        order = torch.tensor([3, 1, 0, 5, 4, 2])
        with g.update():
            loss(ids[order], old[order], adv[order], mask[order])  # every field re-indexed together
            with pytest.raises(ContractViolation) as ei:
                loss(ids[order], old[order], adv, mask[order])  # the advantages left in the old order
    e = ei.value
    assert e.code == ROWS_OUT_OF_STEP and e.argument == "adv" and "no longer in step" in str(e), str(e)


def test_rows_in_step_forgets_the_batch_after_its_update():
    policy = _model()
    ids, old, adv, mask = _episodes()
    with _guard(policy, None) as g:
        collate(ids, old, adv)
        with g.update():
            loss(ids, old, adv, mask)
        collate(ids, old + 1, -adv)  # the same prompts scored again by a later policy: other rows, no alarm
        with g.update():
            loss(ids, old + 1, -adv, mask)


def test_rows_in_step_duplicate_episodes_in_one_call():
    policy = _model()
    ids, old, adv, mask = _episodes()
    ids[1] = ids[0]  # the same completion sampled twice: two rows with other advantages
    with _guard(policy, None) as g:
        collate(ids, old, adv)
        with g.update():
            loss(ids, old, adv, mask)


def test_rows_in_step_without_a_guard_notes_and_passes(caplog):
    ids, old, adv, mask = _episodes()
    with caplog.at_level(logging.WARNING):
        loss(ids, old, adv.flip(0), mask)
    assert "needs a Guard" in caplog.text


def test_row_independent_padded_recall_failing_keeps_the_neighbour_check(caplog):
    model = build_model(ModelConfig(vocab_size=12, d_model=16, n_layers=1, max_len=9))  # no room for 8 more columns
    ids, mask = _right_padded()
    healthy = row_independent(healthy_logps.__wrapped__, mask="attention_mask", every=1)
    leaky = row_independent(batch_normalised_logps.__wrapped__, mask="attention_mask", every=1)
    with caplog.at_level(logging.WARNING):
        healthy(model, ids, mask)
    assert "only the neighbour check runs" in caplog.text
    with pytest.raises(ContractViolation, match="alone in its batch"):
        leaky(model, ids, mask)


# -- permutation_invariant (RLG019) ------------------------------------------------------------------------
def _grpo_loss(input_ids, logp, old_logp, rewards, mask, group_size, sort_for_forward=False):
    grouped = rewards.view(-1, group_size)
    adv = ((grouped - grouped.mean(-1, keepdim=True)) / (grouped.std(-1, keepdim=True) + 1e-4)).view(-1)
    if sort_for_forward:  # the fault: rows sorted by length for the forward, the advantages left as they were
        order = mask.sum(-1).argsort(stable=True)
        logp, old_logp, mask = logp[order], old_logp[order], mask[order]
    ratio = torch.exp(logp - old_logp)
    return -(ratio * adv[:, None] * mask).sum() / mask.sum()


def _loss_batch(dtype=torch.float32):
    gen = torch.Generator().manual_seed(1)
    b, t = 8, 6
    mask = (torch.arange(t - 1)[None] < torch.tensor([5, 2, 4, 3, 1, 5, 2, 3])[:, None]).float()
    return (torch.randint(1, 12, (b, t), generator=gen), torch.randn(b, t - 1, generator=gen).to(dtype),
            torch.randn(b, t - 1, generator=gen).to(dtype), torch.rand(b, generator=gen), mask)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_permutation_invariant_healthy_and_rows_out_of_step(dtype):
    healthy = permutation_invariant(_grpo_loss, group_size="group_size", every=1)
    faulty = permutation_invariant(functools.partial(_grpo_loss, sort_for_forward=True), group_size="group_size",
                                   every=1)
    for _ in range(3):
        healthy(*_loss_batch(dtype), group_size=4)
    with pytest.raises(ContractViolation) as ei:
        faulty(*_loss_batch(dtype), group_size=4)
    assert ei.value.code == ROWS_OUT_OF_STEP and "groups of 4 kept together" in str(ei.value), str(ei.value)


def test_permutation_invariant_misconfigured_and_rng():
    with pytest.raises(ContractDefinitionError, match="group_size='G'"):
        permutation_invariant(_grpo_loss, group_size="G")
    with pytest.raises(ContractDefinitionError, match="rtol"):
        permutation_invariant(rtol=-1)
    checked = permutation_invariant(_grpo_loss, group_size="group_size", every=1)
    torch.manual_seed(5)
    before = torch.get_rng_state()
    out = checked(*_loss_batch(), group_size=4)
    assert torch.equal(before, torch.get_rng_state()) and torch.equal(out, _grpo_loss(*_loss_batch(), group_size=4))


# -- FollowsRewards and UpdateDirection (RLG005 during training) ---------------------------------------------
@contract
def advantages_of(rewards: torch.Tensor, group_size: int, flip: bool = False) -> Annotated[
        Advantages, FollowsRewards(rewards="rewards")]:
    g = rewards.view(-1, group_size)
    adv = ((g - g.mean(-1, keepdim=True)) / (g.std(-1, keepdim=True) + 1e-4)).view(-1)
    return -adv if flip else adv


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_follows_rewards(dtype):
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.5, 0.2, 0.2, 0.2, 0.2]).to(dtype)
    advantages_of(rewards, 4)
    with pytest.raises(ContractViolation) as ei:
        advantages_of(rewards, 4, flip=True)
    assert ei.value.code == "RLG005" and "a higher reward has a lower advantage" in str(ei.value)


def test_update_direction_sees_a_surrogate_that_lost_its_minus():
    torch.manual_seed(0)
    model = _model()
    ids, mask = _right_padded()
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])

    def run(sign: float, min_rows: int = 3):
        @contract(markers={"logp": UpdateDirection(advantages="adv", mask="m", key="ids", min_rows=min_rows)})
        def loss(logp: LogProbs, adv: Advantages, m: ActionMask, ids: TokenIds) -> torch.Tensor:
            return sign * -(logp * adv[:, None] * m).sum() / m.sum()

        m = model.__class__(model.cfg)
        m.load_state_dict(model.state_dict())
        opt = torch.optim.SGD(m.parameters(), lr=0.5)
        with Guard(policy=m, optimizer=opt) as g, g.update():
            for _ in range(2):  # two epochs over the same rows
                opt.zero_grad()
                loss(_gather(m(ids), ids), adv, mask[:, 1:].float(), ids).backward()
                opt.step()

    run(1.0)
    with pytest.raises(ContractViolation) as ei:
        run(-1.0)
    assert ei.value.code == "RLG005" and "moved against their advantages" in str(ei.value)
    with pytest.raises(ContractDefinitionError, match="min_rows"):
        UpdateDirection(min_rows=1)
