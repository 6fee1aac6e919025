"""Measure explanation maps against known object masks.

The shapes scenes (``vitlab.shapes``) come with every object's pixel mask, so a map over
the patch grid can be graded, not just looked at:

- :func:`mask_to_grid` — the fraction of each patch covered by the object;
- :func:`pointing_game` — does the map's highest patch lie on the object (Zhang et al.
  2016, "Top-down neural attention by excitation backprop", on patches: a hit when at least
  ``min_coverage`` of the top patch is object);
- :func:`mass_on_object` — the share of the map's (non-negative) mass on object patches,
  with the object's area share as the chance level.

They take maps and masks only; no model is called here.
"""
from __future__ import annotations

from typing import NamedTuple, Sequence

import numpy as np
import torch
import torch.nn.functional as F


def _as_tensor(a, dtype=torch.float32) -> torch.Tensor:
    if isinstance(a, torch.Tensor):
        return a.detach().to("cpu", dtype)
    return torch.as_tensor(np.ascontiguousarray(a), dtype=dtype)  # also reversed/strided views


def _check(maps: torch.Tensor, masks: torch.Tensor) -> None:
    if maps.ndim != 3:
        raise ValueError(f"maps must be B x gh x gw, got shape {tuple(maps.shape)}")
    if masks.ndim != 3:
        raise ValueError(f"masks must be B x H x W, got shape {tuple(masks.shape)}")
    if maps.shape[0] != masks.shape[0]:
        raise ValueError(f"got {maps.shape[0]} maps for {masks.shape[0]} masks")
    gh, gw = maps.shape[1:]
    H, W = masks.shape[1:]
    if H % gh or W % gw:
        raise ValueError(f"mask size {H} x {W} is not a multiple of the patch grid {gh} x {gw}")


