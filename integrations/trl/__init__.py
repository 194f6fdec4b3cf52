"""rlguard for TRL's ``GRPOTrainer`` and ``RLOOTrainer``: the preflight suite with no adapter to write, and a training callback.

    from rlguard.integrations.trl import preflight, RlguardCallback
    report = preflight(make_trainer)            # or a constructed trainer; rlguard check --trl module:make_trainer

Needs the ``[trl]`` extra (``pip install 'rlguard[trl]'``); importing this package with another TRL version raises
``UnsupportedTRLError`` naming the supported range. See ``docs/trl.md``.
"""

from rlguard.integrations.trl._version import SUPPORTED_TRL, UnsupportedTRLError, require_supported_trl

TRL_VERSION = require_supported_trl()

from rlguard.integrations.trl.callback import TRL_METRICS, RlguardCallback, diagnose_row  # noqa: E402
from rlguard.integrations.trl.preflight import (  # noqa: E402 - only once the version is known to be supported
    GenerationBatch,
    GRPOAdapter,
    PeftReference,
    SUPPORTED_TRAINERS,
    TRLPreflightError,
    UnsupportedTrainerError,
    adapter_from_factory,
    load_trainer_factory,
    preflight,
)

__all__ = ["SUPPORTED_TRL", "TRL_VERSION", "UnsupportedTRLError", "GRPOAdapter", "GenerationBatch", "PeftReference",
           "TRLPreflightError", "SUPPORTED_TRAINERS", "UnsupportedTrainerError", "adapter_from_factory", "load_trainer_factory", "preflight", "RlguardCallback",
           "TRL_METRICS", "diagnose_row"]
