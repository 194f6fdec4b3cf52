"""What the rules know about one module: an index of its nodes, its imports, and a little data flow.

Full libcst scope metadata costs several times the parse itself, so rlguard computes only what its rules need,
in one walk over the tree:

- parents of every node, so a rule can ask what encloses a node (function, loops, ``with`` blocks);
- the import table, so ``F.pad`` is known as ``torch.nn.functional.pad`` and ``from copy import copy as cp``
  as ``copy.copy``;
- per function (and per class, for ``self.x``), the assignments to each name, so a rule can follow aliases
  (``m = batch["action_mask"]; loss_mask = m``), tuple unpacking, slices, ``F.pad``/``torch.roll`` and
  method chains back to where a value came from, and into the returns of small helpers of the same module.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import libcst as cst

from rlguard.lint.names import Vocabulary

# Methods that return "the same tensor" for the purpose of following a value back to its origin.
PASS_THROUGH_METHODS = frozenset({
    "float", "double", "half", "bfloat16", "bool", "long", "int", "to", "type", "type_as", "contiguous",
    "clone", "detach", "cpu", "cuda", "view", "reshape", "view_as", "reshape_as", "squeeze", "unsqueeze",
    "expand", "expand_as", "flatten", "requires_grad_", "detach_", "eval", "train", "float_", "as_subclass",
})
# Functions whose first argument is "the same tensor", moved or padded.
PASS_THROUGH_FUNCTIONS = frozenset({
    "torch.nn.functional.pad", "torch.roll", "torch.clone", "torch.flatten", "torch.squeeze",
    "torch.unsqueeze", "torch.narrow", "torch.as_tensor", "torch.tensor",
})
GRAD_OFF_CONTEXTS = frozenset({"torch.no_grad", "torch.inference_mode", "torch.autograd.no_grad",
                               "torch.autograd.grad_mode.no_grad", "torch.autograd.grad_mode.inference_mode"})

Scope = cst.FunctionDef | cst.Module


@dataclass
class Assignment:
    """``target = value`` as seen by data flow. ``value`` is None when the value is not one expression
    (``for x in ...``, ``with ... as x``, an augmented assignment keeps ``op``)."""

    target: str
    value: cst.BaseExpression | None
    statement: cst.CSTNode
    index: int  # order of the statement within the module walk
    op: cst.BaseAugOp | None = None
    unpacked: int | None = None  # position in a tuple target when the value could not be split


@dataclass
class ScopeInfo:
    node: Scope
    assignments: dict[str, list[Assignment]] = field(default_factory=dict)
    returns: list[cst.Return] = field(default_factory=list)
    params: list[str] = field(default_factory=list)


class ModuleContext:
    """Everything a rule may ask about one parsed module. Built once per file, shared by all rules."""

    def __init__(self, module: cst.Module, path: str = "<string>", vocabulary: Vocabulary | None = None):
        self.module = module
        self.path = path
        self.names = vocabulary or Vocabulary()
        self.parent: dict[int, cst.CSTNode] = {}
        self.order: dict[int, int] = {}
        self.imports: dict[str, str] = {}  # local name -> qualified name
        self.scopes: dict[int, ScopeInfo] = {}
        self.functions: dict[str, list[cst.FunctionDef]] = {}
        self.class_attrs: dict[int, dict[str, list[Assignment]]] = {}  # id(ClassDef) -> "self.x" -> assignments
        self.by_type: dict[type, list[cst.CSTNode]] = {}
        _Indexer(self).index()

    # ----- structure -------------------------------------------------------------------------------------
    def nodes(self, *types: type) -> list[cst.CSTNode]:
        """All nodes of the given libcst types, in source order."""
        if len(types) == 1:
            return self.by_type.get(types[0], [])
        found = [n for t in types for n in self.by_type.get(t, [])]
        return sorted(found, key=lambda n: self.order[id(n)])

    def parent_of(self, node: cst.CSTNode) -> cst.CSTNode | None:
        return self.parent.get(id(node))

    def ancestors(self, node: cst.CSTNode) -> Iterator[cst.CSTNode]:
        current = self.parent.get(id(node))
        while current is not None:
            yield current
            current = self.parent.get(id(current))

    def enclosing_function(self, node: cst.CSTNode) -> cst.FunctionDef | None:
        for anc in self.ancestors(node):
            if isinstance(anc, cst.FunctionDef):
                return anc
        return None

    def enclosing_class(self, node: cst.CSTNode) -> cst.ClassDef | None:
        for anc in self.ancestors(node):
            if isinstance(anc, cst.ClassDef):
                return anc
        return None

    def enclosing_loops(self, node: cst.CSTNode) -> list[cst.For | cst.While]:
        """Loops around ``node`` inside its function, innermost first."""
        loops = []
        for anc in self.ancestors(node):
            if isinstance(anc, (cst.FunctionDef, cst.ClassDef)):
                break
            if isinstance(anc, (cst.For, cst.While)):
                loops.append(anc)
        return loops

    def comes_before(self, a: cst.CSTNode, b: cst.CSTNode) -> bool:
        return self.order[id(a)] < self.order[id(b)]

    def contains(self, outer: cst.CSTNode, inner: cst.CSTNode) -> bool:
        return any(anc is outer for anc in self.ancestors(inner))

    def descendants(self, node: cst.CSTNode, *types: type) -> list[cst.CSTNode]:
        """Indexed nodes of ``types`` that lie inside ``node``."""
        return [n for n in self.nodes(*types) if self.contains(node, n)]

    # ----- names ----------------------------------------------------------------------------------------
    def qualified_name(self, expr: cst.BaseExpression) -> str | None:
        """``F.pad`` -> ``torch.nn.functional.pad`` through the module's imports; None for non-dotted exprs."""
        dotted = dotted_name(expr)
        if dotted is None:
            return None
        head, _, rest = dotted.partition(".")
        base = self.imports.get(head)
        if base is None:
            return dotted
        return f"{base}.{rest}" if rest else base

    def call_name(self, call: cst.Call) -> str | None:
        return self.qualified_name(call.func)

    def is_grad_disabled(self, node: cst.CSTNode) -> bool:
        """Inside ``with torch.no_grad()``/``inference_mode()``/``set_grad_enabled(False)``, or a function
        decorated with one of them (the nearest function only: a nested def runs later, elsewhere)."""
        for anc in self.ancestors(node):
            if isinstance(anc, cst.With):
                for item in anc.items:
                    if self._is_grad_off_call(item.item):
                        return True
            elif isinstance(anc, (cst.FunctionDef, cst.Lambda)):
                if isinstance(anc, cst.FunctionDef):
                    return any(self._is_grad_off_call(d.decorator) for d in anc.decorators)
                return False
        return False

    def _is_grad_off_call(self, expr: cst.BaseExpression) -> bool:
        target = expr.func if isinstance(expr, cst.Call) else expr
        name = self.qualified_name(target)
        if name in GRAD_OFF_CONTEXTS:
            return True
        if name in ("torch.set_grad_enabled", "torch.enable_grad") and isinstance(expr, cst.Call):
            return bool(expr.args) and isinstance(expr.args[0].value, cst.Name) and expr.args[0].value.value == "False"
        return False

    # ----- data flow ------------------------------------------------------------------------------------
    def scope_of(self, node: cst.CSTNode) -> ScopeInfo:
        func = self.enclosing_function(node)
        return self.scopes[id(func if func is not None else self.module)]

    def assignments_to(self, name: str, at: cst.CSTNode) -> list[Assignment]:
        """Assignments to ``name`` visible from ``at``: in its function, for ``self.x`` in its class's
        methods, and module-level ones for names the function does not assign."""
        if name.startswith("self."):
            cls = self.enclosing_class(at)
            return self.class_attrs.get(id(cls), {}).get(name, []) if cls is not None else []
        scope = self.scope_of(at)
        found = scope.assignments.get(name)
        if found is None and scope.node is not self.module and name not in scope.params:
            found = self.scopes[id(self.module)].assignments.get(name)
        return found or []

    def reaching_assignments(self, name: str, at: cst.CSTNode) -> list[Assignment]:
        """The assignments that may give ``name`` its value at ``at``: the last one before it in straight-line
        order, plus any later ones in the same loop (they reach the next iteration)."""
        assigns = self.assignments_to(name, at)
        if not assigns or name.startswith("self."):
            return assigns
        at_index = self.order[id(at)]
        before = [a for a in assigns if a.index < at_index]
        reach = before[-1:] if before else []
        for loop in self.enclosing_loops(at):
            reach += [a for a in assigns if a.index > at_index and self.contains(loop, a.statement)]
        return reach or assigns

    def origins(self, expr: cst.BaseExpression, depth: int = 12) -> list[cst.BaseExpression]:
        """The expressions ``expr`` may have come from, following names, pass-through methods and functions,
        subscripts and calls of same-module helpers that return a parameter. ``expr`` itself comes first."""
        out: list[cst.BaseExpression] = []
        seen: set[int] = set()

        def walk(e: cst.BaseExpression, d: int) -> None:
            if id(e) in seen or d < 0:
                return
            seen.add(id(e))
            out.append(e)
            inner = strip_wrappers(self, e)
            if inner is not e:
                walk(inner, d - 1)
                return
            if isinstance(e, (cst.Name, cst.Attribute)):
                key = dotted_name(e)
                if key is not None and (isinstance(e, cst.Name) or key.startswith("self.")):
                    for a in self.reaching_assignments(key, e):
                        if a.value is not None:
                            walk(a.value, d - 1)
            elif isinstance(e, cst.Call):
                for ret in self.helper_return_values(e):
                    walk(ret, d - 1)

        walk(expr, depth)
        return out

    def role_names(self, expr: cst.BaseExpression) -> list[str]:
        """Names along the origin chain of ``expr`` (variables, ``self.x``, dict keys ``batch["mask"]``)."""
        names = []
        for e in self.origins(expr):
            n = value_name(e)
            if n is not None and n not in names:
                names.append(n)
        return names

    def has_role(self, expr: cst.BaseExpression, role: str) -> bool:
        return any(self.names.is_role(n, role) for n in self.role_names(expr))

    def helper_return_values(self, call: cst.Call) -> list[cst.BaseExpression]:
        """For ``make_ref(policy)`` with ``def make_ref(model): return model`` in this module: ``policy``.
        Returns that are not a bare parameter come back as they are."""
        if not isinstance(call.func, cst.Name):
            return []
        defs = self.functions.get(call.func.value)
        if not defs or len(defs) != 1:
            return []
        info = self.scopes[id(defs[0])]
        values: list[cst.BaseExpression] = []
        for ret in info.returns:
            if ret.value is None:
                continue
            value = ret.value
            if isinstance(value, cst.Name) and value.value in info.params:
                pos = info.params.index(value.value)
                arg = _argument(call, pos, value.value)
                if arg is not None:
                    values.append(arg)
                    continue
            values.append(value)
        return values


