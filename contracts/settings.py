"""Modes (raise / warn / off), the warn-once registry and :func:`report`, the one exit of violations.

The mode is process-wide: ``RLGUARD=off|warn|raise`` in the environment (read at import), :func:`set_mode`,
or the context manager :func:`mode`. ``off`` makes decorated functions call straight through.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Iterator

from rlguard.contracts.errors import ContractViolation, Violation

MODES = ("raise", "warn", "off")
logger = logging.getLogger("rlguard.contracts")


def _mode_from_env() -> str:
    raw = os.environ.get("RLGUARD", "").strip().lower()
    if raw in ("", "on", "1", "true"):
        return "raise"
    if raw in ("0", "false", "none", "disable", "disabled"):
        return "off"
    if raw in MODES:
        return raw
    logger.warning("RLGUARD=%r is not one of %s; using 'raise'", raw, "/".join(MODES))
    return "raise"


class _State:
    """Module state kept on one object: the decorators read ``STATE.mode`` once per call."""

    __slots__ = ("mode", "warned", "compiled_pending", "compiled_warned")

    def __init__(self) -> None:
        self.mode: str = _mode_from_env()
        self.warned: set[tuple[str, str, str]] = set()  # (code, function, argument) already logged
        self.compiled_pending: set[str] = set()  # functions seen inside torch.compile, not yet logged
        self.compiled_warned: set[str] = set()


STATE = _State()


def set_mode(new: str) -> None:
    """Set the process-wide mode: ``"raise"`` (default), ``"warn"`` (log once per code and place), ``"off"``."""
    if new not in MODES:
        raise ValueError(f"rlguard mode must be one of {MODES}, got {new!r}")
    STATE.mode = new


def get_mode() -> str:
    """The current mode."""
    return STATE.mode


@contextlib.contextmanager
def mode(new: str) -> Iterator[None]:
    """``with mode("warn"): ...`` sets the mode for the block and restores the previous one after it."""
    old = STATE.mode
    set_mode(new)
    try:
        yield
    finally:
        STATE.mode = old


def reset_warnings() -> None:
    """Forget which violations were already logged in warn mode (tests use it)."""
    STATE.warned.clear()
    STATE.compiled_warned.clear()
    STATE.compiled_pending.clear()


def report(violations: list[Violation]) -> None:
    """The single exit of a call's violations (empty list: nothing to do).

    Distributed seam: under data parallelism a bad tensor may reach only some ranks, and a rank that raises
    alone leaves the others hanging in the next collective. A later change all-reduces one flag per call here
    (``any(violations)`` as an int, MAX over ranks, one small collective per checked call) and, when any rank
    failed, every rank raises together: a rank with its own violations raises them (with ``rank`` set), the
    others raise a short "violation on rank r" error. Nothing else in the package raises or logs violations,
    so that change stays in this function.
    """
    if not violations:
        return
    if STATE.mode == "raise":
        raise ContractViolation(violations)
    if STATE.mode == "warn":
        for v in violations:
            key = (v.code, v.function, v.argument)
            if key not in STATE.warned:
                STATE.warned.add(key)
                logger.warning("%s", v.message)


def note_compiled(function: str) -> None:
    """Called inside a ``torch.compile`` region (only a set mutation, which dynamo can trace)."""
    STATE.compiled_pending.add(function)


def flush_compiled_notes() -> None:
    """Log, once per function, that its contracts stepped aside inside ``torch.compile`` (called eagerly)."""
    if not STATE.compiled_pending:
        return
    for name in sorted(STATE.compiled_pending - STATE.compiled_warned):
        STATE.compiled_warned.add(name)
        logger.warning(
            "rlguard contracts of %s() stepped aside inside a torch.compile region (not checked there); "
            "call it eagerly, e.g. in a test or under torch.compiler.disable, to check it", name)
    STATE.compiled_pending.clear()
