"""Shared reasoning about losses and signs, for the sign rules (RLG004, RLG005, RLG011) and others."""

from __future__ import annotations

import re

import libcst as cst

from rlguard.lint.context import (ModuleContext, dotted_name, iter_calls, receiver, signed_terms,
                                  strip_wrappers, value_name)

LOSS_NAME = re.compile(r"(?i)(\w+_)?loss(es)?(_\w+)?|cost|total")
MAXIMISED_NAME = re.compile(r"(?i)\w*(objective|surrogate|reward|return|score|gain|utility|elbo)s?\w*")
REDUCTIONS = frozenset({"mean", "sum", "nanmean", "nansum", "masked_mean", "masked_sum", "masked_whiten",
                        "mean_tokens"})
SIGN_DEPTH = 8


def target_name(target: cst.BaseExpression) -> str | None:
    return dotted_name(target) or value_name(target)


def is_minimised_loss(ctx: ModuleContext, target: cst.BaseExpression, stmt: cst.CSTNode) -> bool:
    """Whether the value assigned to ``target`` is minimised: it is named like a loss (and not like an
    entropy/KL component or a maximised objective), or it flows positively into a ``.backward()`` call."""
    name = target_name(target)
    if name is None:
        return False
    bare = name.rsplit(".", 1)[-1]
    if ctx.names.is_role(bare, "entropy") or ctx.names.is_role(bare, "kl") or MAXIMISED_NAME.fullmatch(bare):
        return _backwarded_sign(ctx, name, stmt) == 1
    if LOSS_NAME.fullmatch(bare):
        return _backwarded_sign(ctx, name, stmt) != -1
    return _backwarded_sign(ctx, name, stmt) == 1


def _backwarded_sign(ctx: ModuleContext, name: str, stmt: cst.CSTNode) -> int | None:
    """+1 when ``name`` is backpropagated as is, -1 when negated, None when it never reaches ``.backward()``."""
    scope = ctx.scope_of(stmt)
    for call in iter_calls(ctx, "backward"):
        if ctx.scope_of(call) is not scope:
            continue
        recv = receiver(call)
        sign = net_sign_of_name(ctx, recv, name)
        if sign is not None:
            return sign
    return None


def net_sign_of_name(ctx: ModuleContext, expr: cst.BaseExpression | None, name: str,
                     depth: int = SIGN_DEPTH) -> int | None:
    """The sign with which the variable ``name`` enters ``expr`` (following aliases), None if it does not."""
    return _sign(ctx, expr, lambda n: n == name, depth)


def net_sign(ctx: ModuleContext, expr: cst.BaseExpression | None, role: str, depth: int = SIGN_DEPTH) -> int | None:
    """+1 if ``expr`` is a positive multiple of a value playing ``role`` (entropy, kl, advantages...), -1 if a
    negative one, None if no such value is in it. Follows aliases, reductions and helper calls whose name
    plays the role (``entropy_from_logits(...)``, ``dist.entropy()``)."""
    return _sign(ctx, expr, lambda n: ctx.names.is_role(n, role), depth)


def _sign(ctx, expr, matches, depth) -> int | None:
    if expr is None or depth < 0:
        return None
    terms = signed_terms(expr)
    if len(terms) > 1:
        for sign, term in terms:
            inner = _sign(ctx, term, matches, depth - 1)
            if inner is not None:
                return sign * inner
        return None
    sign, expr = terms[0]
    while isinstance(expr, cst.UnaryOperation) and isinstance(expr.operator, cst.Minus):
        sign, expr = -sign, expr.expression
    if isinstance(expr, cst.BinaryOperation) and isinstance(expr.operator, (cst.Multiply, cst.Divide)):
        for side in (expr.left, expr.right):
            inner = _sign(ctx, side, matches, depth - 1)
            if inner is not None:
                return sign * inner
        return None
    if isinstance(expr, cst.Call):
        func = expr.func
        called = func.attr.value if isinstance(func, cst.Attribute) else (
            func.value if isinstance(func, cst.Name) else None)
        if called is not None and matches(called):
            return sign
        if isinstance(func, cst.Attribute) and (called in REDUCTIONS or strip_wrappers(ctx, expr) is not expr):
            inner = _sign(ctx, func.value, matches, depth - 1)
            if inner is not None:
                return sign * inner
        if called in REDUCTIONS or isinstance(func, cst.Name) or ctx.call_name(expr) in (
                "torch.mean", "torch.sum", "torch.nn.functional.pad"):
            for ret in ctx.helper_return_values(expr) or [a.value for a in expr.args[:1]]:
                inner = _sign(ctx, ret, matches, depth - 1)
                if inner is not None:
                    return sign * inner
        return None
    if isinstance(expr, (cst.Name, cst.Attribute, cst.Subscript)):
        key = dotted_name(expr)
        if key is not None and (isinstance(expr, cst.Name) or key.startswith("self.")):
            for assignment in ctx.reaching_assignments(key, expr):
                if assignment.value is not None and assignment.unpacked is None:
                    inner = _sign(ctx, assignment.value, matches, depth - 1)
                    if inner is not None:
                        return sign * inner
        if isinstance(expr, cst.Subscript) and value_name(expr) is None:
            inner = _sign(ctx, expr.value, matches, depth - 1)
            if inner is not None:
                return sign * inner
        # unassigned (a parameter) or assigned from something unreadable (another module's call): trust the name
        name = value_name(expr)
        if name is not None and matches(name):
            return sign
    return None
