"""Metamorphic check: a judgement must survive renaming. Each file's own local identifiers are renamed to neutral
ones (``v1``, ``v2``, ... for local bindings; ``a1``, ``a2``, ... for attributes the file assigns on ``self``),
consistently and per scope, and the original and the renamed source are linted; a finding that APPEARS under
renaming is a bug (a name cannot make code wrong), one that VANISHES shows a rule that relies on a name.

    python benchmarks/rename.py PATH...                  # files or folders (.py files, recursively)
    python benchmarks/rename.py --rule-examples          # every VALID and INVALID example of every rule
    python benchmarks/rename.py --ecosystem --jobs 2     # the snapshot trees benchmarks/ecosystem.py extracted
    python benchmarks/rename.py --ecosystem --only trl --part development --json out.json
    python benchmarks/rename.py --rule-examples --strict --stable RLG001,RLG003   # vanishing fails these codes

What is renamed (the file's private names, never its interface):
  * bindings local to a ``def`` (assignment, augmented and annotated targets, tuple unpacking, walrus, ``for``,
    ``with ... as``, ``except ... as``, ``del``, ``match`` captures), and comprehension targets;
  * the module's own variables, unless ``--locals-only``: lower-case names bound at module level by plain
    assignment only (not UPPER_CASE constants, not spelt in any string, e.g. ``__all__``, not a class-body name,
    not a builtin's name; none at all in a file with ``from x import *``);
  * ``self.<attr>`` attribute nodes, file-wide, for an attribute some method assigns on its ``self``.
Scopes are resolved with Python's rules (an own pass over ``ast``: any binding in a function makes the name local
there; comprehensions are their own scope but a walrus in one binds outside it; class bodies are invisible to the
scopes nested in them). What is kept: functions, methods, classes, parameters (and keyword names at call sites),
imports, class-body names, ``global``/``nonlocal`` names, builtins, names only read, string keys, any ``x.attr`` on
another receiver, and every binding inside a lambda. Whenever a name is not fully understood it is kept: a name in
``f"{x=}"`` or in a string annotation, every name of a scope that calls ``locals()``, ``globals()``, ``vars()``,
``dir()``, ``eval`` or ``exec`` (and of its enclosing scopes; the module's too for ``globals``/``eval``/``exec``),
module-level names with an annotation (the module's ``__annotations__`` spells them), names inside any annotation,
names starting with ``__``, an occurrence whose position ``ast`` reports wrongly. An attribute is kept when the file
also reads it on another receiver, defines it in a class body, spells it in a string (``getattr``,
``register_buffer``, ``__slots__``), when a class reads it on ``self`` without it or an in-file base assigning it,
and, in a class with a base from outside the file, when it is one the frameworks own (``self.model`` of a
``Trainer``, ``self.training`` of an ``nn.Module``, ...). Attribute names stay observable through reflection
(``vars(obj)``, ``state_dict`` keys): that is the one sense in which the renamed program is not the same.

Self-checks, per file: the renamed source parses, with as many lines, and differs from the original in identifiers
only; it compiles to the same bytecode (same instructions, constants, line and exception tables) with every name
either kept or replaced one-to-one by a neutral name, per namespace (globals and attributes file-wide, locals and
cells per function); CPython's symbol tables (``symtable``) of the two agree scope for scope (every renamed name
keeps its local/free/global/parameter classification); renaming the renamed source again renames as many
bindings. A failed self-check is a bug of this tool (exit status 2); ``--no-self-check`` skips them.

Findings are compared by (code, line): renaming replaces identifiers only, so no line moves. Linting is single-file
(``rlguard.lint.lint_source``, all rules; ``--preview`` passes ``preview=True``), on both sides alike, so cross-file
summaries play no part. ``--ecosystem`` relints only the files some rule's triggers match (the others can have no
finding). Exit status: 1 when any finding appears (or, with ``--strict``, vanishes for a ``--stable`` code;
``--strict`` without ``--stable``: any code), 2 when a self-check fails, 0 otherwise. No third-party code is stored:
``--ecosystem`` reads the trees under ``.rlguard_ecosystem/trees/`` at run time.
"""

