"""Multi-turn agent GRPO with micro-batch accumulation that averages per-micro-batch token means (RLG006):
each micro-batch is normalised by its own token count and divided by the number of micro-batches, instead of
every micro-batch's token sum being divided by the mini-batch's total token count."""

import torch
import torch.nn.functional as F

PROMPT, POLICY, ENV, PAD = 0, 1, 2, 3


def token_log_probs(logits, ids):
    log_probs = F.log_softmax(logits[:, :-1], dim=-1)
    return log_probs.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)


def update(model, optimizer, ids, owner, old_logps, advantages, minibatch_size=32, microbatch_size=4,
           clip_eps=0.2):
    action_mask = (owner[:, 1:] == POLICY).float()
    attention_mask = (owner != PAD).long()
    perm = torch.randperm(ids.size(0))
    for mb_start in range(0, ids.size(0), minibatch_size):
        mb_idx = perm[mb_start:mb_start + minibatch_size]
        micro_batches = mb_idx.split(microbatch_size)
        n_micro = len(micro_batches)
        optimizer.zero_grad(set_to_none=True)
        for idx in micro_batches:
            mask = action_mask[idx]
            logits = model(ids[idx], attention_mask=attention_mask[idx]).logits
            logps = token_log_probs(logits, ids[idx])
            ratio = torch.exp(logps - old_logps[idx])
            adv = advantages[idx].unsqueeze(1)
            pg_losses = -torch.min(ratio * adv, torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps) * adv)
            token_mean = (pg_losses * mask).sum() / mask.sum().clamp(min=1.0)
            (token_mean / n_micro).backward()  # expect: RLG006
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
