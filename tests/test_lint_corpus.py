"""The lint corpus: realistic trainer files the rules are measured against.

``tests/lint_corpus/clean/`` holds correct trainers in the styles of the main open RL code bases (TRL, OpenRLHF,
verl, CleanRL, trlx, a minimal RLOO, a multi-turn agent GRPO, a vLLM-sampled GRPO) and one supervised loop that
merely looks RL-ish: with every rule on, none of them may produce a finding.

``tests/lint_corpus/buggy/`` holds small files with one or two seeded catalog bugs each. A bug is annotated with
``# expect: RLG00N`` (several codes: ``# expect: RLG002, RLG003``) at the end of the line where the finding must
be reported: the line of the offending expression or statement. Conventions for bugs that span several lines:

- RLG001: the line whose expression misaligns the mask (the slice, pad, roll or window that builds it); for a
  [B, T] mask used as is with [B, T-1] values, the line that combines them;
- RLG002/RLG003: the assignment of the old/reference log-probs;
- RLG005: the line whose expression has the wrong sign or the wrong min/max;
- RLG006: the line that divides a micro-batch token mean by the number of micro-batches;
- RLG007: the trainer's log-prob line whose temperature differs from the sampler's (the division of the logits
  by the temperature, or the log-softmax of logits left undivided);
- RLG008: the line that makes the alias (or hands the reference's parameters to the optimizer);
- RLG013: the ``optimizer.step()`` with no ``zero_grad`` before it.

The findings of a buggy file, as (line, code) pairs, must equal its annotations exactly with preview on; in the
default (stable) mode they must be a subset of them: a stable rule may leave a bug to its preview part (one whose
role rests on a local variable's name), never report what is not there. Clean files are clean in both modes.

The corpus files are never imported or executed (they import libraries the tests do not install).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from rlguard.lint import all_rules, lint_source

REPO = Path(__file__).resolve().parent.parent
CORPUS = Path(__file__).resolve().parent / "lint_corpus"
CLEAN = sorted((CORPUS / "clean").glob("*.py"))
BUGGY = sorted((CORPUS / "buggy").glob("*.py"))
STATIC_CODES = {f"RLG{n:03d}" for n in range(1, 14)}
_EXPECT = re.compile(r"#\s*expect:\s*(?P<codes>RLG\d{3}(?:\s*,\s*RLG\d{3})*)\s*$")


def _rel(path: Path) -> str:
    """Repository-relative path: what the findings and failure messages show."""
    return path.relative_to(REPO).as_posix()


def expectations(source: str) -> set[tuple[int, str]]:
    """(line, code) for each ``# expect:`` annotation of a source text."""
    expected = set()
    for number, line in enumerate(source.splitlines(), start=1):
        match = _EXPECT.search(line)
        if match:
            expected |= {(number, code.strip()) for code in match.group("codes").split(",")}
    return expected


def _lint(path: Path, preview: bool = True):
    source = path.read_text(encoding="utf-8")
    return source, lint_source(source, _rel(path), rules=list(all_rules().values()), preview=preview)


def _describe(findings) -> str:
    return "\n".join(f"  {f.path}:{f.line}:{f.col}: {f.code} {f.name}: {f.message}" for f in findings)


def _crashes(result) -> list[str]:
    """Rules that raised on the file (a crash hides whatever the rule would have found)."""
    return [f"  {error.describe()}" for error in getattr(result, "errors", [])]


@pytest.mark.parametrize("preview", [False, True], ids=["default", "preview"])
@pytest.mark.parametrize("path", CLEAN, ids=[p.stem for p in CLEAN])
def test_clean_file_has_no_finding(path, preview):
    _, result = _lint(path, preview)
    message = []
    if result.findings:
        message += [f"{_rel(path)} is correct code, yet:", _describe(result.findings)]
    if _crashes(result):
        message += ["rules raised:"] + _crashes(result)
    assert not message, "\n".join(message)


@pytest.mark.parametrize("path", BUGGY, ids=[p.stem for p in BUGGY])
def test_buggy_file_default_findings_are_annotated(path):
    source, result = _lint(path, preview=False)
    expected = expectations(source)
    extra = [f for f in result.findings if (f.line, f.code) not in expected]
    assert not extra, "reported in the default mode, not expected:\n" + _describe(extra)
    assert not _crashes(result), "\n".join(_crashes(result))


@pytest.mark.parametrize("path", BUGGY, ids=[p.stem for p in BUGGY])
def test_buggy_file_findings_match_annotations(path):
    source, result = _lint(path)
    expected = expectations(source)
    found = {(f.line, f.code) for f in result.findings}
    missed = sorted(expected - found)
    extra = [f for f in result.findings if (f.line, f.code) not in expected]
    lines = source.splitlines()
    message = []
    if missed:
        message.append("missed (expected, not reported):")
        message += [f"  {_rel(path)}:{line}: {code}   {lines[line - 1].strip()}" for line, code in missed]
    if extra:
        message.append("reported, not expected:")
        message.append(_describe(extra))
    if _crashes(result):
        message += ["rules raised:"] + _crashes(result)
    assert not message, "\n".join(message)


# The corpus itself: these hold whatever state the rules are in.

def test_corpus_sizes():
    assert 8 <= len(CLEAN) <= 10 and 15 <= len(BUGGY) <= 25


@pytest.mark.parametrize("path", CLEAN + BUGGY, ids=[f"{p.parent.name}-{p.stem}" for p in CLEAN + BUGGY])
def test_corpus_file_is_well_formed(path):
    source = path.read_text(encoding="utf-8")
    compile(source, _rel(path), "exec", dont_inherit=True, flags=0x400)  # parses (ast only, nothing runs)
    assert "import torch" in source
    assert "noqa" not in source, "corpus files must not silence findings"
    n_lines = len(source.splitlines())
    if path.parent.name == "clean":
        assert 80 <= n_lines <= 250, f"{n_lines} lines"
        assert not expectations(source) and "expect:" not in source
    else:
        assert 20 <= n_lines <= 80, f"{n_lines} lines"
        expected = expectations(source)
        assert 1 <= len({code for _, code in expected}) <= 2, "one or two seeded bugs per buggy file"
        assert {code for _, code in expected} <= STATIC_CODES
        # every annotation is well formed (a typo would silently drop an expectation)
        assert source.count("expect:") == len({line for line, _ in expected})


def test_corpus_covers_every_static_code():
    counts = {code: 0 for code in STATIC_CODES}
    for path in BUGGY:
        for code in {code for _, code in expectations(path.read_text(encoding="utf-8"))}:
            counts[code] += 1
    assert all(counts.values()), f"codes without a buggy file: {sorted(c for c, n in counts.items() if not n)}"
    assert sum(n >= 2 for n in counts.values()) >= 10, counts
