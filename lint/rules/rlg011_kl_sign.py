"""RLG011 kl-sign: a KL penalty subtracted from a minimised loss, or added to a (maximised) reward."""

from __future__ import annotations

import re
from typing import Iterator

import libcst as cst

from rlguard.catalog import KL_SIGN
from rlguard.lint.analysis import Analysis
from rlguard.lint.analysis.groups import grouped_later
from rlguard.lint.analysis import semantics as S
from rlguard.lint.analysis.returns import COPY_METHODS, advantage_minuend, enters_td_reward
from rlguard.lint.analysis.index import key_entry, key_of
from rlguard.lint.analysis.roles import interface_names
from rlguard.lint.analysis.losses import flip, top_terms
from rlguard.lint.analysis.signs import factors, signs
from rlguard.lint.analysis.terms import quantities
from rlguard.lint.rule import Invalid, Rule, Valid, Violation
from rlguard.lint.rules.rlg004_entropy_bonus_sign import judge_terms

# The KL part of a shaped reward, by convention (TRL's `non_score_reward`): a reward value even with no score term.
KL_REWARD_NAME = re.compile(r"(?i)non_score_rewards?|kl_rewards?|kl_penalty_rewards?|penalty_rewards?")
# Preference-learning log-ratio definitions (DPO, A*PO, IPO): `beta * (logp - ref_logp)` is a definition, not a
# reward shaped by a KL penalty.
IMPLICIT_REWARD_NAME = re.compile(r"(?i)\w*implicit\w*|(chosen|rejected|policy|ref|reference)_rewards?|"
                                  r"\w*logratios?\w*|\w*_margins?")


# A GRPO/RLOO scorer: the reward is known by its grouping, the reference by its adapter, the mask by how it is built;
# flagged with the KL added to the reward ({sign} = +), clean with it subtracted
# a KL-shaped value copied into the tensor a TD error reads as its reward ({sign}: "-" subtracts the penalty;
# {discount}: a factor on the discounted next value)
# a reward-shaping helper handed the KL (OpenRLHF-style): the score at the last token, the KL term at every token
_SHAPED_REWARD = ("def compute_reward(r, kl_coef, kl, action_mask):\n"
                  "    if kl_coef <= 0.0:\n"
                  "        kl_coef = 0.0\n"
                  "    kl_reward = {kl_sign}kl_coef * kl\n"
                  "    last = action_mask.size(1) - 1 - action_mask.long().fliplr().argmax(dim=1, keepdim=True)\n"
                  "    score = torch.zeros_like(kl).scatter_(dim=1, index=last, src=r.unsqueeze(1))\n"
                  "    return score + kl_reward\n")
# the older form of that helper: it computes the KL itself from the policy's and the base model's log-probs and
# returns the reward beside it
_SHAPED_REWARD_OWN_KL = ("def approx_kl(log_probs, log_probs_base, action_mask=None):\n"
                         "    log_ratio = log_probs.float() - log_probs_base.float()\n"
                         "    return log_ratio * action_mask if action_mask is not None else log_ratio\n"
                         "\n"
                         "def compute_reward(r, kl_coef, log_probs, log_probs_base, action_mask):\n"
                         "    kl = approx_kl(log_probs, log_probs_base, action_mask=action_mask)\n"
                         "    kl_reward = {kl_sign}kl_coef * kl\n"
                         "    last = torch.zeros_like(kl).scatter_(1, action_mask.sum(1, keepdim=True) - 1, r[:, None])\n"
                         "    reward = last + kl_reward\n"
                         "    return reward, kl\n")
_TD_REWARD = (
    "def advantages(policy, ref_model, ids, values, done, score, beta, gamma):\n"
    "    with torch.no_grad():\n"
    "        lp = torch.log_softmax(policy(ids).logits, -1)\n"
    "        rp = torch.log_softmax(ref_model(ids).logits, -1)\n"
    "    x = {sign}beta * (lp - rp)\n"
    "    y = x.clone()\n"
    "    y[:, -1] += score\n"
    "    out = []\n"
    "    for t in range(y.size(1)):\n"
    "        nv = values[:, t + 1] if t < y.size(1) - 1 else 0.0\n"
    "        out.append(y[:, t] + gamma * nv{discount} - values[:, t])\n"
    "    return torch.stack(out, 1)\n")
_GROUPED_REWARD = (
    "from trl.trainer.utils import pad, use_adapter\n"
    "class Scorer:\n"
    "    def token_logps(self, model, ids):\n"
    "        z = model(ids).logits[:, :-1]\n"
    "        return torch.log_softmax(z, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)\n"
    "    def advantages(self, model, ids, rows, scores):\n"
    "        m = pad([torch.ones_like(r) for r in rows], padding_value=0)\n"
    "        with torch.no_grad():\n"
    "            lp = self.token_logps(model, ids)\n"
    "            with use_adapter(model, adapter_name=\"ref\"):\n"
    "                rl = self.token_logps(model, ids)\n"
    "        k = ((lp - rl) * m).sum(-1)\n"
    "        r = scores {sign} self.beta * k\n"
    "        g = r.view(-1, self.num_generations)\n"
    "        return (g - g.mean(dim=1, keepdim=True)).view(-1)\n"
)

# a rollout that shapes the reward with the sampler's own log-probs against the reference's ({shaped}); the
# scores go straight to the log-softmax or through a padding helper that writes them into a buffer ({helper}, {z})
_PAD_ROWS = (
    "def pad_rows(rows, value):\n"
    "    out = torch.full((len(rows), max(r.size(0) for r in rows), rows[0].size(-1)), value)\n"
    "    for i, r in enumerate(rows):\n"
    "        out[i][: r.size(0)] = r\n"
    "    return out\n"
    "\n"
    "\n"
)
_GENERATION_KL = (
    "{helper}"
    "def make_experience(policy, ref_model, critic, prompts, score_fn, beta, gamma, lam):\n"
    "    with torch.no_grad():\n"
    "        out = policy.generate(prompts, output_scores=True, return_dict_in_generate=True)\n"
    "        seq = out.sequences[:, prompts.size(1):]\n"
    "        z = {z}\n"
    "        a = torch.log_softmax(z, -1).gather(-1, seq.unsqueeze(-1)).squeeze(-1)\n"
    "        y = ref_model(out.sequences).logits[:, prompts.size(1) - 1:-1]\n"
    "        b = torch.log_softmax(y, -1).gather(-1, seq.unsqueeze(-1)).squeeze(-1)\n"
    "        v = critic(out.sequences)[:, prompts.size(1) - 1:-1]\n"
    "{shaped}    r[:, -1] += score_fn(out.sequences)\n"
    "    last = 0.0\n"
    "    adv = []\n"
    "    for t in reversed(range(r.size(1))):\n"
    "        nv = v[:, t + 1] if t < r.size(1) - 1 else 0.0\n"
    "        delta = r[:, t] + gamma * nv - v[:, t]\n"
    "        last = delta + gamma * lam * last\n"
    "        adv.append(last)\n"
    "    return torch.stack(adv[::-1], 1), r\n"
)


