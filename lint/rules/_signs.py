"""Shared reasoning for the "signs, objects and aggregation" rules (RLG005, RLG008, RLG009, RLG010, RLG011).

The heart of it is :func:`sign_of`, a richer cousin of :func:`rlguard.lint.rules._loss.net_sign`: the sign with
which a value playing some role enters an expression, following

- sums, negations, products and quotients (``-c * x``, ``a - (b - x)``);
- aliases inside the function and across ``self.`` attributes, never an assignment into itself
  (``adv = -adv`` reads the *previous* ``adv``);
- reductions and sign-preserving wrappers (``.mean()``, ``.sum(-1)``, ``torch.clamp(x, ...)``, ``x[:, 1:]``,
  ``.unsqueeze(-1)``, ``masked_mean(x, mask)``);
- two-argument ``min``/``max`` (``torch.min(ratio * A, clipped * A)``): the sign both arguments agree on;
- calls of small helpers of the same module, binding their parameters to the call's arguments
  (``aggregate(pg_losses, mask)`` with ``def aggregate(values, mask): return (values * mask).sum()``).

It can also report the assignment statements it went through (``via``), which rules use to report a fault once,
where it starts, instead of at every later statement that inherits it.
"""

from __future__ import annotations

import re
from typing import Callable, Iterator

import libcst as cst

from rlguard.lint.context import (ModuleContext, dotted_name, method_name, receiver, strip_wrappers,
                                  value_name)

SIGN_DEPTH = 10
REDUCTIONS = frozenset({"mean", "sum", "nanmean", "nansum", "masked_mean", "masked_sum", "mean_tokens",
                        "masked_whiten", "whiten"})
# Sign-preserving: the first argument (or the receiver) keeps its sign.
SIGN_KEEPING_METHODS = frozenset({"clamp", "clip", "clamp_", "clip_", "repeat_interleave", "repeat", "masked_fill",
                                  "sum_to_size", "nan_to_num"})
NOT_SIGN_CARRIERS = frozenset({"len", "range", "enumerate", "zip", "isinstance", "print", "str", "getattr",
                               "hasattr", "int", "bool", "type", "id", "sorted", "list", "tuple", "dict"})
SIGN_KEEPING_FUNCTIONS = frozenset({"torch.clamp", "torch.clip", "torch.mean", "torch.sum", "torch.nanmean",
                                    "torch.nansum", "torch.nn.functional.pad", "torch.masked_select",
                                    "torch.nan_to_num", "torch.repeat_interleave"})
MIN_MAX = {"torch.min": "min", "torch.minimum": "min", "torch.fmin": "min", "min": "min",
           "torch.max": "max", "torch.maximum": "max", "torch.fmax": "max", "max": "max"}

Matcher = Callable[[str], bool]
# A helper's parameters bound to the caller's argument expressions: (param -> argument, caller's bindings).
Env = dict


def min_max_kind(ctx: ModuleContext, call: cst.Call) -> str | None:
    """"min" or "max" for an elementwise two-argument min/max call (``torch.min(a, b)``, ``max(a, b)``)."""
    positional = [a for a in call.args if a.keyword is None and not a.star]
    if len(positional) != 2 or len(call.args) != 2:
        return None
    name = ctx.call_name(call)
    if name is None:
        return None
    kind = MIN_MAX.get(name)
    if kind is None and isinstance(call.func, cst.Name):
        return None
    return kind


def reaching(ctx: ModuleContext, key: str, at: cst.CSTNode):
    """Like ``ctx.reaching_assignments`` but never the assignment ``at`` sits in (``x = -x`` reads the old x)."""
    assigns = [a for a in ctx.assignments_to(key, at)
               if not ctx.contains(a.statement, at) and not exclusive_branches(ctx, a.statement, at)]
    if not assigns or key.startswith("self."):
        return assigns
    at_index = ctx.order[id(at)]
    before = [a for a in assigns if a.index < at_index]
    reach = before[-1:]
    for loop in ctx.enclosing_loops(at):
        reach += [a for a in assigns if a.index > at_index and ctx.contains(loop, a.statement)]
    return reach or assigns


def exclusive_branches(ctx: ModuleContext, a: cst.CSTNode, b: cst.CSTNode) -> bool:
    """Whether ``a`` and ``b`` sit in different branches of one ``if``/``else`` (never both run)."""
    for anc in ctx.ancestors(a):
        if isinstance(anc, (cst.FunctionDef, cst.ClassDef)):
            return False
        if isinstance(anc, cst.If) and anc.orelse is not None:
            a_in_body = ctx.contains(anc.body, a)
            if a_in_body and ctx.contains(anc.orelse, b):
                return True
            if not a_in_body and ctx.contains(anc.orelse, a) and ctx.contains(anc.body, b):
                return True
    return False


