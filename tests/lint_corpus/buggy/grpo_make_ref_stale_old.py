"""Hand-written GRPO with several optimisation passes per batch (``num_iterations``): the reference comes from
a ``make_ref`` helper that returns the policy itself (RLG008), and the old log-probs are the detached current
log-probs recomputed in every pass, so the ratio is always 1 (RLG002)."""

import torch
import torch.nn.functional as F


def make_ref(model):
    """Reference model for the KL penalty."""
    model.eval()
    return model


def per_token_logps(model, input_ids, attention_mask, logits_to_keep):
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1]
    logps = torch.gather(F.log_softmax(logits, dim=-1), 2, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    return logps[:, -logits_to_keep:]


class GRPOLoop:
    def __init__(self, model, optimizer, num_iterations=4, beta=0.04, epsilon=0.2):
        self.model = model
        self.ref_model = make_ref(model)  # expect: RLG008
        self.optimizer = optimizer
        self.num_iterations = num_iterations
        self.beta = beta
        self.epsilon = epsilon

    def train_on_batch(self, batches):
        with torch.no_grad():
            for b in batches:
                b["ref_per_token_logps"] = per_token_logps(self.ref_model, b["input_ids"], b["attention_mask"],
                                                           b["completion_mask"].size(1))
        self.model.train()
        for _ in range(self.num_iterations):
            for b in batches:
                completion_mask = b["completion_mask"]
                logps = per_token_logps(self.model, b["input_ids"], b["attention_mask"], completion_mask.size(1))
                old_per_token_logps = logps.detach()  # expect: RLG002
                coef_1 = torch.exp(logps - old_per_token_logps)
                coef_2 = torch.clamp(coef_1, 1 - self.epsilon, 1 + self.epsilon)
                adv = b["advantages"].unsqueeze(1)
                ref_logps = b["ref_per_token_logps"]
                per_token_kl = torch.exp(ref_logps - logps) - (ref_logps - logps) - 1
                per_token_loss = -torch.min(coef_1 * adv, coef_2 * adv) + self.beta * per_token_kl
                loss = (per_token_loss * completion_mask).sum() / completion_mask.sum()
                self.optimizer.zero_grad()
                loss.backward()
                self.optimizer.step()
