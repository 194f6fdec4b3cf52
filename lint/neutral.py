"""Neutral names: a file's own identifiers renamed, consistently and per scope, to ones that say nothing.

A name is a hint, never proof. The engine lints a file that has findings once more with its private names
(function locals, loop, comprehension, ``with`` and ``except`` targets, the module's lower-case variables, the
attributes it assigns on ``self``) replaced by neutral ones (``v1``, ``a1``...), and a finding that does not
survive is reported only in preview mode: it rests on what a variable is called, not on what the code does.
Interface names stay: functions, methods, classes, parameters and keyword names at call sites, imports,
class-body names, string keys and attributes of other receivers, since callers and libraries see them.

Scopes follow Python's rules (any binding in a function makes the name local there; comprehensions are their own
scope, but a walrus in one binds outside it; class bodies are invisible to nested scopes). Whenever a name is not
fully understood it is kept: reflection (``locals()``, ``vars()``, ``eval``...), ``f"{x=}"``, names in
annotations, dunder names, attributes also read on another receiver, spelt in a string, or owned by a framework
base class. Only identifiers change, in place: no line or column moves. ``benchmarks/rename.py`` runs the same
renaming over whole trees, with self-checks (same bytecode, same symbol tables).
"""

from __future__ import annotations

import ast
import builtins
import re
from collections import defaultdict
from dataclasses import dataclass

# Calls that read a scope's names by their spelling: a scope that makes one keeps its names (and its nested ones).
REFLECTIVE = frozenset({"locals", "globals", "vars", "dir", "eval", "exec"})
READS_GLOBALS = frozenset({"globals", "eval", "exec"})  # locals(), vars(), dir() see a function's own names only
FRAME_ATTRS = frozenset({"_getframe", "currentframe", "f_locals"})
# Bases that carry no state of their own: a class with only these (or in-file classes) has no external base.
STATELESS_BASES = frozenset({"object", "ABC", "Generic", "Protocol"})
# Attributes a framework base class owns and reads itself (assigned by a subclass, read by the library): kept in
# a class that has a base from outside the file.
LIBRARY_ATTRS = frozenset({
    # torch.nn.Module
    "training",
    # transformers.Trainer and trl's trainers
    "model", "model_wrapped", "args", "optimizer", "lr_scheduler", "accelerator", "state", "control",
    "callback_handler", "processing_class", "tokenizer", "train_dataset", "eval_dataset", "data_collator",
    "compute_metrics", "callbacks", "deepspeed", "is_deepspeed_enabled", "is_fsdp_enabled", "place_model_on_device",
    "hp_name", "use_apex", "current_flos", "label_names", "neftune_noise_alpha", "is_in_train", "ref_model",
    # PreTrainedModel / PretrainedConfig
    "config", "main_input_name", "base_model_prefix",
    # lightning
    "trainer", "automatic_optimization", "hparams",
    # gym(nasium).Env
    "observation_space", "action_space", "reward_range", "metadata", "spec", "render_mode", "np_random",
    # threading.Thread, Exception
    "daemon", "name",
})
IDENT = re.compile(r"\w+")
WORDS = re.compile(r"(?:\w|[^\x00-\x7f])+")  # identifiers, with the non-ASCII marks \w leaves out (l\u0304)
_LINES = re.compile(r"\r\n|\r|\n")  # line ends as CPython and libcst count them


# ----- renaming --------------------------------------------------------------------------------------------------

@dataclass
class Renaming:
    source: str  # the renamed source
    local_count: int  # (scope, name) bindings renamed
    attr_count: int  # self-attributes renamed
    locals: dict[str, list[str]]  # original name -> the neutral names it got (one per scope)
    attrs: dict[str, str]  # original attribute -> neutral name
    module_names: bool = True  # module-level variables were renamed too

    @property
    def count(self) -> int:
        return self.local_count + self.attr_count


# Binding kinds a renamed name may have: anything else (a parameter, an import, a def or class) makes the name
# interface, and it is kept.
PLAIN = frozenset({"assign", "del", "walrus", "except", "match"})
_FUNCS = (ast.FunctionDef, ast.AsyncFunctionDef)
# f"{x=}" prints the spelling of x: an `=` closing a replacement field (not ==, !=, <=, >=, :=).
_FSTRING_DEBUG = re.compile(r"[^=!<>:]=\s*[}!:]")
_CONSTANT = re.compile(r"^_*[A-Z][A-Z0-9_]*$")


