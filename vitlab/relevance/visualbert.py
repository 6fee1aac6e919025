"""Relevance and the paper's baselines for the single-stream models: Hugging Face VisualBERT and ViLT.

Chefer, Gur & Wolf (ICCV 2021), section 3, "pure self-attention" (their VisualBERT case): text
and image tokens form one sequence ``x`` and every layer is self-attention over all of it, so
the relevance is the ViT rule over the joint sequence -- eq. 1 ``R = I`` (one modality,
``"text+image"``), then per layer eq. 5 ``Abar = E_h[(grad_A ⊙ A)^+]`` and eq. 6
``R += Abar · R`` (:func:`vitlab.relevance.engine.propagate` over
:func:`~vitlab.relevance.engine.self_attention_events`). The explanation is the row of ``R`` of
the token the answer head reads; its entries on the text tokens are the text map (that token's
own entry set to 0, as the reference code does) and those on the image tokens the image map.

Which row. The reference code (hila-chefer/Transformer-MM-Explainability,
``VisualBERT/mmf/models/transformers/backends/ExplanationGenerator.py``, every ``generate_*``)
reads row ``input_mask.sum(1) - 2``, the last question token before ``[SEP]``: VisualBERT's VQA
head (the original code, and Hugging Face's ``VisualBertForQuestionAnswering``) classifies that
token's output, not ``[CLS]``'s. ViLT's head reads the pooled ``[CLS]`` (text token 0), so its
row is 0 (:func:`answer_rows`).

Baselines, as the reference's ``SelfAttentionGenerator``: raw attention (last layer, heads
averaged), rollout (every layer, heads averaged, ``A + I`` multiplied from the first layer; the
reference does not renormalise the rows of ``A + I``, which only scales the product by ``2^L``:
the same ranking as the rollout here, which renormalises, as for LXMERT) and GradCAM on the last
layer's attention (:func:`vitlab.relevance.attention_matrix_gradcam`; the reference then
min-max-normalises the map, which changes no ranking and is left out, as for LXMERT). Every
method reads the same row and sets the same entry to 0.

Token layout (:mod:`vitlab.record.visualbert`): text first, then image. VisualBERT's image map
is ``B x regions`` in ``visual_embeds`` order. ViLT reads pixels: ``ViltEmbeddings.visual_embed``
turns them into an image ``[CLS]`` token and patch tokens *in a random order* (it draws them with
``torch.multinomial``, also at evaluation), so the ViLT methods call ``visual_embed`` themselves
(inside the recording, with the random generator forked so the caller's stream of random
numbers is left as it was), keep its ``patch_index`` and give the model the tokens as
``image_embeds`` -- the same computation as ``model(pixel_values=...)`` -- and return the image
map on the patch grid, ``B x gh x gw`` (the image ``[CLS]`` token left out; patches of padding,
``pixel_mask`` 0, are 0).

Padding never changes a map: padded text tokens and padded regions / patches are masked keys
(attention exactly 0), so no relevance reaches them (their entries are 0) and none passes through
them. Every method runs one recorded forward (and, with gradients, one ``torch.autograd.grad`` to
the attention tensors only) for the whole batch.
"""
from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

from vitlab.inputs import batches, graph_inputs, require_gradients
from vitlab.relevance.bimodal import (
    BimodalMaps, _attention_grads, _recorded_forward, _rollout, attention_matrix_gradcam,
)
from vitlab.methods import display_names
from vitlab.relevance.engine import propagate, read_rows, self_attention_events
from vitlab.relevance.lxmert import QuestionGrades, _grade_question_maps, encoded_questions, lxmert_scene_features

__all__ = [
    "VILT_INPUTS", "VISUALBERT_INPUTS", "answer_rows", "vilt_gradcam", "vilt_raw_attention", "vilt_relevance",
    "vilt_rollout", "visualbert_gradcam", "visualbert_raw_attention", "visualbert_relevance", "visualbert_rollout",
    "VISUALBERT_METHODS", "grade_visualbert", "visualbert_method_maps",
]

