"""RLG003 detached-targets: old/reference log-probs, advantages or returns computed with autograd on."""

from __future__ import annotations

import re
from typing import Iterator

import libcst as cst

from rlguard.catalog import DETACHED_TARGETS
from rlguard.lint.analysis import Analysis, dotted_name
from rlguard.lint.analysis import semantics as S
from rlguard.lint.analysis.index import Def
from rlguard.lint.analysis.provenance import forwards_of_def, models
from rlguard.lint.analysis.semantics import CROSS_ENTROPY, GATHER, LOG_SOFTMAX, LOGPROB_HELPER
from rlguard.lint.analysis.roles import hinted_role, in_model_code, is_backpropagated, target_role_by_use
from rlguard.lint.analysis.uses import reads_of
from rlguard.lint.rule import Invalid, Rule, Valid, Violation

LOGP_WORD = re.compile(r"(?i)log_?probs?|logps?|logprobs?")
WHAT = {"old_logp": "old log-probs", "ref_logp": "reference log-probs", "advantages": "advantages",
        "returns": "returns"}


# a DPO step against a deep copy of the trained model ({frozen}: a freezing call on the copy; {extra}: a line after it)
_DEEP_COPY_REFERENCE = (
    "import copy\n"
    "\n"
    "def train(model, batches, beta):\n"
    "    opt = torch.optim.Adam(model.parameters())\n"
    "    twin = copy.deepcopy(model).eval(){frozen}\n"
    "{extra}    for ids, labels in batches:\n"
    "        a = -F.cross_entropy(twin(ids).logits[:, :-1].transpose(1, 2), labels, reduction=\"none\").sum(-1)\n"
    "        b = -F.cross_entropy(model(ids).logits[:, :-1].transpose(1, 2), labels, reduction=\"none\").sum(-1)\n"
    "        loss = -F.logsigmoid(beta * (b - a)).mean()\n"
    "        opt.zero_grad()\n"
    "        loss.backward()\n"
    "        opt.step()\n"
)


# a trainer whose reference TRL's create_reference_model makes ({made}: the line that makes it)
_REFERENCE_FROM_TRL = (
    "from trl import create_reference_model\n"
    "\n"
    "class Trainer:\n"
    "    def __init__(self, model, beta):\n"
    "        self.model = model\n"
    "{made}\n"
    "    def sequence_logps(self, model, ids):\n"
    "        logits = model(ids).logits[:, :-1]\n"
    "        return torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1).sum(-1)\n"
    "\n"
    "    def prepare(self, ids):\n"
    "        ref_logps = self.sequence_logps(self.ref_model, ids)\n"
    "        return {{\"input_ids\": ids, \"ref_logps\": ref_logps}}\n"
)


# a script that builds its reference and hands it to train_epoch ({built}: how the script prepares it)
_FROZEN_BY_CALLER = (
    "def train_epoch(model, ref_model, batches, opt, beta):\n"
    "    for ids in batches:\n"
    "        logits = model(ids).logits[:, :-1]\n"
    "        logp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)\n"
    "        ref_logits = ref_model(ids).logits[:, :-1]\n"
    "        ref_logp = torch.log_softmax(ref_logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)\n"
    "        loss = -logp.mean() + beta * (logp - ref_logp).mean()\n"
    "        opt.zero_grad()\n"
    "        loss.backward()\n"
    "        opt.step()\n"
    "\n"
    "ref = build_model()\n"
    "{built}policy = build_model()\n"
    "opt = torch.optim.AdamW(policy.parameters())\n"
    "train_epoch(policy, ref, loader, opt, 0.1)\n"
)


# a PPO step whose old log-probs are computed once with autograd on ({ratio}: the ratio line)
_CLIPPED_OLD = (
    "class Trainer:\n"
    "    def __init__(self, model, eps):\n"
    "        self.model = model\n"
    "        self.opt = torch.optim.Adam(model.parameters())\n"
    "        self.eps = eps\n"
    "\n"
    "    def logps(self, ids):\n"
    "        logits = self.model(ids).logits[:, :-1]\n"
    "        return torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)\n"
    "\n"
    "    def step(self, ids, adv, batches):\n"
    "        a = self.logps(ids)\n"
    "        for idx in batches:\n"
    "            b = a[idx]\n"
    "            c = self.logps(ids[idx])\n"
    "{ratio}            w = adv[idx].unsqueeze(-1)\n"
    "            loss = -torch.min(r * w, torch.clamp(r, 1 - self.eps, 1 + self.eps) * w).mean()\n"
    "            self.opt.zero_grad()\n"
    "            loss.backward()\n"
    "            self.opt.step()\n"
)


# a critic behind the DDP unwrap idiom ({scored}: how its values are computed)
_UNWRAPPED_CRITIC = (
    "def experience(critic, ids, rewards):\n"
    "    c = critic.module if isinstance(critic, DistributedDataParallel) else critic\n"
    "{scored}    a = rewards - v\n"
    "    return {{\"advantages\": a, \"returns\": rewards}}\n"
)


# an A2C update: the advantages are returns minus the critic's values, squared into the critic's own loss and
# weighing the log-probs of the policy loss ({detach}: how that second use reads them)
_A2C_RESIDUAL = (
    "def update(policy, critic, opt, obs, acts, batch):\n"
    "    lp = policy(obs).log_softmax(-1).gather(-1, acts[:, None]).squeeze(-1)\n"
    "    q = batch[\"returns\"] - critic(obs).squeeze(-1)\n"
    "    vl = q.pow(2).mean()\n"
    "    pl = -(q{detach} * lp).mean()\n"
    "    opt.zero_grad()\n"
    "    (vl + pl).backward()\n"
    "    opt.step()\n"
)