def _argument(call: cst.Call, position: int, keyword: str) -> cst.BaseExpression | None:
    for arg in call.args:
        if arg.keyword is not None and arg.keyword.value == keyword:
            return arg.value
    positional = [a for a in call.args if a.keyword is None and not a.star]
    return positional[position].value if position < len(positional) else None


def argument(call: cst.Call, position: int | None, keyword: str | None = None) -> cst.BaseExpression | None:
    """The value of a call's argument by keyword, else by position (None when absent)."""
    for arg in call.args:
        if keyword is not None and arg.keyword is not None and arg.keyword.value == keyword:
            return arg.value
    if position is None:
        return None
    positional = [a for a in call.args if a.keyword is None and not a.star]
    return positional[position].value if position < len(positional) else None


def dotted_name(expr: cst.BaseExpression) -> str | None:
    """``a.b.c`` for Name/Attribute chains, else None."""
    parts = []
    while isinstance(expr, cst.Attribute):
        parts.append(expr.attr.value)
        expr = expr.value
    if not isinstance(expr, cst.Name):
        return None
    parts.append(expr.value)
    return ".".join(reversed(parts))


def value_name(expr: cst.BaseExpression) -> str | None:
    """The name a value is known by: ``x`` -> "x", ``self.x`` -> "self.x", ``obj.x`` -> "x",
    ``batch["action_mask"]`` -> "action_mask", ``out.logits`` -> "logits"."""
    if isinstance(expr, cst.Name):
        return expr.value
    if isinstance(expr, cst.Attribute):
        dotted = dotted_name(expr)
        if dotted is not None and dotted.startswith("self.") and dotted.count(".") == 1:
            return dotted
        return expr.attr.value
    if isinstance(expr, cst.Subscript) and len(expr.slice) == 1:
        index = expr.slice[0].slice
        if isinstance(index, cst.Index) and isinstance(index.value, cst.SimpleString):
            return index.value.evaluated_value if isinstance(index.value.evaluated_value, str) else None
    return None


