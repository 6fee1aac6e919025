"""Drawing helpers used by every notebook: a grid-shaped map over an image, grids of maps
with titles, and small tables. They only draw what they are given; no explanation is
computed here.
"""
from __future__ import annotations

from typing import Sequence


import matplotlib.pyplot as plt
import numpy as np
import torch
import torch.nn.functional as F


def _to_numpy_image(image) -> np.ndarray:
    """PIL image, H x W x 3 array (uint8 or float in [0, 1]) or 3 x H x W tensor -> float H x W x 3."""
    if isinstance(image, torch.Tensor):
        t = image.detach().float().cpu()
        if t.ndim == 4 and t.shape[0] == 1:
            t = t[0]
        if t.ndim == 3 and t.shape[0] in (1, 3):
            t = t.permute(1, 2, 0)
        arr = t.numpy()
    else:
        arr = np.asarray(image)
    if arr.ndim == 2:
        arr = np.stack([arr] * 3, axis=-1)
    if arr.ndim != 3 or arr.shape[-1] not in (3, 4):
        raise ValueError(f"expected an RGB image (H x W x 3), got shape {arr.shape}")
    arr = arr[..., :3]
    if arr.dtype == np.uint8:
        return arr.astype(np.float32) / 255.0
    arr = arr.astype(np.float32)
    lo, hi = float(arr.min()), float(arr.max())
    if lo < 0.0 or hi > 1.0:  # e.g. a normalised input tensor: stretch for display
        arr = (arr - lo) / max(hi - lo, 1e-12)
    return arr


def _to_numpy_map(m) -> np.ndarray:
    if isinstance(m, torch.Tensor):
        m = m.detach().float().cpu().numpy()
    m = np.asarray(m, dtype=np.float32)
    if m.ndim != 2:
        raise ValueError(f"expected a 2-D map (gh x gw), got shape {m.shape}")
    return m


def upsample_map(m, size: tuple[int, int], mode: str = "bilinear") -> np.ndarray:
    """A ``gh x gw`` map -> ``H x W`` (bilinear by default; ``"nearest"`` shows the patches)."""
    t = torch.as_tensor(_to_numpy_map(m))[None, None]
    kwargs = {"align_corners": False} if mode in ("bilinear", "bicubic") else {}
    return F.interpolate(t, size=tuple(int(s) for s in size), mode=mode, **kwargs)[0, 0].numpy()


def normalize_map(m) -> np.ndarray:
    """Scale a map to [0, 1] (min-max); a constant map becomes zeros."""
    m = _to_numpy_map(m)
    lo, hi = float(m.min()), float(m.max())
    return (m - lo) / (hi - lo) if hi > lo else np.zeros_like(m)


def overlay(image, m, ax=None, cmap: str = "jet", alpha: float = 0.5, mode: str = "bilinear",
            normalize: bool = True, title: str | None = None, colorbar: bool = False):
    """Draw ``image`` with the grid-shaped map ``m`` upsampled to its size on top.

    Returns the matplotlib Axes.
    """
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    img = _to_numpy_image(image)
    heat = normalize_map(m) if normalize else _to_numpy_map(m)
    heat = upsample_map(heat, img.shape[:2], mode=mode)
    if ax is None:
        _, ax = plt.subplots(figsize=(4, 4))
    ax.imshow(img)
    im = ax.imshow(heat, cmap=cmap, alpha=alpha, vmin=0.0 if normalize else None, vmax=1.0 if normalize else None)
    if colorbar:
        ax.figure.colorbar(im, ax=ax, fraction=0.046, pad=0.04)
    ax.set_axis_off()
    if title:
        ax.set_title(title, fontsize=9)
    return ax


def show_map(m, ax=None, cmap: str = "viridis", title: str | None = None, vmin=None, vmax=None):
    """Draw a grid-shaped map on its own (one cell per patch)."""
    arr = _to_numpy_map(m)
    if ax is None:
        _, ax = plt.subplots(figsize=(3, 3))
    ax.imshow(arr, cmap=cmap, vmin=vmin, vmax=vmax, interpolation="nearest")
    ax.set_xticks([])
    ax.set_yticks([])
    if title:
        ax.set_title(title, fontsize=9)
    return ax


