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
- eq. 8-9: ``Rbar^{xx} = rownorm(R^{xx} - I) + I`` (:func:`normalized_self_relevance`);
  :func:`propagate` keeps ``R^{xx} - I`` itself (:func:`normalized_added_relevance`), so the
  subtraction never cancels in float32 (tested against float64 on a 2/2/3-layer LXMERT).
- eq. 10-11, tokens of s attending to tokens of q (``Abar``: ``Ns x Nq``):
  ``R^{sq} += (Rbar^{ss})^T · Abar · Rbar^{qq}`` and ``R^{ss} += Abar · R^{qs}``
  (:func:`bimodal_rule`). Ablations of :func:`propagate`, to show each rule acting:
  ``normalize=False`` (``R`` for ``Rbar`` in eq. 10), ``self_in_eq10=False`` (eq. 10 as
  ``R^{sq} += Abar``) and ``eq11=False`` (no eq. 11).

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

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch



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

    Precision: when ``R`` stays close to I (small gradients times small attention) the
    subtraction cancels: in float32 an addition of 1e-6 keeps about one digit. :func:`propagate`
    therefore never forms ``R - I`` from ``R``: it keeps ``R - I`` itself and calls
    :func:`normalized_added_relevance`.
    """
    eye = torch.eye(R.shape[-1], dtype=R.dtype, device=R.device)
    return normalized_added_relevance(R - eye)  # eq. 8


def normalized_added_relevance(added: torch.Tensor) -> torch.Tensor:
    """Eq. 9 from eq. 8's ``Rhat = R - I`` itself: ``rownorm(Rhat) + I`` (``... x N x N``).

    A row of ``Rhat`` that sums to 0 stays 0 (the identity row of ``Rbar``), see
    :func:`normalized_self_relevance`.
    """
    eye = torch.eye(added.shape[-1], dtype=added.dtype, device=added.device)
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


def _eq10_from_added(added_ss: torch.Tensor, added_qq: torch.Tensor, Abar: torch.Tensor,
                     normalize: bool) -> torch.Tensor:
    """Eq. 10's addition from ``R^{ss} - I`` and ``R^{qq} - I`` (kept exact by :func:`propagate`)."""
    if not normalize:  # the ablation, R itself: (I + Rhat_ss)^T · Abar · (I + Rhat_qq), expanded
        left = Abar + added_ss.mT @ Abar
        return left + left @ added_qq
    Rb_ss, Rb_qq = normalized_added_relevance(added_ss), normalized_added_relevance(added_qq)
    return Rb_ss.mT @ (Abar @ Rb_qq)


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
    sequence or integer tensor of the batch shape: ``*batch x Nq``); or K >= 1 rows per item
    (an integer tensor ``*batch x K``: ``*batch x K x Nq``), e.g. every detected query of a
    DETR image. An empty index (no rows asked for) is refused. ``drop_self`` (for a square
    ``R^{ss}``) sets each row's entry of its own token to 0, as the reference code does with
    ``R^{tt}[CLS, CLS]``: that entry holds eq. 1's identity.
    """
    *batch, Ns, Nq = R.shape
    batch = tuple(batch)
    if drop_self and Ns != Nq:
        raise ValueError(f"drop_self needs a square self-relevance R^{{ss}}, got rows x columns {Ns} x {Nq}")
    if isinstance(index, bool) or not isinstance(index, (int, Sequence, torch.Tensor)):
        raise TypeError(f"index must be an int, a sequence of ints or an integer tensor, got {type(index).__name__}")
    single = isinstance(index, int)
    idx = torch.as_tensor(index, device=R.device)
    if idx.numel() == 0:  # checked first: torch reads an empty list as float32
        raise ValueError(f"no rows asked for: index is empty (shape {tuple(idx.shape)}); give an int, one row per "
                         f"item (shape {batch}) or K >= 1 rows per item (shape {batch} x K)")
    if idx.is_floating_point() or idx.is_complex() or idx.dtype == torch.bool:
        raise TypeError(f"index must hold integers, got dtype {idx.dtype}")
    if idx.min() < 0 or idx.max() >= Ns:
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
        added: ``s -> R^{ss} - I`` (eq. 8's ``Rhat``), as :func:`propagate` accumulated it:
            exact where ``matrices[s, s]``'s diagonal ``1 + Rhat_ii`` rounds ``Rhat_ii`` off
            (its off-diagonal entries are ``Rhat``'s exactly). None when not given.
    """

    sizes: dict[str, int]
    matrices: dict[tuple[str, str], torch.Tensor]
    added: dict[str, torch.Tensor] | None = None

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
                # a copy per item (not an expanded view): editing one item's R^{ss} leaves the others
                matrices[s, q] = torch.eye(ns, dtype=dtype, device=device).expand(*batch_shape, ns, ns).clone()
            else:
                matrices[s, q] = torch.zeros(*batch_shape, ns, nq, dtype=dtype, device=device)
    return matrices


