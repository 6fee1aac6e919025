"""``shapes-vit-tiny``: the small ViT that vitlab trains itself on :mod:`vitlab.shapes` scenes.

The model is a plain timm :class:`~timm.models.vision_transformer.VisionTransformer` with
DeiT-tiny's blocks (width 192, 3 heads of 64, MLP ratio 4), a CLS token read out by the
head (``global_pool='token'``), and learned position embeddings initialised to 2-D sine-cosine
values. Optionally the single patchify convolution is replaced by a small convolutional stem
(Xiao et al. 2021, "Early convolutions help transformers see better"); either way
``patch_embed.grid_size`` is the patch grid and the attention blocks are timm's own
``Block``/``Attention`` modules, so every vitlab method works on it unchanged.

The architecture is stored with the weights (safetensors metadata), so
:func:`load_shapes_vit` rebuilds exactly the network that :mod:`vitlab.shapes.train` wrote.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields
from functools import partial
from pathlib import Path

import torch
from torch import nn

from timm.layers import PatchEmbed
from timm.models.vision_transformer import VisionTransformer

from vitlab.models import WEIGHTS_DIR
from vitlab.shapes.data import CLASSES

__all__ = [
    "DEFAULT_CONFIG",
    "STEMS",
    "MEAN",
    "STD",
    "WEIGHTS_PATH",
    "ConvStemPatchEmbed",
    "ShapesViTConfig",
    "build_shapes_vit",
    "load_shapes_vit",
    "save_shapes_vit",
]

#: Where the shipped weights live (inside the installed package).
WEIGHTS_PATH = WEIGHTS_DIR / "shapes-vit-tiny.safetensors"

#: Input normalisation (images scaled to [0, 1] first).
MEAN = (0.5, 0.5, 0.5)
STD = (0.5, 0.5, 0.5)


#: Patch embeddings: one patchify convolution ("patch"), or a stack of stride-2 convolutions.
#: "conv": 4x4 kernels with padding 1, so each token's receptive field is centred on its patch;
#: "conv3x3": 3x3 kernels with padding 1 (the first shipped model's stem; it centres each token
#: 7.5 px up-left of its 16-px patch; kept so that weight files written with it still load);
#: "wideconv": like "conv" with a 32-channel first layer.
STEMS = ("conv", "conv3x3", "wideconv", "patch")


@dataclass(frozen=True)
class ShapesViTConfig:
    """Architecture of a shapes ViT. Width and heads are DeiT-tiny's and fixed."""

    img_size: int = 112
    patch_size: int = 16
    depth: int = 6
    stem: str = "conv"  # see STEMS
    num_classes: int = len(CLASSES)
    #: True: one sigmoid per class ("is this shape here?"), trained with binary cross-entropy
    #: on multi-hot labels; False: one softmax over the classes (the earlier shipped models).
    multi_label: bool = True
    embed_dim: int = 192
    num_heads: int = 3

    def __post_init__(self):
        if self.stem not in STEMS:
            raise ValueError(f"stem must be one of {STEMS}, got {self.stem!r}")
        if self.img_size % self.patch_size:
            raise ValueError(f"img_size {self.img_size} is not a multiple of patch_size {self.patch_size}")
        p = self.patch_size
        if self.stem != "patch" and (p < 4 or p & (p - 1)):
            raise ValueError(f"the conv stem needs a power-of-two patch_size >= 4, got {p}")
        if self.depth < 1:
            raise ValueError(f"depth must be >= 1, got {self.depth}")

    @property
    def grid(self) -> int:
        return self.img_size // self.patch_size


#: The architecture of the shipped ``shapes-vit-tiny``.
DEFAULT_CONFIG = ShapesViTConfig()


