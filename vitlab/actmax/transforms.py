"""Random transformations applied to the jittered copies at every optimisation step.

Each transform is a callable ``(x, generator) -> x`` on a ``B x 3 x H x W`` batch in
``[0, 1]`` that draws its randomness from a seeded CPU :class:`torch.Generator`, one draw
per batch item, so runs are reproducible on any device. :func:`compose` chains them.

- :func:`roll` — circular shift by up to ``max_shift`` pixels (Ghiasi et al. 2022 roll ±32),
  in steps of ``step`` pixels: ``step = patch size`` keeps the patch grid where it was,
  ``step = 1`` moves it anywhere.
- :func:`scale`, :func:`rotate` — random zoom / rotation about the centre (bilinear,
  reflected borders).
- :func:`colour_jitter` — per-image, per-channel ``x * (1 + a) + b`` (Ghiasi's colour shift
  and scale).
- :func:`largest_shift` — how far a transform moved a pixel over many draws (a probe).
"""
from __future__ import annotations

import math
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

__all__ = ["Transform", "compose", "roll", "scale", "rotate", "colour_jitter", "standard", "largest_shift"]

Transform = Callable[[torch.Tensor, torch.Generator], torch.Tensor]


def _uniform(n: int, lo: float, hi: float, generator: torch.Generator, device) -> torch.Tensor:
    return (lo + (hi - lo) * torch.rand(n, generator=generator)).to(device)


