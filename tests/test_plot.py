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
    assert (heat.norm.vmin, heat.norm.vmax) == (0.0, 1.0) and heat.get_cmap().name.startswith(plot.SEQUENTIAL_CMAP)
    assert ax.figure.axes == [ax]                                    # no colour bar unless asked
    assert ax.get_title() == "t"
    plt.close("all")


def test_overlay_rejects_bad_input():
    with pytest.raises(ValueError, match="alpha"):
        plot.overlay(np.zeros((8, 8, 3)), np.zeros((2, 2)), alpha=1.5)
    with pytest.raises(ValueError, match="2-D map"):
        plot.overlay(np.zeros((8, 8, 3)), np.zeros((2, 2, 2)))
    with pytest.raises(ValueError, match="RGB image"):
        plot.overlay(np.zeros((8, 8, 5)), np.zeros((2, 2)))


def _panels(fig):
    return [a for a in fig.axes if a.get_label() != "<colorbar>"]


def _colorbars(fig):
    return [a for a in fig.axes if a.get_label() == "<colorbar>"]


def _heat(ax):
    """The map drawn on a panel (the last image: over the photo when there is one)."""
    return ax.get_images()[-1]


def test_map_grid_shapes_and_titles():
    maps = torch.rand(2, 3, 4, 4)
    fig = plot.map_grid(maps, titles=[f"m{i}" for i in range(6)], image=np.zeros((16, 16, 3)))
    axes = _panels(fig)
    assert len(axes) == 6 and len(_colorbars(fig)) == 1
    assert [a.get_title() for a in axes] == [f"m{i}" for i in range(6)]
    np.testing.assert_allclose(np.asarray(axes[4].get_images()[1].get_array())[::4, ::4].shape, (4, 4))
    with pytest.raises(ValueError, match="2 titles for 6 maps"):
        plot.map_grid(maps, titles=["a", "b"])
    fig2 = plot.map_grid([np.eye(3)] * 5, ncols=2)
    assert len(_panels(fig2)) == 6  # 3 rows x 2 columns, the last one blank
    np.testing.assert_array_equal(_panels(fig2)[0].get_images()[0].get_array(), np.eye(3))
    assert _panels(fig2)[5].get_images() == []
    plt.close("all")


def test_shared_grid_puts_every_panel_on_the_range_over_all_panels():
    maps = torch.stack([torch.rand(4, 4) * s + o for s, o in [(1.0, 0.0), (5.0, 2.0), (0.1, 0.3)]])
    fig = plot.map_grid(list(maps), image=np.zeros((16, 16, 3)), label="rollout")
    lo, hi = float(maps.min()), float(maps.max())
    for ax in _panels(fig):
        assert (_heat(ax).norm.vmin, _heat(ax).norm.vmax) == pytest.approx((lo, hi))
    (bar,) = _colorbars(fig)                    # one bar for the grid, with the shared limits
    assert bar.get_ylim() == pytest.approx((lo, hi))
    assert bar.get_ylabel() == "rollout"
    # shared=False: every panel on its own range, with its own bar
    own = plot.map_grid(list(maps), shared=False)
    want = np.array([(float(m.min()), float(m.max())) for m in maps])
    # the same numbers as the maps' own minima and maxima
    np.testing.assert_allclose([(_heat(a).norm.vmin, _heat(a).norm.vmax) for a in _panels(own)], want, rtol=0)
    np.testing.assert_allclose([b.get_ylim() for b in _colorbars(own)], want, rtol=0)
    # explicit limits win, and colorbar=False draws none
    fixed = plot.map_grid(list(maps), vmin=0.0, vmax=2.0, colorbar=False)
    assert _colorbars(fixed) == []
    assert {(_heat(a).norm.vmin, _heat(a).norm.vmax) for a in _panels(fixed)} == {(0.0, 2.0)}
    plt.close("all")


