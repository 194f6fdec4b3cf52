"""``rlguard lint`` and ``rlguard rule``. Exit codes of ``lint``: 0 clean, 1 findings (or a ``--diff`` to apply),
2 usage, configuration or internal error. Never imports torch."""

from __future__ import annotations

import argparse
import os
import sys

USAGE_ERROR = 2
FINDINGS = 1


def _debug() -> bool:
    return os.environ.get("RLGUARD_DEBUG", "").strip() not in ("", "0", "false", "no")


def _codes(values: list[str] | None) -> list[str] | None:
    if values is None:
        return None
    return [c.strip() for v in values for c in v.split(",") if c.strip()]


def _lint_parser() -> argparse.ArgumentParser:
    from rlguard.lint.config import TARGET_VERSIONS
    from rlguard.lint.output import FORMATS

    p = argparse.ArgumentParser(
        prog="rlguard lint",
        description="Lint Python files for the silent bugs of RL trainers (codes RLG001-RLG013 and RLG016-RLG019; rlguard's own: "
                    "RLG900 syntax error, RLG901 unused noqa (opt-in), RLG902 internal error; "
                    "`rlguard rule CODE` explains one).",
        epilog="Exit status: 0 no findings, 1 findings, 2 usage/config/internal error. "
               "Config: [tool.rlguard] in the nearest pyproject.toml.")
    p.add_argument("paths", nargs="*", metavar="PATH", help="files or folders to lint (default: .)")
    p.add_argument("--format", choices=FORMATS, default="text", help="output format (default: text)")
    p.add_argument("--select", action="append", metavar="CODES",
                   help="comma-separated codes or prefixes to run (RLG004, RLG00, ALL); replaces the config's")
    p.add_argument("--extend-select", action="append", metavar="CODES", help="codes to add to the selection")
    p.add_argument("--ignore", action="append", metavar="CODES", help="codes to leave out")
    p.add_argument("--config", metavar="FILE", help="use this pyproject.toml (or a TOML file with the keys at top)")
    p.add_argument("--isolated", action="store_true", help="ignore every configuration file")
    p.add_argument("--target-version", choices=TARGET_VERSIONS, metavar="VERSION",
                   help="the Python the code is for, which decides what is a syntax error (py37-py314; default: "
                        "the config's target-version, else requires-python of the nearest pyproject.toml)")
    p.add_argument("--preview", action=argparse.BooleanOptionalAction, default=None,
                   help="also run the preview rules and rule parts, whose precision on unseen code is not yet shown "
                        "(default: off, or `preview` in [tool.rlguard])")
    p.add_argument("--fix", action="store_true", help="apply the safe rewrites in place")
    p.add_argument("--diff", action="store_true", help="print the rewrites --fix would make as a diff; write nothing")
    p.add_argument("--show-suppressed", action="store_true", help="also list the findings silenced by # noqa")
    p.add_argument("--add-noqa", dest="add_noqa", action="store_const", const="",
                   help="write '# noqa: CODE' on the line of each finding; --add-noqa=REASON appends ' - REASON'")
    p.add_argument("--statistics", action="store_true",
                   help="print the number of findings per code instead of the findings (text or json)")
    p.add_argument("-j", "--jobs", type=int, default=0, metavar="N",
                   help="worker processes (default: the number of CPUs; 1 = no workers)")
    p.add_argument("--no-cache", action="store_true", help="neither read nor write .rlguard_cache/")
    p.add_argument("--force-exclude", action="store_true",
                   help="apply exclude to files named on the command line too (what the pre-commit hook uses)")
    p.add_argument("--exit-zero", action="store_true", help="exit 0 even when there are findings")
    p.add_argument("-o", "--output-file", metavar="FILE", help="write the report to FILE instead of stdout")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="tracebacks of internal errors, cache statistics, skipped paths, the target version")
    return p


def _split_add_noqa(argv: list[str]) -> tuple[list[str], str | None]:
    """``--add-noqa=REASON`` -> (argv with a bare ``--add-noqa``, REASON). The reason must be attached with ``=``
    (as in ruff), so that ``--add-noqa src/`` keeps ``src/`` as a path."""
    reason, out = None, []
    for arg in argv:
        if arg.startswith("--add-noqa="):
            reason = arg.split("=", 1)[1]
            arg = "--add-noqa"
        out.append(arg)
    return out, reason


