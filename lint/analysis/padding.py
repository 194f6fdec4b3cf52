"""Padding: pad-id masks, attention masks, pad = EOS, and the model forwards that read token ids.

Facts shared by the rules about padded batches (RLG016, RLG017):

- :func:`pad_comparison`: ``ids != pad_id``, ``ids.ne(pad)``, ``torch.ne(ids, tokenizer.pad_token_id)``: the
  compared tensor and the pad id (a value named for the pad, by its variable or attribute: ``pad_id``, ``PAD``,
  ``tokenizer.pad_token_id``; a comparison with an unnamed constant says nothing about padding);
- :func:`eos_valued`: whether a value is the EOS token (id): ``tokenizer.eos_token_id``, ``EOS``, a call of an
  ``eos_token()`` method, a config field set from one (``cfg = Config(pad_token_id=tok.eos_token_id)`` makes
  ``cfg.pad_token_id`` the EOS id), through names and helpers; and :func:`pad_set_to_eos`, the statements of the
  module that make the tokenizer's pad token its EOS token (``tokenizer.pad_token = tokenizer.eos_token``,
  ``tok.pad_token_id = tok.eos_token_id``, ``add_special_tokens({"pad_token": tok.eos_token})``), after which a
  ``.pad_token_id`` read anywhere in the module is the EOS id;
- :func:`model_forward_ids`: the token ids a model forward reads (``model(ids)``, ``model(input_ids=ids)``,
  ``model.forward(ids)``; not ``generate``), for a callee that is a model by the provenance facet;
- :func:`attention_masks`: the attention masks a function builds for a tensor of token ids: a pad comparison of
  it, the ``attention_mask`` entry of the batch its ``input_ids`` come from, a pairwise block mask of packed rows
  (``seg[:, None] == seg[None, :]``), or a local named as an attention mask computed from the same data;
- :func:`pad_labels_ignored`: labels whose pad ids are replaced by the ignore index (``labels[labels == pad] =
  -100``, ``masked_fill``, ``torch.where``, ``t if t != pad else IGNORE_INDEX``).
"""

from __future__ import annotations

import builtins
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

import libcst as cst

from rlguard.lint.analysis import semantics as S
from rlguard.lint.analysis.depends import resolve, same_value, share_data, strip_casts
from rlguard.lint.analysis.index import Def, dotted_name, key_entry, key_of
from rlguard.lint.analysis.provenance import forwards, models
from rlguard.lint.analysis.records import splat_entry
from rlguard.lint.analysis.uses import CARRY_METHODS, reads_of
from rlguard.lint.analysis.values import Facet, Trace

if TYPE_CHECKING:
    from rlguard.lint.analysis import Analysis

PAD_NAME = re.compile(r"(?i)(\w+_)?pad(ding)?(_token)?(_ids?|_idx|_index|_value|_val|_tok)?")
EOS_NAME = re.compile(r"(?i)(\w+_)?(eos|eot)(_token)?(_ids?|_idx|_index|_tok)?")
PAD_ATTRS = frozenset({"pad_token_id", "pad_token", "pad_id", "pad_idx", "pad_index"})
EOS_ATTRS = frozenset({"eos_token_id", "eos_token", "eos_id", "eos_idx", "eot_id", "eot_token_id", "eos_index"})
EOS_CALL = re.compile(r"(?i)(get_)?(eos|eot)(_token)?(_ids?)?")
ATTENTION_MASK_NAME = re.compile(r"(?i)(\w+_)?(attention|attn)_?masks?")
# Keywords of a forward that carry the row layout in place of an attention mask (varlen/packed kernels).
LAYOUT_KEYWORDS = frozenset({"cu_seqlens", "cu_seq_lens", "cu_seqlens_q", "cu_seqlens_k", "cu_seq_lens_q",
                             "cu_seq_lens_k", "packed_seq_params", "seq_lens", "seqlens", "seq_lengths",
                             "max_seqlen", "attention_bias", "attn_bias", "segment_ids", "sequence_ids",
                             "document_ids", "block_mask"})
# Masks of another input of a multimodal forward (``pixel_attention_mask``): they say nothing about the text rows.
OTHER_INPUT_MASK = ("pixel_", "image_", "video_", "audio_", "vision_", "speech_")
_ALL_ONES = frozenset({"torch.ones", "torch.ones_like", "torch.full", "torch.full_like", "numpy.ones",
                       "numpy.ones_like"})


