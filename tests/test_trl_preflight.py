"""The zero-code preflight on a real ``trl.GRPOTrainer`` (tiny model built in code): healthy trainers pass, each
seeded fault fails its check with its catalog code, inapplicable checks are skipped with the reason, the user's
trainer is left as it was, and ``rlguard check --trl`` gives the right exit codes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest

pytest.importorskip("trl")
torch = pytest.importorskip("torch")

import trl_helpers as h  # noqa: E402

from rlguard.catalog import BY_NAME  # noqa: E402
from rlguard.integrations.trl import GRPOAdapter, TRLPreflightError, preflight  # noqa: E402
from rlguard.integrations.trl.preflight import copy_patched_model  # noqa: E402
from rlguard.preflight.checks import CHECKS  # noqa: E402
from rlguard.preflight.cli import check_main  # noqa: E402
from rlguard.preflight.report import table  # noqa: E402

pytestmark = pytest.mark.trl
torch.set_num_threads(1)
TESTS = Path(__file__).resolve().parent
# KL term, several optimizer steps per generation and an entropy bonus: every check of the suite applies
FULL = dict(beta=0.1, num_iterations=2, entropy_coef=0.01)


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _by_name(report):
    return {c.name: c for c in report.checks}


def test_healthy_default_trainer_passes_and_says_why_checks_are_skipped():
    report = preflight(lambda: h.make_trainer())  # a factory: the reproducible check runs two real trainings
    assert report.passed, table(report)
    assert [c.name for c in report.checks] == list(CHECKS)
    checks = _by_name(report)
    assert set(report.skipped) == {"old_logp_frozen", "kl_positive", "entropy_direction", "kl_direction",
                                   "grads_zeroed", "greedy_eval"}
    assert "beta == 0" in checks["kl_positive"].hint and "beta == 0" in checks["kl_direction"].hint
    assert "entropy_coef == 0" in checks["entropy_direction"].hint
    assert "one optimizer step per generation" in checks["old_logp_frozen"].hint
    assert not checks["reproducible"].skipped and checks["reproducible"].passed
    assert checks["sampler_logp"].value < 1e-5 and checks["accumulation"].value < 1e-5


def test_healthy_trainer_with_kl_entropy_and_iterations_passes_every_check():
    report = preflight(h.make_trainer(**FULL))
    assert report.passed, table(report)
    assert set(report.skipped) == {"grads_zeroed", "greedy_eval", "reproducible"}  # no factory: no short runs
    checks = _by_name(report)
    assert checks["old_logp_frozen"].value > 1e-3  # the ratio moves after the first of 2 optimizer steps
    assert checks["kl_positive"].value > 1e-6 and checks["kl_direction"].value < 0
    assert checks["entropy_direction"].value > 0


@pytest.mark.parametrize("fault", list(h.fault_classes()))
def test_seeded_fault_fails_its_check_with_its_code(fault):
    seeded = h.fault_classes()[fault]
    report = preflight(seeded.faulty_trainer())
    result = _by_name(report)[seeded.check]
    assert not result.passed and not result.skipped, table(report)
    assert result.code == seeded.code
    healthy = _by_name(preflight(seeded.healthy_trainer(), only=[seeded.check]))[seeded.check]
    assert healthy.passed and not healthy.skipped, healthy


def test_faults_fail_only_their_own_check_where_nothing_else_depends_on_them():
    """Faults that touch one quantity fail one check; the shifted mask also moves what the loss scores."""
    # faults whose consequences other checks measure too, each for a reason of its own:
    also = {
        # TRL's completion mask is the forward's attention mask too: the EOS hidden from it moves the log-probs
        "pad_is_eos": {"labels_shifted", "sampler_logp", "accumulation"},
        # every forward in train mode is a dropout sample: any two passes the suite compares differ
        "attention_dropout": {"labels_shifted", "sampler_logp", "ratio_one", "accumulation", "reload"},
        # the accumulated gradient pairs the micro-batches' rows with other advantages too
        "rows_sorted_for_loss": {"accumulation"},
    }
    for name, seeded in h.fault_classes().items():
        failed = preflight(seeded.faulty_trainer()).failed
        if name == "mask_shift":
            assert failed[0] == "mask_policy", failed
        else:
            assert set(failed) == {seeded.check} | also.get(name, set()), (name, failed)


def test_preflight_leaves_the_trainer_as_it_was():
    """Training after the preflight gives bit-identical parameters to training without it."""
    checked = h.make_trainer(**FULL)
    preflight(checked)
    checked.train()
    plain = h.make_trainer(**FULL)
    plain.train()
    for (name, a), (_, b) in zip(checked.model.named_parameters(), plain.model.named_parameters()):
        assert torch.equal(a, b), name
    assert checked.state.log_history[0]["reward"] == plain.state.log_history[0]["reward"]


def test_a_copy_of_the_patched_policy_runs_its_own_weights():
    """TRL's fused head closes over the original model: a plain deepcopy's forward runs the original's weights."""
    import copy

    trainer = h.make_trainer(beta=0.1)
    ids = torch.tensor([[4, 5, 6, 7]])
    for model in (trainer.model, trainer.ref_model):
        with torch.no_grad():
            before = model(input_ids=ids).logits
            naive, ours = copy.deepcopy(model), copy_patched_model(model)
            for m in (naive, ours):
                m.get_output_embeddings().weight.mul_(2.0)
            assert torch.equal(naive(input_ids=ids).logits, before)  # the trap the adapter avoids
            assert not torch.allclose(ours(input_ids=ids).logits, before)
            assert torch.equal(model(input_ids=ids).logits, before)  # the original is untouched


