"""Hand-written PPO step with full-length buffers: log-probs stored at prediction positions (slot t scores
ids[t + 1]); the loss mask over ``ids`` is rolled one step right instead of one step left (RLG001)."""

import torch
import torch.nn.functional as F


def prediction_logps(model, ids):
    logits = model(ids).logits
    token_logp = torch.gather(F.log_softmax(logits[:, :-1], dim=-1), 2, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    return F.pad(token_logp, (0, 1))


def ppo_step(model, optimizer, ids, loss_mask, old_logps, advantages, clip_eps=0.2):
    """``loss_mask`` [B, T] marks the policy's tokens in ``ids``; ``old_logps`` [B, T] like prediction_logps."""
    mask = torch.roll(loss_mask, shifts=1, dims=-1)  # expect: RLG001
    mask[:, -1] = 0
    logps = prediction_logps(model, ids)
    ratio = torch.exp(logps - old_logps)
    adv = advantages.unsqueeze(1)
    pg_losses = -torch.min(ratio * adv, torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps) * adv)
    loss = (pg_losses * mask).sum() / mask.sum()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return loss.item()
