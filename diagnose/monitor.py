"""A live monitor for the training loop: ``monitor.step(row)`` after each step warns (or raises) when a symptom
rule fires, at most once per rule per ``window`` steps.

    monitor = Monitor(on_symptom="warn", log_path="run.jsonl")
    history = train(cfg, on_step=monitor.step)       # the reference trainer's callback
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from rlguard.diagnose.log import MetricsLogger
from rlguard.diagnose.rules import RULES, Rule, Symptom, Thresholds, diagnose


class SymptomWarning(UserWarning):
    """A symptom rule fired during training."""


class SymptomError(RuntimeError):
    """A symptom rule fired during training and the monitor was told to stop the run."""

    def __init__(self, symptom: Symptom, step: int):
        self.symptom, self.step = symptom, step
        super().__init__(format_alert(symptom, step))


def format_alert(symptom: Symptom, step: int) -> str:
    codes = f" {'/'.join(symptom.codes)}" if symptom.codes else ""
    return (f"rlguard diagnose: step {step}: {symptom.rule}{codes} ({symptom.cause}): "
            f"{symptom.evidence} -- {symptom.advice}")


class Monitor:
    """Watch the metric rows of a running job.

    ``on_symptom``: "warn" (``warnings.warn`` with ``SymptomWarning``), "raise" (``SymptomError``, stops the
    loop) or a callable ``f(symptom, step)``. A rule alerts when it fires at the current step's history and has
    not alerted in the last ``window`` steps. ``log_path``: also write every row to a JSONL log.
    """

    def __init__(self, thresholds: Thresholds | None = None, on_symptom: str | Callable[[Symptom, int], Any] = "warn",
                 window: int = 10, kl_coef: float | None = None, rules: Sequence[Rule] | None = None,
                 log_path: str | os.PathLike | None = None):
        if not callable(on_symptom) and on_symptom not in ("warn", "raise"):
            raise ValueError("on_symptom is 'warn', 'raise' or a callable")
        self.thresholds = thresholds or Thresholds()
        self.on_symptom, self.window, self.kl_coef = on_symptom, window, kl_coef
        self.rules = list(RULES if rules is None else rules)
        self.history: list[dict] = []
        self.alerts: list[tuple[int, Symptom]] = []  # (step, symptom) of each alert given
        self._last_alert: dict[str, int] = {}
        self._logger = MetricsLogger(log_path) if log_path is not None else None

    def step(self, row: Mapping[str, Any]) -> list[Symptom]:
        """Add one step's row; alert for each rule that fires now and is not in its quiet window -> those."""
        row = dict(row)
        row.setdefault("step", len(self.history))
        self.history.append(row)
        if self._logger is not None:
            self._logger.log(row)
        step = int(row["step"])
        report = diagnose(self.history, self.thresholds, self.kl_coef, self.rules)
        new = []
        for symptom in report.symptoms:
            last = self._last_alert.get(symptom.rule)
            if last is not None and step - last < self.window:
                continue
            self._last_alert[symptom.rule] = step
            self.alerts.append((step, symptom))
            new.append(symptom)
        for symptom in new:
            if self.on_symptom == "warn":
                warnings.warn(format_alert(symptom, step), SymptomWarning, stacklevel=2)
            elif self.on_symptom == "raise":
                raise SymptomError(symptom, step)
            else:
                self.on_symptom(symptom, step)
        return new

    __call__ = step

    def close(self) -> None:
        if self._logger is not None:
            self._logger.close()
