"""Markers: semantic checks added to an argument or return value with ``typing.Annotated``.

``Annotated[LogProbs, NoGrad(), Finite()]`` (a marker class without parentheses works too:
``Annotated[LogProbs, NoGrad]``), or ``@contract(markers={"old_logp": NoGrad()})`` for a function whose
annotations you do not want to change. Each marker is validated against the function when the decorator is
applied (:meth:`Marker.bind`) and checks one value per call (:meth:`Marker.check`), returning ``None`` or a
:class:`~rlguard.contracts.errors.Violation`.

Cheap markers (``NoGrad``, the identity part of ``DistinctReference``) read only metadata and run on every call.
Value markers read tensor values and run on every ``check_every``-th call; guard-timed checks
(``SamplerConsistent`` at the first minibatch of an update, the ratio check of ``Frozen`` after a step) also run
once per update when due. A value marker does not read its verdict itself: :meth:`Marker.probe` returns a
:class:`Probe` (a few int64 on the tensors' device), and the decorator reads the probes of all markers of a call
with one host transfer (:func:`settle`), so a checked call synchronises with the device once, not once per
marker. Only a failing check reads more, to explain itself. All value reads happen under ``torch.no_grad()`` on
detached tensors and draw no random numbers; meta tensors and empty tensors pass the value checks (nothing to
read), and tensors a marker compares that sit on different devices are a violation naming both.
"""

from __future__ import annotations

import copy
import logging
import math
import re
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from rlguard.catalog import (
    ADVANTAGE_SIGN, DETACHED_TARGETS, ENTROPY_BONUS_SIGN, GROUP_BASELINE, KL_SIGN, MASK_NOT_SHIFTED, OLD_LOGP_RECOMPUTED, REFERENCE_ALIAS, ROWS_OUT_OF_STEP,
    SAMPLER_TRAINER_MISMATCH, STOP_TOKEN_UNTRAINED, TENSOR_CONTRACT, TRAIN_MODE_SCORING,
)
from rlguard.contracts.batch import MISSING, get_field
from rlguard.contracts.errors import ContractDefinitionError, Violation
from rlguard.contracts.spec import TensorSpec, describe, format_message

_log = logging.getLogger("rlguard.contracts")
_warned_no_guard: set[tuple[str, str]] = set()


def _note_once(function: str, argument: str, text: str) -> None:
    key = (function, argument)
    if key not in _warned_no_guard:
        _warned_no_guard.add(key)
        _log.warning("rlguard: %s", text)


def note_no_guard(function: str, timed: list[tuple[str, "Marker"]]) -> None:
    """Say once per function and marker that a check timed by update boundaries cannot run without a Guard."""
    for argument, marker in timed:
        key = (function, type(marker).__name__)
        if key not in _warned_no_guard:
            _warned_no_guard.add(key)
            _log.warning("rlguard: %s on %s(%s) needs a Guard (Guard(policy=..., reference=..., optimizer=...) "
                         "and `with guard.update():`); without one it does not run", key[1], function, argument)

POLICY_ROLE = 1  # default owner id of policy-written tokens (prompt 0, policy 1, environment 2)


class Ref:
    """A value a marker reads: a checked slot (a parameter, or a batch key such as ``inputs['owner']``) and the
    keys/attributes below it (``self.cfg.n`` is the slot ``self`` and the chain ``("cfg", "n")``)."""

    __slots__ = ("slot", "root", "chain", "text")

    def __init__(self, slot: str, root: str, chain: tuple[str, ...], text: str) -> None:
        self.slot = slot  # key of Call.values
        self.root = root  # the function parameter the slot comes from
        self.chain = chain
        self.text = text  # as the user wrote it

    def get(self, values: dict) -> Any:
        value = values.get(self.slot)
        for key in self.chain:
            if value is None:
                return None
            value = get_field(value, key)
            if value is MISSING:
                return None
        return value

    def __repr__(self) -> str:
        return f"Ref({self.text!r})"


@dataclass
class Site:
    """Where a marker sits, seen at decoration time."""

    function: str
    argument: str  # parameter name, batch key ("inputs['ids']"), "return" or "return[i]"
    params: tuple[str, ...]
    spec: TensorSpec | None
    dim_names: frozenset[str]  # dims bound by the function's tensor specs
    options: dict = field(default_factory=dict)  # decorator options (group_size)
    annotation: Any = None  # the argument's annotation without markers (None: not annotated)
    tensor: bool | None = None  # True: a tensor annotation; False: another type; None: unknown (no annotation)
    resolver: Any = None  # name -> Ref (parameters, sibling batch keys, dotted paths)

    def resolve(self, name: str) -> Ref | None:
        if self.resolver is not None:
            return self.resolver(name, self.argument)
        head, *rest = name.split(".")
        return Ref(head, head, tuple(rest), name) if head in self.params else None


class Call:
    """What a check sees of one call: the argument values it may refer to, the dim bindings, the guard."""

    __slots__ = ("function", "values", "bindings", "guard", "value_due")

    def __init__(self, function: str, values: dict, bindings: dict, guard: Any, value_due: bool) -> None:
        self.function = function
        self.values = values  # parameter name / batch key slot -> value
        self.bindings = bindings
        self.guard = guard
        self.value_due = value_due

    def get(self, ref: Ref | None) -> Any:
        return None if ref is None else ref.get(self.values)


class Probe:
    """A value check in flight: a tensor of a few numbers on the checked tensors' device (0-dim: any dtype;
    1-dim: float64), read with every other probe of the call in one host transfer, then
    ``finish(host_values) -> Violation | None`` (``host_values``: a list of Python numbers)."""

    __slots__ = ("payload", "finish")

    def __init__(self, payload: torch.Tensor, finish: Callable[[list], Violation | None]) -> None:
        self.payload = payload
        self.finish = finish


def settle(probes: list[Probe]) -> list[Violation]:
    """Read every probe's payload with one host transfer per device (one in the usual single-device call).

    0-dim payloads (most verdicts: bool flags, sums) are stacked; 1-dim ones, float64 by convention (exact for
    the row hashes, integers below 2^53), are concatenated after them, which promotes the lot to float64.
    """
    if not probes:
        return []
    with torch.no_grad():
        if len(probes) == 1:  # one check in the call: its payload alone
            p = probes[0]
            v = p.finish(p.payload.reshape(-1).tolist() if p.payload.dim() else [p.payload.item()])
            return [v] if v is not None else []
        host: list = [None] * len(probes)
        by_device: dict[Any, list[int]] = {}
        for i, p in enumerate(probes):
            by_device.setdefault(p.payload.device, []).append(i)
        for dev, idx in by_device.items():
            payloads = [probes[i].payload for i in idx]
            if dev.type == "mps":  # no float64 there: bring the few numbers over first
                payloads = [t.cpu() for t in payloads]
            scalars = [k for k, t in enumerate(payloads) if t.dim() == 0]
            if len(scalars) == len(payloads):
                flat = torch.stack(payloads).tolist()
                for i, v in zip(idx, flat):
                    host[i] = [v]
                continue
            rows = [k for k, t in enumerate(payloads) if t.dim() != 0]
            parts = ([torch.stack([payloads[k] for k in scalars])] if scalars else []) + [payloads[k] for k in rows]
            flat = (torch.cat(parts) if len(parts) > 1 else parts[0]).tolist()  # float64 1-d payloads promote all
            for j, k in enumerate(scalars):
                host[idx[k]] = [flat[j]]
            at = len(scalars)
            for k in rows:
                n = payloads[k].numel()
                host[idx[k]] = flat[at:at + n]
                at += n
        out = []
        for p, h in zip(probes, host):
            v = p.finish(h)
            if v is not None:
                out.append(v)
    return out


def eps_of(*dtypes: torch.dtype) -> float:
    """Machine epsilon of the least precise floating dtype among ``dtypes`` (0 when none is floating)."""
    out = 0.0
    for d in dtypes:
        if d.is_floating_point:
            out = max(out, torch.finfo(d).eps)
    return out


