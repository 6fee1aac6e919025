"""Image parametrisations: what the optimiser actually changes.

- :class:`PixelImage` — the pixels themselves, kept in ``[0, 1]`` by clamping after each
  step (Ghiasi et al. 2022's recipe); optionally at a lower resolution, bilinearly upsampled
  (``lowres=2`` optimises a quarter of the values).
- :class:`FFTImage` — lucent's / Olah et al. 2017's ("Feature Visualization", Distill)
  parametrisation: a Fourier spectrum scaled by ``1 / frequency``, so low frequencies move
  first, then a fixed colour-decorrelation matrix and a sigmoid into ``[0, 1]``.

Both are built from a seeded :class:`torch.Generator`, so the same seed gives the same
starting image on every device. ``image()`` returns ``B x 3 x H x W`` in ``[0, 1]``.
"""
from __future__ import annotations

import abc
import math

import torch
import torch.nn.functional as F

from vitlab.inputs import positive_int

__all__ = ["Parametrization", "PixelImage", "FFTImage", "make", "COLOR_CORRELATION_SVD_SQRT"]

# Square root of the colour covariance of ImageNet, from its SVD (lucid / lucent's constant).
COLOR_CORRELATION_SVD_SQRT = torch.tensor([[0.26, 0.09, 0.02],
                                           [0.27, 0.00, -0.05],
                                           [0.27, -0.09, 0.03]])


def _check_shape(batch: int, size) -> tuple[int, int, int]:
    positive_int("batch", batch)
    h, w = (size, size) if isinstance(size, int) else tuple(size)
    if h < 2 or w < 2:
        raise ValueError(f"image size must be at least 2 x 2, got {h} x {w}")
    return batch, int(h), int(w)


class Parametrization(abc.ABC):
    """An image made of optimisable tensors."""

    @abc.abstractmethod
    def parameters(self) -> list[torch.Tensor]:
        """The tensors the optimiser updates."""

    @abc.abstractmethod
    def image(self) -> torch.Tensor:
        """``B x 3 x H x W`` in ``[0, 1]``, differentiable w.r.t. :meth:`parameters`."""

    def project(self) -> None:
        """Bring the parameters back into their valid set after an optimiser step."""


class PixelImage(Parametrization):
    """Pixels in ``[0, 1]`` (clamped after each step), optionally ``lowres`` times coarser
    and upsampled bilinearly.

    Args:
        batch: number of images.
        size: ``H`` or ``(H, W)`` of the image.
        lowres: optimise an ``ceil(H / lowres) x ceil(W / lowres)`` image (1 = full resolution).
        sd: standard deviation of the Gaussian start around grey 0.5.
        generator: a seeded CPU :class:`torch.Generator` for the start.
        device: where the parameters live.
    """

    def __init__(self, batch: int, size, *, lowres: int = 1, sd: float = 0.1,
                 generator: torch.Generator | None = None, device=None):
        batch, h, w = _check_shape(batch, size)
        if isinstance(lowres, bool) or not isinstance(lowres, int) or lowres < 1:
            raise ValueError(f"lowres must be an int >= 1, got {lowres!r}")
        if sd < 0:
            raise ValueError(f"sd must be >= 0, got {sd}")
        self.size = (h, w)
        self.lowres = lowres
        shape = (batch, 3, math.ceil(h / lowres), math.ceil(w / lowres))
        start = (0.5 + sd * torch.randn(shape, generator=generator)).clamp_(0, 1)
        self.pixels = start.to(device).requires_grad_(True)

    def parameters(self) -> list[torch.Tensor]:
        return [self.pixels]

    def image(self) -> torch.Tensor:
        if self.lowres == 1:
            return self.pixels
        return F.interpolate(self.pixels, size=self.size, mode="bilinear", align_corners=False)

    def project(self) -> None:
        with torch.no_grad():
            self.pixels.clamp_(0.0, 1.0)


def rfft2d_frequencies(h: int, w: int) -> torch.Tensor:
    """``h x (w // 2 + 1)``: the spatial frequency (cycles per pixel) of each rfft2 bin."""
    fy = torch.fft.fftfreq(h)[:, None]
    fx = torch.fft.rfftfreq(w)[None, :]
    return torch.sqrt(fx * fx + fy * fy)


class FFTImage(Parametrization):
    """lucent's ``fft_image`` + ``to_valid_rgb(decorrelate=True)``: a spectrum scaled by
    ``1 / max(f, 1 / max(H, W)) ** decay_power``, inverse real FFT (orthonormal), divided by
    4, colour-decorrelated, then a sigmoid.

    Args:
        batch, size, generator, device: as :class:`PixelImage`.
        sd: standard deviation of the start spectrum. lucent's 0.01 (a near-grey start) traps
            ViT MLP units: on a flat image every token of a unit can sit below GELU's minimum
            (x = -0.75), where its slope is negative and gradient ascent only drives the
            unit towards 0 from below. 0.3 starts from a textured image and escapes (chapter 8
            measured a DINOv2-S unit stuck at 0.0 from 0.01 and reaching 6 from 0.3).
        decay_power: how strongly high frequencies are damped.
        decorrelate: apply the ImageNet colour-correlation matrix (else plain RGB).
    """

    def __init__(self, batch: int, size, *, sd: float = 0.3, decay_power: float = 1.0, decorrelate: bool = True,
                 generator: torch.Generator | None = None, device=None):
        batch, h, w = _check_shape(batch, size)
        if sd <= 0:
            raise ValueError(f"sd must be > 0, got {sd}")
        self.size = (h, w)
        freqs = rfft2d_frequencies(h, w)
        self.scale = (1.0 / freqs.clamp(min=1.0 / max(h, w)) ** decay_power).to(device)[None, None, :, :, None]
        spectrum = sd * torch.randn((batch, 3, *freqs.shape, 2), generator=generator)
        self.spectrum = spectrum.to(device).requires_grad_(True)
        self.decorrelate = decorrelate
        c = COLOR_CORRELATION_SVD_SQRT
        self.color = (c / c.norm(dim=0).max()).to(device)

    def parameters(self) -> list[torch.Tensor]:
        return [self.spectrum]

    def image(self) -> torch.Tensor:
        spectrum = torch.view_as_complex((self.scale * self.spectrum).contiguous())
        x = torch.fft.irfftn(spectrum, s=self.size, dim=(-2, -1), norm="ortho") / 4.0
        if self.decorrelate:
            x = torch.einsum("bchw,dc->bdhw", x, self.color)
        return torch.sigmoid(x)


def make(param, batch: int, size, generator: torch.Generator, device) -> Parametrization:
    """``"pixel"``, ``"pixel_lowres2"`` (``"pixel_lowres<k>"``), ``"fft"``, or a
    :class:`Parametrization` already built -> a :class:`Parametrization`."""
    if isinstance(param, Parametrization):
        return param
    if param == "pixel":
        return PixelImage(batch, size, generator=generator, device=device)
    if isinstance(param, str) and param.startswith("pixel_lowres") and param[len("pixel_lowres"):].isdigit():
        return PixelImage(batch, size, lowres=int(param[len("pixel_lowres"):]), generator=generator, device=device)
    if param == "fft":
        return FFTImage(batch, size, generator=generator, device=device)
    raise ValueError(f"param must be 'pixel', 'pixel_lowres<k>', 'fft' or a Parametrization, got {param!r}")
