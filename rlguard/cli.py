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


# The packages of the optional extras, and the extra that installs each.
EXTRA_OF = {"torch": "torch", "jaxtyping": "torch", "typeguard": "torch", "numpy": "torch", "matplotlib": "plot",
            "beartype": "beartype"}


def missing_extra(command: str, package: str, extra: str) -> str:
    """What to do when a command needs an extra that is not installed (rlguard is installed from a checkout or
    a git URL, not from PyPI)."""
    torch_first = ("pip install torch --index-url https://download.pytorch.org/whl/cpu  "
                   "(the CPU build; a plain `pip install torch` pulls CUDA packages), then\n  ")
    return (f"rlguard {command}: needs {package}, which is not installed. Install the [{extra}] extra:\n  "
            f"{torch_first if extra == 'torch' else ''}pip install -e \".[{extra}]\"  (in your rlguard checkout; "
            f"or pip install \"rlguard[{extra}] @ git+{REPOSITORY}\")")


REPOSITORY = "https://github.com/rlguard/rlguard"


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
        return getattr(module, func_name)(rest)
    except ModuleNotFoundError as exc:
        extra = EXTRA_OF.get((exc.name or "").partition(".")[0])
        if extra is None:  # not one of our extras' packages (the user's adapter, say): the command's own error
            raise
        print(missing_extra(command, exc.name, extra), file=sys.stderr)
        return USAGE_ERROR

