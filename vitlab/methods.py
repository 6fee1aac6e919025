"""Every explanation method under one name, for every model family, and :func:`explain`.

``vitlab.explain(method, model, inputs, target=None, **options)`` runs a method on any model
vitlab can record: it finds the model's family (:func:`vitlab.record.model_family`: a ViT,
LXMERT, VisualBERT, ViLT, DETR, CLIP or Swin) and calls that family's implementation, so a reader
learns one name per method (``"relevance"``, not ``chefer_relevance`` / ``lxmert_relevance`` /
``detr_relevance`` / ``clip_relevance``)::

    vitlab.explain("relevance", vit, x, target=3)           # B x gh x gw
    vitlab.explain("relevance", lxmert, inputs)             # BimodalMaps (the predicted answers)
    vitlab.explain("rollout", detr, pixels)                 # one DetectionMaps per image
    vitlab.explain("grad_eclip", clip, pairs)               # ClipMaps (each pair's score)

:data:`METHODS` holds one :class:`Method` per name: its display name (the one label tables and
figures use), whether it explains a chosen score (``needs_target``: with ``target=None`` the
model's own prediction) or reads the attention alone, and the implementing function per family.
The family functions stay the implementations; their docstrings say what each computes.

What ``inputs`` and ``target`` are depends on the family (:data:`FAMILIES`). A method a family
does not serve, an unknown name, a target given to a method that reads no score and an option
the implementation does not take are refused before any forward, naming what is allowed.

Adding a family is one entry in :data:`IMPLEMENTATIONS` (its methods) and one in
:data:`FAMILIES` (what its inputs and target are), once :mod:`vitlab.record` can record it.
"""
from __future__ import annotations

import functools
import importlib
import inspect
from dataclasses import dataclass
from typing import Callable

__all__ = ["FAMILIES", "IMPLEMENTATIONS", "METHODS", "Family", "Method", "display_names", "explain", "methods_for"]


@dataclass(frozen=True)
class Family:
    """A model family :func:`explain` dispatches on: what it takes as ``inputs`` and ``target``."""

    name: str
    display: str
    inputs: str
    target: str


_IMAGES = "a B x 3 x H x W float image batch"
_CLASS = "a class index (one for all samples, or one per sample); None: each sample's predicted class"
_ANSWER = "an answer index (one, or one per question); None: each question's predicted answer"

#: family name (as :func:`vitlab.record.model_family` returns it) -> what it takes
FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("vit", "ViT", _IMAGES, _CLASS),
    Family("lxmert", "LXMERT", "the model's input dict (input_ids, attention_mask, visual_feats, visual_pos)", _ANSWER),
    Family("visualbert", "VisualBERT", "the model's input dict (input_ids, attention_mask, visual_embeds, ...)",
           _ANSWER),
    Family("vilt", "ViLT", "the model's input dict (input_ids, attention_mask, pixel_values, ...)", _ANSWER),
    Family("detr", "DETR", _IMAGES,
           "the object queries to explain (per image); None: every query detected above the threshold"),
    Family("clip", "CLIP", "the model's input dict of image-caption pairs (pixel_values, input_ids, attention_mask)",
           "none: each pair's own score is explained"),
    Family("swin", "Swin", _IMAGES, _CLASS),
)}

