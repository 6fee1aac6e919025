"""Uncertainty of a measurement over a sample of scenes (or questions, images, ...).

- :func:`rate` -- a hit rate with its Wilson score interval;
- :func:`mean_interval` -- a mean with its percentile bootstrap interval (:func:`bootstrap`);
- :func:`paired_difference` -- two measurements of the same scenes, the mean difference with the
  bootstrap interval of the scenes resampled together;
- :func:`hypergeometric_cdf` -- the exact chance of an overlap as small as the one seen between
  two sets placed at random (the null of a shuffle that keeps their sizes);
- :func:`unpaired_difference` -- two measurements of different scenes (two groups of a split),
  the difference of their means with the bootstrap interval of each group resampled on its own;

where one scene gives several values (a detector's detections), ``groups`` names each value's
scene and the scenes, not the values, are resampled;

each an :class:`Estimate`, which prints itself as ``0.370 [0.340, 0.400]``. These are vitlab's only
intervals: the leaderboard (:func:`vitlab.evaluate.summarize`), the removal test of chapter 7, the
bi-modal perturbation tests and the CLIP training report all call them. Two helpers grade on a
sample:

- :func:`where_defined` -- the scenes where every grade is defined (e.g. SaCo, undefined for a
  constant map), so that a paired difference compares the same scenes;
- :func:`choose_setting` -- a setting (a block range, a threshold) chosen by a rule declared in
  advance: the default unless another is better beyond the noise, measured on scenes kept apart
  from the graded ones.
"""
from __future__ import annotations

import math
import numbers
from typing import NamedTuple

import numpy as np
import torch

from vitlab.inputs import positive_int, seed_int


class Estimate(NamedTuple):
    """A measured value with its 95% (or ``level``) interval over the scenes: ``value``,
    ``low``, ``high`` and ``n`` (scenes). ``str()`` gives ``"0.756 [0.717, 0.792]"``."""

    value: float
    low: float
    high: float
    n: int

    def __str__(self) -> str:
        return self.format()

    def format(self, spec: str = ".3f") -> str:
        """``value [low, high]``, each number formatted with ``spec`` (``"+.3f"`` for a difference,
        ``".2f"`` for fewer digits)."""
        return f"{self.value:{spec}} [{self.low:{spec}}, {self.high:{spec}}]"

    def excludes(self, v: float = 0.0) -> bool:
        """Whether ``v`` lies outside the interval (for a difference: it is not a tie)."""
        return v < self.low or v > self.high


def _level(level) -> float:
    # numbers.Real: also numpy's floats (np.float32(0.9) is a level like 0.9)
    if isinstance(level, bool) or not isinstance(level, numbers.Real) or not 0.0 < float(level) < 1.0:
        raise ValueError(f"level must be a number in (0, 1), got {level!r}")
    return float(level)


def _values(values, what: str) -> np.ndarray:
    v = np.asarray(values.detach().cpu() if isinstance(values, torch.Tensor) else values, dtype=np.float64).ravel()
    if v.size == 0:
        raise ValueError(f"{what} needs at least one value, got none")
    if not np.isfinite(v).all():
        raise ValueError(f"{what} got NaN or inf among its {v.size} values; drop the scenes where the grade is undefined")
    return v


def rate(hits, level: float = 0.95) -> Estimate:
    """The share of hits (one bool or 0/1 per scene, e.g. :func:`pointing_game`) with its Wilson
    score interval (Wilson 1927): the rates p whose binomial test would not reject the observed
    count, ``(k + z^2/2 +- z sqrt(k (n - k) / n + z^2 / 4)) / (n + z^2)``, with ``z`` the normal
    quantile of ``level``. Unlike ``p +- z * SE`` it stays inside [0, 1] and keeps its width near
    0 and 1."""
    z = _normal_quantile(_level(level))
    v = _values(hits, "rate")
    if not np.isin(v, (0.0, 1.0)).all():
        raise ValueError("rate needs hits (bools or 0/1), got other values; use mean_interval for a mean")
    n, k = v.size, float(v.sum())
    centre = (k + z * z / 2) / (n + z * z)
    half = z * math.sqrt(k * (n - k) / n + z * z / 4) / (n + z * z)
    return Estimate(k / n, max(0.0, centre - half), min(1.0, centre + half), n)


