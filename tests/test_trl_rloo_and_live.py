"""TRL's ``RLOOTrainer`` through both surfaces (preflight and callback), trainers the integration does not drive
refused before training starts, faults that start mid-run, NaN rewards, and the callback's own failures never
stopping a run: all against real TRL 1.16 on the tiny model of ``trl_helpers``."""

from __future__ import annotations

import logging
import os
import textwrap
import warnings

import pytest

pytest.importorskip("trl")
torch = pytest.importorskip("torch")

import trl_helpers as h  # noqa: E402

from rlguard.catalog import BY_NAME  # noqa: E402
from rlguard.contracts import ContractViolation  # noqa: E402
from rlguard.contracts import guard as guard_module  # noqa: E402
from rlguard.contracts.settings import reset_warnings  # noqa: E402
from rlguard.integrations.trl import RlguardCallback, UnsupportedTrainerError, preflight  # noqa: E402
from rlguard.integrations.trl import callback as callback_module  # noqa: E402
from rlguard.preflight.report import table  # noqa: E402

pytestmark = pytest.mark.trl
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _quiet():
    reset_warnings()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        yield
    reset_warnings()


def _code(name: str) -> str:
    return BY_NAME[name].code


def _rloo_faults():
    from trl import RLOOTrainer

    return h.fault_classes(RLOOTrainer)


def _dpo_trainer():
    from datasets import Dataset
    from transformers.trainer_callback import PrinterCallback
    from trl import DPOConfig, DPOTrainer

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    data = Dataset.from_dict({"prompt": ["w4 w5", "w6 w7"], "chosen": [" w3", " w4"], "rejected": [" w20", " w21"]})
    args = DPOConfig(output_dir=h.scratch("dpo-"), per_device_train_batch_size=2, max_steps=1, report_to="none",
                     use_cpu=True, save_strategy="no", disable_tqdm=True)
    trainer = DPOTrainer(model=h.model_dir(), args=args, train_dataset=data, processing_class=h.tokenizer())
    trainer.remove_callback(PrinterCallback)
    return trainer


def _sft_trainer():
    from datasets import Dataset
    from transformers.trainer_callback import PrinterCallback
    from trl import SFTConfig, SFTTrainer

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    data = Dataset.from_dict({"text": ["w4 w5 w6 w7", "w8 w9 w10 w11"]})
    args = SFTConfig(output_dir=h.scratch("sft-"), per_device_train_batch_size=2, max_steps=1, report_to="none",
                     use_cpu=True, save_strategy="no", disable_tqdm=True, max_length=16)
    trainer = SFTTrainer(model=h.model_dir(), args=args, train_dataset=data, processing_class=h.tokenizer())
    trainer.remove_callback(PrinterCallback)
    return trainer


def _flip_from(base, step: int):
    class AdvantagesNegatedMidRun(base):
        """RLG005 from ``step`` on: the run starts healthy."""

        def _generate_and_score_completions(self, inputs):
            out = super()._generate_and_score_completions(inputs)
            if self.state.global_step >= step:
                out["advantages"] = -out["advantages"]
            return out

    return AdvantagesNegatedMidRun


def _makers():
    from trl import GRPOTrainer, RLOOTrainer

    return [(GRPOTrainer, h.make_trainer), (RLOOTrainer, h.make_rloo_trainer)]


# ---------------------------------------------------------------------------------------------- RLOO: preflight


def test_healthy_rloo_passes_the_preflight_and_says_why_checks_are_skipped():
    report = preflight(h.make_rloo_trainer())
    assert report.passed, table(report)
    checks = {c.name: c for c in report.checks}
    assert "RLOO's loss has no entropy bonus" in checks["entropy_direction"].hint
    assert checks["group_mean"].value < 1e-5 and checks["ratio_one"].value < 1e-4
    with_kl = preflight(h.make_rloo_trainer(beta=0.05, num_iterations=2))
    assert with_kl.passed, table(with_kl)
    checks = {c.name: c for c in with_kl.checks}
    assert not checks["kl_positive"].skipped and checks["kl_positive"].value > 1e-9  # the reference is distinct
    assert "reward penalty" in checks["kl_direction"].hint  # RLOO's KL is no loss term
    assert checks["old_logp_frozen"].passed and not checks["old_logp_frozen"].skipped


