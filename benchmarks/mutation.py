"""Mutation recall: put one catalog fault into correct, real trainer code and check that ``rlguard lint`` reports it.

A *site* (``mutation_sites.toml`` for development, ``mutation_sites_validation.toml`` for validation; the part is
the one its repository has in ``ecosystem.toml``) names a function of a public repository at the commit pinned in
``ecosystem.toml``, a line, a mutation operator with small parameters (names, indices) and the catalog code the
mutant should raise. No third-party code is stored: the engine reads the file from the local bare mirror, applies
the operator with libcst, and lints the original and the mutant in the same extracted tree (a private copy of the
repository's ``.py`` files under ``--work``; the mutant replaces the one file while it is linted, so calls into
other files see the same folder context). Only the mutated file is passed to the linter: its cross-file context
(callee summaries) is loaded on demand from the source roots, exactly as in a whole-tree run.

A mutant is CAUGHT (OK) when a finding with the site's code lies inside the mutated function (its line ranges in
the mutant) and the original has no finding of that code inside the function. Other outcomes: MISSED,
ORIGINAL-FLAGGED (the original already has the finding: the site proves nothing), INVALID-SITE (the operator
found no target at that line, or the mutant does not parse or equals the original), INTERNAL-ERROR (an RLG902
finding or an exception from the linter on either side). A site with ``harmless = "<why>"`` names a mutant that does
not produce the fault, found by reading the code after the site was chosen (the reference it un-detaches is frozen
where it is built, so the catalog's runtime check would pass): it counts neither as caught nor as missed; HARMLESS
when nothing is reported, HARMLESS-FLAGGED (a false alarm) when the code is.

    python benchmarks/mutation.py --mirrors DIR                       # every site, both parts
    python benchmarks/mutation.py --mirrors DIR --part development -v # one line per site with the finding
    python benchmarks/mutation.py --mirrors DIR --only trl --fuzz 3   # plus 3 random mutants per operator/site
    python benchmarks/mutation.py --mirrors DIR --preview --code RLG016 # one code, preview rules on
    python benchmarks/mutation.py --mirrors DIR --write               # update docs/benchmarks.md

``--fuzz N`` is a robustness pass: for each site, each operator that applies somewhere in the site's function is
applied at up to N other places (seeded, ``--seed``), the mutant linted, and any RLG902 or exception counted as
a failure (the catch of these random mutants is not judged: they are not faults of the catalog in general).

Operators (parameters in brackets; ``occurrence`` is 1-based, left to right on the line):

- ``flip_sign`` [occurrence]: the n-th binary ``+``/``-`` (or ``+=``/``-=``) on the line becomes the other;
- ``drop_negation`` [occurrence]: the n-th unary minus on the line is removed (``-x`` -> ``x``);
- ``swap_min_max`` [occurrence]: ``min``<->``max`` in a call (``torch.min``, ``x.min()``, ``min()``,
  ``torch.minimum``, ``amin``, ``clamp_min``...);
- ``remove_no_grad``: the ``with torch.no_grad()`` / ``inference_mode()`` / ``set_grad_enabled(False)`` item
  starting on the line is dropped (the with statement is replaced by its body when it has no other item), or
  the decorator of that kind on the line is dropped;
- ``remove_detach`` [occurrence]: ``x.detach()`` / ``x.detach_()`` -> ``x`` (``attr = "data"``: ``x.data`` -> ``x``);
- ``shift_mask`` [occurrence, name, delta=-1]: the n-th subscript on the line (of a value named ``name`` if
  given) with a slice: its last bounded slice moves ``delta`` tokens (``[:, 1:]`` -> ``[:, :-1]``,
  ``[:, -L:]`` -> ``[:, -L - 1:-1]``);
- ``remove_shift`` [which=logits|labels|both|roll, labels_line, name, labels_name]: the logits shift (a slice
  ending at -1: ``[:, :-1]`` -> the whole axis, ``[:, -L - 1:-1]`` -> ``[:, -L:]``) and/or the labels shift
  (``[:, 1:]`` -> the whole axis) on the line is removed (the labels one on ``labels_line`` when it is on
  another line); ``which = "roll"``: labels rolled one left, ``torch.roll(ids, shifts=-1, dims=1)`` -> ``ids``;
- ``remove_zero_grad``: the ``*.zero_grad(...)`` statement on the line is deleted (``pass`` when it was alone);
- ``alias_reference`` [policy, keyword]: the value assigned on the line (or passed as ``keyword=`` there) becomes
  the name ``policy`` (a dotted name such as ``self.model``);
- ``batch_mean`` [occurrence]: the dim/axis (and keepdim) arguments of the ``mean``/``std``/``var`` calls on the
  line are removed (all of them unless ``occurrence`` picks one): a group statistic becomes the batch's;
- ``drop_temperature`` [occurrence]: ``logits / T`` -> ``logits``; ``logits /= T`` and ``logits.div_(T)``
  statements deleted; ``logits.div(T)`` -> ``logits``;
- ``move_old_logp_into_loop`` [loop_line]: the statement starting on the line (the old log-probs computed once
  before the update loop, a ``with torch.no_grad():`` block included) is moved to the start of the body of the
  loop starting on ``loop_line``: recomputed from the current weights at every epoch/minibatch;
- ``local_count`` [mask, occurrence]: the divisor of the n-th ``/`` on the line (a token count computed for the
  whole minibatch before the microbatch loop) becomes ``mask.sum()`` (the microbatch's own count);
- ``seq_mean`` [keyword=dim]: a token mean over the batch becomes a mean over sequences of per-sequence token
  means: ``(x * m).sum() / m.sum()`` -> ``((x * m).sum(-1) / m.sum(-1)).mean()``, or a ``*mean*(x, m)`` helper
  call -> ``*mean*(x, m, dim=-1).mean()``;
- ``drop_attention_mask`` [keyword=attention_mask, occurrence]: the ``keyword=`` argument of a call on the line, or
  the ``"keyword"`` entry of a dict literal on the line (a dict splatted into the forward), is removed: a model
  forward on padded or packed ids without its mask;
- ``pad_as_eos`` [tokenizer, where=function|line]: ``<tokenizer>.pad_token = <tokenizer>.eos_token`` is inserted as
  the first statement of the function holding the line (after its docstring; ``where = "line"``, or a line at
  module level: just before the statement holding the line), so a mask or labels built from the pad id on the line
  (``ids != tok.pad_token_id``, ``ignore_index=tok.pad_token_id``) also drop the EOS; ``tokenizer`` defaults to the
  object whose ``.pad_token_id`` the line reads;
- ``remove_eval`` [occurrence]: the ``*.eval()`` / ``*.train(False)`` statement on the line is deleted, or the
  ``.eval()`` call in a chain on the line is removed (``copy.deepcopy(m).eval()`` -> ``copy.deepcopy(m)``): a
  reference, old-policy or value forward scored in train mode;
- ``filter_one_field`` [name, occurrence]: the row selection ``x[idx]`` (``x[idx, ...]``; an index tensor, not a
  slice or a constant) on the line is removed from that one field (``x = x[idx]`` is deleted), where ``idx`` or a
  name it is built from is used elsewhere in the function (the other fields keep the selection): rows out of step.

``--fuzz-operator OP`` (repeatable) restricts the fuzz pass to some operators.
"""

from __future__ import annotations

import argparse
import ast
import datetime
import json
import os
import random
import re
import sys
import time
import traceback
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

import libcst as cst
from libcst.metadata import MetadataWrapper, PositionProvider

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
import snapshots  # noqa: E402