# ----- pad ids, EOS ids ----------------------------------------------------------------------------------------
def is_pad_named(expr: cst.BaseExpression | None) -> bool:
    """``pad_id``, ``PAD``, ``tokenizer.pad_token_id``, ``self.pad_idx``: a value named for the pad token."""
    name = dotted_name(expr) if expr is not None else None
    if name is None:
        return False
    last = name.rsplit(".", 1)[-1]
    return last in PAD_ATTRS or PAD_NAME.fullmatch(last) is not None


def pad_comparison(a: "Analysis", expr: cst.BaseExpression) -> tuple[cst.BaseExpression, cst.BaseExpression] | None:
    """``(ids, pad)`` for ``ids != pad`` / ``ids.ne(pad)`` / ``torch.ne(ids, pad)`` (casts around it looked
    through) where ``pad`` is named for the pad token; None otherwise."""
    while isinstance(expr, cst.Call) and a.method(expr) in CARRY_METHODS and S.receiver(expr) is not None:
        expr = S.receiver(expr)
    pair = None
    if isinstance(expr, cst.Comparison) and len(expr.comparisons) == 1 and isinstance(
            expr.comparisons[0].operator, cst.NotEqual):
        pair = (expr.left, expr.comparisons[0].comparator)
    elif isinstance(expr, cst.Call):
        name = a.call_name(expr) or ""
        if a.method(expr) in ("ne", "not_equal") and S.receiver(expr) is not None and len(expr.args) == 1:
            pair = (S.receiver(expr), expr.args[0].value)
        elif name in ("torch.ne", "torch.not_equal") and len(expr.args) == 2:
            pair = (expr.args[0].value, expr.args[1].value)
    if pair is None:
        return None
    x, p = pair
    if is_pad_named(strip_casts(a, p)):
        return x, p
    if is_pad_named(strip_casts(a, x)):
        return p, x
    return None


class EosFacet(Facet):
    """True when a value is the EOS token or its id; ``unknown`` (None) otherwise."""

    unknown = None

    def __init__(self, a: "Analysis"):
        self.a = a

    def join(self, values):
        return True if values and all(v is True for v in values) else None

    def node(self, trace, expr, frame):
        if isinstance(expr, cst.Attribute) and expr.attr.value in EOS_ATTRS:
            return True
        if isinstance(expr, cst.Name) and EOS_NAME.fullmatch(expr.value):
            return True
        if isinstance(expr, cst.Call):
            last = S.called_name(expr) or ""
            if EOS_CALL.fullmatch(last) and self.a.callee(expr) is None:
                return True
            if last in ("int", "item") and self.a.callee(expr) is None:
                inner = expr.args[0].value if last == "int" and expr.args else S.receiver(expr)
                return trace.value(inner, frame) if inner is not None else None
        return None


def _eos_trace(a: "Analysis") -> Trace:
    return a.facet("eos", lambda an: Trace(an, EosFacet(an), budget=4000))


@dataclass(frozen=True)
class PadSetting:
    """A statement that sets a pad token (``node``), to the EOS token (``eos`` True) or to something else."""

    node: cst.CSTNode
    eos: bool


def pad_settings(a: "Analysis") -> list[PadSetting]:
    """The module's statements that set a tokenizer's (or a config's) pad token: ``x.pad_token = ...``,
    ``x.pad_token_id = ...``, ``x.add_special_tokens({"pad_token": ...})``, ``Config(..., pad_token_id=...)``."""
    def build(an):
        eos = _eos_trace(an)
        found = []

        def copies_pad(value: cst.BaseExpression) -> bool:
            # `GenerationConfig(pad_token_id=tok.pad_token_id)` hands the tokenizer's pad on: it sets no other pad
            value = strip_casts(an, value)
            return isinstance(value, cst.Attribute) and value.attr.value in PAD_ATTRS

        for stmt in an.nodes(cst.Assign):
            for target in stmt.targets:
                if isinstance(target.target, cst.Attribute) and target.target.attr.value in PAD_ATTRS and \
                        not copies_pad(stmt.value):
                    found.append(PadSetting(stmt, eos.value(stmt.value) is True))
        for call in an.nodes(cst.Call):
            if an.method(call) == "add_special_tokens" and call.args and isinstance(call.args[0].value, cst.Dict):
                for el in call.args[0].value.elements:
                    if isinstance(el, cst.DictElement) and isinstance(el.key, cst.SimpleString) and \
                            el.key.evaluated_value == "pad_token":
                        found.append(PadSetting(call, eos.value(el.value) is True))
            for arg in call.args:
                if arg.keyword is not None and arg.keyword.value in ("pad_token", "pad_token_id") and \
                        S.called_name(call) not in ("generate", "pad", "decode", "batch_decode") and \
                        not copies_pad(arg.value):
                    found.append(PadSetting(call, eos.value(arg.value) is True))
        return found
    return a.facet("pad_settings", build)


