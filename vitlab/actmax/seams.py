"""How visible is the patch grid in an image? The seam measure of chapter 8.

A ViT cuts its input into ``P x P`` patches and embeds each one on its own, so an image
optimised for a ViT can change abruptly where one patch ends and the next begins. The
seam measure compares image gradients *across* patch borders with those *inside* patches:

    seam_ratio = mean |x[c, i, j+1] - x[c, i, j]| and |x[c, i+1, j] - x[c, i, j]| over
                 pixel pairs that straddle a patch border
                 / the same mean over pixel pairs inside one patch

1.0 means the borders are no different from anywhere else (no visible grid); a patchy image
has a ratio well above 1. Patch ``k`` along an axis covers pixels
``[offset + k * P, offset + (k + 1) * P)``; a pair straddles a border when its second pixel
starts a patch.

The seam ratio sees steps at the borders only. An image whose patches all repeat one layout
(a tiling) shows the grid to the eye with no step at any border; :func:`patch_period_contrast`
measures that second sign of the patch grid.
"""
from __future__ import annotations

import torch

__all__ = ["border_masks", "image_gradients", "seam_ratio", "border_difference", "seam_profile",
           "mean_patch", "patch_period_contrast"]


def _pair(v, what: str) -> tuple[int, int]:
    if isinstance(v, (tuple, list)):
        if len(v) != 2:
            raise ValueError(f"{what} must be an int or a pair (h, w), got {v!r}")
        a, b = int(v[0]), int(v[1])
    else:
        a = b = int(v)
    return a, b


def _check_images(images: torch.Tensor) -> torch.Tensor:
    if not isinstance(images, torch.Tensor):
        raise TypeError(f"images must be a torch.Tensor, got {type(images).__name__}")
    if images.ndim == 3:
        images = images[None]
    if images.ndim != 4:
        raise ValueError(f"images must be B x C x H x W (or C x H x W), got shape {tuple(images.shape)}")
    return images


