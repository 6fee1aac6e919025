"""Train ``shapes-vit-tiny`` from scratch on freshly generated scenes: ``python -m vitlab.shapes.train``.

Recipe (see ``vitlab/weights/shapes-vit-tiny.md`` for the reasons and the measured numbers):

- data: an endless stream of new :func:`vitlab.shapes.make_scenes` scenes (no scene is seen
  twice, so no augmentation is needed), a share of them with two objects; the background
  difficulty follows a curriculum from plain to the evaluated clutter;
- labels only: a multi-label head, one sigmoid per class, trained with binary cross-entropy
  on multi-hot labels (1 for each class in the scene, 0 for the others), so every logit answers
  "is this shape here?" on its own and rises with its own object, not with the other one
  (``--loss softmax`` gives the earlier recipe: softmax cross-entropy against one-hot / half-half
  targets, which ties the two present classes' logits). ``--smoothing`` smooths the targets
  (off by default: it caps the model's confidence). The masks are never read;
- optimisation: AdamW, linear warmup then cosine decay, gradient clipping, bf16 autocast on CPU.

Training seeds are ``TRAIN_SEED_BASE + ...`` (>= 1,000,000), disjoint from the validation and
evaluation seeds in :mod:`vitlab.shapes.evaluate`. Nothing is selected on validation: the
weights written are those after the last step.
"""
from __future__ import annotations

import argparse
import json
import math
import platform
import shlex
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from vitlab.shapes.data import CLASSES, make_scenes, scenes_to_tensor
from vitlab.shapes.model import DEFAULT_CONFIG, MEAN, STD, STEMS, WEIGHTS_PATH, ShapesViTConfig, build_shapes_vit, save_shapes_vit

__all__ = [
    "LOSSES", "TRAIN_SEED_BASE", "VAL_SEED", "curriculum_difficulty", "loss_fn", "main", "multi_hot_targets",
    "scene_batches", "soft_targets", "train",
]

#: Training losses: "bce" (multi-label head, the shipped recipe) or "softmax" (the earlier one).
LOSSES = ("bce", "softmax")

#: Training scenes use seeds from here on; evaluation and validation seeds are far below.
TRAIN_SEED_BASE = 1_000_000
#: Seed of the small validation set logged during training (labels only).
VAL_SEED = 900


def curriculum_difficulty(progress: float, rng: np.random.Generator, ramp: float) -> float:
    """Background difficulty for a group of training scenes at ``progress`` in [0, 1].

    The ceiling rises linearly from 0.15 to 1 over the first ``ramp`` of training; a group is
    drawn at the ceiling half of the time and uniformly below it otherwise, so plain scenes
    keep appearing while the evaluated difficulty (1.0) dominates the later steps.
    """
    ceiling = 1.0 if ramp <= 0 else min(1.0, 0.15 + 0.85 * progress / ramp)
    return ceiling if rng.random() < 0.5 else float(rng.uniform(0.0, ceiling))


def soft_targets(labels: np.ndarray, num_classes: int, smoothing: float) -> torch.Tensor:
    """``n x K`` target distributions: mass split equally over each scene's classes, smoothed."""
    labels = torch.as_tensor(labels)
    n, m = labels.shape
    t = torch.zeros(n, num_classes)
    t.scatter_add_(1, labels, torch.full((n, m), 1.0 / m))
    return t * (1.0 - smoothing) + smoothing / num_classes


def multi_hot_targets(labels: np.ndarray, num_classes: int, smoothing: float) -> torch.Tensor:
    """``n x K`` multi-hot targets: 1 for every class in the scene, 0 for the others.

    With ``smoothing`` s the targets become ``1 - s / 2`` and ``s / 2`` (each binary label is
    smoothed towards 0.5).
    """
    labels = torch.as_tensor(labels)
    t = torch.zeros(labels.shape[0], num_classes)
    t.scatter_(1, labels, 1.0)
    return t * (1.0 - smoothing) + smoothing / 2


