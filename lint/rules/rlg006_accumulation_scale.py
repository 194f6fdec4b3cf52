"""RLG006 accumulation-scale: gradient accumulation that averages per-microbatch token means."""

from __future__ import annotations

import re
from typing import Iterator

import libcst as cst

from rlguard.catalog import ACCUMULATION_SCALE
from rlguard.lint.analysis import Analysis, dotted_name
from rlguard.lint.analysis import accumulation as A
from rlguard.lint.analysis import semantics as S
from rlguard.lint.analysis.callers import caller_loops
from rlguard.lint.analysis.index import children, key_entry, key_of, names_read
from rlguard.lint.analysis.loops import Loop, Training, training
from rlguard.lint.analysis.roles import backward_loss, is_mask_by_use, names_along
from rlguard.lint.analysis.signs import zero_one
from rlguard.lint.rule import Invalid, Rule, Valid, Violation

PASS_THROUGH_METHODS = frozenset({
    "float", "double", "half", "bfloat16", "bool", "long", "int", "to", "type", "type_as", "contiguous",
    "clone", "detach", "cpu", "cuda", "view", "reshape", "view_as", "reshape_as", "squeeze", "unsqueeze",
    "expand", "expand_as", "flatten", "requires_grad_", "as_subclass",
})
ACCUM_COUNT = re.compile(
    r"(?i)\w*(grad_accum\w*|gradient_accumulation\w*|accum_steps|accum|accumulation_steps|accumulate\w*|"
    r"n_micro\w*|num_micro\w*|micro_?steps|n_mbs?|num_mbs?|n_chunks|num_chunks|n_splits|num_splits|"
    r"micro_batches|n_micro_batches|num_microbatches)")
MICRO_WORD = re.compile(
    r"(?i)(^|_)(micro\w*|mbs?|accum\w*|grad_accum\w*|gradient_accumulation\w*|chunks?|splits?|parts?|"
    r"n_micro\w*|num_micro\w*)($|_)")

MASKED_MEANS = frozenset({"masked_mean", "mean_masked", "masked_average", "masked_avg", "masked_token_mean",
                          "token_mean", "mean_tokens"})
COUNT_METHODS = frozenset({"sum", "count_nonzero", "nansum"})
CLAMPS = frozenset({"clamp", "clamp_min", "clip", "clamp_", "float", "to", "type_as", "item", "detach", "double"})
STEP_NAME = re.compile(r"(?i)\w*step")
COUNT_NAME = re.compile(r"(?i)\w*(n_tok\w*|num_tok\w*|tokens?_count|n_valid\w*|num_valid\w*|\w*_tokens|count)")
DEPTH = 10
PER_CALL_MESSAGE = ("this helper's backward takes its microbatch's own token mean, and every caller runs it once per "
                    "microbatch of an accumulation loop with no step in between: the per-microbatch means are "
                    "summed, so the gradient is scaled by their number and tokens of small microbatches weigh more; "
                    "pass the whole minibatch's token count in and divide the per-token sum by it")


# a loss function in Hugging Face's Trainer interface ({count}: what the token sum is divided by)
_HF_LOSS = ("def token_loss(outputs, labels, num_items_in_batch=None):\n"
            "    labels = labels[..., 1:]\n"
            "    mask = labels != -100\n"
            "    logp = selective_log_softmax(outputs.logits[:, :-1], labels.clamp(min=0))\n"
            "    if num_items_in_batch is None:\n"
            "        num_items_in_batch = mask.sum()\n"
            "    return -(logp * mask).sum() / {count}\n")


# a loss function with one branch per loss type; {dapo}: what the accumulated-count branch divides by
_BRANCHED_LOSS = ("def branch_loss(self, per_token_loss, mask, inputs):\n"
                  "    if self.loss_type == 'bnpo':\n"
                  "        loss = (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)\n"
                  "        normalizer = self.current_gradient_accumulation_steps\n"
                  "        loss = loss / normalizer\n"
                  "    else:\n"
                  "        normalizer = inputs['num_items_in_batch'].clamp(min=1.0) / self.world_size\n"
                  "        loss = (per_token_loss * mask).sum() / {dapo}\n"
                  "    return loss\n")


