"""Cost of rlguard contracts: per call against the alternatives, and per update of a class-based trainer.

    python benchmarks/contracts_overhead.py [--part calls|update|all] [--calls N] [--updates N] [--threads N]

``calls``: times a 4-tensor PPO loss function (logp, old_logp [B, T-1], advantages [B], mask [B, T-1]) bare, with
plain asserts, with jaxtyping + typeguard 2.x, with jaxtyping + beartype (when installed), with rlguard's
always-on checks (shape, dtype, grad: value checks deferred with check_every), and with every rlguard check on
every call (NaN scans, sampler-consistency gap inside a guard update). Then one forward+backward of a small
GPT-like model on CPU (4 layers, d_model 256, batch 8 x 256 tokens; also a 2-layer d128 one) and the overhead of
each variant as a share of that step.

``update``: a class-based GRPO trainer that passes dict batches (TRL-like: methods, ``inputs`` dicts checked with
``Batch`` specs and ``check_batch``), d_model 64, 2 layers, B = 128 episodes (16 prompts x 8) of T = 20 tokens,
2 epochs x 4 minibatches x 2 microbatches per update: 84 checked calls per update, with every documented marker
on (NoGrad, Finite, GroupCentred, MatchesOwner, SamplerConsistent, Frozen with key and current,
DistinctReference) under a Guard at its defaults (RLG008, RLG013, RLG014 on; the position embedding frozen and
left in the optimizer). One model, optimizer and guard serve every variant (the same
memory, so no layout effect), and the variants take turns update by update, in a rotating order: contracts off
(``mode("off")``),
every check on every call (``check_every=1``, the default), ``check_every=10``, and the value checks off
(shape, dtype, grad, identity only), and the Guard alone with no decorated function. Reported: the median over
rounds of each round's time ratio to "off", and
the ratio of the fastest update of each variant to the fastest "off" update (the least disturbed by other load).
Then the Guard per optimizer step: backward + step without it, with it at its defaults, with ``check_every=1``.
All figures come from this one run; process CPU time, one thread.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from typing import Annotated

import torch
from torch import Tensor, nn

from jaxtyping import Float, jaxtyped

from rlguard.contracts import (
    ActionMask,
    Advantages,
    Batch,
    DistinctReference,
    Finite,
    Frozen,
    GroupCentred,
    Guard,
    Logits,
    LogProbs,
    Loss,
    MatchesOwner,
    NoGrad,
    Owner,
    Rewards,
    SamplerConsistent,
    TokenIds,
    check_batch,
    contract,
    mode,
)

B, T = 8, 256


def body(logp, old_logp, advantages, mask):
    ratio = torch.exp(logp - old_logp)
    return -(ratio * advantages[:, None] * mask).sum() / mask.sum()


def bare(logp, old_logp, advantages, mask):
    return body(logp, old_logp, advantages, mask)


def asserts(logp, old_logp, advantages, mask):
    b, t1 = logp.shape
    assert logp.dtype.is_floating_point and old_logp.shape == (b, t1) and mask.shape == (b, t1)
    assert advantages.shape == (b,) and not old_logp.requires_grad and not advantages.requires_grad
    return body(logp, old_logp, advantages, mask)


def jaxtyping_variant(typechecker):
    @jaxtyped(typechecker=typechecker)
    def f(logp: Float[Tensor, "B T"], old_logp: Float[Tensor, "B T"], advantages: Float[Tensor, "B"],
          mask: Float[Tensor, "B T"]) -> Float[Tensor, ""]:
        return body(logp, old_logp, advantages, mask)

    return f


def rlguard_variant(check_every: int):
    @contract(check_every=check_every)
    def f(logp: Annotated[LogProbs, Finite(), SamplerConsistent(sampler="old_logp", mask="mask")],
          old_logp: Annotated[LogProbs, NoGrad(), Finite(), Frozen(current="logp", mask="mask")],
          advantages: Annotated[Advantages, NoGrad(), Finite()],
          mask: ActionMask) -> Annotated[Loss, Finite()]:
        return body(logp, old_logp, advantages, mask)

    return f


# CPU time of this process (time.process_time), not wall time: on a shared, loaded machine wall time also counts
# the time the process waits for a core. With --threads 1 the two agree on an idle machine.
clock = time.process_time


def per_call_us(fn, args, calls: int, repeats: int = 7) -> float:
    for _ in range(min(calls, 50)):
        fn(*args)
    best = []
    for _ in range(repeats):
        t0 = clock()
        for _ in range(calls):
            fn(*args)
        best.append((clock() - t0) / calls * 1e6)
    return min(best)


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x, causal):
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=causal, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int, d: int, layers: int, heads: int, ctx: int) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(ctx, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab)

    def forward(self, ids):
        t = ids.shape[1]
        x = self.tok(ids) + self.pos(torch.arange(t))
        causal = torch.triu(torch.full((t, t), float("-inf")), 1)
        for b in self.blocks:
            x = b(x, causal)
        return self.head(self.ln(x))


def step_ms(layers: int, d: int, vocab: int = 512, repeats: int = 5) -> float:
    torch.manual_seed(0)
    model = GPT(vocab, d, layers, 4, T)
    ids = torch.randint(0, vocab, (B, T))
    times = []
    for i in range(repeats + 1):
        t0 = clock()
        logits = model(ids)
        logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        logp.mean().backward()
        model.zero_grad(set_to_none=True)
        if i:
            times.append((clock() - t0) * 1e3)
    return statistics.median(times)


# -- per update: a class-based trainer with dict batches ----------------------------------------------------
UB, UT, UV, UG = 128, 20, 64, 8  # episodes, tokens, vocabulary, group size
PROMPT, POLICY = 0, 1


def trainer_class(check_every: int | None):
    """The trainer's class with its methods contracted at ``check_every`` (None: not contracted at all)."""
    microbatch = Batch(ids=TokenIds, owner=Owner, mask=ActionMask, old_logp=Annotated[LogProbs, NoGrad()],
                       ref_logp=Annotated[LogProbs, NoGrad()], advantages=Annotated[Advantages, NoGrad(), Finite()])
    checked = contract(check_every=check_every) if check_every is not None else (lambda f: f)

    class Trainer:
        def __init__(self, model: nn.Module, ref_model: nn.Module, optimizer: torch.optim.Optimizer,
                     generator: torch.Generator) -> None:
            self.model, self.ref_model, self.optimizer, self.generator = model, ref_model, optimizer, generator
            self.group_size = UG

        @checked
        def token_logprobs(self, logits: Logits, ids: TokenIds) -> Annotated[LogProbs, Finite()]:
            return logits[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)

        @checked
        def action_mask(self, owner: Owner) -> Annotated[ActionMask, MatchesOwner(owner="owner")]:
            return (owner[:, 1:] == POLICY).float()

        @checked
        def compute_advantages(self, rewards: Annotated[Rewards, Finite()]) -> Annotated[
                Advantages, NoGrad(), Finite(), GroupCentred(group_size="self.group_size")]:
            g = rewards.view(-1, self.group_size)
            return ((g - g.mean(1, keepdim=True)) / (g.std(1, keepdim=True) + 1e-4)).view(-1)

        @(contract(check_every=check_every, markers={"self": DistinctReference(
            reference="self.ref_model", policy="self.model", optimizer="self.optimizer")})
          if check_every is not None else (lambda f: f))
        def ref_logprobs(self, ids: TokenIds) -> Annotated[LogProbs, NoGrad(), Finite()]:
            return self.token_logprobs(self.ref_model(ids), ids)

        # each loss term sums over its microbatch and divides by the whole minibatch's token count
        @checked
        def policy_loss(self, inputs: Annotated[dict, Batch(
                            ids=TokenIds, mask=ActionMask, advantages=Annotated[Advantages, NoGrad()],
                            old_logp=Annotated[LogProbs, NoGrad(), Finite(),
                                               Frozen(current="logp", key="ids", mask="mask")])],
                        logp: Annotated[LogProbs, Finite(), SamplerConsistent(sampler="inputs.old_logp",
                                                                              mask="inputs.mask")],
                        n_tokens: torch.Tensor) -> Annotated[Loss, Finite()]:
            ratio = torch.exp(logp - inputs["old_logp"])
            a = inputs["advantages"][:, None]
            surrogate = torch.minimum(ratio * a, ratio.clamp(0.8, 1.2) * a)
            return -(surrogate * inputs["mask"]).sum() / n_tokens

        @checked
        def kl_penalty(self, logp: LogProbs, ref_logp: Annotated[LogProbs, NoGrad()], mask: ActionMask,
                       n_tokens: torch.Tensor) -> Annotated[Loss, Finite()]:
            d = ref_logp - logp
            return ((torch.exp(d) - d - 1) * mask).sum() / n_tokens

        @checked
        def entropy(self, logits: Logits, mask: ActionMask, n_tokens: torch.Tensor) -> Annotated[Loss, Finite()]:
            lp = logits[:, :-1].log_softmax(-1)
            return (-(lp.exp() * lp).sum(-1) * mask).sum() / n_tokens

        def update(self, rollout: dict) -> None:
            ids = rollout["ids"]
            with torch.no_grad():
                mask = self.action_mask(rollout["owner"])
                old = self.token_logprobs(self.model(ids), ids)
                ref = self.ref_logprobs(ids)
                adv = self.compute_advantages(rollout["rewards"])
            inputs = {"ids": ids, "owner": rollout["owner"], "mask": mask, "old_logp": old, "ref_logp": ref,
                      "advantages": adv}
            for _ in range(2):  # epochs
                for rows in torch.randperm(UB, generator=self.generator).chunk(4):  # minibatches
                    self.optimizer.zero_grad(set_to_none=True)
                    n_tokens = mask[rows].sum()
                    for micro in rows.chunk(2):  # gradient accumulation
                        sub = {k: v[micro] for k, v in inputs.items()}
                        if check_every is not None:
                            check_batch(microbatch, sub, where="Trainer.update", name="microbatch",
                                        check_every=check_every)
                        logits = self.model(sub["ids"])
                        logp = self.token_logprobs(logits, sub["ids"])
                        loss = (self.policy_loss(sub, logp, n_tokens)
                                + 0.04 * self.kl_penalty(logp, sub["ref_logp"], sub["mask"], n_tokens)
                                - 0.01 * self.entropy(logits, sub["mask"], n_tokens))
                        loss.backward()
                    self.optimizer.step()

    return Trainer


