"""Overhead of recording: a forward inside ``vitlab.record`` over a plain forward.

    python benchmarks/bench_record.py [--repeats 21] [--threads 2]

Random-initialised deit_tiny_patch16_224 and vit_base_patch16_224, batch 1 and 16, CPU,
under ``torch.no_grad()`` as a user would run them, recording

- ``full``: every field (``record(model)``: attention, Q, K, V, hidden states), and
- ``attention``: the attention alone (``record(model, capture=("attention",))``, what
  rollout, raw attention and the gradient methods ask for).

Each round runs a plain forward and each recording once, interleaved, so a busy machine
(other processes on the same cores) slows all alike; the ratio printed is the median over
rounds of (recorded time / that round's plain time), next to the median times. Goal: at most
1.15x. Both recordings switch the model to its eager attention path (the fused kernel never
materialises the matrix they keep) and keep one ``B x heads x N x N`` tensor per block, so the
floor is that of a plain eager forward that keeps its attention: printed as ``eager+keep``.
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


def bench(name: str, batch: int, repeats: int) -> dict[str, tuple[float, float]]:
    """``{variant: (median seconds, median ratio to plain)}`` for plain, full, attention, eager+keep."""
    model = timm.create_model(name, pretrained=False).eval()
    x = torch.randn(batch, 3, *model.patch_embed.img_size)

    def plain():
        with torch.no_grad():
            model(x)

    def full():
        with torch.no_grad(), vitlab.record(model) as rec:
            model(x)
        assert len(rec.attentions) == len(rec.queries) == len(model.blocks)

    def attention():
        with torch.no_grad(), vitlab.record(model, capture=("attention",)) as rec:
            model(x)
        assert len(rec.attentions) == len(model.blocks)

    def eager_keep():
        # the floor, by hand (a benchmark may flip a flag; vitlab's modules other than record may not)
        kept = []
        handles = [blk.attn.attn_drop.register_forward_hook(lambda m, i, o: kept.append(o)) for blk in model.blocks]
        for blk in model.blocks:
            blk.attn.fused_attn = False
        try:
            with torch.no_grad():
                model(x)
        finally:
            for blk in model.blocks:
                blk.attn.fused_attn = True
            for h in handles:
                h.remove()
        assert len(kept) == len(model.blocks)

    variants = {"plain": plain, "full": full, "attention": attention, "eager+keep": eager_keep}
    for fn in variants.values():  # warm-up
        fn()
    times = {k: [] for k in variants}
    for _ in range(repeats):
        for k, fn in variants.items():
            times[k].append(_time(fn))
    return {
        k: (statistics.median(t), statistics.median(a / p for a, p in zip(t, times["plain"])))
        for k, t in times.items()
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=21)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} threads, median of {args.repeats} interleaved rounds")
    print(f"{'model':<24}{'batch':>6}{'plain ms':>10}{'full ms':>9}{'full':>7}"
          f"{'attn ms':>9}{'attn':>7}{'eager+keep':>12}")
    for name in ("deit_tiny_patch16_224", "vit_base_patch16_224"):
        for batch in (1, 16):
            r = bench(name, batch, args.repeats)
            print(f"{name:<24}{batch:>6}{r['plain'][0] * 1e3:>10.1f}{r['full'][0] * 1e3:>9.1f}{r['full'][1]:>6.2f}x"
                  f"{r['attention'][0] * 1e3:>9.1f}{r['attention'][1]:>6.2f}x{r['eager+keep'][1]:>11.2f}x")


if __name__ == "__main__":
    main()
