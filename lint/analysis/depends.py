"""Data dependence: the roots a value is computed from, and whether two expressions are one value.

:func:`sources` walks a value back (the shared :class:`~rlguard.lint.analysis.values.Trace`: names, keys,
attributes, tuples, same-module helpers with their parameters bound) to the roots nothing in view computes: the
parameters of the function it sits in, the entries read off a parameter (``batch['input_ids']`` roots at
``batch``), globals and imports. Every operation a value passes through contributes its operands (a call its
receiver and arguments, a subscript its value and index, a comprehension its element and iterables), so the
answer over-approximates what a value depends on: two values with no common root are computed from different
things. ``self``/``cls`` are roots too; :data:`SHARED` names the roots that everything in a class or module
shares and that say nothing about a tensor's data.

:func:`same_value` says whether two expressions read the same binding: the same key path reached by the same
definitions (through the casts and moves that keep a tensor's values, ``.to(device)``, ``.long()``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import libcst as cst

from rlguard.lint.analysis import semantics as S
from rlguard.lint.analysis.index import Def, children, key_base, key_of
from rlguard.lint.analysis.values import Facet, Trace

if TYPE_CHECKING:
    from rlguard.lint.analysis import Analysis

EMPTY: frozenset = frozenset()
# Roots every method of a class (or every function of a module) shares: no evidence of a common tensor.
SHARED = frozenset({("param", "self"), ("param", "cls")})
# Methods that return the receiver's values in another dtype, device or layout.
_SAME_VALUES = frozenset({"to", "float", "double", "half", "bfloat16", "long", "int", "bool", "cpu", "cuda",
                          "contiguous", "detach", "clone"})


class SourceFacet(Facet):
    """The value: a frozenset of roots ``(kind, key)``: ``("param", name)``, ``("global", key)``."""

    unknown = EMPTY

    def __init__(self, a: "Analysis"):
        self.a = a

    def join(self, values):
        out: set = set()
        for v in values:
            out |= v
        return frozenset(out)

    def node(self, trace, expr, frame):
        if isinstance(expr, (cst.Attribute, cst.Subscript)) and key_of(expr) is not None:
            # an entry of a container: what the entry's own bindings give, and the container it is read off
            return trace.named(expr, frame) | trace.value(expr.value, frame)
        if isinstance(expr, (cst.Name, cst.IfExp)):
            return None
        if isinstance(expr, cst.Call):
            if self.a.callee(expr) is not None:
                return None  # a helper of this module: walked into
            found: set = set()
            recv = S.receiver(expr)
            if recv is not None and self.a.method(expr) is not None:
                found |= trace.value(recv, frame)
            for arg in expr.args:
                found |= trace.value(arg.value, frame)
            return frozenset(found)
        if isinstance(expr, (cst.Integer, cst.Float, cst.Imaginary, cst.SimpleString, cst.ConcatenatedString,
                             cst.FormattedString, cst.Ellipsis)):
            return EMPTY
        found = set()
        for part in _operands(expr):
            found |= trace.value(part, frame)
        return frozenset(found)

    def leaf(self, trace, expr, frame):
        key = key_of(expr)
        return frozenset({("global", key)}) if key else EMPTY

    def param(self, trace, d: Def, expr, frame):
        return frozenset({("param", d.key)})

    def opaque(self, trace, d: Def, expr):
        return frozenset({("global", d.key)})

    def item(self, trace, container, entry):
        return container

    def element(self, trace, whole, position):
        return whole

    def iterate(self, trace, iterable, d):
        return iterable

    def enter(self, trace, manager, d):
        return manager

    def aug(self, trace, before, op, operand, d):
        return before | operand


def _operands(expr: cst.CSTNode) -> list[cst.BaseExpression]:
    """The expressions directly inside ``expr`` whose values it is computed from (through argument, element,
    slice and comprehension wrappers)."""
    out = []
    stack = [expr]
    first = True
    while stack:
        node = stack.pop()
        if not first and isinstance(node, cst.BaseExpression):
            if not isinstance(node, cst.Lambda):
                out.append(node)
            continue
        first = False
        if isinstance(node, cst.Attribute):
            stack.append(node.value)
        elif isinstance(node, cst.Arg):
            stack.append(node.value)
        elif isinstance(node, cst.CompFor):
            stack.append(node.iter)
            stack.extend(i.test for i in node.ifs)
            if node.inner_for_in is not None:
                stack.append(node.inner_for_in)
        elif isinstance(node, (cst.ListComp, cst.SetComp, cst.GeneratorExp)):
            stack.extend([node.elt, node.for_in])
        elif isinstance(node, cst.DictComp):
            stack.extend([node.key, node.value, node.for_in])
        elif isinstance(node, cst.Call):
            stack.extend(node.args)
        elif isinstance(node, (cst.Element, cst.StarredElement, cst.DictElement, cst.StarredDictElement,
                               cst.SubscriptElement, cst.Index, cst.Slice, cst.ComparisonTarget,
                               cst.FormattedStringExpression, cst.BaseExpression)):
            for child in children(node):
                stack.append(child)
    return out


def source_trace(a: "Analysis") -> Trace:
    return a.facet("sources", lambda an: Trace(an, SourceFacet(an), budget=20000))


def sources(a: "Analysis", expr: cst.BaseExpression) -> frozenset:
    """The roots ``expr``'s value is computed from (see the module's docstring)."""
    return source_trace(a).value(expr)


def share_data(a: "Analysis", x: cst.BaseExpression, y: cst.BaseExpression) -> bool:
    """Whether ``x`` and ``y`` are computed from a common root other than ``self``/``cls`` and module globals."""
    common = {r for r in sources(a, x) & sources(a, y) if r[0] == "param" and r not in SHARED}
    return bool(common)


def strip_casts(a: "Analysis", expr: cst.BaseExpression) -> cst.BaseExpression:
    """``x`` of ``x.to(device).long()``."""
    while isinstance(expr, cst.Call) and a.method(expr) in _SAME_VALUES and S.receiver(expr) is not None:
        expr = S.receiver(expr)
    return expr


def resolve(a: "Analysis", expr: cst.BaseExpression, depth: int = 6) -> cst.BaseExpression:
    """What ``expr`` is bound to, through names with a single plain assignment and value-keeping casts
    (``ids = batch['input_ids'].to(dev)`` resolves ``ids`` to ``batch['input_ids']``)."""
    for _ in range(depth):
        expr = strip_casts(a, expr)
        key = key_of(expr) if isinstance(expr, cst.Name) else None
        if key is None:
            return expr
        defs = a.flow.reaching(key, expr)
        if len(defs) != 1 or defs[0].kind != "assign" or defs[0].element is not None or defs[0].value is None:
            return expr
        expr = defs[0].value
    return expr


def computed_from(a: "Analysis", expr: cst.BaseExpression, node: cst.CSTNode, depth: int = 8) -> bool:
    """Whether the value of ``expr`` is computed from the result of ``node`` (an expression of the same function):
    ``node`` is inside ``expr``, or a name, attribute path or key that ``expr`` reads is bound (through further
    bindings, tuple targets included) by an expression holding ``node``."""
    seen: set[int] = set()
    stack = [(expr, depth)]
    while stack:
        here, left = stack.pop()
        if here is node or a.contains(here, node):
            return True
        if left <= 0:
            continue
        reads = [here] if key_of(here) is not None else []
        reads += [n for n in a.index.descendants(here, cst.Name, cst.Attribute, cst.Subscript)
                  if key_of(n) is not None]
        for read in reads:
            for d in a.flow.reaching(key_of(read), read):
                if id(d) in seen or d.value is None or d.kind not in ("assign", "aug"):
                    continue
                seen.add(id(d))
                stack.append((d.value, left - 1))
    return False


def same_value(a: "Analysis", x: cst.BaseExpression, y: cst.BaseExpression) -> bool:
    """Whether ``x`` and ``y`` read the same binding (the same key path reached by the same definitions),
    after value-keeping casts and aliases; also two reads of the same entry of one container."""
    if x is None or y is None:
        return False
    for left, right in ((strip_casts(a, x), strip_casts(a, y)), (resolve(a, x), resolve(a, y))):
        kx, ky = key_of(left), key_of(right)
        if kx is None or kx != ky:
            continue
        dx = {id(d) for d in a.flow.reaching(kx, left)}
        dy = {id(d) for d in a.flow.reaching(ky, right)}
        if dx == dy and (dx or a.index.function_scope(left).node is a.index.function_scope(right).node):
            return True
        base = key_base(kx)
        if base != kx and {id(d) for d in a.flow.reaching(base, left)} == {id(d) for d in a.flow.reaching(base, right)}:
            return not dx and not dy
    return False


__all__ = ["SHARED", "computed_from", "resolve", "same_value", "share_data", "sources", "strip_casts"]