class AccumulationScale(Rule):
    """
    ## What it flags
    A `.backward()` on a loss that is a token mean over the *microbatch's own* mask
    (`masked_mean(x, mb_mask)`, `(x * mb_mask).sum() / mb_mask.sum()`, `x[mb_mask].mean()`, or a loss helper
    handed the microbatch's token count), when that loss is accumulated over microbatches: divided by the
    number of microbatches (`/ n_micro`, `/ grad_accum_steps`, `/ len(parts)`, `loss /= accum`), or summed
    without division in a microbatch loop (`for mb in batch.chunk(n)`, `range(accum_steps)`) that has no
    unconditional optimizer step.

    The same when the backward sits in a helper with no loop of its own and every call of the helper in the
    module runs once per microbatch of such a loop (the helper's parameters are judged by the caller's
    arguments: a count handed in from the microbatch is local, one computed before the loop is not).

    A loss function handed `num_items_in_batch` (Hugging Face's Trainer passes the token count of the whole
    accumulated batch under that name, and then does not divide the returned loss by the accumulation steps)
    that returns its token sum divided by its own microbatch's count (`mask.sum()`) and divides by the handed
    count nowhere. The same in one branch of a loss function that binds the accumulated count itself
    (`normalizer = inputs["num_items_in_batch"] / world_size`, read from the batch by its key) and, while that
    name still holds it, returns the token sum divided by the microbatch's own count instead.

    Across data-parallel ranks: a loss multiplied by the world size (`loss * world_size / n_tokens`, undoing
    the gradient averaging) whose token count is summed on this rank only (a mask sum that no collective takes
    in place), and an in-place collective on a temporary whose result is dropped (`dist.all_reduce(mask.sum())`
    in a function that takes a backward). A count capped at 1 (`loss_sum / min(n_tokens, 1)`, `clamp(max=1)`)
    is the empty-batch guard written the wrong way round: the loss is then a sum.

    Not flagged: `(loss_sum / total_tokens).backward()` where `total_tokens` is the whole minibatch's count
    computed outside the microbatch loop; one pass with no loop; sequence-level losses (`masked_mean(x, m,
    dim=-1).mean() / accum`: with equal sequences per microbatch that is the exact mean, a different
    aggregation, see RLG010); a minibatch loop that steps the optimizer each iteration.

    ## Why it is wrong
    The mean of per-microbatch token means is not the token mean of the minibatch: a token of a microbatch
    with few tokens weighs more than one of a microbatch with many. With length-sorted or unevenly padded
    microbatches, short (often failing or truncated) answers dominate the gradient, and the result depends on
    the microbatch size, so changing `grad_accum_steps` changes training. The symptom: runs that should be
    identical differ with the accumulation setting, and the accumulated gradient differs from the one-pass
    gradient by far more than rounding.

    ## Example
    ```python
    for mb in minibatch.chunk(n_micro):
        loss = masked_mean(pg_losses(mb), mb["mask"])
        (loss / n_micro).backward()
    optimizer.step()
    ```

    ## Use instead
    ```python
    total_tokens = minibatch["mask"].sum()
    for mb in minibatch.chunk(n_micro):
        loss_sum = (pg_losses(mb) * mb["mask"]).sum()
        (loss_sum / total_tokens).backward()
    optimizer.step()
    ```

    ## Runtime state
    Whether gradients are averaged across ranks, and whether a count is summed across ranks by code out of
    view, is runtime state: the linter reports only a world-size factor or a dropped collective it can see.
    The accumulation preflight check (the accumulated gradient equals the one-pass gradient, relative error
    < 1e-4, on one or several ranks) covers the rest.

    ## Fix
    No automatic fix: the whole minibatch's token count has to be computed before the loop (and summed across
    data-parallel ranks), which needs names the code does not have.

    ## Options
    `[tool.rlguard.names]` `mask = [...]` adds your own names for loss masks.
    """

    code = ACCUMULATION_SCALE
    # both a backward and some accumulation vocabulary (lookaheads at the start: one linear scan each)
    triggers = (r"(?i)\.backward\s*\(|num_items_in_batch",
                r"(?i)accum|micro|\.chunk\(|\.split\(|\bmbs?\b|\bparts\b|\bn_chunks\b|num_items_in_batch")

    VALID = [
        Valid("def fixed_cross_entropy(source, target, num_items_in_batch=None, ignore_index=-100):\n"
              "    reduction = 'sum' if num_items_in_batch is not None else 'mean'\n"
              "    loss = cross_entropy_loss(source, target, ignore_index=ignore_index)\n"
              "    if reduction == 'sum':\n"
              "        return loss.sum() / num_items_in_batch\n"
              "    return loss.sum() / (target != ignore_index).sum()\n",
              why="the name bound from the count is a mode, not the count; without the count the microbatch's own "
                  "is right", capability="FP", style="functional"),
        Valid(_BRANCHED_LOSS.format(dapo="normalizer"), why="the branch divides by the accumulated count it binds; "
              "the other divides its microbatch mean by the accumulation steps", capability="C2", style="class"),
        Valid(_HF_LOSS.format(count="num_items_in_batch"),
              why="the token sum divided by the accumulated batch's count (its own count only when none is given)",
              capability="C6", style="functional"),
        Valid("total_tokens = mask.sum()\n"
              "for mb in batch.chunk(n_micro):\n"
              "    loss_sum = (pg_loss(mb) * mb['mask']).sum()\n"
              "    (loss_sum / total_tokens).backward()\n"
              "optimizer.step()\n", "normalised by the whole minibatch's token count"),
        Valid("loss = masked_mean(pg_losses, response_mask)\n"
              "loss.backward()\n"
              "optimizer.step()\n", "one pass, no accumulation"),
        Valid("for mb in batch.chunk(n_micro):\n"
              "    per_seq = masked_mean(pg_losses(mb), mb['mask'], dim=-1)\n"
              "    (per_seq.mean() / n_micro).backward()\n"
              "optimizer.step()\n", "sequence-level mean: out of scope"),
        Valid("for start in range(0, batch_size, minibatch_size):\n"
              "    mb = slice(start, start + minibatch_size)\n"
              "    loss = masked_mean(pg_losses[mb], action_mask[mb])\n"
              "    optimizer.zero_grad()\n"
              "    loss.backward()\n"
              "    optimizer.step()\n", "a minibatch loop stepping every iteration: no accumulation"),
        Valid("n_tokens = action_mask[rows].sum().clamp(min=1)\n"
              "for part in rows.chunk(cfg.microbatches):\n"
              "    loss, stats = compute_loss(logits, action_mask[part], n_tokens)\n"
              "    loss.backward()\n", "helper handed the minibatch's token count"),
        Valid("num_tokens = sum(mb['mask'].sum() for mb in micro_batches)\n"
              "for mb in micro_batches:\n"
              "    loss = (per_token_loss(mb) * mb['mask']).sum() / num_tokens\n"
              "    loss.backward()\n", "global count summed over the microbatches beforehand"),
        Valid("for mb in micro_batches:\n"
              "    tok = mb['mask'].sum()\n"
              "    loss = masked_mean(per_token_loss(mb), mb['mask']) * tok / total_tokens\n"
              "    loss.backward()\n", "each microbatch mean reweighted by its share of tokens"),
        Valid("for i, mb in enumerate(batch.split(mb_size)):\n"
              "    loss = (per_token_loss(mb) * mb.mask).sum() / global_token_count\n"
              "    loss.backward()\n"
              "    if (i + 1) % accum_steps == 0:\n"
              "        optimizer.step()\n", "sum over a global count, conditional step"),
        Valid("def micro_backward(policy, mb, total_tokens):\n"
              "    per_tok = -token_logps(policy, mb) * mb['adv'][:, None]\n"
              "    loss = (per_tok * mb['mask']).sum() / total_tokens\n"
              "    loss.backward()\n"
              "\n"
              "def update(policy, opt, batch):\n"
              "    total = batch['mask'].sum()\n"
              "    opt.zero_grad()\n"
              "    for mb in batch.split(8):\n"
              "        micro_backward(policy, mb, total)\n"
              "    opt.step()\n",
              "the helper is handed the whole minibatch's count by its caller", capability="C5",
              style="functional"),
        Valid("class Learner:\n"
              "    def _train_on(self, mb):\n"
              "        loss = masked_mean(self.per_token_loss(mb), mb['mask'])\n"
              "        loss.backward()\n"
              "\n"
              "    def update(self, batch):\n"
              "        for mb in batch.split(self.micro_size):\n"
              "            self.opt.zero_grad()\n"
              "            self._train_on(mb)\n"
              "            self.opt.step()\n",
              "the caller steps after every call: one update per microbatch, nothing accumulates",
              capability="C5", style="class"),
        Valid("def fwd_bwd(m, b):\n"
              "    l = masked_mean(tok_loss(m, b), b['mask'])\n"
              "    l.backward()\n"
              "\n"
              "for step in range(n_steps):\n"
              "    b = next(loader)\n"
              "    fwd_bwd(m, b)\n"
              "    o.step(); o.zero_grad()\n",
              "each call is a whole update (the loop steps each iteration), no microbatch loop",
              capability="C5", style="script"),
        Valid("def pg_step(pi, opt, batches):\n"
              "    opt.zero_grad()\n"
              "    for mb in batches.split(4):\n"
              "        m = mb['mask']\n"
              "        l = (tok_loss(pi, mb) * m).sum() / (1e-8 + m.sum())\n"
              "        l.backward()\n"
              "        opt.step(); opt.zero_grad()\n",
              "an epsilon written first, one step per microbatch: a plain token mean", capability="C9",
              style="script"),
        Valid("def update(policy, opt, batch):\n"
              "    n_tokens = batch['mask'].sum()\n"
              "    for mb in batch.split(8):\n"
              "        loss = (token_loss(policy, mb) * mb['mask']).sum() / max(n_tokens, 1)\n"
              "        loss.backward()\n"
              "    opt.step()\n",
              "the empty-batch guard the right way round, on the whole minibatch's count", capability="C9",
              style="functional"),
        Valid("class Trainer:\n"
              "    def update(self, batch):\n"
              "        count = batch.mask.sum().clamp(min=1)\n"
              "        for mb in batch.chunk(self.n_micro):\n"
              "            loss = (self.per_token(mb) * mb.mask).sum() / count\n"
              "            loss.backward()\n"
              "        self.opt.step()\n",
              "clamp(min=1) guards the count from below", capability="C9", style="class"),
        Valid("class Actor:\n"
              "    def update(self, data):\n"
              "        for minibatch in data.split(self.config.minibatch_size):\n"
              "            n_resp = minibatch.batch['resp_mask'].sum()\n"
              "            dist.all_reduce(n_resp, op=dist.ReduceOp.SUM)\n"
              "            for micro in minibatch.split(self.config.micro_batch_size):\n"
              "                part = self.token_loss(micro) * micro.batch['resp_mask']\n"
              "                loss = part.sum() * self.dp_size / n_resp\n"
              "                loss.backward()\n"
              "            self.optimizer.step()\n",
              "the count is summed across ranks in place before the world size undoes the averaging",
              capability="C9", style="framework"),
        Valid("import torch.distributed as dist\n"
              "\n"
              "def update(policy, opt, batch):\n"
              "    n_tok = batch['mask'].sum()\n"
              "    dist.all_reduce(n_tok)\n"
              "    for mb in batch.split(8):\n"
              "        loss = (token_loss(policy, mb) * mb['mask']).sum() * dist.get_world_size() / n_tok\n"
              "        loss.backward()\n"
              "    opt.step()\n",
              "the collective takes the count variable itself", capability="C9", style="functional"),
        Valid("tot = torch.clamp(mask.sum(), min=1)\n"
              "for mb in idx.chunk(accum):\n"
              "    l = (tl(pi, X[mb]) * mask[mb]).sum() / tot\n"
              "    l.backward()\n"
              "opt.step()\n", "torch.clamp with a lower bound on the whole batch's count", capability="C9",
              style="script"),
        Valid("def update(policy, opt, batch, world_size):\n"
              "    every_mask = gather_from_all(batch['mask'])\n"
              "    for mb in batch.split(8):\n"
              "        loss = (token_loss(policy, mb) * mb['mask']).sum() * world_size / every_mask.sum()\n"
              "        loss.backward()\n"
              "    opt.step()\n",
              "the count is taken over a mask gathered from every rank", capability="C9", style="functional"),
        Valid(
              "def update(model, opt, rows, ids, adv, n_micro):\n"
              "    n_tok = (ids[:, 1:] != 0).sum()\n"
              "    for part in rows.chunk(n_micro):\n"
              "        w = torch.tensor(ids[part] != 0, dtype=torch.bool)[:, 1:]\n"
              "        lp = model(ids[part]).log_softmax(-1)[:, :-1].gather(-1, ids[part][:, 1:, None]).squeeze(-1)\n"
              "        o = lp * adv[part][:, None]\n"
              "        o = (o * w).sum() / n_tok\n"
              "        (-o).backward()\n"
              "    opt.step()\n",
              "each microbatch's token sum divided by the whole batch's token count", capability="C2", style="functional"),
    ]
    INVALID = [
        Invalid(_BRANCHED_LOSS.format(dapo="mask.sum()"), line=8,
                why="the branch binds the accumulated count and divides by the microbatch's own count instead",
                capability="C2", style="class"),
        Invalid(_HF_LOSS.format(count="mask.sum()"), line=7,
                why="handed the accumulated batch's count and divided by the microbatch's own", capability="C6",
                style="functional"),
        Invalid("for mb in batch.chunk(n_micro):\n"
                "    loss = masked_mean(pg_losses(mb), mb['mask'])\n"
                "    (loss / n_micro).backward()\n"
                "optimizer.step()\n", line=3),
        Invalid("loss = masked_mean(pg_losses, response_mask) / self.args.gradient_accumulation_steps\n"
                "loss.backward()\n", line=1, why="HF-style per-call scaling"),
        Invalid("for part in parts:\n"
                "    m = part['loss_mask']\n"
                "    loss = (per_token_loss(part) * m).sum() / m.sum()\n"
                "    (loss / len(parts)).backward()\n", line=4),
        Invalid("for i in range(grad_accum_steps):\n"
                "    mb = next(it)\n"
                "    loss = -(ratio(mb) * adv(mb))[mb.action_mask.bool()].mean()\n"
                "    loss /= grad_accum_steps\n"
                "    loss.backward()\n"
                "optimizer.step()\n", line=4, why="masked-select mean, augmented division"),
        Invalid("for mb in minibatch.split(micro_size):\n"
                "    loss = masked_mean(pg_losses(mb), mb.completion_mask)\n"
                "    loss.backward()\n"
                "optimizer.step()\n", line=3, why="summed without division"),
        Invalid("def minibatch_backward(model, rows, action_mask, cfg, parts):\n"
                "    micro = rows.chunk(cfg.microbatches)\n"
                "    n_micro = len(micro)\n"
                "    for part in micro:\n"
                "        n_tokens = action_mask[part].sum().clamp(min=1)\n"
                "        loss, stats = parts.compute_loss(model, action_mask[part], n_tokens)\n"
                "        (loss / n_micro).backward()\n", line=7, why="loss helper handed the microbatch's count", preview=True),
        Invalid("class Trainer:\n"
                "    def train_step(self, mbs):\n"
                "        for mb in mbs:\n"
                "            with self.accelerator.accumulate(self.model):\n"
                "                loss = self.token_loss(mb)\n"
                "                self.accelerator.backward(loss / self.grad_accum)\n"
                "\n"
                "    def token_loss(self, mb):\n"
                "        mask = mb['response_mask']\n"
                "        return (self.per_token(mb) * mask).sum() / mask.sum()\n", line=6,
                why="a same-module helper returns the microbatch token mean"),
        Invalid("for i, mb in enumerate(micro_batches):\n"
                "    loss = masked_mean(per_token_loss(mb), mb['mask'])\n"
                "    scaler.scale(loss / accumulation_steps).backward()\n"
                "    if (i + 1) % accumulation_steps == 0:\n"
                "        scaler.step(optimizer)\n", line=3, why="AMP scaler, conditional step"),
        Invalid("class Learner:\n"
                "    def _accumulate(self, mb):\n"
                "        loss = masked_mean(self.per_token_loss(mb), mb['mask'])\n"
                "        loss.backward()\n"
                "\n"
                "    def update(self, batch):\n"
                "        self.opt.zero_grad()\n"
                "        for mb in batch.split(self.micro_size):\n"
                "            self._accumulate(mb)\n"
                "        self.opt.step()\n", line=4,
                why="the helper's backward runs once per microbatch of its caller's loop", capability="C5",
                style="class"),
        Invalid("def micro_backward(policy, mb, n_tok):\n"
                "    per_tok = -token_logps(policy, mb) * mb['adv'][:, None]\n"
                "    loss = (per_tok * mb['mask']).sum() / n_tok\n"
                "    loss.backward()\n"
                "\n"
                "def update(policy, opt, batch):\n"
                "    opt.zero_grad()\n"
                "    for mb in batch.split(8):\n"
                "        micro_backward(policy, mb, mb['mask'].sum())\n"
                "    opt.step()\n", line=4,
                why="the count the caller hands in is the microbatch's own", capability="C5",
                style="functional"),
        Invalid("class Worker:\n"
                "    def backward_micro(self, micro):\n"
                "        keep = micro['loss_mask']\n"
                "        loss = (self.token_loss(micro) * keep).sum() / keep.sum()\n"
                "        loss.backward()\n"
                "\n"
                "    def train_minibatch(self, minibatch):\n"
                "        for i, micro in enumerate(minibatch.split(self.cfg.micro_size)):\n"
                "            self.backward_micro(micro)\n"
                "            if i == self.cfg.accum_steps - 1:\n"
                "                self.optimizer.step()\n", line=5,
                why="config-driven accumulation: the step is gated, the helper's means are summed",
                capability="C5", style="framework"),
        Invalid("for i in range(0, N, mbs):\n"
                "    mask = masks[i:i + mbs, 1:]\n"
                "    o = (lp(X[i:i + mbs]) * A[i:i + mbs, None] * mask).sum() / (1e-6 + mask.sum())\n"
                "    (-o / n_micro).backward()\n"
                "opt.step()\n", line=4,
                why="the epsilon written before the microbatch's own count", capability="C9", style="script"),
        Invalid("def update(policy, opt, batch):\n"
                "    for mb in batch.split(8):\n"
                "        m = mb['mask']\n"
                "        loss = (token_loss(policy, mb) * m).sum() / min(m.sum(), 1)\n"
                "        loss.backward()\n"
                "    opt.step()\n", line=4,
                why="min() caps the count at 1: a token sum, not a mean", capability="C9", style="functional"),
        Invalid("class Trainer:\n"
                "    def update(self, batch):\n"
                "        n_valid = batch.mask.sum()\n"
                "        for mb in batch.chunk(self.n_micro):\n"
                "            loss = (self.per_token(mb) * mb.mask).sum() / n_valid.clamp(max=1)\n"
                "            loss.backward()\n"
                "        self.opt.step()\n", line=5,
                why="clamp(max=1) instead of clamp(min=1)", capability="C9", style="class"),
        Invalid("class Actor:\n"
                "    def update(self, data):\n"
                "        for minibatch in data.split(self.config.minibatch_size):\n"
                "            n_resp = minibatch.batch['resp_mask'].sum()\n"
                "            for micro in minibatch.split(self.config.micro_batch_size):\n"
                "                part = self.token_loss(micro) * micro.batch['resp_mask']\n"
                "                loss = part.sum() * self.dp_size / n_resp\n"
                "                loss.backward()\n"
                "            self.optimizer.step()\n", line=7,
                why="the world size undoes the averaging across ranks, but the count is this rank's own",
                capability="C9", style="framework"),
        Invalid("import torch.distributed as dist\n"
                "\n"
                "class Critic:\n"
                "    def update(self, batch):\n"
                "        n_tok = batch['mask'].sum()\n"
                "        dist.all_reduce(batch['mask'].sum())\n"
                "        for mb in batch.split(self.micro):\n"
                "            loss = ((self.values(mb) - mb['ret']) ** 2 * mb['mask']).sum() / n_tok\n"
                "            loss.backward()\n"
                "        self.opt.step()\n", line=6,
                why="the collective sums a temporary and drops it; the count stays rank-local",
                capability="C9", style="class"),
        Invalid("for mb in idx.chunk(accum):\n"
                "    mask = masks[mb]\n"
                "    l = (tl(pi, X[mb]) * mask).sum() / torch.clamp(mask.sum(), max=1)\n"
                "    l.backward()\n"
                "opt.step()\n", line=3, why="torch.clamp with an upper bound of 1", capability="C9",
                style="script"),
        Invalid(
                "def update(model, opt, rows, ids, adv, n_micro):\n"
                "    for part in rows.chunk(n_micro):\n"
                "        w = torch.tensor(ids[part] != 0, dtype=torch.bool)[:, 1:]\n"
                "        lp = model(ids[part]).log_softmax(-1)[:, :-1].gather(-1, ids[part][:, 1:, None]).squeeze(-1)\n"
                "        o = lp * adv[part][:, None]\n"
                "        o = (o * w).sum() / w.sum()\n"
                "        (-o).backward()\n"
                "    opt.step()\n", line=7,
                why="the divisor counts a bool tensor (a mask by its computation and by its use in (o * w).sum() / w.sum())", capability="C2", style="functional"),
    ]

    def check(self, ctx: Analysis) -> Iterator[Violation]:
        yield from _ignores_accumulated_count(ctx)
        acc = _Accumulation(ctx)
        for collective in A.discarded_collectives(ctx):
            func = ctx.enclosing_function(collective)
            tensor = collective.args[0].value
            if func is not None and acc.count_locality(tensor, None, {}, DEPTH) is not None and any(
                    ctx.contains(func, b) for b in acc.train.facts.backwards):
                yield Violation(collective, f"`{ctx.code(collective).strip()}` sums a temporary across ranks in "
                                            "place and throws the result away, so the token count the loss is "
                                            "normalised by stays this rank's own; reduce the count variable itself "
                                            "(`n = mask.sum(); dist.all_reduce(n)`) and divide by it")
        for call in acc.train.facts.backwards:
            loss = backward_loss(call, ctx)
            if loss is None:
                continue
            loops = ctx.enclosing_loops(call)
            loop = loops[0] if loops else None
            capped = acc.capped_count(loss, DEPTH, set())
            if capped is not None:
                yield Violation(capped, "the loss is divided by a count capped at 1 (`min(n, 1)`, "
                                        "`clamp(max=1)`), so it is a sum over tokens whose scale grows with the "
                                        "batch; the guard against an empty batch is `max(n, 1)` / `clamp(min=1)`")
                continue
            rank_local = acc.rank_local_count(loss, DEPTH, set())
            if rank_local is not None:
                yield Violation(rank_local, "the loss is multiplied by the data-parallel world size and divided by "
                                            "a token count summed on this rank only (it is never all-reduced in "
                                            "place), so after the gradients are averaged across ranks each rank's "
                                            "tokens weigh by its own count; sum the count across ranks "
                                            "(`dist.all_reduce(total_tokens)`) before dividing")
                continue
            mean = acc.token_mean(loss, loop, {}, DEPTH, set())
            if mean is None:
                if loop is None and acc.divided_by_count(loss, DEPTH, set()) is None and \
                        acc.per_call_accumulation(call, loss):
                    yield Violation(call, PER_CALL_MESSAGE)
                continue
            division = acc.divided_by_count(loss, DEPTH, set())
            if division is not None:
                yield Violation(division, "the loss is each microbatch's own token mean divided by the number of "
                                          "microbatches, so tokens of small microbatches weigh more; sum the "
                                          "per-token losses and divide by the whole minibatch's token count "
                                          "(`(loss_sum / total_tokens).backward()`)")
            elif loop is not None and acc.train.is_microbatch_loop(loop) and not acc.steps_every_iteration(loop):
                yield Violation(call, "per-microbatch token means are summed over the microbatches, so the "
                                      "gradient is scaled by their number and tokens of small microbatches weigh "
                                      "more; sum the per-token losses and divide by the whole minibatch's token "
                                      "count (`(loss_sum / total_tokens).backward()`)")
            elif loop is None and acc.per_call_accumulation(call, loss):
                yield Violation(call, PER_CALL_MESSAGE)