def mean_interval(values, level: float = 0.95, n_boot: int = 2000, seed: int = 0, groups=None) -> Estimate:
    """The mean of per-scene ``values`` with its percentile bootstrap interval (Efron 1979):
    the scenes are resampled with replacement ``n_boot`` times (a generator seeded with
    ``seed``, an int >= 0: the same seed, the same interval; ``None`` is refused), the mean is
    taken each time, and the interval is the middle ``level`` of those means.

    ``groups``: one label per value (e.g. the scene of each detection) when a scene gives
    several values that are not independent; then whole scenes are resampled (the cluster
    bootstrap, Davison & Hinkley 1997, sec. 3.8), the mean is over all values of the drawn
    scenes, and ``n`` counts the scenes."""
    lv = _level(level)
    positive_int("n_boot", n_boot)
    v = _values(values, "mean_interval")
    if groups is None:
        low, high = bootstrap(v, lv, n_boot, seed)
        return Estimate(float(v.mean()), low, high, int(v.size))
    sums, counts = _group_sums(v, groups, "mean_interval")
    low, high = _cluster_bootstrap(sums, counts, lv, n_boot, seed)
    return Estimate(float(v.mean()), low, high, int(sums.size))


def _group_sums(v: np.ndarray, groups, what: str) -> tuple[np.ndarray, np.ndarray]:
    g = np.asarray(groups.detach().cpu() if isinstance(groups, torch.Tensor) else groups).ravel()
    if g.shape != v.shape:
        raise ValueError(f"{what}: groups needs one label per value, got {g.size} labels for {v.size} values")
    _, index = np.unique(g, return_inverse=True)
    return np.bincount(index, weights=v), np.bincount(index).astype(np.float64)


def _cluster_bootstrap(sums: np.ndarray, counts: np.ndarray, level: float, n_boot: int,
                       seed: int) -> tuple[float, float]:
    """The percentile bootstrap of a mean over groups: ``n_boot`` draws of as many groups as
    there are, with replacement, each giving (sum of the drawn groups' values) / (their count)."""
    rng = np.random.default_rng(seed_int("seed", seed))
    draw = rng.integers(0, sums.size, size=(n_boot, sums.size))
    means = sums[draw].sum(1) / counts[draw].sum(1)
    low, high = np.quantile(means, [(1 - level) / 2, (1 + level) / 2])
    return float(low), float(high)


def bootstrap(v: np.ndarray, level: float, n_boot: int, seed: int) -> tuple[float, float]:
    """The percentile bootstrap of the mean of checked float64 ``v``: ``n_boot`` resamples with
    replacement drawn by ``np.random.default_rng(seed)``, the middle ``level`` of their means.
    The one resampling behind every interval of a mean in vitlab."""
    rng = np.random.default_rng(seed_int("seed", seed))   # None (fresh entropy) refused: reproducible
    means = v[rng.integers(0, v.size, size=(n_boot, v.size))].mean(1)
    low, high = np.quantile(means, [(1 - level) / 2, (1 + level) / 2])
    return float(low), float(high)


def paired_difference(a, b, level: float = 0.95, n_boot: int = 2000, seed: int = 0, groups=None) -> Estimate:
    """``a - b`` for two grades of the *same* scenes (per-scene values or hits, in the same
    order): the mean difference with the bootstrap interval of :func:`mean_interval`, the
    scenes resampled together, so what the two share cancels. An interval that holds 0 is a
    tie on these scenes. ``groups``: as in :func:`mean_interval` (whole scenes resampled)."""
    shapes = [tuple(v.shape) if isinstance(v, torch.Tensor) else np.shape(v) for v in (a, b)]
    if shapes[0] != shapes[1]:          # compared before flattening: a 2 x 3 and a 3 x 2 are not paired
        raise ValueError(f"paired_difference needs one value per scene on both sides, in the same layout (the "
                         f"same scenes in the same order), got shapes {shapes[0]} and {shapes[1]}")
    va, vb = _values(a, "paired_difference"), _values(b, "paired_difference")
    return mean_interval(va - vb, level, n_boot, seed, groups)


def unpaired_difference(a, b, level: float = 0.95, n_boot: int = 2000, seed: int = 0,
                        groups_a=None, groups_b=None) -> Estimate:
    """``mean(a) - mean(b)`` for grades of *different* scenes (e.g. the scenes of a split): the
    two samples are resampled each on its own (``groups_a`` / ``groups_b`` as ``groups`` in
    :func:`mean_interval`), the difference of their means taken ``n_boot`` times, and the
    interval is the middle ``level`` of those differences. Nothing cancels, so it is wider than
    a paired interval on the same numbers would be. ``n`` counts the scenes of both."""
    lv = _level(level)
    positive_int("n_boot", n_boot)
    va, vb = _values(a, "unpaired_difference"), _values(b, "unpaired_difference")
    rng = np.random.default_rng(seed_int("seed", seed))
    means, n = [], 0
    for v, g in ((va, groups_a), (vb, groups_b)):
        sums, counts = (v, np.ones_like(v)) if g is None else _group_sums(v, g, "unpaired_difference")
        draw = rng.integers(0, sums.size, size=(n_boot, sums.size))
        means.append(sums[draw].sum(1) / counts[draw].sum(1))
        n += sums.size
    low, high = np.quantile(means[0] - means[1], [(1 - lv) / 2, (1 + lv) / 2])
    return Estimate(float(va.mean() - vb.mean()), float(low), float(high), n)


