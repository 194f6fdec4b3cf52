"""RLG017 stop-token-untrained: a loss mask ``ids != pad_id`` where the pad token is the EOS token."""

from __future__ import annotations

import re
from typing import Iterator

import libcst as cst

from rlguard.catalog import STOP_TOKEN_UNTRAINED
from rlguard.lint.analysis import Analysis
from rlguard.lint.analysis import semantics as S
from rlguard.lint.analysis.padding import eos_valued, pad_comparison, pad_labels_ignored, pad_set_to_eos
from rlguard.lint.analysis.roles import is_mask_by_use, names_along
from rlguard.lint.analysis.uses import CARRY_METHODS, Use, consumers
from rlguard.lint.rule import Invalid, Rule, Valid, Violation

# Names of masks that select the tokens a loss trains on (not the ones attention may read).
LOSS_MASK_NAME = re.compile(r"(?i)(\w+_)?(action|loss|completion|response|resp|policy|label|labels|target|answer|"
                            r"gen|generation|generated|output|sample|train|trainable)_?masks?")
# Names of masks (and of the tensors compared) that only gate attention, or cover prompts that hold no stop token.
ATTENTION_OR_PROMPT = re.compile(r"(?i)\w*(attention|attn|prompt|query|context|input_mask|padding_mask|pad_mask)\w*")
# Calls that weigh per-token values by a mask: the mask is a loss mask.
MASKED_REDUCTION = re.compile(r"(?i)\w*masked_(mean|sum|whiten|var|average|normali[sz]e)\w*|\w*loss\w*|agg_loss")
# Operations that put tokens back into a mask (the first EOS, a shifted column): the rule cannot tell what.
ADDS_BACK_METHODS = frozenset({"logical_or", "logical_or_", "bitwise_or", "bitwise_or_", "scatter", "scatter_",
                               "index_fill", "index_fill_", "masked_fill", "masked_fill_", "fill_", "index_put",
                               "index_put_", "maximum", "fmax", "roll", "cumsum", "clamp", "clamp_", "add", "add_",
                               "__or__", "__ior__"})
ADDS_BACK_FUNCTIONS = frozenset({"torch.logical_or", "torch.maximum", "torch.fmax", "torch.where", "torch.cat",
                                 "torch.roll", "torch.clamp", "torch.nn.functional.pad", "torch.bitwise_or"})


