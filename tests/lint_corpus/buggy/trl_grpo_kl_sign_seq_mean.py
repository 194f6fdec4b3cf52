"""TRL-style GRPO loss: the KL penalty subtracted from the minimised loss (RLG011) and the loss averaged as the
mean over sequences of per-sequence token means (RLG010)."""

import torch


class GRPOTrainer:
    def __init__(self, args):
        self.beta = args.beta
        self.epsilon = args.epsilon
        self.temperature = args.temperature

    def _get_per_token_logps(self, model, input_ids, attention_mask, logits_to_keep):
        logits = model(input_ids=input_ids, attention_mask=attention_mask, logits_to_keep=logits_to_keep + 1).logits
        logits = logits[:, :-1, :]
        input_ids = input_ids[:, -logits_to_keep:]
        logits = logits[:, -logits_to_keep:] / self.temperature
        return torch.gather(logits.log_softmax(-1), 2, input_ids.unsqueeze(-1)).squeeze(-1)

    def compute_loss(self, model, inputs):
        prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"]
        completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
        attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
        logits_to_keep = completion_ids.size(1)
        per_token_logps = self._get_per_token_logps(model, input_ids, attention_mask, logits_to_keep)

        ref_per_token_logps = inputs["ref_per_token_logps"]
        per_token_kl = torch.exp(ref_per_token_logps - per_token_logps) - (ref_per_token_logps - per_token_logps) - 1

        advantages = inputs["advantages"]
        old_per_token_logps = inputs["old_per_token_logps"]
        coef_1 = torch.exp(per_token_logps - old_per_token_logps)
        coef_2 = torch.clamp(coef_1, 1 - self.epsilon, 1 + self.epsilon)
        per_token_loss = torch.min(coef_1 * advantages.unsqueeze(1), coef_2 * advantages.unsqueeze(1))
        per_token_loss = -(per_token_loss + self.beta * per_token_kl)  # expect: RLG011
        loss = ((per_token_loss * completion_mask).sum(dim=1) / completion_mask.sum(dim=1)).mean()  # expect: RLG010
        return loss
