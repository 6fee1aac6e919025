"""Measure ``shapes-vit-tiny`` on held-out scenes: ``python -m vitlab.shapes.evaluate``.

Prints three figures, each on ``--n`` (default 1,000) scenes at the evaluated difficulty (1.0),
from seeds that training never uses (training seeds start at 1,000,000):

1. single-object top-1 accuracy (seed :data:`SEED_SINGLE`);
2. two-object scenes: the fraction where the two present classes are exactly the top-2
   (seed :data:`SEED_TWO`);
3. the pointing game of the last block's CLS attention, averaged over heads, on the
   single-object scenes: a hit when the patch with the highest attention lies on the object
   (contains at least one of its pixels). Printed with the same game played by a uniformly
   random patch (the chance level) and a stricter variant (at least half the patch is object).

The CLS attention is :func:`vitlab.attention.raw_attention` (read by :mod:`vitlab.record`);
the tests check it against a hand-written recomputation of the last timm ``Block``.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

from vitlab.attention import raw_attention
from vitlab.faithfulness import TOUCH, mask_to_grid
from vitlab.faithfulness import pointing_game as pointing_game_on_grid
from vitlab.shapes.data import make_scenes, scenes_to_tensor

__all__ = ["SEED_SINGLE", "SEED_TWO", "cls_attention_last", "evaluate", "patch_object_fraction", "pointing_game", "main"]

SEED_SINGLE = 1
SEED_TWO = 2


@torch.no_grad()
def cls_attention_last(model, x: torch.Tensor) -> torch.Tensor:
    """Last block's attention from the CLS token to the patches, mean over heads: ``B x gh x gw``."""
    return raw_attention(model, x)


def patch_object_fraction(masks: np.ndarray, grid: tuple[int, int]) -> np.ndarray:
    """Fraction of each patch's pixels covered by the mask: ``n x H x W`` bool -> ``n x gh x gw``."""
    return mask_to_grid(masks, grid).numpy()


def pointing_game(maps: np.ndarray, masks: np.ndarray, min_fraction: float = 0.0) -> np.ndarray:
    """Per scene: does the highest-scoring patch of ``maps`` (``n x gh x gw``) lie on the object?

    "Lies on" means at least ``min_fraction`` of the patch's pixels belong to the mask
    (``n x H x W``); with the default 0, any object pixel in the patch counts
    (:func:`vitlab.faithfulness.pointing_game` with its ``TOUCH`` threshold).
    """
    threshold = min_fraction if min_fraction > 0 else TOUCH
    return pointing_game_on_grid(maps, masks, min_coverage=threshold).numpy()


def _logits(model, x: torch.Tensor, batch: int) -> torch.Tensor:
    return torch.cat([model(x[i : i + batch]).float() for i in range(0, len(x), batch)])


@torch.no_grad()
def evaluate(model, n: int = 1000, batch: int = 100, difficulty: float = 1.0, bf16: bool = False) -> dict:
    """All evaluation figures for ``model`` (a shapes ViT) as a dict (run in eval mode; the
    model's own mode is restored afterwards)."""
    was_training = model.training
    model.eval()
    try:
        return _evaluate(model, n, batch, difficulty, bf16)
    finally:
        model.train(was_training)


def _evaluate(model, n: int, batch: int, difficulty: float, bf16: bool) -> dict:
    cfg = model.pretrained_cfg
    size = cfg["input_size"][1]
    mean, std = cfg["mean"], cfg["std"]
    out: dict = {"n": n, "difficulty": difficulty, "seed_single": SEED_SINGLE, "seed_two": SEED_TWO}
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        one = make_scenes(n, SEED_SINGLE, 1, difficulty=difficulty, size=size)
        x1 = scenes_to_tensor(one.images, cfg["input_size"], mean, std)
        pred1 = _logits(model, x1, batch).argmax(1).numpy()
        out["single_top1"] = float((pred1 == one.labels[:, 0]).mean())

        two = make_scenes(n, SEED_TWO, 2, difficulty=difficulty, size=size)
        x2 = scenes_to_tensor(two.images, cfg["input_size"], mean, std)
        top2 = _logits(model, x2, batch).topk(2, dim=1).indices.numpy()
        both = np.sort(top2, 1) == np.sort(two.labels, 1)
        out["two_both_top2"] = float(both.all(1).mean())

        maps = torch.cat([cls_attention_last(model, x1[i : i + batch]).float() for i in range(0, n, batch)]).numpy()
    masks = one.masks[:, 0]
    out["pointing_cls_attention"] = float(pointing_game(maps, masks).mean())
    out["pointing_cls_attention_half_patch"] = float(pointing_game(maps, masks, min_fraction=0.5).mean())
    frac = patch_object_fraction(masks, maps.shape[1:])
    out["pointing_random_patch"] = float((frac > 0).mean(axis=(1, 2)).mean())
    out["grid"] = list(maps.shape[1:])
    return out


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m vitlab.shapes.evaluate", description=__doc__.splitlines()[0])
    p.add_argument("--weights", default=None, help="safetensors file (default: the shipped shapes-vit-tiny)")
    p.add_argument("--n", type=int, default=1000, help="scenes per figure")
    p.add_argument("--difficulty", type=float, default=1.0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", default="", help="also write the figures as JSON here")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    from vitlab.shapes.model import load_shapes_vit

    t0 = time.time()
    model = load_shapes_vit(True, weights_path=args.weights)
    res = evaluate(model, n=args.n, difficulty=args.difficulty)
    res["eval_seconds"] = round(time.time() - t0, 1)
    print(f"shapes-vit-tiny on {args.n} held-out scenes per figure (difficulty {args.difficulty}, seeds {SEED_SINGLE}/{SEED_TWO})")
    print(f"single-object top-1 accuracy:            {res['single_top1']:.1%}")
    print(f"two-object scenes, both classes in top-2: {res['two_both_top2']:.1%}")
    gh, gw = res["grid"]
    print(
        f"pointing game, last-layer CLS attention (mean over heads, {gh}x{gw} patches): "
        f"{res['pointing_cls_attention']:.1%}  (random patch: {res['pointing_random_patch']:.1%}; "
        f">= half the patch on the object: {res['pointing_cls_attention_half_patch']:.1%})"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1) + "\n")
    sys.stdout.flush()
    return res


if __name__ == "__main__":
    main()
