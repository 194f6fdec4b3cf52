"""rlguard's analysis core: what the rules know about a module, computed once and shared.

Layers, each built on the one before (rules only ever talk to :class:`Analysis`):

- :mod:`~rlguard.lint.analysis.index`: one iterative walk over the parsed module (parents, order, scopes,
  definitions, imports, statement positions);
- :mod:`~rlguard.lint.analysis.flow`: reaching definitions, the single data-flow query;
- :mod:`~rlguard.lint.analysis.values`: the backward value walk (names, keys, attributes, tuples, helpers with
  their parameters bound) that every facet reuses;
- facets, each a small set of transfer rules over that walk: :mod:`.alignment` (time axis), :mod:`.provenance`
  (which model forwards, with or without autograd, a value comes from; which object a name denotes),
  :mod:`.signs` (the sign of a term in a sum), :mod:`.loops` (update loops), :mod:`.losses` (what is
  minimised);
- :mod:`~rlguard.lint.analysis.semantics`: the library facts (torch, transformers, Ray...) the facets rely on;
- :mod:`~rlguard.lint.analysis.summaries`: per-function facts (runs under no_grad, returns its argument or a
  new object, zeroes which optimizer...) for calls into other functions and other files of the linted tree.

The principle: a name is a hint, never proof. A role comes from how a value is computed and used; names only
corroborate, and a trace that fails is *unknown*, which reports nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import libcst as cst

from rlguard.lint.analysis.flow import Flow
from rlguard.lint.analysis.index import Def, ModuleIndex, dotted_name, key_of, read_name
from rlguard.lint.names import Vocabulary

if TYPE_CHECKING:
    from rlguard.lint.analysis.summaries import Project


# module methods that return the module itself: `Net(...).to(device)` is still the Net
_RETURNS_SELF = frozenset({"to", "cuda", "cpu", "float", "half", "double", "bfloat16", "train", "eval",
                           "requires_grad_", "share_memory"})


def _constructor_call(value: cst.BaseExpression | None) -> cst.Call | None:
    """``C(...)`` of ``C(...)`` / ``C(...).to(device).eval()``: the call of a named class, else None."""
    while isinstance(value, cst.Call) and isinstance(value.func, cst.Attribute) and \
            value.func.attr.value in _RETURNS_SELF:
        value = value.func.value
    if isinstance(value, cst.Call) and isinstance(value.func, cst.Name):
        return value
    return None


class Analysis:
    """Everything a rule may ask about one parsed module. Built once per file, shared by all rules; facets and
    per-module facts are computed on first use and cached here."""

    def __init__(self, module: cst.Module, path: str = "<string>", vocabulary: Vocabulary | None = None,
                 project: "Project | None" = None, module_name: str | None = None):
        self.module = module
        self.path = path
        self.names = vocabulary or _default_vocabulary()
        self.index = ModuleIndex(module)
        self.flow = Flow(self.index)
        self.project = project
        self.module_name = module_name
        self.preview = False  # set by the engine: whether preview parts of rules report
        self.cache: dict[str, object] = {}  # per-module facts of the facets, by facet name
        self._callees: dict[int, cst.FunctionDef | None] = {}
        self._call_names: dict[int, str | None] = {}
        self._module_functions: dict[int, bool] = {}
        self._method_summaries: dict[int, list | None] = {}

    # ----- structure (delegated to the index) --------------------------------------------------------------
    def nodes(self, *types: type) -> list[cst.CSTNode]:
        return self.index.nodes(*types)

    def ancestors(self, node: cst.CSTNode):
        return self.index.ancestors(node)

    def contains(self, outer: cst.CSTNode, inner: cst.CSTNode) -> bool:
        return self.index.contains(outer, inner)

    def enclosing_function(self, node: cst.CSTNode) -> cst.FunctionDef | None:
        return self.index.enclosing_function(node)

    def enclosing_class(self, node: cst.CSTNode) -> cst.ClassDef | None:
        return self.index.enclosing_class(node)

    def code(self, node: cst.CSTNode) -> str:
        return self.module.code_for_node(node)

    def sole_value(self, expr: cst.BaseExpression) -> cst.BaseExpression | None:
        """The value a name holds when one plain assignment (no tuple target) is the only definition reaching it;
        None for anything else (a parameter, several definitions, an element of an unpacked value)."""
        if not isinstance(expr, cst.Name):
            return None
        defs = self.flow.reaching(expr.value, expr)
        if len(defs) != 1 or defs[0].kind != "assign" or defs[0].element is not None:
            return None
        return defs[0].value

    def enclosing_loops(self, node: cst.CSTNode) -> list[cst.For | cst.While]:
        """Loops around ``node`` inside its function, innermost first."""
        loops = []
        for anc in self.index.ancestors(node):
            if isinstance(anc, (cst.FunctionDef, cst.ClassDef, cst.Lambda)):
                break
            if isinstance(anc, (cst.For, cst.While)) and not _in_loop_header(anc, node, self.index):
                loops.append(anc)
        return loops

    def expects_error(self, node: cst.CSTNode) -> bool:
        """Whether ``node`` runs inside ``with pytest.raises(...)`` or ``with self.assertRaises(...)``: code a test
        runs to show that it is refused, not code that trains."""
        for anc in self.index.ancestors(node):
            if isinstance(anc, (cst.FunctionDef, cst.ClassDef, cst.Lambda)):
                return False
            if isinstance(anc, cst.With) and any(
                    isinstance(item.item, cst.Call) and (read_name(item.item.func) or "").startswith(
                        ("raises", "assertRaises")) for item in anc.items):
                return True
        return False

    # ----- names and calls -----------------------------------------------------------------------------------
    def call_name(self, call: cst.Call) -> str | None:
        """The qualified name of what ``call`` calls (``F.pad`` -> ``torch.nn.functional.pad``), or None."""
        cache = self._call_names
        hit = cache.get(id(call), _MISSING)
        if hit is not _MISSING:
            return hit
        name = self.index.qualified_name(call.func)
        if name is not None:
            head, _, rest = name.partition(".")
            if head in _CONVENTIONAL and head not in self.index.imports and rest:
                name = f"{_CONVENTIONAL[head]}.{rest}"
        cache[id(call)] = name
        return name

    def qualified_name(self, expr: cst.BaseExpression) -> str | None:
        return self.index.qualified_name(expr)

    def function_alias(self, call: cst.Call) -> str | None:
        """The function a called name or ``self.`` attribute is bound to, when every binding of it refers to the
        same one (``f``, ``mod.f``, ``torch.compile(f, ...)``, either of them under a condition): its qualified
        name, else None. ``self.entropy_fn = torch.compile(verl_F.entropy_from_logits)`` then
        ``self.entropy_fn(logits)`` calls ``entropy_from_logits``, whatever the attribute is called."""
        key = key_of(call.func)
        if key is None:
            return None
        if key.startswith("self."):
            cls = self.enclosing_class(call)
            defs = self.index.class_defs.get(id(cls), {}).get(key, []) if cls is not None else []
        else:
            defs = self.flow.reaching(key, call.func)
        found = set()
        for d in defs:
            if d.kind != "assign" or d.value is None or d.element is not None:
                return None
            choices = [d.value.body, d.value.orelse] if isinstance(d.value, cst.IfExp) else [d.value]
            for value in choices:
                if isinstance(value, cst.Call) and self.call_name(value) == "torch.compile" and value.args:
                    value = value.args[0].value
                if not isinstance(value, (cst.Name, cst.Attribute)):
                    return None
                name = self.qualified_name(value) or dotted_name(value)
                if name is None or name.startswith("self."):
                    return None
                found.add(name)
        return found.pop() if len(found) == 1 else None

    def is_module_function(self, call: cst.Call) -> bool:
        """``torch.roll(...)``, ``F.pad(...)``, ``np.mean(...)``: a function of an imported module, not a method of
        a value."""
        hit = self._module_functions.get(id(call))
        if hit is None:
            hit = self._module_functions[id(call)] = self._is_module_function(call)
        return hit

    def _is_module_function(self, call: cst.Call) -> bool:
        func = call.func
        if type(func) is not cst.Attribute:
            return False
        head = func.value
        while type(head) is cst.Attribute:
            head = head.value
        if type(head) is not cst.Name:
            return False
        head = head.value
        if head in self.index.imports or head in self.index.relative_imports:
            # `from ..utils import torch_functional as VF`: `VF.masked_mean(...)` is a function of that module
            return all(d.kind == "import" for d in self.flow.reaching(head, call))
        if head in _CONVENTIONAL or head in ("torch", "math", "numpy", "random", "os", "copy", "functools"):
            return not any(d.kind != "import" for d in self.flow.reaching(head, call))
        return False

    def method(self, call: cst.Call) -> str | None:
        """The method name of ``x.m(...)`` when ``x`` is a value (not a module: ``F.pad(...)`` has none)."""
        if type(call.func) is cst.Attribute and not self.is_module_function(call):
            return call.func.attr.value
        return None

    def reaching(self, key: str, at: cst.CSTNode) -> list[Def]:
        return self.flow.reaching(key, at)

    def function_named(self, name: str, at: cst.CSTNode | None = None) -> cst.FunctionDef | None:
        """The module's function ``name`` (the one bound where ``at`` reads it, when given), if exactly one."""
        if at is not None:
            defs = [d for d in self.flow.reaching(name, at) if d.kind == "def"]
            funcs = [d.stmt for d in defs if isinstance(d.stmt, cst.FunctionDef)]
            if len(funcs) == 1 and len(defs) == 1:
                return funcs[0]
            if defs:
                return None
        found = self.index.functions.get(name, [])
        top = [f for f in found if self.index.enclosing(f, cst.FunctionDef, cst.ClassDef) is None]
        return top[0] if len(top) == 1 else (found[0] if len(found) == 1 else None)

    def method_of(self, cls: cst.ClassDef, name: str, depth: int = 3) -> cst.FunctionDef | None:
        """Method ``name`` of a class of this module, looking into its same-module base classes."""
        for method in self.index.methods(cls):
            if method.name.value == name:
                return method
        if depth > 0:
            for base in cls.bases:
                base_name = dotted_name(base.value)
                base_cls = self.class_named(base_name) if base_name else None
                if base_cls is not None and base_cls is not cls:
                    found = self.method_of(base_cls, name, depth - 1)
                    if found is not None:
                        return found
        return None

    def class_named(self, name: str | None) -> cst.ClassDef | None:
        found = self.index.classes.get(name or "", [])
        return found[0] if len(found) == 1 else None

    def callee(self, call: cst.Call) -> cst.FunctionDef | None:
        """The function of this module that ``call`` runs: ``helper(...)``, ``self.method(...)`` (also from a
        same-module base class), ``obj.method(...)`` / ``obj(...)`` for an instance of a same-module class
        (``forward``/``__call__``), else None."""
        cached = self._callees.get(id(call), _MISSING)
        if cached is not _MISSING:
            return cached
        found = self._callee(call)
        self._callees[id(call)] = found
        return found

    def _callee(self, call: cst.Call) -> cst.FunctionDef | None:
        # cheap tests first: only a name the module defines can be one of its functions, and only a class of
        # the module with a `forward`/`__call__` (or that method) can make `obj(...)` / `obj.m(...)` run its code
        index = self.index
        func = call.func
        callable_classes = self._callable_classes()
        if isinstance(func, cst.Name):
            if func.value in index.functions:
                found = self.function_named(func.value, call)
                if found is not None:
                    return found
            if not callable_classes:
                return None
            cls = self.instance_class(func)
            return self._call_method(cls) if cls is not None else None
        if isinstance(func, cst.Attribute):
            receiver = func.value
            name = func.attr.value
            if isinstance(receiver, cst.Name) and receiver.value in ("self", "cls"):
                cls = self.enclosing_class(call)
                if cls is not None and name in self._method_names():
                    method = self.method_of(cls, name)
                    if method is not None:
                        return method
                if not callable_classes:
                    return None
                attr_cls = self.instance_class(func)
                return self._call_method(attr_cls) if attr_cls is not None else None
            if name in self._method_names():
                cls = self.instance_class(receiver)
                if cls is not None:
                    return self.method_of(cls, name)
            if callable_classes:
                attr_cls = self.instance_class(func)
                if attr_cls is not None:
                    return self._call_method(attr_cls)
        return None

    def _method_names(self) -> frozenset[str]:
        hit = self.cache.get("method_names")
        if hit is None:
            hit = self.cache["method_names"] = frozenset(
                f.name.value for f in self.index.nodes(cst.FunctionDef) if self.index.scope_of(f).cls is not None
                or isinstance(self.index.scope_node(f), cst.ClassDef))
        return hit

    def _callable_classes(self) -> bool:
        hit = self.cache.get("callable_classes")
        if hit is None:
            hit = self.cache["callable_classes"] = any(
                self.method_of(c, "forward") is not None or self.method_of(c, "__call__") is not None
                for c in self.index.nodes(cst.ClassDef))
        return hit

    def _constructed_keys(self) -> frozenset[str]:
        """Keys (``m``, ``self.m``) some assignment of the module binds to a call of one of the module's classes."""
        hit = self.cache.get("constructed_keys")
        if hit is None:
            keys = set()
            for stmt in self.nodes(cst.Assign, cst.AnnAssign):
                value = _constructor_call(stmt.value)
                if value is not None and value.func.value in self.index.classes:
                    targets = [t.target for t in stmt.targets] if isinstance(stmt, cst.Assign) else [stmt.target]
                    keys.update(k for k in map(key_of, targets) if k is not None)
            hit = self.cache["constructed_keys"] = frozenset(keys)
        return hit

    def _call_method(self, cls: cst.ClassDef) -> cst.FunctionDef | None:
        return self.method_of(cls, "forward") or self.method_of(cls, "__call__")

    def instance_class(self, expr: cst.BaseExpression) -> cst.ClassDef | None:
        """The same-module class ``expr`` is an instance of, when every binding of it constructs that class."""
        key = key_of(expr)
        if key is None or key not in self._constructed_keys():
            return None  # nothing in the module binds it to a call of one of its classes: no reaching def can be
        defs = self.flow.reaching(key, expr)
        classes = set()
        for d in defs:
            value = _constructor_call(d.value) if d.kind == "assign" and d.element is None else None
            if value is None:
                return None
            cls = self.class_named(value.func.value)
            if cls is None:
                return None
            classes.add(id(cls))
            last = cls
        return last if len(classes) == 1 else None

    def positional_field(self, call: cst.Call, entry: str) -> cst.BaseExpression | None:
        """For ``C(a, b)`` constructing a same-module dataclass or NamedTuple: the argument bound to field
        ``entry`` (fields in declaration order)."""
        if not isinstance(call.func, cst.Name):
            return None
        cls = self.class_named(call.func.value)
        if cls is None or not isinstance(cls.body, cst.IndentedBlock):
            return None
        fields = []
        for stmt in cls.body.body:
            if isinstance(stmt, cst.SimpleStatementLine):
                for small in stmt.body:
                    if isinstance(small, cst.AnnAssign) and isinstance(small.target, cst.Name):
                        fields.append(small.target.value)
        positional = [a for a in call.args if a.keyword is None and not a.star]
        if entry in fields:
            pos = fields.index(entry)
            if pos < len(positional):
                return positional[pos].value
        return None

    # ----- other files of the linted tree ------------------------------------------------------------------------
    def summary_of_call(self, call: cst.Call):
        """The summary of the function of another file of the linted tree that ``call`` runs, or None."""
        if self.project is None or self.callee(call) is not None:
            return None
        for qualname in self.call_targets(call):
            found = self.project.get(qualname)
            if found is not None:
                return found
        return None

    def method_summaries(self, call: cst.Call) -> list | None:
        """``x.m(...)`` where nothing in view says what ``x`` is (a constructor parameter kept as an attribute, an
        object from elsewhere) and nothing resolves the call: the summaries of the linted tree's methods named
        ``m`` (:meth:`Project.method_summaries`, a text index of the tree), or None. Not for ``self.m(...)``, a
        function of a module, a name this module defines a method of (its own classes are judged from its code)
        or a common name; the caller asks each definition and acts only when they all agree."""
        if self.project is None or type(call.func) is not cst.Attribute:
            return None
        hit = self._method_summaries.get(id(call), _MISSING)
        if hit is not _MISSING:
            return hit
        found = None
        func = call.func
        name = func.attr.value
        recv = func.value
        if not (isinstance(recv, cst.Name) and recv.value in ("self", "cls")) and \
                name not in self._method_names() and not self.is_module_function(call) and \
                self.callee(call) is None and not self.call_targets(call):
            found = self.project.method_summaries(name, exclude=self.path)
        self._method_summaries[id(call)] = found
        return found

    def element_role(self, call: cst.Call, position: int) -> tuple[str, int] | None:
        """(what, sign) of element ``position`` of the tuple that ``call`` (a function of another file of the
        tree) returns, when the call is unpacked into a tuple target of the arity the callee's returns have and
        every definition the call may run agrees (:meth:`method_summaries`): ``v, lp, ent, h =
        self.net.evaluate_actions(obs, act)`` gives ``ent`` the role the callee's code gives its third element."""
        summary = self.summary_of_call(call)
        candidates = [summary] if summary is not None else self.method_summaries(call)
        if not candidates:
            return None
        arity = _unpacked_arity(self, call)
        if arity is None or any(s.returns_arity != arity for s in candidates):
            return None
        roles = {s.element(position) for s in candidates}
        return roles.pop() if len(roles) == 1 else None

    def call_targets(self, call: cst.Call) -> list[str]:
        """Qualified names ``call`` may run in other modules: an imported function (``f()``, ``mod.f()``), a method
        inherited from an imported base class (``self.m()``), a method of an instance of an imported class."""
        func = call.func
        found = []
        dotted = dotted_name(func)
        if dotted is not None:
            resolved = self.resolve_import(dotted)
            if resolved is not None:
                found.append(resolved)
        if isinstance(func, cst.Attribute):
            receiver = func.value
            if isinstance(receiver, cst.Name) and receiver.value in ("self", "cls"):
                cls = self.enclosing_class(call)
                for base in (cls.bases if cls is not None else ()):
                    base_name = dotted_name(base.value)
                    qualified = self.resolve_import(base_name) if base_name else None
                    if qualified is not None:
                        found.append(f"{qualified}.{func.attr.value}")
            else:
                cls_name = self._instance_of_import(receiver)
                if cls_name is not None:
                    found.append(f"{cls_name}.{func.attr.value}")
        elif isinstance(func, cst.Name):
            cls_name = self._instance_of_import(func)
            if cls_name is not None:
                found += [f"{cls_name}.forward", f"{cls_name}.__call__"]
        return found

    def _instance_of_import(self, expr: cst.BaseExpression) -> str | None:
        key = key_of(expr)
        defs = self.flow.reaching(key, expr) if key else []
        names = set()
        for d in defs:
            value = d.value if d.kind == "assign" and d.element is None else None
            if not isinstance(value, cst.Call):
                return None
            func_name = dotted_name(value.func)
            resolved = self.resolve_import(func_name) if func_name else None
            if resolved is None:
                return None
            names.add(resolved)
        return names.pop() if len(names) == 1 else None

    def resolve_import(self, dotted: str) -> str | None:
        """``utils.f`` -> ``pkg.utils.f`` through this module's imports (relative ones too), or None when the
        head is not imported."""
        head, _, rest = dotted.partition(".")
        base = self.index.imports.get(head)
        if base is None and head in self.index.relative_imports and self.module_name:
            level, name = self.index.relative_imports[head]
            package = self.module_name.split(".")
            if not self.path.endswith("__init__.py"):
                package = package[:-1]
            if level - 1 > len(package):
                return None
            package = package[:len(package) - (level - 1)]
            base = ".".join([*package, name]) if package else name
        if base is None:
            return None
        return f"{base}.{rest}" if rest else base

    # ----- facets ----------------------------------------------------------------------------------------
    def release(self) -> None:
        """Drop the cached facets (they refer back to this analysis), so a file's tables are freed as soon as
        the rules are done with it. The facets' own tables are emptied too: their memos hold bound methods of
        other facets (a stop predicate, a sign query), cycles that only the collector could free otherwise."""
        facets = list(self.cache.values())
        self.cache.clear()
        self._callees.clear()
        for facet in facets:
            state = getattr(facet, "__dict__", None)
            if state is not None:
                state.clear()

    def facet(self, name: str, factory):
        """The module's cached instance of a facet or per-module fact table (built by ``factory(self)``)."""
        hit = self.cache.get(name)
        if hit is None:
            hit = self.cache[name] = factory(self)
        return hit



