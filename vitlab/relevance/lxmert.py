"""Relevance and the paper's baselines for Hugging Face LXMERT (co-attention; chapter 9), and every
method's maps of many questions graded against the scenes' objects (:func:`grade_lxmert`)."""
from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import NamedTuple

import numpy as np
import torch

from vitlab.inputs import batches, check_batch_values, check_images
from vitlab.relevance.bimodal import (
    BIMODAL_METHODS, BimodalMaps, _attention_grads, _backbone_prefix, _checked_methods, _events, _recorded_forward,
    _rollout, _sizes, attention_matrix_gradcam, last_capture, require_family,
)
from vitlab.relevance.engine import propagate


# --- LXMERT and DETR end to end (Chefer, Gur & Wolf 2021, section 3 and 4) ------------------------
#
# One recorded forward (vitlab.record, graph-attached attention) and one call of
# torch.autograd.grad with respect to the attention tensors only -- no parameter's .grad is
# touched, no weight gradient is computed, and the backward stops at the earliest attention
# it needs. The events then go through propagate().
#
# LXMERT (rec.modalities "lang", "vision"; CLS = text token 0). Event order, as LXMERT
# computes: each language layer (self "lang"), each relational layer (self "vision"), then per
# cross-modality layer the step (lang <- vision, vision <- lang) -- one module called twice on
# the same inputs, so one simultaneous step, as in the reference code, which computes both
# additions before adding either -- and after it the layer's self-attention of the text
# (cross.lang) and of the image (cross.vision). LxmertXLayer runs its two self-attentions on
# the co-attention outputs, and the reference applies them after the co-attention step, in the
# same order; the two commute (each reads and writes only its own modality's rows). The
# language and relational layers commute likewise.
#
# DETR (modalities "image": the flattened feature map, "queries": the object queries):
# each encoder layer (self "image"), then per decoder layer its self-attention (self
# "queries") and its cross-attention (queries <- image), the reference's order.

#: What ``lxmert_relevance`` and its baselines accept in ``inputs`` (those the model's
#: ``forward`` takes): the tokenised question and the region features with their boxes, or
#: ``pixel_values`` for a model that computes its regions itself (vitlab's ``shapes-lxmert``).
LXMERT_INPUTS = ("input_ids", "attention_mask", "token_type_ids", "visual_feats", "visual_pos",
                 "visual_attention_mask", "pixel_values")


def checked_lxmert_inputs(model, inputs, method: str) -> tuple[dict, int]:
    """``inputs`` as a dict of tensors the model's forward takes, and the batch size.

    Everything the forward would otherwise fail on deep inside (or compute NaN from) is named
    here, before it runs: the keys, one batch size, an empty batch, token ids outside the
    vocabulary or longer than the model's positions, masks of another shape, region features
    of another width or count than the boxes and the model's ``visual_feat_dim``, and NaN or
    infinite pixels / features / boxes (:func:`vitlab.inputs.check_batch_values`).
    """
    if not isinstance(inputs, Mapping):
        raise TypeError(f"{method}: inputs must be a dict of tensors (keys among {LXMERT_INPUTS}), "
                        f"got {type(inputs).__name__}")
    accepted = set(inspect.signature(model.forward).parameters)
    allowed = [k for k in LXMERT_INPUTS if k in accepted]
    unknown = [k for k in inputs if k not in allowed]
    if unknown:
        raise ValueError(f"{method}: unexpected input key{'s' if len(unknown) > 1 else ''} "
                         f"{', '.join(map(repr, unknown))}; {type(model).__name__} takes {tuple(allowed)}")
    has_regions = "visual_feats" in inputs and "visual_pos" in inputs
    if "input_ids" not in inputs or not (has_regions or "pixel_values" in inputs):
        images = "'visual_feats' and 'visual_pos'" + (" (or 'pixel_values')" if "pixel_values" in allowed else "")
        raise ValueError(f"{method}: inputs need 'input_ids' (the tokenised question) and {images}; "
                         f"got keys {tuple(inputs)}")
    batch = None
    for key, value in inputs.items():
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{method}: inputs[{key!r}] must be a tensor, got {type(value).__name__}")
        if value.ndim == 0:
            raise ValueError(f"{method}: inputs[{key!r}] is a scalar; every input is a batch (samples first)")
        if batch is not None and value.shape[0] != batch:
            raise ValueError(f"{method}: inputs[{key!r}] has shape {tuple(value.shape)}; every input needs "
                             f"the batch size {batch} first")
        batch = value.shape[0]
    if batch == 0:
        raise ValueError(f"{method} got an empty batch (B = 0, inputs['input_ids'] of shape "
                         f"{tuple(inputs['input_ids'].shape)}); pass at least one question")
    _check_tokens(model.config, inputs, method)
    if "pixel_values" in inputs:
        check_images(inputs["pixel_values"], method)
    else:
        _check_regions(model.config, inputs, method)
    return dict(inputs), int(batch)


