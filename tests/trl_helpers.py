"""A tiny real ``trl.GRPOTrainer`` for the TRL tests, built in code (nothing downloaded), and the seeded faults.

The policy is a 2-layer Llama of hidden size 32 over a 32-word vocabulary with a word-level tokenizer; it is
saved with ``save_pretrained`` to a temporary folder because TRL builds its reference model from the policy's
path. The reward pays completions that use the words ``w3``..``w9`` and stop early, so rewards vary within
every group of samples.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from dataclasses import dataclass

import torch

WORDS = ["<pad>", "<eos>", "<bos>", "<unk>"] + [f"w{i}" for i in range(28)]
GOOD = {f"w{i}" for i in range(3, 10)}
MODEL_SIZE = {"hidden_size": 32, "num_hidden_layers": 2}  # the benchmark sizes it up
_MODEL_DIRS: dict[tuple, str] = {}
_SCRATCH: list[str] = []  # this process's folder for the model and the trainers' output_dir, removed at exit


def scratch(prefix: str) -> str:
    if not _SCRATCH:
        _SCRATCH.append(tempfile.mkdtemp(prefix="rlguard-trl-"))
        atexit.register(shutil.rmtree, _SCRATCH[0], True)
    return tempfile.mkdtemp(prefix=prefix, dir=_SCRATCH[0])


def tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>",
                                   unk_token="<unk>")


def model_dir(seed: int = 0) -> str:
    """A folder with the tiny policy and its tokenizer (made once per process, seed and size)."""
    key = (seed, MODEL_SIZE["hidden_size"], MODEL_SIZE["num_hidden_layers"])
    if key not in _MODEL_DIRS:
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(seed)
        hidden = MODEL_SIZE["hidden_size"]
        config = LlamaConfig(vocab_size=len(WORDS), hidden_size=hidden, intermediate_size=2 * hidden,
                             num_hidden_layers=MODEL_SIZE["num_hidden_layers"], num_attention_heads=4,
                             num_key_value_heads=4, max_position_embeddings=64, pad_token_id=0, eos_token_id=1,
                             bos_token_id=2, tie_word_embeddings=False)
        path = scratch("model-")
        LlamaForCausalLM(config).save_pretrained(path)
        tokenizer().save_pretrained(path)
        _MODEL_DIRS[key] = path
    return _MODEL_DIRS[key]


def reward_good_words(completions, **kwargs):
    """Fraction of good words, minus a little per word: rewards differ within each group."""
    out = []
    for text in completions:
        words = text.split()
        out.append(sum(w in GOOD for w in words) / (1 + len(words)) - 0.01 * len(words))
    return out


def dataset(n: int = 16):
    from datasets import Dataset

    return Dataset.from_dict({"prompt": [f"w{i} w{i + 1} w{i + 2}" for i in range(4, 4 + n)]})


# One generation of 8 episodes (2 prompts x G=4) in 2 micro-batches of 4 accumulated into one optimizer step.
CONFIG = dict(per_device_train_batch_size=4, gradient_accumulation_steps=2, num_generations=4,
              max_completion_length=6, max_steps=2, learning_rate=1e-2, report_to="none", logging_steps=1,
              save_strategy="no", use_cpu=True, seed=0, beta=0.0, disable_tqdm=True)


def make_trainer(cls=None, callbacks=None, output_dir=None, reward_funcs=None, **overrides):
    """A ``GRPOTrainer`` (or subclass ``cls``) on the tiny model; ``overrides`` are ``GRPOConfig`` fields."""
    from trl import GRPOConfig, GRPOTrainer

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    output_dir = output_dir or scratch("out-")
    from transformers.trainer_callback import PrinterCallback

    args = GRPOConfig(output_dir=output_dir, **{**CONFIG, **overrides})
    trainer = (cls or GRPOTrainer)(model=model_dir(), reward_funcs=reward_funcs or reward_good_words, args=args,
                                   train_dataset=dataset(), processing_class=tokenizer(), callbacks=callbacks)
    trainer.remove_callback(PrinterCallback)  # the tests read trainer.state.log_history instead
    return trainer


def make_rloo_trainer(cls=None, callbacks=None, output_dir=None, reward_funcs=None, **overrides):
    """An ``RLOOTrainer`` (or subclass ``cls``) on the tiny model, with the GRPO tests' batch layout."""
    from transformers.trainer_callback import PrinterCallback
    from trl import RLOOConfig, RLOOTrainer

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    output_dir = output_dir or scratch("out-")
    args = RLOOConfig(output_dir=output_dir, **{**CONFIG, **overrides})
    trainer = (cls or RLOOTrainer)(model=model_dir(), reward_funcs=reward_funcs or reward_good_words, args=args,
                                   train_dataset=dataset(), processing_class=tokenizer(), callbacks=callbacks)
    trainer.remove_callback(PrinterCallback)
    return trainer