def strip_wrappers(ctx: ModuleContext, expr: cst.BaseExpression) -> cst.BaseExpression:
    """One step from a derived value back to the tensor it derives from: ``x.float()`` -> ``x``,
    ``F.pad(x, ...)`` -> ``x``, ``x[:, 1:]`` -> ``x`` (but ``batch["k"]`` stays), ``(x)`` -> ``x``."""
    if isinstance(expr, cst.Call):
        if isinstance(expr.func, cst.Attribute) and expr.func.attr.value in PASS_THROUGH_METHODS:
            return expr.func.value
        if ctx.call_name(expr) in PASS_THROUGH_FUNCTIONS and expr.args:
            return expr.args[0].value
    if isinstance(expr, cst.Subscript) and value_name(expr) is None:
        return expr.value
    return expr


def slice_text(module: cst.Module, sub: cst.Subscript) -> str:
    """The subscript's index as written, whitespace removed: ``x[:, 1:]`` -> ``:,1:``."""
    return "".join(module.code_for_node(s) for s in sub.slice).replace(" ", "").rstrip(",")


_SKIP_FIELDS = frozenset({
    "lpar", "rpar", "lbracket", "rbracket", "lbrace", "rbrace", "leading_lines", "lines_after_decorators",
    "header", "footer", "comma", "semicolon", "equal", "colon", "first_colon", "second_colon", "star",
    "asynchronous", "trailing_whitespace", "indent", "encoding", "default_indent", "default_newline",
    "has_trailing_newline", "operator", "relative", "dot", "newline", "posonly_ind", "walrus", "arrow",
})
_CHILD_FIELDS: dict[type, tuple[str, ...]] = {}


