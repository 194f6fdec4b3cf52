"""RLG016 padding-leak: a model forward on padded or packed ids with their attention mask in scope, not passed."""

from __future__ import annotations

from typing import Iterator

import libcst as cst

from rlguard.catalog import PADDING_LEAK
from rlguard.lint.analysis import Analysis
from rlguard.lint.analysis import semantics as S
from rlguard.lint.analysis.depends import computed_from, same_value
from rlguard.lint.analysis.index import children
from rlguard.lint.analysis.padding import (LAYOUT_KEYWORDS, OTHER_INPUT_MASK, MaskCandidate, attention_masks,
                                          calls_helper, carried, forward_candidate_ids,
                                          hands_attention_masks, masked_sibling, model_forward_ids,
                                          own_kwargs_splat, splat_keys)
from rlguard.lint.analysis.provenance import forwards
from rlguard.lint.analysis.uses import Use, def_consumers
from rlguard.lint.rule import Invalid, Rule, Valid, Violation


# an actor's forward that takes ids, their mask and extra inputs as **kwargs, with positions from the mask
_ACTOR_FORWARD = ("class Actor(nn.Module):\n"
                  "    def forward(self, sequences, attention_mask=None, **extra):\n"
                  "        position_ids = attention_mask.long().cumsum(-1) - 1\n"
                  "        position_ids.masked_fill_(attention_mask == 0, 1)\n"
                  "        if extra:\n"
                  "            extra['token_type_ids'] = (sequences == 7).long()\n"
                  "        out = self.model(sequences, {mask}position_ids=position_ids, **extra)\n"
                  "        return out['logits']\n")


# an older actor forward: positions counted from the mask, or made by a helper from it on the packed path
_PACKED_OR_PADDED = ("class Actor(nn.Module):\n"
                     "    def forward(self, sequences, attention_mask=None, packed=False):\n"
                     "        if not packed:\n"
                     "            position_ids = attention_mask.long().cumsum(-1) - 1\n"
                     "        else:\n"
                     "            position_ids = reset_position_ids(attention_mask)\n"
                     "            attention_mask = None\n"
                     "        out = self.model(sequences, {mask}position_ids=position_ids)\n"
                     "        return out['logits']\n")


# a reward-model worker with a remove-padding path and a padded path; the mask also picks each row's last token
_RM_WORKER = ("class RewardWorker:\n"
              "    def __init__(self, path, rmpad):\n"
              "        self.reward_module = AutoModelForTokenClassification.from_pretrained(path)\n"
              "        self.use_remove_padding = rmpad\n"
              "\n"
              "    def score(self, micro_batch):\n"
              "        input_ids = micro_batch['input_ids']\n"
              "        attention_mask = micro_batch['attention_mask']\n"
              "        position_ids = micro_batch['position_ids']\n"
              "        if self.use_remove_padding:\n"
              "            ids_rmpad, indices, *_ = unpad_input(input_ids.unsqueeze(-1), attention_mask)\n"
              "            pos_rmpad = index_first_axis(position_ids.unsqueeze(-1), indices).transpose(0, 1)\n"
              "            out = self.reward_module(input_ids=ids_rmpad.transpose(0, 1), attention_mask=None,\n"
              "                                     position_ids=pos_rmpad)\n"
              "            scores = pad_input(out.logits.squeeze(0), indices, *input_ids.shape).squeeze(-1)\n"
              "        else:\n"
              "            out = self.reward_module(input_ids=input_ids, {mask}position_ids=position_ids)\n"
              "            scores = out.logits.squeeze(-1)\n"
              "        last = torch.argmax(position_ids * attention_mask, dim=-1)\n"
              "        return scores[torch.arange(scores.size(0)), last]\n")


