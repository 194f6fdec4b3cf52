"""RLG008 reference-alias: the KL reference model is the live policy (alias, shallow copy, shared parameters,
trained by the optimizer, PEFT adapter left on)."""

from __future__ import annotations

from typing import Iterator

import libcst as cst

from rlguard.catalog import REFERENCE_ALIAS
from rlguard.lint.analysis import Analysis
from rlguard.lint.analysis import semantics as S
from rlguard.lint.analysis.index import children, dotted_name, key_of
from rlguard.lint.analysis.provenance import Tup, models, objects
from rlguard.lint.analysis.roles import handed_values, interface_names
from rlguard.lint.analysis.reference import constant_routings, policy_reference_outputs, unused_selections
from rlguard.lint.rule import Invalid, Rule, Valid, Violation

PARAMS_METHODS = frozenset({"parameters", "named_parameters"})
WALK_LIMIT = 200


class ReferenceAlias(Rule):
    """
    ## What it flags
    A KL reference model that is the live policy, or shares its weights:

    - an alias: `ref_model = model`, `self.ref_model = self.model`, `ref = policy.eval()` (`eval()`, `.to()`,
      `.half()` work in place and return the same module), `ref = accelerator.unwrap_model(model)`, or a helper of
      the same module that returns its argument (`def make_ref(model): return model`); the reference is known by
      its name or by the interface it is handed to (`GRPOTrainer(model=model, ref_model=r)`), and `r = model` is
      an alias of the object the optimizer trains however that object was built; one object handed to one call
      both as the reference and as another argument is the alias whatever builds the trainer (the reference
      known by the keyword, or by the parameter of a function or class `__init__` of the linted tree that a
      positional argument binds: `PairTrainer(model, model)`); not inside `pytest.raises`;
    - a shallow copy: `ref = copy.copy(model)` (the copy's parameters *are* the policy's tensors);
    - `ref = model.get_base_model()` on a PEFT model: LoRA layers are injected in place, so the "base" still runs
      the adapter;
    - shared storage: `ref.load_state_dict(model.state_dict(), assign=True)`;
    - the reference's parameters handed to an optimizer: `torch.optim.Adam(list(model.parameters()) +
      list(ref_model.parameters()))`, `optimizer.add_param_group({"params": ref.parameters()})`.

    - reference *outputs* produced by the policy (C11): a function selects the reference into a local (`net =
      self.ref_model` in one branch, `net = self.policy` in the other, or `a if cond else b`), only moves it
      (`net.eval()`, `net.cuda()`), and runs the policy's forward instead (`self.policy(ids)`); or a flag bound
      once to a constant (`self.ref_on_actor = True`) decides between a separate reference worker and the actor
      for reference log-probs while the module shows adapters are optional (a branch on a LoRA/adapter flag):
      "the actor with its adapter disabled" is then the live policy whenever no adapter is configured.

    Not flagged: `copy.deepcopy(model).eval()`, `AutoModelForCausalLM.from_pretrained(...)`,
    `create_reference_model(model)` (TRL), `ref_model = None` with `with model.disable_adapter():` (the PEFT way),
    `ref_model.load_state_dict(model.state_dict())` (a copy). An `a if cond else model` fallback is not flagged;
    nor a selected model that is run or handed to a helper, nor a routing flag derived from the adapter setting.
    Whether a worker's reference pass really disables an adapter is runtime state: the `ref_is_policy` contract
    (KL to the reference > 0 after a step) checks it.

    ## Why it is wrong
    The KL penalty measures how far the policy moved from where it started. If the reference is the policy, the
    KL is exactly 0 at every step and the penalty never acts (or, with a shallow copy or shared storage, the
    reference silently moves with every optimizer step). Training looks healthy: `kl_ref` flat at 0.000, while
    the policy drifts freely into reward hacking.

    ## Example
    ```python
    ref_model = model
    ref_model.eval()
    ```

    ## Use instead
    ```python
    ref_model = copy.deepcopy(model).eval()
    ref_model.requires_grad_(False)
    ```

    ## Fix
    `--fix` rewrites `copy.copy(policy)` to `copy.deepcopy(policy)` when the `copy` module is imported as a module
    (`import copy`, `import copy as cp`). After `from copy import copy` the call is reported without a fix (it
    would need a new import). Aliases, optimizer groups and PEFT references have no automatic fix: the right
    repair (deep copy, reload from the checkpoint, `disable_adapter()`) depends on memory and setup.

    ## Options
    `[tool.rlguard.names]` `ref_model = [...]` and `policy = [...]` add your own names for the reference and the
    policy.
    """

    code = REFERENCE_ALIAS
    # every branch starts with a literal (fast to scan): a reference-model name, or a bare `ref = <policy-ish>`
    triggers = (r"ref(?:erence)?(?:_?(?:model|policy|net|module|actor|lm)\b|\s*=\s*[^=\n]*(?:model|policy|actor|"
                r"copy\(|net\b|agent)|\.(?:named_)?parameters\(|\.load_state_dict)|frozen_(?:model|policy)"
                r"|init(?:ial)?_(?:model|policy)|ref\w*_log_?p|compute_ref|ref(?:erence)?_(?:logits|outputs?)")
    fixable = True

    VALID = [
        Valid("from transformers import AutoModelForCausalLM, Trainer\n"
              "from trl import create_reference_model\n"
              "class PairTrainer(Trainer):\n"
              "    def __init__(self, model, args, ref_model=None):\n"
              "        if isinstance(model, str):\n"
              "            model = AutoModelForCausalLM.from_pretrained(model)\n"
              "        self.ref_model = create_reference_model(model)\n"
              "        super().__init__(model=model, args=args)\n",
              why="a frozen copy of the model the Trainer trains", capability="C2", style="framework"),
        Valid("import copy\nref = copy.deepcopy(model).eval()\n", "a deep copy"),
        Valid("ref_model = AutoModelForCausalLM.from_pretrained(name)\n", "loaded separately"),
        Valid("from trl import create_reference_model\nref_model = create_reference_model(model)\n",
              "TRL helper from another module"),
        Valid("ref_model = None\nwith model.disable_adapter():\n    ref_logits = model(ids).logits\n",
              "PEFT: adapter disabled for the reference pass", capability="C11", style="script"),
        Valid("ref_model = build_model(cfg)\nref_model.load_state_dict(model.state_dict())\n",
              "load_state_dict copies the values"),
        Valid("class Trainer:\n    def __init__(self, model, ref_model):\n        self.model = model\n"
              "        self.ref_model = ref_model\n", "the reference comes from the caller"),
        Valid("optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)\nfor p in ref_model.parameters():\n"
              "    p.requires_grad_(False)\n", "only the policy is optimised"),
        Valid("ref = copy.deepcopy(policy)\nref_model = ref\n", "alias of a deep copy"),
        Valid("def make_ref(model):\n    return copy.deepcopy(model)\nref_model = make_ref(policy)\n",
              "helper that copies"),
        Valid("ref_model = model if args.share_ref else None\n", "a conditional: not clear aliasing"),
        Valid("def _tiny():\n"
              "    model = build_tiny_model(seed=0)\n"
              "    return model\n"
              "\n"
              "def test_kl_after_step():\n"
              "    model = _tiny()\n"
              "    ref_model = _tiny()\n"
              "    ref_model.load_state_dict(model.state_dict())\n",
              "a factory helper builds a new model at every call: two calls are two objects"),
        Valid("class Trainer:\n"
              "    def __init__(self, policy, reference=None):\n"
              "        self.policy = policy\n"
              "        self.ref_model = reference if reference is not None else copy.deepcopy(policy)\n",
              "a reference from the caller or a deep copy"),
            Valid("model, tok = init_model(cfg, device)\n"
              "optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)\n",
              "a factory named init_model builds the trained model: its name says what it does, the binding says "
              "what the object is", capability="FP", style="script"),
        # ----- C11: reference outputs and who produces them -----
        Valid("def kl_step(base, cfg, ids):\n"
              "    model = get_peft_model(base, LoraConfig(r=cfg.rank))\n"
              "    with model.disable_adapter():\n"
              "        ref_logits = model(ids).logits\n"
              "    logits = model(ids).logits\n"
              "    return logits, ref_logits\n",
              "reference logits with the adapter disabled", capability="C11", style="functional"),
        Valid("class TestHead:\n"
              "    def test_copy(self):\n"
              "        model_ref = build_model()\n"
              "        assert model_ref is not None\n"
              "\n"
              "    def test_patched(self, ids):\n"
              "        model = build_model()\n"
              "        with torch.no_grad():\n"
              "            ref_logits = model(ids).logits\n"
              "        patch_head(model)\n"
              "        assert_close(model(ids).logits, ref_logits)\n",
              "'ref' is a test's expected output; the reference model is another method's local",
              capability="FP", style="class"),
        Valid("class KLTrainer:\n"
              "    def __init__(self, model, ref_model):\n"
              "        self.model, self.ref_model = model, ref_model\n"
              "\n"
              "    def ref_pass(self, ids):\n"
              "        if self.ref_model is None:\n"
              "            with self.model.disable_adapter():\n"
              "                ref_logits = self.model(ids).logits\n"
              "        else:\n"
              "            ref_logits = self.ref_model(ids).logits\n"
              "        return ref_logits\n",
              "the policy stands in for the reference only when there is none, its adapter off",
              capability="C11", style="class"),
        Valid("class Worker:\n"
              "    def logprobs(self, batches, tag):\n"
              "        if tag == 'ref' and self.ref_model is not None:\n"
              "            net = self.ref_model\n"
              "            net.eval()\n"
              "        else:\n"
              "            net = self.policy\n"
              "        return [net(b['ids']).logits for b in batches]\n",
              "the selected model runs the forward", capability="C11", style="class"),
        Valid("def score(policy, ref_model, ids, which):\n"
              "    m = ref_model if which == 'ref' else policy\n"
              "    m.eval()\n"
              "    with torch.no_grad():\n"
              "        return m(ids).logits\n",
              "a conditional selection that is run", capability="C11", style="functional"),
        Valid("def main(model, ref_model, ids, use_ref):\n"
              "    if use_ref:\n"
              "        net = ref_model\n"
              "    else:\n"
              "        net = model\n"
              "    net.cuda()\n"
              "    out = forward_logits(net, ids)\n"
              "    lp = model(ids).logits\n",
              "the selection is handed to a helper; the policy's own forward is another pass",
              capability="C11", style="script"),
        Valid("class Trainer:\n"
              "    def __init__(self, cfg):\n"
              "        self.ref_on_actor = cfg.model.lora_rank > 0\n"
              "\n"
              "    def step(self, batch):\n"
              "        if self.use_lora:\n"
              "            self.sync_adapter()\n"
              "        if self.ref_on_actor:\n"
              "            ref_lp = self.actor_wg.compute_ref_log_prob(batch)\n"
              "        else:\n"
              "            ref_lp = self.ref_wg.compute_ref_log_prob(batch)\n"
              "        return ref_lp\n",
              "the routing flag follows the adapter setting", capability="C11", style="framework"),
        Valid("class Trainer:\n"
              "    def __init__(self, cfg):\n"
              "        self.ref_on_actor = True\n"
              "\n"
              "    def step(self, batch):\n"
              "        if self.ref_on_actor:\n"
              "            ref_lp = self.actor_wg.compute_ref_log_prob(batch)\n"
              "        else:\n"
              "            ref_lp = self.ref_wg.compute_ref_log_prob(batch)\n"
              "        return ref_lp\n",
              "a constant flag in a module whose adapter is not optional (no branch on it)",
              capability="C11", style="framework"),
        Valid("def main(path, lr):\n"
              "    model = AutoModelForCausalLM.from_pretrained(path)\n"
              "    r = AutoModelForCausalLM.from_pretrained(path)\n"
              "    r.requires_grad_(False)\n"
              "    opt = torch.optim.AdamW(model.parameters(), lr=lr)\n"
              "    GRPOTrainer(model=model, ref_model=r, optimizer=opt).train()\n",
              "the reference is loaded a second time: its own object", capability="C2", style="script"),
        Valid("def init_model(cfg, device='cpu'):\n"
              "    model = MiniMindForCausalLM(cfg)\n"
              "    return model.to(device), Tok(cfg)\n"
              "\n"
              "def train(epoch, ref_model):\n"
              "    pass\n"
              "\n"
              "def main(cfg, lr):\n"
              "    model, tok = init_model(cfg)\n"
              "    v1, _ = init_model(cfg)\n"
              "    v1 = v1.eval().requires_grad_(False)\n"
              "    opt = torch.optim.AdamW(model.parameters(), lr=lr)\n"
              "    train(0, v1)\n",
              "a factory called twice builds two models: the one handed on as the reference is not the one the "
              "optimizer trains", capability="C1", style="script"),
        Valid("def main(path, lr):\n"
              "    model = AutoModelForCausalLM.from_pretrained(path)\n"
              "    base = model\n"
              "    r = AutoModelForCausalLM.from_pretrained(path)\n"
              "    opt = torch.optim.AdamW(model.parameters(), lr=lr)\n"
              "    base, opt, r = accelerator.prepare(base, opt, r)\n"
              "    GRPOTrainer(model=base, ref_model=r, optimizer=opt).train()\n",
              why="the alias comes back from prepare in the policy's place; the reference is a model of its own",
              capability="C2", style="script"),
        Valid("def run(cfg, load, Trainer):\n"
              "    model = load(cfg.model_path)\n"
              "    ref_model = load(cfg.model_path) if cfg.use_ref else None\n"
              "    Trainer(model=model, ref_model=ref_model, args=cfg).train()\n",
              why="a second model of its own (or none) handed as the reference", capability="C2", style="script"),
        Valid("def test_same_model_is_refused(model, args):\n"
              "    with pytest.raises(ValueError):\n"
              "        DPOTrainer(model=model, ref_model=model, args=args)\n",
              why="a test that shows the trainer refuses the policy as its reference", capability="C2",
              style="script"),
        Valid("from dataclasses import dataclass, field\n"
              "@dataclass\nclass Timing:\n    started: float = field(default=0.0, init=False, repr=False)\n",
              why="one constant handed to two keywords (`init` reads like a reference's name): no model",
              capability="C2", style="script"),
        Valid("def train(args, strategy, Actor, DPOTrainer):\n"
              "    model = Actor(args.pretrain)\n"
              "    ref_model = Actor(args.ref_pretrain)\n"
              "    (model, optim, scheduler), ref_model = strategy.prepare((model, args.optim), ref_model)\n"
              "    DPOTrainer(model=model, ref_model=ref_model, optim=optim, scheduler=scheduler).fit()\n",
              why="a nested target of an unpacked call is no element of the call's arguments: `optim` is not the "
                  "reference handed back", capability="C2", style="script"),
    ]
    INVALID = [
        Invalid("def run(cfg, load, Trainer):\n"
                "    model = load(cfg.model_path)\n"
                "    if cfg.use_ref:\n"
                "        ref_model = model\n"
                "    else:\n"
                "        ref_model = None\n"
                "    Trainer(model=model, ref_model=ref_model, args=cfg).train()\n", line=7,
                why="one object handed to one call as the model and as the reference, however the trainer is built",
                capability="C2", style="script"),
        Invalid("def main(config, trainers, tokenizer, batches):\n"
                "    policy = AutoModelForCausalLM.from_pretrained(config.path)\n"
                "    TrainerClass = getattr(trainers, config.trainer)\n"
                "    frozen = policy\n"
                "    frozen.eval()\n"
                "    TrainerClass(tokenizer, config, batches, policy=policy, reference_model=frozen).train()\n",
                line=6, why="the reference known by the keyword it is handed to, the same object as the policy "
                            "handed beside it", capability="C2", style="script"),
        Invalid("from transformers import AutoModelForCausalLM, Trainer\n"
                "class PairTrainer(Trainer):\n"
                "    def __init__(self, model, args, ref_model=None):\n"
                "        if isinstance(model, str):\n"
                "            model = AutoModelForCausalLM.from_pretrained(model)\n"
                "        self.ref_model = model\n"
                "        super().__init__(model=model, args=args)\n", line=6,
                why="the model a Trainer subclass hands to its base class is the one the framework trains, however it "
                    "was built", capability="C2", style="framework"),
        Invalid("def main(path, lr):\n"
                "    model = AutoModelForCausalLM.from_pretrained(path)\n"
                "    r = model\n"
                "    for p in r.parameters():\n"
                "        p.requires_grad = False\n"
                "    opt = torch.optim.AdamW(model.parameters(), lr=lr)\n"
                "    GRPOTrainer(model=model, ref_model=r, optimizer=opt).train()\n", line=3,
                why="handed on as ref_model=, and bound to the very object the optimizer trains (which the loop "
                    "then freezes)", capability="C2", style="script"),
        Invalid("ref_model = model\n", line=1, preview=True),
        Invalid("class Trainer:\n    def __init__(self, model):\n        self.model = model\n"
                "        self.ref_model = self.model\n", line=4, preview=True),
        Invalid("import copy\nref = copy.copy(model)\n", line=2, fixed="import copy\nref = copy.deepcopy(model)\n", preview=True),
        Invalid("import copy as cp\nref_policy = cp.copy(policy).eval()\n", line=2,
                fixed="import copy as cp\nref_policy = cp.deepcopy(policy).eval()\n", preview=True),
        Invalid("def make_ref(model):\n    return model\nreference_model = make_ref(actor)\n", line=3,
                why="helper returns its argument", preview=True),
        Invalid("opt = torch.optim.Adam(list(model.parameters()) + list(ref_model.parameters()), lr=1e-5)\n",
                line=1, why="the reference is trained"),
        Invalid("params = [{'params': policy.parameters()}, {'params': self.ref_model.parameters()}]\n"
                "optimizer = AdamW(params)\n", line=2, why="through a name"),
        Invalid("m = policy\nref_model = m.to(device).eval()\n", line=2, why="alias through in-place methods", preview=True),
        Invalid("from copy import copy\nref_model = copy(model)\n", line=2, why="shallow copy, no fix", preview=True),
        Invalid("ref_model = model.get_base_model()\n", line=1, why="PEFT base still runs the adapter", preview=True),
        Invalid("ref.load_state_dict(model.state_dict(), assign=True)\n", line=1, why="shared storage"),
        Invalid("self.ref_model = self.accelerator.unwrap_model(self.model)\n", line=1),
            # ----- C11: reference outputs produced by the policy -----
        Invalid("def kl_step(base, cfg, ids):\n"
                "    model = get_peft_model(base, LoraConfig(r=cfg.rank))\n"
                "    with torch.no_grad():\n"
                "        ref_logits = model(ids).logits\n"
                "    logits = model(ids).logits\n"
                "    return logits, ref_logits\n", line=4,
                why="the adapter is trained and still on for the reference pass", capability="C11",
                style="functional", preview=True),
        Invalid("class KLTrainer:\n"
                "    def __init__(self, model, ref_model):\n"
                "        self.model = model\n"
                "        self.ref_model = ref_model\n"
                "\n"
                "    def ref_pass(self, ids):\n"
                "        with torch.no_grad():\n"
                "            ref_logits = self.model(ids).logits\n"
                "        return ref_logits\n", line=8,
                why="reference logits from the policy while a reference model exists", capability="C11",
                style="class", preview=True),
        Invalid("class Worker:\n"
                "    def logprobs(self, batches, tag):\n"
                "        if tag == 'ref' and self.ref_model is not None:\n"
                "            net = self.ref_model\n"
                "            net.eval()\n"
                "        else:\n"
                "            net = self.policy\n"
                "        out = []\n"
                "        for b in batches:\n"
                "            out.append(self.policy(b['ids']).logits)\n"
                "        return out\n", line=10,
                why="the reference is selected, the policy runs", capability="C11", style="class"),
        Invalid("def score(policy, ref_model, ids, which):\n"
                "    m = ref_model if which == 'ref' else policy\n"
                "    m.eval()\n"
                "    with torch.no_grad():\n"
                "        return policy(ids).logits\n", line=5,
                why="a conditional selection never run", capability="C11", style="functional"),
        Invalid("def main(model, ref_model, ids, use_ref):\n"
                "    if use_ref:\n"
                "        net = ref_model\n"
                "    else:\n"
                "        net = model\n"
                "    net.cuda()\n"
                "    with torch.no_grad():\n"
                "        ref_out = model.generate(ids)\n", line=8,
                why="reference generations from the policy", capability="C11", style="script"),
        Invalid("class Trainer:\n"
                "    def __init__(self, cfg):\n"
                "        self.use_lora = cfg.model.lora_rank > 0\n"
                "        self.ref_on_actor = True\n"
                "\n"
                "    def step(self, batch):\n"
                "        if self.use_lora:\n"
                "            self.sync_adapter()\n"
                "        if self.ref_on_actor:\n"
                "            ref_lp = self.actor_wg.compute_ref_log_prob(batch)\n"
                "        else:\n"
                "            ref_lp = self.ref_wg.compute_ref_log_prob(batch)\n"
                "        return ref_lp\n", line=4,
                why="a constant flag always takes reference log-probs from the actor, LoRA optional",
                capability="C11", style="framework", preview=True),
        Invalid("class Pipeline:\n"
                "    def setup(self, cfg):\n"
                "        self.separate_ref = False\n"
                "        if cfg.peft is not None:\n"
                "            self.wrap()\n"
                "\n"
                "    def ref_pass(self, data):\n"
                "        if self.separate_ref:\n"
                "            ref_logp = self.ref_worker.infer(data)\n"
                "        else:\n"
                "            ref_logp = self.actor_worker.infer(data)\n"
                "        return ref_logp\n", line=3,
                why="the flag, False, always selects the actor branch", capability="C11", style="framework", preview=True),
        Invalid("class Scorer:\n"
                "    def ref_logits(self, ids, use_frozen):\n"
                "        chosen = self.actor\n"
                "        if use_frozen:\n"
                "            chosen = self.ref_model\n"
                "        chosen.to(ids.device)\n"
                "        return self.actor.forward(ids).logits\n", line=7,
                why="a chosen model moved but the actor runs", capability="C11", style="class"),
        Invalid("def main(path, lr):\n"
                "    model = AutoModelForCausalLM.from_pretrained(path)\n"
                "    r = model\n"
                "    opt = torch.optim.AdamW(model.parameters(), lr=lr)\n"
                "    model, opt, r = accelerator.prepare(model, opt, r)\n"
                "    GRPOTrainer(model=model, ref_model=r, optimizer=opt).train()\n", line=3,
                why="the alias goes through accelerator.prepare, which hands each object back in its place, and on "
                    "as ref_model=", capability="C2", style="script"),
    ]

    def check(self, ctx: Analysis) -> Iterator[Violation]:
        yield from self._reference_outputs(ctx)
        model_of = models(ctx)
        objs = objects(ctx)
        names = ctx.names
        ref_roots: set = set()

        # 1. a reference bound to the policy
        for stmt in ctx.nodes(cst.Assign, cst.AnnAssign):
            for d in ctx.index.stmt_defs.get(id(stmt), ()):
                if d.kind != "assign" or d.value is None or not (
                        names.is_role(_bare(d.key), "ref_model") or _reference_by_interface(ctx, d)):
                    continue
                value = d.value if d.element is None else _element(d.value, d.element)
                if value is None:
                    continue
                found = objs.value(value)
                if isinstance(found, Tup) or not found:
                    continue
                verdict = _aliasing(ctx, model_of, value, found)
                if verdict is None:
                    ref_roots |= {o.key for o in found}  # a reference object of its own
                    continue
                kind, node = verdict
                if kind == "copy":
                    yield Violation(node, "copy.copy(...) is a shallow copy: the reference shares the policy's "
                                          "parameters and moves with every step; use copy.deepcopy(...)",
                                    _deepcopy_fix(ctx, node))
                elif kind == "peft":
                    yield Violation(node, "get_base_model() returns the PEFT model's base with the LoRA layers "
                                          "injected in place, so the reference runs the adapter; compute reference "
                                          "log-probs under `with model.disable_adapter():`")
                else:
                    yield Violation(value, "the reference model is the live policy object, so the KL to it is "
                                           "always 0; use copy.deepcopy(model).eval() or load a separate copy")

        # 1b. one call handed the same object as its reference and as another of its arguments (`Trainer(
        # model=m, ref_model=m)`, through any chain of aliases): whatever the callee does, its reference is the model
        yield from _handed_twice(ctx, objs)

        def is_ref(expr) -> bool:
            found = objs.value(expr)
            if isinstance(found, Tup):
                return False
            return bool({o.key for o in found} & ref_roots) or any(names.is_role(n, "ref_model")
                                                                   for o in found for n in _binding_names(o))

        for call in ctx.nodes(cst.Call):
            # 2. the reference's parameters in an optimizer
            name = ctx.call_name(call) or ""
            last = name.rsplit(".", 1)[-1]
            method = ctx.method(call)
            if method == "add_param_group" or (S.OPTIMIZER_CLASS.fullmatch(last) and (
                    last[:1].isupper() or name.startswith("torch.optim"))):
                for arg in call.args:
                    if _ref_parameters(ctx, arg.value, is_ref) is not None:
                        yield Violation(call, "the reference model's parameters are given to the optimizer, so the "
                                              "reference is trained along with the policy; optimise only the "
                                              "policy's parameters and freeze the reference")
                        break
            # 3. load_state_dict(..., assign=True) from the policy
            elif method == "load_state_dict" and S.literal_bool(S.argument(call, None, "assign")) is True:
                recv = S.receiver(call)
                source = S.argument(call, 0, "state_dict")
                if recv is not None and is_ref(recv) and isinstance(source, cst.Call) and ctx.method(
                        source) == "state_dict":
                    src_model = model_of.model(S.receiver(source))
                    if src_model is not None and src_model.role in ("policy", "model"):
                        yield Violation(call, "load_state_dict(..., assign=True) makes the reference's parameters "
                                              "the policy's own tensors (shared storage); drop assign=True to copy "
                                              "values")


    def _reference_outputs(self, ctx: Analysis) -> Iterator[Violation]:
        # 4. a reference selected into a local that is never run, the policy run instead (C11)
        for func in ctx.nodes(cst.FunctionDef):
            for sel in unused_selections(ctx, func):
                yield Violation(sel.call, f"`{sel.selected}` selects the reference model ({ctx.code(sel.reference)}) "
                                          f"but is never run: this forward runs the policy, so the reference "
                                          f"outputs are the policy's own and the KL is 0; call `{sel.selected}(...)`")
        # 6. a reference-named output computed by the policy's forward while a reference model is in scope (C11)
        for found in policy_reference_outputs(ctx):
            if found.reference is not None:
                yield Violation(found.forward, f"`{found.target}` is computed by the policy's forward although a "
                                               f"reference model ({found.reference}) is in scope: the reference "
                                               f"outputs are the policy's own and the KL is 0; run the reference model")
            else:
                yield Violation(found.forward, f"`{found.target}` is computed by the policy with its adapter on (the "
                                               f"module trains a PEFT adapter): the reference outputs are the "
                                               f"policy's own and the KL is 0; compute them under `with "
                                               f"model.disable_adapter():`")
        # 5. a constant flag that always takes reference outputs from the actor, adapters optional (C11)
        for routing in constant_routings(ctx):
            yield Violation(routing.assign, f"`{routing.flag}` is a constant, so reference outputs always come from "
                                            f"`{ctx.code(routing.live.func)}` (the actor with its adapter "
                                            f"disabled); without an adapter that is the live policy and the KL is 0: "
                                            f"derive the flag from the adapter setting")


