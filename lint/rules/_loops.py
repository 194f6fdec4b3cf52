"""Shared reasoning about training loops, for the update-loop rules (RLG002, RLG006, RLG013) and others.

A *loop that holds an update* is a ``for``/``while`` loop in whose body (not in a nested loop, not in a nested
function) the gradients are used: a ``.backward()`` call, or ``.step()`` on a receiver playing the optimizer
role (``optimizer``, ``self.opt``, ``scaler.step(optimizer)``). An *epoch/minibatch loop* is one whose header
says it iterates over PPO epochs, minibatches or microbatches (``for epoch in range(ppo_epochs)``,
``for mb in batch.chunk(n)``, ``for idx in BatchSampler(...)``), wherever its update sits.

It also knows what a *model forward* is (a call of the policy, the reference model or a value head/critic, or
of a helper applied to one: :func:`is_model_forward`, :func:`forward_calls`) and where autograd is off, beyond
``ModuleContext.is_grad_disabled``: functions only ever called under ``torch.no_grad()``
(:func:`is_grad_off`) and a reference model frozen with ``requires_grad_(False)`` (:func:`reference_frozen`).

Per-module facts are computed once (cached per :class:`ModuleContext`) by iterating the indexed calls, so rules
can ask per node without re-walking the tree; the few helpers that scan a subtree (``collects_rollouts``) are
meant for candidates only.
"""

from __future__ import annotations

import re
import weakref
from dataclasses import dataclass, field

import libcst as cst

from rlguard.lint.context import ModuleContext, dotted_name, method_name, receiver, value_name

Loop = cst.For | cst.While

# Words in a loop header (target, iterable, range bound) that say "PPO epochs / minibatches / microbatches".
EPOCH_WORD = re.compile(
    r"(?i)(^|_)(epochs?|ppo_epochs?|update_epochs?|n_epochs|num_epochs|inner_epochs?|ppo_iters?|"
    r"mini_?batch(es)?|mini_?bs|mbs?|mb_\w+|minibatch\w*|micro\w*|accum\w*|grad_accum\w*|"
    r"gradient_accumulation\w*|inner_steps?|k_epochs?|opt_epochs?|optim_epochs?|"
    r"chunks?|splits?|batch_sampler)($|_)")
MICRO_WORD = re.compile(
    r"(?i)(^|_)(micro\w*|mbs?|accum\w*|grad_accum\w*|gradient_accumulation\w*|chunks?|splits?|parts?|"
    r"n_micro\w*|num_micro\w*)($|_)")
# Functions/methods whose call in a loop header means "split the batch into pieces".
SPLIT_CALLS = frozenset({"chunk", "split", "tensor_split", "array_split", "BatchSampler", "minibatches",
                         "iter_minibatches", "micro_batches", "split_batch", "make_minibatches"})
# Calls that mean "collect fresh experience": a loop holding one is an outer rollout loop.
ROLLOUT_CALL = re.compile(r"(?i)generate\w*|rollout\w*|collect\w*|sample_?\w*|play\w*|run_episodes?|"
                          r"make_experience\w*|gather_experience\w*")
ACCUM_COUNT = re.compile(
    r"(?i)\w*(grad_accum\w*|gradient_accumulation\w*|accum_steps|accum|accumulation_steps|accumulate\w*|"
    r"n_micro\w*|num_micro\w*|micro_?steps|n_mbs?|num_mbs?|n_chunks|num_chunks|n_splits|num_splits|"
    r"micro_batches|n_micro_batches|num_microbatches)")
OPT_NAME = re.compile(r"(?i)(\w*_)?(opt|optim|optimi[sz]er)s?|\w*optimi[sz]ers?")


@dataclass
class LoopIndex:
    """Per module: which calls are updates, which loops hold one, and the zero-grad calls."""

    backward_calls: list[cst.Call] = field(default_factory=list)
    step_calls: list[tuple[cst.Call, cst.BaseExpression]] = field(default_factory=list)  # (call, optimizer)
    direct_update_loops: set[int] = field(default_factory=set)  # loops whose own body holds an update


