"""The reference trainer's swappable parts: sampling, reference, optimizer, backward, update.

``Parts`` holds every function a fault may replace; the trainer only calls them through it, so a fault is one
function swapped for its faulty twin in ``rlguard.reference.faults`` and each twin is ordinary, lintable source.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace
from typing import Callable

import torch

from rlguard.reference import losses
from rlguard.reference.sampling import collate, sample_episodes


def rollout(model, tasks, cfg, generator):
    """Sample G episodes per task at the trainer's temperature -> batch (with the sampler's log-probs)."""
    episodes = sample_episodes(model, tasks, cfg.spec, cfg.group_size, temperature=cfg.temperature,
                               generator=generator, reward=cfg.reward)
    return collate(episodes, cfg.group_size)


def forward(model, ids, cfg):
    """The trainer's scoring forward: next-token logits of right-padded ids at the trainer's temperature. Causal
    attention makes right padding harmless, so no attention mask is needed."""
    return model(ids) / cfg.temperature


def make_reference(model):
    """A frozen copy of the policy for the KL penalty."""
    ref_model = copy.deepcopy(model).eval()
    ref_model.requires_grad_(False)
    return ref_model



def make_optimizer(model, cfg):
    """Adam over the trainable parameters; the prefixes in ``cfg.frozen`` stay frozen."""
    for name, p in model.named_parameters():
        p.requires_grad_(not name.startswith(cfg.frozen))
    return torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=cfg.lr)


def minibatch_backward(model, ids, rows, action_mask, old_log_probs, advantages, ref_log_probs, cfg, parts):
    """Backward of one minibatch in length-sorted microbatches; the loss is normalised by the whole minibatch."""
    n_tokens = action_mask[rows].sum().clamp(min=1)
    n_seqs = len(rows)
    micro = rows[action_mask[rows].sum(-1).argsort(stable=True)].chunk(cfg.microbatches)
    logs = []
    for part in micro:
        logits = parts.forward(model, ids[part], cfg)
        ref_part = None if ref_log_probs is None else ref_log_probs[part]
        loss, stats = parts.compute_loss(logits, ids[part], old_log_probs[part], advantages[part],
                                         action_mask[part], ref_part, cfg, parts, n_tokens, n_seqs)
        loss.backward()
        logs.append(dict(stats, loss=float(loss.detach())))
    return merge_stats(logs)


def merge_stats(logs: list[dict]) -> dict:
    out = {}
    for key in logs[0]:
        values = [s[key] for s in logs]
        out[key] = max(values) if key == "ratio_max" else min(values) if key == "ratio_min" else sum(values)
    return out


def update(model, ref_model, optimizer, batch, cfg, parts, generator, shard_rows=None):
    """Several epochs of minibatch PPO steps on one batch -> stats of the update. ``shard_rows(rows, mask)``
    picks this rank's share of each minibatch when the update runs data-parallel."""
    ids = batch["ids"]
    action_mask = parts.build_action_mask(batch["owner"], ids)
    old_log_probs = batch["sampler_logp"]
    with torch.no_grad():
        advantages = parts.group_advantages(batch["rewards"], cfg.group_size)
        ref_log_probs = None
        if ref_model is not None:
            ref_log_probs = parts.token_log_probs(parts.forward(ref_model, ids, cfg), ids)
    logs = []
    for _ in range(cfg.epochs):
        for rows in torch.randperm(len(ids), generator=generator).chunk(cfg.minibatches):
            optimizer.zero_grad(set_to_none=True)
            if shard_rows is not None:
                rows = shard_rows(rows, action_mask)
            stats = parts.minibatch_backward(model, ids, rows, action_mask, old_log_probs, advantages,
                                             ref_log_probs, cfg, parts)
            params = [p for p in model.parameters() if p.grad is not None]
            stats["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm))
            optimizer.step()
            logs.append(stats)
    return summarize_update(logs)


def summarize_update(logs: list[dict]) -> dict:
    tokens = sum(s["tokens"] for s in logs)
    out = {
        "entropy": sum(s["entropy_sum"] for s in logs) / tokens,
        "approx_kl": sum(s["approx_kl_sum"] for s in logs) / tokens,
        "clip_frac": sum(s["clipped_sum"] for s in logs) / tokens,
        "ratio_max": max(s["ratio_max"] for s in logs),
        "ratio_min": min(s["ratio_min"] for s in logs),
        "grad_norm": sum(s["grad_norm"] for s in logs) / len(logs),
        "loss": sum(s["loss"] for s in logs) / len(logs),
    }
    if "kl_ref_sum" in logs[0]:
        out["kl_ref"] = sum(s["kl_ref_sum"] for s in logs) / tokens
        out["kl_ref_k3"] = sum(s["kl_k3_sum"] for s in logs) / tokens
    return out


@dataclass(frozen=True)
class Parts:
    """The functions the trainer calls; a fault replaces exactly one of them."""

    rollout: Callable = rollout
    forward: Callable = forward
    make_reference: Callable = make_reference
    make_optimizer: Callable = make_optimizer
    build_action_mask: Callable = losses.build_action_mask
    group_advantages: Callable = losses.group_advantages
    token_log_probs: Callable = losses.token_log_probs
    compute_loss: Callable = losses.compute_loss
    minibatch_backward: Callable = minibatch_backward
    update: Callable = update

    def with_fault(self, fault: str | None) -> "Parts":
        if fault is None:
            return self
        from rlguard.reference.faults import FAULTS

        if fault not in FAULTS:
            raise KeyError(f"unknown fault {fault!r}; known: {', '.join(FAULTS)}")
        f = FAULTS[fault]
        return replace(self, **{f.part: f.function})


def make_parts(fault: str | None = None) -> Parts:
    return Parts().with_fault(fault)
