"""Helpers the notebooks use to compute and grade many maps at once.

Not methods of their own: they call the methods of :mod:`vitlab.attention`,
:mod:`vitlab.rollout` and :mod:`vitlab.relevance` (which record each batch through
:mod:`vitlab.record`), compute every setting or method from the same recorded attention (and
gradient), and grade the maps with :mod:`vitlab.localization`. A table of many settings costs
one forward (and one backward) per batch.
"""
from __future__ import annotations

from typing import NamedTuple, Sequence

import numpy as np
import torch

from vitlab.faithfulness import _batches
from vitlab.localization import (
    _as_tensor, attention_entropy, grade_asked, grade_maps, layer_mass_on_object, object_area, pointing_game,
)


class CLSProfile(NamedTuple):
    """Where the class token looks, layer by layer, from :func:`cls_attention_profile`.

    Attributes:
        mass: ``B x layers x heads`` share of each head's CLS-to-patch attention on the object.
        entropy: ``B x layers x heads`` normalised entropy of the same maps (1 = uniform).
        area: ``B`` object area share (the chance level of ``mass``).
    """

    mass: torch.Tensor
    entropy: torch.Tensor
    area: torch.Tensor


def cls_attention_profile(model, x: torch.Tensor, masks, batch_size: int = 50) -> CLSProfile:
    """Per sample, layer and head: the class token's attention share on the object and its entropy.

    ``x``: ``B x 3 x H x W`` inputs; ``masks``: ``B x H' x W'`` object masks at the model's
    input resolution (or any multiple of the patch grid). One forward per batch of
    ``batch_size`` (:func:`vitlab.attention.cls_attention`).
    """
    from vitlab.attention import cls_attention

    masks = _as_tensor(masks)
    if masks.ndim != 3 or masks.shape[0] != x.shape[0]:
        raise ValueError(f"need one B x H x W mask per input: {x.shape[0]} inputs, masks {tuple(masks.shape)}")
    mass, entropy = [], []
    for s in _batches(x.shape[0], batch_size):
        cls = cls_attention(model, x[s])  # b x L x heads x gh x gw
        mass.append(layer_mass_on_object(cls, masks[s]))
        entropy.append(attention_entropy(cls))
    return CLSProfile(torch.cat(mass), torch.cat(entropy), object_area(masks))


def rollout_from_attentions(attentions: Sequence[torch.Tensor], layout, head_fusion: str = "mean",
                            discard_ratio: float = 0.0) -> torch.Tensor:
    """:func:`vitlab.rollout.rollout` from already recorded attentions: ``B x gh x gw``.

    ``attentions``: one ``B x heads x N x N`` post-softmax tensor per block (first first);
    ``layout``: the model's :class:`~vitlab.layout.TokenLayout`. Same numbers as
    ``rollout(model, x, head_fusion, discard_ratio)``, without another forward.
    """
    from vitlab.rollout import (
        check_discard_ratio, check_head_fusion, discard_lowest, fuse_heads, max_normalize, residual_normalize,
        rollout_row,
    )

    check_head_fusion(head_fusion)
    check_discard_ratio(discard_ratio)
    layers = [residual_normalize(discard_lowest(fuse_heads(A, head_fusion), discard_ratio)) for A in attentions]
    return max_normalize(layout.patches_to_grid(rollout_row(layers, index=0)))

def rollout_settings_maps(model, x: torch.Tensor, settings: Sequence[tuple[str, float]],
                          batch_size: int = 50) -> torch.Tensor:
    """Attention rollout of every input for several settings: ``S x B x gh x gw``.

    ``settings``: ``(head_fusion, discard_ratio)`` pairs. Each batch of ``batch_size``
    inputs is recorded once and every setting is computed from that recording
    (:func:`rollout_from_attentions`); entry ``[s]`` equals
    ``vitlab.rollout.rollout(model, x, *settings[s])``.
    """
    from vitlab.attention import _recorded_attentions, require_cls

    settings = [(str(f), float(d)) for f, d in settings]
    if not settings:
        raise ValueError("settings must hold at least one (head_fusion, discard_ratio) pair")
    per_batch = []
    for s in _batches(x.shape[0], batch_size):
        attentions, layout = _recorded_attentions(model, x[s])
        require_cls(layout, "rollout_settings_maps")
        per_batch.append(torch.stack([rollout_from_attentions(attentions, layout, f, d) for f, d in settings]))
    return torch.cat(per_batch, dim=1)


def grade_rollout_settings(model, x: torch.Tensor, masks, settings: Sequence[tuple[str, float]],
                           batch_size: int = 50, min_coverage: float = 0.5) -> list[dict]:
    """Pointing game and mass on the object of attention rollout, for several settings at once.

    Args:
        model: a ViT with a class token (eval mode).
        x: ``B x 3 x H x W`` inputs; ``masks``: ``B x H' x W'`` one object mask per input.
        settings: ``(head_fusion, discard_ratio)`` pairs.
        batch_size: inputs per forward (:func:`rollout_settings_maps`: one recording per
            batch serves every setting).
        min_coverage: see :func:`pointing_game`.

    Returns one dict per setting, in order: ``head_fusion``, ``discard_ratio`` and the
    scores of :func:`grade_maps` (``pointing``, ``touch``, ``mass``, ``n``).
    """
    masks = _as_tensor(masks)
    if masks.ndim != 3 or masks.shape[0] != x.shape[0]:
        raise ValueError(f"need one B x H x W mask per input: {x.shape[0]} inputs, masks {tuple(masks.shape)}")
    maps = rollout_settings_maps(model, x, settings, batch_size)
    return [{"head_fusion": str(f), "discard_ratio": float(d), **grade_maps(m, masks, min_coverage)}
            for (f, d), m in zip(settings, maps)]


#: The methods :func:`maps_from_gradients` computes, class-agnostic ones first.
CLASS_METHODS = ("raw attention", "rollout", "GradCAM", "gradient rollout", "Chefer relevance")


