"""``@contract``: compile a function's annotations and markers into a check plan once, check every call.

Per call, in order: the mode (``off`` calls straight through) and ``torch.compile`` (inside a compiled region
the contracts step aside), then the tensor specs in two phases (see :mod:`rlguard.contracts.spec`), the
non-tensor annotations through the pluggable typechecker, the cheap markers, the value markers (every
``check_every``-th call), and after the call the return value against the same dim bindings. Violations of a
call go, as one list, to :func:`rlguard.contracts.settings.report`.

Under ``torch.distributed`` (sync on, world size > 1) a call on the ``check_every`` cadence is a synchronised
call: report() runs a collective there on every rank, failed or not, once for the arguments (before the body)
and, when the function has return checks, once for the return value (after it). The cadence depends only on
the per-function call counter, never on the data, so every rank reaches the same collectives.
"""

from __future__ import annotations

import functools
import inspect
import typing
from typing import Any, Callable

import torch

from rlguard.contracts import guard as _guard
from rlguard.contracts.errors import ContractDefinitionError, Violation
from rlguard.contracts.markers import Call, Marker, Site, as_marker, note_no_guard
from rlguard.contracts.settings import STATE, _distributed, flush_compiled_notes, note_compiled, report
from rlguard.contracts.spec import (
    TensorSpec,
    check_deferred,
    describe,
    format_message,
    is_array_annotation,
    shift_hint,
    unwrap_optional,
)

_MISSING = object()
try:
    _is_compiling = torch.compiler.is_compiling
except AttributeError:  # pragma: no cover - torch < 2.3
    _is_compiling = torch._dynamo.is_compiling


# -- typecheckers for the non-tensor annotations ----------------------------------------------------------
def _typeguard_checker() -> Callable[[str, Any, Any], str | None]:
    import typeguard

    def check(name: str, value: Any, hint: Any) -> str | None:
        try:
            typeguard.check_type(name, value, hint)
        except TypeError as e:
            return str(e)
        return None

    return check


def _beartype_checker() -> Callable[[str, Any, Any], str | None]:
    try:
        from beartype.door import die_if_unbearable, is_bearable
    except ImportError as e:
        raise ContractDefinitionError("typechecker='beartype' needs beartype (pip install 'rlguard[beartype]')") from e

    def check(name: str, value: Any, hint: Any) -> str | None:
        if is_bearable(value, hint):
            return None
        try:
            die_if_unbearable(value, hint)
        except Exception as e:  # noqa: BLE001 - beartype's violation types
            return f"{name}: {e}"
        return None  # pragma: no cover

    return check


def _custom_checker(fn: Callable[[str, Any, Any], Any]) -> Callable[[str, Any, Any], str | None]:
    def check(name: str, value: Any, hint: Any) -> str | None:
        try:
            fn(name, value, hint)
        except (TypeError, AssertionError) as e:
            return str(e)
        return None

    return check


def _make_checker(typechecker: Any) -> Callable[[str, Any, Any], str | None] | None:
    if typechecker is None:
        return None
    if typechecker == "typeguard":
        return _typeguard_checker()
    if typechecker == "beartype":
        return _beartype_checker()
    if callable(typechecker):
        return _custom_checker(typechecker)
    raise ContractDefinitionError(
        f"typechecker must be 'typeguard', 'beartype', None or a callable(name, value, hint), got {typechecker!r}")


_FAST_CLASSES_EXCLUDED = (float, complex, int)  # numeric tower: leave to the typechecker


def _split(hint: Any) -> tuple[Any, list[Marker]]:
    """``Annotated[X, m1, m2]`` -> (X, [m1, m2]); markers inside ``Optional[Annotated[...]]`` too."""
    markers: list[Marker] = []
    if typing.get_origin(hint) is typing.Annotated:
        base = typing.get_args(hint)[0]
        for meta in hint.__metadata__:
            m = as_marker(meta)
            if m is not None:
                markers.append(m)
        hint = base
    inner, optional = unwrap_optional(hint)
    if optional and typing.get_origin(inner) is typing.Annotated:
        base, more = _split(inner)
        return typing.Optional[base], markers + more
    return hint, markers


def _mentions_array(hint: Any) -> bool:
    if is_array_annotation(hint):
        return True
    return any(_mentions_array(a) for a in typing.get_args(hint) if a is not Ellipsis)


