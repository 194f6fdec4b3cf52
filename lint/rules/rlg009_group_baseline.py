"""RLG009 group-baseline: group advantages not centred per group (whole-batch mean, wrong axis of ``view``,
wrong group size), where the grouping is visible in the code."""

from __future__ import annotations

import re
from typing import Iterator

import libcst as cst

from rlguard.catalog import GROUP_BASELINE
from rlguard.lint.analysis import Analysis, dotted_name
from rlguard.lint.analysis import semantics as S
from rlguard.lint.analysis.grad import call_sites
from rlguard.lint.analysis.groups import (GROUP_NAME, GROUP_STRUCTURE, INTERLEAVED, VIEW_METHODS, batch_axis_source,
                                          double_strided, is_group_size, layout_in_scope, one_group_size,
                                          split_group_size, view_dims)
from rlguard.lint.analysis.index import key_of, children
from rlguard.lint.analysis.labels import branch_label, disables_scaling, population
from rlguard.lint.rule import Invalid, Rule, Valid, Violation

# A reward by what it is computed by: a function named for rewards (`calculate_rewards(...)`, `reward_fn(...)`).
_REWARD_WORD = re.compile(r"(?i)(^|_)rewards?(_|$)")
STAT_METHODS = frozenset({"mean", "std", "var", "nanmean"})


