"""RLG010 length-bias: a loss aggregated as the mean over sequences of per-sequence token means."""

from __future__ import annotations

from typing import Iterator

import libcst as cst

from rlguard.catalog import LENGTH_BIAS
from rlguard.lint.analysis import Analysis
from rlguard.lint.analysis import semantics as S
from rlguard.lint.analysis.index import key_of, last_name
from rlguard.lint.analysis.labels import branch_label, token_aggregation
from rlguard.lint.analysis.losses import losses
from rlguard.lint.analysis.signs import signs
from rlguard.lint.rule import Invalid, Rule, Valid, Violation

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
    deliberate, configurable choice, unless the branch's label contradicts what it computes (C10): a branch
    labelled as summing each sequence's tokens (`"seq-mean-token-sum"`, `"token_sum"`, `"sum_tokens"`) that takes
    their per-sequence mean (`masked_mean(x, mask, dim=-1)`, `(x * mask).sum(-1) / mask.sum(-1)`) is flagged.

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

    code = LENGTH_BIAS
    severity = "info"
    # preview: the ecosystem check shows FALSE findings on packed single-row layouts, where a per-row mean is already the token mean (docs/benchmarks.md, Ecosystem)
    preview = True
    triggers = (r"mask\w*\s*\)?\s*\.sum\(\s*(?:dim\s*=\s*|axis\s*=\s*)?-?1\b|masked_mean\("
                r"|torch\.sum\(\s*\w*mask")

    PREVIEW_PARTS = ("a loss known only by the name of the local variable that holds it (`loss = ...` with no backward, loss function or optimising caller in view)",)
    VALID = [
        Valid("loss = (per_token_loss * mask).sum() / mask.sum()\n", "token mean"),
        Valid("loss = masked_mean(loss, action_mask)\n", "masked mean over everything"),
        Valid("loss = ((per_token_loss * completion_mask).sum(dim=1) / self.max_completion_length).mean()\n",
              "Dr. GRPO: sequence sum over a constant"),
        Valid("def objective(self, x, m):\n"
              "    if self.loss_type in ['grpo', 'sapo']:\n"
              "        loss = masked_mean(x, m, dim=-1).mean()\n"
              "    else:\n"
              "        loss = (x * m).sum() / m.sum()\n"
              "    loss.backward()\n",
              "a mode switch written as membership in a literal list of modes is still an explicit switch",
              capability="C10", style="class"),
        Valid("if loss_mode == 'seq_mean_token_mean':\n"
              "    per_seq = (values * mask).sum(-1) / mask.sum(-1).clamp(min=1)\n"
              "    loss = per_seq.sum() / n_seqs\n", "an explicit, configurable mode", capability="C10",
              style="script"),
        Valid("seq_lens = mask.sum(-1)\nstats['len'] = seq_lens.float().mean().item()\n", "lengths only logged"),
        Valid("per_seq_reward = (token_rewards * mask).sum(-1)\nloss = -(per_seq_reward.mean())\n",
              "a sum per sequence, no per-sequence mean"),
        Valid("loss = (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)\n", "clamped token mean"),
        Valid("token_mean = (loss * mask).sum(-1) / mask.sum(-1)\nstats['per_seq'] = token_mean.tolist()\n",
              "per-sequence means only reported"),
        Valid("current_kl = masked_mean(kld, mask=response_mask, axis=-1)\n"
              "current_kl = torch.mean(current_kl, dim=0).item()\n"
              "kl_ctrl.update(current_kl=current_kl, n_steps=n)\n",
              "a per-sequence-mean statistic fed to a controller through .item(): a metric, not a loss"),
        Valid("per_seq = (ratio * mask).sum(-1) / mask.sum(-1)\n"
              "metrics['is_ratio_seq_mean'] = per_seq.mean()\n",
              "stored in a metrics dict"),
            # ----- C10: branch labels against what the branch computes -----
        Valid("def reduce_loss(per_tok, m, agg):\n"
              "    if agg == 'seq-mean-token-sum':\n"
              "        per_seq = (per_tok * m).sum(-1)\n"
              "        return per_seq.mean()\n"
              "    return (per_tok * m).sum() / m.sum()\n",
              "a token-sum label that sums each row's tokens", capability="C10", style="functional"),
        Valid("class Loss:\n"
              "    def aggregate(self, lm, mask):\n"
              "        if self.mode == 'seq_mean_token_mean':\n"
              "            rows = masked_mean(lm, mask, dim=-1)\n"
              "            return rows.mean()\n"
              "        return masked_mean(lm, mask)\n",
              "a token-mean label that takes each row's mean: the mode says so", capability="C10", style="class"),
        Valid("def agg(loss, batch, cfg):\n"
              "    m = batch['response_mask']\n"
              "    if cfg.loss_agg == 'seq-mean-token-sum-norm':\n"
              "        return (loss * m).sum(-1).sum() / cfg.max_response_len\n"
              "    return (loss * m).sum() / m.sum()\n",
              "Dr. GRPO's token-sum over a constant", capability="C10", style="framework"),
    ]
    INVALID = [
        Invalid("loss = ((per_token_loss * completion_mask).sum(dim=1) / completion_mask.sum(dim=1)).mean()\n",
                line=1, preview=True),
        Invalid("loss = masked_mean(loss, action_mask, dim=-1).mean()\n", line=1, why="OpenRLHF form", preview=True),
        Invalid("per_seq = (values * mask).sum(-1) / mask.sum(-1).clamp(min=1)\nloss = per_seq.sum() / n_seqs\n",
                line=2, why="sum over sequences divided by their count", preview=True),
        Invalid("seq_loss = (pg * self.loss_mask).sum(1) / (self.loss_mask.sum(1) + 1e-8)\n"
                "loss = seq_loss.mean()\nloss.backward()\n", line=2, why="through a name, eps in the denominator"),
        Invalid("loss = torch.mean(torch.sum(l * response_mask, dim=-1) / torch.sum(response_mask, dim=-1))\n",
                line=1, why="torch functions", preview=True),
        Invalid("m = batch['action_mask']\nper_seq = masked_mean(token_loss, m, axis=1)\nloss = per_seq.mean()\n",
                line=3, why="alias of the mask, axis keyword", preview=True),
            # ----- C10: a token-sum label whose branch takes each sequence's token mean -----
        Invalid("def reduce_loss(per_tok, m, agg):\n"
                "    if agg == 'seq-mean-token-sum':\n"
                "        per_seq = masked_mean(per_tok, m, dim=-1)\n"
                "        return per_seq.mean()\n"
                "    return (per_tok * m).sum() / m.sum()\n", line=3,
                why="the label says token-sum, the branch takes the row mean", capability="C10", style="functional"),
        Invalid("def agg(loss, batch, cfg):\n"
                "    resp_mask = batch['response_mask']\n"
                "    if cfg.loss_agg == 'sum_tokens':\n"
                "        rows = (loss * resp_mask).sum(-1) / resp_mask.sum(-1).clamp(min=1)\n"
                "        return (rows * batch['w']).sum() / resp_mask.shape[0]\n"
                "    return (loss * resp_mask).sum() / resp_mask.sum()\n", line=4,
                why="a dict batch, config label, divide form", capability="C10", style="framework", preview=True),
        Invalid("class Loss:\n"
                "    def aggregate(self, lm, mask):\n"
                "        match self.mode:\n"
                "            case 'token_sum':\n"
                "                rows = masked_mean(lm, mask, dim=1)\n"
                "                return rows.sum() / lm.size(0)\n"
                "            case _:\n"
                "                return masked_mean(lm, mask)\n", line=5,
                why="a match case labelled token_sum", capability="C10", style="class"),
        Invalid("if agg in ('token-sum', 'seq-mean-token-sum'):\n"
                "    s = (l * mask).sum(1) / (mask.sum(1) + 1e-8)\n"
                "    loss = s.mean()\n", line=2, why="a label set, all token-sum", capability="C10", style="script"),
    ]

    def check(self, ctx: Analysis) -> Iterator[Violation]:
        agg = _Aggregation(ctx)
        for call in ctx.nodes(cst.Call):
            inner = agg.sequence_mean_of(call)
            if inner is not None and agg.per_sequence_mean(inner) and not _mode_switch(ctx, call) and agg.in_loss(call):
                yield Violation(call, _MESSAGE, preview=agg.only_inferred(call))
        # a branch labelled as summing each sequence's tokens that takes their mean (C10)
        for node in ctx.nodes(cst.Call, cst.BinaryOperation):
            if agg.direct_sequence_mean(node):
                label = branch_label(ctx, node)
                if label is not None and {token_aggregation(t) for t in label.labels} == {"sum"}:
                    yield Violation(node, _LABEL_MESSAGE.format(label=label.labels[0]))
        for op in ctx.nodes(cst.BinaryOperation):
            if not isinstance(op.operator, cst.Divide) or not isinstance(op.left, cst.Call):
                continue
            left = op.left
            if ctx.method(left) == "sum" and not left.args and not agg.mask_sum(op.right) and agg.per_sequence_mean(
                    S.receiver(left)) and not _mode_switch(ctx, op) and agg.in_loss(op):
                yield Violation(op, _MESSAGE, preview=agg.only_inferred(op))


