"""RLG001 mask-not-shifted: the action/loss mask sits one token off the log-probs it selects."""

from __future__ import annotations

import re
from typing import Iterator

import libcst as cst

from rlguard.lint.analysis import Analysis, dotted_name
from rlguard.lint.analysis import semantics as S
from rlguard.lint.analysis.alignment import (ATTENTION_NAME, OWNER_NAME, ROOT_IDS, ROOT_LOGITS, ROOT_TOKEN, ROOT_UNKNOWN, Align,
                                             alignment, gather_site, token_values)
from rlguard.lint.analysis.grad import call_sites
from rlguard.lint.analysis.index import key_of, children
from rlguard.lint.analysis.records import records_by_function
from rlguard.lint.analysis.roles import names_along
from rlguard.lint.analysis.values import Frame
from rlguard.lint.rule import Invalid, Rule, Valid, Violation

# Entries of a record (C3): the labels a loss scores, and a per-token loss mask stored beside them.
LABEL_ENTRY = re.compile(r"(?i)(shift(ed)?_|rolled_|next_)?(labels?|targets?|target_ids|target_tokens|next_tokens)")
LOSS_MASK_ENTRY = re.compile(r"(?i)\w*(loss|action|completion|response|resp|policy|generation|gen)_?masks?")
PRODUCER_NAME = re.compile(r"(?i)(action|loss|response|resp|completion|policy|token|act)_?masks?")