@pytest.mark.parametrize("fault", list(_rloo_faults()))
def test_rloo_fault_fails_its_check_with_its_code(fault):
    seeded = _rloo_faults()[fault]
    report = preflight(seeded.faulty_trainer())
    result = {c.name: c for c in report.checks}[seeded.check]
    assert not result.passed and not result.skipped, table(report)
    assert result.code == seeded.code
    healthy = {c.name: c for c in preflight(seeded.healthy_trainer(), only=[seeded.check]).checks}[seeded.check]
    assert healthy.passed and not healthy.skipped, healthy


def test_a_check_that_raises_after_attached_targets_names_the_finding_it_follows_from():
    report = preflight(_rloo_faults()["old_logp_attached"].faulty_trainer())
    assert report.failed[0] == "targets_detached" or "targets_detached" in report.failed
    errors = [c for c in report.checks if c.error]
    assert errors and all(c.code is None for c in errors)  # rlguard errors, under no catalog code
    consequences = [c for c in errors if "backward through the graph" in c.hint]
    assert consequences, [(c.name, c.hint) for c in errors]  # the filter below must not pass vacuously
    assert all("a consequence of targets_detached (RLG003)" in c.hint for c in consequences)


# ---------------------------------------------------------------------------------------------- refused trainers


@pytest.mark.parametrize("make, name", [(_dpo_trainer, "DPOTrainer"), (_sft_trainer, "SFTTrainer")],
                         ids=["dpo", "sft"])
def test_other_trainers_are_refused_at_attach_and_by_the_preflight(make, name):
    other = make()
    with pytest.raises(UnsupportedTrainerError, match=rf"{name}: .*supports trl\.GRPOTrainer or trl\.RLOOTrainer"):
        RlguardCallback.attach(other)
    with pytest.raises(UnsupportedTrainerError):
        other.add_callback(RlguardCallback(other))  # added by hand: refused as it is made
    assert not any(isinstance(cb, RlguardCallback) for cb in other.callback_handler.callbacks)
    with pytest.raises(UnsupportedTrainerError, match=name):
        preflight(other)


@pytest.mark.parametrize("make", [_dpo_trainer, _sft_trainer, h.make_trainer], ids=["dpo", "sft", "another-grpo"])
def test_a_callback_made_for_one_trainer_and_added_to_another_is_refused_before_the_first_step(make):
    grpo = h.make_trainer(max_steps=1)
    other = make()
    other.add_callback(RlguardCallback(grpo, monitor=False))  # made for grpo, added by hand to another trainer
    with pytest.raises(UnsupportedTrainerError, match=r"made for a GRPOTrainer and is running in another trainer"):
        other.train()
    assert other.state.global_step == 0 and grpo.state.global_step == 0
    assert "_generate_and_score_completions" not in grpo.__dict__  # nothing was wrapped on the trainer it was made for


def test_a_trainer_swapped_after_the_callback_was_made_is_refused_before_the_first_step():
    trainer = h.make_trainer(max_steps=1)
    callback = RlguardCallback.attach(trainer)
    callback.trainer = object()  # what on_train_begin sees is no longer a supported trainer
    with pytest.raises(UnsupportedTrainerError):
        trainer.train()
    assert trainer.state.global_step == 0


SCRIPT = """
import trl_helpers as h
from test_trl_rloo_and_live import _dpo_trainer


def make_rloo():
    return h.make_rloo_trainer()


def make_dpo():
    return _dpo_trainer()


def make_unsupported():
    return h.make_trainer(cast_lm_head_to_fp32=True)
"""


