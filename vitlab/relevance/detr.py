"""Relevance and the paper's baselines for Hugging Face DETR (encoder-decoder; chapter 10), and every
method's map of every detection graded against the scenes' objects (:func:`grade_detr`)."""
from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

from vitlab.compat import renamed_arguments
from vitlab.inputs import batches, check_images
from vitlab.relevance.bimodal import (
    BIMODAL_METHODS, DetectionMaps, _attention_grads, _backbone_prefix, _checked_methods, _events, _recorded_forward,
    _rollout, _sizes, attention_matrix_gradcam, last_capture, require_family,
)
from vitlab.relevance.engine import propagate, read_rows


# --- DETR ------------------------------------------------------------------------------------------
def _detr_forward(model, inputs, pixel_mask, method: str, grad: bool, backbone: bool = False):
    """Checks, then one recorded forward of the pixel batch ``inputs``: ``(rec, logits B x queries x
    (classes + 1))``."""
    require_family(model, "detr", method)
    if not isinstance(inputs, torch.Tensor) or inputs.ndim != 4:
        got = tuple(inputs.shape) if isinstance(inputs, torch.Tensor) else type(inputs).__name__
        raise ValueError(f"{method}: inputs must be the images, a tensor B x 3 x H x W, got {got}")
    check_images(inputs, method)  # empty, not float, NaN or infinite
    _check_pixel_mask(pixel_mask, inputs, method)
    kwargs = {"pixel_values": inputs} if pixel_mask is None else {"pixel_values": inputs, "pixel_mask": pixel_mask}
    rec, out = _recorded_forward(model, kwargs, grad, method, through_pixels=backbone)
    logits = getattr(out, "logits", None)
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"{method} explains detections, but {type(model).__name__} returned no class logits: "
                        "use DetrForObjectDetection")
    return rec, logits


def _check_pixel_mask(pixel_mask, inputs: torch.Tensor, method: str) -> None:
    """DETR's ``pixel_mask``: None, or ``B x H x W`` of 1 (a pixel) / 0 (padding) for the images ``inputs``."""
    if pixel_mask is None:
        return
    B, _, H, W = inputs.shape
    if not isinstance(pixel_mask, torch.Tensor) or tuple(pixel_mask.shape) != (B, H, W):
        got = tuple(pixel_mask.shape) if isinstance(pixel_mask, torch.Tensor) else type(pixel_mask).__name__
        raise ValueError(f"{method}: pixel_mask must be B x H x W = {B} x {H} x {W} (one mask per image of "
                         f"inputs), got {got}")
    if not bool(((pixel_mask == 0) | (pixel_mask == 1)).all()):
        raise ValueError(f"{method}: pixel_mask must hold 1 (a pixel of the image) or 0 (padding)")


def check_threshold(threshold, method: str) -> float:
    """``threshold`` as a float, after checking it is a probability in [0, 1) (a real number,
    not a string or a bool): a detection's best class probability must exceed it."""
    if isinstance(threshold, bool) or not isinstance(threshold, numbers.Real) or not 0 <= threshold < 1:
        raise ValueError(f"{method}: threshold must be a probability in [0, 1), got {threshold!r}")
    return float(threshold)


def _detr_queries(logits: torch.Tensor, target, threshold: float, method: str):
    """Per image ``(queries, labels, probabilities)`` to explain, ``target`` the queries asked for
    (see :func:`detr_relevance`)."""
    B, Q, _ = logits.shape
    probs = logits.detach().softmax(-1)[..., :-1]  # the last class is "no object"
    best, labels = probs.max(-1)  # B x Q
    if target is None:
        threshold = check_threshold(threshold, method)
        chosen = [torch.nonzero(best[b] > threshold).flatten() for b in range(B)]
        if not any(len(c) for c in chosen):
            raise ValueError(
                f"{method}: no object detected: no query's best class has a probability above threshold={threshold} "
                f"in any image (highest: {float(best.max()):.3f}); lower threshold or pass target=[...] (query indices)")
    else:
        chosen = [c.to(best.device) for c in _checked_queries(target, B, Q, method)]
    return [(c, labels[b, c], best[b, c]) for b, c in enumerate(chosen)]


