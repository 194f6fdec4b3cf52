"""Runtime contracts for RL trainer functions: shapes, dtypes and RL semantics checked at the first call.

Needs the ``[torch]`` extra (torch, jaxtyping 0.3, typeguard 2.x); ``rlguard.lint`` never imports this.
See ``docs/contracts.md``.
"""

from __future__ import annotations

try:
    import jaxtyping  # noqa: F401
    import torch  # noqa: F401
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        f"rlguard.contracts needs torch and jaxtyping ({e.name} is missing): pip install 'rlguard[torch]'") from e

from rlguard.contracts.aliases import (
    ActionMask,
    Advantages,
    GroupRewards,
    Logits,
    LogProbs,
    Loss,
    Mask,
    OldLogProbs,
    Owner,
    RefLogProbs,
    Rewards,
    TokenIds,
    Values,
)
from rlguard.contracts.batch import Batch, check_batch
from rlguard.contracts.decorator import contract
from rlguard.contracts.errors import ContractDefinitionError, ContractViolation, Violation
from rlguard.contracts.guard import Guard, active_guard
from rlguard.contracts.markers import (
    POLICY_ROLE,
    DistinctReference,
    EvalMode,
    Finite,
    Bonus,
    FollowsRewards,
    Frozen,
    GroupCentered,
    GroupCentred,
    Marker,
    MatchesOwner,
    NoGrad,
    Penalty,
    Probe,
    RowsInStep,
    SamplerConsistent,
    StopTokenInMask,
    UpdateDirection,
)
from rlguard.contracts.row_independent import permutation_invariant, row_independent
from rlguard.contracts.distributed import global_token_count
from rlguard.contracts.settings import get_mode, get_sync, mode, set_mode, set_sync, sync

__all__ = [
    "contract", "Batch", "check_batch", "ContractViolation", "ContractDefinitionError", "Violation",
    "Guard", "active_guard", "set_mode", "get_mode", "mode", "set_sync", "get_sync", "sync", "global_token_count",
    "Marker", "Probe", "NoGrad", "Finite", "Frozen", "GroupCentred", "GroupCentered", "MatchesOwner",
    "SamplerConsistent", "DistinctReference", "POLICY_ROLE", "StopTokenInMask", "EvalMode", "RowsInStep", "UpdateDirection", "FollowsRewards", "Penalty", "Bonus",
    "row_independent", "permutation_invariant",
    "TokenIds", "Owner", "ActionMask", "Logits", "LogProbs", "Advantages", "Rewards", "GroupRewards",
    "Values", "Loss", "OldLogProbs", "RefLogProbs", "Mask",
]
