"""Ready-made jaxtyping annotations for the usual RL tensors (see the catalog's terms).

``ids`` [B, T] are whole episodes; the model's ``logits[:, :-1]`` predict ``ids[:, 1:]``, so every per-token
training tensor (log-probs, action mask, old and reference log-probs) is [B, T-1], aligned to ``ids[:, 1:]``.
Groups: G samples per prompt laid out contiguously, B = P * G.
"""

from __future__ import annotations

from typing import Annotated

from jaxtyping import AbstractDtype, Bool, Float, Int
from torch import Tensor

from rlguard.contracts.markers import Finite, NoGrad
from rlguard.contracts.spec import ALIAS_KINDS


class Mask(AbstractDtype):
    """dtype class for masks: bool, float or int (``Mask[Tensor, "B T-1"]``)."""

    dtypes = list(Bool.dtypes) + list(Float.dtypes) + list(Int.dtypes)
    label = "bool, float or int"


TokenIds = Int[Tensor, "B T"]  # token ids of whole episodes (prompt, policy and environment tokens)
Owner = Int[Tensor, "B T"]  # who wrote each token of ids: prompt / policy / environment role ids
ActionMask = Mask[Tensor, "B T-1"]  # 1 where the policy wrote ids[:, 1:] (bool, float or int)
Logits = Float[Tensor, "B T V"]  # model output over ids
LogProbs = Float[Tensor, "B T-1"]  # log pi(ids[:, 1:] | prefix), aligned to ids[:, 1:]
Advantages = Float[Tensor, "B"]  # one advantage per episode, B = P * G
Rewards = Float[Tensor, "B"]  # one reward per episode
GroupRewards = Float[Tensor, "P G"]  # rewards of P prompts x G samples
Values = Float[Tensor, "B T-1"]  # per-token value estimates (PPO critic)
Loss = Float[Tensor, ""]  # a scalar

ALIAS_KINDS.update({ActionMask: "mask", LogProbs: "logp"})

# with markers: targets that must carry no gradient and no NaN
OldLogProbs = Annotated[LogProbs, NoGrad(), Finite()]
RefLogProbs = Annotated[LogProbs, NoGrad(), Finite()]
