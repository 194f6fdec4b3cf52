"""The TRL integration on a PEFT (LoRA) ``GRPOTrainer`` (tiny model built in code, LoRA from ``peft_config``): the
preflight copies the policy with its adapter, takes the reference log-probs from TRL's own adapter-off pass and
the trainable set from the adapter; the seeded PEFT faults fail with their codes, and the callback checks a LoRA
run without a false RLG008."""

from __future__ import annotations

import warnings

import pytest

pytest.importorskip("trl")
pytest.importorskip("peft")
torch = pytest.importorskip("torch")

import trl_helpers as h  # noqa: E402
from peft import PeftModel  # noqa: E402

from rlguard.catalog import REFERENCE_ALIAS, RELOAD_MISMATCH, TRAINED_PARAMS_DRIFT  # noqa: E402
from rlguard.contracts import ContractViolation  # noqa: E402
from rlguard.contracts.settings import reset_warnings  # noqa: E402
from rlguard.diagnose import SymptomError  # noqa: E402
from rlguard.integrations.trl import GRPOAdapter, RlguardCallback, TRLPreflightError, preflight  # noqa: E402
from rlguard.integrations.trl.preflight import PeftReference, _fused_patch, adapter_parameter_names  # noqa: E402
from rlguard.preflight.report import table  # noqa: E402

pytestmark = pytest.mark.trl
torch.set_num_threads(1)
FULL = dict(beta=0.1, num_iterations=2, entropy_coef=0.01)


@pytest.fixture(autouse=True)
def _quiet():
    reset_warnings()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield
    reset_warnings()


def _by_name(report):
    return {c.name: c for c in report.checks}


def _logits(model, ids, mask, adapter_on=True):
    with torch.no_grad():
        if adapter_on:
            return model(input_ids=ids, attention_mask=mask).logits
        with model.disable_adapter():
            return model(input_ids=ids, attention_mask=mask).logits


# ---------------------------------------------------------------------------------------------- the preflight


@pytest.mark.parametrize("extra", [{}, {"modules_to_save": ["lm_head"]}], ids=["lora", "lora+lm_head_copy"])
def test_healthy_lora_trainer_passes_every_check(extra):
    trainer = h.make_peft_trainer(peft=h.lora_config(**extra), **FULL)
    if extra:  # the trained copy of lm_head is the adapter's too
        assert "base_model.model.lm_head.modules_to_save.default.weight" in adapter_parameter_names(trainer.model)
    report = preflight(trainer)
    assert report.passed, table(report)
    assert set(report.skipped) == {"grads_zeroed", "greedy_eval", "reproducible"}  # no factory: no short runs
    checks = _by_name(report)
    assert checks["kl_positive"].value > 1e-6  # the adapter moved the policy off the base model
    assert checks["old_logp_frozen"].value > 1e-3 and checks["kl_direction"].value < 0
    assert checks["frozen_params"].value == 0 and checks["reload"].value < 1e-6


def test_default_lora_trainer_passes_with_the_skips_named(monkeypatch):
    report = preflight(lambda: h.make_peft_trainer())  # a factory: two real LoRA trainings for `reproducible`
    assert report.passed, table(report)
    checks = _by_name(report)
    assert {"kl_positive", "kl_direction", "entropy_direction", "old_logp_frozen"} <= set(report.skipped)
    assert "beta == 0" in checks["kl_positive"].hint and "adapter off" in checks["kl_positive"].hint
    assert not checks["reproducible"].skipped and checks["reproducible"].passed


