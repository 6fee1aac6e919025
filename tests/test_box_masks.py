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
