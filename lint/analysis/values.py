"""The value walk shared by every analysis: from an expression back to what it is computed from.

An analysis (a *facet*: where a tensor sits on the time axis, which model forwards it comes from, the sign with
which a term enters it, ...) says what each operation does to its own abstract value; :class:`Trace` does the
rest, the same way for all of them:

- names, ``self.x`` attributes and dict keys are resolved through :class:`~rlguard.lint.analysis.flow.Flow`
  (the one reaching-definition query); several reaching definitions are *joined*;
- a tuple target reads its element of the value (``a, b = x, y``; ``a, b = helper()`` reads the helper's
  returned tuple); ``for``/comprehension targets are elements of their iterable; ``with f() as m`` is ``f()``
  entered; an augmented assignment combines the previous value with its operand;
- a dict key whose container was bound as a whole is read off that container's value (``d = {"m": v}``,
  ``dict(src, m=v)``, ``{k: v[rows] for k, v in src.items()}``), and so is an attribute of a constructed object
  (``Opts(tau=0.7).tau``, ``dataclasses.replace(cfg, tau=0.7).tau``);
- a call of a function of the same module (``helper(...)``, ``self.method(...)``, an instance's
  ``forward``/``__call__``) is walked into, its parameters bound to the call's arguments (a :class:`Frame`);
  a parameter with no binding asks the facet (:meth:`Facet.param`);
- a cycle, an exhausted budget or anything the facet does not know gives the facet's ``unknown``: a failed trace
  is unknown, never "what the name says".

Results are memoised per (expression, frame).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import libcst as cst

from rlguard.lint.analysis import semantics as S
from rlguard.lint.analysis.flow import ESCAPED
from rlguard.lint.analysis.index import Def, dotted_name, key_of, params_of, string_key

if TYPE_CHECKING:
    from rlguard.lint.analysis import Analysis

V = TypeVar("V")
MAX_FRAMES = 4  # helper calls walked into, nested
_PENDING = object()


@dataclass(frozen=True, eq=False)
class Frame:
    """A function walked into from a call site: its parameters bound to the call's arguments."""

    func: cst.FunctionDef | cst.Lambda
    call: cst.Call | None
    bindings: tuple[tuple[str, Any], ...]  # param -> (expression, caller frame) or ("item", container, key, frame)
    caller: "Frame | None"
    depth: int

    def binding(self, name: str):
        for param, value in self.bindings:
            if param == name:
                return value
        return None