class MaskNotShifted(Rule):
    """
    ## What it flags
    An action/loss mask that selects per-token values (log-probs, ratios, per-token losses, KL terms) from a
    different position than the one where those values are stored:

    - a mask built from `ids`-aligned data (`owner == POLICY`, `attention_mask`, `ids != pad`) with
      `[:, :-1]` where `[:, 1:]` is meant: `action_mask = (owner[:, :-1] == POLICY).float()`;
    - a pad, roll or window that moves the mask the wrong way relative to the log-probs:
      `F.pad(mask, (1, 0))[:, :-1]`, `torch.roll(mask, 1, -1)`, `attention_mask[:, -L-1:-1]` beside
      log-probs `[:, -L:]`.

    The rule works out where the log-probs are stored from the code that gathers them (`logits[:, :-1]`
    against `ids[:, 1:]` gives ids positions 1..T-1; log-probs padded back to token positions give 0..T-1)
    and where the mask is, following names, `self.` attributes, batch keys, slices, `F.pad`, `torch.roll`,
    comparisons and same-module helpers. It reports only when the two are a known, non-zero number of
    positions apart. A mask read as it is (`mask = batch["action_mask"]`) is trusted: per the catalog,
    per-token masks are already [B, T-1] and aligned to `ids[:, 1:]`.

    ## Why it is wrong
    `logp[:, t]` is the log-prob of `ids[:, t + 1]`. A mask aligned to `ids` instead of `ids[:, 1:]` moves
    every policy span one token: the loss trains on the last prompt or environment token before each span
    and drops the policy's final token (often its answer or EOS). The run looks healthy, but the ratio and
    KL include tokens the policy never chose, pass rates stall, and multi-turn episodes learn to imitate the
    environment's first token.

    ## Example
    ```python
    action_mask = (owner[:, :-1] == POLICY).float()
    loss = (pg_loss * action_mask).sum() / action_mask.sum()
    ```

    ## Use instead
    ```python
    action_mask = (owner[:, 1:] == POLICY).float()  # aligned to ids[:, 1:], like the log-probs
    ```

    ## Fix
    No automatic fix: the right correction (slice the mask `[:, 1:]`, drop a pad, or move the log-probs
    instead) depends on how the trainer stores its per-token tensors.

    ## Options
    `[tool.rlguard.names]` `mask = [...]`, `logp = [...]` and `ids = [...]` add your own names.
    """

    code = "RLG001"
    # a mask, and a time-axis slice, pad or roll somewhere: what any mismatch the rule can prove needs
    triggers = (r"mask", r"\[\s*:\s*,|\[\s*\.\.\.\s*,|\.pad\(|roll\(|\[\s*-")

    VALID = [
        Valid("logits = model(ids).logits\n"
              "logp = logits[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)\n"
              "mask = attention_mask[:, 1:]\nloss = -(logp * adv * mask).sum() / mask.sum()\n",
              "attention_mask[:, 1:] beside logits[:, :-1]"),
        Valid("mask = batch['action_mask']\nloss_mask = mask\nratio = torch.exp(logp - batch['old_logp'])\n"
              "loss = (-(ratio * adv) * loss_mask).sum() / loss_mask.sum()\n",
              "a [B, T-1] action mask used as it is"),
        Valid("def build_action_mask(owner):\n    return (owner[:, 1:] == POLICY).float()\n",
              "ownership of ids[:, 1:]"),
        Valid("log_probs = F.pad(token_logp, (1, 0))\nmask = F.pad(action_mask, (1, 0))\n"
              "loss = (log_probs * mask).sum()\n", "both padded back to token positions"),
        Valid("output = model(input_ids=input_ids)\nlogits = output.logits[:, -response_length - 1 : -1, :]\n"
              "log_prob = logprobs_from_logits(logits, responses)\n"
              "response_mask = attention_mask[:, -response_length:]\n"
              "ratio = torch.exp(log_prob - old_log_prob)\npg_loss = masked_mean(-advantages * ratio, response_mask)\n",
              "verl style windows"),
        Valid("logprobs = logprobs_of_labels(logits[:, :-1, :], tokens[:, 1:])\nstart = query_len - 1\n"
              "end = start + response_length\nlogprobs, mask = logprobs[:, start:end], attention_mask[:, start + 1:end + 1]\n"
              "loss = masked_mean(logprobs * adv, mask)\n", "trlx style windows"),
        Valid("state_seq = sequences[:, input_len - 1 : -1]\n"
              "action_mask = state_seq.ne(eos_token_id) & state_seq.ne(pad_token_id)\n",
              "OpenRLHF's state mask: a symbolic window, never flagged"),
        Valid("values = critic(ids)[:, :-1]\nvf_mask = attention_mask[:, 1:]\n"
              "vf_loss = ((values - returns) ** 2 * vf_mask).sum()\n",
              "value predictions sliced like logits pair with the next token, like log-probs"),
        Valid("logits = self.model(input_ids).logits\n"
              "labels = torch.roll(input_ids, shifts=-1, dims=1)\nlogp = log_probs_from_logits(logits, labels)\n"
              "mask = torch.roll(attention_mask, shifts=-1, dims=1)\nloss = (logp * mask).sum()\n",
              "log-probs and mask rolled together"),
        Valid("def batch_logps(logits, labels, decoder_only=True):\n"
              "    if decoder_only:\n"
              "        labels = labels[:, 1:].clone()\n"
              "        logits = logits[:, :-1, :]\n"
              "    keep = labels != -100\n"
              "    labels = torch.where(labels == -100, 0, labels)\n"
              "    token_logps = selective_log_softmax(logits, labels)\n"
              "    return (token_logps * keep).sum(-1)\n",
              "labels and logits shifted together, the mask built from the shifted labels (the DPO/ORPO idiom)"),
    ]
    # Pinned lines are where the mask is moved (the roll, pad or window to fix) when that is in view.
    INVALID = [
        Invalid("def build_action_mask(owner):\n    action_mask = (owner[:, :-1] == POLICY).float()\n"
                "    return action_mask\n", line=2, why="ownership of ids[:, :-1]"),
        Invalid("logits = model(ids).logits\n"
                "logp = logits[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)\n"
                "mask = attention_mask[:, :-1]\nloss = -(logp * adv * mask).sum() / mask.sum()\n", line=3,
                why="mask[:, :-1] where mask[:, 1:] is meant"),
        Invalid("ratio = torch.exp(logp - old_logp)\nm = F.pad(batch['attention_mask'], (1, 0))[:, :-1]\n"
                "pg_loss = masked_mean(-adv * ratio, m)\n", line=2, why="padded the wrong way"),
        Invalid("loss_mask = torch.roll(mask, 1, -1)\nkl = (log_probs - ref_log_probs) * loss_mask\n", line=1,
                why="rolled the wrong way"),
        Invalid("logp = full_logp[:, -L:]\nmask = attention_mask[:, -L - 1:-1]\n"
                "loss = -(logp * adv * mask).sum()\n", line=2, why="window one step too early"),
        Invalid("class Trainer:\n    def prepare(self, batch):\n"
                "        self.loss_mask = batch['loss_mask'][:, :-1]\n"
                "    def loss(self, logp, adv):\n        return -(logp * adv * self.loss_mask).sum()\n", line=3,
                why="a [B, T] loss mask cut to [:, :-1], used through a self attribute"),
        Invalid("log_probs = F.pad(token_logp, (1, 0))\nmask = F.pad(attention_mask, (1, 0))\n"
                "loss = (log_probs * mask).sum()\n", line=2,
                why="log-probs moved to token positions, an ids-aligned mask moved too"),
        Invalid("values = critic(ids)[:, :-1]\nvf_mask = attention_mask[:, :-1]\n"
                "vf_loss = ((values - returns) ** 2 * vf_mask).sum()\n", line=2,
                why="value predictions pair with the next token: their mask is attention_mask[:, 1:]"),
        Invalid("def aggregate(values, mask):\n    return (values * mask).sum() / mask.sum()\n"
                "def step(logp, old_logp, adv, owner):\n    ratio = (logp - old_logp).exp()\n"
                "    return aggregate(-adv * ratio, (owner[:, :-1] == POLICY).float())\n", line=5,
                why="a helper fed a mask built inline"),
    ]

    def check(self, ctx: Analysis) -> Iterator[Violation]:
        seq = alignment(ctx, "seq")
        producers: set[int] = set()
        convention = _storage_convention(ctx)
        for stmt, value in _producers(ctx):
            m = seq.value(value)
            if m is None or not m.moved or m.kind not in (ROOT_IDS, ROOT_TOKEN):
                continue
            if not (m.s.is_const() and m.e.is_const()):
                continue
            if convention is not None:
                if m.s.const == convention:
                    continue
                producers.add(id(stmt))
                yield Violation(stmt, f"this action mask is aligned to ids[:, {_window(m)}] but the log-probs of "
                                      f"this module are stored from ids position {convention} on; move the mask "
                                      "with the log-probs (for log-probs of ids[:, 1:]: attention_mask[:, 1:], "
                                      "owner[:, 1:] == POLICY)")
                continue
            if m.kind != ROOT_IDS or (m.e - m.s).const != -1 or m.s.const == 1:
                continue
            producers.add(id(stmt))
            yield Violation(stmt, f"this action mask is [B, T-1] but aligned to ids[:, {_window(m)}], not to "
                                  "ids[:, 1:] like the log-probs; build it from ids[:, 1:] "
                                  "(e.g. owner[:, 1:] == POLICY, attention_mask[:, 1:])")
        yield from _record_mismatches(ctx, producers)
        reported: set[int] = set()
        deferred: dict[int, list] = {}
        statements = {id(n): n for n in ctx.nodes(cst.Assign, cst.AnnAssign, cst.AugAssign)}
        for node, values, mask in _sites(ctx):
            verdict = _judge(ctx, values, mask, None, producers)
            if verdict is not None:
                reported.add(id(node))
                # Report where the mask was moved (the roll, pad or window to fix) when that is in view.
                moved_at = seq.value(mask).moved_at
                yield Violation(statements.get(moved_at, node), verdict)
            else:
                func = ctx.enclosing_function(node)
                if func is not None:
                    deferred.setdefault(id(func), []).append((func, node, values, mask))
        for entries in deferred.values():
            func = entries[0][0]
            for call in call_sites(ctx, func):
                frame = seq.enter_frame(func, call, None)
                if frame is None:
                    continue
                for _, node, values, mask in entries:
                    verdict = _judge(ctx, values, mask, frame, producers)
                    if verdict is not None and id(call) not in reported:
                        reported.add(id(call))
                        yield Violation(call, f"in `{func.name.value}` called here: {verdict}")


