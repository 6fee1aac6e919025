"""Which class to explain: the ``target`` argument shared by every class-specific method.

Every explanation method takes ``target`` in one of these forms:

- ``None`` -- each sample's predicted class (argmax of its logits);
- an ``int`` -- the same class for every sample of the batch;
- a sequence, NumPy array or 1-D integer tensor -- one class per sample (length = batch size).

The gradient methods on ViTs (:func:`vitlab.attention.attention_gradients` and every method
built on it: ``attention_gradcam``, ``grad_rollout``, ``chefer_relevance``,
``last_block_relevance``; :func:`vitlab.gradients.input_x_gradient`,
:func:`vitlab.gradients.integrated_gradients`) also take

- a function of the model's output -- ``target(output)`` returns one score per sample, a
  ``(B,)`` float tensor, which the method differentiates. This explains a model without a
  class head (Hugging Face ``Dinov2Model``, ``CLIPVisionModel``, a timm model with
  ``num_classes=0``) for any score you define on its output, e.g. how far each image's
  embedding points along a direction::

      direction = text_embedding / text_embedding.norm()         # D, a direction in embedding space
      maps = vitlab.chefer_relevance(dinov2, x, target=lambda out: out.pooler_output @ direction)

  The function must compute each sample's score from that sample's outputs only (rows of the
  batch do not mix), and work for any batch size: a method may run the batch in chunks, and
  Integrated Gradients runs it along its path. ``score=`` stays ``"logit"``: the function's
  value is the score. The map still reads the row of the token the model's output reads
  (:meth:`vitlab.layout.TokenLayout.readout`: the CLS token for these models), so the
  function should read the pooled output (``pooler_output``, timm's ``forward_head``), the
  token the map explains.

:func:`check_target` validates the form before the model runs (so a batch/target length
mismatch costs no forward pass); :func:`resolve_target` then fills in the predicted classes
and checks the range against the model's number of classes, read from its logits.
:func:`is_function_target` and :func:`function_scores` serve the function form.
"""
from __future__ import annotations

import numbers
from collections.abc import Sequence

import numpy as np
import torch

_ALLOWED = "an int, one class per sample (a sequence or 1-D integer tensor), or None (predicted class)"


def logits_of(output) -> torch.Tensor:
    """The ``B x num_classes`` logits of a model output (a tensor, or an object with ``.logits``).

    timm classifiers return the logits tensor; Hugging Face classification models return an
    output object whose ``.logits`` holds it.
    """
    logits = output if isinstance(output, torch.Tensor) else getattr(output, "logits", None)
    if not isinstance(logits, torch.Tensor):
        raise ValueError(
            f"the model returned {type(output).__name__}, which holds no logits: a class target needs a "
            "classification model (one returning logits or an output with .logits). To explain a model "
            "without a head, pass target as a function of its output returning one score per sample, e.g. "
            "target=lambda out: out.pooler_output @ direction (gradient methods accept it)"
        )
    if logits.ndim != 2:
        raise ValueError(f"expected logits of shape B x num_classes, got {tuple(logits.shape)}")
    return logits


def require_class_head(model, method: str) -> None:
    """Raise ``ValueError`` when ``model`` has no class head for ``method`` to explain.

    A timm model built with ``num_classes=0`` (a feature extractor, like vitlab's embedded
    ``dinov2_small_imgfocus``) returns a feature vector, not class scores: differentiating
    "class" t of it would differentiate feature channel t. Hugging Face base models
    (``ViTModel``, ...) are caught by :func:`logits_of` (their output has no ``.logits``).
    Class-specific methods call this before any forward pass.
    """
    num_classes = getattr(model, "num_classes", None)
    if isinstance(num_classes, int) and not isinstance(num_classes, bool) and num_classes == 0:
        raise ValueError(
            f"{method} explains a class score, but {type(model).__name__} has no class head "
            "(num_classes=0: its output is a feature vector, whose channels are not classes). "
            "Use a classifier, a class-agnostic method (rollout, raw_attention, cls_attention), or pass "
            "target as a function of the output returning one score per sample, e.g. "
            "target=lambda out: out @ direction (gradient methods accept it)"
        )