class PaddingLeak(Rule):
    """
    ## What it flags
    A model forward on token ids that are padded or packed, in a function that builds the attention mask of those
    ids and does not pass it:

    ```python
    attention_mask = (ids != tokenizer.pad_token_id).long()
    logits = model(ids).logits                       # the mask is built, never handed to the model
    ```

    The mask is one the function has for the forward's own ids, before the forward:

    - a pad comparison of the same tensor (`ids != pad_id`, `ids.ne(pad)`, through casts and aliases), also of ids
      that another model call returned (a pad comparison shows they are token ids);
    - the `attention_mask` entry of the batch the ids are the `input_ids` of (`batch["attention_mask"]`,
      `batch.get("attention_mask")`, `batch.attention_mask`);
    - a parameter named for the attention mask when the ids are rows of the token-id parameter beside it (parameter
      names are the function's interface; on one path at least, another may unpad them); one the function never
      reads counts only when a caller in view hands it a mask it built (a pad comparison, a batch's
      `attention_mask` entry): otherwise it may be a placeholder of the interface (a model that takes no mask);
    - a block mask of rows packed into one sequence (`seg[:, None] == seg[None, :]`), or a local named as an
      attention mask computed from the same data as the packed ids.

    The rule reports when that mask is not passed to the forward and is used for nothing but attention and the
    rows' layout elsewhere: never used at all, passed as `attention_mask=` to another forward or to `generate`,
    or read for the rows' positions (`mask.long().cumsum(-1)`, the `mask == 0` slots, a call whose result the
    forward takes as `position_ids=`) or for unpadding them (a call handed the ids and the mask together):
    positions alone do not hide the padding from attention. It also
    reports, whatever else the mask serves, a forward of ids that another call of the same function hands with
    `attention_mask=m` (`m` holding the same value at both calls; the policy and the critic get the mask, the
    reference does not), and a forward of padded ids whose mask the function also uses to remove their padding
    for a model forward (`unpad_input(ids, mask)`, `ids[mask]`: the unpadded path of a remove-padding switch) or to
    count the positions this forward takes (`mask.cumsum(-1)`: positions for rows whose padding comes first),
    whatever else the mask serves (the index of each row's last token, the loss). It is silent when the forward
    takes any mask or a packed layout (`attention_mask=`,
    `cu_seqlens=`, `packed_seq_params=`...; an image's `pixel_attention_mask=` is not the text's), a second
    positional argument, or a `**` splat of a dict whose keys are unknown or include a mask (a local dict built
    with constant keys is read; the function's own `**kwargs` never holds a name the function takes as a
    parameter, so when it takes the mask by name its `**kwargs` cannot hand it on), when the other forward is on the other arm of an if (a packed and an unpadded
    path), and otherwise when the mask also serves the loss or anything else (a causal model reads right-padded
    rows correctly without a mask, and a function that masks its loss with it may rely on that).

    ## Why it is wrong
    Without the mask, every real token attends to the pad tokens before it (left padding) or to the other rows
    packed into its sequence, and its positions count the padding: a row's log-probs change with how much padding
    it carries and with which rows share its batch. The ratio against the sampler's log-probs drifts from 1
    (`logp_gap` well above 1e-4), reference log-probs of the same text differ between batches, and packed rows
    learn from their neighbours' tokens.

    ## Example
    ```python
    def score(model, batch):
        input_ids = batch["input_ids"]
        attention_mask = batch["attention_mask"]
        logits = model(input_ids).logits
        return logits[:, :-1].log_softmax(-1)
    ```

    ## Use instead
    ```python
    def score(model, batch):
        input_ids = batch["input_ids"]
        attention_mask = batch["attention_mask"]
        logits = model(input_ids, attention_mask=attention_mask).logits
        return logits[:, :-1].log_softmax(-1)
    ```

    ## Runtime state
    Whether a batch is left- or right-padded, whether rows are packed, and which attention kernel a model runs
    (a flash-attention varlen kernel reads row boundaries from `position_ids`) are runtime state. The padding
    invariance preflight check (a row's log-probs unchanged by extra left/right padding and by the other rows of
    its batch) sees what the linter cannot.

    ## Fix
    No automatic fix: the mask the model expects (a `[B, T]` keep-mask, a 4-D block mask, `cu_seqlens` for a
    varlen kernel) depends on the model.

    ## Options
    None beyond the shared name lists. Silence a deliberate choice with `# noqa: RLG016`.
    """

    code = PADDING_LEAK
    # stable: no FALSE finding on the 49 ecosystem repositories (none at all in validation and holdout), and
    # renaming changes none of its findings; a mask known by its name alone stays preview (PREVIEW_PARTS)
    PREVIEW_PARTS = ("a mask known only by the name of a local (`attention_mask = ...` computed from the packed ids' data): a finding that rests on it vanishes when the local is renamed, and is reported with `--preview` only",)
    # every mask it reads is named by an interface (`attention_mask=`, a batch key, a parameter) or compared with a
    # pad id, or is a block mask; a file with none of these words has none of them
    # an attention mask's name (a keyword, key or parameter), a block mask (`seg[:, None] == seg[None, :]`), or a pad
    # comparison: the pad-named operand beside `!=`, `ne(` or `not_equal(` (within one expression's reach, across
    # wrapped lines); a pad word alone (`tok.pad_token = tok.eos_token`, a config's help text) compares nothing
    triggers = (r"(?i)(attention|attn)_?masks?|none\s*\]\s*==|pad\w*[\s)\]]*!=|"
                r"(?:!=|ne\(|not_equal\()[\w\s.,()\[\]:+*-]{0,200}?pad")

    VALID = [
        Valid(_PACKED_OR_PADDED.format(mask="attention_mask=attention_mask, "),
              why="the mask handed on (None on the packed path, where the positions carry the layout)",
              capability="C3", style="class"),
        Valid("def perplexity(texts, model, tokenizer):\n"
              "    enc = tokenizer(texts, return_tensors='pt', padding=True)\n"
              "    ids = enc['input_ids']\n"
              "    mask = enc['attention_mask']\n"
              "    labels = torch.where(mask == 1, ids, torch.tensor(-100))\n"
              "    logits = model(ids).logits\n"
              "    return F.cross_entropy(logits[:, :-1].transpose(1, 2), labels[:, 1:], ignore_index=-100)\n",
              why="the mask serves the loss (labels skip the padding): a causal model reads right-padded rows "
                  "correctly without it", capability="C3", style="functional"),
        Valid(_ACTOR_FORWARD.format(mask="attention_mask=attention_mask, "),
              why="the mask and the positions it gives both handed to the forward", capability="C3", style="class"),
        Valid(_ACTOR_FORWARD.format(mask="").replace("attention_mask=None, ", "").replace(
            "attention_mask", "extra['attention_mask']"),
              why="no mask parameter: the **kwargs the forward is handed may carry the mask", capability="C3",
              style="class"),
        Valid("def score(model, batch):\n"
              "    input_ids = batch['input_ids']\n"
              "    attention_mask = batch['attention_mask']\n"
              "    return model(input_ids, attention_mask=attention_mask).logits\n",
              "the mask is passed by keyword", capability="C3", style="framework"),
        Valid("def score(model, ids, pad_id):\n"
              "    mask = (ids != pad_id).long()\n"
              "    return model(ids, mask).logits\n",
              "the mask is passed positionally", capability="C1", style="functional"),
        Valid("def score(model, ids, pad_id):\n"
              "    mask = (ids != pad_id).long()\n"
              "    inputs = {'input_ids': ids, 'attention_mask': mask}\n"
              "    return model(**inputs).logits\n",
              "a dict holding the mask, splatted into the forward", capability="C3", style="functional"),
        Valid("def loss(model, ids, pad_id, adv):\n"
              "    mask = (ids[:, 1:] != pad_id).float()\n"
              "    logp = model(ids).logits[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)\n"
              "    return -(logp * adv[:, None] * mask).sum() / mask.sum()\n",
              "a pad mask used for the loss: a causal forward of right-padded rows needs no mask", capability="FP",
              style="functional"),
        Valid("class Scorer:\n"
              "    def logps(self, batch):\n"
              "        attention_mask = batch['attention_mask']\n"
              "        out = self.model(batch['prompt_ids'])\n"
              "        return out.logits, attention_mask\n",
              "the forward reads other ids than the ones the mask is for", capability="C3", style="class"),
        Valid("def score(model, ids):\n"
              "    attention_mask = torch.ones_like(ids)\n"
              "    return model(ids).logits\n",
              "an all-ones mask: no padding", capability="C9", style="script"),
        Valid("def forward(model, ids, pad):\n"
              "    keep = ids != pad\n"
              "    packed = ids[keep][None]\n"
              "    seg = torch.repeat_interleave(torch.arange(len(ids)), keep.sum(-1))\n"
              "    attention_mask = (seg[:, None] == seg[None, :])[None]\n"
              "    return model(packed, attention_mask=attention_mask)\n",
              "packed rows with their block mask", capability="C7", style="functional"),
        Valid("def forward(model, ids, pad, cu):\n"
              "    attention_mask = ids != pad\n"
              "    packed = ids[attention_mask][None]\n"
              "    return model(packed, cu_seqlens=cu)\n",
              "a varlen forward with cu_seqlens carries the row layout", capability="C12", style="functional"),
        Valid("def step(model, ref, batch):\n"
              "    ids, attn = batch['input_ids'], batch['attention_mask']\n"
              "    logits = model(input_ids=ids, attention_mask=attn).logits\n"
              "    with torch.no_grad():\n"
              "        ref_logits = ref(input_ids=ids, attention_mask=attn).logits\n"
              "    return logits, ref_logits\n",
              "both forwards get the mask (tuple unpacking)", capability="C1", style="framework"),
        Valid("mask = (ids != tokenizer.pad_token_id).long()\n"
              "out = model(ids)\n"
              "loss = (out.loss_per_token * mask).sum() / mask.sum()\n",
              "the mask weighs the loss", capability="C2", style="script"),
        Valid("def collate(rows, pad_id):\n"
              "    ids = torch.nn.utils.rnn.pad_sequence(rows, True, pad_id)\n"
              "    attention_mask = (ids != pad_id).long()\n"
              "    return {'input_ids': ids, 'attention_mask': attention_mask}\n",
              "a collator builds the mask and hands it on: no forward", capability="C3", style="framework"),
        Valid("def score(model, ids, pos, mask, packed):\n"
              "    if packed:\n"
              "        out = model(ids, position_ids=pos)\n"
              "    else:\n"
              "        out = model(ids, attention_mask=mask, position_ids=pos)\n"
              "    return out.logits * mask[..., None]\n",
              "the maskless forward is the packed path on the other arm of the if", capability="C7",
              style="functional"),
        Valid("def score(model, ids, pad_id, extra):\n"
              "    mask = ids != pad_id\n"
              "    inputs = {'input_ids': ids}\n"
              "    inputs.update(extra)\n"
              "    return model(**inputs).logits, mask\n",
              "a splatted dict filled from elsewhere may hold the mask", capability="C3", style="functional"),
        Valid("def score(model, ids, pad_id):\n"
              "    mask = ids != pad_id\n"
              "    inputs = {'input_ids': ids}\n"
              "    inputs['attention_mask'] = mask\n"
              "    return model(**inputs).logits\n",
              "the mask is stored into the splatted dict after it is built", capability="C3", style="functional"),
        Valid("def score(policy, ref, ids, pad_id):\n"
              "    with torch.no_grad():\n"
              "        ref_logits = ref(ids).logits\n"
              "    mask = ids != pad_id\n"
              "    logits = policy(ids, attention_mask=mask).logits\n"
              "    return (logits - ref_logits) * mask[..., None]\n",
              "no mask exists yet where the first forward runs: what it should get is unknown", capability="C1",
              style="functional"),
        Valid("def forward(self, input_ids, attention_mask, pixel_values, pixel_attention_mask):\n"
              "    out = self.model(input_ids=input_ids, attention_mask=attention_mask, pixel_values=pixel_values,\n"
              "                     pixel_attention_mask=pixel_attention_mask)\n"
              "    return out.logits\n",
              "an image mask beside the text mask", capability="C3", style="class"),
        Valid(_RM_WORKER.format(mask="attention_mask=attention_mask, "),
              why="the padded path hands the mask, the remove-padding path forwards the unpadded ids",
              capability="C7", style="class"),
        Valid("def score(reward_model, batch):\n"
              "    input_ids = batch['input_ids']\n"
              "    attention_mask = batch['attention_mask']\n"
              "    values = reward_model(input_ids).logits.squeeze(-1)\n"
              "    last = attention_mask.sum(-1) - 1\n"
              "    return values[torch.arange(values.size(0)), last]\n",
              "the mask only picks each row's last token: a causal model reads right-padded rows correctly "
              "without it, and nothing here removes the padding or counts positions from the mask",
              capability="FP", style="framework"),
        Valid("def score(self, micro_batch):\n"
              "    input_ids = micro_batch['input_ids']\n"
              "    attention_mask = micro_batch['attention_mask']\n"
              "    ids_rmpad, indices, *_ = unpad_input(input_ids.unsqueeze(-1), attention_mask)\n"
              "    out = self.reward_model(input_ids=ids_rmpad.transpose(0, 1), position_ids=micro_batch['pos'])\n"
              "    last = torch.argmax(attention_mask.cumsum(-1), dim=-1)\n"
              "    return pad_input(out.logits.squeeze(0), indices, *input_ids.shape)[:, last]\n",
              "the only forward reads the unpadded ids (a varlen path): the padding is removed, not attended",
              capability="C7", style="class"),
        Valid("def score(reward_model, batch, pad_id):\n"
              "    input_ids = batch['input_ids']\n"
              "    attention_mask = batch['attention_mask']\n"
              "    filled = torch.where(attention_mask.bool(), input_ids, pad_id)\n"
              "    other = reward_model(filled).logits\n"
              "    values = reward_model(input_ids).logits.squeeze(-1)\n"
              "    return values * attention_mask, other\n",
              "an element-wise torch.where of the ids and the mask keeps the padded layout: no padding removed",
              capability="FP", style="functional"),
        Valid("class Trainer:\n"
              "    def _logps(self, model, input_ids, attention_mask, keep):\n"
              "        logits = model(input_ids=input_ids).logits[:, :-1]\n"
              "        return selective_log_softmax(logits[:, -keep:], input_ids[:, -keep:])\n"
              "    def step(self, seqs, keep):\n"
              "        return self._logps(self.actor, seqs, None, keep)\n",
              why="a mask parameter never read and handed no mask: a placeholder of the interface",
              capability="C8", style="class"),
        Valid("def logps(model, input_ids, attention_mask):\n"
              "    return model(input_ids).logits.log_softmax(-1)\n",
              why="a mask parameter never read, no caller in view: the model may take no mask", capability="C8",
              style="functional"),
    ]

    INVALID = [
        Invalid(_PACKED_OR_PADDED.format(mask=""), line=8,
                why="the mask gives the positions (counted here, or made by a helper the forward takes them from) "
                    "and nothing hands it to the forward", capability="C3", style="class"),
        Invalid(_ACTOR_FORWARD.format(mask=""), line=7,
                why="the function takes the mask by name, so its **kwargs cannot hold it; the mask only gives the "
                    "positions, which do not hide the padding", capability="C3", style="class"),
        Invalid("def score(model, ids, tokenizer):\n"
                "    attention_mask = (ids != tokenizer.pad_token_id).long()\n"
                "    logits = model(ids).logits\n"
                "    return logits\n", line=3, why="a pad mask of the same ids, never passed", capability="C1",
                style="functional"),
        Invalid("def score(model, batch):\n"
                "    input_ids = batch['input_ids']\n"
                "    attention_mask = batch['attention_mask']\n"
                "    return model(input_ids, position_ids=batch['position_ids']).logits\n", line=4,
                why="the batch's attention mask is in scope, the forward gets positions only", capability="C3",
                style="framework"),
        Invalid("class Trainer:\n"
                "    def logps(self, batch):\n"
                "        ids = batch['input_ids'].to(self.device)\n"
                "        attn = batch.get('attention_mask')\n"
                "        pol = self.model(input_ids=ids, attention_mask=attn).logits\n"
                "        with torch.no_grad():\n"
                "            ref = self.ref_model(input_ids=ids).logits\n"
                "        return pol, ref\n", line=7,
                why="the policy gets the mask, the reference does not (get(), a cast)", capability="C3",
                style="class"),
        Invalid("def forward(model, ids, cfg):\n"
                "    keep = ids != PAD\n"
                "    lengths = keep.sum(-1)\n"
                "    packed = ids[keep][None]\n"
                "    position_ids = torch.cat([torch.arange(int(n)) for n in lengths])[None]\n"
                "    row_of = torch.repeat_interleave(torch.arange(len(ids)), lengths)\n"
                "    attention_mask = (row_of[:, None] == row_of[None, :])[None]\n"
                "    return model(packed, position_ids=position_ids)\n", line=8,
                why="packed rows: the block mask is built, not passed", capability="C7", style="functional"),
        Invalid("def forward(model, ids, pad):\n"
                "    keep = ids.ne(pad)\n"
                "    flat = ids[keep].unsqueeze(0)\n"
                "    seg = torch.repeat_interleave(torch.arange(ids.size(0)), keep.sum(1))\n"
                "    block = seg[:, None] == seg[None, :]\n"
                "    return model.forward(flat)\n", line=6,
                why="a block mask under another name, model.forward", capability="C2", style="functional"),
        Invalid("mask = ids.ne(PAD_ID)\n"
                "seq = ids\n"
                "out = policy(seq)\n", line=3, why="an alias of the padded ids, ne()", capability="C1",
                style="script"),
        Invalid("def rollout_logps(policy, tok, prompts):\n"
                "    enc = tok(prompts, return_tensors='pt', padding=True)\n"
                "    ids = enc['input_ids']\n"
                "    mask = enc['attention_mask']\n"
                "    out = policy.generate(ids, attention_mask=mask)\n"
                "    logits = policy(ids).logits\n"
                "    return out, logits\n", line=6,
                why="the mask goes to generate, not to the forward of the same ids", capability="C12",
                style="framework"),
        Invalid("class Critic:\n"
                "    def values(self, batch):\n"
                "        input_ids = batch.input_ids\n"
                "        attention_mask = batch.attention_mask\n"
                "        return self.critic(input_ids).squeeze(-1)\n", line=5,
                why="attributes of a batch record", capability="C8", style="class"),
        Invalid("def rollout_step(policy, critic, ref, ids, pad_id, adv):\n"
                "    keep = (ids != pad_id).long()\n"
                "    values = critic(input_ids=ids, attention_mask=keep)\n"
                "    logp = policy(input_ids=ids, attention_mask=keep).logits.log_softmax(-1)\n"
                "    with torch.no_grad():\n"
                "        ref_logp = ref(input_ids=ids).logits.log_softmax(-1)\n"
                "    return ((logp - ref_logp).sum(-1) * keep).sum() / keep.sum(), values\n", line=6,
                why="the other forwards of the same ids get the mask, the reference does not (the mask also weighs "
                    "the loss)", capability="C1", style="functional"),
        Invalid("def logps(self, model, input_ids, attention_mask, chunk):\n"
                "    out = []\n"
                "    for start in range(0, input_ids.size(0), chunk):\n"
                "        rows = input_ids[start:start + chunk]\n"
                "        rows_mask = attention_mask[start:start + chunk]\n"
                "        inputs = {'input_ids': rows}\n"
                "        inputs['use_cache'] = False\n"
                "        out.append(model(**inputs).logits)\n"
                "    return torch.cat(out)\n", line=8,
                why="the function is handed the ids' attention mask and splats a dict without it", capability="C3",
                style="class"),
        Invalid("def score(policy, ref, prompts, tok):\n"
                "    seqs = policy(prompts).sequences\n"
                "    keep = seqs.ne(tok.pad_token_id)\n"
                "    return ref(seqs).logits\n", line=4,
                why="ids that another call returned, compared with the pad id: token ids by that use",
                capability="C1", style="functional"),
        Invalid("def score(model, ids, lengths):\n"
                "    attention_mask = ids.new_ones(ids.shape).cumsum(-1) <= lengths[:, None]\n"
                "    return model(ids).logits\n", line=3, preview=True,
                why="a local known as the attention mask by its name alone, built from the ids' data: preview",
                capability="C1", style="functional"),
        Invalid(_RM_WORKER.format(mask=""), line=17,
                why="the remove-padding path removes these rows' padding with the mask, the padded path forwards "
                    "them without it (the mask also picks the last token: that does not excuse it)",
                capability="C7", style="class"),
        Invalid("def rm_scores(reward_model, mb, flat):\n"
                "    t = mb['input_ids']\n"
                "    keep = mb['attention_mask']\n"
                "    where = mb['position_ids']\n"
                "    if flat:\n"
                "        u, rows, *_ = unpad_input(t.unsqueeze(-1), keep)\n"
                "        h = reward_model(input_ids=u.transpose(0, 1), attention_mask=None,\n"
                "                         position_ids=where.flatten()[rows][None])\n"
                "        s = pad_input(h.logits.squeeze(0), rows, *t.shape).squeeze(-1)\n"
                "    else:\n"
                "        s = reward_model(input_ids=t, position_ids=where).logits.squeeze(-1)\n"
                "    end = torch.argmax(where * keep, dim=-1)\n"
                "    return s[torch.arange(s.size(0)), end]\n", line=11,
                why="the same worker with other local names: the batch keys and the unpad path say what they are",
                capability="C3", style="functional"),
        Invalid("class Trainer:\n"
                "    def _logps(self, model, input_ids, attention_mask, keep):\n"
                "        logits = model(input_ids=input_ids).logits[:, :-1]\n"
                "        return selective_log_softmax(logits[:, -keep:], input_ids[:, -keep:])\n"
                "    def step(self, seqs, keep):\n"
                "        m = (seqs != self.tokenizer.pad_token_id).long()\n"
                "        return self._logps(self.actor, seqs, m, keep)\n", line=3,
                why="the caller builds the pad mask and hands it in; the helper never reads it",
                capability="C8", style="class"),
                Invalid("def reward(critic, input_ids, attention_mask):\n"
                "    position_ids = attention_mask.long().cumsum(-1) - 1\n"
                "    position_ids.masked_fill_(attention_mask == 0, 1)\n"
                "    values = critic(input_ids, position_ids=position_ids).logits.squeeze(-1)\n"
                "    last = attention_mask.size(1) - 1 - attention_mask.long().fliplr().argmax(dim=1, keepdim=True)\n"
                "    return values.gather(1, last).squeeze(1)\n", line=4,
                why="positions counted from the mask are for rows whose padding comes first; the mask also picks "
                    "the last token, and the forward still attends to the padding",
                capability="C8", style="functional"),
    ]

    def check(self, ctx: Analysis) -> Iterator[Violation]:
        for call in ctx.nodes(cst.Call):
            ids = forward_candidate_ids(ctx, call)
            if ids is None or _takes_layout(ctx, call):
                continue
            if calls_helper(ctx, call):
                continue  # a helper of this module, not a forward (model_forward_ids' cheap test, first)
            # a local known as an attention mask by its name alone is a preview part: not even traced otherwise
            masks = attention_masks(ctx, ids, named=ctx.preview)
            if not masks and not hands_attention_masks(ctx, ctx.enclosing_function(call)):
                continue  # no mask in view for these ids: nothing to say, whatever the call is
            ids = model_forward_ids(ctx, call, of_forward=True)
            if ids is None:
                continue
            sibling = masked_sibling(ctx, call, ids)
            if sibling is not None:
                yield Violation(call, _sibling_message(ctx, call, ids, *sibling))
                continue
            # ids that come out of another model call are token ids only when compared with the pad id
            generated = bool(forwards(ctx, ids))
            for mask in masks:
                if generated and mask.kind != "pad":
                    continue
                uses = def_consumers(ctx, mask.d)
                if any(u.node is call or ctx.contains(call, u.node) for u in uses):
                    continue
                if all(_attention_use(u) or _layout_use(ctx, u, ids, call) for u in uses) or any(
                        _hides_padding(ctx, u, ids, call) for u in uses):
                    violation = Violation(call, _message(ctx, call, ids, mask, uses))
                    violation.preview = mask.kind == "named"
                    yield violation
                    break


