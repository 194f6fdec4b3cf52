"""What the checks cost the device: one host read per checked call, whatever the number of markers (counted on
CPU with a TorchFunctionMode); none between check_every calls. Frozen's row hashes: no false alarm over thousands
of distinct rows of a tiny vocabulary."""

from __future__ import annotations

from typing import Annotated

import pytest
import torch

import contracts_helpers as h
from rlguard.contracts import (
    ActionMask,
    Advantages,
    Batch,
    ContractViolation,
    Finite,
    Frozen,
    GroupCentred,
    Guard,
    LogProbs,
    Loss,
    MatchesOwner,
    NoGrad,
    Owner,
    SamplerConsistent,
    TokenIds,
    check_batch,
    contract,
)

torch.set_num_threads(1)


def make_loss(check_every: int):
    @contract(check_every=check_every)
    def loss(logp: Annotated[LogProbs, Finite(), SamplerConsistent(sampler="old_logp", mask="mask")],
             old_logp: Annotated[LogProbs, NoGrad(), Finite(), Frozen(current="logp", key="ids", mask="mask")],
             advantages: Annotated[Advantages, NoGrad(), Finite(), GroupCentred(group_size=4)],
             mask: Annotated[ActionMask, MatchesOwner(owner="owner")], owner: Owner, ids: TokenIds,
             ) -> Annotated[Loss, Finite()]:
        return -(torch.exp(logp - old_logp) * advantages[:, None] * mask).sum() / mask.sum()

    return loss


def rollout():
    policy, ref, opt = h.make_models()
    b = h.make_batch()
    ids, owner = b["ids"], b["owner"]
    mask = (owner[:, 1:] == h.POLICY).float()
    with torch.no_grad():
        old = h.token_logprobs(policy(ids), ids)
    adv = h.compute_advantages(b["rewards"])
    return policy, ref, opt, ids, owner, mask, old, adv


def test_one_host_read_per_checked_call_with_every_marker():
    policy, ref, opt, ids, owner, mask, old, adv = rollout()
    loss = make_loss(1)
    with Guard(policy=policy, reference=ref, optimizer=opt) as g:
        with g.update():
            logp = h.token_logprobs.__wrapped__(policy(ids), ids)  # undecorated: count only `loss`
            with h.HostSyncs() as syncs:  # first minibatch: 8 value checks incl. the sampler's, 1 read
                loss(logp, old, adv, mask, owner, ids)
            assert syncs.count == 1, syncs.calls
            opt.zero_grad()
            loss(logp, old, adv, mask, owner, ids).backward()
            opt.step()
            with h.HostSyncs() as syncs:  # after a step: Frozen's once-per-update ratio check rides along
                for _ in range(5):
                    loss(logp.detach() + 0.01, old, adv, mask, owner, ids)
            assert syncs.count == 5, syncs.calls


def test_no_host_read_between_check_every_calls():
    policy, ref, opt, ids, owner, mask, old, adv = rollout()
    loss = make_loss(4)
    with Guard(policy=policy, reference=ref, optimizer=opt) as g, g.update():
        opt.step()  # past the first minibatch: only the cadence decides
        loss(old + 0.01, old, adv, mask, owner, ids)  # call 1 (and Frozen's once-per-update check)
        with h.HostSyncs() as syncs:
            for _ in range(7):  # calls 2..8: call 5 is due
                loss(old + 0.01, old, adv, mask, owner, ids)
        assert syncs.count == 1, syncs.calls
        with h.HostSyncs() as syncs:  # a violation found between cadence calls still needs no read
            for _ in range(3):
                with pytest.raises(ContractViolation):
                    loss(old + 0.01, old.requires_grad_(), adv, mask, owner, ids)
                old = old.detach()
        assert syncs.count == 0, syncs.calls


def test_check_batch_and_guard_steps_read_once():
    spec = Batch(ids=TokenIds, owner=Owner, mask=Annotated[ActionMask, MatchesOwner()],
                 advantages=Annotated[Advantages, NoGrad(), Finite(), GroupCentred(group_size=4)])
    policy, ref, opt, ids, owner, mask, old, adv = rollout()
    with h.HostSyncs() as syncs:
        check_batch(spec, {"ids": ids, "owner": owner, "mask": mask, "advantages": adv})
    assert syncs.count == 1, syncs.calls

    def step_reads() -> int:
        opt.zero_grad()
        policy(ids).sum().backward()
        with h.HostSyncs() as syncs:
            opt.step()
        return syncs.count

    own = step_reads()  # AdamW reads its step counters itself
    g = Guard(policy=policy, reference=ref, optimizer=opt, check_every=4)
    counts = [step_reads() - own for _ in range(8)]
    g.close()
    assert counts == [1, 0, 0, 0, 1, 0, 0, 0], counts  # the reference's fingerprint, on the cadence


def test_frozen_rows_of_a_tiny_vocabulary_never_collide():
    """5000 distinct episodes over a 4-token vocabulary (the weighted-sum fingerprint this replaced gave 1-2
    colliding pairs per batch of this kind): two epochs of shuffled minibatches raise nothing; one changed value
    in one row is caught."""

    @contract
    def loss(old_logp: Annotated[LogProbs, Frozen(key="ids")], ids: TokenIds) -> None:
        return None

    gen = torch.Generator().manual_seed(0)
    n, t = 5000, 12
    codes = torch.randperm(4 ** t, generator=gen)[:n]  # distinct rows: base-4 digits of distinct numbers
    ids = torch.stack([(codes // 4 ** k) % 4 for k in range(t)], dim=1)
    assert len({tuple(r) for r in ids.tolist()}) == n
    old = -torch.rand(n, t - 1, generator=gen)
    policy, ref, opt = h.make_models()
    with Guard(policy=policy, reference=ref, optimizer=opt) as g, g.update():
        for _ in range(2):
            for rows in torch.randperm(n, generator=gen).chunk(50):
                loss(old[rows], ids[rows])
                opt.step()  # noqa: RLG013 - steps with no gradient: they only advance the step count
        changed = old[:100].clone()
        changed[37, 5] += 1e-6
        with pytest.raises(ContractViolation) as ei:
            loss(changed, ids[:100])
    assert "1 of 100 rows seen earlier in this update (same ids) now have different values" in str(ei.value)
    assert "row 37 of this call" in str(ei.value)


def test_frozen_duplicate_episodes():
    """Identical episodes (the same ids) are separate rows: first seen before any step, or twice in one call."""

    @contract
    def loss(old_logp: Annotated[LogProbs, Frozen(key="ids")], ids: TokenIds) -> None:
        return None

    ids = torch.tensor([[1, 2, 3], [1, 2, 3], [4, 5, 6]])
    old = torch.tensor([[-1.0, -2.0], [-1.5, -2.5], [-3.0, -3.0]])  # the duplicates' stored values differ
    policy, ref, opt = h.make_models()
    with Guard(policy=policy, reference=ref, optimizer=opt) as g:
        with g.update():
            loss(old[:1], ids[:1])
            loss(old[1:], ids[1:])  # before any step: another episode with the same ids
            opt.step()
            loss(old[[1, 0]], ids[[1, 0]])
            loss(old, ids)
        with g.update():
            loss(old, ids)  # twice in one call
            opt.step()
            loss(old[[2, 1, 0]], ids[[2, 1, 0]])
            with pytest.raises(ContractViolation, match="1 of 1 rows"):
                loss(old[:1] + 0.5, ids[:1])
