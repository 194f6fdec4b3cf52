"""A class-based trainer that passes dict batches, contracted through its annotations only: no false alarm over
several seeds, each injected fault caught with its code, and the same parameters with contracts on and off."""

from __future__ import annotations

import pytest
import torch

import contracts_helpers as h
from rlguard.contracts import ContractViolation, mode

torch.set_num_threads(1)


@pytest.mark.parametrize("seed", range(5))
def test_healthy_dict_trainer_passes_over_seeds(seed):
    h.dict_trainer(seed).train(steps=2)


@pytest.mark.parametrize("fault, code", sorted(h.DICT_FAULTS.items()))
def test_each_fault_is_caught_with_its_code(fault, code):
    with pytest.raises(ContractViolation) as ei:
        h.dict_trainer(0, fault=fault).train(steps=2)
    assert ei.value.code == code, str(ei.value)


def test_contracts_on_and_off_train_bit_identical_parameters():
    torch.manual_seed(7)
    on = h.dict_trainer(3)
    on.train(steps=2)
    rng_on = torch.get_rng_state()
    torch.manual_seed(7)
    off = h.dict_trainer(3)
    with mode("off"):
        off.train(steps=2, guard=False)
    assert torch.equal(rng_on, torch.get_rng_state())
    for (name, a), (_, b) in zip(on.model.named_parameters(), off.model.named_parameters()):
        assert torch.equal(a, b), name