class _Accumulation:
    def __init__(self, ctx: Analysis):
        self.ctx = ctx
        self.train: Training = training(ctx)

    def is_mask(self, expr) -> bool:
        """A mask by a name along its definitions, by how it is computed (0/1 values), or by its use in the same
        statement (``(v * w).sum() / w.sum()``: ``w`` counts what it weighs)."""
        ctx = self.ctx
        if any(ctx.names.is_role(n, "mask") for n in names_along(ctx, expr)[:4]) or zero_one(ctx, expr):
            return True
        key = key_of(expr)
        if key is None:
            return False
        stmt = ctx.index.statement_of(expr)
        reaching = {id(d) for d in ctx.flow.reaching(key, expr)}
        return any(key_of(read) == key and read is not expr and is_mask_by_use(ctx, read) and
                   {id(d) for d in ctx.flow.reaching(key, read)} == reaching
                   for read in ctx.index.descendants(stmt, cst.Name, cst.Attribute))

    def is_accumulation_count(self, expr) -> bool:
        """``grad_accum_steps``, ``self.args.gradient_accumulation_steps``, ``n_micro``, ``len(micro_batches)``."""
        ctx = self.ctx
        while isinstance(expr, cst.Call) and ctx.method(expr) in ("float", "int") and not expr.args:
            expr = S.receiver(expr)
        if isinstance(expr, cst.Call) and S.called_name(expr) in ("len", "float", "max") and ctx.method(expr) is None \
                and expr.args:
            return any(self.is_accumulation_count(a.value) or self.train.splits(a.value) or
                       any(MICRO_WORD.search(n) for n in names_along(ctx, a.value)[:1])
                       for a in expr.args)
        key = key_of(expr)
        name = key.rsplit(".", 1)[-1] if key else None
        return name is not None and ACCUM_COUNT.fullmatch(name) is not None

    def steps_every_iteration(self, loop: Loop, helper: cst.FunctionDef | None = None) -> bool:
        """An optimizer step (``opt.step()``, ``self.optimizer_step()``...) in the loop's body, not under an ``if``
        (a call of ``helper``, the function whose backward is judged, is no step)."""
        ctx = self.ctx
        for call in ctx.index.descendants(loop, cst.Call):
            name = S.called_name(call)
            if name is None or not STEP_NAME.fullmatch(name):
                continue
            if helper is not None and ctx.callee(call) is helper:
                continue
            recv = S.receiver(call)
            if recv is not None and re.search(r"(?i)env|sched", dotted_name(recv) or ""):
                continue
            conditional = False
            for anc in ctx.ancestors(call):
                if anc is loop:
                    break
                if isinstance(anc, (cst.If, cst.For, cst.While)):
                    conditional = True
            if not conditional:
                return True
        return False

    def divided_by_count(self, expr: cst.BaseExpression, depth: int, seen: set[int]) -> cst.CSTNode | None:
        """The division of the loss by the number of microbatches / accumulation steps on its way, if any."""
        ctx = self.ctx
        if depth < 0 or id(expr) in seen:
            return None
        seen.add(id(expr))
        if isinstance(expr, cst.BinaryOperation):
            if isinstance(expr.operator, cst.Divide) and self.is_accumulation_count(expr.right):
                return expr
            if isinstance(expr.operator, (cst.Divide, cst.Multiply)):
                return self.divided_by_count(expr.left, depth - 1, seen)
            return None
        if isinstance(expr, cst.Call) and ctx.method(expr) in PASS_THROUGH_METHODS:
            return self.divided_by_count(S.receiver(expr), depth - 1, seen)
        if isinstance(expr, (cst.Name, cst.Attribute)):
            key = key_of(expr)
            if key is None:
                return None
            for d in ctx.flow.reaching(key, expr):
                if d.kind == "aug":
                    if isinstance(d.op, cst.DivideAssign) and self.is_accumulation_count(d.value):
                        return d.stmt
                    hit = self._before_aug(d, depth, seen)
                    if hit is not None:
                        return hit
                elif d.kind == "assign" and d.value is not None and d.element is None:
                    hit = self.divided_by_count(d.value, depth - 1, seen)
                    if hit is not None:
                        return hit
        return None

    def per_call_accumulation(self, call: cst.Call, loss: cst.BaseExpression) -> bool:
        """A backward in a helper with no loop of its own (C5): every in-module call of the helper sits in a
        microbatch loop that does not step each iteration, the helper does not step either, and at every call
        site (the helper's parameters bound to the caller's arguments) the loss is the microbatch's own mean."""
        from rlguard.lint.analysis.values import bind_arguments

        ctx = self.ctx
        func = ctx.enclosing_function(call)
        if func is None or self.steps_every_iteration(func):
            return False
        sites = caller_loops(ctx, func, self.train.is_microbatch_loop, depth=1)
        if not sites:
            return False
        for site, caller_loop in sites:
            if self.steps_every_iteration(caller_loop, func):
                return False
            bindings = {param: (value, caller_loop) for param, (value, _frame) in bind_arguments(func, site, None)}
            if self.token_mean(loss, None, bindings, DEPTH, set()) is None:
                return False
        return True

    def rank_local_count(self, expr: cst.BaseExpression, depth: int, seen: set[int]) -> cst.CSTNode | None:
        """The division, on the loss's way, of a product carrying the data-parallel world size
        (``loss * world_size / n_tokens``: the gradient averaging across ranks undone) by a token count that is
        summed on this rank only: a mask sum, inline or in a name that no collective takes in place."""
        ctx = self.ctx

        def rank_local(div: cst.BinaryOperation) -> bool:
            if not any(A.world_size_factor(ctx, f) is not None for f in _factors(div.left)) or \
                    self.count_locality(div.right, None, {}, DEPTH) is None:
                return False
            count = self.strip_clamps(div.right)
            if A.through_collective(ctx, count):
                return False  # counted over a mask gathered from every rank
            key = key_of(count)
            return key is None or not A.reduced_in_place(ctx, key, ctx.enclosing_function(div) or ctx.module)

        return self.division_on_way(expr, rank_local, depth, seen)

    def capped_count(self, expr: cst.BaseExpression, depth: int, seen: set[int]) -> cst.CSTNode | None:
        """A division of the loss by a count capped at 1 (``min(n_tokens, 1)``, ``n.clamp(max=1)``): the guard
        against an empty batch written the wrong way round, so the loss is a sum, not a mean (C9)."""
        ctx = self.ctx

        def capped(div: cst.BinaryOperation) -> bool:
            inner = _capped_at_one(ctx, div.right)
            return inner is not None and (self.count_locality(inner, None, {}, DEPTH) is not None
                                          or self.is_accumulation_count(inner)
                                          or COUNT_NAME.fullmatch(_last(inner) or "") is not None)

        return self.division_on_way(expr, capped, depth, seen)

    def division_on_way(self, expr: cst.BaseExpression, pred, depth: int, seen: set[int]) -> cst.CSTNode | None:
        """The first division ``pred`` accepts on the loss's way: through products, sums, negation, casts and
        the reaching assignments of names."""
        ctx = self.ctx
        if depth < 0 or id(expr) in seen:
            return None
        seen.add(id(expr))
        if isinstance(expr, cst.BinaryOperation):
            if isinstance(expr.operator, cst.Divide):
                if pred(expr):
                    return expr
                return self.division_on_way(expr.left, pred, depth - 1, seen)
            if isinstance(expr.operator, (cst.Multiply, cst.Add, cst.Subtract)):
                return (self.division_on_way(expr.left, pred, depth - 1, seen)
                        or self.division_on_way(expr.right, pred, depth - 1, seen))
            return None
        if isinstance(expr, cst.UnaryOperation):
            return self.division_on_way(expr.expression, pred, depth - 1, seen)
        if isinstance(expr, cst.Call) and ctx.method(expr) in PASS_THROUGH_METHODS:
            return self.division_on_way(S.receiver(expr), pred, depth - 1, seen)
        if isinstance(expr, (cst.Name, cst.Attribute)):
            key = key_of(expr)
            if key is None:
                return None
            for d in ctx.flow.reaching(key, expr):
                if d.kind in ("assign", "aug") and d.value is not None and d.element is None:
                    hit = self.division_on_way(d.value, pred, depth - 1, seen)
                    if hit is not None:
                        return hit
        return None

    def _before_aug(self, d, depth, seen):
        for prior in self.ctx.flow.reaching(d.key, d.stmt):
            if prior.kind == "assign" and prior.value is not None:
                hit = self.divided_by_count(prior.value, depth - 1, seen)
                if hit is not None:
                    return hit
        return None

    def token_mean(self, expr: cst.BaseExpression | None, loop: Loop | None, bindings: dict, depth: int,
                   seen: set[int]) -> cst.CSTNode | None:
        """The node of a token mean over the current microbatch's own mask inside the loss ``expr``, else None.
        ``bindings`` maps a helper's parameters to the caller's arguments (evaluated in the caller's loop)."""
        ctx = self.ctx
        if expr is None or depth < 0 or id(expr) in seen:
            return None
        seen.add(id(expr))
        d = depth - 1
        if isinstance(expr, cst.BinaryOperation):
            op = expr.operator
            if isinstance(op, cst.Divide):
                locality = self.count_locality(expr.right, loop, bindings, d)
                if locality == "local":
                    return expr
                if locality == "global":
                    return None
                return self.token_mean(expr.left, loop, bindings, d, seen)
            if isinstance(op, cst.Multiply):
                if any(self.reweights(side, loop, bindings, d) for side in (expr.left, expr.right)):
                    return None
            if isinstance(op, (cst.Multiply, cst.Add, cst.Subtract)):
                return (self.token_mean(expr.left, loop, bindings, d, seen)
                        or self.token_mean(expr.right, loop, bindings, d, seen))
            return None
        if isinstance(expr, cst.UnaryOperation):
            return self.token_mean(expr.expression, loop, bindings, d, seen)
        if isinstance(expr, (cst.Name, cst.Attribute)):
            key = key_of(expr)
            if isinstance(expr, cst.Name) and key in bindings and not self._locally_defined(key, expr):
                value, caller_loop = bindings[key]
                return self.token_mean(value, caller_loop, {}, d, seen)
            if key is None:
                return None
            for defn in ctx.flow.reaching(key, expr):
                if defn.value is None:
                    continue
                if defn.kind == "aug":  # `loss /= n`: the mean is in the value before it
                    for prior in ctx.flow.reaching(key, defn.stmt):
                        if prior.kind == "assign" and prior.value is not None:
                            hit = self.token_mean(prior.value, loop, bindings, d, seen)
                            if hit is not None:
                                return hit
                elif defn.kind == "assign" and (defn.element is None or isinstance(defn.value, cst.Call)):
                    # `loss, stats = compute_loss(...)`: the loss function's call is judged as a whole
                    hit = self.token_mean(defn.value, loop, bindings, d, seen)
                    if hit is not None:
                        return hit
            return None
        if not isinstance(expr, cst.Call):
            return None
        name = S.called_name(expr)
        if name in MASKED_MEANS:
            mask = S.argument(expr, 1, "mask")
            dim = S.argument(expr, 2, "dim") or S.argument(expr, None, "axis")
            if dim is not None and not (isinstance(dim, cst.Name) and dim.value == "None"):
                return None
            if mask is None or self.locality(mask, loop, bindings, d) == "local":
                return expr
            return None
        method = ctx.method(expr)
        if method == "mean" and not expr.args:
            inner = S.receiver(expr)
            if isinstance(inner, cst.Subscript) and len(inner.slice) == 1:
                index = inner.slice[0].slice
                if isinstance(index, cst.Index) and self.is_mask(index.value):
                    return expr if self.locality(index.value, loop, bindings, d) == "local" else None
            return None
        if method in PASS_THROUGH_METHODS:
            return self.token_mean(S.receiver(expr), loop, bindings, d, seen)
        helper = ctx.callee(expr)
        if helper is not None:
            from rlguard.lint.analysis.values import bind_arguments

            inner_bindings = {param: (value, loop) for param, (value, _frame) in bind_arguments(helper, expr, None)}
            for ret in ctx.index.scopes[id(helper)].returns:
                hit = self.token_mean(ret.value, None, inner_bindings, d, seen)
                if hit is not None:
                    return expr
            return None
        # a loss function of another module: a token mean when it is handed this microbatch's token count
        for arg in expr.args:
            if self.count_locality(arg.value, loop, bindings, d) == "local":
                return expr
        return None

    def _locally_defined(self, key: str, at) -> bool:
        return any(defn.kind != "param" for defn in self.ctx.flow.reaching(key, at))

    def reweights(self, expr, loop, bindings, depth) -> bool:
        """``tok / total_tokens`` or ``mb_tokens`` as a factor: a microbatch mean reweighted by its token share."""
        if isinstance(expr, cst.BinaryOperation) and isinstance(expr.operator, cst.Divide):
            # a ratio (`tok / total_tokens`, `len(mb) / minibatch_size`): a deliberate reweighting; only a
            # division of 1 by the number of microbatches is no reweighting
            return not self.is_accumulation_count(expr.right)
        return self.count_locality(expr, loop, bindings, depth) is not None

    def count_locality(self, expr, loop, bindings, depth) -> str | None:
        """For a token count (``mask.sum()``, ``n_tokens`` assigned from one): "local" when it counts the current
        microbatch's tokens, "global" when it counts the whole minibatch's, None when ``expr`` is no token count."""
        ctx = self.ctx
        if depth < 0:
            return None
        expr = self.strip_clamps(expr)
        if isinstance(expr, cst.Call):
            method = ctx.method(expr)
            if method in COUNT_METHODS and not _has_dim(expr) and self.is_mask(S.receiver(expr)):
                return self.locality(S.receiver(expr), loop, bindings, depth - 1)
            if ctx.call_name(expr) in ("torch.sum", "torch.count_nonzero") and len(expr.args) == 1 and \
                    self.is_mask(expr.args[0].value):
                return self.locality(expr.args[0].value, loop, bindings, depth - 1)
            if isinstance(expr.func, cst.Name) and expr.func.value in ("sum", "max") and expr.args:
                if isinstance(expr.args[0].value, (cst.GeneratorExp, cst.ListComp)):
                    return "global"  # sum(mb.mask.sum() for mb in micro_batches)
                inner = [self.count_locality(a.value, loop, bindings, depth - 1) for a in expr.args]
                return "local" if "local" in inner else ("global" if "global" in inner else None)
            return None
        if isinstance(expr, cst.Name):
            if expr.value in bindings and not self._locally_defined(expr.value, expr):
                value, caller_loop = bindings[expr.value]
                return self.count_locality(value, caller_loop, {}, depth - 1)
            for defn in ctx.flow.reaching(expr.value, expr):
                if defn.kind != "assign" or defn.value is None:
                    continue
                inner = self.count_locality(defn.value, loop, bindings, depth - 1)
                if inner is not None:
                    return inner
            return None
        return None

    def strip_clamps(self, expr: cst.BaseExpression) -> cst.BaseExpression:
        ctx = self.ctx
        while True:
            if isinstance(expr, cst.Call) and ctx.method(expr) in CLAMPS:
                expr = S.receiver(expr)
            elif isinstance(expr, cst.Call) and isinstance(expr.func, cst.Name) and expr.func.value in (
                    "max", "float", "int") and len(expr.args) >= 1 and not isinstance(
                    expr.args[0].value, (cst.GeneratorExp, cst.ListComp)):
                expr = expr.args[0].value
            elif isinstance(expr, cst.BinaryOperation) and isinstance(expr.operator, cst.Add) and isinstance(
                    expr.right, (cst.Float, cst.Integer, cst.Name)) and not isinstance(expr.left, (cst.Float,
                                                                                                     cst.Integer)):
                expr = expr.left
            elif isinstance(expr, cst.BinaryOperation) and isinstance(expr.operator, cst.Add) and isinstance(
                    expr.left, (cst.Float, cst.Integer)) and not isinstance(expr.right, (cst.Float, cst.Integer)):
                expr = expr.right  # `eps + mask.sum()`: the guard written first
            else:
                return expr

    def locality(self, expr, loop, bindings, depth) -> str:
        """Whether the tensor ``expr`` is the current microbatch's ("local") or the whole minibatch's ("global"):
        local when it depends on the loop's variable or on names assigned inside the loop. With no loop (a
        helper, or one pass), a parameter bound to a caller's argument is judged there; anything else is local."""
        ctx = self.ctx
        names = _names_in(expr)
        if loop is None:
            for name in names:
                if name in bindings:
                    value, caller_loop = bindings[name]
                    if caller_loop is not None:
                        return self.locality(value, caller_loop, {}, depth - 1)
            return "local"
        loop_vars = _names_in(loop.target) if isinstance(loop, cst.For) else set()
        for name in names:
            if name in loop_vars:
                return "local"
            if depth < 0:
                continue
            for defn in ctx.flow.reaching(name, expr):
                if ctx.contains(loop, defn.stmt) and (
                        defn.value is None or defn.kind != "assign" or isinstance(self.strip_clamps(defn.value), cst.Call)
                        or self.locality(defn.value, loop, bindings, depth - 1) == "local"):
                    return "local"
        return "global"