REPOS = HERE / "ecosystem.toml"
SITE_FILES = (HERE / "mutation_sites.toml", HERE / "mutation_sites_validation.toml")
DOC = ROOT / "docs" / "benchmarks.md"
SECTION = "## Mutation recall"
SITE_KEYS = {"repo", "path", "function", "line", "operator", "code", "note"}
# optional: why the mutant does not produce the fault (the catalog's runtime check would pass on it)
OPTIONAL_KEYS = {"harmless"}
STATUSES = ("OK", "MISSED", "ORIGINAL-FLAGGED", "INVALID-SITE", "INTERNAL-ERROR", "HARMLESS", "HARMLESS-FLAGGED")
INTERNAL = "RLG902"


class InvalidSite(Exception):
    """The operator found no target where the site says, or the mutant is not a program."""


# ----- operators -------------------------------------------------------------------------------------------------

class Source:
    """A parsed file with the position of every node."""

    def __init__(self, text: str):
        self.text = text
        self.wrapper = MetadataWrapper(cst.parse_module(text))
        self.module = self.wrapper.module
        self.pos = self.wrapper.resolve(PositionProvider)
        self.nodes: list[cst.CSTNode] = []
        module = self.module

        class Collect(cst.CSTVisitor):
            def on_visit(inner, node: cst.CSTNode) -> bool:  # noqa: N805
                self.nodes.append(node)
                return True

        module.visit(Collect())
        self.parents: dict[int, cst.CSTNode] = {}
        for node in self.nodes:
            for child in node.children:
                self.parents[id(child)] = node

    def start(self, node: cst.CSTNode) -> tuple[int, int]:
        p = self.pos[node].start
        return p.line, p.column

    def line_of(self, node: cst.CSTNode) -> int:
        return self.pos[node].start.line

    def on_line(self, line: int, kind=cst.CSTNode) -> list[cst.CSTNode]:
        return sorted((n for n in self.nodes if isinstance(n, kind) and n in self.pos and self.line_of(n) == line),
                      key=self.start)

    def code(self, node: cst.CSTNode) -> str:
        return self.module.code_for_node(node)


Edit = dict  # id(original node) -> replacement (node, RemovalSentinel, FlattenSentinel) or callable(updated)


class Apply(cst.CSTTransformer):
    def __init__(self, edits: dict[int, object], prepend: dict[int, list[cst.BaseStatement]] | None = None):
        super().__init__()
        self.edits = edits
        self.prepend = prepend or {}
        self.done: set[int] = set()

    def on_leave(self, original_node, updated_node):
        key = id(original_node)
        out = updated_node
        if key in self.prepend and isinstance(out, (cst.For, cst.While)):
            body = out.body
            if isinstance(body, cst.SimpleStatementSuite):
                body = cst.IndentedBlock(body=[cst.SimpleStatementLine(body=list(body.body))])
            out = out.with_changes(body=body.with_changes(body=[*self.prepend[key], *body.body]))
            self.done.add(key)
        if key in self.edits:
            self.done.add(key)
            repl = self.edits[key]
            out = repl(out) if callable(repl) else repl
        if isinstance(out, cst.IndentedBlock) and not out.body:
            out = out.with_changes(body=[cst.SimpleStatementLine(body=[cst.Pass()])])
        if isinstance(out, cst.SimpleStatementSuite) and not out.body:
            out = out.with_changes(body=[cst.Pass()])
        return out


def pick(cands: list, params: dict, what: str, line: int, default_all: bool = False) -> list:
    if not cands:
        raise InvalidSite(f"no {what} on line {line}")
    occ = params.get("occurrence")
    if occ is None:
        return cands if default_all else cands[:1]
    if not 1 <= occ <= len(cands):
        raise InvalidSite(f"occurrence {occ} of {what} on line {line}: only {len(cands)}")
    return [cands[occ - 1]]


def dotted(node: cst.CSTNode) -> str | None:
    if isinstance(node, cst.Name):
        return node.value
    if isinstance(node, cst.Attribute):
        base = dotted(node.value)
        return f"{base}.{node.attr.value}" if base else None
    return None


def names_in(node: cst.CSTNode) -> set[str]:
    out: set[str] = set()

    class V(cst.CSTVisitor):
        def visit_Name(self, n: cst.Name) -> None:
            out.add(n.value)

        def visit_Attribute(self, n: cst.Attribute) -> None:
            out.add(n.attr.value)

        def visit_SimpleString(self, n: cst.SimpleString) -> None:
            out.add(n.value.strip("'\""))

    node.visit(V())
    return out


def paren_like(new: cst.BaseExpression, old: cst.BaseExpression) -> cst.BaseExpression:
    """``new`` with the parentheses ``old`` had around it added."""
    if getattr(old, "lpar", None) and hasattr(new, "lpar"):
        return new.with_changes(lpar=[*old.lpar, *new.lpar], rpar=[*new.rpar, *old.rpar])
    return new


def op_flip_sign(src: Source, line: int, params: dict) -> dict:
    cands = []
    for n in src.nodes:
        if isinstance(n, cst.BinaryOperation) and isinstance(n.operator, (cst.Add, cst.Subtract)):
            if src.line_of(n.operator) == line:
                cands.append((src.start(n.operator), n))
        elif isinstance(n, cst.AugAssign) and isinstance(n.operator, (cst.AddAssign, cst.SubtractAssign)):
            if src.line_of(n.operator) == line:
                cands.append((src.start(n.operator), n))
    cands.sort(key=lambda c: c[0])
    edits = {}
    for _, node in pick([c for c in cands], params, "binary +/-", line):
        def flip(upd, node=node):
            op = upd.operator
            table = {cst.Add: cst.Subtract, cst.Subtract: cst.Add, cst.AddAssign: cst.SubtractAssign,
                     cst.SubtractAssign: cst.AddAssign}
            new = table[type(op)](whitespace_before=op.whitespace_before, whitespace_after=op.whitespace_after)
            return upd.with_changes(operator=new)
        edits[id(node)] = flip
    return edits


def op_drop_negation(src: Source, line: int, params: dict) -> dict:
    cands = [n for n in src.on_line(line, cst.UnaryOperation) if isinstance(n.operator, cst.Minus)]
    edits = {}
    for node in pick(cands, params, "unary minus", line):
        edits[id(node)] = lambda upd: paren_like(upd.expression, upd)
    return edits


MIN_MAX = {"min": "max", "max": "min", "minimum": "maximum", "maximum": "minimum", "amin": "amax", "amax": "amin",
           "fmin": "fmax", "fmax": "fmin", "clamp_min": "clamp_max", "clamp_max": "clamp_min", "nanmin": "nanmax",
           "nanmax": "nanmin"}


def op_swap_min_max(src: Source, line: int, params: dict) -> dict:
    cands = []
    for n in src.nodes:
        if isinstance(n, cst.Call):
            target = n.func.attr if isinstance(n.func, cst.Attribute) else n.func
            if isinstance(target, cst.Name) and target.value in MIN_MAX and src.line_of(target) == line:
                cands.append((src.start(target), target))
    cands.sort(key=lambda c: c[0])
    return {id(t): (lambda upd: upd.with_changes(value=MIN_MAX[upd.value]))
            for _, t in pick(cands, params, "min/max call", line)}


GRAD_OFF = {"no_grad", "inference_mode"}


def is_grad_off(expr: cst.BaseExpression) -> bool:
    func = expr.func if isinstance(expr, cst.Call) else expr
    name = dotted(func) or ""
    last = name.rsplit(".", 1)[-1]
    if last in GRAD_OFF:
        return True
    if last == "set_grad_enabled" and isinstance(expr, cst.Call) and expr.args:
        value = expr.args[0].value
        return isinstance(value, cst.Name) and value.value == "False"
    return False


