"""Lint one source text: check its syntax for the target Python, parse it, run the selected rules, apply
``# noqa``, place the findings.

Every file is syntax-checked, whatever words it contains, so the verdict never depends on which rules trigger:
by CPython's parser judging the grammar of the target version (``target_version``), and by libcst's parser where
the target is newer than the interpreter running rlguard (a 3.11 interpreter rejects valid 3.12 code). Parsing
with libcst is most of the cost, so a file is parsed only when some selected rule's trigger pattern matches it.

Valid code can be deep: a 400-branch ``elif`` chain is a 400-deep tree, and libcst's conversion of the parse
tree, its code generation for positions and the rules all recurse. So the work for one file runs in a thread
with a large stack and a raised recursion limit (:func:`run_deep`), and a rule that still fails loses only its
own findings on that file, reported as an RLG902 finding while the other rules' findings are kept.
"""

from __future__ import annotations

import ast
import dataclasses
import gc
import io
import queue
import re
import sys
import threading
import time
import tokenize
import traceback
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, Sequence, TypeVar

import libcst as cst
from libcst._parser.types.config import KNOWN_PYTHON_VERSION_STRINGS
from libcst._position import CodePosition, CodeRange
from libcst.metadata.position_provider import PositionProvidingCodegenState

from rlguard.catalog import CODES, INTERNAL_ERROR, PARSE_ERROR, TOOL_CODES, UNUSED_NOQA
from rlguard.lint import neutral, noqa
from rlguard.lint.analysis import Analysis
from rlguard.lint.analysis.summaries import Project, summarise_module
from rlguard.lint.names import Vocabulary
from rlguard.lint.rule import Finding, Rule, Violation, all_rules

# A file's work runs on a thread with this stack (virtual memory: pages are committed only as deep code
# touches them) and this recursion limit, enough for the deepest code CPython itself compiles.
DEEP_STACK_BYTES = 512 * 2**20
DEEP_RECURSION_LIMIT = 100_000
_ONLY_AST = 0x400  # ast.PyCF_ONLY_AST: no bytecode
_OLDEST_FEATURE_VERSION = 7  # the oldest grammar CPython's ast feature_version still knows (3.13: 3.7)
_TRACEBACK_FRAMES = 40  # the innermost frames kept for --verbose; a RecursionError has thousands

T = TypeVar("T")


@dataclass
class FileResult:
    """The findings of one file, the ones ``# noqa`` silenced, and the fixed source when fixes applied."""

    path: str
    findings: list[Finding] = field(default_factory=list)
    suppressed: list[Finding] = field(default_factory=list)
    fixed: list[Finding] = field(default_factory=list)  # findings that --fix rewrote away
    fixed_source: str | None = None
    errors: list["InternalError"] = field(default_factory=list)  # rules that raised on this file
    # files of the linted tree whose function summaries the analysis used (path -> content hash): a cached
    # result is stale when one of them changes
    depends: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class InternalError:
    """A rule (or the engine) raised on a file: a bug or a limit of rlguard, reported without stopping the other
    rules and files. Plain strings only, so it pickles across worker processes."""

    path: str
    rule: str | None  # the rule's code, None when the engine itself failed
    exc_type: str
    message: str
    traceback: str = ""

    def describe(self) -> str:
        where = f"rule {self.rule}" if self.rule else "the engine"
        detail = f": {self.message}" if self.message else ""
        return f"internal error on {self.path}: {where} raised {self.exc_type}{detail}"

    def finding(self) -> Finding:
        """The RLG902 finding that puts this error in every output format: the file was not fully checked."""
        lost = f"the findings of {self.rule} on this file are missing" if self.rule else \
            "no rule's findings on this file are reported"
        detail = f": {self.message}" if self.message else ""
        where = f"rule {self.rule}" if self.rule else "the engine"
        return Finding(self.path, 1, 1, 1, 1, INTERNAL_ERROR, CODES[INTERNAL_ERROR].name,
                       f"rlguard failed on this file ({where} raised {self.exc_type}{detail}); {lost}",
                       "error")


