"""Drawing helpers used by every notebook: grid-shaped maps over an image, grids of maps
with titles and colour bars, and small tables. They only draw what they are given; no
explanation is computed here.

Colour is a measurement, so the maps are drawn the way the numbers are:

- a perceptually uniform colormap (:data:`SEQUENTIAL_CMAP`) for maps of one sign, and a
  diverging one (:data:`DIVERGING_CMAP`) centred at 0, with limits symmetric about 0, for
  maps with negative values;
- one colour scale for panels that are compared (:func:`map_grid` ``shared=True``, the
  default, or per row / column / group of maps), shown by a colour bar;
- ``scale="percentile"`` clips a peaked map at a high percentile of its patch values (the
  bar says where), ``scale="log"`` draws it on a log scale;
- ``mode="nearest"`` draws one block per patch, as the maps are graded;
  ``mode="both"`` draws the smooth (bilinear) and the per-patch view side by side;
- grids name their rows and columns (``row_labels``, ``col_labels``: "block 3", "head 1");
- pointing-game pictures outline the object (white on black, readable over any colour) and box
  the top patch (:func:`map_grid` ``outline``, ``mark_top``, ``hits``); over a dark object an
  overlay's colours are darkened, so graded maps are best drawn opaque (``alpha=1``, per patch)
  with the outline showing where the object is; :func:`attention_matrix` frames the class token's row;
  :func:`image_grid` marks the patch borders (``patch``) and zooms in pixel for pixel (``crop``).
"""
from __future__ import annotations

from typing import NamedTuple, Sequence

import matplotlib.pyplot as plt
import numpy as np
import torch
import torch.nn.functional as F
from matplotlib import colors as mcolors
from matplotlib.cm import ScalarMappable
from matplotlib.ticker import MaxNLocator

SEQUENTIAL_CMAP = "inferno"   # maps of one sign: dark = low, bright = high, uniform in lightness
DIVERGING_CMAP = "RdBu_r"     # signed maps: blue < 0 < red, white at 0
SCALES = ("linear", "percentile", "log")
LOG_DECADES = 3.0             # scale="log" spans at most this many powers of 10 below the top
MODES = ("bilinear", "nearest", "both")


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


# ---------------------------------------------------------------------------------------------
# colour scales


class MapScale(NamedTuple):
    """How maps are coloured: ``norm`` (value -> [0, 1]), ``cmap``, and what a colour bar says.

    ``note`` names the scale when it is not plain linear ("clipped at the 99th percentile",
    "log scale"); ``extend`` is ``"neither"``, ``"min"``, ``"max"`` or ``"both"``: which
    ends of the bar stand for values beyond its limits (drawn as arrows).
    """

    norm: mcolors.Normalize
    cmap: mcolors.Colormap
    note: str
    extend: str

    def colorbar_label(self, label: str | None = None) -> str:
        return "\n".join(s for s in (label, self.note and f"({self.note})") if s)


def ordinal(p: float) -> str:
    """``99`` -> ``'99th'``, ``1`` -> ``'1st'``, ``92.5`` -> ``'92.5th'`` (for percentiles in labels)."""
    n = f"{p:g}"
    if "." in n or "e" in n:
        return n + "th"
    i = int(n)
    suffix = "th" if 10 <= i % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(i % 10, "th")
    return n + suffix