class Plan:
    """The compiled contract of one function (``wrapper.__rlguard_contract__``)."""

    def __init__(self, fn: Callable, check_every: int, typechecker: Any, group_size: Any,
                 markers: dict[str, Any] | None) -> None:
        self.function = name = fn.__qualname__
        try:
            sig = inspect.signature(fn)
        except (TypeError, ValueError) as e:
            raise ContractDefinitionError(f"@contract: cannot read the signature of {name!r}: {e}") from e
        try:
            hints = typing.get_type_hints(fn, include_extras=True)
        except Exception as e:  # noqa: BLE001 - NameError etc. from string annotations
            raise ContractDefinitionError(f"{name}(): cannot resolve its annotations: {e}") from e
        if not isinstance(check_every, int) or isinstance(check_every, bool) or check_every < 1:
            raise ContractDefinitionError(f"{name}(): check_every must be a positive int, got {check_every!r}")
        self.check_every = check_every
        checker = _make_checker(typechecker)
        params = tuple(sig.parameters)
        extra: dict[str, list[Marker]] = {}
        for arg, ms in (markers or {}).items():
            if arg not in params and arg != "return":
                raise ContractDefinitionError(
                    f"{name}(): a marker is given for {arg!r}, but {name}() has no parameter {arg!r} "
                    f"(parameters: {', '.join(params) or 'none'})")
            ms = list(ms) if isinstance(ms, (list, tuple)) else [ms]
            extra[arg] = []
            for m in ms:
                mm = as_marker(m)
                if mm is None:
                    raise ContractDefinitionError(f"{name}(): markers[{arg!r}]: {m!r} is not an rlguard marker")
                extra[arg].append(mm)

        self.in_specs: list[TensorSpec] = []
        self.type_checks: list[tuple[str, Any]] = []
        raw_markers: list[tuple[str, Marker, TensorSpec | None]] = []
        positions: dict[str, int | None] = {}
        defaults: dict[str, Any] = {}
        for i, (pname, p) in enumerate(sig.parameters.items()):
            hint = hints.get(pname, inspect.Parameter.empty)
            if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                base, ms = _split(hint)
                if _mentions_array(base) or ms or pname in extra:
                    raise ContractDefinitionError(
                        f"{name}(): tensor specs and markers on *{pname}/**{pname} are not supported; "
                        "give the tensors their own parameters")
                continue
            positions[pname] = i if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) else None
            defaults[pname] = p.default if p.default is not p.empty else _MISSING
            if hint is inspect.Parameter.empty:
                ms, spec = extra.get(pname, []), None
            else:
                base, ms = _split(hint)
                ms = ms + extra.get(pname, [])
                inner, optional = unwrap_optional(base)
                spec = None
                if is_array_annotation(inner):
                    spec = TensorSpec(inner, pname, name, optional=optional)
                    self.in_specs.append(spec)
                elif _mentions_array(base):
                    raise ContractDefinitionError(
                        f"{name}(), argument {pname!r}: {base!r} is not supported; use one jaxtyping annotation "
                        "(Shaped[...] for several dtypes), optionally Optional[...]")
                elif checker is not None and base is not typing.Any:
                    self.type_checks.append((pname, base))
            raw_markers += [(pname, m, spec) for m in ms]

        # the return value: one spec, or a tuple of specs
        self.ret_specs: list[tuple[int | None, TensorSpec]] = []
        rhint = hints.get("return", inspect.Parameter.empty)
        rmarkers: list[tuple[int | None, str, Marker, TensorSpec | None]] = []
        if rhint is not inspect.Parameter.empty:
            rbase, rms = _split(rhint)
            rms += extra.get("return", [])
            inner, optional = unwrap_optional(rbase)
            rspec = None
            if is_array_annotation(inner):
                rspec = TensorSpec(inner, "return", name, optional=optional)
                self.ret_specs.append((None, rspec))
            elif typing.get_origin(inner) is tuple and Ellipsis not in typing.get_args(inner):
                for k, el in enumerate(typing.get_args(inner)):
                    ebase, ems = _split(el)
                    einner, eopt = unwrap_optional(ebase)
                    espec = None
                    if is_array_annotation(einner):
                        espec = TensorSpec(einner, f"return[{k}]", name, optional=eopt)
                        self.ret_specs.append((k, espec))
                    rmarkers += [(k, f"return[{k}]", m, espec) for m in ems]
            elif _mentions_array(rbase):
                raise ContractDefinitionError(f"{name}(): return annotation {rbase!r} is not supported")
            rmarkers += [(None, "return", m, rspec) for m in rms]
        elif "return" in extra:
            rmarkers += [(None, "return", m, None) for m in extra["return"]]

        # dims: every name in an expression must be bindable
        all_specs = self.in_specs + [s for _, s in self.ret_specs]
        plain = set().union(*(s.plain_names for s in all_specs)) if all_specs else set()
        inverse = set().union(*(s.inverse_names for s in all_specs)) if all_specs else set()
        for s in all_specs:
            for n in s.sym_names - plain - inverse:
                raise ContractDefinitionError(
                    f"{name}(), {s.argument!r}: dim {n!r} in {s.dim_str!r} is bound by no annotation: name it "
                    f"plainly in one argument (e.g. '... {n}') or write the expression as '{n}-1' / '{n}+1'")
        self.dim_names = frozenset(plain | inverse)
        # mask-like tensors last, so that a [B, T] mask beside [B, T-1] log-probs is the one reported
        self.in_specs.sort(key=lambda s: s.kind == "mask")

        options = {"group_size": group_size}

        def bind(arg: str, m: Marker, spec: TensorSpec | None) -> Marker:
            return m.bind(Site(name, arg, params, spec, self.dim_names, options))

        self.cheap: list[tuple[str, Marker]] = []
        self.value: list[tuple[str, Marker]] = []
        needed = {s.argument for s in self.in_specs} | {a for a, _ in self.type_checks}
        for arg, m, spec in raw_markers:
            bm = bind(arg, m, spec)
            (self.value if bm.value_check else self.cheap).append((arg, bm))
            needed |= {arg, *bm.needs()}
        self.ret_markers: list[tuple[int | None, Marker]] = []
        for k, arg, m, spec in rmarkers:
            bm = bind(arg, m, spec)
            self.ret_markers.append((k, bm))
            needed |= set(bm.needs())
        self.extract = [(p, positions[p], defaults[p]) for p in params if p in needed and p in positions]
        self.checker = checker
        self.has_markers = bool(self.cheap or self.value or self.ret_markers)
        self.needs_guard = any(getattr(m, "needs_guard", False) or m.code == "RLG008"
                               for _, m in self.cheap + self.value + self.ret_markers)


