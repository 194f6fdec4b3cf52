"""RLG006 accumulation-scale: gradient accumulation that averages per-microbatch token means."""

from __future__ import annotations

import re
from typing import Iterator

import libcst as cst

from rlguard.lint.context import (PASS_THROUGH_METHODS, ModuleContext, argument, dotted_name, method_name,
                                  receiver)
from rlguard.lint.rule import Invalid, Rule, Valid, Violation
from rlguard.lint.rules._loops import (Loop, header_words, is_accumulation_count, is_microbatch_loop,
                                       loop_index, same_module_callee)

MASKED_MEANS = frozenset({"masked_mean", "mean_masked", "masked_average", "masked_avg", "masked_token_mean",
                          "token_mean", "mean_tokens"})
COUNT_METHODS = frozenset({"sum", "count_nonzero", "nansum"})
CLAMPS = frozenset({"clamp", "clamp_min", "clip", "clamp_", "float", "to", "type_as", "item", "detach", "double"})
STEP_NAME = re.compile(r"(?i)\w*step")
DEPTH = 10


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
    triggers = (r"(?is)\A(?=.*?\.backward\s*\()"
                r"(?=.*?(accum|micro|\.chunk\(|\.split\(|\bmbs?\b|\bparts\b|\bn_chunks\b))")

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

    def check(self, ctx: ModuleContext) -> Iterator[Violation]:
        for call in loop_index(ctx).backward_calls:
            loss = _backward_loss(call)
            if loss is None:
                continue
            loops = ctx.enclosing_loops(call)
            loop = loops[0] if loops else None
            mean = _token_mean(ctx, loss, loop, {}, DEPTH, set())
            if mean is None:
                continue
            division = _divided_by_count(ctx, loss, DEPTH, set())
            if division is not None:
                yield Violation(division, "the loss is each microbatch's own token mean divided by the number of "
                                      "microbatches, so tokens of small microbatches weigh more; sum the "
                                      "per-token losses and divide by the whole minibatch's token count "
                                      "(`(loss_sum / total_tokens).backward()`)")
            elif loop is not None and is_microbatch_loop(ctx, loop) and not _steps_every_iteration(ctx, loop):
                yield Violation(call, "per-microbatch token means are summed over the microbatches, so the "
                                      "gradient is scaled by their number and tokens of small microbatches weigh "
                                      "more; sum the per-token losses and divide by the whole minibatch's token "
                                      "count (`(loss_sum / total_tokens).backward()`)")


def _backward_loss(call: cst.Call) -> cst.BaseExpression | None:
    """``loss.backward()`` -> loss; ``accelerator.backward(loss)`` -> loss; ``scaler.scale(l).backward()`` -> l."""
    recv = receiver(call)
    if recv is None:
        return None
    name = dotted_name(recv) or ""
    if call.args and re.search(r"(?i)accelerator|engine|strategy|fabric|self$|model|autograd", name):
        loss = call.args[0].value
    else:
        loss = recv
    while isinstance(loss, cst.Call) and method_name(loss) == "scale" and loss.args:
        loss = loss.args[0].value
    return loss


def _steps_every_iteration(ctx: ModuleContext, loop: Loop) -> bool:
    """An optimizer step (``opt.step()``, ``self.optimizer_step()``...) in the loop's body, not under an ``if``."""
    for call in ctx.descendants(loop, cst.Call):
        name = method_name(call) or (call.func.value if isinstance(call.func, cst.Name) else None)
        if name is None or not STEP_NAME.fullmatch(name):
            continue
        recv = receiver(call)
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


def _divided_by_count(ctx: ModuleContext, expr: cst.BaseExpression, depth: int,
                      seen: set[int]) -> cst.CSTNode | None:
    """The division of the loss by the number of microbatches / accumulation steps on its way, if any."""
    if depth < 0 or id(expr) in seen:
        return None
    seen.add(id(expr))
    if isinstance(expr, cst.BinaryOperation):
        if isinstance(expr.operator, cst.Divide) and is_accumulation_count(ctx, expr.right):
            return expr
        if isinstance(expr.operator, (cst.Divide, cst.Multiply)):
            return _divided_by_count(ctx, expr.left, depth - 1, seen)
        return None
    if isinstance(expr, cst.Call) and method_name(expr) in PASS_THROUGH_METHODS:
        return _divided_by_count(ctx, expr.func.value, depth - 1, seen)
    if isinstance(expr, (cst.Name, cst.Attribute)):
        name = dotted_name(expr)
        if name is None:
            return None
        for a in _assignments_before(ctx, name, expr):
            if isinstance(a.statement, cst.AugAssign):
                if isinstance(a.op, cst.DivideAssign) and is_accumulation_count(ctx, a.statement.value):
                    return a.statement
            elif a.value is not None:
                hit = _divided_by_count(ctx, a.value, depth - 1, seen)
                if hit is not None:
                    return hit
    return None