from __future__ import annotations

import argparse
import ast
import builtins
import dis
import json
import os
import re
import symtable
import sys
import textwrap
import time
import types
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path


try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
ECOSYSTEM_TOML = HERE / "ecosystem.toml"
TREES = ROOT / ".rlguard_ecosystem" / "trees"

# The renaming itself is the linter's own (the engine uses it to tell findings that rest on a name).
from rlguard.lint.neutral import (  # noqa: E402
    _LINES, IDENT, WORDS, Renaming, rename_source,
)

# ----- self-checks -----------------------------------------------------------------------------------------------

def _symtable_flags(sym: symtable.Symbol) -> tuple:
    return (sym.is_parameter(), sym.is_local(), sym.is_global(), sym.is_declared_global(), sym.is_free(),
            sym.is_imported(), sym.is_assigned(), sym.is_referenced(), sym.is_nonlocal(), sym.is_namespace())


def _compare_tables(a: symtable.SymbolTable, b: symtable.SymbolTable, fresh: set[str], where: str,
                    problems: list[str]) -> None:
    """CPython's symbol tables of the original and the renamed source agree: same scopes, every kept name with
    the same classification, the renamed ones replaced by neutral names of the same classifications."""
    if (a.get_type(), a.get_name()) != (b.get_type(), b.get_name()):
        problems.append(f"symtable: scope {where}/{a.get_name()} became {b.get_name()}")
        return
    sa = {s.get_name(): _symtable_flags(s) for s in a.get_symbols()}
    sb = {s.get_name(): _symtable_flags(s) for s in b.get_symbols()}
    gone = set(sa) - set(sb)
    added = set(sb) - set(sa)
    if a.get_type() == "class":
        # A free name the class only passes through to its methods is their business (their tables are compared):
        # a class body binding `k` while a method reads the enclosing function's `k` holds one symbol, which
        # renaming splits into the class's `k` and the passing-through `v1`.
        def passing(table, name):
            sym = table.lookup(name)
            return sym.is_free() and not sym.is_assigned() and not sym.is_referenced()

        gone = {n for n in gone if not passing(a, n)}
        added = {n for n in added if not (n in fresh and passing(b, n))}
    for name in sorted(set(sa) & set(sb)):
        if sa[name] != sb[name]:
            problems.append(f"symtable: in {where}/{a.get_name()}, {name!r} changed its classification")
    if not added <= fresh:
        problems.append(f"symtable: in {where}/{a.get_name()}, new names that are not neutral: {sorted(added - fresh)}")
    if sorted(sa[n] for n in gone) != sorted(sb[n] for n in added):
        problems.append(f"symtable: in {where}/{a.get_name()}, renamed names changed their classification "
                        f"({sorted(gone)} -> {sorted(added)})")
    ca, cb = a.get_children(), b.get_children()
    if len(ca) != len(cb):
        problems.append(f"symtable: {where}/{a.get_name()} has {len(ca)} child scopes, renamed {len(cb)}")
        return
    for x, y in zip(ca, cb):
        _compare_tables(x, y, fresh, f"{where}/{a.get_name()}", problems)


_NAME_TUPLES = ("co_names", "co_varnames", "co_cellvars", "co_freevars")
_HASNAME, _HASLOCAL, _HASFREE = set(dis.hasname), set(dis.haslocal), set(dis.hasfree)
_SORTED_CELL_OPS = frozenset({"MAKE_CELL", "LOAD_CLOSURE"})


def _category(op: int) -> str:
    """The namespace of a name instruction's argument."""
    if op in _HASLOCAL:
        return "fast"
    if op in _HASFREE:
        return "cell"
    opname = dis.opname[op]
    if "ATTR" in opname or "METHOD" in opname:
        return "attr"
    if "IMPORT" in opname:
        return "import"
    return "global"


