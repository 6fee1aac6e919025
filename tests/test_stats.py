"""The intervals the chapters give with every grade (vitlab.stats.rate, mean_interval,
paired_difference): the Wilson interval against scipy's, the bootstrap against the normal
approximation where that holds."""
import numpy as np
import pytest
import torch

from vitlab import stats


def test_rate_is_the_wilson_interval():
    scipy_stats = pytest.importorskip("scipy.stats")
    for k, n in ((378, 500), (0, 40), (40, 40), (3, 7)):
        est = stats.rate([1] * k + [0] * (n - k))
        ci = scipy_stats.binomtest(k, n).proportion_ci(confidence_level=0.95, method="wilson")
        assert est.value == pytest.approx(k / n) and est.n == n
        assert est.low == pytest.approx(ci.low, abs=1e-12) and est.high == pytest.approx(ci.high, abs=1e-12)
    est = stats.rate(torch.tensor([True, False, True, True]), level=0.5)
    ci = scipy_stats.binomtest(3, 4).proportion_ci(confidence_level=0.5, method="wilson")
    assert (est.low, est.high) == pytest.approx((ci.low, ci.high), abs=1e-9)
    assert str(stats.rate([1, 1, 0, 0])) == "0.500 [0.150, 0.850]"
    with pytest.raises(ValueError, match="bools or 0/1"):
        stats.rate([0.5, 1.0])
    with pytest.raises(ValueError, match="at least one value"):
        stats.rate([])
    with pytest.raises(ValueError, match=r"level must be a number in \(0, 1\)"):
        stats.rate([1, 0], level=95)


def test_bootstrap_intervals_and_paired_differences():
    rng = np.random.default_rng(1)
    v = rng.normal(0.3, 1.0, 4000)
    est = stats.mean_interval(v)
    half = 1.96 * v.std(ddof=1) / np.sqrt(v.size)           # the normal approximation, for large n
    assert est.value == pytest.approx(v.mean()) and est.n == 4000
    assert est.low == pytest.approx(v.mean() - half, abs=0.15 * half)
    assert est.high == pytest.approx(v.mean() + half, abs=0.15 * half)
    assert stats.mean_interval(np.full(5, 0.25)) == (0.25, 0.25, 0.25, 5)
    assert stats.mean_interval(v, seed=2) != stats.mean_interval(v, seed=3)
    a = rng.random(300)
    same = stats.paired_difference(a, a)
    assert (same.value, same.low, same.high) == (0.0, 0.0, 0.0) and not same.excludes(0.0)
    shifted = stats.paired_difference(a + 0.1, a)           # a constant gap: no spread at all
    assert shifted.value == pytest.approx(0.1) and shifted.high - shifted.low < 1e-12 and shifted.excludes(0.0)
    # pairing removes what the two grades share: the paired interval is far narrower than the unpaired one
    b = a + rng.normal(0.02, 0.01, 300)
    paired = stats.paired_difference(b, a)
    unpaired_half = 1.96 * np.sqrt(a.var(ddof=1) / 300 + b.var(ddof=1) / 300)
    assert paired.high - paired.low < 0.1 * 2 * unpaired_half and paired.excludes(0.0)
    with pytest.raises(ValueError, match="one value per scene on both sides"):
        stats.paired_difference(a, a[:-1])
    with pytest.raises(ValueError, match="NaN or inf"):
        stats.mean_interval([0.1, float("nan")])


def test_unpaired_difference_resamples_each_side_on_its_own_and_estimates_print_themselves():
    rng = np.random.default_rng(4)
    a, b = rng.normal(0.5, 1.0, 3000), rng.normal(0.2, 2.0, 1000)
    est = stats.unpaired_difference(a, b)
    half = 1.96 * np.sqrt(a.var(ddof=1) / a.size + b.var(ddof=1) / b.size)  # the normal approximation, large n
    assert est.value == pytest.approx(a.mean() - b.mean()) and est.n == 4000
    assert est.low == pytest.approx(est.value - half, abs=0.1 * half)
    assert est.high == pytest.approx(est.value + half, abs=0.1 * half)
    assert stats.unpaired_difference(a, b, seed=1) == stats.unpaired_difference(a, b, seed=1)
    assert stats.unpaired_difference([0.5, 0.5], [0.25] * 3) == (0.25, 0.25, 0.25, 5)  # no spread: no width
    # against a loop: the same generator draws a's resample, then b's, n_boot times in one array each
    g = np.random.default_rng(7)
    ia, ib = g.integers(0, 4, size=(50, 4)), g.integers(0, 3, size=(50, 3))
    x, y = np.array([0.1, 0.4, 0.2, 0.9]), np.array([0.3, 0.0, 0.6])
    d = np.array([x[ia[i]].mean() - y[ib[i]].mean() for i in range(50)])
    got = stats.unpaired_difference(x, y, n_boot=50, seed=7)
    assert (got.low, got.high) == pytest.approx(tuple(np.quantile(d, [0.025, 0.975])), abs=1e-12)
    with pytest.raises(ValueError, match="NaN or inf"):
        stats.unpaired_difference([0.1, float("nan")], [0.2])
    with pytest.raises(ValueError, match="at least one value"):
        stats.unpaired_difference([], [0.2])
    e = stats.Estimate(0.37, 0.34, 0.4, 10)
    assert str(e) == e.format() == "0.370 [0.340, 0.400]"
    assert stats.Estimate(-0.0123, -0.05, 0.026, 3).format("+.2f") == "-0.01 [-0.05, +0.03]"


