"""RLG001 mask-not-shifted: the action/loss mask sits one token off the log-probs it selects."""

from __future__ import annotations

import re
from typing import Iterator

import libcst as cst

from rlguard.catalog import MASK_NOT_SHIFTED
from rlguard.lint.analysis import Analysis, dotted_name
from rlguard.lint.analysis import semantics as S
from rlguard.lint.analysis.alignment import (ATTENTION_NAME, LIKE_FUNCTIONS, OWNER_NAME, ROOT_IDS, ROOT_LOGITS,
                                             ROOT_TOKEN, ROOT_UNKNOWN, VALUE_HEAD, Align, alignment,
                                             classify_root, gather_site, token_values)
from rlguard.lint.analysis.grad import call_sites
from rlguard.lint.analysis.index import children
from rlguard.lint.analysis.records import records_by_function
from rlguard.lint.analysis.roles import names_along
from rlguard.lint.analysis.values import Frame
from rlguard.lint.rule import Invalid, Rule, Valid, Violation

# Entries of a record (C3): the labels a loss scores, and a per-token loss mask stored beside them.
LABEL_ENTRY = re.compile(r"(?i)(shift(ed)?_|rolled_|next_)?(labels?|targets?|target_ids|target_tokens|next_tokens)")
LOSS_MASK_ENTRY = re.compile(r"(?i)\w*(loss|action|completion|response|resp|policy|generation|gen)_?masks?")
PRODUCER_NAME = re.compile(r"(?i)(action|loss|response|resp|completion|policy|token|act)_?masks?")


