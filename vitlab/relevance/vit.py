"""Chefer et al. (2021) relevance for a ViT: the engine of :mod:`vitlab.relevance.engine` with one
modality (eq. 6 over every block), read at the CLS row; and the same rule on the last block alone
(:func:`last_block_relevance`), the single-block baseline that isolates what aggregating the
blocks adds."""
from __future__ import annotations


import torch

from vitlab.attention import _attention_gradients, _in_chunks, checked_layout
from vitlab.relevance.engine import head_averaged_relevance, propagate, self_attention_events


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
    batch (per chunk of a batch over :data:`vitlab.attention.MEMORY_BUDGET`).

    Args:
        model: a timm or Hugging Face ViT classifier (run in eval mode, its mode put back).
        x: ``B x 3 x H x W`` input batch (non-empty, finite).
        target: int, one class per sample (sequence / 1-D tensor), or None (predicted).
        score: differentiate the target's ``"logit"`` (the paper) or its ``"log_probability"``.

    Raises:
        ValueError: a bad input or target, a model without a class head, or one whose head
            does not read a CLS token -- all before the forward.
    """
    layout = checked_layout(model, x, "last_block_relevance")
    chunked = _in_chunks(last_block_relevance, model, x, layout, gradients=True, target=target, score=score)
    if chunked is not None:  # a batch larger than vitlab.attention.MEMORY_BUDGET allows
        return chunked
    ag = _attention_gradients(model, x, target, layers=[-1], score=score, method="last_block_relevance")
    abar = head_averaged_relevance(ag.attentions[-1], ag.gradients[-1])  # B x N x N
    return ag.layout.patches_to_grid(abar[:, 0, :])  # CLS row, patch columns: B x gh x gw
