"""Speed of :func:`vitlab.project` relative to a plain forward pass (issue 11).

Random-initialised timm ``deit_tiny_patch16_224`` (no download), batch 16, 2 torch threads
by default. Each round times a plain forward (under ``torch.no_grad()``) and then
``project`` on the same batch; the ratio of each pair is taken and the median over rounds
printed. ``project`` computes its class logits on first access of a field, so two figures
are given: ``project`` + ``.residual`` (the residual stream, what identifiability reads), and
``project`` + all four projections (residual, mid, attention, mlp).

Goal: project + residual <= 1.3x a plain forward. Measured (2 idle cores, 2026-12-01):
project + residual 1.48x, project + all four 2.59x; the forward inside ``record`` alone is
about 1.04x, ``project`` before any field is read about 1.12x. The head itself is the floor:
every token of every block through a 192 x 1000 head is 16 x 12 x 197 x 192 x 1000 = 7.3
GMACs, about a third of the forward's, so reading all classes of every token misses 1.3x.

    python benchmarks/bench_projection.py [--batch 16] [--rounds 5] [--threads 2]
"""
from __future__ import annotations

import argparse
import statistics
import time

import timm
import torch

from vitlab.projection import project

GOAL = 1.3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    torch.manual_seed(0)
    model = timm.create_model("deit_tiny_patch16_224", pretrained=False).eval()
    x = torch.randn(args.batch, 3, 224, 224)

    def seconds(fn) -> float:
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    def forward():
        with torch.no_grad():
            model(x)

    def residual():
        project(model, x).residual

    def everything():
        p = project(model, x)
        p.residual, p.mid, p.attention, p.mlp

    forward(), residual()  # warm up
    ratios = {"project + residual": [], "project + all four": []}
    plain = []
    for _ in range(args.rounds):
        for name, fn in (("project + residual", residual), ("project + all four", everything)):
            base = seconds(forward)
            plain.append(base)
            ratios[name].append(seconds(fn) / base)
    print(f"deit_tiny_patch16_224 (random), batch {args.batch}, {args.threads} threads, "
          f"median of {args.rounds} rounds; plain forward {statistics.median(plain) * 1000:.0f} ms")
    for name, values in ratios.items():
        goal = f"  (goal <= {GOAL}x)" if name == "project + residual" else ""
        print(f"  {name:20s} {statistics.median(values):.2f}x{goal}")


if __name__ == "__main__":
    main()
