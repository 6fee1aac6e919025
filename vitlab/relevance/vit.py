"""Chefer et al. (2021) relevance for a ViT: the engine of :mod:`vitlab.relevance.engine` with one
modality (eq. 6 over every block), read at the CLS row; and the same rule on the last block alone
(:func:`last_block_relevance`), the single-block baseline that isolates what aggregating the
blocks adds."""
from __future__ import annotations

import numpy as np
import torch

from vitlab.attention import attention_gradients, gradcam_cls_row, recorded_gradients
from vitlab.inputs import batches, checked_layout, gradient_target, in_chunks, readout_weights, require_cls
from vitlab.methods import display_names
from vitlab.relevance.engine import head_averaged_relevance, propagate, self_attention_events
from vitlab.rollout import (
    discard_lowest, grad_fuse_heads, max_normalize, residual_normalize, rollout_from_attentions, rollout_row,
)


# --- the ViT case: one modality --------------------------------------------------------------------
def relevance_matrix(attentions: list[torch.Tensor], gradients: list[torch.Tensor]) -> torch.Tensor:
    """``R^{ss}`` after all blocks: start from I (eq. 1), apply eq. 5-6 per block in order.

    ``attentions[l]``, ``gradients[l]``: ``B x heads x N x N`` of block l (first block
    first). Returns ``B x N x N``: :func:`propagate` with one modality.
    """
    N = attentions[0].shape[-1]
    return propagate(self_attention_events("tokens", attentions, gradients), {"tokens": N})["tokens", "tokens"]


def relevance_row(attentions: list[torch.Tensor], gradients: list[torch.Tensor], index=0) -> torch.Tensor:
    """Row ``index`` of :func:`relevance_matrix`, without the N x N products: ``B x N``.

    After all blocks ``R = (I + Abar_L) ... (I + Abar_1)``, so its row i is
    ``e_i (I + Abar_L) ... (I + Abar_1)``: a row vector updated as ``r <- r + r · Abar``
    from the last block down -- the same numbers for N times less work.

    ``index`` may also be weights ``w`` over the N tokens (``N`` or ``B x N``): the row
    ``w R`` of the token ``sum_i w_i h_i``. A mean-pooled head reads
    ``(1/P) sum_p h_p``; row p of R says how relevant each input token is to the output
    token p, and the pooled token is made of the patch tokens in equal shares, so its row is
    ``(1/P) sum_p R[p]`` (:func:`vitlab.attention.readout_weights`; the prefix rows get weight 0).
    The update is linear in r, so ``w R`` is computed the same way.
    """
    B, _, N, _ = attentions[0].shape
    r = torch.zeros(B, N, dtype=attentions[0].dtype, device=attentions[0].device)
    if isinstance(index, int):
        r[:, index] = 1
    else:
        r = r + torch.as_tensor(index, dtype=r.dtype, device=r.device)
    for A, G in zip(reversed(attentions), reversed(gradients), strict=True):
        r = r + (r.unsqueeze(1) @ head_averaged_relevance(A, G)).squeeze(1)  # B x N
    return r


def chefer_relevance(model, x: torch.Tensor, target=None, score: str = "logit") -> torch.Tensor:
    """Class-specific relevance of each patch (Chefer, Gur & Wolf 2021, eq. 5-6): ``B x gh x gw``.

    ``R = I``; per block ``R += mean_h (dy_t/dA ⊙ A)^+ · R``, with y_t the sample's target
    logit; the map is ``R[CLS, patches]`` on the patch grid, not rescaled (relevance
    units; the CLS->CLS entry is left out with the other prefix tokens). One forward and
    one backward for the whole batch (per chunk of a batch over
    :data:`vitlab.inputs.MEMORY_BUDGET`). For a mean-pooled head (timm ``global_pool="avg"``,
    BEiT, EVA-02, SigLIP's classifier) the row of the pooled token ``(1/P) sum_p h_p``:
    ``(1/P) sum_p R[p, patches]`` (:func:`relevance_row` with weights); for an attention-pool
    head, its probe's row; for CaiT, its class token through the class-attention blocks; for a head
    on two tokens (a distilled DeiT's two heads, Hugging Face Dinov2's classifier over the CLS token
    and the patch mean) the mean of their two rows (:meth:`vitlab.layout.TokenLayout.readout`).

    Args:
        model: a timm or Hugging Face ViT classifier (run in eval mode, its mode put back).
        x: ``B x 3 x H x W`` input batch.
        target: int, one class per sample (sequence / 1-D tensor), None (predicted), or a
            function of the output returning one score per sample (:mod:`vitlab.targets`).
        score: differentiate the target's ``"logit"`` (the paper) or its ``"log_probability"``.
    """
    method = "chefer_relevance"
    layout = checked_layout(model, x, method, pooled=True)
    target = gradient_target(model, target, x.shape[0], score, method)

    def compute(x, target):
        ag = recorded_gradients(model, x, target, layers=None, score=score, method=method)
        w = readout_weights(ag.layout, method, ag.attentions[0].dtype, ag.attentions[0].device)
        row = relevance_row(ag.attentions, ag.gradients, index=w)  # R[CLS, :] (or the pooled row), B x N
        return ag.layout.patches_to_grid(row)  # B x gh x gw
    return in_chunks(compute, model, x, layout, gradients=True, target=target)