def compose(transforms: Sequence[Transform]) -> Transform:
    """Apply ``transforms`` in order."""
    transforms = list(transforms)
    for t in transforms:
        if not callable(t):
            raise ValueError(f"every transform must be callable (x, generator) -> x, got {t!r}")

    def apply(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        for t in transforms:
            x = t(x, generator)
        return x

    return apply


def roll(max_shift: int, step: int = 1) -> Transform:
    """Circularly shift each image by ``dy, dx`` drawn uniformly from the multiples of
    ``step`` in ``[-max_shift, max_shift]``."""
    if isinstance(max_shift, bool) or not isinstance(max_shift, int) or max_shift < 0:
        raise ValueError(f"max_shift must be an int >= 0, got {max_shift!r}")
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise ValueError(f"step must be an int >= 1, got {step!r}")
    k = max_shift // step

    def apply(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        B, C, H, W = x.shape
        shifts = (torch.randint(-k, k + 1, (2, B), generator=generator) * step).to(x.device)
        rows = (torch.arange(H, device=x.device)[None, :] - shifts[0][:, None]) % H      # B x H
        cols = (torch.arange(W, device=x.device)[None, :] - shifts[1][:, None]) % W      # B x W
        x = x.gather(2, rows[:, None, :, None].expand(B, C, H, W))
        return x.gather(3, cols[:, None, None, :].expand(B, C, H, W))

    return apply


def _affine(x: torch.Tensor, theta: torch.Tensor) -> torch.Tensor:
    grid = F.affine_grid(theta, list(x.shape), align_corners=False)
    return F.grid_sample(x, grid, mode="bilinear", padding_mode="reflection", align_corners=False)


def scale(lo: float = 0.9, hi: float = 1.1) -> Transform:
    """Zoom each image by a factor drawn uniformly from ``[lo, hi]`` (> 1 magnifies)."""
    if not 0 < lo <= hi:
        raise ValueError(f"scale needs 0 < lo <= hi, got lo={lo}, hi={hi}")

    def apply(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        s = _uniform(x.shape[0], lo, hi, generator, x.device).to(x.dtype)
        theta = torch.zeros(x.shape[0], 2, 3, dtype=x.dtype, device=x.device)
        theta[:, 0, 0] = theta[:, 1, 1] = 1.0 / s
        return _affine(x, theta)

    return apply


def rotate(degrees: float = 5.0) -> Transform:
    """Rotate each image by an angle drawn uniformly from ``[-degrees, degrees]``."""
    if degrees < 0:
        raise ValueError(f"degrees must be >= 0, got {degrees}")

    def apply(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        a = _uniform(x.shape[0], -degrees, degrees, generator, x.device).to(x.dtype) * (math.pi / 180.0)
        H, W = x.shape[-2:]
        theta = torch.zeros(x.shape[0], 2, 3, dtype=x.dtype, device=x.device)
        # rotation in pixel space, expressed in normalised coordinates of a non-square image
        theta[:, 0, 0] = torch.cos(a)
        theta[:, 0, 1] = -torch.sin(a) * H / W
        theta[:, 1, 0] = torch.sin(a) * W / H
        theta[:, 1, 1] = torch.cos(a)
        return _affine(x, theta)

    return apply


def colour_jitter(shift: float = 0.1, scale: float = 0.1) -> Transform:
    """Per image and channel: ``x * (1 + a) + b`` with ``a ~ U[-scale, scale]``,
    ``b ~ U[-shift, shift]`` (values may leave ``[0, 1]``, as in Ghiasi et al.)."""
    if shift < 0 or scale < 0 or scale >= 1:
        raise ValueError(f"colour_jitter needs shift >= 0 and 0 <= scale < 1, got shift={shift}, scale={scale}")

    def apply(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        B, C = x.shape[:2]
        a = _uniform(B * C, -scale, scale, generator, x.device).view(B, C, 1, 1).to(x.dtype)
        b = _uniform(B * C, -shift, shift, generator, x.device).view(B, C, 1, 1).to(x.dtype)
        return x * (1 + a) + b

    return apply


def standard(patch_size: int, max_shift: int | None = None, step: int | None = None, *, scale_range=None,
             degrees: float = 0.0, shift: float = 0.1, colour_scale: float = 0.1) -> Transform:
    """The jittered copies' transformations: roll by up to ``max_shift`` (default: two patches) in
    steps of ``step`` pixels, then optional zoom and rotation, then colour jitter.

    The default step is vitlab's own choice: whole patches, which keeps the patch grid on the
    same pixels (the setting that shows the seams of chapter 8). Ghiasi et al.'s code rolls by
    any number of pixels (their ``Jitter``, up to 32 px, in ``hamidkazemi22/vit-visualization``,
    ``augmentation/pre.py``): that is ``step=1``."""
    max_shift = 2 * patch_size if max_shift is None else max_shift
    ts: list[Transform] = [roll(max_shift, step=patch_size if step is None else step)]
    if scale_range is not None:
        ts.append(scale(*scale_range))
    if degrees:
        ts.append(rotate(degrees))
    if shift or colour_scale:
        ts.append(colour_jitter(shift, colour_scale))
    return compose(ts)


def largest_shift(transform: Transform, size: int | tuple[int, int], n: int = 500, seed: int = 0) -> int:
    """The largest distance, in pixels along either axis, that ``transform`` moved a pixel over
    ``n`` draws: a probe, not a parameter read back.

    A black ``size`` image with one white pixel in its top-left corner is transformed ``n`` times
    (one seeded generator); in each copy the brightest pixel is where that pixel went, and a shift
    is counted the short way round the edges (a roll by ``-k`` and by ``H - k`` are the same
    shift). For rolls and colour jitter (which keeps the brightest pixel the brightest) this is
    the largest roll drawn; zoom and rotation move the corner pixel too.

    Raises:
        ValueError: if ``size`` is not one or two positive ints or ``n`` is not a positive int.
    """
    h, w = (size, size) if isinstance(size, int) and not isinstance(size, bool) else tuple(size)
    if any(isinstance(v, bool) or not isinstance(v, int) or v <= 0 for v in (h, w)):
        raise ValueError(f"size must be a positive int or an (H, W) pair of them, got {size!r}")
    if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
        raise ValueError(f"n must be a positive int (the number of draws), got {n!r}")
    probe = torch.zeros(n, 3, h, w)
    probe[:, :, 0, 0] = 1.0
    moved = transform(probe, torch.Generator().manual_seed(seed))
    where = moved.mean(1).flatten(1).argmax(1)                   # each copy's brightest pixel
    dy, dx = where // w, where % w
    return int(torch.maximum(torch.minimum(dy, h - dy), torch.minimum(dx, w - dx)).max())
