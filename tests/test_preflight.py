"""The preflight suite: adapter loading, the checks on the example trainer, reports, the CLI's exit codes, the plugin."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from rlguard.preflight.adapter import REQUIRED, AdapterError, load_adapter, missing  # noqa: E402
from rlguard.preflight.checks import CHECKS  # noqa: E402
from rlguard.preflight.cli import check_main  # noqa: E402
from rlguard.preflight.report import markdown, table  # noqa: E402
from rlguard.preflight.suite import TrainerError, run_suite  # noqa: E402

torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "trl_style_grpo.py"
if str(EXAMPLE.parent) not in sys.path:
    sys.path.insert(0, str(EXAMPLE.parent))


@pytest.fixture(scope="module")
def example_report():
    from trl_style_grpo import TRLStyleAdapter

    return run_suite(TRLStyleAdapter())


def test_catalog_codes_of_checks():
    from rlguard.catalog import CODES

    for name, (fn, code, hint) in CHECKS.items():
        assert code is None or code in CODES, name
        assert callable(fn) and hint


def test_reference_adapter_satisfies_protocol():
    from rlguard.preflight.adapter import TrainerAdapter
    from rlguard.reference.adapter import adapter

    assert not missing(adapter)
    assert isinstance(adapter, TrainerAdapter)


def test_example_adapter_passes_every_check(example_report):
    assert example_report.passed, table(example_report)
    skipped = {c.name for c in example_report.checks if c.skipped}
    assert skipped == {"entropy_direction", "greedy_eval"}  # no entropy bonus, no greedy path in the example
    assert [c.name for c in example_report.checks] == list(CHECKS)


def test_report_renderings(example_report):
    text = table(example_report)
    assert "check" in text and "all checks passed" in text
    md = markdown(example_report)
    assert md.startswith("# rlguard preflight report") and "| kl_direction |" in md
    data = example_report.to_dict()
    assert data["passed"] is True
    for c in data["checks"]:
        assert {"name", "code", "value", "tolerance", "passed", "hint"} <= set(c)
    json.dumps(data)


def test_load_adapter_forms(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(AdapterError, match="cannot import"):
        load_adapter("no_such_module_xyz:adapter")
    (tmp_path / "half_adapter.py").write_text("group_size = 4\ndef build_model():\n    return None\n")
    with pytest.raises(AdapterError, match="missing"):
        load_adapter("half_adapter")
    assert len(REQUIRED) >= 10


def test_broken_trainer_is_trainer_error():
    from trl_style_grpo import TRLStyleAdapter

    class Broken(TRLStyleAdapter):
        def make_batch(self, model, seed):
            raise RuntimeError("sampler crashed")

    with pytest.raises(TrainerError, match="sampler crashed"):
        run_suite(Broken())


def test_faulty_example_fails_its_check():
    from trl_style_grpo import TRLStyleAdapter, TinyGRPOTrainer

    class NoZeroGrad(TinyGRPOTrainer):
        def training_step(self, inputs):
            self.optimizer.zero_grad = lambda *a, **k: None  # a trainer that forgot zero_grad
            return super().training_step(inputs)

    class Adapter(TRLStyleAdapter):
        def _trainer(self, model):
            return NoZeroGrad(model, self.args, self.spec)

    report = run_suite(Adapter(), only=["grads_zeroed", "accumulation"])
    assert report.failed == ["grads_zeroed"]
    assert "gradients are not zeroed" in report.checks[-1].hint  # the cause, not the determinism control


def _run_check(args, cwd, pythonpath):
    env = dict(os.environ, PYTHONPATH=str(pythonpath))
    return subprocess.run([sys.executable, "-m", "rlguard", "check", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def test_check_cli_exit_codes(tmp_path):
    src = EXAMPLE.read_text()
    (tmp_path / "good.py").write_text(src)
    bad = src.replace("per_token_loss = -torch.min(", "per_token_loss = torch.min(")
    assert bad != src
    (tmp_path / "bad.py").write_text(bad)
    (tmp_path / "broken.py").write_text(src.replace("def build_model(self):", "def build_model(self):\n        1 / 0"))
    out = tmp_path / "out"
    good = _run_check(["good:adapter", "--out", str(out), "-q"], tmp_path, tmp_path)
    assert good.returncode == 0, good.stdout + good.stderr
    data = json.loads((out / "report.json").read_text())
    assert data["passed"] is True and len(data["checks"]) == len(CHECKS)
    assert (out / "report.md").is_file()
    failed = _run_check(["bad:adapter", "-q", "--only", "advantage_direction,group_mean"], tmp_path, tmp_path)
    assert failed.returncode == 1, failed.stdout + failed.stderr
    assert "FAIL" in failed.stdout and "RLG005" in failed.stdout
    assert _run_check(["broken:adapter", "-q"], tmp_path, tmp_path).returncode == 125
    assert _run_check(["does_not_exist:adapter", "-q"], tmp_path, tmp_path).returncode == 125


def test_check_main_in_process(capsys):
    assert check_main(["trl_style_grpo:adapter", "-q", "--only", "ratio_one,group_mean"]) == 0
    assert "ratio_one" in capsys.readouterr().out


def test_pytest_plugin_fixture_and_marker(tmp_path):
    src = EXAMPLE.read_text()
    (tmp_path / "good_trainer.py").write_text(src)
    (tmp_path / "bad_trainer.py").write_text(src.replace("per_token_loss = -torch.min(", "per_token_loss = torch.min("))
    (tmp_path / "test_user.py").write_text(textwrap.dedent("""
        import pytest

        ONLY = ["advantage_direction", "group_mean"]

        def test_fixture_good(rlguard_check):
            assert rlguard_check("good_trainer:adapter", only=ONLY).passed

        def test_fixture_bad(rlguard_check):
            rlguard_check("bad_trainer:adapter", only=ONLY)

        @pytest.mark.rlguard_preflight("bad_trainer:adapter", only=ONLY)
        def test_marker_bad():
            pass
    """))
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_user.py"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert "2 failed, 1 passed" in out, out
    assert "rlguard preflight failed: advantage_direction" in out


def test_frozen_params_default_is_what_the_model_declared_when_built():
    """The intended trainable set defaults to requires_grad as build_model returned the model, before any
    trainer code ran: a trainer that switches its frozen embedding back on is caught without trainable_names."""
    from trl_style_grpo import TRLStyleAdapter

    class FrozenEmbedding(TRLStyleAdapter):
        def build_model(self):
            model = super().build_model()
            model.tok_emb.requires_grad_(False)  # the model declares its token embedding frozen
            return model

    class Unfreezes(FrozenEmbedding):
        def _trainer(self, model):
            model.requires_grad_(True)  # the fault: the trainer makes every parameter trainable itself
            return super()._trainer(model)

    assert run_suite(FrozenEmbedding(), only=["frozen_params"]).passed
    report = run_suite(Unfreezes(), only=["frozen_params"])
    assert report.failed == ["frozen_params"]
    assert "tok_emb.weight" in report.checks[0].hint and "requires_grad when built" in report.checks[0].hint


def test_frozen_params_says_when_it_needs_trainable_names():
    from trl_style_grpo import TRLStyleAdapter

    result = run_suite(TRLStyleAdapter(), only=["frozen_params"]).checks[0]
    assert result.passed and "give the adapter trainable_names(model)" in result.hint


def test_grads_zeroed_tells_a_nondeterministic_update_from_stale_gradients():
    from trl_style_grpo import TRLStyleAdapter

    class SharedGenerator(TRLStyleAdapter):
        """A copied trainer whose adapter keeps one shuffle generator across calls: each update shuffles
        differently, gradients are zeroed fine."""

        def __init__(self):
            super().__init__()
            self.generator = torch.Generator().manual_seed(0)

        def _trainer(self, model):
            trainer = super()._trainer(model)
            trainer.generator = self.generator
            return trainer

    result = run_suite(SharedGenerator(), only=["grads_zeroed"]).checks[0]
    assert not result.passed
    assert "not deterministic across calls" in result.hint and "not a zero_grad problem" in result.hint
    healthy = run_suite(TRLStyleAdapter(), only=["grads_zeroed"]).checks[0]
    assert healthy.passed and healthy.value == 0


def test_old_log_probs_with_autograd_fail_targets_detached():
    """RLG003: a trainer whose old log-probs are scored with autograd on (outside no_grad)."""
    from trl_style_grpo import TRLStyleAdapter

    class OldWithGrad(TRLStyleAdapter):
        def old_log_probs(self, model, batch):
            return self._trainer(model)._get_per_token_logps(model, batch["input_ids"])  # no torch.no_grad()

    report = run_suite(OldWithGrad(), only=["targets_detached"])
    (check,) = report.checks
    assert report.failed == ["targets_detached"] and check.code == "RLG003"
    assert "old_log_probs(model, batch)" in check.hint and "torch.no_grad()" in check.hint
    assert run_suite(TRLStyleAdapter(), only=["targets_detached"]).passed


def test_a_check_that_raises_is_an_rlguard_error_not_a_finding(tmp_path, capsys):
    from trl_style_grpo import TRLStyleAdapter

    class Raises(TRLStyleAdapter):
        def advantages(self, batch):
            raise RuntimeError("Trying to backward through the graph a second time")

    report = run_suite(Raises(), only=["group_mean", "mask_policy"])
    (error, ok) = sorted(report.checks, key=lambda c: c.name)
    assert error.error and error.code is None and not error.passed and ok.passed
    assert report.failed == [] and report.errors == ["group_mean"]
    assert "rlguard error: the check raised RuntimeError: Trying to backward" in error.hint
    assert "test_preflight.py" in error.hint  # where it broke
    assert "ERROR" in table(report) and "could not run (rlguard errors, not findings)" in table(report)
    assert [c.get("error", False) for c in report.to_dict()["checks"]] == [False, True]  # mask_policy, group_mean
    module = tmp_path / "raising_adapter.py"
    module.write_text("from trl_style_grpo import TRLStyleAdapter\n\n"
                      "class Adapter(TRLStyleAdapter):\n"
                      "    def advantages(self, batch):\n"
                      "        raise RuntimeError('boom')\n\nadapter = Adapter()\n")
    sys.path.insert(0, str(tmp_path))
    try:
        assert check_main(["raising_adapter:adapter", "-q", "--only", "group_mean"]) == 2
    finally:
        sys.path.remove(str(tmp_path))
    assert "group_mean: rlguard error: the check raised RuntimeError: boom" in capsys.readouterr().err


def test_checks_draw_more_batches_until_their_precondition_is_met():
    from trl_style_grpo import TRLStyleAdapter

    class FlatFirstBatch(TRLStyleAdapter):
        def make_batch(self, model, seed):
            batch = super().make_batch(model, seed)
            if seed == 0:  # every group of the first batch has equal rewards: no direction to measure
                batch["rewards"] = torch.zeros_like(batch["rewards"])
                batch["advantages"] = torch.zeros_like(batch["advantages"])
                ids = batch["input_ids"]
                batch["input_ids"] = torch.where(ids == self.spec.eos_token(), torch.full_like(ids, 2), ids)
            return batch

    adapter = FlatFirstBatch()
    report = run_suite(adapter, only=["advantage_direction", "group_mean"])
    direction = next(c for c in report.checks if c.name == "advantage_direction")
    assert direction.passed and not direction.skipped and direction.seed == 1
    assert "seed 1" in direction.hint and "batches: the first for every check but advantage_direction (seed 1)" \
        in table(report)
    # no completion of the first batch ends in EOS: the stop-token check takes the next batch
    (stop,) = run_suite(adapter, only=["stop_token_trained"]).checks
    assert stop.passed and not stop.skipped and stop.seed == 1, stop
    adapter.stop_token_ids = (10_000,)  # never written: not exercised, with the seeds tried
    (never,) = run_suite(adapter, only=["stop_token_trained"]).checks
    assert never.skipped and "not exercised" in never.hint and "seeds 0-7" in never.hint


PADDING_CHECKS = ["mask_policy", "padding_invariant", "padding_leak"]


def _same_length_batches(unpadded):
    """The example adapter whose batches of the seeds in ``unpadded`` hold no padded row: every row a copy of the
    batch's longest completion, so no completion ends before another."""
    from trl_style_grpo import TRLStyleAdapter

    class SameLength(TRLStyleAdapter):
        def make_batch(self, model, seed):
            batch = super().make_batch(model, seed)
            if seed in unpadded:
                owned = self.policy_tokens(batch)[:, 1:]
                cols = torch.arange(1, owned.shape[1] + 1)
                longest = int((owned.long() * cols).max(-1).values.argmax())
                n = owned.shape[0]
                batch = {k: v[[longest] * n] if torch.is_tensor(v) and v.dim() and v.shape[0] == n else v
                         for k, v in batch.items()}
            return batch

    return SameLength()


