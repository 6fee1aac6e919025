"""Token layout of a Vision Transformer: how many prefix tokens, and the patch grid.

A ViT sequence is ``prefix tokens + patch tokens``. The prefix is the CLS token, plus a
distillation token (DeiT-distilled) and/or register tokens (DINOv2-reg, ViT-reg); a timm
model may also have registers and no CLS token at all (``class_token=False``). Every
number here is read from the model (and, where the model accepts several input sizes,
from the input), never assumed: no 197, 196 or 14 x 14 anywhere in vitlab.

The layout also says which tokens the model's output reads (``pool``): the CLS token
(timm's ``global_pool="token"``; every Hugging Face ViT, DeiT and Dinov2, whose Dinov2
classifier reads the CLS token next to the patch mean) or a pooling of the patch tokens
only (timm's ``"avg"``, ``"max"``, ``"avgmax"``, attention pooling ``"map"``). Maps read
from the CLS row explain the CLS token, which only the first kind's output reads.

What each patch token actually reads, its footprint on the input pixels, is measured in
:mod:`vitlab.footprints`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from vitlab.compat import moved_names


@dataclass(frozen=True)
class TokenLayout:
    """Where the tokens of a ViT sequence come from.

    Attributes:
        num_prefix: tokens before the patches (CLS + distillation + registers).
        grid: ``(gh, gw)`` patch grid, row-major in the sequence after the prefix.
        num_registers: register tokens among the prefix.
        has_distillation: whether the prefix holds a distillation token.
        pool: what the model's output reads: ``"token"`` (the CLS token) or timm's name
            of a pooling over the patch tokens (``"avg"``, ``"max"``, ``"avgmax"``, ``"map"``,
            ``"prr"``), or ``""`` (every token, unpooled).
    """

    num_prefix: int
    grid: tuple[int, int]
    num_registers: int = 0
    has_distillation: bool = False
    pool: str = "token"

    @property
    def has_class_token(self) -> bool:
        """Whether the sequence starts with a CLS token (the prefix minus registers and the
        distillation token is not empty). The CLS token, when there is one, is token 0."""
        return self.num_prefix - self.num_registers - int(self.has_distillation) > 0

    @property
    def num_patches(self) -> int:
        return self.grid[0] * self.grid[1]

    @property
    def num_tokens(self) -> int:
        return self.num_prefix + self.num_patches

    def patches_to_grid(self, values: torch.Tensor) -> torch.Tensor:
        """``[..., N]`` over all tokens, or ``[..., num_patches]`` -> ``[..., gh, gw]``."""
        n = values.shape[-1]
        if n == self.num_tokens:
            values = values[..., self.num_prefix:]
        elif n != self.num_patches:
            raise ValueError(
                f"last dimension must be {self.num_tokens} (all tokens) or {self.num_patches} "
                f"(patches) for this layout, got {n}"
            )
        return values.reshape(*values.shape[:-1], *self.grid)


def _input_hw(x) -> tuple[int, int] | None:
    if x is None:
        return None
    if isinstance(x, torch.Tensor):
        if x.ndim < 2:
            raise ValueError(f"expected an image batch B x C x H x W, got shape {tuple(x.shape)}")
        return int(x.shape[-2]), int(x.shape[-1])
    h, w = x
    return int(h), int(w)


def _pair(v) -> tuple[int, int]:
    if isinstance(v, (tuple, list)):
        return int(v[0]), int(v[1])
    return int(v), int(v)


def _timm_grid(pe: nn.Module, hw: tuple[int, int]) -> tuple[int, int]:
    """Patch grid of a ``dynamic_img_size`` timm model for an ``H x W`` input. With
    ``dynamic_img_pad`` timm pads the input up to whole patches: ``ceil(H / ph) x ceil(W / pw)``;
    without, the size must be a multiple of the patch size: ``H / ph x W / pw``."""
    ph, pw = _pair(pe.patch_size)
    if getattr(pe, "dynamic_img_pad", False):
        return -(-hw[0] // ph), -(-hw[1] // pw)  # ceil division
    if hw[0] % ph or hw[1] % pw:
        raise ValueError(
            f"this model takes inputs whose height and width are multiples of its patch size {ph} x {pw}, "
            f"got {hw[0]} x {hw[1]}; resize or crop to a multiple (e.g. {hw[0] // ph * ph} x {hw[1] // pw * pw}), "
            "or build the model with dynamic_img_pad=True to pad the input"
        )
    return hw[0] // ph, hw[1] // pw


def _timm_layout(model: nn.Module, hw) -> TokenLayout:
    pe = model.patch_embed
    if hw is None or not getattr(model, "dynamic_img_size", False):
        grid = tuple(int(g) for g in pe.grid_size)
        if hw is not None:
            expect = tuple(int(s) for s in pe.img_size)
            # a fixed position embedding: the input must give its grid (timm checks the exact size
            # unless strict_img_size was switched off)
            if tuple(hw) != expect and (getattr(pe, "strict_img_size", True) or _timm_grid(pe, hw) != grid):
                raise ValueError(
                    f"this model takes {expect[0]} x {expect[1]} inputs (fixed size), got {hw[0]} x {hw[1]}; "
                    f"resize the input to {expect[0]} x {expect[1]} (vitlab.preprocess(image, model) does), or "
                    "use a model built with dynamic_img_size=True"
                )
    else:
        grid = _timm_grid(pe, hw)
    num_prefix = int(getattr(model, "num_prefix_tokens", 1))
    num_reg = int(getattr(model, "num_reg_tokens", 0) or 0)
    has_dist = getattr(model, "dist_token", None) is not None
    pool = getattr(model, "global_pool", "token")
    if getattr(model, "attn_pool", None) is not None:
        pool = pool or "map"
    return TokenLayout(num_prefix, grid, num_reg, has_dist, pool if isinstance(pool, str) else "token")


def _hf_layout(model: nn.Module, hw) -> TokenLayout:
    config = model.config
    vision = getattr(config, "vision_config", None) or config
    patch = _pair(vision.patch_size)
    if hw is None:
        hw = _pair(vision.image_size)
    grid = (hw[0] // patch[0], hw[1] // patch[1])
    num_reg = int(getattr(vision, "num_register_tokens", 0) or 0)
    has_dist = any(name.endswith("distillation_token") for name, _ in model.named_parameters())
    return TokenLayout(1 + int(has_dist) + num_reg, grid, num_reg, has_dist)


def is_timm_vit(model: nn.Module) -> bool:
    return hasattr(model, "patch_embed") and hasattr(model, "blocks") and hasattr(model.patch_embed, "grid_size")


def is_hf_model(model: nn.Module) -> bool:
    return hasattr(model, "config") and hasattr(model.config, "model_type")


def token_layout(model: nn.Module, x=None) -> TokenLayout:
    """The :class:`TokenLayout` of ``model`` (for input ``x``: a tensor or ``(H, W)``).

    ``x`` matters for models that accept several input sizes (Hugging Face ViTs with
    interpolated position embeddings, timm models with ``dynamic_img_size``); without it the
    model's configured image size is used.
    """
    hw = _input_hw(x)
    if is_timm_vit(model):
        return _timm_layout(model, hw)
    if is_hf_model(model) and hasattr(model.config, "patch_size") or hasattr(
        getattr(getattr(model, "config", None), "vision_config", None), "patch_size"
    ):
        return _hf_layout(model, hw)
    raise TypeError(
        f"{type(model).__name__} is not a supported Vision Transformer: vitlab reads token layouts "
        "from timm VisionTransformer models (ViT, DeiT, DeiT-distilled, DINOv2, with registers) and "
        "Hugging Face ViT, DeiT and Dinov2 models"
    )


# names that moved to vitlab.footprints (vitlab 0.2): reading them here raises an error that says where they are
__getattr__ = moved_names('vitlab.layout', dict.fromkeys(("token_footprints", "FootprintExtent", "footprint_extent", "footprint_regions", "token_centres", "patch_centres"), 'vitlab.footprints'))
