"""One rank of the distributed tests (``tests/test_distributed.py`` starts two of these over gloo on 127.0.0.1).

    python tests/dist_worker.py SCENARIO RANK WORLD PORT OUT_JSON

Each scenario runs several checks in one process group (starting processes is the expensive part) and writes
what it saw, per rank, to ``OUT_JSON``. ``checks`` ends with a fault on rank 1 only that nothing catches: both
processes must then exit promptly with the contract violation.
"""

from __future__ import annotations

import copy
import hashlib
import json
import sys
import time
import traceback
from typing import Annotated

import torch

torch.set_num_threads(1)

import torch.distributed as dist  # noqa: E402

from rlguard.contracts import (  # noqa: E402
    Advantages,
    ContractViolation,
    Guard,
    GroupCentred,
    LogProbs,
    NoGrad,
    contract,
    mode,
    set_sync,
    sync,
)
from rlguard.contracts.settings import STATE  # noqa: E402
from rlguard.reference.config import GRPOConfig  # noqa: E402
from rlguard.reference.distributed import (  # noqa: E402
    DistributedReferenceAdapter,
    init_local_group,
    train_dp,
)

SMALL = GRPOConfig(prompts_per_step=4, group_size=4, minibatches=2, microbatches=2, epochs=1, eval_every=1000,
                   n_heldout=4, kl_coef=0.05, ent_coef=0.01)


def params_digest(model) -> str:
    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def violation(fn) -> dict | None:
    """Run ``fn``; the ContractViolation it raises as a small dict (None when it raises nothing)."""
    try:
        fn()
    except ContractViolation as e:
        return {"code": e.code, "rank": e.rank, "ranks": list(e.ranks), "message": str(e)}
    return None


@contract(group_size=4)
def centred(advantages: Advantages) -> Annotated[Advantages, GroupCentred()]:
    return advantages


@contract(check_every=3)
def scaled(old_logp: Annotated[LogProbs, NoGrad()]) -> LogProbs:
    return old_logp * 1.0


