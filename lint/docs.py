"""A code's documentation page, as markdown: ``rlguard rule RLG004`` prints it, ``docs/rules/RLG004.md`` is it.

A lint rule's page is built from the catalog entry and the rule class's docstring (its sections *What it flags*,
*Why it is wrong*, *Example*, *Use instead*, *Fix*, *Options*); codes without a lint rule take their body from
:mod:`rlguard.rule_docs`. Every page ends with the runtime counterpart and how to suppress the code.
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path

from rlguard.catalog import CODES, ENTROPY_BONUS_SIGN, KL_SIGN, PARSE_ERROR, TOOL_CODES, UNUSED_NOQA

REQUIRED_SECTIONS = ("What it flags", "Why it is wrong", "Example", "Use instead", "Fix", "Options",
                     "Runtime counterpart", "Suppression")
_STATIC = {"yes": "yes", "where visible": "yes, where the values are visible", "info": "yes (informational)",
           "no": "no: caught at run time"}


def _rule(code: str):
    from rlguard.lint.rule import all_rules

    return all_rules().get(code)


def severity(code: str) -> str:
    rule = _rule(code)
    if rule is not None:
        return rule.severity
    return "warning" if code == UNUSED_NOQA else "error"


def _body(code: str) -> str:
    rule = _rule(code)
    if rule is not None and rule.__doc__:
        return inspect.cleandoc(rule.__doc__)
    from rlguard.rule_docs import PAGES

    return inspect.cleandoc(PAGES.get(code, ""))


def _has(body: str, section: str) -> bool:
    return re.search(rf"^##\s+{re.escape(section)}\s*$", body, re.MULTILINE) is not None


def flags_text(code: str) -> str:
    """The first paragraph of "What it flags" as one line (SARIF's fullDescription), else the catalog summary."""
    match = re.search(r"^##\s+What it flags\s*\n+(.+?)(?:\n\s*\n|\n##|\Z)", _body(code), re.MULTILINE | re.DOTALL)
    if not match:
        return CODES[code].summary
    return " ".join(match.group(1).split())


def render_page(code: str) -> str:
    """The whole markdown page of ``code`` (a catalog code, any case, or a name)."""
    from rlguard.catalog import lookup

    entry = lookup(code)
    code = entry.code
    rule = _rule(code)
    body = _body(code)
    out = [f"# {code} {entry.name}", "", f"> {entry.summary}", ""]
    if rule is not None:
        fix = "yes (`rlguard lint --fix`)" if rule.fixable else "no"
        out += ["| static check | status | severity | autofix |", "|---|---|---|---|",
                f"| {_STATIC.get(entry.static, entry.static)} | {status(rule)} | {rule.severity} | {fix} |", ""]
        if rule.preview:
            out += ["**Preview.** This rule runs only with `rlguard lint --preview` (or `preview = true` in "
                    "`[tool.rlguard]`): its precision on code it was not tuned on is not yet shown by the "
                    "ecosystem check.", ""]
        elif rule.PREVIEW_PARTS:
            out += ["**Stable, with parts in preview.** These parts report only with `--preview` (or "
                    "`preview = true`), because their precision on unseen code is not yet shown:", "",
                    *[f"- {part}" for part in rule.PREVIEW_PARTS], ""]
        if not rule.preview:
            out += ["In the default mode a finding that does not survive renaming the file's own names (locals, "
                    "`self` attributes) to neutral ones is reported only with `--preview`: it rests on what a "
                    "variable is called, not on what the code does ([Stable and preview](../lint.md#stable-and-"
                    "preview)).", ""]
    elif code not in TOOL_CODES:
        out += ["| static check | status | severity | autofix |", "|---|---|---|---|",
                f"| {_STATIC['no']} | - | error | no |", ""]
    out += [body.strip(), ""]
    if rule is not None and not _has(body, "Fix"):
        out += ["## Fix", "", "No automatic fix: the right rewrite depends on intent, so `--fix` leaves it to you.", ""]
    if rule is not None and not _has(body, "Options"):
        out += ["## Options", "", "Only the shared name lists: `[tool.rlguard.names]` in `pyproject.toml` adds your "
                "own names for the values this rule recognises (see [the linter's guide](../lint.md)).", ""]
    if not _has(body, "Runtime counterpart"):
        out += ["## Runtime counterpart", ""]
        if entry.runtime.strip() in ("", "-"):
            out += ["None: this code is about rlguard reading your files, not about training.", ""]
        else:
            out += [f"At run time rlguard checks: {entry.runtime}.", "",
                    "These checks run in the runtime contracts on your own functions "
                    "([docs/contracts.md](../contracts.md)) and in the preflight suite that performs one real "
                    "update on a copy of your model (`rlguard check`, [docs/preflight.md](../preflight.md)). "
                    f"A violation there carries the same code, `{code}`.", ""]
            from rlguard.rule_docs import RUNTIME

            if code in RUNTIME:
                out += [" ".join(inspect.cleandoc(RUNTIME[code]).split()), ""]
    if not _has(body, "Suppression"):
        out += ["## Suppression", ""]
        if rule is not None:
            other = KL_SIGN if code != KL_SIGN else ENTROPY_BONUS_SIGN
            out += [f"Silence one line with `# noqa: {code}` (several codes: `# noqa: {code}, {other}`; a bare "
                    f"`# noqa` silences every code on the line). For whole files or folders use "
                    f"`per-file-ignores` in `[tool.rlguard]`, or `ignore = [\"{code}\"]` for the project.", ""]
        elif code == PARSE_ERROR:
            out += ["A file that cannot be parsed cannot carry a working `# noqa`. Fix the file, exclude it "
                    "(`exclude` in `[tool.rlguard]`), or add `RLG900` to `ignore` or `per-file-ignores`.", ""]
        else:
            out += ["No lint finding to silence. At run time, use the contracts' modes (`RLGUARD=warn`) "
                    "as described in [docs/contracts.md](../contracts.md).", ""]
    return "\n".join(out).rstrip() + "\n"


def status(rule) -> str:
    """A rule's status as its page and `rlguard rule --list` show it: ``stable``, ``preview``, or
    ``stable/preview`` (stable, with parts in preview)."""
    if rule.preview:
        return "preview"
    return "stable/preview" if rule.PREVIEW_PARTS else "stable"


def list_codes() -> list[tuple[str, str, str, str, str]]:
    """(code, name, static?, status, fix) for every catalog code."""
    rows = []
    for code, entry in CODES.items():
        rule = _rule(code)
        if rule is not None:
            static = {"info": "yes (info)"}.get(entry.static, entry.static)
            fix = "fix" if rule.fixable else ""
            state = status(rule)
        elif code in TOOL_CODES:
            static, fix, state = "yes", "", "stable"
        else:
            static, fix, state = "no (runtime)", "", "-"
        rows.append((code, entry.name, static, state, fix))
    return rows


def write_docs(folder: str | Path) -> list[Path]:
    """Write ``<folder>/<code>.md`` for every catalog code; returns the files written."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for code in CODES:
        target = folder / f"{code}.md"
        page = render_page(code)
        if not target.exists() or target.read_text(encoding="utf-8") != page:
            target.write_text(page, encoding="utf-8")
        written.append(target)
    return written
