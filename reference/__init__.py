"""The reference GRPO trainer: small, correct, multi-turn, with named fault injection.

    from rlguard.reference import GRPOConfig, train, FAULTS
    history = train(GRPOConfig(), fault=None)      # one metrics dict per step

Needs torch (``pip install 'rlguard[torch]'``).
"""

from rlguard.reference.config import GRPOConfig
from rlguard.reference.faults import FAULTS, Fault
from rlguard.reference.trainer import base_policy, train

__all__ = ["GRPOConfig", "FAULTS", "Fault", "base_policy", "train"]
