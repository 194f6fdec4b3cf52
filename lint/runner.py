"""Lint files and folders: discovery, configuration per file, the cache, parallel workers, fixes.

The per-file work is :func:`lint_job`, a top-level function of plain data (display path, file bytes, codes,
names, fix, target version) so that it runs the same in this process or in a worker process. Only regular files
are read: a FIFO, socket or device named ``x.py`` is skipped (opening a FIFO would wait forever for a writer).
Nothing here imports torch.
"""

from __future__ import annotations

import difflib
import os
import re
import stat
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

from rlguard.catalog import PARSE_ERROR, TOOL_CODES, UNUSED_NOQA
from rlguard.lint import noqa
from rlguard.lint.analysis.summaries import Project, module_name_for
from rlguard.lint.cache import Cache, cache_key
from rlguard.lint.config import Config, ConfigError, Layer, load_config
from rlguard.lint.engine import FileResult, InternalError, decode, internal_error, lint_source, source_encoding
from rlguard.lint.names import Vocabulary
from rlguard.lint.rule import Finding

# Folders never walked into (a folder named on the command line is still linted).
SKIP_DIRS = frozenset({
    ".git", ".hg", ".svn", ".bzr", ".venv", "venv", "__pycache__", "build", "dist", ".tox", ".nox", ".eggs",
    "node_modules", ".rlguard_cache", ".rlguard_realcode", ".rlguard_ecosystem", ".mypy_cache", ".pytest_cache", ".ruff_cache", ".ipynb_checkpoints",
    "__pypackages__",
})
# Below this many files to parse, worker processes cost more than they save.
PARALLEL_MIN_FILES = 32


class PathError(ValueError):
    """A path given to lint does not exist."""


@dataclass(frozen=True)
class Skipped:
    """A path that was not linted, and why (a FIFO, a socket, a device: not a regular file)."""

    path: str
    reason: str
    explicit: bool  # named on the command line (always worth a note) rather than found in a folder


@dataclass
class LintReport:
    """Everything one run found, for the CLI and the output formats."""

    findings: list[Finding] = field(default_factory=list)
    suppressed: list[Finding] = field(default_factory=list)
    fixed: list[Finding] = field(default_factory=list)
    files_checked: int = 0
    errors: list[InternalError] = field(default_factory=list)
    files_fixed: list[str] = field(default_factory=list)
    diffs: list[str] = field(default_factory=list)
    cache_hits: int = 0
    skipped: list[Skipped] = field(default_factory=list)
    noqa_added: int = 0  # directives written by --add-noqa
    noqa_refused: list[str] = field(default_factory=list)  # "path:line" where --add-noqa could not write one

    @property
    def files_with_findings(self) -> int:
        return len({f.path for f in self.findings})

    @property
    def files_not_fully_checked(self) -> int:
        """Files where a rule or the engine failed (RLG902): their findings are incomplete."""
        return len({e.path for e in self.errors})

    def counts(self) -> Counter:
        return Counter(f.code for f in self.findings)


# ----- discovery ----------------------------------------------------------------------------------------------
def _skip_dir(parent: str, name: str) -> bool:
    if name in SKIP_DIRS or name.endswith(".egg-info"):
        return True
    return os.path.isfile(os.path.join(parent, name, "pyvenv.cfg"))  # any virtualenv, whatever its name


