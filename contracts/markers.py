"""Markers: semantic checks added to an argument or return value with ``typing.Annotated``.

``Annotated[LogProbs, NoGrad(), Finite()]`` (a marker class without parentheses works too:
``Annotated[LogProbs, NoGrad]``), or ``@contract(markers={"old_logp": NoGrad()})`` for a function whose
annotations you do not want to change. Each marker is validated against the function when the decorator is
applied (:meth:`Marker.bind`) and checks one value per call (:meth:`Marker.check`), returning ``None`` or a
:class:`~rlguard.contracts.errors.Violation`.

Cheap markers (``NoGrad``, the identity part of ``DistinctReference``) run on every call; value markers read
tensor values and run on every ``check_every``-th call. Guard-timed checks (``SamplerConsistent`` at the first
minibatch of an update, the ratio check of ``Frozen`` after a step) also run once per update when due, even
between ``check_every`` calls. All value reads happen under ``torch.no_grad()`` on detached tensors and draw
no random numbers.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from rlguard.contracts.errors import ContractDefinitionError, Violation
from rlguard.contracts.spec import TensorSpec, describe, format_message

_log = logging.getLogger("rlguard.contracts")
_warned_no_guard: set[tuple[str, str]] = set()


def note_no_guard(function: str, timed: list[tuple[str, "Marker"]]) -> None:
    """Say once per function and marker that a check timed by update boundaries cannot run without a Guard."""
    for argument, marker in timed:
        key = (function, type(marker).__name__)
        if key not in _warned_no_guard:
            _warned_no_guard.add(key)
            _log.warning("rlguard: %s on %s(%s) needs a Guard (Guard(policy=..., reference=..., optimizer=...) "
                         "and `with guard.update():`); without one it does not run", key[1], function, argument)

POLICY_ROLE = 1  # default owner id of policy-written tokens (prompt 0, policy 1, environment 2)


@dataclass
class Site:
    """Where a marker sits, seen at decoration time."""

    function: str
    argument: str  # parameter name, "return" or "return[i]"
    params: tuple[str, ...]
    spec: TensorSpec | None
    dim_names: frozenset[str]  # dims bound by the function's tensor specs
    options: dict = field(default_factory=dict)  # decorator options (group_size)


class Call:
    """What a check sees of one call: the argument values it may refer to, the dim bindings, the guard."""

    __slots__ = ("function", "values", "bindings", "guard", "value_due")

    def __init__(self, function: str, values: dict, bindings: dict, guard: Any, value_due: bool) -> None:
        self.function = function
        self.values = values
        self.bindings = bindings
        self.guard = guard
        self.value_due = value_due


class Marker:
    """Base class. Subclasses set ``code`` and ``value_check`` and implement ``check``."""

    code = "RLG000"
    value_check = False  # reads tensor values: obeys check_every
    needs_guard = False
    _function = "?"
    _argument = "?"

    def bind(self, site: Site) -> Marker:
        """A copy of this marker bound to ``site``; raises ContractDefinitionError when it does not fit."""
        bound = copy.copy(self)
        bound._function = site.function
        bound._argument = site.argument
        bound._bind(site)
        return bound

    def _bind(self, site: Site) -> None:
        pass

    def needs(self) -> tuple[str, ...]:
        """Parameters (besides its own) whose values the check reads."""
        return ()

    def check(self, x: Any, call: Call) -> Violation | None:  # pragma: no cover - abstract
        raise NotImplementedError

    # helpers
    def _param(self, site: Site, name: str | None, what: str) -> None:
        if name is not None and name not in site.params:
            raise ContractDefinitionError(
                f"{site.function}(): {type(self).__name__}({what}={name!r}) on {site.argument!r}: "
                f"{site.function}() has no parameter {name!r} (parameters: {', '.join(site.params) or 'none'})")

    def _fail(self, problem: str, x: Any, call: Call, hint: str | None, code: str | None = None) -> Violation:
        code = code or self.code
        return Violation(code, self._function, self._argument,
                         format_message(code, self._function, self._argument, problem,
                                        expected=repr(self), bindings=call.bindings, got=describe(x),
                                        hint=hint))

    def __repr__(self) -> str:
        fields = {k: v for k, v in vars(self).items() if not k.startswith("_")}
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in fields.items())})"


class NoGrad(Marker):
    """RLG003: ``requires_grad`` False and no ``grad_fn`` (old/reference log-probs, advantages, returns)."""

    code = "RLG003"

    def check(self, x: Any, call: Call) -> Violation | None:
        if isinstance(x, torch.Tensor) and (x.requires_grad or x.grad_fn is not None):
            name = "the return value" if self._argument.startswith("return") else self._argument
            return self._fail(
                "carries autograd history, but it is a target: no gradient may flow through it", x, call,
                f"computed with autograd on? Compute it under torch.no_grad() / torch.inference_mode(), or "
                f"use {name}.detach(); see RLG003")
        return None


class Finite(Marker):
    """No NaN/Inf (losses, advantages, log-probs). Reported as RLG000 (the catalog has no own code for it)."""

    code = "RLG000"
    value_check = True

    def check(self, x: Any, call: Call) -> Violation | None:
        if not isinstance(x, torch.Tensor) or not (x.is_floating_point() or x.is_complex()):
            return None
        with torch.no_grad():
            xd = x.detach()
            bad = ~torch.isfinite(xd)
            if not bool(bad.any()):
                return None
            nan = int(torch.isnan(xd).sum())
            first = tuple(torch.nonzero(bad)[0].tolist()) if xd.dim() else ()
            n_bad = int(bad.sum())
        return self._fail(f"{n_bad} non-finite values ({nan} NaN, {n_bad - nan} Inf), first at index {first}",
                          x, call, "a log of 0 (log-prob of a masked/zero-probability token), a division by a "
                          "zero std or token count, or an overflow in bf16/fp16 upstream")


class GroupCentred(Marker):
    """RLG009: viewed as [P, G], every group's mean is 0 within ``tol``.

    ``group_size``: an int; a parameter name (``"group_size"``) or a dotted path from one (``"cfg.group_size"``);
    or a dim name bound by the function's specs (``"G"`` of ``GroupRewards``). Default: the decorator's
    ``group_size`` option, else a parameter named ``group_size``, else the dim ``G``.

    Under data parallelism the check runs on each rank's own values: each rank must hold whole groups (the G
    samples of a prompt contiguous, on one rank). A group that straddles ranks shows up as a count that is not a
    multiple of G, or as groups whose means are not 0; the message then names the rank and the straddling.
    """

    code = "RLG009"
    value_check = True

    def __init__(self, group_size: int | str | None = None, tol: float = 1e-5) -> None:
        self.group_size = group_size
        self.tol = tol
        self._source: tuple[str, Any] = ("int", None)

    def _bind(self, site: Site) -> None:
        gs = self.group_size if self.group_size is not None else site.options.get("group_size")
        if gs is None:
            if "group_size" in site.params:
                gs = "group_size"
            elif "G" in site.dim_names:
                gs = "G"
            else:
                raise ContractDefinitionError(
                    f"{site.function}(): GroupCentred on {site.argument!r}: can't find the group size; pass "
                    "GroupCentred(group_size=...) or @contract(group_size=...) with an int, a parameter name "
                    "('group_size', 'cfg.group_size') or a dim name bound by an annotation ('G' of [P, G])")
        if isinstance(gs, bool) or not isinstance(gs, (int, str)) or (isinstance(gs, int) and gs < 1):
            raise ContractDefinitionError(
                f"{site.function}(): GroupCentred on {site.argument!r}: group_size must be a positive int or "
                f"a name, got {gs!r}")
        if isinstance(gs, int):
            self._source = ("int", gs)
            return
        head, *rest = gs.split(".")
        if head in site.params:
            self._source = ("param", (head, tuple(rest)))
        elif not rest and gs in site.dim_names:
            self._source = ("dim", gs)
        else:
            raise ContractDefinitionError(
                f"{site.function}(): GroupCentred(group_size={gs!r}) on {site.argument!r}: {head!r} is neither "
                f"a parameter of {site.function}() nor a dim bound by its annotations "
                f"(dims: {', '.join(sorted(site.dim_names)) or 'none'})")

    def needs(self) -> tuple[str, ...]:
        return (self._source[1][0],) if self._source[0] == "param" else ()

    def _group_size(self, call: Call) -> Any:
        kind, src = self._source
        if kind == "int":
            return src
        if kind == "dim":
            return call.bindings.get(src)
        value = call.values.get(src[0])
        for attr in src[1]:
            value = value[attr] if isinstance(value, dict) else getattr(value, attr, None)
        return value

    def check(self, x: Any, call: Call) -> Violation | None:
        if not isinstance(x, torch.Tensor):
            return None
        g = self._group_size(call)
        if isinstance(g, torch.Tensor) and g.numel() == 1:
            g = int(g)
        if isinstance(g, bool) or not isinstance(g, int) or g < 1:
            return self._fail(f"the group size ({self.group_size or self._source[1]}) is {g!r}, not a positive "
                              "int", x, call, None)
        n = x.numel()
        dp = _dp_where()
        if n % g:
            if dp:
                return self._fail(f"{dp}: {n} values are not a whole number of groups of G={g}", x, call,
                                  "a group straddles ranks: each rank must hold whole groups (its G samples of a "
                                  "prompt contiguous, on one rank; shard by prompt, not by sample), or the group "
                                  "size is wrong; see RLG009")
            return self._fail(f"{n} values are not a whole number of groups of G={g}", x, call,
                              "wrong group size, or groups not laid out contiguously [P, G]; see RLG009")
        with torch.no_grad():
            xd = x.detach().double().reshape(-1, g)
            means = xd.mean(dim=1)
            worst = float(means.abs().max())
            if worst <= self.tol:
                return None
            p = xd.shape[0]
            i = int(means.abs().argmax())
            flat = xd.reshape(-1)
            other = [d for d in range(2, min(n, 257)) if n % d == 0 and d != g
                     and float(flat.reshape(-1, d).mean(dim=1).abs().max()) <= self.tol]
            if p > 1 and float(xd.mean(dim=0).abs().max()) <= self.tol:  # noqa: RLG009 - diagnosing a wrong-axis mean on purpose
                hint = (f"centred along the wrong axis: the mean taken over dim 0 of [P, G] = [{p}, {g}] "
                        "(across prompts) instead of dim 1 (within each group)?")
            elif other:
                hint = f"centred with group size {other[0]}, not G={g}?"
            elif abs(float(flat.mean())) <= self.tol:
                hint = "centred over the whole batch, not per group (a batch mean instead of the group mean)?"
            else:
                hint = "no baseline subtracted per group (advantages = rewards?)"
            if dp:
                hint += (f" Or, under data parallelism ({dp}), groups straddle ranks: each rank must hold whole "
                         "groups, centred on the full group's mean.")
        return self._fail(f"group {i} of {p} (G={g}) has mean {means[i].item():.4g}; every group's mean must be 0 "
                          f"(|mean| <= {self.tol:g})", x, call, hint + " see RLG009")


GroupCentered = GroupCentred  # US spelling


def _dp_where() -> str:
    """"rank r of W" when torch.distributed runs with more than one rank, else "" (no collective)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return f"rank {dist.get_rank()} of {dist.get_world_size()}"
    return ""