def test_padding_checks_draw_batches_until_one_has_a_padded_row(tmp_path):
    """mask_policy, padding_invariant and padding_leak check what happens past a completion's end: a batch whose
    completions all have the longest length has no such place, so they draw the next seeds' batches; the batches
    used and the base seed are in the table, report.md and report.json."""
    from rlguard.preflight.checks import padded_row, Context
    from rlguard.preflight.report import write_report

    adapter = _same_length_batches({0, 1})
    assert not padded_row(Context(adapter, 0)) and padded_row(Context(adapter, 2))  # the test's premise
    report = run_suite(adapter, only=PADDING_CHECKS)
    for c in report.checks:
        assert c.passed and not c.skipped and c.seed == 2, c
        assert c.hint.startswith("(on the batch of seed 2, the first of 3 with a padded row"), c.hint
    line = ("batches: the first for every check but mask_policy (seed 2), padding_invariant (seed 2), "
            "padding_leak (seed 2)")
    assert line in table(report)
    assert f"Base seed 0; {line}." in markdown(report)
    write_report(report, tmp_path)
    data = json.loads((tmp_path / "report.json").read_text())
    assert data["seed"] == 0 and data["batches"] == {name: 2 for name in PADDING_CHECKS}
    assert f"Base seed 0; {line}." in (tmp_path / "report.md").read_text()
    first = run_suite(adapter, seed=2, only=PADDING_CHECKS)  # a padded first batch: nothing drawn
    assert all(c.seed is None for c in first.checks) and first.to_dict()["batches"] == {}
    assert first.to_dict()["seed"] == 2 and "Base seed 2; batches: the first for every check." in markdown(first)


