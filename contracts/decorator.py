"""``@contract``: compile a function's annotations and markers into a check plan once, check every call.

Per call, in order: the mode (``off`` calls straight through) and ``torch.compile`` (inside a compiled region
the contracts step aside), then the keys of batch arguments (:mod:`rlguard.contracts.batch`), the tensor specs
in two phases (see :mod:`rlguard.contracts.spec`), the non-tensor annotations through the pluggable typechecker,
the cheap markers, the value markers (every ``check_every``-th call), and after the call the return value
against the same dim bindings. Violations of a call go, as one list, to
:func:`rlguard.contracts.settings.report`.

Value markers leave their verdicts on the device (:class:`~rlguard.contracts.markers.Probe`); a checked call
reads all of them with one host transfer: before the body, or, when the return value has value markers too,
after the body together with the return's (the arguments' value violations are then reported after the body;
if the body raises first, they are reported in its place).

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

from rlguard.catalog import REFERENCE_ALIAS, TENSOR_CONTRACT
from rlguard.contracts import guard as _guard
from rlguard.contracts.batch import MISSING, Batch, field_names, get_field, is_typeddict
from rlguard.contracts.errors import ContractDefinitionError, Violation
from rlguard.contracts.markers import Call, Marker, Probe, Ref, Site, as_marker, note_no_guard, settle
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
_EMPTY = inspect.Parameter.empty


def _analyse(hint: Any) -> tuple[Any, list[Marker], bool, Batch | None]:
    """An annotation -> (base type, markers, optional, batch spec): ``Optional[Annotated[X, m1, Batch(...)]]``,
    ``Annotated[Optional[X], m1]``, a bare ``Batch(...)``."""
    markers: list[Marker] = []
    batch = None
    optional = False
    inner, opt = unwrap_optional(hint)
    if opt:
        optional, hint = True, inner
    if typing.get_origin(hint) is typing.Annotated:
        base = typing.get_args(hint)[0]
        for meta in hint.__metadata__:
            if isinstance(meta, Batch) or meta is Batch:
                if batch is not None:
                    raise ContractDefinitionError(f"{hint!r}: one Batch(...) per annotation")
                batch = meta
                continue
            m = as_marker(meta)
            if m is not None:
                markers.append(m)
        hint = base
        inner, opt = unwrap_optional(hint)
        if opt:
            optional, hint = True, inner
    if isinstance(hint, Batch):
        batch, hint = hint, typing.Any
    if batch is Batch or (batch is not None and not batch.fields):
        batch = Batch.of(hint)
    return hint, markers, optional, batch


def _mentions_array(hint: Any) -> bool:
    if is_array_annotation(hint):
        return True
    return any(_mentions_array(a) for a in typing.get_args(hint) if a is not Ellipsis)


def _tensor_kind(base: Any, spec: TensorSpec | None) -> bool | None:
    """True: a tensor annotation; False: some other type; None: unknown (no annotation, Any)."""
    if spec is not None or (isinstance(base, type) and issubclass(base, torch.Tensor)):
        return True
    if base is _EMPTY or base is typing.Any or base is None:
        return None
    return False


def _plain_class(tp: Any) -> bool:
    """A class checked with isinstance (not ``typing.Any``, which is a class from Python 3.11)."""
    return isinstance(tp, type) and tp is not typing.Any


def _key_style(base: Any) -> bool:
    """True when a container's keys read as ``x['k']`` (mappings, TypedDicts, unknown), False for ``x.k``."""
    if not _plain_class(base) or is_typeddict(base):
        return True
    from collections.abc import Mapping

    return issubclass(base, (dict, Mapping))


def _target(fn: Any) -> tuple[str, inspect.Signature, dict]:
    """(qualified name, signature, type hints) of a function, a method or a ``functools.partial`` of one."""
    inner = fn
    while isinstance(inner, functools.partial):
        inner = inner.func
    source = inner.__func__ if inspect.ismethod(inner) else inner
    if not inspect.isfunction(source):
        kind = type(inner).__qualname__
        raise ContractDefinitionError(
            f"@contract applies to functions, methods and functools.partial objects; got a {kind} instance "
            f"{inner!r}: decorate its class's __call__ method instead")
    name = getattr(source, "__qualname__", None) or getattr(source, "__name__", repr(source))
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError) as e:
        raise ContractDefinitionError(f"@contract: cannot read the signature of {name!r}: {e}") from e
    try:
        hints = typing.get_type_hints(source, include_extras=True)
    except Exception as e:  # noqa: BLE001 - NameError etc. from string annotations
        raise ContractDefinitionError(f"{name}(): cannot resolve its annotations: {e}") from e
    return name, sig, hints