class _Scope:
    __slots__ = ("kind", "node", "parent", "bindings", "declared", "uses", "tainted", "star", "resolved", "order")

    def __init__(self, kind: str, node, parent: "_Scope | None"):
        self.kind = kind  # module, class, function, lambda, comprehension
        self.node = node
        self.parent = parent
        # name -> [(kind, occurrence)]: an occurrence is (how, node) with how in name/except/matchas/matchstar/
        # matchrest (where the identifier is), None for a binding that is never renamed (def, class, import, param)
        self.bindings: dict[str, list] = defaultdict(list)
        self.declared: set[str] = set()  # global / nonlocal here
        self.uses: list[ast.Name] = []
        self.tainted = False
        self.star = False  # from x import *
        self.resolved: dict[str, list] = defaultdict(list)  # reads (anywhere) that resolve to a local here
        self.order: dict[str, int] = {}

    def in_lambda(self) -> bool:
        s = self
        while s is not None:
            if s.kind == "lambda":
                return True
            s = s.parent
        return False


class _Binder:
    """Python's scoping rules over an ``ast`` tree, in one pass: what each scope binds, and each Name read there.
    Names declared global/nonlocal, type parameters and words in string annotations are pinned (kept)."""

    def __init__(self, text: "_Text"):
        self.text = text
        self.module_scope = _Scope("module", None, None)
        self.scope = self.module_scope
        self.scopes = [self.module_scope]
        self.attributes: list[ast.Attribute] = []
        self.classes: list[tuple[ast.ClassDef, _Scope]] = []
        self.function_scope: dict[int, _Scope] = {}  # id(FunctionDef) -> its scope
        self.string_words: set[str] = set()
        self.pinned: set[str] = set()
        self.pinned_attrs: set[str] = set()
        self.module_annotated: set[str] = set()
        self.in_annotation = 0
        self.counter = 0
        self.dispatch = {
            ast.Name: self.Name, ast.Attribute: self.Attribute, ast.Constant: self.Constant,
            ast.JoinedStr: self.JoinedStr, ast.NamedExpr: self.NamedExpr, ast.Global: self.Global,
            ast.Nonlocal: self.Global, ast.Import: self.Import, ast.ImportFrom: self.Import,
            ast.ExceptHandler: self.ExceptHandler, ast.MatchAs: self.MatchAs, ast.MatchStar: self.MatchStar,
            ast.MatchMapping: self.MatchMapping, ast.FunctionDef: self.FunctionDef,
            ast.AsyncFunctionDef: self.FunctionDef, ast.Lambda: self.Lambda, ast.ClassDef: self.ClassDef,
            ast.ListComp: self.Comprehension, ast.SetComp: self.Comprehension, ast.GeneratorExp: self.Comprehension,
            ast.DictComp: self.Comprehension, ast.AnnAssign: self.AnnAssign,
        }
        for name in ("TypeAlias", "TypeVar", "ParamSpec", "TypeVarTuple"):  # 3.12
            if hasattr(ast, name):
                self.dispatch[getattr(ast, name)] = self.TypeParam

    # -- helpers
    def visit(self, node) -> None:
        handler = self.dispatch.get(type(node))
        if handler is not None:
            handler(node)
        else:
            for child in ast.iter_child_nodes(node):
                self.visit(child)

    def visit_all(self, nodes) -> None:
        for n in nodes:
            if n is not None:
                self.visit(n)

    def annotation(self, node) -> None:
        """Annotations are kept whole: they are interface, and stored as text under `from __future__ import
        annotations`."""
        if node is not None:
            self.pin_names_under(node)
            self.in_annotation += 1
            self.visit(node)
            self.in_annotation -= 1

    def push(self, kind: str, node) -> _Scope:
        s = _Scope(kind, node, self.scope)
        self.scopes.append(s)
        self.scope = s
        return s

    def pop(self) -> None:
        self.scope = self.scope.parent

    def bind(self, name: str, kind: str, occurrence, scope: _Scope | None = None) -> None:
        scope = scope or self.scope
        scope.bindings[name].append((kind, occurrence))
        self.counter += 1
        scope.order.setdefault(name, self.counter)

    def taint(self, module: bool = True) -> None:
        """The names of this scope and its enclosing ones (with ``module``, the module's too) are read by spelling."""
        s = self.scope
        while s is not None and (module or s.kind != "module"):
            s.tainted = True
            s = s.parent

    def pin_names_under(self, node, attrs: bool = False) -> None:
        for n in ast.walk(node):
            if isinstance(n, ast.Name):
                self.pinned.add(n.id)
            elif attrs and isinstance(n, ast.Attribute):
                self.pinned_attrs.add(n.attr)

    # -- names, attributes, strings
    def Name(self, node: ast.Name) -> None:
        if isinstance(node.ctx, ast.Load):
            self.scope.uses.append(node)
            self.counter += 1
            if node.id in REFLECTIVE:
                self.taint(module=node.id in READS_GLOBALS)
        else:
            self.bind(node.id, "del" if isinstance(node.ctx, ast.Del) else "assign", ("name", node))

    def Attribute(self, node: ast.Attribute) -> None:
        self.attributes.append(node)
        if node.attr in FRAME_ATTRS:
            self.taint()
        self.visit(node.value)

    def Constant(self, node: ast.Constant) -> None:
        if isinstance(node.value, (str, bytes)):
            text = node.value if isinstance(node.value, str) else node.value.decode("latin-1")
            words = IDENT.findall(text)
            self.string_words.update(words)
            if self.in_annotation:
                self.pinned.update(words)  # a string annotation names things by their spelling

    def JoinedStr(self, node: ast.JoinedStr) -> None:
        text = self.segment(node)
        if text is None or _FSTRING_DEBUG.search(text):
            for value in node.values:
                if isinstance(value, ast.FormattedValue):
                    self.pin_names_under(value.value, attrs=True)
        for child in node.values:
            self.visit(child)

    def segment(self, node) -> str | None:
        start = self.text.offset(node.lineno, node.col_offset)
        end = self.text.offset(node.end_lineno, node.end_col_offset)
        return None if start is None or end is None else self.text.source[start:end]

    # -- bindings
    def NamedExpr(self, node: ast.NamedExpr) -> None:
        s = self.scope
        while s.kind == "comprehension" and s.parent is not None:  # the walrus binds outside comprehensions
            s = s.parent
        if isinstance(node.target, ast.Name):
            self.bind(node.target.id, "walrus", ("name", node.target), s)
        self.visit(node.value)

    def AnnAssign(self, node: ast.AnnAssign) -> None:
        if self.scope.kind == "module" and isinstance(node.target, ast.Name):
            self.module_annotated.add(node.target.id)  # kept: the module's __annotations__ spells it
        self.visit(node.target)
        self.annotation(node.annotation)
        if node.value is not None:
            self.visit(node.value)

    def Global(self, node) -> None:
        self.scope.declared.update(node.names)
        self.pinned.update(node.names)

    def Import(self, node) -> None:
        for alias in node.names:
            if alias.name == "*":
                self.scope.star = True
            else:
                self.bind(alias.asname or alias.name.split(".")[0], "import", None)

    def ExceptHandler(self, node: ast.ExceptHandler) -> None:
        if node.type is not None:
            self.visit(node.type)
        if node.name:
            self.bind(node.name, "except", ("except", node))
        self.visit_all(node.body)

    def MatchAs(self, node) -> None:
        if node.pattern is not None:
            self.visit(node.pattern)
        if node.name:
            self.bind(node.name, "match", ("matchas", node))

    def MatchStar(self, node) -> None:
        if node.name:
            self.bind(node.name, "match", ("matchstar", node))

    def MatchMapping(self, node) -> None:
        self.visit_all(node.keys)
        self.visit_all(node.patterns)
        if node.rest:
            self.bind(node.rest, "match", ("matchrest", node))

    def TypeParam(self, node) -> None:
        self.pin_names_under(node)
        if getattr(node, "name", None) is not None:
            name = node.name.id if isinstance(node.name, ast.Name) else node.name
            self.pinned.add(name)

    # -- scopes
    @staticmethod
    def _args(args: ast.arguments) -> list[ast.arg]:
        out = [*args.posonlyargs, *args.args, *args.kwonlyargs]
        if args.vararg is not None:
            out.append(args.vararg)
        if args.kwarg is not None:
            out.append(args.kwarg)
        return out

    def _outer_parts(self, args: ast.arguments) -> list[ast.arg]:
        """Visit the defaults (evaluated in the enclosing scope); the parameters."""
        self.visit_all(args.defaults)
        self.visit_all(args.kw_defaults)
        return self._args(args)

    def FunctionDef(self, node) -> None:
        self.visit_all(node.decorator_list)
        params = self._outer_parts(node.args)
        for p in params:
            self.annotation(p.annotation)
        self.annotation(node.returns)
        for tp in getattr(node, "type_params", ()):
            self.TypeParam(tp)
        self.bind(node.name, "def", None)
        scope = self.push("function", node)
        self.function_scope[id(node)] = scope
        for p in params:
            self.bind(p.arg, "param", None)
        self.visit_all(node.body)
        self.pop()

    def Lambda(self, node: ast.Lambda) -> None:
        params = self._outer_parts(node.args)
        self.push("lambda", node)
        for p in params:
            self.bind(p.arg, "param", None)
        self.visit(node.body)
        self.pop()

    def ClassDef(self, node: ast.ClassDef) -> None:
        self.visit_all(node.decorator_list)
        for tp in getattr(node, "type_params", ()):
            self.TypeParam(tp)
        self.visit_all(node.bases)
        self.visit_all(k.value for k in node.keywords)
        self.bind(node.name, "class", None)
        scope = self.push("class", node)
        self.classes.append((node, scope))
        self.visit_all(node.body)
        self.pop()

    def Comprehension(self, node) -> None:
        gens = node.generators
        self.visit(gens[0].iter)  # the first iterable is evaluated outside
        self.push("comprehension", node)
        for i, gen in enumerate(gens):
            if i:
                self.visit(gen.iter)
            self.visit(gen.target)
            self.visit_all(gen.ifs)
        if isinstance(node, ast.DictComp):
            self.visit(node.key)
            self.visit(node.value)
        else:
            self.visit(node.elt)
        self.pop()


