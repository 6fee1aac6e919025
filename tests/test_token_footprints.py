"""What a token reads (vitlab.footprints.token_footprints, footprint_extent) and masks grown by it
(vitlab.localization.grow_masks).

The footprint is checked against the full Jacobian of the token's vector, computed in float64 by
torch.autograd.functional.jacobian on the model's own modules (no recording), and against known
answers on a plain patchify convolution."""
from functools import partial

import numpy as np
import pytest
import torch
from timm.models.vision_transformer import VisionTransformer

from vitlab import footprints as fp_module, localization as loc
from vitlab.layout import token_layout
from vitlab.footprints import (footprint_extent, footprint_mass, footprint_pointing, footprint_regions, object_read,
                               stem_windows, token_footprints)
from vitlab.shapes.model import ConvStemPatchEmbed

from conftest import ROUND32, f32_rounded, f32_rounded_rel, f32_tol, f64_tol, module_depth

pytestmark = pytest.mark.usefixtures("one_thread")


def _conv_stem_vit(dtype=torch.float64, seed=0):
    """16 px images, 4 px patches (a 4 x 4 grid) made by two stride-2 4x4 convolutions, D = 16."""
    torch.manual_seed(seed)
    model = VisionTransformer(img_size=16, patch_size=4, embed_dim=16, depth=2, num_heads=2, num_classes=3,
                              embed_layer=partial(ConvStemPatchEmbed, first_width=8))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        for m in model.modules():                       # BatchNorm statistics that are not trivial
            if isinstance(m, torch.nn.BatchNorm2d):
                m.running_mean.copy_(torch.randn(m.num_features, generator=g) * 0.1)
                m.running_var.copy_(torch.rand(m.num_features, generator=g) + 0.5)
    return model.to(dtype).eval()


