"""The module index: one iterative walk over a parsed module that every analysis and rule reads.

It records, for every node, its parent and its order in the walk; nodes by type; the import table; the scopes
(module, functions, lambdas and comprehensions) with their parameters and returns; functions and classes by name;
and every *definition* (what binds a name, an attribute or a dict key, and to which value), attached to the
statement that makes it and to its scope. Statements know their place in the enclosing suite, so the flow
analysis (:mod:`rlguard.lint.analysis.flow`) can walk backwards from any point without another tree walk.

The walk reads node fields directly and keeps an explicit stack: libcst's own visitor rebuilds every node it
passes (more costly than parsing) and recursion would bound the depth of nesting rlguard can read.
"""

from __future__ import annotations

import bisect
import dataclasses
import re
from dataclasses import dataclass, field
from typing import Iterator

import libcst as cst

# Nodes that open a scope of their own. A class body is one, but its names are not visible in its methods.
SCOPE_TYPES = (cst.Module, cst.FunctionDef, cst.ClassDef, cst.Lambda, cst.ListComp, cst.SetComp, cst.GeneratorExp,
               cst.DictComp)
COMPREHENSIONS = (cst.ListComp, cst.SetComp, cst.GeneratorExp, cst.DictComp)
# Statements that hold suites of other statements.
COMPOUND = (cst.If, cst.For, cst.While, cst.With, cst.Try, cst.FunctionDef, cst.ClassDef, cst.Match,
            getattr(cst, "TryStar", cst.Try))
SUITES = (cst.Module, cst.IndentedBlock, cst.SimpleStatementSuite, cst.SimpleStatementLine)
_SUITE_SET = frozenset(SUITES)
# Node types the walker does more for than record (exact types: isinstance on libcst's ABCs is slow).
_HANDLED = frozenset({*SCOPE_TYPES, cst.Assign, cst.AnnAssign, cst.AugAssign, cst.NamedExpr, cst.For, cst.CompFor,
                      cst.WithItem, cst.ExceptHandler, cst.Del, cst.Return, cst.Yield, cst.Import, cst.ImportFrom,
                      *COMPOUND})
_LEAVES = frozenset({*SCOPE_TYPES, *COMPOUND})


@dataclass(eq=False)
class Def:
    """One binding. ``key`` is what is bound: a name (``x``), an attribute path (``self.x``, ``cfg.lr``) or a
    dict key (``batch['mask']``). ``kind`` says how:

    - ``assign``: ``key = value`` (also ``x: T = value`` and ``(x := value)``); ``element`` is the position in a
      tuple target when the value could not be split (``a, b = f()`` gives ``element`` 0 and 1);
    - ``aug``: ``key op= value`` (``op`` the operator); the previous value of ``key`` is an operand;
    - ``for`` / ``comp``: a loop or comprehension target; ``value`` is the iterable; ``element`` as above;
    - ``with``: ``with value as key``;
    - ``param``: a parameter of ``scope`` (``value`` its default, if any);
    - ``import``, ``def`` (a function or class statement), ``del``, ``other`` (except-as, match captures...).
    """

    key: str
    kind: str
    value: cst.BaseExpression | None
    stmt: cst.CSTNode  # the statement (or comprehension/lambda for comp/param) that binds
    scope: cst.CSTNode
    order: int
    element: int | None = None
    op: cst.BaseAugOp | None = None
    target: cst.CSTNode | None = None  # the target expression as written

    def __repr__(self) -> str:  # pragma: no cover - debugging aid
        return f"Def({self.key!r}, {self.kind}, order={self.order}, element={self.element})"


@dataclass
class ScopeInfo:
    node: cst.CSTNode
    parent: "ScopeInfo | None"
    params: list[str] = field(default_factory=list)
    defs: dict[str, list[Def]] = field(default_factory=dict)  # key -> definitions in walk order
    returns: list[cst.Return] = field(default_factory=list)
    yields: bool = False
    cls: cst.ClassDef | None = None  # the class a method belongs to


