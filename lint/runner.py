"""Lint files and folders: discovery, configuration per file, the cache, parallel workers, fixes.

The per-file work is :func:`lint_job`, a top-level function of plain data (display path, file bytes, codes,
names, fix) so that it runs the same in this process or in a worker process. Nothing here imports torch.
"""

from __future__ import annotations

import difflib
import os
import re
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

from rlguard.lint.analysis.summaries import Project, module_name_for
from rlguard.lint.cache import Cache, cache_key
from rlguard.lint.config import PARSE_ERROR, Config, ConfigError, Layer, load_config
from rlguard.lint.engine import FileResult, InternalError, decode, internal_error, lint_source
from rlguard.lint.names import Vocabulary
from rlguard.lint.rule import Finding

# Folders never walked into (a folder named on the command line is still linted).
SKIP_DIRS = frozenset({
    ".git", ".hg", ".svn", ".bzr", ".venv", "venv", "__pycache__", "build", "dist", ".tox", ".nox", ".eggs",
    "node_modules", ".rlguard_cache", ".mypy_cache", ".pytest_cache", ".ruff_cache", ".ipynb_checkpoints",
    "__pypackages__",
})
# Below this many files to parse, worker processes cost more than they save.
PARALLEL_MIN_FILES = 32
_BOM = b"\xef\xbb\xbf"


class PathError(ValueError):
    """A path given to lint does not exist."""


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

    @property
    def files_with_findings(self) -> int:
        return len({f.path for f in self.findings})

    def counts(self) -> Counter:
        return Counter(f.code for f in self.findings)


# ----- discovery ----------------------------------------------------------------------------------------------
def _skip_dir(parent: str, name: str) -> bool:
    if name in SKIP_DIRS or name.endswith(".egg-info"):
        return True
    return os.path.isfile(os.path.join(parent, name, "pyvenv.cfg"))  # any virtualenv, whatever its name