_EXTENDED_ARG = dis.opmap["EXTENDED_ARG"]
_NAME_OPS = _HASNAME | _HASLOCAL | _HASFREE


def _instructions(co: types.CodeType) -> list[tuple[int, int, str | None, int | None]]:
    """(opcode, raw argument, name argument or None, line) of every instruction. Decoded by hand on 3.11, where
    the layout is known (``dis`` is several times slower); through ``dis`` elsewhere."""
    if sys.version_info[:2] != (3, 11):
        return [(i.opcode, i.arg or 0, i.argval if i.opcode in _NAME_OPS and isinstance(i.argval, str) else None,
                 i.positions.lineno if i.positions else None) for i in dis.get_instructions(co)]
    code, names, out, ext = co.co_code, co.co_names, [], 0
    load_global = dis.opmap["LOAD_GLOBAL"]
    for i in range(0, len(code), 2):
        op = code[i]
        if op == _EXTENDED_ARG:
            ext = (ext | code[i + 1]) << 8
            continue
        arg = ext | code[i + 1]
        ext = 0
        name = None
        if op in _HASNAME:
            name = names[arg >> 1 if op == load_global else arg]
        elif op in _HASLOCAL or op in _HASFREE:
            name = co._varname_from_oparg(arg)
        out.append((op, arg, name, None))
    return out


class _NameMaps:
    """Original -> renamed names per namespace; a renaming is consistent when each map is one-to-one, every name
    kept or replaced by a neutral one. Globals and attributes are file-wide, locals and cells per code object."""

    def __init__(self, fresh: set[str]):
        self.fresh = fresh
        self.maps: dict[object, tuple[dict, dict]] = {}

    def agree(self, key, old: str, new: str) -> bool:
        if old != new and new not in self.fresh:
            return False
        forward, backward = self.maps.setdefault(key, ({}, {}))
        if forward.setdefault(old, new) != new or backward.setdefault(new, old) != old:
            return False
        return True


_JUMPS = set(dis.hasjrel) | set(dis.hasjabs)


def _normalised(co: types.CodeType) -> list[tuple]:
    """The instructions of ``co`` without the ones CPython's compiler adds or drops by a name's spelling: 3.11
    compiles ``x.m()`` without LOAD_METHOD (PUSH_NULL, LOAD_ATTR) when the module imports a name ``x``, even where
    a local ``x`` shadows it. Jumps point to instruction numbers, not offsets."""
    every = list(dis.get_instructions(co, show_caches=True))
    kept = [i for i in every if i.opname not in ("PUSH_NULL", "CACHE")]
    number, n = {}, len(kept)
    for i in reversed(every):  # a jump to a dropped instruction lands on the next kept one
        if i.opname not in ("PUSH_NULL", "CACHE"):
            n -= 1
        number[i.offset] = n
    out = []
    for i in kept:
        opname = "LOAD_ATTR" if i.opname == "LOAD_METHOD" else i.opname
        if i.opcode in _JUMPS:
            arg = ("jump", number.get(i.argval))
        elif i.opcode in _NAME_OPS and isinstance(i.argval, str):
            arg = ("name", i.argval)
        elif isinstance(i.argval, types.CodeType):
            arg = ("code",)
        else:
            arg = ("value", i.argval)
        out.append((opname, arg, i.positions.lineno if i.positions else None, i.opcode))
    return out