def _not_regular(path: Path) -> str | None:
    """Why ``path`` is not a file to read (a FIFO, a socket, a device), None for a regular file or one that
    cannot be stat'ed (reading it reports why)."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return None
    if stat.S_ISREG(mode):
        return None
    for test, what in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISDIR, "a folder")):
        if test(mode):
            return f"not a regular file ({what})"
    return "not a regular file"


def discover(paths: Sequence[str | os.PathLike], config: Config, force_exclude: bool = False,
             skipped: list[Skipped] | None = None, unreadable: list[tuple[str, OSError]] | None = None) -> list[Path]:
    """The Python files under ``paths``, in a stable order. Folders skip virtualenvs, build/VCS/cache folders and
    the config's ``exclude``; a path named explicitly is linted even when excluded, unless ``force_exclude``.
    Paths that are not regular files go to ``skipped``; folders that cannot be listed to ``unreadable``."""
    found: list[Path] = []
    seen: set[str] = set()

    def add(path: Path, explicit: bool) -> None:
        key = os.path.abspath(path)
        if key in seen:
            return
        seen.add(key)
        why = _not_regular(path)
        if why is None:
            found.append(path)
        elif skipped is not None:
            skipped.append(Skipped(display_path(path), why, explicit))

    def walk_error(exc: OSError) -> None:
        if unreadable is not None and exc.filename is not None:
            unreadable.append((display_path(Path(exc.filename)), exc))

    missing = [str(p) for p in paths if not os.path.exists(p)]
    if missing:
        raise PathError(f"no such file or directory: {missing[0]}")
    for raw in paths:
        path = Path(raw)
        if force_exclude and config.is_excluded(path):
            continue
        if not path.is_dir():
            add(path, explicit=True)
            continue
        for dirpath, dirnames, filenames in os.walk(path, onerror=walk_error):
            dirnames[:] = sorted(d for d in dirnames
                                 if not _skip_dir(dirpath, d) and not config.is_excluded(Path(dirpath, d)))
            for name in sorted(filenames):
                if name.endswith(".py"):
                    file = Path(dirpath, name)
                    if not config.is_excluded(file):
                        add(file, explicit=False)
    return found


def display_path(path: Path) -> str:
    """Relative to the current directory when under it (POSIX separators), else as given."""
    try:
        return Path(os.path.abspath(path)).relative_to(Path.cwd()).as_posix()
    except ValueError:
        return str(path)


# ----- per-file work (runs in workers) --------------------------------------------------------------------------
_RULES: dict[tuple[str, ...], list] = {}
_VOCABS: dict[tuple, Vocabulary] = {}


_PROJECTS: dict[tuple, Project] = {}


def lint_job(job: tuple) -> FileResult:
    """Lint one file's bytes with the given codes, extra names and target version. Never raises. ``roots`` are
    the source roots of the linted tree (where calls into other files find their callee's summary), ``module``
    the file's module name, ``summarise`` whether other linted files import it (its summaries are then kept: all, or the set of
    top-level names they import)."""
    path, data, codes, names, fix, target, roots, module, summarise, preview = job
    try:
        text, error = decode(data, path)
        if error is not None:
            return FileResult(path, findings=[error])
        rules = _RULES.get(codes)
        if rules is None:
            from rlguard.lint.rule import all_rules

            registry = all_rules()
            rules = _RULES[codes] = [registry[c] for c in codes if c in registry]
        vocabulary = _VOCABS.get(names)
        if vocabulary is None:
            vocabulary = _VOCABS[names] = Vocabulary(extra=dict(names))
        project = _PROJECTS.get((roots, names))
        if project is None:
            project = _PROJECTS[(roots, names)] = Project(roots, vocabulary)
        return lint_source(text, path, rules, vocabulary, fix, target_version=target,
                           unused_noqa=UNUSED_NOQA in codes, project=project, module_name=module,
                           summarise=summarise, preview=preview)
    except Exception as exc:  # the engine itself failed on this file (a libcst quirk, memory...)
        return FileResult(path, errors=[internal_error(path, None, exc)])


def _run_jobs(jobs: list[tuple], workers: int) -> list[FileResult]:
    if workers <= 1 or len(jobs) < PARALLEL_MIN_FILES:
        return [lint_job(job) for job in jobs]
    from concurrent.futures import ProcessPoolExecutor
    from concurrent.futures.process import BrokenProcessPool

    workers = min(workers, len(jobs))
    chunk = max(1, min(16, len(jobs) // (workers * 8)))
    # Big files first, so one large file does not finish alone at the end.
    order = sorted(range(len(jobs)), key=lambda i: -len(jobs[i][1]))
    try:
        with ProcessPoolExecutor(max_workers=workers) as pool:
            results = list(pool.map(lint_job, [jobs[i] for i in order], chunksize=chunk))
    except (BrokenProcessPool, OSError, PermissionError):  # no usable worker processes here: do it ourselves
        return [lint_job(job) for job in jobs]
    out: list[FileResult] = [None] * len(jobs)  # type: ignore[list-item]
    for i, result in zip(order, results):
        out[i] = result
    return out


# ----- one run ------------------------------------------------------------------------------------------------
def run(paths: Sequence[str | os.PathLike], config: Config, jobs: int = 1, cache: bool = True, fix: bool = False,
        diff: bool = False, force_exclude: bool = False, add_noqa: str | None = None) -> LintReport:
    """Lint ``paths`` under ``config``. With ``fix``, write the safe rewrites back (``diff``: only collect a
    unified diff per file and write nothing). With ``add_noqa`` (a reason, possibly empty), write a
    ``# noqa: CODE`` comment for each finding instead."""
    fix = fix or diff
    report = LintReport()
    unreadable: list[tuple[str, OSError]] = []
    files = discover(paths, config, force_exclude=force_exclude, skipped=report.skipped, unreadable=unreadable)
    report.files_checked = len(files)
    store = Cache(config.root) if cache else None
    names = tuple(sorted(config.names.items()))

    pending: list[tuple] = []
    meta: list[tuple[Path, str, bytes, tuple[str, ...], str | None]] = []  # per pending job
    results: list[tuple[FileResult, tuple[str, ...]]] = [
        (FileResult(shown, findings=[_unreadable(shown, exc, "folder")]), config.selected) for shown, exc in unreadable]
    contents: dict[str, tuple[Path, bytes]] = {}  # for --add-noqa
    modules = {path: module_name_for(path) for path in files}
    roots = tuple(sorted({str(root) for _, root in modules.values()}))
    for path in files:
        shown = display_path(path)
        codes = config.codes_for(path)
        try:
            data = read_regular_file(path)
        except OSError as exc:
            results.append((FileResult(shown, findings=[_unreadable(shown, exc)]), codes))
            continue
        if data is None:  # replaced by a FIFO or the like since discovery
            report.skipped.append(Skipped(shown, "not a regular file", False))
            report.files_checked -= 1
            continue
        contents[shown] = (path, data)
        key = cache_key(config.relative(path), data, config.fingerprint(codes)) if store else None
        if store is not None:
            hit = store.get(key, shown)
            if hit is not None and not (fix and any(f.fixable for f in hit[0])):
                report.cache_hits += 1
                results.append((FileResult(shown, findings=hit[0], suppressed=hit[1]), codes))
                continue
        pending.append((shown, data, codes, names, fix, config.target_version, roots, modules[path][0], False,
                        config.preview))
        meta.append((path, shown, data, codes, key))

    # imported modules first, so their summaries are ready when their importers are linted
    order = import_order([job[1] for job in pending], [job[7] for job in pending])
    pending = [(*pending[i][:8], order.summarise(pending[i][7]), pending[i][9]) for i in order.order]
    meta = [meta[i] for i in order.order]
    for (path, shown, data, codes, key), result in zip(meta, _run_jobs(pending, jobs)):
        if result.fixed_source is not None and not result.errors:
            _apply_fix(path, shown, data, result, report, write=not diff)
        elif store is not None and key is not None and not result.errors:
            store.put(key, result.findings, result.suppressed, result.depends)
        results.append((result, codes))

    for result, codes in results:
        # RLG900 comes from the engine whatever the selection: drop it where the user ignored it.
        keep = PARSE_ERROR in codes
        report.findings.extend(f for f in result.findings if keep or f.code != PARSE_ERROR)
        report.suppressed.extend(result.suppressed)
        report.fixed.extend(result.fixed)
        report.errors.extend(result.errors)
        # an internal error is a finding in every format, whatever the selection: the file was not fully checked
        report.findings.extend(error.finding() for error in result.errors)
    for bucket in (report.findings, report.suppressed, report.fixed):
        bucket.sort(key=Finding.sort_key)
    report.errors.sort(key=lambda e: (e.path, e.rule or ""))
    if add_noqa is not None:
        _add_noqa(report, contents, add_noqa)
    return report


