"""Roles of values from how they are used: targets, old log-probs, losses that are backpropagated.

A name gives a *hint* of a role (``old_logp``, ``advantages``); these queries supply the structural side:
``exp(cur - y)`` makes ``y`` the old log-probs of a ratio; a value that is itself ``.backward()``-ed is a loss,
whatever its name; the value a model's ``forward`` returns is that model's output. Rules combine a hint with
a structural fact, and a structural fact that contradicts the hint wins.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import libcst as cst

from rlguard.lint.analysis import semantics as S
from rlguard.lint.analysis.index import Def, dotted_name, key_of, last_name, simple_string_value

if TYPE_CHECKING:
    from rlguard.lint.analysis import Analysis

TARGET_ROLES = ("old_logp", "ref_logp", "advantages", "returns")
# Short names that play these roles in RL code but mean other things elsewhere (``ret = fn(module)``).
TOO_GENERIC = frozenset({"ret", "rets", "targets", "A", "r", "target", "returns_", "out", "res", "result"})
# Pass-through calls between a value and the `.backward()` that makes it a loss.
REDUCING = frozenset({"sum", "mean", "nansum", "nanmean", "float", "double", "to", "squeeze", "contiguous", "clone",
                      "view", "reshape", "flatten", "masked_select", "abs", "pow"})


def hinted_role(a: "Analysis", target: cst.BaseExpression, roles=TARGET_ROLES) -> str | None:
    """The first of ``roles`` that ``target``'s own name plays (never a dict key or a too generic name)."""
    name = dotted_name(target)
    if name is None:
        return None
    bare = name.rsplit(".", 1)[-1]
    if bare in TOO_GENERIC:
        return None
    for role in roles:
        if a.names.is_role(bare, role):
            return role
    return None


def names_along(a: "Analysis", expr: cst.BaseExpression, depth: int = 6) -> list[str]:
    """The names a value is known by along its chain of single definitions (``m = batch["action_mask"]; keep = m``
    -> ``keep``, ``m``, ``action_mask``), shape- and dtype-keeping methods looked through: hints for a role."""
    out: list[str] = []
    for _ in range(depth):
        while isinstance(expr, cst.Call) and a.method(expr) in REDUCING | {"bool", "long", "int", "detach", "cpu",
                                                                          "cuda", "unsqueeze", "expand_as"}:
            expr = S.receiver(expr)
        while isinstance(expr, cst.Subscript) and key_of(expr) is None:
            expr = expr.value
        key = key_of(expr)
        if key is None:
            break
        out.append(last_name(key))
        defs = a.flow.reaching(key, expr)
        if len(defs) != 1 or defs[0].kind != "assign" or defs[0].value is None or defs[0].element is not None:
            break
        expr = defs[0].value
    return out


# ----- backward ---------------------------------------------------------------------------------------------
def backward_calls(a: "Analysis") -> list[cst.Call]:
    """``x.backward()``, ``accelerator.backward(x)``, ``self.manual_backward(x)``, ``scaler.scale(x).backward()``,
    and an optimizer's ``step(loss)``: torch's ``Optimizer.step`` takes only a closure, so an optimizer stepped
    with a value is a wrapper that backpropagates it and steps (the training loops read it so too)."""
    def build(an):
        found = [c for c in an.nodes(cst.Call) if S.method_name(c) in S.BACKWARD_METHODS]
        stepped = [c for c in an.nodes(cst.Call) if S.method_name(c) == "step" and c.args and S.receiver(c) is not None]
        if stepped:
            from rlguard.lint.analysis.loops import steps_a_value, training

            optimizers = training(an)
            found += [c for c in stepped if steps_a_value(an, c) and optimizers.is_optimizer(S.receiver(c))]
        return found
    return a.facet("backward_calls", build)