def maps_from_gradients(ag, rollout_setting: tuple[str, float] = ("mean", 0.0),
                        grad_discard_ratio: float = 0.0) -> dict[str, torch.Tensor]:
    """Every map of :data:`CLASS_METHODS` from one :func:`vitlab.attention.attention_gradients`.

    Same numbers as ``raw_attention``, ``rollout(model, x, *rollout_setting)``,
    ``attention_gradcam``, ``grad_rollout(model, x, target, grad_discard_ratio)`` and
    ``chefer_relevance`` called on the model, each ``B x gh x gw``; the first two do not
    depend on the target class.
    """
    from vitlab.attention import gradcam_cls_row, require_cls
    from vitlab.relevance import relevance_matrix
    from vitlab.rollout import discard_lowest, grad_fuse_heads, max_normalize, residual_normalize, rollout_row

    layout = ag.layout
    require_cls(layout, "maps_from_gradients")
    P = layout.num_prefix
    A_last, G_last = ag.attentions[-1], ag.gradients[-1]
    grad_layers = [residual_normalize(discard_lowest(grad_fuse_heads(A, G), grad_discard_ratio))
                   for A, G in zip(ag.attentions, ag.gradients)]
    return {
        "raw attention": layout.patches_to_grid(A_last[:, :, 0, :].mean(dim=1)),
        "rollout": rollout_from_attentions(ag.attentions, layout, *rollout_setting),
        "GradCAM": layout.patches_to_grid(gradcam_cls_row(A_last[:, :, 0, P:], G_last[:, :, 0, P:])),
        "gradient rollout": max_normalize(layout.patches_to_grid(rollout_row(grad_layers, index=0))),
        "Chefer relevance": layout.patches_to_grid(relevance_matrix(ag.attentions, ag.gradients)[:, 0, :]),
    }


def asked_object_maps(model, x: torch.Tensor, labels, batch_size: int = 50,
                      rollout_setting: tuple[str, float] = ("mean", 0.0),
                      grad_discard_ratio: float = 0.0, score: str = "logit") -> dict[str, torch.Tensor]:
    """Every map of :data:`CLASS_METHODS` for every input and every class in ``labels``.

    ``labels``: ``B x K`` classes (e.g. the K objects of each scene). Returns method ->
    ``B x K x gh x gw``, entry ``[b, k]`` being the map of input b asked for class
    ``labels[b, k]`` (:func:`maps_from_gradients`). One forward and one backward per batch
    covers all K asks (the batch is repeated K times). ``score``: what the gradients
    differentiate, the asked class's ``"logit"`` or its ``"log_probability"``.
    """
    from vitlab.attention import attention_gradients

    labels = torch.as_tensor(np.asarray(labels), dtype=torch.long)
    if labels.ndim != 2 or labels.shape[0] != x.shape[0]:
        raise ValueError(f"need labels B x K for B = {x.shape[0]} inputs; got labels {tuple(labels.shape)}")
    B, K = labels.shape
    out = {m: [] for m in CLASS_METHODS}
    for s in _batches(B, batch_size):
        b = s.stop - s.start
        xb = x[s].repeat(K, 1, 1, 1)  # ask k occupies rows k*b .. (k+1)*b - 1
        ag = attention_gradients(model, xb, labels[s].T.reshape(-1), score=score)
        for name, m in maps_from_gradients(ag, rollout_setting, grad_discard_ratio).items():
            out[name].append(m.reshape(K, b, *m.shape[1:]).transpose(0, 1))  # b x K x gh x gw
    return {name: torch.cat(v) for name, v in out.items()}

def grade_asked_object(model, x: torch.Tensor, labels, masks, batch_size: int = 50, min_coverage: float = 0.5,
                       rollout_setting: tuple[str, float] = ("mean", 0.0),
                       grad_discard_ratio: float = 0.0) -> list[dict]:
    """For every method of :data:`CLASS_METHODS`: does the map point at the object of the asked class?

    Each scene holds K objects (``labels``: ``B x K`` classes, ``masks``: ``B x K x H x W``).
    Each object is asked for in turn (``target`` = its class); a method scores a hit when
    the highest patch of its map lies on the asked object (:func:`pointing_game`).
    :func:`asked_object_maps` then :func:`grade_asked`; see the latter for the keys.
    """
    labels = torch.as_tensor(np.asarray(labels), dtype=torch.long)
    masks = _as_tensor(masks)
    if labels.ndim != 2 or masks.ndim != 4 or masks.shape[:2] != labels.shape or labels.shape[0] != x.shape[0]:
        raise ValueError(
            f"need labels B x K and masks B x K x H x W for B = {x.shape[0]} inputs; "
            f"got labels {tuple(labels.shape)}, masks {tuple(masks.shape)}"
        )
    maps = asked_object_maps(model, x, labels, batch_size, rollout_setting, grad_discard_ratio)
    return grade_asked(maps, masks, min_coverage)


# ---------------------------------------------------------------------------------------------
# Which pixels does a token stand for?
# ---------------------------------------------------------------------------------------------


def token_centres(model, x: torch.Tensor) -> torch.Tensor:
    """Receptive-field centre of every patch token after the patch embedding: ``gh x gw x 2``.

    For token t, the centroid (row, column in input pixels) of ``|d embed_t / d x|`` summed
    over channels, embedding dimensions and the batch ``x`` (``B x 3 x H x W``). With a
    plain patchify convolution it is the patch centre; a convolutional stem can move it
    (e.g. stride-2 3x3 convolutions with padding 1 centre a token on its patch's top-left
    corner). Maps over the patch grid are graded against patches, so an offset here shifts
    every map relative to what its tokens saw. timm ViTs only (``model.patch_embed``).
    """
    pe = getattr(model, "patch_embed", None)
    if pe is None or not hasattr(pe, "grid_size"):
        raise ValueError("token_centres needs a timm ViT (a model with patch_embed.grid_size)")
    gh, gw = (int(g) for g in pe.grid_size)
    H, W = x.shape[-2:]
    with torch.enable_grad():
        xin = x.detach().clone().requires_grad_(True)
        emb = pe(xin)  # B x N x C (timm flattens) or B x C x gh x gw
        if emb.ndim == 4:
            emb = emb.flatten(2).transpose(1, 2)
        ys = torch.arange(H, dtype=torch.float32)[:, None].expand(H, W)
        xs = torch.arange(W, dtype=torch.float32)[None, :].expand(H, W)
        out = torch.empty(gh * gw, 2)
        for t in range(gh * gw):
            (g,) = torch.autograd.grad(emb[:, t].sum(), xin, retain_graph=t < gh * gw - 1)
            w = g.abs().sum(dim=(0, 1)).float()  # H x W
            total = w.sum().clamp_min(torch.finfo(w.dtype).tiny)
            out[t, 0], out[t, 1] = (w * ys).sum() / total, (w * xs).sum() / total
    return out.reshape(gh, gw, 2)