# a KL penalty shaping the value the advantages are computed from ({shaped})
_ADVANTAGE_MINUEND = (
    "def kl_div(p, q, mask):\n"
    "    return ((p * (p.log() - q.log())).sum(-1) * mask).sum(-1) / mask.sum(-1)\n"
    "\n"
    "\n"
    "class Learner:\n"
    "    def update(self, ids, mask, old_probs, old_lp, old_values, r, eps):\n"
    "        logits = self.actor(ids).logits[:, :-1]\n"
    "        lp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1).sum(-1)\n"
    "        with torch.no_grad():\n"
    "            pen = 0.0\n"
    "            if self.kl_weight > 0:\n"
    "                pen = kl_div(old_probs, logits.softmax(-1), mask) * self.kl_weight\n"
    "{shaped}            a = r - old_values\n"
    "            a = (a - a.mean()) / (a.std() + 1e-8)\n"
    "        ratios = (lp - old_lp).exp()\n"
    "        loss = -torch.min(ratios * a, ratios.clamp(1 - eps, 1 + eps) * a).mean()\n"
    "        self.opt.zero_grad()\n"
    "        loss.backward()\n"
    "        self.opt.step()\n"
)


# A sampled KL estimate beside a policy-gradient loss; no name says which operand is the reference.
_SAMPLED_KL = (
    "import torch\n"
    "import torch.nn.functional as F\n\n"
    "def train_step(policy, frozen, opt, ids, mask, adv, beta):\n"
    "    a = torch.gather(F.log_softmax(policy(ids).logits[:, :-1], -1), 2, ids[:, 1:].unsqueeze(-1)).squeeze(-1)\n"
    "    with torch.no_grad():\n"
    "        b = torch.gather(F.log_softmax(frozen(ids).logits[:, :-1], -1), 2, ids[:, 1:].unsqueeze(-1))\n"
    "        b = b.squeeze(-1)\n"
    "    ratio = torch.exp(a - a.detach())\n"
    "    k = {k}\n"
    "    out = -(ratio * adv.unsqueeze(1)) {sign} beta * k\n"
    "    ((out * mask).sum() / mask.sum()).backward()\n"
    "    opt.step()\n"
    "    opt.zero_grad()\n")
# Advantages shaped by a KL penalty, the coefficient read from a settings object in __init__.
_ADVANTAGE_KL = (
    "import torch\n\n"
    "class Estimator:\n"
    "    def __init__(self, loss_config):\n"
    "        self.kl_coef = loss_config.reference_policy_kl_penalty\n\n"
    "    def compute_advantage(self, rewards, mask, logprobs, reference_logprobs):\n"
    "        adv = rewards - rewards.mean()\n"
    "        adv = adv.unsqueeze(-1).expand(mask.shape)\n"
    "        kl = logprobs - reference_logprobs\n"
    "        adv = adv {sign} self.kl_coef * kl\n"
    "        return adv * mask\n")

