"""RLG009 group-baseline: group advantages not centred per group (whole-batch mean, wrong axis of ``view``,
wrong group size), where the grouping is visible in the code."""

from __future__ import annotations

import re
from typing import Iterator

import libcst as cst

from rlguard.lint.context import ModuleContext, argument, dotted_name, method_name, receiver, value_name
from rlguard.lint.rule import Invalid, Rule, Valid, Violation
from rlguard.lint.rules._signs import int_value, reaching, reduction_dim

GROUP_NAME = re.compile(
    r"(?i)(num_|n_|k_)?(group_?size|groups?_?len|generations(_per_prompt)?|samples(_per_(prompt|group|query))?|"
    r"rollouts?(_per_prompt)?|responses_per_prompt|completions_per_prompt|return_sequences|rloo_k|repeat_times)"
    r"|rollout_n|G|K")
STAT_METHODS = frozenset({"mean", "std", "var", "nanmean"})
VIEW_METHODS = frozenset({"view", "reshape"})


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
      `repeat_interleave(B)` where `A` and `B` are visibly different.

    Not flagged: `rewards.view(-1, G).mean(dim=1, keepdim=True)`, TRL's `rewards.view(-1,
    self.num_generations).mean(dim=1).repeat_interleave(self.num_generations, dim=0)`, RLOO leave-one-out
    baselines, a PPO whitening `(adv - adv.mean()) / (adv.std() + 1e-8)` with no group in view, and statistics
    taken inside a loop over groups.

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

    code = "RLG009"
    triggers = r"reward|scores\b|advantage|adv(?:s\b|_|\b)|num_generations|group_size"

    VALID = [
        Valid("def adv(rewards, G):\n    grouped = rewards.view(-1, G)\n"
              "    return (grouped - grouped.mean(dim=1, keepdim=True)).view(-1)\n", "per-group mean"),
        Valid("mean_grouped_rewards = rewards.view(-1, self.num_generations).mean(dim=1)\n"
              "mean_grouped_rewards = mean_grouped_rewards.repeat_interleave(self.num_generations, dim=0)\n"
              "advantages = rewards - mean_grouped_rewards\n", "TRL GRPO"),
        Valid("def compute_gae(rewards, values, gamma, lam):\n    advantages = rewards - values\n"
              "    advantages = (advantages - advantages.mean()) / (advantages.std() + 1e-8)\n    return advantages\n",
              "PPO whitening, no group in view"),
        Valid("rlhf_reward = rlhf_reward.reshape(args.rloo_k, -1)\n"
              "baseline = (rlhf_reward.sum(0) - rlhf_reward) / (args.rloo_k - 1)\nadvantages = rlhf_reward - baseline\n",
              "RLOO leave-one-out"),
        Valid("def grpo(rewards, group_size):\n    r = rewards.reshape(-1, group_size)\n"
              "    return (r - r.mean(-1, keepdim=True)) / (r.std(-1, keepdim=True) + 1e-6)\n", "dim -1"),
        Valid("def adv(scores, num_generations):\n    out = []\n    for group in scores.split(num_generations):\n"
              "        out.append(group - group.mean())\n    return torch.cat(out)\n", "mean inside a loop over groups"),
        Valid("def adv(rewards, G):\n    r = rewards.view(G, -1)\n    return (r - r.mean(dim=0)).flatten()\n",
              "interleaved layout (repeat(G, 1)): view(G, -1) and dim 0"),
        Valid("def adv(rewards, G):\n    grouped = rewards.view(-1, G)\n    centred = grouped - grouped.mean(dim=1, keepdim=True)\n"
              "    centred = centred / (centred.std() + 1e-8)\n    return centred.view(-1)\n",
              "batch scaling after per-group centring"),
    ]
    INVALID = [
        Invalid("def group_advantages(rewards, group_size, eps=1e-4):\n    advantages = rewards - rewards.mean()\n"
                "    advantages = advantages / (rewards.std() + eps)\n    return advantages\n", line=2,
                why="whole-batch mean with a group size in view"),
        Invalid("class GRPO:\n    def advantages(self, rewards):\n        baseline = rewards.mean()\n"
                "        n = self.num_generations\n        return (rewards - baseline) / rewards.std()\n", line=5,
                why="baseline through a name, group size on self"),
        Invalid("def adv(rewards, G):\n    return rewards - torch.mean(rewards)\n", line=2, why="torch.mean"),
        Invalid("def adv(rewards, G):\n    return rewards - rewards.view(-1, G).mean(dim=0).repeat_interleave(G)\n",
                line=2, why="view(-1, G) reduced over dim 0"),
        Invalid("def adv(scores, group_size):\n    grouped = scores.view(group_size, -1)\n"
                "    mean = grouped.mean(dim=-1, keepdim=True)\n    return (grouped - mean).view(-1)\n", line=3,
                why="view(G, -1) reduced over the last dim"),
        Invalid("def adv(rewards, G):\n    grouped = rewards.reshape(-1, G)\n    std = grouped.std(0)\n"
                "    return grouped / std\n", line=3, why="std over dim 0"),
        Invalid("def adv(rewards, num_generations, num_prompts):\n"
                "    mean = rewards.view(-1, num_prompts).mean(dim=1)\n"
                "    mean = mean.repeat_interleave(num_generations, dim=0)\n    return rewards - mean\n", line=3,
                why="grouped by num_prompts, repeated num_generations times"),
        Invalid("def adv(rewards, G):\n    prompts = prompts.repeat_interleave(G, dim=0)\n"
                "    r = rewards.view(G, -1)\n    return (r - r.mean(dim=0)).flatten()\n", line=4,
                why="contiguous layout but view(G, -1)"),
    ]

    def check(self, ctx: ModuleContext) -> Iterator[Violation]:
        group_cache: dict[int, bool] = {}

        def group_in_view(node) -> bool:
            scope = ctx.enclosing_function(node) or ctx.module
            hit = group_cache.get(id(scope))
            if hit is None:
                hit = any(GROUP_NAME.fullmatch(n.value) for n in ctx.descendants(scope, cst.Name)) if (
                    scope is not ctx.module) else any(GROUP_NAME.fullmatch(n.value) for n in ctx.nodes(cst.Name))
                group_cache[id(scope)] = hit
            return hit

        # 1. whole-batch mean subtracted from rewards
        for op in ctx.nodes(cst.BinaryOperation):
            if not isinstance(op.operator, cst.Subtract):
                continue
            mean_call = _whole_mean(ctx, op.right)
            if mean_call is None:
                continue
            source = _mean_source(ctx, mean_call)
            if source is None or not _reward_like(ctx, source) or not _reward_like(ctx, op.left):
                continue
            if _in_loop(ctx, op) or _group_named(ctx, source) or not group_in_view(op):
                continue
            yield Violation(op, "rewards are centred on the whole batch's mean, not each group's own: easy prompts "
                                "get positive advantages for every sample; use rewards.view(-1, G).mean(dim=1, "
                                "keepdim=True) as the baseline")

        # 2. group statistics over the wrong axis
        for call in ctx.nodes(cst.Call):
            method = method_name(call)
            if method in STAT_METHODS or (ctx.call_name(call) or "").removeprefix("torch.") in STAT_METHODS:
                violation = _wrong_axis(ctx, call)
                if violation is not None:
                    yield violation
            elif method == "repeat_interleave":
                violation = _wrong_group_size(ctx, call)
                if violation is not None:
                    yield violation


def _strip(expr):
    while isinstance(expr, cst.Call) and method_name(expr) in ("float", "to", "detach", "clone", "contiguous",
                                                                  "unsqueeze", "squeeze", "expand_as"):
        expr = receiver(expr)
    return expr


def _resolve(ctx: ModuleContext, expr, depth: int = 4):
    """Follow a name to its single reaching value (a few steps), stripping dtype/shape-neutral methods."""
    expr = _strip(expr)
    for _ in range(depth):
        key = dotted_name(expr) if isinstance(expr, (cst.Name, cst.Attribute)) else None
        if key is None or not (isinstance(expr, cst.Name) or key.startswith("self.")):
            return expr
        assigns = reaching(ctx, key, expr)
        if len(assigns) != 1 or assigns[0].value is None or assigns[0].unpacked is not None:
            return expr
        expr = _strip(assigns[0].value)
    return expr


def _whole_mean(ctx: ModuleContext, expr) -> cst.Call | None:
    """``x.mean()`` / ``torch.mean(x)`` with no dim (directly or through a name), else None."""
    expr = _resolve(ctx, expr)
    if not isinstance(expr, cst.Call):
        return None
    if method_name(expr) in ("mean", "nanmean") and not (ctx.call_name(expr) or "").startswith("torch."):
        return expr if not expr.args else None
    if ctx.call_name(expr) in ("torch.mean", "torch.nanmean") and len(expr.args) == 1:
        return expr
    return None


def _mean_source(ctx: ModuleContext, call: cst.Call):
    if (ctx.call_name(call) or "").startswith("torch."):
        return call.args[0].value if call.args else None
    return receiver(call)


def _reward_like(ctx: ModuleContext, expr) -> bool:
    return ctx.has_role(expr, "rewards") and not ctx.has_role(expr, "advantages")


def _group_named(ctx: ModuleContext, expr) -> bool:
    return any("group" in n.lower() for n in ctx.role_names(expr))


def _in_loop(ctx: ModuleContext, node) -> bool:
    if ctx.enclosing_loops(node):
        return True
    for anc in ctx.ancestors(node):
        if isinstance(anc, (cst.ListComp, cst.GeneratorExp, cst.DictComp, cst.SetComp)):
            return True
        if isinstance(anc, (cst.FunctionDef, cst.ClassDef)):
            return False
    return False


def _is_group(expr) -> bool:
    name = value_name(expr) if isinstance(expr, (cst.Name, cst.Attribute)) else None
    return name is not None and GROUP_NAME.fullmatch(name.rsplit(".", 1)[-1]) is not None


def _view_layout(ctx: ModuleContext, expr):
    """For a value from ``x.view(a, b)``: ("PG", call, G) when one group per row, ("GP", call, G) when the group
    size comes first; None when not a 2-d view with a visible group size."""
    expr = _resolve(ctx, expr)
    if not (isinstance(expr, cst.Call) and method_name(expr) in VIEW_METHODS):
        return None
    args = [a.value for a in expr.args if a.keyword is None]
    if len(args) == 1 and isinstance(args[0], (cst.Tuple, cst.List)):
        args = [e.value for e in args[0].elements]
    if len(args) != 2:
        return None
    first, second = args
    if _is_group(second) and not _is_group(first):
        return "PG", expr, second
    if _is_group(first) and not _is_group(second):
        return "GP", expr, first
    return None


def _wrong_axis(ctx: ModuleContext, call: cst.Call) -> Violation | None:
    has_dim, dim = reduction_dim(call)
    if not has_dim or dim is None:
        return None
    src = _mean_source(ctx, call)
    layout = _view_layout(ctx, src) if src is not None else None
    if layout is None:
        return None
    kind, _, group = layout
    group_text = ctx.module.code_for_node(group)
    if kind == "PG" and dim in (0, -2):
        return Violation(call, f"view(-1, {group_text}) puts one group per row (samples of a prompt are "
                               f"contiguous); take group statistics over dim=1, not dim={dim}")
    if kind == "GP" and dim in (1, -1):
        return Violation(call, f"view({group_text}, -1) with statistics over dim={dim} mixes prompts: with samples "
                               f"of a prompt contiguous use view(-1, {group_text}).mean(dim=1)")
    if kind == "GP" and dim in (0, -2) and _shows_contiguous(ctx, call):
        return Violation(call, f"samples of a prompt are contiguous here (repeat_interleave), so view({group_text}, "
                               f"-1) columns are not groups; use view(-1, {group_text}).mean(dim=1)")
    return None


def _shows_contiguous(ctx: ModuleContext, node) -> bool:
    scope = ctx.enclosing_function(node) or ctx.module
    return any(method_name(c) == "repeat_interleave" or ctx.call_name(c) == "torch.repeat_interleave"
               for c in (ctx.descendants(scope, cst.Call) if scope is not ctx.module else ctx.nodes(cst.Call)))


def _wrong_group_size(ctx: ModuleContext, call: cst.Call) -> Violation | None:
    repeats = argument(call, 0, "repeats")
    if repeats is None:
        return None
    stat = _resolve(ctx, receiver(call))
    if not (isinstance(stat, cst.Call) and method_name(stat) in STAT_METHODS):
        return None
    src = _mean_source(ctx, stat)
    layout = _view_layout(ctx, src) if src is not None else None
    if layout is None or layout[0] != "PG":
        # view(-1, n_prompts): the grouped dim is not a group-size name; still compare with the repeat count
        layout = _any_view(ctx, src)
        if layout is None:
            return None
    group = layout[2]
    texts_a = _texts(ctx, group)
    texts_b = _texts(ctx, repeats)
    if texts_a & texts_b:
        return None
    if int_value(group) is not None and int_value(repeats) is not None and int_value(group) == int_value(repeats):
        return None
    return Violation(call, f"the group statistic is computed over groups of {ctx.module.code_for_node(group)} but "
                           f"repeated {ctx.module.code_for_node(repeats)} times: use the same group size for "
                           "view(-1, G) and repeat_interleave(G)")


def _any_view(ctx: ModuleContext, expr):
    expr = _resolve(ctx, expr) if expr is not None else None
    if not (isinstance(expr, cst.Call) and method_name(expr) in VIEW_METHODS):
        return None
    args = [a.value for a in expr.args if a.keyword is None]
    if len(args) == 2 and int_value(args[0]) == -1 and int_value(args[1]) is None:
        return "PG", expr, args[1]
    return None


def _texts(ctx: ModuleContext, expr) -> set[str]:
    out = {ctx.module.code_for_node(expr).replace(" ", "")}
    resolved = _resolve(ctx, expr)
    if resolved is not expr:
        out.add(ctx.module.code_for_node(resolved).replace(" ", ""))
    return out
