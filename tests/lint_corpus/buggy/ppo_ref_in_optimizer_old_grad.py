"""A small PPO-for-LM trainer: the reference model's parameters are handed to the optimizer (RLG008), and the
old log-probs are computed before the epoch loop but with autograd on (RLG003)."""

import copy

import torch
import torch.nn.functional as F


def token_log_probs(model, ids, attention_mask):
    logits = model(ids, attention_mask=attention_mask).logits
    return torch.gather(F.log_softmax(logits[:, :-1], dim=-1), 2, ids[:, 1:].unsqueeze(-1)).squeeze(-1)


class PPOTrainer:
    def __init__(self, policy, lr=1e-6, kl_coef=0.05, clip_eps=0.2, ppo_epochs=4):
        self.policy = policy
        self.ref_model = copy.deepcopy(policy).eval()
        self.optimizer = torch.optim.AdamW(list(policy.parameters()) + list(self.ref_model.parameters()), lr=lr)  # expect: RLG008
        self.kl_coef = kl_coef
        self.clip_eps = clip_eps
        self.ppo_epochs = ppo_epochs

    def update(self, ids, attention_mask, response_mask, scores):
        action_mask = response_mask[:, 1:].float()
        old_logp = token_log_probs(self.policy, ids, attention_mask)  # expect: RLG003
        with torch.no_grad():
            ref_logp = token_log_probs(self.ref_model, ids, attention_mask)
            kl = ((old_logp.detach() - ref_logp) * action_mask).sum(1)
            rewards = scores - self.kl_coef * kl
            advantages = rewards.unsqueeze(1)
        for epoch in range(self.ppo_epochs):
            logp = token_log_probs(self.policy, ids, attention_mask)
            ratio = torch.exp(logp - old_logp)
            pg_losses = -torch.min(ratio * advantages, torch.clamp(ratio, 1 - self.clip_eps, 1 + self.clip_eps) * advantages)
            loss = (pg_losses * action_mask).sum() / action_mask.sum()
            self.optimizer.zero_grad()
            loss.backward()
            self.optimizer.step()