_NEUTRAL_KL = ("def step(opt, p, q, adv, beta):\n"
               "    k = {k}\n"
               "    out = -(p * adv).mean() - beta * k.mean()\n"
               "    out.backward()\n    opt.step()\n    opt.zero_grad()\n")


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
    coefficients (`kl_coef`, `beta`, `kl_ctl`, `kl_div_loss_weight`).

    A KL written out over whole distributions, `(p * (log p - log q)).sum(-1)` or `p * log(p / q)`, is
    `KL(p || q) >= 0` whichever of `p`, `q` is the policy, so its sign needs no names; with the logs swapped it
    is minus the KL. A helper computing the swapped form that its caller adds to the loss as a penalty is
    reported in the helper.

    A KL to the *old* (behaviour) policy estimated from its samples, `old_logp - logp`, is `KL(old || cur)`'s k1
    estimate and is not judged against the reference convention.

    The roles also come from how values are made and used, not only from names: the log-softmax of the scores a
    generation call returned (`generate(..., output_scores=True)`, then `out.scores`) is the sampling policy's
    log-probs, the policy's side of a KL to the reference; a value that a one-step TD error reads as its reward
    (`r[:, t] + gamma * V[:, t + 1] - V[:, t]`), itself or through a copy, is a reward; what a function named for
    the reward returns is a reward (`def compute_rewards(scores, kl_coef, kl): return scores - kl_coef * kl`,
    or `return reward, kl`: the element with a score term). A
    reward copied from, or adding, a value already reported is the same fault: reported once, where a finding
    that needs no local name can say it. A coefficient a parameter hands in keeps its sign when the function
    switches it off at 0 (`if kl_coef <= 0: kl_coef = 0.0`).

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

    code = KL_SIGN
    # a KL by name or reference log-probs, or a KL written out over distributions (it needs logs)
    # stable since 2026-12-07: the FALSE class that kept it in preview (a log-likelihood regulariser beside a
    # preference loss scored against zeros, read as a KL to a reference) is fixed in the core (terms: a constant
    # tensor is no reference); on the 49 repositories its stable part reports 1 TRUE (holdout) and no FALSE
    triggers = r"kl(?:_|\b)|_kl|ref_?log|ref_per_token|reference_log|log\(|log_softmax|exp\("
    fixable = True

    PREVIEW_PARTS = ("a loss known only by the name of the local variable that holds it (`loss = ...` with no backward, loss function or optimising caller in view)",
                     "a KL added to a reward known only by its variable's name (stable when the shaped value meets a "
                     "rewards keyword, parameter or string key, is stored under one (`batch['token_level_rewards'] "
                     "= ...`), or is what a rewards function returns)")
    VALID = [
        Valid(_SAMPLED_KL.format(k="torch.exp(b - a) - (b - a) - 1", sign="+"),
              why="the k3 estimate added to the minimised loss: a penalty", capability="C1", style="functional"),
        Valid(_ADVANTAGE_KL.format(sign="-"), why="the KL penalty subtracted from the advantages",
              capability="C2", style="class"),
        Valid(_NEUTRAL_KL.format(k="torch.exp(q) - (q - p) - 1"),
              why="look-alike: the exponent is not the difference the linear part subtracts, so no estimate; nothing "
                  "says whose log-probs p and q are", capability="C1", style="functional"),
        Valid(_NEUTRAL_KL.format(k="r - (q - p) - 1").replace("    k = ", "    r = torch.exp(q - p)\n    q = q * 2\n    k = "),
              why="look-alike: the linear part reads q after it was rebound, not the exponent's difference",
              capability="C1", style="functional"),
        Valid(_SHAPED_REWARD.format(kl_sign="-"), why="the KL handed in is subtracted from the score",
              capability="C3", style="functional"),
        Valid(_SHAPED_REWARD_OWN_KL.format(kl_sign="-"), why="the KL computed here is subtracted from the score",
              capability="C3", style="functional"),
        Valid("def compute_rewards(scores, kl_coef, kl):\n    return scores - kl_coef * kl\n",
              why="the reward returned straight from a function named for it, the KL subtracted", capability="C3",
              style="functional"),
        Valid(_ADVANTAGE_MINUEND.format(shaped="            r = r - pen\n"),
              "a KL penalty (0 when switched off) subtracted from the value the advantages are computed from",
              capability="C3", style="class"),
        Valid(_GENERATION_KL.format(shaped="    r = -beta * (a - b)\n", z="pad_rows(list(torch.stack(out.scores, 1)), 0.0)", helper=_PAD_ROWS),
              "the sampler's log-probs (the log-softmax of the scores generate returned) minus the reference's, "
              "subtracted from the reward a TD error reads", capability="C1", style="functional"),
        Valid(_GROUPED_REWARD.format(sign="-"),
              why="the same KL subtracted from the grouped reward", capability="C2", style="class"),
        Valid("def update(pg_loss, logp, ref_logp, response_mask, opt, kl_coef):\n"
              "    pen = ((logp - ref_logp).square() * response_mask).sum() / response_mask.sum()\n"
              "    loss = pg_loss + kl_coef * pen\n"
              "    loss = loss * torch.sum(response_mask) / 64\n"
              "    loss.backward(); opt.step()\n",
              why="a squared log-ratio is a penalty whichever way it is written, added to the loss",
              capability="C6", style="functional"),
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
              "through a helper", capability="C1", style="functional"),
        Valid("stats['kl'] = (logp - ref_logp).mean().item()\nloss = pg_loss - ent_coef * entropy\n",
              "KL only logged"),
        Valid("if cfg.algorithm.use_kl_in_reward:\n"
              "    self.kl_controller_for_reward = algos.make_kl_controller(cfg.algorithm.kl_ctrl)\n",
              "a KL controller object stored under a reward-ish name: no tensor, no sum", capability="FP",
              style="framework"),
        Valid("def kl_value(logp, ref_logp, mode):\n"
              "    forward_score = kl_estimate(logp, ref_logp, mode)\n"
              "    backward_score = 0.5 * (logp - ref_logp).square()\n"
              "    return backward_score - backward_score.detach() + forward_score.detach()\n",
              "a straight-through KL estimator's own values named *_score", capability="FP", style="functional"),
        Valid("implicit_reward = beta * (policy_logps - ref_logps)\n"
              "loss = ((implicit_reward - (rewards - v_star)) ** 2).mean()\n",
              "a preference-learning implicit reward regressed onto a target: a definition, not a penalty",
              capability="FP", style="script"),
        Valid("penalty = coef * -log_ratio\n"
              "penalty = [p[s:e] for p, s, e in zip(penalty, starts, ends)]\n"
              "for i in range(n):\n"
              "    rewards = penalty[i]\n"
              "    rewards[-1] += scores[i]\n",
              "the negation is visible where the penalty is built; a comprehension rebinding does not undo it",
              capability="FP", style="script"),
        Valid("def distill_loss(ref_logprobs, logprobs, ratio, keep):\n"
              "    gap = ref_logprobs - logprobs\n"
              "    obj = keep * gap.detach() * ratio\n"
              "    per_token = -obj\n"
              "    return per_token.sum()\n",
              "on-policy distillation: the log-ratio weights the ratio (REINFORCE of reverse KL), negated downstream",
              capability="FP", style="functional"),
        Valid("def kl(p, q):\n"
              "    d = torch.log(p) - torch.log(q)\n"
              "    return (p * d).sum(-1)\n\n"
              "l = pg + beta * kl(pi, pi0).mean()\nl.backward()\n",
              "a helper writing out KL(p || q), added to the loss", capability="C1", style="script"),
        Valid("neg_kl = (p * (q.log() - p.log())).sum(-1)\nloss = pg - beta * neg_kl.mean()\nloss.backward()\n",
              "minus the KL, subtracted: the penalty is added", capability="C2", style="script"),
        Valid("class Tuner:\n"
              "    def update(self, p, q, pg):\n"
              "        gap = (q * torch.log(q / p)).sum(-1)\n"
              "        total = pg + self.kl_div_loss_weight * gap.mean()\n"
              "        total.backward()\n",
              "a KL with no telling name, added; its coefficient is named for the KL", capability="C2", style="class"),
        Valid("class Actor:\n"
              "    def kl_penalty(self, lp, ref_lp):\n"
              "        return lp - ref_lp\n\n"
              "    def loss(self, pg_loss, logprobs, ref_logprobs):\n"
              "        return pg_loss + self.beta * self.kl_penalty(logprobs, ref_logprobs).mean()\n",
              "a same-class KL helper called with the policy's log-probs first", capability="C2", style="class"),
        Valid("def divergence(p_new, p_old, m):\n"
              "    per_tok = (p_new * (torch.log(p_new) - torch.log(p_old))).sum(dim=-1)\n"
              "    return (per_tok * m).sum() / m.sum()\n\n"
              "l = pg + beta * divergence(p, p0, m)\nl.backward()\n",
              "a masked KL(p_new || p_old), its mask known by its use, added", capability="C2",
              style="functional"),
        Valid("import argparse\n"
              "parser = argparse.ArgumentParser()\n"
              "parser.add_argument('--kl-coef', type=float, default=0.05)\n"
              "args = parser.parse_args()\n"
              "def step(pg_loss, logp, ref_logp):\n"
              "    kl = logp - ref_logp\n"
              "    loss = pg_loss + args.kl_coef * kl.mean()\n"
              "    loss.backward()\n",
              "the same coefficient from the parsed arguments, the penalty added", capability="C6", style="script"),
        Valid("class MarginTrainer:\n"
              "    def seq_score(self, logps, ref_logps):\n"
              "        return (logps - ref_logps).sum(-1)\n\n"
              "    def loss(self, good_logps, bad_logps):\n"
              "        good = self.seq_score(good_logps, torch.zeros_like(good_logps).to(self.device))\n"
              "        bad = self.seq_score(bad_logps, torch.zeros_like(bad_logps).to(self.device))\n"
              "        hinge = torch.clamp(self.margin - good + bad, min=0)\n"
              "        nll = -good_logps.sum(-1)\n"
              "        return hinge + self.reg_weight * nll\n",
              "no reference model: the helper's reference parameter is bound to a zero tensor, so its score is the "
              "log-likelihood, not a log-ratio (a KL needs a reference's log-probs)", capability="FP", style="class"),
        Valid("from accelerate.utils import gather\n"
              "def score(self, scores, old_per_token_logps, ref_per_token_logps, mask):\n"
              "    kl = ((old_per_token_logps - ref_per_token_logps) * mask).sum(-1)\n"
              "    kl = gather(kl)\n"
              "    rewards = scores - self.beta * kl\n"
              "    return rewards\n",
              "the same KL subtracted from the reward", capability="C2", style="class"),
        Valid(
              "def step(model, ref_model, ids, adv, beta, opt, idx):\n"
              "    with torch.no_grad():\n"
              "        r = ref_model(ids).logits.log_softmax(-1).gather(-1, ids[..., None]).squeeze(-1)\n"
              "    keep = (ids != 0).float()\n"
              "    for i in idx:\n"
              "        lp = model(ids[i]).logits.log_softmax(-1).gather(-1, ids[i][..., None]).squeeze(-1)\n"
              "        k = ((torch.exp(r[i] - lp) - (r[i] - lp) - 1.0) * keep[i]).sum() / keep[i].sum().clamp(min=1)\n"
              "        loss = -(lp * adv[i]).mean() + beta * k\n"
              "        loss.backward(); opt.step()\n",
              "the same estimate added as a penalty", capability="C2", style="functional"),
        Valid(_TD_REWARD.format(sign="-", discount=""),
              why="the KL penalty subtracted from the value a TD error reads as its reward", capability="C3",
              style="functional"),
    ]
    INVALID = [
        Invalid("def kl_div(p, q):\n"
                "    return (p * (q.log() - p.log())).sum(-1).mean()\n"
                "\n"
                "\n"
                "def update(self, pg_loss, probs, old_probs):\n"
                "    pen = 0.0\n"
                "    if self.kl_weight > 0:\n"
                "        pen = kl_div(probs, old_probs) * self.kl_weight\n"
                "    loss = pg_loss.mean() + pen\n"
                "    loss.backward()\n", line=2,
                why="the helper returns minus the KL; the caller's penalty, 0 when switched off, adds it: reported in "
                    "the helper, where the logs are swapped", capability="C4", style="functional"),
        Invalid(_ADVANTAGE_MINUEND.format(shaped="            r = r + pen\n"), line=13,
                why="no name says reward or KL: the penalty (a KL written out in a helper, 0 when switched off) is added "
                    "to the value the advantages weighing the PPO clip are computed from (r - old_values)",
                capability="C3", style="class"),
        Invalid(_GENERATION_KL.format(shaped="    r = beta * (a - b)\n", z="pad_rows(list(torch.stack(out.scores, 1)), 0.0)", helper=_PAD_ROWS), line=17,
                why="no name says log-probs, KL or reward: the sampling policy's log-probs come from the scores of a "
                    "generation (padded into a buffer by a helper), the other side from the reference, and the value is "
                    "the reward of a TD error", capability="C1", style="functional"),
        Invalid(_GENERATION_KL.format(shaped="    r = beta * (a - b)\n", z="torch.stack(out.scores, 1)", helper=""), line=10,
                why="the KL estimate against the sampler's own log-probs is added to the per-step reward", capability="C1",
                style="functional"),
        Invalid(_GROUPED_REWARD.format(sign="+"), line=13,
                why="a value viewed as groups of samples is a reward (GRPO/RLOO), whatever it is called; the reference is the policy with its reference adapter on, and the mask is ones padded with zeros", capability="C2", style="class"),
        Invalid(_SAMPLED_KL.format(k="torch.exp(b - a) - (b - a) - 1", sign="-"), line=11,
                why="the k3 estimate exp(d) - d - 1 is a KL by its formula (non-negative whatever d is), whatever its "
                    "operands are called", capability="C1", style="functional"),
        Invalid(_SAMPLED_KL.format(k="(r - 1) - r.log()", sign="-").replace("    k = ", "    r = torch.exp(b - a)\n    k = "),
                line=12, why="the same estimate written with the ratio r = exp(d): r - 1 - log r", capability="C1",
                style="functional"),
        Invalid(_ADVANTAGE_KL.format(sign="+"), line=11,
                why="a function named for the advantages returns them shaped by the KL with a + sign; the "
                    "coefficient is a field of a settings object (loss_config)", capability="C2", style="class"),
        Invalid(_NEUTRAL_KL.format(k="torch.exp(q - p) - (q - p) - 1"), line=3,
                why="nothing names the operands: the formula alone says it is a KL", capability="C1", style="functional"),
        Invalid("def penalty(x, y):\n    d = torch.clamp(y - x, min=-20, max=20)\n    r = torch.exp(d)\n"
                "    return torch.clamp((r - d - 1).contiguous(), min=-10, max=10)\n\n"
                "def step(opt, lp, lq, adv):\n    out = -(lp * adv).mean() - 0.1 * penalty(lp, lq).mean()\n"
                "    out.backward()\n    opt.step()\n    opt.zero_grad()\n", line=7,
                why="a helper of the module returns the estimate (clamped): its formula, not its name, makes it a KL",
                capability="C3", style="functional"),
        Invalid("loss = pg_loss - kl_coef * kl\n", line=1, fixed="loss = pg_loss + kl_coef * kl\n", preview=True),
        Invalid("loss = pg_loss\nloss -= self.beta * kl.mean()\n", line=2,
                fixed="loss = pg_loss\nloss += self.beta * kl.mean()\n", preview=True),
        Invalid("rewards = rewards + beta * kl\n", line=1, fixed="rewards = rewards - beta * kl\n", preview=True),
        Invalid("scores = scores + self.kl_coef * (logprobs - ref_logprobs).sum(-1)\n", line=1,
                fixed="scores = scores - self.kl_coef * (logprobs - ref_logprobs).sum(-1)\n", preview=True),
        Invalid("reward = score - beta * (ref_logp - logp)\n", line=1, fixed="reward = score + beta * (ref_logp - logp)\n",
                why="net sign of logp - ref_logp is +", preview=True),
        Invalid("log_ratio = new_log_probs - ref_log_probs\nkl = log_ratio\nout = pg + kl_coef * -kl.mean()\n"
                "out.backward()\n", line=3, why="backward-ed, negated through an alias"),
        Invalid("def compute_loss(logits, ids, old_log_probs, advantages, mask, ref_log_probs, cfg):\n"
                "    kl = aggregate(kl_penalty(log_probs, ref_log_probs), mask)\n"
                "    loss = pg_loss - cfg.ent_coef * entropy\n"
                "    loss = loss - cfg.kl_coef * kl\n    return loss\n", line=4),
        Invalid("kl = ref_logp - logp\nloss = policy_loss + beta * kl.mean()\n", line=2,
                why="kl written as ref - logp, then added: -KL in the loss", preview=True),
        Invalid("non_score_reward = kl_coef * (logprobs - ref_logprobs)\n", line=1, why="positive non-score reward", preview=True),
        Invalid("def kl(p, q):\n"
                "    d = torch.log(q) - torch.log(p)\n"
                "    return (p * d).sum(-1)\n\n"
                "l = pg + beta * kl(pi, pi0).mean()\nl.backward()\n", line=3,
                why="the helper's logs are swapped (minus KL), and the loss adds it: reported in the helper",
                capability="C1", style="script"),
        Invalid("def masked_divergence(p_new, p_old, mask):\n"
                "    per_tok = (p_new * (safe_log(p_old) - safe_log(p_new))).sum(dim=-1)\n"
                "    return (per_tok * mask).sum() / mask.sum()\n\n"
                "def safe_log(t, eps=1e-12):\n"
                "    return torch.log(t.clamp(min=eps))\n\n"
                "class Trainer:\n"
                "    def step(self, p_new, p_old, m, pg_loss):\n"
                "        loss = pg_loss + self.kl_weight * masked_divergence(p_new, p_old, m)\n"
                "        self.accelerator.backward(loss)\n", line=2,
                why="a log helper of the module, summarised from its code", capability="C1", style="class"),
        Invalid("def divergence(p_new, p_old, m):\n"
                "    per_tok = (p_new * (torch.log(p_old) - torch.log(p_new))).sum(dim=-1)\n"
                "    return (per_tok * m).sum() / m.sum()\n\n"
                "l = pg + beta * divergence(p, p0, m)\nl.backward()\n", line=2,
                why="m is a mask by its use, not its name", capability="C2", style="functional"),
        Invalid("d = (p * (p.log() - p0.log())).sum(-1)\nout = pg - beta * d.mean()\nout.backward()\n", line=2,
                why="a KL known by its formula, subtracted", capability="C2", style="script"),
        Invalid("class Tuner:\n"
                "    def update(self, p, q, pg):\n"
                "        gap = (q * torch.log(q / p)).sum(-1)\n"
                "        total = pg - self.c * gap.mean()\n"
                "        total.backward()\n", line=4,
                why="KL(q || p) written as q * log(q / p), subtracted", capability="C2", style="class"),
        Invalid("def kl_term(batch, cfg):\n"
                "    cur, old = batch['probs'], batch['old_probs']\n"
                "    return (old * (torch.log(cur) - torch.log(old))).sum(-1).mean()\n\n"
                "def compute_loss(batch, cfg):\n"
                "    return batch['pg_loss'] + cfg.kl_coef * kl_term(batch, cfg)\n", line=3,
                why="the old distribution weights log cur - log old: minus KL(old || cur), added",
                capability="C2", style="framework"),
        Invalid("def kl_penalty(lp, ref_lp):\n"
                "    return lp - ref_lp\n\n"
                "def actor_loss(pg_loss, ref_logprobs, logprobs, beta):\n"
                "    return pg_loss + beta * kl_penalty(ref_logprobs, logprobs).mean()\n", line=5,
                why="the arguments are passed the wrong way round: the call site's values win over the helper's "
                    "parameter names", capability="C2", style="functional"),
        Invalid("def shape(scores, logp, ref_logp, beta, values):\n"
                "    r = scores + beta * (logp - ref_logp)\n"
                "    return gae(rewards=r, values=values)\n", line=2,
                why="r is handed to the rewards interface: the KL penalty is added to the reward",
                capability="C2", style="functional"),
        Invalid("def compute_rewards(self, scores, logp, ref_logp):\n"
                "    out = scores + self.kl_coef * (logp - ref_logp)\n"
                "    return out\n", line=2,
                why="the value a rewards function returns: the KL penalty is added", capability="C2",
                style="class"),
        Invalid("def pack(score, logp, ref_logp, kl_coef):\n"
                "    shaped = score + kl_coef * (logp - ref_logp)\n"
                "    return {'token_level_rewards': shaped}\n", line=2,
                why="stored under the rewards key of the batch: the KL penalty is added", capability="C3",
                style="framework"),
        Invalid("class T:\n"
                "    def _logps(self, model, ids):\n"
                "        z = model(ids).logits[:, :-1]\n"
                "        return torch.log_softmax(z, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)\n\n"
                "    def compute_loss(self, model, inputs):\n"
                "        v1 = self._logps(model, inputs['input_ids'])\n"
                "        v2 = inputs['ref_per_token_logps']\n"
                "        v3 = torch.exp(v1 - inputs['old_per_token_logps'])\n"
                "        v4 = torch.exp(v2 - v1) - (v2 - v1) - 1\n"
                "        v4 = v4 * v3\n"
                "        v5 = -v3 * inputs['advantages'] - self.beta * v4\n"
                "        return v5.mean()\n", line=12,
                why="the reference read under its batch key into a neutral local; an importance-weighted k3 "
                    "estimate is still the KL: subtracted from the minimised loss", capability="C2",
                style="class"),
        Invalid("def token_logps(model, ids, chunk):\n"
                "    out = []\n"
                "    for i in range(0, ids.size(0), chunk):\n"
                "        z = model(ids[i:i + chunk]).logits[:, :-1]\n"
                "        out.append(torch.log_softmax(z, -1).gather(-1, ids[i:i + chunk, 1:, None]).squeeze(-1))\n"
                "    return torch.cat(out)\n\n"
                "def step(model, ref_model, ids, adv, beta):\n"
                "    lp = token_logps(model, ids, 4)\n"
                "    with torch.no_grad():\n"
                "        rl = token_logps(ref_model, ids, 4)\n"
                "    kl = torch.exp(rl - lp) - (rl - lp) - 1\n"
                "    loss = -(torch.exp(lp - lp.detach()) * adv[:, None]).mean() - beta * kl.mean()\n"
                "    loss.backward()\n", line=13,
                why="the log-probs come from a helper that fills a list chunk by chunk: the list carries what was "
                    "appended to it, the policy's forward and the reference's", capability="C1", style="functional"),
        Invalid("def token_logps(model, ids):\n"
                "    z = model(ids).logits[:, :-1]\n"
                "    return torch.log_softmax(z, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)\n"
                "\n"
                "\n"
                "def step(self, model, ref_model, ids, batch, adv, idx):\n"
                "    lp = token_logps(model, ids)\n"
                "    with torch.no_grad():\n"
                "        rl = token_logps(ref_model, ids)\n"
                "    if self.config.dynamic_bsz:\n"
                "        f = batch[\"response_mask\"].shape[0] / self.config.mini_batch_size\n"
                "    else:\n"
                "        f = 1 / self.config.grad_accum\n"
                "    m = batch[\"response_mask\"]\n"
                "    pg = -(torch.exp(lp - lp.detach()) * adv[:, None] * m).sum() / m.sum()\n"
                "    k3 = torch.exp(rl - lp) - (rl - lp) - 1\n"
                "    kl = (k3[idx] * m[idx]).sum() / m[idx].sum().clamp(min=1)\n"
                "    loss = pg - self.config.kl_coef * kl\n"
                "    (loss * f).backward()\n", line=18,
                why="the loss is scaled by a quotient of a batch size and a config field (positive either way), "
                    "so the KL subtracted inside it is still subtracted", capability="C6", style="class"),
        Invalid("def apply_kl_penalty(data, kl_ctrl):\n"
                "    scores = data.batch[\"token_level_scores\"]\n"
                "    m = data.batch[\"response_mask\"]\n"
                "    k = compute_kl(data.batch[\"old_log_probs\"], data.batch[\"ref_log_probs\"], kl_penalty=\"kl\") * m\n"
                "    data.batch[\"token_level_rewards\"] = scores + kl_ctrl.kl_coef * k\n"
                "    return data\n", line=5,
                why="stored straight under the batch's rewards key: the KL penalty is added to the reward",
                capability="C3", style="framework"),
        Invalid("import argparse\n"
                "parser = argparse.ArgumentParser()\n"
                "parser.add_argument('--kl-coef', type=float, default=0.05)\n"
                "args = parser.parse_args()\n"
                "def step(pg_loss, logp, ref_logp):\n"
                "    kl = logp - ref_logp\n"
                "    loss = pg_loss - args.kl_coef * kl.mean()\n"
                "    loss.backward()\n", line=7,
                why="the coefficient is a field of the parsed arguments: their container is in view, the field is "
                    "the option's", capability="C6", style="script"),
        Invalid("from accelerate.utils import gather\n"
                "def score(self, scores, old_per_token_logps, ref_per_token_logps, mask):\n"
                "    kl = ((old_per_token_logps - ref_per_token_logps) * mask).sum(-1)\n"
                "    kl = gather(kl)\n"
                "    rewards = scores + self.beta * kl\n"
                "    return rewards\n", line=5,
                why="the sampling policy's log-probs minus the reference's, gathered across processes: a KL",
                capability="C2", style="class"),
        Invalid(
                "def step(model, ref_model, ids, adv, beta, opt, idx):\n"
                "    with torch.no_grad():\n"
                "        r = ref_model(ids).logits.log_softmax(-1).gather(-1, ids[..., None]).squeeze(-1)\n"
                "    keep = (ids != 0).float()\n"
                "    for i in idx:\n"
                "        lp = model(ids[i]).logits.log_softmax(-1).gather(-1, ids[i][..., None]).squeeze(-1)\n"
                "        k = ((torch.exp(r[i] - lp) - (r[i] - lp) - 1.0) * keep[i]).sum() / keep[i].sum().clamp(min=1)\n"
                "        loss = -(lp * adv[i]).mean() - beta * k\n"
                "        loss.backward(); opt.step()\n", line=8,
                why="the k3 estimate weighed by a row selection of a cast comparison (a 0/1 mask by its computation) and subtracted from the loss", capability="C2", style="functional"),
        Invalid("def update(pg_loss, logp, ref_logp, response_mask, opt, kl_coef):\n"
                "    pen = ((logp - ref_logp).abs() * response_mask).sum() / response_mask.sum()\n"
                "    loss = pg_loss - kl_coef * pen\n"
                "    loss = loss * torch.sum(response_mask) / 64\n"
                "    loss.backward(); opt.step()\n", line=3,
                why="an absolute log-ratio is a penalty (>= 0) and it is subtracted; the loss is then rescaled by a "
                    "token count (torch.sum of a mask: positive), which keeps the sign",
                capability="C6", style="functional"),
        Invalid("def apply_kl_penalty(data, kl_ctrl):\n"
                "    s = data.batch[\"token_level_scores\"]\n"
                "    k = core_algos.kl_penalty(data.batch[\"old_log_probs\"], data.batch[\"ref_log_prob\"])\n"
                "    b = kl_ctrl.value\n"
                "    r = s + b * k\n"
                "    data.batch[\"token_level_rewards\"] = r\n"
                "    return data\n", line=5,
                why="the coefficient is an adaptive KL controller's value (a parameter named for the controller)",
                capability="C6", style="framework"),
        Invalid(_SHAPED_REWARD.format(kl_sign=""), line=7,
                why="a function named for the reward adds the KL it is handed (a parameter: its interface) to the "
                    "score; the coefficient switched off at 0 keeps its sign; reported once, where the reward is",
                capability="C3", style="functional"),
        Invalid(_SHAPED_REWARD_OWN_KL.format(kl_sign=""), line=9,
                why="the KL of the policy's log-probs to the base model's (a helper of the module) added to the "
                    "score; the reward is returned beside the KL", capability="C3", style="functional"),
        Invalid("def compute_rewards(scores, kl_coef, kl):\n    return scores + kl_coef * kl\n", line=2,
                why="the reward returned straight from a function named for it", capability="C3",
                style="functional"),
        Invalid(_TD_REWARD.format(sign="", discount=""), line=5,
                why="the KL-shaped value is copied into the tensor a TD error reads as its reward (r[:, t] + gamma * "
                    "V[:, t + 1] - V[:, t]): a reward by that use, whatever it is called; reported where the KL "
                    "enters it, once (not again at the copy)", capability="C3", style="functional"),
        Invalid(_TD_REWARD.format(sign="", discount=" * (1 - done[:, t])"), line=5,
                why="the same TD error with the next value cut at episode ends (a (1 - done) factor)",
                capability="C3", style="functional"),
    ]

    def check(self, ctx: Analysis) -> Iterator[Violation]:
        yield from judge_terms(ctx, "kl", want=1, message=(
            "the KL penalty is subtracted from a minimised loss, so the update moves away from the reference; "
            "add it: loss = pg_loss + kl_coef * kl"), helper_message=(
            "this computes p * (log q - log p), minus KL(p || q), and the loss adds it as a KL penalty, so the "
            "update is paid to diverge; swap the logs: p * (log p - log q)"))
        yield from _reward_terms(ctx)