def discover(paths: Sequence[str | os.PathLike], config: Config, force_exclude: bool = False) -> list[Path]:
    """The Python files under ``paths``, in a stable order. Folders skip virtualenvs, build/VCS/cache folders and
    the config's ``exclude``; a path named explicitly is linted even when excluded, unless ``force_exclude``."""
    found: list[Path] = []
    seen: set[str] = set()

    def add(path: Path) -> None:
        key = os.path.abspath(path)
        if key not in seen:
            seen.add(key)
            found.append(path)

    missing = [str(p) for p in paths if not os.path.exists(p)]
    if missing:
        raise PathError(f"no such file or directory: {missing[0]}")
    for raw in paths:
        path = Path(raw)
        if force_exclude and config.is_excluded(path):
            continue
        if not path.is_dir():
            add(path)
            continue
        for dirpath, dirnames, filenames in os.walk(path):
            dirnames[:] = sorted(d for d in dirnames
                                 if not _skip_dir(dirpath, d) and not config.is_excluded(Path(dirpath, d)))
            for name in sorted(filenames):
                if name.endswith(".py"):
                    file = Path(dirpath, name)
                    if not config.is_excluded(file):
                        add(file)
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
    """Lint one file's bytes with the given codes and extra names. Never raises. ``roots`` are the source roots
    of the linted tree (where calls into other files find their callee's summary); ``module`` is this file's
    module name, and ``summarise`` says whether other files import it (its summaries are then kept)."""
    path, data, codes, names, fix, roots, module, summarise = job
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
        return lint_source(text, path, rules, vocabulary, fix, project=project, module_name=module,
                           summarise=summarise)
    except Exception as exc:  # the engine itself failed on this file (deep nesting, a libcst quirk...)
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
        diff: bool = False, force_exclude: bool = False) -> LintReport:
    """Lint ``paths`` under ``config``. With ``fix``, write the safe rewrites back (``diff``: only collect a
    unified diff per file and write nothing)."""
    fix = fix or diff
    report = LintReport()
    files = discover(paths, config, force_exclude=force_exclude)
    report.files_checked = len(files)
    store = Cache(config.root) if cache else None
    names = tuple(sorted(config.names.items()))

    pending: list[tuple] = []
    meta: list[tuple[Path, str, bytes, tuple[str, ...], str | None]] = []  # per pending job
    results: list[tuple[FileResult, tuple[str, ...]]] = []
    modules = {path: module_name_for(path) for path in files}
    roots = tuple(sorted({str(root) for _, root in modules.values()}))
    for path in files:
        shown = display_path(path)
        codes = config.codes_for(path)
        try:
            data = path.read_bytes()
        except OSError as exc:
            results.append((FileResult(shown, findings=[_unreadable(shown, exc)]), codes))
            continue
        key = cache_key(config.relative(path), data, config.fingerprint(codes)) if store else None
        if store is not None:
            hit = store.get(key, shown)
            if hit is not None and not (fix and any(f.fixable for f in hit[0])):
                report.cache_hits += 1
                results.append((FileResult(shown, findings=hit[0], suppressed=hit[1]), codes))
                continue
        pending.append((shown, data, codes, names, fix, roots, modules[path][0], False))
        meta.append((path, shown, data, codes, key))

    order = import_order([job[1] for job in pending], [job[6] for job in pending])
    imported = order.imported
    pending = [(*job[:7], job[6] in imported) for job in pending]
    pending = [pending[i] for i in order.order]
    meta = [meta[i] for i in order.order]
    for (path, shown, data, codes, key), result in zip(meta, _run_jobs(pending, jobs)):
        if result.fixed_source is not None and not result.errors:
            _apply_fix(path, shown, data, result, report, write=not diff)
        elif store is not None and key is not None and not result.errors:
            store.put(key, result.findings, result.suppressed)
        results.append((result, codes))

    for result, codes in results:
        # RLG900 comes from the engine whatever the selection: drop it where the user ignored it.
        keep = PARSE_ERROR in codes
        report.findings.extend(f for f in result.findings if keep or f.code != PARSE_ERROR)
        report.suppressed.extend(result.suppressed)
        report.fixed.extend(result.fixed)
        report.errors.extend(result.errors)
    for bucket in (report.findings, report.suppressed, report.fixed):
        bucket.sort(key=Finding.sort_key)
    report.errors.sort(key=lambda e: (e.path, e.rule or ""))
    return report


@dataclass
class ImportOrder:
    order: list[int]  # job indices, imported modules before the modules that import them
    imported: set[str]  # module names some linted file imports


_IMPORT = re.compile(rb"^[ \t]*(?:from[ \t]+(\.*[\w.]*)[ \t]+import[ \t]+\(?([\w ,\t]*)|import[ \t]+([\w., \t]+))",
                     re.MULTILINE)


def import_order(datas: list[bytes], names: list[str]) -> ImportOrder:
    """A cheap scan of ``import`` lines (no parse): which of the linted modules are imported by others, and an
    order that lints a module before its importers (so its summaries are ready; cycles are cut anywhere)."""
    known = {name: i for i, name in enumerate(names)}
    edges: list[set[int]] = [set() for _ in names]
    imported: set[str] = set()
    for i, (data, name) in enumerate(zip(datas, names)):
        package = name.split(".")[:-1]
        for match in _IMPORT.finditer(data):
            source, members, plain = match.groups()
            targets = []
            if plain is not None:
                targets = [m.strip().split(" ")[0] for m in plain.decode("ascii", "ignore").split(",")]
            else:
                text = source.decode("ascii", "ignore")
                level = len(text) - len(text.lstrip("."))
                base = text[level:]
                if level:
                    up = package[:len(package) - (level - 1)] if level - 1 <= len(package) else []
                    base = ".".join([*up, base] if base else up)
                targets = [base] + [f"{base}.{m.strip().split(' ')[0]}" for m in
                                    members.decode("ascii", "ignore").split(",") if m.strip()]
            for target in targets:
                if target in known and known[target] != i:
                    imported.add(target)
                    edges[i].add(known[target])
    order: list[int] = []
    state = [0] * len(names)  # 0 new, 1 on the stack, 2 done
    for start in range(len(names)):
        if state[start]:
            continue
        stack = [(start, iter(sorted(edges[start])))]
        state[start] = 1
        while stack:
            node, children = stack[-1]
            child = next(children, None)
            if child is None:
                stack.pop()
                state[node] = 2
                order.append(node)
            elif state[child] == 0:
                state[child] = 1
                stack.append((child, iter(sorted(edges[child]))))
    return ImportOrder(order, imported)