# Hugging Face's Trainer hands a loss function the token count of the whole accumulated batch under this name, and
# then leaves the per-microbatch losses undivided: the function is to divide its token sum by that count
ACCUMULATED_COUNT = "num_items_in_batch"


def _ignores_accumulated_count(ctx: Analysis) -> Iterator[Violation]:
    """A loss function handed ``num_items_in_batch`` that divides by its own microbatch's token count instead (and
    by the handed count nowhere): the trainer sums the microbatch means it returns. Or, in one branch of a loss
    function, the accumulated count is bound (``normalizer = inputs["num_items_in_batch"] / world``) and still
    unused where the returned loss is divided by the microbatch's own count."""
    if not ctx.facet("mentions_accumulated_count", lambda an: any(
            n.value == ACCUMULATED_COUNT for n in an.nodes(cst.Name)) or any(
            ACCUMULATED_COUNT in n.value for n in an.nodes(cst.SimpleString))):
        return  # cheap: neither the name nor the key occurs in the module
    for func in ctx.nodes(cst.FunctionDef):
        params = {p.name.value for p in (*func.params.params, *func.params.kwonly_params)}
        handed = ACCUMULATED_COUNT in params
        bound = _bound_accumulated_counts(ctx, func)
        if not handed and not bound:
            continue
        divisions = [node for node in ctx.index.descendants(func, cst.BinaryOperation)
                     if isinstance(node.operator, cst.Divide) and ctx.enclosing_function(node) is func]
        divides_by_it = any(ACCUMULATED_COUNT in _names_in(node.right) for node in divisions)
        for node in divisions:
            own = _own_count(ctx, node.right)
            if not ((own or bound and _counts_its_weights(ctx, node)) and _returned(ctx, func, node)):
                continue
            if handed and not divides_by_it and own:
                yield _accumulated_count_violation(ctx, node, "the function is handed")
                break
            # the branch's own binding of the accumulated count shows the function normalises by it there, so a
            # mask that counts the weights of the token sum is this microbatch's count
            live = [d for d in bound if any(r is d for r in ctx.flow.reaching(d.key, node))]
            if live and not any(d.key in _names_in(node.right) for d in live):
                yield _accumulated_count_violation(ctx, node, f"`{live[0].key}` holds")
                break