class DetachedTargets(Rule):
    """
    ## What it flags
    An assignment to old (behaviour) log-probs, reference log-probs, advantages or returns whose value is
    computed from a model forward pass (the policy, the reference model, a value head or critic, or a helper
    applied to one of them) with autograd on: outside `with torch.no_grad()`/`torch.inference_mode()`/
    `torch.set_grad_enabled(False)`, outside a function decorated with one of them (or only called under
    one), and with no `.detach()` along the way. This includes values derived from tensors that carry grad,
    such as `advantages = returns - values` where `values` come from the value head in the same function.
    A forward of a frozen model carries no grad and is not reported: frozen by `requires_grad_(False)` or a loop
    setting `p.requires_grad = False` over its parameters, built by TRL's `create_reference_model(model)`, or
    handed in as a parameter that every call in the module passes a frozen model. Log-probs are the reference's
    when the model is named or handed in as the reference, or when it is a deep copy of the model the module
    trains (`ref = copy.deepcopy(model)` beside `Adam(model.parameters())`) that is not trained itself. A value is
    the old log-probs by use when it is the `y` of `exp(cur - y)` and that ratio is clamped in a PPO clip (a bare
    `exp(ref - logp)` is the k3 KL estimate, no ratio). A target detached at every use (`exp(logp - old.detach())`,
    itself or through the row selections made of it) is not reported. Returns or rewards minus a model's output
    (the critic's values, also a tuple element that a method of another file of the tree returns) that weigh the
    policy's log-probs in a product are the advantages by their computation and use; their use squared into the
    critic's own loss (`advantages.pow(2).mean()`, A2C) is not a use as a target.

    ## Why it is wrong
    These tensors are *targets*: constants of the loss. With grad on, the gradient also flows through them:
    through `old_logp` the PPO ratio's gradient cancels (ratio = exp(logp - old_logp) with both sides moving),
    through advantages the policy learns to change the critic's values instead of its actions, through
    returns the value loss chases its own prediction. Training looks normal at first; then the clip fraction
    stays 0, the value loss falls while explained variance does not rise, and reward stalls. Memory also
    grows: every target keeps its whole graph alive.

    ## Example
    ```python
    old_logp = compute_logp(policy, ids)
    advantages = returns - critic(obs).squeeze(-1)
    ```

    ## Use instead
    ```python
    with torch.no_grad():
        old_logp = compute_logp(policy, ids)
    advantages = returns - critic(obs).squeeze(-1).detach()
    ```

    ## Fix
    `--fix` appends `.detach()` to the assigned value (`old_logp = compute_logp(policy, ids).detach()`,
    `advantages = (returns - values).detach()`): the value is unchanged, only the gradient stops. Targets
    bound by tuple unpacking (`_, old_logp, _, value = agent.get_action_and_value(obs)`) are reported without
    a fix: wrap the computation in `with torch.no_grad():` instead. Advantages also squared into the critic's loss
    (A2C's `advantages.pow(2).mean()`) are reported without a fix too: detach them where they weigh the log-probs.

    ## Options
    `[tool.rlguard.names]` `old_logp`, `ref_logp`, `advantages`, `returns`, `policy`, `ref_model` add your own
    names for these tensors and models.
    """

    code = DETACHED_TARGETS
    # a target's name: log-probs, advantages, returns (the rule needs one, assigned from a forward)
    # `returns` as code, not the "Returns:" of a docstring or prose ("returns the ..."): most files that say
    # it say it there, and a trigger that passes every documented module parses them all for nothing
    # stable since 2026-12-07: its stable part (a target's role shown by its use, a forward in view) reports 4 TRUE
    # and no FALSE on the 49 repositories (development 4 TRUE; validation and holdout, 5,135 files, no finding),
    # and renaming changes none of them; roles from names and forwards assumed out of view stay preview
    # the log-prob computations themselves (a softmax, a gather, a cross-entropy) admit a file whose variables are
    # named otherwise: reference log-probs are known by the model that computes them
    triggers = (r"(?i)log_?p|advantage|\badv(?:s\b|_|\b)|value_targets|\bgae\b|log_softmax|cross_entropy|\.gather\("
                r"|(?-i:\breturns\b(?![ \t]*:)(?! (?:the|a|an|of|to|is|are|and|or|whether|when|if|None|True|False)\b))")
    fixable = True

    PREVIEW_PARTS = ("a target whose role comes from its variable's name only (stable when its use shows the role: "
                     "it weighs both sides of a PPO clip, or meets a keyword, parameter or string key named for it)",
                     "a forward assumed through a method of a model whose code is out of view "
                     "(`ref.compute_logp(batch)` may run under no_grad or behind an RPC layer)",
                     "log-probs known as the reference's by the model that computes them (a reference is usually "
                     "frozen by its builder, often in another file, and then no gradient flows; stable when the "
                     "reference is a deep copy of the trained model built in the module, never frozen and never "
                     "handed to code out of view)")
    VALID = [
        Valid(_A2C_RESIDUAL.format(detach=".detach()"),
              why="A2C: the residual squared into the critic's loss is meant to train it; the policy loss reads it "
                  "detached", capability="C2", style="functional"),
        Valid("def sft_anchor(model, ref_model, ids, labels, beta):\n"
              "    with torch.no_grad():\n"
              "        a = ref_model(ids).logits[:, :-1]\n"
              "        b = -F.cross_entropy(a.transpose(1, 2), labels, reduction=\"none\").sum(-1)\n"
              "    c = -F.cross_entropy(model(ids).logits[:, :-1].transpose(1, 2), labels, reduction=\"none\").sum(-1)\n"
              "    loss = -F.logsigmoid(beta * (c - b)).mean()\n"
              "    loss.backward()\n",
              why="the reference model's log-probs computed under no_grad", capability="C1", style="functional"),
        Valid("with torch.no_grad():\n"
              "    old_logp = compute_logp(policy, ids)\n", "under no_grad"),
        Valid("import jax\n"
              "import flax.linen as nn\n"
              "from torch.utils.tensorboard import SummaryWriter\n"
              "\n"
              "class Critic(nn.Module):\n"
              "    @nn.compact\n"
              "    def __call__(self, x):\n"
              "        return nn.Dense(1)(x)\n"
              "\n"
              "critic = Critic()\n"
              "\n"
              "@jax.jit\n"
              "def compute_gae(params, obs, storage):\n"
              "    v = critic.apply(params, obs).squeeze()\n"
              "    q = storage.rewards - v\n"
              "    return storage.replace(advantages=q, returns=q + v)\n",
              "a JAX/Flax module (torch only for its TensorBoard writer): no torch autograd graph is built, JAX "
              "differentiates explicitly", capability="C12", style="script"),
        Valid("import ray\n"
              "from transformers import AutoModelForCausalLM\n"
              "\n"
              "def score(cfg, batch):\n"
              "    policy = AutoModelForCausalLM.from_pretrained(cfg.path)\n"
              "    group = WorkerGroup(cls=ray.remote(ActorWorker), model=policy)\n"
              "    out = group.infer_batch(batch)\n"
              "    old = out.get()['log_probs']\n"
              "    return ppo_loss(batch, old_log_probs=old)\n",
              "a worker group built around a Ray remote class: the model runs in its workers, and what the group "
              "returns crossed a process boundary as data", capability="C12", style="framework"),
        Valid("def terms(model, ref, x, y):\n"
              "    lp = model(x).log_softmax(-1).gather(-1, y[..., None]).squeeze(-1)\n"
              "    with torch.no_grad():\n"
              "        rl = ref(x).log_softmax(-1)\n"
              "    return lp, rl.gather(-1, y[..., None]).squeeze(-1)\n"
              "\n"
              "def step(model, ref, x, y, adv):\n"
              "    lp, rl = terms(model, ref, x, y)\n"
              "    loss = kl_loss(lp, ref_logp=rl, advantages=adv)\n"
              "    loss.backward()\n",
              "each element of a helper's returned tuple has its own provenance: the policy's log-probs carry the "
              "graph, the reference's were scored under no_grad", capability="C1", style="functional"),
        Valid("@torch.no_grad()\n"
              "def behaviour_logp(model, ids):\n"
              "    return token_logp(model(ids).logits, ids)\n"
              "\n"
              "old_log_probs = behaviour_logp(policy, ids)\n", "computed by a @torch.no_grad() helper"),
        Valid("logp = compute_logp(policy, ids)\n"
              "old_logp = logp.detach()\n", ".detach() in the chain"),
        Valid("def loss(self, batch):\n"
              "    old_logprobs = batch['old_logprobs']\n"
              "    advantages = batch['advantages']\n"
              "    logp = self.policy(batch['ids'])\n"
              "    return -(torch.exp(logp - old_logprobs) * advantages).mean()\n", "read from the batch dict"),
        Valid("rewards = reward_model(ids)\n"
              "advantages = (rewards - rewards.mean()) / (rewards.std() + 1e-8)\n",
              "advantages from rewards only"),
        Valid("values = self.critic(obs).squeeze(-1)\n"
              "advantages = returns - values.detach()\n"
              "value_loss = (values - returns).pow(2).mean()\n", "values detached for the advantages"),
        Valid("with torch.inference_mode():\n"
              "    ref_logits = self.ref_model(input_ids).logits\n"
              "ref_logps = selective_log_softmax(ref_logits, input_ids)\n",
              "the forward ran under inference_mode"),
        Valid("class Worker:\n"
              "    def rollout(self, ids):\n"
              "        old_logp = self.logp(self.actor, ids)\n"
              "        return old_logp\n"
              "\n"
              "    def step(self, ids):\n"
              "        with torch.no_grad():\n"
              "            batch = self.rollout(ids)\n", "a method only called under no_grad"),
        Valid("ref_model.requires_grad_(False)\n"
              "ref_logp = token_logp(ref_model(ids).logits, ids)\n", "the reference model is frozen"),
        Valid(_REFERENCE_FROM_TRL.format(made="        self.ref_model = create_reference_model(model)\n"),
              "TRL's create_reference_model(model) returns a copy whose parameters all have requires_grad False: its "
              "log-probs carry no gradient without no_grad", capability="C1", style="framework"),
        Valid(_FROZEN_BY_CALLER.format(built="ref = ref.eval().requires_grad_(False)\n"),
              "the function is handed a reference frozen by every caller in the module: the caller's context "
              "is the callee's", capability="C5", style="script"),
        Valid(_DEEP_COPY_REFERENCE.format(frozen=".requires_grad_(False)", extra=""),
              "the deep copy of the trained model is frozen where it is built", capability="C1", style="functional"),
        Valid(_DEEP_COPY_REFERENCE.format(frozen="", extra="    opt.add_param_group({\"params\": twin.parameters()})\n"),
              "the copy is trained too (its parameters join the optimizer): no reference", capability="C1",
              style="functional"),
        Valid(_CLIPPED_OLD.format(ratio="            r = torch.exp(c - b.detach())\n"),
              "the old side of the clipped ratio is detached where it is used", capability="C1", style="class"),
        Valid("policy, tok = init_model(cfg)\n"
              "opt = torch.optim.Adam(policy.parameters())\n"
              "\n"
              "\n"
              "def step(engine, prompts, adv, eps):\n"
              "    enc = tok(prompts, return_tensors=\"pt\", padding=True)\n"
              "    res = engine.rollout(prompt_ids=enc.input_ids)\n"
              "    old = res.per_token_logps\n"
              "    logits = policy(res.ids).logits[:, :-1]\n"
              "    new = torch.log_softmax(logits, -1).gather(-1, res.ids[:, 1:, None]).squeeze(-1)\n"
              "    r = torch.exp(new - old)\n"
              "    loss = -torch.min(r * adv, torch.clamp(r, 1 - eps, 1 + eps) * adv).mean()\n"
              "    opt.zero_grad()\n"
              "    loss.backward()\n"
              "    opt.step()\n",
              "the tokenizer unpacked beside the policy from one factory is called with return_tensors: token ids, no "
              "forward; the rollout engine's log-probs carry no graph in view", capability="C1", style="script"),
        Valid(_UNWRAPPED_CRITIC.format(scored="    with torch.no_grad():\n        v = c(ids).squeeze(-1)\n"),
              "the critic behind the DDP unwrap idiom scores under no_grad", capability="C1", style="functional"),
        Valid("import copy\n"
              "import torch\n"
              "import torch.nn.functional as F\n"
              "\n"
              "\n"
              "def build(cfg):\n"
              "    m = Net(cfg)\n"
              "    return m, copy.deepcopy(m)\n"
              "\n"
              "\n"
              "def train(cfg, batches, beta):\n"
              "    model, twin = build(cfg)\n"
              "    opt = torch.optim.Adam(model.parameters())\n"
              "    for ids, labels in batches:\n"
              "        a = -F.cross_entropy(twin(ids).logits[:, :-1].transpose(1, 2), labels, reduction=\"none\").sum(-1)\n"
              "        b = -F.cross_entropy(model(ids).logits[:, :-1].transpose(1, 2), labels, reduction=\"none\").sum(-1)\n"
              "        loss = -F.logsigmoid(beta * (b - a)).mean()\n"
              "        opt.zero_grad()\n"
              "        loss.backward()\n"
              "        opt.step()\n",
              "the copy comes out of a helper's returned tuple: an element of what the helper made is not known as a "
              "fresh trainable copy (it may be frozen where the helper is changed), so nothing is said", capability="C1",
              style="functional"),
        Valid("with torch.set_grad_enabled(False):\n"
              "    _, old_logp, _, value = agent.get_action_and_value(obs)\n", "set_grad_enabled(False)"),
        Valid("logp = compute_logp(policy, ids)\n"
              "ratio = torch.exp(logp - old_logp)\n", "current log-probs carry grad, as they must"),
        Valid("advantages = returns - self.critic(obs)\n"
              "advantages = advantages.detach()\n", "detached on the next line"),
        Valid("class Distiller:\n"
              "    def _behaviour(self, ids):\n"
              "        out = None\n"
              "        if self.cfg.recompute:\n"
              "            with torch.no_grad():\n"
              "                logits = self.student(ids).logits\n"
              "                out = selective_log_softmax(logits, ids)\n"
              "        return out\n"
              "\n"
              "    def rollouts(self, ids):\n"
              "        old_per_token_logps = self._behaviour(ids)\n",
              "a same-class helper assigns the value under no_grad and returns the name after the block",
              capability="FP", style="class"),
        Valid("ref_logprobs = helpers.token_logprobs(self.ref_policy, batch, use_grad=False)\n",
              "a helper the linter cannot read, told to run without autograd", capability="FP", style="framework"),
        Valid("def test_matches_fused_kernel(model_ref, ids):\n"
              "    ref_logp = model_ref(ids).logits[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None])\n"
              "    ref_logp.sum().backward()\n"
              "    return [p.grad for p in model_ref.parameters()]\n",
              "a test's reference implementation is backpropagated itself: a loss, not a target", capability="FP",
              style="functional"),
        Valid("class Scorer(nn.Module):\n"
              "    def forward(self, ids):\n"
              "        hidden = self.body(ids)[0]\n"
              "        per_token = self.v_head(hidden).squeeze(-1)\n"
              "        returns = per_token[:, -1]\n"
              "        return returns\n",
              "`returns` is what a model's forward returns, not RL returns", capability="FP", style="class"),
        Valid("for batch in loader:\n"
              "    meta = prepare(batch)\n"
              "    advantages, returns = estimate(meta.select(['rewards', 'values']), gamma=1.0)\n"
              "    critic_out = self.critic_wg.update_critic(meta)\n"
              "    meta = meta.union(critic_out)\n",
              "a worker-group RPC returns plain data; meta is rebound at the loop head", capability="FP",
              style="framework"),
        Valid("@torch.no_grad()\n"
              "def logp_and_values(net, toks):\n"
              "    out = net(toks)\n"
              "    lp = out.logits[:, :-1].log_softmax(-1).gather(-1, toks[:, 1:, None]).squeeze(-1)\n"
              "    return lp, out.value\n\n"
              "old_logp, v = logp_and_values(policy, ids)\n",
              "a tuple returned by a helper that runs without autograd", capability="C1", style="functional"),
        Valid("class Trainer:\n"
              "    def step(self, batch):\n"
              "        v = self.critic(batch['obs']).squeeze(-1)\n"
              "        v = v.detach() * batch['mask']\n"
              "        adv = batch['returns'] - v\n"
              "        return adv\n",
              "the rebinding v = f(v) detaches the critic's values", capability="C1", style="framework"),
        Valid("def update(policy, critic, obs, actions, rewards, old_logp, gamma=0.99):\n"
              "    values = critic(obs).squeeze(-1).detach()\n"
              "    rev = []\n"
              "    last = 0.0\n"
              "    for t in reversed(range(rewards.size(1))):\n"
              "        last = rewards[:, t] + gamma * last - values[:, t]\n"
              "        rev.append(last)\n"
              "    adv = torch.stack(rev[::-1], dim=1)\n"
              "    ratio = torch.exp(policy(obs).log_prob(actions) - old_logp)\n"
              "    loss = -torch.min(ratio * adv, torch.clamp(ratio, 0.8, 1.2) * adv).mean()\n"
              "    loss.backward()\n",
              "advantages accumulated in a list from detached values", capability="C1", style="functional"),
        Valid("def update(net, opt, obs, act, rew, nxt, done):\n"
              "    q1 = rew + 0.99 * net.v(nxt).detach() * done\n"
              "    q2 = q1 - net.v(obs).squeeze(-1)\n"
              "    q3 = torch.log_softmax(net.pi(obs), -1).gather(1, act).squeeze(1)\n"
              "    q4 = -(q3 * q2.detach()).mean() + q2.pow(2).mean()\n"
              "    opt.zero_grad()\n"
              "    q4.backward()\n"
              "    opt.step()\n",
              why="A2C with the TD error detached where it weighs the log-probs", capability="C2", style="functional"),
        Valid("def update(net, opt, obs, act, rew, nxt, scale):\n"
              "    q1 = rew + scale * net.v(nxt)\n"
              "    q2 = q1 - net.v(obs).squeeze(-1)\n"
              "    return q2.pow(2).mean()\n",
              why="no discount and no log-probs: a regression, not an advantage", capability="C2", style="functional"),
        Valid("class Net(nn.Module):\n"
              "    def __init__(self):\n"
              "        super().__init__()\n"
              "        self.head_p = nn.Linear(4, 2)\n"
              "        self.head_v = nn.Linear(4, 1)\n"
              "    def p(self, x):\n"
              "        return F.softmax(self.head_p(x), dim=-1)\n"
              "    def v(self, x):\n"
              "        return self.head_v(x)\n"
              "net = Net()\n"
              "opt = torch.optim.Adam(net.parameters())\n"
              "for obs, act, rs, last_obs in batches():\n"
              "    q1 = rs + 0.98 * net.v(last_obs).detach().reshape(-1)\n"
              "    q2 = q1 - net.v(obs).reshape(-1)\n"
              "    q3 = net.p(obs).gather(1, act).reshape(-1)\n"
              "    q4 = -(torch.log(q3) * q2.detach()).mean() + q2.pow(2).mean()\n"
              "    opt.zero_grad()\n"
              "    q4.backward()\n"
              "    opt.step()\n",
              why="the same script with the TD error detached where it weighs the log-probs", capability="C2",
              style="script"),
    ]
    INVALID = [
        Invalid(_A2C_RESIDUAL.format(detach=""), line=3,
                why="returns minus the critic's values (the advantages by their computation) weigh the policy's "
                    "log-probs undetached: the policy loss trains the critic", capability="C2", style="functional"),
        Invalid("def sft_anchor(model, ref_model, ids, labels, beta):\n"
                "    a = ref_model(ids).logits[:, :-1]\n"
                "    b = -F.cross_entropy(a.transpose(1, 2), labels, reduction=\"none\").sum(-1)\n"
                "    c = -F.cross_entropy(model(ids).logits[:, :-1].transpose(1, 2), labels, reduction=\"none\").sum(-1)\n"
                "    loss = -F.logsigmoid(beta * (c - b)).mean()\n"
                "    loss.backward()\n", line=3,
                why="no name says reference or log-probs: the negated cross-entropy of the reference model's forward is",
                capability="C1", style="functional", preview=True),
        Invalid("def update(policy, critic, obs, actions, rewards, old_logp, gamma=0.99):\n"
                "    values = critic(obs).squeeze(-1)\n"
                "    rev = []\n"
                "    last = 0.0\n"
                "    for t in reversed(range(rewards.size(1))):\n"
                "        last = rewards[:, t] + gamma * last - values[:, t]\n"
                "        rev.append(last)\n"
                "    adv = torch.stack(rev[::-1], dim=1)\n"
                "    ratio = torch.exp(policy(obs).log_prob(actions) - old_logp)\n"
                "    loss = -torch.min(ratio * adv, torch.clamp(ratio, 0.8, 1.2) * adv).mean()\n"
                "    loss.backward()\n", line=8,
                why="a GAE loop appends each step's advantage to a list: the list carries the critic's live "
                    "values, and the stacked advantages weigh the PPO clip", capability="C1", style="functional"),
        Invalid(_REFERENCE_FROM_TRL.format(made="        self.ref_model = create_reference_model(model, num_shared_layers=6)\n"), line=13,
                why="with num_shared_layers the copy shares its first layers with the policy: the reference "
                    "log-probs depend on trained weights", capability="C1", style="framework"),
        Invalid(_FROZEN_BY_CALLER.format(built="ref = ref.eval()\n"), line=6,
                why="the caller puts the reference in eval mode but leaves its weights trainable", capability="C5",
                style="script", preview=True),
        Invalid(_DEEP_COPY_REFERENCE.format(frozen="", extra=""), line=7,
                why="no name says reference: a deep copy of the trained model, built here, never frozen and never "
                    "handed out, scores the DPO margin's other side with autograd on", capability="C1", style="functional"),
        Invalid(_DEEP_COPY_REFERENCE.format(frozen="", extra="    disable_dropout(twin)\n"), line=8,
                why="the copy is handed to a function out of view, which may freeze it: preview", capability="C1",
                style="functional", preview=True),
        Invalid(_CLIPPED_OLD.format(ratio="            r = torch.exp(c - b)\n"), line=14,
                why="no name says old log-probs: the value is the y of exp(cur - y), the ratio a PPO clip clamps, and "
                    "it was computed with autograd on and is never detached", capability="C1", style="class"),
        Invalid(_UNWRAPPED_CRITIC.format(scored="    v = c(ids).squeeze(-1)\n"), line=4,
                why="m.module if isinstance(m, DDP) else m is the same critic either way: its values carry grad into "
                    "the advantages", capability="C1", style="functional"),
        Invalid("old_logp = compute_logp(model, ids)\n", line=1,
                fixed="old_logp = compute_logp(model, ids).detach()\n", preview=True),
        Invalid("values = self.critic(obs).squeeze(-1)\n"
                "advantages = returns - values\n", line=2,
                fixed="values = self.critic(obs).squeeze(-1)\n"
                      "advantages = (returns - values).detach()\n", why="values from the value head carry grad", preview=True),
        Invalid("ref_logits = self.ref_model(input_ids).logits\n"
                "ref_per_token_logps = selective_log_softmax(ref_logits, input_ids)\n", line=2,
                fixed="ref_logits = self.ref_model(input_ids).logits\n"
                      "ref_per_token_logps = selective_log_softmax(ref_logits, input_ids).detach()\n",
                why="log-probs of a forward of the reference model (an attribute set elsewhere, named for it)",
                preview=True),
        Invalid("class Trainer:\n"
                "    def collect(self, ids):\n"
                "        self.old_log_probs = self.token_logp(self.policy, ids)\n", line=3,
                why="a self. attribute", preview=True),
        Invalid("def token_logp(model, ids):\n"
                "    logits = model(ids).logits[:, :-1]\n"
                "    return torch.gather(logits.log_softmax(-1), 2, ids[:, 1:, None]).squeeze(-1)\n"
                "\n"
                "behavior_logp = token_logp(policy, ids)\n", line=5, why="a same-module helper runs the forward",
                capability="C1", style="functional", preview=True),
        Invalid("_, old_logprobs, _, value = agent.get_action_and_value(obs)\n", line=1,
                why="tuple unpacking, no fix", capability="C1", style="script", preview=True),
        Invalid("with torch.no_grad():\n"
                "    rewards = reward_model(ids)\n"
                "next_values = critic(next_obs)\n"
                "returns = rewards + gamma * next_values\n", line=4, why="bootstrapped returns carry grad", preview=True),
        Invalid("logits = policy(ids).logits\n"
                "logp = logits.log_softmax(-1)\n"
                "old_logp = logp\n", line=3, fixed="logits = policy(ids).logits\n"
                                                   "logp = logits.log_softmax(-1)\n"
                                                   "old_logp = logp.detach()\n", why="alias of the live logp",
                capability="C1", style="script", preview=True),
        Invalid("def logp_of(net, toks):\n"
                "    z = net(toks).logits\n"
                "    z = z[:, :-1] / tau\n"
                "    return z.log_softmax(-1).gather(-1, toks[:, 1:, None]).squeeze(-1)\n\n"
                "behaviour_lp = logp_of(net, toks)\n", line=6,
                why="z = f(z) reads the model call above it, inside a helper", capability="C1", style="functional", preview=True),
        Invalid("def logp_and_values(net, toks):\n"
                "    out = net(toks)\n"
                "    lp = out.logits[:, :-1].log_softmax(-1).gather(-1, toks[:, 1:, None]).squeeze(-1)\n"
                "    return lp, out.value\n\n"
                "old_logp, v = logp_and_values(policy, ids)\n", line=6,
                why="the first element of a helper's tuple, computed with autograd on", capability="C1",
                style="functional", preview=True),
        Invalid("class Trainer:\n"
                "    def step(self, batch):\n"
                "        v = self.critic(batch['obs']).squeeze(-1)\n"
                "        v = v * batch['mask']\n"
                "        adv = batch['returns'] - v\n"
                "        return adv\n", line=5,
                why="the rebinding v = v * mask keeps the critic's graph", capability="C1", style="framework", preview=True),
        Invalid("adv = gae(rewards, self.value_head(hidden).squeeze(-1), gamma, lam)\n", line=1,
                fixed="adv = gae(rewards, self.value_head(hidden).squeeze(-1), gamma, lam).detach()\n", preview=True),
        # stable: the use shows the role, whatever the variable is called
        Invalid("def update(policy, critic, obs, ids, acts, ret, old):\n"
                "    q = ret - critic(obs).squeeze(-1)\n"
                "    lp = token_logp(policy, ids, acts)\n"
                "    r = (lp - old).exp()\n"
                "    obj = torch.min(r * q, r.clamp(0.8, 1.2) * q)\n"
                "    (-obj.mean()).backward()\n", line=2,
                why="q weighs both sides of the PPO clip (the advantages by their use) and carries the critic's "
                    "graph", capability="C2", style="functional"),
        Invalid("class Learner:\n"
                "    def collect(self, obs, rew):\n"
                "        v = self.critic(obs).squeeze(-1)\n"
                "        q = rew - v\n"
                "        return ppo_loss(logp=self.lp(obs), advantages=q)\n", line=4,
                why="q is passed as the advantages of the loss's interface and carries the critic's graph",
                capability="C2", style="class"),
        Invalid("def make_batch(net, obs, rew, gamma):\n"
                "    batch = {}\n"
                "    g = rew + gamma * net(obs).squeeze(-1)\n"
                "    batch['returns'] = g\n"
                "    return batch\n", line=3,
                why="stored under the returns key: bootstrapped from the live critic with autograd on",
                capability="C3", style="framework"),
        Invalid("x = compute_logp(model, seq)\n"
                "loss = ppo_objective(logp=token_logp(model, seq), old_logp=x, advantages=a)\n"
                "loss.backward()\n", line=1,
                why="x is passed as the old log-probs and computed from the live model with autograd on",
                capability="C4", style="script"),
        Invalid("def update(net, opt, obs, act, rew, nxt, done):\n"
                "    q1 = rew + 0.99 * net.v(nxt).detach() * done\n"
                "    q2 = q1 - net.v(obs).squeeze(-1)\n"
                "    q3 = torch.log_softmax(net.pi(obs), -1).gather(1, act).squeeze(1)\n"
                "    q4 = -(q3 * q2).mean() + (q1 - net.v(obs).squeeze(-1)).pow(2).mean()\n"
                "    opt.zero_grad()\n"
                "    q4.backward()\n"
                "    opt.step()\n", line=3,
                why="A2C: a TD target (reward plus a discounted value) minus the critic's value weighs the log-probs "
                    "undetached, whatever the locals are called (preview: `net.v` is a method out of view, which may "
                    "run under no_grad)", capability="C2", style="functional", preview=True),
        Invalid("class Net(nn.Module):\n"
                "    def __init__(self):\n"
                "        super().__init__()\n"
                "        self.body = nn.Linear(4, 64)\n"
                "        self.head_p = nn.Linear(64, 2)\n"
                "        self.head_v = nn.Linear(64, 1)\n"
                "    def p(self, x):\n"
                "        return F.softmax(self.head_p(F.relu(self.body(x))), dim=-1)\n"
                "    def v(self, x):\n"
                "        return self.head_v(F.relu(self.body(x)))\n"
                "def discounted(last, rs, ms):\n"
                "    g = last\n"
                "    out = []\n"
                "    for r, m in zip(rs[::-1], ms[::-1]):\n"
                "        g = r + 0.98 * g * m\n"
                "        out.append(g)\n"
                "    return torch.stack(out[::-1]).float()\n"
                "net = Net()\n"
                "opt = torch.optim.Adam(net.parameters())\n"
                "for obs, act, rs, ms, last_obs in batches():\n"
                "    q1 = discounted(net.v(last_obs).detach(), rs, ms).reshape(-1)\n"
                "    q2 = q1 - net.v(obs).reshape(-1)\n"
                "    q3 = net.p(obs).gather(1, act).reshape(-1)\n"
                "    q4 = -(torch.log(q3) * q2).mean() + F.smooth_l1_loss(net.v(obs).reshape(-1), q1)\n"
                "    opt.zero_grad()\n"
                "    q4.backward()\n"
                "    opt.step()\n", line=22,
                why="A2C script: discounted returns from a helper minus the value head of a module in view weigh the "
                    "log of the policy head's probabilities, undetached", capability="C2", style="script"),
    ]

    def check(self, ctx: Analysis) -> Iterator[Violation]:
        for stmt in ctx.nodes(cst.Assign, cst.AnnAssign):
            if stmt.value is None:
                continue
            targets = [t.target for t in stmt.targets] if isinstance(stmt, cst.Assign) else [stmt.target]
            for target in targets:
                found = self._check_target(ctx, target, stmt)
                if found is not None:
                    yield found

    def _check_target(self, ctx: Analysis, target, stmt) -> Violation | None:
        unpacked = isinstance(target, (cst.Tuple, cst.List))
        elements = [el.value for el in target.elements] if unpacked else [target]
        defs = {id(d.target): d for d in ctx.index.stmt_defs.get(id(stmt), ()) if d.target is not None}
        for element in elements:
            d = defs.get(id(element))
            if d is None:
                continue
            role = hinted_role(ctx, element)
            by_use = target_role_by_use(ctx, d)
            if role is None and by_use is not None:
                role = by_use
            logp_named = role is None and _logp_named(element)
            if role is None and not logp_named and not ctx.preview and not (
                    models(ctx).makes_deep_copies() and _computes_logprobs(ctx, stmt)):
                # no role, and no log-probs computed here of a model that could be a trainable deep copy of the
                # policy (the stable finding that needs no name): the forwards are not traced for it
                continue
            # forwards that carry gradient into trained weights (a reward model's output is not trained)
            live = [o for o in forwards_of_def(ctx, d, grad=True) if o.model is None or o.model.role != "reward"]
            by_provenance = by_use is None and _reference_logprobs(live)
            # log-probs that only forwards of the reference model compute. A preview part, unless the reference is
            # a deep copy made here and visibly trainable: a reference is usually frozen by its builder
            # (`requires_grad = False` over its parameters, often in another file), and then no gradient flows
            # whatever the context; the ecosystem shows that case (grpo-flat)
            shown_by_provenance = by_provenance and all(o.model is not None and
                                                        models(ctx).trainable_copy(o.model) for o in live)
            if by_provenance:
                role = role or "ref_logp"
                logp_named = False
            if role is None and not logp_named:
                continue
            if logp_named:
                # `base_action_log_probs = self.initial_model(...)`: log-probs of the reference model
                if not live or not all(o.model is not None and o.model.role == "reference" for o in live):
                    continue
                role = "ref_logp"
            if not live or _not_a_target(ctx, d) or _detached_later(ctx, d):
                continue
            name = ctx.code(element)
            message = (f"{WHAT[role]} `{name}` are computed with autograd on, so gradient flows through a "
                       "target; compute them under `torch.no_grad()` or add `.detach()`")
            # no rewrite when the value is also squared into the critic's loss (A2C's `advantages.pow(2)`): detaching
            # it there would stop the critic's training; the use as a target is what needs the `.detach()`
            squared = _squared_somewhere(ctx, d)
            if squared and role == "advantages":
                message = (f"{WHAT[role]} `{name}` are computed with autograd on and used as a target undetached, so "
                           "the policy loss trains the critic; keep them live for the critic's squared loss, and "
                           "read them with `.detach()` where they weigh the log-probs")
            fix = [] if unpacked or squared else [(stmt.value, _detached(stmt.value))]
            # stable when the value's use shows it is a target (a ratio's old side, a clip weight, an interface
            # that names the role); a role that rests on the variable's name alone is a preview finding
            assumed = all(o.assumed for o in live)  # only methods out of view: they may run under no_grad
            return Violation(element if unpacked else stmt.value, message, fix,
                             preview=assumed or not shown_by_provenance and (
                                 by_provenance or by_use is None or by_use != role and {by_use, role} != {
                                     "old_logp", "ref_logp"}))
        return None