def test_check_trl_exit_codes_for_rloo_and_unsupported_trainers(tmp_path, monkeypatch, capsys):
    from rlguard.preflight.cli import check_main

    (tmp_path / "user_rloo.py").write_text(textwrap.dedent(SCRIPT))
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert check_main(["--trl", "user_rloo:make_rloo", "-q", "--only", "group_mean,advantage_direction"]) == 0
    assert check_main(["--trl", "user_rloo:make_dpo", "-q"]) == 2  # a usage error, not git bisect's "skip"
    assert "supports trl.GRPOTrainer or trl.RLOOTrainer" in capsys.readouterr().err
    assert check_main(["--trl", "user_rloo:make_unsupported", "-q"]) == 2
    assert "cast_lm_head_to_fp32=True" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------- RLOO: callback


def test_healthy_rloo_run_is_bit_identical_with_the_callback_and_quiet():
    config = dict(beta=0.05, num_iterations=2, max_steps=4, learning_rate=1e-3)
    watched = h.make_rloo_trainer(**config)
    callback = RlguardCallback.attach(watched, mode="raise")
    watched.train()
    plain = h.make_rloo_trainer(**config)
    plain.train()
    for (name, a), (_, b) in zip(watched.model.named_parameters(), plain.model.named_parameters()):
        assert torch.equal(a, b), name
    assert callback.monitor.alerts == [] and callback.switched_off == {} and callback.vanished == {}
    assert callback._ranked and not callback._unranked_noted  # RLG005 ranks by the KL-penalised reward
    assert [r["step"] for r in callback.monitor.history] == [1, 2, 3, 4]
    assert callback.monitor.history[1]["ratio_max"] > 1.0  # the second optimizer step sees a moved policy
    assert watched.reward_funcs == [h.reward_good_words]  # the reward functions are the user's again


@pytest.mark.parametrize("fault, code, where", [
    ("mask_shift", _code("mask-not-shifted"), "RLOOTrainer._generate_and_score_completions(): argument \"output['action_mask']\""),
    ("sign_flip", _code("advantage-sign"), "RLOOTrainer._generate_and_score_completions(): argument \"output['advantages']\""),
    ("group_mean_batch", _code("group-baseline"), "RLOOTrainer._generate_and_score_completions(): argument \"output['advantages']\""),
    ("old_logp_attached", _code("detached-targets"), "RLOOTrainer._generate_and_score_completions(): argument \"output['old_logps']\""),
    ("stale_old_logp", _code("old-logp-recomputed"), "RLOOTrainer._compute_loss(): argument \"inputs['old_logps']\""),
    ("ref_is_policy", _code("reference-alias"), "Guard(): argument 'reference'"),
    ("attention_dropout", _code("train-mode-scoring"), "Guard(): argument 'policy'"),
])
def test_an_rloo_fault_at_a_seam_stops_training_with_its_code(fault, code, where):
    trainer = _rloo_faults()[fault].faulty_trainer()
    RlguardCallback.attach(trainer, mode="raise", monitor=False)
    with pytest.raises(ContractViolation) as exc:
        trainer.train()
    assert exc.value.code == code
    assert str(exc.value).startswith(f"{code} {where}")
    assert trainer.state.global_step <= 1


# ---------------------------------------------------------------------------------------------- mid-run faults


@pytest.mark.parametrize("which, config", [(0, {}), (1, {}), (1, {"beta": 0.05})],
                         ids=["grpo", "rloo", "rloo-default-beta"])
def test_advantages_negated_from_step_3_are_stopped_at_step_3(which, config):
    """RLOO's default beta (0.05, one iteration) puts a KL penalty into the reward it centres: the advantages are
    ranked by that reward, rebuilt from the generation's own old and reference log-probs."""
    base, make = _makers()[which]
    trainer = make(_flip_from(base, 3), max_steps=6, **config)
    callback = RlguardCallback.attach(trainer, mode="raise", monitor=False)
    with pytest.raises(ContractViolation) as exc:
        trainer.train()
    assert exc.value.code == _code("advantage-sign") and "a higher reward has a lower advantage" in str(exc.value)
    assert trainer.state.global_step == 3 and callback._ranked