def _tolerance(value: Any, name: str, marker: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ContractDefinitionError(f"{marker}({name}={value!r}): a tolerance is a finite number >= 0 "
                                      "(None: the default, scaled to the dtype)")
    return float(value)


def _no_values(*tensors: Any) -> bool:
    """True when a value check cannot or need not read values: a meta tensor (no data) or nothing to read."""
    for t in tensors:
        if isinstance(t, torch.Tensor) and (t.is_meta or t.numel() == 0):
            return True
    return False


def _words(x: torch.Tensor) -> torch.Tensor:
    """[b, ...] -> [b, n] 16-bit words of each row's bits (floats reinterpreted, not converted: -0.0 and 0.0
    differ; a 32-bit value is 2 words, a 64-bit one 4; bool and 8-bit values widened to one word each)."""
    if x.is_complex():
        x = torch.view_as_real(x)
    if x.dim() != 2 or not x.is_contiguous():
        x = x.reshape(x.shape[0], -1).contiguous()
    if x.element_size() == 1:
        return x.to(torch.int16)
    return x.view(torch.int16)


# Row hashes (Frozen). A row's 16-bit words r_j (|r_j| <= 2^15) are hashed by S_c = sum_j w_cj * r_j with weights
# w_cj < 2^16 drawn once from a fixed seed (a private generator: the global RNG is never touched). Every product
# and partial sum is an integer below 2^53 for rows of up to 2^21 words, so one float64 matrix product computes
# S_c exactly, in any summation order: the same on every device and in every batch. For two different rows some
# word differs by d != 0, and for fixed other weights at most one of the 2^16 values of its weight makes S_c
# equal: each column collides with probability <= 2^-16, independently. Keys (which row this is) use 5 columns
# (2^-80 per pair of rows: about n^2 * 2^-81 expected false matches, 2e-15 for the 65536 rows an update may
# fingerprint); values (did the row change) 3 columns (a change missed with probability <= 2^-48).
KEY_COLUMNS, VALUE_COLUMNS = 5, 3
_HASH_WEIGHTS: dict[tuple, torch.Tensor] = {}
_MAX_WORDS = 1 << 21


def _word_count(x: torch.Tensor) -> int:
    """Words per row of ``_words(x)``, from the shape alone."""
    per = 1
    for n in x.shape[1:]:
        per *= n
    if x.is_complex():
        per *= 2
    return per * max(1, (x.element_size() // (2 if x.is_complex() else 1)) // 2)


def row_hashes(parts: list[tuple[torch.Tensor, int, torch.Tensor | None]]) -> torch.Tensor:
    """Hash the rows of several tensors with the same first dim in one pass.

    ``parts``: ``(rows [b, ...], columns, valid or None)``; positions where ``valid`` is False count as 0.
    Returns [b, sum of columns] float64 integers: the first tensor's columns first. One weight matrix spans all
    words side by side, zero outside each tensor's own block, so one matrix product hashes everything.
    """
    blocks = []
    for rows, _, valid in parts:
        if valid is not None:
            rows = torch.where(valid, rows, torch.zeros((), dtype=rows.dtype, device=rows.device))
        blocks.append(_words(rows))
    words = blocks[0] if len(blocks) == 1 else torch.cat(blocks, dim=1)
    if words.device.type == "mps":  # no float64 there: hash on the CPU (one transfer)
        words = words.cpu()
    w = _block_weights(tuple((b.shape[1], c) for b, (_, c, _) in zip(blocks, parts)), words.device)
    return words.to(torch.float64) @ w


def _block_weights(layout: tuple[tuple[int, int], ...], device: torch.device) -> torch.Tensor:
    """[sum of words, sum of columns]: each tensor's own weights in its block of rows, zeros elsewhere."""
    key = (layout, str(device))
    w = _HASH_WEIGHTS.get(key)
    if w is None:
        if len(_HASH_WEIGHTS) > 64:
            _HASH_WEIGHTS.clear()
        w = torch.zeros(sum(n for n, _ in layout), sum(c for _, c in layout), dtype=torch.float64)
        r = k = 0
        for n, c in layout:
            gen = torch.Generator().manual_seed(0x5EED_0F_B175 + n)  # the same weights for the same row width
            w[r:r + n, k:k + c] = torch.randint(1, 1 << 16, (n, c), generator=gen).to(torch.float64)
            r, k = r + n, k + c
        w = w.to(device)
        _HASH_WEIGHTS[key] = w
    return w


class Marker:
    """Base class. Subclasses set ``code`` and ``value_check`` and implement ``check`` (or ``probe``).

    ``check(x, call) -> Violation | None`` is the simple form: it may read values on the host as it likes.
    Built-in value markers implement ``probe(x, call)`` instead, returning ``None`` (nothing to check), a
    ``Violation`` (decided from metadata alone) or a :class:`Probe` read with the call's other probes in one
    host transfer. ``applies_to``: ``"tensor"`` (the argument must be annotated as a tensor, or not annotated),
    ``"object"`` (not a tensor), ``"any"``.
    """

    code = TENSOR_CONTRACT
    value_check = False  # reads tensor values: obeys check_every
    needs_guard = False
    applies_to = "tensor"
    _function = "?"
    _argument = "?"

    def bind(self, site: Site) -> Marker:
        """A copy of this marker bound to ``site``; raises ContractDefinitionError when it does not fit."""
        bound = copy.copy(self)
        bound._function = site.function
        bound._argument = site.argument
        bound._refs = {}
        bound._check_applies(site)
        bound._bind(site)
        return bound

    def _applies(self, site: Site) -> str:
        return self.applies_to

    def _check_applies(self, site: Site) -> None:
        kind = self._applies(site)
        on = "the return value" if site.argument.startswith("return") else repr(site.argument)
        where = f"{site.function}(): {self!r} on {on}"
        if kind == "tensor" and site.tensor is False:
            raise ContractDefinitionError(
                f"{where}: {type(self).__name__} checks a torch tensor, but {site.argument!r} is annotated "
                f"{_type_name(site.annotation)}; put it on a tensor (LogProbs, Float[Tensor, 'B T-1'], a Batch "
                "key) or drop the annotation")
        if kind == "object" and site.tensor is True:
            raise ContractDefinitionError(
                f"{where}: {type(self).__name__} checks a model object, but {site.argument!r} is annotated as a "
                "tensor")

    def _bind(self, site: Site) -> None:
        pass

    def needs(self) -> tuple[str, ...]:
        """Parameters (besides its own) whose values the check reads."""
        return tuple(dict.fromkeys(r.root for r in getattr(self, "_refs", {}).values()))

    def probe(self, x: Any, call: Call) -> Probe | Violation | None:
        """The check, with its verdict left on the device (default: run :meth:`check`)."""
        return self.check(x, call)

    def check(self, x: Any, call: Call) -> Violation | None:
        """The check, read at once (a marker that implements only :meth:`probe` gets this for free)."""
        if type(self).probe is Marker.probe:  # pragma: no cover - abstract
            raise NotImplementedError
        out = self.probe(x, call)
        if isinstance(out, Probe):
            found = settle([out])
            return found[0] if found else None
        return out

    # helpers
    def _ref(self, site: Site, name: str | None, what: str) -> None:
        """Resolve ``name`` (a parameter, a sibling batch key, or a dotted path from one) at decoration."""
        if name is None:
            return
        if not isinstance(name, str) or not name:
            raise ContractDefinitionError(f"{site.function}(): {type(self).__name__}({what}={name!r}) on "
                                          f"{site.argument!r}: {what} must be a name")
        ref = site.resolve(name)
        if ref is None:
            raise ContractDefinitionError(
                f"{site.function}(): {type(self).__name__}({what}={name!r}) on {site.argument!r}: "
                f"{site.function}() has no parameter {name.split('.')[0]!r} (parameters: "
                f"{', '.join(site.params) or 'none'}){_scope_note(site)}")
        self._refs[what] = ref

    def _get(self, call: Call, what: str) -> Any:
        return call.get(self._refs.get(what))

    def _name(self, what: str) -> str:
        ref = self._refs.get(what)
        return ref.slot if ref is not None and not ref.chain else (ref.text if ref is not None else what)

    def _param(self, site: Site, name: str | None, what: str) -> None:
        """Kept for markers written against the first API: ``name`` must be a parameter of the function."""
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

    def _devices(self, call: Call, x: torch.Tensor, **others: Any) -> Violation | None:
        """RLG000 when tensors this marker compares sit on different devices (never a raw torch error)."""
        for what, t in others.items():
            if isinstance(t, torch.Tensor) and t.device != x.device:
                return self._fail(
                    f"{self._argument} is on {x.device} but {self._name(what)} ({what}) is on {t.device}: the "
                    f"{type(self).__name__} check compares them element by element", x, call,
                    "move both to one device (.to(x.device)) before the call; see RLG000", code=TENSOR_CONTRACT)
        return None

    def __repr__(self) -> str:
        fields = {k: v for k, v in vars(self).items() if not k.startswith("_")}
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in fields.items())})"


