"""Token layout of a Vision Transformer: how many prefix tokens, and the patch grid.

A ViT sequence is ``prefix tokens + patch tokens``. The prefix is the CLS token, plus a
distillation token (DeiT-distilled) and/or register tokens (DINOv2-reg, ViT-reg); a timm
model may also have registers and no CLS token at all (``class_token=False``). Every
number here is read from the model (and, where the model accepts several input sizes,
from the input), never assumed: no 197, 196 or 14 x 14 anywhere in vitlab.

The layout also says which tokens the model's output reads (``pool``, :data:`POOLS`): the CLS
token (``"token"``: timm's ``global_pool="token"``; Hugging Face ViT, DeiT, CLIP's vision
tower, ``Dinov2Model``), the CLS and the distillation token (``"token_distillation"``: a
distilled DeiT, timm's or Hugging Face's ``...WithTeacher``, whose logits are the mean of a head
on each), the CLS token next to the mean of the patch tokens (``"token_avg"``: Hugging Face's
``Dinov2ForImageClassification`` and ``Dinov2WithRegistersForImageClassification``, whose
classifier reads the two concatenated), the mean of the patch tokens (``"avg"``: timm's ``"avg"`` -- BEiT and EVA-02 by default --, Hugging
Face BEiT with ``use_mean_pooling``, SigLIP's classifier), another pooling of them (timm's
``"max"``, ``"avgmax"``), an attention probe over the tokens (``"map"``: timm's attention
pooling, SigLIP's pooling head), CaiT's class-attention blocks (``"class_attention"``: its
class token joins the patches only there), or nothing (``""``: every token, unpooled). Maps
read from the CLS row explain the CLS token, which only the first kind's output reads; a
mean-pooled or two-token output is explained through its own row (:meth:`TokenLayout.readout`).

Hierarchical ViTs with windowed attention (Swin) have no single patch grid and no CLS token:
:func:`token_layout` refuses them (:func:`windowed_refusal`).

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
        pool: what the model's output reads (:data:`POOLS`): ``"token"`` (the CLS token),
            ``"token_distillation"`` (a distilled DeiT: the mean of a head on the CLS token and
            a head on the distillation token), ``"token_avg"`` (the CLS token concatenated with
            the mean of the patch tokens: Hugging Face's Dinov2 classifiers),
            ``"avg"`` (the mean of the patch tokens, prefix tokens left out), timm's name of
            another pooling over the patch tokens (``"max"``, ``"avgmax"``, ``"prr"``),
            ``"map"`` (an attention probe over the tokens), ``"class_attention"`` (CaiT: the
            class token joins the patch tokens only in the class-attention blocks after the
            self-attention blocks), or ``""`` (every token, unpooled).
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

    def readout(self, dtype=torch.float32, device=None) -> torch.Tensor | None:
        """Weights ``w`` over the ``N`` tokens with ``pooled = sum_i w_i h_i``: the token the output
        reads, as a combination of the last block's tokens; the weights sum to 1. ``"token"`` /
        ``""`` with a CLS token: ``e_0``; ``"avg"``: ``1 / num_patches`` on every patch token, 0
        on the prefix (what timm and Hugging Face average); CaiT (``"class_attention"``): ``e_0``,
        its class token after the class-attention blocks (:func:`vitlab.attention.full_sequence`).

        Two tokens read by two linear maps: ``"token_distillation"`` (``logits = (head(h_0) +
        head_dist(h_1)) / 2``): ``(e_0 + e_1) / 2``, the shares in which the logits read the CLS
        and the distillation token; ``"token_avg"`` (``logits = W [h_0, mean_p h_p]``, two halves of
        equal width): ``e_0 / 2 + 1 / (2 num_patches)`` on every patch token (registers left out,
        as Hugging Face's mean leaves them out), each half's own row -- the CLS row, the mean of
        the patch rows -- in equal shares. A row of a matrix over the tokens (rollout, Chefer
        relevance) is linear in ``w``, so the map of such a head is the mean of its two tokens'
        maps; the class-specific weighting of the two halves comes from the gradients, which reach
        both tokens. None where the output is not such a combination of tokens (max pooling, an
        attention probe, no CLS token)."""
        w = torch.zeros(self.num_tokens, dtype=dtype, device=device)
        if self.pool in ("token", "", "class_attention") and self.has_class_token:
            w[0] = 1
            return w
        if self.pool == "avg":
            w[self.num_prefix:] = 1.0 / self.num_patches
            return w
        if self.pool == "token_distillation" and self.has_class_token and self.has_distillation:
            w[:2] = 0.5  # the CLS token, then the distillation token (timm and Hugging Face order)
            return w
        if self.pool == "token_avg" and self.has_class_token:
            w[0] = 0.5
            w[self.num_prefix:] = 0.5 / self.num_patches
            return w
        return None

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


#: What ``TokenLayout.pool`` can say (timm's own pooling names kept: ``"avgmax"``, ``"prr"``).
POOLS = ("token", "token_distillation", "token_avg", "avg", "max", "avgmax", "prr", "map", "class_attention", "")


def windowed_refusal(model: nn.Module) -> str | None:
    """Why ``model`` cannot be explained as a ViT, when it is a hierarchical ViT with windowed
    attention (timm or Hugging Face Swin); None otherwise. :func:`token_layout` raises ``TypeError``
    with this text: a Swin has no one token layout; :mod:`vitlab.hierarchical` explains it."""
    name = type(model).__name__
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if "swin" in str(model_type).lower() or name.lower().startswith("swin"):
        return (
            f"{name} is a hierarchical ViT with shifted-window attention (Swin): its attention is computed per "
            "window and its patch grid shrinks between stages (patch merging), and it has no class token, "
            "so it has no one token layout and the ViT methods do not apply to it; explain it with "
            "vitlab.hierarchical (swin_relevance, swin_rollout, swin_raw_attention, swin_gradcam), which "
            "scatters the windows into each stage's token matrix and carries patch merging between stages"
        )
    return None


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
    if not isinstance(pool, str):  # a pooling module (SelectAdaptivePool2d): its name
        pool = str(getattr(pool, "pool_type", "token"))
    if getattr(model, "attn_pool", None) is not None:
        pool = "map"
    if has_dist and isinstance(getattr(model, "head_dist", None), nn.Module):
        # timm's VisionTransformerDistilled (global_pool must be "token"): forward_head returns
        # (head(x[:, 0]) + head_dist(x[:, 1])) / 2 in eval mode, the mean of two heads on two tokens
        pool = "token_distillation"
    if getattr(model, "blocks_token_only", None) is not None and pool == "token":
        # CaiT: the class token is not in the self-attention blocks' sequence; it joins the
        # patches in the class-attention blocks, whose output the head reads
        pool = "class_attention"
    return TokenLayout(num_prefix, grid, num_reg, has_dist, pool)


def _hf_layout(model: nn.Module, hw) -> TokenLayout:
    config = model.config
    vision = getattr(config, "vision_config", None) or config
    patch = _pair(vision.patch_size)
    if hw is None:
        hw = _pair(vision.image_size)
    grid = (hw[0] // patch[0], hw[1] // patch[1])
    num_reg = int(getattr(vision, "num_register_tokens", 0) or 0)
    names = [name for name, _ in model.named_parameters()]
    has_dist = any(name.endswith("distillation_token") for name in names)
    model_type = str(getattr(config, "model_type", ""))
    # a CLS token: a learned cls_token parameter (ViT, DeiT, BEiT, Dinov2), or CLIP's class_embedding;
    # SigLIP's sequence is the patches alone
    has_cls = any(name.endswith(("cls_token", "class_embedding")) for name in names)
    pool = "token" if has_cls else ""
    if model_type.startswith("siglip"):
        # SiglipForImageClassification averages every token (all patches); the vision model's
        # pooler_output is its attention-pooling head (a probe attending to the tokens)
        pool = "avg" if hasattr(model, "classifier") else ("map" if getattr(vision, "vision_use_head", True) else "")
    elif model_type.startswith("beit") and getattr(vision, "use_mean_pooling", False):
        pool = "avg"  # BeitPooler: the mean of the patch tokens (the CLS token left out)
    elif has_dist and has_cls and isinstance(getattr(model, "distillation_classifier", None), nn.Module):
        # DeiTForImageClassificationWithTeacher: (cls_classifier(h[:, 0]) + distillation_classifier(h[:, 1])) / 2;
        # DeiTModel and DeiTForImageClassification read the CLS token alone
        pool = "token_distillation"
    elif model_type.startswith("dinov2") and has_cls and isinstance(getattr(model, "classifier", None), nn.Module):
        # Dinov2(WithRegisters)ForImageClassification: classifier(cat[h[:, 0], mean of the patch tokens]),
        # the registers left out of the mean; Dinov2Model's pooler_output is the CLS token alone
        pool = "token_avg"
    return TokenLayout(int(has_cls) + int(has_dist) + num_reg, grid, num_reg, has_dist, pool)


def hf_needs_interpolation(model: nn.Module, x) -> bool:
    """Whether a Hugging Face ViT must be called with ``interpolate_pos_encoding=True`` for input
    ``x``: its configured image size differs from ``x``'s and its forward takes that argument
    (ViT, DeiT, BEiT, CLIP, SigLIP; Dinov2 always interpolates and takes none). False for timm."""
    import inspect

    config = getattr(model, "config", None)
    if not (is_hf_model(model) and isinstance(x, torch.Tensor) and x.ndim == 4):
        return False
    vision = getattr(config, "vision_config", None) or config
    size = getattr(vision, "image_size", None)
    if size is None or _pair(size) == (int(x.shape[-2]), int(x.shape[-1])):
        return False
    try:
        return "interpolate_pos_encoding" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


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
    refusal = windowed_refusal(model)
    if refusal is not None:
        raise TypeError(refusal)
    if is_timm_vit(model):
        return _timm_layout(model, hw)
    if is_hf_model(model) and hasattr(model.config, "patch_size") or hasattr(
        getattr(getattr(model, "config", None), "vision_config", None), "patch_size"
    ):
        return _hf_layout(model, hw)
    raise TypeError(
        f"{type(model).__name__} is not a supported Vision Transformer: vitlab reads token layouts "
        "from timm ViTs (ViT, DeiT, DeiT-distilled, DINOv2 with and without registers, BEiT, EVA-02, CaiT) and "
        "Hugging Face ViT, DeiT, BEiT, Dinov2, CLIP and SigLIP vision models"
    )


# names that moved to vitlab.footprints (vitlab 0.2): reading them here raises an error that says where they are
__getattr__ = moved_names('vitlab.layout', dict.fromkeys(("token_footprints", "FootprintExtent", "footprint_extent", "footprint_regions", "token_centres", "patch_centres"), 'vitlab.footprints'))
