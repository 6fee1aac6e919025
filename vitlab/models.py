"""Load a ViT by name — timm, Hugging Face, or one of vitlab's embedded offline models —
and turn an image into that model's input.

``load_model(name)`` never hangs when offline: if the weights are neither cached nor
reachable it raises :class:`ModelUnavailableError` within a few seconds, naming the model,
how to pre-download it, and the embedded models that need no network.
"""
from __future__ import annotations

import importlib
import os
import socket
import urllib.parse
from typing import Any, Callable

import numpy as np
import torch
from torch import nn

# name -> "module:function"; each loader is ``fn(pretrained=True, **kwargs) -> nn.Module`` in eval
# mode: a timm VisionTransformer with ``pretrained_cfg`` set, or (shapes-lxmert, shapes-detr) a
# Hugging Face LXMERT / DETR on the frozen shapes-vit-tiny (vitlab.shapes.bimodal).
EMBEDDED_MODELS: dict[str, str] = {
    "shapes-vit-tiny": "vitlab.shapes.model:load_shapes_vit",
    "dinov2_small_imgfocus": "vitlab.imgfocus:load_imgfocus_vit",
    "shapes-lxmert": "vitlab.shapes.bimodal:load_shapes_lxmert",
    "shapes-detr": "vitlab.shapes.bimodal:load_shapes_detr",
}

# Configurations of common Hugging Face ViT-family checkpoints, so that ``pretrained=False``
# builds the same architecture offline. Keys of the processor part follow timm's data config.
_HF_KNOWN: dict[str, dict[str, Any]] = {
    "google/vit-base-patch16-224": dict(
        model_type="vit", head=True,
        config=dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072,
                    image_size=224, patch_size=16, num_labels=1000),
        data=dict(input_size=(3, 224, 224), mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5),
                  interpolation="bilinear", crop_pct=1.0, crop_mode="squash"),
    ),
    "facebook/deit-tiny-patch16-224": dict(
        model_type="vit", head=True,
        config=dict(hidden_size=192, num_hidden_layers=12, num_attention_heads=3, intermediate_size=768,
                    image_size=224, patch_size=16, num_labels=1000),
        data=dict(input_size=(3, 224, 224), mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225),
                  interpolation="bicubic", crop_pct=0.875, crop_mode="center"),
    ),
    "facebook/dinov2-small": dict(
        model_type="dinov2", head=False,
        config=dict(hidden_size=384, num_hidden_layers=12, num_attention_heads=6, mlp_ratio=4,
                    image_size=518, patch_size=14, layerscale_value=1.0),
        data=dict(input_size=(3, 224, 224), mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225),
                  interpolation="bicubic", crop_pct=0.875, crop_mode="center"),
    ),
}


class ModelUnavailableError(RuntimeError):
    """The weights of a model are neither cached nor downloadable from here."""


def _unavailable(name: str, how: str, why: str = "") -> ModelUnavailableError:
    embedded = ", ".join(f'"{n}"' for n in EMBEDDED_MODELS)
    msg = (
        f"cannot load pretrained weights for {name!r}: they are not in the local cache and cannot be "
        f"downloaded from here{(' (' + why + ')') if why else ''}.\n"
        f"  To pre-download, on a machine with internet access run:\n    {how}\n"
        "  then copy the Hugging Face cache (~/.cache/huggingface) or torch hub cache (~/.cache/torch) here.\n"
        f"  Offline alternatives shipped with vitlab: {embedded} (vitlab.load_model(name)); or pass "
        "pretrained=False for the same architecture with random weights."
    )
    return ModelUnavailableError(msg)


def _hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes", "on")


def _reachable(url: str, timeout: float = 3.0) -> bool:
    """Can a TCP connection be opened to ``url``'s host within ``timeout`` seconds?"""
    parts = urllib.parse.urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        with socket.create_connection((parts.hostname, port), timeout=timeout):
            return True
    except OSError:
        return False


def _hf_endpoint() -> str:
    from huggingface_hub import constants

    return constants.ENDPOINT


def _hf_cached(repo_id: str, filenames: tuple[str, ...]) -> bool:
    from huggingface_hub import try_to_load_from_cache

    for f in filenames:
        hit = try_to_load_from_cache(repo_id, f)
        if isinstance(hit, str) and os.path.exists(hit):
            return True
    return False