def _type_name(tp: Any) -> str:
    return getattr(tp, "__qualname__", None) or repr(tp)


def _scope_note(site: Site) -> str:
    """", and its batch has no key ... (keys: ...)" for a marker on a batch key, else ""."""
    near = getattr(site.resolver, "keys_near", None)
    keys = near(site.argument) if near is not None else ()
    return f", and its batch declares no such key (keys: {', '.join(keys)})" if keys else ""


# set on a tensor that rlguard itself passed through an autograd function of its own to read a loss term's sign (the
# TRL callback's reference log-probs): the values are the target's, bit for bit, and its graph gives no gradient
# in the trainer's backward, so NoGrad reads it as the target it stands for
TRACED_TARGET = "_rlguard_traced_target"


class NoGrad(Marker):
    """RLG003: ``requires_grad`` False and no ``grad_fn`` (old/reference log-probs, advantages, returns)."""

    code = DETACHED_TARGETS

    def check(self, x: Any, call: Call) -> Violation | None:
        if isinstance(x, torch.Tensor) and (x.requires_grad or x.grad_fn is not None) \
                and not getattr(x, TRACED_TARGET, False):
            name = "the return value" if self._argument.startswith("return") else self._argument
            return self._fail(
                "carries autograd history, but it is a target: no gradient may flow through it", x, call,
                f"computed with autograd on? Compute it under torch.no_grad() / torch.inference_mode(), or "
                f"use {name}.detach(); see RLG003")
        return None


class Finite(Marker):
    """No NaN/Inf (losses, advantages, log-probs). Reported as RLG000 (the catalog has no own code for it)."""

    code = TENSOR_CONTRACT
    value_check = True

    def probe(self, x: Any, call: Call) -> Probe | None:
        if not isinstance(x, torch.Tensor) or not (x.is_floating_point() or x.is_complex()) or _no_values(x):
            return None
        xd = x.detach()
        if xd.is_complex():
            return Probe(~torch.isfinite(xd).all(), lambda h: self._explain(xd, call) if h[0] else None)
        # the sum is finite when every value is: one reduction. A sum that overflows over finite values only
        # costs the explaining pass, which then finds nothing (no false alarm)
        total = xd.sum() if xd.dtype in (torch.float32, torch.float64) else xd.sum(dtype=torch.float32)
        return Probe(total, lambda h: None if math.isfinite(h[0]) else self._explain(xd, call))

    def _explain(self, xd: torch.Tensor, call: Call) -> Violation | None:
        bad = ~torch.isfinite(xd)
        n_bad = int(bad.sum())
        if not n_bad:  # the sum overflowed over finite values
            return None
        nan = int(torch.isnan(xd).sum())
        first = tuple(torch.nonzero(bad)[0].tolist()) if xd.dim() else ()
        return self._fail(f"{n_bad} non-finite values ({nan} NaN, {n_bad - nan} Inf), first at index {first}",
                          xd, call, "a log of 0 (log-prob of a masked/zero-probability token), a division by a "
                          "zero std or token count, or an overflow in bf16/fp16 upstream")


def default_centred_rtol(dtype: torch.dtype) -> float:
    """GroupCentred's default: sqrt(eps) of the dtype (float32 3.5e-4, float16 0.031, bfloat16 0.088)."""
    return math.sqrt(eps_of(dtype)) if dtype.is_floating_point else 0.0


class GroupCentred(Marker):
    """RLG009: viewed as [P, G], every group's mean is 0, small against the group's own values.

    ``group_size``: an int; a parameter name (``"group_size"``), a sibling batch key, or a dotted path from one
    (``"cfg.group_size"``, ``"self.cfg.n"``); or a dim name bound by the function's specs (``"G"`` of
    ``GroupRewards``). Default: the decorator's ``group_size`` option, else a parameter named ``group_size``, else
    the dim ``G``.

    Tolerance: a group passes when ``|mean| <= tol + rtol * max|value|`` over the group. Default ``rtol``:
    ``sqrt(eps)`` of the advantages' dtype (3.5e-4 in float32, 0.031 in float16, 0.088 in bfloat16), ``tol`` 0:
    correctly centred advantages pass in every precision and at any reward scale, while advantages with no
    baseline, a whole-batch baseline or the wrong group size have group means comparable to their values.
    ``tol=`` alone is an absolute tolerance (``rtol`` then 0 unless given).

    Under data parallelism the check runs on each rank's own values: each rank must hold whole groups (the G
    samples of a prompt contiguous, on one rank). A group that straddles ranks shows up as a count that is not a
    multiple of G, or as groups whose means are not 0; the message then names the rank and the straddling.
    """

    code = GROUP_BASELINE
    value_check = True

    def __init__(self, group_size: int | str | None = None, tol: float | None = None,
                 rtol: float | None = None) -> None:
        self.group_size = group_size
        self.tol = _tolerance(tol, "tol", "GroupCentred")
        self.rtol = _tolerance(rtol, "rtol", "GroupCentred")
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
                    "('group_size', 'cfg.group_size', 'self.cfg.n') or a dim name bound by an annotation "
                    "('G' of [P, G])")
        if isinstance(gs, bool) or not isinstance(gs, (int, str)) or (isinstance(gs, int) and gs < 1):
            raise ContractDefinitionError(
                f"{site.function}(): GroupCentred on {site.argument!r}: group_size must be a positive int or "
                f"a name, got {gs!r}")
        if isinstance(gs, int):
            self._source = ("int", gs)
            return
        if "." not in gs and gs in site.dim_names and site.resolve(gs) is None:
            self._source = ("dim", gs)
            return
        ref = site.resolve(gs)
        if ref is None:
            raise ContractDefinitionError(
                f"{site.function}(): GroupCentred(group_size={gs!r}) on {site.argument!r}: {gs.split('.')[0]!r} "
                f"is neither a parameter of {site.function}() nor a dim bound by its annotations "
                f"(dims: {', '.join(sorted(site.dim_names)) or 'none'}){_scope_note(site)}")
        self._refs["group_size"] = ref
        self._source = ("ref", ref)

    def _group_size(self, call: Call) -> Any:
        kind, src = self._source
        if kind == "int":
            return src
        if kind == "dim":
            return call.bindings.get(src)
        return call.get(src)

    def _limits(self, dtype: torch.dtype) -> tuple[float, float]:
        """(absolute, relative) tolerance for values of ``dtype``."""
        if self.tol is None and self.rtol is None:
            return 0.0, default_centred_rtol(dtype)
        return self.tol or 0.0, (self.rtol if self.rtol is not None else 0.0)

    def probe(self, x: Any, call: Call) -> Probe | Violation | None:
        if not isinstance(x, torch.Tensor):
            return None
        g = self._group_size(call)
        if isinstance(g, torch.Tensor) and g.numel() == 1 and not g.is_meta:
            g = int(g)  # a group size kept in a tensor: one read, on the host already in most trainers
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
        if _no_values(x) or not (x.is_floating_point() or x.dtype in _INT_DTYPES):
            return None
        atol, rtol = self._limits(x.dtype)
        xd = x.detach().reshape(-1, g).double()
        bad = (xd.mean(dim=1).abs_() > xd.abs().amax(dim=1).mul_(rtol).add_(atol)).any()
        return Probe((bad), lambda h: self._explain(x, call, g, dp) if h[0] else None)

    def _centred(self, grouped: torch.Tensor, dim: int, atol: float, rtol: float) -> bool:
        means = grouped.mean(dim=dim).abs()
        return bool((means <= grouped.abs().amax(dim=dim) * rtol + atol).all())

    def _explain(self, x: torch.Tensor, call: Call, g: int, dp: str) -> Violation:
        atol, rtol = self._limits(x.dtype)
        xd = x.detach().double().reshape(-1, g)
        means = xd.mean(dim=1)
        scale = xd.abs().amax(dim=1)
        excess = (means.abs() - (scale * rtol + atol))
        i = int(excess.argmax())
        p, n = xd.shape[0], xd.numel()
        flat = xd.reshape(-1)
        other = [d for d in range(2, min(n, 257)) if n % d == 0 and d != g
                 and self._centred(flat.reshape(-1, d), 1, atol, rtol)]
        if p > 1 and self._centred(xd, 0, atol, rtol):
            hint = (f"centred along the wrong axis: the mean taken over dim 0 of [P, G] = [{p}, {g}] "
                    "(across prompts) instead of dim 1 (within each group)?")
        elif other:
            hint = f"centred with group size {other[0]}, not G={g}?"
        elif self._centred(flat.reshape(1, -1), 1, atol, rtol):
            hint = "centred over the whole batch, not per group (a batch mean instead of the group mean)?"
        else:
            hint = "no baseline subtracted per group (advantages = rewards?)"
        if dp:
            hint += (f" Or, under data parallelism ({dp}), groups straddle ranks: each rank must hold whole "
                     "groups, centred on the full group's mean.")
        if self.tol is None and self.rtol is None:
            limit = f"|mean| <= {rtol:.2g} x max|value| for {str(x.dtype).removeprefix('torch.')}"
        else:
            limit = f"|mean| <= {atol:g} + {rtol:g} x max|value|"
        return self._fail(f"group {i} of {p} (G={g}) has mean {float(means[i]):.4g} with max|value| "
                          f"{float(scale[i]):.4g}; every group's mean must be 0 ({limit})", x, call,
                          hint + " see RLG009")