def rollout(seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, UV, (UB, UT), generator=gen)
    owner = torch.full((UB, UT), PROMPT)
    owner[:, 6:] = POLICY
    return {"ids": ids, "owner": owner, "rewards": torch.randint(0, 2, (UB,), generator=gen).float()}


def update_ratios(updates: int) -> tuple[list[tuple[str, float, float, float]], float]:
    """(variant, median per-round ratio to off, ratio of fastest updates, median ms) per variant; off's ms."""
    import copy

    from rlguard.reference.model import ModelConfig, build_model

    model = build_model(ModelConfig(vocab_size=UV, d_model=64, n_layers=2, max_len=UT), seed=0)
    model.pos_emb.requires_grad_(False)  # a frozen embedding: the guard's default frozen set
    ref = copy.deepcopy(model).eval().requires_grad_(False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)  # the frozen embedding in it too, with no gradient
    gen = torch.Generator().manual_seed(0)
    guard = Guard(policy=model, reference=ref, optimizer=opt)  # defaults: RLG008, RLG013, RLG014 on
    variants = [("contracts off", trainer_class(1), "off"),
                ("every marker, check_every=1 (the default)", trainer_class(1), "raise"),
                ("every marker, check_every=10", trainer_class(10), "raise"),
                ("value checks off (shape, dtype, grad, identity)", trainer_class(10**9), "raise"),
                ("Guard only (RLG008, RLG013, RLG014; no decorated function)", trainer_class(None), "raise")]
    trainers = [(name, cls(model, ref, opt, gen), m) for name, cls, m in variants]
    times: dict[str, list[float]] = {name: [] for name, _, _ in trainers}
    for u in range(updates + 1):
        r = rollout(u)
        turn = trainers[u % len(trainers):] + trainers[:u % len(trainers)]  # rotate: no variant always first
        for name, t, m in turn:
            t0 = clock()
            with mode(m), guard.update():
                t.update(r)
            if u:  # the first round warms up
                times[name].append(clock() - t0)
    guard.close()
    off = times["contracts off"]
    out = []
    for name, ts in times.items():
        ratios = [a / b for a, b in zip(ts, off)]
        out.append((name, statistics.median(ratios), min(ts) / min(off), statistics.median(ts) * 1e3))
    return out, statistics.median(off) * 1e3


