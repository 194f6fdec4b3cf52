"""The :class:`Guard`: update boundaries and optimizer steps, and the state of every stateful check.

Create it once with the policy, the reference and the optimizer(s). It checks the reference at construction
(RLG008), hooks ``optimizer.step`` through ``register_step_pre_hook``/``register_step_post_hook`` (no
monkey-patching) to count steps and to check the steps themselves, and marks update boundaries with
``with guard.update():``. Decorated functions find the active guard themselves (:func:`active_guard`): the
newest guard, or the one whose ``update()`` block is running.

The steps it checks: the reference left bit-identical (RLG008); gradients zeroed between steps (RLG013: a tensor
hook on a few parameters per param group records, at the first backward after a step, whether that step's
gradient was zeroed or set to None since, from the gradient's identity and version counter, never its values);
the frozen set unchanged (RLG014: frozen parameters that hold a gradient in an optimizer's param group before a
step, version counters after every step, a float64 norm per tensor on the ``check_every`` cadence). And the
scoring forwards (RLG018): a forward pre-hook on the reference, and on the policy when autograd is off, finds
every dropout module inactive (flags only, no tensor read).

All state of the stateful checks (Frozen's row hashes, once-per-update flags, version counters) lives here as
Python numbers, cleared at each update boundary where it belongs to one update; fingerprints are a few float64
per watched tensor on its device. It holds no graph and no batch, and refers to the policy, reference,
optimizers and watched tensors weakly.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Iterator

import torch
from torch import nn

import logging

from rlguard.catalog import GRAD_NOT_ZEROED, REFERENCE_ALIAS, TRAIN_MODE_SCORING, TRAINED_PARAMS_DRIFT
from rlguard.contracts.errors import ContractViolation, Violation
from rlguard.contracts.markers import Probe, settle
from rlguard.contracts.settings import STATE, flush_compiled_notes, report
from rlguard.contracts.spec import format_message

_log = logging.getLogger("rlguard.contracts")
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
    """Update boundaries and optimizer steps: the stateful contracts (RLG002, RLG005's ``UpdateDirection``,
    RLG007, RLG008, RLG019's ``RowsInStep``) and the checks of the steps themselves (RLG013, RLG014) and of the
    scoring forwards (RLG018).

    ``Guard(policy=model, reference=ref, optimizer=opt)`` (``optimizer``: one optimizer or a list of them)
    checks now that ``ref`` is a distinct, frozen reference (RLG008) and that no frozen parameter is trainable
    in an optimizer (RLG014), and hooks every optimizer's ``step``. Wrap each update (all minibatches and epochs
    of one rollout) in ``with guard.update():``.

    ``frozen``: what must not change: ``None`` (default) the policy's parameters with ``requires_grad=False``
    now, when the guard is built; names or name prefixes of the policy's parameters and buffers (``"tok_emb"``,
    ``["backbone.", "obs_norm.mean"]``); a predicate ``(name, tensor) -> bool`` over them; ``()`` for nothing.

    Every step (metadata only, no host sync): the optimizers' param groups counted (a group added since the last
    look gets the reference re-checked at once); gradients zeroed since the previous step (RLG013, before the
    step); frozen parameters holding a gradient in the stepping optimizer's groups (RLG014, before the step);
    the frozen set's version counters (RLG014, after it). Every ``check_every``-th step (the first included;
    default 16): float64 norms of the reference's tensors before and after the step and of the frozen set
    against the previous read, all read with one host transfer, and a synchronised point across ranks. The
    reference's identity is checked at every ``update()``, its storage and optimizer membership at every
    ``check_every``-th. Costs: ``docs/benchmarks.md``.
    """

    def __init__(self, policy: nn.Module | None = None, reference: nn.Module | None = None,
                 optimizer: torch.optim.Optimizer | list | tuple | None = None, *, check_every: int = 16,
                 frozen: Any = None) -> None:
        if not isinstance(check_every, int) or isinstance(check_every, bool) or check_every < 1:
            raise ValueError(f"check_every must be a positive int, got {check_every!r}")
        optimizers = list(optimizer) if isinstance(optimizer, (list, tuple)) else (
            [optimizer] if optimizer is not None else [])
        for opt in optimizers:
            if not isinstance(opt, torch.optim.Optimizer):
                raise TypeError(f"Guard(optimizer=...): expected a torch.optim.Optimizer or a list of them, got "
                                f"{type(opt).__name__}")
        self._policy = weakref.ref(policy) if policy is not None else None
        self._reference = weakref.ref(reference) if reference is not None else None
        self._optimizers = [weakref.ref(o) for o in optimizers]
        self.check_every = check_every
        self.updates = 0  # update() blocks begun
        self.steps = 0  # optimizer steps seen (every optimizer's)
        self._step_checks_on = True  # off after an internal error of the step checks (logged once)
        self.steps_in_update = 0  # optimizer steps since the current update began
        self.in_update = False
        self._rows: dict[tuple, dict] = {}  # Frozen's row hashes, per (function, argument, row length)
        self._identity: dict[tuple, dict] = {}  # RowsInStep's key -> value hashes, per (field, row widths)
        self._direction: dict[tuple, tuple] = {}  # UpdateDirection's rows, per (function, argument), this update
        self._verdicts_off: set[tuple] = set()  # (function, argument) whose verdict failed inside rlguard (logged)
        self._done: set[tuple[str, str, str]] = set()
        self._ref_watch = Watch(named_tensors(reference)) if isinstance(reference, nn.Module) else None
        self._pre_versions: list[int] | None = None
        self._pre_fp: dict | None = None
        self._hooks: list[Any] = []
        self._groups = self._group_signature()
        self._frozen = _FrozenSet(policy, frozen, optimizers)
        # every rank builds its guard: a synchronised point (a raise here leaves no hook behind)
        report(self._reference_violations() + self._frozen.construction(optimizers), collective=True)
        self._grads = _GradWatch(self, optimizers)
        self._scoring = _ScoringWatch(self, policy, reference)
        self._hooks += self._scoring.hooks
        for opt in optimizers:
            self._hooks += [opt.register_step_pre_hook(self._pre_step),
                            opt.register_step_post_hook(self._post_step)]
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
        """The first optimizer (``optimizers`` for all of them)."""
        opts = self.optimizers
        return opts[0] if opts else None

    @property
    def optimizers(self) -> list:
        return [o for o in (r() for r in self._optimizers) if o is not None]

    @property
    def frozen_names(self) -> list[str]:
        """The names of the frozen set (RLG014) the guard watches."""
        return list(self._frozen.watch.names)

    # -- update boundaries ---------------------------------------------------------------------------------
    def begin_update(self) -> None:
        """Start an update: the next calls, until the first ``optimizer.step()``, are its first minibatch."""
        flush_compiled_notes()
        _set_current(self)
        self.updates += 1
        self.in_update = True
        self.steps_in_update = 0
        self._rows.clear()
        self._done.clear()
        self._direction.clear()
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
        self._rows.clear()
        self._identity.clear()  # the batch this update consumed: the next rollout's rows start afresh
        self._done.clear()
        found = []
        if STATE.mode != "off":
            for key, (marker, store) in self._direction.items():
                if key in self._verdicts_off:
                    continue
                try:
                    v = marker.verdict(store, self.steps_in_update)
                except ContractViolation:  # a finding reported from inside: the news
                    raise
                except Exception as exc:  # noqa: BLE001 - rlguard's own failure must not stop the run it watches
                    self._verdicts_off.add(key)
                    _log.error("rlguard: the Guard's update-direction verdict (RLG005, %s on %s(%s)) failed at the "
                               "end of an update (%s: %s) and is switched off; training goes on", type(marker).__name__,
                               key[0], key[1], type(exc).__name__, exc)
                    continue
                if v is not None:
                    found.append(v)
        self._direction.clear()
        if flush:  # not while an exception leaves the update: it is the news
            report(found, collective=True)

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
        """Remove the optimizer and gradient hooks and stop being the active guard."""
        for h in self._hooks + self._grads.hooks:
            h.remove()
        self._hooks, self._grads.hooks = [], []
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
        return self._rows.setdefault((function, argument, length), {})

    def direction_rows(self, function: str, argument: str, marker: Any) -> dict:
        """UpdateDirection's store for one (function, argument) in this update: ``rows`` (key -> sum and
        advantage before the first step) and ``pairs`` (key -> change since then and advantage)."""
        key = (function, argument)
        if key not in self._direction:
            self._direction[key] = (marker, {"rows": {}, "pairs": {}})
        return self._direction[key][1]

    def row_identity(self, field: str, widths: Any = None) -> dict:
        """RowsInStep's store of key row -> field row for one field, from the batch's making to the end of the
        update that uses it (cleared by ``end_update``); bounded like Frozen's."""
        store = self._identity.setdefault((field, widths), {})
        if len(store) > FROZEN_ROWS_CAP:
            store.clear()
        return store

    # -- RLG008 --------------------------------------------------------------------------------------------
    def _reference_violations(self, full: bool = True) -> list[Violation]:
        """RLG008 now: identity always; shared storage and optimizer membership when ``full``."""
        ref, pol = self.reference, self.policy
        if ref is None or pol is None or STATE.mode == "off":
            return []
        return [Violation(REFERENCE_ALIAS, "Guard", "reference",
                          format_message(REFERENCE_ALIAS, "Guard", "reference", p, hint=REFERENCE_HINT))
                for p in reference_problems(ref, pol, self.optimizers, full=full)[:1]]

    def _due(self) -> bool:
        """This step is on the ``check_every`` cadence (decided by the step counter: the same on every rank)."""
        return self.steps % self.check_every == 0

    def _group_signature(self) -> tuple:
        """How many parameters each param group of each optimizer holds: cheap, read every step."""
        return tuple(len(g["params"]) for opt in self.optimizers for g in opt.param_groups)

    # -- the step hooks ------------------------------------------------------------------------------------
    # An error inside the step checks themselves (not a violation they found) is rlguard's failure: it is logged
    # once and the step checks are switched off, never raised into the optimizer step of the run they watch.
    def _step_checks_failed(self, where: str, exc: BaseException) -> None:
        self._step_checks_on = False
        self._pre_versions = self._pre_fp = None
        _log.error("rlguard: the Guard's optimizer-step checks (RLG008 reference, RLG013 gradients, RLG014 frozen "
                   "parameters) failed %s (%s: %s) and are switched off; training goes on", where,
                   type(exc).__name__, exc)

    def _pre_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if not self._step_checks_on:
            return
        try:
            violations = self._before_step(optimizer)
        except ContractViolation:  # a finding reported from inside (flush_compiled_notes): the news
            raise
        except Exception as exc:  # noqa: BLE001 - rlguard's own failure must not stop the run it watches
            self._step_checks_failed("before a step", exc)
            return
        if violations:  # reported before the step, so that a raise leaves the parameters as they were
            report(violations)

    def _before_step(self, optimizer: Any) -> list[Violation]:
        flush_compiled_notes()
        self._pre_versions = self._pre_fp = None
        if STATE.mode == "off":  # off: count the steps, check nothing
            return []
        # checks of what this step is about to do, from metadata (under torch.distributed: held to the next
        # synchronised point)
        violations = self._grads.before_step(optimizer) + self._frozen.before_step(optimizer, self.steps)
        watch = self._ref_watch
        if watch is None or not len(watch):
            return violations
        regrouped = self._group_signature() != self._groups
        if self._due() or regrouped:  # a param group added since the last look: watch this step closely
            self._pre_versions = watch.versions()
        if self._due():
            self._pre_fp = watch.fingerprint()
        return violations

    def _post_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        due = self._due()
        step = self.steps
        self.steps += 1
        self.steps_in_update += 1
        if STATE.mode == "off":
            return
        violations: list[Violation] = []
        if self._step_checks_on:
            try:
                violations = self._after_step(optimizer, step, due)
            except ContractViolation:
                raise
            except Exception as exc:  # noqa: BLE001 - rlguard's own failure must not stop the run it watches
                self._step_checks_failed("after a step", exc)
        report(violations, collective=due)  # every rank takes part in the same collectives, checks on or off

    def _after_step(self, optimizer: Any, step: int, due: bool) -> list[Violation]:
        self._grads.after_step(optimizer, step)
        violations: list[Violation] = []
        probes: list[Probe] = []
        watch = self._ref_watch
        changed: list[str] = []
        if watch is not None and self._pre_versions is not None:
            changed = [n for n, a, b in zip(watch.names, self._pre_versions, watch.versions()) if a != b]
            if self._pre_fp is not None:
                probes += watch.differ(self._pre_fp, watch.fingerprint(), changed)
        frozen_probes, frozen_finish = self._frozen.after_step(step, due)
        probes += frozen_probes
        settle(probes)  # the step's one host read: the reference's and the frozen set's fingerprints
        if changed:
            changed = list(dict.fromkeys(changed))
            problem = (f"optimizer.step() changed {len(changed)} of the reference's tensors "
                       f"(first: {changed[0]!r}); the reference must stay bit-identical")
            violations.append(Violation(REFERENCE_ALIAS, "Guard", "reference", format_message(
                REFERENCE_ALIAS, "Guard", "reference", problem, hint=REFERENCE_HINT)))
        if watch is not None and self._pre_versions is not None and self._group_signature() != self._groups:
            self._groups = self._group_signature()
            if not violations:
                violations += self._reference_violations()
        violations += frozen_finish()
        self._pre_versions = self._pre_fp = None
        return violations


