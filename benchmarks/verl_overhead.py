"""Cost of rlguard's verl integration per call: verl's own functions bare, and wrapped by ``install()``.

    python benchmarks/verl_overhead.py [--sizes 64x256,256x1024] [--calls N] [--repeats N] [--check-every N]

Times verl 0.9.1's functions as verl's actor and driver call them, on CPU tensors of B episodes x R response
tokens: the ``vanilla`` policy loss (forward, and forward + backward of its loss), the ``grpo`` and
``grpo_vectorized`` advantage estimators (groups of 8 episodes, verl's ``uid`` array as ``index``), ``agg_loss``
(token-mean) and ``kl_penalty`` (low_var_kl). Each function runs ``--calls`` times per repeat, alternately bare
(the registry's original, ``__wrapped__``) and wrapped (``install("raise")``, every check on every call, or
``--check-every N``), ``--repeats`` times; reported: the median microseconds per call of each, the difference
(what the checks cost per call) and the ratio. One thread, process CPU time, all figures from this one run.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
import warnings

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
warnings.filterwarnings("ignore")

import numpy as np  # noqa: E402
import torch  # noqa: E402

GROUP = 8


def inputs(b: int, r: int) -> dict:
    gen = torch.Generator().manual_seed(0)
    old = torch.randn(b, r, generator=gen) - 2
    mask = torch.ones(b, r, dtype=torch.bool)
    mask[:, r - r // 4:] = torch.rand(b, 1, generator=gen) < 0.5  # some right padding
    rewards = torch.zeros(b, r)
    rewards[:, -1] = torch.rand(b, generator=gen)
    return {"old": old, "logp": (old + 0.1 * torch.randn(b, r, generator=gen)).requires_grad_(),
            "adv": torch.randn(b, r, generator=gen), "mask": mask, "rewards": rewards,
            "uid": np.array([f"prompt-{i // GROUP}" for i in range(b)], dtype=object)}


def calls(core, config, x: dict, wrapped: bool) -> dict:
    """name -> a no-argument call of that verl function, bare or as the installation wraps it."""
    def pick(fn):
        return fn if wrapped else fn.__wrapped__

    loss = pick(core.POLICY_LOSS_REGISTRY["vanilla"])
    grpo, grpo_v = pick(core.ADV_ESTIMATOR_REGISTRY["grpo"]), pick(core.ADV_ESTIMATOR_REGISTRY["grpo_vectorized"])
    agg, kl = pick(core.agg_loss), pick(core.kl_penalty)
    policy = dict(old_log_prob=x["old"], log_prob=x["logp"], advantages=x["adv"], response_mask=x["mask"],
                  loss_agg_mode="token-mean", config=config)

    def loss_backward():
        out, _ = loss(**policy)
        out.backward()
        x["logp"].grad = None

    estimator = dict(token_level_rewards=x["rewards"], response_mask=x["mask"].long(), index=x["uid"])
    return {
        "policy loss 'vanilla' (forward)": lambda: loss(**policy),
        "policy loss 'vanilla' (forward + backward)": loss_backward,
        "advantage estimator 'grpo'": lambda: grpo(**estimator),
        "advantage estimator 'grpo_vectorized'": lambda: grpo_v(**estimator),
        "agg_loss (token-mean)": lambda: agg(loss_mat=x["logp"], loss_mask=x["mask"], loss_agg_mode="token-mean"),
        "kl_penalty (low_var_kl)": lambda: kl(logprob=x["logp"], ref_logprob=x["old"], kl_penalty="low_var_kl"),
    }


def per_call_us(fn, n: int) -> float:
    start = time.process_time()
    for _ in range(n):
        fn()
    return (time.process_time() - start) / n * 1e6


def measure(core, config, b: int, r: int, n: int, repeats: int) -> list[tuple[str, float, float]]:
    x = inputs(b, r)
    bare, wrapped = calls(core, config, x, False), calls(core, config, x, True)
    rows = []
    for name in bare:
        n_here = max(3, n // 10) if "'grpo'" in name else n  # the per-row Python loop of verl's grpo is slow
        for f in (bare[name], wrapped[name]):  # warm up: the first wrapped call builds its contract
            f()
        times: dict[str, list[float]] = {"bare": [], "wrapped": []}
        for _ in range(repeats):
            times["bare"].append(per_call_us(bare[name], n_here))
            times["wrapped"].append(per_call_us(wrapped[name], n_here))
        rows.append((name, statistics.median(times["bare"]), statistics.median(times["wrapped"])))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="64x256,256x1024", help="B x R of each run, comma-separated")
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--check-every", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(1)

    import verl

    import rlguard.integrations.verl as rlguard_verl
    from verl.trainer.ppo import core_algos
    from verl.workers.config import FSDPActorConfig

    rlguard_verl.install("raise", check_every=args.check_every)
    config = FSDPActorConfig(strategy="fsdp", rollout_n=GROUP, ppo_micro_batch_size_per_gpu=2)
    print(f"verl {verl.__version__}, torch {torch.__version__}, {platform.processor() or platform.machine()}, "
          f"1 thread, check_every={args.check_every}, {args.calls} calls x {args.repeats} repeats")
    print("| function | B x R | bare (us/call) | wrapped (us/call) | checks (us/call) | ratio |")
    print("|---|---|---:|---:|---:|---:|")
    for size in args.sizes.split(","):
        b, r = (int(v) for v in size.lower().split("x"))
        for name, bare, wrapped in measure(core_algos, config, b, r, args.calls, args.repeats):
            print(f"| {name} | {b} x {r} | {bare:.0f} | {wrapped:.0f} | {wrapped - bare:.0f} | {wrapped / bare:.2f} |")


if __name__ == "__main__":
    main()
