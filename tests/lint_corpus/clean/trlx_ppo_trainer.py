"""PPO for language models in the style of trlx's ``AcceleratePPOTrainer`` and ``PPOConfig.loss``.

``logprobs_of_labels(logits[:, :-1], tokens[:, 1:])`` is aligned to ``tokens[:, 1:]``: the log-prob at index j
is that of token j + 1, so the response window ``[start, end)`` of the log-probs matches
``attention_mask[:, start + 1:end + 1]``.
"""

import torch
import torch.nn.functional as F

from trlx.data.ppo_types import PPORLElement
from trlx.utils.modeling import flatten_dict, get_tensor_stats, whiten


def logprobs_of_labels(logits, labels):
    logprobs = F.log_softmax(logits, dim=-1)
    logprobs_labels = torch.gather(logprobs, dim=-1, index=labels.unsqueeze(-1))
    return logprobs_labels.squeeze(-1)


class AdaptiveKLController:
    def __init__(self, init_kl_coef, target, horizon):
        self.value = init_kl_coef
        self.target = target
        self.horizon = horizon

    def update(self, current, n_steps):
        proportional_error = max(min(current / self.target - 1, 0.2), -0.2)
        self.value *= 1 + proportional_error * n_steps / self.horizon


class PPOMethod:
    def __init__(self, gamma=1.0, lam=0.95, cliprange=0.2, cliprange_value=0.2, vf_coef=1.0):
        self.gamma = gamma
        self.lam = lam
        self.cliprange = cliprange
        self.cliprange_value = cliprange_value
        self.vf_coef = vf_coef

    def get_advantages_and_returns(self, values, rewards, response_length, use_whitening=True):
        lastgaelam = 0
        advantages_reversed = []
        for t in reversed(range(response_length)):
            nextvalues = values[:, t + 1] if t < response_length - 1 else 0.0
            delta = rewards[:, t] + self.gamma * nextvalues - values[:, t]
            lastgaelam = delta + self.gamma * self.lam * lastgaelam
            advantages_reversed.append(lastgaelam)
        advantages = torch.stack(advantages_reversed[::-1], dim=1)
        returns = advantages + values
        if use_whitening:
            advantages = whiten(advantages)
        return advantages.detach(), returns.detach()

    def loss(self, logprobs, values, old_logprobs, old_values, advantages, returns, mask):
        values_clipped = torch.clamp(values, old_values - self.cliprange_value, old_values + self.cliprange_value)
        n = mask.sum()

        vf_loss1 = (values - returns) ** 2
        vf_loss2 = (values_clipped - returns) ** 2
        vf_loss = 0.5 * torch.sum(torch.max(vf_loss1, vf_loss2) * mask) / n
        vf_clipfrac = torch.sum((vf_loss2 > vf_loss1).float() * mask) / n

        log_ratio = (logprobs - old_logprobs) * mask
        ratio = torch.exp(log_ratio)
        with torch.no_grad():
            approx_kl = torch.mean((ratio - 1) - log_ratio)

        pg_loss1 = -advantages * ratio
        pg_loss2 = -advantages * torch.clamp(ratio, 1.0 - self.cliprange, 1.0 + self.cliprange)
        pg_loss = torch.sum(torch.max(pg_loss1, pg_loss2) * mask) / n
        pg_clipfrac = torch.sum((pg_loss2 > pg_loss1).float() * mask) / n

        loss = pg_loss + self.vf_coef * vf_loss
        stats = dict(
            losses=dict(total_loss=loss.item(), policy_loss=pg_loss.item(), value_loss=vf_loss.item()),
            values=dict(get_tensor_stats(values, mask, n), values_error=torch.sum(((values - returns) * mask) ** 2) / n,
                        clipfrac=vf_clipfrac),
            old_values=get_tensor_stats(old_values, mask, n),
            returns=get_tensor_stats(returns, mask, n),
            policy=dict(approx_kl=approx_kl.item(), clipfrac=pg_clipfrac.item()),
            ratio=(ratio * mask).sum() / n,
            padding_percentage=1 - n / mask.numel(),
        )
        return loss, flatten_dict(stats)


