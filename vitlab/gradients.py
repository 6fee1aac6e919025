"""A baseline that does not read attention: input x gradient, pooled to the patch grid.

Chapter 7 grades the attention-based maps beside one that only uses the model's input
gradient, so a reader can see what attention adds. ``x * d y_t / d x`` (summed over the
colour channels) says, to first order, how much each pixel's value contributes to the
target score compared with an all-zero input; averaged over each patch it is a
``B x gh x gw`` map like every other method's.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from vitlab.attention import check_images
from vitlab.layout import token_layout
from vitlab.record import eval_mode
from vitlab.targets import (
    _logits, check_score, check_target, is_multi_label, require_class_head, resolve_target, target_score,
)


def input_x_gradient(model, x: torch.Tensor, target=None, score: str = "logit",
                     pixels: bool = False) -> torch.Tensor:
    """Input x gradient (Shrikumar et al. 2016) of the target score: ``B x gh x gw``.

    The map is ``sum_c x[c] * d y_t / d x[c]`` per pixel, averaged over the pixels of each patch
    (signed: negative where the pixels speak against the class). ``pixels=True`` returns the
    ``B x H x W`` per-pixel map instead. One forward and one backward for the batch; the
    gradient is taken with respect to the input only (no parameter's ``.grad`` changes), in
    eval mode, and every module's mode is put back.

    Args:
        model: a classifier with a class head (timm or Hugging Face ViT; the patch grid is
            read from :func:`vitlab.token_layout`, so with ``pixels=True`` any image
            classifier works).
        x: ``B x 3 x H x W`` input batch.
        target: int, one class per sample, or None (the predicted class).
        score: ``"logit"`` or ``"log_probability"`` (:data:`vitlab.targets.SCORES`).
    """
    check_images(x, "input_x_gradient")
    require_class_head(model, "input_x_gradient")
    target = check_target(target, x.shape[0])
    check_score(score)
    if torch.is_inference_mode_enabled():
        raise RuntimeError("input_x_gradient needs gradients: call it outside torch.inference_mode()")
    grid = None if pixels else token_layout(model, x).grid
    with eval_mode(model), torch.enable_grad():
        x_in = (x.clone() if x.is_inference() else x.detach()).requires_grad_(True)
        logits = _logits(model(x_in))
        t = resolve_target(target, logits)
        (g,) = torch.autograd.grad(target_score(logits, t, score, is_multi_label(model)).sum(), [x_in])
    per_pixel = (x_in.detach() * g).sum(dim=1)  # B x H x W
    if pixels:
        return per_pixel
    # mean over each patch's pixels (adaptive cells when a padded grid does not divide the image)
    return F.adaptive_avg_pool2d(per_pixel[:, None], grid)[:, 0]
