"""Per-step cost of rlguard contracts in a 2-process data-parallel step, with and without the cross-rank checks.

    python benchmarks/distributed_overhead.py [--steps N] [--rounds N] [--world N]

Starts ``--world`` processes (gloo, 127.0.0.1, one thread each). Each rank trains a DDP-wrapped small GPT-like
model (2 layers, d_model 128, batch 8 x 256 tokens per rank) with a token-mean PPO loss normalised by the global
token count (one all-reduce, as a correct data-parallel trainer must do anyway), under a ``Guard``. The loss
functions carry the usual contracts: token log-probs (shape, return), the PPO loss (NoGrad, Finite,
SamplerConsistent, Frozen) and the KL term. Variants, interleaved round by round so that the machine's load
hits all alike:

- contracts off (``mode("off")``): the baseline;
- contracts, local only (``sync("off")``): every check, no collective (each rank would raise alone);
- contracts, cross-rank (sync on, ``check_every=1``): every decorated call is a synchronised call;
- contracts, cross-rank, ``check_every=10``: value checks and their collectives on every 10th call.

Per step: the median wall time of ``--steps`` steps per round, the median over rounds (rank 0's clock; the
ranks are in lockstep). Also the collectives each step adds, and the bare latency of one flag exchange.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time
from typing import Annotated

import torch

from rlguard.contracts import (ActionMask, Advantages, Finite, Frozen, Guard, Logits, LogProbs, Loss, NoGrad,
                               SamplerConsistent, TokenIds, contract, global_token_count, mode, sync)
from rlguard.contracts.distributed import exchange
from rlguard.contracts.settings import STATE
from rlguard.reference.model import ModelConfig, build_model


def _worker(rank: int, world: int, port: int, args, queue) -> None:
    torch.set_num_threads(1)
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))

    def make(check_every: int):
        @contract(check_every=check_every)
        def token_log_probs(logits: Logits, ids: TokenIds) -> LogProbs:
            return logits[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)

        @contract(check_every=check_every)
        def policy_loss(
            logp: Annotated[LogProbs, Finite(), SamplerConsistent(sampler="old_logp", mask="mask", tol=1e9)],
            old_logp: Annotated[LogProbs, NoGrad(), Frozen(current="logp", mask="mask")],
            advantages: Annotated[Advantages, NoGrad()],
            mask: ActionMask,
            n_tokens: torch.Tensor,
        ) -> Annotated[Loss, Finite()]:
            ratio = torch.exp(logp - old_logp)
            a = advantages[:, None]
            surrogate = torch.minimum(ratio * a, ratio.clamp(0.8, 1.2) * a)
            return -(surrogate * mask).sum() / n_tokens

        @contract(check_every=check_every)
        def kl_term(logp: LogProbs, ref_logp: Annotated[LogProbs, NoGrad()], mask: ActionMask,
                    n_tokens: torch.Tensor) -> Annotated[Loss, Finite()]:
            d = ref_logp - logp
            return ((torch.exp(d) - d - 1) * mask).sum() / n_tokens

        return token_log_probs, policy_loss, kl_term

    fns = {1: make(1), 10: make(10)}
    cfg = ModelConfig(vocab_size=256, d_model=128, n_layers=2, n_heads=4, max_len=256)
    model = build_model(cfg, seed=0)
    ref = build_model(cfg, seed=0).requires_grad_(False)
    ddp = DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)
    guard = Guard(policy=ddp, reference=ref, optimizer=opt)
    gen = torch.Generator().manual_seed(100 + rank)
    b, t = 8, 256
    ids = torch.randint(0, cfg.vocab_size, (b, t), generator=gen)
    lengths = torch.randint(t // 4, t, (b,), generator=gen)
    mask = (torch.arange(t - 1)[None] < lengths[:, None]).float()
    adv = torch.randn(b, generator=gen)
    with torch.no_grad():
        old_logp = fns[1][0](model(ids), ids) - 0.01
        ref_logp = fns[1][0](ref(ids), ids)

    def step(check_every: int) -> None:
        token_log_probs, policy_loss, kl_term = fns[check_every]
        with guard.update():
            opt.zero_grad(set_to_none=True)
            n_tokens = global_token_count(mask)
            logp = token_log_probs(ddp(ids), ids)
            loss = policy_loss(logp, old_logp, adv, mask, n_tokens) + 0.05 * kl_term(logp, ref_logp, mask, n_tokens)
            (loss * world).backward()
            opt.step()

    variants = [
        ("contracts off", "off", "auto", 1),
        ("contracts, local only (sync off)", "raise", "off", 1),
        ("contracts, cross-rank (sync on)", "raise", "auto", 1),
        ("contracts, cross-rank, check_every=10", "raise", "auto", 10),
    ]
    times: dict[str, list[float]] = {v[0]: [] for v in variants}
    colls: dict[str, float] = {v[0]: 0.0 for v in variants}
    for m, s, ce in [(v[1], v[2], v[3]) for v in variants]:  # warm-up
        with mode(m), sync(s):
            step(ce)
    # one step per variant per round, the order rotated each round: the machine's load drifts over all alike
    for r in range(args.rounds):
        order = variants[r % len(variants):] + variants[:r % len(variants)]
        for name, m, s, ce in order:
            with mode(m), sync(s):
                c0 = STATE.collectives
                dist.barrier()
                t0 = time.perf_counter()
                step(ce)
                times[name].append(time.perf_counter() - t0)
                colls[name] += (STATE.collectives - c0) / args.rounds
    # per call of the PPO loss alone (no model): the checks' own cost, and what a synchronised call adds
    logp = old_logp + 0.01
    n_tok = global_token_count(mask)
    calls: dict[str, list[float]] = {v[0]: [] for v in variants}
    for r in range(args.call_rounds):
        for name, m, s, ce in variants:
            policy_loss = fns[ce][1]
            with mode(m), sync(s), guard.update():
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(args.calls):
                    policy_loss(logp, old_logp, adv, mask, n_tok)
                calls[name].append((time.perf_counter() - t0) / args.calls)
    # bare latency of one flag exchange (what each synchronised call adds)
    dist.barrier()
    n = 500
    t0 = time.perf_counter()
    for _ in range(n):
        exchange([], None)
    exch_us = (time.perf_counter() - t0) / n * 1e6
    if rank == 0:
        queue.put({"times": {k: statistics.median(v) for k, v in times.items()}, "colls": colls,
                   "calls": {k: min(v) for k, v in calls.items()}, "exchange_us": exch_us})
    guard.close()
    dist.barrier()
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=20, help="rounds of one step per variant")
    parser.add_argument("--calls", type=int, default=200, help="calls per variant and round of the loss alone")
    parser.add_argument("--call-rounds", type=int, default=5)
    args = parser.parse_args()
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.start_processes(_worker, args=(args.world, port, args, queue), nprocs=args.world, start_method="spawn")
    res = queue.get()
    base = res["times"]["contracts off"]
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"# rlguard distributed overhead  (torch {torch.__version__}, gloo, {args.world} processes x 1 thread, "
          f"{platform.machine()}, python {platform.python_version()}, load average {load:.1f})")
    print("# step: DDP GPT 2 layers d128, batch 8 x 256 per rank, PPO + KL token-mean loss over the global token "
          f"count, one guard update per step; median of {args.rounds} steps per variant, interleaved (rank 0 wall "
          "clock)")
    print(f"# one flag exchange (all-reduce of a [{args.world}] int32, nothing failed): {res['exchange_us']:.0f} us")
    print()
    print("| variant | per step (ms) | added vs off (ms) | ratio to off | collectives per step |")
    print("|---|---:|---:|---:|---:|")
    for name, t in res["times"].items():
        print(f"| {name} | {t * 1e3:.1f} | {(t - base) * 1e3:+.1f} | {t / base:.3f} | {res['colls'][name]:.1f} |")
    print()
    cbase = res["calls"]["contracts off"]
    print(f"# the PPO loss alone (4 tensors [8, 255], markers NoGrad, Finite, SamplerConsistent, Frozen), best of "
          f"{args.call_rounds} x {args.calls} calls")
    print()
    print("| variant | per call (us) | added vs off (us) | added per step, 3 calls (% of the off step) |")
    print("|---|---:|---:|---:|")
    for name, t in res["calls"].items():
        added = t - cbase
        print(f"| {name} | {t * 1e6:.0f} | {added * 1e6:+.0f} | {100 * 3 * added / base:.2f}% |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
