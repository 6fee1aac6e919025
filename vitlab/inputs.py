"""What every method checks and shares before its forward: the input checks, the memory
budget and chunking of a batch, the inference-mode refusal, the positive-int check.

- :func:`check_images`, :func:`check_batch_values`, :func:`check_input_dtype`,
  :func:`checked_layout`, :func:`require_cls` (with :data:`CLS_POOLS`), :func:`require_logit_start`
  (with :data:`TWO_TOKEN_POOLS`), :func:`readout_weights` (the tokens a model's output reads, a
  mean-pooled or two-token head's included): a wrong input is named,
  with what to do, before any forward pass;
- :data:`MEMORY_BUDGET`, :func:`chunk_size`, :func:`in_chunks`, :func:`batches`: a batch whose
  recorded attention would exceed the budget runs in chunks of samples, with the same maps;
- :func:`gradient_target`: a gradient method's target checks, once;
- :func:`require_gradients`: a gradient method called inside ``torch.inference_mode()`` says so;
  :func:`gradient_leaf`, :func:`graph_inputs`: the input a gradient starts from, also when it was made in
  inference mode;
- :func:`positive_int`, :func:`seed_int`, :func:`index_tensor`: the checks of a count, a seed
  and an array of indices.
"""
from __future__ import annotations

import torch

from vitlab.layout import TokenLayout, token_layout
from vitlab.record import attention_size, require_materialized
from vitlab.targets import (
    check_function_target, check_score, check_target, is_function_target, require_class_head,
)

#: Most bytes of recorded attention one forward of a map method (rollout, grad_rollout,
#: chefer_relevance, cls_attention, raw_attention, attention_gradcam) may hold: a forward inside
#: ``record`` keeps every block's ``B x heads x N x N`` attention (and, for the gradient methods,
#: its gradient), about 0.5 GB per image for DINOv2-S at 518 px. A larger batch runs in chunks
#: of samples, each through the method's computation (:func:`chunk_size`, :func:`in_chunks`): the
#: same maps, since samples do not interact in eval mode, at a bounded peak memory. 1 GiB by default; set
#: ``vitlab.inputs.MEMORY_BUDGET`` (in bytes) to suit the machine.
MEMORY_BUDGET = 1 << 30


#: Values of ``TokenLayout.pool`` whose output reads the CLS token (``""``: every token).
CLS_POOLS = ("token", "")

#: Values of ``TokenLayout.pool`` whose output reads the CLS token and one more token through two
#: linear maps: a distilled DeiT's two heads (``"token_distillation"``), Hugging Face Dinov2's
#: classifier over the CLS token and the patch mean (``"token_avg"``). A method that reads the
#: class token's own row refuses them (:func:`require_cls`); the row methods read both
#: (:meth:`vitlab.layout.TokenLayout.readout`); LRP starts from the logits and passes both.
TWO_TOKEN_POOLS = ("token_distillation", "token_avg")

#: What the output of each of :data:`TWO_TOKEN_POOLS` reads, for the refusals.
_TWO_TOKEN_WHY = {
    "token_distillation": ("is a distilled DeiT: its logits average two heads, one on the class token and one on the "
                           "distillation token"),
    "token_avg": ("has a classifier that reads the class token next to the mean of the patch tokens (the two "
                  "concatenated, as Hugging Face's Dinov2ForImageClassification does)"),
}


_POOL_WHY = {
    "map": ("pools the tokens with an attention probe (attention pooling: timm global_pool='map', SigLIP's "
            "pooling head), which has no class token of its own in the blocks; this method reads the class "
            "token's own attention (rollout, grad_rollout, chefer_relevance, last_block_relevance and "
            "raw_attention read the probe's row)"),
    "class_attention": ("is CaiT's: its class token joins the patch tokens only in the class-attention blocks "
                        "after the self-attention blocks, and this method reads the class token in every block "
                        "(grad_rollout, chefer_relevance, last_block_relevance and raw_attention carry it through "
                        "CaiT's blocks, and rollout too where the blocks' attention has no talking heads)"),
    "max": "max-pools the patch tokens, which is not a weighted sum of tokens that a row could stand for",
    "avgmax": "pools the patch tokens with avg + max, and the max is not a weighted sum of tokens",
}


def _pool_refusal(layout: TokenLayout, method: str, reads: str) -> ValueError:
    if not layout.has_class_token and layout.pool in CLS_POOLS:
        what = (f"its {layout.num_prefix} prefix tokens are registers, and a register is not a class token"
                if layout.num_prefix else "it has no prefix tokens")
        return ValueError(
            f"{method} reads {reads}, but this model has no class token ({what}) and its output pools no "
            "tokens; use a ViT with a class token or a mean-pooled head"
        )
    why = _POOL_WHY.get(layout.pool, f"pools the tokens with {layout.pool!r}")
    return ValueError(f"{method} reads {reads}, but this model's head {why}. Use a model whose head reads the "
                      "class token or the mean of the patch tokens (timm global_pool='token' or 'avg')")


