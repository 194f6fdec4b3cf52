"""A second GRPO trainer in another style (class-based, TRL-like names) and its rlguard preflight adapter.

It shares only the model and the environment with ``rlguard.reference``; the trainer code is its own. Run the
preflight suite on it with::

    rlguard check examples.trl_style_grpo:adapter          # from the repository root
    rlguard check trl_style_grpo:adapter                   # from this folder

The adapter at the bottom is the whole integration: a dozen small functions that call the trainer's methods.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from rlguard.reference.model import ModelConfig, build_model
from rlguard.reference.sampling import collate, sample_episodes
from rlguard.reference.task import POLICY, TaskSpec, make_tasks


@dataclass
class GRPOArgs:
    num_generations: int = 8  # G
    per_step_prompts: int = 8
    learning_rate: float = 1e-3
    beta: float = 0.04  # KL coefficient
    epsilon: float = 0.2
    num_iterations: int = 2  # PPO epochs per generation
    steps_per_generation: int = 2  # optimizer steps per epoch
    gradient_accumulation_steps: int = 2
    temperature: float = 1.0
    max_grad_norm: float = 1.0
    seed: int = 0


def selective_log_softmax(logits, index):
    """log_softmax(logits) gathered at index; logits [B, L, V], index [B, L] -> [B, L]."""
    return torch.gather(logits.log_softmax(dim=-1), dim=-1, index=index.unsqueeze(-1)).squeeze(-1)


class TinyGRPOTrainer:
    def __init__(self, model, args: GRPOArgs, spec: TaskSpec):
        self.model = model
        self.args = args
        self.spec = spec
        self.ref_model = self.create_reference_model(model)
        self.optimizer = self.create_optimizer(model)
        self.generator = torch.Generator().manual_seed(args.seed)

    # -- setup
    def create_reference_model(self, model):
        if self.args.beta == 0.0:
            return None
        ref_model = copy.deepcopy(model).eval()
        ref_model.requires_grad_(False)
        return ref_model

    def create_optimizer(self, model):
        return torch.optim.AdamW(model.parameters(), lr=self.args.learning_rate, weight_decay=0.0)

    # -- generation
    def generate_and_score(self, prompts):
        episodes = sample_episodes(self.model, prompts, self.spec, self.args.num_generations,
                                   temperature=self.args.temperature, generator=self.generator)
        batch = collate(episodes, self.args.num_generations)
        inputs = {
            "input_ids": batch["ids"],
            "completion_mask": (batch["owner"][:, 1:] == POLICY).float(),
            "old_per_token_logps": batch["sampler_logp"],
            "rewards": batch["rewards"],
            "owner": batch["owner"],
        }
        inputs["advantages"] = self._compute_advantages(inputs["rewards"])
        if self.ref_model is not None:
            with torch.no_grad():
                inputs["ref_per_token_logps"] = self._get_per_token_logps(self.ref_model, inputs["input_ids"])
        return inputs

    def _compute_advantages(self, rewards):
        grouped = rewards.view(-1, self.args.num_generations)
        mean_grouped_rewards = grouped.mean(dim=1).repeat_interleave(self.args.num_generations)
        std_grouped_rewards = grouped.std(dim=1).repeat_interleave(self.args.num_generations)
        advantages = rewards - mean_grouped_rewards
        return advantages / (std_grouped_rewards + 1e-4)

    # -- loss
    def _get_per_token_logps(self, model, input_ids):
        logits = model(input_ids)
        logits = logits[:, :-1, :] / self.args.temperature
        return selective_log_softmax(logits, input_ids[:, 1:])

    def compute_loss(self, model, inputs, num_items):
        """Summed PPO-clip + KL over the completion tokens, divided by ``num_items`` (the minibatch's tokens)."""
        per_token_logps = self._get_per_token_logps(model, inputs["input_ids"])
        completion_mask = inputs["completion_mask"]
        coef_1 = torch.exp(per_token_logps - inputs["old_per_token_logps"])
        coef_2 = torch.clamp(coef_1, 1 - self.args.epsilon, 1 + self.args.epsilon)
        advantages = inputs["advantages"].unsqueeze(1)
        per_token_loss = -torch.min(coef_1 * advantages, coef_2 * advantages)
        if "ref_per_token_logps" in inputs and self.args.beta != 0.0:
            ref_logps = inputs["ref_per_token_logps"]
            per_token_kl = torch.exp(ref_logps - per_token_logps) - (ref_logps - per_token_logps) - 1
            per_token_loss = per_token_loss + self.args.beta * per_token_kl
        loss = (per_token_loss * completion_mask).sum() / num_items
        self._last_ratio = coef_1.detach()[completion_mask > 0]
        return loss

    # -- training
    def accumulate(self, inputs, rows):
        """Backward of one minibatch in ``gradient_accumulation_steps`` chunks (no optimizer step)."""
        num_items = inputs["completion_mask"][rows].sum().clamp(min=1)
        ratios = []
        for chunk in rows.chunk(self.args.gradient_accumulation_steps):
            sub = {k: v[chunk] for k, v in inputs.items()}
            loss = self.compute_loss(self.model, sub, num_items)
            loss.backward()
            ratios.append(self._last_ratio)
        return torch.cat(ratios)

    def training_step(self, inputs):
        """num_iterations x steps_per_generation optimizer steps on one generation -> logs."""
        ratios = []
        n = len(inputs["input_ids"])
        for _ in range(self.args.num_iterations):
            order = torch.randperm(n, generator=self.generator)
            for rows in order.chunk(self.args.steps_per_generation):
                self.optimizer.zero_grad()
                ratios.append(self.accumulate(inputs, rows))
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.args.max_grad_norm)
                self.optimizer.step()
        ratio = torch.cat(ratios)
        return {"ratio_max": float(ratio.max()), "ratio_min": float(ratio.min())}

    def train(self, tasks, steps):
        logs = []
        for _ in range(steps):
            picks = torch.randperm(len(tasks), generator=self.generator)[: self.args.per_step_prompts]
            inputs = self.generate_and_score([tasks[i] for i in picks.tolist()])
            logs.append(dict(self.training_step(inputs), reward=float(inputs["rewards"].mean())))
        return logs