class Facet(Generic[V]):
    """What one analysis computes. Subclasses override the hooks they need; the defaults say "unknown"."""

    unknown: V
    # whether a buffer holds what is written into it (``out = torch.full(...)`` then ``out[i, :n] = t``): true for
    # facets about where values come from, not for those about their layout (a filled slice is not the whole)
    buffer_fills: bool = False

    def join(self, values: list[V]) -> V:
        """The value of a name several definitions reach. Default: the common value, else unknown."""
        first = values[0] if values else self.unknown
        return first if all(v == first for v in values) else self.unknown

    def node(self, trace: "Trace", expr: cst.BaseExpression, frame: Frame | None) -> V | None:
        """The value of an expression that is not a name, key or helper call (calls, operators, subscripts...);
        None to let :class:`Trace` handle it (names, ``IfExp``, helper calls) or give ``unknown``."""
        return None

    def leaf(self, trace: "Trace", expr: cst.BaseExpression, frame: Frame | None) -> V:
        """A name, attribute or key that nothing in view binds (a global, ``obj.x`` of an unknown object)."""
        return self.unknown

    def param(self, trace: "Trace", d: Def, expr: cst.BaseExpression, frame: Frame | None) -> V:
        """A parameter with no caller binding."""
        return self.unknown

    def opaque(self, trace: "Trace", d: Def, expr: cst.BaseExpression) -> V:
        """A definition that carries no expression (an import, a function statement, ``except ... as``)."""
        return self.unknown

    def unknown_container(self, trace: "Trace", expr: cst.BaseExpression, frame: Frame | None) -> V:
        """A container whose value is unknown (what an unplaced call returned), read for one of its entries: two
        entries of it still come from the one container ``expr``."""
        return self.unknown

    def element(self, trace: "Trace", whole: V, position: int) -> V:
        """Element ``position`` of a value unpacked into a tuple target (the value's expression unknown)."""
        return self.unknown

    def call_element(self, trace: "Trace", call: cst.Call, position: int, frame: Frame | None) -> V | None:
        """Element ``position`` of what a call the walk cannot enter returns (a function of another file), when the
        facet knows it from the callee's summary; None: :meth:`element` of the whole value."""
        return None

    def iterate(self, trace: "Trace", iterable: V, d: Def) -> V:
        """The target of ``for x in <iterable>`` (or a comprehension)."""
        return self.unknown

    def enter(self, trace: "Trace", manager: V, d: Def) -> V:
        """``with <manager> as x``."""
        return self.unknown

    def aug(self, trace: "Trace", before: V, op: cst.BaseAugOp, operand: V, d: Def) -> V:
        """``x op= operand``."""
        return self.unknown

    def item(self, trace: "Trace", container: V, key: str) -> V:
        """``c[key]`` / ``c.key`` of a container whose value is known but whose expression has no such entry."""
        return self.unknown

    def defined(self, trace: "Trace", d: Def, value: V) -> V:
        """The value a name has after definition ``d``, given the value computed for it (a facet may record the
        statement it passed through)."""
        return value

    def helper(self, trace: "Trace", call: cst.Call, returns: list[V], frame: Frame | None) -> V:
        """The result of a same-module helper call, from the values of its returns (in the helper's frame)."""
        return self.join(returns) if returns else self.unknown


