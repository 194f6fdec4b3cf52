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
    reward: str = "hidden"  # or "public": also pays the HACK shortcut; or "pass": 1 when every turn is right
    max_turns: int = 4
    frozen: tuple[str, ...] = ("pos_emb",)  # parameter-name prefixes that must not train
    eval_every: int = 8
    n_heldout: int = 64
    d_model: int = 64
    n_layers: int = 2
    dropout: float = 0.0  # the model's dropout modules (the RL policy has them disabled; see trainer.base_policy)
    warm_start_steps: int = 150
    warm_start_probe: float = 0.1  # the base policy's review (task.review_tokens): each THINK with this probability
    task: TaskSpec = field(default_factory=TaskSpec)

    @property
    def spec(self) -> TaskSpec:
        """The task family with this config's ``max_turns``."""
        if self.task.max_turns == self.max_turns:
            return self.task
        from dataclasses import replace

        return replace(self.task, max_turns=self.max_turns)


# An agent-like variant of the task whose episode length varies a lot and is the policy's choice, and whose policy
# sees its failures: the setting in which a length-biased loss shows (rlguard.reference.task explains the options).
# After the last turn the environment reports PASSED/FAILED and the policy may probe with THINK, up to 16 tokens;
# half the tasks hide their last symbol (a guess), so that episodes keep failing while the policy learns; the reward
# pays passing episodes only, as the debugging chapter's does; three symbols, so that the warm-started policy passes
# a few episodes from the start; no fillers inside a turn, so that the review alone sets the length; the base policy
# probes once more with probability 0.5. 32 microbatches of 4 episodes, as a per-device microbatch of LLM training:
# the correct trainer does not depend on them, an accumulation that normalises per microbatch (accum_local) does.
VARIABLE_LENGTH = GRPOConfig(
    steps=48, reward="pass", microbatches=32, warm_start_probe=0.5,
    task=TaskSpec(n_symbols=3, max_answer_tokens=1, review_tokens=16, blind=0.5),
)
