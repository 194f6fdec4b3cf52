"""Real fixes: does `rlguard lint` catch real bugs that were shipped and later fixed, and clear their fixes?

Each case of ``realfixes.toml`` is a commit of a public RL-for-LM repository that fixes one catalog fault inside
one function. For every case this script reads both versions of the file from a local bare mirror (see
``snapshots.py``: ``--mirrors DIR`` or ``RLGUARD_MIRRORS``), lints each with ``rlguard.lint.lint_source`` and
scores

  caught   a finding with the case's code inside the function, in the buggy version (the commit's parent);
  cleared  no finding with that code inside the function, in the fixed version (the commit).

It prints a table per code and per repository and the totals. Cases whose mirror or commits are absent are skipped
with a note, so a machine without snapshots runs it as a no-op. No third-party code is stored in the project.

    python benchmarks/realfixes.py --mirrors ~/mirrors              # tables
    python benchmarks/realfixes.py --mirrors ~/mirrors -v           # and one line per case
    python benchmarks/realfixes.py --mirrors ~/mirrors --json       # machine-readable
    python benchmarks/realfixes.py --mirrors ~/mirrors --write      # also update docs/benchmarks.md

Exit status 0: it is a measurement. ``--min-caught 0.6`` (and ``--min-cleared 0.95``) make it a gate that exits 1
when the fraction of replayed cases caught (cleared) is lower.
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import sys
from collections import defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
import snapshots  # noqa: E402

CASES = HERE / "realfixes.toml"
DOC = ROOT / "docs" / "benchmarks.md"
SECTION = "## Real fixes"

# Repositories whose histories are kept for an independent evaluation: no case may come from them.
HELD_OUT = frozenset({"huggingface/trl", "volcengine/verl", "OpenRLHF/OpenRLHF", "PrimeIntellect-ai/prime-rl",
                      "allenai/open-instruct", "CarperAI/trlx"})
REQUIRED = ("id", "repo", "commit", "parent", "path", "function", "code", "description", "verified")
OPTIONAL = ("fixed_path",)
VERIFIED = "read both versions"
SHA = re.compile(r"[0-9a-f]{40}")
# A description is one line of prose: characters that only code needs mark a pasted snippet.
CODE_CHARS = re.compile(r"[=()\[\]{}`\n\\]")


class CaseError(ValueError):
    """A case of the corpus file is malformed; the message names the file and the case."""


@dataclass(frozen=True)
class Case:
    id: str
    repo: str
    commit: str
    parent: str
    path: str
    function: str
    code: str
    description: str
    verified: str
    fixed_path: str | None = None


@dataclass(frozen=True)
class Result:
    id: str
    repo: str
    code: str
    function: str
    caught: bool
    cleared: bool
    buggy_lines: list[int]  # lines of the findings with the case's code inside the function, buggy version
    fixed_lines: list[int]  # the same in the fixed version


def load_cases(path: Path = CASES) -> list[Case]:
    """The cases of ``path``, validated: every field present and well formed, codes in the catalog, ids unique,
    no held-out repository, descriptions one line of prose. Raises :class:`CaseError` naming the case."""
    from rlguard.catalog import CODES

    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise CaseError(f"{path}: cannot read the corpus: {exc}") from exc
    entries = data.get("case")
    if not isinstance(entries, list) or not entries:
        raise CaseError(f"{path}: no [[case]] tables")
    cases, seen = [], set()
    for n, entry in enumerate(entries, 1):
        where = f"{path}: case {n} ({entry.get('id', 'no id')!r})"
        missing = [k for k in REQUIRED if not isinstance(entry.get(k), str) or not entry[k].strip()]
        if missing:
            raise CaseError(f"{where}: missing or empty {', '.join(missing)}")
        unknown = sorted(set(entry) - set(REQUIRED) - set(OPTIONAL))
        if unknown:
            raise CaseError(f"{where}: unknown field(s) {', '.join(unknown)}")
        for key in ("commit", "parent"):
            if not SHA.fullmatch(entry[key]):
                raise CaseError(f"{where}: {key} must be a full 40-hex sha, got {entry[key]!r}")
        if entry["code"] not in CODES:
            raise CaseError(f"{where}: code {entry['code']!r} is not in the catalog")
        if entry["repo"].count("/") != 1:
            raise CaseError(f"{where}: repo must be 'owner/name', got {entry['repo']!r}")
        if entry["repo"] in HELD_OUT:
            raise CaseError(f"{where}: {entry['repo']} is held out for the independent evaluation")
        if entry["verified"] != VERIFIED:
            raise CaseError(f"{where}: verified must be {VERIFIED!r} (set only after reading both versions)")
        if CODE_CHARS.search(entry["description"]):
            raise CaseError(f"{where}: the description must be one line of prose, not code")
        if entry["id"] in seen:
            raise CaseError(f"{where}: duplicate id")
        seen.add(entry["id"])
        cases.append(Case(**{k: entry[k] for k in (*REQUIRED, *OPTIONAL) if k in entry}))
    return cases


PREVIEW = False  # --preview: the preview rules and parts on


def lines_with(source: str, path: str, qualname: str, code: str) -> list[int] | None:
    """Lines of the findings with ``code`` inside ``qualname`` of ``source``; None when the function is absent."""
    from rlguard.lint import lint_source

    spans = snapshots.function_lines(source, qualname)
    if not spans:
        return None
    return sorted(f.line for f in lint_source(source, path, preview=PREVIEW).findings
                  if f.code == code and any(first <= f.line <= last for first, last in spans))


def replay(case: Case, root: Path | None) -> Result | str:
    """The case's result, or a note saying why it was skipped."""
    git_dir = snapshots.find_mirror(root, case.repo)
    if git_dir is None:
        return f"{case.id}: no local mirror of {case.repo}"
    for rev in (case.parent, case.commit):
        if not snapshots.has_commit(git_dir, rev):
            return f"{case.id}: {case.repo} mirror lacks {rev[:12]}"
    fixed_path = case.fixed_path or case.path
    buggy_src = snapshots.show(git_dir, case.parent, case.path)
    fixed_src = snapshots.show(git_dir, case.commit, fixed_path)
    if buggy_src is None or fixed_src is None:
        return f"{case.id}: {case.path} is not in the mirror at both commits"
    buggy = lines_with(buggy_src, case.path, case.function, case.code)
    fixed = lines_with(fixed_src, fixed_path, case.function, case.code)
    if buggy is None or fixed is None:
        return f"{case.id}: function {case.function} not found in both versions of {case.path}"
    return Result(case.id, case.repo, case.code, case.function, bool(buggy), not fixed, buggy, fixed)


