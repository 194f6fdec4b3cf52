"""What is minimised: the loss *sinks* of a module, and where a term joins them.

A value is a minimised loss when the code shows it:

- it is what a ``.backward()`` propagates (``loss.backward()``, ``accelerator.backward(loss)``,
  ``scaler.scale(loss).backward()``);
- it is returned by a loss function: a function named for a loss (``compute_policy_loss``, ``loss_fn``), a
  ``forward`` of a class named for one (``class PolicyLoss(nn.Module)``), or a function whose return a
  ``.backward()`` of the module propagates (``self.step_loss(b).backward()``);
- in preview only (:attr:`Sink.inferred`): it is bound to a loss-named variable (``loss``, ``pg_loss``,
  ``total_loss``) that is not used afterwards except to be returned, logged or handed to code out of view: the end
  of a loss computation whose backward lies elsewhere. A local variable's name is a hint, not proof: renaming the
  variable must not change what the stable rules say, so findings that rest on such a sink alone are preview
  findings. A value only logged, only ``.item()``-ed, stored in a metrics dict or computed under ``no_grad`` is a
  metric, never a loss.

Sign rules decompose each sink into signed terms (:mod:`~rlguard.lint.analysis.signs`) and judge the terms; a
fault is reported once, at the statement where the offending term joins a sum.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

import libcst as cst

from rlguard.lint.analysis import semantics as S
from rlguard.lint.analysis.grad import grad_context
from rlguard.lint.analysis.index import Def, key_of
from rlguard.lint.analysis.roles import backward_calls, backward_loss
from rlguard.lint.analysis.signs import Term

if TYPE_CHECKING:
    from rlguard.lint.analysis import Analysis

LOSS_NAME = re.compile(r"(?i)(\w+_)?loss(es)?(_\w+)?|total|cost|objective_loss")
LOSS_FUNCTION = re.compile(r"(?i)\w*loss\w*|\w*_objective|objective")
LOSS_CLASS = re.compile(r"(?i)\w*loss\w*")
# Calls that only record a value: logging, printing, progress bars, metric lists.
METRIC_CALL = re.compile(r"(?i)print|log|log_\w+|\w*_log|logger\.\w+|info|debug|warning|set_postfix|set_description|"
                         r"append|extend|add_scalar\w*|record\w*|update_metrics?|track\w*|report\w*|format|str|repr|"
                         r"float|int|round|isfinite|isnan|assert\w*|all_reduce|gather\w*|reduce\w*")
METRIC_METHODS = frozenset({"item", "tolist", "detach", "cpu", "numpy"})


@dataclass(frozen=True, eq=False)
class Sink:
    expr: cst.BaseExpression  # the minimised value (for "named": the value the definition binds)
    node: cst.CSTNode  # the backward call, return statement or assignment
    kind: str  # "backward", "return", "named"
    defn: Def | None = None  # for "named": the definition of the loss-named variable

    @property
    def inferred(self) -> bool:
        """Whether only a local variable's name makes this value a loss (a preview sink: see the module doc)."""
        return self.kind == "named"

    def terms(self, sign_of, stop=None):
        """The sink's value as signed terms."""
        if self.defn is not None:
            return sign_of.def_terms(self.defn, None, stop)
        return sign_of.terms(self.expr, None, stop)


