"""dp_local_token_mean_accum (RLG006, data-parallel): per-microbatch token means / n_micro on each rank, and DDP
averages over the ranks: the single-process ``accum_local`` fault combined with per-rank normalisation.
"""

import contextlib

from rlguard.reference.pipeline import merge_stats


def minibatch_backward(model, ids, rows, action_mask, old_log_probs, advantages, ref_log_probs, cfg, parts):
    micro = rows[action_mask[rows].sum(-1).argsort(stable=True)].chunk(cfg.microbatches)
    n_micro = len(micro)
    logs = []
    for i, part in enumerate(micro):
        last = i == n_micro - 1 or not hasattr(model, "no_sync")
        with contextlib.nullcontext() if last else model.no_sync():
            logits = model(ids[part]) / cfg.temperature
            ref_part = None if ref_log_probs is None else ref_log_probs[part]
            n_tokens = action_mask[part].sum().clamp(min=1)
            loss, stats = parts.compute_loss(logits, ids[part], old_log_probs[part], advantages[part],
                                             action_mask[part], ref_part, cfg, parts, n_tokens, len(part))
            (loss / n_micro).backward()
        logs.append(dict(stats, loss=float(loss.detach())))
    return merge_stats(logs)
