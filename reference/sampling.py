"""Sampling episodes from the policy, storing each token's log-prob at sampling time, and collating a batch.

The sampler draws every policy token from ``softmax(logits / temperature)`` and keeps ``log p`` of the drawn
token: these are the behaviour (old) log-probs of the update. ``evaluate`` is the plain, one-episode-at-a-time
greedy path used for held-out evaluation; the sampler with ``greedy=True`` must reproduce it exactly.
"""

from __future__ import annotations

import torch

from rlguard.reference.task import OWNER_PAD, PAD, Episode, Task, TaskSpec, finish, policy_step, start_episode


@torch.no_grad()
def sample_episodes(model, tasks: list[Task], spec: TaskSpec, group_size: int, temperature: float,
                    generator: torch.Generator | None = None, greedy: bool = False,
                    reward: str = "hidden") -> list[Episode]:
    """``group_size`` episodes per task, laid out contiguously (task 0's group first), played in lockstep."""
    episodes = [start_episode(spec, task) for task in tasks for _ in range(group_size)]
    while True:
        live = [ep for ep in episodes if not ep.done]
        if not live:
            break
        width = max(len(ep.ids) for ep in live)
        ids = torch.full((len(live), width), PAD, dtype=torch.long)
        for i, ep in enumerate(live):
            ids[i, : len(ep.ids)] = torch.tensor(ep.ids)
        last = torch.tensor([len(ep.ids) - 1 for ep in live])
        logits = model(ids)[torch.arange(len(live)), last] / temperature  # [n, V]
        log_probs = torch.log_softmax(logits.float(), dim=-1)
        if greedy:
            tokens = log_probs.argmax(-1)
        else:
            tokens = torch.multinomial(log_probs.exp(), 1, generator=generator).squeeze(-1)
        chosen = log_probs.gather(-1, tokens[:, None]).squeeze(-1)
        for ep, token, logp in zip(live, tokens.tolist(), chosen.tolist()):
            policy_step(spec, ep, token, logp)
    return [finish(ep, reward) for ep in episodes]


@torch.no_grad()
def evaluate(model, tasks: list[Task], spec: TaskSpec) -> dict:
    """Greedy decoding, one episode at a time -> pass rate, mean reward and the episodes' token ids."""
    episodes = []
    for task in tasks:
        ep = start_episode(spec, task)
        while not ep.done:
            logits = model(torch.tensor([ep.ids]))[0, -1]
            token = int(logits.argmax())
            policy_step(spec, ep, token, float(torch.log_softmax(logits.float(), -1)[token]))
        episodes.append(finish(ep))
    n = max(len(episodes), 1)
    return {"pass_rate": sum(ep.info["passed"] for ep in episodes) / n,
            "reward": sum(ep.info["reward"] for ep in episodes) / n,
            "ids": [list(ep.ids) for ep in episodes]}


def collate(episodes: list[Episode], group_size: int) -> dict:
    """Right-padded tensors: ids/owner [B, T], sampler_logp [B, T-1] aligned to ids[:, 1:], rewards [B]."""
    width = max(len(ep.ids) for ep in episodes)
    b = len(episodes)
    ids = torch.full((b, width), PAD, dtype=torch.long)
    owner = torch.full((b, width), OWNER_PAD, dtype=torch.long)
    sampler_logp = torch.zeros(b, width)
    for i, ep in enumerate(episodes):
        n = len(ep.ids)
        ids[i, :n] = torch.tensor(ep.ids)
        owner[i, :n] = torch.tensor(ep.owner)
        sampler_logp[i, :n] = torch.tensor(ep.sample_logp)
    return {
        "ids": ids,
        "owner": owner,
        "sampler_logp": sampler_logp[:, 1:],
        "rewards": torch.tensor([ep.info["reward"] for ep in episodes]),
        "group_size": group_size,
        "info": [ep.info for ep in episodes],
    }
