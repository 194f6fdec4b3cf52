"""Loss pieces of the GRPO trainer: token log-probs, the action mask, group advantages, PPO-clip, entropy, KL.

Shapes: ``ids``/``owner`` [B, T]; ``logits`` [B, T, V] from ``model(ids)``; every per-token tensor (log-probs,
action mask, old and reference log-probs) is [B, T-1] and aligned to ``ids[:, 1:]``; ``advantages`` [B].
"""

from __future__ import annotations

from typing import Annotated

import torch

from rlguard.contracts import (ActionMask, Advantages, Logits, LogProbs, MatchesOwner, NoGrad, Owner, Rewards,
                               TokenIds, contract)
from rlguard.reference.task import POLICY


@contract
def token_log_probs(logits: Logits, ids: TokenIds) -> LogProbs:
    """log p(ids[:, t+1] | ids[:, :t+1]) -> [B, T-1]: logits[:, t] predicts ids[:, t+1]."""
    log_probs = logits[:, :-1].log_softmax(-1)
    return log_probs.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)


def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of each next-token distribution -> [B, T-1]."""
    log_p = logits[:, :-1].log_softmax(-1)
    return -(log_p.exp() * log_p).sum(-1)


@contract
def build_action_mask(owner: Owner, ids: TokenIds | None = None) -> Annotated[ActionMask, MatchesOwner(owner="owner")]:
    """1.0 where ids[:, 1:] was written by the policy -> [B, T-1] (its stop token included: ``ids`` is not needed
    here; a mask that also drops pad ids drops a stop token that shares the pad's id)."""
    action_mask = (owner[:, 1:] == POLICY).float()
    return action_mask


@contract
def group_advantages(rewards: Rewards, group_size: int, eps: float = 1e-4) -> Annotated[Advantages, NoGrad()]:
    """GRPO advantages: each reward minus its group's mean, over the group's std -> [B]."""
    grouped = rewards.view(-1, group_size)
    centred = grouped - grouped.mean(dim=-1, keepdim=True)
    advantages = centred / (grouped.std(dim=-1, keepdim=True) + eps)
    return advantages.view(-1)


@contract
def kl_penalty(log_probs: LogProbs, ref_log_probs: Annotated[LogProbs, NoGrad()], estimator: str = "k3") -> LogProbs:
    """Per-token estimate of KL(pi || ref) on tokens sampled from pi: k1 = log r, k3 = r' - 1 - log r' (r' = ref/pi)."""
    log_ratio = log_probs - ref_log_probs
    if estimator == "k1":
        return log_ratio
    if estimator == "k3":
        return torch.exp(-log_ratio) - 1 + log_ratio
    raise ValueError(f"unknown KL estimator {estimator!r}: 'k1' or 'k3'")


def aggregate(values: torch.Tensor, action_mask: torch.Tensor, loss_mode: str, n_tokens, n_seqs: int) -> torch.Tensor:
    """Sum of per-token values over the mask, normalised for the whole minibatch (not this microbatch).

    ``token_mean``: every token of the minibatch weighs 1 / n_tokens. ``seq_mean_token_mean``: each sequence's
    token mean weighs 1 / n_seqs (tokens of long episodes weigh less: length bias, RLG010).
    """
    if loss_mode == "token_mean":
        return (values * action_mask).sum() / n_tokens
    if loss_mode == "seq_mean_token_mean":
        per_seq = (values * action_mask).sum(-1) / action_mask.sum(-1).clamp(min=1)
        return per_seq.sum() / n_seqs
    raise ValueError(f"unknown loss_mode {loss_mode!r}")


def compute_loss(logits, ids, old_log_probs, advantages, action_mask, ref_log_probs, cfg, parts, n_tokens, n_seqs):
    """PPO-clip surrogate minus the entropy bonus plus the KL penalty, for one microbatch -> (loss, stats)."""
    log_probs = parts.token_log_probs(logits, ids)
    ratio = torch.exp(log_probs - old_log_probs)
    clipped = torch.clamp(ratio, 1 - cfg.clip_eps, 1 + cfg.clip_eps)
    adv = advantages.unsqueeze(-1)
    pg_losses = -torch.min(ratio * adv, clipped * adv)
    pg_loss = aggregate(pg_losses, action_mask, cfg.loss_mode, n_tokens, n_seqs)
    entropy = aggregate(token_entropy(logits), action_mask, cfg.loss_mode, n_tokens, n_seqs)
    loss = pg_loss - cfg.ent_coef * entropy
    kl = torch.zeros(())
    if ref_log_probs is not None:
        kl = aggregate(kl_penalty(log_probs, ref_log_probs, cfg.kl_estimator), action_mask, cfg.loss_mode,
                       n_tokens, n_seqs)
        loss = loss + cfg.kl_coef * kl
    return loss, token_stats(log_probs, old_log_probs, ratio, clipped, ref_log_probs, action_mask, logits)


@torch.no_grad()
def token_stats(log_probs, old_log_probs, ratio, clipped, ref_log_probs, action_mask, logits) -> dict:
    """Sums over the masked tokens of one microbatch (turned into means by the caller)."""
    m = action_mask > 0
    r = ratio[m]
    log_r = (log_probs - old_log_probs)[m]
    stats = {
        "tokens": float(m.sum()),
        "entropy_sum": float(token_entropy(logits)[m].sum()),
        "approx_kl_sum": float((0.5 * log_r**2).sum()),
        "clipped_sum": float((r != clipped[m]).sum()),
        "ratio_max": float(r.max()) if r.numel() else 1.0,
        "ratio_min": float(r.min()) if r.numel() else 1.0,
    }
    if ref_log_probs is not None:
        stats["kl_ref_sum"] = float(kl_penalty(log_probs, ref_log_probs, "k1")[m].sum())
        stats["kl_k3_sum"] = float(kl_penalty(log_probs, ref_log_probs, "k3")[m].sum())
    return stats
