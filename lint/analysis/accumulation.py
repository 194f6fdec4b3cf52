"""Gradient accumulation across calls: accumulation wrappers, where gradients live, and collectives.

Facts about libraries that accumulate gradients over several backward passes, which the code relies on without
spelling them out (a small table of library semantics, C12), and the local shapes that contradict them:

- An accumulation context (``with accelerator.accumulate(model):``) gates the *prepared optimizer's* ``step`` and
  ``zero_grad`` to the synchronising microbatch; a module's own ``model.zero_grad()`` is not gated, so called on
  every microbatch it wipes the gradients the gated step is to apply (:func:`ungated_module_zeroing`).
- Megatron's distributed model chunks keep their gradients in a contiguous buffer (``main_grad``) that
  ``optimizer.zero_grad()`` does not clear; the chunks' ``zero_grad_buffer()`` does (:func:`megatron_schedule`,
  :func:`zeroes_grad_buffers`).
- A collective such as ``dist.all_reduce(t)`` works in place: on a temporary (``all_reduce(mask.sum())``) its
  result is lost (:func:`discarded_collectives`), and a name is summed across ranks only where it is the
  collective's own argument (:func:`reduced_in_place`).
- A loss multiplied by the data-parallel world size undoes the gradient averaging across ranks; that only gives a
  global token mean when the count it is divided by is summed across ranks (:func:`world_size_factor`).

Everything here is structural; a receiver or argument the linter cannot place reports nothing.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import libcst as cst

from rlguard.lint.analysis import semantics as S
from rlguard.lint.analysis.index import dotted_name, key_of

if TYPE_CHECKING:
    from rlguard.lint.analysis import Analysis

ACCUMULATE_METHODS = frozenset({"accumulate"})
COLLECTIVES = frozenset({"all_reduce", "all_reduce_", "reduce"})
WORLD_SIZE = re.compile(r"(?i)(\w*_)?(world_size|dp_size|data_parallel_size|dp_world_size|num_ranks|n_ranks|"
                        r"num_replicas|num_processes)")
WORLD_SIZE_CALLS = frozenset({"get_world_size", "get_data_parallel_world_size"})
MEGATRON_SCHEDULE = frozenset({"get_forward_backward_func"})
GRAD_BUFFER_ZEROING = frozenset({"zero_grad_buffer"})


def accumulation_contexts(a: "Analysis") -> list[tuple[cst.With, cst.Call]]:
    """``with <x>.accumulate(model, ...):`` blocks of the module, with the ``accumulate`` call."""
    found = []
    for with_node in a.nodes(cst.With):
        for item in with_node.items:
            call = item.item
            if isinstance(call, cst.Call) and a.method(call) in ACCUMULATE_METHODS and call.args:
                found.append((with_node, call))
                break
    return found


def ungated_module_zeroing(a: "Analysis") -> list[tuple[cst.Call, cst.Call]]:
    """``model.zero_grad()`` run on every iteration of a loop that accumulates through an accumulation context:
    a zeroing of the wrapped module itself (the context's argument, or a value whose root is the same object)
    that no ``if`` between it and the loop gates. Pairs (zeroing call, ``accumulate`` call)."""
    from rlguard.lint.analysis.loops import training

    train = training(a)
    found = []
    for with_node, acc in accumulation_contexts(a):
        loops = a.enclosing_loops(with_node)
        if not loops:
            continue
        loop = loops[0]
        wrapped = set()
        for arg in acc.args:
            if arg.keyword is None or arg.keyword.value in ("model", "models"):
                wrapped |= set(train.roots(arg.value))
        if not wrapped:
            continue
        for call in a.index.descendants(loop, cst.Call):
            if S.method_name(call) not in S.ZERO_GRAD_METHODS:
                continue
            recv = S.receiver(call)
            if recv is None or train.is_optimizer(recv):
                continue
            if not (set(train.roots(recv)) & wrapped):
                continue
            if a.enclosing_loops(call)[:1] != [loop] or _conditional_between(a, call, loop):
                continue
            found.append((call, acc))
    return found


def _conditional_between(a: "Analysis", node: cst.CSTNode, outer: cst.CSTNode) -> bool:
    for anc in a.ancestors(node):
        if anc is outer:
            return False
        if isinstance(anc, (cst.If, cst.IfExp, cst.Try)):
            return True
    return False


# ----- Megatron gradient buffers ------------------------------------------------------------------------------
def megatron_schedule(a: "Analysis", func: cst.FunctionDef) -> bool:
    """Whether ``func`` runs Megatron's pipeline schedule (the function ``get_forward_backward_func()`` returns)."""
    for call in a.index.descendants(func, cst.Call):
        if S.called_name(call) in MEGATRON_SCHEDULE and "megatron" in (a.call_name(call) or ""):
            return True
    return False


# megatron.core's builders of the data-parallel wrapper (the owner of the gradient buffers) and of the optimizer
# over the wrapped chunks
MEGATRON_DDP = frozenset({"DistributedDataParallel", "DistributedDataParallelConfig", "get_megatron_optimizer"})


def configures_megatron_ddp(a: "Analysis") -> bool:
    """Whether the module itself builds Megatron's data-parallel wrapper or the optimizer over its chunks (a name
    imported from ``megatron.core``: ``DistributedDataParallel``, its config, ``get_megatron_optimizer``). A
    module that only runs the schedule on models and optimizers set up elsewhere may leave the buffers to the
    code that owns them (freed and rebuilt, or zeroed, in another file)."""
    for target in a.index.imports.values():
        if target.startswith("megatron.core") and target.rsplit(".", 1)[-1] in MEGATRON_DDP:
            return True
    return False


def zeroes_grad_buffers(a: "Analysis") -> bool:
    """Whether the module zeroes a model chunk's gradient buffer anywhere (``chunk.zero_grad_buffer()``), or
    hands that to a call it cannot see into under that name."""
    for call in a.nodes(cst.Call):
        if S.called_name(call) in GRAD_BUFFER_ZEROING:
            return True
    for attr in a.nodes(cst.Attribute):
        if attr.attr.value in GRAD_BUFFER_ZEROING:
            return True  # passed as a callable, `getattr`-ed, or configured
    return False


# ----- collectives ------------------------------------------------------------------------------------------
def is_collective(a: "Analysis", call: cst.Call) -> bool:
    name = S.called_name(call)
    if name not in COLLECTIVES or not call.args:
        return False
    dotted = a.call_name(call) or dotted_name(call.func) or ""
    return "dist" in dotted or "distributed" in dotted or isinstance(call.func, cst.Name) and name != "reduce"


def discarded_collectives(a: "Analysis") -> list[cst.Call]:
    """In-place collectives on a temporary whose result is dropped: ``dist.all_reduce(mask.sum())`` as a
    statement. The sum across ranks is computed and thrown away."""
    found = []
    for stmt in a.nodes(cst.Expr):
        call = stmt.value
        if not isinstance(call, cst.Call) or not is_collective(a, call):
            continue
        tensor = call.args[0]
        if tensor.keyword is not None and tensor.keyword.value != "tensor":
            continue
        if isinstance(tensor.value, (cst.Call, cst.BinaryOperation)):
            found.append(call)
    return found


REDUCING_CALL = re.compile(r"(?i)\w*(reduce|gather|sync|allreduce|all_sum|global_sum)\w*")


def reduced_in_place(a: "Analysis", key: str, scope: cst.CSTNode) -> bool:
    """Whether a collective inside ``scope`` (``dist.all_reduce``, or any call named like a reduction or a
    gather, which may reduce in place) takes ``key`` itself (a name or attribute path) as an argument."""
    for call in a.index.descendants(scope, cst.Call):
        name = S.called_name(call) or ""
        if (name in COLLECTIVES or REDUCING_CALL.fullmatch(name)) and \
                any(key_of(arg.value) == key for arg in call.args):
            return True
    return False


def through_collective(a: "Analysis", expr: cst.BaseExpression, depth: int = 4) -> bool:
    """Whether ``expr`` is, or is computed (through the reaching assignments of its names) from, the result of
    a call named like a reduction or gather across ranks (``gather_from_all(mask)``, ``accelerator.reduce(n)``):
    then it already covers every rank."""
    from rlguard.lint.analysis.index import children

    stack: list[tuple[cst.CSTNode, int]] = [(expr, depth)]
    seen: set[int] = set()
    while stack:
        node, d = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, cst.Call):
            name = S.called_name(node) or ""
            if name in COLLECTIVES or REDUCING_CALL.fullmatch(name):
                return True
        if isinstance(node, (cst.Name, cst.Attribute, cst.Subscript)) and d > 0:
            key = key_of(node)
            if key is not None:
                for defn in a.flow.reaching(key, node):
                    if defn.value is not None:
                        stack.append((defn.value, d - 1))
        if isinstance(node, cst.Attribute):
            stack.append((node.value, d))
        elif not isinstance(node, cst.Name):
            stack.extend((child, d) for child in children(node))
    return False


def world_size_factor(a: "Analysis", expr: cst.BaseExpression) -> cst.BaseExpression | None:
    """The factor of a product that is the data-parallel world size (``self.world_size``,
    ``dist.get_world_size()``), else None."""
    if isinstance(expr, cst.Call):
        if S.called_name(expr) in WORLD_SIZE_CALLS:
            return expr
        return None
    key = key_of(expr)
    name = key.rsplit(".", 1)[-1] if key else None
    if name is not None and WORLD_SIZE.fullmatch(name):
        return expr
    return None