BASELINE_NAME = re.compile(r"(?i)\w*(mean|avg|average|baseline|values?|vpreds?|v_preds?|bias)\w*|v|b|mu|base")


def is_baseline(ctx: ModuleContext, term: cst.BaseExpression) -> bool:
    """A term subtracted as a baseline: a mean, a value estimate (``values``, ``baseline``, ``rewards.mean()``)."""
    for _ in range(4):
        if isinstance(term, cst.Call):
            func = term.func
            called = func.attr.value if isinstance(func, cst.Attribute) else (
                func.value if isinstance(func, cst.Name) else "")
            return bool(BASELINE_NAME.fullmatch(called or "")) or called in ("mean", "nanmean")
        name = value_name(term)
        if name is None:
            return False
        if BASELINE_NAME.fullmatch(name.rsplit(".", 1)[-1]):
            return True
        key = dotted_name(term)
        assigns = reaching(ctx, key, term) if key else []
        if len(assigns) != 1 or assigns[0].value is None:
            return False
        term = assigns[0].value
    return False


def _terms(expr: cst.BaseExpression, sign: int = 1) -> list[tuple[int, cst.BaseExpression]]:
    """Split a sum into signed terms (products stay whole; their negated factors are handled by sign_of)."""
    while isinstance(expr, cst.UnaryOperation) and isinstance(expr.operator, (cst.Minus, cst.Plus)):
        if isinstance(expr.operator, cst.Minus):
            sign = -sign
        expr = expr.expression
    if isinstance(expr, cst.BinaryOperation) and isinstance(expr.operator, (cst.Add, cst.Subtract)):
        right = sign if isinstance(expr.operator, cst.Add) else -sign
        return _terms(expr.left, sign) + _terms(expr.right, right)
    return [(sign, expr)]


