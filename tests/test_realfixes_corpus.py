"""The mined corpus of real fixes (benchmarks/realfixes.toml) and its replay script (benchmarks/realfixes.py).

The schema checks need no snapshot. The scorer is exercised end to end on a throwaway git repository built here
(a two-commit history of a tiny trainer); the replay of the real corpus runs only where mirrors are available
(``RLGUARD_MIRRORS``) and is skipped otherwise.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from rlguard.catalog import CODES

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))
import realfixes  # noqa: E402
import snapshots  # noqa: E402

ENTROPY_BONUS = CODES["RLG004"].code
GRAD_NOT_ZEROED = CODES["RLG013"].code

GOOD = {
    "id": "toy-entropy-sign",
    "repo": "example/toy-rl",
    "commit": "a" * 40,
    "parent": "b" * 40,
    "path": "trainer.py",
    "function": "Trainer.update",
    "code": ENTROPY_BONUS,
    "description": "entropy added to the minimised loss; the fix subtracts it",
    "verified": "read both versions",
}


def write_cases(path: Path, *cases: dict) -> Path:
    def value(v: str) -> str:
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'

    path.write_text("".join("[[case]]\n" + "".join(f"{k} = {value(v)}\n" for k, v in c.items()) + "\n"
                            for c in cases), encoding="utf-8")
    return path


# --- the corpus itself -------------------------------------------------------------------------------------------

def test_corpus_schema():
    cases = realfixes.load_cases()  # raises on a missing field, a bad sha, an unknown code, a held-out repo
    assert len(cases) >= 30
    assert len({c.code for c in cases}) >= 8
    assert all(c.code in CODES and c.code <= CODES["RLG013"].code for c in cases)  # the statically visible faults
    assert all(c.repo not in realfixes.HELD_OUT for c in cases)
    assert len({(c.repo, c.commit, c.path, c.function) for c in cases}) == len(cases)


def test_corpus_stores_no_code():
    text = (BENCH / "realfixes.toml").read_text(encoding="utf-8")
    values = [line.split("=", 1)[1].strip() for line in text.splitlines()
              if "=" in line and not line.lstrip().startswith("#")]
    assert all(v.startswith('"') and v.endswith('"') and len(v) < 250 for v in values)  # one short string each
    assert '"""' not in text and "'''" not in text
    for case in realfixes.load_cases():
        assert not realfixes.CODE_CHARS.search(case.description), case.id


# --- schema errors name the file and the case --------------------------------------------------------------------

def test_healthy_case_loads(tmp_path):
    (case,) = realfixes.load_cases(write_cases(tmp_path / "c.toml", GOOD))
    assert (case.id, case.function, case.fixed_path) == ("toy-entropy-sign", "Trainer.update", None)


@pytest.mark.parametrize("change, message", [
    ({"commit": "abc123"}, "commit must be a full 40-hex sha"),
    ({"parent": "B" * 40}, "parent must be a full 40-hex sha"),
    ({"code": "RLG099"}, "is not in the catalog"),
    ({"repo": "volcengine/verl"}, "held out"),
    ({"repo": "toy-rl"}, "owner/name"),
    ({"verified": "yes"}, "verified must be"),
    ({"description": "loss equals pg plus c times H, written as loss = pg + c * H"}, "not code"),
    ({"function": ""}, "missing or empty function"),
    ({"extra": "x"}, "unknown field(s) extra"),
])
def test_malformed_case_is_named(tmp_path, change, message):
    path = write_cases(tmp_path / "c.toml", GOOD, {**GOOD, "id": "second", **change})
    with pytest.raises(realfixes.CaseError) as err:
        realfixes.load_cases(path)
    assert message in str(err.value) and "case 2 ('second')" in str(err.value) and str(path) in str(err.value)


