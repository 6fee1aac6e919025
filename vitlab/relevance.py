"""Generic attention relevance: Chefer, Gur & Wolf, ICCV 2021, "Generic Attention-model
Explainability for Interpreting Bi-Modal and Encoder-Decoder Transformers".

One engine for every mix of attention: self-attention within a modality (a ViT's blocks,
LXMERT's language and vision layers, DETR's encoder and decoder self-attention), co-attention
between two modalities (LXMERT's cross-modality layers) and encoder-decoder cross-attention
(DETR's decoder queries attending to the image tokens). Tokens belong to named modalities
(``"text"``, ``"image"``, ``"query"``, ...). For every ordered pair of modalities (s, q) it
keeps a relevance matrix ``R^{sq}`` (``... x Ns x Nq``): row i says how relevant each token
of q is to token i of s.

- eq. 1-2: ``R^{ss} = I`` for every modality, ``R^{sq} = 0`` across modalities.
- eq. 5: every attention event gives ``Abar = E_h[(grad_A ⊙ A)^+]`` -- the attention
  weighted by the gradient of the explained score, negatives clamped per head, then averaged
  over heads (:func:`head_averaged_relevance`).
- eq. 6-7, self-attention among the tokens of s: ``R^{ss} += Abar · R^{ss}`` and, for every
  other modality q, ``R^{sq} += Abar · R^{sq}`` (:func:`self_attention_rule`).
- eq. 8-9: ``Rbar^{xx} = rownorm(R^{xx} - I) + I`` (:func:`normalized_self_relevance`).
- eq. 10-11, tokens of s attending to tokens of q (``Abar``: ``Ns x Nq``):
  ``R^{sq} += (Rbar^{ss})^T · Abar · Rbar^{qq}`` and ``R^{ss} += Abar · R^{qs}``
  (:func:`bimodal_rule`).

:func:`propagate` applies these to an ordered list of :class:`AttentionEvent` s (attention
and gradient tensors, as :func:`vitlab.record` captures them; nothing here hooks or runs a
model) and returns :class:`Relevances`, whose :meth:`Relevances.rows` reads the explanation:
a ViT's ``R^{ss}[CLS]``, LXMERT's ``R^{ti}[CLS]`` (image) and ``R^{tt}[CLS]`` (text, CLS =
first text token), DETR's ``R^{qi}[j]`` for each detected query j. A ViT is the engine with
one modality: :func:`relevance_matrix` is :func:`propagate` over its self-attention events.

Event orders. LXMERT (CLS = text token 0): each language layer ``self text``, each vision
layer ``self image``, then per cross-modality layer the step ``(text <- image, image <- text)``
(one attention module called twice) followed by ``self text`` and ``self image``. DETR: each
encoder layer ``self image``, then per decoder layer ``self query`` and ``query <- image``.
A ViT: one ``self`` event per block.

Choices where the paper leaves room (and where its reference code, hila-chefer/
Transformer-MM-Explainability, ``lxmert/.../ExplanationGenerator.py`` and
``DETR/modules/ExplanationGenerator.py``, does something else):

- Simultaneous events. Events listed as one tuple form a *step*: every event of a step reads
  the matrices as they were before the step, and the additions are summed. LXMERT's
  cross-modality layer computes text<-image and image<-text from the same inputs, and so does
  the reference code (both additions are computed before either is added); applying them one
  after the other would let the second read the first's update. Events not grouped run in
  order.
- Empty rows in eq. 9. ``R^{xx} - I`` is non-negative (every ``Abar`` is), so a row sums to
  0 only when it is all zeros: a token no event has mixed yet with a positive weight (at the
  start, or a token whose gradients were zero or negative everywhere). Such a row stays zero,
  so ``Rbar`` keeps the identity row there (the token is relevant to itself only, as at
  eq. 1). The reference divides 0 by 0: its LXMERT code lets the NaN run into the result,
  its DETR code zeroes NaNs after eq. 10 -- and since a NaN row of ``Rbar^{ss}`` (a NaN
  column of its transpose) or of ``Rbar^{qq}`` turns *every* entry of the product into NaN,
  one empty row there discards the whole layer's cross-attention contribution.
- No gradient. An event whose ``grad`` is None (its output cannot reach the explained
  score) has ``Abar = 0``: it changes nothing.
- Batches. Leading dimensions are batch dimensions, each item on its own. The reference
  handles one item: its head average reshapes ``B x H`` into one dimension and averages over
  samples as well, and its ``.t()`` transposes only 2-D matrices.
- Eq. 10's transpose is the paper's and its code's, and kept: with ``(Rbar^{ss})^T`` the
  cross-attention of token i lands in the rows of the tokens k that i is relevant to
  (``Rbar^{ss}[i, k]``), the other direction from eq. 6, where row i gathers from the
  tokens i attends to. The tests pin the transpose down.
- The reference's ``generate_ours`` defaults to ``use_lrp=True`` (the LRP relevance of the
  attention map in place of A); its demo notebooks pass ``use_lrp=False``, the paper's
  method, which is what eq. 5 here computes.
- Equivalences, not deviations: the reference's DETR decoder leaves out eq. 11, which adds
  ``Abar · R^{iq}`` -- zero there, since image tokens never attend to the queries; its LXMERT
  loop skips the image branch of the last cross-modality layer, which cannot change
  ``R^{tt}`` or ``R^{ti}`` (only rows of the image modality read it). It also zeroes
  ``R^{tt}[0, 0]`` before display: :meth:`Relevances.rows` does that with ``drop_self``.

End to end (one recorded forward and one backward per batch): :func:`lxmert_relevance`
(:class:`BimodalMaps`: image and text relevance of the answer) and :func:`detr_relevance`
(one :class:`DetectionMaps` per image: a map per detected object), optionally through the
self-attention of a ViT backbone (``backbone=True``); the paper's baselines with the same
outputs: ``lxmert_raw_attention`` / ``lxmert_rollout`` / ``lxmert_gradcam`` and
``detr_raw_attention`` / ``detr_rollout`` / ``detr_gradcam``.
"""
from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from vitlab.attention import _attention_gradients, _in_chunks, checked_layout