_MISSING = object()
_DEFAULT: list[Vocabulary] = []


def _default_vocabulary() -> Vocabulary:
    """One built-in vocabulary for the process: its answers are cached, so files share them."""
    if not _DEFAULT:
        _DEFAULT.append(Vocabulary())
    return _DEFAULT[0]
_CONVENTIONAL = {"F": "torch.nn.functional", "nn": "torch.nn", "functional": "torch.nn.functional",
                 "np": "numpy", "th": "torch"}


def _unpacked_arity(a: Analysis, call: cst.Call) -> int | None:
    """The number of names ``a, b, c = call`` unpacks the call's value into (one tuple target, no starred one)."""
    stmt = a.index.parent_of(call)
    if isinstance(stmt, cst.Assign) and stmt.value is call and len(stmt.targets) == 1:
        target = stmt.targets[0].target
        if isinstance(target, (cst.Tuple, cst.List)) and not any(
                isinstance(el, cst.StarredElement) for el in target.elements):
            return len(target.elements)
    return None


def _in_loop_header(loop, node, index: ModuleIndex) -> bool:
    header = loop.test if isinstance(loop, cst.While) else loop.iter
    return node is header or index.contains(header, node) or (
        isinstance(loop, cst.For) and (node is loop.target or index.contains(loop.target, node)))


__all__ = ["Analysis", "Def", "dotted_name", "key_of"]
