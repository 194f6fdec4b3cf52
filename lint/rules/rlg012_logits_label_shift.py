"""RLG012 logits-label-shift: log-probs gathered from ``logits[:, t]`` against ``ids[:, t]``."""

from __future__ import annotations

from typing import Iterator


import libcst as cst

from rlguard.catalog import LOGITS_LABEL_SHIFT
from rlguard.lint.analysis import Analysis
from rlguard.lint.analysis.alignment import (ROOT_IDS, ROOT_LOGITS, GatherSite, alignment, gather_sites,
                                             response_columns, same_record, skips_ignore_index)
from rlguard.lint.analysis.grad import call_sites
from rlguard.lint.analysis.values import Frame
from rlguard.lint.rule import Invalid, Rule, Valid, Violation


# a log-prob helper in the Hugging Face label convention (-100 where a token is skipped), and its callers
_HF_HELPER = ("def batch_logps(logits, labels, label_pad_token_id=-100):\n"
              "{shift}"
              "    mask = labels != {skip}\n"
              "    labels = torch.where(mask, labels, 0)\n"
              "    logp = torch.gather(logits.log_softmax(-1), 2, labels.unsqueeze(2)).squeeze(2)\n"
              "    return (logp * mask).sum(-1)\n")
_HF_SHIFT = "    labels = labels[:, 1:].clone()\n    logits = logits[:, :-1, :]\n"
_HF_SHIFT_UNLESS_SEQ2SEQ = ("    if not is_encoder_decoder:\n        labels = labels[:, 1:].clone()\n"
                            "        logits = logits[:, :-1, :]\n")
_HF_CALLER = ("\ndef forward(model, batch):\n"
              "    out = model(batch['input_ids'], attention_mask=batch['attention_mask'])\n"
              "    return batch_logps(out.logits, batch['labels'])\n")
_HF_CALLER_MADE = ("\ndef forward(self, model, pairs):\n"
                   "    merged = self.concatenate(pairs)\n"
                   "    logits = model(merged['concatenated_input_ids']).logits\n"
                   "    return batch_logps(logits, merged['concatenated_labels'])\n"
                   "\n"
                   "def concatenate(self, pairs):\n"
                   "    out = {}\n"
                   "    for k in pairs:\n"
                   "        out[k.replace('chosen', 'concatenated')] = pairs[k]\n"
                   "    return out\n")
_HF_CALLER_SEQ2SEQ = ("\ndef forward(model, batch):\n"
                      "    out = model(batch['input_ids'], decoder_input_ids=batch['decoder_input_ids'])\n"
                      "    return batch_logps(out.logits, batch['labels'])\n")


# an actor forward with a packed path (unpadded by a helper out of view, layout unknown) and a padded path whose
# labels are the ids rolled one left ({labels})
_TWO_PATHS = ("def forward(self, sequences, attention_mask, packed):\n"
              "    if packed:\n"
              "        sequences, labels = unpad_and_roll(sequences, attention_mask)\n"
              "    else:\n"
              "        labels = {labels}\n"
              "    out = self.model(sequences, attention_mask=attention_mask)\n"
              "    return log_probs_from_logits(out['logits'], labels)\n")


# TRL's GRPO scorer: the model fed a dict of inputs, the last logits_to_keep logits against the last ids
# ({cut}: what the logits lose first)
_SPLAT_INPUTS = ("def per_token_logps(self, model, input_ids, attention_mask, logits_to_keep):\n"
                 "    inputs = {{'input_ids': input_ids, 'attention_mask': attention_mask}}\n"
                 "    inputs['use_cache'] = False\n"
                 "    logits = model(**inputs).logits\n"
                 "    logits = logits{cut}\n"
                 "    logits = logits[:, -logits_to_keep:, :]\n"
                 "    return selective_log_softmax(logits, input_ids[:, -logits_to_keep:])\n")


