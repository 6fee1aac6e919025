"""Relevance: Chefer, Gur & Wolf, ICCV 2021, "Generic Attention-model Explainability for
Interpreting Bi-Modal and Encoder-Decoder Transformers" -- one engine, then one module per
model family.

- :mod:`vitlab.relevance.engine`: the update rules (eq. 1-11) as pure functions over batched
  tensors, attention events and :func:`propagate` (nothing there hooks or runs a model; its
  docstring lists every choice made where the paper or its reference code leaves room);
- :mod:`vitlab.relevance.vit`: a ViT (one modality): :func:`chefer_relevance`,
  :func:`relevance_matrix`, :func:`relevance_row`, and the same rule on the last block alone,
  :func:`last_block_relevance`; chapter 4's class-specific maps of every method from one
  recording (:func:`maps_from_gradients`, :func:`asked_object_maps`) and their grades against
  the asked object (:func:`grade_asked_object`);
- :mod:`vitlab.relevance.lxmert`: LXMERT's image and text relevance and the paper's baselines
  (raw attention, rollout, GradCAM); every method's maps of many questions
  (:func:`lxmert_method_maps`, the rule ablations :func:`lxmert_relevance_variants`) graded
  against the scenes' objects (:func:`grade_lxmert`, chapter 9);
- :mod:`vitlab.relevance.visualbert`: the same for VisualBERT and ViLT (:func:`grade_visualbert`);
- :mod:`vitlab.relevance.detr`: DETR's map per detected object and the same baselines; every
  detection's maps graded against the objects (:func:`grade_detr`, chapter 10);
- :mod:`vitlab.relevance.clip`: CLIP's image and text relevance of a pair's score (both towers)
  and the same baselines;
- :mod:`vitlab.relevance.bimodal`: what the bimodal families share (their map types, the
  recorded forward with gradients, events from a recording).

Every name is importable from ``vitlab.relevance`` itself.
"""
from vitlab.relevance.bimodal import BIMODAL_METHODS, BimodalMaps, DetectionMaps, attention_matrix_gradcam
from vitlab.relevance.clip import (
    CLIP_INPUTS, ClipMaps, clip_gradcam, clip_raw_attention, clip_relevance, clip_rollout, end_of_text,
)
from vitlab.relevance.detr import (
    DetectionGrades, detr_detections, detr_gradcam, detr_method_maps, detr_raw_attention, detr_relevance, detr_rollout,
    grade_detr,
)
from vitlab.relevance.engine import (
    AttentionEvent, Relevances, Step, bimodal_rule, head_averaged_relevance, initial_relevances,
    normalized_self_relevance, propagate, read_rows, self_attention_events, self_attention_rule,
)
from vitlab.relevance.lxmert import (
    LXMERT_ABLATIONS, LXMERT_INPUTS, QuestionGrades, grade_lxmert, lxmert_gradcam, lxmert_method_maps,
    lxmert_raw_attention, lxmert_relevance, lxmert_relevance_variants, lxmert_rollout, lxmert_scene_features,
    named_word_positions,
)
from vitlab.relevance.vit import (
    CLASS_METHODS, asked_object_maps, chefer_relevance, grade_asked_object, last_block_relevance, maps_from_gradients,
    relevance_matrix, relevance_row,
)
from vitlab.relevance.visualbert import (
    VILT_INPUTS, VISUALBERT_INPUTS, VISUALBERT_METHODS, answer_rows, grade_visualbert, vilt_gradcam, vilt_raw_attention,
    vilt_relevance, vilt_rollout, visualbert_gradcam, visualbert_method_maps, visualbert_raw_attention,
    visualbert_relevance, visualbert_rollout,
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
    # many maps at once, graded against the scenes' objects (chapters 4, 9 and 10)
    "CLASS_METHODS", "maps_from_gradients", "asked_object_maps", "grade_asked_object",
    "BIMODAL_METHODS", "LXMERT_ABLATIONS", "QuestionGrades", "grade_lxmert", "lxmert_method_maps",
    "lxmert_relevance_variants", "lxmert_scene_features", "named_word_positions",
    "VISUALBERT_METHODS", "grade_visualbert", "visualbert_method_maps",
    "DetectionGrades", "detr_detections", "detr_method_maps", "grade_detr",
]
