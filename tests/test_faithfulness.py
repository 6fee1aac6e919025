"""Mask-based measures on hand-built maps and masks with known answers."""
import numpy as np
import pytest
import torch

from vitlab import faithfulness as fa


def square_mask(H=8, W=8, rows=slice(0, 4), cols=slice(0, 4)):
    m = np.zeros((H, W), bool)
    m[rows, cols] = True
    return m


def test_mask_to_grid_is_patch_coverage():
    m = np.zeros((1, 4, 4), bool)
    m[0, 0, 0] = m[0, 0, 1] = True     # half of the top-left 2x2 patch
    m[0, 2:, 2:] = True                 # all of the bottom-right patch
    np.testing.assert_allclose(fa.mask_to_grid(m, (2, 2))[0].numpy(), [[0.5, 0.0], [0.0, 1.0]])


def test_pointing_game_hits_and_misses():
    masks = np.stack([square_mask(), square_mask()])             # object in the top-left quarter
    maps = torch.zeros(2, 2, 2)
    maps[0, 0, 0] = 1.0        # top patch on the object
    maps[1, 1, 1] = 1.0        # top patch off the object
    assert fa.pointing_game(maps, masks).tolist() == [True, False]


def test_pointing_game_coverage_threshold_and_ties():
    m = np.zeros((1, 4, 4), bool)
    m[0, 0, 0] = True                                             # a quarter of patch (0, 0)
    top_left = torch.tensor([[[1.0, 0.0], [0.0, 0.0]]])
    assert fa.pointing_game(top_left, m, min_coverage=0.25).tolist() == [True]
    assert fa.pointing_game(top_left, m, min_coverage=0.5).tolist() == [False]
    flat = torch.ones(1, 2, 2)                                    # all tied: not all on the object
    assert fa.pointing_game(flat, np.stack([square_mask(4, 4, slice(0, 2), slice(0, 2))])).tolist() == [False]
    assert fa.pointing_game(flat, np.ones((1, 4, 4), bool)).tolist() == [True]


def test_mass_on_object_and_chance_level():
    masks = np.stack([square_mask()])                              # a quarter of the image
    uniform = torch.ones(1, 4, 4)
    np.testing.assert_allclose(fa.mass_on_object(uniform, masks).numpy(), fa.object_area(masks).numpy())
    np.testing.assert_allclose(fa.object_area(masks).numpy(), [0.25])
    peaked = torch.zeros(1, 4, 4)
    peaked[0, 0, 0], peaked[0, 3, 3], peaked[0, 3, 0] = 3.0, 1.0, -5.0   # negatives are clamped
    np.testing.assert_allclose(fa.mass_on_object(peaked, masks).numpy(), [0.75])


def test_bad_shapes_are_value_errors():
    with pytest.raises(ValueError, match="B x gh x gw"):
        fa.pointing_game(torch.zeros(2, 2), np.zeros((1, 4, 4), bool))
    with pytest.raises(ValueError, match="2 maps for 1 masks"):
        fa.pointing_game(torch.zeros(2, 2, 2), np.zeros((1, 4, 4), bool))
    with pytest.raises(ValueError, match="not a multiple"):
        fa.mass_on_object(torch.ones(1, 3, 3), np.zeros((1, 4, 4), bool))
    with pytest.raises(ValueError, match="no positive mass"):
        fa.mass_on_object(torch.zeros(1, 2, 2), np.ones((1, 4, 4), bool))
    with pytest.raises(ValueError, match="min_coverage"):
        fa.pointing_game(torch.zeros(1, 2, 2), np.zeros((1, 4, 4), bool), min_coverage=0)