def _reference_logprobs(live: list) -> bool:
    """Log-probs (or a cross-entropy's negation) that only forwards of the reference model compute, the model known
    as the reference by its interface (a parameter or an attribute read here and set elsewhere, named for it) or by
    how it is built (`create_reference_model`, a copy of the policy): the target of a KL, whatever the value is
    called."""
    return bool(live) and all(o.model is not None and o.model.role == "reference" and o.what in ("logprobs", "nll")
                              for o in live)


def _not_a_target(ctx: Analysis, d: Def) -> bool:
    """A value that is backpropagated itself is a loss (a test's reference implementation); values of a model's
    own ``forward``/``generate`` code are its internals and outputs (a reward model's ``returns``, a decoding
    heuristic's ``adv``)."""
    return is_backpropagated(ctx, d) or in_model_code(ctx, d)


def _detached_later(ctx: Analysis, d: Def) -> bool:
    """``adv = returns - values`` followed by ``adv = adv.detach()`` (or ``adv.detach_()``) in the same function:
    only the final value is the target."""
    scope = ctx.index.function_scope(d.stmt)
    order = ctx.index.order
    for later in scope.defs.get(d.key, ()):
        if later.order > d.order and later.kind == "assign" and later.value is not None \
                and ".detach()" in ctx.code(later.value):
            return True
    for call in ctx.index.descendants(scope.node, cst.Call) if scope.node is not ctx.module else ctx.nodes(cst.Call):
        if isinstance(call.func, cst.Attribute) and call.func.attr.value == "detach_" and \
                dotted_name(call.func.value) == d.key and order[id(call)] > d.order:
            return True
    return _detached_at_every_use(ctx, d)


