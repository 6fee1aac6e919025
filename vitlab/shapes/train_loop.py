"""The training loop shared by the bimodal training commands (``train_lxmert``, ``train_detr``, ...).

Each command (``python -m vitlab.shapes.train_<model>``) supplies what is its own: the model, an
endless stream of batches, the loss of a batch, a validation and a held-out evaluation. This module
does the rest, identically for every model: seeds and threads, AdamW (weight decay on matrices
only) with linear warmup then cosine decay, gradient clipping, validation records, the held-out
evaluation, the weights file (:func:`vitlab.shapes.bimodal.save_bimodal`) and the JSON report.

API (what a new command, e.g. ``train_visualbert.py``, uses):

- ``parser(prog, doc, *, out, steps, batch, lr, weight_decay, val_n, eval_n, clip_help=...)``
  -> :class:`argparse.ArgumentParser` with the options every command shares (``--out``,
  ``--report``, ``--steps``, ``--batch``, ``--chunk``, ``--lr``, ``--min-lr-ratio``, ``--warmup``,
  ``--weight-decay``, ``--clip``, ``--arch``, ``--seed``, ``--threads``, ``--device``,
  ``--val-every``, ``--val-n``, ``--eval-n``, ``--quick``, ``--no-progress``); add your own
  options to it.
- ``parse(p, argv, quick)`` -> ``args``: parses, keeps ``args.argv`` (for the report's command),
  and under ``--quick`` applies the ``quick`` dict (e.g. ``dict(steps=20, batch=16, ...)``)
  where the option was not given explicitly, and writes nothing (``--out ''``, ``--report ''``).
- ``start(args)`` -> ``torch.device``: threads and ``torch.manual_seed(args.seed)``. Call it
  *before* building the model (the initial weights come from that seed).
- ``make_optimizer(model, args)`` -> ``(opt, sched)``: AdamW over the trainable parameters
  (``args.weight_decay`` on tensors with 2+ dimensions, none on biases / norms) and a
  :class:`torch.optim.lr_scheduler.LambdaLR` stepping :func:`lr_schedule`.
- ``optimizer_step(model, opt, loss, clip)`` -> ``float``: backward, clip the gradient norm of
  the trainable parameters to ``clip`` (0: none), step; returns the loss before the step.
- ``fit(model, args, *, name, batches, loss_fn, validate, evaluate, arch, info, counts, save)``
  -> report dict: the loop (``name`` ``"shapes-<x>"``: the report's command is
  ``python -m vitlab.shapes.train_<x> <argv>``). ``batches`` is an iterator; ``loss_fn(model, batch)`` returns the scalar loss
  tensor of one batch; every ``args.val_every`` steps (and at the last) a record
  ``{"step", **counts(step), "minutes", "cpu_minutes", "loss" (EMA 0.98), "lr", **validate(model)}``
  is logged into the history; ``evaluate(model, n=args.eval_n)`` is the held-out evaluation put
  under ``"evaluation"``; ``info`` (command-specific training facts) is completed with the
  command line, seed, steps, batch, arch, minutes, threads, device, torch version and machine,
  and stored in the report and in the weights file's metadata, written by ``save(model, path,
  arch=..., extra=...)`` (default :func:`vitlab.shapes.bimodal.save_bimodal`; pass your own for
  another model family). The report (written to ``args.report``) is ``{"model", "training", "history", "evaluation"}``; the returned dict adds
  the trained model (eval mode, CPU) under ``"model_object"``.
- ``finish_run(model, name, info, history, args, evaluate, arch, minutes, log, save)``: the end
  of :func:`fit` alone (evaluation, weights, report), for a command with its own loop.
- ``lr_schedule(steps, warmup, min_ratio)``: the learning-rate factor per step.
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
from typing import Callable, Iterator

import torch

__all__ = ["finish_run", "fit", "lr_schedule", "make_optimizer", "optimizer_step", "parse", "parser", "start"]


def lr_schedule(steps: int, warmup: float, min_ratio: float):
    """lr factor at each step: linear warmup over ``warmup`` of the steps, cosine decay to ``min_ratio``."""
    n_warm = max(1, int(warmup * steps))

    def factor(step: int) -> float:
        if step < n_warm:
            return (step + 1) / n_warm
        p = (step - n_warm) / max(1, steps - n_warm)
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * p))

    return factor


def parser(prog: str, doc: str, *, out: Path, steps: int, batch: int, lr: float, weight_decay: float,
           val_n: int, eval_n: int, batch_help: str = "examples per step", chunk: int = 512,
           clip_help: str = "gradient norm clip (0: none)", arch_example: str = '{"hidden_size": 64}',
           val_help: str = "validation scenes", eval_help: str = "held-out scenes evaluated at the end (0: skip)",
           quick_help: str = "smoke test: a few small steps, nothing written (explicit options win)"
           ) -> argparse.ArgumentParser:
    """The options every training command shares, with its own defaults (see the module docstring)."""
    out = Path(out)
    p = argparse.ArgumentParser(prog=prog, description=doc.splitlines()[0])
    p.add_argument("--out", default=str(out), help="where to write the safetensors weights ('' to skip)")
    p.add_argument("--report", default=str(out.with_suffix(".json")),
                   help="where to write training history and held-out evaluation as JSON ('' to skip)")
    p.add_argument("--steps", type=int, default=steps, help="optimiser steps")
    p.add_argument("--batch", type=int, default=batch, help=batch_help)
    p.add_argument("--chunk", type=int, default=chunk, help="scenes generated (and encoded by the backbone) at a time")
    p.add_argument("--lr", type=float, default=lr, help="peak learning rate")
    p.add_argument("--min-lr-ratio", type=float, default=0.01)
    p.add_argument("--warmup", type=float, default=0.05, help="warmup, as a fraction of the steps")
    p.add_argument("--weight-decay", type=float, default=weight_decay)
    p.add_argument("--clip", type=float, default=1.0, help=clip_help)
    p.add_argument("--arch", default="{}", help=f"JSON overrides of the model size, e.g. '{arch_example}'")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2, help="CPU threads (one is faster on a busy machine)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--val-every", type=int, default=250, help="validate every this many steps (0: never)")
    p.add_argument("--val-n", type=int, default=val_n, help=val_help)
    p.add_argument("--eval-n", type=int, default=eval_n, help=eval_help)
    p.add_argument("--quick", action="store_true", help=quick_help)
    p.add_argument("--no-progress", action="store_true")
    return p


def parse(p: argparse.ArgumentParser, argv=None, quick: dict | None = None) -> argparse.Namespace:
    """Parse ``argv`` (default ``sys.argv[1:]``); ``--quick`` sets ``quick``'s values where the
    option was not given explicitly and writes nothing unless ``--out`` / ``--report`` are given."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = p.parse_args(argv)
    args.argv = argv
    if args.quick:
        for name, value in (quick or {}).items():
            if "--" + name.replace("_", "-") not in argv:  # what is given explicitly stays
                setattr(args, name, value)
        if "--out" not in argv:
            args.out = ""
        if "--report" not in argv:
            args.report = ""
    if args.steps < 1 or args.batch < 1:
        p.error("--steps and --batch must be positive")
    return args