def patch_centres(grid: tuple[int, int], size: tuple[int, int]) -> torch.Tensor:
    """Centre (row, column in pixels) of every patch of a ``grid`` over an image of ``size``."""
    (gh, gw), (H, W) = grid, size
    ph, pw = H / gh, W / gw
    cy = torch.arange(gh, dtype=torch.float32) * ph + (ph - 1) / 2
    cx = torch.arange(gw, dtype=torch.float32) * pw + (pw - 1) / 2
    return torch.stack(torch.meshgrid(cy, cx, indexing="ij"), dim=-1)


def shift_masks(masks, down: int, right: int) -> torch.Tensor:
    """Move the content of ``... x H x W`` masks ``down`` and ``right`` pixels (negative: up,
    left); what enters at the border is background (False / 0)."""
    m = _as_tensor(masks)
    H, W = m.shape[-2:]
    out = torch.zeros_like(m)
    down, right = int(down), int(right)
    if abs(down) >= H or abs(right) >= W:
        return out
    src_y = slice(max(0, -down), H - max(0, down))
    dst_y = slice(max(0, down), H - max(0, -down))
    src_x = slice(max(0, -right), W - max(0, right))
    dst_x = slice(max(0, right), W - max(0, -right))
    out[..., dst_y, dst_x] = m[..., src_y, src_x]
    return out


# ---------------------------------------------------------------------------------------------
# Chapter 9: relevance of LXMERT's answers and DETR's detections, graded against the masks
# ---------------------------------------------------------------------------------------------


def _lxmert_methods() -> dict:
    from vitlab import relevance as rv

    return {
        "relevance": rv.lxmert_relevance,
        "relevance + backbone": lambda m, inputs: rv.lxmert_relevance(m, inputs, backbone=True),
        "raw attention": rv.lxmert_raw_attention,
        "rollout": rv.lxmert_rollout,
        "GradCAM": rv.lxmert_gradcam,
    }


def _detr_methods() -> dict:
    from vitlab import relevance as rv

    return {
        "relevance": rv.detr_relevance,
        "relevance + backbone": lambda m, x, queries: rv.detr_relevance(m, x, queries=queries, backbone=True),
        "raw attention": rv.detr_raw_attention,
        "rollout": rv.detr_rollout,
        "GradCAM": rv.detr_gradcam,
    }


#: The chapter-5 methods, in table order (the same names for LXMERT and DETR).
BIMODAL_METHODS: tuple[str, ...] = ("relevance", "relevance + backbone", "raw attention", "rollout", "GradCAM")


def _checked_methods(methods) -> tuple[str, ...]:
    methods = tuple(methods)
    unknown = [m for m in methods if m not in BIMODAL_METHODS]
    if not methods or unknown:
        raise ValueError(f"methods must be names from {BIMODAL_METHODS}, got {methods!r}")
    return methods


def named_word_positions(tokenizer, questions) -> np.ndarray:
    """Position of the named class word in each tokenised question (``[CLS]`` = 0), -1 where
    the question names no class (``which``). ``questions``: :class:`vitlab.shapes.qa.Questions`."""
    from vitlab.shapes.data import CLASSES

    pos = np.full(len(questions), -1, dtype=np.int64)
    for i, (text, named) in enumerate(zip(questions.text, questions.named)):
        if named >= 0:
            tokens = tokenizer.tokenize(text)
            pos[i] = tokens.index(CLASSES[int(named)])
    return pos


def _encoded_questions(model, scenes: int, questions, method: str):
    """``(input_ids, attention_mask, scene)`` of ``questions`` for ``shapes-lxmert``, checked
    before any forward: every question within the model's positions (its tokens within its
    vocabulary) and every ``questions.scene`` an index into the ``scenes`` scenes."""
    from vitlab.relevance.lxmert import _check_tokens

    ids, mask = model.encode(list(questions.text))
    _check_tokens(model.config, {"input_ids": ids, "attention_mask": mask}, method)
    scene = torch.as_tensor(np.asarray(questions.scene), dtype=torch.long)
    if scene.shape != (len(questions),):
        raise ValueError(f"{method}: questions.scene must hold one scene index per question, got shape "
                         f"{tuple(scene.shape)} for {len(questions)} questions")
    if len(scene) and (scene.min() < 0 or scene.max() >= scenes):
        raise ValueError(f"{method}: questions.scene holds scene {int(scene.max() if scene.max() >= scenes else scene.min())}, "
                         f"but there are {scenes} scenes (0 .. {scenes - 1}); ask questions about the scenes given")
    return ids, mask, scene


def lxmert_method_maps(model, x: torch.Tensor, questions, methods=BIMODAL_METHODS,
                       batch_size: int = 100, features=None) -> dict:
    """Image and text maps of every method for every question about the scenes ``x``.

    ``model``: ``shapes-lxmert``; ``x``: ``S x 3 x H x W`` preprocessed scenes; ``questions``:
    :class:`vitlab.shapes.qa.Questions` about them (``questions.scene`` indexes ``x``). Each
    method explains the model's own answer. Returns method -> :class:`vitlab.relevance.BimodalMaps`
    over all questions (``image``: ``Q x gh x gw`` on the backbone's patch grid, ``text``:
    ``Q x L``, the questions padded to one length ``L``, 0 on the padding). One forward (and
    one backward) per batch and method. Padding changes no map: every method gives each
    question the map it gives that question asked alone (the methods leave ``[PAD]`` tokens
    out, see :func:`vitlab.relevance.lxmert_rollout`).
    """
    from vitlab.relevance import BimodalMaps

    methods = _checked_methods(methods)
    table = _lxmert_methods()
    ids, mask, scene = _encoded_questions(model, x.shape[0], questions, "lxmert_method_maps")
    grid = tuple(int(g) for g in model.backbone.patch_embed.grid_size)
    feats, pos = lxmert_scene_features(model, x, batch_size) if features is None else features
    out = {}
    for name in methods:
        parts = []
        for s in _batches(len(questions), batch_size):
            if name == "relevance + backbone":  # relevance through the ViT: the pixels go in
                images = dict(pixel_values=x[scene[s]])
            else:  # the frozen ViT's tokens, computed once per scene, are the same input
                images = dict(visual_feats=feats[scene[s]], visual_pos=pos[scene[s]])
            parts.append(table[name](model, dict(input_ids=ids[s], attention_mask=mask[s], **images)))
        image = torch.cat([p.image for p in parts]).reshape(len(questions), *grid)
        out[name] = BimodalMaps(image, torch.cat([p.text for p in parts]),
                                torch.cat([p.target for p in parts]), torch.cat([p.logits for p in parts]))
    return out