def lint_main(argv: list[str]) -> int:
    parser = _lint_parser()
    argv, reason = _split_add_noqa(list(argv))
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse exits 2 on a usage error, 0 on --help
        return exc.code if isinstance(exc.code, int) else USAGE_ERROR
    if reason is not None:
        args.add_noqa = reason
    verbose = args.verbose or _debug()
    try:
        return _lint(args, verbose)
    except KeyboardInterrupt:
        print("rlguard lint: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # a bug in rlguard itself: one line, the traceback only on request
        if verbose:
            import traceback

            traceback.print_exc()
        print(f"rlguard lint: internal error: {type(exc).__name__}: {exc} "
              f"(a bug in rlguard; rerun with RLGUARD_DEBUG=1 for the traceback)", file=sys.stderr)
        return USAGE_ERROR


def _usage_error(message: str) -> int:
    print(f"rlguard lint: {message}", file=sys.stderr)
    return USAGE_ERROR


def _lint(args: argparse.Namespace, verbose: bool) -> int:
    from rlguard.lint.config import ConfigError, Layer, load_config
    from rlguard.lint.output import STATISTICS_FORMATS, render
    from rlguard.lint.runner import PathError, run

    if args.jobs < 0:
        return _usage_error("--jobs must be 0 (all CPUs) or more")
    if args.add_noqa is not None and (args.fix or args.diff):
        return _usage_error("--add-noqa cannot be combined with --fix or --diff: fix first, then add noqa comments")
    if args.statistics and args.format not in STATISTICS_FORMATS:
        return _usage_error(f"--statistics prints {' or '.join(STATISTICS_FORMATS)}, not {args.format}")
    if args.output_file:
        folder = os.path.dirname(os.path.abspath(args.output_file))
        if not os.path.isdir(folder):
            return _usage_error(f"--output-file {args.output_file}: the folder {os.path.dirname(args.output_file)} "
                                f"does not exist; create it first (mkdir -p) or write elsewhere")
        if os.path.isdir(args.output_file):
            return _usage_error(f"--output-file {args.output_file} is a folder; give a file name")
    paths = args.paths or ["."]
    layer = Layer(select=tuple(_codes(args.select)) if args.select is not None else None,
                  extend_select=tuple(_codes(args.extend_select) or ()), ignore=tuple(_codes(args.ignore) or ()),
                  preview=args.preview)
    try:
        config = load_config(paths, config_path=args.config, cli=layer, isolated=args.isolated,
                             target_version=args.target_version)
        jobs = args.jobs or os.cpu_count() or 1
        report = run(paths, config, jobs=jobs, cache=not args.no_cache, fix=args.fix or args.diff, diff=args.diff,
                     force_exclude=args.force_exclude, add_noqa=args.add_noqa)
    except (ConfigError, PathError) as exc:
        return _usage_error(str(exc))

    for skipped in report.skipped:
        if skipped.explicit or verbose:
            print(f"rlguard: skipped {skipped.path}: {skipped.reason}", file=sys.stderr)
    if args.add_noqa is not None:
        return _report_add_noqa(report)
    diff_text = "".join(report.diffs) if args.diff else ""
    if diff_text and args.format != "text":  # keep a machine-readable stdout parseable
        sys.stderr.write(diff_text)
        diff_text = ""
    out = diff_text + render(report, args.format, show_suppressed=args.show_suppressed, statistics=args.statistics)
    if args.output_file:
        try:
            with open(args.output_file, "w", encoding="utf-8") as fh:
                fh.write(out)
        except OSError as exc:
            return _usage_error(f"cannot write the report to {args.output_file}: {exc.strerror or exc}")
    else:
        sys.stdout.write(out)
        sys.stdout.flush()
    for error in report.errors:
        print(f"rlguard: {error.describe()} (a bug or a limit of rlguard: please report it; "
              f"{'traceback follows' if verbose else 'RLGUARD_DEBUG=1 shows the traceback'})", file=sys.stderr)
        if verbose and error.traceback:
            print(error.traceback, file=sys.stderr)
    if verbose:
        target = config.target_version
        print(f"rlguard: {report.files_checked} files, {report.cache_hits} from the cache; target "
              f"{f'py{target[0]}{target[1]}' if target else 'the newest grammar'} from {config.target_source}",
              file=sys.stderr)
    if report.errors:
        return USAGE_ERROR
    if args.exit_zero:
        return 0
    if args.diff:
        return FINDINGS if report.diffs or report.findings else 0
    return FINDINGS if report.findings else 0


def _report_add_noqa(report) -> int:
    files = len(report.files_fixed)
    print(f"Added {report.noqa_added} noqa {'directive' if report.noqa_added == 1 else 'directives'} "
          f"in {files} {'file' if files == 1 else 'files'}")
    for where in report.noqa_refused:
        print(f"rlguard: could not add a noqa comment at {where} (the line ends inside a string or with a "
              f"backslash): silence it by hand or with per-file-ignores", file=sys.stderr)
    for error in report.errors:
        print(f"rlguard: {error.describe()}", file=sys.stderr)
    if report.errors:
        return USAGE_ERROR
    return FINDINGS if report.noqa_refused else 0


# ----- rlguard rule ----------------------------------------------------------------------------------------------
def rule_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="rlguard rule", description="Print a code's documentation page.")
    p.add_argument("code", nargs="?", help="a code (RLG004) or a name (entropy-bonus-sign)")
    p.add_argument("--list", action="store_true", help="list every code with its name and whether lint checks it")
    p.add_argument("--write-docs", metavar="DIR", help="write DIR/<code>.md for every code (docs/rules/)")
    try:
        args = p.parse_args(argv)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else USAGE_ERROR
    from rlguard.lint import docs

    if args.write_docs:
        written = docs.write_docs(args.write_docs)
        print(f"wrote {len(written)} pages to {args.write_docs}")
        return 0
    if args.list:
        rows = [("CODE", "NAME", "STATIC", "STATUS", "FIX"), *docs.list_codes()]
        width = max(len(r[1]) for r in rows)
        state_width = max(len(r[3]) for r in rows)
        for code, name, static, state, fix in rows:
            print(f"{code:<7} {name:<{width}}  {static:<13} {state:<{state_width}}  {fix}".rstrip())
        return 0
    if not args.code:
        p.print_usage(sys.stderr)
        print("rlguard rule: give a code (rlguard rule RLG004) or --list", file=sys.stderr)
        return USAGE_ERROR
    try:
        page = docs.render_page(args.code)
    except KeyError as exc:
        print(f"rlguard rule: {exc.args[0]}", file=sys.stderr)
        return USAGE_ERROR
    sys.stdout.write(page)
    return 0