def _resolve(name: str, scope: _Scope) -> _Scope | None:
    """The scope owning ``name`` as read in ``scope`` (None: a builtin, unknown or declared global/nonlocal; those
    are pinned). A class body sees its own names, then its enclosing functions', skipping class scopes."""
    s = scope
    first = True
    while s is not None:
        if name in s.declared:
            return None
        if (first or s.kind != "class") and name in s.bindings:
            return s
        first = False
        s = s.parent
    return None


class _Text:
    """Absolute character offsets of ``ast`` positions (lines as CPython splits them, columns in UTF-8 bytes)."""

    def __init__(self, source: str):
        self.source = source
        self.starts = [0]
        for m in re.finditer(r"\r\n|\r|\n", source):
            self.starts.append(m.end())
        self.ascii = source.isascii()

    def offset(self, line: int, col: int) -> int | None:
        if not 1 <= line <= len(self.starts):
            return None
        start = self.starts[line - 1]
        if self.ascii:
            return start + col
        end = self.starts[line] if line < len(self.starts) else len(self.source)
        raw = self.source[start:end].encode("utf-8")
        if col > len(raw):
            return None
        try:
            return start + len(raw[:col].decode("utf-8"))
        except UnicodeDecodeError:
            return None

    def at(self, offset: int | None, name: str) -> int | None:
        """``offset`` when the identifier ``name`` is spelt there, else None."""
        if offset is None or self.source[offset:offset + len(name)] != name:
            return None
        before = self.source[offset - 1:offset] if offset else ""
        if before and (before.isalnum() or before == "_"):
            return None
        after = self.source[offset + len(name):offset + len(name) + 1]
        if after and (after.isalnum() or after == "_"):
            return None
        return offset

    def search(self, offset: int | None, pattern: str, name: str, end: int | None = None) -> int | None:
        if offset is None:
            return None
        m = re.compile(pattern.replace("NAME", re.escape(name))).match(self.source, offset, end or len(self.source))
        return m.start(1) if m else None