def lxmert_scene_features(model, x: torch.Tensor, batch_size: int = 100) -> tuple[torch.Tensor, torch.Tensor]:
    """``shapes-lxmert``'s visual inputs for every scene, once: ``(feats S x N x C, boxes S x N x 4)``
    (the frozen ViT's tokens and their grid boxes). The functions below that take ``features=``
    accept them, so that several calls on the same scenes run the ViT once."""
    from vitlab.attention import check_images
    from vitlab.record import eval_mode

    check_images(x, "lxmert_scene_features")
    feats, pos = [], []
    with torch.no_grad(), eval_mode(model):
        for s in _batches(x.shape[0], batch_size):
            f, p = model.visual_inputs(x[s])
            feats.append(f)
            pos.append(p)
    return torch.cat(feats), torch.cat(pos)


class QuestionGrades(NamedTuple):
    """Where each method's maps point, per question (from :func:`grade_lxmert`).

    Attributes:
        methods: the method names, in row order.
        correct: ``Q`` bool, the model answered the question right.
        has_target: ``Q`` bool, the answer is about one object (not ``is there a ...? no``).
        on_target: ``M x Q`` bool, the top image patch lies on that object (pointing game).
        on_other: ``M x Q`` bool, it lies on the scene's other object.
        chance: ``Q``, the hit rate of a random top patch on the target object.
        named_position: ``Q``, the named class word's token position (-1: none named).
        named_top: ``M x Q`` bool, the named word is the most relevant text token (False
            where none is named).
        maps: method -> :class:`vitlab.relevance.BimodalMaps` (as :func:`lxmert_method_maps`).
    """

    methods: tuple
    correct: np.ndarray
    has_target: np.ndarray
    on_target: np.ndarray
    on_other: np.ndarray
    chance: np.ndarray
    named_position: np.ndarray
    named_top: np.ndarray
    maps: dict


def grade_lxmert(model, x: torch.Tensor, masks, questions, methods=BIMODAL_METHODS, batch_size: int = 100,
                 min_coverage: float = 0.5, features=None) -> QuestionGrades:
    """Grade every method's LXMERT maps against the objects of two-object scenes.

    ``masks``: ``S x 2 x H x W`` (the two objects of each scene in ``x``); the target object
    of question q is ``questions.target[q]`` (-1: none, e.g. "is there a star? no"), the other
    object is the scene's other one. The top patch lies "on" an object when it covers at least
    ``min_coverage`` of the patch (:func:`pointing_game`). Text: is the named class word the
    highest of the text map (``[CLS]`` is 0 there, padding never counts)? ``features``: the
    scenes' visual inputs from :func:`lxmert_scene_features`, if already computed.
    """
    masks = _as_tensor(masks)
    if masks.ndim != 4 or masks.shape[:2] != (x.shape[0], 2):
        raise ValueError(f"masks must be S x 2 x H x W for the {x.shape[0]} scenes of x, got {tuple(masks.shape)}")
    maps = lxmert_method_maps(model, x, questions, methods, batch_size, features)
    _, attn_mask = model.encode(list(questions.text))
    return _grade_question_maps(model, maps, masks, questions, min_coverage, attn_mask == 1)


def detr_detections(model, x: torch.Tensor, threshold: float = 0.9, batch_size: int = 100) -> list[dict]:
    """DETR's detections per image: ``{"queries", "labels", "scores", "boxes"}`` (boxes
    ``(x0, y0, x1, y1)`` in [0, 1]) for the queries whose best real class has a probability
    above ``threshold`` (the "no object" class left out). One forward per batch, no gradient."""
    from vitlab.attention import check_images
    from vitlab.record import eval_mode
    from vitlab.relevance._common import _require_family
    from vitlab.relevance.detr import check_threshold

    method = "detr_detections"
    _require_family(model, "detr", method)
    threshold = check_threshold(threshold, method)
    check_images(x, method)
    out = []
    with torch.no_grad(), eval_mode(model):
        for s in _batches(x.shape[0], batch_size):
            res = model(pixel_values=x[s])
            prob = res.logits.softmax(-1)[..., :-1]
            scores, labels = prob.max(-1)
            cx, cy, w, h = res.pred_boxes.unbind(-1)
            boxes = torch.stack([cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2], -1)
            for b in range(scores.shape[0]):
                keep = torch.nonzero(scores[b] > threshold).flatten()
                out.append({"queries": keep, "labels": labels[b, keep], "scores": scores[b, keep],
                            "boxes": boxes[b, keep]})
    return out


