"""The engine decides which rules run on a file with rlguard.lint.triggers.Search, a faster form of
``re.search``: it must give the same answer as the trigger regex on every text, or the engine would skip a file
a rule could flag (or parse one for nothing)."""

from __future__ import annotations

import re
import textwrap

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlguard.lint import all_rules
from rlguard.lint.triggers import Search, required_literal, top_level_branches

RULES = all_rules()


def trigger_patterns(rule) -> tuple[str, ...]:
    return (rule.triggers,) if isinstance(rule.triggers, str) else tuple(rule.triggers)


def regex_fires(rule, text: str) -> bool:
    return all(re.search(pattern, text) for pattern in trigger_patterns(rule))


@pytest.mark.parametrize("code", list(RULES))
def test_may_fire_agrees_with_the_trigger_regex_on_the_rule_examples(code):
    rule = RULES[code]
    for example in [*rule.VALID, *rule.INVALID]:
        text = textwrap.dedent(example.code)
        assert rule.may_fire(text, text.lower()) == regex_fires(rule, text), (code, text)
        assert rule.may_fire(text) == regex_fires(rule, text), (code, text)  # without the lowered text


def _literal_words(pattern: str) -> list[str]:
    return re.findall(r"[A-Za-z_]{2,}", pattern) or ["x"]


@pytest.mark.parametrize("code", list(RULES))
def test_may_fire_agrees_with_the_trigger_regex_on_generated_text(code):
    rule = RULES[code]
    words = sorted({w for p in trigger_patterns(rule) for w in _literal_words(p)})
    pieces = st.one_of(st.sampled_from(words), st.sampled_from(words).map(str.upper),
                       st.sampled_from([" ", "\n", "_", "(", ")", "[:, 1:]", ".", "=", "*", "-", "A", "G", "x"]),
                       st.text(max_size=3))

    @settings(max_examples=80, deadline=None, database=None)
    @given(st.lists(pieces, max_size=12).map("".join))
    def check(text):
        assert rule.may_fire(text, text.lower()) == regex_fires(rule, text), text

    check()


@pytest.mark.parametrize("pattern, texts", [
    (r"\bent\b", ["ent", "x ent", "content", "ent_", "_ent", "(ent)", "entropy", "ént"]),
    (r"(?i)entrop|\bent\b", ["ENTROPY", "Ent", "parent", "a.ent"]),
    (r"foo\b|\b_bar", ["foo", "food", "_bar", "x_bar", " _bar"]),
    (r"\bx*y", ["y", " y", "xy", "ay", ""]),  # an optional character after \b: searched as written
    (r"a|(b|c)d|[|]|\|e", ["a", "bd", "cd", "c", "|", "\\|e", "e"]),
    (r"(?s)(?=.*mask)(?=.*roll\()", ["mask roll(", "roll( mask", "mask"]),
])
def test_search_matches_re_search(pattern, texts):
    search = Search(pattern)
    for text in texts:
        assert search.search(text) == (re.search(pattern, text) is not None), (pattern, text)
        assert search.search(text, text.lower()) == (re.search(pattern, text) is not None), (pattern, text)


@pytest.mark.parametrize("pattern, texts", [
    # a literal after lookbehinds, one inside a case-sensitive group of a case-insensitive pattern, one in a
    # repeated group, one beside an optional group: the prefilter must never reject a text the regex matches
    (r"(?<!cross)(?<!cross_)entrop", ["entropy", "cross_entropy", "ENTROPY", "x entrop", "entro"]),
    (r"(?i)log_?p|(?-i:\breturns\b(?! None))", ["LOG_P", "logp", "returns x", "RETURNS x", "returns None",
                                                 "Return", "ſ returns"]),
    (r"(?i)(?:ab)+cd|adv(?:s\b|_)", ["ABABCD", "abcd", "ADV_", "advs", "adv", "Adv_x", "ſadv_"]),
    (r"(?i)ſtep|kelvin", ["step", "STEP", "\u212aelvin", "KELVIN"]),  # Unicode case folding
    (r"ma?sk\[|==\s*None", ["msk[", "mask[", "x == None", "==None", "= None"]),
])
def test_required_literal_prefilter_never_rejects_a_match(pattern, texts):
    search = Search(pattern)
    for text in texts:
        expected = re.search(pattern, text) is not None
        assert search.search(text) == expected, (pattern, text)
        assert search.search(text, text.lower()) == expected, (pattern, text)


def test_required_literal_finds_the_run_every_match_contains():
    assert required_literal(r"(?<!cross)entrop") == ("entrop", False)
    assert required_literal(r"(?i)value_targets") == ("value_targets", True)
    assert required_literal(r"(?-i:\breturns\b)", re.IGNORECASE) == ("returns", False)
    assert required_literal(r"(?:clamp|clip)\(") == ("cl", False)  # the prefix both branches share
    assert required_literal(r"(?:mean|std)\(") is None  # no branch is required, one "(" is too short
    assert required_literal(r"x(?:abc)?y") is None  # an optional group
    assert required_literal(r"(?:abcd){2}z") == ("abcd", False)


def test_top_level_branches_respect_groups_classes_and_escapes():
    assert top_level_branches(r"a|(b|c)|[|]|\|x") == ["a", "(b|c)", "[|]", r"\|x"]
    assert top_level_branches(r"[]|]|y") == ["[]|]", "y"]
    assert top_level_branches(r"[^]|]|y") == ["[^]|]", "y"]
    assert top_level_branches("abc") == ["abc"]
