"""`rlguard` command: dispatches to the subcommand's own module, imported only when used.

`rlguard lint` and `rlguard rule` must never import torch (they run in the light pre-commit environment).
"""

from __future__ import annotations

import importlib
import sys

from rlguard import __version__

# subcommand -> (module, function taking argv and returning an exit code, one-line help)
SUBCOMMANDS = {
    "lint": ("rlguard.lint.cli", "lint_main", "lint Python files for RL trainer bugs"),
    "rule": ("rlguard.lint.cli", "rule_main", "print the documentation of a code, or --list all codes"),
    "check": ("rlguard.preflight.cli", "check_main", "run the preflight invariant suite on an adapter"),
    "demo": ("rlguard.preflight.cli", "demo_main", "run preflight and lint on the reference trainer and its faults"),
    "diagnose": ("rlguard.diagnose.cli", "diagnose_main", "read a metrics log and name the likely faults"),
}

USAGE_ERROR = 2


def _usage() -> str:
    lines = ["usage: rlguard <command> [options]", "", "commands:"]
    lines += [f"  {name:<10} {help_}" for name, (_, _, help_) in SUBCOMMANDS.items()]
    lines += ["", "Run `rlguard <command> --help` for a command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else USAGE_ERROR
    if argv[0] == "--version":
        print(f"rlguard {__version__}")
        return 0
    command, rest = argv[0], argv[1:]
    if command not in SUBCOMMANDS:
        print(f"rlguard: unknown command {command!r}\n\n{_usage()}", file=sys.stderr)
        return USAGE_ERROR
    module_name, func_name, _ = SUBCOMMANDS[command]
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        print(f"rlguard {command}: needs a package that is not installed ({exc.name or exc}); "
              f"install the extra: pip install 'rlguard[torch]'", file=sys.stderr)
        return USAGE_ERROR
    return getattr(module, func_name)(rest)