class LogitsLabelShift(Rule):
    """
    ## What it flags
    Token log-probs (a `gather`, `F.cross_entropy`/`nll_loss`, `Categorical(logits=...).log_prob`, or a
    `log_probs_from_logits`-style helper) where the labels are not the *next* tokens of the logits:

    - no shift at all: `logits = model(ids).logits` then `logits.log_softmax(-1).gather(-1, ids[..., None])`;
    - both sides shifted the same way: `logits[:, :-1]` with `ids[:, :-1]`, `logits[:, 1:]` with `ids[:, 1:]`;
    - any other visible offset between the two (`torch.roll`, `F.pad`, windows like `[:, -L-1:-1]`).

    The rule follows names, `self.` attributes, the ids a model reads from a dict splatted into it
    (`inputs = {"input_ids": ids}; model(**inputs)`), `.logits`/`[0]` of the model output, `log_softmax`,
    `/ temperature`, slices, `F.pad`, `torch.roll` and same-module helpers (with their parameters bound to the
    call's arguments). It reports only when the offset between logits and labels is a known constant other
    than one, and either both come visibly from the same sequence (`model(ids)` and `ids`: the tensor a model
    reads is its token ids, whatever it is called) or both are visibly sliced. An unshifted helper such as `def logprobs(logits, labels): ...gather(-1, labels...)` is correct
    on its own (the caller shifts) and is checked at its call sites instead, unless it moves its labels
    parameter itself while keeping its width (a roll, a pad, a cut joined with a constant piece, as packed
    rank-1 helpers do): then it treats logits and labels as one sequence's positions and the labels it builds
    must be the next tokens. `einx.get_at("b n [v], b n -> b n", logp, ids)` is a gather like
    `logp.gather(-1, ids[..., None])`. Rollout batches follow the response convention: when the logits of a
    model call are cut with the width of the tensor they are gathered against (`R = responses.size(-1)`,
    `logits[:, -R:]` against `responses`), that tensor is taken as the last `R` columns of the model's input, so
    `[:, -R - 1:-1]` is the shift and `[:, -R:]` is not.

    A tensor that several definitions reach is judged by the ones whose layout is known (a packed path that a
    helper out of view unpads says nothing against the padded path beside it); known paths that disagree say
    nothing.

    Hugging Face labels: a helper that skips the ignore index (`labels != -100`, or a name bound to -100 such as a
    `label_pad_token_id=-100` default) reads its labels in the Hugging Face convention, where the labels stand at
    the positions of the input ids (the model, or the code that gathers, shifts them). When a caller hands it the
    logits of a model call and the labels entry of the record whose input-ids entry the model read
    (`batch["labels"]` beside `model(batch["input_ids"])`, a record built by a helper included), the helper must
    shift; if it does not, the finding is reported in the helper. Not when an encoder-decoder forward
    (`decoder_input_ids=`) is in view, nor when the shift is skipped only on an encoder-decoder branch.

    ## Why it is wrong
    A causal LM's `logits[:, t]` is the distribution of token `t + 1`. Gathering it at token `t` scores each
    token under the distribution that was meant to *produce it from itself*: the log-probs are garbage, the
    ratio against the sampler's log-probs is far from 1 before any step (`logp_gap` well above 1e-4), and
    the policy is trained to predict the current token instead of the next one. Reward stays flat or
    collapses while the loss looks normal.

    ## Example
    ```python
    logits = model(ids).logits
    logp = logits.log_softmax(-1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    ```

    ## Use instead
    ```python
    logits = model(ids).logits
    logp = logits[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    ```

    ## Fix
    No automatic fix: whether the logits should lose their last position or the labels their first (and
    which of the tensors downstream, masks included, must move with them) depends on how the rest of the
    trainer stores per-token tensors.

    ## Options
    `[tool.rlguard.names]` `ids = [...]`, `logits = [...]` and `policy = [...]` add your own names for the
    token ids, the logits and the model.
    """

    code = LOGITS_LABEL_SHIFT
    # what scores tokens, by the API that does it: a local name such as `logits` is no part of the trigger (a file
    # whose variables are called otherwise is judged the same)
    triggers = (r"\.gather\(|cross_entropy|nll_loss|\.log_prob\(|take_along_dim|CrossEntropyLoss|NLLLoss"
                r"|get_at\(|log_?probs?_(?:from|of)_|selective_log_softmax|logps?_from|log_softmax_and_gather")

    VALID = [
        Valid(_SPLAT_INPUTS.format(cut="[:, :-1, :]"),
              why="the logits lose their last position before the last K are kept: the next tokens",
              capability="C8", style="framework"),
        Valid(_TWO_PATHS.format(labels="torch.roll(sequences, shifts=-1, dims=1)"),
              why="the padded path rolls the labels one left; the packed path is unpadded out of view",
              capability="C8", style="class"),
        Valid("def chosen_logps(prompt_mask, ids, attention_mask, logits):\n"
              "    mask = attention_mask[:, :-1] > prompt_mask[:, 1:]\n"
              "    lp = torch.gather(logits[:, :-1, :].log_softmax(-1), dim=2, index=(mask * ids[:, 1:]).unsqueeze(2))\n"
              "    return (lp.squeeze(2) * mask).sum(1) / mask.sum(1)\n",
              why="the index is the next tokens zeroed by a mask at the logits' positions: the product has no one "
                  "layout, the ids give the values", capability="C7", style="functional"),
        Valid(_HF_HELPER.format(shift=_HF_SHIFT, skip="-100") + _HF_CALLER,
              why="Hugging Face labels shifted with the logits inside the helper", capability="C4", style="framework"),
        Valid(_HF_HELPER.format(shift=_HF_SHIFT_UNLESS_SEQ2SEQ, skip="-100") + _HF_CALLER,
              why="the shift skipped for an encoder-decoder model only: no telling which one runs", capability="C4",
              style="framework"),
        Valid(_HF_HELPER.format(shift="", skip="-100") + _HF_CALLER_SEQ2SEQ,
              why="an encoder-decoder forward: the decoder's logits stand at their labels' positions",
              capability="C4", style="framework"),
        Valid("def batch_logps(logits, labels):\n"
              "    return torch.gather(logits.log_softmax(-1), 2, labels.unsqueeze(2)).squeeze(2).sum(-1)\n"
              + _HF_CALLER,
              why="a helper that never skips an ignore index says nothing of its labels' convention: the caller's "
                  "labels may be shifted already", capability="C4", style="framework"),
        Valid("logits = model(ids).logits\n"
              "logp = logits[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)\n",
              "the canonical shift"),
        Valid("shift_logits = logits[..., :-1, :].contiguous()\nshift_labels = labels[..., 1:].contiguous()\n"
              "loss = loss_fct(shift_logits.view(-1, V), shift_labels.view(-1))\n", "HF-style shift"),
        Valid("def log_probs_from_logits(logits, labels):\n"
              "    return torch.log_softmax(logits, -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)\n",
              "an unshifted helper: the caller shifts"),
        Valid("output = self.model(sequences, attention_mask=attention_mask)\n"
              "log_probs = log_probs_from_logits(output['logits'][:, :-1, :], sequences[:, 1:])\n",
              "OpenRLHF style", capability="C8", style="class"),
        Valid("output = model(query_responses)\nlogits = output.logits[:, context_length - 1 : -1]\n"
              "logits /= temperature + 1e-7\n"
              "logprob = selective_log_softmax(logits, query_responses[:, context_length:])\n",
              "TRL style window: ctx_len - 1 .. -1 against ctx_len ..", capability="C8", style="framework"),
        Valid("logits = model(input_ids=input_ids).logits.squeeze(0)\n"
              "labels = torch.roll(input_ids, shifts=-1, dims=1).squeeze(0)\n"
              "log_probs = logprobs_from_logits(logits=logits, labels=labels)\n",
              "verl style: labels rolled left by one"),
        Valid("logits = model(ids)\nlogits = logits[:, -1, :]\n"
              "logp = torch.log_softmax(logits, -1).gather(-1, next_token)\n",
              "sampling: the last position against the sampled token"),
        Valid("logits = self.policy(obs)\ndist = Categorical(logits=logits)\nlogp = dist.log_prob(actions)\n",
              "CleanRL: actions are not the input sequence"),
        Valid("def token_logp(model, ids):\n    logits = model(ids)[0]\n"
              "    return F.cross_entropy(logits[:, :-1].transpose(1, 2), ids[:, 1:], reduction='none')\n",
              "cross-entropy with the shift"),
        Valid("def token_log_probs(logits, ids):\n    lp = logits[:, :-1].log_softmax(-1)\n"
              "    return lp.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)\n"
              "def loss_fn(model, ids):\n    return token_log_probs(model(ids), ids)\n",
              "helper that shifts, called with the model output", capability="C4", style="functional"),
        Valid("def forward_batch(model, batch):\n    batch['logits'] = model(batch['input_ids']).logits\n"
              "    lp = batch['logits'][:, :-1].log_softmax(-1)\n"
              "    return lp.gather(-1, batch['input_ids'][:, 1:].unsqueeze(-1)).squeeze(-1)\n",
              why="logits under a batch key, the shift applied on both sides", capability="C3", style="framework"),
        Valid("class Scorer:\n    def run(self, ids):\n        self.cache = {'logits': self.lm(ids).logits}\n"
              "        return self.score(ids)\n    def score(self, ids):\n"
              "        lsm = self.cache['logits'][:, :-1].log_softmax(-1)\n"
              "        return lsm.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)\n",
              why="logits kept on the trainer and gathered against the next tokens", capability="C3", style="class"),
        Valid("def score(logits, labels):\n"
              "    return logits.log_softmax(-1).gather(-1, labels[..., None]).squeeze(-1)\n"
              "def ref_logps(ref, batch):\n    out = ref(batch['input_ids'])\n"
              "    return score(out.logits[:, :-1], batch['input_ids'][:, 1:])\n",
              why="the unshifted helper is fed the shifted pair", capability="C4", style="framework"),
        Valid("class Rollout:\n    def logprobs(self, query_responses, context_length):\n"
              "        logits = self.policy(query_responses).logits[:, context_length - 1:-1]\n"
              "        return selective_log_softmax(logits, query_responses[:, context_length:])\n",
              why="the context window shifted by one between logits and tokens", capability="C8", style="class"),
        Valid("from einx import get_at\nclass StepScorer(nn.Module):\n    def forward(self, tokens):\n"
              "        src, tgt = tokens[:, :-1], tokens[:, 1:]\n        logits = self.lm(src)\n"
              "        return get_at('b t [v], b t -> b t', logits.log_softmax(dim=-1), tgt)\n",
              why="einx.get_at over logits of all but the last token, at the next tokens",
              capability="C12", style="class"),
        Valid("def packed_token_logp(logits, seqlens, labels):\n"
              "    labels = torch.cat([labels[1:], labels.new_zeros(1)])\n"
              "    logp = torch.log_softmax(logits, dim=-1)\n"
              "    return logp.gather(-1, labels[:, None]).squeeze(-1)\n",
              why="a packed helper shifts the labels one left and pads the end", capability="C7", style="functional"),
        Valid("def lp_of(logits, labels):\n    labels = labels.long()\n"
              "    return logits.log_softmax(-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)\n",
              why="a helper that leaves its labels alone: the caller shifts", capability="C7", style="script"),
        Valid("def old_logp(actor, mb, temperature):\n    resp = mb['responses']\n    resp_len = resp.size(-1)\n"
              "    out = actor(input_ids=mb['input_ids'], attention_mask=mb['attention_mask'])\n"
              "    logits = out.logits / temperature\n    logits = logits[:, -resp_len - 1:-1, :]\n"
              "    return logprobs_from_logits(logits, resp)\n",
              why="responses are the last R columns of the input: logits[:, -R-1:-1] predict them",
              capability="C8", style="framework"),
        Valid("P = b['prompts'].shape[1]\nlg = policy(b['input_ids']).logits[:, P - 1:-1]\n"
              "lp = selective_log_softmax(lg, b['responses'])\n",
              why="the window is the prompt's width, not the labels': no convention applies, nothing is assumed",
              capability="C8", style="script"),
        Valid("def chunked_logps(logits, targets, width=512):\n"
              "    parts = []\n"
              "    for i in range(0, logits.shape[1], width):\n"
              "        z = logits[:, i:i + width].float().log_softmax(-1)\n"
              "        parts.append(z.gather(-1, targets[:, i:i + width].unsqueeze(-1)).squeeze(-1))\n"
              "    return torch.cat(parts, dim=1)\n"
              "\n"
              "def score(model, ids):\n"
              "    return chunked_logps(model(ids).logits[:, :-1], ids[:, 1:])\n",
              "the helper cuts the same running window from both: the caller already paired them",
              capability="C7", style="functional"),
        Valid("def forward_for_logprobs(model, ids, attention_mask, pad_id):\n"
              "    output = model(input_ids=ids, attention_mask=attention_mask)\n"
              "    logits = getattr(output, 'logits', output)[:, :-1]\n"
              "    labels = ids[:, 1:].clone()\n"
              "    labels[labels == pad_id] = 0\n"
              "    return log_softmax_and_gather(logits, labels)\n",
              "a model output's logits read with getattr, shifted against the next tokens", capability="C12",
              style="functional"),
        Valid("def score(ref_model, rollout_engine, prompt_ids, pad_id):\n"
              "    out = rollout_engine.rollout(prompt_ids=prompt_ids)\n"
              "    gen = out.samples\n"
              "    m = (gen != pad_id).long()\n"
              "    y = gen[:, 1:].clone()\n"
              "    with torch.no_grad():\n"
              "        z = ref_model(input_ids=gen, attention_mask=m).logits[:, :-1]\n"
              "        return F.log_softmax(z, dim=-1).gather(2, y.unsqueeze(-1)).squeeze(-1)\n",
              "labels cut one token right of the sequence the reference reads, logits cut one left", capability="C2",
              style="functional"),
        Valid("def update(model, rows, targets):\n    batch = torch.tensor(rows, dtype=torch.long)\n"
              "    out = model.forward(batch).float()\n"
              "    return -F.cross_entropy(out.reshape(-1, out.size(-1)), targets.reshape(-1), reduction='none')\n",
              why="a tensor built here is the model's input; the labels are another tensor, aligned by its producer",
              capability="C12", style="functional"),
    ]

    INVALID = [
        Invalid(_SPLAT_INPUTS.format(cut=""), line=7,
                why="the ids the model reads come in a dict splatted into it; the last K logits, not cut at the "
                    "end first, score the last K ids: each its own token", capability="C8", style="framework"),
        Invalid(_TWO_PATHS.format(labels="sequences"), line=7,
                why="on the padded path the labels are the ids the model read, unshifted; the packed path's "
                    "layout is unknown and says nothing against it", capability="C8", style="class"),
        Invalid(_HF_HELPER.format(shift="", skip="-100") + _HF_CALLER, line=4,
                why="the helper skips the ignore index, so its labels are Hugging Face labels; the caller hands it "
                    "the record's labels beside the input ids the model read: each logit against its own token",
                capability="C4", style="framework"),
        Invalid(_HF_HELPER.format(shift="", skip="label_pad_token_id") + _HF_CALLER_MADE, line=4,
                why="the ignore index as a parameter's default; the record made by a helper of the module",
                capability="C4", style="framework"),
        Invalid("def score(ref_model, rollout_engine, prompt_ids, pad_id):\n"
                "    out = rollout_engine.rollout(prompt_ids=prompt_ids)\n"
                "    gen = out.samples\n"
                "    m = (gen != pad_id).long()\n"
                "    y = gen.clone()\n"
                "    with torch.no_grad():\n"
                "        z = ref_model(input_ids=gen, attention_mask=m).logits[:, :-1]\n"
                "        return F.log_softmax(z, dim=-1).gather(2, y.unsqueeze(-1)).squeeze(-1)\n", line=8,
                why="the labels are the very sequence the model reads (token ids by that use, whatever they are "
                    "called), unshifted, against logits cut at the last position", capability="C2",
                style="functional"),
        Invalid("def forward_for_logprobs(model, ids, attention_mask, pad_id):\n"
                "    output = model(input_ids=ids, attention_mask=attention_mask)\n"
                "    logits = getattr(output, 'logits', output)\n"
                "    labels = ids.clone()\n"
                "    labels[labels == pad_id] = 0\n"
                "    return model_utils.log_softmax_and_gather(logits, labels)\n", line=6,
                why="getattr(output, 'logits', output) reads the model's logits; each position is scored against its "
                    "own input token", capability="C12", style="functional"),
        Invalid("logits = model(ids).logits\n"
                "logp = logits.log_softmax(-1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)\n", line=2,
                why="no shift"),
        Invalid("log_probs = logits[:, :-1].log_softmax(-1)\n"
                "logp = log_probs.gather(-1, ids[:, :-1].unsqueeze(-1)).squeeze(-1)\n", line=2,
                why="both sides drop the last position"),
        Invalid("def get_logps(self, input_ids):\n    out = self.model(input_ids=input_ids)\n"
                "    logits = out.logits[:, 1:]\n    labels = input_ids[:, 1:]\n"
                "    return torch.gather(logits.log_softmax(dim=-1), 2, labels[:, :, None]).squeeze(2)\n",
                line=5, why="both sides drop the first position"),
        Invalid("logits = policy(ids)\nnll = F.cross_entropy(logits.reshape(-1, V), ids.reshape(-1), reduction='none')\n",
                line=2, why="cross-entropy against the input tokens"),
        Invalid("def update(model, rows):\n    batch = torch.tensor(rows, dtype=torch.long)\n"
                "    out = model.forward(batch).float()\n"
                "    lp = -F.cross_entropy(out.reshape(-1, out.size(-1)), batch.reshape(-1), reduction='none')\n"
                "    return lp.view(batch.shape[0], -1)\n", line=4,
                why="a tensor built here, read by the model and scored against itself: no name says ids or logits, "
                    "the model call and the loss do", capability="C12", style="functional"),
        Invalid("logits = model(tokens)\ndist = torch.distributions.Categorical(logits=logits / temperature)\n"
                "logp = dist.log_prob(tokens)\n", line=3, why="Categorical over the input tokens"),
        Invalid("logits = model(ids)\nlabels = torch.roll(ids, 1, dims=-1)\n"
                "logp = log_probs_from_logits(logits, labels)\n", line=3, why="rolled the wrong way"),
        Invalid("def token_log_probs(logits, ids):\n    lp = logits.log_softmax(-1)\n"
                "    return lp.gather(-1, ids.unsqueeze(-1)).squeeze(-1)\n"
                "def loss_fn(model, ids):\n    return token_log_probs(model(ids), ids)\n",
                line=5, why="helper without a shift, fed the model output and its input",
                capability="C4", style="functional"),
        Invalid("class Trainer:\n    def logp(self, ids):\n        self.logits = self.actor(ids).logits\n"
                "        lsm = torch.log_softmax(self.logits[:, 1:], -1)\n"
                "        return lsm.gather(-1, ids[:, 1:].unsqueeze(-1))\n", line=5,
                why="through a self attribute", capability="C3", style="class"),
        Invalid("loss_fct = nn.CrossEntropyLoss()\nlogits = model(input_ids)[0]\n"
                "loss = loss_fct(logits[:, :-1].flatten(0, 1), input_ids[:, :-1].flatten())\n", line=3,
                why="loss object, both drop the last position"),
        Invalid("def forward_batch(model, batch):\n    batch['logits'] = model(batch['input_ids']).logits\n"
                "    lp = batch['logits'].log_softmax(-1)\n"
                "    return lp.gather(-1, batch['input_ids'].unsqueeze(-1)).squeeze(-1)\n", line=4,
                why="logits stored under a batch key and gathered against the same batch's ids",
                capability="C3", style="framework"),
        Invalid("out = {'logits': net(tokens).logits, 'n': tokens.size(1)}\n"
                "lp = torch.gather(out['logits'].log_softmax(-1), 2, tokens[:, :, None]).squeeze(2)\n", line=2,
                why="logits through a dict literal, gathered at the input tokens", capability="C3", style="script"),
        Invalid("def score(logits, labels):\n"
                "    return logits.log_softmax(-1).gather(-1, labels[..., None]).squeeze(-1)\n"
                "def ref_logps(ref, batch):\n    out = ref(batch['input_ids'])\n"
                "    return score(out.logits, batch['input_ids'])\n", line=5,
                why="an unshifted scoring helper fed a model's logits and the model's own input",
                capability="C4", style="framework"),
        Invalid("def response_logps(model, data):\n    R = data['responses'].size(1)\n    seq = data['input_ids']\n"
                "    logits = model(input_ids=seq).logits[:, -R:]\n"
                "    return logprobs_from_logits(logits, seq[:, -R:])\n", line=5,
                why="logits over the response window gathered against the same window of the sequence",
                capability="C8", style="framework"),
        Invalid("class Rollout:\n    def logprobs(self, query_responses, context_length):\n"
                "        logits = self.policy(query_responses).logits[:, context_length:]\n"
                "        return selective_log_softmax(logits, query_responses[:, context_length:])\n", line=4,
                why="a context window cut the same way on logits and tokens", capability="C8", style="class"),
        Invalid("from einx import get_at\nclass StepScorer(nn.Module):\n    def forward(self, tokens):\n"
                "        logits = self.lm(tokens)\n"
                "        return get_at('b t [v], b t -> b t', logits.log_softmax(dim=-1), tokens)\n", line=5,
                why="einx.get_at gathers the last axis: here at the input tokens themselves",
                capability="C12", style="class"),
        Invalid("def packed_token_logp(logits, seqlens, labels):\n"
                "    labels = torch.cat([labels[:-1], labels.new_zeros(1)])\n"
                "    logp = torch.log_softmax(logits, dim=-1)\n"
                "    return logp.gather(-1, labels[:, None]).squeeze(-1)\n", line=4,
                why="a packed helper drops the last label and pads it back: the labels did not move",
                capability="C7", style="functional"),
        Invalid("def lp_of(logits, labels):\n    labels = torch.roll(labels, shifts=1, dims=-1)\n"
                "    return logits.log_softmax(-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)\n", line=3,
                why="a helper rolls its labels the wrong way", capability="C7", style="script"),
        Invalid("def old_logp(actor, mb, temperature):\n    resp = mb['responses']\n    resp_len = resp.size(-1)\n"
                "    out = actor(input_ids=mb['input_ids'], attention_mask=mb['attention_mask'])\n"
                "    logits = out.logits / temperature\n    logits = logits[:, -resp_len:, :]\n"
                "    return logprobs_from_logits(logits, resp)\n", line=7,
                why="responses are the last R columns of the input: logits[:, -R:] scores each token at its own slot",
                capability="C8", style="framework"),
        Invalid("lg = policy(b['input_ids']).logits[:, -b['responses'].shape[1]:]\n"
                "lp = selective_log_softmax(lg, b['responses'])\n", line=2,
                why="the response width read inline: the same unshifted window", capability="C8", style="script"),
        Invalid("def chunked_logps(logits, targets, width=512):\n"
                "    parts = []\n"
                "    for i in range(0, logits.shape[1], width):\n"
                "        z = logits[:, i:i + width].float().log_softmax(-1)\n"
                "        parts.append(z.gather(-1, targets[:, i:i + width].unsqueeze(-1)).squeeze(-1))\n"
                "    return torch.cat(parts, dim=1)\n"
                "\n"
                "def score(model, ids):\n"
                "    return chunked_logps(model(ids).logits, ids)\n", line=9,
                why="the caller passes logits and ids unshifted into a chunking helper", capability="C4",
                style="functional"),
    ]

    def check(self, ctx: Analysis) -> Iterator[Violation]:
        reported: set[int] = set()
        sites = gather_sites(ctx)
        for site in sites:
            message = _judge(ctx, site, None)
            if message is not None and id(site.node) not in reported:
                reported.add(id(site.node))
                yield Violation(site.node, message)
        # helpers whose gather reads their parameters: judge them with each call site's arguments
        by_function: dict[int, list[GatherSite]] = {}
        for site in sites:
            func = ctx.enclosing_function(site.node)
            if func is not None and id(site.node) not in reported:
                by_function.setdefault(id(func), []).append(site)
        logits = alignment(ctx, "logits")
        for func_sites in by_function.values():
            func = ctx.enclosing_function(func_sites[0].node)
            for call in call_sites(ctx, func):
                frame = logits.enter_frame(func, call, None)
                if frame is None:
                    continue
                for site in func_sites:
                    message = _judge(ctx, site, frame)
                    if message is None:
                        continue
                    if _hf_labels(ctx, site, frame):
                        # the helper itself reads its labels as Hugging Face labels (it skips the ignore index),
                        # so the missing shift is its own: reported where it gathers, once
                        if id(site.node) not in reported:
                            reported.add(id(site.node))
                            yield Violation(site.node, f"{message} (the labels are Hugging Face labels: the entry "
                                                       f"beside the model's input in one record, at the input's "
                                                       f"positions, as `{ctx.code(call)[:60]}` hands them)")
                    elif id(call) not in reported:
                        reported.add(id(call))
                        yield Violation(call, f"in `{func.name.value}` called here: {message}")