def _check_tokens(config, inputs, method: str) -> None:
    """input_ids in the vocabulary and within the positions; masks of their shape, CLS kept."""
    ids = inputs["input_ids"]
    if ids.ndim != 2 or ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise ValueError(f"{method}: inputs['input_ids'] must be B x L integer token ids, got shape "
                         f"{tuple(ids.shape)} and dtype {ids.dtype}; encode the questions with the model's tokenizer")
    L = ids.shape[1]
    if L == 0:
        raise ValueError(f"{method}: inputs['input_ids'] holds no token (shape {tuple(ids.shape)}); a question is "
                         "at least [CLS] and [SEP]")
    longest = getattr(config, "max_position_embeddings", None)
    if isinstance(longest, int) and L > longest:
        mask = inputs.get("attention_mask")
        lengths = (mask != 0).sum(1) if mask is not None else torch.full((ids.shape[0],), L)
        if bool((lengths > longest).any()):
            b = int((lengths > longest).nonzero()[0])
            what = f"question {b} is {int(lengths[b])} tokens long ([CLS] and [SEP] included)"
        else:
            what = f"the questions are padded to {L} tokens"
        raise ValueError(f"{method}: {what}, but the model reads at most {longest} tokens "
                         "(config.max_position_embeddings); ask shorter questions (pad to the longest only)")
    vocab = int(config.vocab_size)
    bad = (ids < 0) | (ids >= vocab)
    if bool(bad.any()):
        b, pos = (int(i) for i in bad.nonzero()[0])
        raise ValueError(f"{method}: inputs['input_ids'] holds token id {int(ids[b, pos])} (sample {b}, position "
                         f"{pos}), outside the model's vocabulary 0 .. {vocab - 1}; encode the questions with the "
                         "model's own tokenizer")
    for key in ("attention_mask", "token_type_ids"):
        if key in inputs and tuple(inputs[key].shape) != tuple(ids.shape):
            raise ValueError(f"{method}: inputs[{key!r}] has shape {tuple(inputs[key].shape)}, but input_ids has "
                             f"{tuple(ids.shape)}: one entry per token")
    if "token_type_ids" in inputs:
        types = inputs["token_type_ids"]
        n_types = int(getattr(config, "type_vocab_size", 2))
        if types.is_floating_point() or bool(((types < 0) | (types >= n_types)).any()):
            raise ValueError(f"{method}: inputs['token_type_ids'] must be integers in 0 .. {n_types - 1}")
    if "attention_mask" in inputs:
        mask = inputs["attention_mask"]
        if not bool(((mask == 0) | (mask == 1)).all()):
            raise ValueError(f"{method}: inputs['attention_mask'] must hold 1 (a token) or 0 (padding)")
        if not bool((mask[:, 0] == 1).all()):
            b = int((mask[:, 0] != 1).nonzero()[0])
            raise ValueError(f"{method}: inputs['attention_mask'] masks the first token of sample {b}, but the "
                             "first token is [CLS], from which LXMERT reads its answer; padding goes after the words")


