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
from rlguard.contracts.markers import Probe, settle
from rlguard.contracts.settings import STATE, flush_compiled_notes, report
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
    optimizers = optimizer if isinstance(optimizer, (list, tuple)) else [optimizer] if optimizer is not None else []
    if optimizers:
        opt_ptrs = {}
        for opt in optimizers:
            for group in opt.param_groups:
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


def named_tensors(m: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """A module's parameters and buffers by name."""
    return list(m.named_parameters()) + list(m.named_buffers())


def _norms(tensors: list[torch.Tensor]) -> torch.Tensor:
    """One deterministic float64 number per tensor, its L2 norm (float32 on MPS, which has no float64), all on
    one device: ``torch._foreach_norm`` for the floating tensors (one dispatch), one norm per other tensor."""
    local = [_local(t).detach() for t in tensors]  # a sharded tensor: each rank reads its own shard, no collective
    acc = torch.float32 if local and local[0].device.type == "mps" else torch.float64
    floats = [i for i, t in enumerate(local) if t.is_floating_point()]
    out: list[Any] = [None] * len(local)
    if floats:
        try:
            for i, n in zip(floats, torch._foreach_norm([local[i] for i in floats], 2, dtype=acc)):
                out[i] = n
        except (AttributeError, TypeError, RuntimeError):  # a torch without the dtype argument
            for i in floats:
                out[i] = torch.linalg.vector_norm(local[i], dtype=acc)
    for i, t in enumerate(local):
        if out[i] is None:
            t = torch.view_as_real(t) if t.is_complex() else t
            out[i] = torch.linalg.vector_norm(t.to(acc) if not t.is_floating_point() else t, dtype=acc)
    return torch.stack(out)


class Watch:
    """Tensors that must stay unchanged (a reference model, a frozen set): held weakly, by name.

    ``versions()`` reads their version counters (in-place writes bump them: metadata, no host sync);
    ``fingerprint()`` computes one float64 norm per tensor on its device (no host sync) and ``differ(a, b)``
    turns two fingerprints into :class:`~rlguard.contracts.markers.Probe` s, read with the step's other probes
    in one host transfer.
    """

    def __init__(self, named: list[tuple[str, torch.Tensor]]) -> None:
        self.names = [n for n, _ in named]
        self._refs = [weakref.ref(t) for _, t in named]

    def __len__(self) -> int:
        return len(self.names)

    def tensors(self) -> list[torch.Tensor | None]:
        return [r() for r in self._refs]

    def versions(self) -> list[int]:
        return [t._version if t is not None else -1 for t in self.tensors()]

    def fingerprint(self) -> dict[Any, tuple[list[int], torch.Tensor]]:
        """device -> (indices, [n] norms), nothing read on the host."""
        groups: dict[Any, list[int]] = {}
        tensors = self.tensors()
        for i, t in enumerate(tensors):
            if t is not None:
                groups.setdefault(_local(t).device, []).append(i)
        with torch.no_grad():
            return {dev: (idx, _norms([tensors[i] for i in idx])) for dev, idx in groups.items()}

    def differ(self, before: dict, after: dict, found: list[str]) -> list[Probe]:
        """Probes that append to ``found`` the names whose fingerprint changed from ``before`` to ``after``."""
        probes = []
        for dev, (idx, now) in after.items():
            prev = before.get(dev)
            if prev is None or prev[0] != idx:
                continue

            def finish(h: list[float], idx: list[int] = idx) -> None:
                found.extend(self.names[i] for i, changed in zip(idx, h) if changed)
                return None

            probes.append(Probe((now != prev[1]).to(now.dtype), finish))
        return probes


class Guard:
    """Update boundaries and optimizer steps for the stateful contracts (RLG002, RLG007, RLG008).

    ``Guard(policy=model, reference=ref, optimizer=opt)`` checks now that ``ref`` is a distinct, frozen
    reference (RLG008) and hooks ``opt.step``. Wrap each update (all minibatches and epochs of one rollout) in
    ``with guard.update():``. Every step: the optimizers' param groups are counted (a group added since the last
    look gets the reference re-checked at once). Every ``check_every``-th step (the first included): the
    reference's version counters (in-place writes) and a float64 norm of each of its tensors before and after
    the step, compared with one host read, and a synchronised point across ranks. The reference's identity is
    checked at every ``update()``, its storage and optimizer membership at every ``check_every``-th. The default
    16 keeps the value reads to one step in 16 (cost: ``docs/benchmarks.md``).
    """

    def __init__(self, policy: nn.Module | None = None, reference: nn.Module | None = None,
                 optimizer: torch.optim.Optimizer | None = None, *, check_every: int = 16) -> None:
        if not isinstance(check_every, int) or isinstance(check_every, bool) or check_every < 1:
            raise ValueError(f"check_every must be a positive int, got {check_every!r}")
        self._policy = weakref.ref(policy) if policy is not None else None
        self._reference = weakref.ref(reference) if reference is not None else None
        self._optimizer = weakref.ref(optimizer) if optimizer is not None else None
        self.check_every = check_every
        self.updates = 0  # update() blocks begun
        self.steps = 0  # optimizer steps seen
        self.steps_in_update = 0  # optimizer steps since the current update began
        self.in_update = False
        self._frozen: dict[tuple, dict] = {}
        self._done: set[tuple[str, str, str]] = set()
        self._ref_watch = Watch(named_tensors(reference)) if isinstance(reference, nn.Module) else None
        self._pre_versions: list[int] | None = None
        self._pre_fp: dict | None = None
        self._hooks: list[Any] = []
        self._groups = self._group_signature()
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

    @property
    def optimizers(self) -> list:
        opt = self.optimizer
        return [opt] if opt is not None else []

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
        full = (self.updates - 1) % self.check_every == 0  # the update counter: the same on every rank
        ref = self.reference
        if full and isinstance(ref, nn.Module):  # parameters may have been replaced (a reload) since
            self._ref_watch = Watch(named_tensors(ref))
        if full:
            self._groups = self._group_signature()
        report(self._reference_violations(full), collective=True)

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

    def frozen_rows(self, function: str, argument: str, length: Any = None) -> dict:
        """Frozen's store of row key -> value for one (function, argument, row length) in this update."""
        return self._frozen.setdefault((function, argument, length), {})

    # -- RLG008 --------------------------------------------------------------------------------------------
    def _reference_violations(self, full: bool = True) -> list[Violation]:
        """RLG008 now: identity always; shared storage and optimizer membership when ``full``."""
        ref, pol = self.reference, self.policy
        if ref is None or pol is None or STATE.mode == "off":
            return []
        return [Violation("RLG008", "Guard", "reference",
                          format_message("RLG008", "Guard", "reference", p, hint=REFERENCE_HINT))
                for p in reference_problems(ref, pol, self.optimizers, full=full)[:1]]

    def _due(self) -> bool:
        """This step is on the ``check_every`` cadence (decided by the step counter: the same on every rank)."""
        return self.steps % self.check_every == 0

    def _group_signature(self) -> tuple:
        """How many parameters each param group of each optimizer holds: cheap, read every step."""
        return tuple(len(g["params"]) for opt in self.optimizers for g in opt.param_groups)

    def _pre_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        flush_compiled_notes()
        watch = self._ref_watch
        self._pre_versions = self._pre_fp = None
        if watch is None or not len(watch) or STATE.mode == "off":  # off: count the steps, check nothing
            return
        regrouped = self._group_signature() != self._groups
        if self._due() or regrouped:  # a param group added since the last look: watch this step closely
            self._pre_versions = watch.versions()
        if self._due():
            self._pre_fp = watch.fingerprint()

    def _post_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        due = self._due()
        self.steps += 1
        self.steps_in_update += 1
        violations: list[Violation] = []
        watch = self._ref_watch
        if watch is not None and self._pre_versions is not None:
            changed = [n for n, a, b in zip(watch.names, self._pre_versions, watch.versions()) if a != b]
            if self._pre_fp is not None:
                found: list[str] = []
                settle(watch.differ(self._pre_fp, watch.fingerprint(), found))  # the step's one host read
                changed += [n for n in found if n not in changed]
            if changed:
                problem = (f"optimizer.step() changed {len(changed)} of the reference's tensors "
                           f"(first: {changed[0]!r}); the reference must stay bit-identical")
                violations.append(Violation("RLG008", "Guard", "reference", format_message(
                    "RLG008", "Guard", "reference", problem, hint=REFERENCE_HINT)))
            if self._group_signature() != self._groups:
                self._groups = self._group_signature()
                if not violations:
                    violations += self._reference_violations()
        self._pre_versions = self._pre_fp = None
        report(violations, collective=due)
