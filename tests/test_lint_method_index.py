"""Roles across the files of a tree through the method index: an A2C update unpacks what a method of another
file's class returns (``v, lp, ent, h = self.actor_critic.evaluate_actions(...)``) through an attribute whose class
nothing in the trainer's file says (a constructor parameter). The method is placed by a text index of the tree, and
each element's role comes from the callee's code (the critic's output, a distribution's ``log_probs``, its
``entropy().mean()``), so the three faults (the advantages not detached in the policy loss, the surrogate not
negated, the entropy added) are found whatever the trainer's variables are called. Clean look-alikes: the
original update; a method name that two classes of the tree define with different layouts; a common method name;
a callee whose third element is no entropy; a method of a class that is no torch module (no forward of the model
by its code)."""

from __future__ import annotations

import textwrap

import pytest

MODEL = '''
    import torch.nn as nn


    class Policy({bases}):
        def __init__(self, base, dist):
            super().__init__()
            self.base = base
            self.dist = dist

        def {method}(self, inputs, rnn_hxs, action):
            value, actor_features, rnn_hxs = self.base(inputs, rnn_hxs)
            dist = self.dist(actor_features)
            action_log_probs = dist.log_probs(action)
            dist_entropy = {entropy}
            return value, action_log_probs, dist_entropy, rnn_hxs
'''

# a second class of the tree with a method of the same name ({third}: its third element)
OTHER = '''
    import torch
    import torch.nn as nn


    class Twin(nn.Module):
        def __init__(self, net):
            self.net = net

        def {method}(self, inputs, rnn_hxs, action):
            value, logits = self.net(inputs)
            logp = torch.log_softmax(logits, -1).gather(-1, action)
            return value, logp, {third}, rnn_hxs
'''

ABSTRACT = '''
    class Base:
        def {method}(self, inputs, rnn_hxs, action):
            """Values, log-probs, entropy and hidden state of the actions."""
            raise NotImplementedError
'''

ALGO = '''
    import torch
    import torch.optim as optim


    class A2C:
        def __init__(self, actor_critic, value_loss_coef, entropy_coef, lr=None):
            self.actor_critic = actor_critic
            self.value_loss_coef = value_loss_coef
            self.entropy_coef = entropy_coef
            self.optimizer = optim.RMSprop(actor_critic.parameters(), lr)

        def update(self, rollouts):
            {v}, {lp}, {ent}, _ = self.actor_critic.{method}(
                rollouts.obs[:-1], rollouts.hidden[0], rollouts.actions)
            {v} = {v}.view(-1, 1)
            {adv} = rollouts.returns[:-1] - {v}
            {vl} = {adv}.pow(2).mean()
            {al} = {neg}({adv}{detach} * {lp}).mean()  # policy loss
            self.optimizer.zero_grad()
            ({vl} * self.value_loss_coef + {al} {sign}
             {ent} * self.entropy_coef).backward()  # entropy bonus
            self.optimizer.step()
            return {vl}.item(), {al}.item(), {ent}.item()
'''

NAMED = dict(v="values", lp="action_log_probs", ent="dist_entropy", adv="advantages", vl="value_loss",
             al="action_loss")
NEUTRAL = dict(v="v1", lp="v2", ent="v3", adv="v4", vl="v5", al="v6")
CLEAN = dict(neg="-", detach=".detach()", sign="-")
FAULTS = {
    "RLG003": dict(CLEAN, detach=""),  # the critic's graph reaches the policy loss through the advantages
    "RLG005": dict(CLEAN, neg=""),  # the surrogate enters the minimised loss with a + sign
    "RLG004": dict(CLEAN, sign="+"),  # the entropy bonus is added
}


def _line(text: str, marker: str) -> int:
    return next(i for i, line in enumerate(textwrap.dedent(text).splitlines(), 1) if marker in line)