def hypergeometric_cdf(k, total: int, marked, drawn) -> np.ndarray:
    """P(X <= k) for X the number of marked items among ``drawn`` items taken at random without
    replacement from ``total`` items of which ``marked`` are marked (the hypergeometric law).
    This is the exact chance of an overlap as small as ``k`` between two sets of sizes
    ``marked`` and ``drawn`` placed at random among ``total`` places, the counts kept (what
    shuffling one of them over the places gives). ``k``, ``marked``, ``drawn``: integers or
    arrays of them (broadcast together); ``P(X >= k)`` is ``1 - hypergeometric_cdf(k - 1, ...)``.
    Computed in float64 from log-binomials."""
    to = lambda a: np.asarray(a.detach().cpu() if isinstance(a, torch.Tensor) else a)  # noqa: E731
    k, K, n = np.broadcast_arrays(to(k), to(marked), to(drawn))
    N = positive_int("total", total)
    if not all(np.issubdtype(a.dtype, np.integer) or a.size == 0 for a in (k, K, n)):
        k, K, n = (a.astype(np.float64) for a in (k, K, n))
        if any((a != np.round(a)).any() for a in (k, K, n)):
            raise ValueError("hypergeometric_cdf needs whole numbers for k, marked and drawn")
    k, K, n = (a.astype(np.int64) for a in (k, K, n))
    if (K < 0).any() or (n < 0).any() or (K > N).any() or (n > N).any():
        raise ValueError(f"hypergeometric_cdf needs 0 <= marked, drawn <= total={N}")
    lchoose = lambda a, b: (math.lgamma(a + 1) - math.lgamma(b + 1) - math.lgamma(a - b + 1))  # noqa: E731
    out = np.empty(k.shape, dtype=np.float64)
    for idx in np.ndindex(k.shape):
        kk, KK, nn = int(k[idx]), int(K[idx]), int(n[idx])
        lo, hi = max(0, nn - (N - KK)), min(KK, nn)
        terms = [math.exp(lchoose(KK, i) + lchoose(N - KK, nn - i) - lchoose(N, nn)) for i in range(lo, min(kk, hi) + 1)]
        out[idx] = min(1.0, sum(terms)) if kk < hi else 1.0
    return out


def where_defined(*grades) -> tuple[np.ndarray, ...]:
    """The grades (one value per scene each, the same scenes in the same order) restricted to the
    scenes where none is NaN, as float64 arrays: ``paired_difference(*where_defined(a, b))``
    compares two methods on the scenes both can be graded on, and its ``n`` says how many those
    are. An infinite value is refused (it is not "undefined", it is a fault)."""
    if not grades:
        raise ValueError("where_defined needs at least one grade")
    vs = [np.asarray(g.detach().cpu() if isinstance(g, torch.Tensor) else g, dtype=np.float64).ravel() for g in grades]
    if len({v.size for v in vs}) != 1:
        raise ValueError(f"where_defined needs one value per scene in every grade, got sizes {[v.size for v in vs]}")
    if any(np.isinf(v).any() for v in vs):
        raise ValueError("where_defined got an infinite grade: only NaN marks a scene that cannot be graded")
    ok = ~np.any([np.isnan(v) for v in vs], axis=0)
    return tuple(v[ok] for v in vs)


def choose_setting(hits: dict, default, level: float = 0.95) -> object:
    """A setting chosen by a rule declared before looking: keep ``default`` unless the best other
    setting (the highest mean of ``hits[setting]``, per-scene grades, higher is better) beats it
    beyond the noise, i.e. its :func:`paired_difference` over the default has its interval above
    0. Give it scenes the graded ones do not include: a setting chosen on the graded scenes
    favours itself."""
    if default not in hits:
        raise ValueError(f"choose_setting: the default {default!r} is not among the settings {list(hits)}")
    others = [k for k in hits if k != default]
    if not others:
        return default
    best = max(others, key=lambda k: float(np.mean(_values(hits[k], "choose_setting"))))
    return best if paired_difference(hits[best], hits[default], level).low > 0 else default


def _normal_quantile(level: float) -> float:
    """z with P(|N(0, 1)| <= z) = level (bisection on erf; no scipy needed)."""
    lo, hi = 0.0, 10.0
    for _ in range(200):
        mid = (lo + hi) / 2
        if math.erf(mid / math.sqrt(2)) < level:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2
