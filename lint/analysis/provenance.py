"""Provenance: which objects a name denotes, and which model forwards a tensor is computed from.

Two facets over the shared value walk:

- :class:`ObjectFacet`: what object an expression denotes, as *roots*: a parameter, an attribute of an object
  from elsewhere, a freshly built object (``from_pretrained``, ``deepcopy``, a constructor, a factory helper whose
  return is a local it builds), a shallow copy or PEFT base of another object. ``model.eval()``, ``.to(dev)``,
  ``unwrap_model(m)`` and a helper that returns its argument keep the root: two names with a common root are the
  same object.
- :class:`ProvenanceFacet`: the *origins* of a tensor: model forwards (which model, whether autograd is on
  where it ran, and whether the chain made logits, log-probs or an entropy of it), stored data read from a batch
  or buffer, parameters, results of other processes (Ray RPCs: plain data), rollouts. ``.detach()``, ``.item()``,
  comparisons and code under ``torch.no_grad()`` clear the autograd flag; a literal ``use_grad=False`` passed to a
  helper the linter cannot read is taken at its word.

A model is recognised by what is done with it (called, ``.generate()``-ed, its ``.logits`` read, its
``parameters()`` optimised, built by a model factory) or, as a hint, by the role names of the vocabulary;
a model's *role* (policy, reference, critic) by the names along its alias chain and by being frozen.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import libcst as cst

from rlguard.lint.analysis import semantics as S
from rlguard.lint.analysis.grad import grad_context
from rlguard.lint.analysis.index import Def, dotted_name, key_of, read_name
from rlguard.lint.analysis.values import Facet, Frame, Trace

if TYPE_CHECKING:
    from rlguard.lint.analysis import Analysis

CRITIC_NAME = re.compile(r"(?i)(\w*_)?(critic|value_?(model|head|net|network|fn|function)|v_?head|vf|"
                         r"v_?net|q_?net|q_?function)(_\w+)?")
# Reward models and scorers: run, never trained by the RL update (their gradients reach no optimizer).
REWARD_NAME = re.compile(r"(?i)(\w*_)?(reward_?(model|net|fn|function|head)|rm|rm_model|scorer|judge|verifier|"
                         r"cost_?model)(_\w+)?")


# ===== objects =====================================================================================================
@dataclass(frozen=True)
class Obj:
    """A root of an object's identity. ``kind``: ``param``, ``attr`` (an attribute of an object from elsewhere),
    ``global``, ``new`` (built here), ``copy`` (a shallow copy of ``key``'s object), ``peft`` (the PEFT base model
    of ``key``'s object), ``opaque`` (the result of a call the linter cannot read)."""

    kind: str
    key: str
    names: tuple[str, ...] = ()
    node_id: int = 0


@dataclass(frozen=True)
class Tup:
    """A tuple of objects (``accelerator.prepare(a, b)``)."""

    elements: tuple[frozenset, ...]


EMPTY: frozenset = frozenset()


class ObjectFacet(Facet):
    unknown = EMPTY

    def __init__(self, a: "Analysis"):
        self.a = a
        self.calls: dict[int, cst.Call] = {}

    def join(self, values):
        out: set = set()
        for v in values:
            if isinstance(v, Tup):
                return v if len(values) == 1 else EMPTY
            out |= v
        return frozenset(out)

    def _named(self, objs: frozenset, name: str | None) -> frozenset:
        if not name:
            return objs
        return frozenset(replace(o, names=o.names + (name,)) if name not in o.names else o for o in objs)

    def node(self, trace, expr, frame):
        if isinstance(expr, (cst.Name, cst.Attribute, cst.Subscript)) and key_of(expr) is not None:
            named = trace.named(expr, frame)
            if isinstance(named, Tup):
                return named
            return self._named(named, read_name(expr))
        if isinstance(expr, cst.Call):
            return self._call(trace, expr, frame)
        if isinstance(expr, cst.IfExp):
            # `a if cond else b`: not one object, except the unwrap idiom, `m.module if isinstance(m, DDP) else m`
            # (the wrapper's `.module` is the model it wraps): one model either way
            body, orelse = _unwrapped(expr.body), _unwrapped(expr.orelse)
            if key_of(body) is not None and key_of(body) == key_of(orelse):
                return trace.value(body, frame)
            return EMPTY
        return EMPTY

    def _call(self, trace, call: cst.Call, frame):
        a = self.a
        name = a.call_name(call) or ""
        last = name.rsplit(".", 1)[-1]
        method = a.method(call)
        recv = S.receiver(call)
        if name in S.SHALLOW_COPY and call.args:
            self.calls[id(call)] = call
            inner = trace.value(call.args[0].value, frame)
            if isinstance(inner, Tup):
                return EMPTY
            return frozenset(Obj("copy", o.key, o.names, id(call)) for o in inner)
        if name in S.DEEP_COPY or S.NEW_MODEL_CALLS.fullmatch(name) or S.NEW_MODEL_CALLS.fullmatch(last):
            self.calls[id(call)] = call
            return frozenset({Obj("new", _made(call, frame, "new"), (S.product_name(last),), id(call))})
        if method == "get_base_model" and recv is not None:
            self.calls[id(call)] = call
            inner = trace.value(recv, frame)
            return frozenset(Obj("peft", o.key, o.names, id(call)) for o in inner) if not isinstance(inner, Tup) else EMPTY
        if method in S.SAME_MODULE_METHODS and recv is not None:
            return trace.value(recv, frame)
        if (S.SAME_MODULE_CALL.fullmatch(last) or name in S.SAME_MODULE_FUNCTIONS) and call.args:
            return trace.value(call.args[0].value, frame)
        if method == "prepare" and len(call.args) > 1:
            return Tup(tuple(trace.value(arg.value, frame) for arg in call.args))
        if method == "prepare" and len(call.args) == 1:
            return trace.value(call.args[0].value, frame)
        helper = trace.helper_call(call, frame)
        if helper is not None:
            return helper
        self.calls[id(call)] = call
        if isinstance(call.func, cst.Name) and a.class_named(call.func.value) is not None:
            return frozenset({Obj("new", _made(call, frame, "new"), (call.func.value,), id(call))})
        summary = a.summary_of_call(call)
        if summary is not None:
            returned = summary.returned_argument()
            if returned is not None:
                arg = S.argument(call, returned[0], returned[1])
                if arg is not None:
                    return trace.value(arg, frame)
            if summary.returns_new:
                return frozenset({Obj("new", _made(call, frame, "new"), (S.product_name(last),), id(call))})
        return frozenset({Obj("opaque", _made(call, frame, "call"), (S.product_name(last),) if last else (), id(call))})

    def leaf(self, trace, expr, frame):
        name = key_of(expr) or ""
        return frozenset({Obj("global", name, (read_name(expr) or name,))})

    def param(self, trace, d: Def, expr, frame):
        func = d.scope
        fname = func.name.value if isinstance(func, cst.FunctionDef) else "<lambda>"
        cls = self.a.index.scopes[id(func)].cls if id(func) in self.a.index.scopes else None
        owner = f"{cls.name.value}." if cls is not None else ""
        if cls is not None and d.key in ("self", "cls") and self.a.index.scopes[id(func)].params[:1] == [d.key]:
            # every method's `self` is the same object: its attributes have one identity across the class
            return frozenset({Obj("param", f"{owner}self", ("self",))})
        return frozenset({Obj("param", f"{owner}{fname}:{d.key}", (d.key,))})

    def opaque(self, trace, d: Def, expr):
        return frozenset({Obj("global", d.key, (d.key,))})

    def item(self, trace, container, entry):
        if isinstance(container, Tup):
            return EMPTY
        if not container:
            return EMPTY
        return frozenset(Obj("attr", f"{o.key}.{entry}", (entry,)) for o in container)

    def element(self, trace, whole, position):
        if isinstance(whole, Tup):
            return whole.elements[position] if position < len(whole.elements) else EMPTY
        # an element of what a call returned: its own object, remembering where it came from
        return frozenset(Obj(o.kind if o.kind == "opaque" else "attr", f"{o.key}[{position}]", o.names, o.node_id)
                         for o in whole)

    def enter(self, trace, manager, d):
        return manager if not isinstance(manager, Tup) else EMPTY  # `with unwrap(model) as m`: the model

    def iterate(self, trace, iterable, d):
        return EMPTY

    def helper(self, trace, call, returns, frame):
        """A helper's result. An object it builds is a new object at every call: its identity is this call's (two
        calls of a factory are two objects; a helper returning its argument keeps the argument's identity)."""
        if not returns:
            return EMPTY
        joined = self.join(returns)
        func = self.a.callee(call)
        if isinstance(joined, Tup):  # `return model, tokenizer`: each element is this call's too
            return Tup(tuple(self._of_this_call(element, func, call) for element in joined.elements))
        return self._of_this_call(joined, func, call)

    def _of_this_call(self, objs: frozenset, func, call: cst.Call) -> frozenset:
        """``objs`` with the objects ``func`` builds keyed by this call site: two calls, two objects."""
        out = set()
        for o in objs:
            if o.kind in ("new", "opaque") and func is not None and o.node_id and self._inside(func, o.node_id):
                o = Obj(o.kind, f"{o.kind}@{id(call)}", o.names, id(call))
                self.calls[id(call)] = call
            out.add(o)
        return frozenset(out)

    def _inside(self, func, node_id: int) -> bool:
        node = self.calls.get(node_id)
        return node is not None and self.a.contains(func, node)


_MADE_KEY = re.compile(r"new@(\d+)(?:#\d+)?")


def _unwrapped(expr: cst.BaseExpression) -> cst.BaseExpression:
    """``m`` of ``m.module`` (a DDP/FSDP wrapper's wrapped model), else ``expr``."""
    return expr.value if isinstance(expr, cst.Attribute) and expr.attr.value == "module" else expr


def _made(call: cst.Call, frame, kind: str) -> str:
    """The identity of the object a call makes: the call, and the helper frame it runs in (a helper called twice,
    ``init_model(cfg)`` for the policy and again for the reference, makes two objects, however its result is
    unpacked)."""
    return f"{kind}@{id(call)}" if frame is None else f"{kind}@{id(call)}#{id(frame)}"


def objects(a: "Analysis") -> Trace:
    return a.facet("objects", lambda an: Trace(an, ObjectFacet(an), budget=60000))


# ----- models --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelRef:
    """Which model a forward ran: ``role`` is ``policy``, ``reference``, ``critic``, ``reward`` (a reward model or
    scorer that is not trained) or ``model`` (no telling);
    ``roots`` the identity keys of the object."""

    role: str
    roots: frozenset
    names: tuple[str, ...] = ()


class Models:
    """Per module: which expressions denote models, and their roles."""

    def __init__(self, a: "Analysis"):
        self.a = a
        self.objs = objects(a)
        self._trained: frozenset | None = None
        self._frozen: frozenset | None = None
        self._called: frozenset | None = None
        self._deep_copies: bool | None = None

    def roots(self, expr: cst.BaseExpression, frame: Frame | None = None) -> frozenset:
        value = self.objs.value(expr, frame)
        return value if not isinstance(value, Tup) else EMPTY

    def model(self, expr: cst.BaseExpression, frame: Frame | None = None) -> ModelRef | None:
        """The model ``expr`` denotes, or None when nothing says it is one."""
        objs = self.roots(expr, frame)
        if not objs:
            return None
        names = tuple(n for o in objs for n in o.names)
        keys = frozenset(o.key for o in objs)
        names_say_model = any(self._model_name(n) for n in names)
        structural = bool(keys & self.trained_roots()) or any(o.kind == "new" and self._model_factory(o) for o in objs)
        if not (names_say_model or structural):
            return None
        return ModelRef(self._role(objs, names), keys, names)

    def _model_name(self, name: str) -> bool:
        vocab = self.a.names
        return (vocab.is_role(name, "policy") or vocab.is_role(name, "ref_model") or CRITIC_NAME.fullmatch(name) is not None
                or REWARD_NAME.fullmatch(name) is not None)

    def _model_factory(self, o: Obj) -> bool:
        return bool(o.names) and re.fullmatch(r"(?i)(\w+\.)*(from_pretrained|from_config|deepcopy|"
                                              r"create_reference_model|\w*model\w*)", o.names[0]) is not None

    def _role(self, objs: frozenset, names: tuple[str, ...]) -> str:
        vocab = self.a.names
        if any(vocab.is_role(n, "ref_model") for n in names) or self._frozen_copy_of_trained(objs):
            return "reference"
        if any(REWARD_NAME.fullmatch(n) for n in names) and not frozenset(o.key for o in objs) & self.trained_roots():
            return "reward"
        if any(CRITIC_NAME.fullmatch(n) for n in names):
            return "critic"
        if any(vocab.is_role(n, "policy") for n in names) or frozenset(o.key for o in objs) & self.trained_roots():
            return "policy"
        return "model"

    def _frozen_copy_of_trained(self, objs: frozenset) -> bool:
        """A deep copy of a model this module trains, not trained itself (``ref = copy.deepcopy(model)`` beside
        ``Adam(model.parameters())``): the copy keeps the starting weights, the reference a KL or a DPO margin
        measures against, whatever it is called."""
        trained = self.trained_roots()
        if not trained or not objs or any(o.kind != "new" for o in objs) or {o.key for o in objs} & trained:
            return False
        for o in objs:
            call = self.objs.facet.calls.get(o.node_id)
            if call is None or self.a.call_name(call) not in S.DEEP_COPY or not call.args:
                return False
            source = self.roots(call.args[0].value)
            if not source or not {s.key for s in source} <= trained:
                return False
        return True

    def trained_roots(self) -> frozenset:
        """Roots of objects whose ``parameters()`` are handed to an optimizer in this module."""
        if self._trained is None:
            self._trained = EMPTY
            found: set = set()
            for call in self.a.nodes(cst.Call):
                method = S.method_name(call)
                if method in ("parameters", "named_parameters"):
                    recv = S.receiver(call)
                    if recv is not None and self._in_optimizer(call):
                        found |= {o.key for o in self.roots(recv)}
                elif method == "__init__" and self._trainer_init(call):
                    # `super().__init__(model=model, ...)` in a subclass of a Trainer: the framework trains it
                    model = S.argument(call, 0, "model")
                    if model is not None:
                        found |= {o.key for o in self.roots(model)}
            self._trained = frozenset(found)
        return self._trained

    def _trainer_init(self, call: cst.Call) -> bool:
        """``super().__init__(...)`` in a class with a base named as a trainer (``Trainer``, ``GRPOTrainer``,
        ``BaseTrainer``): the base class's constructor, which takes the model it trains."""
        recv = S.receiver(call)
        if not (isinstance(recv, cst.Call) and S.called_name(recv) == "super"):
            return False
        cls = self.a.enclosing_class(call)
        return cls is not None and any((dotted_name(b.value) or "").rsplit(".", 1)[-1].endswith("Trainer")
                                       for b in cls.bases)

    def _in_optimizer(self, params_call: cst.Call) -> bool:
        a = self.a
        for anc in a.index.ancestors(params_call):
            if isinstance(anc, cst.Call):
                name = (a.call_name(anc) or "").rsplit(".", 1)[-1]
                if S.OPTIMIZER_CLASS.fullmatch(name) or S.method_name(anc) == "add_param_group":
                    return True
            if isinstance(anc, (cst.BaseSmallStatement, cst.BaseCompoundStatement)):
                break
        return False

    def is_frozen(self, ref: ModelRef) -> bool:
        """``ref_model.requires_grad_(False)``, ``ref.eval()`` with a loop setting ``p.requires_grad = False`` over
        its parameters, or a copy made by TRL's ``create_reference_model(model)`` (which sets ``requires_grad =
        False`` on every parameter unless ``num_shared_layers`` shares some with the policy): its forwards carry no
        gradient."""
        if self._frozen is None:
            found: set = set()
            for call in self.a.nodes(cst.Call):
                if S.method_name(call) == "requires_grad_" and call.args and S.literal_bool(call.args[0].value) is False:
                    recv = S.receiver(call)
                    if recv is not None:
                        found |= {o.key for o in self.roots(recv)}
                elif S.called_name(call) == "create_reference_model" and self.a.callee(call) is None and \
                        len(call.args) == 1 and call.args[0].keyword is None and not call.args[0].star:
                    found |= {o.key for o in self.roots(call)}
            for stmt in self.a.nodes(cst.Assign):
                target = dotted_name(stmt.targets[0].target) or ""
                if target.endswith(".requires_grad") and S.literal_bool(stmt.value) is False:
                    for loop in self.a.enclosing_loops(stmt):
                        if isinstance(loop, cst.For) and isinstance(loop.iter, cst.Call) and S.method_name(
                                loop.iter) in ("parameters", "named_parameters"):
                            recv = S.receiver(loop.iter)
                            if recv is not None:
                                found |= {o.key for o in self.roots(recv)}
            if found:
                found |= self._frozen_parameters(found)
            self._frozen = frozenset(found)
        return bool(ref.roots & self._frozen)

    def makes_deep_copies(self) -> bool:
        """Whether the module calls ``copy.deepcopy`` (cached): a cheap necessary condition for
        :meth:`trainable_copy` anywhere in it."""
        if self._deep_copies is None:
            self._deep_copies = any(self.a.call_name(c) in S.DEEP_COPY for c in self.a.nodes(cst.Call))
        return self._deep_copies

    def trainable_copy(self, ref: ModelRef) -> bool:
        """Whether the model's weights visibly require grad: every root is a deep copy made in this module
        (``copy.deepcopy(model)``), nothing here freezes it, and it is never handed to code that could (any call
        taking it as an argument, other than a wrapper that hands it back, ``self._wrap_model(m)``): a reference
        made by a deep copy and only put in eval mode. A model handed in, or handed out, may be frozen where the
        linter cannot see."""
        if not ref.roots or not self.makes_deep_copies() or self.is_frozen(ref):
            return False
        for key in ref.roots:
            made = _MADE_KEY.fullmatch(key)  # `new@<call>` or `new@<call>#<frame>`; an element of one is no copy
            call = self.objs.facet.calls.get(int(made.group(1))) if made else None
            if call is None or self.a.call_name(call) not in S.DEEP_COPY:
                return False
        for call in self.a.nodes(cst.Call):
            name = self.a.call_name(call) or ""
            if S.SAME_MODULE_CALL.fullmatch(name.rsplit(".", 1)[-1]) or name in S.SAME_MODULE_FUNCTIONS or \
                    name in S.DEEP_COPY:
                continue
            for arg in call.args:
                if isinstance(arg.value, (cst.Name, cst.Attribute)) and \
                        {o.key for o in self.roots(arg.value)} & ref.roots:
                    return False
        return True

    def _frozen_parameters(self, frozen: set) -> set:
        """Parameters of this module's functions that every call in the module hands a frozen model (the
        callee's context is its callers': ``train_epoch(..., ref_model)`` after ``ref_model.requires_grad_(False)``
        at the top of the script), through two levels of callers. A function with no call site in view, or one
        called as a method, gets nothing."""
        from rlguard.lint.analysis.grad import call_sites

        found: set = set()
        for _ in range(2):
            known = frozen | found
            for func in self.a.nodes(cst.FunctionDef):
                if self.a.enclosing_class(func) is not None:
                    continue  # a method: `self` shifts the arguments, and callers are many
                sites = call_sites(self.a, func)
                if not sites:
                    continue
                params = [p.name.value for p in func.params.params]
                for name in params:
                    key = f"{func.name.value}:{name}"
                    if key in found:
                        continue
                    handed = [dict(_bind_by_names(params, call)).get(name) for call in sites]
                    if all(arg is not None and (roots := {o.key for o in self.roots(arg)}) and roots <= known
                           for arg in handed):
                        found.add(key)
        return found


def _reference_context(a: "Analysis", item: cst.BaseExpression) -> bool:
    """``model.disable_adapter()``, ``self.null_ref_context()``, ``use_adapter(model, adapter_name="ref")``: a
    context under which the policy's forwards are the reference's."""
    if not isinstance(item, cst.Call):
        return False
    name = S.called_name(item) or ""
    if S.ADAPTER_OFF.fullmatch(name):
        return True
    if name in ("use_adapter", "set_adapter"):
        for arg in item.args:
            for node in (arg.value.body, arg.value.orelse) if isinstance(arg.value, cst.IfExp) else (arg.value,):
                if isinstance(node, cst.SimpleString) and re.fullmatch(r"(?i)ref(erence)?(_\w+)?",
                                                                       node.evaluated_value or ""):
                    return True
    return False


def models(a: "Analysis") -> Models:
    return a.facet("models", Models)


# ===== tensors =====================================================================================================
FORWARD, READ, PARAM, REMOTE, ROLLOUT = "forward", "read", "param", "remote", "rollout"


@dataclass(frozen=True)
class Origin:
    """Where part of a tensor's value comes from. ``grad``: True when autograd is on along the whole path from a
    model forward, False when something stopped it, None when it cannot be told. ``what``: the chain made
    ``logits``, ``logprobs``, ``entropy`` of the forward's ``output`` (``nll``: a cross-entropy)."""

    kind: str
    node_id: int
    grad: bool | None
    what: str = "output"
    model: ModelRef | None = None
    name: str = ""
    # True when the forward is assumed: a method of a model whose code is out of view (rules that need the
    # autograd state for certain report through such an origin only in preview)
    assumed: bool = False


class ProvenanceFacet(Facet):
    unknown = EMPTY
    buffer_fills = True

    def __init__(self, a: "Analysis"):
        self.a = a
        self.models = models(a)
        self.grad = grad_context(a)
        self.nodes: dict[int, cst.CSTNode] = {}

    def join(self, values):
        out: set = set()
        for v in values:
            out |= v
        return frozenset(out)

    # ----- helpers ------------------------------------------------------------------------------------------
    def _off(self, origins: frozenset) -> frozenset:
        return frozenset(replace(o, grad=False) if o.grad is not False else o for o in origins)

    def _what(self, origins: frozenset, what: str) -> frozenset:
        # a rollout's scores are the sampling policy's logits: their log-softmax is its log-probs (the token ids a
        # rollout returns are no logits, whatever is applied to them)
        # (a method's `self`, read where its submodules run, stands for a forward of the caller's model until the
        # call is resolved: see `_own_submodules`)
        return frozenset(replace(o, what=what) if o.kind == FORWARD or (o.kind == PARAM and o.name == "self") or (
            o.kind == ROLLOUT and o.what == "logits" and what == "logprobs") else o for o in origins)

    @staticmethod
    def _rollout_scores(origins: frozenset, attr: str) -> frozenset | None:
        """``out.scores`` / ``out.logits`` of a generation call (``generate(..., output_scores=True)``): the logits
        the sampler drew each token from (``name`` keeps which: HF's ``scores`` are processed by the sampler's
        temperature and warpers, its ``logits`` are raw)."""
        if attr not in ("scores", "logits") or not any(o.kind == ROLLOUT for o in origins):
            return None
        return frozenset(replace(o, what="logits", name=attr) if o.kind == ROLLOUT else o for o in origins)

    def _context(self, origins: frozenset, node: cst.CSTNode, frame) -> frozenset:
        """Origins of an operation run at ``node``: under a grad-off context the result carries no gradient."""
        if not any(o.grad for o in origins):
            return origins
        state = self.grad.enabled(node, frame)
        if state is False:
            return self._off(origins)
        if state is None:
            return frozenset(replace(o, grad=None) if o.grad else o for o in origins)
        return origins

    def _forward(self, call: cst.Call, model: ModelRef, frame, what: str = "output") -> frozenset:
        self.nodes[id(call)] = call
        state = self.grad.enabled(call, frame)
        if state is not False and self.models.is_frozen(model):
            state = False
        if model.role in ("policy", "model") and self._adapter_reference(call, frame):
            model = replace(model, role="reference")  # the PEFT policy with its adapter off: the reference
        return frozenset({Origin(FORWARD, id(call), state, what, model, model.names[0] if model.names else "")})

    def _adapter_reference(self, call: cst.Call, frame) -> bool:
        """Whether the forward runs, here or through the calls that led to it, inside a context that turns the
        policy's adapter off or switches to a reference adapter (``with model.disable_adapter():``,
        ``with self.null_ref_context():``, ``with use_adapter(model, adapter_name="ref"):``)."""
        nodes = [call]
        while frame is not None:
            if frame.call is not None:
                nodes.append(frame.call)
            frame = frame.caller
        for node in nodes:
            for anc in self.a.index.ancestors(node):
                if isinstance(anc, (cst.FunctionDef, cst.ClassDef)):
                    break
                if isinstance(anc, cst.With) and any(_reference_context(self.a, item.item) for item in anc.items):
                    return True
        return False

    def _own_submodules(self, call: cst.Call, recv, origins: frozenset, frame) -> frozenset:
        """A method of a torch module in view, called on a model (``model.v(obs)``), whose walk ends at its own
        submodules (``self.fc_v(x)``, read as the method's ``self``): a forward of the model the caller holds, with
        the caller's autograd state. A method that turns autograd off or detaches is left as walked."""
        own = [o for o in origins if o.kind == PARAM and o.name == "self"]
        if not own or recv is None or not isinstance(recv, (cst.Name, cst.Attribute)):
            return origins
        owner = self.models.model(recv, frame)
        func = self.a.callee(call)
        if owner is None or func is None or self.a.method(call) in S.NON_FORWARD_METHODS:
            return origins
        text = self.a.code(func)
        if "no_grad" in text or "inference_mode" in text or "detach" in text:
            return origins
        forwards = frozenset(o for own_origin in own for o in self._forward(call, owner, frame, own_origin.what))
        return frozenset(o for o in origins if o not in own) | forwards

    # ----- transfer ---------------------------------------------------------------------------------------------
    def node(self, trace, expr, frame):
        if isinstance(expr, cst.Call):
            return self._call(trace, expr, frame)
        if isinstance(expr, cst.Attribute) and key_of(expr) is None:
            return self._attribute(trace, trace.value(expr.value, frame), expr.attr.value)
        if isinstance(expr, cst.Subscript) and key_of(expr) is None:
            inner = trace.value(expr.value, frame)
            if len(expr.slice) == 1 and S.int_value(getattr(expr.slice[0].slice, "value", None)) == 0:
                return self._what(inner, "logits") if any(o.kind == FORWARD and o.what == "output" for o in inner) \
                    else inner
            return inner
        if isinstance(expr, cst.BinaryOperation):
            both = trace.value(expr.left, frame) | trace.value(expr.right, frame)
            return self._context(frozenset(replace(o, what="derived") if o.kind == FORWARD else o for o in both),
                                 expr, frame)
        if isinstance(expr, cst.UnaryOperation):
            inner = trace.value(expr.expression, frame)
            if isinstance(expr.operator, cst.Minus) and any(o.what == "nll" for o in inner if o.kind == FORWARD):
                # `-F.cross_entropy(logits, target, reduction="none")`: the negated NLL is the target's log-prob
                return frozenset(replace(o, what="logprobs") if o.kind == FORWARD and o.what == "nll" else o
                                 for o in inner)
            return self._off(inner) if isinstance(expr.operator, cst.Not) else inner
        if isinstance(expr, cst.Comparison):
            found = trace.value(expr.left, frame)
            for comp in expr.comparisons:
                found |= trace.value(comp.comparator, frame)
            return self._off(found)
        if isinstance(expr, cst.BooleanOperation):
            return trace.value(expr.left, frame) | trace.value(expr.right, frame)
        if isinstance(expr, (cst.Tuple, cst.List, cst.Set)):
            return self.join([trace.value(el.value, frame) for el in expr.elements])
        if isinstance(expr, (cst.Integer, cst.Float, cst.Imaginary, cst.SimpleString, cst.ConcatenatedString,
                             cst.FormattedString, cst.Lambda, cst.Dict, cst.DictComp, cst.ListComp, cst.SetComp,
                             cst.GeneratorExp, cst.Ellipsis)):
            return EMPTY
        return None

    def _attribute(self, trace, origins: frozenset, attr: str) -> frozenset:
        scores = self._rollout_scores(origins, attr)
        if scores is not None:
            return scores
        if attr in ("logits", "logit"):
            return self._what(origins, "logits")
        if attr in S.DATA_ATTRIBUTES:
            return EMPTY if attr != "data" else self._off(origins)
        if attr in ("log_probs", "logprobs", "logps"):
            return self._what(origins, "logprobs")
        return origins

    def _call(self, trace, call: cst.Call, frame):
        a = self.a
        name = a.call_name(call) or ""
        last = name.rsplit(".", 1)[-1]
        method = a.method(call)
        recv = S.receiver(call)
        if S.is_remote_call(call, name):
            return frozenset({Origin(REMOTE, id(call), False, name=last)})
        if any(arg.keyword is not None and arg.keyword.value == "return_tensors" for arg in call.args):
            # a tokenizer or processor (`tok(texts, return_tensors="pt")`, HF's signature): token ids, no forward,
            # whatever object the tokenizer was unpacked from
            return EMPTY
        if method in S.DETACHING_METHODS and recv is not None and name.split(".", 1)[0] not in ("torch", "np", "numpy"):
            return self._off(trace.value(recv, frame)) if method not in ("size", "numel", "dim", "shape") else EMPTY
        if name in S.DETACHING_FUNCTIONS or last in ("len", "range", "isinstance"):
            return EMPTY
        # a model called (``model(x)``, ``self.critic(x)``, ``model.forward(x)``): its forward; a method of a model
        # that runs it (``agent.get_action_and_value(obs)``) too; ``generate`` makes rollouts
        target = call.func
        if a.callee(call) is None:
            whole = self.models.model(target, frame) if isinstance(target, (cst.Name, cst.Attribute)) else None
            if whole is not None and method not in S.NON_FORWARD_METHODS:
                return self._forward(call, whole, frame)
            owner = self.models.model(recv, frame) if recv is not None and isinstance(
                recv, (cst.Name, cst.Attribute, cst.Call)) else None
            if owner is not None and method not in S.NON_FORWARD_METHODS and method not in S.SAME_VALUE_METHODS:
                if S.ROLLOUT_CALL.fullmatch(method or ""):
                    return frozenset({Origin(ROLLOUT, id(call), False, name=method)})
                origins = self._forward(call, owner, frame)
                placed = a.method_summaries(call) if method not in ("forward", "__call__") else None
                if placed and all(s.returns_forward for s in placed) and not any(
                        s.grad_off_for(call) or s.returns_detached or s.grad_param for s in placed):
                    # every definition of the method in the tree is a torch module's method that runs its own
                    # submodules with autograd left as it is: a forward of this model, as the call's context says
                    return origins
                if S.INFERENCE_METHOD.fullmatch(method or ""):
                    # `model.infer_logprobs(...)`: code the linter cannot read, named for inference; whether it
                    # runs with autograd cannot be told
                    origins = frozenset(replace(o, grad=None) if o.grad else o for o in origins)
                elif method not in ("forward", "__call__"):
                    # `ref.compute_logp(batch)`, `cluster.compute_log_probs(batch)`: a method whose code is out of
                    # view may run the forward under no_grad, in a worker behind an RPC layer, or not at all: the
                    # origin is marked as assumed (a method defined in view is walked instead)
                    origins = frozenset(replace(o, assumed=True) for o in origins)
                return origins
            if method == "generate":
                return frozenset({Origin(ROLLOUT, id(call), False, name=method)})
        # log-probs and entropies
        if name in S.LOG_SOFTMAX or method == "log_softmax":
            source = call.args[0].value if method is None and call.args else recv
            return self._context(self._what(trace.value(source, frame), "logprobs"), call, frame)
        if name in S.SOFTMAX or method == "softmax":
            # probabilities: their log is log-probs (`torch.log(pi.gather(1, a))`, A2C's policy head)
            source = call.args[0].value if method is None and call.args else recv
            return self._context(self._what(trace.value(source, frame), "probs"), call, frame)
        if (name == "torch.log" and call.args) or (method == "log" and recv is not None and not call.args):
            inner = trace.value(call.args[0].value if method is None else recv, frame)
            if inner and all(o.kind in (FORWARD, PARAM) and o.what == "probs" for o in inner):
                return self._context(self._what(inner, "logprobs"), call, frame)
        if method == "gather" or name in S.GATHER:
            source = recv if method == "gather" and name not in S.GATHER else S.argument(call, 0, "input")
            return self._context(trace.value(source, frame), call, frame)
        if S.LOGPROB_HELPER.fullmatch(last) and a.callee(call) is None:
            logits = S.argument(call, 0, "logits")
            return self._context(self._what(trace.value(logits, frame), "logprobs"), call, frame)
        if name in S.CROSS_ENTROPY:
            return self._context(self._what(trace.value(S.argument(call, 0, "input"), frame), "nll"), call, frame)
        if (S.ENTROPY_HELPER.fullmatch(last) or name in S.ENTROPY_FUNCTIONS) and a.callee(call) is None:
            source = S.argument(call, 0, "logits") if call.args else recv
            return self._context(self._what(trace.value(source, frame), "entropy"), call, frame)
        if method in ("entropy", "log_prob") and recv is not None:
            dist = self._distribution(trace, recv, frame)
            if dist is None and method == "log_prob" and call.args:
                # `policy(obs).dist.log_prob(act)`: a distribution a model forward returns (torch.distributions'
                # interface), whatever the forward's output is called
                made = trace.value(recv, frame)
                dist = made if made and all(o.kind == FORWARD for o in made) else None
            if dist is not None:
                return self._context(self._what(dist, "entropy" if method == "entropy" else "logprobs"), call, frame)
        # a function of this module: walked into
        helper = trace.helper_call(call, frame)
        if helper is not None:
            return self._own_submodules(call, recv, helper, frame)
        summary = a.summary_of_call(call)
        if summary is not None:
            return self._summarised(trace, call, summary, frame)
        # a function of another module taking a model: a forward of that model, unless it makes rollouts
        model_args = [(arg, m) for arg in call.args
                      for m in [self.models.model(arg.value, frame) if isinstance(arg.value, (cst.Name, cst.Attribute)) else None]
                      if m is not None]
        if model_args and method not in S.NON_FORWARD_METHODS:
            remote = [o for arg in call.args for o in trace.value(arg.value, frame) if o.kind == REMOTE]
            if remote:
                # a handle built around a remote class with the model (``WorkerGroup(cls=ray.remote(Worker),
                # model=policy)``): the model runs in other processes, and the handle's results come back as data
                return frozenset(remote)
            if S.ROLLOUT_CALL.fullmatch(last or ""):
                return frozenset({Origin(ROLLOUT, id(call), False, name=last)})
            if re.fullmatch(r"(?i)\w*(prepare|wrap|build|make|create|init|load|save|copy|unwrap|setup|register)\w*",
                            last or "") or last[:1].isupper():
                # a factory, or a class (CapWords: ``DataParallelPPOActor(actor_module=m)``, ``DDP(m)``) built
                # around the model: an object that holds it, not a forward's output (what its methods return is
                # their own; a method out of view is an assumed forward, see above)
                return EMPTY
            origins = self._forward(call, model_args[0][1], frame)
            if _no_grad_keyword(call):
                origins = self._off(origins)
            return origins
        # anything else: what goes in comes out (receiver and arguments), autograd as the context says
        found: set = set()
        if method is not None and recv is not None and method not in ("append", "extend", "update"):
            inner = trace.value(recv, frame)
            if any(o.kind == REMOTE for o in inner):
                # a method of a handle built around a remote class (``RayWorkerGroup(... ray.remote(Worker) ...)``,
                # an actor handle): what it returns crossed a process boundary, data without an autograd graph,
                # whatever models went into the handle's construction
                return frozenset(o for o in inner if o.kind == REMOTE)
            found |= inner
        for arg in call.args:
            if arg.keyword is not None and arg.keyword.value in ("dim", "index", "device", "dtype", "mask",
                                                                    "attention_mask", "position_ids"):
                continue
            found |= trace.value(arg.value, frame)
        origins = frozenset(found)
        if _no_grad_keyword(call):
            origins = self._off(origins)
        return self._context(origins, call, frame)

    def _distribution(self, trace, expr, frame) -> frozenset | None:
        """The logits' origins of ``Categorical(logits=...)`` behind ``expr`` (through names)."""
        if isinstance(expr, cst.Call) and (self.a.call_name(expr) or "") in S.CATEGORICAL:
            logits = S.argument(expr, None, "logits") or S.argument(expr, None, "probs") or S.argument(expr, 0, None)
            return trace.value(logits, frame) if logits is not None else EMPTY
        key = key_of(expr)
        if key is not None:
            defs = self.a.flow.reaching(key, expr)
            found = [self._distribution(trace, d.value, frame) for d in defs if d.kind == "assign" and d.value is not None]
            found = [f for f in found if f is not None]
            if found:
                return self.join(found)
        return None

    def _summarised(self, trace, call, summary, frame) -> frozenset:
        """A function of another file of the linted tree, through its summary: what it returns derives from the
        arguments it names (``returns_from``), runs the model it is given, and carries autograd as it says."""
        found: set = set()
        bindings = dict(_bind_by_names(summary.params, call))
        for name in summary.returns_from:
            if name in bindings:
                found |= trace.value(bindings[name], frame)
        if summary.returns_detached or summary.grad_off_for(call):
            return self._off(frozenset(found))
        model_args = [self.models.model(arg.value, frame) for arg in call.args
                      if isinstance(arg.value, (cst.Name, cst.Attribute))]
        model_args = [m for m in model_args if m is not None]
        if model_args and summary.runs_model:
            return self._forward(call, model_args[0], frame, summary.returns_role or "output")
        return self._context(frozenset(found), call, frame)

    def leaf(self, trace, expr, frame):
        return EMPTY  # a global or builtin

    def param(self, trace, d: Def, expr, frame):
        return frozenset({Origin(PARAM, id(d.stmt), None, name=d.key)})

    def item(self, trace, container, entry):
        scores = self._rollout_scores(container, entry)
        if scores is not None:
            return scores
        if any(o.kind == FORWARD for o in container):
            return self._attribute(trace, container, entry)
        return frozenset({Origin(READ, 0, None, name=entry)})

    def element(self, trace, whole, position):
        return whole

    def call_element(self, trace, call, position, frame):
        """Element ``position`` of a call into another file unpacked into a tuple target: the forward's output
        made what the callee's code makes that element (log-probs, an entropy), when its definitions agree."""
        role = self.a.element_role(call, position)
        if role is None or role[0] not in ("logprobs", "entropy"):
            return None
        return self._what(trace.value(call, frame), role[0])

    def iterate(self, trace, iterable, d):
        return frozenset(replace(o, kind=READ) if o.kind == PARAM else o for o in iterable)

    def enter(self, trace, manager, d):
        return manager

    def aug(self, trace, before, op, operand, d):
        return self._context(before | operand, d.stmt, None)

    def opaque(self, trace, d, expr):
        return EMPTY

    def helper(self, trace, call, returns, frame):
        """A helper's result: forwards that ran inside it ran *at this call* as far as the caller can see (the
        call is what sits in the caller's loop)."""
        func = self.a.callee(call)
        out = set()
        for o in self.join(returns):
            node = self.nodes.get(o.node_id)
            if o.kind == FORWARD and func is not None and node is not None and self.a.contains(func, node):
                self.nodes[id(call)] = call
                o = replace(o, node_id=id(call))
            out.add(o)
        return frozenset(out)


def _bind_by_names(params: list[str], call: cst.Call) -> list[tuple[str, cst.BaseExpression]]:
    """A call's arguments by the callee's parameter names (``self`` already left out of ``params``)."""
    out = []
    positional = [a for a in call.args if a.keyword is None and not a.star]
    for name, arg in zip(params, positional):
        out.append((name, arg.value))
    names = set(params)
    out += [(arg.keyword.value, arg.value) for arg in call.args if arg.keyword is not None and arg.keyword.value in names]
    return out


def _no_grad_keyword(call: cst.Call) -> bool:
    for arg in call.args:
        if arg.keyword is not None and arg.keyword.value in S.NO_GRAD_KEYWORDS:
            value = S.literal_bool(arg.value)
            if value is not None and value == S.NO_GRAD_KEYWORDS[arg.keyword.value]:
                return True
    return False


def provenance(a: "Analysis") -> Trace:
    return a.facet("provenance", lambda an: Trace(an, ProvenanceFacet(an), budget=80000))


def forwards(a: "Analysis", expr: cst.BaseExpression, grad: bool | None = None) -> list[Origin]:
    """The model forwards ``expr``'s value comes from (``grad``: only those whose autograd state is ``grad``)."""
    found = provenance(a).value(expr)
    return [o for o in found if o.kind == FORWARD and (grad is None or o.grad is grad)]


def forwards_of_def(a: "Analysis", d: Def, grad: bool | None = None) -> list[Origin]:
    """The model forwards of the value binding ``d`` gives its key: for a tuple target (``lp, ref_lp = f(x)``) its
    own element, through a helper of this module's returned tuple (a helper out of view: the whole call)."""
    found = provenance(a).def_value(d, d.key, d.stmt, None)
    return [o for o in found if o.kind == FORWARD and (grad is None or o.grad is grad)]
