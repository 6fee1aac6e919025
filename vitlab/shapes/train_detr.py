"""Train ``shapes-detr`` to find the shapes: ``python -m vitlab.shapes.train_detr``.

Recipe (see ``vitlab/weights/shapes-detr.md`` for the measured numbers):

- data: an endless stream of new scenes (:func:`vitlab.shapes.make_scenes`, difficulty 1, the
  evaluated setting), half with one object and half with two; no scene is seen twice;
- targets: each object's class and its box, ``(cx, cy, w, h)`` normalised to [0, 1], the
  bounding box of its mask (:func:`detr_targets`) — the one use of the masks; they never
  enter the model or model selection (there is none: the weights written are those after
  the last step);
- the frozen ``shapes-vit-tiny`` turns each chunk of scenes into its 7 x 7 patch tokens once
  (fp32, no gradient), and DETR (input projection, encoder, decoder, heads) learns on top
  with its own loss: Hungarian matching, cross-entropy with a down-weighted "no object"
  class, L1 and generalised IoU box losses, on every decoder layer (auxiliary losses);
- AdamW, linear warmup then cosine decay, gradient clipping (the loop shared by the training
  commands, :mod:`vitlab.shapes.train_loop`).

Training seeds are ``TRAIN_SEED_BASE + ...`` (>= 1,000,000); validation (:data:`VAL_SEED`)
and evaluation (:data:`EVAL_SEED`) seeds are far below.
"""
from __future__ import annotations

import json

import numpy as np
import torch

from vitlab.localization import box_iou
from vitlab.shapes.bimodal import DETR_ARCH, DETR_PATH, build_shapes_detr
from vitlab.shapes.data import make_scenes
from vitlab.shapes.qa import object_boxes
from vitlab.shapes.train import TRAIN_SEED_BASE
from vitlab.shapes.train_loop import fit, optimizer_step, parse, parser, scene_outputs, start

__all__ = [
    "EVAL_SEED", "VAL_SEED", "batch_loss", "detect", "detr_targets", "evaluate_detr", "main", "parse_args",
    "scene_features", "train", "train_step",
]

#: Seed of the validation scenes logged during training.
VAL_SEED = 920
#: Seed of the held-out evaluation scenes whose figures go into the model card.
EVAL_SEED = 4


def detr_targets(scenes, idx=None) -> list[dict]:
    """DETR labels for scenes: per scene ``{"class_labels": m, "boxes": m x 4}`` with boxes
    ``(cx, cy, w, h)`` normalised to [0, 1], from the bounding boxes of the masks."""
    idx = np.arange(len(scenes)) if idx is None else np.asarray(idx)
    size = scenes.images.shape[1]
    b = object_boxes(scenes.masks[idx]) / size                    # n x m x 4 (x0, y0, x1, y1)
    cxcywh = np.stack([(b[..., 0] + b[..., 2]) / 2, (b[..., 1] + b[..., 3]) / 2,
                       b[..., 2] - b[..., 0], b[..., 3] - b[..., 1]], -1)
    return [{"class_labels": torch.from_numpy(scenes.labels[i]).long(), "boxes": torch.from_numpy(cxcywh[r]).float()}
            for r, i in enumerate(idx)]


@torch.no_grad()
def scene_features(model, images: np.ndarray, batch: int = 128) -> torch.Tensor:
    """The frozen backbone's feature maps for uint8 scenes: ``n x C x gh x gw`` (fp32)."""
    return scene_outputs(model, images, lambda x: model.model.backbone(x)[-1][0], batch)


def forward_features(model, feature_map: torch.Tensor, labels=None):
    """DETR from precomputed backbone feature maps (``B x C x gh x gw``): the input projection,
    then the model as ``inputs_embeds`` — the same computation as ``model(pixel_values)``
    for an unpadded batch (a test checks it)."""
    emb = model.model.input_projection(feature_map).flatten(2).transpose(1, 2)
    return model(pixel_values=None, inputs_embeds=emb, labels=labels)


