"""The names RL code gives its tensors and objects, by role.

These names are *hints*: the analysis core (:mod:`rlguard.lint.analysis`) decides a value's role from how it is
computed and used, and a name only corroborates that, or stands in for a value whose computation is out of view
(a batch field, a parameter). Each role is a set of exact names in the
spellings of open RL code (TRL, OpenRLHF, verl, trlx) plus a pattern for the obvious variants; users extend
the exact names through ``[tool.rlguard.names]`` in ``pyproject.toml``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

_LOGP = r"(log_?probs?|logps?|lps?|logprobs?|log_?pi|log_?likelihoods?)"

# role -> (exact names, pattern over the whole lower-cased name)
DEFAULT_ROLES: dict[str, tuple[tuple[str, ...], str]] = {
    "old_logp": (
        ("old_log_probs", "old_logprobs", "old_logp", "old_logps", "old_log_prob", "behavior_logp",
         "behaviour_logp", "behavior_log_probs", "behaviour_log_probs", "old_per_token_logps",
         "sampling_logp", "sample_logp", "sampler_logp", "rollout_logp", "rollout_log_probs", "mu_logp"),
        rf"(old|behaviou?r|behav|rollout|sampler?|sampling|mu)_?(per_token_)?{_LOGP}",
    ),
    "ref_logp": (
        ("ref_log_probs", "ref_logprobs", "ref_logp", "ref_logps", "ref_per_token_logps", "reference_logp",
         "reference_log_probs", "base_logp", "base_log_probs", "init_logp", "init_log_probs"),
        rf"(ref|reference|base|init|sft)_?(per_token_|action_)?{_LOGP}|{_LOGP}_(ref|reference|base|init|sft)",
    ),
    "logp": (
        ("log_probs", "logprobs", "logp", "logps", "per_token_logps", "new_log_probs", "new_logp",
         "curr_logp", "current_logp", "action_log_probs", "token_logp", "token_log_probs", "lp"),
        rf"(new_|cur_|curr_|current_|action_|token_|policy_|pi_)?(per_token_)?{_LOGP}",
    ),
    "ref_model": (
        ("ref_model", "reference_model", "ref_policy", "reference_policy", "ref", "reference", "ref_net",
         "model_ref", "ref_module", "initial_model", "init_model", "base_model_ref", "frozen_model"),
        r"(ref|reference|frozen|initial|init)_?(model|policy|net|module|actor|lm)?|(model|policy|actor)_?ref",
    ),
    "policy": (
        ("model", "policy", "actor", "policy_model", "actor_model", "lm", "net", "module", "agent", "pi"),
        r"(policy|actor)(_model|_net|_module)?|model",
    ),
    "mask": (
        ("action_mask", "response_mask", "loss_mask", "completion_mask", "attention_mask", "mask",
         "policy_mask", "token_mask", "resp_mask", "labels_mask", "eos_mask", "valid_mask", "gen_mask"),
        r"\w*_?mask(s)?",
    ),
    "advantages": (
        ("advantages", "adv", "advs", "advantage", "norm_adv", "normalized_advantages", "gae", "A"),
        r"(norm(alized)?_|scaled_|group_|token_|seq_)?(advantages?|advs?)",
    ),
    "returns": (("returns", "ret", "rets", "value_targets", "targets"), r"(disc_|discounted_)?returns?"),
    "rewards": (("rewards", "reward", "scores", "rew", "rews", "r"), r"(seq_|token_|group_)?(rewards?|scores?)"),
    "entropy": (
        ("entropy", "entropies", "ent", "entropy_bonus", "policy_entropy", "token_entropy", "mean_entropy"),
        # cross-entropy is a loss against labels, not the policy's entropy
        r"(?!(\w*_)?cross_?entropy)\w*entrop(y|ies|ys)\w*|ent",
    ),
    "entropy_coef": (
        ("ent_coef", "entropy_coef", "entropy_coeff", "ent_coeff", "entropy_weight", "ent_weight",
         "entropy_beta", "c2", "ENTROPY_COEF"),
        r"(ent|entropy)_?(coef|coeff|weight|beta|scale|bonus_coef)",
    ),
    "kl": (("kl", "kl_div", "kl_loss", "kl_penalty", "approx_kl", "kl_ref", "kld", "kl_term"), r"\w*kl\w*"),
    "kl_coef": (
        ("kl_coef", "kl_coeff", "beta", "kl_beta", "kl_weight", "init_kl_coef", "kl_ctl", "KL_COEF"),
        r"(kl_?)(coef|coeff|beta|weight|ctl|ctrl|controller|scale)|beta",
    ),
    "optimizer": (
        ("optimizer", "optim", "opt", "optimiser", "actor_optimizer", "policy_optimizer"),
        r"\w*optim(izer|iser)?s?",
    ),
    "logits": (("logits", "policy_logits", "lm_logits", "all_logits"), r"\w*logits"),
    "ids": (
        ("ids", "input_ids", "tokens", "token_ids", "sequences", "seq", "labels", "target_ids", "query_responses"),
        r"(input_|token_|target_)?(ids|tokens)|sequences?|labels",
    ),
}


@dataclass
class Vocabulary:
    """Which names play which role. ``extra`` comes from ``[tool.rlguard.names]``."""

    extra: dict[str, tuple[str, ...]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._exact: dict[str, frozenset[str]] = {}
        self._pattern: dict[str, re.Pattern] = {}
        for role, (names, pattern) in DEFAULT_ROLES.items():
            self._exact[role] = frozenset(names) | frozenset(self.extra.get(role, ()))
            self._pattern[role] = re.compile(pattern, re.IGNORECASE)
        self._cache: dict[tuple[str, str], bool] = {}

    def is_role(self, name: str | None, role: str) -> bool:
        """Whether ``name`` (a bare name, ``self.x`` or a dict key) plays ``role``."""
        if not name:
            return False
        key = (name, role)
        hit = self._cache.get(key)
        if hit is None:
            bare = name.rsplit(".", 1)[-1]
            hit = bare in self._exact[role] or self._pattern[role].fullmatch(bare) is not None
            self._cache[key] = hit
        return hit

    def roles(self, name: str | None) -> set[str]:
        return {role for role in self._exact if self.is_role(name, role)}

    def words(self) -> set[str]:
        """Every exact name (the engine's pre-scan uses these to skip files no rule can fire on)."""
        return set().union(*self._exact.values())


ROLES = tuple(DEFAULT_ROLES)
