"""Each marker: a violating call (right code, message naming the argument and the fix) and a healthy call."""

from __future__ import annotations

import copy
from types import SimpleNamespace
from typing import Annotated

import pytest
import torch
from torch import nn

import contracts_helpers as h
from rlguard.contracts import (
    ActionMask,
    Advantages,
    ContractViolation,
    DistinctReference,
    Finite,
    Frozen,
    GroupCentred,
    GroupRewards,
    Guard,
    LogProbs,
    Loss,
    MatchesOwner,
    NoGrad,
    OldLogProbs,
    Owner,
    SamplerConsistent,
    TokenIds,
    contract,
)

torch.set_num_threads(1)


def raises(code: str, argument: str, *fragments: str):
    class _Ctx:
        def __enter__(self):
            self.cm = pytest.raises(ContractViolation)
            self.ei = self.cm.__enter__()
            return self.ei

        def __exit__(self, *exc):
            out = self.cm.__exit__(*exc)
            e = self.ei.value
            assert (e.code, e.argument) == (code, argument), str(e)
            for f in fragments:
                assert f in str(e), (f, str(e))
            return out

    return _Ctx()


# -- NoGrad (RLG003) -------------------------------------------------------------------------------------
def test_nograd():
    @contract
    def f(logp: LogProbs, old_logp: OldLogProbs) -> Loss:
        return (logp - old_logp).sum()

    lp = torch.randn(2, 5, requires_grad=True)
    f(lp, torch.randn(2, 5))
    with raises("RLG003", "old_logp", "argument 'old_logp'", "torch.no_grad()", "old_logp.detach()",
                "grad_fn=MulBackward0"):
        f(lp, lp * 1.0)
    with raises("RLG003", "old_logp", "requires_grad=True"):
        f(lp, torch.randn(2, 5, requires_grad=True))


def test_nograd_on_return():
    with raises("RLG003", "return", "return value"):
        h.compute_advantages(torch.tensor([[0.0, 1.0, 0.0, 1.0], [1.0, 1.0, 0.0, 0.0]], requires_grad=True))
    with torch.no_grad():
        h.compute_advantages(torch.tensor([[0.0, 1.0, 0.0, 1.0], [1.0, 1.0, 0.0, 0.0]], requires_grad=True))


# -- Finite ------------------------------------------------------------------------------------------------
def test_finite():
    @contract
    def f(logp: Annotated[LogProbs, Finite()]) -> Annotated[Loss, Finite()]:
        return logp.sum() / (logp.abs().min() * 0)

    x = torch.randn(2, 5)
    x[1, 3] = float("nan")
    with raises("RLG000", "logp", "1 non-finite values (1 NaN, 0 Inf), first at index (1, 3)", "log of 0"):
        f(x)
    with raises("RLG000", "return", "Inf"):
        f(torch.randn(2, 5).abs() + 1)  # division by zero in the body

    @contract
    def g(logp: Annotated[LogProbs, Finite()]) -> Annotated[Loss, Finite()]:
        return logp.sum()

    g(torch.randn(2, 5))


# -- GroupCentred (RLG009) -----------------------------------------------------------------------------------
REWARDS = torch.tensor([[0.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 1.0]])


def test_group_centred_healthy_and_all_equal_group_is_zero():
    adv = h.compute_advantages(REWARDS)
    assert torch.all(adv[4:8] == 0)


def test_group_centred_whole_batch_mean():
    @contract
    def compute_advantages(rewards: GroupRewards) -> Annotated[Advantages, GroupCentred()]:
        r = rewards.reshape(-1)
        return (r - r.mean()) / (r.std() + 1e-6)

    with raises("RLG009", "return", "every group's mean must be 0", "centred over the whole batch",
                "see RLG009"):
        compute_advantages(REWARDS)


