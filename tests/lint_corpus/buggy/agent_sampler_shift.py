"""Multi-turn agent GRPO: the sampler draws tokens at temperature 0.7 and its log-probs become the old
log-probs, but the trainer scores tokens at temperature 1.0 (RLG007); and the trainer's log-probs gather
``logits[:, :-1]`` against ``ids[:, :-1]``, both shifted the same way (RLG012)."""

import torch
import torch.nn.functional as F

PROMPT, POLICY, ENV, PAD = 0, 1, 2, 3


@torch.no_grad()
def sample(model, ids, owner, max_new_tokens, temperature):
    """Sample one policy turn; returns the extended episode and the log-prob of each sampled token."""
    sampled_logps = []
    for _ in range(max_new_tokens):
        logits = model(ids).logits[:, -1] / temperature
        log_probs = F.log_softmax(logits, dim=-1)
        next_id = torch.multinomial(log_probs.exp(), 1)
        sampled_logps.append(log_probs.gather(-1, next_id))
        ids = torch.cat([ids, next_id], dim=1)
        owner = torch.cat([owner, torch.full_like(next_id, POLICY)], dim=1)
    return ids, owner, torch.cat(sampled_logps, dim=1)


def trainer_log_probs(model, ids):
    logits = model(ids).logits
    return logits[:, :-1].log_softmax(-1).gather(-1, ids[:, :-1].unsqueeze(-1)).squeeze(-1)  # expect: RLG012, RLG007


def train_step(model, optimizer, prompt_ids, reward_fn, group_size=8, max_new_tokens=64, clip_eps=0.2):
    ids = prompt_ids.repeat_interleave(group_size, dim=0)
    owner = torch.full_like(ids, PROMPT)
    ids, owner, old_logps = sample(model, ids, owner, max_new_tokens, temperature=0.7)
    n_new = old_logps.size(1)
    with torch.no_grad():
        rewards = reward_fn(ids).view(-1, group_size)
        advantages = ((rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-4)).view(-1, 1)
    action_mask = (owner[:, 1:] == POLICY).float()[:, -n_new:]
    logps = trainer_log_probs(model, ids)[:, -n_new:]
    ratio = torch.exp(logps - old_logps)
    pg_losses = -torch.min(ratio * advantages, torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps) * advantages)
    loss = (pg_losses * action_mask).sum() / action_mask.sum()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return loss.item()
