"""The preflight checks: each runs on copies of the model and one real batch and returns a ``CheckResult``.

Every check measures one invariant of a correct RL trainer for language models and names the catalog code of
the fault that breaks it (``docs/preflight.md`` explains each one).
"""

from __future__ import annotations

import copy
import math
import tempfile
from dataclasses import asdict, dataclass, replace
from functools import cached_property
from pathlib import Path

import torch
import torch.nn.functional as F
from rlguard.catalog import (
    ACCUMULATION_SCALE, ADVANTAGE_SIGN, ENTROPY_BONUS_SIGN, GRAD_NOT_ZEROED, GROUP_BASELINE, KL_SIGN,
    DETACHED_TARGETS, LOGITS_LABEL_SHIFT, MASK_NOT_SHIFTED, OLD_LOGP_RECOMPUTED, PADDING_LEAK, REFERENCE_ALIAS, RELOAD_MISMATCH,
    ROWS_OUT_OF_STEP, SAMPLER_TRAINER_MISMATCH, STOP_TOKEN_UNTRAINED, TRAIN_MODE_SCORING, TRAINED_PARAMS_DRIFT,
)
from rlguard.contracts.invariance import (
    active_dropout, compute_dtypes, describe_dropout, gaps, group_permutation, order_tolerance, row_tolerance,
    take_rows,
)

# Step size (in parameter space, gradient normalised) of the single-term direction checks.
DIRECTION_STEP = 1e-3


@dataclass
class CheckResult:
    name: str
    code: str | None
    value: float
    tolerance: str
    passed: bool
    hint: str
    skipped: bool = False
    per_rank: list | None = None  # under torch.distributed: each rank's value (``value`` is the worst of them)
    seed: int | None = None  # the seed of the batch the check ran on, when not the suite's first batch
    error: bool = False  # the check itself raised: an rlguard error (no code, no finding), the cause in ``hint``
    # the check measured its fault's signature, but the adapter says the trainer's documented setting does this by
    # design (``documented_deviations``): passed, with the setting named in ``hint``
    warning: bool = False

    def to_dict(self) -> dict:
        d = asdict(self)
        if not self.error:
            del d["error"]
        if not self.warning:
            del d["warning"]
        if self.seed is None:
            del d["seed"]
        d["value"] = None if isinstance(self.value, float) and math.isnan(self.value) else self.value
        if self.per_rank is None:
            del d["per_rank"]
        else:
            d["per_rank"] = [None if isinstance(v, float) and math.isnan(v) else v for v in self.per_rank]
        return d


# A check whose precondition the first batch does not meet (no completion ends in a stop token, every group has
# equal rewards, no padded row) draws the batches of the next seeds, up to this many in all, and reports the seed
# it used.
MAX_BATCHES = 8


class Context:
    """What the checks share: the adapter, the pristine model, one batch, and one real update on a copy."""

    def __init__(self, adapter, seed: int = 0, model=None, declared_trainable=None):
        self.adapter = adapter
        self.seed = seed
        self.model = adapter.build_model() if model is None else model
        # what the model declared trainable when it was built, before any trainer code ran on it (a faulty
        # trainer may switch requires_grad on itself): the default intended set of frozen_params
        self.declared_trainable = ({n for n, p in self.model.named_parameters() if p.requires_grad}
                                   if declared_trainable is None else declared_trainable)
        self._others: dict[int, Context] = {}
        self.batch = adapter.make_batch(self.model, seed)
        self.ids = adapter.token_ids(self.batch)
        self.owned = adapter.policy_tokens(self.batch)[:, 1:].bool()  # [B, T-1] tokens the policy wrote
        self.rows = torch.arange(self.ids.shape[0])

    def copy(self, model):
        """An independent copy of ``model``: the adapter's ``copy_model`` when it has one, else a deep copy."""
        copy_model = getattr(self.adapter, "copy_model", None)
        return copy_model(model) if copy_model is not None else copy.deepcopy(model)

    def fresh(self):
        """A copy of the pristine model (never the model itself)."""
        return self.copy(self.model)

    @cached_property
    def trainer_logp(self) -> torch.Tensor:
        with torch.no_grad():
            return self.adapter.log_probs(self.model, self.batch).detach()

    @cached_property
    def true_advantages(self) -> torch.Tensor:
        """Rewards centred per group by the suite itself (the direction an update must take)."""
        r = self.adapter.rewards(self.batch).float().view(-1, self.adapter.group_size)
        return (r - r.mean(-1, keepdim=True)).view(-1)

    @cached_property
    def stepped(self) -> dict:
        """One real update on a copy: the model before/after, its reference and the update's stats."""
        model = self.fresh()
        with torch.enable_grad():  # first use may come from inside a check's no_grad block
            ref_model = self.adapter.make_reference(model)
            optimizer = self.adapter.make_optimizer(model)
            before = {k: v.detach().clone() for k, v in _state(model).items()}
            stats = self.adapter.update(model, optimizer, ref_model, self.batch)
        return {"model": model, "ref": ref_model, "stats": stats or {}, "before": before}

    def masked_mean(self, values: torch.Tensor) -> float:
        return float(values[self.owned].mean()) if self.owned.any() else 0.0

    def first_batch_where(self, met) -> "Context | None":
        """This context, or the first of the next seeds' (up to ``MAX_BATCHES`` batches in all, the same pristine
        model) whose batch meets ``met(ctx)``; None when none does."""
        for seed in range(self.seed, self.seed + MAX_BATCHES):
            if seed == self.seed:
                other = self
            else:
                other = self._others.get(seed)
                if other is None:
                    other = self._others[seed] = Context(self.adapter, seed, self.model, self.declared_trainable)
            if met(other):
                return other
        return None


