"""RLG002 old-logp-recomputed: behaviour log-probs recomputed from the current weights inside the update loop."""

from __future__ import annotations

from typing import Iterator

import libcst as cst

from rlguard.lint.context import ModuleContext, dotted_name, method_name
from rlguard.lint.rule import Invalid, Rule, Valid, Violation
from rlguard.lint.rules._loops import forward_calls, is_reference_forward, update_loops


class OldLogpRecomputed(Rule):
    """
    ## What it flags
    Old (behaviour) log-probs computed by a forward pass of the policy (or a log-prob helper applied to it)
    inside a loop that runs once per update: a PPO epoch or minibatch loop (`for epoch in range(ppo_epochs)`,
    `for mb in batch.chunk(n)`, `for idx in BatchSampler(...)`) or a loop whose body calls `.backward()` or
    `optimizer.step()`, even under `torch.no_grad()`. A value counts as old log-probs when it is named so
    (`old_logp`, `old_log_probs`, `behavior_logp`, ...) or used as such: passed as the `old_logp`/
    `old_log_probs` argument (by keyword, or positionally to a same-module function whose parameter is so
    named) or subtracted from the current log-probs in `(logp - x).exp()`.

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

    code = "RLG002"
    triggers = (r"(?i)(old|behaviou?r|rollout|sampl\w*|mu)_?(per_token_)?log_?p|"
                r"\.exp\(\)|torch\.exp\(")

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
    ]
    INVALID = [
        Invalid("for epoch in range(ppo_epochs):\n"
                "    for mb in batch.split(mb_size):\n"
                "        with torch.no_grad():\n"
                "            old_logp = compute_logp(policy, mb.ids)\n"
                "        logp = compute_logp(policy, mb.ids)\n"
                "        ratio = (logp - old_logp).exp()\n", line=4, why="even under no_grad"),
        Invalid("for _ in range(self.ppo_epochs):\n"
                "    with torch.no_grad():\n"
                "        old_log_probs = self.policy(input_ids).log_softmax(-1)\n"
                "    new_log_probs = self.policy(input_ids).log_softmax(-1)\n", line=3, why="per epoch"),
        Invalid("for mb in batch.chunk(n_minibatches):\n"
                "    logp = token_logp(model, mb['ids'])\n"
                "    old_logp = logp.detach()\n"
                "    loss = ppo_loss(logp, old_logp, mb['adv'])\n"
                "    loss.backward()\n"
                "    optimizer.step()\n", line=3, why="a detached copy of the current log-probs"),
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
                "            logp = self.logp_fn(self.model, batch.ids)\n", line=5, why="a self. attribute"),
        Invalid("for epoch in range(ppo_epochs):\n"
                "    with torch.no_grad():\n"
                "        out = policy(ids)\n"
                "    old_logprobs = gather_logp(out.logits, ids)\n"
                "    for mb in minibatches:\n"
                "        pass\n", line=4, why="through a forward in the same loop"),
    ]

    def check(self, ctx: ModuleContext) -> Iterator[Violation]:
        used = _used_as_old_logp(ctx)
        for stmt in ctx.nodes(cst.Assign):
            for target in stmt.targets:
                for element in _elements(target.target):
                    name = dotted_name(element)
                    if name is None:
                        continue
                    if not (ctx.names.is_role(name.rsplit(".", 1)[-1], "old_logp")
                            or (id(ctx.scope_of(stmt).node), name) in used):
                        continue
                    loops = update_loops(ctx, stmt)
                    if not loops:
                        continue
                    forwards = [f for f in forward_calls(ctx, stmt.value, grad=False)
                                if not is_reference_forward(ctx, f)]
                    if any(ctx.contains(loop, f) for loop in loops for f in forwards):
                        yield Violation(stmt.value if len(_elements(target.target)) == 1 else element,
                                        f"old log-probs `{name}` are recomputed from the current weights inside "
                                        "the update loop, so the PPO ratio is 1 and clipping never acts; compute "
                                        "them once before the epoch loop (or at rollout time) and slice the "
                                        "stored values per minibatch")
                        break


def _elements(target: cst.BaseExpression) -> list[cst.BaseExpression]:
    if isinstance(target, (cst.Tuple, cst.List)):
        return [el.value for el in target.elements]
    return [target]


def _used_as_old_logp(ctx: ModuleContext) -> set[tuple[int, str]]:
    """(scope, name) of variables used as old log-probs: passed as an old-logp argument, or subtracted from
    the current log-probs under an ``exp``."""
    used: set[tuple[int, str]] = set()

    def add(expr: cst.BaseExpression, at: cst.CSTNode) -> None:
        name = dotted_name(expr)
        if name is not None:
            used.add((id(ctx.scope_of(at).node), name))

    for call in ctx.nodes(cst.Call):
        for arg in call.args:
            if arg.keyword is not None and ctx.names.is_role(arg.keyword.value, "old_logp"):
                add(arg.value, call)
        if isinstance(call.func, cst.Name):
            defs = ctx.functions.get(call.func.value)
            if defs and len(defs) == 1:
                params = ctx.scopes[id(defs[0])].params
                positional = [a for a in call.args if a.keyword is None and not a.star]
                for param, arg in zip(params, positional):
                    if ctx.names.is_role(param, "old_logp"):
                        add(arg.value, call)
        exponent = None
        if method_name(call) == "exp" and not call.args and isinstance(call.func, cst.Attribute):
            exponent = call.func.value
        elif ctx.call_name(call) == "torch.exp" and call.args:
            exponent = call.args[0].value
        if isinstance(exponent, cst.BinaryOperation) and isinstance(exponent.operator, cst.Subtract):
            left = exponent.left
            if _is_current_logp(ctx, left):
                add(exponent.right, call)
    return used


def _is_current_logp(ctx: ModuleContext, expr: cst.BaseExpression) -> bool:
    if any(ctx.names.is_role(n, "logp") for n in ctx.role_names(expr)):
        return True
    return bool(forward_calls(ctx, expr, grad=False))