def map_scale(maps, scale: str = "linear", vmin: float | None = None, vmax: float | None = None,
              percentile: float = 99.0, cmap=None) -> MapScale:
    """One colour scale for a set of maps that are compared (each a ``gh x gw`` map).

    ``scale``: ``"linear"`` from the smallest to the largest value; ``"percentile"`` from the
    smallest value to the ``percentile``-th percentile of all the maps' patch values (larger
    values get the top colour, and the note says so); ``"log"``: logarithmic from the smallest
    positive value (but at most :data:`LOG_DECADES` powers of 10 below the top; smaller values
    and zeros get the bottom colour) to the largest, for maps without negative values. Maps
    with negative values get limits symmetric about 0 (``-a .. a``, with ``a`` the largest
    ``|value|`` or its percentile) and, unless ``cmap`` is given, the diverging colormap.
    ``vmin`` / ``vmax`` override the limits. Returns a :class:`MapScale`.
    """
    if scale not in SCALES:
        raise ValueError(f"scale must be one of {SCALES}, got {scale!r}")
    if isinstance(percentile, bool) or not isinstance(percentile, (int, float)) or not 0.0 < percentile <= 100.0:
        raise ValueError(f"percentile must be a number in (0, 100], got {percentile!r}")
    arrays = [_to_numpy_map(m) for m in maps]
    if not arrays:
        raise ValueError("map_scale needs at least one map")
    values = np.concatenate([a.ravel() for a in arrays])
    values = values[np.isfinite(values)]
    if values.size == 0:
        raise ValueError("the maps hold no finite value to scale")
    signed = bool(values.min() < 0.0)
    note = ""
    if scale == "log":
        if signed:
            raise ValueError(f"scale='log' needs maps without negative values, got values down to "
                             f"{values.min():.3g}; use scale='linear' or 'percentile'")
        positive = values[values > 0]
        hi = float(values.max()) if vmax is None else vmax
        if vmin is not None:
            lo = vmin
        elif positive.size:
            lo = max(float(positive.min()), hi / 10 ** LOG_DECADES)
        else:
            raise ValueError("scale='log' needs a positive value in the maps or a positive vmin; the maps have none")
        if lo <= 0:
            raise ValueError(f"scale='log' needs a positive lower limit, got vmin={lo!r}")
        note = "log scale"
    elif scale == "percentile":
        if signed:
            a = float(np.percentile(np.abs(values), percentile))
            a = a if a > 0 else float(np.abs(values).max())   # mostly zeros: clip nothing
            lo, hi = -a, a
        else:
            lo, hi = float(values.min()), float(np.percentile(values, percentile))
            hi = hi if hi > lo else float(values.max())        # mostly the minimum: clip nothing
        note = f"clipped at the {ordinal(percentile)} percentile"
    else:
        if signed:
            a = float(np.abs(values).max())
            lo, hi = -a, a
        else:
            lo, hi = float(values.min()), float(values.max())
    lo = lo if vmin is None else float(vmin)
    hi = hi if vmax is None else float(vmax)
    if hi == lo and vmin is None and vmax is None:   # a constant map: a bar that starts at its value
        hi = lo + max(abs(lo), 1.0)
    if not hi > lo:
        raise ValueError(f"vmin must be below vmax, got vmin={lo!r}, vmax={hi!r}")
    below, above = bool((values < lo).any()), bool((values > hi).any())
    if scale == "percentile" and not (below or above):
        note = ""                                              # nothing was clipped
    extend = {(False, False): "neither", (True, False): "min", (False, True): "max", (True, True): "both"}[(below, above)]
    if scale == "log":
        norm = mcolors.LogNorm(vmin=lo, vmax=hi)
    else:
        norm = mcolors.Normalize(vmin=lo, vmax=hi)
    base = plt.get_cmap(cmap if cmap is not None else DIVERGING_CMAP if signed else SEQUENTIAL_CMAP)
    # values at or below 0 on a log scale are masked by LogNorm: draw them in the lowest colour
    base = base.with_extremes(bad=base(0.0))
    return MapScale(norm, base, note, extend)


def _add_colorbar(fig, ms: MapScale, ax, label: str | None = None, location: str = "right", **kwargs):
    """A colour bar for ``ms`` next to ``ax`` (one Axes or several). Returns the Colorbar."""
    cbar = fig.colorbar(ScalarMappable(norm=ms.norm, cmap=ms.cmap), ax=ax, location=location,
                        extend=ms.extend, **kwargs)
    cbar.set_label(ms.colorbar_label(label), fontsize=8)
    cbar.ax.tick_params(labelsize=7)
    if location in ("bottom", "top") and not isinstance(ms.norm, mcolors.LogNorm):
        cbar.ax.xaxis.set_major_locator(MaxNLocator(nbins=3))   # a bar under one panel: few ticks, so labels never touch
    return cbar


def colorbar(axes, scale: MapScale, label: str | None = None, location: str = "right"):
    """One colour bar for ``scale`` (from :func:`map_scale`) beside ``axes`` (one Axes or a list
    of Axes drawn on that scale, which share the bar). Returns the matplotlib Colorbar."""
    first = axes if not isinstance(axes, (list, tuple, np.ndarray)) else np.ravel(axes)[0]
    return _add_colorbar(first.figure, scale, axes, label, location=location)


def _check_mode(mode: str, allowed=MODES[:2]):
    if mode not in allowed:
        raise ValueError(f"mode must be one of {allowed}, got {mode!r}")


# ---------------------------------------------------------------------------------------------
# one map


def _grayscale(img: np.ndarray) -> np.ndarray:
    """H x W x 3 -> the same image in grey (luma, ITU-R BT.601), still H x W x 3."""
    luma = img @ np.array([0.299, 0.587, 0.114], dtype=np.float32)
    return np.repeat(luma[..., None], 3, axis=-1)


def _draw_overlay(ax, img: np.ndarray, m: np.ndarray, ms: MapScale, alpha: float, mode: str, gray: bool):
    heat = upsample_map(m, img.shape[:2], mode=mode)
    ax.imshow(_grayscale(img) if gray else img)
    ax.imshow(heat, cmap=ms.cmap, norm=ms.norm, alpha=alpha, interpolation="nearest")
    ax.set_axis_off()


def _draw_map(ax, m: np.ndarray, ms: MapScale, mode: str):
    ax.imshow(m, cmap=ms.cmap, norm=ms.norm, interpolation="nearest" if mode == "nearest" else mode)
    ax.set_xticks([])
    ax.set_yticks([])


