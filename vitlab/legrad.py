"""LeGrad: the gradient of each layer's own image-text similarity with respect to that layer's
attention map (Bousselham, Boggust, Chaybouti, Strobelt & Kuehne, ICCV 2025, arXiv 2404.03214,
"LeGrad: An Explainability Method for Vision Transformers via Feature Formation Sensitivity";
code WalBouss/LeGrad, ``legrad/wrapper.py``, ``LeWrapper.compute_legrad_clip``).

For every block l of the image tower (from ``start_block`` on):

1. the block's tokens ``z^l`` (``B x N x D``, leaving the block) are read as an image embedding
   the way the model reads its last CLS token -- through the final norm and the projection --
   after averaging over all tokens: ``e^l = proj(post_layernorm(mean_i z^l_i))``, normalised;
2. ``s^l = <e^l, t>`` with t the pair's normalised text embedding: what the image would score
   if the model stopped at block l;
3. ``G^l = dS^l / dA^l``, the gradient of that score with respect to block l's *own* attention map
   (``B x heads x N x N``), negatives clamped: ``ReLU(G^l)``;
4. the block's map is ``ReLU(G^l)`` averaged over the heads and over the query rows (every token,
   CLS included), read at the patch columns: ``E^l_i = mean_{h, q} ReLU(G^l)[h, q, i]``.

The maps are summed over the blocks and min-max normalised per pair:
``E = minmax(sum_l E^l)`` (``B x gh x gw`` in [0, 1]; all zero where the sum is constant).

Choices, where the paper and the code differ or leave room:

- Which blocks. The paper's abstract aggregates "over all layers" -- the default here,
  ``start_block=0``. The released code's ``LeWrapper(model, layer_index=-2)`` sums the last two
  blocks only for CLIP models; ``start_block=-2`` reproduces it.
- Pooling. The code averages ``z^l`` over all tokens (CLS included) before the final norm and
  projection, although CLIP's own output reads the CLS token alone; vitlab does as the code.
- The similarity is the cosine, no logit scale (the code's ``text_embedding @ img_feat``
  after normalising both); the scale would cancel in the min-max anyway.
- The text. LeGrad explains the image tower (the paper and the code take the text embedding as
  given), so :attr:`ClipMaps.text` is None.
- The code upsamples the map to pixels before the min-max; the map here stays on the patch
  grid (upsampling is a display choice; :mod:`vitlab.plot` does it).

One recorded forward of the whole model (the text embedding comes from the same forward) and,
per explained block, one ``torch.autograd.grad`` from ``s^l`` to ``A^l`` -- a short backward
through that one block, the final norm and the projection. No parameter's ``.grad`` is touched.
Hooks: :func:`vitlab.record` (attention and the blocks' outputs, ``capture=("attention", "hidden")``).
"""
from __future__ import annotations

import torch

from vitlab.relevance.clip import (
    ClipMaps, check_clip_inputs, check_pair_target, clip_forward, clip_in_chunks, clip_towers, start_index,
    tower_depths,
)

__all__ = ["legrad", "min_max"]


def min_max(maps: torch.Tensor) -> torch.Tensor:
    """Each sample's map (``B x ...``) rescaled to [0, 1]: ``(m - min) / (max - min)``; a
    constant map becomes all zero (LeGrad's code would divide 0 by 0)."""
    flat = maps.flatten(1)
    lo, hi = flat.amin(dim=1, keepdim=True), flat.amax(dim=1, keepdim=True)
    span = hi - lo
    out = (flat - lo) / torch.where(span > 0, span, torch.ones_like(span))
    return out.reshape(maps.shape)


def legrad(model, inputs, target=None, *, start_block: int = 0) -> ClipMaps:
    """LeGrad map of each pair's image-text cosine (Bousselham et al. 2024; the module
    docstring gives the steps and every choice): ``minmax(sum_{l >= start_block}
    mean_{h,q} ReLU(d s^l / d A^l)[h, q, patches])`` with ``s^l`` the cosine of block l's
    mean token, read through the final norm and projection, with the pair's text embedding.

    Args:
        model: a Hugging Face ``CLIPModel`` (run in eval mode; left exactly as it was).
        inputs: ``dict(pixel_values=..., input_ids=..., attention_mask=...)``, one text per image.
        target: None, the pair's score (the only target; anything else is a ``ValueError``).
        start_block: the first image block aggregated (0: all, the paper; -2: the code's default).

    Returns:
        :class:`~vitlab.relevance.clip.ClipMaps` with ``text`` None and ``score`` the cosines of
        the model's own embeddings.
    """
    method = "legrad"
    check_pair_target(target, method)
    inputs, _ = check_clip_inputs(model, inputs, method)
    vision, _ = clip_towers(model, method)
    si = start_index(start_block, tower_depths(model)[0], "image", method)

    def compute(inputs):
        f = clip_forward(model, inputs, method, grad=True, capture=("attention", "hidden"))
        caps = f.rec.stream("image")[si:]
        text = f.output.text_embeds.detach()  # B x P, normalised by the model
        total = 0
        with torch.enable_grad():
            for k, cap in enumerate(caps):
                pooled = model.visual_projection(vision.post_layernorm(cap.hidden.mean(dim=1)))  # B x P
                s = (torch.nn.functional.normalize(pooled, dim=-1) * text).sum()
                (g,) = torch.autograd.grad(s, [cap.attention], retain_graph=k < len(caps) - 1)
                total = total + g.clamp(min=0).mean(dim=(1, 2))  # B x N: heads, then query rows
        return ClipMaps(min_max(f.image_row(total)), None, f.cosine.detach())
    return clip_in_chunks(compute, model, inputs, gradients=True)
