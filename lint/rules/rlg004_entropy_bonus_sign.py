"""RLG004 entropy-bonus-sign: an entropy *bonus* added to a loss that is minimised."""

from __future__ import annotations

from typing import Iterator

import libcst as cst

from rlguard.catalog import ENTROPY_BONUS_SIGN
from rlguard.lint.analysis import Analysis
from rlguard.lint.analysis import semantics as S
from rlguard.lint.analysis.infoforms import negated_origin
from rlguard.lint.analysis.losses import flip, losses, sink_name
from rlguard.lint.analysis.signs import factors, signs
from rlguard.lint.analysis.terms import quantities
from rlguard.lint.rule import Invalid, Rule, Valid, Violation


# A packed-layout actor whose entropy comes from a library function through an attribute, a None placeholder and
# a pad: flagged with the entropy added ({sign} = +), clean with it subtracted
_PACKED_ENTROPY = (
    "from flash_attn.bert_padding import pad_input\n"
    "from verl.utils import torch_functional as verl_F\n"
    "class Actor:\n"
    "    def __init__(self, config):\n"
    "        self.config = config\n"
    "        self.h = (torch.compile(verl_F.entropy_from_logits, dynamic=True)\n"
    "                  if config.use_torch_compile else verl_F.entropy_from_logits)\n"
    "    def _fwd(self, batch, packed):\n"
    "        ent = None\n"
    "        out = self.module(batch[\"input_ids\"])\n"
    "        if packed:\n"
    "            ent = pad_input(hidden_states=self.h(out.logits).unsqueeze(-1), indices=batch[\"idx\"], batch=2, seqlen=8)\n"
    "            ent = ent.squeeze(-1)\n"
    "        else:\n"
    "            ent = verl_F.entropy_from_logits(out.logits)\n"
    "        return ent, out.logits.log_softmax(-1)\n"
    "    def update(self, batch, pg_loss, coef):\n"
    "        ent, lp = self._fwd(batch, self.config.packed)\n"
    "        e = (ent * batch[\"response_mask\"]).sum() / batch[\"response_mask\"].sum()\n"
    "        loss = pg_loss {sign} e * coef\n"
    "        loss.backward()\n"
)