def detr_method_maps(model, x: torch.Tensor, queries, methods=BIMODAL_METHODS, batch_size: int = 100) -> dict:
    """Every method's map of every given query: method -> ``D x gh x gw`` (detections in image
    order, then query order). ``queries``: one list of query indices per image of ``x`` (e.g.
    ``[d["queries"] for d in detr_detections(...)]``). The ``relevance + backbone`` maps lie on
    the backbone's patch grid, the others on DETR's feature grid (the same grid for
    ``shapes-detr``).

    The gradient methods run one backward per batch with K slots, K = the most detections of
    any image in the batch; so the images are batched by their number of detections (fewest
    first; images without any are skipped), which keeps K close to every image's own count.
    With no detection in any image every entry is ``0 x gh x gw``, the grid read from the
    method's map of query 0 of the first image (one extra forward per method).
    """
    from vitlab.attention import check_images

    methods = _checked_methods(methods)
    check_images(x, "detr_method_maps")
    table = _detr_methods()
    if isinstance(queries, (str, bytes)) or not hasattr(queries, "__len__") or len(queries) != x.shape[0]:
        got = f"{len(queries)} lists" if hasattr(queries, "__len__") else type(queries).__name__
        raise ValueError(f"detr_method_maps: queries must hold one list of query indices per image: {got} for "
                         f"{x.shape[0]} images")
    queries = [torch.as_tensor(q, dtype=torch.long).reshape(-1) for q in queries]
    counts = np.array([len(q) for q in queries])
    order = [i for i in np.argsort(counts, kind="stable") if counts[i] > 0]
    out = {}
    for name in methods:
        if not order:  # nothing detected: no map, on the grid this method's maps have
            out[name] = table[name](model, x[:1], queries=[torch.zeros(1, dtype=torch.long)])[0].maps[:0]
            continue
        per_image: list[torch.Tensor | None] = [None] * len(queries)
        for s in _batches(len(order), batch_size):
            idx = order[s]
            for i, d in zip(idx, table[name](model, x[idx], queries=[queries[i] for i in idx])):
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
    from vitlab.localization import chance_pointing
    from vitlab.shapes.qa import object_boxes
    from vitlab.shapes.train_detr import box_iou

    masks = _as_tensor(masks)
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


def object_gaps(masks) -> np.ndarray:
    """Per scene: the shortest distance in pixels between its two objects (``S x 2 x H x W``
    masks; 0 when they touch or overlap)."""
    from scipy.ndimage import distance_transform_edt

    m = np.asarray(_as_tensor(masks).numpy(), dtype=bool)
    if m.ndim != 4 or m.shape[1] != 2:
        raise ValueError(f"masks must be S x 2 x H x W, got shape {m.shape}")
    out = np.empty(len(m))
    for i, (a, b) in enumerate(m):
        if not a.any() or not b.any():
            raise ValueError(f"scene {i} has an empty object mask")
        out[i] = distance_transform_edt(~a)[b].min()
    return out


def text_occlusion(model, x: torch.Tensor, questions, batch_size: int = 100, features=None) -> torch.Tensor:
    """How much each word of each question matters to the answer: the drop of the answer's
    logit when that word is replaced by ``[UNK]`` (a faithfulness test for text maps).

    ``model``: ``shapes-lxmert``; ``x``, ``questions`` as :func:`lxmert_method_maps`. The
    answer is the model's own on the intact question. Returns ``Q x L`` (questions padded to
    one length ``L``, token positions as in the text maps): NaN at ``[CLS]``, ``[SEP]`` and
    padding. One forward per batch and word position.
    """
    from vitlab.record import eval_mode

    tok = model.tokenizer
    scenes = x.shape[0] if features is None else features[0].shape[0]
    ids, mask, scene = _encoded_questions(model, scenes, questions, "text_occlusion")
    feats, boxes = lxmert_scene_features(model, x, batch_size) if features is None else features
    word = (mask == 1) & (ids != tok.cls_id) & (ids != tok.sep_id)
    out = torch.full(ids.shape, float("nan"))
    with torch.no_grad(), eval_mode(model):
        for s in _batches(len(questions), batch_size):
            ib, mb = ids[s], mask[s]
            xb = dict(visual_feats=feats[scene[s]], visual_pos=boxes[scene[s]])
            logits = model(input_ids=ib, attention_mask=mb, **xb).question_answering_score
            answer = logits.argmax(-1, keepdim=True)
            base = logits.gather(1, answer)[:, 0]
            for pos in torch.nonzero(word[s].any(0)).flatten().tolist():
                rows = word[s][:, pos]
                ib2 = ib.clone()
                ib2[rows, pos] = tok.unk_id
                occluded = model(input_ids=ib2[rows], attention_mask=mb[rows], **{k: v[rows] for k, v in xb.items()})
                drop = base[rows] - occluded.question_answering_score.gather(1, answer[rows])[:, 0]
                out[torch.arange(s.start, s.stop)[rows], pos] = drop.float().cpu()
    return out


def top_token_is(scores: torch.Tensor, positions, valid=None) -> np.ndarray:
    """Per row: is the highest score at ``positions[row]``? ``scores``: ``Q x L`` (NaN marks a
    position that does not count, e.g. a token :func:`text_occlusion` does not occlude);
    ``valid``: optional ``Q x L`` bool of the positions that may count. A row has a top token
    only if some position counts: rows with none (all NaN or none valid) give False, as do rows
    with ``positions`` < 0. Infinite scores are refused (``ValueError``)."""
    s = torch.as_tensor(scores, dtype=torch.float64).clone()
    if s.ndim != 2:
        raise ValueError(f"scores must be Q x L (one row per question), got shape {tuple(s.shape)}")
    if bool(torch.isinf(s).any()):
        raise ValueError("scores hold inf: a top token is undefined there; mark positions that do not count "
                         "with NaN or with valid=False")
    pos = np.asarray(positions)
    if pos.shape != (s.shape[0],):
        raise ValueError(f"positions must hold one position per row ({s.shape[0]}), got shape {pos.shape}")
    counts = ~torch.isnan(s)
    if valid is not None:
        valid = torch.as_tensor(valid, dtype=torch.bool)
        if tuple(valid.shape) != tuple(s.shape):
            raise ValueError(f"valid must be Q x L like scores, {tuple(s.shape)}, got {tuple(valid.shape)}")
        counts &= valid
    top = s.masked_fill(~counts, float("-inf")).argmax(-1).numpy()
    return (top == pos) & (pos >= 0) & counts.any(-1).numpy()


