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

from vitlab.attention import attention_gradcam, cls_attention, raw_attention
from vitlab.relevance import chefer_relevance
from vitlab.rollout import grad_rollout, rollout

from _timing import add_timing_arguments, random_deit_tiny, ratios_to_forward, setup_line, stopwatch

GOALS = {"rollout": 1.15, "grad_rollout": 3.2, "chefer_relevance": 3.2}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_timing_arguments(parser, batch=16, rounds=7, clock="wall")
    args = parser.parse_args()
    seconds = stopwatch(args.clock)
    model, x, forward = random_deit_tiny(args.batch, args.threads)

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

    print(setup_line(args.batch, f"{args.clock} clock", args.rounds))
    print(f"plain forward (no_grad): {statistics.median(forward_times) * 1000:.0f} ms")
    for name, values in ratios.items():
        ratio = statistics.median(values)
        goal = GOALS.get(name)
        verdict = "" if goal is None else f"  goal <= {goal:.2f}x: {'ok' if ratio <= goal else 'MISSED'}"
        print(f"{name:28s} {ratio:5.2f}x{verdict}")


if __name__ == "__main__":
    main()