# ----- deep code -------------------------------------------------------------------------------------------------
_limit_lock = threading.Lock()
_limit_users = 0
_saved_limit = 0
_stack_lock = threading.Lock()
_in_deep_thread = threading.local()


@contextmanager
def _raised_recursion_limit() -> Iterator[None]:
    """The interpreter-wide recursion limit raised while any deep call runs (counted, so overlapping calls from
    several threads restore it once, at the end of the last)."""
    global _limit_users, _saved_limit
    with _limit_lock:
        if _limit_users == 0:
            _saved_limit = sys.getrecursionlimit()
            sys.setrecursionlimit(max(_saved_limit, DEEP_RECURSION_LIMIT))
        _limit_users += 1
    try:
        yield
    finally:
        with _limit_lock:
            _limit_users -= 1
            if _limit_users == 0:
                sys.setrecursionlimit(_saved_limit)


def run_deep(fn: Callable[..., T], *args, **kwargs) -> T:
    """``fn(*args, **kwargs)`` on a thread with a :data:`DEEP_STACK_BYTES` stack under a raised recursion limit,
    so that recursion over a deep but valid tree (libcst's, the rules') neither overflows the C stack nor hits
    Python's default limit of 1000. Exceptions propagate to the caller. The thread is started once and reused:
    a new thread per file would fault in fresh stack pages for every file's deep walks."""
    if getattr(_in_deep_thread, "active", False):
        return fn(*args, **kwargs)
    worker = _deep_worker()
    if worker is None:  # no thread to be had (memory limits): run here
        with _raised_recursion_limit():
            return fn(*args, **kwargs)
    return worker.run(fn, args, kwargs)


class _DeepWorker:
    """One long-lived thread with a large stack that runs the per-file work handed to it, one call at a time."""

    def __init__(self):
        self._jobs: queue.Queue = queue.Queue()
        self._call_lock = threading.Lock()
        self.thread = threading.Thread(target=self._loop, name="rlguard-lint-deep", daemon=True)

    def _loop(self) -> None:
        _in_deep_thread.active = True
        while True:
            fn, args, kwargs, box, done = self._jobs.get()
            try:
                with _raised_recursion_limit():
                    box["value"] = fn(*args, **kwargs)
            except BaseException as exc:  # handed to the caller's thread
                box["error"] = exc
            finally:
                done.set()

    def run(self, fn, args, kwargs):
        box: dict = {}
        done = threading.Event()
        with self._call_lock:  # one file at a time
            self._jobs.put((fn, args, kwargs, box, done))
            done.wait()
        if "error" in box:
            raise box["error"]
        return box["value"]


_WORKER: list = []


def _deep_worker() -> "_DeepWorker | None":
    with _stack_lock:
        if _WORKER and (_WORKER[0] is None or _WORKER[0].thread.is_alive()):
            return _WORKER[0]
        worker = _DeepWorker()
        try:  # stack_size is process-wide: set it only for the thread started here
            previous = threading.stack_size(DEEP_STACK_BYTES)
        except (ValueError, RuntimeError):  # a platform that refuses the size
            previous = None
        try:
            worker.thread.start()
        except (RuntimeError, MemoryError):
            worker = None
        finally:
            if previous is not None:
                threading.stack_size(previous)
        _WORKER[:] = [worker]
        return worker


# ----- reading and syntax ------------------------------------------------------------------------------------------
def _parse_error(path: str, message: str, line: int = 1, col: int = 1) -> Finding:
    code = CODES[PARSE_ERROR]
    return Finding(path, line, col, line, col, code.code, code.name, message, "error")


