"""Relevance for CLIP's image-text score, and its baselines: Hugging Face ``CLIPModel`` (chapter 11).

A CLIP (Radford et al. 2021) scores image b with text b as
``S_b = logit_scale.exp() * cos(image_embeds_b, text_embeds_b)`` -- the diagonal entry
``logits_per_image[b, b]``. Every method here explains that score, per pair: row b of a batch is
the pair (image b, text b), and since the two towers never attend to each other and every other
layer works per sample (eval mode), each pair's maps are those of the pair alone (the
off-diagonal entries of ``logits_per_image``, image b with text c, are never differentiated). The
inputs are the model's own: ``inputs = dict(pixel_values=..., input_ids=..., attention_mask=...)``
(:data:`CLIP_INPUTS`), checked before the forward (:func:`check_clip_inputs`).

Every method returns :class:`ClipMaps`: ``image`` (``B x gh x gw``, the CLS token's row over the
patches on the patch grid) and ``text`` (``B x T``, the end-of-text token's row over the tokens),
and the explained scores.

**The text map.** The text tower pools at the end-of-text token (:func:`end_of_text`, Hugging
Face's rule exactly), so the text map is that token's row. Entry t is kept for the caption's
tokens ``0 < t < eos``: the start token (position 0, which every CLIP tokenizer puts first, and
which the causal mask makes every token attend to) and the end-of-text token's entry for itself
are set to 0, as in Chefer et al.'s CLIP notebook (``R_text[eos, 1:eos]``); so are every padding
position (``attention_mask`` 0) and everything after the end-of-text token. Maps are not
rescaled to sum 1 (the notebook does, for display). Padding never changes a map: with the causal
mask no token up to the end-of-text token sees a later one, so a caption padded to any length
gives the same map.

Methods, each ``(model, inputs, target=None, ...)``: ``target`` None is the pair's score, the
only target they explain (:func:`check_pair_target`). One recorded forward -- :func:`vitlab.record`,
both towers -- and at most one ``torch.autograd.grad`` to the attention tensors for the whole
batch; a batch whose recording would exceed the attention methods' memory budget
(``vitlab.inputs.MEMORY_BUDGET``) runs in chunks of pairs, with the same maps (:func:`clip_in_chunks`):

- :func:`clip_relevance`: Chefer, Gur & Wolf (ICCV 2021) on both towers;
- :func:`clip_raw_attention`: the last layer's attention, heads averaged;
- :func:`clip_rollout`: attention rollout (Abnar & Zuidema 2020) as :mod:`vitlab.rollout` defines it;
- :func:`clip_gradcam`: GradCAM on the last layer's attention, as the paper's baseline
  (:func:`vitlab.relevance.attention_matrix_gradcam`).

Grad-ECLIP (:mod:`vitlab.grad_eclip`), LeGrad (:mod:`vitlab.legrad`) and the decomposition of the
image embedding (:mod:`vitlab.clip_decomposition`) read the same inputs through the same checks
(:func:`check_clip_inputs`, :func:`clip_forward`).
"""
from __future__ import annotations

import numbers
from collections.abc import Mapping
from dataclasses import dataclass
from typing import NamedTuple

import torch

from vitlab.inputs import check_images, graph_inputs, require_gradients
from vitlab.record import require_materialized
from vitlab.relevance.bimodal import _rollout, attention_matrix_gradcam
from vitlab.relevance.engine import propagate, read_rows, self_attention_events

__all__ = [
    "CLIP_INPUTS", "ClipMaps", "check_clip_images", "check_clip_inputs", "check_clip_texts", "check_pair_target",
    "clip_chunk_size", "clip_forward", "clip_gradcam", "clip_in_chunks", "clip_raw_attention", "clip_relevance",
    "clip_rollout", "end_of_text", "start_blocks", "text_entries",
]

#: What the CLIP methods take in ``inputs``: the images (normalised as the model expects, e.g.
#: :func:`vitlab.preprocess`), the tokenised texts, and optionally their padding mask.
CLIP_INPUTS = ("pixel_values", "input_ids", "attention_mask")