def contract(fn: Callable | None = None, *, check_every: int = 1, typechecker: Any = "typeguard",
             group_size: int | str | None = None, markers: dict[str, Any] | None = None) -> Any:
    """Check a function's tensor annotations and markers at every call.

    Bare ``@contract`` or ``@contract(check_every=4, typechecker="beartype", group_size="cfg.group_size",
    markers={"old_logp": NoGrad()})``. ``check_every``: run the value checks (NaN scans, group means,
    fingerprints) on every N-th call only; shape, dtype, grad and identity checks always run.
    ``typechecker``: checks the non-tensor annotations ('typeguard', 'beartype', None, or a callable
    ``(name, value, hint)`` raising TypeError). Misfitting annotations or markers raise
    :class:`ContractDefinitionError` here, when the decorator is applied.
    """

    def apply(f: Callable) -> Callable:
        if isinstance(f, (staticmethod, classmethod)):
            return type(f)(apply(f.__func__))
        if not callable(f):
            raise ContractDefinitionError(f"@contract applies to functions, got {f!r}")
        return _wrap(f, Plan(f, check_every, typechecker, group_size, markers))

    return apply(fn) if fn is not None else apply


def _explain(specs: list[TensorSpec], lookup: Callable[[str], Any]) -> Violation:
    """The message of a shape/dtype failure: the fast path only says that it failed, this says where and why.

    Re-runs both phases with the explaining checks over the same values (pure functions of the shapes).
    """
    b: dict[str, Any] = {}
    src: dict[str, str] = {}
    deferred: list = []
    for spec in specs:
        x = lookup(spec.argument)
        problem = spec.check(x, b, src, deferred)
        if problem is not None:
            return spec.violation(x, problem, b, src)
    fail = check_deferred(deferred, b, src)
    if fail is None:  # pragma: no cover - the fast and explaining paths disagree: a bug in rlguard
        raise AssertionError("rlguard: fast shape check failed but the explanation found nothing")
    spec, problem, shift = fail
    code, hint = shift_hint(spec, shift) if shift else ("RLG000", None)
    return spec.violation(lookup(spec.argument), problem, b, src, code=code, hint=hint)