class _Resolver:
    """Resolves the names markers give (``owner``, ``self.cfg.n``, a sibling batch key) to a :class:`Ref`."""

    def __init__(self, params: tuple[str, ...], children: dict, parents: dict, roots: dict) -> None:
        self.params, self.children, self.parents, self.roots = params, children, parents, roots

    def __call__(self, name: str, argument: str) -> Ref | None:
        head, *rest = name.split(".")
        slot = None
        scope = self.parents.get(argument)
        while scope is not None and slot is None:  # sibling keys first, then the enclosing batches' keys
            slot = self.children.get(scope, {}).get(head)
            scope = self.parents.get(scope)
        if slot is None and head in self.params:
            slot = head
        if slot is None:
            return None
        chain = list(rest)
        while chain and chain[0] in self.children.get(slot, {}):  # a declared key: read where it was extracted
            slot = self.children[slot][chain.pop(0)]
        return Ref(slot, self.roots[slot], tuple(chain), name)

    def keys_near(self, argument: str) -> tuple[str, ...]:
        scope = self.parents.get(argument)
        return tuple(self.children.get(scope, {})) if scope is not None else ()


class Plan:
    """The compiled contract of one function (``wrapper.__rlguard_contract__``), or of a batch spec applied
    directly (:func:`rlguard.contracts.batch.check_batch`).

    ``params``: ``(name, position or None, default or _MISSING, annotation)`` per parameter; ``return_hint``: the
    return annotation (``inspect.Parameter.empty``: none).
    """

    def __init__(self, name: str, params: list[tuple[str, int | None, Any, Any]], return_hint: Any,
                 check_every: int, typechecker: Any, group_size: Any, markers: dict[str, Any] | None) -> None:
        self.function = name
        if not isinstance(check_every, int) or isinstance(check_every, bool) or check_every < 1:
            raise ContractDefinitionError(f"{name}(): check_every must be a positive int, got {check_every!r}")
        self.check_every = check_every
        checker = _make_checker(typechecker)
        names = tuple(p[0] for p in params)
        extra: dict[str, list[Marker]] = {}
        for arg, ms in (markers or {}).items():
            if arg not in names and arg != "return":
                raise ContractDefinitionError(
                    f"{name}(): a marker is given for {arg!r}, but {name}() has no parameter {arg!r} "
                    f"(parameters: {', '.join(names) or 'none'})")
            ms = list(ms) if isinstance(ms, (list, tuple)) else [ms]
            extra[arg] = []
            for m in ms:
                mm = as_marker(m)
                if mm is None:
                    raise ContractDefinitionError(f"{name}(): markers[{arg!r}]: {m!r} is not an rlguard marker")
                extra[arg].append(mm)

        self.checker = checker
        self.in_specs: list[TensorSpec] = []
        self.ret_specs: list[TensorSpec] = []
        self.type_checks: list[tuple[str, Any]] = []
        self.in_steps: list[tuple[str, str, Any, bool]] = []  # (slot, container slot, key, optional)
        self.ret_steps: list[tuple[str, str, Any, bool]] = []  # the same for the return value (int key: index)
        self.children: dict[str, dict[str, str]] = {}
        self.parents: dict[str, str] = {}
        self.roots: dict[str, str] = {}
        self.batches: set[str] = set()
        raw: list[tuple[str, Marker, TensorSpec | None, Any, bool | None, bool]] = []  # ..., is_return

        for pname, _, _, hint in params:
            self.roots[pname] = pname
            if hint is _EMPTY:
                raw += [(pname, m, None, None, None, False) for m in extra.get(pname, [])]
                continue
            self._compile(pname, pname, hint, extra.get(pname, []), raw, returning=False)

        if return_hint is not _EMPTY:
            self.roots["return"] = "return"
            base, ms, optional, batch = _analyse(return_hint)
            if batch is None and typing.get_origin(base) is tuple and Ellipsis not in typing.get_args(base):
                raw += [("return", m, None, base, False, True) for m in ms + extra.get("return", [])]
                for k, el in enumerate(typing.get_args(base)):
                    slot = f"return[{k}]"
                    self.roots[slot] = "return"
                    self.ret_steps.append((slot, "return", k, True))
                    self._compile(slot, "return", el, [], raw, returning=True)
            else:
                self._compile("return", "return", return_hint, extra.get("return", []), raw, returning=True)
        elif "return" in extra:
            raw += [("return", m, None, None, None, True) for m in extra["return"]]

        # dims: every name in an expression must be bindable
        all_specs = self.in_specs + self.ret_specs
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

        resolver = _Resolver(names, self.children, self.parents, self.roots)
        options = {"group_size": group_size}
        self.cheap: list[tuple[str, Marker]] = []
        self.value: list[tuple[str, Marker]] = []
        self.ret_markers: list[tuple[str, Marker]] = []
        needed = ({self.roots[s.argument] for s in self.in_specs} | {self.roots[a] for a, _ in self.type_checks}
                  | {self.roots[b] for b in self.batches})
        for slot, m, spec, base, tensor, returning in raw:
            bm = m.bind(Site(name, slot, names, spec, self.dim_names, options, base, tensor, resolver))
            if returning:
                self.ret_markers.append((slot, bm))
            else:
                (self.value if bm.value_check else self.cheap).append((slot, bm))
                needed.add(self.roots[slot])
            needed |= set(bm.needs())
        needed.discard("return")
        self.extract = [(p, pos, default) for p, pos, default, _ in params if p in needed]
        self.in_types = [(a, h) for a, h in self.type_checks if not self.roots[a] == "return"]
        self.has_markers = bool(self.cheap or self.value or self.ret_markers)
        self.needs_guard = any(getattr(m, "needs_guard", False) or m.code == REFERENCE_ALIAS
                               for _, m in self.cheap + self.value + self.ret_markers)
        self.defer_values = any(m.value_check for _, m in self.ret_markers)

    def _compile(self, slot: str, root: str, hint: Any, more: list[Marker], raw: list, returning: bool) -> None:
        name = self.function
        base, ms, optional, batch = _analyse(hint)
        ms = ms + more
        spec = None
        if batch is not None:
            if ms:
                raise ContractDefinitionError(
                    f"{name}(), {slot!r}: markers on a batch container ({', '.join(map(repr, ms))}) check nothing; "
                    "put them on its keys: Batch(advantages=Annotated[Advantages, NoGrad()], ...)")
            self.batches.add(slot)
            if _plain_class(base) and not is_typeddict(base) and not returning:
                self.type_checks.append((slot, typing.Optional[base] if optional else base))
            self.children[slot] = {}
            square = _key_style(base)
            steps = self.ret_steps if returning else self.in_steps
            for key, field_hint in batch.fields.items():
                child = f"{slot}[{key!r}]" if square else f"{slot}.{key}"
                self.children[slot][key] = child
                self.parents[child] = slot
                self.roots[child] = root
                field_optional = _analyse(field_hint)[2] or field_hint is typing.Any
                steps.append((child, slot, key, field_optional or False))
                self._compile(child, root, field_hint, [], raw, returning)
            return
        if is_array_annotation(base):
            spec = TensorSpec(base, slot, name, optional=optional)
            (self.ret_specs if returning else self.in_specs).append(spec)
        elif _mentions_array(base):
            raise ContractDefinitionError(
                f"{name}(), argument {slot!r}: {base!r} is not supported; use one jaxtyping annotation "
                "(Shaped[...] for several dtypes), optionally Optional[...]")
        elif (self.checker is not None and base is not typing.Any and base is not _EMPTY and not returning
              and not (isinstance(base, type) and issubclass(base, torch.Tensor) and optional)):
            self.type_checks.append((slot, typing.Optional[base] if optional else base))
        tensor = _tensor_kind(base, spec)
        raw += [(slot, m, spec, base, tensor, returning) for m in ms]

    @classmethod
    def of_function(cls, fn: Callable, check_every: int, typechecker: Any, group_size: Any,
                    markers: dict[str, Any] | None) -> Plan:
        name, sig, hints = _target(fn)
        params = []
        for i, (pname, p) in enumerate(sig.parameters.items()):
            hint = hints.get(pname, _EMPTY)
            if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                base, ms, _, batch = _analyse(hint) if hint is not _EMPTY else (None, [], False, None)
                if _mentions_array(base) or ms or batch is not None or pname in (markers or {}):
                    raise ContractDefinitionError(
                        f"{name}(): tensor specs and markers on *{pname}/**{pname} are not supported; "
                        "give the tensors their own parameters")
                continue
            position = i if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) else None
            params.append((pname, position, p.default if p.default is not p.empty else _MISSING, hint))
        if markers:
            known = {p[0] for p in params}
            for arg in markers:  # a marker for *args/**kwargs: the same message as an unknown name
                if arg not in known and arg != "return" and arg in sig.parameters:
                    raise ContractDefinitionError(
                        f"{name}(): tensor specs and markers on *{arg}/**{arg} are not supported; "
                        "give the tensors their own parameters")
        return cls(name, params, hints.get("return", _EMPTY), check_every, typechecker, group_size, markers)

    # -- per call ------------------------------------------------------------------------------------------
    def fields(self, values: dict, steps: list) -> Violation | None:
        """Read the batch keys into ``values``; the first missing required key as a violation."""
        for slot, parent, key, optional in steps:
            container = values.get(parent)
            if container is None:
                values[slot] = None
                continue
            if isinstance(key, int):
                value = container[key] if isinstance(container, (tuple, list)) and len(container) > key else None
            else:
                value = get_field(container, key)
                if value is MISSING:
                    if not optional:
                        return Violation(TENSOR_CONTRACT, self.function, parent, format_message(
                            TENSOR_CONTRACT, self.function, parent, f"has no key {key!r}, which its Batch spec requires",
                            got=f"{type(container).__name__} with keys {field_names(container)}",
                            hint=f"pass a container with {key!r}, or declare it Optional[...] in the Batch if it "
                                 "may be absent"))
                    value = None
            values[slot] = value
        return None

    def run_value(self, value: Any) -> None:
        """check_batch's call: the batch as the only argument, no body."""
        if STATE.mode == "off":
            return
        if STATE.compiled_pending:
            flush_compiled_notes()
        self.runner({self.extract[0][0]: value} if self.extract else {}, None)


