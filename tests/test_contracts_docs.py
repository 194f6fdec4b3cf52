"""The violation messages in docs/contracts.md are the ones the code produces."""

from __future__ import annotations

import os

import pytest
import torch

from rlguard.contracts import ContractViolation
from rlguard.contracts._doc_examples import BEGIN, END, markdown

torch.set_num_threads(1)
DOC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "contracts.md")


def test_doc_messages_match_the_code():
    with open(DOC, encoding="utf-8") as f:
        text = f.read()
    block = text.split(BEGIN, 1)[1].split(END, 1)[0].strip()
    assert block == markdown().strip(), (
        "docs/contracts.md is stale: run python -m rlguard.contracts._doc_examples --write docs/contracts.md")
    for code in ("RLG000", "RLG001", "RLG002", "RLG003", "RLG007", "RLG008", "RLG009", "RLG012"):
        assert f"ContractViolation: {code} " in block


def test_quick_start_runs():
    """The quick start of docs/contracts.md runs as written, on a tiny model and a healthy rollout."""
    from types import SimpleNamespace

    import contracts_helpers as h

    with open(DOC, encoding="utf-8") as f:
        text = f.read()
    code = text.split("```python\n", 1)[1].split("```", 1)[0]
    model, ref_model, opt = h.make_models()
    b = h.make_batch()
    ids, rewards = b["ids"], b["rewards"]

    def minibatches(rollout):  # a fresh rollout: old log-probs from the current weights
        with torch.no_grad():
            old = h.token_logprobs(model(ids), ids)
        return [SimpleNamespace(ids=ids, old_logp=old, mask=h.action_mask(b["owner"]),
                                advantages=(rewards - rewards.mean(1, keepdim=True)).reshape(-1))]

    ns = {"model": model, "ref_model": ref_model, "opt": opt, "rollouts": [0, 1], "minibatches": minibatches,
          "logp_of": lambda m: h.token_logprobs(model(m.ids), m.ids)}
    exec(compile(code, "docs/contracts.md", "exec"), ns)  # noqa: S102 - our own documentation
    ns["guard"].close()
    adv = ns["compute_advantages"](rewards)
    assert adv.shape == (h.B,)
    assert ns["action_mask"](b["owner"]).shape == (h.B, h.T - 1)


def _example(tag: str) -> str:
    with open(DOC, encoding="utf-8") as f:
        text = f.read()
    return text.split(f"<!-- example: {tag} -->\n```python\n", 1)[1].split("```", 1)[0]


def _run(code: str, name: str) -> None:
    exec(compile(code, f"docs/contracts.md ({name})", "exec"), {"__name__": f"docs_example_{name}"})  # noqa: S102


FAULTS = {
    "trl-style": [
        ("RLG008", "self.ref_model = copy.deepcopy(model).eval().requires_grad_(False)", "self.ref_model = model"),
        ("RLG009", "return ((grouped - grouped.mean(1, keepdim=True))", "return ((grouped - grouped.mean())"),
        ("RLG002", "self.compute_loss(self.model, {k: v[rows] for k, v in inputs.items()}).backward()",
         "sub = {k: v[rows] for k, v in inputs.items()}\n"
         "                        ids = torch.cat([sub['prompt_ids'], sub['completion_ids']], 1)\n"
         "                        sub['old_per_token_logps'] = self._get_per_token_logps(self.model, ids, 6).detach()\n"
         "                        self.compute_loss(self.model, sub).backward()"),
        ("RLG007", "logits = model(input_ids)[:, -logits_to_keep - 1:-1]",
         "logits = model(input_ids)[:, -logits_to_keep:]"),
    ],
    "verl-style": [
        ("RLG008", "actor = Actor(model, copy.deepcopy(model).eval().requires_grad_(False))",
         "actor = Actor(model, model)"),
        ("RLG009", "return ((grouped - grouped.mean(1, keepdim=True))", "return ((grouped - grouped.mean())"),
        ("RLG002", "mb = data.select(rows).batch",
         "mb = data.select(rows).batch\n"
         "                mb['old_log_probs'] = self._log_probs(\n"
         "                    self.actor_module, mb['input_ids'], mb['responses']).detach()"),
        ("RLG000", '"response_mask": torch.ones_like(responses)', '"response_mask": torch.ones_like(ids)'),
    ],
}


@pytest.mark.parametrize("tag", sorted(FAULTS))
def test_batch_examples_run_and_catch_their_faults(tag):
    """The TRL-style and verl-style examples of docs/contracts.md run as written, with no violation, and each of
    four faults injected into them is caught with its code."""
    code = _example(tag)
    _run(code, tag)
    for code_expected, old, new in FAULTS[tag]:
        assert old in code, (tag, old)
        with pytest.raises(ContractViolation) as ei:
            _run(code.replace(old, new), tag)
        assert ei.value.code == code_expected, (tag, old, str(ei.value))
