"""RLG005 advantage-sign: advantages negated, the surrogate not negated in a minimised loss, or PPO clip with
min/max of the wrong sign."""

from __future__ import annotations

import re
from typing import Iterator

import libcst as cst

from rlguard.catalog import ADVANTAGE_SIGN
from rlguard.lint.analysis import Analysis
from rlguard.lint.analysis import semantics as S
from rlguard.lint.analysis.index import key_of, last_name
from rlguard.lint.analysis.losses import losses, start, top_terms
from rlguard.lint.analysis.roles import critic_output, is_clip_weight, ratio_terms
from rlguard.lint.analysis.signs import factors, min_max_kind, signs
from rlguard.lint.analysis.terms import quantities
from rlguard.lint.rule import Invalid, Rule, Valid, Violation

WEIGHT_ROLES = ("advantages", "returns", "rewards")
BASELINE_NAME = re.compile(r"(?i)\w*(mean|avg|average|baseline|values?|vpreds?|v_preds?|bias)\w*|v|b|mu|base")
RATIO_NAME = re.compile(r"(?i)\w*ratios?\w*|rhos?|coef_[12]|is_weights?|importance_weights?")
# clip bounds, not ratios: verl's clip_ratio_c, clip_ratio_low/high, NeMo-RL's ratio_clip_c/min/max
NOT_RATIO_NAME = re.compile(r"(?i)\w*clip_?ratio\w*|\w*ratio_clip\w*|\w*ratio_(c|low|high|max|min|eps|clip|range)")
COEF_ROLES = ("entropy_coef", "kl_coef")
# Objects that hold settings: an attribute read from one is a number, not a tensor.
CONFIG_HEADS = frozenset({"cfg", "config", "args", "hparams", "opts", "options", "params", "settings", "conf",
                          "loss_config", "algo_config", "training_args"})