def backward_loss(call: cst.Call, a: "Analysis | None" = None) -> cst.BaseExpression | None:
    """The loss a backward call propagates: ``loss.backward()`` -> loss; ``accelerator.backward(loss)`` -> loss;
    ``scaler.scale(loss).backward()`` -> loss. A positional argument is the loss when the receiver is an engine:
    by its name, or (with ``a``) by how it is built, ``self.acc = Accelerator(...)``, whatever it is called (for
    a tensor, the positional argument of ``backward`` is the gradient of a vector-Jacobian product)."""
    recv = S.receiver(call)
    if recv is None:
        return None
    if S.method_name(call) == "step":  # an optimizer wrapper's step(loss) (see backward_calls)
        return call.args[0].value if call.args and call.args[0].keyword is None else None
    loss = recv
    if call.args and call.args[0].keyword is None:
        name = dotted_name(recv) or ""
        if S.ENGINE_NAME.fullmatch(name.rsplit(".", 1)[-1]) or name in ("self", "torch.autograd") or \
                name.endswith(("model", "module", "engine", "accelerator", "strategy", "fabric")) or \
                (a is not None and (_built_as_engine(a, recv) or name in module_like_keys(a))):
            loss = call.args[0].value
    while isinstance(loss, cst.Call) and S.method_name(loss) == "scale" and loss.args:
        loss = loss.args[0].value
    return loss


# Methods of a module or a training engine, never of a tensor: an object that has one called on it is not a tensor,
# so the positional argument of its `backward` is the loss (DeepSpeed's `engine.backward(loss); engine.step()`).
_MODULE_ONLY_METHODS = frozenset({"step", "zero_grad", "parameters", "named_parameters", "train", "eval",
                                  "save_checkpoint", "load_checkpoint", "state_dict", "load_state_dict", "generate",
                                  "gradient_checkpointing_enable"})


def module_like_keys(a: "Analysis") -> frozenset:
    """The dotted names this module treats as modules or engines by what it calls on them: a method only a module
    or an engine has (``.step()``, ``.parameters()``, ``.eval()``...), or the object itself called as a model
    (``self.actor(ids)``). Whatever the names are."""
    def build(an):
        found = set()
        for call in an.nodes(cst.Call):
            func = call.func
            if isinstance(func, cst.Attribute):
                if func.attr.value in _MODULE_ONLY_METHODS:
                    key = dotted_name(func.value)
                    if key is not None:
                        found.add(key)
                key = dotted_name(func)
                if key is not None and isinstance(func.value, cst.Name) and func.value.value == "self":
                    found.add(key)  # `self.actor(ids)`: an attribute that is called is no tensor
        return frozenset(found)
    return a.facet("module_like_keys", build)


def _built_as_engine(a: "Analysis", expr: cst.BaseExpression, depth: int = 3) -> bool:
    """Whether every binding of ``expr`` is a training engine by its interface: it constructs ``Accelerator(...)``,
    ``Fabric(...)``, a ``*Engine``/``*Strategy`` class or unpacks ``deepspeed.initialize(...)[0]`` (the class's
    name, not the variable's), or it is a parameter so named (``def __init__(self, accelerator)``)."""
    key = key_of(expr)
    defs = a.flow.reaching(key, expr) if key is not None and depth > 0 else []
    if not defs:
        return False
    for d in defs:
        if d.kind == "param":
            if not S.ENGINE_NAME.fullmatch(d.key):
                return False
            continue
        value = d.value if d.kind == "assign" else None
        if isinstance(value, (cst.Name, cst.Attribute)) and d.element is None:
            if not _built_as_engine(a, value, depth - 1):
                return False
            continue
        if not isinstance(value, cst.Call):
            return False
        called = (dotted_name(value.func) or "").rsplit(".", 1)[-1]
        if not (S.ENGINE_NAME.fullmatch(called) or called == "initialize" and d.element == 0):
            return False
    return True


def is_backpropagated(a: "Analysis", d: Def) -> bool:
    """Whether the value bound by ``d`` is itself what a ``.backward()`` propagates (through reductions):
    ``ref_logp.sum().backward()`` makes ``ref_logp`` a loss, not a target."""
    for call in backward_calls(a):
        loss = backward_loss(call, a)
        while isinstance(loss, cst.Call) and S.method_name(loss) in REDUCING:
            loss = S.receiver(loss)
        key = key_of(loss) if loss is not None else None
        if key == d.key and any(r is d for r in a.flow.reaching(key, loss)):
            return True
    return False


MODEL_OWN_METHODS = frozenset({"forward", "__call__", "generate", "sample", "_generate", "decode"})


