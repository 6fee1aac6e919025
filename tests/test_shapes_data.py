"""vitlab.shapes.data: generated scenes, their labels and their exact object masks."""
from __future__ import annotations

import math
import time

import numpy as np
import pytest

from conftest import f32_tol
from vitlab.shapes import CLASSES, centres_per_patch, make_scenes, scenes_to_tensor
from vitlab.shapes.data import MIN_CONTRAST, _render_scenes, _shape_inside, remove_objects

LUMA = np.array([0.299, 0.587, 0.114])


def _background_only(n, seed, n_objects, difficulty, size=112):
    return _render_scenes(n, seed, n_objects, difficulty=difficulty, size=size, with_objects=False)


@pytest.mark.parametrize("n_objects", [1, 2])
def test_shapes_and_types(n_objects):
    s = make_scenes(12, 3, n_objects)
    assert s.images.shape == (12, 112, 112, 3) and s.images.dtype == np.uint8
    assert s.labels.shape == (12, n_objects) and np.issubdtype(s.labels.dtype, np.integer)
    assert s.masks.shape == (12, n_objects, 112, 112) and s.masks.dtype == bool
    assert s.classes == CLASSES and len(set(CLASSES)) >= 8
    assert len(s) == 12
    assert s.labels.min() >= 0 and s.labels.max() < len(CLASSES)


def test_other_size():
    s = make_scenes(3, 0, 2, size=64)
    assert s.images.shape == (3, 64, 64, 3) and s.masks.shape == (3, 2, 64, 64)


def test_deterministic_per_seed_and_seeds_differ():
    a, b, c = make_scenes(8, 11, 2), make_scenes(8, 11, 2), make_scenes(8, 12, 2)
    assert np.array_equal(a.images, b.images) and np.array_equal(a.masks, b.masks)
    assert np.array_equal(a.labels, b.labels)
    assert not np.array_equal(a.images, c.images)
    # a prefix of a larger batch is not required to match, but every scene must differ from the others
    flat = a.images.reshape(8, -1)
    assert len({row.tobytes() for row in flat}) == 8


