"""Diagnose a training run from its metrics: a step's row (``step_row``), a JSONL logger, readers for JSONL,
CSV, TensorBoard and TRL's logs (``trainer_state.json``; names mapped by ``trl_logs.TRL_METRICS``), symptom
rules naming the likely catalog codes, a live monitor and a plot.

Torch and matplotlib are optional: ``step_row`` accepts tensors or lists, and the plot imports matplotlib only
when called.
"""

from rlguard.diagnose.log import History, HistoryError, MetricsLogger, read_history
from rlguard.diagnose.metrics import METRICS, step_row
from rlguard.diagnose.monitor import Monitor, SymptomError, SymptomWarning
from rlguard.diagnose.rules import RULES, Report, Symptom, Thresholds, diagnose

__all__ = ["History", "HistoryError", "METRICS", "MetricsLogger", "Monitor", "RULES", "Report", "Symptom",
           "SymptomError", "SymptomWarning", "Thresholds", "diagnose", "read_history", "step_row"]