def _takes_layout(ctx: Analysis, call: cst.Call) -> bool:
    """Whether the forward is handed a mask or a row layout (or could be: a splat of unknown keys, a second
    positional argument)."""
    splatted = splat_keys(ctx, call)
    if splatted is None:
        # the function's own `**kwargs`: open, but never holding a name the function takes as a parameter; when
        # the function takes the mask by name, its `**kwargs` cannot hand the forward that mask
        own = own_kwargs_splat(ctx, call)
        if own is None or not any(_row_layout(name) for name in own[1]):
            return True
        splatted = own[0]
    if any(_row_layout(k) for k in splatted):
        return True
    positional = 0
    for arg in call.args:
        if arg.star == "*":
            return True
        if arg.star:
            continue
        if arg.keyword is None:
            positional += 1
            continue
        if _row_layout(arg.keyword.value):
            return True
    return positional > 1


def _row_layout(keyword: str) -> bool:
    """Whether a keyword of a forward hands it the token rows' mask or layout (``attention_mask``,
    ``cu_seqlens``...; not ``pixel_attention_mask``)."""
    name = keyword.lower()
    return ("mask" in name and not name.startswith(OTHER_INPUT_MASK)) or name in LAYOUT_KEYWORDS


def _attention_use(use: Use) -> bool:
    """A use that hands the value on as an attention mask (to another forward, to ``generate``, into a batch
    entry), not one that computes with it."""
    if use.kind in ("keyword", "entry"):
        name = str(use.detail or "").lower()
        return "attention" in name or "attn" in name
    return False


