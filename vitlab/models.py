"""Load a ViT by name — timm, Hugging Face, or one of vitlab's embedded offline models —
and turn an image into that model's input. The bi-modal transformers of chapter 9 load the
same way: Hugging Face DETR (``facebook/detr-resnet-50``) and LXMERT
(``unc-nlp/lxmert-vqa-uncased``), with their task heads, and CLIP (``openai/clip-vit-base-patch32``),
with eager attention.

``load_model(name)`` never hangs when offline: if the weights are neither cached nor
reachable it raises :class:`ModelUnavailableError` within a few seconds, naming the model,
how to pre-download it, and the embedded models that need no network.
"""
from __future__ import annotations

import hashlib
import importlib
import os
import socket
import urllib.parse
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from torch import nn

#: The folder of the embedded models' weights and cards (``vitlab/weights``), shipped with the package.
WEIGHTS_DIR = Path(__file__).resolve().parent / "weights"

# name -> "module:function"; each loader is ``fn(pretrained=True, **kwargs) -> nn.Module`` in eval
# mode: a timm VisionTransformer (shapes-swin: a timm SwinTransformer) with ``pretrained_cfg`` set, or (shapes-lxmert, shapes-detr) a
# Hugging Face LXMERT / DETR on the frozen shapes-vit-tiny (vitlab.shapes.bimodal).
EMBEDDED_MODELS: dict[str, str] = {
    "shapes-vit-tiny": "vitlab.shapes.model:load_shapes_vit",
    "dinov2_small_imgfocus": "vitlab.imgfocus:load_imgfocus_vit",
    "shapes-lxmert": "vitlab.shapes.bimodal:load_shapes_lxmert",
    "shapes-detr": "vitlab.shapes.bimodal:load_shapes_detr",
    "shapes-visualbert": "vitlab.shapes.visualbert:load_shapes_visualbert",
    "shapes-clip": "vitlab.shapes.clip_model:load_shapes_clip",
    "shapes-swin": "vitlab.shapes.swin_model:load_shapes_swin",
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
    # DETR (Carion et al. 2020), the detector chapter 9 explains: a ResNet-50 (timm's, its weights part of
    # the checkpoint), 6 encoder + 6 decoder layers of width 256 with 8 heads, 100 object queries, the 91
    # COCO category ids (id2label filled from torchvision's COCO table, see _coco_detection_labels). Its
    # processor keeps the aspect ratio: shortest edge 800, longest at most 1333, ImageNet mean / std.
    "facebook/detr-resnet-50": dict(
        model_type="detr", head=True, labels="coco-detection",
        config=dict(use_timm_backbone=True, backbone="resnet50", dilation=False, num_queries=100,
                    encoder_layers=6, decoder_layers=6, encoder_attention_heads=8, decoder_attention_heads=8,
                    encoder_ffn_dim=2048, decoder_ffn_dim=2048, d_model=256, position_embedding_type="sine"),
        data=dict(shortest_edge=800, longest_edge=1333, mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225),
                  interpolation="bilinear"),
    ),
    # LXMERT (Tan & Bansal 2019) fine-tuned on VQA: 9 language, 5 object-relationship and 5 cross-modality
    # layers of width 768 with 12 heads, BERT's uncased vocabulary, 2048-d region features with 4-d boxes,
    # 3129 answers. No image processor: it takes region features (see LXMERT_REGION_FEATURES).
    "unc-nlp/lxmert-vqa-uncased": dict(
        model_type="lxmert", head=True,
        config=dict(hidden_size=768, num_attention_heads=12, intermediate_size=3072, l_layers=9, r_layers=5,
                    x_layers=5, vocab_size=30522, visual_feat_dim=2048, visual_pos_dim=4, num_qa_labels=3129),
        data=None,
    ),
    # VisualBERT (Li et al. 2019) fine-tuned on VQA, the single-stream model of Chefer et al. 2021: BERT-base
    # (12 layers of width 768, 12 heads) over the question's tokens and 2048-d region features together, 3129
    # answers read off the last question token. No image processor: it takes region features.
    "uclanlp/visualbert-vqa": dict(
        model_type="visual_bert", head=True,
        config=dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072,
                    vocab_size=30522, type_vocab_size=2, pad_token_id=1, visual_embedding_dim=2048,
                    special_visual_initialize=True, bypass_transformer=False, num_labels=3129),
        data=None,
    ),
    # ViLT (Kim et al. 2021) fine-tuned on VQA: a single stream that reads pixels (32 x 32 patches, no detector),
    # 12 layers of width 768 with 12 heads, 40 text positions, 3129 answers. Its processor keeps the aspect
    # ratio: shortest edge 384, longest at most 640, mean = std = 0.5, bicubic.
    "dandelin/vilt-b32-finetuned-vqa": dict(
        model_type="vilt", head=True,
        config=dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072,
                    image_size=384, patch_size=32, max_image_length=-1, max_position_embeddings=40,
                    vocab_size=30522, type_vocab_size=2, modality_type_vocab_size=2, qkv_bias=True,
                    num_labels=3129),
        data=dict(shortest_edge=384, longest_edge=640, mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5),
                  interpolation="bicubic"),
    ),
    # CLIP (Radford et al. 2021), the dual encoder of chapter 11: OpenAI's ViT-B/32 and ViT-B/16 image towers
    # (12 layers of width 768, 12 heads; 224 px in 32- or 16-px patches) and their causal text tower (12 layers of
    # width 512, 8 heads, 77 positions, 49,408 BPE tokens), both with quick GELU, projected to 512. Their text_config
    # keeps eos_token_id = 2, so CLIPTextTransformer pools at input_ids.argmax(-1), the end-of-text token (the
    # largest id of that vocabulary). Processor: shortest edge 224 (bicubic), centre crop 224, OpenAI's mean / std.
    **{f"openai/clip-vit-base-patch{p}": dict(
        model_type="clip", head=False,
        config=dict(
            projection_dim=512, logit_scale_init_value=2.6592,
            text_config=dict(vocab_size=49408, hidden_size=512, intermediate_size=2048, num_hidden_layers=12,
                             num_attention_heads=8, max_position_embeddings=77, hidden_act="quick_gelu",
                             layer_norm_eps=1e-5, bos_token_id=0, eos_token_id=2, pad_token_id=1, projection_dim=512),
            vision_config=dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                               image_size=224, patch_size=p, hidden_act="quick_gelu", layer_norm_eps=1e-5,
                               projection_dim=512)),
        data=dict(input_size=(3, 224, 224), mean=(0.48145466, 0.4578275, 0.40821073),
                  std=(0.26862954, 0.26130258, 0.27577711), interpolation="bicubic", crop_pct=1.0, crop_mode="center"),
    ) for p in (32, 16)},
}