@dataclass
class ImportOrder:
    order: list[int]  # job indices, imported modules before the modules that import them
    imported: set[str]  # module names some linted file imports
    # what other files import from each of them: the top-level names, or None for the whole module (`import m`,
    # `from m import *`, a parenthesised list the line scan cannot read to its end)
    members: dict[str, set[str] | None] = field(default_factory=dict)

    def summarise(self, module: str) -> bool | frozenset[str]:
        """What of ``module`` to summarise for its importers: nothing, everything, or the names they import."""
        if module not in self.imported:
            return False
        names = self.members.get(module)
        return True if names is None else frozenset(names)


_IMPORT = re.compile(rb"^[ \t]*(?:from[ \t]+(\.*[\w.]*)[ \t]+import[ \t]+\(?([\w ,\t]*)|import[ \t]+([\w., \t]+))",
                     re.MULTILINE)


def import_order(datas: list[bytes], names: list[str]) -> ImportOrder:
    """A cheap scan of ``import`` lines (no parse): which of the linted modules are imported by others, and an
    order that lints a module before its importers (so its summaries are ready; cycles are cut anywhere)."""
    known = {name: i for i, name in enumerate(names)}
    edges: list[set[int]] = [set() for _ in names]
    imported: set[str] = set()
    member_names: dict[str, set[str] | None] = {}
    for i, (data, name) in enumerate(zip(datas, names)):
        package = name.split(".")[:-1]
        for match in _IMPORT.finditer(data):
            source, members, plain = match.groups()
            named: list[str] | None = None  # the names a `from` line takes (None: whole modules)
            if plain is not None:
                targets = [m.strip().split(" ")[0] for m in plain.decode("ascii", "ignore").split(",")]
            else:
                text = source.decode("ascii", "ignore")
                level = len(text) - len(text.lstrip("."))
                base = text[level:]
                if level:
                    up = package[:len(package) - (level - 1)] if level - 1 <= len(package) else []
                    base = ".".join([*up, base] if base else up)
                named = [m.strip().split(" ")[0] for m in members.decode("ascii", "ignore").split(",") if m.strip()]
                if not named or (b"(" in match.group(0) and b")" not in match.group(0)):
                    named = None  # `import *`, or a list continued on the next lines
                targets = [base] + [f"{base}.{m}" for m in named or ()]
            for target in targets:
                if target in known and known[target] != i:
                    imported.add(target)
                    edges[i].add(known[target])
                    if plain is not None or target != base or named is None:
                        member_names[target] = None  # the module itself is imported: any of its names
                    elif target not in member_names or member_names[target] is not None:
                        member_names.setdefault(target, set()).update(named)
    order: list[int] = []
    state = [0] * len(names)  # 0 new, 1 on the stack, 2 done
    for start in range(len(names)):
        if state[start]:
            continue
        stack = [(start, iter(sorted(edges[start])))]
        state[start] = 1
        while stack:
            node, kids = stack[-1]
            child = next(kids, None)
            if child is None:
                stack.pop()
                state[node] = 2
                order.append(node)
            elif state[child] == 0:
                state[child] = 1
                stack.append((child, iter(sorted(edges[child]))))
    return ImportOrder(order, imported, member_names)