def dotted_name(expr: cst.CSTNode | None) -> str | None:
    """``a.b.c`` for Name/Attribute chains, else None."""
    kind = type(expr)
    if kind is cst.Name:
        return expr.value
    parts = []
    while kind is cst.Attribute:
        parts.append(expr.attr.value)
        expr = expr.value
        kind = type(expr)
    if kind is not cst.Name:
        return None
    parts.append(expr.value)
    return ".".join(reversed(parts))


def string_key(index: cst.CSTNode) -> str | None:
    """The literal string of a subscript's single index (``d["mask"]`` -> ``mask``), else None."""
    if isinstance(index, cst.SubscriptElement):
        index = index.slice
    if isinstance(index, cst.Index):
        value = index.value
        if type(value) is cst.SimpleString:
            return simple_string_value(value)
        if isinstance(value, cst.ConcatenatedString):
            evaluated = value.evaluated_value
            return evaluated if isinstance(evaluated, str) else None
    return None


_PLAIN_STRING = re.compile(r"'[^'\\\n]*'" + r'|"[^"\\\n]*"')


def simple_string_value(node: cst.SimpleString) -> str | None:
    """The text of a str literal, None for bytes. A plain one-quoted literal with no prefix or escape (almost
    every subscript key) is read by slicing: libcst's ``evaluated_value`` runs ``ast.literal_eval`` on every
    call, and subscript keys are read millions of times per tree."""
    raw = node.value
    if _PLAIN_STRING.fullmatch(raw):
        return raw[1:-1]
    evaluated = node.evaluated_value
    return evaluated if isinstance(evaluated, str) else None


def key_of(expr: cst.CSTNode | None) -> str | None:
    """The flow key of an lvalue or a read: ``x``, ``self.x``, ``a.b``, ``d['k']``, ``self.buf['k']``;
    None for anything else (``d[i]``, ``f().x``)."""
    kind = type(expr)
    if kind is cst.Name:
        return expr.value
    if kind is cst.Subscript and len(expr.slice) == 1:
        key = string_key(expr.slice[0])
        base = key_of(expr.value)
        if key is not None and base is not None:
            return f"{base}[{key!r}]"
        return None
    return dotted_name(expr)


def key_entry(key: str) -> str | None:
    """The string key a key path ends in (``batch['mask']`` -> ``mask``), else None."""
    return key[key.rindex("['") + 2:-2] if key.endswith("']") else None


def last_name(key: str) -> str:
    """The name a key path ends in: its last string key or attribute (``batch['mask']`` -> ``mask``,
    ``self.cfg.beta`` -> ``beta``)."""
    entry = key_entry(key)
    return entry if entry is not None else key.rsplit(".", 1)[-1]


def names_read(expr: cst.CSTNode) -> list[cst.Name]:
    """The names an expression reads: ``obj.mask`` reads ``obj``, never the attribute name itself."""
    found: list[cst.Name] = []
    stack = [expr]
    while stack:
        node = stack.pop()
        if isinstance(node, cst.Name):
            found.append(node)
        elif isinstance(node, cst.Attribute):
            stack.append(node.value)
        else:
            stack.extend(children(node))
    return found


def read_name(expr: cst.CSTNode | None) -> str | None:
    """The name a read ends in: a name, an attribute's last part, a subscript's string key; else None."""
    if isinstance(expr, cst.Name):
        return expr.value
    if isinstance(expr, cst.Attribute):
        return expr.attr.value
    if isinstance(expr, cst.Subscript):
        key = key_of(expr)
        return key_entry(key) if key else None
    return None


_KEY_BASE = re.compile(r"[^.\[]*")


def key_base(key: str) -> str:
    """``d['k']`` -> ``d``; ``self.x`` -> ``self``; ``x`` -> ``x`` (the name a key path starts from)."""
    return _KEY_BASE.match(key).group()


