"""Multi-turn agent GRPO: the policy alternates with a tool environment for several turns per episode.

``ids`` [B, T] holds whole episodes; ``owner`` [B, T] says who wrote each token (prompt, policy, environment,
padding). ``logits[:, :-1]`` predict ``ids[:, 1:]``, so log-probs and the action mask are [B, T - 1] and aligned
to ``ids[:, 1:]``. Only policy tokens are trained on. Groups: ``group_size`` episodes per prompt, contiguous.
"""

import copy
from dataclasses import dataclass

import torch
import torch.nn.functional as F

PROMPT, POLICY, ENV, PAD = 0, 1, 2, 3


@dataclass
class AgentGRPOConfig:
    group_size: int = 8
    max_turns: int = 4
    max_new_tokens: int = 128
    temperature: float = 1.0
    clip_eps: float = 0.2
    kl_coef: float = 0.02
    ent_coef: float = 1e-3
    ppo_epochs: int = 2
    minibatch_size: int = 32
    microbatch_size: int = 4
    lr: float = 1e-6
    max_grad_norm: float = 1.0


def token_log_probs(logits, ids, temperature):
    """log p(ids[:, t + 1] | ids[:, :t + 1]) -> [B, T - 1]."""
    log_probs = F.log_softmax(logits[:, :-1] / temperature, dim=-1)
    return log_probs.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)


def token_entropy(logits, temperature):
    """Entropy of each next-token distribution -> [B, T - 1]."""
    log_p = F.log_softmax(logits[:, :-1] / temperature, dim=-1)
    return -(log_p.exp() * log_p).sum(-1)


def group_advantages(rewards, group_size, eps=1e-4):
    grouped = rewards.view(-1, group_size)
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    return (centred / (grouped.std(dim=1, keepdim=True) + eps)).view(-1)


@torch.no_grad()
def sample_turn(model, ids, owner, done, cfg, eos_id, pad_id):
    """Sample one policy turn token by token; finished episodes get padding."""
    for _ in range(cfg.max_new_tokens):
        logits = model(ids, attention_mask=(owner != PAD).long()).logits[:, -1]
        probs = torch.softmax(logits / cfg.temperature, dim=-1)
        next_id = torch.multinomial(probs, 1).squeeze(1)
        next_id = torch.where(done, torch.full_like(next_id, pad_id), next_id)
        next_owner = torch.where(done, torch.full_like(next_id, PAD), torch.full_like(next_id, POLICY))
        ids = torch.cat([ids, next_id[:, None]], dim=1)
        owner = torch.cat([owner, next_owner[:, None]], dim=1)
        done = done | (next_id == eos_id)
        if done.all():
            break
    return ids, owner


@torch.no_grad()
def rollout(model, env, prompt_ids, cfg):
    ids = prompt_ids.repeat_interleave(cfg.group_size, dim=0)
    owner = torch.full_like(ids, PROMPT)
    finished = torch.zeros(ids.size(0), dtype=torch.bool, device=ids.device)
    for turn in range(cfg.max_turns):
        turn_done = finished.clone()
        ids, owner = sample_turn(model, ids, owner, turn_done, cfg, env.eos_id, env.pad_id)
        obs, finished = env.step(ids, owner, finished)  # obs [B, L_obs], padded with env.pad_id
        obs_owner = torch.where(obs == env.pad_id, torch.full_like(obs, PAD), torch.full_like(obs, ENV))
        ids = torch.cat([ids, obs], dim=1)
        owner = torch.cat([owner, obs_owner], dim=1)
        if finished.all():
            break
    rewards = env.score(ids, owner)
    return ids, owner, rewards


class AgentGRPOTrainer:
    def __init__(self, model, env, cfg: AgentGRPOConfig):
        self.model = model
        self.env = env
        self.cfg = cfg
        self.ref_model = copy.deepcopy(model).eval()
        self.ref_model.requires_grad_(False)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr, weight_decay=0.0)

    @torch.no_grad()
    def batched_log_probs(self, model, ids, attention_mask):
        out = []
        for start in range(0, ids.size(0), self.cfg.microbatch_size):
            sl = slice(start, start + self.cfg.microbatch_size)
            logits = model(ids[sl], attention_mask=attention_mask[sl]).logits
            out.append(token_log_probs(logits, ids[sl], self.cfg.temperature))
        return torch.cat(out)

    def train_step(self, prompt_ids):
        cfg = self.cfg
        self.model.eval()
        ids, owner, rewards = rollout(self.model, self.env, prompt_ids, cfg)
        attention_mask = (owner != PAD).long()
        action_mask = (owner[:, 1:] == POLICY).float()

        old_logps = self.batched_log_probs(self.model, ids, attention_mask)
        ref_logps = self.batched_log_probs(self.ref_model, ids, attention_mask)
        with torch.no_grad():
            advantages = group_advantages(rewards, cfg.group_size)

        self.model.train()
        stats = {"reward": rewards.mean().item(), "policy_tokens": action_mask.sum().item()}
        batch_size = ids.size(0)
        for epoch in range(cfg.ppo_epochs):
            perm = torch.randperm(batch_size, device=ids.device)
            for mb_start in range(0, batch_size, cfg.minibatch_size):
                mb_idx = perm[mb_start:mb_start + cfg.minibatch_size]
                total_tokens = action_mask[mb_idx].sum().clamp(min=1.0)
                self.optimizer.zero_grad(set_to_none=True)
                for micro_start in range(0, mb_idx.numel(), cfg.microbatch_size):
                    idx = mb_idx[micro_start:micro_start + cfg.microbatch_size]
                    mask = action_mask[idx]
                    logits = self.model(ids[idx], attention_mask=attention_mask[idx]).logits
                    logps = token_log_probs(logits, ids[idx], cfg.temperature)

                    ratio = torch.exp(logps - old_logps[idx])
                    clipped = torch.clamp(ratio, 1 - cfg.clip_eps, 1 + cfg.clip_eps)
                    adv = advantages[idx].unsqueeze(1)
                    pg_losses = -torch.min(ratio * adv, clipped * adv)

                    log_ratio_ref = ref_logps[idx] - logps
                    per_token_kl = torch.exp(log_ratio_ref) - log_ratio_ref - 1
                    entropy_bonus = token_entropy(logits, cfg.temperature)

                    per_token_loss = pg_losses + cfg.kl_coef * per_token_kl - cfg.ent_coef * entropy_bonus
                    loss_sum = (per_token_loss * mask).sum()
                    (loss_sum / total_tokens).backward()
                grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.max_grad_norm)
                self.optimizer.step()
        stats["grad_norm"] = float(grad_norm)
        return stats
