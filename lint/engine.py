"""Lint one source text: pre-scan, parse, run the selected rules, apply ``# noqa``, place the findings.

Parsing is most of the cost, so a file is parsed with libcst only when some selected rule's trigger pattern
matches its text; other files get a cheap syntax check with :func:`compile` so a broken file is still reported.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Iterable

import libcst as cst
from libcst.metadata import MetadataWrapper, PositionProvider

from rlguard.catalog import CODES
from rlguard.lint import prescan
from rlguard.lint.analysis import Analysis
from rlguard.lint.analysis.summaries import Project, summarise_module
from rlguard.lint.names import Vocabulary
from rlguard.lint.rule import Finding, Rule, Violation, all_rules

PARSE_ERROR = "RLG900"
_NOQA = re.compile(r"#\s*noqa(?::\s*(?P<codes>[A-Z]+[0-9]+(?:\s*,\s*[A-Z]+[0-9]+)*))?", re.IGNORECASE)


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
    """A rule (or the engine) raised on a file: a bug in rlguard, reported without stopping the other rules
    and files. Plain strings only, so it pickles across worker processes."""

    path: str
    rule: str | None  # the rule's code, None when the engine itself failed
    exc_type: str
    message: str
    traceback: str = ""

    def describe(self) -> str:
        where = f"rule {self.rule}" if self.rule else "the engine"
        detail = f": {self.message}" if self.message else ""
        return f"internal error on {self.path}: {where} raised {self.exc_type}{detail}"


def noqa_codes(line: str) -> set[str] | None:
    """Codes a line's ``# noqa`` comment silences: None without a comment, an empty set for bare ``# noqa``."""
    if "noqa" not in line.lower():
        return None
    match = _NOQA.search(line)
    if match is None:
        return None
    codes = match.group("codes")
    return {c.strip().upper() for c in codes.split(",")} if codes else set()


def _mentions_extra_names(vocabulary: Vocabulary, source: str) -> bool:
    return any(name in source for names in vocabulary.extra.values() for name in names)


def _parse_error(path: str, message: str, line: int = 1, col: int = 1) -> Finding:
    code = CODES[PARSE_ERROR]
    return Finding(path, line, col, line, col, code.code, code.name, message, "error")


def _syntax_error_finding(path: str, source: str) -> Finding | None:
    try:
        compile(source, path, "exec", dont_inherit=True, flags=0x400)  # ast.PyCF_ONLY_AST: no bytecode
    except SyntaxError as exc:
        return _parse_error(path, f"syntax error: {exc.msg}", exc.lineno or 1, exc.offset or 1)
    except (ValueError, RecursionError) as exc:  # null bytes, absurd nesting
        return _parse_error(path, f"cannot parse: {exc}")
    return None


def decode(data: bytes, path: str) -> tuple[str | None, Finding | None]:
    try:
        return data.decode("utf-8-sig"), None
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        col = exc.start - data.rfind(b"\n", 0, exc.start)  # 1-based, in bytes
        return None, _parse_error(path, f"not UTF-8: byte {data[exc.start]:#04x} at offset {exc.start}", line, col)