class MaskNotShifted(Rule):
    """
    ## What it flags
    An action/loss mask that selects per-token values (log-probs, ratios, per-token losses, KL terms) from a
    different position than the one where those values are stored:

    - a mask built from `ids`-aligned data (`owner == POLICY`, `attention_mask`, `ids != pad`) with
      `[:, :-1]` where `[:, 1:]` is meant: `action_mask = (owner[:, :-1] == POLICY).float()`;
    - a pad, roll or window that moves the mask the wrong way relative to the log-probs:
      `F.pad(mask, (1, 0))[:, :-1]`, `torch.roll(mask, 1, -1)`, `attention_mask[:, -L-1:-1]` beside
      log-probs `[:, -L:]`.

    The rule works out where the log-probs are stored from the code that gathers them (`logits[:, :-1]`
    against `ids[:, 1:]` gives ids positions 1..T-1; log-probs padded back to token positions give 0..T-1)
    and where the mask is, following names, `self.` attributes, batch keys, slices, `F.pad`, `torch.roll`,
    comparisons and same-module helpers. It reports only when the two are a known, non-zero number of
    positions apart. A mask read as it is (`mask = batch["action_mask"]`) is trusted: per the catalog,
    per-token masks are already [B, T-1] and aligned to `ids[:, 1:]`.

    Where the two meet is followed through records and calls: a mask stored under a batch key, a `self.`
    attribute or a dataclass field and read back elsewhere; a mask and log-probs computed here that meet only as
    arguments of a loss helper out of view (`ppo_objective(lp, adv, keep)`); and a record that stores token
    `labels` moved off the ids (`torch.roll(ids, -1, 1)`, `ids[:, 1:]`, the Megatron convention: the loss
    scores `labels[:, t]` at slot `t`) beside a loss mask left at ids positions.

    Value heads follow the log-probs' convention: a value prediction at slot `t`, computed from the prefix
    `ids[:, :t + 1]`, is the value of the state in which the policy emits `ids[:, t + 1]`, so it pairs with the
    next token exactly like the log-prob at slot `t`. Value predictions sliced like logits (`critic(ids)[:, :-1]`,
    `vhead(seq).logits[:, -R - 1:-1].squeeze(-1)`) take the log-probs' mask (`attention_mask[:, 1:]`,
    `attention_mask[:, -R:]`), and a value tensor read from a batch or an experience record is, like every
    per-token training tensor, [B, T-1] aligned to `ids[:, 1:]` (it is never judged by its name alone).

    When the shift is applied out of view (a framework's batch loader that rolls `labels` in another file),
    nothing here can place the log-probs; the runtime check (the mask equals policy ownership of `ids[:, 1:]`)
    covers it.

    ## Why it is wrong
    `logp[:, t]` is the log-prob of `ids[:, t + 1]`. A mask aligned to `ids` instead of `ids[:, 1:]` moves
    every policy span one token: the loss trains on the last prompt or environment token before each span
    and drops the policy's final token (often its answer or EOS). The run looks healthy, but the ratio and
    KL include tokens the policy never chose, pass rates stall, and multi-turn episodes learn to imitate the
    environment's first token.

    ## Example
    ```python
    action_mask = (owner[:, :-1] == POLICY).float()
    loss = (pg_loss * action_mask).sum() / action_mask.sum()
    ```

    ## Use instead
    ```python
    action_mask = (owner[:, 1:] == POLICY).float()  # aligned to ids[:, 1:], like the log-probs
    ```

    ## Fix
    No automatic fix: the right correction (slice the mask `[:, 1:]`, drop a pad, or move the log-probs
    instead) depends on how the trainer stores its per-token tensors.

    ## Options
    `[tool.rlguard.names]` `mask = [...]`, `logp = [...]` and `ids = [...]` add your own names.
    """

    code = MASK_NOT_SHIFTED
    # Precise where a mask's alignment is a convention, not a producer's (an attention or padding mask, an ownership
    # tensor, a comparison of the ids themselves: all sit at ids positions): on the 49 repositories that part reports
    # one finding, TRUE, and renaming changes none. The FALSE findings the ecosystem showed all came from loss/action
    # masks whose producer decides the alignment (a rolled-labels engine, a collate in another module), from a mask
    # cut to a common width, or from value heads: those are the rule's preview parts. The rule itself stays in preview
    # for its cost: in the default set it added 0.44 s to the cold lint of trl (b/a 1.49 to about 1.58, goal 1.5)
    preview = True
    PREVIEW_PARTS = ("a loss, action or response mask read from elsewhere (`batch['loss_mask']`, a record's field): "
                     "where it sits is decided by its producer, often out of view",
                     "a mask of unknown origin moved against log-probs computed in view (`torch.roll(mask, 1, -1)` "
                     "on a mask this file does not build)",
                     "a mask beside a value head's predictions only: where values sit is a framework's choice (verl's "
                     "critic reads them at the state positions)")
    # a mask and a shift: a 2-d slice, a pad or roll, or a window from the end (`[-R:]`, not an index `[-1]`)
    triggers = (r"mask", r"\[\s*:\s*,|\[\s*\.\.\.\s*,|\.pad\(|roll\(|\[\s*-[^\]\n]*:")

    VALID = [
        Valid("logits = model(ids).logits\n"
              "logp = logits[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)\n"
              "mask = attention_mask[:, 1:]\nloss = -(logp * adv * mask).sum() / mask.sum()\n",
              "attention_mask[:, 1:] beside logits[:, :-1]"),
        Valid("mask = batch['action_mask']\nloss_mask = mask\nratio = torch.exp(logp - batch['old_logp'])\n"
              "loss = (-(ratio * adv) * loss_mask).sum() / loss_mask.sum()\n",
              "a [B, T-1] action mask used as it is", capability="C3", style="framework"),
        Valid("def build_action_mask(owner):\n    return (owner[:, 1:] == POLICY).float()\n",
              "ownership of ids[:, 1:]"),
        Valid("log_probs = F.pad(token_logp, (1, 0))\nmask = F.pad(action_mask, (1, 0))\n"
              "loss = (log_probs * mask).sum()\n", "both padded back to token positions"),
        Valid("output = model(input_ids=input_ids)\nlogits = output.logits[:, -response_length - 1 : -1, :]\n"
              "log_prob = logprobs_from_logits(logits, responses)\n"
              "response_mask = attention_mask[:, -response_length:]\n"
              "ratio = torch.exp(log_prob - old_log_prob)\npg_loss = masked_mean(-advantages * ratio, response_mask)\n",
              "verl style windows", capability="C8", style="framework"),
        Valid("logprobs = logprobs_of_labels(logits[:, :-1, :], tokens[:, 1:])\nstart = query_len - 1\n"
              "end = start + response_length\nlogprobs, mask = logprobs[:, start:end], attention_mask[:, start + 1:end + 1]\n"
              "loss = masked_mean(logprobs * adv, mask)\n", "trlx style windows", capability="C8", style="framework"),
        Valid("state_seq = sequences[:, input_len - 1 : -1]\n"
              "action_mask = state_seq.ne(eos_token_id) & state_seq.ne(pad_token_id)\n",
              "OpenRLHF's state mask: a symbolic window, never flagged", capability="C8", style="framework"),
        Valid("values = critic(ids)[:, :-1]\nvf_mask = attention_mask[:, 1:]\n"
              "vf_loss = ((values - returns) ** 2 * vf_mask).sum()\n",
              "value predictions sliced like logits pair with the next token, like log-probs",
              capability="C8", style="script"),
        Valid("logits = self.model(input_ids).logits\n"
              "labels = torch.roll(input_ids, shifts=-1, dims=1)\nlogp = log_probs_from_logits(logits, labels)\n"
              "mask = torch.roll(attention_mask, shifts=-1, dims=1)\nloss = (logp * mask).sum()\n",
              "log-probs and mask rolled together"),
        Valid("def batch_logps(logits, labels, decoder_only=True):\n"
              "    if decoder_only:\n"
              "        labels = labels[:, 1:].clone()\n"
              "        logits = logits[:, :-1, :]\n"
              "    keep = labels != -100\n"
              "    labels = torch.where(labels == -100, 0, labels)\n"
              "    token_logps = selective_log_softmax(logits, labels)\n"
              "    return (token_logps * keep).sum(-1)\n",
              "labels and logits shifted together, the mask built from the shifted labels (the DPO/ORPO idiom)"),
        Valid("def collate(rows):\n    ids = torch.stack([r['ids'] for r in rows])\n"
              "    batch = {'input_ids': ids, 'labels': torch.roll(ids, shifts=-1, dims=1)}\n"
              "    gen_mask = torch.zeros_like(ids)\n    for i, r in enumerate(rows):\n"
              "        gen_mask[i, r['start']:r['end']] = 1\n"
              "    batch['loss_mask'] = torch.roll(gen_mask, shifts=-1, dims=1)\n    return batch\n",
              why="labels and the loss mask rolled together in the record", capability="C3", style="framework"),
        Valid("class Packer:\n    def pack(self, ids, owner):\n"
              "        out = dict(input_ids=ids[:, :-1], labels=ids[:, 1:])\n"
              "        out.update(action_mask=(owner[:, 1:] == POLICY).float())\n        return out\n",
              why="the action mask cut like the labels, not like the inputs", capability="C3", style="class"),
        Valid("lab = torch.roll(seq, -1, 1)\nmb = {'labels': lab, 'attention_mask': attention_mask}\n"
              "loss = train_step(net, mb)\n",
              why="the unmoved attention mask is the model input's mask, not a loss mask",
              capability="C3", style="script"),
        Valid("@dataclass\nclass Rollout:\n    logp: torch.Tensor\n    keep: torch.Tensor\n\n"
              "def collect(policy, ids, attention_mask):\n"
              "    lp = policy(ids).logits[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)\n"
              "    return Rollout(logp=lp, keep=attention_mask[:, 1:])\n\n"
              "def pg_loss(policy, ids, attention_mask, adv):\n    ro = collect(policy, ids, attention_mask)\n"
              "    return -(ro.logp * adv * ro.keep).sum() / ro.keep.sum()\n",
              why="a record field holds the mask aligned to ids[:, 1:] like the log-probs",
              capability="C3", style="functional"),
        Valid("def encode(batch):\n    rolled = torch.roll(batch['labels'], shifts=-1, dims=-1)\n"
              "    batch.update({'labels': rolled, 'completion_mask': rolled != -100})\n    return batch\n",
              why="the completion mask built from the rolled labels it is stored with",
              capability="C3", style="framework"),
        Valid("from losses import ppo_objective\ndef step(model, ids, attn_mask, adv):\n"
              "    lp_all = model(ids).logits[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)\n"
              "    lp, m = lp_all[:, 3:9], attn_mask[:, 4:10]\n    return ppo_objective(lp, adv, m)\n",
              why="log-prob window and mask window agree (slot t of the log-probs scores ids t+1)",
              capability="C4", style="functional"),
        Valid("class Learner:\n    def update(self, ids, attention_mask, adv):\n"
              "        logits = self.policy(ids).logits[:, :-1]\n"
              "        lp = selective_log_softmax(logits, ids[:, 1:])\n"
              "        loss = self.loss_fn(lp, adv, attention_mask[:, 1:])\n        loss.backward()\n",
              why="the loss callable gets the mask aligned to ids[:, 1:]", capability="C4", style="class"),
        Valid("def run(crit, net, seq, keep, A):\n"
              "    lp = net(seq).logits[:, :-1].log_softmax(-1).gather(-1, seq[:, 1:, None]).squeeze(-1)\n"
              "    return crit(lp * A, keep)\n",
              why="a passed-in callable with a mask of unknown layout: nothing is assumed",
              capability="C4", style="script"),
        Valid("def agg(loss_mat, loss_mask):\n    return (loss_mat * loss_mask).sum() / loss_mask.sum()\n"
              "def compute(model, data):\n    logits = model(data['input_ids']).logits[:, :-1]\n"
              "    logp = logits.log_softmax(-1).gather(-1, data['input_ids'][:, 1:].unsqueeze(-1)).squeeze(-1)\n"
              "    return agg(-logp * data['adv'], data['attention_mask'][:, 1:])\n",
              why="the module helper gets the batch mask cut like the labels", capability="C4", style="framework"),
        Valid("def value_loss(vhead, b, target):\n    R = b['resp'].size(-1)\n"
              "    pred = vhead(b['seq']).logits[:, -R - 1:-1]\n    keep = b['attention_mask'][:, -R:]\n"
              "    return masked_mean((pred.squeeze(-1) - target) ** 2, keep)\n",
              why="a value head sliced like logits over the response, masked with the response window",
              capability="C8", style="functional"),
        Valid("class PPO:\n    def critic_loss(self, ids, attention_mask, returns):\n"
              "        v = self.critic(ids).logits[:, :-1].squeeze(-1)\n        m = attention_mask[:, 1:]\n"
              "        return (((v - returns) ** 2) * m).sum() / m.sum()\n",
              why="critic predictions sliced like logits with the mask of the next tokens",
              capability="C8", style="class"),
        Valid("class Worker:\n    def prepare(self, attention_mask):\n"
              "        self.store = {'keep': attention_mask[:, 1:], 'n': attention_mask.size(0)}\n"
              "    def loss(self, ids, adv):\n"
              "        lp = self.actor(ids).logits[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)\n"
              "        return masked_mean(-lp * adv, self.store.get('keep'))\n",
              why="the mask read back with .get() is aligned to ids[:, 1:]", capability="C3", style="class"),
        Valid("def step(model, input_ids, batch, adv):\n    logits = model(input_ids).logits[:, :-1]\n"
              "    lp = logits.log_softmax(-1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)\n"
              "    m = batch.get('resp_mask', torch.ones_like(lp))\n    return -(lp * adv * m).sum() / m.sum()\n",
              why="a mask read with .get() and a default: unknown when the key may be absent",
              capability="C3", style="framework"),
        Valid("def pg_loss(model, batch, adv):\n    ids, am = batch['input_ids'], batch['attention_mask']\n"
              "    logp = logprobs_from_logits(model(ids).logits, torch.roll(ids, shifts=-1, dims=1))\n"
              "    keep = torch.cat([am[:, 1:], am.new_zeros(am.size(0), 1)], dim=1)\n"
              "    return -(logp * adv * keep).sum() / keep.sum()\n",
              why="the mask shifted left and joined with a zero column, like the rolled labels",
              capability="C7", style="framework"),
        Valid("def sample(text, eod):\n    tokens, labels = text[:-1], text[1:]\n"
              "    loss_mask = torch.ones_like(tokens, dtype=torch.float)\n    loss_mask[tokens == eod] = 0.0\n"
              "    return {'tokens': tokens, 'labels': labels, 'loss_mask': loss_mask}\n",
              why="ones shaped like the inputs, document ends zeroed: only the shape comes from the tokens (EOD masking)",
              capability="C3", style="framework"),
    ]
    # Pinned lines are where the mask is moved (the roll, pad or window to fix) when that is in view.
    INVALID = [
        Invalid("def build_action_mask(owner):\n    action_mask = (owner[:, :-1] == POLICY).float()\n"
                "    return action_mask\n", line=2, why="ownership of ids[:, :-1]"),
        Invalid("logits = model(ids).logits\n"
                "logp = logits[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)\n"
                "mask = attention_mask[:, :-1]\nloss = -(logp * adv * mask).sum() / mask.sum()\n", line=3,
                why="mask[:, :-1] where mask[:, 1:] is meant"),
        Invalid("ratio = torch.exp(logp - old_logp)\nm = F.pad(batch['attention_mask'], (1, 0))[:, :-1]\n"
                "pg_loss = masked_mean(-adv * ratio, m)\n", line=2, why="padded the wrong way"),
        Invalid("loss_mask = torch.roll(mask, 1, -1)\nkl = (log_probs - ref_log_probs) * loss_mask\n", line=1,
                why="rolled the wrong way", preview=True),
        Invalid("logp = full_logp[:, -L:]\nmask = attention_mask[:, -L - 1:-1]\n"
                "loss = -(logp * adv * mask).sum()\n", line=2, why="window one step too early",
                capability="C7", style="script"),
        Invalid("class Trainer:\n    def prepare(self, batch):\n"
                "        self.loss_mask = batch['loss_mask'][:, :-1]\n"
                "    def loss(self, logp, adv):\n        return -(logp * adv * self.loss_mask).sum()\n", line=3,
                why="a [B, T] loss mask cut to [:, :-1], used through a self attribute",
                capability="C3", style="class", preview=True),
        Invalid("log_probs = F.pad(token_logp, (1, 0))\nmask = F.pad(attention_mask, (1, 0))\n"
                "loss = (log_probs * mask).sum()\n", line=2,
                why="log-probs moved to token positions, an ids-aligned mask moved too"),
        Invalid("values = critic(ids)[:, :-1]\nvf_mask = attention_mask[:, :-1]\n"
                "vf_loss = ((values - returns) ** 2 * vf_mask).sum()\n", line=2,
                why="value predictions pair with the next token: their mask is attention_mask[:, 1:]",
                capability="C8", style="script", preview=True),
        Invalid("def aggregate(values, mask):\n    return (values * mask).sum() / mask.sum()\n"
                "def step(logp, old_logp, adv, owner):\n    ratio = (logp - old_logp).exp()\n"
                "    return aggregate(-adv * ratio, (owner[:, :-1] == POLICY).float())\n", line=5,
                why="a helper fed a mask built inline", capability="C4", style="functional"),
        Invalid("def collate(rows):\n    ids = torch.stack([r['ids'] for r in rows])\n"
                "    batch = {'input_ids': ids, 'labels': torch.roll(ids, shifts=-1, dims=1)}\n"
                "    gen_mask = torch.zeros_like(ids)\n    for i, r in enumerate(rows):\n"
                "        gen_mask[i, r['start']:r['end']] = 1\n    batch['loss_mask'] = gen_mask\n"
                "    return batch\n", line=7,
                why="a record stores labels rolled one left and a loss mask filled at token positions",
                capability="C3", style="framework", preview=True),
        Invalid("class Packer:\n    def pack(self, ids, owner):\n"
                "        out = dict(input_ids=ids[:, :-1], labels=ids[:, 1:])\n"
                "        out.update(action_mask=(owner[:, :-1] == POLICY).float())\n        return out\n", line=4,
                why="inputs and labels cut for a causal LM, the action mask cut like the inputs",
                capability="C3", style="class"),
        Invalid("lab = torch.roll(seq, -1, 1)\nmb = {'labels': lab, 'resp_mask': attention_mask}\n"
                "loss = train_step(net, mb)\n", line=2,
                why="rolled labels beside the unmoved attention mask used as the loss mask",
                capability="C3", style="script"),
        Invalid("@dataclass\nclass Rollout:\n    logp: torch.Tensor\n    keep: torch.Tensor\n\n"
                "def collect(policy, ids, attention_mask):\n"
                "    lp = policy(ids).logits[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)\n"
                "    return Rollout(logp=lp, keep=attention_mask[:, :-1])\n\n"
                "def pg_loss(policy, ids, attention_mask, adv):\n    ro = collect(policy, ids, attention_mask)\n"
                "    return -(ro.logp * adv * ro.keep).sum() / ro.keep.sum()\n", line=8,
                why="a record field holds a mask cut like the logits, read back in another function",
                capability="C3", style="functional"),
        Invalid("from losses import ppo_objective\ndef step(model, ids, attn_mask, adv):\n"
                "    lp_all = model(ids).logits[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)\n"
                "    lp, m = lp_all[:, 3:9], attn_mask[:, 3:9]\n    return ppo_objective(lp, adv, m)\n", line=4,
                why="an imported objective fed a log-prob window and a mask window one apart",
                capability="C4", style="functional"),
        Invalid("class Learner:\n    def update(self, ids, attention_mask, adv):\n"
                "        logits = self.policy(ids).logits[:, :-1]\n"
                "        lp = selective_log_softmax(logits, ids[:, 1:])\n"
                "        loss = self.loss_fn(lp, adv, attention_mask[:, :-1])\n        loss.backward()\n", line=5,
                why="a loss callable held on the trainer, the mask cut like the logits",
                capability="C4", style="class"),
        Invalid("def run(crit, net, seq, pad_mask, A):\n"
                "    lp = net(seq).logits[:, :-1].log_softmax(-1).gather(-1, seq[:, 1:, None]).squeeze(-1)\n"
                "    keep = F.pad(pad_mask, (1, 0))[:, 1:-1]\n    return crit(lp * A, keep)\n", line=3,
                why="a callable passed in, fed log-probs and a mask padded the wrong way",
                capability="C4", style="script"),
        Invalid("def agg(loss_mat, loss_mask):\n    return (loss_mat * loss_mask).sum() / loss_mask.sum()\n"
                "def compute(model, data):\n    logits = model(data['input_ids']).logits[:, :-1]\n"
                "    logp = logits.log_softmax(-1).gather(-1, data['input_ids'][:, 1:].unsqueeze(-1)).squeeze(-1)\n"
                "    return agg(-logp * data['adv'], data['attention_mask'][:, :-1])\n", line=6,
                why="a module loss helper fed per-token losses and a batch mask cut like the logits",
                capability="C4", style="framework"),
        Invalid("def value_loss(vhead, b, target):\n    R = b['resp'].size(-1)\n"
                "    pred = vhead(b['seq']).logits[:, -R - 1:-1]\n    keep = b['attention_mask'][:, -R - 1:-1]\n"
                "    return masked_mean((pred.squeeze(-1) - target) ** 2, keep)\n", line=4,
                why="a value head sliced like logits over the response, its mask cut like the logits too",
                capability="C8", style="functional", preview=True),
        Invalid("class PPO:\n    def critic_loss(self, ids, attention_mask, returns):\n"
                "        v = self.critic(ids).logits[:, :-1].squeeze(-1)\n        m = attention_mask[:, :-1]\n"
                "        return (((v - returns) ** 2) * m).sum() / m.sum()\n", line=4,
                why="critic predictions pair with the next token: their mask is attention_mask[:, 1:]",
                capability="C8", style="class", preview=True),
        Invalid("def actor_loss(model, data, old_log_prob, adv):\n    responses = data['responses']\n"
                "    R = responses.size(1)\n    logits = model(input_ids=data['input_ids']).logits[:, -R - 1:-1]\n"
                "    log_prob = logprobs_from_logits(logits, data['input_ids'][:, -R:])\n"
                "    response_mask = data['attention_mask'][:, -R - 1:-1]\n"
                "    ratio = torch.exp(log_prob - old_log_prob)\n"
                "    return masked_mean(-adv * ratio, response_mask)\n", line=6,
                why="response log-probs from logits[:, -R-1:-1] masked with the window one step early",
                capability="C8", style="framework"),
        Invalid("def encode(batch):\n    labels = batch['labels']\n"
                "    batch['labels'] = F.pad(labels[:, 1:], (0, 1), value=-100)\n"
                "    batch['completion_mask'] = (labels != -100).float()\n    return batch\n", line=4,
                why="a completion mask from the unshifted labels stored beside the shifted ones",
                capability="C3", style="framework"),
        Invalid("class Worker:\n    def prepare(self, attention_mask):\n"
                "        self.store = {'keep': attention_mask[:, :-1], 'n': attention_mask.size(0)}\n"
                "    def loss(self, ids, adv):\n"
                "        lp = self.actor(ids).logits[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)\n"
                "        return masked_mean(-lp * adv, self.store.get('keep'))\n", line=3,
                why="a mask stored under a key and read back with .get() in another method",
                capability="C3", style="class"),
        Invalid("def step(model, input_ids, attention_mask, adv):\n"
                "    batch = {'resp_mask': attention_mask[:, :-1], 'input_ids': input_ids}\n"
                "    logits = model(batch['input_ids']).logits[:, :-1]\n"
                "    lp = logits.log_softmax(-1).gather(-1, batch['input_ids'][:, 1:, None]).squeeze(-1)\n"
                "    m = batch.pop('resp_mask')\n    return -(lp * adv * m).sum() / m.sum()\n", line=2,
                why="a mask popped from the batch dict that built it one step left",
                capability="C3", style="framework"),
        Invalid("def pg_loss(model, batch, adv):\n    ids, am = batch['input_ids'], batch['attention_mask']\n"
                "    logp = logprobs_from_logits(model(ids).logits, torch.roll(ids, shifts=-1, dims=1))\n"
                "    keep = torch.cat([am[:, :-1], am.new_zeros(am.size(0), 1)], dim=1)\n"
                "    return -(logp * adv * keep).sum() / keep.sum()\n", line=4,
                why="the mask cut at the end and joined with a zero column: same width, not shifted",
                capability="C7", style="framework"),
    ]

    def check(self, ctx: Analysis) -> Iterator[Violation]:
        seq = alignment(ctx, "seq")
        producers: set[int] = set()
        convention = _storage_convention(ctx)
        for stmt, value in _producers(ctx):
            m = seq.value(value)
            if m is None or not m.moved or m.kind not in (ROOT_IDS, ROOT_TOKEN):
                continue
            if not (m.s.is_const() and m.e.is_const()):
                continue
            if convention is not None:
                if m.s.const == convention:
                    continue
                producers.add(id(stmt))
                yield Violation(stmt, f"this action mask is aligned to ids[:, {_window(m)}] but the log-probs of "
                                      f"this module are stored from ids position {convention} on; move the mask "
                                      "with the log-probs (for log-probs of ids[:, 1:]: attention_mask[:, 1:], "
                                      "owner[:, 1:] == POLICY)", preview=not _aligned_by_convention(ctx, m))
                continue
            if m.kind != ROOT_IDS or (m.e - m.s).const != -1 or m.s.const == 1:
                continue
            producers.add(id(stmt))
            yield Violation(stmt, f"this action mask is [B, T-1] but aligned to ids[:, {_window(m)}], not to "
                                  "ids[:, 1:] like the log-probs; build it from ids[:, 1:] "
                                  "(e.g. owner[:, 1:] == POLICY, attention_mask[:, 1:])",
                            preview=not _aligned_by_convention(ctx, m))
        yield from _record_mismatches(ctx, producers)
        reported: set[int] = set()
        deferred: dict[int, list] = {}
        statements = {id(n): n for n in ctx.nodes(cst.Assign, cst.AnnAssign, cst.AugAssign)}
        for node, values, mask in _sites(ctx):
            verdict = _judge(ctx, values, mask, None, producers)
            if verdict is not None and id(node) not in reported:
                reported.add(id(node))
                # Report where the mask was moved (the roll, pad or window to fix) when that is in view.
                m = seq.value(mask)
                yield Violation(statements.get(m.moved_at, node), verdict,
                                preview=not _aligned_by_convention(ctx, m) or _value_heads_only(ctx, values, None))
            else:
                func = ctx.enclosing_function(node)
                if func is not None:
                    deferred.setdefault(id(func), []).append((func, node, values, mask))
        for entries in deferred.values():
            func = entries[0][0]
            for call in call_sites(ctx, func):
                frame = seq.enter_frame(func, call, None)
                if frame is None:
                    continue
                for _, node, values, mask in entries:
                    verdict = _judge(ctx, values, mask, frame, producers)
                    if verdict is not None and id(call) not in reported:
                        reported.add(id(call))
                        yield Violation(call, f"in `{func.name.value}` called here: {verdict}",
                                        preview=not _aligned_by_convention(ctx, seq.value(mask, frame)) or
                                        _value_heads_only(ctx, values, frame))


