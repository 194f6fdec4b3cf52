"""The mutation-recall harness (benchmarks/mutation.py) on a tree built here: a site's mutant is judged caught,
missed, or (for a site marked ``harmless``) a false alarm when the linter reports it. No mirror is needed."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from rlguard.catalog import CODES

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))
import mutation  # noqa: E402

GRAD_NOT_ZEROED = CODES["RLG013"].code

TRAINER = '''import torch


def train(model, opt, batches):
    for batch in batches:
        opt.zero_grad()
        loss = model(batch).mean()
        loss.backward()
        opt.step()
'''


def _site(tmp_path: Path, **extra) -> mutation.Site:
    (tmp_path / "sites.toml").write_text(
        '[[site]]\nrepo = "toy"\npath = "train.py"\nfunction = "train"\nline = 6\noperator = "remove_zero_grad"\n'
        f'code = "{GRAD_NOT_ZEROED}"\nnote = "zero_grad at the top of the loop"\n'
        + "".join(f'{k} = "{v}"\n' for k, v in extra.items()), encoding="utf-8")
    [site] = mutation.load_sites({"toy": {"name": "toy", "part": "development"}}, [tmp_path / "sites.toml"])
    return site


@pytest.fixture
def tree(tmp_path):
    root = tmp_path / "tree"
    root.mkdir()
    (root / "train.py").write_text(TRAINER, encoding="utf-8")
    cwd = os.getcwd()
    yield root
    os.chdir(cwd)  # the harness lints from inside the tree


def test_a_fault_reported_in_the_function_is_caught(tmp_path, tree):
    outcome = mutation.judge(_site(tmp_path), tree, mutation.Linter(preview=False), {})
    assert outcome.status == "OK", outcome.detail
    assert (tree / "train.py").read_text(encoding="utf-8") == TRAINER  # the original is put back


def test_a_harmless_site_reported_is_a_false_alarm_not_recall(tmp_path, tree):
    site = _site(tmp_path, harmless="for the test: read as no fault")
    assert site.harmless and "harmless" not in site.params
    outcome = mutation.judge(site, tree, mutation.Linter(preview=False), {})
    assert outcome.status == "HARMLESS-FLAGGED"
    row = next(line for line in mutation.render([outcome]).splitlines() if line.startswith("| **all**"))
    assert row.split(" | ")[1:] == ["n/a", "0", "0", "0", "1 (1)", "0 |"]  # no recall; one harmless, flagged


def test_a_harmless_site_left_silent_counts_neither_way(tmp_path, tree):
    # the mutant of a line that is no zero_grad is invalid; a site whose mutant the linter leaves alone is HARMLESS
    (tree / "train.py").write_text(TRAINER.replace("        opt.zero_grad()\n", "        opt.zero_grad()\n"
                                                   "        opt.zero_grad()\n"), encoding="utf-8")
    site = _site(tmp_path, harmless="a second zero_grad: removing one leaves the other")
    outcome = mutation.judge(site, tree, mutation.Linter(preview=False), {})
    assert outcome.status == "HARMLESS"
    row = next(line for line in mutation.render([outcome]).splitlines() if line.startswith("| **all**"))
    assert row.split(" | ")[1:] == ["n/a", "0", "0", "0", "1 (0)", "0 |"]


def test_remove_shift_roll_turns_rolled_labels_into_the_ids():
    source = "labels = torch.roll(ids, shifts=-1, dims=1)\nlp = score(logits, labels)\n"
    mutant = mutation.mutate(source, "remove_shift", 1, {"which": "roll"})
    assert mutant.splitlines()[0] == "labels = ids"
    with pytest.raises(mutation.InvalidSite):
        mutation.mutate(source, "remove_shift", 2, {"which": "roll"})