def overlay(image, m, ax=None, cmap=None, alpha: float = 0.5, mode: str = "bilinear",
            normalize: bool = False, title: str | None = None, colorbar: bool = False,
            scale: str = "linear", vmin: float | None = None, vmax: float | None = None,
            percentile: float = 99.0, label: str | None = None, gray_image: bool = True):
    """Draw ``image`` with the grid-shaped map ``m`` upsampled to its size on top.

    The image is drawn in grey (``gray_image=False``: in colour), so that every colour on
    the panel is a value of the map. ``mode``: ``"bilinear"`` (smooth) or ``"nearest"``
    (one block per patch). The colours
    follow :func:`map_scale` (``scale``, ``vmin``, ``vmax``, ``percentile``, ``cmap``);
    ``colorbar=True`` adds a bar with ``label``. ``normalize=True`` first rescales the map
    to [0, 1] (min-max). Returns the matplotlib Axes.
    """
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    _check_mode(mode)
    img = _to_numpy_image(image)
    arr = normalize_map(m) if normalize else _to_numpy_map(m)
    ms = map_scale([arr], scale, vmin, vmax, percentile, cmap)
    if ax is None:
        _, ax = plt.subplots(figsize=(4.6 if colorbar else 4, 4))
    _draw_overlay(ax, img, arr, ms, alpha, mode, gray_image)
    if colorbar:
        _add_colorbar(ax.figure, ms, ax, label, fraction=0.046, pad=0.04)
    if title:
        ax.set_title(title, fontsize=9)
    return ax


def show_map(m, ax=None, cmap=None, title: str | None = None, vmin: float | None = None,
             vmax: float | None = None, colorbar: bool = False, scale: str = "linear",
             percentile: float = 99.0, label: str | None = None, mode: str = "nearest"):
    """Draw a grid-shaped map on its own, one cell per patch (``mode="bilinear"``: smoothed).

    Colours as in :func:`overlay`. Returns the Axes.
    """
    _check_mode(mode)
    arr = _to_numpy_map(m)
    ms = map_scale([arr], scale, vmin, vmax, percentile, cmap)
    if ax is None:
        _, ax = plt.subplots(figsize=(3.6 if colorbar else 3, 3))
    _draw_map(ax, arr, ms, mode)
    if colorbar:
        _add_colorbar(ax.figure, ms, ax, label, fraction=0.046, pad=0.04)
    if title:
        ax.set_title(title, fontsize=9)
    return ax


def attention_matrix(A, num_prefix: int = 1, ax=None, title: str | None = None, scale: str = "linear",
                     percentile: float = 99.0, vmin: float | None = None, vmax: float | None = None,
                     cmap=None, colorbar: bool = True, label: str | None = "attention"):
    """Draw an ``N x N`` attention matrix (rows: queries *i*, columns: keys *j*), tokens in
    model order (``num_prefix`` prefix tokens first, then the patches row by row).

    The class token's row (row 0, what :func:`vitlab.attention.cls_attention` reads) is framed
    in cyan, and dashed lines separate the prefix tokens from the patches. Colours as in
    :func:`show_map` (``scale="percentile"`` keeps one large entry from hiding the rest).
    Returns the Axes.
    """
    from matplotlib.patches import Rectangle

    arr = _to_numpy_map(A)
    N = arr.shape[0]
    if arr.shape != (N, N):
        raise ValueError(f"expected a square N x N attention matrix, got shape {arr.shape}")
    if isinstance(num_prefix, bool) or not isinstance(num_prefix, int) or not 1 <= num_prefix < N:
        raise ValueError(f"num_prefix must be an int in [1, {N}) (the class token comes first), got {num_prefix!r}")
    ms = map_scale([arr], scale, vmin, vmax, percentile, cmap)
    if ax is None:
        _, ax = plt.subplots(figsize=(4.6 if colorbar else 4, 4))
    ax.imshow(arr, cmap=ms.cmap, norm=ms.norm, interpolation="nearest")
    ax.add_patch(Rectangle((-0.5, -0.5), N, 1, fill=False, edgecolor="cyan", linewidth=1.5, label="CLS row"))
    for v in (num_prefix - 0.5,):
        ax.axhline(v, color="white", linestyle="--", linewidth=0.8)
        ax.axvline(v, color="white", linestyle="--", linewidth=0.8)
    ax.set_xlabel("key token j", fontsize=8)
    ax.set_ylabel("query token i", fontsize=8)
    ticks = [0, N - 1] if num_prefix < 0.08 * N else [0, num_prefix, N - 1]   # no overlapping labels
    ax.set_xticks(ticks)
    ax.set_yticks(ticks)
    ax.tick_params(labelsize=7)
    ax.annotate("CLS row", (N - 1, 0), xytext=(0, 3), textcoords="offset points", ha="right", va="bottom",
                color="cyan", fontsize=7, annotation_clip=False)
    if colorbar:
        _add_colorbar(ax.figure, ms, ax, label, fraction=0.046, pad=0.04)
    if title:
        ax.set_title(title, fontsize=9, pad=12)
    return ax


