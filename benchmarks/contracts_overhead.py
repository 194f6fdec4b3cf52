"""Per-call cost of rlguard contracts against the alternatives, and against one training step.

    python benchmarks/contracts_overhead.py [--calls N] [--threads N]

Times a 4-tensor PPO loss function (logp, old_logp [B, T-1], advantages [B], mask [B, T-1]) bare, with plain
asserts, with jaxtyping + typeguard 2.x, with jaxtyping + beartype (when installed), with rlguard's always-on
checks (shape, dtype, grad: value checks deferred with check_every), and with every rlguard check on every call
(NaN scans, sampler-consistency gap inside a guard update). Then one forward+backward of a small GPT-like model on
CPU (4 layers, d_model 256, batch 8 x 256 tokens; also the 2-layer d128 one of the issue) and the overhead of
each variant as a share of that step. All figures come from this one run.
"""

from __future__ import annotations

import argparse
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
    Finite,
    Frozen,
    Guard,
    LogProbs,
    Loss,
    NoGrad,
    SamplerConsistent,
    contract,
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1: CPU time = wall time)")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
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
    rows.append(("rlguard always-on (shape, dtype, grad)", per_call_us(rlguard_variant(10**9), args, a.calls)))
    policy = nn.Linear(2, 2)
    guard = Guard(policy=policy)  # an update with no step yet: the sampler check runs on every call
    with guard.update():
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


if __name__ == "__main__":
    main()
