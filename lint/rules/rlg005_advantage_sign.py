"""RLG005 advantage-sign: advantages negated, the surrogate not negated in a minimised loss, or PPO clip with
min/max of the wrong sign."""

from __future__ import annotations

import re
from typing import Iterator

import libcst as cst

from rlguard.lint.context import ModuleContext, dotted_name, iter_calls, receiver, value_name
from rlguard.lint.rule import Invalid, Rule, Valid, Violation
from rlguard.lint.rules._loss import is_minimised_loss
from rlguard.lint.rules._signs import (BASELINE_NAME, REDUCTIONS, SIGN_KEEPING_FUNCTIONS, SIGN_KEEPING_METHODS, SignSearch,
                                       _terms, is_baseline, loss_candidate_filter, min_max_kind, reaching, role_matcher, role_stop,
                                       sum_statements, target_key)

WEIGHT_ROLES = ("advantages", "returns", "rewards")
RATIO_NAME = re.compile(r"(?i)\w*ratios?\w*|rhos?|coef_[12]|is_weights?|importance_weights?")
# clip bounds, not ratios: verl's clip_ratio_c, clip_ratio_low/high
NOT_RATIO_NAME = re.compile(r"(?i)\w*clip_?ratio\w*|\w*ratio_(c|low|high|max|min|eps|clip|range)")
COEF_ROLES = ("entropy_coef", "kl_coef")