class Trace(Generic[V]):
    """One facet's walk over one module (memoised; share an instance across queries of the same facet)."""

    def __init__(self, analysis: "Analysis", facet: Facet[V], budget: int = 4000):
        self.a = analysis
        self.facet = facet
        self.budget = budget
        self._memo: dict[tuple[int, int], Any] = {}
        # frames are interned: memo keys hold their ids, so a frame must live as long as the trace
        self._frames: dict[tuple, Frame] = {}
        self._entries: set[tuple] = set()  # (container, entry, frame) of the entry_of calls in progress

    # ----- entry point ----------------------------------------------------------------------------------------
    def value(self, expr: cst.BaseExpression | None, frame: Frame | None = None) -> V:
        if expr is None:
            return self.facet.unknown
        key = (id(expr), id(frame))
        hit = self._memo.get(key, None)
        if hit is _PENDING:
            return self.facet.unknown  # a cycle
        if hit is not None or key in self._memo:
            return hit
        self.budget -= 1
        if self.budget < 0:
            return self.facet.unknown
        self._memo[key] = _PENDING
        try:
            result = self._value(expr, frame)
        except RecursionError:
            result = self.facet.unknown
        self._memo[key] = result
        return result

    def _value(self, expr: cst.BaseExpression, frame: Frame | None) -> V:
        facet = self.facet
        handled = facet.node(self, expr, frame)
        if handled is not None:
            return handled
        if isinstance(expr, (cst.Name, cst.Attribute, cst.Subscript)) and key_of(expr) is not None:
            return self.named(expr, frame)
        if isinstance(expr, cst.IfExp):
            return facet.join([self.value(expr.body, frame), self.value(expr.orelse, frame)])
        if isinstance(expr, cst.Call):
            result = self.helper_call(expr, frame)
            if result is not None:
                return result
            result = self.keyed_read(expr, frame)
            if result is not None:
                return result
        return facet.unknown

    def keyed_read(self, call: cst.Call, frame: Frame | None) -> V | None:
        """``d.get("k")``, ``d.pop("k")``, ``d.get("k", default)``: read like ``d["k"]`` (with a default, joined
        with it); None when ``call`` is not such a read of a container with a key path."""
        func = call.func
        if not (type(func) is cst.Attribute and func.attr.value in ("get", "pop") and 1 <= len(call.args) <= 2):
            return None
        first = call.args[0]
        if first.keyword is not None or first.star or not isinstance(
                first.value, (cst.SimpleString, cst.ConcatenatedString)):
            return None
        entry = first.value.evaluated_value
        base = key_of(func.value)
        if not isinstance(entry, str) or base is None:
            return None
        key = f"{base}[{entry!r}]"
        defs = self.a.flow.reaching(key, call)
        if defs:
            value = self.facet.join([self.facet.defined(self, d, self.def_value(d, key, call, frame)) for d in defs])
        else:
            value = self.entry_of(func.value, entry, frame)
        if len(call.args) == 2:
            default = call.args[1].value
            if isinstance(default, cst.Name) and default.value == "None":
                return value
            return self.facet.join([value, self.value(default, frame)])
        return value

    # ----- names, attributes, keys ----------------------------------------------------------------------------
    def named(self, expr: cst.BaseExpression, frame: Frame | None) -> V:
        """A name, ``self.x`` / ``obj.x`` attribute or ``d['k']`` key, through its reaching definitions."""
        key = key_of(expr)
        if key is None:
            return self.facet.unknown
        defs = self.a.flow.reaching(key, expr)
        if not defs:
            if isinstance(expr, (cst.Attribute, cst.Subscript)):
                return self.container_entry(expr, frame)
            return self.facet.leaf(self, expr, frame)
        values = [self.facet.defined(self, d, self.def_value(d, key, expr, frame)) for d in defs]
        return self.facet.join(values)

    def bound(self, binding) -> V:
        if binding[0] == "item":
            _, container, entry, caller = binding
            return self.entry_of(container, entry, caller)
        expr, caller = binding
        return self.value(expr, caller)

    def def_value(self, d: Def, key: str, at: cst.CSTNode, frame: Frame | None) -> V:
        """The value ``key`` has after definition ``d`` (``d`` may bind a container of ``key``)."""
        facet = self.facet
        if d is ESCAPED:
            return facet.unknown
        if d.key != key:  # the container of the key path was bound as a whole
            return self.entry_of_def(d, key[len(d.key):], frame)
        if d.kind == "assign":
            if d.element is None:
                grown = list_growth(self.a, d)
                if grown:  # `xs = []` filled by `xs.append(v)`: the list holds what was appended
                    return facet.join([self.value(x, frame) for x in grown])
                if facet.buffer_fills:
                    written = buffer_fills(self.a, d)
                    if written:  # `out = torch.full(...)` then `out[i][s] = t`: the buffer holds what went in
                        return facet.join([self.value(d.value, frame)] + [self.value(x, frame) for x in written])
                return self.value(d.value, frame)
            return self.element_of(d.value, d.element, frame)
        if d.kind == "param":
            if frame is not None and d.scope is frame.func:
                bound = frame.binding(d.key)
                if bound is not None:
                    return self.bound(bound)
            return facet.param(self, d, at, frame)
        if d.kind == "aug":
            memo_key = (id(d), id(frame), "aug")
            hit = self._memo.get(memo_key, None)
            if hit is _PENDING:
                return facet.unknown  # `x += y` in a loop reaches itself: the cycle is unknown
            if hit is not None or memo_key in self._memo:
                return hit
            self._memo[memo_key] = _PENDING
            before = [p for p in self.a.flow.reaching(key, d.stmt) if p is not d]
            prev = facet.join([self.def_value(p, key, d.stmt, frame) for p in before]) if before else facet.unknown
            result = facet.aug(self, prev, d.op, self.value(d.value, frame), d)
            self._memo[memo_key] = result
            return result
        if d.kind == "comp" and frame is not None and d.scope is frame.func:
            bound = frame.binding(d.key)  # `{k: f(v) for k, v in src.items()}['k']`: `v` is `src['k']`
            if bound is not None:
                return self.bound(bound)
        if d.kind in ("for", "comp"):
            iterable = self.value(d.value, frame)
            return facet.iterate(self, iterable, d)
        if d.kind == "with":
            return facet.enter(self, self.value(d.value, frame), d)
        return facet.opaque(self, d, at)

    def element_of(self, value: cst.BaseExpression, position: int, frame: Frame | None) -> V:
        """Element ``position`` of ``value`` unpacked into a tuple target."""
        if isinstance(value, (cst.Tuple, cst.List)):
            elements = value.elements
            if position < len(elements) and not isinstance(elements[position], cst.StarredElement):
                return self.value(elements[position].value, frame)
            return self.facet.unknown
        if isinstance(value, cst.Call):
            func = self.a.callee(value)
            if func is not None:
                inner = self.enter_frame(func, value, frame)
                if inner is not None:
                    returns = [r.value for r in self.a.index.scopes[id(func)].returns if r.value is not None]
                    picked = [self.element_of(r, position, inner) for r in returns]
                    return self.facet.join(picked) if picked else self.facet.unknown
            else:
                placed = self.facet.call_element(self, value, position, frame)
                if placed is not None:
                    return placed
        if isinstance(value, (cst.Name, cst.Attribute)):
            key = key_of(value)
            defs = self.a.flow.reaching(key, value) if key else []
            if defs and all(d.kind == "assign" and d.element is None for d in defs):
                return self.facet.join([self.element_of(d.value, position, frame) for d in defs])
        return self.facet.element(self, self.value(value, frame), position)

    # ----- containers ----------------------------------------------------------------------------------------
    def entry_of_def(self, d: Def, rest: str, frame: Frame | None) -> V:
        """``rest`` (``['k']`` or ``.attr``, possibly longer) of the value bound by ``d``."""
        entry, tail = _first_entry(rest)
        if d.kind == "assign" and d.element is None and d.value is not None and not tail:
            return self.entry_of(d.value, entry, frame)
        if d.kind == "assign" and d.element is not None and d.value is not None and not tail:
            # `out, aux = f(x)` then `out.logits`: the entry of what the element holds
            return self.facet.item(self, self.element_of(d.value, d.element, frame), entry)
        return self.facet.unknown

    def container_entry(self, expr: cst.Attribute | cst.Subscript, frame: Frame | None) -> V:
        """``c.x`` / ``c['k']`` where nothing binds the path itself: the entry of ``c``'s value."""
        if isinstance(expr, cst.Attribute):
            return self.entry_of(expr.value, expr.attr.value, frame)
        entry = string_key(expr.slice[0]) if len(expr.slice) == 1 else None
        if entry is None:
            return self.facet.unknown
        return self.entry_of(expr.value, entry, frame)

    def entry_of(self, container: cst.BaseExpression, entry: str, frame: Frame | None) -> V:
        """The entry ``entry`` (a dict key or an attribute name) of the value of ``container``: read off the
        expression that built it when that is in view, else the facet's :meth:`Facet.item` of its value."""
        facet = self.facet
        if isinstance(container, cst.Dict):
            for el in container.elements:
                if isinstance(el, cst.StarredDictElement):
                    return facet.unknown  # {**other, ...}: the key may come from the splat
                if isinstance(el.key, (cst.SimpleString, cst.ConcatenatedString)) and el.key.evaluated_value == entry:
                    return self.value(el.value, frame)
            return facet.unknown
        if isinstance(container, cst.Call):
            for arg in container.args:
                if arg.keyword is not None and arg.keyword.value == entry:
                    return self.value(arg.value, frame)
            name = (self.a.call_name(container) or "").rsplit(".", 1)[-1]
            first = container.args[0] if container.args else None
            if name in ("dict", "replace") and first is not None and first.keyword is None and not first.star:
                return self.entry_of(first.value, entry, frame)
            field_value = self.a.positional_field(container, entry)
            if field_value is not None:
                return self.value(field_value, frame)
        if isinstance(container, cst.DictComp):
            return self._dict_comp_entry(container, entry, frame)
        key = key_of(container) if isinstance(container, (cst.Name, cst.Attribute, cst.Subscript)) else None
        if key is not None:
            active = (id(container), entry, id(frame))
            if active in self._entries:
                # `x = x.attr` in a loop: the entry's definition reads the same entry again with no value() in
                # between (whose memo would cut the cycle); end it as the stack overflow did, at the nearest value()
                raise _EntryCycle(key)
            self._entries.add(active)
            try:
                defs = self.a.flow.reaching(key, container)
                parts = []
                for d in defs:
                    if d is ESCAPED:
                        return facet.unknown
                    if d.key == key and d.kind == "assign" and d.element is None:
                        parts.append(self.entry_of(d.value, entry, frame))
                        continue
                    bound = frame.binding(d.key) if (frame is not None and d.kind == "param"
                                                     and d.scope is frame.func) else None
                    if bound is not None and bound[0] != "item":
                        parts.append(self.entry_of(bound[0], entry, bound[1]))
                    else:
                        parts.append(facet.item(self, self.def_value(d, key, container, frame), entry))
                if parts:
                    return facet.join(parts)
            finally:
                self._entries.discard(active)
        whole = self.value(container, frame)
        if whole is facet.unknown:
            whole = facet.unknown_container(self, container, frame)
        return facet.item(self, whole, entry)

    def _dict_comp_entry(self, comp: cst.DictComp, entry: str, frame: Frame | None) -> V:
        """``{k: f(v) for k, v in src.items()}['entry']`` is ``f(src['entry'])``."""
        loop = comp.for_in
        target = loop.target
        iterable = loop.iter
        if loop.inner_for_in is not None or not (isinstance(target, cst.Tuple) and len(target.elements) == 2):
            return self.facet.unknown
        if not (isinstance(iterable, cst.Call) and isinstance(iterable.func, cst.Attribute)
                and iterable.func.attr.value == "items" and not iterable.args):
            return self.facet.unknown
        key_var, value_var = (el.value for el in target.elements)
        if not (isinstance(key_var, cst.Name) and isinstance(value_var, cst.Name) and isinstance(comp.key, cst.Name)
                and comp.key.value == key_var.value):
            return self.facet.unknown
        src = iterable.func.value
        key = (id(comp), entry, id(frame))
        inner = self._frames.get(key)
        if inner is None:
            inner = self._frames[key] = Frame(comp, None, ((value_var.value, ("item", src, entry, frame)),), frame,
                                              (frame.depth if frame else 0))
        return self.value(comp.value, inner)

    # ----- calls ---------------------------------------------------------------------------------------------
    def helper_call(self, call: cst.Call, frame: Frame | None) -> V | None:
        """The value of a call of a function of this module, walked into; None when it is not one."""
        func = self.a.callee(call)
        if func is None:
            return None
        inner = self.enter_frame(func, call, frame)
        if inner is None:
            return self.facet.unknown
        returns = [self.value(r.value, inner) for r in self.a.index.scopes[id(func)].returns if r.value is not None]
        return self.facet.helper(self, call, returns, frame)

    def enter_frame(self, func: cst.FunctionDef, call: cst.Call, frame: Frame | None) -> Frame | None:
        depth = frame.depth + 1 if frame else 1
        if depth > MAX_FRAMES or (frame is not None and _on_stack(frame, func)) or self.a.index.contains(func, call):
            return None
        key = (id(func), id(call), id(frame))
        found = self._frames.get(key)
        if found is None:
            found = self._frames[key] = Frame(func, call, bind_arguments(func, call, frame), frame, depth)
        return found


