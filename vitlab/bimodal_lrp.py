"""The LRP baselines of Chefer, Gur & Wolf (ICCV 2021, "Generic Attention-model Explainability for
Interpreting Bi-Modal and Encoder-Decoder Transformers", Sec. 4) for VisualBERT and LXMERT:
partial LRP and Transformer attribution, with the calling shape of
:func:`vitlab.relevance.visualbert_relevance` / :func:`~vitlab.relevance.lxmert_relevance`.

What the reference code computes (hila-chefer/Transformer-MM-Explainability, read for these
definitions: ``VisualBERT/mmf/models/transformers/backends/ExplanationGenerator.py``
``generate_partial_lrp`` / ``generate_transformer_att``, and
``lxmert/lxmert/src/ExplanationGenerator.py`` ``GeneratorBaselines.generate_partial_lrp`` /
``generate_transformer_attr``, as ``lxmert/lxmert/perturbation.py`` calls them):

- ``R^A`` of an attention map is its LRP relevance (the map that multiplies V, after dropout),
  from relevance **1** put on the explained answer's logit (the reference's
  ``relprop(one_hot)``); ``grad A`` the ordinary gradient of that logit.
- Partial LRP (Voita et al. 2019): the last layer's ``R^A``, averaged over heads (no clamp),
  min-max normalised over the matrix, then the answer's row (own entry 0). VisualBERT: the last
  layer over the joint sequence, row ``attention_mask.sum(1) - 2``. LXMERT: the last
  cross-modality layer, text -> image co-attention for the image map and text self-attention
  for the text map, row [CLS] (its own entry 0).
- Transformer attribution (Chefer, Gur & Wolf, CVPR 2021, eq. 13): ``Abar = E_h[(grad A ⊙
  R^A)^+]`` per layer, ``C = (I + Abar_L) ... (I + Abar_1)`` (start layer 0, no row
  normalisation), the answer's row (own entry 0). VisualBERT: over every layer of the joint
  stack. LXMERT: the text map is row [CLS] of that product over the text self-attention layers
  (language layers, then each cross-modality layer's), [CLS] entry 0; the image map is row [CLS]
  of the last cross-modality layer's ``Abar`` of its text -> image co-attention alone (the
  reference computes the image-side products too but returns only these two).

The rules are vitlab's ``lrp="chefer"`` set (:mod:`vitlab.record.lrp`): those of LXMERT's
reference (``lxmert/lxmert/src/layers.py``: alpha = 1, beta = 0 over the positive contributions
of both signs, residual additions rescaled, identity at GELU / LayerNorm / softmax / tanh,
attention matmuls halved). The reference's VisualBERT instead uses ``layers_lrp.py``, whose
linear rule normalises the positive inputs' and the negative inputs' contributions separately
and whose additions are not rescaled; vitlab uses the one conservative set for both (as for
the ViT, :mod:`vitlab.lrp`). The reference's min-max normalisation is kept for partial LRP
because it decides where the zeroed own entry ranks; the perturbation script min-max
normalises each row again, which changes no ranking and is left out.

Precision. The rules' relevance has poles where a sum (an attention score, a residual
stream) is small against its terms, which a float32 forward cannot resolve (:mod:`vitlab.lrp`'s
module docstring). So every method runs a float64 copy of the model by default
(``precision="float64"``; the model is not touched) and returns its maps in the dtype of the
image input; ``precision="model"`` runs the model as it is. What float32 costs, measured on
``shapes-visualbert`` with 40 scenes of seed 29_019 (120 questions in padded batches of 3,
answers 3, 5, 7): Transformer attribution's text map lies up to 13% of its max |value| from
float64, and a padded batch moves a question's text map by up to 0.74% (its image map 0.15%)
from the question alone. At the default precision both are float32 rounding of the float64
maps: padded batch = questions alone, and float32 model = float64 model, within 1e-6 of the
map's max (``tests/test_hardening_lrp.py``).

Every method: one recorded forward with the rules attached, one LRP backward (to the attention
maps only) and, for Transformer attribution, one ordinary backward, for the whole batch;
samples do not interact. Padding changes nothing (to float32 rounding of the float64 maps, see
Precision above): padded tokens and regions are masked keys (attention 0), so no relevance
reaches them; min-max runs over the pairs of real tokens only; their entries in the maps are 0.
Inputs are checked (as the relevance methods check them) before the forward; the model is left
as it was.
"""
from __future__ import annotations

import torch

from vitlab.inputs import gradient_leaf, graph_inputs, require_gradients
from vitlab.lrp import PRECISIONS
from vitlab.record import record
from vitlab.record.lrp import working_copy
from vitlab.relevance.bimodal import BimodalMaps, last_capture, require_family
from vitlab.relevance.engine import read_rows
from vitlab.relevance.lxmert import checked_lxmert_inputs, real_tokens
from vitlab.relevance.visualbert import answer_rows, checked_visualbert_inputs
from vitlab.targets import check_target, resolve_target

