"""Relevance: Chefer, Gur & Wolf, ICCV 2021, "Generic Attention-model Explainability for
Interpreting Bi-Modal and Encoder-Decoder Transformers" -- one engine, then one module per
model family.

- :mod:`vitlab.relevance.engine`: the update rules (eq. 1-11) as pure functions over batched
  tensors, attention events and :func:`propagate` (nothing there hooks or runs a model; its
  docstring lists every choice made where the paper or its reference code leaves room);
- :mod:`vitlab.relevance.vit`: a ViT (one modality): :func:`chefer_relevance`,
  :func:`relevance_matrix`, :func:`relevance_row`, and the same rule on the last block alone,
  :func:`last_block_relevance`;
- :mod:`vitlab.relevance.lxmert`: LXMERT's image and text relevance and the paper's baselines
  (raw attention, rollout, GradCAM);
- :mod:`vitlab.relevance.detr`: DETR's map per detected object and the same baselines;
- :mod:`vitlab.relevance.clip`: CLIP's image and text relevance of a pair's score (both towers)
  and the same baselines;
- :mod:`vitlab.relevance._common`: what the bimodal families share (their map types, the
  recorded forward with gradients, events from a recording).

Every name is importable from ``vitlab.relevance`` itself.
"""
from vitlab.relevance._common import BimodalMaps, DetectionMaps, attention_matrix_gradcam
from vitlab.relevance.clip import (
    CLIP_INPUTS, ClipMaps, clip_gradcam, clip_raw_attention, clip_relevance, clip_rollout, end_of_text,
)
from vitlab.relevance.detr import detr_gradcam, detr_raw_attention, detr_relevance, detr_rollout
from vitlab.relevance.engine import (
    AttentionEvent, Relevances, Step, bimodal_rule, head_averaged_relevance, initial_relevances,
    normalized_self_relevance, propagate, read_rows, self_attention_events, self_attention_rule,
)
from vitlab.relevance.lxmert import (
    LXMERT_INPUTS, lxmert_gradcam, lxmert_raw_attention, lxmert_relevance, lxmert_rollout,
)
from vitlab.relevance.vit import chefer_relevance, last_block_relevance, relevance_matrix, relevance_row
from vitlab.relevance.visualbert import (
    VILT_INPUTS, VISUALBERT_INPUTS, answer_rows, vilt_gradcam, vilt_raw_attention, vilt_relevance, vilt_rollout,
    visualbert_gradcam, visualbert_raw_attention, visualbert_relevance, visualbert_rollout,
)

__all__ = [
    "CLIP_INPUTS", "ClipMaps", "clip_gradcam", "clip_raw_attention", "clip_relevance", "clip_rollout", "end_of_text",
    "AttentionEvent", "BimodalMaps", "DetectionMaps", "LXMERT_INPUTS", "Relevances", "Step",
    "attention_matrix_gradcam", "bimodal_rule", "chefer_relevance", "detr_gradcam", "detr_raw_attention",
    "detr_relevance", "detr_rollout", "head_averaged_relevance", "initial_relevances", "last_block_relevance", "lxmert_gradcam",
    "lxmert_raw_attention", "lxmert_relevance", "lxmert_rollout", "normalized_self_relevance", "propagate",
    "read_rows", "relevance_matrix", "relevance_row", "self_attention_events", "self_attention_rule",
    "VILT_INPUTS", "VISUALBERT_INPUTS", "answer_rows", "vilt_gradcam", "vilt_raw_attention", "vilt_relevance",
    "vilt_rollout", "visualbert_gradcam", "visualbert_raw_attention", "visualbert_relevance", "visualbert_rollout",
]