def in_model_code(a: "Analysis", d: Def) -> bool:
    """Whether ``d`` sits in a model's own forward or generation code (a method of a class that defines
    ``forward``): its values are the model's internals and outputs, not a trainer's targets."""
    func = a.index.function_scope(d.stmt).node
    if not isinstance(func, cst.FunctionDef) or func.name.value not in MODEL_OWN_METHODS:
        return False
    cls = a.enclosing_class(func)
    if cls is not None and func.name.value != "forward":
        return a.method_of(cls, "forward") is not None
    return returned_by_forward(a, d) or (cls is not None and func.name.value == "forward")


def returned_by_forward(a: "Analysis", d: Def) -> bool:
    """Whether ``d`` binds what a ``forward``/``__call__`` method returns: a model's output, not a target."""
    func = a.index.function_scope(d.stmt).node
    if not isinstance(func, cst.FunctionDef) or func.name.value not in ("forward", "__call__"):
        return False
    for ret in a.index.scopes[id(func)].returns:
        value = ret.value
        if value is None:
            continue
        elements = [el.value for el in value.elements] if isinstance(value, (cst.Tuple, cst.List)) else [value]
        for el in elements:
            key = key_of(el)
            if key == d.key and any(r is d for r in a.flow.reaching(key, el)):
                return True
    return False


# ----- old log-probs by their use ------------------------------------------------------------------------------
def ratio_terms(a: "Analysis") -> list[tuple[cst.Call, cst.BaseExpression, cst.BaseExpression]]:
    """``exp(cur - y)`` calls (``torch.exp``, ``.exp()``): (call, ``cur``, ``y``)."""
    def build(an):
        found = []
        for call in an.nodes(cst.Call):
            exponent = None
            if S.method_name(call) == "exp" and not call.args:
                exponent = S.receiver(call)
            elif an.call_name(call) in ("torch.exp", "math.exp", "numpy.exp") and call.args:
                exponent = call.args[0].value
            difference = _log_difference(an, exponent) if exponent is not None else None
            if difference is not None:
                found.append((call, difference.left, difference.right))
        return found
    return a.facet("ratio_terms", build)


# what a log-ratio goes through on its way into exp: a clamp against overflow, a cast
_LOG_RATIO_KEEPING = frozenset({"clamp", "clip", "float", "double", "to", "detach"})


def _log_difference(a: "Analysis", expr: cst.BaseExpression) -> cst.BinaryOperation | None:
    """The subtraction ``cur - y`` an exponent is, directly or through plain assignments and clamps/casts
    (``log_ratio = logp - old; log_ratio = log_ratio.clamp(-20, 20); ratio = log_ratio.exp()``)."""
    for _ in range(6):
        if isinstance(expr, cst.BinaryOperation) and isinstance(expr.operator, cst.Subtract):
            return expr
        if isinstance(expr, cst.BinaryOperation) and isinstance(expr.operator, cst.Multiply):
            # a masked log-ratio, `(logp - old) * mask`: the tensor factor that is no difference is the mask
            sides = [side for side in (expr.left, expr.right) if key_of(side) is not None]
            if len(sides) != 1:
                return None
            expr = expr.right if sides[0] is expr.left else expr.left
            continue
        if isinstance(expr, cst.Call):
            if a.method(expr) in _LOG_RATIO_KEEPING and S.receiver(expr) is not None:
                expr = S.receiver(expr)
                continue
            if a.call_name(expr) in ("torch.clamp", "torch.clip") and expr.args:
                expr = expr.args[0].value
                continue
            return None
        value = _single_value(a, expr)
        if value is expr:
            return None
        expr = value
    return None


def old_logp_arguments(a: "Analysis") -> list[tuple[cst.BaseExpression, cst.Call]]:
    """Expressions passed where old log-probs are expected: an ``old_logp``-named keyword, or positionally to a
    same-module function's ``old_logp``-named parameter."""
    return [(value, call) for value, name, call in handed_values(a) if a.names.is_role(name, "old_logp")]