def _compare_loosely(a: types.CodeType, b: types.CodeType, maps: _NameMaps, problems: list[str], where: str) -> None:
    ia, ib = _normalised(a), _normalised(b)
    if len(ia) != len(ib):
        problems.append(f"bytecode: {where}: {len(ia)} instructions became {len(ib)}")
        return
    for (op, arg, line, code), (op_b, arg_b, line_b, _) in zip(ia, ib):
        if op != op_b or line != line_b or arg[0] != arg_b[0]:
            problems.append(f"bytecode: {where}: line {line}: {op} {arg[1:]} became {op_b} {arg_b[1:]}")
            return
        if arg[0] == "name":
            if op in _SORTED_CELL_OPS:
                continue
            category = _category(code)
            key = category if category in ("global", "attr", "import") else (category, id(a))
            if (category == "import" and arg != arg_b) or not maps.agree(key, arg[1], arg_b[1]):
                problems.append(f"bytecode: {where}: line {line}: {op} {arg[1]} became {arg_b[1]}, "
                                f"not a consistent renaming")
                return
        elif arg != arg_b or type(arg[-1]) is not type(arg_b[-1]):
            problems.append(f"bytecode: {where}: line {line}: {op} {arg[1:]} became {arg_b[1:]}")
            return


def _compare_code(a: types.CodeType, b: types.CodeType, maps: _NameMaps, problems: list[str]) -> None:
    """The two programs compile to the same bytecode: same instructions, constants, line numbers and exception
    tables, each name kept or consistently replaced by a neutral one (see :class:`_NameMaps`)."""
    where = f"{a.co_qualname} (line {a.co_firstlineno})"
    if (a.co_qualname, a.co_argcount, a.co_kwonlyargcount, a.co_flags) != \
            (b.co_qualname, b.co_argcount, b.co_kwonlyargcount, b.co_flags):
        problems.append(f"bytecode: {where} changed its signature or flags")
        return
    if len(a.co_code) != len(b.co_code):
        _compare_loosely(a, b, maps, problems, where)
    elif list(a.co_lines()) != list(b.co_lines()) or a.co_exceptiontable != b.co_exceptiontable:
        problems.append(f"bytecode: {where}: line table or exception table changed")
        return
    else:
        _compare_exactly(a, b, maps, problems, where)
    _compare_consts(a, b, maps, problems, where)


def _compare_exactly(a: types.CodeType, b: types.CodeType, maps: _NameMaps, problems: list[str], where: str) -> None:
    same = a.co_code == b.co_code and all(getattr(a, f) == getattr(b, f) for f in _NAME_TUPLES)
    if not same:
        ia, ib = _instructions(a), _instructions(b)
        if len(ia) != len(ib):
            problems.append(f"bytecode: {where}: {len(ia)} instructions became {len(ib)}")
            return
        for (op, arg, name, line), (op_b, arg_b, name_b, _) in zip(ia, ib):
            if op != op_b:
                problems.append(f"bytecode: {where}: line {line}: {dis.opname[op]} became {dis.opname[op_b]}")
                return
            if name is None:
                if arg != arg_b:
                    problems.append(f"bytecode: {where}: line {line}: {dis.opname[op]} {arg} became {arg_b}")
                    return
                continue
            if dis.opname[op] in _SORTED_CELL_OPS:
                continue  # cells are made, and closures built, in sorted name order: renaming may reorder them
            category = _category(op)
            key = category if category in ("global", "attr", "import") else (category, id(a))
            if (category == "import" and name != name_b) or not maps.agree(key, name, name_b):
                problems.append(f"bytecode: {where}: line {line}: {dis.opname[op]} {name} became {name_b}, "
                                f"not a consistent renaming")
                return


def _compare_consts(a: types.CodeType, b: types.CodeType, maps: _NameMaps, problems: list[str], where: str) -> None:
    ka, kb = a.co_consts, b.co_consts
    if len(ka) != len(kb):
        problems.append(f"bytecode: {where}: {len(ka)} constants became {len(kb)}")
        return
    for x, y in zip(ka, kb):
        if isinstance(x, types.CodeType) and isinstance(y, types.CodeType):
            _compare_code(x, y, maps, problems)
        elif type(x) is not type(y) or x != y:
            problems.append(f"bytecode: {where}: constant {x!r} became {y!r}")


