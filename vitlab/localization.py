"""Plausibility: grade explanation maps against known object masks.

Pointing at the object is *plausibility* (does the map agree with where the object is?), not
faithfulness (does the model's output depend on what the map calls salient? see
:mod:`vitlab.faithfulness`). The shapes scenes (``vitlab.shapes``) come with every object's
pixel mask, so a map over the patch grid can be graded, not just looked at:

- :func:`mask_to_grid` — the fraction of each patch covered by the object;
- :func:`pointing_game` — does the map's highest patch lie on the object (Zhang et al.
  2016, "Top-down neural attention by excitation backprop", on patches: a hit when at least
  ``min_coverage`` of the top patch is object);
- :func:`mass_on_object` — the share of the map's (non-negative) mass on object patches,
  with the object's area share as the chance level;
- :func:`grade_maps`, :func:`grade_asked` — those measures over many maps, one object or
  each object of a scene asked for in turn.

They take maps and masks only; no model is called here.
"""
from __future__ import annotations

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
