"""Train ``shapes-swin`` from scratch on freshly generated scenes: ``python -m vitlab.shapes.train_swin``.

The recipe is ``shapes-vit-tiny``'s (:mod:`vitlab.shapes.train`), applied to a small timm Swin
transformer (:mod:`vitlab.shapes.swin_model`):

- data: the same endless stream of new scenes (:func:`vitlab.shapes.train.scene_batches`: a
  share with two objects, the background difficulty following the same curriculum from plain to
  the evaluated clutter; seeds >= 1,000,000, disjoint from every evaluation seed);
- labels only: the multi-label head, one sigmoid per class, binary cross-entropy on multi-hot
  labels summed over the classes, the head's biases starting at the log-odds of a class being
  present; the masks are never read;
- optimisation (:mod:`vitlab.shapes.train_loop`): AdamW (weight decay on matrices only), linear
  warmup then cosine decay, gradient-norm clipping; bf16 autocast on the CPU;
- a wall-clock budget (``--minutes``, default 24): the learning-rate schedule and the stop follow
  whichever is further along, the steps (``step / --steps``) or the clock (``elapsed / --minutes``),
  so a run on a machine shared with other jobs still ends on time with its learning rate annealed
  (it then stops before ``--steps``; the report says at which step). ``--minutes 0``: steps only.

Nothing is selected on validation: the weights written are those after the last step. At the
end the model is measured on held-out scenes (:func:`evaluate`: label accuracy with Wilson
intervals) and the report (history + evaluation) is written next to the weights.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict

import torch

from vitlab.stats import rate
from vitlab.shapes import train_loop
from vitlab.shapes.data import CLASSES, make_scenes, scenes_to_tensor
from vitlab.shapes.model import MEAN, STD
from vitlab.shapes.swin_model import DEFAULT_SWIN_CONFIG, SWIN_PATH, ShapesSwinConfig, build_shapes_swin, save_shapes_swin
from vitlab.shapes.train import loss_fn as _bce_loss
from vitlab.shapes.train import scene_batches, validate

__all__ = ["EVAL_SEED_SINGLE", "EVAL_SEED_TWO", "evaluate", "main", "recipe", "train"]

#: Held-out scenes of the accuracy figures (the seeds of ``python -m vitlab.shapes.evaluate``).
EVAL_SEED_SINGLE = 1
EVAL_SEED_TWO = 2


@torch.no_grad()
def evaluate(model, n: int = 1000, batch: int = 100) -> dict:
    """Label accuracy on ``n`` held-out single-object scenes (top-1, seed 1) and ``n`` two-object
    scenes (both present classes are the top-2, and exactly they have p > 0.5; seed 2), at the
    evaluated difficulty, each with its 95% Wilson interval ``[value, low, high, n]``."""
    model.eval()
    size = model.shapes_config.img_size
    out = {}
    for n_obj, seed in ((1, EVAL_SEED_SINGLE), (2, EVAL_SEED_TWO)):
        s = make_scenes(n, seed, n_obj, size=size)
        x = scenes_to_tensor(s.images, (3, size, size), MEAN, STD)
        logits = torch.cat([model(x[i:i + batch]).float() for i in range(0, n, batch)])
        labels = torch.as_tensor(s.labels)
        if n_obj == 1:
            out["single_top1"] = list(rate(logits.argmax(1) == labels[:, 0]))
        else:
            top2 = logits.topk(2, dim=1).indices.sort(1).values
            out["two_both_top2"] = list(rate((top2 == labels.sort(1).values).all(1)))
            present = torch.zeros_like(logits, dtype=torch.bool).scatter_(1, labels, True)
            out["two_exact_set"] = list(rate(((logits > 0) == present).all(1)))
    out["seeds"] = {"single": EVAL_SEED_SINGLE, "two": EVAL_SEED_TWO}
    return out


def _parser():
    p = train_loop.parser(
        "python -m vitlab.shapes.train_swin", __doc__, out=SWIN_PATH, steps=10000, batch=32, lr=5e-4,
        weight_decay=0.05, val_n=256, eval_n=1000, chunk=1024, arch_example='{"embed_dim": 32}')
    p.add_argument("--two-frac", type=float, default=0.5, help="share of two-object scenes")
    p.add_argument("--ramp", type=float, default=0.3, help="curriculum: fraction of training to reach full clutter")
    p.add_argument("--no-bf16", dest="bf16", action="store_false", help="train in fp32 (slower on CPU)")
    p.add_argument("--minutes", type=float, default=24.0,
                   help="wall-clock budget: schedule and stop follow steps or clock, whichever is further (0: steps only)")
    return p


def recipe(argv) -> dict:
    """Every option of a training command line (``argv``: its arguments after the module name),
    defaults filled in: what the model card reads its recipe from."""
    return vars(_parser().parse_args(list(argv)))


def train(argv=None) -> dict:
    p = _parser()
    args = train_loop.parse(p, argv, quick=dict(steps=20, batch=16, chunk=64, val_every=10, val_n=32, eval_n=50))
    device = train_loop.start(args)
    arch = {**asdict(DEFAULT_SWIN_CONFIG), **json.loads(args.arch)}
    cfg = ShapesSwinConfig(**arch)
    model = build_shapes_swin(cfg)
    prior = (1 + args.two_frac) / len(CLASSES)
    with torch.no_grad():
        model.head.fc.bias.fill_(math.log(prior / (1 - prior)))
    model = model.to(device).train()
    batches = scene_batches(steps=args.steps, batch=args.batch, chunk=args.chunk, two_frac=args.two_frac,
                            ramp=args.ramp, seed=args.seed, size=cfg.img_size, smoothing=0.0, loss="bce")

    def loss_of(model, b):
        x, target, _ = b
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.bf16):
            logits = model(x.to(device))
        return _bce_loss(logits, target.to(device), "bce")

    def val(model):
        return {k: round(v, 4) for k, v in
                validate(model, cfg.img_size, n=args.val_n, bf16=args.bf16, device=device).items()}

    def held_out(model, n):
        return evaluate(model, n=n)

    arch_dict = {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(cfg).items()}
    return _fit(model, args, batches=batches, loss_fn=loss_of, validate=val, evaluate=held_out, arch=arch_dict)


def _fit(model, args, *, batches, loss_fn, validate, evaluate, arch) -> dict:
    """:func:`vitlab.shapes.train_loop.fit`'s loop with a wall-clock budget: progress is
    ``max(step / steps, elapsed / budget)``; the lr follows :func:`train_loop.lr_schedule` at that
    progress, and training stops when it reaches 1 (then evaluation, weights and report through
    :func:`train_loop.finish_run`)."""
    import platform
    import shlex
    import time

    opt, _ = train_loop.make_optimizer(model, args)
    factor = train_loop.lr_schedule(args.steps, args.warmup, args.min_lr_ratio)
    budget = 60.0 * args.minutes
    history, ema, step = [], None, 0
    t0, c0 = time.time(), time.process_time()
    while True:
        elapsed = time.time() - t0
        progress = max(step / args.steps, elapsed / budget if budget else 0.0)
        if progress >= 1.0:
            break
        lr = args.lr * factor(min(args.steps - 1, int(progress * args.steps)))
        for g in opt.param_groups:
            g["lr"] = lr
        loss = train_loop.optimizer_step(model, opt, loss_fn(model, next(batches)), clip=args.clip)
        ema = loss if ema is None else 0.98 * ema + 0.02 * loss
        step += 1
        if args.val_every and step % args.val_every == 0:
            history.append(_record(step, args, t0, c0, ema, lr, validate(model)))
    if not history or history[-1]["step"] != step:
        history.append(_record(step, args, t0, c0, ema, lr, validate(model)))
    minutes = (time.time() - t0) / 60
    device = next(model.parameters()).device
    model.eval().cpu()
    info = {
        "command": "python -m vitlab.shapes.train_swin " + " ".join(shlex.quote(a) for a in args.argv),
        "seed": args.seed, "steps": step, "steps_planned": args.steps, "budget_minutes": args.minutes,
        "stopped_by": "steps" if step >= args.steps else "clock", "batch": args.batch,
        "scenes_seen": step * args.batch, "two_frac": args.two_frac, "ramp": args.ramp, "bf16": args.bf16,
        "loss": "bce", "arch": arch, "train_minutes": round(minutes, 2),
        "steps_per_second": round(step / max(minutes * 60, 1e-9), 3), "threads": args.threads,
        "device": str(device), "torch": torch.__version__, "machine": platform.processor() or platform.machine(),
    }
    return train_loop.finish_run(model, "shapes-swin", info, history, args, evaluate, arch, minutes,
                                 log=lambda m: print(m, flush=True), save=save_shapes_swin)


def _record(step, args, t0, c0, ema, lr, val) -> dict:
    import os
    import time

    rec = {"step": step, "scenes": step * args.batch, "minutes": round((time.time() - t0) / 60, 2),
           "cpu_minutes": round((time.process_time() - c0) / 60, 2), "loss": round(ema, 4), "lr": lr,
           "load1": round(os.getloadavg()[0], 2), **val}  # the machine's 1-minute load (2 cores)
    print(json.dumps(rec), flush=True)
    return rec


def main(argv=None):
    train(argv)


if __name__ == "__main__":
    main()