def _detached_at_every_use(ctx: Analysis, d: Def, depth: int = 2) -> bool:
    """``ratio = exp(logp - old.detach())`` and no other read of ``old`` (a ``del`` aside), itself or through the
    plain copies and row selections made of it (``mb_old = old[idx]``): the target is detached where it is used,
    so no gradient reaches it."""
    reads = [r for r in reads_of(ctx, d) if not isinstance(ctx.index.parent_of(r), cst.Del)]
    if not reads:
        return False
    for read in reads:
        parent = ctx.index.parent_of(read)
        call = ctx.index.parent_of(parent) if isinstance(parent, cst.Attribute) and parent.value is read else None
        if isinstance(call, cst.Call) and call.func is parent and parent.attr.value in ("detach", "detach_"):
            continue
        if _squared_residual(ctx, read, parent, call):
            continue  # `adv.pow(2).mean()`: the critic's own regression loss on the residual, no target use
        value = parent if isinstance(parent, cst.Subscript) and parent.value is read else read
        copies = [b for b in ctx.index.stmt_defs.get(id(ctx.index.statement_of(value)), ())
                  if b.kind == "assign" and b.value is value]
        if depth > 0 and copies and all(_detached_at_every_use(ctx, b, depth - 1) for b in copies):
            continue
        return False
    return True


