"""The reference GRPO trainer: task layout, alignment, determinism, fault registry, and that it learns."""

from __future__ import annotations

import dataclasses

import pytest

torch = pytest.importorskip("torch")

from rlguard.catalog import CODES  # noqa: E402
from rlguard.reference import FAULTS, GRPOConfig, train  # noqa: E402
from rlguard.reference.losses import build_action_mask, group_advantages, token_log_probs  # noqa: E402
from rlguard.reference.pipeline import Parts, make_parts  # noqa: E402
from rlguard.reference.sampling import collate, evaluate, sample_episodes  # noqa: E402
from rlguard.reference.task import ENV, OWNER_PAD, POLICY, PROMPT, TaskSpec, make_tasks  # noqa: E402
from rlguard.reference.trainer import base_policy  # noqa: E402

torch.set_num_threads(1)

SMALL = GRPOConfig(prompts_per_step=4, group_size=4)
CHAPTER_METRICS = ["step", "reward", "entropy", "approx_kl", "clip_frac", "ratio_max", "ratio_min", "grad_norm",
                   "length", "length_pass", "length_fail", "zero_adv_frac", "logp_gap", "kl_ref", "turns",
                   "malformed", "hardcode"]


@pytest.fixture(scope="module")
def batch():
    model = base_policy(SMALL)
    tasks, _ = make_tasks(SMALL.spec)
    episodes = sample_episodes(model, tasks[:4], SMALL.spec, 4, 1.0, torch.Generator().manual_seed(0))
    return model, collate(episodes, 4)


def test_tasks_split_disjoint_and_deterministic():
    train_a, held_a = make_tasks(TaskSpec())
    train_b, held_b = make_tasks(TaskSpec())
    assert train_a == train_b and held_a == held_b
    assert not set(train_a) & set(held_a)


def test_episode_layout_interleaves_owners(batch):
    _, b = batch
    ids, owner = b["ids"], b["owner"]
    assert ids.shape == owner.shape and b["sampler_logp"].shape == (ids.shape[0], ids.shape[1] - 1)
    assert (owner[:, :2] == PROMPT).all()
    assert (owner[:, 2] == ENV).all()
    for row in owner.tolist():
        real = [o for o in row if o != OWNER_PAD]
        assert POLICY in real and ENV in real
        assert real[-1] == POLICY  # an episode ends with the policy's last answer
        assert all(o == OWNER_PAD for o in row[len(real):])  # right padding only


def test_action_mask_is_policy_tokens_of_shifted_ids(batch):
    _, b = batch
    mask = build_action_mask(b["owner"])
    assert torch.equal(mask > 0, b["owner"][:, 1:] == POLICY)
    assert (b["sampler_logp"][mask == 0] == 0).all()


def test_trainer_log_probs_match_sampler(batch):
    model, b = batch
    with torch.no_grad():
        logp = token_log_probs(model(b["ids"]), b["ids"])
    mask = build_action_mask(b["owner"]) > 0
    assert (logp - b["sampler_logp"]).abs()[mask].max() < 1e-4


def test_group_advantages_centred_per_group():
    rewards = torch.tensor([0.0, 1.0, 1.0, 1.0, 0.5, 0.5, 0.5, 0.5])
    adv = group_advantages(rewards, 4)
    assert adv.view(2, 4).mean(-1).abs().max() < 1e-6
    assert (adv[4:] == 0).all() and adv[0] < 0 < adv[1]


def test_greedy_sampler_reproduces_evaluation(batch):
    model, _ = batch
    _, held = make_tasks(SMALL.spec)
    sampled = sample_episodes(model, held[:6], SMALL.spec, 1, 1.0, greedy=True)
    assert [ep.ids for ep in sampled] == evaluate(model, held[:6], SMALL.spec)["ids"]


def test_default_task_keeps_its_layout():
    spec = TaskSpec()
    assert spec.vocab_size == 18 and spec.max_len() == 14 and GRPOConfig().warm_start_probe == 0.1
    assert not any(t.blind for t in make_tasks(spec)[0])