def require_cls(layout: TokenLayout, method: str) -> None:
    """Raise ``ValueError`` when ``method`` cannot read a map from the CLS row of this layout.

    Two cases: the model has no CLS token (none at all, or only registers: a register is
    not a class token, and row 0 would be register 0), or its output does not read the CLS
    token (timm ``global_pool="avg"``, ``"map"``, ...: a CLS-row map would explain a token
    the head ignores). Methods defined on the class token's own attention (``cls_attention``,
    ``attention_gradcam``) call it with ``token_layout(model, x)`` before any forward pass;
    methods defined on a row of a matrix read :func:`readout_weights` instead.
    """
    if layout.has_class_token and layout.pool in CLS_POOLS:
        return
    pooled_methods = ("rollout, grad_rollout, chefer_relevance, last_block_relevance, raw_attention")
    if not layout.has_class_token:
        what = (f"its {layout.num_prefix} prefix tokens are registers, and a register is not a class token"
                if layout.num_prefix else "it has no prefix tokens")
        hint = (f"its head reads the mean of the patch tokens, which these methods explain: {pooled_methods}"
                if layout.pool == "avg" else "use a ViT with a class token")
        raise ValueError(
            f"{method} reads the class-token (CLS) row of the attention, but this model has no class token "
            f"({what}); {hint}"
        )
    if layout.pool == "avg":
        raise ValueError(
            f"{method} reads the class-token (CLS) row of the attention, but this model's head reads the mean of "
            "the patch tokens (global_pool='avg' / use_mean_pooling), so a CLS-row map would explain a token the "
            f"output ignores. Methods that read the pooled output's row do explain it: {pooled_methods}"
        )
    if layout.pool in TWO_TOKEN_POOLS:
        raise ValueError(
            f"{method} reads the class token's own row of the attention, but this model "
            f"{_TWO_TOKEN_WHY[layout.pool]}, so a map of the class token alone would explain part of what the "
            f"output reads. Methods that read the rows of the tokens the output reads do explain it: {pooled_methods}; and the LRP "
            "family (lrp, attn_lrp, partial_lrp, transformer_attribution) and the input gradients, which start "
            "from the logits"
        )
    raise _pool_refusal(layout, method, "the class-token (CLS) row of the attention")


def require_logit_start(layout: TokenLayout, method: str) -> None:
    """The check of a method that starts from the logits and passes the relevance back through the
    model's own head (the LRP family): :func:`require_cls`, except for :data:`TWO_TOKEN_POOLS`, whose
    heads the backward passes to both tokens (the rows such a method reads are then
    :func:`readout_weights`'s)."""
    if layout.pool not in TWO_TOKEN_POOLS or not layout.has_class_token:
        require_cls(layout, method)


def readout_weights(layout: TokenLayout, method: str, dtype=torch.float32, device=None) -> torch.Tensor:
    """The weights ``w`` (``N``) of the token the model's output reads, as a combination of the last
    block's tokens (:meth:`vitlab.layout.TokenLayout.readout`): ``e_CLS`` for a head reading the
    class token, ``1 / P`` on each of the ``P`` patch tokens for a mean-pooled head (timm
    ``global_pool="avg"``, BEiT, EVA-02, SigLIP's classifier), ``(e_CLS + e_dist) / 2`` for a
    distilled DeiT's two heads, ``e_CLS / 2 + 1 / (2P)`` on each patch for Hugging Face Dinov2's
    classifier over the CLS token and the patch mean.

    A map defined as row CLS of a matrix ``M`` over the tokens (rollout, Chefer relevance, the
    last block's attention) becomes ``w M`` for the pooled token: the pooled output is
    ``sum_i w_i h_i``, a fixed linear combination of the last block's tokens, so its row of the
    propagated matrix is the same combination of their rows (each row says what one output
    token is made of; the combination's is the combination of theirs). The prefix tokens'
    rows get weight 0 when the head averages the patches only. A head on two tokens reads them
    through two linear maps, not as one pooled token: its row is the mean of the two tokens'
    rows (the definition, :meth:`vitlab.layout.TokenLayout.readout`), and a gradient-weighted
    method's class-specific weighting reaches both tokens through the gradients. ``ValueError`` (naming what is
    missing) for any other head; called before the forward.
    """
    w = layout.readout(dtype=dtype, device=device)
    if w is None:
        raise _pool_refusal(layout, method, "the row of the token the model's output reads")
    return w