class MatchesOwner(Marker):
    """RLG001: the action mask [B, T-1] equals ``owner[:, 1:] == policy_role`` ("policy wrote ids[:, 1:]")."""

    code = "RLG001"
    value_check = True

    def __init__(self, owner: str = "owner", policy_role: int = POLICY_ROLE) -> None:
        self.owner = owner
        self.policy_role = policy_role

    def _bind(self, site: Site) -> None:
        self._param(site, self.owner, "owner")

    def needs(self) -> tuple[str, ...]:
        return (self.owner,)

    def check(self, x: Any, call: Call) -> Violation | None:
        o = call.values.get(self.owner)
        if not isinstance(x, torch.Tensor) or not isinstance(o, torch.Tensor) or o.dim() != 2:
            return None
        b, t = o.shape
        if tuple(x.shape) != (b, t - 1):
            hint = ("mask aligned to ids, not ids[:, 1:]? Build it from owner[:, 1:]; see RLG001"
                    if tuple(x.shape) == (b, t) else "see RLG001")
            return self._fail(f"shape {tuple(x.shape)}, but owner {tuple(o.shape)} needs ({b}, {t - 1})",
                              x, call, hint)
        with torch.no_grad():
            want = o[:, 1:] == self.policy_role
            got = x.detach() != 0
            diff = want ^ got
            if not bool(diff.any()):
                return None
            count = int(diff.sum())
            r, c = torch.nonzero(diff)[0].tolist()
            if torch.equal(got, o[:, :-1] == self.policy_role):
                hint = ("mask aligned to ids, not ids[:, 1:]: it equals owner[:, :-1] == POLICY, one token off; "
                        "use owner[:, 1:] == POLICY; see RLG001")
            elif t > 2 and torch.equal(got[:, :-1], o[:, 2:] == self.policy_role):
                hint = "mask shifted one token left (owner[:, 2:]); use owner[:, 1:] == POLICY; see RLG001"
            else:
                hint = "the mask must be exactly owner[:, 1:] == POLICY (policy-written tokens of ids[:, 1:]); see RLG001"
        return self._fail(f"{count} positions differ from owner[:, 1:] == {self.policy_role} "
                          f"(first: row {r}, column {c}: mask {bool(got[r, c])}, policy-owned {bool(want[r, c])})",
                          x, call, hint)