def test_padding_checks_without_a_padded_row_are_not_exercised_but_a_failure_is_still_reported():
    adapter = _same_length_batches(set(range(8)))
    report = run_suite(adapter, only=PADDING_CHECKS)
    assert report.passed and report.skipped == PADDING_CHECKS
    for c in report.checks:
        assert c.hint.startswith("skipped: not exercised: no batch of 8 (seeds 0-7) has a padded row"), c.hint
        assert "the first batch passes it: measured" in c.hint
    shifted = _same_length_batches(set(range(8)))
    shifted.action_mask = lambda batch: torch.nn.functional.pad(batch["completion_mask"], (1, 0))[:, :-1]
    (mask,) = run_suite(shifted, only=["mask_policy"]).checks  # a fault is a finding on any batch
    assert not mask.passed and not mask.skipped and mask.code == "RLG001" and mask.seed is None, mask


def test_kl_direction_near_zero_kl_is_not_exercised_rather_than_a_verdict_from_noise():
    """A policy whose logits are scaled to ~1e-7: the KL to the reference is ~1e-9, below float32's rounding of
    it, so whatever sign its change takes is noise. The check says so (skipped, with the numbers) instead of
    failing or passing on that sign; the healthy example still gets its verdict."""
    from trl_style_grpo import TRLStyleAdapter

    class NearZeroKL(TRLStyleAdapter):
        def logits(self, model, batch):
            return super().logits(model, batch) * 1e-7

    for seed in (0, 1):
        (result,) = run_suite(NearZeroKL(), seed=seed, only=["kl_direction"]).checks
        assert result.skipped and result.passed, result
        assert "not exercised" in result.hint and "within rounding" in result.hint, result.hint
    (healthy,) = run_suite(TRLStyleAdapter(), only=["kl_direction"]).checks
    assert healthy.passed and not healthy.skipped and healthy.value < 0, healthy