class AdvantageSign(Rule):
    """
    ## What it flags
    Three ways of getting the direction of the policy gradient backwards:

    - **advantages negated**: `advantages = -advantages`, `adv = -(rewards - baseline)`, `adv = values - returns`,
      `advantages *= -1` (an advantage is *reward minus baseline*: `-(baseline - rewards)` is fine);
    - **surrogate not negated**: a loss that is minimised (named like a loss, or `.backward()`-ed) in which
      `ratio * A` (or `logp * A`, `logp * returns`) enters with a `+` sign: `loss = (ratio * adv).mean()`;
    - **PPO clip of the wrong sign**: the max of the surrogates `torch.max(ratio * A, clipped * A)`, or the min of
      their negations `torch.min(-ratio * A, -clipped * A)`, whatever sign is put in front;
    - **dual clip on every token**: the dual-clip bound `torch.min(clipped_loss, -c * A)` (or
      `torch.max(objective, c * A)`) is meant for negative advantages; taken on every token, each
      positive-advantage token's loss becomes the constant `-c * A`, with no gradient. Reported when the bounded
      value reaches a minimised loss and the function never tests the sign of the advantages (`A < 0` in a
      `torch.where` or a mask).

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

    code = ADVANTAGE_SIGN
    # every branch starts with a literal (Python's re scans those fast); the rule checks the roles itself
    # (clamp/clip: a PPO clip names its advantages by their use, `min(r * x, r.clamp(lo, hi) * x)`)
    # a ratio clipped to a trust region (`clamp(r, 1 - eps, 1 + eps)`, `r.clamp(0.8, 1.2)`) stands for a PPO
    # surrogate whatever its weights are called; a bare clamp( would pass most files for nothing
    triggers = (r"advantage|Advantage|adv(?:s\b|_|\b)|\*\s*-?\s*(?:A|returns?|rewards?)\b"
                r"|(?:clamp|clip)\([^)\n]*(?:\b1(?:\.0*)?\s*[-+]|\b0\.\d+\s*,\s*1\.\d)"
                r"|(?:returns?|rewards?)\s*\*\s*\w*(?:ratio|log_?prob|logp)|A\s*\*\s*\w*(?:ratio|log_?prob|logp)"
                # per-episode rewards read from records (`ep.reward`, `batch["returns"]`): the weight by its source,
                # which a file's own names do not decide
                r"|\.(?:rewards?|returns?)\b|[\"'](?:rewards?|returns?)[\"']")

    PREVIEW_PARTS = ("a loss known only by the name of the local variable that holds it (`loss = ...` with no backward, loss function or optimising caller in view)",)
    VALID = [
        Valid("def update(policy, critic, opt, obs, acts, batch):\n"
              "    lp = policy(obs).log_softmax(-1).gather(-1, acts[:, None]).squeeze(-1)\n"
              "    q = batch[\"returns\"] - critic(obs).squeeze(-1)\n"
              "    pl = -(q.detach() * lp).mean()\n"
              "    opt.zero_grad()\n"
              "    (q.pow(2).mean() + pl).backward()\n"
              "    opt.step()\n",
              why="A2C: returns minus the critic's values weigh the log-probs, negated", capability="C2",
              style="functional"),
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
        Valid("neg_adv = -advantages\nloss = (ratio * neg_adv).mean()\n", "negated once, undone once",
              capability="C1", style="script"),
        Valid("def policy_loss(batch, cfg):\n"
              "    adv = batch['advantages']\n"
              "    ratio = torch.exp(batch['logp'] - batch['old_logp'])\n"
              "    clipped = torch.max(-ratio * adv, -ratio.clamp(1 - cfg.eps, 1 + cfg.eps) * adv)\n"
              "    bounded = torch.min(clipped, -cfg.dual_clip * adv)\n"
              "    per_token = torch.where(adv < 0, bounded, clipped)\n"
              "    return (per_token * batch['mask']).sum() / batch['mask'].sum()\n",
              "dual clip selected where the advantage is negative", capability="FP", style="framework"),
        Valid("class PPO:\n"
              "    def loss(self, logp, old_logp, advantages):\n"
              "        ratio = (logp - old_logp).exp()\n"
              "        obj = torch.min(ratio * advantages, ratio.clamp(0.8, 1.2) * advantages)\n"
              "        lower = torch.max(obj, self.clip_c * advantages)\n"
              "        return -torch.where(advantages < 0, lower, obj).mean()\n",
              "dual clip on the objective, applied to negative advantages only", capability="FP", style="class"),
        Valid("r = (lp - lp_old).exp()\n"
              "pl = torch.max(-r * adv, -r.clamp(0.8, 1.28) * adv)\n"
              "neg = (adv < 0).float()\n"
              "pl = neg * torch.min(pl, -3.0 * adv) + (1 - neg) * pl\n"
              "pl.mean().backward()\n",
              "dual clip blended by a mask of the negative advantages", capability="FP", style="script"),
        Valid("q = (lp - lp_old).exp()\ns1 = q * g\ns2 = q.clamp(0.8, 1.2) * g\nl = -torch.min(s1, s2).mean()\n"
              "l.backward()\n",
              "g weighs both sides of the clip: the advantages by their use, here with the right sign",
              capability="C2", style="script"),
        Valid("class Learner:\n"
              "    def step(self, batch):\n"
              "        rho = torch.exp(self.logp(batch) - batch.behaviour_logp)\n"
              "        gain = batch.score - batch.baseline\n"
              "        obj = torch.min(rho * gain, rho.clamp(0.9, 1.1) * gain)\n"
              "        (-obj.mean()).backward()\n",
              "a clipped objective with an advantage named gain, negated into the loss", capability="C2",
              style="class"),
        Valid("m = torch.max(a * b, c * b)\nloss = m.mean()\nloss.backward()\n",
              "a shared factor but no ratio and its clamp: not a PPO clip, so b is no advantage", capability="C2",
              style="script"),
        Valid("def expected_loss(weights, ratio, cfg):\n"
              "    clipped_ratio = torch.clamp(ratio, 1 - cfg.eps_low, 1 + cfg.eps_high)\n"
              "    l1 = -weights * ratio\n"
              "    l2 = -weights * clipped_ratio\n"
              "    worst = torch.maximum(l1, l2)\n"
              "    floor = -weights * cfg.ratio_clip_c\n"
              "    lower = torch.minimum(worst, floor)\n"
              "    return torch.where(weights < 0, lower, worst).mean()\n",
              "a dual-clip constant named like a ratio is a setting of the config, and the bound is selected for "
              "negative advantages", capability="FP", style="framework"),
        Valid("class T:\n    def loss(self, ratio):\n        surr1 = ratio * self.adv\n"
              "        surr2 = ratio.clamp(0.8, 1.2) * self.adv\n"
              "        return -torch.min(surr1, surr2).mean()\n", "names, self attributes, returned"),
        Valid("value_loss = ((values - returns) ** 2).mean()\nloss = pg_loss + 0.5 * value_loss\n",
              "returns in a value loss"),
        Valid("def grpo_step(model, ids, v29, v33, v75, v32):\n"
              "    v37 = torch.log_softmax(model(ids).logits[:, :-1], -1).gather(2, ids[:, 1:, None])[..., 0]\n"
              "    v45 = v33 - v33.view(-1, v75.g).mean(dim=1).repeat_interleave(v75.g)\n"
              "    v52 = torch.exp(v37 - v29)\n"
              "    v55 = torch.clamp(v52, 1.0 - v75.eps, 1.0 + v75.eps)\n"
              "    v54 = -torch.min(v52 * v45.unsqueeze(1), v55 * v45.unsqueeze(1))\n"
              "    ((v54 * v32).sum() / v32.sum()).backward()\n",
              "neutral names, broadcast advantages, negated min: correct", capability="C2", style="script"),
        Valid("def update(model, opt, episodes, ids, keep_rows, n):\n"
              "    w = torch.tensor([ep.reward for ep in episodes])\n"
              "    m = torch.tensor(keep_rows, dtype=torch.bool)[:, 1:]\n"
              "    lp = -F.cross_entropy(model(ids[:, :-1]).logits.transpose(1, 2), ids[:, 1:], reduction='none')\n"
              "    obj = ((lp * w[:, None]) * m).sum() / n\n"
              "    (-obj).backward()\n",
              "REINFORCE on per-episode rewards, the negated cross-entropy as log-probs, negated at the end",
              capability="C2", style="script"),
    ]
    INVALID = [
        Invalid("def update(policy, critic, opt, obs, acts, batch):\n"
                "    lp = policy(obs).log_softmax(-1).gather(-1, acts[:, None]).squeeze(-1)\n"
                "    q = batch[\"returns\"] - critic(obs).squeeze(-1)\n"
                "    pl = (q.detach() * lp).mean()\n"
                "    opt.zero_grad()\n"
                "    (q.pow(2).mean() + pl).backward()\n"
                "    opt.step()\n", line=4,
                why="returns minus a model's output (the critic's baseline) are advantages by their computation, and "
                    "the log-probs are the policy's by theirs: the surrogate enters the minimised loss with a + sign",
                capability="C2", style="functional"),
        Invalid("def group_advantages(rewards, group_size):\n"
                "    advantages = (rewards - rewards.mean()) / rewards.std()\n"
                "    advantages = -advantages\n    return advantages\n", line=3, why="negated advantages", preview=True),
        Invalid("adv = -(rewards - baseline)\n", line=1, why="negated reward minus baseline", preview=True),
        Invalid("loss = (ratio * adv).mean()\nloss.backward()\n", line=1, why="surrogate not negated"),
        Invalid("pg_loss = torch.max(ratio * A, clipped * A).mean()\n", line=1, why="max of positive surrogates", preview=True),
        Invalid("loss = -torch.max(ratio * adv, torch.clamp(ratio, 0.8, 1.2) * adv).mean()\n", line=1,
                why="negated max: optimistic clip"),
        Invalid("surr1 = -ratio * advantages\nsurr2 = -torch.clamp(ratio, 0.8, 1.2) * advantages\n"
                "pg_loss = torch.min(surr1, surr2).mean()\n", line=3, why="min of negated surrogates"),
        Invalid("class PPO:\n    def update(self, logp):\n        ratio = (logp - self.old_logp).exp()\n"
                "        obj = ratio * self.advantages\n        self.optimizer.zero_grad()\n"
                "        obj.mean().backward()\n", line=4, why="not named like a loss, but backward-ed",
                capability="C2", style="class"),
        Invalid("advantages = values - returns\n", line=1, why="values minus returns", preview=True),
        Invalid("def reinforce_loss(log_probs, returns):\n    return (log_probs * returns).sum()\n"
                "loss = reinforce_loss(lp, G_t)\nloss.backward()\n", line=3, why="through a helper"),
        Invalid("advantages *= -1\n", line=1, why="in-place negation", preview=True),
        Invalid("def policy_loss(batch, cfg):\n"
                "    adv = batch['advantages']\n"
                "    ratio = torch.exp(batch['logp'] - batch['old_logp'])\n"
                "    clipped = torch.max(-ratio * adv, -ratio.clamp(1 - cfg.eps, 1 + cfg.eps) * adv)\n"
                "    bounded = torch.min(clipped, -cfg.dual_clip * adv)\n"
                "    return (bounded * batch['mask']).sum() / batch['mask'].sum()\n", line=5,
                why="dual clip on every token: positive-advantage tokens get the constant -c * A", capability="C9",
                style="framework"),
        Invalid("class PPO:\n"
                "    def loss(self, logp, old_logp, advantages):\n"
                "        ratio = (logp - old_logp).exp()\n"
                "        obj = torch.min(ratio * advantages, ratio.clamp(0.8, 1.2) * advantages)\n"
                "        obj = torch.max(obj, self.clip_c * advantages)\n"
                "        return -obj.mean()\n", line=5,
                why="the objective form: max with c * A on every token", capability="C9", style="class"),
        Invalid("r = (lp - lp_old).exp()\n"
                "pl = torch.max(-r * adv, -r.clamp(0.8, 1.28) * adv)\n"
                "pl = torch.min(pl, -3.0 * adv)\n"
                "pl.mean().backward()\n", line=3, why="a literal dual-clip constant, no selection",
                capability="C9", style="script"),
        Invalid("q = (lp - lp_old).exp()\ns1 = q * g\ns2 = q.clamp(0.8, 1.2) * g\nl = torch.max(s1, s2).mean()\n"
                "l.backward()\n", line=4,
                why="g weighs both sides of the clip, so it is the advantage: the max is the optimistic bound",
                capability="C2", style="script"),
        Invalid("def clipped_objective(logp, old, w, eps):\n"
                "    ratio = torch.exp(logp - old)\n"
                "    return -torch.min(-ratio * w, -torch.clamp(ratio, 1 - eps, 1 + eps) * w).mean()\n", line=3,
                why="an advantage with no telling name, known from the clip", capability="C2", style="functional"),
        Invalid("class Learner:\n"
                "    def step(self, batch):\n"
                "        rho = torch.exp(self.logp(batch) - batch.behaviour_logp)\n"
                "        gain = batch.score - batch.baseline\n"
                "        obj = torch.min(rho * gain, rho.clamp(0.9, 1.1) * gain)\n"
                "        (obj.mean()).backward()\n", line=5,
                why="a clipped objective backpropagated without its minus", capability="C2", style="class"),
        Invalid("def policy_loss(weights, ratio, cfg):\n"
                "    clipped_ratio = torch.clamp(ratio, 1 - cfg.eps_low, 1 + cfg.eps_high)\n"
                "    l1 = -weights * ratio\n"
                "    l2 = -weights * clipped_ratio\n"
                "    worst = torch.maximum(l1, l2)\n"
                "    floor = -weights * cfg.ratio_clip_c\n"
                "    return torch.minimum(worst, floor).mean()\n", line=7,
                why="the advantages (known from the clip) bound by the dual clip on every token", capability="C2",
                style="framework"),
        Invalid("def grpo_step(model, ids, v29, v33, v75, v32):\n"
                "    v37 = torch.log_softmax(model(ids).logits[:, :-1], -1).gather(2, ids[:, 1:, None])[..., 0]\n"
                "    v43 = v33.view(-1, v75.g).mean(dim=1).repeat_interleave(v75.g)\n"
                "    v45 = v33 - v43\n"
                "    v52 = torch.exp(v37 - v29)\n"
                "    v55 = torch.clamp(v52, 1.0 - v75.eps, 1.0 + v75.eps)\n"
                "    v56 = v52 * v45.unsqueeze(1)\n"
                "    v57 = v55 * v45.unsqueeze(1)\n"
                "    v58 = (torch.min(v56, v57) * v32).sum() / v32.sum()\n"
                "    v58.backward()\n", line=7,
                why="neutral names: the advantage is the broadcast value weighing both sides of the clip "
                    "(`A.unsqueeze(1)`), the ratio an exp of a log-prob difference; the minus is missing",
                capability="C2", style="script"),
        Invalid("def epoch(model, v27, v31, v46, v60, cfg):\n"
                "    for v77 in torch.randperm(8).split(2):\n"
                "        v83 = model(v27[v77]) - v31[v77]\n"
                "        v89 = torch.exp(v83)\n"
                "        v92 = torch.min(-v60[v77] * v89, -v60[v77] * torch.clamp(v89, 1.0 - cfg.eps, 1.0 + cfg.eps))\n"
                "        (v92 * v46[v77]).sum().backward()\n", line=5,
                why="row-selected advantages `A[idx]` on both sides: min of the negated surrogates is the "
                    "optimistic bound", capability="C2", style="script"),
        Invalid("def loss(logprobs, old_logprobs, advantages, mask, eps):\n"
                "    lr = (logprobs - old_logprobs) * mask\n"
                "    r = torch.exp(lr)\n"
                "    a = -advantages * r\n"
                "    b = -advantages * torch.clamp(r, 1.0 - eps, 1.0 + eps)\n"
                "    return torch.sum(torch.min(a, b) * mask) / mask.sum()\n", line=6,
                why="a masked log-ratio under exp is still the ratio", capability="C2", style="functional"),
        Invalid("def update(model, opt, episodes, ids, keep_rows, n):\n"
                "    w = torch.tensor([ep.reward for ep in episodes])\n"
                "    m = torch.tensor(keep_rows, dtype=torch.bool)[:, 1:]\n"
                "    lp = -F.cross_entropy(model(ids[:, :-1]).logits.transpose(1, 2), ids[:, 1:], reduction='none')\n"
                "    obj = ((lp * w[:, None]) * m).sum() / n\n"
                "    obj.backward()\n", line=5,
                why="the weight is per-episode rewards by what it is built from, whatever the local is called; the "
                    "negated cross-entropy is the log-prob; a bool tensor only selects", capability="C2",
                style="script"),
        Invalid("class A:\n"
                "    def __init__(self, p):\n"
                "        self.a1 = p\n"
                "        self.a2 = torch.optim.Adam(p.parameters())\n"
                "    def learn(self, batch):\n"
                "        v3 = self.a1(batch.obs).dist\n"
                "        v4 = v3.log_prob(batch.act)\n"
                "        v5 = (v4 * batch.returns).mean()\n"
                "        self.a2.zero_grad()\n"
                "        v5.backward()\n"
                "        self.a2.step()\n", line=8,
                why="REINFORCE with neutral names: the log-probs are a distribution's log_prob of what the policy's "
                    "forward returns, the surrogate is not negated", capability="C2", style="class"),
    ]

    def check(self, ctx: Analysis) -> Iterator[Violation]:
        judge = _Surrogates(ctx)
        # 1. PPO clip with min/max of the wrong sign
        bad_clips: list[cst.Call] = []
        for call in ctx.nodes(cst.Call):
            kind = min_max_kind(ctx, call)
            if kind is None:
                continue
            signs_ = [judge.surrogate_sign(arg.value) for arg in call.args]
            if None in signs_ or signs_[0] != signs_[1]:
                continue  # dual clip (-A * c has no ratio) or mixed forms
            if (kind == "max") == (signs_[0] > 0):
                bad_clips.append(call)
                form = "max of ratio * A and clipped * A" if kind == "max" else "min of -ratio * A and -clipped * A"
                yield Violation(call, f"PPO clip takes the {form}: that is the optimistic bound, which removes the "
                                      "trust region; use -torch.min(ratio * A, clipped * A) or "
                                      "torch.max(-ratio * A, -clipped * A)")

        # 1b. dual clip applied to every token: its constant bound -c * A is meant for A < 0 only
        yield from _unguarded_dual_clips(ctx, judge)

        # 2. advantages negated
        negations = [stmt for stmt in _advantage_assignments(ctx) if judge.negates(stmt)]

        # 3. surrogate not negated in a minimised loss, judged where the value ends up, reported where it starts
        loss = losses(ctx)
        sign_of = signs(ctx)
        judged = []
        for sink in loss.sinks():
            for term in sink.terms(sign_of, judge.stop):
                inner = judge.surrogate_sign(term.expr, term.frame)
                if inner is not None:
                    judged.append((sink, term, term.sign * inner))
        correct_vias = [{id(s) for _, s in term.via} for _, term, net in judged if net < 0]
        unnegated: dict[int, tuple[cst.CSTNode, bool]] = {}  # operand -> (operand, reached by inferred sinks only)
        for sink, term, net in judged:
            if net < 0:
                continue
            stmts = [s for _, s in term.via]
            if any(s in negations for s in stmts):
                continue  # the negated advantages are the cause: reported there
            if any(ctx.contains(c, term.expr) or any(ctx.contains(s, c) for s in stmts) for c in bad_clips):
                continue
            stmt, value, operand = start(ctx, sink, term)
            seen = unnegated.get(id(operand))
            unnegated[id(operand)] = (operand, sink.inferred and (seen is None or seen[1]))
        for operand, inferred in unnegated.values():
            yield Violation(operand, "the policy-gradient surrogate (ratio * A) enters a minimised loss with a + "
                                     "sign, so the update makes high-advantage episodes less likely; negate it: "
                                     "loss = -(ratio * A).mean()", preview=inferred)

        # 2 (report). negated advantages, unless a later negation undoes it on the way into a correct loss
        for stmt in negations:
            if not any(id(stmt) in via for via in correct_vias):
                yield Violation(stmt, "advantages are negated here (an advantage is reward minus baseline), so the "
                                      "update makes good episodes less likely; drop the minus")


class _Surrogates:
    """Policy-gradient surrogates: a ratio ``exp(logp - old)`` (or the log-probs themselves, REINFORCE) times the
    advantages (or returns, rewards)."""

    def __init__(self, ctx: Analysis):
        self.ctx = ctx
        self.signs = signs(ctx)
        self.quantity = quantities(ctx)
        self._ratios = {id(call) for call, _, _ in ratio_terms(ctx)}

    def stop(self, expr, frame) -> bool:
        return self.weight_sign(expr, frame) is not None or self.is_ratio(expr, frame)

    def weight_sign(self, expr, frame=None, depth: int = 4) -> int | None:
        """+1 for advantages/returns/rewards (by name, through sign-keeping operations), -1 when negated. A local
        is what its one definition is (``w = torch.tensor([ep.reward for ep in eps])``): its own name may be any."""
        name = _name_of(expr)
        if name is not None:
            vocab = self.ctx.names
            if any(vocab.is_role(name, r) for r in WEIGHT_ROLES) and not vocab.is_role(name, "entropy_coef") and \
                    not vocab.is_role(name, "kl_coef") and not vocab.is_role(name, "mask"):
                return 1
        if isinstance(expr, cst.Call) and self.ctx.method(expr) in ("unsqueeze", "view", "reshape", "squeeze",
                                                                     "float", "to", "detach", "expand_as", "clone"):
            return self.weight_sign(S.receiver(expr), frame)
        if isinstance(expr, cst.Subscript) and key_of(expr) is None:
            return self.weight_sign(expr.value, frame)
        if isinstance(expr, cst.BinaryOperation) and isinstance(expr.operator, cst.Subtract) and depth > 0:
            # `returns - values`, the value a model forward outputs (a critic) as the baseline: advantages by their
            # computation, with the sign of the returns
            inner = self.weight_sign(expr.left, frame, depth - 1)
            if inner is not None and critic_output(self.ctx, expr.right, frame):
                return inner
        if name is not None and is_clip_weight(self.ctx, expr) and not self.is_ratio(expr, frame):
            return 1  # weighs both sides of a PPO clip: the advantages by their use, whatever the name
        if depth <= 0:
            return None
        if isinstance(expr, cst.Name):
            defs = self.ctx.flow.reaching(expr.value, expr)
            if len(defs) == 1 and defs[0].kind == "assign" and defs[0].element is None and defs[0].value is not None:
                return self.weight_sign(defs[0].value, frame, depth - 1)
        elif isinstance(expr, cst.Call) and self.ctx.call_name(expr) in _TENSOR_OF and expr.args:
            return self.weight_sign(expr.args[0].value, frame, depth - 1)
        elif isinstance(expr, (cst.ListComp, cst.GeneratorExp)):
            return self.weight_sign(expr.elt, frame, depth - 1)
        return None

    def is_ratio(self, expr, frame=None, depth: int = 4) -> bool:
        name = _name_of(expr)
        if isinstance(expr, cst.Attribute) and CONFIG_HEADS & set(self.ctx.code(expr.value).split(".")):
            return False  # cfg.ratio_clip_c, self.config.clip_ratio: a setting, never the ratio tensor
        if name is not None and RATIO_NAME.fullmatch(name) and not NOT_RATIO_NAME.fullmatch(name):
            return True
        if isinstance(expr, cst.Call):
            if id(expr) in self._ratios:
                return True
            if self.ctx.method(expr) in ("clamp", "clip", "detach", "float") or self.ctx.call_name(expr) in (
                    "torch.clamp", "torch.clip"):
                inner = S.receiver(expr) if self.ctx.method(expr) else (expr.args[0].value if expr.args else None)
                return inner is not None and self.is_ratio(inner, frame, depth)
        key = key_of(expr)
        if key is not None and depth > 0:
            defs = self.ctx.flow.reaching(key, expr)
            # a ratio on one path is a ratio (`ratio = exp(lr)` for PPO, a sequence-level one for GSPO)
            if any(d.kind == "assign" and d.value is not None and d.element is None and
                   self.is_ratio(d.value, frame, depth - 1) for d in defs):
                return True
        return self.quantity._is_policy_logp(expr, frame) if name is not None else False

    def surrogate_sign(self, expr, frame=None) -> int | None:
        """The net sign of the advantages in a surrogate ``ratio * A`` (through names and reductions), else None."""
        for term in self.signs.terms(expr, frame, stop=self.stop):
            sign, facs = factors(term.expr)
            ratios = [self.is_ratio(f, term.frame) for f in facs]
            # a factor that is a ratio by its computation is no weight, whatever its name says (`r`)
            weights = [None if is_r else self.weight_sign(f, term.frame) for f, is_r in zip(facs, ratios)]
            if any(ratios) and sum(w is not None for w in weights) == 1:
                w = next(w for w in weights if w is not None)
                return term.sign * sign * w
        return None

    def negates(self, stmt) -> bool:
        if isinstance(stmt, cst.AugAssign):
            return isinstance(stmt.operator, (cst.MultiplyAssign, cst.DivideAssign)) and _negative_literal(stmt.value)
        return _source_sign(self.ctx, stmt.value, SIGN_DEPTH_ADV) == -1


SIGN_DEPTH_ADV = 8


# Calls that make a tensor of their first argument's values (a list of per-episode rewards).
_TENSOR_OF = frozenset({"torch.tensor", "torch.as_tensor", "torch.stack", "torch.cat", "numpy.array",
                        "numpy.asarray", "torch.from_numpy"})


def _name_of(expr) -> str | None:
    key = key_of(expr)
    return last_name(key) if key is not None else None


def _advantage_assignments(ctx: Analysis):
    for stmt in ctx.nodes(cst.Assign, cst.AugAssign):
        targets = [t.target for t in stmt.targets] if isinstance(stmt, cst.Assign) else [stmt.target]
        if len(targets) == 1 and isinstance(targets[0], (cst.Name, cst.Attribute)) and \
                ctx.names.is_role(_name_of(targets[0]), "advantages"):
            yield stmt


def _negative_literal(expr) -> bool:
    return isinstance(expr, cst.UnaryOperation) and isinstance(expr.operator, cst.Minus) and isinstance(
        expr.expression, (cst.Integer, cst.Float))


def _is_baseline(ctx: Analysis, term) -> bool:
    """A term subtracted as a baseline: a mean, a value estimate (``values``, ``baseline``, ``rewards.mean()``)."""
    for _ in range(4):
        if isinstance(term, cst.Call):
            called = S.called_name(term) or ""
            return bool(BASELINE_NAME.fullmatch(called)) or called in ("mean", "nanmean")
        name = _name_of(term)
        if name is None:
            return False
        if BASELINE_NAME.fullmatch(name):
            return True
        key = key_of(term)
        defs = ctx.flow.reaching(key, term) if key else []
        if len(defs) != 1 or defs[0].kind != "assign" or defs[0].value is None or defs[0].element is not None:
            return False
        term = defs[0].value
    return False


def _source_sign(ctx: Analysis, expr: cst.BaseExpression, depth: int) -> int | None:
    """The sign with which the reward-like quantity (rewards, returns, advantages; not their baselines) enters
    ``expr``; None when it does not."""
    if expr is None or depth < 0:
        return None
    terms = top_terms(expr)
    if len(terms) > 1:
        for sign, term in terms:
            if _is_baseline(ctx, term):
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
        method = ctx.method(expr)
        if method is not None and method in ("mean", "sum", "clamp", "clip", "unsqueeze", "view", "reshape", "float",
                                             "to", "detach", "clone", "squeeze", "flatten", "contiguous", "expand_as",
                                             "type_as", "nan_to_num", "masked_fill", "repeat_interleave"):
            return _weighted(sign, _source_sign(ctx, S.receiver(expr), depth - 1))
        if ctx.call_name(expr) in ("torch.clamp", "torch.clip", "torch.mean", "torch.sum") and expr.args:
            return _weighted(sign, _source_sign(ctx, expr.args[0].value, depth - 1))
        return None
    if isinstance(expr, cst.Subscript) and key_of(expr) is None:
        return _weighted(sign, _source_sign(ctx, expr.value, depth - 1))
    if isinstance(expr, (cst.Name, cst.Attribute, cst.Subscript)):
        key = key_of(expr)
        if key is not None:
            for d in ctx.flow.reaching(key, expr):
                if d.kind == "assign" and d.value is not None and d.element is None:
                    inner = _source_sign(ctx, d.value, depth - 1)
                    if inner is not None:
                        return sign * inner
        name = _name_of(expr)
        if name is not None and any(ctx.names.is_role(name, r) for r in WEIGHT_ROLES):
            return sign
    return None


def _weighted(sign: int, inner: int | None) -> int | None:
    return None if inner is None else sign * inner


def _dual_clip_bound(ctx: Analysis, judge: "_Surrogates", expr, frame=None) -> int | None:
    """The sign of ``c * A`` (a scalar bound times the advantages, no ratio): dual clip's constant bound. A name is
    followed to its one plain assignment (``pg_losses3 = -c * A``)."""
    for _ in range(3):
        key = key_of(expr)
        defs = ctx.flow.reaching(key, expr) if key is not None else []
        if len(defs) != 1 or defs[0].kind != "assign" or defs[0].element is not None or defs[0].value is None:
            break
        expr = defs[0].value
    sign, facs = factors(expr)
    weights = [judge.weight_sign(f, frame) for f in facs]
    if sum(w is not None for w in weights) != 1 or len(facs) < 2:
        return None
    for f, w in zip(facs, weights):
        if w is not None:
            continue
        if judge.is_ratio(f, frame) or not (S.number_value(f) is not None or key_of(f) is not None):
            return None  # a ratio or a tensor computation: a surrogate, not a constant bound
        scale = judge.signs.scale(f, frame)
        if scale == -1:
            sign = -sign
    return sign * next(w for w in weights if w is not None)


def _compares_advantages(ctx: Analysis, judge: "_Surrogates", func) -> bool:
    """Whether the function tests the sign of the advantages anywhere (``A < 0``, ``torch.where(adv > 0, ...)``,
    ``adv.lt(0)``): the dual-clip bound is then selected per token."""
    nodes = ctx.index.descendants(func, cst.Comparison) if func is not None else ctx.nodes(cst.Comparison)
    for comp in nodes:
        sides = [comp.left] + [c.comparator for c in comp.comparisons]
        if any(judge.weight_sign(side) is not None for side in sides) and any(
                S.number_value(side) == 0 for side in sides):
            return True
    calls = ctx.index.descendants(func, cst.Call) if func is not None else ctx.nodes(cst.Call)
    for call in calls:
        if ctx.method(call) in ("lt", "gt", "le", "ge", "sign") and judge.weight_sign(S.receiver(call)) is not None:
            return True
        if ctx.call_name(call) == "torch.sign" and call.args and judge.weight_sign(call.args[0].value) is not None:
            return True
    return False


def _unguarded_dual_clips(ctx: Analysis, judge: "_Surrogates") -> Iterator[Violation]:
    """Dual-clip PPO bounds the clipped loss by ``-c * A`` (``torch.min(clipped_loss, -c * A)``, or ``max(.., c * A)``
    on the objective) for negative advantages only; taken on every token it replaces the loss of each
    positive-advantage token by a constant, with no gradient. Reported when the bounded value reaches a minimised
    loss and the function never tests the sign of the advantages."""
    loss = losses(ctx)
    sign_of = signs(ctx)
    sinks = None
    for call in ctx.nodes(cst.Call):
        kind = min_max_kind(ctx, call)
        if kind is None:
            continue
        args = [arg.value for arg in call.args]
        for bound_arg, other in ((args[0], args[1]), (args[1], args[0])):
            bound = _dual_clip_bound(ctx, judge, bound_arg)
            surrogate = judge.surrogate_sign(other) if bound is not None else None
            if surrogate is None or bound != surrogate or kind != ("min" if bound < 0 else "max"):
                continue
            if _compares_advantages(ctx, judge, ctx.enclosing_function(call)):
                break
            if sinks is None:
                sinks = [(sink, sink.terms(sign_of, judge.stop)) for sink in loss.sinks()]
            reached = [sink for sink, terms in sinks for t in terms
                       if ctx.contains(call, t.expr) or any(ctx.contains(call, read) for read, _ in t.via)]
            if reached:
                yield Violation(call, "dual-clip bound applied to every token: for a positive advantage -c * A is "
                                      "below the clipped loss, so those tokens get a constant loss and no gradient; "
                                      "apply it where A < 0: torch.where(A < 0, torch.min(clipped, -c * A), clipped)",
                                preview=all(sink.inferred for sink in reached))
            break