class AcceleratePPOTrainer:
    def __init__(self, model, ref_model, tokenizer, opt, scheduler, accelerator, config):
        self.model = model
        self.ref_model = ref_model
        self.ref_model.eval()
        self.ref_model.requires_grad_(False)
        self.tokenizer = tokenizer
        self.opt = opt
        self.scheduler = scheduler
        self.accelerator = accelerator
        self.config = config
        self.method = PPOMethod(**config.method)
        self.kl_ctl = AdaptiveKLController(config.init_kl_coef, config.target_kl, config.horizon)

    @torch.no_grad()
    def make_experience(self, query_tensors, response_tensors, scores):
        all_tokens = torch.cat((query_tensors, response_tensors), dim=1)
        attention_mask = all_tokens.not_equal(self.tokenizer.pad_token_id).long()
        logits, *_, values = self.model(all_tokens, attention_mask=attention_mask)
        ref_logits = self.ref_model(all_tokens, attention_mask=attention_mask).logits

        logprobs = logprobs_of_labels(logits[:, :-1, :], all_tokens[:, 1:])
        ref_logprobs = logprobs_of_labels(ref_logits[:, :-1, :], all_tokens[:, 1:])

        start = query_tensors.shape[1] - 1
        ends = start + attention_mask[:, start + 1:].sum(1)
        log_ratio = (logprobs - ref_logprobs) * attention_mask[:, 1:]
        self.mean_kl = (log_ratio.exp() - 1 - log_ratio).sum(1).mean()

        rewards = -self.kl_ctl.value * (logprobs - ref_logprobs)
        elements = []
        for i in range(all_tokens.shape[0]):
            end = int(ends[i])
            sample_rewards = rewards[i, start:end].clone()
            sample_rewards[-1] += scores[i]
            elements.append(PPORLElement(
                query_tensor=query_tensors[i],
                response_tensor=response_tensors[i],
                logprobs=logprobs[i, start:end],
                values=values[i, :-1][start:end],
                rewards=sample_rewards,
            ))
        return elements

    def loss(self, batch):
        query_tensors = batch.query_tensors.to(self.accelerator.device)
        response_tensors = batch.response_tensors.to(self.accelerator.device)
        old_logprobs = batch.logprobs.to(self.accelerator.device)
        old_values = batch.values.to(self.accelerator.device)
        old_rewards = batch.rewards.to(self.accelerator.device)
        response_length = old_rewards.shape[1]

        advantages, returns = self.method.get_advantages_and_returns(old_values, old_rewards, response_length)

        tokens = torch.cat((query_tensors, response_tensors), dim=1)
        attention_mask = tokens.not_equal(self.tokenizer.pad_token_id).long().to(tokens.device)
        outputs = self.model(tokens, attention_mask, return_dict=True)
        logits = outputs.logits
        values_pred = outputs.value[:, :-1]
        logprobs = logprobs_of_labels(logits[:, :-1, :], tokens[:, 1:])

        start = query_tensors.shape[1] - 1
        end = start + response_length
        logprobs, values_pred, mask = (
            logprobs[:, start:end],
            values_pred[:, start:end],
            attention_mask[:, start + 1:end + 1],
        )
        return self.method.loss(logprobs=logprobs, values=values_pred, old_logprobs=old_logprobs,
                                old_values=old_values, advantages=advantages, returns=returns, mask=mask)

    def learn(self, store, n_updates_per_batch):
        self.model.train()
        for _ in range(n_updates_per_batch):
            for mb in store.create_loader(self.config.batch_size, shuffle=True):
                loss, stats = self.loss(mb)
                self.accelerator.backward(loss)
                self.accelerator.clip_grad_norm_(self.model.parameters(), self.config.grad_clip)
                self.opt.step()
                self.opt.zero_grad()
                self.scheduler.step()
        self.model.eval()  # as trlx does after each backward: the next rollout scores in eval mode
        self.kl_ctl.update(self.mean_kl.item(), n_steps=self.config.batch_size)
        return stats