class SignSearch:
    """One search for values matching ``matches`` (a predicate over names); ``sign_of`` is the entry point."""

    def __init__(self, ctx: ModuleContext, matches: Matcher, stop: Callable[[str], bool] | None = None,
                 skip_term: Callable[[cst.BaseExpression], bool] | None = None):
        self.ctx = ctx
        self.skip_term = skip_term  # terms of a sum to ignore (e.g. baselines: rewards - baseline)
        self.matches = matches
        self.stop = stop  # names never followed nor matched (e.g. coefficients)
        self.path: list[cst.CSTNode] = []  # assignment statements on the way to the current match
        self.via: list[cst.CSTNode] = []

    def sign_of(self, expr: cst.BaseExpression | None, env: Env | None = None, depth: int = SIGN_DEPTH) -> int | None:
        self.path, self.via = [], []
        return self._sign(expr, env or {}, depth)

    # ------------------------------------------------------------------------------------------------
    def _sign(self, expr, env, depth) -> int | None:
        if expr is None or depth < 0:
            return None
        terms = _terms(expr)
        if len(terms) > 1:
            for sign, term in terms:
                if self.skip_term is not None and self.skip_term(term):
                    continue
                inner = self._sign(term, env, depth - 1)
                if inner is not None:
                    return sign * inner
            return None
        sign, expr = terms[0]
        if isinstance(expr, cst.BinaryOperation):
            if isinstance(expr.operator, (cst.Multiply, cst.Divide, cst.MatrixMultiply)):
                for side, other in ((expr.left, expr.right), (expr.right, expr.left)):
                    inner = self._sign(side, env, depth - 1)
                    if inner is not None:
                        return -sign * inner if _negated(other) else sign * inner
            return None
        if isinstance(expr, cst.Call):
            inner = self._call(expr, env, depth)
            return None if inner is None else sign * inner
        if isinstance(expr, (cst.Name, cst.Attribute, cst.Subscript)):
            inner = self._named(expr, env, depth)
            return None if inner is None else sign * inner
        if isinstance(expr, (cst.IfExp,)):
            a = self._sign(expr.body, env, depth - 1)
            b = self._sign(expr.orelse, env, depth - 1)
            if a is not None and (b is None or a == b):
                return sign * a
            if b is not None and a is None:
                return sign * b
        return None

    def _call(self, call: cst.Call, env, depth) -> int | None:
        ctx = self.ctx
        func = call.func
        called = func.attr.value if isinstance(func, cst.Attribute) else (
            func.value if isinstance(func, cst.Name) else None)
        if called is not None and self.stop is not None and self.stop(called):
            return None
        kind = min_max_kind(ctx, call)
        if kind is not None:
            a = self._sign(call.args[0].value, env, depth - 1)
            b = self._sign(call.args[1].value, env, depth - 1)
            if a is not None and (b is None or a == b):
                return a
            return b if a is None else None
        if isinstance(func, cst.Name) and len(ctx.functions.get(func.value, ())) == 1:
            inner = self._helper(call, env, depth)
            if inner is not None:
                return inner
        if called is not None and self.matches(called):
            return 1
        if isinstance(func, cst.Attribute):
            name = ctx.call_name(call)
            if called in REDUCTIONS or called in SIGN_KEEPING_METHODS or strip_wrappers(ctx, call) is not call:
                if name not in SIGN_KEEPING_FUNCTIONS:
                    return self._sign(func.value, env, depth - 1)
            if name in SIGN_KEEPING_FUNCTIONS and call.args:
                return self._sign(call.args[0].value, env, depth - 1)
            return None
        if isinstance(func, cst.Name) and call.args and func.value not in ctx.functions and (
                func.value not in NOT_SIGN_CARRIERS):
            # a function of another module (masked_mean(x, mask), aggregate(x, ...)): its first argument
            if called in REDUCTIONS or not _looks_like_constructor(func.value):
                return self._sign(call.args[0].value, env, depth - 1)
        return None

    def _helper(self, call: cst.Call, env, depth) -> int | None:
        ctx = self.ctx
        fdef = ctx.functions[call.func.value][0]
        if ctx.contains(fdef, call):  # recursion
            return None
        info = ctx.scopes[id(fdef)]
        bindings: dict[str, tuple] = {}
        positional = [a for a in call.args if a.keyword is None and not a.star]
        params = info.params
        if params and params[0] in ("self", "cls") and isinstance(call.func, cst.Attribute):
            params = params[1:]
        for i, name in enumerate(params):
            if i < len(positional):
                bindings[name] = (positional[i].value, env)
        for arg in call.args:
            if arg.keyword is not None and arg.keyword.value in params:
                bindings[arg.keyword.value] = (arg.value, env)
        for ret in info.returns:
            if ret.value is None:
                continue
            inner = self._sign(ret.value, bindings, depth - 1)
            if inner is not None:
                return inner
        return None

    def _named(self, expr, env, depth) -> int | None:
        ctx = self.ctx
        name = value_name(expr)
        if name is not None and self.stop is not None and self.stop(name):
            return None
        key = dotted_name(expr)
        if key is not None and (isinstance(expr, cst.Name) or key.startswith("self.")):
            assigns = reaching(ctx, key, expr)
            for assignment in assigns:
                if assignment.value is not None and assignment.unpacked is None:
                    self.path.append(assignment.statement)
                    inner = self._sign(assignment.value, env, depth - 1)
                    if inner is not None:
                        if not self.via:
                            self.via = list(self.path)
                        self.path.pop()
                        return inner
                    self.path.pop()
            if not assigns and isinstance(expr, cst.Name) and key in env:
                arg, outer_env = env[key]
                inner = self._sign(arg, outer_env, depth - 1)
                if inner is not None:
                    return inner
        if isinstance(expr, cst.Subscript) and value_name(expr) is None:
            inner = self._sign(expr.value, env, depth - 1)
            if inner is not None:
                return inner
        if name is not None and self.matches(name):
            if not self.via:
                self.via = list(self.path)
            return 1
        return None


def _negated(expr: cst.BaseExpression) -> bool:
    return isinstance(expr, cst.UnaryOperation) and isinstance(expr.operator, cst.Minus)


def _looks_like_constructor(name: str) -> bool:
    return name[:1].isupper()


def role_matcher(ctx: ModuleContext, *roles: str, exclude: tuple[str, ...] = ()) -> Matcher:
    def matches(name: str) -> bool:
        return any(ctx.names.is_role(name, r) for r in roles) and not any(ctx.names.is_role(name, r) for r in exclude)
    return matches


def role_stop(ctx: ModuleContext, *roles: str) -> Callable[[str], bool]:
    def stop(name: str) -> bool:
        return any(ctx.names.is_role(name, r) for r in roles)
    return stop


