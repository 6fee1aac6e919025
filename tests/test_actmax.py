"""vitlab.actmax: objectives against independent computations, the seam measure on
hand-built images, parametrisations, transformations, and visualize()'s contract
(objective rises, deterministic per seed, model left exactly as it was, clear errors)."""
import math

import pytest
import torch
import torch.nn.functional as F
from timm.models.vision_transformer import VisionTransformer

import vitlab
from conftest import assert_model_unchanged, f32_tol, f64_tol, model_snapshot, module_depth
from vitlab import actmax
from vitlab.actmax import transforms as T
from tiny_models import tiny_vit  # conftest's TINY ViT (the tests moved from the issue-14 file)

pytestmark = pytest.mark.usefixtures("one_thread")


def actmax_vit(num_classes=4, **kw):
    """A 2-block ViT with timm's default (PyTorch) init and the preprocessing actmax reads."""
    model = VisionTransformer(img_size=32, patch_size=8, embed_dim=48, depth=2, num_heads=3,
                              num_classes=num_classes, **kw).eval()
    model.pretrained_cfg = dict(input_size=(3, 32, 32), mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225),
                                interpolation="bilinear", crop_pct=1.0, crop_mode="center")
    return model


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return actmax_vit()


# the tiny ViT's forward (16 patches + CLS): the float32 allowance for its outputs
DEPTH = module_depth(actmax_vit(), tokens=17)


def normalise(model, x):
    cfg = model.pretrained_cfg
    return (x - torch.tensor(cfg["mean"]).view(1, 3, 1, 1)) / torch.tensor(cfg["std"]).view(1, 3, 1, 1)