def _checked_queries(target, B: int, Q: int, method: str) -> list[torch.Tensor]:
    def as_indices(v, where):
        t = torch.as_tensor(v) if not (isinstance(v, Sequence) and len(v) == 0) else torch.zeros(0, dtype=torch.long)
        if t.dtype == torch.bool or t.is_floating_point() or t.is_complex() or t.ndim > 1:
            raise ValueError(f"{method}: {where} must be query indices (ints), got {v!r}")
        t = t.reshape(-1).long()
        if t.numel() and (t.min() < 0 or t.max() >= Q):
            raise ValueError(f"{method}: {where} holds query {int(t[(t < 0) | (t >= Q)][0])}; the model has "
                             f"queries 0 .. {Q - 1}")
        return t

    def is_index(v):
        return (isinstance(v, int) and not isinstance(v, bool)) or (isinstance(v, torch.Tensor) and v.ndim == 0)

    def is_number(v):
        return isinstance(v, numbers.Number) or (isinstance(v, torch.Tensor) and v.ndim == 0)

    usage = "an int or a list of ints (the same queries in every image), or one list per image"
    if is_index(target) or (isinstance(target, torch.Tensor) and target.ndim == 1):
        per_image = [as_indices(target, "target")] * B
    elif isinstance(target, (Sequence, torch.Tensor)) and not isinstance(target, (str, bytes)):
        if all(is_index(v) for v in target):
            per_image = [as_indices(list(target), "target")] * B
        elif any(is_number(v) for v in target):  # e.g. [0.0] or [1, True]: numbers, but not indices
            raise ValueError(f"{method}: target must be query indices (ints), got {target!r}")
        elif len(target) != B:
            raise ValueError(f"{method}: target has {len(target)} lists for a batch of {B} images")
        else:
            per_image = [as_indices(q, f"target[{b}]") for b, q in enumerate(target)]
    else:
        raise ValueError(f"{method}: target must be {usage}, got {target!r}")
    if not any(len(q) for q in per_image):
        raise ValueError(f"{method}: target selects no query in any image")
    return per_image