def pad_set_to_eos(a: "Analysis") -> list[cst.CSTNode]:
    """The statements that set the pad token to the EOS token, when every pad setting of the module does (a module
    that also sets another pad token leaves the pad's value open)."""
    settings = pad_settings(a)
    if not settings or not all(s.eos for s in settings):
        return []
    return [s.node for s in settings]


def eos_valued(a: "Analysis", expr: cst.BaseExpression) -> bool:
    """Whether ``expr`` is the EOS id: by its value (through names, config fields, helpers), or as a tokenizer's
    ``.pad_token_id`` in a module that sets the pad token to the EOS token."""
    if _eos_trace(a).value(expr) is True:
        return True
    stripped = strip_casts(a, expr)
    if isinstance(stripped, cst.Attribute) and stripped.attr.value in PAD_ATTRS and pad_set_to_eos(a):
        return True
    return False


_BUILTINS = frozenset(dir(builtins))


# ----- forwards and their attention masks ------------------------------------------------------------------------
def forward_candidate_ids(a: "Analysis", call: cst.Call) -> cst.BaseExpression | None:
    """The token ids ``call`` would read if it were a model forward (its first argument or ``input_ids=``, also
    through a splatted dict literal), by syntax alone; None for builtins and functions of imported modules."""
    func = call.func
    if isinstance(func, cst.Attribute) and func.attr.value not in ("forward", "__call__") and (
            func.attr.value in S.NON_FORWARD_METHODS or func.attr.value in S.SAME_VALUE_METHODS):
        return None
    if not isinstance(func, (cst.Name, cst.Attribute)):
        return None
    ids = S.argument(call, 0, "input_ids")
    if ids is None:
        ids = splat_entry(a, call, "input_ids")
    if ids is None or (isinstance(func, cst.Name) and func.value in _BUILTINS) or a.is_module_function(call):
        return None
    return ids


def model_forward_ids(a: "Analysis", call: cst.Call, of_forward: bool = False) -> cst.BaseExpression | None:
    """The token ids of a model forward (``model(ids)``, ``self.policy(input_ids=ids)``, ``model.forward(ids)``), or
    None when ``call`` is no model forward (``generate``, a method of a model that is not its forward, a helper).
    A tensor that comes out of another model call (hidden states for a value head, or the ids a ``generate``-like
    call returned) is left out unless ``of_forward``: then the caller proves it is token ids by how it is used."""
    ids = forward_candidate_ids(a, call)
    if ids is None or calls_helper(a, call):
        return None
    func = call.func
    target = func.value if isinstance(func, cst.Attribute) and func.attr.value in ("forward", "__call__") else func
    if models(a).model(target) is None:  # the costly test, last
        return None
    if not of_forward and forwards(a, ids):
        return None  # hidden states or logits of another forward (a value head on them): no token ids
    return ids


def calls_helper(a: "Analysis", call: cst.Call) -> bool:
    """Whether ``call`` calls a function of this module other than a ``forward``/``__call__``: a helper, no model
    forward (the cheap half of :func:`model_forward_ids`)."""
    callee = a.callee(call)
    return callee is not None and callee.name.value not in ("forward", "__call__")


def hands_attention_masks(a: "Analysis", func: cst.CSTNode | None) -> bool:
    """Whether any call of ``func`` (the module when None) is handed an ``attention_mask=`` keyword (cached)."""
    cache = a.cache.setdefault("hands_attention_masks", {})
    hit = cache.get(id(func))
    if hit is None:
        calls = a.index.descendants(func, cst.Call) if func is not None else a.nodes(cst.Call)
        hit = cache[id(func)] = any(arg.keyword is not None and arg.keyword.value == "attention_mask"
                                    for call in calls for arg in call.args)
    return hit