def test_grid_shared_per_row_and_per_column():
    maps = torch.arange(2 * 3 * 4, dtype=torch.float32).reshape(2, 3, 2, 2)   # rows x cols x gh x gw
    by_row = plot.map_grid(maps, shared="row")
    limits = [(_heat(a).norm.vmin, _heat(a).norm.vmax) for a in _panels(by_row)]
    assert limits == [(0.0, 11.0)] * 3 + [(12.0, 23.0)] * 3
    assert [b.get_ylim() for b in _colorbars(by_row)] == [(0.0, 11.0), (12.0, 23.0)]
    by_col = plot.map_grid(maps, shared="col")
    limits = [(_heat(a).norm.vmin, _heat(a).norm.vmax) for a in _panels(by_col)]
    assert limits == [(0.0, 15.0), (4.0, 19.0), (8.0, 23.0)] * 2
    assert [b.get_xlim() for b in _colorbars(by_col)] == [(0.0, 15.0), (4.0, 19.0), (8.0, 23.0)]  # bars below
    # group keys, one per map: maps with the same key share a scale and a bar labelled with the key
    keys = ["a", "b", "b"] * 2
    by_key = plot.map_grid(maps, shared=keys)
    limits = [(_heat(a).norm.vmin, _heat(a).norm.vmax) for a in _panels(by_key)]
    assert limits == [(0.0, 15.0), (4.0, 23.0), (4.0, 23.0)] * 2
    assert [(b.get_xlim(), b.get_xlabel()) for b in _colorbars(by_key)] == [((0.0, 15.0), "a"), ((4.0, 23.0), "b")]
    with pytest.raises(ValueError, match="one key per map: got 2 keys for 6 maps"):
        plot.map_grid(maps, shared=["a", "b"])
    plt.close("all")


def test_percentile_scale_clips_the_bar_at_the_percentile_and_says_so():
    rng = np.random.default_rng(0)
    maps = [rng.random((8, 8)) * 0.1 for _ in range(3)]
    maps[1][3, 4] = 10.0                                       # one spike among 192 patch values
    fig = plot.map_grid(maps, scale="percentile", percentile=95, label="rollout")
    top = float(np.percentile(np.concatenate([m.ravel() for m in maps]), 95))
    assert top < 0.1
    for ax in _panels(fig):
        assert _heat(ax).norm.vmin == pytest.approx(min(m.min() for m in maps))
        assert _heat(ax).norm.vmax == pytest.approx(top)
    (bar,) = _colorbars(fig)
    assert bar.get_ylim()[1] == pytest.approx(top)
    assert bar.get_ylabel() == "rollout\n(clipped at the 95th percentile)"
    # a percentile above every value but the spike's clips nothing: plain limits, no note
    ms = plot.map_scale([np.array([[0.0, 1.0], [2.0, 3.0]])], "percentile", percentile=100)
    assert (ms.norm.vmin, ms.norm.vmax, ms.note, ms.extend) == (0.0, 3.0, "", "neither")
    assert plot.map_scale(maps, "percentile", percentile=95).extend == "max"
    plt.close("all")


def test_log_scale_and_signed_maps():
    m = np.array([[2e-3, 1e-2], [0.0, 1.0]])
    ax = plot.show_map(m, scale="log", colorbar=True)
    norm = ax.get_images()[0].norm
    assert isinstance(norm, matplotlib.colors.LogNorm)
    assert (norm.vmin, norm.vmax) == pytest.approx((2e-3, 1.0))   # the smallest positive value to the largest
    assert "log scale" in _colorbars(ax.figure)[0].get_ylabel()
    with pytest.raises(ValueError, match="scale='log' needs maps without negative values"):
        plot.show_map(m - 0.5, scale="log")
    with pytest.raises(ValueError, match="positive lower limit"):
        plot.map_scale([m], "log", vmin=0.0)
    with pytest.raises(ValueError, match="needs a positive value in the maps"):
        plot.map_scale([np.zeros((2, 2))], "log")
    # a signed map: diverging colormap, limits symmetric about 0
    signed = np.array([[-0.5, 0.1], [0.2, 2.0]])
    ms = plot.map_scale([signed])
    assert (ms.norm.vmin, ms.norm.vmax) == (-2.0, 2.0) and ms.cmap.name.startswith(plot.DIVERGING_CMAP)
    assert ms.norm(0.0) == pytest.approx(0.5)
    assert plot.map_scale([np.abs(signed)]).cmap.name.startswith(plot.SEQUENTIAL_CMAP)
    pct = plot.map_scale([signed], "percentile", percentile=50)
    a = float(np.percentile(np.abs(signed), 50))
    assert (pct.norm.vmin, pct.norm.vmax) == pytest.approx((-a, a)) and pct.extend == "both"
    plt.close("all")