# The Hugging Face class load_model builds for a config's model_type, for any repo (cached or known):
# the bi-modal models get their task heads, whose scores the relevance methods explain
# (vitlab.relevance.detr_relevance, lxmert_relevance). Other model types: see _load_hf.
HF_TASK_CLASSES: dict[str, str] = {
    "detr": "DetrForObjectDetection",
    "lxmert": "LxmertForQuestionAnswering",
    "visual_bert": "VisualBertForQuestionAnswering",
    "vilt": "ViltForQuestionAnswering",
    "clip": "CLIPModel",          # both towers and the image-text score (logits_per_image)
}

# model_types whose attention vitlab records from the attention weights, so load_model asks Hugging Face for
# the eager implementation (under SDPA no attention matrix exists); an explicit attn_implementation= wins.
HF_EAGER: tuple[str, ...] = ("clip",)

VISUALBERT_REGION_FEATURES = (
    "VisualBERT does not look at pixels either: like LXMERT it takes region features, inputs['visual_embeds'] "
    "(B x regions x 2048 for uclanlp/visualbert-vqa: an object detector's region features; "
    "inputs['visual_attention_mask'] for padded regions), with the tokenised question (input_ids, attention_mask; "
    "tokenizer: AutoTokenizer.from_pretrained('google-bert/bert-base-uncased'), as in Hugging Face's VisualBERT "
    "examples); its answer is read off the last question "
    "token, attention_mask.sum(1) - 2. vitlab does not compute region features. Offline, vitlab's "
    "'shapes-visualbert' takes pixel_values; for a photo with no detector use ViLT "
    "('dandelin/vilt-b32-finetuned-vqa'), which reads pixels (vitlab.preprocess works for it)."
)

