"""What a failed contract raises, and the small per-check result the checks produce.

Every check returns ``None`` (pass) or a :class:`Violation` (code, argument, message). The decorator collects
a call's violations in a list and hands them to :func:`rlguard.contracts.settings.report`, the single place
where violations leave the checks (see the distributed note there).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rlguard.catalog import CODES


@dataclass(frozen=True)
class Violation:
    """One failed check: a small, picklable record (no tensors), so it can later cross ranks."""

    code: str  # a catalog code, e.g. "RLG001"
    function: str  # qualified name of the decorated function, or "Guard"
    argument: str  # argument name, "return", "return[0]", or a guard role ("reference")
    message: str  # full, multi-line message (starts with the headline)
    details: dict = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        assert self.code in CODES, f"unknown catalog code {self.code!r}"


class ContractViolation(AssertionError):
    """A runtime contract failed.

    Subclass of ``AssertionError``: a contract is an assertion about the caller's tensors, and test frameworks
    (pytest) report it as a failed assertion. ``except AssertionError`` catches it; ``python -O`` does *not*
    disable it (rlguard raises it explicitly, it is not an ``assert`` statement).

    Attributes: ``code`` (catalog code), ``function`` (qualified name), ``argument`` (the argument, or
    ``"return"``), ``violations`` (all of this call's :class:`Violation` records; the message shows the first
    and lists the others), ``rank`` (the data-parallel rank that saw the violations shown: this rank when it
    failed itself, else the first rank that failed; ``None`` in a single process) and ``ranks`` (every rank
    that failed at this synchronised call; ``()`` in a single process).
    """

    def __init__(self, violations: list[Violation], rank: int | None = None,
                 ranks: tuple[int, ...] = (), this_rank: int | None = None) -> None:
        first = violations[0]
        self.violations = list(violations)
        self.code = first.code
        self.function = first.function
        self.argument = first.argument
        self.rank = rank
        self.ranks = tuple(ranks)
        self.this_rank = this_rank
        text = first.message
        if len(violations) > 1:
            more = "\n".join(f"  - {v.code} {v.argument}: {v.message.splitlines()[0]}" for v in violations[1:])
            text += f"\n({len(violations) - 1} more in this call)\n{more}"
        if self.ranks:
            where = ", ".join(map(str, self.ranks))
            if this_rank is not None and this_rank in self.ranks:
                head = f"[rank {this_rank}] contract failed on rank(s) {where}; this rank's violation:"
            else:
                head = (f"[rank {this_rank}] contract failed on rank(s) {where} (not on this rank); rank {rank}'s "
                        "violation:")
            text = head + "\n" + text
        super().__init__(text)

    def __reduce__(self) -> tuple:  # picklable (multiprocessing, cross-rank reporting)
        return (type(self), (self.violations, self.rank, self.ranks, self.this_rank))


class ContractDefinitionError(TypeError):
    """A decorator or marker does not fit the function it was applied to (raised at decoration time)."""