# ------------------------------------------------------------------------------------------------ the adapter


class TRLStyleAdapter:
    """rlguard preflight adapter over ``TinyGRPOTrainer`` (see ``rlguard.preflight.adapter``)."""

    def __init__(self, args: GRPOArgs = GRPOArgs(), spec: TaskSpec = TaskSpec(stop_token=True)):
        torch.set_num_threads(1)
        self.args, self.spec = args, spec
        self.stop_token_ids = spec.stop_ids  # the EOS each completion ends with (stop_token_trained)
        self.group_size = args.num_generations
        self.tasks, _ = make_tasks(spec, n_train=64, n_heldout=0)
        self.model_config = ModelConfig(vocab_size=spec.vocab_size, d_model=32, n_layers=2)

    def _trainer(self, model):
        return TinyGRPOTrainer(model, self.args, self.spec)

    def build_model(self):
        return build_model(self.model_config, seed=self.args.seed)

    def make_batch(self, model, seed):
        trainer = self._trainer(model)
        trainer.generator.manual_seed(seed)
        return trainer.generate_and_score(self.tasks[: self.args.per_step_prompts])

    def token_ids(self, batch):
        return batch["input_ids"]

    def policy_tokens(self, batch):
        return batch["owner"] == POLICY

    def rewards(self, batch):
        return batch["rewards"]

    def sampler_log_probs(self, batch):
        return batch["old_per_token_logps"]

    def old_log_probs(self, model, batch):
        return batch["old_per_token_logps"]

    def logits(self, model, batch):
        return model(batch["input_ids"])[:, :-1] / self.args.temperature

    def log_probs(self, model, batch):
        return self._trainer(model)._get_per_token_logps(model, batch["input_ids"])

    def action_mask(self, batch):
        return batch["completion_mask"]

    def advantages(self, batch):
        return batch["advantages"]

    def loss(self, model, batch, rows, ref_model=None, term="total"):
        inputs = {k: v[rows] for k, v in batch.items()}
        if term == "entropy":
            return None  # no entropy bonus in this trainer
        if term == "kl":
            if ref_model is None:
                return None
            inputs["advantages"] = torch.zeros_like(inputs["advantages"])
        if ref_model is not None:
            with torch.no_grad():
                inputs["ref_per_token_logps"] = self._trainer(model)._get_per_token_logps(ref_model, inputs["input_ids"])
        else:
            inputs.pop("ref_per_token_logps", None)
        return self._trainer(model).compute_loss(model, inputs, inputs["completion_mask"].sum().clamp(min=1))

    def backward(self, model, batch, rows, ref_model=None):
        trainer = self._trainer(model)
        inputs = dict(batch)
        inputs.pop("ref_per_token_logps", None)
        trainer.accumulate(inputs, rows)

    def make_reference(self, model):
        return self._trainer(model).ref_model

    def make_optimizer(self, model):
        return self._trainer(model).create_optimizer(model)

    def update(self, model, optimizer, ref_model, batch):
        trainer = self._trainer(model)
        trainer.optimizer, trainer.ref_model = optimizer, ref_model
        inputs = dict(batch)
        if ref_model is not None:
            with torch.no_grad():
                inputs["ref_per_token_logps"] = trainer._get_per_token_logps(ref_model, inputs["input_ids"])
        return trainer.training_step(inputs)

    def run_signature(self, seed, steps):
        args = GRPOArgs(**{**self.args.__dict__, "seed": seed})
        torch.manual_seed(seed)
        trainer = TinyGRPOTrainer(self.build_model(), args, self.spec)
        return [(r["reward"], r["ratio_max"]) for r in trainer.train(self.tasks, steps)]


adapter = TRLStyleAdapter()
