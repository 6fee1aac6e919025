"""The measures chapter 11 grades CLIP maps with, against independent computations.

- :func:`vitlab.faithfulness.image_text_score` -- a CLIP pair's score as the output SaCo and the
  deletion curves read: equal to ``CLIPModel.forward``'s ``logits_per_image[b, b]``, and, inside
  :func:`~vitlab.faithfulness.perturbation_curve` and :func:`~vitlab.faithfulness.saco_details`,
  equal to a plain loop that deletes pixels from one image at a time and re-runs the model on the
  pair (batch = items, whatever the chunking);
- :func:`vitlab.localization.top_token_hits` -- the top token of a text map against a loop;
- :func:`vitlab.localization.grid_mask_iou` -- against numpy's Kronecker upsampling.

The tiny CLIP is ``test_record_clip``'s float64 model (exactness is the point: the loop and the
batched measure differ only in the order of float64 sums, ``conftest.f64_tol``).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from vitlab import faithfulness as fa
from vitlab import localization as loc

from conftest import assert_model_unchanged, f32_rounded, f32_rounded_rel, f32_tol, f64_tol, model_snapshot
from tiny_models import pairs, tiny_clip
from references import CLIP_DEPTH

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model():
    return tiny_clip(legacy=False)


def close64(a, b) -> bool:
    a, b = torch.as_tensor(a).double(), torch.as_tensor(b).double()
    return a.shape == b.shape and torch.allclose(a, b, **f64_tol([a, b], CLIP_DEPTH))


def pair_score(model, image, ids, mask) -> float:
    """One image with one text through the model's own forward: ``logits_per_image[0, 0]``."""
    with torch.no_grad():
        return float(model(pixel_values=image[None], input_ids=ids[None], attention_mask=mask[None]).logits_per_image[0, 0])


def pixel_maps(B, H=32, W=32, seed=5):
    """Pixel-resolution maps of distinct values (no ties), so the order needs no upsampling rule."""
    g = torch.Generator().manual_seed(seed)
    return torch.rand(B, H, W, generator=g, dtype=torch.float64)


# ----------------------------------------------------------------------------- the pair score
def test_image_text_score_is_the_diagonal_of_the_models_logits(model):
    inputs = pairs()
    score = fa.image_text_score(model, inputs)
    x = inputs["pixel_values"]
    with torch.no_grad():
        logits = model(**inputs).logits_per_image
    assert score.n == 3 and close64(score(x, torch.arange(3)), logits.diagonal())
    # any image with any of the pairs' texts: image 2 and image 0, both with text 1
    with torch.no_grad():
        swapped = model(pixel_values=x[[2, 0]], **{k: v for k, v in inputs.items() if k != "pixel_values"}).logits_per_image
    assert close64(score(x[[2, 0]], torch.tensor([1, 1])), swapped[:, 1])


