"""The pre-commit hook, driven by the real `pre-commit try-repo` against this repository (its working tree,
committed into a scratch clone) in a scratch git repository: it fails and prints the finding on a file with a
seeded bug, passes on a clean one, and honours [tool.rlguard] exclude for staged files."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
PRE_COMMIT = shutil.which("pre-commit") or (shutil.which("pre-commit", path=str(Path(os.sys.executable).parent)))

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(PRE_COMMIT is None, reason="the pre-commit tool is not installed")]


def git(cwd: Path, *args: str) -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.com", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@example.com"}
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True, env=env).stdout


@pytest.fixture(scope="module")
def hook_repo(tmp_path_factory) -> Path:
    """A clone of this repository whose HEAD is the current working tree (tracked and untracked, not ignored)."""
    clone = tmp_path_factory.mktemp("hook-repo")
    files = git(REPO, "ls-files", "-z", "--cached", "--others", "--exclude-standard").split("\0")
    for rel in filter(None, files):
        src = REPO / rel
        if src.is_file():
            (clone / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, clone / rel)
    git(clone, "init", "-q")
    git(clone, "add", "-A")
    git(clone, "commit", "-q", "-m", "snapshot")
    return clone


@pytest.fixture(scope="module")
def scratch(tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("user-repo")
    git(work, "init", "-q")
    (work / "pyproject.toml").write_text('[tool.rlguard]\nexclude = ["fixtures"]\n')
    (work / "buggy.py").write_text("def update(pg_loss, ent_coef, entropy):\n"
                                   "    loss = pg_loss + ent_coef * entropy.mean()\n"
                                   "    loss.backward()\n")
    (work / "clean.py").write_text("def update(pg_loss, ent_coef, entropy):\n"
                                   "    loss = pg_loss - ent_coef * entropy.mean()\n"
                                   "    loss.backward()\n")
    (work / "fixtures").mkdir()
    (work / "fixtures" / "seeded.py").write_text((work / "buggy.py").read_text())
    git(work, "add", "-A")
    return work


def try_repo(hook_repo: Path, work: Path, home: Path, *files: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RLGUARD_DEBUG", "VIRTUAL_ENV", "PYTHONPATH")}
    env["PRE_COMMIT_HOME"] = str(home)
    return subprocess.run([PRE_COMMIT, "try-repo", str(hook_repo), "rlguard-lint", "--files", *files],
                          cwd=work, capture_output=True, text=True, env=env, timeout=600)


def test_hook_definition():
    (hook,) = yaml.safe_load((REPO / ".pre-commit-hooks.yaml").read_text())
    assert hook["id"] == "rlguard-lint" and hook["language"] == "python" and hook["types"] == ["python"]
    assert hook["entry"].split()[:2] == ["rlguard", "lint"]


def test_hook_fails_on_seeded_bug_and_passes_on_clean_file(hook_repo, scratch, tmp_path_factory):
    home = tmp_path_factory.mktemp("pre-commit-home")
    bad = try_repo(hook_repo, scratch, home, "buggy.py")
    out = bad.stdout + bad.stderr
    assert bad.returncode == 1, out
    assert "rlguard lint" in out and "Failed" in out
    assert "buggy.py:2:22: RLG004 [entropy-bonus-sign]" in out
    good = try_repo(hook_repo, scratch, home, "clean.py", "fixtures/seeded.py")  # the env is reused
    out = good.stdout + good.stderr
    assert good.returncode == 0, out
    assert "Passed" in out and "RLG004" not in out
