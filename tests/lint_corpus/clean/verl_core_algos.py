"""Core PPO/GRPO functions in the style of verl's ``trainer/ppo/core_algos.py`` plus the actor's update loop.

Every per-token tensor is [bs, response_length], aligned to the response tokens (``response_mask``).
"""

from collections import defaultdict

import numpy as np
import torch


def masked_mean(values, mask, axis=None):
    return (values * mask).sum(axis=axis) / mask.sum(axis=axis).clamp(min=1)


def masked_whiten(values, mask, shift_mean=True):
    mean = masked_mean(values, mask)
    var = masked_mean((values - mean) ** 2, mask)
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        whitened += mean
    return whitened


def compute_grpo_outcome_advantage(token_level_rewards, response_mask, index, epsilon=1e-6,
                                   norm_adv_by_std_in_grpo=True):
    """Outcome reward per response, centred (and scaled) within the responses that share a prompt uid."""
    scores = token_level_rewards.sum(dim=-1)
    id2score = defaultdict(list)
    id2mean = {}
    id2std = {}
    with torch.no_grad():
        bsz = scores.shape[0]
        for i in range(bsz):
            id2score[index[i]].append(scores[i])
        for idx in id2score:
            if len(id2score[idx]) == 1:
                id2mean[idx] = torch.tensor(0.0)
                id2std[idx] = torch.tensor(1.0)
            elif len(id2score[idx]) > 1:
                id2mean[idx] = torch.mean(torch.tensor(id2score[idx]))
                id2std[idx] = torch.std(torch.tensor([id2score[idx]]))
            else:
                raise ValueError(f"no score in prompt index: {idx}")
        for i in range(bsz):
            if norm_adv_by_std_in_grpo:
                scores[i] = (scores[i] - id2mean[index[i]]) / (id2std[index[i]] + epsilon)
            else:
                scores[i] = scores[i] - id2mean[index[i]]
        scores = scores.unsqueeze(-1) * response_mask
    return scores, scores


def compute_gae_advantage_return(token_level_rewards, values, response_mask, gamma, lam):
    with torch.no_grad():
        lastgaelam = 0
        advantages_reversed = []
        gen_len = token_level_rewards.shape[-1]
        for t in reversed(range(gen_len)):
            nextvalues = values[:, t + 1] if t < gen_len - 1 else 0.0
            delta = token_level_rewards[:, t] + gamma * nextvalues - values[:, t]
            lastgaelam = delta + gamma * lam * lastgaelam
            advantages_reversed.append(lastgaelam)
        advantages = torch.stack(advantages_reversed[::-1], dim=1)
        returns = advantages + values
        advantages = masked_whiten(advantages, response_mask)
    return advantages, returns


def agg_loss(loss_mat, loss_mask, loss_agg_mode="token-mean", num_tokens=None, num_seqs=None, max_len=None):
    """Aggregate a [bs, len] loss. ``num_tokens``/``num_seqs`` are the mini-batch totals when the loss of one
    micro-batch is accumulated: each micro-batch then contributes its share of the mini-batch loss."""
    if loss_agg_mode == "token-mean":
        denom = loss_mask.sum() if num_tokens is None else num_tokens
        loss = (loss_mat * loss_mask).sum() / denom
    elif loss_agg_mode == "seq-mean-token-sum":
        seq_losses = torch.sum(loss_mat * loss_mask, dim=-1)
        loss = seq_losses.sum() / (seq_losses.numel() if num_seqs is None else num_seqs)
    elif loss_agg_mode == "seq-mean-token-sum-norm":
        seq_losses = torch.sum(loss_mat * loss_mask, dim=-1) / (max_len or loss_mask.shape[-1])
        loss = seq_losses.sum() / (seq_losses.numel() if num_seqs is None else num_seqs)
    else:
        raise ValueError(f"invalid loss_agg_mode: {loss_agg_mode}")
    return loss