class GroupBaseline(Rule):
    """
    ## What it flags
    Where the grouping is visible, group-relative advantages (GRPO, RLOO) whose baseline is not the group's own:

    - **whole-batch mean**: `advantages = rewards - rewards.mean()` (or `(rewards - rewards.mean()) /
      rewards.std()`, or through `baseline = rewards.mean()`) in a function that has a group size in view (a name
      like `group_size`, `num_generations`, `n_samples`, `G`, `self.num_generations`);
    - **wrong axis**: samples of one prompt are laid out contiguously (`[p0 p0 p0 p0 p1 p1 ...]`, what
      `repeat_interleave(G)` produces; the catalog's layout), so `rewards.view(-1, G)` holds one group per *row*
      and its statistics must be taken over `dim=1`/`-1`. Flagged: `rewards.view(-1, G).mean(dim=0)`,
      `rewards.view(G, -1).mean(dim=-1)`, and `rewards.view(G, -1).mean(dim=0)` when `repeat_interleave` in the
      same function shows the layout is contiguous (with `repeat(G, 1)`, the interleaved layout, it is right);
    - **wrong group size**: a group statistic computed on `view(-1, A)` and spread back with
      `repeat_interleave(B)` where `A` and `B` are visibly different;
    - **tiled batch grouped as contiguous** (C7): the function builds the batch by tiling it (`x.repeat(G, 1)`,
      `torch.tile`, `list(xs) * G`, a container's `repeat(repeat_times=G, interleave=False)`), so samples of a
      prompt are `B` rows apart, yet groups are taken as rows of `view(-1, G)`;
    - **double-strided group windows** (C7): `for i in range(0, n, G): x[i * G:(i + 1) * G]`, an index that
      already steps by the group size scaled by it again;
    - **batch axis of a flat tensor**: `rewards.mean(dim=0)` on the function's own (1-d) parameter when its
      callers in the module work with groups (a group size or group count in view there);
    - **branch labels** (C10): a branch selected by a per-group label (`if norm == "per_group":`, `case
      "per_prompt":`) that centres on the whole batch's mean;
    - a branch of a scaling switch selected by `"none"`/`"off"` (`if cfg.scale_rewards == "none":`) that still
      divides the rewards by their standard deviation (C10);
    - **precedence** (C9): `x - x.mean() / (x.std() + eps)`, which divides the mean, not the centred values.

    Not flagged: `rewards.view(-1, G).mean(dim=1, keepdim=True)`, TRL's `rewards.view(-1,
    self.num_generations).mean(dim=1).repeat_interleave(self.num_generations, dim=0)`, RLOO leave-one-out
    baselines, a PPO whitening `(adv - adv.mean()) / (adv.std() + 1e-8)` with no group in view, statistics
    taken inside a loop over groups, a tensor that holds one group (built over `range(G)`), and a whole-batch
    mean in a branch labelled as the batch statistic (`if norm == "batch":`).

    ## Why it is wrong
    GRPO compares each sample with the other samples *of the same prompt*. With the batch mean as baseline, every
    sample of an easy prompt gets a positive advantage and every sample of a hard one a negative advantage: the
    update learns which prompts are easy, not which answers are better. Training shows a group-mean advantage far
    from 0 (`|mean| > 1e-5` per group), reward that rises only on easy prompts, and a held-out pass rate that
    stalls.

    ## Example
    ```python
    def group_advantages(rewards, group_size):
        return (rewards - rewards.mean()) / (rewards.std() + 1e-4)
    ```

    ## Use instead
    ```python
    def group_advantages(rewards, group_size):
        grouped = rewards.view(-1, group_size)
        centred = grouped - grouped.mean(dim=1, keepdim=True)
        return (centred / (grouped.std(dim=1, keepdim=True) + 1e-4)).view(-1)
    ```

    ## Fix
    No automatic fix: the correct rewrite depends on how samples are laid out in the batch (contiguous or
    interleaved), which the code may not show.

    ## Options
    `[tool.rlguard.names]` `rewards = [...]` adds your own names for reward tensors.
    """

    code = GROUP_BASELINE
    # a group statistic (mean/std/var) and a group size named somewhere (or a repeat_interleave spreading it)
    triggers = (r"(?:mean|std|var)\(",
                r"(?i)group_?size|generations|samples_per|num_samples|n_samples|rollouts?_per|responses_per|"
                r"completions_per|return_sequences|rloo_k|repeat_times|rollout_n|n_rollouts|num_rollouts|"
                r"repeat_interleave|\bg\b|groups?_?(?:num|count|len)|n(?:um)?_groups|mean\([^()]*\)\s*/"
                r"|['\"](?:per_)?(?:group|prompt)['\"]|(?:scal|norm|std)\w*\s*==\s*['\"](?:none|off|no)['\"]"
                # a row count floor-divided (`x.shape[0] // k`): rows cut into runs of k, whatever k is called
                r"|(?:shape\[0\]|size\(0\)|len\([\w.]*\))\s*//")

    VALID = [
        Valid("def train(loader, args):\n"
              "    for batch in loader:\n"
              "        r = calculate_rewards(batch['prompts'], batch['completions'])\n"
              "        g = r.view(-1, args.num_generations)\n"
              "        m = g.mean(dim=1).repeat_interleave(args.num_generations)\n"
              "        s = g.std(dim=1).repeat_interleave(args.num_generations)\n"
              "        adv = (r - m) / (s + 1e-4)\n",
              why="each group's own mean, spread back over its samples", capability="C5", style="script"),
        Valid("def adv(rewards, G):\n    grouped = rewards.view(-1, G)\n"
              "    return (grouped - grouped.mean(dim=1, keepdim=True)).view(-1)\n", "per-group mean", capability="C7", style="functional"),
        Valid("mean_grouped_rewards = rewards.view(-1, self.num_generations).mean(dim=1)\n"
              "mean_grouped_rewards = mean_grouped_rewards.repeat_interleave(self.num_generations, dim=0)\n"
              "advantages = rewards - mean_grouped_rewards\n", "TRL GRPO", capability="C7", style="framework"),
        Valid("def compute_gae(rewards, values, gamma, lam):\n    advantages = rewards - values\n"
              "    advantages = (advantages - advantages.mean()) / (advantages.std() + 1e-8)\n    return advantages\n",
              "PPO whitening, no group in view"),
        Valid("rlhf_reward = rlhf_reward.reshape(args.rloo_k, -1)\n"
              "baseline = (rlhf_reward.sum(0) - rlhf_reward) / (args.rloo_k - 1)\nadvantages = rlhf_reward - baseline\n",
              "RLOO leave-one-out"),
        Valid("def grpo(rewards, group_size):\n    r = rewards.reshape(-1, group_size)\n"
              "    return (r - r.mean(-1, keepdim=True)) / (r.std(-1, keepdim=True) + 1e-6)\n", "dim -1", capability="C7", style="functional"),
        Valid("def adv(scores, num_generations):\n    out = []\n    for group in scores.split(num_generations):\n"
              "        out.append(group - group.mean())\n    return torch.cat(out)\n", "mean inside a loop over groups"),
        Valid("def adv(rewards, G):\n    r = rewards.view(G, -1)\n    return (r - r.mean(dim=0)).flatten()\n",
              "interleaved layout (repeat(G, 1)): view(G, -1) and dim 0", capability="C7",
              style="functional"),
        Valid("def adv(rewards, G):\n    grouped = rewards.view(-1, G)\n    centred = grouped - grouped.mean(dim=1, keepdim=True)\n"
              "    centred = centred / (centred.std() + 1e-8)\n    return centred.view(-1)\n",
              "batch scaling after per-group centring"),
        Valid("def score_one(self, group):\n"
              "    scores = np.array(group.scores, dtype=float)\n"
              "    advantages = (scores - scores.mean()) / (scores.std() + 1e-8)\n"
              "    samples = []\n"
              "    return advantages, samples\n",
              "a function that handles one group: its whole-array statistics are the group's own", capability="FP",
              style="class"),
        Valid("def combine(rewards_per_func, weights, num_generations):\n"
              "    per_group = rewards_per_func.view(-1, num_generations, rewards_per_func.size(-1))\n"
              "    mu = torch.nanmean(per_group, dim=1, keepdim=True)\n"
              "    normed = ((per_group - mu) / (per_group.std(dim=1, keepdim=True) + 1e-4)).flatten(0, 1)\n"
              "    rewards = (normed * weights).sum(dim=1)\n"
              "    return (rewards - rewards.mean()) / (rewards.std() + 1e-4)\n",
              "batch whitening of a sum of per-group-normalised rewards (GDPO): groups stay centred",
              capability="FP", style="functional"),
        Valid("def ppo_adv(rewards, values, k):\n"
              "    for k in range(3):\n"
              "        pass\n"
              "    adv = rewards - rewards.mean()\n"
              "    return adv\n",
              "k is a loop index, not a group size"),
            # ----- C7: batch layouts and group windows -----
        Valid("def centre(scores, n_samples):\n"
              "    prompts = prompt_ids.repeat_interleave(n_samples, dim=0)\n"
              "    out = scores.view(-1, n_samples)\n"
              "    return (out - out.mean(dim=1, keepdim=True)).flatten()\n",
              "contiguous layout (repeat_interleave) grouped with view(-1, G) over dim 1",
              capability="C7", style="functional"),
        Valid("class Normaliser:\n"
              "    def run(self, adv):\n"
              "        for j in range(adv.shape[0] // self.group_size):\n"
              "            w = slice(j * self.group_size, (j + 1) * self.group_size)\n"
              "            adv[w] = adv[w] - adv[w].mean()\n"
              "        return adv\n",
              "a loop over group indices: windows start at j * G", capability="C7", style="class"),
        Valid("G = 4\n"
              "for s in range(0, len(r), G):\n"
              "    blk = r[s:s + G]\n"
              "    r[s:s + G] = blk - blk.mean()\n",
              "a loop stepping by G slices [s:s + G]: no second scaling", capability="C7", style="script"),
        Valid("def compute_adv(batch, cfg):\n"
              "    batch = batch.repeat(repeat_times=cfg.rollout_n, interleave=True)\n"
              "    scores = batch.batch['token_level_scores'].sum(-1)\n"
              "    grouped = scores.view(-1, cfg.rollout_n)\n"
              "    return (grouped - grouped.mean(dim=1, keepdim=True)).view(-1)\n",
              "a batch container repeated with interleave=True keeps each prompt's copies together",
              capability="C7", style="framework"),
        Valid("k = 8\n"
              "qs = ids.repeat(k, 1)\n"
              "r = judge(qs, pol.generate(qs))\n"
              "b = r.view(k, -1).mean(0)\n"
              "adv = r - b.repeat(k)\n",
              "tiled batch grouped with view(G, -1) over dim 0 (the tiled layout's groups)",
              capability="C7", style="script"),
        Valid("class Sampler:\n"
              "    def collect(self, prompt_ids):\n"
              "        ids = prompt_ids.repeat_interleave(self.num_generations, dim=0)\n"
              "        scores = self.reward(self.policy.generate(ids))\n"
              "        return self.advantages(scores)\n"
              "\n"
              "    def advantages(self, scores):\n"
              "        rows = scores.view(-1, self.num_generations)\n"
              "        return (rows - rows.mean(dim=1, keepdim=True)).view(-1)\n",
              "the caller builds a contiguous batch", capability="C7", style="class"),
        # ----- C9: precedence idiom, clean look-alikes -----
        Valid("adv = (rewards - rewards.mean()) / (rewards.std() + 1e-8)\n", "parenthesised standardisation",
              capability="C9", style="script"),
        Valid("def shift(values, ref):\n    return values - ref.mean() / (ref.std() + 1e-6)\n",
              "the subtrahend's statistics are of another tensor: not the standardisation idiom",
              capability="C9", style="functional"),
        # ----- C10: branch labels -----
        Valid("def normalise(rewards, group_size, how):\n"
              "    if how == 'batch':\n"
              "        return (rewards - rewards.mean()) / (rewards.std() + 1e-6)\n"
              "    g = rewards.view(-1, group_size)\n"
              "    return ((g - g.mean(dim=1, keepdim=True)) / (g.std(dim=1, keepdim=True) + 1e-6)).view(-1)\n",
              "the branch labelled 'batch' takes the batch statistic: a deliberate mode", capability="C10",
              style="functional"),
        Valid("class Adv:\n"
              "    def __call__(self, rewards):\n"
              "        if self.cfg.norm == 'global':\n"
              "            baseline = rewards.mean()\n"
              "            return rewards - baseline\n"
              "        grouped = rewards.view(-1, self.num_generations)\n"
              "        return (grouped - grouped.mean(dim=1, keepdim=True)).view(-1)\n",
              "'global' label, whole-batch baseline: label and statistic agree", capability="C10", style="class"),
        Valid("G = 16\n"
              "if mode == 'per_prompt':\n"
              "    rr = r.view(-1, G)\n"
              "    a = (rr - rr.mean(1, keepdim=True)).view(-1)\n",
              "'per_prompt' label with a per-group mean", capability="C10", style="script"),
        Valid("class Adv:\n"
              "    def __call__(self, rewards):\n"
              "        g = rewards.view(-1, self.num_generations)\n"
              "        centred = (g - g.mean(dim=1, keepdim=True)).view(-1)\n"
              "        if self.cfg.adv_norm == 'none':\n"
              "            return centred\n"
              "        std = g.std(dim=1).repeat_interleave(self.num_generations)\n"
              "        return centred / (std + 1e-4)\n",
              "the 'none' branch leaves the advantages unscaled", capability="C10", style="class"),
        Valid("def advantages(batch, cfg, mean):\n"
              "    rewards = batch['rewards']\n"
              "    if cfg.scale_rewards == 'none':\n"
              "        std = torch.ones_like(rewards)\n"
              "    else:\n"
              "        std = rewards.std()\n"
              "    batch['advantages'] = (rewards - mean) / (std + 1e-4)\n"
              "    return batch\n",
              "the 'none' branch sets the divisor to ones; the division is outside the branch", capability="C10",
              style="framework"),
        # ----- FP: a batch that is one group -----
        Valid("def rollout_prompt(policy, prompt, G):\n"
              "    outs = [policy.generate(prompt) for _ in range(G)]\n"
              "    r = torch.tensor([reward_fn(o) for o in outs])\n"
              "    return (r - r.mean()) / (r.std() + 1e-6)\n",
              "the tensor holds the G samples of one prompt: its whole-tensor mean is the group's",
              capability="FP", style="functional"),
        Valid("class OnePrompt:\n"
              "    def advantages(self, prompt):\n"
              "        scores = torch.stack([self.score(prompt, i) for i in range(self.num_generations)])\n"
              "        return scores - scores.mean()\n",
              "a batch of exactly one group (built over range(num_generations))", capability="FP", style="class"),
        # ----- C5: a whole-tensor helper that the caller applies to one group at a time -----
        Valid("def standardise(x):\n"
              "    return (x - x.mean()) / (x.std() + 1e-5)\n"
              "def grpo_advantages(scores, n_gen):\n"
              "    return torch.cat([standardise(chunk) for chunk in scores.split(n_gen)])\n",
              "the caller maps the helper over the groups: the helper's whole mean is one group's",
              capability="C5", style="functional"),
        Valid("class Scorer:\n"
              "    def _centre(self, rewards):\n"
              "        return rewards - rewards.mean()\n"
              "    def advantages(self, rewards):\n"
              "        rows = rewards.view(-1, self.group_size)\n"
              "        out = []\n"
              "        for row in rows:\n"
              "            out.append(self._centre(row))\n"
              "        return torch.stack(out).flatten()\n",
              "the helper runs once per row of the grouped view", capability="C5", style="class"),
        Valid("class Trainer:\n"
              "    def advantages(self, rewards):\n"
              "        n = rewards.shape[0] // self.k\n"
              "        v = rewards.view(n, self.k)\n"
              "        return ((v - v.mean(dim=1, keepdim=True)) / (v.std(dim=1, keepdim=True) + 1e-4)).view(-1)\n",
              why="each run of k rows centred on its own mean", capability="C7", style="class"),
    ]
    INVALID = [
        Invalid("def train(loader, args):\n"
                "    for batch in loader:\n"
                "        r = calculate_rewards(batch['prompts'], batch['completions'])\n"
                "        g = r.view(-1, args.num_generations)\n"
                "        m = g.mean().repeat_interleave(args.num_generations)\n"
                "        s = g.std(dim=1).repeat_interleave(args.num_generations)\n"
                "        adv = (r - m) / (s + 1e-4)\n", line=7,
                why="the mean of a view that holds every group, taken with no dim, is the batch's (inside the "
                    "training loop, whatever the view is called)", capability="C5", style="script"),
        Invalid("def group_advantages(rewards, group_size, eps=1e-4):\n    advantages = rewards - rewards.mean()\n"
                "    advantages = advantages / (rewards.std() + eps)\n    return advantages\n", line=2,
                why="whole-batch mean with a group size in view"),
        Invalid("class GRPO:\n    def advantages(self, rewards):\n        baseline = rewards.mean()\n"
                "        n = self.num_generations\n        return (rewards - baseline) / rewards.std()\n", line=5,
                why="baseline through a name, group size on self"),
        Invalid("def adv(rewards, G):\n    return rewards - torch.mean(rewards)\n", line=2, why="torch.mean"),
        Invalid("def adv(rewards, G):\n    return rewards - rewards.view(-1, G).mean(dim=0).repeat_interleave(G)\n",
                line=2, why="view(-1, G) reduced over dim 0", capability="C7", style="functional"),
        Invalid("def adv(scores, group_size):\n    grouped = scores.view(group_size, -1)\n"
                "    mean = grouped.mean(dim=-1, keepdim=True)\n    return (grouped - mean).view(-1)\n", line=3,
                why="view(G, -1) reduced over the last dim", capability="C7", style="functional"),
        Invalid("def adv(rewards, G):\n    grouped = rewards.reshape(-1, G)\n    std = grouped.std(0)\n"
                "    return grouped / std\n", line=3, why="std over dim 0", capability="C7", style="functional"),
        Invalid("def adv(rewards, num_generations, num_prompts):\n"
                "    mean = rewards.view(-1, num_prompts).mean(dim=1)\n"
                "    mean = mean.repeat_interleave(num_generations, dim=0)\n    return rewards - mean\n", line=3,
                why="grouped by num_prompts, repeated num_generations times", capability="C7",
                style="functional"),
        Invalid("def adv(rewards, G):\n    prompts = prompts.repeat_interleave(G, dim=0)\n"
                "    r = rewards.view(G, -1)\n    return (r - r.mean(dim=0)).flatten()\n", line=4,
                why="contiguous layout but view(G, -1)", capability="C7", style="functional"),
        Invalid("class Grpo:\n"
                "    def adv(self, r):\n"
                "        k = self.samples_per_prompt\n"
                "        base = r.view(-1, k).mean(0)\n"
                "        return r - base.repeat_interleave(k)\n", line=4,
                why="the group size through an alias, reduced over the wrong axis", capability="C7",
                style="class"),
            Invalid("class Trainer:\n"
                "    def baseline(self, rewards):\n"
                "        rewards = rewards.float()\n"
                "        mu = rewards.mean(dim=0, keepdim=True)\n"
                "        return (rewards - mu) / (rewards.std(dim=0, keepdim=True) + 1e-4)\n"
                "\n"
                "    def step(self, prompts):\n"
                "        n = prompts.shape[0] // self.group_num\n"
                "        rewards = self.score(prompts)\n"
                "        return self.baseline(rewards)\n", line=5,
                why="a flat parameter reduced over dim 0 (the batch), its caller holds the grouped batch",
                capability="C5", style="class"),
        Invalid("def advantages(rewards, group_size, scale_rewards):\n"
                "    g = rewards.view(-1, group_size)\n"
                "    mean = g.mean(dim=1).repeat_interleave(group_size)\n"
                "    std = g.std(dim=1).repeat_interleave(group_size)\n"
                "    if scale_rewards == 'none':\n"
                "        return (rewards - mean) / (std + 1e-4)\n"
                "    return rewards - mean\n", line=6,
                why="the 'none' branch and the default one swapped", capability="C10", style="functional"),
        Invalid("def whiten(batch, cfg):\n"
                "    r = batch['rewards']\n"
                "    if cfg.algorithm.adv_norm == 'off':\n"
                "        batch['advantages'] = r / (r.std() + 1e-6)\n"
                "    return batch\n", line=4,
                why="an 'off' normalisation branch that scales by the std", capability="C10", style="framework"),
        # ----- C7: batch layouts and group windows -----
        Invalid("def normalise(adv, group_size):\n"
                "    out = []\n"
                "    for start in range(0, adv.shape[0], group_size):\n"
                "        chunk = adv[start * group_size:(start + 1) * group_size]\n"
                "        out.append((chunk - chunk.mean()) / (chunk.std() + 1e-6))\n"
                "    return torch.cat(out)\n", line=4,
                why="the index already steps by the group size and is scaled by it again",
                capability="C7", style="functional"),
        Invalid("class Trainer:\n"
                "    def norm(self, scores):\n"
                "        n = scores.size(0)\n"
                "        for i in range(0, n, self.group_size):\n"
                "            s = slice(i * self.group_size, (i + 1) * self.group_size)\n"
                "            scores[s] = scores[s] - scores[s].mean()\n"
                "        return scores\n", line=5, why="double-strided group windows through slice()",
                capability="C7", style="class"),
        Invalid("G = 8\n"
                "prompts = batch_prompts.repeat(G, 1)\n"
                "r = score(policy.generate(prompts))\n"
                "base = r.view(-1, G).mean(1)\n"
                "adv = r - base.repeat_interleave(G)\n", line=4,
                why="the batch is tiled (repeat(G, 1)) but grouped as if contiguous", capability="C7",
                style="script"),
        Invalid("def compute_adv(batch, cfg):\n"
                "    batch = batch.repeat(repeat_times=cfg.rollout_n, interleave=False)\n"
                "    scores = batch.batch['token_level_scores'].sum(-1)\n"
                "    grouped = scores.view(-1, cfg.rollout_n)\n"
                "    return (grouped - grouped.mean(dim=1, keepdim=True)).view(-1)\n", line=5,
                why="a batch container repeated without interleaving, grouped by rows", capability="C7",
                style="framework"),
        Invalid("def adv(questions, n_samples):\n"
                "    qs = list(questions) * n_samples\n"
                "    r = torch.tensor(grade(qs))\n"
                "    rows = r.view(-1, n_samples)\n"
                "    return (rows - rows.mean(dim=-1, keepdim=True)).view(-1)\n", line=5,
                why="a list tiled k times, grouped as if each question's answers were adjacent", capability="C7",
                style="functional"),
        Invalid("class Sampler:\n"
                "    def collect(self, prompt_ids):\n"
                "        tiled = prompt_ids.repeat(self.num_generations, 1)\n"
                "        scores = self.reward(self.policy.generate(tiled))\n"
                "        return self.advantages(scores)\n"
                "\n"
                "    def advantages(self, scores):\n"
                "        rows = scores.view(-1, self.num_generations)\n"
                "        return (rows - rows.mean(dim=1, keepdim=True)).view(-1)\n", line=9,
                why="the batch is tiled in the caller, grouped as contiguous in the helper", capability="C7",
                style="class"),
        # ----- C9: the standardisation precedence slip -----
        Invalid("adv = rewards - rewards.mean() / (rewards.std() + 1e-8)\n", line=1,
                why="the mean is divided by the std, not the centred rewards", capability="C9", style="script"),
        Invalid("class Whitener:\n"
                "    def __call__(self, x):\n"
                "        return x - x.mean() / (x.std() + self.eps)\n", line=3, why="precedence inside a method",
                capability="C9", style="class"),
        Invalid("def standardise(batch):\n"
                "    a = batch['advantages']\n"
                "    batch['advantages'] = a - torch.mean(a) / (torch.std(a) + 1e-6)\n"
                "    return batch\n", line=3, why="torch functions, a dict batch", capability="C9",
                style="framework"),
        # ----- C10: branch labels -----
        Invalid("def normalise(rewards, group_size, how):\n"
                "    if how == 'per_group':\n"
                "        return (rewards - rewards.mean()) / (rewards.std() + 1e-6)\n"
                "    return rewards / (rewards.std() + 1e-6)\n", line=3,
                why="labelled per-group, computes the batch mean", capability="C10", style="functional"),
        Invalid("class Adv:\n"
                "    def __call__(self, rewards):\n"
                "        if self.cfg.norm == 'batch':\n"
                "            return rewards / rewards.std()\n"
                "        elif self.cfg.norm == 'group':\n"
                "            baseline = rewards.mean()\n"
                "            return rewards - baseline\n", line=7,
                why="the 'group' branch centres on the batch mean", capability="C10", style="class"),
        Invalid("match scale:\n"
                "    case 'per_prompt':\n"
                "        a = r - r.mean()\n"
                "    case _:\n"
                "        a = r\n", line=3, why="a match case labelled per-prompt, batch statistic", capability="C10",
                style="script"),
        Invalid("class Trainer:\n"
                "    def advantages(self, rewards):\n"
                "        n = rewards.shape[0] // self.k\n"
                "        v = rewards.view(n, self.k)\n"
                "        return ((v - v.mean()) / (v.std(dim=1, keepdim=True) + 1e-4)).view(-1)\n", line=5,
                why="rows cut into runs of k (view(n // k, k), n the rows' count): the view holds every group, "
                    "whatever k is called", capability="C7", style="class"),
    ]

    def check(self, ctx: Analysis) -> Iterator[Violation]:
        groups = _Groups(ctx)

        # 1. whole-batch mean subtracted from rewards
        for op in ctx.nodes(cst.BinaryOperation):
            if not isinstance(op.operator, cst.Subtract):
                continue
            # 0. precedence: x - x.mean() / x.std() divides the mean, not the centred values (C9)
            if _precedence_slip(ctx, op):
                yield Violation(op, "`x - x.mean() / x.std()` subtracts the mean divided by the std (operator "
                                    "precedence): the values are neither centred nor scaled; write (x - x.mean()) / "
                                    "(x.std() + eps)")
                continue
            mean_call = groups.whole_mean(op.right) or groups.batch_axis_mean(op.right)
            if mean_call is None:
                continue
            source = _mean_source(ctx, mean_call)
            if source is None or not groups.reward_like(source) or not groups.reward_like(op.left):
                continue
            # a 2-d view with the group size as one of its dims holds every group, whatever it is called: its mean
            # with no dim is the batch's (a tensor merely named for a group may hold one)
            all_groups = mean_call is not None and groups.whole_mean(op.right) is not None and \
                groups.view_layout(source) is not None
            if not all_groups and (_in_loop(ctx, op) or groups.group_named(source)) or groups.one_group_function(op):
                continue  # inside a loop over groups, or on a tensor named for a group: it may hold one group
            if one_group_size(ctx, source, groups.is_group) is not None:
                continue  # the tensor holds one group (built over range(G)): its mean is the group's
            label = _population_label(ctx, op)
            if label == "batch":
                continue  # a branch labelled as the whole-batch statistic: a deliberate, configurable mode
            if label == "group":
                yield Violation(op, "the branch is labelled as a per-group normalisation but centres on the whole "
                                    "batch's mean: the mode computes the batch statistic; use rewards.view(-1, "
                                    "G).mean(dim=1, keepdim=True)")
                continue
            if not groups.group_in_view(op) or groups.centred_per_group(source):
                continue
            yield Violation(op, "rewards are centred on the whole batch's mean, not each group's own: easy prompts "
                                "get positive advantages for every sample; use rewards.view(-1, G).mean(dim=1, "
                                "keepdim=True) as the baseline")

        # 4. a "none" scaling branch that still divides by a standard deviation (C10)
        for op in ctx.nodes(cst.BinaryOperation):
            if not isinstance(op.operator, cst.Divide):
                continue
            label = branch_label(ctx, op)
            scaled = op.left
            while isinstance(scaled, cst.BinaryOperation) and isinstance(scaled.operator, cst.Subtract):
                scaled = scaled.left  # (rewards - baseline) / std: the rewards are what is scaled
            if label is None or not disables_scaling(label) or not groups.reward_like(scaled):
                continue
            if groups.std_of_rewards(op.right):
                yield Violation(op, f"the branch {label.labels[0]!r} says no scaling, but it divides by a standard "
                                    f"deviation: the mode still scales the advantages")

        # 3. group windows from a loop index that already steps by the group size, scaled by it again (C7)
        for loop in ctx.nodes(cst.For):
            window = double_strided(ctx, loop)
            if window is not None and groups.is_group(window.step):
                step = ctx.code(window.step)
                yield Violation(window.scaled, f"the loop index already steps by {step} (range(..., {step})) and is "
                                               f"multiplied by {step} again: windows start at i * {step} * {step}, "
                                               f"so most groups are skipped; iterate group indices, range(n // "
                                               f"{step}), or slice [i:i + {step}]")

        # 2. group statistics over the wrong axis; wrong group size
        for call in ctx.nodes(cst.Call):
            method = ctx.method(call)
            if method in STAT_METHODS or (ctx.call_name(call) or "").removeprefix("torch.") in STAT_METHODS:
                violation = groups.wrong_axis(call)
                if violation is not None:
                    yield violation
            elif method == "repeat_interleave":
                violation = groups.wrong_group_size(call)
                if violation is not None:
                    yield violation


