"""`rlguard diagnose LOG`: read a metrics log, run the symptom rules, print the findings (and plot them).

Exit codes: 0 no symptom, 1 symptoms found, 2 usage error or unreadable log.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from rlguard.diagnose.log import HistoryError, read_history
from rlguard.diagnose.rules import RULES, Report, Thresholds, diagnose

OK, SYMPTOMS, USAGE = 0, 1, 2


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="rlguard diagnose",
        description="Read a training metrics log (JSONL, CSV, a TensorBoard log dir, or TRL's trainer_state.json) "
                    "and name the likely faults.")
    p.add_argument("log", help="metrics log: .jsonl (one JSON row per step, or TRL's on_log dicts), .csv, a "
                               "TensorBoard event file/dir, or a TRL trainer_state.json (or its log_history list)")
    p.add_argument("--plot", metavar="OUT.png", help="draw the key metric curves with the firing steps marked")
    p.add_argument("--format", choices=("text", "json"), default="text")
    p.add_argument("--kl-coef", type=float, default=None,
                   help="the run's KL coefficient, when the log has no kl_coef column (TRL's beta, which its "
                        "logs do not hold)")
    p.add_argument("--threshold", "-t", action="append", default=[], metavar="NAME=VALUE",
                   help="override a threshold (repeatable), e.g. -t logp_gap_max=1e-3")
    p.add_argument("--list-rules", action="store_true", help="print the rules and thresholds, then exit")
    return p


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, list):
        return " -> ".join(_fmt(v) for v in value) if len(value) == 2 else "[" + ", ".join(_fmt(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_fmt(v)}" for k, v in value.items()) + "}"
    return str(value)


def _steps(steps: list[int]) -> str:
    """[3, 4, 5, 9] -> '3-5, 9'."""
    parts, i = [], 0
    while i < len(steps):
        j = i
        while j + 1 < len(steps) and steps[j + 1] == steps[j] + 1:
            j += 1
        parts.append(str(steps[i]) if i == j else f"{steps[i]}-{steps[j]}")
        i = j + 1
    return ", ".join(parts)


def format_text(report: Report, path: str) -> str:
    lines = []
    if report.ok:
        lines.append(f"{path}: no symptom found in {report.steps} steps")
        lines.append(f"  looked at: {', '.join(report.looked_at)}")
    else:
        lines.append(f"{path}: {len(report.symptoms)} symptom(s) in {report.steps} steps, likeliest cause first")
        for s in report.symptoms:
            codes = "/".join(s.codes) if s.codes else "-"
            lines.append(f"  {s.rule} [{codes}] {s.cause}")
            lines.append(f"    steps: {_steps(s.steps)}")
            lines.append("    evidence: " + "; ".join(f"{k} {_fmt(v)}" for k, v in s.evidence.items()))
            lines.append(f"    check: {s.advice}")
    if report.disabled:
        lines.append("  rules off (a metric they need is not in the log):")
        lines += [f"    {r}: {report.off_reasons.get(r) or 'the log has no ' + ', '.join(m)}"
                  for r, m in report.disabled.items()]
    lines += [f"  note: {note}" for note in report.notes]
    return "\n".join(lines)


def _list_rules() -> str:
    th = Thresholds()
    lines = ["rules (likeliest cause first):"]
    lines += [f"  {r.name:<18} needs {', '.join(r.requires) or '-':<26} {r.title}" for r in RULES]
    lines.append("thresholds (override with -t NAME=VALUE):")
    lines += [f"  {k} = {v}" for k, v in vars(th).items()]
    return "\n".join(lines)


def diagnose_main(argv: list[str] | None = None) -> int:
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse exits 2 on errors, 0 on --help
        return int(exc.code or 0)
    if args.list_rules:
        print(_list_rules())
        return OK
    try:
        thresholds = Thresholds.parse(args.threshold)
    except (KeyError, ValueError) as exc:
        print(f"rlguard diagnose: {exc.args[0]}", file=sys.stderr)
        return USAGE
    try:
        history = read_history(args.log)
    except HistoryError as exc:
        print(f"rlguard diagnose: {exc}", file=sys.stderr)
        return USAGE
    if not history:
        print(f"rlguard diagnose: {args.log}: the log has no rows", file=sys.stderr)
        return USAGE
    report = diagnose(history, thresholds, kl_coef=args.kl_coef)
    if args.format == "json":
        print(json.dumps(report.to_json(), indent=2))
        for note in report.notes:  # stdout stays the documented list of symptoms
            print(f"rlguard diagnose: note: {note}", file=sys.stderr)
    else:
        print(format_text(report, args.log))
    if args.plot:
        try:
            from rlguard.diagnose.plot import plot_history  # noqa: PLC0415
            plot_history(history, report, args.plot, title=os.path.basename(os.path.normpath(args.log)))
        except ImportError:
            print("rlguard diagnose: --plot needs matplotlib: pip install 'rlguard[plot]'", file=sys.stderr)
            return USAGE
        except (OSError, ValueError) as exc:
            print(f"rlguard diagnose: cannot write the plot {args.plot}: {exc}", file=sys.stderr)
            return USAGE
        if args.format == "text":
            print(f"plot: {args.plot}")
    return OK if report.ok else SYMPTOMS