def _storage_convention(ctx: Analysis) -> int | None:
    """Where the log-probs computed in this module are stored (ids position of slot 0), when that is one
    known constant: from the values of returns and log-prob assignments that gather from logits here."""
    found: set[int] = set()
    candidates = [r.value for r in ctx.nodes(cst.Return) if r.value is not None]
    for stmt in ctx.nodes(cst.Assign):
        name = dotted_name(stmt.targets[0].target) if len(stmt.targets) == 1 else None
        if name and any(ctx.names.is_role(name.rsplit(".", 1)[-1], r) for r in ("logp", "old_logp", "ref_logp")):
            candidates.append(stmt.value)
    tokens = token_values(ctx)
    for value in candidates:
        if not any(gather_site(ctx, c) for c in _calls_in(value)):
            continue
        for al, computed in tokens.value(value):
            if computed and al.s.is_const():
                found.add(al.s.const)
    return found.pop() if len(found) == 1 else None


def _calls_in(expr: cst.BaseExpression, limit: int = 64) -> list[cst.Call]:
    out: list[cst.Call] = []
    stack = [expr]
    while stack and len(out) < limit:
        node = stack.pop()
        if isinstance(node, cst.Call):
            out.append(node)
        stack.extend(children(node))
    return out


def _window(a: Align) -> str:
    start = "" if a.s.const == 0 else str(a.s.const)
    stop = "" if a.e.const == 0 else str(a.e.const)
    return f"{start}:{stop}"


