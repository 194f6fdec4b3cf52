"""label_shift (RLG012): logits and labels both shifted the same way, so ``logits[:, t]`` is gathered at ``ids[:, t]``.

Each token is scored by the distribution that was *conditioned on it*, not by the one that predicted it.
"""


def token_log_probs(logits, ids):
    log_probs = logits[:, :-1].log_softmax(-1)
    return log_probs.gather(-1, ids[:, :-1].unsqueeze(-1)).squeeze(-1)
