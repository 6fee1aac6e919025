"""Train ``shapes-clip`` contrastively on generated scenes and captions: ``python -m vitlab.shapes.train_clip``.

Recipe (``vitlab/weights/shapes-clip.md`` has the measured numbers; the card is written by this
command):

- data: an endless stream of fresh scenes at difficulty 1 (:func:`vitlab.shapes.make_scenes`),
  one- and two-object (``--two-frac`` of each batch has two objects), each with one caption
  drawn by :func:`vitlab.shapes.captions.make_captions` (one object: ``a circle`` /
  ``a circle in the top left``; two objects: those, ``a circle and a square`` and
  ``a circle left of a square``); no scene is seen twice, so there is no augmentation;
- hard negatives in the batch: scenes are batched in groups of ``--group`` that hold the same
  shapes (one class, or one pair of classes), so a batch holds captions that differ only in
  where the shapes are (``a circle left of a square`` next to ``a square left of a circle``,
  ``a star at the top`` next to ``a star on the left``) and the loss must read positions;
- loss: the symmetric InfoNCE of CLIP (Radford et al. 2021, the pseudo-code of their Figure 3)
  over the batch's image-caption similarities ``logit_scale.exp() * cos``, with every caption of
  the batch that is *true* of an image counted as a positive for it
  (:func:`vitlab.shapes.captions.caption_truth`; the targets of each row and column spread
  evenly over its positives, as in UniCL, Yang et al. 2022, eq. 3-4), so that two images whose
  captions are both ``a star`` are not pushed apart: :func:`multi_positive_infonce`;
- temperature: ``logit_scale`` is learned, starts at ``log(1 / 0.07)`` and is clipped at
  ``log(100)`` after every step, as in CLIP;
- model: :func:`vitlab.shapes.clip_model.build_shapes_clip` — the image tower starts from the
  shipped ``shapes-vit-tiny`` (its stem frozen with ``--freeze-stem``), the text tower and both
  projections from Hugging Face's random initialisation; AdamW with a lower learning rate for the
  image tower (``--vision-lr-ratio``), weight decay on matrices only, linear warmup then cosine
  decay, gradient clipping, bf16 autocast on the CPU;
- budget: ``--steps`` steps, or fewer if ``--minutes`` of wall-clock time run out first: the
  learning-rate schedule then follows the elapsed fraction of the budget, so the run always
  ends decayed (a slower machine trains fewer steps; the report says how many).

The masks are read only to place the objects in the captions (box centres, as for
:mod:`vitlab.shapes.qa`); they never enter the model or model selection (there is none: the
weights written are those after the last step, rounded to fp16 before the held-out evaluation,
so the figures are those of the shipped file). Training scenes use seeds >= 1,000,000
(:data:`vitlab.shapes.train.TRAIN_SEED_BASE`); validation (:data:`VAL_SEED`) and the held-out
evaluation (:data:`EVAL_SEED`) use seeds far below.
"""
from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from vitlab.shapes.captions import (
    CAPTION_KINDS, CELL_PHRASES, Caption, caption_truth, make_captions, scene_facts, zero_shot_prompts,
)
from vitlab.shapes.clip_model import CLIP_ARCH, CLIP_PATH, build_shapes_clip, save_shapes_clip
from vitlab.shapes.data import CLASSES, make_scenes, remove_objects, scenes_to_tensor
from vitlab.shapes.model import MEAN, STD
from vitlab.shapes.qa import CELLS
from vitlab.shapes.train import TRAIN_SEED_BASE
from vitlab.shapes.train_loop import finish_run, lr_schedule, parse, parse_weighted, parser, start
from vitlab.stats import rate

__all__ = [
    "EVAL_SEED", "VAL_SEED", "CARD_PATH", "caption_batches", "clip_logits", "evaluate_clip", "hard_negatives", "main",
    "make_optimizer", "multi_positive_infonce", "PositionProbe", "parse_args", "train", "validate_clip",
    "write_card",
]

#: Seed of the validation scenes logged during training.
VAL_SEED = 930
#: Seed of the held-out evaluation scenes whose figures go into the model card.
EVAL_SEED = 5
#: Where the command writes the model card by default.
CARD_PATH = CLIP_PATH.with_suffix(".md")
_LOG_MAX_SCALE = math.log(100.0)


