"""Real images to compare optimised images with: "does the optimised image excite the unit
more than any real image does?" (chapter 8's must-reach check).

- :func:`photo_crops` — random square crops (area 10-100 %, random horizontal flip) of the
  photos that ship inside installed packages (:mod:`vitlab.images`), resized to the model's
  input: a few hundred distinct natural images without any network.
- :func:`reference_images` — scenes from :func:`vitlab.shapes.make_scenes` for the shapes
  model, photo crops for every other model.
"""
from __future__ import annotations

import numpy as np
import torch
from PIL import Image

from vitlab.inputs import positive_int

__all__ = ["PHOTOS", "photo_crops", "reference_images"]

#: Sample photos used for crops: natural photographs and textures (no logo, page of text,
#: binary silhouette, and no duplicate of chelsea).
PHOTOS = ("astronaut", "brick", "camera", "chelsea", "coffee", "coins", "grace_hopper", "grass", "gravel",
          "hubble_deep_field", "immunohistochemistry", "moon", "motorcycle", "retina", "rocket")


def _size(size) -> tuple[int, int]:
    h, w = (size, size) if isinstance(size, int) else tuple(size)
    if h < 8 or w < 8:
        raise ValueError(f"crop size must be at least 8 x 8, got {h} x {w}")
    return int(h), int(w)


def photo_crops(n: int, size, seed: int = 0, photos=PHOTOS) -> torch.Tensor:
    """``n x 3 x H x W`` crops in ``[0, 1]``, cycling through ``photos`` (deterministic per seed)."""
    from vitlab.images import load

    positive_int("n", n)
    h, w = _size(size)
    rng = np.random.default_rng(seed)
    sources = [load(name) for name in photos]
    out = np.empty((n, h, w, 3), dtype=np.uint8)
    for i in range(n):
        img = sources[i % len(sources)]
        W, H = img.size
        side_max = min(W, H)
        side = int(round(side_max * np.sqrt(rng.uniform(0.1, 1.0))))
        x0 = int(rng.integers(0, W - side + 1))
        y0 = int(rng.integers(0, H - side + 1))
        crop = img.crop((x0, y0, x0 + side, y0 + side)).resize((w, h), Image.BICUBIC)
        if rng.random() < 0.5:
            crop = crop.transpose(Image.FLIP_LEFT_RIGHT)
        out[i] = np.asarray(crop)
    return torch.from_numpy(out).permute(0, 3, 1, 2).float().div_(255.0)


def reference_images(model, n: int = 200, seed: int = 0) -> torch.Tensor:
    """``n`` real ``[0, 1]`` images at ``model``'s input size: generated scenes for the
    shapes model (``vitlab.shapes.make_scenes``), photo crops otherwise."""
    from vitlab.models import data_config

    size = tuple(int(s) for s in data_config(model)["input_size"][1:])
    if getattr(model, "shapes_config", None) is not None:
        from vitlab.shapes import make_scenes

        if size[0] != size[1]:
            raise ValueError(f"shapes scenes are square; the model takes {size}")
        scenes = make_scenes(n, seed, size=size[0])
        return torch.from_numpy(scenes.images).permute(0, 3, 1, 2).float().div_(255.0)
    return photo_crops(n, size, seed)
