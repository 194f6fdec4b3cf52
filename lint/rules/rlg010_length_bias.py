"""RLG010 length-bias: a loss aggregated as the mean over sequences of per-sequence token means."""

from __future__ import annotations

from typing import Iterator

import libcst as cst

from rlguard.lint.context import ModuleContext, argument, dotted_name, method_name, receiver
from rlguard.lint.rule import Invalid, Rule, Valid, Violation
from rlguard.lint.rules._signs import int_value, reaching, reduction_dim

ROW_DIMS = (1, -1)


class LengthBias(Rule):
    """
    ## What it flags
    A loss aggregated as a mean over sequences of per-sequence token means:

    ```python
    ((per_token_loss * mask).sum(-1) / mask.sum(-1)).mean()      # the original GRPO / old TRL form
    masked_mean(loss, mask, dim=-1).mean()                         # the same with a helper
    per_seq = (loss * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)
    loss = per_seq.sum() / n_seqs
    ```

    A per-row token mean (`.sum(-1)` over the mask divided by the mask's row count) that is then averaged over
    rows (`.mean()`, `torch.mean`, `.sum() / n`). Aliases are followed. The rule stays silent when the aggregation
    is one branch of an explicit mode switch (`if loss_mode == "seq_mean_token_mean":`, a `match` case): that is a
    deliberate, configurable choice.

    ## Why it is wrong
    Each sequence gets the same total weight, so each token of a long sequence weighs less than a token of a short
    one. Long answers are usually the failing ones (rambling, truncated): their tokens get too little gradient, and
    the policy is not discouraged from being long when wrong. Response length grows over training (`length_fail`
    rising), as Dr. GRPO (Liu et al., 2025) describes. It is a bias, not a crash: hence severity "info".

    ## Example
    ```python
    loss = ((per_token_loss * completion_mask).sum(dim=1) / completion_mask.sum(dim=1)).mean()
    ```

    ## Use instead
    ```python
    # token mean over the whole (mini)batch
    loss = (per_token_loss * completion_mask).sum() / completion_mask.sum()
    # or Dr. GRPO: sequence sums over a constant
    loss = ((per_token_loss * completion_mask).sum(dim=1) / max_completion_length).mean()
    ```

    ## Fix
    No automatic fix: changing the aggregation changes the objective's scale and the effective learning rate;
    under gradient accumulation the token count must cover the whole minibatch (see RLG006), which the rule cannot
    see.

    ## Options
    `[tool.rlguard.names]` `mask = [...]` adds your own names for loss masks. Silence a deliberate choice with
    `# noqa: RLG010`.
    """

    code = "RLG010"
    severity = "info"
    triggers = (r"mask\w*\s*\)?\s*\.sum\(\s*(?:dim\s*=\s*|axis\s*=\s*)?-?1\b|masked_mean\("
                r"|torch\.sum\(\s*\w*mask")

    VALID = [
        Valid("loss = (per_token_loss * mask).sum() / mask.sum()\n", "token mean"),
        Valid("loss = masked_mean(loss, action_mask)\n", "masked mean over everything"),
        Valid("loss = ((per_token_loss * completion_mask).sum(dim=1) / self.max_completion_length).mean()\n",
              "Dr. GRPO: sequence sum over a constant"),
        Valid("if loss_mode == 'seq_mean_token_mean':\n"
              "    per_seq = (values * mask).sum(-1) / mask.sum(-1).clamp(min=1)\n"
              "    loss = per_seq.sum() / n_seqs\n", "an explicit, configurable mode"),
        Valid("seq_lens = mask.sum(-1)\nstats['len'] = seq_lens.float().mean().item()\n", "lengths only logged"),
        Valid("per_seq_reward = (token_rewards * mask).sum(-1)\nloss = -(per_seq_reward.mean())\n",
              "a sum per sequence, no per-sequence mean"),
        Valid("loss = (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)\n", "clamped token mean"),
        Valid("token_mean = (loss * mask).sum(-1) / mask.sum(-1)\nstats['per_seq'] = token_mean.tolist()\n",
              "per-sequence means only reported"),
    ]
    INVALID = [
        Invalid("loss = ((per_token_loss * completion_mask).sum(dim=1) / completion_mask.sum(dim=1)).mean()\n",
                line=1),
        Invalid("loss = masked_mean(loss, action_mask, dim=-1).mean()\n", line=1, why="OpenRLHF form"),
        Invalid("per_seq = (values * mask).sum(-1) / mask.sum(-1).clamp(min=1)\nloss = per_seq.sum() / n_seqs\n",
                line=2, why="sum over sequences divided by their count"),
        Invalid("seq_loss = (pg * self.loss_mask).sum(1) / (self.loss_mask.sum(1) + 1e-8)\n"
                "loss = seq_loss.mean()\nloss.backward()\n", line=2, why="through a name, eps in the denominator"),
        Invalid("loss = torch.mean(torch.sum(l * response_mask, dim=-1) / torch.sum(response_mask, dim=-1))\n",
                line=1, why="torch functions"),
        Invalid("m = batch['action_mask']\nper_seq = masked_mean(token_loss, m, axis=1)\nloss = per_seq.mean()\n",
                line=3, why="alias of the mask, axis keyword"),
    ]

    def check(self, ctx: ModuleContext) -> Iterator[Violation]:
        for call in ctx.nodes(cst.Call):
            inner = _sequence_mean_of(ctx, call)
            if inner is not None and _per_sequence_mean(ctx, inner) and not _mode_switch(ctx, call):
                yield Violation(call, _MESSAGE)
        for op in ctx.nodes(cst.BinaryOperation):
            if not isinstance(op.operator, cst.Divide) or not isinstance(op.left, cst.Call):
                continue
            left = op.left
            if method_name(left) == "sum" and not left.args and not _mask_sum(ctx, op.right) and _per_sequence_mean(
                    ctx, receiver(left)) and not _mode_switch(ctx, op):
                yield Violation(op, _MESSAGE)