class StopTokenUntrained(Rule):
    """
    ## What it flags
    A loss mask that drops pad ids, `ids != pad_id` (also `ids.ne(pad)`, `torch.ne(ids, tokenizer.pad_token_id)`),
    where the pad id is the EOS id:

    ```python
    tokenizer.pad_token = tokenizer.eos_token
    ...
    completion_mask = (completion_ids != tokenizer.pad_token_id).float()
    loss = (per_token_loss * completion_mask).sum() / completion_mask.sum()
    ```

    The same in labels: `labels[labels == pad_id] = -100`, `labels.masked_fill(labels == pad_id, -100)`,
    `torch.where(labels == pad_id, -100, labels)`, `[t if t != pad_id else IGNORE_INDEX for t in ids]` (the pad's
    ids replaced by the ignore index of the cross-entropy; also `labels[ids == pad_id] = -100` where the labels are a
    copy of `ids`), and a loss that skips the pad id itself: `nn.CrossEntropyLoss(ignore_index=tokenizer.pad_token_id)`.

    The pad id is the EOS id when its value is visibly one (`pad_id = eos_id`, `PAD_ID = EOS`,
    `PAD = spec.eos_token()`, a config built with `pad_token_id=tokenizer.eos_token_id`), or when it is a
    tokenizer's `.pad_token_id` in a module that sets the pad token to the EOS token (`tokenizer.pad_token =
    tokenizer.eos_token`, `tokenizer.pad_token_id = tokenizer.eos_token_id`, `add_special_tokens({"pad_token":
    tokenizer.eos_token})`) and sets it to nothing else (a config that copies the tokenizer's pad id,
    `GenerationConfig(pad_token_id=tokenizer.pad_token_id)`, sets no other). The comparison must build a loss mask: it
    is bound to, passed as or stored under a loss-mask name (`action_mask`, `completion_mask`, `loss_mask`...),
    returned by a function so named (`build_action_mask`), fed to a masked reduction or a loss function (also by a
    mask keyword, `policy_loss(logp, adv, mask=m)`, and through tuple assignments), or it divides its own sum
    (`(x * m).sum() / m.sum()`). The rule is silent for a mask that only gates attention (`attention_mask=`) unless
    the same mask is handed to a loss function too, for prompt masks (prompts hold no stop token), and when something
    puts tokens back into the mask (`| first_eos`, `mask[i, eos_idx] = 1`, `scatter_`, a `torch.cat`/`roll` that
    shifts it): that may be the first EOS.

    ## Why it is wrong
    With pad = EOS, every completion's EOS has the pad's id, so `ids != pad_id` removes the stop token together with
    the padding. The stop token never gets a gradient: the policy is never trained to stop, answers run to the
    length limit, and the truncated ones (usually the failing ones) dominate. Only the padding *after* the first EOS
    should leave the mask.

    ## Example
    ```python
    PAD_ID = EOS_ID
    action_mask = (ids[:, 1:] != PAD_ID).float()
    ```

    ## Use instead
    ```python
    is_eos = ids[:, 1:] == EOS_ID
    first_eos = torch.where(is_eos.any(-1), is_eos.int().argmax(-1), is_eos.size(-1) - 1)
    positions = torch.arange(is_eos.size(-1), device=ids.device)
    action_mask = (positions[None] <= first_eos[:, None]).float()   # keeps the first EOS, drops what follows
    ```

    ## Runtime state
    Which id the tokenizer pads with is runtime state when the module does not set it; the stop-token preflight
    check (each completion's first stop token, for every configured stop id, is inside the loss mask) covers a
    tokenizer configured out of view and generation stopping at several stop ids.

    ## Fix
    No automatic fix: where each completion ends (the first EOS, any of several stop ids) is for the trainer to say.

    ## Options
    `[tool.rlguard.names]` `mask = [...]` adds names of loss masks. Silence a deliberate choice with
    `# noqa: RLG017`.
    """

    code = STOP_TOKEN_UNTRAINED
    # stable: no FALSE finding on the 49 ecosystem repositories (none at all in validation and holdout), and
    # renaming changes none of its findings; its name-based part stays preview (PREVIEW_PARTS)
    PREVIEW_PARTS = ('a pad id, or a loss mask, known only by the name of a local (`pad_id = tokenizer.eos_token_id`, `completion_mask = ...`): a finding that rests on it vanishes when the local is renamed, and is reported with `--preview` only',)
    # the pad made the EOS on one line (`tok.pad_token = tok.eos_token`, `pad_id = EOS_ID`, `pad_token_id=eos_id`),
    # and a comparison or an ignore index that drops the pad's id (`!=`, `ne(`, `ignore_index=`, `-100`); a `!=`
    # against a literal (`strategy != "no"`, `x != 0`, `y != None`) compares no token ids
    triggers = (r"(?i)pad[^\n]*(eos|eot)|(eos|eot)[^\n]*pad",
                r"(?i)!=(?![ \t]*(?:[\"'\d\[({-]|none\b|true\b|false\b))|\.ne\(|not_equal|ignore_index|ignore_id|-100")
    # the labels form needs no mask: the ignore index (`-100`, `IGNORE_INDEX`) is in the pattern itself

    VALID = [
        Valid("tokenizer.pad_token = tokenizer.eos_token\n"
              "batch = tokenizer(texts, padding=True, return_tensors='pt')\n"
              "out = model(batch['input_ids'], attention_mask=batch['attention_mask'])\n",
              "the tokenizer's own attention mask", capability="C12", style="script"),
        Valid("tokenizer.pad_token = tokenizer.eos_token\n"
              "def completion_mask(ids):\n"
              "    mask = ids != tokenizer.pad_token_id\n"
              "    first = (~mask).int().argmax(-1)\n"
              "    mask[torch.arange(len(ids)), first] = True\n"
              "    return mask.float()\n",
              "the first EOS is put back into the mask", capability="C1", style="functional"),
        Valid("PAD_ID = 0\nEOS_ID = 2\n"
              "def build_action_mask(ids):\n"
              "    return (ids[:, 1:] != PAD_ID).float()\n",
              "pad and eos are different ids", capability="C6", style="functional"),
        Valid("tokenizer.pad_token_id = tokenizer.eos_token_id\n"
              "def score(model, ids):\n"
              "    attention_mask = (ids != tokenizer.pad_token_id).long()\n"
              "    return model(ids, attention_mask=attention_mask).logits\n",
              "a pad mask used only as the attention mask of a forward", capability="C2", style="functional"),
        Valid("class Trainer:\n"
              "    def __init__(self, tok):\n"
              "        tok.pad_token = tok.eos_token\n"
              "        self.tok = tok\n"
              "    def masks(self, prompt_ids):\n"
              "        prompt_mask = prompt_ids != self.tok.pad_token_id\n"
              "        return prompt_mask\n",
              "a prompt mask: prompts hold no stop token", capability="FP", style="class"),
        Valid("tokenizer.pad_token = '<pad>'\n"
              "def loss_mask(ids):\n"
              "    return (ids != tokenizer.pad_token_id).float()\n",
              "the pad token is its own token", capability="C12", style="functional"),
        Valid("pad_id = eos_id\n"
              "keep = ids != pad_id\n"
              "loss_mask = keep | (ids == eos_id).cumsum(-1).eq(1)\n",
              "a mask that adds the first EOS back", capability="C9", style="script"),
        Valid("def batch_masks(batch, cfg):\n"
              "    gen = GenerationConfig(pad_token_id=cfg.pad_id)\n"
              "    response_mask = batch['responses'] != gen.pad_token_id\n"
              "    return {'response_mask': response_mask}\n",
              "the config's pad id comes from elsewhere, not from the EOS", capability="C3", style="framework"),
        Valid("tokenizer.add_special_tokens({'pad_token': '[PAD]'})\n"
              "labels = input_ids.clone()\n"
              "labels[labels == tokenizer.pad_token_id] = -100\n",
              "labels masked at a pad token of its own", capability="C12", style="script"),
        Valid("tokenizer.pad_token = tokenizer.eos_token\n"
              "def collate(batch):\n"
              "    labels = batch['input_ids'].clone()\n"
              "    labels[batch['attention_mask'] == 0] = -100\n"
              "    return labels\n",
              "labels masked by the attention mask, which keeps the first EOS", capability="C3", style="framework"),
        Valid("tokenizer.add_special_tokens({'pad_token': '[PAD]'})\n"
              "loss_fct = nn.CrossEntropyLoss(ignore_index=tokenizer.pad_token_id)\n",
              "the loss ignores a pad token of its own", capability="C6", style="script"),
        Valid("tokenizer.pad_token = tokenizer.eos_token\n"
              "def stats(model, ids, values):\n"
              "    attention_mask = ids.ne(tokenizer.pad_token_id)\n"
              "    out = model(ids, attention_mask=attention_mask)\n"
              "    return out.logits, masked_mean(values, attention_mask)\n",
              "an attention mask that also weighs a statistic, not a loss", capability="C2", style="functional"),
        Valid("def score(tok, model, ids, idx):\n"
              "    tok.pad_token = tok.eos_token\n"
              "    keep = ids != tok.pad_token_id\n"
              "    return model(ids[idx], attention_mask=keep[idx]).logits\n",
              why="rows of the pad mask handed on as an attention mask: no loss mask", capability="C1",
              style="functional"),
    ]
    INVALID = [
        Invalid("PAD_ID = EOS_ID\n"
                "def build_action_mask(owner, ids):\n"
                "    action_mask = ((owner[:, 1:] == POLICY) & (ids[:, 1:] != PAD_ID)).float()\n"
                "    return action_mask\n", line=3, why="pad = eos by a module constant, AND-ed with ownership",
                capability="C1", style="functional"),
        Invalid("tokenizer.pad_token = tokenizer.eos_token\n"
                "def loss(per_token_loss, completion_ids):\n"
                "    completion_mask = (completion_ids != tokenizer.pad_token_id).float()\n"
                "    return (per_token_loss * completion_mask).sum() / completion_mask.sum()\n", line=3,
                why="the tokenizer's pad set to eos, a completion mask", capability="C12", style="functional"),
        Invalid("class Trainer:\n"
                "    def __init__(self, tokenizer):\n"
                "        if tokenizer.pad_token is None:\n"
                "            tokenizer.pad_token = tokenizer.eos_token\n"
                "        self.tokenizer = tokenizer\n"
                "    def step(self, seqs, logp, adv):\n"
                "        m = seqs[:, 1:].ne(self.tokenizer.pad_token_id).float()\n"
                "        return -((logp * adv[:, None] * m).sum() / m.sum())\n", line=7,
                why="ne(), a mask by its use, pad set in another method", capability="C2", style="class"),
        Invalid("tokenizer.pad_token_id = tokenizer.eos_token_id\n"
                "def make_batch(ids):\n"
                "    return {'input_ids': ids, 'loss_mask': torch.ne(ids, tokenizer.pad_token_id)}\n", line=3,
                why="stored under a loss-mask key, torch.ne", capability="C3", style="framework"),
        Invalid("def build(cfg, tok, ids):\n"
                "    gen = GenerationConfig(pad_token_id=tok.eos_token_id)\n"
                "    response_mask = ids != gen.pad_token_id\n"
                "    return masked_mean(cfg.loss, response_mask)\n", line=3,
                why="a config field set from the EOS id", capability="C6", style="framework"),
        Invalid("pad_id = tokenizer.eos_token_id\n"
                "mask = (seq != pad_id).float()\n"
                "loss = (nll * mask).sum() / mask.sum()\n", line=2, preview=True,
                why="a terse script, mask by use (preview: the pad is known by its local's name only)",
                capability="C9", style="script"),
        Invalid("def labels_mask(ids):\n"
                "    return ids[:, 1:] != PAD_TOKEN_ID\n"
                "PAD_TOKEN_ID = spec.eos_token()\n", line=2,
                why="an eos_token() call, returned by a function named for a loss mask", capability="C5",
                style="functional"),
        Invalid("def encode(tokenizer, full_ids):\n"
                "    if tokenizer.pad_token is None:\n"
                "        tokenizer.pad_token = tokenizer.eos_token\n"
                "    return [tid if tid != tokenizer.pad_token_id else IGNORE_INDEX for tid in full_ids]\n", line=4,
                why="labels built element by element, pad ids ignored (the ROLL distillation form)",
                capability="C9", style="functional"),
        Invalid("tokenizer.pad_token = tokenizer.eos_token\n"
                "labels = input_ids.clone()\n"
                "labels[labels == tokenizer.pad_token_id] = -100\n", line=3,
                why="the collator form: pad ids of the labels set to -100", capability="C12", style="script"),
        Invalid("class Collator:\n"
                "    def __init__(self, tok):\n"
                "        tok.pad_token_id = tok.eos_token_id\n"
                "        self.tok = tok\n"
                "    def __call__(self, ids):\n"
                "        return {'input_ids': ids,\n"
                "                'labels': ids.masked_fill(ids == self.tok.pad_token_id, self.ignore_index)}\n", line=7,
                why="masked_fill with the ignore index, pad set in __init__", capability="C3", style="class"),
        Invalid("class PretrainSet:\n"
                "    def __init__(self, tok):\n"
                "        self.tok = tok\n"
                "        self.tok.pad_token = self.tok.eos_token\n"
                "    def __getitem__(self, i):\n"
                "        ids = torch.tensor(self.rows[i])\n"
                "        labels = ids.clone()\n"
                "        labels[ids == self.tok.pad_token_id] = -100\n"
                "        return ids, labels\n", line=8,
                why="the labels are a copy of the compared ids", capability="C2", style="class"),
        Invalid("tokenizer.pad_token = tokenizer.eos_token\n"
                "loss_fct = nn.CrossEntropyLoss(ignore_index=tokenizer.pad_token_id, reduction='none')\n", line=2,
                why="the loss ignores every label equal to the pad id, the EOS id", capability="C6", style="script"),
        Invalid("tokenizer.pad_token = tokenizer.eos_token\n"
                "gen_cfg = GenerationConfig(pad_token_id=tokenizer.pad_token_id)\n"
                "def step(ids, logp, adv, n):\n"
                "    keep = ids.ne(tokenizer.pad_token_id).long()\n"
                "    logp, keep = (logp[:, -n:], keep[:, -n:])\n"
                "    return policy_loss(logp, adv, mask=keep)\n", line=4,
                why="a config that copies the pad id sets no other pad; the mask goes on through a tuple "
                    "assignment to a loss's mask keyword", capability="C3", style="functional"),
        Invalid("def step(tok, ids, logp, adv, idx):\n"
                "    tok.pad_token = tok.eos_token\n"
                "    keep = ids != tok.pad_token_id\n"
                "    part = keep[idx]\n"
                "    loss = ((-logp * adv)[idx] * part).sum() / part.sum()\n"
                "    loss.backward()\n", line=3,
                why="rows of the mask (a minibatch) keep its zeros, and they divide their own sum", capability="C1",
                style="functional"),
    ]

    def check(self, ctx: Analysis) -> Iterator[Violation]:
        for node in ctx.nodes(cst.Comparison, cst.Call):
            found = pad_comparison(ctx, node)
            if found is None or (isinstance(node, cst.Call) and ctx.method(node) in CARRY_METHODS):
                continue  # `(ids != pad).float()`: the comparison inside is judged
            ids, pad = found
            if not eos_valued(ctx, pad) or any(ATTENTION_OR_PROMPT.fullmatch(n) for n in names_along(ctx, ids)):
                continue
            verdict = _judge(ctx, node)
            if verdict:
                yield Violation(node, _message(ctx, node, pad))
        # the labels form: pad ids replaced by the ignore index in the labels of a loss
        for found in pad_labels_ignored(ctx):
            if eos_valued(ctx, found.pad) and not any(ATTENTION_OR_PROMPT.fullmatch(n)
                                                      for n in names_along(ctx, found.labels)):
                yield Violation(found.node, _message(ctx, found.node, found.pad, labels=True))