class AdvantageSign(Rule):
    """
    ## What it flags
    Three ways of getting the direction of the policy gradient backwards:

    - **advantages negated**: `advantages = -advantages`, `adv = -(rewards - baseline)`, `adv = values - returns`,
      `advantages *= -1` (an advantage is *reward minus baseline*: `-(baseline - rewards)` is fine);
    - **surrogate not negated**: a loss that is minimised (named like a loss, or `.backward()`-ed) in which
      `ratio * A` (or `logp * A`, `logp * returns`) enters with a `+` sign: `loss = (ratio * adv).mean()`;
    - **PPO clip of the wrong sign**: the max of the surrogates `torch.max(ratio * A, clipped * A)`, or the min of
      their negations `torch.min(-ratio * A, -clipped * A)`, whatever sign is put in front.

    The rule follows aliases, `self.` attributes and small helpers of the same module, so the TRL/OpenRLHF/CleanRL
    form (`pg_losses = -advantages * ratio; pg_losses2 = -advantages * torch.clamp(ratio, ...);
    pg_loss = torch.max(pg_losses, pg_losses2).mean()`) is recognised as correct. A negation that is undone
    downstream (`neg = -adv; loss = (ratio * neg).mean()`) is not reported.

    ## Why it is wrong
    The loss is minimised. Minimising `-ratio * A` raises the probability of episodes with a positive advantage;
    any odd number of sign errors lowers it instead. The run then learns to *avoid* reward: reward falls from the
    first steps while the training loss keeps decreasing, and after one step the change of log pi(episode)
    correlates negatively with A (the `sign_flip` run). The optimistic clip (`max` of the surrogates) removes
    PPO's trust region on the side that matters: the ratio runs away and `approx_kl` explodes.

    ## Example
    ```python
    ratio = torch.exp(logp - old_logp)
    pg_loss = torch.max(ratio * adv, torch.clamp(ratio, 1 - eps, 1 + eps) * adv).mean()
    ```

    ## Use instead
    ```python
    pg_loss = -torch.min(ratio * adv, torch.clamp(ratio, 1 - eps, 1 + eps) * adv).mean()
    # or, TRL style
    pg_losses = -adv * ratio
    pg_losses2 = -adv * torch.clamp(ratio, 1 - eps, 1 + eps)
    pg_loss = torch.max(pg_losses, pg_losses2).mean()
    ```

    ## Fix
    No automatic fix: which of the signs is the wrong one (the advantages, the surrogate, or the min/max) depends on
    code the rule may not see, and a wrong guess would silently invert training again.

    ## Options
    `[tool.rlguard.names]` `advantages = [...]`, `returns = [...]` add your own names for advantage and return
    tensors.
    """

    code = "RLG005"
    # every branch starts with a literal (Python's re scans those fast); the rule checks the roles itself
    triggers = (r"advantage|Advantage|adv(?:s\b|_|\b)|\*\s*-?\s*(?:A|returns?|rewards?)\b"
                r"|(?:returns?|rewards?)\s*\*\s*\w*(?:ratio|log_?prob|logp)|A\s*\*\s*\w*(?:ratio|log_?prob|logp)")

    VALID = [
        Valid("ratio = torch.exp(logp - old_logp)\n"
              "pg_loss = -torch.min(ratio * adv, torch.clamp(ratio, 0.8, 1.2) * adv).mean()\n",
              "PPO clip: minus the min of the surrogates"),
        Valid("pg_losses = -advantages * ratio\n"
              "pg_losses2 = -advantages * torch.clamp(ratio, 1.0 - cliprange, 1.0 + cliprange)\n"
              "pg_loss = torch.max(pg_losses, pg_losses2).mean()\n",
              "TRL/CleanRL: max of the negated surrogates"),
        Valid("surrogate = torch.min(ratio * A, clipped * A)\nloss = -surrogate.mean()\n",
              "a maximised surrogate negated into the loss"),
        Valid("loss = -(logp * adv).sum()\nloss.backward()\n", "REINFORCE"),
        Valid("def compute_advantages(rewards, baseline):\n    adv = -(baseline - rewards)\n    return adv\n",
              "minus (baseline - rewards) is rewards - baseline"),
        Valid("coef_1 = torch.exp(log_ratio)\ncoef_2 = torch.clamp(coef_1, 1 - eps, 1 + eps)\n"
              "per_token_loss1 = coef_1 * advantages.unsqueeze(1)\n"
              "per_token_loss2 = coef_2 * advantages.unsqueeze(1)\n"
              "per_token_loss = -torch.min(per_token_loss1, per_token_loss2)\n"
              "loss = (per_token_loss * mask).sum() / mask.sum()\n",
              "TRL GRPO: the positive per_token_loss1/2 only feed the min"),
        Valid("advantages = returns - values\nadvantages = (advantages - advantages.mean()) / (advantages.std() + 1e-8)\n",
              "PPO advantages and whitening"),
        Valid("neg_adv = -advantages\nloss = (ratio * neg_adv).mean()\n", "negated once, undone once"),
        Valid("class T:\n    def loss(self, ratio):\n        surr1 = ratio * self.adv\n"
              "        surr2 = ratio.clamp(0.8, 1.2) * self.adv\n"
              "        return -torch.min(surr1, surr2).mean()\n", "names, self attributes, returned"),
        Valid("value_loss = ((values - returns) ** 2).mean()\nloss = pg_loss + 0.5 * value_loss\n",
              "returns in a value loss"),
    ]
    INVALID = [
        Invalid("def group_advantages(rewards, group_size):\n"
                "    advantages = (rewards - rewards.mean()) / rewards.std()\n"
                "    advantages = -advantages\n    return advantages\n", line=3, why="negated advantages"),
        Invalid("adv = -(rewards - baseline)\n", line=1, why="negated reward minus baseline"),
        Invalid("loss = (ratio * adv).mean()\nloss.backward()\n", line=1, why="surrogate not negated"),
        Invalid("pg_loss = torch.max(ratio * A, clipped * A).mean()\n", line=1, why="max of positive surrogates"),
        Invalid("loss = -torch.max(ratio * adv, torch.clamp(ratio, 0.8, 1.2) * adv).mean()\n", line=1,
                why="negated max: optimistic clip"),
        Invalid("surr1 = -ratio * advantages\nsurr2 = -torch.clamp(ratio, 0.8, 1.2) * advantages\n"
                "pg_loss = torch.min(surr1, surr2).mean()\n", line=3, why="min of negated surrogates"),
        Invalid("class PPO:\n    def update(self, logp):\n        ratio = (logp - self.old_logp).exp()\n"
                "        obj = ratio * self.advantages\n        self.optimizer.zero_grad()\n"
                "        obj.mean().backward()\n", line=4, why="not named like a loss, but backward-ed"),
        Invalid("advantages = values - returns\n", line=1, why="values minus returns"),
        Invalid("def reinforce_loss(log_probs, returns):\n    return (log_probs * returns).sum()\n"
                "loss = reinforce_loss(lp, G_t)\nloss.backward()\n", line=3, why="through a helper"),
        Invalid("advantages *= -1\n", line=1, why="in-place negation"),
    ]

    def check(self, ctx: ModuleContext) -> Iterator[Violation]:
        weight = SignSearch(ctx, role_matcher(ctx, *WEIGHT_ROLES, exclude=COEF_ROLES), role_stop(ctx, *COEF_ROLES),
                            skip_term=lambda term: is_baseline(ctx, term))
        ratio = SignSearch(ctx, lambda n: (RATIO_NAME.fullmatch(n) is not None and not NOT_RATIO_NAME.fullmatch(n))
                           or ctx.names.is_role(n, "logp"))

        # 1. PPO clip with min/max of the wrong sign
        bad_clips: list[cst.Call] = []
        minmax_args: set[str] = set()
        for call in ctx.nodes(cst.Call):
            kind = min_max_kind(ctx, call)
            if kind is None:
                continue
            for arg in call.args:
                key = dotted_name(arg.value)
                if key is not None:
                    minmax_args.add(key)
            signs = [weight.sign_of(a.value) for a in call.args]
            if None in signs or signs[0] != signs[1]:
                continue
            if any(ratio.sign_of(a.value) is None for a in call.args):  # dual clip: -A * c has no ratio
                continue
            if (kind == "max") == (signs[0] > 0):
                bad_clips.append(call)
                form = "max of ratio * A and clipped * A" if kind == "max" else "min of -ratio * A and -clipped * A"
                yield Violation(call, f"PPO clip takes the {form}: that is the optimistic bound, which removes the "
                                      "trust region; use -torch.min(ratio * A, clipped * A) or "
                                      "torch.max(-ratio * A, -clipped * A)")

        # 3 (first part). advantages negated
        negations = []
        for stmt, value, target in _advantage_assignments(ctx):
            if isinstance(stmt, cst.AugAssign):
                negated = isinstance(stmt.operator, (cst.MultiplyAssign, cst.DivideAssign)) and _negative_literal(value)
            else:
                negated = _source_sign(ctx, value, SIGN_DEPTH_ADV) == -1
            if negated:
                negations.append(stmt)

        # 2. surrogate not negated in a minimised loss. Judged where the value ends up (a positive objective
        # named like a loss and negated later, as TRL does, is fine), reported where the fault starts.
        candidates = [(target, value, stmt) for target, value, stmt in sum_statements(ctx)
                      if target_key(target) not in minmax_args]
        for call in iter_calls(ctx, "backward"):
            recv = receiver(call)
            if recv is not None and not isinstance(recv, (cst.Name, cst.Attribute)):
                candidates.append((None, recv, call))
        candidates.sort(key=lambda c: ctx.order[id(c[2])])
        may_be_loss = loss_candidate_filter(ctx)
        judged = []  # (stmt, term, net sign, via, target)
        for target, value, stmt in candidates:
            if target is not None and (_not_a_loss(ctx, target) or not may_be_loss(target, stmt)
                                       or not is_minimised_loss(ctx, target, stmt)):
                continue
            for sign, term in _terms(value):
                inner = weight.sign_of(term)
                via = list(weight.via)
                if inner is not None and ratio.sign_of(term) is not None:
                    judged.append((stmt, term, sign * inner, via, target))
        correct_vias = [via for _, _, net, via, _ in judged if net < 0]
        wrong = [j for j in judged if j[2] > 0 and not any(j[0] in via for via in correct_vias)]
        wrong_stmts = {id(j[0]) for j in wrong}
        for stmt, term, _, via, target in wrong:
            if any(id(s) in wrong_stmts for s in via if s is not stmt) or any(s in negations for s in via):
                continue
            if any(ctx.contains(term, c) or any(ctx.contains(s, c) for s in via) for c in bad_clips):
                continue
            node = term if target is not None and not _synthetic(stmt, term) else stmt
            yield Violation(node, "the policy-gradient surrogate (ratio * A) enters a minimised loss with a + "
                                  "sign, so the update makes high-advantage episodes less likely; negate it: "
                                  "loss = -(ratio * A).mean()")

        # 3. advantages negated (unless a later negation undoes it on the way into a correct loss)
        for stmt in negations:
            if not any(stmt in via for via in correct_vias):
                yield Violation(stmt, "advantages are negated here (an advantage is reward minus baseline), so the "
                                      "update makes good episodes less likely; drop the minus")