def check_images(x, method: str) -> None:
    """Raise ``ValueError`` unless ``x`` is a non-empty, finite ``B x C x H x W`` float batch.

    Every method calls it first, so a wrong input is named before any forward pass (and a
    NaN or infinite pixel never becomes an all-NaN map); the value checks are
    :func:`check_batch_values`.
    """
    if not isinstance(x, torch.Tensor):
        raise ValueError(
            f"{method} takes a B x 3 x H x W image tensor, got {type(x).__name__}; "
            "make one with vitlab.preprocess(image, model)"
        )
    if x.ndim == 3:
        raise ValueError(
            f"{method} takes a batch B x C x H x W, got a single image of shape {tuple(x.shape)}; "
            "add the batch dimension: x[None] (or x.unsqueeze(0))"
        )
    if x.ndim != 4:
        raise ValueError(f"{method} takes an image batch B x C x H x W, got shape {tuple(x.shape)}")
    check_batch_values(x, method)


def check_batch_values(x: torch.Tensor, method: str, name: str | None = None, unit: str = "image") -> None:
    """Raise ``ValueError`` when the batch ``x`` (samples first) is empty, not floating point,
    or holds a NaN or infinite value -- before any forward pass, so that a wrong input is
    named instead of becoming an all-NaN map (or an answer computed from NaN).

    :func:`check_images` calls it for pixels; the bimodal methods call it for every float
    input (``name``, e.g. ``"inputs['visual_feats']"``; None: the image batch), ``unit``
    naming what one sample is in the messages.
    """
    where = "" if name is None else f" {name}"
    if x.shape[0] == 0:
        raise ValueError(
            f"{method} got an empty batch{where} (B = 0, shape {tuple(x.shape)}); pass at least one {unit}"
        )
    if not x.is_floating_point():
        if name is None:
            raise ValueError(
                f"{method} takes a float image batch (normalised as the model expects), got dtype {x.dtype}; "
                "make one with vitlab.preprocess(image, model)"
            )
        raise ValueError(f"{method}:{where} must be a float tensor, got dtype {x.dtype}; convert it with .float()")
    fix = f"check how the {unit}s were loaded and normalised" if name is None else "check how it was computed"
    finite = torch.isfinite(x).flatten(1).all(dim=1) if x.ndim > 1 else torch.isfinite(x)
    if not bool(finite.all()):
        bad = (~finite).nonzero().flatten().tolist()
        raise ValueError(
            f"{method}:{where or ' the input'} holds NaN or infinite values (in sample{'s' if len(bad) > 1 else ''} "
            f"{', '.join(map(str, bad[:10]))}{', ...' if len(bad) > 10 else ''}), which would make every "
            f"map and score NaN; {fix}"
        )


def check_input_dtype(model, x: torch.Tensor, method: str) -> None:
    """Raise ``ValueError`` when ``x`` is not in the dtype of the model's floating-point parameters
    (a float64 batch for a float32 model would fail inside its first layer with "expected scalar
    type Double but found Float"); the message names both and the remedies. Under autocast the
    model casts its inputs itself: no dtype check. A model on the ``meta`` device (no weights) is
    refused first (:func:`vitlab.record.require_materialized`)."""
    require_materialized(model, method)
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), None)
    if dtype is None or x.dtype == dtype or torch.is_autocast_enabled(x.device.type):
        return
    raise ValueError(f"{method}: x is {x.dtype} but the model's parameters are {dtype}; pass x.to({dtype}) "
                     f"(or a model in {x.dtype}: model.to({x.dtype}), e.g. model.double() for float64)")


def checked_layout(model, x, method: str, cls_row: bool = True, pooled: bool = False) -> TokenLayout:
    """:func:`check_images`, :func:`check_input_dtype`, then ``token_layout(model, x)`` and, for a
    method that reads the CLS row (``cls_row``), :func:`require_cls`; for one that reads the row of
    the token the output reads (``pooled``), :func:`readout_weights`: every check a method makes
    before its forward."""
    check_images(x, method)
    check_input_dtype(model, x, method)
    layout = token_layout(model, x)
    if pooled:
        if layout.pool != "map":  # an attention-pool head's probe: checked once recorded (probe_sequence)
            readout_weights(layout, method)
    elif cls_row:
        require_cls(layout, method)
    return layout


