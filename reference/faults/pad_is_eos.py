"""pad_is_eos (RLG017): the pad token is the EOS token, and the loss mask drops pad ids: the stop token too.

The policy's EOS at the end of each completion has the pad's id, so ``ids != PAD_ID`` removes it from the
loss: the model is never trained to stop.
"""

from rlguard.reference.task import POLICY, TaskSpec

PAD_ID = TaskSpec(stop_token=True).eos_token()  # the tokenizer's pad token set to its EOS token


def build_action_mask(owner, ids):
    action_mask = ((owner[:, 1:] == POLICY) & (ids[:, 1:] != PAD_ID)).float()
    return action_mask