class _ScoringWatch:
    """RLG018 at the point of use: a forward pre-hook on the reference (every forward is a scoring one) and on
    the policy (forwards with autograd off: sampling, old log-probs) reports a scoring forward that runs with a
    dropout module active. The dropout-capable modules are listed once; each forward reads their flags. Once
    per update and model. An error inside the check itself is logged once and switches it off."""

    def __init__(self, guard: Guard, policy: Any, reference: Any) -> None:
        from rlguard.contracts.invariance import dropout_modules

        self.guard = weakref.ref(guard)
        self.hooks: list[Any] = []
        self.on = True
        for role, m in (("reference", reference), ("policy", policy)):
            if isinstance(m, nn.Module):
                modules = dropout_modules(m)
                if modules:  # a model with no dropout anywhere cannot score in train mode: no hook at all
                    self.hooks.append(m.register_forward_pre_hook(self._hook(role, modules)))

    def _hook(self, role: str, modules: list) -> Any:
        from rlguard.contracts import invariance

        def hook(module: nn.Module, args: Any) -> None:
            if not self.on or STATE.mode == "off" or (role == "policy" and torch.is_grad_enabled()):
                return None
            guard = self.guard()
            try:
                found = invariance.active_dropout(module, modules)
                if not found or guard is None or not guard.once(("Guard", role, "eval")):
                    return None
                which = "a forward of the reference" if role == "reference" else \
                    "a scoring forward of the policy (autograd off: sampling, old log-probs)"
                problem = f"{which} runs with dropout on: {invariance.describe_dropout(found)} in train mode"
                violation = Violation(TRAIN_MODE_SCORING, "Guard", role, format_message(
                    TRAIN_MODE_SCORING, "Guard", role, problem, got=type(module).__name__,
                    hint="put it in eval mode for sampling and for old-policy/reference/value forwards "
                         "(model.eval(), then model.train() for the training forward), or disable its dropout; "
                         "see RLG018"))
            except Exception as exc:  # noqa: BLE001 - rlguard's own failure must not stop the run it watches
                self.on = False
                _log.warning("rlguard: the Guard's scoring-mode check (RLG018) failed on the %s (%s: %s) and is "
                             "switched off", role, type(exc).__name__, exc)
                return None
            report([violation])
            return None

        return hook