def source_encoding(data: bytes) -> str:
    """The encoding Python reads a source file with: ``utf-8-sig`` after a BOM, else the PEP 263 coding line of
    the first two lines, else UTF-8. Raises SyntaxError for an unknown codec or a BOM with another coding line."""
    try:
        encoding, _ = tokenize.detect_encoding(io.BytesIO(data).readline)
    except SyntaxError as exc:
        if "invalid or missing encoding declaration" in str(exc):  # not UTF-8 in the first lines, no cookie
            return "utf-8"
        raise
    return encoding


def decode(data: bytes, path: str) -> tuple[str | None, Finding | None]:
    """The text of a source file, decoded as Python decodes it (:func:`source_encoding`), or an RLG900 finding."""
    try:
        encoding = source_encoding(data)
    except SyntaxError as exc:
        return None, _parse_error(path, f"cannot decode: {exc.msg or exc}")
    try:
        return data.decode(encoding), None
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        col = exc.start - data.rfind(b"\n", 0, exc.start)  # 1-based, in bytes
        what = "not UTF-8" if encoding in ("utf-8", "utf-8-sig") else f"not valid {encoding} (its coding line)"
        return None, _parse_error(path, f"{what}: byte {data[exc.start]:#04x} at offset {exc.start}", line, col)


def _libcst_config(target: tuple[int, int] | None) -> cst.PartialParserConfig:
    version = f"{target[0]}.{target[1]}" if target else None
    if version in KNOWN_PYTHON_VERSION_STRINGS:
        return cst.PartialParserConfig(python_version=version)
    return cst.PartialParserConfig()


_VALIDATION_LOCK = threading.Lock()
_VALIDATE = cst.CSTNode.__dict__["__post_init__"]


def _unvalidated(self) -> None:
    pass


def parse_module(source: str, config: cst.PartialParserConfig | None = None) -> cst.Module:
    """``libcst.parse_module`` without libcst's per-node validation. Every node libcst constructs runs its
    ``_validate()`` (about a tenth of a parse); a tree its own parser builds from source is valid by
    construction, as libcst's comment on ``CSTNode.__post_init__`` says. The check is switched off only while
    the parser runs, under a lock (nodes built anywhere else, by a fix or a rule, are validated as usual)."""
    with _VALIDATION_LOCK:
        cst.CSTNode.__post_init__ = _unvalidated
        try:
            return cst.parse_module(source, config) if config is not None else cst.parse_module(source)
        finally:
            cst.CSTNode.__post_init__ = _VALIDATE


def parse(source: str, path: str, target: tuple[int, int] | None = None) -> tuple[cst.Module | None, Finding | None]:
    """libcst's tree of the source, or the RLG900 finding saying why there is none."""
    try:
        return parse_module(source, _libcst_config(target)), None
    except cst.ParserSyntaxError as exc:
        return None, _parse_error(path, f"syntax error (libcst): {exc.message}", exc.raw_line, exc.raw_column + 1)
    except (RecursionError, MemoryError, ValueError) as exc:
        return None, _parse_error(path, f"cannot parse ({type(exc).__name__}: {exc})")


def check_syntax(source: str, path: str, target: tuple[int, int] | None = None, will_parse: bool = False
                 ) -> tuple[Finding | None, cst.Module | None]:
    """Whether the source is valid Python for ``target`` ((3, 12); None: the newest grammar rlguard knows).

    CPython's parser decides, with its ``feature_version`` set to the target when the running interpreter is
    newer than it. Where the running interpreter is older than the target (or its parser gives up on deep
    code), its rejection is not final: libcst's parser, which knows the newer grammar, decides, and its tree is
    returned so that it is not parsed twice. Returns (RLG900 finding or None, libcst module or None)."""
    running = sys.version_info[:2]
    older_than_target = target is None or target > running
    cpython: Finding | None = None
    if will_parse and older_than_target:
        # the file is parsed with libcst anyway, and libcst's grammar is the one that decides for this target:
        # parse once (CPython's parser only words the message when libcst rejects the file)
        module, error = parse(source, path, target)
        if module is not None:
            return None, module
    try:
        if older_than_target or target == running:
            compile(source, path, "exec", _ONLY_AST, dont_inherit=True)
        else:
            compile(source, path, "exec", _ONLY_AST, dont_inherit=True,
                    _feature_version=max(target[1], _OLDEST_FEATURE_VERSION))
        return None, None
    except SyntaxError as exc:  # IndentationError and TabError too
        cpython = _parse_error(path, f"syntax error: {exc.msg}", exc.lineno or 1, exc.offset or 1)
        if not older_than_target:
            return cpython, None
    except ValueError as exc:  # null bytes
        return _parse_error(path, f"cannot parse: {exc}"), None
    except (RecursionError, MemoryError):  # CPython's own limits on deep code, which may well be valid
        pass
    module, error = parse(source, path, target)
    if module is not None:
        return None, module
    return cpython or error, None