def loss_fn(logits: torch.Tensor, target: torch.Tensor, loss: str) -> torch.Tensor:
    """Mean training loss of a batch: per-class binary cross-entropy summed over the classes
    ("bce"), or cross-entropy against the soft target distribution ("softmax")."""
    logits = logits.float()
    if loss == "bce":
        return F.binary_cross_entropy_with_logits(logits, target, reduction="none").sum(1).mean()
    if loss == "softmax":
        return torch.sum(-target * F.log_softmax(logits, dim=1), dim=1).mean()
    raise ValueError(f"loss must be one of {LOSSES}, got {loss!r}")


def scene_batches(*, steps, batch, chunk, two_frac, ramp, seed, size, smoothing, groups=4, loss="bce"):
    """Yield ``(x, target, labels_list)`` training batches from freshly generated scene chunks.

    Each chunk of ``chunk`` scenes is made of ``groups`` groups, each drawn at its own curriculum
    difficulty; a fraction ``two_frac`` of every group has two objects. Chunks are shuffled.
    """
    rng = np.random.default_rng([seed, 7])
    total = steps * batch
    made = 0
    c = 0
    while made < total:
        imgs, labs = [], []
        per_group = max(1, chunk // groups)
        for g in range(groups):
            d = curriculum_difficulty(made / total, rng, ramp)
            n_two = int(round(per_group * two_frac))
            n_one = per_group - n_two
            base = TRAIN_SEED_BASE + seed * 100_000_000 + c * groups + g
            for n_obj, n_g in ((1, n_one), (2, n_two)):
                if n_g > 0:
                    s = make_scenes(n_g, base, n_obj, difficulty=d, size=size)
                    imgs.append(s.images)
                    labs.extend(list(row) for row in s.labels)
        images = np.concatenate(imgs)
        order = rng.permutation(len(images))
        images = images[order]
        labs = [labs[i] for i in order]
        for i in range(0, len(images) - batch + 1, batch):
            if made >= total:
                return
            lb = labs[i : i + batch]
            x = scenes_to_tensor(images[i : i + batch], (3, size, size), MEAN, STD)
            make_t = multi_hot_targets if loss == "bce" else soft_targets
            t = torch.stack([make_t(np.array([l]), len(CLASSES), smoothing)[0] for l in lb])
            made += batch
            yield x, t, lb
        c += 1


def _param_groups(model, weight_decay):
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.ndim <= 1 or name in ("pos_embed", "cls_token"):
            no_decay.append(p)
        else:
            decay.append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def _correct(logits: torch.Tensor, labels: list[list[int]]) -> tuple[int, int]:
    """Counts in a batch: single-object scenes right at top-1, two-object scenes with both classes in the top-2."""
    top2 = logits.topk(2, dim=1).indices.tolist()
    one = sum(1 for l, t in zip(labels, top2) if len(l) == 1 and t[0] == l[0])
    two = sum(1 for l, t in zip(labels, top2) if len(l) == 2 and set(t) == set(l))
    return one, two


@torch.no_grad()
def validate(model, size: int, n: int = 256, bf16: bool = True, device: str | torch.device = "cpu") -> dict:
    """Label accuracy on fixed validation scenes at the evaluated difficulty (for logging only)."""
    was_training = model.training
    model.eval()
    out = {}
    for n_obj in (1, 2):
        s = make_scenes(n, VAL_SEED + n_obj, n_obj, size=size)
        x = scenes_to_tensor(s.images, (3, size, size), MEAN, STD).to(device)
        logits = []
        for i in range(0, n, 128):
            with torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=bf16):
                logits.append(model(x[i : i + 128]).float())
        logits = torch.cat(logits).cpu()
        one, two = _correct(logits, s.labels.tolist())
        out["val_top1" if n_obj == 1 else "val_both_top2"] = (one if n_obj == 1 else two) / n
        if n_obj == 2:
            pair = logits.gather(1, torch.as_tensor(s.labels))
            out["val_pair_gap"] = float((pair[:, 0] - pair[:, 1]).abs().mean())
    model.train(was_training)
    return out


