"""RLG002 old-logp-recomputed: behaviour log-probs recomputed from the current weights inside the update loop."""

from __future__ import annotations

from typing import Iterator

import libcst as cst

from rlguard.catalog import OLD_LOGP_RECOMPUTED
from rlguard.lint.analysis import Analysis, dotted_name
from rlguard.lint.analysis import semantics as S
from rlguard.lint.analysis.callers import runs_per_update
from rlguard.lint.analysis.index import Def, key_of
from rlguard.lint.analysis.loops import EPOCH_WORD, training
from rlguard.lint.analysis.provenance import FORWARD, PARAM, READ, REMOTE, provenance
from rlguard.lint.analysis.roles import old_logp_arguments, ratio_terms
from rlguard.lint.rule import Invalid, Rule, Valid, Violation


class OldLogpRecomputed(Rule):
    """
    ## What it flags
    Old (behaviour) log-probs computed by a forward pass of the policy (or a log-prob helper applied to it)
    inside a loop that runs once per update: a PPO epoch or minibatch loop (`for epoch in range(ppo_epochs)`,
    `for mb in batch.chunk(n)`, `for idx in BatchSampler(...)`) or a loop whose body calls `.backward()` or
    `optimizer.step()`, even under `torch.no_grad()`. A value counts as old log-probs when it is named so
    (`old_logp`, `old_log_probs`, `behavior_logp`, ...) or used as such: passed as the `old_logp`/
    `old_log_probs` argument (by keyword, or positionally to a same-module function whose parameter is so
    named) or subtracted from the current log-probs in `(logp - x).exp()` (also when detached there,
    `exp(logp - x.detach())`), or stored under such a key of a record (`mb["old_log_probs"] = logp_of(policy,
    mb)`). `exp(a - b)` between the forwards of two different models (the k3 KL `exp(ref - logp)`) is a KL
    estimator, not a PPO ratio, and makes no old log-probs. A helper with no loop of its own counts as inside
    the update loop when every call of it in the module is, directly or through a few levels of callers
    (`loss_of()` calls `_behaviour_logp()`, and only the minibatch loop calls `loss_of()`); a helper with no
    call in the module (framework entry code) is left alone.

    Not flagged: old log-probs computed once before the epoch loop, read from the rollout buffer inside it
    (`batch["old_logp"][rows]`), or computed in an outer loop that gathers a fresh rollout each iteration
    (`generate`, `collect_rollouts`, `env.step`) with the epoch loop nested inside.

    ## Why it is wrong
    PPO's ratio `exp(logp - old_logp)` measures how far the policy has moved since the rollout. Recomputed
    from the current weights just before the loss, `old_logp == logp`: the ratio is 1 for every minibatch,
    clipping never acts, and PPO degrades to an unclipped policy gradient taking several steps on the same
    data. In training: `ratio_max == 1` and `clip_frac == 0` at every step, `approx_kl` near 0 while the
    policy changes fast, and instability with larger learning rates or more epochs.

    ## Example
    ```python
    for epoch in range(ppo_epochs):
        for mb in batch.split(mb_size):
            with torch.no_grad():
                old_logp = compute_logp(policy, mb.ids)
            logp = compute_logp(policy, mb.ids)
            ratio = (logp - old_logp).exp()
    ```

    ## Use instead
    ```python
    with torch.no_grad():
        batch.old_logp = compute_logp(policy, batch.ids)  # once, with the rollout's weights
    for epoch in range(ppo_epochs):
        for mb in batch.split(mb_size):
            logp = compute_logp(policy, mb.ids)
            ratio = (logp - mb.old_logp).exp()
    ```

    ## Fix
    No automatic fix: the computation has to move before the epoch loop and its result be stored with the
    rollout and sliced per minibatch, a change of structure no rewrite can make safely.

    ## Options
    `[tool.rlguard.names]` `old_logp = [...]` and `policy = [...]` add your own names.
    """

    code = OLD_LOGP_RECOMPUTED
    # a log-prob name (old log-probs by name) or an exp (old log-probs by their use in a ratio)
    triggers = r"(?i)log_?p|_lps?\b|exp\("

    VALID = [
        Valid("with torch.no_grad():\n"
              "    old_logp = compute_logp(policy, ids)\n"
              "for epoch in range(ppo_epochs):\n"
              "    logp = compute_logp(policy, ids)\n"
              "    loss = -(torch.exp(logp - old_logp) * adv).mean()\n"
              "    loss.backward()\n", "computed once before the epoch loop"),
        Valid("for epoch in range(ppo_epochs):\n"
              "    for rows in BatchSampler(SubsetRandomSampler(range(n)), mb_size, False):\n"
              "        old_logp = batch['old_logp'][rows]\n"
              "        logp = compute_logp(policy, batch['ids'][rows])\n"
              "        ratio = (logp - old_logp).exp()\n", "stored values indexed inside the loop"),
        Valid("for iteration in range(num_iterations):\n"
              "    ids = policy.generate(prompts)\n"
              "    with torch.no_grad():\n"
              "        old_logp = compute_logp(policy, ids)\n"
              "    for epoch in range(ppo_epochs):\n"
              "        logp = compute_logp(policy, ids)\n"
              "        ppo_loss(logp, old_logp, adv).backward()\n"
              "        optimizer.step()\n", "outer rollout loop: one fresh rollout per iteration"),
        Valid("for epoch in range(ppo_epochs):\n"
              "    for mb in batch.chunk(4):\n"
              "        logp = self.actor(mb['ids'])\n"
              "        ratio = (logp - mb['old_log_probs']).exp()\n", "current log-probs recomputed, as they must"),
        Valid("for step, batch in enumerate(loader):\n"
              "    completions = model.generate(batch['prompt_ids'])\n"
              "    logp = token_logp(model, completions)\n"
              "    old_logp = logp.detach()\n"
              "    loss = -(torch.exp(logp - old_logp) * adv).mean()\n"
              "    loss.backward()\n"
              "    optimizer.step()\n", "GRPO with one update per rollout: ratio 1 by design"),
        Valid("for epoch in range(ppo_epochs):\n"
              "    for mb in minibatches:\n"
              "        with torch.no_grad():\n"
              "            ref_logp = compute_logp(ref_model, mb.ids)\n"
              "        logp = compute_logp(policy, mb.ids)\n", "reference log-probs are not old log-probs"),
        Valid("old_logp = rollout['logp']\n"
              "for epoch in range(ppo_epochs):\n"
              "    for idx in torch.randperm(n).split(mb):\n"
              "        ratio = torch.exp(policy_logp(policy, ids[idx]) - old_logp[idx])\n",
              "stored at rollout time, sliced in the loop"),
        Valid("with torch.no_grad():\n"
              "    logits = policy(ids).logits\n"
              "for epoch in range(ppo_epochs):\n"
              "    old_logp = logprobs_from_logits(logits, ids)\n"
              "    logp = logprobs_from_logits(policy(ids).logits, ids)\n", "from logits of the rollout weights"),
        Valid("while not done:\n"
              "    with torch.no_grad():\n"
              "        old_logp, value = agent.act(obs)\n"
              "    obs, reward, done, info = env.step(action)\n", "rollout loop (env.step)"),
        Valid("class Actor:\n"
              "    def update(self, data):\n"
              "        chunks = data.split(self.cfg.mini_batch)\n"
              "        single_step = self.cfg.epochs == 1 and len(chunks) == 1\n"
              "        for _ in range(self.cfg.epochs):\n"
              "            for chunk in chunks:\n"
              "                self.opt.zero_grad()\n"
              "                cur = self.score(chunk)['logp']\n"
              "                if single_step:\n"
              "                    behaviour = cur.detach()\n"
              "                else:\n"
              "                    behaviour = chunk['behaviour_logp']\n"
              "                (-(torch.exp(cur - behaviour) * chunk['adv']).mean()).backward()\n"
              "                self.opt.step()\n",
              "the on-policy shortcut, taken only with one epoch and one minibatch (ratio 1 is exact)"),
        Valid("class Trainer:\n"
              "    def compute_loss(self, model, inputs):\n"
              "        lp = self._token_logps(model, inputs['input_ids'])\n"
              "        old = inputs.get('old_per_token_logps')\n"
              "        old = lp.detach() if old is None else old\n"
              "        return -(torch.exp(lp - old) * inputs['advantages']).mean()\n",
              "TRL-style fallback in a loss the framework calls once per optimizer step (no stored old log-probs "
              "means one iteration per rollout)"),
        Valid("class Learner:\n"
              "    def _behaviour(self, b):\n"
              "        with torch.no_grad():\n"
              "            behaviour_logp = self.token_lp(b)\n"
              "        return behaviour_logp\n"
              "\n"
              "    def prepare(self, batch):\n"
              "        batch['behaviour_logp'] = self._behaviour(batch)\n"
              "\n"
              "    def fit(self, batch):\n"
              "        self.prepare(batch)\n"
              "        for _ in range(self.passes):\n"
              "            for b in batch.split(self.mb):\n"
              "                ratio = (self.token_lp(b) - b['behaviour_logp']).exp()\n"
              "                (-(ratio * b['adv']).mean()).backward()\n"
              "                self.opt.step()\n"
              "                self.opt.zero_grad()\n",
              "the helper's only caller runs before the epoch loop, once per rollout",
              capability="C5", style="class"),
        Valid("def behaviour_of(policy, ids):\n"
              "    with torch.no_grad():\n"
              "        old_logp = token_logps(policy, ids)\n"
              "    return old_logp\n"
              "\n"
              "def train(policy, opt, prompts, rounds, epochs):\n"
              "    for _ in range(rounds):\n"
              "        ids = policy.generate(prompts)\n"
              "        old = behaviour_of(policy, ids)\n"
              "        for _ in range(epochs):\n"
              "            ratio = torch.exp(token_logps(policy, ids) - old)\n"
              "            (-(ratio * adv).mean()).backward()\n"
              "            opt.step()\n"
              "            opt.zero_grad()\n",
              "the helper is called in the loop that generates a fresh rollout, above the epoch loop",
              capability="C5", style="functional"),
        Valid("class Worker:\n"
              "    def compute_old_log_probs(self, data):\n"
              "        with torch.no_grad():\n"
              "            old_log_probs = self.forward_logp(data['input_ids'])\n"
              "        return {'old_log_probs': old_log_probs}\n"
              "\n"
              "    def update_actor(self, data):\n"
              "        for mb in data.split(self.config.mini_batch_size):\n"
              "            ratio = (self.forward_logp(mb['input_ids']) - mb['old_log_probs']).exp()\n"
              "            (-(ratio * mb['advantages']).mean()).backward()\n"
              "            self.optimizer.step()\n"
              "            self.optimizer.zero_grad()\n",
              "an entry point the framework calls (no call in the module): no caller context to borrow",
              capability="C5", style="framework"),
        Valid("def one_round(policy, optim, prompts, judge):\n"
              "    with torch.no_grad():\n"
              "        seqs = policy.generate(prompts, do_sample=True)\n"
              "        behaviour_lp = policy(seqs).logits[:, :-1].log_softmax(-1)\n"
              "    lp = policy(seqs).logits[:, :-1].log_softmax(-1)\n"
              "    loss = -((lp - behaviour_lp).exp() * judge(seqs)[:, None, None]).mean()\n"
              "    optim.zero_grad(); loss.backward(); optim.step()\n"
              "\n"
              "def fit(policy, optim, loader, judge):\n"
              "    for prompts in loader:\n"
              "        one_round(policy, optim, prompts, judge)\n",
              "the helper the loop calls generates a fresh rollout itself: old log-probs are once per rollout",
              capability="C5", style="functional"),
        Valid("class Trainer:\n"
              "    def logps(self, model, ids):\n"
              "        out = []\n"
              "        for i in range(0, ids.size(0), 4):\n"
              "            z = model(ids[i:i + 4]).logits[:, :-1]\n"
              "            out.append(torch.log_softmax(z, -1).gather(-1, ids[i:i + 4, 1:, None]).squeeze(-1))\n"
              "        return torch.cat(out)\n"
              "\n"
              "    def step(self, ids, adv, old_lp):\n"
              "        for start in range(0, ids.size(0), 8):\n"
              "            mb = slice(start, start + 8)\n"
              "            rl = self.logps(self.ref_model, ids[mb])\n"
              "            lp = self.logps(self.model, ids[mb])\n"
              "            ratio = torch.exp(lp - old_lp[mb])\n"
              "            kl = torch.exp(rl - lp) - (rl - lp) - 1\n"
              "            loss = (-ratio * adv[mb, None] + 0.04 * kl).mean()\n"
              "            loss.backward()\n"
              "            self.opt.step()\n"
              "            self.opt.zero_grad()\n",
              "exp(ref - logp) inside the loop is the k3 KL between the reference and the policy, two models: "
              "the live log-probs on its right are the current ones, not recomputed old ones", capability="C2",
              style="class"),
    ]
    INVALID = [
        Invalid("def token_logps(model, ids):\n"
                "    z = model(ids).logits[:, :-1]\n"
                "    return torch.log_softmax(z, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)\n"
                "\n"
                "\n"
                "def update(model, opt, batches, epochs):\n"
                "    for _ in range(epochs):\n"
                "        for ids, adv in batches:\n"
                "            prev = token_logps(model, ids)\n"
                "            cur = token_logps(model, ids)\n"
                "            ratio = torch.exp(cur - prev.detach())\n"
                "            loss = -torch.min(ratio * adv, ratio.clamp(0.8, 1.2) * adv).mean()\n"
                "            opt.zero_grad()\n"
                "            loss.backward()\n"
                "            opt.step()\n", line=9,
                why="the old side of the ratio is detached where it is used; its value is still recomputed from "
                    "the current weights in the minibatch loop", capability="C2", style="functional"),
        Invalid("for epoch in range(ppo_epochs):\n"
                "    for mb in batch.split(mb_size):\n"
                "        with torch.no_grad():\n"
                "            old_logp = compute_logp(policy, mb.ids)\n"
                "        logp = compute_logp(policy, mb.ids)\n"
                "        ratio = (logp - old_logp).exp()\n", line=4, why="even under no_grad"),
        Invalid("for _ in range(self.ppo_epochs):\n"
                "    with torch.no_grad():\n"
                "        old_log_probs = self.policy(input_ids).log_softmax(-1)\n"
                "    new_log_probs = self.policy(input_ids).log_softmax(-1)\n", line=3, why="per epoch", preview=True),
        Invalid("for mb in batch.chunk(n_minibatches):\n"
                "    logp = token_logp(model, mb['ids'])\n"
                "    old_logp = logp.detach()\n"
                "    loss = ppo_loss(logp, old_logp, mb['adv'])\n"
                "    loss.backward()\n"
                "    optimizer.step()\n", line=3, why="a detached copy of the current log-probs", preview=True),
        Invalid("for mb in minibatches:\n"
                "    with torch.no_grad():\n"
                "        stale = self.actor(mb.ids).logp\n"
                "    loss = clipped_loss(logp=self.actor(mb.ids).logp, old_log_probs=stale, adv=mb.adv)\n"
                "    loss.backward()\n", line=3, why="used as old_log_probs by keyword"),
        Invalid("for epoch in range(4):\n"
                "    with torch.no_grad():\n"
                "        base = model(ids).logits.log_softmax(-1)\n"
                "    cur = model(ids).logits.log_softmax(-1)\n"
                "    ratio = (cur - base).exp()\n"
                "    (-(ratio * adv).mean()).backward()\n", line=3, why="used as old log-probs in the ratio"),
        Invalid("def ppo_loss(logp, old_logp, adv):\n"
                "    return -(torch.exp(logp - old_logp) * adv).mean()\n"
                "\n"
                "for epoch in range(update_epochs):\n"
                "    with torch.no_grad():\n"
                "        behaviour = policy_logp(policy, ids)\n"
                "    ppo_loss(policy_logp(policy, ids), behaviour, adv).backward()\n", line=6,
                why="passed positionally to a parameter named old_logp"),
        Invalid("class PPOTrainer:\n"
                "    def update(self, batch):\n"
                "        for epoch in range(self.cfg.ppo_epochs):\n"
                "            with torch.no_grad():\n"
                "                self.old_logp = self.logp_fn(self.model, batch.ids)\n"
                "            logp = self.logp_fn(self.model, batch.ids)\n", line=5, why="a self. attribute", preview=True),
        Invalid("for epoch in range(ppo_epochs):\n"
                "    with torch.no_grad():\n"
                "        out = policy(ids)\n"
                "    old_logprobs = gather_logp(out.logits, ids)\n"
                "    for mb in minibatches:\n"
                "        pass\n", line=4, why="through a forward in the same loop", preview=True),
        Invalid("class Learner:\n"
                "    def _stale(self, b):\n"
                "        with torch.no_grad():\n"
                "            old_lp = self.token_lp(b)\n"
                "        return old_lp\n"
                "\n"
                "    def loss_of(self, b):\n"
                "        ratio = (self.token_lp(b) - self._stale(b)).exp()\n"
                "        return -(ratio * b['adv']).mean()\n"
                "\n"
                "    def token_lp(self, b):\n"
                "        return self.policy(b['ids']).logits.log_softmax(-1)\n"
                "\n"
                "    def fit(self, batch):\n"
                "        for _ in range(self.passes):\n"
                "            for b in batch.split(self.mb):\n"
                "                self.loss_of(b).backward()\n"
                "                self.opt.step()\n"
                "                self.opt.zero_grad()\n", line=4,
                why="two levels of helpers: the minibatch loop calls loss_of(), which calls _stale()",
                capability="C5", style="class", preview=True),
        Invalid("def behaviour(policy, ids):\n"
                "    with torch.no_grad():\n"
                "        old_logp = token_logps(policy, ids)\n"
                "    return old_logp\n"
                "\n"
                "def objective(policy, mb):\n"
                "    return clip_objective(token_logps(policy, mb.ids), behaviour(policy, mb.ids), mb.adv)\n"
                "\n"
                "def one_step(policy, mb, opt):\n"
                "    opt.zero_grad()\n"
                "    objective(policy, mb).backward()\n"
                "    opt.step()\n"
                "\n"
                "def train(policy, opt, data, epochs):\n"
                "    for _ in range(epochs):\n"
                "        for mb in data.split(16):\n"
                "            one_step(policy, mb, opt)\n", line=3,
                why="three levels of callers between the helper and the epoch loop",
                capability="C5", style="functional", preview=True),
        Invalid("def upd(pi, opt, data, cfg):\n"
                "    for _ in range(cfg.ppo_epochs):\n"
                "        for mb in data.split(cfg.mb):\n"
                "            with torch.no_grad():\n"
                "                mb['old_log_probs'] = tok_lp(pi, mb['ids'])\n"
                "            r = (tok_lp(pi, mb['ids']) - mb['old_log_probs']).exp()\n"
                "            l = -(r * mb['adv']).mean()\n"
                "            opt.zero_grad(); l.backward(); opt.step()\n", line=5,
                why="stored under the old log-probs key of the minibatch record, inside the loop",
                capability="C3", style="script"),
        Invalid("def lp_old(pi, x):\n"
                "    with torch.no_grad():\n"
                "        behav_lp = pi(x).logits.log_softmax(-1)\n"
                "    return behav_lp\n"
                "\n"
                "for ep in range(K):\n"
                "    for i in idx.split(64):\n"
                "        r = (pi(X[i]).logits.log_softmax(-1) - lp_old(pi, X[i])).exp()\n"
                "        l = -(r * A[i]).mean()\n"
                "        o.zero_grad(); l.backward(); o.step()\n", line=3,
                why="a helper whose only call sits in the epoch loop, used in the ratio",
                capability="C5", style="script", preview=True),
    ]

    def check(self, ctx: Analysis) -> Iterator[Violation]:
        train = training(ctx)
        used = _used_as_old_logp(ctx)
        prov = provenance(ctx)
        for stmt in ctx.nodes(cst.Assign):
            defs = [d for d in ctx.index.stmt_defs.get(id(stmt), ()) if d.kind == "assign"]
            for d in defs:
                name = d.key
                bare = _stored_field(name) if "[" in name else name.rsplit(".", 1)[-1]
                if bare is None or not (ctx.names.is_role(bare, "old_logp") or _used_key(ctx, d) in used):
                    continue
                loops = train.update_loops(stmt)
                per_call = False
                if not loops:
                    # class 5: a method whose every call in the module sits in an update loop runs once per update
                    # (through a few levels of callers: `loss_of()` calls `_old()`, the loop calls `loss_of()`)
                    if not runs_per_update(ctx, ctx.enclosing_function(stmt)):
                        continue
                    per_call = True
                value = d.value.elements[d.element].value if d.element is not None and isinstance(
                    d.value, (cst.Tuple, cst.List)) else d.value
                live = [o for o in prov.value(value) if o.kind == FORWARD and
                        (o.model is None or o.model.role in ("policy", "model"))]
                forwards = [prov.facet.nodes.get(o.node_id) for o in live]
                inside = [f for f in forwards if f is not None and (
                    per_call or any(ctx.contains(loop, f) for loop in loops))]
                if not inside or _one_step_shortcut(ctx, d):
                    continue
                multi = len(defs) > 1 or d.element is not None
                yield Violation(d.target if multi and d.target is not None else stmt.value,
                                f"old log-probs `{name}` are recomputed from the current weights inside "
                                "the update loop, so the PPO ratio is 1 and clipping never acts; compute "
                                "them once before the epoch loop (or at rollout time) and slice the "
                                "stored values per minibatch")
                break