_CACHE: "weakref.WeakKeyDictionary[ModuleContext, LoopIndex]" = weakref.WeakKeyDictionary()


def loop_index(ctx: ModuleContext) -> LoopIndex:
    index = _CACHE.get(ctx)
    if index is None:
        index = _build(ctx)
        _CACHE[ctx] = index
    return index


def _build(ctx: ModuleContext) -> LoopIndex:
    index = LoopIndex()
    for call in ctx.nodes(cst.Call):
        name = method_name(call)
        if name in ("backward", "manual_backward"):
            index.backward_calls.append(call)
        elif name == "step":
            opt = optimizer_of_step(ctx, call)
            if opt is not None:
                index.step_calls.append((call, opt))
        else:
            continue
        loops = ctx.enclosing_loops(call)
        if loops:
            index.direct_update_loops.add(id(loops[0]))
    return index


def _bare_name(call: cst.Call) -> str | None:
    return call.func.value if isinstance(call.func, cst.Name) else None


def optimizer_of_step(ctx: ModuleContext, call: cst.Call) -> cst.BaseExpression | None:
    """For ``opt.step()`` / ``self.optimizer.step()`` / ``scaler.step(optimizer)``: the optimizer expression;
    None when the receiver does not play the optimizer role (``scheduler.step()``, ``env.step(a)``,
    a DeepSpeed ``engine.step()``, which zeroes its own gradients)."""
    recv = receiver(call)
    if recv is None:
        return None
    if is_optimizer(ctx, recv):
        return recv
    name = value_name(recv)
    if name is not None and re.fullmatch(r"(?i)\w*scaler", name.rsplit(".", 1)[-1]) and call.args:
        arg = call.args[0].value
        if is_optimizer(ctx, arg):
            return arg
    return None


def is_optimizer_name(ctx: ModuleContext, name: str | None) -> bool:
    """The optimizer role, plus the short spellings ``actor_opt``, ``critic_optim``, ``opts``."""
    if not name:
        return False
    bare = name.rsplit(".", 1)[-1]
    return ctx.names.is_role(bare, "optimizer") or OPT_NAME.fullmatch(bare) is not None


def is_optimizer(ctx: ModuleContext, expr: cst.BaseExpression) -> bool:
    """Whether ``expr`` names an optimizer (by its own name or an alias), and is not a DeepSpeed engine's."""
    if not any(is_optimizer_name(ctx, n) for n in ctx.role_names(expr)):
        return False
    for origin in ctx.origins(expr):
        if isinstance(origin, cst.Call) and (ctx.call_name(origin) or "").startswith("deepspeed."):
            return False
    return True


def is_update_call(ctx: ModuleContext, call: cst.Call) -> bool:
    index = loop_index(ctx)
    return any(c is call for c in index.backward_calls) or any(c is call for c, _ in index.step_calls)


def holds_update_directly(ctx: ModuleContext, loop: Loop) -> bool:
    """Whether ``.backward()`` or ``optimizer.step()`` sits in this loop's own body (not in a nested loop)."""
    return id(loop) in loop_index(ctx).direct_update_loops


def holds_update(ctx: ModuleContext, loop: Loop) -> bool:
    """Whether an update call sits anywhere inside ``loop`` (nested loops included)."""
    index = loop_index(ctx)
    calls = index.backward_calls + [c for c, _ in index.step_calls]
    return any(ctx.contains(loop, c) for c in calls)


def header_words(ctx: ModuleContext, loop: Loop) -> list[str]:
    """Names in a loop's header: the target, the iterable, the names and called functions in it (not the
    strings: ``tqdm(loader, desc="epoch")`` says nothing about the loop)."""
    words: list[str] = []
    parts: list[cst.CSTNode] = [loop.test] if isinstance(loop, cst.While) else [loop.target, loop.iter]
    stack = list(parts)
    while stack:
        node = stack.pop()
        if isinstance(node, cst.Name):
            words.append(node.value)
        elif isinstance(node, cst.Attribute):
            words.append(node.attr.value)
            stack.append(node.value)
        else:
            stack.extend(node.children)
    return words