def lxmert_answers_without(model, x: torch.Tensor, questions, drop, batch_size: int = 100,
                           features=None) -> torch.Tensor:
    """``shapes-lxmert``'s answers when some image tokens are hidden from it: ``Q`` answer ids.

    ``drop``: ``Q x N`` bool, the image tokens (patches) question q may not see; they are
    masked out of every attention to the image (``visual_attention_mask`` = 0), as if they
    were not there. A faithfulness test for image maps: hide the patch a map calls most
    relevant and see whether the answer changes. ``x``, ``questions`` as
    :func:`lxmert_method_maps`.
    """
    from vitlab.record import eval_mode

    drop = torch.as_tensor(drop, dtype=torch.bool)
    feats, boxes = lxmert_scene_features(model, x, batch_size) if features is None else features
    if drop.shape != (len(questions), feats.shape[1]):
        raise ValueError(f"drop must be Q x N = {len(questions)} x {feats.shape[1]} (questions x image tokens), "
                         f"got {tuple(drop.shape)}")
    ids, mask, scene = _encoded_questions(model, feats.shape[0], questions, "lxmert_answers_without")
    out = []
    with torch.no_grad(), eval_mode(model):
        for s in _batches(len(questions), batch_size):
            logits = model(input_ids=ids[s], attention_mask=mask[s], visual_feats=feats[scene[s]],
                           visual_pos=boxes[scene[s]], visual_attention_mask=(~drop[s]).to(feats.dtype))
            out.append(logits.question_answering_score.argmax(-1))
    return torch.cat(out)


# ---------------------------------------------------------------------------------------------
# Chapter 9: the single-stream model (VisualBERT), graded as LXMERT
# ---------------------------------------------------------------------------------------------


def _visualbert_methods() -> dict:
    from vitlab import relevance as rv

    return {
        "relevance": rv.visualbert_relevance,
        "raw attention": rv.visualbert_raw_attention,
        "rollout": rv.visualbert_rollout,
        "GradCAM": rv.visualbert_gradcam,
    }


#: The chapter-5 methods for ``shapes-visualbert``, in table order (no backbone variant: the
#: single-stream relevance stops at VisualBERT's input tokens).
VISUALBERT_METHODS: tuple[str, ...] = ("relevance", "raw attention", "rollout", "GradCAM")


def visualbert_method_maps(model, x: torch.Tensor, questions, methods=VISUALBERT_METHODS, batch_size: int = 100,
                           features=None) -> dict:
    """Image and text maps of every method for every question, for ``shapes-visualbert``.

    As :func:`lxmert_method_maps` (same arguments and returns; ``features`` the frozen ViT's
    tokens of :func:`lxmert_scene_features`, which ``shapes-visualbert`` reads too, as
    ``visual_feats``). The maps are the row of the token VisualBERT answers from
    (``attention_mask.sum(1) - 2``, the ``?``), its own text entry 0
    (:mod:`vitlab.relevance.visualbert`). One forward (and one backward) per batch and method.
    """
    from vitlab.relevance import BimodalMaps

    methods = tuple(methods)
    unknown = [m for m in methods if m not in VISUALBERT_METHODS]
    if not methods or unknown:
        raise ValueError(f"methods must be names from {VISUALBERT_METHODS}, got {methods!r}")
    table = _visualbert_methods()
    ids, mask, scene = _encoded_questions(model, x.shape[0], questions, "visualbert_method_maps")
    grid = tuple(int(g) for g in model.backbone.patch_embed.grid_size)
    feats = (lxmert_scene_features(model, x, batch_size) if features is None else features)[0]
    out = {}
    for name in methods:
        parts = [table[name](model, dict(input_ids=ids[s], attention_mask=mask[s], visual_feats=feats[scene[s]]))
                 for s in _batches(len(questions), batch_size)]
        image = torch.cat([p.image for p in parts]).reshape(len(questions), *grid)
        out[name] = BimodalMaps(image, torch.cat([p.text for p in parts]),
                                torch.cat([p.target for p in parts]), torch.cat([p.logits for p in parts]))
    return out


def _grade_question_maps(model, maps: dict, masks, questions, min_coverage: float, text_valid) -> QuestionGrades:
    """Pointing (image maps) and the named word (text maps) of every method's maps, per question."""
    from vitlab.localization import chance_pointing

    methods = tuple(maps)
    scene = torch.as_tensor(np.asarray(questions.scene), dtype=torch.long)
    target = torch.as_tensor(np.asarray(questions.target), dtype=torch.long)
    has_target = target >= 0
    t = target.clamp(min=0)
    m_target, m_other = masks[scene, t], masks[scene, 1 - t]
    grid = tuple(next(iter(maps.values())).image.shape[1:])
    pos = named_word_positions(model.tokenizer, questions)
    on_target, on_other, named_top = [], [], []
    for name in methods:
        image = maps[name].image
        on_target.append((pointing_game(image, m_target, min_coverage) & has_target).numpy())
        on_other.append((pointing_game(image, m_other, min_coverage) & has_target).numpy())
        named_top.append(top_token_is(maps[name].text, pos, valid=text_valid))
    correct = (maps[methods[0]].logits.argmax(-1) == torch.as_tensor(questions.answer_id)).numpy()
    return QuestionGrades(methods, correct, has_target.numpy(), np.stack(on_target), np.stack(on_other),
                          chance_pointing(m_target, grid, min_coverage).numpy(), pos, np.stack(named_top), maps)


def grade_visualbert(model, x: torch.Tensor, masks, questions, methods=VISUALBERT_METHODS, batch_size: int = 100,
                     min_coverage: float = 0.5, features=None) -> QuestionGrades:
    """Grade every method's ``shapes-visualbert`` maps against the objects, as :func:`grade_lxmert`.

    Same measures and arguments. Text: the named class word must be the highest of the word
    tokens; ``[CLS]`` and ``[SEP]`` do not count (VisualBERT's answer row is the ``?``, whose
    own entry is 0, and its ``[CLS]`` is a token like any other, not the answer's own).
    """
    masks = _as_tensor(masks)
    if masks.ndim != 4 or masks.shape[:2] != (x.shape[0], 2):
        raise ValueError(f"masks must be S x 2 x H x W for the {x.shape[0]} scenes of x, got {tuple(masks.shape)}")
    maps = visualbert_method_maps(model, x, questions, methods, batch_size, features)
    _, mask = model.encode(list(questions.text))
    positions = torch.arange(mask.shape[1])
    words = (mask == 1) & (positions > 0) & (positions < mask.sum(1, keepdim=True) - 1)
    return _grade_question_maps(model, maps, masks, questions, min_coverage, words)


# ---------------------------------------------------------------------------------------------
# Chapter 9: the paper's perturbation tests for many maps at once
# ---------------------------------------------------------------------------------------------