def self_check(original: str, renaming: Renaming, path: str = "<string>", again: bool = True,
               tree: ast.Module | None = None) -> list[str]:
    """Problems with a renaming (empty: none): see the module docstring."""
    problems: list[str] = []
    try:
        tree_a = tree if tree is not None else ast.parse(original)
    except (SyntaxError, ValueError):
        return problems  # nothing to compare against
    try:
        tree_b = ast.parse(renaming.source)
    except (SyntaxError, ValueError) as exc:
        return [f"the renamed source does not parse: {exc}"]
    if len(_LINES.split(original)) != len(_LINES.split(renaming.source)):
        problems.append("the renamed source has a different number of lines")
    if WORDS.sub("_", original) != WORDS.sub("_", renaming.source):
        problems.append("the renamed source differs from the original in more than identifiers")
    fresh = {n for names in renaming.locals.values() for n in names} | set(renaming.attrs.values())
    try:
        code_a = compile(original, path, "exec", dont_inherit=True)
    except (SyntaxError, ValueError):
        code_a = None  # e.g. `return` outside a function: ast accepts what the compiler refuses
    if code_a is not None:
        try:
            code_b = compile(renaming.source, path, "exec", dont_inherit=True)
        except (SyntaxError, ValueError) as exc:
            problems.append(f"the renamed source does not compile: {exc}")
        else:
            _compare_code(code_a, code_b, _NameMaps(fresh), problems)
    try:
        _compare_tables(symtable.symtable(original, path, "exec"), symtable.symtable(renaming.source, path, "exec"),
                        fresh, "", problems)
    except (SyntaxError, ValueError):
        pass
    if again:
        second = rename_source(renaming.source, renaming.module_names, tree_b)
        if (second.local_count, second.attr_count) != (renaming.local_count, renaming.attr_count):
            problems.append(f"renaming again renamed {second.local_count} locals and {second.attr_count} attributes, "
                            f"not {renaming.local_count} and {renaming.attr_count}")
    return problems



# ----- relinting -------------------------------------------------------------------------------------------------

@dataclass
class Change:
    code: str
    line: int
    message: str
    text: str  # the original source line, stripped
    names: list[tuple[str, str]] = field(default_factory=list)  # (original, neutral) on the finding's lines

    def as_dict(self) -> dict:
        return {"code": self.code, "line": self.line, "message": self.message, "text": self.text,
                "names": [list(p) for p in self.names]}


@dataclass
class FileReport:
    path: str
    findings: int = 0  # findings on the original
    renamed: int = 0  # bindings renamed
    appeared: list[Change] = field(default_factory=list)
    vanished: list[Change] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # self-check failures
    note: str | None = None  # why the file was skipped
    original_codes: Counter = field(default_factory=Counter)

    def as_dict(self) -> dict:
        return {"path": self.path, "findings": self.findings, "renamed": self.renamed,
                "appeared": [c.as_dict() for c in self.appeared], "vanished": [c.as_dict() for c in self.vanished],
                "problems": self.problems, "note": self.note, "original_codes": dict(self.original_codes)}


def names_on_lines(original: str, renamed: str, first: int, last: int) -> list[tuple[str, str]]:
    """(original, neutral) pairs of the identifiers that differ on lines ``first``..``last`` (1-based)."""
    a, b = _LINES.split(original), _LINES.split(renamed)
    pairs: list[tuple[str, str]] = []
    for i in range(max(first, 1) - 1, min(last, first + 4, len(a), len(b))):
        for x, y in zip(WORDS.findall(a[i]), WORDS.findall(b[i])):
            if x != y and (x, y) not in pairs:
                pairs.append((x, y))
    return pairs


def _keyed(findings) -> dict[tuple[str, int], list]:
    out: dict[tuple[str, int], list] = defaultdict(list)
    for f in findings:
        out[(f.code, f.line)].append(f)
    return out


def _lint(source: str, path: str, preview: bool):
    from rlguard.lint import lint_source

    return lint_source(source, path, preview=preview)