def map_grid(maps: Sequence, titles: Sequence[str] | None = None, image=None, ncols: int | None = None,
             cmap: str | None = None, alpha: float = 0.5, size: float = 2.2, suptitle: str | None = None,
             row_labels: Sequence[str] | None = None, **kwargs):
    """A grid of maps, each overlaid on ``image`` (or drawn alone when ``image`` is None).

    ``maps`` is a sequence of ``gh x gw`` maps, or a tensor/array ``R x C x gh x gw`` (then
    the grid has R rows and C columns). ``image`` is one image for all maps or a sequence of
    images, one per map. Returns the Figure.
    """
    if isinstance(maps, (torch.Tensor, np.ndarray)) and maps.ndim == 4:
        rows, cols = maps.shape[:2]
        flat = [maps[r, c] for r in range(rows) for c in range(cols)]
    else:
        flat = list(maps)
        cols = ncols or min(len(flat), 6)
        rows = int(np.ceil(len(flat) / cols)) if flat else 0
    if not flat:
        raise ValueError("map_grid needs at least one map")
    if titles is not None and len(titles) != len(flat):
        raise ValueError(f"got {len(titles)} titles for {len(flat)} maps")
    images = image if isinstance(image, (list, tuple)) else [image] * len(flat)
    if len(images) != len(flat):
        raise ValueError(f"got {len(images)} images for {len(flat)} maps")
    fig, axes = plt.subplots(rows, cols, figsize=(size * cols, size * rows), squeeze=False)
    for i, ax in enumerate(axes.flat):
        if i >= len(flat):
            ax.set_axis_off()
            continue
        t = titles[i] if titles is not None else None
        if images[i] is None:
            show_map(flat[i], ax=ax, cmap=cmap or "viridis", title=t, **kwargs)
        else:
            overlay(images[i], flat[i], ax=ax, cmap=cmap or "jet", alpha=alpha, title=t, **kwargs)
    if row_labels is not None:
        for r, label in enumerate(row_labels[:rows]):
            axes[r, 0].set_axis_on()
            axes[r, 0].set_xticks([])
            axes[r, 0].set_yticks([])
            for spine in axes[r, 0].spines.values():
                spine.set_visible(False)
            axes[r, 0].set_ylabel(label, fontsize=9)
    if suptitle:
        fig.suptitle(suptitle)
    fig.tight_layout()
    return fig


