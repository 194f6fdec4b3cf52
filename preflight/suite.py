"""Run the preflight checks on an adapter -> ``Report``; under ``torch.distributed``, on every rank, aggregated."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Callable, Iterable

import torch

from rlguard.preflight.adapter import TrainerFault
from rlguard.preflight.checks import CHECKS, CheckResult, Context, _skip


class TrainerError(Exception):
    """The trainer could not be built or run (no model, no batch): nothing was checked."""


@dataclass
class Report:
    checks: list[CheckResult] = field(default_factory=list)
    world_size: int = 1  # ranks whose results this report aggregates
    seed: int = 0  # the base seed: the suite's first batch is this seed's (a check may draw the next seeds')

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.checks)

    @property
    def failed(self) -> list[str]:
        """Checks that found their fault (an rlguard error is not a finding: ``errors``)."""
        return [c.name for c in self.checks if not c.passed and not c.error]

    @property
    def errors(self) -> list[str]:
        """Checks that raised: rlguard could not run them on this trainer."""
        return [c.name for c in self.checks if c.error]

    @property
    def skipped(self) -> list[str]:
        return [c.name for c in self.checks if c.skipped]

    @property
    def warnings(self) -> list[str]:
        """Checks whose fault signature a documented setting of the trainer produces by design."""
        return [c.name for c in self.checks if getattr(c, "warning", False)]

    @property
    def batches(self) -> dict[str, int]:
        """check -> the seed of the batch it ran on, for the checks that drew another batch than the first."""
        return {c.name: c.seed for c in self.checks if getattr(c, "seed", None) is not None}

    def batches_line(self) -> str:
        """Which batches the checks ran on: the first (the base seed's) for every check but those that drew another
        (``stop_token_trained (seed 3)``)."""
        others = self.batches
        if not others:
            return "batches: the first for every check"
        return "batches: the first for every check but " + ", ".join(f"{n} (seed {s})" for n, s in others.items())

    def to_dict(self) -> dict:
        d = {"passed": self.passed, "seed": self.seed, "batches": self.batches,
             "checks": [c.to_dict() for c in self.checks]}
        if self.world_size > 1:
            d["world_size"] = self.world_size
        return d


def _world() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def not_applicable(adapter) -> dict[str, str]:
    """The adapter's optional ``not_applicable()``: check name -> why it cannot apply to this configuration."""
    declare = getattr(adapter, "not_applicable", None)
    if declare is None:
        return {}
    reasons = {str(name): str(why) for name, why in dict(declare()).items()}
    unknown = sorted(set(reasons) - set(CHECKS))
    if unknown:
        raise TrainerError(f"not_applicable() names unknown check(s) {', '.join(unknown)}; "
                           f"the checks are: {', '.join(CHECKS)}")
    return reasons


def run_suite(adapter, seed: int = 0, only: Iterable[str] | None = None,
              progress: Callable[[int, int, str], None] | None = None,
              distributed: bool | None = None) -> Report:
    """Every check (or those in ``only``) on one batch of ``adapter``; ``progress(done, total, name)`` after each.

    A check the adapter declares inapplicable (``not_applicable()``: no KL term, no entropy bonus, ...) is not run
    and is reported as skipped with the adapter's reason.

    ``distributed`` (default: whether ``torch.distributed`` is initialised with more than one rank): every rank
    runs every check, in the same order (an adapter's data-parallel ``backward``/``update`` run their collectives
    inside them), then the ranks exchange their results once (``all_gather_object`` of small records) and every
    rank returns the same aggregated report: a check passes when it passed on every rank; its value is the worst
    rank's (the max, or the min for a lower-bound tolerance ``> x``), with each rank's value in ``per_rank`` and the
    failing ranks named in the hint. A trainer that cannot be built on some rank raises ``TrainerError`` on all.
    """
    world = _world() if distributed is None or distributed else 1
    names = list(CHECKS) if only is None else [n for n in CHECKS if n in set(only)]
    torch.manual_seed(seed)
    error = None
    try:
        inapplicable = not_applicable(adapter)
        ctx = Context(adapter, seed)
    except Exception as exc:  # noqa: BLE001 - the trainer itself is broken: report as "cannot test"
        error = f"{type(exc).__name__}: {exc}"
    if world > 1:
        errors = _gather(error)
        if any(errors):
            bad = [r for r, e in enumerate(errors) if e]
            raise TrainerError(f"rank {bad[0]}: {errors[bad[0]]}" + (f" (failed on ranks {bad})" if len(bad) > 1 else ""))
    elif error is not None:
        raise TrainerError(error)
    report = Report(seed=seed)
    documented = _documented_deviations(adapter)
    for i, name in enumerate(names):
        fn, code, _ = CHECKS[name]
        if progress is not None:
            progress(i, len(names), name)
        if name in inapplicable:
            report.checks.append(_skip(name, inapplicable[name]))
            continue
        try:
            result = fn(ctx)
        except TrainerFault as exc:  # the adapter saw the trainer do something wrong: the check's finding
            result = CheckResult(name, code, float("nan"), "-", False, str(exc)[:300])
        except Exception as exc:  # noqa: BLE001 - a crash inside a check is an rlguard error, not a finding
            result = CheckResult(name, None, float("nan"), "-", False, f"rlguard error: {_cause(exc)}", error=True)
        if not result.passed and not result.error and name in documented:
            result = replace(result, passed=True, warning=True,
                             hint=f"warning: {documented[name]} (measured: {result.hint})")
        report.checks.append(result)
    _explain_errors(report)
    if world > 1:
        report = aggregate(_gather(report.checks), seed=seed)
    if progress is not None:
        progress(len(names), len(names), "done")
    return report


def _documented_deviations(adapter) -> dict[str, str]:
    """The adapter's optional ``documented_deviations()``: check name -> the trainer's setting that produces that
    check's fault signature by design (a framework's documented normalisation, say), reported as a warning."""
    fn = getattr(adapter, "documented_deviations", None)
    if fn is None:
        return {}
    try:
        return dict(fn())
    except Exception:  # noqa: BLE001 - a broken optional hook: no deviation is documented
        return {}


def _explain_errors(report: Report) -> None:
    """Name the finding an rlguard error follows from, where one does: targets that carry an autograd graph make
    every later backward through them raise (the graph was freed by the first)."""
    attached = next((c for c in report.checks if c.name == "targets_detached" and not c.passed and not c.error), None)
    if attached is None:
        return
    for c in report.checks:
        if c.error and "backward through the graph a second time" in c.hint:
            c.hint += (f" - a consequence of targets_detached ({attached.code}): {attached.hint}")


def _cause(exc: BaseException) -> str:
    """``Type: message (at file:line in function)`` of the deepest frame of the traceback: where it broke."""
    import traceback

    frames = traceback.extract_tb(exc.__traceback__)
    where = f" (at {frames[-1].filename.rsplit('/', 1)[-1]}:{frames[-1].lineno} in {frames[-1].name})" if frames else ""
    return f"the check raised {type(exc).__name__}: {str(exc)[:200]}{where}"


def _gather(obj) -> list:
    import torch.distributed as dist

    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _worst(tolerance: str, values: list[float]) -> float:
    real = [v for v in values if not (isinstance(v, float) and math.isnan(v))]
    if len(real) < len(values) or not real:
        return float("nan")
    return min(real) if tolerance.strip().startswith(">") else max(real)


def aggregate(per_rank: list[list[CheckResult]], seed: int = 0) -> Report:
    """One report from each rank's results (same checks, same order on every rank)."""
    out = Report(world_size=len(per_rank), seed=seed)
    for results in zip(*per_rank):
        first = results[0]
        failed = [r for r, c in enumerate(results) if not c.passed]
        values = [c.value for c in results]
        if failed:
            hint = f"failed on rank(s) {', '.join(map(str, failed))}: {results[failed[0]].hint}"
            value = results[failed[0]].value
        else:
            hint = first.hint
            value = _worst(first.tolerance, values)
        out.checks.append(replace(first, value=value, passed=not failed, hint=hint,
                                  skipped=all(c.skipped for c in results), per_rank=values,
                                  error=any(c.error for c in results)))
    return out
