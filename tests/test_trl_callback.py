"""``RlguardCallback`` inside a real ``GRPOTrainer.train()``: a healthy run trains bit-identically with it on, the
faults visible at TRL's batch seams or around optimizer steps stop training with their codes, the metrics reach
the diagnose monitor under rlguard's names, and the raise/warn/off modes behave as documented."""

from __future__ import annotations

import logging
import warnings

import pytest

pytest.importorskip("trl")
torch = pytest.importorskip("torch")

import trl_helpers as h  # noqa: E402

from rlguard.catalog import BY_NAME  # noqa: E402
from rlguard.contracts import ContractViolation  # noqa: E402
from rlguard.contracts.settings import reset_warnings  # noqa: E402
from rlguard.diagnose import SymptomError, SymptomWarning, diagnose, read_history  # noqa: E402
from rlguard.integrations.trl import TRL_METRICS, RlguardCallback, diagnose_row  # noqa: E402

pytestmark = pytest.mark.trl
torch.set_num_threads(1)
FULL = dict(beta=0.1, num_iterations=2, entropy_coef=0.01)
SEAMS = ("_generate", "_generate_and_score_completions", "_compute_loss", "_get_per_token_logps_and_entropies")


@pytest.fixture(autouse=True)
def _fresh_warn_registry():
    reset_warnings()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        yield
    reset_warnings()


def _code(name: str) -> str:
    return BY_NAME[name].code


def test_healthy_run_is_bit_identical_with_the_callback_and_quiet():
    watched = h.make_trainer(**FULL, max_steps=4)
    callback = RlguardCallback.attach(watched, mode="raise")
    watched.train()
    plain = h.make_trainer(**FULL, max_steps=4)
    plain.train()
    for (name, a), (_, b) in zip(watched.model.named_parameters(), plain.model.named_parameters()):
        assert torch.equal(a, b), name
    assert callback.monitor.alerts == []
    rows = callback.monitor.history
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(r["kl_coef"] == 0.1 for r in rows) and rows[0]["kl_ref"] == 0.0 < rows[-1]["kl_ref"]
    # two optimizer steps per generation: the first sees ratio 1, the second a moved policy
    assert rows[0]["ratio_max"] == 1.0 and rows[1]["ratio_max"] > 1.0
    assert not any(name in watched.__dict__ for name in SEAMS)  # the wrappers are gone after train()
    assert callback.guard is None


@pytest.mark.parametrize("fault, code, where", [
    ("mask_shift", _code("mask-not-shifted"), "GRPOTrainer._generate_and_score_completions(): argument \"output['action_mask']\""),
    ("ref_is_policy", _code("reference-alias"), "Guard(): argument 'reference'"),
    ("group_mean_batch", _code("group-baseline"), "GRPOTrainer._generate_and_score_completions(): argument \"output['advantages']\""),
    ("stale_old_logp", _code("old-logp-recomputed"), "GRPOTrainer._compute_loss(): argument \"inputs['old_per_token_logps']\""),
])
def test_a_fault_at_a_seam_stops_training_with_its_code(fault, code, where):
    trainer = h.fault_classes()[fault].faulty_trainer()
    RlguardCallback.attach(trainer, mode="raise", monitor=False)
    with pytest.raises(ContractViolation) as exc:
        trainer.train()
    assert exc.value.code == code
    assert str(exc.value).startswith(f"{code} {where}")
    assert trainer.state.global_step <= 1  # at the first generation, or its first reuse


def test_a_reference_in_the_optimizer_is_caught_before_the_first_step():
    from trl import GRPOTrainer

    class TrainsTheReference(GRPOTrainer):
        def create_optimizer(self, model=None):
            params = list(self.model.parameters()) + list(self.ref_model.parameters())
            self.optimizer = torch.optim.AdamW(params)  # noqa: RLG008 - the fault under test
            return self.optimizer

    trainer = h.make_trainer(TrainsTheReference, beta=0.1)
    RlguardCallback.attach(trainer, monitor=False)
    with pytest.raises(ContractViolation, match="in the optimizer's param groups") as exc:
        trainer.train()
    assert exc.value.code == _code("reference-alias") and trainer.state.global_step == 0


