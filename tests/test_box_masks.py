"""vitlab.localization.box_masks: a detector's boxes filled as masks, checked pixel by pixel
against a plain loop over pixel centres; and map_to_mask's bilinear rule, which grows a patch
by half a patch on every side (what the DETR chapter says of its masks)."""
import numpy as np
import pytest
import torch

from vitlab import localization as loc


def test_box_masks_against_a_loop_over_pixel_centres():
    rng = np.random.default_rng(0)
    corners = np.sort(rng.random((6, 2, 2)), axis=1)                   # x0 < x1, y0 < y1
    boxes = np.stack([corners[:, 0, 0], corners[:, 0, 1], corners[:, 1, 0], corners[:, 1, 1]], 1)
    H, W = 13, 17
    got = loc.box_masks(torch.as_tensor(boxes, dtype=torch.float32), (H, W)).numpy()
    b64 = torch.as_tensor(boxes, dtype=torch.float32).double().numpy()
    want = np.zeros((6, H, W), dtype=bool)
    for d, (x0, y0, x1, y1) in enumerate(b64):
        for r in range(H):
            for c in range(W):
                want[d, r, c] = x0 <= (c + 0.5) / W <= x1 and y0 <= (r + 0.5) / H <= y1
    assert got.shape == (6, H, W) and got.dtype == bool
    assert np.array_equal(got, want)
    assert loc.box_masks(np.array([[0.0, 0.0, 1.0, 1.0]]), (4, 4)).all()
    assert not loc.box_masks(np.array([[0.5, 0.5, 0.5, 0.5]]), (4, 4)).any()   # no pixel centre at 0.5
    with pytest.raises(ValueError, match="D x 4"):
        loc.box_masks(np.zeros((3, 2)), (4, 4))
    with pytest.raises(ValueError, match="NaN or inf"):
        loc.box_masks(np.array([[0.0, np.nan, 1.0, 1.0]]), (4, 4))


def test_bilinear_masks_grow_by_half_a_patch():
    grid = torch.zeros(1, 7, 7)
    grid[0, 3, 3] = 1.0                                          # one patch stands out
    near = loc.map_to_mask(grid, (112, 112), upsample="nearest")
    bil = loc.map_to_mask(grid, (112, 112))
    assert int(near.sum()) == 16 * 16
    rows, cols = np.nonzero(bil[0].numpy())
    # the patch covers pixels 48..63; bilinear > 0 reaches to the neighbours' centres (exclusive)
    assert (rows.min(), rows.max(), cols.min(), cols.max()) == (40, 71, 40, 71)
    assert int(bil.sum()) == 32 * 32


def test_best_patch_mask_is_the_best_union_of_patches():
    import itertools
    rng = np.random.default_rng(1)
    masks = torch.as_tensor(rng.random((5, 6, 9)) < rng.random((5, 1, 1)))   # 2 x 3 patches of 3 x 3 pixels
    masks[4] = False                                                       # an empty object
    got = loc.best_patch_mask(masks, (2, 3))
    assert got.shape == masks.shape and got.dtype == torch.bool
    for b in range(5):
        best = 0.0
        for keep in itertools.product([False, True], repeat=6):           # every union of patches
            g = torch.tensor(keep).view(2, 3).repeat_interleave(3, 0).repeat_interleave(3, 1)
            union = (g | masks[b]).sum().item()
            best = max(best, (g & masks[b]).sum().item() / union if union else 0.0)
        mine = got[b]
        union = (mine | masks[b]).sum().item()
        assert ((mine & masks[b]).sum().item() / union if union else 0.0) == pytest.approx(best, abs=1e-12)
        # whole patches only
        assert (mine.view(2, 3, 3, 3).permute(0, 2, 1, 3).reshape(2, 3, 9).float().std(-1) == 0).all()
    assert not got[4].any()
    with pytest.raises(ValueError, match="not a multiple"):
        loc.best_patch_mask(masks, (4, 3))
