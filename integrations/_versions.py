"""Version ranges of the frameworks an integration is tested with (``">=A,<B"``), read without importing them."""

from __future__ import annotations

import re
from importlib import metadata


def release(version: str) -> tuple[int, ...]:
    """The leading release numbers of a version string: "0.9.1rc1" -> (0, 9, 1)."""
    match = re.match(r"\d+(?:\.\d+)*", version.strip())
    if match is None:
        raise ValueError(f"not a version: {version!r}")
    return tuple(int(p) for p in match.group().split("."))


def in_range(version: str, spec: str) -> bool:
    """Whether ``version`` (e.g. "1.16.0") lies in ``spec`` (">=A,<B")."""
    low, high = (s.strip() for s in spec.split(","))
    return release(low.removeprefix(">=")) <= release(version) < release(high.removeprefix("<"))


def require_installed(distribution: str, label: str, spec: str, integration: str, why: str, install: str,
                      error: type[Exception]) -> str:
    """The installed version of ``distribution``; ``error`` naming the supported range ``spec`` when it is missing
    or outside it (``why``: what of the framework the integration depends on)."""
    try:
        version = metadata.version(distribution)
    except metadata.PackageNotFoundError:
        raise error(f"{integration} needs {label} {spec}, which is not installed: {install}") from None
    if not in_range(version, spec):
        raise error(f"{integration} supports {label} {spec}; {label} {version} is installed. {why}: {install} "
                    "installs a supported version")
    return version