#: What the VisualBERT methods accept in ``inputs``: the tokenised questions (``attention_mask``
#: required: the answer row depends on it) and the image as ``visual_embeds`` (region features,
#: e.g. a detector's), or, for vitlab's ``shapes-visualbert``, ``pixel_values`` / ``visual_feats``.
VISUALBERT_INPUTS = ("input_ids", "attention_mask", "token_type_ids", "visual_embeds", "visual_attention_mask",
                     "visual_token_type_ids", "pixel_values", "visual_feats")
#: What the ViLT methods accept in ``inputs``: the tokenised questions and the normalised images
#: (``pixel_mask``: 1 on the image, 0 on padding, as ``ViltProcessor`` gives it).
VILT_INPUTS = ("input_ids", "attention_mask", "token_type_ids", "pixel_values", "pixel_mask")

_IMAGE_KEYS = ("visual_embeds", "visual_feats", "pixel_values")
_MASK_KEYS = ("attention_mask", "visual_attention_mask", "pixel_mask")
_INTEGER_KEYS = ("input_ids", "token_type_ids", "visual_token_type_ids")
_HF_KEYS = {"visual_bert": VISUALBERT_INPUTS[:6], "vilt": VILT_INPUTS}
_CLASSES = {"visual_bert": "a Hugging Face VisualBERT question-answering model (VisualBertForQuestionAnswering)",
            "vilt": "a Hugging Face ViLT question-answering model (ViltForQuestionAnswering)"}


def _require(model, family: str, method: str) -> None:
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if not isinstance(model, torch.nn.Module) or model_type != family:
        raise TypeError(f"{method} explains {_CLASSES[family]}, got {type(model).__name__}"
                        + (f" (model_type {model_type!r})" if model_type else ""))


