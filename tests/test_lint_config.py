"""[tool.rlguard]: discovery, selection (codes, prefixes, ALL, layers), exclude, per-file-ignores, the user's
own names, command-line overrides, and clear errors (exit 2) for anything unknown."""

from __future__ import annotations

import textwrap

import pytest

from rlguard.cli import main
from rlguard.lint.config import ConfigError, Layer, load_config, matches_any, resolve_selectors

ENTROPY_BUG = "loss = pg_loss + ent_coef * entropy.mean(); loss.backward()\n"
KL_BUG = "loss = pg_loss - kl_coef * kl; loss.backward()\n"


@pytest.fixture
def project(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)

    def make(config: str = "", **files: str):
        (tmp_path / "pyproject.toml").write_text("[tool.rlguard]\npreview = true\n" + textwrap.dedent(config))
        for rel, text in files.items():
            rel = rel.replace("__", "/")  # a__b_py -> a/b.py
            path = tmp_path / (rel[:-3] + ".py" if rel.endswith("_py") else rel)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        return tmp_path

    return make


def lint(capsys, *args):
    code = main(["lint", "--no-cache", *args])
    out, err = capsys.readouterr()
    return code, out, err


def codes(out: str) -> list[str]:
    return [line.split()[1] for line in out.splitlines() if line.count(":") >= 3 and " RLG" in line]


def test_selectors_codes_prefixes_all():
    assert resolve_selectors(["RLG004"], "x") == {"RLG004"}
    assert resolve_selectors(["rlg00"], "x") == {f"RLG00{i}" for i in range(10)}
    assert resolve_selectors(["RLG01"], "x") == {"RLG010", "RLG011", "RLG012", "RLG013", "RLG014", "RLG015",
                                                   "RLG016", "RLG017", "RLG018", "RLG019"}
    assert "RLG900" in resolve_selectors(["ALL"], "x")
    with pytest.raises(ConfigError, match="'RLG2'"):
        resolve_selectors(["RLG2"], "here")
    with pytest.raises(ConfigError, match="here: unknown code"):
        resolve_selectors(["E501"], "here")


def test_select_ignore_extend_select_in_config(project, capsys):
    project('select = ["RLG00"]\n', a_py=ENTROPY_BUG + KL_BUG)
    assert codes(lint(capsys)[1]) == ["RLG004"]
    project('ignore = ["RLG004"]\n', a_py=ENTROPY_BUG + KL_BUG)
    assert codes(lint(capsys)[1]) == ["RLG011"]
    project('select = ["RLG004"]\nextend-select = ["RLG011"]\n', a_py=ENTROPY_BUG + KL_BUG)
    assert codes(lint(capsys)[1]) == ["RLG004", "RLG011"]


def test_command_line_overrides_config(project, capsys):
    project('ignore = ["RLG004"]\n', a_py=ENTROPY_BUG + KL_BUG)
    assert codes(lint(capsys, "--select", "RLG004")[1]) == ["RLG004"]  # --select starts afresh
    assert codes(lint(capsys, "--ignore", "RLG011")[1]) == []  # --ignore adds to the config's
    project('select = ["RLG004"]\n', a_py=ENTROPY_BUG + KL_BUG)
    assert codes(lint(capsys, "--extend-select", "RLG011")[1]) == ["RLG004", "RLG011"]
    assert codes(lint(capsys, "--select", "RLG004,RLG011", "--ignore", "RLG004")[1]) == ["RLG011"]
    # isolated: no config, so neither its select nor its preview: every stable rule (RLG004 and RLG011 both are)
    assert codes(lint(capsys, "--isolated")[1]) == ["RLG004", "RLG011"]
    assert codes(lint(capsys, "--isolated", "--preview")[1]) == ["RLG004", "RLG011"]


def test_ignore_rlg900_drops_syntax_errors(project, capsys):
    project('ignore = ["RLG900"]\n', broken_py="def f(:\n", a_py=ENTROPY_BUG)
    code, out, _ = lint(capsys)
    assert codes(out) == ["RLG004"] and code == 1


def test_exclude_and_force_exclude(project, capsys):
    project('exclude = ["generated", "tests/fixtures"]\nextend-exclude = ["*_pb2.py"]\n',
            generated__x_py=ENTROPY_BUG, tests__fixtures__y_py=ENTROPY_BUG, tests__test_z_py=ENTROPY_BUG,
            api_pb2_py=ENTROPY_BUG, src__generated_not_py="")
    code, out, _ = lint(capsys)
    assert [line.split(":")[0] for line in out.splitlines()[:-1]] == ["tests/test_z.py"]
    # named on the command line: linted anyway, unless --force-exclude (what the pre-commit hook passes)
    assert lint(capsys, "generated/x.py")[0] == 1
    code, out, _ = lint(capsys, "--force-exclude", "generated/x.py", "tests/fixtures/y.py", "api_pb2.py")
    assert code == 0 and out == "All checks passed: 0 files, no findings\n"


