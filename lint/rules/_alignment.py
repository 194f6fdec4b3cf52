"""Where a per-token tensor sits on the time axis of ``ids``, for the alignment rules (RLG001, RLG007, RLG012).

The catalog's convention: ``logits[:, t]`` predicts ``ids[:, t + 1]``, so log-probs gathered from
``logits[:, :-1]`` against ``ids[:, 1:]`` sit at ids positions 1..T-1. This module traces a tensor back through
names, ``self.`` attributes, slices, ``F.pad``, ``torch.roll``, comparisons (``owner == POLICY``), pass-through
methods and same-module helpers (binding their parameters to the call's arguments) to a root whose alignment it
knows, and returns an :class:`Align`: element 0 of the tensor's time axis is ids position ``s``, its last
element is ids position ``T + e - 1``. Offsets are small linear forms over symbols (``T``, ``context_length``),
so ``logits[:, ctx_len - 1:-1]`` against ``ids[:, ctx_len:]`` is recognised as shifted by exactly one.

Nothing here guesses: a value whose origin cannot be read gives ``None``, and rules only report when the
offset between two tensors is a known constant.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import Iterator

import libcst as cst

from rlguard.lint.context import ModuleContext, argument, dotted_name, value_name

T_SYMBOL = "<T>"


# ----- linear forms ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Lin:
    """``const + sum(coef * symbol)``."""

    const: int = 0
    terms: tuple[tuple[str, int], ...] = ()

    @staticmethod
    def of(const: int = 0, **_: int) -> "Lin":
        return Lin(const)

    @staticmethod
    def sym(name: str, coef: int = 1) -> "Lin":
        return Lin(0, ((name, coef),))

    def _dict(self) -> dict[str, int]:
        return dict(self.terms)

    def __add__(self, other: "Lin") -> "Lin":
        d = self._dict()
        for k, v in other.terms:
            d[k] = d.get(k, 0) + v
        return Lin(self.const + other.const, tuple(sorted((k, v) for k, v in d.items() if v)))

    def __neg__(self) -> "Lin":
        return Lin(-self.const, tuple((k, -v) for k, v in self.terms))

    def __sub__(self, other: "Lin") -> "Lin":
        return self + (-other)

    def is_const(self) -> bool:
        return not self.terms

    def from_end(self) -> bool:
        """A slice bound counted from the end (``-1``, ``-L``, ``-L-1``)."""
        coefs = [v for _, v in self.terms]
        if any(c > 0 for c in coefs):
            return False
        return self.const < 0 or (bool(coefs) and self.const <= 0)


T = Lin.sym(T_SYMBOL)
ZERO = Lin()
ONE = Lin(1)


def lin(expr: cst.BaseExpression | None, module: cst.Module) -> Lin | None:
    """A slice bound or shift as a linear form; names and other expressions become symbols."""
    if expr is None:
        return None
    if isinstance(expr, cst.Integer):
        return Lin(int(expr.evaluated_value))
    if isinstance(expr, cst.UnaryOperation) and isinstance(expr.operator, (cst.Minus, cst.Plus)):
        inner = lin(expr.expression, module)
        if inner is None:
            return None
        return -inner if isinstance(expr.operator, cst.Minus) else inner
    if isinstance(expr, cst.BinaryOperation) and isinstance(expr.operator, (cst.Add, cst.Subtract)):
        left, right = lin(expr.left, module), lin(expr.right, module)
        if left is None or right is None:
            return None
        return left + right if isinstance(expr.operator, cst.Add) else left - right
    if isinstance(expr, (cst.Float, cst.SimpleString, cst.ConcatenatedString, cst.FormattedString)):
        return None
    if isinstance(expr, cst.Name) and expr.value == "None":
        return None
    text = module.code_for_node(expr.with_changes(lpar=[], rpar=[]) if hasattr(expr, "lpar") else expr)
    return Lin.sym(re.sub(r"\s+", "", text))


# ----- alignments ---------------------------------------------------------------------------------------
ROOT_IDS = "ids"  # ids-aligned [B, T] (token ids, owner, attention mask)
ROOT_TOKEN = "token"  # a per-token tensor by its name ([B, T-1] aligned to ids[:, 1:] by convention)
ROOT_UNKNOWN = "unknown"  # a tensor of unknown layout (assumed [B, T] when it is visibly sliced or moved)
ROOT_LOGITS = "logits"  # logits of unknown origin (a parameter named like logits)


@dataclass(frozen=True)
class Align:
    s: Lin
    e: Lin
    root: str  # the root's text and scope: two tensors with the same root come from the same sequence
    kind: str
    moved: bool = False  # sliced, padded or rolled on the time axis somewhere along the chain
    name: str = ""  # the root's name (``attention_mask`` for ``batch["attention_mask"]``)
    model: bool = False  # logits computed by a model call in view
    via: tuple[int, ...] = ()  # ids of the assignment statements passed through
    moved_at: int | None = None  # id of the first assignment statement whose value moved the tensor

    def shift(self, ds: Lin, de: Lin) -> "Align":
        return replace(self, s=self.s + ds, e=self.e + de, moved=True)


def apply_slice(a: Align, sl: cst.Slice, module: cst.Module) -> Align | None:
    if sl.step is not None and not (isinstance(sl.step, cst.Integer) and sl.step.value == "1"):
        return None
    start = None if sl.lower is None else lin(sl.lower, module)
    stop = None if sl.upper is None else lin(sl.upper, module)
    if (sl.lower is not None and start is None) or (sl.upper is not None and stop is None):
        return None
    s, e = a.s, a.e
    if start is not None:
        s = (T + a.e + start) if start.from_end() else a.s + start
    if stop is not None:
        e = (a.e + stop) if stop.from_end() else (a.s + stop - T)
    if start is None and stop is None:
        return a
    return replace(a, s=s, e=e, moved=True)


def _is_none(expr: cst.BaseExpression) -> bool:
    return isinstance(expr, cst.Name) and expr.value == "None"


def time_element(sub: cst.Subscript, side: str) -> tuple[str, cst.BaseSlice | None]:
    """Which element of ``x[...]`` indexes the time axis: ("slice", el), ("index", el), ("none", None)
    (time axis untouched) or ("key", None) for ``x["name"]``."""
    elements = [el.slice for el in sub.slice
                if not (isinstance(el.slice, cst.Index) and _is_none(el.slice.value))]
    if len(elements) == 1 and isinstance(elements[0], cst.Index) and isinstance(
            elements[0].value, (cst.SimpleString, cst.ConcatenatedString)):
        return "key", None
    ell = [i for i, el in enumerate(elements) if isinstance(el, cst.Index) and isinstance(el.value, cst.Ellipsis)]
    if ell:
        after = len(elements) - ell[0] - 1
        if side == "logits":
            if after < 2:
                return "none", None
            el = elements[-2]
        else:
            if after < 1:
                return "none", None
            el = elements[-1]
    elif not elements:
        return "none", None
    elif len(elements) == 1:
        el = elements[0]
    else:
        el = elements[1]
    if isinstance(el, cst.Slice):
        return "slice", el
    return "index", el


# ----- names --------------------------------------------------------------------------------------------
OWNER_NAME = re.compile(r"(?i)\w*owners?(_ids)?|token_owner|roles")
ATTENTION_NAME = re.compile(r"(?i)(\w+_)?(attention|attn|padding|pad)_?mask(s)?")
TOKEN_MASK_NAME = re.compile(r"(?i)(action|loss|response|resp|completion|labels?|gen|generation|act)_?masks?")
SEQ_IDS = frozenset({"ids", "input_ids", "tokens", "token_ids", "sequences", "seq", "query_responses",
                     "query_response", "input_tokens", "sequence", "seqs", "all_ids", "full_ids"})
MODEL_INPUT_KEYWORDS = ("input_ids", "ids", "input", "inputs", "x", "tokens", "sequences", "idx")


def classify_root(ctx: ModuleContext, name: str | None) -> str:
    if not name:
        return ROOT_UNKNOWN
    bare = name.rsplit(".", 1)[-1]
    if ATTENTION_NAME.fullmatch(bare) or OWNER_NAME.fullmatch(bare) or bare in SEQ_IDS or (
            ctx.names.is_role(bare, "ids") and not bare.startswith("target")):
        return ROOT_IDS
    if TOKEN_MASK_NAME.fullmatch(bare):
        return ROOT_TOKEN
    if any(ctx.names.is_role(bare, r) for r in ("logp", "old_logp", "ref_logp")) and "logit" not in bare:
        return ROOT_TOKEN
    if ctx.names.is_role(bare, "logits"):
        return ROOT_LOGITS
    return ROOT_UNKNOWN


def is_model_call(ctx: ModuleContext, call: cst.Call) -> bool:
    func = call.func
    if isinstance(func, cst.Attribute) and func.attr.value in ("forward", "__call__"):
        func = func.value
    name = value_name(func) if isinstance(func, (cst.Name, cst.Attribute)) else None
    if name is None:
        return False
    return ctx.names.is_role(name, "policy") or ctx.names.is_role(name, "ref_model")


# ----- the tracer ---------------------------------------------------------------------------------------
Env = dict  # param name -> (argument expression, caller env)

SEQ_PASS_METHODS = frozenset({
    "float", "double", "half", "bfloat16", "bool", "long", "int", "to", "type", "type_as", "contiguous",
    "clone", "detach", "cpu", "cuda", "unsqueeze", "squeeze", "requires_grad_", "detach_", "view", "reshape",
    "flatten", "view_as", "reshape_as",
})
LOGITS_PASS_METHODS = SEQ_PASS_METHODS | frozenset({
    "log_softmax", "div", "div_", "mul", "mul_", "softmax", "log", "transpose",
    "permute",
})
COMPARE_METHODS = frozenset({"ne", "eq", "gt", "ge", "lt", "le", "not_equal", "greater", "less", "isin"})
LIKE_FUNCTIONS = frozenset({"torch.ones_like", "torch.zeros_like", "torch.full_like", "torch.empty_like"})
LOG_SOFTMAX_FUNCS = frozenset({"torch.log_softmax", "torch.nn.functional.log_softmax", "torch.softmax",
                               "torch.nn.functional.softmax", "torch.log", "torch.special.log_softmax"})


@dataclass
class Tracer:
    ctx: ModuleContext
    budget: int = 400
    _memo: dict = field(default_factory=dict)

    def trace(self, expr: cst.BaseExpression, side: str, env: Env | None = None, depth: int = 16) -> Align | None:
        """Alignment of ``expr``; ``side`` is "seq" ([B, T]-like: ids, masks, log-probs) or "logits"."""
        key = (id(expr), side, id(env) if env else 0)
        if key in self._memo:
            return self._memo[key]
        self._memo[key] = None  # cycles
        self.budget -= 1
        result = None if self.budget < 0 or depth < 0 else self._trace(expr, side, env or {}, depth)
        self._memo[key] = result
        return result

    def _trace(self, expr, side, env, depth) -> Align | None:
        ctx = self.ctx
        if isinstance(expr, (cst.Name, cst.Attribute)):
            return self._name(expr, side, env, depth)
        if isinstance(expr, cst.Subscript):
            kind, el = time_element(expr, side)
            if kind == "key":
                if side == "logits":
                    return self.trace(expr.value, side, env, depth - 1)
                return self._root(expr, value_name(expr), env)
            if kind == "index":
                if side == "logits" and isinstance(el, cst.Index) and isinstance(el.value, cst.Integer) \
                        and el.value.value == "0" and len(expr.slice) == 1:
                    return self.trace(expr.value, side, env, depth - 1)  # model(ids)[0]: the logits of a tuple
                return None
            inner = self.trace(expr.value, side, env, depth - 1)
            if inner is None or kind == "none":
                return inner
            if inner.kind == ROOT_TOKEN and not inner.moved and TOKEN_MASK_NAME.fullmatch(inner.name):
                # a mask sliced on the time axis is an ids-aligned [B, T] mask, whatever its name says
                inner = replace(inner, s=ZERO, kind=ROOT_IDS)
            return apply_slice(inner, el, ctx.module)
        if isinstance(expr, cst.BinaryOperation):
            if isinstance(expr.operator, (cst.Divide, cst.Multiply)) and side == "logits":
                return self.trace(expr.left, side, env, depth - 1)
            if isinstance(expr.operator, (cst.BitAnd, cst.BitOr, cst.Multiply)):
                return self._either(expr.left, expr.right, side, env, depth)
            return None
        if isinstance(expr, cst.UnaryOperation) and isinstance(expr.operator, (cst.BitInvert, cst.Not)):
            return self.trace(expr.expression, side, env, depth - 1)
        if isinstance(expr, cst.Comparison) and len(expr.comparisons) == 1:
            return self._either(expr.left, expr.comparisons[0].comparator, "seq", env, depth)
        if isinstance(expr, cst.Call):
            return self._call(expr, side, env, depth)
        return None

    def _either(self, a, b, side, env, depth) -> Align | None:
        found = [x for x in (self.trace(a, side, env, depth - 1), self.trace(b, side, env, depth - 1)) if x]
        known = [x for x in found if x.kind != ROOT_UNKNOWN] or found
        return known[0] if known else None

    def _call(self, call: cst.Call, side, env, depth) -> Align | None:
        ctx = self.ctx
        func = call.func
        qname = qualified(ctx, call)
        method = func.attr.value if isinstance(func, cst.Attribute) and not is_module_function(ctx, call) else None
        if side == "logits" and is_model_call(ctx, call):
            arg = argument(call, 0, None)
            for kw in MODEL_INPUT_KEYWORDS:
                arg = arg or argument(call, None, kw)
            if arg is None:
                return None
            inp = self.trace(arg, "seq", env, depth - 1)
            if inp is None or inp.kind != ROOT_IDS:
                return None
            return replace(inp, model=True, kind=ROOT_IDS)
        if method is not None:
            passes = LOGITS_PASS_METHODS if side == "logits" else SEQ_PASS_METHODS
            if method in passes:
                if method in ("unsqueeze", "squeeze") and side == "seq" and call.args and not _int_is(
                        call.args[0].value, (-1,)):
                    if method == "squeeze" and _int_is(call.args[0].value, (0,)):
                        return self.trace(func.value, side, env, depth - 1)
                    return None
                return self.trace(func.value, side, env, depth - 1)
            if method in COMPARE_METHODS:
                return self.trace(func.value, "seq", env, depth - 1)
            if method in ("logical_and", "logical_or", "logical_not", "masked_fill"):
                return self.trace(func.value, side, env, depth - 1)
            if method == "roll":
                return self._roll(func.value, call, 0, side, env, depth)
            if method in ("new_ones", "new_zeros"):
                return None
        if qname in LOG_SOFTMAX_FUNCS and side == "logits" and call.args:
            return self.trace(call.args[0].value, side, env, depth - 1)
        if qname in LIKE_FUNCTIONS and call.args:
            return self.trace(call.args[0].value, side, env, depth - 1)
        if qname in ("torch.logical_and", "torch.logical_or") and len(call.args) >= 2:
            return self._either(call.args[0].value, call.args[1].value, side, env, depth)
        if qname == "torch.roll" and call.args:
            return self._roll(call.args[0].value, call, 1, side, env, depth)
        if qname == "torch.nn.functional.pad" and call.args:
            return self._pad(call, side, env, depth)
        if isinstance(func, cst.Name) or dotted_name(func) == f"self.{method}":
            rets = self.helper_returns(call, env)
            found = [self.trace(r, side, e, depth - 1) for r, e in rets]
            found = [f for f in found if f is not None]
            if found and all((f.s, f.e) == (found[0].s, found[0].e) for f in found):
                return found[0]
        return None

    def _roll(self, target, call, pos, side, env, depth) -> Align | None:
        shifts = argument(call, pos, "shifts")
        dims = argument(call, pos + 1, "dims")
        k = lin(shifts, self.ctx.module) if shifts is not None else None
        if k is None or not k.is_const():
            return None
        time_dims = (1, -1) if side == "seq" else (1, -2)
        if dims is not None and not _int_is(dims, time_dims):
            return None
        inner = self.trace(target, side, env, depth - 1)
        return None if inner is None else inner.shift(-k, -k)

    def _pad(self, call, side, env, depth) -> Align | None:
        pad = argument(call, 1, "pad")
        if not isinstance(pad, (cst.Tuple, cst.List)):
            return None
        values = [lin(el.value, self.ctx.module) for el in pad.elements]
        if any(v is None for v in values):
            return None
        first = 0 if side == "seq" else 2
        inner = self.trace(call.args[0].value, side, env, depth - 1)
        if inner is None or len(values) < first + 2:
            return inner
        left, right = values[first], values[first + 1]
        return inner.shift(-left, right)

    def _name(self, expr, side, env, depth) -> Align | None:
        ctx = self.ctx
        key = dotted_name(expr)
        if key is None or (isinstance(expr, cst.Attribute) and not key.startswith("self.")) or key.count(".") > 1:
            if isinstance(expr, cst.Attribute):
                if side == "logits":
                    return self.trace(expr.value, side, env, depth - 1)  # out.logits
                return self._root(expr, expr.attr.value, env)
            return None
        assigns = _reaching(ctx, key, expr)
        if not assigns:
            if isinstance(expr, cst.Name) and key in env:
                arg, caller_env = env[key]
                return self.trace(arg, side, caller_env, depth - 1)
            return self._root(expr, key, env)
        found = []
        for a in assigns:
            if a.value is None:
                return None
            if a.unpacked is not None and not (side == "logits" and a.unpacked == 0):
                return None
            got = self.trace(a.value, side, env, depth - 1)
            if got is None:
                if len(assigns) == 1:
                    return self._root(expr, key, env, fallback_only=True)
                return None
            moved_at = got.moved_at if got.moved_at is not None or not got.moved else id(a.statement)
            found.append(replace(got, via=got.via + (id(a.statement),), moved_at=moved_at))
        if all((f.s, f.e) == (found[0].s, found[0].e) for f in found):
            return found[0]
        return None

    def _root(self, expr, name, env, fallback_only=False) -> Align | None:
        kind = classify_root(self.ctx, name)
        if fallback_only and kind in (ROOT_UNKNOWN, ROOT_LOGITS):
            return None
        start = ONE if kind == ROOT_TOKEN else ZERO
        text = re.sub(r"\s+", "", self.ctx.module.code_for_node(expr))
        scope = self.ctx.scope_of(expr).node
        return Align(start, ZERO, f"{text}@{id(scope)}", kind, name=(name or "").rsplit(".", 1)[-1])

    def helper_returns(self, call: cst.Call, env: Env) -> list[tuple[cst.BaseExpression, Env]]:
        """Return values of a same-module helper, with the helper's parameters bound to the call's arguments."""
        func = call.func
        if isinstance(func, cst.Attribute) and dotted_name(func) == f"self.{func.attr.value}":
            name = func.attr.value  # a method of this class
        elif isinstance(func, cst.Name):
            name = func.value
        else:
            return []
        defs = self.ctx.functions.get(name)
        if not defs or len(defs) != 1:
            return []
        info = self.ctx.scopes[id(defs[0])]
        new_env = bind_params(defs[0], call, env)
        return [(r.value, new_env) for r in info.returns if r.value is not None]


MODULE_HEADS = frozenset({"torch", "F", "nn", "np", "numpy", "math", "functional"})
ALIASES = {"F": "torch.nn.functional", "nn": "torch.nn", "functional": "torch.nn.functional"}


def is_module_function(ctx: ModuleContext, call: cst.Call) -> bool:
    """``torch.roll(...)``, ``F.pad(...)``: a function of a module, not a method of a tensor."""
    dotted = dotted_name(call.func)
    if dotted is None or "." not in dotted:
        return False
    head = dotted.split(".", 1)[0]
    return head in MODULE_HEADS or head in ctx.imports


def qualified(ctx: ModuleContext, call: cst.Call) -> str | None:
    """The call's qualified name, also when ``F``/``nn`` are used without a visible import."""
    name = ctx.call_name(call)
    if name is None:
        return None
    head, _, rest = name.partition(".")
    if head in ALIASES and head not in ctx.imports and rest:
        return f"{ALIASES[head]}.{rest}"
    return name