def border_masks(size, patch_size, offset=0, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Which neighbouring-pixel pairs straddle a patch border.

    Returns ``(across_cols, across_rows)``: bool vectors of length ``W - 1`` and ``H - 1``;
    ``across_cols[j]`` is True when pixels ``j`` and ``j + 1`` of a row lie in different
    patches (``(j + 1 - offset) % P == 0``), likewise for rows.
    """
    h, w = _pair(size, "size")
    ph, pw = _pair(patch_size, "patch_size")
    oh, ow = _pair(offset, "offset")
    if ph < 2 or pw < 2:
        raise ValueError(f"patch_size must be at least 2 pixels, got {(ph, pw)}")
    if h <= ph or w <= pw:
        raise ValueError(f"image ({h} x {w}) must be larger than one patch ({ph} x {pw}) to have borders")
    cols = (torch.arange(1, w, device=device) - ow) % pw == 0
    rows = (torch.arange(1, h, device=device) - oh) % ph == 0
    return cols, rows


def image_gradients(images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(|d/dx|, |d/dy|)``: absolute differences of horizontally (``B x C x H x W-1``) and
    vertically (``B x C x H-1 x W``) neighbouring pixels."""
    images = _check_images(images)
    dx = (images[..., :, 1:] - images[..., :, :-1]).abs()
    dy = (images[..., 1:, :] - images[..., :-1, :]).abs()
    return dx, dy


def border_difference(images: torch.Tensor, patch_size, offset=0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(across, inside)``: per image, the mean absolute difference of neighbouring pixels
    that straddle a patch border, and of those inside one patch (both ``B``)."""
    images = _check_images(images)
    H, W = images.shape[-2:]
    cols, rows = border_masks((H, W), patch_size, offset, device=images.device)
    dx, dy = image_gradients(images)
    B = images.shape[0]
    dx = dx.reshape(B, -1, W - 1)  # every row of every channel
    dy = dy.reshape(B, images.shape[1], H - 1, W).transpose(1, 2).reshape(B, H - 1, -1)
    n_rows_x = dx.shape[1]
    n_cols_y = dy.shape[2]
    across_sum = dx[:, :, cols].sum((1, 2)) + dy[:, rows, :].sum((1, 2))
    inside_sum = dx[:, :, ~cols].sum((1, 2)) + dy[:, ~rows, :].sum((1, 2))
    n_across = n_rows_x * int(cols.sum()) + n_cols_y * int(rows.sum())
    n_inside = n_rows_x * int((~cols).sum()) + n_cols_y * int((~rows).sum())
    return across_sum / n_across, inside_sum / n_inside


def seam_ratio(images: torch.Tensor, patch_size, offset=0) -> torch.Tensor:
    """The seam measure of each image (``B``): mean |gradient| across patch borders over the
    mean |gradient| inside patches. 1.0 = no visible patch grid; ``nan`` for a constant image.

    Args:
        images: ``B x C x H x W`` (or ``C x H x W``), any value range.
        patch_size: the model's patch size (int or ``(ph, pw)``).
        offset: pixel where the patch grid starts (0 for a ViT's input).
    """
    across, inside = border_difference(images, patch_size, offset)
    with torch.no_grad():
        return across.detach() / inside.detach()


def seam_profile(images: torch.Tensor, patch_size: int) -> torch.Tensor:
    """``B x P``: mean absolute difference of neighbouring pixels by where the pair sits in
    its patch. Entry ``k`` averages the horizontal pairs ``(j, j + 1)`` with
    ``(j + 1) % P == k`` and the vertical pairs likewise; entry 0 is the pairs that straddle a
    border. A visible grid is a spike at 0; ``profile[0] / profile[1:].mean()`` is the seam
    ratio when the image side is a multiple of ``P``. Square patches only."""
    images = _check_images(images)
    if isinstance(patch_size, (tuple, list)):
        if len(patch_size) != 2 or patch_size[0] != patch_size[1]:
            raise ValueError(f"seam_profile needs square patches, got {patch_size!r}")
        patch_size = patch_size[0]
    P = int(patch_size)
    H, W = images.shape[-2:]
    border_masks((H, W), P)  # validates sizes
    dx, dy = image_gradients(images)
    B = images.shape[0]
    pos_x = (torch.arange(1, W, device=images.device)) % P
    pos_y = (torch.arange(1, H, device=images.device)) % P
    out = torch.empty(B, P, dtype=dx.dtype, device=images.device)
    for k in range(P):
        sx, nx = dx[..., pos_x == k], int((pos_x == k).sum())
        sy, ny = dy[..., pos_y == k, :], int((pos_y == k).sum())
        total = sx.flatten(1).sum(1) + sy.flatten(1).sum(1)
        count = nx * dx.shape[1] * dx.shape[2] + ny * dy.shape[1] * dy.shape[3]
        out[:, k] = total / count
    return out.detach()


def _whole_patches(images: torch.Tensor, patch_size) -> tuple[torch.Tensor, torch.Tensor]:
    images = _check_images(images)
    ph, pw = _pair(patch_size, "patch_size")
    H, W = images.shape[-2:]
    if ph < 1 or pw < 1 or H // ph * (W // pw) < 2:
        raise ValueError(f"patch_size {(ph, pw)} must fit at least two whole patches into the "
                         f"{H} x {W} image")
    whole = images[..., : H // ph * ph, : W // pw * pw]
    return whole, whole.unfold(2, ph, ph).unfold(3, pw, pw)      # B x C x gh x gw x ph x pw


def mean_patch(images: torch.Tensor, patch_size) -> torch.Tensor:
    """The mean of all whole ``P x P`` patches of each image: ``B x C x ph x pw`` (detached).
    What :func:`patch_period_contrast` measures the contrast of: a layout every patch repeats
    survives the averaging, unrelated patches average out towards a flat patch.

    Args:
        images: ``B x C x H x W`` (or ``C x H x W``); only whole patches from the top left count.
        patch_size: the model's patch size (int or ``(ph, pw)``).
    """
    _, patches = _whole_patches(images, patch_size)
    return patches.mean((2, 3)).detach()


def patch_period_contrast(images: torch.Tensor, patch_size) -> torch.Tensor:
    """How much the patches of each image (``B``) share one layout: average all its ``P x P``
    patches into one mean patch, and divide that mean patch's contrast (its standard deviation
    over positions) by the image's own (standard deviations over pixels, averaged over the
    channels; population standard deviations).

    1.0 for an image tiled with one patch; about ``1 / sqrt(number of patches)`` when the
    patches are unrelated (the mean of ``n`` independent patches keeps ``1 / sqrt(n)`` of their
    spread); 0 when the layouts cancel. A pattern with the patch period is caught whatever its
    phase, so a grid with no step at the borders (seam ratio about 1) still shows here.

    Args:
        images: ``B x C x H x W`` (or ``C x H x W``); only whole patches from the top left count.
        patch_size: the model's patch size (int or ``(ph, pw)``).
    """
    whole, patches = _whole_patches(images, patch_size)
    layout = patches.mean((2, 3)).flatten(2).std(2, correction=0).mean(1)   # the mean patch's
    spread = whole.flatten(2).std(2, correction=0).mean(1)
    with torch.no_grad():
        return (layout / spread).detach()
