"""Fast trigger searches: whether a rule's trigger regex matches a file, decided before the file is parsed.

Python's ``re`` finds a literal prefix at memory speed, but it scans an alternation such as
``log_?p|adv|\\breturns\\b``, or any branch that opens with ``\\b``, one position at a time: thirteen such
triggers over every file cost more than parsing the files that pass them. :class:`Search` gives the same answer
as ``re.search`` (the tests compare them) with each outermost alternative searched on its own, literal-prefixed
ones first, and a leading ``\\b`` checked on the matches of the rest of the branch.
"""

from __future__ import annotations

import re


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
        self._branches: list[tuple[re.Pattern, bool]] | None = None
        if not pattern.startswith("(?"):
            branches = []
            for branch in top_level_branches(pattern):
                bounded = _WORD_START.match(branch) is not None
                branches.append((re.compile(branch[2:] if bounded else branch, flags), bounded))
            # the literal-prefixed branches first: they are the cheap ones
            self._branches = sorted(branches, key=lambda b: b[1])

    def search(self, text: str) -> bool:
        if self._branches is None:
            return self._whole.search(text) is not None
        for regex, bounded in self._branches:
            if not bounded:
                if regex.search(text) is not None:
                    return True
                continue
            for match in regex.finditer(text):
                start = match.start()
                if start == 0 or not (text[start - 1].isalnum() or text[start - 1] == "_"):
                    return True
        return False
