"""``[tool.rlguard]`` in ``pyproject.toml``, merged with the command line into one effective configuration.

Keys (every one optional)::

    [tool.rlguard]
    select = ["ALL"]                 # codes or prefixes: "RLG004", "RLG00" (RLG001-RLG009), "ALL"
    extend-select = []               # added to select
    ignore = ["RLG010"]              # removed from the selection
    exclude = ["tests/fixtures"]     # globs of files/folders to skip (added to the built-in skips)
    extend-exclude = []              # more globs, same meaning
    per-file-ignores = { "tests/*" = ["RLG013"] }
    target-version = "py310"         # the Python the code is for: decides what is a syntax error


    [tool.rlguard.names]             # your own names, per role, added to the built-in ones
    old-logp = ["behaviour_lp"]
    ref-model = ["teacher"]

Selection is resolved in layers, as ruff does: the config first, then the command line. A layer with
``select`` starts afresh from it, then adds ``extend-select`` and removes ``ignore``. So ``--select RLG010`` on
the command line shows RLG010 even when the config ignores it, and ``--ignore`` removes from whatever the config
selected. Anything unknown (a key, a code, a role, a wrong type) is a :class:`ConfigError`, never a silent no-op,
and so is a selection that runs no rule.

``target-version`` (or ``--target-version``) defaults to the lowest Python allowed by ``requires-python`` in the
nearest ``pyproject.toml`` that has one, and without any to the newest grammar rlguard knows, so that no valid
code is reported as a syntax error when nothing says which Python it is for.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Iterable, Sequence

from rlguard.catalog import CODES, INTERNAL_ERROR, PARSE_ERROR, TOOL_CODES, UNUSED_NOQA
from rlguard.lint.names import ROLES, Vocabulary

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

KEYS = ("select", "extend-select", "ignore", "exclude", "extend-exclude", "per-file-ignores", "names",
        "target-version", "preview")
# Codes selected unless the configuration names them (or a prefix of them, or ALL).
OPT_IN = frozenset({UNUSED_NOQA})
# The Pythons whose grammar `target-version` can name: CPython's ast feature_version goes back to 3.7 and
# libcst's parser knows up to 3.14.
TARGET_VERSIONS = tuple(f"py3{minor}" for minor in range(7, 15))
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
    """Codes the linter can report: the registered rules and rlguard's own codes (RLG900-RLG902)."""
    from rlguard.lint.rule import all_rules

    return sorted(set(all_rules()) | set(TOOL_CODES))


def parse_target_version(value: str, where: str) -> tuple[int, int]:
    """``"py312"`` -> (3, 12); anything else is a :class:`ConfigError` naming ``where`` it came from."""
    key = value.strip().lower() if isinstance(value, str) else value
    if key not in TARGET_VERSIONS:
        raise ConfigError(f"{where}: unknown target version {value!r} (known: {', '.join(TARGET_VERSIONS)})")
    return 3, int(key[3:])


def lowest_python(requires_python: str) -> tuple[int, int] | None:
    """The lowest Python 3 minor version a ``requires-python`` specifier allows (``">=3.10,<4"`` -> (3, 10)), None
    when it sets no lower bound or cannot be read."""
    lowest: tuple[int, int] | None = None
    for clause in requires_python.split(","):
        clause = clause.strip()
        for op in ("~=", "===", "==", ">=", ">"):
            if clause.startswith(op):
                numbers = clause[len(op):].strip().rstrip(".*").split(".")
                try:
                    major, minor = int(numbers[0]), int(numbers[1]) if len(numbers) > 1 else 0
                except ValueError:
                    return None
                if major != 3:
                    return None
                # ">3.9" still allows 3.9.1: the grammar to honour is 3.9's
                bound = (3, minor)
                lowest = bound if lowest is None else max(lowest, bound)
                break
    return lowest


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
            raise ConfigError(f"{where}: unknown code or prefix {raw!r} (codes are RLG000-RLG019 and RLG900-RLG902; "
                              f"prefixes like 'RLG00' and 'ALL' work too; `rlguard rule --list` shows them)")
        out |= matched
    return out


def refuse_ignoring_internal_errors(selectors: Iterable[str], where: str) -> None:
    """RLG902 means a file was not fully checked: naming it in an ignore list is an error, not a silent no-op."""
    if any(s.strip().upper() == INTERNAL_ERROR for s in selectors):
        raise ConfigError(f"{where}: {INTERNAL_ERROR} (internal-error) cannot be ignored: it means a file was not "
                          f"fully checked; exclude the file instead, and please report the error")


@dataclass(frozen=True)
class Layer:
    """One source of selection settings (the config file, then the command line)."""

    select: tuple[str, ...] | None = None
    extend_select: tuple[str, ...] = ()
    ignore: tuple[str, ...] = ()
    where: str = "command line"
    preview: bool | None = None  # None: as the layer below says (default off)

    def apply(self, current: set[str]) -> set[str]:
        refuse_ignoring_internal_errors(self.ignore, f"{self.where} ignore")
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
    target_version: tuple[int, int] | None = None  # None: the newest grammar rlguard knows
    target_source: str = "default"  # where target_version came from, for --verbose

    def __post_init__(self) -> None:
        selected: set[str] = set(CODES) - OPT_IN
        self.preview: bool = False
        for layer in self.layers:
            selected = layer.apply(selected)
            if layer.preview is not None:
                self.preview = layer.preview
        lintable = set(_lint_codes())
        if not self.preview:  # ruff's model: a preview rule runs only in preview mode, even when selected
            lintable -= _preview_rule_codes()
        self.selected: tuple[str, ...] = tuple(sorted(selected & lintable))
        _check_runs_a_rule(self.layers, set(self.selected))
        for glob, codes in self.per_file_ignores.items():
            refuse_ignoring_internal_errors(codes, f"{self._where} per-file-ignores[{glob!r}]")
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
        payload = json.dumps({"codes": list(codes), "names": {k: sorted(v) for k, v in sorted(self.names.items())},
                              "target": list(self.target_version or ()), "preview": self.preview}, sort_keys=True)
        return hashlib.sha256(payload.encode()).hexdigest()[:16]


