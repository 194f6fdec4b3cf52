"""The .rlguard_cache/: hits on an unchanged tree, misses when the file, the config or the linter changes,
self-ignoring layout, survival of corrupted entries and of two processes linting at once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlguard.lint import cache as cache_mod
from rlguard.lint.config import Layer, load_config
from rlguard.lint.runner import run

ENTROPY_BUG = "loss = pg_loss + ent_coef * entropy.mean(); loss.backward()\n"
SUPPRESSED = "loss = pg_loss + ent_coef * entropy.mean(); loss.backward()  # noqa: RLG004\n"


@pytest.fixture
def project(tmp_path, monkeypatch):
    (tmp_path / "pyproject.toml").write_text("[tool.rlguard]\n")
    for i in range(5):
        (tmp_path / f"m{i}.py").write_text(f"x{i} = {i}\n")
    (tmp_path / "bug.py").write_text(ENTROPY_BUG)
    (tmp_path / "quiet.py").write_text(SUPPRESSED)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def lint(select=None, **kwargs):
    config = load_config(["."], cli=Layer(select=tuple(select) if select else None))
    return run(["."], config, **kwargs)


def entries(root: Path) -> list[Path]:
    return sorted((root / ".rlguard_cache").rglob("*.json"))


def test_second_run_comes_from_the_cache_with_the_same_result(project):
    cold = lint()
    assert cold.cache_hits == 0 and len(entries(project)) == 7
    warm = lint()
    assert warm.cache_hits == 7
    assert warm.findings == cold.findings and warm.suppressed == cold.suppressed and len(warm.suppressed) == 1
    assert [f.code for f in warm.findings] == ["RLG004"]


def test_cache_folder_ignores_itself(project):
    lint()
    folder = project / ".rlguard_cache"
    assert (folder / ".gitignore").read_text().splitlines()[-1] == "*"
    assert (folder / "CACHEDIR.TAG").read_text().startswith("Signature: 8a477f597d28d172789f06886806bc55")
    subprocess.run(["git", "init", "-q"], cwd=project, check=True)
    status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=project,
                            capture_output=True, text=True, check=True).stdout
    assert ".rlguard_cache" not in status and "bug.py" in status


def test_no_cache_neither_reads_nor_writes(project):
    report = lint(cache=False)
    assert report.cache_hits == 0 and not (project / ".rlguard_cache").exists()


def test_changed_file_config_or_linter_is_a_miss(project, monkeypatch):
    lint()
    (project / "bug.py").write_text("y = 0\n" + ENTROPY_BUG)
    report = lint()
    assert report.cache_hits == 6 and report.findings[0].line == 2
    report = lint(select=["RLG004"])  # another effective config: other keys
    assert report.cache_hits == 0
    assert lint(select=["RLG004"]).cache_hits == 7
    monkeypatch.setattr(cache_mod, "rules_fingerprint", lambda: "edited rule")  # a rule's source changed
    assert lint().cache_hits == 0


def test_rules_fingerprint_covers_rule_sources():
    sources = {p.name for p in (Path(cache_mod.__file__).parent / "rules").glob("rlg0*.py")}
    assert sources, "no rule modules found"
    lint_dir = Path(cache_mod.__file__).parent
    missing = [name for name in cache_mod._FINDING_SOURCES if not (lint_dir / name).is_file()]
    assert missing == [], "a module that decides findings was renamed: update cache._FINDING_SOURCES"
    cache_mod.rules_fingerprint.cache_clear()
    assert len(cache_mod.rules_fingerprint()) == 64


@pytest.mark.parametrize("garbage", [b"", b"\x00\xff garbage", b"{}", b"[1, 2]", b'{"key": 1}',
                                     b"not json at all {{{"])
def test_corrupted_entries_are_misses(project, garbage):
    cold = lint()
    for entry in entries(project):
        entry.write_bytes(garbage)
    again = lint()
    assert again.cache_hits == 0
    assert again.findings == cold.findings and again.suppressed == cold.suppressed
    assert lint().cache_hits == 7  # rewritten


def test_wrong_shaped_entry_with_the_right_key_is_a_miss(project):
    lint()
    for entry in entries(project):
        data = json.loads(entry.read_bytes())
        data["findings"] = [["x"] * 9]
        entry.write_text(json.dumps(data))
    report = lint()
    assert report.cache_hits == 0 and [f.code for f in report.findings] == ["RLG004"]


def test_unwritable_cache_folder_does_not_fail(project):
    (project / ".rlguard_cache").write_text("a file where the folder should be")
    report = lint()
    assert [f.code for f in report.findings] == ["RLG004"]


def test_two_processes_at_once(project):
    for i in range(40):
        (project / f"n{i}.py").write_text(f"loss = a + c * entropy_{i}; loss.backward()\n" if i % 3 == 0 else f"z = {i}\n")
    cmd = [sys.executable, "-m", "rlguard", "lint", "--format", "json", "--jobs", "1", "."]
    env = {k: v for k, v in os.environ.items() if k != "RLGUARD_DEBUG"}
    procs = [subprocess.Popen(cmd, cwd=project, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
             for _ in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [1, 1], [o[1] for o in outs]
    first, second = (json.loads(o[0]) for o in outs)
    assert first == second and len(first) == 1 + 14
    leftovers = [p for p in (project / ".rlguard_cache").rglob("*") if p.name.startswith(".tmp-")]
    assert leftovers == []
    warm = subprocess.run([*cmd, "--verbose"], cwd=project, capture_output=True, text=True, env=env, timeout=120)
    assert json.loads(warm.stdout) == first
    assert "47 files, 47 from the cache" in warm.stderr