def is_epoch_loop(ctx: ModuleContext, loop: Loop) -> bool:
    """Whether the loop header iterates PPO epochs, minibatches or microbatches (see ``EPOCH_WORD``)."""
    if isinstance(loop, cst.For) and _splits(ctx, loop.iter):
        return True
    return any(EPOCH_WORD.search(w) for w in header_words(ctx, loop))


def is_microbatch_loop(ctx: ModuleContext, loop: Loop) -> bool:
    """Whether the loop iterates microbatches of one minibatch: over ``.chunk()``/``.split()`` pieces,
    ``range(grad_accum_steps)``, or names like ``micro_batches``/``mb``."""
    if not isinstance(loop, cst.For):
        return False
    if _splits(ctx, loop.iter):
        return True
    return any(MICRO_WORD.search(w) for w in header_words(ctx, loop))


def _splits(ctx: ModuleContext, expr: cst.BaseExpression) -> bool:
    stack = [expr]
    while stack:
        node = stack.pop()
        if isinstance(node, cst.Call):
            name = method_name(node) or _bare_name(node) or (ctx.call_name(node) or "").rsplit(".", 1)[-1]
            if name in SPLIT_CALLS:
                return True
            stack.append(node.func)
            stack.extend(a.value for a in node.args)
        elif isinstance(node, (cst.Attribute, cst.Subscript)):
            stack.append(node.value)
    return False


def collects_rollouts(ctx: ModuleContext, loop: Loop) -> bool:
    """Whether the loop's body gathers fresh experience (``model.generate``, ``collect_rollouts()``,
    ``env.step``...): such a loop is an outer rollout loop, one batch of data per iteration."""
    for call in ctx.descendants(loop, cst.Call):
        name = method_name(call) or _bare_name(call)
        if name is None:
            continue
        if ROLLOUT_CALL.fullmatch(name):
            return True
        if name == "step" and not is_update_call(ctx, call):
            recv = receiver(call)
            recv_name = value_name(recv) if recv is not None else None
            if recv_name and re.search(r"(?i)env", recv_name):
                return True
    return False


def update_loops(ctx: ModuleContext, node: cst.CSTNode) -> list[Loop]:
    """The loops around ``node`` (innermost first) in which recomputing something from the current weights
    happens once per update: epoch/minibatch loops by their header, and loops holding an update in their own
    body. The search stops at the first loop that gathers fresh rollouts: it and the loops around it run
    once per batch of experience."""
    found = []
    for loop in ctx.enclosing_loops(node):
        if collects_rollouts(ctx, loop):
            break
        if is_epoch_loop(ctx, loop):
            found.append(loop)
        elif holds_update_directly(ctx, loop):
            found.append(loop)
    return found


def same_object(ctx: ModuleContext, a: cst.BaseExpression, b: cst.BaseExpression) -> bool:
    """Whether two expressions name the same object, following aliases (``opt = self.optimizer``)."""
    return bool(_keys(ctx, a) & _keys(ctx, b))


def _keys(ctx: ModuleContext, expr: cst.BaseExpression) -> set[str]:
    keys = set()
    for origin in ctx.origins(expr):
        name = dotted_name(origin)
        if name is not None:
            keys.add(name)
    return keys


def is_accumulation_count(ctx: ModuleContext, expr: cst.BaseExpression) -> bool:
    """``grad_accum_steps``, ``self.args.gradient_accumulation_steps``, ``n_micro``, ``len(micro_batches)``."""
    while isinstance(expr, cst.Call) and method_name(expr) in ("float", "int") and not expr.args:
        expr = expr.func.value
    if isinstance(expr, cst.Call) and _bare_name(expr) in ("len", "float", "max") and expr.args:
        return any(is_accumulation_count(ctx, a.value) or _splits(ctx, a.value) or
                   (value_name(a.value) is not None and MICRO_WORD.search(value_name(a.value)))
                   for a in expr.args)
    name = value_name(expr)
    if name is not None and ACCUM_COUNT.fullmatch(name.rsplit(".", 1)[-1]):
        return True
    return False


