"""Real-code harness: lint pinned snapshots of public RL codebases and hold every finding to a reviewed verdict.

The repositories and commits are listed in ``realcode.toml``; the reviewed verdicts in ``realcode_verdicts.toml``
(``"<name>:<path>:<function>:<code>" = {verdict = "TRUE" | "FALSE", reason = "..."}``, one per finding key, judged
by reading the code). Snapshots are read from local bare mirrors (see ``snapshots.py``: ``--mirrors DIR`` or
``RLGUARD_MIRRORS``), their ``.py`` files extracted once into ``--work`` (default ``.rlguard_realcode/``, ignored
by git). No third-party code is stored in the project.

    python benchmarks/realcode.py --mirrors ~/mirrors                  # table + verdict check
    python benchmarks/realcode.py --mirrors ~/mirrors --only trl -v   # list every finding with its verdict
    python benchmarks/realcode.py --mirrors ~/mirrors --write         # also update docs/benchmarks.md

Exit status: 0 when every finding has a TRUE verdict and every TRUE verdict is still found; 1 when a finding has
no verdict, is judged FALSE, or a TRUE verdict is no longer reported (a lost true finding); 0 with a note when no
snapshot is available (nothing to check on this machine).
"""

from __future__ import annotations

import argparse
import datetime
import os
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

REPOS = HERE / "realcode.toml"
VERDICTS = HERE / "realcode_verdicts.toml"
DOC = ROOT / "docs" / "benchmarks.md"
SECTION = "## Real code"


@dataclass(frozen=True)
class Hit:
    repo: str  # short name from realcode.toml
    path: str  # inside the repository
    line: int
    code: str
    function: str
    message: str

    @property
    def key(self) -> str:
        return f"{self.repo}:{self.path}:{self.function}:{self.code}"


def load_toml(path: Path) -> dict:
    return tomllib.loads(path.read_text(encoding="utf-8"))


def function_at(spans: list[tuple[int, int, str]], line: int) -> str:
    inside = [s for s in spans if s[0] <= line <= s[1]]
    return max(inside, key=lambda s: s[0])[2] if inside else "<module>"