def _aligned_by_convention(ctx: Analysis, m: Align | None) -> bool:
    """Whether the mask's root sits at ids positions by convention rather than by a producer's choice: an attention
    or padding mask, an ownership tensor or the ids (compared with a pad id or a role). A loss or action mask read
    from elsewhere sits wherever its producer put it."""
    return m is not None and classify_root(ctx, m.name) == ROOT_IDS


def _value_heads_only(ctx: Analysis, values, frame) -> bool:
    """Whether the per-token values a mask selects are only a value head's predictions: where those sit is the
    catalog's convention (one step on, like log-probs), which some frameworks do not follow (verl's critic reads its
    values at the state positions and masks them there), so a finding on them is a preview one."""
    aligns = token_values(ctx).value(values, frame)
    return bool(aligns) and all(computed == VALUE_HEAD for _, computed in aligns)


def _storage_convention(ctx: Analysis) -> int | None:
    """Where the log-probs computed in this module are stored (ids position of slot 0), when that is one
    known constant: from the values of returns and log-prob assignments that gather from logits here."""
    found: set[int] = set()
    candidates = [r.value for r in ctx.nodes(cst.Return) if r.value is not None]
    for stmt in ctx.nodes(cst.Assign):
        name = dotted_name(stmt.targets[0].target) if len(stmt.targets) == 1 else None
        if name and any(ctx.names.is_role(name.rsplit(".", 1)[-1], r) for r in ("logp", "old_logp", "ref_logp")):
            candidates.append(stmt.value)
    tokens = token_values(ctx)
    for value in candidates:
        if not any(gather_site(ctx, c) for c in _calls_in(value)):
            continue
        for al, computed in tokens.value(value):
            if computed and al.s.is_const():
                found.add(al.s.const)
    return found.pop() if len(found) == 1 else None