def _optimizer_label(optimizers: list, optimizer: Any) -> str:
    for i, o in enumerate(optimizers):
        if o is optimizer:
            return f"optimizer {i} ({type(o).__name__})" if len(optimizers) > 1 else type(o).__name__
    return type(optimizer).__name__


GRADIENT_HINT = ("call optimizer.zero_grad() (or model.zero_grad(); set_to_none either way) once per optimizer "
                 "step, before the first backward of the next step; gradient accumulation over the microbatches "
                 "of one step is fine; see RLG013")
FROZEN_HINT = ("a frozen part must stay out of training: requires_grad_(False) and out of the optimizer "
               "(AdamW([p for p in model.parameters() if p.requires_grad])); or, if it is meant to train, leave it "
               "out of Guard(frozen=...); see RLG014")


class _GradWatch:
    """RLG013: was the previous step's gradient zeroed (or set to None) before this step's first backward?

    A tensor hook (``register_hook``, run before the gradient is accumulated into ``.grad``) on the first and the
    last trainable parameter of each param group. After a step, each watched parameter's ``.grad`` identity and
    version counter are recorded; the first time a backward reaches the parameter afterwards, its ``.grad`` is
    ``None`` (set_to_none), or another tensor, or the same tensor with a moved version counter (``zero_()``): or
    it is unchanged, the previous step's gradient, about to be accumulated into. No gradient value is written,
    and none is read unless the tensor looks unchanged (then ``any()`` tells a gradient zeroed through ``.data``,
    which bypasses the counter, from a stale one); later backwards of the same step (accumulation) are not looked
    at.
    """

    def __init__(self, guard: Guard, optimizers: list) -> None:
        self.hooks: list[Any] = []
        self.on = True  # off after an internal error of the check itself (logged once)
        self._after: dict[int, tuple] = {}  # watched id -> (step, grad id, version) recorded after a step
        self._stale: list[tuple[str, int, str]] = []  # (name, step, optimizer label)
        self._by_optimizer: dict[int, list[tuple[int, weakref.ReferenceType]]] = {}
        names = {}
        policy = guard.policy
        if policy is not None:
            names = {id(p): n for n, p in wrapper_chain(policy)[-1].named_parameters()}
        label_of = {id(o): _optimizer_label(optimizers, o) for o in optimizers}
        self._names: dict[int, str] = {}
        self._labels = label_of
        guard_ref = weakref.ref(self)
        for opt in optimizers:
            watched = []
            for gi, group in enumerate(opt.param_groups):
                trainable = [(pi, p) for pi, p in enumerate(group["params"]) if p.requires_grad]
                ends = trainable[:1] + (trainable[-1:] if len(trainable) > 1 else [])
                for pi, p in ends:
                    key = id(p)
                    self._names[key] = names.get(key, f"param group {gi}, parameter {pi}")
                    watched.append((key, weakref.ref(p)))
                    self.hooks.append(p.register_hook(_make_grad_hook(guard_ref, key, weakref.ref(p),
                                                                      label_of[id(opt)])))
            self._by_optimizer[id(opt)] = watched

    def after_step(self, optimizer: Any, step: int) -> None:
        for key, ref in self._by_optimizer.get(id(optimizer), ()):
            p = ref()
            if p is not None:
                g = p.grad
                self._after[key] = (step, id(g), g._version) if g is not None else (step, None, -1)

    def arrived(self, key: int, p: torch.Tensor, label: str) -> None:
        """A backward reached a watched parameter: the first time since a step, compare its .grad."""
        seen = self._after.pop(key, None)
        if seen is None:
            return
        step, grad_id, version = seen
        g = p.grad
        if g is not None and grad_id is not None and id(g) == grad_id and g._version == version:
            # the same gradient tensor, its version counter unmoved: stale, unless something zeroed it behind the
            # counter (``p.grad.data.zero_()``); only then are its values read (one host read), never written
            with torch.no_grad():
                if bool(g.detach().any()):
                    self._stale.append((self._names.get(key, "?"), step, label))

    def failed(self, exc: BaseException) -> None:
        """An error inside the gradient hook itself (rlguard's, raised during the trainer's ``backward``): logged
        once, the check switched off, the gradient left as it is."""
        if not self.on:
            return
        self.on = False
        self._after.clear()
        self._stale = []
        _log.error("rlguard: the Guard's gradient-zeroing check (RLG013, a tensor hook run during backward) failed "
                   "(%s: %s) and is switched off; training goes on", type(exc).__name__, exc)

    def before_step(self, optimizer: Any) -> list[Violation]:
        if not self._stale:
            return []
        label = self._labels.get(id(optimizer), type(optimizer).__name__)
        mine = [s for s in self._stale if s[2] == label] or self._stale
        self._stale = [s for s in self._stale if s not in mine]
        name, step, label = mine[0]
        more = f" (and {len(mine) - 1} more watched)" if len(mine) > 1 else ""
        problem = (f"parameter {name!r}{more} of {label} still held the gradient left by optimizer step {step} "
                   f"when this step's first backward reached it: nothing zeroed it (or set it to None) since, so "
                   f"that step's gradient is added to this one's")
        return [Violation(GRAD_NOT_ZEROED, "Guard", "gradients", format_message(
            GRAD_NOT_ZEROED, "Guard", "gradients", problem, hint=GRADIENT_HINT))]