def test_nearest_view_is_constant_within_each_patch_and_both_draws_both():
    m = torch.tensor([[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]])         # 2 x 3 patches
    img = np.zeros((20, 30, 3))                                   # 10-px patches
    ax = plot.overlay(img, m, mode="nearest")
    drawn = np.asarray(_heat(ax).get_array())
    for r in range(2):
        for c in range(3):
            np.testing.assert_array_equal(drawn[10 * r:10 * r + 10, 10 * c:10 * c + 10], float(m[r, c]))
    fig = plot.map_grid([m, 2 * m], titles=["a", "b"], image=img, mode="both")
    axes = _panels(fig)
    assert [a.get_title() for a in axes] == ["a\nsmooth", "a\nper patch", "b\nsmooth", "b\nper patch"]
    smooth, blocky = (np.asarray(_heat(a).get_array()) for a in axes[2:])
    np.testing.assert_array_equal(blocky, np.kron(2 * m.numpy(), np.ones((10, 10))))
    assert len(np.unique(smooth)) > 6                            # bilinear: values between the patches
    assert smooth.min() >= 0.0 and smooth.max() <= 10.0 + 1e-5   # within the patch values
    assert {(_heat(a).norm.vmin, _heat(a).norm.vmax) for a in axes} == {(0.0, 10.0)}
    plt.close("all")


def test_grid_labels_name_blocks_and_heads():
    maps = torch.rand(3, 2, 4, 4)                                  # blocks x heads
    fig = plot.map_grid(maps, image=np.zeros((8, 8, 3)), row_labels=[f"block {b}" for b in range(3)],
                        col_labels=["head 0", "head 1"])
    axes = _panels(fig)
    assert [axes[2 * b].get_ylabel() for b in range(3)] == ["block 0", "block 1", "block 2"]
    assert [axes[0].get_title(), axes[1].get_title()] == ["head 0", "head 1"]
    with pytest.raises(ValueError, match="2 row labels for 3 rows"):
        plot.map_grid(maps, row_labels=["a", "b"])
    with pytest.raises(ValueError, match="1 column labels for 2 columns"):
        plot.map_grid(maps, col_labels=["a"])
    plt.close("all")


def test_overlay_draws_the_image_in_grey_under_the_map():
    img = np.zeros((4, 4, 3), np.float32)
    img[..., 0] = 1.0                                               # pure red
    base = plot.overlay(img, np.eye(2)).get_images()[0].get_array()
    np.testing.assert_allclose(base, 0.299)                          # its luma, in all three channels
    colour = plot.overlay(img, np.eye(2), gray_image=False).get_images()[0].get_array()
    np.testing.assert_array_equal(colour, img)
    plt.close("all")


def test_bad_scale_arguments_raise_clear_errors():
    m = [np.eye(3)]
    with pytest.raises(ValueError, match="scale must be one of"):
        plot.map_grid(m, scale="loud")
    with pytest.raises(ValueError, match="shared must be True, False, 'row', 'col' or one group key per map"):
        plot.map_grid(m, shared="diagonal")
    with pytest.raises(ValueError, match="mode must be one of"):
        plot.map_grid(m, mode="cubic")
    with pytest.raises(ValueError, match="mode must be one of"):
        plot.overlay(np.zeros((6, 6, 3)), m[0], mode="both")
    for p in (0, 150, True):
        with pytest.raises(ValueError, match="percentile must be a number in \\(0, 100\\]"):
            plot.map_grid(m, scale="percentile", percentile=p)
    with pytest.raises(ValueError, match="vmin must be below vmax, got vmin=1.0, vmax=0.5"):
        plot.map_grid(m, vmin=1.0, vmax=0.5)
    with pytest.raises(ValueError, match="no finite value"):
        plot.map_scale([np.full((2, 2), np.nan)])
    with pytest.raises(ValueError, match="ncols must be a positive int"):
        plot.map_grid(m, ncols=0)
    assert [plot.ordinal(p) for p in (1, 2, 3, 11, 12, 22, 95, 99.5)] == [
        "1st", "2nd", "3rd", "11th", "12th", "22nd", "95th", "99.5th"]
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