_SKIP_FIELDS = frozenset({
    "lpar", "rpar", "lbracket", "rbracket", "lbrace", "rbrace", "leading_lines", "lines_after_decorators",
    "header", "footer", "comma", "semicolon", "equal", "colon", "first_colon", "second_colon", "star",
    "asynchronous", "trailing_whitespace", "indent", "encoding", "default_indent", "default_newline",
    "has_trailing_newline", "operator", "relative", "dot", "newline", "posonly_ind", "walrus", "arrow",
})
_CHILD_FIELDS: dict[type, tuple[str, ...]] = {}


def child_fields(cls: type) -> tuple[str, ...]:
    """The fields of a node class that can hold child nodes the analysis cares about, in source order
    (whitespace, brackets and operators left out: walking them is most of libcst's own visit cost)."""
    found = _CHILD_FIELDS.get(cls)
    if found is None:
        names = [f.name for f in dataclasses.fields(cls)
                 if f.name not in _SKIP_FIELDS and not f.name.startswith("whitespace")]
        if "decorators" in names:  # decorators come first in the source
            names.remove("decorators")
            names.insert(0, "decorators")
        if cls in COMPREHENSIONS or cls is cst.DictComp:
            # the `for` clause is evaluated before the element: index it first, so reads in the element follow
            # the comprehension's binding in walk order
            names.sort(key=lambda n: 0 if n == "for_in" else 1)
        found = _CHILD_FIELDS[cls] = tuple(names)
    return found


_NODE_TYPE: dict[type, bool] = {}


def _is_node_type(kind: type) -> bool:
    hit = _NODE_TYPE.get(kind)
    if hit is None:
        hit = _NODE_TYPE[kind] = issubclass(kind, cst.CSTNode)
    return hit


_PLANS: dict[type, tuple[tuple[str, ...], bool, bool, bool]] = {}


def _plan(kind: type) -> tuple[tuple[str, ...], bool, bool, bool]:
    """What the walker does at a node of ``kind``: its child fields (last first), whether it binds or opens
    something, whether its end is needed, whether it holds a suite of statements (one lookup per node)."""
    plan = _PLANS[kind] = (tuple(reversed(child_fields(kind))), kind in _HANDLED, kind in _LEAVES,
                           kind in _SUITE_SET)
    return plan


def children(node: cst.CSTNode) -> list[cst.CSTNode]:
    """The child nodes the analysis reads, in source order (a type lookup per field: isinstance against libcst's
    abstract node classes costs more than the walk itself)."""
    out = []
    for name in child_fields(type(node)):
        value = getattr(node, name)
        kind = type(value)
        if kind is list or kind is tuple:
            out.extend(v for v in value if _is_node_type(type(v)))
        elif _is_node_type(kind):
            out.append(value)
    return out


def params_of(params: cst.Parameters) -> list[cst.Param]:
    found = [*params.posonly_params, *params.params]
    if isinstance(params.star_arg, cst.Param):
        found.append(params.star_arg)
    found += list(params.kwonly_params)
    if params.star_kwarg is not None:
        found.append(params.star_kwarg)
    return found


