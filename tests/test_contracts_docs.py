"""The violation messages in docs/contracts.md are the ones the code produces."""

from __future__ import annotations

import os

import torch

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
