"""The reference GRPO trainer, data-parallel: ``torch.distributed`` + ``DistributedDataParallel`` (gloo on CPU).

Run it inside an initialised process group (``torchrun --nproc-per-node 2 ...`` or ``torch.multiprocessing``
with :func:`init_local_group`); without one it runs on one rank and equals the single-process trainer.

Layout: every rank samples the same global batch (same seeds; the model is tiny), then each minibatch of the
update is *sharded*: its rows sorted by token count and cut into ``world`` contiguous, equal-sized shards, rank
``r`` taking shard ``r`` (a length-grouped sampler; ranks therefore hold different token counts). The policy is
wrapped in DDP, which averages gradients over ranks. The loss is one token mean over all tokens of the
*global* minibatch: each rank divides its token sum by the global token count (one all-reduce,
:func:`rlguard.contracts.global_token_count`) and multiplies by ``world`` to undo DDP's average; microbatches
accumulate under ``no_sync()`` with the same global normaliser.

Faults (``DP_FAULTS``, data-parallel only, in ``rlguard.reference.faults``): ``dp_local_token_mean`` (each rank
normalises by its own token count, DDP averages the per-rank means) and ``dp_local_token_mean_accum`` (the same
with per-microbatch means / n_micro). Both are RLG006 and fail the preflight ``accumulation`` check, which
compares the DDP gradient with the single-process gradient over the same global batch.

``DistributedReferenceAdapter`` is the preflight adapter (``rlguard check rlguard.reference.distributed:adapter``
under ``torchrun``).
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import os
import socket
from dataclasses import replace

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from rlguard.catalog import ACCUMULATION_SCALE
from rlguard.contracts import Guard, contract, global_token_count
from rlguard.reference.adapter import ReferenceAdapter
from rlguard.reference.config import GRPOConfig
from rlguard.reference.faults import FAULTS, Fault
from rlguard.reference.pipeline import Parts, merge_stats, update
from rlguard.reference.sampling import evaluate
from rlguard.reference.task import TaskSpec, make_tasks
from rlguard.reference.trainer import base_policy, logp_gap, metrics_row, sample_prompts

__all__ = ["DP_FAULTS", "DP_CHECK_CONFIG", "DistributedReferenceAdapter", "adapter", "dp_parts", "train_dp",
           "shard_rows", "world", "rank", "init_local_group", "free_port"]


# -- process group helpers -----------------------------------------------------------------------------------
def world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (for a local process group)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_local_group(rank_: int, world_size: int, port: int, timeout_s: float = 120.0) -> None:
    """A gloo process group over 127.0.0.1 (tests, benchmarks); collectives give up after ``timeout_s``."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank_, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))


def wrap(model):
    """The policy as the data-parallel trainer trains it: DDP over the process group, the module itself alone."""
    if world() == 1 or isinstance(model, DistributedDataParallel):
        return model
    return DistributedDataParallel(model)


def unwrap(model):
    return model.module if isinstance(model, DistributedDataParallel) else model