def is_function_target(target) -> bool:
    """Whether ``target`` is a function of the model's output (see the module docstring), not a
    class index form."""
    return callable(target) and not isinstance(target, (torch.Tensor, np.ndarray, type))


def check_function_target(target, score: str, method: str) -> None:
    """Checks for a function ``target`` before the forward: ``score`` must be ``"logit"`` (the
    function's value is the score itself)."""
    check_score(score)
    if score != "logit":
        raise ValueError(
            f"{method}: score={score!r} reads a class's log-probability, but target is a function whose value "
            "is the score itself; leave score='logit' (or return the log-probability from the function)"
        )


def function_scores(target, output, batch_size: int, method: str) -> torch.Tensor:
    """``target(output)`` checked: a ``(batch_size,)`` floating-point tensor in the autograd graph."""
    scores = target(output)
    if not isinstance(scores, torch.Tensor):
        raise ValueError(f"{method}: target(output) must return a tensor of one score per sample, "
                         f"got {type(scores).__name__}")
    if tuple(scores.shape) != (batch_size,) or not scores.is_floating_point():
        raise ValueError(
            f"{method}: target(output) must return one float score per sample, shape ({batch_size},), got "
            f"shape {tuple(scores.shape)} of dtype {scores.dtype}; e.g. target=lambda out: out.pooler_output @ "
            "direction for a direction of the embedding's size"
        )
    if not scores.requires_grad:
        raise ValueError(
            f"{method}: target(output) returned scores outside the autograd graph (detached, or computed "
            "without the model's output), so they have no gradient to explain; compute them from the output "
            "with differentiable operations"
        )
    return scores


#: What a class-specific method differentiates: the target's logit (Chefer et al., the blog) or
#: its log-probability as the model's head defines it. For a softmax head (one class per image)
#: that is ``log softmax(logits)[t] = y_t - logsumexp(y)``, whose gradient
#: ``dy_t - sum_j p_j dy_j`` subtracts what raises every likely class alike. For a multi-label
#: head (one sigmoid per class, "is class t here?", see :func:`is_multi_label`) it is
#: ``log sigmoid(y_t)``, whose gradient ``(1 - p_t) dy_t`` is the logit's, scaled per sample.
SCORES = ("logit", "log_probability")


def is_multi_label(model) -> bool:
    """Whether ``model``'s logits are independent per-class sigmoids (multi-label), not one softmax.

    Read from timm's ``pretrained_cfg["multi_label"]`` (set by vitlab's shapes models) or a
    Hugging Face config's ``problem_type == "multi_label_classification"``; False otherwise.
    """
    cfg = getattr(model, "pretrained_cfg", None)
    if isinstance(cfg, dict) and "multi_label" in cfg:
        return bool(cfg["multi_label"])
    hf = getattr(model, "config", None)
    return getattr(hf, "problem_type", None) == "multi_label_classification"


def class_probabilities(logits: torch.Tensor, multi_label: bool = False) -> torch.Tensor:
    """The head's class probabilities: ``sigmoid`` per class (multi-label) or ``softmax``."""
    return torch.sigmoid(logits) if multi_label else torch.softmax(logits, dim=-1)


def check_score(score: str) -> str:
    """Validate a ``score`` argument (one of :data:`SCORES`)."""
    if score not in SCORES:
        raise ValueError(f"score must be one of {SCORES}, got {score!r}")
    return score


def target_score(logits: torch.Tensor, t: torch.Tensor, score: str = "logit",
                 multi_label: bool = False) -> torch.Tensor:
    """``(B,)`` per-sample score of class ``t[b]``: its logit or its log-probability
    (``log softmax``, or ``log sigmoid`` for a ``multi_label`` head; see :data:`SCORES`)."""
    check_score(score)
    if score == "log_probability":
        logits = torch.nn.functional.logsigmoid(logits) if multi_label else torch.log_softmax(logits, dim=-1)
    return logits.gather(1, t[:, None])[:, 0]