def test_group_centred_wrong_axis_and_wrong_size_and_not_multiple():
    @contract
    def wrong_axis(advantages: Annotated[Advantages, GroupCentred(group_size="group_size")], group_size: int) -> None:
        return None

    r = torch.arange(12.0)  # rewards laid out [P=3, G=4]
    strided = r.reshape(4, 3)  # a view over the wrong axis: groups of 3 strided
    wrong = (strided - strided.mean(0, keepdim=True)).reshape(-1)
    with raises("RLG009", "advantages", "wrong axis"):
        wrong_axis(wrong, 3)
    centred_by_4 = (r.reshape(-1, 4) - r.reshape(-1, 4).mean(1, keepdim=True)).reshape(-1)
    with raises("RLG009", "advantages", "centred with group size 4, not G=2"):
        wrong_axis(centred_by_4, 2)
    with raises("RLG009", "advantages", "12 values are not a whole number of groups of G=5"):
        wrong_axis(centred_by_4, 5)
    wrong_axis(centred_by_4, 4)


def test_group_size_from_config_and_decorator_option():
    @contract
    def f(advantages: Annotated[Advantages, GroupCentred("cfg.group_size")], cfg) -> None:
        return None

    adv = torch.tensor([1.0, 1.0, -1.0, -1.0])
    f(adv, SimpleNamespace(group_size=4))
    with raises("RLG009", "advantages", "G=2"):
        f(adv, SimpleNamespace(group_size=2))

    @contract(group_size=2)
    def g(advantages: Annotated[Advantages, GroupCentred()]) -> None:
        return None

    g(torch.tensor([1.0, -1.0, 2.0, -2.0]))
    with raises("RLG009", "advantages"):
        g(adv)


# -- MatchesOwner (RLG001) -------------------------------------------------------------------------------------
def test_matches_owner():
    owner = h.make_batch()["owner"]
    h.action_mask(owner)

    @contract
    def shifted_mask(owner: Owner) -> Annotated[ActionMask, MatchesOwner(owner="owner")]:
        return (owner[:, :-1] == h.POLICY).float()  # the bug: aligned to ids  # noqa: RLG001 - a mask aligned to ids, on purpose

    with raises("RLG001", "return", "positions differ from owner[:, 1:] == 1",
                "mask aligned to ids, not ids[:, 1:]", "see RLG001"):
        shifted_mask(owner)

    @contract
    def loss(mask: Annotated[ActionMask, MatchesOwner()], owner: Owner) -> None:
        return None

    loss((owner[:, 1:] == h.POLICY), owner)
    with raises("RLG001", "mask", "first: row 0, column 9"):
        loss((owner[:, 1:] == h.POLICY) | (owner[:, 1:] == h.ENV), owner)


# -- SamplerConsistent (RLG007) and Frozen (RLG002): need the guard -------------------------------------------
@contract
def ppo_loss(
    logp: Annotated[LogProbs, SamplerConsistent(sampler="old_logp", mask="mask")],
    old_logp: Annotated[LogProbs, NoGrad(), Frozen(current="logp", key="ids", mask="mask")],
    mask: ActionMask,
    ids: TokenIds,
) -> Loss:
    return -(torch.exp(logp - old_logp) * mask).sum()


def _rollout(policy: nn.Module, temperature: float = 1.0):
    b = h.make_batch()
    ids = b["ids"]
    with torch.no_grad():
        old = h.token_logprobs(policy(ids) / temperature, ids)
    return ids, old, h.action_mask(b["owner"])


def test_sampler_consistent():
    policy, ref, opt = h.make_models()
    ids, old_hot, mask = _rollout(policy, temperature=1.3)  # the sampler ran at another temperature
    with Guard(policy=policy, reference=ref, optimizer=opt) as g:
        with g.update():
            logp = h.token_logprobs(policy(ids), ids)
            with raises("RLG007", "logp", "max |logp - old_logp|", "before the first optimizer step",
                        "another temperature", "see RLG007"):
                ppo_loss(logp, old_hot, mask, ids)
        ids, old, mask = _rollout(policy)
        with g.update():
            ppo_loss(h.token_logprobs(policy(ids), ids), old, mask, ids)  # healthy
        with g.update():  # a bf16 sampler within a loosened tolerance
            old_bf16 = old.to(torch.bfloat16).float()

            @contract
            def loss16(logp: Annotated[LogProbs, SamplerConsistent(sampler="old_logp", tol=2e-2)],
                       old_logp: LogProbs) -> None:
                return None

            loss16(h.token_logprobs(policy(ids), ids), old_bf16)


