"""``RlguardCallback``: rlguard's contracts and live diagnosis inside ``GRPOTrainer.train()``.

    trainer = GRPOTrainer(...)
    RlguardCallback.attach(trainer, mode="raise")      # = trainer.add_callback(RlguardCallback(trainer, ...))
    trainer.train()                                    # stops at the first violated invariant, with its code

What it checks, and where:

- **the reference** (RLG008), with a ``rlguard.contracts.Guard`` over the policy, TRL's ``ref_model`` and the
  optimizer: distinct object, no shared storage, not in the optimizer (at the start and at every generation),
  bit-identical across every ``optimizer.step()``. With PEFT and no ``ref_model``, TRL's reference is the
  policy with its adapter off: it shares the base weights by design, so it is not checked as a separate model;
  the guard watches every parameter outside the active adapter as frozen instead (bit-identical across every
  step, never trained by the optimizer: RLG014), which is what keeps that reference fixed.
- **the generation batch** TRL builds (``_generate_and_score_completions``' dict): the loss mask equals the
  tokens the sampler wrote, aligned to ``ids[:, 1:]`` (RLG001); advantages centred per group of
  ``num_generations`` (RLG009), finite and without autograd history (RLG003), as are the old, reference and
  sampling log-probs.
- **the loss's inputs** (``_compute_loss``, every micro-batch): old log-probs unchanged for a row seen again in
  the same generation and not equal to the fresh log-probs after an optimizer step (RLG002).
- **TRL's logged metrics**, mapped to rlguard's names (``TRL_METRICS``), into ``rlguard.diagnose.Monitor``: the
  symptom rules (KL to the reference stuck at 0, the ratio stuck at 1, entropy collapse, reward falling, ...)
  run at every logging step.

``mode``: "raise" stops training at the first violation (``ContractViolation``) or symptom (``SymptomError``);
"warn" logs each violation once (logger ``rlguard.contracts``) and warns each symptom (``SymptomWarning``);
"off" does nothing. The checks draw no random numbers and write no tensor: training is bit-identical with the
callback on and off.
"""

from __future__ import annotations

import contextlib
import math
from typing import Annotated, Any, Optional

import torch
from jaxtyping import Float, Int
from torch import Tensor
from transformers import TrainerCallback

from rlguard.contracts import Batch, Finite, Frozen, Guard, GroupCentred, Mask, MatchesOwner, NoGrad, check_batch
from rlguard.contracts import mode as contracts_mode
from rlguard.contracts.markers import POLICY_ROLE
from rlguard.diagnose import Monitor, Thresholds
from rlguard.integrations.trl.preflight import adapter_parameter_names, per_token, policy_written

MODES = ("raise", "warn", "off")

# TRL's logged name -> rlguard.diagnose's name (docs/diagnose.md describes each)
TRL_METRICS = {
    "reward": "reward",
    "entropy": "entropy",
    "kl": "kl_ref",
    "clip_ratio/region_mean": "clip_frac",
    "grad_norm": "grad_norm",
    "completions/mean_length": "length",
    "frac_reward_zero_std": "zero_adv_frac",
    "sampling/sampling_logp_difference/mean": "logp_gap",
}


def diagnose_row(logs: dict, step: int, beta: float) -> dict:
    """One ``rlguard.diagnose`` row from one of TRL's ``on_log`` dicts (unmapped keys are kept as they are)."""
    row: dict[str, Any] = {"step": int(step), "kl_coef": float(beta)}
    for key, value in logs.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        row[TRL_METRICS.get(key, key)] = float(value)
    return row


# -- the two seams, as batch specs -------------------------------------------------------------------------------
# Shapes: prompt [B, P], completion [B, C]; per-token tensors over the whole episode are [B, T-1], T = P + C.
# TRL's dicts hold completion-only tensors; the checks that need the whole episode (the mask against the tokens
# the sampler wrote, the rows' identity) read the few tensors the callback adds in rlguard's layout.
_GENERATED = dict(
    owner=Int[Tensor, "B T"],
    action_mask=Annotated[Mask[Tensor, "B T-1"], MatchesOwner(owner="owner", policy_role=POLICY_ROLE)],
    old_per_token_logps=Optional[Annotated[Float[Tensor, "B C"], NoGrad(), Finite()]],
    ref_per_token_logps=Optional[Annotated[Float[Tensor, "B C"], NoGrad(), Finite()]],
    sampling_per_token_logps=Optional[Annotated[Float[Tensor, "B C"], NoGrad()]],
)
# the generation batch, one process: advantages centred per group of `group_size` completions
GENERATION_BATCH = Batch(
    **_GENERATED, group_size=int,
    advantages=Annotated[Float[Tensor, "B"], NoGrad(), Finite(), GroupCentred(group_size="group_size")])
