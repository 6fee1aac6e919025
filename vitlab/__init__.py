"""vitlab: look inside Vision Transformers.

The public API (names are fixed; the notebooks and chapters use them):

- :func:`load_model`, :func:`preprocess`, :func:`load_image` — models and inputs
- :func:`token_layout` — prefix tokens and patch grid of a model
- :func:`record` — the true attention (and its gradient), queries, keys, values and
  hidden states of every block, without changing the model
- :func:`explain` — any explanation method by its one name (:mod:`vitlab.methods`), on a ViT,
  LXMERT, VisualBERT, ViLT, DETR or CLIP model
- :func:`project` — every token's state after every block read as class logits through the
  model's own norm and head (:mod:`vitlab.projection`, chapter 7)
- :mod:`vitlab.plot` — overlays and grids of maps

Attributes are imported on first use, so ``import vitlab`` stays quick.
"""
from __future__ import annotations

import importlib

__version__ = "0.1.0"

# Imported eagerly: these are light, and ``vitlab.record`` must stay the function even after
# someone imports the module ``vitlab.record`` directly.
from vitlab.layout import TokenLayout, token_layout
from vitlab.record import Recording, record
from vitlab.models import (
    EMBEDDED_MODELS, ModelUnavailableError, load_chapter_model, load_model, load_model_or_fallback, preprocess, preprocess_batch,
)
# explanation methods: every one is (model, x, ...) -> B x gh x gw (cls_attention: per layer/head)
from vitlab.attention import (
    attention_gradcam, attention_gradients, cls_attention, qk_channel_scores, qk_maps, rank_qk_channels,
    raw_attention,
)
from vitlab.rollout import grad_rollout, rollout
from vitlab.relevance import chefer_relevance

# public name -> module that defines it
_EXPORTS = {
    "explain": "vitlab.methods",                # explain(method, model, inputs, target=None, **options)
    "load_image": "vitlab.images",
    "is_multi_label": "vitlab.targets",        # how a classifier's logits are read: sigmoids or one softmax
    "class_probabilities": "vitlab.targets",
    "project": "vitlab.projection",            # every token, block by block, as class logits (chapter 7)
}
_SUBMODULES = {"plot", "images", "shapes", "imgfocus", "localization", "faithfulness", "actmax", "widgets",
               "projection", "evaluate", "gradients", "inputs", "stats", "footprints", "lrp", "targets", "methods",
               "grad_eclip", "legrad", "clip_decomposition",  # CLIP: Grad-ECLIP, LeGrad, the embedding's decomposition
               "hierarchical"}  # Swin: rollout, relevance, raw attention, GradCAM through windows and stages

__all__ = [
    "__version__", "TokenLayout", "token_layout", "Recording", "record", "EMBEDDED_MODELS",
    "ModelUnavailableError", "load_chapter_model", "load_model", "load_model_or_fallback", "preprocess", "preprocess_batch",
    "cls_attention", "qk_maps", "qk_channel_scores", "rank_qk_channels", "raw_attention", "attention_gradcam",
    "attention_gradients", "rollout", "grad_rollout", "chefer_relevance", *_EXPORTS, *sorted(_SUBMODULES),
]


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
    elif name in _SUBMODULES:
        value = importlib.import_module(f"vitlab.{name}")
    elif name == "gradeclip":  # renamed in vitlab 0.2
        raise AttributeError("vitlab.gradeclip was renamed vitlab.grad_eclip (Grad-ECLIP, the method)")
    else:
        raise AttributeError(f"module 'vitlab' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__():
    return sorted(__all__)