class ClipMaps(NamedTuple):
    """What the CLIP methods return, per pair (image b, text b) of the batch.

    Attributes:
        image: ``B x gh x gw``, the relevance of each patch for the pair's score (the CLS row).
        text: ``B x T``, the relevance of each text token (the end-of-text row; 0 at the start
            token, at the end-of-text token itself, after it and on padding); None for a method
            that explains the image only.
        score: ``B``, the explained score of each pair (``logits_per_image[b, b]``; the cosine
            for the methods whose papers differentiate the cosine: Grad-ECLIP, LeGrad).
    """

    image: torch.Tensor
    text: torch.Tensor | None
    score: torch.Tensor


# --- checks -------------------------------------------------------------------------------------------
def clip_towers(model, method: str):
    """``(vision tower, text tower)`` of a Hugging Face CLIPModel, or TypeError."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    vision, text = getattr(model, "vision_model", None), getattr(model, "text_model", None)
    if not isinstance(model, torch.nn.Module) or model_type != "clip" or vision is None or text is None:
        raise TypeError(f"{method} explains a Hugging Face CLIPModel (both towers: vision_model and text_model), "
                        f"got {type(model).__name__}" + (f" (model_type {model_type!r})" if model_type else ""))
    return vision, text


def _eos_id(model) -> int | None:
    _, text = clip_towers(model, "end_of_text")
    eos = getattr(text, "eos_token_id", None)
    if eos is None:
        eos = getattr(model.config.text_config, "eos_token_id", None)
    return None if eos is None else int(eos)


def end_of_text(model, input_ids: torch.Tensor) -> torch.Tensor:
    """The position the text tower pools at, per text (``B``, int64), by Hugging Face's own rule
    (``CLIPTextTransformer`` / ``CLIPTextModel``): with the legacy ``eos_token_id == 2`` of the
    original OpenAI configurations, ``input_ids.argmax(-1)`` (the end-of-text id is the largest
    of that vocabulary: the first largest id); otherwise the first position holding
    ``eos_token_id``."""
    eos = _eos_id(model)
    ids = input_ids.to(torch.int)
    if eos == 2:
        return ids.argmax(dim=-1).long()
    return (ids == eos).int().argmax(dim=-1).long()


def _int_tensor(value, label: str, method: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{method}: {label} must be a tensor, got {type(value).__name__}")
    if value.is_floating_point() or value.is_complex() or value.dtype == torch.bool:
        raise TypeError(f"{method}: {label} must hold integers, got dtype {value.dtype}")
    return value


def check_clip_images(model, x, method: str) -> None:
    """Refuse, before any forward, images that are not a finite, non-empty float
    ``B x C x H x W`` batch of the CLIP model's channels and size."""
    clip_towers(model, method)
    require_materialized(model, method.split(":")[0])
    check_images(x, method)
    vcfg = model.config.vision_config
    size, channels = int(vcfg.image_size), int(vcfg.num_channels)
    if x.shape[1] != channels or tuple(x.shape[-2:]) != (size, size):
        raise ValueError(f"{method}: the images have shape {tuple(x.shape)}; this model takes "
                         f"B x {channels} x {size} x {size} images (vitlab.preprocess(image, model) makes them)")


