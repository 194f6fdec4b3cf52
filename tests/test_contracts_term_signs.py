"""``Penalty`` (RLG011) and ``Bonus`` (RLG004) on a loss's return value: the sign with which a term enters the
loss, read from autograd, in a real training loop whose sign slips mid-run; healthy runs are silent and train
bit-identically with the checks on and off."""

from __future__ import annotations

from typing import Annotated

import pytest

torch = pytest.importorskip("torch")
from torch import Tensor  # noqa: E402

from rlguard.catalog import ENTROPY_BONUS_SIGN, KL_SIGN  # noqa: E402
from rlguard.contracts import Bonus, ContractDefinitionError, ContractViolation, Penalty, contract, mode  # noqa: E402

torch.set_num_threads(1)


@contract
def policy_loss(logp: Tensor, ref_logp: Tensor, adv: Tensor, kl: Tensor, entropy: Tensor, beta: float,
                coef: float) -> Annotated[Tensor, Penalty("kl"), Bonus("entropy")]:
    pg = -(adv[:, None] * torch.exp(logp - logp.detach())).mean()
    return pg + beta * kl.mean() - coef * entropy.mean()


def _terms(model: torch.nn.Module, ref: torch.nn.Module, x: Tensor, y: Tensor):
    logits = model(x)
    logp_all = logits.log_softmax(-1)
    logp = logp_all.gather(-1, y[..., None]).squeeze(-1)
    with torch.no_grad():
        ref_logp_all = ref(x).log_softmax(-1)
    ref_logp = ref_logp_all.gather(-1, y[..., None]).squeeze(-1)
    kl = (logp_all.exp() * (logp_all - ref_logp_all)).sum(-1)  # KL(policy || reference) per position
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, ref_logp, kl, entropy


def _train(steps: int, beta_at=lambda step: 0.1, coef_at=lambda step: 0.01, seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 5))
    ref = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 5))
    ref.load_state_dict(model.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(seed)
    for step in range(steps):
        x = torch.randn(8, 3, 6, generator=gen)
        y = torch.randint(0, 5, (8, 3), generator=gen)
        adv = torch.randn(8, generator=gen)
        logp, ref_logp, kl, entropy = _terms(model, ref, x, y)
        loss = policy_loss(logp, ref_logp, adv, kl, entropy, beta_at(step), coef_at(step))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_healthy_runs_are_silent_and_bit_identical_with_the_checks_off(seed):
    with mode("raise"):
        on = _train(6, seed=seed)
    with mode("off"):
        off = _train(6, seed=seed)
    for a, b in zip(on.parameters(), off.parameters()):
        assert torch.equal(a, b)


def test_a_kl_coefficient_negated_mid_run_is_stopped_at_that_step():
    steps_seen = []

    def beta(step):
        steps_seen.append(step)
        return 0.1 if step < 3 else -0.1

    with mode("raise"), pytest.raises(ContractViolation) as exc:
        _train(6, beta_at=beta)
    assert exc.value.code == KL_SIGN and steps_seen[-1] == 3
    assert "d loss / d kl has the wrong sign" in str(exc.value) and "see RLG011" in str(exc.value)


def test_an_entropy_penalty_is_reported_as_a_bonus_with_the_wrong_sign():
    with mode("raise"), pytest.raises(ContractViolation) as exc:
        _train(2, coef_at=lambda step: -0.01)
    assert exc.value.code == ENTROPY_BONUS_SIGN and "the bonus entropy raises the loss" in str(exc.value)


def test_zero_coefficients_and_evaluation_say_nothing():
    with mode("raise"):
        _train(2, beta_at=lambda step: 0.0, coef_at=lambda step: 0.0)
        x = torch.randn(2, 3, requires_grad=True)
        with torch.no_grad():  # evaluation: no graph to read the sign from
            policy_loss(x, x, torch.ones(2), -x, -x, -1.0, -1.0)


def test_the_marker_goes_on_the_loss_and_names_a_parameter():
    with pytest.raises(ContractDefinitionError, match="goes on the return value"):
        @contract
        def on_an_argument(kl: Annotated[Tensor, Penalty("kl")]) -> Tensor:
            return kl

    with pytest.raises(ContractDefinitionError, match="has no parameter 'kl_term'"):
        @contract
        def unknown(kl: Tensor) -> Annotated[Tensor, Penalty("kl_term")]:
            return kl

    with pytest.raises(ContractDefinitionError, match="rtol"):
        Bonus("entropy", rtol=-1)
