"""The reference trainer's configuration."""

from __future__ import annotations

from dataclasses import dataclass, field

from rlguard.reference.task import TaskSpec


@dataclass(frozen=True)
class GRPOConfig:
    seed: int = 0
    steps: int = 24
    prompts_per_step: int = 32  # P
    group_size: int = 8  # G: samples per prompt, contiguous in the batch
    temperature: float = 1.0  # the sampler's and the trainer's
    lr: float = 3e-3
    epochs: int = 2
    minibatches: int = 2  # optimizer steps per epoch
    microbatches: int = 2  # gradient accumulation chunks per minibatch
    clip_eps: float = 0.2
    max_grad_norm: float = 1.0
    ent_coef: float = 0.001
    kl_coef: float = 0.02
    kl_estimator: str = "k3"  # "k1" or "k3" (the loss term); both are logged
    loss_mode: str = "token_mean"  # or "seq_mean_token_mean" (length-biased)
    reward: str = "hidden"  # or "public": also pays the HACK shortcut
    max_turns: int = 4
    frozen: tuple[str, ...] = ("pos_emb",)  # parameter-name prefixes that must not train
    eval_every: int = 8
    n_heldout: int = 64
    d_model: int = 64
    n_layers: int = 2
    warm_start_steps: int = 150
    task: TaskSpec = field(default_factory=TaskSpec)

    @property
    def spec(self) -> TaskSpec:
        """The task family with this config's ``max_turns``."""
        if self.task.max_turns == self.max_turns:
            return self.task
        from dataclasses import replace

        return replace(self.task, max_turns=self.max_turns)