GroupCentered = GroupCentred  # US spelling
_INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


def _dp_where() -> str:
    """"rank r of W" when torch.distributed runs with more than one rank, else "" (no collective)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return f"rank {dist.get_rank()} of {dist.get_world_size()}"
    return ""


class MatchesOwner(Marker):
    """RLG001: the action mask [B, T-1] equals ``owner[:, 1:] == policy_role`` ("policy wrote ids[:, 1:]").

    ``owner``: a parameter, a sibling batch key or a dotted path, holding the [B, T] owner ids.
    """

    code = MASK_NOT_SHIFTED
    value_check = True

    def __init__(self, owner: str = "owner", policy_role: int = POLICY_ROLE) -> None:
        self.owner = owner
        self.policy_role = policy_role

    def _bind(self, site: Site) -> None:
        self._ref(site, self.owner, "owner")

    def probe(self, x: Any, call: Call) -> Probe | Violation | None:
        o = self._get(call, "owner")
        if not isinstance(x, torch.Tensor) or not isinstance(o, torch.Tensor) or o.dim() != 2:
            return None
        wrong_device = self._devices(call, x, owner=o)
        if wrong_device is not None:
            return wrong_device
        b, t = o.shape
        if tuple(x.shape) != (b, t - 1):
            hint = ("mask aligned to ids, not ids[:, 1:]? Build it from owner[:, 1:]; see RLG001"
                    if tuple(x.shape) == (b, t) else "see RLG001")
            return self._fail(f"shape {tuple(x.shape)}, but {self._name('owner')} {tuple(o.shape)} needs "
                              f"({b}, {t - 1})", x, call, hint)
        if _no_values(x, o):
            return None
        want = o[:, 1:] == self.policy_role
        got = x.detach() != 0
        return Probe(((want != got).any()), lambda h: self._explain(x, o, call) if h[0] else None)

    def _explain(self, x: torch.Tensor, o: torch.Tensor, call: Call) -> Violation:
        t = o.shape[1]
        want = o[:, 1:] == self.policy_role
        got = x.detach() != 0
        diff = want ^ got
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


def _valid(m: Any, like: torch.Tensor) -> torch.Tensor | None:
    if isinstance(m, torch.Tensor) and m.shape == like.shape:
        return m if m.dtype == torch.bool else m != 0  # a comparison carries no autograd history
    return None


class SamplerConsistent(Marker):
    """RLG007: at the first minibatch of an update (no step yet), these log-probs equal the sampler's.

    ``sampler``: the parameter (or sibling batch key) holding the sampler's stored log-probs (``old_logp``);
    ``mask``: the action mask's (only masked-in tokens count). A token passes when
    ``|logp - sampler| <= tol + rtol * |sampler|``; defaults: ``tol`` 1e-4, ``rtol`` twice the epsilon of the less
    precise of the two dtypes (float32: 2.4e-7, negligible; bfloat16: 0.016, the rounding of a stored bf16 log-prob).
    A sampler that computes in bf16 but stores float32 needs ``tol`` of about 2e-2. Needs an active
    :class:`Guard` inside ``guard.update()``.
    """

    code = SAMPLER_TRAINER_MISMATCH
    value_check = True
    needs_guard = True

    def __init__(self, sampler: str = "old_logp", tol: float | None = None, mask: str | None = None,
                 rtol: float | None = None) -> None:
        self.sampler = sampler
        self.tol = _tolerance(tol, "tol", "SamplerConsistent")
        self.mask = mask
        self.rtol = _tolerance(rtol, "rtol", "SamplerConsistent")

    def _bind(self, site: Site) -> None:
        self._ref(site, self.sampler, "sampler")
        self._ref(site, self.mask, "mask")

    def _limits(self, a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
        atol = 1e-4 if self.tol is None else self.tol
        rtol = 2 * eps_of(a.dtype, b.dtype) if self.rtol is None else self.rtol
        return atol, rtol

    def probe(self, x: Any, call: Call) -> Probe | Violation | None:
        g = call.guard
        if g is None or not g.in_update or g.steps_in_update != 0 or not isinstance(x, torch.Tensor):
            return None
        s = self._get(call, "sampler")
        if not isinstance(s, torch.Tensor) or s.shape != x.shape:
            return None
        if not g.once((call.function, self._argument, "sampler")) and not call.value_due:
            return None
        m = self._get(call, "mask")
        wrong_device = self._devices(call, x, sampler=s, mask=m)
        if wrong_device is not None:
            return wrong_device
        if _no_values(x, s, m):
            return None
        atol, rtol = self._limits(x, s)
        sd = s.detach()
        bad = (x.detach() - sd).abs_() > sd.abs().mul_(rtol).add_(atol)
        valid = _valid(m, x)
        if valid is not None:
            bad &= valid
        return Probe((bad.any()), lambda h: self._explain(x, s, valid, call) if h[0] else None)

    def _explain(self, x: torch.Tensor, s: torch.Tensor, valid: torch.Tensor | None, call: Call) -> Violation:
        atol, rtol = self._limits(x, s)
        gap = (x.detach().double() - s.detach().double()).abs()
        if valid is not None:
            gap = torch.where(valid, gap, torch.zeros((), dtype=gap.dtype, device=gap.device))
            n_valid = int(valid.sum())
        else:
            n_valid = gap.numel()
        worst = float(gap.max())
        at = tuple(torch.nonzero(gap == gap.max())[0].tolist())
        mean = float(gap.sum()) / max(n_valid, 1)
        limit = f"tol {atol:g}" + (f" + {rtol:.2g} x |{self._name('sampler')}|" if rtol >= 1e-6 else "")
        return self._fail(
            f"max |{self._argument} - {self._name('sampler')}| = {worst:.4g} at {at} (mean {mean:.3g} over "
            f"{n_valid} valid tokens) before the first optimizer step of the update; the PPO ratio must start at 1 "
            f"({limit})", x, call,
            "the sampler's distribution differs from the trainer's: another temperature (logits not divided "
            "by it), precision (bf16 sampler: raise tol) or top-p/top-k; or a label shift (RLG012); see RLG007")


class Frozen(Marker):
    """RLG002: old log-probs are frozen within an update.

    ``key``: a parameter (or sibling batch key) whose rows identify the samples (``"ids"``): every time a row is
    seen again in the update (minibatches, epochs), its values must be the same as before. Rows are identified by
    a hash of their bits (``row_hashes``: 2^-80 per pair of different rows, so no false alarm for distinct
    episodes of any vocabulary) and compared exactly (``rtol=None``) or, with ``rtol``, by their float64 sums
    within ``rtol``. An exact duplicate episode (the same ids) counts as another row when
    it first appears before the update's first optimizer step or twice in one call. ``current``: the log-probs
    computed now (``"logp"``): after the update's first optimizer step they must differ from these old log-probs
    somewhere (a ratio exactly 1 everywhere means old_logp was recomputed). ``mask``: the action mask, to compare
    valid tokens only. Needs an active :class:`Guard` in an update.
    """

    code = OLD_LOGP_RECOMPUTED
    value_check = True
    needs_guard = True

    def __init__(self, current: str | None = None, key: str | tuple[str, ...] | None = None,
                 mask: str | None = None, rtol: float | None = None) -> None:
        self.current = current
        self.key = key
        self.mask = mask
        self.rtol = _tolerance(rtol, "rtol", "Frozen")

    def _keys(self) -> tuple[str, ...]:
        if self.key is None:
            return ()
        return (self.key,) if isinstance(self.key, str) else tuple(self.key)

    def _bind(self, site: Site) -> None:
        if self.current is None and self.key is None:
            raise ContractDefinitionError(
                f"{site.function}(): Frozen on {site.argument!r} needs current= (the parameter of the fresh "
                "log-probs, e.g. 'logp') and/or key= (a parameter identifying the rows, e.g. 'ids', or several: "
                "('prompt_ids', 'completion_ids'))")
        if self.key is not None and not (isinstance(self.key, str) or (
                isinstance(self.key, tuple) and self.key and all(isinstance(k, str) for k in self.key))):
            raise ContractDefinitionError(
                f"{site.function}(): Frozen(key={self.key!r}) on {site.argument!r}: key is a name or a tuple of "
                "names")
        for i, k in enumerate(self._keys()):
            self._ref(site, k, f"key{i}" if i else "key")
        self._ref(site, self.current, "current")
        self._ref(site, self.mask, "mask")

    def probe(self, x: Any, call: Call) -> Probe | Violation | None:
        g = call.guard
        if g is None or not g.in_update or not isinstance(x, torch.Tensor):
            return None
        ratio = self.current is not None and g.steps_in_update > 0 and (call.function, self._argument,
                                                                          "ratio") not in g._done
        rows = self.key is not None and call.value_due
        if not (ratio or rows):
            return None
        c = self._get(call, "current") if ratio else None
        ratio = ratio and isinstance(c, torch.Tensor) and c.shape == x.shape and g.once(
            (call.function, self._argument, "ratio"))
        keys = [self._get(call, f"key{i}" if i else "key") for i in range(len(self._keys()))] if rows else []
        rows = rows and x.dim() >= 1 and all(isinstance(k, torch.Tensor) and k.dim() >= 1
                                             and k.shape[0] == x.shape[0] for k in keys)
        if rows and sum(_word_count(t) for t in keys + [x]) > _MAX_WORDS:
            _note_once(call.function, self._argument, f"Frozen(key=...) on {call.function}({self._argument}): "
                       f"rows of more than {_MAX_WORDS} 16-bit words are not fingerprinted (the float64 hash "
                       "would round); the current= check still runs")
            rows = False
        if not (ratio or rows):
            return None
        m = self._get(call, "mask")
        others = {"current": c if ratio else None, "mask": m}
        others.update({f"key{i}" if i else "key": k for i, k in enumerate(keys if rows else [])})
        wrong_device = self._devices(call, x, **others)
        if wrong_device is not None:
            return wrong_device
        if _no_values(x, *others.values()):
            return None
        xd = x.detach()
        valid = _valid(m, x)
        parts = []
        if ratio:
            differs = xd != c.detach()
            if valid is not None:
                differs &= valid
            parts.append(torch.stack([differs.any(), valid.any() if valid is not None else differs.new_ones(())]))
        n = xd.shape[0]
        if rows:
            layout = [(k.detach(), KEY_COLUMNS, None) for k in keys]
            layout.append((xd, VALUE_COLUMNS, valid))
            parts.append(row_hashes(layout))
            if self.rtol is not None:
                parts.append(xd.reshape(n, -1).sum(dim=1, dtype=torch.float64))
        payload = torch.cat([p.reshape(-1) for p in parts]) if len(parts) > 1 else parts[0].view(-1)
        widths = tuple(c for _, c, _ in layout) if rows else ()
        length = tuple(_word_count(t) for t, _, _ in layout) if rows else None

        def finish(h: list[float]) -> Violation | None:
            at = 0
            if ratio:
                any_differs, any_valid = h[0], h[1]
                at = 2
                if any_valid and not any_differs:
                    n_valid = int(valid.sum()) if valid is not None else xd.numel()
                    return self._fail(
                        f"equals {self._name('current')} exactly on all {n_valid} valid tokens after "
                        f"{g.steps_in_update} optimizer step(s) in this update: the PPO ratio is 1 everywhere "
                        "and clipping never acts", x, call,
                        f"{self._argument} recomputed from the current weights inside the minibatch/epoch loop? "
                        "Compute it once per rollout, before the loop, and reuse it; see RLG002")
            if rows:
                kc, vc = sum(widths[:-1]), widths[-1]
                width = kc + vc
                hashes = h[at:at + n * width]
                keys = [tuple(hashes[i * width:i * width + kc]) for i in range(n)]
                values = [tuple(hashes[i * width + kc:(i + 1) * width]) for i in range(n)]
                sums = h[at + n * width:at + n * width + n] if self.rtol is not None else values
                return self._compare_rows(x, valid, call, g, length, keys, values, sums)
            return None

        return Probe(payload, finish)

    def _compare_rows(self, x: torch.Tensor, valid: torch.Tensor | None, call: Call, g: Any,
                      length: tuple[int, int], keys: list, values: list, sums: list) -> Violation | None:
        """Compare each row with what the update saw before under the same key (host-side, Python numbers).

        The store maps a key to the row's value (its hash, or its float64 sum with ``rtol``), or to a list of
        them for duplicate episodes. A new value for a known key is another row when nothing could have changed
        the weights yet (no optimizer step in this update) or when the key occurs twice in this very call.
        """
        store = g.frozen_rows(call.function, self._argument, length)
        exact = self.rtol is None
        cap = _frozen_cap()
        changed = []
        for i, k in enumerate(keys):
            seen = store.get(k)
            v = values[i] if exact else sums[i]
            if seen is None:
                if len(store) < cap:
                    store[k] = v
                continue
            if (seen == v if exact else self._close(seen, v)) if type(seen) is not list else (
                    v in seen if exact else any(self._close(t, v) for t in seen)):
                continue
            if g.steps_in_update == 0 or keys.count(k) > 1:
                store[k] = (seen if type(seen) is list else [seen]) + [v]
                continue
            changed.append(i)
        if not changed:
            return None
        i = changed[0]
        with torch.no_grad():
            row = x.detach()[i].double()
            if valid is not None:
                row = row * valid[i]
            now = float(row.sum())
        how = "exactly (a hash of their bits)" if exact else f"within rtol {self.rtol:g} of their sums"
        return self._fail(
            f"{len(changed)} of {len(keys)} rows seen earlier in this update (same {self._key_names()}) now have "
            f"different values, compared {how} (first: row {i} of this call, whose values now sum to {now:.6g})",
            x, call,
            f"{self._argument} recomputed inside the update loop (from weights a step has changed)? Compute it "
            "once per rollout and reuse it in every minibatch and epoch; see RLG002")

    def _key_names(self) -> str:
        return ", ".join(self._name(f"key{i}" if i else "key") for i in range(len(self._keys())))

    def _close(self, a: float, b: float) -> bool:
        return abs(a - b) <= self.rtol * max(abs(a), abs(b), 1e-300)


def _frozen_cap() -> int:
    from rlguard.contracts.guard import FROZEN_ROWS_CAP

    return FROZEN_ROWS_CAP


class DistinctReference(Marker):
    """RLG008: the reference model is not the policy, shares no storage with it (through DDP,
    ``torch.compile``, PEFT-style wrappers), and is not in the optimizer.

    On a reference-model argument (``ref: Annotated[nn.Module, DistinctReference()]``), or anywhere with
    ``reference=`` naming it (``DistinctReference(reference="self.ref_model", policy="self.model")`` on ``self``).
    ``policy``/``optimizer``: parameters, batch keys or dotted paths; default: the active guard's policy and
    optimizer. The identity check runs on every call; the storage and optimizer checks with the value checks
    (``check_every``).
    """

    code = REFERENCE_ALIAS

    def __init__(self, policy: str | None = None, optimizer: str | None = None,
                 reference: str | None = None) -> None:
        self.policy = policy
        self.optimizer = optimizer
        self.reference = reference

    def _applies(self, site: Site) -> str:
        return "any" if self.reference is not None else "object"

    def _bind(self, site: Site) -> None:
        self._ref(site, self.policy, "policy")
        self._ref(site, self.optimizer, "optimizer")
        self._ref(site, self.reference, "reference")

    def check(self, x: Any, call: Call) -> Violation | None:
        from rlguard.contracts.guard import REFERENCE_HINT, reference_problems

        g = call.guard
        ref = self._get(call, "reference") if self.reference is not None else x
        pol = self._get(call, "policy") if self.policy else (g.policy if g is not None else None)
        opt = self._get(call, "optimizer") if self.optimizer else (g.optimizers if g is not None else None)
        if pol is None or ref is None:
            return None
        problems = reference_problems(ref, pol, opt, full=call.value_due)
        if not problems:
            return None
        argument = self._name("reference") if self.reference is not None else self._argument
        return Violation(self.code, self._function, argument,
                         format_message(self.code, self._function, argument, problems[0],
                                        got=type(ref).__name__, hint=REFERENCE_HINT))


class StopTokenInMask(Marker):
    """RLG017: each completion's first stop token is inside the loss mask, whatever the pad token is.

    On a loss/action mask (an argument or the return value). ``ids``: the token ids the mask covers (a parameter,
    a sibling batch key or a dotted path): ``[B, T]`` with the mask ``[B, T-1]`` aligned to ``ids[:, 1:]``, or the
    same shape as the mask (a completion-only layout). ``stop_ids``: an int, a sequence of ints, or the name of a
    value holding them (``"tokenizer.eos_token_id"``, ``"self.stop_token_ids"``). A row's completion starts at its
    first masked position; the first stop token at or after it must be masked. Rows with nothing masked or no
    stop token (a truncated completion) have nothing to check. A stop token left out while the position right
    after it is in the mask is not a cut completion but a mask moved by one token (RLG001, ``MatchesOwner``): it
    is left to the alignment checks.
    """

    code = STOP_TOKEN_UNTRAINED
    value_check = True

    def __init__(self, ids: str = "ids", stop_ids: int | tuple[int, ...] | list[int] | str = "stop_ids") -> None:
        self.ids = ids
        self.stop_ids = stop_ids

    def _bind(self, site: Site) -> None:
        self._ref(site, self.ids, "ids")
        if isinstance(self.stop_ids, str):
            self._ref(site, self.stop_ids, "stop_ids")
        elif isinstance(self.stop_ids, bool) or not (isinstance(self.stop_ids, int) or (
                isinstance(self.stop_ids, (tuple, list)) and self.stop_ids
                and all(isinstance(i, int) and not isinstance(i, bool) for i in self.stop_ids))):
            raise ContractDefinitionError(
                f"{site.function}(): StopTokenInMask(stop_ids={self.stop_ids!r}) on {site.argument!r}: stop_ids is "
                "a token id, a non-empty sequence of token ids, or the name of a value holding them")

    def _stops(self, call: Call) -> tuple[int, ...] | None:
        v = self._get(call, "stop_ids") if isinstance(self.stop_ids, str) else self.stop_ids
        if isinstance(v, torch.Tensor):
            v = v.reshape(-1).tolist()
        if isinstance(v, int) and not isinstance(v, bool):
            return (v,)
        if isinstance(v, (tuple, list, set, frozenset)) and v and all(isinstance(i, int) for i in v):
            return tuple(v)
        return None

    def probe(self, x: Any, call: Call) -> Probe | Violation | None:
        ids = self._get(call, "ids")
        stops = self._stops(call)
        if not isinstance(x, torch.Tensor) or not isinstance(ids, torch.Tensor) or stops is None or x.dim() != 2:
            return None
        if ids.dim() != 2 or ids.shape[0] != x.shape[0] or ids.shape[1] - x.shape[1] not in (0, 1):
            return None
        wrong_device = self._devices(call, x, ids=ids)
        if wrong_device is not None:
            return wrong_device
        if _no_values(x, ids):
            return None
        tokens = ids[:, ids.shape[1] - x.shape[1]:]
        masked = x.detach() != 0
        untrained = self._untrained(masked, tokens, stops)
        return Probe(untrained.any(), lambda h: self._explain(x, tokens, masked, stops, call) if h[0] else None)

    @staticmethod
    def _untrained(masked: torch.Tensor, tokens: torch.Tensor, stops: tuple[int, ...]) -> torch.Tensor:
        """[B] rows whose first stop token after the completion's start is out of the mask."""
        cols = torch.arange(masked.shape[1], device=masked.device)
        start = torch.where(masked.any(-1), masked.int().argmax(-1), masked.shape[1])
        is_stop = torch.isin(tokens, torch.tensor(stops, device=tokens.device)) & (cols[None] >= start[:, None])
        first = is_stop.int().argmax(-1)
        after = masked.gather(1, (first + 1).clamp(max=masked.shape[1] - 1)[:, None]).squeeze(1)
        after &= first + 1 < masked.shape[1]
        return is_stop.any(-1) & ~masked.gather(1, first[:, None]).squeeze(1) & ~after

    def _explain(self, x: torch.Tensor, tokens: torch.Tensor, masked: torch.Tensor, stops: tuple[int, ...],
                 call: Call) -> Violation:
        bad = self._untrained(masked, tokens, stops)
        r = int(torch.nonzero(bad)[0])
        cols = torch.arange(masked.shape[1], device=masked.device)
        start = int(masked[r].int().argmax())
        c = int(torch.nonzero(torch.isin(tokens[r], torch.tensor(stops, device=tokens.device)) & (cols >= start))[0][0])
        return self._fail(
            f"{int(bad.sum())} of {int(masked.any(-1).sum())} completions have their first stop token out of the "
            f"mask (first: row {r}, column {c}, token {int(tokens[r, c])}; stop ids {list(stops)})", x, call,
            "a mask built as ids != pad_token_id while the pad token is the EOS token drops the real EOS too; build "
            "it from the completion's length (positions up to and including the first stop token), or cut it at "
            "any of the stop ids generation uses; see RLG017")


