"""--fix and --diff end to end through the CLI, for each rule with a safe rewrite (RLG003 .detach(),
RLG004 and RLG011 sign flips, RLG008 copy.copy -> copy.deepcopy): formatting and comments are kept, the fixed
file lints clean for that rule, --diff writes nothing."""

from __future__ import annotations

import textwrap

import pytest

from rlguard.cli import main


@pytest.fixture
def project(tmp_path, monkeypatch):
    (tmp_path / "pyproject.toml").write_text("[tool.rlguard]\n")
    monkeypatch.chdir(tmp_path)
    return tmp_path


CASES = {
    "RLG004": (
        """\
        def update(batch):
            # the total loss
            loss = pg_loss   +  ent_coef * entropy.mean(); loss.backward()  # keep this comment
            loss.backward()
        """,
        """\
        def update(batch):
            # the total loss
            loss = pg_loss   -  ent_coef * entropy.mean(); loss.backward()  # keep this comment
            loss.backward()
        """),
    "RLG011": (
        "loss = pg_loss - kl_coef * kl; loss.backward()  # penalty\n",
        "loss = pg_loss + kl_coef * kl; loss.backward()  # penalty\n"),
    "RLG008": (
        "import copy\n\nref_model = copy.copy(policy)   # frozen reference\n",
        "import copy\n\nref_model = copy.deepcopy(policy)   # frozen reference\n"),
    "RLG003": (
        "old_logp = compute_logp(model, ids)  # behaviour log-probs\nloss = ppo_loss(logp, old_logp=old_logp)\n",
        "old_logp = compute_logp(model, ids).detach()  # behaviour log-probs\nloss = ppo_loss(logp, old_logp=old_logp)\n"),
}


@pytest.mark.parametrize("code", sorted(CASES))
def test_fix_rewrites_and_keeps_formatting(project, capsys, code):
    before, after = (textwrap.dedent(t) for t in CASES[code])
    path = project / "train.py"
    path.write_text(before)
    # preview on: some rewrites' findings rest on a name (a shallow copy bound to `ref_model`)
    assert main(["lint", "--no-cache", "--preview", "--select", code, "--fix", "train.py"]) == 0
    out = capsys.readouterr().out
    assert path.read_text() == after
    assert "Fixed 1 finding in 1 file" in out
    assert main(["lint", "--no-cache", "--preview", "--select", code, "train.py"]) == 0
    capsys.readouterr()


@pytest.mark.parametrize("code", sorted(CASES))
def test_diff_previews_and_writes_nothing(project, capsys, code):
    before, after = (textwrap.dedent(t) for t in CASES[code])
    path = project / "train.py"
    path.write_text(before)
    assert main(["lint", "--no-cache", "--preview", "--select", code, "--diff", "train.py"]) == 1
    out = capsys.readouterr().out
    assert path.read_text() == before
    assert out.startswith("--- a/train.py\n+++ b/train.py\n")
    removed = [line[1:] for line in out.splitlines() if line.startswith("-") and not line.startswith("---")]
    added = [line[1:] for line in out.splitlines() if line.startswith("+") and not line.startswith("+++")]
    assert removed == [line for line in before.splitlines() if line not in after.splitlines()]
    assert added == [line for line in after.splitlines() if line not in before.splitlines()]
    assert "Would fix 1 finding in 1 file" in out


def test_fix_leaves_unfixable_and_suppressed_findings(project, capsys):
    path = project / "t.py"
    source = ("loss = pg_loss + ent_coef * entropy.mean(); loss.backward()  # noqa: RLG004\n"
              "loss = pg_loss + ent_coef * entropy.mean(); loss.backward()\n")
    path.write_text(source)
    assert main(["lint", "--no-cache", "--fix", "--select", "RLG004", "t.py"]) == 0
    assert path.read_text().splitlines() == [source.splitlines()[0],
                                             "loss = pg_loss - ent_coef * entropy.mean(); loss.backward()"]
    capsys.readouterr()


def test_fix_uses_a_warm_cache_safely(project, capsys):
    path = project / "t.py"
    path.write_text("loss = pg_loss + ent_coef * entropy.mean(); loss.backward()\n")
    assert main(["lint", "t.py"]) == 1  # fills the cache with a fixable finding
    assert main(["lint", "--fix", "t.py"]) == 0
    assert path.read_text() == "loss = pg_loss - ent_coef * entropy.mean(); loss.backward()\n"
    assert main(["lint", "t.py"]) == 0
    capsys.readouterr()


def test_fix_keeps_a_utf8_bom_and_crlf(project, capsys):
    path = project / "t.py"
    path.write_bytes(b"\xef\xbb\xbf# caf\xc3\xa9\r\nloss = pg_loss + ent_coef * entropy; loss.backward()\r\n")
    assert main(["lint", "--no-cache", "--fix", "t.py"]) == 0
    assert path.read_bytes() == b"\xef\xbb\xbf# caf\xc3\xa9\r\nloss = pg_loss - ent_coef * entropy; loss.backward()\r\n"
    capsys.readouterr()


def test_diff_with_json_keeps_stdout_parseable(project, capsys):
    import json

    (project / "t.py").write_text("loss = pg_loss + ent_coef * entropy; loss.backward()\n")
    assert main(["lint", "--no-cache", "--diff", "--format", "json", "t.py"]) == 1
    out, err = capsys.readouterr()
    assert json.loads(out) == [] and err.startswith("--- a/t.py")