#: family -> method name -> implementing function ("module:function", imported on first use)
IMPLEMENTATIONS: dict[str, dict[str, str]] = {
    "vit": dict(
        raw_attention="vitlab.attention:raw_attention", cls_attention="vitlab.attention:cls_attention",
        rollout="vitlab.rollout:rollout", gradcam="vitlab.attention:attention_gradcam",
        grad_rollout="vitlab.rollout:grad_rollout", relevance="vitlab.relevance:chefer_relevance",
        last_block_relevance="vitlab.relevance:last_block_relevance", lrp="vitlab.lrp:lrp",
        partial_lrp="vitlab.lrp:partial_lrp", transformer_attribution="vitlab.lrp:transformer_attribution",
        attn_lrp="vitlab.lrp:attn_lrp", input_x_gradient="vitlab.gradients:input_x_gradient",
        integrated_gradients="vitlab.gradients:integrated_gradients",
        projection_map="vitlab.projection:projection_map"),
    "lxmert": dict(
        relevance="vitlab.relevance:lxmert_relevance", raw_attention="vitlab.relevance:lxmert_raw_attention",
        rollout="vitlab.relevance:lxmert_rollout", gradcam="vitlab.relevance:lxmert_gradcam",
        partial_lrp="vitlab.bimodal_lrp:lxmert_partial_lrp",
        transformer_attribution="vitlab.bimodal_lrp:lxmert_transformer_attribution"),
    "visualbert": dict(
        relevance="vitlab.relevance:visualbert_relevance", raw_attention="vitlab.relevance:visualbert_raw_attention",
        rollout="vitlab.relevance:visualbert_rollout", gradcam="vitlab.relevance:visualbert_gradcam",
        partial_lrp="vitlab.bimodal_lrp:visualbert_partial_lrp",
        transformer_attribution="vitlab.bimodal_lrp:visualbert_transformer_attribution"),
    "vilt": dict(
        relevance="vitlab.relevance:vilt_relevance", raw_attention="vitlab.relevance:vilt_raw_attention",
        rollout="vitlab.relevance:vilt_rollout", gradcam="vitlab.relevance:vilt_gradcam"),
    "detr": dict(
        relevance="vitlab.relevance:detr_relevance", raw_attention="vitlab.relevance:detr_raw_attention",
        rollout="vitlab.relevance:detr_rollout", gradcam="vitlab.relevance:detr_gradcam"),
    "clip": dict(
        relevance="vitlab.relevance:clip_relevance", raw_attention="vitlab.relevance:clip_raw_attention",
        rollout="vitlab.relevance:clip_rollout", gradcam="vitlab.relevance:clip_gradcam",
        grad_eclip="vitlab.grad_eclip:grad_eclip", legrad="vitlab.legrad:legrad"),
    "swin": dict(
        relevance="vitlab.hierarchical:swin_relevance", raw_attention="vitlab.hierarchical:swin_raw_attention",
        rollout="vitlab.hierarchical:swin_rollout", gradcam="vitlab.hierarchical:swin_gradcam"),
}


@dataclass(frozen=True)
class Method:
    """One explanation method: ``name`` (what :func:`explain` takes), ``display`` (the one label of
    tables and figures), ``needs_target`` (True: it explains one output score, chosen by
    ``target``; False: it reads the attention alone), ``paper`` (where it comes from) and
    ``implementations`` (family -> ``"module:function"``)."""

    name: str
    display: str
    needs_target: bool
    paper: str
    implementations: dict

    @property
    def families(self) -> tuple[str, ...]:
        """The families this method serves, in :data:`FAMILIES` order."""
        return tuple(f for f in FAMILIES if f in self.implementations)

    def function(self, family: str) -> Callable:
        """The implementation for ``family`` (a name of :data:`FAMILIES`)."""
        if family not in self.implementations:
            raise ValueError(_not_served(self.name, family))
        return _resolve(self.implementations[family])

    def takes_target(self, family: str) -> bool:
        """Whether the implementation for ``family`` takes a ``target``."""
        return "target" in _parameters(self.function(family))[1:3]

    def options(self, family: str) -> tuple[str, ...]:
        """The keyword options the implementation for ``family`` takes besides model, inputs, target."""
        return tuple(p for p in _parameters(self.function(family))[2:] if p != "target")

    def __call__(self, model, inputs, target=None, **options):
        return explain(self.name, model, inputs, target, **options)


# name, display name, needs a target (explains a score), where it comes from
_METHOD_INFO = (
    ("raw_attention", "raw attention", False, "the last block's CLS row (Chefer et al. 2021's baseline)"),
    ("cls_attention", "CLS attention", False, "the CLS row of every block and head (B x L x H x gh x gw)"),
    ("rollout", "rollout", False, "Abnar & Zuidema, ACL 2020"),
    ("gradcam", "GradCAM", True, "GradCAM on the last attention map (Chefer et al. 2021's baseline)"),
    ("grad_rollout", "gradient rollout", True, "Gildenblat 2020"),
    ("relevance", "Chefer relevance", True, "Chefer, Gur & Wolf, ICCV 2021 (generic attention relevance)"),
    ("last_block_relevance", "gradient x attention (last block)", True, "Chefer et al.'s rule on the last block"),
    ("lrp", "LRP", True, "Bach et al. 2015, with Chefer et al.'s (CVPR 2021) transformer rules"),
    ("partial_lrp", "partial LRP", True, "Voita et al., ACL 2019"),
    ("transformer_attribution", "Transformer attribution", True, "Chefer, Gur & Wolf, CVPR 2021"),
    ("attn_lrp", "AttnLRP", True, "Achtibat et al., ICML 2024"),
    ("input_x_gradient", "input x gradient", True, "Shrikumar et al. 2016"),
    ("integrated_gradients", "integrated gradients", True, "Sundararajan, Taly & Yan, ICML 2017"),
    ("projection_map", "class-embedding map", True, "the class embedding read through the head (chapter 07)"),
    ("grad_eclip", "Grad-ECLIP", True, "Zhao et al., ICML 2024"),
    ("legrad", "LeGrad", True, "Bousselham et al. 2024"),
)