def batches(model, *, batch: int, chunk: int, seed: int):
    """Endless training batches ``(feature_maps, labels)``, half one-object and half two-object scenes."""
    rng = np.random.default_rng([seed, 13])
    c = 0
    while True:
        base = TRAIN_SEED_BASE + seed * 100_000_000 + 2 * c
        parts = []
        for k, n_obj in enumerate((1, 2)):
            s = make_scenes(max(1, chunk // 2), base + k, n_obj)
            parts += [(f, t) for f, t in zip(scene_features(model, s.images), detr_targets(s))]
        order = rng.permutation(len(parts))
        for i in range(0, len(order) - batch + 1, batch):
            sel = [parts[j] for j in order[i : i + batch]]
            yield torch.stack([f for f, _ in sel]), [t for _, t in sel]
        c += 1


def batch_loss(model, batch) -> torch.Tensor:
    """DETR's own loss (Hungarian matching, classes, L1 and GIoU boxes, auxiliary layers) for one
    batch ``(feature_maps, labels)``."""
    feature_map, labels = batch
    dev = feature_map.device
    labels = [{k: v.to(dev) for k, v in t.items()} for t in labels]
    return forward_features(model, feature_map, labels).loss


def train_step(model, opt, feature_map, labels, clip: float = 1.0) -> float:
    """One optimiser step on a batch of precomputed feature maps; returns the loss before it."""
    return optimizer_step(model, opt, batch_loss(model, (feature_map, labels)), clip)


def detect(logits: torch.Tensor, pred_boxes: torch.Tensor, threshold: float = 0.5) -> list[dict]:
    """Detections of one batch of DETR outputs: per image ``{"scores", "labels", "boxes"}`` for the
    queries whose most probable real class (softmax over classes + "no object") beats
    ``threshold``; boxes ``(x0, y0, x1, y1)`` normalised to [0, 1]."""
    prob = logits.detach().float().softmax(-1)[..., :-1]
    scores, labels = prob.max(-1)
    cx, cy, w, h = pred_boxes.detach().float().unbind(-1)
    xyxy = torch.stack([cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2], -1)
    out = []
    for s, l, b in zip(scores, labels, xyxy):
        keep = s > threshold
        out.append({"scores": s[keep].cpu().numpy(), "labels": l[keep].cpu().numpy(), "boxes": b[keep].cpu().numpy()})
    return out


@torch.no_grad()
def evaluate_detr(model, n: int = 500, seed: int = EVAL_SEED, threshold: float = 0.5, batch: int = 128) -> dict:
    """Detection figures on held-out scenes (difficulty 1): ``n`` one-object and ``n`` two-object.

    Detections are the queries whose best real class has probability > ``threshold``. The
    true objects are matched one-to-one to the detections by maximal total IoU (Hungarian).
    Per scene group (``one``, ``two``) and over all objects (``all``):

    - ``mean_iou``: IoU of each true object with its matched detection, 0 when unmatched;
    - ``matched_iou``: the same over the matched objects only;
    - ``class_accuracy``: objects whose matched detection has the right class (unmatched count wrong);
    - ``recall50``: objects matched at IoU >= 0.5 with the right class;
      ``precision50``: detections that are such a match;
    - ``count_accuracy``: scenes with exactly as many detections as objects.
    """
    from scipy.optimize import linear_sum_assignment

    was_training = model.training
    model.eval()
    res: dict = {"n_per_group": n, "seed": seed, "threshold": threshold}
    tot = {"iou": [], "cls": [], "hit": [], "n_det": 0, "count_ok": 0, "scenes": 0}
    for name, n_obj in (("one", 1), ("two", 2)):
        s = make_scenes(n, seed, n_obj)
        size = s.images.shape[1]
        gt_boxes = object_boxes(s.masks) / size
        dets = []
        for i in range(0, n, batch):
            out = forward_features(model, scene_features(model, s.images[i : i + batch]))
            dets += detect(out.logits, out.pred_boxes, threshold)
        g = {"iou": [], "cls": [], "hit": [], "n_det": 0, "count_ok": 0}
        for i, d in enumerate(dets):
            iou_row = np.zeros(n_obj)
            cls_row = np.zeros(n_obj, dtype=bool)
            if len(d["boxes"]):
                iou = box_iou(gt_boxes[i], d["boxes"])                 # objects x detections
                r, c = linear_sum_assignment(-iou)
                iou_row[r] = iou[r, c]
                cls_row[r] = d["labels"][c] == s.labels[i, r]
            g["iou"] += list(iou_row)
            g["cls"] += list(cls_row)
            g["hit"] += list(cls_row & (iou_row >= 0.5))
            g["n_det"] += len(d["boxes"])
            g["count_ok"] += int(len(d["boxes"]) == n_obj)
        res[name] = _figures(g, n)
        for k in ("iou", "cls", "hit"):
            tot[k] += g[k]
        tot["n_det"] += g["n_det"]
        tot["count_ok"] += g["count_ok"]
    res["all"] = _figures(tot, 2 * n)
    model.train(was_training)
    return res


def _figures(g: dict, scenes: int) -> dict:
    iou = np.array(g["iou"])
    matched = iou > 0
    return {
        "mean_iou": float(iou.mean()),
        "matched_iou": float(iou[matched].mean()) if matched.any() else 0.0,
        "class_accuracy": float(np.mean(g["cls"])),
        "recall50": float(np.mean(g["hit"])),
        "precision50": float(np.sum(g["hit"]) / max(1, g["n_det"])),
        "count_accuracy": g["count_ok"] / scenes,
    }


def train(args) -> dict:
    """Train ``shapes-detr`` as ``args`` (:func:`parse_args`) say; returns the report (:func:`fit`)."""
    device = start(args)
    arch = {**DETR_ARCH, **json.loads(args.arch)}
    model = build_shapes_detr(arch).to(device).train()
    stream = batches(model, batch=args.batch, chunk=args.chunk, seed=args.seed)

    def validate(m) -> dict:
        val = evaluate_detr(m, n=args.val_n, seed=VAL_SEED)
        return {f"{k}_{g}": round(val[g][k], 4) for g in ("one", "two", "all") for k in ("mean_iou", "class_accuracy")}

    return fit(model, args, name="shapes-detr", batches=stream, loss_fn=batch_loss, validate=validate,
               evaluate=evaluate_detr, arch=arch, info={"scenes_seen": args.steps * args.batch},
               counts=lambda step: {"scenes": step * args.batch})


def parse_args(argv=None):
    p = parser("python -m vitlab.shapes.train_detr", __doc__, out=DETR_PATH, steps=3600, batch=32, lr=5e-4,
               weight_decay=1e-4, val_n=100, eval_n=500, batch_help="scenes per step",
               clip_help="gradient norm clip (DETR used 0.1; 0: none)", arch_example='{"num_queries": 10}',
               val_help="validation scenes per group (one / two objects)",
               eval_help="held-out scenes per group evaluated at the end (0: skip)",
               quick_help="smoke test: 20 steps of 8 scenes, nothing written (explicit options win)")
    return parse(p, argv, quick=dict(steps=20, batch=8, chunk=32, val_every=10, val_n=8, eval_n=16))


def main(argv=None):
    train(parse_args(argv))


if __name__ == "__main__":
    main()