def _handed_twice(ctx: Analysis, objs) -> Iterator[Violation]:
    for value, name, call in [*handed_values(ctx), *_positional_elsewhere(ctx, objs)]:
        if not ctx.names.is_role(name, "ref_model") or ctx.expects_error(call):
            continue
        found = objs.value(value)
        if not found or isinstance(found, Tup):
            continue
        # objects a call may be handed twice without sharing a model: constants and globals (`None` where a
        # branch has no reference, `init=False, repr=False`)
        roots = frozenset(o.key for o in found if o.kind != "global")
        if not roots or any(o.kind == "global" and o.key != "None" for o in found):
            continue
        for arg in call.args:
            if arg.value is value or arg.star or (arg.keyword is not None and ctx.names.is_role(
                    arg.keyword.value, "ref_model")):
                continue
            other = objs.value(arg.value)
            if other and not isinstance(other, Tup) and roots <= frozenset(o.key for o in other
                                                                           if o.kind != "global"):
                what = "a shallow copy of" if any(o.kind == "copy" for o in found) else "the very object"
                yield Violation(value, f"`{ctx.code(value)}` is {what} the object this call is also handed as "
                                       f"`{ctx.code(arg.value)}`: the reference is the live policy (its "
                                       f"parameters), so the KL to it is always 0; load a separate copy or use "
                                       f"copy.deepcopy(...).eval()")
                break


