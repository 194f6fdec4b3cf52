"""The :class:`Guard`: update boundaries and optimizer steps, and the state of every stateful check.

Create it once with the policy, the reference and the optimizer. It checks the reference at construction
(RLG008), hooks ``optimizer.step`` through ``register_step_pre_hook``/``register_step_post_hook`` (no
monkey-patching) to count steps and to verify that a step leaves the reference bit-identical, and marks
update boundaries with ``with guard.update():``. Decorated functions find the active guard themselves
(:func:`active_guard`): the newest guard, or the one whose ``update()`` block is running.

All state of the stateful checks (frozen old log-probs fingerprints, once-per-update flags) lives here and is
cleared at each update boundary; it is made of Python ints/floats only, never tensors, so it holds no graph
and no batch. The guard holds its policy, reference and optimizer through weak references.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Iterator

import torch
from torch import nn

from rlguard.contracts.errors import Violation
from rlguard.contracts.settings import flush_compiled_notes, report
from rlguard.contracts.spec import format_message

_CURRENT: weakref.ReferenceType | None = None
FROZEN_ROWS_CAP = 1 << 16  # rows fingerprinted per (function, argument) and update: bounds the state's memory


def active_guard() -> Guard | None:
    """The guard decorated functions use now (``None`` when there is none)."""
    return _CURRENT() if _CURRENT is not None else None


def _set_current(guard: Guard | None) -> None:
    global _CURRENT
    _CURRENT = weakref.ref(guard) if guard is not None else None


# -- module relations (RLG008) ----------------------------------------------------------------------------
def wrapper_chain(m: Any) -> list[Any]:
    """``m`` and the modules it wraps: DDP/FSDP/DataParallel ``.module``, ``torch.compile``'s ``_orig_mod``,
    PEFT-style ``get_base_model()`` / ``base_model.model``."""
    chain = [m]
    seen = {id(m)}
    while True:
        inner = None
        for attr in ("module", "_orig_mod"):
            cand = getattr(m, attr, None)
            if isinstance(cand, nn.Module):
                inner = cand
                break
        if inner is None and callable(getattr(m, "get_base_model", None)):
            try:
                cand = m.get_base_model()
            except Exception:  # noqa: BLE001 - a foreign wrapper; the storage check still applies
                cand = None
            inner = cand if isinstance(cand, nn.Module) else None
        if inner is None or id(inner) in seen:
            return chain
        chain.append(inner)
        seen.add(id(inner))
        m = inner


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a sharded tensor (FSDP2 / DTensor parameters), else the tensor itself."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def _ptr(t: torch.Tensor) -> int:
    return _local(t).untyped_storage().data_ptr()


def _storages(m: nn.Module) -> dict[int, str]:
    out: dict[int, str] = {}
    for name, t in list(m.named_parameters(remove_duplicate=False)) + list(m.named_buffers(remove_duplicate=False)):
        ptr = _ptr(t)
        if ptr:
            out.setdefault(ptr, name)
    return out


def reference_problems(reference: Any, policy: Any, optimizer: Any = None, full: bool = True) -> list[str]:
    """What makes ``reference`` not a distinct frozen copy of ``policy`` (empty list: nothing)."""
    if reference is policy:
        return ["the reference is the policy object itself (ref = model?)"]
    ref_chain, pol_chain = wrapper_chain(reference), wrapper_chain(policy)
    pol_ids = {id(x) for x in pol_chain}
    for r in ref_chain:
        if id(r) in pol_ids:
            return [f"the reference and the policy wrap the same {type(r).__name__} object"]
    if not full or not isinstance(reference, nn.Module):
        return []
    problems = []
    ref_st = _storages(reference)
    if isinstance(policy, nn.Module):
        pol_st = _storages(policy)
        shared = [name for ptr, name in ref_st.items() if ptr in pol_st]
        if shared:
            problems.append(
                f"{len(shared)} of the reference's parameters/buffers share storage with the policy's "
                f"(first: {shared[0]!r}): a shallow copy (copy.copy), tied weights, or a PEFT base model?")
    if optimizer is not None:
        opt_ptrs = {}
        for group in optimizer.param_groups:
            for p in group["params"]:
                opt_ptrs.setdefault(_ptr(p), True)
        in_opt = [name for ptr, name in ref_st.items() if ptr in opt_ptrs]
        if in_opt:
            problems.append(
                f"{len(in_opt)} of the reference's parameters are in the optimizer's param groups "
                f"(first: {in_opt[0]!r}): optimizer.step() will train the reference")
    return problems


REFERENCE_HINT = ("the KL reference must be a separate frozen copy: ref = copy.deepcopy(policy).eval()."
                  "requires_grad_(False), made before training, and not given to the optimizer; see RLG008")


def _ref_tensors(m: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [(n, t) for n, t in list(m.named_parameters()) + list(m.named_buffers())]


def _fingerprint(tensors: list[tuple[str, torch.Tensor]]) -> list[tuple[float, float]]:
    """(sum, sum of squares) in float64 per tensor; deterministic, no RNG, nothing kept but floats."""
    out = []
    with torch.no_grad():
        for _, t in tensors:
            t = _local(t)  # a sharded reference: each rank fingerprints its own shard (no collective)
            if t.is_floating_point() and t.numel():
                d = t.detach().double()
                out.append((float(d.sum()), float((d * d).sum())))
            else:
                out.append((0.0, 0.0))
    return out


class Guard:
    """Update boundaries and optimizer steps for the stateful contracts (RLG002, RLG007, RLG008).

    ``Guard(policy=model, reference=ref, optimizer=opt)`` checks now that ``ref`` is a distinct, frozen
    reference (RLG008) and hooks ``opt.step``. Wrap each update (all minibatches and epochs of one rollout) in
    ``with guard.update():``. ``check_every`` spaces out the value fingerprint of the reference around steps
    (the first step is always checked; in-place writes are seen on every step through version counters).
    """

    def __init__(self, policy: nn.Module | None = None, reference: nn.Module | None = None,
                 optimizer: torch.optim.Optimizer | None = None, *, check_every: int = 1) -> None:
        if not isinstance(check_every, int) or check_every < 1:
            raise ValueError(f"check_every must be a positive int, got {check_every!r}")
        self._policy = weakref.ref(policy) if policy is not None else None
        self._reference = weakref.ref(reference) if reference is not None else None
        self._optimizer = weakref.ref(optimizer) if optimizer is not None else None
        self.check_every = check_every
        self.updates = 0  # update() blocks begun
        self.steps = 0  # optimizer steps seen
        self.steps_in_update = 0  # optimizer steps since the current update began
        self.in_update = False
        self._frozen: dict[tuple[str, str], dict[int, float]] = {}
        self._done: set[tuple[str, str, str]] = set()
        self._pre_versions: list[int] | None = None
        self._pre_fp: list[tuple[float, float]] | None = None
        self._hooks: list[Any] = []
        report(self._reference_violations(), collective=True)  # every rank builds its guard: a synchronised point
        if optimizer is not None:
            self._hooks = [optimizer.register_step_pre_hook(self._pre_step),
                           optimizer.register_step_post_hook(self._post_step)]
        _set_current(self)

    # -- the objects ---------------------------------------------------------------------------------------
    @property
    def policy(self) -> nn.Module | None:
        return self._policy() if self._policy is not None else None

    @property
    def reference(self) -> nn.Module | None:
        return self._reference() if self._reference is not None else None

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        return self._optimizer() if self._optimizer is not None else None

    # -- update boundaries ---------------------------------------------------------------------------------
    def begin_update(self) -> None:
        """Start an update: the next calls, until the first ``optimizer.step()``, are its first minibatch."""
        flush_compiled_notes()
        _set_current(self)
        self.updates += 1
        self.in_update = True
        self.steps_in_update = 0
        self._frozen.clear()
        self._done.clear()
        report(self._reference_violations(), collective=True)

    def end_update(self, flush: bool = True) -> None:
        """End the update. ``flush``: report the violations held since the last synchronised call (under
        ``torch.distributed``: a collective, so call it on every rank; nothing happens in one process)."""
        self.in_update = False
        self._frozen.clear()
        self._done.clear()
        if flush:
            report([], collective=True)

    @contextlib.contextmanager
    def update(self) -> Iterator[Guard]:
        """``with guard.update():`` around the minibatch/epoch loop of one rollout."""
        self.begin_update()
        ok = False
        try:
            yield self
            ok = True
        finally:
            # no collective while an exception leaves the block: the other ranks may be elsewhere
            self.end_update(flush=ok)

    def close(self) -> None:
        """Remove the optimizer hooks and stop being the active guard."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if active_guard() is self:
            _set_current(None)

    def __enter__(self) -> Guard:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- state used by the markers -------------------------------------------------------------------------
    def once(self, key: tuple[str, str, str]) -> bool:
        """True the first time ``key`` is seen in this update (once-per-update checks)."""
        if key in self._done:
            return False
        self._done.add(key)
        return True

    def frozen_rows(self, function: str, argument: str) -> dict[int, float]:
        return self._frozen.setdefault((function, argument), {})

    # -- RLG008 --------------------------------------------------------------------------------------------
    def _reference_violations(self) -> list[Violation]:
        ref, pol = self.reference, self.policy
        if ref is None or pol is None:
            return []
        return [Violation("RLG008", "Guard", "reference",
                          format_message("RLG008", "Guard", "reference", p, hint=REFERENCE_HINT))
                for p in reference_problems(ref, pol, self.optimizer)[:1]]

    def _pre_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        flush_compiled_notes()
        ref = self.reference
        if ref is None:
            return
        tensors = _ref_tensors(ref)
        self._pre_versions = [t._version for _, t in tensors]
        self._pre_fp = _fingerprint(tensors) if self.steps % self.check_every == 0 else None

    def _post_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        due = self.steps % self.check_every == 0  # the step counter: the same on every rank
        self.steps += 1
        self.steps_in_update += 1
        ref = self.reference
        violations: list[Violation] = []
        if ref is not None and self._pre_versions is not None:
            tensors = _ref_tensors(ref)
            changed = [n for (n, t), v in zip(tensors, self._pre_versions) if t._version != v]
            if self._pre_fp is not None:
                changed += [n for (n, _), a, b in zip(tensors, self._pre_fp, _fingerprint(tensors))
                            if a != b and n not in changed]
            if changed:
                problem = (f"optimizer.step() changed {len(changed)} of the reference's tensors "
                           f"(first: {changed[0]!r}); the reference must stay bit-identical")
                violations.append(Violation("RLG008", "Guard", "reference", format_message(
                    "RLG008", "Guard", "reference", problem, hint=REFERENCE_HINT)))
        self._pre_versions = self._pre_fp = None
        report(violations, collective=due)