def _stored_field(key: str) -> str | None:
    """``mb['old_log_probs']`` -> ``old_log_probs``: the string key a value is stored under in a record (the
    last one of the path); None for a deeper path (``d['a'].b``)."""
    if not key.endswith("]"):
        return None
    inner = key[key.rfind("[") + 1:-1]
    return inner[1:-1] if len(inner) >= 2 and inner[0] == inner[-1] and inner[0] in "'\"" else None


def _used_key(ctx: Analysis, d: Def) -> tuple[int, str]:
    return id(ctx.index.function_scope(d.stmt).node), d.key


def _used_as_old_logp(ctx: Analysis) -> set[tuple[int, str]]:
    """(function, key) of values used as old log-probs: passed as an old-logp argument, or subtracted from the
    current log-probs under an ``exp`` (``exp(cur - y)`` with ``cur`` live log-probs of the policy)."""
    used: set[tuple[int, str]] = set()
    prov = provenance(ctx)

    def add(expr: cst.BaseExpression, at: cst.CSTNode) -> None:
        while isinstance(expr, cst.Call) and isinstance(expr.func, cst.Attribute) and not expr.args and \
                expr.func.attr.value in ("detach", "clone", "float", "contiguous"):
            expr = expr.func.value  # `exp(new - old.detach())`: the old values are `old`'s
        key = key_of(expr)
        if key is not None:
            used.add((id(ctx.index.function_scope(at).node), key))

    for value, call in old_logp_arguments(ctx):
        add(value, call)
    for call, cur, old in ratio_terms(ctx):
        current = prov.value(cur)
        if _other_models(current, prov.value(old)):
            continue  # exp(ref - logp): the k3 KL estimator between two models, not a PPO ratio
        if any(o.kind == FORWARD and o.grad is not False for o in current) or any(
                ctx.names.is_role(n, "logp") for n in _names_of(cur)):
            add(old, call)
    return used