def masked_sibling(a: "Analysis", call: cst.Call, ids: cst.BaseExpression) -> tuple[cst.Call, cst.BaseExpression] | None:
    """``(forward, mask)``: another model forward (or any call: the keyword says what it is) of the same function
    on the same ids that is handed ``attention_mask=mask``, where ``mask`` holds at ``call`` the value it holds there (``model(ids,
    attention_mask=m)`` for the policy, ``ref(ids)`` for the reference). That forward shows that these ids need
    their mask, whatever else the mask is used for. A forward on the other arm of an if (a packed and an unpacked
    path) is no sibling. None when there is none."""
    func = a.enclosing_function(call)
    for other in a.index.descendants(func, cst.Call) if func is not None else ():
        if other is call or a.index.in_other_branch(call, other) or a.contains(other, call) or \
                a.contains(call, other):
            continue
        mask = S.argument(other, None, "attention_mask")
        if mask is None or (isinstance(mask, cst.Name) and mask.value == "None"):
            continue
        # a call handed ``attention_mask=`` beside the ids is a forward of them by that interface, whatever it is
        other_ids = model_forward_ids(a, other, of_forward=True) or S.argument(other, 0, "input_ids")
        if other_ids is None or not same_value(a, other_ids, ids) or not _holds_at(a, mask, other, call):
            continue
        return other, mask
    return None


def carried(a: "Analysis", expr: cst.BaseExpression) -> cst.BaseExpression:
    """``x`` of ``x.unsqueeze(-1).long()``: the tensor under methods that keep its values (dtype, device, view)."""
    while isinstance(expr, cst.Call) and a.method(expr) in CARRY_METHODS and S.receiver(expr) is not None:
        expr = S.receiver(expr)
    return expr


def _holds_at(a: "Analysis", expr: cst.BaseExpression, there: cst.CSTNode, here: cst.CSTNode) -> bool:
    """Whether the key path ``expr`` reads at ``there`` is reached at ``here`` by the same definitions."""
    key = key_of(strip_casts(a, expr))
    if key is None:
        return False
    defs = {id(d) for d in a.flow.reaching(key, there)}
    return bool(defs) and defs == {id(d) for d in a.flow.reaching(key, here)}


def splat_keys(a: "Analysis", call: cst.Call) -> frozenset[str] | None:
    """The keys the ``**d`` arguments of ``call`` hand on, when every one is a local dict the function builds with
    constant keys only (a literal or ``dict(k=v)``, then ``d["k"] = v`` and ``d.update(k=v)``), and ``d`` is used
    for nothing else; None when a splat's keys cannot be known (a parameter, a dict filled elsewhere)."""
    keys: set[str] = set()
    func = a.enclosing_function(call)
    for arg in call.args:
        if arg.star != "**":
            continue
        if func is None or not isinstance(arg.value, cst.Name):
            return None
        name = arg.value.value
        defs = a.flow.reaching(name, arg.value)
        if not defs or any(d.kind != "assign" or d.element is not None or d.value is None for d in defs):
            return None
        for d in defs:
            entries = _constant_keys(d.value)
            if entries is None:
                return None
            keys |= entries
        stored = _keys_stored(a, func, name, arg.value)
        if stored is None:
            return None
        keys |= stored
    return frozenset(keys)


def own_kwargs_splat(a: "Analysis", call: cst.Call) -> tuple[frozenset[str], frozenset[str]] | None:
    """For a call whose only ``**`` argument is the enclosing function's own ``**kwargs`` parameter, (the keys the
    function itself stores into it, the keys it cannot hold): a name the function takes as a parameter of its own
    never arrives in its ``**kwargs`` (Python binds it to the parameter), whatever the callers pass. None for any
    other splat, or when the function does more with the dict than store constant keys and read entries."""
    func = a.enclosing_function(call)
    star = func.params.star_kwarg if func is not None else None
    if star is None:
        return None
    own = star.name.value
    splats = [arg for arg in call.args if arg.star == "**"]
    if len(splats) != 1 or not isinstance(splats[0].value, cst.Name) or splats[0].value.value != own or any(
            d.kind != "param" for d in a.flow.reaching(own, splats[0].value)):
        return None
    stored = _keys_stored(a, func, own, splats[0].value, signature=True)
    if stored is None:
        return None
    named = frozenset(p.name.value for p in (*func.params.posonly_params, *func.params.params,
                                              *func.params.kwonly_params))
    return frozenset(stored), named


