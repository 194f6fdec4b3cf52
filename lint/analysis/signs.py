"""Signs: an expression as a signed sum of terms, followed through names, reductions and helpers.

:func:`Signs.terms` writes a value as ``sum(sign_i * term_i)``: sums and negations are split; reductions and
sign-keeping operations (``.mean()``, ``.sum(-1)``, ``masked_mean(x, m)``, ``torch.clamp``, slicing, ``x *
mask``, ``x / n``, ``c * x`` with a coefficient ``c``) are looked through; names expand into the value their
definitions give them (each definition a separate alternative, an augmented ``loss += x`` adding a term); a
same-module helper is walked into with its parameters bound. What cannot be split further (a product of two
tensors, a call the linter cannot read) is a term. Each term remembers the statements it came through (``via``),
so a fault is reported once, where the term joins a sum.

A rule then asks what each term *is* (an entropy, a KL estimate, a policy-gradient surrogate) through
:func:`factors` and the provenance facet; a name is only a hint for a term whose computation is out of view.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import libcst as cst

from rlguard.lint.analysis import semantics as S
from rlguard.lint.analysis.index import dotted_name, key_of, read_name
from rlguard.lint.analysis.roles import is_mask_by_use
from rlguard.lint.analysis.values import Frame

if TYPE_CHECKING:
    from rlguard.lint.analysis import Analysis

REDUCTIONS = frozenset({"mean", "sum", "nanmean", "nansum", "masked_mean", "masked_sum", "mean_tokens",
                        "masked_whiten", "whiten", "agg_loss", "aggregate", "aggregate_loss", "reduce_loss",
                        "masked_normalize", "masked_sum_mean", "loss_agg", "token_mean", "seq_mean"})
SIGN_KEEPING_METHODS = frozenset({
    "clamp", "clip", "clamp_", "clip_", "repeat_interleave", "repeat", "masked_fill", "sum_to_size", "nan_to_num",
    "unsqueeze", "view", "reshape", "float", "to", "detach", "clone", "squeeze", "flatten", "contiguous",
    "expand_as", "expand", "type_as", "double", "half", "bfloat16", "cpu", "cuda", "masked_select",
})
SIGN_KEEPING_FUNCTIONS = frozenset({"torch.clamp", "torch.clip", "torch.mean", "torch.sum", "torch.nanmean",
                                    "torch.nansum", "torch.nn.functional.pad", "torch.masked_select",
                                    "torch.nan_to_num", "torch.repeat_interleave", "torch.squeeze",
                                    "torch.unsqueeze", "torch.flatten"})
# Packed-sequence layout functions of libraries (flash-attn's padding helpers, verl's Ulysses gather, einops): they
# move a tensor's values between padded and packed layouts, and keep their signs.
LAYOUT_FUNCTIONS = frozenset({"pad_input", "unpad_input", "index_first_axis", "gather_outputs_and_unpad",
                              "gather_outpus_and_unpad", "rearrange", "pad_sequence"})
MIN_MAX = {"torch.min": "min", "torch.minimum": "min", "torch.fmin": "min", "min": "min",
           "torch.max": "max", "torch.maximum": "max", "torch.fmax": "max", "max": "max"}
DEPTH = 16  # name expansions and helper calls along one path


@dataclass(frozen=True, eq=False)
class Term:
    sign: int
    expr: cst.BaseExpression
    frame: Frame | None
    # (read, defining statement) pairs passed through, outermost first: the name read that expanded into the
    # statement that defined it
    via: tuple[tuple[cst.BaseExpression, cst.CSTNode], ...]


class Signs:
    """Signed decomposition over one module (memoised per expression and frame)."""

    def __init__(self, a: "Analysis"):
        self.a = a
        self._memo: dict[tuple, list[Term]] = {}
        self._frames: dict[tuple, Frame] = {}
        self.truncated = False  # set when a decomposition hit the depth bound (its result is not memoised)

    def terms(self, expr: cst.BaseExpression, frame: Frame | None = None,
              stop: Callable[[cst.BaseExpression, Frame | None], bool] | None = None,
              depth: int = DEPTH) -> list[Term]:
        """``expr`` as signed terms; ``stop(e, frame)`` marks expressions that are terms as they are (a rule's
        role: an entropy, a KL estimate), never split."""
        key = (id(expr), id(frame), stop)  # the predicate itself: it stays alive as long as the memo
        hit = self._memo.get(key)
        if hit is not None:
            return hit
        if depth <= 0:
            self.truncated = True
            return [Term(1, expr, frame, ())]
        self._memo[key] = [Term(1, expr, frame, ())]  # a cycle reads as one opaque term
        outer, self.truncated = self.truncated, False
        found = self._terms(expr, frame, stop, depth)
        if self.truncated:
            del self._memo[key]  # cut short by the depth bound: a deeper query may see more
        else:
            self._memo[key] = found
        self.truncated = self.truncated or outer
        return found

    def _terms(self, expr, frame, stop, depth) -> list[Term]:
        atom = [Term(1, expr, frame, ())]
        if stop is not None and stop(expr, frame):
            return atom
        # operators and reductions cost no depth: only names and helpers (what can cycle or explode) do
        rec = lambda e, f=frame: self.terms(e, f, stop, depth)  # noqa: E731
        if isinstance(expr, cst.UnaryOperation):
            if isinstance(expr.operator, cst.Minus):
                return negate(rec(expr.expression))
            if isinstance(expr.operator, cst.Plus):
                return rec(expr.expression)
            return atom
        if isinstance(expr, cst.BinaryOperation):
            op = expr.operator
            if isinstance(op, cst.Add):
                return rec(expr.left) + rec(expr.right)
            if isinstance(op, cst.Subtract):
                return rec(expr.left) + negate(rec(expr.right))
            if isinstance(op, (cst.Multiply, cst.Divide)):
                left_scale = self.scale(expr.left, frame)
                right_scale = self.scale(expr.right, frame)
                if isinstance(op, cst.Divide):
                    # a divisor is a count, a standard deviation, a temperature: positive unless a negative literal
                    return scaled(rec(expr.left), right_scale if right_scale is not None else 1)
                if right_scale is not None:
                    return scaled(rec(expr.left), right_scale)
                if left_scale is not None:
                    return scaled(rec(expr.right), left_scale)
            return atom
        if isinstance(expr, cst.Call):
            return self._call(expr, frame, stop, depth, atom)
        if isinstance(expr, cst.Subscript) and key_of(expr) is None:
            return rec(expr.value)
        if isinstance(expr, cst.IfExp):
            return rec(expr.body) + rec(expr.orelse)
        if isinstance(expr, (cst.Name, cst.Attribute, cst.Subscript)):
            return self._named(expr, frame, stop, depth, atom)
        return atom

    def _call(self, call: cst.Call, frame, stop, depth, atom) -> list[Term]:
        a = self.a
        rec = lambda e, f=frame: self.terms(e, f, stop, depth)  # noqa: E731
        name = a.call_name(call) or ""
        method = a.method(call)
        recv = S.receiver(call)
        kind = min_max_kind(a, call)
        if kind is not None:
            return rec(call.args[0].value) + rec(call.args[1].value)
        if method is not None and (method in REDUCTIONS or method in SIGN_KEEPING_METHODS) and recv is not None:
            return rec(recv)
        if name in SIGN_KEEPING_FUNCTIONS and call.args:
            return rec(call.args[0].value)
        func = a.callee(call)
        if func is not None:
            inner = self._frame(func, call, frame)
            if inner is None:
                return atom
            found: list[Term] = []
            for ret in a.index.scopes[id(func)].returns:
                if ret.value is not None and a.index.function_scope(ret).node is func:
                    value = ret.value
                    if isinstance(value, cst.Tuple) and value.elements:
                        value = value.elements[0].value  # (loss, metrics)
                    found += self.terms(value, inner, stop, depth - 1)
            return found or atom
        summary = a.summary_of_call(call)
        keeps = summary.returns_keeps if summary is not None else None
        if keeps is not None:
            # a helper of another file of the tree that reduces or scales one argument and returns it
            kept = S.argument(call, keeps[0], keeps[1])
            return rec(kept) if kept is not None else atom
        last = name.rsplit(".", 1)[-1]
        if last in LAYOUT_FUNCTIONS and call.args and "." in name:
            moved = S.argument(call, 0, "hidden_states") or S.argument(call, 0, "x") or S.argument(call, 0, "tensor")
            return rec(moved) if moved is not None else atom
        if last in REDUCTIONS and call.args:
            first = S.argument(call, 0, "values") or S.argument(call, 0, "loss_mat") or call.args[0].value
            return rec(first)
        return atom

    def _named(self, expr, frame, stop, depth, atom) -> list[Term]:
        a = self.a
        key = key_of(expr)
        defs = a.flow.reaching(key, expr)
        if not defs:
            return atom
        found: list[Term] = []
        for d in defs:
            if d.key != key:
                return atom
            if d.kind == "param":
                bound = frame.binding(d.key) if frame is not None and d.scope is frame.func else None
                if bound is None or bound[0] == "item":
                    found += atom
                else:
                    found += self.terms(bound[0], bound[1], stop, depth - 1)
                continue
            if d.kind == "assign" and d.element is None and d.value is not None:
                found += via(self.terms(d.value, frame, stop, depth - 1), expr, d.stmt)
            elif d.kind == "aug" and d.value is not None and isinstance(d.op, (cst.AddAssign, cst.SubtractAssign)):
                before = self.terms_before(d, frame, stop, depth - 1)
                added = self.terms(d.value, frame, stop, depth - 1)
                if isinstance(d.op, cst.SubtractAssign):
                    added = negate(added)
                found += via(before + added, expr, d.stmt)
            elif d.kind == "aug" and d.value is not None and isinstance(d.op, (cst.MultiplyAssign, cst.DivideAssign)):
                scale = self.scale(d.value, frame)
                if isinstance(d.op, cst.DivideAssign) and scale is None:
                    scale = 1
                before = self.terms_before(d, frame, stop, depth - 1)
                found += via(scaled(before, scale) if scale is not None else [Term(1, expr, frame, ())], expr, d.stmt)
            else:
                found += atom
        return found

    def def_terms(self, d, frame: Frame | None = None, stop=None, depth: int = DEPTH) -> list[Term]:
        """The terms of the value definition ``d`` gives its key (an augmented ``+=`` adds to the previous
        value's terms)."""
        if d.kind == "assign" and d.value is not None:
            return self.terms(d.value, frame, stop, depth)
        if d.kind == "aug" and d.value is not None and isinstance(d.op, (cst.AddAssign, cst.SubtractAssign)):
            added = self.terms(d.value, frame, stop, depth - 1)
            if isinstance(d.op, cst.SubtractAssign):
                added = negate(added)
            return self.terms_before(d, frame, stop, depth - 1) + added
        if d.kind == "aug" and d.value is not None:
            scale = self.scale(d.value, frame)
            if isinstance(d.op, cst.DivideAssign) and scale is None:
                scale = 1
            if scale is not None:
                return scaled(self.terms_before(d, frame, stop, depth - 1), scale)
        return []

    def terms_before(self, d, frame, stop, depth, seen: set[int] | None = None) -> list[Term]:
        """The terms of ``d.key`` just before the augmented assignment ``d``. Each reaching definition counts
        once per query (``seen``): in a loop, ``x += a`` reaches itself and its sibling ``x += b`` through the back
        edge, and following every such path re-collects the same terms at each level, 2**depth times."""
        target = d.target if isinstance(d.target, cst.BaseExpression) else None
        if target is None:
            return []
        if seen is None:
            seen = {id(d)}
        prior = self.a.flow.reaching(d.key, d.stmt)
        found: list[Term] = []
        for p in prior:
            if id(p) in seen:
                continue  # already expanded on this query (a loop-carried definition): its terms are in
            if p.kind == "assign" and p.element is None and p.value is not None:
                seen.add(id(p))
                found += via(self.terms(p.value, frame, stop, depth), target, p.stmt)
            elif p.kind == "aug" and depth > 0:
                seen.add(id(p))
                inner = self.terms_before(p, frame, stop, depth - 1, seen)
                added = self.terms(p.value, frame, stop, depth) if p.value is not None else []
                if isinstance(p.op, cst.SubtractAssign):
                    added = negate(added)
                found += via(inner + added, target, p.stmt)
        return found

    def scale(self, expr: cst.BaseExpression, frame, depth: int = 4) -> int | None:
        """The sign of a factor that only scales a term: +1 for a positive coefficient, a mask or a token count,
        -1 for a negative literal, None for a factor that is itself a tensor of interest (the product is then a
        term). A coefficient is a literal, a hyperparameter (a config field, ``self.beta`` set from one, a
        parameter's numeric default) or, when nothing in view defines it, a name that says so (``ent_coef``); a
        name bound to a tensor computation (``coef_1 = torch.exp(...)``) never is."""
        number = S.number_value(expr)
        if number is not None:
            return 1 if number > 0 else (-1 if number < 0 else None)
        if isinstance(expr, cst.UnaryOperation) and isinstance(expr.operator, cst.Minus):
            inner = self.scale(expr.expression, frame, depth)
            return None if inner is None else -inner
        if isinstance(expr, cst.Comparison):
            return 1  # a 0/1 selection
        if isinstance(expr, cst.BinaryOperation) and isinstance(expr.operator, (cst.Multiply, cst.Divide)) \
                and depth > 0:
            # `mask.shape[0] / cfg.n`, `1 / self.n_micro`: a product of scalings scales by the product of signs
            left = self._hyperparameter(expr.left, frame, depth - 1)
            right = self._hyperparameter(expr.right, frame, depth - 1) if left is not None else None
            return None if right is None else left * right
        if _shape_read(expr):
            return 1  # `x.shape[0]`, `x.size(0)`, `x.numel()`: a size is not negative
        vocab = self.a.names
        if isinstance(expr, cst.Subscript) and key_of(expr) is None:
            # `m[idx]`: a row selection of a scaling scales like it
            return self.scale(expr.value, frame, depth - 1) if depth > 0 else None
        if isinstance(expr, (cst.Name, cst.Attribute, cst.Subscript)):
            name = read_name(expr)
            if name is None:
                return None
            if vocab.is_role(name, "mask"):
                return 1
            if is_mask_by_use(self.a, expr):
                return 1  # (v * w).sum() / w.sum(): w is a mask by its use
            key = key_of(expr)
            defs = self.a.flow.reaching(key, expr) if key is not None and depth > 0 else []
            values = [d for d in defs if d.kind in ("assign", "aug") and d.value is not None]
            if any(d.kind == "param" for d in defs):
                # `if kl_coef <= 0: kl_coef = 0.0` on a parameter: the term switched off, no sign of its own; the
                # parameter's sign is the scaling's
                values = [d for d in values if S.number_value(d.value) != 0]
            if values and all(d.key != key for d in values):
                # only the container's binding reaches (``args = parser.parse_args()``, ``cfg = load(...)``): the
                # field itself is defined nowhere in view, so it is a setting read from that container
                values = []
                default = self._argparse_default(expr)
                if default is not None:
                    return default
            if values:
                signs_ = {self._hyperparameter(d.value, frame, depth - 1) for d in values}
                return signs_.pop() if len(signs_) == 1 else None
            if isinstance(expr, cst.Attribute) and expr.attr.value in ("value", "coef", "beta") and \
                    self.scale(expr.value, frame, depth - 1) == 1:
                return 1  # kl_ctl.value: an adaptive controller's coefficient
            if _COEF.fullmatch(name) or _COEF_WORD.search(name) or vocab.is_role(name, "entropy_coef") \
                    or vocab.is_role(name, "kl_coef") or _COUNT.fullmatch(name):
                return 1
            return None
        if isinstance(expr, cst.Call):
            if _boolean(self.a, expr):
                return 1  # a 0/1 selection
            method = self.a.method(expr)
            recv = S.receiver(expr)
            if method in ("sum", "numel", "float", "clamp", "clamp_min", "size", "item", "detach") and recv is not None:
                inner = recv
                while isinstance(inner, cst.Call) and self.a.method(inner) in ("sum", "float", "clamp", "clamp_min"):
                    inner = S.receiver(inner)
                name = read_name(inner) if inner is not None else None
                if name is not None and (vocab.is_role(name, "mask") or _COUNT.fullmatch(name)):
                    return 1  # a token count
                if method in ("item", "detach", "float", "sum", "clamp", "clamp_min") and depth > 0 and \
                        self.scale(recv, frame, depth - 1) == 1:
                    return 1  # `m[idx].sum().clamp(min=1)` of a mask: a token count
            if S.called_name(expr) in ("len", "max", "float", "int") and expr.args:
                return 1
            if self.a.call_name(expr) in ("torch.sum", "torch.count_nonzero") and expr.args and depth > 0 and \
                    self.scale(expr.args[0].value, frame, depth - 1) == 1:
                return 1  # torch.sum(mask): a token count
        return None

    def _argparse_default(self, expr: cst.BaseExpression) -> int | None:
        """The sign of the default an ``add_argument("--<field>", default=...)`` of this module gives the field
        read by ``expr`` (``args.kl_coef`` <- ``--kl-coef`` / ``--kl_coef``); None when no such option is in view
        or its default is not a number."""
        if not isinstance(expr, cst.Attribute):
            return None
        defaults = self._option_defaults()
        number = defaults.get(expr.attr.value)
        if number is None:
            return None
        return 1 if number > 0 else (-1 if number < 0 else None)

    def _option_defaults(self) -> dict[str, float]:
        """Destination -> numeric default of every ``*.add_argument("--name", ..., default=N)`` of the module."""
        cached = getattr(self, "_options", None)
        if cached is not None:
            return cached
        out: dict[str, float] = {}
        for call in self.a.nodes(cst.Call):
            if not isinstance(call.func, cst.Attribute) or call.func.attr.value != "add_argument" or not call.args:
                continue
            flags = [S.string_value(arg.value) for arg in call.args if arg.keyword is None]
            dest = next((S.string_value(arg.value) for arg in call.args
                         if arg.keyword is not None and arg.keyword.value == "dest"), None)
            default = next((S.number_value(arg.value) for arg in call.args
                            if arg.keyword is not None and arg.keyword.value == "default"), None)
            long_flags = [f for f in flags if isinstance(f, str) and f.startswith("--")]
            name = dest or (long_flags[0][2:].replace("-", "_") if long_flags else None)
            if name and default is not None:
                out[name] = default
        self._options = out
        return out

    def _hyperparameter(self, value: cst.BaseExpression, frame, depth: int) -> int | None:
        """+1 when a definition binds a positive scalar setting: a literal, a config field, another coefficient."""
        number = S.number_value(value)
        if number is not None:
            return 1 if number > 0 else (-1 if number < 0 else None)
        if isinstance(value, (cst.Name, cst.Attribute)):
            dotted = self.a.code(value)
            if dotted.startswith("self.") or setting_read(value):
                return 1 if self.scale(value, frame, depth) != -1 else -1
            return self.scale(value, frame, depth)
        if isinstance(value, cst.Call) and S.called_name(value) in ("get", "getattr", "float", "int") and value.args:
            return 1
        if isinstance(value, (cst.Call, cst.BinaryOperation)) and zero_one(self.a, value):
            return 1  # `m = torch.tensor(rows, dtype=torch.bool)`, `((i < n) & keep).float()`: a 0/1 selection
        if isinstance(value, (cst.Subscript, cst.BinaryOperation)) or _shape_read(value):
            # `batch["response_mask"]`, `n_tokens / world_size`, `mask.shape[0]`: as a scaling
            return self.scale(value, frame, depth)
        return None

    def _frame(self, func, call, frame) -> Frame | None:
        from rlguard.lint.analysis.values import MAX_FRAMES, bind_arguments

        depth = frame.depth + 1 if frame else 1
        if depth > MAX_FRAMES or self.a.index.contains(func, call):
            return None
        key = (id(func), id(call), id(frame))
        found = self._frames.get(key)
        if found is None:
            found = self._frames[key] = Frame(func, call, bind_arguments(func, call, frame), frame, depth)
        return found


# A settings object by its name (`loss_config`, `train_cfg`, `model_args`): a field read from it is a setting.
_CONFIG_HOLDER = re.compile(r"(?i)\w+_(config|cfg|args|hparams|opts|params|settings)")
_SETTINGS = frozenset({"args", "cfg", "config", "hparams", "opts", "params", "settings"})


def setting_read(expr: cst.BaseExpression) -> bool:
    """A field read off a settings object (``loss_config.kl_penalty``, ``args.beta``, ``self.config.kl_coef``): a
    scalar hyperparameter, never a tensor the training computes, whatever the field is called."""
    if not isinstance(expr, cst.Attribute):
        return False
    parts = (dotted_name(expr) or "").split(".")
    if len(parts) < 2:
        return False
    head = parts[1] if parts[0] == "self" and len(parts) > 2 else parts[0]
    return head in _SETTINGS or _CONFIG_HOLDER.fullmatch(head) is not None
_COEF = re.compile(r"(?i)(\w*_)?(coef|coeff|coefficient|beta|alpha|lambda|lam|scale|temperature|gamma|factor|"
                   r"tau)|\w*_(coef|coeff|weight|scale|factor)|c\d?")
_COEF_WORD = re.compile(r"(?i)(^|_)(coef|coeff|coefficient|beta|alpha|weight|scale|factor)(_|$)")
_COUNT = re.compile(r"(?i)n|n_\w+|num_\w+|\w*_count|count|\w*_counts|total_\w*|\w*_len|\w*_length|length|"
                    r"\w*tokens|batch_size|bsz|world_size|denom\w*|normalizer|grad_accum\w*|\w*accumulation\w*|"
                    r"\w*_steps|\w*_size|size")


def _shape_read(expr: cst.BaseExpression) -> bool:
    """``x.shape[i]``, ``x.size(i)``, ``x.numel()``: a size, never negative."""
    if isinstance(expr, cst.Subscript):
        return isinstance(expr.value, cst.Attribute) and expr.value.attr.value == "shape"
    return isinstance(expr, cst.Call) and isinstance(expr.func, cst.Attribute) and \
        expr.func.attr.value in ("size", "numel") and (expr.func.attr.value == "size" or not expr.args)


def negate(terms: list[Term]) -> list[Term]:
    return [Term(-t.sign, t.expr, t.frame, t.via) for t in terms]


_CASTS = frozenset({"float", "long", "int", "half", "bfloat16", "double", "bool", "to", "type"})


def _boolean(a: "Analysis", call: cst.Call) -> bool:
    """``x.bool()``, ``torch.tensor(rows, dtype=torch.bool)``, ``((a < b) & c).float()``: a tensor of 0/1 values."""
    if a.method(call) == "bool" and not call.args:
        return True
    if a.method(call) in _CASTS and _comparison_like(S.receiver(call)):
        return True
    return any(arg.keyword is not None and arg.keyword.value == "dtype" and a.code(arg.value) in (
        "torch.bool", "bool", "np.bool_", "numpy.bool_") for arg in call.args)


def _comparison_like(expr: cst.BaseExpression | None) -> bool:
    """A comparison, or comparisons joined by ``&``/``|`` or negated by ``~``: a boolean tensor."""
    if isinstance(expr, cst.Comparison):
        return True
    if isinstance(expr, cst.BinaryOperation) and isinstance(expr.operator, (cst.BitAnd, cst.BitOr)):
        return _comparison_like(expr.left) and _comparison_like(expr.right)
    if isinstance(expr, cst.UnaryOperation) and isinstance(expr.operator, cst.BitInvert):
        return _comparison_like(expr.expression)
    return False


_SHAPE_ONLY = frozenset({"clone", "detach", "contiguous", "unsqueeze", "squeeze", "view", "reshape", "flatten",
                         "expand", "expand_as", "repeat", "repeat_interleave", "to", "cpu", "cuda"})
_VALUE_KEEPING = _CASTS | _SHAPE_ONLY
_ONES = frozenset({"torch.ones_like", "torch.ones"})


def zero_one(a: "Analysis", expr: cst.BaseExpression, depth: int = 3) -> bool:
    """Whether ``expr`` holds 0/1 values by how it is computed (a comparison, a cast of one, a bool tensor,
    ``&``/``|`` of such values), through row selections and single definitions, whatever it is called."""
    while isinstance(expr, cst.Subscript) and key_of(expr) is None:
        expr = expr.value
    if _comparison_like(expr) or (isinstance(expr, cst.Call) and _boolean(a, expr)):
        return True
    if depth <= 0:
        return False
    if isinstance(expr, cst.Call) and a.method(expr) in _VALUE_KEEPING and S.receiver(expr) is not None:
        return zero_one(a, S.receiver(expr), depth)
    if isinstance(expr, cst.Call):
        name = a.call_name(expr) or ""
        if name in _ONES or a.method(expr) in ("new_ones",):
            return True  # all ones: a mask that keeps everything
        last = name.rsplit(".", 1)[-1]
        padding = S.argument(expr, None, "padding_value")
        if (name in ("torch.tensor", "torch.as_tensor", "torch.stack", "torch.cat") or last in (
                "pad", "pad_sequence")) and expr.args and (padding is None or S.number_value(padding) in (0, 1)):
            # rows of 0/1 values put together (padded with 0 or 1, the default 0): 0/1 values; padded with a pad
            # id or another value that is not known, they are not
            return zero_one(a, expr.args[0].value, depth)
    if isinstance(expr, (cst.ListComp, cst.GeneratorExp)):
        return zero_one(a, expr.elt, depth)
    if isinstance(expr, (cst.List, cst.Tuple)) and expr.elements:
        return all(zero_one(a, el.value, depth - 1) for el in expr.elements)
    if isinstance(expr, cst.UnaryOperation) and isinstance(expr.operator, cst.BitInvert):
        return zero_one(a, expr.expression, depth)
    if isinstance(expr, cst.BinaryOperation) and isinstance(expr.operator, (cst.BitAnd, cst.BitOr, cst.Multiply)):
        # `m1 & m2`, `m1 * m2`: a selection of selections (a product of 0/1 values is 0/1)
        return zero_one(a, expr.left, depth - 1) and zero_one(a, expr.right, depth - 1)
    key = key_of(expr)
    if key is None:
        return False
    defs = a.flow.reaching(key, expr)
    return bool(defs) and all(d.kind == "assign" and d.value is not None and d.element is None and
                              zero_one(a, d.value, depth - 1) for d in defs)


def scaled(terms: list[Term], sign: int) -> list[Term]:
    return terms if sign > 0 else negate(terms)


def via(terms: list[Term], read: cst.BaseExpression, stmt: cst.CSTNode) -> list[Term]:
    return [Term(t.sign, t.expr, t.frame, ((read, stmt),) + t.via) for t in terms]


def factors(expr: cst.BaseExpression) -> tuple[int, list[cst.BaseExpression]]:
    """The sign and the numerator factors of a product/quotient, negations stripped: ``-c * x.mean() / n`` ->
    (-1, [c, x.mean()])."""
    sign = 1
    while isinstance(expr, cst.UnaryOperation) and isinstance(expr.operator, (cst.Minus, cst.Plus)):
        if isinstance(expr.operator, cst.Minus):
            sign = -sign
        expr = expr.expression
    if isinstance(expr, cst.BinaryOperation) and isinstance(expr.operator, (cst.Multiply, cst.Divide)):
        left_sign, left = factors(expr.left)
        if isinstance(expr.operator, cst.Divide):
            right_sign = -1 if (S.number_value(expr.right) or 0) < 0 else 1
            return sign * left_sign * right_sign, left
        right_sign, right = factors(expr.right)
        return sign * left_sign * right_sign, left + right
    number = S.number_value(expr)
    if number is not None and number < 0:
        return -sign, [cst.Integer(str(int(-number)) if number.is_integer() else "1")]
    return sign, [expr]


def min_max_kind(a: "Analysis", call: cst.Call) -> str | None:
    """"min" or "max" for an elementwise two-argument min/max (``torch.min(a, b)``, ``max(a, b)``)."""
    positional = [arg for arg in call.args if arg.keyword is None and not arg.star]
    if len(positional) != 2 or len(call.args) != 2:
        return None
    name = a.call_name(call)
    if name is None:
        return None
    kind = MIN_MAX.get(name)
    if kind is None:
        return None
    if isinstance(call.func, cst.Name) and any(d.kind != "import" for d in a.flow.reaching(call.func.value, call)):
        return None  # a local function named min
    return kind


def signs(a: "Analysis") -> Signs:
    return a.facet("signs", Signs)