# ---------------------------------------------------------------------------------- data
def _group_order(keys: np.ndarray, group: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Indices split into groups of at most ``group`` that share a key, the groups shuffled."""
    groups = []
    for k in np.unique(keys):
        idx = rng.permutation(np.flatnonzero(keys == k))
        groups += [idx[i : i + group] for i in range(0, len(idx), group)]
    return [groups[i] for i in rng.permutation(len(groups))]


def _fill(groups: list[np.ndarray], n: int) -> list[np.ndarray]:
    """Consecutive groups packed into index arrays of exactly ``n`` (a group may be split at the end
    of an array); what does not fill a last array is dropped."""
    flat = np.concatenate(groups) if groups else np.zeros(0, dtype=np.int64)
    return [flat[i : i + n] for i in range(0, len(flat) - n + 1, n)]


def parse_weights(text: str) -> dict:
    """``"shape:1,cell:2"`` -> ``{"shape": 1.0, "cell": 2.0}`` (caption kinds and their weights)."""
    return parse_weighted(text, CAPTION_KINDS, "caption weights take", "shape:1,cell:2")


def caption_batches(*, batch: int, two_frac: float, group: int, chunk: int, seed: int, size: int = 112,
                    kinds_one: dict | None = None, kinds_two: dict | None = None):
    """Endless training batches ``(pixel_values, captions, facts, key)``: ``batch`` fresh scenes
    (``round(batch * two_frac)`` of them with two objects, the first rows one-object), each with
    one drawn caption (:class:`~vitlab.shapes.captions.Caption`), and their
    :class:`~vitlab.shapes.captions.SceneFacts`, and a number that differs between batches (a
    seed for what is drawn per batch). Scenes come ``chunk`` at a time (seeds
    ``TRAIN_SEED_BASE + seed * 100_000_000 + ...``) and are batched in groups of ``group`` that
    hold the same shapes (1: no grouping). ``kinds_one`` / ``kinds_two``: caption kinds and weights
    for one- and two-object scenes (:func:`~vitlab.shapes.captions.make_captions`' defaults if None)."""
    b2 = int(round(batch * two_frac))
    b1 = batch - b2
    rng = np.random.default_rng([seed, 17])
    c = 0
    while True:
        base = TRAIN_SEED_BASE + seed * 100_000_000 + 2 * c
        parts = []
        for n_obj, b in ((1, b1), (2, b2)):
            if b == 0:
                parts.append(None)
                continue
            n = max(b, int(round(chunk * b / batch)))
            s = make_scenes(n, base + n_obj - 1, n_obj, size=size)
            facts = scene_facts(s)
            caps = make_captions(s, base + n_obj - 1, kinds_one if n_obj == 1 else kinds_two, facts=facts)
            labels = np.sort(s.labels, axis=1)
            keys = labels[:, 0] * len(CLASSES) + (labels[:, 1] if n_obj == 2 else 0)
            order = _fill(_group_order(keys, max(1, group), rng), b)
            parts.append((s, facts, caps, order))
        n_batches = min(len(p[3]) for p in parts if p is not None)
        for i in range(n_batches):
            images, caps, facts = [], [], []
            for p in parts:
                if p is None:
                    continue
                s, f, cs, order = p
                idx = order[i]
                images.append(s.images[idx])
                caps += [cs[j] for j in idx]
                facts.append(f.select(idx))
            x = scenes_to_tensor(np.concatenate(images), (3, size, size), MEAN, STD)
            f0 = facts[0]
            if len(facts) == 2:
                f0 = type(f0)(np.concatenate([facts[0].present, facts[1].present]),
                              np.concatenate([facts[0].centre, facts[1].centre]),
                              np.concatenate([facts[0].cell, facts[1].cell]), f0.size)
            yield x, caps, f0, base * 1000 + i
        c += 1


# ---------------------------------------------------------------------------------- loss
def clip_logits(model, pixel_values: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                autocast: bool = False, return_pooled: bool = False):
    """``logits_per_image`` (``B_images x B_texts``) as ``CLIPModel.forward`` computes them:
    ``logit_scale.exp() * cos(image_embed, text_embed)``. With ``autocast`` the towers run under
    bf16 autocast and the normalisation and product in fp32 (bf16 logits of size ~100 would be
    rounded to ~0.5). ``return_pooled``: also return the image tower's pooled CLS token (after
    ``post_layernorm``, before ``visual_projection``), as ``(logits, pooled)``."""
    dev = pixel_values.device.type
    with torch.autocast(dev, dtype=torch.bfloat16, enabled=autocast):
        pooled = model.vision_model(pixel_values=pixel_values).pooler_output
        img = model.visual_projection(pooled)              # = model.get_image_features(pixel_values).pooler_output
        txt = model.get_text_features(input_ids=input_ids, attention_mask=attention_mask).pooler_output
    img = F.normalize(img.float(), dim=-1)
    txt = F.normalize(txt.float(), dim=-1)
    logits = model.logit_scale.exp() * img @ txt.T
    return (logits, pooled.float()) if return_pooled else logits


class PositionProbe(torch.nn.Module):
    """A linear read-out of where each shape is, from the image tower's pooled CLS token: for every
    class, 9 logits over the cells of the 3 x 3 grid (``B x K x 9``). Used only while training (the
    position warm-up of :func:`train`), never part of the model."""

    def __init__(self, width: int, n_classes: int = len(CLASSES), n_cells: int = len(CELLS)):
        super().__init__()
        self.n_classes, self.n_cells = n_classes, n_cells
        self.linear = torch.nn.Linear(width, n_classes * n_cells)

    def forward(self, pooled: torch.Tensor) -> torch.Tensor:
        return self.linear(pooled).view(-1, self.n_classes, self.n_cells)

    def loss(self, pooled: torch.Tensor, facts) -> torch.Tensor:
        """Cross-entropy of each present object's cell, averaged over the objects of the batch."""
        logits = self(pooled)
        cell = torch.from_numpy(facts.cell).to(pooled.device)              # B x K, -1 where absent
        present = cell >= 0
        return F.cross_entropy(logits[present], cell[present])


def multi_positive_infonce(logits: torch.Tensor, positives: torch.Tensor, n_paired: int | None = None) -> torch.Tensor:
    """Symmetric InfoNCE with several positives per row and column.

    ``logits``: ``B_images x T`` (``logits_per_image``); ``positives``: bool, same shape, ``True``
    where the text is true of the image. The image-to-text loss is the cross-entropy of each row's
    softmax against the uniform distribution over its positives, the text-to-image loss the same
    over the columns of the first ``n_paired`` texts (default: all), and the loss their mean:
    CLIP's loss (Radford et al. 2021, Fig. 3) when the positives are the diagonal, UniCL's (Yang
    et al. 2022, eq. 3-4) otherwise. Texts after the first ``n_paired`` are extra negatives for the
    image-to-text direction only, as NegCLIP's hard negative captions (Yuksekgonul et al. 2023).
    Every row, and every one of the first ``n_paired`` columns, needs a positive.
    """
    pos = positives.to(logits.dtype)
    n_paired = logits.shape[1] if n_paired is None else int(n_paired)
    paired = pos[:, :n_paired]
    if not bool((pos.sum(1) > 0).all() and (paired.sum(0) > 0).all()):
        raise ValueError("every image and every paired text needs at least one positive")
    i2t = -(pos / pos.sum(1, keepdim=True) * logits.log_softmax(1)).sum(1).mean()
    t2i = -(paired / paired.sum(0, keepdim=True) * logits[:, :n_paired].log_softmax(0)).sum(0).mean()
    return (i2t + t2i) / 2


def hard_negatives(captions: list[Caption], seed: int) -> list[Caption]:
    """A caption that reads almost like each ``relation`` or ``cell`` caption but says something else
    about positions: the relation with its two shapes swapped (``a square left of a circle`` for
    ``a circle left of a square``), the cell caption with another cell drawn uniformly. Other kinds
    get none. (NegCLIP's swapped-word negatives, Yuksekgonul et al. 2023, made from the structure.)"""
    rng = np.random.default_rng([int(seed), 911])
    out = []
    for c in captions:
        if c.kind == "relation":
            out.append(Caption("relation", c.shapes[::-1], relation=c.relation))
        elif c.kind == "cell":
            other = int(rng.integers(0, len(CELLS) - 1))
            out.append(Caption("cell", c.shapes, cell=other + (other >= c.cell)))
    return out


def batch_loss(model, batch, autocast: bool = True, negatives: bool = False, probe: PositionProbe | None = None,
               probe_weight: float = 0.0):
    """The loss of one batch ``(pixel_values, captions, facts, key)`` of :func:`caption_batches`;
    with ``negatives``, the :func:`hard_negatives` of its captions join as image-to-text negatives;
    with ``probe_weight`` > 0, ``probe_weight`` times the :class:`PositionProbe` loss is added."""
    x, caps, facts, key = batch
    texts = caps + (hard_negatives(caps, key) if negatives else [])
    ids, mask = model.encode([c.text for c in texts])
    positives = torch.from_numpy(caption_truth(texts, facts).T.copy()).to(x.device)   # images x texts
    logits, pooled = clip_logits(model, x, ids, mask, autocast=autocast, return_pooled=True)
    loss = multi_positive_infonce(logits, positives, n_paired=len(caps))
    if probe is not None and probe_weight > 0:
        loss = loss + probe_weight * probe.loss(pooled, facts)
    return loss


def make_optimizer(model, *, lr: float, vision_lr_ratio: float, weight_decay: float, extra=None):
    """AdamW: the image tower (``vision_model``) at ``lr * vision_lr_ratio``, everything else
    (text tower, projections, ``logit_scale``, and the module ``extra`` if given) at ``lr``; weight
    decay on 2+-dimensional tensors only."""
    groups = {}
    named = list(model.named_parameters()) + ([("extra." + n, p) for n, p in extra.named_parameters()] if extra else [])
    for name, p in named:
        if not p.requires_grad:
            continue
        vision = name.startswith("vision_model.")
        groups.setdefault((vision, p.ndim > 1), []).append(p)
    param_groups = [{"params": ps, "lr": lr * (vision_lr_ratio if vision else 1.0),
                     "weight_decay": weight_decay if decay else 0.0}
                    for (vision, decay), ps in groups.items()]
    return torch.optim.AdamW(param_groups, lr=lr)


# ---------------------------------------------------------------------------------- evaluation
def _rate(right: np.ndarray) -> dict:
    """A hit rate with its 95% Wilson interval (:func:`vitlab.stats.rate`), as the report stores it."""
    est = rate(np.asarray(right, dtype=bool))
    return {"rate": est.value, "ci95": [est.low, est.high], "n": est.n}


@torch.no_grad()
def _embed_images(model, images: np.ndarray, batch: int = 250) -> torch.Tensor:
    s = images.shape[1]
    dev = model.logit_scale.device
    out = [model.get_image_features(pixel_values=scenes_to_tensor(images[i : i + batch], (3, s, s), MEAN, STD).to(dev)
                                    ).pooler_output for i in range(0, len(images), batch)]
    return F.normalize(torch.cat(out).float(), dim=-1)


@torch.no_grad()
def _embed_texts(model, texts: list[str], batch: int = 500) -> torch.Tensor:
    out = []
    for i in range(0, len(texts), batch):
        ids, mask = model.encode(texts[i : i + batch])
        out.append(model.get_text_features(input_ids=ids, attention_mask=mask).pooler_output)
    return F.normalize(torch.cat(out).float(), dim=-1)


def _unique_scores(model, img: torch.Tensor, texts: list[str]) -> tuple[torch.Tensor, dict]:
    """Similarity (times the scale) of every image with every distinct text."""
    uniq = sorted(set(texts))
    t = _embed_texts(model, uniq)
    return model.logit_scale.exp() * img @ t.T, {u: i for i, u in enumerate(uniq)}


@torch.no_grad()
def _core_figures(model, one, two, f1, f2, *, pools: int) -> dict:
    """Zero-shot, cell, relation and per-kind retrieval figures on one- and two-object scenes."""
    res = {}
    img1 = _embed_images(model, one.images)
    img2 = _embed_images(model, two.images)
    prompts = zero_shot_prompts(one.classes)
    t_cls = _embed_texts(model, prompts)
    pred = (img1 @ t_cls.T).argmax(-1).cpu().numpy()
    res["zero_shot"] = _rate(pred == one.labels[:, 0])
    res["zero_shot"]["chance"] = 1 / len(prompts)
    top2 = np.sort((img2 @ t_cls.T).topk(2, -1).indices.cpu().numpy(), axis=1)
    res["two_object_both_top2"] = _rate((top2 == np.sort(two.labels, axis=1)).all(1))
    res["two_object_both_top2"]["chance"] = 1 / math.comb(len(prompts), 2)

    # Where is the object? 9 prompts "a {its shape} {cell}" per one-object scene.
    cell_texts = [f"a {c} {CELL_PHRASES[cell]}" for c in one.classes for cell in CELLS]
    t_cell = _embed_texts(model, cell_texts).view(len(one.classes), len(CELLS), -1)
    lab = torch.from_numpy(one.labels[:, 0]).to(img1.device)
    cell_scores = torch.einsum("nd,ncd->nc", img1, t_cell[lab])
    true_cell = f1.cell[np.arange(len(one)), one.labels[:, 0]]
    res["cell_9way"] = _rate(cell_scores.argmax(-1).cpu().numpy() == true_cell)
    res["cell_9way"]["chance"] = 1 / len(CELLS)

    # Which way round? The drawn relation caption against the same words with the shapes swapped.
    rel = make_captions(two, EVAL_SEED, {"relation": 1.0}, facts=f2)
    swapped = [Caption("relation", c.shapes[::-1], relation=c.relation) for c in rel]
    a = (img2 * _embed_texts(model, [c.text for c in rel])).sum(-1)
    b = (img2 * _embed_texts(model, [c.text for c in swapped])).sum(-1)
    res["relation_vs_swapped"] = _rate((a > b).cpu().numpy())
    res["relation_vs_swapped"]["chance"] = 0.5

    # Retrieval within pools of two-object scenes, one caption per scene, per caption kind.
    n = len(two)
    pool = max(2, n // max(1, pools))
    retrieval = {}
    for kind in ("pair", "relation", "cell"):
        caps = make_captions(two, EVAL_SEED + 1, {kind: 1.0}, facts=f2)
        texts = [c.text for c in caps]
        i2t, t2i, chance_i2t, chance_t2i = [], [], [], []
        scores, index = _unique_scores(model, img2, texts)
        for s0 in range(0, n - pool + 1, pool):
            sl = slice(s0, s0 + pool)
            cols = torch.tensor([index[t] for t in texts[sl]], device=scores.device)
            sim = scores[sl][:, cols]                                              # images x captions
            truth = caption_truth(caps[sl], f2.select(np.arange(s0, s0 + pool))).T   # images x captions
            i2t.append(truth[np.arange(pool), sim.argmax(1).cpu().numpy()])
            t2i.append(truth[sim.argmax(0).cpu().numpy(), np.arange(pool)])
            chance_i2t.append(truth.mean(1))
            chance_t2i.append(truth.mean(0))
        retrieval[kind] = {
            "image_to_text": {**_rate(np.concatenate(i2t)), "chance": float(np.concatenate(chance_i2t).mean())},
            "text_to_image": {**_rate(np.concatenate(t2i)), "chance": float(np.concatenate(chance_t2i).mean())},
            "pool": pool,
        }
    res["retrieval"] = retrieval
    return res


@torch.no_grad()
def validate_clip(model, n: int = 256, seed: int = VAL_SEED, probe: PositionProbe | None = None) -> dict:
    """Quick figures logged during training, on ``n`` one- and ``n`` two-object scenes of ``seed``
    (with a ``probe``: also its cell accuracy on the one-object scenes, ``probe_cell``)."""
    was = model.training
    model.eval()
    one, two = make_scenes(n, seed, 1), make_scenes(n, seed, 2)
    f1 = scene_facts(one)
    r = _core_figures(model, one, two, f1, scene_facts(two), pools=max(1, n // 64))
    extra = {}
    if probe is not None:
        s = model.config.vision_config.image_size
        x = scenes_to_tensor(one.images, (3, s, s), MEAN, STD).to(model.logit_scale.device)
        logits = probe(model.vision_model(pixel_values=x).pooler_output)
        logits = logits[torch.arange(n), torch.from_numpy(one.labels[:, 0])]
        extra["probe_cell"] = float((logits.argmax(-1).cpu().numpy() == f1.cell[np.arange(n), one.labels[:, 0]]).mean())
    model.train(was)
    out = {**extra, "zero_shot": r["zero_shot"]["rate"], "both_top2": r["two_object_both_top2"]["rate"],
           "cell_9way": r["cell_9way"]["rate"], "relation_vs_swapped": r["relation_vs_swapped"]["rate"]}
    for kind, v in r["retrieval"].items():
        out[f"r1_{kind}_i2t"] = v["image_to_text"]["rate"]
        out[f"r1_{kind}_t2i"] = v["text_to_image"]["rate"]
    return {k: round(v, 4) for k, v in out.items()}


@torch.no_grad()
def evaluate_clip(model, n: int = 1000, seed: int = EVAL_SEED, pools: int = 10) -> dict:
    """Held-out figures on ``n`` one-object and ``n`` two-object scenes (``make_scenes(n, seed, 1)``,
    ``make_scenes(n, seed, 2)``, difficulty 1), each a rate with its 95% Wilson interval and
    chance level:

    - ``zero_shot``: one-object scenes classified by the 8 prompts ``"a {shape}"``;
    - ``two_object_both_top2``: on two-object scenes, the two present classes' prompts score highest;
    - ``cell_9way``: one-object scenes, the prompt ``"a {shape} {where}"`` with the right cell scores
      highest of the 9 cells (the right shape named);
    - ``relation_vs_swapped``: two-object scenes, a true relation caption (``a circle left of a
      square``) scores above the same words with the shapes swapped;
    - ``retrieval``: two-object scenes in ``pools`` pools, one caption per scene of each kind
      (``pair``, ``relation``, ``cell``); image-to-text R@1 (the best-scoring caption of the pool is
      true of the image) and text-to-image R@1 (the best-scoring image makes the caption true);
      chance is the mean share of true pairs;
    - ``named_object_removed``: on two-object scenes, the score of ``"a {shape}"`` naming one object
      when that object is taken out (:func:`vitlab.shapes.remove_objects`) against when the other
      one is: the rate at which removing the named object costs more, over both objects of every scene.
    """
    was = model.training
    model.eval()
    one, two = make_scenes(n, seed, 1), make_scenes(n, seed, 2)
    f1, f2 = scene_facts(one), scene_facts(two)
    res = {"n": n, "seed": seed, **_core_figures(model, one, two, f1, f2, pools=pools)}

    full = _embed_images(model, two.images)
    without = [_embed_images(model, remove_objects(n, seed, 2, remove=j)) for j in (0, 1)]
    t_cls = _embed_texts(model, zero_shot_prompts(two.classes))
    scale = model.logit_scale.exp()
    own, other = [], []
    for j in (0, 1):
        t = t_cls[torch.from_numpy(two.labels[:, j]).to(full.device)]
        s_full = scale * (full * t).sum(-1)
        own.append((s_full - scale * (without[j] * t).sum(-1)).cpu().numpy())
        other.append((s_full - scale * (without[1 - j] * t).sum(-1)).cpu().numpy())
    own, other = np.concatenate(own), np.concatenate(other)
    res["named_object_removed"] = {**_rate(own > other), "chance": 0.5, "mean_drop_own": float(own.mean()),
                                   "mean_drop_other": float(other.mean())}
    res["logit_scale"] = float(model.logit_scale.exp())
    model.train(was)
    return res


# ---------------------------------------------------------------------------------- card
def _pct(r: dict) -> str:
    lo, hi = r["ci95"]
    return f"{100 * r['rate']:.1f}% [{100 * lo:.1f}, {100 * hi:.1f}]"


def _share(weights: dict, kind: str) -> str:
    total = sum(weights.values())
    return f"{100 * weights.get(kind, 0) / total:.0f}%" if kind in weights else "-"


#: The card's "Why these choices": what the pilots (1 thread on the shared 2-core machine, about 2.5
#: minutes each) showed. Their commands are given, so that they can be rerun.
WHY = [
    "- **Image tower from `shapes-vit-tiny`.** A plain patchify ViT did not learn these scenes from 58k "
    "samples in the sizing runs of the series; `shapes-vit-tiny` already tells the shapes apart, and its "
    "weights carry over exactly (the stem, the blocks, CLS and positions). Zero-shot accuracy with `a {shape}` "
    "was above 95% by step 80 in every pilot.",
    "- **Where the shapes are is the hard part, and the position warm-up is what makes it learnable.** "
    "`shapes-vit-tiny` was trained to say *which* shapes are present: a linear probe of its CLS token finds an "
    "object's 3 x 3 cell in 35% of held-out scenes (chance 11%; `centre` alone is right for 28% of the validation "
    "scenes). Contrastive training then "
    "sits at a saddle: while the image embeddings hardly differ with position, the loss pulls the text "
    "embeddings of `a star on the left` and `a star on the right` together (cosine 0.998 after 400 steps in "
    "a pilot), "
    "and while those are equal the images get no gradient towards position. In pilots of 440 steps of 32 scenes "
    "(`--batch 32 --warmup 0.005 --minutes 0 --val-every 40 --val-n 128 --threads 1`), the cell prompts stayed at "
    "the `centre` prior (28.1% at every validation) with `--position-warmup 0`; with the warm-up at weight 3 "
    "the probe left chance at step 280 and the cell prompts followed (42% at step 320, 72% at step 440), while "
    "zero-shot accuracy dipped to 86-93% (it recovers once the warm-up's weight falls); at weight 1 the probe "
    "was still at 36% at step 440. The warm-up reads the pooled CLS token, the token CLIP's image embedding is "
    "made of, so what it teaches is where the contrastive loss can use it.",
    "- **Every true caption is a positive.** With 8 shapes, a batch of 64 holds many identical captions "
    "(`a star`); CLIP's one-positive loss would push their images apart. The truth of every caption of the "
    "batch for every image is known (`caption_truth`), so each row and column of the similarity matrix is "
    "scored against all its true captions (UniCL's targets).",
    "- **Hard negatives.** A caption is only as informative as the captions it must beat. Scenes with the "
    "same shapes are batched together (`--group`), so a batch's captions differ in where the shapes are, and "
    "each relation or cell caption brings its near miss (`a square left of a circle`, `a star on the right`) "
    "as an extra negative text, as NegCLIP adds captions with swapped words (Yuksekgonul et al. 2023); here "
    "they are made from the captions' structure, and `caption_truth` keeps one that happens to be true of "
    "another image of the batch a positive there.",
    "- **The stem is frozen** (it is `shapes-vit-tiny`'s, trained on these scenes; about 15% of the tower's "
    "multiply-adds) and the rest of the tower is trained at the text tower's learning rate "
    "(`--vision-lr-ratio 1`), since it has to learn positions it was not trained for (the ratio was not "
    "compared in isolation: pilots are too short and too noisy on the shared machine).",
]


def write_card(report: dict, path: str | Path) -> None:
    """The model card (markdown) from a training report (:func:`train`'s, as written to ``--report``)."""
    tr, ev, hist = report["training"], report.get("evaluation"), report["history"]
    arch = tr["arch"]
    lines = [
        "# shapes-clip",
        "",
        "A small [CLIP](https://arxiv.org/abs/2103.00020) that vitlab trains itself on scenes it generates, "
        "with captions it generates, so that chapter 11 can explain an image-text model offline and grade "
        "the explanations against the object masks. It is a Hugging Face `transformers.CLIPModel` "
        "(`vitlab.shapes.clip_model.ShapesCLIPModel`, a subclass that only adds the tokenizer and the "
        "preprocessing): both towers are Hugging Face's classes, so the code that explains it runs on "
        "`openai/clip-vit-base-patch32` unchanged.",
        "",
        "```python",
        "import vitlab",
        "from vitlab.shapes import make_scenes",
        "model = vitlab.load_model(\"shapes-clip\")              # vitlab.shapes.clip_model.load_shapes_clip",
        "s = make_scenes(2, seed=1, n_objects=2)",
        "x = vitlab.preprocess_batch(s.images, model)           # pixel_values, 2 x 3 x 112 x 112",
        "ids, mask = model.encode([\"a circle\", \"a star left of a ring\"])",
        "out = model(pixel_values=x, input_ids=ids, attention_mask=mask)   # .logits_per_image: 2 x 2",
        "```",
        "",
        "## Model",
        "",
        "| | |",
        "|---|---|",
        f"| class | `ShapesCLIPModel(transformers.CLIPModel)`, eager attention in both towers |",
        f"| image tower | `CLIPVisionTransformer`: {arch['vision_layers']} layers of width "
        f"{arch['vision_hidden_size']}, "
        f"{arch['vision_heads']} heads, MLP {arch['vision_intermediate_size']}, exact GELU, LayerNorm eps 1e-6; "
        f"{arch['image_size']} x {arch['image_size']} px in {arch['patch_size']}-px patches: a "
        f"{arch['image_size'] // arch['patch_size']} x {arch['image_size'] // arch['patch_size']} grid + CLS |",
        f"| patch embedding | `vision_model.embeddings.patch_embedding` is `ConvStemPatchEmbedding`: "
        f"{len(arch['stem_widths'])} stride-2 {arch['stem_kernel']}x{arch['stem_kernel']} convolutions with ReLU "
        f"({', '.join(str(w) for w in arch['stem_widths'])} channels) and a 1x1 convolution to "
        f"{arch['vision_hidden_size']}: the stem of `shapes-vit-tiny` with its BatchNorm folded in; its output "
        f"has the patchify convolution's shape, so `CLIPVisionEmbeddings.forward` is unchanged |",
        f"| text tower | `CLIPTextTransformer`: {arch['text_layers']} causal layers of width "
        f"{arch['text_hidden_size']}, "
        f"{arch['text_heads']} heads, MLP {arch['text_intermediate_size']}, at most {arch['max_text_length']} tokens |",
        "| tokens | word level (`vitlab.shapes.captions.CaptionTokenizer`, `model.encode`): `<pad>` = 0, `<unk>`, "
        "`<start>` = 2, the 22 caption words, `<end>` = the largest id = `text_config.eos_token_id`; "
        "`<start> words <end>`, padded on the right, with an attention mask. The text embedding is the `<end>` "
        "token's (the first `eos_token_id`, also `input_ids.argmax(-1)`) |",
        f"| embedding | both towers projected to {arch['projection_dim']} dimensions; score "
        "`logit_scale.exp() * cos(image, text)` |",
        "| input | `vitlab.preprocess(image, model)`: [0, 1] then mean = std = 0.5, no resize or crop for 112 px "
        "scenes (`model.vitlab_data_config`) |",
        f"| parameters | {tr['parameters'] / 1e6:.2f} M; weights stored in fp16 with the `CLIPConfig` and "
        "the vocabulary in the safetensors metadata |",
        "",
        "## Data",
        "",
        "Scenes of `vitlab.shapes.make_scenes` at difficulty 1 (the evaluated setting), "
        f"{100 * (1 - tr['two_frac']):.0f}% with one object and {100 * tr['two_frac']:.0f}% with two, every one "
        "new (seeds >= 1,000,000). Each gets one caption from `vitlab.shapes.captions.make_captions`, naming "
        "shapes and where they are (the generator's colours have no names, so none are used):",
        "",
        "| kind | example | share of the one-object / two-object captions |",
        "|---|---|---|",
        f"| shape | `a circle` | {_share(tr['captions_one'], 'shape')} / {_share(tr['captions_two'], 'shape')} |",
        "| cell | `a circle in the top left` (`at the top`, `on the left`, `in the centre`, ...: the 3 x 3 cell of "
        f"the object's box centre) | {_share(tr['captions_one'], 'cell')} / {_share(tr['captions_two'], 'cell')} |",
        f"| pair | `a circle and a square` | - / {_share(tr['captions_two'], 'pair')} |",
        "| relation | `a circle left of a square` (`right of`, `above`, `below`; along the axis on which the two "
        f"objects lie further apart) | - / {_share(tr['captions_two'], 'relation')} |",
        "",
        "`a {shape}` is a caption of every class: the 8 prompts `a circle` ... `a heart` make the zero-shot "
        "classifier. The masks give only the positions in the captions and the position warm-up's cells (box "
        "centres); they never enter the model or model selection.",
        "",
        "## Training",
        "",
        "```",
        tr["command"],
        "```",
        "",
        f"- {tr['steps_done']} steps of {tr['batch']} scenes ({tr['scenes_seen']:,} scenes), "
        f"**{tr['train_minutes']:.1f} min** of training"
        + (f" (stopped by the {tr['minutes_budget']:g}-minute budget)" if tr["stopped_by_budget"] else "")
        + f" + {ev['minutes'] if ev else 0:.1f} min of held-out evaluation, {tr['threads']} thread(s) on "
        f"{tr['machine']} ({tr['device']}), torch {tr['torch']}, seed {tr['seed']};",
        f"- batches of {tr['batch']} scenes in groups of {tr['group']} with the same shapes (one class, or one "
        "pair), so that the captions of a batch differ in where the shapes are as well as in which: the hard "
        "negatives are in the batch;",
        "- loss: CLIP's symmetric InfoNCE over the batch's image-caption scores, with every caption of the batch "
        "that is true of an image a positive for it (targets spread evenly over a row's or column's positives, "
        "as in UniCL, Yang et al. 2022): identical captions such as `a star` for two star scenes are not pushed "
        "apart (`vitlab.shapes.train_clip.multi_positive_infonce`);",
        f"- temperature learned: `logit_scale` starts at log(1/0.07) and is clipped at log(100) after each "
        f"step (CLIP's rule); it ended at {ev['logit_scale'] if ev else float('nan'):.1f};",
        (f"- image tower from `shapes-vit-tiny` (exact copy of stem, blocks, CLS token, positions and final "
         f"norm; `pre_layrnorm`, which timm's ViT lacks, set to scale {tr['init']['pre_layrnorm_scale']:.3f}, "
         f"the median per-token standard deviation of the embeddings){', stem frozen' if tr['freeze_stem'] else ''}; "
         "text tower and projections random (Hugging Face's initialisation);" if tr["init"].get("vision")
         else "- both towers random (Hugging Face's initialisation, `--vision-init random`);"),
        (f"- position warm-up: for the first {100 * tr['position_warmup_frac']:.0f}% of the run an auxiliary "
         f"cross-entropy of each shape's 3 x 3 cell, read from the pooled CLS token by a linear probe "
         f"(`PositionProbe`, thrown away after training), is added with a weight falling linearly from "
         f"{tr['position_warmup']:g} to 0; after it the loss is CLIP's alone (see \"Why these choices\");"
         if tr["position_warmup"] else "- no position warm-up: the loss is CLIP's alone;"),
        f"- AdamW, peak lr {tr['lr']:g} (image tower x{tr['vision_lr_ratio']:g}), weight decay {tr['weight_decay']:g} "
        f"on matrices, warmup {100 * tr['warmup']:.0f}% then cosine decay to {100 * tr['min_lr_ratio']:g}% of the "
        f"peak, gradient-norm clip {tr['clip']:g}, bf16 autocast{' on the CPU' if tr['device'] == 'cpu' else ''};",
        "- no model selection: the weights are those after the last step, rounded to fp16 before the "
        "evaluation below (so it measures the shipped file).",
        "",
        f"Validation during training ({tr['val_n']} one-object + {tr['val_n']} two-object scenes, seed {VAL_SEED}; "
        "the figures of the evaluation below; the loss is an average over recent steps, warm-up term included):",
        "",
        "| step | scenes | minutes | loss | zero-shot | both top-2 | cell (9-way) | relation vs swapped | "
        "R@1 relation i2t / t2i | probe cell |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for h in hist:
        probe = f"{100 * h['probe_cell']:.1f}%" if "probe_cell" in h else "-"
        lines.append(f"| {h['step']} | {h['scenes']:,} | {h['minutes']:.1f} | {h['loss']:.3f} | "
                     f"{100 * h['zero_shot']:.1f}% | {100 * h['both_top2']:.1f}% | {100 * h['cell_9way']:.1f}% | "
                     f"{100 * h['relation_vs_swapped']:.1f}% | {100 * h['r1_relation_i2t']:.1f}% / "
                     f"{100 * h['r1_relation_t2i']:.1f}% | {probe} |")
    if ev:
        rt = ev["retrieval"]
        lines += [
            "",
            "## Evaluation",
            "",
            f"`vitlab.shapes.train_clip.evaluate_clip(model, n={ev['n']}, seed={ev['seed']})`: {ev['n']} "
            "one-object and "
            f"{ev['n']} two-object held-out scenes at difficulty 1 (training uses seeds >= 1,000,000); 95% Wilson "
            "intervals (scenes of a retrieval pool are scored against each other, so its intervals are "
            "approximate).",
            "",
            "| figure | this model | chance |",
            "|---|---|---|",
            f"| zero-shot accuracy, one-object scenes, prompts `a {{shape}}` | **{_pct(ev['zero_shot'])}** | 12.5% |",
            f"| two-object scenes: both present shapes' prompts score highest | {_pct(ev['two_object_both_top2'])} | "
            f"{100 * ev['two_object_both_top2']['chance']:.1f}% |",
            "| one-object scenes: the right cell of 9 (`a {shape} in the top left`, ...) | "
            f"{_pct(ev['cell_9way'])} | "
            "11.1% |",
            f"| two-object scenes: a true relation caption above the same words with the shapes swapped | "
            f"{_pct(ev['relation_vs_swapped'])} | 50% |",
        ]
        for kind in ("pair", "relation", "cell"):
            for d, name in (("image_to_text", "image -> caption"), ("text_to_image", "caption -> image")):
                r = rt[kind][d]
                lines.append(f"| retrieval R@1, {kind} captions, {name} (pools of {rt[kind]['pool']} two-object "
                             f"scenes) | {_pct(r)} | {100 * r['chance']:.1f}% |")
        no = ev["named_object_removed"]
        lines += [
            f"| two-object scenes, prompt `a {{shape}}` naming one object: removing that object lowers the score "
            f"more than removing the other | {_pct(no)} | 50% |",
            "",
            f"Removing the named object lowers the score of `a {{shape}}` by {no['mean_drop_own']:.2f} on average, "
            f"removing the other object by {no['mean_drop_other']:.2f} (scores are `logit_scale.exp() * cos`, "
            f"scale {ev['logit_scale']:.1f}). The figures are also in `shapes-clip.json` with the training history.",
        ]
    lines += ["", "## Why these choices", "", *WHY, "", "## Reproduce"]
    lines += [
        "",
        "```",
        f".venv/bin/python -m vitlab.shapes.train_clip      # writes vitlab/weights/shapes-clip.{{safetensors,json,md}}",
        "```",
        "",
        "`--quick` is the smoke test (a few steps, nothing written); `--steps`, `--minutes`, `--batch`, "
        "`--threads`, `--seed`, `--out` and the recipe's settings are options (`--help`). On a busy machine use "
        "`--threads 1`. With `--minutes` the number of steps depends on the machine's speed, so a rerun on "
        "another machine trains a different number of steps.",
    ]
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text("\n".join(lines) + "\n")


# ---------------------------------------------------------------------------------- loop
@torch.no_grad()
def _round_to_fp16(model) -> None:
    for p in model.parameters():
        p.copy_(p.half().float())


def train(args) -> dict:
    """Train ``shapes-clip`` as ``args`` (:func:`parse_args`) say; returns the report with the model
    under ``"model_object"``."""
    from tqdm.auto import tqdm

    device = start(args)
    arch = {**CLIP_ARCH, **json.loads(args.arch)}
    arch = {k: list(v) if isinstance(v, tuple) else v for k, v in arch.items()}
    model = build_shapes_clip(arch, vit=None if args.vision_init == "random" else "shapes-vit-tiny").to(device).train()
    init = dict(model.vitlab_init)
    if args.freeze_stem:
        model.vision_model.embeddings.patch_embedding.requires_grad_(False)
    probe = PositionProbe(model.config.vision_config.hidden_size).to(device) if args.position_warmup else None
    opt = make_optimizer(model, lr=args.lr, vision_lr_ratio=args.vision_lr_ratio, weight_decay=args.weight_decay,
                         extra=probe)
    factor = lr_schedule(args.steps, args.warmup, args.min_lr_ratio)
    base_lrs = [g["lr"] for g in opt.param_groups]
    batches = caption_batches(batch=args.batch, two_frac=args.two_frac, group=args.group, chunk=args.chunk,
                              seed=args.seed, kinds_one=parse_weights(args.captions_one),
                              kinds_two=parse_weights(args.captions_two))
    trainable = [p for g in opt.param_groups for p in g["params"]]
    bar = tqdm(total=args.steps, desc="train shapes-clip", mininterval=5.0, disable=args.no_progress)
    log = bar.write
    history, ema = [], None
    t0, c0 = time.time(), time.process_time()
    budget = 60.0 * args.minutes if args.minutes else float("inf")
    step, stopped_by_budget = 0, False
    while step < args.steps:
        elapsed = time.time() - t0            # validation included
        progress = max(step / args.steps, elapsed / budget)
        if progress >= 1.0:
            stopped_by_budget = True
            break
        f = factor(min(args.steps - 1, int(progress * args.steps)))
        for g, lr in zip(opt.param_groups, base_lrs):
            g["lr"] = lr * f
        # position warm-up: the probe's weight falls linearly from --position-warmup to 0 over
        # the first --position-warmup-frac of the run
        w = args.position_warmup * max(0.0, 1.0 - progress / args.position_warmup_frac) if probe is not None else 0.0
        loss = batch_loss(model, next(batches), autocast=args.autocast, negatives=args.hard_negatives, probe=probe,
                          probe_weight=w)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if args.clip:
            torch.nn.utils.clip_grad_norm_(trainable, args.clip)
        opt.step()
        with torch.no_grad():
            model.logit_scale.clamp_(max=_LOG_MAX_SCALE)
        step += 1
        value = loss.item()
        ema = value if ema is None else 0.98 * ema + 0.02 * value
        bar.update(1)
        bar.set_postfix(loss=f"{ema:.3f}", refresh=False)
        if args.val_every and step % args.val_every == 0:
            rec = {"step": step, "scenes": step * args.batch, "minutes": round((time.time() - t0) / 60, 2),
                   "cpu_minutes": round((time.process_time() - c0) / 60, 2), "loss": round(ema, 4),
                   "lr": opt.param_groups[0]["lr"], "logit_scale": round(float(model.logit_scale.detach().exp()), 2),
                   **validate_clip(model, n=args.val_n, probe=probe)}
            history.append(rec)
            log(json.dumps(rec))
            sys.stdout.flush()
    bar.close()
    if args.val_every and (not history or history[-1]["step"] != step):
        history.append({"step": step, "scenes": step * args.batch, "minutes": round((time.time() - t0) / 60, 2),
                        "cpu_minutes": round((time.process_time() - c0) / 60, 2), "loss": round(ema, 4),
                        "lr": opt.param_groups[0]["lr"],
                        "logit_scale": round(float(model.logit_scale.detach().exp()), 2),
                        **validate_clip(model, n=args.val_n, probe=probe)})
        log(json.dumps(history[-1]))
    minutes = (time.time() - t0) / 60
    model = model.cpu().eval()
    model.requires_grad_(True)          # the stem was frozen for training only
    _round_to_fp16(model)
    info = {
        "command": "python -m vitlab.shapes.train_clip " + " ".join(args.argv), "seed": args.seed,
        "steps": args.steps, "steps_done": step, "batch": args.batch, "scenes_seen": step * args.batch,
        "two_frac": args.two_frac, "group": args.group, "captions_one": parse_weights(args.captions_one),
        "captions_two": parse_weights(args.captions_two), "val_n": args.val_n, "lr": args.lr,
        "vision_lr_ratio": args.vision_lr_ratio,
        "weight_decay": args.weight_decay, "warmup": args.warmup, "min_lr_ratio": args.min_lr_ratio,
        "clip": args.clip, "hard_negatives": args.hard_negatives,
        "position_warmup": args.position_warmup, "position_warmup_frac": args.position_warmup_frac,
        "freeze_stem": args.freeze_stem, "vision_init": args.vision_init,
        "autocast": args.autocast, "minutes_budget": args.minutes, "stopped_by_budget": stopped_by_budget,
        "train_minutes": round(minutes, 2), "arch": arch, "init": init,
        "parameters": sum(p.numel() for p in model.parameters()), "threads": args.threads, "device": str(device),
        "torch": torch.__version__, "machine": platform.processor() or platform.machine(),
        "logit_scale": "learned, init log(1/0.07), clipped at log(100)",
    }

    def save(m, path, arch, extra):
        save_shapes_clip(m, path, arch=arch, extra=extra)

    result = finish_run(model, "shapes-clip", info, history, args, evaluate_clip, arch, minutes, log, save=save)
    if args.card:
        write_card(result, args.card)
        log(f"wrote {args.card}")
    return result


def parse_args(argv=None):
    p = parser("python -m vitlab.shapes.train_clip", __doc__, out=CLIP_PATH, steps=4000, batch=64, lr=1e-3,
               weight_decay=0.05, val_n=256, eval_n=1000, batch_help="scenes (and captions) per step", chunk=1024,
               arch_example='{"text_layers": 2}', val_help="validation scenes (one- and two-object, each)",
               eval_help="held-out scenes (one- and two-object, each) evaluated at the end (0: skip)",
               quick_help="smoke test: 20 steps of 16 scenes, nothing written (explicit options win)")
    p.add_argument("--minutes", type=float, default=25.0,
                   help="wall-clock budget of the training loop in minutes, validation included (0: none); the "
                        "schedule follows whichever of steps and time runs out first")
    p.add_argument("--card", default=str(CARD_PATH),
                   help="where to write the model card ('' to skip; default: next to --out)")
    p.add_argument("--two-frac", type=float, default=0.5, help="share of two-object scenes in a batch")
    p.add_argument("--captions-one", default="shape:1,cell:1",
                   help="caption kinds drawn for one-object scenes, with weights")
    p.add_argument("--captions-two", default="shape:0.5,cell:1,pair:1,relation:2",
                   help="caption kinds drawn for two-object scenes, with weights")
    p.add_argument("--group", type=int, default=8,
                   help="scenes with the same shapes batched together (in-batch hard negatives; 1: none)")
    p.add_argument("--vision-lr-ratio", type=float, default=1.0, help="image tower lr = --lr times this")
    p.add_argument("--freeze-stem", action=argparse.BooleanOptionalAction, default=True,
                   help="keep the convolutional stem fixed")
    p.add_argument("--hard-negatives", action=argparse.BooleanOptionalAction, default=True,
                   help="add each relation / cell caption's swapped-position version as an image-to-text negative")
    p.add_argument("--position-warmup", type=float, default=3.0,
                   help="weight of an auxiliary loss (a linear probe of each shape's 3 x 3 cell from the pooled CLS "
                        "token, PositionProbe) at the start, falling linearly to 0 (0: none)")
    p.add_argument("--position-warmup-frac", type=float, default=0.3,
                   help="the fraction of the run over which the position warm-up's weight falls to 0")
    p.add_argument("--vision-init", choices=("shapes-vit-tiny", "random"), default="shapes-vit-tiny")
    p.add_argument("--autocast", action=argparse.BooleanOptionalAction, default=True,
                   help="bf16 autocast for the towers")
    args = parse(p, argv, quick=dict(steps=20, batch=16, chunk=64, val_every=10, val_n=32, eval_n=64, minutes=0))
    given = {a.split("=")[0] for a in args.argv}
    if args.quick and "--card" not in given:
        args.card = ""
    if args.out and "--out" in given:   # the report and the card go next to the weights unless given
        if "--report" not in given:
            args.report = str(Path(args.out).with_suffix(".json"))
        if "--card" not in given:
            args.card = str(Path(args.out).with_suffix(".md"))
    if not 0 <= args.two_frac <= 1:
        p.error(f"--two-frac must be in [0, 1], got {args.two_frac}")
    try:
        parse_weights(args.captions_one)
        parse_weights(args.captions_two)
    except ValueError as e:
        p.error(str(e))
    if set(parse_weights(args.captions_one)) - {"shape", "cell"}:
        p.error("--captions-one takes shape and cell captions only (one object)")
    if args.group < 1:
        p.error(f"--group must be >= 1, got {args.group}")
    if args.position_warmup < 0 or not 0 < args.position_warmup_frac <= 1:
        p.error("--position-warmup must be >= 0 and --position-warmup-frac in (0, 1]")
    if args.minutes < 0:
        p.error(f"--minutes must be >= 0, got {args.minutes}")
    return args


def main(argv=None):
    train(parse_args(argv))


if __name__ == "__main__":
    main()
