"""The TRL integration's packaging: the ``[trl]`` extra pins the tested range the code enforces, other TRL
versions are refused with that range named, and neither ``rlguard lint`` nor the core imports TRL."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("trl")

from rlguard.integrations.trl import _version  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.trl


def _pyproject() -> dict:
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_the_extra_pins_the_range_the_code_enforces():
    project = _pyproject()
    trl_req = [r for r in project["project"]["optional-dependencies"]["trl"] if r.startswith("trl")]
    assert trl_req == [f"trl{_version.SUPPORTED_TRL}"]
    peft_req = [r for r in project["project"]["optional-dependencies"]["trl"] if r.startswith("peft")]
    assert peft_req == [f"peft{_version.SUPPORTED_PEFT}"]
    setuptools = project["tool"]["setuptools"]
    assert {"rlguard.integrations", "rlguard.integrations.trl"} <= set(setuptools["packages"])
    assert setuptools["package-dir"]["rlguard.integrations"] == "integrations"


@pytest.mark.parametrize("version, ok", [("1.16.0", True), ("1.16.3", True), ("1.16.0.dev0", True),
                                         ("1.15.9", False), ("1.17.0", False), ("1.17.0rc1", False),
                                         ("2.0", False), ("0.29.1", False)])
def test_supported_versions(version, ok):
    assert _version.supported(version) is ok


def test_other_trl_versions_are_refused_naming_the_range(monkeypatch):
    monkeypatch.setattr(_version.metadata, "version", lambda name: "1.14.2")
    with pytest.raises(_version.UnsupportedTRLError) as exc:
        _version.require_supported_trl()
    message = str(exc.value)
    assert "TRL >=1.16,<1.17" in message and "TRL 1.14.2 is installed" in message
    assert "pip install 'rlguard[trl]'" in message

    def absent(name):
        raise _version.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(_version.metadata, "version", absent)
    with pytest.raises(ImportError, match=r"needs TRL >=1.16,<1.17, which is not installed"):
        _version.require_supported_trl()


def test_another_peft_version_is_named_only_for_a_peft_trainer(monkeypatch):
    assert _version.unsupported_peft() is None  # the installed one is in the tested range
    monkeypatch.setattr(_version.metadata, "version", lambda name: "0.16.0")
    message = _version.unsupported_peft()
    assert "PEFT 0.16.0" in message and f"tested with PEFT {_version.SUPPORTED_PEFT}" in message
    assert not _version.supported("0.22.0", _version.SUPPORTED_PEFT) and _version.supported("0.18.1",
                                                                                             _version.SUPPORTED_PEFT)


def test_an_unsupported_trl_fails_rlguard_check_trl_with_the_range(tmp_path):
    """A fake ``trl`` 1.0 distribution ahead on the path: the CLI names the range and exits 2, never imports it."""
    dist = tmp_path / "site"
    (dist / "trl").mkdir(parents=True)
    (dist / "trl" / "__init__.py").write_text("raise RuntimeError('an unsupported TRL was imported')\n")
    (dist / "trl-1.0.0.dist-info").mkdir()
    (dist / "trl-1.0.0.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: trl\nVersion: 1.0.0\n")
    code = ("import sys; sys.path.insert(0, sys.argv[1]); from rlguard.preflight.cli import check_main; "
            "sys.exit(check_main(['--trl', 'whatever:make_trainer', '-q']))")
    proc = subprocess.run([sys.executable, "-c", code, str(dist)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "supports TRL >=1.16,<1.17; TRL 1.0.0 is installed" in proc.stderr
    assert "unsupported TRL was imported" not in proc.stderr


def test_lint_and_the_core_never_import_trl(tmp_path):
    (tmp_path / "bug.py").write_text("loss = pg_loss + ent_coef * entropy.mean(); loss.backward()\n")
    probe = (
        "import sys\n"
        "import rlguard, rlguard.catalog, rlguard.cli, rlguard.lint.cli\n"
        "from rlguard.cli import main\n"
        "code = main(['lint', '--no-cache', sys.argv[1]])\n"
        "import rlguard.preflight.cli, rlguard.diagnose\n"
        "heavy = sorted(m for m in ('trl', 'transformers', 'accelerate', 'datasets') if m in sys.modules)\n"
        "assert not heavy, f'imported: {heavy}'\n"
        "assert code == 1, code\n"
        "print('probe ok')\n")
    proc = subprocess.run([sys.executable, "-c", probe, str(tmp_path / "bug.py")], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip().endswith("probe ok")