def bind_params(func: cst.FunctionDef, call: cst.Call, env: Env) -> Env:
    params = [p.name.value for p in (*func.params.posonly_params, *func.params.params)]
    if params and params[0] in ("self", "cls") and isinstance(call.func, cst.Attribute):
        params = params[1:]
    bound: Env = {}
    positional = [a for a in call.args if a.keyword is None and not a.star]
    for name, arg in zip(params, positional):
        bound[name] = (arg.value, env)
    for arg in call.args:
        if arg.keyword is not None:
            bound[arg.keyword.value] = (arg.value, env)
    return bound


def _int_is(expr: cst.BaseExpression | None, values: tuple[int, ...]) -> bool:
    if isinstance(expr, (cst.Tuple, cst.List)) and len(expr.elements) == 1:
        expr = expr.elements[0].value
    if isinstance(expr, cst.Integer):
        return int(expr.value) in values
    if isinstance(expr, cst.UnaryOperation) and isinstance(expr.operator, cst.Minus) and isinstance(
            expr.expression, cst.Integer):
        return -int(expr.expression.value) in values
    return False


def _reaching(ctx: ModuleContext, key: str, at: cst.CSTNode):
    """Plain assignments that may give ``key`` its value at ``at``: the last one before it (not the statement
    that contains ``at``: in ``x = x[:, 1:]`` the right side reads the earlier ``x``), plus later ones in an
    enclosing loop. Augmented assignments (``logits /= t``) keep the value's layout and are looked through."""
    assigns = [a for a in ctx.assignments_to(key, at) if a.op is None]
    if not assigns or key.startswith("self."):
        return assigns
    at_index = ctx.order[id(at)]
    before = [a for a in assigns if a.index < at_index and not ctx.contains(a.statement, at)]
    reach = before[-1:]
    for loop in ctx.enclosing_loops(at):
        reach += [a for a in assigns if a.index > at_index and ctx.contains(loop, a.statement)]
    return reach