class EntropyBonusSign(Rule):
    """
    ## What it flags
    A loss that is minimised (it is named like a loss, or it is `.backward()`-ed) to which the policy's
    entropy is *added*: `loss = pg_loss + ent_coef * entropy`. Minimising that lowers entropy: the "bonus"
    is an entropy penalty.

    The entropy is recognised by its computation, not its name: a library entropy (`dist.entropy()`,
    `entropy_from_logits`), or one written out over the distribution, `-(p * log p).sum(-1)` (with `p` and the
    argument of the log the same value, `torch.log`, `.log()`, `log_softmax` or a log helper of the module). A
    helper that returns `(p * log p).sum(-1)`, which is *minus* the entropy, carries that sign to its callers:
    when a caller subtracts it as a bonus (`loss - c * entropy(p)`), the helper is reported, since that is where
    the sign goes wrong (unless the helper is named for the negation, `neg_entropy`, `entropy_loss`; then the
    caller is).

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

    code = ENTROPY_BONUS_SIGN
    # an entropy by name, or one written out over a distribution (it needs a log: `(p * p.log()).sum(-1)`)
    # entropy, but not the cross-entropy of a supervised loss (which alone passes many files for nothing)
    triggers = r"(?i)\bent\b|log\(|log_softmax|(?<!cross)(?<!cross-)(?<!cross_)(?<!cross )entrop"
    fixable = True

    PREVIEW_PARTS = ("a loss known only by the name of the local variable that holds it (`loss = ...` with no backward, loss function or optimising caller in view)",)
    VALID = [
        Valid(_PACKED_ENTROPY.format(sign="-"),
              why="the same entropy, subtracted: a bonus", capability="C4", style="class"),
        Valid("def test_vocab_parallel_gradient(logits, labels):\n"
              "    logp = logits.log_softmax(-1).gather(-1, labels[..., None]).squeeze(-1)\n"
              "    entropy = -(logits.softmax(-1) * logits.log_softmax(-1)).sum(-1)\n"
              "    (logp.sum() + entropy.sum()).backward()\n"
              "    assert logits.grad is not None\n",
              "a gradient probe: the module steps no optimizer, so nothing is minimised and no bonus has a sign",
              capability="FP", style="functional"),
        Valid("def test_entropy_gradient(model, ids):\n"
              "    ent = -(model(ids).softmax(-1) * model(ids).log_softmax(-1)).sum(-1)\n"
              "    ent.sum().backward()\n"
              "    assert all(p.grad.isfinite().all() for p in model.parameters())\n",
              "the entropy alone is backpropagated to probe its gradient: no other loss term it is a bonus to",
              capability="FP", style="functional"),
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
              "cross-entropy against labels is not the policy's entropy", capability="C2", style="script"),
        Valid("entropy_loss = entropy.mean()\nloss = pg_loss - ent_coef * entropy_loss\nloss.backward()\n",
              "a positive entropy component, subtracted where it joins the loss"),
        Valid("high = entropies >= torch.quantile(entropies[mask.bool()], q)\n"
              "per_token_loss = -torch.min(ratio * adv, ratio.clamp(0.8, 1.2) * adv)\n"
              "per_token_loss = per_token_loss * high_entropy_mask\n"
              "loss = (per_token_loss * mask).sum() / mask.sum()\n",
              "a 0/1 selection of high-entropy tokens multiplies the loss: a mask, never a bonus",
              capability="FP", style="functional"),
        Valid("status = {'act_loss': logs['policy_loss']}\n"
              "status['ent_loss'] = logs['entropy_loss']\n"
              "bar.set_postfix(status)\n",
              "a progress-bar entry named like a loss: nothing minimises it", capability="FP", style="framework"),
        Valid("loss = pg_loss - coef * entropy.mean()\n"
              "log['loss_with_bonus'] = (pg_loss + coef * entropy.mean()).item()\n",
              "the sum with a plus sign is only logged", capability="FP", style="framework"),
        Valid("def loss_fn(logits, mask, adv, ratio):\n"
              "    h = entropy_from_logits(logits)\n"
              "    return -(ratio * adv * mask).sum() / mask.sum() - 0.01 * (h * mask).sum() / mask.sum()\n",
              "a loss function returning the bonus subtracted"),
        # a helper's entropy sign comes from its code (an effect summary), whatever it is called
        Valid("def neg_entropy(p):\n"
              "    return (p * torch.log(p)).sum(-1)\n\n"
              "def pg_objective(lp, adv, p):\n"
              "    loss = -(lp * adv).mean() + 0.01 * neg_entropy(p).mean()\n"
              "    return loss\n",
              "the helper returns minus the entropy and the loss adds it: a bonus", capability="C1",
              style="functional"),
        Valid("class Learner:\n"
              "    def spread(self, probs):\n"
              "        return -(probs * probs.clamp(min=1e-8).log()).sum(dim=-1)\n\n"
              "    def step(self, probs, pg_loss):\n"
              "        ent = self.spread(probs)\n"
              "        loss = pg_loss - self.ent_coef * ent.mean()\n"
              "        loss.backward()\n",
              "a method that writes out the entropy, subtracted by its caller", capability="C1", style="class"),
        Valid("def token_entropy(p):\n"
              "    return (p * ext.safe_log(p)).sum(-1)\n\n"
              "def pg_objective(lp, adv, p):\n"
              "    loss = -(lp * adv).mean() - 0.01 * token_entropy(p).mean()\n"
              "    return loss\n",
              "the log is a call the linter cannot read: the helper's sign is unknown, so nothing is said",
              capability="C1", style="functional"),
        Valid("def ent_and_stats(p):\n"
              "    e = -(p * torch.log(p + 1e-9)).sum(-1)\n"
              "    return e, {'entropy': e.mean().item()}\n\n"
              "def compute_loss(batch, cfg):\n"
              "    ent, stats = ent_and_stats(batch['probs'])\n"
              "    loss = batch['pg'] - cfg.ent_coef * ent.mean()\n"
              "    return loss\n",
              "the first element of the helper's tuple is the entropy, subtracted", capability="C1",
              style="framework"),
        Valid("h = entropy_from_logits(z)\nh = masked_mean(h, m)\nloss = pg - 0.01 * h\nloss.backward()\n",
              "a rebinding h = f(h) reads the entropy above it", capability="C1", style="script"),
        # roles from the formula, not the name
        Valid("entropy = (p * torch.log(p)).sum(-1)\nloss = pg + 0.01 * entropy.mean()\nloss.backward()\n",
              "named entropy, but it is sum(p log p), minus the entropy: adding it is the bonus", capability="C2",
              style="script"),
        Valid("q = z.softmax(-1)\nh = -(q * q.log()).sum(-1)\nl = pg - 0.01 * h.mean()\nl.backward()\n",
              "an entropy with no telling name, subtracted", capability="C2", style="script"),
        Valid("loss = pg_loss + entropy_weight * aux_loss\nloss.backward()\n",
              "a coefficient named for the entropy scales another loss", capability="C2", style="functional"),
        Valid("def loss_fn(teacher, student_logits, ce):\n"
              "    entropy = -(teacher * student_logits.log_softmax(-1)).sum(-1)\n"
              "    return ce + 0.1 * entropy.mean()\n",
              "two different distributions: a cross-entropy to a teacher, not the policy's entropy",
              capability="C2", style="functional"),
        Valid("h = -(q * q.log()).sum(-1)\nl = pg - 0.01 * (h * w).sum() / w.sum().clamp(min=1)\nl.backward()\n",
              "a masked mean of the entropy, by the mask's use, subtracted", capability="C2", style="script"),
        Valid("def update(loss_module, data, optim):\n"
              "    for batch in data:\n"
              "        out = loss_module(batch)\n"
              "        total = out['loss_objective'] + out.get('loss_entropy', 0.0)\n"
              "        total.backward(); optim.step(); optim.zero_grad()\n",
              "torchrl: the loss module's `loss_entropy` is already -c * entropy", capability="FP",
              style="framework"),
        Valid(
              "class Actor:\n"
              "    def _forward(self, batch):\n"
              "        logits = self.model(batch[\"input_ids\"]).logits\n"
              "        out = {\"log_probs\": logits.log_softmax(-1)}\n"
              "        out[\"entropys\"] = unpad_and_gather(self.entropy_fn(logits), batch[\"indices\"])\n"
              "        return out\n"
              "    def update(self, batch, coef):\n"
              "        out = self._forward(batch)\n"
              "        m = batch[\"response_mask\"]\n"
              "        h = (out[\"entropys\"] * m).sum() / m.sum()\n"
              "        loss = -(out[\"log_probs\"].mean()) - h * coef\n"
              "        loss.backward()\n",
              "the same entry subtracted as a bonus", capability="C3", style="class"),
        Valid("def update(loss_module, batch, opt):\n"
              "    loss = loss_module(batch)\n"
              "    total = loss['loss_objective'] + loss['loss_entropy'] + loss['loss_critic']\n"
              "    total.backward()\n",
              "an entropy *loss* produced by a library module (minus the entropy times its coefficient), summed as a "
              "loss term", capability="C3", style="script"),
    ]
    INVALID = [
        Invalid(_PACKED_ENTROPY.format(sign="+"), line=20,
                why="the entropy comes from a helper that starts from None and computes it through an attribute bound to a library entropy function and a packed-layout pad: none of it is named for an entropy", capability="C4", style="class"),
        Invalid("class PolicyTrainer(FSDPModule):\n"
                "    def train_step(self, batch, n_tokens):\n"
                "        logits = self.model(batch[\"input_ids\"]).logits[:, :-1]\n"
                "        logp = torch.log_softmax(logits, -1).gather(-1, batch[\"input_ids\"][:, 1:, None]).squeeze(-1)\n"
                "        ent = entropy_from_logits(logits)\n"
                "        pg = -(torch.exp(logp - batch[\"old_logprobs\"]) * batch[\"advantages\"]).sum() / n_tokens * self.fsdp_size\n"
                "        ent_mean = ent.sum() / n_tokens * self.fsdp_size\n"
                "        loss = pg + self.module_args.entropy_coef * ent_mean\n"
                "        loss.backward()\n", line=8,
                why="every term is scaled by a size the base class sets (self.fsdp_size, defined in another file): "
                    "a size is positive, so the entropy still enters the minimised loss with a + sign",
                capability="C6", style="class"),
        Invalid("loss = pg_loss + ent_coef * entropy.mean()\n", line=1,
                fixed="loss = pg_loss - ent_coef * entropy.mean()\n", preview=True),
        Invalid("loss = loss + ENTROPY_COEF * entropy_bonus(logits, mask)\n", line=1,
                fixed="loss = loss - ENTROPY_COEF * entropy_bonus(logits, mask)\n", preview=True),
        Invalid("loss += 0.01 * entropy\n", line=1, fixed="loss -= 0.01 * entropy\n", preview=True),
        Invalid("total_loss = pg_loss + vf_coef * vf_loss + self.entropy_coef * ent.mean()\n", line=1, preview=True),
        Invalid("ent = dist.entropy()\nout = pg + c * ent\nout.backward()\n", line=2,
                why="not named like a loss, but it is .backward()-ed", capability="C2", style="script"),
        Invalid("loss = pg_loss - ent_coef * (-entropy)\n", line=1, why="double negation is a penalty", preview=True),
        Invalid("h = entropy_from_logits(logits)\nloss = pg_loss + beta_ent * h.mean()\n", line=2,
                why="entropy through an alias", preview=True),
        Invalid("entropy_loss = entropy.mean()\nloss = pg_loss + args.ent_coef * entropy_loss\nloss.backward()\n",
                line=2, why="CleanRL spelling with the sign flipped: reported where the component joins the loss"),
        Invalid("def token_entropy(p):\n"
                "    return (p * torch.log(p)).sum(-1)\n\n"
                "def pg_objective(lp, adv, p):\n"
                "    loss = -(lp * adv).mean() - 0.01 * token_entropy(p).mean()\n"
                "    return loss\n", line=2,
                why="the helper returns sum(p log p), minus the entropy, and the loss subtracts it: reported in the "
                    "helper", capability="C1", style="functional"),
        Invalid("class Learner:\n"
                "    def spread(self, probs):\n"
                "        return (probs * probs.clamp(min=1e-8).log()).sum(dim=-1)\n\n"
                "    def step(self, probs, pg_loss):\n"
                "        ent = self.spread(probs)\n"
                "        loss = pg_loss - self.ent_coef * ent.mean()\n"
                "        loss.backward()\n", line=3,
                why="a method returning minus the entropy, trusted as the entropy by its caller", capability="C1",
                style="class"),
        Invalid("def ent_and_stats(p):\n"
                "    e = (p * torch.log(p + 1e-9)).sum(-1)\n"
                "    return e, {'entropy': e.mean().item()}\n\n"
                "def compute_loss(batch, cfg):\n"
                "    ent, stats = ent_and_stats(batch['probs'])\n"
                "    loss = batch['pg'] - cfg.ent_coef * ent.mean()\n"
                "    return loss\n", line=2,
                why="a tuple return unpacked: its first element is minus the entropy", capability="C1",
                style="framework"),
        Invalid("h = entropy_from_logits(z)\nh = masked_mean(h, m)\nloss = pg + 0.01 * h\nloss.backward()\n",
                line=3, why="h = f(h) keeps the entropy, which is then added", capability="C1", style="script"),
        Invalid("q = z.softmax(-1)\nh = -(q * q.log()).sum(-1)\nl = pg + 0.01 * h.mean()\nl.backward()\n", line=3,
                why="an entropy known by its formula, not its name", capability="C2", style="script"),
        Invalid("def objective(z, adv, lp):\n"
                "    pr = torch.softmax(z, -1)\n"
                "    spread = -(pr * torch.log_softmax(z, -1)).sum(-1)\n"
                "    return -(lp * adv).mean() + 0.01 * spread.mean()\n", line=4,
                why="softmax and log_softmax of the same logits: an entropy, added", capability="C2",
                style="functional"),
        Invalid("def loss_fn(out, cfg):\n"
                "    pr = out['probs']\n"
                "    out['spread'] = -(pr * torch.log(pr + 1e-9)).sum(-1)\n"
                "    return out['pg'] + cfg.coef * out['spread'].mean()\n", line=4,
                why="an entropy stored under a dict key with no telling name", capability="C2", style="framework"),
        Invalid("h = -(q * q.log()).sum(-1)\nl = pg + 0.01 * (h * w).sum() / w.sum().clamp(min=1)\nl.backward()\n",
                line=2, why="w is a mask by its use (it also counts the denominator): a masked mean of the entropy",
                capability="C2", style="script"),
        Invalid("from accelerate import Accelerator\n\n"
                "def spread(p):\n"
                "    e = (-p * torch.log(p.clamp(min=1e-9))).sum(dim=-1)\n"
                "    return e.mean()\n\n"
                "class Trainer:\n"
                "    def __init__(self, net, beta_s=0.01):\n"
                "        self.a1, self.a2, self.a3 = net, Accelerator(), beta_s\n\n"
                "    def learn(self, x, v1):\n"
                "        v2 = self.a1(x).softmax(-1)\n"
                "        v3 = v1 + self.a3 * spread(v2)\n"
                "        self.a2.backward(v3.mean())\n", line=13,
                why="the engine is known by its construction (`Accelerator()`), not its name: its backward(x) "
                    "minimises x, and the entropy is added", capability="C2", style="class"),
        Invalid("class Net(nn.Module):\n"
                "    def evaluate(self, s, a):\n"
                "        d = Categorical(logits=self.pi(s))\n"
                "        return d.log_prob(a), self.v(s), d.entropy()\n\n"
                "class Algo:\n"
                "    def __init__(self, dev):\n"
                "        self.a1 = Net().to(dev)\n\n"
                "    def update(self, s, a, adv):\n"
                "        v1, v2, v3 = self.a1.evaluate(s, a)\n"
                "        v4 = -(v1 * adv) + 0.01 * v3\n"
                "        v4.mean().backward()\n", line=12,
                why="`Net(...).to(dev)` is still a Net: the third element of its evaluate is an entropy",
                capability="C1", style="class"),
        Invalid(
                "class Actor:\n"
                "    def _forward(self, batch):\n"
                "        logits = self.model(batch[\"input_ids\"]).logits\n"
                "        out = {\"log_probs\": logits.log_softmax(-1)}\n"
                "        out[\"entropys\"] = unpad_and_gather(self.entropy_fn(logits), batch[\"indices\"])\n"
                "        return out\n"
                "    def update(self, batch, coef):\n"
                "        out = self._forward(batch)\n"
                "        m = batch[\"response_mask\"]\n"
                "        h = (out[\"entropys\"] * m).sum() / m.sum()\n"
                "        loss = -(out[\"log_probs\"].mean()) + h * coef\n"
                "        loss.backward()\n", line=11,
                why="an entropy stored under its string key by a helper whose computation passes a call out of view", capability="C3", style="class"),
    ]

    def check(self, ctx: Analysis) -> Iterator[Violation]:
        yield from judge_terms(ctx, "entropy", want=-1, message=(
            "entropy is added to a minimised loss, so it is penalised, not rewarded; subtract the entropy "
            "bonus (loss - c * entropy)"), helper_message=(
            "this computes sum(p * log p), minus the entropy, and the loss subtracts it as an entropy bonus, so "
            "entropy is penalised; negate it: -(p * log p).sum(-1)"))


def judge_terms(ctx: Analysis, kind: str, want: int, message: str,
                helper_message: str | None = None) -> Iterator[Violation]:
    """Every term of a minimised loss that is ``kind`` (an entropy, a KL estimate) entering with the sign opposite
    to ``want``, reported once where it joins a sum, with the sign flip as the fix where it is unambiguous."""
    quantity = quantities(ctx)
    sign_of = signs(ctx)
    loss = losses(ctx)

    def stop(expr, frame):
        return quantity.sign(kind, expr, frame) is not None

    reported: set[tuple[int, bool]] = set()
    found_at: dict[int, list[tuple[cst.CSTNode, Violation, bool]]] = {}
    for sink in loss.sinks():
        if sink.kind == "backward" and _gradient_probe(ctx, sink.node):
            continue
        name = sink_name(ctx, sink)
        if name is not None and ctx.names.is_role(name, kind) and not ctx.names.is_role(name, "mask"):
            continue  # `entropy_loss = entropy.mean()`, `def compute_kl_loss(...)`: a component, judged where it joins
        terms = list(sink.terms(sign_of, stop))
        if len(terms) == 1 and not isinstance(sink.node, cst.AugAssign) and not any(
                isinstance(stmt, cst.AugAssign) for _, stmt in terms[0].via):
            continue  # the quantity alone (`entropy.sum().backward()` in a gradient test): no other loss it rewards
        for term in terms:
            sign, facs = factors(term.expr)
            hits = [(f, quantity.sign(kind, f, term.frame)) for f in facs]
            found = [(f, s) for f, s in hits if s is not None]
            # an additive term: its other factors only scale it (a multiplicative factor is never a bonus)
            if len(found) != 1 or any(sign_of.scale(f, term.frame) is None for f, s in hits if s is None):
                continue
            net = term.sign * sign * found[0][1]
            if net == want:
                continue
            origin = negated_origin(ctx, kind, found[0][0], term.frame)
            if origin is not None:
                # a helper presents the negated quantity as the quantity, and its caller trusts it: the helper is
                # where the sign goes wrong (an effect summary from its code, not its name)
                found_at.setdefault(id(origin), []).append((origin, Violation(
                    origin, helper_message or message), sink.inferred))
                continue
            stmt, value, operand = loss.joining(sink, term)
            if (id(operand), sink.inferred) in reported:
                continue
            reported.add((id(operand), sink.inferred))
            helper = _negating_helper_elsewhere(ctx, quantity, sign_of, kind, found[0][0], term.frame)
            if helper is not None:
                role = "an entropy bonus" if kind == "entropy" else "a KL penalty"
                found_at.setdefault(id(found[0][0]), []).append((found[0][0], Violation(
                    operand, f"`{helper}` (another file of the tree) returns minus the {what(kind)}, and it enters "
                             f"this minimised loss with the sign of {role}, so it acts the wrong way; fix the helper "
                             "or the sign here"), sink.inferred))
                continue
            found_at.setdefault(id(found[0][0]), []).append((found[0][0], Violation(
                operand, message, flip(stmt, value, operand)), sink.inferred))
    # one term reached from several sinks (the helper's returned loss, the caller's loss, its backward) is one
    # fault: report it where it joins the sum, in the function that holds the term; it is a preview finding when
    # only sinks inferred from a variable's name reach it
    for candidates in found_at.values():
        home = ctx.enclosing_function(candidates[0][0])
        shown = [(v, inferred) for _, v, inferred in candidates]
        local = [c for c in shown if ctx.enclosing_function(c[0].node) is home] or shown
        violation = local[0][0]
        violation.preview = all(inferred for _, inferred in shown)
        yield violation


def _gradient_probe(ctx: Analysis, backward: cst.CSTNode) -> bool:
    """A backward in a test function (pytest's ``test_*``) that steps no optimizer: gradients computed to be
    looked at (``(logp.sum() + entropy.sum()).backward()`` then ``.grad`` compared), nothing minimised."""
    func = ctx.enclosing_function(backward)
    if func is None or not func.name.value.startswith("test"):
        return False
    return not any(S.method_name(call) == "step" for call in ctx.index.descendants(func, cst.Call))


def what(kind: str) -> str:
    return {"entropy": "entropy", "kl": "KL"}.get(kind, kind)


def _negating_helper_elsewhere(ctx, quantity, sign_of, kind, expr, frame) -> str | None:
    """The name of a function of another file whose summary says it returns minus ``kind``, when ``expr``'s value
    is (a reduction of) its call."""
    def stop(e, _frame):
        return quantity._summarised(kind, e) is not None

    terms = sign_of.terms(expr, frame, stop=stop)
    if len(terms) == 1 and stop(terms[0].expr, None) and quantity._summarised(kind, terms[0].expr) == -1:
        return ctx.code(terms[0].expr.func)
    return None