def _check_regions(config, inputs, method: str) -> None:
    """Region features and boxes: finite floats B x N x visual_feat_dim and B x N x visual_pos_dim."""
    feats, pos = inputs["visual_feats"], inputs["visual_pos"]
    for key, t, width, what in (("visual_feats", feats, getattr(config, "visual_feat_dim", None), "visual_feat_dim"),
                                ("visual_pos", pos, getattr(config, "visual_pos_dim", None), "visual_pos_dim")):
        if t.ndim != 3 or (isinstance(width, int) and t.shape[-1] != width):
            raise ValueError(f"{method}: inputs[{key!r}] must be B x regions x {width} (the model's {what}), "
                             f"got shape {tuple(t.shape)}")
        check_batch_values(t, method, f"inputs[{key!r}]", unit="question")
    if feats.shape[1] != pos.shape[1] or feats.shape[1] == 0:
        raise ValueError(f"{method}: inputs['visual_feats'] has {feats.shape[1]} regions and inputs['visual_pos'] "
                         f"{pos.shape[1]}: give one box per region feature, at least one region")
    vmask = inputs.get("visual_attention_mask")
    if vmask is not None:
        if tuple(vmask.shape) != tuple(feats.shape[:2]):
            raise ValueError(f"{method}: inputs['visual_attention_mask'] has shape {tuple(vmask.shape)}; it needs "
                             f"one entry per region, {tuple(feats.shape[:2])}")
        if not bool(((vmask == 0) | (vmask == 1)).all()):
            raise ValueError(f"{method}: inputs['visual_attention_mask'] must hold 1 (a region) or 0 (masked out)")


def real_tokens(kwargs: dict, text_tokens: int, image_tokens: int, like: torch.Tensor):
    """``(text B x Nt, image B x Ni)``: 1 for a real token, 0 for padding / a masked region
    (``attention_mask`` / ``visual_attention_mask``; all 1 where none was given), in ``like``'s
    dtype and device."""
    B = like.shape[0]
    out = []
    for key, n in (("attention_mask", text_tokens), ("visual_attention_mask", image_tokens)):
        m = kwargs.get(key)
        if m is None:
            out.append(torch.ones(B, n, dtype=like.dtype, device=like.device))
        elif tuple(m.shape) != (B, n):
            raise ValueError(f"inputs[{key!r}] has shape {tuple(m.shape)}, but the model has {B} x {n} such tokens")
        else:
            out.append(m.to(dtype=like.dtype, device=like.device))
    return tuple(out)


# --- LXMERT ----------------------------------------------------------------------------------------
def _lxmert_forward(model, inputs, method: str, grad: bool, backbone: bool = False):
    """Checks, then one recorded forward: ``(rec, logits, kwargs)`` (the checked inputs)."""
    require_family(model, "lxmert", method)
    kwargs, _ = checked_lxmert_inputs(model, inputs, method)
    if backbone and "pixel_values" not in kwargs:
        raise ValueError(f"{method}(backbone=True) needs the images as inputs['pixel_values'] (the backbone "
                         "runs inside the model); with region features there is no backbone to go through")
    rec, out = _recorded_forward(model, kwargs, grad, method, through_pixels=backbone)
    logits = getattr(out, "question_answering_score", None)
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"{method} explains an answer score, but {type(model).__name__} returned no "
                        "question_answering_score: use LxmertForQuestionAnswering")
    return rec, logits, kwargs


