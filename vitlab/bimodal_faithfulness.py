"""Faithfulness of bi-modal explanations: the perturbation tests of Chefer, Gur & Wolf (ICCV 2021).

"Generic Attention-model Explainability for Interpreting Bi-Modal and Encoder-Decoder
Transformers", section 5 (VisualBERT and LXMERT on VQA): the tokens of *one* modality are
removed in the order of an explanation map -- most relevant first (*positive* perturbation: a
faithful map makes accuracy fall fast, a low area under the curve is better) or least relevant
first (*negative*: accuracy should hold, a high area is better) -- and top-1 accuracy is
measured after each step. The other modality stays whole, so accuracy need not reach 0.

As in the reference code (hila-chefer/Transformer-MM-Explainability, ``lxmert/lxmert/
perturbation.py``, ``perturbation_image`` / ``perturbation_text``):

- steps (:data:`PERTURBATION_STEPS`): 0, .25, .5, .75, .8, .85, .9, .95, 1 of the tokens
  removed; a step keeps ``int((1 - step) * n)`` of the ``n`` tokens that can be removed;
- tokens are *deleted* from the input (not masked or blurred): the kept image tokens (their
  features and boxes) are passed alone; the kept text tokens are passed alone, in their order
  (so positions are renumbered), with their attention mask and token types;
- ``[CLS]`` (first) and ``[SEP]`` (last real token) are always kept: the ``n`` text tokens
  that can be removed are the others, and the map is read on them only. VisualBERT reads its
  answer off the token before ``[SEP]`` (``attention_mask.sum(1) - 2``; the ``?`` of a shapes
  question); its reference (``VisualBERT/mmf/trainers/core/evaluation_loop.py``) keeps that
  token too (indices ``0, cls_index, cls_index + 1``): for a VisualBERT model (``model_type``
  ``"visual_bert"``, as :mod:`vitlab.relevance.visualbert` tells the family) the last *two*
  real tokens are always kept (``keep_end=2``, :func:`keep_end_for`; a smaller ``keep_end`` is
  refused: the model would read its answer off another token); its image steps are
  :data:`VISUALBERT_IMAGE_STEPS` (the default for such a model's image tests, :func:`steps_for`);
- image: every image token can be removed. At step 1 the reference keeps ``int(0 * n) = 0``
  regions; Hugging Face's LXMERT cannot run on zero regions (its attention cannot reshape an
  empty sequence), so a step that leaves no image token passes one *blank* token instead
  (zero features and a zero box, or a zero ``visual_embeds`` row): no image content is left,
  but the model still sees one uninformative token. ``kept`` reports 0 there.

Choices the reference leaves open: ties in the map are broken by token order (the earlier
token counts as more relevant; the reference's ``topk`` leaves them to the implementation);
the reference min-max normalises the maps first, which does not change the order. It scores
VQA's soft accuracy against the annotators' answers; here ``answers`` are the true answer
ids (the shapes questions have one answer) or, if None, the model's own unperturbed
predictions.

Batched: every question of a batch is perturbed by its own map; text of different lengths is
re-packed and padded (the padding is masked), so a batch gives what its questions give one by
one (the tests check against a plain loop). Models: LXMERT (``visual_feats`` / ``visual_pos``)
and any model with the same calling shape whose image tokens are inputs of the forward
(VisualBERT's ``visual_embeds``). For vitlab's shapes models ``pixel_values`` (and
``shapes-visualbert``'s ``visual_feats``) are turned into those token inputs first
(:func:`token_inputs`): the patch tokens the model reads, each carrying its own cell (and patch
one-hot), so that a deleted token takes its position with it.

- :func:`perturbation_curve` -- maps in, :class:`PerturbationCurve` out;
- :func:`perturbation_test` -- the same, computing the maps with a method first
  (``lxmert_relevance``, ``lxmert_raw_attention``, ...);
- :func:`perturbation_grid` -- the four tests of many methods' maps at once (an input that
  several curves perturb the same way runs once); :func:`perturbation_rows` (a table row per
  method) and :func:`perturbation_verdicts` (does the paper's ordering hold, beyond a paired
  interval?);
- the intervals over questions are :mod:`vitlab.stats`' (``mean_interval``, ``paired_difference``);
- single-token tests of ``shapes-lxmert``'s maps: :func:`text_occlusion` (each word replaced by
  ``[UNK]``) and :func:`lxmert_answers_without` (chosen image tokens hidden);
- what image tokens carry (why LXMERT's maps pick corner patches): :func:`image_token_roles`
  (attention received by each token from [CLS], its value norm, their product per layer),
  :func:`hiding_effect` (the answer after deleting chosen tokens), :func:`corner_tokens`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from vitlab.compat import replaced_names

__all__ = [
    "IMAGE_KEYS", "PERTURBATION_STEPS", "TEXT_KEYS", "VISUALBERT_IMAGE_STEPS", "PerturbationCurve",
    "corner_tokens", "hiding_effect", "image_token_roles", "keep_end_for", "kept_indices",
    "perturbation_curve", "perturbation_test", "steps_for", "token_inputs",
    "PERTURBATION_TESTS", "Verdict", "lxmert_answers_without", "perturbation_grid", "perturbation_rows",
    "perturbation_verdicts", "text_occlusion",
]

#: Fractions of the removable tokens removed, as in the reference's ``pert_steps`` (LXMERT, image
#: and text; VisualBERT, text).
PERTURBATION_STEPS: tuple[float, ...] = (0.0, 0.25, 0.5, 0.75, 0.8, 0.85, 0.9, 0.95, 1.0)
#: The reference's image steps for VisualBERT (``VisualBERT/mmf/trainers/core/evaluation_loop.py``,
#: 100 regions per image there).
VISUALBERT_IMAGE_STEPS: tuple[float, ...] = (0.0, 0.5, 0.75, 0.95, 0.96, 0.97, 0.98, 0.99, 1.0)
#: Inputs with one entry per text token (``B x T``).
TEXT_KEYS = ("input_ids", "attention_mask", "token_type_ids")
#: Inputs with one entry per image token (``B x N [x D]``): LXMERT's and VisualBERT's.
IMAGE_KEYS = ("visual_feats", "visual_pos", "visual_embeds", "visual_token_type_ids", "visual_attention_mask")


@dataclass(frozen=True)
class PerturbationCurve:
    """One perturbation test over a set of questions.

    Attributes:
        modality: ``"image"`` or ``"text"``, the tokens removed.
        positive: True: most relevant removed first; False: least relevant first.
        steps: fraction of the removable tokens removed at each step.
        correct: ``B x S`` bool, the top-1 answer right after each step.
        kept: ``B x S`` int, tokens of the modality left after each step ([CLS] and [SEP]
            included for text).
        predictions: ``B x S`` int, the top-1 answers.
    """

    modality: str
    positive: bool
    steps: tuple[float, ...]
    correct: torch.Tensor
    kept: torch.Tensor
    predictions: torch.Tensor

    @property
    def accuracy(self) -> torch.Tensor:
        """Mean accuracy after each step (``S``)."""
        return self.correct.double().mean(0)

    @property
    def question_auc(self) -> torch.Tensor:
        """Per question, the trapezoid area under its 0/1 curve over ``steps`` (``B``); their
        mean is :attr:`auc`."""
        return _trapezoid(self.correct.double(), torch.tensor(self.steps, dtype=torch.float64))

    @property
    def auc(self) -> float:
        """Area under the accuracy curve (trapezoid over the fractions removed; in [0, 1]; the
        paper reports it in percent)."""
        return float(_trapezoid(self.accuracy[None], torch.tensor(self.steps, dtype=torch.float64))[0])


def _trapezoid(y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return ((y[:, 1:] + y[:, :-1]) / 2 * (x[1:] - x[:-1])).sum(-1)


def kept_indices(scores: torch.Tensor, step: float, positive: bool) -> torch.Tensor:
    """Indices (ascending) of the ``int((1 - step) * n)`` tokens kept from ``n`` removable ones.

    ``scores``: ``n`` relevance values. Positive: the least relevant are kept (the most
    relevant removed first); negative: the most relevant are kept. Ties: the earlier token
    counts as more relevant.
    """
    n = scores.shape[-1]
    k = int((1 - step) * n)
    order = torch.sort(scores.double(), descending=True, stable=True).indices  # most relevant first
    keep = order[n - k:] if positive else order[:k]
    return torch.sort(keep).values


def keep_end_for(model) -> int:
    """The final real tokens a text perturbation always keeps for ``model``: 2 for VisualBERT
    (``config.model_type == "visual_bert"``: the answer token before ``[SEP]``, and ``[SEP]``),
    1 (``[SEP]``) for every other model."""
    return 2 if getattr(getattr(model, "config", None), "model_type", None) == "visual_bert" else 1


def steps_for(model, modality: str) -> tuple[float, ...]:
    """The fractions removed when ``steps`` is not given, as the reference code runs each model:
    :data:`VISUALBERT_IMAGE_STEPS` for a VisualBERT model's image test (``config.model_type ==
    "visual_bert"``; ``VisualBERT/mmf/trainers/core/evaluation_loop.py``), else
    :data:`PERTURBATION_STEPS` (LXMERT's two tests and VisualBERT's text test)."""
    if modality not in ("image", "text"):
        raise ValueError(f"modality must be 'image' or 'text', got {modality!r}")
    if modality == "image" and keep_end_for(model) == 2:
        return VISUALBERT_IMAGE_STEPS
    return PERTURBATION_STEPS


def _keep_end(model, keep_end) -> int:
    """``keep_end`` for ``model``: None -> :func:`keep_end_for`; fewer than VisualBERT needs refused."""
    need = keep_end_for(model)
    if keep_end is None:
        return need
    if isinstance(keep_end, int) and not isinstance(keep_end, bool) and keep_end < need:
        raise ValueError(f"keep_end={keep_end} would delete the token {type(model).__name__} reads its answer off "
                         f"(attention_mask.sum(1) - 2, the last question token before [SEP]): VisualBERT needs "
                         f"keep_end >= {need}; leave keep_end=None")
    return keep_end


def token_inputs(model, inputs: dict) -> dict:
    """``inputs`` with ``pixel_values`` replaced by the image tokens the model reads.

    For vitlab's shapes models: LXMERT (``model.visual_inputs``) gets ``visual_feats`` and
    ``visual_pos``; VisualBERT (``model.visual_embeddings``) gets ``visual_embeds``, also from
    its ``visual_feats`` (the backbone's tokens; ``visual_embeds`` append each token's cell and
    patch one-hot, which must travel with the token when tokens are deleted). Other inputs are
    returned as they are (a new dict).
    """
    inputs = dict(inputs)
    if "pixel_values" not in inputs:
        if "visual_feats" in inputs and hasattr(model, "visual_embeddings"):
            if "visual_embeds" in inputs:
                raise ValueError("give visual_feats or visual_embeds, not both")
            with torch.no_grad():
                inputs["visual_embeds"] = model.visual_embeddings(inputs.pop("visual_feats"))
        return inputs
    px = inputs.pop("pixel_values")
    if not hasattr(model, "visual_inputs"):
        raise ValueError(f"{type(model).__name__} takes pixel_values but has no visual_inputs() to give its image "
                         "tokens; pass the image tokens (visual_feats / visual_pos, or visual_embeds) instead")
    with torch.no_grad():
        feats, pos = model.visual_inputs(px)
        if hasattr(model, "visual_embeddings"):
            inputs["visual_embeds"] = model.visual_embeddings(feats)
        else:
            inputs["visual_feats"], inputs["visual_pos"] = feats, pos
    return inputs


def logits_of(out) -> torch.Tensor:
    for name in ("question_answering_score", "logits"):
        value = getattr(out, name, None)
        if isinstance(value, torch.Tensor):
            return value
    raise TypeError(f"the model returned {type(out).__name__} with neither question_answering_score nor logits")


def _check(inputs: dict, maps: torch.Tensor, modality: str, answers, steps, keep_end: int = 1) -> tuple[int, int, int]:
    if modality not in ("image", "text"):
        raise ValueError(f"modality must be 'image' or 'text', got {modality!r}")
    if "input_ids" not in inputs or "attention_mask" not in inputs:
        raise ValueError("inputs need input_ids and attention_mask (the questions, e.g. from model.encode)")
    image_keys = [k for k in IMAGE_KEYS if k in inputs]
    if not any(k in inputs for k in ("visual_feats", "visual_embeds")):
        raise ValueError("inputs need the image tokens (visual_feats and visual_pos, or visual_embeds, or "
                         "pixel_values for a vitlab shapes model)")
    ids, mask = inputs["input_ids"], inputs["attention_mask"]
    B, T = ids.shape
    if B == 0:
        raise ValueError("the batch is empty: give at least one question")
    N = inputs[image_keys[0]].shape[1]
    for k in image_keys:
        if inputs[k].shape[:2] != (B, N):
            raise ValueError(f"{k} has shape {tuple(inputs[k].shape)}; every image input must start B x N = {B} x {N}")
    if "visual_attention_mask" in inputs and not bool((inputs["visual_attention_mask"] != 0).all()):
        raise ValueError("visual_attention_mask masks some image tokens: every image token must be real here")
    for k in TEXT_KEYS:
        if k in inputs and inputs[k].shape != (B, T):
            raise ValueError(f"{k} has shape {tuple(inputs[k].shape)}; text inputs must be B x T = {B} x {T}")
    if isinstance(keep_end, bool) or not isinstance(keep_end, int) or keep_end < 1:
        raise ValueError(f"keep_end must be an int >= 1 (the final tokens always kept, [SEP] included), got {keep_end!r}")
    lengths = mask.sum(1)
    if (lengths < 1 + keep_end).any():
        raise ValueError(f"every question needs at least [CLS] and its {keep_end} kept final token(s) "
                         f"(attention_mask sums >= {1 + keep_end})")
    if bool((mask != (torch.arange(T, device=mask.device) < lengths[:, None]).to(mask.dtype)).any()):
        raise ValueError("attention_mask must be right-padded: ones for the tokens, then zeros")
    want = (B, N) if modality == "image" else (B, T)
    if tuple(maps.shape) != want:
        raise ValueError(f"{modality} maps must be B x {'N' if modality == 'image' else 'T'} = {want[0]} x {want[1]}, "
                         f"got {tuple(maps.shape)}")
    if modality == "image":
        valid = maps
    else:
        pos = torch.arange(T, device=maps.device)
        inner = (pos >= 1) & (pos < lengths[:, None].to(maps.device) - keep_end)
        valid = maps[inner]
    if not bool(torch.isfinite(valid).all()):
        raise ValueError(f"the {modality} maps hold NaN or inf: fix the explanation before testing it")
    if answers is not None and tuple(answers.shape) != (B,):
        raise ValueError(f"answers must hold one answer id per question ({B}), got shape {tuple(answers.shape)}")
    try:  # numbers only (None, strings and the like are named as given)
        s = [float(x) for x in steps if not isinstance(x, (str, bytes, bool))]
        if len(s) != len(steps):
            raise TypeError
    except (TypeError, ValueError):
        raise ValueError("steps must be increasing fractions in [0, 1] (e.g. PERTURBATION_STEPS), "
                         f"got {steps!r}") from None
    if not s or any(not 0 <= x <= 1 for x in s) or sorted(s) != s:
        raise ValueError(f"steps must be increasing fractions in [0, 1], got {steps}")
    return B, T, N


def _perturbed_batch(inputs: dict, maps: torch.Tensor, modality: str, step: float, positive: bool,
                     rows: range, keep_end: int = 1) -> tuple[dict, list[int]]:
    """The inputs of questions ``rows`` after removing ``step`` of their ``modality`` tokens."""
    out, kept = {}, []
    mask = inputs["attention_mask"]
    if modality == "image":
        idx = torch.stack([kept_indices(maps[b], step, positive) for b in rows]).to(mask.device)  # b x k
        for k, v in inputs.items():
            if k in IMAGE_KEYS:
                if idx.shape[1] == 0:  # no token left: one blank token (see the module docstring)
                    out[k] = torch.zeros(len(rows), 1, *v.shape[2:], dtype=v.dtype, device=v.device)
                    if k == "visual_attention_mask":
                        out[k] += 1
                    continue
                sel = idx.reshape(*idx.shape, *([1] * (v.ndim - 2))).expand(-1, -1, *v.shape[2:])
                out[k] = v[list(rows)].gather(1, sel)
            else:
                out[k] = v[list(rows)]
        return out, [idx.shape[1]] * len(rows)
    picks = []
    for b in rows:
        n = int(mask[b].sum())
        inner = kept_indices(maps[b, 1 : n - keep_end], step, positive) + 1
        picks.append(torch.cat([torch.tensor([0]), inner.cpu(), torch.arange(n - keep_end, n)]))
    width = max(len(p) for p in picks)
    for k, v in inputs.items():
        if k in TEXT_KEYS:
            packed = torch.zeros(len(picks), width, dtype=v.dtype, device=v.device)
            for r, (b, p) in enumerate(zip(rows, picks)):
                packed[r, : len(p)] = v[b, p.to(v.device)]
            out[k] = packed
        else:
            out[k] = v[list(rows)]
    return out, [len(p) for p in picks]


def perturbation_curve(model, inputs: dict, maps, modality: str, positive: bool = True, answers=None,
                       steps=None, batch_size: int = 256,
                       keep_end: int | None = None) -> PerturbationCurve:
    """The perturbation test of Chefer et al. (2021, sec. 5) for one modality and given maps.

    Args:
        model: LXMERT-like question answering (``question_answering_score`` or ``logits``);
            run in eval mode without gradients and left as it was.
        inputs: the model's keyword inputs for ``B`` questions: ``input_ids``,
            ``attention_mask`` (right-padded; ``[CLS]`` first, ``[SEP]`` last real token), maybe
            ``token_type_ids``; image tokens as ``visual_feats`` + ``visual_pos`` (LXMERT) or
            ``visual_embeds`` (VisualBERT), or ``pixel_values`` for a vitlab shapes model
            (:func:`token_inputs`).
        maps: ``B x N`` (image) or ``B x T`` (text, read on the tokens between [CLS] and
            [SEP]; padding and the two kept tokens are ignored) relevance per token.
        modality: ``"image"`` or ``"text"``: the tokens removed.
        positive: remove the most relevant first (True) or the least relevant first (False).
        answers: ``B`` true answer ids; None: the model's unperturbed predictions.
        steps: fractions removed; None (default): :func:`steps_for` the model and modality
            (:data:`VISUALBERT_IMAGE_STEPS` for VisualBERT's image test, else
            :data:`PERTURBATION_STEPS`).
        batch_size: questions per forward.
        keep_end: final real tokens always kept; None (default): :func:`keep_end_for` the model
            (1: ``[SEP]``, LXMERT; 2: the answer token and ``[SEP]``, VisualBERT, which refuses
            fewer).

    Returns:
        :class:`PerturbationCurve` (accuracy per step, its AUC, per question).
    """
    if not isinstance(inputs, dict):
        raise TypeError(f"inputs must be a dict of the model's keyword inputs, got {type(inputs).__name__}")
    keep_end = _keep_end(model, keep_end)
    if steps is None:
        steps = steps_for(model, modality)
    inputs = token_inputs(model, inputs)
    maps = torch.as_tensor(maps).detach()
    answers = None if answers is None else torch.as_tensor(answers).detach().long()
    B, _, _ = _check(inputs, maps, modality, answers, steps, keep_end)
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    maps = maps.cpu()
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            if answers is None:
                answers = torch.cat([logits_of(model(**{k: v[i : i + batch_size] for k, v in inputs.items()})).argmax(-1)
                                     for i in range(0, B, batch_size)]).cpu()
            preds = torch.zeros(B, len(steps), dtype=torch.long)
            kept = torch.zeros(B, len(steps), dtype=torch.long)
            for j, step in enumerate(steps):
                for i in range(0, B, batch_size):
                    rows = range(i, min(i + batch_size, B))
                    batch, n_kept = _perturbed_batch(inputs, maps, modality, step, positive, rows, keep_end)
                    preds[i : rows.stop, j] = logits_of(model(**batch)).argmax(-1).cpu()
                    kept[i : rows.stop, j] = torch.tensor(n_kept)
    finally:
        model.train(was_training)
    correct = preds == answers.cpu()[:, None]
    return PerturbationCurve(modality, positive, tuple(float(s) for s in steps), correct, kept, preds)


def perturbation_test(model, inputs: dict, method, modality: str, positive: bool = True, answers=None,
                      steps=None, batch_size: int = 256, keep_end: int | None = None,
                      **method_kwargs) -> PerturbationCurve:
    """:func:`perturbation_curve` with the maps of ``method(model, inputs, **method_kwargs)``.

    ``method`` returns :class:`vitlab.relevance.BimodalMaps` (``.image``, ``.text``), e.g.
    ``lxmert_relevance`` (which explains the predicted answer, as the reference does),
    ``lxmert_raw_attention``, ``lxmert_rollout``, ``lxmert_gradcam``, ``visualbert_relevance``.
    The maps are computed on the unperturbed input once; ``steps`` None follows the model
    (:func:`steps_for`).
    """
    keep_end = _keep_end(model, keep_end)
    result = method(model, inputs, **method_kwargs)
    maps = getattr(result, modality, None)
    if not isinstance(maps, torch.Tensor):
        raise TypeError(f"{getattr(method, '__name__', method)} returned {type(result).__name__} without a "
                        f"{modality!r} map (expected BimodalMaps)")
    return perturbation_curve(model, inputs, maps, modality, positive, answers, steps, batch_size, keep_end)


# --- what image tokens carry: attention received, value norms, hiding them ---------------------
def corner_tokens(grid: tuple[int, int]) -> list[int]:
    """Row-major indices of the four corner patches of a ``gh x gw`` grid."""
    gh, gw = grid
    if gh < 1 or gw < 1:
        raise ValueError(f"grid must be positive, got {grid}")
    return sorted({0, gw - 1, (gh - 1) * gw, gh * gw - 1})


def image_token_roles(model, inputs: dict) -> dict:
    """What each image token gives LXMERT's answer token, per cross-modality layer.

    One recorded forward (:func:`vitlab.record`, attention and values; no gradients) of an
    LXMERT-like model; for every cross-modality layer l, read in its text -> image
    co-attention (the one whose output reaches ``[CLS]``):

    - ``attention``: ``B x L x N``, the attention ``[CLS]`` pays each image token, heads
      averaged -- what raw attention and the co-attention part of relevance look at;
    - ``value_norm``: ``B x L x N``, the norm of the token's value vector (heads concatenated):
      how much it can move ``[CLS]`` per unit of attention;
    - ``weighted``: ``B x L x N``, ``mean_h A_h[CLS, j] * ||v_h,j||``, the size of what token j
      actually adds (Kobayashi et al. 2020, "Attention is not only a weight", before the
      output projection).

    A token that takes much attention but has a small value norm is a *sink*: attention parks
    there and little is read from it.
    """
    import vitlab

    inputs = token_inputs(model, inputs)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), vitlab.record(model, capture=("attention", "value")) as rec:
            model(**inputs)
        caps = rec.stream("lang->vision")
        if not caps:
            raise ValueError(f"{type(model).__name__} recorded no text -> image co-attention: use an LXMERT model")
        A = torch.stack([c.attention[:, :, 0] for c in caps], 1).float()        # B x L x heads x N
        V = torch.stack([c.value.norm(dim=-1) for c in caps], 1).float()        # B x L x heads x N
    finally:
        model.train(was_training)
    return {"attention": A.mean(2), "value_norm": V.pow(2).sum(2).sqrt(), "weighted": (A * V).mean(2)}


def hiding_effect(model, inputs: dict, hide, batch_size: int = 256) -> dict:
    """What deleting some image tokens does to the answer (tokens removed from the input, as in
    :func:`perturbation_curve`).

    Args:
        hide: ``B x N`` bool, the image tokens to delete from each question's input (at least
            one kept).

    Returns ``{"answer", "answer_after"`` (``B`` ids), ``"changed"`` (``B`` bool),
    ``"probability", "probability_after"`` (softmax probability of the unperturbed answer,
    ``B``)``}``.
    """
    inputs = token_inputs(model, inputs)
    hide = torch.as_tensor(hide, dtype=torch.bool)
    B, _, N = _check(inputs, torch.zeros(inputs["input_ids"].shape[0], hide.shape[-1]), "image", None, (0.0,))
    if tuple(hide.shape) != (B, N):
        raise ValueError(f"hide must be B x N = {B} x {N}, got {tuple(hide.shape)}")
    if bool(hide.all(1).any()):
        raise ValueError("hide removes every image token of some question: keep at least one")
    was_training = model.training
    model.eval()
    answer, after = torch.zeros(B, dtype=torch.long), torch.zeros(B, dtype=torch.long)
    p0, p1 = torch.zeros(B), torch.zeros(B)
    try:
        with torch.no_grad():
            for i in range(0, B, batch_size):
                sl = slice(i, min(i + batch_size, B))
                probs = logits_of(model(**{k: v[sl] for k, v in inputs.items()})).float().softmax(-1).cpu()
                answer[sl] = probs.argmax(-1)
                p0[sl] = probs.gather(1, answer[sl, None])[:, 0]
            counts = hide.sum(1)
            for n in counts.unique().tolist():                     # questions hiding as many tokens run together
                rows = torch.nonzero(counts == n)[:, 0]
                for i in range(0, len(rows), batch_size):
                    r = rows[i : i + batch_size]
                    keep = torch.stack([torch.nonzero(~hide[b])[:, 0] for b in r.tolist()]).to(inputs["input_ids"].device)
                    x = {}
                    for k, v in inputs.items():
                        v = v[r.to(v.device)]
                        if k in IMAGE_KEYS:
                            sel = keep.reshape(*keep.shape, *([1] * (v.ndim - 2))).expand(-1, -1, *v.shape[2:])
                            v = v.gather(1, sel)
                        x[k] = v
                    probs = logits_of(model(**x)).float().softmax(-1).cpu()
                    after[r] = probs.argmax(-1)
                    p1[r] = probs.gather(1, answer[r, None])[:, 0]
    finally:
        model.train(was_training)
    return {"answer": answer, "answer_after": after, "changed": answer != after, "probability": p0,
            "probability_after": p1}


# ---------------------------------------------------------------------------------------------
# Many maps at once: the four tests of every method (chapter 9), and two single-token tests
# ---------------------------------------------------------------------------------------------


#: The four tests of each model: (modality, positive).
PERTURBATION_TESTS: tuple[tuple[str, bool], ...] = (("image", True), ("image", False), ("text", True),
                                                    ("text", False))


def _kept_sets(maps: torch.Tensor, mask: torch.Tensor, modality: str, positive: bool, steps, keep_end: int):
    """Per question and step, the token indices kept (ascending), as :func:`bimodal_faithfulness
    .perturbation_curve` keeps them: image all tokens, text ``[CLS]``, the kept words, the last
    ``keep_end`` real tokens."""
    out = []
    for b in range(maps.shape[0]):
        if modality == "image":
            out.append([tuple(kept_indices(maps[b], s, positive).tolist()) for s in steps])
            continue
        n = int(mask[b].sum())
        rows = []
        for s in steps:
            inner = (kept_indices(maps[b, 1 : n - keep_end], s, positive) + 1).tolist()
            rows.append(tuple([0] + inner + list(range(n - keep_end, n))))
        out.append(rows)
    return out


def _run_kept(model, inputs: dict, modality: str, items: list, batch_size: int) -> list[int]:
    """The model's top-1 answer for each ``(question, kept token indices)`` of ``items``: the
    kept tokens alone, in their order (no kept image token: one blank token, as
    :mod:`vitlab.bimodal_faithfulness` does); one forward per batch of items that keep as many
    tokens."""
    from vitlab.inputs import batches

    keys = IMAGE_KEYS if modality == "image" else TEXT_KEYS
    preds = [0] * len(items)
    by_count: dict[int, list[int]] = {}
    for i, (_, kept) in enumerate(items):
        by_count.setdefault(len(kept), []).append(i)
    for count, idx in by_count.items():
        for s in batches(len(idx), batch_size):
            chosen = idx[s]
            rows = torch.as_tensor([items[i][0] for i in chosen])
            batch = {}
            for k, v in inputs.items():
                v = v[rows.to(v.device)]
                if k in keys and count == 0:
                    v = torch.zeros(len(chosen), 1, *v.shape[2:], dtype=v.dtype, device=v.device)
                    if k == "visual_attention_mask":
                        v += 1
                elif k in keys:
                    sel = torch.as_tensor([items[i][1] for i in chosen], device=v.device)
                    v = v.gather(1, sel.reshape(*sel.shape, *([1] * (v.ndim - 2))).expand(-1, -1, *v.shape[2:]))
                batch[k] = v
            for i, p in zip(chosen, logits_of(model(**batch)).argmax(-1).tolist()):
                preds[i] = int(p)
    return preds


def perturbation_grid(model, inputs: dict, maps: dict, answers, tests=PERTURBATION_TESTS, steps=None,
                      keep_end: int | None = None, batch_size: int = 256) -> dict:
    """The perturbation tests of Chefer et al. (2021, sec. 5) for many maps at once.

    ``maps``: method -> ``{"image": B x N, "text": B x T}`` (the maps of ``B`` questions);
    ``tests``: ``(modality, positive)`` pairs. Returns ``(method, modality, positive)`` ->
    :class:`vitlab.bimodal_faithfulness.PerturbationCurve`, each equal to
    ``perturbation_curve(model, inputs, maps[method][modality], modality, positive, answers,
    steps, keep_end=keep_end)`` (``steps`` the same for every test when given). Faster: an input that several curves perturb the same way
    (every curve's step 0; the same words kept from a short question by several steps or
    methods) runs once. Questions never share a forward's result, so a batch gives what its
    questions give one by one. ``steps``: None (default) follows the model and modality
    (:func:`vitlab.bimodal_faithfulness.steps_for`: :data:`VISUALBERT_IMAGE_STEPS` for
    VisualBERT's image tests, :data:`PERTURBATION_STEPS` otherwise); ``answers``: ``B`` true answer ids;
    ``keep_end``: None follows the model (:func:`vitlab.bimodal_faithfulness.keep_end_for`: 2 for
    VisualBERT, whose answer token before ``[SEP]`` stays, 1 otherwise). The model runs in eval mode without gradients and is left as it was.
    """
    if not isinstance(inputs, dict):
        raise TypeError(f"inputs must be a dict of the model's keyword inputs, got {type(inputs).__name__}")
    if not maps or not tests:
        raise ValueError("perturbation_grid needs at least one method's maps and one (modality, positive) test")
    inputs = token_inputs(model, inputs)
    keep_end = keep_end_for(model) if keep_end is None else keep_end
    answers = torch.as_tensor(answers).detach().long().cpu()
    given = steps
    steps = {}                                  # modality -> its fractions removed
    checked = {}
    for name, per in maps.items():
        for modality, positive in tests:
            if modality not in per:
                raise ValueError(f"maps[{name!r}] has no {modality!r} map (keys {tuple(per)})")
            m = torch.as_tensor(per[modality]).detach().cpu()
            s = steps_for(model, modality) if given is None else given
            _check(inputs, m, modality, answers, s, keep_end)
            steps[modality] = tuple(float(v) for v in s)
            checked[name, modality] = m
    mask = inputs["attention_mask"].cpu()
    B = mask.shape[0]
    kept = {(name, modality, positive): _kept_sets(checked[name, modality], mask, modality, positive, steps[modality],
                                                   keep_end)
            for name in maps for modality, positive in tests}
    was_training = model.training
    model.eval()
    out = {}
    try:
        with torch.no_grad():
            for modality in dict.fromkeys(m for m, _ in tests):
                slot: dict[tuple, int] = {}
                for key, sets in kept.items():
                    if key[1] == modality:
                        for b in range(B):
                            for k in sets[b]:
                                slot.setdefault((b, k), len(slot))
                preds = _run_kept(model, inputs, modality, list(slot), batch_size)
                for key, sets in kept.items():
                    if key[1] != modality:
                        continue
                    p = torch.tensor([[preds[slot[b, k]] for k in sets[b]] for b in range(B)], dtype=torch.long)
                    n_kept = torch.tensor([[len(k) for k in sets[b]] for b in range(B)], dtype=torch.long)
                    out[key] = PerturbationCurve(modality, key[2], steps[modality], p == answers[:, None], n_kept, p)
    finally:
        model.train(was_training)
    return {key: out[key] for key in kept}


def perturbation_rows(curves: dict, tests=PERTURBATION_TESTS, seed: int = 0) -> list[dict]:
    """One table row per method: each test's AUC with its 95% bootstrap interval over questions
    (:func:`vitlab.stats.mean_interval`), e.g. ``0.487 [0.465, 0.507]``."""
    from vitlab.stats import mean_interval

    rows = []
    for name in dict.fromkeys(k[0] for k in curves):
        row = {"method": name}
        for modality, positive in tests:
            c = curves[name, modality, positive]
            lo, hi = mean_interval(c.question_auc, seed=seed)[1:3]
            row[f"{modality} {'pos ↓' if positive else 'neg ↑'}"] = f"{c.auc:.3f} [{lo:.3f}, {hi:.3f}]"
        rows.append(row)
    return rows


class Verdict(NamedTuple):
    """The paper's ordering on one test (from :func:`perturbation_verdicts`).

    Attributes:
        modality, positive: the test.
        auc: the reference method's AUC; best_other / best_auc: the best other method and its AUC
            (lowest for positive, highest for negative).
        low, high: 95% bootstrap interval of the per-question AUC difference reference - best other.
        holds: the interval lies on the reference's side of 0 (below for positive, above for
            negative); ``tie``: it contains 0.
    """

    modality: str
    positive: bool
    auc: float
    best_other: str
    best_auc: float
    low: float
    high: float
    holds: bool
    tie: bool


def perturbation_verdicts(curves: dict, reference: str = "relevance", tests=PERTURBATION_TESTS,
                          seed: int = 0) -> list[Verdict]:
    """Per test: is ``reference`` better than every other method (lowest AUC on positive,
    highest on negative, as Chefer et al. 2021 claim for their relevance), beyond a 95%
    interval? Paired: the interval is the bootstrap of the per-question AUC difference between
    ``reference`` and the best of the others (:func:`vitlab.stats.paired_difference`)."""
    from vitlab.stats import paired_difference

    out = []
    for modality, positive in tests:
        ref = curves[reference, modality, positive]
        others = {k[0]: c for k, c in curves.items() if k[1:] == (modality, positive) and k[0] != reference}
        if not others:
            raise ValueError(f"no other method than {reference!r} to compare on {modality}, "
                             f"{'positive' if positive else 'negative'}")
        best = (min if positive else max)(others, key=lambda m: others[m].auc)
        lo, hi = paired_difference(ref.question_auc, others[best].question_auc, seed=seed)[1:3]
        holds = hi < 0 if positive else lo > 0
        out.append(Verdict(modality, positive, ref.auc, best, others[best].auc, lo, hi, holds, lo <= 0 <= hi))
    return out


def text_occlusion(model, x: torch.Tensor, questions, batch_size: int = 100, features=None) -> torch.Tensor:
    """How much each word of each question matters to the answer: the drop of the answer's
    logit when that word is replaced by ``[UNK]`` (a faithfulness test for text maps).

    ``model``: ``shapes-lxmert``; ``x``, ``questions`` as :func:`lxmert_method_maps`. The
    answer is the model's own on the intact question. Returns ``Q x L`` (questions padded to
    one length ``L``, token positions as in the text maps): NaN at ``[CLS]``, ``[SEP]`` and
    padding. One forward per batch and word position.
    """
    from vitlab.inputs import batches
    from vitlab.record import eval_mode
    from vitlab.relevance.lxmert import encoded_questions, lxmert_scene_features

    tok = model.tokenizer
    scenes = x.shape[0] if features is None else features[0].shape[0]
    ids, mask, scene = encoded_questions(model, scenes, questions, "text_occlusion")
    feats, boxes = lxmert_scene_features(model, x, batch_size) if features is None else features
    word = (mask == 1) & (ids != tok.cls_id) & (ids != tok.sep_id)
    out = torch.full(ids.shape, float("nan"))
    with torch.no_grad(), eval_mode(model):
        for s in batches(len(questions), batch_size):
            ib, mb = ids[s], mask[s]
            xb = dict(visual_feats=feats[scene[s]], visual_pos=boxes[scene[s]])
            logits = model(input_ids=ib, attention_mask=mb, **xb).question_answering_score
            answer = logits.argmax(-1, keepdim=True)
            base = logits.gather(1, answer)[:, 0]
            for pos in torch.nonzero(word[s].any(0)).flatten().tolist():
                rows = word[s][:, pos]
                ib2 = ib.clone()
                ib2[rows, pos] = tok.unk_id
                occluded = model(input_ids=ib2[rows], attention_mask=mb[rows], **{k: v[rows] for k, v in xb.items()})
                drop = base[rows] - occluded.question_answering_score.gather(1, answer[rows])[:, 0]
                out[torch.arange(s.start, s.stop)[rows], pos] = drop.float().cpu()
    return out


def lxmert_answers_without(model, x: torch.Tensor, questions, drop, batch_size: int = 100,
                           features=None) -> torch.Tensor:
    """``shapes-lxmert``'s answers when some image tokens are hidden from it: ``Q`` answer ids.

    ``drop``: ``Q x N`` bool, the image tokens (patches) question q may not see; they are
    masked out of every attention to the image (``visual_attention_mask`` = 0), as if they
    were not there. A faithfulness test for image maps: hide the patch a map calls most
    relevant and see whether the answer changes. ``x``, ``questions`` as
    :func:`lxmert_method_maps`.
    """
    from vitlab.inputs import batches
    from vitlab.record import eval_mode
    from vitlab.relevance.lxmert import encoded_questions, lxmert_scene_features

    drop = torch.as_tensor(drop, dtype=torch.bool)
    feats, boxes = lxmert_scene_features(model, x, batch_size) if features is None else features
    if drop.shape != (len(questions), feats.shape[1]):
        raise ValueError(f"drop must be Q x N = {len(questions)} x {feats.shape[1]} (questions x image tokens), "
                         f"got {tuple(drop.shape)}")
    ids, mask, scene = encoded_questions(model, feats.shape[0], questions, "lxmert_answers_without")
    out = []
    with torch.no_grad(), eval_mode(model):
        for s in batches(len(questions), batch_size):
            logits = model(input_ids=ids[s], attention_mask=mask[s], visual_feats=feats[scene[s]],
                           visual_pos=boxes[scene[s]], visual_attention_mask=(~drop[s]).to(feats.dtype))
            out.append(logits.question_answering_score.argmax(-1))
    return torch.cat(out)


__getattr__ = replaced_names("vitlab.bimodal_faithfulness", {"bootstrap_interval": "vitlab.stats.mean_interval"})
