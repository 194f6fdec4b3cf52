"""dp_local_token_mean (RLG006, data-parallel only): each rank normalises its loss by its own token count.

DDP then averages the per-rank token means, so with unequal token counts across ranks (length-grouped shards)
a token on the rank holding short episodes weighs more than one on the rank holding long ones: the gradient is
not that of one token mean over the global minibatch. With one rank it equals the healthy trainer.
"""

import contextlib

from rlguard.reference.pipeline import merge_stats


def minibatch_backward(model, ids, rows, action_mask, old_log_probs, advantages, ref_log_probs, cfg, parts):
    n_tokens = action_mask[rows].sum().clamp(min=1)  # this rank's tokens only
    micro = rows[action_mask[rows].sum(-1).argsort(stable=True)].chunk(cfg.microbatches)
    logs = []
    for i, part in enumerate(micro):
        last = i == len(micro) - 1 or not hasattr(model, "no_sync")
        with contextlib.nullcontext() if last else model.no_sync():
            logits = model(ids[part]) / cfg.temperature
            ref_part = None if ref_log_probs is None else ref_log_probs[part]
            loss, stats = parts.compute_loss(logits, ids[part], old_log_probs[part], advantages[part],
                                             action_mask[part], ref_part, cfg, parts, n_tokens, len(rows))
            loss.backward()  # DDP averages the ranks' local token means
        logs.append(dict(stats, loss=float(loss.detach())))
    return merge_stats(logs)
