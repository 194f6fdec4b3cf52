"""A local Ray job for tests/test_verl_integration.py: two verl workers on the CPU, started by verl's own
``RayWorkerGroup``, with the checks turned on the way a verl run turns them on (``RLGUARD_VERL`` and Ray's
``worker_process_setup_hook`` in ``ray.init``'s runtime_env, no code in the workers). Each worker joins a gloo
process group, as verl's FSDP workers join theirs, and calls verl's vanilla policy loss; on ``--faulty-rank``
the old log-probs carry autograd history (RLG003).

    python tests/verl_ray_job.py --faulty-rank 1      # prints one JSON line per phase

Run as a script so that Ray ships the worker class by value (it is defined in ``__main__``).
"""

from __future__ import annotations

import argparse
import json
import os
import time
import warnings


def say(**fields) -> None:
    print(json.dumps(fields), flush=True)


def make_worker_class():
    from verl.single_controller.base import Worker
    from verl.single_controller.base.decorator import Dispatch, register

    class ToyActorWorker(Worker):
        """A verl worker with an actor's role whose update calls verl's policy loss as the actor's ppo_loss does."""

        def __init__(self):
            super().__init__()
            self.role = "actor"

        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def update_actor(self, faulty_rank: int) -> dict:
            import torch
            import torch.distributed as dist

            if not dist.is_initialized():
                dist.init_process_group("gloo")
            from rlguard.integrations.verl import installed
            from verl.trainer.ppo import core_algos
            from verl.workers.config import FSDPActorConfig

            config = FSDPActorConfig(strategy="fsdp", rollout_n=2, ppo_micro_batch_size_per_gpu=2)
            logp = torch.randn(4, 3, requires_grad=True)
            old = logp * 1.0 if self.rank == faulty_rank else logp.detach()  # recomputed with autograd on
            loss, _ = core_algos.get_policy_loss_fn("vanilla")(
                old_log_prob=old, log_prob=logp, advantages=torch.randn(4, 3), response_mask=torch.ones(4, 3),
                loss_agg_mode="token-mean", config=config)
            inst = installed()
            return {"rank": self.rank, "loss": float(loss.detach()), "installed": inst is not None and inst.mode}

    return ToyActorWorker


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--faulty-rank", type=int, default=1)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    start = time.perf_counter()
    import ray

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, runtime_env={
        "env_vars": {"RLGUARD_VERL": "raise", "OMP_NUM_THREADS": "1"},
        "worker_process_setup_hook": "rlguard.integrations.verl.worker_setup"})
    say(phase="ray up", seconds=round(time.perf_counter() - start, 1))
    from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup

    pool = RayResourcePool([2], use_gpu=False, max_colocate_count=1)
    group = RayWorkerGroup(pool, RayClassWithInitArgs(cls=ray.remote(make_worker_class())), device_name="cpu")
    say(phase="workers up", seconds=round(time.perf_counter() - start, 1))
    say(phase="healthy", results=group.update_actor(faulty_rank=-1))
    try:
        group.update_actor(faulty_rank=args.faulty_rank)
        say(phase="faulty", raised=None)
    except Exception as exc:  # noqa: BLE001 - what reaches the driver is the test's subject
        cause = getattr(exc, "cause", None)
        say(phase="faulty", raised=type(exc).__name__, cause=type(cause).__name__ if cause else None,
            code=getattr(cause, "code", None), ranks=list(getattr(cause, "ranks", ()) or ()), message=str(exc))
    say(phase="done", seconds=round(time.perf_counter() - start, 1))
    ray.shutdown()
    os._exit(0)  # Ray's atexit handlers can linger on a loaded machine; the job's results are out


if __name__ == "__main__":
    main()
