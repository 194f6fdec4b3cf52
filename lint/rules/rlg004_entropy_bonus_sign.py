"""RLG004 entropy-bonus-sign: an entropy *bonus* added to a loss that is minimised."""

from __future__ import annotations

from typing import Iterator

import libcst as cst

from rlguard.lint.context import ModuleContext, factors, signed_terms
from rlguard.lint.rule import Invalid, Rule, Valid, Violation
from rlguard.lint.rules._loss import is_minimised_loss, net_sign, target_name


class EntropyBonusSign(Rule):
    """
    ## What it flags
    A loss that is minimised (it is named like a loss, or it is `.backward()`-ed) to which the policy's
    entropy is *added*: `loss = pg_loss + ent_coef * entropy`. Minimising that lowers entropy: the "bonus"
    is an entropy penalty.

    ## Why it is wrong
    The entropy bonus exists to keep the policy exploring. With the wrong sign it pushes the policy to
    collapse onto its current favourite tokens. Reward may still climb for a while; then entropy falls
    towards zero, every sample of a group gets the same reward, `zero_adv_frac` climbs to 1 and learning
    stops (the chapter's `entropy_sign` run: entropy 0.45 -> 0.03, reward flat).

    ## Example
    ```python
    loss = pg_loss + ent_coef * entropy.mean()
    ```

    ## Use instead
    ```python
    loss = pg_loss - ent_coef * entropy.mean()
    # or, equivalently, with an explicit entropy *loss*
    entropy_loss = -entropy.mean()
    loss = pg_loss + ent_coef * entropy_loss
    ```

    ## Fix
    `--fix` flips the sign of the flagged term (`+ c * entropy` -> `- c * entropy`).

    ## Options
    `[tool.rlguard.names]` `entropy = [...]` adds your own names for entropy tensors.
    """

    code = "RLG004"
    triggers = r"(?i)entrop|\bent\b"
    fixable = True

    VALID = [
        Valid("loss = pg_loss - ent_coef * entropy.mean()\n", "the bonus is subtracted from the loss"),
        Valid("entropy_loss = -entropy.mean()\nloss = pg_loss + ent_coef * entropy_loss\n",
              "entropy_loss is the negated entropy"),
        Valid("reward = reward + 0.01 * entropy\n", "a reward is maximised, not minimised"),
        Valid("objective = surrogate + ent_coef * entropy\n(-objective).backward()\n",
              "an objective that is maximised (its negation is minimised)"),
        Valid("loss = policy_loss - self.entropy_coeff * ent\nloss.backward()\n", "subtracted, other spellings"),
        Valid("stats['entropy'] = entropy.mean().item()\nloss = pg_loss\n", "entropy only logged"),
        Valid("loss = pg_loss + vf_coef * value_loss - ent_coef * entropy_bonus\n", "three terms, right sign"),
        Valid("loss = -(surrogate + ent_coef * entropy).mean()\n", "the whole objective is negated"),
        Valid("loss = F.cross_entropy(logits.view(-1, V), labels.view(-1)) + aux_loss\n",
              "cross-entropy against labels is not the policy's entropy"),
        Valid("entropy_loss = entropy.mean()\nloss = pg_loss - ent_coef * entropy_loss\nloss.backward()\n",
              "a positive entropy component, subtracted where it joins the loss"),
    ]
    INVALID = [
        Invalid("loss = pg_loss + ent_coef * entropy.mean()\n", line=1,
                fixed="loss = pg_loss - ent_coef * entropy.mean()\n"),
        Invalid("loss = loss + ENTROPY_COEF * entropy_bonus(logits, mask)\n", line=1,
                fixed="loss = loss - ENTROPY_COEF * entropy_bonus(logits, mask)\n"),
        Invalid("loss += 0.01 * entropy\n", line=1, fixed="loss -= 0.01 * entropy\n"),
        Invalid("total_loss = pg_loss + vf_coef * vf_loss + self.entropy_coef * ent.mean()\n", line=1),
        Invalid("ent = dist.entropy()\nout = pg + c * ent\nout.backward()\n", line=2,
                why="not named like a loss, but it is .backward()-ed"),
        Invalid("loss = pg_loss - ent_coef * (-entropy)\n", line=1, why="double negation is a penalty"),
        Invalid("h = entropy_from_logits(logits)\nloss = pg_loss + beta_ent * h.mean()\n", line=2,
                why="entropy through an alias"),
        Invalid("entropy_loss = entropy.mean()\nloss = pg_loss + args.ent_coef * entropy_loss\nloss.backward()\n",
                line=2, why="CleanRL spelling with the sign flipped: reported where the component joins the loss"),
    ]

    def check(self, ctx: ModuleContext) -> Iterator[Violation]:
        for target, value, stmt in _sum_statements(ctx):
            # `entropy_loss = entropy.mean()` defines a component; its sign is judged where it joins the loss
            if ctx.names.is_role(target_name(target), "entropy") or not is_minimised_loss(ctx, target, stmt):
                continue
            for sign, term in signed_terms(value):
                entropy_sign = _entropy_factor_sign(ctx, term)
                if entropy_sign is not None and sign * entropy_sign > 0:
                    yield Violation(term, "entropy is added to a minimised loss, so it is penalised, not "
                                          "rewarded; subtract the entropy bonus (loss - c * entropy)",
                                    _flip(stmt, value, term))


def _sum_statements(ctx: ModuleContext):
    for stmt in ctx.nodes(cst.Assign):
        if len(stmt.targets) == 1:
            yield stmt.targets[0].target, stmt.value, stmt
    for stmt in ctx.nodes(cst.AugAssign):
        if isinstance(stmt.operator, (cst.AddAssign, cst.SubtractAssign)):
            sign = -1 if isinstance(stmt.operator, cst.SubtractAssign) else 1
            value = stmt.value if sign > 0 else cst.UnaryOperation(cst.Minus(), stmt.value)
            # the synthetic negation is never reported; fixes rewrite the operator instead
            yield stmt.target, value, stmt


def _entropy_factor_sign(ctx: ModuleContext, term: cst.BaseExpression) -> int | None:
    """+1 when the term holds entropy, -1 when it holds negated entropy (an entropy loss), None otherwise."""
    for factor in factors(term):
        if ctx.has_role(factor, "entropy_coef"):
            continue
        sign = net_sign(ctx, factor, "entropy")
        if sign is not None:
            return sign
    return None


def _flip(stmt: cst.CSTNode, value: cst.BaseExpression, term: cst.BaseExpression):
    """A replacement that turns ``+ term`` into ``- term`` when the term is the right side of a ``+``."""
    if isinstance(stmt, cst.AugAssign) and isinstance(stmt.operator, cst.AddAssign) and stmt.value is term:
        return [(stmt.operator, cst.SubtractAssign(whitespace_before=stmt.operator.whitespace_before,
                                                   whitespace_after=stmt.operator.whitespace_after))]
    for node in _binary_ops(value):
        if node.right is term and isinstance(node.operator, cst.Add):
            op = node.operator
            return [(op, cst.Subtract(whitespace_before=op.whitespace_before, whitespace_after=op.whitespace_after))]
    return []


def _binary_ops(expr: cst.BaseExpression):
    while isinstance(expr, cst.BinaryOperation):
        yield expr
        expr = expr.left
