"""Overhead of recording: a forward inside ``vitlab.record`` over a plain forward.

    python benchmarks/bench_record.py [--repeats 7] [--threads 2]

Random-initialised deit_tiny_patch16_224 and vit_base_patch16_224, batch 1 and 16, CPU,
under ``torch.no_grad()`` as a user would run them. Plain and recorded forwards are
interleaved and the median of each is taken, so a busy machine affects both alike.
Goal: at most 1.15x.
"""
from __future__ import annotations

import argparse
import statistics
import time

import timm
import torch

import vitlab


def _time(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def bench(name: str, batch: int, repeats: int) -> tuple[float, float]:
    model = timm.create_model(name, pretrained=False).eval()
    x = torch.randn(batch, 3, *model.patch_embed.img_size)

    def plain():
        with torch.no_grad():
            model(x)

    def recorded():
        with torch.no_grad(), vitlab.record(model) as rec:
            model(x)
        assert len(rec.attentions) == len(model.blocks)

    plain(), recorded()  # warm-up
    tp, tr = [], []
    for _ in range(repeats):
        tp.append(_time(plain))
        tr.append(_time(recorded))
    return statistics.median(tp), statistics.median(tr)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} threads, median of {args.repeats}")
    print(f"{'model':<24}{'batch':>6}{'plain ms':>10}{'record ms':>11}{'ratio':>8}")
    for name in ("deit_tiny_patch16_224", "vit_base_patch16_224"):
        for batch in (1, 16):
            tp, tr = bench(name, batch, args.repeats)
            print(f"{name:<24}{batch:>6}{tp * 1e3:>10.1f}{tr * 1e3:>11.1f}{tr / tp:>7.2f}x")


if __name__ == "__main__":
    main()