class _EntryCycle(RecursionError):
    """An entry read that needs itself; :meth:`Trace.value` catches it as it catches a real overflow."""


def bind_arguments(func: cst.FunctionDef, call: cst.Call, frame: Frame | None) -> tuple:
    """The call's arguments by parameter name (``self`` skipped for a method called as ``obj.method(...)``)."""
    params = [p.name.value for p in params_of(func.params)]
    positional_names = [p.name.value for p in (*func.params.posonly_params, *func.params.params)]
    if positional_names and positional_names[0] in ("self", "cls") and (
            isinstance(call.func, cst.Attribute) or _is_constructor_call(call)):
        positional_names = positional_names[1:]
    bound: list[tuple[str, Any]] = []
    positional = [a for a in call.args if a.keyword is None and not a.star]
    if any(a.star for a in call.args if a.keyword is None):
        positional = positional  # a *args splat: bind what precedes it only
    for name, arg in zip(positional_names, positional):
        bound.append((name, (arg.value, frame)))
    for arg in call.args:
        if arg.keyword is not None and arg.keyword.value in params:
            bound.append((arg.keyword.value, (arg.value, frame)))
    return tuple(bound)


def _is_constructor_call(call: cst.Call) -> bool:
    return isinstance(call.func, cst.Name) and call.func.value[:1].isupper()


