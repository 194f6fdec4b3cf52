"""RLOO-style trainer whose "reference" is the live policy (RLG008), and whose token log-probs gather the
logits at position t against the token at position t instead of t + 1 (RLG012)."""

import torch
import torch.nn.functional as F


def token_logprobs(model, query_responses, attention_mask):
    logits = model(input_ids=query_responses, attention_mask=attention_mask).logits
    return torch.gather(F.log_softmax(logits, dim=-1), 2, query_responses.unsqueeze(-1)).squeeze(-1)  # expect: RLG012


class RLOOTrainer:
    def __init__(self, policy, optimizer, rloo_k=4, kl_coef=0.05):
        self.policy = policy
        self.ref_policy = policy  # expect: RLG008
        self.optimizer = optimizer
        self.rloo_k = rloo_k
        self.kl_coef = kl_coef

    def step(self, query_responses, attention_mask, response_mask, scores):
        k = self.rloo_k
        with torch.no_grad():
            logprobs = token_logprobs(self.policy, query_responses, attention_mask)
            ref_logprobs = token_logprobs(self.ref_policy, query_responses, attention_mask)
            kl = ((logprobs - ref_logprobs) * response_mask).sum(1)
            rlhf_reward = scores - self.kl_coef * kl
            rewards = rlhf_reward.view(-1, k)
            baseline = (rewards.sum(1, keepdim=True) - rewards) / (k - 1)
            advantages = (rewards - baseline).flatten()

        new_logprobs = token_logprobs(self.policy, query_responses, attention_mask)
        loss = -(advantages * (new_logprobs * response_mask).sum(1)).mean()
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        return loss.item()
