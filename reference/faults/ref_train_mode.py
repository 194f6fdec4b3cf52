"""ref_train_mode (RLG018): the reference is rebuilt from the model's config and left in train mode.

A module built by its constructor starts in train mode with the configured dropout (the policy had its dropout
disabled, the rebuilt copy has it on), so every reference forward is a dropout sample: the reference log-probs
are noisy and the KL of the policy to an identical reference is not 0.
"""

from rlguard.reference.model import TinyCausalLM


def make_reference(model):
    ref_model = TinyCausalLM(model.cfg)
    ref_model.load_state_dict(model.state_dict())
    ref_model.requires_grad_(False)
    return ref_model