def propagate(events: Sequence[Step], sizes: Mapping[str, int], normalize: bool = True, *,
              eq11: bool = True, self_in_eq10: bool = True) -> Relevances:
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
        eq11: False leaves eq. 11 out (an ablation): a ``query <- key`` event then adds
            nothing to ``R^{ss}`` through ``R^{qs}``; only eq. 10's ``R^{sq}`` update remains.
        self_in_eq10: False replaces eq. 10 by ``R^{sq} += Abar`` (an ablation, the reference
            code's ``apply_self_in_rule_10=False``): ``Rbar^{ss}`` and ``Rbar^{qq}`` (eq. 8-9)
            become the identity, so the cross-attention is added without the context the two
            modalities' self-attention gave their tokens; ``normalize`` then has no effect.

    Returns:
        :class:`Relevances` in the promoted dtype of the attentions and gradients. Each
        ``R^{ss}`` is accumulated as ``R^{ss} - I`` (its ``added``) and eq. 8-9 read that
        directly: no cancellation in float32 however close to I ``R^{ss}`` stays.
    """
    steps = _checked_steps(events, _checked_sizes(sizes))
    first = steps[0][0].attention
    tensors = [t for step in steps for e in step for t in (e.attention, e.grad) if t is not None]
    dtype = tensors[0].dtype
    for t in tensors[1:]:
        dtype = torch.promote_types(dtype, t.dtype)
    # The state: R^{sq} for s != q, and Rhat^{ss} = R^{ss} - I (eq. 8) itself for s == q, so that
    # eq. 8-9 never subtract I from an R close to I (float32 would lose the additions' digits).
    R = initial_relevances(sizes, first.shape[:-3], dtype, first.device)
    state = {pair: (torch.zeros_like(M) if pair[0] == pair[1] else M) for pair, M in R.items()}
    for step in steps:
        additions: dict[tuple[str, str], torch.Tensor] = {}
        for event in step:
            for pair, add in _additions(state, event, normalize, eq11, self_in_eq10).items():
                additions[pair] = additions[pair] + add if pair in additions else add
        state = {pair: (M + additions[pair] if pair in additions else M) for pair, M in state.items()}
    added = {s: state[s, s] for s in sizes}
    matrices = {pair: (R[pair] + M if pair[0] == pair[1] else M) for pair, M in state.items()}
    return Relevances(dict(sizes), matrices, added)


def _additions(state, event: AttentionEvent, normalize: bool, eq11: bool = True,
               self_in_eq10: bool = True) -> dict[tuple[str, str], torch.Tensor]:
    """What ``event`` adds to each matrix of the state it changes (eq. 5-7, 10-11); the state
    holds ``R^{sq}`` for s != q and ``R^{ss} - I`` for s == q (additions are the same for both).
    ``eq11`` / ``self_in_eq10``: the ablations of :func:`propagate`."""
    Abar = event.head_averaged()
    if Abar is None:
        return {}
    Abar = Abar.to(state[event.query, event.query].dtype)
    s, q = event.query, event.key
    if event.is_self:  # eq. 6 (x = s: Abar · R^{ss} = Abar · Rhat^{ss} + Abar) and eq. 7 (every other x)
        return {(s, x): (Abar @ M + Abar if x == s else Abar @ M) for (row, x), M in state.items() if row == s}
    additions = {(s, q): _eq10_from_added(state[s, s], state[q, q], Abar, normalize) if self_in_eq10
                 else Abar}  # eq. 10 (its ablation: Rbar^{ss} = Rbar^{qq} = I)
    if eq11:
        additions[s, s] = Abar @ state[q, s]  # eq. 11
    return additions


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
