"""Generated scenes with known object classes and pixel masks.

Every scene is a square RGB image: a background (plain colour, gradient, texture, small
clutter blobs, distractor strokes, pixel noise) with one or two objects on top. Each object
is one of :data:`CLASSES` — shapes that differ in outline, not in colour — drawn with a
random colour, size, position and rotation. Because the renderer knows which pixels each
object covers, the scenes come with exact object masks: the ground truth that lets vitlab
*measure* whether an explanation points at the right thing.

Difficulty and contrast
-----------------------
``difficulty`` in [0, 1] scales how busy the background is (gradient and texture amplitude,
number of clutter blobs and strokes, pixel noise). At 0 a scene is one flat-coloured shape on a
flat background; at 1 (the default, and what :mod:`vitlab.shapes.evaluate` measures) it has
textured, graded backgrounds with clutter and strokes. At every difficulty the object stays
visible: background and objects are drawn from opposite luminance bands (dark background and
light object or the reverse), so every object pixel differs from what lies behind it by at
least :data:`MIN_CONTRAST` grey levels of luminance. Strokes and blobs use any colour,
including object-like ones, so colour alone never gives the class or the position away.

All rendering is vectorised over scenes with numpy: 1,000 scenes take 1-3 s of one core.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from numbers import Integral

import numpy as np

__all__ = [
    "CLASSES", "DEFAULT_SIZE", "MIN_CONTRAST", "Scenes", "centres_per_patch", "make_scenes", "remove_objects",
    "scenes_to_tensor",
]

#: Object classes, in label order. Chosen to differ in outline under any rotation and scale.
CLASSES: list[str] = ["circle", "square", "triangle", "star", "cross", "ring", "crescent", "heart"]

#: Default image side in pixels (the shipped model's input size).
DEFAULT_SIZE = 112

#: Minimum luminance difference (0-255 scale) between an object and any background pixel
#: behind it, before pixel noise.
MIN_CONTRAST = 60.0

# Luminance bands (0-255): the background lives in one, the objects in the other.
_DARK = (15.0, 95.0)
_LIGHT = (160.0, 245.0)
_LUMA = np.array([0.299, 0.587, 0.114], dtype=np.float32)

# Object radius range (pixels at DEFAULT_SIZE; scaled with size) for one- and two-object scenes.
_RADIUS_ONE = (15.0, 30.0)
# Two objects: with radii <= 22 px, the image corner farthest from the first object's centre is
# always at least 2 * 22 + 1 px away, so the second object always finds a non-overlapping place.
_RADIUS_TWO = (12.0, 22.0)


@dataclass
class Scenes:
    """A batch of generated scenes.

    Attributes:
        images: ``n x H x W x 3`` uint8 RGB images.
        labels: ``n x n_objects`` int64 class indices into ``classes`` (distinct within a scene).
        masks: ``n x n_objects x H x W`` bool; ``masks[i, j]`` are the visible pixels of object j.
        classes: class names, ``classes[label]`` names a label.
        difficulty: the background difficulty the scenes were drawn at.
    """

    images: np.ndarray
    labels: np.ndarray
    masks: np.ndarray
    classes: list[str]
    difficulty: float

    def __len__(self) -> int:
        return int(self.images.shape[0])


def make_scenes(
    n: int,
    seed: int,
    n_objects: int = 1,
    *,
    difficulty: float = 1.0,
    size: int = DEFAULT_SIZE,
) -> Scenes:
    """Draw ``n`` scenes with ``n_objects`` objects each, deterministically from ``seed``.

    Args:
        n: number of scenes (> 0).
        seed: any non-negative integer; the same seed gives the same scenes, byte for byte.
        n_objects: 1 or 2. Two-object scenes hold two different classes whose bounding
            circles do not intersect (so the objects never overlap).
        difficulty: background busyness in [0, 1] (see the module docstring); 1 is the
            evaluated setting, lower values serve as a training curriculum.
        size: image side in pixels (>= 32).

    Returns:
        :class:`Scenes` with ``images``, ``labels``, ``masks`` and ``classes``.
    """
    return _render_scenes(n, seed, n_objects, difficulty=difficulty, size=size, with_objects=True)


def remove_objects(
    n: int,
    seed: int,
    n_objects: int = 1,
    *,
    difficulty: float = 1.0,
    size: int = DEFAULT_SIZE,
    remove,
) -> np.ndarray:
    """The scenes of ``make_scenes(n, seed, n_objects, ...)`` with some objects taken out.

    ``remove`` is an object index (``0 .. n_objects - 1``) for every scene, or a length-``n``
    sequence of them (one per scene). The removed object's pixels show what lay behind it:
    the same scene rendered without objects (background, clutter and noise are identical), so
    nothing but that object changes. Returns ``n x H x W x 3`` uint8 images.
    """
    _check_args(n, seed, n_objects, difficulty, size)
    which = np.asarray(remove)
    if which.dtype.kind not in "iu" or which.ndim > 1 or (which.ndim == 1 and len(which) != n) \
            or which.min() < 0 or which.max() >= n_objects:
        raise ValueError(f"remove must hold object indices in 0 .. {n_objects - 1}: one int for every scene "
                         f"or one per scene ({n}); got {remove!r}")
    which = np.broadcast_to(which, (int(n),))
    full = _render_scenes(n, seed, n_objects, difficulty=difficulty, size=size, with_objects=True)
    bare = _render_scenes(n, seed, n_objects, difficulty=difficulty, size=size, with_objects=False)
    gone = full.masks[np.arange(len(full)), which]                               # n x H x W
    return np.where(gone[..., None], bare.images, full.images)


def scenes_to_tensor(images: np.ndarray, input_size: tuple[int, int, int], mean, std):
    """Turn a batch of uint8 scene images into a normalised ``B x 3 x H x W`` float tensor.

    This is what timm's eval transform does for a scene whose size already equals the model
    input (``crop_pct`` 1.0: no resize, no crop): scale to [0, 1], subtract ``mean``,
    divide by ``std`` — without a PIL round trip per image, so training and evaluation stay fast.

    Raises:
        ValueError: if ``images`` is not ``n x H x W x 3`` uint8 (a single ``H x W x 3`` image
            is accepted) or its size differs from ``input_size``.
    """
    import torch

    images = np.asarray(images)
    if images.ndim == 3:
        images = images[None]
    if images.ndim != 4 or images.shape[-1] != 3:
        raise ValueError(
            f"expected RGB images shaped (n, H, W, 3) or (H, W, 3), got shape {tuple(images.shape)}"
        )
    if images.dtype != np.uint8:
        raise ValueError(f"expected uint8 images (0-255), got dtype {images.dtype}")
    _, h, w = input_size
    if images.shape[1:3] != (h, w):
        raise ValueError(
            f"images are {images.shape[1]}x{images.shape[2]} pixels but the model expects {h}x{w}; "
            f"draw scenes with make_scenes(..., size={h}) or resize them first"
        )
    x = torch.from_numpy(np.ascontiguousarray(images)).permute(0, 3, 1, 2).float().div_(255.0)
    mean_t = torch.tensor(mean, dtype=torch.float32).view(1, 3, 1, 1)
    std_t = torch.tensor(std, dtype=torch.float32).view(1, 3, 1, 1)
    return (x - mean_t) / std_t


def centres_per_patch(masks: np.ndarray, grid: tuple[int, int]) -> np.ndarray:
    """How many objects have their centre in each patch of a ``gh x gw`` grid laid over the image.

    ``masks`` is ``objects x H x W`` (boolean, one mask per object, e.g. ``make_scenes(...).masks``
    flattened over its first two axes); an object's centre is the mean of its pixels' row and
    column coordinates, and it is counted in the patch that holds that point (patches of
    ``H / gh x W / gw`` pixels). Returns a ``gh x gw`` integer array that sums to the number of
    objects.

    Raises:
        ValueError: if ``masks`` is not ``objects x H x W``, an object's mask is empty, or the grid
            does not divide the image.
    """
    masks = np.asarray(masks, dtype=bool)
    if masks.ndim != 3 or masks.shape[0] == 0:
        raise ValueError(f"masks must be objects x H x W with at least one object, got shape {masks.shape}")
    gh, gw = grid
    h, w = masks.shape[1:]
    if gh <= 0 or gw <= 0 or h % gh or w % gw:
        raise ValueError(f"a {gh} x {gw} grid does not divide a {h} x {w} image into whole patches")
    area = masks.sum(axis=(1, 2))
    if (area == 0).any():
        raise ValueError(f"object {int(np.argmin(area))}'s mask is empty: it has no centre")
    cy = (masks.sum(axis=2) * np.arange(h)).sum(axis=1) / area
    cx = (masks.sum(axis=1) * np.arange(w)).sum(axis=1) / area
    cell = (cy // (h // gh)).astype(int) * gw + (cx // (w // gw)).astype(int)
    return np.bincount(cell, minlength=gh * gw).reshape(gh, gw)


# ---------------------------------------------------------------------------------------------
# Implementation
# ---------------------------------------------------------------------------------------------


def _check_args(n, seed, n_objects, difficulty, size) -> None:
    if isinstance(n, bool) or not isinstance(n, Integral) or n <= 0:
        raise ValueError(f"n must be a positive integer, got {n!r}")
    if isinstance(seed, bool) or not isinstance(seed, Integral) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    if isinstance(n_objects, bool) or not isinstance(n_objects, Integral) or n_objects not in (1, 2):
        raise ValueError(f"n_objects must be 1 or 2, got {n_objects!r}")
    try:
        d = float(difficulty)
    except (TypeError, ValueError):
        raise ValueError(f"difficulty must be a number in [0, 1], got {difficulty!r}") from None
    if not 0.0 <= d <= 1.0:
        raise ValueError(f"difficulty must be in [0, 1], got {difficulty!r}")
    if isinstance(size, bool) or not isinstance(size, Integral) or size < 32:
        raise ValueError(f"size must be an integer >= 32 pixels, got {size!r}")


def _colours_with_luma(rng: np.random.Generator, lo, hi) -> np.ndarray:
    """Random RGB colours (float, 0-255) whose luminance lies in [lo, hi] (arrays or scalars).

    A random colour is shifted by the same amount in every channel (which shifts its
    luminance by exactly that amount) to a target luminance, then clipped; clipping can only
    move the luminance towards the band's middle, never out of it, because the band is
    inside [0, 255] and the target is inside the band.
    """
    lo = np.asarray(lo, dtype=np.float32)
    hi = np.asarray(hi, dtype=np.float32)
    shape = np.broadcast(lo, hi).shape
    base = rng.uniform(0.0, 255.0, size=shape + (3,)).astype(np.float32)
    target = rng.uniform(0.0, 1.0, size=shape).astype(np.float32) * (hi - lo) + lo
    shifted = base + (target - base @ _LUMA)[..., None]
    out = np.clip(shifted, 0.0, 255.0)
    # Clipping one channel changes the luminance; correct it with the others (two passes suffice
    # in practice), then clip the result into the band to be exact.
    for _ in range(3):
        err = target - out @ _LUMA
        free = (out > 0.0) & (out < 255.0)
        weight = (free * _LUMA).sum(-1)
        out = np.clip(out + np.where(weight > 0, err / np.maximum(weight, 1e-6), 0.0)[..., None] * free, 0, 255)
    return out


def _shape_inside(cls: int, u: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Implicit shape of class ``cls`` in unit coordinates (every shape fits in the unit disc)."""
    name = CLASSES[cls]
    r2 = u * u + v * v
    if name == "circle":
        return r2 <= 0.85**2
    if name == "square":
        return np.maximum(np.abs(u), np.abs(v)) <= 0.68
    if name == "triangle":  # equilateral, circumradius 1, inradius 0.5
        inside = np.ones(u.shape, dtype=bool)
        for k in range(3):
            a = -np.pi / 2 + 2 * np.pi * k / 3
            inside &= u * np.cos(a) + v * np.sin(a) <= 0.5
        return inside
    if name == "star":  # five points, outer radius 1, inner radius 0.42
        r_out, r_in, half = 1.0, 0.42, np.pi / 5
        psi = np.mod(np.arctan2(v, u), 2 * half)
        phi = np.where(psi <= half, psi, 2 * half - psi)
        edge = r_out * r_in * np.sin(half) / (r_out * np.sin(phi) + r_in * np.sin(half - phi))
        return np.sqrt(r2) <= edge
    if name == "cross":  # a plus sign with arms of half-width 0.28
        au, av = np.abs(u), np.abs(v)
        return ((au <= 0.28) & (av <= 0.92)) | ((av <= 0.28) & (au <= 0.92))
    if name == "ring":
        return (r2 <= 0.92**2) & (r2 >= 0.52**2)
    if name == "crescent":
        return (r2 <= 0.92**2) & ((u - 0.42) ** 2 + v * v >= 0.72**2)
    if name == "heart":  # (x^2 + y^2 - 1)^3 - x^2 y^3 <= 0, scaled and centred into the unit disc
        x = 1.28 * u  # the heart's points lie within 1.25 of (0, 0.25)
        y = 1.28 * v + 0.25
        return (x * x + y * y - 1.0) ** 3 - x * x * y**3 <= 0.0
    raise AssertionError(f"unknown class index {cls}")


