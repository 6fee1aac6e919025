"""Mask-based measures on hand-built maps and masks with known answers."""
import numpy as np
import pytest
import torch

from conftest import TINY_GRAD_DEPTH, f32_rounded, f32_tol, f64_tol
from vitlab.footprints import patch_centres, token_centres
from vitlab import localization as loc, stats


def square_mask(H=8, W=8, rows=slice(0, 4), cols=slice(0, 4)):
    m = np.zeros((H, W), bool)
    m[rows, cols] = True
    return m


def test_mask_to_grid_is_patch_coverage():
    m = np.zeros((1, 4, 4), bool)
    m[0, 0, 0] = m[0, 0, 1] = True     # half of the top-left 2x2 patch
    m[0, 2:, 2:] = True                 # all of the bottom-right patch
    np.testing.assert_allclose(loc.mask_to_grid(m, (2, 2))[0].numpy(), [[0.5, 0.0], [0.0, 1.0]])


def test_pointing_game_hits_and_misses():
    masks = np.stack([square_mask(), square_mask()])             # object in the top-left quarter
    maps = torch.zeros(2, 2, 2)
    maps[0, 0, 0] = 1.0        # top patch on the object
    maps[1, 1, 1] = 1.0        # top patch off the object
    assert loc.pointing_game(maps, masks).tolist() == [True, False]


def test_pointing_game_coverage_threshold_and_ties():
    m = np.zeros((1, 4, 4), bool)
    m[0, 0, 0] = True                                             # a quarter of patch (0, 0)
    top_left = torch.tensor([[[1.0, 0.0], [0.0, 0.0]]])
    assert loc.pointing_game(top_left, m, min_coverage=0.25).tolist() == [True]
    assert loc.pointing_game(top_left, m, min_coverage=0.5).tolist() == [False]
    flat = torch.ones(1, 2, 2)                                    # all tied: not all on the object
    assert loc.pointing_game(flat, np.stack([square_mask(4, 4, slice(0, 2), slice(0, 2))])).tolist() == [False]
    assert loc.pointing_game(flat, np.ones((1, 4, 4), bool)).tolist() == [True]


def test_mass_on_object_and_chance_level():
    masks = np.stack([square_mask()])                              # a quarter of the image
    uniform = torch.ones(1, 4, 4)
    np.testing.assert_allclose(loc.mass_on_object(uniform, masks).numpy(), loc.object_area(masks).numpy())
    np.testing.assert_allclose(loc.object_area(masks).numpy(), [0.25])
    peaked = torch.zeros(1, 4, 4)
    peaked[0, 0, 0], peaked[0, 3, 3], peaked[0, 3, 0] = 3.0, 1.0, -5.0   # negatives are clamped
    np.testing.assert_allclose(loc.mass_on_object(peaked, masks).numpy(), [0.75])


def test_bad_shapes_are_value_errors():
    with pytest.raises(ValueError, match="B x gh x gw"):
        loc.pointing_game(torch.zeros(2, 2), np.zeros((1, 4, 4), bool))
    with pytest.raises(ValueError, match="2 maps for 1 masks"):
        loc.pointing_game(torch.zeros(2, 2, 2), np.zeros((1, 4, 4), bool))
    with pytest.raises(ValueError, match="not a multiple"):
        loc.mass_on_object(torch.ones(1, 3, 3), np.zeros((1, 4, 4), bool))
    with pytest.raises(ValueError, match="no positive mass"):
        loc.mass_on_object(torch.zeros(1, 2, 2), np.ones((1, 4, 4), bool))
    with pytest.raises(ValueError, match="min_coverage"):
        loc.pointing_game(torch.zeros(1, 2, 2), np.zeros((1, 4, 4), bool), min_coverage=0)


# ---------------------------------------------------------------------------------------------
# Profiles and graded methods over many scenes
# ---------------------------------------------------------------------------------------------
from timm.models.vision_transformer import VisionTransformer  # noqa: E402