def _check_class_index(i: int, v) -> None:
    """One entry of a per-sample target sequence: an integer class index, nothing else."""
    if isinstance(v, (bool, np.bool_)):
        raise ValueError(f"target must hold integer class indices, got a bool at position {i} ({v})")
    if isinstance(v, numbers.Integral):
        return
    if isinstance(v, torch.Tensor) and v.ndim == 0 and not (
        v.dtype == torch.bool or v.is_floating_point() or v.is_complex()
    ):
        return
    if isinstance(v, np.ndarray) and v.ndim == 0 and v.dtype.kind in "iu":
        return
    hint = " (class names are not accepted: pass the class index)" if isinstance(v, (str, bytes)) else ""
    raise ValueError(
        f"target must hold integer class indices, got {v!r} ({type(v).__name__}) at position {i}{hint}"
    )


def check_target(target, batch_size: int) -> torch.Tensor | None:
    """Validate the form of ``target`` for a batch of ``batch_size``; no model needed.

    Returns ``None`` (predicted class, decided later) or a ``(batch_size,)`` int64 CPU tensor.
    Raises ``ValueError`` for booleans (also inside a sequence), non-integers (floats, None,
    class names), empty sequences, wrong dimensions and length mismatches.
    """
    if target is None:
        return None
    if isinstance(target, (bool, np.bool_)):
        raise ValueError(f"target must be {_ALLOWED}, got a bool ({target})")
    if isinstance(target, numbers.Integral):
        return torch.full((batch_size,), int(target), dtype=torch.long)
    if isinstance(target, Sequence) and not isinstance(target, (str, bytes)):
        if len(target) == 0 and batch_size > 0:
            raise ValueError(
                f"target is empty but the batch has {batch_size} samples: pass one class per sample, "
                "a single int for all, or None for the predicted class"
            )
        for i, v in enumerate(target):
            _check_class_index(i, v)
        target = np.asarray([int(v) for v in target], dtype=np.int64)
    if isinstance(target, (torch.Tensor, np.ndarray)):
        if isinstance(target, np.ndarray) and target.dtype.kind not in "biufc":
            raise ValueError(f"target must hold integer class indices, got an array of dtype {target.dtype}")
        t = torch.as_tensor(target)
        if t.dtype == torch.bool or t.is_floating_point() or t.is_complex():
            raise ValueError(f"target must hold integer class indices, got dtype {t.dtype}")
        if t.ndim == 0:
            return torch.full((batch_size,), int(t), dtype=torch.long)
        if t.ndim != 1:
            raise ValueError(f"target must be {_ALLOWED}; got shape {tuple(t.shape)}")
        if t.numel() != batch_size:
            raise ValueError(
                f"target has {t.numel()} classes but the batch has {batch_size} samples: "
                "pass one class per sample, a single int for all, or None for the predicted class"
            )
        return t.to(device="cpu", dtype=torch.long)
    if is_function_target(target):
        raise ValueError(
            "target is a function, which this method does not take: it explains a class, so pass "
            f"{_ALLOWED}. A function of the model's output is accepted by the gradient methods on ViTs "
            "(attention_gradients, attention_gradcam, grad_rollout, chefer_relevance, last_block_relevance, "
            "input_x_gradient, integrated_gradients)"
        )
    raise ValueError(f"target must be {_ALLOWED}, got {type(target).__name__}")


def resolve_target(target, logits: torch.Tensor) -> torch.Tensor:
    """The ``(B,)`` int64 class per sample, on ``logits.device``, checked against the classes.

    ``target`` is anything :func:`check_target` accepts (or its result); ``None`` becomes
    ``logits.argmax(-1)``. A class outside ``0 .. num_classes - 1`` raises ``ValueError``.
    """
    B, num_classes = logits.shape
    t = check_target(target, B)
    if t is None:
        return logits.detach().argmax(dim=-1)
    bad = (t < 0) | (t >= num_classes)
    if bool(bad.any()):
        raise ValueError(
            f"target {t[bad][0].item()} is outside the model's classes: "
            f"allowed 0 .. {num_classes - 1} ({num_classes} classes)"
        )
    return t.to(logits.device)
