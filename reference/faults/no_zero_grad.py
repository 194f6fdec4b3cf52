"""no_zero_grad (RLG013): ``optimizer.step()`` in the minibatch loop with no ``zero_grad``: gradients leak across steps.

Each step applies the sum of every gradient since the start (and whatever ``.grad`` held before the update).
"""

import torch

from rlguard.reference.pipeline import summarize_update


def update(model, ref_model, optimizer, batch, cfg, parts, generator):
    ids = batch["ids"]
    action_mask = parts.build_action_mask(batch["owner"])
    old_log_probs = batch["sampler_logp"]
    with torch.no_grad():
        advantages = parts.group_advantages(batch["rewards"], cfg.group_size)
        ref_log_probs = None
        if ref_model is not None:
            ref_log_probs = parts.token_log_probs(ref_model(ids) / cfg.temperature, ids)
    logs = []
    for _ in range(cfg.epochs):
        for rows in torch.randperm(len(ids), generator=generator).chunk(cfg.minibatches):
            stats = parts.minibatch_backward(model, ids, rows, action_mask, old_log_probs, advantages,
                                             ref_log_probs, cfg, parts)
            params = [p for p in model.parameters() if p.grad is not None]
            stats["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm))
            optimizer.step()
            logs.append(stats)
    return summarize_update(logs)
