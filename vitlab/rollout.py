"""Attention rollout (Abnar & Zuidema 2020) and gradient rollout (Gildenblat 2020), fixed.

Attention rollout, "Quantifying Attention Flow in Transformers" (Abnar & Zuidema, ACL
2020, Sec. 3): per block, the head-fused attention A plus the identity for the residual
connection, ``a = (A + I) / 2``, row-normalised; the rollout is the product
``R = a_L @ ... @ a_1`` and the map is R's CLS row over the patches.

The variant of "Exploring Explainability for Vision Transformers" (Gildenblat 2020, code
jacobgil/vit-explain) adds head fusion by mean / min / max and discards the lowest
``discard_ratio`` of each layer's entries; its gradient rollout replaces head fusion by
``mean_h (A * dy_t/dA)`` with negatives clamped to 0. vitlab fixes the reference code:

- rows are normalised (vit-explain #16 divides by a sum without ``keepdim``: by columns);
- layer l's gradient is paired with layer l's attention (vit-explain #6 reversed them);
- the discard and the output are per sample (vit-explain zeroes batch item 0 only and
  returns item 0 only), and the CLS->CLS entry is never discarded.

Only the CLS row of R is needed, so it is propagated as a row vector,
``r = e_cls @ a_L @ ... @ a_1`` (:func:`rollout_row`; :func:`fused_rollout_row` folds the
normalisation in): the same numbers as the full product (:func:`rollout_matrix`) at a
fraction of the cost.

Chapter 3 grades many settings at once: :func:`rollout_from_attentions` computes one setting
from an already recorded forward, :func:`rollout_settings_maps` every setting from one
recording per batch, and :func:`grade_rollout_settings` grades them against object masks
(pointing game and mass on the object, :mod:`vitlab.localization`).
"""
from __future__ import annotations

import numbers
from typing import Sequence

import torch

from vitlab.attention import recorded_attentions, recorded_gradients
from vitlab.inputs import batches, checked_layout, gradient_target, in_chunks, readout_weights
from vitlab.layout import TokenLayout

HEAD_FUSIONS = ("mean", "min", "max")


def check_head_fusion(head_fusion: str) -> str:
    """``head_fusion`` if it is one of :data:`HEAD_FUSIONS`, else ``ValueError``."""
    if head_fusion not in HEAD_FUSIONS:
        raise ValueError(f"head_fusion must be one of {HEAD_FUSIONS}, got {head_fusion!r}")
    return head_fusion


def check_discard_ratio(discard_ratio: float) -> float:
    """``discard_ratio`` as a float if it is a number in [0, 1), else ``ValueError``."""
    if isinstance(discard_ratio, bool) or not isinstance(discard_ratio, numbers.Real) or not (
        0.0 <= float(discard_ratio) < 1.0
    ):
        raise ValueError(f"discard_ratio must be in [0, 1), got {discard_ratio!r}")
    return float(discard_ratio)


def fuse_heads(attn: torch.Tensor, head_fusion: str = "mean") -> torch.Tensor:
    """``B x heads x N x N`` -> ``B x N x N`` by the mean, min or max over heads."""
    check_head_fusion(head_fusion)
    if head_fusion == "mean":
        return attn.mean(dim=1)
    if head_fusion == "min":
        return attn.amin(dim=1)
    return attn.amax(dim=1)


