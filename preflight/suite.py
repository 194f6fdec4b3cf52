"""Run the preflight checks on an adapter -> ``Report``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch

from rlguard.preflight.checks import CHECKS, CheckResult, Context


class TrainerError(Exception):
    """The trainer could not be built or run (no model, no batch): nothing was checked."""


@dataclass
class Report:
    checks: list[CheckResult] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.checks)

    @property
    def failed(self) -> list[str]:
        return [c.name for c in self.checks if not c.passed]

    def to_dict(self) -> dict:
        return {"passed": self.passed, "checks": [c.to_dict() for c in self.checks]}


def run_suite(adapter, seed: int = 0, only: Iterable[str] | None = None,
              progress: Callable[[int, int, str], None] | None = None) -> Report:
    """Every check (or those in ``only``) on one batch of ``adapter``; ``progress(done, total, name)`` after each."""
    names = list(CHECKS) if only is None else [n for n in CHECKS if n in set(only)]
    torch.manual_seed(seed)
    try:
        ctx = Context(adapter, seed)
    except Exception as exc:  # noqa: BLE001 - the trainer itself is broken: report as "cannot test"
        raise TrainerError(f"{type(exc).__name__}: {exc}") from exc
    report = Report()
    for i, name in enumerate(names):
        fn, code, _ = CHECKS[name]
        if progress is not None:
            progress(i, len(names), name)
        try:
            result = fn(ctx)
        except Exception as exc:  # noqa: BLE001 - a crash inside a check is that check's failure
            result = CheckResult(name, code, float("nan"), "-", False, f"raised {type(exc).__name__}: {exc}"[:200])
        report.checks.append(result)
    if progress is not None:
        progress(len(names), len(names), "done")
    return report