def _producers(ctx: Analysis):
    """Assignments and returns that build an action mask."""
    for stmt in ctx.nodes(cst.Assign):
        if len(stmt.targets) != 1:
            continue
        name = dotted_name(stmt.targets[0].target)
        if name is None:
            continue
        bare = name.rsplit(".", 1)[-1]
        if PRODUCER_NAME.fullmatch(bare) or _owner_comparison(stmt.value):
            yield stmt, stmt.value
    for ret in ctx.nodes(cst.Return):
        func = ctx.enclosing_function(ret)
        if ret.value is not None and func is not None and "mask" in func.name.value.lower() and not isinstance(
                ret.value, cst.Name):
            yield ret, ret.value


def _owner_comparison(expr: cst.BaseExpression) -> bool:
    while isinstance(expr, cst.Call) and isinstance(expr.func, cst.Attribute):
        expr = expr.func.value
    if isinstance(expr, cst.Comparison):
        for side in (expr.left, *(c.comparator for c in expr.comparisons)):
            while isinstance(side, cst.Subscript):
                side = side.value
            if isinstance(side, (cst.Name, cst.Attribute)) and OWNER_NAME.fullmatch(
                    (dotted_name(side) or "").rsplit(".", 1)[-1]):
                return True
    return False


def _is_mask(ctx: Analysis, expr: cst.BaseExpression) -> bool:
    inner = expr
    while isinstance(inner, cst.UnaryOperation):
        inner = inner.expression
    if _owner_comparison(inner):
        return True
    if any(ctx.names.is_role(n, "mask") for n in names_along(ctx, inner)[:4]):
        return True
    traced = alignment(ctx, "seq").value(inner)
    return traced is not None and ctx.names.is_role(traced.name, "mask")