# -- the data-parallel parts ---------------------------------------------------------------------------------
def shard_rows(rows: torch.Tensor, action_mask: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a minibatch: rows sorted by token count, cut into ``world`` equal contiguous parts."""
    w = world()
    if len(rows) % w:
        raise ValueError(f"a minibatch of {len(rows)} rows does not split evenly over {w} ranks")
    ordered = rows[action_mask[rows].sum(-1).argsort(stable=True)]
    return ordered.chunk(w)[rank()]


def _global_seqs(n_local: int) -> int:
    return n_local * world()  # shards are equal-sized (shard_rows)


def dp_minibatch_backward(model, ids, rows, action_mask, old_log_probs, advantages, ref_log_probs, cfg, parts):
    """This rank's shard ``rows`` of one minibatch: one token mean over the global minibatch's tokens."""
    w = world()
    n_tokens = global_token_count(action_mask[rows]).clamp(min=1)  # all ranks' tokens of this minibatch
    n_seqs = _global_seqs(len(rows))
    micro = rows[action_mask[rows].sum(-1).argsort(stable=True)].chunk(cfg.microbatches)
    logs = []
    for i, part in enumerate(micro):
        sync = i == len(micro) - 1 or not isinstance(model, DistributedDataParallel)
        with contextlib.nullcontext() if sync else model.no_sync():
            logits = model(ids[part]) / cfg.temperature
            ref_part = None if ref_log_probs is None else ref_log_probs[part]
            loss, stats = parts.compute_loss(logits, ids[part], old_log_probs[part], advantages[part],
                                             action_mask[part], ref_part, cfg, parts, n_tokens, n_seqs)
            (loss * w).backward()  # DDP averages over the w ranks: the sum over ranks is the global token mean
        logs.append(dict(stats, loss=float(loss.detach())))
    return merge_stats(logs)


def dp_update(model, ref_model, optimizer, batch, cfg, parts, generator):
    """The single-process update with each minibatch's rows sharded over the ranks (``model``: DDP-wrapped)."""
    return update(model, ref_model, optimizer, batch, cfg, parts, generator, shard_rows=shard_rows)


DP_FAULTS: dict[str, Fault] = {f.name: f for f in [
    Fault("dp_local_token_mean", ACCUMULATION_SCALE,
          "each rank divides its token sum by its own token count; DDP averages the per-rank means",
          "minibatch_backward", "accumulation", statically_visible=False),
    Fault("dp_local_token_mean_accum", ACCUMULATION_SCALE,
          "each rank's microbatches each their own token mean / n_micro; DDP averages over ranks",
          "minibatch_backward", "accumulation"),  # rlguard lint reports RLG006 at the division by n_micro
]}


def dp_parts(fault: str | None = None) -> Parts:
    """The data-parallel trainer's parts, with ``fault`` (a data-parallel fault or any single-process one)."""
    parts = Parts(minibatch_backward=dp_minibatch_backward, update=dp_update)
    if fault is None:
        return parts
    if fault in DP_FAULTS:
        f = DP_FAULTS[fault]
        return replace(parts, **{f.part: f.function})
    if fault not in FAULTS:
        raise KeyError(f"unknown fault {fault!r}; known: {', '.join([*DP_FAULTS, *FAULTS])}")
    f = FAULTS[fault]
    if f.part in ("minibatch_backward", "update"):
        raise ValueError(f"fault {fault!r} replaces {f.part}, which the data-parallel trainer replaces itself; "
                         "it has no data-parallel twin")
    return replace(parts, **{f.part: _under_contract(getattr(parts, f.part), f.function)})


def _under_contract(healthy, faulty):
    """The faulty twin under the healthy part's contract: the bug sits *inside* the decorated function, as in a
    real trainer, so every rank runs the same decorated calls (and their cross-rank collectives) whichever rank
    carries the fault."""
    plan = getattr(healthy, "__rlguard_contract__", None)
    if plan is None:
        return faulty

    @functools.wraps(healthy.__wrapped__)
    def twin(*args, **kwargs):
        return faulty(*args, **kwargs)

    return contract(twin, check_every=plan.check_every)


# -- training ------------------------------------------------------------------------------------------------
def train_dp(cfg: GRPOConfig = GRPOConfig(), fault: str | None = None, steps: int | None = None, on_step=None,
             model=None, guard: bool = True) -> list[dict]:
    """Data-parallel GRPO on every rank of the current process group -> this rank's metrics rows.

    ``fault``: this rank's fault (a name of ``DP_FAULTS`` or of ``FAULTS``), so a test can break one rank only.
    ``guard``: train under a ``rlguard.contracts.Guard`` over the DDP-wrapped policy (its checks then sync
    across ranks). ``model``: trained in place (default: a copy of the base policy).
    """
    torch.set_num_threads(1)
    parts = dp_parts(fault)
    steps = cfg.steps if steps is None else steps
    train_tasks, heldout_tasks = make_tasks(cfg.spec, n_heldout=cfg.n_heldout, seed=1234 + cfg.seed)
    model = base_policy(cfg) if model is None else model
    torch.manual_seed(cfg.seed)
    generator = torch.Generator().manual_seed(cfg.seed)
    ref_model = parts.make_reference(model) if cfg.kl_coef else None
    optimizer = parts.make_optimizer(model, cfg)  # sets requires_grad: before DDP registers the parameters
    ddp = wrap(model)
    g = Guard(policy=ddp, reference=ref_model, optimizer=optimizer) if guard else None
    history = []
    try:
        for step in range(steps):
            batch = parts.rollout(model, sample_prompts(train_tasks, cfg, generator), cfg, generator)
            gap = logp_gap(model, batch, cfg, parts)
            with g.update() if g is not None else contextlib.nullcontext():
                stats = parts.update(ddp, ref_model, optimizer, batch, cfg, parts, generator)
            row = dict(metrics_row(batch, stats, cfg), logp_gap=gap, step=step, rank=rank(), world=world())
            row.setdefault("kl_ref", 0.0)
            if step % cfg.eval_every == 0 or step == steps - 1:
                row["eval_pass"] = evaluate(model, heldout_tasks, cfg.spec)["pass_rate"]
            history.append(row)
            if on_step is not None:
                on_step(row)
    finally:
        if g is not None:
            g.close()
    return history


# -- the preflight adapter -----------------------------------------------------------------------------------
# 8 prompts x 8 samples; each minibatch of 32 rows splits into 16 per rank (2 ranks) or 8 (4 ranks).
DP_CHECK_CONFIG = GRPOConfig(prompts_per_step=8, group_size=8, kl_coef=0.05, ent_coef=0.01, dropout=0.1,
                             task=TaskSpec(stop_token=True))  # as CHECK_CONFIG: a stop token, dropout modules


class DistributedReferenceAdapter(ReferenceAdapter):
    """The reference adapter with the data-parallel trainer: ``backward`` and ``update`` run DDP over the process
    group (each rank its shard of the rows), so the suite's ``accumulation`` check compares the distributed
    gradient with the one-pass, single-process gradient of ``loss`` over the same global batch. Every other
    function is the single-process adapter's, on the global batch every rank holds."""

    def __init__(self, fault: str | None = None, cfg: GRPOConfig = DP_CHECK_CONFIG):
        super().__init__(None, cfg)
        self.fault = fault
        self.parts = dp_parts(fault)

    def backward(self, model, batch, rows, ref_model=None):
        ids, mask = batch["ids"], self.action_mask(batch)
        self.parts.minibatch_backward(wrap(model), ids, shard_rows(rows, mask), mask, batch["sampler_logp"],
                                      self.advantages(batch), self._ref_logp(ref_model, ids), self.cfg, self.parts)

    def update(self, model, optimizer, ref_model, batch):
        gen = torch.Generator().manual_seed(self.cfg.seed)
        return self.parts.update(wrap(model), ref_model, optimizer, batch, self.cfg, self.parts, gen)

    def run_signature(self, seed: int, steps: int):
        rows = train_dp(replace(self.cfg, seed=seed), fault=self.fault, steps=steps, guard=False)
        return [(r["reward"], r["length"], r["grad_norm"]) for r in rows]


adapter = DistributedReferenceAdapter()


def fault_adapter(fault: str | None) -> DistributedReferenceAdapter:
    return DistributedReferenceAdapter(fault)