def _other_models(current, other) -> bool:
    """Both sides of ``exp(a - b)`` are forwards of models, and no model runs on both sides: a log-ratio between
    two models (a KL estimator), where a PPO ratio compares one policy at two times."""
    def roots(origins):
        return {root for o in origins if o.kind == FORWARD and o.model is not None for root in o.model.roots}
    a, b = roots(current), roots(other)
    return bool(a) and bool(b) and a.isdisjoint(b)


def _names_of(expr: cst.BaseExpression) -> list[str]:
    key = key_of(expr)
    return [key.rsplit(".", 1)[-1]] if key else []


def _one_step_shortcut(ctx: Analysis, d: Def) -> bool:
    """``if on_policy: old = logp.detach() else: old = batch["old_log_probs"]`` where the condition visibly means
    one optimizer step per rollout (one epoch and one minibatch): the current weights are the behaviour weights and
    ratio 1 is exact (the documented TRL and verl shortcut)."""
    prov = provenance(ctx)
    for anc in ctx.ancestors(d.stmt):
        if isinstance(anc, (cst.FunctionDef, cst.ClassDef)):
            return False
        if isinstance(anc, cst.If) and anc.orelse is not None:
            in_body = ctx.contains(anc.body, d.stmt)
            other = anc.orelse if in_body else anc.body
            if not _reads_stored(ctx, prov, other, d.key):
                continue
            return _bounds_to_one_step(ctx, anc.test, 3)
    return False