class Losses:
    def __init__(self, a: "Analysis"):
        self.a = a
        self._sinks: list[Sink] | None = None

    def sinks(self) -> list[Sink]:
        if self._sinks is None:
            self._sinks = self._find()
        return self._sinks

    def _find(self) -> list[Sink]:
        a = self.a
        grad = grad_context(a)
        found: list[Sink] = []
        backwarded_functions: set[int] = set()
        for call in backward_calls(a):
            loss = backward_loss(call, a)
            if loss is None or _vector_jacobian(call, loss):
                continue
            found.append(Sink(loss, call, "backward"))
            inner = loss
            while isinstance(inner, cst.Call) and a.method(inner) in ("mean", "sum", "float"):
                inner = S.receiver(inner)
            if isinstance(inner, cst.Call):
                func = a.callee(inner)
                if func is not None:
                    backwarded_functions.add(id(func))
        for func in a.nodes(cst.FunctionDef):
            if not (id(func) in backwarded_functions or self.is_loss_function(func)):
                continue
            for ret in a.index.scopes[id(func)].returns:
                if ret.value is None or a.index.function_scope(ret).node is not func:
                    continue
                value = ret.value
                if isinstance(value, cst.Tuple) and value.elements:
                    value = value.elements[0].value  # (loss, metrics)
                if grad.enabled(ret) is not False:
                    found.append(Sink(value, ret, "return"))
        for stmt in a.nodes(cst.Assign, cst.AnnAssign, cst.AugAssign):
            for d in a.index.stmt_defs.get(id(stmt), ()):
                if d.kind not in ("assign", "aug") or d.element is not None or "[" in d.key:
                    continue
                if not LOSS_NAME.fullmatch(d.key.rsplit(".", 1)[-1]) or d.key.startswith(("self.", "cls.")):
                    continue
                if grad.enabled(stmt) is False or not self._terminal(d):
                    continue
                found.append(Sink(stmt.value, stmt, "named", d))
        return found

    def is_loss_function(self, func: cst.FunctionDef) -> bool:
        name = func.name.value
        if LOSS_FUNCTION.fullmatch(name) and not name.startswith(("log", "_log", "record", "report")):
            return True
        if name in ("forward", "__call__"):
            cls = self.a.enclosing_class(func)
            return cls is not None and LOSS_CLASS.fullmatch(cls.name.value) is not None
        return False

    def _terminal(self, d: Def) -> bool:
        """Whether the loss-named value bound by ``d`` ends a computation: no later use feeds another value,
        and it is not only recorded (a metric)."""
        uses = self.uses(d)
        if not uses:
            return True
        recorded = 0
        for use in uses:
            kind = self._use_kind(use)
            if kind == "feeds":
                return False
            if kind == "metric":
                recorded += 1
        return recorded < len(uses)

    def uses(self, d: Def) -> list[cst.BaseExpression]:
        """The reads of ``d.key`` that ``d`` reaches (in its function)."""
        a = self.a
        scope = a.index.function_scope(d.stmt).node
        nodes = a.index.descendants(scope, cst.Name) if scope is not a.module else a.nodes(cst.Name)
        found = []
        for node in nodes:
            if node.value != d.key or a.index.order[id(node)] <= a.index.order[id(d.stmt)] and not a.enclosing_loops(node):
                continue
            parent = a.index.parent_of(node)
            if isinstance(parent, (cst.AssignTarget,)) or (isinstance(parent, cst.AugAssign) and parent.target is node):
                continue
            if any(r is d for r in a.flow.reaching(d.key, node)):
                found.append(node)
        return found

    def _use_kind(self, use: cst.BaseExpression) -> str:
        """"metric" (only recorded), "returned", "backward", "other" (handed to code out of view) or "feeds"
        (part of another value)."""
        a = self.a
        node = use
        parent = a.index.parent_of(node)
        while parent is not None:
            if isinstance(parent, cst.Call):
                if node is parent.func or (isinstance(parent.func, cst.Attribute) and parent.func.value is node):
                    method = a.method(parent)
                    if method in METRIC_METHODS:
                        return "metric"
                    if method in S.BACKWARD_METHODS:
                        return "backward"
                    node, parent = parent, a.index.parent_of(parent)
                    continue
                name = S.called_name(parent) or ""
                if METRIC_CALL.fullmatch(name):
                    return "metric"
                if name in S.BACKWARD_METHODS:
                    return "backward"
                return "other"
            if isinstance(parent, (cst.Arg, cst.Attribute)) and not isinstance(parent, cst.Call):
                node, parent = parent, a.index.parent_of(parent)
                continue
            if isinstance(parent, cst.Return):
                return "returned"
            if isinstance(parent, (cst.DictElement, cst.Dict, cst.FormattedStringExpression, cst.FormattedString)):
                return "metric"
            if isinstance(parent, (cst.Assign, cst.AnnAssign, cst.AugAssign)):
                targets = [t.target for t in parent.targets] if isinstance(parent, cst.Assign) else [parent.target]
                if all(isinstance(t, cst.Subscript) for t in targets):
                    return "metric"  # stats["loss"] = loss
                return "feeds"
            if isinstance(parent, (cst.BaseSmallStatement, cst.BaseCompoundStatement)):
                return "other" if not isinstance(parent, (cst.If, cst.While, cst.Assert)) else "metric"
            node, parent = parent, a.index.parent_of(parent)
        return "other"

    # ----- where a term joins -------------------------------------------------------------------------------
    def joining(self, sink: Sink, term: Term) -> tuple[cst.CSTNode, cst.BaseExpression, cst.BaseExpression]:
        """(statement, its value, the operand of its top-level sum) where ``term`` joins a sum on its way into
        ``sink``: the innermost statement on the way whose value adds several terms (or ``+=`` one)."""
        entries: list[tuple[cst.CSTNode, cst.BaseExpression, cst.BaseExpression]] = []
        sink_stmt = sink.node
        sink_value = sink.expr if sink.kind != "named" else _value(sink.node)
        chain = [(sink_stmt, sink_value)] + [(stmt, _value(stmt)) for _, stmt in term.via]
        reads = [read for read, _ in term.via] + [term.expr]
        for (stmt, value), inner in zip(chain, reads):
            if value is None:
                continue
            operand = _operand_containing(self.a, value, inner)
            if isinstance(stmt, cst.AugAssign) and isinstance(stmt.operator, (cst.AddAssign, cst.SubtractAssign)):
                entries.append((stmt, value, operand or stmt.value))
            elif operand is not None and len(top_terms(value)) > 1:
                entries.append((stmt, value, operand))
        if entries:
            return entries[-1]
        return sink_stmt, sink_value, sink_value