# -------------------------------------------------------------------------------- seeded faults (small subclasses)


def fault_classes(base=None):
    """name -> ``Fault``: a small subclass of ``base`` (GRPOTrainer by default, or RLOOTrainer) or a configuration
    that seeds one catalog fault, written as a user of that trainer would."""
    from trl import GRPOTrainer, RLOOTrainer

    from rlguard.catalog import BY_NAME

    base = base or GRPOTrainer
    rloo = issubclass(base, RLOOTrainer)
    GRPOTrainer = base  # noqa: N806 - the classes below subclass the trainer under test

    class ShiftedCompletionMask(GRPOTrainer):
        """RLG001: the completion mask moved one token right (a pad on the wrong side)."""

        def _generate_and_score_completions(self, inputs):
            out = super()._generate_and_score_completions(inputs)
            out["completion_mask"] = torch.nn.functional.pad(out["completion_mask"], (1, 0))[:, :-1]
            return out

    class NegatedAdvantages(GRPOTrainer):
        """RLG005: advantages with the wrong sign."""

        def _generate_and_score_completions(self, inputs):
            out = super()._generate_and_score_completions(inputs)
            out["advantages"] = -out["advantages"]
            return out

    class ReferenceIsPolicy(GRPOTrainer):
        """RLG008: the KL reference is the live policy."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.ref_model = self.model  # noqa: RLG008 - the ref_is_policy fault, seeded on purpose

    class WholeBatchBaseline(GRPOTrainer):
        """RLG009: advantages centred on the whole batch's mean reward instead of each group's."""

        def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
            self._rewards = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
            return self._rewards

        def _generate_and_score_completions(self, inputs):
            out = super()._generate_and_score_completions(inputs)
            rewards = (self._rewards * self.reward_weights.unsqueeze(0)).nansum(dim=1)
            out["advantages"] = (rewards - rewards.mean()) / (rewards.std() + 1e-4)
            return out

    class SamplerTemperature(GRPOTrainer):
        """RLG007: generation samples at 0.7 while the loss scores at the configured temperature."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.generation_config.temperature = 0.7

    class OldLogpsRecomputed(GRPOTrainer):
        """RLG002: with num_iterations > 1, old log-probs recomputed from the current weights every micro-step."""

        def _prepare_inputs(self, generation_batch):
            inputs = super()._prepare_inputs(generation_batch)
            if self.model.training:
                ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
                mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
                with torch.no_grad():
                    logps, _, _ = self._get_per_token_logps_and_entropies(
                        self.model, ids, mask, inputs["completion_ids"].shape[1])
                if "old_logps" in inputs:  # RLOO keeps the sequence sums
                    inputs = {**inputs, "old_logps": (logps * inputs["completion_mask"]).sum(1)}
                else:
                    inputs = {**inputs, "old_per_token_logps": logps}
            return inputs

    class OldLogpsWithAutograd(GRPOTrainer):
        """RLG003: old log-probs recomputed after generation outside ``torch.no_grad()``: they carry the graph."""

        def _generate_and_score_completions(self, inputs):
            out = super()._generate_and_score_completions(inputs)
            ids = torch.cat([out["prompt_ids"], out["completion_ids"]], dim=1)
            mask = torch.cat([out["prompt_mask"], out["completion_mask"]], dim=1)
            logps, _, _ = self._get_per_token_logps_and_entropies(self.model, ids, mask, out["completion_ids"].shape[1])
            if "old_logps" in out:
                out["old_logps"] = (logps * out["completion_mask"]).sum(1)
            else:
                out["old_per_token_logps"] = logps
            return out

    class PadIsEos(GRPOTrainer):
        """RLG017: the pad token set to the EOS token, and a completion mask rebuilt as ids != pad_token_id."""

        def _generate_and_score_completions(self, inputs):
            out = super()._generate_and_score_completions(inputs)
            pad_id = self._tokenizer.eos_token_id  # tokenizer.pad_token = tokenizer.eos_token
            ids = out["completion_ids"]
            ids = torch.where(out["completion_mask"].bool(), ids, torch.full_like(ids, pad_id))
            out["completion_ids"], out["completion_mask"] = ids, (ids != pad_id).int()
            return out

    class AttentionDropout(GRPOTrainer):
        """RLG018: a model whose config has attention dropout (Llama applies it functionally while training, so
        ``disable_dropout``, which zeroes nn.Dropout modules, leaves it on): TRL scores the old log-probs in the
        trainer's train mode."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            for module in self.model.modules():
                if isinstance(getattr(module, "attention_dropout", None), float):
                    module.attention_dropout = 0.5

    class NoAttentionMask(GRPOTrainer):
        """RLG016: the log-prob forward without the attention mask (left-padded prompts attended as tokens)."""

        def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, *args, **kwargs):
            return super()._get_per_token_logps_and_entropies(model, input_ids, torch.ones_like(attention_mask),
                                                              *args, **kwargs)

    class LocalTokenMean(GRPOTrainer):
        """RLG006: the loss normalised by each micro-batch's own token count (the generation batch's count
        replaced by the local one), so accumulated micro-batches weigh their tokens unequally."""

        def _compute_loss(self, model, inputs):
            return super()._compute_loss(model, {**inputs, "num_items_in_batch": inputs["completion_mask"].sum()})

    class RowsSortedForTheLoss(GRPOTrainer):
        """RLG019: the loss's rows sorted by completion length, the advantages left in the batch's order."""

        def _compute_loss(self, model, inputs):
            n = inputs["completion_mask"].shape[0]
            order = inputs["completion_mask"].sum(-1).argsort(stable=True)
            inputs = {k: v[order] if torch.is_tensor(v) and v.dim() >= 1 and v.shape[0] == n and k != "advantages"
                      else v for k, v in inputs.items()}
            return super()._compute_loss(model, inputs)

    faults = {
        "old_logp_attached": Fault(OldLogpsWithAutograd, {}, "targets_detached", BY_NAME["detached-targets"].code),
        "pad_is_eos": Fault(PadIsEos, {}, "stop_token_trained", BY_NAME["stop-token-untrained"].code),
        "attention_dropout": Fault(AttentionDropout, {"num_iterations": 2, "disable_dropout": True},
                                   "scoring_eval_mode", BY_NAME["train-mode-scoring"].code),
        "no_attention_mask": Fault(NoAttentionMask, {}, "padding_leak", BY_NAME["padding-leak"].code),
        "rows_sorted_for_loss": Fault(RowsSortedForTheLoss, {}, "rows_in_step", BY_NAME["rows-out-of-step"].code),
        "mask_shift": Fault(ShiftedCompletionMask, {}, "mask_policy", BY_NAME["mask-not-shifted"].code),
        "sign_flip": Fault(NegatedAdvantages, {}, "advantage_direction", BY_NAME["advantage-sign"].code),
        "ref_is_policy": Fault(ReferenceIsPolicy, {"beta": 0.1}, "kl_positive", BY_NAME["reference-alias"].code),
        "group_mean_batch": Fault(WholeBatchBaseline, {}, "group_mean", BY_NAME["group-baseline"].code),
        # "dapo" (the default) divides by the generation batch's token count; TRL's own "bnpo" is a per-micro-batch
        # token mean by design, which the preflight reports as a warning naming the setting, not as this fault
        "accum_local": Fault(LocalTokenMean, {}, "accumulation", BY_NAME["accumulation-scale"].code),
        "sampler_temp": Fault(SamplerTemperature, {}, "sampler_logp", BY_NAME["sampler-trainer-mismatch"].code),
        "stale_old_logp": Fault(OldLogpsRecomputed, {"num_iterations": 2}, "old_logp_frozen",
                                BY_NAME["old-logp-recomputed"].code),
        # signs through the configuration alone: the loss subtracts coef * entropy and adds beta * KL
        "entropy_sign": Fault(GRPOTrainer, {"entropy_coef": -0.01}, "entropy_direction",
                              BY_NAME["entropy-bonus-sign"].code, healthy={"entropy_coef": 0.01}),
        "kl_sign": Fault(GRPOTrainer, {"beta": -0.1}, "kl_direction", BY_NAME["kl-sign"].code,
                         healthy={"beta": 0.1}),
    }
    if rloo:  # RLOO's loss has no entropy or KL term and no loss_type (its KL is a reward penalty)
        for name in ("entropy_sign", "kl_sign", "accum_local"):
            del faults[name]
        for fault in faults.values():
            fault.rloo = True
    return faults


def own_loss(kl_sign: float = 1.0, entropy_sign: float = -1.0, from_step: int = 0):
    """A ``GRPOTrainer`` subclass that writes its own ``_compute_loss``, as a user would: the clipped surrogate,
    plus ``beta`` times TRL's per-token KL estimator (``exp(ref - logp) - (ref - logp) - 1``), minus
    ``entropy_coef`` times the mean entropy. From ``global_step >= from_step`` the KL term enters with
    ``kl_sign`` and the entropy term with ``entropy_sign`` (the healthy signs: +1 and -1), so a sign slip can
    start mid-run with both coefficients positive."""
    from trl import GRPOTrainer

    class OwnLoss(GRPOTrainer):
        def _compute_loss(self, model, inputs):
            ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
            attention = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
            logps, entropies, _ = self._get_per_token_logps_and_entropies(
                model, ids, attention, inputs["completion_ids"].shape[1], compute_entropy=True)
            mask = inputs["completion_mask"]
            old = inputs.get("old_per_token_logps")
            old = logps.detach() if old is None else old
            ratio = torch.exp(logps - old)
            advantages = inputs["advantages"].unsqueeze(1)
            per_token = -torch.min(ratio * advantages, ratio.clamp(1 - self.epsilon_low, 1 + self.epsilon_high)
                                   * advantages)
            slipped = self.state.global_step >= from_step
            if self.beta != 0.0:
                ref = inputs["ref_per_token_logps"]
                kl = torch.exp(ref - logps) - (ref - logps) - 1
                per_token = per_token + (kl_sign if slipped else 1.0) * self.beta * kl
            tokens = mask.sum().clamp(min=1.0) * self.current_gradient_accumulation_steps
            loss = (per_token * mask).sum() / tokens
            if self.entropy_coef != 0.0:
                entropy = (entropies * mask).sum() / tokens
                loss = loss + (entropy_sign if slipped else -1.0) * self.entropy_coef * entropy
            return loss

    return OwnLoss


@dataclass
class Fault:
    """A seeded fault: the trainer class and config that carry it, the check that must fail, its code; the
    healthy twin is ``GRPOTrainer`` with ``healthy`` (default: the fault's config) instead."""

    cls: type
    config: dict
    check: str
    code: str
    healthy: dict | None = None
    peft: bool = False  # on a LoRA trainer (make_peft_trainer)
    rloo: bool = False  # on an RLOOTrainer (make_rloo_trainer)

    def _maker(self):
        return make_peft_trainer if self.peft else make_rloo_trainer if self.rloo else make_trainer

    def faulty_trainer(self):
        return self._maker()(self.cls, **self.config)

    def healthy_trainer(self):
        return self._maker()(**(self.config if self.healthy is None else self.healthy))


# -------------------------------------------------------------------------------- PEFT (LoRA)


def lora_config(**overrides):
    """A LoRA adapter on the attention's q and v projections (no dropout: the tests compare runs bit for bit)."""
    from peft import LoraConfig

    return LoraConfig(**{"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"], "lora_dropout": 0.0,
                         "task_type": "CAUSAL_LM", **overrides})


