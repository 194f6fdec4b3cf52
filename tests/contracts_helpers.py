"""A tiny GRPO trainer decorated with rlguard contracts, shared by the contracts tests."""

from __future__ import annotations

import copy
from typing import Annotated

import torch
from torch import nn

from rlguard.contracts import (
    ActionMask,
    Advantages,
    Finite,
    Frozen,
    GroupCentred,
    GroupRewards,
    Guard,
    Logits,
    LogProbs,
    Loss,
    MatchesOwner,
    NoGrad,
    Owner,
    SamplerConsistent,
    TokenIds,
    contract,
)

V, P, G, T = 32, 2, 4, 12
B = P * G
PROMPT, POLICY, ENV = 0, 1, 2


class TinyLM(nn.Module):
    def __init__(self, vocab: int = V, d: int = 16) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.mix = nn.Linear(d, d)
        self.head = nn.Linear(d, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        h = h + torch.tanh(self.mix(torch.cumsum(h, dim=1) / torch.arange(1, ids.shape[1] + 1)[:, None]))
        return self.head(h)


@contract
def token_logprobs(logits: Logits, ids: TokenIds) -> Annotated[LogProbs, Finite()]:
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    return logp.gather(-1, ids[:, 1:, None]).squeeze(-1)


@contract
def action_mask(owner: Owner) -> Annotated[ActionMask, MatchesOwner(owner="owner")]:
    return (owner[:, 1:] == POLICY).float()


@contract
def compute_advantages(rewards: Annotated[GroupRewards, Finite()]) -> Annotated[
        Advantages, NoGrad(), Finite(), GroupCentred()]:
    centred = rewards - rewards.mean(dim=1, keepdim=True)
    return (centred / (rewards.std(dim=1, keepdim=True) + 1e-6)).reshape(-1)


@contract
def policy_loss(
    logp: Annotated[LogProbs, Finite(), SamplerConsistent(sampler="old_logp", mask="mask")],
    old_logp: Annotated[LogProbs, NoGrad(), Frozen(current="logp", mask="mask")],
    advantages: Annotated[Advantages, NoGrad()],
    mask: ActionMask,
    *,
    clip: float = 0.2,
) -> Annotated[Loss, Finite()]:
    ratio = torch.exp(logp - old_logp)
    a = advantages[:, None]
    surrogate = torch.minimum(ratio * a, ratio.clamp(1 - clip, 1 + clip) * a)
    return -(surrogate * mask).sum() / mask.sum()


@contract
def kl_penalty(logp: LogProbs, ref_logp: Annotated[LogProbs, NoGrad()], mask: ActionMask) -> Annotated[
        Loss, Finite()]:
    d = ref_logp - logp
    return ((torch.exp(d) - d - 1) * mask).sum() / mask.sum()


def make_batch(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (B, T), generator=gen)
    owner = torch.full((B, T), PROMPT)
    owner[:, 4:10] = POLICY
    owner[:, 10:] = ENV
    rewards = torch.randint(0, 2, (P, G), generator=gen).float()
    rewards[0] = torch.tensor([0.0, 1.0, 0.0, 1.0])  # never an all-equal first group
    return {"ids": ids, "owner": owner, "rewards": rewards}


def make_models(seed: int = 0) -> tuple[TinyLM, TinyLM, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    policy = TinyLM()
    ref = copy.deepcopy(policy).eval().requires_grad_(False)
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-2)
    return policy, ref, opt


def train(updates: int = 2, epochs: int = 2, minibatches: int = 2, seed: int = 0,
          recompute_old: bool = False, guard: bool = True) -> TinyLM:
    """A few GRPO updates; ``recompute_old`` injects the RLG002 bug."""
    policy, ref, opt = make_models(seed)
    g = Guard(policy=policy, reference=ref, optimizer=opt) if guard else None
    for u in range(updates):
        batch = make_batch(seed + u)
        ids, owner = batch["ids"], batch["owner"]
        mask = action_mask(owner)
        with torch.no_grad():
            old_logp = token_logprobs(policy(ids), ids)
            ref_logp = token_logprobs(ref(ids), ids)
        adv = compute_advantages(batch["rewards"])
        ctx = g.update() if g is not None else _null()
        with ctx:
            for _ in range(epochs):
                for mb in torch.arange(B).chunk(minibatches):
                    logp = token_logprobs(policy(ids[mb]), ids[mb])
                    old = old_logp[mb]
                    if recompute_old:
                        with torch.no_grad():
                            old = token_logprobs(policy(ids[mb]), ids[mb])  # noqa: RLG002 - the recompute_old fault, injected on purpose
                    loss = policy_loss(logp, old, adv[mb], mask[mb]) + 0.01 * kl_penalty(
                        logp, ref_logp[mb], mask[mb])
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
    if g is not None:
        g.close()
    return policy


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *a: object) -> None:
        return None
