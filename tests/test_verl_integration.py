"""rlguard.integrations.verl against real verl (0.9.1): the wrapped contracts pass every registered policy loss and
advantage estimator on healthy inputs and return exactly what verl returns; user-style faults fail with their
code (a custom loss with an unnegated surrogate, an estimator centred over the whole batch, a reward-side KL with
the wrong sign, old log-probs recomputed from the live actor with autograd); the preflight drives verl's own
math; a violation in a Ray worker names its rank and role and does not hang.

Runs in the verl environment (``.venv-verl``, ``.ci/run``'s second step): verl's transformers range cannot share
one with the [trl] extra, so in the main environment this file is skipped.
"""

from __future__ import annotations

import inspect
import json
import logging
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path
from typing import Annotated

import pytest

pytest.importorskip("verl", reason="verl is not installed: the verl integration's tests run in the [verl] "
                                   "environment (.ci/run's second step, .venv-verl)")
warnings.filterwarnings("ignore", module="verl")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from jaxtyping import Float, Int  # noqa: E402
from torch import Tensor  # noqa: E402

import rlguard.integrations.verl as rlguard_verl  # noqa: E402
from rlguard.catalog import (ADVANTAGE_SIGN, DETACHED_TARGETS, GROUP_BASELINE, KL_SIGN, LENGTH_BIAS,  # noqa: E402
                             ROWS_OUT_OF_STEP, TENSOR_CONTRACT)
from rlguard.contracts import ContractViolation, Mask, contract  # noqa: E402
from rlguard.contracts.settings import reset_warnings  # noqa: E402
from rlguard.integrations.verl import _version, checks  # noqa: E402
from rlguard.preflight.suite import run_suite  # noqa: E402
from rlguard.reference.model import ModelConfig, build_model  # noqa: E402
from verl import DataProto  # noqa: E402
from verl.trainer.config import AlgoConfig  # noqa: E402
from verl.trainer.ppo import core_algos  # noqa: E402
from verl.workers.config import FSDPActorConfig, PolicyLossConfig  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.verl
B, R, G = 8, 5, 4  # episodes, response tokens, episodes per prompt


@pytest.fixture(autouse=True)
def _clean():
    """Every test starts and ends with verl's own functions in place and no warn-once memory."""
    rlguard_verl.uninstall()
    reset_warnings()
    yield
    rlguard_verl.uninstall()


@pytest.fixture()
def installed():
    return rlguard_verl.install("raise")


def actor_config(**kw) -> FSDPActorConfig:
    policy_loss = PolicyLossConfig(dro_beta=0.1)  # DRO refuses to run without one
    return FSDPActorConfig(strategy="fsdp", rollout_n=G, ppo_micro_batch_size_per_gpu=2, policy_loss=policy_loss,
                           **kw)


def policy_inputs(seed: int = 0) -> dict:
    """A micro-batch as verl's ppo_loss passes it: old log-probs without autograd, current ones with it, token
    advantages, a bool response mask with some right padding."""
    gen = torch.Generator().manual_seed(seed)
    old = torch.randn(B, R, generator=gen) - 2
    logp = (old + 0.1 * torch.randn(B, R, generator=gen)).requires_grad_()
    mask = torch.ones(B, R, dtype=torch.bool)
    mask[0, 3:] = mask[5, 1:] = False
    return {"old_log_prob": old, "log_prob": logp, "advantages": torch.randn(B, R, generator=gen),
            "response_mask": mask, "loss_agg_mode": "token-mean", "config": actor_config(),
            "rollout_is_weights": None}