class ModuleIndex:
    """Built once per file; read by the flow analysis, the value analyses and the rules."""

    def __init__(self, module: cst.Module):
        self.module = module
        self.parent: dict[int, cst.CSTNode] = {}
        self.order: dict[int, int] = {}
        self.by_type: dict[type, list[cst.CSTNode]] = {}
        self.imports: dict[str, str] = {}  # local name -> qualified name (absolute imports)
        self.relative_imports: dict[str, tuple[int, str]] = {}  # local name -> (level, "module.name")
        self.scopes: dict[int, ScopeInfo] = {}
        self.functions: dict[str, list[cst.FunctionDef]] = {}
        self.classes: dict[str, list[cst.ClassDef]] = {}
        self.class_defs: dict[int, dict[str, list[Def]]] = {}  # id(ClassDef) -> "self.x" -> defs in its methods
        self.stmt_defs: dict[int, list[Def]] = {}  # id(statement) -> its definitions
        # statement -> (suite node, position): where it sits in the sequence of statements that contains it
        self.position: dict[int, tuple[cst.CSTNode, int]] = {}
        self.defined_inside: dict[int, frozenset[str]] = {}  # id(compound statement) -> key bases defined in it
        self.scope_at: dict[int, cst.CSTNode] = {}  # id(node) -> the scope whose code it is
        self._statements: dict[int, cst.CSTNode] = {}
        self._multi: dict[tuple, list] = {}
        self._keys: dict[tuple, list[int]] = {}
        _Walker(self).walk()

    # ----- structure -------------------------------------------------------------------------------------------
    def nodes(self, *types: type) -> list[cst.CSTNode]:
        """All nodes of the given libcst types, in source order."""
        if len(types) == 1:
            return self.by_type.get(types[0], [])
        hit = self._multi.get(types)
        if hit is None:
            order = self.order
            found = [n for t in types for n in self.by_type.get(t, [])]
            hit = self._multi[types] = sorted(found, key=lambda n: order[id(n)])
        return hit

    def parent_of(self, node: cst.CSTNode) -> cst.CSTNode | None:
        return self.parent.get(id(node))

    def ancestors(self, node: cst.CSTNode) -> Iterator[cst.CSTNode]:
        current = self.parent.get(id(node))
        while current is not None:
            yield current
            current = self.parent.get(id(current))

    def contains(self, outer: cst.CSTNode, inner: cst.CSTNode) -> bool:
        return any(anc is outer for anc in self.ancestors(inner))

    def comes_before(self, a: cst.CSTNode, b: cst.CSTNode) -> bool:
        return self.order[id(a)] < self.order[id(b)]

    def descendants(self, node: cst.CSTNode, *types: type) -> list[cst.CSTNode]:
        """Indexed nodes of ``types`` that lie inside ``node`` (by walk order: a contiguous range)."""
        start = self.order[id(node)]
        end = self.subtree_end(node)
        nodes = self.nodes(*types)
        keys = self._order_keys(types, nodes)
        return nodes[bisect.bisect_right(keys, start):bisect.bisect_right(keys, end)]

    def _order_keys(self, types: tuple, nodes: list) -> list[int]:
        keys = self._keys.get(types)
        if keys is None or len(keys) != len(nodes):
            order = self.order
            keys = self._keys[types] = [order[id(n)] for n in nodes]
        return keys

    def subtree_end(self, node: cst.CSTNode) -> int:
        """The walk order of the last node inside ``node``."""
        end = self._ends.get(id(node))
        if end is None:
            end = self.order[id(node)]
            stack = [node]
            while stack:
                current = stack.pop()
                kids = children(current)
                if kids:
                    end = max(end, self.order[id(kids[-1])])
                    stack.append(kids[-1])
            self._ends[id(node)] = end
        return end

    def enclosing(self, node: cst.CSTNode, *types: type, stop: tuple[type, ...] = ()) -> cst.CSTNode | None:
        for anc in self.ancestors(node):
            if isinstance(anc, types):
                return anc
            if stop and isinstance(anc, stop):
                return None
        return None

    def enclosing_function(self, node: cst.CSTNode) -> cst.FunctionDef | None:
        return self.enclosing(node, cst.FunctionDef)

    def enclosing_class(self, node: cst.CSTNode) -> cst.ClassDef | None:
        """The class of the method ``node`` is in (the nearest function's class)."""
        func = node if isinstance(node, cst.FunctionDef) else self.enclosing_function(node)
        while func is not None:
            parent = self.enclosing(func, cst.ClassDef, cst.FunctionDef)
            if isinstance(parent, cst.ClassDef):
                return parent
            func = parent
        return None

    def scope_node(self, node: cst.CSTNode) -> cst.CSTNode:
        """The function, class body, lambda, comprehension or module whose code ``node`` is (a scope's own node
        belongs to the enclosing scope)."""
        return self.scope_at.get(id(node), self.module)

    def scope_of(self, node: cst.CSTNode) -> ScopeInfo:
        return self.scopes[id(self.scope_node(node))]

    def function_scope(self, node: cst.CSTNode) -> ScopeInfo:
        """The function (or module) scope of ``node``, looking through comprehensions, lambdas and classes."""
        info = self.scope_of(node)
        while not isinstance(info.node, (cst.FunctionDef, cst.Module)) and info.parent is not None:
            info = info.parent
        return info

    def in_other_branch(self, a: cst.CSTNode, b: cst.CSTNode) -> bool:
        """Whether ``a`` and ``b`` lie in different arms of one ``if``/``else``: alternative paths, so that neither
        runs before the other (an in-place ``z.div_(t)`` in one arm does not scale the ``z`` of the other)."""
        arm_of_b = {}
        child, node = b, self.parent.get(id(b))
        while node is not None:
            if isinstance(node, cst.If):
                arm_of_b[id(node)] = child is node.body
            child, node = node, self.parent.get(id(node))
        child, node = a, self.parent.get(id(a))
        while node is not None:
            if isinstance(node, cst.If) and id(node) in arm_of_b and child is not node.test:
                return arm_of_b[id(node)] != (child is node.body)
            child, node = node, self.parent.get(id(node))
        return False

    def statement_of(self, node: cst.CSTNode) -> cst.CSTNode:
        """The statement ``node`` belongs to: a small statement, or a compound statement for its header
        (``if`` test, ``for`` iterable, ``with`` items). A statement is its own statement."""
        memo = self._statements
        path = []
        current: cst.CSTNode | None = node
        found = None
        while current is not None:
            hit = memo.get(id(current))
            if hit is not None:
                found = hit
                break
            if id(current) in self.position:
                found = current
                break
            path.append(id(current))
            current = self.parent.get(id(current))
        found = found if found is not None else self.module
        for key in path:
            memo[key] = found
        return found

    def code(self, node: cst.CSTNode) -> str:
        return self.module.code_for_node(node)

    def methods(self, cls: cst.ClassDef) -> list[cst.FunctionDef]:
        return [s for s in cls.body.body if isinstance(s, cst.FunctionDef)] if isinstance(
            cls.body, cst.IndentedBlock) else []

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

    _ends: dict[int, int]


