"""``# noqa`` comments: found among a file's comment tokens (never inside a string), which findings they silence,
which of their rlguard codes silenced nothing (RLG901), and ``--add-noqa``, which writes them.

Syntax, as in flake8 and ruff: ``# noqa`` silences every code on its line; ``# noqa: RLG001, RLG004``,
``# noqa: RLG001 RLG004`` and ``# noqa:rlg004`` silence the codes named (any case, separated by commas or
spaces). Anything after the codes is free text, by convention ``# noqa: RLG004 - why this is intended``. The
directive may follow other comment text (``# type: ignore  # noqa: RLG004``). Codes of other tools
(``# noqa: E501``) are accepted and left alone.
"""

from __future__ import annotations

import io
import re
import tokenize
from dataclasses import dataclass

NEWLINE = re.compile(r"\r\n|\r|\n")  # the line breaks of Python's tokenizer (str.splitlines knows more)
_CODE = r"[A-Za-z]+[0-9]+\b"
_DIRECTIVE = re.compile(rf"#\s*noqa(?:\s*:\s*(?P<codes>{_CODE}(?:(?:\s*,\s*|\s+){_CODE})*))?", re.IGNORECASE)
_SPLIT = re.compile(r"[\s,]+")


@dataclass(frozen=True)
class Directive:
    """One ``# noqa`` comment: its line, its 1-based columns, and the codes it names (None: every code)."""

    line: int
    col: int
    end_col: int
    codes: frozenset[str] | None

    def silences(self, code: str) -> bool:
        return self.codes is None or code in self.codes


def parse_directive(comment: str) -> tuple[int, int, frozenset[str] | None] | None:
    """``(start, end, codes)`` of the ``# noqa`` directive in a comment's text (0-based offsets), None without
    one. ``codes`` is None for a bare ``# noqa`` (or ``# noqa:`` followed by no code)."""
    if "noqa" not in comment.lower():
        return None
    match = _DIRECTIVE.search(comment)
    if match is None:
        return None
    raw = match.group("codes")
    codes = frozenset(c.upper() for c in _SPLIT.split(raw) if c) if raw else None
    return match.start(), match.end(), codes


def noqa_codes(line: str) -> set[str] | None:
    """Codes a comment's ``# noqa`` silences: None without a directive, an empty set for a bare ``# noqa``."""
    found = parse_directive(line)
    if found is None:
        return None
    return set(found[2]) if found[2] is not None else set()


def lines_of(source: str) -> list[str]:
    """The physical lines as Python's tokenizer numbers them (no line endings)."""
    return NEWLINE.split(source)


def directives(source: str, lowered: str | None = None) -> dict[int, Directive]:
    """The ``# noqa`` directives of a source, by line, read from its comment tokens only: a ``"# noqa"`` inside a
    string literal is not one. Tokenizing stops after the last line that mentions noqa."""
    lowered = source.lower() if lowered is None else lowered
    if "noqa" not in lowered:
        return {}
    lines = lines_of(source)
    wanted = {i for i, text in enumerate(lines, 1) if "noqa" in text.lower()}
    last = max(wanted)
    found: dict[int, Directive] = {}
    try:
        for tok in tokenize.generate_tokens(io.StringIO(source).readline):
            if tok.start[0] > last:
                break
            if tok.type == tokenize.COMMENT and tok.start[0] in wanted:
                _add(found, tok.start[0], tok.start[1], tok.string)
    except (tokenize.TokenError, SyntaxError):
        # A file the tokenizer of this Python cannot read to the end (newer syntax than the running
        # interpreter): for the lines not reached, fall back to the first '#' of the line.
        reached = max(found, default=0)
        for line_no in sorted(n for n in wanted if n > reached):
            text = lines[line_no - 1]
            hash_at = text.find("#")
            if hash_at >= 0:
                _add(found, line_no, hash_at, text[hash_at:])
    return found


def _add(found: dict[int, Directive], line: int, col0: int, comment: str) -> None:
    parsed = parse_directive(comment)
    if parsed is not None:
        start, end, codes = parsed
        found[line] = Directive(line, col0 + start + 1, col0 + end + 1, codes)


def silencing(found: dict[int, Directive], code: str, line: int, end_line: int) -> Directive | None:
    """The directive that silences a finding of ``code`` spanning ``line``-``end_line``: one on its first or
    its last line."""
    for line_no in dict.fromkeys((line, end_line)):
        directive = found.get(line_no)
        if directive is not None and directive.silences(code):
            return directive
    return None


# ----- --add-noqa ------------------------------------------------------------------------------------------------
def commentable_lines(source: str) -> set[int] | None:
    """Lines whose end is outside any string and not a backslash continuation, so a comment can go there;
    None when the tokenizer cannot read the source."""
    lines = lines_of(source)
    blocked: set[int] = set()
    try:
        for tok in tokenize.generate_tokens(io.StringIO(source).readline):
            if tok.start[0] != tok.end[0]:  # a token spanning lines: a triple-quoted string
                blocked.update(range(tok.start[0], tok.end[0]))
    except (tokenize.TokenError, SyntaxError):
        return None
    return {n for n, text in enumerate(lines, 1)
            if n not in blocked and not text.rstrip().endswith("\\")}


def add_directives(source: str, spans: list[tuple[int, int, str]], reason: str = "") -> tuple[str, int, list[int]]:
    """Add ``# noqa: CODES`` (and `` - reason``) for each finding ``(line, end_line, code)``, at the end of its
    first line, or of its last line where the first cannot carry a comment (it ends inside a string or with a
    backslash). A line that already has a directive gets the missing codes added to it; a bare ``# noqa``
    covers all. Returns the new source, how many lines changed, and the lines of the findings that could not
    get a comment."""
    ok = commentable_lines(source)
    existing = directives(source)
    parts = NEWLINE.split(source)
    breaks = NEWLINE.findall(source)
    wanted: dict[int, set[str]] = {}
    refused: list[int] = []
    for line, end_line, code in spans:
        target = next((n for n in (line, end_line) if ok is not None and n in ok and n <= len(parts)), None)
        if target is None:
            refused.append(line)
        else:
            wanted.setdefault(target, set()).add(code)
    changed = 0
    suffix = f" - {reason.strip()}" if reason.strip() else ""
    for line_no in sorted(wanted):
        text = parts[line_no - 1]
        directive = existing.get(line_no)
        if directive is not None:
            if directive.codes is None or wanted[line_no] <= directive.codes:
                continue
            codes = ", ".join(sorted(directive.codes | wanted[line_no]))
            start, end = directive.col - 1, directive.end_col - 1
            parts[line_no - 1] = f"{text[:start]}# noqa: {codes}{text[end:]}"
        else:
            codes = ", ".join(sorted(wanted[line_no]))
            parts[line_no - 1] = f"{text.rstrip()}  # noqa: {codes}{suffix}"
        changed += 1
    out = "".join(part + (breaks[i] if i < len(breaks) else "") for i, part in enumerate(parts))
    return out, changed, sorted(set(refused))