def test_mixed_precision_is_measured_only_when_asked():
    """By default TRL's code runs in float32 (the suite's tolerances are fp32); autocast=True keeps bf16."""
    trainer = h.make_trainer(bf16=True)
    fp32 = _by_name(preflight(trainer, only=["sampler_logp"]))["sampler_logp"]
    assert fp32.passed and fp32.value < 1e-5
    from rlguard.preflight.suite import run_suite

    bf16 = _by_name(run_suite(GRPOAdapter(trainer, autocast=True), only=["sampler_logp"]))["sampler_logp"]
    assert not bf16.passed and bf16.value > 1e-4  # the sampler (fp32 generate) vs the bf16 loss


def test_unsupported_configurations_are_refused_with_the_setting_named():
    with pytest.raises(TRLPreflightError, match="cast_lm_head_to_fp32=True"):
        GRPOAdapter(h.make_trainer(cast_lm_head_to_fp32=True))
    with pytest.raises(TypeError, match="supports trl.GRPOTrainer or trl.RLOOTrainer"):
        GRPOAdapter(object())
    with pytest.raises(TypeError, match="the factory returned is a builtins.int"):
        preflight(lambda: 3)


# ---------------------------------------------------------------------------------------------------- the CLI

SCRIPT = """
from trl_helpers import fault_classes, make_trainer as _make


def make_trainer():
    return _make()


def make_faulty():
    return fault_classes()["sign_flip"].faulty_trainer()


def make_broken():
    raise RuntimeError("no GPU here")


def make_unsupported():
    return _make(cast_lm_head_to_fp32=True)
"""


