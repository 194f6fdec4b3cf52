"""Record the metrics logs that `rlguard diagnose` is validated on (tests/data/diagnose/<run>.jsonl).

Each run trains the reference GRPO trainer (`rlguard.reference.trainer.train`) from its warm-started base policy:
the healthy configuration, each of the debugging chapter's seven injected faults, a learning rate ten times too
high, the length-biased loss mode and a reward that pays for passing the public check only. The length-biased loss
and the accumulation fault also run on the variable-length task (`rlguard.reference.config.VARIABLE_LENGTH`: a
PASSED/FAILED report after the last turn, then up to 16 probe tokens), next to a healthy run of it. Every step's
row is written through `rlguard.diagnose.MetricsLogger` (JSON lines) as the trainer produces it, with the run's
`kl_coef` added so that the kl_ref rule knows a KL term is set.

    python scripts/record_diagnose_logs.py                 # all runs (about ten minutes on one CPU core)
    python scripts/record_diagnose_logs.py --only healthy sampler_temp --out /tmp/logs

The runs are deterministic for a given torch version (fixed seeds, one thread).
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from rlguard.diagnose import MetricsLogger
from rlguard.reference.config import VARIABLE_LENGTH
from rlguard.reference.trainer import GRPOConfig, train

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "data" / "diagnose"
BASE = GRPOConfig()

# run name -> (config, fault, steps)
RUNS: dict[str, tuple[GRPOConfig, str | None, int]] = {
    "healthy": (BASE, None, 24),
    "mask_shift": (BASE, "mask_shift", 24),
    "stale_old_logp": (BASE, "stale_old_logp", 24),
    # The chapter's entropy fault is a penalty of 0.3; at the trainer's default ent_coef (0.001) the wrong sign
    # changes nothing a metric can show (entropy_sign_tiny), so the fault runs at the chapter's coefficient,
    # next to a healthy run with a correct bonus of the same size.
    "entropy_sign": (replace(BASE, ent_coef=0.3), "entropy_sign", 24),
    "entropy_sign_tiny": (BASE, "entropy_sign", 24),
    "healthy_ent_bonus": (replace(BASE, ent_coef=0.3), None, 24),
    "sign_flip": (BASE, "sign_flip", 24),
    "accum_local": (BASE, "accum_local", 24),
    "sampler_temp": (BASE, "sampler_temp", 24),
    "ref_is_policy": (BASE, "ref_is_policy", 24),
    "lr_high": (replace(BASE, lr=10 * BASE.lr), None, 24),
    # The length-biased loss needs episodes whose length the policy controls and failures it sees: the default
    # task's length is fixed by its turns (the chapter's agent reads files; this one probes after a FAILED report).
    # 48 steps: the bias acts once groups mix passing and failing episodes (pass rate 0.04 -> 0.5).
    "healthy_varlen": (VARIABLE_LENGTH, None, 48),
    "length_bias": (replace(VARIABLE_LENGTH, loss_mode="seq_mean_token_mean"), None, 48),
    # Length-sorted microbatches of 4 episodes, each its own token mean / 32: a coarser length bias.
    "accum_local_varlen": (VARIABLE_LENGTH, "accum_local", 48),
    "public_reward": (replace(BASE, reward="public"), None, 24),
}


def record(name: str, out: Path) -> Path:
    cfg, fault, steps = RUNS[name]
    path = out / f"{name}.jsonl"
    with MetricsLogger(path) as log:
        train(cfg, fault=fault, steps=steps, on_step=lambda row: log(dict(row, kl_coef=cfg.kl_coef)))
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=OUT, help="directory for the <run>.jsonl logs")
    parser.add_argument("--only", nargs="+", choices=list(RUNS), help="record only these runs")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    for name in args.only or list(RUNS):
        start = time.time()
        path = record(name, args.out)
        print(f"{name:<18} {RUNS[name][2]} steps in {time.time() - start:5.1f}s -> {path.name}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