# ----- gather sites -------------------------------------------------------------------------------------
LOGP_HELPER = re.compile(
    r"(?i)selective_log_softmax|\w*log_?probs?_(from|of)_\w+|gather_\w*log_?probs?\w*|\w*logps?_from_logits"
    r"|logprobs_from_logits\w*|\w*log_?prob_from_logits")
CROSS_ENTROPY = frozenset({"torch.nn.functional.cross_entropy", "torch.nn.functional.nll_loss"})
LOSS_CLASSES = frozenset({"torch.nn.CrossEntropyLoss", "torch.nn.NLLLoss", "nn.CrossEntropyLoss", "nn.NLLLoss"})
CATEGORICAL = frozenset({"torch.distributions.Categorical", "torch.distributions.categorical.Categorical",
                         "Categorical", "torch.distributions.OneHotCategorical"})


@dataclass(frozen=True)
class GatherSite:
    """Log-probs (or a cross-entropy) of ``labels`` under ``logits``; ``node`` is where to report."""

    node: cst.CSTNode
    logits: cst.BaseExpression
    labels: cst.BaseExpression
    kind: str


def gather_sites(ctx: ModuleContext) -> Iterator[GatherSite]:
    for call in ctx.nodes(cst.Call):
        site = gather_site(ctx, call)
        if site is not None:
            yield site