# --- the rules: pure functions over batched tensors ----------------------------------------------
def head_averaged_relevance(attn: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """Eq. 5: ``Abar = mean_h (grad ⊙ A)^+``; ``... x heads x Nq x Nk`` -> ``... x Nq x Nk``.

    Each head is clamped at 0 before the mean over heads (dimension -3).
    """
    return (grad * attn).clamp(min=0).mean(dim=-3)


def self_attention_rule(R: torch.Tensor, Abar: torch.Tensor) -> torch.Tensor:
    """Eq. 6 / 7: ``R + Abar · R``, for ``R^{ss}`` (``... x Ns x Ns``) or ``R^{sq}`` (``... x Ns x Nq``).

    ``Abar``: ``... x Ns x Ns``, the head-averaged relevance of a self-attention layer over
    the tokens s. Returns a new tensor.
    """
    return R + Abar @ R


def normalized_self_relevance(R: torch.Tensor) -> torch.Tensor:
    """Eq. 8-9: ``Rbar = rownorm(R - I) + I`` for a self-relevance ``R^{xx}`` (``... x N x N``).

    ``R - I`` holds what the attention layers added to the identity of eq. 1 (eq. 8); each row
    of it is divided by its sum (eq. 9), so that a token's accumulated context weighs as much
    as the token itself. A row that sums to 0 (nothing added yet) stays 0: that token's row of
    ``Rbar`` is its identity row, where the literal formula would give 0 / 0 = NaN.
    """
    eye = torch.eye(R.shape[-1], dtype=R.dtype, device=R.device)
    added = R - eye  # eq. 8
    total = added.sum(dim=-1, keepdim=True)
    return added / torch.where(total > 0, total, torch.ones_like(total)) + eye  # eq. 9


def bimodal_rule(R_ss: torch.Tensor, R_sq: torch.Tensor, R_qq: torch.Tensor, R_qs: torch.Tensor,
                 Abar: torch.Tensor, normalize: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Eq. 10-11 for tokens of s attending to tokens of q: returns the new ``(R^{ss}, R^{sq})``.

    ``R^{sq} + (Rbar^{ss})^T · Abar · Rbar^{qq}`` (eq. 10) and ``R^{ss} + Abar · R^{qs}`` (eq. 11),
    with ``Rbar`` from :func:`normalized_self_relevance` (eq. 8-9; ``normalize=False`` uses
    ``R^{ss}``, ``R^{qq}`` as they are, the paper's ablation). The transpose of ``Rbar^{ss}`` is
    the paper's (and its code's). Shapes: ``R_ss`` ``... x Ns x Ns``, ``R_sq`` and ``Abar``
    ``... x Ns x Nq``, ``R_qq`` ``... x Nq x Nq``, ``R_qs`` ``... x Nq x Ns``.
    """
    return R_ss + Abar @ R_qs, R_sq + _eq10_addition(R_ss, R_qq, Abar, normalize)


def _eq10_addition(R_ss: torch.Tensor, R_qq: torch.Tensor, Abar: torch.Tensor, normalize: bool) -> torch.Tensor:
    if normalize:
        R_ss, R_qq = normalized_self_relevance(R_ss), normalized_self_relevance(R_qq)
    return R_ss.mT @ (Abar @ R_qq)


# --- events and the engine ------------------------------------------------------------------------
@dataclass(frozen=True)
class AttentionEvent:
    """One attention layer's post-softmax attention and its gradient, for :func:`propagate`.

    Tokens of modality ``query`` attend to tokens of modality ``key``: ``query == key`` is
    self-attention within a modality (eq. 6-7), ``query != key`` co-attention or
    encoder-decoder cross-attention ``query <- key`` (eq. 10-11).

    Attributes:
        query: the modality whose tokens ask (the rows of ``attention``).
        key: the modality whose tokens are attended to (the columns).
        attention: ``... x heads x Nq x Nk`` (leading dimensions: batch).
        grad: d(explained score)/d(attention), the shape of ``attention``; None when the
            layer cannot reach the score (its event then changes nothing).
    """

    query: str
    key: str
    attention: torch.Tensor
    grad: torch.Tensor | None

    def __post_init__(self):
        for name in ("query", "key"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise TypeError(f"AttentionEvent.{name} must be a modality name (a non-empty str), got {value!r}")
        if not isinstance(self.attention, torch.Tensor) or self.attention.ndim < 3:
            got = tuple(self.attention.shape) if isinstance(self.attention, torch.Tensor) else type(self.attention).__name__
            raise ValueError(f"{self}: attention must be a tensor ... x heads x Nq x Nk (at least 3 dimensions), got {got}")
        if self.grad is not None:
            if not isinstance(self.grad, torch.Tensor) or self.grad.shape != self.attention.shape:
                got = tuple(self.grad.shape) if isinstance(self.grad, torch.Tensor) else type(self.grad).__name__
                raise ValueError(f"{self}: grad must have the attention's shape {tuple(self.attention.shape)}, got {got}")

    @property
    def is_self(self) -> bool:
        """Self-attention within one modality."""
        return self.query == self.key

    def __str__(self) -> str:
        return f"self-attention {self.query!r}" if self.is_self else f"attention {self.query!r} <- {self.key!r}"

    def head_averaged(self) -> torch.Tensor | None:
        """Eq. 5 for this event, ``... x Nq x Nk``; None without a gradient."""
        return None if self.grad is None else head_averaged_relevance(self.attention, self.grad)


def self_attention_events(modality: str, attentions: Sequence[torch.Tensor],
                          gradients: Sequence[torch.Tensor | None]) -> list[AttentionEvent]:
    """One self-attention :class:`AttentionEvent` of ``modality`` per layer, first layer first."""
    return [AttentionEvent(modality, modality, A, G) for A, G in zip(attentions, gradients, strict=True)]


def read_rows(R: torch.Tensor, index, drop_self: bool = False) -> torch.Tensor:
    """Rows of a batched relevance matrix ``R`` (``*batch x Ns x Nq``).

    ``index``: an int (the same row of every item: ``*batch x Nq``); one row per item (a
    sequence or integer tensor of the batch shape: ``*batch x Nq``); or K rows per item (an
    integer tensor ``*batch x K``: ``*batch x K x Nq``), e.g. every detected query of a DETR
    image. ``drop_self`` (for a square ``R^{ss}``) sets each row's entry of its own token to 0,
    as the reference code does with ``R^{tt}[CLS, CLS]``: that entry holds eq. 1's identity.
    """
    *batch, Ns, Nq = R.shape
    batch = tuple(batch)
    if drop_self and Ns != Nq:
        raise ValueError(f"drop_self needs a square self-relevance R^{{ss}}, got rows x columns {Ns} x {Nq}")
    if isinstance(index, bool) or not isinstance(index, (int, Sequence, torch.Tensor)):
        raise TypeError(f"index must be an int, a sequence of ints or an integer tensor, got {type(index).__name__}")
    single = isinstance(index, int)
    idx = torch.as_tensor(index, device=R.device)
    if idx.is_floating_point() or idx.is_complex() or idx.dtype == torch.bool:
        raise TypeError(f"index must hold integers, got dtype {idx.dtype}")
    if idx.numel() and (idx.min() < 0 or idx.max() >= Ns):
        raise ValueError(f"row index {idx.min().item() if idx.min() < 0 else idx.max().item()} is outside "
                         f"0 .. {Ns - 1} ({Ns} tokens)")
    if single:
        idx = idx.expand(batch)
    if tuple(idx.shape) == batch:
        squeeze = True
        idx = idx.unsqueeze(-1)
    elif tuple(idx.shape[:-1]) == batch:
        squeeze = False
    else:
        raise ValueError(f"index must be an int, one row per item (shape {batch}) or K rows per item "
                         f"(shape {batch} x K), got shape {tuple(idx.shape)}")
    idx = idx.long()
    rows = R.gather(-2, idx.unsqueeze(-1).expand(*idx.shape, Nq))  # *batch x K x Nq
    if drop_self:
        rows = rows.scatter(-1, idx.unsqueeze(-1), 0.0)
    return rows.squeeze(-2) if squeeze else rows


@dataclass(frozen=True)
class Relevances:
    """The relevance matrices after :func:`propagate`.

    Attributes:
        sizes: tokens per modality.
        matrices: ``(s, q) -> R^{sq}``, ``*batch x Ns x Nq`` for every ordered pair of
            modalities (``(s, s)`` included).
    """

    sizes: dict[str, int]
    matrices: dict[tuple[str, str], torch.Tensor]

    def __getitem__(self, pair: tuple[str, str]) -> torch.Tensor:
        """``R^{sq}`` for ``pair = (s, q)``: ``*batch x Ns x Nq``."""
        if pair not in self.matrices:
            raise KeyError(f"no relevance {pair!r}: pairs are (s, q) with s, q among {sorted(self.sizes)}")
        return self.matrices[pair]

    def rows(self, s: str, q: str, index, drop_self: bool = False) -> torch.Tensor:
        """Row(s) ``index`` of ``R^{sq}``: relevance of every q token for token(s) ``index`` of s.

        LXMERT: ``rows("text", "image", 0)`` (image, CLS = first text token) and
        ``rows("text", "text", 0, drop_self=True)``; DETR: ``rows("query", "image", js)`` with
        ``js`` the detected queries (``B x K``). See :func:`read_rows` for ``index``.
        """
        return read_rows(self[s, q], index, drop_self=drop_self)


Step = AttentionEvent | Sequence[AttentionEvent]


def initial_relevances(sizes: Mapping[str, int], batch_shape=(), dtype=None, device=None) -> dict[tuple[str, str], torch.Tensor]:
    """Eq. 1-2: ``R^{ss} = I`` for every modality s, ``R^{sq} = 0`` for s != q, each ``*batch x Ns x Nq``."""
    sizes = _checked_sizes(sizes)
    batch_shape = tuple(batch_shape)
    matrices = {}
    for s, ns in sizes.items():
        for q, nq in sizes.items():
            if s == q:
                matrices[s, q] = torch.eye(ns, dtype=dtype, device=device).expand(*batch_shape, ns, ns)
            else:
                matrices[s, q] = torch.zeros(*batch_shape, ns, nq, dtype=dtype, device=device)
    return matrices


def propagate(events: Sequence[Step], sizes: Mapping[str, int], normalize: bool = True) -> Relevances:
    """Relevance through an ordered list of attention events (Chefer, Gur & Wolf 2021, eq. 1-11).

    Starts from eq. 1-2 and applies, per event in order, eq. 5 and then eq. 6-7 (self-attention)
    or eq. 8-11 (``query <- key``). A tuple (or list) of events in ``events`` is one step whose
    events all read the matrices from before the step, their additions summed: LXMERT's two
    co-attention directions of one layer.

    Args:
        events: :class:`AttentionEvent` s and steps, first layer first. Every attention must
            be ``*batch x heads x N_query x N_key`` with the same batch shape.
        sizes: tokens per modality, e.g. ``{"text": 20, "image": 36}``; modalities no event
            touches keep eq. 1-2.
        normalize: eq. 8-9 before eq. 10 (the paper); False is its ablation.

    Returns:
        :class:`Relevances` in the promoted dtype of the attentions and gradients.
    """
    steps = _checked_steps(events, _checked_sizes(sizes))
    first = steps[0][0].attention
    tensors = [t for step in steps for e in step for t in (e.attention, e.grad) if t is not None]
    dtype = tensors[0].dtype
    for t in tensors[1:]:
        dtype = torch.promote_types(dtype, t.dtype)
    R = initial_relevances(sizes, first.shape[:-3], dtype, first.device)
    for step in steps:
        additions: dict[tuple[str, str], torch.Tensor] = {}
        for event in step:
            for pair, add in _additions(R, event, normalize).items():
                additions[pair] = additions[pair] + add if pair in additions else add
        R = {pair: (M + additions[pair] if pair in additions else M) for pair, M in R.items()}
    return Relevances(dict(sizes), R)


def _additions(R, event: AttentionEvent, normalize: bool) -> dict[tuple[str, str], torch.Tensor]:
    """What ``event`` adds to each ``R^{sq}`` it changes, read from ``R`` (eq. 5-7, 10-11)."""
    Abar = event.head_averaged()
    if Abar is None:
        return {}
    Abar = Abar.to(R[event.query, event.query].dtype)
    s, q = event.query, event.key
    if event.is_self:  # eq. 6 (x = s) and eq. 7 (every other x)
        return {(s, x): Abar @ R[s, x] for (row, x) in R if row == s}
    return {(s, q): _eq10_addition(R[s, s], R[q, q], Abar, normalize),  # eq. 10
            (s, s): Abar @ R[q, s]}  # eq. 11


def _checked_sizes(sizes: Mapping[str, int]) -> dict[str, int]:
    if not isinstance(sizes, Mapping) or not sizes:
        raise ValueError(f"sizes must map each modality to its number of tokens, e.g. {{'text': 20, 'image': 36}}, got {sizes!r}")
    for name, n in sizes.items():
        if not isinstance(name, str) or isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"sizes must map modality names (str) to token counts >= 1, got {name!r}: {n!r}")
    return dict(sizes)


def _checked_steps(events: Sequence[Step], sizes: dict[str, int]) -> list[tuple[AttentionEvent, ...]]:
    if isinstance(events, AttentionEvent):
        events = [events]
    steps, grouped = [], []
    for k, step in enumerate(events):
        grouped.append(not isinstance(step, AttentionEvent))
        step = tuple(step) if grouped[-1] else (step,)
        if not step or not all(isinstance(e, AttentionEvent) for e in step):
            raise TypeError(f"events[{k}] must be an AttentionEvent or a non-empty tuple of them, got {step!r}")
        steps.append(step)
    if not steps:
        raise ValueError("propagate needs at least one AttentionEvent (the batch shape comes from them)")
    batch = steps[0][0].attention.shape[:-3]
    for k, step in enumerate(steps):
        for j, event in enumerate(step):
            where = f"events[{k}]{f'[{j}]' if grouped[k] else ''} ({event})"
            for name in (event.query, event.key):
                if name not in sizes:
                    raise ValueError(f"{where}: unknown modality {name!r}; sizes has {sorted(sizes)}")
            expected = (sizes[event.query], sizes[event.key])
            if tuple(event.attention.shape[-2:]) != expected:
                raise ValueError(f"{where}: attention is {tuple(event.attention.shape)}, its last two dimensions "
                                 f"must be {expected[0]} x {expected[1]} ({event.query!r} tokens x {event.key!r} tokens)")
            if event.attention.shape[:-3] != batch:
                raise ValueError(f"{where}: batch shape {tuple(event.attention.shape[:-3])} differs from the first event's "
                                 f"{tuple(batch)}")
    return steps


# --- the ViT case: one modality --------------------------------------------------------------------
def relevance_matrix(attentions: list[torch.Tensor], gradients: list[torch.Tensor]) -> torch.Tensor:
    """``R^{ss}`` after all blocks: start from I (eq. 1), apply eq. 5-6 per block in order.

    ``attentions[l]``, ``gradients[l]``: ``B x heads x N x N`` of block l (first block
    first). Returns ``B x N x N``: :func:`propagate` with one modality.
    """
    N = attentions[0].shape[-1]
    return propagate(self_attention_events("tokens", attentions, gradients), {"tokens": N})["tokens", "tokens"]


def relevance_row(attentions: list[torch.Tensor], gradients: list[torch.Tensor], index: int = 0) -> torch.Tensor:
    """Row ``index`` of :func:`relevance_matrix`, without the N x N products: ``B x N``.

    After all blocks ``R = (I + Abar_L) ... (I + Abar_1)``, so its row i is
    ``e_i (I + Abar_L) ... (I + Abar_1)``: a row vector updated as ``r <- r + r · Abar``
    from the last block down -- the same numbers for N times less work.
    """
    B, _, N, _ = attentions[0].shape
    r = torch.zeros(B, N, dtype=attentions[0].dtype, device=attentions[0].device)
    r[:, index] = 1
    for A, G in zip(reversed(attentions), reversed(gradients), strict=True):
        r = r + (r.unsqueeze(1) @ head_averaged_relevance(A, G)).squeeze(1)  # B x N
    return r


def chefer_relevance(model, x: torch.Tensor, target=None, score: str = "logit") -> torch.Tensor:
    """Class-specific relevance of each patch (Chefer, Gur & Wolf 2021, eq. 5-6): ``B x gh x gw``.

    ``R = I``; per block ``R += mean_h (dy_t/dA ⊙ A)^+ · R``, with y_t the sample's target
    logit; the map is ``R[CLS, patches]`` on the patch grid, not rescaled (relevance
    units; the CLS->CLS entry is left out with the other prefix tokens). One forward and
    one backward for the whole batch (per chunk of a batch over
    :data:`vitlab.attention.MEMORY_BUDGET`).

    Args:
        model: a timm or Hugging Face ViT classifier (run in eval mode, its mode put back).
        x: ``B x 3 x H x W`` input batch.
        target: int, one class per sample (sequence / 1-D tensor), or None (predicted).
        score: differentiate the target's ``"logit"`` (the paper) or its ``"log_probability"``.
    """
    layout = checked_layout(model, x, "chefer_relevance")
    chunked = _in_chunks(chefer_relevance, model, x, layout, gradients=True, target=target, score=score)
    if chunked is not None:  # a batch larger than vitlab.attention.MEMORY_BUDGET allows
        return chunked
    ag = _attention_gradients(model, x, target, layers=None, score=score, method="chefer_relevance")
    row = relevance_row(ag.attentions, ag.gradients, index=0)  # R[CLS, :], B x N
    return ag.layout.patches_to_grid(row)  # B x gh x gw


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


class BimodalMaps(NamedTuple):
    """What the LXMERT methods return, per sample of the batch.

    Attributes:
        image: ``B x regions``, the relevance of each image region (or patch) for the answer.
        text: ``B x tokens``, the relevance of each text token, the CLS entry set to 0.
        target: ``B``, the answer explained (the predicted one when none was given).
        logits: ``B x answers``, the model's answer scores.
    """

    image: torch.Tensor
    text: torch.Tensor
    target: torch.Tensor
    logits: torch.Tensor


class DetectionMaps(NamedTuple):
    """What the DETR methods return for one image: one map per explained object query.

    Attributes:
        queries: ``K``, the explained object queries (indices into DETR's queries).
        labels: ``K``, the best class of each (the "no object" class left out).
        probabilities: ``K``, its probability (softmax over all classes, "no object" included).
        maps: ``K x h x w``, the relevance on the feature grid (``rec.feature_grid``; with
            ``backbone=True`` the ViT backbone's patch grid, the same for a ViT feature map).
    """

    queries: torch.Tensor
    labels: torch.Tensor
    probabilities: torch.Tensor
    maps: torch.Tensor


def _require_family(model, family: str, method: str) -> None:
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if not isinstance(model, torch.nn.Module) or model_type != family:
        what = {"lxmert": "a Hugging Face LXMERT question-answering model (LxmertForQuestionAnswering)",
                "detr": "a Hugging Face DETR detector (DetrForObjectDetection)"}[family]
        raise TypeError(f"{method} explains {what}, got {type(model).__name__}"
                        + (f" (model_type {model_type!r})" if model_type else ""))


def _require_gradients_possible(method: str) -> None:
    if torch.is_inference_mode_enabled():
        raise RuntimeError(
            f"{method} needs gradients, but it was called inside torch.inference_mode(), which cannot be "
            "switched off from inside: call it outside inference_mode (inside torch.no_grad() is fine)")


def _checked_lxmert_inputs(model, inputs, method: str) -> tuple[dict, int]:
    """``inputs`` as a dict of tensors the model's forward takes, and the batch size."""
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
    return dict(inputs), int(batch)


def _recorded_forward(model, kwargs: dict, grad: bool, method: str, through_pixels: bool = False):
    """One forward of ``model(**kwargs)`` inside :func:`vitlab.record` (attention only, eval
    mode): ``(rec, output)``; with ``grad`` the attentions stay in the autograd graph.
    ``through_pixels``: the images go in as a copy that requires grad, so that a frozen
    backbone's attention joins the graph too (relevance through the backbone)."""
    from vitlab.record import record

    if through_pixels:
        x = kwargs["pixel_values"]
        kwargs = {**kwargs, "pixel_values": (x.clone() if x.is_inference() else x.detach()).requires_grad_(True)}
    if grad:
        _require_gradients_possible(method)
    context = torch.enable_grad() if grad else torch.no_grad()
    with context, record(model, detach=not grad, eval_mode=True, capture=("attention",)) as rec:
        out = model(**kwargs)
    return rec, out


def _attention_grads(output: torch.Tensor, grad_output: torch.Tensor, captures, batched: bool, method: str):
    """d(score)/d(attention) of each capture, one ``torch.autograd.grad`` call; None where the
    score does not depend on it. ``grad_output``: the score's weights on ``output``
    (``batched``: ``K x output.shape``, K vector-Jacobian products in that one call)."""
    for cap in captures:
        if not cap.attention.requires_grad:
            raise RuntimeError(
                f"{method}: the attention of {cap.name} is outside the autograd graph (the parameters up to "
                "there are frozen and the inputs do not require grad), so its gradient cannot be computed; "
                "unfreeze them (model.requires_grad_(True)): no parameter's .grad is written")
    grads = torch.autograd.grad(output, [c.attention for c in captures], grad_outputs=grad_output,
                                allow_unused=True, is_grads_batched=batched)
    return [None if g is None else g.detach() for g in grads]


def _padded(t: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """``t`` (``... x Nq x Nk``) with ``rows`` zero rows and ``cols`` zero columns in front."""
    return torch.nn.functional.pad(t, (cols, 0, rows, 0)) if rows or cols else t


def _events(captures, grads, image: str, prefix: int = 0, slots: int | None = None) -> list[Step]:
    """The propagate steps of ``captures`` (in ``rec.events`` order) with their ``grads``.

    LXMERT's ``lang->vision`` capture and the ``vision->lang`` capture right after it (the
    same module in the same layer) form one simultaneous step. ``prefix`` > 0 (relevance
    through a ViT backbone): the backbone's self-attention captures become self-attention of
    modality ``image`` over all the ViT's tokens, and every other capture touching ``image``
    gets ``prefix`` zero rows / columns in front, so that image token k is the ViT's token
    ``prefix + k`` (its patch k). ``slots`` = K: the gradients have a leading dimension K (K
    scores of one batched backward) and every attention is expanded to it.
    """
    steps: list[Step] = []
    last = None
    for cap, g in zip(captures, grads, strict=True):
        q, k = cap.query_modality, cap.key_modality
        A = cap.attention.detach()
        if slots is not None:
            A = A.expand(slots, *A.shape)
        if cap.stream == "backbone":
            q = k = image
        elif prefix:
            rows, cols = prefix * (q == image), prefix * (k == image)
            A = _padded(A, rows, cols)
            g = None if g is None else _padded(g, rows, cols)
        event = AttentionEvent(q, k, A, g)
        if (cap.stream == "vision->lang" and last is not None and last.stream == "lang->vision"
                and last.layer == cap.layer):
            steps[-1] = (steps[-1], event)
        else:
            steps.append(event)
        last = cap
    return steps


def _sizes(steps: list[Step]) -> dict[str, int]:
    sizes: dict[str, int] = {}
    for step in steps:
        for e in (step if isinstance(step, tuple) else (step,)):
            sizes.setdefault(e.query, e.attention.shape[-2])
            sizes.setdefault(e.key, e.attention.shape[-1])
    return sizes


def _backbone_prefix(rec, image_tokens: int, method: str) -> int:
    """The ViT backbone's prefix-token count, after checking its patches are the image tokens."""
    layout = rec.layout
    if layout is None or not rec.streams.get("backbone"):
        raise ValueError(f"{method}(backbone=True) carries relevance through a ViT backbone's self-attention, "
                         "but no ViT backbone ran in this forward (vitlab.record found none)")
    if layout.num_patches != image_tokens:
        raise ValueError(f"{method}(backbone=True): the ViT backbone has {layout.num_patches} patches but the model "
                         f"has {image_tokens} image tokens; relevance through the backbone needs image token k = "
                         "patch k (as in shapes-lxmert / shapes-detr)")
    return layout.num_prefix


# --- LXMERT ----------------------------------------------------------------------------------------
def _lxmert_forward(model, inputs, method: str, grad: bool, backbone: bool = False):
    """Checks, then one recorded forward: ``(rec, logits)``."""
    _require_family(model, "lxmert", method)
    kwargs, _ = _checked_lxmert_inputs(model, inputs, method)
    if backbone and "pixel_values" not in kwargs:
        raise ValueError(f"{method}(backbone=True) needs the images as inputs['pixel_values'] (the backbone "
                         "runs inside the model); with region features there is no backbone to go through")
    rec, out = _recorded_forward(model, kwargs, grad, method, through_pixels=backbone)
    logits = getattr(out, "question_answering_score", None)
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"{method} explains an answer score, but {type(model).__name__} returned no "
                        "question_answering_score: use LxmertForQuestionAnswering")
    return rec, logits


def _last(rec, stream: str, method: str):
    caps = rec.stream(stream)
    if not caps:
        raise ValueError(f"{method}: the model has no {stream!r} attention layer")
    return caps[-1]


def lxmert_relevance(model, inputs: dict, target=None, backbone: bool = False) -> BimodalMaps:
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

    Returns:
        :class:`BimodalMaps` (``image`` ``B x regions``, ``text`` ``B x tokens``).
    """
    method = "lxmert_relevance"
    _require_family(model, "lxmert", method)
    batch = _checked_lxmert_inputs(model, inputs, method)[1]
    from vitlab.targets import check_target, resolve_target

    target = check_target(target, batch)
    rec, logits = _lxmert_forward(model, inputs, method, grad=True, backbone=backbone)
    t = resolve_target(target, logits)
    captures = [c for c in rec.events if backbone or c.stream != "backbone"]
    image_tokens = _last(rec, "lang->vision", method).attention.shape[-1]
    prefix = _backbone_prefix(rec, image_tokens, method) if backbone else 0
    grad_output = torch.zeros_like(logits)
    grad_output[torch.arange(batch, device=logits.device), t] = 1  # the score: sum over samples of each one's target logit
    grads = _attention_grads(logits, grad_output, captures, batched=False, method=method)
    steps = _events(captures, grads, "vision", prefix)
    R = propagate(steps, _sizes(steps))
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
    rec, logits = _lxmert_forward(model, inputs, method, grad=False)
    image = _last(rec, "lang->vision", method).attention.mean(dim=1)[:, 0]  # B x regions
    text = _last(rec, "cross.lang", method).attention.mean(dim=1)[:, 0].clone()  # B x tokens
    text[:, 0] = 0
    return BimodalMaps(image, text, logits.argmax(-1), logits)


def _rollout(cams: list[torch.Tensor], n: int, like: torch.Tensor) -> torch.Tensor:
    """Attention rollout of head-averaged self-attention ``cams`` (first first): ``... x n x n``;
    the identity when there is none."""
    from vitlab.rollout import residual_normalize, rollout_matrix

    if not cams:
        return torch.eye(n, dtype=like.dtype, device=like.device).expand(*like.shape[:-2], n, n)
    return rollout_matrix([residual_normalize(a) for a in cams])


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
    """
    method = "lxmert_rollout"
    rec, logits = _lxmert_forward(model, inputs, method, grad=False)
    last_layer = _last(rec, "lang->vision", method).layer
    text_cams = [c.attention.mean(dim=1) for c in rec.stream("lang")]
    text_cams += [c.attention.mean(dim=1) for c in rec.stream("cross.lang") if c.layer < last_layer]
    image_cams = [c.attention.mean(dim=1) for c in rec.stream("vision")]
    image_cams += [c.attention.mean(dim=1) for c in rec.stream("cross.vision") if c.layer < last_layer]
    C = _last(rec, "lang->vision", method).attention.mean(dim=1)  # B x Nt x Ni
    T = _rollout(text_cams, C.shape[-2], C)
    V = _rollout(image_cams, C.shape[-1], C)
    image = (T.mT @ C @ V)[:, 0]
    text_all = _rollout(text_cams + [_last(rec, "cross.lang", method).attention.mean(dim=1)], C.shape[-2], C)
    text = text_all[:, 0].clone()
    text[:, 0] = 0
    return BimodalMaps(image, text, logits.argmax(-1), logits)


def attention_matrix_gradcam(attn: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """GradCAM on a whole attention map, as the reference's bi-modal baseline: ``... x Nq x Nk``.

    Per head ``w_h`` = the gradient averaged over all ``Nq x Nk`` entries; the map is
    ``(mean_h w_h A_h)^+``. (The ViT baseline, :func:`vitlab.attention.gradcam_cls_row`,
    averages the CLS row only, as the ViT reference does.)
    """
    w = grad.mean(dim=(-2, -1), keepdim=True)  # ... x H x 1 x 1
    return (w * attn).mean(dim=-3).clamp(min=0)


def lxmert_gradcam(model, inputs: dict, target=None) -> BimodalMaps:
    """GradCAM baseline on the last cross-modality layer (the reference's ``generate_attn_gradcam``).

    ``image`` = row CLS of :func:`attention_matrix_gradcam` of its text -> image co-attention;
    ``text`` = row CLS of the same for its text self-attention, CLS entry set to 0; gradients
    of the ``target`` answer's logit (None: predicted). One forward, one backward (to these
    two attention maps only).
    """
    method = "lxmert_gradcam"
    _require_family(model, "lxmert", method)
    from vitlab.targets import check_target, resolve_target

    target = check_target(target, _checked_lxmert_inputs(model, inputs, method)[1])
    rec, logits = _lxmert_forward(model, inputs, method, grad=True)
    t = resolve_target(target, logits)
    co, lang = _last(rec, "lang->vision", method), _last(rec, "cross.lang", method)
    grad_output = torch.zeros_like(logits)
    grad_output[torch.arange(logits.shape[0], device=logits.device), t] = 1
    g_co, g_lang = _attention_grads(logits, grad_output, [co, lang], batched=False, method=method)
    zero = torch.zeros_like
    image = attention_matrix_gradcam(co.attention.detach(), zero(co.attention) if g_co is None else g_co)[:, 0]
    text = attention_matrix_gradcam(lang.attention.detach(), zero(lang.attention) if g_lang is None else g_lang)[:, 0]
    text = text.clone()
    text[:, 0] = 0
    return BimodalMaps(image, text, t, logits.detach())


# --- DETR ------------------------------------------------------------------------------------------
def _detr_forward(model, pixel_values, pixel_mask, method: str, grad: bool, backbone: bool = False):
    """Checks, then one recorded forward: ``(rec, logits B x queries x (classes + 1))``."""
    _require_family(model, "detr", method)
    if not isinstance(pixel_values, torch.Tensor) or pixel_values.ndim != 4:
        got = tuple(pixel_values.shape) if isinstance(pixel_values, torch.Tensor) else type(pixel_values).__name__
        raise ValueError(f"{method}: pixel_values must be a tensor B x 3 x H x W, got {got}")
    kwargs = {"pixel_values": pixel_values} if pixel_mask is None else {"pixel_values": pixel_values,
                                                                       "pixel_mask": pixel_mask}
    rec, out = _recorded_forward(model, kwargs, grad, method, through_pixels=backbone)
    logits = getattr(out, "logits", None)
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"{method} explains detections, but {type(model).__name__} returned no class logits: "
                        "use DetrForObjectDetection")
    return rec, logits


def _detr_queries(logits: torch.Tensor, queries, threshold: float, method: str):
    """Per image ``(queries, labels, probabilities)`` to explain (see :func:`detr_relevance`)."""
    B, Q, _ = logits.shape
    probs = logits.detach().softmax(-1)[..., :-1]  # the last class is "no object"
    best, labels = probs.max(-1)  # B x Q
    if queries is None:
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 0 <= threshold < 1:
            raise ValueError(f"{method}: threshold must be a probability in [0, 1), got {threshold!r}")
        chosen = [torch.nonzero(best[b] > threshold).flatten() for b in range(B)]
        if not any(len(c) for c in chosen):
            raise ValueError(
                f"{method}: no object detected: no query's best class has a probability above threshold={threshold} "
                f"in any image (highest: {float(best.max()):.3f}); lower threshold or pass queries=[...]")
    else:
        chosen = [c.to(best.device) for c in _checked_queries(queries, B, Q, method)]
    return [(c, labels[b, c], best[b, c]) for b, c in enumerate(chosen)]


def _checked_queries(queries, B: int, Q: int, method: str) -> list[torch.Tensor]:
    def as_indices(v, where):
        t = torch.as_tensor(v) if not (isinstance(v, Sequence) and len(v) == 0) else torch.zeros(0, dtype=torch.long)
        if t.dtype == torch.bool or t.is_floating_point() or t.is_complex() or t.ndim > 1:
            raise ValueError(f"{method}: {where} must be query indices (ints), got {v!r}")
        t = t.reshape(-1).long()
        if t.numel() and (t.min() < 0 or t.max() >= Q):
            raise ValueError(f"{method}: {where} holds query {int(t[(t < 0) | (t >= Q)][0])}; the model has "
                             f"queries 0 .. {Q - 1}")
        return t

    def is_index(v):
        return (isinstance(v, int) and not isinstance(v, bool)) or (isinstance(v, torch.Tensor) and v.ndim == 0)

    usage = "an int or a list of ints (the same queries in every image), or one list per image"
    if is_index(queries) or (isinstance(queries, torch.Tensor) and queries.ndim == 1):
        per_image = [as_indices(queries, "queries")] * B
    elif isinstance(queries, (Sequence, torch.Tensor)) and not isinstance(queries, (str, bytes)):
        if all(is_index(v) for v in queries):
            per_image = [as_indices(list(queries), "queries")] * B
        elif len(queries) != B:
            raise ValueError(f"{method}: queries has {len(queries)} lists for a batch of {B} images")
        else:
            per_image = [as_indices(q, f"queries[{b}]") for b, q in enumerate(queries)]
    else:
        raise ValueError(f"{method}: queries must be {usage}, got {queries!r}")
    if not any(len(q) for q in per_image):
        raise ValueError(f"{method}: queries selects no query in any image")
    return per_image


def _slot_grad_output(logits: torch.Tensor, found) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The K scores of one batched backward: slot k holds, for every image b, the logit of its
    k-th explained query's class (zero weights where the image has fewer than k + 1).
    Returns ``(grad_output K x B x Q x C, query index K x B, K)``."""
    B = logits.shape[0]
    K = max(len(q) for q, _, _ in found)
    grad_output = torch.zeros(K, *logits.shape, dtype=logits.dtype, device=logits.device)
    index = torch.zeros(K, B, dtype=torch.long, device=logits.device)
    for b, (q, labels, _) in enumerate(found):
        k = torch.arange(len(q), device=logits.device)
        grad_output[k, b, q.to(logits.device), labels.to(logits.device)] = 1
        index[k, b] = q.to(logits.device)
    return grad_output, index, K


def _per_image(found, rows: torch.Tensor, grid) -> list[DetectionMaps]:
    """``rows``: ``K x B x tokens`` (slot k of image b) -> one :class:`DetectionMaps` per image."""
    out = []
    for b, (q, labels, probs) in enumerate(found):
        maps = rows[: len(q), b].reshape(len(q), *grid)
        out.append(DetectionMaps(q, labels, probs, maps))
    return out


def _detr_grads(logits, found, captures, method):
    grad_output, index, K = _slot_grad_output(logits, found)
    if K == 1:  # one query per image: a plain backward
        grads = _attention_grads(logits, grad_output[0], captures, batched=False, method=method)
        grads = [None if g is None else g.unsqueeze(0) for g in grads]
    else:
        grads = _attention_grads(logits, grad_output, captures, batched=True, method=method)
    return grads, index, K


def detr_relevance(model, pixel_values: torch.Tensor, queries=None, threshold: float = 0.9,
                   pixel_mask: torch.Tensor | None = None, backbone: bool = False) -> list[DetectionMaps]:
    """Generic attention relevance of each detected object of DETR (Chefer, Gur & Wolf 2021).

    For each image and each explained object query j with best class c (the "no object"
    class left out): the row ``R^{qi}[j]`` after :func:`propagate` over the encoder's
    self-attention and, per decoder layer, the queries' self-attention and their
    cross-attention to the image tokens, for the score ``logit[j, c]``, on the feature grid.

    Several queries of one image need several gradients (the score differs per query, and
    so does every layer's eq. 5 weighting). Instead of repeating the image as batch items (K
    forwards' worth of work for K queries), this runs **one forward** for the batch and
    **one backward call** with K stacked scores (``torch.autograd.grad(...,
    is_grads_batched=True)``, vmapped over the score: slot k explains the k-th query of every
    image at once, images being independent), then propagates the K x B relevance problems
    as one batch. K = the most queries any image has; with K = 1 it is a plain backward.

    Args:
        model: ``DetrForObjectDetection`` (e.g. ``facebook/detr-resnet-50`` or vitlab's
            ``shapes-detr``), run in eval mode; left exactly as it was.
        pixel_values: ``B x 3 x H x W``, preprocessed images.
        queries: None (every query whose best class probability exceeds ``threshold``, as
            DETR's demo keeps them), or the queries to explain: an int or a list of ints for
            every image, or one list per image.
        threshold: the probability a detection must exceed (default 0.9, the paper's).
        pixel_mask: DETR's optional ``B x H x W`` mask of valid pixels.
        backbone: also carry relevance through the self-attention of a ViT backbone (vitlab's
            ``shapes-detr``): its blocks are earlier self-attention layers of the image
            modality over all the ViT's tokens (feature token k = patch k); the maps are read
            on its patches.

    Returns:
        One :class:`DetectionMaps` per image (``maps``: ``K x h x w``). An image with no
        detection gets K = 0 entries while another image of the batch has some.

    Raises:
        ValueError: no query to explain in any image (the message gives the highest
            probability), bad ``queries`` or ``threshold``, a backbone that does not fit.
        TypeError: not a DETR detector (``DetrModel`` has no class logits).
    """
    method = "detr_relevance"
    rec, logits = _detr_forward(model, pixel_values, pixel_mask, method, grad=True, backbone=backbone)
    found = _detr_queries(logits, queries, threshold, method)
    captures = [c for c in rec.events if backbone or c.stream != "backbone"]
    grid = rec.feature_grid
    image_tokens = rec.stream("encoder")[0].attention.shape[-1] if rec.stream("encoder") else \
        rec.stream("cross")[0].attention.shape[-1]
    prefix = _backbone_prefix(rec, image_tokens, method) if backbone else 0
    if backbone:
        grid = rec.layout.grid
    grads, index, K = _detr_grads(logits, found, captures, method)
    steps = _events(captures, grads, "image", prefix, slots=K)
    rows = propagate(steps, _sizes(steps)).rows("queries", "image", index)[..., prefix:]  # K x B x tokens
    return _per_image(found, rows, grid)


def detr_raw_attention(model, pixel_values: torch.Tensor, queries=None, threshold: float = 0.9,
                       pixel_mask: torch.Tensor | None = None) -> list[DetectionMaps]:
    """Raw attention baseline: row j of the last decoder layer's cross-attention, heads
    averaged (the reference's ``generate_raw_attn``). One forward, no gradient; queries and
    output as :func:`detr_relevance`."""
    method = "detr_raw_attention"
    rec, logits = _detr_forward(model, pixel_values, pixel_mask, method, grad=False)
    found = _detr_queries(logits, queries, threshold, method)
    cam = _last(rec, "cross", method).attention.mean(dim=1)  # B x Q x N
    return [DetectionMaps(q, l, p, cam[b, q].reshape(len(q), *rec.feature_grid)) for b, (q, l, p) in enumerate(found)]


def detr_rollout(model, pixel_values: torch.Tensor, queries=None, threshold: float = 0.9,
                 pixel_mask: torch.Tensor | None = None) -> list[DetectionMaps]:
    """Rollout baseline for DETR, as the reference's ``generate_rollout`` computes it.

    Heads averaged; ``E`` = rollout of the encoder's self-attention layers
    (``rownorm(a_L + I) ... rownorm(a_1 + I)``), ``D`` = rollout of the decoder's
    self-attention layers (queries), ``C`` = the last decoder layer's cross-attention:
    the map of query j is row j of ``D^T · C · E``. The earlier cross-attention layers do not
    enter. One forward, no gradient; queries and output as :func:`detr_relevance`.
    """
    method = "detr_rollout"
    rec, logits = _detr_forward(model, pixel_values, pixel_mask, method, grad=False)
    found = _detr_queries(logits, queries, threshold, method)
    C = _last(rec, "cross", method).attention.mean(dim=1)  # B x Q x N
    E = _rollout([c.attention.mean(dim=1) for c in rec.stream("encoder")], C.shape[-1], C)
    D = _rollout([c.attention.mean(dim=1) for c in rec.stream("decoder")], C.shape[-2], C)
    R = D.mT @ C @ E
    return [DetectionMaps(q, l, p, R[b, q].reshape(len(q), *rec.feature_grid)) for b, (q, l, p) in enumerate(found)]


def detr_gradcam(model, pixel_values: torch.Tensor, queries=None, threshold: float = 0.9,
                 pixel_mask: torch.Tensor | None = None) -> list[DetectionMaps]:
    """GradCAM baseline on the last decoder layer's cross-attention (the reference's
    ``generate_attn_gradcam``): row j of :func:`attention_matrix_gradcam` with the gradient of
    query j's class logit. One forward, one (batched over queries, as in
    :func:`detr_relevance`) backward to that attention map only."""
    method = "detr_gradcam"
    rec, logits = _detr_forward(model, pixel_values, pixel_mask, method, grad=True)
    found = _detr_queries(logits, queries, threshold, method)
    cross = _last(rec, "cross", method)
    (g,), index, K = _detr_grads(logits, found, [cross], method)
    A = cross.attention.detach().expand(K, *cross.attention.shape)
    cam = attention_matrix_gradcam(A, torch.zeros_like(A) if g is None else g)  # K x B x Q x N
    rows = read_rows(cam, index)  # K x B x N
    return _per_image(found, rows, rec.feature_grid)