def _precedence_slip(ctx: Analysis, op: cst.BinaryOperation) -> bool:
    """``x - x.mean() / (x.std() + eps)`` written without parentheses around the centring."""
    right = op.right
    if not (isinstance(right, cst.BinaryOperation) and isinstance(right.operator, cst.Divide)) or right.lpar:
        return False
    mean = right.left
    if not (isinstance(mean, cst.Call) and (ctx.method(mean) in ("mean", "nanmean") or (
            ctx.call_name(mean) or "") in ("torch.mean", "numpy.mean"))):
        return False
    source = _mean_source(ctx, mean)
    if source is None or ctx.code(source).replace(" ", "") != ctx.code(op.left).replace(" ", ""):
        return False
    text = ctx.code(source).replace(" ", "")
    for call in ctx.index.descendants(right.right, cst.Call) if not isinstance(right.right, cst.Call) else [
            right.right, *ctx.index.descendants(right.right, cst.Call)]:
        if (ctx.method(call) in ("std", "var") or (ctx.call_name(call) or "") in ("torch.std", "numpy.std")) and (
                (_mean_source(ctx, call) is not None and ctx.code(_mean_source(ctx, call)).replace(" ", "") == text)):
            return True
    return False


def _population_label(ctx: Analysis, node) -> str | None:
    label = branch_label(ctx, node)
    if label is None:
        return None
    kinds = {population(t) for t in label.labels}
    return next(iter(kinds)) if len(kinds) == 1 else None