def test_duplicate_id_and_bad_file(tmp_path):
    with pytest.raises(realfixes.CaseError, match="duplicate id"):
        realfixes.load_cases(write_cases(tmp_path / "c.toml", GOOD, GOOD))
    bad = tmp_path / "bad.toml"
    bad.write_text("[[case]\n", encoding="utf-8")
    with pytest.raises(realfixes.CaseError, match="cannot read the corpus"):
        realfixes.load_cases(bad)
    bad.write_text("title = 'no cases'\n", encoding="utf-8")
    with pytest.raises(realfixes.CaseError, match=r"no \[\[case\]\] tables"):
        realfixes.load_cases(bad)


def test_cli_reports_a_bad_corpus_without_traceback(tmp_path, capsys):
    path = write_cases(tmp_path / "c.toml", {**GOOD, "code": "RLG099"})
    with pytest.raises(SystemExit) as exit_:
        realfixes.main(["--cases", str(path)])
    assert exit_.value.code == 2
    assert "RLG099" in capsys.readouterr().err


# --- enclosing functions -----------------------------------------------------------------------------------------

def test_function_lines():
    source = ("import torch\n"            # 1
              "class Trainer:\n"          # 2
              "    @torch.no_grad()\n"    # 3
              "    def update(self):\n"   # 4
              "        def inner():\n"    # 5
              "            pass\n"        # 6
              "        return inner\n"    # 7
              "if torch:\n"               # 8
              "    def helper(): pass\n"  # 9
              "else:\n"                   # 10
              "    def helper(): pass\n")  # 11
    assert snapshots.function_lines(source, "Trainer.update") == [(3, 7)]  # from the decorator
    assert snapshots.function_lines(source, "Trainer.update.inner") == [(5, 6)]
    assert snapshots.function_lines(source, "helper") == [(9, 9), (11, 11)]
    assert snapshots.function_lines(source, "update") == []  # a method needs its class
    assert snapshots.function_lines(source, "<module>") == [(1, 11)]
    assert snapshots.function_lines("def broken(:\n", "broken") == []


# --- the scorer, end to end on a throwaway repository ------------------------------------------------------------

BUGGY = '''import torch


class Trainer:
    def update(self, batch, coef=0.01):
        logp = torch.log_softmax(self.policy(batch["ids"]).logits, -1)
        entropy = -(logp.exp() * logp).sum(-1).mean()
        loss = batch["pg_loss"] + coef * entropy
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()

    def report(self, batch, coef=0.01):
        logp = torch.log_softmax(self.policy(batch["ids"]).logits, -1)
        entropy = -(logp.exp() * logp).sum(-1).mean()
        loss = batch["pg_loss"] + coef * entropy
        loss.backward()
'''
FIXED = BUGGY.replace('loss = batch["pg_loss"] + coef', 'loss = batch["pg_loss"] - coef', 1)


@pytest.fixture
def toy_mirror(tmp_path):
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    work = tmp_path / "work"
    work.mkdir()

    def git(*args: str) -> str:
        env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
               "GIT_COMMITTER_EMAIL": "t@t", "GIT_CONFIG_GLOBAL": os.devnull, "GIT_CONFIG_SYSTEM": os.devnull}
        return subprocess.run(["git", *args], cwd=work, env=env, check=True, capture_output=True,
                              text=True).stdout.strip()

    git("init", "-q")
    (work / "trainer.py").write_text(BUGGY, encoding="utf-8")
    git("add", "trainer.py")
    git("commit", "-q", "-m", "buggy")
    parent = git("rev-parse", "HEAD")
    (work / "trainer.py").write_text(FIXED, encoding="utf-8")
    git("commit", "-q", "-am", "fix entropy sign in update")
    commit = git("rev-parse", "HEAD")
    mirrors = tmp_path / "mirrors"
    subprocess.run(["git", "clone", "-q", "--mirror", str(work), str(mirrors / "example+toy-rl" / "repo")],
                   check=True, capture_output=True)
    return mirrors, parent, commit


def case(**change) -> realfixes.Case:
    return realfixes.Case(**{**GOOD, **change})