def checked_visualbert_inputs(model, inputs, family: str, method: str) -> tuple[dict, int]:
    """``inputs`` as a dict of tensors the model takes, checked before any forward; and the batch size."""
    _require(model, family, method)
    names = VISUALBERT_INPUTS if family == "visual_bert" else VILT_INPUTS
    if not isinstance(inputs, Mapping):
        raise TypeError(f"{method}: inputs must be a dict of tensors (keys among {names}), got {type(inputs).__name__}")
    explicit = set(inspect.signature(model.forward).parameters)
    allowed = [k for k in names if k in _HF_KEYS[family] or k in explicit]
    unknown = [k for k in inputs if k not in allowed]
    if unknown:
        raise ValueError(f"{method}: unexpected input key{'s' if len(unknown) > 1 else ''} "
                         f"{', '.join(map(repr, unknown))}; {type(model).__name__} takes {tuple(allowed)}")
    images = [k for k in _IMAGE_KEYS if k in allowed]
    given = [k for k in images if k in inputs]
    needed = ("input_ids", "attention_mask") if family == "visual_bert" else ("input_ids",)
    if any(k not in inputs for k in needed) or len(given) != 1:
        raise ValueError(f"{method}: inputs need {' and '.join(map(repr, needed))} (the tokenised questions) and "
                         f"one of {tuple(images)} (the images); got keys {tuple(inputs)}")
    batch = None
    for key, value in inputs.items():
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{method}: inputs[{key!r}] must be a tensor, got {type(value).__name__}")
        if value.ndim == 0 or value.numel() == 0:
            raise ValueError(f"{method}: inputs[{key!r}] has shape {tuple(value.shape)}; every input is a non-empty "
                             "batch (samples first)")
        if batch is not None and value.shape[0] != batch:
            raise ValueError(f"{method}: inputs[{key!r}] has shape {tuple(value.shape)}; every input needs the batch "
                             f"size {batch} first")
        batch = value.shape[0]
        if key in _INTEGER_KEYS and (value.is_floating_point() or value.is_complex()):
            raise TypeError(f"{method}: inputs[{key!r}] must hold integer token ids, got dtype {value.dtype}")
        if key in _IMAGE_KEYS:
            if value.dtype == torch.uint8:
                raise TypeError(f"{method}: inputs[{key!r}] is uint8 (raw pixel or byte values); give float tensors, "
                                "images normalised as the model expects (vitlab.preprocess or the model's processor)")
            if not value.is_floating_point():
                raise TypeError(f"{method}: inputs[{key!r}] must be a float tensor, got dtype {value.dtype}")
        if (value.is_floating_point() or value.is_complex()) and not torch.isfinite(value).all():
            raise ValueError(f"{method}: inputs[{key!r}] contains NaN or infinite values; every input must be finite")
        if key in _MASK_KEYS and not ((value == 0) | (value == 1)).all():
            raise ValueError(f"{method}: inputs[{key!r}] must hold 0 (padding) and 1 (token) only")
    ids, config = inputs["input_ids"], model.config
    vocab, positions = int(config.vocab_size), int(config.max_position_embeddings)
    if ids.min() < 0 or ids.max() >= vocab:
        raise ValueError(f"{method}: inputs['input_ids'] holds token id {int(ids.max() if ids.max() >= vocab else ids.min())}, "
                         f"outside the model's vocabulary 0 .. {vocab - 1}; tokenise with the model's own tokenizer")
    if ids.shape[1] > positions:
        raise ValueError(f"{method}: the questions are {ids.shape[1]} tokens long, more than the model's "
                         f"{positions} text positions (max_position_embeddings); shorten them")
    mask = inputs.get("attention_mask")
    if mask is not None:
        if (mask[:, 1:] > mask[:, :-1]).any():
            raise ValueError(f"{method}: inputs['attention_mask'] has padding before a token; pad the questions at "
                             "the end (as the tokenizers do)")
        shortest = int(mask.sum(1).min())
        if shortest < (2 if family == "visual_bert" else 1):
            raise ValueError(f"{method}: a question has {shortest} token(s) in attention_mask; VisualBERT's answer "
                             "is read off token attention_mask.sum(1) - 2, so every question needs [CLS], a word "
                             "and [SEP]" if family == "visual_bert" else
                             f"{method}: a question has no token in attention_mask")
    return dict(inputs), int(batch)


def answer_rows(model, inputs: dict) -> torch.Tensor:
    """The token whose output the answer head classifies, per sample (``B``, int64): VisualBERT
    ``attention_mask.sum(1) - 2`` (the last question token before ``[SEP]``), ViLT 0 (``[CLS]``)."""
    family = getattr(getattr(model, "config", None), "model_type", None)
    if family == "visual_bert":
        return inputs["attention_mask"].sum(1).long() - 2
    if family == "vilt":
        return torch.zeros(inputs["input_ids"].shape[0], dtype=torch.long, device=inputs["input_ids"].device)
    raise TypeError(f"answer_rows reads VisualBERT and ViLT models, got {type(model).__name__}")


@dataclass
class _Joint:
    """One recorded forward of a single-stream model."""

    rec: object
    logits: torch.Tensor
    text_tokens: int                      # Nt: the joint sequence is Nt text tokens, then the image's
    rows: torch.Tensor                    # B: the row each sample's answer is read off
    patch_index: torch.Tensor | None      # ViLT: B x patches x 2, (row, column) of each patch token
    grid: tuple[int, int] | None          # ViLT: the batch's patch grid
    valid: torch.Tensor                   # B x N, True on the joint sequence's tokens that are not padding