def compute_policy_loss(old_log_prob, log_prob, advantages, response_mask, cliprange=0.2, cliprange_low=None,
                        cliprange_high=None, clip_ratio_c=3.0, loss_agg_mode="token-mean", **agg_kwargs):
    """PPO clipped surrogate with dual clip (https://arxiv.org/pdf/1912.09729) for negative advantages."""
    assert clip_ratio_c > 1.0, f"clip_ratio_c must be > 1.0, got {clip_ratio_c}"
    cliprange_low = cliprange if cliprange_low is None else cliprange_low
    cliprange_high = cliprange if cliprange_high is None else cliprange_high

    negative_approx_kl = log_prob - old_log_prob
    ratio = torch.exp(negative_approx_kl)
    ppo_kl = masked_mean(-negative_approx_kl, response_mask)

    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - cliprange_low, 1 + cliprange_high)
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    pg_clipfrac = masked_mean(torch.gt(pg_losses2, pg_losses1).float(), response_mask)

    pg_losses3 = -advantages * clip_ratio_c
    clip_pg_losses2 = torch.min(pg_losses3, clip_pg_losses1)
    pg_clipfrac_lower = masked_mean(torch.gt(clip_pg_losses1, pg_losses3) * (advantages < 0).float(), response_mask)

    pg_losses = torch.where(advantages < 0, clip_pg_losses2, clip_pg_losses1)
    pg_loss = agg_loss(pg_losses, response_mask, loss_agg_mode, **agg_kwargs)
    return pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower


def kl_penalty(logprob, ref_logprob, kl_penalty="low_var_kl"):
    if kl_penalty in ("kl", "k1"):
        return logprob - ref_logprob
    if kl_penalty == "abs":
        return (logprob - ref_logprob).abs()
    if kl_penalty in ("mse", "k2"):
        return 0.5 * (logprob - ref_logprob).square()
    if kl_penalty in ("low_var_kl", "k3"):
        kl = ref_logprob - logprob
        kl = torch.clamp(kl, min=-20, max=20)
        ratio = torch.exp(kl)
        kld = ratio - kl - 1
        return torch.clamp(kld, min=-10, max=10)
    raise NotImplementedError(kl_penalty)


def entropy_from_logits(logits):
    pd = torch.nn.functional.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - torch.sum(pd * logits, dim=-1)


def update_policy(actor, actor_optimizer, mini_batches, config):
    """One PPO update over pre-computed mini-batches; micro-batches accumulate one mini-batch's gradient."""
    metrics = defaultdict(list)
    actor.actor_module.train()
    for epoch in range(config.ppo_epochs):
        for mini_batch in mini_batches:
            # Mini-batch totals, so that the micro-batch losses add up to one token mean per mini-batch.
            agg_kwargs = {"num_tokens": mini_batch["response_mask"].sum().clamp(min=1),
                          "num_seqs": mini_batch["response_mask"].shape[0],
                          "max_len": config.response_length}
            actor_optimizer.zero_grad()
            for data in mini_batch.split(config.ppo_micro_batch_size_per_gpu):
                response_mask = data["response_mask"]
                old_log_prob = data["old_log_probs"]
                advantages = data["advantages"]
                entropy, log_prob = actor.forward_micro_batch(data, temperature=config.temperature,
                                                              calculate_entropy=True)
                pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower = compute_policy_loss(
                    old_log_prob, log_prob, advantages, response_mask, cliprange=config.clip_ratio,
                    clip_ratio_c=config.clip_ratio_c, loss_agg_mode=config.loss_agg_mode, **agg_kwargs)
                if config.entropy_coeff != 0:
                    entropy_loss = agg_loss(entropy, response_mask, config.loss_agg_mode, **agg_kwargs)
                    policy_loss = pg_loss - entropy_loss * config.entropy_coeff
                else:
                    policy_loss = pg_loss
                if config.use_kl_loss:
                    ref_log_prob = data["ref_log_prob"]
                    kld = kl_penalty(log_prob, ref_log_prob, kl_penalty=config.kl_loss_type)
                    kl_loss = agg_loss(kld, response_mask, config.loss_agg_mode, **agg_kwargs)
                    policy_loss = policy_loss + kl_loss * config.kl_loss_coef
                    metrics["actor/kl_loss"].append(kl_loss.detach().item())
                policy_loss.backward()
                metrics["actor/pg_loss"].append(pg_loss.detach().item())
                metrics["actor/pg_clipfrac"].append(pg_clipfrac.detach().item())
                metrics["actor/ppo_kl"].append(ppo_kl.detach().item())
            grad_norm = torch.nn.utils.clip_grad_norm_(actor.actor_module.parameters(), max_norm=config.grad_clip)
            if torch.isfinite(grad_norm):
                actor_optimizer.step()
            metrics["actor/grad_norm"].append(grad_norm.detach().item())
    actor_optimizer.zero_grad()
    return {k: float(np.mean(v)) for k, v in metrics.items()}
