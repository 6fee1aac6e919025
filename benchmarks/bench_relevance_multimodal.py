"""Cost of the chapter-5 relevance (vitlab.relevance) over a plain forward + backward.

    python benchmarks/bench_relevance_multimodal.py [--repeats 5] [--threads 1] [--real-lxmert]

Random-initialised, no download:

- DETR: ``DetrForObjectDetection(DetrConfig(use_pretrained_backbone=False))`` (ResNet-50,
  6 + 6 layers, 8 heads, 100 queries) on one 480 x 640 image (a 15 x 20 feature map, 300
  image tokens), explaining K = 1 and K = 5 queries (given: random weights detect nothing).
- LXMERT: a small ``LxmertConfig`` of the real depth (9 language, 5 relational, 5
  cross-modality layers; hidden 256, 4 heads; ``--real-lxmert``: ``LxmertConfig()`` itself,
  hidden 768, 12 heads), batch 8, 20-token questions, 36 regions of 2048-d features.

Each round runs every variant once, interleaved, so a busy machine slows all alike; printed
are median times and the median over rounds of (time / that round's plain forward + backward):

- ``fwd+bwd``: plain forward, then ``backward()`` of the explained score (the reference, 1x);
- ``relevance``: ``lxmert_relevance`` / ``detr_relevance`` (one recorded forward, one
  ``torch.autograd.grad`` to the attention tensors, then :func:`propagate`);
- ``engine``: :func:`propagate` alone on the same events (the matrix products of eq. 5-11);
- ``raw`` / ``gradcam``: the baselines (one forward; one forward + a backward to the last
  cross-attention);
- DETR, K = 5: ``K x fwd+bwd``, the image repeated as 5 batch items and one backward: what
  explaining 5 queries costs done that way (``detr_relevance`` runs one forward and one
  backward vmapped over the 5 scores instead).

Goal: relevance at most ~1x one forward + one backward per batch, plus the engine.

Measured (2026-12-01, torch 2.14 CPU, ``--threads 1``, ``--repeats 5``, a 2-core machine
shared with other jobs, load ~5; median ms and median ratio to the round's fwd+bwd)::

    LXMERT (hidden 256, 9+5+5), batch 8     fwd+bwd   611 ms 1.00x   relevance  434 ms 0.71x
                                            engine      8 ms 0.01x   raw        222 ms 0.37x   gradcam  243 ms 0.39x
    DETR (DetrConfig()), 480x640, K = 1     fwd+bwd  3494 ms 1.00x   relevance 1397 ms 0.40x
                                            engine     23 ms 0.01x   raw       1174 ms 0.33x   gradcam 1229 ms 0.35x
    DETR (DetrConfig()), 480x640, K = 5     fwd+bwd  3278 ms 1.00x   relevance 2171 ms 0.66x
                                            engine    118 ms 0.04x   raw       1124 ms 0.34x   gradcam 1152 ms 0.35x
                                            K x fwd+bwd (image repeated 5 times)  18338 ms 5.49x

Reading: the relevance stays under one plain forward + backward (goal met), because its
backward is ``torch.autograd.grad`` to the attention tensors only: no weight gradient, and
it stops at the first encoder attention (DETR's ResNet-50, most of the plain backward, is
never entered). The engine's matrix products are 1-4% of it. Five DETR queries cost 1.6x one
query (the vmapped backward does five vector-Jacobian products of the transformer, the
forward runs once); repeating the image as five batch items would cost 5.5x the single
forward + backward, 8.4x the relevance of five queries done here.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import vitlab  # noqa: E402
from vitlab.relevance import (  # noqa: E402
    AttentionEvent,
    detr_gradcam,
    detr_raw_attention,
    detr_relevance,
    lxmert_gradcam,
    lxmert_raw_attention,
    lxmert_relevance,
    propagate,
)


def _time(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def run_rounds(variants: dict, repeats: int, reference: str = "fwd+bwd") -> dict[str, tuple[float, float]]:
    """``{name: (median seconds, median ratio to the reference of the same round)}``."""
    for fn in variants.values():  # warm-up
        fn()
    times = {name: [] for name in variants}
    for _ in range(repeats):
        for name, fn in variants.items():
            times[name].append(_time(fn))
    ref = times[reference]
    return {name: (statistics.median(ts), statistics.median(t / r for t, r in zip(ts, ref)))
            for name, ts in times.items()}


def engine_only(model, inputs: dict, score, steps_of, slots: int = 1) -> callable:
    """A function timing :func:`propagate` on the events of one recorded forward + backward
    (``slots`` > 1: each gradient repeated as K scores, the batch detr_relevance propagates)."""
    with vitlab.record(model, gradients=True, eval_mode=True, capture=("attention",)) as rec:
        score(model(**inputs)).backward()
    model.zero_grad(set_to_none=True)
    steps, sizes = steps_of(rec, slots)
    return lambda: propagate(steps, sizes)


def ev(cap, slots=1):
    A, G = cap.attention.detach(), cap.grad
    if slots > 1:
        A, G = A.expand(slots, *A.shape), G.expand(slots, *G.shape).contiguous()
    return AttentionEvent(cap.query_modality, cap.key_modality, A, G)


def detr_steps(rec, slots=1):
    steps = [ev(c, slots) for c in rec.stream("encoder")]
    for d, c in zip(rec.stream("decoder"), rec.stream("cross")):
        steps += [ev(d, slots), ev(c, slots)]
    return steps, {"image": rec.stream("cross")[0].attention.shape[-1], "queries": rec.stream("decoder")[0].attention.shape[-1]}


def lxmert_steps(rec, slots=1):
    steps = [ev(c) for c in rec.stream("lang") + rec.stream("vision")]
    for lv, vl, cl, cv in zip(*(rec.stream(s) for s in ("lang->vision", "vision->lang", "cross.lang", "cross.vision"))):
        steps += [(ev(lv), ev(vl)), ev(cl), ev(cv)]
    Nt, Nv = rec.stream("lang->vision")[0].attention.shape[-2:]
    return steps, {"lang": Nt, "vision": Nv}


def bench_detr(repeats: int) -> None:
    from transformers import DetrConfig, DetrForObjectDetection

    torch.manual_seed(0)
    model = DetrForObjectDetection(DetrConfig(use_pretrained_backbone=False)).eval()
    x = torch.randn(1, 3, 480, 640)
    for K in (1, 5):
        queries = list(range(0, 20 * K, 20))[:K]

        def score(out, queries=queries):
            return out.logits[0, queries, 1].sum()

        def plain():
            score(model(pixel_values=x)).backward()
            model.zero_grad(set_to_none=True)

        variants = {
            "fwd+bwd": plain,
            "relevance": lambda: detr_relevance(model, x, queries=queries),
            "engine": engine_only(model, dict(pixel_values=x), score, detr_steps, slots=K),
            "raw": lambda: detr_raw_attention(model, x, queries=queries),
            "gradcam": lambda: detr_gradcam(model, x, queries=queries),
        }
        if K > 1:
            xs = x.expand(K, -1, -1, -1)

            def repeated():
                out = model(pixel_values=xs)
                out.logits[torch.arange(K), queries, 1].sum().backward()
                model.zero_grad(set_to_none=True)

            variants["K x fwd+bwd"] = repeated
        report(f"DETR (DetrConfig()), 480x640, K={K}", run_rounds(variants, repeats))


def bench_lxmert(repeats: int, real: bool) -> None:
    from transformers import LxmertConfig, LxmertForQuestionAnswering

    torch.manual_seed(0)
    cfg = LxmertConfig() if real else LxmertConfig(hidden_size=256, num_attention_heads=4, intermediate_size=1024,
                                                   vocab_size=1000, num_qa_labels=100)
    model = LxmertForQuestionAnswering(cfg).eval()
    B = 8
    inputs = dict(input_ids=torch.randint(0, cfg.vocab_size, (B, 20)), attention_mask=torch.ones(B, 20, dtype=torch.long),
                  visual_feats=torch.randn(B, 36, 2048), visual_pos=torch.rand(B, 36, 4))

    def score(out):
        return out.question_answering_score[:, 3].sum()

    def plain():
        score(model(**inputs)).backward()
        model.zero_grad(set_to_none=True)

    variants = {
        "fwd+bwd": plain,
        "relevance": lambda: lxmert_relevance(model, inputs, target=3),
        "engine": engine_only(model, inputs, score, lxmert_steps),
        "raw": lambda: lxmert_raw_attention(model, inputs),
        "gradcam": lambda: lxmert_gradcam(model, inputs, target=3),
    }
    name = "LxmertConfig()" if real else "hidden 256"
    report(f"LXMERT ({name}, 9+5+5), batch {B}, 20+36", run_rounds(variants, repeats))


def report(label: str, r: dict[str, tuple[float, float]]) -> None:
    print(f"\n{label}")
    for name, (t, ratio) in r.items():
        print(f"    {name:<14}{t * 1e3:>10.1f} ms {ratio:>7.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--real-lxmert", action="store_true", help="LxmertConfig() itself (hidden 768), slower to build")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} threads, median of {args.repeats} interleaved rounds; "
          "ratio = time / plain forward + backward of the same round")
    bench_lxmert(args.repeats, args.real_lxmert)
    bench_detr(args.repeats)


if __name__ == "__main__":
    main()