def _make_grad_hook(owner: weakref.ReferenceType, key: int, param: weakref.ReferenceType, label: str):
    def hook(grad: torch.Tensor) -> None:  # returns None: the gradient is left as it is
        watch, p = owner(), param()
        if watch is None or p is None or not watch.on:
            return None
        try:  # inside the trainer's loss.backward(): an error of rlguard's here would stop the run it watches
            if key in watch._after and STATE.mode != "off":
                watch.arrived(key, p, label)
        except Exception as exc:  # noqa: BLE001 - rlguard's own failure must not stop the run it watches
            watch.failed(exc)
        return None

    return hook


class _FrozenSet:
    """RLG014: the parameters and buffers outside the trainable set stay bit-identical."""

    def __init__(self, policy: nn.Module | None, frozen: Any, optimizers: list) -> None:
        named = _frozen_tensors(policy, frozen)
        self.watch = Watch(named)
        self._params = {id(t): n for n, t in named if isinstance(t, nn.Parameter)}
        self._versions = self.watch.versions()
        self._fp = self.watch.fingerprint() if len(self.watch) else None
        self._labels = {id(o): _optimizer_label(optimizers, o) for o in optimizers}
        self._pending: list[str] = []
        self._in_step: list[str] = []

    def _in_groups(self, optimizer: Any) -> list[tuple[str, int, nn.Parameter]]:
        out = []
        for gi, group in enumerate(optimizer.param_groups):
            for p in group["params"]:
                name = self._params.get(id(p))
                if name is not None:
                    out.append((name, gi, p))
        return out

    def construction(self, optimizers: list) -> list[Violation]:
        """Frozen parameters that an optimizer would train: in a param group and requiring grad."""
        if not self._params or STATE.mode == "off":
            return []
        found = [(name, gi, self._labels[id(o)]) for o in optimizers for name, gi, p in self._in_groups(o)
                 if p.requires_grad]
        if not found:
            return []
        name, gi, label = found[0]
        problem = (f"{len(found)} frozen parameter(s) are in an optimizer's param groups and require grad (first: "
                   f"{name!r} in {label}, param group {gi}): every step will train them")
        return [Violation(TRAINED_PARAMS_DRIFT, "Guard", "frozen", format_message(
            TRAINED_PARAMS_DRIFT, "Guard", "frozen", problem, hint=FROZEN_HINT))]

    def before_step(self, optimizer: Any, step: int) -> list[Violation]:
        if not self._params:
            return []
        self._in_step = self.watch.versions() if len(self.watch) else []
        found = [(name, gi) for name, gi, p in self._in_groups(optimizer) if p.grad is not None]
        if not found:
            return []
        name, gi = found[0]
        label = self._labels.get(id(optimizer), type(optimizer).__name__)
        problem = (f"{len(found)} frozen parameter(s) hold a gradient in {label}'s param groups (first: {name!r}, "
                   f"param group {gi}): optimizer step {step} is about to change them")
        return [Violation(TRAINED_PARAMS_DRIFT, "Guard", "frozen", format_message(
            TRAINED_PARAMS_DRIFT, "Guard", "frozen", problem, hint=FROZEN_HINT))]

    def after_step(self, step: int, due: bool) -> tuple[list[Probe], Any]:
        """Version counters now; on the cadence, a fingerprint against the previous one (probes for the step's
        one host read); ``finish()`` then gives the violations."""
        if not len(self.watch):
            return [], lambda: []
        now = self.watch.versions()
        moved = [i for i, (a, b) in enumerate(zip(self._versions, now)) if a != b]
        in_step = {i for i in moved if self._in_step and self._in_step[i] != now[i]}
        self._versions, self._in_step = now, []
        found: list[str] = []
        probes: list[Probe] = []
        if due:
            fp = self.watch.fingerprint()
            if self._fp is not None:
                probes = self.watch.differ(self._fp, fp, found)
            self._fp = fp

        def finish() -> list[Violation]:
            names = [self.watch.names[i] for i in moved]
            by_value = [n for n in found if n not in names]
            if not names and not by_value:
                return []
            if names:
                first = names[0]
                where = ("during optimizer step " if moved[0] in in_step else "since the step before, outside "
                         "optimizer.step() (a forward pass updating a buffer, or your code), by step ") + str(step)
                how = f"written in place {where}: its version counter moved"
            else:
                first = by_value[0]
                how = (f"its values changed by step {step} (a float64 norm differs from the previous check; a "
                       "write the version counters did not see: .data, a fused optimizer, another view)")
            total = len(names) + len(by_value)
            problem = f"{total} frozen tensor(s) changed (first: {first!r}, {how})"
            return [Violation(TRAINED_PARAMS_DRIFT, "Guard", "frozen", format_message(
                TRAINED_PARAMS_DRIFT, "Guard", "frozen", problem, hint=FROZEN_HINT))]

        return probes, finish


