"""Grad-ECLIP: gradient-weighted values of the last attention layers of CLIP (Zhao et al., ICML 2024,
"Gradient-based Visual Explanation for Transformer-based CLIP"; extended as arXiv 2502.18816,
"Grad-ECLIP: Gradient-based Visual and Textual Explanations for CLIP"; code Cyang-Zhao/Grad-Eclip).

The idea (the paper's section on decomposing the encoder): the pooled token's output of an
attention layer is ``o = sum_i A_i v_i`` (per head, A the pooled token's attention row, v_i the
value of token i), and the score S reads the image (text) through it. Grad-ECLIP keeps the two
factors that say how much token i matters and replaces the sparse softmax attention by a
"loosened" one:

- channel weights ``w_c = dS / do_c``: the gradient of the score with respect to the attention
  output of the pooled token (the CLS token of the image tower, the end-of-text token of the text
  tower), channel c of the heads' outputs side by side -- what the output projection reads;
- spatial weights ``lambda_i``: the cosine between the pooled token's query and token i's key
  (over the whole width, all heads side by side), min-max normalised over the tokens;
- the map ``H_i = ReLU( sum_c w_c v_{i,c} lambda_i )`` over the tokens i.

This is what the reference code computes (``grad_eclip_image.ipynb``, ``grad_eclip_text.ipynb``:
``grad = d c / d attn_output``, ``(grad_cls * v * cosine_qk).sum(-1)``) with the score ``c`` the
cosine of the two embeddings (no logit scale). Choices, where the code leaves room or where
vitlab differs from it:

- The model as it is. The reference recomputes the explained layers with *one* attention head
  over the whole width (``attention_layer(q, k, v, 1)``, commented "vision_heads=1"), so its
  score and gradients come from a different network than the CLIP it explains (the criticism
  of Cui & Fan, arXiv 2605.12952, "Debunking Grad-ECLIP"). Here the forward is the model's own
  (its multi-head attention, recorded by :func:`vitlab.record`), and ``w`` is the gradient of the
  model's own cosine with respect to its own attention output.
- Which layers. The reference explains the image with the last layer (``n=1``) and the text
  with the last eight of twelve (``n=8``); those are the defaults here (``start_block=(-1, -8)``,
  image then text: the last eight, or all blocks of a shallower tower). The image map
  sums the per-layer maps after each one's ReLU, the text map applies the ReLU to the sum --
  as the two notebooks do (the same for one layer).
- Spatial weights over which tokens. The image's min-max runs over the patches (the CLS token
  left out), as in the reference. The text's runs, in the reference, over all 77 positions,
  padding included, which makes a caption's map depend on how far it was padded; here it runs
  over the tokens up to the end-of-text token (the only ones it attends to under the causal
  mask). Where all cosines are equal the weights are 0 (the reference divides 0 by 0).
- Text map entries: ``0 < t < eos`` (start token, end-of-text token and padding 0), divided by
  their sum, as the reference does (``emap[1:eos] / emap.sum()``); all zero when the sum is 0.
  The image map is returned as computed (the reference rescales it only for display).
- The reference's script (``generate_emap.py``) passes q and k through the output projection
  before the cosine; its notebooks, whose maps the paper shows, do not; neither does this.

One recorded forward and one ``torch.autograd.grad`` (to the attention outputs of the explained
layers of both towers) for the whole batch. Hooks: :func:`vitlab.record` (``capture`` with
``"query"``, ``"key"`` and ``"value"``, whose captures carry ``context``, the attention output).
"""
from __future__ import annotations

import torch

from vitlab.compat import renamed_arguments
from vitlab.relevance.clip import (
    ClipMaps, check_clip_inputs, check_pair_target, clip_forward, clip_in_chunks, start_blocks, tower_depths,
)

__all__ = ["grad_eclip", "loosened_attention"]


