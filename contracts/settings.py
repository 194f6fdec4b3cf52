"""Modes (raise / warn / off), cross-rank sync, the warn-once registry and :func:`report`, the one exit of violations.

The mode is process-wide: ``RLGUARD=off|warn|raise`` in the environment (read at import), :func:`set_mode`,
or the context manager :func:`mode`. ``off`` makes decorated functions call straight through.

The cross-rank sync (``RLGUARD_SYNC=auto|off``, :func:`set_sync`, :func:`sync`) is used only when
``torch.distributed`` is initialised with more than one process: see :func:`report` and ``docs/distributed.md``.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Iterator

from rlguard.contracts.errors import ContractViolation, Violation

MODES = ("raise", "warn", "off")
SYNC_MODES = ("auto", "off")
PENDING_CAP = 16  # violations held between synchronised calls (the first ones are kept)
logger = logging.getLogger("rlguard.contracts")


_MODE_ALIASES = {"": "raise", "on": "raise", "1": "raise", "true": "raise", "0": "off", "false": "off",
                 "none": "off", "disable": "off", "disabled": "off"}


def parse_mode(raw: object) -> str | None:
    """``"raise"``, ``"warn"`` or ``"off"`` from what ``RLGUARD`` accepts (any case, ``on``/``1``/``true``,
    ``0``/``false``/``none``/``disable(d)``); ``None`` for anything else."""
    if not isinstance(raw, str):
        return None
    text = raw.strip().lower()
    if text in MODES:
        return text
    return _MODE_ALIASES.get(text)


def _mode_from_env() -> str:
    raw = os.environ.get("RLGUARD", "")
    parsed = parse_mode(raw)
    if parsed is None:
        logger.warning("RLGUARD=%r is not one of %s; using 'raise'", raw, "/".join(MODES))
        return "raise"
    return parsed


def _sync_from_env() -> str:
    raw = os.environ.get("RLGUARD_SYNC", "").strip().lower()
    if raw in ("", "auto", "on", "1", "true"):
        return "auto"
    if raw in ("off", "0", "false", "none", "local"):
        return "off"
    logger.warning("RLGUARD_SYNC=%r is not one of %s; using 'auto'", raw, "/".join(SYNC_MODES))
    return "auto"


class _State:
    """Module state kept on one object: the decorators read ``STATE.mode`` once per call."""

    __slots__ = ("mode", "warned", "compiled_pending", "compiled_warned", "sync", "group", "pending",
                 "collectives")

    def __init__(self) -> None:
        self.mode: str = _mode_from_env()
        self.warned: set[tuple[str, str, str]] = set()  # (code, function, argument) already logged
        self.compiled_pending: set[str] = set()  # functions seen inside torch.compile, not yet logged
        self.compiled_warned: set[str] = set()
        self.sync: str = _sync_from_env()  # "auto": sync across ranks when torch.distributed runs; "off": never
        self.group = None  # the process group of the sync (None: the default group)
        self.pending: list[Violation] = []  # seen between synchronised calls, reported at the next one
        self.collectives = 0  # flag all-reduces done by report() (tests and benchmarks read it)


STATE = _State()


def set_mode(new: str) -> None:
    """Set the process-wide mode: ``"raise"`` (default), ``"warn"`` (log once per code and place), ``"off"``.

    Accepts what the ``RLGUARD`` environment variable accepts (``"WARN"``, ``"on"``, ``"0"``, ...)."""
    parsed = parse_mode(new)
    if parsed is None:
        raise ValueError(f"rlguard mode must be one of {MODES} (any case; also on/1/true, off/0/false/none), "
                         f"got {new!r}")
    STATE.mode = parsed


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


def set_sync(new: str, group=None) -> None:
    """Cross-rank sync of violations: ``"auto"`` (default: on when ``torch.distributed`` is initialised with
    world size > 1) or ``"off"`` (each rank reports its own violations alone, never a collective).

    ``group``: the process group whose ranks check together (default: the default group). With sync on, every
    decorated function must be called the same number of times, in the same order, on every rank of the group,
    like any collective.
    """
    if new not in SYNC_MODES:
        raise ValueError(f"rlguard sync must be one of {SYNC_MODES}, got {new!r}")
    STATE.sync = new
    STATE.group = group


def get_sync() -> str:
    """The current sync setting (``"auto"`` or ``"off"``)."""
    return STATE.sync


@contextlib.contextmanager
def sync(new: str) -> Iterator[None]:
    """``with sync("off"): ...``: no cross-rank sync in the block (e.g. an evaluation that runs on rank 0 only)."""
    old, old_group = STATE.sync, STATE.group
    set_sync(new, old_group)
    try:
        yield
    finally:
        STATE.sync, STATE.group = old, old_group


def reset_warnings() -> None:
    """Forget which violations were already logged in warn mode (tests use it)."""
    STATE.warned.clear()
    STATE.compiled_warned.clear()
    STATE.compiled_pending.clear()


def report(violations: list[Violation], *, collective: bool = False) -> None:
    """The single exit of violations: raise (``raise`` mode) or log once (``warn`` mode); nothing in ``off``.

    In one process (``torch.distributed`` not initialised, world size 1, or ``sync="off"``) the violations are
    emitted at once and ``collective`` is ignored: no collective ever runs.

    Across ranks (sync on): a bad tensor may reach only some ranks, and a rank that raised alone would leave
    the others hanging in their next collective (DDP's gradient all-reduce). So violations leave only at a
    *synchronised call*: the callers pass ``collective=True`` exactly where every rank calls report() at the same
    point whether or not anything failed (a decorated function's call on its ``check_every`` cadence, the
    guard's construction, update boundaries and cadence steps). There one small all-reduce of a [world] int flag
    vector runs on every rank, unconditionally; when a rank failed, the failing ranks' violations are shared
    with one ``all_gather_object`` (only then), and every rank raises (or warns) together, naming the rank(s).
    Violations seen at a non-collective point (a cheap check between cadence calls) are held and reported, on
    all ranks, at the next synchronised call.
    """
    if STATE.mode == "off":
        STATE.pending.clear()
        return
    if STATE.sync == "off" or not _distributed():
        if violations:
            _emit(violations)
        return
    if not collective:
        room = PENDING_CAP - len(STATE.pending)
        if room > 0:
            STATE.pending.extend(violations[:room])
        return
    local = STATE.pending + list(violations)
    STATE.pending = []
    from rlguard.contracts.distributed import exchange

    STATE.collectives += 1
    shared = exchange(local, STATE.group)
    if shared is not None:
        shown, rank, ranks, this_rank = shared
        _emit(shown, rank, ranks, this_rank)


def _distributed() -> bool:
    """True when torch.distributed runs with more than one rank (cheap; no collective)."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size(STATE.group) > 1


def _emit(violations: list[Violation], rank: int | None = None, ranks: tuple[int, ...] = (),
          this_rank: int | None = None) -> None:
    if STATE.mode == "raise":
        raise ContractViolation(violations, rank, ranks, this_rank)
    if STATE.mode == "warn":
        prefix = ""
        if ranks:
            where = ", ".join(map(str, ranks))
            prefix = (f"[rank {this_rank}] contract failed on rank(s) {where}" +
                      ("" if this_rank in ranks else f" (not on this rank); rank {rank}'s violation") + ":\n")
        for v in violations:
            key = (v.code, v.function, v.argument)
            if key not in STATE.warned:
                STATE.warned.add(key)
                logger.warning("%s", prefix + v.message)


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
