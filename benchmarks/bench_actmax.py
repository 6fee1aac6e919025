"""Speed of activation maximisation: optimisation steps per second next to a plain
forward + backward of the same batch.

    python benchmarks/bench_actmax.py [--steps 10] [--repeats 3] [--threads 2] [--copies 8]

A step of ``vitlab.actmax.visualize`` renders the image from its parametrisation, makes
``copies`` randomly transformed copies (roll, colour jitter), runs the model inside
``vitlab.record`` (eager attention, MLP activations kept), evaluates the objective and
takes an Adam step. The plain reference runs the model as a user would (fused attention,
no hooks) on a batch of the same size and backpropagates the same kind of output to the
input. Overhead = 1 - plain / step: the fraction of a step spent on anything but the
model's forward and backward. Goal: at most 15%.

Random-initialised timm ``deit_tiny_patch16_224`` (the chapter's preferred model) and
``vit_small_patch14_dinov2`` at 224 px (the architecture of the embedded photo model), CPU
(and CUDA when available). Plain and optimised runs are interleaved and the median per
step is taken, so a busy machine affects both alike.
"""
from __future__ import annotations

import argparse
import statistics
import time

import timm
import torch

from vitlab import actmax


def plain_steps(model, x: torch.Tensor, steps: int, readout) -> float:
    """Seconds per forward + backward to the input of a batch like the optimiser's."""
    x = x.clone().requires_grad_(True)
    t0 = time.perf_counter()
    for _ in range(steps):
        out = model(x)
        (g,) = torch.autograd.grad(readout(out).sum(), x)
    if x.is_cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / steps


def actmax_steps(model, objective, steps: int, copies: int, param: str) -> float:
    """Seconds per optimisation step (setup amortised: one extra step measured and removed)."""
    def run(n):
        t0 = time.perf_counter()
        actmax.visualize(model, objective, steps=n, copies=copies, param=param, progress=False)
        if next(model.parameters()).is_cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    return (run(steps + 1) - run(1)) / steps


def bench(name: str, kwargs: dict, device: str, steps: int, repeats: int, copies: int):
    model = timm.create_model(name, pretrained=False, **kwargs).eval().to(device)
    size = model.patch_embed.img_size
    x = torch.rand(copies, 3, *size, device=device)
    depth = len(model.blocks)
    cases = [
        ("class logit, pixel" if model.num_classes else "last channel, pixel",
         actmax.class_logit(0) if model.num_classes else actmax.residual_channel(depth - 1, 0),
         (lambda out: out[:, 0]), "pixel"),
        (f"mlp[{depth - 1}] unit, fft", actmax.mlp_unit(depth - 1, 0), (lambda out: out[:, 0]), "fft"),
    ]
    rows = []
    for label, objective, readout, param in cases:
        plain_steps(model, x, 1, readout), actmax_steps(model, objective, 1, copies, param)  # warm-up
        tp, ta = [], []
        for _ in range(repeats):
            tp.append(plain_steps(model, x, steps, readout))
            ta.append(actmax_steps(model, objective, steps, copies, param))
        p, a = statistics.median(tp), statistics.median(ta)
        rows.append((label, p, a))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--copies", type=int, default=8, help="batch: jittered copies of one image")
    ap.add_argument("--models", default="deit_tiny_patch16_224,vit_small_patch14_dinov2",
                    help="comma-separated timm names (dinov2 models run at 224 px)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    print(f"torch {torch.__version__}, {args.threads} threads, batch {args.copies}, "
          f"{args.steps} steps, median of {args.repeats}")
    print(f"{'model':<26}{'device':>7}  {'objective':<22}{'plain step/s':>13}{'actmax step/s':>14}{'overhead':>10}")
    for name in args.models.split(","):
        kwargs = {"img_size": 224} if "dinov2" in name else {}
        for device in devices:
            for label, p, a in bench(name, kwargs, device, args.steps, args.repeats, args.copies):
                print(f"{name:<26}{device:>7}  {label:<22}{1 / p:>13.2f}{1 / a:>14.2f}{1 - p / a:>9.1%}")


if __name__ == "__main__":
    main()
