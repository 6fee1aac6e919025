"""Cost of the chapter-5 relevance (vitlab.relevance) over a plain forward + backward.

    python benchmarks/bench_relevance_multimodal.py [--repeats 5] [--threads 1] [--real-lxmert]
                                                    [--only shapes|real] [--batch 64]

Part 1, the chapter's models (``--only shapes``): ``shapes-lxmert`` (2/2/2 layers, random
heads, ``build_shapes_lxmert(dict(l_layers=2, r_layers=2, x_layers=2))``) and
``shapes-visualbert`` (``build_shapes_visualbert()``, 4 layers), both on the shipped frozen
``shapes-vit-tiny``, a batch of 64 generated questions about 112 x 112 scenes. Relevance of a
batch is one forward and one backward: printed are the forward calls of the model (a forward
hook on the model, here only) and the ``torch.autograd.grad`` / ``backward`` calls of one
``lxmert_relevance`` / ``visualbert_relevance`` call and of the per-question loop (each question
alone, 64 calls), and their cost as the median over rounds of paired ratios
(:func:`_timing.ratios_to_forward`: each call timed right after its reference on the
same batch) to a plain forward (``torch.no_grad()``) and to a forward + ``backward()`` of the
explained logits.

Part 2 (``--only real``), random-initialised real configurations, no download:

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

Measured, part 1 (2026-12-01, torch 2.14 CPU, ``--threads 1 --repeats 7``, the 2-core shared
machine at load 1.5-1.9; median of paired ratios)::

    shapes-lxmert (2/2/2), batch 64: forward 393 ms, forward + backward 485 ms
                                     forwards backwards  / forward  / fwd+bwd
        relevance (batch)                   1         1      1.28x      1.02x
        per-question loop (64 calls)       64        64      6.11x      4.49x
        forward + backward                  1         1      1.26x      1.00x
    shapes-visualbert (4 layers), batch 64: forward 355 ms, forward + backward 471 ms
        relevance (batch)                   1         1      1.21x      0.90x
        per-question loop (64 calls)       64        64      4.63x      3.72x
        forward + backward                  1         1      1.18x      1.00x

Reading: a batch's relevance is one forward and one backward, and costs what a plain forward +
backward of the logits costs (0.90-1.02x); the frozen ViT backbone, which both run forward
only, is most of the forward, hence only ~1.2-1.3x a plain forward. Explaining the 64
questions one at a time costs 3.7-4.5x the batch's forward + backward (64 small forwards).

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
import sys
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
    visualbert_relevance,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import median_ratios, print_forward_and_backward_ratios, stopwatch  # noqa: E402

_time = stopwatch("wall")


def run_rounds(variants: dict, repeats: int, reference: str = "fwd+bwd") -> dict[str, tuple[float, float]]:
    """``{name: (median seconds, median ratio to the reference of the same round)}``."""
    return median_ratios(variants, repeats, reference, _time)


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
            "relevance": lambda: detr_relevance(model, x, target=queries),
            "engine": engine_only(model, dict(pixel_values=x), score, detr_steps, slots=K),
            "raw": lambda: detr_raw_attention(model, x, target=queries),
            "gradcam": lambda: detr_gradcam(model, x, target=queries),
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


def shapes_batch(model, batch: int) -> dict:
    """``batch`` generated questions about two-object scenes (seeded), as the model's inputs."""
    from vitlab.shapes.data import make_scenes, scenes_to_tensor
    from vitlab.shapes.qa import make_questions

    scenes = make_scenes(batch, 0, 2)
    qs = make_questions(scenes, 0, per_scene=1)
    x = scenes_to_tensor(scenes.images[qs.scene], (3, 112, 112), (0.5,) * 3, (0.5,) * 3)
    ids, mask = model.encode(qs.text)
    return dict(input_ids=ids, attention_mask=mask, pixel_values=x)


def count_calls(model, fn) -> tuple[int, int]:
    """``(forward calls of model, torch.autograd.grad / backward calls)`` during ``fn()``."""
    forwards, backwards = [0], [0]
    handle = model.register_forward_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1))
    grad, backward = torch.autograd.grad, torch.autograd.backward

    def counted(f):
        def call(*a, **k):
            backwards[0] += 1
            return f(*a, **k)
        return call

    torch.autograd.grad, torch.autograd.backward = counted(grad), counted(backward)
    try:
        fn()
    finally:
        torch.autograd.grad, torch.autograd.backward = grad, backward
        handle.remove()
    return forwards[0], backwards[0]


def bench_shapes(repeats: int, batch: int) -> None:
    from vitlab.shapes.bimodal import build_shapes_lxmert
    from vitlab.shapes.visualbert import build_shapes_visualbert

    torch.manual_seed(0)
    models = {
        "shapes-lxmert (2/2/2, random)": (build_shapes_lxmert(dict(l_layers=2, r_layers=2, x_layers=2)).eval(),
                                          lxmert_relevance),
        "shapes-visualbert (4 layers, random)": (build_shapes_visualbert().eval(), visualbert_relevance),
    }
    for label, (model, method) in models.items():
        inputs = shapes_batch(model, batch)
        B = inputs["input_ids"].shape[0]
        with torch.no_grad():
            out = model(**inputs)
        logits_of = (lambda o: o.question_answering_score) if hasattr(out, "question_answering_score") \
            else (lambda o: o.logits)
        target = logits_of(out).argmax(-1)

        def forward():
            with torch.no_grad():
                model(**inputs)

        def forward_backward():
            logits_of(model(**inputs)).gather(1, target[:, None]).sum().backward()
            model.zero_grad(set_to_none=True)

        def relevance():
            method(model, inputs, target=target)

        def per_question():
            for b in range(B):
                method(model, {k: v[b : b + 1] for k, v in inputs.items()}, target=target[b : b + 1])

        calls = {"relevance (batch)": count_calls(model, relevance),
                 f"per-question loop ({B} calls)": count_calls(model, per_question),
                 "forward + backward": count_calls(model, forward_backward)}
        methods = {"relevance (batch)": relevance, f"per-question loop ({B} calls)": per_question,
                   "forward + backward": forward_backward}
        print_forward_and_backward_ratios(forward, forward_backward, methods, calls, repeats, _time, width=28,
                                          lead=f"\n{label}, batch {B}: ")


def report(label: str, r: dict[str, tuple[float, float]]) -> None:
    print(f"\n{label}")
    for name, (t, ratio) in r.items():
        print(f"    {name:<14}{t * 1e3:>10.1f} ms {ratio:>7.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--real-lxmert", action="store_true", help="LxmertConfig() itself (hidden 768), slower to build")
    ap.add_argument("--only", choices=("shapes", "real"), default=None, help="run one part only")
    ap.add_argument("--batch", type=int, default=64, help="questions per batch for the shapes models")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.only != "real":
        print(f"torch {torch.__version__}, {args.threads} threads, median of {args.repeats} rounds of paired "
              "ratios (each call / its reference timed just before it)")
        bench_shapes(args.repeats, args.batch)
    if args.only != "shapes":
        print(f"\ntorch {torch.__version__}, {args.threads} threads, median of {args.repeats} interleaved rounds; "
              "ratio = time / plain forward + backward of the same round")
        bench_lxmert(args.repeats, args.real_lxmert)
        bench_detr(args.repeats)


if __name__ == "__main__":
    main()