def handed_values(a: "Analysis") -> list[tuple[cst.BaseExpression, str, cst.Call]]:
    """(value, interface name, call) for every argument of a call: its keyword, or the name of the same-module
    parameter it binds positionally."""
    def build(an):
        from rlguard.lint.analysis.values import bind_arguments

        found = []
        for call in an.nodes(cst.Call):
            for arg in call.args:
                if arg.keyword is not None:
                    found.append((arg.value, arg.keyword.value, call))
            func = an.callee(call)
            if func is not None:
                for param, (value, _frame) in bind_arguments(func, call, None):
                    if not any(arg.keyword is not None and arg.keyword.value == param for arg in call.args):
                        found.append((value, param, call))
        return found
    return a.facet("handed_values", build)


# ----- targets by their use --------------------------------------------------------------------------------------
def target_role_by_use(a: "Analysis", d: Def) -> str | None:
    """The target role (:data:`TARGET_ROLES`) the value bound by ``d`` plays by how the module uses it, never by
    the name it is bound to: the weight of both sides of a PPO clip (advantages), or a value passed to a keyword
    or a same-module parameter, or stored under a string key, that names the role (``old_logp=x``,
    ``batch["returns"] = x``): the interface a value meets, which renaming its variable does not change; the
    ``y`` of ``exp(cur - y)`` when that ratio is clipped in a PPO clip (old log-probs). (The ``y`` of a bare
    ``exp(cur - y)`` is no evidence: the k3 KL estimator ``exp(ref - logp)`` puts the live log-probs there.)"""
    found = a.cache.setdefault("target_role_by_use", {})
    if id(d) in found:
        return found[id(d)]
    role = "advantages" if _reaches(a, d, _clip_weight_reads_by_key(a).get(d.key, ())) else None
    if role is None and _reaches(a, d, _clipped_ratio_olds(a).get(d.key, ())):
        role = "old_logp"
    if role is None and critic_advantage(a, d):
        role = "advantages"
    if role is None:
        def names_a_role(name: str) -> bool:
            return name not in TOO_GENERIC and any(a.names.is_role(name, r) for r in TARGET_ROLES)

        for name in interface_names(a, d, names_a_role):
            role = next((r for r in TARGET_ROLES if name not in TOO_GENERIC and a.names.is_role(name, r)), None)
            if role is not None:
                break
    found[id(d)] = role
    return role


# Reads through which a value keeps its rows and entries (a factor of a product is still the value).
_KEEPING = frozenset({"detach", "unsqueeze", "squeeze", "view", "reshape", "float", "to", "expand_as", "flatten",
                      "contiguous"})
REWARD_ROLES = ("returns", "rewards")


def critic_advantage(a: "Analysis", d: Def) -> bool:
    """``x = R - V``, returns or rewards (by the name of what is read: an attribute or key of another object, a
    parameter) minus the output of a model forward (the critic's value: no log-probs, logits or entropy), read
    as a factor of a product with the policy's log-probs (REINFORCE and A2C's ``-(A * logp)``): the advantages
    by how they are computed and used, whatever ``x`` is called."""
    value = d.value if d.kind == "assign" and d.element is None else None
    if not (isinstance(value, cst.BinaryOperation) and isinstance(value.operator, cst.Subtract)):
        return False
    if not (reward_like(a, value.left) or bootstrapped_return(a, value.left)) or not critic_output(a, value.right):
        return False
    from rlguard.lint.analysis.uses import reads_of

    return any(weighs_logprobs(a, read) for read in reads_of(a, d))


def _kept(a: "Analysis", expr: cst.BaseExpression, collected: bool = False) -> cst.BaseExpression:
    """``expr`` through the reads that keep its rows and entries: row selections (``x[:-1]``), :data:`_KEEPING`
    methods, and with ``collected`` a list made a tensor (``torch.stack(xs)``: the list's elements)."""
    while True:
        if isinstance(expr, cst.Subscript) and key_of(expr) is None:
            expr = expr.value
        elif isinstance(expr, cst.Call) and a.method(expr) in _KEEPING and S.receiver(expr) is not None:
            expr = S.receiver(expr)
        elif collected and isinstance(expr, cst.Call) and a.call_name(expr) in _COLLECTING and expr.args:
            expr = expr.args[0].value
        else:
            return expr