def loosened_attention(query: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
    """Grad-ECLIP's spatial weights: ``cos(q, k_i)`` min-max normalised over the tokens i.

    ``query``: ``B x D``, ``keys``: ``B x N x D`` (all heads side by side); ``valid``: ``B x N``
    booleans, the tokens the normalisation runs over (the others get 0; None: all). Returns
    ``B x N`` in [0, 1]; all zero where the cosines are all equal.
    """
    cos = torch.nn.functional.cosine_similarity(query[:, None, :], keys, dim=-1)  # B x N
    if valid is None:
        valid = torch.ones_like(cos, dtype=torch.bool)
    lo = cos.masked_fill(~valid, float("inf")).amin(dim=1, keepdim=True)
    hi = cos.masked_fill(~valid, float("-inf")).amax(dim=1, keepdim=True)
    span = hi - lo
    out = (cos - lo) / torch.where(span > 0, span, torch.ones_like(span))
    return torch.where(valid & (span > 0), out, torch.zeros_like(out))


def _side_by_side(t: torch.Tensor) -> torch.Tensor:
    """``B x heads x N x head_dim`` -> ``B x N x D`` (heads side by side, as the projections lay them out)."""
    B, H, N, d = t.shape
    return t.transpose(1, 2).reshape(B, N, H * d)


def _layer_map(cap, grad: torch.Tensor, rows: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``sum_c w_c v_{i,c} lambda_i`` of one layer, ``B x N``: ``grad`` = dS/d(context) (``B x N x D``),
    read at each sample's pooled token ``rows``."""
    b = torch.arange(grad.shape[0], device=grad.device)
    w = grad[b, rows]                                   # B x D: channel weights
    q = _side_by_side(cap.query.detach())[b, rows]      # B x D
    k, v = _side_by_side(cap.key.detach()), _side_by_side(cap.value.detach())
    lam = loosened_attention(q, k, valid)               # B x N
    return (v * w[:, None, :]).sum(dim=-1) * lam


@renamed_arguments(image_start_block="start_block", text_start_block="start_block")
def grad_eclip(model, inputs, target=None, *, start_block=(-1, -8)) -> ClipMaps:
    """Grad-ECLIP maps of each pair's image-text cosine, image and text (Zhao et al., ICML 2024;
    the module docstring gives the equations and every choice).

    Image: ``sum_l ReLU( sum_c w^l_c v^l_{i,c} lambda^l_i )`` over the image blocks l from
    the image start block on, ``w^l`` the gradient of the cosine with respect to block l's
    attention output at the CLS token, ``lambda^l`` the min-max normalised cosine of the CLS
    query with each patch's key; ``B x gh x gw``. Text: ``ReLU( sum_l sum_c w^l_c v^l_{t,c}
    lambda^l_t )`` at the end-of-text token, over the caption's tokens ``0 < t < eos``, divided
    by its sum; ``B x T``.

    Args:
        model: a Hugging Face ``CLIPModel`` (run in eval mode; left exactly as it was).
        inputs: ``dict(pixel_values=..., input_ids=..., attention_mask=...)``, one text per image.
        target: None, the pair's score (the only target; anything else is a ``ValueError``).
        start_block: the first block explained, ``(image, text)`` or one int for both towers
            (negative counts from the end). Default ``(-1, -8)``, the reference's choice: the
            image tower's last block, the text tower's last eight (all blocks of a tower with
            fewer: a negative start further back than the tower is deep means all its blocks).

    Returns:
        :class:`~vitlab.relevance.clip.ClipMaps`, ``score`` the cosines.
    """
    method = "grad_eclip"
    check_pair_target(target, method)
    inputs, _ = check_clip_inputs(model, inputs, method)
    si, st = start_blocks(start_block, tower_depths(model), method, whole_tower=True)

    def compute(inputs):
        f = clip_forward(model, inputs, method, grad=True, capture=("query", "key", "value"))
        image_caps, text_caps = f.rec.stream("image")[si:], f.rec.stream("text")[st:]
        grads = f.gradients(f.cosine, [c.context for c in image_caps + text_caps])
        B = f.cosine.shape[0]
        n_image = image_caps[0].context.shape[1]
        cls = torch.zeros(B, dtype=torch.long, device=f.cosine.device)
        patches = torch.ones(B, n_image, dtype=torch.bool, device=f.cosine.device)
        patches[:, 0] = False
        image = sum(_layer_map(c, g, cls, patches).clamp(min=0) for c, g in zip(image_caps, grads[:len(image_caps)]))
        text = sum(_layer_map(c, g, f.eos, f.valid) for c, g in zip(text_caps, grads[len(image_caps):]))
        text = f.text_row(text.clamp(min=0))
        total = text.sum(dim=1, keepdim=True)
        text = torch.where(total > 0, text / torch.where(total > 0, total, torch.ones_like(total)),
                           torch.zeros_like(text))
        return ClipMaps(f.image_row(image), text, f.cosine.detach())
    return clip_in_chunks(compute, model, inputs, gradients=True)
