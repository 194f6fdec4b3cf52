"""A content-addressed cache of lint results, so re-linting an unchanged tree (a pre-commit hook on every
commit) reads small JSON files instead of parsing.

Layout, in the project root::

    .rlguard_cache/
        .gitignore          "*": the folder ignores itself, as ruff's does
        CACHEDIR.TAG        backup tools skip it
        v1/ab/cdef....json  one entry per (file path, file bytes, rlguard version, rules, effective config)

The key hashes the file's path and bytes, rlguard's version, a fingerprint of the linter's own source files
(editing a rule invalidates every entry) and the configuration that affects the file (codes run on it, names).
Entries are written to a temporary file in the same folder and renamed into place, so a reader sees a whole
entry or none, and two processes writing the same entry both write the same bytes. Anything unreadable or
malformed is a miss. Only findings and suppressed findings are cached, never fixes or internal errors.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from functools import lru_cache
from pathlib import Path

from rlguard import __version__
from rlguard.lint.rule import Finding

CACHE_DIR = ".rlguard_cache"
FORMAT = "v1"
_TAG = ("Signature: 8a477f597d28d172789f06886806bc55\n"
        "# This file is a cache directory tag created by rlguard.\n"
        "# For information about cache directory tags see https://bford.info/cachedir/\n")
_FINDING_SOURCES = ("engine.py", "names.py", "rule.py", "triggers.py", "noqa.py")
_FIELDS = ("line", "col", "end_line", "end_col", "code", "name", "message", "severity", "fixable")


@lru_cache(maxsize=1)
def rules_fingerprint() -> str:
    """A hash of the source that decides a file's findings: the engine, the names, the trigger search, the noqa
    comments, the analysis core and every rule module (not the CLI, the output formats or the docs, whose edits
    change no finding)."""
    lint_dir = Path(__file__).resolve().parent
    digest = hashlib.sha256(__version__.encode())
    for path in sorted([*(lint_dir / name for name in _FINDING_SOURCES), *lint_dir.glob("rules/*.py"),
                        *lint_dir.glob("analysis/*.py")]):
        digest.update(path.relative_to(lint_dir).as_posix().encode())
        try:
            digest.update(path.read_bytes())
        except OSError:
            pass
    import rlguard.catalog

    try:
        digest.update(Path(rlguard.catalog.__file__).read_bytes())
    except (OSError, TypeError):
        pass
    return digest.hexdigest()


def cache_key(rel_path: str, data: bytes, config_fingerprint: str) -> str:
    digest = hashlib.sha256()
    for part in (FORMAT, __version__, rules_fingerprint(), config_fingerprint, rel_path):
        digest.update(part.encode())
        digest.update(b"\0")
    digest.update(data)
    return digest.hexdigest()


class Cache:
    """Read and write entries under ``root/.rlguard_cache``. Never raises: a cache that cannot be read or
    written only makes rlguard slower."""

    def __init__(self, root: Path):
        self.dir = Path(root) / CACHE_DIR
        self.entries = self.dir / FORMAT
        self._ready = False
        self._made: set[str] = set()

    def _entry(self, key: str) -> Path:
        return self.entries / key[:2] / f"{key[2:]}.json"

    def get(self, key: str, path: str) -> tuple[list[Finding], list[Finding]] | None:
        """The cached (findings, suppressed) for ``key``, with ``path`` put back into each finding; None on a miss
        or an entry that is not exactly what :meth:`put` writes."""
        try:
            with open(self._entry(key), "rb") as fh:
                data = json.loads(fh.read())
            if data.get("key") != key or not _depends_unchanged(data.get("depends", {})):
                return None
            return ([_finding(path, f) for f in data["findings"]], [_finding(path, f) for f in data["suppressed"]])
        except (OSError, ValueError, TypeError, KeyError, AttributeError):
            return None

    def put(self, key: str, findings: list[Finding], suppressed: list[Finding],
            depends: dict[str, str] | None = None) -> None:
        """``depends``: the other files (path -> content hash) whose function summaries the findings relied on; the
        entry is stale when one of them changes (a helper edited re-lints its callers)."""
        entry = {"key": key, "findings": [_record(f) for f in findings],
                 "suppressed": [_record(f) for f in suppressed], "depends": dict(depends or {})}
        target = self._entry(key)
        try:
            self._prepare()
            folder = target.parent
            if folder.name not in self._made:
                folder.mkdir(parents=True, exist_ok=True)
                self._made.add(folder.name)
            _write_atomic(target, json.dumps(entry, separators=(",", ":")).encode())
        except OSError:
            pass

    def _prepare(self) -> None:
        if self._ready:
            return
        self.entries.mkdir(parents=True, exist_ok=True)
        for name, text in ((".gitignore", "# Automatically created by rlguard.\n*\n"), ("CACHEDIR.TAG", _TAG)):
            if not (self.dir / name).exists():
                _write_atomic(self.dir / name, text.encode())
        self._ready = True


def _depends_unchanged(depends) -> bool:
    from rlguard.lint.analysis.summaries import content_hash

    if not isinstance(depends, dict):
        return False
    for path, digest in depends.items():
        try:
            text = Path(path).read_bytes().decode("utf-8-sig")
        except (OSError, UnicodeDecodeError, TypeError):
            return False
        if content_hash(text) != digest:
            return False
    return True


def _write_atomic(target: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".tmp-", suffix=".part")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.replace(tmp, target)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _record(f: Finding) -> list:
    return [getattr(f, name) for name in _FIELDS]


def _finding(path: str, record: list) -> Finding:
    if not isinstance(record, list) or len(record) != len(_FIELDS):
        raise ValueError("malformed cache record")
    line, col, end_line, end_col, code, name, message, severity, fixable = record
    for value in (line, col, end_line, end_col):
        if not isinstance(value, int) or isinstance(value, bool):
            raise ValueError("malformed position")
    if not all(isinstance(v, str) for v in (code, name, message, severity)) or not isinstance(fixable, bool):
        raise ValueError("malformed cache record")
    return Finding(path, line, col, end_line, end_col, code, name, message, severity, fixable)