LXMERT_REGION_FEATURES = (
    "LXMERT does not look at pixels: it takes the features of image regions found by an object detector, "
    "inputs['visual_feats'] (B x regions x 2048; the pretrained models saw 36 regions per image) and their boxes "
    "inputs['visual_pos'] (B x regions x 4: x1, y1, x2, y2 divided by the image's width and height), with the "
    "tokenised question (input_ids, attention_mask; tokenizer: AutoTokenizer.from_pretrained("
    "'unc-nlp/lxmert-base-uncased')). vitlab does not compute region features. They come from the Faster R-CNN "
    "the LXMERT authors used (bottom-up attention, trained on Visual Genome; github.com/airsplay/lxmert and "
    "github.com/airsplay/py-bottom-up-attention), which Hugging Face's research project 'lxmert' "
    "runs in PyTorch (examples/research_projects/lxmert of github.com/huggingface/transformers, since moved to "
    "github.com/huggingface/transformers-research-projects; demo.ipynb, modeling_frcnn.py, processing_image.py): "
    "GeneralizedRCNN.from_pretrained('unc-nlp/frcnn-vg-finetuned') after its Preprocess gives 'roi_features' "
    "(visual_feats) and 'normalized_boxes' (visual_pos); the VQA answer names are airsplay/lxmert's "
    "data/vqa/trainval_label2ans.json. Offline, vitlab's 'shapes-lxmert' takes pixel_values instead "
    "(vitlab.preprocess works for it)."
)


class ModelUnavailableError(RuntimeError):
    """The weights of a model are neither cached nor downloadable from here."""