def _layout_use(ctx: Analysis, use: Use, ids, forward: cst.Call) -> bool:
    """A use that reads the mask as the layout of the ids' rows: their positions (``mask.cumsum(-1)``, the
    ``mask == 0`` slots filled in them, a call whose result the forward takes as ``position_ids=``), or unpadding
    them (a call handed the ids and the mask together). Positions alone do not hide padding from attention: the
    forward still needs the mask."""
    if use.kind == "argument" and isinstance(use.node, cst.Call) and _feeds_positions(ctx, use.node, forward):
        return True
    if use.kind == "method" and use.detail == "cumsum":
        return True
    if use.kind == "compare":
        # `positions.masked_fill_(mask == 0, 1)`: the pad slots of positions counted from the mask (a comparison
        # that builds labels or weights serves the loss instead)
        arg = ctx.index.parent_of(use.node)
        call = ctx.index.parent_of(arg) if isinstance(arg, cst.Arg) else None
        return isinstance(call, cst.Call) and ctx.method(call) in ("masked_fill", "masked_fill_") and \
            _counted_positions(ctx, S.receiver(call))
    if use.kind == "argument" and isinstance(use.node, cst.Call):
        return any(same_value(ctx, arg.value, ids) or _one_path_of(ctx, arg.value, ids)
                   for arg in use.node.args if not arg.star)
    return False


