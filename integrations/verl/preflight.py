"""A preflight adapter (``rlguard.preflight.adapter``) that drives verl's own math on a tiny policy.

    # my_verl_check.py
    from rlguard.integrations.verl import verl_adapter
    adapter = verl_adapter(".hydra/config.yaml")       # your run's config; or keyword args
    # rlguard check my_verl_check:adapter

What runs is verl's code, with the user's choices: ``verl.trainer.ppo.ray_trainer.compute_advantage`` (which
dispatches to the registered advantage estimators, the user's included), ``apply_kl_penalty`` (the KL in the
reward, ``algorithm.use_kl_in_reward``), ``verl.workers.utils.losses.ppo_loss`` (the actor's loss: the
registered policy loss by ``policy_loss.loss_mode``, ``agg_loss`` by ``loss_agg_mode``, the entropy bonus by
``entropy_coeff``, ``kl_penalty`` by ``kl_loss_type`` for ``use_kl_loss``, the global-batch normalisation its
``global_batch_info`` carries), ``no_padding_2_padding`` (the actor's unpacking of the model output),
``get_response_mask`` (the response mask from the EOS), ``logprobs_from_logits`` and ``entropy_from_logits``; the
configuration is verl's own dataclasses (``FSDPActorConfig``, ``AlgoConfig``), which validate it.

What does not run: the FSDP/Megatron engine and worker (``ActorRolloutRefWorker``, ``FSDPEngineWithLMHead``),
the vLLM/SGLang rollout, Ray and the reward managers. The engine registers itself for "cuda" and "npu" devices
only (``@EngineRegistry.register(..., device=["cuda", "npu"])``) and on a CPU-only machine verl's platform
falls back to CUDA (``get_device_name()`` is "cuda"), so ``forward_backward_batch`` moves its token count to a
CUDA device before any loss is computed. In their place the adapter replays the engine's loop: mini-batches of
the batch, micro-batches of each, ``ppo_loss`` per micro-batch normalised by the mini-batch's token and
sequence counts (``batch_num_tokens``, ``global_batch_size``, ``dp_size=1``, as ``forward_backward_batch`` sets
them), ``loss.backward()`` each, gradient clipping at ``grad_clip``, one ``optimizer.step()`` per mini-batch;
the sampler is a token-by-token multinomial sampler over the same tiny model.

The policy is ``rlguard.reference.model.TinyCausalLM`` (built in code, no download); prompts are random tokens
of one length (no left padding), responses end at the EOS (which is also the pad token) or at
``response_length``; the reward of an episode is the share of its response tokens that are even. The sizes of the
run (prompts, mini-batches, micro-batches, learning rate) are the preflight's, not the user's run's: they are a
few rows of the tiny model.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib
import os
from collections.abc import Mapping
from typing import Any, Callable

import numpy as np
import torch
import torch.nn.functional as F

from rlguard.integrations.verl import checks
from rlguard.reference.model import ModelConfig, build_model

VOCAB = 16
EOS = 1  # also verl's pad token here: get_response_mask keeps the first EOS in the mask, cuts what follows
PROMPT_LEN = 4
SUITE_PADDING = 8  # the columns of right padding the suite's padding checks add (positions the model must embed)

# the user's choices, by where verl keeps them
ACTOR_KEYS = ("loss_agg_mode", "clip_ratio", "clip_ratio_low", "clip_ratio_high", "clip_ratio_c", "entropy_coeff",
              "use_kl_loss", "kl_loss_coef", "kl_loss_type", "ppo_epochs", "loss_scale_factor", "tau_pos", "tau_neg",
              "calculate_entropy", "grad_clip")
ALGO_KEYS = ("adv_estimator", "gamma", "lam", "norm_adv_by_std_in_grpo", "use_kl_in_reward", "kl_penalty",
             "gdpo_reward_weights")
ROLLOUT_KEYS = ("n", "temperature")
# the preflight's own: sizes of its run, and the user's functions that replace verl's
OWN_KEYS = ("prompts", "mini_batches", "micro_batches", "response_length", "lr", "seed", "apply_kl_penalty",
            "old_log_prob_fn", "group_relative")
SHORTCUTS = ("loss_mode", "kl_coef", "rollout_n", "policy_loss", "kl_ctrl")
# KL estimators whose use cannot be judged by a step on the term (see documented_deviations): k1 as a loss, and
# anything but k1 as a reward
BIASED_LOSS_KL = ("kl", "k1")
UNBIASED_REWARD_KL = ("kl", "k1")
# when the choices name no estimator: verl's own default, "gae", needs a critic, which the preflight lacks
DEFAULT_ESTIMATOR = "grpo"
# estimators the preflight cannot feed, and why
UNSUPPORTED_ESTIMATORS = {"gae": "GAE needs a critic's values, and the preflight builds no critic (verl's "
                                 "critic worker does not run here)"}


class VerlPreflightError(ValueError):
    """The configuration is one the verl preflight cannot run (it says which setting and why)."""


# ---------------------------------------------------------------------------------------------- configuration


def _plain(config: Any) -> dict:
    """A verl config as plain dicts: a Mapping, an OmegaConf DictConfig, or the path of a saved (composed) YAML
    config such as Hydra's ``outputs/.../.hydra/config.yaml``."""
    if config is None:
        return {}
    if isinstance(config, (str, os.PathLike)):
        from omegaconf import OmegaConf

        config = OmegaConf.load(os.fspath(config))
    if type(config).__name__ == "DictConfig":
        from omegaconf import OmegaConf

        return OmegaConf.to_container(config, resolve=True)
    if not isinstance(config, Mapping):
        raise VerlPreflightError(f"a verl config is a dict, a DictConfig or a YAML path, got {type(config).__name__}")
    return dict(config)


