"""Measure ``shapes-vit-tiny`` on held-out scenes: ``python -m vitlab.shapes.evaluate``.

Every figure is measured on ``--n`` (default 1,000) scenes at the evaluated difficulty (1.0),
from seeds that training never uses (training seeds start at 1,000,000):

1. single-object top-1 accuracy (seed :data:`SEED_SINGLE`);
2. two-object scenes (seed :data:`SEED_TWO`): the fraction where the two present classes are
   exactly the top-2; for a multi-label head also the fraction whose set of classes with
   probability > 0.5 is exactly the present pair;
3. do the two present classes get separate answers? The mean ``|logit_a - logit_b|`` of the
   two present classes, and what happens to a class's logit when one object is taken out of
   the scene (:func:`vitlab.shapes.remove_objects`: its pixels show the background that lay
   behind it): the drop when its *own* object goes versus when the *other* one goes, and how
   often the own object's removal costs more. For a multi-label head: how often removing the
   object switches its class off (probability < 0.5) and removing the other leaves it on;
4. class-specific explanations on the two-object scenes, each object asked for in turn
   (:func:`vitlab.relevance.asked_object_maps`): how often the top patch of Chefer relevance
   and of gradient rollout lies on the asked object (touch: any of its pixels; strict: at least
   half the patch) or on the other one, explaining the class's logit and its log-probability;
5. the pointing game of the last block's CLS attention, averaged over heads, on the
   single-object scenes: a hit when the patch with the highest attention lies on the object
   (contains at least one of its pixels). Printed with the same game played by a uniformly
   random patch (the chance level) and a stricter variant (at least half the patch is object).

Masks are used here, to grade; never in training.

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
from vitlab.localization import TOUCH, grade_asked, mask_to_grid
from vitlab.localization import pointing_game as pointing_game_on_grid
from vitlab.methods import display_names
from vitlab.relevance import asked_object_maps
from vitlab.shapes.data import make_scenes, remove_objects, scenes_to_tensor
from vitlab.targets import SCORES, is_multi_label

__all__ = [
    "ASKED_METHODS", "SEED_SINGLE", "SEED_TWO", "asked_object_pointing", "cls_attention_last", "evaluate",
    "pair_separation", "patch_object_fraction", "pointing_game", "removal_effect", "main",
]

#: The class-specific methods graded on asked objects (keys of ``asked_object_maps``): the display
#: names (:mod:`vitlab.methods`) of relevance and grad_rollout.
ASKED_METHODS = display_names("relevance", "grad_rollout")

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
    (:func:`vitlab.localization.pointing_game` with its ``TOUCH`` threshold).
    """
    threshold = min_fraction if min_fraction > 0 else TOUCH
    return pointing_game_on_grid(maps, masks, min_coverage=threshold).numpy()


def logits_of(model, x: torch.Tensor, batch: int) -> torch.Tensor:
    return torch.cat([model(x[i : i + batch]).float() for i in range(0, len(x), batch)])


def pair_separation(logits: torch.Tensor, labels: np.ndarray) -> dict:
    """How separately the two present classes of each scene are scored.

    ``logits``: ``n x C``; ``labels``: ``n x 2``. Returns the mean ``|logit_a - logit_b|`` of the
    present pair (``pair_logit_gap``) and the mean margin of the lower present logit over the
    highest absent one (``present_over_absent``).
    """
    lab = torch.as_tensor(np.asarray(labels), dtype=torch.long)
    pair = logits.gather(1, lab)
    absent = logits.clone()
    absent.scatter_(1, lab, float("-inf"))
    return {
        "pair_logit_gap": float((pair[:, 0] - pair[:, 1]).abs().mean()),
        "present_over_absent": float((pair.min(1).values - absent.max(1).values).mean()),
    }