def test_class_grid_draws_no_class_in_grey():
    # with eight or nine classes tab10 would give one class its grey, which reads as "no class"
    for k in (8, 9):
        labels = np.arange(k).reshape(1, 1, 1, k)
        drawn = plot.class_grid(labels, [str(i) for i in range(k)]).axes[0].get_images()[0]
        colours = [drawn.get_cmap()(drawn.norm(v))[:3] for v in range(k)]
        assert len(set(colours)) == k
        assert not any(max(c) - min(c) < 0.05 for c in colours), colours
    plt.close("all")


def test_image_grid_marks_patch_borders_and_crops_pixel_for_pixel():
    img = np.arange(28 * 28 * 3, dtype=np.float32).reshape(28, 28, 3) / (28 * 28 * 3)
    fig = plot.image_grid([img, img], ["a", "b"], patch=7)
    ax = fig.axes[0]
    np.testing.assert_array_equal(ax.get_xticks(), [6.5, 13.5, 20.5])    # between pixels 6|7, 13|14, 20|21
    np.testing.assert_array_equal(ax.get_yticks(), [6.5, 13.5, 20.5])
    np.testing.assert_allclose(ax.get_images()[0].get_array(), img)
    zoom = plot.image_grid([img], patch=7, crop=(10, 3, 8, 12)).axes[0]
    shown = zoom.get_images()[0]
    np.testing.assert_allclose(shown.get_array(), img[10:18, 3:15])
    assert shown.get_interpolation() == "nearest"
    assert shown.get_extent() == [2.5, 14.5, 17.5, 9.5]                    # the image's own pixel coordinates
    np.testing.assert_array_equal(zoom.get_xticks(), [6.5, 13.5])
    np.testing.assert_array_equal(zoom.get_yticks(), [13.5])
    with pytest.raises(ValueError, match="reaches outside image 0 of size 28 x 28"):
        plot.image_grid([img], crop=(20, 0, 10, 5))
    with pytest.raises(ValueError, match="crop must be"):
        plot.image_grid([img], crop=(0, 0, 5))
    with pytest.raises(ValueError, match="patch must be a positive int"):
        plot.image_grid([img], patch=0)
    with pytest.raises(ValueError, match="1 titles for 2 images"):
        plot.image_grid([img, img], ["a"])
    plt.close("all")


def test_pointing_marks_box_the_top_patch_and_colour_hits_and_misses():
    maps = [torch.tensor([[0.0, 1.0], [0.2, 0.3]]), torch.tensor([[0.0, 0.1], [0.9, 0.3]])]
    masks = np.zeros((2, 8, 8), bool)
    masks[:, :4, 4:] = True                                      # the object: the top-right patch
    fig = plot.map_grid(maps, image=np.zeros((8, 8, 3)), outline=masks, hits=[True, False], mode="nearest")
    boxes = [ax.patches[0] for ax in _panels(fig)]
    assert [(b.get_x(), b.get_y(), b.get_width(), b.get_height()) for b in boxes] == [(3.5, -0.5, 4, 4), (-0.5, 3.5, 4, 4)]
    assert [matplotlib.colors.to_hex(b.get_edgecolor()) for b in boxes] == ["#00ff00", "#ff0000"]
    assert all(len(ax.collections) > 0 for ax in _panels(fig))   # the contour of the mask
    assert plot.top_patch(maps[1]) == (1, 0)
    alone = plot.map_grid(maps, mark_top=True)                       # no image: one cell per patch
    b = _panels(alone)[0].patches[0]
    assert (b.get_x(), b.get_y(), b.get_width(), b.get_height()) == (0.5, -0.5, 1.0, 1.0)
    with pytest.raises(ValueError, match="outline needs an image"):
        plot.map_grid(maps, outline=masks)
    with pytest.raises(ValueError, match="one H x W mask or 2 of them"):
        plot.map_grid(maps, image=np.zeros((8, 8, 3)), outline=masks[:1, None])
    with pytest.raises(ValueError, match="1 hits for 2 maps"):
        plot.map_grid(maps, hits=[True])
    plt.close("all")