def _texture(rng: np.random.Generator, n: int, size: int, yy, xx) -> np.ndarray:
    """Zero-mean textures in [-1, 1], one per scene: stripes, checks, blotches or rings."""
    kind = rng.integers(0, 4, size=n)
    freq = rng.uniform(3.0, 9.0, size=n).astype(np.float32) / size  # cycles per pixel
    angle = rng.uniform(0.0, np.pi, size=n).astype(np.float32)
    phase = rng.uniform(0.0, 2 * np.pi, size=n).astype(np.float32)
    centre = rng.uniform(0.0, size, size=(n, 2)).astype(np.float32)
    # Low-resolution random field for blotches, upsampled bilinearly.
    g = 6
    field = rng.uniform(-1.0, 1.0, size=(n, g, g)).astype(np.float32)

    out = np.empty((n, size, size), dtype=np.float32)
    two_pi_f = (2 * np.pi * freq)[:, None, None]
    c, s = np.cos(angle)[:, None, None], np.sin(angle)[:, None, None]
    ph = phase[:, None, None]
    for k in range(4):
        idx = np.flatnonzero(kind == k)
        if idx.size == 0:
            continue
        if k == 0:  # stripes
            t = xx * c[idx] + yy * s[idx]
            out[idx] = np.sin(two_pi_f[idx] * t + ph[idx])
        elif k == 1:  # checks
            t1 = xx * c[idx] + yy * s[idx]
            t2 = -xx * s[idx] + yy * c[idx]
            out[idx] = np.sign(np.sin(two_pi_f[idx] * t1) * np.sin(two_pi_f[idx] * t2 + ph[idx]))
        elif k == 2:  # blotches: bilinear upsampling of a 6 x 6 random field
            pos = (np.arange(size, dtype=np.float32) + 0.5) * (g - 1) / size
            i0 = np.minimum(pos.astype(int), g - 2)
            w = (pos - i0)[None, :]
            f = field[idx]
            rows = f[:, i0, :] * (1 - w[..., None]) + f[:, i0 + 1, :] * w[..., None]  # m x size x g
            out[idx] = rows[:, :, i0] * (1 - w[:, None, :]) + rows[:, :, i0 + 1] * w[:, None, :]
        else:  # concentric rings around a random centre
            d = np.sqrt((xx - centre[idx, 0, None, None]) ** 2 + (yy - centre[idx, 1, None, None]) ** 2)
            out[idx] = np.sin(two_pi_f[idx] * d + ph[idx])
    return out


