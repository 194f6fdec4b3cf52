"""OpenRLHF-style actor that keeps every per-token buffer at full length [B, T]. Log-probs are stored at
*prediction* positions: slot t holds log p(ids[t + 1] | ids[:t + 1]) (last slot 0), so the response mask over
``sequences`` must move one step left (``F.pad(mask[:, 1:], (0, 1))``); it is moved one step right instead
(RLG001). The policy loss is the mean over sequences of per-sequence token means (RLG010)."""

import torch
import torch.nn as nn
import torch.nn.functional as F


def masked_mean(tensor, mask, dim=None):
    if dim is None:
        return (tensor * mask).sum() / mask.sum()
    return (tensor * mask).sum(dim=dim) / mask.sum(dim=dim)


class Actor(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, sequences, attention_mask):
        logits = self.model(sequences, attention_mask=attention_mask).logits
        token_logp = F.log_softmax(logits[:, :-1], dim=-1).gather(-1, sequences[:, 1:].unsqueeze(-1)).squeeze(-1)
        return F.pad(token_logp, (0, 1))


class PolicyLoss(nn.Module):
    def __init__(self, clip_eps=0.2):
        super().__init__()
        self.clip_eps = clip_eps

    def forward(self, log_probs, old_log_probs, advantages, action_mask):
        ratio = (log_probs - old_log_probs).exp()
        surr1 = ratio * advantages
        surr2 = ratio.clamp(1 - self.clip_eps, 1 + self.clip_eps) * advantages
        loss = -torch.min(surr1, surr2)
        loss = masked_mean(loss, action_mask, dim=-1).mean()  # expect: RLG010
        return loss


def training_step(actor, actor_optim, loss_fn, experience):
    response_mask = experience["response_mask"]
    action_mask = F.pad(response_mask, (1, 0))[:, :-1]  # expect: RLG001
    log_probs = actor(experience["sequences"], experience["attention_mask"])
    loss = loss_fn(log_probs, experience["old_log_probs"], experience["advantages"], action_mask)
    actor_optim.zero_grad()
    loss.backward()
    actor_optim.step()
    return loss.item()