def lxmert_relevance(model, inputs: dict, target=None, backbone: bool = False, *, eq11: bool = True,
                     simultaneous: bool = True, self_in_eq10: bool = True) -> BimodalMaps:
    """Generic attention relevance of LXMERT's answer (Chefer, Gur & Wolf 2021, eq. 1-11).

    Image relevance ``R^{ti}[CLS]`` and text relevance ``R^{tt}[CLS]`` (its CLS entry set to
    0, as the reference code does), CLS being the first text token, for the answer
    ``target``'s logit. One recorded forward and one backward for the whole batch (to the
    attention tensors only), then :func:`propagate` over the events in LXMERT's order: each
    language layer, each relational (image) layer, then per cross-modality layer the
    co-attention step ``(text <- image, image <- text)`` -- simultaneous, both computed from
    the same inputs -- followed by that layer's text and image self-attention (see the
    comment above :data:`LXMERT_INPUTS`). Samples do not interact: batch = items.

    Args:
        model: ``LxmertForQuestionAnswering`` (or a subclass such as vitlab's
            ``shapes-lxmert``), run in eval mode; left exactly as it was.
        inputs: the model's keyword inputs (:data:`LXMERT_INPUTS`): ``input_ids`` (and usually
            ``attention_mask``) of the questions plus ``visual_feats`` and ``visual_pos`` (region
            features and boxes), or ``pixel_values`` for ``shapes-lxmert``.
        target: the answer to explain: an int, one per sample, or None (the predicted answer).
        backbone: also carry relevance through the self-attention of a ViT backbone inside the
            model (``shapes-lxmert``; needs ``pixel_values``): its blocks are earlier
            self-attention layers of the image modality, whose tokens are the ViT's tokens
            (prefix tokens included, region k = patch k); ``image`` is then read on the patches.
        eq11: an ablation, as are ``simultaneous`` and ``self_in_eq10`` (keyword-only; the
            defaults are the paper's method, False leaves one rule out to show what it does).
            False drops eq. 11 from every co-attention event: ``R^{tt}`` no longer gains
            ``Abar^{ti} · R^{it}`` (nor ``R^{ii}`` gains ``Abar^{it} · R^{ti}``), so the text
            tokens' self-relevance never takes in what the image tokens they attend to had
            gathered from the text; eq. 10's ``R^{ti}`` / ``R^{it}`` updates stay. With
            simultaneous steps it acts from the second cross-modality layer on (``R^{it}`` and
            ``R^{ti}`` are 0 before the first one).
        simultaneous: False applies the two co-attention directions of a cross-modality layer
            one after the other, text <- image first (eq. 10-11 into ``R^{ti}``, ``R^{tt}``),
            then image <- text reading the matrices that first direction just updated, where
            LXMERT (and the reference code) compute both from the layer's inputs. It changes
            ``R^{ii}`` / ``R^{it}`` of a layer, so the answer's maps from the next
            cross-modality layer on.
        self_in_eq10: False replaces eq. 10 by ``R^{sq} += Abar`` (the reference code's
            ``apply_self_in_rule_10=False`` ablation): the normalised self-relevances
            ``Rbar^{ss}``, ``Rbar^{qq}`` of eq. 8-9 become the identity, so the cross-attention
            is added without the contextualisation of either modality's self-attention.

    Returns:
        :class:`BimodalMaps` (``image`` ``B x regions``, ``text`` ``B x tokens``).
    """
    method = "lxmert_relevance"
    require_family(model, "lxmert", method)
    for name, value in (("eq11", eq11), ("simultaneous", simultaneous), ("self_in_eq10", self_in_eq10)):
        if not isinstance(value, bool):
            raise TypeError(f"{method}: {name} must be True or False, got {value!r}")
    batch = checked_lxmert_inputs(model, inputs, method)[1]
    from vitlab.targets import check_target, resolve_target

    target = check_target(target, batch)
    rec, logits, _ = _lxmert_forward(model, inputs, method, grad=True, backbone=backbone)
    t = resolve_target(target, logits)
    captures = [c for c in rec.events if backbone or c.stream != "backbone"]
    image_tokens = last_capture(rec, "lang->vision", method).attention.shape[-1]
    prefix = _backbone_prefix(rec, image_tokens, method) if backbone else 0
    grad_output = torch.zeros_like(logits)
    grad_output[torch.arange(batch, device=logits.device), t] = 1  # the score: sum over samples of each one's target logit
    grads = _attention_grads(logits, grad_output, captures, batched=False, method=method)
    steps = _events(captures, grads, "vision", prefix)
    if not simultaneous:  # each (text <- image, image <- text) step as two steps, in that order
        steps = [e for step in steps for e in (step if isinstance(step, tuple) else (step,))]
    R = propagate(steps, _sizes(steps), eq11=eq11, self_in_eq10=self_in_eq10)
    image = R.rows("lang", "vision", 0)[..., prefix:]
    text = R.rows("lang", "lang", 0, drop_self=True)
    return BimodalMaps(image, text, t, logits.detach())


