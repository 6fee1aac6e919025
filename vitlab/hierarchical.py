"""Attention maps of hierarchical (Swin) transformers: rollout and Chefer relevance through the
windows and the stages, raw attention and a stage-aware GradCAM, for timm ``SwinTransformer``
and Hugging Face ``SwinForImageClassification``.

A Swin classifier differs from a ViT in three ways, and each has a definition here:

1. **Windows.** Each block attends inside windows (shifted in every other block).
   :mod:`vitlab.record.swin` records every block's attention scattered into its stage's full
   ``N x N`` token matrix (0 for a pair that shared no window), so a block is an ordinary
   token-to-token matrix and the ViT rules apply to it unchanged: rollout's ``(A + I) / 2``
   row-normalised, Chefer's ``R <- R + mean_h (grad ⊙ A)^+ R``.
2. **Patch merging.** Between stages every 2 x 2 group of tokens becomes one token (a linear map
   of the four concatenated). It is carried as a pooling matrix ``P`` (``N_next x N``,
   :func:`merge_matrix`): ``P[m, n] = 1/4`` when token n is one of the four below merged token m
   (``1/k`` for the k real tokens below m at an odd border), else 0. A merged token's rollout row
   and relevance row are the mean of its children's rows: ``R <- P R``. The merge is treated as
   an attention layer in which each merged token attends equally to the tokens it was made of,
   with no residual (a merged token has no earlier self). The mean keeps the sum of a row (a
   rollout row stays a distribution); weighting the children by ``1`` instead would multiply
   every map by 4 per merge and change nothing else.
3. **Pooled head.** The head reads the mean of the last stage's tokens, so the row that explains
   the output is the mean of the last stage's rows: ``(1/N_L) 1^T R``.

Together, with ``S_s`` the product of stage s's block matrices (last block on the left; rollout:
``a_b = rownorm((mean_h A_b + I) / 2)``, relevance: ``I + Abar_b``), the map of the output over
the first stage's tokens is

    ``m = (1/N_L) 1^T  S_L  P_{L-1}  S_{L-1}  ...  P_1  S_1``      (length ``N_1``)

computed right to left as a row vector (``r <- r a`` / ``r <- r + r Abar`` per block from the
last down, ``r <- r P`` at a merge): no ``N x N`` products. The maps are on the first stage's
grid (the patch grid).

Raw attention of a pooled head: the last block's attention averaged over heads and over its
query tokens (every token the head averages), on the last stage's grid.

GradCAM (stage-aware, :func:`swin_gradcam`): gradient-weighted **activations** of a stage's
output tokens, by default the last stage's -- the feature map the head average-pools, which is
GradCAM's own setting (a CNN's last feature map): channel weights ``w_c`` = the target's gradient
averaged over the stage's tokens, map = ``relu(sum_c w_c F[:, c])``. Activations, not attention:
the head reads the tokens themselves, and a Swin has no class-token row of attention to weight
(the ViT GradCAM of :func:`vitlab.attention.attention_gradcam` weights the CLS row); the last
block's attention would first need a choice of query rows.

Every method works per sample on a batch (one forward and one backward for the batch),
refuses non-finite or empty input before the forward, runs the model in eval mode with its
state put back, and explains the target's logit (or its log-probability, ``score=``).
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch
from torch import nn

from vitlab.inputs import batches, check_images, check_input_dtype, gradient_leaf, require_gradients
from vitlab.record import record
from vitlab.record.swin import SwinCapture, scatter_windows, swin_blocks
from vitlab.rollout import check_head_fusion, fuse_heads, residual_normalize
from vitlab.relevance.engine import head_averaged_relevance
from vitlab.targets import (
    check_score, check_target, is_multi_label, logits_of, require_class_head, resolve_target, target_score,
)

__all__ = [
    "SWIN_METHODS", "SwinGradients", "merge_matrix", "pooled_rows", "require_swin", "stage_grids",
    "swin_asked_object_maps", "swin_attention_gradients", "swin_gradcam", "swin_maps_from_gradients",
    "swin_raw_attention", "swin_relevance", "swin_rollout",
]

#: The maps :func:`swin_maps_from_gradients` computes.
SWIN_METHODS = ("raw attention", "rollout", "GradCAM", "Chefer relevance")


class SwinGradients(NamedTuple):
    """One forward and backward of a Swin classifier: every block's scattered attention and its
    gradient (``B x heads x N_s x N_s``, detached), the blocks' geometry, the chosen stage's
    output tokens and their gradient (``B x N_s x C``, for GradCAM), the targets and logits."""

    attentions: list[torch.Tensor]
    gradients: list[torch.Tensor]
    captures: list[SwinCapture]
    features: torch.Tensor
    feature_grads: torch.Tensor
    feature_grid: tuple[int, int]
    target: torch.Tensor
    logits: torch.Tensor


def require_swin(model: nn.Module, method: str) -> None:
    """``TypeError`` unless ``model`` is a timm or Hugging Face Swin transformer."""
    if not isinstance(model, nn.Module) or not swin_blocks(model):
        raise TypeError(
            f"{method} explains Swin transformers (timm SwinTransformer, Hugging Face SwinForImageClassification); "
            f"got {type(model).__name__}. For a ViT use vitlab.rollout / vitlab.relevance.chefer_relevance")


def _check(model, x, method: str) -> None:
    require_swin(model, method)
    check_images(x, method)
    check_input_dtype(model, x, method)


def merge_matrix(grid: tuple[int, int], dtype=torch.float32, device=None) -> torch.Tensor:
    """Patch merging as a pooling matrix, ``N_next x N`` for an ``h x w`` grid (``N = h * w``,
    ``N_next = ceil(h/2) * ceil(w/2)``, both row-major): ``P[m, n] = 1 / k`` when token n is one of
    the ``k`` tokens of the 2 x 2 group below merged token m (``k = 4`` inside the grid; fewer at
    an odd border, where the model pads with zeros), else 0. Rows sum to 1."""
    h, w = grid
    H2, W2 = (h + 1) // 2, (w + 1) // 2
    r = torch.arange(h, device=device)
    c = torch.arange(w, device=device)
    parent = ((r[:, None] // 2) * W2 + c[None, :] // 2).reshape(-1)   # merged token of each token
    P = torch.zeros(H2 * W2, h * w, dtype=dtype, device=device)
    P[parent, torch.arange(h * w, device=device)] = 1.0
    return P / P.sum(1, keepdim=True)


def stage_grids(captures: list[SwinCapture]) -> list[tuple[int, int]]:
    """The grid of each stage, in order, from the recorded blocks."""
    grids: list[tuple[int, int]] = []
    for cap in captures:
        if cap.stage >= len(grids):
            grids.append(cap.grid)
    return grids


def pooled_rows(blocks: list[torch.Tensor], captures: list[SwinCapture], residual: bool) -> torch.Tensor:
    """The row of the mean-pooled output through every block and merge: ``B x N_1``.

    ``blocks[l]``: block l's ``B x N_s x N_s`` matrix; ``residual``: the block acts as
    ``I + blocks[l]`` (Chefer's rule) rather than as ``blocks[l]`` (rollout). Starts from the
    mean of the last stage's rows and walks back: ``r <- r M`` per block, ``r <- r P`` per merge
    (see the module docstring).
    """
    last = blocks[-1]
    r = torch.full(last.shape[:2], 1.0 / last.shape[-1], dtype=last.dtype, device=last.device)  # B x N_L
    for l in range(len(blocks) - 1, -1, -1):
        cap = captures[l]
        if l < len(blocks) - 1 and captures[l + 1].stage != cap.stage:  # a merge lies between l and l+1
            P = merge_matrix(cap.grid, dtype=r.dtype, device=r.device)
            if P.shape[0] != r.shape[-1]:
                raise ValueError(f"stage {cap.stage + 1} has {r.shape[-1]} tokens, but merging the {cap.grid} grid "
                                 f"of stage {cap.stage} gives {P.shape[0]}")
            r = r @ P
        step = (r.unsqueeze(1) @ blocks[l]).squeeze(1)
        r = r + step if residual else step
    return r


def _grid(row: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
    return row.reshape(row.shape[0], *grid)


def _forward(model, x, *, target=None, score="logit", gradients: bool, stage: int = -1,
             method: str) -> SwinGradients:
    """The recorded forward (and with ``gradients`` the backward) every method runs."""
    _check(model, x, method)
    if gradients:
        require_class_head(model, method)
        target = check_target(target, x.shape[0])
        check_score(score)
        require_gradients(method)
    n_stages = len({s for s, *_ in swin_blocks(model)})
    if not isinstance(stage, int) or isinstance(stage, bool) or not -n_stages <= stage < n_stages:
        raise ValueError(f"stage must be an int in {-n_stages} .. {n_stages - 1} ({n_stages} stages), got {stage!r}")
    stage %= n_stages
    with torch.enable_grad() if gradients else torch.no_grad():
        x_in = gradient_leaf(x, requires_grad=gradients)
        capture = ("attention", "hidden") if gradients else ("attention",)
        with record(model, detach=not gradients, eval_mode=True, capture=capture) as rec:
            out = model(x_in)
            caps = list(rec.stream("self"))
        if not gradients:
            return SwinGradients([c.attention for c in caps], [], caps, None, None, caps[-1].grid, None, None)
        logits = logits_of(out)
        t = resolve_target(target, logits)
        total = target_score(logits, t, score, is_multi_label(model)).sum()
        feat_cap = [c for c in caps if c.stage == stage][-1]
        grads = torch.autograd.grad(total, [c.window_attention for c in caps] + [feat_cap.hidden])
    B = x.shape[0]
    dense_grads = [scatter_windows(g, c.index, B, c.grid[0] * c.grid[1]) for g, c in zip(grads[:-1], caps)]
    C = feat_cap.hidden.shape[-1]
    features = feat_cap.hidden.detach().reshape(B, -1, C)
    for c in caps:  # keep no autograd graph alive through the captures
        c.attention, c.window_attention, c.hidden = c.attention.detach(), c.window_attention.detach(), None
    return SwinGradients([c.attention for c in caps], dense_grads, caps, features,
                         grads[-1].detach().reshape(B, -1, C), feat_cap.grid, t, logits.detach())


def swin_attention_gradients(model, x: torch.Tensor, target=None, score: str = "logit",
                             stage: int = -1) -> SwinGradients:
    """Every block's scattered attention and ``d(target score)/d(attention)``, and stage
    ``stage``'s output tokens with their gradient: one forward, one backward for the batch
    (gradients with respect to the recorded tensors only: no parameter's ``.grad`` is touched).

    Args:
        model: a timm or Hugging Face Swin classifier (run in eval mode, its mode put back).
        x: ``B x 3 x H x W`` input batch (non-empty, finite).
        target: int, one class per sample, or None (predicted).
        score: ``"logit"`` or ``"log_probability"`` (:data:`vitlab.targets.SCORES`).
        stage: whose output tokens to return for GradCAM (default the last).
    """
    return _forward(model, x, target=target, score=score, gradients=True, stage=stage,
                    method="swin_attention_gradients")


def swin_maps_from_gradients(g: SwinGradients, head_fusion: str = "mean") -> dict[str, torch.Tensor]:
    """Every map of :data:`SWIN_METHODS` from one :func:`swin_attention_gradients`: raw attention
    and GradCAM on the last (GradCAM: the chosen) stage's grid, rollout and Chefer relevance on the
    first stage's grid; each ``B x gh x gw``."""
    check_head_fusion(head_fusion)
    first, last = g.captures[0].grid, g.captures[-1].grid
    return {
        "raw attention": _grid(g.attentions[-1].mean(1).mean(1), last),
        "rollout": _grid(pooled_rows([residual_normalize(fuse_heads(A, head_fusion)) for A in g.attentions],
                                     g.captures, residual=False), first),
        "GradCAM": _grid(_gradcam(g.features, g.feature_grads), g.feature_grid),
        "Chefer relevance": _grid(pooled_rows([head_averaged_relevance(A, G) for A, G in zip(g.attentions, g.gradients)],
                                              g.captures, residual=True), first),
    }


def _gradcam(features: torch.Tensor, grads: torch.Tensor) -> torch.Tensor:
    """``relu(sum_c w_c F[:, n, c])`` with ``w_c = mean_n grad[:, n, c]``: ``B x N``."""
    w = grads.mean(dim=1, keepdim=True)            # B x 1 x C
    return (features * w).sum(-1).clamp(min=0)      # B x N


def swin_relevance(model, x: torch.Tensor, target=None, score: str = "logit") -> torch.Tensor:
    """Chefer et al.'s relevance through the windows and the stages: ``B x gh x gw`` on the first
    stage's grid (the patch grid), in relevance units (not rescaled).

    Per block ``R <- R + mean_h (dy_t/dA ⊙ A)^+ R`` on the block's scattered token matrix, per
    patch merging ``R <- P R`` (:func:`merge_matrix`), read at the mean of the last stage's rows
    (the head's average pool); see the module docstring. One forward and one backward.
    """
    g = _forward(model, x, target=target, score=score, gradients=True, method="swin_relevance")
    rows = pooled_rows([head_averaged_relevance(A, G) for A, G in zip(g.attentions, g.gradients)], g.captures, True)
    return _grid(rows, g.captures[0].grid)


def swin_rollout(model, x: torch.Tensor, head_fusion: str = "mean") -> torch.Tensor:
    """Attention rollout (Abnar & Zuidema 2020) through the windows and the stages: ``B x gh x gw``
    on the first stage's grid; each row of the mean-pooled output sums to 1 over the patches.

    Per block ``a = rownorm((fuse_h A + I) / 2)`` on the scattered token matrix, per merge the
    pooling matrix, read at the mean of the last stage's rows. One forward, no gradients.
    """
    check_head_fusion(head_fusion)
    g = _forward(model, x, gradients=False, method="swin_rollout")
    rows = pooled_rows([residual_normalize(fuse_heads(A, head_fusion)) for A in g.attentions], g.captures, False)
    return _grid(rows, g.captures[0].grid)


def swin_raw_attention(model, x: torch.Tensor) -> torch.Tensor:
    """The last block's attention averaged over heads and over its query tokens (the tokens the
    pooled head averages): ``B x gh x gw`` on the last stage's grid. One forward."""
    g = _forward(model, x, gradients=False, method="swin_raw_attention")  # B x heads x N x N last
    return _grid(g.attentions[-1].mean(1).mean(1), g.captures[-1].grid)


def swin_gradcam(model, x: torch.Tensor, target=None, score: str = "logit", stage: int = -1) -> torch.Tensor:
    """GradCAM on a stage's output tokens (default the last stage, the feature map the head
    pools): ``relu(sum_c w_c F[:, c])``, ``w_c`` the target's gradient averaged over the stage's
    tokens; ``B x gh x gw`` on that stage's grid. One forward and one backward."""
    g = _forward(model, x, target=target, score=score, gradients=True, stage=stage, method="swin_gradcam")
    return _grid(_gradcam(g.features, g.feature_grads), g.feature_grid)


def swin_asked_object_maps(model, x: torch.Tensor, labels, batch_size: int = 50, score: str = "logit",
                           head_fusion: str = "mean") -> dict[str, torch.Tensor]:
    """Every map of :data:`SWIN_METHODS` for every input and every class in ``labels`` (``B x K``):
    method -> ``B x K x gh x gw`` (the Swin counterpart of
    :func:`vitlab.relevance.asked_object_maps`; one forward and backward per batch covers the K asks)."""
    labels = torch.as_tensor(np.asarray(labels), dtype=torch.long)
    if labels.ndim != 2 or labels.shape[0] != x.shape[0]:
        raise ValueError(f"need labels B x K for B = {x.shape[0]} inputs; got labels {tuple(labels.shape)}")
    B, K = labels.shape
    out: dict[str, list] = {m: [] for m in SWIN_METHODS}
    for s in batches(B, batch_size):
        b = s.stop - s.start
        g = swin_attention_gradients(model, x[s].repeat(K, 1, 1, 1), labels[s].T.reshape(-1), score=score)
        for name, m in swin_maps_from_gradients(g, head_fusion).items():
            out[name].append(m.reshape(K, b, *m.shape[1:]).transpose(0, 1))
    return {name: torch.cat(v) for name, v in out.items()}
