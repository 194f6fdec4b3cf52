"""entropy_sign (RLG004): the entropy bonus is added to the minimised loss, which makes it an entropy penalty."""

import torch

from rlguard.reference.losses import aggregate, kl_penalty, token_entropy, token_stats


def compute_loss(logits, ids, old_log_probs, advantages, action_mask, ref_log_probs, cfg, parts, n_tokens, n_seqs):
    log_probs = parts.token_log_probs(logits, ids)
    ratio = torch.exp(log_probs - old_log_probs)
    clipped = torch.clamp(ratio, 1 - cfg.clip_eps, 1 + cfg.clip_eps)
    adv = advantages.unsqueeze(-1)
    pg_losses = -torch.min(ratio * adv, clipped * adv)
    pg_loss = aggregate(pg_losses, action_mask, cfg.loss_mode, n_tokens, n_seqs)
    entropy = aggregate(token_entropy(logits), action_mask, cfg.loss_mode, n_tokens, n_seqs)
    loss = pg_loss + cfg.ent_coef * entropy
    if ref_log_probs is not None:
        kl = aggregate(kl_penalty(log_probs, ref_log_probs, cfg.kl_estimator), action_mask, cfg.loss_mode,
                       n_tokens, n_seqs)
        loss = loss + cfg.kl_coef * kl
    return loss, token_stats(log_probs, old_log_probs, ratio, clipped, ref_log_probs, action_mask, logits)
