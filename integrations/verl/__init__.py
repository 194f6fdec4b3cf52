"""rlguard for verl: contracts at verl's seams (its registered policy losses and advantage estimators,
``agg_loss``, ``kl_penalty``, ``DataProto`` batches), in the driver and in its Ray workers, and a preflight that
drives verl's own loss code on a tiny policy.

    from rlguard.integrations import verl as rlguard_verl
    rlguard_verl.install(mode="raise")                  # in this process; RLGUARD_VERL=raise for every process
    adapter = rlguard_verl.verl_adapter(config)         # rlguard check my_module:adapter

Needs the ``[verl]`` extra (``pip install 'rlguard[verl]'``). Importing this package reads verl's version from
the package metadata and raises ``UnsupportedVerlError`` naming the supported range for another one; it does
not import verl itself: ``install()`` and the preflight do, when called. With ``RLGUARD_VERL=raise`` (or
``warn``) in the environment, importing it installs the checks: Ray's ``worker_process_setup_hook`` pointing at
``rlguard.integrations.verl.worker_setup`` does that in every worker process. See ``docs/verl.md``.
"""

from rlguard.integrations.verl._version import SUPPORTED_VERL, UnsupportedVerlError, require_supported_verl

VERL_VERSION = require_supported_verl()

from rlguard.integrations.verl.checks import GROUP_RELATIVE, CentredPerIndex  # noqa: E402
from rlguard.integrations.verl.dataproto import DataProtoSpec, RowCount  # noqa: E402
from rlguard.integrations.verl.wrappers import (  # noqa: E402 - only once the version is known to be supported
    ENV_VAR,
    Installation,
    checking,
    install,
    install_from_environment,
    installed,
    uninstall,
    worker_setup,
)
from rlguard.integrations.verl.preflight import VerlPreflightError, verl_adapter  # noqa: E402

__all__ = ["SUPPORTED_VERL", "VERL_VERSION", "UnsupportedVerlError", "install", "uninstall", "installed",
           "checking", "install_from_environment", "worker_setup", "ENV_VAR", "Installation", "DataProtoSpec",
           "RowCount", "CentredPerIndex", "GROUP_RELATIVE", "verl_adapter", "VerlPreflightError"]

install_from_environment()
