"""The distribution: a wheel and an editable install into fresh virtualenvs without torch give a working
`rlguard lint`, never import torch for linting, install only under `rlguard/` (no top-level `lint` or
`contracts` module), and report the version."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow

BUG = "loss = pg_loss + ent_coef * entropy.mean(); loss.backward()\n"
PROBE = ("import sys, importlib.util, rlguard.lint, rlguard.lint.cli, rlguard.lint.runner; "
         "assert 'torch' not in sys.modules, 'rlguard.lint imported torch'; "
         "assert importlib.util.find_spec('torch') is None, 'torch is installed here'; "
         "bare = [m for m in ('lint', 'contracts', 'preflight', 'reference', 'diagnose', 'integrations') "
         "if importlib.util.find_spec(m) is not None]; "
         "assert not bare, f'top-level modules importable: {bare}'; print('probe ok')")


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME",
                                                            "RLGUARD_DEBUG")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


def sh(*args, cwd=None, check=True, timeout=300) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(a) for a in args], cwd=cwd, capture_output=True, text=True, env=_env(),
                          timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{args} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """A copy of the working tree (tracked and untracked, not ignored): builds never touch the repository."""
    copy = tmp_path_factory.mktemp("src")
    listing = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                             capture_output=True, text=True, check=True).stdout
    for rel in filter(None, listing.split("\0")):
        if (REPO / rel).is_file():
            (copy / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / rel, copy / rel)
    return copy


def venv(where: Path) -> Path:
    # no --system-site-packages: this venv has no torch; no pip of its own either (ensurepip is slow): the test
    # environment's pip installs into it with --python
    sh(sys.executable, "-m", "venv", "--without-pip", where)
    return where / "bin"


def pip_install(bin_dir: Path, *args) -> None:
    sh(sys.executable, "-m", "pip", "--python", bin_dir / "python", "install", "-q", *args)


def check_install(bin_dir: Path, work: Path) -> None:
    (work / "bug.py").write_text(BUG)
    version = sh(bin_dir / "rlguard", "--version", cwd=work)
    assert version.stdout.strip() == "rlguard 0.1.0"
    lint = sh(bin_dir / "rlguard", "lint", "--no-cache", "bug.py", cwd=work, check=False)
    assert lint.returncode == 1, lint.stderr
    assert lint.stdout.startswith("bug.py:1:18: RLG004 [entropy-bonus-sign] ")
    assert sh(bin_dir / "python", "-c", PROBE, cwd=work).stdout.strip() == "probe ok"
    for bare in ("lint", "contracts"):
        proc = sh(bin_dir / "python", "-c", f"import {bare}", cwd=work, check=False)
        assert proc.returncode != 0 and "ModuleNotFoundError" in proc.stderr


def test_wheel_installs_only_rlguard_and_lints_without_torch(source, tmp_path):
    dist = tmp_path / "dist"
    sh(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", dist, source)
    (wheel,) = dist.glob("rlguard-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    outside = [n for n in names if not (n.startswith("rlguard/") or n.startswith("rlguard-0.1.0.dist-info/"))]
    assert outside == []
    for expected in ("rlguard/lint/cli.py", "rlguard/lint/rules/rlg004_entropy_bonus_sign.py",
                     "rlguard/rule_docs.py", "rlguard/catalog.py", "rlguard/integrations/trl/preflight.py"):
        assert expected in names
    bin_dir = venv(tmp_path / "venv")
    pip_install(bin_dir, wheel)
    work = tmp_path / "work"
    work.mkdir()
    check_install(bin_dir, work)


def test_editable_install(source, tmp_path):
    bin_dir = venv(tmp_path / "venv")
    pip_install(bin_dir, "-e", source)
    work = tmp_path / "work"
    work.mkdir()
    check_install(bin_dir, work)
    # editable: a change in the source tree shows without reinstalling
    rule_docs = source / "rlguard" / "rule_docs.py"
    rule_docs.write_text(rule_docs.read_text() + "\nEDITABLE_MARK = 1\n")
    sh(bin_dir / "python", "-c", "import rlguard.rule_docs as r; assert r.EDITABLE_MARK == 1", cwd=work)
