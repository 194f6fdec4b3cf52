"""A fast necessary condition for a rule's ``triggers`` regex: the literal words any match must contain.

Python's ``re`` scans a case-insensitive alternation such as ``(?i)(old|ref|sampl\\w*)_?log_?p|advantage`` at a
few MB/s, slower than libcst parses; thirteen such triggers over every file cost more than parsing them all.
:func:`requirement` reads the regex's parse tree and returns the words any match must contain, as an and/or
tree (``(old|ref)_?log_?p`` needs "log" and "p" and one of "old", "ref"). Checking them with ``in``
runs at memory speed; the engine runs the regex only on the files that pass. The condition is looser than the
regex (case, word boundaries and order are ignored), never stricter, so a file the regex would match always
passes.
"""

from __future__ import annotations

import re
from functools import lru_cache

try:  # Python 3.11+
    from re import _constants as C
    from re import _parser as P
except ImportError:  # pragma: no cover - Python 3.10
    import sre_constants as C  # type: ignore[no-redef]
    import sre_parse as P  # type: ignore[no-redef]

# A requirement tree: ("word", w) | ("and", children) | ("or", children); None means "anything matches".
Node = tuple


def _and(children: list) -> Node | None:
    kids = [c for c in children if c is not None]
    if not kids:
        return None
    return kids[0] if len(kids) == 1 else ("and", tuple(kids))


def _seq(items) -> Node | None:
    """A sequence matches only if every item does: literal runs become words, the rest recurse."""
    parts: list = []
    run = ""
    for op, arg in items:
        char = _literal_char(op, arg)
        if char is not None:
            run += char
            continue
        if run:
            parts.append(("word", run))
            run = ""
        parts.append(_item(op, arg))
    if run:
        parts.append(("word", run))
    return _and(parts)


def _literal_char(op, arg) -> str | None:
    if op is C.LITERAL:
        return chr(arg).lower()
    if op is C.IN:  # [Rr] -> "r"
        chars = {chr(a).lower() for o, a in arg if o is C.LITERAL}
        if len(chars) == 1 and all(o is C.LITERAL for o, _ in arg):
            return chars.pop()
    return None


def _item(op, arg) -> Node | None:
    if op is C.SUBPATTERN:
        return _seq(arg[-1])
    if op in (C.MAX_REPEAT, C.MIN_REPEAT, getattr(C, "POSSESSIVE_REPEAT", None)):
        low, _high, body = arg
        return _seq(body) if low >= 1 else None
    if op is C.ASSERT:
        direction, body = arg
        return _seq(body) if direction == 1 else None
    if op is getattr(C, "ATOMIC_GROUP", None):
        return _seq(arg)
    if op is C.BRANCH:
        alternatives = [_seq(alt) for alt in arg[1]]
        if any(a is None for a in alternatives):
            return None
        return ("or", tuple(alternatives))
    return None


@lru_cache(maxsize=None)
def requirement(pattern: str, flags: int = 0) -> Node | None:
    """What any match of the regex must contain, as a tree of lower-case words; None when nothing can be said."""
    try:
        return _seq(list(P.parse(pattern, flags)))
    except Exception:  # an exotic pattern: no prefilter
        return None


def _holds(node: Node, lowered: str, memo: dict) -> bool:
    kind, arg = node
    if kind == "word":
        hit = memo.get(arg)
        if hit is None:
            hit = memo[arg] = arg in lowered
        return hit
    if kind == "and":
        return all(_holds(child, lowered, memo) for child in arg)
    return any(_holds(child, lowered, memo) for child in arg)


def may_fire(regex: re.Pattern, lowered: str, memo: dict | None = None) -> bool:
    """Whether ``regex`` could match a text whose lower-cased form is ``lowered``: every word the regex requires
    is there. Looser than the regex (case, ``\\b``, order are ignored), never stricter."""
    node = requirement(regex.pattern, regex.flags & ~re.UNICODE)
    return True if node is None else _holds(node, lowered, {} if memo is None else memo)