class _Walker:
    """One walk: parents, order, nodes by type, imports, scopes, definitions, statement positions."""

    def __init__(self, index: ModuleIndex):
        self.index = index
        index._ends = {}
        self.counter = 0
        self.scope_stack: list[ScopeInfo] = []
        self.compound_stack: list[tuple[cst.CSTNode, set[str]]] = []

    def walk(self) -> None:
        index = self.index
        parent_of, order, by_type, position, scope_at = (index.parent, index.order, index.by_type, index.position,
                                                          index.scope_at)
        leave = object()
        node_types = _NODE_TYPE
        plans = _PLANS
        scope_stack = self.scope_stack
        current_scope = None  # the innermost scope node open at this point of the walk
        counter = self.counter
        todo: list = [(index.module, None)]
        pop, push = todo.pop, todo.append
        while todo:
            item = pop()
            if item is leave:
                self.counter = counter
                self.on_leave(pop())
                counter = self.counter
                current_scope = scope_stack[-1].node if scope_stack else None
                continue
            node, parent = item
            kind = type(node)
            nid = id(node)
            if parent is not None:
                parent_of[nid] = parent
            order[nid] = counter
            counter += 1
            bucket = by_type.get(kind)
            if bucket is None:
                bucket = by_type[kind] = []
            bucket.append(node)
            scope_at[nid] = node if current_scope is None else current_scope
            plan = plans.get(kind)
            if plan is None:
                plan = _plan(kind)
            fields, handled, leaves, suite = plan
            if handled:
                self.counter = counter
                self.on_visit(node, parent)
                counter = self.counter
                if scope_stack:
                    current_scope = scope_stack[-1].node
            if leaves:  # scopes and compound statements need their end
                push(node)
                push(leave)
            if suite:
                for pos, stmt in enumerate(node.body):
                    position[id(stmt)] = (node, pos)
            # children pushed last field first, each sequence backwards: popped in source order
            for name in fields:
                value = getattr(node, name)
                vkind = type(value)
                if vkind is list or vkind is tuple:
                    for v in reversed(value):
                        is_node = node_types.get(type(v))
                        if is_node is None:
                            is_node = _is_node_type(type(v))
                        if is_node:
                            push((v, node))
                else:
                    is_node = node_types.get(vkind)
                    if is_node is None:
                        is_node = _is_node_type(vkind)
                    if is_node:
                        push((value, node))
        self.counter = counter

    # ----- enter / leave ------------------------------------------------------------------------------------
    def on_visit(self, node: cst.CSTNode, parent: cst.CSTNode | None) -> None:
        index = self.index
        if type(node) in SCOPE_TYPES:
            outer = self.scope_stack[-1] if self.scope_stack else None
            info = ScopeInfo(node, outer)
            index.scopes[id(node)] = info
            if type(node) in (cst.FunctionDef, cst.ClassDef) and outer is not None:
                self._define(node.name.value, "def", None, node, outer.node, target=node.name)
            if type(node) is cst.FunctionDef:
                info.cls = outer.node if outer is not None and type(outer.node) is cst.ClassDef else None
                index.functions.setdefault(node.name.value, []).append(node)
            elif type(node) is cst.ClassDef:
                index.classes.setdefault(node.name.value, []).append(node)
                index.class_defs[id(node)] = {}
            if type(node) in (cst.FunctionDef, cst.Lambda):
                for param in params_of(node.params):
                    name = param.name.value
                    info.params.append(name)
                    info.defs.setdefault(name, []).append(
                        Def(name, "param", param.default, param, node, self.counter, target=param.name))
            self.scope_stack.append(info)
        elif type(node) in (cst.Assign, cst.AnnAssign, cst.AugAssign, cst.NamedExpr):
            if type(node) is cst.Assign:
                for target in node.targets:
                    self._bind(target.target, node.value, node, "assign")
            elif type(node) is cst.AnnAssign:
                if node.value is not None:
                    self._bind(node.target, node.value, node, "assign")
            elif type(node) is cst.AugAssign:
                self._bind(node.target, node.value, node, "aug", op=node.operator)
            else:
                self._bind(node.target, node.value, self._statement_for_walrus(node), "assign")
        elif type(node) is cst.For:
            self._bind(node.target, node.iter, node, "for")
        elif type(node) is cst.CompFor:
            self._bind(node.target, node.iter, node, "comp")
        elif type(node) is cst.WithItem and node.asname is not None:
            self._bind(node.asname.name, node.item, self._with_statement(node), "with")
        elif type(node) is cst.ExceptHandler and node.name is not None:
            self._bind(node.name.name, None, node, "other")
        elif type(node) is cst.Del:
            self._bind(node.target, None, node, "del")
        elif type(node) is cst.Return:
            self.scope_stack[-1].returns.append(node)
        elif type(node) in (cst.Yield,):
            self.scope_stack[-1].yields = True
        elif type(node) is cst.Import:
            for alias in node.names:
                full = dotted_name(alias.name)
                if alias.asname is not None and type(alias.asname.name) is cst.Name:
                    local = alias.asname.name.value
                    index.imports[local] = full
                elif full:
                    local = full.split(".")[0]
                    index.imports.setdefault(local, local)
                else:
                    continue
                self._define(local, "import", None, node, self.scope_stack[-1].node)
        elif type(node) is cst.ImportFrom:
            self._import_from(node)
        if type(node) in COMPOUND and not type(node) in (cst.FunctionDef, cst.ClassDef):
            self.compound_stack.append((node, set()))

    def on_leave(self, node: cst.CSTNode) -> None:
        if type(node) in SCOPE_TYPES:
            self.scope_stack.pop()
        if type(node) in COMPOUND and not type(node) in (cst.FunctionDef, cst.ClassDef):
            compound, keys = self.compound_stack.pop()
            self.index.defined_inside[id(compound)] = frozenset(keys)
            if self.compound_stack:
                self.compound_stack[-1][1].update(keys)

    # ----- helpers ------------------------------------------------------------------------------------------
    def _statement_for_walrus(self, node: cst.CSTNode) -> cst.CSTNode:
        # a walrus binds in the enclosing statement (its value is read by what follows)
        current = self.index.parent.get(id(node))
        while current is not None and not isinstance(current, (cst.BaseSmallStatement, cst.BaseCompoundStatement)):
            current = self.index.parent.get(id(current))
        return current or node

    def _with_statement(self, item: cst.WithItem) -> cst.CSTNode:
        return self.index.parent.get(id(item)) or item

    def _import_from(self, node: cst.ImportFrom) -> None:
        index = self.index
        if isinstance(node.names, cst.ImportStar):
            return
        base = dotted_name(node.module) if node.module is not None else ""
        level = len(node.relative)
        for alias in node.names:
            name = dotted_name(alias.name)
            local = alias.asname.name.value if alias.asname is not None and isinstance(
                alias.asname.name, cst.Name) else name
            if not name or not local:
                continue
            if level:
                index.relative_imports[local] = (level, f"{base}.{name}" if base else name)
            elif base:
                index.imports[local] = f"{base}.{name}"
            self._define(local, "import", None, node, self.scope_stack[-1].node)

    def _define(self, key: str, kind: str, value, stmt, scope, element=None, op=None, target=None) -> Def:
        index = self.index
        d = Def(key, kind, value, stmt, scope, self.counter, element, op, target)
        self.counter += 1  # definitions order between the nodes they sit in
        info = index.scopes[id(scope)]
        info.defs.setdefault(key, []).append(d)
        index.stmt_defs.setdefault(id(stmt), []).append(d)
        if self.compound_stack:
            self.compound_stack[-1][1].add(key_base(key))
        return d

    def _bind(self, target: cst.CSTNode, value, stmt, kind: str, op=None, element: int | None = None) -> None:
        if isinstance(target, (cst.Tuple, cst.List)):
            elements = [el.value for el in target.elements]
            starred = any(isinstance(el, cst.StarredElement) for el in target.elements)
            if kind == "assign" and not starred and isinstance(value, (cst.Tuple, cst.List)) and len(
                    value.elements) == len(elements) and not any(
                    isinstance(v, cst.StarredElement) for v in value.elements):
                for el, val in zip(elements, value.elements):
                    self._bind(el, val.value, stmt, kind, op)
            elif element is not None and kind == "assign":
                # `(a, b), c = f()`: a position inside an element of a value that could not be split has no
                # `element` to name it (`a` is not element 0 of `f()`): a binding of unknown value
                for el in elements:
                    self._bind(el, value, stmt, "other", op)
            else:
                for pos, el in enumerate(elements):
                    self._bind(el, value, stmt, kind, op, element=None if starred else pos)
            return
        if isinstance(target, cst.StarredElement):
            target = target.value
            element = None
        key = key_of(target)
        scope = self.scope_stack[-1].node
        if key is None:
            if isinstance(target, cst.Subscript):
                # d[i] = v with a computed index (or d[i][s] = v): a store into `d` that key paths cannot follow
                root = target.value
                while isinstance(root, cst.Subscript) and key_of(root) is None:
                    root = root.value
                base = key_of(root)
                if base is not None:
                    self._define(base + "[?]", "other", value, stmt, scope, target=target)
            return
        d = self._define(key, kind, value, stmt, scope, element, op, target)
        if key.startswith(("self.", "cls.")):
            cls = self._method_class()
            if cls is not None:
                self.index.class_defs[id(cls)].setdefault(key, []).append(d)

    def _method_class(self) -> cst.ClassDef | None:
        for info in reversed(self.scope_stack):
            if isinstance(info.node, cst.FunctionDef):
                return info.cls
        return None
