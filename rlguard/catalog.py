"""The failure-mode catalog: one code per fault, shared by the linter, the contracts, preflight and the docs.

A user who sees ``RLG004`` anywhere lands on ``docs/rules/RLG004.md``. Codes are fixed: new ones are added
after the last, never reused or renumbered. This module must stay importable without torch.
"""

from __future__ import annotations

from dataclasses import dataclass

DOCS_BASE_URL = "https://github.com/rlguard/rlguard/blob/main/docs/rules/"


@dataclass(frozen=True)
class Code:
    code: str
    name: str
    summary: str
    static: str  # "yes", "where visible", "info" or "no": whether `rlguard lint` can see it
    runtime: str  # what the contracts / preflight check at run time

    @property
    def help_uri(self) -> str:
        return f"{DOCS_BASE_URL}{self.code}.md"


_CODES = [
    Code("RLG000", "tensor-contract",
         "A tensor's shape or dtype does not match its contract and no more specific code applies.",
         "no", "jaxtyping-style spec check naming the argument, the expected dims and their bindings"),
    Code("RLG001", "mask-not-shifted",
         "Action/loss mask aligned to `ids` instead of `ids[:, 1:]`: each policy span moves one token. "
         "Value predictions pair with the next token like log-probs (slot t: the state before ids[:, t+1]).",
         "yes", "mask equals policy ownership of ids[:, 1:]; loss invariant to right padding; shape [B, T] vs [B, T-1]"),
    Code("RLG002", "old-logp-recomputed",
         "Old (behaviour) log-probs recomputed from the current weights inside the update loop: ratio is 1.",
         "yes", "old_logp fingerprint unchanged across the minibatches of one update; ratio != 1 after the first step"),
    Code("RLG003", "detached-targets",
         "Old/reference log-probs, advantages or returns computed with autograd on.",
         "yes", "requires_grad False and grad_fn None on those tensors"),
    Code("RLG004", "entropy-bonus-sign",
         "Entropy bonus added to a minimised loss: an entropy penalty.",
         "yes", "a step on the entropy term alone raises entropy"),
    Code("RLG005", "advantage-sign",
         "Advantages negated, surrogate not negated, or PPO clip with min/max of the wrong sign.",
         "yes", "after one step, change of log pi(episode) correlates positively with the advantage"),
    Code("RLG006", "accumulation-scale",
         "Gradient accumulation averages per-microbatch token means instead of one token mean.",
         "yes", "accumulated gradient equals the one-pass gradient (relative error < 1e-4)"),
    Code("RLG007", "sampler-trainer-mismatch",
         "Old log-probs come from a sampler whose distribution differs from the trainer's.",
         "where visible", "trainer log-prob equals sampler log-prob on sampled tokens; ratio = 1 before any step"),
    Code("RLG008", "reference-alias",
         "The KL reference is the live policy (alias, shallow copy, shared storage, in the optimizer).",
         "yes", "distinct object, no shared storage, not in any optimizer, unchanged by optimizer.step()"),
    Code("RLG009", "group-baseline",
         "Group advantages not centred per group (whole-batch mean, wrong axis, wrong group size).",
         "where visible", "each group's advantage mean is 0"),
    Code("RLG010", "length-bias",
         "Loss is a mean over sequences of per-sequence token means: long episodes weigh less per token.",
         "info", "per-token gradient weight independent of episode length"),
    Code("RLG011", "kl-sign",
         "KL penalty subtracted from a minimised loss, or added to the reward with the wrong sign.",
         "yes", "a step on the KL term alone lowers KL to the reference"),
    Code("RLG012", "logits-label-shift",
         "Log-probs gathered from logits[:, t] against ids[:, t] (no shift), or both shifted the same way.",
         "yes", "trainer/sampler log-prob gap; shapes"),
    Code("RLG013", "grad-not-zeroed",
         "optimizer.step() in a loop with no zero_grad between steps: gradients leak across updates.",
         "yes", "gradients are zero/None before each update's first backward"),
    Code("RLG014", "trained-params-drift",
         "Weights outside the intended trainable set change in an update.",
         "no", "after one step only the intended parameters changed; the rest bit-identical"),
    Code("RLG015", "reload-mismatch",
         "A saved checkpoint does not reproduce the policy.",
         "no", "save, reload, same outputs for the same inputs"),
    Code("RLG016", "padding-leak",
         "Per-token log-probs depend on how much padding a row carries or on its batch neighbours.",
         "where visible", "a row's log-probs unchanged by extra padding and by the other rows of its batch"),
    Code("RLG017", "stop-token-untrained",
         "The stop token falls out of the loss mask (pad = eos and mask = ids != pad_id): the model never "
         "learns to stop.",
         "where visible", "each completion's first stop token (any configured stop id) is inside the loss mask"),
    Code("RLG018", "train-mode-scoring",
         "Old-policy, reference or value forwards run in train mode with dropout on: noisy old log-probs, "
         "a ratio that is not 1 before the first step, a reference whose KL to itself is not 0.",
         "where visible", "scoring forwards under no_grad have every dropout module inactive; two scoring passes agree"),
    Code("RLG019", "rows-out-of-step",
         "Rows filtered, sorted or permuted in some fields of a batch and not in the others that describe the "
         "same episodes.",
         "where visible", "the fields of one batch keep one row identity; the loss is invariant to a consistent "
         "permutation of rows"),
    # Codes from RLG900 are rlguard's own, not failure modes of a trainer.
    Code("RLG900", "syntax-error",
         "The file could not be read or parsed, so no rule ran on it.",
         "yes", "-"),
    Code("RLG901", "unused-noqa",
         "A `# noqa` comment names an rlguard code that reports nothing on its line.",
         "yes", "-"),
    Code("RLG902", "internal-error",
         "rlguard failed on this file: the findings of the named rule (or of every rule) are missing.",
         "yes", "-"),
]