class EvalMode(Marker):
    """RLG018: a scoring model (old policy, reference, value model) has every dropout module inactive.

    On a model argument of a scoring function (``ref: Annotated[nn.Module, EvalMode()]``), checked on every
    call: the module's dropout-capable submodules are listed once per model, then read by flag (``training``
    and the rate). ``only_no_grad=True``: check only calls made with autograd off (a function that also trains).
    """

    code = TRAIN_MODE_SCORING
    applies_to = "object"

    def __init__(self, only_no_grad: bool = False) -> None:
        self.only_no_grad = only_no_grad

    def _bind(self, site: Site) -> None:
        self._lists: Any = None

    def check(self, x: Any, call: Call) -> Violation | None:
        from rlguard.contracts.invariance import active_dropout, describe_dropout, dropout_modules

        if not isinstance(x, torch.nn.Module) or (self.only_no_grad and torch.is_grad_enabled()):
            return None
        if self._lists is None:
            self._lists = weakref.WeakKeyDictionary()
        modules = self._lists.get(x)
        if modules is None:
            modules = self._lists[x] = dropout_modules(x)
        found = active_dropout(x, modules)
        if not found:
            return None
        return Violation(self.code, self._function, self._argument, format_message(
            self.code, self._function, self._argument,
            f"scores with dropout on: {describe_dropout(found)} in train mode", got=type(x).__name__,
            hint="put the scoring model in eval mode (model.eval(), or a context that does) before old-policy, "
                 "reference or value forwards, or disable its dropout; see RLG018"))


