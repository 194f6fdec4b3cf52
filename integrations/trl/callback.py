"""``RlguardCallback``: rlguard's contracts and live diagnosis inside ``GRPOTrainer.train()`` and
``RLOOTrainer.train()`` (any other trainer is refused when the callback is made, before training starts).

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
- **the loss's terms** (GRPO, the first training micro-batch of each optimizer step): the KL term enters the loss
  as a penalty and the entropy term as a bonus (RLG011, RLG004), read from the returned loss's graph by the
  ``Penalty`` and ``Bonus`` markers (``term_signs``; the KL through ``_ReferenceDistance``), so a subclass's own
  loss that subtracts the KL or adds the entropy with positive coefficients is stopped at that step.
- **TRL's logged metrics**, mapped to rlguard's names (``TRL_METRICS``), into ``rlguard.diagnose.Monitor``: the
  symptom rules (KL to the reference stuck at 0, the ratio stuck at 1, entropy collapse, reward falling, ...)
  run at every logging step.

``mode``: "raise" stops training at the first violation (``ContractViolation``) or symptom (``SymptomError``);
"warn" logs each violation once (logger ``rlguard.contracts``) and warns each symptom (``SymptomWarning``);
"off" does nothing. The checks draw no random numbers and write no tensor: training is bit-identical with the
callback on and off.

The callback never breaks the run it watches by itself: only a violation (``ContractViolation``) or a symptom
(``SymptomError``) in "raise" mode stops training. An unexpected error inside one of rlguard's own checks is
logged once (logger ``rlguard.contracts``) with what was being checked, and that check is switched off for the
rest of the run (``RlguardCallback.switched_off`` lists them); TRL's own code runs exactly as without it.

RLOO: its generation dict holds sequence-level old log-probs (``old_logps`` [B], the masked sum of the per-token
ones) and no reference log-probs (its KL is a reward penalty, inside the advantages), so the checks read those;
the advantage-rank check (RLG005) ranks by the penalised reward, rebuilt from the old and reference per-token
log-probs of the generation's own scoring passes (so it runs with RLOO's default ``beta=0.05``).
"""

from __future__ import annotations

import contextlib
import logging
import math
from typing import Annotated, Any, Optional

import torch
from jaxtyping import Float, Int
from torch import Tensor
from transformers import TrainerCallback

from rlguard.contracts import (Batch, Bonus, ContractViolation, Finite, FollowsRewards, Frozen, Guard, GroupCentred,
                               Mask, MatchesOwner, NoGrad, Penalty, UpdateDirection, check_batch, contract)
from rlguard.contracts import mode as contracts_mode
from rlguard.catalog import ENTROPY_BONUS_SIGN, KL_SIGN
from rlguard.contracts.errors import Violation
from rlguard.contracts.markers import POLICY_ROLE, TRACED_TARGET
from rlguard.contracts.settings import report
from rlguard.contracts.spec import format_message
from rlguard.diagnose import Monitor, SymptomError, Thresholds
from rlguard.diagnose.trl_logs import TRL_METRICS  # TRL's name -> rlguard's, shared with `rlguard diagnose`
from rlguard.contracts.guard import wrapper_chain
from rlguard.integrations.trl.preflight import (SUPPORTED_NAMES, RLOOTrainer, UnsupportedTrainerError,
                                                adapter_parameter_names, per_token, policy_written, supported_trainer)

_log = logging.getLogger("rlguard.contracts")

MODES = ("raise", "warn", "off")


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
def generation_spec(rloo: bool, grouped: bool, ranked: bool) -> Batch:
    """The batch spec of a generation dict. GRPO's holds per-token old/reference/sampling log-probs ([B, C]);
    RLOO's sequence-level old log-probs (``old_logps`` [B]) and no reference ones (its KL is in the advantages).
    ``grouped`` (one process: every group's completions are here): advantages centred per group of
    ``group_size``. ``ranked``: within a group, a higher reward (``rewards`` [B], the weighted sum of the reward
    functions; RLOO's minus its KL penalty when ``beta != 0``) never gets a lower advantage (RLG005 at every
    generation: a sign that flips mid-run shows at once)."""
    fields: dict = dict(
        owner=Int[Tensor, "B T"],
        action_mask=Annotated[Mask[Tensor, "B T-1"], MatchesOwner(owner="owner", policy_role=POLICY_ROLE)])
    if rloo:
        fields["old_logps"] = Annotated[Float[Tensor, "B"], NoGrad(), Finite()]
    else:
        fields.update(old_per_token_logps=Optional[Annotated[Float[Tensor, "B C"], NoGrad(), Finite()]],
                      ref_per_token_logps=Optional[Annotated[Float[Tensor, "B C"], NoGrad(), Finite()]],
                      sampling_per_token_logps=Optional[Annotated[Float[Tensor, "B C"], NoGrad()]])
    markers: list = [NoGrad(), Finite()]
    if grouped:
        fields["group_size"] = int
        markers.append(GroupCentred(group_size="group_size"))
        if ranked:
            fields["rewards"] = Float[Tensor, "B"]
            markers.append(FollowsRewards(rewards="rewards", group_size="group_size"))
    fields["advantages"] = Annotated[(Float[Tensor, "B"], *markers)]
    return Batch(**fields)