class ConvStemPatchEmbed(PatchEmbed):
    """timm ``PatchEmbed`` whose projection is a stack of stride-2 convolutions.

    ``log2(patch_size)`` conv-BN-ReLU layers halve the resolution each time, doubling the
    channels from ``first_width`` (default ``embed_dim / patch_size``, at least 16) up to
    ``embed_dim``, and a final 1x1 convolution maps to ``embed_dim`` — the "early
    convolutions" stem of Xiao et al. (2021). Output tokens, ``grid_size`` and
    ``num_patches`` are the same as for the patchify convolution it replaces.

    ``kernel_size`` 4 (padding 1) centres every output cell's receptive field on the input
    cells it covers, so token ``(i, j)`` looks at the centre of patch ``(i, j)``. With 3x3
    kernels (padding 1) each layer shifts the centre half an input pixel up-left and the
    shifts add up: ``(patch_size - 1) / 2`` pixels for the whole stem (7.5 px at 16 px patches).
    """

    def __init__(self, img_size=224, patch_size=16, in_chans=3, embed_dim=768, first_width=None, kernel_size=4, **kwargs):
        super().__init__(img_size=img_size, patch_size=patch_size, in_chans=in_chans, embed_dim=embed_dim, **kwargs)
        n_down = int(round(math.log2(self.patch_size[0])))
        layers: list[nn.Module] = []
        c_in, c_out = in_chans, first_width or embed_dim // 2 ** (n_down)
        for _ in range(n_down):
            c_out = min(max(c_out, 16), embed_dim)
            layers += [
                nn.Conv2d(c_in, c_out, kernel_size=kernel_size, stride=2, padding=1, bias=False),
                nn.BatchNorm2d(c_out),
                nn.ReLU(inplace=True),
            ]
            c_in, c_out = c_out, c_out * 2
        layers.append(nn.Conv2d(c_in, embed_dim, kernel_size=1))
        self.proj = nn.Sequential(*layers)


def _sincos_2d(grid: int, dim: int) -> torch.Tensor:
    """2-D sine-cosine position embeddings (MAE / MoCo v3), ``grid*grid x dim``."""
    quarter = dim // 4
    omega = 1.0 / (10000 ** (torch.arange(quarter, dtype=torch.float32) / quarter))
    ys, xs = torch.meshgrid(torch.arange(grid, dtype=torch.float32), torch.arange(grid, dtype=torch.float32), indexing="ij")
    out_y = ys.reshape(-1, 1) * omega[None]
    out_x = xs.reshape(-1, 1) * omega[None]
    return torch.cat([out_x.sin(), out_x.cos(), out_y.sin(), out_y.cos()], dim=1)


def pretrained_cfg(cfg, architecture: str, classifier: str) -> dict:
    """The timm ``pretrained_cfg`` of a shapes model (ViT or Swin) with config ``cfg``: its input size,
    normalisation, classes and how its logits are read."""
    return {
        "architecture": architecture,
        "input_size": (3, cfg.img_size, cfg.img_size),
        "mean": MEAN,
        "std": STD,
        "interpolation": "bilinear",
        "crop_pct": 1.0,
        "crop_mode": "center",
        "num_classes": cfg.num_classes,
        "label_names": list(CLASSES),
        # How the logits are read: independent sigmoids (multi-label) or one softmax.
        "multi_label": cfg.multi_label,
        "first_conv": "patch_embed.proj",
        "classifier": classifier,
    }


def build_shapes_vit(cfg: ShapesViTConfig = DEFAULT_CONFIG) -> VisionTransformer:
    """A randomly initialised shapes ViT (train mode), with ``pretrained_cfg`` set."""
    model = VisionTransformer(
        img_size=cfg.img_size,
        patch_size=cfg.patch_size,
        embed_dim=cfg.embed_dim,
        depth=cfg.depth,
        num_heads=cfg.num_heads,
        mlp_ratio=4.0,
        qkv_bias=True,
        num_classes=cfg.num_classes,
        global_pool="token",
        class_token=True,
        embed_layer={
            "conv": ConvStemPatchEmbed,
            "conv3x3": partial(ConvStemPatchEmbed, kernel_size=3),
            "wideconv": partial(ConvStemPatchEmbed, first_width=32),
            "patch": PatchEmbed,
        }[cfg.stem],
    )
    with torch.no_grad():
        model.pos_embed[0, model.num_prefix_tokens :] = _sincos_2d(cfg.grid, cfg.embed_dim)
        model.pos_embed[0, : model.num_prefix_tokens] = 0.0
    model.pretrained_cfg = pretrained_cfg(cfg, "shapes_vit_tiny", "head")
    model.default_cfg = model.pretrained_cfg
    model.shapes_config = cfg
    return model


def save_shapes_vit(model: VisionTransformer, path: str | Path, *, extra: dict | None = None, half: bool = True) -> None:
    """Write the weights (fp16 by default) with the architecture in the safetensors metadata."""
    save_shapes_model(model, path, extra=extra, half=half)


