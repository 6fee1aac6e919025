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