def _check_weights_reachable(name: str, *, hf_repo: str | None, url: str | None, how: str) -> None:
    """Raise fast when weights are not cached and the network cannot provide them."""
    if hf_repo is not None:
        if _hf_cached(hf_repo, ("model.safetensors", "pytorch_model.bin", "open_clip_pytorch_model.bin")):
            return
        if _hub_offline():
            raise _unavailable(name, how, "HF_HUB_OFFLINE is set")
        if not _reachable(_hf_endpoint()):
            raise _unavailable(name, how, "the Hugging Face hub is unreachable")
        return
    if url:
        fname = os.path.basename(urllib.parse.urlsplit(url).path)
        if os.path.exists(os.path.join(torch.hub.get_dir(), "checkpoints", fname)):
            return
        if not _reachable(url):
            raise _unavailable(name, how, "the download server is unreachable")


# ---------------------------------------------------------------------------- timm
def _load_timm(name: str, pretrained: bool, **kwargs) -> nn.Module:
    import timm

    if not timm.is_model(name):
        close = timm.list_models(f"*{name.split('.')[0][:12]}*")[:8]
        raise ValueError(
            f"unknown model {name!r}: not an embedded vitlab model ({', '.join(EMBEDDED_MODELS)}), "
            f"not a timm model name, and not a Hugging Face id (owner/name)."
            + (f" Similar timm names: {', '.join(close)}" if close else "")
        )
    if pretrained:
        cfg = timm.models.get_pretrained_cfg(name)
        hf_repo = getattr(cfg, "hf_hub_id", None) if cfg is not None else None
        url = getattr(cfg, "url", None) if cfg is not None else None
        _check_weights_reachable(
            name, hf_repo=hf_repo, url=url,
            how=f"python -c \"import timm; timm.create_model('{name}', pretrained=True)\"",
        )
    try:
        model = timm.create_model(name, pretrained=pretrained, **kwargs)
    except (OSError, RuntimeError) as e:  # hub errors surface as OSError subclasses
        if pretrained and not isinstance(e, ModelUnavailableError):
            raise _unavailable(
                name, f"python -c \"import timm; timm.create_model('{name}', pretrained=True)\"", str(e)[:200]
            ) from e
        raise
    return model


# ---------------------------------------------------------------------------- Hugging Face
def _hf_data_config(repo: str, model: nn.Module) -> dict[str, Any]:
    """timm-style data config from the checkpoint's image processor (or the known table)."""
    try:
        from transformers import AutoImageProcessor

        proc = AutoImageProcessor.from_pretrained(repo, local_files_only=True)
    except Exception:  # noqa: BLE001 - processor not cached: fall back to the table / config
        proc = None
    if proc is not None:
        size = getattr(proc, "crop_size", None) if getattr(proc, "do_center_crop", False) else getattr(proc, "size", None)
        size = dict(size) if size is not None else {}
        h = size.get("height") or size.get("shortest_edge")
        w = size.get("width") or size.get("shortest_edge")
        resample = int(getattr(proc, "resample", 2))
        data = dict(
            input_size=(3, int(h), int(w)),
            mean=tuple(proc.image_mean), std=tuple(proc.image_std),
            interpolation={2: "bilinear", 3: "bicubic"}.get(resample, "bilinear"),
            crop_pct=1.0, crop_mode="squash",
        )
        if getattr(proc, "do_center_crop", False):
            resize = dict(proc.size).get("shortest_edge") or dict(proc.size).get("height")
            data.update(crop_pct=float(h) / float(resize), crop_mode="center")
        return data
    if repo in _HF_KNOWN:
        return dict(_HF_KNOWN[repo]["data"])
    size = int(getattr(model.config, "image_size", 224))
    return dict(input_size=(3, size, size), mean=(0.5,) * 3, std=(0.5,) * 3,
                interpolation="bilinear", crop_pct=1.0, crop_mode="squash")


def _load_hf(repo: str, pretrained: bool, **kwargs) -> nn.Module:
    import transformers
    from transformers import AutoConfig

    how = f"python -c \"import vitlab; vitlab.load_model('{repo}')\"   (or: hf download {repo})"
    config = None
    try:
        config = AutoConfig.from_pretrained(repo, local_files_only=True)
    except Exception:  # noqa: BLE001 - not cached
        config = None
    if config is None and repo in _HF_KNOWN and not pretrained:
        known = _HF_KNOWN[repo]
        config = transformers.AutoConfig.for_model(known["model_type"], **known["config"])
    if pretrained:
        _check_weights_reachable(repo, hf_repo=repo, url=None, how=how)
        if config is None:
            config = AutoConfig.from_pretrained(repo)
    elif config is None:
        raise _unavailable(repo, how, "its configuration is not cached either, so even pretrained=False "
                                      f"cannot build it; known offline: {', '.join(_HF_KNOWN)}")
    has_head = bool(getattr(config, "id2label", None)) and config.model_type in ("vit", "deit") and (
        repo not in _HF_KNOWN or _HF_KNOWN[repo]["head"]
    )
    auto = transformers.AutoModelForImageClassification if has_head else transformers.AutoModel
    if pretrained:
        model = auto.from_pretrained(repo, **kwargs)
    else:
        model = auto.from_config(config, **kwargs)
    model.vitlab_data_config = _hf_data_config(repo, model)
    return model


