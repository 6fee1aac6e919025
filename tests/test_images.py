"""vitlab.images: every input becomes 8-bit RGB; bundled photos load with no network."""
import io
import socket
import urllib.error
import urllib.request

import numpy as np
import pytest
from PIL import Image

from vitlab import images


@pytest.fixture
def no_network(monkeypatch):
    """Any attempt to open a connection fails loudly."""

    def refuse(*args, **kwargs):
        raise AssertionError("network access attempted")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(urllib.request, "urlopen", refuse)


def _rgb_array(img):
    assert isinstance(img, Image.Image) and img.mode == "RGB"
    a = np.asarray(img)
    assert a.dtype == np.uint8 and a.ndim == 3 and a.shape[-1] == 3
    return a


# ---------------------------------------------------------------------------- samples
def test_names_cover_the_notebook_photos():
    listed = images.names()
    assert listed == sorted(listed)
    for name in ("chelsea", "coffee", "astronaut", "rocket", "grace_hopper", "camera"):
        assert name in listed


def test_every_sample_loads_offline_as_rgb(no_network):
    for name in images.names():
        a = _rgb_array(images.load(name))
        assert min(a.shape[:2]) >= 100, name
        assert a.std() > 5, f"{name} is (nearly) constant"


def test_samples_equal_the_packages_own_loaders(no_network):
    import matplotlib.image
    import skimage.data
    from matplotlib import cbook

    np.testing.assert_array_equal(_rgb_array(images.load("chelsea")), skimage.data.chelsea())
    np.testing.assert_array_equal(_rgb_array(images.load("cat")), skimage.data.chelsea())
    np.testing.assert_array_equal(_rgb_array(images.load("coffee")), skimage.data.coffee())
    np.testing.assert_array_equal(_rgb_array(images.load("astronaut")), skimage.data.astronaut())
    gray = skimage.data.camera()  # H x W: replicated into three equal channels
    np.testing.assert_array_equal(_rgb_array(images.load("camera")), np.repeat(gray[..., None], 3, -1))
    hopper = matplotlib.image.imread(cbook.get_sample_data("grace_hopper.jpg", asfileobj=False))
    np.testing.assert_array_equal(_rgb_array(images.load("grace_hopper")), hopper)


def test_load_image_accepts_a_sample_name(no_network):
    np.testing.assert_array_equal(
        np.asarray(images.load_image("coffee")), np.asarray(images.load("coffee"))
    )


def test_unknown_sample_lists_the_names():
    with pytest.raises(ValueError, match="unknown sample image 'kitten'.*chelsea.*grace_hopper"):
        images.load("kitten")


# ---------------------------------------------------------------------------- conversions
def test_rgb_is_returned_as_a_copy():
    src = Image.new("RGB", (4, 3), (10, 20, 30))
    out = images.load_image(src)
    out.putpixel((0, 0), (0, 0, 0))
    assert src.getpixel((0, 0)) == (10, 20, 30)


def test_grayscale_is_replicated():
    gray = np.arange(12, dtype=np.uint8).reshape(3, 4) * 20
    for src in (gray, gray[..., None], Image.fromarray(gray, mode="L")):
        a = _rgb_array(images.load_image(src))
        for c in range(3):
            np.testing.assert_array_equal(a[..., c], gray)


def test_rgba_is_composited_on_white():
    rgba = np.zeros((2, 3, 4), np.uint8)
    rgba[..., :3] = (200, 40, 0)
    rgba[..., 3] = [[0, 255, 128], [64, 255, 0]]
    alpha = rgba[..., 3:].astype(np.float64) / 255
    expected = rgba[..., :3] * alpha + 255 * (1 - alpha)  # "over" on an opaque white page
    for src in (rgba, Image.fromarray(rgba, mode="RGBA")):
        a = _rgb_array(images.load_image(src)).astype(np.float64)
        assert np.abs(a - expected).max() <= 1.0
    assert tuple(_rgb_array(images.load_image(rgba))[0, 0]) == (255, 255, 255)
    assert tuple(_rgb_array(images.load_image(rgba))[0, 1]) == (200, 40, 0)


def test_gray_alpha_is_composited_on_white():
    la = Image.new("LA", (2, 1), (0, 255))
    la.putpixel((1, 0), (0, 0))
    assert _rgb_array(images.load_image(la)).tolist() == [[[0, 0, 0], [255, 255, 255]]]


def test_palette_images_are_expanded():
    colours = [(255, 0, 0), (0, 128, 255), (7, 7, 7)]
    pal = Image.new("P", (3, 1))
    pal.putpalette([v for c in colours for v in c] + [0] * (768 - 9))
    for i in range(3):
        pal.putpixel((i, 0), i)
    assert [tuple(p) for p in _rgb_array(images.load_image(pal))[0]] == colours
    pal.info["transparency"] = 1  # palette index 1 transparent -> white
    assert [tuple(p) for p in _rgb_array(images.load_image(pal))[0]] == [
        (255, 0, 0), (255, 255, 255), (7, 7, 7)
    ]