def outcome_rewards(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-level rewards as verl's reward managers write them (the score on the last response token)."""
    gen = torch.Generator().manual_seed(seed)
    mask = torch.ones(B, R, dtype=torch.long)
    mask[1, 2:] = mask[6, 4:] = 0
    rewards = torch.zeros(B, R)
    rewards[torch.arange(B), mask.sum(1) - 1] = torch.rand(B, generator=gen)
    return rewards, mask


def uid(order=None) -> np.ndarray:
    out = np.array([f"prompt-{i // G}" for i in range(B)], dtype=object)
    return out if order is None else out[order]


def estimator_kwargs(fn, seed: int = 0) -> dict:
    """The arguments verl's compute_advantage gives ``fn`` (those its signature takes)."""
    rewards, mask = outcome_rewards(seed)
    gen = torch.Generator().manual_seed(seed + 1)
    offered = {
        "token_level_rewards": rewards, "response_mask": mask, "index": uid(),
        "config": AlgoConfig(adv_estimator="grpo", gdpo_reward_keys=["score"]),
        "values": torch.randn(B, R, generator=gen),
        "gamma": 1.0, "lam": 0.95, "reward_baselines": torch.rand(B, generator=gen),
        "old_log_probs": -torch.rand(B, R, generator=gen), "sum_pi_squared": 0.5 * torch.rand(B, R, generator=gen),
        "non_tensor_batch": {"score": rewards.sum(-1).numpy()},
        "batch": {"prompts": torch.zeros(B, 3, dtype=torch.long),
                  "attention_mask": torch.cat([torch.ones(B, 3, dtype=torch.long), mask], 1)},
    }
    params = inspect.signature(fn).parameters
    return {k: v for k, v in offered.items() if k in params}


def same(a, b) -> bool:
    """Bit-identical results: tensors equal in every bit, containers element by element."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a.detach(), b.detach())
    if isinstance(a, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return a == b


# ---------------------------------------------------------------------------------------------- packaging


def _pyproject() -> dict:
    import tomllib

    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_the_extra_pins_the_range_the_code_enforces():
    project = _pyproject()
    extra = project["project"]["optional-dependencies"]["verl"]
    assert [r for r in extra if r.startswith("verl")] == [f"verl{_version.SUPPORTED_VERL}"]
    assert set(project["project"]["optional-dependencies"]["torch"]) <= set(extra)
    assert "rlguard.integrations.verl" in project["tool"]["setuptools"]["packages"]
    assert _version.supported(rlguard_verl.VERL_VERSION)


@pytest.mark.parametrize("version, ok", [("0.9.1", True), ("0.9.7", True), ("0.9.1rc1", True), ("0.9.0", False),
                                         ("0.10.0", False), ("1.0", False), ("0.8.5", False)])
def test_supported_versions(version, ok):
    assert _version.supported(version) is ok


def test_other_verl_versions_are_refused_naming_the_range(monkeypatch):
    monkeypatch.setattr(_version.metadata, "version", lambda name: "0.8.3")
    with pytest.raises(_version.UnsupportedVerlError, match=r"supports verl >=0.9.1,<0.10; verl 0.8.3 is installed"):
        _version.require_supported_verl()

    def absent(name):
        raise _version.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(_version.metadata, "version", absent)
    with pytest.raises(ImportError, match=r"needs verl >=0.9.1,<0.10, which is not installed"):
        _version.require_supported_verl()


def _python(code: str, **env) -> subprocess.CompletedProcess:
    environment = {**os.environ, **env}
    return subprocess.run([sys.executable, "-W", "ignore", "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=240, env=environment, cwd=ROOT)


def test_importing_the_integration_imports_no_verl_until_install():
    proc = _python("""
        import sys
        import rlguard.integrations.verl as rv
        assert not [m for m in sys.modules if m == "verl" or m.startswith("verl.")], "verl imported"
        rv.install("warn")
        assert "verl.trainer.ppo.core_algos" in sys.modules
        print("ok")
    """)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


def test_the_environment_variable_installs_the_checks_at_import():
    code = """
        import rlguard.integrations.verl as rv
        inst = rv.installed()
        from verl.workers.utils import losses  # imported after: it reads the wrapped functions
        from verl.trainer.ppo import core_algos
        print(inst and inst.mode, bool(getattr(losses.agg_loss, "__rlguard_verl__", None)),
              bool(getattr(core_algos.get_policy_loss_fn("vanilla"), "__rlguard_verl__", None)))
    """
    assert _python(code, RLGUARD_VERL="warn").stdout.split() == ["warn", "True", "True"]
    assert _python(code, RLGUARD_VERL="off").stdout.split() == ["None", "False", "False"]
    unknown = _python(code, RLGUARD_VERL="loud")
    assert unknown.stdout.split() == ["raise", "True", "True"]
    assert "RLGUARD_VERL='loud' is not one of raise/warn/off; using 'raise'" in unknown.stderr


# ---------------------------------------------------------------------------------------------- healthy verl


@pytest.mark.parametrize("name", sorted(core_algos.POLICY_LOSS_REGISTRY))
def test_every_registered_policy_loss_passes_and_returns_what_verl_returns(installed, name):
    wrapped = core_algos.get_policy_loss_fn(name)
    assert wrapped.__rlguard_verl__ == f"verl policy loss {name!r}"
    inputs = policy_inputs()
    torch.manual_seed(0)  # clip_cov draws a permutation from the global generator
    expected = wrapped.__wrapped__(**inputs)
    torch.manual_seed(0)
    got = wrapped(**inputs)
    assert same(got, expected)
    assert not installed.switched_off


@pytest.mark.parametrize("name", sorted(core_algos.ADV_ESTIMATOR_REGISTRY))
def test_every_registered_estimator_passes_and_returns_what_verl_returns(installed, name):
    wrapped = core_algos.get_adv_estimator_fn(name)
    assert wrapped.__rlguard_verl__ == f"verl advantage estimator {name!r}"
    expected = wrapped.__wrapped__(**estimator_kwargs(wrapped))
    assert same(wrapped(**estimator_kwargs(wrapped)), expected)
    assert not installed.switched_off


@pytest.mark.parametrize("name", sorted(checks.GROUP_RELATIVE))
def test_group_relative_estimators_pass_with_groups_in_any_order(installed, name):
    """verl balances its batches across ranks, so a group's episodes need not be contiguous: the groups are read
    from index."""
    order = torch.randperm(B, generator=torch.Generator().manual_seed(3))
    kwargs = estimator_kwargs(core_algos.ADV_ESTIMATOR_REGISTRY[name])
    kwargs["token_level_rewards"], kwargs["response_mask"] = kwargs["token_level_rewards"][order], \
        kwargs["response_mask"][order]
    kwargs["index"] = uid(order.numpy())
    core_algos.get_adv_estimator_fn(name)(**kwargs)


def test_grpo_as_compute_advantage_calls_it_is_checked(installed):
    """verl's driver calls GRPO (and GAE) as module functions, not through the registry."""
    from verl.trainer.ppo.ray_trainer import compute_advantage

    rewards, mask = outcome_rewards()
    rewards[:G] = rewards[:G] + 1.0  # a whole-batch baseline would now leave group 0 off centre
    data = DataProto.from_dict(tensors={"token_level_rewards": rewards, "response_mask": mask},
                               non_tensors={"uid": uid()})
    assert core_algos.compute_grpo_outcome_advantage.__rlguard_verl__ == "verl advantage estimator 'grpo'"
    out = compute_advantage(data, adv_estimator="grpo", num_repeat=G)
    assert out.batch["advantages"].shape == (B, R)


@pytest.mark.parametrize("mode", ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean",
                                  "seq-mean-token-sum-norm"])
