"""How far the LRP family run on a float32 model lies from the same methods on a float64 copy.

On held-out two-object scenes of ``shapes-vit-tiny`` (``make_scenes(N, SEED, 2)``, a seed used
nowhere else in vitlab), each method runs on the float32 model and on a float64 copy of it (the
input cast too); per scene the error is ``max |map32 - map64| / max |map64|``, in percent. Prints
per method and precision (:data:`vitlab.lrp.PRECISIONS`: ``"float64"``, the default of the
methods with Chefer's rules, runs a float64 copy of the model; ``"model"`` runs the float32
model itself) the largest error, the median, how many scenes exceed 2% and 10%, and the
seconds the float32-model calls took (process CPU time).

    python benchmarks/check_lrp_float32.py [--n 30] [--seed 29017] [--threads 1]
"""
from __future__ import annotations

import argparse
import copy
import time

import torch

from vitlab.lrp import attn_lrp, lrp, partial_lrp, transformer_attribution
from vitlab.shapes import load_shapes_vit, make_scenes, scenes_to_tensor

METHODS = {"lrp": lrp, "partial_lrp": partial_lrp, "transformer_attribution": transformer_attribution,
           "attn_lrp": attn_lrp}


def scene_errors(method, model32, model64, x: torch.Tensor, precision: str) -> tuple[torch.Tensor, float]:
    """Per scene, ``max |m32 - m64| / max |m64|`` in percent (float64), and the CPU seconds of
    the float32 model's call."""
    start = time.process_time()
    m32 = method(model32, x, precision=precision).double()
    seconds = time.process_time() - start
    m64 = method(model64, x.double())
    return 100 * (m32 - m64).flatten(1).abs().max(1).values / m64.flatten(1).abs().max(1).values, seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=30)
    parser.add_argument("--seed", type=int, default=29_017)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model = load_shapes_vit()
    cfg = model.pretrained_cfg
    scenes = make_scenes(args.n, args.seed, 2)
    x = scenes_to_tensor(scenes.images, cfg["input_size"], cfg["mean"], cfg["std"])
    model64 = copy.deepcopy(model).double()
    print(f"shapes-vit-tiny, {args.n} two-object scenes of seed {args.seed}: the float32 model against its "
          "float64 copy, max |difference| as % of the float64 map's max |value|")
    print(f"{'method':26s} {'precision':9s} {'max %':>9s} {'median %':>9s} {'> 2%':>5s} {'> 10%':>6s} {'cpu s':>6s}")
    for name, method in METHODS.items():
        for precision in ("float64", "model"):
            err, seconds = scene_errors(method, model, model64, x, precision)
            print(f"{name:26s} {precision:9s} {err.max().item():9.4f} {err.median().item():9.4f} "
                  f"{int((err > 2).sum()):5d} {int((err > 10).sum()):6d} {seconds:6.2f}")


if __name__ == "__main__":
    main()