def footprints(maps: Sequence, boxes: Sequence[tuple[int, int, int, int]], regions=None, centres=None,
               titles: Sequence[str] | None = None, region_labels: Sequence[str] | None = None,
               size: float = 2.8, scale: str = "linear", label: str | None = None, cmap=None):
    """What tokens read: one panel per footprint (``H x W`` weights over the input pixels, e.g.
    :func:`vitlab.footprints.token_footprints` of one token divided by its sum), all on one colour
    scale, with the token's own patch boxed in cyan (``boxes``: ``(top, left, height, width)`` in
    pixels, one per panel), its centre marked with a cyan cross (``centres``: ``(row, column)``
    per panel, optional) and, for each panel, the outlines of ``regions`` (a sequence of ``H x W``
    masks per panel, e.g. :func:`vitlab.footprints.footprint_regions`: the smallest areas holding
    50% and 90% of it) in white, solid for the first, dashed for the next, named in a legend by
    ``region_labels``. Returns the Figure."""
    from matplotlib.lines import Line2D
    from matplotlib.patches import Rectangle

    flat = [_to_numpy_map(m) for m in maps]
    n = len(flat)
    if n == 0:
        raise ValueError("footprints needs at least one map")
    for name, seq in (("boxes", boxes), ("titles", titles), ("centres", centres), ("regions", regions)):
        if seq is not None and len(seq) != n:
            raise ValueError(f"got {len(seq)} {name} for {n} footprints")
    ms = map_scale(flat, scale, cmap=cmap)
    fig, axes = plt.subplots(1, n, squeeze=False, layout="constrained", figsize=(size * n + 0.9, size + 0.5))
    styles = ("solid", "dashed", "dotted", "dashdot")
    for i, (ax, m) in enumerate(zip(axes[0], flat)):
        _draw_map(ax, m, ms, "nearest")
        top, left, h, w = boxes[i]
        ax.add_patch(Rectangle((left - 0.5, top - 0.5), w, h, fill=False, edgecolor="cyan", linewidth=1.5))
        if centres is not None:
            ax.plot([centres[i][1]], [centres[i][0]], marker="x", color="cyan", markersize=8, mew=2)
        if regions is not None:
            for k, region in enumerate(regions[i]):
                r = np.asarray(region.detach().cpu() if isinstance(region, torch.Tensor) else region, dtype=float)
                if r.shape != m.shape:
                    raise ValueError(f"regions must have the footprint's shape {m.shape}, got {r.shape}")
                ax.contour(np.arange(r.shape[1]), np.arange(r.shape[0]), r, levels=[0.5], colors="white",
                           linewidths=1.3, linestyles=styles[k % len(styles)])
        if titles is not None:
            ax.set_title(titles[i], fontsize=9)
    if regions is not None and region_labels is not None:
        handles = [Line2D([], [], color="white", linestyle=styles[k % len(styles)], label=t)
                   for k, t in enumerate(region_labels)]
        handles.append(Line2D([], [], color="cyan", linewidth=1.5, label="the token's patch"))
        leg = axes[0, 0].legend(handles=handles, loc="lower left", fontsize=7, facecolor="0.3", framealpha=0.9)
        for text in leg.get_texts():
            text.set_color("white")
    _add_colorbar(fig, ms, axes, label)
    return fig


# ---------------------------------------------------------------------------------------------
# grids of maps


def _draw_outline(ax, mask: np.ndarray, size: tuple[int, int]):
    """A white contour of ``mask`` (H x W, same size as the image drawn on ``ax``) on a wider
    black one, so that it reads over the brightest and the darkest colours of a map."""
    if mask.shape != tuple(size):
        raise ValueError(f"outline masks must have the image's size {tuple(size)}, got {mask.shape}")
    ys, xs = np.arange(mask.shape[0]), np.arange(mask.shape[1])
    ax.contour(xs, ys, mask, levels=[0.5], colors="black", linewidths=2.6)
    ax.contour(xs, ys, mask, levels=[0.5], colors="white", linewidths=1.0)


def top_patch(m) -> tuple[int, int]:
    """Row and column of a map's highest patch (the first one, row-major, on ties)."""
    arr = _to_numpy_map(m)
    return tuple(int(v) for v in np.unravel_index(int(np.nanargmax(arr)), arr.shape))


def _mark_top_patch(ax, m: np.ndarray, size: tuple[int, int] | None, hit: bool | None):
    """A box around the highest patch, in image pixels (``size``) or map cells (``None``)."""
    from matplotlib.patches import Rectangle

    r, c = top_patch(m)
    gh, gw = m.shape
    ph, pw = (1.0, 1.0) if size is None else (size[0] / gh, size[1] / gw)
    colour = "cyan" if hit is None else ("lime" if hit else "red")
    ax.add_patch(Rectangle((c * pw - 0.5, r * ph - 0.5), pw, ph, fill=False, edgecolor=colour, linewidth=1.8))