def test_agg_loss_passes_every_mode_and_notes_the_length_biased_one_once(installed, mode, caplog):
    inputs = policy_inputs()
    with caplog.at_level(logging.WARNING, logger="rlguard.contracts"):
        for _ in range(3):
            got = core_algos.agg_loss(loss_mat=inputs["log_prob"], loss_mask=inputs["response_mask"],
                                      loss_agg_mode=mode)
    assert same(got, core_algos.agg_loss.__wrapped__(inputs["log_prob"], inputs["response_mask"], mode))
    notes = [r.getMessage() for r in caplog.records if f"{LENGTH_BIAS} note" in r.getMessage()]
    assert len(notes) == (1 if mode == "seq-mean-token-mean" else 0)


def test_the_length_bias_note_names_the_policy_loss_that_aggregates(installed, caplog):
    """SAPO aggregates with seq-mean-token-mean whatever loss_agg_mode says."""
    with caplog.at_level(logging.WARNING, logger="rlguard.contracts"):
        core_algos.get_policy_loss_fn("sapo")(**policy_inputs())
    assert any("verl policy loss 'sapo' aggregates with loss_agg_mode='seq-mean-token-mean'" in r.getMessage()
               for r in caplog.records)


@pytest.mark.parametrize("kind", ["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3", "k3+", "k1+"])
def test_kl_penalty_passes_every_estimator(installed, kind):
    inputs = policy_inputs()
    got = core_algos.kl_penalty(logprob=inputs["log_prob"], ref_logprob=inputs["old_log_prob"], kl_penalty=kind)
    assert same(got, core_algos.kl_penalty.__wrapped__(inputs["log_prob"], inputs["old_log_prob"], kind))


# ---------------------------------------------------------------------------------------------- faults


def test_a_reference_with_autograd_in_kl_penalty_is_rlg003(installed):
    inputs = policy_inputs()
    with pytest.raises(ContractViolation) as exc:
        core_algos.kl_penalty(inputs["log_prob"], inputs["log_prob"] * 1.0, kl_penalty="low_var_kl")
    assert exc.value.code == DETACHED_TARGETS and exc.value.function == "verl kl_penalty"
    assert exc.value.argument == "ref_logprob"


class TinyActor(torch.nn.Module):
    """A policy over R response positions: log-probs of fixed response tokens from learned logits."""

    def __init__(self):
        super().__init__()
        self.logits = torch.nn.Parameter(torch.randn(B, R, 6, generator=torch.Generator().manual_seed(0)))
        self.register_buffer("tokens", torch.randint(0, 6, (B, R), generator=torch.Generator().manual_seed(1)))

    def forward(self) -> torch.Tensor:
        return torch.log_softmax(self.logits, -1).gather(-1, self.tokens[..., None]).squeeze(-1)


def test_old_log_probs_recomputed_from_the_live_actor_with_autograd_are_rlg003(installed):
    actor = TinyActor()
    inputs = policy_inputs()
    inputs["old_log_prob"] = actor()  # the fault: recomputed from the live actor, autograd on
    inputs["log_prob"] = actor()
    with pytest.raises(ContractViolation) as exc:
        core_algos.get_policy_loss_fn("vanilla")(**inputs)
    assert exc.value.code == DETACHED_TARGETS and exc.value.argument == "old_log_prob"
    assert exc.value.function == "verl policy loss 'vanilla'"
    with torch.no_grad():  # the fix: computed once, without autograd, as verl's compute_log_prob does
        inputs["old_log_prob"] = actor()
    core_algos.get_policy_loss_fn("vanilla")(**inputs)


def test_through_verl_ppo_loss_the_actor_path_is_checked(installed):
    """The actor's own loss function (verl.workers.utils.losses.ppo_loss, imported before install) looks the
    policy loss up through the wrapped registry and aggregates with the wrapped agg_loss."""
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.losses import ppo_loss

    inputs = policy_inputs()
    prompts = torch.ones(B, 3, dtype=torch.long)
    mask = torch.ones(B, R, dtype=torch.long)
    attention = torch.cat([torch.ones_like(prompts), mask], 1)
    data = TensorDict({"prompts": prompts, "responses": torch.ones(B, R, dtype=torch.long), "attention_mask": attention,
                       "response_mask": mask, "old_log_probs": inputs["log_prob"] * 1.0,  # autograd on: the fault
                       "advantages": inputs["advantages"]}, batch_size=[B])
    tu.assign_non_tensor(data, dp_size=1, batch_num_tokens=int(mask.sum()), global_batch_size=B)
    packed = torch.cat([torch.zeros(B, 2), inputs["log_prob"], torch.zeros(B, 1)], 1)[attention.bool()]
    with pytest.raises(ContractViolation) as exc:
        ppo_loss(actor_config(), {"log_probs": packed}, data)
    assert exc.value.code == DETACHED_TARGETS and exc.value.function == "verl policy loss 'vanilla'"