def _valid(call: Call, mask: str | None, like: torch.Tensor) -> torch.Tensor | None:
    m = call.values.get(mask) if mask else None
    if isinstance(m, torch.Tensor) and m.shape == like.shape:
        return m.detach() != 0
    return None


class SamplerConsistent(Marker):
    """RLG007: at the first minibatch of an update (no step yet), these log-probs equal the sampler's.

    ``sampler``: the parameter holding the sampler's stored log-probs (``old_logp``); ``tol``: max absolute
    gap on valid tokens (fp32 default 1e-4; a bf16 sampler needs ~1e-2); ``mask``: the parameter of the action
    mask (only masked-in tokens count). Needs an active :class:`Guard` inside ``guard.update()``.
    """

    code = "RLG007"
    value_check = True
    needs_guard = True

    def __init__(self, sampler: str = "old_logp", tol: float = 1e-4, mask: str | None = None) -> None:
        self.sampler = sampler
        self.tol = tol
        self.mask = mask

    def _bind(self, site: Site) -> None:
        self._param(site, self.sampler, "sampler")
        self._param(site, self.mask, "mask")

    def needs(self) -> tuple[str, ...]:
        return tuple(n for n in (self.sampler, self.mask) if n)

    def check(self, x: Any, call: Call) -> Violation | None:
        g = call.guard
        s = call.values.get(self.sampler)
        if (g is None or not g.in_update or g.steps_in_update != 0 or not isinstance(x, torch.Tensor)
                or not isinstance(s, torch.Tensor) or s.shape != x.shape):
            return None
        if not g.once((call.function, self._argument, "sampler")) and not call.value_due:
            return None
        with torch.no_grad():
            gap = (x.detach().double() - s.detach().double()).abs()
            valid = _valid(call, self.mask, x)
            if valid is not None:
                gap = torch.where(valid, gap, torch.zeros((), dtype=gap.dtype, device=gap.device))
                n_valid = int(valid.sum())
            else:
                n_valid = gap.numel()
            if n_valid == 0:
                return None
            worst = float(gap.max())
            if worst <= self.tol:
                return None
            at = tuple(torch.nonzero(gap == gap.max())[0].tolist())
            mean = float(gap.sum()) / n_valid
        return self._fail(
            f"max |{self._argument} - {self.sampler}| = {worst:.4g} at {at} (mean {mean:.3g} over {n_valid} "
            f"valid tokens) before the first optimizer step of the update; the PPO ratio must start at 1 "
            f"(tol {self.tol:g})", x, call,
            "the sampler's distribution differs from the trainer's: another temperature (logits not divided "
            "by it), precision (bf16 sampler: raise tol) or top-p/top-k; or a label shift (RLG012); see RLG007")