def test_rloo_default_beta_ranks_by_the_kl_penalised_reward_and_a_healthy_run_passes():
    """With beta > 0 RLOO centres ``reward - beta * KL``: ranking by the bare reward would flag healthy runs once
    the KL differs within a group. A large beta makes it decide the order; the check stays quiet and on."""
    from trl import RLOOConfig

    fields = RLOOConfig.__dataclass_fields__
    assert fields["beta"].default == 0.05 and fields["num_iterations"].default == 1  # RLOO's defaults
    for beta in (0.05, 5.0):
        trainer = h.make_rloo_trainer(beta=beta, max_steps=4, learning_rate=1e-2)
        callback = RlguardCallback.attach(trainer, mode="raise", monitor=False)
        trainer.train()
        assert trainer.state.global_step == 4 and callback._ranked and callback.switched_off == {}
        assert not callback._unranked_noted


def test_advantages_normalised_after_summing_per_function_are_not_ranked_by_the_sum():
    """``normalize_then_sum`` ranks a group by the sum of per-function normalised rewards, not by the weighted
    sum: the rank check is off there (centring still applies), and a healthy run passes."""
    def length_penalty(completions, **kwargs):
        return [-0.05 * len(c.split()) for c in completions]

    trainer = h.make_trainer(max_steps=3, multi_objective_aggregation="normalize_then_sum",
                             reward_funcs=[h.reward_good_words, length_penalty])
    callback = RlguardCallback.attach(trainer, mode="raise")
    trainer.train()
    assert callback.switched_off == {} and not callback._ranked


def _nan_from_call(n: int):
    calls = [0]

    def good_words_then_nan(completions, **kwargs):
        calls[0] += 1
        return [float("nan") if calls[0] >= n else r for r in h.reward_good_words(completions)]

    return good_words_then_nan


def _none_for_long(completions, **kwargs):
    """TRL's convention for an unscorable completion: None (it becomes NaN inside TRL, by design)."""
    return [None if len(c.split()) > 4 else r for c, r in zip(completions, h.reward_good_words(completions))]


@pytest.mark.parametrize("which", [0, 1], ids=["grpo", "rloo"])
def test_a_reward_function_that_starts_returning_nan_is_stopped_with_its_name(which):
    _, make = _makers()[which]
    trainer = make(max_steps=6, reward_funcs=_nan_from_call(3))
    RlguardCallback.attach(trainer, mode="raise", monitor=False)
    with pytest.raises(ContractViolation) as exc:
        trainer.train()
    assert exc.value.code == _code("tensor-contract")
    assert str(exc.value).startswith("RLG000 good_words_then_nan(): argument \"output['rewards']\"")
    assert "NaN" in str(exc.value) and trainer.state.global_step == 2


def _reward_model_dir() -> str:
    """A tiny sequence-classification reward model (one label) with the policy's tokenizer, saved once."""
    if "reward" not in _REWARD_MODEL:
        from transformers import LlamaConfig, LlamaForSequenceClassification

        torch.manual_seed(1)
        config = LlamaConfig(vocab_size=len(h.WORDS), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                             num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0,
                             eos_token_id=1, bos_token_id=2, num_labels=1)
        path = h.scratch("reward-model-")
        LlamaForSequenceClassification(config).save_pretrained(path)
        h.tokenizer().save_pretrained(path)
        _REWARD_MODEL["reward"] = path
    return _REWARD_MODEL["reward"]


_REWARD_MODEL: dict[str, str] = {}


def _nan_from_forward(trainer, n: int) -> None:
    """The trainer's reward model returns NaN logits from its n-th forward on (a diverged reward model)."""
    model = trainer.reward_funcs[0]
    calls = [0]

    def hook(_module, _args, output):
        calls[0] += 1
        if calls[0] >= n:
            output.logits = torch.full_like(output.logits, float("nan"))
        return output

    model.register_forward_hook(hook)


def _async_nan_from_call(n: int):
    calls = [0]

    async def async_good_words_then_nan(completions, **kwargs):
        calls[0] += 1
        return [float("nan") if calls[0] >= n else r for r in h.reward_good_words(completions)]

    return async_good_words_then_nan