def test_where_defined_keeps_the_scenes_every_grade_has():
    a = np.array([0.1, np.nan, 0.3, 0.4, np.nan])
    b = torch.tensor([1.0, 2.0, float("nan"), 4.0, 5.0])
    ka, kb = stats.where_defined(a, b)
    assert ka.tolist() == [0.1, 0.4] and kb.tolist() == [1.0, 4.0]
    d = stats.paired_difference(*stats.where_defined(a, b))
    assert d.n == 2 and d.value == pytest.approx(np.mean([0.1 - 1.0, 0.4 - 4.0]))
    (only,) = stats.where_defined(a)
    assert only.tolist() == [0.1, 0.3, 0.4]
    with pytest.raises(ValueError, match="one value per scene"):
        stats.where_defined(a, b[:3])
    with pytest.raises(ValueError, match="infinite"):
        stats.where_defined([0.1, float("inf")])
    with pytest.raises(ValueError, match="at least one grade"):
        stats.where_defined()


def test_choose_setting_keeps_the_default_unless_another_is_better_beyond_noise():
    rng = np.random.default_rng(3)
    base = rng.random(400) < 0.6
    noisy = base.copy()
    noisy[rng.choice(400, 6, replace=False)] = True          # a few more hits: within the noise
    clearly = base | (rng.random(400) < 0.5)                  # many more hits
    worse = base & (rng.random(400) < 0.5)
    assert stats.choose_setting({"paper": base, "other": noisy}, "paper") == "paper"
    assert stats.choose_setting({"paper": base, "other": clearly, "worse": worse}, "paper") == "other"
    assert stats.choose_setting({"paper": clearly, "other": base}, "paper") == "paper"
    assert stats.choose_setting({"paper": base}, "paper") == "paper"
    # the rule is the paired interval: exactly when its low end is above 0
    d = stats.paired_difference(noisy, base)
    assert d.low <= 0 < d.value
    with pytest.raises(ValueError, match="default"):
        stats.choose_setting({"a": base}, "b")


def test_groups_resample_whole_scenes():
    rng = np.random.default_rng(4)
    # 400 scenes, each giving 1-3 values that share the scene's level: the values are not independent
    level = rng.normal(0.0, 1.0, 400)
    k = rng.integers(1, 4, 400)
    groups = np.repeat(np.arange(400), k)
    v = np.repeat(level, k) + rng.normal(0.0, 0.05, groups.size)
    est = stats.mean_interval(v, groups=groups)
    assert est.value == pytest.approx(v.mean()) and est.n == 400
    # the interval of a ratio of sums over scenes (the delta method), computed independently
    sums, counts = np.bincount(groups, weights=v), np.bincount(groups)
    resid = sums - v.mean() * counts
    half = 1.96 * np.sqrt((resid ** 2).sum()) / counts.sum()
    assert est.low == pytest.approx(v.mean() - half, abs=0.15 * half)
    assert est.high == pytest.approx(v.mean() + half, abs=0.15 * half)
    naive = stats.mean_interval(v)                       # as if the values were independent: too narrow
    assert (naive.high - naive.low) < 0.8 * (est.high - est.low)
    # one value per scene: the grouped bootstrap is the plain one (same draws)
    w = rng.random(50)
    plain, grouped = stats.mean_interval(w), stats.mean_interval(w, groups=np.arange(50))
    assert grouped.n == plain.n == 50
    assert (grouped.low, grouped.high) == pytest.approx((plain.low, plain.high), abs=1e-12)
    # labels need not be numbers (only their order matters to the draws); paired differences pass them on
    labels = np.array([f"scene {g:04d}" for g in groups])
    assert stats.mean_interval(v, groups=labels)[1:] == pytest.approx(est[1:], abs=1e-12)
    d = stats.paired_difference(v + 0.1, v, groups=groups)
    assert d.value == pytest.approx(0.1) and d.high - d.low < 1e-9 and d.n == 400
    with pytest.raises(ValueError, match="one label per value"):
        stats.mean_interval(v, groups=groups[:-1])


def test_unpaired_difference():
    rng = np.random.default_rng(5)
    a, b = rng.normal(0.5, 1.0, 3000), rng.normal(0.3, 2.0, 2000)
    est = stats.unpaired_difference(a, b)
    half = 1.96 * np.sqrt(a.var(ddof=1) / a.size + b.var(ddof=1) / b.size)   # the normal approximation
    assert est.value == pytest.approx(a.mean() - b.mean()) and est.n == 5000
    assert est.low == pytest.approx(est.value - half, abs=0.15 * half)
    assert est.high == pytest.approx(est.value + half, abs=0.15 * half)
    same = stats.unpaired_difference(np.full(10, 0.7), np.full(20, 0.2))
    assert same == pytest.approx((0.5, 0.5, 0.5, 30))
    ga = np.repeat(np.arange(100), 3)
    grouped = stats.unpaired_difference(np.repeat(rng.normal(0, 1, 100), 3), b, groups_a=ga)
    assert grouped.n == 100 + b.size
    with pytest.raises(ValueError, match="one label per value"):
        stats.unpaired_difference(a, b, groups_b=np.arange(3))