def lxmert_raw_attention(model, inputs: dict) -> BimodalMaps:
    """Raw attention baseline (Chefer et al. 2021): the last cross-modality layer, heads averaged.

    ``image`` = row CLS of its text -> image co-attention; ``text`` = row CLS of its text
    self-attention, CLS entry set to 0 (the reference's ``generate_raw_attn``). One forward
    without gradients; ``target`` is the predicted answer.
    """
    method = "lxmert_raw_attention"
    rec, logits, _ = _lxmert_forward(model, inputs, method, grad=False)
    image = last_capture(rec, "lang->vision", method).attention.mean(dim=1)[:, 0]  # B x regions
    text = last_capture(rec, "cross.lang", method).attention.mean(dim=1)[:, 0].clone()  # B x tokens
    text[:, 0] = 0
    return BimodalMaps(image, text, logits.argmax(-1), logits)


def lxmert_rollout(model, inputs: dict) -> BimodalMaps:
    """Attention rollout baseline for LXMERT, as the reference's ``generate_rollout`` computes it.

    Heads averaged everywhere; rollout(a_1..a_L) = ``rownorm(a_L + I) ... rownorm(a_1 + I)``.
    With ``T`` = rollout of the text self-attention of the language layers and of every
    cross-modality layer but the last, ``V`` = the same for the image (relational layers and
    the image self-attention of every cross-modality layer but the last), and ``C`` = the last
    cross-modality layer's text -> image co-attention: ``image = (T^T · C · V)[CLS]``;
    ``text`` = row CLS of the rollout of all text self-attention layers (the last layer's
    included), CLS entry set to 0. The other co-attention layers do not enter. One forward
    without gradients; ``target`` is the predicted answer.

    Padding: a ``[PAD]`` token (``attention_mask`` 0) or a masked region
    (``visual_attention_mask`` 0) is not a token of the question or image -- the model
    attends to none of them -- so its rows and columns are left out of every ``a`` (its row
    of ``rownorm(a + I)`` is the identity's): a padded question gets the map of the same
    question alone (the reference explains one unpadded question at a time), 0 on the padding.
    """
    method = "lxmert_rollout"
    rec, logits, kwargs = _lxmert_forward(model, inputs, method, grad=False)
    co = last_capture(rec, "lang->vision", method)
    last_layer = co.layer
    text, image = real_tokens(kwargs, *co.attention.shape[-2:], co.attention)

    def cam(c, rows, cols):  # head-averaged, padding's rows and columns zeroed
        return c.attention.mean(dim=1) * rows[:, :, None] * cols[:, None, :]

    text_cams = [cam(c, text, text) for c in rec.stream("lang")]
    text_cams += [cam(c, text, text) for c in rec.stream("cross.lang") if c.layer < last_layer]
    image_cams = [cam(c, image, image) for c in rec.stream("vision")]
    image_cams += [cam(c, image, image) for c in rec.stream("cross.vision") if c.layer < last_layer]
    C = cam(co, text, image)  # B x Nt x Ni
    T = _rollout(text_cams, C.shape[-2], C)
    V = _rollout(image_cams, C.shape[-1], C)
    image_map = (T.mT @ C @ V)[:, 0]
    text_all = _rollout(text_cams + [cam(last_capture(rec, "cross.lang", method), text, text)], C.shape[-2], C)
    text_map = text_all[:, 0].clone()
    text_map[:, 0] = 0
    return BimodalMaps(image_map, text_map, logits.argmax(-1), logits)


