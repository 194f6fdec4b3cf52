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
