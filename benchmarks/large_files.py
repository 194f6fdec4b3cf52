"""How do lint time and memory grow with the size of one file, and where does the time go?

Generates single files of growing size and lints each in a fresh process, so that every peak RSS is that
file's alone:

  (a) libcst ``parse_module`` alone (time, peak RSS);
  (b) ``rlguard lint --no-cache --isolated FILE`` end to end (wall time, peak RSS; goal: within 2x of (a));
  (c) the engine alone (``lint_source``, no process start nor imports) and its stage timings for the same file (``lint_source(..., timings=...)``): CPython's syntax check,
      the trigger search, libcst's parse, the analysis index, each rule, positions, noqa.

Two kinds of file: ``table``, a generated module (an OpInfo-style table of N entries, as torch's
common_methods_invocations.py) ending in a small trainer with one RLG004 bug, so every rule runs over the whole
file and the finding must be placed; ``trainer``, N generated trainer functions, where every rule has work on
every function.

    python benchmarks/large_files.py                          # table 6,250-50,000 lines; trainer 1,000-4,000
    python benchmarks/large_files.py --sizes 50000 --trainer-sizes ""
    python benchmarks/large_files.py --write                  # the "Large files" section of docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

ENTRY = '''    OpInfo(
        "op_{i}",
        ref=reference_op_{i},
        dtypes=floating_types_and(torch.half, torch.bfloat16),
        sample_inputs_func=partial(sample_inputs_op, shapes=((S, M), ({i}, S)), scale={i}.5),
        supports_autograd={flag},
        skips=(DecorateInfo(unittest.skip("slow"), "TestCommon", "test_variant_{i}"),),
    ),
'''
TRAINER_TAIL = '''

def update(policy, optimizer, batch, ent_coef=0.01):
    logits = policy(batch["input_ids"]).logits[:, :-1]
    logp = torch.log_softmax(logits, -1)
    entropy = -(logp.exp() * logp).sum(-1)
    pg_loss = -(batch["advantages"][:, None] * logp.gather(-1, batch["input_ids"][:, 1:, None]).squeeze(-1)).mean()
    loss = pg_loss + ent_coef * entropy.mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
'''
TRAINER_BLOCK = '''
def update_{i}(policy, ref_model, optimizer, batch, ent_coef=0.01, kl_coef=0.1):
    ids = batch["input_ids"]
    mask = batch["action_mask"][:, 1:]
    with torch.no_grad():
        old_logp = token_logprobs(policy(ids), ids)
        ref_logp = token_logprobs(ref_model(ids), ids)
    advantages = (batch["rewards"] - batch["rewards"].mean()) / (batch["rewards"].std() + 1e-8)
    for epoch in range(4):
        optimizer.zero_grad()
        logits = policy(ids).logits[:, :-1]
        logp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        ratio = torch.exp(logp - old_logp)
        pg_loss = -torch.min(ratio * advantages[:, None], torch.clamp(ratio, 0.8, 1.2) * advantages[:, None])
        entropy = -(torch.softmax(logits, -1) * torch.log_softmax(logits, -1)).sum(-1)
        kl = logp - ref_logp
        loss = ((pg_loss + kl_coef * kl) * mask).sum() / mask.sum() - ent_coef * (entropy * mask).sum() / mask.sum()
        loss.backward()
        optimizer.step()
    return loss.item()
'''


def generate(kind: str, lines: int) -> str:
    """A file of about ``lines`` lines with exactly one finding (RLG004)."""
    if kind == "table":
        n = max(1, (lines - 20) // ENTRY.count("\n"))
        body = "".join(ENTRY.format(i=i, flag=bool(i % 2)) for i in range(n))
        return "import unittest\nfrom functools import partial\n\nimport torch\n\nop_db = [\n" + body + "]\n" \
            + TRAINER_TAIL
    n = max(1, lines // TRAINER_BLOCK.count("\n"))
    blocks = [TRAINER_BLOCK.format(i=i) for i in range(n)]
    blocks.insert(n // 2, "\nloss = pg_loss + ent_coef * entropy.mean()\n")
    return "import torch\nfrom helpers import token_logprobs\n" + "".join(blocks)


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def child(mode: str, path: str) -> None:
    """Runs in a fresh process: one measurement of one file, printed as JSON."""
    if mode == "cli":
        cli(path)
        return
    source = Path(path).read_text(encoding="utf-8")
    if mode == "parse":
        import libcst

        start = time.perf_counter()
        libcst.parse_module(source)
        print(json.dumps({"seconds": time.perf_counter() - start, "rss_mb": _peak_rss_mb()}))
        return
    from rlguard.lint.engine import lint_source

    timings: dict[str, float] = {}
    start = time.perf_counter()
    result = lint_source(source, path, timings=timings)
    print(json.dumps({"seconds": time.perf_counter() - start, "rss_mb": _peak_rss_mb(), "stages": timings,
                      "findings": [f.code for f in result.findings], "errors": len(result.errors)}))


def run_child(*args: str) -> dict:
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    proc = subprocess.run([sys.executable, __file__, "--child", *args], capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"measurement {args} failed:\n{proc.stderr}")
    return json.loads(proc.stdout)


def cli(path: str) -> None:
    """Runs in a fresh process: `rlguard lint --no-cache --isolated FILE` as its only child, so that the
    children's peak RSS is the linter's."""
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "rlguard", "lint", "--no-cache", "--isolated", "--format", "json",
                           path], capture_output=True, text=True, cwd=Path(path).parent)
    seconds = time.perf_counter() - start
    if proc.returncode not in (0, 1):
        raise SystemExit(f"rlguard lint failed ({proc.returncode}) on {path}:\n{proc.stderr}")
    rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    print(json.dumps({"seconds": seconds, "rss_mb": rss, "findings": [f["code"] for f in json.loads(proc.stdout)]}))


def _median_run(samples: list[dict]) -> dict:
    """The sample with the median time (its RSS and stages come with it)."""
    return sorted(samples, key=lambda s: s["seconds"])[(len(samples) - 1) // 2]


def measure(kind: str, sizes: list[int], scratch: Path, runs: int) -> list[dict]:
    rows = []
    for size in sizes:
        path = scratch / f"{kind}_{size}.py"
        path.write_text(generate(kind, size), encoding="utf-8")
        lines = path.read_text(encoding="utf-8").count("\n")
        samples: dict[str, list[dict]] = {"parse": [], "lint": [], "cli": []}
        for _ in range(runs):  # interleaved, so that a busy spell of the machine hits every measurement alike
            for mode in samples:
                samples[mode].append(run_child(mode, str(path)))
        parse, engine, linted = (_median_run(samples[m]) for m in ("parse", "lint", "cli"))
        row = {"kind": kind, "lines": lines, "parse": parse, "engine": engine, "cli": linted,
               "ratios": [c["seconds"] / a["seconds"] for a, c in zip(samples["parse"], samples["cli"])]}
        rows.append(row)
        print(f"{kind} {lines:>6} lines: parse {parse['seconds']:.2f} s {parse['rss_mb']:.0f} MB | lint "
              f"{linted['seconds']:.2f} s {linted['rss_mb']:.0f} MB ({linted['seconds'] / parse['seconds']:.2f}x) | "
              f"findings {linted['findings']}", flush=True)
    return rows


STAGES = ("syntax", "triggers", "parse", "context", "rules", "positions", "noqa")


def _stage_seconds(stages: dict[str, float]) -> dict[str, float]:
    out = {name: stages.get(name, 0.0) for name in STAGES}
    out["rules"] = sum(v for k, v in stages.items() if k.startswith("RLG"))
    return out


def render(rows: list[dict], machine: str, runs: int) -> str:
    lines = [
        "## Large files",
        "",
        f"Measured {datetime.date.today().isoformat()} on a {machine} by `python benchmarks/large_files.py "
        f"--runs {runs}` (medians of {runs} interleaved runs per size, each measurement in a fresh process; b/a "
        f"also per run). `table`: a generated OpInfo-style table ending in a "
        f"small trainer with one RLG004 bug, so every rule runs over the whole file and one finding is placed; "
        f"`trainer`: generated trainer functions, one RLG004 bug among them.",
        "",
        "| file | lines | (a) libcst parse alone | (b) `rlguard lint` | b/a (goal <= 2) | s per 1,000 lines (b) "
        "| (c) engine alone | peak RSS (a) / (b) | findings |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        a, b, c = r["parse"], r["cli"], r["engine"]
        lines.append(f"| {r['kind']} | {r['lines']:,} | {a['seconds']:.2f} s | {b['seconds']:.2f} s | "
                     f"{b['seconds'] / a['seconds']:.2f} ({', '.join(f'{x:.2f}' for x in r['ratios'])}) | "
                     f"{1000 * b['seconds'] / r['lines']:.3f} | "
                     f"{c['seconds']:.2f} s | {a['rss_mb']:.0f} / {b['rss_mb']:.0f} MB | "
                     f"{', '.join(b['findings']) or '-'} |")
    lines += ["", "Where the engine's time goes (`lint_source(..., timings=...)`, seconds):", "",
              "| file | lines | " + " | ".join(STAGES) + " | slowest rules |",
              "|---|---|" + "---|" * (len(STAGES) + 1)]
    for r in rows:
        stages = r["engine"]["stages"]
        per = _stage_seconds(stages)
        slow = sorted(((k, v) for k, v in stages.items() if k.startswith("RLG")), key=lambda kv: -kv[1])[:3]
        lines.append(f"| {r['kind']} | {r['lines']:,} | " + " | ".join(f"{per[s]:.2f}" for s in STAGES)
                     + " | " + ", ".join(f"{k} {v:.2f}" for k, v in slow) + " |")
    lines += ["", "`syntax` is CPython's check of every file for the target version, `triggers` the search of the "
                  "rules' trigger patterns, `context` the analysis index (`lint/analysis/index.py`, one walk), "
                  "`positions` the placing of the findings (one code-generation pass recording only the flagged "
                  "nodes).", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="6250,12500,25000,50000", help="lines of the table files (comma-separated)")
    p.add_argument("--trainer-sizes", default="1000,2000,4000", help="lines of the trainer files ('' for none)")
    p.add_argument("--runs", type=int, default=3, help="runs of each measurement (default 3)")
    p.add_argument("--machine", default="2-core CPU", help="machine description for the table")
    p.add_argument("--write", action="store_true", help="write the section into docs/benchmarks.md")
    p.add_argument("--child", nargs=2, metavar=("MODE", "FILE"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        child(*args.child)
        return 0
    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    trainer_sizes = [int(s) for s in args.trainer_sizes.split(",") if s.strip()]
    with tempfile.TemporaryDirectory() as scratch:
        rows = measure("table", sizes, Path(scratch), args.runs) + measure("trainer", trainer_sizes, Path(scratch),
                                                                           args.runs)
    table = render(rows, args.machine, args.runs)
    print(table)
    if args.write:
        from lint_speed import write_section

        write_section(table, heading="Large files")
        print("wrote the Large files section of docs/benchmarks.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
