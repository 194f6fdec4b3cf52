"""Every marker in float32 and bfloat16: a healthy call and a violating one; tolerances that scale with the dtype
and with the values' magnitude (correctly centred bf16/fp16 advantages and reward scale ~1000 pass)."""

from __future__ import annotations

import copy
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
    Guard,
    LogProbs,
    MatchesOwner,
    NoGrad,
    Owner,
    SamplerConsistent,
    TokenIds,
    contract,
)
from rlguard.contracts.markers import default_centred_rtol

torch.set_num_threads(1)
DTYPES = [torch.float32, torch.bfloat16]
G = 8


@contract
def take_advantages(advantages: Annotated[Advantages, NoGrad(), Finite(), GroupCentred(group_size=G)]) -> None:
    return None


def grpo_advantages(rewards: torch.Tensor, normalise: bool = True) -> torch.Tensor:
    """The usual GRPO centring, computed in the rewards' own dtype."""
    grouped = rewards.view(-1, G)
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    if normalise:
        centred = centred / (grouped.std(dim=1, keepdim=True) + 1e-4)
    return centred.reshape(-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scale", [1.0, 1000.0])
@pytest.mark.parametrize("normalise", [True, False])
def test_centred_advantages_pass_in_every_precision_and_scale(dtype, scale, normalise):
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):  # 20 calls, as the report that found the fixed 1e-5 too tight
        base = torch.rand(16, 1, generator=gen) * scale  # every group has its own offset
        rewards = (base + torch.rand(16, G, generator=gen) * scale).reshape(-1)
        if dtype == torch.float16 and scale > 100:
            rewards = rewards / 100  # float16 tops out at 65504; keep its sums in range
        take_advantages(grpo_advantages(rewards.to(dtype), normalise))
        take_advantages(grpo_advantages(rewards.double(), normalise).to(dtype))  # centred in fp64, then cast


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_uncentred_and_batch_centred_advantages_are_caught_in_every_precision(dtype):
    gen = torch.Generator().manual_seed(1)
    rewards = torch.randint(0, 2, (16 * G,), generator=gen).float()
    rewards[:G] = torch.tensor([1.0, 0, 0, 0, 0, 0, 0, 0])  # a group of 8 with one success: mean 1/8
    with pytest.raises(ContractViolation) as ei:  # no baseline at all
        take_advantages(rewards.to(dtype))
    assert ei.value.code == "RLG009" and "no baseline subtracted" in str(ei.value)
    with pytest.raises(ContractViolation) as ei:  # one baseline for the whole batch
        take_advantages((rewards - rewards.mean()).to(dtype))  # noqa: RLG009 - a whole-batch baseline, on purpose
    assert "centred over the whole batch" in str(ei.value), str(ei.value)
    assert str(dtype).removeprefix("torch.") in str(ei.value)


def test_default_tolerance_scales_with_the_dtype():
    assert default_centred_rtol(torch.float32) == pytest.approx(3.45e-4, rel=1e-2)
    assert default_centred_rtol(torch.bfloat16) == pytest.approx(0.0884, rel=1e-2)
    assert default_centred_rtol(torch.float16) == pytest.approx(0.03125, rel=1e-2)
    assert default_centred_rtol(torch.float64) < 1e-7

    @contract
    def absolute(advantages: Annotated[Advantages, GroupCentred(group_size=2, tol=1e-3)]) -> None:
        return None

    absolute(torch.tensor([1000.0, -1000.0004]))  # |mean| 2e-4 <= tol
    with pytest.raises(ContractViolation, match="1e-05|0.001"):
        absolute(torch.tensor([1000.0, -999.99]))  # |mean| 5e-3 > tol, with no relative part


@pytest.mark.parametrize("dtype", DTYPES)
def test_nograd_and_finite(dtype):
    @contract
    def f(old_logp: Annotated[LogProbs, NoGrad(), Finite()]) -> None:
        return None

    f(torch.randn(4, 5).to(dtype))
    f(torch.full((4, 5), 3e38 if dtype == torch.float32 else 3e38).to(dtype))  # finite values whose sum overflows
    with pytest.raises(ContractViolation) as ei:
        f(torch.randn(4, 5).to(dtype).requires_grad_())
    assert ei.value.code == "RLG003"
    bad = torch.randn(4, 5).to(dtype)
    bad[2, 3] = float("inf")
    with pytest.raises(ContractViolation) as ei:
        f(bad)
    assert "1 non-finite values (0 NaN, 1 Inf), first at index (2, 3)" in str(ei.value)