def _bound_accumulated_counts(ctx: Analysis, func: cst.FunctionDef) -> list:
    """The definitions in ``func`` of a plain name bound to the accumulated batch's count (read by its name or its
    string key: ``n = inputs["num_items_in_batch"].clamp(min=1) / world``)."""
    found = []
    for stmt in ctx.index.descendants(func, cst.Assign):
        if ctx.enclosing_function(stmt) is not func:
            continue
        if not _is_accumulated_count(ctx, stmt.value):
            continue
        found += [d for d in ctx.index.stmt_defs.get(id(stmt), ()) if d.kind == "assign" and d.element is None
                  and "." not in d.key and "[" not in d.key]
    return found


def _is_accumulated_count(ctx: Analysis, expr: cst.BaseExpression) -> bool:
    """The value is the accumulated count itself, clamped, cast or scaled (``num_items_in_batch / world``,
    ``inputs["num_items_in_batch"].clamp(min=1.0)``), not a value computed from whether it is given (``"sum" if
    num_items_in_batch is not None else "mean"``)."""
    while True:
        if isinstance(expr, cst.Call) and ctx.method(expr) in (*CLAMPS, "float", "to", "item") and \
                S.receiver(expr) is not None:
            expr = S.receiver(expr)
        elif isinstance(expr, cst.BinaryOperation) and isinstance(expr.operator, (cst.Divide, cst.Multiply)):
            expr = expr.left
        else:
            break
    if isinstance(expr, cst.Name):
        return expr.value == ACCUMULATED_COUNT
    key = key_of(expr)
    return key is not None and key_entry(key) == ACCUMULATED_COUNT