def _squared_somewhere(ctx: Analysis, d: Def) -> bool:
    """Whether some read of the value ``d`` binds is squared as a regression residual."""
    for read in reads_of(ctx, d):
        parent = ctx.index.parent_of(read)
        call = ctx.index.parent_of(parent) if isinstance(parent, cst.Attribute) and parent.value is read else None
        if _squared_residual(ctx, read, parent, call):
            return True
    return False


def _squared_residual(ctx: Analysis, read, parent, call) -> bool:
    """``x.pow(2)``, ``x ** 2``, ``x.square()``, ``torch.square(x)``: the read is squared as a regression
    residual; A2C's ``advantages.pow(2).mean()`` is the critic's loss, whose gradient into the critic is meant."""
    if isinstance(call, cst.Call) and call.func is parent:
        method = parent.attr.value
        if method == "square" and not call.args:
            return True
        return method == "pow" and len(call.args) == 1 and S.number_value(call.args[0].value) == 2
    if isinstance(parent, cst.BinaryOperation) and isinstance(parent.operator, cst.Power) and parent.left is read:
        return S.number_value(parent.right) == 2
    if isinstance(parent, cst.Arg):
        outer = ctx.index.parent_of(parent)
        return isinstance(outer, cst.Call) and ctx.call_name(outer) == "torch.square" and len(outer.args) == 1
    return False