def _assignments_before(ctx: ModuleContext, name: str, at: cst.CSTNode):
    """Assignments to ``name`` in the same function that come before ``at`` (and ``self.x`` ones anywhere)."""
    found = ctx.assignments_to(name, at)
    if name.startswith("self."):
        return found
    return [a for a in found if a.index < ctx.order[id(at)]] or ctx.reaching_assignments(name, at)


def _token_mean(ctx: ModuleContext, expr: cst.BaseExpression | None, loop: Loop | None, bindings: dict,
                depth: int, seen: set[int]) -> cst.CSTNode | None:
    """The node of a token mean over the current microbatch's own mask inside the loss ``expr``, else None.
    ``bindings`` maps a helper's parameters to the caller's arguments (evaluated in the caller's loop)."""
    if expr is None or depth < 0 or id(expr) in seen:
        return None
    seen.add(id(expr))
    d = depth - 1
    if isinstance(expr, cst.BinaryOperation):
        op = expr.operator
        if isinstance(op, cst.Divide):
            locality = _count_locality(ctx, expr.right, loop, bindings, d)
            if locality == "local":
                return expr
            if locality == "global":
                return None
            return _token_mean(ctx, expr.left, loop, bindings, d, seen)
        if isinstance(op, cst.Multiply):
            if any(_reweights(ctx, side, loop, bindings, d) for side in (expr.left, expr.right)):
                return None
        if isinstance(op, (cst.Multiply, cst.Add, cst.Subtract)):
            return (_token_mean(ctx, expr.left, loop, bindings, d, seen)
                    or _token_mean(ctx, expr.right, loop, bindings, d, seen))
        return None
    if isinstance(expr, cst.UnaryOperation):
        return _token_mean(ctx, expr.expression, loop, bindings, d, seen)
    if isinstance(expr, (cst.Name, cst.Attribute)):
        name = dotted_name(expr)
        if isinstance(expr, cst.Name) and name in bindings:
            value, caller_loop = bindings[name]
            return _token_mean(ctx, value, caller_loop, {}, d, seen)
        if name is None or (isinstance(expr, cst.Attribute) and not name.startswith("self.")):
            return None
        for a in _assignments_before(ctx, name, expr):
            if a.value is not None:
                hit = _token_mean(ctx, a.value, loop, bindings, d, seen)
                if hit is not None:
                    return hit
        return None
    if not isinstance(expr, cst.Call):
        return None
    name = method_name(expr) or (expr.func.value if isinstance(expr.func, cst.Name) else None)
    if name in MASKED_MEANS:
        mask = argument(expr, 1, "mask")
        dim = argument(expr, 2, "dim") or argument(expr, None, "axis")
        if dim is not None and not (isinstance(dim, cst.Name) and dim.value == "None"):
            return None
        if mask is None or _locality(ctx, mask, loop, bindings, d) == "local":
            return expr
        return None
    if name == "mean" and not expr.args and isinstance(expr.func, cst.Attribute):
        inner = expr.func.value
        if isinstance(inner, cst.Subscript) and len(inner.slice) == 1:
            index = inner.slice[0].slice
            if isinstance(index, cst.Index) and ctx.has_role(index.value, "mask"):
                return expr if _locality(ctx, index.value, loop, bindings, d) == "local" else None
        return None
    if name in PASS_THROUGH_METHODS and isinstance(expr.func, cst.Attribute):
        return _token_mean(ctx, expr.func.value, loop, bindings, d, seen)
    helper = _helper(ctx, expr)
    if helper is not None:
        params = ctx.scopes[id(helper)].params
        if params and params[0] in ("self", "cls"):
            params = params[1:]
        inner_bindings = {}
        for pos, param in enumerate(params):
            value = argument(expr, pos, param)
            if value is not None:
                inner_bindings[param] = (value, loop)
        for ret in ctx.scopes[id(helper)].returns:
            hit = _token_mean(ctx, ret.value, None, inner_bindings, d, seen)
            if hit is not None:
                return expr
        return None
    # a loss function of another module: a token mean when it is handed this microbatch's token count
    for arg in expr.args:
        if _count_locality(ctx, arg.value, loop, bindings, d) == "local":
            return expr
    return None


def _helper(ctx: ModuleContext, call: cst.Call) -> cst.FunctionDef | None:
    """The same-module function ``call`` runs: ``helper(...)``, ``self.helper(...)``, or the ``forward`` of a
    same-module ``nn.Module`` instance (``self.loss_fn = PolicyLoss(); self.loss_fn(...)``)."""
    return same_module_callee(ctx, call)