@pytest.mark.parametrize("which, kind", [(0, "model"), (1, "model"), (0, "async")],
                         ids=["grpo-reward-model", "rloo-reward-model", "grpo-async"])
def test_a_reward_model_or_async_function_that_starts_returning_nan_is_stopped_with_its_name(which, kind):
    """Not only plain functions: a reward model (an ``nn.Module``, which TRL calls itself) is checked on its column
    of ``_calculate_rewards``' output, an async function as it returns, before TRL's NaN handling hides it."""
    _, make = _makers()[which]
    if kind == "model":
        trainer = make(max_steps=6, reward_funcs=_reward_model_dir())
        _nan_from_forward(trainer, 3)
        where = f"RLG000 {trainer.reward_func_names[0]}(): argument \"output['rewards']\""
    else:
        trainer = make(max_steps=6, reward_funcs=_async_nan_from_call(3))
        where = "RLG000 async_good_words_then_nan(): argument \"output['rewards']\""
    callback = RlguardCallback.attach(trainer, mode="raise", monitor=False)
    with pytest.raises(ContractViolation) as exc:
        trainer.train()
    assert exc.value.code == _code("tensor-contract") and str(exc.value).startswith(where), str(exc.value)
    assert "NaN" in str(exc.value) and trainer.state.global_step == 2
    assert callback.switched_off == {}


def test_none_rewards_are_trls_convention_and_pass():
    trainer = h.make_trainer(max_steps=3, reward_funcs=_none_for_long)
    callback = RlguardCallback.attach(trainer, mode="raise", monitor=False)
    trainer.train()
    assert callback.switched_off == {}


def test_in_warn_mode_nan_rewards_are_logged_and_the_vanished_metric_is_named(caplog):
    trainer = h.make_trainer(max_steps=5, reward_funcs=_nan_from_call(3))
    callback = RlguardCallback.attach(trainer, mode="warn")
    with caplog.at_level(logging.WARNING, logger="rlguard.contracts"):
        trainer.train()
    assert trainer.state.global_step == 5
    text = caplog.text
    assert "RLG000 good_words_then_nan()" in text
    assert callback.vanished.get("rewards/good_words_then_nan/mean") == 3
    assert "'rewards/good_words_then_nan/mean' was logged until step 2" in text


# ---------------------------------------------------------------------------------------------- never breaks


def _boom(*_args, **_kwargs):
    raise RuntimeError("rlguard bug under test")


GUARD_INTERNAL = {"guard steps", "guard pre-step", "grad hook", "direction verdict"}


@pytest.mark.parametrize("seam, target, attr", [
    ("Guard", callback_module, "Guard"),
    ("generation", callback_module, "policy_written"),
    ("loss", callback_module.RlguardCallback, "_check_loss"),
    ("diagnosis", callback_module.Monitor, "step"),
    ("rewards", callback_module.RlguardCallback, "_check_rewards"),
    ("guard steps", callback_module.Guard, "_after_step"),
    ("guard pre-step", callback_module.Guard, "_before_step"),
    ("grad hook", guard_module._GradWatch, "arrived"),  # inside TRL's loss.backward()
    ("direction verdict", callback_module.UpdateDirection, "verdict"),  # at the end of each generation's update
    ("signs", callback_module.RlguardCallback, "_check_signs"),
    ("reference trace", callback_module.RlguardCallback, "_trace_reference"),  # before TRL's loss runs
    ("term signs", callback_module.RlguardCallback, "_check_terms"),
    ("generation spec", callback_module.RlguardCallback, "_choose_generation_spec"),
    ("reward wrapping", callback_module.RlguardCallback, "_wrap_reward_functions"),
])
def test_an_internal_error_at_any_seam_is_logged_once_and_training_finishes(seam, target, attr, monkeypatch,
                                                                            caplog):
    monkeypatch.setattr(target, attr, _boom)
    config = dict(beta=0.1, num_iterations=2, max_steps=4)
    watched = h.make_trainer(**config)
    callback = RlguardCallback.attach(watched, mode="raise")
    with caplog.at_level(logging.ERROR, logger="rlguard.contracts"):
        watched.train()
    assert watched.state.global_step == 4
    errors = [r for r in caplog.records if "rlguard bug under test" in r.getMessage()]
    assert len(errors) == 1, [r.getMessage() for r in errors]  # once, then that check is off
    assert "switched off" in errors[0].getMessage()
    if seam in GUARD_INTERNAL:  # the Guard's own checks switch themselves off inside the Guard
        assert callback.switched_off == {}
    else:
        assert len(callback.switched_off) == 1
    monkeypatch.undo()
    plain = h.make_trainer(**config)
    plain.train()
    for (name, a), (_, b) in zip(watched.model.named_parameters(), plain.model.named_parameters()):
        assert torch.equal(a, b), name