def scenario_checks(rank: int, out: dict) -> None:
    from rlguard.preflight.suite import run_suite
    from rlguard.reference.distributed import wrap

    t0 = time.perf_counter()
    # 1. each data-parallel fault: the accumulation check (DDP gradient vs single-process one-pass gradient)
    for fault in ("dp_local_token_mean", "dp_local_token_mean_accum"):
        report = run_suite(DistributedReferenceAdapter(fault), only=["accumulation"])
        out[fault] = report.to_dict()
    out["t_faults"] = time.perf_counter() - t0

    # 2. bit-identical parameters with contracts on (synced) and off, under DDP, with a guard
    digests = {}
    for m in ("raise", "off"):
        with mode(m):
            from rlguard.reference.trainer import base_policy

            model = base_policy(SMALL)
            before = STATE.collectives
            train_dp(SMALL, steps=2, model=model, guard=True)
            digests[m] = params_digest(model)
            out[f"collectives_{m}"] = STATE.collectives - before
    out["digests"] = digests
    out["t_bitident"] = time.perf_counter() - t0

    # 3. the guard sees through DDP (and FSDP)
    from rlguard.reference.trainer import base_policy

    model = base_policy(SMALL)
    ddp = wrap(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    out["ddp_alias"] = violation(lambda: Guard(policy=ddp, reference=ddp.module, optimizer=opt).close())
    ref = copy.deepcopy(model)
    both = torch.optim.Adam(list(model.parameters()) + list(ref.parameters()), lr=1e-3)  # noqa: RLG008
    out["ddp_ref_in_opt"] = violation(lambda: Guard(policy=ddp, reference=ref, optimizer=both).close())
    out["ddp_ok"] = violation(lambda: Guard(policy=ddp, reference=copy.deepcopy(model).requires_grad_(False),
                                            optimizer=opt).close())
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        ref = copy.deepcopy(model).requires_grad_(False)
        fsdp = FSDP(copy.deepcopy(model), device_id=torch.device("cpu"), use_orig_params=True)
        fopt = torch.optim.Adam(fsdp.parameters(), lr=1e-3)
        out["fsdp_alias"] = violation(lambda: Guard(policy=fsdp, reference=fsdp.module, optimizer=fopt).close())
        out["fsdp_ok"] = violation(lambda: Guard(policy=fsdp, reference=ref, optimizer=fopt).close())
    except Exception as e:  # noqa: BLE001 - recorded: the test says what failed
        out["fsdp_error"] = f"{type(e).__name__}: {e}"

    # 4. groups: whole groups per rank pass; groups straddling ranks (strided sharding) fail on every rank
    rewards = torch.tensor([0., 1, 0, 1, 1, 1, 0, 0, 0.5, 0, 1, 1, 0, 0, 0, 1])
    grouped = rewards.view(-1, 4)
    adv = ((grouped - grouped.mean(-1, keepdim=True)) / (grouped.std(-1, keepdim=True) + 1e-4)).view(-1)
    out["groups_contiguous"] = violation(lambda: centred(adv.view(2, -1)[rank].clone()))
    out["groups_straddle"] = violation(lambda: centred(adv[rank::2].clone()))
    out["groups_partial"] = violation(lambda: centred(adv[:6].clone() if rank == 1 else adv[:8].clone()))

    # 5. a cheap check failing between cadence calls (check_every=3) on rank 1: held, raised on both at call 4
    good = torch.zeros(2, 5)
    bad = torch.zeros(2, 5, requires_grad=True) * 1.0
    held = []
    for call in range(1, 5):
        x = bad if (rank == 1 and call == 2) else good
        v = violation(lambda: scaled(x))
        held.append(None if v is None else {"call": call, **v})
    out["held"] = [h for h in held if h is not None]

    # 6. sync off: no collective (each rank alone)
    with sync("off"):
        before = STATE.collectives
        out["sync_off_local"] = violation(lambda: centred(adv[:6].clone())) if rank == 0 else None
        out["sync_off_collectives"] = STATE.collectives - before
    out["t_contracts"] = time.perf_counter() - t0

    # 6b. the guard's update checks under DDP: rank 1 alone forgets zero_grad; both ranks raise at that step
    def ddp_steps(forget: bool) -> None:
        model = base_policy(SMALL)
        ddp = wrap(model)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        ids = torch.randint(0, 4, (4, 6), generator=torch.Generator().manual_seed(rank))
        with Guard(policy=ddp, optimizer=opt, check_every=1):
            for _ in range(3):
                ddp(ids).float().logsumexp(-1).mean().backward()
                opt.step()
                if not forget:
                    opt.zero_grad()

    out["grads_ok"] = violation(lambda: ddp_steps(False))
    out["grads_one_rank"] = violation(lambda: ddp_steps(rank == 1))

    # 7. the data-parallel trainer with a fault on rank 1 only, caught (both ranks raise together)
    out["one_rank_caught"] = violation(
        lambda: train_dp(SMALL, fault="mask_shift" if rank == 1 else None, steps=1, guard=True))
    out["t_total"] = time.perf_counter() - t0


def scenario_uncaught(rank: int, out: dict) -> None:
    """A fault on rank 1 only and nothing catches it: the violation ends both processes."""
    out["started"] = True
    train_dp(SMALL, fault="mask_shift" if rank == 1 else None, steps=2, guard=True)
    out["finished"] = True  # never reached


def main() -> int:
    scenario, rank, world, port, path = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
    init_local_group(rank, world, port, timeout_s=60)
    set_sync("auto")
    out: dict = {"rank": rank}
    try:
        if scenario == "checks":
            scenario_checks(rank, out)
            out["status"] = "ok"
            out["t_uncaught_start"] = time.time()
            with open(path, "w") as f:
                json.dump(out, f)
            scenario_uncaught(rank, {})  # raises on both ranks: the process ends with the violation
        else:
            raise SystemExit(f"unknown scenario {scenario!r}")
    except BaseException:
        out.setdefault("status", "error")
        out["error"] = traceback.format_exc()[-3000:]
        if out["status"] == "error":
            with open(path, "w") as f:
                json.dump(out, f)
        raise
    finally:
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