def guard_step_us(steps: int) -> list[tuple[str, float]]:
    """Per optimizer step of the same model (backward + step): no guard, the guard at its defaults, the guard
    with check_every=1 (every step reads the fingerprints): median process time, interleaved."""
    import copy

    from rlguard.reference.model import ModelConfig, build_model

    model = build_model(ModelConfig(vocab_size=UV, d_model=64, n_layers=2, max_len=UT), seed=0)
    model.pos_emb.requires_grad_(False)
    ref = copy.deepcopy(model).eval().requires_grad_(False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = rollout(0)["ids"][:32]
    guards = {"no guard": None, "Guard, defaults (check_every=16)": 16, "Guard, check_every=1": 1}
    times: dict[str, list[float]] = {k: [] for k in guards}
    per_round = 16  # one cadence period of the default
    for i in range(max(steps // 4, 2) + 1):
        for name, every in guards.items():
            g = Guard(policy=model, reference=ref, optimizer=opt, check_every=every) if every else None
            t0 = clock()
            for _ in range(per_round):
                opt.zero_grad(set_to_none=True)
                model(ids).logsumexp(-1).mean().backward()
                opt.step()
            if i:
                times[name].append((clock() - t0) / per_round * 1e6)
            if g is not None:
                g.close()
    return [(name, statistics.median(ts)) for name, ts in times.items()]


def calls_table(a: argparse.Namespace) -> None:
    torch.manual_seed(0)
    logp = torch.randn(B, T - 1, requires_grad=True)
    old = torch.randn(B, T - 1)
    adv = torch.randn(B)
    mask = torch.ones(B, T - 1)
    args = (logp, old.clone(), adv, mask)
    sampler_args = (logp, logp.detach().clone(), adv, mask)  # a healthy first minibatch: ratio 1

    import typeguard

    rows = [("bare call", per_call_us(bare, args, a.calls)),
            ("plain asserts", per_call_us(asserts, args, a.calls)),
            ("jaxtyping + typeguard 2.x", per_call_us(jaxtyping_variant(typeguard.typechecked), args,
                                                      max(a.calls // 10, 100)))]
    try:
        import beartype

        rows.append(("jaxtyping + beartype", per_call_us(jaxtyping_variant(beartype.beartype), args,
                                                         max(a.calls // 4, 100))))
    except ImportError:
        pass
    policy = nn.Linear(2, 2)
    guard = Guard(policy=policy)  # an update with no step yet: the sampler check runs on every checked call
    with guard.update():
        rows.append(("rlguard always-on (shape, dtype, grad)", per_call_us(rlguard_variant(10**9), sampler_args,
                                                                            a.calls)))
        rows.append(("rlguard all checks, every call", per_call_us(rlguard_variant(1), sampler_args, a.calls)))
        rows.append(("rlguard all checks, check_every=10", per_call_us(rlguard_variant(10), sampler_args,
                                                                        a.calls)))
    guard.close()

    step4 = step_ms(4, 256)
    step2 = step_ms(2, 128)
    base = rows[0][1]
    print(f"# rlguard contracts overhead  (torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{platform.machine()}, python {platform.python_version()}; process CPU time, min of 7 runs)")
    print(f"# function: 4 tensors, logp/old_logp/mask [{B}, {T - 1}], advantages [{B}]")
    print(f"# one fwd+bwd, GPT 4 layers d256, batch {B}x{T}: {step4:.1f} ms; GPT 2 layers d128: {step2:.1f} ms")
    print()
    print("| variant | per call (us) | added vs bare (us) | added / step 4L-d256 | added / step 2L-d128 |")
    print("|---|---:|---:|---:|---:|")
    for name, us in rows:
        add = us - base
        print(f"| {name} | {us:.1f} | {add:+.1f} | {add / (step4 * 1e3) * 100:.3f}% | "
              f"{add / (step2 * 1e3) * 100:.3f}% |")


def update_table(a: argparse.Namespace) -> None:
    rows, off_ms = update_ratios(a.updates)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"# rlguard contracts per update  (torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{platform.machine()}, python {platform.python_version()}, load average {load:.1f})")
    print(f"# class-based trainer, dict batches: d_model 64, 2 layers, B={UB} x T={UT}, 2 epochs x 4 minibatches x "
          f"2 microbatches, 84 checked calls per update; {a.updates} rounds; one update off: {off_ms:.1f} ms")
    print()
    print("| variant | per update (ms, median) | ratio to off (median of rounds) | ratio of fastest updates |")
    print("|---|---:|---:|---:|")
    for name, median_ratio, fastest_ratio, ms in rows:
        print(f"| {name} | {ms:.1f} | {median_ratio:.3f} | {fastest_ratio:.3f} |")
    steps = guard_step_us(a.updates)
    base = steps[0][1]
    print()
    print("# the Guard per optimizer step (backward + step of 32 episodes; reference and frozen embedding watched)")
    print()
    print("| variant | per step (us, median) | added (us) |")
    print("|---|---:|---:|")
    for name, us in steps:
        print(f"| {name} | {us:.0f} | {us - base:+.0f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=("calls", "update", "all"), default="all")
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--updates", type=int, default=20, help="rounds of the per-update comparison")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1: CPU time = wall time)")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    if a.part in ("calls", "all"):
        calls_table(a)
    if a.part in ("update", "all"):
        if a.part == "all":
            print()
        update_table(a)


if __name__ == "__main__":
    main()