def _occurrence_offset(text: _Text, how: str, node, name: str) -> int | None:
    if how == "name":
        return text.at(text.offset(node.lineno, node.col_offset), name)
    if how == "attr":
        return text.at(text.offset(node.end_lineno, node.end_col_offset - len(name.encode("utf-8"))), name)
    if how == "except":
        if node.type is None:
            return None
        start = text.offset(node.type.end_lineno, node.type.end_col_offset)
        return text.search(start, r"[\s\\)]*as[\s\\]+(NAME)\b", name)
    if how == "matchas":
        if node.pattern is None:
            return text.at(text.offset(node.lineno, node.col_offset), name)
        return text.at(text.offset(node.end_lineno, node.end_col_offset - len(name.encode("utf-8"))), name)
    if how == "matchstar":
        return text.at(text.offset(node.end_lineno, node.end_col_offset - len(name.encode("utf-8"))), name)
    if how == "matchrest":
        last = node.patterns[-1] if node.patterns else None
        start = text.offset(last.end_lineno, last.end_col_offset) if last is not None else \
            text.offset(node.lineno, node.col_offset + 1)
        return text.search(start, r"[\s\\,]*\*\*[\s\\]*(NAME)\b", name)
    return None


def _base_names(cls: ast.ClassDef) -> list[str | None]:
    out = []
    for v in cls.bases:
        if isinstance(v, ast.Subscript):  # Generic[T], Base[Cfg]
            v = v.value
        if isinstance(v, ast.Name):
            out.append(v.id)
        elif isinstance(v, ast.Attribute):
            out.append(v.attr if v.attr in STATELESS_BASES else None)
        else:
            out.append(None)
    return out


