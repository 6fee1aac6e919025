"""SaCo (Wu et al. 2024) and Chefer's perturbation curves: hand-worked cases, fake models with
known per-pixel effects, an independent loop implementation, batch = items, model unchanged."""
import math

import numpy as np
import pytest
import torch
from torch import nn

from conftest import (
    TINY, TINY_DEPTH, assert_model_unchanged, decided_argmax, f32_rel, f32_tol, f64_tol, model_snapshot, randomize,
)  # noqa: F401
from references import forwards_counted
from vitlab import faithfulness as fa

pytestmark = pytest.mark.usefixtures("one_thread")


# SaCo compares group drops (d_i >= d_j): the method and the loop (or a batch and its items) agree
# exactly only away from rounding ties, so those checks run the tiny ViT in float64 (conftest's vit64), whose logits are
# then the same on every CPU to ~1e-16 (the method reads them rounded to float32, the loop in float64:
# the comparisons agree unless two drops tie within 1e-7). SaCo (|.| <= 1) is returned in float32:
# one rounding.
SACO_TOL = f32_tol(1.0, 1)
# LinearProb's probability: a sum over 64 pixels, then log, softmax and exp (a few roundings each)
LINEAR_DEPTH = 64 + 8


class LinearProb(nn.Module):
    """Two classes; p(class 0) = u = c + sum_p w_p x[0, p] (weights small so u stays in (0, 1)).

    Replacing pixel p of channel 0 by m changes p(class 0) by w_p (m - x_p): drops are known.
    In train mode class 0 gets +5 on its logit, so a run that forgot eval mode is visible.
    """

    def __init__(self, w: torch.Tensor, c: float = 0.5):
        super().__init__()
        self.w = nn.Parameter(w.clone())
        self.c = c
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        u = (self.c + (x[:, 0] * self.w).flatten(1).sum(1)).clamp(1e-6, 1 - 1e-6)
        logits = torch.stack([u.log(), (1 - u).log()], dim=1)
        if self.training:
            logits = logits + torch.tensor([5.0, 0.0])
        return logits