from vitlab.attention import (  # noqa: E402
    attention_gradcam, attention_gradients, cls_attention, cls_attention_profile, raw_attention,
)
from vitlab.relevance import (  # noqa: E402
    CLASS_METHODS, asked_object_maps, chefer_relevance, grade_asked_object, maps_from_gradients,
)
from vitlab.rollout import (  # noqa: E402
    grad_rollout, grade_rollout_settings, rollout, rollout_from_attentions, rollout_settings_maps,
)


def _tiny_vit(seed=0):
    """A random timm ViT, 32 px, 4 x 4 patch grid, 5 classes, weights large enough to give
    peaked attention (so maps differ from method to method). In float64: the helpers below must
    equal the methods batch by batch, and discard ratios and pointing games rank map values, so
    their results are exact only away from rounding ties (~1e-12 of the values in float64)."""
    model = VisionTransformer(img_size=32, patch_size=8, embed_dim=48, depth=3, num_heads=3, num_classes=5)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model.eval().double()


def close64(got, want):
    """float64 maps: the tiny ViT's forward and backward, then a rollout's or relevance's products
    over 17 tokens, per block."""
    torch.testing.assert_close(got, want, **f64_tol(want, TINY_GRAD_DEPTH + 3 * 17))


def _inputs(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, 32, 32, generator=g, dtype=torch.float64)
    masks = torch.zeros(n, 2, 32, 32, dtype=torch.bool)
    for i in range(n):                       # two disjoint 8 x 16 objects at varying places
        r = i % 3 * 8
        masks[i, 0, r:r + 8, 0:16] = True
        masks[i, 1, r:r + 8, 16:32] = True
    labels = torch.tensor([[i % 5, (i + 2) % 5] for i in range(n)])
    return x, masks, labels


def test_attention_entropy_known_values():
    uniform = torch.ones(2, 4, 4)
    one_patch = torch.zeros(4, 4)
    one_patch[1, 2] = 7.0
    half = torch.zeros(4, 4)
    half[:2] = 1.0                                                   # 8 of 16 patches
    maps = torch.stack([uniform[0], one_patch, half])
    # float32 sums of 16 shares and of 16 p log p, and a log: 2 * 16 + 1 roundings
    np.testing.assert_allclose(loc.attention_entropy(maps).numpy(), [1.0, 0.0, 0.75], **f32_tol(1.0, 33))
    np.testing.assert_allclose(loc.attention_entropy(half, normalized=False).numpy(), np.log(8),
                               **f32_tol(np.log(16), 33))
    with pytest.raises(ValueError, match="no positive mass"):
        loc.attention_entropy(torch.zeros(1, 2, 2))
    with pytest.raises(ValueError, match="non-negative"):
        loc.attention_entropy(-torch.ones(1, 2, 2))


def test_layer_mass_on_object_equals_one_map_at_a_time():
    g = torch.Generator().manual_seed(3)
    maps = torch.rand(2, 3, 4, 2, 2, generator=g)                 # B x L x H x gh x gw
    masks = np.stack([square_mask(), square_mask(rows=slice(4, 8))])
    got = loc.layer_mass_on_object(maps, masks)
    assert got.shape == (2, 3, 4)
    for b in range(2):
        for l in range(3):
            np.testing.assert_allclose(got[b, l].numpy(), loc.mass_on_object(maps[b, l], np.stack([masks[b]] * 4)).numpy(),
                                       **f32_tol(1.0, 2 * 4))  # shares of sums over 2 x 2 patches


def test_chance_pointing_is_the_share_of_hit_patches():
    m = np.zeros((2, 4, 4), bool)
    m[0, :2, :2] = True                                             # one of four 2 x 2 patches
    m[1, :, :2] = True                                              # two of four
    np.testing.assert_allclose(loc.chance_pointing(m, (2, 2)).numpy(), [0.25, 0.5])