# what a reward function returns, one value per completion (None: unscorable, TRL's convention)
REWARDS = Batch(rewards=Annotated[Float[Tensor, "N"], Finite()])
def loss_spec(rloo: bool, directed: bool) -> Batch:
    """One micro-batch's loss inputs and the per-token log-probs the loss computed from them (``logp`` [B, C]).
    Old log-probs are frozen within the generation (RLG002): GRPO's per token, RLOO's per sequence (``old_logps``
    against ``logp_sum``, the masked sums of ``logp``). ``directed`` (rows seen again after an optimizer step in
    the same generation): the update moves each row's log-probability the way its advantage says (RLG005, the
    verdict at the end of each generation's update: a surrogate that loses its minus mid-run shows there)."""
    markers: list = [Finite()]
    if directed:
        markers.append(UpdateDirection(advantages="advantages", mask="completion_mask", key="ids"))
    fields: dict = dict(ids=Int[Tensor, "B T"], completion_mask=Mask[Tensor, "B C"],
                        logp=Annotated[(Float[Tensor, "B C"], *markers)], advantages=Float[Tensor, "B ..."])
    if rloo:
        fields.update(logp_sum=Float[Tensor, "B"],
                      old_logps=Annotated[Float[Tensor, "B"], NoGrad(), Finite(), Frozen(current="logp_sum", key="ids")])
    else:
        fields["old_per_token_logps"] = Optional[Annotated[Float[Tensor, "B C"], NoGrad(), Finite(), Frozen(
            current="logp", key="ids", mask="completion_mask")]]
    return Batch(**fields)


# -- the loss's KL and entropy terms, read through autograd (RLG011, RLG004) --------------------------------------
# TRL's GRPO loss adds ``beta * per_token_kl`` and subtracts ``entropy_coef * entropy`` inside ``_compute_loss``;
# neither term leaves the method, so the sign they enter the loss with is read from autograd with the markers that
# own it (``Penalty``, ``Bonus``: ``d loss / d term``, ``torch.autograd.grad`` with the graph kept, no ``.grad``
# written). The entropy is a tensor the loss seam already observes: the second output of the loss's own
# ``_get_per_token_logps_and_entropies`` call. The per-token KL is computed from two tensors the seam has, the
# reference log-probs (``inputs["ref_per_token_logps"]``, TRL reads them only for that) and the policy's
# (``per_token_logps``, observed), but is not one of them; so the reference log-probs the loss reads are made to
# pass through ``_ReferenceDistance``: its forward returns them bit for bit, and through it they depend on a
# tensor ``lam`` of ones, read as ``ref(lam) = logp + lam * (ref - logp)`` at ``lam = 1``: the reference's
# distance from the policy, per token. A per-token KL estimator that is a divergence (0 where the two log-probs
# agree, growing as they part: TRL's ``exp(ref - logp) - (ref - logp) - 1``, the squared or absolute difference)
# grows with ``lam`` at every token where they differ, so ``d loss / d lam`` has the sign of ``d loss / d
# per_token_kl`` there, and is exactly 0 where they agree. ``lam`` is what ``Penalty`` reads, under the name
# ``per_token_kl``.
class _ReferenceDistance(torch.autograd.Function):
    """``ref`` unchanged (a copy, bit for bit); in the backward, the gradient of ``lam`` where ``ref(lam) = logp +
    lam * (ref - logp)`` at ``lam = 1``: ``grad * (ref - logp)``, with ``logp`` the policy's log-probs the loss
    computed (``frame["logp"]``). Only while ``frame["measuring"]`` (the callback's own ``autograd.grad``): in the
    trainer's backward it returns nothing, so training computes what it computes without the callback."""

    @staticmethod
    def forward(ctx, lam, ref, frame):  # noqa: ARG004 - lam is the input the backward differentiates
        ctx.ref, ctx.frame = ref, frame
        return ref.clone()

    @staticmethod
    def backward(ctx, grad):
        frame, ref = ctx.frame, ctx.ref
        logp = frame.get("logp")
        if not frame.get("measuring") or logp is None or logp.shape != ref.shape or logp.device != ref.device:
            return None, None, None
        return grad * (ref - logp).to(grad.dtype), None, None