def _calls_in(expr: cst.BaseExpression, limit: int = 64) -> list[cst.Call]:
    out: list[cst.Call] = []
    stack = [expr]
    while stack and len(out) < limit:
        node = stack.pop()
        if isinstance(node, cst.Call):
            out.append(node)
        stack.extend(children(node))
    return out


def _window(a: Align) -> str:
    start = "" if a.s.const == 0 else str(a.s.const)
    stop = "" if a.e.const == 0 else str(a.e.const)
    return f"{start}:{stop}"


def _producers(ctx: Analysis):
    """Assignments and returns that build an action mask."""
    for stmt in ctx.nodes(cst.Assign):
        if len(stmt.targets) != 1:
            continue
        name = dotted_name(stmt.targets[0].target)
        if name is None:
            continue
        bare = name.rsplit(".", 1)[-1]
        if PRODUCER_NAME.fullmatch(bare) or _owner_comparison(stmt.value):
            yield stmt, stmt.value
    for ret in ctx.nodes(cst.Return):
        func = ctx.enclosing_function(ret)
        if ret.value is not None and func is not None and "mask" in func.name.value.lower() and not isinstance(
                ret.value, cst.Name):
            yield ret, ret.value


def _owner_comparison(expr: cst.BaseExpression) -> bool:
    while isinstance(expr, cst.Call) and isinstance(expr.func, cst.Attribute):
        expr = expr.func.value
    if isinstance(expr, cst.Comparison):
        for side in (expr.left, *(c.comparator for c in expr.comparisons)):
            while isinstance(side, cst.Subscript):
                side = side.value
            if isinstance(side, (cst.Name, cst.Attribute)) and OWNER_NAME.fullmatch(
                    (dotted_name(side) or "").rsplit(".", 1)[-1]):
                return True
    return False