def test_a_violation_still_stops_training_when_another_check_is_switched_off(monkeypatch):
    monkeypatch.setattr(callback_module.Monitor, "step", _boom)
    trainer = h.fault_classes()["mask_shift"].faulty_trainer()
    RlguardCallback.attach(trainer, mode="raise")
    with pytest.raises(ContractViolation) as exc:
        trainer.train()
    assert exc.value.code == _code("mask-not-shifted")


# ---------------------------------------------------------------------------------------------- documented settings


def test_trls_documented_bnpo_normalisation_is_a_warning_naming_the_setting():
    report = preflight(h.make_trainer(loss_type="bnpo"), only=["accumulation"])
    result = report.checks[0]
    assert report.passed and result.passed and result.warning and report.warnings == ["accumulation"]
    assert "loss_type='bnpo' with gradient_accumulation_steps=2" in result.hint
    assert "warn" in table(report) and "by a documented setting: accumulation" in table(report)
    assert result.value > 1e-4  # the measurement is kept: the gradients do differ
    single = preflight(h.make_trainer(loss_type="bnpo", gradient_accumulation_steps=1, per_device_train_batch_size=8),
                       only=["accumulation"])
    assert single.passed and not single.checks[0].warning  # one micro-batch per step: nothing to weigh


def test_a_temperature_slip_is_told_from_a_label_shift():
    """A global rescaling of the logits at the right labels is a temperature (RLG007), not a shift (RLG012)."""
    from trl import GRPOTrainer

    class LossAtAnotherTemperature(GRPOTrainer):
        def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, *a, **k):
            out = model(input_ids=input_ids, attention_mask=attention_mask)
            logits = out.logits[:, -logits_to_keep - 1:-1].float()  # the temperature division forgotten
            logps = logits.log_softmax(-1).gather(-1, input_ids[:, -logits_to_keep:, None]).squeeze(-1)
            return logps, None, None

    report = preflight(h.make_trainer(LossAtAnotherTemperature, temperature=0.7), only=["labels_shifted"])
    result = report.checks[0]
    assert not result.passed and result.code == _code("sampler-trainer-mismatch"), table(report)
    assert "temperature" in result.hint and "not a label shift" in result.hint
    shifted = preflight(h.fault_classes()["mask_shift"].faulty_trainer(), only=["labels_shifted"]).checks[0]
    assert shifted.code != _code("sampler-trainer-mismatch")


@pytest.mark.parametrize("which", [0, 1], ids=["grpo", "rloo"])
def test_a_surrogate_that_loses_its_minus_mid_run_is_stopped_at_the_next_generation(which):
    """The advantages stay right (the rank check passes); the loss is negated from step 2 on. With two optimizer
    steps per generation, the rows' log-probs after the first move against their advantages."""
    base, make = _makers()[which]

    class LossNegatedMidRun(base):
        def _compute_loss(self, model, inputs):
            loss = super()._compute_loss(model, inputs)
            return -loss if self.state.global_step >= 2 else loss

    config = dict(num_iterations=2, max_steps=8, learning_rate=1e-3 if which else 1e-2)
    trainer = make(LossNegatedMidRun, **config)
    RlguardCallback.attach(trainer, mode="raise", monitor=False)
    with pytest.raises(ContractViolation) as exc:
        trainer.train()
    assert exc.value.code == _code("advantage-sign") and "moved against their advantages" in str(exc.value)
    assert 2 <= trainer.state.global_step <= 4
    healthy = make(**config)
    callback = RlguardCallback.attach(healthy, mode="raise", monitor=False)
    healthy.train()
    assert callback.switched_off == {}