class Counting(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model
        self.calls = 0
        self.sizes = []

    def forward(self, x):
        self.calls += 1
        self.sizes.append(x.shape[0])
        return self.model(x)


def linear_case(B=2, H=8, W=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, 3, H, W, generator=g)
    w = torch.randn(H, W, generator=g) * 0.002
    return LinearProb(w), x


def true_effect(model, x):
    """Per pixel: p(class 0 | x) - p(class 0 | x with that pixel at the channel mean), exactly
    linear for LinearProb: w_p (x_p - mean)."""
    m = x[:, 0].mean(dim=(1, 2), keepdim=True)
    return model.w.detach() * (x[:, 0] - m)


# --- the pure coefficient ------------------------------------------------------------------


def test_saco_from_drops_hand_worked():
    # s = 3, 2, 1; d = 0.3, 0.1, 0.2: pairs (1,2) agree w=1, (1,3) agree w=2, (2,3) violate w=-1
    assert float(fa.saco_from_drops([0.3, 0.1, 0.2], [3.0, 2.0, 1.0])) == pytest.approx((1 + 2 - 1) / 4)
    # perfectly ordered -> 1, reversed -> -1
    assert float(fa.saco_from_drops([0.5, 0.4, 0.1, 0.0], [4.0, 3.0, 2.0, 1.0])) == pytest.approx(1.0)
    assert float(fa.saco_from_drops([0.0, 0.1, 0.4, 0.5], [4.0, 3.0, 2.0, 1.0])) == pytest.approx(-1.0)
    # equal drops count as agreeing (d_i >= d_j)
    assert float(fa.saco_from_drops([0.2, 0.2], [2.0, 1.0])) == pytest.approx(1.0)
    # batched rows = rows one by one
    d = torch.rand(5, 6, generator=torch.Generator().manual_seed(1))
    s = torch.rand(5, 6, generator=torch.Generator().manual_seed(2))
    rows = torch.stack([fa.saco_from_drops(d[i], s[i]) for i in range(5)])
    torch.testing.assert_close(fa.saco_from_drops(d, s), rows)


def test_saco_from_drops_matches_pair_loop():
    rng = np.random.default_rng(3)
    for _ in range(20):
        K = int(rng.integers(2, 12))
        d, s = rng.normal(size=K), rng.normal(size=K)
        num = den = 0.0
        for i in range(K):
            for j in range(i + 1, K):
                w = s[i] - s[j] if d[i] >= d[j] else -(s[i] - s[j])
                num += w
                den += abs(w)
        assert float(fa.saco_from_drops(d, s)) == pytest.approx(num / den, abs=1e-12)


def test_saco_from_drops_errors():
    with pytest.raises(ValueError, match="same salience"):
        fa.saco_from_drops([0.3, 0.1, 0.2], [1.0, 1.0, 1.0])
    with pytest.raises(ValueError, match="K or B x K"):
        fa.saco_from_drops([0.3, 0.1], [1.0, 1.0, 1.0])
    with pytest.raises(ValueError, match="finite"):
        fa.saco_from_drops([0.3, float("nan")], [1.0, 2.0])


def test_random_salience_averages_near_zero():
    g = torch.Generator().manual_seed(4)
    d, s = torch.rand(4000, 10, generator=g), torch.rand(4000, 10, generator=g)
    assert abs(float(fa.saco_from_drops(d, s).mean())) < 0.02


# --- groups ------------------------------------------------------------------------------


def test_pixel_groups_follow_array_split_of_a_stable_descending_order():
    g = torch.Generator().manual_seed(5)
    sal = torch.randint(0, 4, (2, 5, 7), generator=g).float()  # many ties
    groups = fa.pixel_groups(sal, 4)
    for b in range(2):
        flat = sal[b].flatten().numpy()
        order = np.argsort(-flat, kind="stable")
        expect = np.empty(flat.size, int)
        for gi, part in enumerate(np.array_split(order, 4)):
            expect[part] = gi
        np.testing.assert_array_equal(groups[b].flatten().numpy(), expect)
    with pytest.raises(ValueError, match="k must be"):
        fa.pixel_groups(sal, 1)


# --- saco on models ----------------------------------------------------------------------


def loop_saco(model, x, saliency, target, k, prob=lambda z: torch.softmax(z, -1)):
    """Independent reference: one sample, one group at a time, numpy grouping."""
    out = []
    model.eval()
    with torch.no_grad():
        for b in range(x.shape[0]):
            s = saliency[b]
            if s.shape != x.shape[-2:]:
                s = torch.nn.functional.interpolate(s[None, None], size=x.shape[-2:], mode="bilinear",
                                                    align_corners=False)[0, 0]
            flat = s.flatten().double().numpy()
            parts = np.array_split(np.argsort(-flat, kind="stable"), k)
            xb = x[b]
            z0 = model(xb[None]).double()
            p0 = prob(z0)[0]
            t = int(z0.argmax()) if target is None else int(target[b])
            mean = xb.mean(dim=(1, 2))
            d, sums = [], []
            for part in parts:
                xp = xb.clone().reshape(3, -1)
                xp[:, torch.as_tensor(part)] = mean[:, None]
                p = prob(model(xp.reshape(xb.shape)[None]).double())[0, t]
                d.append(float(p0[t] - p))
                sums.append(flat[part].sum())
            num = den = 0.0
            for i in range(k):
                for j in range(i + 1, k):
                    w = sums[i] - sums[j] if d[i] >= d[j] else -(sums[i] - sums[j])
                    num, den = num + w, den + abs(w)
            out.append(num / den)
    return torch.tensor(out)


@pytest.mark.parametrize("grid", [True, False])
def test_saco_equals_independent_loop(vit64, x64, grid):
    vit, x = vit64, x64
    g = torch.Generator().manual_seed(6)
    sal = torch.rand(3, 4, 4, generator=g) if grid else torch.rand(3, 32, 32, generator=g)
    got = fa.saco(vit, x, sal, k=5, batch_size=7)
    torch.testing.assert_close(got.double(), loop_saco(vit, x, sal, None, 5).double(), **SACO_TOL)
    tgt = [1, 4, 0]
    torch.testing.assert_close(fa.saco(vit, x, sal, target=tgt, k=5, batch_size=4).double(),
                               loop_saco(vit, x, sal, tgt, 5).double(), **SACO_TOL)


def test_saco_map_equal_to_true_effect_is_one_and_reverse_minus_one():
    model, x = linear_case()
    effect = true_effect(model, x)
    res = fa.saco_details(model, x, effect, target=0, k=8)
    # group drops are exactly the group sums of the true effect (two float32 probabilities apart)
    torch.testing.assert_close(res.drops, res.sums, **f32_tol(1.0, LINEAR_DEPTH))
    torch.testing.assert_close(res.saco, torch.ones(2))
    torch.testing.assert_close(fa.saco(model, x, -effect, target=0, k=8), -torch.ones(2))
    # other maps score lower: random maps, and the effect's magnitude (sign lost)
    g = torch.Generator().manual_seed(0)
    others = torch.stack([fa.saco(model, x, torch.rand(effect.shape, generator=g), target=0, k=8) for _ in range(10)])
    assert (others < 1).all()
    assert (fa.saco(model, x, effect.abs(), target=0, k=8) < 1).all()


def test_saco_batch_equals_items(vit64, x64):
    vit, x = vit64, x64
    sal = torch.rand(3, 4, 4, generator=torch.Generator().manual_seed(8))
    whole = fa.saco(vit, x, sal, k=6, batch_size=5)
    items = torch.cat([fa.saco(vit, x[i:i + 1], sal[i:i + 1], k=6) for i in range(3)])
    torch.testing.assert_close(whole, items, **SACO_TOL)


@pytest.mark.parametrize("B,k,chunk", [(3, 4, 5), (2, 10, 64), (3, 5, 1)])
def test_saco_forward_count(vit, x, B, k, chunk):
    model = Counting(vit)
    sal = torch.rand(B, 4, 4, generator=torch.Generator().manual_seed(9))
    fa.saco(model, x[:B], sal, k=k, batch_size=chunk)
    assert model.calls == math.ceil((k + 1) * B / chunk)
    assert sum(model.sizes) == (k + 1) * B and max(model.sizes) <= chunk


def test_saco_errors(vit, x):
    with pytest.raises(ValueError, match="constant"):
        fa.saco(vit, x, torch.ones(3, 4, 4))
    nan = torch.rand(3, 4, 4)
    nan[1, 2, 2] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        fa.saco(vit, x, nan)
    for bad in (torch.rand(2, 4, 4), torch.rand(3, 16), torch.rand(3, 1, 4, 4), torch.rand(3, 64, 64)):
        with pytest.raises(ValueError, match="saliency"):
            fa.saco(vit, x, bad)
    with pytest.raises(ValueError, match="target"):
        fa.saco(vit, x, torch.rand(3, 4, 4), target=[0, 1])
    with pytest.raises(ValueError, match="outside"):
        fa.saco(vit, x, torch.rand(3, 4, 4), target=7)
    with pytest.raises(ValueError, match="batch_size"):
        fa.saco(vit, x, torch.rand(3, 4, 4), batch_size=0)


def test_model_unchanged_and_run_in_eval(vit, x):
    before = model_snapshot(vit)
    sal = torch.rand(3, 4, 4)
    fa.saco(vit, x, sal, k=4)
    fa.perturbation_curve(vit, x, sal, replacement="blur")
    assert_model_unchanged(vit, before)

    # a model in train mode (mixed per module) gets eval inside and its modes back after
    model, xs = linear_case()
    model.train()
    sub = nn.Identity().eval()
    model.sub = sub
    eff = true_effect(model, xs)
    assert torch.equal(fa.saco(model, xs, eff, target=0, k=4), torch.ones(2))
    curve = fa.perturbation_curve(model, xs, eff, target=0)
    model.eval()
    torch.testing.assert_close(curve.probability,
                               fa.perturbation_curve(model, xs, eff, target=0).probability)
    model.train()
    model.sub.eval()
    before = model_snapshot(model)
    fa.saco(model, xs, eff, target=0, k=4)
    model.calls = before["modules"][""][1]["calls"]  # the test model's own forward counter
    assert_model_unchanged(model, before)
    assert model.training and not model.sub.training


# --- perturbation curves -----------------------------------------------------------------


def test_curve_fraction_zero_is_plain_probability(vit, x):
    sal = torch.rand(3, 4, 4, generator=torch.Generator().manual_seed(10))
    with torch.no_grad():
        logits = vit(x)
    p = torch.softmax(logits, -1)
    c = fa.perturbation_curve(vit, x, sal, batch_size=7)
    assert c.probability.shape == (3, 10) and c.correct.shape == (3, 10)
    torch.testing.assert_close(c.target, decided_argmax(logits, f32_tol(logits, TINY_DEPTH)["atol"]))
    tol = f32_tol(1.0, TINY_DEPTH)  # probabilities of another forward of the same images
    torch.testing.assert_close(c.probability[:, 0], p.max(-1).values, **tol)
    assert c.correct[:, 0].all()
    c1 = fa.perturbation_curve(vit, x, sal, target=2)
    torch.testing.assert_close(c1.probability[:, 0], p[:, 2], **tol)
    torch.testing.assert_close(c1.correct[:, 0], logits.argmax(-1) == 2)


def test_curve_positive_vs_negative_on_known_region():
    # p(class 0) rises with the top-left quarter's channel 0 only; inputs bright there
    H = W = 8
    w = torch.zeros(H, W)
    w[:4, :4] = 0.01
    model = LinearProb(w, c=0.3)
    x = torch.zeros(2, 3, H, W)
    x[:, 0, :4, :4] = 3.0
    sal = torch.zeros(2, H, W)
    sal[:, :4, :4] = 1.0
    sal += torch.linspace(0, 0.1, H * W).reshape(H, W)  # break ties within regions
    pos = fa.perturbation_curve(model, x, sal, target=0, positive=True, replacement="zero")
    neg = fa.perturbation_curve(model, x, sal, target=0, positive=False, replacement="zero")
    # positive removes the 16 important pixels first: by 0.3 (19 pixels) all are gone
    p_clean = 0.3 + 16 * 0.03
    tol = f32_tol(1.0, LINEAR_DEPTH)
    torch.testing.assert_close(pos.probability[:, 0], torch.full((2,), p_clean), **tol)
    torch.testing.assert_close(pos.probability[:, 3], torch.full((2,), 0.3), **tol)
    # negative removes the 48 unimportant pixels first: unchanged up to 0.7 (44 pixels)
    torch.testing.assert_close(neg.probability[:, :8], torch.full((2, 8), p_clean), **tol)
    assert (pos.auc < neg.auc).all()
    # exact values at 0.1 (6 pixels) and 0.2 (12 pixels) for the positive order
    torch.testing.assert_close(pos.probability[:, 1], torch.full((2,), p_clean - 6 * 0.03), **tol)
    torch.testing.assert_close(pos.probability[:, 2], torch.full((2,), p_clean - 12 * 0.03), **tol)
    # top-1 correctness: class 0 wins while p > 0.5
    torch.testing.assert_close(pos.correct, pos.probability > 0.5)


def test_curve_auc_by_hand_and_replacements(vit, x):
    sal = torch.rand(3, 4, 4, generator=torch.Generator().manual_seed(11))
    fr = (0.0, 0.25, 0.5, 0.9)
    for rep in fa.REPLACEMENTS:
        c = fa.perturbation_curve(vit, x, sal, fractions=fr, replacement=rep, batch_size=5)
        p = c.probability.numpy()
        by_hand = [sum((p[b, i] + p[b, i + 1]) / 2 * (fr[i + 1] - fr[i]) for i in range(3)) for b in range(3)]
        # the same probabilities: 3 trapezoids (a sum, a product each) in float32 against float64
        np.testing.assert_allclose(c.auc.numpy(), by_hand, **f32_tol(1.0, 3 * 3))
        acc = c.correct.float().numpy()
        by_hand = [sum((acc[b, i] + acc[b, i + 1]) / 2 * (fr[i + 1] - fr[i]) for i in range(3)) for b in range(3)]
        np.testing.assert_allclose(c.auc_accuracy.numpy(), by_hand, **f32_tol(1.0, 3 * 3))


def test_curve_replacement_values():
    """What the model sees: count pixels replaced, and their values, per replacement."""
    seen = []

    class Spy(nn.Module):
        def forward(self, x):
            seen.append(x.clone())
            return torch.zeros(x.shape[0], 2)

    x = torch.randn(1, 3, 4, 5, generator=torch.Generator().manual_seed(12))
    sal = torch.arange(20.0).reshape(1, 4, 5)  # raster order: last pixels most salient
    fa.perturbation_curve(Spy(), x, sal, target=0, fractions=(0.0, 0.5), replacement="zero")
    clean, half = torch.cat(seen).split(1)
    assert torch.equal(clean, x)
    changed = (half != x).any(1)[0].flatten()
    assert changed[10:].all() and not changed[:10].any()
    assert (half[0].reshape(3, -1)[:, 10:] == 0).all()
    seen.clear()
    fa.perturbation_curve(Spy(), x, sal, target=0, fractions=(0.5,), replacement="mean", positive=False)
    (neg,) = seen
    m = x.mean(dim=(2, 3))[0]
    torch.testing.assert_close(neg[0].reshape(3, -1)[:, :10], m[:, None].expand(3, 10), **f32_tol(x, 20))  # means of 20
    assert torch.equal(neg[0].reshape(3, -1)[:, 10:], x[0].reshape(3, -1)[:, 10:])
    # blur of a constant image is that constant
    seen.clear()
    const = torch.full((1, 3, 6, 6), 2.5)
    fa.perturbation_curve(Spy(), const, torch.rand(1, 6, 6), target=0, fractions=(0.0, 1.0), replacement="blur")
    torch.testing.assert_close(torch.cat(seen)[-1:], const, **f32_tol(const, 2 * 25))  # two passes, <= 25 taps each


def test_curve_forward_count_batch_items_and_errors(vit, x):
    model = Counting(vit)
    sal = torch.rand(3, 4, 4, generator=torch.Generator().manual_seed(13))
    whole = fa.perturbation_curve(model, x, sal, batch_size=8)
    assert model.calls == math.ceil(3 * 10 / 8)
    for i in range(3):
        one = fa.perturbation_curve(vit, x[i:i + 1], sal[i:i + 1])
        torch.testing.assert_close(whole.probability[i:i + 1], one.probability, **f32_tol(1.0, TINY_DEPTH))
    with pytest.raises(ValueError, match="replacement"):
        fa.perturbation_curve(vit, x, sal, replacement="noise")
    with pytest.raises(ValueError, match="fractions"):
        fa.perturbation_curve(vit, x, sal, fractions=(0.0, 0.5, 0.3))
    with pytest.raises(ValueError, match="first fraction"):
        fa.perturbation_curve(vit, x, sal, fractions=(0.1, 0.5))
    with pytest.raises(ValueError, match="NaN"):
        fa.perturbation_curve(vit, x, sal * float("nan"))


def test_curve_blur_replacement_is_a_gaussian_blur():
    """Replaced pixels take scipy's Gaussian filter of the image (edges 'nearest', radius 3 sigma)."""
    nd = pytest.importorskip("scipy.ndimage")
    seen = []

    class Spy(nn.Module):
        def forward(self, x):
            seen.append(x.clone())
            return torch.zeros(x.shape[0], 2)

    x = torch.randn(2, 3, 6, 10, dtype=torch.float64, generator=torch.Generator().manual_seed(14))
    sal = torch.rand(2, 6, 10, generator=torch.Generator().manual_seed(15))
    for sigma in (1.0, 3.0):
        seen.clear()
        fa.perturbation_curve(Spy(), x, sal, target=0, fractions=(1.0,), replacement="blur", blur_sigma=sigma)
        ref = nd.gaussian_filter(x.numpy(), sigma=(0, 0, sigma, sigma), mode="nearest", truncate=3.0)
        np.testing.assert_allclose(torch.cat(seen).numpy(), ref, **f64_tol(ref, 2 * (6 * sigma + 1)))  # two passes


# --- which probability: softmax (the papers), sigmoid, or the head's own ----------------------

class MultiLabel(nn.Module):
    """Wraps a model; ``pretrained_cfg`` marks its head multi-label, as vitlab's shapes models do."""

    def __init__(self, model, multi_label: bool):
        super().__init__()
        self.model = model
        self.pretrained_cfg = {"multi_label": multi_label}

    def forward(self, x):
        return self.model(x)


def test_probability_options_read_the_asked_probability(vit64, x64):
    vit, x = vit64, x64  # SaCo against the loop: float64 (see SACO_TOL)
    sal = torch.rand(3, 4, 4, generator=torch.Generator().manual_seed(11))
    with torch.no_grad():
        vit.eval()
        logits = vit(x).double()
    t = logits.argmax(-1)
    soft = fa.saco_details(vit, x, sal, k=5)
    sig = fa.saco_details(vit, x, sal, k=5, probability="sigmoid")
    # probabilities of another forward, each returned in float32: the model's rounding, then one more
    tol = f32_tol(1.0, 1)
    torch.testing.assert_close(soft.probability.double(), torch.softmax(logits, -1)[torch.arange(3), t], **tol)
    torch.testing.assert_close(sig.probability.double(), torch.sigmoid(logits)[torch.arange(3), t], **tol)
    # SaCo from the sigmoid drops, recomputed by the loop with the sigmoid
    torch.testing.assert_close(sig.saco.double(), loop_saco(vit, x, sal, None, 5, prob=torch.sigmoid).double(),
                               **SACO_TOL)
    # "head" follows the model's flag
    for multi, want in ((True, sig), (False, soft)):
        got = fa.saco_details(MultiLabel(vit, multi), x, sal, k=5, probability="head")
        torch.testing.assert_close(got.drops, want.drops)
    curve = fa.perturbation_curve(MultiLabel(vit, True), x, sal, probability="head")
    torch.testing.assert_close(curve.probability[:, 0], sig.probability)
    for bad in ("logit", "Softmax", None):
        with pytest.raises(ValueError, match="probability"):
            fa.saco(vit, x, sal, probability=bad)
        with pytest.raises(ValueError, match="probability"):
            fa.perturbation_curve(vit, x, sal, probability=bad)


def test_pixel_saliency_is_the_bilinear_upsampling_saco_ranks(vit, x):
    sal = torch.rand(3, 4, 4, generator=torch.Generator().manual_seed(12))
    up = fa.pixel_saliency(sal, x)
    want = torch.nn.functional.interpolate(sal[:, None], size=(32, 32), mode="bilinear", align_corners=False)[:, 0]
    torch.testing.assert_close(up, want)
    assert torch.equal(fa.pixel_saliency(up, x), up)
    groups = fa.pixel_groups(up, 4)
    want = torch.stack([torch.stack([up[b][groups[b] == g].sum() for g in range(4)]) for b in range(3)])
    torch.testing.assert_close(fa.saco_details(vit, x, sal, k=4).sums, want, **f32_rel(32 * 32 // 4))  # 256 terms >= 0
    with pytest.raises(ValueError, match="saliency"):
        fa.pixel_saliency(torch.rand(2, 4, 4), x)


def test_fractions_that_are_not_numbers_are_named_as_given(vit):
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(4))
    maps = torch.rand(2, 4, 4, generator=torch.Generator().manual_seed(5))
    for bad, shown in ((None, "None"), ("0.5", "'0.5'"), ([0.0, None], r"\[0.0, None\]")):
        with pytest.raises(ValueError, match=r"fractions must be increasing numbers in \[0, 1\] .*got " + shown + "$"):
            fa.perturbation_curve(vit, x, maps, fractions=bad)
    with pytest.raises(ValueError, match=r"got \[0.0, nan\]"):                  # a real NaN is still shown as one
        fa.perturbation_curve(vit, x, maps, fractions=[0.0, float("nan")])
    curve = fa.perturbation_curve(vit, x, maps, fractions=np.array([0, 0.5]))   # numbers of any kind still work
    assert curve.probability.shape == (2, 2) and curve.fractions.tolist() == [0.0, 0.5]


def test_saco_and_curves_refuse_nan_empty_and_integer_pixels_before_the_forward(vit):
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    maps = torch.rand(2, 4, 4)
    nan = x.clone()
    nan[1, 2, 0, 0] = float("nan")
    for fn in (lambda m, x, s: fa.saco(m, x, s, k=3), fa.perturbation_curve):
        for bad, sal, message in ((nan, maps, r"NaN or infinite values \(in sample 1\)"),
                                  (x[:0], maps[:0], r"empty batch \(B = 0"),
                                  ((x * 10).to(torch.uint8), maps, "float image batch")):
            with forwards_counted(vit) as calls, pytest.raises(ValueError, match=message):
                fn(vit, bad, sal)
            assert not calls


def test_perturbation_curve_refuses_nan_fractions(vit):
    x = torch.randn(2, 3, 32, 32)
    for fractions in ([0, float("nan"), 1], [0, math.inf]):
        with forwards_counted(vit) as calls, pytest.raises(ValueError, match=r"fractions must be increasing values "
                                                                              r"in \[0, 1\] \(finite\)"):
            fa.perturbation_curve(vit, x, torch.rand(2, 4, 4), fractions=fractions)
        assert not calls