def contract(fn: Callable | None = None, *, check_every: int = 1, typechecker: Any = "typeguard",
             group_size: int | str | None = None, markers: dict[str, Any] | None = None) -> Any:
    """Check a function's tensor annotations and markers at every call.

    Bare ``@contract`` or ``@contract(check_every=4, typechecker="beartype", group_size="cfg.group_size",
    markers={"old_logp": NoGrad()})``. ``check_every``: run the value checks (NaN scans, group means,
    fingerprints) on every N-th call only; shape, dtype, grad and identity checks always run.
    ``typechecker``: checks the non-tensor annotations ('typeguard', 'beartype', None, or a callable
    ``(name, value, hint)`` raising TypeError). Applies to functions, methods (``self``'s attributes can be named
    by markers: ``GroupCentred(group_size="self.cfg.n")``), static/class methods and ``functools.partial``
    objects; a class is refused (decorate its methods). Misfitting annotations or markers raise
    :class:`ContractDefinitionError` here, when the decorator is applied.
    """

    def apply(f: Callable) -> Callable:
        if isinstance(f, (staticmethod, classmethod)):
            return type(f)(apply(f.__func__))
        if inspect.isclass(f):
            raise ContractDefinitionError(
                f"@contract applies to functions and methods, not to the class {f.__qualname__}: decorating it "
                f"would replace the class by a function (isinstance and subclassing break). Decorate the methods "
                f"whose tensors it should check (e.g. {f.__qualname__}.compute_loss) instead")
        if not callable(f):
            raise ContractDefinitionError(f"@contract applies to functions, got {f!r}")
        return _wrap(f, Plan.of_function(f, check_every, typechecker, group_size, markers))

    return apply(fn) if fn is not None else apply


