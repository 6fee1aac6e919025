"""To be deleted: every name that lived here now lives in the module of the method or measure it
serves, and this file only re-exports them so that notebooks not yet rewritten keep running.

Rewrite a notebook's uses with ``python /work/notes/rewrite_chapters.py NOTEBOOK...``; once no
notebook imports ``vitlab.chapters``, delete this file. New code imports from the homes below.

- :mod:`vitlab.attention`: ``CLSProfile``, ``cls_attention_profile`` (chapter 2);
- :mod:`vitlab.rollout`: ``rollout_from_attentions``, ``rollout_settings_maps``,
  ``grade_rollout_settings`` (chapter 3);
- :mod:`vitlab.layout`: ``token_centres``, ``patch_centres`` (chapter 3a);
- :mod:`vitlab.localization`: ``shift_masks``, ``object_gaps``, ``top_token_is``, ``map_change``;
  ``paired_difference`` (its :class:`~vitlab.localization.Estimate` holds ``n`` after the
  ``(mean, low, high)`` this module's version returned);
- :mod:`vitlab.relevance.vit`: ``CLASS_METHODS``, ``maps_from_gradients``, ``asked_object_maps``,
  ``grade_asked_object`` (chapter 4);
- :mod:`vitlab.relevance.lxmert` (``BIMODAL_METHODS`` from :mod:`vitlab.relevance._common`):
  ``named_word_positions``, ``lxmert_scene_features``, ``lxmert_method_maps``, ``QuestionGrades``,
  ``grade_lxmert``, ``LXMERT_ABLATIONS``, ``lxmert_relevance_variants`` (chapters 9, 9a);
- :mod:`vitlab.relevance.visualbert`: ``VISUALBERT_METHODS``, ``visualbert_method_maps``,
  ``grade_visualbert`` (chapter 9);
- :mod:`vitlab.relevance.detr`: ``detr_detections``, ``detr_method_maps``, ``DetectionGrades``,
  ``grade_detr`` (chapter 10);
- :mod:`vitlab.bimodal_faithfulness`: ``PERTURBATION_TESTS``, ``perturbation_grid``,
  ``perturbation_rows``, ``Verdict``, ``perturbation_verdicts``, ``text_occlusion``,
  ``lxmert_answers_without`` (chapters 9, 9a).

Every :mod:`vitlab.relevance` name here is importable from ``vitlab.relevance`` itself.
"""
from __future__ import annotations

from vitlab.attention import CLSProfile, cls_attention_profile  # noqa: F401
from vitlab.bimodal_faithfulness import (  # noqa: F401
    PERTURBATION_TESTS, Verdict, lxmert_answers_without, perturbation_grid, perturbation_rows, perturbation_verdicts,
    text_occlusion,
)
from vitlab.layout import patch_centres, token_centres  # noqa: F401
from vitlab.localization import map_change, object_gaps, shift_masks, top_token_is  # noqa: F401
from vitlab.relevance import (  # noqa: F401
    BIMODAL_METHODS, CLASS_METHODS, LXMERT_ABLATIONS, VISUALBERT_METHODS, DetectionGrades, QuestionGrades,
    asked_object_maps, detr_detections, detr_method_maps, grade_asked_object, grade_detr, grade_lxmert,
    grade_visualbert, lxmert_method_maps, lxmert_relevance_variants, lxmert_scene_features, maps_from_gradients,
    named_word_positions, visualbert_method_maps,
)
from vitlab.rollout import grade_rollout_settings, rollout_from_attentions, rollout_settings_maps  # noqa: F401


def paired_difference(a, b, seed: int = 0) -> tuple[float, float, float]:
    """``(mean, low, high)`` of ``a - b``: the first three fields of
    :func:`vitlab.localization.paired_difference` (the one implementation), for notebooks not yet
    rewritten (the rewrite reads ``d, lo, hi, _ = loc.paired_difference(a, b)``)."""
    from vitlab.localization import paired_difference as _paired

    e = _paired(a, b, seed=seed)
    return e.value, e.low, e.high
