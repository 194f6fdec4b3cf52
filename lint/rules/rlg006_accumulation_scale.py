"""RLG006 accumulation-scale: gradient accumulation that averages per-microbatch token means."""

from __future__ import annotations

import re
from typing import Iterator

import libcst as cst

from rlguard.lint.analysis import Analysis, dotted_name
from rlguard.lint.analysis import accumulation as A
from rlguard.lint.analysis import semantics as S
from rlguard.lint.analysis.callers import caller_loops
from rlguard.lint.analysis.index import key_of, children
from rlguard.lint.analysis.loops import Loop, Training, training
from rlguard.lint.analysis.roles import backward_loss, names_along
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
DEPTH = 10
PER_CALL_MESSAGE = ("this helper's backward takes its microbatch's own token mean, and every caller runs it once per "
                    "microbatch of an accumulation loop with no step in between: the per-microbatch means are "
                    "summed, so the gradient is scaled by their number and tokens of small microbatches weigh more; "
                    "pass the whole minibatch's token count in and divide the per-token sum by it")


class AccumulationScale(Rule):
    """
    ## What it flags
    A `.backward()` on a loss that is a token mean over the *microbatch's own* mask
    (`masked_mean(x, mb_mask)`, `(x * mb_mask).sum() / mb_mask.sum()`, `x[mb_mask].mean()`, or a loss helper
    handed the microbatch's token count), when that loss is accumulated over microbatches: divided by the
    number of microbatches (`/ n_micro`, `/ grad_accum_steps`, `/ len(parts)`, `loss /= accum`), or summed
    without division in a microbatch loop (`for mb in batch.chunk(n)`, `range(accum_steps)`) that has no
    unconditional optimizer step.

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

    ## Fix
    No automatic fix: the whole minibatch's token count has to be computed before the loop (and summed across
    data-parallel ranks), which needs names the code does not have.

    ## Options
    `[tool.rlguard.names]` `mask = [...]` adds your own names for loss masks.
    """

    code = "RLG006"
    # both a backward and some accumulation vocabulary (lookaheads at the start: one linear scan each)
    triggers = (r"(?i)\.backward\s*\(", r"(?i)accum|micro|\.chunk\(|\.split\(|\bmbs?\b|\bparts\b|\bn_chunks\b")

    VALID = [
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
    ]
    INVALID = [
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
                "        (loss / n_micro).backward()\n", line=7, why="loss helper handed the microbatch's count"),
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
    ]

    def check(self, ctx: Analysis) -> Iterator[Violation]:
        acc = _Accumulation(ctx)
        for call in acc.train.facts.backwards:
            loss = backward_loss(call)
            if loss is None:
                continue
            loops = ctx.enclosing_loops(call)
            loop = loops[0] if loops else None
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
        return any(self.ctx.names.is_role(n, "mask") for n in names_along(self.ctx, expr)[:4])

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
        if depth < 0 or id(expr) in seen:
            return None
        seen.add(id(expr))
        if isinstance(expr, cst.BinaryOperation):
            if isinstance(expr.operator, cst.Divide):
                if any(A.world_size_factor(ctx, f) is not None for f in _factors(expr.left)) and \
                        self.count_locality(expr.right, None, {}, DEPTH) is not None:
                    count = self.strip_clamps(expr.right)
                    key = key_of(count)
                    scope = ctx.enclosing_function(expr) or ctx.module
                    if key is None or not A.reduced_in_place(ctx, key, scope):
                        return expr
                return self.rank_local_count(expr.left, depth - 1, seen)
            if isinstance(expr.operator, (cst.Multiply, cst.Add, cst.Subtract)):
                return (self.rank_local_count(expr.left, depth - 1, seen)
                        or self.rank_local_count(expr.right, depth - 1, seen))
            return None
        if isinstance(expr, cst.UnaryOperation):
            return self.rank_local_count(expr.expression, depth - 1, seen)
        if isinstance(expr, cst.Call) and ctx.method(expr) in PASS_THROUGH_METHODS:
            return self.rank_local_count(S.receiver(expr), depth - 1, seen)
        if isinstance(expr, (cst.Name, cst.Attribute)):
            key = key_of(expr)
            if key is None:
                return None
            for d in ctx.flow.reaching(key, expr):
                if d.kind in ("assign", "aug") and d.value is not None and d.element is None:
                    hit = self.rank_local_count(d.value, depth - 1, seen)
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


def _factors(expr: cst.BaseExpression) -> list[cst.BaseExpression]:
    """The factors of a product: ``a * b * c`` -> [a, b, c] (parentheses and casts kept as they are)."""
    if isinstance(expr, cst.BinaryOperation) and isinstance(expr.operator, cst.Multiply):
        return _factors(expr.left) + _factors(expr.right)
    return [expr]


def _has_dim(call: cst.Call) -> bool:
    return any(a.keyword is None or a.keyword.value in ("dim", "axis") for a in call.args)


def _names_in(expr: cst.CSTNode) -> set[str]:
    names: set[str] = set()
    stack = [expr]
    while stack:
        node = stack.pop()
        if isinstance(node, cst.Name):
            names.add(node.value)
        elif isinstance(node, cst.Attribute):
            stack.append(node.value)  # obj.mask -> obj; never the attribute name itself
        else:
            stack.extend(children(node))
    return names