def _vector_jacobian(call: cst.Call, loss: cst.BaseExpression) -> bool:
    """``y.backward(grad_output)``: a vector-Jacobian product (a test of gradients), not a loss minimised."""
    receiver = S.receiver(call)
    positional = [arg for arg in call.args if arg.keyword is None]
    return receiver is loss and bool(positional) or any(
        arg.keyword is not None and arg.keyword.value == "gradient" for arg in call.args)


def sink_name(a: "Analysis", sink: Sink) -> str | None:
    """The name a sink is known by: its variable, or the function that returns it."""
    if sink.defn is not None:
        return sink.defn.key.rsplit(".", 1)[-1]
    if sink.kind == "return":
        func = a.index.function_scope(sink.node).node
        return func.name.value if isinstance(func, cst.FunctionDef) else None
    key = key_of(sink.expr)
    return key.rsplit(".", 1)[-1] if key else None


MAXIMISED_NAME = re.compile(r"(?i)\w*(objective|surrogate|reward|return|score|gain|utility|elbo)s?\w*")


def start(a: "Analysis", sink: Sink, term: Term) -> tuple[cst.CSTNode, cst.BaseExpression, cst.BaseExpression]:
    """(statement, value, operand) where ``term`` starts its way into ``sink``: the innermost statement on the way
    that does not bind a value meant to be maximised (``surrogate = torch.min(...)`` is right as it is; the fault is
    where it becomes a loss), else the sink."""
    sink_value = sink.expr if sink.kind != "named" else _value(sink.node)
    chain = [(sink.node, sink_value)] + [(stmt, _value(stmt)) for _, stmt in term.via]
    reads = [read for read, _ in term.via] + [term.expr]
    for (stmt, value), inner in reversed(list(zip(chain, reads))):
        if value is None:
            continue
        names = [d.key.rsplit(".", 1)[-1] for d in a.index.stmt_defs.get(id(stmt), ())]
        if names and all(MAXIMISED_NAME.fullmatch(n) for n in names):
            continue
        operand = _operand_containing(a, value, inner)
        return stmt, value, operand if operand is not None else value
    return sink.node, sink_value, sink_value


def _value(stmt: cst.CSTNode) -> cst.BaseExpression | None:
    if isinstance(stmt, (cst.Assign, cst.AnnAssign, cst.AugAssign)):
        return stmt.value
    if isinstance(stmt, cst.Return):
        return stmt.value
    return None


def top_terms(expr: cst.BaseExpression, sign: int = 1) -> list[tuple[int, cst.BaseExpression]]:
    """The operands of ``expr``'s top-level sum (no names followed): ``a - c * b`` -> [(+1, a), (-1, c * b)]."""
    while isinstance(expr, cst.UnaryOperation) and isinstance(expr.operator, (cst.Minus, cst.Plus)):
        if isinstance(expr.operator, cst.Minus):
            sign = -sign
        expr = expr.expression
    if isinstance(expr, cst.BinaryOperation) and isinstance(expr.operator, (cst.Add, cst.Subtract)):
        right = sign if isinstance(expr.operator, cst.Add) else -sign
        return top_terms(expr.left, sign) + top_terms(expr.right, right)
    return [(sign, expr)]


def _operand_containing(a: "Analysis", value: cst.BaseExpression, inner: cst.BaseExpression) -> cst.BaseExpression | None:
    for _, operand in top_terms(value):
        if operand is inner or a.index.contains(operand, inner):
            return operand
    return None


def flip(stmt: cst.CSTNode, value: cst.BaseExpression, operand: cst.BaseExpression) -> list:
    """A replacement flipping the sign of ``operand`` in ``stmt``: ``+ t`` <-> ``- t`` when it is the right
    operand of the top-level sum, ``+=`` <-> ``-=`` for an augmented assignment of it; empty when ambiguous."""
    if isinstance(stmt, cst.AugAssign) and isinstance(stmt.operator, (cst.AddAssign, cst.SubtractAssign)) and (
            stmt.value is operand):
        op = stmt.operator
        new = cst.SubtractAssign if isinstance(op, cst.AddAssign) else cst.AddAssign
        return [(op, new(whitespace_before=op.whitespace_before, whitespace_after=op.whitespace_after))]
    expr = value
    while isinstance(expr, cst.BinaryOperation) and isinstance(expr.operator, (cst.Add, cst.Subtract)):
        if expr.right is operand:
            op = expr.operator
            new = cst.Subtract if isinstance(op, cst.Add) else cst.Add
            return [(op, new(whitespace_before=op.whitespace_before, whitespace_after=op.whitespace_after))]
        expr = expr.left
    return []


def losses(a: "Analysis") -> Losses:
    return a.facet("losses", Losses)


__all__ = ["Losses", "Sink", "flip", "key_of", "losses", "top_terms"]