def test_outline_is_white_on_black_and_an_opaque_map_shows_its_own_colours():
    # a black object under the map: with alpha=1 the panel's colours are the map's colours, exactly
    maps = [torch.tensor([[0.0, 1.0], [0.5, 0.25]])]
    masks = np.zeros((1, 8, 8), bool)
    masks[0, 2:6, 2:6] = True
    image = np.ones((8, 8, 3))
    image[masks[0]] = 0.0
    fig = plot.map_grid(maps, image=image, outline=masks, mode="nearest", alpha=1.0)
    ax = _panels(fig)[0]
    heat = ax.get_images()[-1]
    assert heat.get_alpha() == 1.0
    rgba = heat.to_rgba(heat.get_array())[..., :3]                  # what the heat layer paints
    want = heat.cmap(heat.norm(plot.upsample_map(maps[0], (8, 8), "nearest")))[..., :3]
    np.testing.assert_allclose(rgba, want, atol=1 / 255)
    lines = [(matplotlib.colors.to_hex(c.get_edgecolor()[0]), float(np.ravel(c.get_linewidth())[0]))
             for c in ax.collections]
    assert lines == [("#000000", 2.6), ("#ffffff", 1.0)]           # a wide black line under a white one
    plt.close("all")


def test_footprints_box_the_patch_mark_the_centre_and_outline_each_region():
    f = np.zeros((2, 8, 8))
    f[0, 2:6, 2:6] = 1.0
    f[1, 0:3, 0:3] = 2.0
    inner = np.zeros((8, 8), bool)
    inner[3:5, 3:5] = True
    regions = [[inner, f[0] > 0], [f[1] > 0, f[1] > 0]]
    fig = plot.footprints(list(f), boxes=[(2, 2, 4, 4), (0, 0, 4, 4)], regions=regions, centres=[(3.5, 3.5), (1, 1)],
                          titles=["a", "b"], region_labels=["50%", "90%"], label="share")
    axes = _panels(fig)
    assert len(axes) == 2 and len(_colorbars(fig)) == 1                   # one colour scale for both
    assert _heat(axes[1]).norm.vmax == 2.0 and _heat(axes[0]).norm.vmax == 2.0
    box = axes[0].patches[0]
    assert (box.get_x(), box.get_y(), box.get_width(), box.get_height()) == (1.5, 1.5, 4, 4)
    assert matplotlib.colors.to_hex(box.get_edgecolor()) == "#00ffff"
    assert axes[0].lines[0].get_xydata().tolist() == [[3.5, 3.5]]          # the centre: (row, column) -> (x, y)
    assert len(axes[0].collections) == 2 and len(axes[1].collections) == 2  # one outline per region
    assert [t.get_text() for t in axes[0].get_legend().get_texts()] == ["50%", "90%", "the token's patch"]
    with pytest.raises(ValueError, match="got 1 boxes for 2 footprints"):
        plot.footprints(list(f), boxes=[(0, 0, 4, 4)])
    with pytest.raises(ValueError, match="footprint's shape"):
        plot.footprints(list(f), boxes=[(0, 0, 4, 4)] * 2, regions=[[np.ones((4, 4))], [np.ones((4, 4))]])
    plt.close("all")


def test_line_plot_shades_each_band_in_its_curve_colour():
    ax = plot.line_plot({"a": [0.2, 0.5, 0.4], "b": torch.tensor([0.1, 0.1, 0.2])},
                        bands={"a": ([0.1, 0.4, 0.3], [0.3, 0.6, 0.5])})
    (band,) = ax.collections
    assert matplotlib.colors.to_hex(band.get_facecolor()[0][:3]) == matplotlib.colors.to_hex(ax.lines[0].get_color())
    verts = band.get_paths()[0].vertices
    assert verts[:, 1].min() == pytest.approx(0.1) and verts[:, 1].max() == pytest.approx(0.6)
    with pytest.raises(ValueError, match=r"not in series: \['c'\]"):
        plot.line_plot({"a": [1, 2]}, bands={"c": ([0, 1], [1, 2])})
    with pytest.raises(ValueError, match="a low and a high value per point"):
        plot.line_plot({"a": [1, 2]}, bands={"a": ([0], [1])})
    plt.close("all")


