"""rlguard under torch.distributed: 2 gloo processes on 127.0.0.1 (CPU), as CI can run them.

Two process groups in all (starting processes is the expensive part): ``tests/dist_worker.py checks`` runs the
contracts and preflight cases of both ranks in one group and ends with a fault on rank 1 that nothing catches;
``torchrun ... -m rlguard check`` runs the whole suite on the healthy data-parallel reference trainer. Every
process has a hard timeout and is killed when it runs over.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
if not (torch.distributed.is_available() and torch.distributed.is_gloo_available()):  # pragma: no cover
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

pytestmark = pytest.mark.slow  # two process groups, about a minute on two loaded cores
torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parent.parent
WORKER = Path(__file__).resolve().parent / "dist_worker.py"
TIMEOUT_S = 150  # per process group; both processes are killed past it
PROMPT_S = 30  # a one-rank fault must end both processes within this after it is injected


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", RLGUARD="raise")
    env.pop("RLGUARD_SYNC", None)
    return env


def _run_group(argvs: list[list[str]], logs: list[Path], timeout: float = TIMEOUT_S) -> tuple[list[int], float]:
    """Start the processes, wait for all with one deadline, kill every one still running past it."""
    start = time.monotonic()
    procs = []
    for argv, log in zip(argvs, logs):
        f = open(log, "w")
        procs.append((subprocess.Popen(argv, cwd=ROOT, env=_env(), stdout=f, stderr=subprocess.STDOUT), f))
    codes = []
    try:
        for p, _ in procs:
            codes.append(p.wait(timeout=max(1.0, timeout - (time.monotonic() - start))))
    except subprocess.TimeoutExpired:
        for p, _ in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        pytest.fail(f"process group ran over {timeout:.0f} s (killed); logs: "
                    + " | ".join(log.read_text()[-1500:] for log in logs))
    finally:
        for _, f in procs:
            f.close()
    return codes, time.monotonic() - start


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    """Both ranks of the ``checks`` scenario -> (per-rank results, return codes, logs, end time)."""
    tmp = tmp_path_factory.mktemp("dist")
    port = _free_port()
    outs = [tmp / f"rank{r}.json" for r in range(2)]
    logs = [tmp / f"rank{r}.log" for r in range(2)]
    argvs = [[sys.executable, str(WORKER), "checks", str(r), "2", str(port), str(outs[r])] for r in range(2)]
    codes, elapsed = _run_group(argvs, logs)
    end = time.time()
    results = []
    for r in range(2):
        assert outs[r].exists(), f"rank {r} wrote no results:\n{logs[r].read_text()[-3000:]}"
        results.append(json.loads(outs[r].read_text()))
        assert results[r]["status"] == "ok", results[r].get("error")
    return {"results": results, "codes": codes, "logs": [log.read_text() for log in logs], "end": end,
            "elapsed": elapsed}


def test_each_dp_fault_caught_with_its_code_on_both_ranks(workers):
    from rlguard.reference.distributed import DP_FAULTS

    for fault, spec in DP_FAULTS.items():
        for rank, res in enumerate(workers["results"]):
            (check,) = res[fault]["checks"]
            assert check["name"] == spec.expected_check == "accumulation"
            assert check["code"] == spec.code == "RLG006"
            assert not check["passed"], (rank, fault, check)
            assert check["value"] > 1e-2  # far outside the 1e-4 tolerance: ranks hold different token counts
            assert len(check["per_rank"]) == 2 and all(v > 1e-2 for v in check["per_rank"])
            assert "failed on rank(s) 0, 1" in check["hint"]
            assert res[fault]["world_size"] == 2 and not res[fault]["passed"]


def test_contracts_on_and_off_bit_identical_under_ddp(workers):
    for res in workers["results"]:
        assert res["digests"]["raise"] == res["digests"]["off"]
        assert res["collectives_raise"] > 0 and res["collectives_off"] == 0
    assert workers["results"][0]["digests"] == workers["results"][1]["digests"]  # DDP keeps the ranks equal
    assert workers["results"][0]["collectives_raise"] == workers["results"][1]["collectives_raise"]


def test_guard_sees_through_ddp_and_fsdp(workers):
    for rank, res in enumerate(workers["results"]):
        for case, words in (("ddp_alias", "wrap the same"), ("ddp_ref_in_opt", "in the optimizer")):
            v = res[case]
            assert v is not None and v["code"] == "RLG008" and words in v["message"], (case, v)
            assert v["ranks"] == [0, 1] and v["rank"] == rank and f"[rank {rank}]" in v["message"]
        assert res["ddp_ok"] is None
        assert "fsdp_error" not in res, res.get("fsdp_error")  # FSDP (v1) constructs on CPU with gloo here
        assert res["fsdp_alias"]["code"] == "RLG008" and res["fsdp_ok"] is None


def test_groups_must_not_straddle_ranks(workers):
    for rank, res in enumerate(workers["results"]):
        assert res["groups_contiguous"] is None  # whole groups per rank
        v = res["groups_straddle"]  # strided sharding: every rank's groups mix prompts
        assert v["code"] == "RLG009" and v["ranks"] == [0, 1] and "straddle ranks" in v["message"]
        v = res["groups_partial"]  # rank 1 holds 6 values of G=4: a group cut between ranks
        assert v["code"] == "RLG009" and v["ranks"] == [1] and v["rank"] == 1
        assert "rank 1 of 2: 6 values are not a whole number of groups" in v["message"]
        assert ("not on this rank" in v["message"]) == (rank == 0)


def test_check_between_cadence_calls_is_held_to_the_next_synced_call(workers):
    for res in workers["results"]:  # rank 1 failed at call 2 (check_every=3): both raise at call 4, not before
        assert [(h["call"], h["code"], h["ranks"]) for h in res["held"]] == [(4, "RLG003", [1])]


def test_guard_update_checks_raise_on_both_ranks(workers):
    for rank, res in enumerate(workers["results"]):
        assert res["grads_ok"] is None  # a healthy DDP loop under the guard's RLG013/RLG014 checks
        v = res["grads_one_rank"]  # rank 1 alone forgot zero_grad: found there before its step, raised on both
        assert v["code"] == "RLG013" and v["ranks"] == [1] and v["rank"] == 1, v
        assert ("not on this rank" in v["message"]) == (rank == 0)


def test_sync_off_means_no_collective(workers):
    r0, r1 = workers["results"]
    assert r0["sync_off_local"]["ranks"] == [] and r0["sync_off_local"]["rank"] is None
    assert r1["sync_off_local"] is None
    assert r0["sync_off_collectives"] == r1["sync_off_collectives"] == 0


def test_one_rank_fault_raises_on_both_ranks_naming_it(workers):
    for rank, res in enumerate(workers["results"]):
        v = res["one_rank_caught"]
        assert v["code"] == "RLG001" and v["ranks"] == [1] and v["rank"] == 1
        assert "contract failed on rank(s) 1" in v["message"] and "build_action_mask" in v["message"]


def test_one_rank_fault_uncaught_ends_both_processes_promptly(workers):
    assert workers["codes"][0] != 0 and workers["codes"][1] != 0
    for rank, log in enumerate(workers["logs"]):
        assert "ContractViolation" in log and "RLG001" in log, log[-2000:]
        assert f"[rank {rank}] contract failed on rank(s) 1" in log
    started = max(res["t_uncaught_start"] for res in workers["results"])
    assert workers["end"] - started < PROMPT_S


def test_healthy_dp_reference_passes_every_check_under_torchrun(tmp_path):
    from rlguard.preflight.checks import CHECKS

    out = tmp_path / "report"
    argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
            "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
            "-m", "rlguard", "check", "rlguard.reference.distributed:adapter", "-q", "--out", str(out)]
    log = tmp_path / "torchrun.log"
    (code,), _ = _run_group([argv], [log])
    text = log.read_text()
    assert code == 0, text[-3000:]
    assert text.count("all checks passed") == 1  # printed once, by rank 0
    data = json.loads((out / "report.json").read_text())
    assert data["passed"] and data["world_size"] == 2
    assert [c["name"] for c in data["checks"]] == list(CHECKS)
    for c in data["checks"]:
        assert c["passed"] and not c["skipped"], c
        assert len(c["per_rank"]) == 2
    acc = next(c for c in data["checks"] if c["name"] == "accumulation")
    assert acc["value"] < 1e-5  # the DDP gradient equals the single-process one over the same global batch


def test_single_process_no_collectives_and_dp_faults_invisible():
    """Without a process group: no collective, and a per-rank normaliser is the healthy one (world size 1)."""
    from rlguard.contracts.settings import STATE
    from rlguard.preflight.suite import run_suite
    from rlguard.reference.distributed import DistributedReferenceAdapter

    assert not torch.distributed.is_initialized()
    before = STATE.collectives
    report = run_suite(DistributedReferenceAdapter("dp_local_token_mean"), only=["accumulation", "group_mean"])
    assert STATE.collectives == before
    assert report.passed and report.world_size == 1 and "world_size" not in report.to_dict()
