"""mask_shift (RLG001): the action mask is aligned to ``ids`` instead of ``ids[:, 1:]``: each policy span moves one token right.

``log_probs[:, t]`` scores ``ids[:, t + 1]``; a mask taken from ``owner[:, :-1]`` selects the token *after*
each policy token (the environment's next token) and drops the first token of each policy span.
"""

from rlguard.reference.task import POLICY


def build_action_mask(owner, ids=None):
    action_mask = (owner[:, :-1] == POLICY).float()
    return action_mask
