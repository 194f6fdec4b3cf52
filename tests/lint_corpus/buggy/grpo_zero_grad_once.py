"""Hand-written GRPO loop: ``zero_grad`` is called once before training, so every update applies the sum of
all gradients so far (RLG013)."""

import torch
import torch.nn.functional as F


def token_log_probs(model, ids, attention_mask):
    logits = model(ids, attention_mask=attention_mask).logits
    return F.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)


def train(model, optimizer, batches, group_size=8, clip_eps=0.2):
    model.train()
    optimizer.zero_grad()
    for batch in batches:
        ids, attention_mask = batch["ids"], batch["attention_mask"]
        action_mask = batch["response_mask"][:, 1:].float()
        with torch.no_grad():
            old_logps = token_log_probs(model, ids, attention_mask)
            grouped = batch["rewards"].view(-1, group_size)
            advantages = (grouped - grouped.mean(dim=1, keepdim=True)).view(-1, 1)
        for _ in range(2):
            logps = token_log_probs(model, ids, attention_mask)
            ratio = torch.exp(logps - old_logps)
            pg_losses = -torch.min(ratio * advantages, torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps) * advantages)
            loss = (pg_losses * action_mask).sum() / action_mask.sum()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()  # expect: RLG013