#: method name -> :class:`Method`, in the order of :data:`_METHOD_INFO`
METHODS: dict[str, Method] = {
    name: Method(name, display, needs, paper,
                 {family: table[name] for family, table in IMPLEMENTATIONS.items() if name in table})
    for name, display, needs, paper in _METHOD_INFO
}


def display_names(*names: str) -> tuple[str, ...]:
    """The display names of the methods ``names`` (registry names), in that order."""
    return tuple(_method(n).display for n in names)


def methods_for(family: str) -> tuple[str, ...]:
    """The methods ``family`` serves, in registry order."""
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; families: {', '.join(FAMILIES)}")
    return tuple(n for n, m in METHODS.items() if family in m.implementations)


def explain(method: str, model, inputs, target=None, **options):
    """Run the explanation ``method`` (a name of :data:`METHODS`) on ``model``, whatever its family.

    Args:
        method: ``"relevance"``, ``"rollout"``, ``"gradcam"``, ... (``sorted(vitlab.methods.METHODS)``).
        model: a model :func:`vitlab.record` can record; its family picks the implementation.
        inputs: what the family takes (:data:`FAMILIES`): an image batch for a ViT or DETR, the
            model's input dict for LXMERT, VisualBERT, ViLT and CLIP.
        target: the score to explain (a class, an answer, DETR's queries); None: the model's own
            prediction (CLIP: each pair's score, the only one). A method that reads the attention
            alone (``needs_target`` False; DETR's baselines excepted, whose target picks the
            queries) takes none.
        **options: the implementation's own keywords (``Method.options(family)``), e.g.
            ``head_fusion`` and ``discard_ratio`` for a ViT's rollout, ``start_block`` for CLIP.

    Returns:
        what the family's implementation returns: ``B x gh x gw`` for a ViT, a ``BimodalMaps``
        for LXMERT / VisualBERT / ViLT, one ``DetectionMaps`` per image for DETR, a ``ClipMaps``.
    """
    from vitlab.record import model_family

    m = _method(method)
    family = model_family(model)
    fn = m.function(family)
    params = _parameters(fn)
    unknown = [k for k in options if k not in params[2:] or k == "target"]
    if unknown:
        allowed = ", ".join(m.options(family)) or "none"
        raise TypeError(f"{method} on a {FAMILIES[family].display} model takes the options {allowed}; "
                        f"got {', '.join(map(repr, unknown))}")
    if target is None:
        return fn(model, inputs, **options)
    if "target" not in params[1:3]:
        raise ValueError(f"{method} on a {FAMILIES[family].display} model takes no target: it reads the attention "
                         "alone, the same map for every class. Leave target=None, or use a method that explains a "
                         f"score ({', '.join(n for n in methods_for(family) if METHODS[n].needs_target)})")
    return fn(model, inputs, target, **options)


def _method(name) -> Method:
    if isinstance(name, str) and name in METHODS:
        return METHODS[name]
    hint = ""
    if isinstance(name, str):
        for m in METHODS.values():
            functions = {spec.split(":")[1] for spec in m.implementations.values()}
            if name in functions or name.lower() == m.display.lower():
                hint = f" ({name!r} is {m.name!r})"
                break
    raise ValueError(f"unknown method {name!r}{hint}; methods: {', '.join(METHODS)}")


def _not_served(method: str, family: str) -> str:
    served = methods_for(family)
    return (f"{method} is not defined for {FAMILIES[family].display} models; a {FAMILIES[family].display} "
            f"model serves: {', '.join(served)}")


@functools.lru_cache(maxsize=None)
def _resolve(spec: str) -> Callable:
    module, name = spec.split(":")
    return getattr(importlib.import_module(module), name)


def _parameters(fn: Callable) -> list[str]:
    """The names of ``fn``'s parameters (through decorators that keep ``__wrapped__``)."""
    return list(inspect.signature(fn).parameters)