def lxmert_gradcam(model, inputs: dict, target=None) -> BimodalMaps:
    """GradCAM baseline on the last cross-modality layer (the reference's ``generate_attn_gradcam``).

    ``image`` = row CLS of :func:`attention_matrix_gradcam` of its text -> image co-attention;
    ``text`` = row CLS of the same for its text self-attention, CLS entry set to 0; gradients
    of the ``target`` answer's logit (None: predicted). One forward, one backward (to these
    two attention maps only).

    Padding: each head's weight is the gradient's mean over the entries between real tokens
    only (``[PAD]`` tokens and masked regions are no entries of the question alone, which is
    what the reference explains), so padding never rescales the map.
    """
    method = "lxmert_gradcam"
    require_family(model, "lxmert", method)
    from vitlab.targets import check_target, resolve_target

    target = check_target(target, checked_lxmert_inputs(model, inputs, method)[1])
    rec, logits, kwargs = _lxmert_forward(model, inputs, method, grad=True)
    t = resolve_target(target, logits)
    co, lang = last_capture(rec, "lang->vision", method), last_capture(rec, "cross.lang", method)
    real_text, real_image = real_tokens(kwargs, *co.attention.shape[-2:], co.attention)
    grad_output = torch.zeros_like(logits)
    grad_output[torch.arange(logits.shape[0], device=logits.device), t] = 1
    g_co, g_lang = _attention_grads(logits, grad_output, [co, lang], batched=False, method=method)
    zero = torch.zeros_like
    entries = (real_text[:, None, :, None] * real_image[:, None, None, :],  # B x 1 x Nt x Ni
               real_text[:, None, :, None] * real_text[:, None, None, :])  # B x 1 x Nt x Nt
    image = attention_matrix_gradcam(co.attention.detach(), zero(co.attention) if g_co is None else g_co,
                                     entries[0])[:, 0]
    text = attention_matrix_gradcam(lang.attention.detach(), zero(lang.attention) if g_lang is None else g_lang,
                                    entries[1])[:, 0]
    text = text.clone()
    text[:, 0] = 0
    return BimodalMaps(image, text, t, logits.detach())


# ---------------------------------------------------------------------------------------------
# Chapter 9: every method's maps of many questions, graded against the scenes' objects
# ---------------------------------------------------------------------------------------------


def _lxmert_methods() -> dict:
    return {
        "relevance": lxmert_relevance,
        "relevance + backbone": lambda m, inputs: lxmert_relevance(m, inputs, backbone=True),
        "raw attention": lxmert_raw_attention,
        "rollout": lxmert_rollout,
        "GradCAM": lxmert_gradcam,
    }


def named_word_positions(tokenizer, questions) -> np.ndarray:
    """Position of the named class word in each tokenised question (``[CLS]`` = 0), -1 where
    the question names no class (``which``). ``questions``: :class:`vitlab.shapes.qa.Questions`."""
    from vitlab.shapes.data import CLASSES

    pos = np.full(len(questions), -1, dtype=np.int64)
    for i, (text, named) in enumerate(zip(questions.text, questions.named)):
        if named >= 0:
            tokens = tokenizer.tokenize(text)
            pos[i] = tokens.index(CLASSES[int(named)])
    return pos


def encoded_questions(model, scenes: int, questions, method: str):
    """``(input_ids, attention_mask, scene)`` of ``questions`` for ``shapes-lxmert``, checked
    before any forward: every question within the model's positions (its tokens within its
    vocabulary) and every ``questions.scene`` an index into the ``scenes`` scenes."""
    ids, mask = model.encode(list(questions.text))
    _check_tokens(model.config, {"input_ids": ids, "attention_mask": mask}, method)
    scene = torch.as_tensor(np.asarray(questions.scene), dtype=torch.long)
    if scene.shape != (len(questions),):
        raise ValueError(f"{method}: questions.scene must hold one scene index per question, got shape "
                         f"{tuple(scene.shape)} for {len(questions)} questions")
    if len(scene) and (scene.min() < 0 or scene.max() >= scenes):
        raise ValueError(f"{method}: questions.scene holds scene {int(scene.max() if scene.max() >= scenes else scene.min())}, "
                         f"but there are {scenes} scenes (0 .. {scenes - 1}); ask questions about the scenes given")
    return ids, mask, scene


def lxmert_scene_features(model, x: torch.Tensor, batch_size: int = 100) -> tuple[torch.Tensor, torch.Tensor]:
    """``shapes-lxmert``'s visual inputs for every scene, once: ``(feats S x N x C, boxes S x N x 4)``
    (the frozen ViT's tokens and their grid boxes). The functions below that take ``features=``
    accept them, so that several calls on the same scenes run the ViT once."""
    from vitlab.record import eval_mode

    check_images(x, "lxmert_scene_features")
    feats, pos = [], []
    with torch.no_grad(), eval_mode(model):
        for s in batches(x.shape[0], batch_size):
            f, p = model.visual_inputs(x[s])
            feats.append(f)
            pos.append(p)
    return torch.cat(feats), torch.cat(pos)


