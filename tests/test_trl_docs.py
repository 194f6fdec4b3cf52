"""docs/trl.md's complete example runs as written (on the tests' tiny model standing in for MODEL): the preflight
command gives the report the page shows, and training with the callback writes a log `rlguard diagnose` reads."""

from __future__ import annotations

import re
import sys
import warnings
from pathlib import Path

import pytest

pytest.importorskip("trl")
pytest.importorskip("torch")

import trl_helpers as h  # noqa: E402

from rlguard.diagnose import read_history  # noqa: E402
from rlguard.preflight.cli import check_main  # noqa: E402

pytestmark = pytest.mark.trl
DOC = Path(__file__).resolve().parents[1] / "docs" / "trl.md"
# The tiny stand-in moves too little at the example's lr 1e-6 for kl_positive to see it above float32 noise (a
# real model's first step does): the test runs the example's trainer at the tests' lr.
STAND_IN = """
import my_grpo


def make_trainer():
    trainer = my_grpo.make_trainer()
    trainer.args.learning_rate = 1e-2
    return trainer
"""


def _blocks(kind: str) -> list[str]:
    return re.findall(rf"```{kind}\n(.*?)```", DOC.read_text(), flags=re.S)


def _columns(table: str) -> list[tuple[str, ...]]:
    """(check, tolerance, status, code) of each row of a report table (not the measured values), and the
    summary line."""
    from rlguard.preflight.checks import CHECKS

    rows = []
    for line in table.strip().splitlines():
        cells = line.split()
        if cells and cells[0] in CHECKS:
            at = next(i for i, cell in enumerate(cells[2:], 2) if cell in ("ok", "skip", "FAIL"))
            rows.append((cells[0], " ".join(cells[2:at]), cells[at], cells[at + 1]))
        elif "passed" in line or "failed" in line:
            rows.append((line.strip(),))
    return rows


@pytest.fixture()
def example(tmp_path, monkeypatch):
    (python,) = [b for b in _blocks("python") if "def make_trainer" in b and "__main__" in b]
    (tmp_path / "my_grpo.py").write_text(python)
    (tmp_path / "tiny_stand_in.py").write_text(STAND_IN)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("MODEL", h.model_dir())
    for name in ("my_grpo", "tiny_stand_in"):
        sys.modules.pop(name, None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield tmp_path


def test_the_preflight_command_prints_the_report_the_page_shows(example, capsys):
    assert check_main(["--trl", "tiny_stand_in:make_trainer", "-q"]) == 0
    printed = capsys.readouterr().out
    (shown,) = [b for b in _blocks("console") if b.startswith("$ rlguard check --trl my_grpo:make_trainer")]
    shown = shown.split("\n", 1)[1]
    assert _columns(printed) == _columns(shown)
    from rlguard.preflight.checks import CHECKS

    assert len(_columns(printed)) == len(CHECKS) + 1


def test_training_with_the_callback_writes_a_log_rlguard_diagnose_reads(example):
    import tiny_stand_in

    from rlguard.integrations.trl import RlguardCallback

    trainer = tiny_stand_in.make_trainer()
    trainer.args.max_steps = 3
    callback = RlguardCallback.attach(trainer, mode="raise", log_path="grpo-out/rlguard.jsonl")
    trainer.train()
    callback.close()
    history = read_history(example / "grpo-out" / "rlguard.jsonl")
    assert [row["step"] for row in history] == [1, 2, 3]
    assert {"reward", "kl_ref", "clip_frac", "ratio_max", "kl_coef"} <= set(history[-1])