def _slot_grad_output(logits: torch.Tensor, found) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The K scores of one batched backward: slot k holds, for every image b, the logit of its
    k-th explained query's class (zero weights where the image has fewer than k + 1).
    Returns ``(grad_output K x B x Q x C, query index K x B, K)``."""
    B = logits.shape[0]
    K = max(len(q) for q, _, _ in found)
    grad_output = torch.zeros(K, *logits.shape, dtype=logits.dtype, device=logits.device)
    index = torch.zeros(K, B, dtype=torch.long, device=logits.device)
    for b, (q, labels, _) in enumerate(found):
        k = torch.arange(len(q), device=logits.device)
        grad_output[k, b, q.to(logits.device), labels.to(logits.device)] = 1
        index[k, b] = q.to(logits.device)
    return grad_output, index, K


def _per_image(found, rows: torch.Tensor, grid) -> list[DetectionMaps]:
    """``rows``: ``K x B x tokens`` (slot k of image b) -> one :class:`DetectionMaps` per image."""
    out = []
    for b, (q, labels, probs) in enumerate(found):
        maps = rows[: len(q), b].reshape(len(q), *grid)
        out.append(DetectionMaps(q, labels, probs, maps))
    return out


def _detr_grads(logits, found, captures, method):
    grad_output, index, K = _slot_grad_output(logits, found)
    if K == 1:  # one query per image: a plain backward
        grads = _attention_grads(logits, grad_output[0], captures, batched=False, method=method)
        grads = [None if g is None else g.unsqueeze(0) for g in grads]
    else:
        grads = _attention_grads(logits, grad_output, captures, batched=True, method=method)
    return grads, index, K


@renamed_arguments(pixel_values="inputs", queries="target")
def detr_relevance(model, inputs: torch.Tensor, target=None, threshold: float = 0.9,
                   pixel_mask: torch.Tensor | None = None, backbone: bool = False) -> list[DetectionMaps]:
    """Generic attention relevance of each detected object of DETR (Chefer, Gur & Wolf 2021).

    For each image and each explained object query j with best class c (the "no object"
    class left out): the row ``R^{qi}[j]`` after :func:`propagate` over the encoder's
    self-attention and, per decoder layer, the queries' self-attention and their
    cross-attention to the image tokens, for the score ``logit[j, c]``, on the feature grid.

    Several queries of one image need several gradients (the score differs per query, and
    so does every layer's eq. 5 weighting). Instead of repeating the image as batch items (K
    forwards' worth of work for K queries), this runs **one forward** for the batch and
    **one backward call** with K stacked scores (``torch.autograd.grad(...,
    is_grads_batched=True)``, vmapped over the score: slot k explains the k-th query of every
    image at once, images being independent), then propagates the K x B relevance problems
    as one batch. K = the most queries any image has; with K = 1 it is a plain backward.

    Args:
        model: ``DetrForObjectDetection`` (e.g. ``facebook/detr-resnet-50`` or vitlab's
            ``shapes-detr``), run in eval mode; left exactly as it was.
        inputs: ``B x 3 x H x W``, preprocessed images (the model's ``pixel_values``).
        target: the object queries to explain: None (every query whose best class probability
            exceeds ``threshold``, as DETR's demo keeps them), an int or a list of ints for
            every image, or one list per image.
        threshold: the probability a detection must exceed (default 0.9, the paper's).
        pixel_mask: DETR's optional ``B x H x W`` mask of valid pixels (1) and padding (0).
            The maps then lie on the padded image's feature grid, 0 on the padding. DETR's
            own computation is not exactly independent of padding (its backbone and position
            encoding see the padded image: on random-initialised DETRs, in float64, the raw
            cross-attention of an image alone and padded differs by 5e-5 to 3e-3 relative),
            so a padded image's maps equal its maps alone only to about that order.
        backbone: also carry relevance through the self-attention of a ViT backbone (vitlab's
            ``shapes-detr``): its blocks are earlier self-attention layers of the image
            modality over all the ViT's tokens (feature token k = patch k); the maps are read
            on its patches.

    Returns:
        One :class:`DetectionMaps` per image (``maps``: ``K x h x w``). An image with no
        detection gets K = 0 entries while another image of the batch has some.

    Raises:
        ValueError: no query to explain in any image (the message gives the highest
            probability), bad ``target`` or ``threshold``, a backbone that does not fit.
        TypeError: not a DETR detector (``DetrModel`` has no class logits).
    """
    method = "detr_relevance"
    rec, logits = _detr_forward(model, inputs, pixel_mask, method, grad=True, backbone=backbone)
    found = _detr_queries(logits, target, threshold, method)
    captures = [c for c in rec.events if backbone or c.stream != "backbone"]
    grid = rec.feature_grid
    image_tokens = rec.stream("encoder")[0].attention.shape[-1] if rec.stream("encoder") else \
        rec.stream("cross")[0].attention.shape[-1]
    prefix = _backbone_prefix(rec, image_tokens, method) if backbone else 0
    if backbone:
        grid = rec.layout.grid
    grads, index, K = _detr_grads(logits, found, captures, method)
    steps = _events(captures, grads, "image", prefix, slots=K)
    rows = propagate(steps, _sizes(steps)).rows("queries", "image", index)[..., prefix:]  # K x B x tokens
    return _per_image(found, rows, grid)


@renamed_arguments(pixel_values="inputs", queries="target")
def detr_raw_attention(model, inputs: torch.Tensor, target=None, threshold: float = 0.9,
                       pixel_mask: torch.Tensor | None = None) -> list[DetectionMaps]:
    """Raw attention baseline: row j of the last decoder layer's cross-attention, heads
    averaged (the reference's ``generate_raw_attn``). One forward, no gradient; ``target`` and
    output as :func:`detr_relevance`."""
    method = "detr_raw_attention"
    rec, logits = _detr_forward(model, inputs, pixel_mask, method, grad=False)
    found = _detr_queries(logits, target, threshold, method)
    cam = last_capture(rec, "cross", method).attention.mean(dim=1)  # B x Q x N
    return [DetectionMaps(q, l, p, cam[b, q].reshape(len(q), *rec.feature_grid)) for b, (q, l, p) in enumerate(found)]


@renamed_arguments(pixel_values="inputs", queries="target")
def detr_rollout(model, inputs: torch.Tensor, target=None, threshold: float = 0.9,
                 pixel_mask: torch.Tensor | None = None) -> list[DetectionMaps]:
    """Rollout baseline for DETR, as the reference's ``generate_rollout`` computes it.

    Heads averaged; ``E`` = rollout of the encoder's self-attention layers
    (``rownorm(a_L + I) ... rownorm(a_1 + I)``), ``D`` = rollout of the decoder's
    self-attention layers (queries), ``C`` = the last decoder layer's cross-attention:
    the map of query j is row j of ``D^T · C · E``. The earlier cross-attention layers do not
    enter. One forward, no gradient; ``target`` and output as :func:`detr_relevance`.
    """
    method = "detr_rollout"
    rec, logits = _detr_forward(model, inputs, pixel_mask, method, grad=False)
    found = _detr_queries(logits, target, threshold, method)
    C = last_capture(rec, "cross", method).attention.mean(dim=1)  # B x Q x N
    E = _rollout([c.attention.mean(dim=1) for c in rec.stream("encoder")], C.shape[-1], C)
    D = _rollout([c.attention.mean(dim=1) for c in rec.stream("decoder")], C.shape[-2], C)
    R = D.mT @ C @ E
    return [DetectionMaps(q, l, p, R[b, q].reshape(len(q), *rec.feature_grid)) for b, (q, l, p) in enumerate(found)]


@renamed_arguments(pixel_values="inputs", queries="target")
def detr_gradcam(model, inputs: torch.Tensor, target=None, threshold: float = 0.9,
                 pixel_mask: torch.Tensor | None = None) -> list[DetectionMaps]:
    """GradCAM baseline on the last decoder layer's cross-attention (the reference's
    ``generate_attn_gradcam``): row j of :func:`attention_matrix_gradcam` with the gradient of
    query j's class logit. One forward, one (batched over queries, as in
    :func:`detr_relevance`) backward to that attention map only. With a ``pixel_mask``, the
    head weights average the gradient over the feature positions of real pixels only (the
    positions DETR itself masks: ``pixel_mask`` resized to the feature grid, nearest), so
    padding an image does not dilute them."""
    method = "detr_gradcam"
    rec, logits = _detr_forward(model, inputs, pixel_mask, method, grad=True)
    found = _detr_queries(logits, target, threshold, method)
    cross = last_capture(rec, "cross", method)
    (g,), index, K = _detr_grads(logits, found, [cross], method)
    A = cross.attention.detach().expand(K, *cross.attention.shape)
    entries = None
    if pixel_mask is not None:  # as DetrConvModel masks its feature map
        real = torch.nn.functional.interpolate(pixel_mask[None].float(), size=rec.feature_grid)[0] > 0
        entries = real.flatten(1)[:, None, None, :].to(device=A.device)  # B x 1 x 1 x N
    cam = attention_matrix_gradcam(A, torch.zeros_like(A) if g is None else g, entries)  # K x B x Q x N
    rows = read_rows(cam, index)  # K x B x N
    return _per_image(found, rows, rec.feature_grid)


# ---------------------------------------------------------------------------------------------
# Chapter 10: every method's map of every detection, graded against the scenes' objects
# ---------------------------------------------------------------------------------------------


def _detr_methods() -> dict:
    return {
        "relevance": detr_relevance,
        "relevance + backbone": lambda m, x, target: detr_relevance(m, x, target=target, backbone=True),
        "raw attention": detr_raw_attention,
        "rollout": detr_rollout,
        "GradCAM": detr_gradcam,
    }


@renamed_arguments(x="inputs")
def detr_detections(model, inputs: torch.Tensor, threshold: float = 0.9, batch_size: int = 100) -> list[dict]:
    """DETR's detections per image: ``{"queries", "labels", "scores", "boxes"}`` (boxes
    ``(x0, y0, x1, y1)`` in [0, 1]) for the queries whose best real class has a probability
    above ``threshold`` (the "no object" class left out), for the images ``inputs`` (``B x 3 x H x W``).
    One forward per batch, no gradient."""
    from vitlab.record import eval_mode

    method = "detr_detections"
    require_family(model, "detr", method)
    threshold = check_threshold(threshold, method)
    check_images(inputs, method)
    out = []
    with torch.no_grad(), eval_mode(model):
        for s in batches(inputs.shape[0], batch_size):
            res = model(pixel_values=inputs[s])
            prob = res.logits.softmax(-1)[..., :-1]
            scores, labels = prob.max(-1)
            cx, cy, w, h = res.pred_boxes.unbind(-1)
            boxes = torch.stack([cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2], -1)
            for b in range(scores.shape[0]):
                keep = torch.nonzero(scores[b] > threshold).flatten()
                out.append({"queries": keep, "labels": labels[b, keep], "scores": scores[b, keep],
                            "boxes": boxes[b, keep]})
    return out


@renamed_arguments(x="inputs", queries="target")
def detr_method_maps(model, inputs: torch.Tensor, target, methods=BIMODAL_METHODS, batch_size: int = 100) -> dict:
    """Every method's map of every given query: method -> ``D x gh x gw`` (detections in image
    order, then query order), for the images ``inputs``. ``target``: one list of query indices per image (e.g.
    ``[d["queries"] for d in detr_detections(...)]``). The ``relevance + backbone`` maps lie on
    the backbone's patch grid, the others on DETR's feature grid (the same grid for
    ``shapes-detr``).

    The gradient methods run one backward per batch with K slots, K = the most detections of
    any image in the batch; so the images are batched by their number of detections (fewest
    first; images without any are skipped), which keeps K close to every image's own count.
    With no detection in any image every entry is ``0 x gh x gw``, the grid read from the
    method's map of query 0 of the first image (one extra forward per method).
    """
    methods = _checked_methods(methods)
    check_images(inputs, "detr_method_maps")
    table = _detr_methods()
    if isinstance(target, (str, bytes)) or not hasattr(target, "__len__") or len(target) != inputs.shape[0]:
        got = f"{len(target)} lists" if hasattr(target, "__len__") else type(target).__name__
        raise ValueError(f"detr_method_maps: target must hold one list of query indices per image: {got} for "
                         f"{inputs.shape[0]} images")
    queries = [torch.as_tensor(q, dtype=torch.long).reshape(-1) for q in target]
    counts = np.array([len(q) for q in queries])
    order = [i for i in np.argsort(counts, kind="stable") if counts[i] > 0]
    out = {}
    for name in methods:
        if not order:  # nothing detected: no map, on the grid this method's maps have
            out[name] = table[name](model, inputs[:1], target=[torch.zeros(1, dtype=torch.long)])[0].maps[:0]
            continue
        per_image: list[torch.Tensor | None] = [None] * len(queries)
        for s in batches(len(order), batch_size):
            idx = order[s]
            for i, d in zip(idx, table[name](model, inputs[idx], target=[queries[i] for i in idx])):
                per_image[i] = d.maps
        out[name] = torch.cat([m for m in per_image if m is not None])
    return out


class DetectionGrades(NamedTuple):
    """Where each method's map of each detection points (from :func:`grade_detr`).

    Attributes:
        methods: the method names, in row order.
        scene, query, label, score: ``D`` each: the image, the query, its class and probability.
        box: ``D x 4`` predicted box ``(x0, y0, x1, y1)`` in [0, 1].
        matched: ``D``, the object (0 or 1) whose box overlaps the detection's most (-1: neither).
        iou: ``D``, that overlap (intersection over union with the object's mask box).
        class_correct: ``D`` bool, the detection's class is the matched object's.
        on_detected: ``M x D`` bool, the map's top patch lies on the matched object.
        on_other: ``M x D`` bool, it lies on the scene's other object.
        chance: ``D``, the hit rate of a random top patch on the matched object.
        maps: method -> ``D x gh x gw``.
    """

    methods: tuple
    scene: np.ndarray
    query: np.ndarray
    label: np.ndarray
    score: np.ndarray
    box: np.ndarray
    matched: np.ndarray
    iou: np.ndarray
    class_correct: np.ndarray
    on_detected: np.ndarray
    on_other: np.ndarray
    chance: np.ndarray
    maps: dict


def grade_detr(model, x: torch.Tensor, masks, labels, threshold: float = 0.9, methods=BIMODAL_METHODS,
               batch_size: int = 100, min_coverage: float = 0.5) -> DetectionGrades:
    """Detect (:func:`detr_detections`), explain every detection with every method, and grade
    the maps against the two objects of each scene (``masks``: ``S x 2 x H x W``, ``labels``:
    ``S x 2`` classes). Each detection is matched to the object whose mask's bounding box it
    overlaps most (duplicates of one object all match it); a detection overlapping neither
    (``matched`` -1) counts as a miss for every method."""
    from vitlab.localization import as_cpu_tensor, box_iou, chance_pointing, pointing_game
    from vitlab.shapes.qa import object_boxes

    masks = as_cpu_tensor(masks)
    labels = np.asarray(labels)
    if masks.ndim != 4 or masks.shape[:2] != (x.shape[0], 2) or labels.shape != (x.shape[0], 2):
        raise ValueError(f"need masks S x 2 x H x W and labels S x 2 for the {x.shape[0]} scenes of x; "
                         f"got masks {tuple(masks.shape)}, labels {labels.shape}")
    dets = detr_detections(model, x, threshold, batch_size)
    if not any(len(d["queries"]) for d in dets):
        raise ValueError(f"grade_detr: nothing to grade: no query's best class has a probability above "
                         f"threshold={threshold} in any of the {x.shape[0]} images; lower the threshold")
    maps = detr_method_maps(model, x, [d["queries"] for d in dets], methods, batch_size)
    methods = tuple(maps)
    H, W = masks.shape[-2:]
    gt = object_boxes(masks.numpy().astype(bool)) / np.array([W, H, W, H], dtype=np.float32)  # S x 2 x 4
    scene = np.concatenate([np.full(len(d["queries"]), i) for i, d in enumerate(dets)]).astype(np.int64)
    cat = lambda k: torch.cat([d[k] for d in dets]).numpy()  # noqa: E731
    query, label, score, box = cat("queries"), cat("labels"), cat("scores"), cat("boxes")
    iou = np.stack([box_iou(box[i:i + 1], gt[s])[0] for i, s in enumerate(scene)]) if len(scene) else np.zeros((0, 2))
    matched = np.where(iou.max(1) > 0, iou.argmax(1), -1) if len(scene) else np.zeros(0, dtype=np.int64)
    best_iou = iou.max(1) if len(scene) else np.zeros(0)
    m = np.clip(matched, 0, 1)
    class_correct = (matched >= 0) & (label == labels[scene, m])
    m_det = masks[torch.as_tensor(scene), torch.as_tensor(m)]
    m_oth = masks[torch.as_tensor(scene), torch.as_tensor(1 - m)]
    ok = matched >= 0
    on_det, on_oth = [], []
    for name in methods:
        on_det.append(pointing_game(maps[name], m_det, min_coverage).numpy() & ok)
        on_oth.append(pointing_game(maps[name], m_oth, min_coverage).numpy() & ok)
    grid = tuple(next(iter(maps.values())).shape[1:])
    return DetectionGrades(methods, scene, query, label, score, box, matched, best_iou, class_correct,
                           np.stack(on_det), np.stack(on_oth), chance_pointing(m_det, grid, min_coverage).numpy(),
                           maps)