def _unreadable(path: str, exc: OSError) -> Finding:
    from rlguard.catalog import CODES

    code = CODES[PARSE_ERROR]
    return Finding(path, 1, 1, 1, 1, code.code, code.name, f"cannot read file: {exc.strerror or exc}", "error")


def _apply_fix(path: Path, shown: str, data: bytes, result: FileResult, report: LintReport, write: bool) -> None:
    original = data.decode("utf-8-sig")
    fixed = result.fixed_source
    if fixed == original:
        return
    if write:
        out = fixed.encode("utf-8")
        path.write_bytes(_BOM + out if data.startswith(_BOM) else out)
    else:
        report.diffs.append("".join(difflib.unified_diff(
            original.splitlines(keepends=True), fixed.splitlines(keepends=True), f"a/{shown}", f"b/{shown}")))
    report.files_fixed.append(shown)


# ----- the public entry point -----------------------------------------------------------------------------------
def lint_paths(paths: Iterable[str | os.PathLike], select: Sequence[str] | None = None,
               ignore: Sequence[str] | None = None, config: Config | str | os.PathLike | None = None,
               jobs: int = 1, cache: bool = True, fix: bool = False) -> list[Finding]:
    """Lint files and folders with the project's ``[tool.rlguard]`` (or ``config``: a :class:`Config` or the path
    of a TOML file), ``select``/``ignore`` applied on top as on the command line. Returns the findings sorted by
    path and position. Raises :class:`ConfigError` for a bad configuration, :class:`PathError` for a missing path,
    and :class:`RuntimeError` when a rule failed on some file."""
    report = lint_report(paths, select=select, ignore=ignore, config=config, jobs=jobs, cache=cache, fix=fix)
    if report.errors:
        raise RuntimeError("; ".join(e.describe() for e in report.errors))
    return report.findings


def lint_report(paths: Iterable[str | os.PathLike], select: Sequence[str] | None = None,
                ignore: Sequence[str] | None = None, config: Config | str | os.PathLike | None = None,
                jobs: int = 1, cache: bool = True, fix: bool = False, diff: bool = False,
                extend_select: Sequence[str] = (), force_exclude: bool = False) -> LintReport:
    """Like :func:`lint_paths`, returning the whole :class:`LintReport` (suppressed, fixed, internal errors)."""
    paths = [os.fspath(p) for p in paths] or ["."]
    layer = Layer(select=tuple(select) if select is not None else None, extend_select=tuple(extend_select),
                  ignore=tuple(ignore or ()))
    if not isinstance(config, Config):
        config = load_config(paths, config_path=config, cli=layer)
    elif select is not None or ignore or extend_select:
        config = Config(root=config.root, source=config.source, layers=[*config.layers, layer],
                        exclude=config.exclude, per_file_ignores=config.per_file_ignores, names=config.names)
    return run(paths, config, jobs=jobs, cache=cache, fix=fix, diff=diff, force_exclude=force_exclude)


__all__ = ["ConfigError", "LintReport", "PathError", "SKIP_DIRS", "discover", "lint_job", "lint_paths",
           "lint_report", "run"]

if __name__ == "__main__":  # pragma: no cover
    sys.exit("use `rlguard lint`")