def _wrap(fn: Callable, plan: Plan) -> Callable:
    qualname = plan.function
    extract = plan.extract
    in_specs = plan.in_specs
    type_checks = plan.type_checks
    checker = plan.checker
    cheap, value, ret_markers, ret_specs = plan.cheap, plan.value, plan.ret_markers, plan.ret_specs
    timed = [(a, m) for a, m in value if m.needs_guard]
    untimed = [(a, m) for a, m in value if not m.needs_guard]
    has_markers, needs_guard = plan.has_markers, plan.needs_guard
    has_ret = bool(ret_specs or ret_markers)
    check_every = plan.check_every
    counter = [0]
    state = STATE

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if state.mode == "off":
            return fn(*args, **kwargs)
        if _is_compiling():
            note_compiled(qualname)
            return fn(*args, **kwargs)
        if state.compiled_pending:
            flush_compiled_notes()
        values: dict[str, Any] = {}
        n = len(args)
        for pname, pos, default in extract:
            if pos is not None and pos < n:
                values[pname] = args[pos]
            else:
                v = kwargs.get(pname, default)
                if v is _MISSING:
                    return fn(*args, **kwargs)  # let Python report the missing argument
                values[pname] = v
        counter[0] += 1
        due = check_every == 1 or counter[0] % check_every == 1
        # a synchronised call (cross-rank collectives in report): decided by the counter only, same on all ranks
        synced = due and state.sync != "off" and _distributed()
        b: dict[str, Any] = {}
        deferred: list = []
        misshapen = False
        for spec in in_specs:
            if not spec.fast(values[spec.argument], b, deferred):
                misshapen = True
                break
        if misshapen or (deferred and check_deferred(deferred, b, None) is not None):
            report([_explain(in_specs, values.__getitem__)], collective=synced)
            out = fn(*args, **kwargs)  # warn mode: no further checks on a misshapen call
            if synced and has_ret:
                report([], collective=True)  # the return's collective, so that all ranks stay in step
            return out
        violations: list[Violation] = []
        for pname, hint in type_checks:
            x = values[pname]
            if isinstance(hint, type) and hint not in _FAST_CLASSES_EXCLUDED:
                msg = None if isinstance(x, hint) else f"expected {hint.__qualname__}, got {type(x).__name__}"
            else:
                msg = checker(pname, x, hint)
            if msg is not None:
                violations.append(Violation("RLG000", qualname, pname, format_message(
                    "RLG000", qualname, pname, "does not match its annotation", expected=repr(hint),
                    got=describe(x), hint=msg)))
        call = None
        if has_markers:
            call = Call(qualname, values, b, _guard.active_guard() if needs_guard else None, due)
            for pname, m in cheap:
                v = m.check(values[pname], call)
                if v is not None:
                    violations.append(v)
            if due:
                for pname, m in untimed:
                    v = m.check(values[pname], call)
                    if v is not None:
                        violations.append(v)
            if call.guard is not None:
                for pname, m in timed:
                    v = m.check(values[pname], call)
                    if v is not None:
                        violations.append(v)
            elif timed:
                note_no_guard(qualname, timed)
        if violations or synced:
            report(violations, collective=synced)
        out = fn(*args, **kwargs)
        if has_ret:
            _check_return(out, b, call, due, qualname, values, synced)
        return out

    def _check_return(out: Any, b: dict, call: Any, due: bool, qualname: str, values: dict,
                      synced: bool) -> None:
        def element(k: int | None) -> Any:
            if k is None:
                return out
            return out[k] if isinstance(out, (tuple, list)) and len(out) > k else None

        deferred: list = []
        ok = all(spec.fast(element(k), b, deferred) for k, spec in ret_specs)
        if not ok or (deferred and check_deferred(deferred, b, None) is not None):
            by_name = {s.argument: k for k, s in ret_specs}

            def lookup(a: str) -> Any:
                return element(by_name[a]) if a in by_name else values[a]

            report([_explain(in_specs + [s for _, s in ret_specs], lookup)], collective=synced)
            return
        if not ret_markers:
            if synced:
                report([], collective=True)
            return
        if call is None:
            call = Call(qualname, values, b, _guard.active_guard() if needs_guard else None, due)
        violations = []
        for k, m in ret_markers:
            if m.value_check and not due and not m.needs_guard:
                continue
            v = m.check(element(k), call)
            if v is not None:
                violations.append(v)
        if violations or synced:
            report(violations, collective=synced)

    wrapper.__rlguard_contract__ = plan  # type: ignore[attr-defined]
    return wrapper