def _reward_terms(ctx: Analysis) -> Iterator[Violation]:
    """A KL term entering a reward value (a score shaped by the penalty) with a + sign."""
    quantity = quantities(ctx)
    sign_of = signs(ctx)

    def stop(expr, frame):
        return quantity.sign("kl", expr, frame) is not None

    found: list[tuple] = []  # (definition, node, fix, preview, the operand whose KL is added)
    for stmt in ctx.nodes(cst.Assign, cst.AugAssign):
        for d in ctx.index.stmt_defs.get(id(stmt), ()):
            if d.kind not in ("assign", "aug") or d.element is not None:
                continue
            if "[" in d.key:
                # `data.batch["token_level_rewards"] = scores - beta * kl`: stored under a key named for rewards
                if not _reward_key(d.key):
                    continue
                bare, kl_part = d.key, False
            else:
                bare = d.key.rsplit(".", 1)[-1]
                kl_part = KL_REWARD_NAME.fullmatch(bare) is not None
                if IMPLICIT_REWARD_NAME.fullmatch(bare) or not (
                        kl_part or ctx.names.is_role(bare, "rewards") or _reward_by_interface(ctx, d)):
                    continue
            value = stmt.value
            if isinstance(stmt, cst.AugAssign) and not isinstance(stmt.operator, (cst.AddAssign, cst.SubtractAssign)):
                continue
            operands = top_terms(value)
            if isinstance(stmt, cst.AugAssign) and isinstance(stmt.operator, cst.SubtractAssign):
                operands = [(-s, t) for s, t in operands]
            kl_terms, score_terms = [], []
            for sign, operand in operands:
                if _reads_key(ctx, operand, d.key):
                    score_terms.append((sign, operand, None))  # the reward's previous value, not a new term
                    continue
                net = _kl_of_operand(ctx, quantity, sign_of, operand, stop)
                (kl_terms if net is not None else score_terms).append((sign, operand, net))
            if isinstance(stmt, cst.AugAssign):
                score_terms.append((1, d.target, None))  # the reward it adds to
            # a reward: scores beside the KL term, or added to it later, or the value is what a TD error reads as
            # its reward (itself or a copy: the score may be added to the copy)
            if not kl_terms or not (score_terms or kl_part or _score_added_later(ctx, d) or enters_td_reward(ctx, d)):
                continue
            for sign, operand, net in kl_terms:
                if sign * net > 0:
                    node = operand if not isinstance(stmt, cst.AugAssign) else stmt
                    fix = flip(stmt, value, operand) if not isinstance(stmt, cst.AugAssign) or \
                        operand is stmt.value else []
                    found.append((d, node, fix, not _reward_by_interface(ctx, d), operand))
    # a function named for the reward returns it: `return scores - kl * kl_ratio` (its name is its interface)
    for func in ctx.nodes(cst.FunctionDef):
        if not _names_reward(ctx, func.name.value):
            continue
        for ret in ctx.index.scopes[id(func)].returns:
            if ret.value is None or key_of(ret.value) is not None:
                continue  # a returned name is judged where it is bound
            kl_terms, scored = [], False
            for sign, operand in top_terms(ret.value):
                net = _kl_of_operand(ctx, quantity, sign_of, operand, stop)
                if net is None:
                    scored = True
                else:
                    kl_terms.append((sign, operand, net))
            for sign, operand, net in kl_terms if scored else ():
                if sign * net > 0:
                    found.append((None, operand, flip(ret, ret.value, operand), False, operand))
    # one fault, one finding: a reward that copies or adds a value already reported (`rewards = shaped.clone()`,
    # `reward = score + kl_part`) is the same fault, reported once, where a stable finding can say it (a value that
    # is a reward by its name only yields to the reward by interface it flows into)
    by_def = {id(d): i for i, (d, *_rest) in enumerate(found) if d is not None}
    dropped: set[int] = set()
    for i, (d, node, fix, preview, operand) in enumerate(found):
        defs = _copied_defs(ctx, operand)
        if not defs or not all(x in by_def and by_def[x] != i for x in defs):
            continue
        earlier = [by_def[x] for x in defs]
        if not preview and all(found[j][3] for j in earlier):
            dropped.update(earlier)
        else:
            dropped.add(i)
    for i, (d, node, fix, preview, operand) in enumerate(found):
        if i not in dropped:
            yield Violation(node, "the KL penalty is added to the reward, so the policy is paid to move away from "
                                  "the reference; subtract it: reward - beta * (logp - ref_logp)", fix, preview=preview)