def _on_stack(frame: Frame | None, func) -> bool:
    while frame is not None:
        if frame.func is func:
            return True
        frame = frame.caller
    return False


def _first_entry(rest: str) -> tuple[str, str]:
    """``['k'].x`` -> ("k", ".x"); ``.attr['k']`` -> ("attr", "['k']")."""
    if rest.startswith("."):
        body = rest[1:]
        for i, ch in enumerate(body):
            if ch in ".[":
                return body[:i], body[i:]
        return body, ""
    if rest.startswith("["):
        quote = rest[1]
        end = rest.index(quote + "]", 2)
        return rest[2:end], rest[end + 2:]
    return rest, ""


__all__ = ["Facet", "Frame", "Trace", "bind_arguments", "dotted_name"]


# ----- lists filled after they are bound -----------------------------------------------------------------------------
_GROWING = {"append": 0, "insert": 1, "extend": 0}


def _empty_list(expr: cst.BaseExpression | None) -> bool:
    if isinstance(expr, cst.List):
        return not expr.elements
    return isinstance(expr, cst.Call) and not expr.args and dotted_name(expr.func) == "list"


def list_growth(a: "Analysis", d: Def) -> list[cst.BaseExpression]:
    """The values put into the empty list bound by ``d`` (``xs = []``) in its own function: the argument of each
    ``xs.append(v)`` / ``xs.insert(i, v)``, the iterable of ``xs.extend(vs)``, where ``d`` reaches ``xs``. A list
    built in a loop (``all_logps.append(logps)`` then ``torch.cat(all_logps)``) carries what went into it."""
    if not _empty_list(d.value):
        return []
    calls = a.facet("list_growth", _growth_calls).get(d.key)
    if not calls:
        return []
    index = a.index
    scope = index.function_scope(d.stmt).node
    return [value for recv, value in calls
            if index.function_scope(recv).node is scope and any(r is d for r in a.flow.reaching(d.key, recv))]