_MESSAGE = ("the loss is a mean over sequences of per-sequence token means, so tokens of long sequences weigh less "
            "(length bias); use one token mean over the batch, (loss * mask).sum() / mask.sum(), or Dr. GRPO's "
            ".sum(-1) / max_len")


_LABEL_MESSAGE = ("the branch {label!r} says each sequence's tokens are summed, but it takes their per-sequence mean "
                  "(a sum divided by the mask's row count): the mode computes another mode's aggregation, and "
                  "tokens of long sequences weigh less; sum the masked tokens of each row")


class _Aggregation:
    def __init__(self, ctx: Analysis):
        self.ctx = ctx
        # per kind of sink (False: shown by the code; True: inferred from a variable's name, a preview sink)
        self._loss_statements: dict[bool, set[int]] | None = None
        self._sink_nodes: dict[bool, list] = {}

    def in_loss(self, node: cst.CSTNode) -> bool:
        """Whether ``node`` is part of a minimised loss: inside a loss sink's value, or in a statement a loss
        flows through (a value only logged, ``.item()``-ed or fed to a controller is a metric)."""
        return self._reached_by(node, False) or self._reached_by(node, True)

    def only_inferred(self, node: cst.CSTNode) -> bool:
        """Whether only sinks inferred from a variable's name make ``node`` part of a loss (a preview finding)."""
        return not self._reached_by(node, False)

    def _reached_by(self, node: cst.CSTNode, inferred: bool) -> bool:
        ctx = self.ctx
        if self._loss_statements is None:
            self._loss_statements = {False: set(), True: set()}
            self._sink_nodes = {False: [], True: []}
            sign_of = signs(ctx)
            for sink in losses(ctx).sinks():
                self._sink_nodes[sink.inferred].append(sink.expr)
                stmts = self._loss_statements[sink.inferred]
                stmts.add(id(sink.node))
                for term in sink.terms(sign_of):
                    stmts.update(id(s) for _, s in term.via)
        if any(node is n or ctx.contains(n, node) for n in self._sink_nodes[inferred]):
            return True
        stmt = ctx.index.statement_of(node)
        return id(stmt) in self._loss_statements[inferred]

    def sequence_mean_of(self, call: cst.Call):
        """For ``x.mean()`` / ``x.mean(0)`` / ``torch.mean(x)``: ``x``; else None."""
        ctx = self.ctx
        name = ctx.call_name(call) or ""
        if ctx.method(call) is None and name in ("torch.mean", "torch.nanmean"):
            has_dim, dim = _reduction_dim(ctx, call)
            return call.args[0].value if call.args and (not has_dim or dim == 0) else None
        if ctx.method(call) in ("mean", "nanmean"):
            has_dim, dim = _reduction_dim(ctx, call)
            return S.receiver(call) if not has_dim or dim == 0 else None
        return None

    def resolve(self, expr, depth: int = 4):
        ctx = self.ctx
        for _ in range(depth):
            while isinstance(expr, cst.Call) and ctx.method(expr) in ("float", "to", "squeeze", "contiguous"):
                expr = S.receiver(expr)
            key = key_of(expr) if isinstance(expr, (cst.Name, cst.Attribute)) else None
            if key is None:
                return expr
            defs = ctx.flow.reaching(key, expr)
            if len(defs) != 1 or defs[0].kind != "assign" or defs[0].value is None or defs[0].element is not None:
                return expr
            expr = defs[0].value
        return expr

    def per_sequence_mean(self, expr) -> bool:
        """``(x * mask).sum(-1) / mask.sum(-1)`` or ``masked_mean(x, mask, dim=-1)`` (through names)."""
        ctx = self.ctx
        expr = self.resolve(expr)
        if isinstance(expr, cst.Call) and (ctx.call_name(expr) or "").rsplit(".", 1)[-1] == "masked_mean":
            dim = S.argument(expr, 2, "dim")
            if dim is None:
                dim = S.argument(expr, None, "axis")
            return S.int_value(dim) in ROW_DIMS
        if isinstance(expr, cst.BinaryOperation) and isinstance(expr.operator, cst.Divide):
            return self.row_sum(expr.left, need_mask=False) and self.mask_row_sum(expr.right)
        return False

    def direct_sequence_mean(self, node) -> bool:
        """``node`` itself is a per-sequence token mean: ``masked_mean(x, m, dim=-1)`` or ``(x * m).sum(-1) /
        m.sum(-1)`` (names inside it are followed, the node is not)."""
        ctx = self.ctx
        if isinstance(node, cst.Call):
            return (ctx.call_name(node) or "").rsplit(".", 1)[-1] == "masked_mean" and self.per_sequence_mean(node)
        return isinstance(node, cst.BinaryOperation) and isinstance(node.operator, cst.Divide) and \
            self.per_sequence_mean(node)

    def row_sum(self, expr, need_mask: bool) -> bool:
        """A sum over the last dim (``x.sum(-1)``, ``torch.sum(x, dim=1)``) of something with a mask in it."""
        ctx = self.ctx
        expr = self.resolve(expr)
        if not isinstance(expr, cst.Call):
            return False
        is_torch = ctx.method(expr) is None and ctx.call_name(expr) in ("torch.sum", "torch.nansum")
        if not (is_torch or ctx.method(expr) in ("sum", "nansum")):
            return False
        has_dim, dim = _reduction_dim(ctx, expr)
        if not has_dim or dim not in ROW_DIMS:
            return False
        summed = expr.args[0].value if is_torch else S.receiver(expr)
        return self.has_mask(summed, top=need_mask)

    def has_mask(self, expr, top: bool) -> bool:
        """``top``: the expression *is* a mask; else a mask is one of its factors."""
        ctx = self.ctx
        expr = self.resolve(expr)
        if top:
            return self._is_mask(expr)
        if isinstance(expr, cst.BinaryOperation) and isinstance(expr.operator, cst.Multiply):
            return any(self.has_mask(side, top=True) or self.has_mask(side, top=False)
                       for side in (expr.left, expr.right))
        if isinstance(expr, cst.Call) and ctx.method(expr) == "masked_fill":
            return True
        return False

    def _is_mask(self, expr) -> bool:
        key = key_of(expr)
        name = None
        if key is not None:
            name = last_name(key)
        if name is not None and self.ctx.names.is_role(name, "mask"):
            return True
        return isinstance(expr, cst.Comparison)

    def mask_row_sum(self, expr) -> bool:
        ctx = self.ctx
        expr = self.resolve(expr)
        while True:
            if isinstance(expr, cst.BinaryOperation) and isinstance(expr.operator, cst.Add):
                expr = expr.left if not isinstance(expr.left, (cst.Float, cst.Integer)) else expr.right
            elif isinstance(expr, cst.Call) and ctx.method(expr) in ("clamp", "clamp_min", "clip", "float", "to"):
                expr = S.receiver(expr)
            elif isinstance(expr, cst.Call) and ctx.call_name(expr) in ("torch.clamp", "torch.clamp_min", "torch.clip"):
                expr = expr.args[0].value if expr.args else None
            else:
                break
        return expr is not None and self.row_sum(expr, need_mask=True)

    def mask_sum(self, expr) -> bool:
        expr = self.resolve(expr)
        return isinstance(expr, cst.Call) and self.ctx.method(expr) == "sum" and self._is_mask(S.receiver(expr))