def test_healthy_twins_of_the_seam_faults_train_quietly():
    for fault in ("mask_shift", "ref_is_policy", "group_mean_batch", "stale_old_logp"):
        trainer = h.fault_classes()[fault].healthy_trainer()
        trainer.args.max_steps = 3
        callback = RlguardCallback.attach(trainer, mode="raise")
        trainer.train()
        assert callback.monitor.alerts == [], fault


@pytest.mark.parametrize("fault, rule, code", [
    ("ref_is_policy", "kl_ref_zero", _code("reference-alias")),         # TRL's kl stays exactly 0
    ("stale_old_logp", "ratio_stuck_at_one", _code("old-logp-recomputed")),  # the ratio the loss used stays 1
])
def test_the_monitor_reads_the_fault_off_trls_metrics(fault, rule, code):
    trainer = h.fault_classes()[fault].faulty_trainer()
    trainer.args.max_steps = 6
    RlguardCallback.attach(trainer, mode="raise", contracts=False)
    with pytest.raises(SymptomError) as exc:
        trainer.train()
    assert exc.value.symptom.rule == rule and code in exc.value.symptom.codes
    assert trainer.state.global_step < 6  # stopped early


def test_warn_mode_logs_and_warns_and_trains_on(caplog):
    trainer = h.fault_classes()["ref_is_policy"].faulty_trainer()
    trainer.args.max_steps = 3
    RlguardCallback.attach(trainer, mode="warn")
    with caplog.at_level(logging.WARNING, logger="rlguard.contracts"), \
            pytest.warns(SymptomWarning, match="kl_ref_zero RLG008"):
        trainer.train()
    assert trainer.state.global_step == 3
    assert any(r.getMessage().startswith("RLG008 Guard(): argument 'reference'") for r in caplog.records)


def test_off_mode_does_nothing():
    trainer = h.fault_classes()["mask_shift"].faulty_trainer()
    callback = RlguardCallback.attach(trainer, mode="off")
    trainer.train()
    assert callback.monitor is None and callback.guard is None and trainer.state.global_step == 2


def test_the_metric_log_reads_back_into_rlguard_diagnose(tmp_path):
    trainer = h.fault_classes()["ref_is_policy"].faulty_trainer()
    trainer.args.max_steps = 3
    log = tmp_path / "run.jsonl"
    RlguardCallback.attach(trainer, mode="warn", contracts=False, log_path=log)
    with pytest.warns(SymptomWarning):
        trainer.train()
    history = read_history(log)
    assert len(history) == 3 and {"reward", "entropy", "kl_ref", "clip_frac", "grad_norm"} <= set(history[0])
    assert [s.rule for s in diagnose(history).symptoms][:1] == ["kl_ref_zero"]


def test_diagnose_row_maps_trls_names():
    logs = {"reward": 0.5, "kl": 0.01, "entropy": 2.0, "clip_ratio/region_mean": 0.1, "grad_norm": 0.3,
            "completions/mean_length": 12.0, "frac_reward_zero_std": 0.25,
            "sampling/sampling_logp_difference/mean": 1e-3, "learning_rate": 1e-5, "name": "not a number"}
    row = diagnose_row(logs, step=7, beta=0.04)
    assert row == {"step": 7, "kl_coef": 0.04, "reward": 0.5, "kl_ref": 0.01, "entropy": 2.0, "clip_frac": 0.1,
                   "grad_norm": 0.3, "length": 12.0, "zero_adv_frac": 0.25, "logp_gap": 1e-3,
                   "learning_rate": 1e-5}
    from rlguard.diagnose import METRICS

    assert set(TRL_METRICS.values()) <= set(METRICS)


def test_bad_arguments_fail_when_the_callback_is_made():
    trainer = h.make_trainer()
    with pytest.raises(ValueError, match="mode must be one of"):
        RlguardCallback(trainer, mode="loud")
    with pytest.raises(ValueError, match="check_every must be a positive int"):
        RlguardCallback(trainer, check_every=0)