SIGN_DEPTH_ADV = 8


def _not_a_loss(ctx: ModuleContext, target) -> bool:
    """Targets that flow into a loss but are not one: advantages, returns, rewards, baselines."""
    key = target_key(target)
    bare = key.rsplit(".", 1)[-1] if key else ""
    return any(ctx.names.is_role(bare, r) for r in WEIGHT_ROLES) or bool(BASELINE_NAME.fullmatch(bare))


def _synthetic(stmt, term) -> bool:
    return isinstance(stmt, cst.AugAssign) and stmt.value is not term and not isinstance(stmt.value, cst.BinaryOperation)


def _advantage_assignments(ctx: ModuleContext):
    for stmt in ctx.nodes(cst.Assign):
        if len(stmt.targets) == 1 and isinstance(stmt.targets[0].target, (cst.Name, cst.Attribute)):
            if ctx.names.is_role(value_name(stmt.targets[0].target), "advantages"):
                yield stmt, stmt.value, stmt.targets[0].target
    for stmt in ctx.nodes(cst.AugAssign):
        if isinstance(stmt.target, (cst.Name, cst.Attribute)) and ctx.names.is_role(
                value_name(stmt.target), "advantages"):
            yield stmt, stmt.value, stmt.target


def _negative_literal(expr) -> bool:
    return isinstance(expr, cst.UnaryOperation) and isinstance(expr.operator, cst.Minus) and isinstance(
        expr.expression, (cst.Integer, cst.Float))


