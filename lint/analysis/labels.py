"""Branch labels (capability C10): what the string a branch is selected by says it computes.

Mode switches name the statistic a branch should compute: ``if agg == "seq-mean-token-sum":``, ``elif norm ==
"per_group":``, ``case "batch":``. This module reads the label of the branch a node sits in and parses it against
closed vocabularies (how tokens of a sequence are aggregated; over which population a statistic is taken). Rules
compare the label with what the branch visibly computes and report only a contradiction of two known facts; a
label outside the vocabularies, or a node in no labelled branch, says nothing.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import libcst as cst

from rlguard.lint.analysis import semantics as S
from rlguard.lint.analysis.index import key_of


@dataclass(frozen=True)
class BranchLabel:
    """The string literal(s) an if-chain branch (or ``match`` case) is selected by, and the switched variable."""

    subject: str | None  # the compared variable's text key, when it is a name/attribute
    labels: tuple[str, ...]
    branch: cst.CSTNode  # the If / MatchCase whose body holds the node


def _test_labels(test) -> tuple[str | None, tuple[str, ...]] | None:
    """``x == "a"``, ``"a" == x``, ``x in ("a", "b")`` (also inside an ``and``): (x's key, labels)."""
    if isinstance(test, cst.BooleanOperation) and isinstance(test.operator, cst.And):
        return _test_labels(test.left) or _test_labels(test.right)
    if not isinstance(test, cst.Comparison) or len(test.comparisons) != 1:
        return None
    comp = test.comparisons[0]
    left, right = test.left, comp.comparator
    if isinstance(comp.operator, cst.Equal):
        for subject, literal in ((left, right), (right, left)):
            value = S.string_value(literal)
            if value is not None:
                return key_of(subject), (value,)
        return None
    if isinstance(comp.operator, cst.In) and isinstance(right, (cst.Tuple, cst.List, cst.Set)):
        values = tuple(S.string_value(e.value) for e in right.elements)
        if values and all(v is not None for v in values):
            return key_of(left), values  # type: ignore[return-value]
    return None


def branch_label(ctx, node: cst.CSTNode) -> BranchLabel | None:
    """The label of the innermost labelled branch whose *body* holds ``node`` (not its test), within the node's
    function; None when there is none."""
    child = node
    for anc in ctx.ancestors(node):
        if isinstance(anc, (cst.FunctionDef, cst.ClassDef, cst.Lambda)):
            return None
        if isinstance(anc, cst.If) and child is anc.body:
            found = _test_labels(anc.test)
            if found is not None:
                return BranchLabel(found[0], found[1], anc)
        if isinstance(anc, cst.MatchCase) and child is anc.body:
            pattern = anc.pattern
            if isinstance(pattern, cst.MatchValue):
                value = S.string_value(pattern.value)
                if value is not None:
                    match = next((a for a in ctx.ancestors(anc) if isinstance(a, cst.Match)), None)
                    return BranchLabel(key_of(match.subject) if match is not None else None, (value,), anc)
            if isinstance(pattern, cst.MatchOr):
                values = tuple(S.string_value(p.pattern.value) if isinstance(p.pattern, cst.MatchValue) else None
                               for p in pattern.patterns)
                if values and all(v is not None for v in values):
                    match = next((a for a in ctx.ancestors(anc) if isinstance(a, cst.Match)), None)
                    return BranchLabel(key_of(match.subject) if match is not None else None, values, anc)  # type: ignore[arg-type]
        child = anc
    return None


# ----- vocabularies -------------------------------------------------------------------------------------------
_WORD = re.compile(r"[a-z0-9]+")
# how the tokens of one sequence are aggregated: "token-sum", "seq-mean-token-mean", "sum_tokens", "token_avg"
# ("seq-mean-token-sum": the word after "token" decides, before a "<agg>-token" reading of "mean-token")
_TOKEN_AGG = (re.compile(r"(?:^|[^a-z])tokens?[-_ ]?(sum|mean|avg|average)(?:$|[^a-z])"),
              re.compile(r"(?:^|[^a-z])(sum|mean|avg|average)[-_ ]?(?:over[-_ ]?|of[-_ ]?)?tokens(?:$|[^a-z])"))


def token_aggregation(label: str) -> str | None:
    """"sum" or "mean" when the label names how a sequence's tokens are aggregated, else None."""
    for pattern in _TOKEN_AGG:
        found = pattern.search(label.lower())
        if found is not None:
            return "sum" if found.group(1) == "sum" else "mean"
    return None


# ("local" is not here: it also names a per-rank statistic against a "global" all-reduced one)
GROUP_WORDS = frozenset({"group", "grouped", "per_group", "pergroup", "prompt", "per_prompt", "grpo"})
BATCH_WORDS = frozenset({"batch", "global", "whole", "whole_batch", "batch_wide"})


def population(label: str) -> str | None:
    """"group" or "batch" when a normalisation label names the population of its statistic, else None (both or
    neither named, or another vocabulary)."""
    low = label.lower()
    words = set(_WORD.findall(low)) | {low.replace("-", "_").replace(" ", "_")}
    group = bool(words & GROUP_WORDS)
    batch = bool(words & BATCH_WORDS)
    if group == batch:
        return None
    return "group" if group else "batch"


NONE_LABELS = frozenset({"none", "no", "off", "identity", "disabled", "false"})
_SCALING_SUBJECT = re.compile(r"(?i)\w*(scal|norm|std|whiten|standardi[sz])\w*")


def disables_scaling(label: BranchLabel) -> bool:
    """A branch of a scaling/normalisation switch (``scale_rewards``, ``adv_norm``) selected by "none"/"off"."""
    subject = (label.subject or "").rsplit(".", 1)[-1].rsplit("[", 1)[-1].strip("'\"]")
    return bool(label.labels) and all(t.lower() in NONE_LABELS for t in label.labels) and bool(
        _SCALING_SUBJECT.fullmatch(subject))


__all__ = ["BranchLabel", "branch_label", "disables_scaling", "population", "token_aggregation"]