def _copied_defs(ctx: Analysis, operand: cst.BaseExpression) -> list[int]:
    """The definitions (their ids) that reach ``operand`` when it is a name or a copy of one (``x.clone()``,
    ``x.detach()``); empty otherwise."""
    while isinstance(operand, cst.Call) and ctx.method(operand) in COPY_METHODS and S.receiver(operand) is not None:
        operand = S.receiver(operand)
    if not isinstance(operand, cst.Name):
        return []
    return [id(x) for x in ctx.flow.reaching(operand.value, operand)]


# Interface names (keywords, parameters, string keys: not renamed with a file's locals) that hold a reward value.
# Advantages count: a KL penalty shaped into the advantages (`adv = adv - beta * kl`) is a reward shaping too.
_REWARD_INTERFACE = re.compile(r"(?i)(\w+_)?(rewards?|advantages?|advs?)(_\w+)?")
_NOT_A_REWARD = re.compile(r"(?i)model|fn|func|name|weight|coef|scale|std|mean|norm|ids?$|mask|type|kwargs|config|"
                           r"estimator|mode|kind|clip")


def _reward_key(key: str) -> bool:
    """A key path whose last entry is a string key named for rewards (``batch['token_level_rewards']``)."""
    entry = key_entry(key)
    return entry is not None and _REWARD_INTERFACE.fullmatch(entry) is not None and not _NOT_A_REWARD.search(entry)