def _accumulated_count_violation(ctx: Analysis, node: cst.BinaryOperation, holder: str) -> Violation:
    if holder == "the function is handed":
        consequence = ("the trainer then sums the microbatch means (no division by the accumulation steps), so the "
                       "gradient grows with their number and short microbatches weigh more")
    else:
        consequence = ("the loss accumulated over the microbatches is then made of per-microbatch token means, in "
                       "which the tokens of short microbatches weigh more than in the one token mean this branch "
                       "binds the count for")
    return Violation(node, f"`{ctx.code(node.right)}` counts this microbatch's own tokens, while {holder} "
                           f"`{ACCUMULATED_COUNT}`, the count of the whole accumulated batch, and the loss is "
                           f"divided by it nowhere: {consequence}; divide the token sum by `{ACCUMULATED_COUNT}`")


def _counts_its_weights(ctx: Analysis, division: cst.BinaryOperation) -> bool:
    """``(v * w).sum() / w.sum()`` (clamped, cast): the division counts the weights of its own token sum."""
    def core(expr, methods):
        while isinstance(expr, cst.Call) and ctx.method(expr) in methods and S.receiver(expr) is not None:
            expr = S.receiver(expr)
        return expr

    total = core(division.left, ("float",))
    count = core(division.right, CLAMPS)
    if not (isinstance(total, cst.Call) and ctx.method(total) == "sum" and isinstance(count, cst.Call) and
            ctx.method(count) in COUNT_METHODS):
        return False
    product = S.receiver(total)
    counted = key_of(S.receiver(count)) if S.receiver(count) is not None else None
    if counted is None or not (isinstance(product, cst.BinaryOperation) and isinstance(product.operator,
                                                                                       cst.Multiply)):
        return False
    return counted in (key_of(product.left), key_of(product.right))