def test_a_mask_of_another_length_is_refused_before_verl_runs(installed):
    calls = []

    @core_algos.register_policy_loss("counted")
    def counted(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None,
                rollout_is_weights=None):
        calls.append(1)
        return core_algos.agg_loss(-advantages * torch.exp(log_prob - old_log_prob), response_mask, loss_agg_mode), {}

    inputs = policy_inputs()
    inputs["response_mask"] = torch.ones(B, R + 1)  # the prompt's last token included
    with pytest.raises(ContractViolation) as exc:
        core_algos.get_policy_loss_fn("counted")(**inputs)
    assert exc.value.code == TENSOR_CONTRACT and exc.value.argument == "response_mask"
    assert "dim 1 (R) is 6, but R=5" in str(exc.value) and not calls


def batch_centred(token_level_rewards, response_mask, index, config=None, **kwargs):
    """A user's GRPO whose baseline is the batch mean: the groups of index are ignored (the fault)."""
    scores = token_level_rewards.sum(-1)
    scores = (scores - scores.mean()) / (scores.std() + 1e-6)  # the fault: the batch's mean
    return scores[:, None] * response_mask, scores[:, None] * response_mask


def group_centred(token_level_rewards, response_mask, index, config=None, **kwargs):
    """The same estimator, centred per group of index."""
    scores = token_level_rewards.sum(-1)
    groups = torch.as_tensor(np.unique(index, return_inverse=True)[1])
    means = torch.zeros(int(groups.max()) + 1).index_add(0, groups, scores) / torch.bincount(groups)
    return (scores - means[groups])[:, None] * response_mask, (scores - means[groups])[:, None] * response_mask


def _registered(name: str, fn) -> None:
    core_algos.ADV_ESTIMATOR_REGISTRY.pop(name, None)
    core_algos.register_adv_est(name)(fn)


@pytest.mark.parametrize("when", ["before install", "after install", "through a decorator taken before install"])
def test_an_estimator_centred_over_the_whole_batch_is_rlg009(when):
    register = core_algos.register_adv_est  # held by a user's module before install()
    core_algos.ADV_ESTIMATOR_REGISTRY.pop("my_grpo", None)
    if when == "before install":
        register("my_grpo")(batch_centred)
    rlguard_verl.install("raise")
    if when == "after install":
        _registered("my_grpo", batch_centred)
    elif when != "before install":
        register("my_grpo")(batch_centred)
    rewards, mask = outcome_rewards()
    rewards[:G] = rewards[:G] + 1.0  # group 0 scores higher: a batch mean leaves it off centre
    with pytest.raises(ContractViolation) as exc:
        core_algos.get_adv_estimator_fn("my_grpo")(token_level_rewards=rewards, response_mask=mask, index=uid())
    assert exc.value.code == GROUP_BASELINE and exc.value.argument == "return[0]"
    assert "centred over the whole batch" in str(exc.value)
    core_algos.ADV_ESTIMATOR_REGISTRY.pop("my_grpo", None)
    _registered("my_grpo", group_centred)  # the fix passes
    core_algos.get_adv_estimator_fn("my_grpo")(token_level_rewards=rewards, response_mask=mask, index=uid())
    core_algos.ADV_ESTIMATOR_REGISTRY.pop("my_grpo", None)


def test_an_estimator_declared_not_group_relative_is_not_held_to_it():
    rlguard_verl.install("raise", group_relative={"my_whitened": None})
    _registered("my_whitened", batch_centred)
    rewards, mask = outcome_rewards()
    rewards[:G] += 1.0
    core_algos.get_adv_estimator_fn("my_whitened")(token_level_rewards=rewards, response_mask=mask, index=uid())
    core_algos.ADV_ESTIMATOR_REGISTRY.pop("my_whitened", None)


def test_verls_duplicate_registration_check_still_applies(installed):
    _registered("mine", group_centred)
    core_algos.register_adv_est("mine")(group_centred)  # the same function again: accepted, as by verl
    with pytest.raises(ValueError, match="has already been registered"):
        core_algos.register_adv_est("mine")(batch_centred)
    assert core_algos.ADV_ESTIMATOR_REGISTRY["mine"].__wrapped__ is group_centred
    core_algos.ADV_ESTIMATOR_REGISTRY.pop("mine", None)


def test_warn_mode_logs_once_and_returns_what_verl_returns(caplog):
    rlguard_verl.install("warn")
    inputs = policy_inputs()
    inputs["old_log_prob"] = inputs["log_prob"] * 1.0
    with caplog.at_level(logging.WARNING, logger="rlguard.contracts"):
        results = [core_algos.get_policy_loss_fn("vanilla")(**inputs) for _ in range(3)]
    expected = core_algos.POLICY_LOSS_REGISTRY["vanilla"].__wrapped__(**inputs)
    assert all(same(r, expected) for r in results)
    found = [r.getMessage() for r in caplog.records if DETACHED_TARGETS in r.getMessage()]
    assert len(found) == 1 and "verl policy loss 'vanilla'" in found[0]


