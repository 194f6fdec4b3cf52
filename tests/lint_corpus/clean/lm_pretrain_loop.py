"""Causal language-model pretraining loop (supervised, not RL) with gradient accumulation and an EMA copy.

Training data are packed blocks of exactly ``block_size`` tokens (no padding, ``drop_last=True``): every
micro-batch has the same number of predicted tokens, so the mean loss of a micro-batch divided by
``grad_accum_steps`` sums to the mean loss of the whole batch. Evaluation runs on padded documents and
counts only real tokens.
"""

import copy
import math
import os

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader


def lm_loss(model, input_ids):
    logits = model(input_ids).logits
    shift_logits = logits[..., :-1, :].contiguous()
    shift_labels = input_ids[..., 1:].contiguous()
    loss = F.cross_entropy(shift_logits.view(-1, shift_logits.size(-1)), shift_labels.view(-1))
    return loss


@torch.no_grad()
def update_ema(ema_model, model, decay):
    for ema_p, p in zip(ema_model.parameters(), model.parameters()):
        ema_p.mul_(decay).add_(p.detach(), alpha=1 - decay)


@torch.no_grad()
def evaluate(model, eval_loader, device):
    was_training = model.training
    model.eval()
    total_nll, total_tokens = 0.0, 0
    for batch in eval_loader:
        input_ids = batch["input_ids"].to(device)
        attention_mask = batch["attention_mask"].to(device)
        logits = model(input_ids, attention_mask=attention_mask).logits
        token_nll = F.cross_entropy(logits[:, :-1].transpose(1, 2), input_ids[:, 1:], reduction="none")
        target_mask = attention_mask[:, 1:].float()
        total_nll += (token_nll * target_mask).sum().item()
        total_tokens += int(target_mask.sum().item())
    model.train(was_training)
    mean_nll = total_nll / max(total_tokens, 1)
    return {"eval_loss": mean_nll, "eval_ppl": math.exp(min(mean_nll, 20.0))}


def cosine_lr(step, warmup_steps, max_steps, max_lr, min_lr):
    if step < warmup_steps:
        return max_lr * (step + 1) / warmup_steps
    if step >= max_steps:
        return min_lr
    progress = (step - warmup_steps) / (max_steps - warmup_steps)
    return min_lr + 0.5 * (max_lr - min_lr) * (1.0 + math.cos(math.pi * progress))


def train(model, train_dataset, eval_dataset, out_dir, micro_batch_size=8, grad_accum_steps=8, max_steps=10000,
          warmup_steps=500, max_lr=3e-4, min_lr=3e-5, weight_decay=0.1, grad_clip=1.0, ema_decay=0.999,
          eval_interval=500, device="cuda"):
    model.to(device)
    model.train()
    ema_model = copy.deepcopy(model)
    ema_model.requires_grad_(False)
    ema_model.eval()

    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (decay if p.dim() >= 2 else no_decay).append(p)
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=max_lr, betas=(0.9, 0.95), fused=torch.cuda.is_available(),
    )

    train_loader = DataLoader(train_dataset, batch_size=micro_batch_size, shuffle=True, drop_last=True)
    eval_loader = DataLoader(eval_dataset, batch_size=micro_batch_size, shuffle=False)
    data_iter = iter(train_loader)

    optimizer.zero_grad(set_to_none=True)
    for step in range(max_steps):
        lr = cosine_lr(step, warmup_steps, max_steps, max_lr, min_lr)
        for group in optimizer.param_groups:
            group["lr"] = lr

        running_loss = 0.0
        for micro_step in range(grad_accum_steps):
            try:
                batch = next(data_iter)
            except StopIteration:
                data_iter = iter(train_loader)
                batch = next(data_iter)
            input_ids = batch["input_ids"].to(device, non_blocking=True)
            with torch.autocast(device_type="cuda", dtype=torch.bfloat16, enabled=(device == "cuda")):
                loss = lm_loss(model, input_ids)
            loss = loss / grad_accum_steps
            running_loss += loss.item()
            loss.backward()

        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        update_ema(ema_model, model, ema_decay)

        if step % 50 == 0:
            print(f"step {step}: loss {running_loss:.4f} lr {lr:.2e} grad_norm {float(grad_norm):.3f}")
        if step > 0 and step % eval_interval == 0:
            metrics = evaluate(model, eval_loader, device)
            ema_metrics = evaluate(ema_model, eval_loader, device)
            print(f"step {step}: {metrics} ema {ema_metrics}")
            torch.save({"model": model.state_dict(), "ema": ema_model.state_dict(), "step": step},
                       os.path.join(out_dir, "ckpt.pt"))
    return model, ema_model