def _keys_stored(a: "Analysis", func: cst.CSTNode, name: str, splatted: cst.Name,
                 signature: bool = False) -> set[str] | None:
    """The keys the other mentions of a splatted dict ``name`` in ``func`` store into it (:func:`_stored_key`), or
    None when one may add unknown keys; ``signature``: the dict is the function's own parameter, whose mention in
    the signature stores nothing."""
    keys: set[str] = set()
    for read in a.index.descendants(func, cst.Name):
        if read.value != name or read is splatted or signature and isinstance(a.index.parent_of(read), cst.Param):
            continue
        stored = _stored_key(a, read)
        if stored is False:
            return None
        keys |= stored
    return keys


def _constant_keys(expr: cst.BaseExpression) -> set[str] | None:
    if isinstance(expr, cst.Dict):
        out = set()
        for el in expr.elements:
            if not isinstance(el, cst.DictElement) or not isinstance(el.key, cst.SimpleString):
                return None
            out.add(el.key.evaluated_value)
        return out
    if isinstance(expr, cst.Call) and isinstance(expr.func, cst.Name) and expr.func.value == "dict" and all(
            arg.keyword is not None for arg in expr.args):
        return {arg.keyword.value for arg in expr.args}
    return None


def _constant_strings(a: "Analysis", expr: cst.BaseExpression, depth: int = 2) -> set[str] | None:
    """The strings ``expr`` can be: a literal, ``"a" if c else "b"``, a name bound only to such values; else None."""
    value = S.string_value(expr)
    if value is not None:
        return {value}
    if isinstance(expr, cst.IfExp):
        body, orelse = _constant_strings(a, expr.body, depth), _constant_strings(a, expr.orelse, depth)
        return body | orelse if body is not None and orelse is not None else None
    if isinstance(expr, cst.Name) and depth > 0:
        defs = a.flow.reaching(expr.value, expr)
        out: set[str] = set()
        for d in defs:
            found = _constant_strings(a, d.value, depth - 1) if d.kind == "assign" and d.element is None and \
                d.value is not None else None
            if found is None:
                return None
            out |= found
        return out if defs else None
    return None


def _stored_key(a: "Analysis", name: cst.Name) -> "set[str] | bool":
    """What one more mention of a splatted dict does: the keys it stores (``d["k"] = v``, ``d.update(k=v)``), an
    empty set for its binding or a read of one entry, False for anything that may add unknown keys."""
    parent = a.index.parent_of(name)
    if isinstance(parent, cst.AssignTarget) or (isinstance(parent, cst.Assign) and name in [
            t.target for t in parent.targets]):
        return set()
    if isinstance(parent, cst.Subscript) and parent.value is name and len(parent.slice) == 1 and isinstance(
            parent.slice[0].slice, cst.Index):
        keys = _constant_strings(a, parent.slice[0].slice.value)
        if keys is not None:
            return keys  # a store adds the key, a read is harmless
    if isinstance(parent, (cst.If, cst.While)) and parent.test is name or isinstance(parent, cst.ComparisonTarget) \
            and isinstance(parent.operator, (cst.In, cst.NotIn)):
        return set()  # `if d:`, `"k" in d`: reads that add nothing
    if isinstance(parent, cst.Attribute) and parent.value is name:
        call = a.index.parent_of(parent)
        if parent.attr.value in ("get", "keys", "items", "values", "pop") and isinstance(call, cst.Call):
            return set()
        if parent.attr.value == "update" and isinstance(call, cst.Call) and call.func is parent and all(
                arg.keyword is not None for arg in call.args):
            return {arg.keyword.value for arg in call.args}
    return False


@dataclass(frozen=True)
class MaskCandidate:
    """An attention mask a function builds: bound by ``d``; ``kind`` says how it is one (``pad``: a pad comparison
    of the forward's ids; ``batch``: the ``attention_mask`` entry of the batch the ids come from; ``block``: a
    pairwise mask of packed rows; ``named``: a local so named, computed from the ids' data; ``param``: a parameter
    named for the attention mask of the token-id parameter the ids are rows of)."""

    d: Def
    kind: str


