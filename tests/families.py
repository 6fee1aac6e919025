"""Tiny random-initialised models of every ViT family vitlab is tried on, and the checks of the
supported-models table (tests/test_supported_models.py asserts them; scripts/supported_models.py
prints the README's table from them). Everything here runs in float64: exactness is the point.

Each family is built from a small config (depth 2, width 32, 32 x 32 images) of its real
architecture, with weights drawn large enough for peaked attention (timm's init is tiny).
"""
from __future__ import annotations

import copy
import re

import torch

SIZE = 32
CLASSES = 5


def _randomize(model, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64).to(p.dtype) * 0.3)
    return model


def _timm(name, **kw):
    import timm

    def build():
        args = dict(pretrained=False, img_size=SIZE, num_classes=CLASSES)  # kw may set img_size
        args.update(kw)
        return timm.create_model(name, **args)
    return build


_SMALL = dict(patch_size=8, embed_dim=32, depth=2, num_heads=2)
_HF = dict(image_size=SIZE, patch_size=8, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
           intermediate_size=64)


def _hf(model_cls, config_cls, **kw):
    def build():
        import transformers as tf

        return getattr(tf, model_cls)(getattr(tf, config_cls)(**{**_HF, **kw}))
    return build


def _hf_pair(model_cls, config_cls, vision_cls, **kw):
    def build():
        import transformers as tf

        vision = {**_HF, **kw}
        text = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, vocab_size=99)
        cfg = getattr(tf, config_cls)(vision_config=vision, text_config=text,
                                      **({"num_labels": CLASSES} if model_cls.endswith("Classification") else {}))
        return getattr(tf, model_cls)(cfg)
    return build


#: family name -> builder of a tiny random model of it (untrained; eval mode, float64 by :func:`build`)
FAMILIES = {
    "timm ViT": _timm("vit_tiny_patch16_224", **_SMALL),
    "timm ViT, mean-pooled (global_pool='avg')": _timm("vit_tiny_patch16_224", global_pool="avg", **_SMALL),
    "timm ViT, attention-pooled (global_pool='map')": _timm("vit_tiny_patch16_224", global_pool="map", **_SMALL),
    "timm DeiT distilled": _timm("deit_tiny_distilled_patch16_224", **_SMALL),
    "timm DeiT-3": _timm("deit3_small_patch16_224", **_SMALL),
    "timm DINOv2": _timm("vit_small_patch14_dinov2", **_SMALL),
    "timm DINOv2 + registers": _timm("vit_small_patch14_reg4_dinov2", **_SMALL),
    "timm FlexiViT": _timm("flexivit_small", **_SMALL),
    "timm hybrid R+ViT": _timm("vit_tiny_r_s16_p8_224", img_size=64, embed_dim=32, depth=2, num_heads=2),
    "timm BEiT": _timm("beit_base_patch16_224", **_SMALL),
    "timm EVA-02": _timm("eva02_tiny_patch14_224", **_SMALL),
    "timm EVA-02, class-token head (global_pool='token')": _timm("eva02_tiny_patch14_224", global_pool="token",
                                                                  **_SMALL),
    "timm CaiT": _timm("cait_xxs24_224", depth_token_only=2, **_SMALL),
    "timm Swin": _timm("swin_tiny_patch4_window7_224", patch_size=4, window_size=4, embed_dim=16, depths=(1, 1),
                       num_heads=(1, 2)),
    "HF ViT": _hf("ViTForImageClassification", "ViTConfig", num_labels=CLASSES),
    "HF DeiT distilled": _hf("DeiTForImageClassificationWithTeacher", "DeiTConfig", num_labels=CLASSES),
    "HF BEiT (mean pooling)": _hf("BeitForImageClassification", "BeitConfig", num_labels=CLASSES,
                                  use_mean_pooling=True, use_relative_position_bias=True),
    "HF Dinov2ForImageClassification": _hf("Dinov2ForImageClassification", "Dinov2Config", num_labels=CLASSES),
    "HF Dinov2WithRegistersForImageClassification": _hf("Dinov2WithRegistersForImageClassification",
                                                        "Dinov2WithRegistersConfig", num_labels=CLASSES,
                                                        num_register_tokens=2),
    "HF Dinov2Model (no head)": _hf("Dinov2Model", "Dinov2Config"),
    "HF SigLIP vision model (attention-pool head)": _hf("SiglipVisionModel", "SiglipVisionConfig"),
    "HF SigLIP classifier": _hf_pair("SiglipForImageClassification", "SiglipConfig", "SiglipVisionConfig"),
    "HF CLIPVisionModel (no head)": _hf("CLIPVisionModel", "CLIPVisionConfig"),
    "HF CLIPModel": _hf_pair("CLIPModel", "CLIPConfig", "CLIPVisionConfig"),
    "HF Swin": lambda: __import__("transformers").SwinForImageClassification(__import__("transformers").SwinConfig(
        image_size=SIZE, patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[1, 2], window_size=4,
        num_labels=CLASSES)),
}