def file_sha256(path) -> str:
    """The SHA-256 of a file's bytes (hex), read in 4 MiB blocks: how weights files are told apart."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


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
def _coco_detection_labels() -> dict[int, str]:
    """DETR's COCO ``id2label``: the 91 COCO category ids, "N/A" at the 11 unused ones and at 0.

    torchvision ships the same table for its COCO detectors (index 0 is its "__background__",
    which DETR's checkpoint calls "N/A"), so no download is needed.
    """
    from torchvision.models.detection import FasterRCNN_ResNet50_FPN_Weights

    names = FasterRCNN_ResNet50_FPN_Weights.DEFAULT.meta["categories"]
    return {i: ("N/A" if name == "__background__" else name) for i, name in enumerate(names)}


def _known_config(repo: str):
    """The configuration of a checkpoint in :data:`_HF_KNOWN`, built without any file."""
    import transformers

    known = _HF_KNOWN[repo]
    kwargs = dict(known["config"])
    if known.get("labels") == "coco-detection":
        kwargs["id2label"] = _coco_detection_labels()
        kwargs["label2id"] = {name: i for i, name in kwargs["id2label"].items()}  # "N/A": its last id, 83
    return transformers.AutoConfig.for_model(known["model_type"], **kwargs)


def _no_pretrained_backbone(config) -> None:
    """A DETR's backbone weights are in its checkpoint: never fetch a separately pretrained backbone
    (``use_pretrained_backbone``; transformers 5 builds timm backbones without pretrained weights anyway)."""
    for cfg in (config, getattr(config, "backbone_config", None)):
        if cfg is not None and hasattr(cfg, "use_pretrained_backbone"):
            cfg.use_pretrained_backbone = False


def _aspect_data_config(proc=None, known: dict | None = None) -> dict[str, Any]:
    """DETR-style preprocessing (aspect ratio kept): shortest edge, longest-edge cap, mean, std."""
    if proc is not None:
        size = dict(getattr(proc, "size", None) or {})
        resample = int(getattr(proc, "resample", 2))
        return dict(shortest_edge=int(size.get("shortest_edge", 800)), longest_edge=int(size.get("longest_edge", 1333)),
                    mean=tuple(proc.image_mean), std=tuple(proc.image_std),
                    interpolation={2: "bilinear", 3: "bicubic"}.get(resample, "bilinear"))
    return dict(known or _HF_KNOWN["facebook/detr-resnet-50"]["data"])


def _hf_data_config(repo: str, model: nn.Module) -> dict[str, Any]:
    """timm-style data config from the checkpoint's image processor (or the known table).

    A DETR gets an aspect-ratio keeping config instead (``shortest_edge``, ``longest_edge``, ``mean``,
    ``std``, ``interpolation``; no ``input_size``, no crop), which :func:`preprocess` applies as DETR's
    image processor does. LXMERT takes region features, not pixels: a TypeError says where to get them.
    """
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type in ("lxmert", "visual_bert"):
        raise TypeError(f"vitlab.preprocess cannot prepare images for {type(model).__name__}. "
                        + (LXMERT_REGION_FEATURES if model_type == "lxmert" else VISUALBERT_REGION_FEATURES))
    try:
        from transformers import AutoImageProcessor

        proc = AutoImageProcessor.from_pretrained(repo, local_files_only=True)
    except Exception:  # noqa: BLE001 - processor not cached: fall back to the table / config
        proc = None
    if model_type == "detr":
        return _aspect_data_config(proc, _HF_KNOWN[repo]["data"] if repo in _HF_KNOWN else None)
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
    if model_type == "clip":  # CLIP's own preprocessing (CLIPImageProcessor's defaults) at the tower's size
        size = int(model.config.vision_config.image_size)
        return dict(_HF_KNOWN["openai/clip-vit-base-patch32"]["data"], input_size=(3, size, size))
    size = int(getattr(model.config, "image_size", 224))
    return dict(input_size=(3, size, size), mean=(0.5,) * 3, std=(0.5,) * 3,
                interpolation="bilinear", crop_pct=1.0, crop_mode="squash")


def _hf_class(repo: str, config):
    """The transformers class to build: the task head of :data:`HF_TASK_CLASSES` for DETR / LXMERT,
    the image classifier for a ViT / DeiT checkpoint with labels, else the bare model."""
    import transformers

    if config.model_type in HF_TASK_CLASSES:
        return getattr(transformers, HF_TASK_CLASSES[config.model_type])
    has_head = bool(getattr(config, "id2label", None)) and config.model_type in ("vit", "deit") and (
        repo not in _HF_KNOWN or _HF_KNOWN[repo]["head"]
    )
    return transformers.AutoModelForImageClassification if has_head else transformers.AutoModel


def _load_hf(repo: str, pretrained: bool, **kwargs) -> nn.Module:
    from transformers import AutoConfig

    how = f"python -c \"import vitlab; vitlab.load_model('{repo}')\"   (or: hf download {repo})"
    config = None
    try:
        config = AutoConfig.from_pretrained(repo, local_files_only=True)
    except Exception:  # noqa: BLE001 - not cached
        config = None
    if config is None and repo in _HF_KNOWN and not pretrained:
        config = _known_config(repo)
    if pretrained:
        _check_weights_reachable(repo, hf_repo=repo, url=None, how=how)
        if config is None:
            config = AutoConfig.from_pretrained(repo)
    elif config is None:
        raise _unavailable(repo, how, "its configuration is not cached either, so even pretrained=False "
                                      f"cannot build it; known offline: {', '.join(_HF_KNOWN)}")
    if config.model_type == "detr":
        _no_pretrained_backbone(config)
    if config.model_type in HF_EAGER:
        kwargs.setdefault("attn_implementation", "eager")
    cls = _hf_class(repo, config)
    if pretrained:
        model = cls.from_pretrained(repo, config=config, **kwargs)
    else:
        model = cls.from_config(config, **kwargs) if hasattr(cls, "from_config") else cls._from_config(config, **kwargs)
    if config.model_type not in ("lxmert", "visual_bert"):  # region features: data_config explains
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
            ``"facebook/dinov2-small"``, ...). The bi-modal models of chapter 9 get their task
            heads (:data:`HF_TASK_CLASSES`, by the config's ``model_type``, for any repo):
            ``"facebook/detr-resnet-50"`` gives a ``DetrForObjectDetection`` (ResNet-50 backbone
            included in the checkpoint: no separately pretrained backbone is fetched; images via
            :func:`preprocess`, which keeps DETR's aspect ratio), ``"unc-nlp/lxmert-vqa-uncased"``
            a ``LxmertForQuestionAnswering`` (3129 VQA answers; it takes region features, not
            images: :data:`LXMERT_REGION_FEATURES` says where they come from). A CLIP
            (``"openai/clip-vit-base-patch32"``, ``-patch16``, any repo whose config is a ``clip``)
            gives a ``CLIPModel`` with eager attention in both towers (:data:`HF_EAGER`), images via
            :func:`preprocess` (CLIP's resize, centre crop and mean / std); its text goes through the
            checkpoint's own tokenizer (``CLIPTokenizer``), which vitlab does not ship.
            ``"shapes-clip"`` is vitlab's own, offline (``model.encode(texts)`` tokenizes).
        pretrained: ``False`` gives the same architecture with random weights, built offline
            without any download for the checkpoints vitlab knows (``_HF_KNOWN``: the two above,
            DETR with COCO's 91 category ids and names, and the ViTs) and for any cached config.
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
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if hasattr(model, "config") and (hasattr(model.config, "image_size") or model_type in HF_TASK_CLASSES):
        repo = getattr(model.config, "_name_or_path", "") or ""
        return _hf_data_config(repo, model)  # a TypeError for LXMERT, saying where its inputs come from
    raise TypeError(f"cannot tell how to preprocess images for {type(model).__name__}")


def preprocess(image, model: nn.Module) -> torch.Tensor:
    """``image`` (path, URL, PIL image or array) -> ``1 x 3 x H x W`` input for ``model``.

    Uses the model's own data configuration (timm's pretrained config, or the Hugging Face
    image processor's settings), on the device of the model's parameters. A DETR keeps the
    image's aspect ratio, as its image processor does (``DetrImageProcessor``: shortest edge
    800, longest at most 1333, ImageNet mean / std, no crop), so ``H x W`` follows the image.
    LXMERT takes region features, not images: a TypeError says where to get them.
    """
    from vitlab.images import load_image

    img = load_image(image)
    cfg = data_config(model)
    if "shortest_edge" in cfg:  # DETR-style: resize keeping the aspect ratio, normalise, no crop
        from transformers import DetrImageProcessor

        proc = DetrImageProcessor(size={"shortest_edge": cfg["shortest_edge"], "longest_edge": cfg["longest_edge"]},
                                  image_mean=list(cfg["mean"]), image_std=list(cfg["std"]), do_pad=False,
                                  resample={"bilinear": 2, "bicubic": 3}[cfg.get("interpolation", "bilinear")])
        x = proc(images=img, return_tensors="pt")["pixel_values"]
    else:
        import timm.data

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


def load_chapter_model(stored: str, blog: str = "deit_tiny_patch16_224", use_blog: bool = False,
                       stored_kwargs: dict | None = None, **blog_kwargs) -> tuple[nn.Module, str]:
    """The model a chapter runs on: by default ``stored``, the embedded model that produced the
    notebook's stored outputs and that its text describes, so a re-run anywhere (online or not)
    draws the same figures; with ``use_blog=True`` the blog's ``blog`` model (timm's DeiT-tiny),
    which needs its weights downloaded once, falling back to ``stored`` when they cannot be had.

    Returns ``(model, name_that_runs)`` and prints one line saying which model runs and, for the
    blog's model, that the figures will differ from the text.
    """
    if not use_blog:
        model = load_model(stored, **(stored_kwargs or {}))
        print(f"Running on {stored}, the model this chapter's text describes "
              f"(set USE_BLOG_MODEL = True for the blog's {blog}).")
        return model, stored
    try:
        model = load_model(blog, **blog_kwargs)
    except ModelUnavailableError:
        model = load_model(stored, **(stored_kwargs or {}))
        print(f"Running on {stored}: {blog} is not downloadable here, so the figures are the stored ones.")
        return model, stored
    print(f"Running on {blog}, the blog's model: the figures and numbers below will differ from the text, "
          f"which describes {stored}.")
    return model, blog


def preprocess_batch(images, model: nn.Module) -> torch.Tensor:
    """A batch of images (``N x H x W x 3`` uint8 array, or a sequence of images) ->
    ``N x 3 x H' x W'``, each through :func:`preprocess`."""
    if isinstance(images, np.ndarray) and images.ndim == 3:
        raise ValueError(f"expected a batch N x H x W x 3, got one image of shape {images.shape}; use preprocess()")
    if len(images) == 0:
        raise ValueError("preprocess_batch got an empty batch")
    xs = [preprocess(img, model) for img in images]
    sizes = sorted({tuple(x.shape[-2:]) for x in xs})
    if len(sizes) > 1:
        raise ValueError(f"preprocess_batch: {type(model).__name__} keeps each image's aspect ratio, giving inputs of "
                         f"sizes {sizes}; explain them one at a time, or pad them to one size with "
                         "transformers' DetrImageProcessor (pixel_values and pixel_mask)")
    return torch.cat(xs)