def test_glob_matching():
    assert matches_any("tests/fixtures/a.py", ["tests/fixtures"])
    assert matches_any("tests/fixtures/a.py", ["tests/fixtures/"])
    assert not matches_any("src/tests/fixtures/a.py", ["tests/fixtures"])  # a glob with / is anchored
    assert matches_any("src/gen/a.py", ["gen"])  # a bare name matches any component
    assert matches_any("a/b/c_pb2.py", ["*_pb2.py"])
    assert matches_any("tests/unit/test_x.py", ["tests/*/test_*.py"])
    assert not matches_any("testsx/a.py", ["tests"])


def test_per_file_ignores(project, capsys):
    project('[tool.rlguard.per-file-ignores]\n"tests/*" = ["RLG004"]\n"legacy.py" = ["RLG0"]\n',
            tests__t_py=ENTROPY_BUG + KL_BUG, legacy_py=ENTROPY_BUG + KL_BUG, a_py=ENTROPY_BUG)
    code, out, _ = lint(capsys)
    assert [(line.split(":")[0], line.split()[1]) for line in out.splitlines()[:-1]] == [
        ("a.py", "RLG004"), ("tests/t.py", "RLG011")]


def test_names_extend_what_rules_recognise(project, capsys):
    bug = "loss = pg_loss + ent_coef * spread_of_policy.mean(); loss.backward()\n"
    project("", a_py=bug)
    assert lint(capsys)[0] == 0  # "spread_of_policy" is not an entropy name...
    project('[tool.rlguard.names]\nentropy = ["spread_of_policy"]\n', a_py=bug)
    code, out, _ = lint(capsys)  # ...until the user says it is
    assert code == 1 and codes(out) == ["RLG004"]
    project('[tool.rlguard.names]\nkl-coef = ["lam"]\nold-logp = ["behaviour_lp"]\nref-model = ["teacher"]\n',
            a_py=bug)
    assert lint(capsys)[0] == 0


def test_config_found_from_subfolder_and_nested_project(project, capsys, monkeypatch):
    root = project('select = ["RLG011"]\n', sub__deep__a_py=ENTROPY_BUG + KL_BUG)
    monkeypatch.chdir(root / "sub")
    assert codes(lint(capsys, "deep/a.py")[1]) == ["RLG011"]
    (root / "sub" / "pyproject.toml").write_text("[project]\nname = 'x'\n")  # no [tool.rlguard]: keep looking
    assert codes(lint(capsys, "deep/a.py")[1]) == ["RLG011"]
    (root / "sub" / "pyproject.toml").write_text("[tool.rlguard]\npreview = true\nselect = ['RLG004']\n")
    assert codes(lint(capsys, "deep/a.py")[1]) == ["RLG004"]


def test_explicit_config_file(project, capsys, tmp_path):
    project("", a_py=ENTROPY_BUG + KL_BUG)
    (tmp_path / "rlguard.toml").write_text('select = ["RLG011"]\npreview = true\n')
    assert codes(lint(capsys, "--config", "rlguard.toml")[1]) == ["RLG011"]
    code, _, err = lint(capsys, "--config", "nope.toml")
    assert code == 2 and "nope.toml" in err


@pytest.mark.parametrize("config, message", [
    ('selectt = ["RLG004"]\n', "unknown key 'selectt'"),
    ('select = ["RLG099"]\n', "select: unknown code or prefix 'RLG099'"),
    ('ignore = "RLG004"\n', "ignore must be a list of strings"),
    ('exclude = [1]\n', "exclude must be a list of strings"),
    ('per-file-ignores = ["x"]\n', "per-file-ignores must be a table"),
    ('[tool.rlguard.per-file-ignores]\n"x.py" = ["NOPE1"]\n', "unknown code or prefix 'NOPE1'"),
    ('[tool.rlguard.names]\nlogprobz = ["x"]\n', "unknown role 'logprobz'"),
    ('[tool.rlguard.names]\nmask = ["not a name"]\n', "is not a Python identifier"),
    ('select = [\n', "not valid TOML"),
])
def test_bad_config_is_a_clear_error(project, capsys, config, message):
    project(config, a_py="x = 1\n")
    code, out, err = lint(capsys)
    assert code == 2 and out == ""
    assert message in err and "pyproject.toml" in err and "Traceback" not in err


def test_load_config_api(project):
    root = project('select = ["RLG0"]\nignore = ["RLG010"]\n[tool.rlguard.names]\nmask = ["m1"]\n')
    config = load_config(["."])
    assert config.root == root
    assert "RLG004" in config.selected and "RLG010" not in config.selected and "RLG900" not in config.selected
    assert config.names == {"mask": ("m1",)}
    assert config.vocabulary().is_role("m1", "mask")
    other = load_config(["."], cli=Layer(select=("RLG010",)))
    assert other.selected == ("RLG010",)
    assert config.fingerprint(config.selected) != other.fingerprint(other.selected)
