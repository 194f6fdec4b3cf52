"""Train and eval mode: the model copies a module builds for scoring, and whether it ever sets their mode.

An ``nn.Module`` starts in train mode, and ``copy.deepcopy`` copies the mode of its source (a trained policy is
in train mode); ``from_pretrained`` returns a model in eval mode. A model used only to score (a frozen reference,
an old policy, a target network run under ``torch.no_grad()``) keeps its dropout on until something calls
``.eval()`` (or ``.train(False)``) on it. ``requires_grad_(False)`` freezes the weights and leaves the mode alone.

:func:`scoring_copies` lists the models a module builds by ``copy.deepcopy(model)``, or by a class constructor
whose weights are then loaded (``Net(cfg)`` and ``net.load_state_dict(...)``), that are visibly used to score (they
are frozen, or run a forward with autograd off) and are not trained (no optimizer gets their parameters). For each
it says whether the module sets its mode (:func:`mode_is_set`): a method of it named for a mode (``eval``,
``train(...)`` with anything but a literal ``True``, ``set_training_mode``, ``eval_mode``...), on the object, on
an alias, or in a same-module helper it is handed to; and whether the object escapes to code out of view (handed
to a call the linter cannot read, stored in a container or on another object) that may set it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

import libcst as cst

from rlguard.lint.analysis import semantics as S
from rlguard.lint.analysis.grad import call_sites, grad_context
from rlguard.lint.analysis.index import Def, dotted_name, key_of, last_name, params_of
from rlguard.lint.analysis.provenance import ModelRef, models
from rlguard.lint.analysis.uses import def_consumers

if TYPE_CHECKING:
    from rlguard.lint.analysis import Analysis

# Methods that set (or may set) a module's mode.
MODE_METHOD = re.compile(r"(?i)eval|train|\w*(training_mode|train_mode|eval_mode|set_mode|set_train\w*|"
                         r"set_eval\w*|inference_mode)\w*")
# Calls that take a model and leave its mode alone (and do not hand it on).
NEUTRAL_CALLS = frozenset({"isinstance", "print", "len", "id", "type", "getattr", "hasattr", "str", "repr", "zip",
                           "enumerate", "list", "tuple", "callable", "vars", "dir", "format"})
# Layers without dropout or batch statistics: a same-module class built only of these scores the same in any mode.
MODE_FREE_LAYERS = frozenset({"Linear", "ReLU", "Tanh", "Sigmoid", "GELU", "SiLU", "ELU", "LeakyReLU", "Softmax",
                              "LogSoftmax", "Conv1d", "Conv2d", "Conv3d", "ConvTranspose2d", "Embedding", "LayerNorm",
                              "RMSNorm", "Sequential", "ModuleList", "ModuleDict", "Identity", "Flatten",
                              "Unflatten", "MaxPool2d", "AvgPool2d", "AdaptiveAvgPool2d", "Parameter", "Softplus",
                              "Mish", "Hardtanh", "GLU", "Bilinear", "GRU", "LSTM", "RNN", "GRUCell", "LSTMCell",
                              "Module", "Categorical", "Normal"})
_NOT_MODULES = re.compile(r"(\w+\.)*(\w*(Config|Tokenizer|Optimizer|Dataset|DataLoader|Loader|Scheduler|Trainer|"
                          r"Args|Arguments|Params|Sampler|Buffer|Logger|Writer|Processor)|[A-Z0-9_]+)")
_FROM_PRETRAINED = re.compile(r"(?i)(\w+\.)*from_pretrained")


@dataclass(frozen=True)
class ScoringCopy:
    """A model built for scoring: bound by ``d``, made by ``call`` (``how``: ``deepcopy`` or ``constructor``),
    with object ``roots``; ``evidence`` says how it scores (``frozen`` or ``no_grad``)."""

    d: Def
    call: cst.Call
    how: str
    roots: frozenset
    evidence: str
    objects: frozenset = frozenset()  # the object's roots with their names (what built it)


def _keys(a: "Analysis", expr: cst.BaseExpression) -> frozenset:
    """The identity keys of the object ``expr`` denotes (empty when it is no single known object)."""
    return frozenset(o.key for o in models(a).roots(expr))


def _core(a: "Analysis", value: cst.BaseExpression) -> tuple[cst.BaseExpression, bool]:
    """``deepcopy(m)`` of ``deepcopy(m).to(dev).eval()``, and whether the chain sets the mode."""
    sets = False
    while isinstance(value, cst.Call) and isinstance(value.func, cst.Attribute) and \
            value.func.attr.value in S.SAME_MODULE_METHODS | {"requires_grad_"}:
        if MODE_METHOD.fullmatch(value.func.attr.value) and not _train_true(value):
            sets = True
        value = value.func.value
    return value, sets


def _train_true(call: cst.Call) -> bool:
    """``m.train()`` / ``m.train(True)``: train mode, no eval."""
    if not (isinstance(call.func, cst.Attribute) and call.func.attr.value == "train"):
        return False
    return not call.args or S.literal_bool(call.args[0].value) is True


def scoring_copies(a: "Analysis") -> list[ScoringCopy]:
    def build(an):
        found = []
        model_facts = models(an)
        for stmt in an.nodes(cst.Assign, cst.AnnAssign):
            targets = [t.target for t in stmt.targets] if isinstance(stmt, cst.Assign) else [stmt.target]
            if len(targets) != 1 or stmt.value is None:
                continue
            call, chain_sets = _core(an, stmt.value)
            if chain_sets or not isinstance(call, cst.Call):
                continue
            summary = an.summary_of_call(call)
            if summary is not None and summary.returns_module:
                found += _factory_copies(an, stmt, call, frozenset(summary.returns_module))
                continue
            key = key_of(targets[0])
            if key is None:
                continue
            how = _how(an, call)
            if how is None:
                continue
            d = next((x for x in an.index.stmt_defs.get(id(stmt), ()) if x.key == key), None)
            if d is None:
                continue
            roots = _keys(an, stmt.value)
            if not roots or roots & model_facts.trained_roots():
                continue
            if how == "constructor":
                loaded = _weights_loaded(an, roots)
                if loaded is None:
                    continue
                handed_in = loaded
            else:
                source = _source_mode(an, call)
                if source is None:
                    continue  # the mode of the copied model is not known: it may be in eval mode already
                handed_in = source == "explicit"
            evidence = _scores(an, roots)
            # frozen weights are a scoring copy's; a forward under no_grad alone is one only for a copy of a model
            # handed in (a test comparing two implementations, a target network of a local model, scores too)
            if evidence == "frozen" or (evidence == "no_grad" and handed_in):
                found.append(ScoringCopy(d, call, how, roots, evidence, models(an).roots(stmt.value)))
        return found
    return a.facet("scoring_copies", build)


def _factory_copies(a: "Analysis", stmt, call: cst.Call, positions: frozenset) -> list[ScoringCopy]:
    """The names ``stmt`` binds to what a function of another file of the linted tree returns at ``positions``
    (-1: its whole value, else a tuple element): a module that function builds by a class constructor and loads
    weights into, handed back without a mode (so in train mode); each that scores and is not trained."""
    found = []
    facts = models(a)
    for d in a.index.stmt_defs.get(id(stmt), ()):
        position = -1 if d.element is None else d.element
        if d.kind != "assign" or position not in positions:
            continue
        objs = facts.objs.def_value(d, d.key, stmt, None)
        if not isinstance(objs, frozenset) or not objs:
            continue
        roots = frozenset(o.key for o in objs)
        if roots & facts.trained_roots():
            continue
        evidence = _scores(a, roots)
        if evidence is not None:  # the weights come from out of view: no_grad alone is a scoring forward here
            found.append(ScoringCopy(d, call, "factory", roots, evidence, objs))
    return found


def returned_modules(a: "Analysis", returns: list) -> list[int]:
    """For a function's summary: the positions (-1: the whole value, else a tuple element) at which every return
    hands back a module the function builds by a class constructor and loads weights into, without setting its
    mode or handing it to code that may (so the caller gets it in train mode)."""
    common: set | None = None
    for r in returns:
        value = r.value
        parts = [(i, el.value) for i, el in enumerate(value.elements) if isinstance(el, cst.Element)] \
            if isinstance(value, cst.Tuple) else [(-1, value)]
        here = {pos for pos, expr in parts if _fresh_module(a, expr)}
        common = here if common is None else common & here
    return sorted(common or ())


def _fresh_module(a: "Analysis", expr: cst.BaseExpression) -> bool:
    facts = models(a)
    objs = facts.roots(expr)
    if len(objs) != 1:
        return False
    obj = next(iter(objs))
    call = facts.objs.facet.calls.get(obj.node_id) if obj.kind in ("new", "opaque") else None
    if call is None or _how(a, call) != "constructor" or \
            (dotted_name(call.func) or "").rsplit(".", 1)[-1] in MODE_FREE_LAYERS:
        return False  # `nn.Linear(...)`: a layer without dropout scores the same in any mode
    roots = frozenset({obj.key})
    if _weights_loaded(a, roots) is None or _mode_free_class(a, objs):
        return False
    return not (_mode_set(a, roots) or _escapes(a, roots))


def _how(a: "Analysis", call: cst.Call) -> str | None:
    name = a.call_name(call) or ""
    if name in S.DEEP_COPY and call.args:
        return "deepcopy"
    func = dotted_name(call.func)
    if func is None:
        return None
    last = func.rsplit(".", 1)[-1]
    if not last[:1].isupper() or _NOT_MODULES.fullmatch(last) or a.callee(call) is not None and \
            a.class_named(last) is None:
        return None
    return "constructor"


def _weights_loaded(a: "Analysis", roots: frozenset) -> bool | None:
    """Whether ``load_state_dict`` is called on the object (its weights are another model's): None when it is
    not, True when the weights are those of a model handed in (``other.state_dict()`` of a parameter, an
    attribute, a name bound out of view), False otherwise."""
    loaded = None
    for call in a.nodes(cst.Call):
        if S.method_name(call) == "load_state_dict" and S.receiver(call) is not None and \
                _keys(a, S.receiver(call)) & roots:
            loaded = bool(loaded)
            state = S.argument(call, 0, "state_dict")
            if isinstance(state, cst.Call) and S.method_name(state) == "state_dict" and S.receiver(state) is not None:
                source = models(a).roots(S.receiver(state))
                if source and all(o.kind in ("param", "attr", "global") for o in source):
                    loaded = True
    return loaded


def _source_mode(a: "Analysis", call: cst.Call) -> str | None:
    """Why the model a deep copy copies is in train mode: ``constructed`` (built in view by a class constructor,
    which starts a module in train mode), ``explicit`` (put in train mode by ``.train()`` before the copy, in the
    same function); None when its mode is not known (a model handed in may be in eval mode)."""
    source = S.argument(call, 0, None)
    objs = models(a).roots(source) if source is not None else frozenset()
    if not objs:
        return None
    if all(o.kind in ("new", "opaque") and o.names and o.names[0][:1].isupper() and not _NOT_MODULES.fullmatch(
            o.names[0]) for o in objs):
        return "constructed"
    keys = frozenset(o.key for o in objs)
    func = a.enclosing_function(call)
    order = a.index.order[id(call)]
    for other in a.nodes(cst.Call):
        if _train_true(other) and a.index.order[id(other)] < order and a.enclosing_function(other) is func and \
                S.receiver(other) is not None and _keys(a, S.receiver(other)) & keys:
            return "explicit"
    return None


def _scores(a: "Analysis", roots: frozenset) -> str | None:
    """``frozen`` when the object's weights are frozen, ``no_grad`` when it runs a forward with autograd off."""
    facts = models(a)
    if facts.is_frozen(ModelRef("model", roots)):
        return "frozen"
    grad = grad_context(a)
    for call in a.nodes(cst.Call):
        func = call.func
        target = func.value if isinstance(func, cst.Attribute) and func.attr.value == "forward" else func
        if not isinstance(target, (cst.Name, cst.Attribute)) or (
                isinstance(func, cst.Attribute) and func.attr.value in S.NON_FORWARD_METHODS):
            continue
        if _keys(a, target) & roots and grad.enabled(call) is False:
            return "no_grad"
    return None


def mode_is_set(a: "Analysis", copy: ScoringCopy) -> bool:
    """Whether the module sets the copy's mode, or may (it escapes to code out of view); for a deep copy, also
    whether its source may be in eval mode (built by ``from_pretrained``, or its mode set in the module)."""
    roots = set(copy.roots)
    if copy.how == "deepcopy":
        source = models(a).roots(copy.call.args[0].value)
        if _mode_set(a, frozenset(o.key for o in source)) or any(
                o.kind == "new" and o.names and _FROM_PRETRAINED.fullmatch(o.names[0]) for o in source):
            return True
        if _mode_free_class(a, source):
            return True
    elif _mode_free_class(a, copy.objects):
        return True
    # the function that builds it may hand it back: its callers' results are the same object
    func = a.enclosing_function(copy.d.stmt)
    if func is not None and any(u.kind == "return" for u in def_consumers(a, copy.d)):
        for site in call_sites(a, func):
            roots |= _keys(a, site)
    frozen_roots = frozenset(roots)
    return _mode_set(a, frozen_roots) or _escapes(a, frozen_roots)


def _mode_set(a: "Analysis", roots: frozenset) -> bool:
    if not roots:
        return False
    facts = models(a)
    for call in a.nodes(cst.Call):
        method = S.method_name(call)
        if method is None or not MODE_METHOD.fullmatch(method) or _train_true(call):
            continue  # `m.train()` puts it in train mode: no eval
        recv = S.receiver(call)
        if recv is not None and _keys(a, recv) & roots:
            return True
    return False


def _escapes(a: "Analysis", roots: frozenset, depth: int = 2) -> bool:
    """Whether an object with ``roots`` is handed to code that may set its mode: a call out of view, a helper of
    the module that sets a mode on (or hands on) its parameter, a container or another object's attribute."""
    facts = models(a)
    for call in a.nodes(cst.Call):
        for arg in call.args:
            value = arg.value
            if not isinstance(value, (cst.Name, cst.Attribute, cst.Subscript)) or not _keys(a, value) & roots:
                continue
            if _is_own_forward(a, call, roots):
                continue
            name = (a.call_name(call) or "").rsplit(".", 1)[-1]
            if name in NEUTRAL_CALLS or (a.call_name(call) or "") in S.DEEP_COPY:
                continue
            callee = a.callee(call)
            if callee is None or depth <= 0 or _helper_sets(a, callee, call, arg, depth):
                return True
    for stmt in a.nodes(cst.Assign):
        value = stmt.value
        if not isinstance(value, (cst.Name, cst.Attribute)) or not _keys(a, value) & roots:
            continue
        for target in stmt.targets:
            key = key_of(target.target)
            if key is None or not key.startswith(("self.", "cls.")) and ("." in key or "[" in key):
                return True  # stored on another object or in a container
    for node in a.nodes(cst.Dict, cst.List, cst.Tuple):
        if isinstance(a.index.parent_of(node), cst.Return):
            continue  # `return policy, ref`: handed back, like a plain return
        elements = [el.value for el in node.elements if isinstance(el, (cst.DictElement, cst.Element))]
        if any(isinstance(v, (cst.Name, cst.Attribute)) and _keys(a, v) & roots for v in elements):
            return True
    return False


def _is_own_forward(a: "Analysis", call: cst.Call, roots: frozenset) -> bool:
    """``ref(ids)``, ``ref.forward(ids)``, ``ref.m(...)``: a call of the object itself or of its methods."""
    func = call.func
    target = func.value if isinstance(func, cst.Attribute) else func
    return isinstance(target, (cst.Name, cst.Attribute)) and bool(_ids(a, target) & roots)


def _helper_sets(a: "Analysis", func: cst.FunctionDef, call: cst.Call, arg: cst.Arg, depth: int) -> bool:
    """Whether a same-module helper sets the mode of the parameter ``arg`` binds, or hands it on."""
    params = [p.name.value for p in params_of(func.params)]
    positional = [x for x in call.args if x.keyword is None and not x.star]
    if isinstance(call.func, cst.Attribute) and params[:1] in (["self"], ["cls"]):
        params = params[1:]
    if arg.keyword is not None:
        name = arg.keyword.value
    elif arg in positional and positional.index(arg) < len(params):
        name = params[positional.index(arg)]
    else:
        return True
    param_defs = [d for d in a.index.scopes[id(func)].defs.get(name, ()) if d.kind == "param"]
    if not param_defs:
        return True
    for use in def_consumers(a, param_defs[0]):
        if use.kind == "method" and MODE_METHOD.fullmatch(str(use.detail)):
            return True
        if use.kind in ("argument", "keyword", "element", "entry", "bound"):
            return True
    return False


def _mode_free_class(a: "Analysis", roots: frozenset) -> bool:
    """Whether the object is an instance of a class of this module built only of layers without dropout or batch
    statistics (then its mode changes nothing)."""
    classes = set()
    for o in roots:
        if o.kind != "new" or not o.names:
            return False
        cls = a.class_named(o.names[0])
        if cls is None:
            return False
        classes.add(id(cls))
        found = cls
    return len(classes) == 1 and _built_of_mode_free_layers(a, found, 3)


def _built_of_mode_free_layers(a: "Analysis", cls: cst.ClassDef, depth: int) -> bool:
    if depth <= 0 or re.search(r"(?i)dropout|batchnorm|batch_norm|drop_path|droppath", a.code(cls)):
        return False
    for base in cls.bases:
        name = (dotted_name(base.value) or "").rsplit(".", 1)[-1]
        inner = a.class_named(name)
        if inner is not None:
            if not _built_of_mode_free_layers(a, inner, depth - 1):
                return False
        elif name not in ("Module", "object"):
            return False
    for call in a.index.descendants(cls, cst.Call):
        name = (dotted_name(call.func) or "").rsplit(".", 1)[-1]
        if not name[:1].isupper():
            continue
        inner = a.class_named(name)
        if inner is not None and inner is not cls:
            if not _built_of_mode_free_layers(a, inner, depth - 1):
                return False
        elif name not in MODE_FREE_LAYERS:
            return False
    return True


__all__ = ["MODE_METHOD", "ScoringCopy", "mode_is_set", "returned_modules", "scoring_copies"]


# ===== a trained model scored in the train mode the module puts it in ==============================================
@dataclass(frozen=True)
class TrainModeScore:
    """A forward of a model the module puts in train mode (``m.train()``) and never in another mode, run with
    autograd off to score (old log-probs, values): ``site`` is where autograd is off (the forward, or the call of
    the helper that runs it), ``forward`` the forward itself, ``train`` a ``.train()`` call on the model."""

    name: str
    site: cst.Call
    forward: cst.Call
    train: cst.Call
    # the module also sets other modes, but every function that does leaves the model in train mode (an evaluation
    # pass that ends with `self.actor.train()  # reset model state`) and none is set for this forward
    resting: bool = False


_EVAL_CALL = re.compile(r"(?i)\w*(eval|inference|freeze|mode)\w*")


def _sets_train(call: cst.Call) -> bool:
    """``m.train()``, ``m.train(True)``, ``m.set_training_mode(True)``: train mode, no other."""
    method = S.method_name(call)
    if method == "train":
        return _train_true(call)
    if method is not None and re.fullmatch(r"(?i)set_(training|train)_mode|train_mode", method):
        return bool(call.args) and S.literal_bool(call.args[0].value) is True
    return False


def train_mode_scores(a: "Analysis") -> list[TrainModeScore]:
    def build(an):
        trains: dict[str, cst.Call] = {}
        others: set = set()
        mode_calls: list[tuple[cst.Call, frozenset]] = []  # every mode call, with the objects it sets
        for call in an.nodes(cst.Call):
            method = S.method_name(call)
            recv = S.receiver(call)
            if method is None or recv is None or not MODE_METHOD.fullmatch(method):
                continue
            keys = _ids(an, recv) | _instance(an, recv)
            mode_calls.append((call, keys))
            if _sets_train(call):
                for k in keys:
                    trains.setdefault(k, call)
            else:
                others |= keys
        if not trains:
            return []
        # the last names the trained objects are reached by (`self.actor.train()` -> `actor`, through aliases the
        # module binds); a call of nothing so named is not asked for its grad context, which costs more
        named = {last_name(k) for call in trains.values() for k in [key_of(S.receiver(call))] if k}
        for d in (d for scope in an.index.scopes.values() for defs in scope.defs.values() for d in defs):
            if d.kind == "assign" and d.value is not None and last_name(key_of(d.value) or "") in named:
                named.add(last_name(d.key))
        grad = grad_context(an)
        found = []
        seen = set()
        for call in an.nodes(cst.Call):
            func = call.func
            target = func.value if isinstance(func, cst.Attribute) and func.attr.value == "forward" else func
            if not isinstance(target, (cst.Name, cst.Attribute)) or (
                    isinstance(func, cst.Attribute) and func.attr.value in S.NON_FORWARD_METHODS):
                continue
            if isinstance(an.index.parent_of(call), cst.Expr) or last_name(key_of(target) or "") not in named:
                continue
            site = _scoring_site(an, grad, call)  # before the identity of the callee, which costs more
            if site is None or id(site) in seen:
                continue
            keys = _ids(an, target)
            train = next((trains[k] for k in sorted(keys) if k in trains), None)
            if train is None or _trained_just_before(an, keys, trains, site, call):
                continue
            owners = _owners(an, target)
            resting = None
            if keys & others or owners & others:
                resting = _resting_in_train(an, mode_calls, keys | owners, site)
                if resting is None:
                    continue
                train = resting
            if _mode_free_class(an, models(an).roots(target)) or _hands_to_mode_setter(an, keys):
                continue
            seen.add(id(site))
            found.append(TrainModeScore(dotted_name(target) or "model", site, call, train, resting is not None))
        return found
    return a.facet("train_mode_scores", build)


def _ids(a: "Analysis", expr: cst.BaseExpression) -> frozenset:
    """The identity keys of ``expr``'s object; for an attribute of ``self`` bound to what the linter cannot follow
    (``self.actor, self.opt = strategy.prepare(...)``), the attribute of its class."""
    keys = _keys(a, expr)
    if keys or not isinstance(expr, cst.Attribute) or not (isinstance(expr.value, cst.Name) and expr.value.value in (
            "self", "cls")):
        return keys
    cls = a.enclosing_class(expr)
    return frozenset({f"{cls.name.value}.{expr.attr.value}@attribute"}) if cls is not None else keys


def _instance(a: "Analysis", expr: cst.BaseExpression) -> frozenset:
    """``self`` in a method: the instance of its class (its mode methods set the mode of every submodule)."""
    if isinstance(expr, cst.Name) and expr.value in ("self", "cls"):
        cls = a.enclosing_class(expr)
        if cls is not None:
            return frozenset({f"{cls.name.value}@instance"})
    return frozenset()


def _owners(a: "Analysis", target: cst.BaseExpression) -> frozenset:
    """The objects ``target`` is a submodule of (``self`` and ``self.body`` for ``self.body.head``): a mode method
    called on one of them sets the mode of ``target`` too."""
    found: set = set()
    while isinstance(target, cst.Attribute):
        target = target.value
        found |= _ids(a, target) | _instance(a, target)
    return frozenset(found)


def _trained_just_before(a: "Analysis", keys: frozenset, trains: dict, site: cst.Call, forward: cst.Call) -> bool:
    """Whether the function that scores puts the model in train mode itself before it scores (a test of the train
    path, a pass deliberately run with dropout on): the mode is chosen there, not left over from an update."""
    order = a.index.order
    for node in (site, forward):
        func = a.enclosing_function(node)
        for call in a.nodes(cst.Call):
            if _sets_train(call) and a.enclosing_function(call) is func and order[id(call)] < order[id(node)] and \
                    S.receiver(call) is not None and _ids(a, S.receiver(call)) & keys:
                return True
    return False


def _resting_in_train(a: "Analysis", mode_calls: list[tuple[cst.Call, frozenset]], keys: frozenset,
                      site: cst.Call) -> cst.Call | None:
    """For a model the module puts in eval mode somewhere: a ``.train()`` call after which it rests in train mode,
    when that is where every function leaves it and nothing sets its mode for the forward at ``site``. Every function
    that sets a mode on the model ends in train mode (its last mode call is ``.train()``: an evaluation pass that
    puts it back, `self.actor.train()  # reset model state`), so between calls the model is in train mode; the
    function that scores sets no mode before the forward, nor does a caller in view before it calls that function.
    Every call after the first update then scores with dropout on. None otherwise (a function that leaves the model
    in eval mode makes its mode at the forward depend on the order of calls)."""
    func = a.enclosing_function(site)
    if func is None:
        return None
    order = a.index.order
    by_function: dict[int, list[cst.Call]] = {}
    for call, objects in mode_calls:
        if objects & keys:
            by_function.setdefault(id(a.enclosing_function(call)), []).append(call)
    resting = None
    for calls in by_function.values():
        last = max(calls, key=lambda c: order[id(c)])
        if not _sets_train(last):
            return None
        resting = resting or last
    if any(order[id(c)] < order[id(site)] for c in by_function.get(id(func), ())):
        return None  # a mode is chosen before the forward (eval, or a deliberate train-mode pass)
    for caller_site in call_sites(a, func):
        before = by_function.get(id(a.enclosing_function(caller_site)), ())
        if any(order[id(c)] < order[id(caller_site)] for c in before):
            return None  # the caller sets the mode before it calls
    return resting


def _scoring_site(a: "Analysis", grad, call: cst.Call, depth: int = 2) -> cst.Call | None:
    """Where the forward ``call`` runs with autograd off: the call itself, or a call of the same-module helper that
    runs it made under ``torch.no_grad()`` (None when autograd is on or not known there)."""
    state = grad.enabled(call)
    if state is False:
        return call
    if state is None or depth <= 0:
        return None
    func = a.enclosing_function(call)
    if func is None:
        return None
    for site in call_sites(a, func):
        hit = _scoring_site(a, grad, site, depth - 1)
        if hit is not None:
            return hit
    return None


def _hands_to_mode_setter(a: "Analysis", keys: frozenset) -> bool:
    """Whether the model is handed to a call that may set its mode: a same-module helper that sets a mode on its
    parameter (or hands it on), or a call out of view named for a mode (``set_eval(model)``, ``evaluate(model)``)."""
    for call in a.nodes(cst.Call):
        for arg in call.args:
            value = arg.value
            if not isinstance(value, (cst.Name, cst.Attribute)) or not _ids(a, value) & keys:
                continue
            if _is_own_forward(a, call, keys):
                continue
            callee = a.callee(call)
            if callee is not None:
                if _helper_sets(a, callee, call, arg, 1):
                    return True
            elif _EVAL_CALL.fullmatch((a.call_name(call) or "").rsplit(".", 1)[-1]):
                return True
    return False