def _hides_padding(ctx: Analysis, use: Use, ids, forward: cst.Call) -> bool:
    """A use of the mask that shows these rows' padding must not reach the model, whatever else the mask serves
    (a last-token index, the loss): the positions this forward takes are counted from it (``mask.cumsum(-1)``:
    positions that differ from the column index, so padding precedes the rows' tokens), or it removes the padding
    of these ids (a call handed the ids and the mask, ``ids[mask]``) for a model forward of the function (the
    unpadded path of an ``if``, or this forward on another path)."""
    if use.kind == "method" and use.detail == "cumsum":
        return any(arg.keyword is not None and arg.keyword.value in ("position_ids", "positions") and
                   computed_from(ctx, arg.value, use.node) for arg in forward.args)
    if use.kind == "argument" and isinstance(use.node, cst.Call):
        # an unpadding helper (`unpad_input(ids.unsqueeze(-1), mask)`), not an element-wise tensor function
        # (`torch.where(mask, ids, pad)` keeps the padded layout)
        name = ctx.call_name(use.node) or ""
        if name.startswith(("torch.", "numpy.")) and name != "torch.masked_select" or not any(
                arg.value is not use.value and _carries(ctx, arg.value, ids) for arg in use.node.args if not arg.star):
            return False
    elif use.kind != "index" or not isinstance(use.node, cst.Subscript) or not _carries(ctx, use.node.value, ids):
        return False
    func = ctx.enclosing_function(forward)
    for other in ctx.index.descendants(func, cst.Call) if func is not None else ():
        fed = forward_candidate_ids(ctx, other)
        if fed is None or other is use.node or ctx.contains(other, use.node):
            continue
        if computed_from(ctx, fed, use.node) and model_forward_ids(ctx, other, of_forward=True) is not None:
            return True
    return False


