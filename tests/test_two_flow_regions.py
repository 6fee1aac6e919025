"""The two-flow pattern's regions (vitlab.attention.two_flow_regions) against the definition in
plain Python, and vitlab.stats.hypergeometric_cdf -- the exact null of shuffling one region's
places -- against scipy and against shuffles drawn one by one."""
import numpy as np
import pytest
import torch

from vitlab import stats
from vitlab.attention import two_flow_regions, two_flow_score


def test_regions_follow_the_definition():
    g = torch.Generator().manual_seed(3)
    q, k = torch.randn(2, 16, 5, generator=g), torch.randn(2, 16, 5, generator=g)
    r = two_flow_regions(q, k)
    assert r.gather.shape == r.broadcast.shape == (2, 16, 5) and r.gather.dtype == torch.bool
    for b, c in np.ndindex(2, 5):
        qq, kk = q[b, :, c].tolist(), k[b, :, c].tolist()
        m = 1.0 if sum(qq) > 0 else -1.0
        assert r.gather[b, :, c].tolist() == [v * m < 0 for v in qq]
        assert r.broadcast[b, :, c].tolist() == [v * m > 0 for v in kk]
    # the score's last factor is the regions' overlap: regions that coincide score 0
    q1 = torch.tensor([[-1.0], [-1.0], [1.0], [1.0], [-1.0], [-1.0]])
    assert float(two_flow_score(q1, -q1)) == 0.0
    with pytest.raises(ValueError, match="same P patches"):
        two_flow_regions(q, k[:, :8])


def test_hypergeometric_cdf_against_scipy_and_shuffles():
    hyper = pytest.importorskip("scipy.stats").hypergeom
    N = 40
    for K, n in ((12, 5), (30, 25), (0, 7), (40, 3), (17, 17)):
        k = np.arange(-1, n + 2)
        got = stats.hypergeometric_cdf(k, N, K, n)
        assert got == pytest.approx(hyper.cdf(k, N, K, n), abs=1e-12)
    # arrays broadcast together (one channel per entry)
    got = stats.hypergeometric_cdf(torch.tensor([0, 2, 5]), N, torch.tensor([10, 20, 30]), 6)
    assert got == pytest.approx(hyper.cdf([0, 2, 5], N, [10, 20, 30], 6), abs=1e-12)
    # it is the null of shuffling: a region of 9 places moved at random over 40, another of 15 fixed
    rng = np.random.default_rng(0)
    fixed = np.zeros(N, dtype=bool)
    fixed[:15] = True
    overlaps = np.array([fixed[rng.permutation(N)[:9]].sum() for _ in range(20000)])
    for k in range(0, 7):
        assert stats.hypergeometric_cdf(k, N, 15, 9) == pytest.approx((overlaps <= k).mean(), abs=0.012)
    with pytest.raises(ValueError, match="0 <= marked, drawn <= total"):
        stats.hypergeometric_cdf(1, 10, 11, 2)
    with pytest.raises(ValueError, match="whole numbers"):
        stats.hypergeometric_cdf(1.5, 10, 3, 2)