def op_remove_no_grad(src: Source, line: int, params: dict) -> dict:
    for node in src.on_line(line, cst.With):
        if node.leading_lines and src.line_of(node) != line:
            continue
        items = [i for i in node.items if is_grad_off(i.item)]
        if not items:
            continue
        if len(items) == len(node.items):
            def flatten(upd):
                body = upd.body
                if isinstance(body, cst.SimpleStatementSuite):
                    stmts = [cst.SimpleStatementLine(body=list(body.body))]
                else:
                    stmts = list(body.body)
                if upd.leading_lines and stmts:
                    stmts[0] = stmts[0].with_changes(leading_lines=[*upd.leading_lines, *stmts[0].leading_lines])
                return cst.FlattenSentinel(stmts)
            return {id(node): flatten}
        keep = [i for i in node.items if not is_grad_off(i.item)]
        keep[-1] = keep[-1].with_changes(comma=cst.MaybeSentinel.DEFAULT)
        return {id(node): lambda upd, keep=keep: upd.with_changes(items=keep)}
    for node in src.on_line(line, cst.Decorator):
        if is_grad_off(node.decorator):
            return {id(node): cst.RemovalSentinel.REMOVE}
    raise InvalidSite(f"no torch.no_grad()/inference_mode() with-item or decorator on line {line}")


def op_remove_detach(src: Source, line: int, params: dict) -> dict:
    attrs = {params["attr"]} if "attr" in params else {"detach", "detach_"}
    cands = []
    for n in src.nodes:
        if attrs == {"data"}:
            if isinstance(n, cst.Attribute) and n.attr.value == "data" and src.line_of(n.attr) == line:
                cands.append((src.start(n.attr), n, False))
        elif isinstance(n, cst.Call) and isinstance(n.func, cst.Attribute) and n.func.attr.value in attrs \
                and not n.args and src.line_of(n.func.attr) == line:
            cands.append((src.start(n.func.attr), n, True))
    cands.sort(key=lambda c: c[0])
    edits = {}
    for _, node, is_call in pick(cands, params, "/".join(sorted(attrs)), line):
        edits[id(node)] = (lambda upd: paren_like(upd.func.value, upd)) if is_call else (lambda upd: upd.value)
    return edits


def int_value(expr: cst.BaseExpression | None) -> int | None:
    if isinstance(expr, cst.Integer):
        return int(expr.value)
    if isinstance(expr, cst.UnaryOperation) and isinstance(expr.operator, cst.Minus) \
            and isinstance(expr.expression, cst.Integer):
        return -int(expr.expression.value)
    return None


def int_expr(value: int) -> cst.BaseExpression:
    return cst.Integer(str(value)) if value >= 0 else cst.UnaryOperation(cst.Minus(), cst.Integer(str(-value)))


def shifted(bound: cst.BaseExpression | None, delta: int, upper: bool) -> cst.BaseExpression | None:
    """The slice bound moved by ``delta`` tokens (None: the start, or the end for an upper bound)."""
    if bound is None:
        if upper:
            return int_expr(delta) if delta < 0 else None
        if delta < 0:
            raise InvalidSite("a window starting at 0 cannot move left")
        return int_expr(delta)
    k = int_value(bound)
    if k is not None:
        new = k + delta
        if new == 0 and (k < 0) != upper:
            pass
        if new == 0 and not upper:
            return None
        if new == 0 and upper and k < 0:
            return None  # [.., :-1] moved right ends at the end
        return int_expr(new)
    if isinstance(bound, cst.BinaryOperation) and isinstance(bound.operator, (cst.Add, cst.Subtract)):
        k = int_value(bound.right)
        if k is not None and k >= 0:
            signed = k if isinstance(bound.operator, cst.Add) else -k
            new = signed + delta
            if new == 0:
                return bound.left
            op = cst.Add() if new > 0 else cst.Subtract()
            op = op.with_changes(whitespace_before=bound.operator.whitespace_before,
                                 whitespace_after=bound.operator.whitespace_after)
            return bound.with_changes(operator=op, right=cst.Integer(str(abs(new))))
    op = cst.Add if delta > 0 else cst.Subtract
    return cst.BinaryOperation(left=bound, operator=op(whitespace_before=cst.SimpleWhitespace(" "),
                                                       whitespace_after=cst.SimpleWhitespace(" ")),
                               right=cst.Integer(str(abs(delta))))


def slice_elements(sub: cst.Subscript) -> list[tuple[int, cst.Slice]]:
    return [(i, e.slice) for i, e in enumerate(sub.slice) if isinstance(e.slice, cst.Slice) and e.slice.step is None]


def value_named(sub: cst.Subscript, name: str | None) -> bool:
    return name is None or name in names_in(sub.value)


def op_shift_mask(src: Source, line: int, params: dict) -> dict:
    delta = int(params.get("delta", -1))
    name = params.get("name")
    cands = [n for n in src.on_line(line, cst.Subscript) if value_named(n, name)
             and any(s.lower is not None or s.upper is not None for _, s in slice_elements(n))]
    edits = {}
    for node in pick(cands, params, f"sliced subscript{f' of {name}' if name else ''}", line):
        idx, sl = [(i, s) for i, s in slice_elements(node) if s.lower is not None or s.upper is not None][-1]
        new_slice = sl.with_changes(lower=shifted(sl.lower, delta, False), upper=shifted(sl.upper, delta, True))
        if new_slice.lower is None and new_slice.upper is None:
            raise InvalidSite(f"shifting the window on line {line} leaves a full slice")

        def edit(upd, idx=idx, new_slice=new_slice):
            elems = list(upd.slice)
            elems[idx] = elems[idx].with_changes(slice=new_slice)
            return upd.with_changes(slice=elems)
        edits[id(node)] = edit
    return edits


def is_logits_shift(s: cst.Slice) -> bool:
    return int_value(s.upper) == -1 and (s.lower is None or int_value(s.lower) is None or int_value(s.lower) < -1)


def is_labels_shift(s: cst.Slice) -> bool:
    return int_value(s.lower) == 1 and s.upper is None


def unshift(src: Source, line: int, test: Callable[[cst.Slice], bool], what: str, params: dict) -> dict:
    name = params.get("name") if what == "logits" else params.get("labels_name")
    cands = [n for n in src.on_line(line, cst.Subscript) if value_named(n, name)
             and any(test(s) for _, s in slice_elements(n))]
    edits = {}
    for node in pick(cands, {"occurrence": params.get("occurrence")} if what == "logits" else {}, f"{what} shift",
                     line):
        idx = [i for i, s in slice_elements(node) if test(s)][-1]
        others = [e for i, e in enumerate(node.slice) if i != idx]
        trivial = all((isinstance(e.slice, cst.Slice) and e.slice.lower is None and e.slice.upper is None
                       and e.slice.step is None) or (isinstance(e.slice, cst.Index)
                                                     and isinstance(e.slice.value, cst.Ellipsis)) for e in others)

        window = what == "logits" and node.slice[idx].slice.lower is not None

        def edit(upd, idx=idx, trivial=trivial, window=window):
            if window:  # [:, -L - 1:-1] -> [:, -L:]: the same window, unshifted
                elems = list(upd.slice)
                sl = elems[idx].slice
                elems[idx] = elems[idx].with_changes(slice=sl.with_changes(lower=shifted(sl.lower, 1, False),
                                                                           upper=None))
                return upd.with_changes(slice=elems)
            if trivial:
                return paren_like(upd.value, upd)
            elems = list(upd.slice)
            elems[idx] = elems[idx].with_changes(slice=cst.Slice(lower=None, upper=None))
            return upd.with_changes(slice=elems)
        edits[id(node)] = edit
    return edits


