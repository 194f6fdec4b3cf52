"""``rlguard check`` and ``rlguard demo``."""

from __future__ import annotations

import argparse
import os
import sys
import time

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_SKIP = 0, 1, 2, 125


def check_main(argv: list[str]) -> int:
    code = _check(argv)
    if _left_group:
        # a torchrun worker whose process group rlguard made and has destroyed: leave at once. At interpreter exit
        # gloo's threads can still be torn down after the process group ("terminate called without an active
        # exception", SIGABRT, seen in CI even after a barrier), failing a job whose checks all passed; the report is
        # written and the output flushed, and nothing else runs in this process.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


_left_group = False  # set when this process made a process group under torchrun and has left it


def _check(argv: list[str]) -> int:
    global _left_group
    parser = argparse.ArgumentParser(
        prog="rlguard check",
        description="Run the preflight invariant suite on a trainer adapter. Exit 0: every check passed; "
                    "1: a check failed; 2: a check could not run (an rlguard error, its cause printed) or the trainer's class "
                    "or configuration is not supported; 125: the trainer "
                    "could not be built or run (git bisect's 'skip').")
    parser.add_argument("adapter", nargs="?",
                        help="module:attr of the adapter (instance, class or factory), or a module")
    parser.add_argument("--trl", metavar="MODULE:FUNCTION",
                        help="instead of an adapter: a function returning a constructed trl.GRPOTrainer or "
                             "trl.RLOOTrainer (your subclass, config and reward functions); needs the [trl] extra")
    parser.add_argument("--out", help="write report.md and report.json into this folder")
    parser.add_argument("--seed", type=int, default=0, help="seed of the batch (default 0)")
    parser.add_argument("--only", help="comma-separated check names")
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    parser.add_argument("--backend", default="gloo",
                        help="under torchrun (WORLD_SIZE > 1): the torch.distributed backend (default gloo)")
    parser.add_argument("--dist-timeout", type=float, default=300.0,
                        help="under torchrun: seconds a collective may wait before the job fails (default 300)")
    args = parser.parse_args(argv)
    if (args.adapter is None) == (args.trl is None):
        parser.error("give either an adapter (module:attr) or --trl MODULE:FUNCTION")

    import torch

    torch.set_num_threads(1)
    from rlguard.preflight.adapter import AdapterError, load_adapter
    from rlguard.preflight.report import Progress, table, write_report
    from rlguard.preflight.suite import TrainerError, run_suite

    group = _init_distributed(args.backend, args.dist_timeout)
    rank = group[0] if group else 0
    ranks_in_step = False  # every rank finished the suite: they can leave the group together
    try:
        if args.trl is not None:
            try:
                from rlguard.integrations.trl import UnsupportedTRLError  # noqa: F401 - the version check
            except ImportError as exc:
                print(f"rlguard check: {exc}", file=sys.stderr)
                return EXIT_USAGE
        try:
            adapter = load_adapter(args.adapter) if args.trl is None else _trl_adapter(args.trl, args.seed)
            loaded = None
        except UsageError as exc:  # a trainer or configuration the TRL integration does not drive: not a "skip"
            print(f"rlguard check: {exc}", file=sys.stderr)
            return EXIT_USAGE
        except AdapterError as exc:
            loaded = str(exc)
        if group and _any_rank(loaded):  # every rank gives up together, never one alone
            loaded = loaded or "the adapter failed to load on another rank"
        if loaded is not None:
            print(f"rlguard check: {loaded}", file=sys.stderr)
            return EXIT_SKIP
        only = None if not args.only else [s.strip() for s in args.only.split(",")]
        try:
            report = run_suite(adapter, seed=args.seed, only=only,
                               progress=None if args.quiet or rank != 0 else Progress("preflight"))
        except TrainerError as exc:
            if rank == 0:
                print(f"rlguard check: the trainer could not be built or run: {exc}", file=sys.stderr)
            return EXIT_SKIP
        ranks_in_step = True
        if rank == 0:  # the report is the same on every rank: printed and written once
            print(table(report))
            if args.out:
                write_report(report, args.out)
            for c in report.checks:
                if c.error:
                    print(f"rlguard check: {c.name}: {c.hint}", file=sys.stderr)
        if report.failed:
            return EXIT_FAILED
        return EXIT_USAGE if report.errors else EXIT_OK
    finally:
        if group and group[2]:
            import torch.distributed as dist

            if ranks_in_step:
                # A rank that tears its gloo connections down while another still writes the report can abort
                # the other at exit ("terminate called without an active exception", SIGABRT): leave together.
                dist.barrier()
            dist.destroy_process_group()
            _left_group = True


class UsageError(Exception):
    """What the user asked for cannot be checked as given (exit 2, not git bisect's "skip")."""


def _trl_adapter(spec: str, seed: int):
    """The preflight adapter over the GRPOTrainer that ``spec``'s function builds (AdapterError if it cannot)."""
    from rlguard.integrations.trl import TRLPreflightError, adapter_from_factory, load_trainer_factory
    from rlguard.preflight.adapter import AdapterError

    try:
        factory = load_trainer_factory(spec)
    except AdapterError as exc:
        raise AdapterError(f"--trl {spec}: {exc}") from exc
    except (ValueError, TypeError) as exc:
        raise AdapterError(f"--trl {spec}: {exc}") from exc
    try:
        return adapter_from_factory(factory, seed=seed)
    except TRLPreflightError as exc:  # the trainer's class or configuration: the user's to change
        raise UsageError(f"--trl {spec}: {exc}") from exc
    except Exception as exc:  # noqa: BLE001 - the user's function raised: the trainer could not be built
        raise AdapterError(f"--trl {spec}: building the trainer failed: {type(exc).__name__}: {exc}") from exc


def _init_distributed(backend: str, timeout_s: float):
    """Under torchrun (``WORLD_SIZE`` > 1 in the environment): join the process group -> (rank, world, created)."""
    import os

    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return None
    import datetime

    import torch.distributed as dist

    created = not dist.is_initialized()
    if created:
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size(), created


def _any_rank(error) -> bool:
    import torch.distributed as dist

    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, error)
    return any(out)


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