@torch.no_grad()
def removal_effect(model, n: int, seed: int, difficulty: float = 1.0, batch: int = 100) -> dict:
    """What taking one object out of a two-object scene does to each present class's logit.

    For every scene and each of its two classes c (object j), with ``y`` the logits:
    ``own drop = y_c(scene) - y_c(scene without object j)`` and
    ``other drop = y_c(scene) - y_c(scene without the other object)``. Returns the means of
    both, ``own_larger`` (share of the 2n (scene, class) pairs whose own drop is the larger),
    and for a multi-label head ``switches_off`` (its probability falls below 0.5 without its
    object) and ``stays_on`` (it stays above 0.5 without the other object, having been above).
    """
    cfg = model.pretrained_cfg
    size = cfg["input_size"][1]
    s = make_scenes(n, seed, 2, difficulty=difficulty, size=size)
    lab = torch.as_tensor(s.labels)

    def scores(images):
        x = scenes_to_tensor(images, cfg["input_size"], cfg["mean"], cfg["std"])
        return logits_of(model, x, batch).gather(1, lab)             # n x 2: logits of the two classes

    full = scores(s.images)
    without = [scores(remove_objects(n, seed, 2, difficulty=difficulty, size=size, remove=j)) for j in (0, 1)]
    # own[:, j]: class j without object j; other[:, j]: class j without object 1 - j.
    own = torch.stack([without[0][:, 0], without[1][:, 1]], 1)
    other = torch.stack([without[1][:, 0], without[0][:, 1]], 1)
    own_drop, other_drop = full - own, full - other
    out = {
        "own_drop": float(own_drop.mean()),
        "other_drop": float(other_drop.mean()),
        "own_larger": float((own_drop > other_drop).float().mean()),
    }
    if is_multi_label(model):
        out["switches_off"] = float((torch.sigmoid(own) < 0.5).float().mean())
        on = torch.sigmoid(full) > 0.5
        out["stays_on"] = float(((torch.sigmoid(other) > 0.5) & on).float().sum() / on.float().sum().clamp_min(1))
    return out


def asked_object_pointing(model, x: torch.Tensor, labels, masks, batch: int = 100,
                          methods=ASKED_METHODS, scores=SCORES) -> dict:
    """Each object of each scene asked for in turn: where does each method's top patch land?

    Returns ``{score: {method: {"touch", "strict", "other", "all_asks"}}}``: the share of asks
    whose top patch touches the asked object, is at least half on it, is (at least half) on the
    other object, and of scenes where both asks hit their own object strictly
    (:func:`vitlab.localization.grade_asked`).
    """
    out = {}
    for score in scores:
        maps = asked_object_maps(model, x, labels, batch_size=batch, score=score)
        rows = grade_asked({m: maps[m] for m in methods}, masks, min_coverage=0.5)
        out[score] = {r["method"]: {"touch": r["asked_touch"], "strict": r["asked"], "other": r["other"],
                                    "all_asks": r["all_asks"]} for r in rows}
    return out


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
        pred1 = logits_of(model, x1, batch).argmax(1).numpy()
        out["single_top1"] = float((pred1 == one.labels[:, 0]).mean())

        two = make_scenes(n, SEED_TWO, 2, difficulty=difficulty, size=size)
        x2 = scenes_to_tensor(two.images, cfg["input_size"], mean, std)
        logits2 = logits_of(model, x2, batch)
        top2 = logits2.topk(2, dim=1).indices.numpy()
        both = np.sort(top2, 1) == np.sort(two.labels, 1)
        out["two_both_top2"] = float(both.all(1).mean())
        out["multi_label"] = is_multi_label(model)
        if out["multi_label"]:
            on = (torch.sigmoid(logits2) > 0.5).numpy()
            want = np.zeros_like(on)
            np.put_along_axis(want, two.labels, True, axis=1)
            out["two_exact_set"] = float((on == want).all(1).mean())
        out.update(pair_separation(logits2, two.labels))
        out["removal"] = removal_effect(model, n, SEED_TWO, difficulty, batch)

        maps = torch.cat([cls_attention_last(model, x1[i : i + batch]).float() for i in range(0, n, batch)]).numpy()
    out["asked"] = asked_object_pointing(model, x2, two.labels, two.masks, batch=batch)
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
    if res["multi_label"]:
        print(f"two-object scenes, exactly the pair has p > 0.5: {res['two_exact_set']:.1%}")
    print(f"the present pair's logits: mean |difference| {res['pair_logit_gap']:.2f}; "
          f"lower present minus highest absent {res['present_over_absent']:.2f}")
    r = res["removal"]
    line = (f"removing an object: a class's logit drops {r['own_drop']:.2f} without its own object, "
            f"{r['other_drop']:.2f} without the other; own drop larger in {r['own_larger']:.1%} of (scene, class) pairs")
    if "switches_off" in r:
        line += f"; p < 0.5 without its object {r['switches_off']:.1%}, stays > 0.5 without the other {r['stays_on']:.1%}"
    print(line)
    for score, per in res["asked"].items():
        for method, v in per.items():
            print(f"asked object, {method} of the {score.replace('_', '-')}: top patch touches it {v['touch']:.1%}, "
                  f">= half on it {v['strict']:.1%}, on the other object {v['other']:.1%}")
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