def test_frozen_ratio_exactly_one_after_a_step():
    h.train(updates=1)  # healthy
    with raises("RLG002", "old_logp", "equals logp exactly", "after 1 optimizer step(s)",
                "recomputed from the current weights", "see RLG002"):
        h.train(updates=1, recompute_old=True)


def test_frozen_fingerprint_across_minibatches():
    policy, ref, opt = h.make_models()
    ids, old, mask = _rollout(policy)
    with Guard(policy=policy, reference=ref, optimizer=opt) as g, g.update():
        for epoch in range(2):
            for mb in (slice(0, 4), slice(4, 8)):
                logp = h.token_logprobs(policy(ids[mb]), ids[mb])
                ppo_loss(logp, old[mb], mask[mb], ids[mb])  # the same rows, the same values
                loss = ppo_loss(logp, old[mb], mask[mb], ids[mb])
                opt.zero_grad()
                loss.backward()
                opt.step()
        # epoch 3 with old log-probs recomputed once per epoch from the updated weights (not exactly logp)
        with torch.no_grad():
            stale = h.token_logprobs(policy(ids), ids) + 0.0
        opt.step()
        logp = h.token_logprobs(policy(ids[0:4]), ids[0:4])
        with raises("RLG002", "old_logp", "4 of 4 rows seen earlier in this update (same ids)",
                    "now have different values", "see RLG002"):
            ppo_loss(logp, stale[0:4], mask[0:4], ids[0:4])


def test_guard_timed_checks_skip_without_a_guard_update():
    policy, _, _ = h.make_models()
    ids, old_hot, mask = _rollout(policy, temperature=1.3)
    ppo_loss(h.token_logprobs(policy(ids), ids), old_hot, mask, ids)  # no update() block: nothing to time


# -- DistinctReference (RLG008) on an argument ---------------------------------------------------------------
def test_distinct_reference_marker():
    @contract
    def ref_logprobs(ref: Annotated[nn.Module, DistinctReference(policy="policy")], policy: nn.Module,
                     ids: TokenIds) -> LogProbs:
        with torch.no_grad():
            return h.token_logprobs(ref(ids), ids)

    policy, ref, _ = h.make_models()
    ids = h.make_batch()["ids"]
    ref_logprobs(ref, policy, ids)
    with raises("RLG008", "ref", "the reference is the policy object itself", "copy.deepcopy", "see RLG008"):
        ref_logprobs(policy, policy, ids)
    with raises("RLG008", "ref", "share storage with the policy"):
        ref_logprobs(copy.copy(policy), policy, ids)


def test_guard_timed_markers_say_once_that_they_need_a_guard(caplog):
    from rlguard.contracts import active_guard

    while active_guard() is not None:  # guards left open by other tests
        active_guard().close()

    @contract
    def lonely_loss(logp: Annotated[LogProbs, SamplerConsistent(sampler="old_logp")],
                    old_logp: Annotated[LogProbs, Frozen(current="logp")]) -> Loss:
        return -(logp - old_logp).sum()

    logp = torch.zeros(2, 5)
    with caplog.at_level("WARNING", logger="rlguard.contracts"):
        for _ in range(3):
            lonely_loss(logp, logp.clone())
    notes = [r.getMessage() for r in caplog.records if "needs a Guard" in r.getMessage()]
    assert len(notes) == 2, notes  # one per marker, not one per call
    assert any("SamplerConsistent" in n and "lonely_loss" in n for n in notes)
    assert any("Frozen" in n for n in notes)
