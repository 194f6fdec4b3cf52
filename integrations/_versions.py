"""Version ranges of the frameworks an integration is tested with (``">=A,<B"``), read without importing them."""

from __future__ import annotations

import re


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