def test_image_text_score_refuses_before_any_forward(model):
    inputs = pairs()
    bad = dict(inputs, pixel_values=inputs["pixel_values"].clone())
    bad["pixel_values"][0, 0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN|finite"):
        fa.image_text_score(model, bad)
    with pytest.raises(ValueError, match="one text per image"):
        fa.image_text_score(model, dict(inputs, input_ids=inputs["input_ids"][:2],
                                        attention_mask=inputs["attention_mask"][:2]))
    score = fa.image_text_score(model, inputs)
    with pytest.raises(ValueError, match="rows must index"):
        score(inputs["pixel_values"][:1], torch.tensor([3]))


# ----------------------------------------------------------------------------- deletion curves of a pair score
def loop_curve(model, inputs, sal, fractions, positive):
    """Delete the top (or bottom) pixels of one image at a time and re-run the model on the pair."""
    x, ids, mask = inputs["pixel_values"], inputs["input_ids"], inputs["attention_mask"]
    B, C, H, W = x.shape
    out = np.zeros((B, len(fractions)))
    for b in range(B):
        s = sal[b].numpy().ravel()
        order = np.argsort(-s if positive else s, kind="stable")
        mean = x[b].mean(dim=(1, 2))
        for j, f in enumerate(fractions):
            img = x[b].clone().reshape(C, H * W)
            gone = order[:int(f * H * W + 1e-9)]
            img[:, gone] = mean[:, None]
            out[b, j] = pair_score(model, img.reshape(C, H, W), ids[b], mask[b])
    return out


@pytest.mark.parametrize("positive", [True, False])
def test_deletion_curve_of_the_pair_score_equals_a_delete_and_rerun_loop(model, positive):
    inputs = pairs()
    sal = pixel_maps(3)
    fractions = (0.0, 0.1, 0.3, 0.5, 0.9)
    before = model_snapshot(model)
    curve = fa.perturbation_curve(model, inputs["pixel_values"], sal, positive=positive, fractions=fractions,
                                  batch_size=4, score=fa.image_text_score(model, inputs))
    assert_model_unchanged(model, before)
    expected = loop_curve(model, inputs, sal, fractions, positive)
    assert close64(curve.probability, torch.from_numpy(expected).float())  # stored as float32
    assert curve.correct is None and curve.auc_accuracy is None and (curve.target == -1).all()
    auc = ((expected[:, 1:] + expected[:, :-1]) / 2 * np.diff(fractions)).sum(1)
    # float32 storage of the curve: the library's trapezoid runs in float32 on the rounded scores and
    # fractions: a sum of len - 1 terms, each within 4 roundings (score, fraction difference, sum,
    # product), the fractions' own rounding bounded by the largest: depth len + 3, scale max p * max t
    tol = f32_tol(expected.max() * max(fractions), len(fractions) + 3)
    assert np.allclose(curve.auc.numpy(), auc, **tol)
    # batch = items: pair 1 alone gives row 1
    one = {k: v[1:2] for k, v in inputs.items()}
    alone = fa.perturbation_curve(model, one["pixel_values"], sal[1:2], positive=positive, fractions=fractions,
                                  score=fa.image_text_score(model, one))
    assert close64(alone.probability[0], curve.probability[1])


def test_deletion_curve_of_a_grid_map_ranks_its_upsampled_pixels(model):
    inputs = pairs()
    grid = torch.rand(3, 4, 4, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    fractions = (0.0, 0.25, 0.5)
    score = fa.image_text_score(model, inputs)
    curve = fa.perturbation_curve(model, inputs["pixel_values"], grid, fractions=fractions, batch_size=2, score=score)
    expected = loop_curve(model, inputs, fa.pixel_saliency(grid, inputs["pixel_values"]).double(), fractions, True)
    assert close64(curve.probability, torch.from_numpy(expected).float())


# ----------------------------------------------------------------------------- SaCo of a pair score
def saco_by_hand(drops, sums):
    """Wu et al. 2024, Alg. 1, as two loops."""
    num = den = 0.0
    K = len(drops)
    for i in range(K):
        for j in range(i + 1, K):
            w = sums[i] - sums[j]
            num += w if drops[i] >= drops[j] else -w
            den += abs(w)
    return num / den


def test_saco_of_the_pair_score_equals_a_replace_each_group_loop(model):
    inputs = pairs()
    x, ids, mask = inputs["pixel_values"], inputs["input_ids"], inputs["attention_mask"]
    sal = pixel_maps(3, seed=9)
    k = 5
    before = model_snapshot(model)
    res = fa.saco_details(model, x, sal, k=k, batch_size=7, score=fa.image_text_score(model, inputs))
    assert_model_unchanged(model, before)
    B, C, H, W = x.shape
    for b in range(B):
        s = sal[b].numpy().ravel()
        groups = np.array_split(np.argsort(-s, kind="stable"), k)
        clean = pair_score(model, x[b], ids[b], mask[b])
        mean = x[b].mean(dim=(1, 2))
        drops, sums = [], []
        for g in groups:
            img = x[b].clone().reshape(C, H * W)
            img[:, g] = mean[:, None]
            drops.append(clean - pair_score(model, img.reshape(C, H, W), ids[b], mask[b]))
            sums.append(float(s[g].sum()))
        assert close64(res.drops[b], torch.tensor(drops).float())
        # the sums (float64 sums over H W / k pixels, in another order) and the coefficient (float64
        # from K (K - 1) / 2 pairs) are stored as float32: one rounding each
        sum_rtol = f32_rounded_rel(1)["rtol"] + f64_tol(1.0, H * W)["atol"]  # non-negative terms
        assert np.allclose(res.sums[b].numpy(), sums, rtol=sum_rtol, atol=0)
        p_tol = f32_rounded(clean, 1, f64_tol([clean], CLIP_DEPTH)["atol"])["atol"]
        assert abs(float(res.probability[b]) - clean) <= p_tol
        saco_tol = f32_rounded(1.0, 1, f64_tol(1.0, k * k)["atol"])["atol"]
        assert abs(float(res.saco[b]) - saco_by_hand(drops, sums)) <= saco_tol
    assert (res.target == -1).all()
    assert torch.equal(fa.saco(model, x, sal, k=k, score=fa.image_text_score(model, inputs)), res.saco)


def test_clip_saco_grades_the_pairs_with_a_ranking_and_leaves_the_others_undefined(model):
    inputs = pairs()
    sal = pixel_maps(3, seed=9)
    sal[1] = 0.5                                              # a constant map: SaCo undefined
    before = model_snapshot(model)
    res = fa.clip_saco(model, inputs, sal, k=5, batch_size=4)
    assert_model_unchanged(model, before)
    keep = torch.tensor([0, 2])
    sub = {k: v[keep] for k, v in inputs.items()}
    ref = fa.saco_details(model, sub["pixel_values"], sal[keep], k=5, score=fa.image_text_score(model, sub))
    assert torch.isnan(res.saco[1]) and torch.isnan(res.drops[1]).all() and torch.isnan(res.sums[1]).all()
    assert close64(res.saco[keep], ref.saco) and close64(res.drops[keep], ref.drops)
    assert close64(res.probability[keep], ref.probability)
    flat = {k: v for k, v in inputs.items()}
    flat_sal = torch.ones_like(sal)
    assert torch.isnan(fa.clip_saco(model, flat, flat_sal, k=5).saco).all()
    with pytest.raises(ValueError, match="pixel_values"):
        fa.clip_saco(model, {"input_ids": inputs["input_ids"]}, sal)


def test_a_train_mode_model_comes_back_in_train_mode(model):
    inputs = pairs()
    model.train()
    try:
        before = model_snapshot(model)
        fa.saco(model, inputs["pixel_values"], pixel_maps(3), k=3, score=fa.image_text_score(model, inputs))
        assert_model_unchanged(model, before)
    finally:
        model.eval()


def test_the_measures_refuse_a_score_that_does_not_fit_before_any_forward(model):
    inputs = pairs()
    x, sal = inputs["pixel_values"], pixel_maps(3)
    score = fa.image_text_score(model, inputs)
    with pytest.raises(ValueError, match="no target class"):
        fa.saco(model, x, sal, target=0, score=score)
    with pytest.raises(ValueError, match="made for 3 pairs but x holds 2"):
        fa.perturbation_curve(model, x[:2], sal[:2], score=score)
    with pytest.raises(ValueError, match="another model"):
        fa.saco(tiny_clip(legacy=False, seed=1), x, sal, score=score)
    with pytest.raises(TypeError, match="callable"):
        fa.saco(model, x, sal, score="logits")
    nan = x.clone()
    nan[1, 0, 0, 0] = float("inf")
    calls = []
    with pytest.raises(ValueError, match="NaN|finite|inf"):
        fa.saco(model, nan, sal, score=lambda images, rows: calls.append(1) or score(images, rows))
    assert not calls
    with pytest.raises(ValueError, match="one number per image"):
        fa.perturbation_curve(model, x, sal, score=lambda images, rows: score(images, rows)[:1])


# ----------------------------------------------------------------------------- text maps: the top token
def test_top_token_hits_against_a_loop_with_ties_and_chance():
    g = torch.Generator().manual_seed(0)
    maps = torch.randint(0, 4, (200, 7), generator=g).double()        # many ties
    targets = torch.rand(200, 7, generator=g) < 0.3
    valid = torch.rand(200, 7, generator=g) < 0.8
    ok = (valid & targets).any(1)
    maps, targets, valid = maps[ok], targets[ok], valid[ok]
    got = loc.top_token_hits(maps, targets, valid)
    for b in range(maps.shape[0]):
        idx = [t for t in range(7) if valid[b, t]]
        best = max(float(maps[b, t]) for t in idx)
        tied = [t for t in idx if float(maps[b, t]) == best]
        assert bool(got.hits[b]) == all(bool(targets[b, t]) for t in tied)
        want = sum(bool(targets[b, t]) for t in idx) / len(idx)  # a ratio of small integers: one rounding
        assert abs(float(got.chance[b]) - want) <= f32_rounded(want, 1)["atol"]
    # known answers: padding (invalid) may hold the largest value without counting
    h = loc.top_token_hits(torch.tensor([[0.0, 0.2, 0.9, 5.0], [0.0, 0.7, 0.1, 0.0]]),
                           torch.tensor([[False, False, True, False], [False, False, True, False]]),
                           torch.tensor([[False, True, True, False], [False, True, True, False]]))
    assert h.hits.tolist() == [True, False] and h.chance.tolist() == [0.5, 0.5]


def test_top_token_hits_refuses_what_it_cannot_grade():
    with pytest.raises(ValueError, match="no valid token or no valid target"):
        loc.top_token_hits(torch.ones(2, 3), torch.tensor([[True, False, False], [False] * 3]))
    with pytest.raises(ValueError, match="NaN or inf"):
        loc.top_token_hits(torch.tensor([[float("nan"), 1.0]]), torch.tensor([[True, False]]))
    with pytest.raises(ValueError, match="B x T"):
        loc.top_token_hits(torch.ones(2, 3), torch.ones(2, 4, dtype=torch.bool))


# ----------------------------------------------------------------------------- masks on the patch grid
def test_grid_mask_iou_against_numpy():
    rng = np.random.default_rng(1)
    grid = rng.random((20, 7, 7)) < 0.3
    masks = rng.random((20, 112, 112)) < 0.2
    masks[3] = False
    grid[3] = False                                     # both empty: 0
    got = loc.grid_mask_iou(torch.from_numpy(grid), torch.from_numpy(masks)).numpy()
    for b in range(20):
        up = np.kron(grid[b].astype(int), np.ones((16, 16), dtype=int)).astype(bool)
        union = (up | masks[b]).sum()
        want = (up & masks[b]).sum() / union if union else 0.0
        assert abs(got[b] - want) < 1e-12
    full = loc.grid_mask_iou(torch.ones(1, 7, 7, dtype=torch.bool), torch.from_numpy(masks[:1]))
    assert abs(float(full[0]) - masks[0].mean()) < 1e-12   # every patch: IoU = the object's area share
    with pytest.raises(ValueError, match="multiple of the patch grid"):
        loc.grid_mask_iou(torch.ones(1, 5, 5, dtype=torch.bool), torch.ones(1, 112, 112, dtype=torch.bool))
