"""The Guard: distinct reference (RLG008) at construction and around optimizer steps, update boundaries."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import contracts_helpers as h
from rlguard.contracts import ContractViolation, Guard, active_guard, mode

torch.set_num_threads(1)


def guard_fails(*fragments: str, **kw):
    with pytest.raises(ContractViolation) as ei:
        Guard(**kw)
    e = ei.value
    assert (e.code, e.function, e.argument) == ("RLG008", "Guard", "reference"), str(e)
    for f in fragments:
        assert f in str(e), (f, str(e))
    assert "copy.deepcopy(policy)" in str(e) and "see RLG008" in str(e)


class DDPLike(nn.Module):  # torch.nn.parallel.DistributedDataParallel keeps the model in .module
    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, x):
        return self.module(x)


class LoraLike(nn.Module):  # a PEFT-style adapter: base model plus trainable low-rank weights
    def __init__(self, base: nn.Module) -> None:
        super().__init__()
        self.base_model = base
        self.lora_a = nn.Parameter(torch.zeros(4, 16))

    def get_base_model(self) -> nn.Module:
        return self.base_model

    def forward(self, x):
        return self.base_model(x)


def test_healthy_reference():
    policy, ref, opt = h.make_models()
    with Guard(policy=policy, reference=ref, optimizer=opt) as g:
        assert active_guard() is g
    assert active_guard() is None


def test_reference_is_policy():
    policy, _, opt = h.make_models()
    guard_fails("the reference is the policy object itself", policy=policy, reference=policy, optimizer=opt)  # noqa: RLG008 - the policy as its own reference, on purpose: the Guard must refuse it


def test_shallow_copy_shares_storage():
    policy, _, opt = h.make_models()
    guard_fails("share storage with the policy", "copy.copy", policy=policy, reference=copy.copy(policy),  # noqa: RLG008 - a shallow copy as the reference, on purpose
                optimizer=opt)


def test_reference_in_optimizer():
    policy, ref, _ = h.make_models()
    opt = torch.optim.SGD(list(policy.parameters()) + list(ref.parameters()), lr=0.1)  # noqa: RLG008 - a reference in the optimizer, on purpose
    guard_fails("in the optimizer's param groups", policy=policy, reference=ref, optimizer=opt)


@pytest.mark.parametrize("wrap", ["ddp", "compile", "peft_base", "peft_self"])
def test_wrappers(wrap):
    policy, ref, opt = h.make_models()
    if wrap == "ddp":
        guard_fails("wrap the same TinyLM", policy=DDPLike(policy), reference=policy, optimizer=opt)
        Guard(policy=DDPLike(policy), reference=ref, optimizer=opt).close()
    elif wrap == "compile":
        compiled = torch.compile(policy)  # an OptimizedModule; nothing is compiled until it is called
        assert type(compiled).__name__ == "OptimizedModule"
        guard_fails("wrap the same TinyLM", policy=compiled, reference=policy, optimizer=opt)  # noqa: RLG008 - the compiled policy and the policy, on purpose
        Guard(policy=compiled, reference=ref, optimizer=opt).close()
    elif wrap == "peft_base":
        lora = LoraLike(policy)
        opt = torch.optim.AdamW([lora.lora_a], lr=1e-3)
        guard_fails("wrap the same TinyLM", policy=lora, reference=policy, optimizer=opt)
    else:  # reference = a module that holds the policy's base weights without being it
        lora = LoraLike(policy)
        holder = nn.Module()
        holder.head = policy.head
        guard_fails("share storage with the policy", "PEFT base model", policy=lora, reference=holder,
                    optimizer=torch.optim.AdamW([lora.lora_a], lr=1e-3))


def test_step_must_leave_reference_bit_identical():
    policy, ref, opt = h.make_models()
    g = Guard(policy=policy, reference=ref, optimizer=opt)
    opt.add_param_group({"params": [ref.head.bias.requires_grad_(True)]})  # after the guard's check
    ids = h.make_batch()["ids"]
    (policy(ids).sum() + ref(ids).sum()).backward()
    with pytest.raises(ContractViolation) as ei:
        opt.step()
    assert ei.value.code == "RLG008" and "optimizer.step() changed 1 of the reference's tensors" in str(ei.value)
    assert "'head.bias'" in str(ei.value)
    g.close()


def test_step_counting_and_update_boundaries():
    policy, ref, opt = h.make_models()
    g = Guard(policy=policy, reference=ref, optimizer=opt)
    ids = h.make_batch()["ids"]
    with g.update():
        assert g.in_update and g.steps_in_update == 0
        for _ in range(3):
            opt.zero_grad()
            policy(ids).sum().backward()
            opt.step()
        assert g.steps_in_update == 3
    assert not g.in_update
    with g.update():
        assert g.steps_in_update == 0 and g.steps == 3 and g.updates == 2
    g.close()
    opt.step()
    assert g.steps == 3  # hooks removed


def test_warn_mode_guard_logs_instead(caplog):
    policy, _, opt = h.make_models()
    with mode("warn"), caplog.at_level("WARNING", logger="rlguard.contracts"):
        Guard(policy=policy, reference=policy, optimizer=opt).close()  # noqa: RLG008 - the policy as its own reference, on purpose: warn mode must log it
    assert "RLG008" in caplog.text


def test_an_internal_error_in_the_gradient_hook_is_logged_once_and_backward_goes_on(monkeypatch, caplog):
    """RLG013's tensor hook runs inside the trainer's ``loss.backward()``: an error of rlguard's own there must not
    raise out of backward. It is logged once with what was checked, and that check is switched off."""
    import logging

    from rlguard.contracts import guard as guard_module

    def boom(*_a, **_k):
        raise RuntimeError("grad hook bug under test")

    monkeypatch.setattr(guard_module._GradWatch, "arrived", boom)
    torch.manual_seed(0)
    policy = nn.Linear(4, 2)
    opt = torch.optim.SGD(policy.parameters(), lr=0.1)
    g = Guard(policy=policy, optimizer=opt, check_every=1)
    x = torch.randn(3, 4)
    with caplog.at_level(logging.ERROR, logger="rlguard.contracts"):
        for _ in range(4):
            opt.zero_grad()
            policy(x).sum().backward()  # raised RuntimeError before the hook was guarded
            opt.step()
    errors = [r.getMessage() for r in caplog.records if "grad hook bug under test" in r.getMessage()]
    assert len(errors) == 1 and "RLG013" in errors[0] and "switched off" in errors[0], errors
    assert not g._grads.on and g.steps == 4
    g.close()


def test_an_internal_error_in_the_update_direction_verdict_is_logged_once(monkeypatch, caplog):
    import logging

    class Store:  # stands for the UpdateDirection marker whose verdict is read at the end of each update
        def verdict(self, store, steps):
            raise RuntimeError("verdict bug under test")

    policy = nn.Linear(4, 2)
    g = Guard(policy=policy, optimizer=torch.optim.SGD(policy.parameters(), lr=0.1))
    with caplog.at_level(logging.ERROR, logger="rlguard.contracts"):
        for _ in range(2):
            g.begin_update()
            g.direction_rows("f", "logp", Store())
            g.end_update()  # raised RuntimeError before the verdict was guarded
    errors = [r.getMessage() for r in caplog.records if "verdict bug under test" in r.getMessage()]
    assert len(errors) == 1 and "RLG005" in errors[0] and "switched off" in errors[0], errors
    g.close()