def _own_count(ctx: Analysis, expr: cst.BaseExpression, depth: int = 2) -> bool:
    """``mask.sum()`` (clamped, cast) of a 0/1 tensor, or a name bound only to one."""
    while isinstance(expr, cst.Call) and ctx.method(expr) in CLAMPS and S.receiver(expr) is not None:
        expr = S.receiver(expr)
    if isinstance(expr, cst.Call) and ctx.method(expr) in COUNT_METHODS and S.receiver(expr) is not None:
        counted = S.receiver(expr)
        return zero_one(ctx, counted) or is_mask_by_use(ctx, counted)
    if isinstance(expr, cst.Name) and depth > 0:
        defs = ctx.flow.reaching(expr.value, expr)
        return bool(defs) and all(d.kind == "assign" and d.element is None and d.value is not None and
                                  _own_count(ctx, d.value, depth - 1) for d in defs)
    return False


def _returned(ctx: Analysis, func: cst.FunctionDef, node: cst.CSTNode) -> bool:
    """Whether the division is what the function returns: the returned expression, or the value of a name it
    returns (``loss = x.sum() / n; return loss``)."""
    for ret in ctx.index.scopes[id(func)].returns:
        value = ret.value
        if value is None:
            continue
        if value is node or ctx.contains(value, node):
            return True
        if isinstance(value, cst.Name) and any(
                d.kind == "assign" and d.value is not None and (d.value is node or ctx.contains(d.value, node))
                for d in ctx.flow.reaching(value.value, value)):
            return True
    return False