#: input size of a family whose grid at SIZE would be a single token (the hybrid's ResNet stem has stride 32)
SIZES = {"timm hybrid R+ViT": 64}


def build(name: str, seed: int = 0):
    """The family's tiny model: random weights (``seed``), float64, eval mode."""
    model = FAMILIES[name]()
    return _randomize(model, seed).double().eval()


def images(n: int = 2, seed: int = 1, family: str | None = None) -> torch.Tensor:
    """``n`` random float64 images of the family's input size."""
    size = SIZES.get(family, SIZE)
    return torch.randn(n, 3, size, size, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def has_head(model) -> bool:
    """Whether the model outputs class logits (timm num_classes > 0, a Hugging Face ...ForImageClassification)."""
    if hasattr(model, "config") and hasattr(model.config, "model_type"):
        return hasattr(model, "classifier") or type(model).__name__.endswith("Classification") or \
            type(model).__name__.endswith("WithTeacher")
    return getattr(model, "num_classes", 0) > 0


def direction(model, seed: int = 3) -> torch.Tensor:
    """A fixed unit direction in the pooled output's space (for heads-less models' function target)."""
    config = getattr(model, "config", None)
    dim = getattr(config, "hidden_size", None) or getattr(config, "projection_dim", None)
    g = torch.Generator().manual_seed(seed)
    d = torch.randn(dim, generator=g, dtype=torch.float64)
    return d / d.norm()


def pooled_target(model):
    """``target`` for a heads-less model: the pooled output along :func:`direction`."""
    d = direction(model)
    return lambda out: out.pooler_output @ d


def output_tensor(out) -> torch.Tensor:
    """The main tensor of a model output: logits, else the pooled output, else the last hidden state."""
    if isinstance(out, torch.Tensor):
        return out
    for name in ("logits", "pooler_output", "last_hidden_state", "logits_per_image"):
        t = getattr(out, name, None)
        if isinstance(t, torch.Tensor):
            return t
    raise TypeError(type(out).__name__)


# --- the eager reference attention, independent of vitlab.record --------------------------------
def eager_attentions(model, x, with_output: bool = False, **kwargs):
    """Every attention matrix the model multiplies with its values, from the model's own eager path:
    timm: a copy with ``fused_attn`` off, read at each attention's ``attn_drop`` (hooks on the copy);
    Hugging Face: a copy built with ``attn_implementation="eager"`` and ``output_attentions=True``.
    ``with_output``: also the copy's output of that forward (the attentions are in its graph)."""
    if hasattr(model, "config") and hasattr(model.config, "model_type"):
        eager = type(model)._from_config(model.config, attn_implementation="eager").double().eval()
        eager.load_state_dict(model.state_dict())
        out = eager(x, output_attentions=True, **kwargs)
        return (list(out.attentions), out) if with_output else list(out.attentions)
    eager = copy.deepcopy(model)
    got, handles = [], []
    for name, m in eager.named_modules():
        attn = getattr(m, "attn", None)
        if isinstance(attn, torch.nn.Module) and isinstance(getattr(attn, "attn_drop", None), torch.nn.Module):
            if hasattr(attn, "fused_attn"):
                attn.fused_attn = False
            handles.append(attn.attn_drop.register_forward_hook(lambda mod, i, o: got.append(o)))
    out = eager(x)
    for h in handles:
        h.remove()
    return (got, out) if with_output else got


_INTERNAL = re.compile(r"vitlab(\.\w+)*\._\w+|\battention_size\b|\b_vit_only\b|\b_adapter_for\b|\bKeyError\b")


def internal_name(message: str) -> str | None:
    """An internal name (a private vitlab function, a record helper) in an error message, or None."""
    m = _INTERNAL.search(message)
    return None if m is None else m.group(0)


def methods() -> dict:
    """The registry's methods (vitlab.evaluate.METHODS) but the random baseline."""
    from vitlab.evaluate import METHODS

    return {name: fn for name, fn in METHODS.items() if name != "random"}


def run_method(fn, model, x, target):
    return fn(model, x, target, None)


def method_status(name: str, model, x, tol) -> tuple[str, str]:
    """``("exact", how)``: the method ran, per sample on the batch (each sample's map equals the
    map of that sample alone, within ``tol(values)``), finite, on the patch grid; ``("refused",
    message)``: it raised ``ValueError`` / ``TypeError`` before explaining. Any other exception
    propagates (a cryptic failure is a test failure)."""
    from vitlab.layout import token_layout

    fn = methods()[name]
    target = 1 if has_head(model) else pooled_target(model)
    try:
        maps = run_method(fn, model, x, target)
    except (ValueError, TypeError) as e:
        return "refused", str(e)
    grid = token_layout(model, x).grid
    assert tuple(maps.shape) == (x.shape[0], *grid), (name, tuple(maps.shape))
    assert bool(torch.isfinite(maps).all()), name
    for i in range(x.shape[0]):
        one = run_method(fn, model, x[i:i + 1], target)
        assert torch.allclose(one[0].double(), maps[i].double(), **tol(maps)), (name, i)
    return "exact", "target = a function of the output" if callable(target) else "class target"