def _section(config: dict, *path: str) -> dict:
    for key in path:
        config = config.get(key) or {}
        if not isinstance(config, Mapping):
            return {}
    return dict(config)


def choices_from_config(config: Any) -> dict:
    """The choices the preflight reads from a verl config (``algorithm``, ``actor_rollout_ref.actor`` and
    ``.rollout``, ``data.train_batch_size``), as keyword arguments of ``verl_adapter``."""
    plain = _plain(config)
    algorithm, actor = _section(plain, "algorithm"), _section(plain, "actor_rollout_ref", "actor")
    rollout = _section(plain, "actor_rollout_ref", "rollout")
    out = {k: algorithm[k] for k in ALGO_KEYS if algorithm.get(k) is not None}
    if algorithm.get("kl_ctrl"):
        out["kl_ctrl"] = dict(algorithm["kl_ctrl"])
    out.update({k: actor[k] for k in ACTOR_KEYS if actor.get(k) is not None})
    if actor.get("policy_loss"):
        out["policy_loss"] = dict(actor["policy_loss"])
    if rollout.get("n") is not None:
        out["rollout_n"] = rollout["n"]
    if rollout.get("temperature") is not None:
        out["temperature"] = rollout["temperature"]
    train, mini = _section(plain, "data").get("train_batch_size"), actor.get("ppo_mini_batch_size")
    if isinstance(train, int) and isinstance(mini, int) and mini > 0:
        out["mini_batches"] = max(1, train // mini)
    micro = actor.get("ppo_micro_batch_size_per_gpu")
    if isinstance(mini, int) and isinstance(micro, int) and micro > 0:
        out["micro_batches"] = max(1, mini * int(rollout.get("n") or 1) // micro)
    return out


@dataclasses.dataclass
class Choices:
    """What the preflight runs with: verl's configs, built by verl's own dataclasses, and its own sizes."""

    actor: Any  # verl.workers.config.FSDPActorConfig
    algorithm: Any  # verl.trainer.config.AlgoConfig
    n: int = 4
    temperature: float = 1.0
    prompts: int = 4
    mini_batches: int = 2
    micro_batches: int = 2
    response_length: int = 6
    lr: float = 1e-2
    seed: int = 0
    apply_kl_penalty: Callable | None = None
    old_log_prob_fn: Callable | None = None
    group_relative: dict | None = None

    @property
    def loss_mode(self) -> str:
        return self.actor.policy_loss.loss_mode

    @property
    def kl_in_loss(self) -> bool:
        return bool(self.actor.use_kl_loss)

    @property
    def kl_in_reward(self) -> bool:
        return bool(self.algorithm.use_kl_in_reward)


def build_choices(given: dict) -> Choices:
    """``Choices`` from ``verl_adapter``'s keyword arguments; unknown names are refused (a typo would silently
    check the default)."""
    from verl.trainer.config import AlgoConfig
    from verl.trainer.config.algorithm import KLControlConfig
    from verl.workers.config import FSDPActorConfig, PolicyLossConfig

    known = set(ACTOR_KEYS) | set(ALGO_KEYS) | set(OWN_KEYS) | set(SHORTCUTS) | set(ROLLOUT_KEYS)
    unknown = sorted(set(given) - known)
    if unknown:
        raise VerlPreflightError(f"unknown verl preflight setting(s) {', '.join(unknown)}; known: "
                                 f"{', '.join(sorted(known))}")
    policy_loss = dict(given.get("policy_loss") or {})
    if "loss_mode" in given:
        policy_loss["loss_mode"] = given["loss_mode"]
    if isinstance(policy_loss.get("rollout_correction"), Mapping):
        from verl.trainer.config.algorithm import RolloutCorrectionConfig

        policy_loss["rollout_correction"] = RolloutCorrectionConfig(**policy_loss["rollout_correction"])
    n = int(given.get("rollout_n", given.get("n", 4)))
    actor = FSDPActorConfig(strategy="fsdp", rollout_n=n, ppo_micro_batch_size_per_gpu=1,
                            policy_loss=PolicyLossConfig(**policy_loss),
                            **{k: given[k] for k in ACTOR_KEYS if k in given})
    kl_ctrl = dict(given.get("kl_ctrl") or {})
    if "kl_coef" in given:
        kl_ctrl["kl_coef"] = given["kl_coef"]
    algo = {k: given[k] for k in ALGO_KEYS if k in given}
    algo.setdefault("adv_estimator", DEFAULT_ESTIMATOR)
    algorithm = AlgoConfig(kl_ctrl=KLControlConfig(**kl_ctrl), gdpo_reward_keys=["score"], **algo)
    own = {k: given[k] for k in OWN_KEYS if k in given}
    return Choices(actor=actor, algorithm=algorithm, n=n, temperature=float(given.get("temperature", 1.0)), **own)


# ---------------------------------------------------------------------------------------------- layout helpers


def per_token(prompt_len: int, response: torch.Tensor) -> torch.Tensor:
    """[B, R] over the response -> [B, P+R-1] aligned to ``ids[:, 1:]`` of ``ids = cat(prompts, responses)``
    (zeros over the prompt): verl's per-token tensors in the layout of rlguard's checks."""
    b, r = response.shape[:2]
    out = response.new_zeros((b, prompt_len + r - 1) + tuple(response.shape[2:]))
    out[:, prompt_len - 1:] = response
    return out


def packed(per_response: torch.Tensor, attention_mask: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """[B, R] response values -> the actor's packed model output (remove-padding layout, [total tokens]):
    each row's valid tokens in order, the value predicting token k+1 at token k, which is what verl's
    ``no_padding_2_padding`` unpacks (the prompt's own positions hold 0: the loss never reads them)."""
    b = per_response.shape[0]
    before = per_response.new_zeros(b, prompt_len - 1)
    after = per_response.new_zeros(b, attention_mask.shape[1] - prompt_len - per_response.shape[1] + 1)
    full = torch.cat([before, per_response, after], dim=1)
    return full[attention_mask.bool()]


ROW_KEYS_2D = ("responses", "response_mask", "rollout_log_probs", "old_log_probs", "ref_log_prob",
               "token_level_scores", "token_level_rewards", "advantages", "returns", "sum_pi_squared", "written")


# ---------------------------------------------------------------------------------------------- the adapter


class VerlAdapter:
    """rlguard's preflight adapter over verl's math (see the module docstring); build it with ``verl_adapter``."""

    def __init__(self, choices: Choices):
        torch.set_num_threads(1)
        self.choices = c = choices
        self._core = importlib.import_module("verl.trainer.ppo.core_algos")
        self._losses = importlib.import_module("verl.workers.utils.losses")
        self._trainer = importlib.import_module("verl.trainer.ppo.ray_trainer")
        self._functional = importlib.import_module("verl.utils.torch_functional")
        self.group_size = c.n
        self.stop_token_ids = (EOS,)
        self.pad_id = EOS
        self._refuse_unsupported()
        self.weighting = checks.group_weighting(c.algorithm.adv_estimator, self._estimator(), c.group_relative)
        self.model_config = ModelConfig(vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=4,
                                        max_len=PROMPT_LEN + c.response_length + SUITE_PADDING)

    def _estimator(self):
        return self._core.get_adv_estimator_fn(self.choices.algorithm.adv_estimator)

    def _refuse_unsupported(self) -> None:
        c, problems = self.choices, []
        name = c.algorithm.adv_estimator
        if name in UNSUPPORTED_ESTIMATORS:
            problems.append(f"adv_estimator={name!r}: {UNSUPPORTED_ESTIMATORS[name]}")
        elif name not in self._core.ADV_ESTIMATOR_REGISTRY:
            problems.append(f"adv_estimator={name!r} is not registered (registered: "
                            f"{', '.join(sorted(self._core.ADV_ESTIMATOR_REGISTRY))}); register yours before")
        if c.loss_mode not in self._core.POLICY_LOSS_REGISTRY:
            problems.append(f"policy_loss.loss_mode={c.loss_mode!r} is not registered (registered: "
                            f"{', '.join(sorted(self._core.POLICY_LOSS_REGISTRY))}); register yours before")
        if c.n < 2:
            problems.append(f"rollout.n={c.n}: the preflight needs at least 2 samples per prompt")
        if c.prompts % c.mini_batches:
            problems.append(f"prompts={c.prompts} is not a multiple of mini_batches={c.mini_batches}")
        if problems:
            raise VerlPreflightError("the verl preflight cannot run " + "; ".join(problems))

    # -- configuration -----------------------------------------------------------------------------------------
    def not_applicable(self) -> dict[str, str]:
        c, out = self.choices, {}
        if not (c.kl_in_loss or c.kl_in_reward):
            out["kl_positive"] = out["kl_direction"] = ("no KL term: actor.use_kl_loss and algorithm.use_kl_in_reward "
                                                        "are both off (verl builds no reference)")
        if not c.actor.entropy_coeff:
            out["entropy_direction"] = "entropy_coeff == 0: verl's ppo_loss adds no entropy bonus"
        name = c.algorithm.adv_estimator
        if self.weighting is None:
            out["group_mean"] = checks.NOT_GROUP_CENTRED.get(
                name, f"the estimator {name!r} takes no index: its advantages are not group-relative")
        elif self.weighting == "token":
            out["group_mean"] = (f"{name!r} centres each group per token (a length-weighted baseline), not per "
                                 "episode: the runtime contract (install()) checks that")
        if c.actor.ppo_epochs * c.mini_batches == 1:
            out["old_logp_frozen"] = (f"one optimizer step per batch (ppo_epochs={c.actor.ppo_epochs}, one "
                                      "mini-batch): the ratio is 1 by construction")
        out["grads_zeroed"] = ("the optimizer loop is the preflight's replay of verl's engine (zero_grad at every "
                               "train_batch), which the check would test instead of verl")
        return out

    def documented_deviations(self) -> dict[str, str]:
        """verl's documented settings whose behaviour has a fault's signature by design."""
        c, out = self.choices, {}
        if c.actor.loss_agg_mode == "seq-mean-token-sum-norm" and c.actor.loss_scale_factor is None:
            out["padding_invariant"] = (
                "loss_agg_mode='seq-mean-token-sum-norm' with loss_scale_factor=None: verl divides by the padded "
                "response length (loss_mask.shape[-1]), as agg_loss documents; set actor.loss_scale_factor to a "
                "constant for a normalisation that padding does not change")
        if c.kl_in_loss and c.actor.kl_loss_type in BIASED_LOSS_KL:
            out["kl_direction"] = (
                f"kl_loss_type={c.actor.kl_loss_type!r} in the loss: the gradient of k1 is E[grad log pi], which is "
                "0 in expectation on-policy and not the KL's gradient, as verl documents (its '+' types, "
                "'k1+'/'k3+', take k2's gradient): a step on it need not lower the KL, so its sign cannot be judged")
        if c.kl_in_reward and c.algorithm.kl_penalty not in UNBIASED_REWARD_KL:
            out["kl_direction"] = (
                f"kl_penalty={c.algorithm.kl_penalty!r} in the reward: the policy gradient of a reward that is this "
                "estimator leaves out the estimator's own dependence on the policy (only k1's is 0 in expectation), "
                "so it is not the KL's gradient and a step on it need not lower the KL; its sign cannot be judged "
                "('kl' / 'k1' can)")
        if c.loss_mode == "clip_cov":
            out["accumulation"] = out["rows_in_step"] = (
                "loss_mode='clip_cov' detaches a random sample of each call's tokens whose covariance lies in "
                "(clip_cov_lb, clip_cov_ub), at least one token per call (clip_cov_ratio), drawn with torch.randperm: "
                "which tokens it picks depends on the micro-batching and on the rows' order, by design")
        if c.loss_mode == "geo_mean" and c.micro_batches > 1:
            out["accumulation"] = (
                "loss_mode='geo_mean' averages each micro-batch with torch.mean (verl documents loss_agg_mode as "
                "not used by it, and it ignores global_batch_info): micro-batch means are summed, so the "
                "accumulated gradient is micro_batches times the one-pass gradient")
        return out

    # -- models ----------------------------------------------------------------------------------------------
    def build_model(self):
        return build_model(self.model_config, seed=self.choices.seed)

    def trainable_names(self, model) -> set[str]:
        """verl's actor trains every parameter of the policy (no LoRA here): all of the tiny model's."""
        return {name for name, _ in model.named_parameters()}

    def make_reference(self, model):
        """verl's reference worker: the same initial weights, frozen (only with a KL term)."""
        if not (self.choices.kl_in_loss or self.choices.kl_in_reward):
            return None
        return copy.deepcopy(model).eval().requires_grad_(False)

    def make_optimizer(self, model):
        """AdamW as verl's actor builds it (betas and weight decay from verl's optimizer config); the learning
        rate is the preflight's (a tiny model's), not the run's."""
        from verl.workers.config import FSDPOptimizerConfig

        optim = FSDPOptimizerConfig(lr=self.choices.lr)
        return torch.optim.AdamW(model.parameters(), lr=optim.lr, betas=tuple(optim.betas),
                                 weight_decay=optim.weight_decay)

    # -- the batch ------------------------------------------------------------------------------------------------
    def make_batch(self, model, seed):
        return self._batch(model, seed, self.make_reference(model))

    def _batch(self, model, seed, ref):
        """One batch sampled from ``model``; ``ref``: the reference (verl's: the initial weights, frozen)."""
        c = self.choices
        gen = torch.Generator().manual_seed(1000 + seed)
        prompts = torch.randint(2, VOCAB, (c.prompts, PROMPT_LEN), generator=gen).repeat_interleave(c.n, 0)
        with torch.no_grad():
            responses, written, rollout_logp = self._sample(model, prompts, gen)
        response_mask = self._functional.get_response_mask(responses, eos_token=EOS)
        batch = {
            "prompts": prompts, "responses": responses, "input_ids": torch.cat([prompts, responses], 1),
            "attention_mask": torch.cat([torch.ones_like(prompts), response_mask], 1),
            "response_mask": response_mask, "rollout_log_probs": rollout_logp, "written": written,
            "uid": np.array([f"prompt-{seed}-{i // c.n}" for i in range(prompts.shape[0])], dtype=object),
        }
        batch["scores"] = self._score(responses, response_mask)
        batch["token_level_scores"] = self._at_last_token(batch["scores"], response_mask)
        batch["old_log_probs"] = (c.old_log_prob_fn or self._old_log_probs)(model, batch)
        if ref is not None:
            with torch.no_grad():
                batch["ref_log_prob"] = self.response_log_probs(ref, batch)
        self._estimator_inputs(model, batch, prompts, gen)
        batch.update(self._advantages(batch, batch["old_log_probs"], batch.get("ref_log_prob"),
                                      batch["token_level_scores"]))
        return batch

    def _sample(self, model, prompts, gen):
        """Token by token from ``model`` at the rollout temperature; after the EOS, EOS (the pad) and mask 0."""
        t, r = self.choices.temperature, self.choices.response_length
        ids, done = prompts, torch.zeros(prompts.shape[0], dtype=torch.bool)
        tokens, written, logps = [], [], []
        for _ in range(r):
            logp = torch.log_softmax(model(ids)[:, -1].float() / t, -1)
            token = torch.multinomial(logp.exp(), 1, generator=gen).squeeze(-1)
            token = torch.where(done, torch.full_like(token, EOS), token)
            written.append(~done)
            logps.append(torch.where(done, torch.zeros(()), logp.gather(-1, token[:, None]).squeeze(-1)))
            tokens.append(token)
            done = done | (token == EOS)
            ids = torch.cat([ids, token[:, None]], 1)
        return torch.stack(tokens, 1), torch.stack(written, 1), torch.stack(logps, 1)

    def _greedy(self, model, prompts):
        ids = prompts
        for _ in range(self.choices.response_length):
            ids = torch.cat([ids, model(ids)[:, -1].argmax(-1, keepdim=True)], 1)
        responses = ids[:, prompts.shape[1]:]
        return responses, self._functional.get_response_mask(responses, eos_token=EOS)

    @staticmethod
    def _score(responses, response_mask):
        """The share of an episode's response tokens (its EOS excluded) that are even: rewards that differ
        within a group from the first batch on."""
        mask = response_mask.bool() & (responses != EOS)
        return ((responses % 2 == 0) & mask).sum(1).float() / mask.sum(1).clamp(min=1).float()

    @staticmethod
    def _at_last_token(scores, response_mask):
        """verl's reward managers put an episode's score on its last response token."""
        out = torch.zeros(response_mask.shape, dtype=torch.float32)
        last = (response_mask.sum(1) - 1).clamp(min=0)
        out[torch.arange(len(scores)), last] = scores
        return out

    def _estimator_inputs(self, model, batch, prompts, gen) -> None:
        """The extra inputs some estimators take, computed as verl's trainer computes them."""
        name = self.choices.algorithm.adv_estimator
        if name in ("optimal_token_baseline", "tir_optimal_token_baseline"):  # actor.calculate_sum_pi_squared
            with torch.no_grad():
                probs = torch.softmax(self._response_logits(model, batch), -1)
            batch["sum_pi_squared"] = (probs ** 2).sum(-1)
        if name == "remax":  # the reward of a greedy rollout of the same prompt
            with torch.no_grad():
                greedy, mask = self._greedy(model, prompts)
            batch["reward_baselines"] = self._score(greedy, mask)

    def _old_log_probs(self, model, batch):
        """verl's actor compute_log_prob: a forward of the policy without autograd."""
        with torch.no_grad():
            return self.response_log_probs(model, batch)

    def _advantages(self, batch, old_log_probs, ref_log_prob, scores) -> dict:
        """verl's driver: the KL penalty in the reward (``apply_kl_penalty``) when configured, then
        ``compute_advantage`` -> token_level_rewards, advantages, returns [B, R]."""
        from verl import DataProto

        c = self.choices
        tensors = {"response_mask": batch["response_mask"], "token_level_scores": scores,
                   "old_log_probs": old_log_probs, "responses": batch["responses"],
                   "attention_mask": batch["attention_mask"], "prompts": batch["prompts"]}
        for key in ("sum_pi_squared", "reward_baselines"):
            if key in batch:
                tensors[key] = batch[key]
        if ref_log_prob is not None:
            tensors["ref_log_prob"] = ref_log_prob
        data = DataProto.from_dict(tensors=tensors, non_tensors={
            "uid": batch["uid"], "score": batch["scores"].numpy().astype(np.float32)})
        if c.kl_in_reward:
            kl_ctrl = self._core.get_kl_controller(c.algorithm.kl_ctrl)  # a fresh one: each call alike
            data, _ = (c.apply_kl_penalty or self._trainer.apply_kl_penalty)(
                data, kl_ctrl=kl_ctrl, kl_penalty=c.algorithm.kl_penalty)
        else:
            data.batch["token_level_rewards"] = scores
        data = self._trainer.compute_advantage(
            data, adv_estimator=c.algorithm.adv_estimator, gamma=c.algorithm.gamma, lam=c.algorithm.lam,
            num_repeat=c.n, norm_adv_by_std_in_grpo=c.algorithm.norm_adv_by_std_in_grpo, config=c.algorithm)
        return {k: data.batch[k] for k in ("token_level_rewards", "advantages", "returns")}

    # -- scoring --------------------------------------------------------------------------------------------------
    def _response_logits(self, model, batch):
        """The logits that predict each response token, divided by the temperature (verl's actor does)."""
        r = batch["responses"].shape[1]
        logits = model(batch["input_ids"])
        return logits[:, PROMPT_LEN - 1:PROMPT_LEN - 1 + r].float() / self.choices.temperature

    def response_log_probs(self, model, batch):
        """[B, R] log-probs of the response tokens, through verl's ``logprobs_from_logits`` (with autograd as
        the caller has it)."""
        return self._functional.logprobs_from_logits(self._response_logits(model, batch), batch["responses"])

    def _response_entropy(self, model, batch):
        return self._functional.entropy_from_logits(self._response_logits(model, batch))

    # -- the protocol's views of the batch ----------------------------------------------------------------------
    def token_ids(self, batch):
        return batch["input_ids"]

    def policy_tokens(self, batch):
        return torch.cat([torch.zeros_like(batch["prompts"], dtype=torch.bool), batch["written"]], 1)

    def rewards(self, batch):
        return batch["scores"]

    def sampler_log_probs(self, batch):
        return per_token(PROMPT_LEN, batch["rollout_log_probs"])

    def old_log_probs(self, model, batch):
        return per_token(PROMPT_LEN, batch["old_log_probs"])

    def ref_log_probs(self, ref_model, batch):
        ref = batch.get("ref_log_prob")
        if ref is None:
            with torch.no_grad():
                ref = self.response_log_probs(ref_model, batch)
        return per_token(PROMPT_LEN, ref)

    def returns(self, batch):
        mask = batch["response_mask"].float()
        return (batch["returns"] * mask).sum(1) / mask.sum(1).clamp(min=1)

    def logits(self, model, batch):
        return model(batch["input_ids"])[:, :-1].float() / self.choices.temperature

    def log_probs(self, model, batch):
        return per_token(PROMPT_LEN, self.response_log_probs(model, batch))

    def action_mask(self, batch):
        return per_token(PROMPT_LEN, batch["response_mask"].float())

    def advantages(self, batch):
        """One per episode: the mean of verl's token-level advantages over the response (all equal for the
        outcome estimators)."""
        mask = batch["response_mask"].float()
        return (batch["advantages"] * mask).sum(1) / mask.sum(1).clamp(min=1)

    def select_rows(self, batch, rows):
        rows = torch.as_tensor(rows)
        b = batch["input_ids"].shape[0]
        out = {}
        for key, value in batch.items():
            if torch.is_tensor(value) and value.dim() >= 1 and value.shape[0] == b:
                out[key] = value[rows]
            elif isinstance(value, np.ndarray) and len(value) == b:
                out[key] = value[rows.numpy()]
            else:
                out[key] = value
        return out

    def pad_batch(self, batch, extra):
        """``extra`` more response columns: EOS (the pad) in the responses, 0 in the masks and the per-token
        tensors, as verl pads a batch to a longer response length."""
        out = dict(batch)
        for key in ROW_KEYS_2D:
            if key in batch:
                out[key] = F.pad(batch[key], (0, extra), value=EOS if key == "responses" else 0)
        out["input_ids"] = torch.cat([batch["prompts"], out["responses"]], 1)
        out["attention_mask"] = torch.cat([torch.ones_like(batch["prompts"]), out["response_mask"]], 1)
        return out

    # -- verl's loss ----------------------------------------------------------------------------------------------
    def _ppo_loss(self, model, batch, rows, config, advantages, ref_log_prob, old_log_probs=None,
                  tokens=None, sequences=None):
        """verl's actor loss (``ppo_loss``) over ``rows``, normalised as a mini-batch of ``tokens`` response
        tokens and ``sequences`` episodes (default: ``rows`` themselves) -> (loss, the rows' log-probs)."""
        from tensordict import TensorDict
        from verl.utils import tensordict_utils as tu

        sub = self.select_rows(batch, rows)
        old = (batch["old_log_probs"] if old_log_probs is None else old_log_probs)[rows]
        fields = {"prompts": sub["prompts"], "responses": sub["responses"], "attention_mask": sub["attention_mask"],
                  "response_mask": sub["response_mask"], "old_log_probs": old, "advantages": advantages[rows]}
        if config.use_kl_loss:
            fields["ref_log_prob"] = ref_log_prob[rows]
        data = TensorDict(fields, batch_size=[len(rows)])
        tu.assign_non_tensor(data, dp_size=1, global_batch_size=int(sequences or len(rows)),
                             batch_num_tokens=int(tokens if tokens is not None else sub["response_mask"].sum()))
        logp = self.response_log_probs(model, sub)
        output = {"log_probs": packed(logp, sub["attention_mask"], PROMPT_LEN)}
        if config.entropy_coeff or config.calculate_entropy:
            output["entropy"] = packed(self._response_entropy(model, sub), sub["attention_mask"], PROMPT_LEN)
        loss, _ = self._losses.ppo_loss(config, output, data)
        return loss, logp.detach()

    def _ref_log_prob(self, batch, ref_model):
        """The reference log-probs: recomputed from ``ref_model`` when given (the suite's), else the batch's."""
        if ref_model is not None:
            with torch.no_grad():
                return self.response_log_probs(ref_model, batch)
        return batch.get("ref_log_prob")

    def loss(self, model, batch, rows, ref_model=None, term="total"):
        """verl's ``ppo_loss`` over ``rows`` in one pass. ``term="entropy"``: the entropy bonus alone (zero
        advantages, no KL loss) as ppo_loss subtracts it; ``term="kl"``: the KL alone as it enters the update:
        the KL loss (``use_kl_loss``) and the KL in the reward (``use_kl_in_reward``: the advantages verl's
        estimator gives to rewards that are the KL penalty alone, the current policy as the old one)."""
        rows = torch.as_tensor(rows)
        c = self.choices
        ref = self._ref_log_prob(batch, ref_model)
        zeros = torch.zeros_like(batch["advantages"])
        if term == "total":
            return self._ppo_loss(model, batch, rows, c.actor, batch["advantages"], ref)[0]
        if term == "entropy":
            if not c.actor.entropy_coeff:
                return None
            config = dataclasses.replace(c.actor, use_kl_loss=False)
            return self._ppo_loss(model, batch, rows, config, zeros, ref)[0]
        if term != "kl":
            raise ValueError(f"unknown term {term!r}")
        if ref is None or not (c.kl_in_loss or c.kl_in_reward):
            return None
        parts = []
        if c.kl_in_loss:
            config = dataclasses.replace(c.actor, entropy_coeff=0.0)
            parts.append(self._ppo_loss(model, batch, rows, config, zeros, ref)[0])
        if c.kl_in_reward:
            parts.append(self._reward_kl_loss(model, batch, rows, ref))
        return sum(parts[1:], parts[0])

    def _reward_kl_loss(self, model, batch, rows, ref):
        """The policy loss on the advantages of rewards that are the KL penalty alone (scores 0), the current
        policy's log-probs as the old ones (ratio 1): the gradient the KL in the reward gives."""
        c = self.choices
        with torch.no_grad():
            current = self.response_log_probs(model, batch)
        kl_only = self._advantages(batch, current, ref, torch.zeros_like(batch["token_level_scores"]))
        config = dataclasses.replace(c.actor, entropy_coeff=0.0, use_kl_loss=False)
        return self._ppo_loss(model, batch, rows, config, kl_only["advantages"], ref, old_log_probs=current)[0]

    def backward(self, model, batch, rows, ref_model=None):
        """One mini-batch (``rows``) as verl's engine runs it: micro-batches, each ``ppo_loss`` normalised by
        the mini-batch's token and sequence counts, each backward; no optimizer step."""
        rows = torch.as_tensor(rows)
        self._mini_batch(model, batch, rows, self._ref_log_prob(batch, ref_model), [])

    def _mini_batch(self, model, batch, rows, ref, ratios: list) -> None:
        tokens, sequences = int(batch["response_mask"][rows].sum()), len(rows)
        for micro in rows.chunk(min(self.choices.micro_batches, len(rows))):
            loss, logp = self._ppo_loss(model, batch, micro, self.choices.actor, batch["advantages"], ref,
                                        tokens=tokens, sequences=sequences)
            loss.backward()
            mask = batch["response_mask"][micro].bool()
            if mask.any():
                ratio = torch.exp(logp - batch["old_log_probs"][micro].detach())[mask]
                ratios.append((float(ratio.max()), float(ratio.min())))

    def update(self, model, optimizer, ref_model, batch):
        """``ppo_epochs`` x mini-batches (whole groups, in order: verl's actor does not shuffle by default), one
        optimizer step each after clipping the gradient norm at ``grad_clip``."""
        c = self.choices
        ref = self._ref_log_prob(batch, ref_model)
        ratios: list = []
        rows = torch.arange(batch["input_ids"].shape[0])
        params = [p for p in model.parameters() if p.requires_grad]
        model.train()
        for _ in range(c.actor.ppo_epochs):
            for mini in rows.chunk(c.mini_batches):
                optimizer.zero_grad()
                self._mini_batch(model, batch, mini, ref, ratios)
                torch.nn.utils.clip_grad_norm_(params, c.actor.grad_clip)
                optimizer.step()
        return {"ratio_max": max(r[0] for r in ratios), "ratio_min": min(r[1] for r in ratios)}

    def run_signature(self, seed: int, steps: int) -> list:
        """``steps`` short training steps (a batch, an update) from the initial policy."""
        model = self.build_model()
        ref, optimizer = self.make_reference(model), self.make_optimizer(model)
        out = []
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)  # a run seeds torch first: some losses draw from it (clip_cov's randperm)
            for step in range(steps):
                batch = self._batch(model, seed + step, ref)
                stats = self.update(model, optimizer, ref, batch)
                out.append((float(batch["scores"].mean()), stats["ratio_max"], stats["ratio_min"]))
        return out


def verl_adapter(config: Any = None, **choices) -> VerlAdapter:
    """The preflight adapter over verl's math with your choices: ``config`` (a verl config: a dict, a
    DictConfig, or a saved composed YAML; its ``algorithm``, ``actor_rollout_ref.actor`` and ``.rollout``
    are read) and keyword arguments, which override it:

    - verl's own names: ``adv_estimator``, ``loss_mode`` (``policy_loss.loss_mode``; ``policy_loss={...}`` for
      its other fields, e.g. ``dro_beta``), ``loss_agg_mode``, ``clip_ratio``, ``clip_ratio_low``,
      ``clip_ratio_high``, ``clip_ratio_c``, ``entropy_coeff``, ``use_kl_loss``, ``kl_loss_coef``,
      ``kl_loss_type``, ``use_kl_in_reward``, ``kl_penalty``, ``kl_coef`` (``kl_ctrl.kl_coef``),
      ``norm_adv_by_std_in_grpo``, ``gamma``, ``lam``, ``ppo_epochs``, ``rollout_n``, ``temperature``, ...;
    - the preflight's sizes: ``prompts`` (4), ``mini_batches`` (2), ``micro_batches`` (2), ``response_length``
      (6), ``lr`` (1e-2), ``seed`` (0);
    - your replacements of verl's functions: ``apply_kl_penalty(data, kl_ctrl, kl_penalty) -> (data, metrics)``
      (as ``verl.trainer.ppo.ray_trainer.apply_kl_penalty``), ``old_log_prob_fn(model, batch) -> [B, R]`` (the
      old-policy scoring; default: a forward without autograd, as verl's ``compute_log_prob``);
      ``group_relative``: as ``install()``'s.

    Register your own policy losses and estimators (``register_policy_loss``, ``register_adv_est``) before.
    """
    merged = {**choices_from_config(config), **choices}
    return VerlAdapter(build_choices(merged))
