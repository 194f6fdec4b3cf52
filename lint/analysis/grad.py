"""Where autograd is on: ``with`` blocks, decorators, conditional managers, and functions only called without it.

:func:`grad_enabled` answers for a point of the code (optionally inside a helper walked into from a call site):
``False`` under ``torch.no_grad()``/``inference_mode()``/``set_grad_enabled(False)`` or a decorator of them, or in
a function whose every call in the module sits where autograd is off; ``True`` where nothing turns it off;
``None`` when it depends on something the linter cannot resolve (``with torch.no_grad() if flag else
nullcontext():`` with ``flag`` unknown). Facts about the call site flow into the helper: a helper's code runs
without autograd when its call does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import libcst as cst

from rlguard.lint.analysis import semantics as S
from rlguard.lint.analysis.index import dotted_name, key_of

if TYPE_CHECKING:
    from rlguard.lint.analysis import Analysis
    from rlguard.lint.analysis.values import Frame


class GradContext:
    """Per-module cache of the autograd state of statements and functions."""

    def __init__(self, a: "Analysis"):
        self.a = a
        self._stmt: dict[int, bool | None] = {}
        self._func: dict[int, bool | None] = {}
        self.jax_module = _computes_in_jax(a)

    def enabled(self, node: cst.CSTNode, frame: "Frame | None" = None) -> bool | None:
        """Whether autograd is on where ``node`` runs (inside ``frame``'s helper, when given)."""
        if self.jax_module:
            return False
        local = self._local(node, frame)
        if local is not True:
            return local
        if frame is not None and frame.call is not None:
            return self.enabled(frame.call, frame.caller)
        return True

    def _local(self, node: cst.CSTNode, frame: "Frame | None") -> bool | None:
        """The state set by the code between ``node`` and its function's start (and by the function's callers
        in this module when ``frame`` is None)."""
        a = self.a
        state: bool | None = True
        for anc in a.index.ancestors(node):
            if isinstance(anc, cst.With):
                for item in anc.items:
                    if node is item or a.index.contains(item, node):
                        continue  # the manager's own expression runs before it is entered
                    verdict = self.manager(item.item, frame)
                    if verdict is False:
                        return False
                    if verdict is None:
                        state = None
            elif isinstance(anc, (cst.FunctionDef, cst.Lambda)):
                if isinstance(anc, cst.FunctionDef):
                    for dec in anc.decorators:
                        if self.manager(dec.decorator, frame) is False:
                            return False
                    if frame is None or frame.func is not anc:
                        if state is True and self.function_off(anc):
                            return False
                return state
        return state

    def manager(self, expr: cst.BaseExpression, frame: "Frame | None", depth: int = 3) -> bool | None:
        """What entering ``expr`` does to autograd: False (turns it off), True (leaves or turns it on), None
        (cannot tell)."""
        a = self.a
        if isinstance(expr, cst.IfExp):
            cond = self.condition(expr.test, frame)
            if cond is True:
                return self.manager(expr.body, frame, depth)
            if cond is False:
                return self.manager(expr.orelse, frame, depth)
            branches = {self.manager(expr.body, frame, depth), self.manager(expr.orelse, frame, depth)}
            return branches.pop() if len(branches) == 1 else None
        target = expr.func if isinstance(expr, cst.Call) else expr
        name = a.qualified_name(target) if isinstance(target, (cst.Name, cst.Attribute)) else None
        if name in S.GRAD_OFF_CONTEXTS:
            return False
        if name in S.GRAD_ON_CONTEXTS or name in S.NULL_CONTEXTS:
            return True
        if name == S.GRAD_SWITCH and isinstance(expr, cst.Call) and expr.args:
            value = self.condition(expr.args[0].value, frame)
            return value
        if isinstance(expr, (cst.Name, cst.Attribute)) and depth > 0:
            key = key_of(expr)
            defs = a.flow.reaching(key, expr) if key else []
            verdicts = set()
            for d in defs:
                if d.kind == "assign" and d.element is None and d.value is not None:
                    verdicts.add(self.manager(d.value, frame, depth - 1))
                elif d.kind == "param" and frame is not None and d.scope is frame.func:
                    bound = frame.binding(d.key)
                    verdicts.add(self.manager(bound[0], bound[1], depth - 1) if bound and bound[0] != "item" else None)
                else:
                    verdicts.add(None)
            if len(verdicts) == 1:
                return verdicts.pop()
            return None
        return True  # autocast, a lock, a timer...: no effect on autograd

    def condition(self, expr: cst.BaseExpression, frame: "Frame | None", depth: int = 4) -> bool | None:
        """The truth of a condition when it is a literal, a negation of one, or a parameter bound to one."""
        literal = S.literal_bool(expr)
        if literal is not None:
            return literal
        if isinstance(expr, cst.UnaryOperation) and isinstance(expr.operator, cst.Not):
            inner = self.condition(expr.expression, frame, depth)
            return None if inner is None else not inner
        if isinstance(expr, cst.Name) and depth > 0:
            defs = self.a.flow.reaching(expr.value, expr)
            values = set()
            for d in defs:
                if d.kind == "param":
                    bound = frame.binding(d.key) if frame is not None and d.scope is frame.func else None
                    if bound is not None and bound[0] != "item":
                        values.add(self.condition(bound[0], bound[1], depth - 1))
                    else:
                        values.add(None)  # decided by callers the walk did not come from
                elif d.kind == "assign" and d.element is None and d.value is not None:
                    values.add(self.condition(d.value, frame, depth - 1))
                else:
                    values.add(None)
            return values.pop() if len(values) == 1 else None
        return None

    def function_off(self, func: cst.FunctionDef) -> bool:
        """Whether every call of ``func`` in this module sits where autograd is off (a helper only ever called
        under ``torch.no_grad()``); False when it has no call in the module (entry code of unknown callers)."""
        hit = self._func.get(id(func))
        if hit is None:
            self._func[id(func)] = False  # recursion guard
            sites = call_sites(self.a, func)
            hit = bool(sites) and not entry_point(self.a, func) and all(self.enabled(site) is False for site in sites)
            self._func[id(func)] = hit
        return bool(hit)


def entry_point(a: "Analysis", func: cst.FunctionDef) -> bool:
    """A public method of a class that derives from a class of another module (``Trainer.compute_loss``,
    ``nn.Module.forward``): a framework calls it from code out of view, so its in-module calls do not tell how
    it runs."""
    cls = a.enclosing_class(func)
    if cls is None or func.name.value.startswith("_") and not func.name.value.startswith("__"):
        return False
    return any(a.class_named(dotted_name(base.value) or "") is None for base in cls.bases)


def call_sites(a: "Analysis", func: cst.FunctionDef, limit: int = 16) -> list[cst.Call]:
    """The calls in this module that run ``func`` (resolved with :meth:`Analysis.callee`)."""
    cache = a.cache.setdefault("call_sites", {})
    hit = cache.get(id(func))
    if hit is not None:
        return hit
    by_name = a.cache.get("calls_by_name")
    if by_name is None:
        by_name = a.cache["calls_by_name"] = {}
        for call in a.nodes(cst.Call):
            f = call.func
            kind = type(f)
            last = f.value if kind is cst.Name else (f.attr.value if kind is cst.Attribute else None)
            by_name.setdefault(last, []).append(call)
    name = func.name.value
    candidates = list(by_name.get(name, ()))
    if name in ("forward", "__call__"):
        # `obj(...)` / `self.head(...)` for an instance of the class: calls of names bound to its construction
        cls = a.enclosing_class(func)
        if cls is not None:
            instances = _instance_names(a, cls)
            candidates += [c for last, calls in by_name.items() if last in instances for c in calls]
    sites = []
    for call in candidates:
        if a.callee(call) is func:
            sites.append(call)
            if len(sites) >= limit:
                break
    cache[id(func)] = sites
    return sites


def _instance_names(a: "Analysis", cls: cst.ClassDef) -> set[str]:
    """Last names of the variables and attributes the module binds to ``cls(...)``."""
    found = set()
    for stmt in a.nodes(cst.Assign):
        value = stmt.value
        if type(value) is cst.Call and type(value.func) is cst.Name and value.func.value == cls.name.value:
            for target in stmt.targets:
                key = key_of(target.target)
                if key:
                    found.add(key.rsplit(".", 1)[-1])
    return found


# torch imports that bring no tensor math with them: a JAX script's TensorBoard writer, its data loader
_TORCH_WITHOUT_AUTOGRAD = ("torch.utils.tensorboard", "torch.utils.data")


def _computes_in_jax(a: "Analysis") -> bool:
    """A module that computes in JAX (it imports ``jax`` or ``flax``) and imports torch, if at all, only for a
    writer or a loader: its arrays are JAX's, and no torch autograd graph is built in it (JAX differentiates
    explicitly, ``jax.grad(loss_fn)(params)``), so nothing in it runs with autograd on."""
    imported = list(a.index.imports.values())
    if not any(q == "jax" or q.startswith(("jax.", "flax")) for q in imported):
        return False
    return not any((q == "torch" or q.startswith("torch.")) and not q.startswith(_TORCH_WITHOUT_AUTOGRAD)
                   for q in imported)


def grad_context(a: "Analysis") -> GradContext:
    return a.facet("grad", GradContext)


__all__ = ["GradContext", "call_sites", "dotted_name", "grad_context"]