_BATCH_PLANS_CAP = 256


def batch_plan(spec: Batch, where: str, name: str, check_every: int, typechecker: Any) -> Plan:
    """The compiled plan of ``check_batch(spec, value, where, name=...)`` (cached on the spec)."""
    if not isinstance(spec, Batch):
        raise ContractDefinitionError(f"check_batch: spec must be a Batch(...), got {spec!r}")
    for what, text in (("where", where), ("name", name)):
        if not isinstance(text, str) or not text:
            raise ContractDefinitionError(f"check_batch: {what} must be a non-empty string, got {text!r}")
    key = (where, name, check_every, typechecker if isinstance(typechecker, (str, type(None))) else id(typechecker))
    plan = spec._plans.get(key)
    if plan is None:
        if len(spec._plans) > _BATCH_PLANS_CAP:
            spec._plans.clear()
        plan = Plan(where, [(name, 0, _MISSING, typing.Annotated[typing.Any, spec])], _EMPTY, check_every,
                    typechecker, None, None)
        plan.runner = _runner(plan)
        spec._plans[key] = plan
    return plan


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
    code, hint = shift_hint(spec, shift) if shift else (TENSOR_CONTRACT, None)
    return spec.violation(lookup(spec.argument), problem, b, src, code=code, hint=hint)