def read_regular_file(path: Path) -> bytes | None:
    """The bytes of ``path``, or None when it is not a regular file. Opened without blocking, so a FIFO that
    took the file's place after discovery cannot hang the run waiting for a writer."""
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0)
    fd = os.open(path, flags)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        chunks = []
        while True:
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                return b"".join(chunks)
            chunks.append(chunk)
    finally:
        os.close(fd)


def _unreadable(path: str, exc: OSError, what: str = "file") -> Finding:
    from rlguard.catalog import CODES

    code = CODES[PARSE_ERROR]
    return Finding(path, 1, 1, 1, 1, code.code, code.name, f"cannot read {what}: {exc.strerror or exc}", "error")


def _write_source(path: Path, data: bytes, text: str) -> None:
    """Write ``text`` back in the encoding the file was read with (a BOM stays, a coding line is honoured)."""
    path.write_bytes(text.encode(source_encoding(data)))


def _apply_fix(path: Path, shown: str, data: bytes, result: FileResult, report: LintReport, write: bool) -> None:
    original, _ = decode(data, shown)
    fixed = result.fixed_source
    if original is None or fixed == original:
        return
    if write:
        _write_source(path, data, fixed)
    else:
        report.diffs.append("".join(difflib.unified_diff(
            original.splitlines(keepends=True), fixed.splitlines(keepends=True), f"a/{shown}", f"b/{shown}")))
    report.files_fixed.append(shown)