def _is_mask(ctx: Analysis, expr: cst.BaseExpression) -> bool:
    inner = expr
    while isinstance(inner, cst.UnaryOperation):
        inner = inner.expression
    if _owner_comparison(inner):
        return True
    if any(ctx.names.is_role(n, "mask") for n in names_along(ctx, inner)[:4]):
        return True
    traced = alignment(ctx, "seq").value(inner)
    return traced is not None and ctx.names.is_role(traced.name, "mask")


def _sites(ctx: Analysis):
    """(node, per-token values, mask) where a mask selects per-token values."""
    for op in ctx.nodes(cst.BinaryOperation):
        if not isinstance(op.operator, cst.Multiply):
            continue
        left, right = _is_mask(ctx, op.left), _is_mask(ctx, op.right)
        if left != right:
            yield (op, op.left, op.right) if right else (op, op.right, op.left)
    for call in ctx.nodes(cst.Call):
        func = call.func
        name = S.called_name(call)
        if name is None:
            continue
        if "masked" in name.lower() and name not in ("masked_fill", "masked_select", "masked_scatter") \
                and len(call.args) >= 2:
            values, mask = S.argument(call, 0, None), S.argument(call, 1, "mask")
            if values is not None and mask is not None and _is_mask(ctx, mask):
                yield call, values, mask
        elif name in ("masked_fill", "masked_select") and isinstance(func, cst.Attribute) and call.args:
            mask = call.args[0].value
            if _is_mask(ctx, mask):
                yield call, func.value, mask
        elif ctx.call_name(call) == "torch.where" and len(call.args) >= 2 and _is_mask(ctx, call.args[0].value):
            yield call, call.args[1].value, call.args[0].value
        else:
            yield from _co_arguments(ctx, call)