def lxmert_method_maps(model, x: torch.Tensor, questions, methods=BIMODAL_METHODS,
                       batch_size: int = 100, features=None) -> dict:
    """Image and text maps of every method for every question about the scenes ``x``.

    ``model``: ``shapes-lxmert``; ``x``: ``S x 3 x H x W`` preprocessed scenes; ``questions``:
    :class:`vitlab.shapes.qa.Questions` about them (``questions.scene`` indexes ``x``). Each
    method explains the model's own answer. Returns method -> :class:`vitlab.relevance.BimodalMaps`
    over all questions (``image``: ``Q x gh x gw`` on the backbone's patch grid, ``text``:
    ``Q x L``, the questions padded to one length ``L``, 0 on the padding). One forward (and
    one backward) per batch and method. Padding changes no map: every method gives each
    question the map it gives that question asked alone (the methods leave ``[PAD]`` tokens
    out, see :func:`vitlab.relevance.lxmert_rollout`).
    """
    methods = _checked_methods(methods)
    table = _lxmert_methods()
    ids, mask, scene = encoded_questions(model, x.shape[0], questions, "lxmert_method_maps")
    grid = tuple(int(g) for g in model.backbone.patch_embed.grid_size)
    feats, pos = lxmert_scene_features(model, x, batch_size) if features is None else features
    out = {}
    for name in methods:
        parts = []
        for s in batches(len(questions), batch_size):
            if name == "relevance + backbone":  # relevance through the ViT: the pixels go in
                images = dict(pixel_values=x[scene[s]])
            else:  # the frozen ViT's tokens, computed once per scene, are the same input
                images = dict(visual_feats=feats[scene[s]], visual_pos=pos[scene[s]])
            parts.append(table[name](model, dict(input_ids=ids[s], attention_mask=mask[s], **images)))
        image = torch.cat([p.image for p in parts]).reshape(len(questions), *grid)
        out[name] = BimodalMaps(image, torch.cat([p.text for p in parts]),
                                torch.cat([p.target for p in parts]), torch.cat([p.logits for p in parts]))
    return out


class QuestionGrades(NamedTuple):
    """Where each method's maps point, per question (from :func:`grade_lxmert`).

    Attributes:
        methods: the method names, in row order.
        correct: ``Q`` bool, the model answered the question right.
        has_target: ``Q`` bool, the answer is about one object (not ``is there a ...? no``).
        on_target: ``M x Q`` bool, the top image patch lies on that object (pointing game).
        on_other: ``M x Q`` bool, it lies on the scene's other object.
        chance: ``Q``, the hit rate of a random top patch on the target object.
        named_position: ``Q``, the named class word's token position (-1: none named).
        named_top: ``M x Q`` bool, the named word is the most relevant text token (False
            where none is named).
        maps: method -> :class:`vitlab.relevance.BimodalMaps` (as :func:`lxmert_method_maps`).
    """

    methods: tuple
    correct: np.ndarray
    has_target: np.ndarray
    on_target: np.ndarray
    on_other: np.ndarray
    chance: np.ndarray
    named_position: np.ndarray
    named_top: np.ndarray
    maps: dict