def _judge(ctx: Analysis, node: cst.CSTNode) -> bool:
    """Whether the mask built at ``node`` is a loss mask that nothing puts tokens back into."""
    loss = False  # shown by the code: a masked reduction, a loss function, the mask dividing its own sum
    named = False  # a loss mask by a name it is bound to, passed as, stored under or returned from
    selects = False  # it indexes another tensor (`tokens[mask]`): a selection, for decoding or statistics
    attention = False  # bound or passed on as an attention or prompt mask on some path
    loss_call = False  # handed to a loss function: what such a mask does whatever it is called
    todo = [node]
    seen: set[int] = set()
    while todo:
        current = todo.pop()
        if id(current) in seen or len(seen) > 64:
            continue
        seen.add(id(current))
        for use in consumers(ctx, current):
            names = use.names
            if any(ATTENTION_OR_PROMPT.fullmatch(n) for n in names):
                attention = True
            if any(LOSS_MASK_NAME.fullmatch(n) or ctx.names.is_role(n, "mask") and n not in ("mask", "masks") and
                   not ATTENTION_OR_PROMPT.fullmatch(n) for n in names):
                named = True
            if use.kind == "index":
                selects = True
            if isinstance(use.value, cst.Name) and is_mask_by_use(ctx, use.value):
                loss = True  # (x * m).sum() / m.sum(): a mask by its use
            verdict = _use(ctx, use)
            if verdict == "adds-back":
                return False
            if verdict == "attention":
                attention = True  # handed on as an attention mask: what the keyword says, whatever the name
                continue
            if verdict == "loss":
                named = True
            elif verdict == "loss-call":
                loss = True
                call = use.node if use.kind in ("argument", "keyword") else None
                loss_call = loss_call or (isinstance(call, cst.Call) and "loss" in _callee(ctx, call).lower())
            elif verdict == "through":
                todo.append(use.node)
            elif use.kind == "store":
                return False
    if attention:  # an attention mask is a loss mask too only where it is handed to a loss (not a statistic)
        return loss_call
    # a name alone makes it a loss mask only when nothing shows another purpose (a selection of tokens)
    return loss or (named and not selects)


