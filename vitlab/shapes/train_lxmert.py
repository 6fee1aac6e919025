"""Train ``shapes-lxmert`` on generated questions: ``python -m vitlab.shapes.train_lxmert``.

Recipe (see ``vitlab/models/shapes-lxmert.md`` for the measured numbers):

- data: an endless stream of new two-object scenes (:func:`vitlab.shapes.make_scenes`, difficulty
  1, the evaluated setting), ``--per-scene`` questions about each (:func:`vitlab.shapes.qa.make_questions`:
  where / exists / which, drawn 2 : 1 : 1 by default, see ``--kinds``); no scene is seen twice;
- the frozen ``shapes-vit-tiny`` turns each chunk of scenes into its 49 patch tokens once
  (fp32, no gradient), and LXMERT learns on top: cross-entropy over the answers;
- AdamW, linear warmup then cosine decay, gradient clipping.

The masks are read only to derive the ``where`` / ``which`` answers (object positions, see
:mod:`vitlab.shapes.qa`); they never enter the model or model selection (there is none: the
weights written are those after the last step). Training seeds are ``TRAIN_SEED_BASE + ...``
(>= 1,000,000); validation (:data:`VAL_SEED`) and evaluation (:data:`EVAL_SEED`) seeds are far below.
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

from vitlab.shapes.bimodal import LXMERT_ARCH, LXMERT_PATH, build_shapes_lxmert, save_bimodal
from vitlab.shapes.data import make_scenes, scenes_to_tensor
from vitlab.shapes.model import MEAN, STD
from vitlab.shapes.qa import QUESTION_TYPES, make_questions
from vitlab.shapes.train import TRAIN_SEED_BASE

__all__ = [
    "EVAL_SEED", "VAL_SEED", "evaluate_lxmert", "feature_chunks", "lr_schedule", "main", "parse_args", "parse_kinds",
    "question_batches", "scene_features", "train", "train_step",
]

#: Seed of the validation scenes logged during training.
VAL_SEED = 910
#: Seed of the held-out evaluation scenes whose figures go into the model card.
EVAL_SEED = 3


def lr_schedule(steps: int, warmup: float, min_ratio: float):
    """lr factor at each step: linear warmup over ``warmup`` of the steps, cosine decay to ``min_ratio``."""
    n_warm = max(1, int(warmup * steps))

    def factor(step: int) -> float:
        if step < n_warm:
            return (step + 1) / n_warm
        p = (step - n_warm) / max(1, steps - n_warm)
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * p))

    return factor


@torch.no_grad()
def scene_features(model, images: np.ndarray, batch: int = 128) -> torch.Tensor:
    """The frozen backbone's patch tokens for uint8 scenes: ``n x N x C`` (fp32, on the model's device)."""
    size = images.shape[1]
    dev = next(model.parameters()).device
    out = []
    for i in range(0, len(images), batch):
        x = scenes_to_tensor(images[i : i + batch], (3, size, size), MEAN, STD).to(dev)
        out.append(model.visual_inputs(x)[0])
    return torch.cat(out)


def feature_chunks(model, *, chunk: int, seed: int, n_objects=2, difficulty: float = 1.0):
    """Endless ``(scenes, features)`` chunks of fresh training scenes (seeds >= TRAIN_SEED_BASE).

    ``n_objects``: 1, 2, or a tuple to split every chunk evenly (one scene seed per part).
    """
    parts = (n_objects,) if isinstance(n_objects, int) else tuple(n_objects)
    c = 0
    while True:
        base = TRAIN_SEED_BASE + seed * 100_000_000 + c * len(parts)
        for k, n_obj in enumerate(parts):
            s = make_scenes(max(1, chunk // len(parts)), base + k, n_obj, difficulty=difficulty)
            yield base + k, s, scene_features(model, s.images)
        c += 1


def question_batches(model, *, batch: int, per_scene: int, chunk: int, seed: int, kinds=QUESTION_TYPES,
                     weights=None, first_kinds=None, first_batches: int = 0):
    """Endless training batches ``(visual_feats, input_ids, attention_mask, answer_ids, kinds)``.

    Every chunk of ``chunk`` scenes gets ``per_scene`` questions each (kinds drawn in proportion
    to ``weights``, uniformly if None), shuffled; a batch holds ``batch`` questions, each with its
    scene's tokens. Curriculum: the first ``first_batches`` batches ask only ``first_kinds``
    (drawn uniformly; a chunk started within them is asked about in full).
    """
    rng = np.random.default_rng([seed, 11])
    made = 0
    for scene_seed, scenes, feats in feature_chunks(model, chunk=chunk, seed=seed):
        if made < first_batches and first_kinds:
            q = make_questions(scenes, scene_seed, per_scene=per_scene, kinds=first_kinds)
        else:
            q = make_questions(scenes, scene_seed, per_scene=per_scene, kinds=kinds, weights=weights)
        order = rng.permutation(len(q))
        for i in range(0, len(order) - batch + 1, batch):
            made += 1
            sel = q.select(order[i : i + batch])
            ids, mask = model.encode(sel.text)
            yield feats[torch.from_numpy(sel.scene)], ids, mask, torch.from_numpy(sel.answer_id).to(ids.device), sel.kind


def train_step(model, opt, feats, ids, mask, answers, clip: float = 1.0) -> float:
    """One optimiser step on a batch; returns the loss before the step."""
    pos = model.patch_boxes.expand(feats.shape[0], -1, -1)
    out = model(input_ids=ids, visual_feats=feats, visual_pos=pos, attention_mask=mask)
    loss = F.cross_entropy(out.question_answering_score, answers)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    if clip:
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], clip)
    opt.step()
    return loss.item()


@torch.no_grad()
def evaluate_lxmert(model, n: int = 1000, seed: int = EVAL_SEED, per_scene: int = 3, batch: int = 256) -> dict:
    """Answer accuracy on held-out two-object scenes (difficulty 1), overall and per question kind.

    ``n`` scenes from ``make_scenes(n, seed, 2)`` with ``per_scene`` questions each
    (:func:`make_questions` with the same seed). Returns ``{"n_scenes", "n_questions", "seed",
    "accuracy", "accuracy_<kind>", "n_<kind>"}`` (accuracies in [0, 1]); chance levels for
    reference are 1/9 (where), 1/2 (exists) and 1/2 (which: one of the scene's two classes).
    """
    was_training = model.training
    model.eval()
    scenes = make_scenes(n, seed, 2)
    q = make_questions(scenes, seed, per_scene=per_scene)
    feats = scene_features(model, scenes.images)
    pred = []
    for i in range(0, len(q), batch):
        sel = q.select(np.arange(i, min(i + batch, len(q))))
        ids, mask = model.encode(sel.text)
        f = feats[torch.from_numpy(sel.scene)]
        out = model(input_ids=ids, visual_feats=f, visual_pos=model.patch_boxes.expand(len(f), -1, -1),
                    attention_mask=mask)
        pred.append(out.question_answering_score.argmax(-1).cpu())
    right = (torch.cat(pred).numpy() == q.answer_id)
    kinds = np.array(q.kind)
    res = {"n_scenes": n, "n_questions": len(q), "seed": seed, "accuracy": float(right.mean())}
    for k in QUESTION_TYPES:
        sel = kinds == k
        res[f"accuracy_{k}"] = float(right[sel].mean()) if sel.any() else float("nan")
        res[f"n_{k}"] = int(sel.sum())
    model.train(was_training)
    return res


def parse_kinds(text: str) -> tuple[tuple[str, ...], list[float]]:
    """``"where:2,exists:1,which"`` -> ``(("where", "exists", "which"), [2.0, 1.0, 1.0])``."""
    kinds, weights = [], []
    for part in text.split(","):
        name, _, w = part.strip().partition(":")
        if name not in QUESTION_TYPES or name in kinds:
            raise ValueError(f"--kinds takes distinct kinds from {','.join(QUESTION_TYPES)}, each with an "
                             f"optional :weight, e.g. where:2,exists:1,which:1; got {text!r}")
        try:
            weight = float(w) if w else 1.0
        except ValueError:
            raise ValueError(f"the weight of {name!r} in --kinds must be a number, got {w!r}") from None
        if not weight > 0:
            raise ValueError(f"the weight of {name!r} in --kinds must be positive, got {weight}")
        kinds.append(name)
        weights.append(weight)
    return tuple(kinds), weights


def train(args) -> dict:
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    arch = {**LXMERT_ARCH, **json.loads(args.arch)}
    model = build_shapes_lxmert(arch).to(device).train()
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.ndim > 1]
    no_decay = [p for p in params if p.ndim <= 1]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=args.lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_schedule(args.steps, args.warmup, args.min_lr_ratio))
    kinds, weights = parse_kinds(args.kinds)
    first = parse_kinds(args.first_kinds)[0] if args.first_kinds else None
    batches = question_batches(model, batch=args.batch, per_scene=args.per_scene, chunk=args.chunk, seed=args.seed,
                               kinds=kinds, weights=weights, first_kinds=first,
                               first_batches=int(round(args.first_frac * args.steps)))
    from tqdm.auto import tqdm

    bar = tqdm(total=args.steps, desc="train shapes-lxmert", mininterval=5.0, disable=args.no_progress)
    log = bar.write
    history, ema = [], None
    t0, c0 = time.time(), time.process_time()
    for step in range(args.steps):
        feats, ids, mask, answers, _ = next(batches)
        loss = train_step(model, opt, feats, ids, mask, answers, clip=args.clip)
        sched.step()
        ema = loss if ema is None else 0.98 * ema + 0.02 * loss
        bar.update(1)
        bar.set_postfix(loss=f"{ema:.3f}", refresh=False)
        last = step + 1 == args.steps
        if args.val_every and ((step + 1) % args.val_every == 0 or last):
            rec = {"step": step + 1, "questions": (step + 1) * args.batch,
                   "scenes": (step + 1) * args.batch // args.per_scene,
                   "minutes": round((time.time() - t0) / 60, 2),
                   "cpu_minutes": round((time.process_time() - c0) / 60, 2), "loss": round(ema, 4),
                   "lr": sched.get_last_lr()[0]}
            val = evaluate_lxmert(model, n=args.val_n, seed=VAL_SEED)
            rec.update({k: round(v, 4) for k, v in val.items() if k.startswith("accuracy")})
            history.append(rec)
            log(json.dumps(rec))
            sys.stdout.flush()
    bar.close()
    minutes = (time.time() - t0) / 60
    model.eval().cpu()
    info = {
        "command": "python -m vitlab.shapes.train_lxmert " + " ".join(shlex.quote(a) for a in args.argv),
        "seed": args.seed, "steps": args.steps, "batch": args.batch, "per_scene": args.per_scene,
        "kinds": dict(zip(kinds, weights)), "first_kinds": args.first_kinds, "first_frac": args.first_frac,
        "questions_seen": args.steps * args.batch, "arch": arch, "train_minutes": round(minutes, 2),
        "threads": args.threads, "device": str(device), "torch": torch.__version__,
        "machine": platform.processor() or platform.machine(),
    }
    return finish_run(model, "shapes-lxmert", info, history, args, evaluate_lxmert, arch, minutes, log)


def finish_run(model, name: str, info: dict, history: list, args, evaluate, arch: dict, minutes: float,
               log) -> dict:
    """The end of a training command (shapes-lxmert and shapes-detr alike): the held-out
    ``evaluate(model, n=args.eval_n)`` if asked, the weights to ``args.out`` and the JSON report
    (training info, history, evaluation) to ``args.report``; returns the report with the model
    under ``"model_object"``."""
    result = {"model": name, "training": info, "history": history}
    if args.eval_n:
        t1 = time.time()
        result["evaluation"] = evaluate(model, n=args.eval_n)
        result["evaluation"]["minutes"] = round((time.time() - t1) / 60, 2)
        log("held-out evaluation: " + json.dumps(result["evaluation"]))
    if args.out:
        save_bimodal(model, args.out, arch=arch, extra={"training": info})
        log(f"wrote {args.out} ({Path(args.out).stat().st_size / 1e6:.1f} MB) after {minutes:.1f} min")
    if args.report:
        Path(args.report).parent.mkdir(parents=True, exist_ok=True)
        Path(args.report).write_text(json.dumps(result, indent=1))
    result["model_object"] = model
    return result


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m vitlab.shapes.train_lxmert", description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(LXMERT_PATH), help="where to write the safetensors weights ('' to skip)")
    p.add_argument("--report", default=str(LXMERT_PATH.with_suffix(".json")),
                   help="where to write training history and held-out evaluation as JSON ('' to skip)")
    p.add_argument("--steps", type=int, default=4000, help="optimiser steps")
    p.add_argument("--batch", type=int, default=64, help="questions per step")
    p.add_argument("--per-scene", type=int, default=4, help="questions drawn about each scene")
    p.add_argument("--kinds", default="where:2,exists:1,which:1",
                   help="question kinds to train on, each with an optional sampling weight (kind:weight, comma-separated)")
    p.add_argument("--first-kinds", default="where", help="curriculum: the kinds asked alone at first ('' for none)")
    p.add_argument("--first-frac", type=float, default=0.2,
                   help="curriculum: the fraction of the steps (rounded up to whole chunks) that ask only --first-kinds")
    p.add_argument("--chunk", type=int, default=512, help="scenes generated (and encoded by the backbone) at a time")
    p.add_argument("--lr", type=float, default=1e-3, help="peak learning rate")
    p.add_argument("--min-lr-ratio", type=float, default=0.01)
    p.add_argument("--warmup", type=float, default=0.05, help="warmup, as a fraction of the steps")
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--clip", type=float, default=1.0, help="gradient norm clip (0: none)")
    p.add_argument("--arch", default="{}", help='JSON overrides of the LXMERT size, e.g. \'{"x_layers": 3}\'')
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2, help="CPU threads (one is faster on a busy machine)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--val-every", type=int, default=250, help="validate every this many steps (0: never)")
    p.add_argument("--val-n", type=int, default=200, help="validation scenes (3 questions each)")
    p.add_argument("--eval-n", type=int, default=1000, help="held-out scenes evaluated at the end (0: skip)")
    p.add_argument("--quick", action="store_true", help="smoke test: 20 steps of 16 questions, nothing written (explicit options win)")
    p.add_argument("--no-progress", action="store_true")
    argv = list(sys.argv[1:] if argv is None else argv)
    args = p.parse_args(argv)
    args.argv = argv
    if args.quick:
        for name, value in dict(steps=20, batch=16, chunk=32, val_every=10, val_n=16, eval_n=32).items():
            if "--" + name.replace("_", "-") not in argv:  # what is given explicitly stays
                setattr(args, name, value)
        if "--out" not in argv:
            args.out = ""
        if "--report" not in argv:
            args.report = ""
    if args.steps < 1 or args.batch < 1 or args.per_scene < 1:
        p.error("--steps, --batch and --per-scene must be positive")
    try:
        parse_kinds(args.kinds)
        if args.first_kinds:
            parse_kinds(args.first_kinds)
    except ValueError as e:
        p.error(str(e))
    if not 0 <= args.first_frac < 1:
        p.error(f"--first-frac must be in [0, 1), got {args.first_frac}")
    return args


def main(argv=None):
    train(parse_args(argv))


if __name__ == "__main__":
    main()
