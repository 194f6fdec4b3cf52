"""Minimal RLOO trainer: the advantage is baseline minus reward, i.e. negated (RLG005), and the optimizer's
gradients are never zeroed between updates (RLG013)."""

import torch
import torch.nn.functional as F


def sequence_logps(model, input_ids, attention_mask, response_mask):
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
    logps = torch.gather(F.log_softmax(logits[:, :-1], dim=-1), 2, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    return (logps * response_mask[:, 1:]).sum(1)


def train(policy, optimizer, dataloader, reward_fn, tokenizer, k=4, max_new_tokens=256):
    policy.train()
    for batch in dataloader:
        prompt_ids = batch["input_ids"].repeat_interleave(k, dim=0)
        prompt_mask = batch["attention_mask"].repeat_interleave(k, dim=0)
        with torch.no_grad():
            query_responses = policy.generate(input_ids=prompt_ids, attention_mask=prompt_mask, do_sample=True,
                                              max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id)
        attention_mask = (query_responses != tokenizer.pad_token_id).long()
        attention_mask[:, :prompt_ids.size(1)] = prompt_mask
        response_mask = attention_mask.clone()
        response_mask[:, :prompt_ids.size(1)] = 0

        texts = tokenizer.batch_decode(query_responses[:, prompt_ids.size(1):], skip_special_tokens=True)
        scores = torch.tensor(reward_fn(texts), dtype=torch.float, device=query_responses.device)
        rewards = scores.view(-1, k)
        baseline = (rewards.sum(1, keepdim=True) - rewards) / (k - 1)
        advantages = (baseline - rewards).flatten()  # expect: RLG005

        seq_logps = sequence_logps(policy, query_responses, attention_mask, response_mask)
        loss = -(advantages * seq_logps).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
        optimizer.step()  # expect: RLG013
