"""``[tool.rlguard]`` in ``pyproject.toml``, merged with the command line into one effective configuration.

Keys (every one optional)::

    [tool.rlguard]
    select = ["ALL"]                 # codes or prefixes: "RLG004", "RLG00" (RLG001-RLG009), "ALL"
    extend-select = []               # added to select
    ignore = ["RLG010"]              # removed from the selection
    exclude = ["tests/fixtures"]     # globs of files/folders to skip (added to the built-in skips)
    extend-exclude = []              # more globs, same meaning
    per-file-ignores = { "tests/*" = ["RLG013"] }

    [tool.rlguard.names]             # your own names, per role, added to the built-in ones
    old-logp = ["behaviour_lp"]
    ref-model = ["teacher"]

Selection is resolved in layers, as ruff does: the config first, then the command line. A layer with
``select`` starts afresh from it, then adds ``extend-select`` and removes ``ignore``. So ``--select RLG010`` on
the command line shows RLG010 even when the config ignores it, and ``--ignore`` removes from whatever the config
selected. Anything unknown (a key, a code, a role, a wrong type) is a :class:`ConfigError`, never a silent no-op.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

from rlguard.catalog import CODES
from rlguard.lint.names import ROLES, Vocabulary

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

PARSE_ERROR = "RLG900"
KEYS = ("select", "extend-select", "ignore", "exclude", "extend-exclude", "per-file-ignores", "names")
# Friendly spellings of the roles of rlguard.lint.names; the role names themselves work too, with - or _.
ROLE_ALIASES = {
    "old-log-probs": "old_logp", "old-logprobs": "old_logp", "behaviour-logp": "old_logp",
    "ref-log-probs": "ref_logp", "ref-logprobs": "ref_logp", "reference-logp": "ref_logp",
    "log-probs": "logp", "logprobs": "logp",
    "reference-model": "ref_model", "reference": "ref_model", "ref": "ref_model",
    "masks": "mask", "action-mask": "mask", "advantage": "advantages", "adv": "advantages",
    "return": "returns", "reward": "rewards", "entropy-coeff": "entropy_coef", "kl-coeff": "kl_coef",
    "optimiser": "optimizer", "token-ids": "ids",
}


class ConfigError(ValueError):
    """A configuration that rlguard cannot honour; the CLI prints it and exits 2."""


def _lint_codes() -> list[str]:
    """Codes the linter can report: the registered rules and RLG900."""
    from rlguard.lint.rule import all_rules

    return sorted(set(all_rules()) | {PARSE_ERROR})


def resolve_selectors(selectors: Iterable[str], where: str) -> set[str]:
    """``["RLG00", "RLG011"]`` -> the catalog codes they name. A selector is ``ALL``, a full code or a prefix of
    one; anything else raises :class:`ConfigError` naming ``where`` it came from."""
    out: set[str] = set()
    for raw in selectors:
        sel = raw.strip().upper()
        if sel == "ALL":
            out |= set(CODES)
            continue
        matched = {code for code in CODES if code.startswith(sel)} if sel.startswith("RLG") else set()
        if not matched:
            raise ConfigError(f"{where}: unknown code or prefix {raw!r} (codes are RLG000-RLG015 and RLG900; "
                              f"prefixes like 'RLG00' and 'ALL' work too; `rlguard rule --list` shows them)")
        out |= matched
    return out


@dataclass(frozen=True)
class Layer:
    """One source of selection settings (the config file, then the command line)."""

    select: tuple[str, ...] | None = None
    extend_select: tuple[str, ...] = ()
    ignore: tuple[str, ...] = ()
    where: str = "command line"

    def apply(self, current: set[str]) -> set[str]:
        if self.select is not None:
            current = resolve_selectors(self.select, f"{self.where} select")
        current = current | resolve_selectors(self.extend_select, f"{self.where} extend-select")
        return current - resolve_selectors(self.ignore, f"{self.where} ignore")


@dataclass
class Config:
    """The effective configuration for one run. ``root`` is the project root: where the config file lives,
    else the current directory; globs in ``exclude``/``per-file-ignores`` are relative to it, and the cache
    lives there."""

    root: Path
    source: Path | None = None  # the file the settings came from, None for defaults
    layers: list[Layer] = field(default_factory=list)
    exclude: tuple[str, ...] = ()
    per_file_ignores: dict[str, tuple[str, ...]] = field(default_factory=dict)
    names: dict[str, tuple[str, ...]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        selected: set[str] = set(CODES)
        for layer in self.layers:
            selected = layer.apply(selected)
        lintable = set(_lint_codes())
        self.selected: tuple[str, ...] = tuple(sorted(selected & lintable))
        self._pfi = {glob: resolve_selectors(codes, f"{self._where} per-file-ignores[{glob!r}]")
                     for glob, codes in self.per_file_ignores.items()}
        self._codes_cache: dict[str, tuple[str, ...]] = {}

    @property
    def _where(self) -> str:
        return _display(self.source) if self.source else "configuration"

    # ----- per file -----------------------------------------------------------------------------------------
    def relative(self, path: Path) -> str:
        """``path`` relative to the project root in POSIX form (as given when outside the root)."""
        try:
            return Path(os.path.abspath(path)).relative_to(self.root).as_posix()
        except ValueError:
            return Path(path).as_posix()

    def is_excluded(self, path: Path) -> bool:
        return bool(self.exclude) and matches_any(self.relative(path), self.exclude)

    def codes_for(self, path: Path) -> tuple[str, ...]:
        """The selected codes minus the file's ``per-file-ignores``."""
        if not self._pfi:
            return self.selected
        rel = self.relative(path)
        hit = self._codes_cache.get(rel)
        if hit is None:
            dropped: set[str] = set()
            for glob, codes in self._pfi.items():
                if matches_any(rel, (glob,)):
                    dropped |= codes
            hit = tuple(c for c in self.selected if c not in dropped)
            self._codes_cache[rel] = hit
        return hit

    def vocabulary(self) -> Vocabulary:
        return Vocabulary(extra=dict(self.names))

    def fingerprint(self, codes: Sequence[str]) -> str:
        """What of the configuration can change a file's findings: the codes run on it and the names."""
        payload = json.dumps({"codes": list(codes), "names": {k: sorted(v) for k, v in sorted(self.names.items())}},
                             sort_keys=True)
        return hashlib.sha256(payload.encode()).hexdigest()[:16]