def test_uninstall_puts_verls_own_functions_back():
    from verl.workers.utils import losses

    originals = (dict(core_algos.POLICY_LOSS_REGISTRY), dict(core_algos.ADV_ESTIMATOR_REGISTRY),
                 core_algos.agg_loss, core_algos.kl_penalty, losses.agg_loss, losses.get_policy_loss_fn,
                 core_algos.register_adv_est, core_algos.compute_grpo_outcome_advantage)
    rlguard_verl.install("raise")
    assert losses.agg_loss is not originals[4] and losses.agg_loss.__wrapped__ is originals[4]
    rlguard_verl.uninstall()
    after = (dict(core_algos.POLICY_LOSS_REGISTRY), dict(core_algos.ADV_ESTIMATOR_REGISTRY),
             core_algos.agg_loss, core_algos.kl_penalty, losses.agg_loss, losses.get_policy_loss_fn,
             core_algos.register_adv_est, core_algos.compute_grpo_outcome_advantage)
    assert all(a == b if isinstance(a, dict) else a is b for a, b in zip(originals, after))


# ---------------------------------------------------------------------------------------------- no perturbation


def _train(steps: int, kl: bool = True) -> tuple[dict, torch.Tensor]:
    """A tiny actor stepped with verl's vanilla policy loss, its KL loss and agg_loss, as ppo_loss composes them."""
    torch.manual_seed(0)
    actor = TinyActor()
    reference = TinyActor().requires_grad_(False)
    optimizer = torch.optim.AdamW(actor.parameters(), lr=1e-2)
    config = actor_config()
    inputs = policy_inputs()
    for _ in range(steps):
        with torch.no_grad():
            old = actor()
        for _ in range(2):  # two mini-batch steps on one rollout: the ratio leaves 1
            optimizer.zero_grad()
            logp = actor()
            loss, _ = core_algos.get_policy_loss_fn("vanilla")(
                old_log_prob=old, log_prob=logp, advantages=inputs["advantages"],
                response_mask=inputs["response_mask"], loss_agg_mode="token-mean", config=config)
            if kl:
                kld = core_algos.kl_penalty(logprob=logp, ref_logprob=reference().detach(), kl_penalty="low_var_kl")
                loss = loss + 0.1 * core_algos.agg_loss(loss_mat=kld, loss_mask=inputs["response_mask"],
                                                        loss_agg_mode="token-mean")
            loss.backward()
            optimizer.step()
    return {k: v.detach().clone() for k, v in actor.state_dict().items()}, torch.get_rng_state()


def test_parameters_after_n_steps_are_bit_identical_with_the_integration_on_and_off():
    off, rng_off = _train(steps=5)
    installation = rlguard_verl.install("raise")
    on, rng_on = _train(steps=5)
    assert not installation.switched_off
    assert on.keys() == off.keys() and all(torch.equal(on[k], off[k]) for k in on)
    assert torch.equal(rng_on, rng_off)
    moved, _ = _train(steps=0)
    assert not torch.equal(moved["logits"], on["logits"])  # the run did train


# ---------------------------------------------------------------------------------------------- rlguard's own errors


def test_an_internal_error_is_logged_once_and_switches_that_check_off(monkeypatch, caplog):
    installation = rlguard_verl.install("raise")

    def broken(*args, **kwargs):
        raise RuntimeError("a bug in rlguard")

    monkeypatch.setattr(checks.CentredPerIndex, "_group_stats", broken)
    grpo = core_algos.get_adv_estimator_fn("grpo")
    kwargs = estimator_kwargs(grpo)
    expected = grpo.__wrapped__(**estimator_kwargs(grpo))
    with caplog.at_level(logging.ERROR, logger="rlguard.contracts"):
        results = [grpo(**estimator_kwargs(grpo)) for _ in range(3)]
    assert all(same(r, expected) for r in results) and kwargs
    errors = [r.getMessage() for r in caplog.records if "internal error" in r.getMessage()]
    assert len(errors) == 1 and "verl advantage estimator 'grpo'" in errors[0] and "a bug in rlguard" in errors[0]
    assert list(installation.switched_off) == ["verl advantage estimator 'grpo'"]
    inputs = policy_inputs()
    inputs["old_log_prob"] = inputs["log_prob"] * 1.0
    with pytest.raises(ContractViolation):  # the other functions' checks still run
        core_algos.get_policy_loss_fn("vanilla")(**inputs)


def test_an_internal_error_before_the_call_still_runs_verl_once(monkeypatch):
    from rlguard.integrations.verl import wrappers

    installation = rlguard_verl.install("raise")

    def broken():
        raise RuntimeError("no context")

    monkeypatch.setattr(wrappers, "describe_place", broken)
    calls = []
    vanilla = core_algos.POLICY_LOSS_REGISTRY["vanilla"].__wrapped__

    @core_algos.register_policy_loss("counted_twice")
    def counted(**kwargs):
        calls.append(1)
        return vanilla(**kwargs)

    out = core_algos.get_policy_loss_fn("counted_twice")(**policy_inputs())
    assert same(out, vanilla(**policy_inputs())) and calls == [1]
    assert "verl policy loss 'counted_twice'" in installation.switched_off
    core_algos.POLICY_LOSS_REGISTRY.pop("counted_twice", None)


