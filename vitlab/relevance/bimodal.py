"""What the bimodal and detection relevance share: the maps they return, the recorded forward
with gradients, attention events from a recording, and the baselines' building blocks."""
from __future__ import annotations

from typing import NamedTuple

import torch

from vitlab.methods import display_names
from vitlab.relevance.engine import AttentionEvent, Step


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


def require_family(model, family: str, method: str) -> None:
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if not isinstance(model, torch.nn.Module) or model_type != family:
        what = {"lxmert": "a Hugging Face LXMERT question-answering model (LxmertForQuestionAnswering)",
                "detr": "a Hugging Face DETR detector (DetrForObjectDetection)"}[family]
        raise TypeError(f"{method} explains {what}, got {type(model).__name__}"
                        + (f" (model_type {model_type!r})" if model_type else ""))


def _recorded_forward(model, kwargs: dict, grad: bool, method: str, through_pixels: bool = False):
    """One forward of ``model(**kwargs)`` inside :func:`vitlab.record` (attention only, eval
    mode): ``(rec, output)``; with ``grad`` the attentions stay in the autograd graph.
    ``through_pixels``: the images go in as a copy that requires grad, so that a frozen
    backbone's attention joins the graph too (relevance through the backbone)."""
    from vitlab.inputs import gradient_leaf, graph_inputs, require_gradients
    from vitlab.record import record

    if grad:
        require_gradients(method)
        kwargs = graph_inputs(kwargs)
    if through_pixels:
        kwargs = {**kwargs, "pixel_values": gradient_leaf(kwargs["pixel_values"])}
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


def last_capture(rec, stream: str, method: str):
    caps = rec.stream(stream)
    if not caps:
        raise ValueError(f"{method}: the model has no {stream!r} attention layer")
    return caps[-1]


def _rollout(cams: list[torch.Tensor], n: int, like: torch.Tensor) -> torch.Tensor:
    """Attention rollout of head-averaged self-attention ``cams`` (first first): ``... x n x n``;
    the identity when there is none."""
    from vitlab.rollout import residual_normalize, rollout_matrix

    if not cams:
        return torch.eye(n, dtype=like.dtype, device=like.device).expand(*like.shape[:-2], n, n)
    return rollout_matrix([residual_normalize(a) for a in cams])


def attention_matrix_gradcam(attn: torch.Tensor, grad: torch.Tensor, entries: torch.Tensor | None = None) -> torch.Tensor:
    """GradCAM on a whole attention map, as the reference's bi-modal baseline: ``... x Nq x Nk``.

    Per head ``w_h`` = the gradient averaged over all ``Nq x Nk`` entries; the map is
    ``(mean_h w_h A_h)^+``. (The ViT baseline, :func:`vitlab.attention.gradcam_cls_row`,
    averages the CLS row only, as the ViT reference does.) ``entries`` (0 / 1, broadcastable
    to ``attn``, e.g. ``B x 1 x Nq x Nk``): average over the entries marked 1 only -- those
    between real tokens, so that padding does not dilute the weights.
    """
    if entries is None:
        w = grad.mean(dim=(-2, -1), keepdim=True)  # ... x H x 1 x 1
    else:
        entries = entries.to(grad.dtype).expand_as(grad)
        count = entries.sum(dim=(-2, -1), keepdim=True).clamp(min=1)
        w = (grad * entries).sum(dim=(-2, -1), keepdim=True) / count
    return (w * attn).mean(dim=-3).clamp(min=0)


# ---------------------------------------------------------------------------------------------
# The methods chapter 9 compares on LXMERT and DETR
# ---------------------------------------------------------------------------------------------


#: The methods chapters 9 and 10 compare, in table order (the same names for LXMERT and DETR): the
#: display names (:mod:`vitlab.methods`) of raw_attention, rollout and gradcam, after Chefer et al.'s
#: relevance (display name "Chefer relevance"; labelled "relevance" in chapters 9, 9a and 10, whose
#: stored outputs use it) without and with the relevance carried through the ViT backbone.
BIMODAL_METHODS: tuple[str, ...] = ("relevance", "relevance + backbone",
                                    *display_names("raw_attention", "rollout", "gradcam"))


def _checked_methods(methods) -> tuple[str, ...]:
    methods = tuple(methods)
    unknown = [m for m in methods if m not in BIMODAL_METHODS]
    if not methods or unknown:
        raise ValueError(f"methods must be names from {BIMODAL_METHODS}, got {methods!r}")
    return methods