def matches_any(rel_posix: str, globs: Iterable[str]) -> bool:
    """Whether a root-relative POSIX path matches a glob. A glob with a ``/`` is anchored at the root and also
    matches everything below a matching folder (``tests/fixtures`` skips the whole folder); a glob without one
    matches any single component (``*_pb2.py``, ``generated``)."""
    parts = rel_posix.split("/")
    for glob in globs:
        pattern = glob.strip().lstrip("./").rstrip("/") if glob.strip() not in (".", "./") else ""
        if not pattern:
            continue
        if "/" in pattern:
            prefix = ""
            for part in parts:
                prefix = f"{prefix}/{part}" if prefix else part
                if fnmatch.fnmatchcase(prefix, pattern):
                    return True
        elif any(fnmatch.fnmatchcase(part, pattern) for part in parts):
            return True
    return False


# ----- loading -------------------------------------------------------------------------------------------------
def find_config(start: Path) -> Path | None:
    """The nearest ``pyproject.toml`` with a ``[tool.rlguard]`` table, from ``start`` upwards."""
    here = Path(os.path.abspath(start))
    if here.is_file() or not here.exists():
        here = here.parent
    for folder in (here, *here.parents):
        candidate = folder / "pyproject.toml"
        if candidate.is_file():
            try:
                data = _read_toml(candidate)
            except ConfigError:
                # someone else's broken pyproject is not ours to report, unless it has our table
                if "tool.rlguard" in candidate.read_text(encoding="utf-8", errors="replace"):
                    raise
                continue
            if "rlguard" in data.get("tool", {}):
                return candidate
    return None


def _read_toml(path: Path) -> dict:
    try:
        with open(path, "rb") as fh:
            return tomllib.load(fh)
    except OSError as exc:
        raise ConfigError(f"{_display(path)}: cannot read: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{_display(path)}: not valid TOML: {exc}") from None


