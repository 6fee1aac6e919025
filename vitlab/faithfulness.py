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
    return torch.as_tensor(np.asarray(a), dtype=dtype)


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


def grade_rollout_settings(model, x: torch.Tensor, masks, settings: Sequence[tuple[str, float]],
                           batch_size: int = 50, min_coverage: float = 0.5) -> list[dict]:
    """Pointing game and mass on the object of attention rollout, for several settings at once.

    Args:
        model: a ViT with a class token (eval mode).
        x: ``B x 3 x H x W`` inputs; ``masks``: ``B x H' x W'`` one object mask per input.
        settings: ``(head_fusion, discard_ratio)`` pairs.
        batch_size: inputs per forward; each batch is recorded once and every setting is
            computed from that recording (:func:`rollout_from_attentions`).
        min_coverage: see :func:`pointing_game`.

    Returns one dict per setting, in order: ``head_fusion``, ``discard_ratio``, ``pointing``
    (fraction of hits), ``mass`` (mean share of map mass on the object), ``n``.
    """
    from vitlab.attention import _recorded_attentions, require_cls

    masks = _as_tensor(masks)
    if masks.ndim != 3 or masks.shape[0] != x.shape[0]:
        raise ValueError(f"need one B x H x W mask per input: {x.shape[0]} inputs, masks {tuple(masks.shape)}")
    settings = [(str(f), float(d)) for f, d in settings]
    if not settings:
        raise ValueError("settings must hold at least one (head_fusion, discard_ratio) pair")
    hits = [[] for _ in settings]
    mass = [[] for _ in settings]
    for s in _batches(x.shape[0], batch_size):
        attentions, layout = _recorded_attentions(model, x[s])
        require_cls(layout, "grade_rollout_settings")
        for i, (fusion, ratio) in enumerate(settings):
            maps = rollout_from_attentions(attentions, layout, fusion, ratio)
            hits[i].append(pointing_game(maps, masks[s], min_coverage))
            mass[i].append(mass_on_object(maps, masks[s]))
    return [
        {"head_fusion": f, "discard_ratio": d, "pointing": float(torch.cat(h).float().mean()),
         "mass": float(torch.cat(m).mean()), "n": int(x.shape[0])}
        for (f, d), h, m in zip(settings, hits, mass)
    ]


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


def grade_asked_object(model, x: torch.Tensor, labels, masks, batch_size: int = 50, min_coverage: float = 0.5,
                       rollout_setting: tuple[str, float] = ("mean", 0.0),
                       grad_discard_ratio: float = 0.0) -> list[dict]:
    """For every method of :data:`CLASS_METHODS`: does the map point at the object of the asked class?

    Each scene holds K objects (``labels``: ``B x K`` classes, ``masks``: ``B x K x H x W``).
    Each object is asked for in turn (``target`` = its class); a method scores a hit when
    the highest patch of its map lies on the asked object (:func:`pointing_game`). One
    forward and one backward per batch covers all K asks (the batch is repeated K times).

    Returns one dict per method: ``method``; ``asked`` (fraction of asks whose top patch is
    on the asked object); and for K > 1 ``other`` (on another object of the scene) and
    ``all_asks`` (fraction of scenes where every ask hits its own object -- a
    class-agnostic map, the same for every ask, can only do this by luck of ties); ``n``
    (scenes).
    """
    from vitlab.attention import attention_gradients

    labels = torch.as_tensor(np.asarray(labels), dtype=torch.long)
    masks = _as_tensor(masks)
    if labels.ndim != 2 or masks.ndim != 4 or masks.shape[:2] != labels.shape or labels.shape[0] != x.shape[0]:
        raise ValueError(
            f"need labels B x K and masks B x K x H x W for B = {x.shape[0]} inputs; "
            f"got labels {tuple(labels.shape)}, masks {tuple(masks.shape)}"
        )
    B, K = labels.shape
    asked = {m: [] for m in CLASS_METHODS}
    other = {m: [] for m in CLASS_METHODS}
    for s in _batches(B, batch_size):
        b = s.stop - s.start
        xb = x[s].repeat(K, 1, 1, 1)  # ask k occupies rows k*b .. (k+1)*b - 1
        target = labels[s].T.reshape(-1)
        ag = attention_gradients(model, xb, target)
        maps = maps_from_gradients(ag, rollout_setting, grad_discard_ratio)
        own = masks[s].transpose(0, 1).reshape(K * b, *masks.shape[2:])
        rest = torch.stack([masks[s][:, [j for j in range(K) if j != k]].amax(1) for k in range(K)]) if K > 1 else None
        for name, m in maps.items():
            asked[name].append(pointing_game(m, own, min_coverage).reshape(K, b).T)  # b x K
            if rest is not None:
                other[name].append(pointing_game(m, rest.reshape(K * b, *masks.shape[2:]), min_coverage).reshape(K, b).T)
    rows = []
    for name in CLASS_METHODS:
        hit = torch.cat(asked[name])  # B x K
        row = {"method": name, "asked": float(hit.float().mean())}
        if K > 1:
            row["other"] = float(torch.cat(other[name]).float().mean())
            row["all_asks"] = float(hit.all(1).float().mean())
        row["n"] = B
        rows.append(row)
    return rows