def gather_site(ctx: ModuleContext, call: cst.Call) -> GatherSite | None:
    func = call.func
    qname = qualified(ctx, call)
    method = func.attr.value if isinstance(func, cst.Attribute) and not is_module_function(ctx, call) else None
    if method == "gather" and qname not in ("torch.gather",):
        dim = argument(call, 0, "dim")
        index = argument(call, 1, "index")
        if index is not None and _int_is(dim, (-1, 2)):
            return GatherSite(call, func.value, index, "gather")
        return None
    if qname == "torch.gather":
        src, dim, index = argument(call, 0, "input"), argument(call, 1, "dim"), argument(call, 2, "index")
        if src is not None and index is not None and _int_is(dim, (-1, 2)):
            return GatherSite(call, src, index, "gather")
        return None
    if qname == "torch.take_along_dim":
        src, index, dim = argument(call, 0, "input"), argument(call, 1, "indices"), argument(call, 2, "dim")
        if src is not None and index is not None and _int_is(dim, (-1, 2)):
            return GatherSite(call, src, index, "gather")
        return None
    if qname in CROSS_ENTROPY or _is_loss_object(ctx, call):
        src, target = argument(call, 0, "input"), argument(call, 1, "target")
        if src is not None and target is not None:
            return GatherSite(call, src, target, "cross_entropy")
        return None
    if method == "log_prob" and call.args:
        dist = _categorical_logits(ctx, func.value)
        if dist is not None:
            return GatherSite(call, dist, call.args[0].value, "categorical")
        return None
    name = func.value if isinstance(func, cst.Name) else method
    if name and LOGP_HELPER.fullmatch(name) and len(call.args) >= 2:
        logits = argument(call, 0, "logits")
        labels = argument(call, 1, "labels") or argument(call, None, "index") or argument(call, None, "input_ids")
        if logits is not None and labels is not None:
            return GatherSite(call, logits, labels, "helper")
    return None