# the same with several processes: a group's completions are spread over ranks, so no group check
UNGROUPED_GENERATION_BATCH = Batch(**_GENERATED, advantages=Annotated[Float[Tensor, "B"], NoGrad(), Finite()])
# one micro-batch's loss inputs and the log-probs the loss computed from them
LOSS_INPUTS = Batch(
    ids=Int[Tensor, "B T"],
    completion_mask=Mask[Tensor, "B C"],
    logp=Annotated[Float[Tensor, "B C"], Finite()],
    old_per_token_logps=Optional[Annotated[Float[Tensor, "B C"], NoGrad(), Finite(),
                                           Frozen(current="logp", key="ids", mask="completion_mask")]],
)


class RlguardCallback(TrainerCallback):
    """Contracts at TRL's batch seams, reference checks around optimizer steps, and live diagnosis.

    ``trainer``: the ``GRPOTrainer`` it watches (add the callback to it, or use ``attach``). ``contracts`` /
    ``monitor``: turn either part off. ``thresholds``, ``window``, ``log_path``: the ``Monitor``'s (a JSONL log
    of the mapped rows, readable by ``rlguard diagnose``). ``check_every``: the guard's float64 fingerprint of
    the reference on every N-th optimizer step only (its version counters see every step); the seams' value
    checks run on every call, their cost does not grow with the model.
    """

    def __init__(self, trainer, mode: str = "raise", *, contracts: bool = True, monitor: bool = True,
                 thresholds: Thresholds | None = None, window: int = 10, log_path=None, check_every: int = 1):
        if mode not in MODES:
            raise ValueError(f"RlguardCallback mode must be one of {MODES}, got {mode!r}")
        if not isinstance(check_every, int) or check_every < 1:
            raise ValueError(f"check_every must be a positive int, got {check_every!r}")
        self.trainer = trainer
        self.mode = mode
        self.contracts = contracts and mode != "off"
        self.check_every = check_every
        self.monitor = None
        if monitor and mode != "off":
            thresholds = thresholds or Thresholds()
            self.monitor = Monitor(thresholds, on_symptom=mode, window=window, kl_coef=float(trainer.beta),
                                   log_path=log_path)
        self.guard: Guard | None = None
        self._wrapped: list[str] = []
        self._generated = None
        self._loss_frames: list[dict] = []
        self._ratio = [-math.inf, math.inf]  # max, min of the PPO ratio since the last log
        self._step_mode = None

    @classmethod
    def attach(cls, trainer, **kwargs) -> RlguardCallback:
        """A callback for ``trainer``, added to it."""
        callback = cls(trainer, **kwargs)
        trainer.add_callback(callback)
        return callback

    # -- training events ---------------------------------------------------------------------------------------
    def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
        self._release()  # a previous train() that ended in an exception left its wrappers and guard
        t = self.trainer
        if self.contracts:
            optimizer = getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer wraps torch's
            reference = t.ref_model if t.beta != 0.0 else None
            frozen = None  # the policy's parameters with requires_grad off now
            names = adapter_parameter_names(t.model)
            if names:  # PEFT: what must not move is everything outside the adapter, whatever requires_grad says
                adapter = frozenset(id(p) for n, p in t.model.named_parameters() if n in names)
                frozen = lambda _name, tensor: id(tensor) not in adapter  # noqa: E731 - by identity: the guard
                # names the tensors as the unwrapped model does
            with contracts_mode(self.mode):
                self.guard = Guard(policy=t.model, reference=reference, optimizer=optimizer,
                                   check_every=self.check_every, frozen=frozen)
            self._wrap("_generate", self._observed_generate)
            self._wrap("_generate_and_score_completions", self._checked_generation)
        if self.contracts or self.monitor is not None:  # the monitor reads the PPO ratio from the loss seam
            self._wrap("_compute_loss", self._checked_loss)
            self._wrap("_get_per_token_logps_and_entropies", self._observed_logps)

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if self.guard is not None:  # the guard's step hooks report under the callback's mode
            self._step_mode = contracts_mode(self.mode)
            self._step_mode.__enter__()

    def on_optimizer_step(self, args, state, control, **kwargs):
        self._leave_step_mode()

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.monitor is None or not logs or any(key.startswith("eval_") for key in logs):
            return  # evaluation rows are not training steps
        if not any(key in logs for key in TRL_METRICS):
            return  # the end-of-training summary, when the last logging step has already taken the metrics
        row = diagnose_row({k: v for k, v in logs.items() if not k.startswith("train_")}, state.global_step,
                           self.trainer.beta)
        if self._multi_step() and self._ratio[0] > -math.inf:
            row["ratio_max"], row["ratio_min"] = self._ratio
        self._ratio = [-math.inf, math.inf]
        self.monitor.step(row)

    def on_train_end(self, args, state, control, **kwargs):
        self._release()

    def close(self) -> None:
        """Take the wrappers off the trainer, close the guard, and close the monitor's JSONL log (it is flushed
        at every row, so it reads while training runs)."""
        self._release()
        if self.monitor is not None:
            self.monitor.close()

    def _release(self) -> None:
        """End the update, close the guard and take the wrappers off the trainer (at the end of ``train()``)."""
        self._leave_step_mode()
        for name in self._wrapped:
            self.trainer.__dict__.pop(name, None)
        self._wrapped = []
        if self.guard is not None:
            with contracts_mode(self.mode):
                if self.guard.in_update:
                    self.guard.end_update()
            self.guard.close()
            self.guard = None

    # -- the seams -----------------------------------------------------------------------------------------------
    def _wrap(self, name: str, wrapper) -> None:
        original = getattr(self.trainer, name)
        setattr(self.trainer, name, lambda *a, **k: wrapper(original, *a, **k))
        self._wrapped.append(name)

    def _observed_generate(self, original, *args, **kwargs):
        out = original(*args, **kwargs)
        self._generated = out
        return out

    def _checked_generation(self, original, inputs, *args, **kwargs):
        t = self.trainer
        training = t.model.training
        if training:  # a new generation starts an update: the steps until the next one reuse its batch
            with contracts_mode(self.mode):
                if self.guard.in_update:
                    self.guard.end_update()
                self.guard.begin_update()
        out = original(inputs, *args, **kwargs)
        generated, self._generated = self._generated, None
        if training and generated is not None:
            self._check_generation(out, generated)
        return out

    def _check_generation(self, out: dict, generated: tuple) -> None:
        t = self.trainer
        prompt_len = out["prompt_ids"].shape[1]
        written = policy_written(t, generated, out["completion_ids"].shape[1]).to(out["completion_ids"].device)
        owner = torch.cat([torch.zeros_like(out["prompt_ids"]), written.long() * POLICY_ROLE], dim=1)
        mask = out["completion_mask"] * out["tool_mask"] if "tool_mask" in out else out["completion_mask"]
        tensors = dict(owner=owner, action_mask=per_token(prompt_len, mask), advantages=out["advantages"],
                       old_per_token_logps=out.get("old_per_token_logps"),
                       ref_per_token_logps=out.get("ref_per_token_logps"),
                       sampling_per_token_logps=out.get("sampling_per_token_logps"))
        with contracts_mode(self.mode):
            if t.accelerator.num_processes == 1:
                check_batch(GENERATION_BATCH, {**tensors, "group_size": t.num_generations},
                            where="GRPOTrainer._generate_and_score_completions", name="output")
            else:
                check_batch(UNGROUPED_GENERATION_BATCH, tensors,
                            where="GRPOTrainer._generate_and_score_completions", name="output")

    def _observed_logps(self, original, *args, **kwargs):
        out = original(*args, **kwargs)
        frames = self._loss_frames
        if frames and frames[-1]["logp"] is None and torch.is_grad_enabled():
            frames[-1]["logp"] = out[0].detach()
        return out

    def _checked_loss(self, original, model, inputs, *args, **kwargs):
        frame = {"logp": None}
        self._loss_frames.append(frame)
        try:
            loss = original(model, inputs, *args, **kwargs)
        finally:
            self._loss_frames.pop()
        if frame["logp"] is not None and self.trainer.model.training:
            self._check_loss(inputs, frame["logp"])
        return loss

    def _check_loss(self, inputs: dict, logp: torch.Tensor) -> None:
        mask = inputs["completion_mask"] * inputs["tool_mask"] if "tool_mask" in inputs else inputs["completion_mask"]
        ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
        old = inputs.get("old_per_token_logps")
        if self.contracts:
            with contracts_mode(self.mode):
                check_batch(LOSS_INPUTS, {"ids": ids, "completion_mask": mask, "logp": logp,
                                          "old_per_token_logps": old},
                            where="GRPOTrainer._compute_loss", name="inputs")
        if old is not None and mask.any():
            with torch.no_grad():
                ratio = torch.exp(logp.float() - old.float())[mask.bool()]
                self._ratio = [max(self._ratio[0], float(ratio.max())), min(self._ratio[1], float(ratio.min()))]
        elif mask.any():  # TRL uses the fresh log-probs, detached: the ratio is exactly 1
            self._ratio = [max(self._ratio[0], 1.0), min(self._ratio[1], 1.0)]

    # -- helpers -------------------------------------------------------------------------------------------------
    def _multi_step(self) -> bool:
        """More than one optimizer step per generation: only then can the ratio leave 1."""
        args = self.trainer.args
        return args.steps_per_generation * self.trainer.num_iterations > args.gradient_accumulation_steps

    def _leave_step_mode(self) -> None:
        if self._step_mode is not None:
            step_mode, self._step_mode = self._step_mode, None
            with contextlib.suppress(Exception):
                step_mode.__exit__(None, None, None)