def test_replay_scores_caught_and_cleared(toy_mirror):
    mirrors, parent, commit = toy_mirror
    fixed = realfixes.replay(case(parent=parent, commit=commit), mirrors)
    assert (fixed.caught, fixed.cleared, fixed.buggy_lines, fixed.fixed_lines) == (True, True, [8], [])
    # the same fault left in place in another method: caught, not cleared
    unfixed = realfixes.replay(case(parent=parent, commit=commit, function="Trainer.report"), mirrors)
    assert (unfixed.caught, unfixed.cleared) == (True, False)
    # a code the linter does not report there: missed (and trivially cleared)
    missed = realfixes.replay(case(parent=parent, commit=commit, code=GRAD_NOT_ZEROED), mirrors)
    assert (missed.caught, missed.cleared) == (False, True)


def test_replay_skips_with_a_note(toy_mirror, tmp_path):
    mirrors, parent, commit = toy_mirror
    assert "no local mirror" in realfixes.replay(case(repo="example/absent"), mirrors)
    assert "lacks" in realfixes.replay(case(parent="0" * 40, commit=commit), mirrors)
    assert "not in the mirror" in realfixes.replay(case(parent=parent, commit=commit, path="absent.py"), mirrors)
    assert "not found" in realfixes.replay(case(parent=parent, commit=commit, function="Trainer.gone"), mirrors)
    assert "no local mirror" in realfixes.replay(case(), None)


def test_main_tables_gate_and_doc(toy_mirror, tmp_path, monkeypatch, capsys):
    mirrors, parent, commit = toy_mirror
    path = write_cases(tmp_path / "c.toml", {**GOOD, "parent": parent, "commit": commit},
                       {**GOOD, "id": "toy-report", "function": "Trainer.report", "parent": parent, "commit": commit},
                       {**GOOD, "id": "toy-absent", "repo": "example/absent"})
    assert realfixes.main(["--cases", str(path), "--mirrors", str(mirrors)]) == 0
    out = capsys.readouterr().out
    assert "| RLG004 | 2 | 2 | 1 |" in out and "| example/toy-rl | 2 | 2 | 1 |" in out
    assert "2 cases replayed: 2 caught (100%), 1 cleared (50%); 1 skipped." in out
    assert "toy-absent: no local mirror of example/absent" in out
    assert realfixes.main(["--cases", str(path), "--mirrors", str(mirrors), "--min-cleared", "0.9"]) == 1
    assert realfixes.main(["--cases", str(path), "--mirrors", str(mirrors), "--min-caught", "0.9"]) == 0
    capsys.readouterr()
    assert realfixes.main(["--cases", str(path), "--mirrors", str(mirrors), "--json"]) == 0
    assert '"cleared": false' in capsys.readouterr().out

    doc = tmp_path / "benchmarks.md"
    doc.write_text("# Benchmarks\n\n## Real fixes\n\nold table\n\n## Lint speed\n\nkept\n", encoding="utf-8")
    monkeypatch.setattr(realfixes, "DOC", doc)
    realfixes.main(["--cases", str(path), "--mirrors", str(mirrors), "--write"])
    text = doc.read_text(encoding="utf-8")
    assert "old table" not in text and "| RLG004 | 2 | 2 | 1 |" in text and text.endswith("## Lint speed\n\nkept\n")


def test_min_caught_must_be_a_fraction(capsys):
    with pytest.raises(SystemExit):
        realfixes.main(["--min-caught", "60"])
    assert "fraction between 0 and 1" in capsys.readouterr().err


# --- the real corpus, where snapshots exist ----------------------------------------------------------------------

def test_replay_real_corpus():
    root = snapshots.mirrors_root()
    cases = realfixes.load_cases()
    present = [c for c in cases if snapshots.find_mirror(root, c.repo) is not None]
    if not present:
        pytest.skip(f"no mirror of the corpus repositories (set ${snapshots.ENV})")
    for c in present:
        outcome = realfixes.replay(c, root)
        # a mirror that lacks the commits is a stale snapshot, not a corpus error; anything else is
        if isinstance(outcome, str) and "lacks" not in outcome:
            pytest.fail(outcome)
