"""``rlguard check`` and ``rlguard demo``."""

from __future__ import annotations

import argparse
import sys
import time

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_SKIP = 0, 1, 2, 125


def check_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="rlguard check",
        description="Run the preflight invariant suite on a trainer adapter. Exit 0: every check passed; "
                    "1: a check failed; 125: the trainer could not be built or run (git bisect's 'skip').")
    parser.add_argument("adapter", help="module:attr of the adapter (instance, class or factory), or a module")
    parser.add_argument("--out", help="write report.md and report.json into this folder")
    parser.add_argument("--seed", type=int, default=0, help="seed of the batch (default 0)")
    parser.add_argument("--only", help="comma-separated check names")
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)

    import torch

    torch.set_num_threads(1)
    from rlguard.preflight.adapter import AdapterError, load_adapter
    from rlguard.preflight.report import Progress, table, write_report
    from rlguard.preflight.suite import TrainerError, run_suite

    try:
        adapter = load_adapter(args.adapter)
    except AdapterError as exc:
        print(f"rlguard check: {exc}", file=sys.stderr)
        return EXIT_SKIP
    only = None if not args.only else [s.strip() for s in args.only.split(",")]
    try:
        report = run_suite(adapter, seed=args.seed, only=only,
                           progress=None if args.quiet else Progress("preflight"))
    except TrainerError as exc:
        print(f"rlguard check: the trainer could not be built or run: {exc}", file=sys.stderr)
        return EXIT_SKIP
    print(table(report))
    if args.out:
        write_report(report, args.out)
    return EXIT_OK if report.passed else EXIT_FAILED


def demo_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="rlguard demo",
        description="Preflight checks and lint on the reference GRPO trainer, healthy and with each injected "
                    "fault: one matrix (faults x checks, plus lint) and a verdict per fault.")
    parser.add_argument("--out", help="write matrix.md and matrix.json into this folder")
    parser.add_argument("--faults", help="comma-separated subset of faults (default: all)")
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)

    import torch

    torch.set_num_threads(1)
    from rlguard.preflight.demo import expectations_met, run_demo, write_matrix
    from rlguard.preflight.report import Progress, matrix_table

    faults = None if not args.faults else [s.strip() for s in args.faults.split(",")]
    start = time.perf_counter()
    result = run_demo(faults, progress=None if args.quiet else Progress("demo"))
    print(matrix_table(result["checks"], result["rows"]))
    print()
    width = max(len(n) for n in result["verdicts"])
    for name, text in result["verdicts"].items():
        print(f"{name:<{width}}  {text}")
    if not result["lint"]:
        print("\n(lint column empty: rlguard.lint is not available)")
    print(f"\n{len(result['rows'])} trainers checked in {time.perf_counter() - start:.0f} s")
    if args.out:
        write_matrix(result, args.out)
    return EXIT_OK if expectations_met(result) else EXIT_FAILED