def test_variable_length_task_reports_then_lets_the_policy_probe():
    from rlguard.reference.config import VARIABLE_LENGTH
    from rlguard.reference.task import THINK, finish, policy_step, start_episode

    spec = VARIABLE_LENGTH.spec
    tasks, held = make_tasks(spec)
    assert 0.3 < sum(t.blind for t in tasks) / len(tasks) < 0.7
    task = next(t for t in tasks if not t.blind)
    right = [spec.out_token(spec.answer(task.key, x)) for x in task.symbols]

    def play(answers, probes):
        ep = start_episode(spec, task)
        for token in answers:
            policy_step(spec, ep, token, 0.0)
        assert not ep.done and ep.ids[-1] == spec.report_token(answers == right) and ep.owner[-1] == ENV
        for _ in range(probes):
            if not ep.done:
                policy_step(spec, ep, THINK, 0.0)
        if not ep.done:
            policy_step(spec, ep, spec.out_token(0), 0.0)  # any other token ends the review
        return finish(ep, "pass")

    passed = play(right, 0)
    assert passed.done and passed.info["reward"] == 1.0 and passed.info["length"] == len(right) + 1
    failed = play([spec.out_token((spec.answer(task.key, task.symbols[0]) + 1) % spec.n_symbols)] + right[1:], 3)
    assert failed.info["reward"] == 0.0 and failed.info["thinks"] == 3 and failed.info["length"] == len(right) + 4
    capped = play(right, 100)  # at most review_tokens tokens after the report
    assert capped.info["thinks"] == spec.review_tokens and len(capped.ids) <= spec.max_len()
    blind = next(t for t in tasks if t.blind)
    ep = start_episode(spec, blind)
    for _ in blind.symbols[:-1]:
        policy_step(spec, ep, spec.out_token(0), 0.0)
    assert ep.ids[-1] == spec.blank_token()  # the last symbol is hidden


def test_variable_length_config_trains_and_samples_like_evaluation():
    from rlguard.reference.config import VARIABLE_LENGTH

    cfg = dataclasses.replace(VARIABLE_LENGTH, prompts_per_step=4, group_size=4, microbatches=2, warm_start_steps=0)
    model = base_policy(cfg)
    assert model.pos_emb.num_embeddings >= cfg.spec.max_len()
    _, held = make_tasks(cfg.spec)
    sampled = sample_episodes(model, held[:6], cfg.spec, 1, 1.0, greedy=True)
    assert [ep.ids for ep in sampled] == evaluate(model, held[:6], cfg.spec)["ids"]
    episodes = sample_episodes(model, held[:4], cfg.spec, 4, 1.0, torch.Generator().manual_seed(0), reward="pass")
    b = collate(episodes, 4)
    assert torch.equal(build_action_mask(b["owner"]) > 0, b["owner"][:, 1:] == POLICY)
    assert set(b["rewards"].tolist()) <= {0.0, 1.0}
    rows = train(cfg, steps=1)
    assert rows[0]["thinks"] >= 0 and rows[0]["logp_gap"] < 1e-5


def test_rows_have_the_chapter_metrics_and_are_deterministic():
    a = train(SMALL, steps=2)
    b = train(SMALL, steps=2)
    assert a == b
    for key in CHAPTER_METRICS:
        assert key in a[0], key
    assert "eval_pass" in a[0] and "eval_pass" in a[-1]
    assert a[0]["logp_gap"] < 1e-5


def test_config_options_run():
    for cfg in [dataclasses.replace(SMALL, loss_mode="seq_mean_token_mean"), dataclasses.replace(SMALL, reward="public"),
                dataclasses.replace(SMALL, kl_coef=0.0, kl_estimator="k1"), dataclasses.replace(SMALL, max_turns=6, warm_start_steps=0)]:
        rows = train(cfg, steps=1)
        assert rows[0]["reward"] >= 0


def test_fault_registry():
    assert len(FAULTS) == 16
    chapter = {"mask_shift", "stale_old_logp", "entropy_sign", "sign_flip", "accum_local", "sampler_temp",
               "ref_is_policy"}
    assert chapter <= set(FAULTS)
    assert {f.code for f in FAULTS.values()} >= {"RLG009", "RLG011", "RLG012", "RLG013", "RLG014", "RLG016",
                                                 "RLG017", "RLG018", "RLG019"}
    fields = {f.name for f in dataclasses.fields(Parts)}
    for fault in FAULTS.values():
        assert fault.code in CODES
        assert fault.part in fields
        assert fault.path.is_file()
        swapped = make_parts(fault.name)
        assert getattr(swapped, fault.part) is fault.function
        assert getattr(Parts(), fault.part) is not fault.function


@pytest.mark.parametrize("fault", list(FAULTS))
def test_every_fault_trains_one_step(fault):
    rows = train(SMALL, fault=fault, steps=1)
    assert len(rows) == 1


@pytest.mark.slow
def test_default_run_learns():
    history = train(GRPOConfig())
    first = sum(r["reward"] for r in history[:4]) / 4
    last = sum(r["reward"] for r in history[-4:]) / 4
    assert len(history) == 24
    assert last > first + 0.2, (first, last)
    assert history[-1]["eval_pass"] > history[0]["eval_pass"]


def test_contracts_on_and_off_train_bit_identically():
    from rlguard.contracts import ContractViolation, mode

    def run():
        model = base_policy(SMALL)
        train(SMALL, steps=2, model=model)
        return model.state_dict()

    with mode("raise"):
        on = run()
        with pytest.raises(ContractViolation):  # the contracts really are active on the trainer's functions
            token_log_probs(torch.zeros(2, 5, 7), torch.zeros(2, 4, dtype=torch.long))
    with mode("off"):
        off = run()
    assert all(torch.equal(on[k], off[k]) for k in on)
