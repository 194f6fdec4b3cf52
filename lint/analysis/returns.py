"""Temporal-difference structure: which values a one-step TD error reads as its reward, and which value an
advantage is computed from (the minuend of ``returns - values``).

A TD error (the heart of GAE) is ``r_t + gamma * V_{t+1} - V_t``: the same value tensor read at step ``t + 1``
(scaled by a discount) and at step ``t`` (subtracted), and one more term, the reward at step ``t``:

    delta = rewards[:, t] + gamma * next_values - values[:, t]     # next_values = values[:, t + 1] (or 0 at the end)

That shape says which tensor is the per-step reward, whatever the variables are called (a KL-shaped reward kept
in ``non_score_reward`` and copied into the tensor the TD error reads is a reward by this use).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import libcst as cst

from rlguard.lint.analysis.index import key_of
from rlguard.lint.analysis.losses import top_terms
from rlguard.lint.analysis.uses import reads_of

if TYPE_CHECKING:
    from rlguard.lint.analysis import Analysis

_SUM = (cst.Add, cst.Subtract)
COPY_METHODS = frozenset({"clone", "detach", "float", "to", "contiguous", "double"})


def td_reward_reads(a: "Analysis") -> dict[str, list[cst.BaseExpression]]:
    """Per module: the reads (``rewards`` of ``rewards[:, t]``) a TD error takes as its reward, by flow key."""
    def build(an):
        found: dict[str, list[cst.BaseExpression]] = {}
        for op in an.nodes(cst.BinaryOperation):
            if not isinstance(op.operator, _SUM):
                continue
            parent = an.index.parent_of(op)
            if isinstance(parent, cst.BinaryOperation) and isinstance(parent.operator, _SUM):
                continue  # only the whole sum
            reward = _reward_term(an, top_terms(op))
            if reward is None:
                continue
            read = reward.value if isinstance(reward, cst.Subscript) else reward
            key = key_of(read)
            if key is not None:
                found.setdefault(key, []).append(read)
        return found
    return a.facet("td_reward_reads", build)


def _reward_term(a: "Analysis", terms) -> cst.BaseExpression | None:
    """The reward of ``r + g * V[t + 1] - V[t]`` (any order of the terms), else None."""
    if len(terms) != 3:
        return None
    subtracted = [t for s, t in terms if s < 0]
    added = [t for s, t in terms if s > 0]
    if len(subtracted) != 1 or len(added) != 2:
        return None
    now = _step_read(a, subtracted[0])
    if now is None:
        return None
    base, step = now
    for i, term in enumerate(added):
        if not (isinstance(term, cst.BinaryOperation) and isinstance(term.operator, cst.Multiply)):
            continue
        for factor in _factors(term):  # `gamma * V[:, t + 1] * (1 - done[:, t])`: any factor of the product
            if _next_of(a, factor, base, step):
                other = added[1 - i]
                at = _step_read(a, other)
                return other if (at is not None and at[1] == step) or isinstance(other, cst.Name) else None
    return None


def _factors(expr) -> list[cst.BaseExpression]:
    """The factors of a product, nested products flattened (parentheses are not nodes in libcst)."""
    if isinstance(expr, cst.BinaryOperation) and isinstance(expr.operator, cst.Multiply):
        return _factors(expr.left) + _factors(expr.right)
    return [expr]


def _step_read(a: "Analysis", expr) -> tuple[str, str] | None:
    """``(key of x, "t")`` for ``x[..., t]`` / ``x[t]`` with a name as the last index."""
    if not isinstance(expr, cst.Subscript) or not expr.slice:
        return None
    last = expr.slice[-1].slice
    if not isinstance(last, cst.Index) or not isinstance(last.value, cst.Name):
        return None
    key = key_of(expr.value)
    return (key, last.value.value) if key is not None else None


def _next_of(a: "Analysis", expr, base: str, step: str, depth: int = 2) -> bool:
    """Whether ``expr`` is ``base[..., step + 1]``, directly or through a name every reaching definition of which
    gives it (``next_v = values[:, t + 1] if t < n - 1 else 0.0``: the constant closes the last step)."""
    if isinstance(expr, cst.Subscript) and key_of(expr.value) == base and expr.slice:
        last = expr.slice[-1].slice
        value = last.value if isinstance(last, cst.Index) else None
        return isinstance(value, cst.BinaryOperation) and isinstance(value.operator, cst.Add) and \
            isinstance(value.left, cst.Name) and value.left.value == step and \
            isinstance(value.right, cst.Integer) and value.right.value == "1"
    if isinstance(expr, cst.IfExp):
        sides = [s for s in (expr.body, expr.orelse) if not isinstance(s, (cst.Integer, cst.Float))]
        return bool(sides) and all(_next_of(a, s, base, step, depth) for s in sides)
    if isinstance(expr, cst.Name) and depth > 0:
        defs = a.flow.reaching(expr.value, expr)
        return bool(defs) and all(d.kind == "assign" and d.element is None and d.value is not None and
                                  _next_of(a, d.value, base, step, depth - 1) for d in defs)
    return False


def enters_td_reward(a: "Analysis", d) -> bool:
    """Whether the value bound by ``d`` is read by a TD error as its reward, itself or through a copy made of it
    (``rewards = non_score_reward.clone()``, then ``rewards[:, t] + gamma * ...``)."""
    td_reads = td_reward_reads(a)
    if not td_reads or "." in d.key or "[" in d.key:
        return False
    bindings = [d]
    for read in reads_of(a, d):
        value = read
        parent = a.index.parent_of(value)
        while isinstance(parent, cst.Attribute) and parent.value is value:
            call = a.index.parent_of(parent)
            if not (isinstance(call, cst.Call) and call.func is parent and parent.attr.value in COPY_METHODS):
                break
            value, parent = call, a.index.parent_of(call)
        if isinstance(parent, cst.Assign) and parent.value is value:
            bindings += [c for c in a.index.stmt_defs.get(id(parent), ()) if c.kind == "assign" and c.element is None]
    for b in bindings:
        wanted = {id(r) for r in td_reads.get(b.key, ())}
        if wanted and any(id(r) in wanted for r in reads_of(a, b)):
            return True
    return False


# single-tensor steps that keep what a value is (a reshape, a copy, an einops rearrangement)
_SAME_VALUE_CALLS = frozenset({"rearrange", "view", "reshape", "unsqueeze", "squeeze", "flatten", "expand",
                               "expand_as", "repeat"}) | COPY_METHODS


def advantage_minuend(a: "Analysis", d, depth: int = 2) -> bool:
    """Whether the value bound by ``d`` is what an advantage is computed from: the minuend of ``x - b`` whose
    result (normalised or not) is bound to a value that weighs a PPO clip or meets an interface named for
    advantages (``advantages = masked_normalize(rewards - old_values)``). The baseline is subtracted from the
    return or reward, whatever each is called; a reshape or copy on the way keeps the value
    (``rewards = rearrange(rewards, 'b -> b 1')``)."""
    from rlguard.lint.analysis.roles import target_role_by_use

    if "." in d.key or "[" in d.key or d.key not in _minuend_names(a):
        return False
    for read in reads_of(a, d):
        node, parent = read, a.index.parent_of(read)
        if isinstance(parent, cst.Arg):
            parent = a.index.parent_of(parent)
        step = _same_value_step(a, node, parent)
        if step is not None:
            if depth > 0 and any(advantage_minuend(a, b, depth - 1) for b in _bound_by(a, step)):
                return True
            continue
        if not (isinstance(parent, cst.BinaryOperation) and isinstance(parent.operator, cst.Subtract)
                and parent.left is node):
            continue
        if any(_advantages(a, b, target_role_by_use) for b in _bound_by(a, _whole_value(a, parent))):
            return True
    return False


def _whole_value(a: "Analysis", node):
    """The whole expression ``node`` is computed into, through calls and arithmetic (a normalisation, a division
    by a standard deviation)."""
    for _ in range(5):
        up = a.index.parent_of(node)
        if isinstance(up, cst.Arg):
            up = a.index.parent_of(up)
        if not isinstance(up, (cst.Call, cst.BinaryOperation, cst.UnaryOperation)):
            break
        node = up
    return node


def _advantages(a: "Analysis", d, role_by_use, depth: int = 2) -> bool:
    """Whether ``d`` binds the advantages by use, itself or through what is computed from it
    (``adv = r - v`` then ``adv = (adv - adv.mean()) / adv.std()``, the normalised value weighing the clip)."""
    if role_by_use(a, d) == "advantages":
        return True
    return depth > 0 and any(_advantages(a, b, role_by_use, depth - 1)
                             for read in reads_of(a, d) for b in _bound_by(a, _whole_value(a, read)))


def _minuend_names(a: "Analysis") -> frozenset[str]:
    """Names an advantage may be computed from: the left operand of a subtraction whose result is bound to the
    advantages by use, and names reshaped or copied into one of those (two steps): a cheap necessary condition for
    :func:`advantage_minuend`, which every assignment is asked."""
    from rlguard.lint.analysis.roles import target_role_by_use

    def build(an):
        found = set()
        for op in an.nodes(cst.BinaryOperation):
            if isinstance(op.operator, cst.Subtract) and isinstance(op.left, cst.Name) and op.left.value not in found:
                if any(_advantages(an, b, target_role_by_use) for b in _bound_by(an, _whole_value(an, op))):
                    found.add(op.left.value)
        for _ in range(2):
            for call in an.nodes(cst.Call):
                func = call.func
                if isinstance(func, cst.Attribute) and func.attr.value in _SAME_VALUE_CALLS:
                    source = func.value
                elif isinstance(func, cst.Name) and func.value in _SAME_VALUE_CALLS and call.args:
                    source = call.args[0].value
                else:
                    continue
                if isinstance(source, cst.Name) and any(b.key in found for b in _bound_by(an, call)):
                    found.add(source.value)
        return frozenset(found)
    return a.facet("minuend_names", build)


def _same_value_step(a: "Analysis", node, parent) -> cst.Call | None:
    """``parent`` when it is a call that hands ``node``'s value on reshaped or copied (``rearrange(x, ...)``,
    ``x.view(...)``, ``x.clone()``)."""
    if not isinstance(parent, cst.Call):
        return None
    func = parent.func
    if isinstance(func, cst.Attribute) and func.value is node and func.attr.value in _SAME_VALUE_CALLS:
        return parent
    if isinstance(func, cst.Name) and func.value in _SAME_VALUE_CALLS and parent.args and parent.args[0].value is node:
        return parent
    return None


def _bound_by(a: "Analysis", value) -> list:
    """The plain bindings of the statement whose whole value is ``value``."""
    stmt = a.index.parent_of(value)
    if not isinstance(stmt, cst.Assign) or stmt.value is not value:
        return []
    return [b for b in a.index.stmt_defs.get(id(stmt), ()) if b.kind == "assign" and b.element is None]