def _mean_source(ctx: Analysis, call: cst.Call):
    if ctx.method(call) is None:
        return call.args[0].value if call.args else None
    return S.receiver(call)


def _argument_for(ctx: Analysis, func: cst.FunctionDef, call: cst.Call, param: str):
    """The argument a call passes for ``param`` of ``func`` (a method's ``self`` skipped), or None."""
    params = [p.name.value for p in func.params.params]
    if params and params[0] in ("self", "cls") and isinstance(call.func, cst.Attribute):
        params = params[1:]
    for i, arg in enumerate(a for a in call.args if a.keyword is None and not a.star):
        if i < len(params) and params[i] == param:
            return arg.value
    for arg in call.args:
        if arg.keyword is not None and arg.keyword.value == param:
            return arg.value
    return None


def _in_loop(ctx: Analysis, node) -> bool:
    if ctx.enclosing_loops(node):
        return True
    for anc in ctx.ancestors(node):
        if isinstance(anc, (cst.ListComp, cst.GeneratorExp, cst.DictComp, cst.SetComp)):
            return True
        if isinstance(anc, (cst.FunctionDef, cst.ClassDef)):
            return False
    return False


def _strip(ctx: Analysis, expr):
    while isinstance(expr, cst.Call) and ctx.method(expr) in ("float", "to", "detach", "clone", "contiguous",
                                                              "unsqueeze", "squeeze", "expand_as"):
        expr = S.receiver(expr)
    return expr


