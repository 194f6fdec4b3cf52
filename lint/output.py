"""Report formats: ``text`` (ruff-like lines and a summary), ``json``, ``sarif`` (2.1.0, for GitHub code
scanning) and ``github`` (workflow annotation commands); ``--statistics`` (a count per code) in text or json.

Internal errors are RLG902 findings, so every format shows which files were not fully checked."""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path, PurePath
from urllib.parse import quote

from rlguard import __version__
from rlguard.catalog import CODES, TOOL_CODES
from rlguard.lint.runner import LintReport

FORMATS = ("text", "json", "sarif", "github")
STATISTICS_FORMATS = ("text", "json")
SRCROOT = "SRCROOT"  # SARIF base id of relative result URIs: the folder rlguard ran in
SARIF_SCHEMA = "https://json.schemastore.org/sarif-2.1.0.json"
INFORMATION_URI = "https://github.com/rlguard/rlguard"
SARIF_LEVEL = {"error": "error", "warning": "warning", "info": "note"}
GITHUB_LEVEL = {"error": "error", "warning": "warning", "info": "notice"}


def render(report: LintReport, fmt: str, show_suppressed: bool = False, statistics: bool = False) -> str:
    if statistics:
        return render_statistics(report, fmt)
    if fmt == "text":
        return text(report, show_suppressed)
    if fmt == "json":
        return json.dumps([f.as_dict() for f in report.findings], indent=2) + "\n"
    if fmt == "sarif":
        return json.dumps(sarif(report), indent=2) + "\n"
    if fmt == "github":
        return github(report)
    raise ValueError(f"unknown format {fmt!r}; choose from {', '.join(FORMATS)}")


# ----- text ------------------------------------------------------------------------------------------------------
def finding_line(f) -> str:
    return f"{f.path}:{f.line}:{f.col}: {f.code} [{f.name}] {f.message}"


def _n(count: int, word: str) -> str:
    return f"{count} {word}{'' if count == 1 else 's'}"


def summary(report: LintReport) -> str:
    """The last line. It never says "passed" when a file was not fully checked: internal errors are RLG902
    findings, and the files they hit are counted."""
    counts = report.counts()
    if report.findings:
        per_code = ", ".join(f"{code}: {n}" for code, n in sorted(counts.items()))
        line = (f"Found {_n(len(report.findings), 'finding')} in {report.files_with_findings} of "
                f"{report.files_checked} files ({per_code})")
    else:
        line = f"All checks passed: {_n(report.files_checked, 'file')}, no findings"
    if report.errors:
        line += f"; {_n(report.files_not_fully_checked, 'file')} not fully checked (internal errors)"
    if report.suppressed:
        line += f"; {len(report.suppressed)} suppressed by noqa"
    if report.skipped:
        line += f"; {len(report.skipped)} skipped (not regular files)"
    return line


def text(report: LintReport, show_suppressed: bool = False) -> str:
    lines = [finding_line(f) for f in report.findings]
    if show_suppressed:
        lines += [f"{finding_line(f)} (suppressed by noqa)" for f in report.suppressed]
    if report.fixed:
        verb = "Would fix" if report.diffs else "Fixed"
        lines.append(f"{verb} {_n(len(report.fixed), 'finding')} in {_n(len(report.files_fixed), 'file')}"
                     + (" (run with --fix to apply)" if report.diffs else ""))
    lines.append(summary(report))
    return "\n".join(lines) + "\n"


# ----- --statistics ------------------------------------------------------------------------------------------------
def statistics(report: LintReport) -> list[dict]:
    """One row per code found: code, name, count, how many of them ``--fix`` can fix; most frequent first."""
    counts = Counter(f.code for f in report.findings)
    fixable = Counter(f.code for f in report.findings if f.fixable)
    return [{"code": code, "name": CODES[code].name if code in CODES else "", "count": n, "fixable": fixable[code]}
            for code, n in sorted(counts.items(), key=lambda item: (-item[1], item[0]))]