def buffer_fills(a: "Analysis", d: Def) -> list[cst.BaseExpression]:
    """The values written into the tensor buffer bound by ``d`` (``out = torch.full(shape, pad)``,
    ``x.new_zeros(n)``) by element stores of its own function after it (``out[i][s] = t``, ``out[:, :n] = t``)
    that ``d`` reaches."""
    value = d.value
    if not isinstance(value, cst.Call) or not (
            a.call_name(value) in S.BUFFER_FUNCTIONS or a.method(value) in S.BUFFER_METHODS):
        return []
    scope = a.index.function_scope(d.stmt)
    stores = scope.defs.get(d.key + "[?]", ())
    out = []
    for store in stores:
        if store.order <= d.order or store.value is None or store.target is None:
            continue
        root = store.target
        while isinstance(root, cst.Subscript):
            root = root.value
        if any(r is d for r in a.flow.reaching(d.key, root)):
            out.append(store.value)
    return out


def _growth_calls(a: "Analysis") -> dict[str, list[tuple[cst.BaseExpression, cst.BaseExpression]]]:
    """key -> (receiver, value put in) for every ``key.append(v)`` / ``insert`` / ``extend`` call of the module."""
    found: dict[str, list[tuple[cst.BaseExpression, cst.BaseExpression]]] = {}
    for call in a.nodes(cst.Call):
        func = call.func
        if type(func) is not cst.Attribute:
            continue
        position = _GROWING.get(func.attr.value)
        if position is None or len(call.args) != position + 1 or call.args[position].keyword is not None \
                or call.args[position].star:
            continue
        key = key_of(func.value)
        if key is not None:
            found.setdefault(key, []).append((func.value, call.args[position].value))
    return found