def last_block_relevance(model, x: torch.Tensor, target=None, score: str = "logit") -> torch.Tensor:
    """Chefer et al.'s rule on the last block only: ``mean_h (dy_t/dA_L ⊙ A_L)^+``, CLS row: ``B x gh x gw``.

    Eq. 5 of Chefer, Gur & Wolf (ICCV 2021, "Generic Attention-model Explainability") on the
    last block's attention ``A_L`` (each head clamped at 0 before the mean over heads), read at
    the CLS row over the patch columns. It is :func:`chefer_relevance` with every block but
    the last left out (``R = I + Abar_L``: the CLS row of R over the patches is
    ``Abar_L[CLS, patches]``), so it differs from that method in one thing only, the number of
    blocks, and from :func:`vitlab.attention.raw_attention` (``mean_h A_L``) in one thing only,
    the gradient weighting. :func:`vitlab.attention.attention_gradcam` also weights the last
    block by its gradient, but with one mean gradient per head (GradCAM's weighting). Not
    rescaled (relevance units, like :func:`chefer_relevance`); a patch whose every head has
    ``grad * A <= 0`` is 0. One forward and one backward through the last block for the whole
    batch (per chunk of a batch over :data:`vitlab.inputs.MEMORY_BUDGET`).

    Args:
        model: a timm or Hugging Face ViT classifier (run in eval mode, its mode put back).
        x: ``B x 3 x H x W`` input batch (non-empty, finite).
        target: int, one class per sample (sequence / 1-D tensor), or None (predicted).
        score: differentiate the target's ``"logit"`` (the paper) or its ``"log_probability"``.

    Raises:
        ValueError: a bad input or target, a model without a class head, or one whose head
            does not read a CLS token -- all before the forward.
    """
    method = "last_block_relevance"
    layout = checked_layout(model, x, method, pooled=True)
    target = gradient_target(model, target, x.shape[0], score, method)

    def compute(x, target):
        ag = recorded_gradients(model, x, target, layers=[-1], score=score, method=method)
        abar = head_averaged_relevance(ag.attentions[-1], ag.gradients[-1])  # B x N x N
        w = readout_weights(ag.layout, method, abar.dtype, abar.device)
        return ag.layout.patches_to_grid(w @ abar)  # CLS (or pooled) row, patch columns: B x gh x gw
    return in_chunks(compute, model, x, layout, gradients=True, target=target)


# ---------------------------------------------------------------------------------------------
# Every class-specific map of chapter 4 from one recording, graded against masks
# ---------------------------------------------------------------------------------------------


#: The methods :func:`maps_from_gradients` computes, class-agnostic ones first: the display names
#: (:mod:`vitlab.methods`) of raw_attention, rollout, gradcam, grad_rollout and relevance.
CLASS_METHODS = display_names("raw_attention", "rollout", "gradcam", "grad_rollout", "relevance")