def _carries(ctx: Analysis, expr, ids) -> bool:
    """``expr`` is the tensor ``ids`` (reshaped or cast: ``ids.unsqueeze(-1)``), on every path that reaches it."""
    expr = carried(ctx, expr)
    return same_value(ctx, expr, ids) or _one_path_of(ctx, expr, ids)


def _feeds_positions(ctx: Analysis, call: cst.Call, forward: cst.Call) -> bool:
    """``positions = make_positions(mask)`` and the forward takes ``position_ids=positions``."""
    stmt = ctx.index.statement_of(call)
    if not isinstance(stmt, cst.Assign) or stmt.value is not call:
        return False
    bound = {d.key for d in ctx.index.stmt_defs.get(id(stmt), ()) if d.kind == "assign"}
    return any(arg.keyword is not None and arg.keyword.value in ("position_ids", "positions") and
               isinstance(arg.value, cst.Name) and arg.value.value in bound for arg in forward.args)


def _counted_positions(ctx: Analysis, expr) -> bool:
    """``expr`` is a name bound to a running count (``mask.long().cumsum(-1) - 1``): positions."""
    if not isinstance(expr, cst.Name):
        return False
    for d in ctx.flow.reaching(expr.value, expr):
        stack = [d.value] if d.kind == "assign" and d.value is not None else []
        while stack:
            node = stack.pop()
            if isinstance(node, cst.Call) and ctx.method(node) == "cumsum":
                return True
            if isinstance(node, (cst.BinaryOperation, cst.Call, cst.Attribute)):
                stack.extend(children(node))
    return False