def attention_masks(a: "Analysis", ids: cst.BaseExpression, named: bool = True) -> list[MaskCandidate]:
    """The attention masks built in ``ids``' function, before it, for the tensor ``ids`` (see the module's
    docstring). A mask of all ones (``torch.ones_like(ids)``) says there is no padding and is left out.
    ``named``: also a local known as an attention mask only by its name (the costly case: whether it is built from
    the ids' data is traced)."""
    func = a.index.function_scope(ids).node
    order = a.index.order[id(ids)]
    found = []
    for d in _mask_defs(a, func):
        if d.kind == "param":
            # the function is handed the attention mask of the ids it is handed: its interface says so (a parameter
            # it never reads is a placeholder of its interface: a model that takes no mask, a signature kept for
            # callers; one it reads, slices or moves, and then drops, is forgotten)
            if _from_parameter(a, ids, d):
                found.append(MaskCandidate(d, "param"))
            continue
        if a.index.order[id(d.stmt)] > order:
            continue
        kind = _mask_kind(a, d.key, d.value, ids, named)
        if kind is not None:
            found.append(MaskCandidate(d, kind))
    return found


def _mask_defs(a: "Analysis", func: cst.CSTNode) -> list[Def]:
    """The bindings of ``func`` that may be an attention mask whatever ids it is for (cached per function): a
    parameter named for one and read, or a plain assignment of a pad comparison, a batch's ``attention_mask``
    entry, a block mask or a local named as an attention mask."""
    cache = a.cache.setdefault("mask_defs", {})
    hit = cache.get(id(func))
    if hit is not None:
        return hit
    scope = a.index.scopes.get(id(func))
    out: list[Def] = []
    for key, defs in (scope.defs.items() if scope is not None else ()):
        if "." in key or "[" in key:
            continue
        for d in defs:
            if d.kind == "param":
                # a parameter never read is a placeholder of the function's interface (a model that takes no mask, a
                # signature kept for callers), unless a caller in view builds the mask and hands it in: then the
                # forward needs it and the function drops it
                if ATTENTION_MASK_NAME.fullmatch(key) and not key.lower().startswith(OTHER_INPUT_MASK) and \
                        (reads_of(a, d) or _handed_a_mask(a, func, key)):
                    out.append(d)
                continue
            if d.kind != "assign" or d.element is not None or d.value is None:
                continue
            core = strip_casts(a, d.value)
            entry = _entry(a, core)
            if pad_comparison(a, d.value) is not None or (entry is not None and entry[1] == "attention_mask") or \
                    _block_mask(a, core) or ATTENTION_MASK_NAME.fullmatch(key):
                out.append(d)
    cache[id(func)] = out
    return out


def _handed_a_mask(a: "Analysis", func: cst.CSTNode, param: str) -> bool:
    """Whether a call of ``func`` in view hands its parameter ``param`` an attention mask the caller has: a pad
    comparison (``seq != pad_id``, through casts and one plain assignment) or a batch's ``attention_mask`` entry.
    The caller built the mask for this function's forward; a function that then never reads it drops it."""
    if not isinstance(func, cst.FunctionDef):
        return False
    from rlguard.lint.analysis.grad import call_sites
    from rlguard.lint.analysis.values import bind_arguments

    for call in call_sites(a, func):
        for name, (value, _) in bind_arguments(func, call, None):
            if name == param and _is_mask_value(a, value):
                return True
    return False


def _is_mask_value(a: "Analysis", expr: cst.BaseExpression, depth: int = 1) -> bool:
    core = strip_casts(a, expr)
    if pad_comparison(a, core) is not None:
        return True
    entry = _entry(a, core)
    if entry is not None and entry[1] == "attention_mask":
        return True
    key = key_of(core) if isinstance(core, (cst.Name, cst.Attribute)) and depth > 0 else None
    if key is None:
        return False
    defs = a.flow.reaching(key, core)
    return bool(defs) and all(d.kind == "assign" and d.element is None and d.value is not None and
                              _is_mask_value(a, d.value, depth - 1) for d in defs)


def _from_parameter(a: "Analysis", ids: cst.BaseExpression, mask_param: Def) -> bool:
    """Whether ``ids`` are rows of another parameter of their function (``input_ids``, sliced or cast), named
    for token ids: then a parameter named for their attention mask is theirs."""
    root = ids
    while True:
        root = strip_casts(a, resolve(a, root))
        if isinstance(root, cst.Subscript) and key_of(root) is None:
            root = root.value
            continue
        break
    if not isinstance(root, cst.Name) or not (re.fullmatch(r"(?i)(\w+_)?(input_)?ids", root.value) or (
            root.value != "labels" and a.names.is_role(root.value, "ids"))):
        return False
    # on one path at least the ids are the parameter itself (another may unpad them, with a layout of its own)
    return any(d.kind == "param" and d is not mask_param for d in a.flow.reaching(root.value, root))


