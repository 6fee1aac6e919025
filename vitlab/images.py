"""Images in, 8-bit RGB PIL images out; and real photos that ship inside installed packages.

- :func:`load_image` takes a path, an http(s) URL, a sample name, a PIL image or a numpy
  array, and always returns an 8-bit ``RGB`` PIL image: grayscale is replicated to three
  channels, palette images are expanded, 16-bit images are scaled to 8 bits
  (``value / 257``, so 65535 -> 255; a 32-bit integer image, mode ``"I"``, is 8-bit when its
  values lie in 0..255, as an integer array is, and 16-bit up to 65535), and transparent
  images are composited on white
  (a transparent logo then looks as it does on a page; dropping alpha would reveal whatever
  colour happens to be stored under the transparent pixels).
- :func:`load` / :func:`names`: photos shipped in scikit-image's wheel (``skimage.data``:
  chelsea the cat, coffee, astronaut, rocket, ...) and matplotlib's ``grace_hopper.jpg``.
  They are read straight from the installed files, so no network is ever touched
  (``skimage.data`` fetches its larger images with pooch; none of those are listed here).
"""
from __future__ import annotations

import importlib.util
import io
import urllib.error
import urllib.request
from pathlib import Path
from typing import Dict, List, Tuple, Union

import numpy as np
from PIL import Image

__all__ = ["SAMPLES", "load", "load_image", "names", "sample_path", "to_rgb"]

URL_TIMEOUT_S = 10.0

# name -> (package, file inside the package, what it shows). The skimage names are those of
# the ``skimage.data`` functions that return the same picture.
SAMPLES: Dict[str, Tuple[str, str, str]] = {
    "astronaut": ("skimage", "data/astronaut.png", "astronaut Eileen Collins"),
    "brick": ("skimage", "data/brick.png", "brick wall texture (grayscale)"),
    "camera": ("skimage", "data/camera.png", "the cameraman: a man with a camera on a tripod (grayscale)"),
    "cat": ("skimage", "data/chelsea.png", "Chelsea the cat (same as 'chelsea')"),
    "chelsea": ("skimage", "data/chelsea.png", "Chelsea the cat"),
    "coffee": ("skimage", "data/coffee.png", "a coffee cup on a saucer"),
    "coins": ("skimage", "data/coins.png", "Greek coins from Pompeii (grayscale)"),
    "grace_hopper": ("matplotlib", "mpl-data/sample_data/grace_hopper.jpg",
                     "Rear Admiral Grace Hopper in uniform"),
    "grass": ("skimage", "data/grass.png", "grass texture (grayscale)"),
    "gravel": ("skimage", "data/gravel.png", "gravel texture (grayscale)"),
    "horse": ("skimage", "data/horse.png", "silhouette of a horse (binary)"),
    "hubble_deep_field": ("skimage", "data/hubble_deep_field.jpg", "Hubble deep field galaxies"),
    "immunohistochemistry": ("skimage", "data/ihc.png", "immunohistochemical (IHC) staining of colonic glands"),
    "logo": ("skimage", "data/logo.png", "scikit-image logo (RGBA, transparent background)"),
    "moon": ("skimage", "data/moon.png", "surface of the moon (grayscale)"),
    "motorcycle": ("skimage", "data/motorcycle_left.png", "a motorcycle (left view of a stereo pair)"),
    "page": ("skimage", "data/page.png", "scanned page of text (grayscale)"),
    "retina": ("skimage", "data/retina.jpg", "human retina fundus photo"),
    "rocket": ("skimage", "data/rocket.jpg", "Falcon 9 launching DSCOVR"),
    "text": ("skimage", "data/text.png", "hand-written maths on paper, photographed at an angle (grayscale)"),
}

ImageSource = Union[str, Path, Image.Image, np.ndarray]


def names() -> List[str]:
    """Names of the sample photos :func:`load` knows, sorted."""
    return sorted(SAMPLES)


def sample_path(name: str) -> Path:
    """Installed file of the sample photo ``name`` (no import of the package, no network)."""
    if name not in SAMPLES:
        raise ValueError(f"unknown sample image {name!r}; known: {', '.join(names())}")
    package, relative, _ = SAMPLES[name]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"sample image {name!r} ships with the {package!r} package, which is not installed "
            f"(run `bash scripts/setup.sh`)"
        )
    for location in spec.submodule_search_locations:
        path = Path(location) / relative
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"sample image {name!r}: {relative} is missing from the installed {package!r} package "
        f"at {list(spec.submodule_search_locations)}"
    )


def load(name: str) -> Image.Image:
    """The sample photo ``name`` (see :func:`names`) as an 8-bit RGB PIL image."""
    return load_image(sample_path(name))


def load_image(src: ImageSource) -> Image.Image:
    """``src`` -> 8-bit ``RGB`` PIL image.

    ``src``: a file path; an ``http://`` / ``https://`` URL (fetched with a
    ``URL_TIMEOUT_S`` = 10 s timeout); a sample name from :func:`names` (when no such file exists);
    a PIL image of any mode; or a numpy array ``H x W``, ``H x W x 1``, ``H x W x 3`` or
    ``H x W x 4`` (uint8; uint16 scaled by 1/257; bool; float in [0, 1]).
    """
    if isinstance(src, Image.Image):
        return to_rgb(src)
    if isinstance(src, np.ndarray):
        return to_rgb(_array_to_pil(src))
    if isinstance(src, (str, Path)):
        text = str(src)
        if text.startswith(("http://", "https://")):
            return to_rgb(_open_bytes(_fetch(text), text))
        path = Path(text).expanduser()
        if path.is_file():
            return to_rgb(_open_path(path))
        if isinstance(src, str) and text in SAMPLES:
            return load(text)
        if path.exists():
            raise ValueError(f"{text!r} is not a file (a directory?); give an image file")
        raise FileNotFoundError(
            f"no image file {text!r}; give an existing path, an http(s) URL, a PIL image, a "
            f"numpy array, or a sample name: {', '.join(names())}"
        )
    raise TypeError(
        f"cannot load an image from {type(src).__name__}; give a path, an http(s) URL, a "
        f"sample name, a PIL image or a numpy array"
    )