def test_cls_attention_profile_matches_cls_attention():
    model = _tiny_vit()
    x, masks, _ = _inputs(5)
    prof = cls_attention_profile(model, x, masks[:, 0], batch_size=2)   # batches of 2, 2, 1
    cls = cls_attention(model, x)
    assert prof.mass.shape == prof.entropy.shape == (5, 3, 3)
    close64(prof.mass, loc.layer_mass_on_object(cls, masks[:, 0]))
    close64(prof.entropy, loc.attention_entropy(cls))
    torch.testing.assert_close(prof.area, loc.object_area(masks[:, 0]))


@pytest.mark.parametrize("fusion,ratio", [("mean", 0.0), ("min", 0.5), ("max", 0.9)])
def test_rollout_from_attentions_equals_rollout(fusion, ratio):
    model = _tiny_vit()
    x, _, _ = _inputs(3)
    from vitlab.attention import recorded_attentions
    attentions, layout = recorded_attentions(model, x)
    close64(rollout_from_attentions(attentions, layout, fusion, ratio),
            rollout(model, x, head_fusion=fusion, discard_ratio=ratio))


def test_grade_rollout_settings_equals_per_setting_grading():
    model = _tiny_vit()
    x, masks, _ = _inputs(7)
    settings = [("mean", 0.0), ("max", 0.9)]
    rows = grade_rollout_settings(model, x, masks[:, 0], settings, batch_size=3)
    assert [(r["head_fusion"], r["discard_ratio"], r["n"]) for r in rows] == [("mean", 0.0, 7), ("max", 0.9, 7)]
    for r, (f, d) in zip(rows, settings):
        maps = rollout(model, x, head_fusion=f, discard_ratio=d)
        assert r["pointing"] == pytest.approx(float(loc.pointing_game(maps, masks[:, 0]).float().mean()))
        # float32 shares (sums over 16 patches), averaged over 7 maps
        assert r["mass"] == pytest.approx(float(loc.mass_on_object(maps, masks[:, 0]).mean()), abs=f32_tol(1.0, 2 * 16 + 7)["atol"])
        assert r["touch"] == pytest.approx(float(loc.pointing_game(maps, masks[:, 0], loc.TOUCH).float().mean()))
        assert r["touch"] >= r["pointing"]
    with pytest.raises(ValueError, match="head_fusion"):
        grade_rollout_settings(model, x, masks[:, 0], [("median", 0.0)])
    with pytest.raises(ValueError, match="one B x H x W mask per input"):
        grade_rollout_settings(model, x, masks[:3, 0], settings)


def test_maps_from_gradients_equal_the_methods():
    model = _tiny_vit()
    x, _, labels = _inputs(4)
    target = labels[:, 1]
    maps = maps_from_gradients(attention_gradients(model, x, target), ("max", 0.5), grad_discard_ratio=0.3)
    assert tuple(maps) == CLASS_METHODS
    close64(maps["raw attention"], raw_attention(model, x))
    close64(maps["rollout"], rollout(model, x, "max", 0.5))
    close64(maps["GradCAM"], attention_gradcam(model, x, target))
    close64(maps["gradient rollout"], grad_rollout(model, x, target, discard_ratio=0.3))
    close64(maps["Chefer relevance"], chefer_relevance(model, x, target))


