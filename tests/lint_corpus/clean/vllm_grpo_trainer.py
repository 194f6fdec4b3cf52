"""GRPO with a vLLM sampler whose log-probs serve as the behaviour (old) log-probs.

The sampler and the trainer use the same distribution: one ``TEMPERATURE`` for vLLM's ``SamplingParams`` and
for the trainer's logits, vLLM returning processed (temperature-scaled) log-probs, no top-p/top-k truncation,
fresh weights pushed to vLLM before each rollout.
Completion log-probs are stored per completion token, aligned to ``completion_ids`` and ``completion_mask``.
"""

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM
from vllm import LLM, SamplingParams

TEMPERATURE = 0.7
GROUP_SIZE = 8


def completion_log_probs(model, input_ids, attention_mask, n_completion):
    """Trainer log-probs of the last ``n_completion`` tokens (same temperature as the sampler)."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
    logits = logits[:, :-1] / TEMPERATURE
    labels = input_ids[:, 1:]
    logps = torch.gather(F.log_softmax(logits.float(), dim=-1), 2, labels.unsqueeze(-1)).squeeze(-1)
    return logps[:, -n_completion:]


class VLLMGRPOTrainer:
    def __init__(self, model_name, reward_fn, tokenizer, lr=1e-6, beta=0.04, clip_eps=0.2, max_tokens=1024):
        self.model = AutoModelForCausalLM.from_pretrained(model_name, torch_dtype=torch.bfloat16).cuda()
        self.ref_model = AutoModelForCausalLM.from_pretrained(model_name, torch_dtype=torch.bfloat16).cuda().eval()
        self.ref_model.requires_grad_(False)
        # processed log-probs: after temperature scaling, the distribution the tokens were sampled from
        self.llm = LLM(model=model_name, gpu_memory_utilization=0.4, logprobs_mode="processed_logprobs")
        self.sampling_params = SamplingParams(n=GROUP_SIZE, temperature=TEMPERATURE, top_p=1.0, top_k=-1,
                                              max_tokens=max_tokens, logprobs=0)
        self.tokenizer = tokenizer
        self.reward_fn = reward_fn
        self.beta = beta
        self.clip_eps = clip_eps
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr)

    @torch.no_grad()
    def sync_weights(self):
        llm_model = self.llm.llm_engine.model_executor.driver_worker.model_runner.model
        llm_model.load_weights(self.model.state_dict().items())

    def rollout(self, prompts):
        self.sync_weights()
        outputs = self.llm.generate(prompts, self.sampling_params)
        prompt_ids, completion_ids, sampling_logps, texts = [], [], [], []
        for out in outputs:
            for sample in out.outputs:
                prompt_ids.append(out.prompt_token_ids)
                completion_ids.append(sample.token_ids)
                sampling_logps.append([lp[tok].logprob for lp, tok in zip(sample.logprobs, sample.token_ids)])
                texts.append(sample.text)
        return prompt_ids, completion_ids, sampling_logps, texts

    def collate(self, prompt_ids, completion_ids, sampling_logps):
        pad = self.tokenizer.pad_token_id
        p_len = max(len(p) for p in prompt_ids)
        c_len = max(len(c) for c in completion_ids)
        rows, attn, comp_mask, old = [], [], [], []
        for p, c, lp in zip(prompt_ids, completion_ids, sampling_logps):
            left, right = p_len - len(p), c_len - len(c)
            rows.append([pad] * left + list(p) + list(c) + [pad] * right)
            attn.append([0] * left + [1] * (len(p) + len(c)) + [0] * right)
            comp_mask.append([1] * len(c) + [0] * right)
            old.append(list(lp) + [0.0] * right)
        as_long = lambda x: torch.tensor(x, dtype=torch.long, device="cuda")
        old_logps = torch.tensor(old, dtype=torch.float, device="cuda")
        return as_long(rows), as_long(attn), as_long(comp_mask).float(), old_logps, c_len

    def step(self, prompts):
        prompt_ids, completion_ids, sampling_logps, texts = self.rollout(prompts)
        input_ids, attention_mask, completion_mask, old_logps, n_completion = self.collate(
            prompt_ids, completion_ids, sampling_logps)

        rewards = torch.tensor(self.reward_fn(texts), dtype=torch.float, device="cuda")
        grouped = rewards.view(-1, GROUP_SIZE)
        advantages = (grouped - grouped.mean(dim=1, keepdim=True)) / (grouped.std(dim=1, keepdim=True) + 1e-4)
        advantages = advantages.view(-1, 1)

        with torch.no_grad():
            ref_logps = completion_log_probs(self.ref_model, input_ids, attention_mask, n_completion)

        logps = completion_log_probs(self.model, input_ids, attention_mask, n_completion)
        ratio = torch.exp(logps - old_logps)
        surrogate = torch.min(ratio * advantages, torch.clamp(ratio, 1 - self.clip_eps, 1 + self.clip_eps) * advantages)
        per_token_kl = torch.exp(ref_logps - logps) - (ref_logps - logps) - 1
        per_token_loss = -surrogate + self.beta * per_token_kl
        loss = (per_token_loss * completion_mask).sum() / completion_mask.sum()

        self.optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()

        gap = ((logps.detach() - old_logps).abs() * completion_mask).sum() / completion_mask.sum()
        return {"loss": loss.item(), "reward": rewards.mean().item(), "logp_gap": gap.item()}