def _is_loss_object(ctx: ModuleContext, call: cst.Call) -> bool:
    func = call.func
    if isinstance(func, cst.Call):
        return qualified(ctx, func) in LOSS_CLASSES
    key = dotted_name(func)
    if key is None or key.count(".") > 1:
        return False
    for a in ctx.assignments_to(key, call):
        if isinstance(a.value, cst.Call) and qualified(ctx, a.value) in LOSS_CLASSES:
            return True
    return False


def _categorical_logits(ctx: ModuleContext, expr: cst.BaseExpression, depth: int = 4) -> cst.BaseExpression | None:
    if depth < 0:
        return None
    if isinstance(expr, cst.Call) and (ctx.call_name(expr) or "").split(".")[-1] in ("Categorical",):
        return argument(expr, None, "logits")
    key = dotted_name(expr)
    if key is not None and key.count(".") <= 1:
        for a in _reaching(ctx, key, expr):
            if a.value is not None:
                got = _categorical_logits(ctx, a.value, depth - 1)
                if got is not None:
                    return got
    return None


def call_sites(ctx: ModuleContext, func: cst.FunctionDef, limit: int = 8) -> list[cst.Call]:
    """In-module calls of ``func`` by its bare name (or ``self.name`` for methods)."""
    name = func.name.value
    if len(ctx.functions.get(name, [])) != 1:
        return []
    out = []
    for call in ctx.nodes(cst.Call):
        f = call.func
        if (isinstance(f, cst.Name) and f.value == name) or (
                isinstance(f, cst.Attribute) and f.attr.value == name and dotted_name(f) == f"self.{name}"):
            out.append(call)
            if len(out) >= limit:
                break
    return out


def fmt(x: Lin) -> str:
    return str(x.const) if x.is_const() else "?"