def test_a_loss_that_does_not_take_verls_argument_names_is_said_once_and_left_alone(installed, caplog):
    vanilla = core_algos.POLICY_LOSS_REGISTRY["vanilla"].__wrapped__

    @core_algos.register_policy_loss("positional")
    def positional(*args):
        return vanilla(*args)

    inputs = policy_inputs()
    with caplog.at_level(logging.WARNING, logger="rlguard.contracts"):
        for _ in range(2):
            out = core_algos.get_policy_loss_fn("positional")(*inputs.values())
    assert same(out, vanilla(**inputs))
    said = [r.getMessage() for r in caplog.records if "is not checked" in r.getMessage()]
    assert said == ["rlguard: verl policy loss 'positional' is not checked: it takes no argument 'old_log_prob', "
                    "which verl passes by that name"]
    core_algos.POLICY_LOSS_REGISTRY.pop("positional", None)


def test_verls_own_error_reaches_the_run_unchanged(installed):
    inputs = policy_inputs()
    inputs["config"] = None  # verl asserts a config
    with pytest.raises(AssertionError) as exc:
        core_algos.get_policy_loss_fn("vanilla")(**inputs)
    assert not isinstance(exc.value, ContractViolation) and not installed.switched_off


# ---------------------------------------------------------------------------------------------- DataProto specs

SCORED = rlguard_verl.DataProtoSpec(
    batch={"responses": Int[Tensor, "B R"], "response_mask": Mask[Tensor, "B R"],
           "token_level_scores": Float[Tensor, "B R"]},
    non_tensor={"uid": np.ndarray}, meta_info={"global_steps": int})


@contract
def shaped_rewards(data: Annotated[DataProto, SCORED]) -> Float[Tensor, "B R"]:
    return data.batch["token_level_scores"] * data.batch["response_mask"]


def scored(uids: int = B, mask_width: int = R) -> DataProto:
    rewards, _ = outcome_rewards()
    data = DataProto.from_dict(
        tensors={"responses": torch.ones(B, R, dtype=torch.long), "response_mask": torch.ones(B, mask_width),
                 "token_level_scores": rewards},
        non_tensors={"uid": np.array([f"u{i}" for i in range(B)], dtype=object)}, meta_info={"global_steps": 3})
    if uids != B:  # DataProto checks the lengths when it is made, not when an entry is replaced afterwards
        data.non_tensor_batch["uid"] = data.non_tensor_batch["uid"][:uids]
    return data


def test_a_dataproto_spec_passes_a_healthy_batch():
    assert shaped_rewards(scored()).shape == (B, R)


def test_a_uid_array_out_of_step_with_the_tensors_is_rlg019():
    with pytest.raises(ContractViolation) as exc:
        shaped_rewards(scored(uids=B - 2))
    assert exc.value.code == ROWS_OUT_OF_STEP and exc.value.argument == "data.non_tensor_batch['uid']"
    assert "has 6 entries, but the batch's tensors have B=8 rows" in str(exc.value)


def test_a_dataproto_tensor_of_another_shape_or_a_missing_key_is_rlg000():
    with pytest.raises(ContractViolation) as exc:
        shaped_rewards(scored(mask_width=R + 1))
    assert exc.value.code == TENSOR_CONTRACT and exc.value.argument == "data.batch['response_mask']"
    data = scored()
    data.batch.pop("token_level_scores")
    with pytest.raises(ContractViolation, match="has no key 'token_level_scores'"):
        shaped_rewards(data)


# ---------------------------------------------------------------------------------------------- the preflight


def failed(report) -> dict:
    return {c.name: c.code for c in report.checks if not c.passed}


def ran(report, name: str) -> bool:
    return any(c.name == name and not c.skipped for c in report.checks)


def test_the_preflight_passes_verls_grpo_with_its_kl_loss_and_entropy_bonus():
    report = run_suite(rlguard_verl.verl_adapter(use_kl_loss=True, kl_loss_coef=0.1, entropy_coeff=0.01))
    assert report.passed, failed(report)
    for name in ("group_mean", "accumulation", "advantage_direction", "kl_positive", "kl_direction",
                 "entropy_direction", "old_logp_frozen", "ratio_one", "mask_policy", "stop_token_trained"):
        assert ran(report, name), name


@pytest.mark.parametrize("name", sorted(set(core_algos.ADV_ESTIMATOR_REGISTRY) - {"gae"}))
def test_the_preflight_passes_every_registered_estimator_but_gae(name):
    report = run_suite(rlguard_verl.verl_adapter(adv_estimator=name))
    assert report.passed and not report.errors, failed(report)
    assert ran(report, "group_mean") is (checks.GROUP_RELATIVE.get(name) == "sequence")


@pytest.mark.parametrize("name", sorted(core_algos.POLICY_LOSS_REGISTRY))
def test_the_preflight_passes_every_registered_policy_loss(name):
    adapter = rlguard_verl.verl_adapter(loss_mode=name, policy_loss={"dro_beta": 0.1})
    report = run_suite(adapter)
    assert report.passed and not report.errors, failed(report)
    assert set(report.warnings) <= set(adapter.documented_deviations())
    if name == "geo_mean":  # its per-micro-batch torch.mean: the accumulated gradient is twice the one-pass one
        assert report.warnings == ["accumulation"]
        assert next(c.value for c in report.checks if c.name == "accumulation") == pytest.approx(1.0, rel=1e-3)