def _inputs(n, size=16, dtype=torch.float64, seed=1):
    return torch.randn(n, 3, size, size, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _jacobian_footprint(model, x, block=None):
    """sum over colour of the L2 norm over D of d h_t / d x, mean over images, from the full
    Jacobian of the model's own forward (patch embedding, position embedding, blocks)."""
    def tokens(xi):
        h = model.norm_pre(model.patch_drop(model._pos_embed(model.patch_embed(xi[None]))))
        if block is not None:
            for blk in model.blocks[:block + 1]:
                h = blk(h)
        return h[0, model.num_prefix_tokens:]              # T x D
    out = []
    for xi in x:
        J = torch.autograd.functional.jacobian(tokens, xi)  # T x D x 3 x H x W
        out.append(J.pow(2).sum(1).sqrt().sum(1))           # T x H x W
    gh, gw = model.patch_embed.grid_size
    return torch.stack(out).mean(0).reshape(gh, gw, *x.shape[-2:])


def test_exact_footprint_equals_the_jacobian_of_the_token():
    model, x = _conv_stem_vit(), _inputs(3)
    for block in (None, 0, -1):
        got = token_footprints(model, x, block=block, probes=None)
        want = _jacobian_footprint(model, x, None if block is None else block % 2)
        assert got.shape == (4, 4, 16, 16) and got.dtype == torch.float32
        # float64 throughout, rounded once to float32 at the end (rtol); the float64 Jacobians (forward
        # and backward over 16 + 1 tokens, the norm over D = 16, the sum over 3 colours) in another order
        depth = module_depth(model, tokens=17, grad=True) + 16 + 3
        torch.testing.assert_close(got.double(), want, rtol=f32_rounded_rel(1)["rtol"],
                                   atol=f64_tol(want, depth)["atol"])
    # the embedding's footprint ends where the stem's window (10 px for two 4x4/2 layers) ends
    f = token_footprints(model, x, probes=None)
    assert float(f[0, 0, 10:].abs().max()) == 0.0 and float(f[0, 0, :, 10:].abs().max()) == 0.0
    # after a block, attention has mixed in every token
    assert float(token_footprints(model, x, block=0, probes=None)[0, 0, 12:, 12:].min()) > 0


def test_a_batch_gives_the_mean_of_its_images():
    model, x = _conv_stem_vit(), _inputs(3)
    whole = token_footprints(model, x, probes=None, batch_size=2)
    items = torch.stack([token_footprints(model, x[i:i + 1], probes=None) for i in range(3)]).mean(0)
    # non-negative footprints, each rounded once to float32 from float64 sums in another order
    # (depth: a forward and a backward); the items' mean then adds 3 roundings in float32 (2 sums, 1 division)
    depth = module_depth(model, tokens=17, grad=True) + 16 + 3
    rtol = f32_rounded_rel(2)["rtol"] + 3 * ROUND32 + f64_tol(1.0, depth)["atol"]
    torch.testing.assert_close(whole, items, rtol=rtol, atol=0.0)
    # random directions are drawn per image: the same whatever the batch size (one rounding each side)
    torch.testing.assert_close(token_footprints(model, x, probes=2, batch_size=1),
                               token_footprints(model, x, probes=2, batch_size=3),
                               rtol=f32_rounded_rel(2)["rtol"] + f64_tol(1.0, depth)["atol"], atol=0.0)


def test_random_directions_estimate_the_exact_footprint():
    model = _conv_stem_vit()
    x = _inputs(2).repeat(60, 1, 1, 1)                    # 120 images, 2 distinct: 60 x 4 directions each
    exact = footprint_extent(token_footprints(model, x[:2], probes=None))
    est_f = token_footprints(model, x, probes=4, seed=3)
    est = footprint_extent(est_f)
    # each pixel's estimate is a mean of 240 |N(0, s^2)| draws: relative sd sqrt(pi/2 - 1) / sqrt(240) = 4.9 %
    exact_f = token_footprints(model, x[:2], probes=None)
    assert float(((est_f - exact_f).abs().sum() / exact_f.sum())) < 0.08
    assert float((est.own_patch - exact.own_patch).abs().max()) < 0.03
    torch.testing.assert_close(est.centre, exact.centre, atol=0.25, rtol=0)


def test_a_patchify_convolution_reads_its_own_patch_only():
    model = VisionTransformer(img_size=32, patch_size=8, embed_dim=12, depth=1, num_heads=2, num_classes=2).eval()
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    ext = footprint_extent(token_footprints(model, x, probes=None))
    torch.testing.assert_close(ext.own_patch, torch.ones(4, 4))
    assert bool((ext.side <= 8).all())
    with torch.no_grad():
        model.patch_embed.proj.weight.fill_(1.0)          # every pixel of the patch counts the same
    ext = footprint_extent(token_footprints(model, x, probes=None), mass=(0.5, 0.25, 1.0))
    # equal weights (the gradient is the weight, 1, exactly): the float64 centroid of 64 pixels is the
    # patch centre to float64 rounding of the coordinates (< 32)
    torch.testing.assert_close(ext.offset, torch.zeros(4, 4, 2), atol=f64_tol(32.0, 64 + 1)["atol"], rtol=0)
    # a flat 8 x 8 footprint: half of it is 32 pixels; centred squares of side 2, 4, 6, 8 hold
    # 4, 16, 36, 64 of its 64 pixels, so 0.5 needs side 6, 0.25 side 4, all of it side 8
    assert ext.area[..., 0].unique().tolist() == [32.0]
    assert ext.side[1, 2].tolist() == [6.0, 4.0, 8.0]
    torch.testing.assert_close(ext.margin(0), torch.zeros(4, 4))
    torch.testing.assert_close(ext.margin(2), torch.zeros(4, 4))


def _one_backward_per_token(monkeypatch, model, x, **kwargs):
    """token_footprints as for a stem not known to be local: one backward per token, whose
    gradient counts on every pixel."""
    with monkeypatch.context() as m:
        m.setattr(fp_module, "stem_windows", lambda model, layout, size: None)
        return token_footprints(model, x, **kwargs)


@pytest.mark.parametrize("stem", ["conv", "conv3x3", "patch"])
def test_tokens_sharing_a_backward_give_their_own_footprints_to_the_bit(monkeypatch, stem):
    """Entering block 0, tokens whose stem windows do not overlap share one backward; each token's
    footprint is the one its own backward gives, bit for bit (float32, random directions and
    exact), and it lies inside its window, all of which it reads."""
    from vitlab.shapes.model import ShapesViTConfig, build_shapes_vit

    torch.manual_seed(0)
    model = build_shapes_vit(ShapesViTConfig(img_size=64, depth=1, stem=stem)).eval()
    x = _inputs(3, size=64, dtype=torch.float32)
    layout = token_layout(model, x)
    windows = stem_windows(model, layout, (64, 64))
    groups = fp_module._disjoint_groups(windows, layout.grid)
    assert sorted(t for g in groups for t in g) == list(range(16))
    assert len(groups) == {"conv": 9, "conv3x3": 4, "patch": 1}[stem]
    for kwargs in (dict(probes=1, batch_size=2), dict(probes=2, seed=4)):
        got = token_footprints(model, x, **kwargs)
        assert torch.equal(got, _one_backward_per_token(monkeypatch, model, x, **kwargs))
    # a random direction's gradient is zero only where the whole gradient is (almost surely)
    got = got.reshape(16, 64, 64)
    for t, (rows, cols) in enumerate(windows):
        inside = torch.zeros(64, 64, dtype=torch.bool)
        inside[rows, cols] = True
        assert float(got[t][~inside].abs().max()) == 0.0 and float(got[t][inside].min()) > 0
    if stem == "conv":   # exact, on the small conv-stem ViT (D = 16): 9 groups of its 4 x 4 grid
        small, xs = _conv_stem_vit(torch.float32), _inputs(2, dtype=torch.float32)
        assert len(fp_module._disjoint_groups(stem_windows(small, token_layout(small, xs), (16, 16)), (4, 4))) == 9
        assert torch.equal(token_footprints(small, xs, probes=None),
                           _one_backward_per_token(monkeypatch, small, xs, probes=None))


def test_stems_that_are_not_provably_local_get_one_backward_per_token():
    """A stem whose locality cannot be read from its structure (a GroupNorm pools over the whole
    image; a circular padding wraps around) has no windows, and its footprints are computed one
    backward per token: still the Jacobian's."""
    for change in ("group norm", "circular padding"):
        model = _conv_stem_vit()
        if change == "group norm":
            model.patch_embed.proj[1] = torch.nn.GroupNorm(2, model.patch_embed.proj[0].out_channels).double()
        else:
            model.patch_embed.proj[0].padding_mode = "circular"
        x = _inputs(2)
        assert stem_windows(model, token_layout(model, x), (16, 16)) is None
        got = token_footprints(model, x, probes=None)
        want = _jacobian_footprint(model, x)
        torch.testing.assert_close(got.double(), want, rtol=2e-7, atol=2e-7 * float(want.abs().max()))
        if change == "group norm":   # the whole image counts, beyond the 10 px window
            assert float(want[0, 0, 12:, 12:].abs().max()) > 0


def test_footprint_extent_of_hand_built_footprints():
    f = torch.zeros(2, 2, 8, 8)
    f[0, 0, 1, 2] = 3.0                                   # one pixel, in its own patch (4 x 4 patches)
    f[1, 1, 0, 0] = 1.0                                   # one pixel, far off its patch (rows 4-7, cols 4-7)
    f[0, 1, 0:4, 4:8] = 1.0                               # its own patch, evenly
    f[1, 0, :, :] = 1.0                                   # the whole image, evenly
    ext = footprint_extent(f, mass=(0.5, 1.0))
    np.testing.assert_allclose(ext.centre[0, 0].numpy(), [1.0, 2.0])
    np.testing.assert_allclose(ext.offset[0, 0].numpy(), [-0.5, 0.5])
    np.testing.assert_allclose(ext.offset[1, 1].numpy(), [-5.5, -5.5])
    assert ext.own_patch.tolist() == [[1.0, 1.0], [0.25, 0.0]]
    assert ext.area[0, 0].tolist() == [1.0, 1.0] and ext.area[1, 0].tolist() == [32.0, 64.0]
    # the square must reach pixel (0, 0) from the patch centre (5.5, 5.5): Chebyshev 5.5 -> side 12
    assert ext.side[1, 1].tolist() == [12.0, 12.0]
    assert ext.side[0, 1].tolist() == [4.0, 4.0] and ext.margin(1)[1, 1] == 4.0
    with pytest.raises(ValueError, match="gh x gw x H x W"):
        footprint_extent(f[0])
    with pytest.raises(ValueError, match="zero everywhere"):
        footprint_extent(torch.zeros(2, 2, 8, 8))
    with pytest.raises(ValueError, match="non-negative"):
        footprint_extent(-f)
    with pytest.raises(ValueError, match=r"mass must hold shares in \(0, 1\]"):
        footprint_extent(f, mass=(0.5, 1.5))
    with pytest.raises(ValueError, match="whole number of patches"):
        footprint_extent(torch.ones(3, 3, 8, 8))


def test_footprint_regions_are_the_smallest_sets_holding_the_share():
    f = torch.rand(2, 3, 8, 12, generator=torch.Generator().manual_seed(4)) ** 4
    reg = footprint_regions(f, mass=(0.5, 0.9))
    ext = footprint_extent(f, mass=(0.5, 0.9))
    assert reg.shape == (2, 3, 2, 8, 12) and reg.dtype == torch.bool
    for r in range(2):
        for c in range(3):
            w = (f[r, c] / f[r, c].sum()).double()
            for q, share in enumerate((0.5, 0.9)):
                inside = reg[r, c, q]
                assert int(inside.sum()) == int(ext.area[r, c, q])
                assert float(w[inside].sum()) >= share - 1e-9                 # it holds the share
                smallest_in = float(w[inside].min())
                assert float(w[~inside].max()) <= smallest_in                   # the largest values first
                assert float(w[inside].sum()) - smallest_in < share             # one pixel fewer would not do
            assert bool((reg[r, c, 0] <= reg[r, c, 1]).all())                   # nested
    sq = footprint_regions(f, mass=(0.5, 0.9), shape="square")          # 2 x 3 patches of 4 x 4 px
    for r in range(2):
        for c in range(3):
            for q, share in enumerate((0.5, 0.9)):
                side = int(ext.side[r, c, q])
                w = (f[r, c] / f[r, c].sum()).double()
                assert float(w[sq[r, c, q]].sum()) >= share - 1e-9
                rows, cols = sq[r, c, q].any(1).nonzero()[:, 0], sq[r, c, q].any(0).nonzero()[:, 0]
                cy, cx = r * 4 + 1.5, c * 4 + 1.5                               # the patch centre
                # a square of that side centred on the patch, as far as the image reaches
                assert rows.tolist() == [y for y in range(8) if abs(y - cy) <= (side - 1) / 2]
                assert cols.tolist() == [x for x in range(12) if abs(x - cx) <= (side - 1) / 2]
    with pytest.raises(ValueError, match="'pixels' or 'square'"):
        footprint_regions(f, shape="disc")


def test_token_footprints_refuses_bad_input_and_leaves_the_model_as_it_was():
    model = _conv_stem_vit(torch.float32).train()
    model.blocks[1].requires_grad_(False)
    flags = [(m.training, [p.requires_grad for p in m.parameters(recurse=False)]) for m in model.modules()]
    state = {k: v.clone() for k, v in model.state_dict().items()}
    x = _inputs(2, dtype=torch.float32)
    got = token_footprints(model, x, probes=1)
    assert [(m.training, [p.requires_grad for p in m.parameters(recurse=False)]) for m in model.modules()] == flags
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())   # BatchNorm stats unchanged
    assert all(p.grad is None for p in model.parameters())
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    # it ran in eval mode: the same as on the model put in eval mode
    torch.testing.assert_close(got, token_footprints(model.eval(), x, probes=1))
    bad = x.clone()
    bad[0, 0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN or inf"):
        token_footprints(model, bad)
    with pytest.raises(ValueError, match="non-empty image batch"):
        token_footprints(model, x[:0])
    with pytest.raises(ValueError, match="probes must be a positive int"):
        token_footprints(model, x, probes=0)
    with pytest.raises(ValueError, match=r"block must be None .* \[-2, 2\)"):
        token_footprints(model, x, block=2)
    with pytest.raises(ValueError, match="batch_size must be a positive int"):
        token_footprints(model, x, batch_size=0)


def test_grow_masks_equals_a_brute_force_square_neighbourhood():
    rng = np.random.default_rng(0)
    masks = rng.random((3, 12, 10)) < 0.05
    masks[2] = False
    for margin in (0, 1, 3):
        want = np.zeros(masks.shape)
        for b, y, x in zip(*np.nonzero(masks)):
            want[b, max(0, y - margin):y + margin + 1, max(0, x - margin):x + margin + 1] = 1.0
        np.testing.assert_array_equal(loc.grow_masks(masks, margin).numpy(), want)
    with pytest.raises(ValueError, match="non-negative int"):
        loc.grow_masks(masks, -1)
    with pytest.raises(ValueError, match="B x H x W"):
        loc.grow_masks(masks[0], 1)


def test_object_read_and_the_grades_by_it_against_a_loop_by_hand():
    rng = np.random.default_rng(3)
    fp = torch.as_tensor(rng.random((2, 3, 8, 12)) * (rng.random((2, 3, 8, 12)) < 0.6))   # 2 x 3 grid, 4 px patches
    fp[0, 0] = 0.0
    fp[0, 0, 0, 0] = 2.0                                                  # token (0, 0) reads one pixel
    masks = torch.as_tensor(rng.random((4, 8, 12)) < 0.4)
    masks[0] = False
    masks[0, 0, 0] = True                                                 # scene 0: the object is that pixel
    read = object_read(fp, masks)
    want = torch.zeros(4, 2, 3, dtype=torch.float64)
    for b in range(4):
        for r in range(2):
            for c in range(3):
                want[b, r, c] = (fp[r, c] * masks[b]).sum() / fp[r, c].sum()
    # float64 shares over 8 x 12 pixels in another order, stored as float32 (one rounding)
    torch.testing.assert_close(read.double(), want, **f32_rounded(want, 1, f64_tol(want, 8 * 12)["atol"]))
    assert float(read[0, 0, 0]) == 1.0
    maps = torch.as_tensor(rng.random((4, 2, 3)))
    maps[0] = 0.0
    maps[0, 0, 0] = 1.0                                                   # top token (0, 0): read only object
    maps[1] = 0.5                                                         # a tie over every token
    hits = footprint_pointing(maps, read)
    for b in range(4):
        top = maps[b] == maps[b].max()
        assert bool(hits[b]) == bool((read[b][top] >= 0.5).all())
    assert bool(hits[0])
    assert bool(hits[1]) == bool((read[1] >= 0.5).all())
    mass = footprint_mass(maps, read)
    want = ((maps * read).sum((1, 2)) / maps.sum((1, 2))).double()  # float64 over 6 tokens, as the library
    torch.testing.assert_close(mass.double(), want, **f32_rounded(want, 1, f64_tol(want, 6 + 1)["atol"]))
    # flat: chance; the library rounds once, the float32 mean of 6 values rounds 7 times
    torch.testing.assert_close(footprint_mass(maps[1], read[1]), read[1].mean(), **f32_tol(read[1], 6 + 1 + 1))
    # the patch's own pixels as the footprint: the patch rule's cover, exactly
    own = torch.zeros(2, 3, 8, 12)
    for r in range(2):
        for c in range(3):
            own[r, c, r * 4:(r + 1) * 4, c * 4:(c + 1) * 4] = 1.0
    # shares k / 16 of a 4 x 4 patch: exact in float32 on both sides
    torch.testing.assert_close(object_read(own, masks), loc.mask_to_grid(masks, (2, 3)).float(), atol=0, rtol=0)
    with pytest.raises(ValueError, match="image size"):
        object_read(fp, masks[:, :4])
    with pytest.raises(ValueError, match="zero everywhere"):
        object_read(torch.zeros(2, 3, 8, 12), masks)
    with pytest.raises(ValueError, match="min_share"):
        footprint_pointing(maps, read, min_share=0.0)
    with pytest.raises(ValueError, match="NaN"):
        footprint_pointing(torch.full((4, 2, 3), float("nan")), read)
    with pytest.raises(ValueError, match="non-negative"):
        footprint_mass(-maps, read)
