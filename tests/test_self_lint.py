"""rlguard lints its own repository clean: the trainers, contracts and tests in it are correct code (files with
deliberate bugs are excluded in pyproject.toml or carry a `# noqa` naming why)."""

from pathlib import Path

from rlguard.lint.runner import lint_report

ROOT = Path(__file__).resolve().parents[1]


def test_repository_is_lint_clean(monkeypatch):
    monkeypatch.chdir(ROOT)
    report = lint_report(["."], cache=False, jobs=1)
    assert not report.errors
    assert [f"{f.path}:{f.line}: {f.code} {f.message}" for f in report.findings] == []
    assert report.files_checked > 50