def _source_sign(ctx: ModuleContext, expr: cst.BaseExpression, depth: int) -> int | None:
    """The sign with which the reward-like quantity (rewards, returns, advantages; not their baselines) enters
    ``expr``; None when it does not."""
    if expr is None or depth < 0:
        return None
    terms = _terms(expr)
    if len(terms) > 1:
        for sign, term in terms:
            if is_baseline(ctx, term):
                continue
            inner = _source_sign(ctx, term, depth - 1)
            if inner is not None:
                return sign * inner
        return None
    sign, expr = terms[0]
    if isinstance(expr, cst.BinaryOperation) and isinstance(expr.operator, (cst.Multiply, cst.Divide)):
        sides = [expr.left] if isinstance(expr.operator, cst.Divide) else [expr.left, expr.right]
        for side in sides:
            inner = _source_sign(ctx, side, depth - 1)
            if inner is not None:
                other = expr.right if side is expr.left else expr.left
                if _negative_literal(other):
                    inner = -inner
                return sign * inner
        return None
    if isinstance(expr, cst.Call):
        func = expr.func
        if isinstance(func, cst.Attribute):
            called = func.attr.value
            if called in REDUCTIONS or called in SIGN_KEEPING_METHODS or called in (
                    "unsqueeze", "view", "reshape", "float", "to", "detach", "clone", "squeeze", "flatten",
                    "contiguous", "expand_as", "type_as"):
                return _weighted(sign, _source_sign(ctx, func.value, depth - 1))
            if ctx.call_name(expr) in SIGN_KEEPING_FUNCTIONS and expr.args:
                return _weighted(sign, _source_sign(ctx, expr.args[0].value, depth - 1))
        return None
    if isinstance(expr, cst.Subscript) and value_name(expr) is None:
        return _weighted(sign, _source_sign(ctx, expr.value, depth - 1))
    if isinstance(expr, (cst.Name, cst.Attribute)):
        key = dotted_name(expr)
        if key is not None and (isinstance(expr, cst.Name) or key.startswith("self.")):
            for a in reaching(ctx, key, expr):
                if a.value is not None and a.unpacked is None:
                    inner = _source_sign(ctx, a.value, depth - 1)
                    if inner is not None:
                        return sign * inner
        name = value_name(expr)
        if name is not None and any(ctx.names.is_role(name, r) for r in WEIGHT_ROLES):
            return sign
    return None


def _weighted(sign: int, inner: int | None) -> int | None:
    return None if inner is None else sign * inner
