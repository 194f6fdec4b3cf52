"""pytest plugin (registered through the ``pytest11`` entry point ``rlguard``): preflight as an ordinary test.

Fixture::

    def test_trainer_preflight(rlguard_check):
        rlguard_check("mytrainer.adapters:adapter")       # or an adapter object; fails with the report

Marker (the test body runs after the suite passed)::

    @pytest.mark.rlguard_preflight("mytrainer.adapters:adapter", only=["ratio_one", "group_mean"])
    def test_preflight():
        pass

torch is imported only when a test uses the fixture or the marker.
"""

from __future__ import annotations

import pytest


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "rlguard_preflight(adapter, only=None, seed=0): run rlguard's preflight suite on the adapter "
                   "(module:attr or object) before the test; fail with the report if a check fails")


def _run(adapter, only=None, seed: int = 0):
    import torch

    torch.set_num_threads(1)
    from rlguard.preflight.adapter import load_adapter
    from rlguard.preflight.report import table
    from rlguard.preflight.suite import run_suite

    if isinstance(adapter, str):
        adapter = load_adapter(adapter)
    report = run_suite(adapter, seed=seed, only=only)
    if not report.passed:
        pytest.fail(f"rlguard preflight failed: {', '.join(report.failed)}\n\n{table(report)}", pytrace=False)
    return report


@pytest.fixture
def rlguard_check():
    """``rlguard_check(adapter, only=None, seed=0) -> Report``; fails the test when a check fails."""
    return _run


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_call(item):
    """A test marked ``rlguard_preflight`` fails (as a test failure, not a setup error) when a check fails."""
    marker = item.get_closest_marker("rlguard_preflight")
    if marker is not None:
        adapter = marker.args[0] if marker.args else marker.kwargs["adapter"]
        _run(adapter, only=marker.kwargs.get("only"), seed=marker.kwargs.get("seed", 0))
