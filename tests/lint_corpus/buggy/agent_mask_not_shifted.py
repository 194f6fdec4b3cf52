"""Multi-turn agent GRPO: the action mask is taken from ``owner[:, :-1]`` (who wrote the *input* token) instead
of ``owner[:, 1:]`` (who wrote the predicted token), so every policy span is off by one (RLG001)."""

import torch
import torch.nn.functional as F

PROMPT, POLICY, ENV, PAD = 0, 1, 2, 3


def token_log_probs(logits, ids):
    log_probs = F.log_softmax(logits[:, :-1], dim=-1)
    return log_probs.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)


def grpo_loss(model, ids, owner, old_logps, ref_logps, advantages, clip_eps=0.2, kl_coef=0.02):
    action_mask = (owner[:, :-1] == POLICY).float()  # expect: RLG001
    logits = model(ids, attention_mask=(owner != PAD).long()).logits
    logps = token_log_probs(logits, ids)
    ratio = torch.exp(logps - old_logps)
    adv = advantages.unsqueeze(1)
    pg_losses = -torch.min(ratio * adv, torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps) * adv)
    log_ratio_ref = ref_logps - logps
    per_token_kl = torch.exp(log_ratio_ref) - log_ratio_ref - 1
    per_token_loss = pg_losses + kl_coef * per_token_kl
    return (per_token_loss * action_mask).sum() / action_mask.sum()


def train_step(model, optimizer, ids, owner, old_logps, ref_logps, advantages):
    optimizer.zero_grad(set_to_none=True)
    loss = grpo_loss(model, ids, owner, old_logps, ref_logps, advantages)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    return loss.item()