def _segment_distance(px, py, ax, ay, bx, by):
    """Distance from points (px, py) to segments a-b (all broadcast together)."""
    dx, dy = bx - ax, by - ay
    t = ((px - ax) * dx + (py - ay) * dy) / np.maximum(dx * dx + dy * dy, 1e-6)
    t = np.clip(t, 0.0, 1.0)
    return np.sqrt((px - ax - t * dx) ** 2 + (py - ay - t * dy) ** 2)


def _paint(img: np.ndarray, idx: np.ndarray, mask: np.ndarray, colour: np.ndarray) -> None:
    """In place: ``img[idx[i]][mask[i]] = colour[i]`` for every i (only the masked pixels move)."""
    i, y, x = np.nonzero(mask)
    img[idx[i], y, x] = colour[i]


#: Recently rendered scene sets, newest last, up to _CACHE_BYTES in all: the same arguments give
#: the same scenes byte for byte, and a chapter asks for the same held-out scenes several times
#: (with and without their objects). Every caller gets its own copy.
_CACHE: "OrderedDict[tuple, Scenes]" = OrderedDict()
_CACHE_BYTES = 256 * 2**20
_CACHE_LOCK = threading.Lock()


def _copy(s: Scenes) -> Scenes:
    return Scenes(images=s.images.copy(), labels=s.labels.copy(), masks=s.masks.copy(),
                  classes=list(s.classes), difficulty=s.difficulty)


