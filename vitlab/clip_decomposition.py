"""CLIP's image embedding as a sum of direct contributions, read against text embeddings
(Gandelsman, Efros & Steinhardt, ICLR 2024, "Interpreting CLIP's Image Representation via
Text-Based Decomposition", arXiv 2310.05916; code yossigandelsman/clip_text_span).

The image tower is a residual stream: the CLS token leaving the last block is what entered the
first block plus what every attention and MLP sublayer added to it (paper eq. 1-2),

    z_L[CLS] = z_0[CLS] + sum_l ( attn_l[CLS] + mlp_l[CLS] ),

and an attention sublayer's output at the CLS token is a sum over heads h and tokens i (eq. 4-5):

    attn_l[CLS] = sum_h sum_i A^{l,h}[CLS, i] W_O^{l,h} v^{l,h}_i + b_O^l.

The image embedding reads it through the final LayerNorm and the projection,
``e = P (gamma ⊙ (z - mean(z)) / sigma + beta)``. With the norm's statistics frozen at this
image's values (sigma from z itself), the map from z to e is affine: its linear part
``c -> P (gamma ⊙ (c - mean(c)) / sigma)`` (centring is linear) applies to each term on its own,
and ``P beta`` is a constant. So the embedding is *exactly* the sum of the projected direct
contributions of the embedding, every (layer, head, token), every attention bias and every MLP,
plus ``P beta`` (:meth:`ImageDecomposition.total` reconstructs the model's embedding; the tests
check it in float64). The paper's code spreads the norm's mean and bias equally over the terms
instead of centring each one; the sums agree, and a term differs from ours by a multiple of the
same two vectors -- a constant that shifts every token of a map alike.

Read against a text embedding t (unit length), each term's dot product over the embedding's norm
is its share of the cosine ``cos(e, t)``: the terms of one image sum to the pair's cosine.

- :func:`decompose_image`: the contributions (:class:`ImageDecomposition`), one forward;
- :func:`head_maps`: ``B x layers x heads x gh x gw``, each head's per-patch share of the cosine
  with the pair's text (the paper's per-head spatial maps, section 5);
- :func:`layer_ablation`: mean-ablation (section 3.2): a layer's direct contribution replaced
  by its mean over the images of the batch, zero-shot accuracy and score change;
- :func:`zero_shot_segmentation` and :func:`class_masks`: per-patch scores of every class text
  (the sum over layers and heads of each patch's contributions, section 5.2), the argmax
  class per patch, and the paper's binary mask of one class.

Hooks: :func:`vitlab.record` (the image tower's attention, values and residual stream); the
model's own ``post_layernorm``, ``out_proj`` and ``visual_projection`` weights are read, never
changed.
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import NamedTuple

import torch

from vitlab.compat import renamed_arguments
from vitlab.layout import TokenLayout
from vitlab.relevance.clip import check_clip_images, check_clip_texts, clip_towers, start_index

__all__ = [
    "ImageDecomposition", "LayerAblation", "Segmentation", "class_masks", "decompose_image", "head_maps",
    "layer_ablation", "text_embeddings", "zero_shot_segmentation",
]


@dataclass(frozen=True)
class ImageDecomposition:
    """The direct contributions to each image's embedding, in the embedding space (``P`` dims),
    through the final LayerNorm with this image's statistics frozen and the projection.

    Attributes:
        heads: ``B x L x H x N x P``: layer l, head h, token i (``A[CLS, i] W_O v_i``).
        attention_bias: ``B x L x P``: each attention sublayer's output bias ``b_O``.
        mlps: ``B x L x P``: what each MLP sublayer added to the CLS token.
        embedding: ``B x P``: the CLS token entering the first block (after ``pre_layrnorm``).
        norm_bias: ``P``: ``P beta``, the final norm's bias projected (the same for every image).
        image_embeds: ``B x P``: the model's image embedding (``get_image_features``, unnormalised).
        layout: the image tower's token layout (CLS, then the patch grid).
    """

    heads: torch.Tensor
    attention_bias: torch.Tensor
    mlps: torch.Tensor
    embedding: torch.Tensor
    norm_bias: torch.Tensor
    image_embeds: torch.Tensor
    layout: TokenLayout

    def attention_layers(self) -> torch.Tensor:
        """``B x L x P``: each attention sublayer's whole direct contribution (heads, tokens, bias)."""
        return self.heads.sum(dim=(2, 3)) + self.attention_bias

    def total(self) -> torch.Tensor:
        """``B x P``: the sum of every term -- equals :attr:`image_embeds` (up to rounding)."""
        return (self.embedding + self.attention_layers().sum(dim=1) + self.mlps.sum(dim=1)
                + self.norm_bias)

    def patch_heads(self) -> torch.Tensor:
        """``B x L x H x num_patches x P``: the heads' contributions through the patch tokens."""
        return self.heads[:, :, :, self.layout.num_prefix:]