def _judge(ctx: Analysis, site: GatherSite, frame: Frame | None) -> str | None:
    logits = alignment(ctx, "logits").value(site.logits, frame)
    if logits is None or not (logits.model or logits.kind == ROOT_LOGITS):
        return None
    labels = alignment(ctx, "seq").value(site.labels, frame)
    if frame is None and (labels is None or not labels.moved and labels.root != logits.root):
        labels = response_columns(ctx, site.labels, logits, site.node) or labels  # C8: responses, last R columns
    if labels is None:
        return None
    # Hugging Face labels: the entry beside the model's input in one record, skipped at the ignore index where
    # they are gathered, are that input's positions (the model, or here the trainer, shifts them)
    same_sequence = logits.model and (logits.root == labels.root or same_record(labels, logits) and _hf_labels(
        ctx, site, frame))
    if labels.kind != ROOT_IDS and not same_sequence:
        return None  # labels are token ids by their name, or by being the very sequence the model reads
    both_moved = logits.moved and labels.moved
    if not (same_sequence or both_moved or (frame is None and _shifts_its_labels(ctx, site, logits, labels))):
        return None
    if both_moved and not same_sequence and not logits.s.is_const() and not labels.s.is_const():
        return None  # one window at a running position cut from both (chunking): it keeps whatever pairing they had
    diff = labels.s - logits.s
    if not diff.is_const():
        diff = labels.e - logits.e
        if not diff.is_const():
            return None
    k = diff.const
    if k == 1:
        return None
    if k == 0:
        what = "the labels are the tokens at the logits' own positions (logits[:, t] against ids[:, t])"
    else:
        what = f"the labels are {k:+d} positions from the logits' own positions (the next token is +1)"
    return f"{what}; logits[:, t] predicts ids[:, t+1]: gather logits[:, :-1] against ids[:, 1:]"