def op_remove_shift(src: Source, line: int, params: dict) -> dict:
    which = params.get("which", "both")
    if which not in ("logits", "labels", "both", "roll"):
        raise InvalidSite(f"which = {which!r}: logits, labels, both or roll")
    if which == "roll":
        # labels rolled one left (`torch.roll(ids, shifts=-1, dims=1)`) -> the ids themselves
        for node in src.on_line(line, cst.Call):
            if dotted(node.func) == "torch.roll" and node.args:
                kept = node.args[0].value
                return {id(node): lambda upd, kept=kept: kept}
        raise InvalidSite(f"no torch.roll(...) on line {line}")
    edits = {}
    if which in ("logits", "both"):
        edits.update(unshift(src, line, is_logits_shift, "logits", params))
    if which in ("labels", "both"):
        edits.update(unshift(src, int(params.get("labels_line", line)), is_labels_shift, "labels", params))
    return edits


def statement_at(src: Source, line: int, kinds=(cst.BaseStatement,)) -> cst.BaseStatement | None:
    for node in src.nodes:
        if isinstance(node, kinds) and node in src.pos:
            # a statement's position starts at its first token, after its leading blank lines/comments
            if src.line_of(node) == line:
                return node
    return None


def op_remove_zero_grad(src: Source, line: int, params: dict) -> dict:
    stmt = statement_at(src, line, (cst.SimpleStatementLine,))
    if stmt is not None:
        calls = [s for s in stmt.body if isinstance(s, cst.Expr) and isinstance(s.value, cst.Call)
                 and isinstance(s.value.func, cst.Attribute) and s.value.func.attr.value == "zero_grad"]
        if calls:
            if len(stmt.body) == 1:
                return {id(stmt): cst.RemovalSentinel.REMOVE}
            return {id(calls[0]): cst.RemovalSentinel.REMOVE}
    raise InvalidSite(f"no *.zero_grad() statement on line {line}")


def parse_dotted(text: str) -> cst.BaseExpression:
    expr = cst.parse_expression(text)
    if dotted(expr) != text:
        raise InvalidSite(f"policy = {text!r} is not a (dotted) name")
    return expr


def op_alias_reference(src: Source, line: int, params: dict) -> dict:
    if "policy" not in params:
        raise InvalidSite("alias_reference needs policy = \"<name>\"")
    policy = parse_dotted(params["policy"])
    keyword = params.get("keyword")
    if keyword is None:
        for node in src.nodes:
            if isinstance(node, (cst.Assign, cst.AnnAssign)) and node in src.pos and src.line_of(node) == line \
                    and node.value is not None:
                if dotted(node.value) == params["policy"]:
                    raise InvalidSite("the value is the policy already")
                return {id(node.value): lambda upd: policy}
        raise InvalidSite(f"no assignment on line {line}")
    for node in src.on_line(line, cst.Arg):
        if node.keyword is not None and node.keyword.value == keyword:
            return {id(node.value): lambda upd: policy}
    raise InvalidSite(f"no {keyword}= argument on line {line}")


STATS = {"mean", "std", "var", "nanmean"}


def op_batch_mean(src: Source, line: int, params: dict) -> dict:
    cands = []
    for n in src.nodes:
        if not isinstance(n, cst.Call) or not isinstance(n.func, cst.Attribute) or n.func.attr.value not in STATS:
            continue
        if src.line_of(n.func.attr) != line:
            continue
        module_form = dotted(n.func.value) in ("torch", "np", "numpy", "jnp")
        first_dim = 1 if module_form else 0
        drop = [i for i, a in enumerate(n.args)
                if (a.keyword is None and i == first_dim and a.star == "")
                or (a.keyword is not None and a.keyword.value in ("dim", "axis", "keepdim", "keepdims"))
                or (a.keyword is None and i == first_dim + 1 and a.star == "" and len(n.args) > first_dim + 1)]
        if any(a.keyword is not None and a.keyword.value in ("dim", "axis") for a in n.args) or \
                len([a for a in n.args if a.keyword is None]) > first_dim:
            cands.append((src.start(n.func.attr), n, drop))
    cands.sort(key=lambda c: c[0])
    edits = {}
    for _, node, drop in pick(cands, params, "mean/std/var call with a dim", line, default_all=True):
        def edit(upd, drop=drop):
            args = [a for i, a in enumerate(upd.args) if i not in drop]
            if args:
                args[-1] = args[-1].with_changes(comma=cst.MaybeSentinel.DEFAULT)
            return upd.with_changes(args=args)
        edits[id(node)] = edit
    return edits


def op_drop_temperature(src: Source, line: int, params: dict) -> dict:
    stmt = statement_at(src, line, (cst.SimpleStatementLine,))
    if stmt is not None and len(stmt.body) == 1:
        small = stmt.body[0]
        if isinstance(small, cst.AugAssign) and isinstance(small.operator, cst.DivideAssign):
            return {id(stmt): cst.RemovalSentinel.REMOVE}
        if isinstance(small, cst.Expr) and isinstance(small.value, cst.Call) \
                and isinstance(small.value.func, cst.Attribute) and small.value.func.attr.value == "div_":
            return {id(stmt): cst.RemovalSentinel.REMOVE}
    cands = []
    for n in src.nodes:
        if isinstance(n, cst.BinaryOperation) and isinstance(n.operator, cst.Divide) and src.line_of(n.operator) == line:
            cands.append((src.start(n.operator), n, "op"))
        elif isinstance(n, cst.Call) and isinstance(n.func, cst.Attribute) and n.func.attr.value in ("div", "div_") \
                and src.line_of(n.func.attr) == line:
            cands.append((src.start(n.func.attr), n, "call"))
    cands.sort(key=lambda c: c[0])
    edits = {}
    for _, node, kind in pick(cands, params, "division", line):
        edits[id(node)] = (lambda upd: paren_like(upd.left, upd)) if kind == "op" else \
            (lambda upd: paren_like(upd.func.value, upd))
    return edits


def op_move_old_logp_into_loop(src: Source, line: int, params: dict) -> tuple[dict, dict]:
    if "loop_line" not in params:
        raise InvalidSite("move_old_logp_into_loop needs loop_line")
    stmt = statement_at(src, line, (cst.SimpleStatementLine, cst.With, cst.If))
    loop = statement_at(src, int(params["loop_line"]), (cst.For, cst.While))
    if stmt is None or loop is None:
        raise InvalidSite(f"no statement on line {line} or no loop on line {params['loop_line']}")
    if int(params["loop_line"]) <= line:
        raise InvalidSite("the loop must come after the statement")
    moved = stmt.with_changes(leading_lines=[])
    return {id(stmt): cst.RemovalSentinel.REMOVE}, {id(loop): [moved]}


def op_local_count(src: Source, line: int, params: dict) -> dict:
    if "mask" not in params:
        raise InvalidSite("local_count needs mask = \"<name>\"")
    mask = parse_dotted(params["mask"])
    cands = [(src.start(n.operator), n) for n in src.nodes if isinstance(n, cst.BinaryOperation)
             and isinstance(n.operator, cst.Divide) and src.line_of(n.operator) == line]
    cands.sort(key=lambda c: c[0])
    new = cst.Call(func=cst.Attribute(value=mask, attr=cst.Name("sum")))
    return {id(n): (lambda upd: upd.with_changes(right=new)) for _, n in pick(cands, params, "division", line)}


def is_plain_sum(expr: cst.BaseExpression) -> bool:
    """``x.sum()``, or a count guarded after the sum: ``x.sum().clamp(min=1)``, ``.clamp_min(1)``, ``.float()``."""
    if isinstance(expr, cst.Call) and isinstance(expr.func, cst.Attribute) and expr.func.attr.value == "sum":
        return not expr.args
    if isinstance(expr, cst.Call) and isinstance(expr.func, cst.Attribute) \
            and expr.func.attr.value in ("clamp", "clamp_min", "float", "to"):
        return is_plain_sum(expr.func.value)
    return False