# ----- model forwards and autograd -----------------------------------------------------------------------
# Names of value heads / critics (the policy and the reference model come from the role vocabulary).
CRITIC_NAME = re.compile(r"(?i)(\w*_)?(critic|value_?(model|head|net|network|fn|function)|v_?head|vf|"
                         r"v_?net|q_?net|q_?function)")
# Methods of a model that are no forward pass.
NON_FORWARD_METHODS = frozenset({
    "parameters", "named_parameters", "buffers", "named_buffers", "modules", "named_modules", "children",
    "eval", "train", "to", "cuda", "cpu", "half", "float", "bfloat16", "state_dict", "load_state_dict",
    "generate", "zero_grad", "requires_grad_", "save_pretrained", "get_input_embeddings", "apply",
    "register_forward_hook", "register_buffer", "gradient_checkpointing_enable", "tie_weights", "resize",
    "eval_mode", "train_mode", "num_parameters", "get_output_embeddings",
})
# Calls whose result carries no gradient whatever their inputs.
NO_GRAD_CALLS = frozenset({
    "detach", "detach_", "item", "tolist", "numpy", "zeros_like", "ones_like", "empty_like", "full_like",
    "rand_like", "randn_like", "randint_like", "size", "numel", "dim", "argmax", "argmin", "argsort", "len",
    "int", "bool", "long", "isnan", "isinf", "isfinite", "eq", "ne", "gt", "lt", "ge", "le", "nonzero",
    "multinomial", "sample", "generate", "no_grad", "shape",
})
GRAD_OFF_NAMES = frozenset({"no_grad", "inference_mode"})


def is_model_name(ctx: ModuleContext, name: str | None) -> bool:
    """Policy, reference model or value head/critic, by name (``self.actor``, ``ref_model``, ``critic``)."""
    if not name:
        return False
    bare = name.rsplit(".", 1)[-1]
    return (ctx.names.is_role(bare, "policy") or ctx.names.is_role(bare, "ref_model")
            or CRITIC_NAME.fullmatch(bare) is not None)


def _model_expr(ctx: ModuleContext, expr: cst.BaseExpression) -> bool:
    if isinstance(expr, (cst.Name, cst.Attribute)):
        return is_model_name(ctx, value_name(expr))
    return False


def is_model_forward(ctx: ModuleContext, call: cst.Call) -> bool:
    """``model(ids)``, ``self.policy.forward(x)``, ``agent.get_action_and_value(obs)``, ``critic(obs)``:
    a call of a model, or of a method of one that runs it (not ``.parameters()``, ``.generate()``...)."""
    func = call.func
    if _model_expr(ctx, func):
        return True
    if isinstance(func, cst.Attribute) and func.attr.value not in NON_FORWARD_METHODS:
        return _model_expr(ctx, func.value)
    return False


def model_arguments(ctx: ModuleContext, call: cst.Call) -> list[cst.BaseExpression]:
    """Arguments of ``call`` that name a model (``compute_logp(policy, ids)`` -> [policy])."""
    return [a.value for a in call.args if _model_expr(ctx, a.value)]


@dataclass
class _GradState:
    grad_off_functions: dict[int, bool] = field(default_factory=dict)
    frozen_ref: bool | None = None


_GRAD_CACHE: "weakref.WeakKeyDictionary[ModuleContext, _GradState]" = weakref.WeakKeyDictionary()


def _grad_state(ctx: ModuleContext) -> _GradState:
    state = _GRAD_CACHE.get(ctx)
    if state is None:
        state = _GradState()
        _GRAD_CACHE[ctx] = state
    return state


