"""`rlguard lint` on valid but unusual input never loses a file or a finding (issue 11): deep nesting and long
chains, rules that fail, FIFOs, code for a newer Python than the one running, PEP 263 coding lines, noqa text
inside strings, selections that run nothing, user errors, and `demo`/`check` without torch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from test_lint_cli import ENTROPY_BUG, KL_BUG, lint, project  # noqa: F401 - project is a fixture


# ----- deep code ---------------------------------------------------------------------------------------------------
DEEP = {
    "calls150.py": "x = " + "f(" * 150 + "1" + ")" * 150 + "\n",
    "lists150.py": "x = " + "[" * 150 + "1" + "]" * 150 + "\n",
    "terms400.py": "x = " + " + ".join(f"a{i}" for i in range(400)) + "\n",
    "chain200.py": "x = y" + ".f()" * 200 + "\n",
    "elif400.py": "if a == 0:\n    pass\n" + "".join(f"elif a == {i}:\n    pass\n" for i in range(1, 400)),
    # from about 500 branches the former error handler recursed too and the whole run aborted
    "elif1500.py": "if a == 0:\n    pass\n" + "".join(f"elif a == {i}:\n    pass\n" for i in range(1, 1500)),
}


@pytest.mark.parametrize("name", sorted(DEEP))
def test_deep_valid_code_keeps_its_finding(project, capsys, name):
    (project / name).write_text(DEEP[name] + ENTROPY_BUG)
    code, out, err = lint(capsys, name)
    assert code == 1, err
    line = len(DEEP[name].splitlines()) + 1
    assert out.splitlines() == [out.splitlines()[0], "Found 1 finding in 1 of 1 files (RLG004: 1)"]
    assert out.startswith(f"{name}:{line}:18: RLG004 [entropy-bonus-sign]")
    assert "internal error" not in err and "Traceback" not in err


def test_deep_files_beside_normal_ones_all_reported(project, capsys):
    for name, body in DEEP.items():
        (project / name).write_text(ENTROPY_BUG + body)
    (project / "plain.py").write_text(KL_BUG)
    code, out, _ = lint(capsys)
    assert code == 1
    assert out.splitlines()[-1] == f"Found {len(DEEP) + 1} findings in {len(DEEP) + 1} of {len(DEEP) + 1} files " \
                                   f"(RLG004: {len(DEEP)}, RLG011: 1)"


def test_recursion_limit_is_restored_after_linting(project):
    from rlguard.lint import lint_source

    before = sys.getrecursionlimit()
    assert [f.code for f in lint_source(DEEP["elif1500.py"] + ENTROPY_BUG).findings] == ["RLG004"]
    assert sys.getrecursionlimit() == before


# ----- a rule or the engine that fails -------------------------------------------------------------------------------
@pytest.fixture
def recursing_entropy_rule(monkeypatch):
    """RLG004 recursing without end, as a rule would on a tree deeper than it expects."""
    from rlguard.lint.rules.rlg004_entropy_bonus_sign import EntropyBonusSign

    def check(self, ctx, depth=0):
        return check(self, ctx, depth + 1)

    monkeypatch.setattr(EntropyBonusSign, "check", check)


def test_a_rule_that_recurses_loses_only_its_own_findings(project, capsys, recursing_entropy_rule):
    (project / "both.py").write_text(ENTROPY_BUG + KL_BUG)
    (project / "other.py").write_text(KL_BUG)
    code, out, err = lint(capsys)
    assert code == 2
    lines = out.splitlines()
    assert lines[0].startswith("both.py:1:1: RLG902 [internal-error] rlguard failed on this file (rule RLG004 raised "
                               "RecursionError")
    assert "the findings of RLG004 on this file are missing" in lines[0]
    assert lines[1].startswith("both.py:2:") and "RLG011" in lines[1]  # the other rule's finding on that file
    assert lines[2].startswith("other.py:1:") and "RLG011" in lines[2]
    assert lines[3] == ("Found 3 findings in 2 of 2 files (RLG011: 2, RLG902: 1); 1 file not fully checked "
                        "(internal errors)")
    assert "internal error on both.py: rule RLG004 raised RecursionError" in err


def test_a_failed_file_is_never_all_checks_passed(project, capsys, recursing_entropy_rule):
    (project / "only.py").write_text(ENTROPY_BUG)
    code, out, _ = lint(capsys)
    assert code == 2
    assert "passed" not in out
    assert out.splitlines()[-1].startswith("Found 1 finding in 1 of 1 files (RLG902: 1); 1 file not fully checked")


@pytest.mark.parametrize("fmt", ["json", "sarif", "github"])
def test_internal_error_is_a_finding_with_the_path_in_every_format(project, capsys, recursing_entropy_rule, fmt):
    (project / "only.py").write_text(ENTROPY_BUG)
    code, out, _ = lint(capsys, "--format", fmt)
    assert code == 2
    if fmt == "json":
        (item,) = json.loads(out)
        assert (item["path"], item["code"], item["name"]) == ("only.py", "RLG902", "internal-error")
    elif fmt == "sarif":
        run = json.loads(out)["runs"][0]
        (result,) = run["results"]
        assert result["ruleId"] == "RLG902"
        assert result["locations"][0]["physicalLocation"]["artifactLocation"]["uri"] == "only.py"
        assert run["invocations"][0]["executionSuccessful"] is False
    else:
        assert out.startswith("::error file=only.py,line=1,col=1,endLine=1,endColumn=1,title=RLG902 internal-error::")


def test_engine_failure_is_reported_for_the_file(project, capsys, monkeypatch):
    import rlguard.lint.engine as engine

    def broken(*args, **kwargs):
        raise MemoryError("no memory for the index")

    monkeypatch.setattr(engine, "Analysis", broken)
    (project / "a.py").write_text(ENTROPY_BUG)
    (project / "b.py").write_text("x = 1\n")  # no trigger: no analysis, nothing lost
    code, out, _ = lint(capsys)
    assert code == 2
    assert out.splitlines()[0].startswith("a.py:1:1: RLG902 [internal-error] rlguard failed on this file "
                                          "(the engine raised MemoryError: no memory for the index)")
    assert "of 2 files" in out.splitlines()[-1]


def test_internal_errors_cannot_be_ignored(project, capsys):
    (project / "a.py").write_text(ENTROPY_BUG)
    code, _, err = lint(capsys, "--ignore", "RLG902")
    assert code == 2 and "RLG902 (internal-error) cannot be ignored" in err


# ----- only regular files ---------------------------------------------------------------------------------------------
@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs on this platform")
def test_fifo_named_like_python_is_skipped_not_waited_on(tmp_path):
    (tmp_path / "pyproject.toml").write_text("[tool.rlguard]\npreview = true\n")
    (tmp_path / "bug.py").write_text(ENTROPY_BUG)
    os.mkfifo(tmp_path / "x.py")
    env = {k: v for k, v in os.environ.items() if k != "RLGUARD_DEBUG"}
    cmd = [sys.executable, "-m", "rlguard", "lint", "--no-cache"]
    proc = subprocess.run([*cmd, "."], cwd=tmp_path, capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 1, proc.stderr
    assert proc.stdout.splitlines() == [proc.stdout.splitlines()[0],
                                        "Found 1 finding in 1 of 1 files (RLG004: 1); 1 skipped (not regular files)"]
    assert "x.py" not in proc.stdout and proc.stderr == ""
    proc = subprocess.run([*cmd, "-v", "."], cwd=tmp_path, capture_output=True, text=True, env=env, timeout=60)
    assert "rlguard: skipped x.py: not a regular file (a FIFO)" in proc.stderr
    # named on the command line, the note comes without -v
    proc = subprocess.run([*cmd, "x.py"], cwd=tmp_path, capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 0 and "skipped x.py: not a regular file (a FIFO)" in proc.stderr


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs on this platform")
def test_reading_never_blocks_on_a_fifo(tmp_path):
    from rlguard.lint.runner import read_regular_file

    os.mkfifo(tmp_path / "late.py")  # what a file can become between discovery and reading
    assert read_regular_file(tmp_path / "late.py") is None
    (tmp_path / "real.py").write_bytes(b"x = 1\n")
    assert read_regular_file(tmp_path / "real.py") == b"x = 1\n"


# ----- target version -------------------------------------------------------------------------------------------------
PY312 = "def first[T](items: list[T]) -> T:\n    return items[0]\n\ntype Pair = tuple[int, int]\n"


@pytest.mark.parametrize("with_trigger", [True, False])
def test_newer_syntax_is_judged_by_the_target_not_the_running_python(project, capsys, with_trigger):
    """On Python 3.11 (CI) the interpreter rejects 3.12 syntax; the target decides, with or without trigger
    words (the file is syntax-checked even when no rule would run on it)."""
    body = PY312 + (ENTROPY_BUG if with_trigger else "")
    (project / "new.py").write_text(body)
    expected = ["RLG004"] if with_trigger else []
    (project / "pyproject.toml").write_text('[tool.rlguard]\npreview = true\ntarget-version = "py312"\n')
    code, out, _ = lint(capsys, "--format", "json")
    assert [f["code"] for f in json.loads(out)] == expected and code == (1 if with_trigger else 0)
    (project / "pyproject.toml").write_text('[tool.rlguard]\npreview = true\ntarget-version = "py311"\n')
    code, out, _ = lint(capsys, "--format", "json")
    (finding,) = json.loads(out)
    assert (finding["code"], finding["line"]) == ("RLG900", 1) and code == 1
    # the command line overrides the config
    code, out, _ = lint(capsys, "--format", "json", "--target-version", "py312")
    assert [f["code"] for f in json.loads(out)] == expected


def test_older_target_rejects_newer_syntax_on_a_newer_interpreter(project, capsys):
    (project / "m.py").write_text("match command:\n    case 'go':\n        pass\n")
    assert lint(capsys, "--target-version", "py310")[0] == 0
    code, out, _ = lint(capsys, "--target-version", "py39")
    assert code == 1 and out.startswith("m.py:")
    assert "RLG900 [syntax-error] syntax error: Pattern matching is only supported in Python 3.10" in out


def test_target_version_defaults_to_requires_python(project, capsys):
    (project / "new.py").write_text(PY312)
    (project / "pyproject.toml").write_text('[project]\nrequires-python = ">=3.12"\n[tool.rlguard]\npreview = true\n')
    code, _, err = lint(capsys, "-v")
    assert code == 0
    assert "target py312 from pyproject.toml requires-python '>=3.12'" in err
    (project / "pyproject.toml").write_text('[project]\nrequires-python = ">=3.10,<4"\n[tool.rlguard]\npreview = true\n')
    assert lint(capsys)[0] == 1
    # no pyproject says which Python: the newest grammar, so valid code is never a syntax error
    (project / "pyproject.toml").unlink()
    assert lint(capsys, "--isolated", "new.py")[0] == 0


def test_unknown_target_version_is_a_usage_error(project, capsys):
    (project / "pyproject.toml").write_text('[tool.rlguard]\npreview = true\ntarget-version = "3.12"\n')
    code, _, err = lint(capsys)
    assert code == 2 and "unknown target version '3.12'" in err and "py312" in err
    assert lint(capsys, "--isolated", "--target-version", "py29")[0] == 2


# ----- encodings ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("encoding, text", [("latin-1", "café"), ("cp1252", "“quoted” €")])
def test_pep263_coding_line_decodes_as_python_does(project, capsys, encoding, text):
    source = f"# -*- coding: {encoding} -*-\nlabel = '{text}'\n{ENTROPY_BUG}"
    (project / "coded.py").write_bytes(source.encode(encoding))
    code, out, _ = lint(capsys)
    assert code == 1 and out.startswith("coded.py:3:18: RLG004 [entropy-bonus-sign]")
    # --fix writes the file back in its own encoding
    assert lint(capsys, "--fix")[0] == 0
    fixed = (project / "coded.py").read_bytes().decode(encoding)
    assert fixed == source.replace("pg_loss + ent_coef", "pg_loss - ent_coef")


def test_bom_and_bad_coding_lines(project, capsys):
    (project / "bom.py").write_bytes(b"\xef\xbb\xbf" + ENTROPY_BUG.encode())
    (project / "ascii.py").write_bytes(b"# coding: ascii\nx = '\xc3\xa9'\n")
    (project / "unknown.py").write_bytes(b"# coding: no-such-codec\nx = 1\n")
    code, out, _ = lint(capsys)
    assert code == 1
    lines = out.splitlines()
    assert lines[0].startswith("ascii.py:2:6: RLG900 [syntax-error] not valid ascii (its coding line): byte 0xc3")
    assert lines[1].startswith("bom.py:1:18: RLG004")
    assert lines[2].startswith("unknown.py:1:1: RLG900 [syntax-error] cannot decode: unknown encoding")


# ----- noqa -------------------------------------------------------------------------------------------------------------
def test_noqa_in_a_string_does_not_hide_a_finding(project, capsys):
    (project / "s.py").write_text(textwrap.dedent("""\
        note = "# noqa: RLG004"; loss = pg_loss + ent_coef * entropy.mean(); loss.backward()
        doc = '''
        # noqa
        '''; loss = pg_loss + ent_coef * entropy.mean(); loss.backward()
        """))
    code, out, _ = lint(capsys)
    assert code == 1
    assert [line.split(":")[1] for line in out.splitlines()[:-1]] == ["1", "4"]


@pytest.mark.parametrize("comment", ["# noqa: RLG001 RLG004", "# noqa:RLG004", "# noqa: rlg004", "# NOQA:RLG011,RLG004",
                                     "# type: ignore  # noqa: RLG004", "# noqa: RLG004 - the bonus is a penalty here",
                                     "#noqa"])
def test_noqa_spellings_silence(project, capsys, comment):
    (project / "t.py").write_text(f"loss = pg_loss + ent_coef * entropy.mean(); loss.backward()  {comment}\n")
    code, out, _ = lint(capsys)
    assert code == 0 and out == "All checks passed: 1 file, no findings; 1 suppressed by noqa\n"


@pytest.mark.parametrize("comment", ["# noqa: E501", "# noqa: RLG011", "# noqa RLG004 is wrong"])
def test_noqa_for_other_codes_does_not_silence(project, capsys, comment):
    expected = 0 if comment == "# noqa RLG004 is wrong" else 1  # no colon: a bare noqa, as in flake8
    (project / "t.py").write_text(f"loss = pg_loss + ent_coef * entropy.mean(); loss.backward()  {comment}\n")
    assert lint(capsys)[0] == expected


def test_unused_noqa_is_opt_in_and_names_the_codes(project, capsys):
    (project / "t.py").write_text(textwrap.dedent("""\
        loss = pg_loss - ent_coef * entropy.mean(); loss.backward()  # noqa: RLG004
        loss = pg_loss + ent_coef * entropy.mean(); loss.backward()  # noqa: RLG004, RLG011
        x = 1  # noqa: E501
        y = 2  # noqa
        z = 3  # noqa: RLG042, RLG014
        w = 4  # noqa: RLG010, RLG901
        """))
    code, out, _ = lint(capsys)
    assert code == 0  # off by default
    code, out, _ = lint(capsys, "--extend-select", "RLG901")
    assert code == 1
    assert out.splitlines() == [
        "t.py:1:62: RLG901 [unused-noqa] unused noqa: RLG004 (no RLG004 finding on this line); remove it",
        "t.py:2:62: RLG901 [unused-noqa] unused noqa: RLG011 (no RLG011 finding on this line); remove it",
        "t.py:5:8: RLG901 [unused-noqa] unused noqa: RLG014 (checked at run time only, never by lint), "
        "RLG042 (no such code); remove it",
        "Found 3 findings in 1 of 1 files (RLG901: 3); 1 suppressed by noqa",
    ]
    # a code whose rule did not run on the file is left alone: another configuration may need it
    code, out, _ = lint(capsys, "--extend-select", "RLG901", "--ignore", "RLG004")
    assert "unused noqa: RLG004" not in out


def test_add_noqa_writes_comments_that_silence(project, capsys):
    source = ("loss = pg_loss + ent_coef * entropy.mean(); loss.backward()\r\n"
              "loss = pg_loss - kl_coef * kl; loss.backward()  # noqa: E501\r\n"
              "loss = pg_loss + ent_coef * entropy.mean(); loss.backward()  # noqa: RLG011\r\n")
    (project / "t.py").write_bytes(source.encode())
    (project / "u.py").write_text(ENTROPY_BUG)
    code, out, _ = lint(capsys, "--add-noqa=sign checked by hand", "t.py")
    assert code == 0 and out == "Added 3 noqa directives in 1 file\n"
    assert (project / "t.py").read_bytes().decode() == (
        "loss = pg_loss + ent_coef * entropy.mean(); loss.backward()  # noqa: RLG004 - sign checked by hand\r\n"
        "loss = pg_loss - kl_coef * kl; loss.backward()  # noqa: E501, RLG011\r\n"
        "loss = pg_loss + ent_coef * entropy.mean(); loss.backward()  # noqa: RLG004, RLG011\r\n")
    assert lint(capsys, "t.py")[0] == 0
    assert lint(capsys, "--add-noqa", "u.py")[0] == 0  # no reason; the path is not taken for one
    assert (project / "u.py").read_text() == ENTROPY_BUG.rstrip() + "  # noqa: RLG004\n"
    assert lint(capsys, "--add-noqa", "--fix")[0] == 2


@pytest.mark.parametrize("source, expected", [
    ('(pg_loss + ent_coef * entropy.mean(dim="""\n""")).backward()\n',  # line 1 ends inside a string
     '(pg_loss + ent_coef * entropy.mean(dim="""\n""")).backward()  # noqa: RLG004\n'),
    ("(pg_loss + ent_coef * \\\n    entropy.mean()).backward()\n",  # line 1 ends with a backslash
     "(pg_loss + ent_coef * \\\n    entropy.mean()).backward()  # noqa: RLG004\n"),
])
def test_add_noqa_uses_the_last_line_when_the_first_cannot_carry_a_comment(project, capsys, source, expected):
    (project / "t.py").write_text(source)
    assert lint(capsys, "--add-noqa")[0] == 0
    assert (project / "t.py").read_text() == expected
    assert lint(capsys)[0] == 0


# ----- statistics -----------------------------------------------------------------------------------------------------
def test_statistics_text_and_json(project, capsys):
    (project / "a.py").write_text(ENTROPY_BUG + ENTROPY_BUG.replace("loss", "total") + KL_BUG)
    code, out, _ = lint(capsys, "--statistics")
    assert code == 1
    assert out.splitlines() == ["2  RLG004  entropy-bonus-sign  (2 fixable with --fix)",
                                "1  RLG011  kl-sign             (1 fixable with --fix)",
                                "Found 3 findings in 1 of 1 files (RLG004: 2, RLG011: 1)"]
    code, out, _ = lint(capsys, "--statistics", "--format", "json")
    assert json.loads(out) == [{"code": "RLG004", "name": "entropy-bonus-sign", "count": 2, "fixable": 2},
                               {"code": "RLG011", "name": "kl-sign", "count": 1, "fixable": 1}]
    code, _, err = lint(capsys, "--statistics", "--format", "sarif")
    assert code == 2 and "--statistics prints text or json" in err


# ----- selections that run nothing --------------------------------------------------------------------------------------
@pytest.mark.parametrize("args, config, message", [
    (["--select", "RLG014"], "", "command line select RLG014 runs no lint rule: RLG014 (trained-params-drift) is "
                                 "checked at run time only"),
    (["--select", ""], "", "command line select is empty, so no rule would run"),
    ([], "select = []\n", "pyproject.toml [tool.rlguard] select is empty, so no rule would run"),
    (["--select", "RLG004", "--ignore", "RLG004"], "", "RLG004 is removed by command line ignore"),
    (["--select", "RLG901"], "", "RLG901 (unused-noqa) judges the noqa comments of the rules that run"),
])
def test_a_selection_that_runs_no_rule_is_a_usage_error(project, capsys, args, config, message):
    (project / "pyproject.toml").write_text("[tool.rlguard]\npreview = true\n" + config)
    (project / "a.py").write_text(ENTROPY_BUG)
    code, out, err = lint(capsys, *args)
    assert code == 2 and out == ""
    assert message in err and "passed" not in err


def test_syntax_check_alone_is_a_selection(project, capsys):
    (project / "a.py").write_text(ENTROPY_BUG)
    (project / "b.py").write_text("def f(:\n")
    code, out, _ = lint(capsys, "--select", "RLG900")
    assert code == 1 and out.splitlines()[-1] == "Found 1 finding in 1 of 2 files (RLG900: 1)"


# ----- user errors ------------------------------------------------------------------------------------------------------
def test_output_into_a_missing_folder_says_what_to_do(project, capsys):
    (project / "a.py").write_text(ENTROPY_BUG)
    code, out, err = lint(capsys, "-o", "reports/lint.txt")
    assert code == 2 and out == ""
    assert "the folder reports does not exist; create it first" in err and "bug" not in err
    code, _, err = lint(capsys, "-o", ".")
    assert code == 2 and "is a folder" in err and "bug" not in err


def test_non_utf8_pyproject_says_what_to_do(project, capsys):
    (project / "pyproject.toml").write_bytes(b"[tool.rlguard]\npreview = true\n# caf\xe9\n")
    (project / "a.py").write_text(ENTROPY_BUG)
    code, _, err = lint(capsys)
    assert code == 2
    assert "pyproject.toml: not UTF-8 (byte 0xe9 at offset 35); TOML files must be UTF-8" in err
    assert "bug" not in err and "Traceback" not in err


@pytest.mark.parametrize("command", [["demo"], ["check", "my_trainer:adapter"]])
def test_demo_and_check_without_torch_name_the_extra(tmp_path, command):
    probe = ("import sys; sys.modules['torch'] = None  # as if torch were not installed\n"
             f"from rlguard.cli import main; sys.exit(main({command!r}))")
    env = {k: v for k, v in os.environ.items() if k != "RLGUARD_DEBUG"}
    proc = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, env=env,
                          timeout=120)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert f"rlguard {command[0]}: needs torch, which is not installed. Install the [torch] extra" in proc.stderr
    assert "https://download.pytorch.org/whl/cpu" in proc.stderr and 'pip install -e ".[torch]"' in proc.stderr


# ----- positions ---------------------------------------------------------------------------------------------------------
def test_positions_of_flagged_nodes_match_libcsts_provider():
    """The engine records positions for the flagged nodes only; they must equal PositionProvider's."""
    import random

    import libcst as cst
    from libcst.metadata import MetadataWrapper, PositionProvider

    from rlguard.lint.engine import node_positions, run_deep

    corpus = Path(__file__).parent / "lint_corpus"
    source = "\n\n".join(p.read_text(encoding="utf-8") for p in sorted(corpus.rglob("*.py"))[:40])
    source += "\n" + DEEP["elif400.py"] + "@decorator\nclass C:\n    def f(self): return (1,\n  2)\n"
    module = cst.parse_module(source)
    expected = run_deep(lambda: dict(MetadataWrapper(module, unsafe_skip_copy=True).resolve(PositionProvider)))
    nodes = list(expected)
    random.Random(0).shuffle(nodes)
    wanted = nodes[:3000] + [module.body[0], module.body[-1]]
    got = run_deep(node_positions, module, wanted)
    assert {n: got[n] for n in wanted} == {n: expected[n] for n in wanted}


def test_unvalidated_parse_keeps_validation_everywhere_else():
    """The engine parses without libcst's per-node validation (a speed-up); the check is back for every node
    built afterwards, after a failed parse too, and the tree is the source's."""
    import libcst as cst

    from rlguard.lint.engine import parse_module

    source = "def f(x):\n    return x[:, 1:] * 2  # kept\n"
    assert parse_module(source).code == source
    with pytest.raises(cst.CSTValidationError):
        cst.Name("")
    with pytest.raises(cst.ParserSyntaxError):
        parse_module("def f(:\n")
    with pytest.raises(cst.CSTValidationError):
        cst.Name("")