def check_clip_texts(model, input_ids, attention_mask, method: str, rows: int | None = None,
                     key=lambda k: k) -> None:
    """Refuse, before any forward, texts the CLIP's text tower cannot read as meant: ``input_ids``
    that are not ``B x T`` integers (``T >= 1``, ``B = rows`` where given: one text per image) within
    the vocabulary and the position embeddings; an ``attention_mask`` of another shape, holding
    values other than 0 and 1, or padding before a token; a text without its end-of-text token
    (where the model pools by ``eos_token_id``: Hugging Face would pool it at position 0, the
    start token) or whose end-of-text token is padding. ``key(name)`` names an argument in the
    messages (``inputs['input_ids']`` for a dict of inputs)."""
    clip_towers(model, method)
    require_materialized(model, method)
    ids = _int_tensor(input_ids, key("input_ids"), method)
    if ids.ndim != 2 or ids.shape[1] == 0 or ids.shape[0] == 0:
        raise ValueError(f"{method}: {key('input_ids')} must be B x T token ids with T >= 1 (one text per row), "
                         f"got shape {tuple(ids.shape)}")
    if rows is not None and ids.shape[0] != rows:
        raise ValueError(f"{method}: {rows} images but {ids.shape[0]} texts ({key('input_ids')} "
                         f"{tuple(ids.shape)}); row b is the pair image b / text b, so give one text per image")
    tcfg = model.config.text_config
    vocab, positions = int(tcfg.vocab_size), int(tcfg.max_position_embeddings)
    bad = (ids < 0) | (ids >= vocab)
    if bool(bad.any()):
        b, t = (int(i) for i in bad.nonzero()[0])
        raise ValueError(f"{method}: {key('input_ids')} holds token id {int(ids[b, t])} (text {b}, position {t}), "
                         f"outside the model's vocabulary 0 .. {vocab - 1}; tokenise with the model's own tokenizer")
    if ids.shape[1] > positions:
        raise ValueError(f"{method}: the texts are {ids.shape[1]} tokens long, more than the model's {positions} "
                         "positions (max_position_embeddings); pad to the longest text only, or shorten them")
    mask = attention_mask
    if mask is not None:
        if not isinstance(mask, torch.Tensor):
            raise TypeError(f"{method}: {key('attention_mask')} must be a tensor, got {type(mask).__name__}")
        if tuple(mask.shape) != tuple(ids.shape):
            raise ValueError(f"{method}: {key('attention_mask')} has shape {tuple(mask.shape)}, but input_ids has "
                             f"{tuple(ids.shape)}: one entry per token (1 token, 0 padding)")
        if mask.is_complex() or not bool(((mask == 0) | (mask == 1)).all()):
            raise ValueError(f"{method}: {key('attention_mask')} must hold 0 (padding) and 1 (token) only")
        if bool((mask[:, 1:] > mask[:, :-1]).any()):
            raise ValueError(f"{method}: {key('attention_mask')} has padding before a token; pad the texts at the "
                             "end, as the tokenizers do")
    eos_id = _eos_id(model)
    eos = end_of_text(model, ids)
    if eos_id != 2:
        found = (ids == eos_id).any(dim=1)
        if not bool(found.all()):
            b = int((~found).nonzero()[0])
            raise ValueError(f"{method}: text {b} holds no end-of-text token (id {eos_id}, the model's eos_token_id), "
                             "where the text tower pools; tokenise with the model's own tokenizer")
    if mask is not None:
        at_eos = mask.gather(1, eos[:, None].to(mask.device))[:, 0]
        if bool((at_eos == 0).any()):
            b = int((at_eos == 0).nonzero()[0])
            raise ValueError(f"{method}: the end-of-text token of text {b} (position {int(eos[b])}) is padding in "
                             f"{key('attention_mask')}; the mask must cover every token up to and including it")


def check_clip_inputs(model, inputs, method: str) -> tuple[dict, int]:
    """``inputs`` as a dict the model's forward takes, and the batch size -- or an error that says
    what is wrong, raised before any forward.

    Refused: a model that is not a Hugging Face ``CLIPModel``; keys other than
    :data:`CLIP_INPUTS`; images that are not a finite, non-empty float ``B x C x H x W`` batch of
    the model's size and channels; ``input_ids`` that are not ``B x T`` integers (``T >= 1``) within
    the vocabulary and the position embeddings, or whose batch differs from the images' (row b
    is the pair image b / text b); an ``attention_mask`` of another shape, holding values other
    than 0 and 1, or padding before a token; a text without its end-of-text token (where the
    model pools by ``eos_token_id``) or whose end-of-text token is padding.
    """
    vision, _ = clip_towers(model, method)
    if not isinstance(inputs, Mapping):
        raise TypeError(f"{method}: inputs must be a dict of tensors with keys {CLIP_INPUTS} "
                        f"(attention_mask optional), got {type(inputs).__name__}")
    unknown = [k for k in inputs if k not in CLIP_INPUTS]
    if unknown:
        raise ValueError(f"{method}: unexpected input key{'s' if len(unknown) > 1 else ''} "
                         f"{', '.join(map(repr, unknown))}; the CLIP methods take {CLIP_INPUTS}")
    missing = [k for k in CLIP_INPUTS[:2] if k not in inputs]
    if missing:
        raise ValueError(f"{method}: inputs need 'pixel_values' (the images) and 'input_ids' (the tokenised texts, "
                         f"one per image); missing {', '.join(map(repr, missing))}")
    x = inputs["pixel_values"]
    check_clip_images(model, x, f"{method}: inputs['pixel_values']")
    check_clip_texts(model, inputs["input_ids"], inputs.get("attention_mask"), method, rows=int(x.shape[0]),
                     key=lambda k: f"inputs[{k!r}]")
    B = int(x.shape[0])
    return dict(inputs), B


