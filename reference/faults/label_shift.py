"""label_shift (RLG012): log-probs gathered from ``logits[:, t]`` against ``ids[:, t]`` (no shift).

Each token is scored by the distribution that was *conditioned on it*, not by the one that predicted it.
"""


def token_log_probs(logits, ids):
    log_probs = logits.log_softmax(-1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    return log_probs[:, 1:]
