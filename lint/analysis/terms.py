"""What a term of a loss or a reward *is*: an entropy, a KL estimate, log-probs of the policy or the reference.

Each query returns the sign with which the quantity enters the expression (+1, -1) or None when the expression
is not that quantity. The structure decides first (an entropy computation, a difference of policy and reference
log-probs); a name is accepted only for a value whose computation is out of view (a parameter, a batch field, a
call the linter cannot read), and never for a mask (``entropy_mask``), a coefficient (``kl_coef``) or a
comparison.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import libcst as cst

from rlguard.lint.analysis import semantics as S
from rlguard.lint.analysis.index import key_entry, key_of, last_name
from rlguard.lint.analysis.infoforms import forms
from rlguard.lint.analysis.losses import top_terms
from rlguard.lint.analysis.provenance import FORWARD, ROLLOUT, provenance
from rlguard.lint.analysis.records import record_entries
from rlguard.lint.analysis.signs import factors, setting_read, signs
from rlguard.lint.analysis.values import Frame

if TYPE_CHECKING:
    from rlguard.lint.analysis import Analysis

DEPTH = 10
# A reduction under a mask named for what it reduces (``masked_entropy``, ``masked_kl_div``), not a mask itself.
_MASKED_REDUCTION = re.compile(r"(?i)masked_(?!mask)\w+")
# A coefficient named for the term it scales (``kl_div_loss_weight``, ``entropy_scale``, ``kl_beta``).
_COEFFICIENT = re.compile(r"(?i)\w+_(coef|coeff|coefficient|weight|scale|factor|beta|lambda|lam)")

# Methods that move or cast a tensor without changing what it holds.
_CAST_METHODS = frozenset({"to", "float", "double", "half", "bfloat16", "cuda", "cpu", "detach", "type", "type_as",
                           "contiguous", "clone"})


# Steps that keep a sampled KL estimate one: reductions, clamps, casts.
_ESTIMATE_KEEPING = frozenset({"mean", "sum", "nanmean", "float", "contiguous", "clamp", "clip", "detach", "to"})


class Quantities:
    """Per module: entropy, KL and log-prob recognition with memoised answers."""

    def __init__(self, a: "Analysis"):
        self.a = a
        self.prov = provenance(a)
        self.signs = signs(a)
        self._memo: dict[tuple, int | None] = {}
        self._logp_answers: dict[tuple, bool] = {}
        self.truncated = False

    # ----- names --------------------------------------------------------------------------------------------
    def _name(self, expr: cst.BaseExpression) -> str | None:
        if isinstance(expr, cst.Call):
            return S.called_name(expr)
        key = key_of(expr)
        return last_name(key) if key is not None else None

    def _excluded(self, name: str | None) -> bool:
        vocab = self.a.names
        if name is not None and _MASKED_REDUCTION.fullmatch(name):
            return False  # masked_entropy(p, mask=m), masked_kl_div(p, q, m): a masked reduction, not a mask
        if name is not None and _COEFFICIENT.fullmatch(name):
            return True  # kl_div_loss_weight, entropy_scale: the coefficient of the term, not the term
        return name is None or vocab.is_role(name, "mask") or vocab.is_role(name, "entropy_coef") or \
            vocab.is_role(name, "kl_coef") or "coef" in name.lower() or "mask" in name.lower()

    def _info_form(self, kind: str, expr) -> int | None:
        """The sign of an entropy or KL written out over a whole distribution (``(p * log(p)).sum(-1)``)."""
        found = forms(self.a).form(expr)
        return found.sign if found is not None and found.kind == kind else None

    def _memoised(self, kind: str, expr, frame, depth, compute) -> int | None:
        key = (kind, id(expr), id(frame))
        if key in self._memo:
            return self._memo[key]
        if depth <= 0:
            self.truncated = True
            return None
        self._memo[key] = None  # cycles
        outer, self.truncated = self.truncated, False
        result = compute(expr, frame, depth)
        if self.truncated and result is None:
            del self._memo[key]  # the depth bound cut it short: a shallower query may see more
        else:
            self._memo[key] = result
        self.truncated = self.truncated or outer
        return result

    def _through_definitions(self, kind: str, expr, frame, depth) -> int | None:
        """The sign of the quantity in the value a name's definitions give it (all must agree)."""
        key = key_of(expr)
        if key is None:
            return None
        defs = self.a.flow.reaching(key, expr)
        if not defs:
            return None
        found = set()
        for d in defs:
            if d.kind == "param":
                bound = frame.binding(d.key) if frame is not None and d.scope is frame.func else None
                if bound is None or bound[0] == "item":
                    return None
                found.add(self.sign(kind, bound[0], bound[1], depth - 1))
            elif d.kind == "assign" and d.element is None and d.value is not None and d.key == key:
                if isinstance(d.value, cst.Name) and d.value.value == "None" or S.number_value(d.value) == 0:
                    # `entropy = None` / `kl_penalty = 0.` before the branch that computes it (the term switched
                    # off): no signed value that reaches a sum
                    continue
                if setting_read(d.value):
                    return None  # `self.c = loss_config.kl_penalty`: a coefficient read from the settings
                found.add(self.sign(kind, d.value, frame, depth - 1))
            elif d.kind == "assign" and d.element is not None and isinstance(d.value, cst.Call) and d.key == key:
                found.add(self._returned_element(kind, d.value, d.element, frame, depth))
            else:
                return None
        return found.pop() if len(found) == 1 else None

    def _returned_element(self, kind: str, call: cst.Call, element: int, frame, depth) -> int | None:
        """``h, stats = helper(p)``: the sign of the quantity in element ``element`` of every tuple the
        same-module helper returns (its parameters bound to the call's arguments); None when a return is not a
        tuple of that length or the helper is out of view."""
        func = self.a.callee(call)
        if func is None:
            # a function of another file: the role its code gives that element, when every definition agrees
            role = self.a.element_role(call, element)
            return role[1] if role is not None and role[0] == kind else None
        inner = self.signs._frame(func, call, frame)
        if inner is None:
            return None
        found = set()
        for ret in self.a.index.scopes[id(func)].returns:
            if ret.value is None or self.a.index.function_scope(ret).node is not func:
                continue
            value = ret.value
            if not isinstance(value, cst.Tuple) or element >= len(value.elements) or any(
                    isinstance(el, cst.StarredElement) for el in value.elements):
                return None
            found.add(self.sign(kind, value.elements[element].value, inner, depth - 1))
        return found.pop() if len(found) == 1 else None

    def _visible(self, expr, frame) -> bool:
        """Whether the expression's value is computed in view (a definition with an expression reaches it)."""
        key = key_of(expr)
        if key is None:
            return isinstance(expr, cst.Call) and self.a.callee(expr) is not None
        for d in self.a.flow.reaching(key, expr):
            if d.kind == "assign" and d.value is not None:
                if d.element is not None and isinstance(d.value, cst.Call) and self.a.callee(d.value) is None:
                    continue  # `_, lp, entropy, v = agent.get_action_and_value(obs)`: computed out of view
                return True
            if d.kind == "param" and frame is not None and d.scope is frame.func and frame.binding(d.key):
                return True
        return False

    def sign(self, kind: str, expr, frame: Frame | None = None, depth: int = DEPTH) -> int | None:
        compute = {"entropy": self._entropy, "kl": self._kl}[kind]
        return self._memoised(kind, expr, frame, depth, compute)

    def _summarised(self, kind: str, expr) -> int | None:
        """The sign a function of another file of the linted tree returns the quantity with (its summary, from its
        code), else None."""
        if not isinstance(expr, cst.Call):
            return None
        summary = self.a.summary_of_call(expr)
        signed = getattr(summary, "returns_signed", None) if summary is not None else None
        return signed.get(kind) if signed else None

    # ----- linear pieces -----------------------------------------------------------------------------------------
    def _linear(self, kind: str, expr, frame, depth) -> int | None:
        """The sign of the quantity in a sum, a product with coefficients, or a reduction of it."""
        terms = self.signs.terms(expr, frame, depth=4)
        if len(terms) == 1 and terms[0].expr is expr:
            sign, facs = factors(expr)
            if len(facs) == 1 and facs[0] is expr:
                return None
            inner = [(f, self.sign(kind, f, frame, depth - 1)) for f in facs]
            hits = [(f, s) for f, s in inner if s is not None]
            others = [f for f, s in inner if s is None]
            if len(hits) == 1 and all(self.signs.scale(f, frame) is not None or self._positive(f)
                                      for f in others):
                return sign * hits[0][1]
            return None
        # a sum is the quantity only when every term is (constants aside): `pg + c * H` is a loss, not an entropy
        found = set()
        for t in terms:
            if S.number_value(t.expr) is not None:
                continue
            inner = self.sign(kind, t.expr, t.frame, depth - 1)
            if inner is None:
                return None
            found.add(t.sign * inner)
        return found.pop() if len(found) == 1 else None

    # ----- entropy -------------------------------------------------------------------------------------------------
    def _entropy(self, expr, frame, depth) -> int | None:
        name = self._name(expr)
        if name is not None and self._excluded(name):
            return None
        written_out = self._info_form("entropy", expr)
        if written_out is not None:
            return written_out
        elsewhere = self._summarised("entropy", expr)
        if elsewhere is not None:
            return elsewhere
        if isinstance(expr, cst.Call):
            func = self.a.callee(expr)
            if func is None and self._entropy_call(expr):
                return 1  # entropy_from_logits(...), dist.entropy(): the library computes an entropy
            if func is not None:
                rets = [r.value for r in self.a.index.scopes[id(func)].returns if r.value is not None]
                if rets and all(self._entropy_formula(r, None) or self._entropy_call(r) or
                                self.sign("entropy", r, None, depth - 1) == 1 for r in rets):
                    return 1  # a helper of the module that computes an entropy
        if self._entropy_formula(expr, frame):
            return 1
        if isinstance(expr, (cst.Name, cst.Attribute, cst.Subscript)) and key_of(expr) is not None:
            inner = self._through_definitions("entropy", expr, frame, depth)
            if inner is not None:
                return inner
            if not self._visible(expr, frame) and name is not None and self.a.names.is_role(name, "entropy"):
                return 1  # computed out of view: the name is all there is
            entry = key_entry(key_of(expr))
            if entry is not None and self.a.names.is_role(entry, "entropy") and not self._excluded(entry) and \
                    "loss" not in entry.lower() and self._stored_here(entry):
                # `outputs["entropys"]`: a producer of this module stores the entry under its key (the interface
                # between two functions, not a local's name) where its computation passes calls out of view
                return 1
            return None
        if isinstance(expr, cst.Call):
            method = self.a.method(expr)
            recv = S.receiver(expr)
            if method in ("mean", "sum", "nanmean", "float", "detach", "squeeze", "clamp") and recv is not None:
                return self.sign("entropy", recv, frame, depth - 1)
            gathered = S.collected(self.a, expr)
            if gathered is not None:
                return self.sign("entropy", gathered, frame, depth - 1)
            if self.a.callee(expr) is None and name is not None and self.a.names.is_role(name, "entropy") \
                    and "cross" not in name.lower():
                return 1  # entropy_bonus(logits, mask), a helper out of view named for it
        return self._linear("entropy", expr, frame, depth)

    def _entropy_call(self, expr) -> bool:
        name = S.called_name(expr) if isinstance(expr, cst.Call) else None
        if name is None:
            return False
        if S.ENTROPY_HELPER.fullmatch(name) is not None or (name == "entropy" and self.a.method(expr) == "entropy") \
                or self.a.call_name(expr) in S.ENTROPY_FUNCTIONS:
            return True
        alias = self.a.function_alias(expr)  # `self.entropy_fn(logits)` bound to an entropy function
        return alias is not None and (S.ENTROPY_HELPER.fullmatch(alias.rsplit(".", 1)[-1]) is not None or
                                      alias in S.ENTROPY_FUNCTIONS)

    def _entropy_formula(self, expr, frame) -> bool:
        """``-(p * logp).sum(-1)`` with ``p`` probabilities and ``logp`` log-probs of the same logits, or
        ``logsumexp(z) - (softmax(z) * z).sum(-1)``."""
        if isinstance(expr, cst.BinaryOperation) and isinstance(expr.operator, cst.Subtract):
            left, right = expr.left, expr.right
            if isinstance(left, cst.Call) and (self.a.call_name(left) == "torch.logsumexp" or
                                               self.a.method(left) == "logsumexp"):
                text = self.a.code(right)
                return "softmax" in text or "probs" in text or "pd" in text
            return False
        if not (isinstance(expr, cst.UnaryOperation) and isinstance(expr.operator, cst.Minus)):
            return False
        inner = expr.expression
        while isinstance(inner, cst.Call) and self.a.method(inner) in ("mean",):
            inner = S.receiver(inner)
        if not (isinstance(inner, cst.Call) and self.a.method(inner) == "sum" and isinstance(
                S.receiver(inner), cst.BinaryOperation)):
            return False
        product = S.receiver(inner)
        if not isinstance(product.operator, cst.Multiply):
            return False
        whats = [{o.what for o in self.prov.value(side, frame) if o.kind == FORWARD}
                 for side in (product.left, product.right)]
        texts = [self.a.code(side) for side in (product.left, product.right)]
        logp_side = any("logprobs" in w for w in whats)
        prob_side = any("softmax" in t or "exp(" in t or "probs" in t for t in texts)
        return logp_side and prob_side

    def _positive(self, expr, depth: int = 3) -> bool:
        """A tensor factor positive by construction, which weighs a quantity without changing its sign: an
        importance weight ``exp(logp - old)`` (clamped or not), a sigmoid, or a name bound only to those."""
        while isinstance(expr, cst.Call) and (self.a.method(expr) in ("clamp", "clip", "detach", "float") or
                                              self.a.call_name(expr) in ("torch.clamp", "torch.clip")):
            expr = S.receiver(expr) if self.a.method(expr) else (expr.args[0].value if expr.args else None)
        if isinstance(expr, cst.Call):
            return (self.a.method(expr) in ("exp", "sigmoid") and not expr.args) or self.a.call_name(expr) in (
                "torch.exp", "torch.sigmoid")
        key = key_of(expr) if expr is not None else None
        if key is None or depth <= 0:
            return False
        defs = self.a.flow.reaching(key, expr)
        return bool(defs) and all(d.kind == "assign" and d.element is None and d.value is not None and
                                  self._positive(d.value, depth - 1) for d in defs)

    # ----- KL to the reference -----------------------------------------------------------------------------------
    def _kl(self, expr, frame, depth) -> int | None:
        name = self._name(expr)
        if name is not None and self._excluded(name):
            return None
        if isinstance(expr, cst.Comparison):
            return None
        written_out = self._info_form("kl", expr)
        if written_out is not None:
            return written_out
        elsewhere = self._summarised("kl", expr)
        if elsewhere is not None:
            return elsewhere
        if self._sampled_estimate(expr):
            return 1
        difference = self._log_ratio(expr, frame, depth)
        if difference is not None:
            return difference
        if isinstance(expr, (cst.Name, cst.Attribute, cst.Subscript)) and key_of(expr) is not None:
            inner = self._through_definitions("kl", expr, frame, depth)
            if inner is not None:
                return inner
            if not self._visible(expr, frame) and name is not None and self.a.names.is_role(name, "kl"):
                return 1
            return None
        even = self._even_of(expr)
        if even is not None:
            # |logp - ref|, (logp - ref) ** 2: a symmetric penalty, >= 0 whichever way the log-ratio is written
            return 1 if self.sign("kl", even, frame, depth - 1) is not None else None
        if isinstance(expr, cst.Call):
            method = self.a.method(expr)
            recv = S.receiver(expr)
            if method in ("mean", "sum", "nanmean", "float", "detach", "squeeze", "clamp", "contiguous") and \
                    recv is not None:
                return self.sign("kl", recv, frame, depth - 1)
            if self.a.call_name(expr) in ("torch.clamp", "torch.clip") and expr.args:
                return self.sign("kl", expr.args[0].value, frame, depth - 1)
            gathered = S.collected(self.a, expr)
            if gathered is not None:
                return self.sign("kl", gathered, frame, depth - 1)
            func = self.a.callee(expr)
            if func is not None and self._returns_estimate(func, depth):
                return 1  # a helper of the module that returns a sampled KL estimate, by its formula
            if func is None and name is not None and self.a.names.is_role(name, "kl") and \
                    any(self._logp_like(arg.value, frame) for arg in expr.args):
                return 1  # kl_penalty(logp, ref_logp), a KL helper out of view fed log-probs
        return self._linear("kl", expr, frame, depth)

    def _sampled_estimate(self, expr) -> bool:
        """The k3 estimate of a KL from sampled tokens, ``exp(d) - d - 1`` (``r - 1 - log(r)`` with ``r = exp(d)``),
        its terms in any order and the exponential possibly a name bound to it (``ratio = torch.exp(d)``;
        ``ratio - d - 1``). It is non-negative whatever ``d`` is, so the formula makes it a divergence, whichever
        side of ``d`` is the reference and whatever the operands are called."""
        if not (isinstance(expr, cst.BinaryOperation) and isinstance(expr.operator, (cst.Add, cst.Subtract))):
            return False
        terms = top_terms(expr)
        constant = sum(s * S.number_value(t) for s, t in terms if S.number_value(t) is not None)
        rest = [(s, t) for s, t in terms if S.number_value(t) is None]
        if constant != -1 or len(rest) < 2:
            return False
        for i, (sign, term) in enumerate(rest):
            exponent = self._exponent(term) if sign == 1 else None
            if exponent is None:
                continue
            linear = rest[:i] + rest[i + 1:]
            argument = exponent
            if self._atoms(linear) == self._atoms([(-1, argument)]):
                return True  # exp(d) - d - 1
            if len(linear) == 1 and linear[0][0] == -1 and isinstance(linear[0][1], cst.Call):
                log = linear[0][1]
                inner = S.receiver(log) if self.a.method(log) == "log" and not log.args else (
                    log.args[0].value if self.a.call_name(log) == "torch.log" and len(log.args) == 1 else None)
                if inner is not None and self._atoms([(1, inner)]) == self._atoms([(1, term)]):
                    return True  # r - log(r) - 1 with r = exp(d)
        return False

    def _returns_estimate(self, func: cst.FunctionDef, depth: int) -> bool:
        """Whether every return of a helper of the module is a sampled KL estimate (its formula, read without the
        caller's arguments: the estimate's sign needs no roles)."""
        rets = [r.value for r in self.a.index.scopes[id(func)].returns if r.value is not None]
        return bool(rets) and all(self._estimate_within(r, depth - 1) for r in rets)

    def _estimate_within(self, expr, depth: int) -> bool:
        """``expr`` is a sampled KL estimate up to reductions, clamps and casts, and names bound once."""
        while depth > 0:
            depth -= 1
            if isinstance(expr, cst.Call):
                recv = S.receiver(expr)
                if self.a.method(expr) in _ESTIMATE_KEEPING and recv is not None:
                    expr = recv
                    continue
                if self.a.call_name(expr) in ("torch.clamp", "torch.clip", "torch.mean", "torch.sum") and expr.args:
                    expr = expr.args[0].value
                    continue
                return False
            if isinstance(expr, cst.Name):
                expr = self.a.sole_value(expr)
                if expr is None:
                    return False
                continue
            return self._sampled_estimate(expr)
        return False

    def _exponent(self, term) -> cst.BaseExpression | None:
        """``d`` of ``torch.exp(d)`` or ``d.exp()``, or of the exponential a name is bound to by its one reaching
        definition."""
        if isinstance(term, cst.Name):
            term = self.a.sole_value(term)
        if not isinstance(term, cst.Call):
            return None
        if self.a.call_name(term) == "torch.exp" and len(term.args) == 1:
            return term.args[0].value
        if self.a.method(term) == "exp" and not term.args and S.receiver(term) is not None:
            return S.receiver(term)
        return None

    def _atoms(self, terms) -> list:
        """The signed atoms of a sum, sorted: (sign, code, the definitions that reach each name it reads at its
        place), so two spellings of one difference at two places compare equal only when they read the same
        values."""
        out = []
        for sign, term in terms:
            for s, atom in top_terms(term, sign):
                names = [atom] if isinstance(atom, cst.Name) else self.a.index.descendants(atom, cst.Name)
                reads = tuple(sorted((n.value, tuple(sorted(id(d) for d in self.a.flow.reaching(n.value, n))))
                                     for n in names))
                out.append((s, self.a.code(atom).replace(" ", ""), reads))
        return sorted(out)

    def _even_of(self, expr) -> cst.BaseExpression | None:
        """``x`` of ``x.abs()``, ``torch.abs(x)``, ``x.square()``, ``torch.square(x)``, ``x ** 2``, ``x.pow(2)``."""
        if isinstance(expr, cst.BinaryOperation) and isinstance(expr.operator, cst.Power):
            return expr.left if S.number_value(expr.right) == 2 else None
        if not isinstance(expr, cst.Call):
            return None
        method = self.a.method(expr)
        if method in ("abs", "square") and not expr.args:
            return S.receiver(expr)
        if method == "pow" and len(expr.args) == 1 and S.number_value(expr.args[0].value) == 2:
            return S.receiver(expr)
        if self.a.call_name(expr) in ("torch.abs", "torch.square") and len(expr.args) == 1:
            return expr.args[0].value
        return None

    def _log_ratio(self, expr, frame, depth) -> int | None:
        """+1 for ``logp - ref_logp`` (and estimators built from it, k3 included), -1 for ``ref_logp - logp``:
        the sign of the policy's log-probs against the reference's in the value's linear part."""
        terms = self.signs.terms(expr, frame, stop=self._logp_stop, depth=6)
        ref, pol = set(), set()
        for t in terms:
            if self._is_reference_logp(t.expr, t.frame):
                ref.add(t.sign)
            elif self._is_policy_logp(t.expr, t.frame) or self._is_sampling_logp(t.expr, t.frame):
                pol.add(t.sign)  # the sampling policy's log-probs stand for the policy in a KL to the reference
            elif S.number_value(t.expr) is None and not self._function_of_log_ratio(t.expr, t.frame):
                return None  # another term: a loss or reward that contains a log-ratio, not the estimate itself
        if len(ref) == 1 and len(pol) == 1 and ref != pol:
            return pol.pop()
        return None

    def _function_of_log_ratio(self, expr, frame) -> bool:
        """``exp(ref - logp)``, ``(logp - ref) ** 2``, ``ratio.log()``: a non-linear piece of a KL estimator built
        only from the two log-probs (k2, k3)."""
        inner = None
        if isinstance(expr, cst.Call) and (self.a.call_name(expr) in ("torch.exp", "torch.square", "torch.log")
                                           and expr.args):
            inner = expr.args[0].value
        elif isinstance(expr, cst.Call) and self.a.method(expr) in ("exp", "square", "log", "pow"):
            inner = S.receiver(expr)
        elif isinstance(expr, cst.BinaryOperation) and isinstance(expr.operator, cst.Power):
            inner = expr.left
        if inner is None:
            return False
        terms = self.signs.terms(inner, frame, stop=self._logp_stop, depth=6)
        return bool(terms) and all(self._is_reference_logp(t.expr, t.frame) or self._is_policy_logp(t.expr, t.frame)
                                   or self._is_sampling_logp(t.expr, t.frame) or S.number_value(t.expr) is not None
                                   for t in terms)

    def _logp_stop(self, expr, frame) -> bool:
        return self._is_reference_logp(expr, frame) or self._is_policy_logp(expr, frame)

    def _bound(self, expr, frame):
        """A helper's parameter read in a frame bound to the call's argument: (argument, caller frame), else None."""
        if frame is None or not isinstance(expr, cst.Name):
            return None
        defs = self.a.flow.reaching(expr.value, expr)
        if len(defs) != 1 or defs[0].kind != "param" or defs[0].scope is not frame.func:
            return None
        bound = frame.binding(expr.value)
        if bound is None or bound[0] == "item":
            return None
        return bound

    def _argument_role(self, expr, frame) -> str | None:
        """"reference" or "policy" when a parameter's bound argument says which log-probs it is: the value at the
        call site wins over the parameter's name (``kl(ref_logp, logp)`` into ``def kl(lp, ref_lp)``); "constant"
        when the argument is a constant tensor (``rewards(logp, torch.zeros_like(logp))``: no model's log-probs,
        whatever the parameter is called)."""
        bound = self._bound(expr, frame)
        if bound is None:
            return None
        if self._constant_tensor(*bound):
            return "constant"
        if self._is_reference_logp(*bound):
            return "reference"
        if self._is_policy_logp(*bound):
            return "policy"
        return None

    def _copied_from(self, expr) -> list[cst.BaseExpression]:
        """What a local name copies: the values of its plain assignments when each is a read of a stored value
        (``ref = inputs["ref_per_token_logps"]``, ``old = batch.get("old_logprobs")``, ``x = y``), else []. The
        interface the value was read from names its role; the local variable's name does not."""
        if not isinstance(expr, cst.Name):
            return []
        defs = self.a.flow.reaching(expr.value, expr)
        values = []
        for d in defs:
            value = d.value if d.kind == "assign" and d.element is None else None
            if self._get_key(value) is not None:
                values.append(value)
            elif isinstance(value, (cst.Subscript, cst.Attribute, cst.Name)) and key_of(value) is not None:
                values.append(value)
            else:
                return []
        return values

    def _constant_tensor(self, expr, frame, depth: int = 4) -> bool:
        """A value no model computed: a number, or a tensor filled with a constant (``torch.zeros_like(x)``,
        ``torch.full((n,), 0.0)``, ``x.new_zeros(n)``, ``torch.tensor(0.0)``), moved or cast (``.to(device)``), or a
        name every reaching definition (or the caller's argument bound to a parameter) gives such a value. A
        log-prob difference against it (SimPO/SLiC's implicit reference ``logp - 0``) is a log-likelihood, not a
        log-ratio to a reference model."""
        while isinstance(expr, cst.Call) and self.a.method(expr) in _CAST_METHODS and S.receiver(expr) is not None:
            expr = S.receiver(expr)
        if S.number_value(expr) is not None:
            return True
        if isinstance(expr, cst.Call):
            if self.a.callee(expr) is not None:
                return False
            name = self.a.call_name(expr)
            if name in S.FILLED_FUNCTIONS or self.a.method(expr) in S.FILLED_METHODS:
                return True
            return name in ("torch.tensor", "torch.as_tensor") and bool(expr.args) and \
                S.number_value(expr.args[0].value) is not None
        key = key_of(expr)
        if key is None or depth <= 0:
            return False
        bound = self._bound(expr, frame)
        if bound is not None:
            return self._constant_tensor(bound[0], bound[1], depth - 1)
        defs = self.a.flow.reaching(key, expr)
        return bool(defs) and all(d.kind == "assign" and d.element is None and d.value is not None and d.key == key
                                  and self._constant_tensor(d.value, frame, depth - 1) for d in defs)

    def _is_reference_logp(self, expr, frame, depth: int = 2) -> bool:
        return self._logp_memo("reference", expr, frame, depth, self._reference_logp)

    def _is_policy_logp(self, expr, frame) -> bool:
        return self._logp_memo("policy", expr, frame, 0, lambda e, f, _: self._policy_logp(e, f))

    def _logp_memo(self, side: str, expr, frame, depth: int, compute) -> bool:
        """Whose log-probs a value is, asked of every piece of every KL and entropy candidate by the stop
        predicates: answered once per value and frame (a value met again while it is being answered is not)."""
        key = (side, id(expr), id(frame), depth)
        hit = self._logp_answers.get(key)
        if hit is None:
            self._logp_answers[key] = False
            hit = self._logp_answers[key] = compute(expr, frame, depth)
        return hit

    def _reference_logp(self, expr, frame, depth: int) -> bool:
        role = self._argument_role(expr, frame)
        if role is not None:
            return role == "reference"
        if self._constant_tensor(expr, frame):
            return False  # `ref_logps = torch.zeros_like(logps)`: a constant, whatever its name
        copies = self._copied_from(expr) if depth > 0 else []
        if copies and all(self._is_reference_logp(c, frame, depth - 1) for c in copies):
            return True
        name = self._name(expr)
        if name is not None and (self.a.names.is_role(name, "ref_logp") or (
                self.a.names.is_role(name, "ref_model") and isinstance(expr, cst.Name))):
            return True  # `ref` beside the policy's log-probs in a log-ratio is the reference's
        forwards = [o for o in self.prov.value(expr, frame) if o.kind == FORWARD]
        return bool(forwards) and all(o.model is not None and o.model.role == "reference" and
                                      o.what in ("logprobs", "output") for o in forwards)

    def _policy_logp(self, expr, frame) -> bool:
        role = self._argument_role(expr, frame)
        if role is not None:
            return role == "policy"
        if self._constant_tensor(expr, frame):
            return False
        copies = self._copied_from(expr)
        if copies and any(self._stored_role(c) in ("ref_logp", "old_logp") for c in copies):
            return False
        name = self._name(expr)
        if name is not None and (self.a.names.is_role(name, "ref_logp") or self.a.names.is_role(name, "old_logp")):
            return False
        if name is not None and self.a.names.is_role(name, "logp"):
            return True
        forwards = [o for o in self.prov.value(expr, frame) if o.kind == FORWARD]
        # a model named a critic that computes log-probs of actions is an actor-critic (`actor_critic`): the policy
        return bool(forwards) and all(o.what == "logprobs" and (o.model is None or o.model.role in (
            "policy", "model", "critic")) for o in forwards)

    def _stored_here(self, entry: str) -> bool:
        """Whether a function of this module stores a value under the string key ``entry``."""
        stored = self.a.facet("stored_entries", lambda an: frozenset(e.entry for e in record_entries(an)))
        return entry in stored

    def _is_sampling_logp(self, expr, frame) -> bool:
        """The old (sampling) policy's log-probs by their name, the key they are stored under, or how they are made
        (the log-softmax of the scores a generation call returned, and no model forward): in ``old - ref`` (a KL
        estimate put into the reward at sampling time) they are the policy's side."""
        name = self._name(expr)
        if self._stored_role(expr) == "old_logp" or (name is not None and self.a.names.is_role(name, "old_logp")):
            return True
        return self._logp_memo("sampling", expr, frame, 0, lambda e, f, _: self._sampled(e, f))

    def _sampled(self, expr, frame) -> bool:
        origins = [o for o in self.prov.value(expr, frame) if o.kind in (FORWARD, ROLLOUT)]
        return bool(origins) and all(o.kind == ROLLOUT and o.what == "logprobs" for o in origins)

    def _stored_role(self, expr) -> str | None:
        name = self._get_key(expr) or self._name(expr)
        for role in ("ref_logp", "old_logp"):
            if name is not None and self.a.names.is_role(name, role):
                return role
        return None

    @staticmethod
    def _get_key(expr) -> str | None:
        """``"k"`` of ``x.get("k", ...)``."""
        if isinstance(expr, cst.Call) and isinstance(expr.func, cst.Attribute) and expr.func.attr.value == "get" \
                and expr.args and isinstance(expr.args[0].value, cst.SimpleString):
            return expr.args[0].value.evaluated_value
        return None

    def _logp_like(self, expr, frame) -> bool:
        return self._is_policy_logp(expr, frame) or self._is_reference_logp(expr, frame) or any(
            o.what == "logprobs" for o in self.prov.value(expr, frame) if o.kind == FORWARD)


def quantities(a: "Analysis") -> Quantities:
    return a.facet("quantities", Quantities)