# One constant per failure mode, named after it: code refers to the codes through these, never by literal.
TENSOR_CONTRACT = "RLG000"
MASK_NOT_SHIFTED = "RLG001"
OLD_LOGP_RECOMPUTED = "RLG002"
DETACHED_TARGETS = "RLG003"
ENTROPY_BONUS_SIGN = "RLG004"
ADVANTAGE_SIGN = "RLG005"
ACCUMULATION_SCALE = "RLG006"
SAMPLER_TRAINER_MISMATCH = "RLG007"
REFERENCE_ALIAS = "RLG008"
GROUP_BASELINE = "RLG009"
LENGTH_BIAS = "RLG010"
KL_SIGN = "RLG011"
LOGITS_LABEL_SHIFT = "RLG012"
GRAD_NOT_ZEROED = "RLG013"
TRAINED_PARAMS_DRIFT = "RLG014"
RELOAD_MISMATCH = "RLG015"
PADDING_LEAK = "RLG016"
STOP_TOKEN_UNTRAINED = "RLG017"
TRAIN_MODE_SCORING = "RLG018"
ROWS_OUT_OF_STEP = "RLG019"

# rlguard's own codes, reported by the linter about its own work rather than about a trainer.
PARSE_ERROR = "RLG900"
UNUSED_NOQA = "RLG901"  # off unless selected by name, a prefix or ALL: stale noqa comments are not bugs
INTERNAL_ERROR = "RLG902"  # always reported: it means a file was not fully checked
TOOL_CODES = (PARSE_ERROR, UNUSED_NOQA, INTERNAL_ERROR)

CODES: dict[str, Code] = {c.code: c for c in _CODES}
BY_NAME: dict[str, Code] = {c.name: c for c in _CODES}


def lookup(code_or_name: str) -> Code:
    """A code by its code (``RLG004``, case-insensitive) or its name (``entropy-bonus-sign``)."""
    key = code_or_name.strip()
    found = CODES.get(key.upper()) or BY_NAME.get(key.lower())
    if found is None:
        raise KeyError(f"unknown rlguard code {code_or_name!r}; known: {', '.join(CODES)}")
    return found
