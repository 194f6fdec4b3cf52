"""The preflight adapter over the reference trainer (``rlguard check rlguard.reference.adapter:adapter``).

``ReferenceAdapter(fault=None)`` runs every function through the (possibly faulty) pipeline parts, so the
suite sees exactly what the faulty trainer would do.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from rlguard.reference.config import GRPOConfig
from rlguard.reference.pipeline import make_parts
from rlguard.reference.sampling import evaluate, sample_episodes
from rlguard.reference.task import POLICY, TaskSpec, make_tasks
from rlguard.reference.trainer import base_policy, sample_prompts, train

# Small and fast: 8 prompts x 8 samples, 2 epochs x 2 minibatches x 2 microbatches. Episodes end with the
# policy's EOS (stop_token_trained needs one), and the model has dropout modules (disabled in the policy, as TRL
# does; a reference rebuilt from the config has them on: scoring_eval_mode).
CHECK_CONFIG = GRPOConfig(prompts_per_step=8, group_size=8, kl_coef=0.05, ent_coef=0.01, dropout=0.1,
                          task=TaskSpec(stop_token=True))


class ReferenceAdapter:
    def __init__(self, fault: str | None = None, cfg: GRPOConfig = CHECK_CONFIG):
        torch.set_num_threads(1)
        self.fault = fault
        self.cfg = cfg
        self.parts = make_parts(fault)
        self.group_size = cfg.group_size
        self.pad_id = 0
        self.stop_token_ids = cfg.spec.stop_ids
        self.train_tasks, self.heldout_tasks = make_tasks(cfg.spec, n_heldout=cfg.n_heldout, seed=1234 + cfg.seed)

    # -- model and batch
    def build_model(self):
        model = base_policy(self.cfg)
        for name, p in model.named_parameters():
            p.requires_grad_(not name.startswith(self.cfg.frozen))
        return model

    def trainable_names(self, model) -> set[str]:
        return {name for name, _ in model.named_parameters() if not name.startswith(self.cfg.frozen)}

    def make_batch(self, model, seed: int):
        gen = torch.Generator().manual_seed(seed)
        return self.parts.rollout(model, sample_prompts(self.train_tasks, self.cfg, gen), self.cfg, gen)

    def token_ids(self, batch):
        return batch["ids"]

    def policy_tokens(self, batch):
        return batch["owner"] == POLICY

    def rewards(self, batch):
        return batch["rewards"]

    def sampler_log_probs(self, batch):
        return batch["sampler_logp"]

    def old_log_probs(self, model, batch):
        return batch["sampler_logp"]

    # -- the trainer's own computations
    def logits(self, model, batch):
        return self.parts.forward(model, batch["ids"], self.cfg)[:, :-1]

    def log_probs(self, model, batch):
        return self.parts.token_log_probs(self.parts.forward(model, batch["ids"], self.cfg), batch["ids"])

    def action_mask(self, batch):
        return self.parts.build_action_mask(batch["owner"], batch["ids"])

    def advantages(self, batch):
        with torch.no_grad():
            return self.parts.group_advantages(batch["rewards"], self.cfg.group_size)

    def _ref_logp(self, ref_model, ids):
        if ref_model is None:
            return None
        with torch.no_grad():
            return self.parts.token_log_probs(self.parts.forward(ref_model, ids, self.cfg), ids)

    def ref_log_probs(self, ref_model, batch):
        return self._ref_logp(ref_model, batch["ids"])

    def loss(self, model, batch, rows, ref_model=None, term="total"):
        cfg, advantages = self.cfg, self.advantages(batch)
        if term == "entropy":
            cfg, advantages = replace(cfg, kl_coef=0.0), torch.zeros_like(advantages)
        elif term == "kl":
            cfg, advantages = replace(cfg, ent_coef=0.0), torch.zeros_like(advantages)
        elif term != "total":
            raise ValueError(f"unknown term {term!r}")
        ids, mask = batch["ids"], self.action_mask(batch)
        ref_logp = self._ref_logp(ref_model, ids) if cfg.kl_coef else None
        if term == "kl" and ref_logp is None:
            return None
        logits = self.parts.forward(model, ids[rows], cfg)
        loss, _ = self.parts.compute_loss(logits, ids[rows], batch["sampler_logp"][rows], advantages[rows],
                                          mask[rows], None if ref_logp is None else ref_logp[rows], cfg, self.parts,
                                          mask[rows].sum().clamp(min=1), len(rows))
        return loss

    def backward(self, model, batch, rows, ref_model=None):
        ids = batch["ids"]
        self.parts.minibatch_backward(model, ids, rows, self.action_mask(batch), batch["sampler_logp"],
                                      self.advantages(batch), self._ref_logp(ref_model, ids), self.cfg, self.parts)

    def make_reference(self, model):
        return self.parts.make_reference(model) if self.cfg.kl_coef else None

    def make_optimizer(self, model):
        return self.parts.make_optimizer(model, self.cfg)

    def update(self, model, optimizer, ref_model, batch):
        gen = torch.Generator().manual_seed(self.cfg.seed)
        return self.parts.update(model, ref_model, optimizer, batch, self.cfg, self.parts, gen)

    # -- optional checks
    def run_signature(self, seed: int, steps: int):
        rows = train(replace(self.cfg, seed=seed), fault=self.fault, steps=steps)
        return [(r["reward"], r["length"], r["grad_norm"]) for r in rows]

    def greedy_rollout(self, model, seed: int):
        episodes = sample_episodes(model, self.heldout_tasks[:16], self.cfg.spec, 1, temperature=1.0, greedy=True)
        return [ep.ids for ep in episodes]

    def evaluate_greedy(self, model, seed: int):
        return evaluate(model, self.heldout_tasks[:16], self.cfg.spec)["ids"]


adapter = ReferenceAdapter()


def fault_adapter(fault: str | None) -> ReferenceAdapter:
    return ReferenceAdapter(fault)
