"""Fast trigger searches: whether a rule's trigger regex matches a file, decided before the file is parsed.

Python's ``re`` finds a literal prefix at memory speed, but it scans an alternation such as
``log_?p|adv|\\breturns\\b``, or any branch that opens with ``\\b``, one position at a time: thirteen such
triggers over every file cost more than parsing the files that pass them. :class:`Search` gives the same answer
as ``re.search`` (the tests compare them) with each outermost alternative searched on its own, literal-prefixed
ones first, and a leading ``\\b`` checked on the matches of the rest of the branch.
"""

from __future__ import annotations

import re
import re._constants as _sre
import re._parser as _sre_parse


def required_literal(pattern: str, flags: int = 0) -> tuple[str, bool] | None:
    """The longest run of literal characters every match of ``pattern`` contains, and whether case-insensitive
    matching applies to some of its letters (then the run is given lower-cased, to be looked for in the
    lower-cased text); None when there is no run of two characters or more. ``needle in text`` is far cheaper
    than a regex scan, so a text without the run is rejected before the scan."""
    try:
        tree = _sre_parse.parse(pattern, flags)
    except Exception:
        return None
    best: tuple[str, bool] = ("", False)

    def sequence(items, ignore_case: bool) -> None:
        nonlocal best
        run, folded = "", False
        for op, arg in items:
            if op is _sre.LITERAL:
                char = chr(arg)
                run += char
                folded = folded or (ignore_case and char.lower() != char.upper())
                continue
            if len(run) > len(best[0]):
                best = (run, folded)
            run, folded = "", False
            if op is _sre.SUBPATTERN:  # a group is matched whole: its own literals are required too
                _, add, remove, inner = arg
                sequence(inner, (ignore_case or bool(add & re.IGNORECASE)) and not remove & re.IGNORECASE)
            elif op in (_sre.MAX_REPEAT, _sre.MIN_REPEAT) and arg[0] >= 1:
                sequence(arg[2], ignore_case)
        if len(run) > len(best[0]):
            best = (run, folded)

    sequence(list(tree), bool(tree.state.flags & re.IGNORECASE))
    needle, folded = best
    if len(needle) < 2 or (folded and not needle.isascii()):
        return None
    return (needle.lower(), True) if folded else (needle, False)


def top_level_branches(pattern: str) -> list[str]:
    """The alternatives of a regex's outermost ``|`` (outside groups and classes), or ``[pattern]``."""
    branches, depth, in_class, start, i = [], 0, False, 0, 0
    while i < len(pattern):
        char = pattern[i]
        if char == "\\":
            i += 2
            continue
        if in_class:
            in_class = char != "]" or i == class_start + 1
        elif char == "[":
            in_class, class_start = True, i
            if pattern.startswith("^", i + 1):
                class_start += 1
        elif char == "(":
            depth += 1
        elif char == ")":
            depth -= 1
        elif char == "|" and depth == 0:
            branches.append(pattern[start:i])
            start = i + 1
        i += 1
    branches.append(pattern[start:])
    return branches


_WORD_START = re.compile(r"\\b(?=[A-Za-z0-9_](?![*?{]))")  # a word character that must be there


class Search:
    """``re.compile(pattern, flags).search(text) is not None``, faster. ``re`` finds a literal prefix at
    memory speed but scans an alternation, or a branch that opens with ``\\b``, one position at a time, several
    times slower than libcst parses. So each outermost alternative is searched on its own, and one that opens
    with ``\\b`` before a word character is searched without it, its matches then checked for the boundary.
    Patterns with leading global flags other than ``(?i)`` are searched as they are."""

    def __init__(self, pattern: str, flags: int = 0):
        self.pattern = pattern
        self._whole = re.compile(pattern, flags)
        prefix = re.match(r"\(\?i\)", pattern)
        if prefix:
            flags |= re.IGNORECASE
            pattern = pattern[prefix.end():]
        self._branches: list[tuple[re.Pattern, bool, tuple[str, bool] | None]] | None = None
        self._needle: tuple[str, bool] | None = None
        if not pattern.startswith("(?"):
            branches = []
            for branch in top_level_branches(pattern):
                bounded = _WORD_START.match(branch) is not None
                body = branch[2:] if bounded else branch
                branches.append((re.compile(body, flags), bounded, required_literal(body, flags)))
            # the literal-prefixed branches first: they are the cheap ones
            self._branches = sorted(branches, key=lambda b: b[1])
        else:
            self._needle = required_literal(self.pattern, flags & ~re.IGNORECASE if prefix else flags)

    def search(self, text: str, lowered: str | None = None) -> bool:
        """``lowered``: ``text.lower()`` when the caller has it; lets case-insensitive branches be rejected by a
        literal they need (for ASCII text only: under Unicode case folding ``ſ`` matches ``s``)."""
        folded_text = lowered if lowered is not None and text.isascii() else None
        if self._branches is None:
            if self._needle is not None and _absent(self._needle, text, folded_text):
                return False
            return self._whole.search(text) is not None
        for regex, bounded, needle in self._branches:
            if needle is not None and _absent(needle, text, folded_text):
                continue  # a literal every match contains is absent
            if not bounded:
                if regex.search(text) is not None:
                    return True
                continue
            for match in regex.finditer(text):
                start = match.start()
                if start == 0 or not (text[start - 1].isalnum() or text[start - 1] == "_"):
                    return True
        return False


def _absent(needle: tuple[str, bool], text: str, folded_text: str | None) -> bool:
    """Whether the required literal is surely missing from the text."""
    literal, folded = needle
    if not folded:
        return literal not in text
    return folded_text is not None and literal not in folded_text