def manual_states(model, images):
    """Independent forward of a timm ViT block by block: residual stream after each block,
    MLP hidden activation GELU(fc1(norm2(.))) of each block, and block 0's attention."""
    x = normalise(model, images)
    h = model.norm_pre(model._pos_embed(model.patch_embed(x)))
    states, mlps = [], []
    blk0 = model.blocks[0]
    a = blk0.attn
    B, N, C = h.shape
    qkv = a.qkv(blk0.norm1(h)).reshape(B, N, 3, a.num_heads, C // a.num_heads).permute(2, 0, 3, 1, 4)
    attn0 = torch.softmax((qkv[0] * a.scale) @ qkv[1].transpose(-2, -1), dim=-1)
    for blk in model.blocks:
        h = h + blk.ls1(blk.attn(blk.norm1(h)))
        mlps.append(blk.mlp.act(blk.mlp.fc1(blk.norm2(h))))
        h = h + blk.ls2(blk.mlp(blk.norm2(h)))
        states.append(h)
    return states, mlps, attn0


# ----------------------------------------------------------------------------- seam measure
def patchy(H=16, W=16, P=4, g=0.01, s=0.05, channels=3):
    """x[c, i, j] = g * j + s * (j // P): every horizontal step is g, plus s at a border."""
    j = torch.arange(W, dtype=torch.float64)
    row = g * j + s * torch.div(j, P, rounding_mode="floor")
    return row.expand(channels, H, W).clone()


def test_seam_ratio_is_one_on_smooth_images():
    y, x = torch.meshgrid(torch.arange(28.0, dtype=torch.float64), torch.arange(28.0, dtype=torch.float64),
                          indexing="ij")
    ramp = torch.stack([0.01 * x, 0.02 * y, 0.01 * x + 0.03 * y])  # constant gradient everywhere
    # float64: exactly 1 up to the rounding of two means over 3 * 28 * 27 pairs each
    assert actmax.seam_ratio(ramp, 7).item() == pytest.approx(1.0, abs=f64_tol(1.0, 2 * 3 * 28 * 27)["atol"])
    noise = torch.rand(4, 3, 112, 112, generator=torch.Generator().manual_seed(0))
    ratios = actmax.seam_ratio(noise, 14)
    assert ratios.shape == (4,)
    assert torch.allclose(ratios, torch.ones(4), atol=0.03)  # i.i.d. pixels: no preferred place (sampling, seeded)


def test_seam_ratio_known_value_on_a_patchy_image():
    # 16 x 16, P = 4: 3 of the 15 column pairs straddle a border, 3 of 15 row pairs.
    # Horizontal: across = g + s, inside = g; vertical differences are all 0, and there are
    # as many vertical as horizontal pairs in each group, so the ratio is (g + s) / g.
    g, s = 0.01, 0.05
    img = patchy(g=g, s=s)
    across, inside = actmax.border_difference(img[None], 4)
    assert across.item() == pytest.approx((g + s) / 2)
    assert inside.item() == pytest.approx(g / 2)
    assert actmax.seam_ratio(img, 4).item() == pytest.approx((g + s) / g)
    # transposed image, same answer; a (ph, pw) patch size reads the right axis
    assert actmax.seam_ratio(img.transpose(1, 2), 4).item() == pytest.approx((g + s) / g)
    assert actmax.seam_ratio(img, (8, 4)).item() == pytest.approx(
        (48 * (g + s) + 16 * 0) / 64 / ((192 * g) / (192 + 224)))
    # a grid shifted by half a patch sees no seams where there are none
    assert actmax.seam_ratio(img, 4, offset=2).item() < 1.0


def test_seam_profile_spikes_at_the_border():
    g, s = 0.01, 0.05
    img = patchy(g=g, s=s)
    prof = actmax.seam_profile(img, 4)[0]
    # horizontal pairs: g everywhere, g + s at position 0; vertical pairs: 0 everywhere
    assert prof[0].item() == pytest.approx((g + s) / 2)
    assert torch.allclose(prof[1:], torch.full((3,), g / 2, dtype=prof.dtype))
    noise = torch.rand(2, 3, 56, 56, dtype=torch.float64)  # an identity: checked in float64
    prof = actmax.seam_profile(noise, 14)
    ratio = actmax.seam_ratio(noise, 14)
    assert torch.allclose(prof[:, 0] / prof[:, 1:].mean(1), ratio, **f64_tol(ratio, 2 * 2 * 3 * 56 * 55))
    with pytest.raises(ValueError, match="square"):
        actmax.seam_profile(noise, (14, 7))


def test_seam_masks_and_errors():
    cols, rows = actmax.seams.border_masks((8, 12), (4, 3))
    assert cols.tolist() == [(j + 1) % 3 == 0 for j in range(11)]
    assert rows.tolist() == [(i + 1) % 4 == 0 for i in range(7)]
    with pytest.raises(ValueError, match="patch_size"):
        actmax.seam_ratio(torch.rand(3, 8, 8), 1)
    with pytest.raises(ValueError, match="larger than one patch"):
        actmax.seam_ratio(torch.rand(3, 8, 8), 8)
    with pytest.raises(ValueError, match="B x C x H x W"):
        actmax.seam_ratio(torch.rand(8, 8), 4)


def test_patch_period_contrast_known_values():
    # one 2 x 4 channel, P = 2: patches A = [[0, 1], [0, 1]] and B = 0. The mean patch is
    # [[0, .5], [0, .5]] (std .25); the image holds two 1s and six 0s (std sqrt(1.5 / 8)),
    # so the contrast is .25 / sqrt(.1875) = 1 / sqrt(3).
    a = torch.tensor([[0.0, 1.0], [0.0, 1.0]], dtype=torch.float64)
    half = torch.cat([a, torch.zeros_like(a)], 1)[None, None]
    assert actmax.patch_period_contrast(half, 2).item() == pytest.approx(3 ** -0.5, rel=1e-12)
    # layouts that cancel (A and 1 - A) average to a flat patch: 0
    cancel = torch.cat([a, 1 - a], 1)[None, None]
    assert actmax.patch_period_contrast(cancel, 2).item() == pytest.approx(0.0, abs=1e-12)
    # one random patch tiled over a 5 x 4 grid: 1, and still 1 whatever the tiling's phase
    tile = torch.rand(3, 6, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    tiled = tile.repeat(1, 5, 4)[None]
    for shift in (0, 2, 5):
        rolled = tiled.roll((shift, 3), dims=(2, 3))
        assert actmax.patch_period_contrast(rolled, 6).item() == pytest.approx(1.0, rel=1e-12)
    assert actmax.seam_ratio(tiled, 6).item() < 1.2    # no step at the borders to speak of


def test_patch_period_contrast_matches_a_loop_and_reads_rectangular_patches():
    g = torch.Generator().manual_seed(1)
    images = torch.rand(3, 2, 13, 17, dtype=torch.float64, generator=g)    # not whole patches
    ph, pw = 4, 5
    got = actmax.patch_period_contrast(images, (ph, pw))
    for b in range(3):
        layout, spread = [], []
        for c in range(2):
            whole = images[b, c, : 13 // ph * ph, : 17 // pw * pw]
            tiles = [whole[i:i + ph, j:j + pw] for i in range(0, whole.shape[0], ph)
                     for j in range(0, whole.shape[1], pw)]
            mean_patch = sum(tiles) / len(tiles)
            layout.append(((mean_patch - mean_patch.mean()) ** 2).mean().sqrt())
            spread.append(((whole - whole.mean()) ** 2).mean().sqrt())
        expected = (sum(layout) / 2) / (sum(spread) / 2)
        assert got[b].item() == pytest.approx(expected.item(), rel=1e-12)
    # unrelated patches: about 1 / sqrt(number of patches) (i.i.d. pixels, seeded)
    noise = torch.rand(4, 3, 112, 112, generator=g.manual_seed(2))
    assert torch.allclose(actmax.patch_period_contrast(noise, 14), torch.full((4,), 1 / 8), rtol=0.1)


def test_mean_patch_averages_whole_patches_and_feeds_the_contrast():
    g = torch.Generator().manual_seed(3)
    images = torch.rand(2, 3, 13, 17, dtype=torch.float64, generator=g)    # not whole patches
    got = actmax.mean_patch(images, (4, 5))
    assert got.shape == (2, 3, 4, 5)
    tiles = [images[..., i:i + 4, j:j + 5] for i in range(0, 12, 4) for j in range(0, 15, 5)]
    assert torch.allclose(got, sum(tiles) / len(tiles), rtol=0, atol=1e-12)
    # a tiling's mean patch is its tile; the contrast is the mean patch's std over the image's
    tile = torch.rand(3, 6, 6, dtype=torch.float64, generator=g)
    tiled = tile.repeat(1, 3, 2)[None]
    assert torch.allclose(actmax.mean_patch(tiled, 6)[0], tile, rtol=0, atol=1e-12)
    whole = images[..., :12, :15]
    ratio = got.flatten(2).std(2, correction=0).mean(1) / whole.flatten(2).std(2, correction=0).mean(1)
    assert torch.allclose(actmax.patch_period_contrast(images, (4, 5)), ratio, rtol=1e-12)
    x = torch.rand(1, 3, 8, 8, requires_grad=True)
    assert not actmax.mean_patch(x, 4).requires_grad
    with pytest.raises(ValueError, match="two whole patches"):
        actmax.mean_patch(torch.rand(3, 8, 8), 8)


def test_patch_period_contrast_errors():
    with pytest.raises(ValueError, match="two whole patches"):
        actmax.patch_period_contrast(torch.rand(3, 8, 8), 8)
    with pytest.raises(ValueError, match="B x C x H x W"):
        actmax.patch_period_contrast(torch.rand(8, 8), 4)


# ----------------------------------------------------------------------------- objectives
def ctx_for(model, images, units_mlp=True):
    with torch.no_grad(), vitlab.record(model, mlp=units_mlp, detach=True) as rec:
        out = model(normalise(model, images))
    idx = torch.arange(images.shape[0])
    return actmax.Context(rec, out, images, images, idx, (8, 8), model.num_classes)


def test_model_objectives_match_an_independent_forward(model):
    images = torch.rand(3, 3, 32, 32)
    with torch.no_grad():
        states, mlps, attn0 = manual_states(model, images)
        logits = model(normalise(model, images))
    objs = [actmax.mlp_unit(1, 7), actmax.mlp_unit(0, 190), actmax.residual_channel(0, 5),
            actmax.class_logit(2), actmax.class_log_probability(3), actmax.cls_attention(0, 1),
            actmax.cls_attention(0, 2, patch=(1, 3)), actmax.mlp_unit(-1, 7)]
    got = actmax.evaluate(model, objs, images)
    expect = torch.stack([
        mlps[1][:, 1:, 7].mean(1), mlps[0][:, 1:, 190].mean(1), states[0][:, 1:, 5].mean(1),
        logits[:, 2], torch.log_softmax(logits, 1)[:, 3], attn0[:, 1, 0, 1:].sum(1),
        attn0[:, 2, 0, 1 + 1 * 4 + 3], mlps[1][:, 1:, 7].mean(1),
    ])
    assert got.shape == (len(objs), 3)
    assert torch.allclose(got, expect, **f32_tol(expect, DEPTH))
    # all units at once
    means = actmax.mlp_unit_means(model, 1, images, batch_size=2)
    tol = f32_tol(mlps, DEPTH)
    assert torch.allclose(means, mlps[1][:, 1:].mean(1), **tol)
    both = actmax.mlp_unit_means(model, [0, -1], images)
    assert torch.allclose(both[0], mlps[0][:, 1:].mean(1), **tol) and torch.allclose(both[1], means, **tol)
    with pytest.raises(ValueError, match="block must be in"):
        actmax.mlp_unit_means(model, [0, 2], images)


def test_class_log_probability_of_a_multi_label_head_is_log_sigmoid(model):
    images = torch.rand(3, 3, 32, 32)
    with torch.no_grad():
        logits = model(normalise(model, images))
    saved = model.pretrained_cfg
    model.pretrained_cfg = {**saved, "multi_label": True}
    try:
        got = actmax.evaluate(model, actmax.class_log_probability(3), images)
    finally:
        model.pretrained_cfg = saved
    assert torch.allclose(got, F.logsigmoid(logits[:, 3]), **f32_tol(logits, DEPTH))
    assert not torch.allclose(got, torch.log_softmax(logits, 1)[:, 3], atol=1e-3)


def test_per_image_units_and_copies(model):
    images = torch.rand(2, 3, 32, 32)
    with torch.no_grad():
        _, mlps, _ = manual_states(model, images)
    got = actmax.evaluate(model, actmax.mlp_unit(1, [4, 9]), images)
    assert torch.allclose(got, torch.stack([mlps[1][0, 1:, 4].mean(), mlps[1][1, 1:, 9].mean()]),
                          **f32_tol(mlps, DEPTH))
    # a Context averages the copies of each image
    ctx = ctx_for(model, images)
    ctx.image_index = torch.tensor([0, 0, 1])
    ctx.images = images[:2]
    assert torch.allclose(ctx.per_image(torch.tensor([1.0, 3.0, 5.0])), torch.tensor([2.0, 5.0]))


def test_total_variation_and_border_difference_formulas(model):
    images = torch.rand(2, 3, 32, 32)
    ctx = ctx_for(model, images)
    tv = actmax.total_variation()(ctx)
    for b in range(2):
        x = images[b]
        sx = sum(abs(float(x[c, i, j + 1] - x[c, i, j])) for c in range(3) for i in range(32) for j in range(31))
        sy = sum(abs(float(x[c, i + 1, j] - x[c, i, j])) for c in range(3) for i in range(31) for j in range(32))
        # float32 means over 2 x 2976 differences of pixels in [0, 1], against Python's float64 sums
        assert tv[b].item() == pytest.approx(sx / (3 * 32 * 31) + sy / (3 * 31 * 32),
                                             abs=f32_tol(1.0, 2 * 3 * 32 * 31)["atol"])
    across, _ = actmax.border_difference(images, 8)
    assert torch.allclose(actmax.patch_border_difference()(ctx), across)


SEAM_TOL = f32_tol(6.0, 2 * 3 * 32 * 31)["atol"]  # the seam ratio (6) of a float32 32 x 32 image


def test_seam_excess_is_the_seam_measure_above_one(model):
    img = patchy(H=32, W=32, P=8).float()
    smooth = torch.linspace(0, 1, 32).expand(3, 32, 32).clone()
    images = torch.stack([img, smooth]).requires_grad_(True)
    ctx = ctx_for(model, images.detach())
    ctx.images = images
    excess = actmax.seam_excess()(ctx)
    ratios = actmax.seam_ratio(images.detach(), 8)
    assert torch.allclose(excess, torch.relu(ratios - 1), rtol=0, atol=SEAM_TOL)
    # a float32 ratio of means over the 2 x 3 x 32 x 31 pixel pairs (the image's own rounding, <= 92 eps
    # of each 0.01 step, is far inside that depth); the smooth ramp's ratio is 1 up to that rounding
    assert excess[0].item() == pytest.approx((0.01 + 0.05) / 0.01 - 1, abs=SEAM_TOL)
    assert excess[1].item() == pytest.approx(0.0, abs=SEAM_TOL)
    # the in-patch differences are held constant: only pixels at a border get a gradient
    (g,) = torch.autograd.grad(excess.sum(), images)
    cols = torch.zeros(32, dtype=torch.bool)
    cols[7::8] = True
    cols[8::8] = True
    assert g[0][..., ~cols].abs().max() == 0 and g[0][..., cols].abs().max() > 0


def test_continuity_pulls_a_patchy_image_to_no_seams(model):
    start = actmax.PixelImage(1, 32, sd=0.0)
    with torch.no_grad():
        start.pixels.copy_(0.2 + patchy(H=32, W=32, P=8, g=0.01, s=0.05)[None].float())
    assert actmax.seam_ratio(start.image().detach(), 8).item() == pytest.approx(6.0, abs=SEAM_TOL)
    nothing = 0 * actmax.class_logit(0)
    r = actmax.visualize(model, nothing, steps=30, copies=1, param=start, continuity=True, lr=0.002,
                         transforms=T.compose([]), progress=False)
    assert actmax.seam_ratio(r.images, 8).item() < 1.1
    assert r.trace[0].item() == pytest.approx(-actmax.CONTINUITY_WEIGHT * 5.0, rel=1e-3)
    assert r.objective_trace.abs().max().item() == 0.0        # the objective alone: 0 * logit
    assert r.objective == "0 * logit[0] - 2 * seam_excess"    # the name still shows the penalty


def test_objective_trace_is_the_objective_without_the_penalty(model):
    unit = actmax.mlp_unit(1, [3, 7])
    run = dict(steps=4, batch=2, copies=2, param="fft", seed=5, progress=False)
    plain = actmax.visualize(model, unit, **run)
    assert torch.equal(plain.objective_trace, plain.trace)
    smooth = actmax.visualize(model, unit, continuity=True, **run)
    # same seed: the same start and the same jitter at step 0, so the same objective before any step
    assert torch.equal(smooth.objective_trace[0], plain.trace[0])
    # the penalty (weight 2 times a seam excess >= 0) is what separates the two traces
    assert (smooth.trace <= smooth.objective_trace).all()
    excess = smooth.objective_trace - smooth.trace
    assert (excess > 0).any()
    assert torch.allclose(excess / actmax.CONTINUITY_WEIGHT, (excess / actmax.CONTINUITY_WEIGHT).clamp(min=0))


def test_objectives_compose_like_lucent(model):
    images = torch.rand(2, 3, 32, 32)
    ctx = ctx_for(model, images)
    a, b, tv = actmax.mlp_unit(1, 3), actmax.class_logit(1), actmax.total_variation()
    va, vb, vt = a(ctx), b(ctx), tv(ctx)
    assert torch.allclose((a + b)(ctx), va + vb)
    assert torch.allclose((a - 0.1 * tv)(ctx), va - 0.1 * vt)
    assert torch.allclose((-a)(ctx), -va)
    assert torch.allclose((2 - a)(ctx), 2 - va)
    assert torch.allclose((a / 4 + 1)(ctx), va / 4 + 1)
    assert torch.allclose(sum([a, b, tv])(ctx), va + vb + vt)
    assert (a + b).needs_mlp and (b + a).needs_mlp and not (b + tv).needs_mlp
    assert (a - 0.1 * tv).name == "mlp[1][3] - 0.1 * tv"
    assert (-(-a + b)).name == "-(-mlp[1][3] + logit[1])" and (-(-a)).name == "mlp[1][3]"
    with pytest.raises(TypeError):
        a * b
    with pytest.raises(ValueError, match="divide"):
        a / 0


def test_objective_argument_errors(model):
    images = torch.rand(2, 3, 32, 32)
    ctx = ctx_for(model, images)
    for bad in (-1, 1.5, [], True, "3"):
        with pytest.raises(ValueError, match="unit"):
            actmax.mlp_unit(0, bad)
    with pytest.raises(ValueError, match="block must be an int"):
        actmax.mlp_unit(1.0, 3)
    with pytest.raises(ValueError, match=r"block must be in \[-2, 2\)"):
        actmax.mlp_unit(5, 3)(ctx)
    with pytest.raises(ValueError, match="unit .* must be < 192"):
        actmax.mlp_unit(0, 192)(ctx)
    with pytest.raises(ValueError, match="3 per-image choices"):
        actmax.mlp_unit(0, [1, 2, 3])(ctx)
    with pytest.raises(ValueError, match="class .* must be < 4"):
        actmax.class_logit(4)(ctx)
    with pytest.raises(ValueError, match="head must be in"):
        actmax.cls_attention(0, 3)(ctx)
    with pytest.raises(ValueError, match="outside the 4 x 4 patch grid"):
        actmax.cls_attention(0, 0, patch=(4, 0))(ctx)
    with pytest.raises(ValueError, match="grid cell"):
        actmax.cls_attention(0, 0, patch=5)
    headless = actmax_vit(num_classes=0)
    with pytest.raises(ValueError, match="no classifier head"):
        actmax.evaluate(headless, actmax.class_logit(0), images)


# ----------------------------------------------------------------------------- parametrisations
def test_pixel_and_fft_parametrisations():
    g = lambda: torch.Generator().manual_seed(3)  # noqa: E731
    p = actmax.PixelImage(2, (16, 24), generator=g())
    assert p.image().shape == (2, 3, 16, 24)
    with torch.no_grad():
        p.pixels.add_(5.0)
    p.project()
    assert float(p.image().detach().max()) == 1.0
    low = actmax.PixelImage(1, 16, lowres=4, generator=g())
    assert low.pixels.shape == (1, 3, 4, 4) and low.image().shape == (1, 3, 16, 16)
    f1, f2 = actmax.FFTImage(2, 16, generator=g()), actmax.FFTImage(2, 16, generator=g())
    img = f1.image().detach()
    assert img.shape == (2, 3, 16, 16) and torch.equal(img, f2.image())
    assert 0 < float(img.min()) and float(img.max()) < 1
    # a spectrum with only the DC term gives a constant image: sigmoid(colour @ (c * scale_0 / (4 * sqrt(HW))))
    flat = actmax.FFTImage(1, 8, decorrelate=False, generator=g())
    with torch.no_grad():
        flat.spectrum.zero_()
        flat.spectrum[0, :, 0, 0, 0] = torch.tensor([1.0, 2.0, 3.0])
    expect = torch.sigmoid(torch.tensor([1.0, 2.0, 3.0]) * 8.0 / (4 * 8))  # scale at f=0 is 1/(1/8) = 8
    assert torch.allclose(flat.image()[0, :, 3, 5], expect, **f32_tol(expect, 8 * 8))  # an 8 x 8 inverse FFT
    freqs = actmax.param.rfft2d_frequencies(4, 4)
    assert torch.allclose(freqs, torch.tensor([[0, 0.25, 0.5], [0.25, 0.25 * math.sqrt(2), math.sqrt(0.3125)],
                                               [0.5, math.sqrt(0.3125), math.sqrt(0.5)],
                                               [0.25, 0.25 * math.sqrt(2), math.sqrt(0.3125)]]))
    with pytest.raises(ValueError, match="lowres"):
        actmax.PixelImage(1, 16, lowres=0)
    with pytest.raises(ValueError, match="batch"):
        actmax.FFTImage(0, 16)


# ----------------------------------------------------------------------------- transforms
def test_roll_moves_by_multiples_of_step():
    x = torch.arange(2 * 3 * 12 * 12, dtype=torch.float32).view(2, 3, 12, 12)
    g = torch.Generator().manual_seed(0)
    for _ in range(5):
        y = T.roll(8, step=4)(x, g)
        for b in range(2):
            hits = [(dy, dx) for dy in range(-8, 9, 4) for dx in range(-8, 9, 4)
                    if torch.equal(y[b], torch.roll(x[b], (dy, dx), dims=(1, 2)))]
            assert hits, "roll(step=4) must be a circular shift by multiples of 4"
    same = T.roll(3)(x, torch.Generator().manual_seed(1)), T.roll(3)(x, torch.Generator().manual_seed(1))
    assert torch.equal(*same)
    with pytest.raises(ValueError, match="step"):
        T.roll(8, step=0)


def test_largest_shift_finds_the_largest_roll_drawn():
    for k, step in ((8, 1), (8, 4), (0, 1)):
        # 400 draws of 2 * (2k / step + 1) values each: every roll size is drawn, so the probe finds k
        assert T.largest_shift(T.roll(k, step=step), 32, n=400) == k
    assert T.largest_shift(T.standard(16, step=1), (64, 48), n=400) == 32      # two patches, colour jitter on
    # rolls past half the image are the short way round: a roll by up to 7 of a 10-px image moves <= 5
    assert T.largest_shift(T.roll(7), 10, n=400) == 5
    assert T.largest_shift(T.compose([]), 16, n=3) == 0
    with pytest.raises(ValueError, match="size"):
        T.largest_shift(T.roll(2), (0, 8))
    with pytest.raises(ValueError, match="n must be"):
        T.largest_shift(T.roll(2), 8, n=0)


def test_geometric_and_colour_transforms():
    x = torch.rand(3, 3, 16, 16)
    g = torch.Generator().manual_seed(0)
    # identities up to the sampling grid's rounding: ~5 eps in [-1, 1], i.e. 5 eps * 16 px, times the
    # largest step between pixels (1)
    tol = f32_tol(1.0, 5 * 16)
    assert torch.allclose(T.scale(1.0, 1.0)(x, g), x, **tol)
    assert torch.allclose(T.rotate(0.0)(x, g), x, **tol)
    y = T.colour_jitter(shift=0.1, scale=0.2)(x, g)
    x00, x11, y00, y11 = x[:, :, 0, 0], x[:, :, 1, 1], y[:, :, 0, 0], y[:, :, 1, 1]
    a = (y00 - y11) / (x00 - x11)  # per channel 1 + a
    # y = x (1 + a) + b rounds 3 times (1 + a, the product, the sum), the differences and the quotient
    # once more: depth 4 at the magnitudes involved, over the difference the quotient divides by
    slack = f32_tol(1.0, 4)["atol"] * (y00.abs() + y11.abs() + 1.2 * (x00.abs() + x11.abs())) / (x00 - x11).abs()
    assert ((a >= 0.8 - slack) & (a <= 1.2 + slack)).all()
    assert T.compose([T.rotate(10), T.scale(0.8, 1.2)])(x, g).shape == x.shape
    with pytest.raises(ValueError, match="lo <= hi"):
        T.scale(1.2, 0.8)
    with pytest.raises(ValueError, match="callable"):
        T.compose([3])


# ----------------------------------------------------------------------------- visualize
def test_visualize_raises_the_objective_and_leaves_the_model_as_it_was(model):
    before = model_snapshot(model)
    obj = actmax.mlp_unit(1, [5, 11]) - 0.05 * actmax.total_variation()
    r = actmax.visualize(model, obj, steps=25, batch=2, copies=3, seed=1, progress=False)
    assert r.images.shape == (2, 3, 32, 32) and r.trace.shape == (25, 2)
    assert 0 <= float(r.images.min()) and float(r.images.max()) <= 1
    assert (r.trace[-5:].mean(0) > r.trace[:5].mean(0) + 0.05).all()
    final = actmax.evaluate(model, actmax.mlp_unit(1, [5, 11]), r.images)
    start = actmax.evaluate(model, actmax.mlp_unit(1, [5, 11]), torch.full_like(r.images, 0.5))
    assert (final > start).all()
    assert_model_unchanged(model, before)


def test_visualize_is_deterministic_per_seed(model):
    kw = dict(steps=6, batch=1, copies=2, progress=False, param="fft", continuity=True, roll_step=1)
    a = actmax.visualize(model, actmax.class_logit(1), seed=5, **kw)
    b = actmax.visualize(model, actmax.class_logit(1), seed=5, **kw)
    c = actmax.visualize(model, actmax.class_logit(1), seed=6, **kw)
    assert torch.equal(a.images, b.images) and torch.equal(a.trace, b.trace)
    assert not torch.equal(a.images, c.images)


def test_visualize_keeps_train_mode_and_flags(model):
    m = actmax_vit()
    m.train()
    m.blocks[0].attn.qkv.weight.requires_grad_(False)
    before = model_snapshot(m)
    actmax.visualize(m, -actmax.cls_attention(1, 0) + actmax.residual_channel(0, 2), steps=2, copies=1,
                     progress=False, transforms=T.compose([T.rotate(5), T.scale(0.9, 1.1)]))
    assert_model_unchanged(m, before)
    assert m.training and not m.blocks[0].attn.qkv.weight.requires_grad


def test_visualize_argument_errors(model):
    unit = actmax.mlp_unit(0, 1)
    for kw, msg in [(dict(steps=0), "steps"), (dict(batch=0), "batch"), (dict(copies=-1), "copies"),
                    (dict(lr=0), "lr"), (dict(betas=(0.5, 1.0)), "betas"), (dict(param="bogus"), "param"),
                    (dict(transforms=5), "transforms"), (dict(continuity=-1.0), "continuity"),
                    (dict(continuity="yes"), "continuity"), (dict(roll_step=0), "roll_step")]:
        with pytest.raises(ValueError, match=msg):
            actmax.visualize(model, unit, progress=False, **{"steps": 1, **kw})
    with pytest.raises(ValueError, match="Objective"):
        actmax.visualize(model, lambda ctx: 0, steps=1, progress=False)
    with pytest.raises(ValueError, match="the model takes"):
        actmax.visualize(model, unit, steps=1, progress=False, param=actmax.PixelImage(1, 16))
    with pytest.raises(ValueError, match="model takes"):
        actmax.evaluate(model, unit, torch.rand(1, 3, 16, 16))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_visualize_on_gpu_matches_cpu_start(model):
    m = actmax_vit().cuda()
    r = actmax.visualize(m, actmax.mlp_unit(1, 3), steps=5, copies=2, progress=False)
    assert r.images.device.type == "cpu" and torch.isfinite(r.trace).all()
    assert (r.trace[-1] > r.trace[0]).all()


# ----------------------------------------------------------------------------- real images
def test_reference_images():
    a, b = actmax.photo_crops(6, 24, seed=0), actmax.photo_crops(6, 24, seed=0)
    assert a.shape == (6, 3, 24, 24) and torch.equal(a, b)
    assert 0 <= float(a.min()) and float(a.max()) <= 1
    assert not torch.equal(a, actmax.photo_crops(6, 24, seed=1))
    assert len({tuple(x.flatten()[:50].tolist()) for x in a}) == 6  # all different
    shapes_model = vitlab.load_model("shapes-vit-tiny", pretrained=False, depth=1)
    scenes = actmax.reference_images(shapes_model, n=3, seed=2)
    from vitlab.shapes import make_scenes
    assert torch.equal(scenes, torch.from_numpy(make_scenes(3, 2).images).permute(0, 3, 1, 2).float() / 255)


def test_hugging_face_vit_class_logit():
    from transformers import ViTConfig, ViTForImageClassification

    torch.manual_seed(0)
    hf = ViTForImageClassification(ViTConfig(image_size=32, patch_size=8, hidden_size=48, num_hidden_layers=2,
                                             num_attention_heads=3, intermediate_size=96, num_labels=4)).eval()
    hf.vitlab_data_config = dict(input_size=(3, 32, 32), mean=(0.5,) * 3, std=(0.5,) * 3)
    assert actmax.patch_size_of(hf) == (8, 8)
    images = torch.rand(2, 3, 32, 32)
    with torch.no_grad():
        logits = hf(pixel_values=(images - 0.5) / 0.5).logits
    assert torch.allclose(actmax.evaluate(hf, actmax.class_logit(3), images), logits[:, 3],
                          **f32_tol(logits, module_depth(hf, tokens=17)))
    before = model_snapshot(hf)
    r = actmax.visualize(hf, actmax.class_logit(3), steps=8, copies=2, progress=False)
    assert r.trace[-1] > r.trace[0]
    assert_model_unchanged(hf, before)


CFG = dict(input_size=(3, 32, 32), mean=(0.5,) * 3, std=(0.5,) * 3, interpolation="bilinear", crop_pct=1.0,
           crop_mode="center")


def test_actmax_cls_attention_refuses_a_model_without_class_token():
    model = tiny_vit(class_token=False, reg_tokens=2, global_pool="avg")
    model.pretrained_cfg = CFG
    with pytest.raises(ValueError, match="no class token"):
        actmax.evaluate(model, actmax.cls_attention(0, 0), torch.rand(1, 3, 32, 32))


def test_actmax_visualize_under_no_grad_works_and_under_inference_mode_says_so():
    model = tiny_vit()
    model.pretrained_cfg = CFG
    before = model_snapshot(model)
    kw = dict(steps=2, copies=1, progress=False, seed=0)
    free = actmax.visualize(model, actmax.class_logit(1), **kw)
    with torch.no_grad():
        under = actmax.visualize(model, actmax.class_logit(1), **kw)
        assert not torch.is_grad_enabled()
    assert torch.equal(free.images, under.images)
    with torch.inference_mode(), pytest.raises(RuntimeError, match=r"actmax.visualize .* inside torch.inference_mode"):
        actmax.visualize(model, actmax.class_logit(1), **kw)
    assert_model_unchanged(model, before)


# --- silent wrong 6: a model in train mode ------------------------------------------------------------
class TokenBatchNorm(torch.nn.Module):
    """BatchNorm over the channels of a B x N x C token sequence (a stem with running statistics)."""

    def __init__(self, dim: int):
        super().__init__()
        self.bn = torch.nn.BatchNorm1d(dim)

    def forward(self, x):
        return self.bn(x.transpose(1, 2)).transpose(1, 2)


def test_actmax_visualize_does_not_update_batchnorm_statistics_in_train_mode():
    model = tiny_vit()
    model.norm_pre = TokenBatchNorm(48).eval()
    model.pretrained_cfg = CFG
    kw = dict(steps=3, copies=2, progress=False, seed=0)
    expected = actmax.visualize(model, actmax.mlp_unit(0, 1), **kw)
    model.train()
    buffers = {k: v.clone() for k, v in model.state_dict().items()}
    got = actmax.visualize(model, actmax.mlp_unit(0, 1), **kw)
    assert all(torch.equal(buffers[k], v) for k, v in model.state_dict().items())  # running stats unchanged
    assert model.training and model.norm_pre.bn.training
    assert torch.equal(got.images, expected.images)
