"""Reference outputs produced by the policy (capability C11).

RLG008's bindings check looks at what a reference-model *name* is bound to. A reference *output* can also come
from the policy while a distinct reference exists:

- :func:`unused_selections`: a function selects a model into a local (``m = self.ref if tag == "ref" else
  self.policy``, or the same in two branches), never runs the selected local (only moves it: ``m.eval()``,
  ``m.cuda()``), and runs the policy's forward instead. The selection is dead; the reference pass runs the policy.
- :func:`constant_routings`: a flag attribute bound once, to a literal, that decides between a separate reference
  worker and the actor for a reference output (``if not self.F: ref = self.ref_wg.m(b) else: ref =
  self.actor_wg.m(b)``), while the module shows adapters are optional (a branch on a LoRA/adapter flag). The flag
  makes the reference "the actor with its adapter disabled" even when there is no adapter: the live policy.

Roles come from the models facet (object identity, optimiser membership; names only as the facet's hint); a
trace that fails reports nothing.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import libcst as cst

from rlguard.lint.analysis import semantics as S
from rlguard.lint.analysis.index import key_of, last_name
from rlguard.lint.analysis.provenance import forwards, models

_REF_WORD = re.compile(r"(?i)(^|_)(ref|reference)(_|$)")
_ACTOR_WORD = re.compile(r"(?i)(^|_)(actor|policy)(_|$)")
_ADAPTER_WORD = re.compile(r"(?i)lora|adapter|peft")


@dataclass(frozen=True)
class UnusedSelection:
    call: cst.Call  # the forward that runs the policy
    selected: str  # the local the reference was selected into
    reference: cst.BaseExpression  # the reference value selected


def _loads(ctx, func, name: str) -> list[cst.Name]:
    out = []
    for node in ctx.index.descendants(func, cst.Name):
        if node.value != name:
            continue
        parent = ctx.index.parent_of(node)
        if isinstance(parent, cst.AssignTarget) and parent.target is node:
            continue
        if isinstance(parent, cst.Attribute) and parent.attr is node:
            continue
        if isinstance(parent, (cst.Param, cst.Arg)) and getattr(parent, "keyword", None) is node:
            continue
        out.append(node)
    return out


def _only_moved(ctx, use: cst.Name) -> bool:
    """``m.eval()`` / ``m.cuda()`` / ``m.to(d)``: housekeeping that does not run the model."""
    parent = ctx.index.parent_of(use)
    if not (isinstance(parent, cst.Attribute) and parent.value is use):
        return False
    call = ctx.index.parent_of(parent)
    return isinstance(call, cst.Call) and call.func is parent and parent.attr.value in S.SAME_MODULE_METHODS


def _forward_receiver(ctx, call: cst.Call):
    """The model a call runs: ``m(...)``, ``m.forward(...)``, ``m.generate(...)``; else None."""
    func = call.func
    if isinstance(func, cst.Attribute) and func.attr.value in ("forward", "generate"):
        return func.value
    if isinstance(func, (cst.Name, cst.Attribute)):
        return func
    return None


def unused_selections(ctx, func: cst.FunctionDef) -> list[UnusedSelection]:
    mods = models(ctx)
    by_name: dict[str, list] = {}
    for stmt in ctx.index.descendants(func, cst.Assign):
        for d in ctx.index.stmt_defs.get(id(stmt), ()):
            if d.kind == "assign" and d.value is not None and d.element is None and "." not in d.key and (
                    "[" not in d.key):
                by_name.setdefault(d.key, []).append(d)
    found = []
    for name, defs in by_name.items():
        # the candidates: values of two or more bindings, or the arms of one conditional expression
        values = [d.value for d in defs]
        if len(defs) == 1 and isinstance(defs[0].value, cst.IfExp):
            values = [defs[0].value.body, defs[0].value.orelse]
        if len(values) < 2:
            continue
        refs = []
        policies = []
        for value in values:
            m = mods.model(value)
            if m is None:
                refs = []
                break
            (refs if m.role == "reference" else policies if m.role in ("policy", "model") else []).append(value)
        if not refs or not policies:
            continue
        uses = _loads(ctx, func, name)
        if not uses or not all(_only_moved(ctx, u) for u in uses):
            continue
        policy_texts = {ctx.code(p).replace(" ", "") for p in policies}
        last_def = max(defs, key=lambda d: d.order)
        for call in ctx.index.descendants(func, cst.Call):
            recv = _forward_receiver(ctx, call)
            if recv is None or ctx.code(recv).replace(" ", "") not in policy_texts:
                continue
            if not ctx.index.comes_before(last_def.stmt, call):
                continue
            m = mods.model(recv)
            if m is not None and m.role in ("policy", "model"):
                found.append(UnusedSelection(call, name, refs[0]))
                break
    return found


@dataclass(frozen=True)
class ConstantRouting:
    assign: cst.Assign  # ``self.F = True``
    flag: str
    live: cst.Call  # the reference output's producer the constant always selects


def _flag_test(test, flag: str) -> bool | None:
    """True when ``test`` is ``self.F``, False when ``not self.F``, None otherwise."""
    if isinstance(test, cst.UnaryOperation) and isinstance(test.operator, cst.Not):
        inner = _flag_test(test.expression, flag)
        return None if inner is None else not inner
    return True if key_of(test) == flag else None


def _branch_call(block) -> tuple[str, cst.Call] | None:
    """A branch that is one assignment of a method call: (target key, call)."""
    body = getattr(block, "body", None)
    if not body or len(body) != 1 or not isinstance(body[0], cst.SimpleStatementLine) or len(body[0].body) != 1:
        return None
    stmt = body[0].body[0]
    if not isinstance(stmt, cst.Assign) or len(stmt.targets) != 1 or not isinstance(stmt.value, cst.Call):
        return None
    key = key_of(stmt.targets[0].target)
    if key is None or not isinstance(stmt.value.func, cst.Attribute):
        return None
    return key, stmt.value


def constant_routings(ctx) -> list[ConstantRouting]:
    flags: dict[str, list] = {}
    for stmt in ctx.nodes(cst.Assign, cst.AnnAssign, cst.AugAssign):
        for d in ctx.index.stmt_defs.get(id(stmt), ()):
            if d.key.startswith("self."):
                flags.setdefault(d.key, []).append((stmt, d))
    adapters_optional = any(
        _ADAPTER_WORD.search(ctx.code(node.test)) for node in ctx.nodes(cst.If))
    if not adapters_optional:
        return []
    out = []
    for flag, binds in flags.items():
        if len(binds) != 1:
            continue
        stmt, d = binds[0]
        value = S.literal_bool(d.value) if isinstance(stmt, cst.Assign) else None
        if value is None or _ADAPTER_WORD.search(flag):
            continue
        for node in ctx.nodes(cst.If):
            polarity = _flag_test(node.test, flag)
            if polarity is None or not isinstance(node.orelse, cst.Else):
                continue
            yes, no = _branch_call(node.body), _branch_call(node.orelse.body)
            if yes is None or no is None or yes[0] != no[0]:
                continue
            live, dead = (yes[1], no[1]) if polarity == value else (no[1], yes[1])
            if live.func.attr.value != dead.func.attr.value:
                continue
            target, method = yes[0].rsplit(".", 1)[-1], live.func.attr.value
            if not (_REF_WORD.search(target) or _REF_WORD.search(method) or ctx.names.is_role(target, "ref_logp")):
                continue
            live_recv = (key_of(live.func.value) or "").rsplit(".", 1)[-1]
            dead_recv = (key_of(dead.func.value) or "").rsplit(".", 1)[-1]
            if _ACTOR_WORD.search(live_recv) and not _REF_WORD.search(live_recv) and _REF_WORD.search(dead_recv):
                out.append(ConstantRouting(stmt, flag, live))
                break
    return out


# outputs named as the reference's (log-probs come from the vocabulary's ref_logp role)
REF_OUTPUT = re.compile(r"(?i)(ref|reference)_?(logits|outputs?|out|hidden_states|logits_\w+)")


@dataclass(frozen=True)
class PolicyReferenceOutput:
    assign: cst.CSTNode  # the statement binding the reference-named output
    target: str
    forward: cst.Call  # the policy forward it comes from
    reference: str | None  # the distinct reference object in scope; None: the module trains an adapter


def _reference_in_scope(ctx, mods, func) -> tuple[str, frozenset] | None:
    """A reference model the function refers to, or one its class holds as an attribute (``self.ref_model``; a
    local of another method is not in scope): (its text, its roots)."""
    scopes = [func]
    cls = ctx.enclosing_class(func)
    if cls is not None:
        scopes.append(cls)
    for scope in scopes:
        for node in ctx.index.descendants(scope, cst.Attribute, cst.Name):
            if isinstance(node, cst.Name):
                parent = ctx.index.parent_of(node)
                if isinstance(parent, cst.Attribute) or scope is not func:
                    continue
            key = key_of(node)
            if scope is not func and (key is None or not key.startswith("self.")):
                continue
            if key is None or not ctx.names.is_role(key.rsplit(".", 1)[-1], "ref_model"):
                continue
            m = mods.model(node)
            if m is not None and m.role == "reference":
                return ctx.code(node), m.roots
    return None


def policy_reference_outputs(ctx) -> list[PolicyReferenceOutput]:
    """A reference-named output (``ref_logps``, ``ref_logits``) whose every forward is the policy's, in a function
    that has a distinct reference model in scope, outside any branch on the reference and any adapter-disabling
    context."""
    mods = models(ctx)
    out = []
    for stmt in ctx.nodes(cst.Assign):
        if len(stmt.targets) != 1:
            continue
        key = key_of(stmt.targets[0].target)
        if key is None:
            continue
        name = last_name(key)
        if not (ctx.names.is_role(name, "ref_logp") or REF_OUTPUT.fullmatch(name)):
            continue
        func = ctx.enclosing_function(stmt)
        if func is None or _guarded(ctx, stmt):
            continue
        origins = forwards(ctx, stmt.value)
        if not origins or any(o.model is None or o.model.role != "policy" for o in origins):
            continue
        ref = _reference_in_scope(ctx, mods, func)
        if ref is None and not _adapter_training(ctx):
            continue
        if ref is not None and any(o.model.roots & ref[1] for o in origins):
            continue
        call = next((c for c in ctx.nodes(cst.Call) if any(id(c) == o.node_id for o in origins)), None)
        if call is None or _guarded(ctx, call):
            continue
        out.append(PolicyReferenceOutput(stmt, name, call, ref[0] if ref is not None else None))
    return out


_ADAPTER_BUILDERS = re.compile(r"(?:^|\.)(get_peft_model|LoraConfig|add_adapter|inject_adapter_in_model)$|"
                               r"(?:^|\.)PeftModel\.from_pretrained$")


def _adapter_training(ctx) -> bool:
    """The module wraps a model with an adapter (PEFT's ``get_peft_model``, ``LoraConfig``, ``add_adapter``)."""
    hit = ctx.cache.get("reference.adapters")
    if hit is None:
        hit = any(_ADAPTER_BUILDERS.search(ctx.call_name(c) or "") for c in ctx.nodes(cst.Call))
        ctx.cache["reference.adapters"] = hit
    return hit


# context managers known not to change which weights a forward runs
_PLAIN_CONTEXTS = re.compile(r"(?:^|\.)(no_grad|inference_mode|enable_grad|set_grad_enabled|autocast|nullcontext|"
                             r"amp\.autocast|sdpa_kernel)$")


def _guarded(ctx, node) -> bool:
    """Inside a branch whose test names the reference or an adapter (``if self.ref_model is None:``), or a
    ``with`` other than a plain autograd/autocast context (it may turn adapters off or hand back another model)."""
    for anc in ctx.ancestors(node):
        if isinstance(anc, cst.If) and (_mentions_reference(ctx, anc.test)):
            return True
        if isinstance(anc, cst.With) and any(
                item.asname is not None or not isinstance(item.item, cst.Call) or
                not _PLAIN_CONTEXTS.search(ctx.call_name(item.item) or "") for item in anc.items):
            return True  # an adapter-off or unknown context manager may change the weights the forward runs
        if isinstance(anc, cst.IfExp) and _mentions_reference(ctx, anc.test):
            return True
    return False


def _mentions_reference(ctx, test) -> bool:
    if S.ADAPTER_OFF.search(ctx.code(test)) or _ADAPTER_WORD.search(ctx.code(test)):
        return True
    for node in ctx.index.descendants(test, cst.Name, cst.Attribute) if not isinstance(test, (cst.Name, cst.Attribute)) \
            else [test]:
        key = key_of(node)
        if key is not None and (ctx.names.is_role(key.rsplit(".", 1)[-1], "ref_model") or _REF_WORD.search(
                key.rsplit(".", 1)[-1])):
            return True
    return False


__all__ = ["ConstantRouting", "PolicyReferenceOutput", "UnusedSelection", "constant_routings",
           "policy_reference_outputs", "unused_selections"]
