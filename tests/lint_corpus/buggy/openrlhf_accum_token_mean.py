"""OpenRLHF-style actor update: each micro-batch loss is a token mean over that micro-batch, then divided by
the number of accumulation steps (RLG006): micro-batches with few tokens weigh as much as long ones."""

import torch
import torch.nn as nn


def masked_mean(tensor, mask, dim=None):
    if dim is None:
        return (tensor * mask).sum() / mask.sum()
    return (tensor * mask).sum(dim=dim) / mask.sum(dim=dim)


class PolicyLoss(nn.Module):
    def __init__(self, clip_eps=0.2):
        super().__init__()
        self.clip_eps = clip_eps

    def forward(self, log_probs, old_log_probs, advantages, action_mask):
        ratio = (log_probs - old_log_probs).exp()
        surr1 = ratio * advantages
        surr2 = ratio.clamp(1 - self.clip_eps, 1 + self.clip_eps) * advantages
        loss = -torch.min(surr1, surr2)
        return masked_mean(loss, action_mask)


class ActorPPOTrainer:
    def __init__(self, actor, actor_optim, micro_train_batch_size=4, train_batch_size=64, eps_clip=0.2):
        self.actor = actor
        self.actor_optim = actor_optim
        self.accumulation_steps = train_batch_size // micro_train_batch_size
        self.actor_loss_fn = PolicyLoss(eps_clip)

    def ppo_train(self, dataloader, max_epochs=1):
        step = 0
        self.actor_optim.zero_grad()
        for epoch in range(max_epochs):
            for experience in dataloader:
                self.training_step(experience)
                step += 1
                if step % self.accumulation_steps == 0:
                    nn.utils.clip_grad_norm_(self.actor.parameters(), 1.0)
                    self.actor_optim.step()
                    self.actor_optim.zero_grad()

    def training_step(self, experience):
        num_actions = experience.action_mask.size(1)
        action_log_probs = self.actor(experience.sequences, num_actions, attention_mask=experience.attention_mask)
        actor_loss = self.actor_loss_fn(action_log_probs, experience.action_log_probs, experience.advantages,
                                        action_mask=experience.action_mask)
        loss = actor_loss / self.accumulation_steps  # expect: RLG006
        loss.backward()
        return loss.item()