def to_rgb(image: Image.Image) -> Image.Image:
    """Any PIL image -> 8-bit RGB (see the module docstring for the rules)."""
    mode = image.mode
    if mode == "RGB":
        return image.copy()
    if mode == "P":  # palette: expand, keeping transparency if the palette has one
        return to_rgb(image.convert("RGBA" if "transparency" in image.info else "RGB"))
    if mode == "PA":
        return to_rgb(image.convert("RGBA"))
    if mode in ("I;16", "I;16L", "I;16B", "I;16N"):
        return to_rgb(_array_to_pil(np.asarray(image).astype(np.uint16)))
    if mode == "I":
        # 32-bit integers record no bit depth: read like an integer array (0..255 is 8-bit, e.g.
        # image.convert("I") of an 8-bit image); larger values up to 65535 are 16-bit data
        # (16-bit files may open as "I")
        array = np.asarray(image)
        lo, hi = int(array.min()), int(array.max())
        if lo < 0 or hi > 65535:
            raise ValueError(
                f"32-bit integer image with values in [{lo}, {hi}]: cannot tell its bit depth; "
                f"convert it to 8 bits (0..255) or 16 bits (0..65535) first"
            )
        return to_rgb(_array_to_pil(array.astype(np.uint8 if hi <= 255 else np.uint16)))
    if mode == "F":
        return to_rgb(_array_to_pil(np.asarray(image, dtype=np.float32)))
    if mode in ("RGBA", "LA", "RGBa", "La"):
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    if mode in ("1", "L", "CMYK", "YCbCr", "LAB", "HSV", "RGBX"):
        return image.convert("RGB")
    raise ValueError(f"unsupported PIL image mode {mode!r}")


def _array_to_pil(array: np.ndarray) -> Image.Image:
    """``H x W [x 1|3|4]`` array -> PIL image (``L``, ``RGB`` or ``RGBA``), 8 bits."""
    a = np.asarray(array)
    if a.ndim == 3 and a.shape[-1] == 1:
        a = a[..., 0]
    if not (a.ndim == 2 or (a.ndim == 3 and a.shape[-1] in (3, 4))):
        hint = ""
        if a.ndim == 3 and a.shape[0] in (1, 3, 4):
            hint = " (channels first? use array.transpose(1, 2, 0))"
        raise ValueError(
            f"image arrays must be H x W, H x W x 1, H x W x 3 or H x W x 4; got shape "
            f"{a.shape}{hint}"
        )
    if a.size == 0:
        raise ValueError(f"empty image array of shape {a.shape}")
    if a.dtype == np.uint8:
        u8 = a
    elif a.dtype == np.uint16:
        u8 = np.round(a.astype(np.float64) / 257.0).astype(np.uint8)
    elif a.dtype == np.bool_:
        u8 = a.astype(np.uint8) * 255
    elif np.issubdtype(a.dtype, np.floating):
        if not np.all(np.isfinite(a)):
            raise ValueError("float image array contains NaN or infinity")
        lo, hi = float(a.min()), float(a.max())
        if lo < 0.0 or hi > 1.0:
            raise ValueError(
                f"float image arrays must lie in [0, 1]; got values in [{lo:.4g}, {hi:.4g}] "
                f"(divide by 255 for 0..255 data)"
            )
        u8 = np.round(a * 255.0).astype(np.uint8)
    elif np.issubdtype(a.dtype, np.integer):
        lo, hi = int(a.min()), int(a.max())
        if lo < 0 or hi > 255:
            raise ValueError(
                f"{a.dtype} image array has values in [{lo}, {hi}]; integer images must be "
                f"0..255 (use uint16 for 16-bit data)"
            )
        u8 = a.astype(np.uint8)
    else:
        raise ValueError(f"unsupported image array dtype {a.dtype}")
    mode = "L" if u8.ndim == 2 else {3: "RGB", 4: "RGBA"}[u8.shape[-1]]
    return Image.fromarray(np.ascontiguousarray(u8), mode=mode)


def _open_path(path: Path) -> Image.Image:
    try:
        with Image.open(path) as image:
            image.load()
            return image
    except Exception as err:  # PIL.UnidentifiedImageError, truncated files, ...
        raise ValueError(f"cannot read {str(path)!r} as an image: {err}") from err


def _open_bytes(data: bytes, where: str) -> Image.Image:
    try:
        image = Image.open(io.BytesIO(data))
        image.load()
        return image
    except Exception as err:
        raise ValueError(f"the data at {where!r} is not an image PIL can read: {err}") from err


def _fetch(url: str) -> bytes:
    request = urllib.request.Request(url, headers={"User-Agent": "vitlab"})
    try:
        with urllib.request.urlopen(request, timeout=URL_TIMEOUT_S) as response:
            return response.read()
    except (urllib.error.URLError, TimeoutError, OSError) as err:
        raise ConnectionError(
            f"cannot download {url!r} ({getattr(err, 'reason', err)}); offline? Use a local "
            f"file or a bundled sample instead: vitlab.images.load(name) with name in "
            f"{', '.join(names())}"
        ) from err
