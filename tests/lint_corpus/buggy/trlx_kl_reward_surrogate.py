"""trlx-style PPO: the KL to the reference enters the reward with a positive sign (a KL *bonus*, RLG011), and
the clipped surrogate objective is used as the loss without negation (RLG005)."""

import torch
import torch.nn.functional as F


def logprobs_of_labels(logits, labels):
    logprobs = F.log_softmax(logits, dim=-1)
    return torch.gather(logprobs, dim=-1, index=labels.unsqueeze(-1)).squeeze(-1)


class PPOTrainer:
    def __init__(self, model, ref_model, kl_ctl, cliprange=0.2, vf_coef=1.0):
        self.model = model
        self.ref_model = ref_model
        self.kl_ctl = kl_ctl
        self.cliprange = cliprange
        self.vf_coef = vf_coef

    @torch.no_grad()
    def make_experience(self, all_tokens, attention_mask, scores, start):
        logits = self.model(all_tokens, attention_mask=attention_mask).logits
        ref_logits = self.ref_model(all_tokens, attention_mask=attention_mask).logits
        logprobs = logprobs_of_labels(logits[:, :-1, :], all_tokens[:, 1:])
        ref_logprobs = logprobs_of_labels(ref_logits[:, :-1, :], all_tokens[:, 1:])
        rewards = self.kl_ctl.value * (logprobs - ref_logprobs)  # expect: RLG011
        response_mask = attention_mask[:, start + 1:]
        rewards = rewards[:, start:] * response_mask
        last = response_mask.sum(1).long() - 1
        rewards[torch.arange(rewards.size(0)), last] += scores
        return logprobs[:, start:], rewards

    def loss(self, logprobs, values, old_logprobs, old_values, advantages, returns, mask):
        n = mask.sum()
        values_clipped = torch.clamp(values, old_values - self.cliprange, old_values + self.cliprange)
        vf_loss1 = (values - returns) ** 2
        vf_loss2 = (values_clipped - returns) ** 2
        vf_loss = 0.5 * torch.sum(torch.max(vf_loss1, vf_loss2) * mask) / n

        log_ratio = (logprobs - old_logprobs) * mask
        ratio = torch.exp(log_ratio)
        surrogate = torch.min(advantages * ratio, advantages * torch.clamp(ratio, 1.0 - self.cliprange, 1.0 + self.cliprange))
        pg_loss = torch.sum(surrogate * mask) / n  # expect: RLG005
        loss = pg_loss + self.vf_coef * vf_loss
        return loss