def _mask_kind(a: "Analysis", key: str, value: cst.BaseExpression, ids: cst.BaseExpression,
               named: bool = True) -> str | None:
    core = strip_casts(a, value)
    if isinstance(core, cst.Call) and (a.call_name(core) in _ALL_ONES or a.method(core) in ("new_ones", "fill_")):
        return None
    compared = pad_comparison(a, value)
    if compared is not None:
        return "pad" if same_value(a, compared[0], ids) else None
    entry = _entry(a, core)
    if entry is not None and entry[1] == "attention_mask":
        source = _entry(a, resolve(a, ids))
        return "batch" if source is not None and source[1] == "input_ids" and same_value(a, entry[0], source[0]) \
            else None
    if _block_mask(a, core):
        return "block" if share_data(a, value, ids) else None
    if named and ATTENTION_MASK_NAME.fullmatch(key):
        return "named" if share_data(a, value, ids) else None
    return None


def _entry(a: "Analysis", expr: cst.BaseExpression) -> tuple[cst.BaseExpression, str] | None:
    """``(batch, "k")`` for ``batch["k"]``, ``batch.get("k")``, ``batch.k`` (a non-``self`` container)."""
    if isinstance(expr, cst.Subscript) and len(expr.slice) == 1:
        key = key_of(expr)
        if key is not None and key_entry(key) is not None:
            return expr.value, key_entry(key)
    if isinstance(expr, cst.Call) and a.method(expr) in ("get", "pop") and expr.args and isinstance(
            expr.args[0].value, cst.SimpleString):
        return S.receiver(expr), expr.args[0].value.evaluated_value
    if isinstance(expr, cst.Attribute) and isinstance(expr.value, (cst.Name, cst.Attribute)) and \
            dotted_name(expr.value) not in ("self", "cls"):
        return expr.value, expr.attr.value
    return None


def _block_mask(a: "Analysis", expr: cst.BaseExpression) -> bool:
    """``seg[:, None] == seg[None, :]`` (also with a trailing ``[None]`` or ``&`` a causal mask): a pairwise mask
    that keeps packed rows apart."""
    while isinstance(expr, cst.Subscript) and key_of(expr) is None:
        expr = expr.value
    if isinstance(expr, cst.BinaryOperation) and isinstance(expr.operator, cst.BitAnd):
        return _block_mask(a, expr.left) or _block_mask(a, expr.right)
    if not (isinstance(expr, cst.Comparison) and len(expr.comparisons) == 1 and isinstance(
            expr.comparisons[0].operator, cst.Equal)):
        return False
    left, right = expr.left, expr.comparisons[0].comparator
    if not (isinstance(left, cst.Subscript) and isinstance(right, cst.Subscript)):
        return False
    return a.code(left.value) == a.code(right.value) and _none_at(left) != _none_at(right) and \
        None not in (_none_at(left), _none_at(right))


def _none_at(sub: cst.Subscript) -> int | None:
    """The position of the single ``None`` in ``x[:, None]`` / ``x[None, :]``."""
    spots = [i for i, el in enumerate(sub.slice) if isinstance(el.slice, cst.Index) and isinstance(
        el.slice.value, cst.Name) and el.slice.value.value == "None"]
    return spots[0] if len(spots) == 1 else None




# ----- labels: pad ids replaced by the ignore index ----------------------------------------------------------------
IGNORE_NAME = re.compile(r"(?i)\w*ignore\w*")


def is_ignore_index(expr: cst.BaseExpression | None) -> bool:
    """``-100`` or a value named for the ignore index (``IGNORE_INDEX``, ``self.ignore_index``)."""
    if expr is None:
        return False
    if S.int_value(expr) == -100:
        return True
    name = dotted_name(expr)
    return name is not None and IGNORE_NAME.fullmatch(name.rsplit(".", 1)[-1]) is not None


@dataclass(frozen=True)
class PadLabels:
    """A place where labels equal to the pad id are replaced by the ignore index: ``node`` (to report),
    ``labels`` (the tensor or element), ``pad`` (the pad id)."""

    node: cst.CSTNode
    labels: cst.BaseExpression
    pad: cst.BaseExpression