def _positional_elsewhere(ctx: Analysis, objs) -> list:
    """(value, parameter, call) for the positional arguments of a call into another file of the linted tree (a
    function, or a class's ``__init__``) when the call is handed one object twice: the callee's parameter names
    are its interface. Asked only of such calls: the summary lookup is a parse of the other file."""
    found = []
    if ctx.project is None:
        return found
    for call in ctx.nodes(cst.Call):
        positional = [arg for arg in call.args if arg.keyword is None and not arg.star]
        # the cheap tests first: two arguments that name objects, an imported callee not of this module
        if len(positional) < 2 or sum(isinstance(arg.value, (cst.Name, cst.Attribute)) for arg in call.args) < 2:
            continue
        dotted = dotted_name(call.func)
        if dotted is None or ctx.resolve_import(dotted) is None or ctx.callee(call) is not None:
            continue
        roots = []
        for arg in call.args:
            got = objs.value(arg.value) if not arg.star else None
            roots.append(frozenset(o.key for o in got if o.kind != "global") if got and not isinstance(
                got, Tup) else frozenset())
        if not any(r and any(r <= other for j, other in enumerate(roots) if j != i) for i, r in enumerate(roots)):
            continue
        params = _callee_parameters(ctx, call)
        for param, arg in zip(params, positional):
            found.append((arg.value, param, call))
    return found


