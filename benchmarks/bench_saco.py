"""Cost of :func:`vitlab.faithfulness.saco` relative to the forwards it needs (issue 12).

SaCo with K groups needs (K + 1) x B forward passes: the clean batch and every image with one
group replaced. This times ``saco`` against exactly that many plain forwards, in chunks of the
same size, of inputs of the same shape; the ratio is the overhead of building the perturbed
inputs, grouping the pixels and computing the coefficient. Random-initialised timm
``deit_tiny_patch16_224`` (no download), a random 14 x 14 saliency map per image.

Goal: at most 1.1x. Measured (2 idle cores, 2026-12-01, medians): B=4 1.04x (7 rounds),
B=8 1.06x (5 rounds); single rounds range 0.95-1.29x, so take the median of several. Run on an
otherwise idle machine.

    python benchmarks/bench_saco.py [--batch 4] [--k 10] [--chunk 16] [--rounds 7] [--threads 2]
"""
from __future__ import annotations

import argparse
import math
import statistics

import torch

from vitlab.faithfulness import saco

from _timing import add_timing_arguments, random_deit_tiny, ratios_to_forward, stopwatch

GOAL = 1.1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_timing_arguments(parser, batch=4, rounds=7, threads=2, clock=None)
    parser.add_argument("--k", type=int, default=10)
    parser.add_argument("--chunk", type=int, default=16)
    args = parser.parse_args()
    model, x, _ = random_deit_tiny(args.batch, args.threads)
    maps = torch.rand(args.batch, 14, 14)
    n = (args.k + 1) * args.batch
    chunks = [min(args.chunk, n - i) for i in range(0, n, args.chunk)]
    inputs = torch.randn(args.chunk, 3, 224, 224)

    def forwards():
        with torch.no_grad():
            for c in chunks:
                model(inputs[:c])

    def measure():
        saco(model, x, maps, k=args.k, batch_size=args.chunk)

    ratios = ratios_to_forward(forwards, {"saco": measure}, args.rounds, stopwatch("wall"))[0]["saco"]
    print(f"saco, B={args.batch}, K={args.k}, {len(chunks)} forwards of <= {args.chunk} "
          f"({math.ceil(n / args.chunk)} needed): {statistics.median(ratios):.2f}x the plain forwards "
          f"(goal <= {GOAL}x; rounds: {', '.join(f'{r:.2f}' for r in ratios)})")


if __name__ == "__main__":
    main()
