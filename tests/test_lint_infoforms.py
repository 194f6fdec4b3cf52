"""Entropy and KL written out over whole distributions (``lint/analysis/infoforms.py``): the form and its sign from
the formula, through log helpers and single definitions, and what a helper's negated form does at its callers
(RLG004, RLG011): reported in the helper when the caller trusts it, silent when the signs agree."""

from __future__ import annotations

import textwrap

import libcst as cst
import pytest

from rlguard.lint import all_rules, lint_source
from rlguard.lint.analysis import Analysis
from rlguard.lint.analysis.infoforms import forms


def _products(source: str):
    a = Analysis(cst.parse_module(textwrap.dedent(source)))
    f = forms(a)
    found = []
    for node in a.nodes(cst.BinaryOperation):
        form = f.form(node)
        if form is not None:
            found.append((form.kind, form.sign))
    return found


@pytest.mark.parametrize("source, expected", [
    ("h = -(p * torch.log(p)).sum(-1)\n", [("entropy", -1)]),  # the product is minus the entropy; the minus restores it
    ("h = (p * p.log()).sum(dim=-1)\n", [("entropy", -1)]),
    ("h = (-(p * p.log())).sum(dim=-1)\n", [("entropy", -1)]),  # the product's own sign; the minus is outside
    ("h = (-p * p.log()).sum(dim=-1)\n", [("entropy", 1)]),
    ("h = torch.sum(q * torch.log(q.clamp(min=1e-8)), dim=-1)\n", [("entropy", -1)]),
    ("h = (p * torch.log(p + 1e-9)).sum(-1)\n", [("entropy", -1)]),
    ("q = z.softmax(-1)\nh = (q * z.log_softmax(-1)).sum(-1)\n", [("entropy", -1)]),
    ("k = (p * (p.log() - q.log())).sum(-1)\n", [("kl", 1)]),
    ("k = (p * (q.log() - p.log())).sum(-1)\n", [("kl", -1)]),
    ("k = (q * torch.log(q / p)).sum(-1)\n", [("kl", 1)]),
    ("d = torch.log(q) - torch.log(p)\nk = (p * d).sum(-1)\n", [("kl", -1)]),
    ("def log(t, eps=1e-20):\n    return torch.log(t.clamp(min=eps))\n\nk = (a * (log(a) - log(b))).sum(-1)\n",
     [("kl", 1)]),
])
def test_forms_and_signs(source, expected):
    assert _products(source) == expected


@pytest.mark.parametrize("source", [
    "h = (p * torch.log(r)).sum(-1)\n",           # two different values: a cross-entropy, not an entropy
    "h = (p * torch.log(p)).sum(1)\n",            # not the last axis
    "h = (p * torch.log(p)).mean()\n",            # no sum over the distribution
    "h = (p * lib.safe_log(p)).sum(-1)\n",        # a log the linter cannot read
    "k = (p * (q.log() - r.log())).sum(-1)\n",    # p weights neither log
])
def test_not_a_form(source):
    assert _products(source) == []


RULES = [all_rules()[c] for c in ("RLG004", "RLG011")]


def _findings(source):
    return [(f.code, f.line) for f in lint_source(textwrap.dedent(source), "trainer.py", rules=RULES, preview=True).findings]


def test_negated_helper_reported_once_in_the_helper_for_every_caller():
    source = '''
        def token_entropy(p):
            return (p * torch.log(p)).sum(-1)

        def actor_loss(lp, adv, p):
            loss = -(lp * adv).mean() - 0.01 * token_entropy(p).mean()
            return loss

        def aux_loss(p, ce):
            loss = ce - 0.1 * token_entropy(p).mean()
            return loss
    '''
    assert _findings(source) == [("RLG004", 3)]


def test_negated_helper_added_by_its_caller_is_a_bonus():
    source = '''
        def token_entropy(p):
            return (p * torch.log(p)).sum(-1)

        def actor_loss(lp, adv, p):
            loss = -(lp * adv).mean() + 0.01 * token_entropy(p).mean()
            return loss
    '''
    assert _findings(source) == []


def test_kl_helper_with_swapped_logs_reported_in_the_helper():
    source = '''
        def log(t, eps=1e-20):
            return torch.log(t.clamp(min=eps))

        def masked_kl_div(p, q, mask):
            kl = (p * (log(q) - log(p))).sum(dim=-1)
            return (kl * mask).sum() / mask.sum()

        class Trainer:
            def learn(self, p, q, mask, pg_loss):
                kl_loss = masked_kl_div(p, q, mask) * self.kl_div_loss_weight
                loss = pg_loss.mean() + kl_loss
                self.accelerator.backward(loss)
    '''
    assert _findings(source) == [("RLG011", 6)]
    fixed = source.replace("(log(q) - log(p))", "(log(p) - log(q))")
    assert _findings(fixed) == []