def class_grid(labels, names: Sequence[str], image=None, titles: Sequence[str] | None = None,
               row_labels: Sequence[str] | None = None, alpha: float = 0.6, size: float = 1.8,
               suptitle: str | None = None, outline=None):
    """Per-patch class labels, one colour per class, optionally over an image, with a legend.

    ``labels``: integer array ``R x C x gh x gw`` (e.g. each token's top class, scenes x
    blocks), values in ``0 .. len(names) - 1``. ``image``: None, one image for all panels, or
    one per row (a sequence of R images); with an image the colours are blended with it
    (``alpha``), without one they are drawn opaque, so they match the legend exactly.
    ``outline``: optional ``R x H x W`` boolean masks (e.g. the objects) drawn as a white
    contour on every panel of their row. Patches are drawn as blocks (nearest), since a label
    belongs to a whole token. Returns the Figure.
    """
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    lab = np.asarray(labels.detach().cpu() if isinstance(labels, torch.Tensor) else labels)
    if lab.ndim != 4 or lab.dtype.kind not in "iu":
        raise ValueError(f"labels must be an integer array R x C x gh x gw, got {lab.dtype} {lab.shape}")
    k = len(names)
    if lab.size and (lab.min() < 0 or lab.max() >= k):
        raise ValueError(f"labels must lie in 0 .. {k - 1} ({k} names), got {lab.min()} .. {lab.max()}")
    rows, cols = lab.shape[:2]
    if titles is not None and len(titles) != rows * cols:
        raise ValueError(f"got {len(titles)} titles for {rows * cols} panels")
    images = list(image) if isinstance(image, (list, tuple)) else [image] * rows
    if len(images) != rows:
        raise ValueError(f"got {len(images)} images for {rows} rows")
    masks = None if outline is None else np.asarray(
        outline.detach().cpu() if isinstance(outline, torch.Tensor) else outline, dtype=float)
    if masks is not None and (masks.ndim != 3 or len(masks) != rows):
        raise ValueError(f"outline must be {rows} masks H x W (one per row), got shape {masks.shape}")
    base = plt.get_cmap("tab10" if k <= 10 else "tab20")
    cmap = ListedColormap([base(i) for i in range(k)])
    fig, axes = plt.subplots(rows, cols, figsize=(size * cols, size * rows + 0.5), squeeze=False)
    for r in range(rows):
        img = None if images[r] is None else _to_numpy_image(images[r])
        for c in range(cols):
            ax = axes[r, c]
            ax.set_xticks([])
            ax.set_yticks([])
            h, w = (img.shape[:2] if img is not None else masks.shape[1:] if masks is not None else lab.shape[2:])
            if img is not None:
                ax.imshow(img)
            ax.imshow(lab[r, c], cmap=cmap, vmin=-0.5, vmax=k - 0.5, interpolation="nearest",
                      alpha=alpha if img is not None else 1.0, extent=(0, w, h, 0))
            if masks is not None:
                ys, xs = (np.arange(n) + 0.5 for n in masks.shape[1:])
                ax.contour(xs, ys, masks[r], levels=[0.5], colors="white", linewidths=1.2)
                ax.set_xlim(0, w)
                ax.set_ylim(h, 0)
            if titles is not None:
                ax.set_title(titles[r * cols + c], fontsize=8)
        if row_labels is not None and r < len(row_labels):
            axes[r, 0].set_ylabel(row_labels[r], fontsize=9)
    fig.legend(handles=[Patch(color=cmap(i), label=n) for i, n in enumerate(names)], loc="lower center",
               ncol=min(k, 8), fontsize=8, frameon=False)
    if suptitle:
        fig.suptitle(suptitle)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    return fig


def image_grid(images: Sequence, titles: Sequence[str] | None = None, ncols: int | None = None,
               size: float = 2.2, suptitle: str | None = None):
    """A grid of plain images with titles. Returns the Figure."""
    images = list(images)
    if not images:
        raise ValueError("image_grid needs at least one image")
    cols = ncols or min(len(images), 6)
    rows = int(np.ceil(len(images) / cols))
    fig, axes = plt.subplots(rows, cols, figsize=(size * cols, size * rows), squeeze=False)
    for i, ax in enumerate(axes.flat):
        ax.set_axis_off()
        if i < len(images):
            ax.imshow(_to_numpy_image(images[i]))
            if titles is not None:
                ax.set_title(titles[i], fontsize=9)
    if suptitle:
        fig.suptitle(suptitle)
    fig.tight_layout()
    return fig


def line_plot(series: dict, x=None, xlabel: str = "", ylabel: str = "", title: str | None = None, ax=None):
    """Several named curves on one Axes (e.g. a measure per layer). Returns the Axes."""
    if ax is None:
        _, ax = plt.subplots(figsize=(5, 3))
    for label, ys in series.items():
        ys = ys.detach().cpu().numpy() if isinstance(ys, torch.Tensor) else np.asarray(ys)
        ax.plot(np.arange(len(ys)) if x is None else x, ys, marker="o", ms=3, label=label)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title)
    if len(series) > 1:
        ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return ax


def table(rows: Sequence[dict], columns: Sequence[str] | None = None, floatfmt: str = "{:.3f}") -> str:
    """A plain-text table of dicts (what a notebook prints next to a figure)."""
    rows = list(rows)
    if not rows:
        return ""
    columns = list(columns or rows[0].keys())
    cells = [[(floatfmt.format(r[c]) if isinstance(r.get(c), float) else str(r.get(c, ""))) for c in columns]
             for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    line = "  ".join(c.ljust(w) for c, w in zip(columns, widths))
    sep = "  ".join("-" * w for w in widths)
    body = ["  ".join(v.ljust(w) for v, w in zip(row, widths)) for row in cells]
    return "\n".join([line, sep, *body])
