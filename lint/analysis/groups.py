"""Batch layouts and group windows (capability C7): facts about how samples of one prompt sit in a batch.

- :func:`layout_in_scope`: the layout a function shows for a group size: *interleaved* (``x.repeat(G, 1)``,
  ``torch.tile``, ``[p] * G`` / ``list * G``, ``cat([x] * G)``, a DataProto-style ``repeat(..., interleave=False)``)
  or *contiguous* (``repeat_interleave(G)``, ``[p for p in xs for _ in range(G)]``, ``repeat(...,
  interleave=True)``). Unknown (None) when it shows neither, or both: "unknown" is the bottom of the lattice and
  a rule reports only two known facts that contradict.
- :func:`double_strided`: a loop index that already steps by a window width (``range(0, n, G)``) and is then
  scaled by the same width again (``x[i * G:(i + 1) * G]``): windows start at ``i * G * G``, most are skipped.
- :func:`batch_axis_source`: a reduction over axis 0 of a function's own parameter (``rewards.mean(dim=0)``),
  which for a flat per-sample tensor is the whole batch.
- :func:`is_group_size`: a group size (samples per prompt), by the name it or what it is bound to has;
  :func:`grouped_later`: a binding whose value is later viewed as groups (``r.view(-1, G)``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import libcst as cst

from rlguard.lint.analysis import semantics as S
from rlguard.lint.analysis.index import Def, key_of

# Names of a group size (samples per prompt). Plain `samples`, `rollouts`, `k` are not: they name lists and indices.
GROUP_NAME = re.compile(
    r"(?i)(num_|n_|k_)?(group_?size|groups?_?len|generations(_per_prompt)?|samples_per_(prompt|group|query)|"
    r"num_samples|n_samples|rollouts?_per_prompt|responses_per_prompt|completions_per_prompt|return_sequences|"
    r"num_return_sequences|rloo_k|repeat_times|n_rollouts|num_rollouts)(_eval|_train)?|rollout_n|(?-i:G)")
# A group structure named (for "is there grouping in view" only, never for which axis is the group's): a group
# count or a group size spelled either way.
GROUP_STRUCTURE = re.compile(r"(?i)(num_|n_)?groups?_?(num|count|size|len)|(num_|n_)groups")
VIEW_METHODS = frozenset({"view", "reshape"})


def is_group_size(ctx, expr, depth: int = 3) -> bool:
    """A group size: named so, or bound (through aliases) to something named so (``G = self.num_generations``:
    the attribute a config sets keeps its name when a file's locals are renamed)."""
    if isinstance(expr, cst.IfExp):
        return is_group_size(ctx, expr.body, depth) and is_group_size(ctx, expr.orelse, depth)
    name = key_of(expr) if isinstance(expr, (cst.Name, cst.Attribute)) else None
    if name is None:
        return False
    if GROUP_NAME.fullmatch(name.rsplit(".", 1)[-1]):
        return True
    if depth > 0:
        defs = ctx.flow.reaching(name, expr)
        return bool(defs) and all(d.kind == "assign" and d.value is not None and is_group_size(ctx, d.value, depth - 1)
                                  for d in defs)
    return False


def view_dims(call: cst.Call) -> list[cst.BaseExpression]:
    """The dims a ``view``/``reshape`` call is given, as separate arguments or as one tuple or list."""
    args = [a.value for a in call.args if a.keyword is None]
    if len(args) == 1 and isinstance(args[0], (cst.Tuple, cst.List)):
        args = [e.value for e in args[0].elements]
    return args


def split_group_size(ctx, call: cst.Call) -> cst.BaseExpression | None:
    """``k`` of ``x.view(n // k, k)`` (also ``reshape``), where ``n`` is ``x``'s own row count (``x.shape[0]``,
    ``x.size(0)``, ``len(x)``), directly or through a name bound once: the rows cut into consecutive runs of ``k``,
    one run per row of the view, whatever ``k`` is called. None otherwise."""
    if ctx.method(call) not in VIEW_METHODS:
        return None
    recv = S.receiver(call)
    dims = view_dims(call)
    if recv is None or len(dims) != 2:
        return None
    first, second = dims
    for _ in range(3):
        key = key_of(first) if isinstance(first, (cst.Name, cst.Attribute)) else None
        if key is None:
            break
        defs = ctx.flow.reaching(key, first)
        if len(defs) != 1 or defs[0].kind != "assign" or defs[0].element is not None or defs[0].value is None:
            return None
        first = defs[0].value
    if not (isinstance(first, cst.BinaryOperation) and isinstance(first.operator, cst.FloorDivide)):
        return None
    if _text(ctx, first.right) != _text(ctx, second) or not _row_count_of(ctx, first.left, recv):
        return None
    return second


def _row_count_of(ctx, expr, tensor) -> bool:
    """``tensor.shape[0]``, ``tensor.size(0)``, ``len(tensor)`` (the tensor written the same way)."""
    if isinstance(expr, cst.Subscript) and isinstance(expr.value, cst.Attribute) and expr.value.attr.value == "shape" \
            and len(expr.slice) == 1 and S.int_value(getattr(expr.slice[0].slice, "value", None)) == 0:
        return _text(ctx, expr.value.value) == _text(ctx, tensor)
    if isinstance(expr, cst.Call) and ctx.method(expr) == "size" and len(expr.args) == 1 and \
            S.int_value(expr.args[0].value) == 0:
        return _text(ctx, S.receiver(expr)) == _text(ctx, tensor)
    if isinstance(expr, cst.Call) and S.called_name(expr) == "len" and len(expr.args) == 1:
        return _text(ctx, expr.args[0].value) == _text(ctx, tensor)
    return False


def grouped_later(ctx, d: Def) -> bool:
    """Whether the value binding ``d`` gives its name is read, where that binding reaches, as the receiver of a
    view into groups (``rewards.view(-1, G)``, ``reshape(B, G)``, with a group size among the dims): a per-sample
    value compared within its prompt's group (GRPO/RLOO rewards)."""
    if "." in d.key or "[" in d.key:
        return False
    scope = ctx.index.function_scope(d.stmt).node
    for recv in _group_views(ctx, scope).get(d.key, ()):
        if ctx.index.order[id(recv)] > d.order and any(r is d for r in ctx.flow.reaching(recv.value, recv)):
            return True
    return False


def _group_views(ctx, scope) -> dict[str, list[cst.Name]]:
    """Per function (cached): the names read as the receiver of a view into groups, with those reads."""
    cache = ctx.cache.setdefault("group_views", {})
    hit = cache.get(id(scope))
    if hit is not None:
        return hit
    found: dict[str, list[cst.Name]] = {}
    for call in ctx.index.descendants(scope, cst.Call) if scope is not ctx.module else ctx.nodes(cst.Call):
        if ctx.method(call) not in VIEW_METHODS:
            continue
        recv = S.receiver(call)
        if not isinstance(recv, cst.Name):
            continue
        args = view_dims(call)
        if len(args) >= 2 and (any(is_group_size(ctx, a) for a in args) or split_group_size(ctx, call) is not None):
            found.setdefault(recv.value, []).append(recv)
    cache[id(scope)] = found
    return found


INTERLEAVED = "interleaved"
CONTIGUOUS = "contiguous"
# calls that put each prompt's copies next to each other / that tile the whole batch G times
_CONTIGUOUS_FUNCTIONS = frozenset({"torch.repeat_interleave", "numpy.repeat", "np.repeat"})
_TILE_FUNCTIONS = frozenset({"torch.tile", "numpy.tile", "np.tile"})
_NEUTRAL = frozenset({"float", "double", "to", "detach", "clone", "contiguous", "cpu", "cuda"})


def _text(ctx, expr) -> str:
    return ctx.code(expr).replace(" ", "")


def _same(ctx, a, b) -> bool:
    if a is None or b is None:
        return False
    if _text(ctx, a) == _text(ctx, b):
        return True
    x, y = S.int_value(a), S.int_value(b)
    return x is not None and x == y


def _scope_calls(ctx, scope):
    return ctx.index.descendants(scope, cst.Call) if scope is not ctx.module else ctx.nodes(cst.Call)


def layout_of_call(ctx, call: cst.Call, group) -> str | None:
    """The layout one call produces when it replicates by ``group`` (None when it does not, or says nothing)."""
    method = ctx.method(call)
    name = ctx.call_name(call) or ""
    if method == "repeat_interleave" or name in _CONTIGUOUS_FUNCTIONS:
        repeats = S.argument(call, 0 if method == "repeat_interleave" else 1, "repeats")
        if method == "repeat_interleave" and _reduced(ctx, S.receiver(call)):
            return None  # a per-group statistic spread back over its group: not how the batch was built
        return CONTIGUOUS if _same(ctx, repeats, group) else None
    if method == "repeat":
        interleave = S.literal_bool(S.argument(call, None, "interleave"))
        times = S.argument(call, None, "repeat_times")
        if times is not None:  # a batch container's repeat(repeat_times=G, interleave=...)
            if not _same(ctx, times, group):
                return None
            return INTERLEAVED if interleave is False else CONTIGUOUS if interleave is True else None
        positional = [a.value for a in call.args if a.keyword is None and not a.star]
        # tensor.repeat(G, 1[, 1]): the whole batch G times along dim 0
        if positional and _same(ctx, positional[0], group) and all(S.int_value(p) == 1 for p in positional[1:]):
            return INTERLEAVED
        return None
    if method == "tile" or name in _TILE_FUNCTIONS:
        reps = S.argument(call, 0 if method == "tile" else 1, "reps")
        if reps is None:
            reps = S.argument(call, None, "dims")
        if isinstance(reps, (cst.Tuple, cst.List)) and reps.elements:
            first = reps.elements[0].value
            rest = [e.value for e in reps.elements[1:]]
            return INTERLEAVED if _same(ctx, first, group) and all(S.int_value(r) == 1 for r in rest) else None
        return INTERLEAVED if _same(ctx, reps, group) else None
    return None


_REDUCTIONS = frozenset({"mean", "std", "var", "sum", "nanmean", "nansum", "amax", "amin", "max", "min", "norm"})


def _reduced(ctx, expr) -> bool:
    """``expr`` is (or is a name bound once to) a reduction's result."""
    for _ in range(3):
        if isinstance(expr, cst.Call) and ctx.method(expr) in _NEUTRAL:
            expr = S.receiver(expr)
            continue
        if isinstance(expr, cst.Call):
            return ctx.method(expr) in _REDUCTIONS or (ctx.call_name(expr) or "").removeprefix("torch.") in _REDUCTIONS
        key = key_of(expr) if isinstance(expr, (cst.Name, cst.Attribute)) else None
        if key is None:
            return False
        defs = ctx.flow.reaching(key, expr)
        if len(defs) != 1 or defs[0].kind != "assign" or defs[0].value is None:
            return False
        expr = defs[0].value
    return False


def _list_tiling(ctx, op: cst.BinaryOperation, group) -> bool:
    """``[p] * G``, ``prompts * G`` where ``prompts`` is a list literal or ``list(...)``: the list G times."""
    if not isinstance(op.operator, cst.Multiply):
        return False
    for side, other in ((op.left, op.right), (op.right, op.left)):
        if _same(ctx, other, group) and isinstance(side, (cst.List, cst.ListComp)):
            return True
        if _same(ctx, other, group) and isinstance(side, cst.Call) and ctx.call_name(side) == "list":
            return True
    return False


def _comprehension_repeat(ctx, comp: cst.ListComp, group) -> bool:
    """``[p for p in xs for _ in range(G)]``: each element G times in a row."""
    inner = comp.for_in.inner_for_in
    if inner is None or comp.for_in.inner_for_in is None:
        return False
    it = inner.iter
    return isinstance(it, cst.Call) and ctx.call_name(it) == "range" and len(it.args) == 1 and _same(
        ctx, it.args[0].value, group)


def layout_in_scope(ctx, node: cst.CSTNode, group) -> str | None:
    """The batch layout for group size ``group`` that the function holding ``node`` shows, or, when it shows
    none, the one its callers in the module all show (the batch is built there and handed down); else None."""
    scope = ctx.enclosing_function(node) or ctx.module
    own, seen = _scope_layout(ctx, scope, group)
    if own is not None or seen or scope is ctx.module:
        return own
    from rlguard.lint.analysis.grad import call_sites

    kinds = set()
    for site in call_sites(ctx, scope):
        caller = ctx.enclosing_function(site) or ctx.module
        if caller is scope:
            return None
        kind, caller_seen = _scope_layout(ctx, caller, group)
        if caller_seen and kind is None:
            return None  # a caller shows both layouts
        if kind is not None:
            kinds.add(kind)
    return next(iter(kinds)) if len(kinds) == 1 else None


def _scope_layout(ctx, scope, group) -> tuple[str | None, bool]:
    """(the one layout ``scope`` shows or None, whether it shows any)."""
    cache = ctx.cache.setdefault("groups.layout", {})
    key = (id(scope), _text(ctx, group))
    if key in cache:
        return cache[key]
    found = set()
    for call in _scope_calls(ctx, scope):
        kind = layout_of_call(ctx, call, group)
        if kind is not None:
            found.add(kind)
    ops = ctx.index.descendants(scope, cst.BinaryOperation) if scope is not ctx.module else ctx.nodes(
        cst.BinaryOperation)
    if any(_list_tiling(ctx, op, group) for op in ops):
        found.add(INTERLEAVED)
    comps = ctx.index.descendants(scope, cst.ListComp) if scope is not ctx.module else ctx.nodes(cst.ListComp)
    if any(_comprehension_repeat(ctx, c, group) for c in comps):
        found.add(CONTIGUOUS)
    result = (next(iter(found)) if len(found) == 1 else None, bool(found))
    cache[key] = result
    return result


@dataclass(frozen=True)
class StridedWindow:
    loop: cst.For
    index: str
    step: cst.BaseExpression
    scaled: cst.BinaryOperation  # the ``i * step`` that scales the strided index again


def double_strided(ctx, loop: cst.For) -> StridedWindow | None:
    """``for i in range(a, n, W): ... i * W ...``: an index that steps by ``W`` scaled by ``W`` once more, and never
    rebound in the body."""
    it = loop.iter
    if not (isinstance(loop.target, cst.Name) and isinstance(it, cst.Call) and ctx.call_name(it) == "range"):
        return None
    args = [a.value for a in it.args if a.keyword is None and not a.star]
    if len(args) != 3:
        return None
    step = args[2]
    if S.int_value(step) is not None:
        return None  # a literal stride: no visible window width to compare
    index = loop.target.value
    for op in ctx.index.descendants(loop.body, cst.BinaryOperation):
        if not isinstance(op.operator, cst.Multiply):
            continue
        for side, other in ((op.left, op.right), (op.right, op.left)):
            if _is_index(side, index) and _same(ctx, other, step):
                if any(d.stmt is not loop for d in ctx.flow.reaching(index, op)):
                    return None  # rebound inside the loop
                return StridedWindow(loop, index, step, op)
    return None


def _is_index(expr, index: str) -> bool:
    if isinstance(expr, cst.Name):
        return expr.value == index
    # (i + 1) * W: the window's end
    return isinstance(expr, cst.BinaryOperation) and isinstance(expr.operator, cst.Add) and (
        (isinstance(expr.left, cst.Name) and expr.left.value == index and S.int_value(expr.right) is not None))


def _strip_neutral(ctx, expr):
    while isinstance(expr, cst.Call) and ctx.method(expr) in _NEUTRAL:
        expr = S.receiver(expr)
    return expr


def batch_axis_source(ctx, call: cst.Call) -> cst.Name | None:
    """For ``x.mean(dim=0)`` / ``x.std(0)`` / ``torch.mean(x, dim=0)`` whose ``x`` is (through dtype/device-only
    rebinding) a parameter of the enclosing function: that parameter's name, else None."""
    method = ctx.method(call)
    if method is not None:
        source = S.receiver(call)
        dim = S.argument(call, 0, "dim")
        if dim is None:
            dim = S.argument(call, None, "axis")
    else:
        source = S.argument(call, 0, "input")
        dim = S.argument(call, 1, "dim")
        if dim is None:
            dim = S.argument(call, None, "axis")
    if S.int_value(dim) != 0 or source is None:
        return None
    func = ctx.enclosing_function(call)
    if func is None:
        return None
    expr = _strip_neutral(ctx, source)
    for _ in range(4):
        key = key_of(expr) if isinstance(expr, cst.Name) else None
        if key is None:
            return None
        defs = ctx.flow.reaching(key, expr)
        if len(defs) != 1:
            return None
        d = defs[0]
        if d.kind == "param" and d.scope is func:
            return expr
        if d.kind != "assign" or d.value is None or d.element is not None:
            return None
        nxt = _strip_neutral(ctx, d.value)
        if nxt is d.value:
            return None  # a computed value: its shape is not the parameter's
        expr = nxt
    return None


_BUILDERS = frozenset({"torch.tensor", "torch.as_tensor", "torch.stack", "torch.cat", "numpy.array", "numpy.asarray",
                       "np.array", "np.asarray", "torch.Tensor", "torch.FloatTensor"})


def one_group_size(ctx, expr, is_group, depth: int = 5):
    """The group size ``G`` when ``expr`` visibly holds exactly one group: a tensor built from a comprehension or
    list over ``range(G)`` (directly or through names), ``G`` a group size. Then its whole-tensor statistics are the
    group's own. None otherwise."""
    for _ in range(depth):
        expr = _strip_neutral(ctx, expr)
        if isinstance(expr, cst.Call) and (ctx.call_name(expr) or "") in _BUILDERS and expr.args:
            expr = expr.args[0].value
            continue
        if isinstance(expr, (cst.ListComp, cst.GeneratorExp)):
            comp = expr.for_in
            if comp.inner_for_in is not None:
                return None
            it = comp.iter
            if isinstance(it, cst.Call) and ctx.call_name(it) == "range" and len(it.args) == 1 and is_group(
                    it.args[0].value):
                return it.args[0].value
            expr = it
            continue
        key = key_of(expr) if isinstance(expr, cst.Name) else None
        if key is None:
            return None
        defs = ctx.flow.reaching(key, expr)
        if len(defs) != 1 or defs[0].kind != "assign" or defs[0].value is None or defs[0].element is not None:
            return None
        expr = defs[0].value
    return None


__all__ = ["CONTIGUOUS", "GROUP_NAME", "GROUP_STRUCTURE", "INTERLEAVED", "StridedWindow", "VIEW_METHODS",
           "batch_axis_source", "double_strided", "grouped_later", "is_group_size", "layout_in_scope",
           "layout_of_call", "one_group_size", "view_dims"]