def _on(ctx: Context, other: Context, result: CheckResult, why: str) -> CheckResult:
    """``result`` of a check that ran on another batch than the first: the seed recorded and said."""
    if other is not ctx:
        result.seed = other.seed
        result.hint = (f"(on the batch of seed {other.seed}, the first of {other.seed - ctx.seed + 1} with {why}) "
                       + result.hint).strip()
    return result


def padded_row(ctx: Context) -> bool:
    """Whether some row of the batch has padding after its completion's end: its policy-written tokens end before
    another row's (a completion shorter than the longest, so that columns past its EOS are pads)."""
    owned = ctx.owned
    if not owned.numel():
        return False
    cols = torch.arange(1, owned.shape[1] + 1, device=owned.device)
    end = (owned.long() * cols).max(-1).values  # 1 + the column of each row's last policy token (0: none)
    return bool(end.min() < end.max())


PADDED = "a padded row (a completion shorter than the longest)"


def _on_padded_batch(name: str, check, ctx: Context) -> CheckResult:
    """``check`` (mask_policy, padding_invariant, padding_leak: what happens past a completion's end) on the first
    batch with a padded row (``padded_row``), drawn like ``first_batch_where``. When none of ``MAX_BATCHES`` has
    one, the check runs on the first batch: a failure there is still a finding, a pass is no verdict on the padding
    (skipped as "not exercised", with the seeds tried and the first batch's measurement)."""
    other = ctx.first_batch_where(padded_row)
    if other is not None:
        return _on(ctx, other, check(other), PADDED)
    result = check(ctx)
    if not result.passed or result.skipped:
        return result
    return _skip(name, f"not exercised: no batch of {MAX_BATCHES} (seeds {ctx.seed}-{ctx.seed + MAX_BATCHES - 1}) has "
                       f"{PADDED}: every completion is as long as the longest, so no padding after a completion's "
                       f"end could be checked (the first batch passes it: measured {result.value:.3g}, tolerance "
                       f"{result.tolerance})")


def _state(model) -> dict:
    return dict(list(model.named_parameters()) + list(model.named_buffers()))


def _loss_and_grad(adapter, model, batch, rows) -> tuple[float, torch.Tensor | None]:
    """``adapter.loss`` over ``rows`` -> (its value, its gradient over the trainable parameters, flat; None when
    the loss has no gradient). ``.grad`` is left as it was."""
    params = [p for p in model.parameters() if p.requires_grad]
    with torch.enable_grad(), torch.random.fork_rng(devices=[]):
        loss = adapter.loss(model, batch, rows)
        if not params or not getattr(loss, "requires_grad", False):
            return float(loss), None
        grads = torch.autograd.grad(loss, params, allow_unused=True)
    flat = torch.cat([(g if g is not None else torch.zeros_like(p)).flatten().float() for g, p in zip(grads, params)])
    return float(loss.detach()), flat


def _grads(model) -> torch.Tensor:
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten().float()
                      for p in model.parameters()])


def _entropy(logits: torch.Tensor) -> torch.Tensor:
    log_p = logits.float().log_softmax(-1)
    return -(log_p.exp() * log_p).sum(-1)


def _kl(logits: torch.Tensor, ref_logits: torch.Tensor) -> torch.Tensor:
    """Exact KL(pi || ref) of each next-token distribution -> [B, T-1]."""
    log_p, log_q = logits.float().log_softmax(-1), ref_logits.float().log_softmax(-1)
    return (log_p.exp() * (log_p - log_q)).sum(-1)


def _direction_step(model, loss, length: float | None = None) -> bool:
    """One plain gradient step of fixed length (``DIRECTION_STEP`` by default) on ``loss`` alone; False when the
    term has no gradient."""
    length = DIRECTION_STEP if length is None else length
    params = [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    norm = torch.sqrt(sum((g.float() ** 2).sum() for g in grads if g is not None) + 0.0)
    if not torch.isfinite(norm) or norm == 0:
        return False
    with torch.no_grad():
        for p, g in zip(params, grads):
            if g is not None:
                p.sub_(length * g / norm)
    return True


def _result(name, value, tolerance, passed, hint="", skipped=False) -> CheckResult:
    code, what = CHECKS[name][1], CHECKS[name][2]
    return CheckResult(name, code, float(value), tolerance, bool(passed), hint if hint else ("" if passed else what),
                       skipped)


def _skip(name, why) -> CheckResult:
    return _result(name, float("nan"), "-", True, f"skipped: {why}", skipped=True)


# ---------------------------------------------------------------------------------------------- the checks


def stop_ids(adapter) -> tuple[int, ...]:
    """The adapter's optional ``stop_token_ids`` (an attribute or a method): the ids that end a completion."""
    ids = getattr(adapter, "stop_token_ids", None)
    if callable(ids):
        ids = ids()
    if ids is None:
        return ()
    return tuple(int(i) for i in ([ids] if isinstance(ids, int) else ids))


def _first_stops(ctx: Context, stops: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: whether the policy wrote a stop token in ids[:, 1:], and the column of its first one."""
    tokens = ctx.ids[:, 1:]
    is_stop = torch.isin(tokens, torch.tensor(stops, device=tokens.device)) & ctx.owned
    return is_stop.any(-1), is_stop.int().argmax(-1)


def check_mask_policy(ctx: Context) -> CheckResult:
    return _on_padded_batch("mask_policy", _mask_policy, ctx)


def _mask_policy(ctx: Context) -> CheckResult:
    mask = ctx.adapter.action_mask(ctx.batch) > 0
    wrong = mask != ctx.owned
    stops = stop_ids(ctx.adapter)
    hint = ""
    if stops:  # a first stop token left out of the mask is stop_token_trained's (RLG017), not a shift
        has, first = _first_stops(ctx, stops)
        dropped = torch.zeros_like(wrong)
        dropped[ctx.rows[has], first[has]] = True
        dropped &= ~mask
        if bool((wrong & dropped).any()):
            wrong &= ~dropped
            hint = "" if wrong.any() else "the only difference: stop tokens out of the mask (see stop_token_trained)"
    n = int(wrong.sum())
    return _result("mask_policy", n, "== 0", n == 0, hint)


def check_stop_token_trained(ctx: Context) -> CheckResult:
    stops = stop_ids(ctx.adapter)
    if not stops:
        return _skip("stop_token_trained", "the adapter declares no stop_token_ids")
    first_ctx = ctx
    ctx = first_ctx.first_batch_where(lambda c: bool(_first_stops(c, stops)[0].any()))
    if ctx is None:
        return _skip("stop_token_trained", f"not exercised: no completion of {MAX_BATCHES} batches (seeds "
                                           f"{first_ctx.seed}-{first_ctx.seed + MAX_BATCHES - 1}) has a stop token "
                                           f"{list(stops)} written by the policy")
    return _on(first_ctx, ctx, _stop_token_result(ctx, stops), "a completion that ends in a stop token")


def _stop_token_result(ctx: Context, stops: tuple[int, ...]) -> CheckResult:
    has, first = _first_stops(ctx, stops)
    mask = ctx.adapter.action_mask(ctx.batch) > 0
    trained = mask[ctx.rows, first]
    missing = has & ~trained
    n = int(missing.sum())
    hint = ""
    if n:
        r = int(torch.nonzero(missing)[0])
        hint = (f"{n} of {int(has.sum())} completions have their first stop token out of the loss mask (first: "
                f"row {r}, column {int(first[r])} of ids[:, 1:], token {int(ctx.ids[r, 1 + int(first[r])])}): a "
                "mask built as ids != pad_id with pad = eos, or cut at another stop id")
    return _result("stop_token_trained", n, "== 0", n == 0, hint)


def check_labels_shifted(ctx: Context) -> CheckResult:
    with torch.no_grad():
        logits = ctx.adapter.logits(ctx.model, ctx.batch).float()
        gathered = logits.log_softmax(-1).gather(-1, ctx.ids[:, 1:, None]).squeeze(-1)
    err = float((ctx.trainer_logp - gathered).abs()[ctx.owned].max()) if ctx.owned.any() else 0.0
    result = _result("labels_shifted", err, "< 1e-5", err < 1e-5)
    if not result.passed:
        scale = _temperature_scale(ctx.trainer_logp, logits, ctx.ids[:, 1:], ctx.owned)
        if scale is not None:  # the right tokens at another temperature: not a shift
            result = replace(result, code=SAMPLER_TRAINER_MISMATCH, hint=(
                f"the trainer's log-probs are the model's logits x {scale:.3g} (a temperature {1 / scale:.3g} times "
                "the one the logits are given at), at the right labels: the loss scores at another temperature "
                "than the one the model's logits are divided by (see RLG007), not a label shift"))
    return result


def _temperature_scale(logp: torch.Tensor, logits: torch.Tensor, labels: torch.Tensor, owned: torch.Tensor,
                       tol: float = 1e-4) -> float | None:
    """The factor ``c`` != 1 with ``log_softmax(c * logits)[labels] == logp`` on the owned tokens (within ``tol``),
    or None: a global rescaling of the logits, which a temperature is and a label shift is not. Golden-section
    search over log c in [-3, 3] (the error is unimodal in c near its minimum for any one token set)."""
    if not owned.any():
        return None

    def err(log_c: float) -> float:
        with torch.no_grad():
            g = (logits * math.exp(log_c)).log_softmax(-1).gather(-1, labels[..., None]).squeeze(-1)
        return float((logp - g).abs()[owned].max())

    lo, hi = -3.0, 3.0
    ratio = (math.sqrt(5) - 1) / 2
    a, b = hi - ratio * (hi - lo), lo + ratio * (hi - lo)
    fa, fb = err(a), err(b)
    for _ in range(60):
        if fa < fb:
            hi, b, fb = b, a, fa
            a = hi - ratio * (hi - lo)
            fa = err(a)
        else:
            lo, a, fa = a, b, fb
            b = lo + ratio * (hi - lo)
            fb = err(b)
    log_c = (lo + hi) / 2
    if err(log_c) > tol or abs(log_c) < 1e-3:
        return None
    return math.exp(log_c)


def check_sampler_logp(ctx: Context) -> CheckResult:
    sampler = ctx.adapter.sampler_log_probs(ctx.batch)
    gap = float((ctx.trainer_logp - sampler).abs()[ctx.owned].max()) if ctx.owned.any() else 0.0
    return _result("sampler_logp", gap, "< 1e-4", gap < 1e-4)


def check_ratio_one(ctx: Context) -> CheckResult:
    with torch.no_grad():
        old = ctx.adapter.old_log_probs(ctx.model, ctx.batch)
    ratio = torch.exp(ctx.trainer_logp - old)
    err = float((ratio - 1).abs()[ctx.owned].max()) if ctx.owned.any() else 0.0
    return _result("ratio_one", err, "< 1e-4", err < 1e-4)


def check_targets_detached(ctx: Context) -> CheckResult:
    """The loss's targets as the trainer computes them, called with autograd on as the trainer's own code runs."""
    a = ctx.adapter
    model = ctx.fresh()
    with torch.enable_grad(), torch.random.fork_rng(devices=[]):
        targets = {"old_log_probs(model, batch)": a.old_log_probs(model, ctx.batch),
                   "sampler_log_probs(batch)": a.sampler_log_probs(ctx.batch),
                   "advantages(batch)": a.advantages(ctx.batch)}
        if hasattr(a, "ref_log_probs"):
            ref = a.make_reference(model)
            if ref is not None:
                targets["ref_log_probs(reference, batch)"] = a.ref_log_probs(ref, ctx.batch)
        if hasattr(a, "returns"):
            targets["returns(batch)"] = a.returns(ctx.batch)
    attached = [name for name, v in targets.items()
                if isinstance(v, torch.Tensor) and (v.requires_grad or v.grad_fn is not None)]
    hint = ""
    if attached:
        grad_fn = type(targets[attached[0]].grad_fn).__name__ if targets[attached[0]].grad_fn is not None else "none"
        hint = (f"{', '.join(attached)} carr{'ies' if len(attached) == 1 else 'y'} an autograd graph (grad_fn "
                f"{grad_fn}): computed with autograd on; compute them under torch.no_grad() or .detach() them")
    return _result("targets_detached", len(attached), "== 0", not attached, hint)


def check_group_mean(ctx: Context) -> CheckResult:
    adv = ctx.adapter.advantages(ctx.batch).float().view(-1, ctx.adapter.group_size)
    worst = float(adv.mean(-1).abs().max())
    return _result("group_mean", worst, "< 1e-5", worst < 1e-5)


def check_padding_invariant(ctx: Context) -> CheckResult:
    return _on_padded_batch("padding_invariant", _padding_invariant, ctx)


def _padding_invariant(ctx: Context) -> CheckResult:
    padded = pad_batch(ctx.adapter, ctx.batch, 8)
    with torch.no_grad():
        a = float(ctx.adapter.loss(ctx.model, ctx.batch, ctx.rows))
        b = float(ctx.adapter.loss(ctx.model, padded, ctx.rows))
    err = abs(a - b)
    return _result("padding_invariant", err, "< 1e-5", err < 1e-5)


def select_rows(adapter, batch, rows: torch.Tensor):
    """The batch restricted to (and ordered by) ``rows``: the adapter's ``select_rows`` if it has one; for a
    dict batch, every tensor, list or tuple whose first dim is B indexed by ``rows``."""
    if hasattr(adapter, "select_rows"):
        return adapter.select_rows(batch, rows)
    if not isinstance(batch, dict):
        raise TypeError("batch is not a dict: give the adapter a select_rows(batch, rows)")
    return take_rows(batch, rows, adapter.token_ids(batch).shape[0])


def _no_grad_scoring(fn, *args, seed: int | None = None):
    """``fn(*args)`` under no_grad with the global RNG as it was (a check must not move the trainer's RNG);
    ``seed``: the RNG seeded so inside, so that two passes draw different random numbers (dropout)."""
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        if seed is not None:
            torch.manual_seed(seed)
        return fn(*args).detach()


def _can_select(adapter, batch) -> bool:
    return hasattr(adapter, "select_rows") or isinstance(batch, dict)


def check_padding_leak(ctx: Context) -> CheckResult:
    return _on_padded_batch("padding_leak", _padding_leak, ctx)


def _padding_leak(ctx: Context) -> CheckResult:
    a, model, batch = ctx.adapter, ctx.model, ctx.batch
    if not _can_select(a, batch):
        return _skip("padding_leak", "the batch is not a dict and the adapter has no select_rows(batch, rows)")
    base = ctx.trainer_logp
    again = _no_grad_scoring(a.log_probs, model, batch)
    mean_tol, max_tol = row_tolerance(*compute_dtypes(base, model))
    noise = gaps(base, again, ctx.owned)
    if noise[1] > 0:
        found = active_dropout(model)
        return _skip("padding_leak", "two scorings of the same batch differ (max gap "
                     f"{noise[1]:.3g}): the log-probs are not deterministic"
                     + (f" (dropout on: {describe_dropout(found)}; see scoring_eval_mode, RLG018)" if found else ""))
    n = len(ctx.rows)
    worst = (0.0, 0.0, -1, "")
    cases = [("the batch's rows in reverse order", ctx.rows.flip(0)), ("its last row alone", ctx.rows[-1:])]
    for what, rows in cases:
        other = _no_grad_scoring(a.log_probs, model, select_rows(a, batch, rows))
        w = other.shape[1]  # an adapter may pad the selected rows less (left-padded prompts): align at the end
        g = gaps(other, base[rows][:, base.shape[1] - w:], ctx.owned[rows][:, base.shape[1] - w:])
        if g[0] > worst[0] or g[1] > worst[1]:
            worst = (g[0], g[1], int(rows[g[2]]) if g[2] >= 0 else -1, what)
    padded = _no_grad_scoring(a.log_probs, model, pad_batch(a, batch, 8))
    g = gaps(padded[:, :base.shape[1]], base, ctx.owned)
    if g[0] > worst[0] or g[1] > worst[1]:
        worst = (g[0], g[1], g[2], "8 more columns of right padding")
    if hasattr(a, "pad_prompts"):  # where the trainer pads its prompts (on the left): the completions move right
        padded = _no_grad_scoring(a.log_probs, model, a.pad_prompts(batch, 8))
        g = gaps(padded[:, padded.shape[1] - base.shape[1]:], base, ctx.owned)
        if g[0] > worst[0] or g[1] > worst[1]:
            worst = (g[0], g[1], g[2], "8 more columns of prompt padding")
    mean, top, row, what = worst
    leak = mean > mean_tol or top > max_tol
    hint = ""
    if leak:
        hint = (f"row {row}'s log-probs change with {what}: mean gap {mean:.3g}, max {top:.3g} over its policy "
                f"tokens (allowed {mean_tol:g} / {max_tol:g}): a forward without the attention mask or position ids "
                "its padding needs, or packed rows that attend to each other")
    return _result("padding_leak", top, f"mean < {mean_tol:g}, max < {max_tol:g}", not leak, hint)


def _order_pairs(ctx: Context, k: int = 3) -> list[torch.Tensor]:
    """Up to ``k`` pairs of rows with different lengths and different advantages: swapping two such rows
    changes the loss whenever some field is paired with the wrong one."""
    lengths = ctx.owned.sum(-1)
    adv = ctx.true_advantages
    pairs, used = [], set()
    for i in range(len(ctx.rows)):
        for j in range(i + 1, len(ctx.rows)):
            if i in used or j in used or lengths[i] == lengths[j] or abs(float(adv[i] - adv[j])) < 1e-3:
                continue
            pairs.append(torch.tensor([i, j]))
            used |= {i, j}
            break
        if len(pairs) == k:
            break
    return pairs


def _exponent(limit: float) -> str:
    """A tolerance as the fixed ones of the report are written: ``1e-4``, ``2e-2``."""
    mantissa, _, power = f"{limit:.0e}".partition("e")
    return f"{mantissa}e{int(power)}"


def check_rows_in_step(ctx: Context) -> CheckResult:
    a = ctx.adapter
    dtypes = compute_dtypes(ctx.trainer_logp, ctx.model)
    mean_tol, max_tol = row_tolerance(*dtypes)
    limit = order_tolerance(*dtypes)  # relative: float32 1e-4, half precision 2e-2 (reordered sums' rounding)
    reordered = _no_grad_scoring(a.log_probs, ctx.model, select_rows(a, ctx.batch, ctx.rows.flip(0))) \
        if _can_select(a, ctx.batch) else None
    if reordered is not None and reordered.shape == ctx.trainer_logp.shape:
        g = gaps(reordered.flip(0), ctx.trainer_logp, ctx.owned)
        if g[0] > mean_tol or g[1] > max_tol:
            return _skip("rows_in_step", "the rows' log-probs depend on their batch neighbours (see padding_leak): "
                         "a reordering of the rows cannot be judged")
    gen = torch.Generator().manual_seed(ctx.seed + 7)
    perm = group_permutation(len(ctx.rows), a.group_size, gen)
    model = ctx.fresh()
    # the loss's gradient where it has one, else its value: at ratio 1 a sequence-level surrogate's value is
    # -mean(advantages) however rows are paired (and near 0 when advantages are centred, so that a relative
    # difference of values measures rounding), while its gradient pairs each row's log-probs with an advantage
    base = _loss_and_grad(a, model, ctx.batch, ctx.rows)
    measured = [(_loss_and_grad(a, model, ctx.batch, ctx.rows[perm]), "the loss of the same rows in another order")]
    if reordered is not None:
        measured.append((_loss_and_grad(a, model, select_rows(a, ctx.batch, perm), ctx.rows),
                         "the loss of the batch with its rows permuted (groups kept together)"))
    scale = max(abs(base[0]), 1e-12)
    worst, what = 0.0, ""
    for (value, grad), desc in measured:
        if grad is not None and base[1] is not None:
            err = float((grad - base[1]).norm() / base[1].norm().clamp(min=1e-12))
            desc = desc.replace("the loss", "the gradient of the loss")
        else:
            err = abs(value - base[0]) / scale
        if err > worst:
            worst, what = err, desc
    # the trainer's own backward over two rows, in both orders: a field taken in another order than the rest
    # (microbatches sorted for the forward, advantages not) pairs each row with the other's values (not for an
    # adapter whose backward takes the whole batch only, in the trainer's own order)
    for pair in ([] if getattr(a, "whole_batch_backward", False) else _order_pairs(ctx)):
        grads = []
        for order in (pair, pair.flip(0)):
            model.zero_grad(set_to_none=True)
            with torch.random.fork_rng(devices=[]):
                a.backward(model, ctx.batch, order)
            grads.append(_grads(model))
        err = float((grads[1] - grads[0]).norm() / grads[0].norm().clamp(min=1e-12))
        if err > worst:
            worst, what = err, f"the gradient of backward() over rows {pair.tolist()} in the other order"
    ok = worst < limit
    hint = "" if ok else (f"{what} differs by {worst:.3g} (relative, allowed {_exponent(limit)}): some fields of "
                          "the batch are paired with other rows than the rest (a sort, filter or permutation applied "
                          "to some fields only)")
    return _result("rows_in_step", worst, f"< {_exponent(limit)}", ok, hint)


def check_scoring_eval_mode(ctx: Context) -> CheckResult:
    a = ctx.adapter
    model = ctx.fresh()
    with torch.enable_grad():
        ref = a.make_reference(model)
    worst, who = 0.0, ""
    if hasattr(a, "scoring_passes"):  # the trainer's own scoring code, as it runs in training
        passes = [_scoring_passes(a, model, ctx.batch, ctx.seed + 11), _scoring_passes(a, model, ctx.batch,
                                                                                        ctx.seed + 12)]
        for what in passes[0]:
            first, second = passes[0][what], passes[1].get(what)
            g = gaps(first, second, None)[1] if second is not None and second.shape == first.shape else 0.0
            if g > worst:
                worst, who = g, what
    scorings = [("old_log_probs(model)", a.old_log_probs, model)]
    if ref is not None:
        scorings.append(("log_probs(reference)", a.log_probs, ref))
    for what, fn, m in scorings:
        first = _no_grad_scoring(fn, m, ctx.batch, seed=ctx.seed + 11)
        second = _no_grad_scoring(fn, m, ctx.batch, seed=ctx.seed + 12)
        g = gaps(first, second, ctx.owned)[1]
        if g > worst:
            worst, who = g, what
    ok = worst == 0
    hint = ""
    if not ok:
        m = ref if "ref" in who else model
        found = active_dropout(m) if m is not None and not isinstance(m, type(None)) else []
        hint = (f"two scoring passes of {who} differ by up to {worst:.3g}: "
                + (f"dropout on in {describe_dropout(found)}; put the scoring model in eval mode (model.eval())"
                   if found else "a scoring forward is not deterministic (dropout in train mode, or sampling)"))
    return _result("scoring_eval_mode", worst, "== 0", ok, hint)


def _scoring_passes(adapter, model, batch, seed: int) -> dict:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return {k: v.detach() for k, v in adapter.scoring_passes(model, batch).items()}


def check_accumulation(ctx: Context) -> CheckResult:
    model = ctx.fresh()
    model.zero_grad(set_to_none=True)
    ctx.adapter.loss(model, ctx.batch, ctx.rows).backward()
    one_pass = _grads(model)
    model.zero_grad(set_to_none=True)
    ctx.adapter.backward(model, ctx.batch, ctx.rows)
    accumulated = _grads(model)
    err = float((accumulated - one_pass).norm() / one_pass.norm().clamp(min=1e-12))
    return _result("accumulation", err, "< 1e-4", err < 1e-4)


def check_old_logp_frozen(ctx: Context) -> CheckResult:
    stats = ctx.stepped["stats"]
    if "ratio_max" not in stats or "ratio_min" not in stats:
        return _result("old_logp_frozen", float("nan"), "> 1e-6", False,
                       "update() must report ratio_max and ratio_min over its minibatches")
    moved = max(stats["ratio_max"] - 1, 1 - stats["ratio_min"])
    return _result("old_logp_frozen", moved, "> 1e-6", moved > 1e-6)


def check_advantage_direction(ctx: Context) -> CheckResult:
    first_ctx = ctx
    ctx = first_ctx.first_batch_where(lambda c: bool(c.true_advantages.abs().max() > 0))
    if ctx is None:
        return _skip("advantage_direction", f"not exercised: every group has equal rewards in {MAX_BATCHES} "
                                            f"batches (seeds {first_ctx.seed}-{first_ctx.seed + MAX_BATCHES - 1})")
    with torch.no_grad():
        new = ctx.adapter.log_probs(ctx.stepped["model"], ctx.batch)
    moved = ((new - ctx.trainer_logp) * ctx.owned).sum(-1)  # change of log pi(episode) [B]
    corr = float(torch.corrcoef(torch.stack([moved.float(), ctx.true_advantages]))[0, 1])
    return _on(first_ctx, ctx, _result("advantage_direction", corr, "> 0", corr > 0),
               "a group whose rewards differ")


def check_kl_positive(ctx: Context) -> CheckResult:
    ref = ctx.stepped["ref"]
    if ref is None:
        return _skip("kl_positive", "make_reference returned None (no KL term)")
    with torch.no_grad():
        kl = ctx.masked_mean(_kl(ctx.adapter.logits(ctx.stepped["model"], ctx.batch),
                                 ctx.adapter.logits(ref, ctx.batch)))
    return _result("kl_positive", kl, "> 1e-9", kl > 1e-9)


def check_entropy_direction(ctx: Context) -> CheckResult:
    model = ctx.fresh()
    term = ctx.adapter.loss(model, ctx.batch, ctx.rows, None, term="entropy")
    if term is None or not getattr(term, "requires_grad", False):
        return _skip("entropy_direction", "the loss has no entropy term")
    with torch.no_grad():
        before = ctx.masked_mean(_entropy(ctx.adapter.logits(model, ctx.batch)))
    if not _direction_step(model, term):
        return _skip("entropy_direction", "the entropy term has no gradient (coefficient 0?)")
    with torch.no_grad():
        after = ctx.masked_mean(_entropy(ctx.adapter.logits(model, ctx.batch)))
    return _result("entropy_direction", after - before, "> 0", after > before)


# the KL's relative change a direction step must make to be read as a direction, not rounding; longer steps are
# tried (x10 each) until it does
KL_DIRECTION_MIN_CHANGE = 1e-3
KL_DIRECTION_STEPS = 3
# ... and its absolute change must exceed this many times the KL's own rounding, measured on the same logits
KL_DIRECTION_ROUNDING = 4.0


def _kl_rounding(ctx: Context, logits: torch.Tensor, ref_logits: torch.Tensor) -> float:
    """How far float32 rounding alone moves the measured KL: the same KL from the policy's logits shifted by a
    constant (the same distribution; only the rounding differs), as the masked mean of the per-token gaps."""
    with torch.no_grad():
        shifted = _kl(logits.float() + 1.0, ref_logits)
        return float((shifted - _kl(logits, ref_logits)).abs()[ctx.owned].mean()) if ctx.owned.any() else 0.0


def check_kl_direction(ctx: Context) -> CheckResult:
    """One step on the KL term alone must lower the KL to the reference. Measured as the KL's relative change,
    with the step lengthened (x10, up to ``KL_DIRECTION_STEPS`` lengths) while that change is within rounding
    (below ``KL_DIRECTION_MIN_CHANGE`` of the KL, or below ``KL_DIRECTION_ROUNDING`` times the KL's own float32
    rounding): a KL near 0 moves by ~1e-6 on the shortest step, where float32 noise could decide the sign. A
    change still within rounding after the longest step is no verdict: the check is skipped ("not exercised")
    with the numbers."""
    ref = ctx.copy(ctx.model).requires_grad_(False)
    moved = ctx.fresh()
    gen = torch.Generator().manual_seed(ctx.seed)
    with torch.no_grad():  # move the policy off the reference so that the KL term has a gradient
        for p in moved.parameters():
            p.add_(0.02 * p.abs().mean() * torch.randn(p.shape, generator=gen).to(p))
        ref_logits = ctx.adapter.logits(ref, ctx.batch)
        logits = ctx.adapter.logits(moved, ctx.batch)
        before = ctx.masked_mean(_kl(logits, ref_logits))
        noise = _kl_rounding(ctx, logits, ref_logits)
    change, longest = 0.0, DIRECTION_STEP
    for attempt in range(KL_DIRECTION_STEPS):
        model = ctx.copy(moved)
        term = ctx.adapter.loss(model, ctx.batch, ctx.rows, ref, term="kl")
        if term is None or not getattr(term, "requires_grad", False):
            return _skip("kl_direction", "the loss has no KL term")
        longest = DIRECTION_STEP * 10 ** attempt
        if not _direction_step(model, term, longest):
            return _skip("kl_direction", "the KL term has no gradient (coefficient 0?)")
        with torch.no_grad():
            logits = ctx.adapter.logits(model, ctx.batch)
            after = ctx.masked_mean(_kl(logits, ref_logits))
            noise = max(noise, _kl_rounding(ctx, logits, ref_logits))
        change = (after - before) / max(abs(before), 1e-12)
        if abs(change) >= KL_DIRECTION_MIN_CHANGE and abs(after - before) > KL_DIRECTION_ROUNDING * noise:
            break
    else:  # every length left the KL within rounding: its sign would be float32 noise, not a direction
        return _skip("kl_direction", f"not exercised: the KL to the reference ({before:.3g}) moved by "
                                     f"{after - before:.3g} ({change:.3g} of itself) after steps of every length "
                                     f"up to {longest:g}, within rounding (float32 rounding moves it by "
                                     f"{noise:.3g}; a direction needs {KL_DIRECTION_MIN_CHANGE:g} of the KL and "
                                     f"{KL_DIRECTION_ROUNDING:g}x the rounding): no verdict is read from noise")
    return _result("kl_direction", change, "< 0", change < 0)


def _update_from(ctx: Context, stale_grads: bool):
    """One update on a fresh copy, the global RNG seeded the same way each time; ``stale_grads``: every trainable
    parameter starts with a random ``.grad``, as if the previous update had left its gradients behind."""
    model = ctx.fresh()
    ref_model = ctx.adapter.make_reference(model)
    optimizer = ctx.adapter.make_optimizer(model)
    if stale_grads:
        gen = torch.Generator().manual_seed(ctx.seed + 1)
        for p in model.parameters():
            if p.requires_grad:
                p.grad = torch.randn(p.shape, generator=gen).to(p)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(ctx.seed)
        ctx.adapter.update(model, optimizer, ref_model, ctx.batch)
    return model


def _max_diff(a, b) -> float:
    return max((float((x.detach().float() - y.detach().float()).abs().max()) for x, y in
                zip(a.parameters(), b.parameters()) if x.numel()), default=0.0)


def check_grads_zeroed(ctx: Context) -> CheckResult:
    clean = _update_from(ctx, stale_grads=False)
    again = _update_from(ctx, stale_grads=False)
    drift = _max_diff(clean, again)
    if drift != 0:  # the control failed: a difference with stale gradients would prove nothing
        return _result("grads_zeroed", drift, "== 0", False,
                       f"update() is not deterministic across calls: two clean updates of the same model and batch "
                       f"differ by {drift:.3g}, so stale gradients cannot be told apart (not a zero_grad problem). "
                       "Likely a generator or other state shared across calls (a shuffle generator the adapter "
                       "keeps, a global counter): seed it from the batch or create it in update()")
    diff = _max_diff(_update_from(ctx, stale_grads=True), clean)
    return _result("grads_zeroed", diff, "== 0", diff == 0)


def check_frozen_params(ctx: Context) -> CheckResult:
    if hasattr(ctx.adapter, "trainable_names"):
        intended = set(ctx.adapter.trainable_names(ctx.model))
        source = "trainable_names"
    else:
        intended = ctx.declared_trainable
        source = "the model's requires_grad when built"
    before = ctx.stepped["before"]
    after = _state(ctx.stepped["model"])
    drifted = sorted(n for n in before if n not in intended and not torch.equal(before[n], after[n].detach()))
    hint = f"changed but meant to stay frozen ({source}): {', '.join(drifted[:4])}" if drifted else ""
    if not drifted and not hasattr(ctx.adapter, "trainable_names") and intended >= {
            n for n, _ in ctx.model.named_parameters()}:
        hint = ("every parameter was trainable when build_model returned it; if the trainer freezes parts "
                "itself, give the adapter trainable_names(model) so that this check knows which")
    return _result("frozen_params", len(drifted), "== 0", not drifted, hint)


def check_reload(ctx: Context) -> CheckResult:
    model = ctx.stepped["model"]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "checkpoint.pt"
        if hasattr(ctx.adapter, "save") and hasattr(ctx.adapter, "load"):
            ctx.adapter.save(model, path)
            loaded = ctx.adapter.load(path)
        else:
            torch.save(model.state_dict(), path)
            loaded = ctx.adapter.build_model()
            loaded.load_state_dict(torch.load(path, weights_only=True))
    with torch.no_grad():
        diff = float((ctx.adapter.logits(loaded, ctx.batch) - ctx.adapter.logits(model, ctx.batch)).abs().max())
    return _result("reload", diff, "< 1e-6", diff < 1e-6)


def check_reproducible(ctx: Context) -> CheckResult:
    if not hasattr(ctx.adapter, "run_signature"):
        return _skip("reproducible", "adapter has no run_signature")
    a = ctx.adapter.run_signature(ctx.seed, 2)
    b = ctx.adapter.run_signature(ctx.seed, 2)
    return _result("reproducible", 0.0 if a == b else 1.0, "identical", a == b)


def check_greedy_eval(ctx: Context) -> CheckResult:
    if not (hasattr(ctx.adapter, "greedy_rollout") and hasattr(ctx.adapter, "evaluate_greedy")):
        return _skip("greedy_eval", "adapter has no greedy_rollout/evaluate_greedy")
    a = ctx.adapter.greedy_rollout(ctx.model, ctx.seed)
    b = ctx.adapter.evaluate_greedy(ctx.model, ctx.seed)
    n_diff = sum(x != y for x, y in zip(a, b)) + abs(len(a) - len(b))
    return _result("greedy_eval", n_diff, "== 0", n_diff == 0)


def pad_batch(adapter, batch, extra: int):
    """The batch with ``extra`` columns of right padding (the adapter's own ``pad_batch`` if it has one)."""
    if hasattr(adapter, "pad_batch"):
        return adapter.pad_batch(batch, extra)
    if not isinstance(batch, dict):
        raise TypeError("batch is not a dict: give the adapter a pad_batch(batch, extra)")
    t = adapter.token_ids(batch).shape[1]
    out = dict(batch)
    for key, value in batch.items():
        if torch.is_tensor(value) and value.dim() >= 2 and value.shape[1] in (t, t - 1):
            fill = getattr(adapter, "pad_id", 0) if value is adapter.token_ids(batch) else 0
            pad = [0, 0] * (value.dim() - 2) + [0, extra]
            out[key] = F.pad(value, pad, value=fill)
    return out


# name -> (function, catalog code, what a failure means)
CHECKS = {
    "mask_policy": (check_mask_policy, MASK_NOT_SHIFTED,
                    "the loss mask is not the policy's tokens of ids[:, 1:] (shifted or wrong owner)"),
    "stop_token_trained": (check_stop_token_trained, STOP_TOKEN_UNTRAINED,
                           "a completion's first stop token is out of the loss mask: the model never learns to stop"),
    "labels_shifted": (check_labels_shifted, LOGITS_LABEL_SHIFT,
                       "trainer log-probs are not logits[:, t] gathered at ids[:, t+1]"),
    "sampler_logp": (check_sampler_logp, SAMPLER_TRAINER_MISMATCH,
                     "trainer and sampler disagree on the sampled tokens (temperature, precision, label shift)"),
    "ratio_one": (check_ratio_one, SAMPLER_TRAINER_MISMATCH, "the PPO ratio is not 1 before any step: old log-probs are off-policy"),
    "scoring_eval_mode": (check_scoring_eval_mode, TRAIN_MODE_SCORING,
                          "two scoring passes of the old policy or the reference differ: dropout on (train mode)"),
    "targets_detached": (check_targets_detached, DETACHED_TARGETS,
                         "old/reference/sampler log-probs, advantages or returns carry an autograd graph"),
    "group_mean": (check_group_mean, GROUP_BASELINE, "advantages are not centred per group (batch mean, wrong axis/size)"),
    "padding_invariant": (check_padding_invariant, MASK_NOT_SHIFTED, "right padding changes the loss: pads are trained on"),
    "padding_leak": (check_padding_leak, PADDING_LEAK,
                     "a row's log-probs change with its padding or its batch neighbours"),
    "accumulation": (check_accumulation, ACCUMULATION_SCALE,
                     "accumulated gradient differs from the one-pass gradient (per-microbatch normalisation)"),
    "rows_in_step": (check_rows_in_step, ROWS_OUT_OF_STEP,
                     "the loss or gradient changes when the rows are permuted consistently: fields out of step"),
    "old_logp_frozen": (check_old_logp_frozen, OLD_LOGP_RECOMPUTED,
                        "the ratio stays 1 across the update: old log-probs recomputed each minibatch"),
    "advantage_direction": (check_advantage_direction, ADVANTAGE_SIGN,
                            "an update makes low-reward episodes likelier: advantage or surrogate sign"),
    "kl_positive": (check_kl_positive, REFERENCE_ALIAS, "KL to the reference is 0 after a step: the reference is the policy"),
    "entropy_direction": (check_entropy_direction, ENTROPY_BONUS_SIGN,
                          "a step on the entropy term lowers entropy: the bonus has the wrong sign"),
    "kl_direction": (check_kl_direction, KL_SIGN, "a step on the KL term raises KL: the penalty has the wrong sign"),
    "grads_zeroed": (check_grads_zeroed, GRAD_NOT_ZEROED, "stale .grad changes the update: gradients are not zeroed"),
    "frozen_params": (check_frozen_params, TRAINED_PARAMS_DRIFT, "parameters meant to stay frozen changed in the update"),
    "reload": (check_reload, RELOAD_MISMATCH, "a saved and reloaded model gives other outputs"),
    "reproducible": (check_reproducible, None, "the same seed gives another short-run signature"),
    "greedy_eval": (check_greedy_eval, SAMPLER_TRAINER_MISMATCH, "greedy sampling does not reproduce the evaluation path"),
}