def _hf_labels(ctx: Analysis, site: GatherSite, frame: Frame | None) -> bool:
    """The labels gathered at ``site`` follow the Hugging Face convention: the function that gathers them skips the
    ignore index, and no encoder-decoder forward (``decoder_input_ids=``) is in view of it or its caller, where the
    decoder's logits already stand at their labels' positions. Asked twice per judged call site (to judge, and to
    say where to report): answered once."""
    memo = ctx.cache.setdefault("rlg012_hf_labels", {})
    key = (id(site.node), id(frame))
    if key not in memo:
        memo[key] = _hf_labels_uncached(ctx, site, frame)
    return memo[key]


def _hf_labels_uncached(ctx: Analysis, site: GatherSite, frame: Frame | None) -> bool:
    func = ctx.enclosing_function(site.node)
    if func is None or not skips_ignore_index(ctx, func, site.labels):
        return False
    scopes = [func] + ([ctx.enclosing_function(frame.call)] if frame is not None and frame.call is not None else [])
    return not any(scope is not None and any(
        arg.keyword is not None and arg.keyword.value == "decoder_input_ids"
        for call in ctx.index.descendants(scope, cst.Call) for arg in call.args) for scope in scopes)


def _shifts_its_labels(ctx: Analysis, site: GatherSite, logits, labels) -> bool:
    """A helper that takes logits and labels as parameters and moves the labels itself, keeping their width (a
    roll, a pad, a cut joined with a constant piece), with the logits as they came: it treats both parameters as
    one sequence's positions, so the labels it builds must be the next tokens (+1)."""
    func = ctx.enclosing_function(site.node)
    if func is None or logits.moved or not labels.moved or logits.model:
        return False
    width = labels.e - labels.s
    if not width.is_const() or width.const != 0:
        return False
    params = {p.name.value for p in (*func.params.posonly_params, *func.params.params, *func.params.kwonly_params)}
    return logits.name in params and labels.name in params and logits.root.split("@")[1:] == \
        labels.root.split("@")[1:]