def _forward(model, inputs, family: str, method: str, grad: bool) -> _Joint:
    kwargs, _ = checked_visualbert_inputs(model, inputs, family, method)
    text_tokens = int(kwargs["input_ids"].shape[1])
    rows = answer_rows(model, kwargs)
    if family == "visual_bert":
        rec, out = _recorded_forward(model, kwargs, grad, method)
        patch_index = grid = None
        image_valid = kwargs.get("visual_attention_mask")
    else:
        rec, out, patch_index, grid, image_valid = _vilt_recorded_forward(model, kwargs, grad, method)
    text_valid = kwargs.get("attention_mask", torch.ones_like(kwargs["input_ids"]))
    caps = rec.stream("joint")
    if not caps:
        raise ValueError(f"{method}: {type(model).__name__} ran no self-attention layer")
    n_image = caps[0].attention.shape[-1] - text_tokens
    if image_valid is None:
        image_valid = torch.ones(text_valid.shape[0], n_image, dtype=torch.bool, device=text_valid.device)
    valid = torch.cat([text_valid.bool(), image_valid.bool().to(text_valid.device)], dim=1)
    logits = getattr(out, "logits", None)
    if not isinstance(logits, torch.Tensor) or logits.ndim != 2:
        raise TypeError(f"{method} explains an answer score, but {type(model).__name__} returned no B x answers "
                        f"logits: use {'VisualBertForQuestionAnswering' if family == 'visual_bert' else 'ViltForQuestionAnswering'}")
    return _Joint(rec, logits, text_tokens, rows, patch_index, grid, valid)


def _vilt_base(model):
    base = getattr(model, "vilt", model)
    if not hasattr(getattr(base, "embeddings", None), "visual_embed"):
        raise TypeError(f"{type(model).__name__} has no ViLT embeddings (model.vilt.embeddings.visual_embed)")
    return base


def _vilt_recorded_forward(model, kwargs: dict, grad: bool, method: str):
    """ViLT's patch selection made here (``visual_embed``, as the model would), then one recorded
    forward on those tokens: ``(rec, output, patch_index, grid)``."""
    from vitlab.record import record

    base = _vilt_base(model)
    if grad:
        require_gradients(method)
        kwargs = graph_inputs(kwargs)
    pixels = kwargs.pop("pixel_values")
    mask = kwargs.pop("pixel_mask", None)
    if mask is None:
        mask = torch.ones(pixels.shape[0], *pixels.shape[-2:], dtype=torch.long, device=pixels.device)
    context = torch.enable_grad() if grad else torch.no_grad()
    devices = [pixels.device.index or 0] if pixels.device.type == "cuda" else []
    with context, record(model, detach=not grad, eval_mode=True, capture=("attention",)) as rec:
        with torch.random.fork_rng(devices=devices):  # visual_embed draws its patch order
            embeds, token_mask, (patch_index, grid) = base.embeddings.visual_embed(
                pixels, mask, max_image_length=base.config.max_image_length)
        out = model(**kwargs, image_embeds=embeds, pixel_mask=token_mask)
    return rec, out, patch_index, (int(grid[0]), int(grid[1])), token_mask