@pytest.fixture()
def user_script(tmp_path, monkeypatch):
    (tmp_path / "user_grpo.py").write_text(textwrap.dedent(SCRIPT))
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def test_check_trl_exit_codes_in_process(user_script, capsys):
    out = user_script / "report"
    assert check_main(["--trl", "user_grpo:make_trainer", "-q", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "all checks passed (6 skipped" in text and "beta == 0" in text
    data = json.loads((out / "report.json").read_text())
    assert data["passed"] and {c["name"] for c in data["checks"] if c["skipped"]} >= {"kl_positive"}
    assert check_main(["--trl", "user_grpo:make_faulty", "-q", "--only", "advantage_direction"]) == 1
    assert "RLG005" in capsys.readouterr().out
    assert check_main(["--trl", "user_grpo:make_broken", "-q"]) == 125
    assert "building the trainer failed: RuntimeError: no GPU here" in capsys.readouterr().err
    assert check_main(["--trl", "user_grpo:make_unsupported", "-q"]) == 2  # the user's to change: not a skip
    assert "cast_lm_head_to_fp32=True" in capsys.readouterr().err
    assert check_main(["--trl", "user_grpo:no_such_function", "-q"]) == 125
    assert "has no attribute 'no_such_function'" in capsys.readouterr().err
    assert check_main(["--trl", "user_grpo", "-q"]) == 125
    assert "expected MODULE:FUNCTION" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        check_main(["examples.trl_style_grpo:adapter", "--trl", "user_grpo:make_trainer"])
    assert exc.value.code == 2


def test_rlguard_check_trl_command(user_script):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(user_script), str(TESTS)]))
    proc = subprocess.run([sys.executable, "-m", "rlguard", "check", "--trl", "user_grpo:make_faulty", "-q",
                           "--only", "advantage_direction,group_mean"], cwd=user_script, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "advantage_direction" in proc.stdout and "RLG005" in proc.stdout and "FAIL" in proc.stdout


@pytest.mark.parametrize("option", [
    {"loss_type": "grpo"}, {"loss_type": "dr_grpo"}, {"loss_type": "cispo"}, {"loss_type": "sapo"},
    {"scale_rewards": "batch"}, {"scale_rewards": "none"}, {"temperature": 0.7}, {"steps_per_generation": 4},
    {"mask_truncated_completions": True}, {"importance_sampling_level": "sequence", "loss_type": "grpo"},
])
def test_trl_options_that_keep_every_invariant_pass(option):
    report = preflight(h.make_trainer(**FULL, **option))
    assert report.passed, (option, table(report))


@pytest.mark.parametrize("option", [{"top_p": 0.9}, {"top_k": 10}, {"repetition_penalty": 1.2}])
def test_sampling_options_the_loss_does_not_apply_fail_the_sampler_check(option):
    """TRL's loss scores the full tempered softmax; truncated or penalised sampling draws from another one."""
    report = preflight(h.make_trainer(**option))
    assert report.failed == ["sampler_logp"], (option, table(report))
    assert _by_name(report)["sampler_logp"].code == BY_NAME["sampler-trainer-mismatch"].code


def test_an_optimizer_over_the_reference_is_refused_and_the_users_reference_left_alone():
    from trl import GRPOTrainer

    class TrainsTheReference(GRPOTrainer):
        def create_optimizer(self, model=None):
            params = list(self.model.parameters()) + list(self.ref_model.parameters())
            self.optimizer = torch.optim.AdamW(params)  # noqa: RLG008 - the fault under test
            return self.optimizer

    trainer = h.make_trainer(TrainsTheReference, beta=0.1)
    before = [p.detach().clone() for p in trainer.ref_model.parameters()]
    report = preflight(trainer, only=["kl_positive", "advantage_direction", "group_mean"])
    failed = _by_name(report)
    assert report.failed == ["advantage_direction", "kl_positive"]
    for name in report.failed:
        assert "not the policy's (the reference's? see RLG008)" in failed[name].hint
    assert all(torch.equal(a, b) for a, b in zip(before, trainer.ref_model.parameters()))


PADDING_CHECKS = ["mask_policy", "padding_invariant", "padding_leak"]


def test_padding_checks_draw_trls_next_batches_until_one_has_a_padded_row(tmp_path):
    """On the real trainer: seed 2's generation has every completion at max_completion_length (no padding after
    an EOS), so the three checks of what lies past a completion's end run on the next seed whose batch has one;
    report.md and report.json say which batches were used and the base seed."""
    from rlguard.preflight.checks import Context, padded_row
    from rlguard.preflight.report import markdown, write_report

    adapter = GRPOAdapter(h.make_trainer(), seed=2)
    assert not padded_row(Context(adapter, 2))  # the test's premise: TRL sampled no EOS in seed 2's batch
    report = preflight(h.make_trainer(), seed=2, only=PADDING_CHECKS)
    used = {c.seed for c in report.checks}
    assert len(used) == 1 and used.pop() > 2, table(report)
    drawn = report.checks[0].seed
    for c in report.checks:
        assert c.passed and not c.skipped and f"on the batch of seed {drawn}" in c.hint and "padded row" in c.hint
    assert padded_row(Context(adapter, drawn))
    write_report(report, tmp_path)
    data = json.loads((tmp_path / "report.json").read_text())
    assert data["seed"] == 2 and data["batches"] == {name: drawn for name in PADDING_CHECKS}
    assert f"Base seed 2; batches: the first for every check but mask_policy (seed {drawn})" in markdown(report)


def test_padding_checks_on_trl_completions_that_never_stop_early_are_not_exercised():
    """``min_new_tokens = max_completion_length``: no completion of any batch ends early, so there is no padding to
    check; the checks say so (with the seeds tried) instead of passing, and a shifted mask still fails."""
    never_stop = dict(generation_kwargs={"min_new_tokens": h.CONFIG["max_completion_length"]})
    report = preflight(h.make_trainer(**never_stop), only=PADDING_CHECKS)
    assert report.passed and report.skipped == PADDING_CHECKS, table(report)
    for c in report.checks:
        assert "not exercised: no batch of 8 (seeds 0-7) has a padded row" in c.hint, c.hint
    fault = h.fault_classes()["mask_shift"]
    (mask,) = preflight(h.make_trainer(fault.cls, **never_stop), only=["mask_policy"]).checks
    assert not mask.passed and not mask.skipped and mask.code == fault.code, mask