def _linear_part(z_last: torch.Tensor, norm: torch.nn.LayerNorm, projection: torch.Tensor):
    """The linear part of ``c -> P(LayerNorm(c))`` with the statistics of ``z_last`` (``B x D``)
    frozen: a function of ``B x ... x D`` -> ``B x ... x P``."""
    var = z_last.var(dim=-1, unbiased=False)
    sigma = torch.sqrt(var + norm.eps)  # B
    gamma = norm.weight if norm.weight is not None else torch.ones_like(z_last[0])

    def apply(c: torch.Tensor) -> torch.Tensor:
        centred = c - c.mean(dim=-1, keepdim=True)
        scale = (gamma / sigma.view(-1, *([1] * (c.ndim - 1))))
        return (centred * scale) @ projection.T

    return apply


@renamed_arguments(pixel_values="inputs")
def decompose_image(model, inputs: torch.Tensor) -> ImageDecomposition:
    """Every direct contribution to each image's embedding (Gandelsman et al. 2024, eq. 1-5, the
    final LayerNorm's statistics frozen): one forward of the image tower without gradients.

    Args:
        model: a Hugging Face ``CLIPModel`` (its image tower: pre-norm blocks, a final
            ``post_layernorm`` on the CLS token, a bias-free ``visual_projection``); run in eval
            mode and left exactly as it was.
        inputs: ``B x C x H x W`` images, normalised as the model expects.
    """
    from vitlab.record import record

    method = "decompose_image"
    check_clip_images(model, inputs, method)
    vision, _ = clip_towers(model, method)
    projection = model.visual_projection
    if getattr(projection, "bias", None) is not None:
        raise ValueError(f"{method}: the visual projection has a bias; the decomposition expects CLIP's bias-free one")
    with torch.no_grad():
        with record(model, eval_mode=True, capture=("attention", "value", "hidden")) as rec:
            out = model.get_image_features(pixel_values=inputs)
        return _decomposition(vision, projection, rec, out if isinstance(out, torch.Tensor) else out.pooler_output)


def _decomposition(vision, projection, rec, image_embeds: torch.Tensor) -> ImageDecomposition:
    """The terms of :func:`decompose_image` from a recording of the image tower."""
    caps = rec.stream("image")
    norm = vision.post_layernorm
    P = projection.weight
    lin = _linear_part(caps[-1].hidden[:, 0], norm, P)
    heads, biases, mlps = [], [], []
    for cap, layer in zip(caps, vision.encoder.layers):
        out_proj = layer.self_attn.out_proj
        A = cap.attention[:, :, 0, :]                      # B x H x N: the CLS row
        B, H, N, d = cap.value.shape
        W = out_proj.weight.view(out_proj.weight.shape[0], H, d)  # D x H x d: each head's slice of W_O
        c = torch.einsum("bhn,bhnd,ehd->bhne", A, cap.value, W)  # B x H x N x D
        heads.append(lin(c))
        bias = out_proj.bias if out_proj.bias is not None else torch.zeros_like(out_proj.weight[:, 0])
        biases.append(lin(bias.expand(B, -1)))
        mlps.append(lin((cap.hidden - cap.mid)[:, 0]))
    beta = norm.bias if norm.bias is not None else torch.zeros_like(P[0, :])
    return ImageDecomposition(
        heads=torch.stack(heads, dim=1), attention_bias=torch.stack(biases, dim=1), mlps=torch.stack(mlps, dim=1),
        embedding=lin(caps[0].block_input[:, 0]), norm_bias=beta @ P.T, image_embeds=image_embeds.detach(),
        layout=rec.layout,
    )


