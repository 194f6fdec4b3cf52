"""docs/rules/<code>.md is exactly the rendered page of every catalog code (regenerate with
`rlguard rule --write-docs docs/rules`), and each page has the sections a user needs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from rlguard.catalog import CODES, TOOL_CODES
from rlguard.cli import main
from rlguard.lint import all_rules
from rlguard.lint.docs import REQUIRED_SECTIONS, flags_text, render_page
from rlguard.rule_docs import PAGES

DOCS = Path(__file__).resolve().parents[1] / "docs" / "rules"
RULES = all_rules()


def sections(page: str) -> dict[str, str]:
    parts = re.split(r"^## (.+?)\s*$", page, flags=re.MULTILINE)
    return {parts[i]: parts[i + 1].strip() for i in range(1, len(parts) - 1, 2)}


@pytest.mark.parametrize("code", list(CODES))
def test_docs_page_is_up_to_date(code):
    path = DOCS / f"{code}.md"
    assert path.is_file(), f"missing {path.name}: run `rlguard rule --write-docs docs/rules`"
    assert path.read_text(encoding="utf-8") == render_page(code), \
        f"{path.name} is stale: run `rlguard rule --write-docs docs/rules`"


def test_no_stray_pages():
    assert sorted(p.stem for p in DOCS.glob("*.md")) == sorted(CODES)


@pytest.mark.parametrize("code", list(RULES))
def test_rule_page_has_every_section(code):
    page = render_page(code)
    assert page.startswith(f"# {code} {CODES[code].name}\n")
    found = sections(page)
    for name in REQUIRED_SECTIONS:
        assert found.get(name), f"{code}: section '## {name}' missing or empty"
    assert "```python" in found["Example"] and "```python" in found["Use instead"]
    if RULES[code].fixable:
        assert "--fix" in found["Fix"], f"{code} is fixable: its Fix section must say what --fix does"
    else:
        assert re.search(r"(?i)no (automatic|safe|auto-?)\s*fix|not (auto-?)?fix|no --fix|--fix (does not|doesn't|never)",
                         found["Fix"]), f"{code} has no safe fix: its Fix section must say so"
    assert "contracts.md" in found["Runtime counterpart"] and CODES[code].runtime in found["Runtime counterpart"]
    assert f"# noqa: {code}" in found["Suppression"]


@pytest.mark.parametrize("code", sorted(PAGES))
def test_runtime_only_pages(code):
    assert code not in RULES
    found = sections(render_page(code))
    assert {"Example", "Use instead", "Fix", "Options", "Suppression"} <= set(found)
    if code not in TOOL_CODES:  # rlguard's own codes (RLG900-RLG902) are about reading files, not training
        assert "No static check: caught at run time by" in render_page(code)
        assert "preflight.md" in render_page(code) or "contracts.md" in render_page(code)


def test_every_code_has_a_page_body():
    assert set(CODES) == set(RULES) | set(PAGES)


def test_flags_text_is_one_line():
    for code in CODES:
        text = flags_text(code)
        assert text and "\n" not in text


def test_write_docs_command(tmp_path, capsys):
    assert main(["rule", "--write-docs", str(tmp_path)]) == 0
    for code in CODES:
        assert (tmp_path / f"{code}.md").read_text(encoding="utf-8") == render_page(code)
    assert "wrote" in capsys.readouterr().out


def test_every_failure_mode_has_a_constant_named_after_it():
    import rlguard.catalog as catalog

    for code, entry in catalog.CODES.items():
        if code in catalog.TOOL_CODES:
            continue
        constant = entry.name.upper().replace("-", "_")
        assert getattr(catalog, constant, None) == code, f"rlguard.catalog.{constant} should be {code!r}"
