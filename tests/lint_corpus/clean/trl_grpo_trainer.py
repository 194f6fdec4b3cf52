"""Group Relative Policy Optimization trainer in the style of TRL's ``GRPOTrainer``.

Generation and scoring happen in ``_generate_and_score_completions``; the Trainer base class calls
``compute_loss`` for each micro-batch. Log-probs are stored for the completion tokens only, aligned to
``completion_ids`` (the same positions as ``completion_mask``).
"""

from collections import defaultdict

import torch
from accelerate.utils import gather, gather_object
from transformers import AutoModelForCausalLM, GenerationConfig, Trainer
from trl.models import unwrap_model_for_generation

from .utils import is_peft_model, selective_log_softmax


class GRPOTrainer(Trainer):
    def __init__(self, model, reward_funcs, args, train_dataset=None, processing_class=None, peft_config=None):
        model_id = model if isinstance(model, str) else model.config._name_or_path
        if isinstance(model, str):
            model = AutoModelForCausalLM.from_pretrained(model_id, **(args.model_init_kwargs or {}))
        super().__init__(model=model, args=args, train_dataset=train_dataset, processing_class=processing_class)

        self.reward_funcs = reward_funcs
        self.reward_weights = torch.ones(len(reward_funcs), dtype=torch.float32)
        self.num_generations = args.num_generations
        self.max_completion_length = args.max_completion_length
        self.temperature = args.temperature
        self.beta = args.beta
        self.epsilon_low = args.epsilon
        self.epsilon_high = args.epsilon_high if args.epsilon_high is not None else args.epsilon
        self.num_iterations = args.num_iterations
        self.scale_rewards = args.scale_rewards
        self._metrics = defaultdict(list)

        # Reference model: none without a KL term; with PEFT the base model (adapter disabled) is the reference.
        if self.beta == 0.0:
            self.ref_model = None
        elif is_peft_model(model):
            self.ref_model = None
        else:
            self.ref_model = AutoModelForCausalLM.from_pretrained(model_id, **(args.model_init_kwargs or {}))
            self.ref_model.eval()
            self.ref_model.requires_grad_(False)

        self.generation_config = GenerationConfig(
            max_new_tokens=self.max_completion_length,
            do_sample=True,
            pad_token_id=processing_class.pad_token_id,
            temperature=self.temperature,
            top_p=1.0,
            top_k=None,
        )

    def _get_per_token_logps(self, model, input_ids, attention_mask, logits_to_keep):
        # One extra logit: the last one predicts the token after the sequence and is dropped.
        logits = model(input_ids=input_ids, attention_mask=attention_mask, logits_to_keep=logits_to_keep + 1).logits
        logits = logits[:, :-1, :]
        input_ids = input_ids[:, -logits_to_keep:]
        logits = logits[:, -logits_to_keep:]
        logits = logits / self.temperature
        return selective_log_softmax(logits, input_ids)

    def _generate_and_score_completions(self, inputs):
        device = self.accelerator.device
        prompts = [x["prompt"] for x in inputs]
        prompt_inputs = self.processing_class(
            prompts, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False
        )
        prompt_ids = prompt_inputs["input_ids"].to(device)
        prompt_mask = prompt_inputs["attention_mask"].to(device)

        with unwrap_model_for_generation(self.model_wrapped, self.accelerator) as unwrapped_model:
            prompt_completion_ids = unwrapped_model.generate(
                prompt_ids, attention_mask=prompt_mask, generation_config=self.generation_config
            )
        prompt_length = prompt_ids.size(1)
        prompt_ids = prompt_completion_ids[:, :prompt_length]
        completion_ids = prompt_completion_ids[:, prompt_length:]

        # Mask everything after the first EOS token (the EOS itself is trained on).
        is_eos = completion_ids == self.processing_class.eos_token_id
        eos_idx = torch.full((is_eos.size(0),), is_eos.size(1), dtype=torch.long, device=device)
        eos_idx[is_eos.any(dim=1)] = is_eos.int().argmax(dim=1)[is_eos.any(dim=1)]
        sequence_indices = torch.arange(is_eos.size(1), device=device).expand(is_eos.size(0), -1)
        completion_mask = (sequence_indices <= eos_idx.unsqueeze(1)).int()

        attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
        logits_to_keep = completion_ids.size(1)

        with torch.no_grad():
            if self.num_iterations > 1:
                old_per_token_logps = self._get_per_token_logps(
                    self.model, prompt_completion_ids, attention_mask, logits_to_keep
                )
            else:
                old_per_token_logps = None

            if self.beta == 0.0:
                ref_per_token_logps = None
            elif self.ref_model is not None:
                ref_per_token_logps = self._get_per_token_logps(
                    self.ref_model, prompt_completion_ids, attention_mask, logits_to_keep
                )
            else:
                with self.accelerator.unwrap_model(self.model).disable_adapter():
                    ref_per_token_logps = self._get_per_token_logps(
                        self.model, prompt_completion_ids, attention_mask, logits_to_keep
                    )

        completions = self.processing_class.batch_decode(completion_ids, skip_special_tokens=True)
        rewards_per_func = torch.zeros(len(prompts), len(self.reward_funcs), device=device)
        for i, reward_func in enumerate(self.reward_funcs):
            output_reward_func = reward_func(prompts=prompts, completions=completions)
            rewards_per_func[:, i] = torch.tensor(output_reward_func, dtype=torch.float32, device=device)
        rewards_per_func = gather(rewards_per_func)
        rewards = (rewards_per_func * self.reward_weights.to(device).unsqueeze(0)).sum(dim=1)

        # Group-wise baseline: the G completions of one prompt are contiguous.
        mean_grouped_rewards = rewards.view(-1, self.num_generations).mean(dim=1)
        std_grouped_rewards = rewards.view(-1, self.num_generations).std(dim=1)
        mean_grouped_rewards = mean_grouped_rewards.repeat_interleave(self.num_generations, dim=0)
        std_grouped_rewards = std_grouped_rewards.repeat_interleave(self.num_generations, dim=0)
        advantages = rewards - mean_grouped_rewards
        if self.scale_rewards:
            advantages = advantages / (std_grouped_rewards + 1e-4)

        process_slice = slice(
            self.accelerator.process_index * len(prompts),
            (self.accelerator.process_index + 1) * len(prompts),
        )
        advantages = advantages[process_slice]

        self._metrics["reward"].append(rewards.mean().item())
        self._metrics["reward_std"].append(std_grouped_rewards.mean().item())
        self._metrics["completion_length"].append(self.accelerator.gather_for_metrics(completion_mask.sum(1)).float().mean().item())
        self._textual_logs = gather_object(completions)

        return {
            "prompt_ids": prompt_ids,
            "prompt_mask": prompt_mask,
            "completion_ids": completion_ids,
            "completion_mask": completion_mask,
            "old_per_token_logps": old_per_token_logps,
            "ref_per_token_logps": ref_per_token_logps,
            "advantages": advantages,
        }

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if return_outputs:
            raise ValueError("The GRPOTrainer does not support returning outputs")
        prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"]
        completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
        attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
        logits_to_keep = completion_ids.size(1)

        per_token_logps = self._get_per_token_logps(model, input_ids, attention_mask, logits_to_keep)

        if self.beta != 0.0:
            ref_per_token_logps = inputs["ref_per_token_logps"]
            per_token_kl = (
                torch.exp(ref_per_token_logps - per_token_logps) - (ref_per_token_logps - per_token_logps) - 1
            )

        advantages = inputs["advantages"]
        # With a single gradient step per generation the policy has not moved yet: the detached current
        # log-probs are the behaviour log-probs (ratio 1, gradient of the plain policy gradient).
        old_per_token_logps = inputs["old_per_token_logps"] if self.num_iterations > 1 else per_token_logps.detach()
        coef_1 = torch.exp(per_token_logps - old_per_token_logps)
        coef_2 = torch.clamp(coef_1, 1 - self.epsilon_low, 1 + self.epsilon_high)
        per_token_loss1 = coef_1 * advantages.unsqueeze(1)
        per_token_loss2 = coef_2 * advantages.unsqueeze(1)
        per_token_loss = torch.min(per_token_loss1, per_token_loss2)
        if self.beta != 0.0:
            per_token_loss = -(per_token_loss - self.beta * per_token_kl)
        else:
            per_token_loss = -per_token_loss
        loss = (per_token_loss * completion_mask).sum() / completion_mask.sum().clamp(min=1.0)

        mode = "train" if self.model.training else "eval"
        if self.beta != 0.0:
            mean_kl = (per_token_kl * completion_mask).sum() / completion_mask.sum()
            self._metrics[f"{mode}/kl"].append(self.accelerator.gather_for_metrics(mean_kl).nanmean().item())
        is_clipped = (coef_1 < 1 - self.epsilon_low) | (coef_1 > 1 + self.epsilon_high)
        clip_ratio = (is_clipped * completion_mask).sum() / completion_mask.sum()
        self._metrics[f"{mode}/clip_ratio"].append(self.accelerator.gather_for_metrics(clip_ratio).nanmean().item())
        return loss