def _method_receiver(fn) -> ast.arg | None:
    for d in fn.decorator_list:
        d = d.func if isinstance(d, ast.Call) else d
        label = d.id if isinstance(d, ast.Name) else d.attr if isinstance(d, ast.Attribute) else ""
        if label in ("staticmethod", "classmethod"):
            return None
    params = [*fn.args.posonlyargs, *fn.args.args]
    return params[0] if params else None


def _fresh(prefix: str, taken: set[str]):
    n = 0
    while True:
        n += 1
        name = f"{prefix}{n}"
        if name not in taken:
            taken.add(name)
            yield name


def rename_source(source: str, module_names: bool = True, tree: ast.Module | None = None) -> Renaming:
    """Rename the local bindings and self-attributes of ``source`` (see the module docstring); with
    ``module_names``, also the module's own lower-case variables. Only identifiers change, in place: no line
    moves. Raises ``SyntaxError`` when ``source`` does not parse."""
    if tree is None:
        tree = ast.parse(source)
    text = _Text(source)
    binder = _Binder(text)
    binder.visit_all(tree.body)
    taken = set(IDENT.findall(source))
    pinned = binder.pinned

    for scope in binder.scopes:
        for use in scope.uses:
            owner = _resolve(use.id, scope)
            if owner is not None:
                owner.resolved[use.id].append(use)

    class_body_names: set[str] = set()
    for _, s in binder.classes:
        class_body_names.update(s.bindings)
    star = binder.module_scope.star

    groups = []
    for scope in binder.scopes:
        if scope.kind == "module":
            if not module_names or star:
                continue
        elif scope.kind not in ("function", "comprehension") or scope.in_lambda():
            continue
        if scope.tainted:
            continue
        for name, bindings in scope.bindings.items():
            if name in pinned or name.startswith("__") or name in scope.declared:
                continue
            if not all(kind in PLAIN and occ is not None for kind, occ in bindings):
                continue
            if scope.kind == "module" and (_CONSTANT.match(name) or name in binder.string_words
                                           or name in class_body_names or name in binder.module_annotated
                                           or hasattr(builtins, name)):
                continue  # a global shadowing a builtin is read as the builtin until it is bound: kept
            offsets = [_occurrence_offset(text, how, node, name) for _, (how, node) in bindings]
            offsets += [_occurrence_offset(text, "name", node, name) for node in scope.resolved.get(name, [])]
            if any(o is None for o in offsets):
                continue  # a position ast reports wrongly (f-strings before 3.12): keep the name
            groups.append((scope.order.get(name, 0), name, offsets))

    edits: dict[int, tuple[str, str]] = {}  # offset -> (old, new)
    local_names: dict[str, list[str]] = defaultdict(list)
    local_fresh = _fresh("v", taken)
    for _, name, offsets in sorted(groups, key=lambda g: (g[0], g[1])):
        fresh = next(local_fresh)
        local_names[name].append(fresh)
        for o in offsets:
            edits[o] = (name, fresh)

    # ----- self-attributes
    by_class_name: dict[str, list[ast.ClassDef]] = defaultdict(list)
    for c, _ in binder.classes:
        by_class_name[c.name].append(c)
    receivers: dict[int, ast.ClassDef] = {}  # id(Name read of a method's self) -> its class
    for c, _ in binder.classes:
        for stmt in c.body:
            if not isinstance(stmt, _FUNCS):
                continue
            param = _method_receiver(stmt)
            fscope = binder.function_scope.get(id(stmt))
            if param is None or fscope is None:
                continue
            if [k for k, _ in fscope.bindings.get(param.arg, [])] != ["param"]:
                continue  # self re-bound in the method: not known to be the instance
            for use in fscope.resolved.get(param.arg, []):
                receivers[id(use)] = c

    assigned: dict[str, set] = defaultdict(set)  # attr -> ids of classes assigning it on self
    mentioned: dict[str, dict] = defaultdict(dict)  # attr -> classes using it on self
    other_receiver: set[str] = set()
    self_attr_nodes: dict[str, list[ast.Attribute]] = defaultdict(list)
    for attr in binder.attributes:
        a = attr.attr
        cls = receivers.get(id(attr.value)) if isinstance(attr.value, ast.Name) else None
        if cls is None:
            other_receiver.add(a)
            continue
        mentioned[a][id(cls)] = cls
        self_attr_nodes[a].append(attr)
        if isinstance(attr.ctx, ast.Store):
            assigned[a].add(id(cls))

    def lineage(c: ast.ClassDef, depth: int = 0) -> tuple[list[ast.ClassDef], bool]:
        """In-file ancestors of ``c``, and whether a base comes from outside the file."""
        found, external = [], False
        if depth > 20:
            return found, True
        for base in _base_names(c):
            if base is None:
                external = True
            elif base in by_class_name:
                for b in by_class_name[base]:
                    if b is c:
                        continue
                    found.append(b)
                    more, ext = lineage(b, depth + 1)
                    found.extend(more)
                    external |= ext
            elif base not in STATELESS_BASES:
                external = True
        return found, external

    lines = {id(c): lineage(c) for c, _ in binder.classes}
    attrs: dict[str, str] = {}
    attr_fresh = _fresh("a", taken)
    for a in assigned:  # dicts keep source order
        if (a in other_receiver or a in class_body_names or a in binder.string_words or a in binder.pinned_attrs
                or a.startswith("__")):
            continue
        ok = True
        for cls in mentioned[a].values():
            line, external = lines[id(cls)]
            if id(cls) not in assigned[a] and not any(id(b) in assigned[a] for b in line):
                ok = False  # read on self here, assigned by no class of its line in this file
            if a in LIBRARY_ATTRS and external:
                ok = False
        offsets = [_occurrence_offset(text, "attr", n, a) for n in self_attr_nodes[a]]
        if not ok or any(o is None for o in offsets):
            continue
        attrs[a] = fresh = next(attr_fresh)
        for o in offsets:
            edits[o] = (a, fresh)

    if edits:
        out, last = [], 0
        for o in sorted(edits):
            old, fresh = edits[o]
            out.append(source[last:o])
            out.append(fresh)
            last = o + len(old)
        out.append(source[last:])
        renamed = "".join(out)
    else:
        renamed = source
    return Renaming(renamed, len(groups), len(attrs), dict(local_names), attrs, module_names)


def enclosing_functions(tree: ast.Module) -> list[tuple[int, int, str]]:
    """(first line, last line, qualified name) of every function and method of a module, outermost first. The
    first line is the first decorator's; names are ``Class.method``, ``func.inner``. The renaming check and the
    real-code benchmarks use them to tell which function a finding is in."""
    spans: list[tuple[int, int, str]] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef):
                    first = min([child.lineno, *(d.lineno for d in child.decorator_list)])
                    spans.append((first, child.end_lineno or child.lineno, name))
                visit(child, name + ".")
            else:
                visit(child, prefix)

    visit(tree, "")
    return spans


def function_at(spans: list[tuple[int, int, str]], line: int) -> str:
    """The qualified name of the innermost function of ``spans`` (:func:`enclosing_functions`) holding ``line``,
    or ``<module>``."""
    inside = [s for s in spans if s[0] <= line <= s[1]]
    return max(inside, key=lambda s: s[0])[2] if inside else "<module>"