def _co_arguments(ctx: Analysis, call: cst.Call):
    """C4: a mask and per-token values that meet only as arguments of a loss helper out of view (imported, or
    a callable held in an attribute): ``ppo_objective(lp, adv, keep)``. The call is a site when exactly one
    argument is a mask and others carry per-token values computed in view (gathered from logits here); `_judge`
    then needs a known, non-zero offset between the traced tensors, as for a product. Helpers in view are judged
    through their own bodies instead, and library calls (``torch.*``) and tensor methods are never sites."""
    if len(call.args) < 2:
        return
    if ctx.method(call) is not None and not (isinstance(call.func, cst.Attribute) and isinstance(
            call.func.value, cst.Name) and call.func.value.value == "self"):
        return
    qname = ctx.call_name(call) or ""
    if qname.split(".", 1)[0] in ("torch", "F", "np", "numpy", "math", "einops", "einx") or \
            qname in ("print", "len", "zip", "dict", "list", "tuple", "isinstance", "getattr", "setattr"):
        return
    if ctx.callee(call) is not None:
        return
    if not _log_probs_made_near(ctx, call):
        return  # nothing in the caller computes log-probs: no argument can be log-probs computed in view
    args = [arg.value for arg in call.args if not arg.star]
    masks = [v for v in args if _is_mask(ctx, v)]
    if len(masks) != 1:
        return
    for value in args:
        # the values must be log-probs computed in view: a mask and log-probs that are both read from elsewhere
        # (a record built of two lists cut the same way) say nothing about each other's layout
        if value is not masks[0] and any(computed for _, computed in token_values(ctx).value(value)):
            yield call, value, masks[0]