def test_grade_asked_object_equals_asking_one_object_at_a_time():
    model = _tiny_vit()
    x, masks, labels = _inputs(5)
    rows = {r["method"]: r for r in grade_asked_object(model, x, labels, masks, batch_size=2)}
    assert list(rows) == list(CLASS_METHODS)
    per_ask = {m: [] for m in CLASS_METHODS}
    per_other = {m: [] for m in CLASS_METHODS}
    per_touch = {m: [] for m in CLASS_METHODS}
    for k in range(2):
        maps = maps_from_gradients(attention_gradients(model, x, labels[:, k]))
        for m in CLASS_METHODS:
            per_ask[m].append(loc.pointing_game(maps[m], masks[:, k]))
            per_other[m].append(loc.pointing_game(maps[m], masks[:, 1 - k]))
            per_touch[m].append(loc.pointing_game(maps[m], masks[:, k], min_coverage=1e-6))
    for m in CLASS_METHODS:
        hits = torch.stack(per_ask[m], 1)                            # B x 2
        assert rows[m]["asked"] == pytest.approx(float(hits.float().mean()))
        assert rows[m]["all_asks"] == pytest.approx(float(hits.all(1).float().mean()))
        assert rows[m]["other"] == pytest.approx(float(torch.stack(per_other[m], 1).float().mean()))
        assert rows[m]["n"] == 5
        assert rows[m]["asked_touch"] == pytest.approx(float(torch.stack(per_touch[m], 1).float().mean()))
    # a class-agnostic map is the same for both asks: it cannot hit both disjoint objects
    assert rows["raw attention"]["all_asks"] == 0.0 and rows["rollout"]["all_asks"] == 0.0
    one = grade_asked_object(model, x, labels[:, :1], masks[:, :1])
    assert "other" not in one[0] and one[0]["asked"] == pytest.approx(
        float(torch.stack(per_ask["raw attention"], 1)[:, 0].float().mean()))
    with pytest.raises(ValueError, match="labels B x K"):
        grade_asked_object(model, x, labels, masks[:, :1])


def test_token_centres_of_a_plain_patchify_vit_are_the_patch_centres():
    model = _tiny_vit()                                          # 32 px, 8 px patches
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    centres = token_centres(model, x)                         # random weights: inside the patch
    assert centres.shape == (4, 4, 2)
    assert (centres - patch_centres((4, 4), (32, 32))).abs().max() < 3.5
    with torch.no_grad():
        model.patch_embed.proj.weight.fill_(1.0)                 # every pixel of the patch counts the same
    # the float64 model's centres (coordinates < 32), returned in float32: one rounding
    torch.testing.assert_close(token_centres(model, x), patch_centres((4, 4), (32, 32)), **f32_tol(32.0, 1))
    np.testing.assert_allclose(patch_centres((2, 2), (8, 8))[1, 0].numpy(), [5.5, 1.5])


def test_token_centres_see_a_stem_that_looks_up_and_left():
    model = _tiny_vit()
    # replace the patchify convolution by one that reads only the top-left pixel of each patch
    conv = model.patch_embed.proj
    with torch.no_grad():
        conv.weight.zero_()
        conv.weight[:, :, 0, 0] = 1.0
    centres = token_centres(model, torch.randn(1, 3, 32, 32, dtype=torch.float64))
    np.testing.assert_allclose(centres[1, 2].numpy(), [8.0, 16.0], **f32_tol(32.0, 1))


def test_shift_masks_moves_content_and_fills_background():
    m = torch.zeros(1, 4, 4, dtype=torch.bool)
    m[0, 0, 0] = m[0, 3, 3] = True
    down = loc.shift_masks(m, 1, 2)
    assert down.dtype == torch.float32 and down.sum() == 1 and down[0, 1, 2] == 1   # (3, 3) left the image
    up = loc.shift_masks(m, -3, -3)
    assert up.sum() == 1 and up[0, 0, 0] == 1
    assert loc.shift_masks(m, 4, 0).sum() == 0
    torch.testing.assert_close(loc.shift_masks(m, 0, 0), m.float())


def test_grade_maps_scores_and_empty_maps():
    masks = np.stack([square_mask(), square_mask()])                # object: top-left quarter
    maps = torch.zeros(2, 2, 2)
    maps[0, 0, 0] = 1.0                                              # on the object, all mass there
    got = loc.grade_maps(maps, masks)                                 # map 1 is empty: a miss, mass 0
    assert got == {"pointing": 0.5, "touch": 0.5, "mass": 0.5, "n": 2}