def check_source(source: str, path: str = "<string>", preview: bool = False, self_checks: bool = True,
                 prefilter: bool = False, module_names: bool = True) -> FileReport:
    """Lint ``source`` and its renaming; what appears and vanishes. With ``prefilter``, a file no rule's triggers
    match is skipped (it can have no finding); ``module_names``: see :func:`rename_source`."""
    report = FileReport(path)
    if source.startswith("\ufeff"):
        source = source[1:]
    if prefilter:
        from rlguard.lint import all_rules

        lowered = source.lower()
        if not any(r.may_fire(source, lowered) for r in all_rules().values() if preview or not r.preview):
            report.note = NO_TRIGGER
            return report
    from rlguard.lint.engine import run_deep

    try:
        tree = run_deep(ast.parse, source)
    except (SyntaxError, ValueError, MemoryError, RecursionError) as exc:
        report.note = f"does not parse: {exc.__class__.__name__}"
        return report
    try:
        renaming = run_deep(rename_source, source, module_names, tree)
    except Exception as exc:  # a bug here
        report.note = f"not renamed: {exc.__class__.__name__}: {str(exc)[:200]}"
        return report
    report.renamed = renaming.count
    if self_checks:
        report.problems = run_deep(self_check, source, renaming, path, True, tree)
    original = _lint(source, path, preview)
    report.findings = len(original.findings)
    report.original_codes = Counter(f.code for f in original.findings)
    if renaming.count == 0:
        return report
    after = _lint(renaming.source, path, preview)
    lines = _LINES.split(source)
    before_k, after_k = _keyed(original.findings), _keyed(after.findings)

    def change(f, with_names: bool) -> Change:
        text = lines[f.line - 1].strip() if 0 < f.line <= len(lines) else ""
        names = names_on_lines(source, renaming.source, f.line, f.end_line) if with_names else []
        return Change(f.code, f.line, f.message, text, names)

    for key, found in after_k.items():
        extra = len(found) - len(before_k.get(key, []))
        for f in found[len(found) - extra:] if extra > 0 else []:
            report.appeared.append(change(f, True))
    for key, found in before_k.items():
        lost = len(found) - len(after_k.get(key, []))
        for f in found[len(found) - lost:] if lost > 0 else []:
            report.vanished.append(change(f, True))
    before_errors = {(e.rule, e.exc_type) for e in original.errors}
    for e in after.errors:
        if (e.rule, e.exc_type) not in before_errors:
            report.appeared.append(Change(e.rule or "engine", 1, f"internal error under renaming: {e.describe()}", ""))
    report.appeared.sort(key=lambda c: (c.line, c.code))
    report.vanished.sort(key=lambda c: (c.line, c.code))
    return report


# ----- inputs ----------------------------------------------------------------------------------------------------

def python_files(paths: list[str]) -> list[Path]:
    from rlguard.lint.runner import SKIP_DIRS

    out: list[Path] = []
    for raw in paths:
        p = Path(raw)
        if p.is_file():
            out.append(p)
            continue
        for dirpath, dirnames, filenames in os.walk(p):
            dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS and not d.endswith(".egg-info")
                                 and not os.path.isfile(os.path.join(dirpath, d, "pyvenv.cfg")))
            out.extend(Path(dirpath, f) for f in sorted(filenames) if f.endswith(".py"))
    return out


def rule_examples() -> list[tuple[str, str]]:
    """(label, source) of every VALID and INVALID example of every registered rule."""
    from rlguard.lint import all_rules

    out = []
    for code, rule in all_rules().items():
        for kind, examples in (("valid", rule.VALID), ("invalid", rule.INVALID)):
            for i, ex in enumerate(examples):
                out.append((f"{code}-{kind}-{i}", textwrap.dedent(ex.code)))
    return out


