"""Ecosystem check: lint public RL repositories at pinned commits, as a new user would, and hold every finding to a
reviewed verdict (in the manner of mypy_primer and ruff's ecosystem CI).

The repositories, their commits and the split into parts (development, validation, and a later holdout) are in ``ecosystem.toml`` (the split was made
once, before tuning, and is kept). Verdicts live in one file, ``ecosystem_verdicts.toml``: one per finding key
``"<name>:<path>:<function>:<code>"`` with ``verdict = "TRUE" | "FALSE" | "DEBATABLE"`` and a one-line ``reason``
judged by reading the code. Snapshots come from local bare mirrors (``--mirrors DIR`` or ``RLGUARD_MIRRORS``; see
``snapshots.py``); an absent one is skipped with the command that gets it. No third-party code is stored in the
project: the ``.py`` files of each snapshot are extracted into ``--work`` (ignored by git).

    python benchmarks/ecosystem.py --mirrors DIR                 # table per repository and code, unjudged/FALSE
    python benchmarks/ecosystem.py --mirrors DIR --preview       # the same with the preview rules on
    python benchmarks/ecosystem.py --mirrors DIR --part validation -v   # every finding with its verdict
    python benchmarks/ecosystem.py --mirrors DIR --diff HEAD~1   # findings this tree adds/removes against a revision
    python benchmarks/ecosystem.py --mirrors DIR --rev HEAD      # lint with rlguard as committed, not the tree
    python benchmarks/ecosystem.py --mirrors DIR --write         # also update docs/benchmarks.md

Each lint runs in a subprocess on a given revision of rlguard's linter (the working tree by default), and its
findings are cached under ``--work`` by snapshot commit, linter version (a hash of the linter's sources) and rule
set, so a rerun, or the base side of ``--diff``, costs nothing the second time.

Exit status: 0 when no finding is unjudged or judged FALSE (in the set that ran) and no TRUE verdict is lost;
1 otherwise; 0 with a note when no snapshot is available.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
import snapshots  # noqa: E402

from rlguard.lint import neutral  # noqa: E402

REPOS = HERE / "ecosystem.toml"
# development: tuned on; validation: judged, never tuned on; holdout: added later, only measured (ecosystem.toml)
PARTS = ("development", "validation", "holdout")
VERDICTS = HERE / "ecosystem_verdicts.toml"
DOC = ROOT / "docs" / "benchmarks.md"
SECTION = "## Ecosystem"
# What the linter's behaviour depends on: its package and the catalog it reads codes from.
LINTER_SOURCES = ("lint", "rlguard")
VERDICT_LABELS = ("TRUE", "FALSE", "DEBATABLE")


@dataclass(frozen=True)
class Hit:
    repo: str
    path: str
    line: int
    code: str
    function: str
    message: str
    text: str  # the source line, stripped

    @property
    def key(self) -> str:
        return f"{self.repo}:{self.path}:{self.function}:{self.code}"


def load_toml(path: Path) -> dict:
    return tomllib.loads(path.read_text(encoding="utf-8"))


def load_repos() -> list[dict]:
    repos = load_toml(REPOS)["repo"]
    for entry in repos:
        if entry.get("part") not in PARTS:
            raise SystemExit(f"{REPOS.name}: repository {entry.get('name')!r} has no part ({', '.join(PARTS)})")
    return repos


def load_verdicts(path: Path) -> dict[str, dict]:
    if not path.exists():
        return {}
    verdicts = load_toml(path).get("verdicts", {})
    for key, value in verdicts.items():
        if value.get("verdict") not in VERDICT_LABELS or not value.get("reason"):
            raise SystemExit(f"{path.name}: verdict for {key!r} needs verdict in {VERDICT_LABELS} and a reason")
    return verdicts


# ----- the linter at a revision ----------------------------------------------------------------------------------

def linter_tree(rev: str | None, work: Path) -> tuple[Path | None, str]:
    """A folder to put on ``PYTHONPATH`` that imports as the ``rlguard`` linter of ``rev`` (None: the working
    tree, already importable), and the linter version string the cache is keyed by."""
    if rev is None:
        digest = hashlib.sha256()
        for top in LINTER_SOURCES:
            for path in sorted((ROOT / top).rglob("*.py")):
                digest.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes())
        return None, "tree-" + digest.hexdigest()[:16]
    sha = subprocess.run(["git", "-C", str(ROOT), "rev-parse", f"{rev}^{{commit}}"], check=True,
                         capture_output=True, text=True).stdout.strip()
    dest = work / "linters" / sha
    if not (dest / ".complete").exists():
        shutil.rmtree(dest, ignore_errors=True)
        (dest / "rlguard").mkdir(parents=True)
        # The distribution maps top-level folders into the rlguard namespace (pyproject's package-dir):
        # rebuild that layout for the two the linter needs.
        for top, into in (("rlguard", dest), ("lint", dest / "rlguard")):
            archive = subprocess.run(["git", "-C", str(ROOT), "archive", sha, top], check=True,
                                     capture_output=True).stdout
            subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
        (dest / ".complete").write_text(sha)
    return dest, "rev-" + sha[:16]


WORKER = r"""
import json, os, sys
from rlguard.lint.config import Layer, load_config
from rlguard.lint.runner import run
tree, preview, jobs = sys.argv[1], sys.argv[2] == "1", int(sys.argv[3])
kwargs = {"preview": True} if preview else {}
try:
    layer = Layer(select=("ALL",), **kwargs)
