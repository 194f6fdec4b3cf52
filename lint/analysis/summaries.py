"""Function summaries: what a function does, for the calls that reach it from other files of the linted tree.

Before the rules run on a file, every function and method of the files it imports from the linted tree is
summarised (in terms of its own parameters, as Pysa's summaries are): whether it runs its work without autograd
(always, or when a parameter such as ``use_grad`` says so), whether it returns one of its arguments or a new object
(a factory), whether what it returns carries autograd and is log-probs, logits or an entropy, whether it runs a
model it is given, which optimizers it zeroes or steps and whether it calls ``.backward()``. A call into another
file is then judged from the callee's summary (:meth:`rlguard.lint.analysis.Analysis.summary_of_call`).

Summaries are plain data (JSON-friendly), computed in the worker that parses the file, cached by content with
the findings, and keyed by qualified name (``package.module.function``, ``package.module.Class.method``).
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import libcst as cst

from rlguard.lint.analysis import semantics as S
from rlguard.lint.analysis.index import dotted_name, params_of

if TYPE_CHECKING:
    from rlguard.lint.analysis import Analysis

VERSION = 5

# Methods too common to be placed by their name alone (many classes of a tree define them, and library objects have
# them too): a call of one whose receiver's class is unknown is not matched to a definition of the tree.
COMMON_METHODS = frozenset({
    "forward", "step", "update", "get", "set", "put", "pop", "add", "run", "call", "apply", "train", "eval",
    "evaluate", "act", "sample", "predict", "compute", "compute_loss", "loss", "backward", "reset", "load", "save",
    "build", "setup", "init", "process", "collect", "rollout", "score", "generate", "entropy", "log_prob",
    "log_probs", "mode", "mean", "sum", "item", "items", "keys", "values", "copy", "clone", "to", "cuda", "cpu",
    "float", "half", "view", "reshape", "append", "extend", "insert", "remove", "clear", "close", "open", "read",
    "write", "start", "stop", "main", "encode", "decode", "format", "parse", "transform", "fit", "infer", "inference",
    "state_dict", "load_state_dict", "parameters", "named_parameters", "zero_grad", "log", "info", "debug",
    "prepare", "wrap", "unwrap", "batch", "next", "send", "recv", "wait", "sync", "gather", "scatter", "reduce",
    # tensor methods that return tuples (`a, b = x.split(n)`, `v, i = x.topk(k)`)
    "split", "tensor_split", "chunk", "unbind", "topk", "max", "min", "sort", "kthvalue", "median", "aminmax",
    "svd", "qr", "eig", "eigh", "slogdet", "lstsq", "unique", "unique_consecutive", "frexp", "histogram",
    "std_mean", "var_mean", "cummax", "cummin", "nanmedian", "size", "shape", "dim", "numel", "tolist", "numpy",
    "astype", "type", "to_dict",
}) | frozenset(name for kind in (str, bytes, list, tuple, dict, set) for name in dir(kind))  # builtins' methods
# A method defined in more files than this is not placed by its name (the index never summarises many files).
MAX_DEFINING_FILES = 4
# A tree with more Python files than this is not indexed (the text scan would cost more than it could give).
MAX_INDEXED_FILES = 20000
_DEF = re.compile(rb"^[ \t]+(?:async[ \t]+)?def[ \t]+(\w+)[ \t]*\(", re.M)
_SKIPPED_DIRS = frozenset({"__pycache__", "node_modules", "site-packages", ".git", ".venv", "venv", ".tox"})


@dataclass
class FunctionSummary:
    qualname: str
    params: list[str] = field(default_factory=list)
    grad_off: bool = False  # its work runs without autograd whatever the arguments
    grad_param: tuple[str, bool] | None = None  # (parameter, value with which it runs without autograd)
    returns_param: tuple[int, str] | None = None  # returns this argument itself (position, name)
    returns_new: bool = False  # returns an object it builds (a factory)
    returns_detached: bool = False  # what it returns carries no autograd
    returns_role: str | None = None  # "logprobs", "logits", "entropy" when every return is one
    returns_from: list[str] = field(default_factory=list)  # parameters whose values flow into what it returns
    runs_model: bool = False  # calls one of its parameters as a model (or a helper that does)
    zeroes: list[str] = field(default_factory=list)  # parameters / "self.x" whose gradients it zeroes
    steps: list[str] = field(default_factory=list)  # parameters / "self.x" whose optimizer it steps
    backward: bool = False
    # the sign with which every return is an entropy or a KL ({"entropy": -1} for `(p * log p).sum(-1)`)
    returns_signed: dict[str, int] = field(default_factory=dict)
    # every return is this argument (position, name) up to sign-keeping steps: reductions, masks and positive
    # scalings (`masked_mean(values, mask)`, `(values * mask).sum(-1) / n`): a loss reduced by it keeps its sign
    returns_keeps: tuple[int | None, str] | None = None
    # positions (-1: the whole value, else a tuple element) of a module it builds by a class constructor and loads
    # weights into, returned without a mode set (a new module starts in train mode)
    returns_module: list[int] = field(default_factory=list)
    # every return is a tuple of this many elements (no starred one): what the elements below are positions of
    returns_arity: int | None = None
    # (position, what, sign) for tuple elements every return agrees on, read from the code: "entropy" (with that
    # sign: `dist.entropy().mean()`, a written-out formula), "logprobs" (sign 1: a log-softmax of a forward, a
    # distribution's `log_prob(a)`); `value, logp, ent, h = f(...)` then gives each name its role in the caller
    returns_elements: list[tuple[int, str, int]] = field(default_factory=list)
    # its body only raises, passes or has a docstring (an abstract method that its subclasses implement)
    abstract: bool = False
    # a method of a torch module class that calls one of the module's own submodules (`self.base(x)`): what it
    # returns is a forward of the module it is called on, with autograd as at the call
    returns_forward: bool = False

    def returned_argument(self) -> tuple[int | None, str] | None:
        if self.returns_param is None:
            return None
        pos, name = self.returns_param
        return pos, name

    def grad_off_for(self, call: cst.Call) -> bool:
        if self.grad_off:
            return True
        if self.grad_param is not None:
            name, value = self.grad_param
            for arg in call.args:
                if arg.keyword is not None and arg.keyword.value == name:
                    return S.literal_bool(arg.value) == value
            if name in self.params:
                pos = self.params.index(name)
                positional = [a for a in call.args if a.keyword is None and not a.star]
                if pos < len(positional):
                    return S.literal_bool(positional[pos].value) == value
        return False

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> "FunctionSummary":
        data = dict(data)
        for key in ("grad_param", "returns_param", "returns_keeps"):
            if data.get(key) is not None:
                data[key] = tuple(data[key])
        data["returns_elements"] = [tuple(e) for e in data.get("returns_elements", ())]
        return cls(**data)

    def element(self, position: int) -> tuple[str, int] | None:
        """(what, sign) of tuple element ``position`` of what it returns, when its code says."""
        for pos, what, sign in self.returns_elements:
            if pos == position:
                return what, sign
        return None


class Project:
    """The linted tree's function summaries, loaded on demand: a call into ``pkg.mod.f`` parses ``pkg/mod.py``
    (found under the source roots of the linted files) once per process and summarises it; the file being linted
    records its own summaries as it goes. ``consulted`` lists the files whose summaries a lint used, with their
    content hashes, so a cached result is redone when one of them changes."""

    def __init__(self, roots: list[Path] | tuple = (), vocabulary=None):
        self.roots = [Path(r) for r in roots]
        self.vocabulary = vocabulary
        self.consulted: dict[str, str] = {}  # path -> content hash, for the file being linted
        self._modules: dict[str, Path | None] = {}
        # module -> (path, content hash): a file is read and hashed once per run, not at every call into it
        self._seen: dict[str, tuple[str, str | None]] = {}
        self._method_files: dict[str, list[str]] | None = None  # method name -> files that define it (text scan)
        self._by_path: dict[str, tuple[str, str | None]] = {}  # file -> (module, content hash)

    def begin_file(self) -> None:
        self.consulted = {}

    def get(self, qualname: str) -> FunctionSummary | None:
        parts = qualname.split(".")
        for i in range(len(parts) - 1, 0, -1):
            module = ".".join(parts[:i])
            path = self.find_module(module)
            if path is not None:
                summaries = self.load(module, path)
                return summaries.get(qualname) if summaries is not None else None
        return None

    def find_module(self, module: str) -> Path | None:
        if module in self._modules:
            return self._modules[module]
        found = None
        rel = Path(*module.split("."))
        # a script folder (no __init__.py) that imports its own folder, or a sibling one, as a namespace package
        # (`from trainer.utils import f` in trainer/train.py, its parent put on sys.path): the folder above it
        scripts = [root.parent for root in self.roots if root.name == module.split(".")[0]
                   and not (root / "__init__.py").is_file()]
        for root in [*self.roots, *scripts]:
            for candidate in (root / rel.with_suffix(".py"), root / rel / "__init__.py"):
                if candidate.is_file():
                    found = candidate
                    break
            if found is not None:
                break
        self._modules[module] = found
        return found

    def load(self, module: str, path: Path) -> dict[str, FunctionSummary] | None:
        seen = self._seen.get(module)
        if seen is None:
            seen = self._seen[module] = self._read(module, path)
        shown, digest = seen
        if digest is None:
            return None
        self.consulted[shown] = digest
        return _STORE.get(digest)

    def _read(self, module: str, path: Path) -> tuple[str, str | None]:
        """(path, content hash) of the module's file, its summaries put in the store when they are not there yet
        (read once per run: the hash keys the summaries, which a later lint of that file may replace)."""
        try:
            text = path.read_bytes().decode("utf-8-sig")
        except (OSError, UnicodeDecodeError):
            return str(path), None
        digest = content_hash(text)
        if digest not in _STORE:
            _STORE[digest] = _summarise_source(text, str(path), module, self.vocabulary)
        return str(path), digest

    # ----- the method index: calls of a method on an object whose class nothing in view says ----------------
    def method_summaries(self, name: str, exclude: str | None = None) -> list[FunctionSummary] | None:
        """The summaries of every method ``name`` of a module-level class of the linted tree (``x.m(...)`` where
        nothing says what ``x`` is: a constructor parameter, an attribute set elsewhere), found by a text scan of
        the tree's files for ``def name(`` (once per process), then by summarising the few files that define it.
        None when the name is too common to place (:data:`COMMON_METHODS`, a dunder), defined in too many files,
        or nowhere; abstract definitions (a body that only raises) are left out. ``exclude``: the linted file (its
        own classes are judged from its code). The caller decides whether the definitions agree on what it asks."""
        if name in COMMON_METHODS or name.startswith("__") or not self.roots:
            return None
        files = self._method_index().get(name)
        if exclude is not None:
            skip = os.path.abspath(exclude)
            files = [f for f in files or () if f != skip]
        if not files or len(files) > MAX_DEFINING_FILES:
            return None
        found = []
        for path in files:
            module, digest = self._load_path(path)
            if digest is None:
                return None
            summaries = _STORE.get(digest) or {}
            self.consulted[path] = digest
            prefix = f"{module}."
            for qual, summary in summaries.items():
                rest = qual[len(prefix):] if qual.startswith(prefix) else ""
                if rest.count(".") == 1 and rest.endswith(f".{name}") and not summary.abstract:
                    found.append(summary)
        return found or None

    def _method_index(self) -> dict[str, list[str]]:
        if self._method_files is None:
            self._method_files = _scan_methods(self.roots)
        return self._method_files

    def _load_path(self, path: str) -> tuple[str, str | None]:
        seen = self._by_path.get(path)
        if seen is None:
            module = module_name_for(Path(path))[0]
            seen = self._by_path[path] = (module, self._read(module, Path(path))[1])
        return seen

    def record(self, text: str, summaries: dict[str, FunctionSummary]) -> None:
        _STORE[content_hash(text)] = summaries


def _scan_methods(roots: list[Path]) -> dict[str, list[str]]:
    """Method name -> the files under ``roots`` with an indented ``def name(`` (a method, or a nested function),
    by a text scan: no file is parsed here. Empty when the tree has too many files."""
    index: dict[str, list[str]] = {}
    seen: set[str] = set()
    count = 0
    for root in roots:
        for folder, dirs, names in os.walk(root):
            dirs[:] = [d for d in dirs if d not in _SKIPPED_DIRS and not d.startswith(".")]
            for file_name in names:
                if not file_name.endswith(".py"):
                    continue
                path = os.path.abspath(os.path.join(folder, file_name))
                if path in seen:
                    continue
                seen.add(path)
                count += 1
                if count > MAX_INDEXED_FILES:
                    return {}
                try:
                    with open(path, "rb") as handle:
                        data = handle.read()
                except OSError:
                    continue
                for name in {m.group(1) for m in _DEF.finditer(data)}:
                    index.setdefault(name.decode("ascii", "replace"), []).append(path)
    return index


def content_hash(text: str) -> str:
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()


# Summaries by file content hash, for the life of the process (workers keep their own).
_STORE: dict[str, dict[str, FunctionSummary]] = {}


def _summarise_source(text: str, path: str, module: str, vocabulary) -> dict[str, FunctionSummary]:
    from rlguard.lint.analysis import Analysis

    try:
        from rlguard.lint.engine import parse_module  # the engine's parser (imports this module)

        tree = parse_module(text)
        analysis = Analysis(tree, path, vocabulary, project=None, module_name=module)
        return summarise_module(analysis, module)
    except Exception:  # noqa: BLE001 - a helper file that does not parse or trips the analysis: no summaries
        return {}


def module_name_for(path: Path) -> tuple[str, Path]:
    """``pkg/sub/mod.py`` -> ("pkg.sub.mod", the folder above ``pkg``): the package chain of ``__init__.py``
    files decides where the source root is."""
    path = Path(os.path.abspath(path))
    parts = [path.stem] if path.name != "__init__.py" else []
    folder = path.parent
    while (folder / "__init__.py").is_file() and folder.parent != folder:
        parts.insert(0, folder.name)
        folder = folder.parent
    return ".".join(parts) or path.stem, folder


def summarise_module(a: "Analysis", module_name: str,
                     only: frozenset[str] | None = None) -> dict[str, FunctionSummary]:
    """Summaries of every module-level function and every method of a module-level class (``only``: of those
    top-level names, what the other linted files import from the module)."""
    out: dict[str, FunctionSummary] = {}
    for stmt in a.module.body:
        if only is not None and isinstance(stmt, (cst.FunctionDef, cst.ClassDef)) and stmt.name.value not in only:
            continue
        if isinstance(stmt, cst.FunctionDef):
            out[f"{module_name}.{stmt.name.value}"] = summarise(a, stmt, f"{module_name}.{stmt.name.value}")
        elif isinstance(stmt, cst.ClassDef):
            for method in a.index.methods(stmt):
                qual = f"{module_name}.{stmt.name.value}.{method.name.value}"
                out[qual] = summarise(a, method, qual)
    return out


def summarise(a: "Analysis", func: cst.FunctionDef, qualname: str) -> FunctionSummary:
    from rlguard.lint.analysis.grad import grad_context
    from rlguard.lint.analysis.provenance import FORWARD, PARAM, READ, objects, provenance

    params = [p.name.value for p in params_of(func.params)]
    positional = [p.name.value for p in (*func.params.posonly_params, *func.params.params)]
    if positional and positional[0] in ("self", "cls"):
        positional = positional[1:]
    summary = FunctionSummary(qualname, params=[p for p in params if p not in ("self", "cls")])
    info = a.index.scopes[id(func)]
    returns = [r for r in info.returns if r.value is not None and a.index.function_scope(r).node is func]
    grad = grad_context(a)
    if any(grad.manager(d.decorator, None) is False for d in func.decorators):
        summary.grad_off = True
    summary.grad_param = _grad_param(a, func)

    if returns:
        objs = [objects(a).value(r.value) for r in returns]
        roots = [o for value in objs if isinstance(value, frozenset) for o in value]
        func_key = f"{info.cls.name.value}." if info.cls is not None else ""
        prefix = f"{func_key}{func.name.value}:"
        param_roots = {o.key[len(prefix):] for o in roots if o.kind == "param" and o.key.startswith(prefix)}
        if roots and len(param_roots) == 1 and all(o.kind == "param" and o.key.startswith(prefix) for o in roots):
            name = param_roots.pop()
            if name in params and name not in ("self", "cls"):
                summary.returns_param = (positional.index(name) if name in positional else None, name)
        elif roots and all(o.kind == "new" for o in roots):
            summary.returns_new = True
        origins = [provenance(a).value(r.value) for r in returns]
        states = [grad.enabled(r) for r in returns]
        flat = [o for value in origins for o in value]
        forwards = [o for o in flat if o.kind == FORWARD]
        if all(s is False for s in states) or (forwards and all(o.grad is False for o in forwards)):
            summary.returns_detached = True
        whats = {o.what for o in forwards}
        if forwards and len(whats) == 1 and whats <= {"logprobs", "logits", "entropy"}:
            summary.returns_role = whats.pop()
        summary.runs_model = bool(forwards) and any(
            any(n in params for n in (o.model.names if o.model else ())) for o in forwards)
        # a parameter, or the elements of one iterated over (`for t in tensors: out[i] = t`: a read that keeps the
        # parameter's definition as its node)
        summary.returns_from = sorted({o.name for o in flat if (o.kind == PARAM or o.kind == READ and o.node_id)
                                       and o.name in params and o.name not in ("self", "cls")})
        summary.returns_signed = _returns_signed(a, returns)
        summary.returns_keeps = _returns_keeps(a, func, returns, positional)
        summary.returns_module = _returns_module(a, returns)
        summary.returns_arity, summary.returns_elements = _returns_elements(a, returns)
        summary.returns_forward = info.cls is not None and _runs_submodule(a, func, info.cls)
    elif _abstract(func):
        summary.abstract = True
    for call in a.index.descendants(func, cst.Call):
        if a.index.function_scope(call).node is not func:
            continue
        method = S.method_name(call)
        recv = S.receiver(call)
        target = dotted_name(recv) if recv is not None else None
        if method in S.ZERO_GRAD_METHODS and target:
            summary.zeroes.append(target)
        elif method in S.BACKWARD_METHODS:
            summary.backward = True
        elif method == "step" and target:
            summary.steps.append(target)
    return summary


def _torch_module(a: "Analysis", cls: cst.ClassDef, depth: int = 3) -> bool:
    """A class deriving from ``nn.Module`` (through classes of the same module)."""
    for base in cls.bases:
        name = dotted_name(base.value) or ""
        if name.rsplit(".", 1)[-1] == "Module":
            return True
        inner = a.class_named(name) if depth > 0 and "." not in name else None
        if inner is not None and inner is not cls and _torch_module(a, inner, depth - 1):
            return True
    return False


def _runs_submodule(a: "Analysis", func: cst.FunctionDef, cls: cst.ClassDef) -> bool:
    """A method of a torch module that calls one of its submodules (``self.base(x)``: an attribute of ``self``
    that is no method of the class) or itself (``self(x)``, ``self.forward(x)``)."""
    if not _torch_module(a, cls):
        return False
    for call in a.index.descendants(func, cst.Call):
        target = call.func
        if isinstance(target, cst.Name) and target.value == "self":
            return True
        if isinstance(target, cst.Attribute) and isinstance(target.value, cst.Name) and target.value.value == "self":
            name = target.attr.value
            if name == "forward" or (a.method_of(cls, name) is None and name not in S.NON_FORWARD_METHODS):
                return True
    return False


def _abstract(func: cst.FunctionDef) -> bool:
    """A body of only a docstring, ``pass``, ``...`` or ``raise`` (``raise NotImplementedError``)."""
    body = func.body.body if isinstance(func.body, cst.IndentedBlock) else [func.body]
    for stmt in body:
        smalls = stmt.body if isinstance(stmt, (cst.SimpleStatementLine, cst.SimpleStatementSuite)) else None
        if smalls is None:
            return False
        for small in smalls:
            if isinstance(small, (cst.Pass, cst.Raise)):
                continue
            if isinstance(small, cst.Expr) and isinstance(small.value, (cst.SimpleString, cst.ConcatenatedString,
                                                                         cst.Ellipsis)):
                continue
            return False
    return True


def _returns_elements(a: "Analysis", returns: list) -> tuple[int | None, list[tuple[int, str, int]]]:
    """The arity every return's tuple has, and the roles of the elements all returns agree on (read from the code:
    the quantities facet for an entropy, the provenance facet or a distribution's ``log_prob`` for log-probs)."""
    values = [r.value for r in returns]
    if not all(isinstance(v, cst.Tuple) for v in values):
        return None, []
    arity = len(values[0].elements)
    if any(len(v.elements) != arity or any(isinstance(el, cst.StarredElement) for el in v.elements)
           for v in values):
        return None, []
    from rlguard.lint.analysis.provenance import FORWARD, provenance
    from rlguard.lint.analysis.terms import quantities

    out: list[tuple[int, str, int]] = []
    for position in range(arity):
        elements = [v.elements[position].value for v in values]
        texts = [a.code(el).lower() for el in elements]
        if all(_logprob_call(a, el) for el in elements) or all(
                (found := [o for o in provenance(a).value(el) if o.kind == FORWARD]) and
                all(o.what == "logprobs" for o in found) for el in elements):
            out.append((position, "logprobs", 1))
            continue
        if not all(("entrop" in t or "log" in t or a.sole_value(el) is not None) for t, el in
                   zip(texts, elements)):
            continue  # cheap: an entropy needs an entropy call or a log, here or in the one value a name holds
        signs_ = {quantities(a).sign("entropy", el, None) for el in elements}
        if len(signs_) == 1 and None not in signs_:
            out.append((position, "entropy", signs_.pop()))
    return arity, out


def _logprob_call(a: "Analysis", expr: cst.BaseExpression, depth: int = 4) -> bool:
    """A distribution's log-probability of its argument (``dist.log_prob(a)``, ``dist.log_probs(a)``), through
    names bound once and shape-keeping methods."""
    for _ in range(depth):
        inner = a.sole_value(expr)
        if inner is not None:
            expr = inner
            continue
        if not isinstance(expr, cst.Call):
            return False
        method = a.method(expr)
        if method in ("log_prob", "log_probs") and len(expr.args) == 1 and expr.args[0].keyword is None:
            return True
        if method in S.SAME_VALUE_METHODS or method in ("sum", "mean"):
            expr = S.receiver(expr)
            continue
        return False
    return False


def _returns_module(a: "Analysis", returns: list) -> list[int]:
    loads = a.facet("loads_state_dict", lambda an: any(S.method_name(c) == "load_state_dict"
                                                       for c in an.nodes(cst.Call)))
    if not loads:
        return []  # cheap: a module it builds and loads weights into needs a load_state_dict in the file
    from rlguard.lint.analysis.modes import returned_modules

    return returned_modules(a, returns)


def _returns_signed(a: "Analysis", returns: list) -> dict[str, int]:
    """For each of entropy and KL, the sign with which every return value is that quantity (read from the code by
    the quantities facet: a written-out formula, a library entropy), when all returns agree."""
    from rlguard.lint.analysis.terms import quantities

    texts = [a.code(r.value).lower() for r in returns]
    if not any("log" in t or "entrop" in t or "kl" in t for t in texts):
        return {}  # cheap: every form the facet knows needs a log, an entropy call or a KL by name
    found: dict[str, int] = {}
    for kind in ("entropy", "kl"):
        values = []
        for r in returns:
            value = r.value.elements[0].value if isinstance(r.value, cst.Tuple) and r.value.elements else r.value
            values.append(quantities(a).sign(kind, value, None))
        if values and values[0] is not None and all(v == values[0] for v in values):
            found[kind] = values[0]
    return found


def _returns_keeps(a: "Analysis", func: cst.FunctionDef, returns: list, positional: list[str]
                   ) -> tuple[int | None, str] | None:
    """The parameter every return value is, with a positive sign, once the signed decomposition has gone through
    reductions, masks, positive scalings and clamps (the signs facet); None when any return is something else (a
    tuple, a negation, a product of two tensors)."""
    from rlguard.lint.analysis.signs import signs

    found = set()
    for r in returns:
        terms = signs(a).terms(r.value, None, depth=4)
        if len(terms) != 1 or terms[0].sign != 1 or not isinstance(terms[0].expr, cst.Name):
            return None
        name = terms[0].expr
        defs = a.flow.reaching(name.value, name)
        if len(defs) != 1 or defs[0].kind != "param" or defs[0].scope is not func or name.value in ("self", "cls"):
            return None
        found.add(name.value)
    if len(found) != 1:
        return None
    kept = found.pop()
    return (positional.index(kept) if kept in positional else None), kept


def _grad_param(a: "Analysis", func: cst.FunctionDef) -> tuple[str, bool] | None:
    """``ctx = torch.no_grad() if not use_grad else nullcontext(); with ctx:`` and the like: the parameter and the
    value with which the function's ``with`` turns autograd off."""
    from rlguard.lint.analysis.grad import grad_context
    from rlguard.lint.analysis.values import Frame

    grad = grad_context(a)
    params = [p.name.value for p in params_of(func.params)]
    for with_stmt in a.index.descendants(func, cst.With):
        for item in with_stmt.items:
            if grad.manager(item.item, None) is not None:
                continue
            for name in params:
                for value in (False, True):
                    literal = cst.Name("True" if value else "False")
                    frame = Frame(func, None, ((name, (literal, None)),), None, 1)
                    if grad.manager(item.item, frame) is False:
                        return name, value
    return None


__all__ = ["FunctionSummary", "Project", "VERSION", "module_name_for", "summarise", "summarise_module"]