# ----- positions ---------------------------------------------------------------------------------------------------
_NEWLINE = re.compile(r"\r\n?|\n")
_NO_RECORD = nullcontext()


class _Recording:
    """The syntactic range of one wanted node, as libcst's PositionProvidingCodegenState records it (hoisting
    the start or end from a child where the node says so), without a generator per node."""

    __slots__ = ("state", "node", "start_node", "end_node", "start")

    def __init__(self, state: "_WantedPositions", node, start_node, end_node):
        self.state, self.node, self.start_node, self.end_node = state, node, start_node, end_node

    def __enter__(self) -> None:
        self.start = CodePosition(self.state.line, self.state.column)

    def __exit__(self, *exc) -> None:
        computed = self.state.provider._computed
        end = CodePosition(self.state.line, self.state.column)
        start = computed[self.start_node].start if self.start_node is not None else self.start
        end = computed[self.end_node].end if self.end_node is not None else end
        computed[self.node] = CodeRange(start, end)


class _WantedPositions(PositionProvidingCodegenState):
    """libcst's position code generation, recording only the nodes asked for (and the children their range is
    hoisted from), and keeping no generated text: on a 12,500-line file it costs a third of recording every
    node, the most expensive step of a file with a finding."""

    def setup(self, wanted: set[int]) -> "_WantedPositions":
        self.wanted = wanted
        self.starts: dict[int, CodePosition] = {}
        return self

    def add_indent_tokens(self) -> None:
        for token in self.indent_tokens:
            self.add_token(token)

    def add_token(self, value: str) -> None:
        if "\n" in value or "\r" in value:
            segments = _NEWLINE.split(value)
            self.line += len(segments) - 1
            self.column = len(segments[-1])
        else:
            self.column += len(value)

    def before_codegen(self, node) -> None:
        if id(node) in self.wanted:
            self.starts[id(node)] = CodePosition(self.line, self.column)

    def after_codegen(self, node) -> None:
        start = self.starts.pop(id(node), None)
        if start is not None and node not in self.provider._computed:
            self.provider._computed[node] = CodeRange(start, CodePosition(self.line, self.column))

    def record_syntactic_position(self, node, *, start_node=None, end_node=None):
        if id(node) not in self.wanted:
            return _NO_RECORD
        for child in (start_node, end_node):
            if child is not None:
                self.wanted.add(id(child))
        return _Recording(self, node, start_node, end_node)


def node_positions(module: cst.Module, nodes: Iterable[cst.CSTNode] | None = None) -> dict:
    """Start and end (libcst's :class:`PositionProvider` ranges) of ``nodes``, or of every node, from one code
    generation pass; ``MetadataWrapper.resolve`` would add a visit of the whole tree that costs as much again."""
    from libcst.metadata import MetadataWrapper, PositionProvider

    provider = PositionProvider()
    try:
        if nodes is None:
            provider._gen_impl(module)
        else:
            state = _WantedPositions(default_indent=module.default_indent, default_newline=module.default_newline,
                                     provider=provider).setup({id(n) for n in nodes})
            module._codegen(state)
        return provider._computed
    except (AttributeError, TypeError, KeyError):  # pragma: no cover - libcst internals changed: the public way
        return dict(MetadataWrapper(module, unsafe_skip_copy=True).resolve(PositionProvider))