@pytest.mark.parametrize("which, config, code", [
    (0, {"beta": -0.1}, _code("kl-sign")),
    (0, {"entropy_coef": -0.01}, _code("entropy-bonus-sign")),
    (1, {"beta": -0.05}, _code("kl-sign")),
], ids=["grpo-beta", "grpo-entropy", "rloo-beta"])
def test_a_coefficient_with_the_wrong_sign_stops_training_at_the_first_loss(which, config, code):
    _, make = _makers()[which]
    trainer = make(max_steps=2, **config)
    RlguardCallback.attach(trainer, mode="raise", monitor=False)
    with pytest.raises(ContractViolation) as exc:
        trainer.train()
    assert exc.value.code == code and trainer.state.global_step == 0


def test_a_kl_coefficient_that_turns_negative_mid_run_is_stopped_then():
    from trl import GRPOTrainer

    class BetaScheduleBelowZero(GRPOTrainer):
        def _generate_and_score_completions(self, inputs):
            self.beta = 0.1 if self.state.global_step < 2 else -0.1  # a schedule that goes wrong at step 2
            return super()._generate_and_score_completions(inputs)

    trainer = h.make_trainer(BetaScheduleBelowZero, beta=0.1, max_steps=4)
    RlguardCallback.attach(trainer, mode="raise", monitor=False)
    with pytest.raises(ContractViolation) as exc:
        trainer.train()
    assert exc.value.code == _code("kl-sign") and trainer.state.global_step == 2


@pytest.mark.parametrize("slip, config, code, term", [
    ({"kl_sign": -1.0}, {"beta": 0.1}, _code("kl-sign"), "per_token_kl"),
    ({"entropy_sign": 1.0}, {"entropy_coef": 0.01}, _code("entropy-bonus-sign"), "entropy"),
], ids=["kl-subtracted", "entropy-added"])
def test_a_loss_term_with_the_wrong_sign_from_step_3_is_stopped_at_step_3(slip, config, code, term):
    """A subclass's own loss subtracts the KL penalty (``pg - beta * kl``) or adds the entropy bonus from step 3 on,
    with ``beta`` and ``entropy_coef`` positive throughout: no coefficient is wrong, the term's sign in the loss
    is. The callback reads ``d loss / d term`` from autograd on each step's first micro-batch (``Penalty``,
    ``Bonus``)."""
    trainer = h.make_trainer(h.own_loss(from_step=3, **slip), max_steps=6, **config)
    RlguardCallback.attach(trainer, mode="raise", monitor=False)
    with pytest.raises(ContractViolation) as exc:
        trainer.train()
    assert exc.value.code == code and trainer.state.global_step == 3
    assert str(exc.value).startswith(f"{code} GRPOTrainer._compute_loss(): return value: d loss / d {term} has "
                                     "the wrong sign"), str(exc.value)
    assert trainer.beta >= 0 and trainer.entropy_coef >= 0  # the coefficients' own check has nothing to say


def _term_checks(monkeypatch) -> dict:
    """Counts of the Penalty and Bonus checks the callback ran ("calls") and of those that read a non-zero
    gradient (the term reached the loss: "Penalty", "Bonus")."""
    from rlguard.contracts import Bonus, Penalty

    seen = {"Penalty": 0, "Bonus": 0, "calls": 0}
    for marker in (Penalty, Bonus):
        original = marker.check

        def counted(self, x, call, _original=original, _name=marker.__name__):
            seen["calls"] += 1
            term = self._get(call, "term")
            if torch.is_tensor(term) and torch.is_tensor(x) and x.requires_grad:
                (grad,) = torch.autograd.grad(x.sum(), term, retain_graph=True, allow_unused=True)
                seen[_name] += grad is not None and bool(grad.abs().max() > 0)
            return _original(self, x, call)

        monkeypatch.setattr(marker, "check", counted)
    return seen