def _runner(plan: Plan) -> Callable[[dict, Callable[[], Any] | None], Any]:
    """``run(values, body)``: the checks of one call around ``body()`` (None: no body, check_batch)."""
    qualname = plan.function
    in_specs, ret_specs = plan.in_specs, plan.ret_specs
    in_steps, ret_steps = plan.in_steps, plan.ret_steps
    type_checks = plan.in_types
    checker = plan.checker
    cheap, value, ret_markers = plan.cheap, plan.value, plan.ret_markers
    timed = [(a, m) for a, m in value if m.needs_guard]
    untimed = [(a, m) for a, m in value if not m.needs_guard]
    has_markers, needs_guard, defer = plan.has_markers, plan.needs_guard, plan.defer_values
    has_ret = bool(ret_specs or ret_markers or ret_steps)
    check_every = plan.check_every
    counter = [0]
    state = STATE
    fields = plan.fields

    def run(values: dict, body: Callable[[], Any] | None) -> Any:
        counter[0] += 1
        due = check_every == 1 or counter[0] % check_every == 1
        # a synchronised call (cross-rank collectives in report): decided by the counter only, same on all ranks
        synced = due and state.sync != "off" and _distributed()
        b: dict[str, Any] = {}
        deferred: list = []
        problem = fields(values, in_steps) if in_steps else None
        if problem is None:
            for spec in in_specs:
                if not spec.fast(values[spec.argument], b, deferred):
                    problem = _explain(in_specs, values.__getitem__)
                    break
            else:
                if deferred and check_deferred(deferred, b, None) is not None:
                    problem = _explain(in_specs, values.__getitem__)
        if problem is not None:
            report([problem], collective=synced)
            if body is None:
                return None
            out = body()  # warn mode: no further checks on a misshapen call
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
                violations.append(Violation(TENSOR_CONTRACT, qualname, pname, format_message(
                    TENSOR_CONTRACT, qualname, pname, "does not match its annotation", expected=repr(hint),
                    got=describe(x), hint=msg)))
        call = None
        probes: list[Probe] = []
        if has_markers:
            call = Call(qualname, values, b, _guard.active_guard() if needs_guard else None, due)
            for pname, m in cheap:
                v = m.check(values[pname], call)
                if v is not None:
                    violations.append(v)
            if due:
                for pname, m in untimed:
                    r = m.probe(values[pname], call)
                    if r is not None:
                        (probes if type(r) is Probe else violations).append(r)
            if call.guard is not None:
                for pname, m in timed:
                    r = m.probe(values[pname], call)
                    if r is not None:
                        (probes if type(r) is Probe else violations).append(r)
            elif timed:
                note_no_guard(qualname, timed)
        if probes and not (defer and body is not None):
            violations += settle(probes)
            probes = []
        if violations or synced:
            report(violations, collective=synced)
        if body is None:
            return None
        if probes:
            try:
                out = body()
            except Exception:
                found = settle(probes)  # the body may have failed on values a check flags: say that first
                if found:
                    report(found)
                raise
        else:
            out = body()
        if has_ret:
            _check_return(out, values, b, call, due, synced, probes)
        return out

    def _check_return(out: Any, values: dict, b: dict, call: Any, due: bool, synced: bool,
                      probes: list[Probe]) -> None:
        values["return"] = out
        problem = fields(values, ret_steps) if ret_steps else None
        deferred: list = []
        if problem is None and not (all(spec.fast(values[spec.argument], b, deferred) for spec in ret_specs)
                                    and not (deferred and check_deferred(deferred, b, None) is not None)):
            problem = _explain(in_specs + ret_specs, values.__getitem__)
        if problem is not None:
            report([problem] + settle(probes), collective=synced)
            return
        if not ret_markers and not probes:
            if synced:
                report([], collective=True)
            return
        if call is None:
            call = Call(qualname, values, b, _guard.active_guard() if needs_guard else None, due)
        violations = []
        for slot, m in ret_markers:
            if m.value_check and not due and not m.needs_guard:
                continue
            r = m.probe(values[slot], call) if m.value_check else m.check(values[slot], call)
            if r is not None:
                (probes if type(r) is Probe else violations).append(r)
        violations += settle(probes)
        if violations or synced:
            report(violations, collective=synced)

    return run


def _wrap(fn: Callable, plan: Plan) -> Callable:
    qualname = plan.function
    extract = plan.extract
    state = STATE
    run = _runner(plan)
    plan.runner = run

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
        return run(values, lambda: fn(*args, **kwargs))

    if isinstance(fn, functools.partial):  # functools.wraps found no name on the partial
        wrapper.__name__ = qualname.rsplit(".", 1)[-1]
        wrapper.__qualname__ = qualname
    wrapper.__rlguard_contract__ = plan  # type: ignore[attr-defined]
    return wrapper