#: The four tests of each model: (modality, positive).
PERTURBATION_TESTS: tuple[tuple[str, bool], ...] = (("image", True), ("image", False), ("text", True),
                                                    ("text", False))


def _kept_sets(maps: torch.Tensor, mask: torch.Tensor, modality: str, positive: bool, steps, keep_end: int):
    """Per question and step, the token indices kept (ascending), as :func:`bimodal_faithfulness
    .perturbation_curve` keeps them: image all tokens, text ``[CLS]``, the kept words, the last
    ``keep_end`` real tokens."""
    from vitlab.bimodal_faithfulness import kept_indices

    out = []
    for b in range(maps.shape[0]):
        if modality == "image":
            out.append([tuple(kept_indices(maps[b], s, positive).tolist()) for s in steps])
            continue
        n = int(mask[b].sum())
        rows = []
        for s in steps:
            inner = (kept_indices(maps[b, 1 : n - keep_end], s, positive) + 1).tolist()
            rows.append(tuple([0] + inner + list(range(n - keep_end, n))))
        out.append(rows)
    return out


def _run_kept(model, inputs: dict, modality: str, items: list, batch_size: int) -> list[int]:
    """The model's top-1 answer for each ``(question, kept token indices)`` of ``items``: the
    kept tokens alone, in their order (no kept image token: one blank token, as
    :mod:`vitlab.bimodal_faithfulness` does); one forward per batch of items that keep as many
    tokens."""
    from vitlab.bimodal_faithfulness import IMAGE_KEYS, TEXT_KEYS, _logits

    keys = IMAGE_KEYS if modality == "image" else TEXT_KEYS
    preds = [0] * len(items)
    by_count: dict[int, list[int]] = {}
    for i, (_, kept) in enumerate(items):
        by_count.setdefault(len(kept), []).append(i)
    for count, idx in by_count.items():
        for s in _batches(len(idx), batch_size):
            chosen = idx[s]
            rows = torch.as_tensor([items[i][0] for i in chosen])
            batch = {}
            for k, v in inputs.items():
                v = v[rows.to(v.device)]
                if k in keys and count == 0:
                    v = torch.zeros(len(chosen), 1, *v.shape[2:], dtype=v.dtype, device=v.device)
                    if k == "visual_attention_mask":
                        v += 1
                elif k in keys:
                    sel = torch.as_tensor([items[i][1] for i in chosen], device=v.device)
                    v = v.gather(1, sel.reshape(*sel.shape, *([1] * (v.ndim - 2))).expand(-1, -1, *v.shape[2:]))
                batch[k] = v
            for i, p in zip(chosen, _logits(model(**batch)).argmax(-1).tolist()):
                preds[i] = int(p)
    return preds


def perturbation_grid(model, inputs: dict, maps: dict, answers, tests=PERTURBATION_TESTS, steps=None,
                      keep_end: int | None = None, batch_size: int = 256) -> dict:
    """The perturbation tests of Chefer et al. (2021, sec. 5) for many maps at once.

    ``maps``: method -> ``{"image": B x N, "text": B x T}`` (the maps of ``B`` questions);
    ``tests``: ``(modality, positive)`` pairs. Returns ``(method, modality, positive)`` ->
    :class:`vitlab.bimodal_faithfulness.PerturbationCurve`, each equal to
    ``perturbation_curve(model, inputs, maps[method][modality], modality, positive, answers,
    steps, keep_end=keep_end)``. Faster: an input that several curves perturb the same way
    (every curve's step 0; the same words kept from a short question by several steps or
    methods) runs once. Questions never share a forward's result, so a batch gives what its
    questions give one by one. ``steps``: default
    :data:`vitlab.bimodal_faithfulness.PERTURBATION_STEPS`; ``answers``: ``B`` true answer ids;
    ``keep_end``: None follows the model (:func:`vitlab.bimodal_faithfulness.keep_end_for`: 2 for
    VisualBERT, whose answer token before ``[SEP]`` stays, 1 otherwise). The model runs in eval mode without gradients and is left as it was.
    """
    from vitlab import bimodal_faithfulness as bf

    steps = tuple(float(s) for s in (bf.PERTURBATION_STEPS if steps is None else steps))
    if not isinstance(inputs, dict):
        raise TypeError(f"inputs must be a dict of the model's keyword inputs, got {type(inputs).__name__}")
    if not maps or not tests:
        raise ValueError("perturbation_grid needs at least one method's maps and one (modality, positive) test")
    inputs = bf.token_inputs(model, inputs)
    keep_end = bf.keep_end_for(model) if keep_end is None else keep_end
    answers = torch.as_tensor(answers).detach().long().cpu()
    checked = {}
    for name, per in maps.items():
        for modality, positive in tests:
            if modality not in per:
                raise ValueError(f"maps[{name!r}] has no {modality!r} map (keys {tuple(per)})")
            m = torch.as_tensor(per[modality]).detach().cpu()
            bf._check(inputs, m, modality, answers, steps, keep_end)
            checked[name, modality] = m
    mask = inputs["attention_mask"].cpu()
    B = mask.shape[0]
    kept = {(name, modality, positive): _kept_sets(checked[name, modality], mask, modality, positive, steps, keep_end)
            for name in maps for modality, positive in tests}
    was_training = model.training
    model.eval()
    out = {}
    try:
        with torch.no_grad():
            for modality in dict.fromkeys(m for m, _ in tests):
                slot: dict[tuple, int] = {}
                for key, sets in kept.items():
                    if key[1] == modality:
                        for b in range(B):
                            for k in sets[b]:
                                slot.setdefault((b, k), len(slot))
                preds = _run_kept(model, inputs, modality, list(slot), batch_size)
                for key, sets in kept.items():
                    if key[1] != modality:
                        continue
                    p = torch.tensor([[preds[slot[b, k]] for k in sets[b]] for b in range(B)], dtype=torch.long)
                    n_kept = torch.tensor([[len(k) for k in sets[b]] for b in range(B)], dtype=torch.long)
                    out[key] = bf.PerturbationCurve(modality, key[2], steps, p == answers[:, None], n_kept, p)
    finally:
        model.train(was_training)
    return {key: out[key] for key in kept}


