"""RLG018 train-mode-scoring: a reference / old-policy copy that scores in train mode (dropout on)."""

from __future__ import annotations

from typing import Iterator

from rlguard.catalog import TRAIN_MODE_SCORING
from rlguard.lint.analysis import Analysis
from rlguard.lint.analysis.modes import mode_is_set, scoring_copies, train_mode_scores
from rlguard.lint.rule import Invalid, Rule, Valid, Violation


class TrainModeScoring(Rule):
    """
    ## What it flags
    A model built in view for scoring that the module never puts in eval mode:

    ```python
    ref_model = TinyCausalLM(model.cfg)                  # a module starts in train mode
    ref_model.load_state_dict(model.state_dict())
    ref_model.requires_grad_(False)                      # frozen, but still in train mode
    ```

    The copy is built by a class constructor whose weights are then loaded (`ref = Net(cfg)` and
    `ref.load_state_dict(policy.state_dict())`), or by `copy.deepcopy(model)` of a model visibly in train mode:
    built in view by a class constructor, or put in train mode by `.train()` before the copy in the same function
    (a model handed in may be in eval mode already: `from_pretrained` returns one, so a copy of it is silent). It
    scores: its weights are frozen (`requires_grad_(False)`, `p.requires_grad = False` over its parameters), or it
    runs a forward under `torch.no_grad()`/`inference_mode()` and its weights are those of a model handed in (a test
    that loads one implementation from another, or a target network of a local model, also runs under no_grad); and
    no optimizer trains it. Nothing in the module sets its mode: no `.eval()`, `.train(False)` or other mode method
    on it or an alias (a chain `copy.deepcopy(model).eval()` counts), in the function that builds it or in the
    callers it is returned to (`.train()` puts it in train mode and does not count). The rule is silent when the
    object is handed to code out of view (a wrapper may set its mode), when a deep copy's source has its own mode
    set in the module, and when it is an instance of a class of the module built only of layers without dropout or
    batch statistics (its mode changes nothing). `requires_grad_(False)` does not count: it freezes the weights and
    leaves dropout on.

    The copy may also come from a factory in another file of the linted tree (`ref, _ = init_model(cfg)`): a
    function that builds the module by a class constructor, loads weights into it and returns it (whole or as a
    tuple element) without setting its mode or handing it to code that may; the caller then freezes it or scores
    it under no_grad and never puts it in eval mode. A script folder without `__init__.py` that imports its own
    folder (`from trainer.utils import init_model` in `trainer/train.py`) resolves as a namespace package.

    It also flags a forward, run with autograd off to score (old log-probs, values), of a model the module puts in
    train mode (`.train()`, `set_training_mode(True)`) and never in any other mode: after the update step that sets
    train mode, the next scoring pass runs with dropout on.

    ```python
    class Actor:
        @torch.no_grad()
        def old_logprobs(self, ids):
            return self._logprobs(ids)      # runs self.module(ids): still in the train mode of update()
        def update(self, ids):
            self.module.train()
            ...
    ```

    The forward runs under `torch.no_grad()`/`inference_mode()` itself, or in a same-module helper called there; a
    model attribute bound to what the linter cannot follow (`self.actor, self.opt = strategy.prepare(...)`) is
    known by its attribute. Where the module also sets another mode on the model (`.eval()`, `.train(False)`), or
    on a module that owns it (`self.eval()` for `self.trunk`), it reports only when train mode is where the model
    rests: every function that sets a mode on it ends with `.train()` (an evaluation pass that puts it back, `#
    reset model state`), and neither the function that scores nor a caller in view sets a mode before the forward.
    A function that leaves the model in eval mode (a rollout) silences it: the mode at the forward then depends on
    the order of calls. It is also silent when the
    function that scores puts it in train mode itself before the forward (a deliberate train-mode pass), when the model is handed to a same-module helper that sets a mode, or
    to a call out of view named for one (`set_eval(model)`), when the forward's output is dropped (a pass that
    refreshes batch statistics), and when the model is an instance of a class of the module without dropout or
    batch statistics.

    ## Why it is wrong
    A module in train mode samples its dropout masks (LoRA dropout included) on every forward. Old-policy log-probs
    become noisy, so the PPO ratio is not 1 before the first step and clipping acts on noise; reference log-probs
    differ between two passes over the same tokens, so the KL of the policy to an identical reference is not 0 and
    the penalty pushes the policy around at random.

    ## Example
    ```python
    def make_reference(model):
        ref_model = TinyCausalLM(model.cfg)
        ref_model.load_state_dict(model.state_dict())
        ref_model.requires_grad_(False)
        return ref_model
    ```

    ## Use instead
    ```python
    def make_reference(model):
        ref_model = copy.deepcopy(model).eval()
        ref_model.requires_grad_(False)
        return ref_model
    ```

    ## Runtime state
    Which submodules have dropout, and the mode of a model built out of view, are runtime state. The preflight
    check that scoring forwards under no_grad have every dropout module inactive, and that two scoring passes
    agree, covers models the linter cannot see built.

    ## Fix
    No automatic fix: where the mode belongs (at construction, before each scoring pass) depends on the trainer.

    ## Options
    `[tool.rlguard.names]` `ref-model = [...]` adds your own names for reference models. Silence a deliberate
    choice with `# noqa: RLG018`.
    """

    code = TRAIN_MODE_SCORING
    # stable since 2026-12-07: no FALSE finding on the 49 ecosystem repositories (none at all in validation and
    # holdout), and renaming changes none of its findings; see docs/lint.md, "Stable and preview"
    preview = False
    # a model frozen in a file that builds none itself may come from a factory of another file (returns_module)
    triggers = (r"deepcopy|load_state_dict|\.train\(|requires_grad_\(False\)", r"requires_grad|no_grad|inference_mode")

    VALID = [
        Valid("import copy\n"
              "def make_reference(model):\n"
              "    ref_model = copy.deepcopy(model).eval()\n"
              "    ref_model.requires_grad_(False)\n"
              "    return ref_model\n",
              "deepcopy then eval in one chain", capability="C1", style="functional"),
        Valid("from transformers import AutoModelForCausalLM\n"
              "ref = AutoModelForCausalLM.from_pretrained(name)\n"
              "ref.requires_grad_(False)\n"
              "with torch.no_grad():\n"
              "    ref_logits = ref(ids).logits\n",
              "from_pretrained returns a model in eval mode", capability="C12", style="script"),
        Valid("import copy\n"
              "class Trainer:\n"
              "    def __init__(self, policy):\n"
              "        self.policy = policy\n"
              "        self.ref = copy.deepcopy(policy)\n"
              "        self.ref.requires_grad_(False)\n"
              "    def score(self, ids):\n"
              "        self.ref.eval()\n"
              "        with torch.no_grad():\n"
              "            return self.ref(ids).logits\n",
              "the scoring method puts the reference in eval mode", capability="C3", style="class"),
        Valid("import copy\n"
              "def fit(policy, batches):\n"
              "    old = copy.deepcopy(policy)\n"
              "    opt = torch.optim.AdamW(old.parameters())\n"
              "    for b in batches:\n"
              "        with torch.no_grad():\n"
              "            lp = old(b)\n"
              "        opt.step()\n",
              "a copy that is trained is no scoring copy", capability="C2", style="functional"),
        Valid("class QNet(nn.Module):\n"
              "    def __init__(self, n):\n"
              "        super().__init__()\n"
              "        self.net = nn.Sequential(nn.Linear(n, 64), nn.ReLU(), nn.Linear(64, 2))\n"
              "q = QNet(4)\n"
              "target = QNet(4)\n"
              "target.load_state_dict(q.state_dict())\n"
              "with torch.no_grad():\n"
              "    nxt = target(obs).max(-1).values\n",
              "a target network of a module class without dropout: its mode changes nothing", capability="FP",
              style="script"),
        Valid("import copy\n"
              "def build(policy, accelerator):\n"
              "    ref = copy.deepcopy(policy)\n"
              "    ref.requires_grad_(False)\n"
              "    return accelerator.prepare_model(ref, evaluation_mode=True)\n",
              "handed to a wrapper out of view that may set its mode", capability="C12", style="framework"),
        Valid("import copy\n"
              "def make_ref(model):\n"
              "    ref = copy.deepcopy(model)\n"
              "    ref.requires_grad_(False)\n"
              "    return ref\n"
              "def setup(model):\n"
              "    ref = make_ref(model)\n"
              "    ref.eval()\n"
              "    return ref\n",
              "the caller the copy is returned to puts it in eval mode", capability="C5", style="functional"),
        Valid("policy = Policy(cfg)\n"
              "policy.load_state_dict(torch.load(path))\n"
              "opt = torch.optim.Adam(policy.parameters())\n",
              "a policy loaded from a checkpoint and trained", capability="C2", style="script"),
        Valid("import copy\n"
              "def make_ref_model(model, device):\n"
              "    ref_model = copy.deepcopy(model).to(device)\n"
              "    ref_model.requires_grad_(False)\n"
              "    return ref_model\n",
              "a copy of a model handed in: its mode (eval after from_pretrained) is not known here",
              capability="FP", style="functional"),
        Valid("def test_equivalent(x):\n"
              "    a = LSTMCell(10, 20)\n"
              "    b = nn.LSTMCell(10, 20)\n"
              "    a.load_state_dict(b.state_dict())\n"
              "    with torch.no_grad():\n"
              "        assert torch.allclose(a(x)[0], b(x)[0])\n",
              "a test comparing two implementations: no scoring copy", capability="FP", style="script"),
        Valid("import copy\n"
              "def make_ref(model):\n"
              "    ref = copy.deepcopy(model)\n"
              "    ref.train(False)\n"
              "    for p in ref.parameters():\n"
              "        p.requires_grad = False\n"
              "    return ref\n",
              "train(False) is eval mode", capability="C1", style="functional"),
        Valid("class Actor:\n"
              "    def __init__(self, module, optimizer):\n"
              "        self.module = module\n"
              "        self.optimizer = optimizer\n"
              "    def _logprobs(self, ids):\n"
              "        return self.module(ids).logits.log_softmax(-1)\n"
              "    @torch.no_grad()\n"
              "    def old_logprobs(self, ids):\n"
              "        self.module.eval()\n"
              "        return self._logprobs(ids)\n"
              "    def update(self, ids):\n"
              "        self.module.train()\n"
              "        (-self._logprobs(ids).mean()).backward()\n"
              "        self.optimizer.step()\n",
              "the scoring method puts the trained module in eval mode first", capability="C3", style="class"),
        Valid("def recalibrate(model, loader):\n"
              "    model.train()\n"
              "    with torch.no_grad():\n"
              "        for x in loader:\n"
              "            model(x)\n",
              "a forward in train mode whose output is dropped refreshes batch statistics: no scoring",
              capability="FP", style="functional"),
        Valid("class Agent(nn.Module):\n"
              "    def __init__(self):\n"
              "        super().__init__()\n"
              "        self.pi = nn.Sequential(nn.Linear(4, 64), nn.Tanh(), nn.Linear(64, 2))\n"
              "    def forward(self, obs):\n"
              "        return self.pi(obs)\n"
              "agent = Agent()\n"
              "for step in range(100):\n"
              "    with torch.no_grad():\n"
              "        logits = agent(obs)\n"
              "    agent.train()\n"
              "    update(agent, logits)\n",
              "a module class of the file without dropout: its mode changes nothing", capability="FP", style="script"),
        Valid("def to_eval(m):\n"
              "    m.train(False)\n"
              "def fit(policy, opt, ids):\n"
              "    policy.train()\n"
              "    policy(ids).loss.backward()\n"
              "    opt.step()\n"
              "def score(policy, ids):\n"
              "    to_eval(policy)\n"
              "    with torch.no_grad():\n"
              "        return policy(ids).logits\n",
              "a helper of the module sets the scoring mode", capability="C5", style="functional"),
        Valid("class Discriminator(nn.Module):\n"
              "    def __init__(self, trunk, optimizer):\n"
              "        super().__init__()\n"
              "        self.trunk = trunk\n"
              "        self.optimizer = optimizer\n"
              "    def update(self, x, y):\n"
              "        self.trunk.train()\n"
              "        loss_fn(self.trunk(x), y).backward()\n"
              "        self.optimizer.step()\n"
              "    def predict(self, x):\n"
              "        with torch.no_grad():\n"
              "            self.eval()\n"
              "            return self.trunk(x).sigmoid()\n",
              "eval() on the module that owns the submodule sets the submodule's mode", capability="C3",
              style="class"),
        Valid("def test_patched_forward_matches(model, ids):\n"
              "    model.train()\n"
              "    with torch.no_grad():\n"
              "        expected = model(ids).logits\n"
              "    patch_attention()\n"
              "    got = model(ids).logits\n"
              "    assert torch.allclose(expected, got)\n",
              "the function puts the model in train mode itself right before: a deliberate train-mode pass",
              capability="FP", style="script"),
        Valid("class PolicyWorker:\n"
              "    def forward(self, seqs):\n"
              "        with torch.no_grad():\n"
              "            logp = self.actor(seqs)\n"
              "        self.actor.train()\n"
              "        return logp\n"
              "    def rollout(self, prompts):\n"
              "        self.actor.eval()\n"
              "        return self.actor.generate(prompts)\n",
              why="the rollout leaves the actor in eval mode: its mode at the scoring forward depends on the order of "
                  "calls", capability="C8", style="framework"),
        Valid("class PolicyWorker:\n"
              "    def _score(self, seqs):\n"
              "        with torch.no_grad():\n"
              "            logp = self.actor(seqs)\n"
              "        self.actor.train()\n"
              "        return logp\n"
              "    def make_experience(self, seqs):\n"
              "        self.actor.eval()\n"
              "        return self._score(seqs)\n",
              why="the only caller puts the actor in eval mode before it calls the scoring function",
              capability="C8", style="framework"),
        Valid("class PolicyWorker:\n"
              "    def forward(self, seqs):\n"
              "        self.actor.eval()\n"
              "        with torch.no_grad():\n"
              "            logp = self.actor(seqs)\n"
              "        self.actor.train()  # reset model state\n"
              "        return logp\n",
              why="eval before scoring, train after: correct", capability="C8", style="framework"),
    ]

    INVALID = [
        Invalid("from rlguard.reference.model import TinyCausalLM\n"
                "def make_reference(model):\n"
                "    ref_model = TinyCausalLM(model.cfg)\n"
                "    ref_model.load_state_dict(model.state_dict())\n"
                "    ref_model.requires_grad_(False)\n"
                "    return ref_model\n", line=3,
                why="rebuilt by its constructor (train mode), weights loaded, frozen, never eval", capability="C1",
                style="functional"),
        Invalid("import copy\n"
                "def make_reference(cfg):\n"
                "    policy = PolicyNet(cfg)\n"
                "    ref_model = copy.deepcopy(policy)\n"
                "    ref_model.requires_grad_(False)\n"
                "    return policy, ref_model\n", line=4,
                why="a deep copy of a module just built (train mode), frozen", capability="C1", style="functional"),
        Invalid("import copy\n"
                "class PPOTrainer:\n"
                "    def __init__(self, actor):\n"
                "        self.actor = actor\n"
                "        self.actor.train()\n"
                "        self.old_actor = copy.deepcopy(self.actor)\n"
                "    def old_logprobs(self, ids):\n"
                "        with torch.no_grad():\n"
                "            return self.old_actor(ids).logits.log_softmax(-1)\n", line=6,
                why="a copy of the actor after .train(), scored under no_grad in another method", capability="C3",
                style="class"),
        Invalid("from copy import deepcopy\n"
                "policy = Policy(cfg).to(device)\n"
                "ref = deepcopy(policy).to(device)\n"
                "for p in ref.parameters():\n"
                "    p.requires_grad = False\n", line=3,
                why="from-import, a .to() chain, frozen by a parameter loop", capability="C1", style="script"),
        Invalid("class Net(nn.Module):\n"
                "    def __init__(self, d):\n"
                "        super().__init__()\n"
                "        self.body = nn.Sequential(nn.Linear(d, d), nn.Dropout(0.1))\n"
                "def step(policy, obs):\n"
                "    ref = Net(64)\n"
                "    ref.load_state_dict(policy.state_dict())\n"
                "    with torch.inference_mode():\n"
                "        return ref(obs)\n", line=6,
                why="a module class with dropout, the weights of a policy handed in, scored under inference_mode",
                capability="C12", style="functional"),
        Invalid("def make_ref(model):\n"
                "    ref = Model(model.config)\n"
                "    ref.load_state_dict(model.state_dict())\n"
                "    ref.requires_grad_(False)\n"
                "    return ref\n"
                "def setup(model):\n"
                "    ref = make_ref(model)\n"
                "    ref.train()\n"
                "    return ref\n", line=2,
                why="the caller puts it in train mode explicitly: still never eval", capability="C5",
                style="functional"),
        Invalid("import copy\n"
                "class Worker:\n"
                "    def init_model(self, cfg):\n"
                "        self.actor_module.train()\n"
                "        self.ref_module = copy.deepcopy(self.actor_module)\n"
                "        self.ref_module.requires_grad_(False)\n", line=5,
                why="stored on self, frozen, copied after train()", capability="C8", style="framework"),
        Invalid("class Actor:\n"
                "    def __init__(self, module, optimizer):\n"
                "        self.module = module\n"
                "        self.optimizer = optimizer\n"
                "    def _logprobs(self, ids):\n"
                "        return self.module(ids).logits.log_softmax(-1)\n"
                "    @torch.no_grad()\n"
                "    def old_logprobs(self, ids):\n"
                "        return self._logprobs(ids)\n"
                "    def update(self, ids):\n"
                "        self.module.train()\n"
                "        (-self._logprobs(ids).mean()).backward()\n"
                "        self.optimizer.step()\n", line=9,
                why="the update puts the module in train mode; the old log-probs are scored by a helper under "
                    "no_grad, never in eval mode", capability="C3", style="class"),
        Invalid("def fit(policy, opt, loader):\n"
                "    for batch in loader:\n"
                "        with torch.no_grad():\n"
                "            old = policy(batch).log_softmax(-1)\n"
                "        policy.train()\n"
                "        loss_fn(policy(batch), old).backward()\n"
                "        opt.step()\n", line=4,
                why="from the second batch on, the old log-probs are scored in the train mode the update set",
                capability="C4", style="functional"),
        Invalid("class Worker:\n"
                "    def setup(self, strategy, model):\n"
                "        self.model, self.opt = strategy.prepare(model)\n"
                "    def fit(self):\n"
                "        self.model.train()\n"
                "    def values(self, ids):\n"
                "        with torch.inference_mode():\n"
                "            v = self.model(ids)\n"
                "        return v\n", line=8,
                why="an attribute bound out of view, put in train mode in one method, scored in another",
                capability="C8", style="framework"),
        Invalid("class PolicyWorker:\n"
                "    def init(self, model):\n"
                "        self.actor = model\n"
                "    def forward(self, seqs, mask):\n"
                "        with torch.no_grad():\n"
                "            logp = self.actor(seqs, mask)\n"
                "        self.actor.train()  # reset model state\n"
                "        return logp.cpu()\n"
                "    def evaluate(self, loader):\n"
                "        self.actor.eval()\n"
                "        with torch.no_grad():\n"
                "            scores = [self.actor(b) for b in loader]\n"
                "        self.actor.train()\n"
                "        return scores\n", line=6,
                why="the evaluation pass puts the actor back in train mode, so it rests there; the scoring forward "
                    "sets no mode", capability="C8", style="framework"),
        Invalid("class PolicyWorker:\n"
                "    def fit(self, batch):\n"
                "        self.model.train()\n"
                "        self.model(batch).loss.backward()\n"
                "    def evaluate(self, loader):\n"
                "        self.model.eval()\n"
                "        out = [self.model(b) for b in loader]\n"
                "        self.model.train()\n"
                "        return out\n"
                "    @torch.no_grad()\n"
                "    def old_logprobs(self, ids):\n"
                "        return self.model(ids).logits.log_softmax(-1)\n", line=12,
                why="renamed spelling: every function that sets a mode ends in train mode", capability="C8",
                style="framework"),
    ]

    def check(self, ctx: Analysis) -> Iterator[Violation]:
        for copy in scoring_copies(ctx):
            if mode_is_set(ctx, copy):
                continue
            name = copy.d.key
            built = "copies its source's train mode" if copy.how == "deepcopy" else \
                "is built by its constructor, which starts it in train mode" if copy.how == "constructor" else \
                f"is built by `{ctx.call_name(copy.call) or 'its factory'}`, which constructs it (train mode) and " \
                f"returns it without a mode"
            use = "its weights are frozen for scoring" if copy.evidence == "frozen" else \
                "it scores under no_grad"
            yield Violation(copy.call, f"`{name}` {built} and is never put in eval mode, yet {use}: its dropout "
                                       f"stays on, so its log-probs are noisy (the ratio is not 1 before a step, the "
                                       f"KL to an identical reference is not 0); call `{name}.eval()`")
        for score in train_mode_scores(ctx):
            name = score.name
            if score.resting:
                yield Violation(score.site, f"`{name}` scores here with autograd off, and no mode is set for this "
                                            f"forward while every function that sets one leaves it in train mode "
                                            f"(`{ctx.code(score.train)}`): after the first update it scores with "
                                            f"dropout on, so the log-probs or values it gives are noisy (the ratio is "
                                            f"not 1 before a step); call `{name}.eval()` before scoring")
                continue
            yield Violation(score.site, f"`{name}` is put in train mode (`.train()`) and never in eval mode in this "
                                        f"module, yet it scores here with autograd off: its dropout stays on, so the "
                                        f"log-probs or values it gives are noisy (the ratio is not 1 before a step); "
                                        f"call `{name}.eval()` before scoring")