def _add_noqa(report: LintReport, contents: dict[str, tuple[Path, bytes]], reason: str) -> None:
    """--add-noqa: a ``# noqa: CODE`` comment for every finding of a rule (rlguard's own codes excluded)."""
    by_file: dict[str, list[tuple[int, int, str]]] = {}
    for f in report.findings:
        if f.code not in TOOL_CODES and f.path in contents:
            by_file.setdefault(f.path, []).append((f.line, f.end_line, f.code))
    for shown, spans in sorted(by_file.items()):
        path, data = contents[shown]
        text, error = decode(data, shown)
        if text is None:
            continue
        new, changed, refused = noqa.add_directives(text, spans, reason)
        if changed:
            try:
                _write_source(path, data, new)
            except UnicodeEncodeError:  # a reason the file's declared encoding cannot hold
                refused = sorted({line for line, _, _ in spans})
                changed = 0
        report.noqa_refused += [f"{shown}:{line}" for line in refused]
        if changed:
            report.noqa_added += changed
            report.files_fixed.append(shown)


# ----- the public entry point -----------------------------------------------------------------------------------
def lint_paths(paths: Iterable[str | os.PathLike], select: Sequence[str] | None = None,
               ignore: Sequence[str] | None = None, config: Config | str | os.PathLike | None = None,
               jobs: int = 1, cache: bool = True, fix: bool = False, preview: bool | None = None) -> list[Finding]:
    """Lint files and folders with the project's ``[tool.rlguard]`` (or ``config``: a :class:`Config` or the path
    of a TOML file), ``select``/``ignore`` applied on top as on the command line. Returns the findings sorted by
    path and position. Raises :class:`ConfigError` for a bad configuration, :class:`PathError` for a missing path,
    and :class:`RuntimeError` when a rule failed on some file."""
    report = lint_report(paths, select=select, ignore=ignore, config=config, jobs=jobs, cache=cache, fix=fix,
                         preview=preview)
    if report.errors:
        raise RuntimeError("; ".join(e.describe() for e in report.errors))
    return report.findings


def lint_report(paths: Iterable[str | os.PathLike], select: Sequence[str] | None = None,
                ignore: Sequence[str] | None = None, config: Config | str | os.PathLike | None = None,
                jobs: int = 1, cache: bool = True, fix: bool = False, diff: bool = False,
                extend_select: Sequence[str] = (), force_exclude: bool = False,
                target_version: str | None = None, preview: bool | None = None) -> LintReport:
    """Like :func:`lint_paths`, returning the whole :class:`LintReport` (suppressed, fixed, internal errors).
    ``target_version`` (``"py311"``) overrides the configuration's; ``preview`` (None: as configured) turns the
    preview rules and parts on or off."""
    paths = [os.fspath(p) for p in paths] or ["."]
    layer = Layer(select=tuple(select) if select is not None else None, extend_select=tuple(extend_select),
                  ignore=tuple(ignore or ()), preview=preview)
    if not isinstance(config, Config):
        config = load_config(paths, config_path=config, cli=layer, target_version=target_version)
    elif select is not None or ignore or extend_select or preview is not None:
        config = Config(root=config.root, source=config.source, layers=[*config.layers, layer],
                        exclude=config.exclude, per_file_ignores=config.per_file_ignores, names=config.names,
                        target_version=config.target_version, target_source=config.target_source)
    return run(paths, config, jobs=jobs, cache=cache, fix=fix, diff=diff, force_exclude=force_exclude)


__all__ = ["ConfigError", "LintReport", "PathError", "SKIP_DIRS", "Skipped", "discover", "lint_job", "lint_paths",
           "lint_report", "read_regular_file", "run"]

if __name__ == "__main__":  # pragma: no cover
    sys.exit("use `rlguard lint`")
