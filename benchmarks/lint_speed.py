"""How fast is `rlguard lint`, against parsing alone, cold and with a warm cache?

On a corpus of real files (default: every .py file of the installed torch package, 2,000+ files), in one
invocation and over several runs each, times

  (a) libcst.parse_module alone over every file (files read beforehand, one process);
  (b) `rlguard lint --no-cache --jobs 1` (one worker: what the rules add on top of parsing);
  (c) `rlguard lint` again with a warm cache (what a pre-commit hook pays on every commit);

and prints the medians with the ratios b/a (goal <= 1.5) and c/b (goal <= 0.1). `--write` puts the table into
the "Lint speed" section of docs/benchmarks.md (other sections are kept).

    python benchmarks/lint_speed.py                    # torch corpus, 3 runs each
    python benchmarks/lint_speed.py --corpus ~/src/trl --runs 5 --write
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "benchmarks.md"
SKIP = {".git", "__pycache__", ".venv", "venv", "build", "dist", ".rlguard_cache"}


def corpus_files(corpus: Path) -> list[Path]:
    files = []
    for dirpath, dirnames, filenames in os.walk(corpus):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP)
        files += [Path(dirpath, f) for f in sorted(filenames) if f.endswith(".py")]
    return files


def time_parse(sources: list[str]) -> tuple[float, int]:
    import libcst

    failed = 0
    start = time.perf_counter()
    for text in sources:
        try:
            libcst.parse_module(text)
        except Exception:
            failed += 1
    return time.perf_counter() - start, failed


def time_lint(corpus: Path, cwd: Path, *flags: str) -> float:
    cmd = [sys.executable, "-m", "rlguard", "lint", "--isolated", "--exit-zero", "--format", "json", *flags,
           str(corpus)]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    elapsed = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"rlguard lint failed ({proc.returncode}):\n{proc.stderr}")
    return elapsed


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--corpus", type=Path, help="folder of .py files (default: the installed torch package)")
    p.add_argument("--runs", type=int, default=3, help="runs of each measurement (default 3)")
    p.add_argument("--machine", default="2-core CPU", help="machine description for the table")
    p.add_argument("--write", action="store_true", help="write the table into docs/benchmarks.md")
    args = p.parse_args(argv)

    corpus = args.corpus
    label = str(corpus) if corpus else ""
    if corpus is None:
        spec = importlib.util.find_spec("torch")
        if spec is None or not spec.origin:
            raise SystemExit("torch is not installed: pass --corpus DIR")
        corpus = Path(spec.origin).parent
        label = "installed torch package"
    files = corpus_files(corpus)
    sources = [f.read_bytes().decode("utf-8", "replace") for f in files]
    lines = sum(s.count("\n") for s in sources)
    print(f"corpus: {label}: {len(files)} files, {lines:,} lines, {sum(map(len, sources)) / 1e6:.1f} MB; "
          f"{args.runs} runs each", flush=True)

    parse, cold, warm = [], [], []
    with tempfile.TemporaryDirectory() as scratch:  # the warm cache lives here, not in the corpus
        cwd = Path(scratch)
        for run in range(args.runs):
            seconds, failed = time_parse(sources)
            parse.append(seconds)
            cold.append(time_lint(corpus, cwd, "--no-cache", "--jobs", "1"))
            time_lint(corpus, cwd)  # fills the cache (again, should the linter's source have changed meanwhile)
            warm.append(time_lint(corpus, cwd))
            print(f"run {run + 1}: (a) {parse[-1]:.2f} s  (b) {cold[-1]:.2f} s  (c) {warm[-1]:.2f} s", flush=True)
    a, b, c = (statistics.median(x) for x in (parse, cold, warm))
    table = render(label, len(files), lines, args.runs, args.machine, (parse, cold, warm), failed)
    print(table)
    if args.write:
        write_section(table)
        print(f"wrote the Lint speed section of {DOC.relative_to(ROOT)}")
    return 0


def render(label, n_files, lines, runs, machine, samples, failed, note="") -> str:
    ok = lambda good: "met" if good else "MISSED"  # noqa: E731
    a, b, c = (statistics.median(x) for x in samples)
    each = [", ".join(f"{v:.2f}" for v in x) for x in samples]
    per_run = [f"{y / x:.2f}" for x, y in zip(samples[0], samples[1])]
    return "\n".join([
        "## Lint speed",
        "",
        f"Measured {datetime.date.today().isoformat()} on a {machine} by `python benchmarks/lint_speed.py` "
        f"({runs} runs each, medians). Corpus: the {label}, {n_files} files, {lines:,} lines"
        + (f" ({failed} of them do not parse on this Python)." if failed else "."),
        "",
        "| step | median | each run (s) |",
        "|---|---|---|",
        f"| (a) libcst `parse_module` alone, every file | {a:.2f} s | {each[0]} |",
        f"| (b) `rlguard lint --no-cache --jobs 1` (all rules) | {b:.2f} s | {each[1]} |",
        f"| (c) `rlguard lint`, warm cache | {c:.2f} s | {each[2]} |",
        f"| b/a (goal <= 1.5) | {b / a:.2f} ({ok(b / a <= 1.5)}) | per run: {', '.join(per_run)} |",
        f"| c/b (goal <= 0.1) | {c / b:.3f} ({ok(c / b <= 0.1)}) | |",
        "",
        *([note, ""] if note else []),
        "(b) can be below (a): the engine parses a file only when some rule's trigger words occur in it, and a "
        "warm run (c) reads one small JSON entry per unchanged file instead of parsing it.",
        "",
    ])


def write_section(table: str, heading: str = "Lint speed") -> None:
    """Put ``table`` in place of the ``## heading`` section of docs/benchmarks.md (appended when missing)."""
    text = DOC.read_text(encoding="utf-8") if DOC.exists() else "# Benchmarks\n\n"
    pattern = re.compile(rf"^## {re.escape(heading)}\n.*?(?=^## |\Z)", re.MULTILINE | re.DOTALL)
    if pattern.search(text):
        text = pattern.sub(lambda _: table + "\n", text, count=1)
    else:
        text = text.rstrip("\n") + "\n\n" + table + "\n"
    DOC.write_text(text.rstrip("\n") + "\n", encoding="utf-8")


if __name__ == "__main__":
    sys.exit(main())