def test_negated_helper_in_another_file_of_the_tree(tmp_path, monkeypatch):
    from rlguard.lint.config import Layer, load_config
    from rlguard.lint.runner import run

    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "infos.py").write_text(textwrap.dedent('''
        import torch

        def token_entropy(p):
            return (p * torch.log(p)).sum(-1)

        def kl_div(p, q):
            return (p * (torch.log(p) - torch.log(q))).sum(-1)
    '''))
    (pkg / "train.py").write_text(textwrap.dedent('''
        from pkg.infos import token_entropy, kl_div

        def actor_loss(lp, adv, p, q):
            loss = -(lp * adv).mean() - 0.01 * token_entropy(p).mean() + 0.1 * kl_div(p, q).mean()
            return loss
    '''))
    monkeypatch.chdir(tmp_path)
    config = load_config([tmp_path], cli=Layer(select=["RLG004", "RLG011"]), isolated=True)
    found = [(f.code, f.path.replace("\\", "/"), f.line) for f in run(["."], config, cache=False).findings]
    assert found == [("RLG004", "pkg/train.py", 5)]  # the entropy helper is negated; the KL one is right


def _tree_findings(tmp_path, monkeypatch, files: dict[str, str], codes=("RLG004", "RLG011")):
    from rlguard.lint.config import Layer, load_config
    from rlguard.lint.runner import run

    for rel, text in files.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    monkeypatch.chdir(tmp_path)
    config = load_config([tmp_path], cli=Layer(select=list(codes)), isolated=True)
    return [(f.code, f.path.replace("\\", "/"), f.line) for f in run(["."], config, cache=False).findings]


_ALGOS = '''
    from . import tensor_ops as ops

    def average_loss(values, mask, mode):
        if mode == "token":
            return ops.masked_mean(values, mask)
        return ((values * mask).sum(-1) / (mask.sum(-1) + 1e-8)).mean()

    def compute_kl(log_probs, ref_log_probs, kind):
        if kind == "abs":
            return (log_probs - ref_log_probs).abs()
        if kind == "mse":
            return 0.5 * (log_probs - ref_log_probs).square()
        return log_probs - ref_log_probs
'''
_OPS = '''
    def masked_mean(values, mask):
        return (values * mask).sum() / mask.sum()
'''
_ACTOR = '''
    import torch
    from .algos import average_loss, compute_kl

    class Actor:
        def update(self, pg_loss, log_probs, batch):
            k = compute_kl(log_probs, batch["ref_log_probs"], self.config.kl_penalty)
            kl_loss = average_loss(k, batch["response_mask"], self.config.loss_avg_mode)
            loss = pg_loss + kl_loss * self.config.kl_coef
            loss = loss * torch.sum(batch["response_mask"]) / self.config.total_tokens
            loss.backward()
'''


def test_a_reduction_helper_in_another_file_keeps_the_sign_of_what_it_reduces(tmp_path, monkeypatch):
    """``average_loss(values, mask)`` of another file returns a masked mean of its first argument (its summary says
    so, read from its code through a module alias), so the KL it reduces keeps its sign in the caller's loss."""
    files = {"pkg/__init__.py": "", "pkg/tensor_ops.py": _OPS, "pkg/algos.py": _ALGOS, "pkg/actor.py": _ACTOR}
    assert _tree_findings(tmp_path, monkeypatch, files) == []
    files["pkg/actor.py"] = _ACTOR.replace("pg_loss + kl_loss", "pg_loss - kl_loss")
    assert _tree_findings(tmp_path, monkeypatch, files) == [("RLG011", "pkg/actor.py", 9)]


def test_a_helper_that_negates_what_it_reduces_is_no_reduction(tmp_path, monkeypatch):
    """A helper returning minus its argument's mean does not keep its sign: the caller's subtracted term is then a
    KL of unknown sign, and nothing is said."""
    algos = _ALGOS.replace("return ((values * mask).sum(-1) / (mask.sum(-1) + 1e-8)).mean()",
                           "return -((values * mask).sum(-1) / (mask.sum(-1) + 1e-8)).mean()")
    files = {"pkg/__init__.py": "", "pkg/tensor_ops.py": _OPS, "pkg/algos.py": algos,
             "pkg/actor.py": _ACTOR.replace("pg_loss + kl_loss", "pg_loss - kl_loss")}
    assert _tree_findings(tmp_path, monkeypatch, files) == []