def test_family_styles_gives_every_curve_its_own_style():
    names = ["relevance (every block)", "relevance (last block)", "raw attention", "rollout", "GradCAM",
             "Grad-ECLIP (every block)", "Grad-ECLIP (last block)", "LeGrad (every block)",
             "LeGrad (last two blocks)", "decomposition", "random map"]
    st = plot.family_styles(names)
    key = lambda d: (matplotlib.colors.to_hex(d["color"]), d["linestyle"], d["marker"])
    assert len({key(st[n]) for n in names}) == len(names)                      # 11 curves, 11 styles
    assert st["LeGrad (every block)"]["color"] == st["LeGrad (last two blocks)"]["color"]     # one colour a method
    assert st["LeGrad (every block)"]["linestyle"] != st["LeGrad (last two blocks)"]["linestyle"]
    colours = [matplotlib.colors.to_hex(st[n]["color"]) for n in names if "(last" not in n]
    assert len(set(colours)) == len(colours)                                   # methods differ in colour
    assert matplotlib.colors.to_hex(st["random map"]["color"]) == "#737373" and st["random map"]["linestyle"] == ":"
    many = plot.family_styles([f"m{i} (a)" for i in range(20)] + [f"m0 (s{k})" for k in range(6)])
    assert len({key(d) for d in many.values()}) == 26                          # past the colours and the dashes
    with pytest.raises(ValueError, match="distinct names"):
        plot.family_styles(["a", "a"])


def test_line_plot_draws_the_styles_it_is_given():
    series = {n: [3.0 - i, 2.0, 1.0] for i, n in enumerate(["a (x)", "a (y)", "b", "random map"])}
    ax = plot.line_plot(series, styles="families", legend="outside")
    st = plot.family_styles(list(series))
    for line, n in zip(ax.lines, series):
        assert line.get_label() == n and line.get_linestyle() == {"-": "-", "--": "--", ":": ":", "-.": "-."}[st[n]["linestyle"]]
        assert matplotlib.colors.to_hex(line.get_color()) == matplotlib.colors.to_hex(st[n]["color"])
    assert ax.lines[0].get_linestyle() != ax.lines[1].get_linestyle()
    assert ax.get_legend().get_bbox_to_anchor().x0 > ax.get_window_extent().x1 - 1      # right of the Axes
    ax = plot.line_plot({"a": [1, 2]}, styles={"a": dict(color="red", linestyle="--")})
    assert matplotlib.colors.to_hex(ax.lines[0].get_color()) == "#ff0000" and ax.lines[0].get_linestyle() == "--"
    with pytest.raises(ValueError, match=r"styles names curves that are not in series: \['c'\]"):
        plot.line_plot({"a": [1, 2]}, styles={"c": {}})
    with pytest.raises(ValueError, match="'families'"):
        plot.line_plot({"a": [1, 2]}, styles="rainbow")
    with pytest.raises(ValueError, match="legend must be"):
        plot.line_plot({"a": [1, 2]}, legend="below")
    plt.close("all")


def test_attention_matrix_frames_the_cls_row():
    A = torch.softmax(torch.randn(5, 5, generator=torch.Generator().manual_seed(0)), -1)
    ax = plot.attention_matrix(A, num_prefix=1, title="block 0")
    np.testing.assert_array_equal(ax.get_images()[0].get_array(), A.numpy())  # the matrix itself
    frame = ax.patches[0]
    assert (frame.get_x(), frame.get_y(), frame.get_width(), frame.get_height()) == (-0.5, -0.5, 5, 1)
    assert ax.get_xlabel() == "key token j" and ax.get_ylabel() == "query token i"
    assert _colorbars(ax.figure)[0].get_ylim() == pytest.approx((float(A.min()), float(A.max())))
    with pytest.raises(ValueError, match="square N x N"):
        plot.attention_matrix(A[:, :4])
    with pytest.raises(ValueError, match="num_prefix must be an int in \\[1, 5\\)"):
        plot.attention_matrix(A, num_prefix=0)
    plt.close("all")


def test_colorbar_is_shared_by_the_axes_given():
    fig, axes = plt.subplots(1, 2)
    ms = plot.map_scale([np.array([[0.0, 2.0]])], cmap="gray")
    bar = plot.colorbar(list(axes), ms, label="value")
    assert bar.ax.get_ylim() == (0.0, 2.0) and bar.ax.get_ylabel() == "value"
    assert bar.mappable.get_cmap().name.startswith("gray")
    plt.close("all")
