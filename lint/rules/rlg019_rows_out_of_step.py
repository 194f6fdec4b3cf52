"""RLG019 rows-out-of-step: some fields of a batch filtered or permuted, the others not, then used together."""

from __future__ import annotations

from typing import Iterator

from rlguard.catalog import ROWS_OUT_OF_STEP
from rlguard.lint.analysis import Analysis
from rlguard.lint.analysis.rows import out_of_step
from rlguard.lint.rule import Invalid, Rule, Valid, Violation


class RowsOutOfStep(Rule):
    """
    ## What it flags
    Tensors that describe the same episodes meeting (as arguments of one call, operands of one operation, values
    of one dict) with their rows in different orders:

    ```python
    order = lengths.argsort()
    ids, mask = ids[order], mask[order]           # re-indexed
    loss = ppo_loss(ids, mask, old_logp, adv)     # old_logp and adv still in the old order
    ```

    These forms are reported:

    - **reordered**: tensors selected by index values made from the same rows, one of them through a reordering
      the other lacks: `loss_fn(ids[part], old_logp[part], adv[unsorted], mask[part])`, where `part` is a chunk of
      `rows[lengths.argsort()]` and `unsorted` the chunk of `rows` at the same place;
    - **left behind**: some fields re-indexed by a filter or permutation built in view (`argsort`, `sort`,
      `topk`, `nonzero`, `randperm`, a boolean keep mask), the others not, when the others are row fields of the
      same batch: entries of the same container (`batch["old_logp"]` beside `batch["ids"][keep]`), elements of the
      same unpacking, the field the filter or permutation was computed from (`order = (labels != -100).argsort()`
      applied to the hidden states and not to `labels`), or parameters named for per-row fields (old and reference
      log-probs, advantages, rewards, returns, masks, token ids). The fields may have been through the same other
      row operations first or after (flattened alike with `reshape(-1, ...)`, the same contiguous slice of rows
      `x[s : s + n]`): `hidden[order][s:e]` beside `labels[s:e]`;
    - **left behind in a minibatch**: a run of consecutive `name = value` statements that takes the fields of one
      minibatch, two or more by the same index made from a shuffle or filter in view
      (`np.random.permutation`, `randperm`, `argsort`, `nonzero`, sliced), and one other a whole tensor
      (`mb_adv = advantages` beside `mb_logp = logp[mb_inds]`), one never indexed by that index in the function;
    - **unapplied**: a row index built and never read, where the same expression bound to the same name re-indexes
      a field elsewhere in the function (`back = torch.tensor(inverse_of(order))` then `logp = logp[back]`; the
      same `back = ...` rebuilt for the entropies and never applied).

    Index values that are the same value are one selection: an alias (`idx = order`), one dict comprehension
    (`{k: v[idx] for k, v in batch.items()}`), the same argsort written twice. One field bound under two names
    on two paths (`labels = shift_labels.reshape(-1)` or `labels[..., 1:].reshape(-1)`) is one field. A
    permutation followed by its inverse (`x[order][order.argsort()]`) restores the order. A row operation the rule
    does not model (a `view` that splits rows, a `cat`, a scatter into a new tensor) makes the rows unknown, which
    reports nothing.

    ## Why it is wrong
    Each episode is trained with another episode's advantage, old log-probs or reward: the ratio compares
    unrelated tokens, the policy gradient pushes episodes in directions that belong to others, and the update is
    noise with the right statistics. Nothing crashes when the shapes agree; reward just stops improving.

    ## Example
    ```python
    micro = rows[mask[rows].sum(-1).argsort()].chunk(n)
    for part, unsorted in zip(micro, rows.chunk(n)):
        loss = loss_fn(ids[part], old_logp[part], adv[unsorted], mask[part])
    ```

    ## Use instead
    ```python
    for part in rows[mask[rows].sum(-1).argsort()].chunk(n):
        loss = loss_fn(ids[part], old_logp[part], adv[part], mask[part])
    ```

    ## Runtime state
    Which rows a batch object reorders for itself (a `DataProto`, a `TensorDict` indexed as a whole) and orders
    set by code out of view are runtime state; the runtime check that the loss is invariant to a consistent
    permutation of the batch's rows, and that fields keep one row identity through filters, covers them.

    ## Fix
    No automatic fix: which index each field should take (the sorted one, or the inverse permutation applied to
    the outputs) depends on what the code means to do.

    ## Options
    `[tool.rlguard.names]` adds names for per-row fields (`old-logp`, `advantages`, `rewards`, `mask`...).
    Silence a deliberate choice with `# noqa: RLG019`.
    """

    code = ROWS_OUT_OF_STEP
    # preview: no FALSE finding on the 49 ecosystem repositories (none at all in validation and holdout), and
    # renaming changes none of its findings, but in the default set its cost puts the lint-speed goal out of reach
    # (docs/benchmarks.md, Lint speed); see docs/lint.md, "Stable and preview"
    preview = True
    # a filter or permutation is made by one of these calls, or is a tensor indexing another (`x[keep]`, `x[v1]`):
    # structural words only, so renaming a variable never changes whether the rule runs
    # a filter or a permutation built in view (its call, a boolean index, a reversing helper), or a statement that
    # selects rows by an index (`kept = x[keep]`); a bare `x[i]` inside an expression is in nearly every file
    triggers = (r"argsort|\.sort\(|topk\(|nonzero|randperm|permutation|torch\.where\(|inverse|reverse_|"
                r"\[\s*~\s*\w+\s*\]|\[[^\]\n]*(==|!=|>|<)|\n[ \t]*\w+[ \t]*=[ \t]*[\w.]+(\[[^\]\n]*\])*"
                r"\[[ \t]*~?[ \t]*[a-z_]\w*[ \t]*\][ \t]*\n")

    VALID = [
        Valid("def step(ids, mask, old_logp, adv, lengths):\n"
              "    order = lengths.argsort()\n"
              "    ids, mask, old_logp, adv = ids[order], mask[order], old_logp[order], adv[order]\n"
              "    return ppo_loss(ids, mask, old_logp, adv)\n",
              "every field re-indexed with the same index", capability="C1", style="functional"),
        Valid("def minibatch(batch, idx):\n"
              "    sub = {k: v[idx] for k, v in batch.items()}\n"
              "    return loss_fn(sub['ids'], sub['old_logp'], sub['adv'])\n",
              "a dict comprehension re-indexes every entry", capability="C3", style="framework"),
        Valid("def step(ids, old_logp, adv, lengths):\n"
              "    order = lengths.argsort(descending=True)\n"
              "    idx = order\n"
              "    return ppo_loss(ids[order], old_logp[idx], adv[order])\n",
              "two index variables that are the same value", capability="C1", style="functional"),
        Valid("def backward(model, ids, rows, mask, old_logp, adv):\n"
              "    for part in rows[mask[rows].sum(-1).argsort(stable=True)].chunk(4):\n"
              "        loss = loss_fn(model(ids[part]), old_logp[part], adv[part], mask[part])\n"
              "        loss.backward()\n",
              "length-sorted microbatches, every field by the same chunk", capability="C7", style="functional"),
        Valid("def score(model, ids, adv, lengths):\n"
              "    order = lengths.argsort()\n"
              "    logits = model(ids[order])\n"
              "    logits = logits[order.argsort()]\n"
              "    return logits * adv[:, None, None]\n",
              "sorted for the forward, then restored with the inverse permutation", capability="C7",
              style="functional"),
        Valid("def dpo(policy_logps, ref_logps, is_chosen):\n"
              "    chosen, rejected = policy_logps[is_chosen], policy_logps[~is_chosen]\n"
              "    ref_chosen, ref_rejected = ref_logps[is_chosen], ref_logps[~is_chosen]\n"
              "    return dpo_loss(chosen, rejected, ref_chosen, ref_rejected)\n",
              "chosen and rejected rows are different selections on purpose", capability="FP", style="functional"),
        Valid("class Buffer:\n"
              "    def sample(self, batch, n):\n"
              "        idx = torch.randperm(n)\n"
              "        return Minibatch(batch['ids'][idx], batch['adv'][idx], batch['old'][idx])\n",
              "a random minibatch of every field", capability="C3", style="class"),
        Valid("def filter_groups(rewards, prompts, old_logp):\n"
              "    keep = rewards.std(-1) > 0\n"
              "    rewards = rewards[keep]\n"
              "    return summarize(rewards, prompts)\n",
              "a field with no per-row role left unfiltered", capability="C2", style="functional"),
        Valid("order = lens.argsort()\n"
              "out = model.generate(prompts[order])\n"
              "texts = decode(out, lens[order])\n",
              "both sides of the generation sorted", capability="C12", style="script"),
        Valid("def chunked_ce(hidden, targets, head, size):\n"
              "    h = hidden.reshape(-1, hidden.size(-1))\n"
              "    t = targets.reshape(-1)\n"
              "    order = (t != -100).to(torch.int8).argsort(descending=True, stable=True)\n"
              "    h, t = h[order], t[order]\n"
              "    total = 0.0\n"
              "    for s in range(0, t.numel(), size):\n"
              "        total = total + ce(h[s : s + size], head, t[s : s + size])\n"
              "    return total\n",
              "tokens flattened, valid ones packed first in every field, then the same chunk of each",
              capability="C7", style="functional"),
        Valid("def pair_loss(policy_logps, ref_logps, n):\n"
              "    order = policy_logps[:n].argsort()\n"
              "    margin = policy_logps[:n] - policy_logps[n:]\n"
              "    ref_margin = ref_logps[:n] - ref_logps[n:]\n"
              "    return sigmoid_loss(margin - ref_margin), order\n",
              "chosen and rejected halves taken by different row slices on purpose", capability="FP",
              style="functional"),
        Valid("def shifted_ce(hidden, labels, shift_labels, head):\n"
              "    if shift_labels is not None:\n"
              "        t = shift_labels.reshape(-1)\n"
              "    else:\n"
              "        t = labels[..., 1:].reshape(-1)\n"
              "    h = hidden.reshape(-1, hidden.size(-1))\n"
              "    keep = t != -100\n"
              "    return ce(h[keep], head, t[keep])\n",
              "labels from either branch, both fields filtered by the same mask", capability="C2",
              style="functional"),
        Valid("def epoch(model, obs, logp, adv, n, size, clip):\n"
              "    order = np.random.permutation(n)\n"
              "    for start in range(0, n, size):\n"
              "        idx = order[start : start + size]\n"
              "        mb_obs = obs[idx]\n"
              "        mb_logp = logp[idx]\n"
              "        mb_adv = adv[idx]\n"
              "        eps = clip\n"
              "        update(model, mb_obs, mb_logp, mb_adv, eps)\n",
              "every field of the shuffled minibatch by one index; the whole value beside them is a number",
              capability="C3", style="script"),
        Valid("def epoch(model, obs, logp, adv, idx):\n"
              "    mb_obs = obs[idx]\n"
              "    mb_logp = logp[idx]\n"
              "    mb_adv = adv\n"
              "    return update(model, mb_obs, mb_logp, mb_adv)\n",
              "an index handed in: nothing in view says its rows are the rows of adv", capability="FP",
              style="functional"),
        Valid("def gather(outputs, order):\n"
              "    logp = torch.cat([o['logp'] for o in outputs])\n"
              "    back = torch.tensor(inverse_of(order))\n"
              "    logp = logp[back]\n"
              "    ent = torch.cat([o['ent'] for o in outputs])\n"
              "    back = torch.tensor(inverse_of(order))\n"
              "    ent = ent[back]\n"
              "    return logp, ent\n",
              "the restoring index rebuilt for each field and applied to each", capability="C7",
              style="functional"),
        Valid("def restore(outputs, order, fast):\n"
              "    if fast:\n"
              "        back = torch.tensor(inverse_of(order))\n"
              "    else:\n"
              "        back = torch.tensor(inverse_of(order))\n"
              "    return torch.cat(outputs)[back]\n",
              "the same index built on either branch, applied after both", capability="FP", style="functional"),
    ]
    INVALID = [
        Invalid("def minibatch_backward(model, ids, rows, action_mask, old_log_probs, advantages, cfg, parts):\n"
                "    micro = rows[action_mask[rows].sum(-1).argsort(stable=True)].chunk(cfg.microbatches)\n"
                "    for part, unsorted in zip(micro, rows.chunk(cfg.microbatches)):\n"
                "        logits = parts.forward(model, ids[part], cfg)\n"
                "        loss = parts.compute_loss(logits, ids[part], old_log_probs[part], advantages[unsorted],\n"
                "                                  action_mask[part], cfg)\n"
                "        loss.backward()\n", line=5,
                why="advantages by the unsorted chunk, everything else by the sorted one", capability="C7",
                style="functional"),
        Invalid("def step(ids, mask, old_logp, adv, lengths):\n"
                "    order = lengths.argsort(descending=True)\n"
                "    ids = ids[order]\n"
                "    mask = mask[order]\n"
                "    return ppo_loss(ids, mask, old_logp, adv)\n", line=5,
                why="old log-probs and advantages left in the old order", capability="C1", style="functional"),
        Invalid("def filter_batch(batch):\n"
                "    keep = batch['rewards'].std(-1) > 0\n"
                "    rewards = batch['rewards'][keep]\n"
                "    return compute_loss(rewards, batch['old_logp'], batch['ref_logp'])\n", line=4,
                why="rewards filtered, the log-probs of the same batch not", capability="C3", style="framework"),
        Invalid("class Trainer:\n"
                "    def train_step(self, ids, old_logp, advantages, lengths):\n"
                "        _, perm = lengths.sort(descending=True)\n"
                "        logits = self.model(ids[perm]).logits\n"
                "        logp = selective_log_softmax(logits, ids[perm])\n"
                "        ratio = (logp - old_logp).exp()\n"
                "        return -(ratio * advantages[perm]).mean()\n", line=6,
                why="log-probs of sorted ids against old log-probs in the old order (sort indices)",
                capability="C2", style="class"),
        Invalid("def nonzero_rows(batch):\n"
                "    ids, mask, adv = batch\n"
                "    idx = torch.nonzero(adv != 0).squeeze(-1)\n"
                "    return loss_fn(ids[idx], mask[idx], adv)\n", line=4,
                why="elements of one unpacking, nonzero filter", capability="C1", style="script"),
        Invalid("def pack(batch, lengths):\n"
                "    order = torch.argsort(lengths)\n"
                "    sub = {k: v[order] for k, v in batch.items()}\n"
                "    return {'ids': sub['ids'], 'adv': batch['adv']}\n", line=4,
                why="a re-indexed copy mixed with the original batch", capability="C3", style="framework"),
        Invalid("def topk_update(scores, old_logp, logp, k):\n"
                "    _, best = scores.topk(k)\n"
                "    return (logp[best] - old_logp).exp()\n", line=3,
                why="topk rows of the log-probs, all rows of the old ones", capability="C9", style="functional"),
        Invalid("def chunked_ce(hidden, targets, head, size):\n"
                "    h = hidden.reshape(-1, hidden.size(-1))\n"
                "    t = targets.reshape(-1)\n"
                "    order = (t != -100).to(torch.int8).argsort(descending=True, stable=True)\n"
                "    h = h[order]\n"
                "    total = 0.0\n"
                "    for s in range(0, t.numel(), size):\n"
                "        total = total + ce(h[s : s + size], head, t[s : s + size])\n"
                "    return total\n", line=8,
                why="hidden states packed by the order made from the targets, the targets left unpacked; both "
                    "then chunked alike", capability="C7", style="functional"),
        Invalid("def shifted_ce(hidden, labels, shift_labels, head):\n"
                "    if shift_labels is not None:\n"
                "        t = shift_labels.reshape(-1)\n"
                "    else:\n"
                "        t = labels[..., 1:].reshape(-1)\n"
                "    h = hidden.reshape(-1, hidden.size(-1))\n"
                "    order = (t == -100).argsort(stable=True)\n"
                "    return ce(h[order][:512], head, t[:512])\n", line=8,
                why="labels from either branch are the rows the order was made from; only the hidden states "
                    "follow it", capability="C2", style="functional"),
        Invalid("def epoch(model, obs, logp, adv, n, size):\n"
                "    order = np.random.permutation(n)\n"
                "    for start in range(0, n, size):\n"
                "        idx = order[start : start + size]\n"
                "        mb_obs = obs[idx]\n"
                "        mb_logp = logp[idx]\n"
                "        mb_adv = adv\n"
                "        update(model, mb_obs, mb_logp, mb_adv)\n", line=7,
                why="a shuffled minibatch assembled field by field, the advantages taken whole", capability="C3",
                style="script"),
        Invalid("def gather(outputs, order):\n"
                "    logp = torch.cat([o['logp'] for o in outputs])\n"
                "    back = torch.tensor(inverse_of(order))\n"
                "    logp = logp[back]\n"
                "    ent = torch.cat([o['ent'] for o in outputs])\n"
                "    back = torch.tensor(inverse_of(order))\n"
                "    return logp, ent\n", line=6,
                why="the restoring index rebuilt for the entropies and never applied: the log-probs restored, "
                    "the entropies not", capability="C7", style="functional"),
    ]

    def check(self, ctx: Analysis) -> Iterator[Violation]:
        reported: set[int] = set()
        for found in out_of_step(ctx):
            odd = found.odd[0]
            if id(odd) in reported:
                continue
            reported.update(id(e) for e in found.odd)
            odd_text = ", ".join(f"`{ctx.code(e)}`" for e in found.odd)
            others = ", ".join(f"`{ctx.code(e)}`" for e in found.others[:3])
            if found.kind == "unapplied":
                message = (f"{odd_text} is built like the index of {others} but never applied: the rows it was "
                           f"built for keep the old order while the others were re-indexed, so each episode "
                           f"meets another episode's values; apply it to the field it was built for")
            elif found.kind == "reordered":
                message = (f"{odd_text} takes its rows by an index that is not reordered like the one of {others}, "
                           f"though both are made from the same rows: each episode meets another episode's "
                           f"values; index every field with the same index")
            else:
                message = (f"{odd_text} keeps the old row order while {others} were filtered or permuted: the "
                           f"fields of one batch are out of step, so each episode meets another episode's "
                           f"values; index every field with the same index")
            yield Violation(odd, message)