__all__ = ["lxmert_partial_lrp", "lxmert_transformer_attribution", "visualbert_partial_lrp",
           "visualbert_transformer_attribution"]

_IMAGE_KEYS = ("visual_embeds", "visual_feats", "pixel_values")


_FLOAT_KEYS = _IMAGE_KEYS + ("visual_pos",)


def _at_precision(model, kwargs: dict, precision: str, method: str):
    """``(model, kwargs, dtype)`` as the pass runs them: with ``precision="float64"`` a float64 copy
    of the model (none when it is float64 already) and the float inputs (features, boxes, pixels)
    in float64; with ``"model"`` both as they are, the float inputs in the model's dtype (else
    ``ValueError`` with the remedy). ``dtype``: the image input's, which the maps are returned in."""
    if precision not in PRECISIONS:
        raise ValueError(f"{method}: precision must be one of {PRECISIONS}, got {precision!r}")
    floats = [k for k in _FLOAT_KEYS if k in kwargs]
    like = kwargs[floats[0]].dtype
    dtype = next((t.dtype for t in model.parameters() if t.is_floating_point()), torch.float64)
    if precision == "model":
        bad = [k for k in floats if kwargs[k].dtype != dtype]
        if bad:
            raise ValueError(f"{method}: inputs[{bad[0]!r}] is {kwargs[bad[0]].dtype} but the model's parameters are "
                             f"{dtype}; pass it .to({dtype}), or precision='float64' (a float64 copy of the model)")
        return model, kwargs, like
    run = model if dtype == torch.float64 else working_copy(model, torch.float64)
    return run, {k: (v.to(torch.float64) if k in floats else v) for k, v in kwargs.items()}, like


def _lrp_attention(model, kwargs: dict, target, streams, plain: bool, method: str):
    """One forward with ``lrp="chefer"``, relevance 1 on each sample's ``target`` logit:
    ``(R^A per capture, grad A per capture or None, target, logits, captures)`` for the
    captures of ``streams`` (a function of the recording)."""
    require_gradients(method)
    # the image features require grad, so that every attention is in the graph even when the
    # model's parameters are frozen (its own tensors are not changed)
    kwargs = {k: (gradient_leaf(v) if k in _IMAGE_KEYS else v) for k, v in graph_inputs(kwargs).items()}
    with torch.enable_grad(), record(model, lrp="chefer", capture=("attention",), detach=False,
                                     eval_mode=True) as rec:
        out = model(**kwargs)
        logits = getattr(out, "logits", None)
        if logits is None:
            logits = getattr(out, "question_answering_score", None)
        if not isinstance(logits, torch.Tensor) or logits.ndim != 2:
            raise TypeError(f"{method} explains an answer score, but {type(model).__name__} returned no "
                            "B x answers logits (use a ...ForQuestionAnswering model)")
        t = resolve_target(target, logits)
        y = logits.gather(1, t[:, None])[:, 0]
        caps = streams(rec)
        if (y.detach() == 0).any():
            raise ValueError(f"{method}: the explained logit is exactly 0 for sample "
                             f"{int((y.detach() == 0).nonzero()[0])}; LRP's relevance 1 on it cannot be "
                             "expressed as a gradient: explain another answer (target=...)")
        attn = [c.attention for c in caps]
        if not all(a.requires_grad for a in attn):
            raise RuntimeError(f"{method}: an attention map is outside the autograd graph; unfreeze the model's "
                               "parameters (model.requires_grad_(True)): no parameter's .grad is written")
        # relevance R_y = y * gbar_y = 1 on the answer: gbar_y = 1 / y (the reference's relprop(one_hot))
        lrp_grads = torch.autograd.grad(y, attn, grad_outputs=1 / y.detach(), retain_graph=plain,
                                        allow_unused=True)
        plain_grads = [None] * len(attn)
        if plain:
            with rec.plain_gradients():
                plain_grads = torch.autograd.grad(y.sum(), attn, allow_unused=True)
    R_A = [a.detach() * (torch.zeros_like(a) if g is None else g) for a, g in zip(attn, lrp_grads)]
    G = [torch.zeros_like(a).detach() if g is None else g.detach() for a, g in zip(attn, plain_grads)]
    return R_A, G, t, logits.detach(), caps