def per_row(expr: cst.BaseExpression) -> cst.BaseExpression:
    """The plain ``.sum()`` of ``is_plain_sum`` taken over the last axis: ``.sum(-1)``."""
    if expr.func.attr.value == "sum":
        return expr.with_changes(args=[cst.Arg(int_expr(-1))])
    return expr.with_changes(func=expr.func.with_changes(value=per_row(expr.func.value)))


def op_seq_mean(src: Source, line: int, params: dict) -> dict:
    keyword = params.get("keyword", "dim")
    cands = []
    for n in src.nodes:
        if isinstance(n, cst.BinaryOperation) and isinstance(n.operator, cst.Divide) \
                and src.line_of(n.operator) == line and is_plain_sum(n.left) and is_plain_sum(n.right):
            cands.append((src.start(n.operator), n, "div"))
        elif isinstance(n, cst.Call) and "mean" in (dotted(n.func) or "").rsplit(".", 1)[-1].lower() \
                and src.line_of(n) == line and len([a for a in n.args if a.keyword is None]) >= 2 \
                and not any(a.keyword is not None and a.keyword.value in ("dim", "axis") for a in n.args):
            cands.append((src.start(n), n, "helper"))
    cands.sort(key=lambda c: c[0])
    edits = {}
    for _, node, kind in pick(cands, params, "token mean", line):
        def edit(upd, kind=kind):
            if kind == "div":
                inner = upd.with_changes(left=per_row(upd.left), right=per_row(upd.right),
                                         lpar=[cst.LeftParen()], rpar=[cst.RightParen()])
                return cst.Call(func=cst.Attribute(value=inner, attr=cst.Name("mean")))
            args = list(upd.args)
            args[-1] = args[-1].with_changes(comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" ")))
            args.append(cst.Arg(int_expr(-1), keyword=cst.Name(keyword),
                                equal=cst.AssignEqual(cst.SimpleWhitespace(""), cst.SimpleWhitespace(""))))
            return cst.Call(func=cst.Attribute(value=upd.with_changes(args=args), attr=cst.Name("mean")))
        edits[id(node)] = edit
    return edits


# ----- RLG016-RLG019 ---------------------------------------------------------------------------------------------

def _is_key(node: cst.BaseExpression | None, key: str) -> bool:
    return isinstance(node, cst.SimpleString) and node.evaluated_value == key


def _without(items: list, idx: int) -> list:
    """``items`` (call args or dict elements) without the ``idx``-th; a removed last item hands its trailing
    comma (and the whitespace before the closing bracket) to the new last one."""
    out = list(items[:idx]) + list(items[idx + 1:])
    if out and idx == len(items) - 1:
        last, removed = out[-1], items[idx]
        changes = {"comma": removed.comma}
        if isinstance(last, cst.Arg):
            changes["whitespace_after_arg"] = removed.whitespace_after_arg
        out[-1] = last.with_changes(**changes)
    return out


def op_drop_attention_mask(src: Source, line: int, params: dict) -> dict:
    keyword = params.get("keyword", "attention_mask")
    cands = []
    for node in src.nodes:
        if isinstance(node, cst.Call):
            for i, arg in enumerate(node.args):
                if arg.keyword is not None and arg.keyword.value == keyword and src.line_of(arg) == line:
                    cands.append((src.start(arg), node, i))
        elif isinstance(node, cst.Dict):
            for i, el in enumerate(node.elements):
                if isinstance(el, cst.DictElement) and _is_key(el.key, keyword) and src.line_of(el) == line:
                    cands.append((src.start(el), node, i))
    cands.sort(key=lambda c: c[0])
    edits = {}
    for _, node, i in pick(cands, params, f"{keyword}= argument or {keyword!r} entry", line):
        if isinstance(node, cst.Call):
            edits[id(node)] = lambda upd, i=i: upd.with_changes(args=_without(list(upd.args), i))
        else:
            edits[id(node)] = lambda upd, i=i: upd.with_changes(elements=_without(list(upd.elements), i))
    return edits


PAD_READS = frozenset({"pad_token_id", "pad_token", "pad_id"})
PAD_NAME = re.compile(r"(?i)(\w+_)?pad(ding)?(_token)?(_ids?|_idx|_index)?")


def _end_line(src: Source, node: cst.CSTNode) -> int:
    return src.pos[node].end.line


def _innermost(src: Source, line: int, kinds) -> cst.CSTNode | None:
    """The innermost node of ``kinds`` whose lines contain ``line``."""
    best = None
    for node in src.nodes:
        if isinstance(node, kinds) and node in src.pos and src.line_of(node) <= line <= _end_line(src, node):
            if best is None or src.line_of(node) >= src.line_of(best) and _end_line(src, node) <= _end_line(src, best):
                best = node
    return best


def _block_statement(src: Source, line: int) -> cst.BaseStatement | None:
    """The innermost statement holding ``line`` that sits directly in a block (a body or the module)."""
    best = None
    for node in src.nodes:
        if isinstance(node, (cst.SimpleStatementLine, cst.BaseCompoundStatement)) and node in src.pos and \
                isinstance(src.parents.get(id(node)), (cst.IndentedBlock, cst.Module)) and \
                src.line_of(node) <= line <= _end_line(src, node):
            if best is None or src.line_of(node) >= src.line_of(best):
                best = node
    return best


def _is_docstring(stmt: cst.BaseStatement) -> bool:
    return isinstance(stmt, cst.SimpleStatementLine) and len(stmt.body) == 1 and isinstance(stmt.body[0], cst.Expr) \
        and isinstance(stmt.body[0].value, (cst.SimpleString, cst.ConcatenatedString))


def op_pad_as_eos(src: Source, line: int, params: dict) -> dict:
    reads = [n for n in src.on_line(line, cst.Attribute) if n.attr.value in PAD_READS and dotted(n.value)]
    tokenizer = params.get("tokenizer")
    if tokenizer is None:
        if not reads:
            raise InvalidSite(f"no tokenizer .pad_token_id read on line {line} (give tokenizer = \"<name>\")")
        tokenizer = dotted(reads[0].value)
    elif not reads and not any(isinstance(n, cst.Name) and PAD_NAME.fullmatch(n.value) for n in
                               src.on_line(line, cst.Name)):
        raise InvalidSite(f"no pad id read on line {line}")
    parse_dotted(tokenizer)
    setting = cst.parse_statement(f"{tokenizer}.pad_token = {tokenizer}.eos_token\n")
    where = params.get("where", "function")
    if where not in ("function", "line"):
        raise InvalidSite(f"where = {where!r}: function or line")
    func = _innermost(src, line, cst.FunctionDef) if where == "function" else None
    if func is not None and isinstance(func.body, cst.IndentedBlock):
        def prepend(upd):
            body = list(upd.body.body)
            at = 1 if body and _is_docstring(body[0]) else 0
            return upd.with_changes(body=upd.body.with_changes(body=[*body[:at], setting, *body[at:]]))
        return {id(func): prepend}
    stmt = _block_statement(src, line)
    if stmt is None:
        raise InvalidSite(f"no statement holds line {line}")

    def before(upd):
        first = setting.with_changes(leading_lines=upd.leading_lines)
        return cst.FlattenSentinel([first, upd.with_changes(leading_lines=[])])
    return {id(stmt): before}


def _mode_off(call: cst.Call) -> bool:
    """``x.eval()``, ``x.train(False)``, ``x.train(mode=False)``."""
    if not isinstance(call.func, cst.Attribute):
        return False
    name = call.func.attr.value
    if name == "eval":
        return not call.args
    if name == "train" and len(call.args) == 1:
        value = call.args[0].value
        return isinstance(value, cst.Name) and value.value == "False"
    return False