class _Groups:
    def __init__(self, ctx: Analysis):
        self.ctx = ctx
        self._in_view: dict[int, bool] = {}

    def resolve(self, expr, depth: int = 4):
        """Follow a name to its single reaching value (a few steps), stripping dtype/shape-neutral methods."""
        ctx = self.ctx
        expr = _strip(ctx, expr)
        for _ in range(depth):
            key = key_of(expr) if isinstance(expr, (cst.Name, cst.Attribute)) else None
            if key is None:
                return expr
            defs = ctx.flow.reaching(key, expr)
            if len(defs) != 1 or defs[0].kind != "assign" or defs[0].value is None or defs[0].element is not None:
                return expr
            expr = _strip(ctx, defs[0].value)
        return expr

    def whole_mean(self, expr) -> cst.Call | None:
        """``x.mean()`` / ``torch.mean(x)`` with no dim (directly or through a name), else None."""
        expr = self.resolve(expr)
        while isinstance(expr, cst.Call) and self.ctx.method(expr) in ("repeat_interleave", "expand", "repeat"):
            expr = self.resolve(S.receiver(expr))  # `x.mean().repeat_interleave(G)`: the one mean, spread
        if not isinstance(expr, cst.Call):
            return None
        if self.ctx.method(expr) in ("mean", "nanmean"):
            return expr if not expr.args else None
        if self.ctx.call_name(expr) in ("torch.mean", "torch.nanmean", "numpy.mean") and len(expr.args) == 1:
            return expr
        return None

    def batch_axis_mean(self, expr) -> cst.Call | None:
        """``x.mean(dim=0)`` on a flat parameter of the function (directly or through a name): a batch mean, when no
        caller in the module passes a reshaped value for it."""
        expr = self.resolve(expr)
        if not (isinstance(expr, cst.Call) and (self.ctx.method(expr) in ("mean", "nanmean") or (
                self.ctx.call_name(expr) or "") in ("torch.mean", "torch.nanmean"))):
            return None
        param = batch_axis_source(self.ctx, expr)
        if param is None:
            return None
        func = self.ctx.enclosing_function(expr)
        for site in call_sites(self.ctx, func):
            arg = _argument_for(self.ctx, func, site, param.value)
            if arg is None:
                continue
            value = self.resolve(arg)
            if isinstance(value, cst.Call) and self.ctx.method(value) in (*VIEW_METHODS, "unflatten", "stack"):
                return None
            if isinstance(value, cst.Call) and (self.ctx.call_name(value) or "") in ("torch.stack",):
                return None
        return expr

    def std_of_rewards(self, expr) -> bool:
        """``r.std()``, ``torch.std(r)``, ``r.var().sqrt()`` (plus an epsilon, through names) of reward-like values."""
        ctx = self.ctx
        expr = self.resolve(expr)
        if isinstance(expr, cst.BinaryOperation) and isinstance(expr.operator, cst.Add):
            left, right = self.resolve(expr.left), self.resolve(expr.right)
            expr = left if S.number_value(right) is not None else right if S.number_value(left) is not None else expr
        expr = self.resolve(expr)
        while isinstance(expr, cst.Call) and ctx.method(expr) in ("sqrt", "clamp", "clamp_min", "clip",
                                                                  "repeat_interleave", "expand_as"):
            inner = S.receiver(expr)
            if ctx.method(expr) == "sqrt" and isinstance(inner, cst.Call) and ctx.method(inner) == "var":
                expr = inner
                break
            expr = self.resolve(inner)
        if not isinstance(expr, cst.Call):
            return False
        if ctx.method(expr) in ("std", "var"):
            src = S.receiver(expr)
        elif (ctx.call_name(expr) or "") in ("torch.std", "numpy.std"):
            src = expr.args[0].value if expr.args else None
        else:
            return False
        if src is None:
            return False
        layout = self.view_layout(src)
        return self.reward_like(layout[1].func.value if layout is not None else src)

    def reward_like(self, expr) -> bool:
        names = self._names(expr)
        vocab = self.ctx.names
        return any(vocab.is_role(n, "rewards") or _REWARD_WORD.search(n) for n in names) and not any(
            vocab.is_role(n, "advantages") for n in names)

    def _names(self, expr, depth: int = 6) -> list[str]:
        out = []
        for _ in range(depth):
            expr = _strip(self.ctx, expr)
            key = key_of(expr)
            if key is None:
                if isinstance(expr, cst.Subscript):
                    expr = expr.value
                    continue
                if isinstance(expr, cst.Call) and S.called_name(expr):
                    out.append(S.called_name(expr))  # `calculate_rewards(...)`: what a function is named for returns
                break
            out.append(key.rsplit("[", 1)[-1].strip("']") if "[" in key else key.rsplit(".", 1)[-1])
            defs = self.ctx.flow.reaching(key, expr)
            if len(defs) != 1 or defs[0].kind != "assign" or defs[0].value is None:
                break
            expr = defs[0].value
            while isinstance(expr, cst.Call) and self.ctx.method(expr) in VIEW_METHODS:
                expr = S.receiver(expr)  # `grouped = rewards.view(-1, G)`: a view of the rewards is rewards
        return out

    def group_named(self, expr) -> bool:
        return any("group" in n.lower() for n in self._names(expr))

    def is_group(self, expr, depth: int = 3) -> bool:
        return is_group_size(self.ctx, expr, depth)

    def group_in_view(self, node) -> bool:
        """A group structure in the function: a group size (by name) used to reshape, repeat or split a tensor,
        or a group-size attribute or parameter read."""
        ctx = self.ctx
        scope = ctx.enclosing_function(node) or ctx.module
        hit = self._in_view.get(id(scope))
        if hit is None:
            hit = False
            calls = ctx.index.descendants(scope, cst.Call) if scope is not ctx.module else ctx.nodes(cst.Call)
            for call in calls:
                if ctx.method(call) in ("view", "reshape", "repeat_interleave", "repeat", "split", "chunk", "unflatten") \
                        and (any(self.is_group(arg.value) for arg in call.args) or
                             split_group_size(ctx, call) is not None):
                    hit = True
                    break
            if not hit and isinstance(scope, cst.FunctionDef):
                params = [p.name.value for p in (*scope.params.params, *scope.params.kwonly_params)]
                hit = any(GROUP_NAME.fullmatch(p) for p in params)
                if not hit:
                    attrs = ctx.index.descendants(scope, cst.Attribute)
                    hit = any(GROUP_NAME.fullmatch(a.attr.value) and dotted_name(a.value) in (
                        "self", "self.args", "args", "self.config", "config", "cfg", "self.cfg") for a in attrs)
            self._in_view[id(scope)] = hit
            if not hit and isinstance(scope, cst.FunctionDef):
                hit = self._callers_group(scope)
                self._in_view[id(scope)] = hit
        return hit

    def _callers_group(self, func: cst.FunctionDef) -> bool:
        """A helper whose every caller in the module has a group structure in view (a group size or group count
        read there): the values it receives are grouped (C5)."""
        ctx = self.ctx
        sites = call_sites(ctx, func)
        if not sites:
            return False
        for site in sites:
            scope = ctx.enclosing_function(site)
            if scope is None or scope is func:
                return False
            if _in_loop(ctx, site):
                return False  # applied piece by piece (`[whiten(g) for g in r.split(G)]`): its whole mean is a piece's
            names = [a.attr.value for a in ctx.index.descendants(scope, cst.Attribute)] + [
                n.value for n in ctx.index.descendants(scope, cst.Name)]
            if not any(GROUP_NAME.fullmatch(n) or GROUP_STRUCTURE.fullmatch(n) for n in names):
                return False
        return True

    def one_group_function(self, node) -> bool:
        """A function that handles one group (``def score_group(group)``): whole-array statistics are the group's."""
        func = self.ctx.enclosing_function(node)
        if func is None:
            return False
        params = [p.name.value for p in (*func.params.params, *func.params.kwonly_params)]
        return any(re.fullmatch(r"(?i)(\w+_)?group", p) for p in params) and not any(
            GROUP_NAME.fullmatch(p) for p in params)

    def centred_per_group(self, expr, depth: int = 12) -> bool:
        """Whether ``expr`` derives from values already centred per group (a ``view(-1, G)`` whose mean over the
        group axis was subtracted): whitening them over the batch keeps each group centred (GDPO)."""
        ctx = self.ctx
        from collections import deque

        stack, seen = deque([expr]), 0
        while stack and seen < 400:
            node = stack.popleft()  # breadth first: the values nearest the whitening come first
            seen += 1
            if isinstance(node, cst.BinaryOperation) and isinstance(node.operator, cst.Subtract):
                right = self.resolve(node.right)
                if isinstance(right, cst.Call) and (ctx.method(right) in STAT_METHODS or (
                        ctx.call_name(right) or "").removeprefix("torch.") in STAT_METHODS):
                    has_dim, dim = _reduction_dim(ctx, right)
                    layout = self.view_layout(_mean_source(ctx, right))
                    if has_dim and dim is not None and layout is not None:
                        axis = dim + layout[3] if dim < 0 else dim
                        if (layout[0] == "PG" and axis == 1) or (layout[0] == "GP" and axis == 0):
                            return True
            key = key_of(node) if isinstance(node, (cst.Name, cst.Attribute)) else None
            if key is not None and key.startswith(("self.", "cls.")):
                continue  # an attribute set elsewhere in the class: not this computation
            if key is not None and depth > 0:
                defs = [d for d in ctx.flow.reaching(key, node) if d.kind == "assign" and d.value is not None]
                if defs or isinstance(node, cst.Name):
                    stack.extend(d.value for d in defs)
                    depth -= 1
                    continue
            if isinstance(node, cst.Attribute):
                stack.append(node.value)  # never the attribute's own name
                continue
            stack.extend(c for c in children(node) if isinstance(c, cst.BaseExpression) or isinstance(c, cst.Arg))
        return False

    def view_layout(self, expr):
        """For a value from ``x.view(a, b)``: ("PG", call, G) when one group per row, ("GP", call, G) when the
        group size comes first; None when not a 2-d view with a visible group size."""
        expr = self.resolve(expr) if expr is not None else None
        if not (isinstance(expr, cst.Call) and self.ctx.method(expr) in VIEW_METHODS):
            return None
        args = view_dims(expr)
        if len(args) < 2:
            return None
        first, second = args[0], args[1]
        if self.is_group(second) and not self.is_group(first) and not any(self.is_group(x) for x in args[2:]):
            return "PG", expr, second, len(args)  # [P, G, ...]: one group per row, its axis is 1
        if not self.is_group(first) and split_group_size(self.ctx, expr) is not None:
            return "PG", expr, second, len(args)  # x.view(n // k, k): runs of k rows, one per row of the view
        if self.is_group(first) and not any(self.is_group(x) for x in args[1:]):
            return "GP", expr, first, len(args)
        return None

    def wrong_axis(self, call: cst.Call) -> Violation | None:
        ctx = self.ctx
        has_dim, dim = _reduction_dim(ctx, call)
        if not has_dim or dim is None:
            return None
        src = _mean_source(ctx, call)
        layout = self.view_layout(src) if src is not None else None
        if layout is None:
            return None
        kind, _, group, ndim = layout
        group_text = ctx.code(group)
        dim = dim + ndim if dim is not None and dim < 0 else dim
        if ndim != 2:
            if kind == "PG" and dim == 0:
                return Violation(call, "the view puts the group's samples on axis 1 (one group per row); take group "
                                       "statistics over dim=1, not dim=0")
            return None
        if kind == "PG" and dim == 0:
            return Violation(call, f"view(-1, {group_text}) puts one group per row (samples of a prompt are "
                                   f"contiguous); take group statistics over dim=1, not dim={dim}")
        if kind == "GP" and dim == 1:
            return Violation(call, f"view({group_text}, -1) with statistics over dim={dim} mixes prompts: with "
                                   f"samples of a prompt contiguous use view(-1, {group_text}).mean(dim=1)")
        if kind == "PG" and dim == 1 and layout_in_scope(ctx, call, group) == INTERLEAVED:
            return Violation(call, f"the batch is tiled here (the whole batch repeated {group_text} times, e.g. "
                                   f"repeat({group_text}, 1)), so samples of a prompt are {group_text} rows apart "
                                   f"and view(-1, {group_text}) rows are not groups; use repeat_interleave("
                                   f"{group_text}, dim=0) to build the batch, or view({group_text}, -1) with dim=0")
        if kind == "GP" and dim == 0 and self._shows_contiguous(call):
            return Violation(call, f"samples of a prompt are contiguous here (repeat_interleave), so "
                                   f"view({group_text}, -1) columns are not groups; use view(-1, "
                                   f"{group_text}).mean(dim=1)")
        return None

    def _shows_contiguous(self, node) -> bool:
        ctx = self.ctx
        scope = ctx.enclosing_function(node) or ctx.module
        calls = ctx.index.descendants(scope, cst.Call) if scope is not ctx.module else ctx.nodes(cst.Call)
        return any(ctx.method(c) == "repeat_interleave" or ctx.call_name(c) == "torch.repeat_interleave"
                   for c in calls)

    def wrong_group_size(self, call: cst.Call) -> Violation | None:
        ctx = self.ctx
        repeats = S.argument(call, 0, "repeats")
        if repeats is None:
            return None
        stat = self.resolve(S.receiver(call))
        if not (isinstance(stat, cst.Call) and ctx.method(stat) in STAT_METHODS):
            return None
        src = _mean_source(ctx, stat)
        layout = self.view_layout(src) if src is not None else None
        if layout is None or layout[0] != "PG":
            layout = self._any_view(src)
            if layout is None:
                return None
        group = layout[2]
        if self._texts(group) & self._texts(repeats):
            return None
        a, b = S.int_value(group), S.int_value(repeats)
        if a is not None and b is not None and a == b:
            return None
        return Violation(call, f"the group statistic is computed over groups of {ctx.code(group)} but repeated "
                               f"{ctx.code(repeats)} times: use the same group size for view(-1, G) and "
                               "repeat_interleave(G)")

    def _any_view(self, expr):
        expr = self.resolve(expr) if expr is not None else None
        if not (isinstance(expr, cst.Call) and self.ctx.method(expr) in VIEW_METHODS):
            return None
        args = [a.value for a in expr.args if a.keyword is None]
        if len(args) == 2 and S.int_value(args[0]) == -1 and S.int_value(args[1]) is None:
            return "PG", expr, args[1], 2
        return None

    def _texts(self, expr) -> set[str]:
        out = {self.ctx.code(expr).replace(" ", "")}
        resolved = self.resolve(expr)
        if resolved is not expr:
            out.add(self.ctx.code(resolved).replace(" ", ""))
        return out


def _reduction_dim(ctx: Analysis, call: cst.Call) -> tuple[bool, int | None]:
    """(has a dim argument, its integer value if literal) for ``x.mean(dim=1)``, ``x.sum(-1)``, ``torch.mean(x, 1)``."""
    for arg in call.args:
        if arg.keyword is not None and arg.keyword.value in ("dim", "axis"):
            return True, S.int_value(arg.value)
    positional = [a for a in call.args if a.keyword is None and not a.star]
    index = 0 if ctx.method(call) is not None else 1
    if len(positional) > index:
        return True, S.int_value(positional[index].value)
    return False, None