def function_runs_grad_off(ctx: ModuleContext, func: cst.FunctionDef | None) -> bool:
    """Whether ``func`` is decorated with a grad-off context, or every call of it in this module
    (``helper(...)``, ``self.helper(...)``) sits in a grad-off region."""
    if func is None:
        return False
    state = _grad_state(ctx)
    hit = state.grad_off_functions.get(id(func))
    if hit is None:
        state.grad_off_functions[id(func)] = False  # recursion guard
        if any(ctx._is_grad_off_call(d.decorator) for d in func.decorators):
            hit = True
        else:
            name = func.name.value
            sites = [c for c in ctx.nodes(cst.Call)
                     if (isinstance(c.func, cst.Name) and c.func.value == name)
                     or (isinstance(c.func, cst.Attribute) and c.func.attr.value == name
                         and dotted_name(c.func.value) in ("self", "cls"))]
            hit = bool(sites) and all(is_grad_off(ctx, c) for c in sites)
        state.grad_off_functions[id(func)] = hit
    return hit


def is_grad_off(ctx: ModuleContext, node: cst.CSTNode) -> bool:
    """Autograd is off at ``node``: a grad-off ``with`` block or decorator, or a function that only runs
    under one (see :func:`function_runs_grad_off`)."""
    if ctx.is_grad_disabled(node):
        return True
    return function_runs_grad_off(ctx, ctx.enclosing_function(node))


def reference_frozen(ctx: ModuleContext) -> bool:
    """Whether the module freezes its reference model (``ref_model.requires_grad_(False)``, or
    ``p.requires_grad = False`` in a loop over its parameters): its forwards then carry no gradient."""
    state = _grad_state(ctx)
    if state.frozen_ref is None:
        state.frozen_ref = False
        for call in ctx.nodes(cst.Call):
            if method_name(call) == "requires_grad_" and call.args and \
                    isinstance(call.args[0].value, cst.Name) and call.args[0].value.value == "False":
                recv = receiver(call)
                if recv is not None and ctx.has_role(recv, "ref_model"):
                    state.frozen_ref = True
        for stmt in ctx.nodes(cst.Assign):
            target = dotted_name(stmt.targets[0].target) or ""
            if target.endswith(".requires_grad") and isinstance(stmt.value, cst.Name) and \
                    stmt.value.value == "False":
                for loop in ctx.enclosing_loops(stmt):
                    if isinstance(loop, cst.For) and any(
                            ctx.names.is_role(w, "ref_model") for w in header_words(ctx, loop)):
                        state.frozen_ref = True
    return state.frozen_ref


def forward_calls(ctx: ModuleContext, expr: cst.BaseExpression, *, grad: bool, depth: int = 10) -> list[cst.Call]:
    """The model forwards ``expr``'s value is computed from, following names back through their reaching
    assignments, ``self.x`` attributes and the bodies of same-module helpers.

    With ``grad=True`` only paths along which the gradient survives count: ``.detach()``/``.item()``,
    assignments in grad-off regions, grad-off helpers and forwards of a frozen reference stop the search.
    With ``grad=False`` every forward counts (the question is then "does this come from the weights?")."""
    found: list[cst.Call] = []
    seen: set[int] = set()

    def walk(e: cst.CSTNode | None, d: int) -> None:
        if e is None or d < 0 or id(e) in seen:
            return
        seen.add(id(e))
        if isinstance(e, cst.Call):
            name = method_name(e) or (e.func.value if isinstance(e.func, cst.Name) else None)
            if grad and name in NO_GRAD_CALLS:
                return
            if is_model_forward(ctx, e):
                if grad and (ctx.is_grad_disabled(e) or (reference_frozen(ctx) and _is_ref_call(ctx, e))):
                    return
                found.append(e)
                return
            helper = same_module_callee(ctx, e)
            if helper is not None:
                if grad and function_runs_grad_off(ctx, helper):
                    return
                returns = [r for r in ctx.scopes[id(helper)].returns if r.value is not None]
                if grad:
                    returns = [r for r in returns if not ctx.is_grad_disabled(r)]
                    if not returns or all(_detached_text(ctx, r.value) for r in returns):
                        return
                before = len(found)
                for ret in returns:
                    walk(ret.value, d - 1)
                if len(found) > before:  # report the call site, not the forward inside the helper
                    del found[before:]
                    found.append(e)
                walk_args(e, d)  # arguments flow into the helper's result
                return
            if model_arguments(ctx, e) and name not in NON_FORWARD_METHODS:
                found.append(e)  # compute_logp(policy, ids) from another module: a forward of the policy
                return
            if isinstance(e.func, cst.Attribute):
                walk(e.func.value, d)
            walk_args(e, d)
        elif isinstance(e, (cst.Name, cst.Attribute)):
            key = dotted_name(e)
            if isinstance(e, cst.Attribute) and (key is None or not key.startswith("self.") or key.count(".") > 1):
                if e.attr.value in ("shape", "dtype", "device", "grad", "data"):
                    return
                walk(e.value, d)
                return
            if key is None:
                return
            for a in ctx.reaching_assignments(key, e):
                if a.value is None or (grad and is_grad_off(ctx, a.statement)):
                    continue
                walk(a.value, d - 1)
        elif isinstance(e, cst.Subscript):
            walk(e.value, d)
        elif isinstance(e, cst.BinaryOperation):
            walk(e.left, d)
            walk(e.right, d)
        elif isinstance(e, cst.UnaryOperation):
            if not isinstance(e.operator, cst.Not):
                walk(e.expression, d)
        elif isinstance(e, cst.IfExp):
            walk(e.body, d)
            walk(e.orelse, d)
        elif isinstance(e, (cst.Tuple, cst.List)):
            for el in e.elements:
                walk(el.value, d)

    def walk_args(call: cst.Call, d: int) -> None:
        for arg in call.args:
            if arg.keyword is None or arg.keyword.value not in ("dim", "index", "mask", "attention_mask"):
                walk(arg.value, d)

    walk(expr, depth)
    return found