def _callee_parameters(ctx: Analysis, call: cst.Call) -> list[str]:
    """The positional parameters of the other-file function or class a call runs (``self`` left out)."""
    dotted = dotted_name(call.func)
    qualified = ctx.resolve_import(dotted) if dotted else None
    if qualified is None:
        return []
    summary = ctx.project.get(qualified) or ctx.project.get(f"{qualified}.__init__")
    if summary is None:
        return []
    params = list(summary.params)
    return params[1:] if params[:1] in (["self"], ["cls"]) else params


def _binding_names(obj) -> tuple[str, ...]:
    """The names an object is bound to. For an object built by a call, the call's own name (its first name) is what
    the factory does, not the object's role (``model = init_model(cfg)`` is no "initial model" reference) unless it
    is the only name there is."""
    if (obj.kind in ("new", "opaque") or obj.key.startswith(("new@", "call@"))) and len(obj.names) > 1:
        return obj.names[1:]
    return obj.names


def _bare(key: str) -> str:
    return key.rsplit(".", 1)[-1]


def _element(value: cst.BaseExpression, position: int) -> cst.BaseExpression | None:
    if isinstance(value, (cst.Tuple, cst.List)) and position < len(value.elements):
        return value.elements[position].value
    return None


def _reference_by_interface(ctx: Analysis, d, depth: int = 2) -> bool:
    """Whether the model bound by ``d`` is handed on as the reference (``Trainer(ref_model=r)``, a parameter or
    string key named for it): its role by the interface it meets, which renaming the variable does not change. The
    object keeps its interface through a call that hands its arguments back in order (``model, r =
    accelerator.prepare(model, r)``: the new binding is the same object)."""
    if interface_names(ctx, d, lambda name: ctx.names.is_role(name, "ref_model")):
        return True
    return depth > 0 and any(_reference_by_interface(ctx, later, depth - 1) for later in _handed_back(ctx, d))