def text_embeddings(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """The texts' embeddings (``get_text_features``), unit length: ``T x P``; eval mode, no gradients,
    every module's mode put back. The texts are checked first, as every CLIP method checks them
    (:func:`vitlab.relevance.clip.check_clip_texts`: ids in the vocabulary, each text with its
    end-of-text token, a 0/1 mask that does not cover it as padding)."""
    from vitlab.record import eval_mode

    check_clip_texts(model, input_ids, attention_mask, "text_embeddings")

    with torch.no_grad(), eval_mode(model):
        out = model.get_text_features(input_ids=input_ids, attention_mask=attention_mask)
    emb = out if isinstance(out, torch.Tensor) else out.pooler_output
    return torch.nn.functional.normalize(emb, dim=-1)


def _unit_texts(text_embeds, rows: int | None, name: str, method: str, dim: int) -> torch.Tensor:
    if not isinstance(text_embeds, torch.Tensor) or text_embeds.ndim != 2 or text_embeds.shape[1] != dim:
        got = tuple(text_embeds.shape) if isinstance(text_embeds, torch.Tensor) else type(text_embeds).__name__
        raise ValueError(f"{method}: {name} must be a tensor of text embeddings, one per row, of the model's "
                         f"{dim} dims (vitlab.clip_decomposition.text_embeddings makes them), got {got}")
    if text_embeds.shape[0] == 0 or (rows is not None and text_embeds.shape[0] != rows):
        raise ValueError(f"{method}: {name} has {text_embeds.shape[0]} rows; "
                         + (f"give one text per image ({rows})" if rows is not None else "give at least one text"))
    if not text_embeds.is_floating_point() or not bool(torch.isfinite(text_embeds).all()):
        raise ValueError(f"{method}: {name} must be finite float embeddings")
    norms = text_embeds.norm(dim=-1, keepdim=True)
    if bool((norms == 0).any()):
        raise ValueError(f"{method}: {name} holds an all-zero embedding, which has no direction to read along")
    return text_embeds / norms


@renamed_arguments(pixel_values="inputs")
def head_maps(model, inputs: torch.Tensor, text_embeds: torch.Tensor) -> torch.Tensor:
    """Each head's direct contribution through each patch, as a share of the pair's cosine:
    ``B x L x H x gh x gw``, entry ``heads[b, l, h, patch] · t_b / |e_b|`` with ``t_b`` the unit
    text embedding of pair b (``text_embeds``: ``B x P``, row b for image b) and ``e_b`` the image
    embedding (Gandelsman et al. 2024, section 5: per-head image-text maps). Summed with every
    other term of :func:`decompose_image` (CLS token, biases, MLPs, embedding, norm bias) over the
    same reading, they give ``cos(e_b, t_b)``.
    """
    dec = decompose_image(model, inputs)
    t = _unit_texts(text_embeds, inputs.shape[0], "text_embeds", "head_maps", dec.image_embeds.shape[1])
    norm = dec.image_embeds.norm(dim=-1)  # B
    share = torch.einsum("blhnp,bp->blhn", dec.patch_heads(), t.to(dec.heads.dtype)) / norm[:, None, None, None]
    return dec.layout.patches_to_grid(share)


class LayerAblation(NamedTuple):
    """Zero-shot classification with direct contributions mean-ablated (Gandelsman et al. 2024,
    section 3.2). Accuracies are fractions of the batch's images; score changes are the mean
    over the images of the change in the cosine with their own class's text (the ablated
    embedding renormalised).

    Attributes:
        baseline: accuracy of the model's own embeddings.
        attention: ``L``: accuracy with layer l's attention contribution (all heads, tokens and
            bias) replaced by its mean over the images.
        attention_upto: ``L``: with layers ``0 .. l`` replaced at once (the paper's curve).
        mlp: ``L``: with MLP l replaced.
        all_mlps: with every MLP and the embedding term replaced (the paper's "MLPs" ablation).
        attention_change, attention_upto_change, mlp_change, all_mlps_change: the score changes.
    """

    baseline: float
    attention: torch.Tensor
    attention_upto: torch.Tensor
    mlp: torch.Tensor
    all_mlps: float
    attention_change: torch.Tensor
    attention_upto_change: torch.Tensor
    mlp_change: torch.Tensor
    all_mlps_change: float


def _zero_shot(embeds: torch.Tensor, classes: torch.Tensor, labels: torch.Tensor) -> tuple[float, torch.Tensor]:
    """(accuracy, per-image cosine with the true class's text)."""
    cos = torch.nn.functional.normalize(embeds, dim=-1) @ classes.T  # B x C
    accuracy = float((cos.argmax(dim=1) == labels).double().mean())
    return accuracy, cos.gather(1, labels[:, None])[:, 0]


def _check_labels(labels, batch: int, classes: int, method: str) -> torch.Tensor:
    labels = torch.as_tensor(labels)
    if labels.ndim != 1 or labels.shape[0] != batch or labels.is_floating_point() or labels.dtype == torch.bool:
        raise ValueError(f"{method}: labels must be {batch} integer class indices (one per image), got "
                         f"shape {tuple(labels.shape)} and dtype {labels.dtype}")
    if batch and (int(labels.min()) < 0 or int(labels.max()) >= classes):
        raise ValueError(f"{method}: labels must index the {classes} class texts (0 .. {classes - 1})")
    return labels.long()


@renamed_arguments(pixel_values="inputs")
def layer_ablation(model, inputs: torch.Tensor, class_embeds: torch.Tensor, labels) -> LayerAblation:
    """Mean-ablation of each layer's direct contribution (Gandelsman et al. 2024; their
    ``compute_ablations.py``, which ablates all MLPs at once, the class token's attention to itself,
    and the attention of blocks 0 to l, printing accuracies): the term is replaced by its mean
    over the batch's images, every other term kept, and the images classified zero-shot against ``class_embeds``
    (``C x P``, one text per class, e.g. ``"a {shape}"``). Their README: "To verify that the MLPs
    and the attention from the class token to itself can be mean-ablated" (chapter 11 sets this
    model's accuracies beside it).

    Args:
        model: a Hugging Face ``CLIPModel`` (left exactly as it was).
        inputs: ``B x C x H x W`` images (the mean runs over them: use many).
        class_embeds: ``C x P`` class text embeddings (normalised here).
        labels: ``B`` true classes.
    """
    method = "layer_ablation"
    check_clip_images(model, inputs, method)
    B = inputs.shape[0]
    dim = model.visual_projection.weight.shape[0]
    classes = _unit_texts(class_embeds, None, "class_embeds", method, dim)
    labels = _check_labels(labels, B, classes.shape[0], method).to(inputs.device)
    dec = decompose_image(model, inputs)
    classes = classes.to(dec.heads.dtype)
    total = dec.total()
    base_acc, base_cos = _zero_shot(total, classes, labels)
    attn, mlps = dec.attention_layers(), dec.mlps  # B x L x P

    def ablated(terms: torch.Tensor) -> tuple[float, float]:
        """``terms``: ``B x K x P`` replaced by their means over the images."""
        e = total - terms.sum(dim=1) + terms.mean(dim=0, keepdim=True).sum(dim=1)
        acc, cos = _zero_shot(e, classes, labels)
        return acc, float((cos - base_cos).mean())

    L = attn.shape[1]
    a = [ablated(attn[:, l:l + 1]) for l in range(L)]
    up = [ablated(attn[:, :l + 1]) for l in range(L)]
    m = [ablated(mlps[:, l:l + 1]) for l in range(L)]
    every = ablated(torch.cat([dec.embedding[:, None], mlps], dim=1))

    def col(pairs, k):
        return torch.tensor([p[k] for p in pairs], dtype=torch.float64)

    return LayerAblation(base_acc, col(a, 0), col(up, 0), col(m, 0), every[0], col(a, 1), col(up, 1), col(m, 1),
                         every[1])


class Segmentation(NamedTuple):
    """Zero-shot segmentation from the decomposition (:func:`zero_shot_segmentation`).

    Attributes:
        scores: ``B x C x gh x gw``: each patch's direct contribution (summed over the layers from
            ``start_block`` and over the heads) read along each class text, over the image
            embedding's norm (its share of the cosine with that class).
        labels: ``B x gh x gw``: the class of highest score per patch.
    """

    scores: torch.Tensor
    labels: torch.Tensor


@renamed_arguments(pixel_values="inputs")
def zero_shot_segmentation(model, inputs: torch.Tensor, class_embeds: torch.Tensor, *,
                           start_block: int = 0) -> Segmentation:
    """Per-patch class scores and the argmax class of every patch (Gandelsman et al. 2024,
    section 5.2, ``compute_segmentations.py``: the patches' contributions summed over layers and
    heads, read along the class texts).

    Args:
        model: a Hugging Face ``CLIPModel`` (left exactly as it was).
        inputs: ``B x C x H x W`` images.
        class_embeds: ``C x P`` class text embeddings (normalised here).
        start_block: the first layer whose heads count (the paper's code: all, 0; the direct
            effect sits in the last layers, so e.g. -4 keeps the last four).
    """
    method = "zero_shot_segmentation"
    check_clip_images(model, inputs, method)
    classes = _unit_texts(class_embeds, None, "class_embeds", method, model.visual_projection.weight.shape[0])
    vision, _ = clip_towers(model, method)
    si = start_index(start_block, len(vision.encoder.layers), "image", method)
    dec = decompose_image(model, inputs)
    patches = dec.patch_heads()[:, si:].sum(dim=(1, 2))  # B x num_patches x P
    norm = dec.image_embeds.norm(dim=-1)
    scores = torch.einsum("bnp,cp->bcn", patches, classes.to(patches.dtype)) / norm[:, None, None]
    scores = dec.layout.patches_to_grid(scores)
    return Segmentation(scores, scores.argmax(dim=1))


def class_masks(scores: torch.Tensor, target) -> torch.Tensor:
    """The paper's binary mask of class ``target`` (one int, or one per image) from the scores of
    :func:`zero_shot_segmentation` (``B x C x gh x gw``), as ``compute_segmentations.py`` makes
    it: the class's score minus the mean over the classes, negatives clipped to 0, min-max
    rescaled to [0, 1], then every patch above the map's mean. ``B x gh x gw`` booleans (all False
    where the map is all zero)."""
    if not isinstance(scores, torch.Tensor) or scores.ndim != 4:
        raise ValueError("class_masks takes the B x C x gh x gw scores of zero_shot_segmentation")
    B, C = scores.shape[:2]
    if not scores.is_floating_point():
        raise ValueError(f"class_masks takes float scores (zero_shot_segmentation's), got dtype {scores.dtype}")
    finite = torch.isfinite(scores).flatten(1).all(1)
    if not bool(finite.all()):           # one NaN would make the mean over classes, and so the mask, NaN
        bad = (~finite).nonzero().flatten().tolist()
        raise ValueError(f"class_masks: the scores of image{'s' if len(bad) > 1 else ''} "
                         f"{', '.join(map(str, bad[:10]))} hold NaN or infinite values, which would empty the mask; "
                         "compute the scores from finite images and texts (zero_shot_segmentation checks both)")
    if isinstance(target, numbers.Integral) and not isinstance(target, bool):
        target = torch.full((B,), int(target), dtype=torch.long)
    target = _check_labels(target, B, C, "class_masks").to(scores.device)
    own = scores[torch.arange(B, device=scores.device), target]          # B x gh x gw
    m = (own - scores.mean(dim=1)).clamp(min=0).flatten(1)
    hi = m.amax(dim=1, keepdim=True)
    lo = m.amin(dim=1, keepdim=True)
    span = hi - lo
    m = torch.where(span > 0, (m - lo) / torch.where(span > 0, span, torch.ones_like(span)), torch.zeros_like(m))
    mask = (m > m.mean(dim=1, keepdim=True)) & (span > 0)
    return mask.reshape(own.shape)