def tally(results: list[Result], key) -> list[tuple[str, int, int, int]]:
    groups: dict[str, list[Result]] = defaultdict(list)
    for r in results:
        groups[key(r)].append(r)
    return [(name, len(rs), sum(r.caught for r in rs), sum(r.cleared for r in rs))
            for name, rs in sorted(groups.items())]


def render(results: list[Result], skipped: list[str]) -> str:
    def table(title: str, rows) -> list[str]:
        out = [f"| {title} | cases | caught | cleared |", "|---|---:|---:|---:|"]
        out += [f"| {name} | {n} | {c} | {k} |" for name, n, c, k in rows]
        return out

    n = len(results)
    caught, cleared = sum(r.caught for r in results), sum(r.cleared for r in results)
    lines = table("code", tally(results, lambda r: r.code)) + [""]
    lines += table("repository", tally(results, lambda r: r.repo)) + [""]
    pct = (lambda k: f"{100 * k / n:.0f}%") if n else (lambda k: "-")
    lines.append(f"{n} cases replayed: {caught} caught ({pct(caught)}), {cleared} cleared ({pct(cleared)}); "
                 f"{len(skipped)} skipped.")
    return "\n".join(lines)


def write_doc(table: str, codes: int) -> None:
    body = (f"{SECTION}\n\n`python benchmarks/realfixes.py --mirrors DIR --write` "
            f"({datetime.date.today().isoformat()}): the mined corpus `benchmarks/realfixes.toml`, real fixes of "
            f"{codes} catalog codes from public RL-for-LM repositories (the six precision frameworks' histories "
            f"held out). *Caught*: the case's code is reported inside the enclosing function of the buggy version; "
            f"*cleared*: it is not reported there in the fixed version.\n\n{table}\n")
    snapshots.replace_section(DOC, SECTION, body)


def fraction(value: str) -> float:
    number = float(value)
    if not 0.0 <= number <= 1.0:
        raise argparse.ArgumentTypeError(f"must be a fraction between 0 and 1, got {value}")
    return number


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mirrors", help=f"folder of bare git mirrors (default: ${snapshots.ENV})")
    parser.add_argument("--cases", type=Path, default=CASES, help="corpus file (default: realfixes.toml)")
    parser.add_argument("--only", action="append", help="case id or code (repeatable)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("-v", "--verbose", action="store_true", help="one line per case")
    parser.add_argument("--write", action="store_true", help="update the Real fixes section of docs/benchmarks.md")
    parser.add_argument("--preview", action="store_true", help="lint with the preview rules and parts on")
    parser.add_argument("--min-caught", type=fraction, help="exit 1 when fewer of the replayed cases are caught")
    parser.add_argument("--min-cleared", type=fraction, help="exit 1 when fewer of the replayed cases are cleared")
    args = parser.parse_args(argv)
    global PREVIEW
    PREVIEW = args.preview

    try:
        cases = load_cases(args.cases)
    except CaseError as exc:
        parser.error(str(exc))
    if args.only:
        cases = [c for c in cases if c.id in args.only or c.code in args.only]
    root = snapshots.mirrors_root(args.mirrors)
    results: list[Result] = []
    skipped: list[str] = []
    for case in cases:
        outcome = replay(case, root)
        (skipped if isinstance(outcome, str) else results).append(outcome)

    if args.json:
        print(json.dumps({"results": [asdict(r) for r in results], "skipped": skipped}, indent=2))
    else:
        if skipped:
            print("skipped:", *skipped, sep="\n  ")
        if not results:
            print(f"no case replayed (set --mirrors or ${snapshots.ENV} to a folder of mirrors)")
        else:
            if args.verbose:
                for r in results:
                    mark = f"{'caught' if r.caught else 'missed':6} {'cleared' if r.cleared else 'STILL':7}"
                    print(f"{mark} {r.code} {r.id} ({r.repo}, {r.function})")
            print(render(results, skipped))
    if args.write and results:
        write_doc(render(results, skipped), len({c.code for c in cases}))

    failed = []
    n = len(results)
    if n and args.min_caught is not None and sum(r.caught for r in results) < args.min_caught * n:
        failed.append(f"caught below {args.min_caught:.0%}")
    if n and args.min_cleared is not None and sum(r.cleared for r in results) < args.min_cleared * n:
        failed.append(f"cleared below {args.min_cleared:.0%}")
    for line in failed:
        print("gate:", line, file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