def train(args) -> dict:
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    cfg = ShapesViTConfig(
        img_size=args.img_size, patch_size=args.patch_size, depth=args.depth, stem=args.stem,
        multi_label=args.loss == "bce",
    )
    device = torch.device(args.device)
    model = build_shapes_vit(cfg)
    if cfg.multi_label:
        # Start every sigmoid at the rate a class is present (1.5 classes in 8 per scene when
        # half the scenes hold two), so the first steps are not spent learning "mostly absent".
        prior = (1 + args.two_frac) / len(CLASSES)
        with torch.no_grad():
            model.head.bias.fill_(math.log(prior / (1 - prior)))
    model = model.to(device).train()
    opt = torch.optim.AdamW(_param_groups(model, args.weight_decay), lr=args.lr, betas=(0.9, 0.999))
    warmup = max(1, int(args.warmup * args.steps))

    def lr_factor(step):
        if step < warmup:
            return (step + 1) / warmup
        p = (step - warmup) / max(1, args.steps - warmup)
        return args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * p))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)
    batches = scene_batches(
        steps=args.steps, batch=args.batch, chunk=args.chunk, two_frac=args.two_frac, ramp=args.ramp,
        seed=args.seed, size=args.img_size, smoothing=args.smoothing, loss=args.loss,
    )
    try:
        from tqdm.auto import tqdm
    except ImportError:  # pragma: no cover - tqdm is a dependency
        tqdm = None
    bar = tqdm(total=args.steps, desc="train shapes-vit", mininterval=5.0, disable=args.no_progress) if tqdm else None
    log = print if bar is None else bar.write
    history = []
    ema_loss, win = None, {"one": 0, "n_one": 0, "two": 0, "n_two": 0}
    t0 = time.time()
    for step, (x, target, lb) in enumerate(batches):
        x, target = x.to(device, non_blocking=True), target.to(device, non_blocking=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.bf16):
            logits = model(x)
        loss = loss_fn(logits, target, args.loss)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        opt.step()
        sched.step()
        lv = loss.item()
        ema_loss = lv if ema_loss is None else 0.98 * ema_loss + 0.02 * lv
        one, two = _correct(logits.detach().float().cpu(), lb)
        win["one"] += one
        win["two"] += two
        win["n_one"] += sum(len(l) == 1 for l in lb)
        win["n_two"] += sum(len(l) == 2 for l in lb)
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{ema_loss:.3f}", lr=f"{sched.get_last_lr()[0]:.2e}", refresh=False)
        last = step + 1 == args.steps
        if (step + 1) % args.log_every == 0 or last:
            rec = {
                "step": step + 1,
                "scenes": (step + 1) * args.batch,
                "minutes": round((time.time() - t0) / 60, 2),
                "loss": round(ema_loss, 4),
                "train_top1": round(win["one"] / max(1, win["n_one"]), 4),
                "train_both_top2": round(win["two"] / max(1, win["n_two"]), 4),
                "lr": sched.get_last_lr()[0],
            }
            if args.val_every and ((step + 1) % args.val_every == 0 or last):
                rec.update({k: round(v, 4) for k, v in validate(model, args.img_size, bf16=args.bf16, device=device).items()})
            history.append(rec)
            log(json.dumps(rec))
            sys.stdout.flush()
            win = {"one": 0, "n_one": 0, "two": 0, "n_two": 0}
        if args.checkpoint and args.checkpoint_every and (step + 1) % args.checkpoint_every == 0 and not last:
            save_shapes_vit(model, args.checkpoint, extra={"checkpoint_step": step + 1})
    if bar is not None:
        bar.close()
    minutes = (time.time() - t0) / 60
    model.eval().cpu()
    info = {
        "command": "python -m vitlab.shapes.train " + " ".join(shlex.quote(a) for a in args.argv),
        "seed": args.seed,
        "steps": args.steps,
        "batch": args.batch,
        "scenes_seen": args.steps * args.batch,
        "loss": args.loss,
        "train_minutes": round(minutes, 2),
        "threads": args.threads,
        "device": str(device),
        "torch": torch.__version__,
        "machine": platform.processor() or platform.machine(),
        "final": history[-1] if history else {},
    }
    if args.out:
        save_shapes_vit(model, args.out, extra={"training": info})
        log(f"wrote {args.out} ({Path(args.out).stat().st_size / 1e6:.1f} MB) after {minutes:.1f} min")
    if args.history:
        Path(args.history).parent.mkdir(parents=True, exist_ok=True)
        Path(args.history).write_text(json.dumps({"training": info, "history": history}, indent=1))
    return {"model": model, "history": history, "info": info}


