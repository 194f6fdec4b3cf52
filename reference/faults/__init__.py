"""Faults of the reference trainer, one module each: the faulty twin of the one pipeline part it changes.

``FAULTS[name]`` -> :class:`Fault` (catalog code, description, the part it swaps, the faulty function, the
module's source path for the linter, and the preflight check expected to catch it). The first seven are the
debugging chapter's injected bugs; the rest cover RLG009, RLG011, RLG012, RLG013, RLG014 and RLG016-RLG019.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import import_module
from pathlib import Path
from typing import Callable
from rlguard.catalog import (
    ACCUMULATION_SCALE, ADVANTAGE_SIGN, ENTROPY_BONUS_SIGN, GRAD_NOT_ZEROED, GROUP_BASELINE, KL_SIGN,
    LOGITS_LABEL_SHIFT, MASK_NOT_SHIFTED, OLD_LOGP_RECOMPUTED, PADDING_LEAK, REFERENCE_ALIAS, ROWS_OUT_OF_STEP,
    SAMPLER_TRAINER_MISMATCH, STOP_TOKEN_UNTRAINED, TRAIN_MODE_SCORING, TRAINED_PARAMS_DRIFT,
)

HERE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Fault:
    name: str
    code: str
    description: str
    part: str  # the field of rlguard.reference.pipeline.Parts it replaces
    expected_check: str  # the preflight check that must fail on it
    statically_visible: bool = True  # the linter is expected to report `code` on its source

    @property
    def module(self):
        return import_module(f"{__name__}.{self.name}")

    @property
    def function(self) -> Callable:
        return getattr(self.module, self.part)

    @property
    def path(self) -> Path:
        return HERE / f"{self.name}.py"


_FAULTS = [
    Fault("mask_shift", MASK_NOT_SHIFTED, "action mask aligned to ids instead of ids[:, 1:]: each policy span moves one token right",
          "build_action_mask", "mask_policy"),
    Fault("stale_old_logp", OLD_LOGP_RECOMPUTED, "old log-probs recomputed from the current weights before every minibatch",
          "update", "old_logp_frozen"),
    Fault("entropy_sign", ENTROPY_BONUS_SIGN, "entropy bonus added to the minimised loss: an entropy penalty",
          "compute_loss", "entropy_direction"),
    Fault("sign_flip", ADVANTAGE_SIGN, "advantages negated", "group_advantages", "advantage_direction"),
    Fault("accum_local", ACCUMULATION_SCALE, "length-sorted microbatches, each its own token mean / n_micro",
          "minibatch_backward", "accumulation"),
    Fault("sampler_temp", SAMPLER_TRAINER_MISMATCH, "sampler at temperature 0.7, trainer at cfg.temperature; sampler log-probs used as old",
          "rollout", "sampler_logp"),
    Fault("ref_is_policy", REFERENCE_ALIAS, "the KL reference is the live policy object", "make_reference", "kl_positive"),
    Fault("group_mean_batch", GROUP_BASELINE, "advantages centred on the whole batch's mean instead of each group's",
          "group_advantages", "group_mean"),
    Fault("kl_sign", KL_SIGN, "KL penalty subtracted from the minimised loss", "compute_loss", "kl_direction"),
    Fault("label_shift", LOGITS_LABEL_SHIFT, "logits[:, :-1] gathered at ids[:, :-1]: logits[:, t] scored against ids[:, t]",
          "token_log_probs", "labels_shifted"),
    Fault("no_zero_grad", GRAD_NOT_ZEROED, "optimizer.step() in the loop with no zero_grad", "update", "grads_zeroed"),
    Fault("trains_frozen", TRAINED_PARAMS_DRIFT, "the frozen position embedding is unfrozen and put in the optimizer",
          "make_optimizer", "frozen_params", statically_visible=False),
    Fault("pack_no_mask", PADDING_LEAK, "rows packed into one sequence for the forward, the mask that keeps them apart "
          "built but not passed", "forward", "padding_leak"),
    Fault("pad_is_eos", STOP_TOKEN_UNTRAINED, "pad token = EOS token and the loss mask drops pad ids: the EOS too",
          "build_action_mask", "stop_token_trained"),
    Fault("ref_train_mode", TRAIN_MODE_SCORING, "the reference rebuilt from the config and left in train mode "
          "(dropout on)", "make_reference", "scoring_eval_mode"),
    Fault("rows_out_of_step", ROWS_OUT_OF_STEP, "microbatches length-sorted, advantages taken in the unsorted order",
          "minibatch_backward", "rows_in_step"),
]

FAULTS: dict[str, Fault] = {f.name: f for f in _FAULTS}
