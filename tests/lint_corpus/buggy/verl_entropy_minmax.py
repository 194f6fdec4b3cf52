"""verl-style actor loss: the PPO clip takes the minimum of the negated surrogates (optimistic instead of
pessimistic, RLG005) and the entropy is added to the minimised policy loss (RLG004)."""

import torch


def masked_mean(values, mask, axis=None):
    return (values * mask).sum(axis=axis) / mask.sum(axis=axis)


def agg_loss(loss_mat, loss_mask, loss_agg_mode="token-mean"):
    if loss_agg_mode == "token-mean":
        return masked_mean(loss_mat, loss_mask)
    if loss_agg_mode == "seq-mean-token-sum":
        return torch.sum(loss_mat * loss_mask, dim=-1).mean()
    raise ValueError(f"invalid loss_agg_mode: {loss_agg_mode}")


def compute_policy_loss(old_log_prob, log_prob, advantages, response_mask, cliprange=0.2, clip_ratio_c=3.0,
                        loss_agg_mode="token-mean"):
    negative_approx_kl = log_prob - old_log_prob
    ratio = torch.exp(negative_approx_kl)
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - cliprange, 1 + cliprange)
    clip_pg_losses1 = torch.min(pg_losses1, pg_losses2)  # expect: RLG005
    pg_losses3 = -advantages * clip_ratio_c
    clip_pg_losses2 = torch.min(pg_losses3, clip_pg_losses1)
    pg_losses = torch.where(advantages < 0, clip_pg_losses2, clip_pg_losses1)
    return agg_loss(pg_losses, response_mask, loss_agg_mode)


def entropy_from_logits(logits):
    pd = torch.nn.functional.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - torch.sum(pd * logits, dim=-1)


def actor_loss(data, log_prob, logits, entropy_coeff=0.001, loss_agg_mode="token-mean"):
    response_mask = data["response_mask"]
    pg_loss = compute_policy_loss(data["old_log_probs"], log_prob, data["advantages"], response_mask,
                                  loss_agg_mode=loss_agg_mode)
    entropy = entropy_from_logits(logits)
    entropy_loss = agg_loss(entropy, response_mask, loss_agg_mode)
    policy_loss = pg_loss + entropy_loss * entropy_coeff  # expect: RLG004
    return policy_loss