def _child_fields(cls: type) -> tuple[str, ...]:
    """The fields of a node class that can hold child nodes the rules care about, in source order
    (whitespace, brackets and operators left out: walking them is most of libcst's own visit cost)."""
    found = _CHILD_FIELDS.get(cls)
    if found is None:
        names = [f.name for f in dataclasses.fields(cls)
                 if f.name not in _SKIP_FIELDS and not f.name.startswith("whitespace")]
        if "decorators" in names:  # decorators come first in the source
            names.remove("decorators")
            names.insert(0, "decorators")
        found = _CHILD_FIELDS[cls] = tuple(names)
    return found


class _Indexer:
    """One walk: parents, order, nodes by type, imports, assignments per scope, returns, functions.

    It reads node fields directly instead of using ``Module.visit``: libcst's visitor rebuilds every node
    it passes, which alone costs more than parsing.
    """

    def __init__(self, ctx: ModuleContext):
        self.ctx = ctx
        self.stack: list[cst.CSTNode] = []
        self.scope_stack: list[ScopeInfo] = []
        self.class_stack: list[cst.ClassDef] = []
        self.counter = 0

    def index(self) -> None:
        leave = object()
        todo: list = [self.ctx.module]
        while todo:
            node = todo.pop()
            if node is leave:
                self.on_leave(todo.pop())
                continue
            self.on_visit(node)
            todo.append(node)
            todo.append(leave)
            children = []
            for name in _child_fields(type(node)):
                value = getattr(node, name)
                if isinstance(value, cst.CSTNode):
                    children.append(value)
                elif isinstance(value, (list, tuple)):
                    children.extend(v for v in value if isinstance(v, cst.CSTNode))
            todo.extend(reversed(children))

    def on_visit(self, node: cst.CSTNode) -> bool:
        ctx = self.ctx
        if self.stack:
            ctx.parent[id(node)] = self.stack[-1]
        self.stack.append(node)
        ctx.order[id(node)] = self.counter
        self.counter += 1
        ctx.by_type.setdefault(type(node), []).append(node)
        if isinstance(node, (cst.Module, cst.FunctionDef)):
            info = ScopeInfo(node)
            if isinstance(node, cst.FunctionDef):
                params = node.params
                info.params = [p.name.value for p in (*params.posonly_params, *params.params,
                                                       *params.kwonly_params)]
                for star in (params.star_arg, params.star_kwarg):
                    if isinstance(star, cst.Param):
                        info.params.append(star.name.value)
                ctx.functions.setdefault(node.name.value, []).append(node)
            ctx.scopes[id(node)] = info
            self.scope_stack.append(info)
        elif isinstance(node, cst.ClassDef):
            self.class_stack.append(node)
            ctx.class_attrs[id(node)] = {}
        elif isinstance(node, cst.Assign):
            for target in node.targets:
                self._bind(target.target, node.value, node)
        elif isinstance(node, cst.AnnAssign) and node.value is not None:
            self._bind(node.target, node.value, node)
        elif isinstance(node, cst.AugAssign):
            self._bind(node.target, None, node, op=node.operator)
        elif isinstance(node, cst.NamedExpr):
            self._bind(node.target, node.value, node)
        elif isinstance(node, (cst.For, cst.CompFor)):
            self._bind(node.target, None, node)
        elif isinstance(node, cst.WithItem) and node.asname is not None:
            self._bind(node.asname.name, None, node)
        elif isinstance(node, cst.Return):
            self.scope_stack[-1].returns.append(node)
        elif isinstance(node, cst.Import):
            for alias in node.names:
                full = dotted_name(alias.name)
                if alias.asname is not None and isinstance(alias.asname.name, cst.Name):
                    ctx.imports[alias.asname.name.value] = full
                elif full:
                    head = full.split(".")[0]
                    ctx.imports.setdefault(head, head)
        elif isinstance(node, cst.ImportFrom) and node.module is not None and not node.relative:
            base = dotted_name(node.module)
            if base and not isinstance(node.names, cst.ImportStar):
                for alias in node.names:
                    name = dotted_name(alias.name)
                    local = alias.asname.name.value if alias.asname is not None and isinstance(
                        alias.asname.name, cst.Name) else name
                    if name and local:
                        ctx.imports[local] = f"{base}.{name}"
        return True

    def on_leave(self, original_node: cst.CSTNode) -> None:
        self.stack.pop()
        if isinstance(original_node, (cst.Module, cst.FunctionDef)):
            self.scope_stack.pop()
        elif isinstance(original_node, cst.ClassDef):
            self.class_stack.pop()

    def _bind(self, target: cst.BaseExpression, value: cst.BaseExpression | None, stmt: cst.CSTNode,
              op: cst.BaseAugOp | None = None, unpacked: int | None = None) -> None:
        if isinstance(target, (cst.Tuple, cst.List)):
            elements = [el.value for el in target.elements]
            if isinstance(value, (cst.Tuple, cst.List)) and len(value.elements) == len(elements):
                for el, val in zip(elements, value.elements):
                    self._bind(el, val.value, stmt, op)
            else:
                for pos, el in enumerate(elements):
                    self._bind(el, value, stmt, op, unpacked=pos)
            return
        if isinstance(target, cst.StarredElement):
            target = target.value
        name = dotted_name(target)
        if name is None:
            return
        assignment = Assignment(name, value, stmt, self.counter, op, unpacked)
        if name.startswith("self.") and name.count(".") == 1 and self.class_stack:
            self.ctx.class_attrs[id(self.class_stack[-1])].setdefault(name, []).append(assignment)
        elif "." not in name:
            self.scope_stack[-1].assignments.setdefault(name, []).append(assignment)


