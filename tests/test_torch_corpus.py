"""Real-code check: every .py file of the installed torch package lints without an internal error and with no
RLG finding (torch is not an RL trainer, so any finding there is almost surely a false positive). Files torch
ships that do not parse on this Python (RLG900) are allowed and listed."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

from rlguard.lint.config import Layer, load_config
from rlguard.lint.runner import run

SPEC = importlib.util.find_spec("torch")  # located, not imported: the sweep never needs torch itself

pytestmark = [pytest.mark.slow, pytest.mark.skipif(SPEC is None or not SPEC.origin, reason="torch is not installed")]


def test_torch_package_has_no_findings_and_no_internal_errors():
    root = Path(SPEC.origin).parent
    config = load_config([root], cli=Layer(select=("ALL",)), isolated=True)
    report = run([root], config, jobs=2, cache=False)
    assert report.files_checked > 1000
    unparsable = [f"{f.path}:{f.line}: {f.message}" for f in report.findings if f.code == "RLG900"]
    print(f"{report.files_checked} torch files; {len(unparsable)} do not parse on this Python:", *unparsable,
          sep="\n  ")
    assert not report.errors, "\n".join(e.describe() for e in report.errors)
    false_positives = [f"{Path(os.path.abspath(f.path)).relative_to(root)}:{f.line}: {f.code} {f.message}"
                       for f in report.findings if f.code != "RLG900"]
    assert not false_positives, "findings on torch (false positives):\n" + "\n".join(false_positives)