class FollowsRewards(GroupCentred):
    """RLG005 at the advantages: within each group, a higher reward never gets a lower advantage.

    On group advantages [B] (``Annotated[Advantages, FollowsRewards(rewards="rewards")]``), checked against the
    rewards they come from: viewed as [P, G], for every pair of rows of a group, ``r_i > r_j`` implies
    ``a_i >= a_j`` (within ``rtol`` of the group's largest advantage: default sqrt(eps) of the dtype). Advantages
    negated (from some step on), or normalised by a negative scale, reverse the order. ``group_size`` as for
    :class:`GroupCentred`. For group-relative advantages only (GRPO, RLOO, Dr. GRPO): a value baseline (GAE)
    may rank episodes otherwise.
    """

    code = ADVANTAGE_SIGN

    def __init__(self, rewards: str = "rewards", group_size: int | str | None = None,
                 rtol: float | None = None) -> None:
        super().__init__(group_size=group_size, rtol=rtol)
        self.rewards = rewards

    def _bind(self, site: Site) -> None:
        super()._bind(site)
        self._ref(site, self.rewards, "rewards")

    def probe(self, x: Any, call: Call) -> Probe | Violation | None:
        r, g = self._get(call, "rewards"), self._group_size(call)
        if not isinstance(x, torch.Tensor) or not isinstance(r, torch.Tensor) or not isinstance(g, int) or g < 2:
            return None
        if x.dim() != 1 or r.shape != x.shape or x.numel() % g or _no_values(x, r):
            return None
        wrong_device = self._devices(call, x, rewards=r)
        if wrong_device is not None:
            return wrong_device
        a, rr = x.detach().double().view(-1, g), r.detach().double().view(-1, g)
        rtol = self.rtol if self.rtol is not None else default_centred_rtol(x.dtype)
        slack = a.abs().amax(-1, keepdim=True)[..., None] * rtol
        reversed_ = (rr[:, :, None] > rr[:, None, :]) & (a[:, :, None] < a[:, None, :] - slack)
        return Probe(reversed_.any(), lambda h: self._explain(a, rr, reversed_, call) if h[0] else None)

    def _explain(self, a: torch.Tensor, r: torch.Tensor, reversed_: torch.Tensor, call: Call) -> Violation:
        p, i, j = torch.nonzero(reversed_)[0].tolist()
        groups = int(reversed_.flatten(1).any(-1).sum())
        return self._fail(
            f"in {groups} of {a.shape[0]} groups a higher reward has a lower advantage (first: group {p}, rows {i} "
            f"and {j} of it: rewards {float(r[p, i]):.4g} > {float(r[p, j]):.4g}, advantages {float(a[p, i]):.4g} < "
            f"{float(a[p, j]):.4g})", a.view(-1), call,
            "advantages negated, or normalised by a negative scale: the update will make worse episodes likelier; "
            "see RLG005")


