"""Speed of the explanation methods relative to a plain forward pass (issue 5).

Random-initialised timm ``deit_tiny_patch16_224`` (no download), batch 16, CPU. Every
method call is timed right after a plain forward on the same batch (under
``torch.no_grad()``, as a user would run it); the ratio of each pair is taken and the
median over rounds printed, which keeps the figures stable on a shared machine.

Goals: rollout <= 1.15x; gradient rollout and Chefer relevance <= 3.2x (one forward and
one backward for the whole batch). jacobgil/vit-explain's per-image loop: 1.40x / 5.7x.

    python benchmarks/bench_methods.py [--batch 16] [--rounds 7] [--threads N] [--clock wall|cpu]

On a machine shared with other jobs, ``--threads 1 --clock cpu`` (process CPU time of one
thread) measures the work done rather than the wait for a core, and varies far less.
"""
from __future__ import annotations

import argparse
import statistics
import time

import timm
import torch

from vitlab.attention import attention_gradcam, cls_attention, raw_attention
from vitlab.relevance import chefer_relevance
from vitlab.rollout import grad_rollout, rollout

GOALS = {"rollout": 1.15, "grad_rollout": 3.2, "chefer_relevance": 3.2}


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def ratios_to_forward(forward, methods: dict, rounds: int, seconds):
    """Warm every callable up once, then time each method against a plain forward timed just
    before it, ``rounds`` times: ``({name: [ratio, ...]}, [forward seconds, ...])``."""
    forward()  # warm-up
    for fn in methods.values():
        fn()
    ratios = {name: [] for name in methods}
    forward_times = []
    for _ in range(rounds):
        for name, fn in methods.items():
            t_fwd = seconds(forward)
            forward_times.append(t_fwd)
            ratios[name].append(seconds(fn) / t_fwd)
    return ratios, forward_times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                        help="wall: elapsed time; cpu: this process's CPU time (steadier on a busy machine)")
    args = parser.parse_args()
    clock = CLOCKS[args.clock]

    def seconds(fn) -> float:
        start = clock()
        fn()
        return clock() - start

    if args.threads:
        torch.set_num_threads(args.threads)

    torch.manual_seed(0)
    model = timm.create_model("deit_tiny_patch16_224", pretrained=False).eval()
    x = torch.randn(args.batch, 3, 224, 224)

    def forward():
        with torch.no_grad():
            model(x)

    methods = {
        "rollout": lambda: rollout(model, x),
        "rollout (min, discard 0.9)": lambda: rollout(model, x, head_fusion="min", discard_ratio=0.9),
        "grad_rollout": lambda: grad_rollout(model, x),
        "chefer_relevance": lambda: chefer_relevance(model, x),
        "cls_attention": lambda: cls_attention(model, x),
        "raw_attention": lambda: raw_attention(model, x),
        "attention_gradcam": lambda: attention_gradcam(model, x),
    }
    ratios, forward_times = ratios_to_forward(forward, methods, args.rounds, seconds)

    print(
        f"deit_tiny_patch16_224 (random init), batch {args.batch}, CPU, {torch.get_num_threads()} threads, "
        f"{args.clock} clock, median of {args.rounds} rounds"
    )
    print(f"plain forward (no_grad): {statistics.median(forward_times) * 1000:.0f} ms")
    for name, values in ratios.items():
        ratio = statistics.median(values)
        goal = GOALS.get(name)
        verdict = "" if goal is None else f"  goal <= {goal:.2f}x: {'ok' if ratio <= goal else 'MISSED'}"
        print(f"{name:28s} {ratio:5.2f}x{verdict}")


if __name__ == "__main__":
    main()