@pytest.mark.parametrize("difficulty", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("n_objects", [1, 2])
def test_masks_are_exactly_the_pixels_the_objects_change(difficulty, n_objects):
    s = make_scenes(40, 5, n_objects, difficulty=difficulty)
    bg = _background_only(40, 5, n_objects, difficulty)
    changed = (s.images != bg.images).any(-1)
    assert np.array_equal(changed, s.masks.any(1))
    assert np.array_equal(s.labels, bg.labels)


def test_contrast_with_the_background_behind_the_object():
    # plain scenes: every object pixel differs in luminance from the background behind it
    s = make_scenes(60, 8, 2, difficulty=0.0)
    bg = _background_only(60, 8, 2, 0.0)
    dl = np.abs(s.images.astype(float) @ LUMA - bg.images.astype(float) @ LUMA)
    on = s.masks.any(1)
    assert dl[on].min() >= MIN_CONTRAST - 1.5  # -1.5: rounding to uint8
    # cluttered scenes: strokes and blobs of any colour may pass behind an object, and pixel
    # noise is added; still nearly every object pixel keeps the contrast
    s = make_scenes(60, 8, 1, difficulty=1.0)
    bg = _background_only(60, 8, 1, 1.0)
    dl = np.abs(s.images.astype(float) @ LUMA - bg.images.astype(float) @ LUMA)
    assert np.mean(dl[s.masks[:, 0]] >= MIN_CONTRAST - 1.5) > 0.95


def test_plain_background_is_one_colour_and_clutter_adds_variety():
    plain = _background_only(10, 2, 1, 0.0)
    for img in plain.images:
        assert len(np.unique(img.reshape(-1, 3), axis=0)) == 1
    busy = _background_only(10, 2, 1, 1.0)
    for img in busy.images:
        assert len(np.unique(img.reshape(-1, 3), axis=0)) > 100


def test_objects_are_visible_and_sized():
    s = make_scenes(200, 4, 1)
    area = s.masks.sum((2, 3))[:, 0]
    # radius 15..30 px; the smallest shape (cross, star) still covers > 200 px
    assert area.min() > 200 and area.max() < 0.25 * 112 * 112


def test_two_objects_differ_in_class_and_do_not_touch():
    s = make_scenes(300, 9, 2)
    assert np.all(s.labels[:, 0] != s.labels[:, 1])
    m0, m1 = s.masks[:, 0], s.masks[:, 1]
    assert not np.any(m0 & m1)
    # grow object 1 by one pixel (4-neighbourhood): it must not reach object 0. If the
    # objects overlapped, object 0's visible part would border object 1.
    grown = m1.copy()
    grown[:, 1:] |= m1[:, :-1]
    grown[:, :-1] |= m1[:, 1:]
    grown[:, :, 1:] |= m1[:, :, :-1]
    grown[:, :, :-1] |= m1[:, :, 1:]
    assert not np.any(grown & m0)
    assert m0.sum((1, 2)).min() > 150 and m1.sum((1, 2)).min() > 150


def test_classes_are_balanced():
    s = make_scenes(2000, 1, 1, size=32)
    counts = np.bincount(s.labels[:, 0], minlength=len(CLASSES))
    assert counts.min() > 2000 / len(CLASSES) * 0.75


# Known areas of the unit shapes (every shape fits in the unit disc).
KNOWN_AREAS = {
    "circle": math.pi * 0.85**2,
    "square": 1.36**2,
    "triangle": 3 * math.sqrt(3) / 4,  # equilateral, circumradius 1
    "star": 5 * 1.0 * 0.42 * math.sin(math.pi / 5),  # 10 triangles between outer and inner vertices
    "cross": 2 * (0.56 * 1.84) - 0.56**2,
    "ring": math.pi * (0.92**2 - 0.52**2),
}


@pytest.mark.parametrize("name", sorted(KNOWN_AREAS))
def test_unit_shape_areas(name):
    g = np.linspace(-1, 1, 801)
    u, v = np.meshgrid(g, g)
    inside = _shape_inside(CLASSES.index(name), u, v)
    area = inside.mean() * 4.0
    assert area == pytest.approx(KNOWN_AREAS[name], rel=0.01)  # the 801 x 801 grid's discretisation, not rounding


def test_every_shape_fits_the_unit_disc_and_shapes_differ():
    g = np.linspace(-1.2, 1.2, 481)
    u, v = np.meshgrid(g, g)
    outside = u**2 + v**2 > 1.0
    masks = [_shape_inside(k, u, v) for k in range(len(CLASSES))]
    for k, m in enumerate(masks):
        assert not np.any(m & outside), CLASSES[k]
        assert m.mean() > 0.05, CLASSES[k]
    for a in range(len(masks)):
        for b in range(a + 1, len(masks)):
            iou = (masks[a] & masks[b]).sum() / (masks[a] | masks[b]).sum()
            assert iou < 0.9, (CLASSES[a], CLASSES[b])  # circle vs ring: 0.84


@pytest.mark.slow
def test_fast_enough():
    # CPU time of this (single-threaded) process, so that other jobs on the machine don't count
    make_scenes(10, 0)
    t = time.process_time()
    make_scenes(1000, 123)
    assert time.process_time() - t < 10.0


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(n=0, seed=0),
        dict(n=-3, seed=0),
        dict(n=2.5, seed=0),
        dict(n=2, seed=-1),
        dict(n=2, seed=0, n_objects=0),
        dict(n=2, seed=0, n_objects=3),
        dict(n=2, seed=0, difficulty=1.5),
        dict(n=2, seed=0, difficulty="hard"),
        dict(n=2, seed=0, size=16),
    ],
)
def test_bad_arguments_raise_value_error(kwargs):
    with pytest.raises(ValueError):
        make_scenes(**kwargs)


def test_scenes_to_tensor_normalises_and_checks_input():
    s = make_scenes(4, 0)
    x = scenes_to_tensor(s.images, (3, 112, 112), (0.5, 0.5, 0.5), (0.25, 0.5, 1.0))
    assert tuple(x.shape) == (4, 3, 112, 112)
    # float32 (p / 255 - m) / s: three roundings of values up to |2|
    expect = (s.images[1, 10, 20, 2] / 255.0 - 0.5) / 1.0
    assert float(x[1, 2, 10, 20]) == pytest.approx(expect, abs=f32_tol(2.0, 3)["atol"])
    expect = (s.images[3, 50, 7, 0] / 255.0 - 0.5) / 0.25
    assert float(x[3, 0, 50, 7]) == pytest.approx(expect, abs=f32_tol(2.0, 3)["atol"])
    one = scenes_to_tensor(s.images[0], (3, 112, 112), (0.5,) * 3, (0.5,) * 3)
    assert tuple(one.shape) == (1, 3, 112, 112)
    with pytest.raises(ValueError, match="expects 96x96"):
        scenes_to_tensor(s.images, (3, 96, 96), (0.5,) * 3, (0.5,) * 3)
    with pytest.raises(ValueError, match="RGB"):
        scenes_to_tensor(s.images[..., :2], (3, 112, 112), (0.5,) * 3, (0.5,) * 3)
    with pytest.raises(ValueError, match="uint8"):
        scenes_to_tensor(s.images.astype(np.float32), (3, 112, 112), (0.5,) * 3, (0.5,) * 3)


