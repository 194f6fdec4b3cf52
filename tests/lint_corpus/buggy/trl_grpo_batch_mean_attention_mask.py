"""TRL-style GRPO: advantages centred on the whole batch (RLG009) and the [B, T] attention mask used as the
loss mask of [B, T-1] log-probs (RLG001)."""

import torch
import torch.nn.functional as F


def selective_log_softmax(logits, index):
    return torch.gather(logits.log_softmax(-1), dim=-1, index=index.unsqueeze(-1)).squeeze(-1)


class GRPOTrainer:
    def __init__(self, args):
        self.num_generations = args.num_generations
        self.temperature = args.temperature
        self.beta = args.beta
        self.epsilon = args.epsilon
        self._metrics = {"reward_std": []}

    def _get_per_token_logps(self, model, input_ids, attention_mask):
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
        logits = logits[:, :-1, :] / self.temperature
        return selective_log_softmax(logits, input_ids[:, 1:])

    def _compute_advantages(self, rewards):
        # rewards: [B], the num_generations completions of one prompt are contiguous
        std_grouped_rewards = rewards.view(-1, self.num_generations).std(dim=1)
        advantages = (rewards - rewards.mean()) / (rewards.std() + 1e-4)  # expect: RLG009
        self._metrics["reward_std"].append(std_grouped_rewards.mean().item())
        return advantages

    def compute_loss(self, model, inputs):
        input_ids, attention_mask = inputs["input_ids"], inputs["attention_mask"]
        per_token_logps = self._get_per_token_logps(model, input_ids, attention_mask)
        old_per_token_logps = inputs["old_per_token_logps"]
        ref_per_token_logps = inputs["ref_per_token_logps"]
        advantages = inputs["advantages"]

        per_token_kl = torch.exp(ref_per_token_logps - per_token_logps) - (ref_per_token_logps - per_token_logps) - 1
        coef_1 = torch.exp(per_token_logps - old_per_token_logps)
        coef_2 = torch.clamp(coef_1, 1 - self.epsilon, 1 + self.epsilon)
        per_token_loss = -torch.min(coef_1 * advantages.unsqueeze(1), coef_2 * advantages.unsqueeze(1))
        per_token_loss = per_token_loss + self.beta * per_token_kl
        loss = (per_token_loss * attention_mask).sum() / attention_mask.sum()  # expect: RLG001
        return loss