def _handed_back(ctx: Analysis, d) -> list:
    """The bindings of an element of a call's result that is the object ``d`` bound, handed back in place: the
    objects analysis reads the call as a tuple of its arguments' objects (``accelerator.prepare(a, b)``), and
    argument ``i``, a read ``d`` reaches, comes back as element ``i``."""
    def build(an):
        by_key: dict[str, list] = {}
        for stmt in an.nodes(cst.Assign):
            value = stmt.value
            if not isinstance(value, cst.Call) or len(value.args) < 2:
                continue
            for later in an.index.stmt_defs.get(id(stmt), ()):
                if later.kind == "assign" and later.element is not None and later.value is value and \
                        later.element < len(value.args):
                    arg = value.args[later.element]
                    key = key_of(arg.value) if not arg.star and arg.keyword is None else None
                    if key is not None:
                        by_key.setdefault(key, []).append((arg.value, later))
        return by_key
    found = []
    for read, later in ctx.facet("rlg008_handed_back", build).get(d.key, ()):
        if any(r is d for r in ctx.flow.reaching(d.key, read)) and isinstance(objects(ctx).value(later.value), Tup):
            found.append(later)
    return found


def _aliasing(ctx: Analysis, model_of, value, found):
    """("alias", value) when every root of the reference is the policy's own object, ("copy", call) for a
    shallow copy of it, ("peft", call) for its PEFT base; None otherwise (a new object, or no telling)."""
    kinds = {o.kind for o in found}
    if kinds <= {"copy"} or kinds <= {"peft"}:
        inner_roots = frozenset(o.key for o in found)
        names = tuple(n for o in found for n in o.names)
        role = model_of._role(found, names) if names else "model"
        if role in ("policy", "model") and (any(ctx.names.is_role(n, "policy") for n in names) or
                                            inner_roots & model_of.trained_roots()):
            node = objects(ctx).facet.calls.get(next(iter(found)).node_id)
            return (next(iter(kinds)), node) if node is not None else None
        return None
    if isinstance(value, (cst.Name, cst.Attribute)) and "new" in kinds and \
            frozenset(o.key for o in found) <= model_of.trained_roots():
        # `ref_model = model` where `model` is the object whose parameters the optimizer trains: the same
        # object, however it was built
        return "alias", value
    if kinds & {"new", "opaque", "copy", "peft"}:
        return None
    roots = frozenset(o.key for o in found)
    if all(k.startswith(("new@", "call@")) for k in roots) and not roots & model_of.trained_roots():
        return None  # an element of what a factory call built (`ref, _ = init_model(cfg)`): an object of its own
    ref = model_of.model(value)
    if ref is None or ref.role != "policy":
        return None
    return "alias", value