@pytest.mark.parametrize("remove", [0, 1, [1, 0, 0, 1, 1]])
def test_remove_objects_changes_only_that_objects_pixels(remove):
    n, seed = 5, 12
    full = make_scenes(n, seed, 2)
    bare = _background_only(n, seed, 2, 1.0)
    got = remove_objects(n, seed, 2, remove=remove)
    which = np.broadcast_to(np.asarray(remove), (n,))
    for i in range(n):
        gone = full.masks[i, which[i]]
        kept = full.masks[i, 1 - which[i]]
        np.testing.assert_array_equal(got[i][gone], bare.images[i][gone])   # what lay behind it
        np.testing.assert_array_equal(got[i][~gone], full.images[i][~gone])  # the rest untouched
        assert (got[i][kept] == full.images[i][kept]).all()
        assert (got[i][gone] != full.images[i][gone]).any(axis=-1).mean() > 0.9  # it really is gone


def test_remove_objects_bad_index():
    with pytest.raises(ValueError, match="object indices"):
        remove_objects(3, 1, 2, remove=2)
    with pytest.raises(ValueError, match="object indices"):
        remove_objects(3, 1, 1, remove=[0, 1, 0])


def test_centres_per_patch_counts_each_object_in_the_patch_of_its_centre():
    masks = np.zeros((4, 12, 12), bool)
    masks[0, 0:2, 0:2] = True          # centre (0.5, 0.5): patch (0, 0)
    masks[1, 5:8, 9:12] = True         # centre (6, 10): patch (1, 2)
    masks[2, 8:12, 0:4] = True         # centre (9.5, 1.5): patch (2, 0)
    masks[3, 3, 3] = masks[3, 3, 4] = masks[3, 5, 3] = masks[3, 5, 4] = True   # centre (4, 3.5): patch (1, 0)
    expected = np.zeros((3, 3), int)
    expected[0, 0] = expected[1, 2] = expected[2, 0] = expected[1, 0] = 1
    np.testing.assert_array_equal(centres_per_patch(masks, (3, 3)), expected)
    # a ring's centre is its hole: the mask's mean, not a pixel of the mask
    ring = np.zeros((1, 12, 12), bool)
    ring[0, 5:9, 5:9] = True           # centre (6.5, 6.5), in the hole
    ring[0, 6:8, 6:8] = False
    assert centres_per_patch(ring, (2, 2))[1, 1] == 1
    sc = make_scenes(20, seed=3, n_objects=2)
    counts = centres_per_patch(sc.masks.reshape(-1, *sc.masks.shape[2:]), (7, 7))
    assert counts.shape == (7, 7) and counts.sum() == 40
    with pytest.raises(ValueError, match="whole patches"):
        centres_per_patch(masks, (5, 5))
    with pytest.raises(ValueError, match="empty"):
        centres_per_patch(np.zeros((1, 12, 12), bool), (3, 3))
    with pytest.raises(ValueError, match="objects x H x W"):
        centres_per_patch(masks[0], (3, 3))


def test_repeated_calls_give_the_same_scenes_as_independent_copies():
    """make_scenes keeps recent scene sets: a repeated call gives the scenes a fresh draw gives,
    byte for byte, and changing what one call returned changes nothing another call returns."""
    from vitlab.shapes.data import _draw_scenes

    first = make_scenes(6, seed=123, n_objects=2)
    fresh = _draw_scenes(6, 123, 2, difficulty=1.0, size=first.images.shape[1], with_objects=True)
    first.images[:] = 0
    first.masks[:] = False
    again = make_scenes(6, seed=123, n_objects=2)
    for name in ("images", "labels", "masks"):
        assert np.array_equal(getattr(again, name), getattr(fresh, name)), name
    assert again.images is not make_scenes(6, seed=123, n_objects=2).images
    assert np.array_equal(remove_objects(6, 123, 2, remove=0), remove_objects(6, 123, 2, remove=0))
