"""PPO actor training in the style of OpenRLHF (REINFORCE++ advantages, KL in the reward, EMA of the actor).

Log-probs: ``Actor.forward`` returns the log-probs of the last ``num_actions`` tokens, aligned to
``sequences[:, -num_actions:]``; ``action_mask`` covers exactly those response tokens.

The policy loss sums the token losses of each sequence and normalises by the constant generation budget
(``generate_max_len``), then averages over sequences. Micro-batches all hold ``micro_train_batch_size``
sequences (``drop_last=True``), so dividing each micro-batch loss by ``accumulation_steps`` gives exactly the
loss of the whole batch.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader


def masked_mean(tensor, mask, dim=None):
    if dim is None:
        return (tensor * mask).sum() / mask.sum().clamp(min=1)
    return (tensor * mask).sum(dim=dim) / mask.sum(dim=dim).clamp(min=1)


def log_probs_from_logits(logits, labels):
    log_probs = F.log_softmax(logits.float(), dim=-1)
    return log_probs.gather(dim=-1, index=labels.unsqueeze(-1)).squeeze(-1)


def compute_approx_kl(log_probs, log_probs_base, action_mask=None, kl_estimator="k1"):
    log_ratio = log_probs.float() - log_probs_base.float()
    if kl_estimator == "k3":
        log_ratio = -log_ratio
        log_ratio = log_ratio.exp() - 1 - log_ratio
    if action_mask is not None:
        log_ratio = log_ratio * action_mask
    return log_ratio


def compute_reward(r, kl_coef, kl, action_mask):
    # KL penalty on every action token, the reward model's score on the last one.
    kl_reward = -kl_coef * kl
    eos_indices = action_mask.size(1) - 1 - action_mask.long().fliplr().argmax(dim=1, keepdim=True)
    last_reward = torch.zeros_like(kl).scatter_(dim=1, index=eos_indices, src=r.unsqueeze(1).to(kl.dtype))
    return last_reward + kl_reward


def get_cumulative_returns(rewards, action_mask, gamma=1.0):
    returns = torch.zeros_like(rewards)
    cumulative_return = torch.zeros(rewards.size(0), device=rewards.device)
    rewards = rewards * action_mask
    for t in reversed(range(rewards.size(1))):
        cumulative_return = rewards[:, t] + gamma * cumulative_return
        returns[:, t] = cumulative_return
    return returns


class Actor(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    @torch.no_grad()
    def generate(self, input_ids, attention_mask, eos_token_id, pad_token_id, **kwargs):
        sequences = self.model.generate(input_ids=input_ids, attention_mask=attention_mask, eos_token_id=eos_token_id,
                                        pad_token_id=pad_token_id, **kwargs)
        response = sequences[:, input_ids.size(1):]
        is_eos = response.eq(eos_token_id).long()
        after_eos = (is_eos.cumsum(dim=1) - is_eos) > 0
        action_mask = (~after_eos).long()
        full_attention_mask = torch.cat([attention_mask, action_mask], dim=1)
        return sequences, full_attention_mask, action_mask

    def forward(self, sequences, num_actions, attention_mask):
        position_ids = attention_mask.long().cumsum(-1) - 1
        position_ids.masked_fill_(attention_mask == 0, 1)
        output = self.model(sequences, attention_mask=attention_mask, position_ids=position_ids)
        log_probs = log_probs_from_logits(output["logits"][:, :-1, :], sequences[:, 1:])
        return log_probs[:, -num_actions:]


class PolicyLoss(nn.Module):
    def __init__(self, clip_eps=0.2, generate_max_len=1024):
        super().__init__()
        self.clip_eps = clip_eps
        self.generate_max_len = generate_max_len

    def forward(self, log_probs, old_log_probs, advantages, action_mask):
        ratio = (log_probs - old_log_probs).exp()
        pg_losses = -advantages * ratio
        pg_losses2 = -advantages * ratio.clamp(1 - self.clip_eps, 1 + self.clip_eps)
        loss = torch.max(pg_losses, pg_losses2)
        # token sum per sequence over a constant length budget, mean over sequences
        return (loss * action_mask).sum(dim=-1).mean() / self.generate_max_len


class ActorPPOTrainer:
    def __init__(self, actor, initial_model, reward_model, ema_model, actor_optim, actor_scheduler,
                 micro_train_batch_size=4, train_batch_size=64, max_epochs=1, kl_coef=0.01, gamma=1.0,
                 eps_clip=0.2, generate_max_len=1024, max_norm=1.0, ema_beta=0.992):
        self.actor = actor
        self.initial_model = initial_model
        self.reward_model = reward_model
        self.ema_model = ema_model
        self.actor_optim = actor_optim
        self.actor_scheduler = actor_scheduler
        self.micro_train_batch_size = micro_train_batch_size
        self.accumulation_steps = train_batch_size // micro_train_batch_size
        self.max_epochs = max_epochs
        self.kl_coef = kl_coef
        self.gamma = gamma
        self.max_norm = max_norm
        self.ema_beta = ema_beta
        self.actor_loss_fn = PolicyLoss(eps_clip, generate_max_len)

    @torch.no_grad()
    def make_experience(self, input_ids, attention_mask, **generate_kwargs):
        self.actor.eval()
        sequences, attention_mask, action_mask = self.actor.generate(input_ids, attention_mask, **generate_kwargs)
        num_actions = action_mask.size(1)
        action_log_probs = self.actor(sequences, num_actions, attention_mask)
        base_action_log_probs = self.initial_model(sequences, num_actions, attention_mask)
        r = self.reward_model(sequences, attention_mask)

        kl = compute_approx_kl(action_log_probs, base_action_log_probs, action_mask=action_mask)
        reward = compute_reward(r, self.kl_coef, kl, action_mask=action_mask)
        returns = get_cumulative_returns(reward, action_mask, self.gamma)
        # REINFORCE++: whiten the returns over the whole batch (no groups here)
        mean = masked_mean(returns, action_mask)
        var = masked_mean((returns - mean) ** 2, action_mask)
        advantages = (returns - mean) * torch.rsqrt(var + 1e-8) * action_mask
        info = {"kl": masked_mean(kl, action_mask, dim=-1), "reward": r, "response_length": action_mask.sum(-1)}
        self.actor.train()
        return dict(sequences=sequences, action_log_probs=action_log_probs, advantages=advantages,
                    attention_mask=attention_mask, action_mask=action_mask, info=info)

    def ppo_train(self, replay_buffer):
        dataloader = DataLoader(replay_buffer, batch_size=self.micro_train_batch_size, shuffle=True, drop_last=True,
                                collate_fn=replay_buffer.collate_fn)
        self.actor_optim.zero_grad()
        step = 0
        status_list = []
        for epoch in range(self.max_epochs):
            for experience in dataloader:
                status = self.training_step(experience)
                step += 1
                if step % self.accumulation_steps == 0:
                    nn.utils.clip_grad_norm_(self.actor.parameters(), self.max_norm)
                    self.actor_optim.step()
                    self.actor_optim.zero_grad()
                    self.actor_scheduler.step()
                    if self.ema_model is not None:
                        self.moving_average(self.actor, self.ema_model, self.ema_beta)
                status_list.append(status)
        return status_list

    def training_step(self, experience):
        self.actor.train()
        num_actions = experience["action_mask"].size(1)
        action_log_probs = self.actor(experience["sequences"], num_actions, experience["attention_mask"])
        actor_loss = self.actor_loss_fn(action_log_probs, experience["action_log_probs"], experience["advantages"],
                                        action_mask=experience["action_mask"])
        loss = actor_loss / self.accumulation_steps
        loss.backward()
        return {"policy_loss": actor_loss.item(), "lr": self.actor_scheduler.get_last_lr()[0]}

    @torch.no_grad()
    def moving_average(self, model, model_ema, beta=0.992):
        for param, param_ema in zip(model.parameters(), model_ema.parameters()):
            if param.requires_grad:
                param_ema.data.mul_(beta).add_(param.data, alpha=1 - beta)