def _ref_parameters(ctx: Analysis, expr, is_ref, depth: int = 3):
    """A ``ref.parameters()`` call inside ``expr`` (following names a few assignments back), or None."""
    stack = [(expr, depth)]
    seen = 0
    while stack and seen < WALK_LIMIT:
        node, d = stack.pop()
        seen += 1
        if isinstance(node, cst.Call) and ctx.method(node) in PARAMS_METHODS:
            recv = S.receiver(node)
            if recv is not None and is_ref(recv):
                return node
        if isinstance(node, cst.Name) and d > 0:
            for defn in ctx.flow.reaching(node.value, node):
                if defn.kind == "assign" and defn.value is not None:
                    stack.append((defn.value, d - 1))
            continue
        if isinstance(node, (cst.Call, cst.List, cst.Tuple, cst.Dict, cst.Element, cst.DictElement, cst.Arg,
                             cst.BinaryOperation, cst.ListComp, cst.GeneratorExp, cst.CompFor, cst.Attribute,
                             cst.StarredElement, cst.StarredDictElement, cst.Lambda, cst.Subscript,
                             cst.SubscriptElement, cst.Index)):
            stack.extend((child, d) for child in children(node))
    return None


def _deepcopy_fix(ctx: Analysis, call: cst.Call):
    func = call.func
    if isinstance(func, cst.Attribute) and isinstance(func.value, cst.Name) and func.attr.value == "copy" and (
            ctx.index.imports.get(func.value.value) == "copy"):
        return [(func.attr, func.attr.with_changes(value="deepcopy"))]
    return []