def _reward_by_interface(ctx: Analysis, d) -> bool:
    """Whether the shaped value is a reward by the interface it meets or by its use, not by its variable's name: it
    is stored under, or handed to, a string key, keyword or parameter named for rewards, returned by a function
    named for them, or viewed as groups of samples (``r.view(-1, G)``, the GRPO/RLOO baseline's input); a local name
    alone makes the finding a preview one: renaming the variable must not change a stable finding."""
    if "[" in d.key:
        return _reward_key(d.key)
    if any(_REWARD_INTERFACE.fullmatch(name) and not _NOT_A_REWARD.search(name)
           for name in interface_names(ctx, d, _REWARD_INTERFACE.fullmatch)):
        return True
    func = ctx.enclosing_function(d.stmt)
    if func is not None and _names_reward(ctx, func.name.value) and any(
            ret.value is not None and d.key in _returned_keys(ret.value)
            for ret in ctx.index.scopes[id(func)].returns):
        return True
    # read as the reward of a TD error (`r[:, t] + gamma * V[:, t + 1] - V[:, t]`), itself or through a copy, or
    # as what an advantage is computed from (`advantages = rewards - values`)
    return grouped_later(ctx, d) or enters_td_reward(ctx, d) or advantage_minuend(ctx, d)


def _returned_keys(value: cst.BaseExpression) -> set[str]:
    """The keys a return statement hands back: the value's, each element's of a returned tuple (``return reward,
    kl``: the KL returned beside the reward is no reward, having no score term), each factor's of a product."""
    if isinstance(value, (cst.Tuple, cst.List)):
        return {key for el in value.elements for key in _returned_keys(el.value)}
    if isinstance(value, cst.BinaryOperation) and isinstance(value.operator, (cst.Multiply, cst.Divide)):
        return _returned_keys(value.left) | _returned_keys(value.right)  # `return adv * mask`: masked, or scaled
    key = key_of(value)
    return {key} if key is not None else set()