class UpdateDirection(Marker):
    """RLG005 during training: the update moves each episode's log-probability the way its advantage says.

    On the current policy's per-token log-probs in the loss function (``logp: Annotated[LogProbs,
    UpdateDirection(advantages="advantages", mask="mask", key="ids")]``). In each update, a row first seen before
    the update's first optimizer step records its masked log-prob sum; when it is seen again after a step (the
    next epoch, a later minibatch), the change is paired with its advantage. At the end of the update the changes
    must correlate positively with the advantages (at least ``min_rows`` pairs, advantages not all equal): a sign
    that flips mid-run (advantages negated from some step on, a surrogate that lost its minus) is reported at the
    end of the first update it spoils. ``advantages``: [B] or [B, T-1] (per-token: their masked mean per row).
    Needs a Guard and rows seen again after a step in one update (epochs > 1, or several minibatches over the same
    rows); otherwise it logs once that it cannot see anything. Checked on the value-check calls (``check_every``).
    """

    code = ADVANTAGE_SIGN
    value_check = True
    needs_guard = True

    def __init__(self, advantages: str = "advantages", mask: str | None = None, key: str = "ids",
                 min_rows: int = 8) -> None:
        if isinstance(min_rows, bool) or not isinstance(min_rows, int) or min_rows < 3:
            raise ContractDefinitionError(f"UpdateDirection(min_rows={min_rows!r}): an int >= 3")
        self.advantages = advantages
        self.mask = mask
        self.key = key
        self.min_rows = min_rows

    def _bind(self, site: Site) -> None:
        self._ref(site, self.advantages, "advantages")
        self._ref(site, self.mask, "mask")
        self._ref(site, self.key, "key")

    def probe(self, x: Any, call: Call) -> Probe | Violation | None:
        g = call.guard
        if g is None or not g.in_update or not call.value_due or not isinstance(x, torch.Tensor) or x.dim() != 2:
            return None
        a, k, m = self._get(call, "advantages"), self._get(call, "key"), self._get(call, "mask")
        if not isinstance(a, torch.Tensor) or not isinstance(k, torch.Tensor) or k.shape[0] != x.shape[0]:
            return None
        if a.shape[0] != x.shape[0] or _no_values(x, a, k) or _word_count(k) > _MAX_WORDS:
            return None
        wrong_device = self._devices(call, x, advantages=a, key=k, mask=m)
        if wrong_device is not None:
            return wrong_device
        valid = _valid(m, x)
        w = valid.to(torch.float64) if valid is not None else torch.ones_like(x, dtype=torch.float64)
        sums = (x.detach().double() * w).sum(-1)
        ad = a.detach().double()
        adv = ad.reshape(len(ad), -1)
        if adv.shape[1] == x.shape[1]:  # per-token advantages: their mean over the row's valid tokens
            adv = (adv * w).sum(-1) / w.sum(-1).clamp(min=1)
        else:
            adv = adv[:, 0]
        keys = row_hashes([(k.detach(), KEY_COLUMNS, None)])
        n = x.shape[0]
        steps = g.steps_in_update
        store = g.direction_rows(call.function, self._argument, self)

        def finish(h: list[float]) -> None:
            keyed = [tuple(h[i * KEY_COLUMNS:(i + 1) * KEY_COLUMNS]) for i in range(n)]
            s, av = h[n * KEY_COLUMNS:n * KEY_COLUMNS + n], h[n * KEY_COLUMNS + n:]
            for i, kk in enumerate(keyed):
                seen = store["rows"].get(kk)
                if seen is None:
                    if steps == 0 and len(store["rows"]) < _frozen_cap():
                        store["rows"][kk] = (s[i], av[i])
                elif steps > 0:
                    store["pairs"][kk] = (s[i] - seen[0], seen[1])  # the latest change since before the first step
            return None

        return Probe(torch.cat([keys.reshape(-1), sums, adv]), finish)

    def verdict(self, store: dict, steps: int) -> Violation | None:
        """At the end of an update: the changes against the advantages (None when they agree or cannot tell)."""
        pairs = list(store["pairs"].values())
        if len(pairs) < self.min_rows:
            if store["rows"] and steps:
                _note_once(self._function, self._argument + "#direction",
                           f"UpdateDirection on {self._function}({self._argument}): no row came back after an "
                           "optimizer step in this update (one epoch over each row?), so the update's direction "
                           "cannot be measured")
            return None
        moved = torch.tensor([p[0] for p in pairs], dtype=torch.float64)
        adv = torch.tensor([p[1] for p in pairs], dtype=torch.float64)
        if adv.std() == 0 or moved.std() == 0:
            return None
        corr = float(torch.corrcoef(torch.stack([moved, adv]))[0, 1])
        if corr >= 0:
            return None
        against = int(((moved > 0) != (adv > 0)).logical_and(adv != 0).sum())
        problem = (f"after {steps} optimizer step(s) of this update, the log-probs of {len(pairs)} rows seen before "
                   f"and after moved against their advantages (correlation {corr:.2f}; {against} rows the wrong "
                   "way): the update makes low-advantage episodes likelier")
        return Violation(self.code, self._function, self._argument, format_message(
            self.code, self._function, self._argument, problem, expected=repr(self),
            hint="advantages negated (from this update on?), a surrogate without its minus, or min/max of the "
                 "PPO clip swapped; see RLG005"))