def test_the_copy_keeps_the_adapter_and_the_reference_is_trls_adapter_off_pass():
    trainer = h.make_peft_trainer(beta=0.1)
    adapter = GRPOAdapter(trainer)
    model = adapter.build_model()
    assert isinstance(model, PeftModel) and model is not trainer.model
    assert _fused_patch(model.get_base_model()) is not None  # TRL's fused head, on the copy's own base model
    names = adapter.trainable_names(model)
    assert names == {n for n, p in model.named_parameters() if p.requires_grad} and names
    assert all(".lora_A.default." in n or ".lora_B.default." in n for n in names)
    assert adapter_parameter_names(trainer.model) == {n for n, p in trainer.model.named_parameters()
                                                      if p.requires_grad}
    ref = adapter.make_reference(model)
    assert isinstance(ref, PeftReference) and ref.policy is model
    batch = adapter.make_batch(model, seed=0)
    assert trainer.ref_model is None  # TRL's own path, with no ref_model, computed the batch's reference
    ids, mask = adapter.token_ids(batch), adapter._attention(batch)
    with torch.no_grad():  # move the adapter: the policy now differs from its base model
        for name, p in model.named_parameters():
            if name in names:
                p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
    base, live = _logits(model, ids, mask, adapter_on=False)[:, :-1], _logits(model, ids, mask)[:, :-1]
    assert not torch.allclose(base, live, atol=1e-4)
    ref_logits = adapter.logits(ref, batch)
    assert torch.allclose(ref_logits, base / trainer.temperature, atol=1e-5)
    ref_logps = adapter._completion_logps(ref, batch).detach()
    c = batch.inputs["completion_ids"].shape[1]
    expected = (base[:, -c:].float() / trainer.temperature).log_softmax(-1).gather(
        -1, batch.inputs["completion_ids"][..., None]).squeeze(-1)
    keep = batch.inputs["completion_mask"].bool()  # TRL's log-probs are 0 past the end of a completion
    assert torch.allclose(ref_logps[keep], expected[keep], atol=1e-5)
    assert all(p.requires_grad == (n in names) for n, p in model.named_parameters())  # adapter state restored


def test_a_pretrained_adapter_is_checked_against_trls_frozen_ref_adapter():
    """A ``PeftModel`` with a trained adapter: TRL's reference is its ``"ref"`` copy, not the base model."""
    trainer = h.make_pretrained_adapter_trainer(beta=0.1, num_iterations=2)
    assert set(trainer.model.peft_config) == {"default", "ref"}
    report = preflight(trainer)
    assert report.passed, table(report)
    adapter = GRPOAdapter(trainer)
    model = adapter.build_model()
    names = adapter.trainable_names(model)
    assert names and all(".default." in n for n in names)  # the "ref" adapter is not meant to train
    batch = adapter.make_batch(model, seed=0)
    ids, mask = adapter.token_ids(batch), adapter._attention(batch)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in names:
                p.mul_(1.5)
        model.set_adapter("ref")
        ref_on = model(input_ids=ids, attention_mask=mask).logits[:, :-1]
        model.set_adapter("default")
    ref_logits = adapter.logits(adapter.make_reference(model), batch)
    assert torch.allclose(ref_logits, ref_on / trainer.temperature, atol=1e-5)
    assert not torch.allclose(ref_logits, _logits(model, ids, mask, adapter_on=False)[:, :-1], atol=1e-4)
    assert model.active_adapters == ["default"]
    assert all(p.requires_grad == (n in names) for n, p in model.named_parameters())


@pytest.mark.parametrize("fault", list(h.peft_fault_classes()))
def test_seeded_peft_fault_fails_its_check_with_its_code(fault):
    seeded = h.peft_fault_classes()[fault]
    report = preflight(seeded.faulty_trainer())
    result = _by_name(report)[seeded.check]
    assert not result.passed and not result.skipped, table(report)
    assert result.code == seeded.code
    expected = {seeded.check}
    if fault == "peft_base_unfrozen":  # the adapter checkpoint does not hold the trained base weight either
        expected.add("reload")
        assert _by_name(report)["reload"].code == RELOAD_MISMATCH
        assert "lm_head.weight" in result.hint and "trainable_names" in result.hint
    assert set(report.failed) == expected, table(report)
    healthy = preflight(seeded.healthy_trainer(), only=[seeded.check])
    assert healthy.passed and not healthy.checks[0].skipped, table(healthy)


