"""RLG008 reference-alias: the KL reference model is the live policy (alias, shallow copy, shared parameters,
trained by the optimizer, PEFT adapter left on)."""

from __future__ import annotations

import re
from typing import Iterator

import libcst as cst

from rlguard.lint.context import ModuleContext, argument, dotted_name, method_name, receiver, value_name
from rlguard.lint.rule import Invalid, Rule, Valid, Violation
from rlguard.lint.rules._signs import reaching

# Calls and methods that hand back the very same module object (nn.Module.to/half/eval... work in place).
SAME_OBJECT_METHODS = frozenset({"eval", "train", "to", "cuda", "cpu", "half", "float", "double", "bfloat16",
                                 "requires_grad_", "to_empty", "type", "unwrap_model", "compile"})
SAME_OBJECT_FUNCTIONS = frozenset({"torch.compile"})
OPTIMIZER_NAME = re.compile(r"(?i)(\w*adam\w*|sgd|rmsprop|adagrad|adadelta|adamax|lion|adafactor|lamb|lars|"
                            r"\w*optimizer|\w*optimiser)")
PARAMS_METHODS = frozenset({"parameters", "named_parameters"})
WALK_LIMIT = 200


class ReferenceAlias(Rule):
    """
    ## What it flags
    A KL reference model that is the live policy, or shares its weights:

    - an alias: `ref_model = model`, `self.ref_model = self.model`, `ref = policy.eval()` (`eval()`, `.to()`,
      `.half()` work in place and return the same module), `ref = accelerator.unwrap_model(model)`, or a helper of
      the same module that returns its argument (`def make_ref(model): return model`);
    - a shallow copy: `ref = copy.copy(model)` (the copy's parameters *are* the policy's tensors);
    - `ref = model.get_base_model()` on a PEFT model: LoRA layers are injected in place, so the "base" still runs
      the adapter;
    - shared storage: `ref.load_state_dict(model.state_dict(), assign=True)`;
    - the reference's parameters handed to an optimizer: `torch.optim.Adam(list(model.parameters()) +
      list(ref_model.parameters()))`, `optimizer.add_param_group({"params": ref.parameters()})`.

    Not flagged: `copy.deepcopy(model).eval()`, `AutoModelForCausalLM.from_pretrained(...)`,
    `create_reference_model(model)` (TRL), `ref_model = None` with `with model.disable_adapter():` (the PEFT way),
    `ref_model.load_state_dict(model.state_dict())` (a copy). An `a if cond else model` fallback is not flagged.

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

    code = "RLG008"
    # every branch starts with a literal (fast to scan): a reference-model name, or a bare `ref = <policy-ish>`
    triggers = (r"ref(?:erence)?(?:_?(?:model|policy|net|module|actor|lm)\b|\s*=\s*[^=\n]*(?:model|policy|actor|"
                r"copy\(|net\b|agent)|\.(?:named_)?parameters\(|\.load_state_dict)|frozen_(?:model|policy)"
                r"|init(?:ial)?_(?:model|policy)")
    fixable = True

    VALID = [
        Valid("import copy\nref = copy.deepcopy(model).eval()\n", "a deep copy"),
        Valid("ref_model = AutoModelForCausalLM.from_pretrained(name)\n", "loaded separately"),
        Valid("from trl import create_reference_model\nref_model = create_reference_model(model)\n",
              "TRL helper from another module"),
        Valid("ref_model = None\nwith model.disable_adapter():\n    ref_logits = model(ids).logits\n",
              "PEFT: adapter disabled for the reference pass"),
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
    ]
    INVALID = [
        Invalid("ref_model = model\n", line=1),
        Invalid("class Trainer:\n    def __init__(self, model):\n        self.model = model\n"
                "        self.ref_model = self.model\n", line=4),
        Invalid("import copy\nref = copy.copy(model)\n", line=2, fixed="import copy\nref = copy.deepcopy(model)\n"),
        Invalid("import copy as cp\nref_policy = cp.copy(policy).eval()\n", line=2,
                fixed="import copy as cp\nref_policy = cp.deepcopy(policy).eval()\n"),
        Invalid("def make_ref(model):\n    return model\nreference_model = make_ref(actor)\n", line=3,
                why="helper returns its argument"),
        Invalid("opt = torch.optim.Adam(list(model.parameters()) + list(ref_model.parameters()), lr=1e-5)\n",
                line=1, why="the reference is trained"),
        Invalid("params = [{'params': policy.parameters()}, {'params': self.ref_model.parameters()}]\n"
                "optimizer = AdamW(params)\n", line=2, why="through a name"),
        Invalid("m = policy\nref_model = m.to(device).eval()\n", line=2, why="alias through in-place methods"),
        Invalid("from copy import copy\nref_model = copy(model)\n", line=2, why="shallow copy, no fix"),
        Invalid("ref_model = model.get_base_model()\n", line=1, why="PEFT base still runs the adapter"),
        Invalid("ref.load_state_dict(model.state_dict(), assign=True)\n", line=1, why="shared storage"),
        Invalid("self.ref_model = self.accelerator.unwrap_model(self.model)\n", line=1),
    ]

    def check(self, ctx: ModuleContext) -> Iterator[Violation]:
        names = ctx.names

        def is_ref(name):
            return name is not None and names.is_role(name, "ref_model")

        # 1. a reference bound to the policy
        for target, value in _bindings(ctx):
            if not is_ref(value_name(target)):
                continue
            found = _aliased_policy(ctx, value, 10)
            if found is None:
                continue
            kind, node = found
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

        for call in ctx.nodes(cst.Call):
            # 2. the reference's parameters in an optimizer
            name = ctx.call_name(call) or ""
            last = name.rsplit(".", 1)[-1]
            method = method_name(call)
            if method == "add_param_group" or (OPTIMIZER_NAME.fullmatch(last) and (
                    last[:1].isupper() or name.startswith("torch.optim"))):
                for arg in call.args:
                    hit = _ref_parameters(ctx, arg.value, is_ref)
                    if hit is not None:
                        yield Violation(call, "the reference model's parameters are given to the optimizer, so the "
                                              "reference is trained along with the policy; optimise only the "
                                              "policy's parameters and freeze the reference")
                        break
            # 3. load_state_dict(..., assign=True) from the policy
            elif method == "load_state_dict" and _is_true(argument(call, None, "assign")):
                recv = receiver(call)
                source = argument(call, 0, "state_dict")
                if recv is not None and _chain_has(recv, is_ref) and isinstance(source, cst.Call) and method_name(
                        source) == "state_dict" and _aliased_policy(ctx, receiver(source), 10) is not None:
                    yield Violation(call, "load_state_dict(..., assign=True) makes the reference's parameters the "
                                          "policy's own tensors (shared storage); drop assign=True to copy values")


def _bindings(ctx: ModuleContext):
    """(target, value) for every ``target = value``, tuples split element-wise when both sides are tuples."""
    for stmt in ctx.nodes(cst.Assign, cst.AnnAssign):
        targets = [t.target for t in stmt.targets] if isinstance(stmt, cst.Assign) else [stmt.target]
        if stmt.value is None:
            continue
        for target in targets:
            if isinstance(target, (cst.Tuple, cst.List)):
                if isinstance(stmt.value, (cst.Tuple, cst.List)) and len(stmt.value.elements) == len(target.elements):
                    for t, v in zip(target.elements, stmt.value.elements):
                        yield t.value, v.value
            else:
                yield target, stmt.value


def _aliased_policy(ctx: ModuleContext, expr, depth: int):
    """("alias", node) when ``expr`` is the policy object itself, ("copy", call) for a shallow copy of it,
    ("peft", call) for a PEFT base model of it; None otherwise."""
    if expr is None or depth < 0:
        return None
    names = ctx.names
    if isinstance(expr, cst.Call):
        qual = ctx.call_name(expr) or ""
        method = method_name(expr)
        if qual == "copy.copy" and expr.args:
            inner = _aliased_policy(ctx, expr.args[0].value, depth - 1)
            return ("copy", expr) if inner is not None and inner[0] == "alias" else inner
        if method == "get_base_model":
            inner = _aliased_policy(ctx, receiver(expr), depth - 1)
            return ("peft", expr) if inner is not None else None
        if method in SAME_OBJECT_METHODS and method not in ("unwrap_model", "compile"):
            return _aliased_policy(ctx, receiver(expr), depth - 1)
        if (method in ("unwrap_model", "compile") or qual in SAME_OBJECT_FUNCTIONS) and expr.args:
            return _aliased_policy(ctx, expr.args[0].value, depth - 1)
        if isinstance(expr.func, cst.Name) and len(ctx.functions.get(expr.func.value, ())) == 1:
            fdef = ctx.functions[expr.func.value][0]
            if not ctx.contains(fdef, expr):
                for ret in ctx.helper_return_values(expr):
                    inner = _aliased_policy(ctx, ret, depth - 1)
                    if inner is not None:
                        return inner
        return None
    if isinstance(expr, (cst.Name, cst.Attribute, cst.Subscript)):
        name = value_name(expr)
        if name is None:
            return None
        if names.is_role(name, "policy") and not names.is_role(name, "ref_model"):
            return ("alias", expr)
        key = dotted_name(expr)
        if key is not None and (isinstance(expr, cst.Name) or key.startswith("self.")):
            for a in reaching(ctx, key, expr):
                if a.value is not None and a.unpacked is None:
                    inner = _aliased_policy(ctx, a.value, depth - 1)
                    if inner is not None:
                        return inner
    return None


def _chain_has(expr, pred) -> bool:
    """Whether any name along ``a.b.c`` (or ``self.x``) satisfies ``pred``."""
    while True:
        if pred(value_name(expr)):
            return True
        if isinstance(expr, (cst.Attribute, cst.Subscript)):
            expr = expr.value
        elif isinstance(expr, cst.Call) and isinstance(expr.func, cst.Attribute):
            expr = expr.func.value
        else:
            return False


def _ref_parameters(ctx: ModuleContext, expr, is_ref, depth: int = 3):
    """A ``ref.parameters()`` call inside ``expr`` (following names a few assignments back), or None."""
    stack = [(expr, depth)]
    seen = 0
    while stack and seen < WALK_LIMIT:
        node, d = stack.pop()
        seen += 1
        if isinstance(node, cst.Call) and method_name(node) in PARAMS_METHODS:
            recv = receiver(node)
            if recv is not None and (_chain_has(recv, is_ref) or ctx.has_role(recv, "ref_model")):
                return node
        if isinstance(node, cst.Name) and d > 0:
            for a in reaching(ctx, node.value, node):
                if a.value is not None:
                    stack.append((a.value, d - 1))
            continue
        if isinstance(node, (cst.Call, cst.List, cst.Tuple, cst.Dict, cst.Element, cst.DictElement, cst.Arg,
                             cst.BinaryOperation, cst.ListComp, cst.GeneratorExp, cst.CompFor, cst.Attribute,
                             cst.StarredElement, cst.StarredDictElement, cst.Lambda, cst.Subscript,
                             cst.SubscriptElement, cst.Index)):
            stack.extend((child, d) for child in node.children)
    return None


def _is_true(expr) -> bool:
    return isinstance(expr, cst.Name) and expr.value == "True"


def _deepcopy_fix(ctx: ModuleContext, call: cst.Call):
    func = call.func
    if isinstance(func, cst.Attribute) and isinstance(func.value, cst.Name) and func.attr.value == "copy" and (
            ctx.imports.get(func.value.value) == "copy"):
        return [(func.attr, func.attr.with_changes(value="deepcopy"))]
    return []