def first_arg(call: cst.Call) -> cst.BaseExpression | None:
    return call.args[0].value if call.args else None


def method_name(call: cst.Call) -> str | None:
    """``x.backward()`` -> "backward"; None for calls of bare names."""
    return call.func.attr.value if isinstance(call.func, cst.Attribute) else None


def receiver(call: cst.Call) -> cst.BaseExpression | None:
    """``opt.step()`` -> ``opt``."""
    return call.func.value if isinstance(call.func, cst.Attribute) else None


def iter_calls(ctx: ModuleContext, method: str | Sequence[str]) -> Iterator[cst.Call]:
    """Every call of a method with this name (``.backward()``, ``.step()``), in source order."""
    methods = {method} if isinstance(method, str) else set(method)
    for call in ctx.nodes(cst.Call):
        if method_name(call) in methods:
            yield call


def signed_terms(expr: cst.BaseExpression, sign: int = 1) -> list[tuple[int, cst.BaseExpression]]:
    """Split a sum into (sign, term) pairs: ``a - c * b + (-d)`` -> [(+1, a), (-1, c * b), (-1, d)].
    A product or quotient is one term; a negated factor in it flips the term's sign."""
    while isinstance(expr, cst.UnaryOperation) and isinstance(expr.operator, (cst.Minus, cst.Plus)):
        if isinstance(expr.operator, cst.Minus):
            sign = -sign
        expr = expr.expression
    if isinstance(expr, cst.BinaryOperation) and isinstance(expr.operator, (cst.Add, cst.Subtract)):
        right_sign = sign if isinstance(expr.operator, cst.Add) else -sign
        return signed_terms(expr.left, sign) + signed_terms(expr.right, right_sign)
    if isinstance(expr, cst.BinaryOperation) and isinstance(expr.operator, (cst.Multiply, cst.Divide)):
        for side in (expr.left, expr.right):
            if isinstance(side, cst.UnaryOperation) and isinstance(side.operator, cst.Minus):
                sign = -sign
    return [(sign, expr)]


def factors(expr: cst.BaseExpression) -> list[cst.BaseExpression]:
    """The factors of a product/quotient, negations and parentheses stripped: ``-c * x.mean()`` -> [c, x.mean()]."""
    while isinstance(expr, cst.UnaryOperation):
        expr = expr.expression
    if isinstance(expr, cst.BinaryOperation) and isinstance(expr.operator, (cst.Multiply, cst.Divide)):
        return factors(expr.left) + factors(expr.right)
    return [expr]
