"""RLG013 grad-not-zeroed: ``optimizer.step()`` in a loop with no ``zero_grad`` between steps."""

from __future__ import annotations

from typing import Iterator

import libcst as cst

from rlguard.catalog import GRAD_NOT_ZEROED
from rlguard.lint.analysis.index import children, key_of

from rlguard.lint.analysis import Analysis
from rlguard.lint.analysis import accumulation as A
from rlguard.lint.analysis import semantics as S
from rlguard.lint.analysis.callers import caller_loops
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
    opt.step()`), the loop of the same module that calls the helper (directly, or through other helpers of the
    module) must zero.

    Also flagged, from library semantics visible in the module: a module's own `model.zero_grad()` run on
    every iteration of a loop that accumulates through `with accelerator.accumulate(model):` (the context gates
    only the prepared optimizer's `step` and `zero_grad` to the synchronising microbatch, so the module's
    zeroing wipes what is being accumulated); and an optimizer step after Megatron's pipeline schedule
    (`get_forward_backward_func()`) in a module that builds Megatron's `DistributedDataParallel` (or its
    config, or `get_megatron_optimizer` over the chunks) and never calls a model chunk's `zero_grad_buffer()`
    (Megatron's DDP chunks keep gradients in their own buffers, which `optimizer.zero_grad()` does not clear; a
    module that only runs the schedule on models and optimizers set up elsewhere is left alone, as their owner
    may free and rebuild the buffers).
    `accelerator.accumulate(model)` with `optimizer.zero_grad()` on every iteration is correct when the
    optimizer went through `accelerator.prepare`, and is not flagged.

    Gradient accumulation is recognised: `zero_grad` right after a conditional step
    (`if (i + 1) % accum == 0: opt.step(); opt.zero_grad()`), or in the enclosing loop when the step sits
    after the inner microbatch loop or inside it under a condition that holds once per pass (`if i == n - 1:`);
    a step under a remainder condition (`if n % accum == 0:`) fires many times in its loop, so that loop must
    zero the gradients itself. DeepSpeed engines (`engine.step()`, or an
    optimizer returned by `deepspeed.initialize`) zero their own gradients and are not flagged; neither is
    `scheduler.step()` nor `env.step(action)`. An optimizer is known by how it is built (`optim.Adam(...)`,
    `make_optimizer(...)`), whatever its variable is called, or else by its name. A `step(value)` with a
    positional value that is no closure (`optim.step(loss)`) is another API's step, a wrapper that backpropagates,
    steps and zeroes itself: torch's `Optimizer.step` takes only a closure. A loop in which no gradient is made
    (no backward in view or in a helper that runs one, no call whose name says it backpropagates, no read of
    `.grad` or `clip_grad_*`) has nothing to accumulate, and an optimizer built anew in each iteration steps once:
    neither is flagged.

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

    ## Runtime state
    Whether an optimizer was prepared by the accumulation wrapper, and which buffers a distributed model
    keeps its gradients in, is runtime state. The runtime check that gradients are zero or None before each
    update's first backward, and the accumulation preflight check (the accumulated gradient equals the
    one-pass gradient), cover what the linter cannot see.

    ## Fix
    No automatic fix: where the zeroing belongs (top of the loop, after the step, at an accumulation
    boundary) depends on the intended accumulation, which the code does not say.

    ## Options
    `[tool.rlguard.names]` `optimizer = [...]` adds your own names for optimizers.
    """

    code = GRAD_NOT_ZEROED
    # stable since the ecosystem check shows no FALSE finding of it (the two classes it had, wrappers' step(loss) and
    # steps with no backward between them, are read from the code now) and renaming changes none of its findings
    # any argument-free `.step()`: the optimizer is known by how it is built, whatever its variable is called
    triggers = r"\.\s*step\s*\(\s*\)|scaler\.step\s*\("

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
              "    update(model, optimizer, batch)\n", "the helper zeroes before its step",
              capability="C5", style="functional"),
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
        Valid("class Tuner:\n"
              "    def fit(self, loader):\n"
              "        for batch in loader:\n"
              "            with self.accelerator.accumulate(self.model):\n"
              "                loss = self.loss_fn(batch)\n"
              "                self.accelerator.backward(loss)\n"
              "                self.optimizer.step()\n"
              "                self.optimizer.zero_grad()\n",
              "the prepared optimizer's zero_grad is gated by the accumulation context", capability="C12",
              style="class"),
        Valid("def train(accelerator, net, opt, loader):\n"
              "    for batch in loader:\n"
              "        with accelerator.accumulate(net):\n"
              "            accelerator.backward(net(batch).loss)\n"
              "            if accelerator.sync_gradients:\n"
              "                opt.step()\n"
              "                net.zero_grad()\n",
              "the module is zeroed only on the synchronising microbatch", capability="C12",
              style="functional"),
        Valid("from megatron.core.distributed import DistributedDataParallel\n"
              "from megatron.core.pipeline_parallel import get_forward_backward_func\n"
              "\n"
              "class Engine:\n"
              "    def __init__(self, cfg, ddp_cfg, chunks, optimizer):\n"
              "        self.model = [DistributedDataParallel(cfg, ddp_cfg, c) for c in chunks]\n"
              "        self.optimizer = optimizer\n"
              "\n"
              "    def train_batch(self, data):\n"
              "        for chunk in self.model:\n"
              "            chunk.zero_grad_buffer()\n"
              "        self.optimizer.zero_grad()\n"
              "        run = get_forward_backward_func()\n"
              "        run(forward_step_func=self.step_fn, data_iterator=iter(data), model=self.model,\n"
              "            num_microbatches=len(data), seq_length=1, micro_batch_size=1, forward_only=False)\n"
              "        self.optimizer.step()\n",
              "every model chunk's gradient buffer is zeroed before the schedule", capability="C12",
              style="framework"),
        Valid("class Agent:\n"
              "    def learn(self, b):\n"
              "        self.loss(b).backward()\n"
              "        self.opt.step()\n"
              "\n"
              "    def run(self, batches):\n"
              "        for b in batches:\n"
              "            self.opt.zero_grad()\n"
              "            self.learn(b)\n",
              "the caller's loop zeroes before each call of the stepping helper", capability="C5",
              style="class"),
        Valid("def upd(b):\n"
              "    opt.zero_grad(); L(b).backward(); opt.step()\n"
              "\n"
              "for b in dl:\n"
              "    upd(b)\n", "the helper zeroes before its own step", capability="C5", style="script"),
        Valid("class Runner:\n"
              "    def _apply(self, batch):\n"
              "        self.model(**batch['inputs']).loss.backward()\n"
              "        self.optimizer.step()\n"
              "\n"
              "    def _one_batch(self, batch):\n"
              "        self.optimizer.zero_grad(set_to_none=True)\n"
              "        self._apply(batch)\n"
              "\n"
              "    def run(self, loader):\n"
              "        for batch in loader:\n"
              "            self._one_batch(batch)\n",
              "the intermediate helper zeroes before the stepping one", capability="C5", style="framework"),
        Valid("class Learner:\n"
              "    def __init__(self, pi, vf):\n"
              "        self.pi_optim = torch.optim.Adam(pi.parameters())\n"
              "        self.vf_optim = torch.optim.Adam(vf.parameters())\n"
              "\n"
              "    def _clear_grads(self):\n"
              "        self.pi_optim.zero_grad()\n"
              "        self.vf_optim.zero_grad()\n"
              "\n"
              "    def train(self, data):\n"
              "        for d in data:\n"
              "            self._clear_grads()\n"
              "            self.objective(d).backward()\n"
              "            self.pi_optim.step()\n"
              "            self.vf_optim.step()\n",
              "a method zeroes both optimizers built in __init__: its effect names the same objects the steps use",
              capability="C1", style="class"),
        Valid("class A2C:\n"
              "    def update(self, batches):\n"
              "        for b in batches:\n"
              "            loss = self.loss(b)\n"
              "            self.optim.step(loss)\n",
              "a wrapper's step(loss) backpropagates, steps and zeroes itself: torch's step takes no value",
              capability="FP", style="class"),
        Valid("def main(cfg, loss_fn, data):\n"
              "    optimizer, lr_scheduler = make_optimizer(cfg.train, loss_fn)\n"
              "    for b in data:\n"
              "        optimizer.zero_grad()\n"
              "        loss_fn(b).backward()\n"
              "        optimizer.step()\n"
              "        lr_scheduler.step()\n",
              "the second element a factory returns beside the optimizer is no optimizer", capability="FP",
              style="script"),
        Valid("def check(model, x, n):\n"
              "    for _ in range(n):\n"
              "        model(x).sum().backward()\n"
              "        opt = optim.SGD(model.parameters(), lr=0.01)\n"
              "        opt.step()\n",
              "a new optimizer each iteration steps once: no optimizer of the loop steps twice", capability="FP",
              style="script"),
        Valid("def test_scheduler():\n"
              "    opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
              "    sched = make_scheduler(opt)\n"
              "    for _ in range(10):\n"
              "        opt.step()\n"
              "        sched.step()\n",
              "no backward between the steps: there are no gradients to accumulate", capability="FP",
              style="script"),
        Valid("def train(model, opt, loader):\n"
              "    for batch in loader:\n"
              "        opt.zero_grad()\n"
              "        for i, mb in enumerate(batch):\n"
              "            model(mb).mean().backward()\n"
              "            if i == len(batch) - 1:\n"
              "                opt.step()\n",
              "one gated step per inner loop, zeroed in the outer loop", capability="C9", style="script"),
    ]
    INVALID = [
        Invalid("def train(model, opt, loader, accum):\n"
                "    n = 0\n"
                "    for batch in loader:\n"
                "        for mb in batch:\n"
                "            model(mb).mean().backward()\n"
                "            n += 1\n"
                "            if n % accum == 0:\n"
                "                opt.step()\n"
                "        if n % accum != 0:\n"
                "            opt.step()\n"
                "            opt.zero_grad()\n", line=8,
                why="a step every accum microbatches inside the inner loop, zeroed only after it: the inner loop's "
                    "steps share their gradients", capability="C9", style="script"),
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
                "        update(model, optimizer, batch)\n", line=4, why="the helper's caller loops, never zeroes",
                capability="C5", style="functional"),
        Invalid("class Tuner:\n"
                "    def fit(self, loader):\n"
                "        for batch in loader:\n"
                "            with self.accelerator.accumulate(self.model):\n"
                "                loss = self.loss_fn(batch)\n"
                "                self.accelerator.backward(loss)\n"
                "                self.optimizer.step()\n"
                "                self.model.zero_grad(set_to_none=True)\n", line=8,
                why="the module's zero_grad is not gated: it wipes the accumulated gradients", capability="C12",
                style="class"),
        Invalid("for b in dl:\n"
                "    with acc.accumulate(net):\n"
                "        acc.backward(net(b).loss)\n"
                "        opt.step()\n"
                "    net.zero_grad()\n", line=5,
                why="zeroing the wrapped module after the context, on every microbatch", capability="C12",
                style="script"),
        Invalid("from megatron.core.distributed import DistributedDataParallel\n"
                "from megatron.core.pipeline_parallel import get_forward_backward_func\n"
                "\n"
                "class Engine:\n"
                "    def __init__(self, cfg, ddp_cfg, chunks, optimizer):\n"
                "        self.model = [DistributedDataParallel(cfg, ddp_cfg, c) for c in chunks]\n"
                "        self.optimizer = optimizer\n"
                "\n"
                "    def train_batch(self, data):\n"
                "        run = get_forward_backward_func()\n"
                "        run(forward_step_func=self.step_fn, data_iterator=iter(data), model=self.model,\n"
                "            num_microbatches=len(data), seq_length=1, micro_batch_size=1, forward_only=False)\n"
                "        self.optimizer.step()\n"
                "        self.optimizer.zero_grad()\n", line=13,
                why="Megatron chunks keep gradients in buffers optimizer.zero_grad() does not clear",
                capability="C12", style="framework"),
        Invalid("class Agent:\n"
                "    def learn(self, b):\n"
                "        self.loss(b).backward()\n"
                "        self.opt.step()\n"
                "\n"
                "    def run(self, batches):\n"
                "        for b in batches:\n"
                "            self.learn(b)\n", line=4,
                why="the stepping method's only caller loops without zeroing", capability="C5", style="class"),
        Invalid("def upd(b):\n"
                "    L(b).backward(); opt.step()\n"
                "\n"
                "for b in dl:\n"
                "    upd(b)\n", line=2, why="a terse helper stepped from a loop that never zeroes",
                capability="C5", style="script"),
        Invalid("class Runner:\n"
                "    def _apply(self, batch):\n"
                "        self.model(**batch['inputs']).loss.backward()\n"
                "        self.optimizer.step()\n"
                "\n"
                "    def _one_batch(self, batch):\n"
                "        batch = {k: v.to(self.cfg.device) for k, v in batch.items()}\n"
                "        self._apply(batch)\n"
                "\n"
                "    def run(self, loader):\n"
                "        for batch in loader:\n"
                "            self._one_batch(batch)\n", line=4,
                why="called only through another helper, from a loop that never zeroes", capability="C5",
                style="framework"),
        Invalid("import torch.optim as optim\n\n"
                "class PPO:\n"
                "    def __init__(self, ac, lr):\n"
                "        self.a1 = ac\n"
                "        self.a2 = optim.Adam(ac.parameters(), lr=lr)\n\n"
                "    def update(self, batches):\n"
                "        for b in batches:\n"
                "            self.a1(b).mean().backward()\n"
                "            self.a2.step()\n", line=11,
                why="an optimizer by its construction (`optim.Adam(...)`), whatever the attribute is called",
                capability="C2", style="class"),
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
            if loops and _built_in(ctx, opt, loops[0]):
                continue  # a fresh optimizer each iteration (a numerical check's `SGD(params).step()`): one step each
            if loops:
                if _zeroed_in_loops(ctx, train, call, opt, loops) or not _backpropagates(ctx, train, loops[-1]):
                    continue  # zeroed, or no gradient is made between the steps (a scheduler test's steps)
                yield Violation(call, f"`{_text(ctx, call)}` runs in a loop with no zero_grad for that optimizer "
                                      "between steps, so gradients accumulate across updates; call "
                                      f"`{_text(ctx, opt)}.zero_grad()` before each backward (or after the step)")
                continue
            func = ctx.enclosing_function(call)
            if func is None or any(ctx.contains(func, z.node) and _matches(train, z, opt) for z in facts.zeroing):
                continue
            sites = call_sites(ctx, func)
            for site in sites:
                site_loops = ctx.enclosing_loops(site)
                if site_loops and not any(ctx.contains(site_loops[0], z.node) for z in facts.zeroing):
                    yield Violation(call, f"`{_text(ctx, call)}` has no zero_grad before it, and "
                                          f"`{func.name.value}()` is called in a loop that does not zero "
                                          "either, so gradients accumulate across updates; call "
                                          f"`{_text(ctx, opt)}.zero_grad()` before the backward")
                    break
            else:
                if sites and not any(ctx.enclosing_loops(site) for site in sites):
                    # called only through other helpers: the loops around every outermost call (C5)
                    chain = caller_loops(ctx, func, lambda loop: True)
                    for site, loop in chain or ():
                        if any(ctx.contains(loop, z.node) for z in facts.zeroing):
                            continue
                        yield Violation(call, f"`{_text(ctx, call)}` has no zero_grad before it, and every call "
                                              f"of `{func.name.value}()` comes, through other helpers, from a loop "
                                              "that does not zero either, so gradients accumulate across "
                                              f"updates; call `{_text(ctx, opt)}.zero_grad()` before the backward")
                        break


def _megatron_classes(ctx: Analysis, train: Training) -> set[int]:
    """Classes (or, outside a class, functions) that run Megatron's schedule with gradients and step an
    optimizer, in a module that builds Megatron's data-parallel wrapper or optimizer (the buffers' owner) and
    never zeroes a model chunk's gradient buffer."""
    if A.zeroes_grad_buffers(ctx) or not A.configures_megatron_ddp(ctx):
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
    gates = [a for a in _between(ctx, call, inner) if isinstance(a, cst.If)]
    if gates and not any(_periodic(a.test) for a in gates):
        # a step gated once per inner loop (`if i == len(mbs) - 1:`): zeroing in an outer loop separates the steps;
        # a periodic gate (`if n % accum == 0:`) fires many times in the inner loop, which must zero itself
        return any(ctx.contains(loop, z.node) and _matches(train, z, opt) for loop in loops[1:] for z in zeroing)
    return False


def _periodic(test: cst.BaseExpression) -> bool:
    """A condition that holds every N-th time: it compares a remainder (``(i + 1) % accum == 0``)."""
    stack = [test]
    while stack:
        node = stack.pop()
        if isinstance(node, cst.BinaryOperation) and isinstance(node.operator, cst.Modulo):
            return True
        if isinstance(node, (cst.Comparison, cst.BooleanOperation, cst.UnaryOperation, cst.BinaryOperation)):
            stack.extend(children(node))
        elif isinstance(node, cst.ComparisonTarget):
            stack.append(node.comparator)
    return False


def _built_in(ctx: Analysis, opt: cst.BaseExpression, loop: cst.CSTNode) -> bool:
    """Whether every definition of ``opt`` reaching the step lies inside ``loop``: the object is new each time."""
    key = key_of(opt)
    defs = ctx.flow.reaching(key, opt) if key is not None else []
    return bool(defs) and all(d.kind == "assign" and ctx.contains(loop, d.stmt) for d in defs)


def _backpropagates(ctx: Analysis, train: Training, loop: cst.CSTNode, depth: int = 2) -> bool:
    """Whether gradients are made inside ``loop``: a backward call in it; a call in it into a function that runs
    one (of this module, followed ``depth`` calls deep, or of another file of the tree, by its summary); a call out
    of view whose interface says it backpropagates (``parts.minibatch_backward(...)``); or gradients read
    (``p.grad``, ``clip_grad_norm_``), which only exist where something made them."""
    if any(ctx.contains(loop, b) for b in train.facts.backwards):
        return True
    if any(node.attr.value == "grad" for node in ctx.index.descendants(loop, cst.Attribute)):
        return True
    for call in ctx.index.descendants(loop, cst.Call):
        called = S.called_name(call) or ""
        if "backward" in called.lower() or called.startswith("clip_grad"):
            return True
        func = ctx.callee(call)
        if func is not None:
            if depth > 0 and _backpropagates(ctx, train, func, depth - 1):
                return True
            continue
        summary = ctx.summary_of_call(call)
        if summary is not None and summary.backward:
            return True
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