def test_rollout_settings_maps_stack_the_settings():
    model = _tiny_vit()
    x, _, _ = _inputs(5)
    maps = rollout_settings_maps(model, x, [("min", 0.0), ("max", 0.5)], batch_size=2)
    assert maps.shape == (2, 5, 4, 4)
    close64(maps[1], rollout(model, x, "max", 0.5))


def test_asked_object_maps_are_the_maps_of_each_ask():
    model = _tiny_vit()
    x, _, labels = _inputs(3)
    maps = asked_object_maps(model, x, labels, batch_size=2, grad_discard_ratio=0.2)
    assert set(maps) == set(CLASS_METHODS) and maps["Chefer relevance"].shape == (3, 2, 4, 4)
    close64(maps["Chefer relevance"][:, 1], chefer_relevance(model, x, labels[:, 1]))
    close64(maps["gradient rollout"][:, 0], grad_rollout(model, x, labels[:, 0], discard_ratio=0.2))


# --- weakly supervised segmentation (Chefer et al. 2021, DETR) -----------------------------------
def brute_otsu(u8):
    """Otsu by definition: the t maximising w0 w1 (m0 - m1)^2 over {v <= t} / {v > t}."""
    v = np.asarray(u8, dtype=np.float64).ravel()
    best, arg = -1.0, 0
    for t in range(256):
        lo, hi = v[v <= t], v[v > t]
        if len(lo) == 0 or len(hi) == 0:
            continue
        score = len(lo) / len(v) * len(hi) / len(v) * (lo.mean() - hi.mean()) ** 2
        if score > best + 1e-12:
            best, arg = score, t
    return arg


def test_otsu_threshold_is_the_definition():
    rng = np.random.default_rng(0)
    for _ in range(5):
        u8 = np.concatenate([rng.integers(0, 90, 30), rng.integers(150, 256, 19)]).astype(np.uint8)
        t = loc.otsu_threshold(u8)
        assert t == brute_otsu(u8)
        assert (u8 > t).sum() == 19                                  # the two groups split
    with pytest.raises(ValueError, match="uint8"):
        loc.otsu_threshold(np.array([0.5, 0.7]))


def test_map_to_mask_keeps_the_high_patches():
    m = torch.zeros(1, 4, 4)
    m[0, 1:3, 1:3] = 1.0                                             # the object's 4 patches
    m[0, 0, 0] = 0.1
    near = loc.map_to_mask(m, (8, 8), upsample="nearest")
    assert torch.equal(near[0], torch.from_numpy(square_mask(8, 8, slice(2, 6), slice(2, 6))))
    bil = loc.map_to_mask(m, (8, 8))                                # bilinear > 0 grows by the blend zone
    assert (bil[0] >= near[0]).all() and bil[0].sum() > near[0].sum() and not bil[0, 0, 0]
    assert not loc.map_to_mask(torch.ones(1, 4, 4), (8, 8)).any()   # nothing stands out
    with pytest.raises(ValueError, match="NaN"):
        loc.map_to_mask(torch.full((1, 2, 2), float("nan")), (4, 4))


def test_mask_iou_by_hand():
    a = np.stack([square_mask(), np.zeros((8, 8), bool)])
    b = np.stack([square_mask(rows=slice(0, 4), cols=slice(2, 6)), np.zeros((8, 8), bool)])
    iou = loc.mask_iou(a, b)                                        # 8 shared of 24 pixels
    np.testing.assert_allclose(iou.numpy(), [[8 / 24, 0.0], [0.0, 0.0]])


def det(scores, labels, masks):
    return {"scores": np.array(scores, float), "labels": np.array(labels), "masks": np.stack(masks)}