def parse_args(argv=None):
    d = DEFAULT_CONFIG
    p = argparse.ArgumentParser(prog="python -m vitlab.shapes.train", description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(WEIGHTS_PATH), help="where to write the safetensors weights ('' to skip)")
    p.add_argument("--steps", type=int, default=12000, help="optimiser steps")
    p.add_argument("--quick", action="store_true", help="smoke test: 30 steps of 16 scenes, tiny chunks, no file written unless --out given explicitly")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=5e-4, help="peak learning rate")
    p.add_argument("--min-lr-ratio", type=float, default=0.01, help="final lr as a fraction of the peak")
    p.add_argument("--warmup", type=float, default=0.05, help="warmup, as a fraction of the steps")
    p.add_argument("--weight-decay", type=float, default=0.05)
    p.add_argument("--loss", choices=LOSSES, default="bce",
                   help="bce: multi-label head, binary cross-entropy per class (default); softmax: the earlier softmax head")
    p.add_argument("--smoothing", type=float, default=0.0, help="label smoothing")
    p.add_argument("--clip", type=float, default=1.0, help="gradient norm clip")
    p.add_argument("--two-frac", type=float, default=0.5, help="share of two-object scenes")
    p.add_argument("--ramp", type=float, default=0.3, help="curriculum: fraction of training to reach full clutter")
    p.add_argument("--chunk", type=int, default=1024, help="scenes generated at a time")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--img-size", type=int, default=d.img_size)
    p.add_argument("--patch-size", type=int, default=d.patch_size)
    p.add_argument("--depth", type=int, default=d.depth)
    p.add_argument("--stem", choices=STEMS, default=d.stem)
    p.add_argument("--threads", type=int, default=2, help="CPU threads (one is faster on a busy machine)")
    p.add_argument("--device", default="cpu", help="torch device to train on, e.g. cuda (scenes are still drawn on the CPU)")
    p.add_argument("--no-bf16", dest="bf16", action="store_false", help="train in fp32 (slower on CPU)")
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--val-every", type=int, default=200, help="log validation label accuracy (0: never)")
    p.add_argument("--checkpoint", default="", help="also save intermediate weights here")
    p.add_argument("--checkpoint-every", type=int, default=1000)
    p.add_argument("--history", default="", help="write the logged history as JSON here")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    argv = list(sys.argv[1:] if argv is None else argv)
    args = p.parse_args(argv)
    args.argv = argv
    if args.quick:
        args.steps, args.batch, args.chunk = min(args.steps, 30), 16, 64
        args.log_every, args.val_every = 10, 0
        if "--out" not in argv:
            args.out = ""
    if args.steps < 1 or args.batch < 1:
        p.error("--steps and --batch must be positive")
    return args


def main(argv=None):
    train(parse_args(argv))


if __name__ == "__main__":
    main()
