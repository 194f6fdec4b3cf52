"""Records: the entries a function stores together into one dict-like value (capability class C3).

Trainers hand per-token tensors from the code that builds them to the code that consumes them in a record: a dict
literal bound to a name (``batch = {"labels": ..., "loss_mask": ...}``), entries added by ``batch.update({...})``
or ``batch.update(k=v)``, subscript stores ``batch["k"] = v``, ``dict(k=v)``, or a dict literal returned directly.
The tensors of one record are read together downstream (the loss scores ``labels`` and selects with
``loss_mask``), so their layouts must agree. This module only lists what is stored where; judging the entries
(their alignment, their roles) is the rules' business, through the shared value traces.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import libcst as cst

from rlguard.lint.analysis.index import key_of, string_key

if TYPE_CHECKING:
    from rlguard.lint.analysis import Analysis


@dataclass(frozen=True)
class RecordEntry:
    """``value`` stored under ``entry`` into the record ``record`` (a key path such as ``batch``, ``self.buf``, or
    ``<return>`` for a returned literal) inside ``function`` (None at module level); ``node`` is where to report."""

    function: cst.FunctionDef | None
    record: str
    entry: str
    value: cst.BaseExpression
    node: cst.CSTNode


def _literal(expr: cst.BaseExpression) -> str | None:
    if isinstance(expr, (cst.SimpleString, cst.ConcatenatedString)):
        value = expr.evaluated_value
        return value if isinstance(value, str) else None
    return None


def _dict_entries(expr: cst.BaseExpression) -> list[tuple[str, cst.BaseExpression, cst.CSTNode]] | None:
    """The constant-keyed entries of ``{"k": v}`` or ``dict(k=v)``; None when ``expr`` is neither."""
    if isinstance(expr, cst.Dict):
        out = []
        for el in expr.elements:
            if isinstance(el, cst.DictElement):
                key = _literal(el.key)
                if key is not None:
                    out.append((key, el.value, el))
        return out
    if isinstance(expr, cst.Call) and isinstance(expr.func, cst.Name) and expr.func.value == "dict":
        return [(arg.keyword.value, arg.value, arg) for arg in expr.args if arg.keyword is not None]
    return None


def record_entries(a: "Analysis") -> list[RecordEntry]:
    """Every constant-keyed entry stored into a record in the module, in source order."""
    def build(an: "Analysis") -> list[RecordEntry]:
        out: list[RecordEntry] = []
        for node in an.nodes(cst.Assign, cst.Return, cst.Call):
            if isinstance(node, cst.Assign):
                if len(node.targets) != 1:
                    continue
                target = node.targets[0].target
                entries = _dict_entries(node.value)
                if entries is not None:
                    record = key_of(target)
                    if record is not None:
                        out.extend(RecordEntry(an.enclosing_function(node), record, k, v, n) for k, v, n in entries)
                    continue
                if isinstance(target, cst.Subscript) and len(target.slice) == 1 and isinstance(
                        target.slice[0].slice, cst.Index):
                    entry = string_key(target.slice[0])
                    record = key_of(target.value)
                    if entry is not None and record is not None:
                        out.append(RecordEntry(an.enclosing_function(node), record, entry, node.value, node))
            elif isinstance(node, cst.Return):
                entries = _dict_entries(node.value) if node.value is not None else None
                if entries:
                    out.extend(RecordEntry(an.enclosing_function(node), "<return>", k, v, n) for k, v, n in entries)
            elif isinstance(node.func, cst.Attribute) and node.func.attr.value == "update":
                func = an.enclosing_function(node)
                record = key_of(node.func.value)
                if record is None:
                    continue
                for arg in node.args:
                    if arg.keyword is not None:
                        out.append(RecordEntry(func, record, arg.keyword.value, arg.value, arg))
                    elif not arg.star:
                        entries = _dict_entries(arg.value)
                        out.extend(RecordEntry(func, record, k, v, n) for k, v, n in entries or ())
        return out
    return a.facet("records", build)


def records_by_function(a: "Analysis") -> dict[tuple[int, str], list[RecordEntry]]:
    """The entries of :func:`record_entries` grouped by (function, record)."""
    def build(an: "Analysis"):
        groups: dict[tuple[int, str], list[RecordEntry]] = {}
        for e in record_entries(an):
            groups.setdefault((id(e.function), e.record), []).append(e)
        return groups
    return a.facet("records_by_function", build)


def splat_entry(a: "Analysis", call: cst.Call, key: str) -> cst.BaseExpression | None:
    """The value a ``**d`` argument of ``call`` hands on under ``key``, when ``d``'s one definition is a dict
    literal holding it (``inputs = {"input_ids": ids, ...}; model(**inputs)``)."""
    for arg in call.args:
        if arg.star != "**" or not isinstance(arg.value, cst.Name):
            continue
        defs = a.flow.reaching(arg.value.value, arg.value)
        if len(defs) == 1 and defs[0].kind == "assign" and isinstance(defs[0].value, cst.Dict):
            for el in defs[0].value.elements:
                if isinstance(el, cst.DictElement) and isinstance(el.key, cst.SimpleString) and \
                        el.key.evaluated_value == key:
                    return el.value
    return None


__all__ = ["RecordEntry", "record_entries", "records_by_function", "splat_entry"]