def same_module_callee(ctx: ModuleContext, call: cst.Call) -> cst.FunctionDef | None:
    """The same-module function ``call`` runs: ``helper(...)`` or ``self.helper(...)`` when exactly one
    function has that name, or the ``forward``/``__call__`` of an instance of a same-module class
    (``self.loss_fn = PolicyLoss(); self.loss_fn(...)``)."""
    func = call.func
    if isinstance(func, cst.Name):
        name = func.value
    elif isinstance(func, cst.Attribute) and dotted_name(func.value) in ("self", "cls"):
        name = func.attr.value
    else:
        return None
    defs = ctx.functions.get(name)
    if defs:
        return defs[0] if len(defs) == 1 else None
    for origin in ctx.origins(func)[1:]:
        if isinstance(origin, cst.Call) and isinstance(origin.func, cst.Name):
            method = _class_method(ctx, origin.func.value, ("forward", "__call__"))
            if method is not None:
                return method
    return None


def _class_method(ctx: ModuleContext, class_name: str, methods: tuple[str, ...]) -> cst.FunctionDef | None:
    classes = [c for c in ctx.nodes(cst.ClassDef) if c.name.value == class_name]
    if len(classes) != 1:
        return None
    for stmt in classes[0].body.body:
        if isinstance(stmt, cst.FunctionDef) and stmt.name.value in methods:
            return stmt
    return None


def is_reference_forward(ctx: ModuleContext, call: cst.Call) -> bool:
    """A forward of the reference model (``ref_model(ids)``, ``self.ref.forward(x)``), or a helper applied to it
    (``logp_of(self.ref_model, ids)``)."""
    if is_model_forward(ctx, call):
        func = call.func
        if ctx.has_role(func, "ref_model"):
            return True
        return isinstance(func, cst.Attribute) and ctx.has_role(func.value, "ref_model")
    return any(ctx.has_role(arg, "ref_model") for arg in model_arguments(ctx, call))


def _is_ref_call(ctx: ModuleContext, call: cst.Call) -> bool:
    func = call.func
    target = func.value if isinstance(func, cst.Attribute) and not ctx.has_role(func, "ref_model") else func
    return ctx.has_role(target, "ref_model")


def _detached_text(ctx: ModuleContext, expr: cst.BaseExpression) -> bool:
    text = ctx.module.code_for_node(expr)
    return ".detach()" in text or ".item()" in text or ".tolist()" in text