def reward_like(a: "Analysis", expr: cst.BaseExpression) -> bool:
    """Returns or rewards by the name of the value read (``rollouts.returns[:-1]``, ``batch["rewards"]``)."""
    expr = _kept(a, expr)
    key = key_of(expr)
    if key is None:
        return False
    name = last_name(key)
    return name not in TOO_GENERIC and any(a.names.is_role(name, r) for r in REWARD_ROLES) and \
        not a.names.is_role(name, "mask")


def bootstrapped_return(a: "Analysis", expr: cst.BaseExpression, depth: int = 6) -> bool:
    """A return by its formula: a sum with a discounted term, ``r + gamma * v_next`` (a TD target) or ``r + gamma *
    R`` (a discounted return), the discount a literal in (0, 1), a name every binding of which is one, or a
    parameter or settings field named for it (``gamma``, ``discount``: the interface), through plain assignments."""
    expr = _kept(a, expr, collected=True)  # torch.stack(returns[::-1]).float(): the list's elements
    if isinstance(expr, cst.BinaryOperation) and isinstance(expr.operator, cst.Add):
        return any(_discounted(a, side) for side in (expr.left, expr.right))
    if depth <= 0:
        return False
    if isinstance(expr, cst.Call):
        # a function of this module that returns discounted returns (a `compute_returns` helper)
        func = a.callee(expr)
        returns = [r.value for r in a.index.scopes[id(func)].returns if r.value is not None] if func else []
        return bool(returns) and all(bootstrapped_return(a, r, depth - 1) for r in returns)
    key = key_of(expr) if isinstance(expr, cst.Name) else None
    if key is None:
        return False
    defs = a.flow.reaching(key, expr)
    if not defs or not all(d.kind == "assign" and d.element is None and d.value is not None for d in defs):
        return False
    from rlguard.lint.analysis.values import list_growth

    for d in defs:
        # a list filled in a loop (`returns.insert(0, R)`, `targets.append(G)`): its elements
        added = list_growth(a, d)
        if not (all(bootstrapped_return(a, e, depth - 1) for e in added) if added else
                bootstrapped_return(a, d.value, depth - 1)):
            return False
    return True


_COLLECTING = frozenset({"torch.stack", "torch.tensor", "torch.as_tensor", "torch.cat", "torch.FloatTensor",
                         "numpy.array", "numpy.asarray", "numpy.stack"})


_DISCOUNT_NAME = re.compile(r"(?i)gamma|discount(_factor)?")


def _discounted(a: "Analysis", expr: cst.BaseExpression) -> bool:
    """``gamma * x`` (either order, possibly times a done mask): a factor that is a discount."""
    if not (isinstance(expr, cst.BinaryOperation) and isinstance(expr.operator, cst.Multiply)):
        return False
    from rlguard.lint.analysis.signs import factors

    return any(_is_discount(a, f) for f in factors(expr)[1])


def _is_discount(a: "Analysis", expr: cst.BaseExpression, depth: int = 2) -> bool:
    number = S.number_value(expr)
    if number is not None:
        return 0.0 < number < 1.0
    key = key_of(expr) if isinstance(expr, (cst.Name, cst.Attribute)) else None
    if key is None or depth <= 0:
        return False
    defs = a.flow.reaching(key, expr)
    if not defs:
        # a field of a settings object or a parameter read here and bound elsewhere: its name is the interface
        return isinstance(expr, cst.Attribute) and bool(_DISCOUNT_NAME.fullmatch(expr.attr.value))
    for d in defs:
        if d.kind == "param":
            if not _DISCOUNT_NAME.fullmatch(d.key) and not (d.value is not None and _is_discount(a, d.value, 0)):
                return False
        elif not (d.kind == "assign" and d.element is None and d.value is not None and
                  _is_discount(a, d.value, depth - 1)):
            return False
    return True


def critic_output(a: "Analysis", expr: cst.BaseExpression, frame=None) -> bool:
    """A model forward's output as it came out (a value head's estimate): no log-probs, logits or entropy made of
    it, not a reward model's or the reference's."""
    from rlguard.lint.analysis.provenance import FORWARD, provenance

    origins = provenance(a).value(expr, frame)
    forwards = [o for o in origins if o.kind == FORWARD]
    return bool(forwards) and len(forwards) == len(origins) and all(
        o.what == "output" and (o.model is None or o.model.role not in ("reward", "reference")) for o in forwards)


