"""RLG013 grad-not-zeroed: ``optimizer.step()`` in a loop with no ``zero_grad`` between steps."""

from __future__ import annotations

from typing import Iterator

import libcst as cst

from rlguard.lint.analysis.index import children

from rlguard.lint.analysis import Analysis
from rlguard.lint.analysis import accumulation as A
from rlguard.lint.analysis.grad import call_sites
from rlguard.lint.analysis.loops import ALL, UNKNOWN, Training, Zeroing, training
from rlguard.lint.rule import Invalid, Rule, Valid, Violation


class GradNotZeroed(Rule):
    """
    ## What it flags
    `optimizer.step()` (or `scaler.step(optimizer)`) inside a loop, with no `zero_grad` for that optimizer
    between one step and the next: none in the loop, only one before the loop, or only one after it. Any of
    these counts as zeroing: `optimizer.zero_grad()` (with or without `set_to_none`), `model.zero_grad()`,
    `for p in params: p.grad = None`, `p.grad.zero_()`, or a call of a helper of the same module that does
    one of these. When the step sits in a helper with no zeroing (`def update(...): loss.backward();
    opt.step()`), the loop of the same module that calls the helper must zero.

    Gradient accumulation is recognised: `zero_grad` right after a conditional step
    (`if (i + 1) % accum == 0: opt.step(); opt.zero_grad()`), or in the enclosing loop when the step sits
    after (or conditionally inside) the inner microbatch loop. DeepSpeed engines (`engine.step()`, or an
    optimizer returned by `deepspeed.initialize`) zero their own gradients and are not flagged; neither is
    `scheduler.step()` nor `env.step(action)`.

    ## Why it is wrong
    `.backward()` adds into `.grad`. Without zeroing, each update applies the sum of every gradient since
    the start: the effective learning rate grows with the step count and old minibatches keep pushing the
    weights. In training, the loss may fall for a few steps, then `approx_kl` and the gradient norm climb
    step after step and the run diverges (with Adam, more quietly: the update direction is dominated by
    stale gradients).

    ## Example
    ```python
    for mb in minibatches:
        loss = ppo_loss(policy, mb)
        loss.backward()
        optimizer.step()
    ```

    ## Use instead
    ```python
    for mb in minibatches:
        optimizer.zero_grad(set_to_none=True)
        loss = ppo_loss(policy, mb)
        loss.backward()
        optimizer.step()
    ```

    ## Fix
    No automatic fix: where the zeroing belongs (top of the loop, after the step, at an accumulation
    boundary) depends on the intended accumulation, which the code does not say.

    ## Options
    `[tool.rlguard.names]` `optimizer = [...]` adds your own names for optimizers.
    """

    code = "RLG013"
    triggers = r"(?i)opt\w*\s*\.\s*step\s*\(|scaler\.step\s*\("

    VALID = [
        Valid("for batch in loader:\n"
              "    optimizer.zero_grad()\n"
              "    loss = model(batch).mean()\n"
              "    loss.backward()\n"
              "    optimizer.step()\n", "zero_grad at the top of the loop"),
        Valid("for mb in minibatches:\n"
              "    ppo_loss(policy, mb).backward()\n"
              "    self.opt.step()\n"
              "    self.opt.zero_grad(set_to_none=True)\n", "zero_grad right after the step"),
        Valid("for i, mb in enumerate(micro_batches):\n"
              "    (loss_fn(model, mb) / accum).backward()\n"
              "    if (i + 1) % accum == 0:\n"
              "        optimizer.step()\n"
              "        optimizer.zero_grad()\n", "gradient accumulation: zero after the conditional step"),
        Valid("for batch in loader:\n"
              "    optimizer.zero_grad()\n"
              "    for mb in batch.chunk(4):\n"
              "        (loss_fn(mb) / 4).backward()\n"
              "    optimizer.step()\n", "step after the inner accumulation loop; the outer loop zeroes"),
        Valid("for epoch in range(epochs):\n"
              "    for i, mb in enumerate(mbs):\n"
              "        loss_fn(mb).backward()\n"
              "        if i == len(mbs) - 1:\n"
              "            optimizer.step()\n"
              "    optimizer.zero_grad()\n", "conditional step in the inner loop, zeroed by the outer one"),
        Valid("for batch in loader:\n"
              "    model.zero_grad()\n"
              "    model(batch).loss.backward()\n"
              "    optimizer.step()\n", "model.zero_grad() zeroes the same parameters"),
        Valid("for batch in loader:\n"
              "    for p in model.parameters():\n"
              "        p.grad = None\n"
              "    model(batch).loss.backward()\n"
              "    optim.step()\n", "grads reset by hand"),
        Valid("for batch in loader:\n"
              "    loss = engine(batch)\n"
              "    engine.backward(loss)\n"
              "    engine.step()\n"
              "    lr_scheduler.step()\n", "DeepSpeed engine zeroes its own grads; a scheduler is no optimizer"),
        Valid("class Trainer:\n"
              "    def train(self, loader):\n"
              "        opt = self.optimizer\n"
              "        for batch in loader:\n"
              "            self.optimizer.zero_grad()\n"
              "            self.loss(batch).backward()\n"
              "            opt.step()\n", "alias of the same optimizer"),
        Valid("def reset(opt):\n"
              "    opt.zero_grad(set_to_none=True)\n"
              "\n"
              "for batch in loader:\n"
              "    reset(optimizer)\n"
              "    loss_fn(batch).backward()\n"
              "    optimizer.step()\n", "zeroed in a same-module helper"),
        Valid("def update(model, optimizer, batch):\n"
              "    optimizer.zero_grad()\n"
              "    model(batch).loss.backward()\n"
              "    optimizer.step()\n"
              "\n"
              "for batch in loader:\n"
              "    update(model, optimizer, batch)\n", "the helper zeroes before its step"),
        Valid("for batch in loader:\n"
              "    def closure():\n"
              "        optimizer.zero_grad()\n"
              "        loss = loss_fn(model(batch))\n"
              "        loss.backward()\n"
              "        return loss\n"
              "    optimizer.step(closure)\n", "LBFGS closure zeroes"),
        Valid("model_engine, optimizer, _, _ = deepspeed.initialize(model=model, config=cfg)\n"
              "for batch in loader:\n"
              "    model_engine.backward(model_engine(batch))\n"
              "    optimizer.step()\n", "DeepSpeed optimizer"),
        Valid("for batch in loader:\n"
              "    for o in (actor_opt, critic_opt):\n"
              "        o.zero_grad()\n"
              "    loss_fn(batch).backward()\n"
              "    actor_opt.step()\n"
              "    critic_opt.step()\n", "zeroed through a loop over the optimizers"),
        Valid("def hook(param):\n"
              "    for opt in param._in_backward_optimizers:\n"
              "        opt.step()\n"
              "    param.grad = None\n", "a loop over optimizers steps each once"),
        Valid("self.model.optim.zero_grad()\n"
              "for batch in loader:\n"
              "    for _ in range(self.epochs):\n"
              "        self.model.training_step(batch)\n"
              "        self.model.optim.step()\n",
              "a framework training step out of view owns the gradients (it zeroes at its entry)"),
    ]
    INVALID = [
        Invalid("for batch in loader:\n"
                "    loss = model(batch).mean()\n"
                "    loss.backward()\n"
                "    optimizer.step()\n", line=4, why="never zeroed"),
        Invalid("optimizer.zero_grad()\n"
                "for epoch in range(epochs):\n"
                "    loss = compute_loss(model, batch)\n"
                "    loss.backward()\n"
                "    optimizer.step()\n", line=5, why="zeroed once, before the loop"),
        Invalid("class PPO:\n"
                "    def update(self, batches):\n"
                "        for b in batches:\n"
                "            self.critic_opt.zero_grad()\n"
                "            self.loss(b).backward()\n"
                "            self.actor_opt.step()\n", line=6, why="another optimizer is zeroed"),
        Invalid("for step, batch in enumerate(dataloader):\n"
                "    with torch.autocast('cuda'):\n"
                "        loss = model(**batch).loss\n"
                "    scaler.scale(loss).backward()\n"
                "    scaler.step(optimizer)\n"
                "    scaler.update()\n", line=5, why="AMP step, never zeroed"),
        Invalid("for mb in minibatches:\n"
                "    loss = ppo_loss(policy, mb)\n"
                "    loss.backward()\n"
                "    opt.step()\n"
                "opt.zero_grad()\n", line=4, why="zeroed after the loop"),
        Invalid("for epoch in range(ppo_epochs):\n"
                "    optimizer.zero_grad()\n"
                "    for mb in batch.split(64):\n"
                "        loss_fn(mb).backward()\n"
                "        optimizer.step()\n", line=5, why="a step per minibatch, zeroed once per epoch"),
        Invalid("class Trainer:\n"
                "    def train(self):\n"
                "        opt = self.policy_optimizer\n"
                "        while self.step < self.total:\n"
                "            self.value_optimizer.zero_grad()\n"
                "            self.loss().backward()\n"
                "            opt.step()\n", line=7, why="alias of the policy optimizer, value one zeroed"),
        Invalid("def update(model, optimizer, batch):\n"
                "    loss = model(batch).mean()\n"
                "    loss.backward()\n"
                "    optimizer.step()\n"
                "\n"
                "def train(model, optimizer, loader):\n"
                "    for batch in loader:\n"
                "        update(model, optimizer, batch)\n", line=4, why="the helper's caller loops, never zeroes"),
    ]

    def check(self, ctx: Analysis) -> Iterator[Violation]:
        train = training(ctx)
        facts = train.facts
        for zero, acc in A.ungated_module_zeroing(ctx):
            yield Violation(zero, f"`{_text(ctx, zero)}` runs on every microbatch of `{_text(ctx, acc)}`, which "
                                  "gates only the prepared optimizer's step and zero_grad to the synchronising "
                                  "microbatch: the module's own zero_grad wipes the gradients being accumulated, "
                                  "so each update applies only the last microbatch's; zero through the prepared "
                                  "optimizer (`optimizer.zero_grad()`)")
        if not facts.steps:
            return
        megatron = _megatron_classes(ctx, train)
        for call, opt in facts.steps:
            owner = ctx.enclosing_class(call) or ctx.enclosing_function(call)
            if owner is not None and id(owner) in megatron:
                yield Violation(call, f"`{_text(ctx, call)}` follows Megatron's pipeline schedule, whose model "
                                      "chunks accumulate gradients in their own buffers (`main_grad`), and no "
                                      "chunk's buffer is ever zeroed: `optimizer.zero_grad()` does not clear them, "
                                      "so gradients leak into the next update; call `chunk.zero_grad_buffer()` "
                                      "for every model chunk before the next forward-backward")
                continue
            # `for opt in optimizers: opt.step()` steps each optimizer once: that loop is no training loop
            opt_names = _names(opt)
            loops = [loop for loop in ctx.enclosing_loops(call)
                     if not (isinstance(loop, cst.For) and _names(loop.target) & opt_names)]
            if loops:
                if _zeroed_in_loops(ctx, train, call, opt, loops):
                    continue
                yield Violation(call, f"`{_text(ctx, call)}` runs in a loop with no zero_grad for that optimizer "
                                      "between steps, so gradients accumulate across updates; call "
                                      f"`{_text(ctx, opt)}.zero_grad()` before each backward (or after the step)")
                continue
            func = ctx.enclosing_function(call)
            if func is None or any(ctx.contains(func, z.node) and _matches(train, z, opt) for z in facts.zeroing):
                continue
            for site in call_sites(ctx, func):
                site_loops = ctx.enclosing_loops(site)
                if site_loops and not any(ctx.contains(site_loops[0], z.node) for z in facts.zeroing):
                    yield Violation(call, f"`{_text(ctx, call)}` has no zero_grad before it, and "
                                          f"`{func.name.value}()` is called in a loop that does not zero "
                                          "either, so gradients accumulate across updates; call "
                                          f"`{_text(ctx, opt)}.zero_grad()` before the backward")
                    break