def make_peft_trainer(cls=None, callbacks=None, peft=None, reward_funcs=None, **overrides):
    """``make_trainer`` with a LoRA adapter (``peft_config``): TRL wraps the tiny model in a ``PeftModel``."""
    from trl import GRPOConfig, GRPOTrainer
    from transformers.trainer_callback import PrinterCallback

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    args = GRPOConfig(output_dir=scratch("out-"), **{**CONFIG, **overrides})
    trainer = (cls or GRPOTrainer)(model=model_dir(), reward_funcs=reward_funcs or reward_good_words, args=args,
                                   train_dataset=dataset(), processing_class=tokenizer(), callbacks=callbacks,
                                   peft_config=peft or lora_config())
    trainer.remove_callback(PrinterCallback)
    return trainer


def peft_fault_classes():
    """name -> ``Fault`` on a LoRA trainer (``make_peft_trainer``)."""
    from trl import GRPOTrainer

    from rlguard.catalog import REFERENCE_ALIAS, TRAINED_PARAMS_DRIFT

    class ReferenceAdapterOn(GRPOTrainer):
        """RLG008: TRL's reference pass runs with the adapter still on (``use_adapter`` made a no-op), so the KL
        is measured against the live policy."""

        def _generate_and_score_completions(self, inputs):
            import contextlib

            import trl.trainer.grpo_trainer as grpo

            original = grpo.use_adapter
            grpo.use_adapter = lambda model, adapter_name: contextlib.nullcontext()
            try:
                return super()._generate_and_score_completions(inputs)
            finally:
                grpo.use_adapter = original

    class UnfrozenBaseWeight(GRPOTrainer):
        """RLG014: a base weight (``lm_head``) switched trainable next to the adapter, which does not list it."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.model.get_base_model().lm_head.weight.requires_grad_(True)

    class PeftReferenceIsPolicy(GRPOTrainer):
        """RLG008: a ``ref_model`` set to the PEFT policy itself (adapter on): TRL then uses it as the reference."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.ref_model = self.model  # noqa: RLG008 - the fault, seeded on purpose

    class PeftReferenceIsBaseModel(GRPOTrainer):
        """RLG008: ``ref_model = model.get_base_model()``: LoRA is injected in place, so the "base" still runs
        the adapter (the reference is computed with the adapter on)."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.ref_model = self.model.get_base_model()  # noqa: RLG008 - the fault, seeded on purpose

    return {
        "peft_ref_is_base_model": Fault(PeftReferenceIsBaseModel, {"beta": 0.1}, "kl_positive", REFERENCE_ALIAS,
                                        peft=True),
        "peft_ref_is_policy": Fault(PeftReferenceIsPolicy, {"beta": 0.1}, "kl_positive", REFERENCE_ALIAS,
                                    peft=True),
        "peft_ref_adapter_on": Fault(ReferenceAdapterOn, {"beta": 0.1}, "kl_positive", REFERENCE_ALIAS,
                                     peft=True),
        "peft_base_unfrozen": Fault(UnfrozenBaseWeight, {}, "frozen_params", TRAINED_PARAMS_DRIFT, peft=True),
    }


def make_pretrained_adapter_trainer(**overrides):
    """A ``GRPOTrainer`` given a ``PeftModel`` whose adapter is already trained (random, non-zero LoRA B): with
    ``beta != 0`` TRL adds a frozen copy of it, the ``"ref"`` adapter, as the reference."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM
    from transformers.trainer_callback import PrinterCallback
    from trl import GRPOConfig, GRPOTrainer

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    base = AutoModelForCausalLM.from_pretrained(model_dir())
    with torch.random.fork_rng():
        torch.manual_seed(3)
        model = get_peft_model(base, lora_config(init_lora_weights=False))
    args = GRPOConfig(output_dir=scratch("out-"), **{**CONFIG, **overrides})
    trainer = GRPOTrainer(model=model, reward_funcs=reward_good_words, args=args, train_dataset=dataset(),
                          processing_class=tokenizer())
    trainer.remove_callback(PrinterCallback)
    return trainer