def save_shapes_model(model, path: str | Path, *, extra: dict | None = None, half: bool = True) -> None:
    """Write a shapes model's weights (fp16 by default) with its architecture (``model.shapes_config``)
    and the class names in the safetensors metadata, and ``extra`` (JSON values) beside them."""
    from safetensors.torch import save_file

    cfg = model.shapes_config
    state = {k: (v.detach().half() if half and v.is_floating_point() else v.detach()).contiguous().cpu()
             for k, v in model.state_dict().items()}
    meta = {"format": "pt", "vitlab_config": json.dumps(asdict(cfg)), "label_names": json.dumps(list(CLASSES))}
    if extra:
        meta.update({k: json.dumps(v) for k, v in extra.items()})
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    save_file(state, str(path), metadata=meta)


def refuse_arch(arch: dict, path=None) -> None:
    """Architecture arguments only shape random weights: with a weights file (at ``path``, when
    known) they are refused, since the file fixes the architecture."""
    if arch:
        where = "" if path is None else f" {path}"
        raise ValueError(f"architecture arguments {sorted(arch)} only apply with pretrained=False; "
                         f"the weights file{where} fixes the architecture")


def load_shapes_model(config_cls, default, build, pretrained: bool, weights_path, default_path: Path, arch: dict,
                      *, name: str, train: str, duration: str, stored_defaults: dict | None = None):
    """The shared steps of :func:`load_shapes_vit` and :func:`vitlab.shapes.swin_model.load_shapes_swin`:
    ``arch`` checked against ``config_cls``'s fields; a random ``build(config)`` without
    ``pretrained``; else the file's config (``stored_defaults`` filling keys older files lack),
    ``arch`` checked against it, the weights loaded in float32. Eval mode. ``name``, ``train``
    (the training module) and ``duration`` go into the messages."""
    names = {f.name for f in fields(config_cls)}
    unknown = set(arch) - names
    if unknown:
        raise ValueError(f"unknown architecture argument(s) {sorted(unknown)}; expected some of {sorted(names)}")
    if not pretrained:
        return build(config_cls(**{**asdict(default), **arch})).eval()

    from safetensors import safe_open
    from safetensors.torch import load_file

    path = Path(weights_path) if weights_path is not None else default_path
    if not path.is_file():
        raise FileNotFoundError(f"{name} weights not found at {path}; retrain them with "
                                f"`python -m {train} --out {path}` ({duration} on 2 CPU cores)")
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
    if "vitlab_config" not in meta:
        raise ValueError(f"{path} has no vitlab_config metadata; it was not written by {train}")
    cfg = config_cls(**{**(stored_defaults or {}), **json.loads(meta["vitlab_config"])})
    clash = {k: (v, getattr(cfg, k)) for k, v in arch.items()
             if getattr(cfg, k) != (tuple(v) if isinstance(v, list) else v)}
    if clash:
        raise ValueError(f"arguments contradict the weights file {path}: " + ", ".join(
            f"{k}={a!r} but the file has {b!r}" for k, (a, b) in clash.items()))
    model = build(cfg)
    state = {k: v.float() if v.is_floating_point() else v for k, v in load_file(str(path)).items()}
    model.load_state_dict(state, strict=True)
    return model.eval()


def load_shapes_vit(pretrained: bool = True, *, weights_path: str | Path | None = None, **arch) -> VisionTransformer:
    """The ``shapes-vit-tiny`` model, in eval mode.

    Args:
        pretrained: load the trained weights (the file shipped in ``vitlab/weights`` unless
            ``weights_path`` is given); ``False`` gives the same architecture, randomly initialised.
        weights_path: a safetensors file written by :func:`save_shapes_vit` / ``vitlab.shapes.train``.
        **arch: :class:`ShapesViTConfig` fields. With ``pretrained=False`` they change the
            architecture; with ``pretrained=True`` they must agree with the file's.

    Raises:
        FileNotFoundError: the weights file is missing (retrain with ``python -m vitlab.shapes.train``).
        ValueError: unknown architecture keywords, or keywords that contradict the weights file.
    """
    return load_shapes_model(ShapesViTConfig, DEFAULT_CONFIG, build_shapes_vit, pretrained, weights_path, WEIGHTS_PATH,
                             arch, name="shapes-vit-tiny", train="vitlab.shapes.train", duration="about an hour",
                             stored_defaults={"multi_label": False})  # older files: softmax heads