def start(args) -> torch.device:
    """Threads and seed for a run (call before building the model); returns the device."""
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    return torch.device(args.device)


def parse_weighted(text: str, allowed, what: str, example: str, where: str = "") -> dict[str, float]:
    """``"a:2,b"`` -> ``{"a": 2.0, "b": 1.0}``: distinct names from ``allowed``, each with an optional
    positive ``:weight`` (default 1). ``what`` (a subject and its verb, "--kinds takes") starts the
    message for a wrong name, ``example`` shows the form; ``where`` follows the name in the messages
    for a wrong weight."""
    out: dict[str, float] = {}
    for part in text.split(","):
        name, _, w = part.strip().partition(":")
        if name not in allowed or name in out:
            raise ValueError(f"{what} distinct kinds from {','.join(allowed)}, each with an "
                             f"optional :weight, e.g. {example}; got {text!r}")
        try:
            out[name] = float(w) if w else 1.0
        except ValueError:
            raise ValueError(f"the weight of {name!r}{where} must be a number, got {w!r}") from None
        if not out[name] > 0:
            raise ValueError(f"the weight of {name!r}{where} must be positive, got {out[name]}")
    return out


@torch.no_grad()
def scene_outputs(model: torch.nn.Module, images, backbone: Callable, batch: int = 128) -> torch.Tensor:
    """``backbone(x)`` over uint8 scenes ``n x H x W x 3`` in batches of ``batch``, each normalised as the
    shapes models expect and moved to the model's device, concatenated along the first dim."""
    from vitlab.shapes.data import scenes_to_tensor
    from vitlab.shapes.model import MEAN, STD

    size = images.shape[1]
    dev = next(model.parameters()).device
    return torch.cat([backbone(scenes_to_tensor(images[i: i + batch], (3, size, size), MEAN, STD).to(dev))
                      for i in range(0, len(images), batch)])


