"""Row order: which rows of a batch a tensor holds, and in which order (the filters and permutations applied).

A facet over the shared value walk. Its value, :class:`Rows`, names the *space* of a tensor's rows (the batch
they describe: the parameters of one function, the entries of one container, the elements of one tuple
unpacking) and the row operations applied to it since: a selection by an index (``x[idx]``, with what the index
itself is made of) or a chunking (``x.chunk(n)`` iterated). Index values are rows too: a parameter ``rows``, a
fresh permutation (``torch.randperm(n)``, ``lengths.argsort()``, the indices of ``sort``/``topk``), a boolean
keep mask or the ``nonzero()`` of one (a filter), ``rows[order]`` (a reordering of ``rows``), ``order.argsort()``
(the inverse of ``order``: applying both restores the order). Operations that keep each row where it is keep the
value (casts, elementwise arithmetic, reductions over other dims, slices of other dims, model forwards of the
ids, log-prob helpers); flattening rows into tokens (``reshape(-1, ...)``) and a contiguous slice of rows
(``x[s : s + n]``) are row operations recorded like selections, so fields flattened or sliced alike stay in step;
one field under two names on two paths joins into one. Each fresh filter or permutation remembers the rows it was
computed from. Anything else is *unknown* and stops the walk.

:func:`out_of_step` reads the places where tensors meet (the arguments of one call, the operands of one
arithmetic operation, the values of one dict literal) and reports two tensors of one space whose rows are not in
step:

- ``reordered``: both selected by index values made from the same rows, one through a reordering the other lacks
  (``ids[part]`` with ``adv[unsorted]``, ``part`` a chunk of ``rows[lengths.argsort()]``, ``unsorted`` the chunk
  of ``rows`` at the same place);
- ``left behind``: one re-indexed by a filter or permutation built in view (``ids = ids[order]``,
  ``rewards = rewards[keep]``) and the other not, where the other is a row field of the same batch by its place
  (an entry of the same container, an element of the same unpacking) or, for two parameters of one function, by
  its name (old/reference log-probs, advantages, rewards, returns, masks, token ids), or because the selection was
  computed from its rows; both may share every other row operation (``hidden[order][s:e]`` beside ``labels[s:e]``).
  A run of consecutive ``name = value`` statements that takes a shuffled minibatch field by field is a meeting
  too: one whole tensor among fields taken by one fresh index is left behind;
- ``unapplied``: a row index built and never read, where the same expression bound to the same name re-indexes a
  field elsewhere in the function: the field it was built for stays in the old order.

Index values that are the same value (``idx = order``, one dict comprehension ``{k: v[idx] ...}``, the same
argsort written twice) are one selection.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import libcst as cst

from rlguard.lint.analysis import semantics as S
from rlguard.lint.analysis.index import Def, key_base, key_entry, key_of
from rlguard.lint.analysis.provenance import models
from rlguard.lint.analysis.values import Facet, Trace

if TYPE_CHECKING:
    from rlguard.lint.analysis import Analysis

FRESH = ("perm:", "inv:", "filter:", "topk:")
# Roles of per-row fields of a batch (names of parameters that describe the same episodes).
ROW_ROLES = ("old_logp", "ref_logp", "logp", "advantages", "returns", "rewards", "mask", "ids")
_KEEP_METHODS = frozenset({"float", "double", "half", "bfloat16", "long", "int", "bool", "to", "type_as", "detach",
                           "clone", "contiguous", "cpu", "cuda", "exp", "log", "sigmoid", "tanh", "abs", "neg",
                           "sqrt", "square", "clamp", "clip", "clamp_min", "clamp_max", "masked_fill", "nan_to_num",
                           "requires_grad_", "softmax", "log_softmax", "pow", "relu", "exp_", "log1p", "expm1",
                           "logical_not", "sign", "reciprocal", "rsqrt", "pin_memory"})
_DIM_METHODS = frozenset({"sum", "mean", "max", "min", "amax", "amin", "logsumexp", "std", "var", "nansum",
                          "nanmean", "any", "all", "prod", "norm", "cumsum", "argmax", "argmin", "count_nonzero"})
_TORCH_KEEP = frozenset({"torch.exp", "torch.log", "torch.sigmoid", "torch.tanh", "torch.abs", "torch.clamp",
                         "torch.clip", "torch.softmax", "torch.log_softmax", "torch.nn.functional.softmax",
                         "torch.nn.functional.log_softmax", "torch.sqrt", "torch.square", "torch.nan_to_num",
                         "torch.logical_not", "torch.log1p", "torch.expm1", "torch.nn.functional.logsigmoid",
                         "torch.nn.functional.relu"})
_SCALAR_CALLS = frozenset({"len", "int", "float", "bool", "str", "range", "max", "min", "sum", "round", "abs"})
_DATA_ATTRS = frozenset({"shape", "dtype", "device", "ndim", "is_cuda", "requires_grad", "grad"})


@dataclass(frozen=True)
class Rows:
    """A tensor's rows: ``space`` (the batch they belong to), ``field`` (its name in that batch, for messages and for
    telling index values apart), ``ops`` (the selections and chunkings applied, in order). ``derived``: the value
    was computed (a record's entry read off it is the same rows, not a new field)."""

    space: str
    field: str | None
    ops: tuple = ()
    derived: bool = False


SCALAR = Rows("<scalar>", None)
NONE = Rows("<none>", None)
# A value whose rows are not known but that no tensor of the batch flows into (a config field, a global, a
# function of those): left out when tensors are combined, never reported.
MAYBE = Rows("<maybe>", None)


@dataclass(frozen=True)
class Chunks:
    rows: Rows
    n: str


@dataclass(frozen=True)
class Parts:
    """A fixed tuple of values: ``zip(a, b)``, ``torch.where(cond)``, ``x.sort()`` (values, indices)."""

    parts: tuple


def _is_rows(v) -> bool:
    return isinstance(v, Rows) and v.space not in ("<scalar>", "<none>", "<maybe>")


def _fresh(v: Rows) -> bool:
    return v.space.startswith(FRESH)


class RowFacet(Facet):
    unknown = None

    def __init__(self, a: "Analysis"):
        self.a = a
        self.models = models(a)
        # the rows a fresh filter or permutation was computed from (`order = (labels != -100).argsort()`: labels'
        # rows), by its space: those rows are the batch the selection is meant for
        self.sources: dict[str, set[tuple]] = {}

    def _made_from(self, space: str, source) -> None:
        if _is_rows(source):
            self.sources.setdefault(space, set()).add((source.space, source.field))

    # ----- lattice ----------------------------------------------------------------------------------------------
    def join(self, values):
        kept = [v for v in values if v != NONE]
        if not kept:
            return NONE if values else None
        first = kept[0]
        if all(v == first for v in kept):
            return first
        # the same rows of one batch under different names on two paths (`labels = shift_labels.reshape(-1)` or
        # `labels = labels[..., 1:].reshape(-1)`): one field whose name is either
        if all(_is_rows(v) for v in kept) and all(v.space == first.space and v.ops == first.ops and
                                                  v.derived == first.derived for v in kept):
            fields = sorted({f for v in kept for f in (v.field or "").split("|") if f})
            return replace(first, field="|".join(fields) or None)
        return None

    def combine(self, values) -> Rows | None:
        """The rows of an elementwise combination: the common rows, ignoring numbers and full reductions."""
        rows = []
        maybe = False
        for v in values:
            if v is None or isinstance(v, (Chunks, Parts)):
                return None
            if _is_rows(v):
                rows.append(v)
            maybe = maybe or v == MAYBE
        if not rows:
            return MAYBE if maybe else SCALAR
        first = rows[0]
        if any(r.space != first.space or r.ops != first.ops for r in rows[1:]):
            return None
        return replace(first, derived=True)

    # ----- leaves -----------------------------------------------------------------------------------------------
    def leaf(self, trace, expr, frame):
        return MAYBE

    def param(self, trace, d: Def, expr, frame):
        if d.key in ("self", "cls"):
            return None
        return Rows(f"params@{id(d.scope)}", d.key)

    def item(self, trace, container, entry):
        if not _is_rows(container):
            return None
        if entry in _DATA_ATTRS:
            return SCALAR
        if container.derived:
            return container
        return Rows(f"{container.space}/{container.field}", entry, container.ops)

    def element(self, trace, whole, position):
        if isinstance(whole, Parts):
            return whole.parts[position] if position < len(whole.parts) else None
        if _is_rows(whole) and not whole.derived:
            return Rows(f"{whole.space}/{whole.field}", str(position), whole.ops)
        return None

    def iterate(self, trace, iterable, d):
        if isinstance(iterable, Parts):
            if d.element is None or d.element >= len(iterable.parts):
                return None
            iterable = iterable.parts[d.element]
        elif d.element is not None:
            return None
        if isinstance(iterable, Chunks):
            return replace(iterable.rows, ops=iterable.rows.ops + (("chunk", iterable.n),), derived=True)
        return None

    def helper(self, trace, call, returns, frame):
        return self.join(returns) if returns else None

    # ----- operations -------------------------------------------------------------------------------------------
    def node(self, trace, expr, frame):
        a = self.a
        if isinstance(expr, cst.Name):
            if expr.value == "None":
                return NONE
            if expr.value in ("True", "False"):
                return SCALAR
            return None
        if isinstance(expr, (cst.Integer, cst.Float, cst.SimpleString, cst.ConcatenatedString, cst.FormattedString)):
            return SCALAR
        key = key_of(expr) if isinstance(expr, (cst.Attribute, cst.Subscript)) else None
        if key is not None:
            if key_base(key) in ("self", "cls"):
                return MAYBE  # an attribute of the object: not one of the batch's tensors as far as the walk sees
            if isinstance(expr, cst.Attribute) and expr.attr.value in _DATA_ATTRS:
                return SCALAR
            found = trace.named(expr, frame)
            if found is None and isinstance(expr, cst.Subscript) and key_entry(key) is not None:
                found = self.item(trace, trace.value(expr.value, frame), key_entry(key))
            elif found is None or (isinstance(expr, cst.Attribute) and _is_rows(found) and not found.derived):
                found = MAYBE  # `cfg.temperature`, `batch.n`: an attribute read off a parameter or a global
            return found
        if isinstance(expr, cst.Attribute):
            inner = trace.value(expr.value, frame)
            attr = expr.attr.value
            if isinstance(inner, Parts) and attr in ("values", "indices") and len(inner.parts) == 2:
                return inner.parts[0 if attr == "values" else 1]
            if attr in _DATA_ATTRS:
                return SCALAR
            return inner if _is_rows(inner) and inner.derived else None
        if isinstance(expr, cst.Subscript):
            return self._subscript(trace, expr, frame)
        if isinstance(expr, cst.Call):
            if a.callee(expr) is not None:
                return None  # a helper of this module: walked into
            return self._call(trace, expr, frame)
        if isinstance(expr, cst.BinaryOperation):
            return self.combine([trace.value(expr.left, frame), trace.value(expr.right, frame)])
        if isinstance(expr, cst.UnaryOperation):
            inner = trace.value(expr.expression, frame)
            return replace(inner, derived=True) if _is_rows(inner) else inner if inner in (SCALAR,) else None
        if isinstance(expr, cst.Comparison):
            return self.combine([trace.value(expr.left, frame)] + [trace.value(c.comparator, frame)
                                                                    for c in expr.comparisons])
        return None

    def _subscript(self, trace, expr: cst.Subscript, frame):
        value = trace.value(expr.value, frame)
        first = expr.slice[0].slice
        if isinstance(value, Parts):
            position = S.int_value(first.value) if isinstance(first, cst.Index) else None
            return value.parts[position] if position is not None and 0 <= position < len(value.parts) else None
        if not _is_rows(value):
            return None
        if isinstance(first, cst.Slice):
            full = first.lower is None and first.upper is None and first.step is None
            if full:
                return replace(value, derived=True)
            if first.step is not None or any(not _plain_axis(el.slice) for el in expr.slice[1:]):
                return None
            # a contiguous run of rows (`x[start : start + n]`): the same bounds take the same rows of every field
            return Rows(value.space, value.field, value.ops + (("slice", self.a.code(first)),), True)
        inner = first.value
        if any(not _plain_axis(el.slice) for el in expr.slice[1:]):
            return None  # `x[rows, cols]`: elements gathered by several index tensors, not rows
        if isinstance(inner, cst.Ellipsis):
            return replace(value, derived=True)
        if isinstance(inner, (cst.Integer, cst.UnaryOperation)) or (isinstance(inner, cst.Name) and inner.value == "None"):
            return None
        sel = self.selection(trace, inner, frame)
        if sel is None:
            return None
        return Rows(value.space, value.field, _compose(value.ops, sel), True)

    def selection(self, trace, index: cst.BaseExpression, frame):
        """The selection an index expression makes: ``("sel", space, field, ops)`` of its own rows, or None."""
        text = _filter_text(self.a, index)
        if text is not None:
            self._made_from("filter:" + text, trace.value(index, frame))
            return ("sel", "filter:" + text, None, ())
        value = trace.value(index, frame)
        if not _is_rows(value):
            return None
        return ("sel", value.space, value.field, value.ops)

    def _call(self, trace, call: cst.Call, frame):
        a = self.a
        name = a.call_name(call) or ""
        method = a.method(call)
        recv = S.receiver(call)
        if name == "zip":
            return Parts(tuple(trace.value(arg.value, frame) for arg in call.args))
        if name in _SCALAR_CALLS or method in ("item", "tolist", "numel", "size", "dim", "nelement"):
            return SCALAR
        if name in ("torch.randperm", "np.random.permutation", "numpy.random.permutation") or (
                method == "permutation" and call.args and S.int_value(call.args[0].value) is None and
                trace.value(call.args[0].value, frame) in (SCALAR, MAYBE)):
            return Rows("perm:" + a.code(call), None, (), True)  # a shuffled order of n rows (`rng.permutation(n)`)
        if method == "argsort" or name == "torch.argsort":
            source = trace.value(recv if method == "argsort" else S.argument(call, 0, "input"), frame)
            if _is_rows(source) and source.space.startswith("perm:") and not source.ops:
                return Rows("inv:" + source.space[5:], None, (), True)  # argsort of a permutation: its inverse
            self._made_from("perm:" + a.code(call), source)
            return Rows("perm:" + a.code(call), None, (), True)
        if method in ("sort", "topk") or name in ("torch.sort", "torch.topk"):
            kind = "perm:" if (method or name.rsplit(".", 1)[-1]) == "sort" else "topk:"
            source = trace.value(recv if method else S.argument(call, 0, "input"), frame)
            perm = Rows(kind + a.code(call), None, (), True)
            self._made_from(perm.space, source)
            values = Rows(source.space, source.field, _compose(source.ops, ("sel", perm.space, None, ())), True) \
                if _is_rows(source) else None
            return Parts((values, perm))
        if method == "nonzero" or name == "torch.nonzero" or (name == "torch.where" and len(call.args) == 1):
            cond = recv if method == "nonzero" else call.args[0].value
            text = _filter_text(a, cond) or a.code(cond)
            if name == "torch.where" or S.literal_bool(S.argument(call, None, "as_tuple")) is True:
                return Parts((Rows("filter:" + text, None, (), True),))
            return Rows("filter:" + text, None, (), True)
        if method in ("chunk", "split", "tensor_split") or name in ("torch.chunk", "torch.split"):
            source = trace.value(recv if method else S.argument(call, 0, "input"), frame)
            n = S.argument(call, 0 if method else 1, "chunks")
            if n is None:
                n = S.argument(call, 0 if method else 1, "split_size_or_sections")
            return Chunks(source, a.code(n)) if _is_rows(source) and n is not None else None
        if method in _KEEP_METHODS and recv is not None:
            return _derived(trace.value(recv, frame))
        if method in _DIM_METHODS and recv is not None:
            dim = S.argument(call, 0, "dim")
            if dim is None:
                dim = S.argument(call, None, "axis")
            if dim is None:
                return SCALAR
            value = S.int_value(dim)
            if value == 0:
                return SCALAR
            return _derived(trace.value(recv, frame)) if value is not None else None
        if method in ("reshape", "view") and recv is not None and call.args and \
                S.int_value(call.args[0].value) == -1:
            # rows (and the dims after them) flattened into one leading dim: every field flattened alike stays in
            # step with the others
            source = trace.value(recv, frame)
            return Rows(source.space, source.field, source.ops + (("flat",),), True) if _is_rows(source) else None
        if method in ("unsqueeze", "squeeze") and recv is not None:
            dim = S.int_value(S.argument(call, 0, "dim"))
            return _derived(trace.value(recv, frame)) if dim is not None and dim != 0 else None
        if method == "gather" and recv is not None:
            dim = S.int_value(S.argument(call, 0, "dim"))
            return _derived(trace.value(recv, frame)) if dim is not None and dim != 0 else None
        if name in _TORCH_KEEP and call.args:
            return _derived(trace.value(call.args[0].value, frame))
        if name in ("torch.where", "torch.maximum", "torch.minimum") and len(call.args) >= 2:
            return self.combine([trace.value(arg.value, frame) for arg in call.args])
        if S.LOGPROB_HELPER.fullmatch(name.rsplit(".", 1)[-1]) and call.args:
            return _derived(trace.value(call.args[0].value, frame))
        # a model forward (or generation) reads rows and answers one row per row
        func = call.func
        target = func.value if isinstance(func, cst.Attribute) and func.attr.value in (
            "forward", "__call__", "generate") else func
        if isinstance(target, (cst.Name, cst.Attribute)) and self.models.model(target) is not None and (
                method in (None, "forward", "__call__", "generate") or target is func):
            ids = S.argument(call, 0, "input_ids")
            return _derived(trace.value(ids, frame)) if ids is not None else None
        # anything else: unknown, unless no tensor of a batch goes in (a function of config values)
        inputs = [trace.value(arg.value, frame) for arg in call.args]
        if recv is not None and method is not None:
            inputs.append(trace.value(recv, frame))
        if all(v in (SCALAR, MAYBE, NONE) for v in inputs):
            return MAYBE
        return None


def _plain_axis(element) -> bool:
    """A subscript element that keeps its axis: a slice (``:``, ``1:``), ``None`` or ``...``."""
    if isinstance(element, cst.Slice):
        return True
    value = element.value if isinstance(element, cst.Index) else None
    return isinstance(value, cst.Ellipsis) or (isinstance(value, cst.Name) and value.value == "None")


def _derived(value):
    if _is_rows(value):
        return replace(value, derived=True)
    return value if value is SCALAR else None


def _compose(ops: tuple, sel: tuple) -> tuple:
    """``ops`` followed by the selection ``sel``; a permutation followed by its inverse cancels."""
    if ops and ops[-1][0] == "sel" and sel[0] == "sel":
        last = ops[-1]
        if last[1].startswith("perm:") and sel[1] == "inv:" + last[1][5:] and not last[3] and not sel[3]:
            return ops[:-1]
    return ops + (sel,)


def _filter_text(a: "Analysis", expr: cst.BaseExpression, depth: int = 4) -> str | None:
    """The text of a boolean keep mask behind ``expr`` (a comparison, ``~m``, ``m & n``, ``isfinite``...,
    through names with one definition and casts), or None."""
    for _ in range(depth):
        while isinstance(expr, cst.Call) and a.method(expr) in ("bool", "to", "cuda", "cpu", "detach") and \
                S.receiver(expr) is not None:
            expr = S.receiver(expr)
        if isinstance(expr, cst.Comparison):
            return a.code(expr)
        if isinstance(expr, cst.UnaryOperation) and isinstance(expr.operator, cst.BitInvert):
            inner = _filter_text(a, expr.expression, depth - 1)
            return f"~({inner})" if inner is not None else None
        if isinstance(expr, cst.BinaryOperation) and isinstance(expr.operator, (cst.BitAnd, cst.BitOr)):
            left, right = _filter_text(a, expr.left, depth - 1), _filter_text(a, expr.right, depth - 1)
            return a.code(expr) if left is not None and right is not None else None
        if isinstance(expr, cst.Call) and ((a.call_name(expr) or "") in (
                "torch.isfinite", "torch.isnan", "torch.logical_and", "torch.logical_or", "torch.logical_not") or
                a.method(expr) in ("isfinite", "isnan", "logical_and", "logical_or", "logical_not", "eq", "ne",
                                   "gt", "lt", "ge", "le")):
            return a.code(expr)
        if isinstance(expr, cst.Name):
            defs = a.flow.reaching(expr.value, expr)
            if len(defs) != 1 or defs[0].kind != "assign" or defs[0].element is not None or defs[0].value is None:
                return None
            expr = defs[0].value
            continue
        return None
    return None


def row_trace(a: "Analysis") -> Trace:
    return a.facet("rows", lambda an: Trace(an, RowFacet(an), budget=40000))


# ----- meetings ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class OutOfStep:
    """Tensors of one batch that meet at ``node`` with rows out of step: ``odd`` (the operands whose rows differ
    from the rest), ``others`` (the rest); ``kind``: ``reordered``, ``left behind`` or ``unapplied``."""

    node: cst.CSTNode
    odd: tuple[cst.BaseExpression, ...]
    others: tuple[cst.BaseExpression, ...]
    kind: str


def _operands(node: cst.CSTNode) -> list[cst.BaseExpression]:
    if isinstance(node, cst.Call):
        return [arg.value for arg in node.args if not arg.star]
    if isinstance(node, cst.BinaryOperation):
        return [node.left, node.right]
    if isinstance(node, cst.Dict):
        return [el.value for el in node.elements if isinstance(el, cst.DictElement)]
    return []


def out_of_step(a: "Analysis") -> list[OutOfStep]:
    def build(an):
        trace = row_trace(an)
        found = []
        selecting: dict[int, int | None] = {}
        found.extend(_assembled(an, trace))
        found.extend(_unapplied(an))
        order = an.index.order
        for node in an.nodes(cst.Call, cst.BinaryOperation, cst.Dict):
            if isinstance(node, cst.Call) and (an.call_name(node) or "") in ("zip", "torch.cat", "torch.stack"):
                continue
            scope = an.index.function_scope(node).node
            if id(scope) not in selecting:
                selecting[id(scope)] = _rows_selected_from(an, scope)
            start = selecting[id(scope)]
            if start is None or order[id(node)] < start:
                continue  # no filter or permutation built here, or not yet: nothing can be out of step
            operands = _operands(node)
            if len(operands) < 2:
                continue
            values = [(expr, trace.value(expr)) for expr in operands]
            by_space: dict[str, list] = {}
            for expr, value in values:
                if _is_rows(value) and not _fresh(value):
                    by_space.setdefault(value.space, []).append((expr, value))
            for members in by_space.values():
                finding = _judge(an, node, members, trace.facet.sources)
                if finding is not None:
                    found.append(finding)
        return found
    return a.facet("rows_out_of_step", build)


def _assembled(a: "Analysis", trace: Trace) -> list[OutOfStep]:
    """Fields of one minibatch taken one after another (a run of consecutive ``name = value`` statements, the
    statement form of a dict literal), at least two of them by the same index built from a filter or permutation
    in view (``mb_adv = adv[mb_inds]``, ``mb_inds`` a slice of a shuffled order), and one other a whole tensor
    (``mb_ret = returns``): that one keeps every row in the old order."""
    found = []
    for body in a.nodes(cst.IndentedBlock, cst.Module):
        run: list[tuple[cst.Assign, cst.BaseExpression]] = []
        for stmt in list(body.body) + [None]:
            assign = _simple_assign(stmt)
            if assign is not None:
                run.append(assign)
                continue
            if len(run) >= 3:
                finding = _judge_run(a, trace, run)
                if finding is not None:
                    found.append(finding)
            run = []
    return found


def _unapplied(a: "Analysis") -> list[OutOfStep]:
    """A row index built and never read, the same expression bound to the same name re-indexing a field elsewhere
    in the function (``revert = torch.tensor(reverse_of(order))`` then ``logp = logp[revert]`` in one block, the
    same ``revert = ...`` built for ``entropy`` in the next and never applied): the field it was built for keeps
    the old order while the other was re-indexed."""
    found = []
    for func in a.nodes(cst.FunctionDef):
        applied: dict[tuple[str, str], tuple] = {}
        for sub in a.index.descendants(func, cst.Subscript):
            if len(sub.slice) != 1 or not isinstance(sub.slice[0].slice, cst.Index) or \
                    not isinstance(sub.slice[0].slice.value, cst.Name) or a.index.function_scope(sub).node is not func:
                continue
            name = sub.slice[0].slice.value
            for d in a.flow.reaching(name.value, name):
                # an index a call builds (`torch.tensor(reverse_of(order))`); a lookup (`node = next_of[node]`,
                # a walk along a linked structure) is no row index
                if d.kind == "assign" and d.element is None and isinstance(d.value, cst.Call):
                    applied.setdefault((d.key, a.code(d.value)), (sub, set()))[1].add(id(d.stmt))
        if not applied:
            continue
        applied_names = {name for name, _ in applied}
        loads = None
        for assign in a.index.descendants(func, cst.Assign):
            if len(assign.targets) != 1 or not isinstance(assign.targets[0].target, cst.Name) or \
                    a.index.function_scope(assign).node is not func:
                continue
            target = assign.targets[0].target
            if target.value not in applied_names or not isinstance(assign.value, cst.Call):
                continue  # only a call bound to a name that indexes rows can rebuild a row index
            hit = applied.get((target.value, a.code(assign.value)))
            stmt = a.index.statement_of(assign)
            if hit is None or id(stmt) in hit[1]:
                continue
            if loads is None:
                targets = {id(t.target) for t in a.index.descendants(func, cst.AssignTarget)}
                loads = [n for n in a.index.descendants(func, cst.Name) if id(n) not in targets]
            if any(n.value == target.value and any(d.stmt is stmt for d in a.flow.reaching(n.value, n))
                   for n in loads):
                continue
            found.append(OutOfStep(target, (target,), (hit[0],), "unapplied"))
    return found


def _simple_assign(stmt) -> tuple | None:
    if not isinstance(stmt, cst.SimpleStatementLine) or len(stmt.body) != 1:
        return None
    assign = stmt.body[0]
    if not isinstance(assign, cst.Assign) or len(assign.targets) != 1 or \
            not isinstance(assign.targets[0].target, cst.Name):
        return None
    return assign, assign.value


def _judge_run(a: "Analysis", trace: Trace, run: list) -> OutOfStep | None:
    by_index: dict[str, list] = {}
    for assign, value in run:
        if isinstance(value, cst.Subscript) and len(value.slice) == 1 and isinstance(value.slice[0].slice,
                                                                                     cst.Index) and \
                isinstance(value.value, cst.Name):
            by_index.setdefault(a.code(value.slice[0].slice.value), []).append(value)
    for text, selected in by_index.items():
        if len(selected) < 2:
            continue
        index = selected[0].slice[0].slice.value
        sel = trace.value(index)
        if not (_is_rows(sel) and sel.space.startswith(("perm:", "filter:"))):
            continue  # an index handed in, or not made of rows: nothing says the run is one shuffled minibatch
        taken = {sub.value.value for sub in selected}
        plain = []
        for assign, value in run:
            if not isinstance(value, cst.Name) or value.value in taken:
                continue
            rows = trace.value(value)
            if rows in (SCALAR, MAYBE, NONE) or isinstance(rows, (Chunks, Parts)) or (_is_rows(rows) and _fresh(rows)):
                continue  # a number, a config value, an index: not a field of the batch
            if _is_rows(rows) and not _row_field(a, rows, {}, ()):
                continue  # a parameter with no per-row role (`eps = clip`): may well be a number
            if _indexed_by(a, value, text):
                continue
            plain.append(value)
        if len(plain) == 1:
            return OutOfStep(plain[0], tuple(plain), tuple(selected), "left behind")
    return None


def _indexed_by(a: "Analysis", name: cst.Name, index_text: str) -> bool:
    """Whether the function takes rows of ``name`` by that index somewhere (the whole tensor then used on purpose)."""
    scope = a.index.function_scope(name).node
    subs = a.index.descendants(scope, cst.Subscript) if not isinstance(scope, cst.Module) else a.nodes(cst.Subscript)
    return any(isinstance(sub.value, cst.Name) and sub.value.value == name.value and len(sub.slice) == 1 and
               isinstance(sub.slice[0].slice, cst.Index) and a.code(sub.slice[0].slice.value) == index_text
               for sub in subs)


_SELECTING = frozenset({"argsort", "sort", "topk", "nonzero", "randperm", "permutation", "where"})


def _rows_selected_from(a: "Analysis", scope: cst.CSTNode) -> int | None:
    """The walk order from which rows of the function (or module) may be out of step, or None when it builds no
    filter or permutation (a call that makes one, or a subscript by a boolean keep mask): its first such construct,
    or the start of the outermost loop around it (a later iteration reads what an earlier one selected). Before
    that, no value carries a selection."""
    calls = a.index.descendants(scope, cst.Call) if not isinstance(scope, cst.Module) else a.nodes(cst.Call)
    first = None
    for call in calls:
        if S.called_name(call) in _SELECTING:
            first = call
            break
    subs = a.index.descendants(scope, cst.Subscript) if not isinstance(scope, cst.Module) else a.nodes(cst.Subscript)
    order = a.index.order
    for sub in subs:
        if first is not None and order[id(sub)] > order[id(first)]:
            break
        index = sub.slice[0].slice if sub.slice else None
        if isinstance(index, cst.Index) and not isinstance(index.value, (cst.SimpleString, cst.Integer)) and \
                _filter_text(a, index.value) is not None:
            first = sub
            break
    if first is None:
        return None
    start = order[id(first)]
    for anc in a.index.ancestors(first):
        if anc is scope:
            break
        if isinstance(anc, (cst.For, cst.While, cst.ListComp, cst.SetComp, cst.DictComp, cst.GeneratorExp)):
            start = order[id(anc)]
    return start


def _judge(a: "Analysis", node: cst.CSTNode, members: list, sources: dict) -> OutOfStep | None:
    selected: dict[tuple, list] = {}
    plain = []
    for expr, value in members:
        if value.ops and not _same_rows(value.ops):
            selected.setdefault(value.ops, []).append(expr)
        elif _row_field(a, value, sources, ()):
            plain.append(expr)
    groups = sorted(selected.items(), key=lambda kv: -len(kv[1]))
    # reordered: two selections of the same rows, one through a reordering the other lacks (the smaller group is
    # the odd one)
    for i, (ops_x, group_x) in enumerate(groups):
        for ops_y, group_y in groups[i + 1:]:
            if _reordered(ops_x, ops_y):
                return OutOfStep(node, tuple(group_y), tuple(group_x), "reordered")
    # left behind: row fields in the old order beside fields selected by a filter or permutation built in view
    if plain and len(groups) == 1 and all(_fresh_selection(op) for op in groups[0][0]):
        return OutOfStep(node, tuple(plain), tuple(groups[0][1]), "left behind")
    # ... or both taken through the same row operations (flattened alike, the same slice of rows), one with a fresh
    # selection more: `hidden[order][s:e]` beside `labels[s:e]`
    values = {id(expr): value for expr, value in members}
    histories: dict[tuple, list] = {}
    for expr, value in members:
        histories.setdefault(value.ops, []).append(expr)
    for ops_x, group_x in histories.items():
        for ops_y, group_y in histories.items():
            step = _one_selection_more(ops_x, ops_y)
            if step is not None and all(_row_field(a, values[id(e)], sources, step) for e in group_y):
                return OutOfStep(node, tuple(group_y), tuple(group_x), "left behind")
    return None


def _same_rows(ops: tuple) -> bool:
    """Ops that keep every row where it is, for the fields of one batch alike: flattening rows into tokens."""
    return all(op == ("flat",) for op in ops)


def _one_selection_more(x: tuple, y: tuple) -> tuple | None:
    """The fresh selection ``x`` applies and ``y`` lacks when ``x`` is ``y`` with exactly that one step inserted
    (the rest of both histories identical), else None."""
    if len(x) != len(y) + 1:
        return None
    for i, op in enumerate(x):
        if _fresh_selection(op) and not op[3] and x[:i] + x[i + 1:] == y:
            return op
    return None


def _fresh_selection(op: tuple) -> bool:
    """A selection by an index built in view as a filter or permutation (not by an index handed in)."""
    return op[0] == "sel" and op[1].startswith(FRESH)


def _reordered(x: tuple, y: tuple) -> bool:
    """Two histories that select, at the same step, by index values made from the same rows, one through a
    reordering (a permutation or topk) the other lacks, and agree otherwise."""
    if len(x) != len(y):
        return False
    diffs = [(p, q) for p, q in zip(x, y) if p != q]
    if len(diffs) != 1:
        return False
    p, q = diffs[0]
    if p[0] != "sel" or q[0] != "sel" or p[1] != q[1] or p[2] != q[2] or p[1].startswith(FRESH):
        return False
    inner_p, inner_q = list(p[3]), list(q[3])
    reorders = lambda ops: [op for op in ops if op[0] == "sel" and op[1].startswith(("perm:", "topk:"))]
    rest = lambda ops: [op for op in ops if op not in reorders(ops)]
    return reorders(inner_p) != reorders(inner_q) and rest(inner_p) == rest(inner_q)


def _row_field(a: "Analysis", value: Rows, sources: dict, selection: tuple) -> bool:
    """Whether an operand left in the old order is a row field of the batch: an entry of a container or an element
    of an unpacking (its place says so), the field whose rows the selection it lacks was computed from
    (``order = (labels != -100).argsort()`` applied to ``hidden`` and not to ``labels``), or a parameter named for
    a per-row field."""
    if not value.space.startswith("params@") or "/" in value.space:
        return True
    if selection and (value.space, value.field) in sources.get(selection[1], ()):
        return True
    return any(a.names.is_role(field, role) for field in (value.field or "").split("|") for role in ROW_ROLES)


__all__ = ["OutOfStep", "Rows", "out_of_step", "row_trace"]