class _TermSign(Marker):
    """The sign with which a term enters the loss a function returns, read from autograd: ``d loss / d term``
    over the term's elements (``torch.autograd.grad`` with the graph kept, so the trainer's own ``backward``
    runs as before and no ``.grad`` is written). A penalty must never lower the loss where it grows; a bonus
    never raise it. On the return value (the loss), naming the term's parameter: checked on the value-check
    calls (``check_every``) when the loss and the term carry a graph (training, not evaluation). A term that
    does not reach the loss, or enters with coefficient 0, has nothing to say."""

    value_check = True
    sign = 1  # +1: a penalty (d loss / d term >= 0); -1: a bonus
    what = "penalty"

    def __init__(self, term: str, rtol: float = 1e-6) -> None:
        if not isinstance(rtol, (int, float)) or isinstance(rtol, bool) or rtol < 0:
            raise ContractDefinitionError(f"{type(self).__name__}(rtol={rtol!r}): a number >= 0")
        self.term = term
        self.rtol = rtol

    def _bind(self, site: Site) -> None:
        if not site.argument.startswith("return"):
            raise ContractDefinitionError(
                f"{site.function}(): {self!r} on {site.argument!r}: it goes on the return value (the loss), "
                f"naming the term's parameter, e.g. -> Annotated[Tensor, {type(self).__name__}({self.term!r})]")
        self._ref(site, self.term, "term")

    def check(self, x: Any, call: Call) -> Violation | None:
        term = self._get(call, "term")
        if not isinstance(x, torch.Tensor) or not isinstance(term, torch.Tensor) or not x.is_floating_point():
            return None
        if not torch.is_grad_enabled() or not x.requires_grad or not term.requires_grad or not x.numel():
            return None
        (grad,) = torch.autograd.grad(x.sum(), term, retain_graph=True, allow_unused=True)
        if grad is None:
            return None
        g = grad.detach().double() * self.sign
        scale = float(g.abs().max())
        worst = float(g.min())
        if scale == 0 or worst >= -self.rtol * scale:
            return None
        wrong = int((g < -self.rtol * scale).sum())
        name = self._name("term")
        direction = "lowers" if self.sign > 0 else "raises"
        return self._fail(
            f"d loss / d {name} has the wrong sign at {wrong} of {g.numel()} elements (as low as "
            f"{worst * self.sign:.3g}): the {self.what} {name} {direction} the loss where it grows, so the update "
            f"{'drives it up' if self.sign > 0 else 'drives it down'}", x, call, self._hint(name))

    def _hint(self, name: str) -> str:  # pragma: no cover - overridden
        raise NotImplementedError


class Penalty(_TermSign):
    """RLG011: a penalty term (a KL to the reference) enters the returned loss with a non-negative gradient:
    ``loss = pg + beta * kl`` (``-> Annotated[Tensor, Penalty("kl")]``). A KL coefficient negated (from some step
    on), a reward-side KL with the wrong sign fed back as a loss term, or ``pg - beta * kl``, is reported at the
    first value-check call after it happens."""

    code = KL_SIGN
    sign = 1
    what = "penalty"

    def _hint(self, name: str) -> str:
        return (f"add the penalty: loss = ... + coef * {name} with coef >= 0 (a negative beta, or ... - beta * "
                f"{name}, rewards divergence from the reference); see RLG011")


class Bonus(_TermSign):
    """RLG004: a bonus term (the policy's entropy) enters the returned loss with a non-positive gradient:
    ``loss = pg - coef * entropy`` (``-> Annotated[Tensor, Bonus("entropy")]``). ``+ coef * entropy`` (an
    entropy penalty: the policy collapses) is reported at the first value-check call after it happens."""

    code = ENTROPY_BONUS_SIGN
    sign = -1
    what = "bonus"

    def _hint(self, name: str) -> str:
        return (f"subtract the bonus: loss = ... - coef * {name} with coef >= 0 (adding it penalises exploration "
                "and collapses the policy's entropy); see RLG004")


def field_name(argument: str) -> str:
    """The name a batch field goes by across functions: ``inputs['old_logp']`` and ``return['old_logp']`` ->
    ``old_logp``; a parameter's own name otherwise."""
    m = re.search(r"\[['\"]([^'\"]+)['\"]\]$", argument)
    return m.group(1) if m else argument


class RowsInStep(Marker):
    """RLG019: a field of a batch keeps its rows in step with the rows of ``key`` from where the batch is made to
    where it is used.

    Put it on the fields that describe the episodes and must not change in between (stored old, reference and
    sampler log-probs, rewards, masks), at the producer (the rollout's or collate's return value) and at the
    consumers (the loss): every call hashes each row of ``key`` (``"ids"``) and of the field (``row_hashes``:
    exact, 2^-80 per pair of different rows) and the active :class:`Guard` keeps key -> value per field ``name``
    (default: the field's own name, ``batch['old_logp']`` -> ``old_logp``) until the end of the next update. A
    row whose key comes back with another value means the field was re-indexed (filtered, sorted, permuted)
    without the key, or the key without the field. Needs an active Guard; checked every ``check_every``-th call.
    """

    code = ROWS_OUT_OF_STEP
    value_check = True
    needs_guard = True

    def __init__(self, key: str = "ids", name: str | None = None) -> None:
        self.key = key
        self.name = name

    def _bind(self, site: Site) -> None:
        self._ref(site, self.key, "key")
        self._field = self.name or field_name(site.argument)

    def probe(self, x: Any, call: Call) -> Probe | Violation | None:
        g = call.guard
        k = self._get(call, "key")
        if g is None or not call.value_due or not isinstance(x, torch.Tensor) or not isinstance(k, torch.Tensor):
            return None
        if x.dim() < 1 or k.dim() < 1 or x.shape[0] != k.shape[0] or _no_values(x, k):
            return None
        if _word_count(x) + _word_count(k) > _MAX_WORDS:
            return None
        wrong_device = self._devices(call, x, key=k)
        if wrong_device is not None:
            return wrong_device
        layout = ((k.detach(), KEY_COLUMNS, None), (x.detach(), VALUE_COLUMNS, None))
        n = x.shape[0]
        widths = (_word_count(k), _word_count(x))

        def finish(h: list[float]) -> Violation | None:
            w = KEY_COLUMNS + VALUE_COLUMNS
            keys = [tuple(h[i * w:i * w + KEY_COLUMNS]) for i in range(n)]
            values = [tuple(h[i * w + KEY_COLUMNS:(i + 1) * w]) for i in range(n)]
            store = g.row_identity(self._field, widths)
            moved = []
            for i, (kk, v) in enumerate(zip(keys, values)):
                seen = store.get(kk)
                if seen is None:
                    store[kk] = v
                elif v != seen and not (type(seen) is list and v in seen):
                    if keys.count(kk) > 1:  # the same episode twice in one call: two rows, both kept
                        store[kk] = (seen if type(seen) is list else [seen]) + [v]
                    else:
                        moved.append(i)
            if not moved:
                return None
            return self._fail(
                f"{len(moved)} of {n} rows carry other values of {self._field!r} than they had earlier for the "
                f"same {self._name('key')} row (first: row {moved[0]}): the field and {self._name('key')} are no "
                "longer in step", x, call,
                "a filter, sort or permutation applied to some fields of the batch and not to the others (values "
                "masked in a dynamic-batching order, then un-permuted; rewards re-indexed but not the log-probs)? "
                "Index every field of the episode with the same rows; see RLG019")

        return Probe(row_hashes(list(layout)).reshape(-1), finish)


def as_marker(obj: Any) -> Marker | None:
    """A marker instance from ``obj`` (an instance, or a marker class with no required arguments)."""
    if isinstance(obj, Marker):
        return obj
    if isinstance(obj, type) and issubclass(obj, Marker) and obj is not Marker:
        return obj()
    return None