def _computes_logprobs(ctx: Analysis, stmt: cst.CSTNode) -> bool:
    """Whether the assignment itself computes log-probs (a log-softmax, a cross-entropy, a gather, a log-prob
    helper out of view): what the value is then follows from the model it is computed from."""
    def build(an: Analysis) -> frozenset[int]:
        found = set()
        for call in an.nodes(cst.Call):
            func = call.func
            last = func.attr.value if type(func) is cst.Attribute else (func.value if type(func) is cst.Name else "")
            if last not in ("log_softmax", "gather", "cross_entropy", "nll_loss", "take_along_dim") and \
                    not LOGPROB_HELPER.fullmatch(last):
                continue  # the cheap test on the called name first
            name = an.call_name(call) or ""
            if name in LOG_SOFTMAX or name in CROSS_ENTROPY or name in GATHER or an.method(call) in (
                    "log_softmax", "gather") or (LOGPROB_HELPER.fullmatch(last) and an.callee(call) is None):
                found.add(id(an.index.statement_of(call)))
        return frozenset(found)
    return id(stmt) in ctx.facet("logprob_statements", build)


def _logp_named(target: cst.BaseExpression) -> bool:
    name = dotted_name(target)
    return name is not None and LOGP_WORD.search(name.rsplit(".", 1)[-1]) is not None


def _detached(value: cst.BaseExpression) -> cst.BaseExpression:
    if not isinstance(value, (cst.Name, cst.Attribute, cst.Call, cst.Subscript)) and not value.lpar:
        value = value.with_changes(lpar=[cst.LeftParen()], rpar=[cst.RightParen()])
    return cst.Call(func=cst.Attribute(value=value, attr=cst.Name("detach")))