def _lint(tmp_path, monkeypatch, names, fault, method="evaluate_actions", entropy="dist.entropy().mean()",
          other=None, abstract=False, preview=False, bases="nn.Module"):
    from rlguard.lint.config import Layer, load_config
    from rlguard.lint.runner import run

    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "model.py").write_text(textwrap.dedent(MODEL.format(method=method, entropy=entropy, bases=bases)))
    if other is not None:
        (pkg / "twin.py").write_text(textwrap.dedent(OTHER.format(method=method, third=other)))
    if abstract:
        (pkg / "base.py").write_text(textwrap.dedent(ABSTRACT.format(method=method)))
    algo = ALGO.format(method=method, **names, **fault)
    (pkg / "algo.py").write_text(textwrap.dedent(algo))
    monkeypatch.chdir(tmp_path)
    config = load_config([tmp_path], cli=Layer(select=["RLG003", "RLG004", "RLG005"], preview=preview),
                         isolated=True)
    found = [(f.code, f.path.replace("\\", "/"), f.line) for f in run(["pkg/algo.py"], config, cache=False).findings]
    return found, algo


WHERE = {"RLG003": "rollouts.returns[:-1] -", "RLG005": "# policy loss", "RLG004": "# entropy bonus"}


@pytest.mark.parametrize("preview", [False, True])
@pytest.mark.parametrize("names", [NAMED, NEUTRAL], ids=["named", "neutral"])
@pytest.mark.parametrize("code", sorted(FAULTS))
def test_each_fault_is_found_by_the_callee_code(tmp_path, monkeypatch, code, names, preview):
    found, algo = _lint(tmp_path, monkeypatch, names, FAULTS[code], preview=preview)
    assert found == [(code, "pkg/algo.py", _line(algo, WHERE[code]))]


@pytest.mark.parametrize("names", [NAMED, NEUTRAL], ids=["named", "neutral"])
def test_the_original_update_is_clean(tmp_path, monkeypatch, names):
    # advantages squared into the critic's loss (its gradient is meant) and detached in the policy loss
    for preview in (False, True):
        sub = tmp_path / str(preview)
        sub.mkdir()
        assert _lint(sub, monkeypatch, names, CLEAN, preview=preview)[0] == []


@pytest.mark.parametrize("code", sorted(FAULTS))
def test_an_abstract_base_and_an_agreeing_twin_keep_the_roles(tmp_path, monkeypatch, code):
    # a base class that only raises is left out; a second class whose elements play the same roles agrees
    found, algo = _lint(tmp_path, monkeypatch, NEUTRAL, FAULTS[code], abstract=True,
                        other="-(logits.softmax(-1) * torch.log_softmax(logits, -1)).sum(-1).mean()")
    assert found == [(code, "pkg/algo.py", _line(algo, WHERE[code]))]


def test_two_classes_that_disagree_place_nothing(tmp_path, monkeypatch):
    # the twin's third element is its logits' mean, no entropy: which class runs is unknown, so is the role
    found, _ = _lint(tmp_path, monkeypatch, NEUTRAL, FAULTS["RLG004"], other="logits.mean()")
    assert found == []


def test_a_common_method_name_is_not_placed(tmp_path, monkeypatch):
    # `act` is defined by many classes of many trees and by library objects: not matched by its name alone
    for code in sorted(FAULTS):
        sub = tmp_path / code
        sub.mkdir()
        assert _lint(sub, monkeypatch, NEUTRAL, FAULTS[code], method="act")[0] == []


def test_a_third_element_that_is_no_entropy_is_not_one(tmp_path, monkeypatch):
    # the callee's third element is the features' norm: added to the loss, it is no entropy bonus
    found, _ = _lint(tmp_path, monkeypatch, NEUTRAL, FAULTS["RLG004"], entropy="actor_features.norm()")
    assert found == []


def test_a_method_of_no_torch_module_is_no_forward_of_the_model(tmp_path, monkeypatch):
    # the class that defines the method is no nn.Module (a client of workers, a data plane): what it returns may
    # come from anywhere, so whether it carries the model's graph is not known, and nothing is said by default
    found, _ = _lint(tmp_path, monkeypatch, NEUTRAL, FAULTS["RLG003"], bases="object")
    assert found == []
