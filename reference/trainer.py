"""A small, correct, multi-turn GRPO trainer on the synthetic task family (``rlguard.reference.task``).

``train(cfg, fault=None)`` runs ``cfg.steps`` RL steps from the warm-started base policy and returns one metrics
row per step (the metric names of the debugging chapter's dashboard). ``fault`` swaps one part of the
pipeline for its faulty twin from ``rlguard.reference.faults``.
"""

from __future__ import annotations

import copy
import functools
import random
from dataclasses import replace

import torch

from rlguard.reference.config import GRPOConfig
from rlguard.reference.model import ModelConfig, TinyCausalLM, build_model, disable_dropout
from rlguard.reference.pipeline import Parts, make_parts
from rlguard.reference.sampling import evaluate
from rlguard.reference.task import HACK, POLICY, THINK, TaskSpec, finish, make_tasks, policy_step, start_episode

__all__ = ["GRPOConfig", "base_policy", "train", "metrics_row", "model_config"]


def model_config(cfg: GRPOConfig) -> ModelConfig:
    return ModelConfig(vocab_size=cfg.spec.vocab_size, d_model=cfg.d_model, n_layers=cfg.n_layers,
                       max_len=max(64, cfg.spec.max_len()), dropout=cfg.dropout)


@functools.lru_cache(maxsize=8)
def _warm_start_state(spec: TaskSpec, mcfg: ModelConfig, steps: int, seed: int, probe: float = 0.1) -> dict:
    """A short supervised warm start: the base policy learns the answer format, with uniformly random answers (and,
    with ``spec.review_tokens``, probes after the report: each THINK with probability ``probe``)."""
    rng = random.Random(seed)
    model = build_model(mcfg, seed)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    out0 = spec.out_token(0)
    for _ in range(steps):
        rows = []
        for _ in range(32):
            n = rng.randint(spec.min_turns, spec.max_turns)
            ep = start_episode(spec, _random_task(rng, spec, n))
            while not ep.done:
                review = ep.turn == len(ep.task.symbols)  # after the report (spec.review_tokens): probes
                if review and spec.stop_ids:  # the ending of an episode with a stop token
                    policy_step(spec, ep, spec.eos_token(), 0.0)
                    continue
                cap, p = (spec.review_tokens, probe) if review else (spec.max_answer_tokens, 0.1)
                while ep.answer_tokens < cap - 1 and rng.random() < p:
                    policy_step(spec, ep, THINK, 0.0)
                token = HACK if rng.random() < 0.04 else out0 + rng.randrange(spec.n_symbols)
                policy_step(spec, ep, token, 0.0)
            rows.append(ep)
        width = max(len(ep.ids) for ep in rows)
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        target_mask = torch.zeros(len(rows), width - 1)
        for i, ep in enumerate(rows):
            ids[i, : len(ep.ids)] = torch.tensor(ep.ids)
            target_mask[i, : len(ep.ids) - 1] = torch.tensor([float(o == POLICY) for o in ep.owner[1:]])
        logp = model(ids)[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        nll = -(logp * target_mask).sum() / target_mask.sum()
        opt.zero_grad()
        nll.backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _random_task(rng: random.Random, spec: TaskSpec, n: int):
    from rlguard.reference.task import Task

    return Task(rng.randrange(spec.n_keys), tuple(rng.randrange(spec.n_symbols) for _ in range(n)))


def base_policy(cfg: GRPOConfig) -> TinyCausalLM:
    """The RL starting policy: a fresh copy of the (cached) warm-started model, its dropout disabled as TRL's
    ``disable_dropout`` does (the model keeps its dropout modules and its config's rate: a module rebuilt from
    ``model.cfg`` has dropout on)."""
    mcfg = model_config(cfg)
    model = TinyCausalLM(mcfg)
    plain = replace(mcfg, dropout=0.0)  # dropout has no weights: the warm start is the same with or without it
    if cfg.warm_start_steps:
        with torch.random.fork_rng(devices=[]):
            state = _warm_start_state(cfg.spec, plain, cfg.warm_start_steps, cfg.seed, cfg.warm_start_probe)
    else:
        state = build_model(plain, cfg.seed).state_dict()
    model.load_state_dict(state)
    return disable_dropout(model)


def sample_prompts(tasks, cfg: GRPOConfig, generator: torch.Generator):
    picks = torch.randperm(len(tasks), generator=generator)[: cfg.prompts_per_step]
    return [tasks[i] for i in picks.tolist()]


@torch.no_grad()
def logp_gap(model, batch, cfg: GRPOConfig, parts: Parts) -> float:
    """Mean |trainer log-prob - sampler log-prob| on the trained tokens (healthy: ~1e-7)."""
    ids = batch["ids"]
    mask = parts.build_action_mask(batch["owner"], ids) > 0
    trainer = parts.token_log_probs(parts.forward(model, ids, cfg), ids)
    return float((trainer - batch["sampler_logp"]).abs()[mask].mean()) if mask.any() else 0.0


def metrics_row(batch, update_stats: dict, cfg: GRPOConfig) -> dict:
    info = batch["info"]
    n = len(info)
    rewards = batch["rewards"].view(-1, cfg.group_size)
    lengths = [i["length"] for i in info]

    def mean_length(passed: bool) -> float:
        picked = [i["length"] for i in info if i["passed"] == passed]
        return sum(picked) / max(len(picked), 1)

    return dict(
        update_stats,
        reward=float(batch["rewards"].mean()),
        pass_rate=sum(i["passed"] for i in info) / n,
        length=sum(lengths) / n,
        length_pass=mean_length(True),
        length_fail=mean_length(False),
        zero_adv_frac=float((rewards.max(-1).values == rewards.min(-1).values).float().mean()),
        turns=sum(i["turns"] for i in info) / n,
        malformed=sum(i["malformed"] for i in info) / n,
        hardcode=sum(i["hardcode"] for i in info) / n,
        thinks=sum(i["thinks"] for i in info) / n,
    )


def train(cfg: GRPOConfig = GRPOConfig(), fault: str | None = None, steps: int | None = None,
          on_step=None, model: TinyCausalLM | None = None) -> list[dict]:
    """Train (a copy of the base policy, or ``model`` in place) -> one metrics dict per step."""
    torch.set_num_threads(1)
    parts = make_parts(fault)
    steps = cfg.steps if steps is None else steps
    train_tasks, heldout_tasks = make_tasks(cfg.spec, n_heldout=cfg.n_heldout, seed=1234 + cfg.seed)
    model = base_policy(cfg) if model is None else model
    torch.manual_seed(cfg.seed)
    generator = torch.Generator().manual_seed(cfg.seed)
    ref_model = parts.make_reference(model) if cfg.kl_coef else None
    optimizer = parts.make_optimizer(model, cfg)
    history = []
    for step in range(steps):
        batch = parts.rollout(model, sample_prompts(train_tasks, cfg, generator), cfg, generator)
        gap = logp_gap(model, batch, cfg, parts)
        stats = parts.update(model, ref_model, optimizer, batch, cfg, parts, generator)
        row = dict(metrics_row(batch, stats, cfg), logp_gap=gap, step=step)
        row.setdefault("kl_ref", 0.0)
        if step % cfg.eval_every == 0 or step == steps - 1:
            row["eval_pass"] = evaluate(model, heldout_tasks, cfg.spec)["pass_rate"]
        history.append(row)
        if on_step is not None:
            on_step(row)
    return history
