"""Modes, check_every, zero perturbation, memory, torch.compile, imports."""

from __future__ import annotations

import gc
import logging
import os
import subprocess
import sys
import tracemalloc
import weakref
from typing import Annotated

import pytest
import torch

import contracts_helpers as h
from rlguard.contracts import (
    ContractViolation,
    Finite,
    LogProbs,
    Loss,
    NoGrad,
    contract,
    get_mode,
    mode,
    set_mode,
)
from rlguard.contracts.settings import reset_warnings

torch.set_num_threads(1)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@contract
def loss_fn(logp: Annotated[LogProbs, Finite()], old_logp: Annotated[LogProbs, NoGrad()]) -> Loss:
    return (logp - old_logp).sum()


def nan_logp() -> torch.Tensor:
    x = torch.randn(2, 5)
    x[0, 0] = float("nan")
    return x


def test_modes_raise_warn_off(caplog):
    assert get_mode() == "raise"
    reset_warnings()
    with mode("warn"), caplog.at_level(logging.WARNING, logger="rlguard.contracts"):
        assert get_mode() == "warn"
        for _ in range(3):
            out = loss_fn(torch.randn(2, 5), torch.randn(2, 5, requires_grad=True))  # runs, logs
        with pytest.raises(RuntimeError):  # warn mode: logged, then the body itself fails
            loss_fn(torch.randn(2, 5), torch.randn(2, 6))
        assert out.shape == ()
    assert caplog.text.count("RLG003 test_modes_raise_warn_off") == 0
    assert caplog.text.count("RLG003 loss_fn()") == 1  # once per code and place
    assert caplog.text.count("RLG012 loss_fn()") == 1
    assert "argument 'old_logp'" in caplog.text
    assert get_mode() == "raise"
    with mode("off"):
        loss_fn(torch.randn(2, 5), torch.randn(5))  # straight through, no check
    with pytest.raises(ContractViolation):
        loss_fn(torch.randn(2, 5), torch.randn(5))
    with pytest.raises(ValueError, match="mode must be one of"):
        set_mode("loud")


def test_env_var_sets_the_mode(monkeypatch):
    from rlguard.contracts.settings import _mode_from_env

    for value, expect in (("off", "off"), ("warn", "warn"), ("raise", "raise"), ("", "raise"), ("0", "off")):
        monkeypatch.setenv("RLGUARD", value)
        assert _mode_from_env() == expect


def test_check_every_defers_value_checks_only():
    @contract(check_every=3)
    def f(logp: Annotated[LogProbs, Finite()], old_logp: Annotated[LogProbs, NoGrad()]) -> None:
        return None

    with pytest.raises(ContractViolation, match="NaN"):
        f(nan_logp(), torch.zeros(2, 5))  # call 1: value checks run
    f(nan_logp(), torch.zeros(2, 5))  # call 2: skipped
    f(nan_logp(), torch.zeros(2, 5))  # call 3: skipped
    with pytest.raises(ContractViolation, match="NaN"):
        f(nan_logp(), torch.zeros(2, 5))  # call 4
    with pytest.raises(ContractViolation) as ei:  # call 5: shape and grad checks always run
        f(torch.zeros(2, 5), torch.zeros(2, 5, requires_grad=True))
    assert ei.value.code == "RLG003"
    with pytest.raises(ContractViolation) as ei:  # call 6
        f(torch.zeros(2, 5), torch.zeros(3, 5))
    assert ei.value.code == "RLG000"


def test_zero_perturbation_training_is_bit_identical():
    torch.manual_seed(123)
    with_contracts = h.train(updates=2, epochs=2, minibatches=2)
    rng_on = torch.get_rng_state()
    torch.manual_seed(123)
    with mode("off"):
        without = h.train(updates=2, epochs=2, minibatches=2, guard=False)
    rng_off = torch.get_rng_state()
    for (n, a), (_, b) in zip(with_contracts.named_parameters(), without.named_parameters()):
        assert torch.equal(a, b), n
    assert torch.equal(rng_on, rng_off)  # the checks drew no random numbers


def test_checks_do_not_touch_inputs():
    b = h.make_batch()
    logp = torch.randn(h.B, h.T - 1, requires_grad=True)
    old = torch.randn(h.B, h.T - 1)
    adv = h.compute_advantages(b["rewards"])
    mask = h.action_mask(b["owner"])
    before = [t._version for t in (logp, old, adv, mask)] + [t.clone() for t in (old, adv, mask)]
    h.policy_loss(logp, old, adv, mask)
    assert [t._version for t in (logp, old, adv, mask)] == before[:4]
    assert all(torch.equal(a, c) for a, c in zip((old, adv, mask), before[4:]))


def test_no_reference_kept_and_memory_flat_over_200_calls():
    policy, ref, opt = h.make_models()
    from rlguard.contracts import Guard

    g = Guard(policy=policy, reference=ref, optimizer=opt)
    b = h.make_batch()
    ids, mask = b["ids"], h.action_mask(b["owner"])
    adv = h.compute_advantages(b["rewards"])

    with torch.no_grad():
        old = h.token_logprobs(policy(ids), ids)

    def one_call():
        logits = policy(ids)
        logp = h.token_logprobs(logits, ids)
        loss = h.policy_loss(logp, old, adv, mask)
        loss.backward()
        return weakref.ref(logp), weakref.ref(loss), weakref.ref(logits)

    with g.update():
        refs = one_call()
        opt.step()
        gc.collect()
        assert all(r() is None for r in refs), "a contract kept a tensor (and its graph) alive"
        for _ in range(20):
            one_call()
        gc.collect()
        tracemalloc.start()
        start = tracemalloc.take_snapshot()
        for _ in range(200):
            one_call()
        gc.collect()
        growth = sum(s.size_diff for s in tracemalloc.take_snapshot().compare_to(start, "filename"))
        tracemalloc.stop()
    g.close()
    assert growth < 200_000, f"memory grew by {growth} bytes over 200 calls"


def test_torch_compile_steps_aside(caplog):
    reset_warnings()

    @contract
    def scale(logp: Annotated[LogProbs, Finite()]) -> Annotated[LogProbs, NoGrad()]:
        return logp * 2

    @torch.compile(fullgraph=True, backend="eager")
    def step(x: torch.Tensor) -> torch.Tensor:
        return scale(x) + 1

    x = torch.randn(3, 4)
    assert torch.equal(step(x), x * 2 + 1)
    bad = torch.randn(3)  # wrong rank: eager would raise
    assert torch.equal(step(bad), bad * 2 + 1)
    with caplog.at_level(logging.WARNING, logger="rlguard.contracts"):
        with pytest.raises(ContractViolation):  # the next eager call checks again and reports the skip once
            scale(bad)
        scale(x)
    assert caplog.text.count("stepped aside inside a torch.compile region") == 1

    compiled_scale = torch.compile(scale, fullgraph=True, backend="eager")
    assert torch.equal(compiled_scale(x), x * 2)


def test_import_lint_does_not_import_torch():
    r = subprocess.run([sys.executable, "-c", "import rlguard.lint, sys; assert 'torch' not in sys.modules; "
                        "assert 'rlguard.contracts' not in sys.modules"], capture_output=True, text=True,
                       cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr
