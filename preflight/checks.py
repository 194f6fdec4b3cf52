"""The preflight checks: each runs on copies of the model and one real batch and returns a ``CheckResult``.

Every check measures one invariant of a correct RL trainer for language models and names the catalog code of
the fault that breaks it (``docs/preflight.md`` explains each one).
"""

from __future__ import annotations

import copy
import math
import tempfile
from dataclasses import asdict, dataclass
from functools import cached_property
from pathlib import Path

import torch
import torch.nn.functional as F
from rlguard.catalog import (
    ACCUMULATION_SCALE, ADVANTAGE_SIGN, ENTROPY_BONUS_SIGN, GRAD_NOT_ZEROED, GROUP_BASELINE, KL_SIGN,
    LOGITS_LABEL_SHIFT, MASK_NOT_SHIFTED, OLD_LOGP_RECOMPUTED, REFERENCE_ALIAS, RELOAD_MISMATCH,
    SAMPLER_TRAINER_MISMATCH, TRAINED_PARAMS_DRIFT,
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

    def to_dict(self) -> dict:
        d = asdict(self)
        d["value"] = None if isinstance(self.value, float) and math.isnan(self.value) else self.value
        if self.per_rank is None:
            del d["per_rank"]
        else:
            d["per_rank"] = [None if isinstance(v, float) and math.isnan(v) else v for v in self.per_rank]
        return d


class Context:
    """What the checks share: the adapter, the pristine model, one batch, and one real update on a copy."""

    def __init__(self, adapter, seed: int = 0):
        self.adapter = adapter
        self.seed = seed
        self.model = adapter.build_model()
        # what the model declared trainable when it was built, before any trainer code ran on it (a faulty
        # trainer may switch requires_grad on itself): the default intended set of frozen_params
        self.declared_trainable = {n for n, p in self.model.named_parameters() if p.requires_grad}
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


def _state(model) -> dict:
    return dict(list(model.named_parameters()) + list(model.named_buffers()))


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


def _direction_step(model, loss) -> bool:
    """One plain gradient step of fixed length on ``loss`` alone; False when the term has no gradient."""
    params = [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    norm = torch.sqrt(sum((g.float() ** 2).sum() for g in grads if g is not None) + 0.0)
    if not torch.isfinite(norm) or norm == 0:
        return False
    with torch.no_grad():
        for p, g in zip(params, grads):
            if g is not None:
                p.sub_(DIRECTION_STEP * g / norm)
    return True


def _result(name, value, tolerance, passed, hint="", skipped=False) -> CheckResult:
    code, what = CHECKS[name][1], CHECKS[name][2]
    return CheckResult(name, code, float(value), tolerance, bool(passed), hint if hint else ("" if passed else what),
                       skipped)


def _skip(name, why) -> CheckResult:
    return _result(name, float("nan"), "-", True, f"skipped: {why}", skipped=True)


# ---------------------------------------------------------------------------------------------- the checks


def check_mask_policy(ctx: Context) -> CheckResult:
    mask = ctx.adapter.action_mask(ctx.batch)
    wrong = int(((mask > 0) != ctx.owned).sum())
    return _result("mask_policy", wrong, "== 0", wrong == 0)


def check_labels_shifted(ctx: Context) -> CheckResult:
    with torch.no_grad():
        logits = ctx.adapter.logits(ctx.model, ctx.batch)
        gathered = logits.float().log_softmax(-1).gather(-1, ctx.ids[:, 1:, None]).squeeze(-1)
    err = float((ctx.trainer_logp - gathered).abs()[ctx.owned].max()) if ctx.owned.any() else 0.0
    return _result("labels_shifted", err, "< 1e-5", err < 1e-5)


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


def check_group_mean(ctx: Context) -> CheckResult:
    adv = ctx.adapter.advantages(ctx.batch).float().view(-1, ctx.adapter.group_size)
    worst = float(adv.mean(-1).abs().max())
    return _result("group_mean", worst, "< 1e-5", worst < 1e-5)


def check_padding_invariant(ctx: Context) -> CheckResult:
    padded = pad_batch(ctx.adapter, ctx.batch, 8)
    with torch.no_grad():
        a = float(ctx.adapter.loss(ctx.model, ctx.batch, ctx.rows))
        b = float(ctx.adapter.loss(ctx.model, padded, ctx.rows))
    err = abs(a - b)
    return _result("padding_invariant", err, "< 1e-5", err < 1e-5)


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
    with torch.no_grad():
        new = ctx.adapter.log_probs(ctx.stepped["model"], ctx.batch)
    moved = ((new - ctx.trainer_logp) * ctx.owned).sum(-1)  # change of log pi(episode) [B]
    adv = ctx.true_advantages
    if adv.abs().max() == 0:
        return _skip("advantage_direction", "every group has equal rewards in this batch")
    corr = float(torch.corrcoef(torch.stack([moved.float(), adv]))[0, 1])
    return _result("advantage_direction", corr, "> 0", corr > 0)


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


def check_kl_direction(ctx: Context) -> CheckResult:
    ref = ctx.copy(ctx.model).requires_grad_(False)
    model = ctx.fresh()
    gen = torch.Generator().manual_seed(ctx.seed)
    with torch.no_grad():  # move the policy off the reference so that the KL term has a gradient
        for p in model.parameters():
            p.add_(0.02 * p.abs().mean() * torch.randn(p.shape, generator=gen).to(p))
    term = ctx.adapter.loss(model, ctx.batch, ctx.rows, ref, term="kl")
    if term is None or not getattr(term, "requires_grad", False):
        return _skip("kl_direction", "the loss has no KL term")
    with torch.no_grad():
        ref_logits = ctx.adapter.logits(ref, ctx.batch)
        before = ctx.masked_mean(_kl(ctx.adapter.logits(model, ctx.batch), ref_logits))
    if not _direction_step(model, term):
        return _skip("kl_direction", "the KL term has no gradient (coefficient 0?)")
    with torch.no_grad():
        after = ctx.masked_mean(_kl(ctx.adapter.logits(model, ctx.batch), ref_logits))
    return _result("kl_direction", after - before, "< 0", after < before)


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
    "labels_shifted": (check_labels_shifted, LOGITS_LABEL_SHIFT,
                       "trainer log-probs are not logits[:, t] gathered at ids[:, t+1]"),
    "sampler_logp": (check_sampler_logp, SAMPLER_TRAINER_MISMATCH,
                     "trainer and sampler disagree on the sampled tokens (temperature, precision, label shift)"),
    "ratio_one": (check_ratio_one, SAMPLER_TRAINER_MISMATCH, "the PPO ratio is not 1 before any step: old log-probs are off-policy"),
    "group_mean": (check_group_mean, GROUP_BASELINE, "advantages are not centred per group (batch mean, wrong axis/size)"),
    "padding_invariant": (check_padding_invariant, MASK_NOT_SHIFTED, "right padding changes the loss: pads are trained on"),
    "accumulation": (check_accumulation, ACCUMULATION_SCALE,
                     "accumulated gradient differs from the one-pass gradient (per-microbatch normalisation)"),
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