def op_remove_eval(src: Source, line: int, params: dict) -> dict:
    stmt = statement_at(src, line, (cst.SimpleStatementLine,))
    if stmt is not None:
        smalls = [s for s in stmt.body if isinstance(s, cst.Expr) and isinstance(s.value, cst.Call)
                  and _mode_off(s.value)]
        if smalls:
            if len(stmt.body) == 1:
                return {id(stmt): cst.RemovalSentinel.REMOVE}
            return {id(smalls[0]): cst.RemovalSentinel.REMOVE}
    cands = [(src.start(n.func.attr), n) for n in src.nodes if isinstance(n, cst.Call) and _mode_off(n)
             and src.line_of(n.func.attr) == line]
    cands.sort(key=lambda c: c[0])
    return {id(n): (lambda upd: paren_like(upd.func.value, upd))
            for _, n in pick(cands, params, ".eval() / .train(False) call", line)}


def _row_index(sub: cst.Subscript) -> cst.BaseExpression | None:
    """The index expression of ``x[idx]`` / ``x[idx, ...]`` when it is a tensor of rows (not a slice, a number, a
    string key, ``None`` or ``...``)."""
    first = sub.slice[0].slice if sub.slice else None
    if not isinstance(first, cst.Index) or first.star is not None:
        return None
    value = first.value
    if isinstance(value, (cst.Integer, cst.Float, cst.SimpleString, cst.ConcatenatedString, cst.FormattedString,
                          cst.Ellipsis)) or int_value(value) is not None:
        return None
    if isinstance(value, cst.Name) and value.value in ("None", "True", "False"):
        return None
    if isinstance(value, (cst.Tuple, cst.Slice)):
        return None
    return value


def _shared_selection(src: Source, sub: cst.Subscript, idx: cst.BaseExpression) -> bool:
    """Whether the selection ``idx`` (or a name it is built from) is used elsewhere in the function (or module)
    that holds ``sub``: other fields are selected by it, so the field left unselected falls out of step."""
    names = {n.value for n in src.nodes if isinstance(n, cst.Name) and n in src.pos and _within(src, n, idx)
             and not isinstance(src.parents.get(id(n)), cst.Attribute)}  # variables, not modules or attributes
    if not names:
        return False
    scope = _innermost(src, src.line_of(sub), cst.FunctionDef) or src.module
    for n in src.nodes:
        if isinstance(n, cst.Name) and n.value in names and n in src.pos and _within(src, n, scope) \
                and not _within(src, n, sub) and not _is_attr_name(src, n):
            return True
    return False


def _is_attr_name(src: Source, n: cst.Name) -> bool:
    parent = src.parents.get(id(n))
    return isinstance(parent, cst.Attribute) and parent.attr is n


def _within(src: Source, node: cst.CSTNode, outer: cst.CSTNode) -> bool:
    if isinstance(outer, cst.Module):
        return True
    a, b = src.pos[outer].start, src.pos[outer].end
    p = src.pos[node].start
    return (a.line, a.column) <= (p.line, p.column) <= (b.line, b.column)


def op_filter_one_field(src: Source, line: int, params: dict) -> dict:
    name = params.get("name")
    cands = []
    for n in src.nodes:
        if not isinstance(n, cst.Subscript):
            continue
        idx = _row_index(n)
        if idx is None or src.line_of(idx) != line or not (name is None or dotted(n.value) == name):
            continue
        if not _shared_selection(src, n, idx):
            continue  # the selection is used nowhere else: no other field to fall out of step with
        cands.append((src.start(idx), n))
    cands.sort(key=lambda c: c[0])
    edits = {}
    for _, node in pick(cands, params, f"row selection{f' of {name}' if name else ''} shared with another field",
                        line):
        rest = list(node.slice[1:])
        trivial = all(isinstance(e.slice, cst.Slice) and e.slice.lower is None and e.slice.upper is None
                      and e.slice.step is None for e in rest)
        parent = src.parents.get(id(node))
        stmt = src.parents.get(id(parent)) if parent is not None else None
        if trivial and isinstance(parent, cst.Assign) and parent.value is node and len(parent.targets) == 1 \
                and src.code(parent.targets[0].target) == src.code(node.value) \
                and isinstance(stmt, cst.SimpleStatementLine) and len(stmt.body) == 1:
            edits[id(stmt)] = cst.RemovalSentinel.REMOVE  # `x = x[idx]` -> the statement goes
        elif trivial:
            edits[id(node)] = lambda upd: paren_like(upd.value, upd)
        else:
            def edit(upd):
                elems = list(upd.slice)
                elems[0] = elems[0].with_changes(slice=cst.Slice(lower=None, upper=None))
                return upd.with_changes(slice=elems)
            edits[id(node)] = edit
    return edits


OPERATORS: dict[str, Callable] = {
    "flip_sign": op_flip_sign,
    "drop_negation": op_drop_negation,
    "swap_min_max": op_swap_min_max,
    "remove_no_grad": op_remove_no_grad,
    "remove_detach": op_remove_detach,
    "shift_mask": op_shift_mask,
    "remove_shift": op_remove_shift,
    "remove_zero_grad": op_remove_zero_grad,
    "alias_reference": op_alias_reference,
    "batch_mean": op_batch_mean,
    "drop_temperature": op_drop_temperature,
    "move_old_logp_into_loop": op_move_old_logp_into_loop,
    "local_count": op_local_count,
    "seq_mean": op_seq_mean,
    "drop_attention_mask": op_drop_attention_mask,
    "pad_as_eos": op_pad_as_eos,
    "remove_eval": op_remove_eval,
    "filter_one_field": op_filter_one_field,
}
# operators that need no site-specific parameter: the ones the fuzz pass applies at random places
FUZZABLE = ("flip_sign", "drop_negation", "swap_min_max", "remove_no_grad", "remove_detach", "shift_mask",
            "remove_shift", "remove_zero_grad", "batch_mean", "drop_temperature", "seq_mean", "drop_attention_mask",
            "pad_as_eos", "remove_eval", "filter_one_field")


def mutate(text: str, operator: str, line: int, params: dict) -> str:
    """The mutant of ``text``; InvalidSite when the operator finds no target or the result is no program."""
    if operator not in OPERATORS:
        raise InvalidSite(f"unknown operator {operator!r}")
    try:
        src = Source(text)
    except cst.ParserSyntaxError as exc:
        raise InvalidSite(f"libcst cannot parse the original: {exc}") from None
    result = OPERATORS[operator](src, line, params)
    edits, prepend = result if isinstance(result, tuple) else (result, {})
    applier = Apply(edits, prepend)
    new = src.module.visit(applier)
    missing = (set(edits) | set(prepend)) - applier.done
    if missing:
        raise InvalidSite(f"{len(missing)} target(s) of {operator} not reached by the transform")
    out = new.code
    if out == text:
        raise InvalidSite("the mutant equals the original")
    try:
        ast.parse(out)
    except SyntaxError as exc:
        raise InvalidSite(f"the mutant does not parse: {exc}") from None
    return out


# ----- sites -----------------------------------------------------------------------------------------------------

@dataclass
class Site:
    repo: str
    path: str
    function: str
    line: int
    operator: str
    code: str
    note: str
    params: dict
    part: str = ""
    origin: str = ""
    harmless: str = ""

    @property
    def label(self) -> str:
        return f"{self.repo}:{self.path}:{self.line} {self.operator} {self.code}"


def load_repos() -> dict[str, dict]:
    return {r["name"]: r for r in tomllib.loads(REPOS.read_text(encoding="utf-8"))["repo"]}


