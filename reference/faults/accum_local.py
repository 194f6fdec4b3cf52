"""accum_local (RLG006): each microbatch's own token mean, divided by the number of microbatches, is backpropagated.

With length-sorted microbatches a token of a short-answer microbatch weighs more than one of a long-answer
microbatch: the accumulated gradient is not the gradient of the minibatch's token-mean loss.
"""

from rlguard.reference.pipeline import merge_stats


def minibatch_backward(model, ids, rows, action_mask, old_log_probs, advantages, ref_log_probs, cfg, parts):
    micro = rows[action_mask[rows].sum(-1).argsort(stable=True)].chunk(cfg.microbatches)
    n_micro = len(micro)
    logs = []
    for part in micro:
        logits = model(ids[part]) / cfg.temperature
        ref_part = None if ref_log_probs is None else ref_log_probs[part]
        n_tokens = action_mask[part].sum().clamp(min=1)
        loss, stats = parts.compute_loss(logits, ids[part], old_log_probs[part], advantages[part],
                                         action_mask[part], ref_part, cfg, parts, n_tokens, len(part))
        (loss / n_micro).backward()
        logs.append(dict(stats, loss=float(loss.detach())))
    return merge_stats(logs)
