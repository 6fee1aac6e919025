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
  each object of a scene asked for in turn; :func:`asked_hits` and :func:`asked_rates` — the
  pointing game per ask (on the asked object, touching it, on another one) and each rate with its
  Wilson interval;
- :func:`grow_masks` — masks grown by a margin, to grade a map by what its tokens read
  (a token reads more than its patch: :func:`vitlab.footprints.token_footprints`);
  :func:`shift_masks` — masks moved by whole pixels (a stem that moves token centres,
  :func:`vitlab.footprints.token_centres`); :func:`object_gaps` — how far apart two objects lie;
- :func:`top_token_hits` — the same question for a text map: is the highest token one of the
  words that should carry the relevance (the shape a caption names), with its chance level;
  :func:`top_token_is` — is it the one given position (a question's named word);
- :func:`map_change` — how much one map differs from another (top entry moved, L1 distance of
  the normalised maps), e.g. a rollout setting against vanilla rollout;
- the uncertainty of a grade over a sample of scenes is :mod:`vitlab.stats`'s;
- weakly supervised segmentation, Chefer et al. (2021)'s DETR experiment:
  :func:`map_to_mask` (a detection's map -> the object's mask, Otsu as the reference's
  ``DETR/mask_generator.py``), :func:`mask_iou` and :func:`segmentation_ap` (COCO's mask AP
  over the reference's IoU thresholds 0.2:0.05:0.95, :data:`SEGMENTATION_IOU_THRESHOLDS`);
  :func:`grid_mask_iou` (a mask on the patch grid, e.g. zero-shot segmentation's, against the
  object's pixel mask); :func:`box_iou` (boxes against boxes: a detection against an object's box).

They take maps and masks only; no model is called here.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from vitlab import stats
from vitlab.compat import moved_names


def as_cpu_tensor(a, dtype=torch.float32) -> torch.Tensor:
    if isinstance(a, torch.Tensor):
        return a.detach().to("cpu", dtype)
    return torch.as_tensor(np.ascontiguousarray(a), dtype=dtype)  # also reversed/strided views


def _refuse_non_finite(values: torch.Tensor, what: str) -> None:
    """``ValueError`` naming the samples (first axis) of ``values`` that hold NaN or infinity.

    A map with a NaN is a failed computation, not a map: it has no highest patch and no mass,
    so no score of it would mean anything (``NaN == max`` is never true, so a pointing game
    that read it would call it a hit). It is refused before grading, as every input is."""
    finite = torch.isfinite(values.reshape(values.shape[0], -1)).all(1)
    if not bool(finite.all()):
        bad = (~finite).nonzero().flatten().tolist()
        raise ValueError(f"{what} {', '.join(map(str, bad[:10]))}{', ...' if len(bad) > 10 else ''} "
                         f"hold{'s' if len(bad) == 1 else ''} NaN or infinite values, so no patch is the highest "
                         "and nothing can be graded; find where the map went NaN (a 0/0 normalisation, a "
                         "non-finite input) and grade the maps once they are finite")


def _check(maps: torch.Tensor, masks: torch.Tensor) -> None:
    if maps.ndim != 3:
        raise ValueError(f"maps must be B x gh x gw, got shape {tuple(maps.shape)}")
    if masks.ndim != 3:
        raise ValueError(f"masks must be B x H x W, got shape {tuple(masks.shape)}")
    if maps.shape[0] != masks.shape[0]:
        raise ValueError(f"got {maps.shape[0]} maps for {masks.shape[0]} masks")
    _refuse_non_finite(maps, "map")
    _refuse_non_finite(masks, "mask")
    gh, gw = maps.shape[1:]
    H, W = masks.shape[1:]
    if H % gh or W % gw:
        raise ValueError(f"mask size {H} x {W} is not a multiple of the patch grid {gh} x {gw}")


def patch_size(masks: torch.Tensor, grid: tuple[int, int]) -> tuple[int, int]:
    """The pixel size ``(ph, pw)`` of one patch of the ``gh x gw`` grid over ``B x H x W`` masks;
    refuses masks of another rank or a size the grid does not divide."""
    if masks.ndim != 3:
        raise ValueError(f"masks must be B x H x W, got shape {tuple(masks.shape)}")
    H, W = masks.shape[1:]
    gh, gw = grid
    if H % gh or W % gw:
        raise ValueError(f"mask size {H} x {W} is not a multiple of the patch grid {gh} x {gw}")
    return H // gh, W // gw


def mask_to_grid(masks, grid: tuple[int, int]) -> torch.Tensor:
    """``B x H x W`` boolean masks -> ``B x gh x gw`` fraction of each patch on the object."""
    m = as_cpu_tensor(masks)
    return F.avg_pool2d(m[:, None], kernel_size=patch_size(m, grid))[:, 0]


def pointing_game(maps, masks, min_coverage: float = 0.5) -> torch.Tensor:
    """Per sample: does the highest patch of the map lie on the object? (bool tensor ``B``)

    A patch lies on the object when at least ``min_coverage`` of its pixels are object
    pixels. Ties for the highest value count as a hit only if all tied patches are hits.
    """
    if not 0.0 < min_coverage <= 1.0:
        raise ValueError(f"min_coverage must be in (0, 1], got {min_coverage}")
    maps, masks = as_cpu_tensor(maps), as_cpu_tensor(masks)
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
    maps, masks = as_cpu_tensor(maps).clamp_min(0), as_cpu_tensor(masks)
    _check(maps, masks)
    cover = mask_to_grid(masks, tuple(maps.shape[1:]))
    total = maps.flatten(1).sum(1)
    if (total <= 0).any():
        raise ValueError("a map has no positive mass; mass_on_object is undefined for it")
    return (maps * cover).flatten(1).sum(1) / total


def object_area(masks) -> torch.Tensor:
    """Per sample: the fraction of the image the object covers (chance level of the measures)."""
    m = as_cpu_tensor(masks)
    return m.flatten(1).mean(1)


def attention_entropy(maps, normalized: bool = True) -> torch.Tensor:
    """Entropy of each map as a distribution over its patches: ``... x gh x gw`` -> ``...``.

    Each (non-negative) map is divided by its sum, then ``H = -sum_p p log p`` (with
    ``0 log 0 = 0``). With ``normalized`` (default) H is divided by ``log(gh * gw)``: 1 for a
    uniform map, 0 for a map on a single patch. A map with no positive mass raises
    ``ValueError``.
    """
    m = as_cpu_tensor(maps)
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
    maps, masks = as_cpu_tensor(maps), as_cpu_tensor(masks)
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
    maps, masks = as_cpu_tensor(maps), as_cpu_tensor(masks)
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
    masks = as_cpu_tensor(masks)
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


#: The columns of :func:`asked_hits`, in order.
ASKED_COLUMNS = ("asked", "asked_touch", "other")


def asked_hits(maps: dict, masks, min_coverage: float = 0.5) -> dict:
    """The pointing game per ask: ``maps`` as :func:`grade_asked` takes them (method -> ``B x K x
    gh x gw``, ask k of scene i asking for object k), ``masks`` ``B x K x H x W`` with ``K >= 2``.

    Returns method -> a ``(B K) x 3`` bool tensor, one row per ask, scene by scene (scene 0's K
    asks, then scene 1's, ...), columns :data:`ASKED_COLUMNS`: the top patch on the asked object
    (:func:`pointing_game` at ``min_coverage``), touching it (:data:`TOUCH`: it holds any of its
    pixels), on another object of the scene (their union, at ``min_coverage``). The hits of each
    ask, for rates with intervals (:func:`asked_rates`) and paired differences between methods
    (:func:`vitlab.stats.paired_difference`) on the same asks."""
    masks = as_cpu_tensor(masks)
    if masks.ndim != 4 or masks.shape[1] < 2:
        raise ValueError(f"asked_hits needs masks B x K x H x W with K >= 2 objects per scene (an 'other' "
                         f"object to miss), got {tuple(masks.shape)}; for one object use pointing_game")
    B, K = masks.shape[:2]
    own = masks.reshape(B * K, *masks.shape[2:])
    rest = torch.stack([masks[:, [j for j in range(K) if j != k]].amax(1) for k in range(K)], 1)
    rest = rest.reshape(B * K, *masks.shape[2:])
    out = {}
    for name, m in maps.items():
        m = as_cpu_tensor(m)
        if m.ndim != 4 or m.shape[:2] != masks.shape[:2]:
            raise ValueError(f"{name}: need maps B x K x gh x gw matching masks {tuple(masks.shape[:2])}, "
                             f"got {tuple(m.shape)}")
        flat = m.reshape(B * K, *m.shape[2:])
        out[name] = torch.stack([pointing_game(flat, own, min_coverage), pointing_game(flat, own, TOUCH),
                                 pointing_game(flat, rest, min_coverage)], 1)
    return out


def asked_rates(hits: dict, asks_per_scene: int = 2, level: float = 0.95) -> list[dict]:
    """One row per method of :func:`asked_hits`: ``method``; ``asked``, ``asked_touch``, ``other``
    (each a :class:`vitlab.stats.Estimate`: the share of asks with its Wilson interval,
    :func:`vitlab.stats.rate`); ``all_asks`` (the share of scenes where every ask hits its own
    object, with its Wilson interval: a class-agnostic map, the same for every ask, cannot do
    this for disjoint objects); ``n`` (``"asks / scenes"``). Rows print with
    :func:`vitlab.plot.table`."""
    rows = []
    for name, h in hits.items():
        h = torch.as_tensor(h)
        if h.ndim != 2 or h.shape[1] != len(ASKED_COLUMNS) or h.shape[0] % asks_per_scene:
            raise ValueError(f"{name}: need asked_hits' (scenes x {asks_per_scene}) x {len(ASKED_COLUMNS)} "
                             f"hits, got {tuple(h.shape)}")
        h = h.bool()
        row = {"method": name, **{c: stats.rate(h[:, j], level) for j, c in enumerate(ASKED_COLUMNS)}}
        row["all_asks"] = stats.rate(h[:, 0].reshape(-1, asks_per_scene).all(1), level)
        row["n"] = f"{len(h)} / {len(h) // asks_per_scene}"
        rows.append(row)
    return rows


def grow_masks(masks, margin: int) -> torch.Tensor:
    """``B x H x W`` masks grown by ``margin`` pixels: a pixel is in the grown mask when an
    object pixel lies within ``margin`` pixels of it in both directions (a square
    neighbourhood, the Chebyshev distance; ``margin=0`` returns the masks as floats). Used to
    grade a map by what its tokens read: a token reads a window around its patch
    (:func:`vitlab.footprints.footprint_extent` measures how far), so the top patch of a map can
    sit beside the object while its token saw it."""
    m = as_cpu_tensor(masks)
    if m.ndim != 3:
        raise ValueError(f"masks must be B x H x W, got shape {tuple(m.shape)}")
    if isinstance(margin, bool) or not isinstance(margin, (int, np.integer)) or margin < 0:
        raise ValueError(f"margin must be a non-negative int (pixels), got {margin!r}")
    margin = int(margin)
    if margin == 0:
        return (m > 0).float()
    return F.max_pool2d((m > 0).float()[:, None], kernel_size=2 * margin + 1, stride=1, padding=margin)[:, 0]


class TokenHits(NamedTuple):
    """What :func:`top_token_hits` returns, per text: ``hits`` (``B`` bool) and ``chance``
    (``B`` float, the hit rate of a map whose top token is drawn at random among the counted ones)."""

    hits: torch.Tensor
    chance: torch.Tensor


def top_token_hits(maps, targets, valid=None) -> TokenHits:
    """Per text: is the highest token of the map one of ``targets``? -- the pointing game on a text
    map (e.g. a CLIP caption's relevance: does the word naming the shape carry the most?).

    Args:
        maps: ``B x T`` token scores.
        targets: ``B x T`` bool, the tokens that count as a hit (e.g. the shape words).
        valid: ``B x T`` bool, the tokens that take part (e.g. a text map's kept entries: the
            caption's words, not the start, end-of-text or padding tokens); None: all.

    As :func:`pointing_game`, ties for the highest value are a hit only if every tied token is a
    target. ``chance``: the share of the valid tokens that are targets (a random top token hits
    that often). A text with no valid token, or no valid target, is refused (``ValueError``), as
    are non-finite scores.
    """
    m = as_cpu_tensor(maps, torch.float64)
    t = as_cpu_tensor(targets, torch.bool)
    if m.ndim != 2 or tuple(t.shape) != tuple(m.shape):
        raise ValueError(f"maps and targets must both be B x T, got {tuple(m.shape)} and {tuple(t.shape)}")
    v = torch.ones_like(t) if valid is None else as_cpu_tensor(valid, torch.bool)
    if tuple(v.shape) != tuple(m.shape):
        raise ValueError(f"valid must be B x T like maps {tuple(m.shape)}, got {tuple(v.shape)}")
    if not bool(torch.isfinite(m[v]).all()):
        raise ValueError("maps hold NaN or inf among the valid tokens")
    n_valid, n_target = v.sum(1), (t & v).sum(1)
    if bool((n_valid == 0).any()) or bool((n_target == 0).any()):
        b = int(((n_valid == 0) | (n_target == 0)).nonzero()[0])
        raise ValueError(f"text {b} has no valid token or no valid target token: its top token cannot be graded")
    scores = m.masked_fill(~v, float("-inf"))
    top = (scores == scores.amax(1, keepdim=True)) & v
    hits = (top & ~t).sum(1) == 0
    return TokenHits(hits, (n_target.double() / n_valid.double()).float())


def grid_mask_iou(grid_masks, masks) -> torch.Tensor:
    """IoU of masks on the patch grid with pixel masks, pair by pair: ``B x gh x gw`` (bool; each
    patch stands for its whole square of pixels, i.e. nearest upsampling) and ``B x H x W`` ->
    ``B``. 0 where both are empty. E.g. a zero-shot segmentation's patches of one class
    (:func:`vitlab.clip_decomposition.class_masks`) against that object's mask."""
    g = as_cpu_tensor(grid_masks, torch.bool)
    t = as_cpu_tensor(masks, torch.bool)
    if g.ndim != 3 or t.ndim != 3 or g.shape[0] != t.shape[0]:
        raise ValueError(f"grid_masks must be B x gh x gw and masks B x H x W with the same B, got "
                         f"{tuple(g.shape)} and {tuple(t.shape)}")
    (gh, gw), (H, W) = g.shape[1:], t.shape[1:]
    if H % gh or W % gw:
        raise ValueError(f"mask size {H} x {W} is not a multiple of the patch grid {gh} x {gw}")
    up = g.repeat_interleave(H // gh, dim=1).repeat_interleave(W // gw, dim=2)
    inter = (up & t).flatten(1).sum(1).double()
    union = (up | t).flatten(1).sum(1).double()
    return torch.where(union > 0, inter / union.clamp_min(1), torch.zeros_like(inter))


# --- weakly supervised segmentation: Chefer et al. (2021)'s DETR experiment --------------------
#: IoU thresholds of the reference's segmentation experiment: COCO's mask evaluation with its
#: ``iouThrs`` changed from 0.5:0.05:0.95 to 0.2:0.05:0.95 (hila-chefer/Transformer-MM-
#: Explainability, README "segmentation experiment"), 16 thresholds.
SEGMENTATION_IOU_THRESHOLDS: tuple[float, ...] = tuple(np.round(np.linspace(0.2, 0.95, 16), 2).tolist())


def otsu_threshold(values) -> int:
    """Otsu's threshold (1979) of uint8 values: the level ``t`` maximising the between-class
    variance of ``{v <= t}`` and ``{v > t}`` over the 256-bin histogram (as OpenCV's
    ``THRESH_OTSU``: pixels ``> t`` are foreground; the first maximum wins)."""
    v = np.asarray(values).ravel()
    if v.size == 0:
        raise ValueError("otsu_threshold needs at least one value")
    if v.dtype != np.uint8:
        raise ValueError(f"otsu_threshold takes uint8 values (0..255), got dtype {v.dtype}")
    hist = np.bincount(v, minlength=256).astype(np.float64)
    p = hist / hist.sum()
    levels = np.arange(256, dtype=np.float64)
    w0 = np.cumsum(p)                       # weight of {v <= t}
    m0 = np.cumsum(p * levels)
    mu = m0[-1]
    w1 = 1.0 - w0
    with np.errstate(divide="ignore", invalid="ignore"):
        between = (mu * w0 - m0) ** 2 / (w0 * w1)
    between[(w0 <= 0) | (w1 <= 1e-15)] = -1.0
    return int(np.argmax(between))


#: How :func:`map_to_mask` cuts a map: ``"otsu"`` (Chefer et al.'s DETR experiment,
#: ``DETR/mask_generator.py``) or ``"mean"`` (the ImageNet-segmentation benchmark of Chefer et
#: al.'s ViT code, ``imagenet_seg_eval.py``, reused by Gandelsman et al.'s
#: ``compute_segmentations.py``: min-max scaled, foreground above the map's mean). Both cut the
#: patch grid here; the benchmark's code cuts pixels, after upsampling the map bilinearly.
MASK_RULES = ("otsu", "mean")


def map_to_mask(maps, size: tuple[int, int], upsample: str = "bilinear", rule: str = "otsu") -> torch.Tensor:
    """Explanation maps ``B x gh x gw`` -> object masks ``B x H x W`` (bool). ``rule="otsu"``: as
    the reference's ``DETR/mask_generator.py`` makes them: each map min-max scaled to 0..255, cast
    to uint8, thresholded by Otsu on the patch grid (:func:`otsu_threshold`), then brought to the
    image size. ``rule="mean"``: each map min-max scaled to [0, 1] and the patches above its mean
    kept (the ImageNet-segmentation benchmark's rule, :data:`MASK_RULES`, which its code applies to
    pixels after upsampling the map bilinearly; here to the patch grid, like Otsu). ``upsample="bilinear"``: as DETR's ``PostProcessSegm`` does it (bilinear
    interpolation of the grid mask, ``align_corners=False``, foreground where the value is
    > 0, i.e. its sigmoid > 0.5); ``"nearest"``: each patch's pixels take its value. A constant
    map gives an empty mask (nothing stands out)."""
    if upsample not in ("bilinear", "nearest"):
        raise ValueError(f"upsample must be 'bilinear' or 'nearest', got {upsample!r}")
    if rule not in MASK_RULES:
        raise ValueError(f"rule must be one of {MASK_RULES}, got {rule!r}")
    m = as_cpu_tensor(maps, torch.float64)
    if m.ndim != 3 or m.shape[0] == 0:
        raise ValueError(f"maps must be B x gh x gw with B >= 1, got shape {tuple(m.shape)}")
    if not bool(torch.isfinite(m).all()):
        raise ValueError("maps hold NaN or inf: fix the explanation before turning it into a mask")
    grid = torch.zeros_like(m)
    for b in range(m.shape[0]):
        lo, hi = m[b].min(), m[b].max()
        if hi <= lo:
            continue
        if rule == "mean":
            unit = (m[b] - lo) / (hi - lo)
            grid[b] = (unit > unit.mean()).double()
            continue
        u8 = ((m[b] - lo) / (hi - lo) * 255).numpy().astype(np.uint8)
        grid[b] = torch.from_numpy(u8 > otsu_threshold(u8)).double()
    if upsample == "nearest":
        up = F.interpolate(grid[:, None], size=tuple(size), mode="nearest")[:, 0]
    else:
        up = F.interpolate(grid[:, None], size=tuple(size), mode="bilinear", align_corners=False)[:, 0]
    return up > 0


def mask_iou(pred, true) -> torch.Tensor:
    """IoU of every predicted mask with every true mask: ``K x H x W`` and ``M x H x W`` -> ``K x M``
    (0 where both are empty)."""
    a = as_cpu_tensor(pred, torch.bool).flatten(1).double()
    b = as_cpu_tensor(true, torch.bool).flatten(1).double()
    if a.shape[1:] != b.shape[1:]:
        raise ValueError(f"predicted and true masks differ in size: {tuple(pred.shape[1:])} vs {tuple(true.shape[1:])}")
    inter = a @ b.T
    union = a.sum(1)[:, None] + b.sum(1)[None] - inter
    return torch.where(union > 0, inter / union.clamp_min(1), torch.zeros_like(inter))


def box_iou(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """IoU of every box in ``a`` (``n x 4``) with every box in ``b`` (``m x 4``), ``(x0, y0, x1, y1)``."""
    a, b = np.asarray(a, dtype=np.float64)[:, None], np.asarray(b, dtype=np.float64)[None]
    iw = np.clip(np.minimum(a[..., 2], b[..., 2]) - np.maximum(a[..., 0], b[..., 0]), 0, None)
    ih = np.clip(np.minimum(a[..., 3], b[..., 3]) - np.maximum(a[..., 1], b[..., 1]), 0, None)
    inter = iw * ih
    area = lambda z: (z[..., 2] - z[..., 0]) * (z[..., 3] - z[..., 1])  # noqa: E731
    return inter / np.maximum(area(a) + area(b) - inter, 1e-12)


def best_patch_mask(masks, grid: tuple[int, int]) -> torch.Tensor:
    """For each object mask (``B x H x W`` bool), the union of whole patches of the ``gh x gw``
    grid with the highest IoU with it, as a ``B x H x W`` bool mask: the ceiling of any mask
    made of whole patches (a map's patches, not grown). With ``a_p`` the object's pixels in
    patch ``p`` and ``A`` a patch's area, a union of ``k`` patches has IoU
    ``sum a / (|object| + k A - sum a)``, highest for the ``k`` patches of largest ``a_p``; the
    best ``k`` is then taken (ties: the fewest patches). An empty object gives an empty mask."""
    m = as_cpu_tensor(masks, torch.float64)
    ph, pw = patch_size(m, grid)
    gh, gw = grid
    a = F.avg_pool2d(m[:, None], kernel_size=(ph, pw))[:, 0].flatten(1) * (ph * pw)   # B x P pixels
    order = a.argsort(dim=1, descending=True, stable=True)
    cum = a.gather(1, order).cumsum(1)
    k = torch.arange(1, a.shape[1] + 1, dtype=torch.float64)
    iou = cum / (m.flatten(1).sum(1, keepdim=True) + k * ph * pw - cum).clamp_min(1)
    best_k = iou.argmax(1) + 1                                       # first maximum: fewest patches
    keep = torch.zeros_like(a, dtype=torch.bool)
    keep.scatter_(1, order, k[None].expand_as(a) <= best_k[:, None].double())
    keep &= (m.flatten(1).sum(1) > 0)[:, None]
    grid_mask = keep.view(-1, gh, gw)
    return grid_mask.repeat_interleave(ph, dim=1).repeat_interleave(pw, dim=2)


def box_masks(boxes, size: tuple[int, int]) -> torch.Tensor:
    """Boxes filled as masks: ``D x 4`` boxes ``(x0, y0, x1, y1)`` in [0, 1] (a detector's
    predicted boxes, e.g. :attr:`vitlab.relevance.DetectionGrades.box`) -> ``D x H x W`` bool
    masks of ``size = (H, W)``, a pixel inside when its centre is (edges included). The trivial
    segmentation a detector gives with no explanation at all: the baseline a map's mask
    (:func:`map_to_mask`) has to beat."""
    b = as_cpu_tensor(boxes, torch.float64)
    if b.ndim != 2 or b.shape[1] != 4:
        raise ValueError(f"boxes must be D x 4 (x0, y0, x1, y1), got shape {tuple(b.shape)}")
    if not bool(torch.isfinite(b).all()):
        raise ValueError("boxes hold NaN or inf: drop those detections first")
    H, W = (int(v) for v in size)
    cy = (torch.arange(H, dtype=torch.float64) + 0.5) / H
    cx = (torch.arange(W, dtype=torch.float64) + 0.5) / W
    inside_y = (cy >= b[:, 1, None]) & (cy <= b[:, 3, None])          # D x H
    inside_x = (cx >= b[:, 0, None]) & (cx <= b[:, 2, None])          # D x W
    return inside_y[:, :, None] & inside_x[:, None, :]


def segmentation_ap(detections: list[dict], truths: list[dict],
                    iou_thresholds=SEGMENTATION_IOU_THRESHOLDS) -> dict:
    """COCO's mask AP (the reference's DETR segmentation score), written out here.

    Args:
        detections: per image ``{"scores": K, "labels": K, "masks": K x H x W}``.
        truths: per image ``{"labels": M, "masks": M x H x W}``.
        iou_thresholds: default the reference's 0.2, 0.25, ..., 0.95.

    COCO's rules (``pycocotools`` ``evaluateImg`` / ``accumulate``): per image and class,
    detections by decreasing score each take the still unmatched true object of that class
    with the highest IoU, if at least the threshold; per class over all images, detections by
    decreasing score give the precision-recall curve, made non-increasing from the right and
    read at the 101 recalls 0, 0.01, ..., 1 (0 beyond the highest recall); AP is the mean over
    the classes that have true objects and over the thresholds. Returns ``{"ap", "ap50" (the
    0.5 threshold, if listed), "per_threshold": {t: ap}, "per_class": {label: ap},
    "n_detections", "n_objects"}``.
    """
    if len(detections) != len(truths):
        raise ValueError(f"got detections for {len(detections)} images and truths for {len(truths)}")
    thr = [float(t) for t in iou_thresholds]
    if not thr or any(not 0 < t <= 1 for t in thr):
        raise ValueError(f"iou_thresholds must be in (0, 1], got {iou_thresholds}")
    per_class: dict[int, dict] = {}
    for d, t in zip(detections, truths):
        scores = np.asarray(d["scores"], dtype=np.float64).ravel()
        dl = np.asarray(d["labels"]).ravel().astype(int)
        tl = np.asarray(t["labels"]).ravel().astype(int)
        if len(scores) != len(dl) or len(d["masks"]) != len(dl) or len(t["masks"]) != len(tl):
            raise ValueError("each image needs as many scores, labels and masks as detections (and labels as masks "
                             "for its true objects)")
        if not np.isfinite(scores).all():
            raise ValueError("detection scores hold NaN or inf")
        for c in set(dl.tolist()) | set(tl.tolist()):
            di, ti = np.flatnonzero(dl == c), np.flatnonzero(tl == c)
            di = di[np.argsort(-scores[di], kind="mergesort")]
            entry = per_class.setdefault(c, {"scores": [], "matched": [], "n_true": 0})
            entry["n_true"] += len(ti)
            if len(di) == 0:
                continue
            if len(ti):
                ious = mask_iou(as_cpu_tensor(d["masks"], torch.bool)[torch.from_numpy(di)],
                                as_cpu_tensor(t["masks"], torch.bool)[torch.from_numpy(ti)]).numpy()
            else:
                ious = np.zeros((len(di), 0))
            matched = np.zeros((len(thr), len(di)), dtype=bool)
            for k, th in enumerate(thr):
                taken = np.zeros(len(ti), dtype=bool)
                for r in range(len(di)):
                    best, m = min(th, 1 - 1e-10), -1
                    for g in range(len(ti)):
                        if taken[g] or ious[r, g] < best:
                            continue
                        best, m = ious[r, g], g
                    if m >= 0:
                        taken[m] = True
                        matched[k, r] = True
            entry["scores"].append(scores[di])
            entry["matched"].append(matched)
    recalls = np.linspace(0, 1, 101)
    ap = np.full((len(thr), len(per_class)), np.nan)
    classes = sorted(per_class)
    for j, c in enumerate(classes):
        e = per_class[c]
        if e["n_true"] == 0:
            continue
        if not e["scores"]:
            ap[:, j] = 0.0
            continue
        s = np.concatenate(e["scores"])
        order = np.argsort(-s, kind="mergesort")
        tps = np.concatenate(e["matched"], axis=1)[:, order]
        for k in range(len(thr)):
            tp = np.cumsum(tps[k])
            fp = np.cumsum(~tps[k])
            rc = tp / e["n_true"]
            pr = tp / np.maximum(tp + fp, np.finfo(np.float64).eps)
            pr = np.maximum.accumulate(pr[::-1])[::-1]
            idx = np.searchsorted(rc, recalls, side="left")
            q = np.where(idx < len(pr), pr[np.minimum(idx, len(pr) - 1)], 0.0)
            ap[k, j] = q.mean()
    valid = ~np.isnan(ap[0]) if len(classes) else np.zeros(0, bool)
    if not valid.any():
        raise ValueError("no true objects: segmentation AP needs at least one")
    res = {"ap": float(ap[:, valid].mean()),
           "per_threshold": {t: float(ap[k, valid].mean()) for k, t in enumerate(thr)},
           "per_class": {c: float(ap[:, j].mean()) for j, c in enumerate(classes) if valid[j]},
           "n_detections": int(sum(len(np.asarray(d["scores"]).ravel()) for d in detections)),
           "n_objects": int(sum(per_class[c]["n_true"] for c in classes))}
    if 0.5 in res["per_threshold"]:
        res["ap50"] = res["per_threshold"][0.5]
    return res


# ---------------------------------------------------------------------------------------------
# Masks moved, objects apart, text maps' top token, two maps compared
# ---------------------------------------------------------------------------------------------


def shift_masks(masks, down: int, right: int) -> torch.Tensor:
    """Move the content of ``... x H x W`` masks ``down`` and ``right`` pixels (negative: up,
    left); what enters at the border is background (False / 0)."""
    m = as_cpu_tensor(masks)
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


def object_gaps(masks) -> np.ndarray:
    """Per scene: the shortest distance in pixels between its two objects (``S x 2 x H x W``
    masks; 0 when they touch or overlap)."""
    from scipy.ndimage import distance_transform_edt

    m = np.asarray(as_cpu_tensor(masks).numpy(), dtype=bool)
    if m.ndim != 4 or m.shape[1] != 2:
        raise ValueError(f"masks must be S x 2 x H x W, got shape {m.shape}")
    out = np.empty(len(m))
    for i, (a, b) in enumerate(m):
        if not a.any() or not b.any():
            raise ValueError(f"scene {i} has an empty object mask")
        out[i] = distance_transform_edt(~a)[b].min()
    return out


def top_token_is(scores: torch.Tensor, positions, valid=None) -> np.ndarray:
    """Per row: is the highest score at ``positions[row]``? ``scores``: ``Q x L`` (NaN marks a
    position that does not count, e.g. a token :func:`text_occlusion` does not occlude);
    ``valid``: optional ``Q x L`` bool of the positions that may count. A row has a top token
    only if some position counts: rows with none (all NaN or none valid) give False, as do rows
    with ``positions`` < 0. Infinite scores are refused (``ValueError``)."""
    s = torch.as_tensor(scores, dtype=torch.float64).clone()
    if s.ndim != 2:
        raise ValueError(f"scores must be Q x L (one row per question), got shape {tuple(s.shape)}")
    if bool(torch.isinf(s).any()):
        raise ValueError("scores hold inf: a top token is undefined there; mark positions that do not count "
                         "with NaN or with valid=False")
    pos = np.asarray(positions)
    if pos.shape != (s.shape[0],):
        raise ValueError(f"positions must hold one position per row ({s.shape[0]}), got shape {pos.shape}")
    counts = ~torch.isnan(s)
    if valid is not None:
        valid = torch.as_tensor(valid, dtype=torch.bool)
        if tuple(valid.shape) != tuple(s.shape):
            raise ValueError(f"valid must be Q x L like scores, {tuple(s.shape)}, got {tuple(valid.shape)}")
        counts &= valid
    top = s.masked_fill(~counts, float("-inf")).argmax(-1).numpy()
    return (top == pos) & (pos >= 0) & counts.any(-1).numpy()


def map_change(a: torch.Tensor, b: torch.Tensor) -> dict:
    """How much map ``b`` differs from map ``a``, per question (``Q x ...`` each): ``"top_moved"``
    (bool, the highest entry is elsewhere), ``"l1"`` (the L1 distance of the two maps each
    divided by its L1 norm ``sum |m|`` -- its sum, for a non-negative map --, in [0, 2] by the
    triangle inequality, also for signed maps; 0 where both maps are 0, 1 where one is).
    Maps holding NaN or infinity are refused."""
    a, b = as_cpu_tensor(a, torch.float64).flatten(1), as_cpu_tensor(b, torch.float64).flatten(1)
    if a.shape != b.shape:
        raise ValueError(f"the maps must have the same shape, got {tuple(a.shape)} and {tuple(b.shape)}")
    _refuse_non_finite(a, "map a of question")
    _refuse_non_finite(b, "map b of question")
    # divided by sum |m|, not sum m: a signed map's sum can be 0 or negative (an L1 of 1e300 before)
    na = a / a.abs().sum(1, keepdim=True).clamp_min(1e-300)
    nb = b / b.abs().sum(1, keepdim=True).clamp_min(1e-300)
    return {"top_moved": (a.argmax(1) != b.argmax(1)).numpy(), "l1": (na - nb).abs().sum(1).numpy()}


# names that moved to vitlab.stats (vitlab 0.2): reading them here raises an error that says where they are
__getattr__ = moved_names('vitlab.localization', dict.fromkeys(("Estimate", "rate", "mean_interval", "paired_difference"), 'vitlab.stats'))
