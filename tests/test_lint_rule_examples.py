"""Every rule's own examples (Fixit style): each VALID snippet yields no finding of that rule (in the default
mode and with preview on), each INVALID snippet at least one, on the pinned line where one is given, and the fixed
source where one is given. An INVALID example marked ``preview`` is found by a preview part of its rule: flagged
with preview on and not in the default mode."""

from __future__ import annotations

import textwrap

import pytest

from rlguard.lint import all_rules, lint_source
from rlguard.lint.rule import CAPABILITIES

RULES = all_rules()
VALID = [pytest.param(rule, ex, id=f"{code}-valid-{i}") for code, rule in RULES.items()
         for i, ex in enumerate(rule.VALID)]
INVALID = [pytest.param(rule, ex, id=f"{code}-invalid-{i}") for code, rule in RULES.items()
           for i, ex in enumerate(rule.INVALID)]


def _lint(rule, code, fix=False, preview=False):
    return lint_source(textwrap.dedent(code), "example.py", rules=[rule], fix=fix, preview=preview)


@pytest.mark.parametrize("preview", [False, True], ids=["default", "preview"])
@pytest.mark.parametrize("rule, example", VALID)
def test_valid_example_is_not_flagged(rule, example, preview):
    result = _lint(rule, example.code, preview=preview)
    assert [f for f in result.findings if f.code == rule.code] == [], example.why


@pytest.mark.parametrize("rule, example", INVALID)
def test_invalid_example_is_flagged(rule, example):
    preview = example.preview or rule.preview
    result = _lint(rule, example.code, preview=preview)
    hits = [f for f in result.findings if f.code == rule.code]
    assert hits, f"{rule.code} missed: {example.why}\n{example.code}"
    if example.line is not None:
        assert example.line in [f.line for f in hits]
    if example.preview:
        default = [f for f in _lint(rule, example.code).findings if f.code == rule.code]
        assert not default, f"{rule.code}: a preview example is flagged without preview: {example.why}"
    if example.fixed is not None:
        fixed = _lint(rule, example.code, fix=True, preview=preview)
        assert fixed.fixed_source == textwrap.dedent(example.fixed)
        assert not [f for f in _lint(rule, fixed.fixed_source, preview=preview).findings if f.code == rule.code]


@pytest.mark.parametrize("code", [c for c, r in RULES.items()])
def test_rule_has_enough_examples(code):
    rule = RULES[code]
    assert len(rule.VALID) >= 6 and len(rule.INVALID) >= 6, f"{code}: needs >= 6 valid and >= 6 invalid examples"


def _tagged(kind, capability):
    return [ex for rule in RULES.values() for ex in getattr(rule, kind) if ex.capability == capability]


# Classes whose examples have not all landed yet. Each is expected to fail, strictly: once a class is covered its
# XPASS fails the run, so it must leave this set; nothing here can hide a class that loses its examples.
PENDING: frozenset[str] = frozenset()


def _expected(capability):
    marks = [pytest.mark.xfail(strict=True, reason="examples of this class not landed yet")] \
        if capability in PENDING else []
    return pytest.param(capability, marks=marks, id=capability)


@pytest.mark.parametrize("capability", [_expected(c) for c in CAPABILITIES if c != "FP"])
def test_every_capability_class_has_flagged_and_clean_examples_in_several_styles(capability):
    flagged, clean = _tagged("INVALID", capability), _tagged("VALID", capability)
    assert len(flagged) >= 6 and len(clean) >= 6, (
        f"{capability} ({CAPABILITIES[capability]}): {len(flagged)} flagged and {len(clean)} clean examples, "
        "needs >= 6 of each")
    for kind, examples in (("flagged", flagged), ("clean", clean)):
        styles = {ex.style for ex in examples if ex.style}
        assert len(styles) >= 3, f"{capability}: {kind} examples in styles {sorted(styles)}, needs >= 3 styles"


@pytest.mark.parametrize("capability", [_expected("FP")])
def test_false_positive_knowledge_has_clean_examples(capability):
    assert len(_tagged("VALID", capability)) >= 6