@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_owner(dtype):
    @contract
    def f(mask: Annotated[ActionMask, MatchesOwner(owner="owner")], owner: Owner) -> None:
        return None

    owner = h.make_batch()["owner"]
    f((owner[:, 1:] == h.POLICY).to(dtype), owner)
    with pytest.raises(ContractViolation) as ei:
        f((owner[:, :-1] == h.POLICY).to(dtype), owner)
    assert ei.value.code == "RLG001" and "mask aligned to ids" in str(ei.value)


@contract
def ppo_loss(logp: Annotated[LogProbs, SamplerConsistent(sampler="old_logp", mask="mask")],
             old_logp: Annotated[LogProbs, NoGrad(), Frozen(current="logp", key="ids", mask="mask")],
             mask: ActionMask, ids: TokenIds) -> None:
    return None


@pytest.mark.parametrize("dtype", DTYPES)
def test_sampler_consistent(dtype):
    policy, ref, opt = h.make_models()
    ids = h.make_batch()["ids"]
    mask = h.action_mask(h.make_batch()["owner"])
    with torch.no_grad():
        logp = h.token_logprobs(policy(ids), ids)
        hot = h.token_logprobs(policy(ids) / 0.7, ids)
    with Guard(policy=policy, reference=ref, optimizer=opt) as g:
        with g.update():  # the sampler's log-probs stored in `dtype`, the trainer's in float32
            ppo_loss(logp, logp.to(dtype), mask, ids)
        with g.update():
            ppo_loss(logp.to(dtype), logp.to(dtype), mask, ids)
        with g.update(), pytest.raises(ContractViolation) as ei:  # a sampler at another temperature
            ppo_loss(logp, hot.to(dtype), mask, ids)
    assert ei.value.code == "RLG007"


@contract
def frozen_loss(logp: LogProbs, old_logp: Annotated[LogProbs, Frozen(current="logp", key="ids", mask="mask")],
                mask: ActionMask, ids: TokenIds) -> None:
    return None


@pytest.mark.parametrize("dtype", DTYPES)
def test_frozen(dtype):
    policy, ref, opt = h.make_models()
    b = h.make_batch()
    ids, mask = b["ids"], h.action_mask(b["owner"])
    with torch.no_grad():
        old = h.token_logprobs(policy(ids), ids).to(dtype)
    logp = (old.float() + 0.01).to(dtype)
    with Guard(policy=policy, reference=ref, optimizer=opt) as g, g.update():
        for epoch in range(2):
            for rows in (slice(0, 4), slice(4, 8)):
                frozen_loss(logp[rows], old[rows], mask[rows], ids[rows])
                opt.step()  # noqa: RLG013 - steps with no gradient: they only advance the step count
        changed = old[0:4].clone()
        changed[1, 3] = changed[1, 3] * 0.5  # one value of one row (a valid token)
        with pytest.raises(ContractViolation) as ei:
            frozen_loss(logp[0:4], changed, mask[0:4], ids[0:4])
    assert ei.value.code == "RLG002" and "1 of 4 rows" in str(ei.value)
    with Guard(policy=policy, reference=ref, optimizer=opt) as g, g.update():
        frozen_loss(old, old, mask, ids)
        opt.step()
        with pytest.raises(ContractViolation) as ei:  # recomputed from the current weights: exactly equal
            frozen_loss(old, old.clone(), mask, ids)
    assert ei.value.code == "RLG002" and "equals logp exactly" in str(ei.value)


@pytest.mark.parametrize("dtype", DTYPES)
def test_distinct_reference(dtype):
    @contract
    def ref_logprobs(ref: Annotated[nn.Module, DistinctReference(policy="policy")], policy: nn.Module) -> None:
        return None

    policy = h.TinyLM().to(dtype)
    ref_logprobs(copy.deepcopy(policy).requires_grad_(False), policy)
    with pytest.raises(ContractViolation) as ei:  # a shallow copy shares the policy's (bf16) storage
        ref_logprobs(copy.copy(policy), policy)
    assert ei.value.code == "RLG008" and "share storage" in str(ei.value)