def _reweights(ctx, expr, loop, bindings, depth) -> bool:
    """``tok / total_tokens`` or ``mb_tokens`` as a factor: a microbatch mean reweighted by its token share."""
    if isinstance(expr, cst.BinaryOperation) and isinstance(expr.operator, cst.Divide):
        # a ratio (`tok / total_tokens`, `len(mb) / minibatch_size`): a deliberate reweighting; only a
        # division of 1 by the number of microbatches is no reweighting
        return not is_accumulation_count(ctx, expr.right)
    return _count_locality(ctx, expr, loop, bindings, depth) is not None


def _count_locality(ctx: ModuleContext, expr: cst.BaseExpression, loop: Loop | None, bindings: dict,
                    depth: int) -> str | None:
    """For a token count (``mask.sum()``, ``n_tokens`` assigned from one): "local" when it counts the current
    microbatch's tokens, "global" when it counts the whole minibatch's, None when ``expr`` is no token count."""
    if depth < 0:
        return None
    expr = _strip_clamps(expr)
    if isinstance(expr, cst.Call):
        name = method_name(expr)
        if name in COUNT_METHODS and not _has_dim(expr) and ctx.has_role(expr.func.value, "mask"):
            return _locality(ctx, expr.func.value, loop, bindings, depth - 1)
        if ctx.call_name(expr) in ("torch.sum", "torch.count_nonzero") and len(expr.args) == 1 and \
                ctx.has_role(expr.args[0].value, "mask"):
            return _locality(ctx, expr.args[0].value, loop, bindings, depth - 1)
        if isinstance(expr.func, cst.Name) and expr.func.value in ("sum", "max") and expr.args:
            inner = [_count_locality(ctx, a.value, loop, bindings, depth - 1) for a in expr.args]
            if isinstance(expr.args[0].value, (cst.GeneratorExp, cst.ListComp)):
                return "global"  # sum(mb.mask.sum() for mb in micro_batches)
            return "local" if "local" in inner else ("global" if "global" in inner else None)
        return None
    if isinstance(expr, cst.Name):
        if expr.value in bindings:
            value, caller_loop = bindings[expr.value]
            return _count_locality(ctx, value, caller_loop, {}, depth - 1)
        for a in ctx.reaching_assignments(expr.value, expr):
            if a.value is None:
                continue
            inner = _count_locality(ctx, a.value, loop, bindings, depth - 1)
            if inner is not None:
                return inner
        return None
    return None


def _strip_clamps(expr: cst.BaseExpression) -> cst.BaseExpression:
    while True:
        if isinstance(expr, cst.Call) and method_name(expr) in CLAMPS:
            expr = expr.func.value
        elif isinstance(expr, cst.Call) and isinstance(expr.func, cst.Name) and expr.func.value in (
                "max", "float", "int") and len(expr.args) >= 1 and not isinstance(
                expr.args[0].value, (cst.GeneratorExp, cst.ListComp)):
            expr = expr.args[0].value
        elif isinstance(expr, cst.BinaryOperation) and isinstance(expr.operator, cst.Add) and isinstance(
                expr.right, (cst.Float, cst.Integer, cst.Name)) and not isinstance(expr.left, (cst.Float,
                                                                                                 cst.Integer)):
            expr = expr.left
        else:
            return expr


def _has_dim(call: cst.Call) -> bool:
    return any(a.keyword is None or a.keyword.value in ("dim", "axis") for a in call.args)


def _locality(ctx: ModuleContext, expr: cst.BaseExpression, loop: Loop | None, bindings: dict,
              depth: int) -> str:
    """Whether the tensor ``expr`` is the current microbatch's ("local") or the whole minibatch's ("global"):
    local when it depends on the loop's variable or on names assigned inside the loop. With no loop (a
    helper, or one pass), a parameter bound to a caller's argument is judged there; anything else is local."""
    names = _names_in(expr)
    if loop is None:
        for name in names:
            if name in bindings:
                value, caller_loop = bindings[name]
                if caller_loop is not None:
                    return _locality(ctx, value, caller_loop, {}, depth - 1)
        return "local"
    targets = set(header_words(ctx, loop)) if isinstance(loop, cst.For) else set()
    loop_vars = {n for n in targets if isinstance(loop, cst.For) and n in _names_in(loop.target)}
    for name in names:
        if name in loop_vars:
            return "local"
        if depth < 0:
            continue
        for a in ctx.reaching_assignments(name, expr):
            if ctx.contains(loop, a.statement) and (
                    a.value is None or isinstance(_strip_clamps(a.value), cst.Call)  # next(it), load(mb)
                    or _locality(ctx, a.value, loop, bindings, depth - 1) == "local"):
                return "local"
    return "global"


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
            stack.extend(node.children)
    return names
