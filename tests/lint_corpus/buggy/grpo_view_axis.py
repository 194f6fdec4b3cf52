"""Hand-written GRPO whose group baseline reshapes the rewards along the wrong axis (RLG009): the prompts are
repeated with ``repeat_interleave`` (groups contiguous, rewards[p * G + g]) but the rewards are viewed as
[G, P], so each "group" mean mixes samples of different prompts."""

import torch
import torch.nn.functional as F


class GRPO:
    def __init__(self, policy, optimizer, group_size=8, clip_eps=0.2):
        self.policy = policy
        self.optimizer = optimizer
        self.group_size = group_size
        self.clip_eps = clip_eps

    @torch.no_grad()
    def sample(self, prompt_ids, max_new_tokens=256):
        prompt_ids = prompt_ids.repeat_interleave(self.group_size, dim=0)
        return self.policy.generate(prompt_ids, do_sample=True, max_new_tokens=max_new_tokens)

    def advantages(self, rewards):
        mean_grouped_rewards = rewards.view(self.group_size, -1).mean(dim=0).repeat_interleave(self.group_size)  # expect: RLG009
        return rewards - mean_grouped_rewards

    def step(self, ids, response_mask, old_logps, rewards):
        with torch.no_grad():
            advantages = self.advantages(rewards)
        logits = self.policy(ids).logits
        logps = torch.gather(F.log_softmax(logits[:, :-1], -1), 2, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
        ratio = torch.exp(logps - old_logps)
        adv = advantages.unsqueeze(1)
        pg_losses = -torch.min(ratio * adv, torch.clamp(ratio, 1 - self.clip_eps, 1 + self.clip_eps) * adv)
        mask = response_mask[:, 1:]
        loss = (pg_losses * mask).sum() / mask.sum()
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        return loss.item()