def perturbation_rows(curves: dict, tests=PERTURBATION_TESTS, seed: int = 0) -> list[dict]:
    """One table row per method: each test's AUC with its 95% bootstrap interval over questions
    (:func:`vitlab.bimodal_faithfulness.bootstrap_interval`), e.g. ``0.487 [0.465, 0.507]``."""
    from vitlab.bimodal_faithfulness import bootstrap_interval

    rows = []
    for name in dict.fromkeys(k[0] for k in curves):
        row = {"method": name}
        for modality, positive in tests:
            c = curves[name, modality, positive]
            lo, hi = bootstrap_interval(c.question_auc, seed=seed)
            row[f"{modality} {'pos ↓' if positive else 'neg ↑'}"] = f"{c.auc:.3f} [{lo:.3f}, {hi:.3f}]"
        rows.append(row)
    return rows


class Verdict(NamedTuple):
    """The paper's ordering on one test (from :func:`perturbation_verdicts`).

    Attributes:
        modality, positive: the test.
        auc: the reference method's AUC; best_other / best_auc: the best other method and its AUC
            (lowest for positive, highest for negative).
        low, high: 95% bootstrap interval of the per-question AUC difference reference - best other.
        holds: the interval lies on the reference's side of 0 (below for positive, above for
            negative); ``tie``: it contains 0.
    """

    modality: str
    positive: bool
    auc: float
    best_other: str
    best_auc: float
    low: float
    high: float
    holds: bool
    tie: bool


def perturbation_verdicts(curves: dict, reference: str = "relevance", tests=PERTURBATION_TESTS,
                          seed: int = 0) -> list[Verdict]:
    """Per test: is ``reference`` better than every other method (lowest AUC on positive,
    highest on negative, as Chefer et al. 2021 claim for their relevance), beyond a 95%
    interval? Paired: the interval is the bootstrap of the per-question AUC difference between
    ``reference`` and the best of the others (:func:`vitlab.bimodal_faithfulness.bootstrap_interval`)."""
    from vitlab.bimodal_faithfulness import bootstrap_interval

    out = []
    for modality, positive in tests:
        ref = curves[reference, modality, positive]
        others = {k[0]: c for k, c in curves.items() if k[1:] == (modality, positive) and k[0] != reference}
        if not others:
            raise ValueError(f"no other method than {reference!r} to compare on {modality}, "
                             f"{'positive' if positive else 'negative'}")
        best = (min if positive else max)(others, key=lambda m: others[m].auc)
        lo, hi = bootstrap_interval(ref.question_auc - others[best].question_auc, seed=seed)
        holds = hi < 0 if positive else lo > 0
        out.append(Verdict(modality, positive, ref.auc, best, others[best].auc, lo, hi, holds, lo <= 0 <= hi))
    return out


def paired_difference(a, b, seed: int = 0) -> tuple[float, float, float]:
    """``(mean, low, high)``: the mean of ``a - b`` over questions (per-question values, e.g.
    two curves' ``question_auc``) and its 95% bootstrap interval."""
    from vitlab.bimodal_faithfulness import bootstrap_interval

    d = torch.as_tensor(a, dtype=torch.float64) - torch.as_tensor(b, dtype=torch.float64)
    lo, hi = bootstrap_interval(d, seed=seed)
    return float(d.mean()), lo, hi


# ---------------------------------------------------------------------------------------------
# Chapter 9: eq. 10's self-relevance, eq. 11 and simultaneous co-attention, left out one at a time
# ---------------------------------------------------------------------------------------------

#: The variants of :func:`lxmert_relevance_variants`: name -> ``lxmert_relevance`` keywords.
LXMERT_ABLATIONS: dict = {
    "relevance": {},
    "without eq. 11": {"eq11": False},
    "sequential co-attention": {"simultaneous": False},
    "without self-relevance in eq. 10": {"self_in_eq10": False},
}


def lxmert_relevance_variants(model, x: torch.Tensor, questions, variants=None, batch_size: int = 100,
                              features=None) -> dict:
    """``lxmert_relevance`` of every question with each rule left out: variant -> BimodalMaps.

    ``variants``: name -> keyword arguments of :func:`vitlab.relevance.lxmert_relevance`
    (default :data:`LXMERT_ABLATIONS`). As :func:`lxmert_method_maps` otherwise (image maps
    ``Q x gh x gw``); each variant explains the model's own answer.
    """
    from vitlab.relevance import BimodalMaps, lxmert_relevance

    variants = dict(LXMERT_ABLATIONS if variants is None else variants)
    if not variants:
        raise ValueError("variants must name at least one set of lxmert_relevance keywords")
    ids, mask, scene = _encoded_questions(model, x.shape[0], questions, "lxmert_relevance_variants")
    grid = tuple(int(g) for g in model.backbone.patch_embed.grid_size)
    feats, pos = lxmert_scene_features(model, x, batch_size) if features is None else features
    out = {}
    for name, kwargs in variants.items():
        parts = [lxmert_relevance(model, dict(input_ids=ids[s], attention_mask=mask[s], visual_feats=feats[scene[s]],
                                              visual_pos=pos[scene[s]]), **kwargs)
                 for s in _batches(len(questions), batch_size)]
        out[name] = BimodalMaps(torch.cat([p.image for p in parts]).reshape(len(questions), *grid),
                                torch.cat([p.text for p in parts]), torch.cat([p.target for p in parts]),
                                torch.cat([p.logits for p in parts]))
    return out


def map_change(a: torch.Tensor, b: torch.Tensor) -> dict:
    """How much map ``b`` differs from map ``a``, per question (``Q x ...`` each): ``"top_moved"``
    (bool, the highest entry is elsewhere), ``"l1"`` (the L1 distance of the two maps each
    divided by its sum, in [0, 2]; 0 where both maps are 0)."""
    a, b = a.flatten(1).double(), b.flatten(1).double()
    if a.shape != b.shape:
        raise ValueError(f"the maps must have the same shape, got {tuple(a.shape)} and {tuple(b.shape)}")
    na = a / a.sum(1, keepdim=True).clamp_min(1e-300)
    nb = b / b.sum(1, keepdim=True).clamp_min(1e-300)
    return {"top_moved": (a.argmax(1) != b.argmax(1)).numpy(), "l1": (na - nb).abs().sum(1).numpy()}