def load_sites(repos: dict[str, dict], files: Iterable[Path] = SITE_FILES) -> list[Site]:
    sites = []
    for path in files:
        if not path.exists():
            continue
        for i, entry in enumerate(tomllib.loads(path.read_text(encoding="utf-8")).get("site", [])):
            where = f"{path.name} site {i + 1}"
            missing = SITE_KEYS - set(entry)
            if missing:
                raise SystemExit(f"{where}: missing {sorted(missing)}")
            if entry["repo"] not in repos:
                raise SystemExit(f"{where}: repository {entry['repo']!r} is not in {REPOS.name}")
            for key, value in entry.items():
                if key not in SITE_KEYS | OPTIONAL_KEYS and not isinstance(value, (int, str)):
                    raise SystemExit(f"{where}: parameter {key} must be a name or an index")
            params = {k: v for k, v in entry.items() if k not in SITE_KEYS | OPTIONAL_KEYS}
            sites.append(Site(entry["repo"], entry["path"], entry["function"], int(entry["line"]), entry["operator"],
                              entry["code"], entry["note"], params, repos[entry["repo"]]["part"], path.name,
                              str(entry.get("harmless", ""))))
    return sites


# ----- linting -----------------------------------------------------------------------------------------------------

class Linter:
    """The working tree's linter, in process, over one extracted tree at a time."""

    def __init__(self, preview: bool):
        from rlguard.lint import runner
        from rlguard.lint.config import Layer, load_config

        self.runner, self.load_config = runner, load_config
        try:
            self.layer = Layer(select=("ALL",), preview=True) if preview else Layer(select=("ALL",))
        except TypeError:  # a linter without preview rules
            self.layer = Layer(select=("ALL",))
        self.tree: Path | None = None
        self.config = None
        self.seconds = 0.0
        self.lints = 0

    def use(self, tree: Path) -> None:
        if tree != self.tree:
            os.chdir(tree)
            self.tree, self.config = tree, self.load_config([str(tree)], cli=self.layer, isolated=True)

    def lint(self, rel: str) -> tuple[list[tuple[str, int, str]], list[str]]:
        """(code, line, message) of every finding in ``rel``, and the internal errors."""
        start = time.perf_counter()
        try:
            self.runner._PROJECTS.clear()  # the mutated module is re-read from disk, not from a cached hash
            report = self.runner.run([rel], self.config, jobs=1, cache=False)
        finally:
            self.seconds += time.perf_counter() - start
            self.lints += 1
        findings = [(f.code, f.line, f.message) for f in report.findings]
        errors = [e.describe() for e in report.errors] + [f"{m} (line {ln})" for c, ln, m in findings if c == INTERNAL]
        return findings, errors


def prepare_tree(entry: dict, root: Path | None, work: Path) -> tuple[Path | None, Path | None, str]:
    git_dir = snapshots.find_mirror(root, entry["repo"])
    if git_dir is None or not snapshots.has_commit(git_dir, entry["commit"]):
        return None, None, (f"no local mirror of {entry['repo']} with commit {entry['commit'][:12]} (git clone "
                            f"--mirror https://github.com/{entry['repo']} <mirrors>/{entry['repo'].replace('/', '+')})")
    # A private copy of the ecosystem tree: mutants are written into it while they are linted.
    tree = work / "mutation" / f"{entry['name']}-{entry['commit'][:12]}"
    snapshots.extract_python(git_dir, entry["commit"], tree)
    return git_dir, tree, ""


class Mutated:
    """Write ``text`` over ``tree/rel`` for the duration of a with block, and put the original back."""

    def __init__(self, tree: Path, rel: str, text: str, original: bytes):
        self.path, self.text, self.original = tree / rel, text, original

    def __enter__(self):
        tmp = self.path.with_name(self.path.name + ".mutant-tmp")
        tmp.write_text(self.text, encoding="utf-8")
        tmp.replace(self.path)

    def __exit__(self, *exc):
        tmp = self.path.with_name(self.path.name + ".orig-tmp")
        tmp.write_bytes(self.original)
        tmp.replace(self.path)


def in_ranges(line: int, ranges: list[tuple[int, int]]) -> bool:
    return any(a <= line <= b for a, b in ranges)


@dataclass
class Outcome:
    site: Site
    status: str
    detail: str = ""
    mutant_findings: list = field(default_factory=list)
    seconds: float = 0.0


def judge(site: Site, tree: Path, linter: Linter, original_cache: dict) -> Outcome:
    start = time.perf_counter()
    file = tree / site.path
    if not file.is_file():
        return Outcome(site, "INVALID-SITE", f"{site.path} absent at the pinned commit")
    original_bytes = file.read_bytes()
    original = original_bytes.decode("utf-8", "replace")
    before = snapshots.function_lines(original, site.function)
    if not in_ranges(site.line, before):
        return Outcome(site, "INVALID-SITE", f"line {site.line} is not inside {site.function} "
                                             f"({before or 'no such function'})")
    try:
        mutant = mutate(original, site.operator, site.line, site.params)
    except InvalidSite as exc:
        return Outcome(site, "INVALID-SITE", str(exc))
    after = snapshots.function_lines(mutant, site.function)
    if not after:
        return Outcome(site, "INVALID-SITE", f"{site.function} not found in the mutant")
    linter.use(tree)
    try:
        if site.path not in original_cache:
            original_cache[site.path] = linter.lint(site.path)
        orig_findings, orig_errors = original_cache[site.path]
        with Mutated(tree, site.path, mutant, original_bytes):
            mut_findings, mut_errors = linter.lint(site.path)
    except Exception:  # the linter itself failed
        return Outcome(site, "INTERNAL-ERROR", traceback.format_exc(limit=4), seconds=time.perf_counter() - start)
    seconds = time.perf_counter() - start
    errors = orig_errors + mut_errors
    if errors:
        return Outcome(site, "INTERNAL-ERROR", "; ".join(errors)[:500], seconds=seconds)
    flagged = [f for f in orig_findings if f[0] == site.code and in_ranges(f[1], before)]
    caught = [f for f in mut_findings if f[0] == site.code and in_ranges(f[1], after)]
    if flagged:
        return Outcome(site, "ORIGINAL-FLAGGED", f"line {flagged[0][1]}: {flagged[0][2]}", caught, seconds)
    if site.harmless:
        # not a fault: a finding here is a false alarm, and silence is right; neither counts as recall
        if caught:
            return Outcome(site, "HARMLESS-FLAGGED", f"line {caught[0][1]}: {caught[0][2]} ({site.harmless})",
                           caught, seconds)
        return Outcome(site, "HARMLESS", site.harmless, mut_findings, seconds)
    if caught:
        return Outcome(site, "OK", f"line {caught[0][1]}: {caught[0][2]}", caught, seconds)
    other = sorted({f[0] for f in mut_findings if in_ranges(f[1], after)}
                   - {f[0] for f in orig_findings if in_ranges(f[1], before)})
    return Outcome(site, "MISSED", f"new codes in the function: {', '.join(other) or 'none'}", mut_findings, seconds)


def fuzz_site(site: Site, tree: Path, linter: Linter, n: int, rng: random.Random,
              operators: Iterable[str] = FUZZABLE) -> tuple[int, list[str]]:
    """Apply each fuzzable operator (or those of ``operators``) at up to ``n`` random places of the site's function;
    lint each mutant."""
    file = tree / site.path
    original_bytes = file.read_bytes()
    original = original_bytes.decode("utf-8", "replace")
    ranges = snapshots.function_lines(original, site.function)
    if not ranges:
        return 0, []
    try:
        src = Source(original)
    except cst.ParserSyntaxError:
        return 0, []
    lines = sorted({ln for a, b in ranges for ln in range(a, b + 1)})
    done, failures = 0, []
    linter.use(tree)
    for operator in operators:
        places = []
        for ln in lines:
            try:
                OPERATORS[operator](src, ln, {})
            except InvalidSite:
                continue
            places.append(ln)
        for ln in rng.sample(places, min(n, len(places))):
            try:
                mutant = mutate(original, operator, ln, {})
            except InvalidSite:
                continue
            try:
                with Mutated(tree, site.path, mutant, original_bytes):
                    findings, errors = linter.lint(site.path)
            except Exception as exc:
                errors = [f"{type(exc).__name__}: {exc}"]
            done += 1
            if errors:
                failures.append(f"{site.repo}:{site.path}:{ln} {operator}: {'; '.join(errors)[:300]}")
    return done, failures


