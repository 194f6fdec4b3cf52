"""Cost of rlguard's TRL integration: the callback per training step, and the preflight's wall time.

    python benchmarks/trl_overhead.py [--trainer grpo|rloo] [--steps N] [--repeats N] [--hidden H] [--layers L]
                                      [--check-every N]

Trains a real ``trl.GRPOTrainer`` (or ``trl.RLOOTrainer``, without the entropy bonus it does not have) on the CPU (a Llama built in code, ``tests/trl_helpers.py``; the default
configuration of the TRL tests with a KL term, two iterations per generation, an entropy bonus, lr 1e-3) for
``--steps`` optimizer steps, alternately without and with ``RlguardCallback`` (raise mode, contracts and monitor
on), ``--repeats`` times each; reports the median seconds per step of each and the ratio, and the time spent
inside the callback's own checks (its seams, the guard's optimizer-step hooks, the monitor), clocked directly, which
the noise of a shared machine does not blur. All figures come from this one run.
Then the preflight (``preflight(trainer)`` and with the factory, which adds two short real trainings) on the same
trainer. ``--hidden``/``--layers`` size the model (the tests' is 32/2).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
import warnings
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import torch  # noqa: E402

import trl_helpers as h  # noqa: E402


# seconds spent inside the callback's checks (its seams, the guard's step hooks, the monitor), this run
INSIDE: dict[str, float] = {}


def _clocked(name, fn):
    def clocked(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            INSIDE[name] = INSIDE.get(name, 0.0) + time.perf_counter() - start

    return clocked


def _clock_the_checks() -> None:
    from rlguard.contracts.guard import Guard
    from rlguard.integrations.trl.callback import RlguardCallback

    for cls, names in ((RlguardCallback, ("_check_generation", "_check_loss", "_check_rewards",
                                          "_check_reward_models", "_trace_reference", "_check_terms", "on_log",
                                          "on_train_begin")),
                       (Guard, ("_pre_step", "_post_step", "begin_update", "end_update"))):
        for name in names:
            setattr(cls, name, _clocked(f"{cls.__name__}.{name}", getattr(cls, name)))


MAKE = {"grpo": h.make_trainer, "rloo": h.make_rloo_trainer}


def _timed_training(config: dict, watched: bool, check_every: int = 1, kind: str = "grpo") -> tuple[float, dict]:
    from rlguard.integrations.trl import RlguardCallback

    trainer = MAKE[kind](**config)
    if watched:
        RlguardCallback.attach(trainer, mode="raise", check_every=check_every)
    INSIDE.clear()
    start = time.perf_counter()
    trainer.train()
    steps = config["max_steps"]
    return (time.perf_counter() - start) / steps, {k: v / steps for k, v in INSIDE.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--hidden", type=int, default=32)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--check-every", type=int, default=1, help="the callback's check_every")
    parser.add_argument("--trainer", choices=sorted(MAKE), default="grpo")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    import transformers

    transformers.logging.set_verbosity_error()
    from rlguard.integrations.trl import TRL_VERSION, preflight

    h.MODEL_SIZE.update(hidden_size=args.hidden, num_hidden_layers=args.layers)
    config = dict(beta=0.1, num_iterations=2, learning_rate=1e-3, max_steps=args.steps)
    if args.trainer == "grpo":
        config["entropy_coef"] = 0.01
    _clock_the_checks()
    _timed_training(config, True, kind=args.trainer)  # warm-up: imports, kernels, the model folder
    plain, watched, inside = [], [], []
    for _ in range(args.repeats):
        plain.append(_timed_training(config, False, kind=args.trainer)[0])
        step, checks = _timed_training(config, True, args.check_every, args.trainer)
        watched.append(step)
        inside.append(checks)
    off, on = statistics.median(plain), statistics.median(watched)
    print(f"{args.trainer}: torch {torch.__version__}, trl {TRL_VERSION}, {platform.processor() or platform.machine()}, "
          f"{args.threads} thread(s); Llama hidden {args.hidden} x {args.layers} layers, "
          f"{h.CONFIG['per_device_train_batch_size'] * h.CONFIG['gradient_accumulation_steps']} episodes of up to "
          f"{h.CONFIG['max_completion_length']} tokens per step, {args.steps} steps x {args.repeats} runs, "
          f"check_every={args.check_every}")
    print(f"per optimizer step: without callback {off * 1e3:.1f} ms, with {on * 1e3:.1f} ms, "
          f"ratio {on / off:.3f} (+{(on - off) * 1e3:.1f} ms)")
    total = statistics.median(sum(run.values()) for run in inside)
    print(f"inside the callback's checks: {total * 1e3:.2f} ms per step (median), {total / off:.1%} of a step "
          "without it; by part (median ms per step): " + ", ".join(
              f"{name} {statistics.median(run.get(name, 0.0) for run in inside) * 1e3:.2f}"
              for name in sorted(inside[0])))
    print(f"  runs without: {', '.join(f'{x * 1e3:.1f}' for x in plain)} ms")
    print(f"  runs with:    {', '.join(f'{x * 1e3:.1f}' for x in watched)} ms")
    for label, target in (("preflight(trainer)", None), ("preflight(factory)", "factory")):
        times = []
        for _ in range(args.repeats):
            trainer_config = {k: v for k, v in config.items() if k != "max_steps"}
            make = MAKE[args.trainer]
            subject = (lambda: make(**trainer_config)) if target else make(**trainer_config)
            start = time.perf_counter()
            report = preflight(subject)
            times.append(time.perf_counter() - start)
            assert report.passed
        print(f"{label}: median {statistics.median(times):.2f} s ({', '.join(f'{t:.2f}' for t in times)})")


if __name__ == "__main__":
    main()