def _sites(ctx: Analysis):
    """(node, per-token values, mask) where a mask selects per-token values."""
    for op in ctx.nodes(cst.BinaryOperation):
        if not isinstance(op.operator, cst.Multiply):
            continue
        left, right = _is_mask(ctx, op.left), _is_mask(ctx, op.right)
        if left != right:
            yield (op, op.left, op.right) if right else (op, op.right, op.left)
    for call in ctx.nodes(cst.Call):
        func = call.func
        name = S.called_name(call)
        if name is None:
            continue
        if "masked" in name.lower() and name not in ("masked_fill", "masked_select", "masked_scatter") \
                and len(call.args) >= 2:
            values, mask = S.argument(call, 0, None), S.argument(call, 1, "mask")
            if values is not None and mask is not None and _is_mask(ctx, mask):
                yield call, values, mask
        elif name in ("masked_fill", "masked_select") and isinstance(func, cst.Attribute) and call.args:
            mask = call.args[0].value
            if _is_mask(ctx, mask):
                yield call, func.value, mask
        elif ctx.call_name(call) == "torch.where" and len(call.args) >= 2 and _is_mask(ctx, call.args[0].value):
            yield call, call.args[1].value, call.args[0].value


def _judge(ctx: Analysis, values, mask, frame: Frame | None, producers: set[int]) -> str | None:
    m = alignment(ctx, "seq").value(mask, frame)
    if m is None or m.kind == ROOT_LOGITS or (m.kind == ROOT_UNKNOWN and not m.moved):
        return None
    if any(v in producers for v in m.via):
        return None  # already reported where the mask is built
    aligns = token_values(ctx).value(values, frame)
    if not aligns:
        return None
    if not m.moved and not any(computed for _, computed in aligns):
        return None
    diffs = set()
    for al, _ in aligns:
        d = m.s - al.s
        if not d.is_const():
            d = m.e - al.e
            if not d.is_const():
                return None
        diffs.add(d.const)
    if 0 in diffs or len(diffs) != 1:
        return None
    k = diffs.pop()
    return (f"the mask is {abs(k)} position{'s' if abs(k) != 1 else ''} {'left' if k < 0 else 'right'} of the "
            "per-token values it selects (log-probs of ids[:, 1:] sit at logits[:, :-1]'s positions); "
            "align the mask to ids[:, 1:] (e.g. attention_mask[:, 1:], owner[:, 1:] == POLICY)")


def _record_mismatches(ctx: Analysis, producers: set[int]) -> Iterator[Violation]:
    """A record (C3) that stores token labels moved off the ids (``torch.roll(ids, -1)``, ``ids[:, 1:]``) and a
    loss mask traced to ids positions: the loss downstream scores ``labels[:, t]`` (the per-token log-probs sit
    where the labels are) and selects with the mask, so the mask must sit where the labels do."""
    seq = alignment(ctx, "seq")
    for entries in records_by_function(ctx).values():
        labels = [e for e in entries if LABEL_ENTRY.fullmatch(e.entry)]
        masks = [e for e in entries if LOSS_MASK_ENTRY.fullmatch(e.entry) and not ATTENTION_NAME.fullmatch(e.entry)]
        if not labels or not masks:
            continue
        starts = set()
        for e in labels:
            al = seq.value(e.value)
            if al is None or al.kind != ROOT_IDS or not al.moved or not al.s.is_const() or \
                    ATTENTION_NAME.fullmatch(al.name) or OWNER_NAME.fullmatch(al.name):
                continue
            starts.add(al.s.const)
        if len(starts) != 1 or 0 in starts:
            continue
        start = starts.pop()
        for e in masks:
            m = seq.value(e.value)
            if m is None or m.kind != ROOT_IDS or not m.s.is_const() or m.s.const == start:
                continue
            if any(v in producers for v in m.via):
                continue
            k = m.s.const - start
            yield Violation(e.node, f"this loss mask is stored with labels that are ids[:, {start}:]-aligned (the "
                                    f"per-token log-probs scored against them sit there) but the mask is "
                                    f"{abs(k)} position{'s' if abs(k) != 1 else ''} {'left' if k < 0 else 'right'} "
                                    "of them, at ids positions; move it with the labels (e.g. roll or slice it "
                                    "the same way)")
