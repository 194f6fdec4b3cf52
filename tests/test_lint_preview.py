"""Stable and preview (ruff's model): a finding that rests only on a heuristic whose precision on unseen code is
not shown is reported with ``--preview`` / ``preview = true``, and never in the default mode."""

from __future__ import annotations

import pytest

from rlguard.cli import main
from rlguard.lint import lint_source
from rlguard.lint.config import ConfigError, Layer, load_config

# The minimised loss is known only by its variable's name (no backward, no loss function in view): a preview sink.
NAMED_ONLY = "loss = pg_loss + ent_coef * entropy.mean()\n"
# The same term reaching a backward: the sink is shown by the code, so the stable rule reports it.
BACKWARD = "loss = pg_loss + ent_coef * entropy.mean()\nloss.backward()\n"
# Renamed: the same program with a neutral local name.
RENAMED = "v1 = pg_loss + ent_coef * entropy.mean()\nv1.backward()\n"


def codes(source: str, preview: bool) -> list[str]:
    return [f.code for f in lint_source(source, "t.py", preview=preview).findings]


def test_a_loss_known_only_by_its_name_is_a_preview_finding():
    assert codes(NAMED_ONLY, preview=False) == []
    assert codes(NAMED_ONLY, preview=True) == ["RLG004"]


def test_a_loss_shown_by_its_backward_is_stable_and_survives_renaming():
    assert codes(BACKWARD, preview=False) == ["RLG004"]
    assert codes(RENAMED, preview=False) == ["RLG004"]


# A value named for a maximised quantity (`surrogate*`) moves where the unnegated surrogate is reported (to the line
# where it becomes the returned loss); under neutral names it is reported where the terms are built. The finding
# stands in both spellings: a name chose its line, not whether it is reported.
MOVED = ("def actor_loss_fn(logp, old_logp, adv, mask, eps):\n"
         "    ratio = torch.exp(logp - old_logp)\n"
         "    {s1} = adv * ratio\n"
         "    {s2} = adv * torch.clamp(ratio, 1 - eps, 1 + eps)\n"
         "    return (torch.min({s1}, {s2}) * mask).sum() / mask.sum()\n")


def lines(source: str, preview: bool = False) -> list[tuple[str, int]]:
    return [(f.code, f.line) for f in lint_source(source, "t.py", preview=preview).findings]


def test_a_finding_whose_line_a_name_chooses_survives_renaming():
    named = MOVED.format(s1="surrogate1", s2="surrogate2")
    neutral = MOVED.format(s1="q1", s2="q2")
    assert lines(named, preview=True) == [("RLG005", 5)]
    assert lines(named) == [("RLG005", 5)]
    assert lines(neutral) == [("RLG005", 3), ("RLG005", 4)]


# DeepSpeed's `engine.backward(loss)`: an object that is stepped is an engine, not a tensor (whose `backward`
# takes a gradient), whatever it is called; without the step nothing shows that the argument is a loss.
ENGINE = ("def update(self, pg_loss, entropy):\n"
          "    v1 = pg_loss + 0.01 * entropy.mean()\n"
          "    self.e1.backward(v1)\n"
          "{step}")


def test_an_engine_is_known_by_its_step_not_its_name():
    assert lines(ENGINE.format(step="    self.e1.step()\n")) == [("RLG004", 2)]
    assert lines(ENGINE.format(step="")) == []


# An optimizer stepped with a value is a wrapper that backpropagates it (torch's step takes only a closure); an
# environment stepped with a value is not.
STEPPED = ("class A:\n"
           "    def __init__(self, p):\n"
           "        self.a2 = {built}\n"
           "    def learn(self, pg_loss, entropy):\n"
           "        v1 = pg_loss + 0.01 * entropy.mean()\n"
           "        self.a2.step(v1)\n")


def test_an_optimizer_stepped_with_a_loss_backpropagates_it():
    assert lines(STEPPED.format(built="torch.optim.Adam(p.parameters())")) == [("RLG004", 5)]
    assert lines(STEPPED.format(built="make_env()")) == []


@pytest.fixture
def project(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "t.py").write_text(NAMED_ONLY)
    return tmp_path


def lint(capsys, *args):
    code = main(["lint", "--no-cache", *args])
    return code, capsys.readouterr().out


def test_cli_flag_and_config_key(project, capsys):
    (project / "pyproject.toml").write_text("[tool.rlguard]\n")
    assert lint(capsys)[0] == 0
    code, out = lint(capsys, "--preview")
    assert code == 1 and "RLG004" in out
    (project / "pyproject.toml").write_text("[tool.rlguard]\npreview = true\n")
    assert lint(capsys)[0] == 1
    assert lint(capsys, "--no-preview")[0] == 0  # the command line wins over the file


def test_preview_must_be_a_boolean(project):
    (project / "pyproject.toml").write_text('[tool.rlguard]\npreview = "yes"\n')
    with pytest.raises(ConfigError, match="preview must be true or false"):
        load_config([project])


def test_preview_is_part_of_the_cache_key(project, capsys):
    (project / "pyproject.toml").write_text("[tool.rlguard]\n")
    assert main(["lint"]) == 0
    assert main(["lint", "--preview"]) == 1  # not the default mode's cached "clean"
    capsys.readouterr()


def test_a_preview_rule_runs_only_in_preview_mode(monkeypatch):
    from rlguard.lint import rule as rule_module
    from rlguard.lint.config import _lint_codes  # noqa: F401 - the catalog codes lint knows

    rules = rule_module.all_rules()
    monkeypatch.setattr(rules["RLG004"], "preview", True)
    default = load_config([], cli=Layer(), isolated=True)
    assert "RLG004" not in default.selected
    assert "RLG004" in load_config([], cli=Layer(preview=True), isolated=True).selected
    assert codes(BACKWARD, preview=False) == []
    assert codes(BACKWARD, preview=True) == ["RLG004"]
    with pytest.raises(ConfigError, match="in preview: add --preview"):
        load_config([], cli=Layer(select=("RLG004",)), isolated=True)


def test_rule_pages_say_the_status():
    from rlguard.lint.docs import render_page

    page = render_page("RLG004")
    assert "| static check | status | severity | autofix |" in page
    assert "| yes | stable/preview | error |" in page  # RLG004: stable, its named sinks in preview
    assert "Stable, with parts in preview" in page and "name of the local variable" in page
    assert "| yes | stable | error |" in render_page("RLG002")
    assert "| yes (informational) | preview | info |" in render_page("RLG010") and "**Preview.**" in render_page("RLG010")
