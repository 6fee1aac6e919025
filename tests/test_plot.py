"""vitlab.plot draws what it is given: checked through the arrays matplotlib holds."""
import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from vitlab import plot  # noqa: E402


def test_upsample_nearest_keeps_patch_blocks_and_bilinear_keeps_range():
    m = torch.tensor([[0.0, 1.0], [2.0, 3.0]])
    up = plot.upsample_map(m, (4, 6), mode="nearest")
    assert up.shape == (4, 6)
    np.testing.assert_array_equal(up[:2, :3], 0.0)
    np.testing.assert_array_equal(up[2:, 3:], 3.0)
    bi = plot.upsample_map(m, (8, 8))
    assert bi.min() >= 0.0 and bi.max() <= 3.0


def test_normalize_map():
    np.testing.assert_allclose(plot.normalize_map(np.array([[2.0, 4.0], [3.0, 6.0]])),
                               [[0.0, 0.5], [0.25, 1.0]])
    np.testing.assert_array_equal(plot.normalize_map(np.ones((2, 2))), np.zeros((2, 2)))


def test_overlay_draws_image_and_upsampled_map():
    img = np.zeros((32, 48, 3), dtype=np.uint8)
    ax = plot.overlay(img, torch.tensor([[0.0, 1.0], [0.5, 0.25]]), alpha=0.4, mode="nearest", title="t")
    base, heat = ax.get_images()
    assert base.get_array().shape == (32, 48, 3)
    heat_arr = np.asarray(heat.get_array())
    assert heat_arr.shape == (32, 48) and heat.get_alpha() == 0.4
    assert heat_arr[0, 0] == 0.0 and heat_arr[0, -1] == 1.0 and heat_arr[-1, 0] == 0.5
    assert ax.get_title() == "t"
    plt.close("all")


def test_overlay_rejects_bad_input():
    with pytest.raises(ValueError, match="alpha"):
        plot.overlay(np.zeros((8, 8, 3)), np.zeros((2, 2)), alpha=1.5)
    with pytest.raises(ValueError, match="2-D map"):
        plot.overlay(np.zeros((8, 8, 3)), np.zeros((2, 2, 2)))
    with pytest.raises(ValueError, match="RGB image"):
        plot.overlay(np.zeros((8, 8, 5)), np.zeros((2, 2)))


def test_map_grid_shapes_and_titles():
    maps = torch.rand(2, 3, 4, 4)
    fig = plot.map_grid(maps, titles=[f"m{i}" for i in range(6)], image=np.zeros((16, 16, 3)))
    axes = fig.axes
    assert len(axes) == 6
    assert [a.get_title() for a in axes] == [f"m{i}" for i in range(6)]
    np.testing.assert_allclose(np.asarray(axes[4].get_images()[1].get_array())[::4, ::4].shape, (4, 4))
    with pytest.raises(ValueError, match="2 titles for 6 maps"):
        plot.map_grid(maps, titles=["a", "b"])
    fig2 = plot.map_grid([np.eye(3)] * 5, ncols=2)
    assert len(fig2.axes) == 6  # 3 rows x 2 columns, the last one blank
    np.testing.assert_array_equal(fig2.axes[0].get_images()[0].get_array(), np.eye(3))
    plt.close("all")


def test_table_formats_rows():
    text = plot.table([{"method": "rollout", "pointing": 0.8125}, {"method": "chefer", "pointing": 0.9}])
    lines = text.splitlines()
    assert lines[0].split() == ["method", "pointing"]
    assert lines[2].split() == ["rollout", "0.812"] or lines[2].split() == ["rollout", "0.813"]
    assert lines[3].split() == ["chefer", "0.900"]


def test_class_grid_draws_each_label_in_its_own_colour_as_patch_blocks():
    labels = np.array([[[[0, 1], [2, 1]], [[1, 1], [0, 0]]]])  # 1 row x 2 panels x 2 x 2
    fig = plot.class_grid(labels, ["a", "b", "c"], image=np.zeros((8, 8, 3)), titles=["x", "y"])
    axes = fig.axes
    assert [a.get_title() for a in axes] == ["x", "y"]
    drawn = axes[0].get_images()[1]
    np.testing.assert_array_equal(np.asarray(drawn.get_array()), labels[0, 0])
    assert drawn.get_extent() == [0, 8, 8, 0]  # stretched over the image, one block per patch
    cmap, norm = drawn.get_cmap(), drawn.norm
    colours = {tuple(cmap(norm(v))) for v in (0, 1, 2)}
    assert len(colours) == 3  # three labels, three colours
    legend = fig.legends[0]
    assert [t.get_text() for t in legend.get_texts()] == ["a", "b", "c"]
    outlined = plot.class_grid(labels, ["a", "b", "c"], outline=np.zeros((1, 8, 8), bool) | np.eye(8, dtype=bool))
    assert outlined.axes[0].get_images()[0].get_alpha() in (None, 1.0)  # opaque without an image
    assert outlined.axes[0].get_images()[0].get_extent() == [0, 8, 8, 0]
    assert len(outlined.axes[1].collections) > 0  # the contour is drawn on every panel of the row
    with pytest.raises(ValueError, match="outline must be 1 masks"):
        plot.class_grid(labels, ["a", "b", "c"], outline=np.zeros((2, 8, 8), bool))
    with pytest.raises(ValueError, match="lie in 0 .. 1"):
        plot.class_grid(labels, ["a", "b"])
    with pytest.raises(ValueError, match="integer array"):
        plot.class_grid(labels[0].astype(float), ["a", "b", "c"])
    plt.close("all")
