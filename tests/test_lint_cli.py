"""`rlguard lint` and `rlguard rule` end to end: output lines and summary, exit codes, broken files,
internal errors, noqa, usage errors. Runs the CLI in-process (same code path as the console script) in a
scratch project with its own pyproject.toml, so the repository's config never leaks in."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from rlguard.cli import main

ENTROPY_BUG = "loss = pg_loss + ent_coef * entropy.mean(); loss.backward()\n"
KL_BUG = "loss = pg_loss - kl_coef * kl; loss.backward()\n"
CLEAN = "loss = pg_loss - ent_coef * entropy.mean(); loss.backward()\n"


@pytest.fixture
def project(tmp_path, monkeypatch):
    """An empty project (pyproject.toml with an empty [tool.rlguard]) as the current directory."""
    (tmp_path / "pyproject.toml").write_text("[tool.rlguard]\npreview = true\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("RLGUARD_DEBUG", raising=False)
    return tmp_path


def write(root: Path, rel: str, text: str | bytes) -> Path:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(textwrap.dedent(text))
    return path


def lint(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["lint", "--no-cache", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_findings_sorted_by_path_and_position_with_summary(project, capsys):
    write(project, "b.py", "x = 1\n" + ENTROPY_BUG)
    write(project, "a.py", KL_BUG + "y = 2\n" + ENTROPY_BUG)
    write(project, "c.py", CLEAN)
    code, out, _ = lint(capsys)
    lines = out.splitlines()
    assert code == 1
    assert lines[0].startswith("a.py:1:") and " RLG011 [kl-sign] " in lines[0]
    assert lines[1].startswith("a.py:3:18: RLG004 [entropy-bonus-sign] entropy is added")
    assert lines[2].startswith("b.py:2:18: RLG004 [entropy-bonus-sign] ")
    assert lines[3] == "Found 3 findings in 2 of 3 files (RLG004: 2, RLG011: 1)"
    assert len(lines) == 4


def test_clean_tree_exits_zero(project, capsys):
    write(project, "ok.py", CLEAN)
    write(project, "pkg/also_ok.py", "import torch\n")
    code, out, _ = lint(capsys, ".")
    assert code == 0
    assert out == "All checks passed: 2 files, no findings\n"


def test_default_path_is_cwd_and_skips_venvs_build_vcs_and_caches(project, capsys):
    write(project, "src/real.py", ENTROPY_BUG)
    for folder in (".git", ".venv", "venv", "build", "dist", "__pycache__", ".tox", "x.egg-info",
                   "node_modules", ".rlguard_cache", ".mypy_cache", ".pytest_cache"):
        write(project, f"{folder}/bad.py", ENTROPY_BUG)
    write(project, "myenv/pyvenv.cfg", "home = /usr\n")
    write(project, "myenv/lib/bad.py", ENTROPY_BUG)
    code, out, _ = lint(capsys)
    assert code == 1
    assert out.splitlines()[0].startswith("src/real.py:1:18: RLG004")
    assert out.splitlines()[-1] == "Found 1 finding in 1 of 1 files (RLG004: 1)"


def test_explicit_file_in_skipped_folder_is_linted(project, capsys):
    write(project, "build/gen.py", ENTROPY_BUG)
    code, out, _ = lint(capsys, "build/gen.py")
    assert code == 1 and out.startswith("build/gen.py:1:18: RLG004")


def test_syntax_error_is_a_finding_and_other_files_still_lint(project, capsys):
    write(project, "broken.py", "def f(x:\n    return x\n")
    write(project, "bug.py", ENTROPY_BUG)
    write(project, "nul.py", b"x = 1\x00\n")
    code, out, err = lint(capsys)
    assert code == 1 and "Traceback" not in out + err
    lines = out.splitlines()
    assert lines[0].startswith("broken.py:1:6: RLG900 [syntax-error] syntax error: ")
    assert lines[1].startswith("bug.py:1:18: RLG004")
    assert lines[2].startswith("nul.py:1:1: RLG900 [syntax-error] ")
    assert lines[3] == "Found 3 findings in 3 of 3 files (RLG004: 1, RLG900: 2)"


def test_syntax_error_position_points_at_the_error(project, capsys):
    write(project, "late.py", "a = 1\nb = 2\nc = (3 +\n")
    write(project, "indent.py", "def f():\nreturn 1\n")
    code, out, _ = lint(capsys)
    assert code == 1
    assert "indent.py:2:1: RLG900 [syntax-error] syntax error: expected an indented block" in out
    assert "late.py:3:5: RLG900 [syntax-error] syntax error: " in out


def test_not_utf8_and_unreadable_files(project, capsys):
    write(project, "latin.py", "x = 1\ny = 'caf\xe9'\n".encode("latin-1"))
    os.symlink(project / "missing-target.py", project / "dangling.py")
    code, out, err = lint(capsys)
    assert code == 1 and "Traceback" not in err
    assert "dangling.py:1:1: RLG900 [syntax-error] cannot read file: No such file or directory" in out
    assert "latin.py:2:9: RLG900 [syntax-error] not UTF-8: byte 0xe9 at offset 14" in out


def test_noqa_codes_bare_and_other_code(project, capsys):
    write(project, "t.py", f"""\
        loss = pg_loss + ent_coef * entropy.mean(); loss.backward()  # noqa: RLG004
        loss = pg_loss + ent_coef * entropy.mean(); loss.backward()  # noqa: RLG011, RLG004
        loss = pg_loss + ent_coef * entropy.mean(); loss.backward()  # noqa
        loss = pg_loss + ent_coef * entropy.mean(); loss.backward()  # noqa: RLG011
        """)
    code, out, _ = lint(capsys)
    assert code == 1
    assert out.splitlines() == [
        out.splitlines()[0],
        "Found 1 finding in 1 of 1 files (RLG004: 1); 3 suppressed by noqa",
    ]
    assert out.startswith("t.py:4:18: RLG004")
    code, out, _ = lint(capsys, "--show-suppressed")
    suppressed = [line for line in out.splitlines() if line.endswith("(suppressed by noqa)")]
    assert [line.split(":")[1] for line in suppressed] == ["1", "2", "3"]


def test_all_suppressed_exits_zero_and_says_so(project, capsys):
    write(project, "t.py", ENTROPY_BUG.rstrip() + "  # noqa: RLG004\n")
    code, out, _ = lint(capsys)
    assert code == 0
    assert out == "All checks passed: 1 file, no findings; 1 suppressed by noqa\n"


def test_internal_error_in_a_rule_names_file_rule_and_exception(project, capsys, monkeypatch):
    from rlguard.lint.rules.rlg004_entropy_bonus_sign import EntropyBonusSign

    def boom(self, ctx):
        raise KeyError("oops")
        yield  # pragma: no cover

    monkeypatch.setattr(EntropyBonusSign, "check", boom)
    write(project, "a.py", ENTROPY_BUG)
    write(project, "b.py", KL_BUG)
    code, out, err = lint(capsys)
    assert code == 2
    assert "b.py:1:" in out and "RLG011" in out  # the other rules and files still ran
    assert "internal error on a.py: rule RLG004 raised KeyError: 'oops'" in err
    assert "Traceback" not in err
    monkeypatch.setenv("RLGUARD_DEBUG", "1")
    code, _, err = lint(capsys)
    assert code == 2 and "Traceback" in err and "boom" in err


def test_usage_errors_exit_2(project, capsys):
    assert lint(capsys, "--format", "xml")[0] == 2
    code, _, err = lint(capsys, "no/such/file.py")
    assert code == 2 and "no such file or directory: no/such/file.py" in err
    code, _, err = lint(capsys, "--select", "RLG042")
    assert code == 2 and "'RLG042'" in err
    assert lint(capsys, "--jobs", "-1")[0] == 2
    assert main(["lint", "--help"]) == 0


def test_exit_zero_and_output_file(project, capsys):
    write(project, "bug.py", ENTROPY_BUG)
    code, out, _ = lint(capsys, "--exit-zero", "--output-file", "report.txt")
    assert code == 0 and out == ""
    assert (project / "report.txt").read_text().startswith("bug.py:1:18: RLG004")


def test_rule_prints_the_docs_page(capsys):
    assert main(["rule", "RLG004"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("# RLG004 entropy-bonus-sign\n")
    for heading in ("## What it flags", "## Why it is wrong", "## Fix", "## Runtime counterpart", "## Suppression"):
        assert heading in out
    assert main(["rule", "entropy-bonus-sign"]) == 0
    assert capsys.readouterr().out == out
    assert main(["rule", "RLG999"]) == 2
    assert "unknown rlguard code" in capsys.readouterr().err
    assert main(["rule"]) == 2


def test_rule_list_has_every_catalog_code(capsys):
    from rlguard.catalog import CODES
    from rlguard.lint import all_rules

    assert main(["rule", "--list"]) == 0
    rows = capsys.readouterr().out.splitlines()
    assert rows[0].split() == ["CODE", "NAME", "STATIC", "STATUS", "FIX"]
    by_code = {row.split()[0]: row.split() for row in rows[1:]}
    assert list(by_code) == list(CODES)
    rules = all_rules()
    for code, entry in CODES.items():
        assert by_code[code][1] == entry.name
        if code in rules:
            expected = "preview" if rules[code].preview else (
                "stable/preview" if rules[code].PREVIEW_PARTS else "stable")
            assert expected in by_code[code]
    assert by_code["RLG004"][2] == "yes" and by_code["RLG004"][-1] == "fix"
    assert by_code["RLG014"][2:] == ["no", "(runtime)", "-"]
    for code in all_rules():
        assert by_code[code][2] != "no", code


def test_console_script_and_module_entry_point(tmp_path):
    (tmp_path / "pyproject.toml").write_text("[tool.rlguard]\npreview = true\n")
    (tmp_path / "bug.py").write_text(ENTROPY_BUG)
    env = {k: v for k, v in os.environ.items() if k != "RLGUARD_DEBUG"}
    proc = subprocess.run([sys.executable, "-m", "rlguard", "lint", "--no-cache", "bug.py"], cwd=tmp_path,
                          capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 1, proc.stderr
    assert proc.stdout.startswith("bug.py:1:18: RLG004 [entropy-bonus-sign] ")
    # the linter never imports torch (it runs in pre-commit's torch-free environment)
    probe = ("import sys, rlguard.cli as c; rc = c.main(['lint', '--no-cache', 'bug.py']); "
             "assert 'torch' not in sys.modules, 'torch imported'; print('rc', rc)")
    proc = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, env=env,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().endswith("rc 1")


def test_lint_paths_api(project):
    from rlguard.lint import lint_paths

    write(project, "a.py", ENTROPY_BUG + KL_BUG)
    findings = lint_paths([project / "a.py"], cache=False)
    assert [f.code for f in findings] == ["RLG004", "RLG011"]
    assert [f.code for f in lint_paths(["a.py"], select=["RLG011"], cache=False)] == ["RLG011"]
    assert lint_paths(["a.py"], ignore=["RLG0"], cache=False) == []
