"""Where a wrapped verl function runs: the worker's rank and role, for the messages of its violations.

verl runs the policy loss (and the KL penalty of ``use_kl_loss``) in Ray worker processes, one per GPU, and the
advantage estimators on the driver. A violation raised in a worker reaches the driver as Ray's ``RayTaskError``
around it, so the message itself must say which worker saw it. What is read, in order:

- the rank: ``RANK`` and ``WORLD_SIZE`` from the environment (verl's ``RayWorkerGroup`` sets them for every
  worker it starts, as ``torch.distributed`` expects them), else ``torch.distributed``'s rank and world size
  when a process group is initialised;
- the role: the ``role`` attribute (``"actor"``, ``"actor_rollout"``, ``"actor_rollout_ref"``, ``"ref"``, ...)
  of the verl ``Worker`` found on the call stack (``ActorRolloutRefWorker.update_actor`` calls the loss), else
  that worker's class name, else the Ray actor's name when the process is a Ray actor.

Nothing is found on the driver: its messages name the function only.
"""

from __future__ import annotations

import os
import sys

_WORKER_MODULE = "verl.single_controller.base.worker"


def rank_text() -> str:
    """"rank 1 of 4" from the environment or torch.distributed; "" when neither says."""
    rank, world = os.environ.get("RANK"), os.environ.get("WORLD_SIZE")
    if rank is not None and rank.strip().isdigit():
        return f"rank {int(rank)}" + (f" of {int(world)}" if world and world.strip().isdigit() else "")
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return f"rank {dist.get_rank()} of {dist.get_world_size()}"
    return ""


def _worker_class():
    """verl's ``Worker`` base class if verl's controller is loaded (a worker process has it), else None."""
    module = sys.modules.get(_WORKER_MODULE)
    return getattr(module, "Worker", None)


def role_text(frame=None) -> str:
    """The role of the verl worker whose method is on the call stack above ``frame``; "" when none is."""
    worker = _worker_class()
    if worker is not None:
        frame = frame or sys._getframe(1)
        while frame is not None:
            owner = frame.f_locals.get("self")
            if isinstance(owner, worker):
                role = getattr(owner, "role", None)
                return str(role) if isinstance(role, str) and role else type(owner).__name__
            frame = frame.f_back
    return _ray_actor_name()


def _ray_actor_name() -> str:
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return ""
    try:
        context = ray.get_runtime_context()
        return context.get_actor_name() or "" if context.get_actor_id() else ""
    except Exception:  # noqa: BLE001 - only a name for a message; Ray's context may be half set up
        return ""


def describe_place() -> str:
    """" [rank 1 of 4, role actor_rollout_ref]" for a worker, "" on the driver (or a plain process)."""
    rank, role = rank_text(), role_text(sys._getframe(1))
    parts = [p for p in (rank, f"role {role}" if role else "") if p]
    return " [" + ", ".join(parts) + "]" if parts else ""