class Frozen(Marker):
    """RLG002: old log-probs are frozen within an update.

    ``key``: a parameter whose rows identify the samples (``"ids"``): each row's fingerprint must stay the same
    every time the same row is seen again in the update (minibatches, epochs). ``current``: the parameter of
    the log-probs computed now (``"logp"``): after the update's first optimizer step they must differ from
    these old log-probs somewhere (a ratio exactly 1 everywhere means old_logp was recomputed). ``mask``:
    the action mask's parameter, to compare valid tokens only. Needs an active :class:`Guard` in an update.
    """

    code = "RLG002"
    value_check = True
    needs_guard = True

    def __init__(self, current: str | None = None, key: str | None = None, mask: str | None = None,
                 rtol: float = 1e-9) -> None:
        self.current = current
        self.key = key
        self.mask = mask
        self.rtol = rtol

    def _bind(self, site: Site) -> None:
        if self.current is None and self.key is None:
            raise ContractDefinitionError(
                f"{site.function}(): Frozen on {site.argument!r} needs current= (the parameter of the fresh "
                "log-probs, e.g. 'logp') and/or key= (a parameter identifying the rows, e.g. 'ids')")
        self._param(site, self.current, "current")
        self._param(site, self.key, "key")
        self._param(site, self.mask, "mask")

    def needs(self) -> tuple[str, ...]:
        return tuple(n for n in (self.current, self.key, self.mask) if n)

    def check(self, x: Any, call: Call) -> Violation | None:
        g = call.guard
        if g is None or not g.in_update or not isinstance(x, torch.Tensor):
            return None
        if self.key is not None and call.value_due:
            v = self._check_rows(x, call, g)
            if v is not None:
                return v
        c = call.values.get(self.current) if self.current else None
        if (isinstance(c, torch.Tensor) and c.shape == x.shape and g.steps_in_update > 0
                and (g.once((call.function, self._argument, "ratio")) or call.value_due)):
            with torch.no_grad():
                differs = x.detach() != c.detach()
                valid = _valid(call, self.mask, x)
                if valid is not None:
                    differs &= valid
                    n_valid = int(valid.sum())
                else:
                    n_valid = x.numel()
                if n_valid and not bool(differs.any()):
                    return self._fail(
                        f"equals {self.current} exactly on all {n_valid} valid tokens after "
                        f"{g.steps_in_update} optimizer step(s) in this update: the PPO ratio is 1 everywhere "
                        "and clipping never acts", x, call,
                        f"{self._argument} recomputed from the current weights inside the minibatch/epoch loop? "
                        "Compute it once per rollout, before the loop, and reuse it; see RLG002")
        return None

    def _check_rows(self, x: torch.Tensor, call: Call, g: Any) -> Violation | None:
        ids = call.values.get(self.key)
        if not isinstance(ids, torch.Tensor) or ids.dim() < 1 or x.dim() < 1 or ids.shape[0] != x.shape[0]:
            return None
        with torch.no_grad():
            keys = _row_keys(ids.detach()).tolist()
            fps = _row_values(x.detach()).tolist()
        store = g.frozen_rows(call.function, self._argument)
        changed = []
        for k, f in zip(keys, fps):
            prev = store.get(k)
            if prev is None:
                if len(store) < _frozen_cap():
                    store[k] = f
            elif abs(prev - f) > self.rtol * max(abs(prev), 1.0):
                changed.append((k, prev, f))
        if not changed:
            return None
        return self._fail(
            f"{len(changed)} of {len(keys)} rows seen earlier in this update (same {self.key}) now have "
            f"different values (first row's fingerprint {changed[0][1]:.4g} -> {changed[0][2]:.4g})", x, call,
            f"{self._argument} recomputed inside the update loop (from weights a step has changed)? Compute it "
            "once per rollout and reuse it in every minibatch and epoch; see RLG002")