LOGP_MAKER = re.compile(r"(?i)gather|take_along_dim|get_at|log_prob|cross_entropy|\w*(log_?probs?|logps?|"
                        r"log_softmax|logprobs_from_logits)\w*")


def _log_probs_made_near(ctx: Analysis, call: cst.Call) -> bool:
    """A cheap superset of "an argument is log-probs computed in view": the function around ``call`` (the module
    at top level) calls something that gathers or makes log-probs, itself or through a same-module function."""
    scope = ctx.enclosing_function(call)
    return _makes_log_probs(ctx, scope if scope is not None else ctx.module, depth=1)


def _makes_log_probs(ctx: Analysis, scope: cst.CSTNode, depth: int) -> bool:
    cache = ctx.cache.setdefault("rlg001_logp_scopes", {})
    key = (id(scope), depth)
    hit = cache.get(key)
    if hit is None:
        cache[key] = False  # recursion guard
        calls = ctx.nodes(cst.Call) if scope is ctx.module else ctx.index.descendants(scope, cst.Call)
        hit = any(LOGP_MAKER.fullmatch(S.called_name(c) or "") for c in calls)
        if not hit and depth > 0:
            for c in calls:
                callee = ctx.callee(c)
                if callee is not None and callee is not scope and _makes_log_probs(ctx, callee, depth - 1):
                    hit = True
                    break
        cache[key] = hit
    return hit