def lint_source(source: str, path: str = "<string>", rules: Iterable[type[Rule]] | None = None,
                vocabulary: Vocabulary | None = None, fix: bool = False, project: Project | None = None,
                module_name: str | None = None, summarise: bool = False) -> FileResult:
    """Lint one source text with ``rules`` (default: all). Never raises for bad input: a file that does not
    parse becomes a single RLG900 finding. ``project`` gives access to the summaries of the linted tree's other
    files (calls into them are judged from what the callee does); with ``summarise``, this file's own
    summaries are added to it for the files linted after it."""
    result = FileResult(path)
    if project is not None:
        project.begin_file()
    rule_classes = list(all_rules().values() if rules is None else rules)
    lowered, memo = source.lower(), {}
    # the literal words a trigger needs are checked first (memory speed); the trigger regex only where they are
    candidates = [r for r in rule_classes if prescan.may_fire(r._trigger_re, lowered, memo) and r.may_fire(source)]
    if len(candidates) < len(rule_classes) and vocabulary is not None and _mentions_extra_names(vocabulary, source):
        candidates = rule_classes  # the triggers know the built-in names only, not the user's own
    if not candidates:
        error = _syntax_error_finding(path, source)
        if error is not None:
            result.findings.append(error)
        return result
    try:
        module = cst.parse_module(source)
    except cst.ParserSyntaxError as exc:
        # CPython's own message and position read better than the parser's; libcst's only when CPython parses it
        error = _syntax_error_finding(path, source) or _parse_error(
            path, f"syntax error (libcst): {exc.message}", exc.raw_line, exc.raw_column + 1)
        result.findings.append(error)
        return result
    except (RecursionError, ValueError) as exc:
        result.findings.append(_parse_error(path, f"cannot parse: {exc}"))
        return result

    ctx = Analysis(module, path, vocabulary, project=project, module_name=module_name)
    violations: list[tuple[type[Rule], Violation]] = []
    for rule in candidates:
        try:
            found = list(rule().check(ctx))
        except Exception as exc:  # a bug in a rule must not stop the other rules nor the other files
            result.errors.append(internal_error(path, rule.code, exc))
            continue
        violations.extend((rule, violation) for violation in found)
    if project is not None:
        if summarise and module_name:
            try:
                project.record(source, summarise_module(ctx, module_name))
            except Exception as exc:  # summaries are an aid to other files: a failure costs their precision only
                result.errors.append(internal_error(path, None, exc))
        result.depends = dict(project.consulted)
    if not violations:
        return result

    positions = MetadataWrapper(module, unsafe_skip_copy=True).resolve(PositionProvider)
    lines = source.splitlines()
    to_fix: list[tuple[cst.CSTNode, cst.CSTNode]] = []
    seen: set[tuple] = set()
    for rule, violation in violations:
        pos = positions[violation.node]
        finding = Finding(path, pos.start.line, pos.start.column + 1, pos.end.line, pos.end.column + 1,
                          rule.code, rule.name, violation.message, rule.severity,
                          fixable=bool(violation.replacements))
        key = (finding.line, finding.col, finding.code)
        if key in seen:
            continue
        seen.add(key)
        silenced = _suppressed(lines, finding)
        (result.suppressed if silenced else result.findings).append(finding)
        if fix and not silenced:
            to_fix.extend(violation.replacements)
    result.findings.sort(key=Finding.sort_key)
    if to_fix:
        result.fixed_source = apply_replacements(module, to_fix).code
        result.fixed = [f for f in result.findings if f.fixable]
        result.findings = [f for f in result.findings if not f.fixable]
    return result


def internal_error(path: str, rule: str | None, exc: BaseException) -> InternalError:
    import traceback

    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return InternalError(path, rule, type(exc).__name__, str(exc)[:300], text)


def _suppressed(lines: list[str], finding: Finding) -> bool:
    # A noqa comment may sit on the first or the last line of a multi-line finding.
    for line_no in {finding.line, finding.end_line}:
        if 1 <= line_no <= len(lines):
            codes = noqa_codes(lines[line_no - 1])
            if codes is not None and (not codes or finding.code in codes):
                return True
    return False


class _Replacer(cst.CSTTransformer):
    def __init__(self, replacements: dict[int, cst.CSTNode]):
        super().__init__()
        self.replacements = replacements

    def on_leave(self, original_node, updated_node):
        return self.replacements.get(id(original_node), updated_node)


def apply_replacements(module: cst.Module, pairs: list[tuple[cst.CSTNode, cst.CSTNode]]) -> cst.Module:
    """Swap nodes by identity; libcst regenerates the rest of the file byte for byte."""
    return module.visit(_Replacer({id(old): new for old, new in pairs}))