def _check_runs_a_rule(layers: Sequence[Layer], selected: set[str]) -> None:
    """A selection with no rule (nor RLG900, a syntax check on its own) would report "All checks passed" having
    checked nothing: a :class:`ConfigError` that names the codes and why none of them runs."""
    if selected & (_lint_rule_codes() | {PARSE_ERROR}):
        return
    chooser = next((layer for layer in reversed(layers) if layer.select is not None), None)
    if chooser is not None and not [s for s in chooser.select if s.strip()]:
        raise ConfigError(f"{chooser.where} select is empty, so no rule would run: name codes (RLG001-RLG013, RLG016-RLG019), "
                          f"a prefix such as RLG00, or ALL")
    chosen = resolve_selectors(chooser.select, f"{chooser.where} select") if chooser else set(CODES) - OPT_IN
    reasons = []
    for code in sorted(chosen):
        entry = CODES[code]
        if entry.static == "no":
            reasons.append(f"{code} ({entry.name}) is checked at run time only, by the contracts and `rlguard check`")
        elif code == UNUSED_NOQA:
            reasons.append(f"{code} ({entry.name}) judges the noqa comments of the rules that run, so it needs some")
        elif code == INTERNAL_ERROR:
            reasons.append(f"{code} ({entry.name}) is always reported and runs nothing itself")
    in_preview = sorted(chosen & _preview_rule_codes() - selected)
    if in_preview:
        reasons.append(f"{', '.join(in_preview)} {'is' if len(in_preview) == 1 else 'are'} in preview: add --preview "
                       f"(or preview = true in [tool.rlguard])")
    removed = sorted(chosen & _lint_rule_codes() - selected - set(in_preview))
    if removed:
        ignorers = [layer.where for layer in layers if layer.ignore]
        reasons.append(f"{', '.join(removed)} {'is' if len(removed) == 1 else 'are'} removed by "
                       f"{' and '.join(dict.fromkeys(f'{w} ignore' for w in ignorers)) or 'ignore'}")
    where = f"{chooser.where} select {', '.join(chooser.select)}" if chooser else "the selection"
    raise ConfigError(f"{where} runs no lint rule: {'; '.join(reasons) or 'nothing selected'}. Lint checks "
                      f"RLG001-RLG013 and RLG016-RLG019 (`rlguard rule --list`)")


def _lint_rule_codes() -> set[str]:
    from rlguard.lint.rule import all_rules

    return set(all_rules())


def _preview_rule_codes() -> set[str]:
    from rlguard.lint.rule import all_rules

    return {code for code, rule in all_rules().items() if rule.preview}


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
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{_display(path)}: not UTF-8 (byte {exc.object[exc.start]:#04x} at offset {exc.start}); "
                          f"TOML files must be UTF-8: save it as UTF-8") from None


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
                cli: Layer | None = None, isolated: bool = False, target_version: str | None = None) -> Config:
    """The effective configuration: ``config_path`` or the nearest ``[tool.rlguard]`` from the first path (or the
    current directory), then the command-line layer. ``isolated`` ignores every config file. ``target_version``
    (``"py311"``, from ``--target-version``) overrides the config's and the ``requires-python`` default."""
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
    preview = table.get("preview")
    if preview is not None and not isinstance(preview, bool):
        raise ConfigError(f"{where} preview must be true or false, got {preview!r}")
    layer = replace(layer, preview=preview)
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

    if target_version is not None:
        target, target_source = parse_target_version(target_version, "--target-version"), "--target-version"
    elif "target-version" in table:
        target = parse_target_version(table["target-version"], f"{where} target-version")
        target_source = f"{where} target-version"
    else:
        target, target_source = _requires_python(Path(paths[0]) if paths else Path.cwd(), isolated)

    layers = [layer] + ([cli] if cli is not None else [])
    return Config(root=root, source=source, layers=layers, exclude=exclude, per_file_ignores=per_file_ignores,
                  names=names, target_version=target, target_source=target_source)


def _requires_python(start: Path, isolated: bool) -> tuple[tuple[int, int] | None, str]:
    """The target version implied by ``requires-python`` in the nearest pyproject.toml that has it, upwards from
    ``start``: (version or None, where it came from). Other projects' unreadable pyproject files are skipped."""
    if not isolated:
        here = Path(os.path.abspath(start))
        if here.is_file() or not here.exists():
            here = here.parent
        for folder in (here, *here.parents):
            candidate = folder / "pyproject.toml"
            if not candidate.is_file():
                continue
            try:
                project = _read_toml(candidate).get("project", {})
            except ConfigError:
                continue
            spec = project.get("requires-python") if isinstance(project, dict) else None
            if isinstance(spec, str):
                lowest = lowest_python(spec)
                if lowest is not None:
                    known = (3, int(TARGET_VERSIONS[0][3:])), (3, int(TARGET_VERSIONS[-1][3:]))
                    lowest = min(max(lowest, known[0]), known[1])
                    return lowest, f"{_display(candidate)} requires-python {spec!r}"
    return None, "default (the newest grammar rlguard knows)"


def _display(path: Path | None) -> str:
    """A path for messages: relative to the current directory when under it."""
    if path is None:
        return ""
    try:
        return Path(os.path.abspath(path)).relative_to(Path.cwd()).as_posix()
    except ValueError:
        return str(path)
