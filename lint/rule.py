"""What a lint rule is: one small class per catalog code, registered by its code, carrying its own examples.

A rule looks at one parsed module through the analysis core (:class:`~rlguard.lint.analysis.Analysis`) and yields
:class:`Violation` objects (a node, a message, optionally a safe replacement for ``--fix``). The engine turns
them into :class:`Finding` records with positions. ``VALID``/``INVALID`` examples on each rule are run by the
tests, as Fixit does: code the rule must not flag, and code it must flag.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar, Iterator

import libcst as cst

from rlguard.catalog import CODES
from rlguard.lint import triggers

if TYPE_CHECKING:
    from rlguard.lint.analysis import Analysis

SEVERITIES = ("error", "warning", "info")


# The capability classes a rule example exercises (docs/lint.md, "What the analysis knows"): the kinds of real
# code the linter must read right, each with flagged and clean examples across the coding styles below.
CAPABILITIES = {
    "C1": "reaching definitions, tuples, effect summaries and failed traces",
    "C2": "roles inferred from use, not from names",
    "C3": "values through dict keys, attributes and records",
    "C4": "a mask and log-probs that meet as arguments of a call",
    "C5": "the caller's loops, grouping and arguments inside a helper",
    "C6": "values from config objects, and symbols when values are unknown",
    "C7": "subscript axes, position-preserving operations, window widths, batch layouts",
    "C8": "framework conventions: response windows, value heads, experience records",
    "C9": "local arithmetic idioms that are wrong in themselves",
    "C10": "mode labels of a branch that contradict what the branch computes",
    "C11": "reference outputs produced by the policy",
    "C12": "library and runtime semantics visible in the module",
    "FP": "false-positive knowledge: correct shapes that look like bugs",
}
STYLES = ("class", "functional", "script", "framework")  # class-based trainer, functions, terse script, dict batches


@dataclass(frozen=True)
class Valid:
    """Source the rule must not flag. ``why`` says what makes it correct (shown when a test fails);
    ``capability`` (a key of :data:`CAPABILITIES`) and ``style`` (one of :data:`STYLES`) say what it exercises."""

    code: str
    why: str = ""
    capability: str | None = None
    style: str | None = None


@dataclass(frozen=True)
class Invalid:
    """Source the rule must flag. ``line`` (1-based, optional) pins the line of the first finding;
    ``fixed`` (optional) is the source after ``--fix``; ``capability`` and ``style`` as for :class:`Valid`."""

    code: str
    line: int | None = None
    fixed: str | None = None
    why: str = ""
    capability: str | None = None
    style: str | None = None
    preview: bool = False  # flagged only with preview on (the finding comes from a preview part of the rule)


@dataclass
class Violation:
    """What a rule reports: the offending node, a message, and optionally a safe rewrite of that node."""

    node: cst.CSTNode
    message: str
    # (old node, new node) pairs; the engine swaps them by identity, keeping formatting and comments.
    replacements: list[tuple[cst.CSTNode, cst.CSTNode]] = field(default_factory=list)
    # Found by a part of the rule whose precision on unseen code is not yet shown (ruff's preview): reported only
    # with `--preview` / `preview = true`. The rule's page says which of its parts are in preview.
    preview: bool = False


@dataclass(frozen=True)
class Finding:
    """One reported problem at a position in a file (lines and columns 1-based)."""

    path: str
    line: int
    col: int
    end_line: int
    end_col: int
    code: str
    name: str
    message: str
    severity: str
    fixable: bool = False

    def sort_key(self) -> tuple:
        return (self.path, self.line, self.col, self.code)

    def as_dict(self) -> dict:
        return {
            "path": self.path, "line": self.line, "col": self.col, "end_line": self.end_line,
            "end_col": self.end_col, "code": self.code, "name": self.name, "message": self.message,
            "severity": self.severity,
        }


class Rule:
    """Base class of every lint rule. Subclasses set the class attributes and implement :meth:`check`."""

    code: ClassVar[str]
    name: ClassVar[str]  # set from the catalog
    severity: ClassVar[str] = "error"
    # Regular expression over the raw source: when it does not match, the rule cannot fire on that file and
    # is not run (the engine skips parsing a file no selected rule can fire on).
    triggers: ClassVar[str | tuple[str, ...]]  # a tuple: every pattern must match
    # Whether `--fix` can rewrite what this rule flags; a rule without a safe fix says so in its docs.
    fixable: ClassVar[bool] = False
    # The whole rule is in preview: it runs only with `--preview` (or `preview = true` in [tool.rlguard]). A rule
    # is stable when the ecosystem check shows it no FALSE finding, validation precision >= 95%, and renaming a
    # file's own identifiers changes none of its findings (docs/lint.md, "Stable and preview").
    preview: ClassVar[bool] = False
    # What of a stable rule is in preview (shown on its page): the heuristics that yield Violation(preview=True).
    PREVIEW_PARTS: ClassVar[tuple[str, ...]] = ()
    VALID: ClassVar[list[Valid]] = []
    INVALID: ClassVar[list[Invalid]] = []

    _parts: ClassVar[tuple]

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if cls.code not in CODES:
            raise TypeError(f"rule {cls.__name__} has code {cls.code!r}, which is not in the catalog")
        if cls.severity not in SEVERITIES:
            raise TypeError(f"rule {cls.__name__}: severity must be one of {SEVERITIES}")
        cls.name = CODES[cls.code].name
        for example in [*cls.VALID, *cls.INVALID]:
            if example.capability is not None and example.capability not in CAPABILITIES:
                raise TypeError(f"rule {cls.__name__}: example capability {example.capability!r} is not one of "
                                f"{sorted(CAPABILITIES)}")
            if example.style is not None and example.style not in STYLES:
                raise TypeError(f"rule {cls.__name__}: example style {example.style!r} is not one of {STYLES}")
        parts = (cls.triggers,) if isinstance(cls.triggers, str) else tuple(cls.triggers)
        # A part that ignores case and spells its literals in lower case is run, without the flag, on the
        # lower-cased text: the same matches, at literal-scan speed (re optimises little under IGNORECASE).
        cls._parts = tuple(_lowered(p) for p in parts)
        register(cls)

    @classmethod
    def may_fire(cls, source: str, lowered: str | None = None) -> bool:
        """Whether every trigger pattern matches ``source`` (``lowered``: its lower-cased text, when known)."""
        for search, on_lowered in cls._parts:
            if on_lowered and lowered is None:
                lowered = source.lower()
            if not (search.search(lowered) if on_lowered else search.search(source, lowered)):
                return False
        return True

    def check(self, ctx: "Analysis") -> Iterator[Violation]:
        raise NotImplementedError


def _lowered(pattern: str) -> tuple[triggers.Search, bool]:
    body = pattern[4:] if pattern.startswith("(?i)") else None
    if body is not None and body == body.lower():
        return triggers.Search(body), True
    return triggers.Search(pattern), False


REGISTRY: dict[str, type[Rule]] = {}


def register(rule: type[Rule]) -> None:
    if rule.code in REGISTRY and REGISTRY[rule.code] is not rule:
        raise TypeError(f"two rules claim {rule.code}: {REGISTRY[rule.code].__name__} and {rule.__name__}")
    REGISTRY[rule.code] = rule


def all_rules() -> dict[str, type[Rule]]:
    """Every registered rule by code (importing the rule modules registers them)."""
    import rlguard.lint.rules  # noqa: F401 - registers the rules

    return dict(sorted(REGISTRY.items()))