def _grade_question_maps(model, maps: dict, masks, questions, min_coverage: float, text_valid) -> QuestionGrades:
    """Pointing (image maps) and the named word (text maps) of every method's maps, per question."""
    from vitlab.localization import chance_pointing, pointing_game

    from vitlab.localization import top_token_is

    methods = tuple(maps)
    scene = torch.as_tensor(np.asarray(questions.scene), dtype=torch.long)
    target = torch.as_tensor(np.asarray(questions.target), dtype=torch.long)
    has_target = target >= 0
    t = target.clamp(min=0)
    m_target, m_other = masks[scene, t], masks[scene, 1 - t]
    grid = tuple(next(iter(maps.values())).image.shape[1:])
    pos = named_word_positions(model.tokenizer, questions)
    on_target, on_other, named_top = [], [], []
    for name in methods:
        image = maps[name].image
        on_target.append((pointing_game(image, m_target, min_coverage) & has_target).numpy())
        on_other.append((pointing_game(image, m_other, min_coverage) & has_target).numpy())
        named_top.append(top_token_is(maps[name].text, pos, valid=text_valid))
    correct = (maps[methods[0]].logits.argmax(-1) == torch.as_tensor(questions.answer_id)).numpy()
    return QuestionGrades(methods, correct, has_target.numpy(), np.stack(on_target), np.stack(on_other),
                          chance_pointing(m_target, grid, min_coverage).numpy(), pos, np.stack(named_top), maps)


def grade_lxmert(model, x: torch.Tensor, masks, questions, methods=BIMODAL_METHODS, batch_size: int = 100,
                 min_coverage: float = 0.5, features=None) -> QuestionGrades:
    """Grade every method's LXMERT maps against the objects of two-object scenes.

    ``masks``: ``S x 2 x H x W`` (the two objects of each scene in ``x``); the target object
    of question q is ``questions.target[q]`` (-1: none, e.g. "is there a star? no"), the other
    object is the scene's other one. The top patch lies "on" an object when it covers at least
    ``min_coverage`` of the patch (:func:`pointing_game`). Text: is the named class word the
    highest of the text map (``[CLS]`` is 0 there, padding never counts)? ``features``: the
    scenes' visual inputs from :func:`lxmert_scene_features`, if already computed.
    """
    from vitlab.localization import as_cpu_tensor

    masks = as_cpu_tensor(masks)
    if masks.ndim != 4 or masks.shape[:2] != (x.shape[0], 2):
        raise ValueError(f"masks must be S x 2 x H x W for the {x.shape[0]} scenes of x, got {tuple(masks.shape)}")
    maps = lxmert_method_maps(model, x, questions, methods, batch_size, features)
    _, attn_mask = model.encode(list(questions.text))
    return _grade_question_maps(model, maps, masks, questions, min_coverage, attn_mask == 1)


#: The variants of :func:`lxmert_relevance_variants`: name -> ``lxmert_relevance`` keywords.
LXMERT_ABLATIONS: dict = {
    "relevance": {},
    "without eq. 11": {"eq11": False},
    "sequential co-attention": {"simultaneous": False},
    "without self-relevance in eq. 10": {"self_in_eq10": False},
}


def lxmert_relevance_variants(model, x: torch.Tensor, questions, variants=None, batch_size: int = 100,
                              features=None) -> dict:
    """``lxmert_relevance`` of every question with each rule left out: variant -> BimodalMaps.

    ``variants``: name -> keyword arguments of :func:`vitlab.relevance.lxmert_relevance`
    (default :data:`LXMERT_ABLATIONS`). As :func:`lxmert_method_maps` otherwise (image maps
    ``Q x gh x gw``); each variant explains the model's own answer.
    """
    variants = dict(LXMERT_ABLATIONS if variants is None else variants)
    if not variants:
        raise ValueError("variants must name at least one set of lxmert_relevance keywords")
    ids, mask, scene = encoded_questions(model, x.shape[0], questions, "lxmert_relevance_variants")
    grid = tuple(int(g) for g in model.backbone.patch_embed.grid_size)
    feats, pos = lxmert_scene_features(model, x, batch_size) if features is None else features
    out = {}
    for name, kwargs in variants.items():
        parts = [lxmert_relevance(model, dict(input_ids=ids[s], attention_mask=mask[s], visual_feats=feats[scene[s]],
                                              visual_pos=pos[scene[s]]), **kwargs)
                 for s in batches(len(questions), batch_size)]
        out[name] = BimodalMaps(torch.cat([p.image for p in parts]).reshape(len(questions), *grid),
                                torch.cat([p.text for p in parts]), torch.cat([p.target for p in parts]),
                                torch.cat([p.logits for p in parts]))
    return out