@pytest.mark.parametrize("config", [{}, {"beta": 0.1}, {"entropy_coef": 0.01},
                                    {"beta": 0.1, "entropy_coef": 0.01, "num_iterations": 2}],
                         ids=["default", "beta", "entropy-coef", "both-two-iterations"])
def test_healthy_loss_terms_pass_and_training_is_bit_identical_with_the_callback(config, monkeypatch):
    """TRL's own loss: the KL and entropy terms are read once per optimizer step where they exist (their gradient
    reaches the checks; the default config has neither, and the checks run and say nothing), pass, and leave
    training as it is (the reference log-probs the loss reads are passed through unchanged)."""
    seen = _term_checks(monkeypatch)
    config = dict(max_steps=3, **config)
    watched = h.make_trainer(**config)
    callback = RlguardCallback.attach(watched, mode="raise")
    watched.train()
    assert callback.switched_off == {} and callback.monitor.alerts == []
    assert watched.args.gradient_accumulation_steps > 1  # several micro-batches per step; the terms read on one
    assert seen["calls"] == 2 * watched.state.global_step, seen  # Penalty and Bonus, once per optimizer step
    assert bool(seen["Penalty"]) == ("beta" in config) and bool(seen["Bonus"]) == ("entropy_coef" in config), seen
    monkeypatch.undo()
    plain = h.make_trainer(**config)
    plain.train()
    for (name, a), (_, b) in zip(watched.model.named_parameters(), plain.model.named_parameters()):
        assert torch.equal(a, b), name
        assert a.grad is None or b.grad is None or torch.equal(a.grad, b.grad), name
    if "beta" in config:
        assert [r.get("kl") for r in watched.state.log_history] == [r.get("kl") for r in plain.state.log_history]


def test_a_users_own_loss_with_the_right_signs_passes(monkeypatch):
    """The user's loss also checks its inputs with rlguard's own contracts: the reference log-probs the callback
    passes through its autograd function (to read the KL's sign) are still the target NoGrad expects."""
    from typing import Annotated, Optional

    from jaxtyping import Float
    from torch import Tensor

    from rlguard.contracts import Batch, NoGrad, check_batch
    from rlguard.contracts import mode as contracts_mode

    spec = Batch(ref_per_token_logps=Optional[Annotated[Float[Tensor, "B C"], NoGrad()]],
                 advantages=Annotated[Float[Tensor, "B"], NoGrad()])

    class ContractedOwnLoss(h.own_loss()):
        def _compute_loss(self, model, inputs):
            with contracts_mode("raise"):
                check_batch(spec, {k: inputs.get(k) for k in ("ref_per_token_logps", "advantages")},
                            where="ContractedOwnLoss._compute_loss", name="inputs")
            return super()._compute_loss(model, inputs)

    seen = _term_checks(monkeypatch)
    trainer = h.make_trainer(ContractedOwnLoss, beta=0.1, entropy_coef=0.01, num_iterations=2, max_steps=4)
    callback = RlguardCallback.attach(trainer, mode="raise", monitor=False)
    trainer.train()
    assert trainer.state.global_step == 4 and callback.switched_off == {}
    assert seen["Penalty"] > 0 and seen["Bonus"] > 0, seen  # both terms were read, at the right sign


def test_gradients_not_zeroed_between_trls_own_steps_are_stopped_by_the_callback():
    """RLG013 through the trainer's own loop (the preflight replays transformers' loop, so it skips this check):
    a subclass whose model's zero_grad is a no-op accumulates every step's gradient into the next."""
    from trl import GRPOTrainer

    class NoZeroGrad(GRPOTrainer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.model.zero_grad = lambda *a, **k: None

    trainer = h.make_trainer(NoZeroGrad, max_steps=4)
    RlguardCallback.attach(trainer, mode="raise", monitor=False)
    with pytest.raises(ContractViolation) as exc:
        trainer.train()
    assert exc.value.code == _code("grad-not-zeroed") and trainer.state.global_step == 1
    assert "still held the gradient left by optimizer step 0" in str(exc.value)
