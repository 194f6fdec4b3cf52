"""The engine's prescan (rlguard.lint.prescan) is a necessary condition of each rule's trigger regex: whenever
the regex matches a text, the literal-word check passes, so the fast path never skips a file a rule could flag."""

from __future__ import annotations

import re
import textwrap

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlguard.lint import all_rules
from rlguard.lint.prescan import may_fire, requirement

RULES = all_rules()


def words(node) -> list[str]:
    if node is None:
        return []
    kind, arg = node
    return [arg] if kind == "word" else [w for child in arg for w in words(child)]


@pytest.mark.parametrize("code", list(RULES))
def test_rule_examples_that_match_the_trigger_pass_the_prescan(code):
    rule = RULES[code]
    for example in [*rule.VALID, *rule.INVALID]:
        text = textwrap.dedent(example.code)
        if rule._trigger_re.search(text):
            assert may_fire(rule._trigger_re, text.lower()), (code, text)


@pytest.mark.parametrize("code", list(RULES))
def test_prescan_never_stricter_than_the_trigger(code):
    regex = RULES[code]._trigger_re
    vocabulary = words(requirement(regex.pattern, regex.flags & ~re.UNICODE)) or ["x"]
    pieces = st.one_of(st.sampled_from(vocabulary), st.sampled_from(vocabulary).map(str.upper),
                       st.sampled_from([" ", "\n", "_", "(", ")", "[:, 1:]", ".", "=", "*", "-", "A", "G"]),
                       st.text(max_size=3))

    @settings(max_examples=50, deadline=None, database=None)
    @given(st.lists(pieces, max_size=12).map("".join))
    def check(text):
        if regex.search(text):
            assert may_fire(regex, text.lower()), text

    check()


def test_requirement_tree_shapes():
    assert requirement(r"(?i)entrop|\bent\b") == ("or", (("word", "entrop"), ("word", "ent")))
    assert requirement(r"[Rr]eturns?") == ("word", "return")
    assert requirement(r"a*|b") is None  # an alternative that needs nothing: no prescan
    node = requirement(r"(?s)\A(?=.*mask)(?=.*roll\()")
    assert node == ("and", (("word", "mask"), ("word", "roll(")))
    assert not may_fire(re.compile(r"(?s)\A(?=.*mask)(?=.*roll\()"), "mask only")
    assert may_fire(re.compile(r"(?s)\A(?=.*mask)(?=.*roll\()"), "roll(x) then mask")