def _use(ctx: Analysis, use: Use) -> str | None:
    kind, detail = use.kind, use.detail
    if kind == "indexed":
        return "through"  # `mask[rows]`, `mask[:, 1:]`: rows or positions of the mask keep its zeros
    if kind == "operand":
        if detail in ("BitOr", "Add", "Or", "BitOrAssign", "AddAssign"):
            return "adds-back"
        if detail in ("BitAnd", "And", "Multiply"):
            return "through"
        return None
    if kind == "method":
        if detail in ADDS_BACK_METHODS:
            return "adds-back"
        if detail in ("logical_and", "logical_and_", "mul", "mul_", "bitwise_and"):
            return "through"
        return None
    if kind in ("keyword", "entry"):
        name = str(detail or "")
        if ATTENTION_OR_PROMPT.fullmatch(name):
            return "attention"
        if LOSS_MASK_NAME.fullmatch(name):
            return "loss"
        call = use.node
        if kind == "keyword" and "mask" in name.lower() and isinstance(call, cst.Call) and MASKED_REDUCTION.fullmatch(
                _callee(ctx, call)):
            return "loss-call"  # `loss_fn(logp, adv, mask=m)`: the callee's interface says what the mask does
        return None
    if kind in ("argument", "element"):
        call = use.node if kind == "argument" else _enclosing_call(ctx, use.node)
        if not isinstance(call, cst.Call):
            return None
        name = ctx.call_name(call) or ""
        if name in ADDS_BACK_FUNCTIONS:
            return "adds-back"
        if MASKED_REDUCTION.fullmatch(name.rsplit(".", 1)[-1]):
            return "loss-call"
        return None
    if kind == "return":
        return "loss" if detail and LOSS_MASK_NAME.search(str(detail)) else None
    return None


def _callee(ctx: Analysis, call: cst.Call) -> str:
    """The last name of what ``call`` calls (``self.config.method.loss`` -> ``loss``), or ""."""
    return (ctx.call_name(call) or S.called_name(call) or "").rsplit(".", 1)[-1]


def _enclosing_call(ctx: Analysis, node: cst.CSTNode):
    parent = ctx.index.parent_of(node)
    return ctx.index.parent_of(parent) if isinstance(parent, cst.Arg) else None


def _message(ctx: Analysis, node: cst.CSTNode, pad, labels: bool = False) -> str:
    settings = pad_set_to_eos(ctx)
    where = (f"the module sets the pad token to the EOS token (`{ctx.code(settings[0]).strip().splitlines()[0]}`)"
             if settings and not isinstance(pad, cst.Name) else f"`{ctx.code(pad)}` is the EOS id")
    what = "the labels' pad ids are ignored by the loss" if labels else "drops every pad id from the loss mask"
    code = ctx.code(node).strip().splitlines()[0]
    return (f"`{code}`: {what}, and {where}: each completion's EOS falls "
            f"out of the loss too, so the model is never trained to stop; keep the tokens up to and including the "
            f"first EOS")