def _capped_at_one(ctx: Analysis, expr: cst.BaseExpression) -> cst.BaseExpression | None:
    """``min(n, 1)``, ``min(1, n)``, ``n.clamp(max=1)``, ``n.clamp_max(1)``, ``torch.clamp(n, max=1)``: ``n``."""
    if not isinstance(expr, cst.Call):
        return None
    args = expr.args
    if isinstance(expr.func, cst.Name) and expr.func.value == "min" and len(args) == 2:
        ones = [a for a in args if _is_one(a.value)]
        rest = [a for a in args if not _is_one(a.value)]
        return rest[0].value if len(ones) == 1 and len(rest) == 1 else None
    method = ctx.method(expr)
    if method in ("clamp", "clip", "clamp_"):
        top = S.argument(expr, 1, "max")
        return S.receiver(expr) if top is not None and _is_one(top) else None
    if method == "clamp_max" and args and _is_one(args[0].value):
        return S.receiver(expr)
    if ctx.call_name(expr) in ("torch.clamp", "torch.clip") and args:
        top = S.argument(expr, 2, "max")
        return args[0].value if top is not None and _is_one(top) else None
    return None


def _is_one(expr: cst.BaseExpression) -> bool:
    if not isinstance(expr, (cst.Integer, cst.Float)):
        return False
    try:
        return float(expr.value) == 1.0
    except ValueError:
        return False


def _last(expr: cst.BaseExpression) -> str | None:
    key = key_of(expr)
    return key.rsplit(".", 1)[-1] if key else None


def _factors(expr: cst.BaseExpression) -> list[cst.BaseExpression]:
    """The factors of a product: ``a * b * c`` -> [a, b, c] (parentheses and casts kept as they are)."""
    if isinstance(expr, cst.BinaryOperation) and isinstance(expr.operator, cst.Multiply):
        return _factors(expr.left) + _factors(expr.right)
    return [expr]


def _has_dim(call: cst.Call) -> bool:
    return any(a.keyword is None or a.keyword.value in ("dim", "axis") for a in call.args)


def _names_in(expr: cst.CSTNode) -> set[str]:
    return {name.value for name in names_read(expr)}