def _frozen_tensors(policy: nn.Module | None, frozen: Any) -> list[tuple[str, torch.Tensor]]:
    """The frozen set: ``frozen`` resolved against the policy's parameters and buffers (see :class:`Guard`)."""
    if frozen is None and policy is None:
        return []
    if policy is None:
        raise ValueError("Guard(frozen=...) names the policy's parameters: give policy= too")
    module = wrapper_chain(policy)[-1]  # names as the model has them (not DDP's "module." ones)
    params = list(module.named_parameters())
    if frozen is None:
        return [(n, p) for n, p in params if not p.requires_grad]
    tensors = params + list(module.named_buffers())
    if frozen is False or (isinstance(frozen, (list, tuple, set)) and not frozen):
        return []
    if callable(frozen) and not isinstance(frozen, str):
        return [(n, t) for n, t in tensors if frozen(n, t)]
    names = [frozen] if isinstance(frozen, str) else list(frozen)
    if not all(isinstance(n, str) and n for n in names):
        raise TypeError(f"Guard(frozen=...): names or prefixes (strings), a predicate (name, tensor) -> bool, or "
                        f"None; got {frozen!r}")
    out = []
    for want in names:
        hits = [(n, t) for n, t in tensors if n == want or n.startswith(want if want.endswith(".") else want + ".")]
        if not hits:
            some = ", ".join(n for n, _ in tensors[:8])
            raise ValueError(f"Guard(frozen={frozen!r}): {want!r} names no parameter or buffer of the policy (names "
                             f"are like: {some}{', ...' if len(tensors) > 8 else ''})")
        out += [h for h in hits if h[0] not in {n for n, _ in out}]
    return out