def test_segmentation_ap_hand_made_cases():
    obj = square_mask()                                             # 16 pixels
    half = square_mask(rows=slice(0, 4), cols=slice(2, 6))          # IoU 8/24 = 1/3 with obj
    truth = [{"labels": np.array([0]), "masks": obj[None]}]
    # a perfect mask: AP 1 at every threshold
    assert loc.segmentation_ap([det([0.9], [0], [obj])], truth)["ap"] == pytest.approx(1.0)
    # IoU 1/3: a hit at the thresholds 0.2, 0.25, 0.3 only -> 3 of 16
    r = loc.segmentation_ap([det([0.9], [0], [half])], truth)
    assert r["ap"] == pytest.approx(3 / 16) and r["ap50"] == 0.0 and r["per_threshold"][0.3] == 1.0
    # a higher-scored false positive first: precision 1/2 at recall 1 -> AP 0.5
    wrong = square_mask(rows=slice(4, 8), cols=slice(4, 8))
    assert loc.segmentation_ap([det([0.9, 0.5], [0, 0], [wrong, obj])], truth)["ap"] == pytest.approx(0.5)
    # ... after the true positive it costs nothing (the precision envelope)
    assert loc.segmentation_ap([det([0.5, 0.9], [0, 0], [wrong, obj])], truth)["ap"] == pytest.approx(1.0)
    # the wrong class never matches; a class with objects but no detection scores 0
    r = loc.segmentation_ap([det([0.9], [1], [obj])], truth)
    assert r["ap"] == 0.0 and set(r["per_class"]) == {0}
    # two images, one object each, one found: recall reaches 1/2 -> 51 of the 101 recalls
    t2 = truth + [{"labels": np.array([0]), "masks": wrong[None]}]
    nothing = {"scores": np.zeros(0), "labels": np.zeros(0, int), "masks": np.zeros((0, 8, 8), bool)}
    r = loc.segmentation_ap([det([0.9], [0], [obj]), nothing], t2)
    assert r["ap"] == pytest.approx(51 / 101) and r["n_objects"] == 2
    # each detection takes the unmatched object it overlaps most: both found here
    both = [{"labels": np.array([0, 0]), "masks": np.stack([obj, half])}]
    r = loc.segmentation_ap([det([0.9, 0.5], [0, 0], [obj, half])], both)
    assert r["ap"] == pytest.approx(1.0)
    with pytest.raises(ValueError, match="no true objects"):
        loc.segmentation_ap([det([0.9], [0], [obj])], [{"labels": np.zeros(0, int), "masks": np.zeros((0, 8, 8), bool)}])


def test_top_token_is_gives_false_for_a_row_where_nothing_counts():
    from vitlab.localization import top_token_is

    nan = float("nan")
    s = torch.tensor([[nan, nan, nan], [nan, 1.0, 3.0], [2.0, 1.0, 0.0], [2.0, 1.0, 0.0]])
    valid = torch.tensor([[True] * 3, [True] * 3, [False, False, False], [True] * 3])
    # row 0: all NaN, row 2: nothing valid -> no top token, whatever the position asked
    assert top_token_is(s, [0, 2, 0, 0], valid).tolist() == [False, True, False, True]
    assert top_token_is(s, [0, 2, 0, -1]).tolist() == [False, True, True, False]
    # the answer of a row does not depend on the other rows
    for r in range(4):
        assert top_token_is(s[r:r + 1], [0], valid[r:r + 1]).tolist() == \
            [top_token_is(s, [0, 0, 0, 0], valid).tolist()[r]]
    with pytest.raises(ValueError, match="scores hold inf"):
        top_token_is(torch.tensor([[float("inf"), 0.0]]), [0])
    with pytest.raises(ValueError, match="one position per row"):
        top_token_is(s, [0, 1])