def mask_to_grid(masks, grid: tuple[int, int]) -> torch.Tensor:
    """``B x H x W`` boolean masks -> ``B x gh x gw`` fraction of each patch on the object."""
    m = _as_tensor(masks)
    if m.ndim != 3:
        raise ValueError(f"masks must be B x H x W, got shape {tuple(m.shape)}")
    H, W = m.shape[1:]
    gh, gw = grid
    if H % gh or W % gw:
        raise ValueError(f"mask size {H} x {W} is not a multiple of the patch grid {gh} x {gw}")
    return F.avg_pool2d(m[:, None], kernel_size=(H // gh, W // gw))[:, 0]


def pointing_game(maps, masks, min_coverage: float = 0.5) -> torch.Tensor:
    """Per sample: does the highest patch of the map lie on the object? (bool tensor ``B``)

    A patch lies on the object when at least ``min_coverage`` of its pixels are object
    pixels. Ties for the highest value count as a hit only if all tied patches are hits.
    """
    if not 0.0 < min_coverage <= 1.0:
        raise ValueError(f"min_coverage must be in (0, 1], got {min_coverage}")
    maps, masks = _as_tensor(maps), _as_tensor(masks)
    _check(maps, masks)
    on = mask_to_grid(masks, tuple(maps.shape[1:])) >= min_coverage - 1e-9   # B x gh x gw
    flat, on = maps.flatten(1), on.flatten(1)
    top = flat == flat.max(dim=1, keepdim=True).values
    return (top & ~on).sum(1) == 0


def mass_on_object(maps, masks) -> torch.Tensor:
    """Per sample: share of the map's mass on the object (``B`` floats in [0, 1]).

    Negative map values are clamped to 0; each patch's mass is weighted by the fraction of
    it the object covers. A uniform map scores the object's area share (the chance level,
    see :func:`object_area`).
    """
    maps, masks = _as_tensor(maps).clamp_min(0), _as_tensor(masks)
    _check(maps, masks)
    cover = mask_to_grid(masks, tuple(maps.shape[1:]))
    total = maps.flatten(1).sum(1)
    if (total <= 0).any():
        raise ValueError("a map has no positive mass; mass_on_object is undefined for it")
    return (maps * cover).flatten(1).sum(1) / total


def object_area(masks) -> torch.Tensor:
    """Per sample: the fraction of the image the object covers (chance level of the measures)."""
    m = _as_tensor(masks)
    return m.flatten(1).mean(1)


# ---------------------------------------------------------------------------------------------
# Many maps at once: per-layer profiles, and methods graded over many scenes
# ---------------------------------------------------------------------------------------------
#
# The functions below grade the methods of vitlab.attention / vitlab.rollout /
# vitlab.relevance on held-out scenes. They record each batch once (through vitlab.record,
# via those modules) and compute every setting or method from the same recorded attention
# (and gradient), so a table of many settings costs one forward (and one backward) per batch.


def attention_entropy(maps, normalized: bool = True) -> torch.Tensor:
    """Entropy of each map as a distribution over its patches: ``... x gh x gw`` -> ``...``.

    Each (non-negative) map is divided by its sum, then ``H = -sum_p p log p`` (with
    ``0 log 0 = 0``). With ``normalized`` (default) H is divided by ``log(gh * gw)``: 1 for a
    uniform map, 0 for a map on a single patch. A map with no positive mass raises
    ``ValueError``.
    """
    m = _as_tensor(maps)
    if m.ndim < 2:
        raise ValueError(f"maps must be ... x gh x gw, got shape {tuple(m.shape)}")
    if (m < 0).any():
        raise ValueError("attention_entropy needs non-negative maps (attention weights); got negative values")
    flat = m.flatten(-2)
    total = flat.sum(-1, keepdim=True)
    if (total <= 0).any():
        raise ValueError("a map has no positive mass; its entropy is undefined")
    p = flat / total
    h = -torch.where(p > 0, p * p.clamp_min(1e-30).log(), torch.zeros_like(p)).sum(-1)
    return h / np.log(flat.shape[-1]) if normalized else h


def layer_mass_on_object(maps, masks) -> torch.Tensor:
    """:func:`mass_on_object` for stacks of maps: ``B x ... x gh x gw`` maps -> ``B x ...``.

    Every map of sample b (e.g. ``B x layers x heads x gh x gw`` class-token attention) is
    graded against that sample's one mask ``masks[b]`` (``B x H x W``).
    """
    maps, masks = _as_tensor(maps), _as_tensor(masks)
    if maps.ndim < 3:
        raise ValueError(f"maps must be B x ... x gh x gw, got shape {tuple(maps.shape)}")
    lead = maps.shape[1:-2]
    k = int(np.prod(lead)) if lead else 1
    flat = maps.reshape(maps.shape[0] * k, *maps.shape[-2:])
    return mass_on_object(flat, masks.repeat_interleave(k, dim=0)).reshape(maps.shape[0], *lead)


def chance_pointing(masks, grid: tuple[int, int], min_coverage: float = 0.5) -> torch.Tensor:
    """Per sample: the hit rate of a uniformly random top patch in :func:`pointing_game`.

    The fraction of patches covered at least ``min_coverage`` by the object: the chance
    level the pointing game of a method should be compared with. ``B`` floats.
    """
    if not 0.0 < min_coverage <= 1.0:
        raise ValueError(f"min_coverage must be in (0, 1], got {min_coverage}")
    on = mask_to_grid(masks, grid) >= min_coverage - 1e-9
    return on.flatten(1).float().mean(1)


#: ``min_coverage`` of the lenient pointing game: the top patch holds any object pixel.
TOUCH = 1e-6


def _batches(n: int, batch_size: int):
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    for start in range(0, n, batch_size):
        yield slice(start, min(start + batch_size, n))


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


def grade_maps(maps, masks, min_coverage: float = 0.5) -> dict:
    """Mean scores of ``B x gh x gw`` maps against ``B x H x W`` masks, one dict.

    ``pointing`` (:func:`pointing_game` at ``min_coverage``), ``touch`` (the lenient game: the
    top patch holds any object pixel), ``mass`` (:func:`mass_on_object`; a map with no
    positive mass scores 0) and ``n``.
    """
    maps, masks = _as_tensor(maps), _as_tensor(masks)
    _check(maps, masks)
    positive = maps.clamp_min(0).flatten(1).sum(1) > 0
    mass = torch.zeros(maps.shape[0])
    if positive.any():
        mass[positive] = mass_on_object(maps[positive], masks[positive])
    return {"pointing": float(pointing_game(maps, masks, min_coverage).float().mean()),
            "touch": float(pointing_game(maps, masks, TOUCH).float().mean()),
            "mass": float(mass.mean()), "n": int(maps.shape[0])}


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


def grade_asked(maps: dict, masks, min_coverage: float = 0.5) -> list[dict]:
    """Grade :func:`asked_object_maps` against the objects' masks (``B x K x H x W``).

    Returns one dict per method: ``method``; ``asked`` (fraction of asks whose top patch is
    on the asked object); ``asked_touch`` (the same, lenient: the top patch holds any pixel
    of the asked object); and for K > 1 ``other`` (on another object of the scene) and
    ``all_asks`` (fraction of scenes where every ask hits its own object -- a
    class-agnostic map, the same for every ask, cannot do this for disjoint objects);
    ``n`` (scenes).
    """
    masks = _as_tensor(masks)
    rows = []
    for name, m in maps.items():
        if masks.ndim != 4 or masks.shape[:2] != m.shape[:2]:
            raise ValueError(f"need masks B x K x H x W matching maps {tuple(m.shape[:2])}, got {tuple(masks.shape)}")
        B, K = m.shape[:2]
        flat_maps = m.reshape(B * K, *m.shape[2:])
        own = masks.reshape(B * K, *masks.shape[2:])
        hit = pointing_game(flat_maps, own, min_coverage).reshape(B, K)
        row = {"method": name, "asked": float(hit.float().mean()),
               "asked_touch": float(pointing_game(flat_maps, own, TOUCH).float().mean())}
        if K > 1:
            rest = torch.stack([masks[:, [j for j in range(K) if j != k]].amax(1) for k in range(K)], dim=1)
            row["other"] = float(pointing_game(flat_maps, rest.reshape(B * K, *masks.shape[2:]), min_coverage).float().mean())
            row["all_asks"] = float(hit.all(1).float().mean())
        row["n"] = B
        rows.append(row)
    return rows


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
# Faithfulness: does the model's output respond to the pixels the map calls salient?
# ---------------------------------------------------------------------------------------------
#
# SaCo (Wu et al., CVPR 2024, "On the Faithfulness of Vision Transformer Explanations",
# Sec. 3, Alg. 1) perturbs K pixel groups *one at a time*; the perturbation curves of Chefer,
# Gur and Wolf (CVPR 2021, Sec. 4.1) remove a growing fraction of pixels cumulatively. Both
# only run the model forward (under no_grad, in eval mode, restored after); no hooks.


def _module_modes(model: torch.nn.Module) -> list[tuple[torch.nn.Module, bool]]:
    return [(m, m.training) for m in model.modules()]


def _pixel_saliency(saliency, x: torch.Tensor) -> torch.Tensor:
    """``B x gh x gw`` (bilinear upsampling) or ``B x H x W`` map -> ``B x H x W`` float on x's device."""
    if x.ndim != 4:
        raise ValueError(f"x must be B x C x H x W, got shape {tuple(x.shape)}")
    s = saliency.detach() if isinstance(saliency, torch.Tensor) else torch.as_tensor(np.asarray(saliency))
    s = s.to(device=x.device, dtype=torch.float32)
    B, _, H, W = x.shape
    if s.ndim != 3 or s.shape[0] != B:
        raise ValueError(
            f"saliency must be B x gh x gw (patch grid) or B x H x W (pixels) with B = {B}, "
            f"got shape {tuple(s.shape)}"
        )
    if s.shape[1] > H or s.shape[2] > W or min(s.shape[1:]) < 1:
        raise ValueError(f"saliency grid {tuple(s.shape[1:])} is larger than the input {H} x {W}")
    if not bool(torch.isfinite(s).all()):
        raise ValueError("saliency holds NaN or infinite values")
    if tuple(s.shape[1:]) != (H, W):
        s = F.interpolate(s[:, None], size=(H, W), mode="bilinear", align_corners=False)[:, 0]
    return s


def _channel_means(x: torch.Tensor) -> torch.Tensor:
    return x.mean(dim=(2, 3), keepdim=True)  # B x C x 1 x 1


def _run_items(model, n_items: int, make_chunk, batch_size: int, progress: bool, desc: str) -> torch.Tensor:
    """Logits of ``n_items`` inputs built chunk by chunk (``make_chunk(start, stop)``): one
    forward per chunk of ``batch_size``, eval mode and no_grad; every module's mode restored."""
    from vitlab.targets import _logits

    from tqdm.auto import tqdm

    modes = _module_modes(model)
    out = []
    try:
        model.eval()
        with torch.no_grad():
            chunks = list(_batches(n_items, batch_size))
            for s in tqdm(chunks, desc=desc, unit="forward", disable=not progress):
                out.append(_logits(model(make_chunk(s.start, s.stop))).detach().float().cpu())
    finally:
        for m, mode in modes:
            m.training = mode
    return torch.cat(out)


def saco_from_drops(drops, sums) -> torch.Tensor:
    """The Salience-guided Faithfulness Coefficient from per-group responses and saliences.

    Wu et al. 2024, Alg. 1: for groups ordered by salience and every pair i < j,
    ``w = s_i - s_j`` if ``d_i >= d_j`` else ``-(s_i - s_j)``; SaCo = ``sum w / sum |w|``,
    in [-1, 1]. ``drops`` (d) and ``sums`` (s): ``K`` or ``B x K``; returns a scalar or ``B``.
    When all s_i of a row are equal SaCo is undefined: ``ValueError``.
    """
    d = torch.as_tensor(drops, dtype=torch.float64)
    s = torch.as_tensor(sums, dtype=torch.float64)
    if d.shape != s.shape or d.ndim not in (1, 2) or d.shape[-1] < 2:
        raise ValueError(f"drops and sums must both be K or B x K with K >= 2, got {tuple(d.shape)} and {tuple(s.shape)}")
    if not (bool(torch.isfinite(d).all()) and bool(torch.isfinite(s).all())):
        raise ValueError("drops and sums must be finite")
    one = d.ndim == 1
    d, s = d.reshape(-1, d.shape[-1]), s.reshape(-1, s.shape[-1])
    K = d.shape[1]
    i, j = torch.triu_indices(K, K, offset=1)
    diff = s[:, i] - s[:, j]                                    # B x pairs
    w = torch.where(d[:, i] >= d[:, j], diff, -diff)
    total = diff.abs().sum(1)
    if bool((total == 0).any()):
        raise ValueError("all groups have the same salience (a constant map has no order): SaCo is undefined")
    out = w.sum(1) / total
    return out[0] if one else out


class SaCoResult(NamedTuple):
    """Everything :func:`saco_details` computes, per sample.

    Attributes:
        saco: ``B`` coefficients in [-1, 1].
        drops: ``B x K`` drop of the target's softmax probability when group k (most salient
            first) alone is replaced by the image's per-channel mean.
        sums: ``B x K`` salience summed over each group.
        probability: ``B`` target probability of the clean input.
        target: ``B`` classes explained.
    """

    saco: torch.Tensor
    drops: torch.Tensor
    sums: torch.Tensor
    probability: torch.Tensor
    target: torch.Tensor


def pixel_groups(saliency: torch.Tensor, k: int) -> torch.Tensor:
    """``B x H x W`` pixel map -> ``B x H x W`` group index 0..k-1 (0 = most salient).

    Pixels ranked by salience, high first (stable: ties keep raster order), split into ``k``
    groups as ``numpy.array_split`` does (the first ``n % k`` groups one pixel larger).
    """
    B, H, W = saliency.shape
    n = H * W
    if isinstance(k, bool) or not isinstance(k, int) or not 2 <= k <= n:
        raise ValueError(f"k must be an int in 2 .. {n} (number of pixels), got {k!r}")
    order = torch.argsort(saliency.reshape(B, n), dim=1, descending=True, stable=True)
    sizes = [n // k + (1 if g < n % k else 0) for g in range(k)]
    rank_group = torch.repeat_interleave(torch.arange(k, device=saliency.device),
                                         torch.tensor(sizes, device=saliency.device))
    groups = torch.empty(B, n, dtype=torch.long, device=saliency.device)
    groups.scatter_(1, order, rank_group.expand(B, n))
    return groups.reshape(B, H, W)


def saco_details(model, x: torch.Tensor, saliency, target=None, k: int = 10, batch_size: int = 64,
                 progress: bool = False) -> SaCoResult:
    """:func:`saco` with its ingredients (groups' drops and salience sums); see there."""
    from vitlab.targets import check_target, resolve_target

    sal = _pixel_saliency(saliency, x)
    B, C, H, W = x.shape
    flat = sal.reshape(B, -1)
    if bool((flat.amax(1) == flat.amin(1)).any()):
        raise ValueError("a saliency map is constant: it ranks no pixel above another, so SaCo is undefined")
    check_target(target, B)
    groups = pixel_groups(sal, k)                                       # B x H x W
    sums = torch.zeros(B, k, dtype=torch.float64, device=sal.device)
    sums.scatter_add_(1, groups.reshape(B, -1), flat.double())
    means = _channel_means(x)
    x = x.detach()

    def make_chunk(start, stop):  # item i: sample i // (k+1); 0 = clean, g + 1 = group g replaced
        idx = torch.arange(start, stop, device=x.device)
        b, g = idx // (k + 1), idx % (k + 1) - 1
        xb = x[b]
        replace = (groups[b] == g[:, None, None])[:, None]              # n x 1 x H x W (g = -1: none)
        return torch.where(replace, means[b], xb)

    logits = _run_items(model, B * (k + 1), make_chunk, batch_size, progress, "SaCo").reshape(B, k + 1, -1)
    t = resolve_target(target, logits[:, 0]).cpu()
    probs = torch.softmax(logits.double(), dim=-1)
    p_t = probs.gather(2, t[:, None, None].expand(B, k + 1, 1))[..., 0]  # B x (k+1)
    drops = p_t[:, :1] - p_t[:, 1:]
    sums = sums.cpu()
    return SaCoResult(saco_from_drops(drops, sums).float(), drops.float(), sums.float(), p_t[:, 0].float(), t)


def saco(model, x: torch.Tensor, saliency, target=None, k: int = 10, batch_size: int = 64,
         progress: bool = False) -> torch.Tensor:
    """Salience-guided Faithfulness Coefficient (Wu et al., CVPR 2024, Alg. 1) per sample: ``B``.

    Args:
        model: a classifier (timm or Hugging Face); run in eval mode under no_grad, left as it was.
        x: ``B x C x H x W`` inputs (as the model takes them).
        saliency: ``B x gh x gw`` maps (upsampled bilinearly to ``H x W``) or ``B x H x W``
            pixel maps. Wrong shape, NaN, or a constant map: ``ValueError``.
        target: :mod:`vitlab.targets` conventions (None = predicted class of the clean input).
        k: number of pixel groups (:func:`pixel_groups`: descending, stable, array_split sizes).
        batch_size: inputs per forward; the ``B x (k + 1)`` inputs (clean and each group
            replaced on its own by the image's per-channel mean) take
            ``ceil(B (k + 1) / batch_size)`` forwards.
        progress: show a tqdm bar over the forwards.

    The response of group i is ``d_i = p(t|x) - p(t|x with G_i replaced)`` (softmax
    probability), its salience ``s_i`` the map's sum over G_i; SaCo is
    :func:`saco_from_drops`. 1: more salient groups always matter more; -1: the reverse.
    """
    return saco_details(model, x, saliency, target, k, batch_size, progress).saco


def _blur(x: torch.Tensor, sigma: float) -> torch.Tensor:
    """Separable Gaussian blur of ``B x C x H x W`` (radius ``ceil(3 sigma)``, edges replicated)."""
    radius = max(1, int(np.ceil(3 * sigma)))
    t = torch.arange(-radius, radius + 1, dtype=x.dtype, device=x.device)
    g = torch.exp(-0.5 * (t / sigma) ** 2)
    g = g / g.sum()
    C = x.shape[1]
    y = F.pad(x, (radius, radius, radius, radius), mode="replicate")
    y = F.conv2d(y, g.reshape(1, 1, -1, 1).expand(C, 1, -1, 1).contiguous(), groups=C)
    return F.conv2d(y, g.reshape(1, 1, 1, -1).expand(C, 1, 1, -1).contiguous(), groups=C)


#: What removed pixels become in :func:`perturbation_curve`.
REPLACEMENTS = ("mean", "zero", "blur")

#: Chefer et al.'s fractions: the clean point and 10% .. 90% removed.
CHEFER_FRACTIONS = tuple(round(0.1 * i, 1) for i in range(10))


class PerturbationCurve(NamedTuple):
    """Result of :func:`perturbation_curve`.

    Attributes:
        fractions: ``F`` fractions of pixels removed.
        probability: ``B x F`` target softmax probability at each fraction.
        correct: ``B x F`` whether the top-1 class is the target.
        target: ``B`` classes.
        auc: ``B`` trapezoid area under ``probability`` over ``fractions``.
        auc_accuracy: ``B`` the same under ``correct`` (its mean over samples is the
            accuracy AUC of Chefer et al.).
    """

    fractions: torch.Tensor
    probability: torch.Tensor
    correct: torch.Tensor
    target: torch.Tensor
    auc: torch.Tensor
    auc_accuracy: torch.Tensor


def _trapezoid(y: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    if y.shape[-1] < 2:
        return torch.zeros(y.shape[:-1], dtype=y.dtype)
    return ((y[..., 1:] + y[..., :-1]) / 2 * (t[1:] - t[:-1])).sum(-1)


def perturbation_curve(model, x: torch.Tensor, saliency, target=None, positive: bool = True,
                       fractions=CHEFER_FRACTIONS, replacement: str = "mean", batch_size: int = 64,
                       blur_sigma: float | None = None, progress: bool = False) -> PerturbationCurve:
    """Cumulative perturbation test (Chefer, Gur, Wolf 2021, Sec. 4.1) per sample.

    At each fraction f, the ``int(f * H * W)`` most salient pixels (``positive``; the least
    salient for ``positive=False``; stable order, ties in raster order) are replaced and the
    target's softmax probability and top-1 correctness recorded. ``replacement``: ``"mean"``
    (the image's per-channel mean), ``"zero"`` (0 in the model's input space, Chefer's
    choice on normalised inputs) or ``"blur"`` (a Gaussian blur of the image, ``blur_sigma``
    pixels, default ``min(H, W) / 16``). Lower positive AUC and higher negative AUC are
    better. ``saliency``, ``target``, ``batch_size`` as in :func:`saco`; ``B x F`` inputs,
    ``ceil(B F / batch_size)`` forwards. The target (None = predicted) is decided on the
    clean input, which must be the first fraction 0 when ``target`` is None.
    """
    from vitlab.targets import check_target, resolve_target

    if replacement not in REPLACEMENTS:
        raise ValueError(f"replacement must be one of {REPLACEMENTS}, got {replacement!r}")
    fr = torch.as_tensor(np.asarray(fractions, dtype=np.float64))
    if fr.ndim != 1 or fr.numel() < 1 or bool(((fr < 0) | (fr > 1)).any()) or bool((fr[1:] <= fr[:-1]).any()):
        raise ValueError(f"fractions must be increasing values in [0, 1], got {list(np.asarray(fractions).ravel())}")
    if target is None and fr[0] != 0:
        raise ValueError("with target=None the first fraction must be 0 (the clean input decides the predicted class)")
    sal = _pixel_saliency(saliency, x)
    B, C, H, W = x.shape
    n = H * W
    check_target(target, B)
    x = x.detach()
    if replacement == "mean":
        fill = _channel_means(x).expand_as(x)
    elif replacement == "zero":
        fill = torch.zeros_like(x)
    else:
        sigma = float(blur_sigma) if blur_sigma is not None else min(H, W) / 16
        if not sigma > 0:
            raise ValueError(f"blur_sigma must be positive, got {blur_sigma}")
        fill = _blur(x, sigma)
    order = torch.argsort(sal.reshape(B, n), dim=1, descending=bool(positive), stable=True)
    rank = torch.empty(B, n, dtype=torch.long, device=x.device)
    rank.scatter_(1, order, torch.arange(n, device=x.device).expand(B, n))
    rank = rank.reshape(B, 1, H, W)
    counts = torch.tensor([int(float(f) * n + 1e-9) for f in fr], device=x.device)
    Fn = fr.numel()

    def make_chunk(start, stop):  # item i: sample i // F at fraction i % F
        idx = torch.arange(start, stop, device=x.device)
        b, f = idx // Fn, idx % Fn
        return torch.where(rank[b] < counts[f][:, None, None, None], fill[b], x[b])

    logits = _run_items(model, B * Fn, make_chunk, batch_size, progress, "perturbation").reshape(B, Fn, -1)
    t = resolve_target(target, logits[:, 0]).cpu()
    prob = torch.softmax(logits.double(), -1).gather(2, t[:, None, None].expand(B, Fn, 1))[..., 0].float()
    correct = logits.argmax(-1) == t[:, None]
    fr = fr.float()
    return PerturbationCurve(fr, prob, correct, t, _trapezoid(prob, fr), _trapezoid(correct.float(), fr))
