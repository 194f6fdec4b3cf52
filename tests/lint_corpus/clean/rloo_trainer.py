"""A minimal REINFORCE trainer with the RLOO leave-one-out baseline.

Each prompt is sampled ``k`` times (``repeat_interleave``: the k samples of a prompt are contiguous), so the
rewards reshape to [num_prompts, k]. The sequence-level KL to the reference enters the reward; the loss is
REINFORCE on the summed log-probs of each response.
"""

import copy
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class RLOOConfig:
    rloo_k: int = 4
    kl_coef: float = 0.05
    temperature: float = 1.0
    max_new_tokens: int = 256
    lr: float = 1e-6
    max_grad_norm: float = 1.0


def sequence_token_logps(model, input_ids, attention_mask, temperature):
    """log p(input_ids[:, t + 1] | input_ids[:, :t + 1]) for every t -> [B, T - 1]."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
    logits = logits[:, :-1] / temperature
    return torch.gather(F.log_softmax(logits, dim=-1), 2, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)


def response_mask_of(input_ids, prompt_len, eos_token_id):
    """1 on the response tokens up to and including the first EOS, aligned to input_ids[:, 1:] -> [B, T - 1]."""
    response = input_ids[:, prompt_len:]
    is_eos = (response == eos_token_id).long()
    after_eos = (is_eos.cumsum(dim=1) - is_eos) > 0
    mask = torch.zeros_like(input_ids[:, 1:], dtype=torch.float)
    mask[:, prompt_len - 1:] = (~after_eos).float()
    return mask


class RLOOTrainer:
    def __init__(self, policy, tokenizer, reward_fn, config: RLOOConfig):
        self.policy = policy
        self.ref_policy = copy.deepcopy(policy)
        self.ref_policy.eval()
        self.ref_policy.requires_grad_(False)
        self.tokenizer = tokenizer
        self.reward_fn = reward_fn
        self.config = config
        self.optimizer = torch.optim.AdamW(self.policy.parameters(), lr=config.lr)

    @torch.no_grad()
    def rollout(self, prompt_ids, prompt_attention_mask):
        k = self.config.rloo_k
        prompt_ids = prompt_ids.repeat_interleave(k, dim=0)
        prompt_attention_mask = prompt_attention_mask.repeat_interleave(k, dim=0)
        self.policy.eval()
        query_responses = self.policy.generate(
            input_ids=prompt_ids, attention_mask=prompt_attention_mask, do_sample=True,
            temperature=self.config.temperature, top_k=0, top_p=1.0,
            max_new_tokens=self.config.max_new_tokens, pad_token_id=self.tokenizer.pad_token_id,
        )
        self.policy.train()
        prompt_len = prompt_ids.size(1)
        response_mask = response_mask_of(query_responses, prompt_len, self.tokenizer.eos_token_id)
        attention_mask = torch.cat([prompt_attention_mask, response_mask[:, prompt_len - 1:].long()], dim=1)

        logprobs = sequence_token_logps(self.policy, query_responses, attention_mask, self.config.temperature)
        ref_logprobs = sequence_token_logps(self.ref_policy, query_responses, attention_mask, self.config.temperature)
        kl = ((logprobs - ref_logprobs) * response_mask).sum(1)

        texts = self.tokenizer.batch_decode(query_responses[:, prompt_len:], skip_special_tokens=True)
        scores = torch.tensor(self.reward_fn(texts), dtype=torch.float, device=query_responses.device)
        non_score_reward = -self.config.kl_coef * kl
        rlhf_reward = scores + non_score_reward

        # leave-one-out baseline: the mean reward of the other k - 1 samples of the same prompt
        rewards = rlhf_reward.view(-1, k)
        baseline = (rewards.sum(1, keepdim=True) - rewards) / (k - 1)
        advantages = (rewards - baseline).flatten()
        stats = {"score": scores.mean().item(), "kl": kl.mean().item(), "rlhf_reward": rlhf_reward.mean().item()}
        return query_responses, attention_mask, response_mask, advantages, stats

    def step(self, prompt_ids, prompt_attention_mask):
        query_responses, attention_mask, response_mask, advantages, stats = self.rollout(prompt_ids,
                                                                                          prompt_attention_mask)
        new_logprobs = sequence_token_logps(self.policy, query_responses, attention_mask, self.config.temperature)
        seq_logprobs = (new_logprobs * response_mask).sum(1)
        loss = -(advantages * seq_logprobs).mean()

        self.optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.policy.parameters(), self.config.max_grad_norm)
        self.optimizer.step()
        stats["loss"] = loss.item()
        return stats