def _judge(ctx: Analysis, values, mask, frame: Frame | None, producers: set[int]) -> str | None:
    m = alignment(ctx, "seq").value(mask, frame)
    if m is None or m.kind == ROOT_LOGITS or (m.kind == ROOT_UNKNOWN and not m.moved):
        return None
    if any(v in producers for v in m.via):
        return None  # already reported where the mask is built
    aligns = token_values(ctx).value(values, frame)
    if not aligns:
        return None
    if not m.moved and not any(computed for _, computed in aligns):
        return None
    diffs = set()
    for al, _ in aligns:
        d = m.s - al.s
        if not d.is_const():
            d = m.e - al.e
            if not d.is_const():
                return None
        diffs.add(d.const)
    if 0 in diffs or len(diffs) != 1:
        return None
    k = diffs.pop()
    return (f"the mask is {abs(k)} position{'s' if abs(k) != 1 else ''} {'left' if k < 0 else 'right'} of the "
            "per-token values it selects (log-probs of ids[:, 1:] sit at logits[:, :-1]'s positions); "
            "align the mask to ids[:, 1:] (e.g. attention_mask[:, 1:], owner[:, 1:] == POLICY)")


def _record_mismatches(ctx: Analysis, producers: set[int]) -> Iterator[Violation]:
    """A record (C3) that stores token labels moved off the ids (``torch.roll(ids, -1)``, ``ids[:, 1:]``) and a
    loss mask traced to ids positions: the loss downstream scores ``labels[:, t]`` (the per-token log-probs sit
    where the labels are) and selects with the mask, so the mask must sit where the labels do."""
    seq = alignment(ctx, "seq")
    for entries in records_by_function(ctx).values():
        labels = [e for e in entries if LABEL_ENTRY.fullmatch(e.entry)]
        masks = [e for e in entries if LOSS_MASK_ENTRY.fullmatch(e.entry) and not ATTENTION_NAME.fullmatch(e.entry)]
        if not labels or not masks:
            continue
        starts = set()
        for e in labels:
            al = seq.value(e.value)
            if al is None or al.kind != ROOT_IDS or not al.moved or not al.s.is_const() or \
                    ATTENTION_NAME.fullmatch(al.name) or OWNER_NAME.fullmatch(al.name):
                continue
            starts.add(al.s.const)
        if len(starts) != 1 or 0 in starts:
            continue
        start = starts.pop()
        for e in masks:
            m = seq.value(e.value)
            if m is None or m.kind != ROOT_IDS or not m.s.is_const() or m.s.const == start:
                continue
            if _shape_copy(ctx, e.value, e.node) and not _span_filled(ctx, e):
                continue  # `ones_like(tokens)` with EOD slots zeroed: only its shape comes from the tokens
            if any(v in producers for v in m.via):
                continue
            k = m.s.const - start
            yield Violation(e.node, preview=not _aligned_by_convention(ctx, m), message=f"this loss mask is stored with labels that are ids[:, {start}:]-aligned (the "
                                    f"per-token log-probs scored against them sit there) but the mask is "
                                    f"{abs(k)} position{'s' if abs(k) != 1 else ''} {'left' if k < 0 else 'right'} "
                                    "of them, at ids positions; move it with the labels (e.g. roll or slice it "
                                    "the same way)")


def _shape_copy(ctx: Analysis, expr: cst.BaseExpression, at: cst.CSTNode) -> bool:
    """The mask is a ``*_like`` / ``torch.zeros`` copy of a tensor: its layout comes from that tensor's shape alone."""
    values = [expr]
    if isinstance(expr, cst.Name):
        values = [d.value for d in ctx.flow.reaching(expr.value, at) if d.kind == "assign" and d.value is not None]
    return any(isinstance(v, cst.Call) and ctx.call_name(v) in LIKE_FUNCTIONS for v in values)


def _span_filled(ctx: Analysis, entry) -> bool:
    """A span of the mask is set by position in the function that stores it (``mask[i, start:end] = 1``): the
    positions are ids positions (prompt and response lengths count tokens), not a copy of another mask's."""
    if not isinstance(entry.value, cst.Name) or entry.function is None:
        return False
    for stmt in ctx.index.descendants(entry.function, cst.Assign):
        for target in stmt.targets:
            t = target.target
            if isinstance(t, cst.Subscript) and isinstance(t.value, cst.Name) and t.value.value == entry.value.value \
                    and any(isinstance(el.slice, cst.Slice) and el.slice.lower is not None for el in t.slice):
                return True
    return False
