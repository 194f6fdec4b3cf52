"""Cross-rank pieces of the contracts: the flag exchange behind :func:`rlguard.contracts.settings.report`, and
:func:`global_token_count` for a token-mean loss over a data-parallel minibatch (RLG006).

Nothing here runs unless ``torch.distributed`` is initialised with more than one rank. Cost of one exchange:
one all-reduce of a [world] int32 vector (4 bytes per rank) on every rank; only when some rank failed, one
``all_gather_object`` of the failing ranks' violation records (small dataclasses, no tensors).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from rlguard.contracts.errors import Violation


def _device(group) -> torch.device:
    """Where the flag tensor lives: CPU for gloo/mpi (and mixed cpu:gloo backends), the current GPU for NCCL."""
    backend = str(dist.get_backend(group)).lower()
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _portable(v: Violation) -> Violation:
    """The record without ``details`` (it may hold anything): what crosses ranks."""
    return Violation(v.code, v.function, v.argument, v.message)


def exchange(local: list[Violation], group=None) -> tuple[list[Violation], int, tuple[int, ...], int] | None:
    """One synchronised call: every rank of ``group`` calls this at the same point, failed or not.

    Returns ``None`` when no rank failed; else ``(violations to show, the rank they come from, all failing
    ranks, this rank)``: a failing rank shows its own violations, the others the first failing rank's.
    """
    world = dist.get_world_size(group)
    me = dist.get_rank(group)
    flags = torch.zeros(world, dtype=torch.int32, device=_device(group))
    if local:
        flags[me] = 1
    dist.all_reduce(flags, op=dist.ReduceOp.SUM, group=group)
    failed = tuple(int(r) for r in torch.nonzero(flags.cpu()).flatten().tolist())
    if not failed:
        return None
    gathered: list = [None] * world
    dist.all_gather_object(gathered, [_portable(v) for v in local] if local else None, group=group)
    if local:
        return local, me, failed, me
    first = failed[0]
    return list(gathered[first] or []), first, failed, me


def distributed_world(group=None) -> int:
    """The world size of ``group`` when torch.distributed is initialised, else 1."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(group)
    return 1


def global_token_count(mask: torch.Tensor, group=None) -> torch.Tensor:
    """The number of loss tokens (``mask != 0``) of the *global* minibatch: this rank's count summed over ranks.

    A data-parallel token-mean loss divides each rank's token sum by this count (and, when DDP averages
    gradients over W ranks, multiplies by W), so that the gradient equals the single-process gradient of one
    token mean over all ranks' tokens (RLG006). Each rank dividing by its own count is the fault: with unequal
    token counts across ranks, DDP's average of per-rank means weighs a token of a short shard more. One
    all-reduce of a scalar; in one process it is just the local count. Call it on every rank.
    """
    count = (mask.detach() != 0).sum().to(torch.float64)
    if distributed_world(group) > 1:
        count = count.to(_device(group))
        dist.all_reduce(count, op=dist.ReduceOp.SUM, group=group)
        count = count.to(mask.device)
    return count.to(torch.float32 if not mask.is_floating_point() else mask.dtype)
