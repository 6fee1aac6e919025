"""Helpers the notebooks use to compute and grade many maps at once.

Not methods of their own: they call the methods of :mod:`vitlab.attention`,
:mod:`vitlab.rollout` and :mod:`vitlab.relevance` (which record each batch through
:mod:`vitlab.record`), compute every setting or method from the same recorded attention (and
gradient), and grade the maps with :mod:`vitlab.localization`. A table of many settings costs
one forward (and one backward) per batch.
"""
from __future__ import annotations

from typing import NamedTuple, Sequence

import numpy as np
import torch

from vitlab.faithfulness import _batches
from vitlab.localization import (
    _as_tensor, attention_entropy, grade_asked, grade_maps, layer_mass_on_object, object_area, pointing_game,
)


class CLSProfile(NamedTuple):
    """Where the class token looks, layer by layer, from :func:`cls_attention_profile`.

    Attributes:
        mass: ``B x layers x heads`` share of each head's CLS-to-patch attention on the object.
        entropy: ``B x layers x heads`` normalised entropy of the same maps (1 = uniform).
        area: ``B`` object area share (the chance level of ``mass``).
    """

    mass: torch.Tensor
    entropy: torch.Tensor
    area: torch.Tensor


def cls_attention_profile(model, x: torch.Tensor, masks, batch_size: int = 50) -> CLSProfile:
    """Per sample, layer and head: the class token's attention share on the object and its entropy.

    ``x``: ``B x 3 x H x W`` inputs; ``masks``: ``B x H' x W'`` object masks at the model's
    input resolution (or any multiple of the patch grid). One forward per batch of
    ``batch_size`` (:func:`vitlab.attention.cls_attention`).
    """
    from vitlab.attention import cls_attention

    masks = _as_tensor(masks)
    if masks.ndim != 3 or masks.shape[0] != x.shape[0]:
        raise ValueError(f"need one B x H x W mask per input: {x.shape[0]} inputs, masks {tuple(masks.shape)}")
    mass, entropy = [], []
    for s in _batches(x.shape[0], batch_size):
        cls = cls_attention(model, x[s])  # b x L x heads x gh x gw
        mass.append(layer_mass_on_object(cls, masks[s]))
        entropy.append(attention_entropy(cls))
    return CLSProfile(torch.cat(mass), torch.cat(entropy), object_area(masks))


def rollout_from_attentions(attentions: Sequence[torch.Tensor], layout, head_fusion: str = "mean",
                            discard_ratio: float = 0.0) -> torch.Tensor:
    """:func:`vitlab.rollout.rollout` from already recorded attentions: ``B x gh x gw``.

    ``attentions``: one ``B x heads x N x N`` post-softmax tensor per block (first first);
    ``layout``: the model's :class:`~vitlab.layout.TokenLayout`. Same numbers as
    ``rollout(model, x, head_fusion, discard_ratio)``, without another forward.
    """
    from vitlab.rollout import (
        check_discard_ratio, check_head_fusion, discard_lowest, fuse_heads, max_normalize, residual_normalize,
        rollout_row,
    )

    check_head_fusion(head_fusion)
    check_discard_ratio(discard_ratio)
    layers = [residual_normalize(discard_lowest(fuse_heads(A, head_fusion), discard_ratio)) for A in attentions]
    return max_normalize(layout.patches_to_grid(rollout_row(layers, index=0)))

def rollout_settings_maps(model, x: torch.Tensor, settings: Sequence[tuple[str, float]],
                          batch_size: int = 50) -> torch.Tensor:
    """Attention rollout of every input for several settings: ``S x B x gh x gw``.

    ``settings``: ``(head_fusion, discard_ratio)`` pairs. Each batch of ``batch_size``
    inputs is recorded once and every setting is computed from that recording
    (:func:`rollout_from_attentions`); entry ``[s]`` equals
    ``vitlab.rollout.rollout(model, x, *settings[s])``.
    """
    from vitlab.attention import _recorded_attentions, require_cls

    settings = [(str(f), float(d)) for f, d in settings]
    if not settings:
        raise ValueError("settings must hold at least one (head_fusion, discard_ratio) pair")
    per_batch = []
    for s in _batches(x.shape[0], batch_size):
        attentions, layout = _recorded_attentions(model, x[s])
        require_cls(layout, "rollout_settings_maps")
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
    masks = _as_tensor(masks)
    if masks.ndim != 3 or masks.shape[0] != x.shape[0]:
        raise ValueError(f"need one B x H x W mask per input: {x.shape[0]} inputs, masks {tuple(masks.shape)}")
    maps = rollout_settings_maps(model, x, settings, batch_size)
    return [{"head_fusion": str(f), "discard_ratio": float(d), **grade_maps(m, masks, min_coverage)}
            for (f, d), m in zip(settings, maps)]


#: The methods :func:`maps_from_gradients` computes, class-agnostic ones first.
CLASS_METHODS = ("raw attention", "rollout", "GradCAM", "gradient rollout", "Chefer relevance")


