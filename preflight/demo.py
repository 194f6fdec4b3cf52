"""The demo: preflight and lint on the reference trainer, healthy and with each fault -> one matrix."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

from rlguard.preflight.checks import CHECKS
from rlguard.preflight.suite import run_suite

REFERENCE_DIR = Path(__file__).resolve().parent.parent / "reference"


def lint_codes(paths: list[Path]) -> list[str] | None:
    """Codes ``rlguard lint --preview`` reports on these files (sorted, unique); None when the linter is
    unavailable. Preview on: a fault twin is one small module whose roles are often known by their names only,
    which the stable set leaves to the preview parts of its rules."""
    try:
        from rlguard.lint import lint_paths
    except ImportError:
        return None
    codes: set[str] = set()
    for path in paths:  # one file at a time: an internal error in one file must not hide the others' findings
        try:
            codes |= {f.code for f in lint_paths([str(path)], cache=False, preview=True)}
        except Exception as exc:  # noqa: BLE001 - the linter itself failed on this file
            codes.add(f"lint-error:{path.name}")
    return sorted(codes)


def healthy_sources() -> list[Path]:
    """The healthy trainer's source: every module of rlguard.reference except the fault twins."""
    import rlguard.reference

    here = Path(rlguard.reference.__file__).resolve().parent
    return sorted(p for p in here.glob("*.py"))


def run_demo(faults: list[str] | None = None, progress: Callable[[int, int, str], None] | None = None) -> dict:
    """-> {"checks": [...], "rows": {name: {"failed_checks", "lint_codes"}}, "verdicts": {...}, "lint": bool}."""
    from rlguard.reference.adapter import ReferenceAdapter
    from rlguard.reference.faults import FAULTS

    names = [None, *(FAULTS if faults is None else faults)]
    rows: dict[str, dict] = {}
    lint_available = True
    for i, fault in enumerate(names):
        label = fault or "healthy"
        if progress is not None:
            progress(i, len(names), label)
        report = run_suite(ReferenceAdapter(fault))
        codes = lint_codes(healthy_sources() if fault is None else [FAULTS[fault].path])
        lint_available = lint_available and codes is not None
        # a check that could not run counts against the row: the demo must show every check working
        rows[label] = {"failed_checks": report.failed + report.errors, "lint_codes": codes or []}
    if progress is not None:
        progress(len(names), len(names), "done")
    verdicts = {name: verdict(name, row, lint_available) for name, row in rows.items()}
    return {"checks": list(CHECKS), "rows": rows, "verdicts": verdicts, "lint": lint_available}


def verdict(name: str, row: dict, lint_available: bool = True) -> str:
    from rlguard.reference.faults import FAULTS

    failed, codes = row["failed_checks"], row["lint_codes"]
    if name == "healthy":
        ok = not failed and not codes
        return ("OK: every check passes, lint clean" if ok else
                f"PROBLEM: healthy trainer fails {failed or '-'}, lint {codes or '-'}")
    fault = FAULTS[name]
    caught = fault.expected_check in failed
    parts = [f"{fault.code} {fault.description}."]
    parts.append(f"preflight: {'caught' if caught else 'MISSED'} by {fault.expected_check}"
                 + (f" (also {', '.join(c for c in failed if c != fault.expected_check)})" if len(failed) > 1 else ""))
    if not lint_available:
        parts.append("lint: not available")
    elif fault.code in codes:
        parts.append(f"lint: {fault.code}")
    elif fault.statically_visible:
        parts.append(f"lint: MISSED {fault.code}" + (f" (reports {', '.join(codes)})" if codes else ""))
    else:
        parts.append("lint: not statically visible" + (f" (reports {', '.join(codes)})" if codes else ""))
    return " ".join(parts[:1]) + " " + "; ".join(parts[1:])


def expectations_met(result: dict) -> bool:
    from rlguard.reference.faults import FAULTS

    for name, row in result["rows"].items():
        if name == "healthy":
            if row["failed_checks"] or row["lint_codes"]:
                return False
            continue
        fault = FAULTS[name]
        if fault.expected_check not in row["failed_checks"]:
            return False
        if result["lint"] and fault.statically_visible and fault.code not in row["lint_codes"]:
            return False
    return True


def write_matrix(result: dict, out: str | Path) -> None:
    from rlguard.preflight.report import matrix_markdown

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "matrix.md").write_text(matrix_markdown(result["checks"], result["rows"], result["verdicts"]))
    data = {"checks": result["checks"], "rows": result["rows"]}
    (out / "matrix.json").write_text(json.dumps(data, indent=2) + "\n")