def _scale_groups(shared, rows: int, cols: int, n: int) -> list[list[int]]:
    """Indices of the maps (row-major on the ``rows x cols`` grid) that share one scale."""
    if isinstance(shared, (list, tuple)):
        if len(shared) != n:
            raise ValueError(f"shared as group keys needs one key per map: got {len(shared)} keys for {n} maps")
        groups: dict = {}
        for i, key in enumerate(shared):
            groups.setdefault(key, []).append(i)
        return list(groups.values())
    if shared is True:
        return [list(range(n))]
    if shared is False:
        return [[i] for i in range(n)]
    if shared == "row":
        return [g for g in ([i for i in range(r * cols, min((r + 1) * cols, n))] for r in range(rows)) if g]
    if shared == "col":
        return [g for g in ([i for i in range(c, n, cols)] for c in range(cols)) if g]
    raise ValueError(f"shared must be True, False, 'row', 'col' or one group key per map, got {shared!r}")


def map_grid(maps: Sequence, titles: Sequence[str] | None = None, image=None, ncols: int | None = None,
             cmap=None, alpha: float = 0.5, size: float = 2.2, suptitle: str | None = None,
             row_labels: Sequence[str] | None = None, col_labels: Sequence[str] | None = None,
             shared=True, scale: str = "linear", vmin: float | None = None, vmax: float | None = None,
             percentile: float = 99.0, colorbar: bool = True, label: str | None = None,
             mode: str = "bilinear", gray_image: bool = True, outline=None, mark_top: bool = False,
             hits: Sequence[bool] | None = None):
    """A grid of maps, each overlaid on ``image`` (or drawn alone when ``image`` is None).

    ``maps`` is a sequence of ``gh x gw`` maps, or a tensor/array ``R x C x gh x gw`` (then
    the grid has R rows and C columns, e.g. blocks x heads). ``image`` is one image for all
    maps or a sequence of images, one per map. ``row_labels`` / ``col_labels`` name the rows
    (left) and columns (top), e.g. ``"block 3"`` / ``"head 1"``.

    Colour (see :func:`map_scale`): ``shared=True`` colours every panel on one scale (the
    minimum to the maximum over all panels, or as ``scale``, ``vmin``, ``vmax`` ask), drawn as
    one colour bar for the grid; ``"row"`` / ``"col"``: one scale and bar per row / column;
    ``False``: each panel on its own scale with its own bar; a sequence of keys, one per map
    (e.g. the method that made it): maps with equal keys share a scale, drawn as one bar
    below their panels and labelled with the key (unless ``label`` is given). ``colorbar=False`` leaves the bars
    out; ``label`` names the bars' quantity.

    ``mode``: ``"bilinear"`` (smooth), ``"nearest"`` (one block per patch, as the maps are
    graded) or ``"both"``: each map twice, smooth and then per patch, side by side.
    Images are drawn in grey under the maps (``gray_image=False``: in colour).

    Pointing-game pictures: ``outline`` (one ``H x W`` boolean mask for all maps, or one per
    map, e.g. the objects) is drawn as a white contour on a black one over the map (with
    ``alpha=1`` the map hides the image and every colour reads exactly against its bar, the
    object's place shown by the outline alone); ``mark_top=True`` draws
    a box around each map's highest patch; ``hits`` (one bool per map, e.g. from
    :func:`vitlab.localization.pointing_game`) colours that box green (hit) or red (miss).
    Returns the Figure.
    """
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    _check_mode(mode, MODES)
    if isinstance(maps, (torch.Tensor, np.ndarray)) and maps.ndim == 4:
        rows, cols = maps.shape[:2]
        flat = [maps[r, c] for r in range(rows) for c in range(cols)]
    else:
        flat = list(maps)
        if ncols is not None and (isinstance(ncols, bool) or not isinstance(ncols, int) or ncols < 1):
            raise ValueError(f"ncols must be a positive int, got {ncols!r}")
        cols = ncols or min(len(flat), 6)
        rows = int(np.ceil(len(flat) / cols)) if flat else 0
    if not flat:
        raise ValueError("map_grid needs at least one map")
    flat = [_to_numpy_map(m) for m in flat]
    n = len(flat)
    if titles is not None and len(titles) != n:
        raise ValueError(f"got {len(titles)} titles for {n} maps")
    if row_labels is not None and len(row_labels) != rows:
        raise ValueError(f"got {len(row_labels)} row labels for {rows} rows")
    if col_labels is not None and len(col_labels) != cols:
        raise ValueError(f"got {len(col_labels)} column labels for {cols} columns")
    images = list(image) if isinstance(image, (list, tuple)) else [image] * n
    if len(images) != n:
        raise ValueError(f"got {len(images)} images for {n} maps")
    masks = None
    if outline is not None:
        if any(im is None for im in images):
            raise ValueError("outline needs an image under every map (the mask is drawn in image pixels)")
        o = np.asarray(outline.detach().cpu() if isinstance(outline, torch.Tensor) else outline, dtype=float)
        masks = [o] * n if o.ndim == 2 else list(o)
        if len(masks) != n or any(m.ndim != 2 for m in masks):
            raise ValueError(f"outline must be one H x W mask or {n} of them (one per map), got shape {o.shape}")
    if hits is not None:
        hits = [bool(h) for h in (hits.tolist() if isinstance(hits, (torch.Tensor, np.ndarray)) else hits)]
        if len(hits) != n:
            raise ValueError(f"got {len(hits)} hits for {n} maps")
        mark_top = True
    groups = _scale_groups(shared, rows, cols, n)
    scales: list[MapScale | None] = [None] * n
    for g in groups:
        ms = map_scale([flat[i] for i in g], scale, vmin, vmax, percentile, cmap)
        for i in g:
            scales[i] = ms

    views = ("bilinear", "nearest") if mode == "both" else (mode,)
    k = len(views)
    by_key = isinstance(shared, (list, tuple))
    bar_right = colorbar and not by_key and shared in (True, False, "row")
    fig, axes = plt.subplots(rows, cols * k, squeeze=False, layout="constrained",
                             figsize=(size * cols * k + (0.9 if bar_right else 0.2),
                                      size * rows + (0.7 if colorbar and (by_key or shared == "col") else 0.0)
                                      + (0.3 if col_labels is not None else 0.0) + (0.4 if suptitle else 0.0)))
    for ax in axes.flat:
        ax.set_axis_off()
    for i, m in enumerate(flat):
        r, c = divmod(i, cols)
        for v, view in enumerate(views):
            ax = axes[r, c * k + v]
            if images[i] is None:
                _draw_map(ax, m, scales[i], view)
            else:
                img = _to_numpy_image(images[i])
                _draw_overlay(ax, img, m, scales[i], alpha, view, gray_image)
                if masks is not None:
                    _draw_outline(ax, masks[i], img.shape[:2])
            if mark_top:
                _mark_top_patch(ax, m, None if images[i] is None else _to_numpy_image(images[i]).shape[:2],
                                None if hits is None else hits[i])
            t = titles[i] if titles is not None else ""
            if mode == "both":
                t = f"{t}\n{'smooth' if view == 'bilinear' else 'per patch'}" if t else ("smooth" if view == "bilinear" else "per patch")
            if t:
                ax.set_title(t, fontsize=8)
    if row_labels is not None:
        for r, text in enumerate(row_labels):
            ax = axes[r, 0]
            ax.set_axis_on()
            ax.set_xticks([])
            ax.set_yticks([])
            for spine in ax.spines.values():
                spine.set_visible(False)
            ax.set_ylabel(text, fontsize=9)
    if col_labels is not None:
        for c, text in enumerate(col_labels):
            ax = axes[0, c * k]
            ax.set_title(f"{text}\n{ax.get_title()}" if ax.get_title() else text, fontsize=9)
    if colorbar:
        if shared is True:
            _add_colorbar(fig, scales[0], axes, label, shrink=min(1.0, 0.5 + 0.25 * rows), aspect=max(20, 12 * rows))
        elif shared == "row":
            for r in range(rows):
                if r * cols < n:
                    _add_colorbar(fig, scales[r * cols], axes[r, :], label, aspect=12)
        elif shared == "col":
            for c in range(min(cols, n)):
                _add_colorbar(fig, scales[c], axes[:, c * k:(c + 1) * k], label, location="bottom", aspect=12)
        elif shared is False:
            for i in range(n):
                r, c = divmod(i, cols)
                _add_colorbar(fig, scales[i], axes[r, c * k:(c + 1) * k], label, fraction=0.05, pad=0.02)
        else:
            for key, g in zip(dict.fromkeys(shared), groups):
                group_axes = [axes[i // cols, (i % cols) * k + v] for i in g for v in range(k)]
                _add_colorbar(fig, scales[g[0]], group_axes, str(key) if label is None else label,
                              location="bottom", aspect=12)
    if suptitle:
        fig.suptitle(suptitle)
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
    # tab10 without its grey (index 7), which reads as "no class"; tab20 beyond nine classes
    palette = [plt.get_cmap("tab10")(i) for i in (0, 1, 2, 3, 4, 5, 6, 8, 9)] if k <= 9 else \
        [plt.get_cmap("tab20")(i) for i in range(20)]
    cmap = ListedColormap(palette[:k] if k <= len(palette) else [plt.get_cmap("hsv")(i / k) for i in range(k)])
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


def _patch_ticks(ax, patch: int, top: int, left: int, h: int, w: int):
    """Ticks on all four sides of ``ax`` at the patch borders inside the window drawn."""
    xs = [b - 0.5 for b in range(patch * (left // patch + 1), left + w, patch)]
    ys = [b - 0.5 for b in range(patch * (top // patch + 1), top + h, patch)]
    ax.set_axis_on()
    ax.set_xticks(xs)
    ax.set_yticks(ys)
    ax.tick_params(direction="out", length=4, width=1, top=True, right=True,
                   labelbottom=False, labelleft=False)


def image_grid(images: Sequence, titles: Sequence[str] | None = None, ncols: int | None = None,
               size: float = 2.2, suptitle: str | None = None, patch: int | None = None, crop=None):
    """A grid of plain images with titles. Returns the Figure.

    ``patch``: the model's patch size in pixels; ticks on the frame of every image mark the
    patch borders (where a ViT's patches meet), without drawing over the pixels.
    ``crop``: ``(top, left, height, width)`` in pixels: show only that window of every image,
    pixel for pixel (nearest, no smoothing), in the image's own pixel coordinates.
    """
    images = list(images)
    if not images:
        raise ValueError("image_grid needs at least one image")
    if titles is not None and len(titles) != len(images):
        raise ValueError(f"got {len(titles)} titles for {len(images)} images")
    if patch is not None and (isinstance(patch, bool) or not isinstance(patch, int) or patch < 1):
        raise ValueError(f"patch must be a positive int (pixels), got {patch!r}")
    if crop is not None:
        crop = tuple(crop)
        if len(crop) != 4 or any(isinstance(v, bool) or not isinstance(v, int) for v in crop) or min(crop) < 0 \
                or crop[2] < 1 or crop[3] < 1:
            raise ValueError(f"crop must be (top, left, height, width), four ints >= 0 with height, width >= 1, "
                             f"got {crop!r}")
    cols = ncols or min(len(images), 6)
    rows = int(np.ceil(len(images) / cols))
    fig, axes = plt.subplots(rows, cols, figsize=(size * cols, size * rows), squeeze=False)
    for i, ax in enumerate(axes.flat):
        ax.set_axis_off()
        if i >= len(images):
            continue
        img = _to_numpy_image(images[i])
        top, left, h, w = crop if crop is not None else (0, 0, *img.shape[:2])
        if top + h > img.shape[0] or left + w > img.shape[1]:
            raise ValueError(f"crop {crop} reaches outside image {i} of size {img.shape[0]} x {img.shape[1]}")
        ax.imshow(img[top:top + h, left:left + w], extent=(left - 0.5, left + w - 0.5, top + h - 0.5, top - 0.5),
                  interpolation="nearest" if crop is not None else None)
        if patch is not None:
            _patch_ticks(ax, patch, top, left, h, w)
        if titles is not None:
            ax.set_title(titles[i], fontsize=9)
    if suptitle:
        fig.suptitle(suptitle)
    fig.tight_layout()
    return fig


FAMILY_COLOURS = [c for i, c in enumerate(plt.get_cmap("tab10").colors) if i != 7]   # tab10 without its grey
FAMILY_DASHES = ("-", "--", ":", "-.")
FAMILY_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")


def family_styles(names: Sequence[str], neutral: str = "random") -> dict[str, dict]:
    """A distinct, readable style for each curve name, for plots with more curves than a colour
    cycle has colours. Names of one family (the text before ``" ("``: "LeGrad (every block)" and
    "LeGrad (last two blocks)") share a colour and differ in line style (solid, dashed, dotted,
    dash-dot); each family gets its own colour (tab10 without grey; past nine families, or four
    members of a family, the marker changes too). Names containing ``neutral`` (a random
    baseline) are grey and dotted. Returns ``{name: dict(color=..., linestyle=..., marker=...)}``
    for :func:`line_plot`'s ``styles``; no two names get the same style."""
    names = list(names)
    if len(set(names)) != len(names):
        raise ValueError(f"family_styles needs distinct names, got {names}")
    is_neutral = lambda n: bool(neutral) and neutral in n
    families = list(dict.fromkeys(n.split(" (")[0] for n in names if not is_neutral(n)))
    groups = -(-len(families) // len(FAMILY_COLOURS))            # how many times the colours go round
    styles, members = {}, {}
    for name in names:
        if is_neutral(name):
            k = members[None] = members.get(None, -1) + 1
            style = dict(color="0.45", linestyle=":", marker=k)
        else:
            fam = families.index(name.split(" (")[0])
            k = members[fam] = members.get(fam, -1) + 1
            style = dict(color=FAMILY_COLOURS[fam % len(FAMILY_COLOURS)], linestyle=FAMILY_DASHES[k % len(FAMILY_DASHES)],
                         marker=fam // len(FAMILY_COLOURS) + (k // len(FAMILY_DASHES)) * groups)
        if style["marker"] >= len(FAMILY_MARKERS):
            raise ValueError(f"family_styles has {len(FAMILY_MARKERS)} markers for {len(names)} curves in "
                             f"{len(families)} families: too many to tell apart; plot fewer curves per Axes")
        style["marker"] = FAMILY_MARKERS[style["marker"]]
        styles[name] = style
    return styles


def line_plot(series: dict, x=None, xlabel: str = "", ylabel: str = "", title: str | None = None, ax=None,
              bands: dict | None = None, styles: dict | str | None = None, legend: str = "inside"):
    """Several named curves on one Axes (e.g. a measure per layer). ``bands`` maps a curve's
    name to ``(low, high)`` sequences, e.g. 95% intervals, drawn as a shaded band in the curve's
    colour. ``styles`` maps a curve's name to keyword arguments of ``Axes.plot`` (``color``,
    ``linestyle``, ``marker``), or is ``"families"`` for :func:`family_styles` (one colour per
    method, one line style per setting: for more curves than the colour cycle holds).
    ``legend="outside"`` puts the legend to the right of the Axes, for many curves. Returns the Axes."""
    if ax is None:
        _, ax = plt.subplots(figsize=(5, 3))
    if legend not in ("inside", "outside"):
        raise ValueError(f"legend must be 'inside' or 'outside', got {legend!r}")
    bands = dict(bands or {})
    unknown = sorted(set(bands) - set(series))
    if unknown:
        raise ValueError(f"bands names curves that are not in series: {unknown}")
    if isinstance(styles, str):
        if styles != "families":
            raise ValueError(f"styles must be a dict of per-curve styles or 'families', got {styles!r}")
        styles = family_styles(list(series))
    styles = dict(styles or {})
    unknown = sorted(set(styles) - set(series))
    if unknown:
        raise ValueError(f"styles names curves that are not in series: {unknown}")
    as_array = lambda v: v.detach().cpu().numpy() if isinstance(v, torch.Tensor) else np.asarray(v, dtype=float)
    for label, ys in series.items():
        ys = as_array(ys)
        xs = np.arange(len(ys)) if x is None else x
        (line,) = ax.plot(xs, ys, **{"marker": "o", "ms": 3, **styles.get(label, {})}, label=label)
        if label in bands:
            low, high = (as_array(v) for v in bands[label])
            if low.shape != ys.shape or high.shape != ys.shape:
                raise ValueError(f"the band of {label!r} needs a low and a high value per point ({len(ys)}), "
                                 f"got {low.shape} and {high.shape}")
            ax.fill_between(xs, low, high, color=line.get_color(), alpha=0.2, linewidth=0)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title)
    if len(series) > 1:
        if legend == "outside":
            ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), handlelength=3)
        else:
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


def leaderboard(board, measures: Sequence[str] | None = None, reference: str | None = "random",
                ncols: int = 4, figsize_per_panel: tuple[float, float] = (3.3, 3.0),
                methods: Sequence[str] | None = None):
    """Draw a method x measure leaderboard: one panel per measure, a bar per method with its
    95% interval, the ``reference`` method's mean as a dashed line, and each panel's title
    saying which direction is better. ``methods``: the rows to draw, in this order (default:
    all of the board's), e.g. those of a table printed beside the figure.

    ``board``: anything with ``methods``, ``measures``, ``cell(method, measure)`` (a dict with
    ``mean``, ``ci_low``, ``ci_high``) and ``higher_is_better(measure)`` — what
    ``vitlab.evaluate.leaderboard`` returns. Returns the figure.
    """
    measures = list(board.measures if measures is None else measures)
    unknown = [q for q in measures if q not in board.measures]
    if unknown or not measures:
        raise ValueError(f"measures must be among {list(board.measures)}, got {measures}")
    methods = list(board.methods if methods is None else methods)
    missing = [m for m in methods if m not in board.methods]
    if missing or not methods or len(set(methods)) != len(methods):
        raise ValueError(f"methods must be distinct rows of the board, among {list(board.methods)}, got {methods}")
    if reference is not None and reference not in board.methods:
        raise ValueError(f"reference must be one of the methods {list(board.methods)} or None, got {reference!r}")
    ncols = max(1, min(int(ncols), len(measures)))
    nrows = -(-len(measures) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(figsize_per_panel[0] * ncols + 2.2, figsize_per_panel[1] * nrows),
                             sharey=True, squeeze=False)
    y = np.arange(len(methods))[::-1]
    for ax, q in zip(axes.flat, measures):
        cells = [board.cell(m, q) for m in methods]
        mean = np.array([c["mean"] for c in cells])
        lo = np.array([c["ci_low"] for c in cells])
        hi = np.array([c["ci_high"] for c in cells])
        err = np.nan_to_num(np.stack([mean - lo, hi - mean]), nan=0.0)
        colours = ["0.6" if m == reference else "tab:blue" for m in methods]
        ax.barh(y, mean, xerr=err, color=colours, ecolor="k", capsize=2, height=0.7)
        if reference is not None:
            ax.axvline(board.cell(reference, q)["mean"], color="0.3", ls="--", lw=1)
        ax.axvline(0, color="k", lw=0.6)
        ax.set_title(f"{q}\n({'higher' if board.higher_is_better(q) else 'lower'} is better)", fontsize=9)
        ax.tick_params(labelsize=8)
        ax.grid(axis="x", alpha=0.3)
    for ax in axes.flat[len(measures):]:
        ax.axis("off")
    for row in axes:
        row[0].set_yticks(y, methods, fontsize=8)
    note = f"bars: mean over samples with a 95% interval; dashed: {reference}" if reference else \
        "bars: mean over samples with a 95% interval"
    fig.suptitle(note, fontsize=9, y=1.0)
    fig.tight_layout()
    return fig