def test_16_bit_is_scaled_to_8_bit(tmp_path):
    values = np.array([[0, 257, 32896], [65535, 1000, 12850]], dtype=np.uint16)
    expected = np.round(values / 257.0).astype(np.uint8)  # 65535 -> 255, 257 -> 1
    assert expected.tolist() == [[0, 1, 128], [255, 4, 50]]
    path = tmp_path / "sixteen.png"
    Image.fromarray(values).save(path)  # a 16-bit grayscale PNG
    reopened = Image.open(path)
    assert reopened.mode.startswith("I")
    for src in (values, values[..., None], Image.fromarray(values), path, str(path)):
        a = _rgb_array(images.load_image(src))
        np.testing.assert_array_equal(a[..., 0], expected)
        np.testing.assert_array_equal(a[..., 2], expected)
    colour = np.stack([values, values // 2, 65535 - values], -1)
    np.testing.assert_array_equal(
        _rgb_array(images.load_image(colour)), np.round(colour / 257.0).astype(np.uint8)
    )


def test_float_bool_and_int_arrays():
    f = np.array([[0.0, 0.5], [1.0, 0.2]], dtype=np.float32)
    np.testing.assert_array_equal(_rgb_array(images.load_image(f))[..., 1], np.round(f * 255))
    b = np.array([[True, False]])
    assert _rgb_array(images.load_image(b))[0, :, 0].tolist() == [255, 0]
    i = np.array([[0, 17, 255]], dtype=np.int64)
    assert _rgb_array(images.load_image(i))[0, :, 0].tolist() == [0, 17, 255]


def test_files_load(tmp_path):
    rgb = (np.arange(5 * 6 * 3) % 251).astype(np.uint8).reshape(5, 6, 3)
    path = tmp_path / "x.png"
    Image.fromarray(rgb).save(path)
    np.testing.assert_array_equal(_rgb_array(images.load_image(path)), rgb)
    np.testing.assert_array_equal(_rgb_array(images.load_image(str(path))), rgb)


def test_url_is_fetched(monkeypatch):
    buf = io.BytesIO()
    Image.new("RGB", (3, 2), (1, 2, 3)).save(buf, format="PNG")
    calls = []

    def fake_urlopen(request, timeout):
        calls.append((request.full_url, timeout))
        return io.BytesIO(buf.getvalue())

    monkeypatch.setattr(urllib.request, "urlopen", fake_urlopen)
    a = _rgb_array(images.load_image("https://example.org/x.png"))
    assert a.shape == (2, 3, 3) and tuple(a[0, 0]) == (1, 2, 3)
    assert calls == [("https://example.org/x.png", images.URL_TIMEOUT_S)]
    assert images.URL_TIMEOUT_S <= 30


def test_url_offline_is_a_clear_error(monkeypatch):
    def offline(request, timeout):
        raise urllib.error.URLError("[Errno -3] Temporary failure in name resolution")

    monkeypatch.setattr(urllib.request, "urlopen", offline)
    with pytest.raises(ConnectionError, match="cannot download 'https://example.org/x.png'.*offline.*chelsea"):
        images.load_image("https://example.org/x.png")


# ---------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    "src, error, message",
    [
        (np.zeros((3, 8, 8), np.uint8), ValueError, r"got shape \(3, 8, 8\).*transpose\(1, 2, 0\)"),
        (np.zeros((8, 8, 2), np.uint8), ValueError, r"H x W x 4; got shape \(8, 8, 2\)"),
        (np.zeros((0, 4), np.uint8), ValueError, "empty image array"),
        (np.full((2, 2), 300, np.int32), ValueError, r"values in \[300, 300\].*0\.\.255"),
        (np.full((2, 2), 2.0), ValueError, r"must lie in \[0, 1\].*divide by 255"),
        (np.array([[np.nan, 0.5]]), ValueError, "NaN"),
        (np.zeros((2, 2), np.complex64), ValueError, "unsupported image array dtype"),
        (42, TypeError, "cannot load an image from int"),
        ("no/such/file.png", FileNotFoundError, "no image file 'no/such/file.png'.*chelsea"),
    ],
)
def test_bad_input_is_a_clear_error(src, error, message):
    with pytest.raises(error, match=message):
        images.load_image(src)


def test_non_image_file_is_a_clear_error(tmp_path):
    path = tmp_path / "notes.png"
    path.write_text("not an image")
    with pytest.raises(ValueError, match="cannot read .*notes.png.* as an image"):
        images.load_image(path)
    with pytest.raises(ValueError, match="not a file"):
        images.load_image(tmp_path)


# --- silent wrong 8: a 32-bit integer PIL image holding 8-bit values -------------------------------
def test_mode_i_image_with_8_bit_values_equals_the_int32_array():
    values = np.array([[0, 17, 128], [200, 254, 255]], dtype=np.int32)
    pil = Image.fromarray(values)
    assert pil.mode == "I"
    expected = np.asarray(images.load_image(values))
    assert expected[..., 0].tolist() == values.tolist()
    np.testing.assert_array_equal(np.asarray(images.load_image(pil)), expected)
    gray = Image.fromarray(values.astype(np.uint8)).convert("I")  # an 8-bit image in 32-bit mode
    np.testing.assert_array_equal(np.asarray(images.load_image(gray)), expected)
    sixteen = Image.fromarray(np.array([[0, 257, 65535]], dtype=np.int32))  # beyond 255: 16-bit data
    assert np.asarray(images.load_image(sixteen))[0, :, 1].tolist() == [0, 1, 255]
    with pytest.raises(ValueError, match=r"values in \[-1, 3\]: cannot tell its bit depth"):
        images.load_image(Image.fromarray(np.array([[-1, 3]], dtype=np.int32)))
