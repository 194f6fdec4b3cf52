"""Uses: where a value goes (the forward counterpart of reaching definitions).

The flow analysis answers "which definitions reach this read"; rules that judge a value by what is done with it
(a mask built but never passed, a mask that only ever gates attention, a pad-id mask that something adds the stop
token back to) need the other direction:

- :func:`reads_of`: the reads of a name, ``self.x`` path or ``d['k']`` key that one definition reaches (a read
  that another definition may reach as well is still a read of this one);
- :func:`consumers`: the places a value is handed to, climbing through the operations that keep it what it is
  (dtype and device casts, ``detach``, ``view``/``unsqueeze``, slices such as ``m[:, 1:]``, parentheses, a
  conditional expression) and through the assignments that bind it to a name, whose reads are followed in turn.
  Each :class:`Use` says how the value is consumed: as a call's keyword or positional argument, as an operand,
  a dict entry or container element, a subscript index, the receiver of another method, a store into it
  (``m[...] = v``), a return, or a bare statement.

A use the walk cannot follow (a tuple target, a value that escapes into a container bound elsewhere) is reported
as the use it is, never dropped: a rule that needs "no other use" sees everything the value meets.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator

import libcst as cst

from rlguard.lint.analysis.index import Def, key_of, last_name

if TYPE_CHECKING:
    from rlguard.lint.analysis import Analysis

# Methods whose result is the receiver's value in another dtype, device or view: a mask stays a mask.
CARRY_METHODS = frozenset({"float", "double", "half", "bfloat16", "long", "int", "bool", "byte", "to", "type",
                           "type_as", "detach", "clone", "contiguous", "cpu", "cuda", "view", "reshape", "view_as",
                           "reshape_as", "unsqueeze", "squeeze", "expand", "expand_as", "requires_grad_"})


@dataclass(frozen=True)
class Use:
    """One place a value is consumed.

    ``kind``: ``keyword`` (``detail`` the keyword), ``argument`` (``detail`` the position, ``*``/``**`` for a
    splat), ``operand`` (``detail`` the operator's class name: ``Multiply``, ``BitAnd``, ``BitOr``...),
    ``compare``, ``entry`` (a dict literal's value, ``detail`` its literal key or None), ``element`` (of a list,
    tuple or set literal), ``index`` (the subscript of another value: ``x[m]``), ``method`` (``detail`` the method
    name, ``node`` the call), ``attribute`` (``detail`` the attribute read), ``store`` (an assignment into the
    value: ``m[i] = v``), ``return``, ``bound`` (an assignment target the walk does not follow), ``statement`` (a
    bare expression statement), ``other``. ``node`` is the consuming node, ``value`` the expression that carries
    the value into it, ``names`` the names the value was bound to on the way (innermost last)."""

    kind: str
    node: cst.CSTNode
    value: cst.BaseExpression
    detail: object = None
    names: tuple[str, ...] = ()


def reads_of(a: "Analysis", d: Def) -> list[cst.BaseExpression]:
    """The reads of ``d.key`` inside ``d``'s scope (nested comprehensions and functions included) that ``d``
    reaches, in source order."""
    cache = a.cache.setdefault("reads_of", {})
    hit = cache.get(id(d))
    if hit is not None:
        return hit
    index = a.index
    scope = d.scope
    key = d.key
    plain = "." not in key and "[" not in key
    kinds = (cst.Name,) if plain else (cst.Attribute, cst.Subscript)
    nodes = index.descendants(scope, *kinds) if not isinstance(scope, cst.Module) else a.nodes(*kinds)
    targets = _binding_targets(a)
    found = []
    for node in nodes:
        if key_of(node) != key or id(node) in targets or not _is_read(a, node):
            continue
        if any(r is d for r in a.flow.reaching(key, node)):
            found.append(node)
    cache[id(d)] = found
    return found


def _binding_targets(a: "Analysis") -> frozenset[int]:
    hit = a.cache.get("binding_targets")
    if hit is None:
        hit = a.cache["binding_targets"] = frozenset(
            id(d.target) for defs in a.index.stmt_defs.values() for d in defs
            if d.target is not None and d.kind != "aug")
    return hit


def _is_read(a: "Analysis", node: cst.CSTNode) -> bool:
    parent = a.index.parent_of(node)
    if isinstance(parent, cst.Attribute) and parent.attr is node:
        return False
    if isinstance(parent, cst.Arg) and parent.keyword is node:
        return False
    if isinstance(parent, (cst.Param, cst.FunctionDef, cst.ClassDef, cst.ImportAlias, cst.AsName,
                           cst.NameItem, cst.Global, cst.Nonlocal)):
        return False
    return True


def consumers(a: "Analysis", expr: cst.BaseExpression, depth: int = 4) -> list[Use]:
    """Where the value of ``expr`` goes (see the module's docstring)."""
    return list(_consumers(a, expr, depth, (), set()))


def _consumers(a: "Analysis", expr: cst.BaseExpression, depth: int, names: tuple[str, ...],
               seen: set[int]) -> Iterator[Use]:
    if id(expr) in seen:
        return
    seen.add(id(expr))
    index = a.index
    node: cst.CSTNode = expr
    while True:
        parent = index.parent_of(node)
        if parent is None:
            return
        kind = type(parent)
        # ----- carriers: the value goes on as itself ---------------------------------------------------------
        if kind is cst.Attribute and parent.value is node:
            call = index.parent_of(parent)
            if isinstance(call, cst.Call) and call.func is parent:
                if parent.attr.value in CARRY_METHODS:
                    node = call
                    continue
                yield Use("method", call, node, parent.attr.value, names)
                return
            yield Use("attribute", parent, node, parent.attr.value, names)
            return
        if kind is cst.Subscript and parent.value is node:
            target = index.parent_of(parent)
            if isinstance(target, (cst.AssignTarget,)) or (
                    isinstance(target, (cst.AugAssign, cst.AnnAssign)) and target.target is parent):
                yield Use("store", target, node, None, names)
                return
            if _slices_only(parent):
                node = parent
                continue
            yield Use("indexed", parent, node, None, names)
            return
        if kind is cst.IfExp and (parent.body is node or parent.orelse is node):
            node = parent
            continue
        if kind is cst.NamedExpr and parent.value is node:
            node = parent
            continue
        # ----- bindings: follow the reads of the name ------------------------------------------------------
        if kind in (cst.Assign, cst.AnnAssign) and parent.value is node:
            targets = [t.target for t in parent.targets] if kind is cst.Assign else [parent.target]
            for target in targets:
                key = key_of(target)
                defs = [d for d in index.stmt_defs.get(id(parent), ()) if d.key == key and d.target is target]
                if key is None or not defs or depth <= 0:
                    yield Use("bound", parent, node, None, names)
                    continue
                bare = last_name(key)
                for read in reads_of(a, defs[0]):
                    yield from _consumers(a, read, depth - 1, names + (bare,), seen)
            return
        # ----- consumers ---------------------------------------------------------------------------------------
        if kind is cst.Arg:
            call = index.parent_of(parent)
            if parent.keyword is not None:
                yield Use("keyword", call, node, parent.keyword.value, names)
            elif parent.star:
                yield Use("argument", call, node, parent.star, names)
            else:
                positional = [x for x in call.args if x.keyword is None and not x.star]
                position = next((i for i, x in enumerate(positional) if x is parent), None)
                yield Use("argument", call, node, position, names)
            return
        if kind is cst.BinaryOperation:
            yield Use("operand", parent, node, type(parent.operator).__name__, names)
            return
        if kind is cst.UnaryOperation:
            yield Use("operand", parent, node, type(parent.operator).__name__, names)
            return
        if kind is cst.BooleanOperation:
            yield Use("operand", parent, node, type(parent.operator).__name__, names)
            return
        if kind in (cst.Comparison, cst.ComparisonTarget):
            yield Use("compare", parent, node, None, names)
            return
        if kind is cst.AugAssign:
            yield Use("operand" if parent.value is node else "store", parent, node,
                      type(parent.operator).__name__, names)
            return
        if kind is cst.DictElement and parent.value is node:
            container = index.parent_of(parent)
            entry = parent.key.evaluated_value if isinstance(
                parent.key, (cst.SimpleString, cst.ConcatenatedString)) else None
            yield Use("entry", container, node, entry, names)
            return
        if kind in (cst.Element, cst.StarredElement):
            container = index.parent_of(parent)
            d = _unpacked_into(index, container, parent) if kind is cst.Element and depth > 0 else None
            if d is not None:
                # `lp, m = (lp[:, 1:], m[:, 1:])`: the element goes on under the target at its position
                for read in reads_of(a, d):
                    yield from _consumers(a, read, depth - 1, names + (last_name(d.key),), seen)
                return
            yield Use("element", container, node, None, names)
            return
        if kind in (cst.Index, cst.SubscriptElement, cst.Slice):
            sub = parent
            while sub is not None and not isinstance(sub, cst.Subscript):
                sub = index.parent_of(sub)
            yield Use("index", sub or parent, node, None, names)
            return
        if kind is cst.Return:
            func = a.enclosing_function(parent)
            yield Use("return", parent, node, func.name.value if func is not None else None, names)
            return
        if kind is cst.Expr:
            yield Use("statement", parent, node, None, names)
            return
        yield Use("other", parent, node, None, names)
        return


def _unpacked_into(index, container: cst.CSTNode, element: cst.Element) -> Def | None:
    """The binding that ``element`` of a tuple or list literal goes to in ``a, b = (x, y)``; None otherwise."""
    stmt = index.parent_of(container)
    if not (isinstance(container, (cst.Tuple, cst.List)) and isinstance(stmt, cst.Assign) and
            stmt.value is container and len(stmt.targets) == 1):
        return None
    target = stmt.targets[0].target
    if not isinstance(target, (cst.Tuple, cst.List)) or len(target.elements) != len(container.elements) or any(
            isinstance(el, cst.StarredElement) for el in (*target.elements, *container.elements)):
        return None
    position = next(i for i, el in enumerate(container.elements) if el is element)
    key = key_of(target.elements[position].value)
    return next((d for d in index.stmt_defs.get(id(stmt), ()) if d.key == key), None) if key is not None else None


def _slices_only(sub: cst.Subscript) -> bool:
    """``m[:, 1:]``, ``m[..., None]``, ``m[:, :-1]``: slices, ``None`` and ``...`` only (no index tensor)."""
    for el in sub.slice:
        inner = el.slice
        if isinstance(inner, cst.Slice):
            continue
        if isinstance(inner, cst.Index) and (isinstance(inner.value, cst.Ellipsis) or (
                isinstance(inner.value, cst.Name) and inner.value.value == "None")):
            continue
        return False
    return True


def def_consumers(a: "Analysis", d: Def, depth: int = 4) -> list[Use]:
    """Where the value bound by ``d`` goes: the consumers of each of its reads."""
    bare = last_name(d.key)
    found: list[Use] = []
    seen: set[int] = set()
    for read in reads_of(a, d):
        found += _consumers(a, read, depth, (bare,), seen)
    return found


__all__ = ["CARRY_METHODS", "Use", "consumers", "def_consumers", "reads_of"]