def _one_path_of(ctx: Analysis, expr, ids) -> bool:
    """``expr`` is a name whose every binding reaching it also reaches ``ids`` (``sequences`` handed to an unpad
    call, the forward reading either those ids or the unpadded ones)."""
    if not isinstance(expr, cst.Name) or not isinstance(ids, cst.Name) or expr.value != ids.value:
        return False
    at_ids = {id(d) for d in ctx.flow.reaching(ids.value, ids)}
    defs = ctx.flow.reaching(expr.value, expr)
    return bool(defs) and all(id(d) in at_ids for d in defs)


def _sibling_message(ctx: Analysis, call: cst.Call, ids, other: cst.Call, mask) -> str:
    line = ctx.code(ctx.index.statement_of(other)).strip().splitlines()[0]
    return (f"the forward on `{ctx.code(ids)}` gets no attention mask, while another forward of the same ids in this "
            f"function is given `attention_mask={ctx.code(mask)}` (`{line}`): padded rows attend to their padding "
            f"here, so these log-probs differ from the other forward's on the same text; pass "
            f"`attention_mask={ctx.code(mask)}` here too")


def _message(ctx: Analysis, call: cst.Call, ids, mask: MaskCandidate, uses: list[Use]) -> str:
    name = mask.d.key
    elsewhere = " (it goes to another call instead)" if uses else ""
    if mask.kind == "param":
        return (f"the forward on the padded ids `{ctx.code(ids)}` gets no attention mask, though this function is "
                f"handed their attention mask, `{name}`, and hands it to no forward{elsewhere}: each row attends to "
                f"its padding, so its log-probs depend on its batch; pass the mask of these rows as `attention_mask=`")
    line = ctx.code(mask.d.stmt).strip().splitlines()[0]
    what = {"pad": "the pad mask of these ids", "batch": "the batch's attention mask",
            "block": "the block mask of these packed rows", "named": "the attention mask of these rows"}[mask.kind]
    layout = "packed" if mask.kind in ("block", "named") else "padded"
    return (f"the forward on the {layout} ids `{ctx.code(ids)}` gets no attention mask, though {what}, "
            f"`{name}` (`{line}`), is built for it{elsewhere}: each row attends to padding or to the rows packed "
            f"beside it, so its log-probs depend on its batch; pass `attention_mask={name}`")
