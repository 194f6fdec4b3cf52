"""Cost of the RLG016-RLG019 checks: the runtime checks per checked call and per update at their default
cadence, and the preflight's extra seconds. All ratios come from this one run (process CPU time, one thread).

    python benchmarks/row_checks_overhead.py [--reps N] [--threads N]

Runtime checks, each against the same function undecorated, on a small GPT-like model on CPU (4 layers, d_model
256, dropout modules present and disabled as TRL's ``disable_dropout`` does; batch 8 x 256 tokens):

- ``StopTokenInMask`` (RLG017) on a mask builder's return value.
- ``EvalMode`` (RLG018) on the model argument of a scoring forward, and the Guard's forward pre-hook on the
  reference (every forward) and on the policy (forwards with autograd off).
- ``@row_independent`` (RLG016) on a scoring forward: a checked call (two more forwards of one row; three with
  ``side="both"``, or by default on a batch padded on both sides) and the amortised cost per call at its default
  cadence (``every=16``).
- ``@permutation_invariant`` (RLG019) on a loss over the batch (forward with autograd, the loss): a checked call
  (one more forward of the batch, autograd off) and the amortised cost at ``every=16``.
- ``RowsInStep`` (RLG019) on two [B, T-1] fields of a loss (row hashes of ids and of each field).

Per update: one update of 2 epochs x 4 minibatches x 2 microbatches has 16 loss calls, 1 reference and 1
old-policy scoring forward; the figure adds each check's cost at its cadence to that update's own time.

Preflight: the seconds the four new checks add to ``rlguard check`` on the reference trainer (its preflight
configuration), measured check by check.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
import torch
from torch import nn

from rlguard.contracts import (
    ActionMask, EvalMode, Guard, LogProbs, RowsInStep, StopTokenInMask, TokenIds, contract, permutation_invariant,
    row_independent,
)
from rlguard.reference.model import ModelConfig, build_model, disable_dropout

B, T, V, EOS = 8, 256, 512, 2


def cpu_time(fn, reps: int) -> float:
    """Median seconds of ``fn()`` over ``reps`` runs (process CPU time), after one warm-up."""
    fn()
    out = []
    for _ in range(reps):
        t = time.process_time()
        fn()
        out.append(time.process_time() - t)
    return statistics.median(out)


def gather(logits, ids):
    return logits[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cfg = ModelConfig(vocab_size=V, d_model=256, n_layers=4, n_heads=4, max_len=T + 8, dropout=0.1)
    policy = disable_dropout(build_model(cfg))
    ref = disable_dropout(build_model(cfg, seed=1)).eval().requires_grad_(False)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, V, (B, T), generator=gen)
    ids[:, T // 2:] = EOS  # completions ending in EOS, padded with it
    mask = torch.ones(B, T)
    print(f"# rlguard RLG016-RLG019 checks, torch {torch.__version__}, {platform.machine()}, "
          f"{args.threads} thread(s), model d256 x 4 layers, batch {B} x {T}")

    # -- RLG017 StopTokenInMask
    def build_mask(ids: TokenIds) -> ActionMask:
        t = ids[:, 1:]
        after = (t == EOS).int().cumsum(-1) - (t == EOS).int() > 0
        return (~after).float()

    checked_mask = contract(build_mask, markers={"return": StopTokenInMask(ids="ids", stop_ids=EOS)})
    bare_mask = cpu_time(lambda: build_mask(ids), args.reps * 10)
    stop = cpu_time(lambda: checked_mask(ids), args.reps * 10) - bare_mask

    # -- RLG018 EvalMode and the Guard's hook
    def score(model: nn.Module, ids: TokenIds):
        with torch.no_grad():
            return gather(model(ids), ids)

    # a flag check costs microseconds whatever the input: measured on forwards of one 8-token row, so that the
    # forward's own noise does not bury it
    tiny, many = ids[:1, :8], args.reps * 40
    scored = contract(score, markers={"model": EvalMode()})
    bare_fwd = cpu_time(lambda: score(ref, ids), args.reps)
    bare_tiny = cpu_time(lambda: score(ref, tiny), many)
    eval_mode = cpu_time(lambda: scored(ref, tiny), many) - bare_tiny
    bare_policy = cpu_time(lambda: score(policy, tiny), many)
    opt = torch.optim.SGD(policy.parameters(), lr=0.0)
    with Guard(policy=policy, reference=ref, optimizer=opt):
        hooked = cpu_time(lambda: score(ref, tiny), many) - bare_tiny
        hooked_policy = cpu_time(lambda: score(policy, tiny), many) - bare_policy

    # -- RLG016 row_independent
    def logps(model, input_ids, attention_mask):
        with torch.no_grad():
            return gather(model(input_ids), input_ids)

    every_call = row_independent(logps, ids="input_ids", mask="attention_mask", every=1)
    bare_logps = cpu_time(lambda: logps(ref, ids, mask), args.reps)
    checked = cpu_time(lambda: every_call(ref, ids, mask), args.reps) - bare_logps
    def logps_positions(model, input_ids, attention_mask):  # what left padding needs: the mask and position ids
        with torch.no_grad():
            position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
            return gather(model(input_ids, attention_mask=attention_mask, position_ids=position_ids), input_ids)

    both_sides = row_independent(logps_positions, ids="input_ids", mask="attention_mask", every=1, side="both")
    bare_positions = cpu_time(lambda: logps_positions(ref, ids, mask), args.reps)
    checked_both = cpu_time(lambda: both_sides(ref, ids, mask), args.reps) - bare_positions

    # -- RLG019 permutation_invariant: a GRPO-style loss over the batch (its forward with autograd)
    adv = torch.randn(B, generator=gen)

    def pg_loss(model, input_ids, advantages, attention_mask):
        logp = gather(model(input_ids), input_ids)
        m = attention_mask[:, 1:]
        return -(logp * advantages[:, None] * m).sum() / m.sum()

    perm_checked = permutation_invariant(pg_loss, key="input_ids", every=1)
    bare_pg = cpu_time(lambda: pg_loss(policy, ids, adv, mask), args.reps)
    permuted = cpu_time(lambda: perm_checked(policy, ids, adv, mask), args.reps) - bare_pg

    # -- RLG019 RowsInStep
    def loss(ids: TokenIds, old: LogProbs, ref_lp: LogProbs):
        return (old - ref_lp).sum()

    old, ref_lp = torch.randn(B, T - 1), torch.randn(B, T - 1)
    checked_loss = contract(loss, markers={"old": RowsInStep(key="ids"), "ref_lp": RowsInStep(key="ids")})
    bare_loss = cpu_time(lambda: loss(ids, old, ref_lp), args.reps * 10)
    with Guard(policy=policy, optimizer=opt) as g:
        checked_loss(ids, old, ref_lp)
        with g.update():
            rows = cpu_time(lambda: checked_loss(ids, old, ref_lp), args.reps * 10) - bare_loss

    # -- one update of the trainer: 16 microbatches of one row (2 epochs x 4 minibatches x 2 microbatches of the
    # batch of 8), forward and backward, and 2 scoring forwards of the whole batch (old policy, reference)
    def step():
        policy.zero_grad()
        policy(ids[:1]).float().logsumexp(-1).mean().backward()

    update = 16 * cpu_time(step, args.reps) + 2 * bare_fwd
    per_update = {
        "StopTokenInMask (RLG017), once per rollout": stop,
        "EvalMode (RLG018), 2 scoring calls": 2 * eval_mode,
        "Guard scoring hooks (RLG018), 2 scoring forwards": hooked + hooked_policy,
        "row_independent (RLG016), 2 scoring calls at every=16": 2 * checked / 16,
        "permutation_invariant (RLG019), 16 loss calls at every=16": permuted,
        "RowsInStep (RLG019), 16 loss calls + 1 at the rollout": 17 * rows,
    }
    print("\n## Per checked call (ms; the call itself in brackets)")
    print(f"StopTokenInMask on a mask builder:       {stop * 1e3:8.3f}  [{bare_mask * 1e3:.3f}]")
    print(f"EvalMode on a scoring forward:           {eval_mode * 1e3:8.3f}  [{bare_fwd * 1e3:.1f}]")
    print(f"Guard hook, reference forward:           {hooked * 1e3:8.3f}  [{bare_fwd * 1e3:.1f}]")
    print(f"Guard hook, policy forward (no_grad):    {hooked_policy * 1e3:8.3f}  [{bare_fwd * 1e3:.1f}]")
    print(f"  (the flag checks measured on forwards of one 8-token row: {bare_tiny * 1e3:.2f} ms bare)")
    print(f"row_independent, a checked call:         {checked * 1e3:8.3f}  [{bare_logps * 1e3:.1f}]  "
          f"({checked / bare_logps:.2f}x the call; at every=16: {checked / 16 / bare_logps * 100:.1f}% per call)")
    print(f"row_independent, side='both':            {checked_both * 1e3:8.3f}  [{bare_positions * 1e3:.1f}]  "
          f"({checked_both / bare_positions:.2f}x the call; at every=16: "
          f"{checked_both / 16 / bare_positions * 100:.1f}% per call; a scorer passing mask and position ids)")
    print(f"permutation_invariant on a batch loss:   {permuted * 1e3:8.3f}  [{bare_pg * 1e3:.1f}]  "
          f"({permuted / bare_pg:.2f}x the call; at every=16: {permuted / 16 / bare_pg * 100:.1f}% per call)")
    print(f"RowsInStep on 2 fields of a loss:        {rows * 1e3:8.3f}  [{bare_loss * 1e3:.3f}]")
    print(f"\n## Per update (ms; an update of this model: {update * 1e3:.0f} ms)")
    for what, cost in per_update.items():
        print(f"{what:58s} {cost * 1e3:8.3f}  ({cost / update * 100:.2f}%)")
    total = sum(per_update.values())
    print(f"{'all five':58s} {total * 1e3:8.3f}  ({total / update * 100:.2f}%)")
    print("  (permutation_invariant: one checked call per update, on a loss over the whole batch of 8: an upper "
          "bound for this update, whose loss calls take one row)")

    # -- the preflight's extra seconds
    from rlguard.preflight.checks import CHECKS, Context
    from rlguard.reference.adapter import ReferenceAdapter

    ctx = Context(ReferenceAdapter())
    _ = ctx.trainer_logp
    print("\n## Preflight on the reference trainer (s)")
    extra = 0.0
    for name in ("stop_token_trained", "scoring_eval_mode", "padding_leak", "rows_in_step"):
        t = time.perf_counter()
        result = CHECKS[name][0](ctx)
        dt = time.perf_counter() - t
        extra += dt
        print(f"{name:22s} {dt:6.3f}  ({'pass' if result.passed else 'FAIL'}{', skipped' if result.skipped else ''})")
    t = time.perf_counter()
    from rlguard.preflight.suite import run_suite

    run_suite(ReferenceAdapter())
    print(f"{'the four together':22s} {extra:6.3f}  of a whole suite run of {time.perf_counter() - t:.2f}")


if __name__ == "__main__":
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    main()