def test_preflight_leaves_the_lora_trainer_as_it_was():
    checked = h.make_peft_trainer(**FULL)
    preflight(checked)
    assert not checked._logs["prompt"] and not checked._logs["advantages"]  # no preflight row in its table
    checked.train()
    plain = h.make_peft_trainer(**FULL)
    plain.train()
    for (name, a), (_, b) in zip(checked.model.named_parameters(), plain.model.named_parameters()):
        assert torch.equal(a, b), name
    assert checked.ref_model is None and isinstance(checked.model, PeftModel)


def test_reload_is_skipped_when_the_base_model_cannot_be_loaded_back():
    trainer = h.make_peft_trainer()
    trainer.model.peft_config["default"].base_model_name_or_path = "/nonexistent/base-model"
    report = preflight(trainer, only=["reload", "frozen_params"])
    checks = _by_name(report)
    assert checks["reload"].skipped and "base_model_name_or_path" in checks["reload"].hint
    assert checks["frozen_params"].passed and not checks["frozen_params"].skipped


def test_a_peft_outside_the_tested_range_is_refused_for_a_peft_trainer(monkeypatch):
    from rlguard.integrations.trl import _version

    peft_trainer, plain_trainer = h.make_peft_trainer(), h.make_trainer()
    real = _version.metadata.version
    monkeypatch.setattr(_version.metadata, "version", lambda name: "0.16.0" if name == "peft" else real(name))
    with pytest.raises(TRLPreflightError, match=r"PEFT 0.16.0 \(the TRL integration is tested with PEFT >=0.18"):
        GRPOAdapter(peft_trainer)
    GRPOAdapter(plain_trainer)  # a trainer without PEFT does not care


def test_prompt_learning_peft_is_refused():
    from peft import PromptTuningConfig

    trainer = h.make_peft_trainer(peft=PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=2))
    with pytest.raises(TRLPreflightError, match="prompt-learning PEFT method"):
        GRPOAdapter(trainer)


# ---------------------------------------------------------------------------------------------- the callback


def test_healthy_lora_run_is_bit_identical_with_the_callback_and_quiet():
    watched = h.make_peft_trainer(**FULL, max_steps=3)
    seen = {}

    class Spy(RlguardCallback):
        def on_train_begin(self, *args, **kwargs):
            super().on_train_begin(*args, **kwargs)
            seen["frozen"], seen["reference"] = set(self.guard.frozen_names), self.guard.reference

    callback = Spy.attach(watched, mode="raise")
    watched.train()
    plain = h.make_peft_trainer(**FULL, max_steps=3)
    plain.train()
    for (name, a), (_, b) in zip(watched.model.named_parameters(), plain.model.named_parameters()):
        assert torch.equal(a, b), name
    assert callback.monitor.alerts == []
    assert callback.monitor.history[-1]["kl_ref"] > 0
    assert seen["reference"] is None  # the adapter-off reference is not a second model
    adapter = adapter_parameter_names(watched.model)
    assert seen["frozen"] and not any("lora_" in n for n in seen["frozen"])  # every base weight, no adapter one
    assert len(seen["frozen"]) >= sum(1 for n, _ in watched.model.named_parameters() if n not in adapter)


@pytest.mark.parametrize("fault, error, code", [
    ("peft_base_unfrozen", ContractViolation, TRAINED_PARAMS_DRIFT),  # the guard, before the first step
    ("peft_ref_is_policy", ContractViolation, REFERENCE_ALIAS),       # the guard: the reference is the policy
    ("peft_ref_is_base_model", ContractViolation, REFERENCE_ALIAS),   # the guard: PEFT's base model, adapter in it
    ("peft_ref_adapter_on", SymptomError, REFERENCE_ALIAS),           # the monitor: TRL's kl stays exactly 0
])
def test_peft_faults_stop_training_with_their_codes(fault, error, code):
    trainer = h.peft_fault_classes()[fault].faulty_trainer()
    trainer.args.max_steps = 5
    RlguardCallback.attach(trainer, mode="raise")
    with pytest.raises(error) as exc:
        trainer.train()
    got = exc.value.code if error is ContractViolation else exc.value.symptom.codes
    assert code == got or code in got
    assert trainer.state.global_step < 5