def _megatron_classes(ctx: Analysis, train: Training) -> set[int]:
    """Classes (or, outside a class, functions) that run Megatron's schedule with gradients and step an
    optimizer, in a module that never zeroes a model chunk's gradient buffer."""
    if A.zeroes_grad_buffers(ctx):
        return set()
    found = set()
    for func in ctx.nodes(cst.FunctionDef):
        if A.megatron_schedule(ctx, func):
            owner = ctx.enclosing_class(func) or func
            found.add(id(owner))
    return found


def _text(ctx: Analysis, node: cst.CSTNode) -> str:
    return ctx.code(node).strip()


def _zeroed_in_loops(ctx: Analysis, train: Training, call, opt, loops) -> bool:
    zeroing = train.facts.zeroing
    inner = loops[0]
    if any(ctx.contains(inner, z.node) and _matches(train, z, opt) for z in zeroing):
        return True
    conditional = any(isinstance(a, cst.If) for a in _between(ctx, call, inner))
    if conditional:
        return any(ctx.contains(loop, z.node) and _matches(train, z, opt) for loop in loops[1:] for z in zeroing)
    return False


def _between(ctx: Analysis, node: cst.CSTNode, outer: cst.CSTNode):
    for anc in ctx.ancestors(node):
        if anc is outer:
            return
        yield anc


def _matches(train: Training, zero: Zeroing, opt: cst.BaseExpression) -> bool:
    """Whether the zeroing covers ``opt``: every optimizer, one the linter cannot rule out, or the same one."""
    return bool(zero.roots & {ALL, UNKNOWN}) or bool(zero.roots & train.roots(opt))


def _names(expr: cst.CSTNode) -> set[str]:
    """Bare names in a target or a receiver: ``(i, opt)`` -> {i, opt}; ``self.opts[k]`` -> {self, k}."""
    found: set[str] = set()
    stack = [expr]
    while stack:
        node = stack.pop()
        if isinstance(node, cst.Name):
            found.add(node.value)
        elif isinstance(node, cst.Attribute):
            stack.append(node.value)
        else:
            stack.extend(children(node))
    return found
