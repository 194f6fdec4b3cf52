"""Training loops: optimizer steps, backward passes, gradient zeroing, and the loops that hold an update.

- An *optimizer* is an object built by an optimizer class (``torch.optim.AdamW(...)``, ``Lion(...)``) or, as a
  hint, named like one; a DeepSpeed engine (or an optimizer ``deepspeed.initialize`` returns) zeroes its own
  gradients and is left out. Identity follows :mod:`~rlguard.lint.analysis.provenance` roots, so ``opt =
  self.optimizer`` is the same optimizer.
- *Zeroing* is ``opt.zero_grad()`` (for that optimizer), ``model.zero_grad()`` or a reset of ``p.grad`` (for
  every parameter), a same-module helper or another file's function whose code does one of these (mapped
  through its parameters), or a call the linter cannot see into that owns a whole training step
  (``self.model.training_step(batch)``): its effect is unknown, and unknown reports nothing.
- An *update loop* holds an optimizer step or a backward pass in its body, directly or through a helper of the
  module; an *epoch/minibatch loop* is one whose header iterates PPO epochs, minibatches or microbatches (a hint
  from its names, or a ``.split``/``.chunk`` of the batch).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import libcst as cst

from rlguard.lint.analysis import semantics as S
from rlguard.lint.analysis.index import dotted_name, key_of, children
from rlguard.lint.analysis.provenance import Tup, objects

if TYPE_CHECKING:
    from rlguard.lint.analysis import Analysis

Loop = cst.For | cst.While

EPOCH_WORD = re.compile(
    r"(?i)(^|_)(epochs?|ppo_epochs?|update_epochs?|n_epochs|num_epochs|inner_epochs?|ppo_iters?|"
    r"mini_?batch(es)?|mini_?bs|mbs?|mb_\w+|minibatch\w*|micro\w*|accum\w*|grad_accum\w*|"
    r"gradient_accumulation\w*|inner_steps?|k_epochs?|opt_epochs?|optim_epochs?|num_iterations|"
    r"chunks?|splits?|batch_sampler)($|_)")
MICRO_WORD = re.compile(
    r"(?i)(^|_)(micro\w*|mbs?|accum\w*|grad_accum\w*|gradient_accumulation\w*|chunks?|splits?|parts?|"
    r"n_micro\w*|num_micro\w*)($|_)")
SPLIT_CALLS = frozenset({"chunk", "split", "tensor_split", "array_split", "BatchSampler", "minibatches",
                         "iter_minibatches", "micro_batches", "split_batch", "make_minibatches"})
ROLLOUT_CALL = re.compile(r"(?i)generate\w*|rollout\w*|collect\w*|sample_?\w*|play\w*|run_episodes?|"
                          r"make_experience\w*|gather_experience\w*")
OPT_NAME = re.compile(r"(?i)(\w*_)?(opt|optim|optimi[sz]er)s?|\w*optimi[sz]ers?")
SCHEDULER_NAME = re.compile(r"(?i)\w*(sched\w*|lr_\w*|warmup\w*|env\w*|scaler)")
# Calls that run a whole training step in code the linter cannot see (they zero, forward, backward).
TRAIN_STEP_CALL = re.compile(r"(?i)\w*(training_step|train_step|train_batch|fwd_bwd\w*|forward_backward\w*|"
                             r"backward_step|optimizer_step|step_optimizer|update_step|train_on_batch|"
                             r"apply_gradients)\w*")
ALL = "*"  # zeroing that covers every optimizer (model.zero_grad(), p.grad = None)
UNKNOWN = "?"  # zeroing the linter cannot rule out (a training step out of view)


@dataclass
class Zeroing:
    node: cst.CSTNode
    roots: frozenset  # roots of the optimizer zeroed; or {ALL} / {UNKNOWN}


@dataclass
class TrainingFacts:
    """Per module: backward passes, optimizer steps (with the optimizer), gradient zeroing."""

    backwards: list[cst.Call] = field(default_factory=list)
    steps: list[tuple[cst.Call, cst.BaseExpression]] = field(default_factory=list)
    zeroing: list[Zeroing] = field(default_factory=list)
    update_loops: set[int] = field(default_factory=set)  # loops whose own body holds an update


class Training:
    def __init__(self, a: "Analysis"):
        self.a = a
        self.objs = objects(a)
        self.facts = TrainingFacts()
        self._helper_effects: dict[int, tuple[bool, list]] = {}
        self._build()

    # ----- optimizers ------------------------------------------------------------------------------------------
    def roots(self, expr: cst.BaseExpression) -> frozenset:
        value = self.objs.value(expr)
        if isinstance(value, Tup) or not value:
            key = key_of(expr)
            return frozenset({key}) if key else frozenset()
        return frozenset(o.key for o in value)

    def is_optimizer(self, expr: cst.BaseExpression) -> bool:
        value = self.objs.value(expr)
        if isinstance(value, Tup):
            return False
        # an element of what a call returns (`opt, sched = make_optimizer(...)`) is neither named nor built by it
        whole = [o for o in value if not o.key.endswith("]")]
        names = [n for o in whole for n in o.names] + ([_last_name(expr)] if _last_name(expr) else [])
        for o in value:
            if o in whole and o.kind in ("new", "opaque") and o.names and S.OPTIMIZER_CLASS.fullmatch(o.names[0]):
                return True  # built by an optimizer class or factory (`optim.Adam(...)`), whatever it is called
            if o.kind == "opaque" and o.node_id and self._from_deepspeed(o):
                return False
        if any(SCHEDULER_NAME.fullmatch(n) for n in names[-1:]):
            return False
        return any(self.a.names.is_role(n, "optimizer") or OPT_NAME.fullmatch(n) for n in names)

    def _from_deepspeed(self, o) -> bool:
        return bool(o.names) and o.names[0] in ("initialize", "deepspeed_init", "init_distributed")

    def optimizer_of_step(self, call: cst.Call) -> cst.BaseExpression | None:
        """``opt.step()`` / ``self.optimizer.step()`` / ``scaler.step(optimizer)``: the optimizer; None for a
        scheduler, an environment, a DeepSpeed engine."""
        recv = S.receiver(call)
        if recv is None:
            return None
        name = _last_name(recv) or ""
        if re.fullmatch(r"(?i)\w*scaler", name) and call.args and self.is_optimizer(call.args[0].value):
            return call.args[0].value  # AMP: scaler.step(optimizer)
        if steps_a_value(self.a, call):
            return None  # `optim.step(loss)`: a wrapper that backpropagates and steps itself, not torch's step
        if self.is_optimizer(recv):
            return recv
        return None

    # ----- module facts --------------------------------------------------------------------------------------
    def _build(self) -> None:
        a, facts = self.a, self.facts
        for call in a.nodes(cst.Call):
            method = S.method_name(call)
            if method in S.BACKWARD_METHODS:
                facts.backwards.append(call)
                self._mark_update(call)
            elif method == "step":
                opt = self.optimizer_of_step(call)
                if opt is not None:
                    facts.steps.append((call, opt))
                    self._mark_update(call)
            zero = self._zeroing_of(call)
            if zero is not None:
                facts.zeroing.append(Zeroing(call, zero))
        for stmt in a.nodes(cst.Assign):
            if any(_is_grad(t.target) for t in stmt.targets):
                facts.zeroing.append(Zeroing(stmt, frozenset({ALL})))
        # helpers that update: their call sites hold an update too
        updating = self._updating_helpers()
        for call in a.nodes(cst.Call):
            if (S.called_name(call) or "") in updating:
                func = a.callee(call)
                if func is not None and self.helper_updates(func):
                    self._mark_update(call)

    def _mark_update(self, node: cst.CSTNode) -> None:
        loops = self.a.enclosing_loops(node)
        if loops:
            self.facts.update_loops.add(id(loops[0]))

    def _zeroing_of(self, call: cst.Call) -> frozenset | None:
        a = self.a
        method = S.method_name(call)
        recv = S.receiver(call)
        if method in S.ZERO_GRAD_METHODS:
            if recv is not None and self.is_optimizer(recv) and not self._loop_variable(recv):
                return self.roots(recv)
            return frozenset({ALL})
        if method in S.GRAD_RESET_METHODS and recv is not None and _is_grad(recv):
            return frozenset({ALL})
        last = S.called_name(call) or ""
        if last in self._zeroing_helpers():
            func = a.callee(call)
            if func is not None:
                effect = self.helper_zeroes(func)
                return self._map_effect(effect, call, func) if effect else None
        if a.project is not None:
            dotted = dotted_name(call.func)
            resolved = a.resolve_import(dotted) if dotted else None
            summary = a.project.get(resolved) if resolved else None
            if summary is not None:
                return self._map_summary(summary.zeroes, summary.params, call) if summary.zeroes else None
        if TRAIN_STEP_CALL.fullmatch(last):
            return frozenset({UNKNOWN})
        return None

    def _updating_helpers(self) -> set[str]:
        """Names of functions that hold a backward or an optimizer step, directly or through a helper (by name)."""
        a = self.a
        names = set()
        for call in self.facts.backwards + [c for c, _ in self.facts.steps]:
            func = a.enclosing_function(call)
            if func is not None:
                names.add(func.name.value)
        changed = bool(names)
        while changed:
            changed = False
            for call in a.nodes(cst.Call):
                if (S.called_name(call) or "") in names:
                    func = a.enclosing_function(call)
                    if func is not None and func.name.value not in names:
                        names.add(func.name.value)
                        changed = True
        return names

    def _zeroing_helpers(self) -> frozenset[str]:
        """Names of the module's functions that zero gradients (themselves or through a helper they call)."""
        hit = self.a.cache.get("zeroing_helpers")
        if hit is None:
            # functions with a zeroing of their own, then (by name) those that call one: a cheap superset, each
            # confirmed through its effects when a call of it is met
            a = self.a
            direct = set()
            for call in a.nodes(cst.Call):
                method = S.method_name(call)
                if method in S.ZERO_GRAD_METHODS or (method in S.GRAD_RESET_METHODS and _is_grad(S.receiver(call))):
                    func = a.enclosing_function(call)
                    if func is not None:
                        direct.add(func.name.value)
            for stmt in a.nodes(cst.Assign):
                if any(_is_grad(t.target) for t in stmt.targets):
                    func = a.enclosing_function(stmt)
                    if func is not None:
                        direct.add(func.name.value)
            names = set(direct)
            changed = bool(names)
            while changed:
                changed = False
                for call in a.nodes(cst.Call):
                    if (S.called_name(call) or "") in names:
                        func = a.enclosing_function(call)
                        if func is not None and func.name.value not in names:
                            names.add(func.name.value)
                            changed = True
            hit = self.a.cache["zeroing_helpers"] = frozenset(names)
        return hit

    def helper_zeroes(self, func: cst.FunctionDef) -> list[str]:
        """What a same-module function zeroes: parameter names, ``self.x`` paths, or ALL."""
        return self._effects(func)[1]

    def helper_updates(self, func: cst.FunctionDef) -> bool:
        return self._effects(func)[0]

    def _effects(self, func: cst.FunctionDef) -> tuple[bool, list]:
        hit = self._helper_effects.get(id(func))
        if hit is not None:
            return hit
        self._helper_effects[id(func)] = (False, [])  # recursion guard
        updates, zeroes = False, []
        for call in self.a.index.descendants(func, cst.Call):
            method = S.method_name(call)
            if method in S.BACKWARD_METHODS or (method == "step" and self.optimizer_of_step(call) is not None):
                updates = True
            if method in S.ZERO_GRAD_METHODS:
                recv = S.receiver(call)
                zeroes.append(dotted_name(recv) if recv is not None and self.is_optimizer(recv) else ALL)
            elif method in S.GRAD_RESET_METHODS and S.receiver(call) is not None and _is_grad(S.receiver(call)):
                zeroes.append(ALL)
            inner = self.a.callee(call)
            if inner is not None and inner is not func:
                inner_updates, inner_zeroes = self._effects(inner)
                updates = updates or inner_updates
                zeroes += [z for z in inner_zeroes if z == ALL or z.startswith("self.")]
        for stmt in self.a.index.descendants(func, cst.Assign):
            if any(_is_grad(t.target) for t in stmt.targets):
                zeroes.append(ALL)
        hit = (updates, [z for z in zeroes if z])
        self._helper_effects[id(func)] = hit
        return hit

    def _map_effect(self, effect: list[str], call: cst.Call, func: cst.FunctionDef) -> frozenset:
        from rlguard.lint.analysis.values import bind_arguments

        bound = dict((name, value) for name, value in bind_arguments(func, call, None))
        roots: set = set()
        for z in effect:
            if z == ALL:
                return frozenset({ALL})
            head = z.split(".", 1)[0]
            if head in ("self", "cls"):
                roots.add(self._self_root(call, z))
            elif head in bound:
                roots |= self.roots(bound[head][0])
            else:
                roots.add(UNKNOWN)
        return frozenset(roots)

    def _self_root(self, call: cst.Call, path: str) -> str:
        """The identity key of ``self.<attr>`` as seen from ``call``'s class."""
        cls = self.a.enclosing_class(call)
        owner = f"{cls.name.value}." if cls is not None else ""
        fallback = None
        for stmt in self.a.nodes(cst.Attribute):
            if dotted_name(stmt) == path and self.a.enclosing_class(stmt) is cls:
                value = self.objs.value(stmt)
                found = self.roots(stmt)
                if not found:
                    continue
                # the store's own target (`self.opt = AdamW(...)` in __init__) names the attribute, not the object
                # bound to it: prefer a read, which resolves to that object as every use of `self.opt` does
                if value and not isinstance(value, Tup) and all(o.kind == "attr" for o in value):
                    fallback = fallback or next(iter(found))
                    continue
                return next(iter(found))
        return fallback or f"{owner}{path}"

    def _map_summary(self, zeroes: list[str], params: list[str], call: cst.Call) -> frozenset:
        roots: set = set()
        positional = [a.value for a in call.args if a.keyword is None and not a.star]
        by_name = dict(zip(params, positional))
        by_name.update({a.keyword.value: a.value for a in call.args if a.keyword is not None})
        for z in zeroes:
            head = z.split(".", 1)[0]
            if head in by_name:
                roots |= self.roots(by_name[head])
            else:
                roots.add(UNKNOWN)  # its own attribute, or an optimizer it builds: cannot be matched here
        return frozenset(roots)

    def _loop_variable(self, expr: cst.BaseExpression) -> bool:
        """``o`` in ``for o in (actor_opt, critic_opt): o.zero_grad()``: it stands for several optimizers."""
        if not isinstance(expr, cst.Name):
            return False
        return any(d.kind in ("for", "comp") for d in self.a.flow.reaching(expr.value, expr))

    # ----- loops ---------------------------------------------------------------------------------------------
    def holds_update_directly(self, loop: Loop) -> bool:
        return id(loop) in self.facts.update_loops

    def header_words(self, loop: Loop) -> list[str]:
        """Names in a loop's header: the target, the iterable, the names and called functions in it (not the
        strings: ``tqdm(loader, desc="epoch")`` says nothing about the loop)."""
        words: list[str] = []
        stack: list[cst.CSTNode] = [loop.test] if isinstance(loop, cst.While) else [loop.target, loop.iter]
        while stack:
            node = stack.pop()
            if isinstance(node, cst.Name):
                words.append(node.value)
            elif isinstance(node, cst.Attribute):
                words.append(node.attr.value)
                stack.append(node.value)
            else:
                stack.extend(children(node))
        return words

    def splits(self, expr: cst.BaseExpression) -> bool:
        stack = [expr]
        while stack:
            node = stack.pop()
            if isinstance(node, cst.Call):
                name = S.called_name(node) or ""
                if name in SPLIT_CALLS:
                    return True
                stack.append(node.func)
                stack.extend(arg.value for arg in node.args)
            elif isinstance(node, (cst.Attribute, cst.Subscript)):
                stack.append(node.value)
        return False

    def is_epoch_loop(self, loop: Loop) -> bool:
        if isinstance(loop, cst.For) and self.splits(loop.iter):
            return True
        return any(EPOCH_WORD.search(w) for w in self.header_words(loop))

    def is_microbatch_loop(self, loop: Loop) -> bool:
        if not isinstance(loop, cst.For):
            return False
        if self.splits(loop.iter):
            return True
        return any(MICRO_WORD.search(w) for w in self.header_words(loop))

    def collects_rollouts(self, loop: Loop) -> bool:
        """Whether the loop's body gathers fresh experience (``model.generate``, ``collect_rollouts()``,
        ``env.step``...): such a loop runs once per batch of experience."""
        cache = self.a.cache.setdefault("collects_rollouts", {})
        hit = cache.get(id(loop))
        if hit is not None:
            return hit
        hit = self._gathers_experience(loop, depth=2)
        cache[id(loop)] = hit
        return hit

    def _gathers_experience(self, scope: cst.CSTNode, depth: int) -> bool:
        """A rollout call in ``scope``, or in a same-module function it calls (``depth`` levels): a loop that
        calls ``train_step()`` which itself generates gathers fresh experience as much as one that generates."""
        for call in self.a.index.descendants(scope, cst.Call):
            name = S.called_name(call) or ""
            if ROLLOUT_CALL.fullmatch(name):
                return True
            if name == "step" and self.optimizer_of_step(call) is None:
                recv = S.receiver(call)
                if re.search(r"(?i)env", _last_name(recv) or "" if recv is not None else ""):
                    return True
            if depth > 0:
                callee = self.a.callee(call)
                if callee is not None and not self.a.contains(callee, scope) and \
                        self._gathers_experience(callee, depth - 1):
                    return True
        return False

    def update_loops(self, node: cst.CSTNode) -> list[Loop]:
        """Loops around ``node`` (innermost first) that run once per update: epoch/minibatch loops and loops
        holding an update in their own body, up to the first loop that gathers fresh rollouts."""
        found = []
        for loop in self.a.enclosing_loops(node):
            if self.collects_rollouts(loop):
                break
            if self.is_epoch_loop(loop) or self.holds_update_directly(loop):
                found.append(loop)
        return found

    def same_optimizer(self, a_expr: cst.BaseExpression, b_expr: cst.BaseExpression) -> bool:
        return bool(self.roots(a_expr) & self.roots(b_expr))


def _is_grad(expr: cst.BaseExpression) -> bool:
    """``p.grad``, ``p.grad.data``."""
    name = dotted_name(expr)
    return name is not None and (name.endswith(".grad") or name.endswith(".grad.data"))


def _last_name(expr: cst.BaseExpression | None) -> str | None:
    if isinstance(expr, cst.Name):
        return expr.value
    if isinstance(expr, cst.Attribute):
        return expr.attr.value
    return None


def training(a: "Analysis") -> Training:
    return a.facet("training", Training)


def steps_a_value(a: "Analysis", call: cst.Call) -> bool:
    """``x.step(v)`` with a positional argument that is no closure: torch's ``Optimizer.step`` takes only a
    closure (a lambda or a function), so ``step(loss)`` is another API's step (a wrapper that runs the backward
    and the update, an environment's ``step(action)``)."""
    positional = [arg.value for arg in call.args if arg.keyword is None and not arg.star]
    if not positional:
        return False
    first = positional[0]
    if isinstance(first, cst.Lambda):
        return False
    if isinstance(first, cst.Name) and any(d.kind == "def" for d in a.flow.reaching(first.value, first)):
        return False
    return True