def test_map_to_mask_mean_rule_is_the_benchmarks_min_max_and_mean_cut():
    rng = np.random.default_rng(4)
    m = torch.from_numpy(rng.normal(size=(5, 7, 7)))
    got = loc.map_to_mask(m, (7, 7), upsample="nearest", rule="mean")
    for b in range(5):                                     # numpy, as imagenet_seg_eval.py does it
        u = (m[b].numpy() - m[b].numpy().min()) / (m[b].numpy().max() - m[b].numpy().min())
        assert np.array_equal(got[b].numpy(), u > u.mean())
    big = loc.map_to_mask(m, (14, 14), upsample="nearest", rule="mean")
    assert torch.equal(big, got.repeat_interleave(2, 1).repeat_interleave(2, 2))
    assert not loc.map_to_mask(torch.ones(1, 4, 4), (4, 4), rule="mean").any()   # nothing stands out
    # one high patch among equal ones: both rules keep exactly it
    one = torch.zeros(1, 4, 4)
    one[0, 1, 2] = 1.0
    for rule in loc.MASK_RULES:
        assert loc.map_to_mask(one, (4, 4), upsample="nearest", rule=rule).nonzero().tolist() == [[0, 1, 2]]
    with pytest.raises(ValueError, match="rule must be one of"):
        loc.map_to_mask(m, (7, 7), rule="median")


def test_asked_hits_and_rates_by_hand():
    # two scenes, two objects each: object 0 top-left quarter, object 1 bottom-right quarter (8 x 8, 2 x 2 grid)
    tl, br = square_mask(), square_mask(rows=slice(4, 8), cols=slice(4, 8))
    masks = np.stack([np.stack([tl, br]), np.stack([br, tl])])          # scene 1 lists them the other way round
    top = lambda r, c: torch.zeros(2, 2).index_put_((torch.tensor(r), torch.tensor(c)), torch.tensor(1.0))
    maps = torch.stack([torch.stack([top(0, 0), top(1, 1)]),            # scene 0: both asks hit their own object
                        torch.stack([top(0, 0), top(0, 1)])])           # scene 1: ask 0 on the other, ask 1 on none
    hits = loc.asked_hits({"m": maps}, masks)["m"]
    assert hits.dtype == torch.bool and hits.tolist() == [[True, True, False], [True, True, False],
                                                          [False, False, True], [False, False, False]]
    for k in range(2):                                                   # each column is pointing_game per ask
        own = torch.as_tensor(masks[:, k])
        assert hits.view(2, 2, 3)[:, k, 0].tolist() == loc.pointing_game(maps[:, k], own).tolist()
    row, = loc.asked_rates({"m": hits})
    assert (row["method"], row["n"]) == ("m", "4 / 2")
    assert [row[c].value for c in ("asked", "asked_touch", "other", "all_asks")] == [0.5, 0.5, 0.25, 0.5]
    assert row["asked"] == stats.rate([1, 1, 0, 0]) and row["all_asks"] == stats.rate([1, 0])
    with pytest.raises(ValueError, match="K >= 2"):
        loc.asked_hits({"m": maps[:, :1]}, masks[:, :1])
    with pytest.raises(ValueError, match="matching masks"):
        loc.asked_hits({"m": maps[:1]}, masks)
    with pytest.raises(ValueError, match="need asked_hits"):
        loc.asked_rates({"m": hits[:3]})


def test_asked_hits_agree_with_grade_asked():
    rng = np.random.default_rng(0)
    masks = rng.random((5, 3, 8, 8)) > 0.6                              # three overlapping random objects
    maps = {"a": torch.as_tensor(rng.random((5, 3, 4, 4))), "b": torch.as_tensor(rng.random((5, 3, 4, 4)))}
    hits = loc.asked_hits(maps, masks)
    for row in loc.grade_asked(maps, masks):
        h = hits[row["method"]].double()
        # grade_asked takes its means in float32: 15 zeros and ones sum exactly, the division rounds
        # once (a mean <= 1)
        one_rounding = f32_rounded(1.0, 1)["atol"]
        assert [float(h[:, j].mean()) for j in range(3)] == pytest.approx(
            [row["asked"], row["asked_touch"], row["other"]], abs=one_rounding)
        assert float(h[:, 0].view(5, 3).min(1).values.mean()) == pytest.approx(row["all_asks"], abs=one_rounding)