def _reduction_dim(ctx: Analysis, call: cst.Call) -> tuple[bool, int | None]:
    for arg in call.args:
        if arg.keyword is not None and arg.keyword.value in ("dim", "axis"):
            return True, S.int_value(arg.value)
    positional = [a for a in call.args if a.keyword is None and not a.star]
    index = 0 if ctx.method(call) is not None else 1
    if len(positional) > index:
        return True, S.int_value(positional[index].value)
    return False, None


def _mode_switch(ctx: Analysis, node) -> bool:
    """Inside ``if <x> == "<mode>":``, ``if <x> in ("<mode>", ...):`` or a ``match`` case: a configurable
    aggregation mode."""
    for anc in ctx.ancestors(node):
        if isinstance(anc, cst.If) and isinstance(anc.test, cst.Comparison) and any(
                _names_modes(c.comparator) for c in anc.test.comparisons):
            return True
        if isinstance(anc, cst.MatchCase):
            return True
        if isinstance(anc, (cst.FunctionDef, cst.ClassDef)):
            return False
    return False


def _names_modes(expr: cst.BaseExpression) -> bool:
    """A string literal, or a literal list, tuple or set of them: the modes a switch compares with."""
    if isinstance(expr, (cst.SimpleString, cst.ConcatenatedString)):
        return True
    return isinstance(expr, (cst.List, cst.Tuple, cst.Set)) and bool(expr.elements) and all(
        isinstance(el.value, (cst.SimpleString, cst.ConcatenatedString)) for el in expr.elements)
