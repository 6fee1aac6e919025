"""``shapes-swin``: a small hierarchical (Swin) transformer that vitlab trains itself on
:mod:`vitlab.shapes` scenes.

The model is timm's own :class:`~timm.models.swin_transformer.SwinTransformer` (its
``SwinTransformerBlock`` / ``WindowAttention`` / ``PatchMerging`` modules, NHWC tokens), small
enough to train on two CPU cores: 112 x 112 pixels, a convolutional patch embedding to a
14 x 14 grid (8-px patches), two stages of two blocks at 14 x 14 tokens (width 64, 2 heads; four
7 x 7 windows, shifted by 3 in the second block) and 7 x 7 tokens (width 128, 4 heads; one window
covering the grid, so timm shifts nothing there) joined by patch merging, and a head that averages the last stage's tokens (``global_pool='avg'``) into a multi-label
linear layer, one sigmoid per class, like ``shapes-vit-tiny``'s.

The architecture is stored with the weights (safetensors metadata), so :func:`load_shapes_swin`
rebuilds exactly the network that :mod:`vitlab.shapes.train_swin` wrote.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from timm.layers import PatchEmbed
from timm.models.swin_transformer import SwinTransformer

from vitlab.models import WEIGHTS_DIR
from vitlab.shapes.data import CLASSES
from vitlab.shapes.model import ConvStemPatchEmbed, load_shapes_model, pretrained_cfg, save_shapes_model

__all__ = ["DEFAULT_SWIN_CONFIG", "SWIN_PATH", "SWIN_STEMS", "ShapesSwinConfig", "build_shapes_swin",
           "load_shapes_swin", "save_shapes_swin"]

#: Where the shipped weights live (inside the installed package).
SWIN_PATH = WEIGHTS_DIR / "shapes-swin.safetensors"

#: Patch embeddings: "conv" (stride-2 4x4 convolutions, see ConvStemPatchEmbed) or "patch" (one
#: patchify convolution, timm's default).
SWIN_STEMS = ("conv", "patch")


@dataclass(frozen=True)
class ShapesSwinConfig:
    """Architecture of a shapes Swin transformer."""

    img_size: int = 112
    patch_size: int = 8
    embed_dim: int = 64
    depths: tuple = (2, 2)
    num_heads: tuple = (2, 4)
    window_size: int = 7
    mlp_ratio: float = 4.0
    stem: str = "conv"
    num_classes: int = len(CLASSES)
    multi_label: bool = True

    def __post_init__(self):
        object.__setattr__(self, "depths", tuple(int(d) for d in self.depths))
        object.__setattr__(self, "num_heads", tuple(int(h) for h in self.num_heads))
        if self.stem not in SWIN_STEMS:
            raise ValueError(f"stem must be one of {SWIN_STEMS}, got {self.stem!r}")
        if len(self.depths) != len(self.num_heads) or not self.depths:
            raise ValueError(f"depths {self.depths} and num_heads {self.num_heads} need the same, non-zero length")
        grid = self.img_size // self.patch_size
        if self.img_size % self.patch_size or grid % (2 ** (len(self.depths) - 1)):
            raise ValueError(f"img_size {self.img_size} / patch_size {self.patch_size} must give a grid that "
                             f"halves evenly {len(self.depths) - 1} times")

    @property
    def grid(self) -> int:
        return self.img_size // self.patch_size


#: The architecture of the shipped ``shapes-swin``.
DEFAULT_SWIN_CONFIG = ShapesSwinConfig()


def build_shapes_swin(cfg: ShapesSwinConfig = DEFAULT_SWIN_CONFIG) -> SwinTransformer:
    """A randomly initialised shapes Swin transformer (train mode), with ``pretrained_cfg`` set."""
    model = SwinTransformer(
        img_size=cfg.img_size, patch_size=cfg.patch_size, num_classes=cfg.num_classes, global_pool="avg",
        embed_dim=cfg.embed_dim, depths=cfg.depths, num_heads=cfg.num_heads, window_size=cfg.window_size,
        mlp_ratio=cfg.mlp_ratio, drop_path_rate=0.0,
        embed_layer=ConvStemPatchEmbed if cfg.stem == "conv" else PatchEmbed,
    )
    model.pretrained_cfg = pretrained_cfg(cfg, "shapes_swin", "head.fc")
    model.default_cfg = model.pretrained_cfg
    model.shapes_config = cfg
    return model


def save_shapes_swin(model: SwinTransformer, path: str | Path, *, arch: dict | None = None,
                     extra: dict | None = None, half: bool = True) -> None:
    """Write the weights (fp16 by default) with the architecture in the safetensors metadata
    (``arch`` is accepted for :func:`vitlab.shapes.train_loop.fit`'s ``save`` and ignored: the
    architecture is the model's own ``shapes_config``)."""
    save_shapes_model(model, path, extra=extra, half=half)


def load_shapes_swin(pretrained: bool = True, *, weights_path: str | Path | None = None, **arch) -> SwinTransformer:
    """The ``shapes-swin`` model, in eval mode.

    Args:
        pretrained: load the trained weights (the file shipped with vitlab unless ``weights_path``
            is given); ``False`` gives the same architecture, randomly initialised.
        weights_path: a safetensors file written by :func:`save_shapes_swin` / ``vitlab.shapes.train_swin``.
        **arch: :class:`ShapesSwinConfig` fields. With ``pretrained=False`` they change the
            architecture; with ``pretrained=True`` they must agree with the file's.

    Raises:
        FileNotFoundError: the weights file is missing (retrain with ``python -m vitlab.shapes.train_swin``).
        ValueError: unknown architecture keywords, or keywords that contradict the weights file.
    """
    return load_shapes_model(ShapesSwinConfig, DEFAULT_SWIN_CONFIG, build_shapes_swin, pretrained, weights_path,
                             SWIN_PATH, arch, name="shapes-swin", train="vitlab.shapes.train_swin",
                             duration="about 25 minutes")