def _split(joint: _Joint, row_maps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(image, text)`` of the rows ``B x N`` of the joint sequence."""
    nt = joint.text_tokens
    text, image = row_maps[:, :nt], row_maps[:, nt:]
    if joint.patch_index is None:
        return image, text
    image = image[:, 1:]  # ViLT's image [CLS] token
    B, P = image.shape
    h, w = joint.grid
    flat = joint.patch_index[..., 0] * w + joint.patch_index[..., 1]  # B x P
    grid = torch.zeros(B, h * w, dtype=image.dtype, device=image.device)
    grid = grid.scatter_add(1, flat.to(image.device), image)  # padding patches carry 0
    return grid.reshape(B, h, w), text


def _explained_row(joint: _Joint, matrix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(image, text)``: the answer rows of a ``B x N x N`` matrix over the joint sequence, own entry 0."""
    return _split(joint, read_rows(matrix, joint.rows.to(matrix.device), drop_self=True))


def _relevance(model, inputs, target, family: str, method: str) -> BimodalMaps:
    from vitlab.targets import check_target, resolve_target

    batch = checked_visualbert_inputs(model, inputs, family, method)[1]
    target = check_target(target, batch)
    joint = _forward(model, inputs, family, method, grad=True)
    t = resolve_target(target, joint.logits)
    caps = joint.rec.stream("joint")
    grad_output = torch.zeros_like(joint.logits)
    grad_output[torch.arange(batch, device=joint.logits.device), t] = 1  # sum over samples of each target logit
    grads = _attention_grads(joint.logits, grad_output, caps, batched=False, method=method)
    N = caps[0].attention.shape[-1]
    events = self_attention_events("text+image", [c.attention.detach() for c in caps], grads)
    R = propagate(events, {"text+image": N})["text+image", "text+image"]  # eq. 1, 5, 6 per layer
    image, text = _explained_row(joint, R)
    return BimodalMaps(image, text, t, joint.logits.detach())


def _raw_attention(model, inputs, family: str, method: str) -> BimodalMaps:
    joint = _forward(model, inputs, family, method, grad=False)
    image, text = _explained_row(joint, joint.rec.stream("joint")[-1].attention.mean(dim=1))
    return BimodalMaps(image, text, joint.logits.argmax(-1), joint.logits)


def _rollout_maps(model, inputs, family: str, method: str) -> BimodalMaps:
    joint = _forward(model, inputs, family, method, grad=False)
    cams = [c.attention.mean(dim=1) for c in joint.rec.stream("joint")]
    image, text = _explained_row(joint, _rollout(cams, cams[0].shape[-1], cams[0]))
    return BimodalMaps(image, text, joint.logits.argmax(-1), joint.logits)


def _gradcam(model, inputs, target, family: str, method: str) -> BimodalMaps:
    from vitlab.targets import check_target, resolve_target

    batch = checked_visualbert_inputs(model, inputs, family, method)[1]
    target = check_target(target, batch)
    joint = _forward(model, inputs, family, method, grad=True)
    t = resolve_target(target, joint.logits)
    last = joint.rec.stream("joint")[-1]
    grad_output = torch.zeros_like(joint.logits)
    grad_output[torch.arange(batch, device=joint.logits.device), t] = 1
    (g,) = _attention_grads(joint.logits, grad_output, [last], batched=False, method=method)
    g = torch.zeros_like(last.attention) if g is None else g
    # GradCAM's head weight averages the gradient over the whole map: over the pairs of real tokens
    # only, so that padding (whose columns carry gradients but no attention) cannot change it
    pairs = (joint.valid[:, :, None] & joint.valid[:, None, :]).to(g.dtype)[:, None]  # B x 1 x N x N
    g = g * pairs * (pairs[0, 0].numel() / pairs.sum(dim=(-2, -1), keepdim=True))
    image, text = _explained_row(joint, attention_matrix_gradcam(last.attention.detach(), g))
    return BimodalMaps(image, text, t, joint.logits.detach())


# --- VisualBERT --------------------------------------------------------------------------------------
_VB_ARGS = """
    Args:
        model: ``VisualBertForQuestionAnswering`` (or a subclass such as vitlab's ``shapes-visualbert``),
            run in eval mode; left exactly as it was.
        inputs: the model's keyword inputs (:data:`VISUALBERT_INPUTS`): ``input_ids`` and
            ``attention_mask`` of the questions (padded at the end) plus ``visual_embeds`` (region
            features; ``visual_attention_mask`` for padded regions), or ``pixel_values`` /
            ``visual_feats`` for ``shapes-visualbert``.

    Returns:
        :class:`BimodalMaps`: ``image`` ``B x regions``, ``text`` ``B x tokens`` (the answer
        token's own entry 0), the answer explained, the logits.
"""


def visualbert_relevance(model, inputs: dict, target=None) -> BimodalMaps:
    """Generic attention relevance of VisualBERT's answer (Chefer, Gur & Wolf 2021, eq. 1, 5, 6).

    ``R = I``, per layer ``R += E_h[(grad_A ⊙ A)^+] · R`` over the joint text + image sequence,
    with the gradient of the ``target`` answer's logit (an int, one per sample, or None: the
    predicted answer); the maps are row ``attention_mask.sum(1) - 2`` of ``R`` (the token the
    answer head reads), on the text and on the image tokens. One recorded forward and one backward
    (to the attention tensors only) for the whole batch; samples do not interact.
    """
    return _relevance(model, inputs, target, "visual_bert", "visualbert_relevance")


def visualbert_raw_attention(model, inputs: dict) -> BimodalMaps:
    """Raw attention baseline: the last layer's attention, heads averaged, at the answer row
    (the reference's ``generate_raw_attn``). One forward without gradients; the predicted answer.
    """
    return _raw_attention(model, inputs, "visual_bert", "visualbert_raw_attention")


def visualbert_rollout(model, inputs: dict) -> BimodalMaps:
    """Attention rollout baseline (Abnar & Zuidema 2020; the reference's ``generate_rollout``):
    ``rownorm(A_L + I) ... rownorm(A_1 + I)``, heads averaged, at the answer row. One forward
    without gradients; the predicted answer.
    """
    return _rollout_maps(model, inputs, "visual_bert", "visualbert_rollout")


def visualbert_gradcam(model, inputs: dict, target=None) -> BimodalMaps:
    """GradCAM baseline on the last layer's attention (the reference's ``generate_attn_gradcam``):
    :func:`attention_matrix_gradcam` at the answer row, gradients of the ``target`` answer's logit.
    One forward, one backward (to that attention only).
    """
    return _gradcam(model, inputs, target, "visual_bert", "visualbert_gradcam")


# --- ViLT ----------------------------------------------------------------------------------------------
_VILT_ARGS = """
    Args:
        model: ``ViltForQuestionAnswering``, run in eval mode; left exactly as it was.
        inputs: the model's keyword inputs (:data:`VILT_INPUTS`): ``input_ids`` (and
            ``attention_mask``) of the questions, ``pixel_values`` of the images (normalised as the
            model expects; ``pixel_mask`` where the images were padded to a common size).

    Returns:
        :class:`BimodalMaps`: ``image`` ``B x gh x gw`` on the patch grid (padding 0), ``text``
        ``B x tokens`` (the ``[CLS]`` entry 0), the answer explained, the logits.
"""


def vilt_relevance(model, inputs: dict, target=None) -> BimodalMaps:
    """Generic attention relevance of ViLT's answer (Chefer, Gur & Wolf 2021, eq. 1, 5, 6): as
    :func:`visualbert_relevance`, at row 0 (``[CLS]``, which ViLT's pooler reads), the image map put
    back on the patch grid. One recorded forward and one backward for the whole batch.
    """
    return _relevance(model, inputs, target, "vilt", "vilt_relevance")


def vilt_raw_attention(model, inputs: dict) -> BimodalMaps:
    """Raw attention baseline for ViLT: the last layer's attention, heads averaged, row ``[CLS]``."""
    return _raw_attention(model, inputs, "vilt", "vilt_raw_attention")


def vilt_rollout(model, inputs: dict) -> BimodalMaps:
    """Attention rollout baseline for ViLT, as :func:`visualbert_rollout`, row ``[CLS]``."""
    return _rollout_maps(model, inputs, "vilt", "vilt_rollout")


def vilt_gradcam(model, inputs: dict, target=None) -> BimodalMaps:
    """GradCAM baseline for ViLT on its last layer's attention, row ``[CLS]``."""
    return _gradcam(model, inputs, target, "vilt", "vilt_gradcam")


for _f in (visualbert_relevance, visualbert_raw_attention, visualbert_rollout, visualbert_gradcam):
    _f.__doc__ += _VB_ARGS
for _f in (vilt_relevance, vilt_raw_attention, vilt_rollout, vilt_gradcam):
    _f.__doc__ += _VILT_ARGS
del _f


# ---------------------------------------------------------------------------------------------
# Chapter 9: the single-stream model's maps of many questions, graded as LXMERT's
# ---------------------------------------------------------------------------------------------


def _visualbert_methods() -> dict:
    return {
        "relevance": visualbert_relevance,
        "raw attention": visualbert_raw_attention,
        "rollout": visualbert_rollout,
        "GradCAM": visualbert_gradcam,
    }


#: The methods chapter 9 compares for ``shapes-visualbert``, in table order (no backbone variant: the
#: single-stream relevance stops at VisualBERT's input tokens).
#: As :data:`BIMODAL_METHODS`: "relevance" is Chefer et al.'s, then display names of the registry.
VISUALBERT_METHODS: tuple[str, ...] = ("relevance", *display_names("raw_attention", "rollout", "gradcam"))


def visualbert_method_maps(model, x: torch.Tensor, questions, methods=VISUALBERT_METHODS, batch_size: int = 100,
                           features=None) -> dict:
    """Image and text maps of every method for every question, for ``shapes-visualbert``.

    As :func:`lxmert_method_maps` (same arguments and returns; ``features`` the frozen ViT's
    tokens of :func:`lxmert_scene_features`, which ``shapes-visualbert`` reads too, as
    ``visual_feats``). The maps are the row of the token VisualBERT answers from
    (``attention_mask.sum(1) - 2``, the ``?``), its own text entry 0
    (:mod:`vitlab.relevance.visualbert`). One forward (and one backward) per batch and method.
    """
    methods = tuple(methods)
    unknown = [m for m in methods if m not in VISUALBERT_METHODS]
    if not methods or unknown:
        raise ValueError(f"methods must be names from {VISUALBERT_METHODS}, got {methods!r}")
    table = _visualbert_methods()
    ids, mask, scene = encoded_questions(model, x.shape[0], questions, "visualbert_method_maps")
    grid = tuple(int(g) for g in model.backbone.patch_embed.grid_size)
    feats = (lxmert_scene_features(model, x, batch_size) if features is None else features)[0]
    out = {}
    for name in methods:
        parts = [table[name](model, dict(input_ids=ids[s], attention_mask=mask[s], visual_feats=feats[scene[s]]))
                 for s in batches(len(questions), batch_size)]
        image = torch.cat([p.image for p in parts]).reshape(len(questions), *grid)
        out[name] = BimodalMaps(image, torch.cat([p.text for p in parts]),
                                torch.cat([p.target for p in parts]), torch.cat([p.logits for p in parts]))
    return out


def grade_visualbert(model, x: torch.Tensor, masks, questions, methods=VISUALBERT_METHODS, batch_size: int = 100,
                     min_coverage: float = 0.5, features=None) -> QuestionGrades:
    """Grade every method's ``shapes-visualbert`` maps against the objects, as :func:`grade_lxmert`.

    Same measures and arguments. Text: the named class word must be the highest of the word
    tokens; ``[CLS]`` and ``[SEP]`` do not count (VisualBERT's answer row is the ``?``, whose
    own entry is 0, and its ``[CLS]`` is a token like any other, not the answer's own).
    """
    from vitlab.localization import as_cpu_tensor

    masks = as_cpu_tensor(masks)
    if masks.ndim != 4 or masks.shape[:2] != (x.shape[0], 2):
        raise ValueError(f"masks must be S x 2 x H x W for the {x.shape[0]} scenes of x, got {tuple(masks.shape)}")
    maps = visualbert_method_maps(model, x, questions, methods, batch_size, features)
    _, mask = model.encode(list(questions.text))
    positions = torch.arange(mask.shape[1])
    words = (mask == 1) & (positions > 0) & (positions < mask.sum(1, keepdim=True) - 1)
    return _grade_question_maps(model, maps, masks, questions, min_coverage, words)