def _min_max(cam: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """``(cam - min) / (max - min)`` per sample over the entries where ``real`` (``B x Nq x Nk``)
    is 1; 0 elsewhere, and 0 where the entries are all equal."""
    big = torch.finfo(cam.dtype).max
    lo = torch.where(real > 0, cam, big).flatten(1).min(1).values[:, None, None]
    hi = torch.where(real > 0, cam, -big).flatten(1).max(1).values[:, None, None]
    span = hi - lo
    out = torch.where(span > 0, (cam - lo) / torch.where(span > 0, span, 1.0), 0.0)
    return out * real


def _abar(R_A: torch.Tensor, G: torch.Tensor) -> torch.Tensor:
    """Eq. 13's ``E_h[(grad A ⊙ R^A)^+]``: ``B x Nq x Nk``."""
    return (G * R_A).clamp(min=0).mean(dim=1)


def _product(abars: list[torch.Tensor], n: int, like: torch.Tensor) -> torch.Tensor:
    """``(I + Abar_L) ... (I + Abar_1)`` (first layer first in ``abars``)."""
    C = torch.eye(n, dtype=like.dtype, device=like.device).expand(like.shape[0], n, n)
    for a in abars:
        C = C + a @ C
    return C


# --- VisualBERT ------------------------------------------------------------------------------------
def _visualbert(model, inputs, target, plain: bool, method: str, precision: str):
    kwargs, batch = checked_visualbert_inputs(model, inputs, "visual_bert", method)
    target = check_target(target, batch)
    rows = answer_rows(model, kwargs)
    model, kwargs, like = _at_precision(model, kwargs, precision, method)
    R_A, G, t, logits, caps = _lrp_attention(model, kwargs, target, lambda rec: rec.stream("joint"), plain, method)
    if not caps:
        raise ValueError(f"{method}: {type(model).__name__} ran no self-attention layer")
    nt = int(kwargs["input_ids"].shape[1])
    N = R_A[0].shape[-1]
    text_valid = kwargs["attention_mask"].to(R_A[0].dtype)
    image_valid = kwargs.get("visual_attention_mask")
    image_valid = (torch.ones(batch, N - nt, dtype=R_A[0].dtype, device=R_A[0].device) if image_valid is None
                   else image_valid.to(R_A[0].dtype))
    valid = torch.cat([text_valid, image_valid.to(text_valid.device)], 1)  # B x N
    return R_A, G, t, logits, rows.to(R_A[0].device), nt, valid, like


def _split(matrix, rows, nt, valid):
    row = read_rows(matrix, rows, drop_self=True) * valid
    return row[:, nt:], row[:, :nt]


def visualbert_partial_lrp(model, inputs: dict, target=None, precision: str = "float64") -> BimodalMaps:
    """Partial LRP of VisualBERT's answer, as the reference's ``generate_partial_lrp``: the last
    layer's attention relevance ``R^A`` (relevance 1 on the ``target`` answer's logit, vitlab's
    ``lrp="chefer"`` rules), averaged over heads, min-max normalised over the pairs of real
    tokens, row ``attention_mask.sum(1) - 2`` (the token the answer head reads; own entry 0).
    One forward and one LRP backward for the whole batch.

    Args:
        model: ``VisualBertForQuestionAnswering`` (or vitlab's ``shapes-visualbert``), run in eval
            mode; left exactly as it was.
        inputs: as :func:`vitlab.relevance.visualbert_relevance` (``input_ids``, ``attention_mask``
            and ``visual_embeds`` / ``pixel_values`` / ``visual_feats``; padding masks).
        target: the answer: an int, one per sample, or None (the predicted answer).
        precision: ``"float64"`` (default: a float64 copy of a model in another dtype, the maps
            returned in the image input's dtype) or ``"model"`` (the model's own dtype; see the
            module docstring for what float32 costs).

    Returns:
        :class:`~vitlab.relevance.BimodalMaps`: ``image`` ``B x regions``, ``text`` ``B x tokens``
        in [0, 1] (padding 0), the answer explained, the logits.
    """
    R_A, _, t, logits, rows, nt, valid, like = _visualbert(model, inputs, target, False, "visualbert_partial_lrp",
                                                           precision)
    cam = _min_max(R_A[-1].mean(dim=1), valid[:, :, None] * valid[:, None, :])
    image, text = _split(cam, rows, nt, valid)
    return BimodalMaps(image.to(like), text.to(like), t, logits.to(like))


def visualbert_transformer_attribution(model, inputs: dict, target=None, precision: str = "float64") -> BimodalMaps:
    """Transformer attribution (Chefer, Gur & Wolf, CVPR 2021, eq. 13) of VisualBERT's answer, as
    the reference's ``generate_transformer_att``: ``C = (I + Abar_L) ... (I + Abar_1)`` with
    ``Abar = E_h[(grad A ⊙ R^A)^+]`` over every layer of the joint stack, row
    ``attention_mask.sum(1) - 2`` (own entry 0), split into the text and the image tokens. One
    forward, one LRP backward and one ordinary backward for the whole batch.

    Args / Returns: as :func:`visualbert_partial_lrp` (the maps are not normalised).
    """
    R_A, G, t, logits, rows, nt, valid, like = _visualbert(model, inputs, target, True,
                                                           "visualbert_transformer_attribution", precision)
    C = _product([_abar(r, g) for r, g in zip(R_A, G)], R_A[0].shape[-1], R_A[0])
    image, text = _split(C, rows, nt, valid)
    return BimodalMaps(image.to(like), text.to(like), t, logits.to(like))


# --- LXMERT ------------------------------------------------------------------------------------------
def _lxmert(model, inputs, target, plain: bool, method: str, streams, precision: str):
    require_family(model, "lxmert", method)
    kwargs, batch = checked_lxmert_inputs(model, inputs, method)
    target = check_target(target, batch)
    model, kwargs, like = _at_precision(model, kwargs, precision, method)

    def captures(rec):
        return [c for s in streams for c in (rec.stream(s) if s != "last lang->vision"
                                             else [last_capture(rec, "lang->vision", method)])]
    R_A, G, t, logits, caps = _lrp_attention(model, kwargs, target, captures, plain, method)
    co = caps[-1]
    text, image = real_tokens(kwargs, *co.attention.shape[-2:], R_A[-1])
    return R_A, G, t, logits, caps, text, image, like


def lxmert_partial_lrp(model, inputs: dict, target=None, precision: str = "float64") -> BimodalMaps:
    """Partial LRP of LXMERT's answer, as the reference's ``GeneratorBaselines.generate_partial_lrp``:
    in the last cross-modality layer, the attention relevance ``R^A`` (relevance 1 on the
    ``target`` answer's logit, vitlab's ``lrp="chefer"`` rules) averaged over heads and min-max
    normalised over the pairs of real tokens: ``image`` = row [CLS] of the text -> image
    co-attention's, ``text`` = row [CLS] of the text self-attention's, [CLS] entry 0. One
    forward and one LRP backward for the whole batch.

    Args:
        model: ``LxmertForQuestionAnswering`` (or vitlab's ``shapes-lxmert``), run in eval mode;
            left exactly as it was.
        inputs: as :func:`vitlab.relevance.lxmert_relevance` (``input_ids``, ``attention_mask``,
            ``visual_feats`` and ``visual_pos``, or ``pixel_values`` for ``shapes-lxmert``).
        target: the answer: an int, one per sample, or None (the predicted answer).
        precision: as :func:`visualbert_partial_lrp`.

    Returns:
        :class:`~vitlab.relevance.BimodalMaps`: ``image`` ``B x regions``, ``text`` ``B x tokens``
        in [0, 1] (padding 0), the answer explained, the logits.
    """
    method = "lxmert_partial_lrp"
    R_A, _, t, logits, caps, text, image, like = _lxmert(model, inputs, target, False, method,
                                                         ("cross.lang", "last lang->vision"), precision)
    n_cross = len([c for c in caps if c.query_modality == c.key_modality])
    lang = R_A[n_cross - 1].mean(dim=1)  # the last cross-modality layer's text self-attention
    co = R_A[-1].mean(dim=1)
    image_map = _min_max(co, text[:, :, None] * image[:, None, :])[:, 0]
    text_map = _min_max(lang, text[:, :, None] * text[:, None, :])[:, 0].clone()
    text_map[:, 0] = 0
    return BimodalMaps(image_map.to(like), text_map.to(like), t, logits.to(like))


def lxmert_transformer_attribution(model, inputs: dict, target=None, precision: str = "float64") -> BimodalMaps:
    """Transformer attribution (Chefer, Gur & Wolf, CVPR 2021, eq. 13) of LXMERT's answer, as the
    reference's ``GeneratorBaselines.generate_transformer_attr``: with ``Abar = E_h[(grad A ⊙
    R^A)^+]``, ``text`` = row [CLS] of ``(I + Abar_L) ... (I + Abar_1)`` over the text
    self-attention layers (the language layers, then each cross-modality layer's), [CLS] entry
    0; ``image`` = row [CLS] of the last cross-modality layer's text -> image co-attention
    ``Abar``. One forward, one LRP backward and one ordinary backward for the whole batch.

    Args / Returns: as :func:`lxmert_partial_lrp` (the maps are not normalised).
    """
    method = "lxmert_transformer_attribution"
    R_A, G, t, logits, caps, text, image, like = _lxmert(model, inputs, target, True, method,
                                                         ("lang", "cross.lang", "last lang->vision"), precision)
    abars = [_abar(r, g) for r, g in zip(R_A, G)]
    real_pairs = text[:, :, None] * text[:, None, :]
    C = _product([a * real_pairs for a in abars[:-1]], text.shape[1], R_A[0])
    text_map = C[:, 0].clone() * text
    text_map[:, 0] = 0
    image_map = abars[-1][:, 0] * image
    return BimodalMaps(image_map.to(like), text_map.to(like), t, logits.to(like))