def _frozen_cap() -> int:
    from rlguard.contracts.guard import FROZEN_ROWS_CAP

    return FROZEN_ROWS_CAP


_WEIGHTS: dict[tuple[int, str, bool], torch.Tensor] = {}


def _weights(n: int, device: torch.device, integer: bool) -> torch.Tensor:
    """Fixed, deterministic per-position weights (no RNG); a small bounded cache."""
    key = (n, str(device), integer)
    w = _WEIGHTS.get(key)
    if w is None:
        if len(_WEIGHTS) > 32:
            _WEIGHTS.clear()
        pos = torch.arange(n, dtype=torch.int64)
        if integer:
            w = (pos * 2654435761 + 97) % 1000003 + 1
        else:
            w = 1.0 + (pos % 13).double() / 13.0
        w = w.to(device)
        _WEIGHTS[key] = w
    return w


def _row_keys(ids: torch.Tensor) -> torch.Tensor:
    flat = ids.reshape(ids.shape[0], -1).long()
    return (flat * _weights(flat.shape[1], flat.device, True)).sum(dim=1)


def _row_values(x: torch.Tensor) -> torch.Tensor:
    flat = x.reshape(x.shape[0], -1).double()
    return (flat * _weights(flat.shape[1], flat.device, False)).sum(dim=1)


