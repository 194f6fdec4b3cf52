"""TRL's logged metrics under ``rlguard.diagnose``'s names, and which of TRL's log rows are training steps.

TRL 1.16's ``GRPOTrainer`` and ``RLOOTrainer`` collect their metrics in ``self._metrics[mode]`` and average them
over each logging interval in ``log()``; transformers' ``Trainer.log`` adds ``loss``, ``grad_norm``,
``learning_rate`` and ``epoch``, appends ``{**logs, "step": global_step}`` to ``trainer.state.log_history`` (saved
in every checkpoint's ``trainer_state.json``) and hands ``logs`` to each callback's ``on_log``. Evaluation rows
carry the same names prefixed ``eval_``; the end-of-training summary has ``train_runtime``, ``train_loss``,
``total_flos``. A metric that is NaN at every step of an interval is logged as ``None`` (JSON ``null``).

Only standard-library code here: ``rlguard diagnose`` reads TRL's logs without torch or TRL installed.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# TRL's logged name -> rlguard.diagnose's name (rlguard.diagnose.metrics.METRICS), only where both mean the same
# thing; every other numeric key is kept under TRL's name (TRL_KEPT says why the notable ones are not mapped).
TRL_METRICS: dict[str, str] = {
    # mean reward of the interval's completions: the weighted sum of the reward functions
    "reward": "reward",
    # mean per-token entropy over the completion mask
    "entropy": "entropy",
    # mean per-token KL to the reference model (GRPO: k3 estimator, RLOO: k1); logged only when beta != 0
    "kl": "kl_ref",
    # fraction of completion tokens where the clip binds (ratio below 1 - eps with A < 0 or above 1 + eps with
    # A > 0); 0 while the ratio is 1, like rlguard's clip_frac
    "clip_ratio/region_mean": "clip_frac",
    # transformers: the gradient norm before clipping (of the interval's last optimizer step)
    "grad_norm": "grad_norm",
    # tokens per completion (with tools, the model's tokens only)
    "completions/mean_length": "length",
    # fraction of completions whose group's rewards all agree (scale_rewards="group", RLOO): groups with no signal
    "frac_reward_zero_std": "zero_adv_frac",
    # vLLM with importance-sampling correction: mean |trainer log-prob - vLLM's log-prob| on the completion mask
    "sampling/sampling_logp_difference/mean": "logp_gap",
}

# TRL's names kept as they are, and why none of rlguard's names fits.
TRL_KEPT: dict[str, str] = {
    "loss": "transformers' mean training loss over the interval (rlguard has no loss metric)",
    "learning_rate": "the scheduler's learning rate",
    "reward_std": "std of the rewards over the whole batch, not per group",
    "rewards/<func>/mean": "one reward function's mean (reward is their weighted sum)",
    "rewards/<func>/std": "one reward function's std",
    "clip_ratio/low_mean": "the low side of clip_ratio/region_mean alone",
    "clip_ratio/high_mean": "the high side of clip_ratio/region_mean alone",
    "clip_ratio/low_min, clip_ratio/high_max": "extremes over sequences of the per-sequence clip fractions",
    "completions/clipped_ratio": "fraction of completions truncated at max_completion_length (not the PPO clip)",
    "completions/min_length, completions/max_length": "completion length extremes",
    "completions/*_terminated_length": "lengths of the completions that ended with EOS",
    "sampling/sampling_logp_difference/max": "the largest trainer/vLLM log-prob gap",
    "sampling/importance_sampling_ratio/*": "vLLM's importance weight pi_old / pi_vllm, not the PPO ratio pi / pi_old",
    "cispo_clip_ratio": "CISPO's one-sided clip of the importance weight (loss_type='cispo')",
    "policy_loss, entropy_coef, aux_loss, num_tokens, step_time, epoch": "bookkeeping",
}

# rlguard metric -> why TRL's logs lack it: the report's reason for each rule that is off on a TRL log.
TRL_NOT_LOGGED: dict[str, str] = {
    "approx_kl": "TRL does not log KL(old || new); its `kl` is the KL to the reference, read as kl_ref",
    "ratio_max": "TRL does not log the PPO ratio; RlguardCallback's log adds it",
    "ratio_min": "TRL does not log the PPO ratio; RlguardCallback's log adds it",
    "clip_frac": "TRL logs clip_ratio/region_mean only for loss_type grpo, bnpo, dr_grpo, dapo, luspo",
    "kl_ref": "TRL logs `kl` only when beta != 0: no KL term, nothing to check",
    "logp_gap": "TRL logs sampling/sampling_logp_difference/mean only with vLLM and its importance-sampling "
                "correction",
    "eval_pass": "TRL logs no held-out pass rate; its eval_reward is the training reward on the eval prompts",
    "length_pass": "TRL does not split completion lengths by passing and failing",
    "length_fail": "TRL does not split completion lengths by passing and failing",
    "malformed": "a task-specific extra that TRL does not log",
    "hardcode": "a task-specific extra that TRL does not log",
    "kl_coef": "TRL's beta is not in its log; pass --kl-coef",
}

# Names only TRL logs: a JSON-lines log with one of them in a row is read as TRL's on_log dicts.
TRL_ONLY_NAMES = frozenset(name for name, ours in TRL_METRICS.items() if name != ours) | {
    "reward_std", "completions/clipped_ratio", "clip_ratio/low_mean", "clip_ratio/high_mean"}

# Keys of a log row that are not metrics of a step: they do not make a row a training row.
BOOKKEEPING = frozenset({"step", "epoch"})


def is_trl_row(row: Mapping[str, Any]) -> bool:
    """Whether a log row carries one of the names only TRL logs (``kl``, ``frac_reward_zero_std``, ...)."""
    return any(key in TRL_ONLY_NAMES for key in row)


def is_summary(row: Mapping[str, Any]) -> bool:
    """transformers' end-of-training summary row (``train_loss``, ``total_flos``, ``train_runtime``, ...)."""
    return "train_loss" in row or "total_flos" in row


def is_eval(row: Mapping[str, Any]) -> bool:
    """An evaluation row: every metric in it has the ``eval_`` prefix TRL and transformers give evaluation."""
    metrics = [key for key in row if key not in BOOKKEEPING]
    return bool(metrics) and all(key.startswith("eval_") for key in metrics)


def is_training_row(row: Mapping[str, Any]) -> bool:
    """A row of training metrics: neither an evaluation row nor the end-of-training summary."""
    return not is_summary(row) and not is_eval(row) and any(key not in BOOKKEEPING for key in row)


def rlguard_names(row: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """A TRL row under rlguard's names -> (the row, {rlguard name: TRL name} for each renamed key).

    ``train_*`` keys (transformers' speed metrics, logged with ``include_num_input_tokens_seen``) are dropped. A
    key already under rlguard's name keeps its value; the TRL key it would overwrite then stays as it is.
    """
    out: dict[str, Any] = {}
    renamed: dict[str, str] = {}
    for key, value in row.items():
        if key.startswith("train_"):
            continue
        ours = TRL_METRICS.get(key, key)
        if ours != key and (ours in row or ours in out):
            ours = key
        out[ours] = value
        if ours != key:
            renamed[ours] = key
    return out, renamed