def test_the_preflight_refuses_gae_and_unknown_settings():
    with pytest.raises(rlguard_verl.VerlPreflightError, match="GAE needs a critic"):
        rlguard_verl.verl_adapter(adv_estimator="gae")
    with pytest.raises(rlguard_verl.VerlPreflightError, match="unknown verl preflight setting"):
        rlguard_verl.verl_adapter(clip_raito=0.3)


VERL_CONFIG = {
    "data": {"train_batch_size": 64},
    "algorithm": {"adv_estimator": "rloo", "use_kl_in_reward": True, "kl_penalty": "kl",
                  "kl_ctrl": {"type": "fixed", "kl_coef": 0.1}},
    "actor_rollout_ref": {"actor": {"policy_loss": {"loss_mode": "gspo"}, "loss_agg_mode": "seq-mean-token-mean",
                                    "clip_ratio_low": 0.0003, "clip_ratio_high": 0.0004, "ppo_mini_batch_size": 32,
                                    "ppo_micro_batch_size_per_gpu": 8},
                          "rollout": {"n": 4, "temperature": 1.0}},
}


def test_the_preflight_reads_a_verl_config_dict_and_a_saved_yaml(tmp_path):
    from omegaconf import OmegaConf

    adapter = rlguard_verl.verl_adapter(VERL_CONFIG)
    choices = adapter.choices
    assert (choices.algorithm.adv_estimator, choices.loss_mode, choices.actor.loss_agg_mode, choices.n,
            choices.mini_batches, choices.micro_batches, choices.algorithm.kl_ctrl.kl_coef) == \
        ("rloo", "gspo", "seq-mean-token-mean", 4, 2, 16, 0.1)
    OmegaConf.save(OmegaConf.create(VERL_CONFIG), tmp_path / "config.yaml")
    assert rlguard_verl.verl_adapter(tmp_path / "config.yaml").choices == choices
    report = run_suite(adapter)
    assert report.passed, failed(report)
    assert rlguard_verl.verl_adapter(VERL_CONFIG, adv_estimator="grpo").choices.algorithm.adv_estimator == "grpo"


@pytest.fixture()
def unnegated_loss():
    @core_algos.register_policy_loss("unnegated")
    def unnegated(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None,
                  rollout_is_weights=None):
        """A user's PPO surrogate that lost its minus: minimising it makes low-advantage tokens likelier."""
        ratio = torch.exp(log_prob - old_log_prob)
        surrogate = torch.minimum(ratio * advantages, ratio.clamp(0.8, 1.2) * advantages)
        return core_algos.agg_loss(surrogate, response_mask, loss_agg_mode,  # the fault: no minus
                                   **config.global_batch_info), {}

    yield "unnegated"
    core_algos.POLICY_LOSS_REGISTRY.pop("unnegated", None)


def test_a_custom_loss_with_an_unnegated_surrogate_fails_advantage_direction(unnegated_loss):
    report = run_suite(rlguard_verl.verl_adapter(loss_mode=unnegated_loss))
    assert failed(report) == {"advantage_direction": ADVANTAGE_SIGN}


def test_an_estimator_centred_over_the_whole_batch_fails_group_mean():
    _registered("my_grpo", batch_centred)
    try:
        report = run_suite(rlguard_verl.verl_adapter(adv_estimator="my_grpo"))
        assert failed(report) == {"group_mean": GROUP_BASELINE}
        _registered("my_grpo", group_centred)
        assert run_suite(rlguard_verl.verl_adapter(adv_estimator="my_grpo")).passed
    finally:
        core_algos.ADV_ESTIMATOR_REGISTRY.pop("my_grpo", None)


def kl_added_to_the_reward(data, kl_ctrl, kl_penalty="kl"):
    """A user's apply_kl_penalty (verl's, from ray_trainer) with the sign of the penalty flipped."""
    kld = core_algos.kl_penalty(data.batch["old_log_probs"], data.batch["ref_log_prob"], kl_penalty=kl_penalty)
    kld = kld * data.batch["response_mask"]
    data.batch["token_level_rewards"] = data.batch["token_level_scores"] + kl_ctrl.value * kld  # noqa: RLG011 (the fault)
    return data, {}


def test_a_reward_side_kl_with_the_wrong_sign_fails_kl_direction():
    healthy = run_suite(rlguard_verl.verl_adapter(use_kl_in_reward=True, kl_coef=0.1))
    assert healthy.passed and ran(healthy, "kl_direction"), failed(healthy)
    faulty = run_suite(rlguard_verl.verl_adapter(use_kl_in_reward=True, kl_coef=0.1,
                                                 apply_kl_penalty=kl_added_to_the_reward))
    assert failed(faulty) == {"kl_direction": KL_SIGN}


def test_old_log_probs_scored_with_autograd_fail_targets_detached_and_the_wrapped_loss(installed):
    adapter = rlguard_verl.verl_adapter()
    adapter.choices.old_log_prob_fn = adapter.response_log_probs  # the live actor, autograd on
    report = run_suite(adapter, only=["targets_detached"])
    assert failed(report) == {"targets_detached": DETACHED_TARGETS}
    model = adapter.build_model()
    batch = adapter.make_batch(model, 0)
    with pytest.raises(ContractViolation) as exc:  # in training, the wrapped policy loss stops the update
        adapter.update(model, adapter.make_optimizer(model), None, batch)
    assert exc.value.code == DETACHED_TARGETS and exc.value.function == "verl policy loss 'vanilla'"


