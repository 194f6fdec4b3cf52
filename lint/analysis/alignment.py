"""Where a per-token tensor sits on the time axis of ``ids``, for the alignment rules (RLG001, RLG007, RLG012).

The catalog's convention: ``logits[:, t]`` predicts ``ids[:, t + 1]``, so log-probs gathered from
``logits[:, :-1]`` against ``ids[:, 1:]`` sit at ids positions 1..T-1, and so does every per-token training tensor
([B, T-1], aligned to ``ids[:, 1:]``); value-head predictions sliced like logits pair with the next token the same
way. A tensor is traced (through the shared value walk: names, ``self.`` attributes, batch keys, helpers with their
parameters bound) to a *root* whose alignment is known, and slices, ``F.pad``, ``torch.roll``, comparisons
(``owner == POLICY``) and pass-through methods move it. An :class:`Align` says element 0 of the tensor's time axis
is ids position ``s`` and its last element ids position ``T + e - 1``; offsets are small linear forms over symbols
(``T``, ``context_length``), so ``logits[:, ctx_len - 1:-1]`` against ``ids[:, ctx_len:]`` is recognised as
shifted by exactly one.

Roots are classified by what they are read from: token ids, ownership and attention masks are [B, T] at ids
positions; a per-token mask or log-probs read from a batch are, by the convention, already aligned to ``ids[:, 1:]``.
Nothing here guesses: a value whose origin cannot be read is unknown (None), and rules only report when the offset
between two tensors is a known constant.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import libcst as cst

from rlguard.lint.analysis import semantics as S
from rlguard.lint.analysis.index import Def, key_entry, key_of, names_read
from rlguard.lint.analysis.provenance import models
from rlguard.lint.analysis.records import splat_entry
from rlguard.lint.analysis.values import Facet, Frame, Trace

if TYPE_CHECKING:
    from rlguard.lint.analysis import Analysis

T_SYMBOL = "<T>"


# ----- linear forms -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Lin:
    """``const + sum(coef * symbol)``."""

    const: int = 0
    terms: tuple[tuple[str, int], ...] = ()

    @staticmethod
    def sym(name: str, coef: int = 1) -> "Lin":
        return Lin(0, ((name, coef),))

    def __add__(self, other: "Lin") -> "Lin":
        d = dict(self.terms)
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


def lin(expr: cst.BaseExpression | None, a: "Analysis") -> Lin | None:
    """A slice bound or shift as a linear form; names and other expressions become symbols."""
    if expr is None:
        return None
    if isinstance(expr, cst.Integer):
        return Lin(int(expr.evaluated_value))
    if isinstance(expr, cst.UnaryOperation) and isinstance(expr.operator, (cst.Minus, cst.Plus)):
        inner = lin(expr.expression, a)
        if inner is None:
            return None
        return -inner if isinstance(expr.operator, cst.Minus) else inner
    if isinstance(expr, cst.BinaryOperation) and isinstance(expr.operator, (cst.Add, cst.Subtract)):
        left, right = lin(expr.left, a), lin(expr.right, a)
        if left is None or right is None:
            return None
        return left + right if isinstance(expr.operator, cst.Add) else left - right
    if isinstance(expr, (cst.Float, cst.SimpleString, cst.ConcatenatedString, cst.FormattedString)):
        return None
    if isinstance(expr, cst.Name) and expr.value == "None":
        return None
    text = a.code(expr.with_changes(lpar=[], rpar=[]) if hasattr(expr, "lpar") else expr)
    return Lin.sym(re.sub(r"\s+", "", text))


# ----- alignments -----------------------------------------------------------------------------------------------
ROOT_IDS = "ids"  # ids-aligned [B, T] (token ids, owner, attention mask)
ROOT_TOKEN = "token"  # a per-token tensor by the convention ([B, T-1] aligned to ids[:, 1:])
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
    via: tuple[int, ...] = ()  # ids of the definition statements passed through
    moved_at: int | None = None  # id of the first definition statement whose value moved the tensor

    def shift(self, ds: Lin, de: Lin) -> "Align":
        return replace(self, s=self.s + ds, e=self.e + de, moved=True)


def apply_slice(al: Align, sl: cst.Slice, a: "Analysis") -> Align | None:
    if sl.step is not None and not (isinstance(sl.step, cst.Integer) and sl.step.value == "1"):
        return None
    start = None if sl.lower is None else lin(sl.lower, a)
    stop = None if sl.upper is None else lin(sl.upper, a)
    if (sl.lower is not None and start is None) or (sl.upper is not None and stop is None):
        return None
    s, e = al.s, al.e
    if start is not None:
        s = (T + al.e + start) if start.from_end() else al.s + start
    if stop is not None:
        e = (al.e + stop) if stop.from_end() else (al.s + stop - T)
    if start is None and stop is None:
        return al
    return replace(al, s=s, e=e, moved=True)


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


# ----- names of roots -------------------------------------------------------------------------------------------
OWNER_NAME = re.compile(r"(?i)\w*owners?(_ids)?|token_owner|roles")
ATTENTION_NAME = re.compile(r"(?i)(\w+_)?(attention|attn|padding|pad)_?mask(s)?")
TOKEN_MASK_NAME = re.compile(r"(?i)(action|loss|response|resp|completion|labels?|gen|generation|act)_?masks?")
SEQ_IDS = frozenset({"ids", "input_ids", "tokens", "token_ids", "sequences", "seq", "query_responses",
                     "query_response", "input_tokens", "sequence", "seqs", "all_ids", "full_ids", "all_tokens"})
MODEL_INPUT_KEYWORDS = ("input_ids", "ids", "input", "inputs", "x", "tokens", "sequences", "idx")


def classify_root(a: "Analysis", name: str | None) -> str:
    if not name:
        return ROOT_UNKNOWN
    bare = name.rsplit(".", 1)[-1]
    if ATTENTION_NAME.fullmatch(bare) or OWNER_NAME.fullmatch(bare) or bare in SEQ_IDS or (
            a.names.is_role(bare, "ids") and not bare.startswith("target")):
        return ROOT_IDS
    if TOKEN_MASK_NAME.fullmatch(bare):
        return ROOT_TOKEN
    if any(a.names.is_role(bare, r) for r in ("logp", "old_logp", "ref_logp")) and "logit" not in bare:
        return ROOT_TOKEN
    if a.names.is_role(bare, "logits"):
        return ROOT_LOGITS
    return ROOT_UNKNOWN


SEQ_PASS_METHODS = frozenset({
    "float", "double", "half", "bfloat16", "bool", "long", "int", "to", "type", "type_as", "contiguous",
    "clone", "detach", "cpu", "cuda", "unsqueeze", "squeeze", "requires_grad_", "detach_", "view", "reshape",
    "flatten", "view_as", "reshape_as",
})
LOGITS_PASS_METHODS = SEQ_PASS_METHODS | frozenset({
    "log_softmax", "div", "div_", "mul", "mul_", "softmax", "log", "transpose", "permute",
})
COMPARE_METHODS = frozenset({"ne", "eq", "gt", "ge", "lt", "le", "not_equal", "greater", "less", "isin"})
LIKE_FUNCTIONS = frozenset({"torch.ones_like", "torch.zeros_like", "torch.full_like", "torch.empty_like"})
LOG_SOFTMAX_FUNCS = frozenset({"torch.log_softmax", "torch.nn.functional.log_softmax", "torch.softmax",
                               "torch.nn.functional.softmax", "torch.log", "torch.special.log_softmax"})


def _int_is(expr: cst.BaseExpression | None, values: tuple[int, ...]) -> bool:
    if isinstance(expr, (cst.Tuple, cst.List)) and len(expr.elements) == 1:
        expr = expr.elements[0].value
    value = S.int_value(expr)
    return value is not None and value in values


# ----- the facet ---------------------------------------------------------------------------------------------------
class AlignFacet(Facet):
    """The alignment of a tensor, on one ``side``: "seq" ([B, T]-like: ids, masks, log-probs) or "logits"."""

    unknown = None

    def __init__(self, a: "Analysis", side: str):
        self.a = a
        self.side = side
        self.models = models(a)

    def join(self, values):
        # a path whose layout is unknown (`x = unpad(...)` on a packed branch) says nothing against the known
        # paths: they are judged as they are (a fault on one feasible path is a fault)
        values = [v for v in values if v is not None]
        if not values:
            return None
        first = values[0]
        if not all(v.s == first.s for v in values):
            return None
        known = [v for v in values if v.kind != ROOT_UNKNOWN]
        chosen = known[0] if known else first
        if not all(v.e == first.e for v in values):
            # the same start, ends that differ (one known, one a symbol): the start is what is known
            chosen = replace(chosen, e=Lin.sym(f"<join@{id(values[0])}>"))
        return chosen

    def other(self, trace) -> Trace:
        return alignment(self.a, "seq" if self.side == "logits" else "logits")

    def seq(self, trace) -> Trace:
        return trace if self.side == "seq" else alignment(self.a, "seq")

    def defined(self, trace, d: Def, value):
        if value is None and d.kind == "assign" and d.element is None and isinstance(d.value, cst.Call) and \
                self.a.callee(d.value) is None and d.target is not None:
            # `attention_mask = make_mask(ids)`, `tokens = torch.stack(rows)`: what a call the facet cannot place
            # returns is read like a batch field of that name (an attention mask, token ids: ids-aligned)
            kind = classify_root(self.a, d.key)
            if kind in (ROOT_IDS, ROOT_TOKEN):
                value = self.root(d.target, d.key, None)
            elif self.side == "seq":
                # `batch = torch.tensor(rows)`: a tensor of its own, at its own positions. It pairs only with
                # itself (its root is this assignment), so `model(batch)` scored against `batch` is one sequence
                value = Align(ZERO, ZERO, f"<def@{id(d.stmt)}>", kind, name=d.key.rsplit(".", 1)[-1])
        if value is None or not isinstance(d.stmt, cst.CSTNode):
            return value
        moved_at = value.moved_at if value.moved_at is not None or not value.moved else id(d.stmt)
        return replace(value, via=value.via + (id(d.stmt),), moved_at=moved_at)

    def root(self, expr, name: str | None, frame) -> Align:
        kind = classify_root(self.a, name)
        start = ONE if kind == ROOT_TOKEN else ZERO
        text = re.sub(r"\s+", "", self.a.code(expr))
        scope = self.a.index.function_scope(expr).node
        return Align(start, ZERO, f"{text}@{id(scope)}@{id(frame)}", kind, name=(name or "").rsplit(".", 1)[-1])

    # ----- hooks --------------------------------------------------------------------------------------------
    def leaf(self, trace, expr, frame):
        return self.root(expr, _read_name(expr), frame)

    def param(self, trace, d, expr, frame):
        return self.root(expr, d.key, frame)

    def item(self, trace, container, entry):
        if self.side == "logits":
            return container  # out.logits, out["logits"]: the logits of the output
        if container is None:
            return Align(ONE if classify_root(self.a, entry) == ROOT_TOKEN else ZERO, ZERO, f"<item>{entry}",
                         classify_root(self.a, entry), name=entry)
        kind = classify_root(self.a, entry)
        start = ONE if kind == ROOT_TOKEN else ZERO
        return Align(start, ZERO, f"{container.root}.{entry}", kind, name=entry)

    def unknown_container(self, trace, expr, frame):
        # `b = make_batch(...)` then `b["input_ids"]`, `b["labels"]`: entries of one record, whatever it holds
        if self.side != "seq":
            return None
        return Align(ZERO, ZERO, self.root(expr, None, frame).root, ROOT_UNKNOWN)

    def element(self, trace, whole, position):
        if self.side == "logits" and position == 0:
            return whole  # logits, *rest = model(ids)
        return None

    def aug(self, trace, before, op, operand, d):
        return before  # `logits /= t` keeps the layout

    def opaque(self, trace, d, expr):
        return None

    # ----- expressions ----------------------------------------------------------------------------------------
    def node(self, trace, expr, frame):
        side = self.side
        a = self.a
        if isinstance(expr, cst.Subscript) and key_of(expr) is None:
            kind, el = time_element(expr, side)
            if kind == "key":
                return None
            if kind == "index":
                if side == "logits" and isinstance(el, cst.Index) and S.int_value(el.value) == 0 and len(
                        expr.slice) == 1:
                    return trace.value(expr.value, frame)  # model(ids)[0]: the logits of a tuple
                return _UNKNOWN
            inner = trace.value(expr.value, frame)
            if inner is None or kind == "none":
                return inner if inner is not None else _UNKNOWN
            if inner.kind == ROOT_TOKEN and not inner.moved and TOKEN_MASK_NAME.fullmatch(inner.name):
                # a mask sliced on the time axis is an ids-aligned [B, T] mask, whatever its name says
                inner = replace(inner, s=ZERO, kind=ROOT_IDS)
            return apply_slice(inner, el, a) or _UNKNOWN
        if isinstance(expr, cst.Attribute) and key_of(expr) is None:
            if side == "logits":
                return trace.value(expr.value, frame) or _UNKNOWN  # model(ids).logits
            return _UNKNOWN
        if isinstance(expr, cst.BinaryOperation):
            if isinstance(expr.operator, (cst.Divide, cst.Multiply)) and side == "logits":
                return trace.value(expr.left, frame) or _UNKNOWN
            if isinstance(expr.operator, cst.Multiply) and side == "seq":
                # `mask * ids[:, 1:]`: two known operands at different positions give no one layout (the values
                # are the ids', the zeros the mask's)
                left, right = trace.value(expr.left, frame), trace.value(expr.right, frame)
                if left is not None and right is not None and (left.moved or right.moved) and (
                        left.s != right.s or left.e != right.e):
                    return _UNKNOWN
            if isinstance(expr.operator, (cst.BitAnd, cst.BitOr, cst.Multiply)):
                return self._either(trace, expr.left, expr.right, frame)
            return _UNKNOWN
        if isinstance(expr, cst.UnaryOperation) and isinstance(expr.operator, (cst.BitInvert, cst.Not)):
            return trace.value(expr.expression, frame) or _UNKNOWN
        if isinstance(expr, cst.Comparison) and len(expr.comparisons) == 1:
            seq = self.seq(trace)
            return AlignFacet._either(seq.facet, seq, expr.left, expr.comparisons[0].comparator, frame)
        if isinstance(expr, cst.Call):
            return self._call(trace, expr, frame)
        if isinstance(expr, (cst.Integer, cst.Float, cst.SimpleString, cst.Tuple, cst.List, cst.Dict)):
            return _UNKNOWN
        return None

    def _either(self, trace, left, right, frame):
        found = [x for x in (trace.value(left, frame), trace.value(right, frame)) if x]
        known = [x for x in found if x.kind != ROOT_UNKNOWN] or found
        return known[0] if known else _UNKNOWN

    def _call(self, trace, call: cst.Call, frame):
        a = self.a
        side = self.side
        qname = a.call_name(call)
        method = a.method(call)
        if side == "logits" and self.is_model_call(call, frame):
            arg = S.argument(call, 0, None)
            for kw in MODEL_INPUT_KEYWORDS:
                arg = arg or S.argument(call, None, kw)
            for kw in MODEL_INPUT_KEYWORDS:
                arg = arg or splat_entry(a, call, kw)  # `inputs = {"input_ids": ids, ...}; model(**inputs)`
            if arg is None:
                return _UNKNOWN
            inp = self.seq(trace).value(arg, frame)
            if inp is None or inp.kind not in (ROOT_IDS, ROOT_UNKNOWN):
                return _UNKNOWN
            # what a model reads is its token ids, whatever the tensor is called (`model(batch_token_ids)`)
            return replace(inp, model=True, kind=ROOT_IDS)
        if method is not None:
            passes = LOGITS_PASS_METHODS if side == "logits" else SEQ_PASS_METHODS
            recv = S.receiver(call)
            if method in passes:
                # a trailing axis (-1, or 2 and later: after [B, T]) keeps the time axis where it was
                if method in ("unsqueeze", "squeeze") and side == "seq" and call.args and not _int_is(
                        call.args[0].value, (-1, 2, 3)):
                    if method == "squeeze" and _int_is(call.args[0].value, (0,)):
                        return trace.value(recv, frame) or _UNKNOWN
                    return _UNKNOWN
                return trace.value(recv, frame) or _UNKNOWN
            if method in COMPARE_METHODS:
                return self.seq(trace).value(recv, frame) or _UNKNOWN
            if method in ("logical_and", "logical_or", "logical_not", "masked_fill"):
                return trace.value(recv, frame) or _UNKNOWN
            if method == "roll":
                return self._roll(trace, recv, call, 0, frame)
            if method in ("new_ones", "new_zeros"):
                return _UNKNOWN
        if qname in LOG_SOFTMAX_FUNCS and side == "logits" and call.args:
            return trace.value(call.args[0].value, frame) or _UNKNOWN
        if qname == "getattr" and side == "logits" and len(call.args) >= 2 and \
                S.string_value(call.args[1].value) in ("logits", "logit"):
            # getattr(output, "logits", output): a model output's logits, or the output when it is the logits
            return trace.value(call.args[0].value, frame) or _UNKNOWN
        if qname in LIKE_FUNCTIONS and call.args:
            return trace.value(call.args[0].value, frame) or _UNKNOWN
        if qname in ("torch.logical_and", "torch.logical_or") and len(call.args) >= 2:
            return self._either(trace, call.args[0].value, call.args[1].value, frame)
        if qname == "torch.where" and len(call.args) >= 3 and side == "seq":
            # where(cond, c, x) keeps x's positions, or c's when x is a scalar (`torch.where(mask, labels, 0)`)
            kept = call.args[1].value if S.number_value(call.args[2].value) is not None else call.args[2].value
            return trace.value(kept, frame) or _UNKNOWN
        if qname == "torch.roll" and call.args:
            return self._roll(trace, call.args[0].value, call, 1, frame)
        if qname in ("torch.cat", "torch.concat", "torch.concatenate") and side == "seq" and call.args:
            return self._cat(trace, call, frame)
        if qname == "torch.nn.functional.pad" and call.args:
            return self._pad(trace, call, frame)
        if a.callee(call) is not None:
            return None  # walked into by the shared walk
        return _UNKNOWN

    def _roll(self, trace, target, call, pos, frame):
        shifts = S.argument(call, pos, "shifts")
        dims = S.argument(call, pos + 1, "dims")
        k = lin(shifts, self.a) if shifts is not None else None
        if k is None or not k.is_const():
            return _UNKNOWN
        time_dims = (1, -1) if self.side == "seq" else (1, -2)
        if dims is not None and not _int_is(dims, time_dims):
            return _UNKNOWN
        inner = trace.value(target, frame)
        return _UNKNOWN if inner is None else inner.shift(-k, -k)

    def _cat(self, trace, call, frame):
        """``torch.cat([prompt, completion], dim=1)``: the pieces appended along time make a sequence that starts
        where the first one does (its end is the pieces' sum: a symbol); token ids and masks so joined are a whole
        episode's [B, T] ids-aligned tensor."""
        padded = self._cat_constant(trace, call, frame)
        if padded is not None:
            return padded
        dim = S.argument(call, 1, "dim")
        if not _int_is(dim, (1, -1)):
            return _UNKNOWN
        pieces = call.args[0].value
        if not isinstance(pieces, (cst.Tuple, cst.List)) or not pieces.elements:
            return _UNKNOWN
        first = trace.value(pieces.elements[0].value, frame)
        kinds = {v.kind for v in (trace.value(el.value, frame) for el in pieces.elements) if v is not None}
        if kinds & {ROOT_TOKEN, ROOT_LOGITS}:
            return _UNKNOWN
        start = first.s if first is not None and first.s.is_const() else ZERO
        text = re.sub(r"\s+", "", self.a.code(call))
        return Align(start, Lin.sym(f"<cat>{text}"), f"{text}@{id(frame)}", ROOT_IDS, name="cat")

    def _cat_constant(self, trace, call, frame):
        """``torch.cat([x[:, 1:], zeros(B, 1)], dim=1)``, ``torch.cat([labels[1:], torch.tensor([0])])`` (a packed,
        rank-1 sequence): one traced tensor joined along time with constant pieces of literal width is that tensor
        padded, like ``F.pad``: its positions stay, the pieces before it move its start, those after it its end.
        Along dim 0 only when the tensor is visibly rank 1 (sliced by a single slice) and the pieces are rank-1
        literals."""
        dim = S.argument(call, 1, "dim")
        rank1 = dim is None or _int_is(dim, (0,))
        if not rank1 and not _int_is(dim, (1, -1)):
            return None
        pieces = call.args[0].value
        if not isinstance(pieces, (cst.Tuple, cst.List)) or len(pieces.elements) < 2:
            return None
        widths = [_literal_width(self.a, el.value, rank1) for el in pieces.elements]
        traced = [i for i, w in enumerate(widths) if w is None]
        if len(traced) != 1:
            return None
        i = traced[0]
        piece = pieces.elements[i].value
        if rank1 and not (isinstance(piece, cst.Subscript) and len(piece.slice) == 1
                          and isinstance(piece.slice[0].slice, cst.Slice)):
            return None
        inner = trace.value(piece, frame)
        if inner is None or inner.kind not in (ROOT_IDS, ROOT_UNKNOWN):
            return None
        before, after = sum(widths[:i]), sum(widths[i + 1:])
        return inner.shift(Lin(-before), Lin(after))

    def _pad(self, trace, call, frame):
        pad = S.argument(call, 1, "pad")
        if not isinstance(pad, (cst.Tuple, cst.List)):
            return _UNKNOWN
        values = [lin(el.value, self.a) for el in pad.elements]
        if any(v is None for v in values):
            return _UNKNOWN
        first = 0 if self.side == "seq" else 2
        inner = trace.value(call.args[0].value, frame)
        if inner is None or len(values) < first + 2:
            return inner if inner is not None else _UNKNOWN
        left, right = values[first], values[first + 1]
        return inner.shift(-left, right)

    def is_model_call(self, call: cst.Call, frame) -> bool:
        func = call.func
        if isinstance(func, cst.Attribute) and func.attr.value in ("forward", "__call__"):
            func = func.value
        if not isinstance(func, (cst.Name, cst.Attribute)):
            return False
        return self.models.model(func, frame) is not None


CONSTANT_FACTORIES = frozenset({"torch.zeros", "torch.ones", "torch.full", "torch.empty"})
CONSTANT_METHODS = frozenset({"new_zeros", "new_ones", "new_full", "new_empty"})


def _literal_width(a: "Analysis", expr: cst.BaseExpression, rank1: bool) -> int | None:
    """The width along the joined axis of a constant piece of ``torch.cat`` (``torch.tensor([0])``,
    ``torch.zeros(1)``, ``x.new_zeros(B, 1)``, ``torch.full((B, 2), pad)``), when it is a literal; else None."""
    if not isinstance(expr, cst.Call):
        return None
    qname, method = a.call_name(expr), a.method(expr)
    if qname in ("torch.tensor", "torch.as_tensor", "torch.LongTensor") and rank1 and expr.args:
        data = expr.args[0].value
        if isinstance(data, (cst.List, cst.Tuple)) and data.elements and all(
                isinstance(el.value, (cst.Integer, cst.Float)) or S.int_value(el.value) is not None
                for el in data.elements):
            return len(data.elements)
        return None
    if qname not in CONSTANT_FACTORIES and method not in CONSTANT_METHODS:
        return None
    sizes = [arg.value for arg in expr.args if arg.keyword is None and not arg.star]
    if qname in ("torch.full",) or method == "new_full":
        sizes = sizes[:1]
    if len(sizes) == 1 and isinstance(sizes[0], (cst.Tuple, cst.List)):
        sizes = [el.value for el in sizes[0].elements]
    if not sizes or len(sizes) != (1 if rank1 else 2):
        return None
    return S.int_value(sizes[-1])


# What `node` returns for an expression it knows nothing about. It is None, like "defer to the shared walk": for
# anything but a name or a call of this module's functions the walk then gives unknown as well.
_UNKNOWN = None


def _read_name(expr: cst.BaseExpression) -> str | None:
    key = key_of(expr)
    if key is None:
        return None
    entry = key_entry(key)
    return entry if entry is not None else key


def alignment(a: "Analysis", side: str) -> Trace:
    return a.facet(f"alignment:{side}", lambda an: Trace(an, AlignFacet(an, side), budget=60000))


def trace_alignment(a: "Analysis", expr: cst.BaseExpression, side: str, frame: Frame | None = None) -> Align | None:
    return alignment(a, side).value(expr, frame)


# ----- gather sites -------------------------------------------------------------------------------------------
CROSS_ENTROPY = frozenset({"torch.nn.functional.cross_entropy", "torch.nn.functional.nll_loss"})
LOSS_CLASSES = frozenset({"torch.nn.CrossEntropyLoss", "torch.nn.NLLLoss", "nn.CrossEntropyLoss", "nn.NLLLoss"})


@dataclass(frozen=True)
class GatherSite:
    """Log-probs (or a cross-entropy) of ``labels`` under ``logits``; ``node`` is where to report."""

    node: cst.CSTNode
    logits: cst.BaseExpression
    labels: cst.BaseExpression
    kind: str


def gather_sites(a: "Analysis") -> list[GatherSite]:
    def build(an):
        return [site for call in an.nodes(cst.Call) for site in [gather_site(an, call)] if site is not None]
    return a.facet("gather_sites", build)


def gather_site(a: "Analysis", call: cst.Call) -> GatherSite | None:
    func = call.func
    qname = a.call_name(call)
    method = a.method(call)
    if method == "gather":
        dim = S.argument(call, 0, "dim")
        index = S.argument(call, 1, "index")
        if index is not None and _int_is(dim, (-1, 2)):
            return GatherSite(call, S.receiver(call), index, "gather")
        return None
    if qname == "torch.gather":
        src, dim, index = S.argument(call, 0, "input"), S.argument(call, 1, "dim"), S.argument(call, 2, "index")
        if src is not None and index is not None and _int_is(dim, (-1, 2)):
            return GatherSite(call, src, index, "gather")
        return None
    if qname == "torch.take_along_dim":
        src, index, dim = S.argument(call, 0, "input"), S.argument(call, 1, "indices"), S.argument(call, 2, "dim")
        if src is not None and index is not None and _int_is(dim, (-1, 2)):
            return GatherSite(call, src, index, "gather")
        return None
    if qname in EINX_GATHER:
        site = _einx_gather(call)
        if site is not None:
            return site
        return None
    if qname in CROSS_ENTROPY or _is_loss_object(a, call):
        src, target = S.argument(call, 0, "input"), S.argument(call, 1, "target")
        if src is not None and target is not None:
            return GatherSite(call, src, target, "cross_entropy")
        return None
    if method == "log_prob" and call.args:
        dist = _categorical_logits(a, S.receiver(call))
        if dist is not None:
            return GatherSite(call, dist, call.args[0].value, "categorical")
        return None
    # `selective_log_softmax(...)`, `self.logprobs_from_logits(...)`, `model_utils.log_softmax_and_gather(...)`
    name = func.value if isinstance(func, cst.Name) else func.attr.value if isinstance(func, cst.Attribute) else None
    if name and S.LOGPROB_HELPER.fullmatch(name) and len(call.args) >= 2 and a.callee(call) is None:
        logits = S.argument(call, 0, "logits")
        labels = S.argument(call, 1, "labels") or S.argument(call, None, "index") or S.argument(
            call, None, "input_ids")
        if logits is not None and labels is not None:
            return GatherSite(call, logits, labels, "helper")
    return None


EINX_GATHER = frozenset({"einx.get_at"})
_EINX_AXES = re.compile(r"\s+")


def _einx_gather(call: cst.Call) -> GatherSite | None:
    """``einx.get_at("b n [v], b n -> b n", logp, ids)``: a gather along the last axis of the first operand, when
    the pattern brackets exactly that axis and the indices carry the other axes in the same order (the
    per-token ``gather(-1, ids[..., None])``)."""
    if len(call.args) < 3 or any(arg.keyword is not None or arg.star for arg in call.args[:3]):
        return None
    pattern = call.args[0].value
    if not isinstance(pattern, cst.SimpleString):
        return None
    text = pattern.evaluated_value
    if not isinstance(text, str) or text.count("->") != 1:
        return None
    inputs, output = (part.strip() for part in text.split("->"))
    operands = [o.strip() for o in inputs.split(",")]
    if len(operands) != 2:
        return None
    source, index = (_EINX_AXES.split(o) for o in operands)
    out = _EINX_AXES.split(output)
    if len(source) < 2 or not re.fullmatch(r"\[\w+\]", source[-1]) or any("[" in ax for ax in source[:-1]):
        return None
    if index != source[:-1] or out != index:
        return None
    return GatherSite(call, call.args[1].value, call.args[2].value, "gather")


def _is_loss_object(a: "Analysis", call: cst.Call) -> bool:
    func = call.func
    if type(func) is cst.Call:
        return a.call_name(func) in LOSS_CLASSES
    key = key_of(func)
    if key is None or key.count(".") > 1 or key.rsplit(".", 1)[-1] not in _loss_object_names(a):
        return False
    for d in a.flow.reaching(key, call):
        if d.kind == "assign" and isinstance(d.value, cst.Call) and a.call_name(d.value) in LOSS_CLASSES:
            return True
    return False


def _loss_object_names(a: "Analysis") -> frozenset[str]:
    """Last names of what the module binds to ``nn.CrossEntropyLoss()`` and the like (a cheap filter)."""
    hit = a.cache.get("loss_object_names")
    if hit is None:
        names = set()
        for stmt in a.nodes(cst.Assign):
            if type(stmt.value) is cst.Call and a.call_name(stmt.value) in LOSS_CLASSES:
                for target in stmt.targets:
                    key = key_of(target.target)
                    if key:
                        names.add(key.rsplit(".", 1)[-1])
        hit = a.cache["loss_object_names"] = frozenset(names)
    return hit


def _categorical_logits(a: "Analysis", expr: cst.BaseExpression, depth: int = 4) -> cst.BaseExpression | None:
    if depth < 0 or expr is None:
        return None
    if isinstance(expr, cst.Call) and (a.call_name(expr) or "").split(".")[-1] == "Categorical":
        return S.argument(expr, None, "logits")
    key = key_of(expr)
    if key is not None and key.count(".") <= 1:
        for d in a.flow.reaching(key, expr):
            if d.kind == "assign" and d.value is not None:
                got = _categorical_logits(a, d.value, depth - 1)
                if got is not None:
                    return got
    return None


def fmt(x: Lin) -> str:
    return str(x.const) if x.is_const() else "?"


__all__ = ["Align", "GatherSite", "Lin", "ONE", "ROOT_IDS", "ROOT_LOGITS", "ROOT_TOKEN", "ROOT_UNKNOWN", "T", "ZERO",
           "alignment", "apply_slice", "classify_root", "gather_site", "gather_sites", "lin", "response_columns",
           "time_element", "trace_alignment"]


# ----- where the per-token values inside an expression are stored ---------------------------------------------------
ELEMENTWISE_METHODS = frozenset({
    "exp", "clamp", "clip", "float", "double", "to", "detach", "clone", "contiguous", "squeeze", "neg", "abs",
    "pow", "sub", "add", "mul", "div", "half", "bfloat16", "type_as", "log", "sigmoid", "minimum", "maximum",
})
ELEMENTWISE_FUNCTIONS = frozenset({
    "torch.exp", "torch.clamp", "torch.clip", "torch.min", "torch.max", "torch.minimum", "torch.maximum",
    "torch.where", "torch.abs", "torch.square", "torch.log",
})
# Tensors that are per-sequence or per-token weights, not values stored on the time axis of log-probs.
SKIP_ROLES = ("advantages", "returns", "rewards", "mask", "entropy_coef", "kl_coef")
VALUE_NAME = re.compile(r"(?i)\w*values?(_pred|_preds|_old)?|vpreds?|v_preds?")
EMPTY: frozenset = frozenset()
LOGP_WORD = re.compile(r"(?i)(^|_)(log_?probs?|logps?|logprobs?)($|_)")


class TokenFacet(Facet):
    """Where the per-token values (log-probs, ratios, per-token losses, value predictions) inside an expression sit
    on the time axis: a set of (alignment, computed in view?) pairs. Log-probs gathered here are placed from their
    labels (or their logits, one step on); value-head predictions of a model call sliced like logits pair with the
    next token like log-probs; log-probs read from a batch follow the catalog's convention ([B, T-1] at ids[:, 1:])."""

    unknown = EMPTY

    def __init__(self, a: "Analysis"):
        self.a = a

    def join(self, values):
        out: set = set()
        for v in values:
            out |= v
        return frozenset(out)

    def _seq(self) -> Trace:
        return alignment(self.a, "seq")

    def _logits(self) -> Trace:
        return alignment(self.a, "logits")

    def _assumed(self, expr, name, frame) -> frozenset:
        """A log-prob tensor read from elsewhere: by the catalog's convention [B, T-1], aligned to ids[:, 1:]."""
        bare = name.rsplit(".", 1)[-1] if name else ""
        if bare and (any(self.a.names.is_role(bare, r) for r in ("logp", "old_logp", "ref_logp"))
                     or LOGP_WORD.search(bare)) and "logit" not in bare:
            root = self._seq().facet.root(expr, name, frame)
            return frozenset({(replace(root, s=ONE, kind=ROOT_TOKEN), False)})
        return EMPTY

    def _skipped(self, name: str | None) -> bool:
        return name is None or any(self.a.names.is_role(name, r) for r in SKIP_ROLES)

    def leaf(self, trace, expr, frame):
        name = _read_name(expr)
        return EMPTY if self._skipped(name) else self._assumed(expr, name, frame)

    def param(self, trace, d, expr, frame):
        return EMPTY if self._skipped(d.key) else self._assumed(expr, d.key, frame)

    def item(self, trace, container, entry):
        if self._skipped(entry):
            return EMPTY
        if any(self.a.names.is_role(entry, r) for r in ("logp", "old_logp", "ref_logp")) and "logit" not in entry:
            return frozenset({(Align(ONE, ZERO, f"<item>{entry}", ROOT_TOKEN, name=entry), False)})
        return EMPTY

    def defined(self, trace, d, value):
        bare = d.key.rsplit(".", 1)[-1]
        if self._skipped(bare):
            return EMPTY
        if not value and d.kind == "assign" and isinstance(d.value, cst.Call) and self.a.callee(d.value) is None \
                and gather_site(self.a, d.value) is None and d.target is not None:
            # `log_probs = actor(seq, n, attn)`: what a call out of view returns is read like a batch field, by the
            # convention (log-probs at ids[:, 1:])
            return self._assumed(d.target, d.key, None)
        return value

    def element(self, trace, whole, position):
        return EMPTY

    def node(self, trace, expr, frame):
        a = self.a
        if isinstance(expr, (cst.Name, cst.Attribute, cst.Subscript)) and key_of(expr) is not None:
            if frame is not None and isinstance(expr, cst.Name) and frame.binding(expr.value) is not None and all(
                    d.kind == "param" for d in a.flow.reaching(expr.value, expr)):
                return None  # a helper's parameter: what the caller passed decides, not the parameter's name
            name = _read_name(expr)
            if self._skipped(name.rsplit(".", 1)[-1] if name else None):
                return EMPTY
            if name and VALUE_NAME.fullmatch(name.rsplit(".", 1)[-1]):
                return self._values(expr, frame)
            return None  # the shared walk
        if isinstance(expr, cst.Subscript):
            kind, el = time_element(expr, "seq")
            if kind == "index":
                return EMPTY
            inner = trace.value(expr.value, frame)
            if kind == "none":
                return inner
            out = set()
            for al, computed in inner:
                moved = apply_slice(al, el, a)
                if moved is not None:
                    out.add((moved, computed))
            return frozenset(out)
        if isinstance(expr, cst.BinaryOperation):
            return trace.value(expr.left, frame) | trace.value(expr.right, frame)
        if isinstance(expr, cst.UnaryOperation):
            return trace.value(expr.expression, frame)
        if isinstance(expr, cst.Call):
            return self._call(trace, expr, frame)
        return EMPTY

    def _values(self, expr, frame) -> frozenset:
        """A value-head prediction: computed by a model call in view and sliced like logits, it pairs with the next
        token (one step on, like log-probs); read from elsewhere its layout is not known."""
        logits = self._logits().value(expr, frame)
        if logits is not None and logits.model and logits.moved:
            return frozenset({(logits.shift(ONE, ONE), VALUE_HEAD)})
        return EMPTY

    def _scalar_head(self, expr, frame) -> frozenset:
        """C8, value heads: a model call's output sliced on time like logits and squeezed to one number per
        position (``vhead(seq).logits[:, -R - 1:-1].squeeze(-1)``) is a per-token prediction, paired with the next
        token like log-probs (the catalog's convention); whatever its name."""
        head = self._logits().value(expr, frame)
        if head is not None and head.model and head.moved:
            return frozenset({(head.shift(ONE, ONE), VALUE_HEAD)})
        return EMPTY

    def _call(self, trace, call, frame) -> frozenset:
        a = self.a
        site = gather_site(a, call)
        if site is not None:
            labels = self._seq().value(site.labels, frame)
            if labels is not None and labels.kind == ROOT_IDS:
                return frozenset({(labels, True)})
            logits = self._logits().value(site.logits, frame)
            if logits is not None and (logits.model or logits.moved):
                return frozenset({(logits.shift(ONE, ONE), True)})
            return EMPTY
        qname = a.call_name(call)
        method = a.method(call)
        if qname == "torch.nn.functional.pad" and call.args:
            pad = S.argument(call, 1, "pad")
            inner = trace.value(call.args[0].value, frame)
            if isinstance(pad, (cst.Tuple, cst.List)) and len(pad.elements) >= 2:
                left, right = lin(pad.elements[0].value, a), lin(pad.elements[1].value, a)
                if left is not None and right is not None:
                    return frozenset((al.shift(-left, right), c) for al, c in inner)
            return EMPTY
        if qname == "torch.roll" or method == "roll":
            return EMPTY
        if qname in ELEMENTWISE_FUNCTIONS:
            return self.join([trace.value(arg.value, frame) for arg in call.args])
        if a.callee(call) is not None:
            return None  # walked into
        if method is not None:
            if method in ELEMENTWISE_METHODS:
                if method == "squeeze" and call.args and S.int_value(call.args[0].value) != -1:
                    return EMPTY
                inner = trace.value(S.receiver(call), frame)
                if not inner and method == "squeeze":
                    return self._scalar_head(S.receiver(call), frame)
                return inner
            return EMPTY
        return EMPTY


# The "computed in view" mark of a value head's predictions (truthy like True): placed by the catalog's convention,
# one step on like log-probs, which not every framework follows (verl's critic reads values at the state positions).
VALUE_HEAD = "value_head"


def token_values(a: "Analysis") -> Trace:
    return a.facet("alignment:tokens", lambda an: Trace(an, TokenFacet(an), budget=60000))


# ----- framework conventions: response columns (C8) -------------------------------------------------------------
# ----- the Hugging Face label convention ----------------------------------------------------------------------
IGNORE_INDEX = -100  # the label a Hugging Face loss skips (`CrossEntropyLoss`'s default `ignore_index`)


def _is_ignore_index(a: "Analysis", expr: cst.BaseExpression, depth: int = 2) -> bool:
    """``-100``, or a name whose every binding that reaches it is ``-100`` (a module constant, a parameter's
    default such as ``label_pad_token_id=-100``)."""
    if S.int_value(expr) == IGNORE_INDEX:
        return True
    if depth <= 0 or not isinstance(expr, cst.Name):
        return False
    defs = a.flow.reaching(expr.value, expr)
    return bool(defs) and all(d.kind in ("assign", "param") and d.value is not None and d.element is None
                              and _is_ignore_index(a, d.value, depth - 1) for d in defs)


def skips_ignore_index(a: "Analysis", func: cst.FunctionDef, labels: cst.BaseExpression) -> bool:
    """Whether ``func`` compares the labels it gathers with the ignore index (``labels != -100``,
    ``labels[labels == -100] = 0``, ``labels.ne(label_pad_token_id)``): labels in the Hugging Face convention."""
    names = {n.value for n in names_read(labels)}
    if not names:
        return False
    for node in a.index.descendants(func, cst.Comparison, cst.Call):
        if isinstance(node, cst.Comparison):
            if len(node.comparisons) != 1 or not isinstance(node.comparisons[0].operator, (
                    cst.Equal, cst.NotEqual)):
                continue
            sides = (node.left, node.comparisons[0].comparator)
        elif a.method(node) in ("eq", "ne") and node.args and S.receiver(node) is not None:
            sides = (S.receiver(node), node.args[0].value)
        else:
            continue
        for this, that in (sides, sides[::-1]):
            if isinstance(this, cst.Name) and this.value in names and _is_ignore_index(a, that):
                return True
    return False


def same_record(labels: Align, logits: Align) -> bool:
    """Whether the labels and the sequence a model read are two entries of one record (``batch["labels"]``
    and ``batch["input_ids"]``): what a Hugging Face collator builds at the same positions."""
    if labels.root == logits.root or "." not in labels.root or "." not in logits.root:
        return False
    return labels.root.rsplit(".", 1)[0] == logits.root.rsplit(".", 1)[0]


def _width_of(a: "Analysis", expr: cst.BaseExpression | None, key: str) -> bool:
    """``x.size(1)``, ``x.size(-1)``, ``x.shape[1]``, ``x.shape[-1]`` of the tensor read as ``key``."""
    if isinstance(expr, cst.Call) and a.method(expr) == "size" and len(expr.args) == 1 and _int_is(
            expr.args[0].value, (1, -1)):
        return key_of(S.receiver(expr)) == key
    if isinstance(expr, cst.Subscript) and len(expr.slice) == 1 and isinstance(expr.slice[0].slice, cst.Index) \
            and _int_is(expr.slice[0].slice.value, (1, -1)) and isinstance(expr.value, cst.Attribute) \
            and expr.value.attr.value == "shape":
        return key_of(expr.value.value) == key
    return False


def response_columns(a: "Analysis", labels: cst.BaseExpression, logits: Align, at: cst.CSTNode) -> Align | None:
    """C8, rollout batches (verl and the like): the response tensor is the last ``R`` columns of the sequence the
    model reads, ``R`` its width. When logits of a model call in view are sliced with a bound that is the width of
    the very tensor they are gathered against (``R = responses.size(1)``, ``logits[:, -R - 1:-1]`` against
    ``responses``), that tensor sits at ids positions ``T - R .. T - 1`` of the model's input: the alignment
    returned here. None when no bound of the logits is that width (nothing is assumed)."""
    key = key_of(labels)
    if key is None or not logits.model or not logits.moved:
        return None
    for sym, _ in (*logits.s.terms, *logits.e.terms):
        if sym == T_SYMBOL:
            continue
        width = False
        if re.fullmatch(r"[A-Za-z_]\w*", sym):
            defs = a.flow.reaching(sym, at)
            width = bool(defs) and all(d.kind == "assign" and d.element is None and _width_of(a, d.value, key)
                                       for d in defs)
        else:
            try:
                width = _width_of(a, cst.parse_expression(sym), key)
            except cst.ParserSyntaxError:
                width = False
        if width:
            return replace(logits, s=T - Lin.sym(sym), e=ZERO, kind=ROOT_IDS, model=False, name=key.rsplit(".", 1)[-1])
    return None