def text_entries(model, inputs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """``(eos, keep)``: the end-of-text position of each text (``B``) and the ``B x T`` boolean mask
    of the entries a text map keeps: ``0 < t < eos`` and not padding."""
    ids = inputs["input_ids"]
    eos = end_of_text(model, ids).to(ids.device)
    t = torch.arange(ids.shape[1], device=ids.device)
    keep = (t > 0) & (t < eos[:, None])
    mask = inputs.get("attention_mask")
    if mask is not None:
        keep = keep & (mask != 0)
    return eos, keep


# --- the recorded forward -------------------------------------------------------------------------------
@dataclass
class ClipForward:
    """One recorded forward of a CLIPModel on pairs (:func:`clip_forward`).

    Attributes:
        rec: the :class:`vitlab.Recording` (streams ``"image"`` and ``"text"``; ``rec.layout``
            the image tower's token layout).
        output: the model's ``CLIPOutput``.
        score: ``B``, ``logits_per_image[b, b]`` (graph-attached with ``grad``).
        cosine: ``B``, ``cos(image_embeds_b, text_embeds_b)`` (the score over ``logit_scale.exp()``).
        eos: ``B``, the end-of-text position of each text.
        keep: ``B x T``, the text entries a map keeps (:func:`text_entries`).
        valid: ``B x T``, the tokens up to the end-of-text token that are not padding.
    """

    rec: object
    output: object
    score: torch.Tensor
    cosine: torch.Tensor
    eos: torch.Tensor
    keep: torch.Tensor
    valid: torch.Tensor

    def image_row(self, rows: torch.Tensor) -> torch.Tensor:
        """``B x N`` over the image tower's tokens -> ``B x gh x gw`` (the patches, CLS left out)."""
        return self.rec.layout.patches_to_grid(rows)

    def text_row(self, rows: torch.Tensor) -> torch.Tensor:
        """``B x T`` over the text tokens -> the text map: 0 outside :attr:`keep`."""
        return rows * self.keep.to(rows.dtype)

    def gradients(self, of: torch.Tensor, wrt) -> tuple:
        """``torch.autograd.grad(of.sum(), wrt)`` -- ``of`` being :attr:`score` or :attr:`cosine`
        (one per pair, so the sum's gradient is each pair's own) -- with gradients switched on, so
        that a caller's ``torch.no_grad()`` cannot cut the sum off the graph (the forward itself
        runs under ``torch.enable_grad()``, :func:`clip_forward`)."""
        with torch.enable_grad():
            return torch.autograd.grad(of.sum(), list(wrt))


def clip_forward(model, inputs, method: str, grad: bool, capture=("attention",)) -> ClipForward:
    """One forward inside :func:`vitlab.record` (both towers, eval mode, the fields ``capture``) of
    ``inputs`` that passed :func:`check_clip_inputs` (the caller checks them, once); with ``grad``
    the recorded tensors stay in the graph. Works under a caller's ``torch.no_grad()`` (gradients
    are switched on inside)."""
    from vitlab.record import record

    kwargs = dict(inputs)
    if grad:
        require_gradients(method)
        kwargs = graph_inputs(kwargs)
    eos, keep = text_entries(model, kwargs)
    t = torch.arange(kwargs["input_ids"].shape[1], device=eos.device)
    valid = t <= eos[:, None]
    if "attention_mask" in kwargs:
        valid = valid & (kwargs["attention_mask"] != 0)
    context = torch.enable_grad() if grad else torch.no_grad()
    with context, record(model, detach=not grad, eval_mode=True, capture=capture) as rec:
        out = model(**kwargs)
        score = out.logits_per_image.diagonal()
        cosine = (out.image_embeds * out.text_embeds).sum(dim=-1)
    if rec.layout is None:
        raise RuntimeError(f"{method}: could not read the image tower's patch grid from its patch embedding's output")
    return ClipForward(rec, out, score, cosine, eos, keep, valid)


def start_index(start_block, depth: int, tower: str, method: str) -> int:
    if isinstance(start_block, bool) or not isinstance(start_block, numbers.Integral):
        raise TypeError(f"{method}: start_block must be an int (or a pair (image, text) of ints), got {start_block!r}")
    if not -depth <= int(start_block) < depth:
        raise ValueError(f"{method}: start_block {start_block} is outside the {tower} tower's {depth} blocks "
                         f"(0 .. {depth - 1}, or -{depth} .. -1 from the end)")
    return int(start_block) % depth


def start_blocks(start_block, depths: tuple[int, int], method: str, *, whole_tower: bool = False) -> tuple[int, int]:
    """``start_block`` (an int for both towers, or ``(image, text)``) as two non-negative block indices.

    With ``whole_tower``, a negative start further back than a tower is deep means all of its
    blocks (block 0), e.g. Grad-ECLIP's default text start -8 on a tower of four blocks; without
    it, that is a ``ValueError`` as any index outside the tower."""
    if isinstance(start_block, tuple):
        if len(start_block) != 2:
            raise ValueError(f"{method}: start_block as a tuple is (image, text), got {start_block!r}")
        pair = start_block
    else:
        pair = (start_block, start_block)
    out = []
    for start, depth, tower in zip(pair, depths, ("image", "text")):
        if (whole_tower and isinstance(start, numbers.Integral) and not isinstance(start, bool)
                and start < -depth):
            start = 0
        out.append(start_index(start, depth, tower, method))
    return out[0], out[1]


def tower_depths(model) -> tuple[int, int]:
    vision, text = clip_towers(model, "clip")
    return len(vision.encoder.layers), len(text.encoder.layers)


def check_pair_target(target, method: str) -> None:
    """The CLIP methods explain each pair's own score (image b with text b): ``target`` must be
    None (the only target they take), anything else is a ``ValueError``."""
    if target is not None:
        raise ValueError(f"{method}: CLIP maps explain the image-text pair's score (image b with text b), so "
                         f"target must be None, got {target!r}; to explain image b against another text, put that "
                         "text in row b of input_ids")


def clip_chunk_size(model, inputs: dict, gradients: bool = False) -> int:
    """How many pairs of ``inputs`` one forward may take within the attention methods' memory
    budget (``vitlab.inputs.MEMORY_BUDGET``, at least 1): one pair's recording holds, per
    tower, the sum over blocks of ``heads x N x N`` entries (``N`` the image tower's tokens, the
    texts' padded length), of the images' dtype; twice that with ``gradients``."""
    from vitlab import inputs as _inputs_module

    vision, text = clip_towers(model, "clip_chunk_size")
    x = inputs["pixel_values"]
    image_tokens = int(vision.embeddings.num_positions)
    text_tokens = int(inputs["input_ids"].shape[1])
    per_pair = 0
    for tower, n in ((vision, image_tokens), (text, text_tokens)):
        heads = sum(int(getattr(layer.self_attn, "num_heads", tower.config.num_attention_heads))
                    for layer in tower.encoder.layers)
        per_pair += heads * n * n
    per_pair *= x.element_size() * (2 if gradients else 1)
    return max(1, int(_inputs_module.MEMORY_BUDGET) // max(1, per_pair))


def clip_in_chunks(compute, model, inputs: dict, gradients: bool = False) -> ClipMaps:
    """``compute(inputs)`` over chunks of :func:`clip_chunk_size` pairs (every entry of ``inputs``
    split along the batch), the :class:`ClipMaps` concatenated; one call on the whole batch when it
    fits in one forward. The pairs are independent, so the maps are those of one call. A method
    checks ``inputs`` once (:func:`check_clip_inputs`), then hands its unchecked computation to
    this: nothing is validated again per chunk."""
    B = int(inputs["pixel_values"].shape[0])
    size = clip_chunk_size(model, inputs, gradients)
    if size >= B:
        return compute(inputs)
    parts = [compute({k: v[i:i + size] for k, v in inputs.items()}) for i in range(0, B, size)]
    text = None if parts[0].text is None else torch.cat([p.text for p in parts])
    return ClipMaps(torch.cat([p.image for p in parts]), text, torch.cat([p.score for p in parts]))


# --- Chefer et al. ---------------------------------------------------------------------------------------
def clip_relevance(model, inputs, target=None, *, start_block=0) -> ClipMaps:
    """Generic attention relevance of CLIP's score on both towers (Chefer, Gur & Wolf, ICCV 2021,
    "Generic Attention-model Explainability for Interpreting Bi-Modal and Encoder-Decoder
    Transformers", eq. 1, 5, 6; their CLIP notebook, hila-chefer/Transformer-MM-Explainability
    ``CLIP_explainability.ipynb``).

    Target: the pair's score ``S_b = logits_per_image[b, b]``. In each tower separately (the
    towers never attend to each other, so each is the paper's single-modality self-attention
    case): eq. 1 ``R = I`` over its tokens; then for every block l from ``start_block`` on, eq. 5
    ``Abar_l = E_h[(dS/dA_l ⊙ A_l)^+]`` (per head, the attention weighted by its gradient, negatives
    clamped, then the mean over heads) and eq. 6 ``R <- R + Abar_l · R``
    (:func:`vitlab.relevance.engine.propagate`). The image map is ``R[CLS, patches]`` on the patch
    grid; the text map is ``R[eos, t]`` for the caption's tokens ``0 < t < eos`` (see the module
    docstring: start token, the end-of-text token itself and padding are 0; not rescaled).

    Why a start block. The paper's rule walks every block (``start_block=0``, the default here,
    and what the chapter uses). The reference notebook's default is the *last* block only
    (``start_layer = -1``), a choice for display: its issue #8 reports noisy maps on ViT-B/16
    when all blocks are used, which is the signature of high-norm "artifact" tokens that swallow
    the attention of the middle blocks (Darcet et al., ICLR 2024, "Vision Transformers Need
    Registers"), so that rows through them spread relevance over background patches. With the
    last block alone, ``R = I + Abar_L`` and the map is the gradient-weighted attention of the
    CLS token in the last block -- no context from earlier blocks at all. The chapter's
    ``shapes-clip`` shows no artifact tokens and its objects are mixed over several blocks, so
    it uses every block; ``start_block=-1`` gives the notebook's default, and an int or an
    ``(image, text)`` pair chooses per tower.

    One recorded forward and one ``torch.autograd.grad`` (to the attention tensors from the start
    block on, both towers) for the whole batch -- in chunks of pairs when the batch's recording
    would exceed the memory budget (:func:`clip_in_chunks`; the same maps); no parameter's
    ``.grad`` is touched.

    Args:
        model: a Hugging Face ``CLIPModel`` (run in eval mode; left exactly as it was).
        inputs: ``dict(pixel_values=..., input_ids=..., attention_mask=...)``, one text per image
            (:func:`check_clip_inputs`).
        target: None, the pair's score (the only target; anything else is a ``ValueError``).
        start_block: the first block of each tower the rule walks: an int for both towers
            (negative counts from the end) or ``(image, text)``.

    Returns:
        :class:`ClipMaps` (``score``: ``logits_per_image[b, b]``).
    """
    method = "clip_relevance"
    check_pair_target(target, method)
    inputs, _ = check_clip_inputs(model, inputs, method)
    si, st = start_blocks(start_block, tower_depths(model), method)

    def compute(inputs):
        f = clip_forward(model, inputs, method, grad=True)
        image_caps, text_caps = f.rec.stream("image")[si:], f.rec.stream("text")[st:]
        used = image_caps + text_caps
        grads = f.gradients(f.score, [c.attention for c in used])
        gi, gt = grads[:len(image_caps)], grads[len(image_caps):]
        Ni, Nt = image_caps[0].attention.shape[-1], text_caps[0].attention.shape[-1]
        Ri = propagate(self_attention_events("image", [c.attention.detach() for c in image_caps], gi), {"image": Ni})
        Rt = propagate(self_attention_events("text", [c.attention.detach() for c in text_caps], gt), {"text": Nt})
        image = f.image_row(Ri["image", "image"][:, 0, :])
        text = f.text_row(read_rows(Rt["text", "text"], f.eos))
        return ClipMaps(image, text, f.score.detach())
    return clip_in_chunks(compute, model, inputs, gradients=True)


# --- baselines ----------------------------------------------------------------------------------------------
def clip_raw_attention(model, inputs, target=None) -> ClipMaps:
    """Raw attention baseline (as in Chefer et al. 2021): each tower's last block, heads averaged,
    ``mean_h A_L[h, CLS, patches]`` on the grid and ``mean_h A_L[h, eos, t]`` over the caption's
    tokens (the text map's entries as in :func:`clip_relevance`). One forward without gradients;
    ``target`` and chunking as in :func:`clip_relevance`.
    """
    method = "clip_raw_attention"
    check_pair_target(target, method)
    inputs, _ = check_clip_inputs(model, inputs, method)

    def compute(inputs):
        f = clip_forward(model, inputs, method, grad=False)
        Ai, At = f.rec.stream("image")[-1].attention.mean(dim=1), f.rec.stream("text")[-1].attention.mean(dim=1)
        return ClipMaps(f.image_row(Ai[:, 0, :]), f.text_row(read_rows(At, f.eos)), f.score)
    return clip_in_chunks(compute, model, inputs)


def _max_normalize(rows: torch.Tensor) -> torch.Tensor:
    from vitlab.rollout import max_normalize

    return max_normalize(rows)


def clip_rollout(model, inputs, target=None) -> ClipMaps:
    """Attention rollout baseline (Abnar & Zuidema, ACL 2020), as :func:`vitlab.rollout.rollout`
    defines it, on each tower: per block ``a = rownorm((mean_h A + I) / 2)``, ``R = a_L ... a_1``;
    the image map is ``R[CLS, patches]`` and the text map ``R[eos, t]`` over the caption's tokens
    (entries as in :func:`clip_relevance`), each divided by its maximum (all zero only when no
    entry is positive). One forward without gradients; ``target`` and chunking as in
    :func:`clip_relevance`.
    """
    method = "clip_rollout"
    check_pair_target(target, method)
    inputs, _ = check_clip_inputs(model, inputs, method)

    def compute(inputs):
        f = clip_forward(model, inputs, method, grad=False)
        maps = []
        for stream in ("image", "text"):
            cams = [c.attention.mean(dim=1) for c in f.rec.stream(stream)]
            maps.append(_rollout(cams, cams[0].shape[-1], cams[0]))
        image = _max_normalize(f.image_row(maps[0][:, 0, :]))
        text = _max_normalize(f.text_row(read_rows(maps[1], f.eos)))
        return ClipMaps(image, text, f.score)
    return clip_in_chunks(compute, model, inputs)


def clip_gradcam(model, inputs, target=None) -> ClipMaps:
    """GradCAM on each tower's last attention map, the baseline of Chefer et al. (2021) as their
    bi-modal code computes it (:func:`vitlab.relevance.attention_matrix_gradcam`): per head
    ``w_h`` = the gradient of the pair's score averaged over the whole map, then
    ``(mean_h w_h A_h)^+``, read at the CLS row (image, patches on the grid) and the end-of-text
    row (text, entries as in :func:`clip_relevance`). The text average runs over the pairs of
    tokens up to the end-of-text token that are not padding, so padding cannot change the weights.
    One forward and one backward (to the two last attention maps only); ``target`` and chunking
    as in :func:`clip_relevance`.
    """
    method = "clip_gradcam"
    check_pair_target(target, method)
    inputs, _ = check_clip_inputs(model, inputs, method)

    def compute(inputs):
        f = clip_forward(model, inputs, method, grad=True)
        last_i, last_t = f.rec.stream("image")[-1], f.rec.stream("text")[-1]
        gi, gt = f.gradients(f.score, [last_i.attention, last_t.attention])
        image = attention_matrix_gradcam(last_i.attention.detach(), gi)
        v = f.valid.to(gt.dtype)
        entries = (v[:, :, None] * v[:, None, :])[:, None]  # B x 1 x T x T
        text = attention_matrix_gradcam(last_t.attention.detach(), gt, entries)
        return ClipMaps(f.image_row(image[:, 0, :]), f.text_row(read_rows(text, f.eos)), f.score.detach())
    return clip_in_chunks(compute, model, inputs, gradients=True)