# ----- statements ----------------------------------------------------------------------------------------
def sum_statements(ctx: ModuleContext) -> Iterator[tuple[cst.BaseExpression, cst.BaseExpression, cst.CSTNode]]:
    """``target = value`` and ``target += / -= value`` (the latter as ``target = (-)value``, synthetic), in
    source order."""
    for stmt in ctx.nodes(cst.Assign, cst.AugAssign):
        if isinstance(stmt, cst.Assign):
            if len(stmt.targets) == 1:
                yield stmt.targets[0].target, stmt.value, stmt
        elif isinstance(stmt.operator, (cst.AddAssign, cst.SubtractAssign)):
            negative = isinstance(stmt.operator, cst.SubtractAssign)
            value = cst.UnaryOperation(cst.Minus(), stmt.value) if negative else stmt.value
            yield stmt.target, value, stmt


def loss_candidate_filter(ctx: ModuleContext):
    """A cheap test run before ``is_minimised_loss`` (which scans the scope's ``.backward()`` calls): the target
    is named like a loss, or its scope has a ``.backward()`` call at all."""
    from rlguard.lint.rules._loss import LOSS_NAME

    scopes = {id(ctx.scope_of(call).node) for call in ctx.nodes(cst.Call)
              if isinstance(call.func, cst.Attribute) and call.func.attr.value == "backward"}

    def may_be_loss(target: cst.BaseExpression, stmt: cst.CSTNode) -> bool:
        key = target_key(target)
        if key is None:
            return False
        if LOSS_NAME.fullmatch(key.rsplit(".", 1)[-1]):
            return True
        return bool(scopes) and id(ctx.scope_of(stmt).node) in scopes
    return may_be_loss


def target_key(target: cst.BaseExpression) -> str | None:
    """The variable an assignment writes: ``x``, ``self.x``, ``rewards`` for ``rewards[:, -1]``."""
    while isinstance(target, cst.Subscript):
        target = target.value
    name = dotted_name(target)
    if name is not None:
        return name
    return value_name(target)


def flip(stmt: cst.CSTNode, value: cst.BaseExpression, term: cst.BaseExpression):
    """A replacement flipping the sign of ``term``: ``+ term`` <-> ``- term`` when it is the right operand of
    the top-level sum, ``+=`` <-> ``-=`` for an augmented assignment of it. Empty when not unambiguous."""
    if isinstance(stmt, cst.AugAssign) and (stmt.value is term or _unwrap_minus(value) is term):
        op = stmt.operator
        new = cst.SubtractAssign if isinstance(op, cst.AddAssign) else cst.AddAssign
        return [(op, new(whitespace_before=op.whitespace_before, whitespace_after=op.whitespace_after))]
    expr = value
    while isinstance(expr, cst.BinaryOperation) and isinstance(expr.operator, (cst.Add, cst.Subtract)):
        if expr.right is term:
            op = expr.operator
            new = cst.Subtract if isinstance(op, cst.Add) else cst.Add
            return [(op, new(whitespace_before=op.whitespace_before, whitespace_after=op.whitespace_after))]
        expr = expr.left
    return []


def _unwrap_minus(expr):
    if isinstance(expr, cst.UnaryOperation) and isinstance(expr.operator, cst.Minus):
        return expr.expression
    return expr


def int_value(expr: cst.BaseExpression | None) -> int | None:
    """``1`` -> 1, ``-1`` -> -1; None for anything else."""
    if isinstance(expr, cst.Integer):
        return int(expr.value)
    if isinstance(expr, cst.UnaryOperation) and isinstance(expr.operator, cst.Minus) and isinstance(
            expr.expression, cst.Integer):
        return -int(expr.expression.value)
    return None


def reduction_dim(call: cst.Call) -> tuple[bool, int | None]:
    """(has a dim argument, its integer value if literal) for ``x.mean(dim=1)``, ``x.sum(-1)``, ``torch.mean(x, 1)``."""
    for arg in call.args:
        if arg.keyword is not None and arg.keyword.value in ("dim", "axis"):
            return True, int_value(arg.value)
    positional = [a for a in call.args if a.keyword is None and not a.star]
    index = 0 if isinstance(call.func, cst.Attribute) and method_name(call) not in (None,) and not _is_torch_fn(
        call) else 1
    if len(positional) > index:
        return True, int_value(positional[index].value)
    return False, None


def _is_torch_fn(call: cst.Call) -> bool:
    recv = receiver(call)
    return isinstance(recv, cst.Name) and recv.value in ("torch", "th", "np", "numpy")


def strip_parens_and_wrappers(ctx: ModuleContext, expr: cst.BaseExpression) -> cst.BaseExpression:
    for _ in range(12):
        inner = strip_wrappers(ctx, expr)
        if inner is expr:
            return expr
        expr = inner
    return expr


NAME_CHARS = re.compile(r"\w+")