# ----- report --------------------------------------------------------------------------------------------------

def rate(ok: int, valid: int) -> str:
    return f"{ok}/{valid} ({100 * ok / valid:.0f}%)" if valid else "n/a"


def render(outcomes: list[Outcome]) -> str:
    codes = sorted({o.site.code for o in outcomes})
    parts = [p for p in ("development", "validation") if any(o.site.part == p for o in outcomes)]
    lines = ["| code | " + " | ".join(f"{p}: caught / valid | missed | original flagged | invalid | harmless "
                                       f"(flagged) | error" for p in parts) + " |",
             "|---|" + "---|" * (6 * len(parts))]
    for code in codes + ["all"]:
        cells = []
        for part in parts:
            c = Counter(o.status for o in outcomes if o.site.part == part and (code == "all" or o.site.code == code))
            valid = c["OK"] + c["MISSED"]
            cells.append(f"{rate(c['OK'], valid)} | {c['MISSED']} | {c['ORIGINAL-FLAGGED']} | {c['INVALID-SITE']} | "
                         f"{c['HARMLESS'] + c['HARMLESS-FLAGGED']} ({c['HARMLESS-FLAGGED']}) | {c['INTERNAL-ERROR']}")
        lines.append(f"| {'**all**' if code == 'all' else code} | " + " | ".join(cells) + " |")
    lines.append("")
    for part in parts:
        mine = [o for o in outcomes if o.site.part == part]
        c = Counter(o.status for o in mine)
        ops = Counter(o.site.operator for o in mine)
        lines.append(f"- {part}: {len(mine)} sites in {len({o.site.repo for o in mine})} repositories, "
                     f"{len(ops)} operators; caught {rate(c['OK'], c['OK'] + c['MISSED'])} of the valid sites "
                     f"(valid = caught + missed)")
    return "\n".join(lines)


def render_sites(outcomes: list[Outcome]) -> str:
    rows = ["| part | status | site | operator | code |", "|---|---|---|---|---|"]
    for o in sorted(outcomes, key=lambda o: (o.site.part, o.status != "OK", o.site.code, o.site.repo)):
        if o.status == "OK":
            continue
        rows.append(f"| {o.site.part[:3]} | {o.status} | {o.site.repo}:`{o.site.path}`:{o.site.line} "
                    f"(`{o.site.function}`) | {o.site.operator} | {o.site.code} |")
    return "\n".join(rows) if len(rows) > 2 else "every valid site caught"


def write_doc(table: str, sites_table: str, preview: bool, fuzz_line: str) -> None:
    flag = " --preview" if preview else ""
    body = (f"{SECTION}\n\n`python benchmarks/mutation.py --mirrors DIR{flag} --write` "
            f"({datetime.date.today().isoformat()}): one catalog fault put by a mutation operator into correct code "
            f"of the pinned snapshots of `benchmarks/ecosystem.toml` (sites in `benchmarks/mutation_sites.toml` and "
            f"`benchmarks/mutation_sites_validation.toml`; the part is the repository's). Caught: a finding of the "
            f"site's code inside the mutated function, none in the original function.\n\n{table}\n\n"
            f"Sites not caught:\n\n{sites_table}\n" + (f"\n{fuzz_line}\n" if fuzz_line else ""))
    snapshots.replace_section(DOC, SECTION, body)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mirrors", help=f"folder of bare git mirrors (default: ${snapshots.ENV})")
    parser.add_argument("--work", default=str(ROOT / ".rlguard_ecosystem"), help="extracted trees")
    parser.add_argument("--part", choices=("development", "validation"))
    parser.add_argument("--only", action="append", help="repository short name (repeatable)")
    parser.add_argument("--code", action="append", help="catalog code (repeatable)")
    parser.add_argument("--sites", action="append", help="site file(s) instead of the two defaults")
    parser.add_argument("--preview", action="store_true", help="turn the preview rules on")
    parser.add_argument("--fuzz", type=int, default=0, metavar="N", help="random mutants per operator and site")
    parser.add_argument("--fuzz-operator", action="append", choices=FUZZABLE, metavar="OP",
                        help="fuzz only with these operators (repeatable; default: every fuzzable one)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("-v", "--verbose", action="store_true")
    parser.add_argument("--json", metavar="FILE")
    parser.add_argument("--write", action="store_true", help=f"update the {SECTION!r} section of docs/benchmarks.md")
    args = parser.parse_args(argv)

    repos = load_repos()
    files = [Path(p) for p in args.sites] if args.sites else SITE_FILES
    sites = [s for s in load_sites(repos, files) if (not args.part or s.part == args.part)
             and (not args.only or s.repo in args.only) and (not args.code or s.code in args.code)]
    root = snapshots.mirrors_root(args.mirrors)
    work = Path(args.work).resolve()
    cwd = os.getcwd()
    linter = Linter(args.preview)
    outcomes: list[Outcome] = []
    skipped: list[str] = []
    fuzzed, fuzz_failures = 0, []
    rng = random.Random(args.seed)
    by_repo: dict[str, list[Site]] = defaultdict(list)
    for s in sites:
        by_repo[s.repo].append(s)
    try:
        for name, group in by_repo.items():
            git_dir, tree, why = prepare_tree(repos[name], root, work)
            if tree is None:
                skipped.append(f"{name}: {why} ({len(group)} sites)")
                continue
            original_cache: dict = {}
            for site in group:
                outcome = judge(site, tree, linter, original_cache)
                outcomes.append(outcome)
                mark = "" if outcome.status == "OK" else f"  [{outcome.status}]"
                if args.verbose or outcome.status != "OK":
                    print(f"{outcome.status:16} {site.label} in {site.function} ({outcome.seconds:.1f} s)"
                          f"\n{'':17}{outcome.detail[:300]}", file=sys.stderr)
                else:
                    print(f"{outcome.status:16} {site.label}{mark}", file=sys.stderr)
                if args.fuzz:
                    n, failures = fuzz_site(site, tree, linter, args.fuzz, rng, args.fuzz_operator or FUZZABLE)
                    fuzzed += n
                    fuzz_failures += failures
    finally:
        os.chdir(cwd)
    for line in skipped:
        print("skipped:", line)
    if not outcomes:
        print(f"no site checked (no snapshot: set --mirrors or ${snapshots.ENV})")
        return 0
    table = render(outcomes)
    sites_table = render_sites(outcomes)
    print(table)
    print()
    print(sites_table)
    fuzz_line = ""
    if args.fuzz:
        ops = "".join(f" --fuzz-operator {op}" for op in args.fuzz_operator or ())
        fuzz_line = (f"Fuzz pass (`--fuzz {args.fuzz} --seed {args.seed}{ops}`): {fuzzed} random mutants linted, "
                     f"{len(fuzz_failures)} with an internal error or exception.")
        print("\n" + fuzz_line)
        for f in fuzz_failures:
            print("  fuzz failure:", f)
    print(f"\n{linter.lints} lints, {linter.seconds:.0f} s in the linter")
    if args.json:
        Path(args.json).write_text(json.dumps([
            dict(repo=o.site.repo, path=o.site.path, function=o.site.function, line=o.site.line,
                 operator=o.site.operator, code=o.site.code, part=o.site.part, params=o.site.params,
                 status=o.status, detail=o.detail, seconds=round(o.seconds, 2)) for o in outcomes], indent=1))
    if args.write:
        write_doc(table, sites_table, args.preview, fuzz_line)
    errors = sum(o.status == "INTERNAL-ERROR" for o in outcomes) + len(fuzz_failures)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
