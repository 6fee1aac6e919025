"""How far the LRP family run on a float32 model lies from the same methods on its float64 copy.

On held-out two-object scenes of ``shapes-vit-tiny`` (``make_scenes(N, SEED, 2)``, seeds used
nowhere else in vitlab) and on random inputs to a random-initialised DeiT-tiny (timm
``deit_tiny_patch16_224``, no download), each method runs on the float32 model and on a float64
copy of it (the input cast too); per image the error is ``max |map32 - map64| / max |map64|``, in
percent. Printed per method and precision (:data:`vitlab.lrp.PRECISIONS`: ``"model"``, the
default, runs the float32 model itself; ``"float64"`` runs a float64 copy of it): the largest
error, the median, how many images exceed 2% and 10%, and the seconds the float32 model's calls
took (process CPU time).

Beside them, the conditioning of the float64 maps themselves: the same float64 model on the input
moved by one float32 rounding (each value times ``1 + 2^-24 n``, ``n`` standard normal), in the
same units. A float32 forward rounds every layer's output by at least that much, so where this
column is above 2% no float32 computation of the rules can be within 2% of the float64 map: the
map there is decided by a sum that nearly cancels (a stream entry ``h_d = a_d + b_d`` before a
LayerNorm, an attention score ``q·k``), whose terms' shares ``a_d / h_d`` the rules pass on.
Conservation: per image ``|tokens - start| / |start|`` of :func:`vitlab.lrp.lrp_conservation`
(Chefer's rules hand the whole start to the tokens).

Measured (``--threads 1``, defaults): the float64 map moved by one float32 rounding of the input,
full LRP, at most 22.9% (seed 29017), 1.84% (seed 80001), 16.6% (DeiT) of its maximum; the float32
model's full LRP against its float64 copy's at most 68.3%, 3825% and 337% (4, 8 and 6 images over
2%); Transformer attribution 12.2%, 2.36%, 0.14%; partial LRP 0.13%, 0.004%, 0.48%; AttnLRP 0.0003%
at most; ``precision="float64"`` 0.0000% everywhere. Conservation of the float32 model with Chefer's
rules: ``|tokens - start| / |start|`` at most 1.4e-6, 2.5e-6, 3.2e-6.

    python benchmarks/check_lrp_float32.py [--n 30] [--seeds 29017 80001] [--deit 8] [--threads 1]
"""
from __future__ import annotations

import argparse
import copy
import time

import timm
import torch

from vitlab.lrp import attn_lrp, lrp, lrp_conservation, partial_lrp, transformer_attribution
from vitlab.shapes import load_shapes_vit, make_scenes, scenes_to_tensor

METHODS = {"lrp": lrp, "partial_lrp": partial_lrp, "transformer_attribution": transformer_attribution,
           "attn_lrp": attn_lrp}


def relative(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per image ``100 * max |a - b| / max |b|`` (float64)."""
    a, b = a.double().flatten(1), b.double().flatten(1)
    return 100 * (a - b).abs().max(1).values / b.abs().max(1).values


def in_chunks(fn, x: torch.Tensor, size: int) -> torch.Tensor:
    return torch.cat([fn(c) for c in x.split(size)])


def report(title: str, model32, x: torch.Tensor, chunk: int, generator: torch.Generator) -> None:
    model64 = copy.deepcopy(model32).double()
    x64 = x.double()
    moved = x64 * (1 + 2.0 ** -24 * torch.randn(x.shape, generator=generator, dtype=torch.float64))
    print(title)
    print(f"  {'method':24s} {'precision':9s} {'max %':>9s} {'median %':>9s} {'> 2%':>5s} {'> 10%':>6s} {'cpu s':>6s}"
          f"   float64, input moved 2^-24: {'max %':>8s} {'median %':>9s} {'> 2%':>5s}")
    for name, method in METHODS.items():
        want = in_chunks(lambda c: method(model64, c), x64, chunk)
        cond = relative(in_chunks(lambda c: method(model64, c), moved, chunk), want)
        for precision in ("model", "float64"):
            start = time.process_time()
            got = in_chunks(lambda c: method(model32, c, precision=precision), x, chunk)
            seconds = time.process_time() - start
            err = relative(got, want)
            tail = (f"   {'':28s} {cond.max().item():8.4f} {cond.median().item():9.5f} {int((cond > 2).sum()):5d}"
                    if precision == "model" else "")
            print(f"  {name:24s} {precision:9s} {err.max().item():9.4f} {err.median().item():9.5f} "
                  f"{int((err > 2).sum()):5d} {int((err > 10).sum()):6d} {seconds:6.2f}{tail}")
    for rules in ("chefer", "attnlrp"):
        c = in_chunks(lambda t: torch.stack(list(lrp_conservation(model32, t, rules=rules).values()), 1), x, chunk)
        keys = list(lrp_conservation(model32, x[:1], rules=rules))
        start, tokens = c[:, keys.index("start")].double(), c[:, keys.index("tokens")].double()
        gap = (tokens - start).abs() / start.abs()
        kept = "whole start expected" if rules == "chefer" else "biases and the softmax keep a share"
        print(f"  conservation, float32 model, {rules:8s}: |tokens - start| / |start| max {gap.max().item():.2e}, "
              f"median {gap.median().item():.2e} ({kept})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=30)
    parser.add_argument("--seeds", type=int, nargs="+", default=[29_017, 80_001])
    parser.add_argument("--deit", type=int, default=8, help="random inputs to a random DeiT-tiny (0: none)")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    generator = torch.Generator().manual_seed(0)
    model = load_shapes_vit()
    cfg = model.pretrained_cfg
    for seed in args.seeds:
        scenes = make_scenes(args.n, seed, 2)
        x = scenes_to_tensor(scenes.images, cfg["input_size"], cfg["mean"], cfg["std"])
        report(f"shapes-vit-tiny, {args.n} two-object scenes of seed {seed}: the float32 model against its float64 "
               "copy, max |difference| as % of the float64 map's max |value|", model, x, 10, generator)
    if args.deit:
        torch.manual_seed(0)
        deit = timm.create_model("deit_tiny_patch16_224", pretrained=False).eval()
        x = torch.randn(args.deit, 3, 224, 224, generator=generator)
        report(f"deit_tiny_patch16_224 (random init), {args.deit} random inputs", deit, x, 4, generator)


if __name__ == "__main__":
    main()
