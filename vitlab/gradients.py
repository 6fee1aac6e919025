"""Baselines that do not read attention: input x gradient and Integrated Gradients, from Captum,
pooled to the patch grid.

Chapter 5 grades the attention-based maps beside ones that only use the model's input
gradient, so a reader can see what attention adds. Both come from Captum
(``captum.attr.InputXGradient``, ``captum.attr.IntegratedGradients``), the attribution
library of the PyTorch ecosystem; vitlab adds the batch checks, the target handling, eval
mode and the pooling: the attribution is summed over the colour channels and averaged over
each patch's pixels, a ``B x gh x gw`` map like every other method's (``pixels=True``: the
``B x H x W`` per-pixel map).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from vitlab.attention import run_images
from vitlab.inputs import check_images, check_input_dtype, gradient_leaf, gradient_target
from vitlab.layout import token_layout
from vitlab.record import eval_mode
from vitlab.targets import function_scores, is_function_target, is_multi_label, logits_of, resolve_target


def _scores_fn(model, score: str, multi_label: bool, function=None, method: str = ""):
    """The forward Captum differentiates: ``B x classes`` logits or log-probabilities; for a
    function target, its scores as ``B x 1``."""
    def forward(x):
        if function is not None:
            return function_scores(function, run_images(model, x), x.shape[0], method)[:, None]
        logits = logits_of(run_images(model, x))
        if score == "log_probability":
            return F.logsigmoid(logits) if multi_label else torch.log_softmax(logits, dim=-1)
        return logits
    return forward


def _attribute(model, x, target, score, pixels, method, attribute):
    """Checks, eval mode, target, Captum's ``attribute(forward, inputs, target)``, pooling."""
    check_images(x, method)
    check_input_dtype(model, x, method)  # a float64 batch for a float32 model: the remedy, not a dtype clash
    target = gradient_target(model, target, x.shape[0], score, method)
    function = target if is_function_target(target) else None
    grid = None if pixels else token_layout(model, x).grid
    x_in = gradient_leaf(x)
    with eval_mode(model), torch.enable_grad():
        forward = _scores_fn(model, score, is_multi_label(model), function, method)
        if function is not None:
            target = torch.zeros(x.shape[0], dtype=torch.long)  # column 0: the function's score
        else:
            with torch.no_grad():  # the predicted class, or the given one checked against the classes
                target = resolve_target(target, logits_of(run_images(model, x_in)))
        attribution = attribute(forward, x_in, target.to(x.device))
    per_pixel = attribution.detach().sum(dim=1)  # B x H x W
    if pixels:
        return per_pixel
    # mean over each patch's pixels (adaptive cells when a padded grid does not divide the image)
    return F.adaptive_avg_pool2d(per_pixel[:, None], grid)[:, 0]


def input_x_gradient(model, x: torch.Tensor, target=None, score: str = "logit",
                     pixels: bool = False) -> torch.Tensor:
    """Input x gradient (Shrikumar et al. 2016, "Not Just a Black Box") of the target score,
    Captum's ``InputXGradient``: ``B x gh x gw``.

    The map is ``sum_c x[c] * d y_t / d x[c]`` per pixel, averaged over the pixels of each patch
    (signed: negative where the pixels speak against the class): to first order, how much each
    pixel's value contributes to the target score compared with an all-zero input. One
    forward and one backward for the batch (and a forward without gradients that picks or
    checks the target); the gradient is taken with respect to the input
    only (no parameter's ``.grad`` changes), in eval mode, and every module's mode is put back.

    Args:
        model: a classifier with a class head (timm or Hugging Face ViT; the patch grid is
            read from :func:`vitlab.token_layout`, so with ``pixels=True`` any image
            classifier works).
        x: ``B x 3 x H x W`` input batch.
        target: int, one class per sample, None (the predicted class), or a function of the
            model's output returning one score per sample (a model without a class head, see
            :mod:`vitlab.targets`), e.g. ``target=lambda out: out.pooler_output @ direction``.
        score: ``"logit"`` or ``"log_probability"`` (:data:`vitlab.targets.SCORES`).
        pixels: return the ``B x H x W`` per-pixel map.
    """
    from captum.attr import InputXGradient

    def attribute(forward, inputs, t):
        return InputXGradient(forward).attribute(inputs, target=t)
    return _attribute(model, x, target, score, pixels, "input_x_gradient", attribute)


def integrated_gradients(model, x: torch.Tensor, target=None, score: str = "logit", steps: int = 32,
                         baseline: float = 0.0, pixels: bool = False,
                         internal_batch_size: int | None = None) -> torch.Tensor:
    """Integrated Gradients (Sundararajan, Taly & Yan, ICML 2017, "Axiomatic Attribution for
    Deep Networks", eq. 1, Riemann sum of Sec. 5), Captum's ``IntegratedGradients``:
    ``(x - x') ⊙ mean_k dy_t/dx at x' + a_k (x - x')``, summed over channels and averaged per
    patch: ``B x gh x gw``.

    Choices: the baseline ``x'`` is the constant ``baseline`` in the model's input space
    (default 0: after the usual mean / std normalisation, the dataset's mean colour, a grey
    image, rather than a black one, which would be a strong colour of its own for the
    model); ``steps`` points on Captum's default Gauss-Legendre rule (32: the completeness
    gap of eq. 3, ``sum attribution - (y_t(x) - y_t(x'))``, is what more steps shrink; see
    the tests). Costs ``steps`` forwards and backwards per image, run by Captum in forwards of
    ``internal_batch_size`` inputs (default 64).

    Args:
        model, x, target, score, pixels: as :func:`input_x_gradient`.
        steps: integration points (>= 1).
        baseline: the baseline's constant value (finite).
        internal_batch_size: inputs per forward inside Captum (None: 64).
    """
    from captum.attr import IntegratedGradients

    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be an int >= 1, got {steps!r}")
    if not isinstance(baseline, (int, float)) or isinstance(baseline, bool) or not torch.isfinite(
            torch.tensor(float(baseline))):
        raise ValueError(f"baseline must be a finite number, got {baseline!r}")
    if internal_batch_size is not None and (isinstance(internal_batch_size, bool)
                                            or not isinstance(internal_batch_size, int) or internal_batch_size < 1):
        raise ValueError(f"internal_batch_size must be an int >= 1 (or None for 64), got {internal_batch_size!r}")
    size = 64 if internal_batch_size is None else internal_batch_size

    def attribute(forward, inputs, t):
        return IntegratedGradients(forward).attribute(inputs, baselines=float(baseline), target=t,
                                                      n_steps=steps, internal_batch_size=size)
    return _attribute(model, x, target, score, pixels, "integrated_gradients", attribute)