def weighs_logprobs(a: "Analysis", read: cst.BaseExpression) -> bool:
    """Whether ``read`` (through detaches, casts, reshapes and row selections) is a factor of a product with the
    log-probs of a model forward (by their computation)."""
    from rlguard.lint.analysis.provenance import FORWARD, provenance
    from rlguard.lint.analysis.signs import factors

    expr = read
    index = a.index
    while True:
        parent = index.parent_of(expr)
        if isinstance(parent, cst.Subscript) and parent.value is expr:
            expr = parent
            continue
        if isinstance(parent, cst.Attribute) and parent.value is expr:
            call = index.parent_of(parent)
            if isinstance(call, cst.Call) and call.func is parent and parent.attr.value in _KEEPING:
                expr = call
                continue
        break
    top = expr
    while True:
        parent = index.parent_of(top)
        if isinstance(parent, cst.BinaryOperation) and isinstance(parent.operator, cst.Multiply):
            top = parent
            continue
        break
    if top is expr:
        return False
    _, facs = factors(top)
    if not any(f is expr for f in facs):
        return False
    for f in facs:
        if f is expr:
            continue
        forwards = [o for o in provenance(a).value(f) if o.kind == FORWARD]
        if forwards and all(o.what == "logprobs" for o in forwards):
            return True
    return False


def interface_names(a: "Analysis", d: Def, wanted=None) -> list[str]:
    """The interface names the value bound by ``d`` is handed to: keywords of calls (``rewards=x``), parameters
    of same-module functions it is passed to positionally, string keys it is stored under (``batch["x"] = x``),
    each for a read that ``d`` reaches. A role read from them survives renaming the variable. ``wanted``, a test
    on the name, keeps only the names a caller asks about (and spares the reaching query for the others)."""
    return [name for read, name in _interface_reads_by_key(a).get(d.key, ())
            if (wanted is None or wanted(name)) and any(r is d for r in a.flow.reaching(d.key, read))]


def interface_calls(a: "Analysis", d: Def, wanted) -> list[cst.Call]:
    """The calls that receive the value bound by ``d`` under an interface name ``wanted`` accepts (a keyword, or
    a same-module parameter it binds positionally), for a read that ``d`` reaches: what the callee is handed
    beside it is read against it (``Trainer(model=m, ref_model=r)``)."""
    by_key = _by_flow_key(a, "handed_values_by_key", handed_values, lambda item: item[0])
    return [call for value, name, call in by_key.get(d.key, ())
            if wanted(name) and any(r is d for r in a.flow.reaching(d.key, value))]


def _reaches(a: "Analysis", d: Def, reads) -> bool:
    return any(any(r is d for r in a.flow.reaching(d.key, read)) for read in reads)


def _clip_weight_reads_by_key(a: "Analysis") -> dict[str, list[cst.BaseExpression]]:
    return _by_flow_key(a, "clip_weight_reads_by_key", _clip_weight_reads, lambda read: read)


def _interface_reads_by_key(a: "Analysis") -> dict[str, list[tuple[cst.BaseExpression, str]]]:
    return _by_flow_key(a, "interface_reads_by_key", _interface_reads, lambda item: item[0])


def _by_flow_key(a: "Analysis", facet: str, items, read_of) -> dict:
    """A per-module list of reads (``items(a)``) grouped by the flow key of each read (``read_of(item)``): a
    target asks about its own key only, not every read of the module."""
    def build(an):
        grouped: dict = {}
        for item in items(an):
            grouped.setdefault(key_of(read_of(item)), []).append(item)
        return grouped
    return a.facet(facet, build)


def _interface_reads(a: "Analysis") -> list[tuple[cst.BaseExpression, str]]:
    def build(an):
        out: list[tuple[cst.BaseExpression, str]] = []

        def add(expr, name):
            while isinstance(expr, cst.Call) and S.method_name(expr) in REDUCING | {"unsqueeze"}:
                expr = S.receiver(expr)
            if expr is not None and key_of(expr) is not None and isinstance(name, str):
                out.append((expr, name))

        for value, name, _call in handed_values(an):
            add(value, name)
        for stmt in an.nodes(cst.Assign):
            for target in stmt.targets:
                t = target.target
                if isinstance(t, cst.Subscript) and len(t.slice) == 1 and isinstance(t.slice[0].slice, cst.Index):
                    key = t.slice[0].slice.value
                    if isinstance(key, cst.SimpleString):
                        add(stmt.value, simple_string_value(key))
        for literal in an.nodes(cst.Dict):
            for element in literal.elements:
                if isinstance(element, cst.DictElement) and isinstance(element.key, cst.SimpleString):
                    add(element.value, simple_string_value(element.key))
        return out
    return a.facet("interface_reads", build)


