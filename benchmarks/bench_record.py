"""Overhead of recording: a forward inside ``vitlab.record`` over a plain forward.

    python benchmarks/bench_record.py [--repeats 21] [--threads 2] [--multimodal]

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

``--multimodal`` also times the real configurations of chapter 9, random-initialised (no
download): ``DetrForObjectDetection(DetrConfig(use_pretrained_backbone=False))`` (ResNet-50,
6 + 6 layers, 100 queries) on one 480 x 640 image, and
``LxmertForQuestionAnswering(LxmertConfig())`` (9 + 5 + 5 layers) on a 20-token question
with 36 regions: a plain forward, a recorded one (attention only), and a recorded forward +
backward (``gradients=True``) next to a plain forward + backward.

Measured (2026-12-01, torch 2.14 CPU, ``--threads 1``, a 2-core machine shared with other
jobs, load 5-10; per-round median ratios)::

    model                  batch   full   attention   eager+keep (floor)
    deit_tiny_patch16_224      1   1.13x     1.07x      1.07x
    deit_tiny_patch16_224     16   1.18x     1.05x      1.03x
    vit_base_patch16_224       1   1.07x     1.05x      1.10x
    vit_base_patch16_224      16   1.05x     1.02x      1.03x

    DETR (DetrConfig(), 480 x 640)     attention 1.01x   forward + backward with gradients 1.01x
    LXMERT (LxmertConfig(), 20 + 36)   attention 1.03x   forward + backward with gradients 1.01x

Attention-only recording meets the 1.15x goal everywhere and sits at the eager+keep floor;
full recording of DeiT-tiny at batch 16 does not (1.18x): keeping Q, K, V (views that hold
each block's qkv output alive) and the hidden states costs the rest. The median times are
noisy under such load (vit_base at batch 16 ran 18-27 s per forward); the ratios are not.

Idle machine, 2026-12-01 11:02 (2 threads, median of 21 interleaved rounds): deit_tiny batch 1
full 1.25x / attention only 1.15x (eager + keep 1.07x); batch 16 1.00x / 0.94x (0.93x);
vit_base batch 1 1.06x / 1.02x (1.02x).
"""
from __future__ import annotations

import argparse
import statistics

import timm
import torch

import vitlab

from _timing import interleaved_times, median_ratio, median_ratios, stopwatch


_time = stopwatch("wall")


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
    return median_ratios(variants, repeats, "plain", _time)


def bench_multimodal(repeats: int) -> None:
    from transformers import DetrConfig, DetrForObjectDetection, LxmertConfig, LxmertForQuestionAnswering

    torch.manual_seed(0)
    cases = {
        "DETR (DetrConfig())": (
            DetrForObjectDetection(DetrConfig(use_pretrained_backbone=False)).eval(),
            dict(pixel_values=torch.randn(1, 3, 480, 640)),
            lambda out: out.logits[0, :, 1].sum(),
        ),
        "LXMERT (LxmertConfig())": (
            LxmertForQuestionAnswering(LxmertConfig()).eval(),
            dict(input_ids=torch.randint(0, 30000, (1, 20)), visual_feats=torch.randn(1, 36, 2048),
                 visual_pos=torch.rand(1, 36, 4)),
            lambda out: out.question_answering_score[:, 3].sum(),
        ),
    }
    print(f"\n{'model':<26}{'plain ms':>10}{'attn ms':>9}{'ratio':>7}{'fwd+bwd ms':>12}{'+grads ms':>11}{'ratio':>7}")
    for label, (model, inputs, score) in cases.items():
        def plain():
            with torch.no_grad():
                model(**inputs)

        def recorded():
            with torch.no_grad(), vitlab.record(model, capture=("attention",)) as rec:
                model(**inputs)
            assert rec.events

        def backward():
            score(model(**inputs)).backward()
            model.zero_grad(set_to_none=True)

        def graded():
            with vitlab.record(model, gradients=True, capture=("attention",)) as rec:
                score(model(**inputs)).backward()
            model.zero_grad(set_to_none=True)
            assert all(e.grad is not None for e in rec.events)

        times = interleaved_times(dict(plain=plain, recorded=recorded, backward=backward, graded=graded),
                                  repeats, _time)
        med = [statistics.median(t) for t in times.values()]
        r1 = median_ratio(times["recorded"], times["plain"])
        r2 = median_ratio(times["graded"], times["backward"])
        print(f"{label:<26}{med[0] * 1e3:>10.1f}{med[1] * 1e3:>9.1f}{r1:>6.2f}x{med[2] * 1e3:>12.1f}"
              f"{med[3] * 1e3:>11.1f}{r2:>6.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=21)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--multimodal", action="store_true", help="also time real-size DETR and LXMERT")
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
    if args.multimodal:
        bench_multimodal(max(3, args.repeats // 3))


if __name__ == "__main__":
    main()