def grad_fuse_heads(attn: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """Gradient rollout's head fusion: ``(mean_h A_h * dA_h)`` clamped at 0; ``B x N x N``.

    The mean is taken before the clamp (Gildenblat 2020), unlike Chefer's eq. 5, which
    clamps each head first (:func:`vitlab.relevance.head_averaged_relevance`).
    """
    return (attn * grad).mean(dim=1).clamp(min=0)


def discard_count(num_tokens: int, discard_ratio: float) -> int:
    """How many of a layer's ``N*N`` entries ``discard_ratio`` zeroes: ``int(N*N * ratio)``.

    Raises ``ValueError`` when that leaves at most one entry (``k >= N*N - 1``): with nothing
    but CLS->CLS (or one other entry) left, the map would be all zero. Methods call it with
    the model's number of tokens before the forward pass.
    """
    discard_ratio = check_discard_ratio(discard_ratio)
    N = int(num_tokens)
    k = int(N * N * discard_ratio)
    if k > 0 and k >= N * N - 1:
        raise ValueError(
            f"discard_ratio={discard_ratio!r} would zero {k} of the {N * N} attention entries of each layer "
            f"({N} tokens), leaving at most one: the map would be all zero. For this model use "
            f"discard_ratio < {(N * N - 1) / (N * N):.6g} (Gildenblat's default is 0.9)"
        )
    return k


def discard_lowest(a: torch.Tensor, discard_ratio: float) -> torch.Tensor:
    """Zero each sample's lowest ``int(N*N * discard_ratio)`` entries, never CLS->CLS.

    ``a``: ``B x N x N``. Each sample is ranked on its own; among entries tied with the
    k-th lowest value, the lowest flat indices go first. When the CLS->CLS entry (flat
    index 0) is among the lowest it is kept, so one entry fewer is zeroed. Returns a new
    tensor (``a`` itself when nothing is discarded); ``a`` is not modified. A ratio that
    would leave at most one entry raises ``ValueError`` (:func:`discard_count`).
    """
    B, N, _ = a.shape
    k = discard_count(N, discard_ratio)
    if k == 0:
        return a
    flat = a.reshape(B, N * N)
    # k-th lowest value per sample (a selection, much cheaper than topk / sort for large k)
    kth = flat.kthvalue(k, dim=-1, keepdim=True).values  # B x 1
    below = flat < kth
    tied = flat == kth
    missing = k - below.sum(dim=-1, keepdim=True)  # B x 1, how many tied entries to drop
    drop = below | (tied & (tied.cumsum(dim=-1) <= missing))
    drop[:, 0] = False  # CLS->CLS
    return flat.masked_fill(drop, 0).reshape(B, N, N)


def residual_normalize(a: torch.Tensor) -> torch.Tensor:
    """``(a + I) / 2`` divided by its row sums (``keepdim``: every row sums to 1)."""
    N = a.shape[-1]
    a = (a + torch.eye(N, dtype=a.dtype, device=a.device)) / 2
    return a / a.sum(dim=-1, keepdim=True)


def rollout_matrix(layers: list[torch.Tensor]) -> torch.Tensor:
    """Full rollout ``R = a_L @ ... @ a_1`` of row-normalised ``B x N x N`` layer matrices.

    ``layers[l]`` = :func:`residual_normalize` of block l's fused matrix, first block first.
    """
    R = torch.eye(layers[0].shape[-1], dtype=layers[0].dtype, device=layers[0].device).expand_as(layers[0])
    for a in layers:  # first block first
        R = a @ R
    return R


def _start(like: torch.Tensor, index) -> torch.Tensor:
    """``B x N`` start row: ``e_index`` for an int, else the given weights over the N tokens."""
    B, N = like.shape[0], like.shape[-1]
    if isinstance(index, int):
        r = torch.zeros(B, N, dtype=like.dtype, device=like.device)
        r[:, index] = 1
        return r
    w = torch.as_tensor(index, dtype=like.dtype, device=like.device)
    if w.shape[-1] != N:
        raise ValueError(f"the start weights have {w.shape[-1]} entries, the attention has {N} tokens")
    return w.expand(B, N).clone()


def rollout_row(layers: list[torch.Tensor], index=0) -> torch.Tensor:
    """Row ``index`` of :func:`rollout_matrix`, as ``e_index @ a_L @ ... @ a_1``: ``B x N``.

    ``index`` may also be weights ``w`` over the N tokens (``N`` or ``B x N``): the row
    ``w @ R`` of the token ``sum_i w_i h_i`` (a mean-pooled output,
    :func:`vitlab.attention.readout_weights`); the products are linear in the row."""
    if isinstance(index, int):
        r = layers[-1][:, index, :]  # B x N
    else:
        r = (_start(layers[-1], index).unsqueeze(1) @ layers[-1]).squeeze(1)  # B x N
    for a in reversed(layers[:-1]):
        r = (r.unsqueeze(1) @ a).squeeze(1)  # B x N
    return r


def fused_rollout_row(fused: list[torch.Tensor], index=0) -> torch.Tensor:
    """:func:`rollout_row` straight from the fused matrices, never forming an ``a_l``: ``B x N``.

    ``fused[l]``: block l's head-fused (and discarded) ``B x N x N`` matrix A. With
    ``d = ((A + I) / 2).sum(-1)`` its row sums, a row vector r times
    ``a = diag(1/d) (A + I) / 2`` is ``((r / d) @ A + r / d) / 2``: one row-sum and one
    vector-matrix product per block, from the last block down. ``index``: a token, or
    weights over the tokens (:func:`rollout_row`).
    """
    r = _start(fused[0], index)
    for A in reversed(fused):
        s = r / ((A.sum(dim=-1) + 1) / 2)  # B x N: r over the row sums of (A + I) / 2
        r = ((s.unsqueeze(1) @ A).squeeze(1) + s) / 2  # B x N
    return r


def require_attention_flow(model, method: str) -> None:
    """Raise ``ValueError`` when ``model``'s attention rows are not distributions over the tokens,
    which rollout's flow (``(A + I) / 2``, each row a share of the token's input) needs: CaiT's
    talking-heads attention mixes the heads after the softmax (``proj_w``), so the matrix it
    multiplies with the values has rows of any sign and sum."""
    if any(isinstance(getattr(m, "proj_w", None), torch.nn.Linear) and isinstance(getattr(m, "proj_l", None), torch.nn.Linear)
           for m in model.modules()):
        raise ValueError(
            f"{method} follows attention as a flow (each row a distribution over the tokens), but this model's "
            "talking-heads attention (CaiT) mixes the heads after the softmax, so its rows are not distributions; "
            "use grad_rollout or chefer_relevance, which weigh each attention by its gradient"
        )


def max_normalize(maps: torch.Tensor) -> torch.Tensor:
    """Divide each sample's map (``B x ...``) by its maximum; an all-zero map stays zero."""
    m = maps.flatten(1).amax(dim=1).clamp_min(torch.finfo(maps.dtype).tiny)
    return maps / m.view(-1, *([1] * (maps.ndim - 1)))


def _cls_readout(fused: list[torch.Tensor], layout: TokenLayout, method: str = "rollout") -> torch.Tensor:
    """The row of the token the output reads (CLS, or the mean of the patch tokens) of the
    rollout, patch columns, on the grid, over its max: ``B x gh x gw``."""
    w = readout_weights(layout, method, fused[0].dtype, fused[0].device)
    row = fused_rollout_row(fused, index=w)  # B x N
    return max_normalize(layout.patches_to_grid(row))


def rollout(model, x: torch.Tensor, head_fusion: str = "mean", discard_ratio: float = 0.0) -> torch.Tensor:
    """Attention rollout map of each sample: ``B x gh x gw``, maximum 1 per sample (all zero
    only when the discard leaves no attention path from CLS to a patch).

    Abnar & Zuidema (2020) with the head fusion and discard of Gildenblat (2020): per
    block, ``A = fuse(heads)``; discard each sample's lowest ``discard_ratio`` of entries
    (never CLS->CLS); ``a = (A + I) / 2``, row-normalised; ``R = a_L @ ... @ a_1``; map =
    ``R[CLS, patches]`` on the grid, divided by its maximum. One forward, no gradients (one
    per chunk of a batch over :data:`vitlab.inputs.MEMORY_BUDGET`). For a mean-pooled head
    (timm ``global_pool="avg"``, BEiT, EVA-02) the row of the pooled token ``(1/P) sum_p h_p``:
    ``(1/P) sum_p R[p, patches]``, the mean of the patch tokens' rows
    (:func:`vitlab.inputs.readout_weights`); for an attention-pool head, its probe's row
    (:func:`vitlab.attention.probe_sequence`); for a head on two tokens (a distilled DeiT's two
    heads, Hugging Face Dinov2's classifier over the CLS token and the patch mean) the mean of
    their two rows.

    Args:
        model: a timm or Hugging Face ViT (run in eval mode, its mode put back).
        x: ``B x 3 x H x W`` input batch.
        head_fusion: "mean", "min" or "max".
        discard_ratio: fraction in [0, 1) of each layer's entries to zero; it must leave more
            than one entry (:func:`discard_count`).

    Raises:
        ValueError: bad arguments or input, or a model whose output reads neither a CLS
            token, nor the mean of the patch tokens, nor an attention probe
            (:func:`vitlab.inputs.readout_weights`).
    """
    check_head_fusion(head_fusion)
    check_discard_ratio(discard_ratio)
    layout = checked_layout(model, x, "rollout", pooled=True)
    require_attention_flow(model, "rollout")
    discard_count(layout.num_tokens, discard_ratio)

    def compute(x):
        attentions, layout = recorded_attentions(model, x)
        fused = [discard_lowest(fuse_heads(A, head_fusion), discard_ratio) for A in attentions]  # B x N x N each
        return _cls_readout(fused, layout)
    return in_chunks(compute, model, x, layout)


def grad_rollout(model, x: torch.Tensor, target=None, discard_ratio: float = 0.0, score: str = "logit") -> torch.Tensor:
    """Class-specific gradient rollout (Gildenblat 2020), per sample: ``B x gh x gw``.

    Per block l: ``A = (mean_h A_l * dy_t/dA_l)`` clamped at 0, where y_t is the sample's
    target logit; discard the lowest ``discard_ratio`` (never CLS->CLS); ``(A + I) / 2``,
    row-normalised; multiply as in :func:`rollout`; map = CLS row over the patches,
    divided by its maximum (all zero where no positive path from CLS to a patch is left).
    One forward and one backward for the whole batch (per chunk of a batch over
    :data:`vitlab.inputs.MEMORY_BUDGET`).

    Args:
        model: a timm or Hugging Face ViT classifier (run in eval mode, its mode put back).
        x: ``B x 3 x H x W`` input batch.
        target: int, one class per sample (sequence / 1-D tensor), or None (predicted).
        discard_ratio: fraction in [0, 1) of each layer's entries to zero; it must leave more
            than one entry (:func:`discard_count`).
        score: differentiate the target's ``"logit"`` (the blog) or its ``"log_probability"``.

    Raises:
        ValueError: bad arguments, input or target, a model without a class head, or one
            whose head reads neither a CLS token, nor the mean of the patch tokens, nor an
            attention probe (a pooled head is explained through its row, as in :func:`rollout`).
    """
    method = "grad_rollout"
    check_discard_ratio(discard_ratio)
    layout = checked_layout(model, x, method, pooled=True)
    discard_count(layout.num_tokens, discard_ratio)
    target = gradient_target(model, target, x.shape[0], score, method)

    def compute(x, target):
        ag = recorded_gradients(model, x, target, layers=None, score=score, method=method)
        fused = [
            discard_lowest(grad_fuse_heads(A, G), discard_ratio)  # B x N x N
            for A, G in zip(ag.attentions, ag.gradients)  # layer l with its own gradient
        ]
        return _cls_readout(fused, ag.layout, method)
    return in_chunks(compute, model, x, layout, gradients=True, target=target)


# ---------------------------------------------------------------------------------------------
# Many settings from one recording, graded against masks
# ---------------------------------------------------------------------------------------------


def rollout_from_attentions(attentions: Sequence[torch.Tensor], layout, head_fusion: str = "mean",
                            discard_ratio: float = 0.0) -> torch.Tensor:
    """:func:`vitlab.rollout.rollout` from already recorded attentions: ``B x gh x gw``.

    ``attentions``: one ``B x heads x N x N`` post-softmax tensor per block (first first);
    ``layout``: the model's :class:`~vitlab.layout.TokenLayout`. Same numbers as
    ``rollout(model, x, head_fusion, discard_ratio)``, without another forward.
    """
    check_head_fusion(head_fusion)
    check_discard_ratio(discard_ratio)
    layers = [residual_normalize(discard_lowest(fuse_heads(A, head_fusion), discard_ratio)) for A in attentions]
    w = readout_weights(layout, "rollout_from_attentions", layers[0].dtype, layers[0].device)
    return max_normalize(layout.patches_to_grid(rollout_row(layers, index=w)))


def rollout_settings_maps(model, x: torch.Tensor, settings: Sequence[tuple[str, float]],
                          batch_size: int = 50) -> torch.Tensor:
    """Attention rollout of every input for several settings: ``S x B x gh x gw``.

    ``settings``: ``(head_fusion, discard_ratio)`` pairs. Each batch of ``batch_size``
    inputs is recorded once and every setting is computed from that recording
    (:func:`rollout_from_attentions`); entry ``[s]`` equals
    ``vitlab.rollout.rollout(model, x, *settings[s])``.
    """
    settings = [(str(f), float(d)) for f, d in settings]
    if not settings:
        raise ValueError("settings must hold at least one (head_fusion, discard_ratio) pair")
    per_batch = []
    require_attention_flow(model, "rollout_settings_maps")
    for s in batches(x.shape[0], batch_size):
        attentions, layout = recorded_attentions(model, x[s])
        readout_weights(layout, "rollout_settings_maps")
        per_batch.append(torch.stack([rollout_from_attentions(attentions, layout, f, d) for f, d in settings]))
    return torch.cat(per_batch, dim=1)


def grade_rollout_settings(model, x: torch.Tensor, masks, settings: Sequence[tuple[str, float]],
                           batch_size: int = 50, min_coverage: float = 0.5) -> list[dict]:
    """Pointing game and mass on the object of attention rollout, for several settings at once.

    Args:
        model: a ViT with a class token (eval mode).
        x: ``B x 3 x H x W`` inputs; ``masks``: ``B x H' x W'`` one object mask per input.
        settings: ``(head_fusion, discard_ratio)`` pairs.
        batch_size: inputs per forward (:func:`rollout_settings_maps`: one recording per
            batch serves every setting).
        min_coverage: see :func:`pointing_game`.

    Returns one dict per setting, in order: ``head_fusion``, ``discard_ratio`` and the
    scores of :func:`grade_maps` (``pointing``, ``touch``, ``mass``, ``n``).
    """
    from vitlab.localization import as_cpu_tensor, grade_maps

    masks = as_cpu_tensor(masks)
    if masks.ndim != 3 or masks.shape[0] != x.shape[0]:
        raise ValueError(f"need one B x H x W mask per input: {x.shape[0]} inputs, masks {tuple(masks.shape)}")
    maps = rollout_settings_maps(model, x, settings, batch_size)
    return [{"head_fusion": str(f), "discard_ratio": float(d), **grade_maps(m, masks, min_coverage)}
            for (f, d), m in zip(settings, maps)]