def _clip_weight_reads(a: "Analysis") -> list[cst.BaseExpression]:
    def build(an):
        out = []
        weights = clip_weights(an)
        if not weights:
            return out
        weight_keys = {key for key, _ in weights}
        for node in an.nodes(cst.Name, cst.Attribute):
            key = key_of(node)
            if key in weight_keys and (key, frozenset(id(x) for x in an.flow.reaching(key, node))) in weights:
                out.append(node)
        return out
    return a.facet("clip_weight_reads", build)


# ----- advantages by their use ----------------------------------------------------------------------------------
def _ppo_clips(a: "Analysis") -> list[tuple[cst.BaseExpression, cst.BaseExpression]]:
    """Every PPO clip of the module, ``min/max(r * x, clamp(r, lo, hi) * x)`` (each side possibly a name with one
    plain definition, either sign): (the read of ``x``, the ratio ``r``); found once per module, for the clip
    weights and the clipped ratios' old sides."""
    return a.facet("ppo_clips", _find_ppo_clips)


def _find_ppo_clips(an: "Analysis") -> list[tuple[cst.BaseExpression, cst.BaseExpression]]:
    from rlguard.lint.analysis.signs import factors, min_max_kind

    found = []
    for call in an.nodes(cst.Call):
        if min_max_kind(an, call) is None:
            continue
        sides = []
        for arg in call.args:
            sign, facs = factors(_single_value(an, arg.value))
            sides.append(facs)
        if len(sides) != 2 or len(sides[0]) != 2 or len(sides[1]) != 2:
            continue
        for x_side, other in ((0, 1), (1, 0)):
            left, right = sides[x_side], sides[other]
            for i in (0, 1):
                x, r = left[i], left[1 - i]
                for j in (0, 1):
                    if not _same_read(an, x, right[j]):
                        continue
                    inner = _clamped(an, right[1 - j]) or _clamped(an, _single_value(an, right[1 - j]))
                    read = _value_read(an, x)  # `ratio * adv.unsqueeze(1)` weighs by adv
                    if inner is not None and _same_read(an, inner, r) and key_of(read) is not None:
                        found.append((read, r))
    return found


def clip_weights(a: "Analysis") -> frozenset:
    """The values that weigh both sides of a PPO clip: in ``min/max(r * x, clamp(r, lo, hi) * x)``, ``x`` is the
    advantage, whatever it is called, and ``r`` the ratio. Answers (key, reaching definitions) pairs of ``x``'s
    reads."""
    return a.facet("clip_weights", lambda an: frozenset(_read_id(an, read) for read, _ in _ppo_clips(an)))


def _clipped_ratio_olds(a: "Analysis") -> dict[str, list[cst.BaseExpression]]:
    """By flow key, the reads ``y`` of ``exp(cur - y)`` when that exponential is the ratio of a PPO clip: the old
    log-probs by use (a clipped ratio is no k3 KL estimate, whose ``exp(ref - logp)`` puts the live log-probs
    there)."""
    def build(an):
        found: dict[str, list[cst.BaseExpression]] = {}
        exps = {id(call): old for call, _, old in ratio_terms(an)}
        for _, r in _ppo_clips(an):
            value = _single_value(an, r)
            old = exps.get(id(value))
            if old is None:
                continue
            read = _value_read(an, old)
            if key_of(read) is not None:
                found.setdefault(key_of(read), []).append(read)
        return found
    return a.facet("clipped_ratio_olds", build)


def is_clip_weight(a: "Analysis", expr: cst.BaseExpression) -> bool:
    """Whether ``expr`` reads a value that weighs both sides of a PPO clip in this module."""
    return key_of(expr) is not None and _read_id(a, expr) in clip_weights(a)