# ---------------------------------------------------------------------------- embedded
def _embedded_loader(name: str) -> Callable[..., nn.Module]:
    module, fn = EMBEDDED_MODELS[name].split(":")
    return getattr(importlib.import_module(module), fn)


def load_model(name: str, pretrained: bool = True, **kwargs) -> nn.Module:
    """Load a Vision Transformer by name, in eval mode.

    Args:
        name: an embedded vitlab model (``"shapes-vit-tiny"``, ``"dinov2_small_imgfocus"``),
            any timm ViT name (``"deit_tiny_patch16_224"``, ``"vit_small_patch14_reg4_dinov2"``,
            ...), or a Hugging Face id (``"google/vit-base-patch16-224"``,
            ``"facebook/dinov2-small"``, ...).
        pretrained: ``False`` gives the same architecture with random weights.
        **kwargs: passed to the underlying constructor (e.g. ``img_size`` for timm models).

    Raises:
        ModelUnavailableError: pretrained weights are not cached and cannot be downloaded.
        ValueError: the name is unknown.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"model name must be a non-empty string, got {name!r}")
    if name in EMBEDDED_MODELS:
        model = _embedded_loader(name)(pretrained=pretrained, **kwargs)
    elif "/" in name and not name.startswith(("hf-hub:", "hf_hub:")):
        model = _load_hf(name, pretrained, **kwargs)
    else:
        model = _load_timm(name, pretrained, **kwargs)
    return model.eval()


# ---------------------------------------------------------------------------- preprocess
def data_config(model: nn.Module) -> dict[str, Any]:
    """The model's own resize / crop / normalisation, as a timm data config dict."""
    cfg = getattr(model, "vitlab_data_config", None)
    if cfg is not None:
        return dict(cfg)
    if hasattr(model, "pretrained_cfg") or hasattr(model, "default_cfg"):
        import timm.data

        return timm.data.resolve_data_config({}, model=model)
    if hasattr(model, "config") and hasattr(model.config, "image_size"):
        repo = getattr(model.config, "_name_or_path", "") or ""
        return _hf_data_config(repo, model)
    raise TypeError(f"cannot tell how to preprocess images for {type(model).__name__}")


def preprocess(image, model: nn.Module) -> torch.Tensor:
    """``image`` (path, URL, PIL image or array) -> ``1 x 3 x H x W`` input for ``model``.

    Uses the model's own data configuration (timm's pretrained config, or the Hugging Face
    image processor's settings), on the device of the model's parameters.
    """
    import timm.data

    from vitlab.images import load_image

    img = load_image(image)
    cfg = data_config(model)
    keys = ("input_size", "interpolation", "mean", "std", "crop_pct", "crop_mode")
    transform = timm.data.create_transform(**{k: cfg[k] for k in keys if k in cfg}, is_training=False)
    x = transform(img).unsqueeze(0)
    param = next(model.parameters(), None)
    return x.to(param.device) if param is not None else x


def load_model_or_fallback(preferred: str, fallback: str, pretrained: bool = True,
                           fallback_kwargs: dict | None = None, **kwargs) -> tuple[nn.Module, str]:
    """Load ``preferred``; if its weights cannot be had here, load the embedded ``fallback``.

    Returns ``(model, name_that_ran)`` and prints one line saying which model runs, so a
    notebook states it. Only :class:`ModelUnavailableError` triggers the fallback; any other
    error (a typo in a name, say) is raised.
    """
    try:
        model = load_model(preferred, pretrained=pretrained, **kwargs)
        print(f"Running on {preferred}.")
        return model, preferred
    except ModelUnavailableError:
        model = load_model(fallback, pretrained=pretrained, **(fallback_kwargs or {}))
        print(f"Running on {fallback} ({preferred} is not downloadable here).")
        return model, fallback


def preprocess_batch(images, model: nn.Module) -> torch.Tensor:
    """A batch of images (``N x H x W x 3`` uint8 array, or a sequence of images) ->
    ``N x 3 x H' x W'``, each through :func:`preprocess`."""
    if isinstance(images, np.ndarray) and images.ndim == 3:
        raise ValueError(f"expected a batch N x H x W x 3, got one image of shape {images.shape}; use preprocess()")
    if len(images) == 0:
        raise ValueError("preprocess_batch got an empty batch")
    return torch.cat([preprocess(img, model) for img in images])