def _render_scenes(n, seed, n_objects, *, difficulty, size, with_objects) -> Scenes:
    """:func:`_draw_scenes`, kept for repeated calls (a copy each time)."""
    _check_args(n, seed, n_objects, difficulty, size)
    key = (int(n), int(seed), int(n_objects), float(difficulty), int(size), bool(with_objects))
    with _CACHE_LOCK:
        if key in _CACHE:
            _CACHE.move_to_end(key)
            return _copy(_CACHE[key])
    scenes = _draw_scenes(n, seed, n_objects, difficulty=difficulty, size=size, with_objects=with_objects)
    nbytes = scenes.images.nbytes + scenes.masks.nbytes + scenes.labels.nbytes
    if nbytes <= _CACHE_BYTES // 4:
        with _CACHE_LOCK:
            _CACHE[key] = _copy(scenes)
            while sum(v.images.nbytes + v.masks.nbytes + v.labels.nbytes for v in _CACHE.values()) > _CACHE_BYTES:
                _CACHE.popitem(last=False)
    return scenes


def _draw_scenes(n, seed, n_objects, *, difficulty, size, with_objects) -> Scenes:
    """Draw all random parameters first, then render; ``with_objects=False`` renders the
    identical scenes without their objects (the tests compare the two)."""
    n, n_objects, size, d = int(n), int(n_objects), int(size), float(difficulty)
    rng = np.random.default_rng([int(seed), n_objects, 20240601])
    k_cls = len(CLASSES)
    scale = size / DEFAULT_SIZE

    # ---- random parameters ----------------------------------------------------------------
    dark_bg = rng.random(n) < 0.5
    # Background variation (gradient + texture) stays inside the background band, so the
    # band gap guarantees the object contrast.
    bg_lo = np.where(dark_bg, _DARK[0], _LIGHT[0]).astype(np.float32)
    bg_hi = np.where(dark_bg, _DARK[1], _LIGHT[1]).astype(np.float32)
    tex_amp = (d * rng.uniform(0.4, 1.0, size=n) * 18.0).astype(np.float32)  # luminance units
    grad_amp = d * rng.uniform(0.3, 1.0, size=n).astype(np.float32)  # fraction of the band
    # Base colours leave room for the texture amplitude on both sides.
    c0 = _colours_with_luma(rng, bg_lo + tex_amp, bg_hi - tex_amp)
    c1 = _colours_with_luma(rng, bg_lo + tex_amp, bg_hi - tex_amp)
    grad_angle = rng.uniform(0.0, 2 * np.pi, size=n).astype(np.float32)

    n_blobs_max, n_strokes_max = 4, 3
    n_blobs = rng.binomial(n_blobs_max, d, size=n)
    n_strokes = rng.binomial(n_strokes_max, d * 0.9, size=n)
    blob_xy = rng.uniform(0, size, size=(n, n_blobs_max, 2)).astype(np.float32)
    blob_r = (rng.uniform(2.0, 5.0, size=(n, n_blobs_max)) * scale).astype(np.float32)
    blob_col = rng.uniform(0, 255, size=(n, n_blobs_max, 3)).astype(np.float32)
    stroke_a = rng.uniform(0, size, size=(n, n_strokes_max, 2)).astype(np.float32)
    stroke_len = rng.uniform(0.25, 0.7, size=(n, n_strokes_max)).astype(np.float32) * size
    stroke_ang = rng.uniform(0, 2 * np.pi, size=(n, n_strokes_max)).astype(np.float32)
    stroke_b = stroke_a + stroke_len[..., None] * np.stack([np.cos(stroke_ang), np.sin(stroke_ang)], -1)
    stroke_w = (rng.uniform(0.8, 1.8, size=(n, n_strokes_max)) * scale).astype(np.float32)  # half-width
    stroke_col = rng.uniform(0, 255, size=(n, n_strokes_max, 3)).astype(np.float32)
    noise_sd = 5.0 * d

    # Objects: distinct classes within a scene.
    labels = np.empty((n, n_objects), dtype=np.int64)
    labels[:, 0] = rng.integers(0, k_cls, size=n)
    if n_objects == 2:
        labels[:, 1] = (labels[:, 0] + rng.integers(1, k_cls, size=n)) % k_cls
    r_lo, r_hi = _RADIUS_ONE if n_objects == 1 else _RADIUS_TWO
    radius = (rng.uniform(r_lo, r_hi, size=(n, n_objects)) * scale).astype(np.float32)
    rot = rng.uniform(0.0, 2 * np.pi, size=(n, n_objects)).astype(np.float32)
    obj_lo = np.where(dark_bg, _LIGHT[0], _DARK[0]).astype(np.float32)
    obj_hi = np.where(dark_bg, _LIGHT[1], _DARK[1]).astype(np.float32)
    obj_col = _colours_with_luma(rng, obj_lo[:, None].repeat(n_objects, 1), obj_hi[:, None].repeat(n_objects, 1))
    centre = np.empty((n, n_objects, 2), dtype=np.float32)
    centre[:, 0] = radius[:, :1] + rng.random((n, 2)).astype(np.float32) * (size - 2 * radius[:, :1])
    if n_objects == 2:
        # Place the second object where its bounding circle misses the first one's: the first
        # of 24 random candidates that fits, else the farthest corner position (which always
        # fits for the radius range used).
        r2 = radius[:, 1:2]
        cand = r2[:, None, :] + rng.random((n, 24, 2)).astype(np.float32) * (size - 2 * r2[:, None, :])
        corners = np.stack(
            [
                np.concatenate([r2, r2], 1),
                np.concatenate([size - r2, r2], 1),
                np.concatenate([r2, size - r2], 1),
                np.concatenate([size - r2, size - r2], 1),
            ],
            1,
        )
        dist_c = np.linalg.norm(cand - centre[:, None, 0], axis=-1)
        ok = dist_c >= (radius[:, :1] + r2 + 1.0 * scale)
        first_ok = np.argmax(ok, axis=1)
        dist_k = np.linalg.norm(corners - centre[:, None, 0], axis=-1)
        far = np.argmax(dist_k, axis=1)
        rows = np.arange(n)
        centre[:, 1] = np.where(ok.any(1)[:, None], cand[rows, first_ok], corners[rows, far])

    noise = rng.standard_normal((n, size, size, 3), dtype=np.float32) * noise_sd if noise_sd > 0 else None

    # ---- background -----------------------------------------------------------------------
    coords = np.arange(size, dtype=np.float32) + 0.5
    yy, xx = coords[None, :, None], coords[None, None, :]
    t = (xx - size / 2) * np.cos(grad_angle)[:, None, None] + (yy - size / 2) * np.sin(grad_angle)[:, None, None]
    t = np.clip(t / size + 0.5, 0.0, 1.0) * grad_amp[:, None, None]  # n x S x S in [0, grad_amp]
    img = c0[:, None, None, :] + t[..., None] * (c1 - c0)[:, None, None, :]
    if d > 0:
        tex = _texture(rng, n, size, yy, xx) * tex_amp[:, None, None]
        img += tex[..., None]  # equal shift in every channel = the same luminance shift

    # Clutter blobs and strokes (any colour; drawn behind the objects).
    for j in range(n_blobs_max):
        idx = np.flatnonzero(n_blobs > j)
        if idx.size:
            dd = (xx - blob_xy[idx, j, 0, None, None]) ** 2 + (yy - blob_xy[idx, j, 1, None, None]) ** 2
            _paint(img, idx, dd <= blob_r[idx, j, None, None] ** 2, blob_col[idx, j])
    for j in range(n_strokes_max):
        idx = np.flatnonzero(n_strokes > j)
        if idx.size:
            dist = _segment_distance(
                xx, yy,
                stroke_a[idx, j, 0, None, None], stroke_a[idx, j, 1, None, None],
                stroke_b[idx, j, 0, None, None], stroke_b[idx, j, 1, None, None],
            )
            _paint(img, idx, dist <= stroke_w[idx, j, None, None], stroke_col[idx, j])

    # ---- objects ----------------------------------------------------------------------------
    masks = np.zeros((n, n_objects, size, size), dtype=bool)
    for j in range(n_objects):
        for k in range(k_cls):
            idx = np.flatnonzero(labels[:, j] == k)
            if idx.size == 0:
                continue
            cx = centre[idx, j, 0, None, None]
            cy = centre[idx, j, 1, None, None]
            ca = np.cos(rot[idx, j])[:, None, None]
            sa = np.sin(rot[idx, j])[:, None, None]
            inv_r = 1.0 / radius[idx, j, None, None]
            dx, dy = xx - cx, yy - cy
            u = (dx * ca + dy * sa) * inv_r
            v = (-dx * sa + dy * ca) * inv_r
            masks[idx, j] = _shape_inside(k, u, v)
    if n_objects == 2:  # the later object is drawn on top; masks hold visible pixels only
        masks[:, 0] &= ~masks[:, 1]
    if with_objects:
        every = np.arange(n)
        for j in range(n_objects):
            _paint(img, every, masks[:, j], obj_col[:, j])

    if noise is not None:
        img += noise
    images = np.clip(np.rint(img), 0, 255).astype(np.uint8)
    return Scenes(images=images, labels=labels, masks=masks, classes=list(CLASSES), difficulty=d)