def chunk_size(model, x: torch.Tensor, layout: TokenLayout, gradients: bool = False) -> int:
    """How many samples of ``x`` one forward may take within :data:`MEMORY_BUDGET` (at least 1).

    One sample's recording holds :func:`vitlab.record.attention_size` entries of ``x``'s dtype
    (sum over blocks of ``heads x N x N``), twice that with ``gradients`` (the attention and
    its gradient).
    """
    per_sample = attention_size(model, layout.num_tokens) * x.element_size() * (2 if gradients else 1)
    return max(1, int(MEMORY_BUDGET) // max(1, per_sample))


def batches(n: int, batch_size: int):
    """Slices ``0 .. n`` in runs of ``batch_size`` (a positive int, else ``ValueError``)."""
    positive_int("batch_size", batch_size)
    for start in range(0, n, batch_size):
        yield slice(start, min(start + batch_size, n))


def in_chunks(compute, model, x: torch.Tensor, layout: TokenLayout, gradients: bool = False, target=None):
    """``compute(x)`` -- for a gradient method ``compute(x, target)`` -- over chunks of
    :func:`chunk_size` samples, concatenated along the batch; one call on the whole batch when it
    fits in one forward.

    A method checks its input once, then hands its unchecked computation to this (the chunks are
    slices of a batch already checked, so nothing is validated again per chunk). ``target``: the
    gradient method's target as :func:`gradient_target` returned it (None, a ``(B,)`` tensor, or a
    function), split with the batch."""
    size = chunk_size(model, x, layout, gradients)
    if size >= x.shape[0]:
        return compute(x, target) if gradients else compute(x)
    chunks = x.split(size)
    if not gradients:
        return torch.cat([compute(c) for c in chunks])
    targets = target.split(size) if isinstance(target, torch.Tensor) else [target] * len(chunks)
    return torch.cat([compute(c, t) for c, t in zip(chunks, targets)])


def gradient_target(model, target, batch_size: int, score: str, method: str):
    """Every check a gradient method makes of its target before the forward, once: a function target
    (:func:`vitlab.targets.check_function_target`), else a class head
    (:func:`vitlab.targets.require_class_head`), the classes (:func:`vitlab.targets.check_target`)
    and ``score``; then :func:`require_gradients`. Returns the target as the computation takes it:
    the function, None (the predicted class) or a ``(batch_size,)`` tensor."""
    if is_function_target(target):
        check_function_target(target, score, method)
    else:
        require_class_head(model, method)
        target = check_target(target, batch_size)
        check_score(score)
    require_gradients(method)
    return target


def require_gradients(method: str) -> None:
    """Raise ``RuntimeError`` when called inside ``torch.inference_mode()``: ``method`` needs
    gradients, and inference mode cannot be switched off from inside (``torch.no_grad()`` can)."""
    if torch.is_inference_mode_enabled():
        raise RuntimeError(
            f"{method} needs gradients, but it was called inside torch.inference_mode(), which cannot be "
            "switched off from inside: call it outside inference_mode (inside torch.no_grad() is fine)")


def graph_inputs(inputs: dict) -> dict:
    """``inputs`` (a model's keyword inputs) with every tensor made under ``torch.inference_mode()``
    copied, so that a forward whose graph a gradient method differentiates can save it for the
    backward (an inference tensor cannot be saved); other entries as they are."""
    return {k: v.clone() if isinstance(v, torch.Tensor) and v.is_inference() else v for k, v in inputs.items()}


def gradient_leaf(x: torch.Tensor, requires_grad: bool = True) -> torch.Tensor:
    """A new leaf holding ``x``'s values, requiring grad (with ``requires_grad``), that the caller's
    graph starts from: ``x`` detached, or copied when ``x`` was made under ``torch.inference_mode()``
    (an inference tensor cannot be made to require grad, nor saved for a backward). Call it after
    :func:`require_gradients` (inside ``torch.inference_mode()`` no graph can start anywhere)."""
    leaf = x.clone() if x.is_inference() else x.detach()
    return leaf.requires_grad_(requires_grad)


def positive_int(name: str, value):
    """``value`` when it is an int >= 1 (not a bool), else ``ValueError`` naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def seed_int(name: str, value) -> int:
    """``value`` as a seed: an int >= 0 (a Python or numpy int, not a bool), else ``ValueError``.
    ``None`` is refused too: vitlab's random draws (bootstrap resamples, probe directions) are
    reproducible by design, so a seed picks one of them; pass another int for another draw."""
    import numbers

    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or int(value) < 0:
        raise ValueError(f"{name} must be an int >= 0 (the same seed gives the same draw; pass another int for "
                         f"another one), got {value!r}")
    return int(value)


def index_tensor(values, name: str) -> torch.Tensor:
    """``values`` (a tensor, array or list of integers) as an int64 tensor, else ``ValueError``:
    a float index would be truncated (1.7 -> 1) and a bool read as 0/1, silently picking
    another row."""
    import numpy as np

    if isinstance(values, torch.Tensor):
        ok = not (values.is_floating_point() or values.is_complex() or values.dtype == torch.bool)
        kind = str(values.dtype)
    else:
        arr = np.asarray(values)
        ok, kind = arr.dtype.kind in "iu" or (arr.size == 0 and arr.dtype.kind == "f"), str(arr.dtype)
        values = arr if ok else values
    if not ok:
        raise ValueError(f"{name} must hold integers (indices), got {kind}: a float would be truncated to another "
                         "index; pass ints (e.g. torch.arange(n) or a list of ints)")
    return torch.as_tensor(values).to(torch.long)
