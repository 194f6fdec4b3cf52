"""GRPO with a vLLM sampler: vLLM samples at temperature 0.7 and its log-probs are the old log-probs, but the
trainer's log-probs use ``self.temperature = 1.0`` (RLG007); and the reference is a shallow ``copy.copy`` of
the policy, which shares its parameters (RLG008)."""

import copy

import torch
import torch.nn.functional as F
from vllm import LLM, SamplingParams

from .data import pad_samples  # -> input_ids, attention_mask, completion_mask, sampling_logps (right-padded)


class VLLMGRPOTrainer:
    def __init__(self, model, model_name, optimizer, pad_token_id, group_size=8, beta=0.04, clip_eps=0.2):
        self.model = model
        self.pad_token_id = pad_token_id
        self.ref_model = copy.copy(model)  # expect: RLG008
        self.ref_model.eval()
        self.optimizer = optimizer
        self.temperature = 1.0
        self.group_size = group_size
        self.beta = beta
        self.clip_eps = clip_eps
        self.llm = LLM(model=model_name, logprobs_mode="processed_logprobs")
        self.sampling_params = SamplingParams(n=group_size, temperature=0.7, max_tokens=1024, logprobs=0)

    def completion_logps(self, model, input_ids, attention_mask, n_completion):
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
        logits = logits[:, :-1] / self.temperature  # expect: RLG007
        logps = torch.gather(F.log_softmax(logits, dim=-1), 2, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
        return logps[:, -n_completion:]

    @torch.no_grad()
    def sync_weights(self):
        self.llm.llm_engine.model_executor.driver_worker.model_runner.model.load_weights(self.model.state_dict().items())

    def rollout(self, prompts):
        self.sync_weights()
        outputs = self.llm.generate(prompts, self.sampling_params)
        samples = [(o.prompt_token_ids, s.token_ids, [lp[t].logprob for lp, t in zip(s.logprobs, s.token_ids)])
                   for o in outputs for s in o.outputs]
        return pad_samples(samples, self.pad_token_id)

    def step(self, prompts, reward_fn):
        input_ids, attention_mask, completion_mask, sampling_logps = self.rollout(prompts)
        old_logps = sampling_logps
        n_completion = completion_mask.size(1)
        grouped = reward_fn(input_ids, completion_mask).view(-1, self.group_size)
        advantages = ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-4)).view(-1, 1)
        with torch.no_grad():
            ref_logps = self.completion_logps(self.ref_model, input_ids, attention_mask, n_completion)
        logps = self.completion_logps(self.model, input_ids, attention_mask, n_completion)
        ratio = torch.exp(logps - old_logps)
        per_token_loss = -torch.min(ratio * advantages, torch.clamp(ratio, 1 - self.clip_eps, 1 + self.clip_eps) * advantages)
        per_token_kl = torch.exp(ref_logps - logps) - (ref_logps - logps) - 1
        per_token_loss = per_token_loss + self.beta * per_token_kl
        loss = (per_token_loss * completion_mask).sum() / completion_mask.sum()
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        return loss.item()