_MESSAGE = ("the loss is a mean over sequences of per-sequence token means, so tokens of long sequences weigh less "
            "(length bias); use one token mean over the batch, (loss * mask).sum() / mask.sum(), or Dr. GRPO's "
            ".sum(-1) / max_len")


def _sequence_mean_of(ctx: ModuleContext, call: cst.Call):
    """For ``x.mean()`` / ``x.mean(0)`` / ``torch.mean(x)``: ``x``; else None."""
    name = ctx.call_name(call) or ""
    if name in ("torch.mean", "torch.nanmean"):
        has_dim, dim = reduction_dim(call)
        return call.args[0].value if call.args and (not has_dim or dim == 0) else None
    if method_name(call) in ("mean", "nanmean"):
        has_dim, dim = reduction_dim(call)
        return receiver(call) if not has_dim or dim == 0 else None
    return None


def _resolve(ctx: ModuleContext, expr, depth: int = 4):
    for _ in range(depth):
        while isinstance(expr, cst.Call) and method_name(expr) in ("float", "to", "squeeze", "contiguous"):
            expr = receiver(expr)
        key = dotted_name(expr) if isinstance(expr, (cst.Name, cst.Attribute)) else None
        if key is None or not (isinstance(expr, cst.Name) or key.startswith("self.")):
            return expr
        assigns = reaching(ctx, key, expr)
        if len(assigns) != 1 or assigns[0].value is None or assigns[0].unpacked is not None:
            return expr
        expr = assigns[0].value
    return expr


def _per_sequence_mean(ctx: ModuleContext, expr) -> bool:
    """``(x * mask).sum(-1) / mask.sum(-1)`` or ``masked_mean(x, mask, dim=-1)`` (through names)."""
    expr = _resolve(ctx, expr)
    if isinstance(expr, cst.Call) and (ctx.call_name(expr) or "").rsplit(".", 1)[-1] == "masked_mean":
        dim = argument(expr, 2, "dim")
        if dim is None:
            dim = argument(expr, None, "axis")
        return int_value(dim) in ROW_DIMS
    if isinstance(expr, cst.BinaryOperation) and isinstance(expr.operator, cst.Divide):
        return _row_sum(ctx, expr.left, need_mask=False) and _mask_row_sum(ctx, expr.right)
    return False


def _row_sum(ctx: ModuleContext, expr, need_mask: bool) -> bool:
    """A sum over the last dim (``x.sum(-1)``, ``torch.sum(x, dim=1)``) of something with a mask in it."""
    expr = _resolve(ctx, expr)
    if not isinstance(expr, cst.Call):
        return False
    is_torch = ctx.call_name(expr) in ("torch.sum", "torch.nansum")
    if not (is_torch or method_name(expr) in ("sum", "nansum")):
        return False
    has_dim, dim = reduction_dim(expr)
    if not has_dim or dim not in ROW_DIMS:
        return False
    summed = expr.args[0].value if is_torch else receiver(expr)
    return _has_mask(ctx, summed, top=need_mask)


def _has_mask(ctx: ModuleContext, expr, top: bool) -> bool:
    """``top``: the expression *is* a mask; else a mask is one of its factors."""
    expr = _resolve(ctx, expr)
    if top:
        return ctx.has_role(expr, "mask")
    if isinstance(expr, cst.BinaryOperation) and isinstance(expr.operator, cst.Multiply):
        return _has_mask(ctx, expr.left, top=True) or _has_mask(ctx, expr.right, top=True) or _has_mask(
            ctx, expr.left, top=False) or _has_mask(ctx, expr.right, top=False)
    if isinstance(expr, cst.Call) and method_name(expr) == "masked_fill":
        return True
    return False


def _mask_row_sum(ctx: ModuleContext, expr) -> bool:
    expr = _resolve(ctx, expr)
    while True:
        if isinstance(expr, cst.BinaryOperation) and isinstance(expr.operator, cst.Add):
            expr = expr.left if not isinstance(expr.left, (cst.Float, cst.Integer)) else expr.right
        elif isinstance(expr, cst.Call) and method_name(expr) in ("clamp", "clamp_min", "clip", "float", "to"):
            expr = receiver(expr)
        elif isinstance(expr, cst.Call) and ctx.call_name(expr) in ("torch.clamp", "torch.clamp_min", "torch.clip"):
            expr = expr.args[0].value if expr.args else None
        else:
            break
    return expr is not None and _row_sum(ctx, expr, need_mask=True)


def _mask_sum(ctx: ModuleContext, expr) -> bool:
    expr = _resolve(ctx, expr)
    return isinstance(expr, cst.Call) and method_name(expr) == "sum" and ctx.has_role(receiver(expr), "mask")


def _mode_switch(ctx: ModuleContext, node) -> bool:
    """Inside ``if <x> == "<mode>":`` or a ``match`` case: a configurable aggregation mode."""
    for anc in ctx.ancestors(node):
        if isinstance(anc, cst.If) and isinstance(anc.test, cst.Comparison) and any(
                isinstance(c.comparator, (cst.SimpleString, cst.ConcatenatedString)) for c in anc.test.comparisons):
            return True
        if isinstance(anc, cst.MatchCase):
            return True
        if isinstance(anc, (cst.FunctionDef, cst.ClassDef)):
            return False
    return False