# ----- one file ----------------------------------------------------------------------------------------------------
class _Clock:
    """Seconds per stage into ``timings`` (what benchmarks/large_files.py reports), or nothing."""

    def __init__(self, timings: dict[str, float] | None):
        self.timings = timings

    @contextmanager
    def __call__(self, stage: str) -> Iterator[None]:
        if self.timings is None:
            yield
            return
        start = time.perf_counter()
        try:
            yield
        finally:
            self.timings[stage] = self.timings.get(stage, 0.0) + time.perf_counter() - start


def _mentions_extra_names(vocabulary: Vocabulary, source: str) -> bool:
    return any(name in source for names in vocabulary.extra.values() for name in names)


def lint_source(source: str, path: str = "<string>", rules: Iterable[type[Rule]] | None = None,
                vocabulary: Vocabulary | None = None, fix: bool = False, target_version: tuple[int, int] | None = None,
                unused_noqa: bool = False, timings: dict[str, float] | None = None, project: Project | None = None,
                module_name: str | None = None, summarise: bool | frozenset[str] = False,
                preview: bool = False) -> FileResult:
    """Lint one source text with ``rules`` (default: all). Without ``preview``, preview rules do not run and the
    violations a stable rule's preview parts find are dropped. ``target_version`` ((3, 10); None: the newest grammar)
    decides what is a syntax error; ``unused_noqa`` reports RLG901 for noqa codes that silence nothing;
    ``timings``, when given, receives the seconds spent per stage. ``project`` gives access to the summaries of
    the linted tree's other files (calls into them are judged from what the callee does); with ``summarise``,
    this file's own summaries (``module_name``) are kept for the files linted after it (a set of names: only
    those top-level functions and classes, the ones other files import). Never raises for bad
    input: a file that does not parse becomes a single RLG900 finding, a rule that fails an
    :class:`InternalError` in ``errors``."""
    with _gc_paused():
        result = run_deep(_lint_source, source, path, rules, vocabulary, fix, target_version, unused_noqa,
                          _Clock(timings), project, module_name, summarise, preview)
        if preview or not (result.findings or result.fixed) or result.errors:
            return result
        keep = _surviving_renaming(source, path, rules, vocabulary, target_version, project, module_name,
                                   [*result.findings, *result.fixed])
        if keep is None:
            return result
        if fix and any((f.code, f.line) not in keep for f in result.fixed):
            # a rewrite for a finding that rests on a name is not applied: lint again, keeping the others only
            depends = result.depends
            result = run_deep(_lint_source, source, path, rules, vocabulary, fix, target_version, unused_noqa,
                              _Clock(None), project, module_name, False, preview, keep)
            result.depends = depends
            return result
        result.findings = [f for f in result.findings if f.code in TOOL_CODES or (f.code, f.line) in keep]
        return result


def _surviving_renaming(source: str, path: str, rules, vocabulary, target, project, module_name,
                        found: Sequence[Finding] = ()) -> frozenset[tuple[str, int]] | None:
    """The (code, line) of the findings that survive renaming the file's own names to neutral ones
    (:mod:`rlguard.lint.neutral`): a finding that does not rests on what a variable is called, and is a
    preview finding. A finding of ``found`` survives too when the renamed file has a finding of its code in the
    same function on another line: a name may choose where a fault is reported (a value named ``surrogate`` is
    meant to be maximised, so the fault is where it becomes a loss) without deciding whether it is reported.
    None when nothing is renamed, or the renaming cannot be made (then every finding stands)."""
    try:
        tree = ast.parse(source)
        renaming = neutral.rename_source(source, tree=tree)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    if renaming.count == 0 or renaming.source == source:
        return None
    consulted = dict(project.consulted) if project is not None else None
    again = run_deep(_lint_source, renaming.source, path, rules, vocabulary, False, target, False, _Clock(None),
                     project, module_name, False, False)
    if project is not None:
        project.consulted.clear()
        project.consulted.update(consulted)
    if again.errors:
        return None
    keep = {(f.code, f.line) for f in again.findings}
    moved = [f for f in found if (f.code, f.line) not in keep]
    if moved:
        spans = neutral.enclosing_functions(tree)  # renaming moves no line: the spans hold for both texts
        renamed = {(f.code, neutral.function_at(spans, f.line)) for f in again.findings}
        for f in moved:
            function = neutral.function_at(spans, f.line)
            if function != "<module>" and (f.code, function) in renamed:
                keep.add((f.code, f.line))
    return frozenset(keep)


