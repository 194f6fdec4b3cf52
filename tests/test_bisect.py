"""`git bisect run rlguard check ...` names the commit that introduced a fault into the example trainer."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "trl_style_grpo.py"

# (message, edit of the trainer's source); the fourth commit flips the surrogate's sign.
HISTORY = [
    ("initial trainer", None),
    ("document the accumulation", ("    def accumulate(self, inputs, rows):\n",
                                   "    def accumulate(self, inputs, rows):  # no optimizer step here\n")),
    ("raise the default beta", ("    beta: float = 0.04", "    beta: float = 0.05")),
    ("simplify the surrogate", ("per_token_loss = -torch.min(coef_1 * advantages, coef_2 * advantages)",
                                "per_token_loss = torch.max(-coef_1 * advantages, -coef_2 * advantages) * -1")),
    ("log the reward mean", ("reward=float(inputs[\"rewards\"].mean())", "reward=inputs[\"rewards\"].mean().item()")),
    ("rename a local", ("        ratios = []\n        n = len(", "        ratios = []  # per minibatch\n        n = len(")),
]
BAD = 3


def git(repo, *args):
    env = dict(os.environ, GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@example.com", GIT_COMMITTER_NAME="t",
               GIT_COMMITTER_EMAIL="t@example.com")
    return subprocess.run(["git", *args], cwd=repo, env=env, capture_output=True, text=True, check=True).stdout


@pytest.mark.slow
def test_git_bisect_run_names_the_faulty_commit(tmp_path):
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    repo = tmp_path / "repo"
    repo.mkdir()
    git(repo, "init", "-q")
    target = repo / "example_trainer.py"
    source = EXAMPLE.read_text()
    commits = []
    for message, edit in HISTORY:
        if edit is not None:
            old, new = edit
            assert old in source, message
            source = source.replace(old, new)
        target.write_text(source)
        git(repo, "add", "example_trainer.py")
        git(repo, "commit", "-q", "-m", message)
        commits.append(git(repo, "rev-parse", "HEAD").strip())
    git(repo, "bisect", "start", commits[-1], commits[0])
    rlguard = [sys.executable, "-m", "rlguard", "check", "example_trainer:adapter", "-q"]
    env = dict(os.environ, PYTHONPATH=str(repo))
    run = subprocess.run(["git", "bisect", "run", *rlguard], cwd=repo, env=env, capture_output=True, text=True,
                         timeout=600)
    assert f"{commits[BAD]} is the first bad commit" in run.stdout, run.stdout + run.stderr
    assert HISTORY[BAD][0] in run.stdout
