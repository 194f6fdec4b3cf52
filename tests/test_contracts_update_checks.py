"""The Guard checks the update itself: gradients zeroed between steps (RLG013) and the frozen set unchanged
(RLG014), at the first step where it goes wrong, with no false alarm on correct trainers (accumulation,
set_to_none both ways, schedulers, several optimizers, a fused optimizer) and the same parameters with the
Guard on and off."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import contracts_helpers as h
from rlguard.contracts import ContractViolation, Guard, mode

torch.set_num_threads(1)
V, T = 16, 6


class Policy(nn.Module):
    """Token and position embeddings, a head, a value head, and a running normaliser kept as a buffer."""

    def __init__(self, freeze_tokens: bool = True) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.tok_emb = nn.Embedding(V, 16)
        self.pos_emb = nn.Embedding(T, 16)
        self.head = nn.Linear(16, V)
        self.value = nn.Linear(16, 1)
        self.register_buffer("obs_mean", torch.zeros(16))
        self.update_norm = False  # True: the normaliser keeps updating in the forward pass
        self.tok_emb.requires_grad_(not freeze_tokens)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok_emb(ids) + self.pos_emb(torch.arange(ids.shape[1]))
        if self.update_norm:
            with torch.no_grad():
                self.obs_mean.mul_(0.9).add_(0.1 * x.mean(dim=(0, 1)))
        x = torch.tanh(x - self.obs_mean)
        return torch.cat([self.head(x), self.value(x)], dim=-1)


def batch(i: int) -> torch.Tensor:
    return torch.randint(0, V, (8, T), generator=torch.Generator().manual_seed(i))


def loss_of(model: Policy, ids: torch.Tensor, part: str = "both") -> torch.Tensor:
    out = model(ids)
    policy, value = out[..., :V].log_softmax(-1).mean(), out[..., V:].pow(2).mean()
    return {"both": -policy + value, "policy": -policy, "value": value}[part]


def train(model: Policy, optimizers: list, steps: int, *, micro: int = 1, zero: str | None = "optimizer",
          set_to_none: bool = True, scheduler: bool = False, parts: tuple[str, ...] = ("both",),
          forget: int | None = None) -> None:
    """``steps`` steps of every optimizer; ``zero``: "optimizer" (each optimizer's zero_grad), "model"
    (model.zero_grad), "data" (p.grad.data.zero_()), None (no zeroing: the RLG013 fault); ``forget``: the index of
    an optimizer that alone forgets to zero."""
    sched = [torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5) for o in optimizers] if scheduler else []
    for step in range(steps):
        for k in range(micro):  # accumulation: several backwards per step
            loss = sum(loss_of(model, batch(step * micro + k), part) for part in parts) / micro
            loss.backward()
        for i, opt in enumerate(optimizers):
            opt.step()
            if zero == "optimizer" and i != forget:
                opt.zero_grad(set_to_none=set_to_none)
        if zero == "model":
            model.zero_grad(set_to_none=set_to_none)
        elif zero == "data":
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.data.zero_()
        for s in sched:
            s.step()


def params(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()] + [b.clone() for b in model.buffers()]


def split_optimizers(model: Policy, fused: bool = False) -> list:
    body = [p for n, p in model.named_parameters() if not n.startswith("value.")]
    return [torch.optim.AdamW(body, lr=1e-2, fused=fused), torch.optim.SGD(model.value.parameters(), lr=1e-2)]


# -- RLG013 -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", ["set_to_none", "zero_in_place", "model.zero_grad", "accumulation",
                                     "scheduler", "two_optimizers", "zeroed_through_data"])
def test_gradients_zeroed_no_false_alarm(variant):
    model = Policy()
    opts = split_optimizers(model) if variant == "two_optimizers" else [
        torch.optim.AdamW(model.parameters(), lr=1e-2)]
    kw = {"set_to_none": "set_to_none", "zero_in_place": {"set_to_none": False},
          "model.zero_grad": {"zero": "model"}, "accumulation": {"micro": 3}, "scheduler": {"scheduler": True},
          "two_optimizers": {"parts": ("policy", "value")}, "zeroed_through_data": {"zero": "data"}}[variant]
    with Guard(policy=model, optimizer=opts, check_every=2):
        train(model, opts, steps=6, **(kw if isinstance(kw, dict) else {}))


def test_no_zero_grad_is_caught_before_the_second_step():
    model = Policy()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = Guard(policy=model, optimizer=opt)
    loss_of(model, batch(0)).backward()
    opt.step()  # step 0: its own gradient, nothing leaked yet
    after_first = params(model)
    loss_of(model, batch(1)).backward()  # the fault: no zero_grad, this backward adds to step 0's gradient
    with pytest.raises(ContractViolation) as ei:
        opt.step()
    g.close()
    e = ei.value
    assert (e.code, e.function, e.argument) == ("RLG013", "Guard", "gradients")
    assert "still held the gradient left by optimizer step 0" in str(e) and "parameter 'value.bias'" in str(e)
    assert "zero_grad" in str(e) and "see RLG013" in str(e)
    assert all(torch.equal(a, b) for a, b in zip(params(model), after_first))  # raised before the step ran


def test_the_optimizer_that_forgets_is_named():
    model = Policy()
    opts = split_optimizers(model)
    with pytest.raises(ContractViolation) as ei, Guard(policy=model, optimizer=opts):
        train(model, opts, steps=3, parts=("policy", "value"), forget=1)
    assert ei.value.code == "RLG013" and "of optimizer 1 (SGD)" in str(ei.value) and "'value." in str(ei.value)


def test_gradients_are_not_touched_bit_identical_with_and_without_guard():
    for zero in ("optimizer", None):  # a healthy trainer, and one that forgets zero_grad (in warn mode)
        runs = []
        for guarded in (True, False):
            model = Policy()
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
            g = Guard(policy=model, optimizer=opt, check_every=1) if guarded else None
            with mode("warn"):
                train(model, [opt], steps=4, micro=2, zero=zero)
            if g is not None:
                g.close()
            runs.append(params(model))
        assert all(torch.equal(a, b) for a, b in zip(*runs)), zero


# -- RLG014 -------------------------------------------------------------------------------------------------
def test_frozen_set_healthy_trainers():
    model = Policy()  # tok_emb frozen when the guard is built, and in the optimizer with no gradient: harmless
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    with Guard(policy=model, optimizer=opt, check_every=1) as g:
        assert g.frozen_names == ["tok_emb.weight"]
        model.update_norm = True  # a buffer that updates in the forward, not declared frozen
        train(model, [opt], steps=4, micro=2)
    model = Policy()
    model.pos_emb.requires_grad_(False)
    opts = split_optimizers(model, fused=True)  # several optimizers, one fused
    with Guard(policy=model, optimizer=opts, frozen=["tok_emb", "pos_emb.weight", "obs_mean"], check_every=2):
        train(model, opts, steps=4, parts=("policy", "value"))


def test_frozen_parameter_trainable_in_the_optimizer_at_construction():
    model = Policy(freeze_tokens=False)  # the fault: the embedding meant to stay frozen is left trainable
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with pytest.raises(ContractViolation) as ei:
        Guard(policy=model, optimizer=opt, frozen="tok_emb")
    e = ei.value
    assert (e.code, e.argument) == ("RLG014", "frozen")
    assert "'tok_emb.weight' in AdamW, param group 0): every step will train them" in str(e)
    assert "requires_grad_(False)" in str(e) and "see RLG014" in str(e)


@pytest.mark.parametrize("fused", [False, True])
def test_frozen_parameter_unfrozen_mid_run_is_caught_before_its_step(fused):
    model = Policy()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused)  # fused: no version counter moves
    g = Guard(policy=model, optimizer=opt)
    train(model, [opt], steps=2)
    model.tok_emb.requires_grad_(True)  # a configuration change mid-run
    frozen_before = model.tok_emb.weight.detach().clone()
    loss_of(model, batch(9)).backward()
    with pytest.raises(ContractViolation) as ei:
        opt.step()
    g.close()
    assert ei.value.code == "RLG014" and "'tok_emb.weight'" in str(ei.value)
    assert "optimizer step 2 is about to change them" in str(ei.value)
    assert torch.equal(model.tok_emb.weight, frozen_before)


def test_frozen_buffer_updated_in_the_forward_is_caught_at_the_next_step():
    model = Policy()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    with Guard(policy=model, optimizer=opt, frozen=["obs_mean"], check_every=16):
        train(model, [opt], steps=2)
        model.update_norm = True  # the fault: the normaliser, meant frozen after warm-up, keeps updating
        with pytest.raises(ContractViolation) as ei:
            train(model, [opt], steps=1)
    e = ei.value
    assert e.code == "RLG014" and "'obs_mean'" in str(e)
    assert "outside optimizer.step() (a forward pass updating a buffer, or your code)" in str(e)


def test_writes_past_the_version_counters_are_caught_on_the_cadence():
    model = Policy()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    caught = []
    with Guard(policy=model, optimizer=opt, check_every=4):
        for step in range(8):
            if step == 1:
                model.tok_emb.weight.data.add_(1e-3)  # .data: a write its version counter does not see
            loss_of(model, batch(step)).backward()
            try:
                opt.step()
            except ContractViolation as e:
                caught.append((step, e))
            opt.zero_grad()
    assert [s for s, _ in caught] == [4], caught  # steps 0, 4, ... read the fingerprint
    assert "a float64 norm differs" in str(caught[0][1]) and "'tok_emb.weight'" in str(caught[0][1])


def test_frozen_argument_forms():
    model = Policy()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    with Guard(policy=model, optimizer=opt, frozen=lambda name, t: name.startswith(("tok_", "obs_"))) as g:
        assert g.frozen_names == ["tok_emb.weight", "obs_mean"]
    with Guard(policy=model, optimizer=opt, frozen=()) as g:
        assert g.frozen_names == []
    with pytest.raises(ValueError, match="'embed' names no parameter or buffer of the policy"):
        Guard(policy=model, optimizer=opt, frozen="embed")
    with pytest.raises(ValueError, match="give policy= too"):
        Guard(optimizer=opt, frozen="tok_emb")
    with pytest.raises(TypeError, match="optimizer"):
        Guard(policy=model, optimizer=model)


def test_guard_reads_the_host_once_per_cadence_step():
    model = Policy()
    ref = copy.deepcopy(model).requires_grad_(False)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-2)

    def step_reads() -> int:
        opt.zero_grad()
        loss_of(model, batch(0)).backward()
        with h.HostSyncs() as syncs:
            opt.step()
        return syncs.count

    own = step_reads()
    with Guard(policy=model, reference=ref, optimizer=opt, frozen=["tok_emb", "obs_mean"], check_every=3):
        counts = [step_reads() - own for _ in range(6)]
    assert counts == [1, 0, 0, 1, 0, 0], counts  # the reference's and the frozen set's norms, read together