def _reads_stored(ctx: Analysis, prov, branch: cst.CSTNode, key: str) -> bool:
    """The other branch binds ``key`` to stored data (a batch field, a parameter, another process's result)."""
    for stmt in ctx.index.descendants(branch, cst.Assign):
        for d in ctx.index.stmt_defs.get(id(stmt), ()):
            if d.key == key and d.value is not None:
                origins = prov.value(d.value)
                if any(o.kind == FORWARD for o in origins):
                    continue
                # a batch field (`mb["old_log_probs"]`, `batch.old_logp`) or stored data by provenance
                if (origins and all(o.kind in (READ, PARAM, REMOTE) for o in origins)) or isinstance(
                        d.value, (cst.Subscript, cst.Attribute)):
                    return True
    return False


def _bounds_to_one_step(ctx: Analysis, test: cst.BaseExpression, depth: int) -> bool:
    """A condition that holds only with one epoch / one minibatch / one iteration per rollout:
    ``len(mini_batches) == 1``, ``self.config.ppo_epochs == 1``, ``num_iterations == 1``, an ``and`` of such
    tests, or a name bound to one."""
    if isinstance(test, cst.BooleanOperation) and isinstance(test.operator, cst.And):
        return _bounds_to_one_step(ctx, test.left, depth) or _bounds_to_one_step(ctx, test.right, depth)
    if isinstance(test, cst.Comparison) and len(test.comparisons) == 1:
        comp = test.comparisons[0]
        if isinstance(comp.operator, cst.Equal) and S.int_value(comp.comparator) == 1:
            return _counts_steps(test.left)
        if isinstance(comp.operator, cst.LessThanEqual) and S.int_value(comp.comparator) == 1:
            return _counts_steps(test.left)
        return False
    key = key_of(test)
    if key is not None and depth > 0:
        defs = ctx.flow.reaching(key, test)
        return bool(defs) and all(d.kind == "assign" and d.value is not None and
                                  _bounds_to_one_step(ctx, d.value, depth - 1) for d in defs)
    return False


def _counts_steps(expr: cst.BaseExpression) -> bool:
    if isinstance(expr, cst.Call) and S.called_name(expr) == "len":
        return True
    name = dotted_name(expr) or ""
    return bool(EPOCH_WORD.search(name.rsplit(".", 1)[-1])) or "iteration" in name.lower()