class DistinctReference(Marker):
    """RLG008 on a reference-model argument: not the policy, no shared storage (through DDP,
    ``torch.compile``, PEFT-style wrappers), not in the optimizer.

    ``policy``/``optimizer``: parameter names; default: the active guard's policy and optimizer. The identity
    check runs on every call; the storage and optimizer checks with the value checks (``check_every``).
    """

    code = "RLG008"

    def __init__(self, policy: str | None = None, optimizer: str | None = None) -> None:
        self.policy = policy
        self.optimizer = optimizer

    def _bind(self, site: Site) -> None:
        self._param(site, self.policy, "policy")
        self._param(site, self.optimizer, "optimizer")

    def needs(self) -> tuple[str, ...]:
        return tuple(n for n in (self.policy, self.optimizer) if n)

    def check(self, x: Any, call: Call) -> Violation | None:
        from rlguard.contracts.guard import REFERENCE_HINT, reference_problems

        g = call.guard
        pol = call.values.get(self.policy) if self.policy else (g.policy if g is not None else None)
        opt = call.values.get(self.optimizer) if self.optimizer else (g.optimizer if g is not None else None)
        if pol is None or x is None:
            return None
        problems = reference_problems(x, pol, opt, full=call.value_due)
        if not problems:
            return None
        return Violation(self.code, self._function, self._argument,
                         format_message(self.code, self._function, self._argument, problems[0],
                                        got=type(x).__name__, hint=REFERENCE_HINT))


def as_marker(obj: Any) -> Marker | None:
    """A marker instance from ``obj`` (an instance, or a marker class with no required arguments)."""
    if isinstance(obj, Marker):
        return obj
    if isinstance(obj, type) and issubclass(obj, Marker) and obj is not Marker:
        return obj()
    return None