def lint_snapshot(name: str, tree: Path, jobs: int, select: tuple[str, ...] = ("ALL",)
                  ) -> tuple[list[Hit], int, float, list[str]]:
    from rlguard.lint.config import Layer, load_config
    from rlguard.lint.runner import run

    config = load_config([tree], cli=Layer(select=select), isolated=True)
    start = time.perf_counter()
    cwd = os.getcwd()
    os.chdir(tree)  # findings' paths relative to the repository root
    try:
        report = run(["."], config, jobs=jobs, cache=False)
    finally:
        os.chdir(cwd)
    elapsed = time.perf_counter() - start
    spans: dict[str, list] = {}
    hits = []
    for f in report.findings:
        path = f.path.removeprefix("./")
        if path not in spans:
            spans[path] = snapshots.enclosing_functions((tree / path).read_text(encoding="utf-8", errors="replace"))
        hits.append(Hit(name, path, f.line, f.code, function_at(spans[path], f.line), f.message))
    errors = [e.describe() for e in report.errors]
    return hits, report.files_checked, elapsed, errors


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mirrors", help=f"folder of bare git mirrors (default: ${snapshots.ENV})")
    parser.add_argument("--work", default=str(ROOT / ".rlguard_realcode"), help="where snapshots are extracted")
    parser.add_argument("--only", action="append", help="repository short name (repeatable)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--verdicts", default=str(VERDICTS))
    parser.add_argument("--select", default="ALL", help="comma-separated codes to run (default: all); verdicts of "
                                                         "codes not run are not checked for being still reported")
    parser.add_argument("-v", "--verbose", action="store_true", help="list every finding with its verdict")
    parser.add_argument("--write", action="store_true", help="update the Real code section of docs/benchmarks.md")
    args = parser.parse_args(argv)

    root = snapshots.mirrors_root(args.mirrors)
    repos = [r for r in load_toml(REPOS)["repo"] if not args.only or r["name"] in args.only]
    verdicts: dict[str, dict] = load_toml(Path(args.verdicts)).get("verdicts", {}) if Path(args.verdicts).exists() else {}
    rows, hits, skipped, errors = [], [], [], []
    for entry in repos:
        git_dir = snapshots.find_mirror(root, entry["repo"])
        if git_dir is None or not snapshots.has_commit(git_dir, entry["commit"]):
            skipped.append(f"{entry['name']} ({entry['repo']}@{entry['commit'][:9]}: no local mirror with that commit)")
            continue
        tree = Path(args.work) / f"{entry['name']}-{entry['commit'][:12]}"
        snapshots.extract_python(git_dir, entry["commit"], tree)
        found, files, seconds, errs = lint_snapshot(entry["name"], tree, args.jobs, tuple(args.select.split(",")))
        hits += found
        errors += [f"{entry['name']}: {e}" for e in errs]
        rows.append((entry, files, seconds, found))

    if skipped:
        print("skipped:", *skipped, sep="\n  ")
    if not rows:
        print(f"no snapshot available: nothing checked (set --mirrors or ${snapshots.ENV})")
        return 0

    judged = Counter()
    problems = []
    for hit in hits:
        verdict = verdicts.get(hit.key)
        label = verdict["verdict"] if verdict else "UNJUDGED"
        judged[label] += 1
        if label != "TRUE":
            problems.append(f"{label}: {hit.key} (line {hit.line}): {hit.message}")
        if args.verbose:
            reason = f" -- {verdict['reason']}" if verdict else ""
            print(f"[{label}] {hit.repo}:{hit.path}:{hit.line} {hit.code} in {hit.function}{reason}")
    present = {h.key for h in hits}
    names = {e["name"] for e, *_ in rows}
    selected = args.select.split(",")
    lost = [k for k, v in verdicts.items() if v["verdict"] == "TRUE" and k.split(":", 1)[0] in names
            and k not in present and ("ALL" in selected or any(k.endswith(":" + c) for c in selected))]
    problems += [f"LOST: {k} (judged TRUE, no longer reported)" for k in lost]

    table = render_table(rows, judged, len(lost))
    print(table)
    for line in errors:
        print("internal error:", line)
    for line in problems:
        print(line)
    if args.write:
        write_doc(table)
    return 1 if problems or errors else 0


def render_table(rows, judged: Counter, lost: int) -> str:
    codes = sorted({h.code for *_, found in rows for h in found})
    head = "| repository | commit | files | seconds | findings | " + " | ".join(codes) + " |"
    lines = [head, "|" + "---|" * (5 + len(codes))]
    for entry, files, seconds, found in rows:
        per = Counter(h.code for h in found)
        cells = " | ".join(str(per.get(c, "")) for c in codes)
        lines.append(f"| {entry['name']} | `{entry['commit'][:9]}` | {files} | {seconds:.1f} | {len(found)} | {cells} |")
    total = sum(len(f) for *_, f in rows)
    lines.append("")
    lines.append(f"{total} findings: {judged.get('TRUE', 0)} judged TRUE, {judged.get('FALSE', 0)} FALSE, "
                 f"{judged.get('UNJUDGED', 0)} without a verdict; {lost} TRUE verdicts no longer reported.")
    return "\n".join(lines)


def write_doc(table: str) -> None:
    text = DOC.read_text(encoding="utf-8") if DOC.exists() else "# Benchmarks\n"
    body = (f"{SECTION}\n\n`python benchmarks/realcode.py --mirrors DIR --write` "
            f"({datetime.date.today().isoformat()}): every finding on the pinned snapshots, held to the reviewed "
            f"verdicts in `benchmarks/realcode_verdicts.toml`.\n\n{table}\n")
    start = text.find(SECTION)
    if start < 0:
        text = text.rstrip("\n") + "\n\n" + body
    else:
        end = text.find("\n## ", start + len(SECTION))
        text = text[:start] + body + (text[end + 1:] if end >= 0 else "")
    DOC.write_text(text, encoding="utf-8")


if __name__ == "__main__":
    sys.exit(main())
