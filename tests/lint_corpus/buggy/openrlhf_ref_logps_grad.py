"""OpenRLHF-style GRPO experience maker: the reference log-probs are computed with autograd on (RLG003).
The behaviour log-probs and the rewards are computed under ``torch.no_grad()``; the reference forward is not.
The KL to the reference is a loss term here (``use_kl_loss``), not part of the reward."""

import torch
import torch.nn as nn


def masked_mean(tensor, mask, dim=None):
    if dim is None:
        return (tensor * mask).sum() / mask.sum()
    return (tensor * mask).sum(dim=dim) / mask.sum(dim=dim)


def compute_approx_kl(log_probs, log_probs_base, kl_estimator="k3"):
    log_ratio = log_probs.float() - log_probs_base.float()
    if kl_estimator == "k3":
        log_ratio = -log_ratio
        log_ratio = log_ratio.exp() - 1 - log_ratio
    return log_ratio


class GRPOExperienceMaker:
    def __init__(self, actor, initial_model, reward_model, n_samples_per_prompt=8):
        self.actor = actor
        self.initial_model = initial_model
        self.reward_model = reward_model
        self.n_samples_per_prompt = n_samples_per_prompt

    def make_experience(self, sequences, attention_mask, action_mask):
        num_actions = action_mask.size(1)
        with torch.no_grad():
            action_log_probs = self.actor(sequences, num_actions, attention_mask)
            r = self.reward_model(sequences, attention_mask)
        base_action_log_probs = self.initial_model(sequences, num_actions, attention_mask)  # expect: RLG003

        rewards = r.view(-1, self.n_samples_per_prompt)
        rewards = (rewards - rewards.mean(-1, keepdim=True)) / (rewards.std(-1, keepdim=True) + 1e-9)
        advantages = rewards.reshape(-1, 1) * action_mask
        return dict(sequences=sequences, attention_mask=attention_mask, action_mask=action_mask,
                    action_log_probs=action_log_probs, base_action_log_probs=base_action_log_probs,
                    advantages=advantages)


def actor_loss(actor, experience, kl_coef=0.001, clip_eps=0.2):
    action_mask = experience["action_mask"]
    log_probs = actor(experience["sequences"], action_mask.size(1), experience["attention_mask"])
    ratio = (log_probs - experience["action_log_probs"]).exp()
    surr1 = ratio * experience["advantages"]
    surr2 = ratio.clamp(1 - clip_eps, 1 + clip_eps) * experience["advantages"]
    pg_loss = masked_mean(-torch.min(surr1, surr2), action_mask)
    kl = compute_approx_kl(log_probs, experience["base_action_log_probs"], kl_estimator="k3")
    kl_loss = masked_mean(kl, action_mask)
    return pg_loss + kl_loss * kl_coef