def maps_from_gradients(ag, rollout_setting: tuple[str, float] = ("mean", 0.0),
                        grad_discard_ratio: float = 0.0) -> dict[str, torch.Tensor]:
    """Every map of :data:`CLASS_METHODS` from one :func:`vitlab.attention.attention_gradients`.

    Same numbers as ``raw_attention``, ``rollout(model, x, *rollout_setting)``,
    ``attention_gradcam``, ``grad_rollout(model, x, target, grad_discard_ratio)`` and
    ``chefer_relevance`` called on the model, each ``B x gh x gw``; the first two do not
    depend on the target class.
    """
    from vitlab.attention import gradcam_cls_row, require_cls
    from vitlab.relevance import relevance_matrix
    from vitlab.rollout import discard_lowest, grad_fuse_heads, max_normalize, residual_normalize, rollout_row

    layout = ag.layout
    require_cls(layout, "maps_from_gradients")
    P = layout.num_prefix
    A_last, G_last = ag.attentions[-1], ag.gradients[-1]
    grad_layers = [residual_normalize(discard_lowest(grad_fuse_heads(A, G), grad_discard_ratio))
                   for A, G in zip(ag.attentions, ag.gradients)]
    return {
        "raw attention": layout.patches_to_grid(A_last[:, :, 0, :].mean(dim=1)),
        "rollout": rollout_from_attentions(ag.attentions, layout, *rollout_setting),
        "GradCAM": layout.patches_to_grid(gradcam_cls_row(A_last[:, :, 0, P:], G_last[:, :, 0, P:])),
        "gradient rollout": max_normalize(layout.patches_to_grid(rollout_row(grad_layers, index=0))),
        "Chefer relevance": layout.patches_to_grid(relevance_matrix(ag.attentions, ag.gradients)[:, 0, :]),
    }


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
    from vitlab.attention import attention_gradients

    labels = torch.as_tensor(np.asarray(labels), dtype=torch.long)
    if labels.ndim != 2 or labels.shape[0] != x.shape[0]:
        raise ValueError(f"need labels B x K for B = {x.shape[0]} inputs; got labels {tuple(labels.shape)}")
    B, K = labels.shape
    out = {m: [] for m in CLASS_METHODS}
    for s in _batches(B, batch_size):
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
    labels = torch.as_tensor(np.asarray(labels), dtype=torch.long)
    masks = _as_tensor(masks)
    if labels.ndim != 2 or masks.ndim != 4 or masks.shape[:2] != labels.shape or labels.shape[0] != x.shape[0]:
        raise ValueError(
            f"need labels B x K and masks B x K x H x W for B = {x.shape[0]} inputs; "
            f"got labels {tuple(labels.shape)}, masks {tuple(masks.shape)}"
        )
    maps = asked_object_maps(model, x, labels, batch_size, rollout_setting, grad_discard_ratio)
    return grade_asked(maps, masks, min_coverage)


# ---------------------------------------------------------------------------------------------
# Which pixels does a token stand for?
# ---------------------------------------------------------------------------------------------


def token_centres(model, x: torch.Tensor) -> torch.Tensor:
    """Receptive-field centre of every patch token after the patch embedding: ``gh x gw x 2``.

    For token t, the centroid (row, column in input pixels) of ``|d embed_t / d x|`` summed
    over channels, embedding dimensions and the batch ``x`` (``B x 3 x H x W``). With a
    plain patchify convolution it is the patch centre; a convolutional stem can move it
    (e.g. stride-2 3x3 convolutions with padding 1 centre a token on its patch's top-left
    corner). Maps over the patch grid are graded against patches, so an offset here shifts
    every map relative to what its tokens saw. timm ViTs only (``model.patch_embed``).
    """
    pe = getattr(model, "patch_embed", None)
    if pe is None or not hasattr(pe, "grid_size"):
        raise ValueError("token_centres needs a timm ViT (a model with patch_embed.grid_size)")
    gh, gw = (int(g) for g in pe.grid_size)
    H, W = x.shape[-2:]
    with torch.enable_grad():
        xin = x.detach().clone().requires_grad_(True)
        emb = pe(xin)  # B x N x C (timm flattens) or B x C x gh x gw
        if emb.ndim == 4:
            emb = emb.flatten(2).transpose(1, 2)
        ys = torch.arange(H, dtype=torch.float32)[:, None].expand(H, W)
        xs = torch.arange(W, dtype=torch.float32)[None, :].expand(H, W)
        out = torch.empty(gh * gw, 2)
        for t in range(gh * gw):
            (g,) = torch.autograd.grad(emb[:, t].sum(), xin, retain_graph=t < gh * gw - 1)
            w = g.abs().sum(dim=(0, 1)).float()  # H x W
            total = w.sum().clamp_min(torch.finfo(w.dtype).tiny)
            out[t, 0], out[t, 1] = (w * ys).sum() / total, (w * xs).sum() / total
    return out.reshape(gh, gw, 2)


def patch_centres(grid: tuple[int, int], size: tuple[int, int]) -> torch.Tensor:
    """Centre (row, column in pixels) of every patch of a ``grid`` over an image of ``size``."""
    (gh, gw), (H, W) = grid, size
    ph, pw = H / gh, W / gw
    cy = torch.arange(gh, dtype=torch.float32) * ph + (ph - 1) / 2
    cx = torch.arange(gw, dtype=torch.float32) * pw + (pw - 1) / 2
    return torch.stack(torch.meshgrid(cy, cx, indexing="ij"), dim=-1)


def shift_masks(masks, down: int, right: int) -> torch.Tensor:
    """Move the content of ``... x H x W`` masks ``down`` and ``right`` pixels (negative: up,
    left); what enters at the border is background (False / 0)."""
    m = _as_tensor(masks)
    H, W = m.shape[-2:]
    out = torch.zeros_like(m)
    down, right = int(down), int(right)
    if abs(down) >= H or abs(right) >= W:
        return out
    src_y = slice(max(0, -down), H - max(0, down))
    dst_y = slice(max(0, down), H - max(0, -down))
    src_x = slice(max(0, -right), W - max(0, right))
    dst_x = slice(max(0, right), W - max(0, -right))
    out[..., dst_y, dst_x] = m[..., src_y, src_x]
    return out