def ecosystem_trees(only: list[str], part: str | None) -> tuple[list[tuple[str, Path]], list[str]]:
    repos = tomllib.loads(ECOSYSTEM_TOML.read_text(encoding="utf-8"))["repo"]
    chosen, missing = [], []
    for entry in repos:
        if only and entry["name"] not in only:
            continue
        if part and entry.get("part") != part:
            continue
        tree = TREES / f"{entry['name']}-{entry['commit'][:12]}"
        if tree.is_dir():
            chosen.append((entry["name"], tree))
        else:
            missing.append(entry["name"])
    unknown = set(only) - {e["name"] for e in repos}
    if unknown:
        raise SystemExit(f"--only: no repository named {sorted(unknown)} in {ECOSYSTEM_TOML.name}")
    return chosen, missing


NO_TRIGGER = "no rule's triggers match"
_OPTIONS: dict = {}


def _init_worker(options: dict) -> None:
    _OPTIONS.update(options)


def _job(item: tuple[str, str | None, str | None, bool]) -> FileReport:
    label, source, file, prefilter = item
    if source is None:
        try:
            data = Path(file).read_bytes()
            source = data.decode("utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            return FileReport(label, note=f"unreadable: {exc.__class__.__name__}")
    try:
        return check_source(source, label, preview=_OPTIONS.get("preview", False),
                            self_checks=_OPTIONS.get("self_checks", True), prefilter=prefilter,
                            module_names=_OPTIONS.get("module_names", True))
    except RecursionError:
        return FileReport(label, note="not renamed: RecursionError")


def run_all(items: list[tuple[str, str | None, str | None, bool]], jobs: int, options: dict) -> list[FileReport]:
    if jobs <= 1 or len(items) < 8:
        _init_worker(options)
        return [_job(i) for i in items]
    import multiprocessing as mp

    out: list[FileReport] = []
    with mp.get_context("fork" if sys.platform != "win32" else "spawn").Pool(
            jobs, initializer=_init_worker, initargs=(options,)) as pool:
        for n, report in enumerate(pool.imap(_job, items, chunksize=4), 1):
            out.append(report)
            if n % 500 == 0:
                print(f"  {n}/{len(items)} inputs", file=sys.stderr, flush=True)
    return out


# ----- output ----------------------------------------------------------------------------------------------------

def summarise(reports: list[FileReport]) -> dict[str, dict[str, int]]:
    per: dict[str, Counter] = defaultdict(Counter)
    for r in reports:
        for code, n in r.original_codes.items():
            per[code]["findings"] += n
        for c in r.appeared:
            per[c.code]["appeared"] += 1
        for c in r.vanished:
            per[c.code]["vanished"] += 1
    return {code: {k: per[code][k] for k in ("findings", "appeared", "vanished")} for code in sorted(per)}


def print_report(reports: list[FileReport], seconds: float, out=sys.stdout) -> None:
    for r in reports:
        if not (r.appeared or r.vanished or r.problems):
            continue
        print(f"{r.path}  ({r.renamed} renamed, {r.findings} findings)", file=out)
        for problem in r.problems:
            print(f"  ! self-check: {problem}", file=out)
        for sign, changes in (("+ APPEARS", r.appeared), ("- vanishes", r.vanished)):
            for c in changes:
                print(f"  {sign} {c.code} line {c.line}: {c.message}", file=out)
                if c.text:
                    print(f"      | {c.text}", file=out)
                if c.names and sign.startswith("-"):
                    print("      names: " + ", ".join(f"{a} -> {b}" for a, b in c.names), file=out)
    checked = [r for r in reports if r.note is None]
    skipped = Counter((r.note or "").split(":")[0] for r in reports if r.note is not None)
    print(f"\n{len(reports)} inputs, {len(checked)} renamed and relinted "
          f"({sum(r.renamed for r in checked)} bindings renamed, {sum(r.findings for r in checked)} original findings)"
          f" in {seconds:.1f} s", file=out)
    for why, n in sorted(skipped.items()):
        print(f"  skipped {n}: {why}", file=out)
    table = summarise(reports)
    print(f"\n{'code':8} {'findings':>9} {'appeared':>9} {'vanished':>9}", file=out)
    for code, row in table.items():
        print(f"{code:8} {row['findings']:>9} {row['appeared']:>9} {row['vanished']:>9}", file=out)
    total = {k: sum(row[k] for row in table.values()) for k in ("findings", "appeared", "vanished")}
    print(f"{'total':8} {total['findings']:>9} {total['appeared']:>9} {total['vanished']:>9}", file=out)
    bad = [r for r in reports if r.problems]
    if bad:
        print(f"\nself-check failed on {len(bad)} inputs: a bug of benchmarks/rename.py", file=out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("paths", nargs="*", help="files or folders to check")
    parser.add_argument("--rule-examples", action="store_true", help="every VALID and INVALID example of every rule")
    parser.add_argument("--ecosystem", action="store_true", help=f"the snapshot trees under {TREES}")
    parser.add_argument("--only", action="append", default=[], metavar="NAME", help="with --ecosystem: this repository")
    parser.add_argument("--part", choices=("development", "validation", "holdout"), help="with --ecosystem: one part of the split")
    parser.add_argument("--preview", action="store_true",
                        help="lint with the preview rules and parts on (passed to lint_source as preview=True)")
    parser.add_argument("--jobs", "-j", type=int, default=1, help="worker processes")
    parser.add_argument("--json", metavar="FILE", help="write every report as JSON")
    parser.add_argument("--strict", action="store_true", help="also fail when a finding of a --stable code vanishes")
    parser.add_argument("--stable", default="", metavar="CODES",
                        help="comma-separated codes for --strict (default with --strict: every code)")
    parser.add_argument("--no-self-check", action="store_true", help="skip the self-checks (faster)")
    parser.add_argument("--locals-only", action="store_true",
                        help="do not rename module-level variables (function locals and self-attributes only)")
    args = parser.parse_args(argv)
    if not (args.paths or args.rule_examples or args.ecosystem):
        parser.error("give PATHs, --rule-examples or --ecosystem")

    # (label, source or None, file or None, skip the file when no rule's triggers match it)
    items: list[tuple[str, str | None, str | None, bool]] = []
    if args.rule_examples:
        items += [(label, source, None, False) for label, source in rule_examples()]
    for p in python_files(args.paths):
        items.append((str(p), None, str(p), False))
    if args.ecosystem:
        trees, missing = ecosystem_trees(args.only, args.part)
        if missing:
            print(f"note: no extracted tree for {', '.join(missing)} (run benchmarks/ecosystem.py first)",
                  file=sys.stderr)
        for name, tree in trees:
            for p in python_files([str(tree)]):
                items.append((f"{name}:{p.relative_to(tree).as_posix()}", None, str(p), True))
    options = {"preview": args.preview, "self_checks": not args.no_self_check, "module_names": not args.locals_only}
    start = time.perf_counter()
    reports = run_all(items, max(1, args.jobs), options)
    seconds = time.perf_counter() - start
    print_report(reports, seconds)
    if args.json:
        Path(args.json).write_text(json.dumps({"seconds": seconds, "preview": args.preview, "inputs": len(reports),
                                               "relinted": sum(r.note is None for r in reports),
                                               "renamed": sum(r.renamed for r in reports),
                                               "summary": summarise(reports),
                                               "files": [r.as_dict() for r in reports if r.note is None
                                                         and (r.appeared or r.vanished or r.problems)],
                                               "skipped": {r.path: r.note for r in reports if r.note is not None
                                                           and r.note != NO_TRIGGER}},
                                              indent=1))
    if any(r.problems for r in reports):
        return 2
    if any(r.appeared for r in reports):
        return 1
    if args.strict:
        stable = {c.strip() for c in args.stable.split(",") if c.strip()}
        if any(c.code in stable or not stable for r in reports for c in r.vanished):
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