@contextmanager
def _gc_paused() -> Iterator[None]:
    """No cyclic garbage collection while one file is linted: a file's trees and tables are built and dropped
    together (reference counting frees them), and the collector's passes over a growing libcst tree cost about
    a tenth of the lint. It runs again, as usual, between files."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _lint_source(source: str, path: str, rules: Iterable[type[Rule]] | None, vocabulary: Vocabulary | None,
                 fix: bool, target: tuple[int, int] | None, unused_noqa: bool, clock: _Clock,
                 project: Project | None = None, module_name: str | None = None,
                 summarise: bool | frozenset[str] = False, preview: bool = False,
                 keep: frozenset[tuple[str, int]] | None = None) -> FileResult:
    result = FileResult(path)
    if project is not None:
        project.begin_file()
    source = source[1:] if source.startswith("\ufeff") else source  # text read without utf-8-sig
    rule_classes = [r for r in (all_rules().values() if rules is None else rules) if preview or not r.preview]
    lowered = source.lower()
    with clock("triggers"):
        candidates = [r for r in rule_classes if r.may_fire(source, lowered)]
        if len(candidates) < len(rule_classes) and vocabulary is not None and _mentions_extra_names(vocabulary, source):
            candidates = rule_classes  # the triggers know the built-in names only, not the user's own
    with clock("syntax"):
        error, module = check_syntax(source, path, target, will_parse=bool(candidates))
    if error is not None:
        result.findings.append(error)
        return result

    failed: set[str] = set()
    violations: list[tuple[type[Rule], Violation]] = []
    if candidates:
        if module is None:
            with clock("parse"):
                module, error = parse(source, path, target)
            if error is not None:  # CPython accepted it: a gap in libcst's grammar, not the user's
                result.findings.append(dataclasses.replace(
                    error, message=f"valid Python that libcst cannot parse, so no rule ran on it: {error.message}"))
                return result
        try:
            with clock("context"):
                ctx = Analysis(module, path, vocabulary, project=project, module_name=module_name)
                ctx.preview = preview
        except Exception as exc:  # the shared analysis failed: no rule can run on this file
            result.errors.append(internal_error(path, None, exc))
            return result
        for rule in candidates:
            try:
                with clock(rule.code):
                    found = list(rule().check(ctx))
            except Exception as exc:  # a bug in a rule must not stop the other rules nor the other files
                result.errors.append(internal_error(path, rule.code, exc))
                failed.add(rule.code)
                continue
            violations.extend((rule, violation) for violation in found if preview or not violation.preview)
        if project is not None and summarise and module_name:
            try:
                with clock("summaries"):
                    project.record(source, summarise_module(
                        ctx, module_name, None if summarise is True else summarise))
            except Exception as exc:  # summaries help other files: a failure costs their precision only
                result.errors.append(internal_error(path, None, exc))
        ctx.release()  # the facets refer back to the analysis: free the file's tables without the collector
    if project is not None:
        result.depends = dict(project.consulted)

    with clock("noqa"):
        directives = noqa.directives(source, lowered)
    used: dict[int, set[str]] = {}
    to_fix: list[tuple[cst.CSTNode, cst.CSTNode]] = []
    if violations:
        try:
            with clock("positions"):
                positions = node_positions(module, [violation.node for _, violation in violations])
        except Exception as exc:
            result.errors.append(internal_error(path, None, exc))
            return result
        seen: set[tuple] = set()
        for rule, violation in violations:
            pos = positions.get(violation.node)
            if pos is None:  # a node that is not in this module: the rule built it
                if rule.code not in failed:
                    failed.add(rule.code)
                    result.errors.append(InternalError(path, rule.code, "ValueError",
                                                       "reported a node that is not in the parsed module"))
                continue
            finding = Finding(path, pos.start.line, pos.start.column + 1, pos.end.line, pos.end.column + 1,
                              rule.code, rule.name, violation.message, rule.severity,
                              fixable=bool(violation.replacements))
            key = (finding.line, finding.col, finding.code)
            if key in seen or keep is not None and (finding.code, finding.line) not in keep:
                continue
            seen.add(key)
            directive = noqa.silencing(directives, finding.code, finding.line, finding.end_line)
            if directive is not None:
                used.setdefault(directive.line, set()).add(finding.code)
                result.suppressed.append(finding)
            else:
                result.findings.append(finding)
                if fix:
                    to_fix.extend(violation.replacements)
    if unused_noqa and directives:
        ran = {r.code for r in rule_classes} - failed
        result.findings.extend(unused_noqa_findings(path, directives, used, ran))
    result.findings.sort(key=Finding.sort_key)
    if to_fix:
        try:
            result.fixed_source = apply_replacements(module, to_fix).code
        except Exception as exc:
            result.errors.append(internal_error(path, None, exc))
            return result
        result.fixed = [f for f in result.findings if f.fixable]
        result.findings = [f for f in result.findings if not f.fixable]
    return result


def unused_noqa_findings(path: str, directives: dict[int, noqa.Directive], used: dict[int, set[str]],
                         ran: set[str]) -> list[Finding]:
    """RLG901 for each ``# noqa`` comment naming rlguard codes that silenced nothing on its line: a code whose
    rule ran on the file and found nothing there, a runtime-only or tool code that lint never silences, or no
    code at all. Bare ``# noqa`` and other tools' codes are left alone (flake8's, ruff's), and so are lint codes
    not run on this file (they may serve another configuration)."""
    out = []
    entry = CODES[UNUSED_NOQA]
    for directive in directives.values():
        if directive.codes is None or UNUSED_NOQA in directive.codes:
            continue
        stale = []
        for code in sorted(c for c in directive.codes if c.startswith("RLG")):
            if code in used.get(directive.line, ()):
                continue
            if code not in CODES:
                stale.append(f"{code} (no such code)")
            elif code in ran:
                stale.append(f"{code} (no {code} finding on this line)")
            elif CODES[code].static == "no":
                stale.append(f"{code} (checked at run time only, never by lint)")
            elif code in (PARSE_ERROR, INTERNAL_ERROR):
                stale.append(f"{code} (cannot be silenced by noqa)")
        if stale:
            out.append(Finding(path, directive.line, directive.col, directive.line, directive.end_col, entry.code,
                               entry.name, f"unused noqa: {', '.join(stale)}; remove it", "warning"))
    return out


def internal_error(path: str, rule: str | None, exc: BaseException) -> InternalError:
    frames = traceback.format_exception(type(exc), exc, exc.__traceback__, limit=-_TRACEBACK_FRAMES)
    return InternalError(path, rule, type(exc).__name__, str(exc)[:300], "".join(frames))


class _Replacer(cst.CSTTransformer):
    def __init__(self, replacements: dict[int, cst.CSTNode]):
        super().__init__()
        self.replacements = replacements

    def on_leave(self, original_node, updated_node):
        return self.replacements.get(id(original_node), updated_node)


def apply_replacements(module: cst.Module, pairs: list[tuple[cst.CSTNode, cst.CSTNode]]) -> cst.Module:
    """Swap nodes by identity; libcst regenerates the rest of the file byte for byte."""
    return run_deep(module.visit, _Replacer({id(old): new for old, new in pairs}))