def make_optimizer(model: torch.nn.Module, args):
    """AdamW (weight decay on 2+-dimensional tensors only) and its warmup-cosine schedule."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.ndim > 1]
    no_decay = [p for p in params if p.ndim <= 1]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=args.lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_schedule(args.steps, args.warmup, args.min_lr_ratio))
    return opt, sched


def optimizer_step(model: torch.nn.Module, opt, loss: torch.Tensor, clip: float = 1.0) -> float:
    """Backward, gradient-norm clip (``clip`` 0: none) over the trainable parameters, step.
    Returns the loss (before the step) as a float."""
    opt.zero_grad(set_to_none=True)
    loss.backward()
    if clip:
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], clip)
    opt.step()
    return loss.item()


def fit(model: torch.nn.Module, args, *, name: str, batches: Iterator,
        loss_fn: Callable[[torch.nn.Module, object], torch.Tensor],
        validate: Callable[[torch.nn.Module], dict] | None, evaluate: Callable[..., dict], arch: dict,
        info: dict | None = None, counts: Callable[[int], dict] | None = None,
        save: Callable | None = None) -> dict:
    """Train ``model`` for ``args.steps`` steps and write its files (see the module docstring)."""
    from tqdm.auto import tqdm

    opt, sched = make_optimizer(model, args)
    bar = tqdm(total=args.steps, desc=f"train {name}", mininterval=5.0, disable=args.no_progress)
    log = bar.write
    history, ema = [], None
    t0, c0 = time.time(), time.process_time()
    for step in range(args.steps):
        loss = optimizer_step(model, opt, loss_fn(model, next(batches)), clip=args.clip)
        sched.step()
        ema = loss if ema is None else 0.98 * ema + 0.02 * loss
        bar.update(1)
        bar.set_postfix(loss=f"{ema:.3f}", refresh=False)
        last = step + 1 == args.steps
        if args.val_every and ((step + 1) % args.val_every == 0 or last):
            rec = {"step": step + 1, **(counts(step + 1) if counts else {}),
                   "minutes": round((time.time() - t0) / 60, 2),
                   "cpu_minutes": round((time.process_time() - c0) / 60, 2), "loss": round(ema, 4),
                   "lr": sched.get_last_lr()[0]}
            if validate is not None:
                rec.update(validate(model))
            history.append(rec)
            log(json.dumps(rec))
            sys.stdout.flush()
    bar.close()
    minutes = (time.time() - t0) / 60
    device = next(model.parameters()).device
    model.eval().cpu()
    module = "vitlab.shapes.train_" + name.removeprefix("shapes-")
    full = {
        "command": f"python -m {module} " + " ".join(shlex.quote(a) for a in args.argv),
        "seed": args.seed, "steps": args.steps, "batch": args.batch, **(info or {}), "arch": arch,
        "train_minutes": round(minutes, 2), "steps_per_second": round(args.steps / max(minutes * 60, 1e-9), 3),
        "threads": args.threads, "device": str(device), "torch": torch.__version__,
        "machine": platform.processor() or platform.machine(),
    }
    return finish_run(model, name, full, history, args, evaluate, arch, minutes, log, save=save)


def finish_run(model, name: str, info: dict, history: list, args, evaluate, arch: dict, minutes: float,
               log=print, save: Callable | None = None) -> dict:
    """The end of a training command: the held-out ``evaluate(model, n=args.eval_n)`` if asked,
    the weights to ``args.out`` by ``save(model, path, arch=arch, extra={"training": info})``
    (default :func:`vitlab.shapes.bimodal.save_bimodal`) and the JSON report (training info,
    history, evaluation) to ``args.report``; returns the report with the model under
    ``"model_object"``."""
    if save is None:
        from vitlab.shapes.bimodal import save_bimodal as save

    result = {"model": name, "training": info, "history": history}
    if args.eval_n:
        t1 = time.time()
        result["evaluation"] = evaluate(model, n=args.eval_n)
        result["evaluation"]["minutes"] = round((time.time() - t1) / 60, 2)
        log("held-out evaluation: " + json.dumps(result["evaluation"]))
    if args.out:
        save(model, args.out, arch=arch, extra={"training": info})
        log(f"wrote {args.out} ({Path(args.out).stat().st_size / 1e6:.1f} MB) after {minutes:.1f} min")
    if args.report:
        Path(args.report).parent.mkdir(parents=True, exist_ok=True)
        Path(args.report).write_text(json.dumps(result, indent=1))
    result["model_object"] = model
    return result