def test_rlguard_check_runs_the_adapter_from_a_module(tmp_path, monkeypatch, capsys):
    from rlguard.preflight.cli import check_main

    (tmp_path / "my_verl_check.py").write_text(
        "from rlguard.integrations.verl import verl_adapter\n"
        "adapter = verl_adapter(adv_estimator='rloo', use_kl_loss=True, kl_loss_coef=0.1)\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert check_main(["my_verl_check:adapter", "-q"]) == 0
    assert "all checks passed" in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------- Ray workers


def test_a_violation_in_a_ray_worker_names_rank_and_role_and_does_not_hang():
    pytest.importorskip("ray", reason="ray is not installed")
    job = subprocess.Popen([sys.executable, str(ROOT / "tests" / "verl_ray_job.py"), "--faulty-rank", "1"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                           env={**os.environ, "PYTHONWARNINGS": "ignore"})
    try:
        out, err = job.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        job.kill()
        out, err = job.communicate()
        phases = [json.loads(line)["phase"] for line in out.splitlines() if line.startswith("{")]
        if "ray up" not in phases:
            pytest.skip("a local Ray did not start on this machine within the time given")
        pytest.fail(f"the Ray job hung after {phases}:\n{err[-3000:]}")
    phases = {json.loads(line)["phase"]: json.loads(line) for line in out.splitlines() if line.startswith("{")}
    if "ray up" not in phases:
        pytest.skip(f"a local Ray does not start on this machine: {err[-500:]}")
    if phases["ray up"]["seconds"] > 60:
        pytest.skip(f"a local Ray took {phases['ray up']['seconds']} s to start (more than 60 s)")
    assert "done" in phases, err[-3000:]
    assert [r["installed"] for r in phases["healthy"]["results"]] == ["raise", "raise"]
    faulty = phases["faulty"]
    assert faulty["cause"] == "ContractViolation" and faulty["code"] == DETACHED_TARGETS
    assert faulty["ranks"] == [1]
    assert "verl policy loss 'vanilla' [rank 1 of 2, role actor]" in faulty["message"]


# ---------------------------------------------------------------------------------------------- docs/verl.md

DOC = ROOT / "docs" / "verl.md"


def _doc_block(kind: str, starting: str = "") -> str:
    import re

    blocks = re.findall(rf"```{kind}\n(.*?)```", DOC.read_text(), flags=re.S)
    (found,) = [b for b in blocks if b.startswith(starting)]
    return found


def _columns(table: str) -> list[tuple[str, ...]]:
    """(check, tolerance, status, code) of each report row (not the measured values), and the summary line."""
    from rlguard.preflight.checks import CHECKS

    rows = []
    for line in table.strip().splitlines():
        cells = line.split()
        if cells and cells[0] in CHECKS:
            at = next(i for i, cell in enumerate(cells[2:], 2) if cell in ("ok", "skip", "FAIL", "warn"))
            rows.append((cells[0], " ".join(cells[2:at]), cells[at], cells[at + 1]))
        elif "passed" in line or "failed" in line:
            rows.append((line.strip(),))
    return rows


def test_the_docs_example_prints_the_report_the_page_shows(tmp_path, monkeypatch, capsys):
    from rlguard.preflight.cli import check_main

    (tmp_path / "my_verl_check.py").write_text(_doc_block("python", "# my_verl_check.py"))
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("my_verl_check", None)
    try:
        assert check_main(["my_verl_check:adapter", "-q"]) == 0
    finally:
        core_algos.POLICY_LOSS_REGISTRY.pop("clipped_is", None)
        sys.modules.pop("my_verl_check", None)
    shown = _doc_block("console", "$ rlguard check my_verl_check:adapter").split("\n", 1)[1]
    assert _columns(capsys.readouterr().out) == _columns(shown)


def test_the_documented_hydra_overrides_reach_ray_init():
    """verl's main_ppo merges ray_kwargs.ray_init.runtime_env into its own runtime_env before ray.init: the two
    overrides of the page, composed into verl's ppo_trainer config, come out as the env var and the setup hook."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf
    from verl.trainer.constants_ppo import get_ppo_ray_runtime_env

    command = _doc_block("bash", "python3 -m verl.trainer.main_ppo")
    overrides = [word for word in command.split() if word.startswith("+ray_kwargs")]
    assert len(overrides) == 2
    config_dir = str(Path(core_algos.__file__).parents[1] / "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        config = compose("ppo_trainer", overrides=overrides)
    # main_ppo.run_ppo's merge, as verl 0.9.1 writes it
    ray_init_kwargs = config.ray_kwargs.get("ray_init", {})
    runtime_env = OmegaConf.merge(get_ppo_ray_runtime_env(config), ray_init_kwargs.get("runtime_env", {}))
    merged = OmegaConf.create({**ray_init_kwargs, "runtime_env": runtime_env})
    runtime_env = OmegaConf.to_container(merged)["runtime_env"]
    assert runtime_env["env_vars"][rlguard_verl.ENV_VAR] == "raise"
    assert runtime_env["worker_process_setup_hook"] == "rlguard.integrations.verl.worker_setup"
