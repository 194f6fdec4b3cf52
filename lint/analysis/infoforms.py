"""Information quantities over a whole distribution, recognised by their formula: entropy and KL divergence.

``-(p * log p).sum(-1)`` is an entropy and ``(p * log p).sum(-1)`` its negation; ``(p * (log p - log q)).sum(-1)``
(or ``p * log(p / q)``) is ``KL(p || q)`` and ``(p * (log q - log p)).sum(-1)`` its negation, whichever of ``p``
and ``q`` is the policy: a KL over full distributions is non-negative by construction, so its sign needs no role.
The form is read at the product, the unit the sign walk (:mod:`~rlguard.lint.analysis.signs`) leaves as a term,
and only where that product is summed over the last (vocabulary) axis.

``log`` is ``torch.log(x)``, ``x.log()``, either of them over a clamped ``x``, or a helper of the module (or of
the linted tree, by its code) that returns one of these of its parameter (``def log(t, eps): return
torch.log(t.clamp(min=eps))``). ``p`` and the argument of its log must be the same value: the same name reached by
the same definitions (a parameter of the helper counts), or ``softmax(z)`` beside ``log_softmax(z)`` of the same
``z``. Anything else is not a form (unknown, which reports nothing).

:meth:`Forms.form` answers ``(kind, sign)`` for one product; the quantities facet
(:mod:`~rlguard.lint.analysis.terms`) uses it as one more structural recognition, so a helper that returns a
negated entropy or a KL with its logs swapped carries that sign to every call site (an effect summary from the
helper's code, not from its name). :func:`negated_origin` says where such a sign comes from, so a rule can report
the helper rather than the call site that trusted it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import libcst as cst

from rlguard.lint.analysis import semantics as S
from rlguard.lint.analysis.index import key_of
from rlguard.lint.analysis.signs import factors, signs

if TYPE_CHECKING:
    from rlguard.lint.analysis import Analysis

# Sign-keeping wrappers around the argument of a log (a clamp for numerical safety, a dtype cast).
_WRAPPERS = frozenset({"clamp", "clamp_min", "clip", "float", "double", "to", "detach", "contiguous"})
_LOGS = frozenset({"torch.log", "math.log", "numpy.log", "torch.log2", "torch.log10"})
_SOFTMAX = frozenset({"torch.softmax", "torch.nn.functional.softmax", "torch.special.softmax"})
_LOG_SOFTMAX = frozenset({"torch.log_softmax", "torch.nn.functional.log_softmax", "torch.special.log_softmax"})
# Names that say a value is the negation of the quantity or a loss built from it: the helper is then right to
# return the negated form, and a fault lies with its caller.
NEGATED_NAME = re.compile(r"(?i)(neg|minus|negative|negated)_?\w*|\w*_(neg|negative|negated)|\w*loss\w*|"
                          r"\w*_penalty|penalty")


@dataclass(frozen=True)
class Form:
    kind: str  # "entropy" or "kl"
    sign: int  # +1: the quantity; -1: its negation
    node: cst.BaseExpression = field(repr=False)  # the product p * log p (or p * (log p - log q))


class Forms:
    """Per module, memoised per node."""

    def __init__(self, a: "Analysis"):
        self.a = a
        self._memo: dict[int, Form | None] = {}

    # ----- the forms ---------------------------------------------------------------------------------------------
    def form(self, expr: cst.BaseExpression) -> Form | None:
        """The information quantity a product computes, with its sign, when it is summed over the last axis."""
        if not isinstance(expr, cst.BinaryOperation) or not isinstance(expr.operator, cst.Multiply):
            return None
        key = id(expr)
        if key not in self._memo:
            self._memo[key] = self._form(expr)
        return self._memo[key]

    def _form(self, product: cst.BinaryOperation) -> Form | None:
        if not self._summed_over_last_axis(product):
            return None
        sign, facs = factors(product)
        if len(facs) != 2:
            return None
        for weight, other in ((facs[0], facs[1]), (facs[1], facs[0])):
            if self._log_of(other) is not None:
                if self.same(weight, self._log_of(other)):
                    return Form("entropy", -sign, product)  # p log p is minus the entropy
                continue
            logs = self._log_difference(other)
            if logs is not None:
                (s1, x1), (s2, x2) = logs
                if self.same(weight, x1) and not self.same(weight, x2):
                    return Form("kl", sign * s1, product)
                if self.same(weight, x2) and not self.same(weight, x1):
                    return Form("kl", sign * s2, product)
        return None

    def _summed_over_last_axis(self, product: cst.BaseExpression) -> bool:
        """``(p * ...).sum(-1)``, ``.sum(dim=-1)``, ``torch.sum(p * ..., dim=-1)``: the vocabulary axis."""
        index = self.a.index
        parent = index.parent_of(product)
        while isinstance(parent, cst.UnaryOperation) and isinstance(parent.operator, cst.Minus):
            product, parent = parent, index.parent_of(parent)  # (-(p * log p)).sum(-1)
        if isinstance(parent, cst.Attribute) and parent.value is product and parent.attr.value in ("sum", "nansum"):
            call = index.parent_of(parent)
            if isinstance(call, cst.Call) and call.func is parent:
                dim = S.argument(call, 0, "dim")
                return S.int_value(dim) == -1
            return False
        if isinstance(parent, cst.Arg):
            call = index.parent_of(parent)
            if isinstance(call, cst.Call) and self.a.call_name(call) in ("torch.sum", "torch.nansum") and \
                    call.args and call.args[0] is parent:
                return S.int_value(S.argument(call, 1, "dim")) == -1
        return False

    def _log_difference(self, expr: cst.BaseExpression, depth: int = 3):
        """``log x - log y`` (each possibly negated), or ``log(x / y)``: two (sign, argument) pairs, else None.
        A name is followed to its one definition (``d = log(q) - log(p); (p * d).sum(-1)``)."""
        while isinstance(expr, cst.Call) and self.a.method(expr) in _WRAPPERS:
            expr = S.receiver(expr)
        single = self._single_value(expr) if depth > 0 else None
        if single is not None:
            return self._log_difference(single, depth - 1)
        if isinstance(expr, cst.BinaryOperation) and isinstance(expr.operator, (cst.Subtract, cst.Add)):
            left, right = self._log_of(expr.left), self._log_of(expr.right)
            if left is None or right is None:
                return None
            return (1, left), (1 if isinstance(expr.operator, cst.Add) else -1, right)
        inner = self._log_argument(expr)
        if isinstance(inner, cst.BinaryOperation) and isinstance(inner.operator, cst.Divide):
            return (1, _unwrap(self.a, inner.left)), (-1, _unwrap(self.a, inner.right))
        return None

    def _log_of(self, expr: cst.BaseExpression, depth: int = 3):
        """The value whose log ``expr`` is (wrappers stripped), or ``("softmax", z)`` for ``log_softmax(z)``."""
        inner = self._log_argument(expr, depth)
        if inner is None:
            return None
        if isinstance(inner, tuple):
            return inner
        if isinstance(inner, cst.BinaryOperation) and isinstance(inner.operator, cst.Divide):
            return None  # log(p / q): a difference, not a log of one value
        return _unwrap(self.a, inner)

    def _single_value(self, expr: cst.BaseExpression) -> cst.BaseExpression | None:
        """The value of a name with exactly one reaching definition, a plain assignment (else None: unknown)."""
        key = key_of(expr)
        if key is None:
            return None
        defs = self.a.flow.reaching(key, expr)
        if len(defs) == 1 and defs[0].kind == "assign" and defs[0].element is None and defs[0].value is not None \
                and defs[0].key == key:
            return defs[0].value
        return None

    def _log_argument(self, expr: cst.BaseExpression, depth: int = 3):
        a = self.a
        single = self._single_value(expr) if depth > 0 else None
        if single is not None:
            return self._log_argument(single, depth - 1)
        if not isinstance(expr, cst.Call):
            return None
        name = a.call_name(expr)
        if name in _LOGS and expr.args:
            return expr.args[0].value
        if a.method(expr) == "log" and not expr.args:
            return S.receiver(expr)
        if name in _LOG_SOFTMAX and expr.args:
            return ("softmax", a.code(expr.args[0].value))
        if a.method(expr) == "log_softmax" and S.receiver(expr) is not None:
            return ("softmax", a.code(S.receiver(expr)))
        func = a.callee(expr)
        if func is None or depth <= 0:
            return None
        # a helper of the module: every return is a log of the same parameter, bound to this call's argument
        from rlguard.lint.analysis.values import bind_arguments, params_of

        params = {p.name.value for p in params_of(func.params)}
        returned = set()
        for ret in a.index.scopes[id(func)].returns:
            if ret.value is None or a.index.function_scope(ret).node is not func:
                continue
            inner = self._log_of(ret.value, depth - 1)
            if not isinstance(inner, cst.Name) or inner.value not in params:
                return None
            returned.add(inner.value)
        if len(returned) != 1:
            return None
        param = returned.pop()
        for bound_name, (value, _frame) in bind_arguments(func, expr, None):
            if bound_name == param:
                return value
        return None

    def same(self, p, x) -> bool:
        """Whether ``p`` (probabilities) and ``x`` (the argument of a log) are the same value."""
        if x is None:
            return False
        p = _unwrap(self.a, p)
        if isinstance(x, tuple):
            return self._softmax_of(p) == x[1]
        kp, kx = key_of(p), key_of(x)
        if kp is None or kp != kx:
            return False
        dp = {id(d) for d in self.a.flow.reaching(kp, p)}
        dx = {id(d) for d in self.a.flow.reaching(kx, x)}
        if not dp:  # defined out of view (a global of a script): the same name read in the same scope
            return not dx and self.a.index.function_scope(p).node is self.a.index.function_scope(x).node
        return dp == dx

    def _softmax_of(self, p, depth: int = 3) -> str | None:
        a = self.a
        if isinstance(p, cst.Call):
            if a.call_name(p) in _SOFTMAX and p.args:
                return a.code(p.args[0].value)
            if a.method(p) == "softmax" and S.receiver(p) is not None:
                return a.code(S.receiver(p))
            return None
        key = key_of(p)
        if key is None or depth <= 0:
            return None
        defs = a.flow.reaching(key, p)
        if len(defs) == 1 and defs[0].kind == "assign" and defs[0].element is None and defs[0].value is not None:
            return self._softmax_of(_unwrap(a, defs[0].value), depth - 1)
        return None


def _unwrap(a: "Analysis", expr: cst.BaseExpression) -> cst.BaseExpression:
    while True:
        if isinstance(expr, cst.Call) and a.method(expr) in _WRAPPERS and S.receiver(expr) is not None:
            expr = S.receiver(expr)
        elif isinstance(expr, cst.BinaryOperation) and isinstance(expr.operator, cst.Add) and (
                (S.number_value(expr.right) or 0) > 0):
            expr = expr.left  # log(p + 1e-9): an epsilon for numerical safety
        else:
            break
    if isinstance(expr, cst.Call) and a.call_name(expr) in ("torch.clamp", "torch.clip") and expr.args:
        return _unwrap(a, expr.args[0].value)
    return expr


def forms(a: "Analysis") -> Forms:
    return a.facet("infoforms", Forms)


def negated_origin(a: "Analysis", kind: str, expr: cst.BaseExpression, frame) -> cst.BaseExpression | None:
    """Where a negated ``kind`` that ``expr`` carries is computed, when that is inside a helper (a function other
    than the one ``expr`` is read in) that presents it as the quantity itself: the one formula all of ``expr``'s
    terms come from, with sign -1 as the helper computes it, in a helper not named for a negation or a loss. None
    otherwise (the caller is then where the sign goes wrong)."""
    f = forms(a)

    def stop(e, _frame):
        found = f.form(e)
        return found is not None and found.kind == kind

    terms = signs(a).terms(expr, frame, stop=stop)
    if len(terms) == 1 and not stop(terms[0].expr, terms[0].frame):
        inner = _returned_element(a, terms[0].expr)
        if inner is not None:  # `h, stats = helper(p)`: the element the helper returns
            terms = signs(a).terms(inner, None, stop=stop)
    # a literal 0 (`kl = 0.` before the branch that computes it: the term switched off) adds nothing
    terms = [t for t in terms if S.number_value(t.expr) != 0]
    origins = {id(t.expr): t.expr for t in terms if stop(t.expr, t.frame)}
    if len(origins) != 1 or len(terms) != sum(1 for t in terms if stop(t.expr, t.frame)):
        return None
    node = next(iter(origins.values()))
    if f.form(node).sign != -1:
        return None
    helper = a.enclosing_function(node)
    if helper is None or helper is a.enclosing_function(expr):
        return None
    if NEGATED_NAME.fullmatch(helper.name.value):
        return None
    # the name the helper binds the formula to, if any (``entropies = (p * log(p)).sum(-1)``)
    stmt = next((s for s in a.ancestors(node) if isinstance(s, (cst.Assign, cst.Return))), None)
    if isinstance(stmt, cst.Assign):
        for target in stmt.targets:
            name = key_of(target.target)
            if name is not None and NEGATED_NAME.fullmatch(name.rsplit(".", 1)[-1]):
                return None
    return node


def _returned_element(a: "Analysis", expr: cst.BaseExpression) -> cst.BaseExpression | None:
    """For a name bound by unpacking a same-module helper's call (``h, stats = helper(p)``), the expression at that
    position of the helper's one returned tuple; None otherwise."""
    key = key_of(expr)
    defs = a.flow.reaching(key, expr) if key is not None else []
    if len(defs) != 1 or defs[0].kind != "assign" or defs[0].element is None or not isinstance(defs[0].value,
                                                                                                 cst.Call):
        return None
    func = a.callee(defs[0].value)
    if func is None:
        return None
    rets = [r.value for r in a.index.scopes[id(func)].returns
            if r.value is not None and a.index.function_scope(r).node is func]
    if len(rets) != 1 or not isinstance(rets[0], cst.Tuple) or defs[0].element >= len(rets[0].elements):
        return None
    return rets[0].elements[defs[0].element].value


__all__ = ["Form", "Forms", "NEGATED_NAME", "forms", "negated_origin"]