def maps_from_gradients(ag, rollout_setting: tuple[str, float] = ("mean", 0.0),
                        grad_discard_ratio: float = 0.0) -> dict[str, torch.Tensor]:
    """Every map of :data:`CLASS_METHODS` from one :func:`vitlab.attention.attention_gradients`.

    Same numbers as ``raw_attention``, ``rollout(model, x, *rollout_setting)``,
    ``attention_gradcam``, ``grad_rollout(model, x, target, grad_discard_ratio)`` and
    ``chefer_relevance`` called on the model, each ``B x gh x gw``; the first two do not
    depend on the target class.
    """
    layout = ag.layout
    require_cls(layout, "maps_from_gradients")
    P = layout.num_prefix
    A_last, G_last = ag.attentions[-1], ag.gradients[-1]
    grad_layers = [residual_normalize(discard_lowest(grad_fuse_heads(A, G), grad_discard_ratio))
                   for A, G in zip(ag.attentions, ag.gradients)]
    return dict(zip(CLASS_METHODS, (
        layout.patches_to_grid(A_last[:, :, 0, :].mean(dim=1)),
        rollout_from_attentions(ag.attentions, layout, *rollout_setting),
        layout.patches_to_grid(gradcam_cls_row(A_last[:, :, 0, P:], G_last[:, :, 0, P:])),
        max_normalize(layout.patches_to_grid(rollout_row(grad_layers, index=0))),
        layout.patches_to_grid(relevance_matrix(ag.attentions, ag.gradients)[:, 0, :]),
    )))


def asked_object_maps(model, x: torch.Tensor, labels, batch_size: int = 50,
                      rollout_setting: tuple[str, float] = ("mean", 0.0),
                      grad_discard_ratio: float = 0.0, score: str = "logit") -> dict[str, torch.Tensor]:
    """Every map of :data:`CLASS_METHODS` for every input and every class in ``labels``.

    ``labels``: ``B x K`` classes (e.g. the K objects of each scene). Returns method ->
    ``B x K x gh x gw``, entry ``[b, k]`` being the map of input b asked for class
    ``labels[b, k]`` (:func:`maps_from_gradients`). One forward and one backward per batch
    covers all K asks (the batch is repeated K times). ``score``: what the gradients
    differentiate, the asked class's ``"logit"`` or its ``"log_probability"``.
    """
    labels = torch.as_tensor(np.asarray(labels), dtype=torch.long)
    if labels.ndim != 2 or labels.shape[0] != x.shape[0]:
        raise ValueError(f"need labels B x K for B = {x.shape[0]} inputs; got labels {tuple(labels.shape)}")
    B, K = labels.shape
    out = {m: [] for m in CLASS_METHODS}
    for s in batches(B, batch_size):
        b = s.stop - s.start
        xb = x[s].repeat(K, 1, 1, 1)  # ask k occupies rows k*b .. (k+1)*b - 1
        ag = attention_gradients(model, xb, labels[s].T.reshape(-1), score=score)
        for name, m in maps_from_gradients(ag, rollout_setting, grad_discard_ratio).items():
            out[name].append(m.reshape(K, b, *m.shape[1:]).transpose(0, 1))  # b x K x gh x gw
    return {name: torch.cat(v) for name, v in out.items()}


def grade_asked_object(model, x: torch.Tensor, labels, masks, batch_size: int = 50, min_coverage: float = 0.5,
                       rollout_setting: tuple[str, float] = ("mean", 0.0),
                       grad_discard_ratio: float = 0.0) -> list[dict]:
    """For every method of :data:`CLASS_METHODS`: does the map point at the object of the asked class?

    Each scene holds K objects (``labels``: ``B x K`` classes, ``masks``: ``B x K x H x W``).
    Each object is asked for in turn (``target`` = its class); a method scores a hit when
    the highest patch of its map lies on the asked object (:func:`pointing_game`).
    :func:`asked_object_maps` then :func:`grade_asked`; see the latter for the keys.
    """
    from vitlab.localization import as_cpu_tensor, grade_asked

    labels = torch.as_tensor(np.asarray(labels), dtype=torch.long)
    masks = as_cpu_tensor(masks)
    if labels.ndim != 2 or masks.ndim != 4 or masks.shape[:2] != labels.shape or labels.shape[0] != x.shape[0]:
        raise ValueError(
            f"need labels B x K and masks B x K x H x W for B = {x.shape[0]} inputs; "
            f"got labels {tuple(labels.shape)}, masks {tuple(masks.shape)}"
        )
    maps = asked_object_maps(model, x, labels, batch_size, rollout_setting, grad_discard_ratio)
    return grade_asked(maps, masks, min_coverage)
