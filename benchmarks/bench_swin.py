"""Cost of explaining a Swin transformer: Chefer relevance through the windows and stages
(:func:`vitlab.hierarchical.swin_relevance`) for a batch, next to a plain forward of the same
batch.

    python benchmarks/bench_swin.py [--batch 32] [--repeats 7] [--threads 2] [--record]

The plain reference runs the model as a user would (``torch.no_grad()``, eval mode, no hooks).
Relevance runs one recorded forward, one backward to the attention and the propagation through
the stages; rollout one recorded forward and the propagation; "forward + backward" is the plain
forward with a backward of the summed target logits to the input (what any gradient method
pays). Runs are interleaved and the median per call taken, so a busy machine affects all alike.
Goal: relevance at most 3x the plain forward.

The model is the embedded ``shapes-swin`` (random-initialised with ``--random``) on held-out
shapes scenes. ``--record`` stores the result under ``"benchmark"`` in ``shapes-swin.json``, from
which ``python -m vitlab.shapes.evaluate_swin`` writes the model card.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from vitlab.hierarchical import swin_relevance, swin_rollout
from vitlab.shapes.data import make_scenes, scenes_to_tensor
from vitlab.shapes.swin_model import SWIN_PATH, load_shapes_swin


def _time(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--random", action="store_true", help="random-initialised weights (no weights file needed)")
    p.add_argument("--record", action="store_true", help="store the result in shapes-swin.json")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = load_shapes_swin(pretrained=not args.random)
    cfg = model.pretrained_cfg
    s = make_scenes(args.batch, 5, 2, size=cfg["input_size"][1])
    x = scenes_to_tensor(s.images, cfg["input_size"], cfg["mean"], cfg["std"])
    target = torch.as_tensor(s.labels[:, 0])

    def plain():
        with torch.no_grad():
            model(x)

    def fwd_bwd():
        xi = x.clone().requires_grad_(True)
        torch.autograd.grad(model(xi).gather(1, target[:, None]).sum(), xi)

    cases = {"plain": plain, "relevance": lambda: swin_relevance(model, x, target),
             "rollout": lambda: swin_rollout(model, x), "forward_backward": fwd_bwd}
    for fn in cases.values():  # warm-up
        fn()
    times = {k: [] for k in cases}
    for _ in range(args.repeats):
        for k, fn in cases.items():
            times[k].append(_time(fn))
    med = {k: statistics.median(v) for k, v in times.items()}
    result = {"batch": args.batch, "threads": args.threads, "repeats": args.repeats,
              "seconds": {k: round(v, 4) for k, v in med.items()},
              "ratio_relevance": med["relevance"] / med["plain"], "ratio_rollout": med["rollout"] / med["plain"],
              "ratio_forward_backward": med["forward_backward"] / med["plain"]}
    print(f"plain forward of {args.batch}: {1000 * med['plain']:.1f} ms")
    for k in ("relevance", "rollout", "forward_backward"):
        print(f"{k:>17}: {1000 * med[k]:.1f} ms = {med[k] / med['plain']:.2f}x the plain forward")
    print(f"goal: relevance <= 3x -> {'met' if result['ratio_relevance'] <= 3 else 'NOT met'}")
    if args.record:
        path = SWIN_PATH.with_suffix(".json")
        report = json.loads(path.read_text())
        report["benchmark"] = result
        path.write_text(json.dumps(report, indent=1))
        print(f"stored in {path}")
    return result


if __name__ == "__main__":
    main()