def load_table(path: Path) -> dict:
    """The ``[tool.rlguard]`` table of a pyproject.toml, or the whole file for another TOML file
    (``--config rlguard.toml``)."""
    data = _read_toml(path)
    if "tool" in data and isinstance(data["tool"], dict) and "rlguard" in data["tool"]:
        table = data["tool"]["rlguard"]
    elif path.name == "pyproject.toml":
        table = {}
    else:
        table = data
    if not isinstance(table, dict):
        raise ConfigError(f"{_display(path)}: [tool.rlguard] must be a table")
    return table


def _strings(value, where: str) -> tuple[str, ...]:
    if isinstance(value, str) or not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"{where} must be a list of strings, got {value!r}")
    return tuple(value)


def _role(name: str, where: str) -> str:
    key = name.strip().lower()
    role = ROLE_ALIASES.get(key, key.replace("-", "_"))
    if role not in ROLES:
        friendly = sorted({r.replace("_", "-") for r in ROLES})
        raise ConfigError(f"{where}: unknown role {name!r} (known: {', '.join(friendly)})")
    return role


def load_config(paths: Sequence[str | os.PathLike] = (), config_path: str | os.PathLike | None = None,
                cli: Layer | None = None, isolated: bool = False) -> Config:
    """The effective configuration: ``config_path`` or the nearest ``[tool.rlguard]`` from the first path (or the
    current directory), then the command-line layer. ``isolated`` ignores every config file."""
    source: Path | None = None
    if config_path is not None:
        source = Path(config_path)
        if not source.is_file():
            raise ConfigError(f"--config {config_path}: no such file")
    elif not isolated:
        source = find_config(Path(paths[0]) if paths else Path.cwd())
    table = load_table(source) if source is not None else {}
    root = Path(os.path.abspath(source)).parent if source is not None else Path.cwd()
    where = f"{_display(source)} [tool.rlguard]" if source is not None else "configuration"

    unknown = sorted(set(table) - set(KEYS))
    if unknown:
        raise ConfigError(f"{where}: unknown key {unknown[0]!r} (known keys: {', '.join(KEYS)})")
    layer = Layer(
        select=_strings(table["select"], f"{where} select") if "select" in table else None,
        extend_select=_strings(table.get("extend-select", []), f"{where} extend-select"),
        ignore=_strings(table.get("ignore", []), f"{where} ignore"),
        where=where,
    )
    exclude = _strings(table.get("exclude", []), f"{where} exclude") + _strings(
        table.get("extend-exclude", []), f"{where} extend-exclude")
    pfi_raw = table.get("per-file-ignores", {})
    if not isinstance(pfi_raw, dict):
        raise ConfigError(f"{where} per-file-ignores must be a table of glob = [codes], got {pfi_raw!r}")
    per_file_ignores = {glob: _strings(codes, f"{where} per-file-ignores[{glob!r}]") for glob, codes in pfi_raw.items()}
    names_raw = table.get("names", {})
    if not isinstance(names_raw, dict):
        raise ConfigError(f"{where} names must be a table of role = [names], got {names_raw!r}")
    names: dict[str, tuple[str, ...]] = {}
    for role_name, extra in names_raw.items():
        role = _role(role_name, f"{where} names")
        values = _strings(extra, f"{where} names.{role_name}")
        bad = [v for v in values if not v.isidentifier()]
        if bad:
            raise ConfigError(f"{where} names.{role_name}: {bad[0]!r} is not a Python identifier")
        names[role] = tuple(sorted(set(names.get(role, ())) | set(values)))

    layers = [layer] + ([cli] if cli is not None else [])
    return Config(root=root, source=source, layers=layers, exclude=exclude, per_file_ignores=per_file_ignores,
                  names=names)


def _display(path: Path | None) -> str:
    """A path for messages: relative to the current directory when under it."""
    if path is None:
        return ""
    try:
        return Path(os.path.abspath(path)).relative_to(Path.cwd()).as_posix()
    except ValueError:
        return str(path)
