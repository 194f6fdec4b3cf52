"""The TRL versions this integration is tested with, and the check that refuses the others.

It reads the installed version from the package metadata, so an unsupported TRL is refused before anything
imports it. The range is the ``[trl]`` extra's (``pyproject.toml``; a test keeps the two equal).
"""

from __future__ import annotations

from importlib import metadata

from rlguard.integrations._versions import in_range, require_installed

SUPPORTED_TRL = ">=1.16,<1.17"
# PEFT, for LoRA trainers only (the [trl] extra installs it; a trainer without PEFT never needs it). 0.17 does not
# import with the transformers TRL 1.16 is tested with (transformers 5 removed HybridCache).
SUPPORTED_PEFT = ">=0.18,<0.22"
INSTALL = "pip install 'rlguard[trl]'"


class UnsupportedTRLError(ImportError):
    """TRL is missing, or its version is outside the tested range."""


def supported(version: str, spec: str = SUPPORTED_TRL) -> bool:
    """Whether ``version`` (e.g. "1.16.0") lies in ``spec`` (">=A,<B")."""
    return in_range(version, spec)


def unsupported_peft() -> str | None:
    """Why the installed PEFT cannot run the TRL preflight on a PEFT model (outside ``SUPPORTED_PEFT``), or None."""
    try:
        version = metadata.version("peft")
    except metadata.PackageNotFoundError:  # pragma: no cover - a PEFT model implies PEFT is installed
        return f"PEFT is not installed ({INSTALL} installs PEFT {SUPPORTED_PEFT})"
    if supported(version, SUPPORTED_PEFT):
        return None
    return f"PEFT {version} (the TRL integration is tested with PEFT {SUPPORTED_PEFT}: {INSTALL})"


def require_supported_trl() -> str:
    """The installed TRL version; ``UnsupportedTRLError`` naming the supported range when it is not usable."""
    return require_installed("trl", "TRL", SUPPORTED_TRL, "rlguard.integrations.trl",
                             "It reads GRPOTrainer internals that change between TRL releases", INSTALL,
                             UnsupportedTRLError)