except TypeError:  # a revision without preview rules
    layer = Layer(select=("ALL",))
config = load_config([tree], cli=layer, isolated=True)
os.chdir(tree)
report = run(["."], config, jobs=jobs, cache=False)
out = {"files": report.files_checked,
       "findings": [dict(f.as_dict(), path=f.path.removeprefix("./")) for f in report.findings],
       "errors": [e.describe() for e in report.errors]}
json.dump(out, sys.stdout)
"""


def lint_snapshot(tree: Path, pythonpath: Path | None, version: str, preview: bool, jobs: int,
                  cache_dir: Path, commit: str) -> tuple[dict, float, bool]:
    """Lint ``tree`` with the linter on ``pythonpath``; the JSON result, seconds, whether it came from cache."""
    key = hashlib.sha256(f"{commit}|{version}|preview={preview}".encode()).hexdigest()[:24]
    cached = cache_dir / f"{key}.json"
    if cached.exists():
        try:
            data = json.loads(cached.read_text())
            return data, data.get("seconds", 0.0), True
        except ValueError:
            cached.unlink()
    env = dict(os.environ)
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", WORKER, str(tree), "1" if preview else "0", str(jobs)],
                          capture_output=True, text=True, env=env, cwd=str(tree))
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"linting {tree} failed:\n{proc.stderr[-3000:]}")
    data = json.loads(proc.stdout)
    data["seconds"] = seconds
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = cached.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    tmp.replace(cached)
    return data, seconds, False


def hits_of(name: str, tree: Path, data: dict) -> list[Hit]:
    spans: dict[str, list] = {}
    lines: dict[str, list[str]] = {}
    hits = []
    for f in data["findings"]:
        path = f["path"]
        if path not in spans:
            source = (tree / path).read_text(encoding="utf-8", errors="replace")
            spans[path] = snapshots.enclosing_functions(source)
            lines[path] = source.splitlines()
        text = lines[path][f["line"] - 1].strip() if 0 < f["line"] <= len(lines[path]) else ""
        hits.append(Hit(name, path, f["line"], f["code"], neutral.function_at(spans[path], f["line"]), f["message"], text))
    return hits


@dataclass
class RepoRun:
    entry: dict
    files: int
    seconds: float
    hits: list[Hit]
    errors: list[str]


def lint_all(repos: list[dict], root: Path | None, work: Path, rev: str | None, preview: bool, jobs: int,
             quiet: bool = False) -> tuple[list[RepoRun], list[str]]:
    pythonpath, version = linter_tree(rev, work)
    runs, skipped = [], []
    for entry in repos:
        git_dir = snapshots.find_mirror(root, entry["repo"])
        if git_dir is None or not snapshots.has_commit(git_dir, entry["commit"]):
            skipped.append(f"{entry['name']}: no local mirror of {entry['repo']} with commit {entry['commit'][:12]} "
                           f"(get one with the search tool's fetch, or git clone --mirror "
                           f"https://github.com/{entry['repo']} <mirrors>/{entry['repo'].replace('/', '+')})")
            continue
        tree = work / "trees" / f"{entry['name']}-{entry['commit'][:12]}"
        snapshots.extract_python(git_dir, entry["commit"], tree)
        data, seconds, from_cache = lint_snapshot(tree, pythonpath, version, preview, jobs, work / "cache",
                                                  entry["commit"])
        if not quiet:
            print(f"  {entry['name']}: {data['files']} files, {len(data['findings'])} findings"
                  f"{' (cached)' if from_cache else f', {seconds:.1f} s'}", file=sys.stderr)
        runs.append(RepoRun(entry, data["files"], seconds, hits_of(entry["name"], tree, data), data["errors"]))
    return runs, skipped


# ----- reports ---------------------------------------------------------------------------------------------------

def verdict_of(verdicts: dict, hit: Hit) -> str:
    v = verdicts.get(hit.key)
    return v["verdict"] if v else "UNJUDGED"


def precision(counts: Counter) -> str:
    judged = counts["TRUE"] + counts["FALSE"]
    return f"{100 * counts['TRUE'] / judged:.0f}%" if judged else "n/a"


def render_table(runs: list[RepoRun], verdicts: dict) -> str:
    codes = sorted({h.code for r in runs for h in r.hits})
    head = ("| part | repository | commit | files | findings | TRUE | FALSE | DEBATABLE | unjudged | "
            + " | ".join(codes) + " |")
    lines = [head, "|" + "---|" * (9 + len(codes))]
    totals: dict[str, Counter] = defaultdict(Counter)
    for run in sorted(runs, key=lambda r: (r.entry["part"], r.entry["name"].lower())):
        per = Counter(h.code for h in run.hits)
        judged = Counter(verdict_of(verdicts, h) for h in run.hits)
        totals[run.entry["part"]].update(judged)
        totals[run.entry["part"]]["files"] += run.files
        totals[run.entry["part"]]["findings"] += len(run.hits)
        cells = " | ".join(str(per.get(c, "")) for c in codes)
        lines.append(f"| {run.entry['part'][:3]} | {run.entry['name']} | `{run.entry['commit'][:9]}` | {run.files} | "
                     f"{len(run.hits)} | {judged['TRUE']} | {judged['FALSE']} | {judged['DEBATABLE']} | "
                     f"{judged['UNJUDGED']} | {cells} |")
    lines.append("")
    for part in PARTS:
        t = totals.get(part)
        if t is None:
            continue
        lines.append(f"- {part}: {t['files']} files, {t['findings']} findings: {t['TRUE']} TRUE, {t['FALSE']} FALSE, "
                     f"{t['DEBATABLE']} DEBATABLE, {t['UNJUDGED']} unjudged; precision TRUE/(TRUE+FALSE) "
                     f"{precision(t)}")
    return "\n".join(lines)


def print_diff(base: list[RepoRun], head: list[RepoRun], verdicts: dict) -> int:
    def index(runs):
        return {(h.key, h.line): h for r in runs for h in r.hits}

    before, after = index(base), index(head)
    # A finding that only moved lines (same key, count unchanged) is not a change.
    count_before = Counter(k for k, _ in before)
    count_after = Counter(k for k, _ in after)
    added = [h for (k, line), h in after.items() if (k, line) not in before and count_after[k] > count_before[k]]
    removed = [h for (k, line), h in before.items() if (k, line) not in after and count_before[k] > count_after[k]]
    for label, hits in (("added", added), ("removed", removed)):
        print(f"\n{len(hits)} findings {label}:")
        for h in sorted(hits, key=lambda h: (h.repo, h.path, h.line)):
            print(f"  {'+' if label == 'added' else '-'} [{verdict_of(verdicts, h)}] {h.repo}:{h.path}:{h.line} "
                  f"{h.code} in {h.function}\n      {h.text}\n      {h.message}")
    return len(added) + len(removed)


def write_doc(table: str, preview: bool) -> None:
    section = SECTION + (" (preview rules on)" if preview else "")
    flag = " --preview" if preview else ""
    body = (f"{section}\n\n`python benchmarks/ecosystem.py --mirrors DIR{flag} --write` "
            f"({datetime.date.today().isoformat()}): every finding on the pinned snapshots of "
            f"`benchmarks/ecosystem.toml`, held to the verdicts in `benchmarks/ecosystem_verdicts.toml`.\n\n"
            f"{table}\n")
    snapshots.replace_section(DOC, section, body)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mirrors", help=f"folder of bare git mirrors (default: ${snapshots.ENV})")
    parser.add_argument("--work", default=str(ROOT / ".rlguard_ecosystem"), help="snapshots and cache")
    parser.add_argument("--only", action="append", help="repository short name (repeatable)")
    parser.add_argument("--part", choices=PARTS, help="one part of the split only")
    parser.add_argument("--preview", action="store_true", help="turn the preview rules on")
    parser.add_argument("--diff", metavar="REV", help="list the findings added/removed relative to rlguard at REV")
    parser.add_argument("--rev", metavar="REV", help="lint with rlguard at REV (a commit of this repository) instead "
                                                     "of the working tree")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--verdicts", default=str(VERDICTS))
    parser.add_argument("-v", "--verbose", action="store_true", help="list every finding with its verdict")
    parser.add_argument("--json", metavar="FILE", help="write every finding with its verdict to FILE")
    parser.add_argument("--write", action="store_true", help="update the Ecosystem section of docs/benchmarks.md")
    args = parser.parse_args(argv)

    root = snapshots.mirrors_root(args.mirrors)
    repos = [r for r in load_repos() if (not args.only or r["name"] in args.only)
             and (not args.part or r["part"] == args.part)]
    verdicts = load_verdicts(Path(args.verdicts))
    work = Path(args.work)
    runs, skipped = lint_all(repos, root, work, args.rev, args.preview, args.jobs)
    if skipped:
        print("skipped:", *skipped, sep="\n  ")
    if not runs:
        print(f"no snapshot available: nothing checked (set --mirrors or ${snapshots.ENV})")
        return 0

    hits = [h for r in runs for h in r.hits]
    problems = []
    for hit in hits:
        label = verdict_of(verdicts, hit)
        reason = verdicts.get(hit.key, {}).get("reason", "")
        if label in ("UNJUDGED", "FALSE"):
            problems.append(f"{label}: {hit.key} (line {hit.line}): {hit.text}\n      {hit.message}"
                            + (f"\n      verdict: {reason}" if reason else ""))
        if args.verbose:
            print(f"[{label}] {hit.repo}:{hit.path}:{hit.line} {hit.code} in {hit.function}"
                  + (f" -- {reason}" if reason else ""))
    present = {h.key for h in hits}
    names = {r.entry["name"] for r in runs}
    lost = [k for k, v in verdicts.items() if v["verdict"] == "TRUE" and k.split(":", 1)[0] in names
            and k not in present and (args.preview or not v.get("preview"))]
    problems += [f"LOST: {k} (judged TRUE, no longer reported)" for k in lost]
    errors = [f"{r.entry['name']}: {e}" for r in runs for e in r.errors]

    table = render_table(runs, verdicts)
    print(table)
    for line in errors:
        print("internal error:", line)
    for line in problems:
        print(line)
    if args.json:
        Path(args.json).write_text(json.dumps([dict(vars(h), key=h.key, verdict=verdict_of(verdicts, h))
                                               for h in hits], indent=1))
    if args.diff:
        base, _ = lint_all(repos, root, work, args.diff, args.preview, args.jobs)
        print_diff(base, runs, verdicts)
    if args.write:
        write_doc(table, args.preview)
    return 1 if problems or errors else 0


if __name__ == "__main__":
    sys.exit(main())
