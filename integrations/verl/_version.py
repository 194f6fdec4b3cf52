"""The verl versions this integration is tested with, and the check that refuses the others.

The installed version is read from the package metadata, so an unsupported verl is refused before anything
imports it (importing verl pulls in Ray, transformers and its config system: seconds, and side effects). The
range is the ``[verl]`` extra's (``pyproject.toml``; a test keeps the two equal).
"""

from __future__ import annotations

from importlib import metadata  # noqa: F401 - the tests patch metadata.version through this module

from rlguard.integrations._versions import in_range, require_installed

SUPPORTED_VERL = ">=0.9.1,<0.10"
INSTALL = "pip install 'rlguard[verl]'"


class UnsupportedVerlError(ImportError):
    """verl is missing, or its version is outside the tested range."""


def supported(version: str, spec: str = SUPPORTED_VERL) -> bool:
    """Whether ``version`` (e.g. "0.9.1") lies in ``spec`` (">=A,<B")."""
    return in_range(version, spec)


def require_supported_verl() -> str:
    """The installed verl version; ``UnsupportedVerlError`` naming the supported range when it is not usable."""
    return require_installed("verl", "verl", SUPPORTED_VERL, "rlguard.integrations.verl",
                             "It wraps functions of verl.trainer.ppo.core_algos whose signatures change between verl "
                             "releases", INSTALL, UnsupportedVerlError)
