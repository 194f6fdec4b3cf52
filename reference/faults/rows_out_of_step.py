"""rows_out_of_step (RLG019): microbatches sorted by length for the forward, advantages taken in the unsorted order.

Each microbatch's ids, mask and old log-probs are length-sorted rows; its advantages are the rows of the
unsorted chunk at the same place: every episode is trained with another episode's advantage.
"""

from rlguard.reference.pipeline import merge_stats


def minibatch_backward(model, ids, rows, action_mask, old_log_probs, advantages, ref_log_probs, cfg, parts):
    n_tokens = action_mask[rows].sum().clamp(min=1)
    n_seqs = len(rows)
    micro = rows[action_mask[rows].sum(-1).argsort(stable=True)].chunk(cfg.microbatches)
    logs = []
    for part, unsorted in zip(micro, rows.chunk(cfg.microbatches)):
        logits = parts.forward(model, ids[part], cfg)
        ref_part = None if ref_log_probs is None else ref_log_probs[part]
        loss, stats = parts.compute_loss(logits, ids[part], old_log_probs[part], advantages[unsorted],
                                         action_mask[part], ref_part, cfg, parts, n_tokens, n_seqs)
        loss.backward()
        logs.append(dict(stats, loss=float(loss.detach())))
    return merge_stats(logs)