def _single_value(a: "Analysis", expr: cst.BaseExpression) -> cst.BaseExpression:
    """A name followed to the value of its one plain assignment (up to three steps), else the expression itself."""
    for _ in range(3):
        key = key_of(expr)
        defs = a.flow.reaching(key, expr) if key is not None else []
        if len(defs) != 1 or defs[0].kind != "assign" or defs[0].element is not None or defs[0].value is None:
            return expr
        expr = defs[0].value
    return expr


def _read_id(a: "Analysis", expr: cst.BaseExpression) -> tuple:
    key = key_of(expr)
    return key, frozenset(id(d) for d in a.flow.reaching(key, expr))


def _value_read(a: "Analysis", expr: cst.BaseExpression) -> cst.BaseExpression:
    """The value a broadcast, cast or row selection reads (``adv.unsqueeze(1)``, ``adv.view(-1, 1).float()``,
    ``adv[idx]`` -> ``adv``; a string key, ``batch["adv"]``, is a value of its own)."""
    while True:
        if isinstance(expr, cst.Call) and a.method(expr) in ("unsqueeze", "detach", "float", "view", "reshape") and \
                S.receiver(expr) is not None:
            expr = S.receiver(expr)
        elif isinstance(expr, cst.Subscript) and key_of(expr) is None and key_of(expr.value) is not None:
            expr = expr.value
        else:
            return expr


def _same_read(a: "Analysis", x: cst.BaseExpression, y: cst.BaseExpression) -> bool:
    x, y = _value_read(a, x), _value_read(a, y)
    if key_of(x) is None or key_of(x) != key_of(y):
        return False
    return _read_id(a, x) == _read_id(a, y)


def _clamped(a: "Analysis", expr: cst.BaseExpression) -> cst.BaseExpression | None:
    """``r`` of ``r.clamp(lo, hi)`` / ``torch.clamp(r, lo, hi)`` (also ``clip``), else None."""
    if isinstance(expr, cst.Call):
        if a.method(expr) in ("clamp", "clip") and S.receiver(expr) is not None:
            return S.receiver(expr)
        if a.call_name(expr) in ("torch.clamp", "torch.clip") and expr.args:
            return expr.args[0].value
    return None


# ----- masks by their use ---------------------------------------------------------------------------------------
def is_mask_by_use(a: "Analysis", expr: cst.BaseExpression) -> bool:
    """``w`` in ``(v * w).sum(...) / w.sum(...)`` (the factor that also counts the denominator, optionally clamped):
    a 0/1 mask or a non-negative weight by its use, whatever it is called."""
    selected = expr
    while isinstance(selected, cst.Subscript) and key_of(selected) is None:
        selected = selected.value  # `w[idx]`: a row selection of the mask, counted by the same selection
    key = key_of(selected)
    if key is None:
        return False
    index = a.index
    node, parent = expr, index.parent_of(expr)
    while isinstance(parent, cst.BinaryOperation) and isinstance(parent.operator, cst.Multiply):
        node, parent = parent, index.parent_of(parent)
    if node is expr or not isinstance(parent, cst.Attribute) or parent.attr.value not in ("sum", "nansum"):
        return False
    total = index.parent_of(parent)
    if not isinstance(total, cst.Call):
        return False
    division = index.parent_of(total)
    while isinstance(division, cst.BinaryOperation) and isinstance(division.operator, cst.Multiply):
        total, division = division, index.parent_of(division)  # c * (v * w).sum() / w.sum()
    if not isinstance(division, cst.BinaryOperation) or not isinstance(division.operator, cst.Divide) or \
            division.left is not total:
        return False
    count = division.right
    while isinstance(count, cst.Call) and a.method(count) in ("clamp", "clamp_min", "clip", "float", "item"):
        count = S.receiver(count)
    if not (isinstance(count, cst.Call) and a.method(count) == "sum"):
        return False
    counted = S.receiver(count)
    if selected is not expr:
        if a.code(counted) != a.code(expr):
            return False
        while isinstance(counted, cst.Subscript) and key_of(counted) is None:
            counted = counted.value
    return key_of(counted) == key and {id(d) for d in a.flow.reaching(key, counted)} == {
        id(d) for d in a.flow.reaching(key, selected)}