def term_signs(where: str):
    """A contract on the loss ``where`` returned (``GRPOTrainer._compute_loss``): the KL term a penalty
    (``Penalty``, RLG011), the entropy term a bonus (``Bonus``, RLG004). Called as ``checked(per_token_kl,
    entropy, loss)`` with the terms' tensors (None: that term is not read in this call)."""
    def terms(per_token_kl, entropy, loss) -> Annotated[Tensor, Penalty("per_token_kl"), Bonus("entropy")]:
        return loss

    terms.__qualname__ = terms.__name__ = where
    return contract(terms, typechecker=None)


# the checks the callback can switch off one by one (after an internal error of its own)
GUARD = "Guard's reference and frozen-parameter checks (RLG008, RLG014)"
GENERATION = "checks of the generation batch (RLG001, RLG003, RLG005, RLG009)"
REWARDS_CHECK = "checks of the reward functions' values"
SIGNS = "checks of the KL and entropy terms' signs (RLG004, RLG011)"
LOSS = "checks of the loss inputs (RLG002) and the PPO ratio"
DIAGNOSIS = "live diagnosis of the logged metrics"


class RlguardCallback(TrainerCallback):
    """Contracts at TRL's batch seams, reference checks around optimizer steps, and live diagnosis.

    ``trainer``: the ``GRPOTrainer`` or ``RLOOTrainer`` it watches (add the callback to it, or use ``attach``);
    any other trainer raises ``UnsupportedTrainerError`` here, before training starts. ``contracts`` /
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
        self.trainer_class = supported_trainer(trainer, what="trainer given to RlguardCallback")
        self.rloo = issubclass(self.trainer_class, RLOOTrainer)
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
        self._unranked_noted = False  # said once: a generation whose advantages could not be ranked
        self._generation_logps: list | None = None  # (model, per-token log-probs) of the generation's scoring passes
        self._loss_frames: list[dict] = []
        self._term_signs = None  # the contract reading the loss's KL and entropy terms' signs (term_signs)
        self._terms_read_at = -1  # the optimizer step whose loss's terms were read last (once per step)
        self._ratio = [-math.inf, math.inf]  # max, min of the PPO ratio since the last log
        self._step_mode = None
        self._rewards = None  # what _calculate_rewards returned for the generation being checked
        self._reward_funcs: list | None = None  # the trainer's own reward functions, while they are wrapped
        self._logged: dict[str, set[str]] = {}  # kind of row -> TRL metrics logged in it with a finite value
        self._last_step = 0
        self.vanished: dict[str, int] = {}  # TRL metric -> the logging step from which it was missing or NaN
        self.switched_off: dict[str, str] = {}  # check -> the internal error that switched it off

    @classmethod
    def attach(cls, trainer, **kwargs) -> RlguardCallback:
        """A callback for ``trainer``, added to it (``UnsupportedTrainerError`` for another kind of trainer)."""
        callback = cls(trainer, **kwargs)
        trainer.add_callback(callback)
        return callback

    # -- rlguard's own failures ------------------------------------------------------------------------------------
    def _safely(self, check: str, fn, *args):
        """``fn(*args)``, rlguard's own code for ``check``: a violation or a symptom propagates (it is the news);
        any other error is rlguard's: logged once with what was being checked, and ``check`` switched off."""
        if check in self.switched_off:
            return None
        try:
            return fn(*args)
        except (ContractViolation, SymptomError):
            raise
        except Exception as exc:  # noqa: BLE001 - rlguard's own failure must not stop the run it watches
            self.switched_off[check] = f"{type(exc).__name__}: {exc}"
            _log.error("rlguard: internal error in the %s (%s: %s); that check is switched off for the rest of "
                       "the run, training goes on", check, type(exc).__name__, exc)
            if check == GUARD:  # its hooks must not run half-built
                self._close_guard()
            return None

    # -- training events ---------------------------------------------------------------------------------------
    def on_train_begin(self, args, state, control, optimizer=None, model=None, **kwargs):
        # a trainer swapped since the callback was made is refused here, before the first step
        supported_trainer(self.trainer, what="trainer given to RlguardCallback")
        self._refuse_another_trainer(model)
        self._release()  # a previous train() that ended in an exception left its wrappers and guard
        self._terms_read_at = -1
        if self.contracts:
            self._safely(GUARD, self._start_guard, optimizer)
            self._safely(GENERATION, self._choose_generation_spec)
            self._wrap("_generate", self._observed_generate)
            self._wrap("_calculate_rewards", self._observed_rewards)
            self._wrap("_generate_and_score_completions", self._checked_generation)
            self._safely(REWARDS_CHECK, self._wrap_reward_functions)
        if self.contracts or self.monitor is not None:  # the monitor reads the PPO ratio from the loss seam
            self._wrap("_compute_loss", self._checked_loss)
            self._wrap("_get_per_token_logps_and_entropies", self._observed_logps)

    def _refuse_another_trainer(self, model) -> None:
        """The callback runs in the trainer it was made for: one made for a GRPOTrainer and added by hand to
        another trainer (a DPOTrainer, an SFTTrainer, a second GRPOTrainer) would check the wrong trainer's seams
        while that one trains unwatched. Told by the model ``train()`` passes to its callbacks (the trainer's own,
        as it was built; FSDP may wrap it since) and by the callback being in the trainer's callback list."""
        t = self.trainer
        handler = getattr(t, "callback_handler", None)
        added = handler is None or any(cb is self for cb in getattr(handler, "callbacks", ()))
        same_model = model is None or bool({id(m) for m in wrapper_chain(model)} &
                                           {id(m) for m in wrapper_chain(getattr(t, "model", None))})
        if added and same_model:
            return
        why = ("the model train() passed to the callbacks is a " + type(model).__name__ + ", not this trainer's"
               if not same_model else "the callback is not in this trainer's callback list")
        raise UnsupportedTrainerError(
            f"RlguardCallback was made for a {type(t).__name__} and is running in another trainer's train() "
            f"({why}): a callback made for one trainer and added by hand to another (a DPOTrainer, an SFTTrainer, "
            f"another {self.trainer_class.__name__}) would watch the wrong one; refused before the first step. "
            f"Make one for the trainer you train: RlguardCallback.attach(trainer), which supports "
            f"{SUPPORTED_NAMES}")

    def _choose_generation_spec(self) -> None:
        t = self.trainer
        grouped = t.accelerator.num_processes == 1
        # advantages ranked as the rewards where they are an increasing function of the reward TRL centres within a
        # group: GRPO summing before normalising; RLOO always, its reward with the KL penalty TRL subtracts
        # (beta > 0: rebuilt from the old and reference log-probs the generation computed, _ranking_rewards)
        ranked = (True if self.rloo else
                  getattr(t, "multi_objective_aggregation", "sum_then_normalize") == "sum_then_normalize")
        self._ranked = grouped and ranked
        self._generation_spec = generation_spec(self.rloo, grouped, self._ranked)
        self._loss_spec = loss_spec(self.rloo, directed=self._multi_step())

    def _wrap_reward_functions(self) -> None:
        """Each reward function (synchronous or async), wrapped to check what it returns before TRL turns a
        missing reward (None) into NaN and NaN advantages into 0: a NaN or infinite reward is the user's function
        misbehaving. A reward model (``nn.Module``) stays as it is (TRL dispatches on its class); its column of
        ``_calculate_rewards``' output is checked instead (``_check_reward_models``): a model never returns None,
        so every NaN there is its own. The trainer gets a new list; its own is put back at the end of train()."""
        from trl.trainer.utils import is_async_callable  # TRL's own test, as it dispatches them

        t = self.trainer
        funcs = list(t.reward_funcs)
        wrapped = []
        for func, name in zip(funcs, t.reward_func_names):
            if isinstance(func, torch.nn.Module):
                wrapped.append(func)
            else:
                wrapped.append(self._checked_reward_function(func, name, is_async_callable(func)))
        self._reward_funcs = funcs
        t.reward_funcs = wrapped

    def _checked_reward_function(self, func, name: str, is_async: bool = False):
        if is_async:  # still a coroutine function, so that TRL gathers it with the other async ones
            async def checked(*args, **kwargs):
                out = await func(*args, **kwargs)
                self._safely(REWARDS_CHECK, self._check_rewards, out, name)
                return out
        else:
            def checked(*args, **kwargs):
                out = func(*args, **kwargs)
                self._safely(REWARDS_CHECK, self._check_rewards, out, name)
                return out

        checked.__name__ = getattr(func, "__name__", name)
        checked.__wrapped__ = func
        return checked

    def _check_reward_models(self, rewards_per_func) -> None:
        """The reward models' columns of ``_calculate_rewards``' output ([B, reward functions]), before TRL's NaN
        handling: finite (a model has no None convention; the functions' columns are checked as they return)."""
        t = self.trainer
        funcs = self._reward_funcs if self._reward_funcs is not None else t.reward_funcs
        if not torch.is_tensor(rewards_per_func) or rewards_per_func.dim() != 2:
            return
        for i, (func, name) in enumerate(zip(funcs, t.reward_func_names)):
            if isinstance(func, torch.nn.Module) and i < rewards_per_func.shape[1]:
                with contracts_mode(self.mode):
                    check_batch(REWARDS, {"rewards": rewards_per_func[:, i].detach().double()}, where=name,
                                name="output")

    def _check_rewards(self, out, name: str) -> None:
        values = [float(r) for r in out if r is not None]
        if values:
            with contracts_mode(self.mode):
                check_batch(REWARDS, {"rewards": torch.tensor(values, dtype=torch.float64)}, where=name,
                            name="output")

    def _start_guard(self, optimizer) -> None:
        t = self.trainer
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

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if self.guard is not None:  # the guard's step hooks report under the callback's mode
            self._step_mode = contracts_mode(self.mode)
            self._step_mode.__enter__()

    def on_optimizer_step(self, args, state, control, **kwargs):
        self._leave_step_mode()

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.monitor is None or not logs or any(key.startswith("eval_") for key in logs):
            return  # evaluation rows are not training steps
        self._safely(DIAGNOSIS, self._diagnose, logs, state.global_step)

    def _diagnose(self, logs: dict, step: int) -> None:
        if not any(key in logs for key in TRL_METRICS):
            return  # the end-of-training summary, when the last logging step has already taken the metrics
        self._watch_metrics(logs, step)
        row = diagnose_row({k: v for k, v in logs.items() if not k.startswith("train_")}, step, self.trainer.beta)
        if self._multi_step() and self._ratio[0] > -math.inf:
            row["ratio_max"], row["ratio_min"] = self._ratio
        self._ratio = [-math.inf, math.inf]
        self.monitor.step(row)

    def _watch_metrics(self, logs: dict, step: int) -> None:
        """A metric TRL logged before and no longer logs (TRL logs an all-NaN metric as NaN, which JSON logs
        write as null): said once, with the step, because no symptom rule can read a metric that is gone."""
        # TRL logs the generation's metrics (completions/*, rewards, kl) only at the steps that generate, the
        # loss's at every step: a metric is missing when a row of its kind lacks it
        kind = "generation" if any(key.startswith("completions/") for key in logs) else "loss"
        present = set()
        for key, value in logs.items():
            if key in TRL_METRICS or key.startswith("rewards/"):
                if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                    present.add(key)
        logged = self._logged.setdefault(kind, set())
        for key in sorted(logged - present - set(self.vanished)):
            self.vanished[key] = int(step)
            _log.warning("rlguard: TRL's metric %r was logged until step %d and is missing or NaN from step %d on "
                         "(a reward function returning NaN or None, or a term that stopped being computed); the "
                         "symptom rules that read it see nothing from here", key, self._last_step, step)
        logged |= present
        self._last_step = int(step)

    def on_train_end(self, args, state, control, **kwargs):
        self._release()

    def close(self) -> None:
        """Take the wrappers off the trainer, close the guard, and close the monitor's JSONL log (it is flushed
        at every row, so it reads while training runs)."""
        self._release()
        if self.monitor is not None:
            self._safely(DIAGNOSIS, self.monitor.close)

    def _release(self) -> None:
        """End the update, close the guard and take the wrappers off the trainer (at the end of ``train()``)."""
        self._leave_step_mode()
        for name in self._wrapped:
            self.trainer.__dict__.pop(name, None)
        self._wrapped = []
        if self._reward_funcs is not None:
            self.trainer.reward_funcs, self._reward_funcs = self._reward_funcs, None
        if self.guard is not None:
            self._safely(GUARD, self._end_update)
            self._close_guard()

    def _end_update(self) -> None:
        with contracts_mode(self.mode):
            if self.guard is not None and self.guard.in_update:
                self.guard.end_update()

    def _next_update(self) -> None:
        with contracts_mode(self.mode):
            if self.guard.in_update:
                self.guard.end_update()
            self.guard.begin_update()

    def _close_guard(self) -> None:
        guard, self.guard = self.guard, None
        if guard is not None:
            with contextlib.suppress(Exception):  # removing hooks; nothing to report
                guard.close()

    # -- the seams: TRL's own call runs exactly once, outside rlguard's error handling -----------------------------
    def _wrap(self, name: str, wrapper) -> None:
        original = getattr(self.trainer, name)
        setattr(self.trainer, name, lambda *a, **k: wrapper(original, *a, **k))
        self._wrapped.append(name)

    def _observed_generate(self, original, *args, **kwargs):
        out = original(*args, **kwargs)
        self._generated = out
        return out

    def _observed_rewards(self, original, *args, **kwargs):
        out = original(*args, **kwargs)
        self._rewards = out
        self._safely(REWARDS_CHECK, self._check_reward_models, out)
        return out

    def _checked_generation(self, original, inputs, *args, **kwargs):
        training = self.trainer.model.training
        if training and self.guard is not None:  # a new generation starts an update: the steps until the next
            self._safely(GUARD, self._next_update)  # one reuse its batch
        self._generation_logps = [] if training else None
        try:
            out = original(inputs, *args, **kwargs)
        finally:
            logps, self._generation_logps = self._generation_logps, None
        generated, self._generated = self._generated, None
        rewards, self._rewards = self._rewards, None
        if training and generated is not None:
            self._safely(GENERATION, self._check_generation, out, generated, rewards, logps)
        return out

    def _check_generation(self, out: dict, generated: tuple, rewards_per_func, logps=None) -> None:
        t = self.trainer
        prompt_len = out["prompt_ids"].shape[1]
        written = policy_written(t, generated, out["completion_ids"].shape[1]).to(out["completion_ids"].device)
        owner = torch.cat([torch.zeros_like(out["prompt_ids"]), written.long() * POLICY_ROLE], dim=1)
        mask = out["completion_mask"] * out["tool_mask"] if "tool_mask" in out else out["completion_mask"]
        tensors = dict(owner=owner, action_mask=per_token(prompt_len, mask), advantages=out["advantages"])
        if self.rloo:
            tensors["old_logps"] = out["old_logps"]
        else:
            tensors.update(old_per_token_logps=out.get("old_per_token_logps"),
                           ref_per_token_logps=out.get("ref_per_token_logps"),
                           sampling_per_token_logps=out.get("sampling_per_token_logps"))
        spec = self._generation_spec
        if t.accelerator.num_processes == 1:
            tensors["group_size"] = t.num_generations
        if self._ranked:
            rewards = self._ranking_rewards(out, rewards_per_func, logps)
            if rewards is None:  # this generation's reward cannot be rebuilt: its advantages are not ranked
                spec = generation_spec(self.rloo, t.accelerator.num_processes == 1, ranked=False)
                if not self._unranked_noted:
                    self._unranked_noted = True
                    _log.warning("rlguard: the advantage-rank check (RLG005) could not rebuild the reward TRL centred "
                                 "at step %d (its rewards%s were not observed as TRL computed them); it is skipped "
                                 "for such generations, the other generation checks run", t.state.global_step,
                                 " or the KL penalty's log-probs" if self.rloo and t.beta != 0.0 else "")
            else:
                tensors["rewards"] = rewards
        with contracts_mode(self.mode):
            check_batch(spec, tensors, where=f"{self.trainer_class.__name__}._generate_and_score_completions",
                        name="output")

    def _ranking_rewards(self, out: dict, rewards_per_func, logps) -> torch.Tensor | None:
        """The reward TRL centres within each group, rebuilt as TRL computes it: the weighted sum of the reward
        functions (NaN where none scored the completion (None): TRL leaves such rows out of the baseline and gives
        them advantage 0, so they are ranked with nothing), clipped to ``reward_clip_range``, and for RLOO with
        ``beta != 0`` minus ``beta`` times the sequence KL to the reference (the masked sum of the old minus the
        reference per-token log-probs of the generation's own scoring passes). None when it cannot be rebuilt."""
        t = self.trainer
        if not torch.is_tensor(rewards_per_func) or rewards_per_func.shape[0] != out["advantages"].shape[0]:
            return None
        weights = t.reward_weights.to(rewards_per_func.device).unsqueeze(0)
        rewards = (rewards_per_func * weights).nansum(dim=1)
        rewards[torch.isnan(rewards_per_func).all(dim=1)] = torch.nan
        clip = getattr(t, "reward_clip_range", None)
        if clip:
            rewards = rewards.clamp(min=clip[0], max=clip[1])
        if self.rloo and t.beta != 0.0:
            kl = self._sequence_kl(out, logps)
            if kl is None:
                return None
            rewards = rewards - t.beta * kl.to(rewards.device)
        return rewards.to(out["advantages"].device)

    def _sequence_kl(self, out: dict, logps) -> torch.Tensor | None:
        """RLOO's sequence KL penalty, ``((old - ref) * completion_mask).sum(-1)`` per completion, from the
        generation's scoring passes as TRL ran them (autograd off): the policy's first (the old log-probs), then
        the reference's (``ref_model``; with PEFT and no ``ref_model``, the policy's second pass, adapter off)."""
        t = self.trainer
        if not logps or len(logps) < 2 or logps[0][0] is not t.model:
            return None
        old = logps[0][1]
        if t.ref_model is not None:
            ref = next((lp for model, lp in logps[1:] if model is t.ref_model), None)
        else:
            ref = logps[1][1] if logps[1][0] is t.model else None
        mask = out["completion_mask"]
        if ref is None or old.shape != mask.shape or ref.shape != mask.shape:
            return None
        return ((old - ref) * mask).sum(-1)

    def _observed_logps(self, original, *args, **kwargs):
        out = original(*args, **kwargs)
        if self._generation_logps is not None and not torch.is_grad_enabled() and len(self._generation_logps) < 4:
            model = args[0] if args else kwargs.get("model")
            self._generation_logps.append((model, out[0]))  # the generation's scoring passes (no autograd)
        frames = self._loss_frames
        if frames and frames[-1]["logp"] is None and torch.is_grad_enabled():
            frames[-1]["logp"] = out[0].detach()
            if frames[-1].get("terms") and torch.is_tensor(out[1]) and out[1].requires_grad:
                frames[-1]["entropy"] = out[1]  # the loss's own entropies, with their graph (its bonus term)
        return out

    def _checked_loss(self, original, model, inputs, *args, **kwargs):
        frame = {"logp": None}
        step = self.trainer.state.global_step
        if self.contracts and not self.rloo and torch.is_grad_enabled() and self.trainer.model.training and \
                step != self._terms_read_at:
            # the KL and entropy terms' signs are read from this call's graph: once per optimizer step, on its first
            # micro-batch (the loss code is the same for the others; a slip that starts mid-run shows at its step)
            self._terms_read_at = step
            frame["terms"] = True
            self._safely(SIGNS, self._trace_reference, inputs, frame)
        self._loss_frames.append(frame)
        try:
            loss = original(model, inputs, *args, **kwargs)
        finally:
            self._loss_frames.pop()
            if "ref" in frame and isinstance(inputs, dict) and inputs.get("ref_per_token_logps") is frame["traced"]:
                inputs["ref_per_token_logps"] = frame["ref"]  # the batch as TRL built it, for later micro-steps
        if frame["logp"] is not None and self.trainer.model.training:
            self._safely(LOSS, self._check_loss, inputs, frame["logp"])
            self._safely(SIGNS, self._check_signs)
            if frame.get("terms"):
                self._safely(SIGNS, self._check_terms, loss, frame)
        frame.clear()  # the traced reference's backward reads it: it holds nothing from here on
        return loss

    def _check_loss(self, inputs: dict, logp: torch.Tensor) -> None:
        mask = inputs["completion_mask"] * inputs["tool_mask"] if "tool_mask" in inputs else inputs["completion_mask"]
        ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
        where = f"{self.trainer_class.__name__}._compute_loss"
        values = {"ids": ids, "completion_mask": mask, "logp": logp, "advantages": inputs["advantages"]}
        if self.rloo:  # one old log-prob per sequence: the ratio is of the masked sums
            old = inputs.get("old_logps")
            logp = values["logp_sum"] = (logp * mask).sum(1)
            values["old_logps"] = old
            selected = mask.bool().any(1)
        else:
            old = values["old_per_token_logps"] = inputs.get("old_per_token_logps")
            selected = mask.bool()
        if self.contracts and "_loss_spec" in self.__dict__:
            with contracts_mode(self.mode):
                check_batch(self._loss_spec, values, where=where, name="inputs")
        if old is not None and selected.any():
            with torch.no_grad():
                ratio = torch.exp(logp.float() - old.float())[selected]
                self._ratio = [max(self._ratio[0], float(ratio.max())), min(self._ratio[1], float(ratio.min()))]
        elif selected.any():  # TRL uses the fresh log-probs, detached: the ratio is exactly 1
            self._ratio = [max(self._ratio[0], 1.0), min(self._ratio[1], 1.0)]

    def _check_signs(self) -> None:
        """The signs of the loss's KL and entropy coefficients as the loss uses them now (TRL's ``beta`` and
        ``entropy_coef``, which a schedule, the adaptive entropy control or a subclass may change mid-run): the
        KL term (GRPO's loss; RLOO's reward penalty) must be a penalty, the entropy term a bonus."""
        t, where = self.trainer, f"{self.trainer_class.__name__}._compute_loss"
        found = []
        if t.beta < 0:
            found.append(Violation(KL_SIGN, where, "beta", format_message(
                KL_SIGN, where, "beta", f"the KL coefficient is {t.beta:g} (< 0): the KL to the reference is "
                "rewarded, so the update drives the policy away from it", got=repr(t.beta),
                hint="beta >= 0 (0 turns the KL term off); see RLG011")))
        if not self.rloo and getattr(t, "_entropy_bonus_enabled", False) and t.entropy_coef < 0:
            found.append(Violation(ENTROPY_BONUS_SIGN, where, "entropy_coef", format_message(
                ENTROPY_BONUS_SIGN, where, "entropy_coef", f"the entropy coefficient is {t.entropy_coef:g} (< 0): "
                "TRL subtracts entropy_coef * entropy from the loss, so the entropy is penalised and the policy "
                "collapses", got=repr(t.entropy_coef), hint="entropy_coef >= 0; see RLG004")))
        if found:
            with contracts_mode(self.mode):
                report(found)

    def _trace_reference(self, inputs, frame: dict) -> None:
        """Before the loss runs: the reference log-probs it will read, passed through ``_ReferenceDistance``
        (same values, bit for bit) so that ``d loss / d per_token_kl``'s sign can be read after it (``lam``). Put
        back in ``inputs`` when the loss returns. Nothing to trace without a KL term (``beta == 0``)."""
        ref = inputs.get("ref_per_token_logps") if isinstance(inputs, dict) else None
        if self.trainer.beta == 0.0 or not torch.is_tensor(ref) or not ref.is_floating_point() or ref.requires_grad:
            return
        lam = torch.ones_like(ref, requires_grad=True)
        traced = _ReferenceDistance.apply(lam, ref, frame)
        setattr(traced, TRACED_TARGET, True)  # a NoGrad contract on the user's own loss reads it as the target
        frame.update(lam=lam, ref=ref, traced=traced)
        inputs["ref_per_token_logps"] = traced

    def _check_terms(self, loss, frame: dict) -> None:
        """After the loss: the KL term must enter it as a penalty (``d loss / d per_token_kl >= 0`` at every
        token, RLG011) and the entropy as a bonus (``d loss / d entropy <= 0``, RLG004), read by ``Penalty`` and
        ``Bonus`` from this call's graph (two ``torch.autograd.grad`` calls through the terms' few elementwise
        ops, never the model; no ``.grad`` written). A term the loss does not use, or uses with coefficient 0
        (``beta == 0``, the entropy bonus off), has nothing to say."""
        if not torch.is_tensor(loss) or not loss.requires_grad:
            return
        if self._term_signs is None:
            self._term_signs = term_signs(f"{self.trainer_class.__name__}._compute_loss")
        frame["measuring"] = True
        try:
            with contracts_mode(self.mode):
                self._term_signs(frame.get("lam"), frame.get("entropy"), loss)
        finally:
            frame["measuring"] = False

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