def render_statistics(report: LintReport, fmt: str) -> str:
    rows = statistics(report)
    if fmt == "json":
        return json.dumps(rows, indent=2) + "\n"
    if fmt != "text":
        raise ValueError(f"--statistics prints {' or '.join(STATISTICS_FORMATS)}, not {fmt!r}")
    width = max((len(str(r["count"])) for r in rows), default=1)
    name_width = max((len(r["name"]) for r in rows), default=0)
    lines = [f"{r['count']:>{width}}  {r['code']}  {r['name']:<{name_width}}"
             + (f"  ({r['fixable']} fixable with --fix)" if r["fixable"] else "") for r in rows]
    return "\n".join([*(line.rstrip() for line in lines), summary(report)]) + "\n"


# ----- SARIF -----------------------------------------------------------------------------------------------------
def artifact_location(path: str) -> dict:
    """A SARIF artifactLocation: a relative path as a percent-encoded URI reference resolved against SRCROOT (a
    space, ``#``, ``%`` or non-ASCII character in a file name must not change which file it names), an absolute
    path as a ``file:`` URI."""
    pure = PurePath(path)
    if pure.is_absolute():
        return {"uri": Path(path).as_uri()}
    return {"uri": quote(pure.as_posix(), safe="/"), "uriBaseId": SRCROOT}


def _srcroot_uri() -> str:
    uri = Path(os.getcwd()).as_uri()
    return uri if uri.endswith("/") else uri + "/"


def sarif_rule(code: str) -> dict:
    from rlguard.lint.docs import flags_text, render_page, severity

    entry = CODES[code]
    return {
        "id": code,
        "name": entry.name,
        "shortDescription": {"text": entry.summary},
        "fullDescription": {"text": flags_text(code)},
        "helpUri": entry.help_uri,
        "help": {"text": f"{entry.summary} See {entry.help_uri}", "markdown": render_page(code)},
        "defaultConfiguration": {"level": SARIF_LEVEL[severity(code)]},
        "properties": {"tags": ["rl", "correctness"], "precision": "high" if entry.static == "yes" else "medium"},
    }


def sarif(report: LintReport) -> dict:
    from rlguard.lint.rule import all_rules

    codes = sorted(set(all_rules()) | set(TOOL_CODES) | {f.code for f in report.findings})
    index = {code: i for i, code in enumerate(codes)}
    results = []
    for f in report.findings:
        results.append({
            "ruleId": f.code,
            "ruleIndex": index[f.code],
            "level": SARIF_LEVEL.get(f.severity, "warning"),
            "message": {"text": f.message},
            "locations": [{"physicalLocation": {
                "artifactLocation": artifact_location(f.path),
                "region": {"startLine": f.line, "startColumn": f.col, "endLine": f.end_line, "endColumn": f.end_col},
            }}],
        })
    invocation = {"executionSuccessful": not report.errors}
    if report.errors:
        invocation["toolExecutionNotifications"] = [
            {"level": "error", "message": {"text": e.describe()},
             "locations": [{"physicalLocation": {"artifactLocation": artifact_location(e.path)}}]}
            for e in report.errors]
    return {
        "$schema": SARIF_SCHEMA,
        "version": "2.1.0",
        "runs": [{
            "tool": {"driver": {"name": "rlguard", "version": __version__, "semanticVersion": __version__,
                                "informationUri": INFORMATION_URI, "rules": [sarif_rule(c) for c in codes]}},
            "originalUriBaseIds": {SRCROOT: {"uri": _srcroot_uri()}},
            "columnKind": "unicodeCodePoints",
            "results": results,
            "invocations": [invocation],
        }],
    }


# ----- GitHub workflow commands -------------------------------------------------------------------------------------
def escape_data(value: str) -> str:
    return value.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")


def escape_property(value: str) -> str:
    return escape_data(value).replace(":", "%3A").replace(",", "%2C")


def github(report: LintReport) -> str:
    lines = []
    for f in report.findings:
        props = {"file": f.path, "line": f.line, "col": f.col, "endLine": f.end_line, "endColumn": f.end_col,
                 "title": f"{f.code} {f.name}"}
        prop_text = ",".join(f"{k}={escape_property(str(v))}" for k, v in props.items())
        lines.append(f"::{GITHUB_LEVEL.get(f.severity, 'warning')} {prop_text}::{escape_data(f.message)}")
    lines.append(summary(report))
    return "\n".join(lines) + "\n"
