"""Render a preflight ``Report`` (terminal table, markdown, JSON) and the demo's fault matrix; a progress bar."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from rlguard.preflight.suite import Report


def _fmt(value: float) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if value == int(value) and abs(value) < 1e6:
        return str(int(value))
    return f"{value:.3g}"


def _status(c) -> str:
    if getattr(c, "error", False):
        return "ERROR"
    if getattr(c, "warning", False):
        return "warn"
    return "skip" if c.skipped else ("ok" if c.passed else "FAIL")


def table(report: Report) -> str:
    rows = [("check", "measured", "tolerance", "ok", "code", "hint")]
    rows += [(c.name, _fmt(c.value), c.tolerance, _status(c), c.code or "-", c.hint) for c in report.checks]
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r[:5], widths)) + "  " + r[5] for r in rows]
    lines.insert(1, "-" * min(len(lines[0]) + 20, 110))
    n_fail = len(report.failed)
    lines.append("")
    lines.append("all checks passed" if report.passed else
                 f"{n_fail} check(s) failed: {', '.join(report.failed)}" if n_fail else "no check failed")
    if report.errors:
        lines[-1] += (f"; {len(report.errors)} check(s) could not run (rlguard errors, not findings): "
                      f"{', '.join(report.errors)}")
    if report.skipped:
        lines[-1] += f" ({len(report.skipped)} skipped: {', '.join(report.skipped)})"
    if getattr(report, "warnings", None):
        lines[-1] += f"; {len(report.warnings)} warning(s), by a documented setting: {', '.join(report.warnings)}"
    if report.batches:
        lines.append(report.batches_line())
    if getattr(report, "world_size", 1) > 1:
        lines.append(f"(data-parallel: {report.world_size} ranks; each value is the worst rank's, per-rank values "
                     "in report.json)")
    return "\n".join(lines)


def markdown(report: Report, title: str = "rlguard preflight report") -> str:
    lines = [f"# {title}", "", f"**{'PASSED' if report.passed else 'FAILED'}**"
             + ("" if report.passed else f": {', '.join(report.failed + report.errors)}"), "",
             *([f"Data-parallel: {report.world_size} ranks; each value is the worst rank's.", ""]
               if getattr(report, "world_size", 1) > 1 else []),
             f"Base seed {report.seed}; {report.batches_line()}.", "",
             "| check | measured | tolerance | ok | code | hint |", "|---|---|---|---|---|---|"]
    for c in report.checks:
        lines.append(f"| {c.name} | {_fmt(c.value)} | {c.tolerance} | {_status(c)} | {c.code or '-'} | {c.hint} |")
    return "\n".join(lines) + "\n"


def write_report(report: Report, out: str | Path) -> None:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.md").write_text(markdown(report))
    (out / "report.json").write_text(json.dumps(report.to_dict(), indent=2) + "\n")


class Progress:
    """A one-line progress bar on stderr (plain lines when stderr is not a terminal)."""

    def __init__(self, label: str, stream=None, width: int = 24):
        self.label, self.stream, self.width = label, stream or sys.stderr, width
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()

    def __call__(self, done: int, total: int, name: str) -> None:
        filled = int(self.width * done / max(total, 1))
        bar = "#" * filled + "." * (self.width - filled)
        line = f"{self.label} [{bar}] {done}/{total} {name}"
        if self.tty:
            end = "\n" if done >= total else ""
            self.stream.write("\r\033[K" + line + end)
        else:
            self.stream.write(line + "\n")
        self.stream.flush()


def matrix_table(checks: list[str], rows: dict[str, dict]) -> str:
    """Faults x checks (numbered, legend below) with a lint column."""
    label_w = max(len(r) for r in rows) + 1
    head = " " * label_w + " ".join(f"{i + 1:>4}" for i in range(len(checks))) + "  lint"
    lines = [head]
    for name, row in rows.items():
        cells = " ".join(f"{'FAIL' if c in row['failed_checks'] else 'ok':>4}" for c in checks)
        lines.append(f"{name:<{label_w}}{cells}  {','.join(row['lint_codes']) or '-'}")
    lines.append("")
    lines.append("checks: " + "  ".join(f"{i + 1} {c}" for i, c in enumerate(checks)))
    return "\n".join(lines)


def matrix_markdown(checks: list[str], rows: dict[str, dict], verdicts: dict[str, str]) -> str:
    lines = ["# rlguard demo: faults x preflight checks, and lint", "",
             "| fault | " + " | ".join(checks) + " | lint |", "|---|" + "---|" * (len(checks) + 1)]
    for name, row in rows.items():
        cells = " | ".join("FAIL" if c in row["failed_checks"] else "ok" for c in checks)
        lines.append(f"| {name} | {cells} | {', '.join(row['lint_codes']) or '-'} |")
    lines += ["", "## Verdicts", ""] + [f"- **{name}**: {v}" for name, v in verdicts.items()]
    return "\n".join(lines) + "\n"