def _equal_pad(a: "Analysis", expr: cst.BaseExpression, negated: bool) -> tuple | None:
    """``(x, pad)`` for ``x == pad`` (``x != pad`` when ``negated``), ``pad`` named for the pad token."""
    if not (isinstance(expr, cst.Comparison) and len(expr.comparisons) == 1):
        return None
    op = expr.comparisons[0].operator
    if not isinstance(op, cst.NotEqual if negated else cst.Equal):
        return None
    left, right = expr.left, expr.comparisons[0].comparator
    if is_pad_named(strip_casts(a, right)):
        return left, right
    if is_pad_named(strip_casts(a, left)):
        return right, left
    return None


def _copy_of(a: "Analysis", labels: cst.BaseExpression, ids: cst.BaseExpression) -> bool:
    """Whether ``labels`` are the tensor ``ids`` or a copy of it (``labels = ids.clone()``)."""
    if a.code(labels) == a.code(ids) or same_value(a, labels, ids):
        return True
    source = resolve(a, labels)
    if source is resolve(a, ids):  # one value: `ids = torch.tensor(rows); labels = ids.clone()`
        return True
    while isinstance(source, cst.Call) and a.method(source) in ("clone", "copy", "detach") and \
            S.receiver(source) is not None:
        source = S.receiver(source)
    return source is not labels and same_value(a, source, ids)


def pad_labels_ignored(a: "Analysis") -> list[PadLabels]:
    """``labels[labels == pad] = -100``, ``labels.masked_fill(labels == pad, -100)``, ``torch.where(labels == pad,
    -100, labels)``, ``[t if t != pad else IGNORE_INDEX for t in ids]`` (also where the labels are a copy of the
    compared ids), a loss built with ``ignore_index=pad``: the labels' pad ids leave the loss."""
    def build(an):
        found = []
        for node in an.nodes(cst.IfExp):
            kept = _equal_pad(an, node.test, True)
            if kept is not None and an.code(node.body) == an.code(kept[0]) and is_ignore_index(node.orelse):
                found.append(PadLabels(node, kept[0], kept[1]))
                continue
            dropped = _equal_pad(an, node.test, False)
            if dropped is not None and an.code(node.orelse) == an.code(dropped[0]) and is_ignore_index(node.body):
                found.append(PadLabels(node, dropped[0], dropped[1]))
        for stmt in an.nodes(cst.Assign):
            target = stmt.targets[0].target if len(stmt.targets) == 1 else None
            if isinstance(target, cst.Subscript) and len(target.slice) == 1 and isinstance(
                    target.slice[0].slice, cst.Index) and is_ignore_index(stmt.value):
                dropped = _equal_pad(an, target.slice[0].slice.value, False)
                if dropped is not None and _copy_of(an, target.value, dropped[0]):
                    found.append(PadLabels(stmt, target.value, dropped[1]))
        for call in an.nodes(cst.Call):
            name = an.call_name(call) or ""
            if an.method(call) in ("masked_fill", "masked_fill_") and len(call.args) == 2 and is_ignore_index(
                    call.args[1].value):
                dropped = _equal_pad(an, call.args[0].value, False)
                if dropped is not None and an.code(dropped[0]) == an.code(S.receiver(call)):
                    found.append(PadLabels(call, dropped[0], dropped[1]))
            ignored = S.argument(call, None, "ignore_index")
            if ignored is not None and is_pad_named(strip_casts(an, ignored)):
                # `CrossEntropyLoss(ignore_index=tok.pad_token_id)`: the loss skips every label equal to the pad id
                found.append(PadLabels(call, ignored, ignored))
            elif name == "torch.where" and len(call.args) == 3:
                cond, yes, no = (arg.value for arg in call.args)
                dropped = _equal_pad(an, cond, False)
                kept = _equal_pad(an, cond, True)
                if dropped is not None and is_ignore_index(yes) and an.code(no) == an.code(dropped[0]):
                    found.append(PadLabels(call, dropped[0], dropped[1]))
                elif kept is not None and is_ignore_index(no) and an.code(yes) == an.code(kept[0]):
                    found.append(PadLabels(call, kept[0], kept[1]))
        return found
    return a.facet("pad_labels_ignored", build)


__all__ = ["ATTENTION_MASK_NAME", "LAYOUT_KEYWORDS", "MaskCandidate", "OTHER_INPUT_MASK", "PadLabels",
           "attention_masks", "calls_helper", "carried", "eos_valued", "forward_candidate_ids",
           "hands_attention_masks", "is_ignore_index", "is_pad_named", "masked_sibling", "model_forward_ids",
           "pad_comparison", "pad_labels_ignored", "pad_set_to_eos", "pad_settings", "splat_keys"]
