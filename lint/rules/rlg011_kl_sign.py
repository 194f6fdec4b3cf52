"""RLG011 kl-sign: a KL penalty subtracted from a minimised loss, or added to a (maximised) reward."""

from __future__ import annotations

from typing import Iterator

import libcst as cst

from rlguard.lint.context import ModuleContext
from rlguard.lint.rule import Invalid, Rule, Valid, Violation
from rlguard.lint.rules._loss import MAXIMISED_NAME, is_minimised_loss
from rlguard.lint.rules._signs import BASELINE_NAME, SignSearch, loss_candidate_filter, _terms, flip, role_matcher, role_stop, sum_statements, target_key


class KlSign(Rule):
    """
    ## What it flags
    A KL penalty with the wrong sign:

    - **in a loss that is minimised** (named like a loss, or `.backward()`-ed), the KL term *subtracted*:
      `loss = pg_loss - kl_coef * kl`, `loss -= beta * kl_loss`;
    - **in a reward** (a name like `rewards`, `scores`, `non_score_reward`, `rlhf_reward`), the KL term *added*:
      `rewards = rewards + beta * kl`.

    The rule thinks in terms of the net sign of `logp - ref_logp`, following aliases and small same-module helpers:
    `reward - beta * (logp - ref_logp)` and `reward + beta * (ref_logp - logp)` are both correct, and so is
    verl's k3 estimator written from `kl = ref_logp - logp` (`kld = exp(kl) - kl - 1`). When no reference
    log-probs are visible, it trusts the name (`kl`, `kl_div`, `per_token_kl`, `kl_penalty(...)`), ignoring
    coefficients (`kl_coef`, `beta`, `kl_ctl`).

    ## Why it is wrong
    The KL term keeps the policy near the reference model. With the wrong sign it *rewards* moving away: the KL to
    the reference grows every step instead of staying in its band, the adaptive KL controller (if any) raises its
    coefficient, which only pushes harder, and the policy drifts into degenerate text that games the reward model
    (reward up, held-out quality down).

    ## Example
    ```python
    loss = pg_loss - kl_coef * kl
    rewards = scores + beta * (logp - ref_logp)
    ```

    ## Use instead
    ```python
    loss = pg_loss + kl_coef * kl
    rewards = scores - beta * (logp - ref_logp)
    # or, TRL style
    non_score_reward = -kl_coef * kl
    reward = score + non_score_reward
    ```

    ## Fix
    `--fix` flips the sign of the flagged term when it is the right operand of the statement's top-level sum
    (`- c * kl` -> `+ c * kl`, `+=` <-> `-=`). A term elsewhere (first in the sum, inside parentheses) is reported
    without a fix.

    ## Options
    `[tool.rlguard.names]` `kl = [...]`, `kl_coef = [...]`, `ref_logp = [...]`, `rewards = [...]` add your own
    names.
    """

    code = "RLG011"
    triggers = r"kl(?:_|\b)|_kl|ref_?log|ref_per_token|reference_log"
    fixable = True

    VALID = [
        Valid("loss = pg_loss + kl_coef * kl\n", "the penalty is added to the loss"),
        Valid("loss = pg_loss\nloss += beta * kl_loss\n", "augmented assignment"),
        Valid("kl = logprobs - ref_logprobs\nnon_score_reward = -kl_coef * kl\nreward = score + non_score_reward\n",
              "TRL: negative non-score reward"),
        Valid("rewards = rewards - beta * (logp - ref_logp)\n", "penalty subtracted from the reward"),
        Valid("rewards = rewards + beta * (ref_logp - logp)\n", "the same, written the other way round"),
        Valid("kl = ref_logprob - logprob\nkl = torch.clamp(kl, min=-20, max=20)\nratio = torch.exp(kl)\n"
              "kld = (ratio - kl - 1).contiguous()\nloss = pg_loss + self.kl_coef * kld.mean()\n",
              "verl low-variance KL (k3) built from ref - logp"),
        Valid("per_token_kl = torch.exp(ref_per_token_logps - per_token_logps) - (ref_per_token_logps - "
              "per_token_logps) - 1\nper_token_loss = -(per_token_loss - self.beta * per_token_kl)\n",
              "old TRL GRPO: minus (objective - beta * kl)"),
        Valid("def kl_penalty(lp, ref_lp):\n    return lp - ref_lp\nloss = pg_loss + beta * kl_penalty(lp, ref_lp)\n",
              "through a helper"),
        Valid("stats['kl'] = (logp - ref_logp).mean().item()\nloss = pg_loss - ent_coef * entropy\n",
              "KL only logged"),
    ]
    INVALID = [
        Invalid("loss = pg_loss - kl_coef * kl\n", line=1, fixed="loss = pg_loss + kl_coef * kl\n"),
        Invalid("loss = pg_loss\nloss -= self.beta * kl.mean()\n", line=2,
                fixed="loss = pg_loss\nloss += self.beta * kl.mean()\n"),
        Invalid("rewards = rewards + beta * kl\n", line=1, fixed="rewards = rewards - beta * kl\n"),
        Invalid("scores = scores + self.kl_coef * (logprobs - ref_logprobs).sum(-1)\n", line=1,
                fixed="scores = scores - self.kl_coef * (logprobs - ref_logprobs).sum(-1)\n"),
        Invalid("reward = score - beta * (ref_logp - logp)\n", line=1, fixed="reward = score + beta * (ref_logp - logp)\n",
                why="net sign of logp - ref_logp is +"),
        Invalid("log_ratio = new_log_probs - ref_log_probs\nkl = log_ratio\nout = pg + kl_coef * -kl.mean()\n"
                "out.backward()\n", line=3, why="backward-ed, negated through an alias"),
        Invalid("def compute_loss(logits, ids, old_log_probs, advantages, mask, ref_log_probs, cfg):\n"
                "    kl = aggregate(kl_penalty(log_probs, ref_log_probs), mask)\n"
                "    loss = pg_loss - cfg.ent_coef * entropy\n"
                "    loss = loss - cfg.kl_coef * kl\n    return loss\n", line=4),
        Invalid("kl = ref_logp - logp\nloss = policy_loss + beta * kl.mean()\n", line=2,
                why="kl written as ref - logp, then added: -KL in the loss"),
        Invalid("non_score_reward = kl_coef * (logprobs - ref_logprobs)\n", line=1, why="positive non-score reward"),
    ]

    def check(self, ctx: ModuleContext) -> Iterator[Violation]:
        stop = role_stop(ctx, "kl_coef", "entropy_coef")
        ref = SignSearch(ctx, role_matcher(ctx, "ref_logp"), stop)
        named = SignSearch(ctx, role_matcher(ctx, "kl", exclude=("kl_coef",)), stop)

        def kl_sign(term):
            sign = ref.sign_of(term)
            if sign is not None:
                return -sign, ref.via
            return named.sign_of(term), named.via

        may_be_loss = loss_candidate_filter(ctx)
        judged: set[int] = set()  # statements already judged: a KL inherited from them is not judged again
        for target, value, stmt in sum_statements(ctx):
            key = target_key(target)
            if key is None:
                continue
            bare = key.rsplit(".", 1)[-1]
            if any(ctx.names.is_role(bare, r) for r in ("advantages", "returns")) or BASELINE_NAME.fullmatch(bare):
                continue
            reward = ctx.names.is_role(bare, "rewards") or MAXIMISED_NAME.fullmatch(bare) is not None
            loss = not reward and may_be_loss(target, stmt) and is_minimised_loss(ctx, target, stmt)
            if not (reward or loss):
                continue
            judged.add(id(stmt))
            for sign, term in _terms(value):
                inner, via = kl_sign(term)
                if inner is None or any(id(s) in judged for s in via):
                    continue
                net = sign * inner
                synthetic = isinstance(stmt, cst.AugAssign) and term is not stmt.value
                node = stmt if synthetic else term
                if loss and net < 0:
                    yield Violation(node, "the KL penalty is subtracted from a minimised loss, so the update moves "
                                          "away from the reference; add it: loss = pg_loss + kl_coef * kl",
                                    flip(stmt, value, term))
                elif reward and net > 0:
                    yield Violation(node, "the KL penalty is added to the reward, so the policy is paid to move away "
                                          "from the reference; subtract it: reward - beta * (logp - ref_logp)",
                                    flip(stmt, value, term))
