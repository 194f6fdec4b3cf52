"""mask_shift (RLG001): the action mask is built for ``ids`` and then padded, so each policy span moves one token right.

The log-probs are stored for ``ids[:, 1:]`` already; the extra pad shifts the mask onto the token after each
policy span (an environment token) and off the span's first token.
"""

import torch.nn.functional as F

from rlguard.reference.task import POLICY


def build_action_mask(owner):
    """1.0 where the policy wrote ... one position too late."""
    action_mask = (owner[:, 1:] == POLICY).float()
    action_mask = F.pad(action_mask, (1, 0))[:, :-1]
    return action_mask