def _names_reward(ctx: Analysis, name: str) -> bool:
    """A function's name says it computes the reward or the advantages (``compute_rewards``, ``shaped_reward``,
    ``compute_advantage``)."""
    lowered = name.lower()
    return ctx.names.is_role(name, "rewards") or "reward" in lowered or "advantage" in lowered


def _reads_key(ctx: Analysis, operand: cst.BaseExpression, key: str) -> bool:
    """Whether the operand is (a slice or scaling of) the variable being defined: ``rewards[:, s:] * mask``."""
    stack = [operand]
    while stack:
        node = stack.pop()
        if isinstance(node, (cst.Name, cst.Attribute)) and ctx.code(node) == key:
            return True
        if isinstance(node, cst.Subscript):
            stack.append(node.value)
        elif isinstance(node, cst.BinaryOperation) and isinstance(node.operator, (cst.Multiply, cst.Divide)):
            stack += [node.left, node.right]
        elif isinstance(node, cst.Call) and isinstance(node.func, cst.Attribute):
            stack.append(node.func.value)
    return False


def _score_added_later(ctx: Analysis, d) -> bool:
    """``rewards = kl_term`` followed by ``rewards[..., last] += scores`` or ``rewards = rewards + scores``: the value
    is the KL part of a shaped reward."""
    scope = ctx.index.function_scope(d.stmt)
    for later in scope.defs.get(d.key, ()) + scope.defs.get(d.key + "[?]", []):
        if later.order <= d.order:
            continue
        if later.kind == "aug" and isinstance(later.op, cst.AddAssign):
            return True
        if later.kind == "other" and isinstance(later.stmt, cst.AugAssign) and isinstance(
                later.stmt.operator, cst.AddAssign):
            return True
        if later.kind == "assign" and isinstance(later.value, cst.BinaryOperation) and isinstance(
                later.value.operator, cst.Add) and d.key in (ctx.code(later.value.left), ctx.code(later.value.right)):
            return True
    return False


def _kl_of_operand(ctx, quantity, sign_of, operand, stop) -> int | None:
    """The net sign of a KL estimate in one operand of a reward's sum (a coefficient may scale it), else None."""
    sign, facs = factors(operand)
    hits = [(f, quantity.sign("kl", f)) for f in facs]
    found = [s for _, s in hits if s is not None]
    if len(found) != 1 or any(sign_of.scale(f, None) is None for f, s in hits if s is None):
        return None
    return sign * found[0]
