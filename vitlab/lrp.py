"""The LRP family on the model as it is: full LRP, partial LRP, Transformer attribution, AttnLRP.

Every method is ``(model, x, target=None, ...) -> B x gh x gw`` and costs one forward and
one backward for the whole batch (Transformer attribution: one more backward, for the
ordinary attention gradient). The rules live in :mod:`vitlab.record.lrp`, attached and
removed by ``vitlab.record(model, lrp=...)``; nothing here touches the model.

Relevance is what LRP conserves: the explained logit ``y_t`` is divided among the inputs of
each layer, layer by layer, down to the patch tokens. What a rule gives to a bias (and to
the position embedding added after the patch embedding, and to the CLS token) stays there:
the patch map sums to ``y_t`` minus those shares (:func:`lrp_conservation` measures them).

Choices where the papers leave room:

- Where the maps stop: at the patch embedding's output tokens ``e`` (``R = sum_d e ⊙
  gbar_e``, one value per patch), not at the pixels. The rule at the patch embedding only
  redistributes a token's relevance over its own pixels (the reference's z^B rule conserves
  it exactly, bias excluded), so on the patch grid every conservative pixel rule gives this
  map; the choice of pixel rule is left out rather than made. The position embedding
  ``x_0 = e + p`` takes its z-rule share ``p ⊙ R / x_0`` (the reference's ``Add`` without
  its rescaling, a positive factor per image that does not change a map's order).
- Rules for full and partial LRP and Transformer attribution: ``lrp="chefer"``, those of the
  reference code used for Transformer attribution (``modules/layers_ours.py``: alpha = 1,
  beta = 0 at linear layers, identity at GELU / LayerNorm / softmax, halved attention
  matmuls, rescaled residual additions). The reference's baselines for full and partial LRP
  use ``modules/layers_lrp.py`` instead, whose linear rule divides the positive and the
  negative inputs' contributions each by its own sum (so every linear layer doubles the
  relevance) and whose additions are not rescaled; vitlab uses the one conservative set.
- AttnLRP: epsilon rule with epsilon -> 0 at the linear layers (the plain gradient), not the
  gamma rule that lxt's ViT example tunes by eye per layer type: no gamma is picked for the
  reader. The softmax gets AttnLRP's own rule (lxt's ViT example uses CP-LRP inside the
  attention, which lets no relevance through the softmax).
- Transformer attribution starts at block 0 (``start_layer=0``): eq. 13 multiplies over
  every block; the reference's perturbation script passes ``start_layer=1``.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from vitlab.attention import _in_chunks, checked_layout
from vitlab.record import record
from vitlab.relevance.engine import head_averaged_relevance
from vitlab.targets import _logits, check_target, require_class_head, resolve_target


class LRPPass(NamedTuple):
    """What one LRP forward + backward gives (:func:`lrp_pass`).

    Attributes:
        patch_relevance: ``B x P`` relevance of each patch token (summed over channels).
        token_relevance: ``B x N`` relevance of every token entering the first block (patch
            embedding + position, CLS and other prefix tokens included).
        attention_relevance: per block ``B x heads x N x N``, ``R^A = A ⊙ gbar_A`` (with
            ``attention=True`` or ``plain=True``; ``attention="last"``: the last block's only).
        attention_grads: per block the ordinary ``dy_t / dA`` (with ``plain=True``; else empty).
        logit: ``(B,)`` the explained logit ``y_t``.
        target: ``(B,)`` the explained class.
    """

    patch_relevance: torch.Tensor
    token_relevance: torch.Tensor
    attention_relevance: list[torch.Tensor]
    attention_grads: list[torch.Tensor]
    logit: torch.Tensor
    target: torch.Tensor


def lrp_pass(model, x: torch.Tensor, target=None, rules: str = "chefer", attention: bool = False,
             plain: bool = False, tokens: bool = True, method: str = "lrp_pass") -> LRPPass:
    """One forward with the LRP rules ``rules`` attached and one LRP backward of the target
    logits (their sum over the batch: samples do not interact), plus with ``plain`` one
    ordinary backward for the attention gradients. ``attention``: also the relevance of every
    attention map (``attention="last"``: the last block's only); ``tokens=False`` leaves the
    token relevances out (empty tensors), so the backward stops at the first attention map it
    needs. Checks the input before the forward."""
    checked_layout(model, x, method)
    require_class_head(model, method)
    target = check_target(target, x.shape[0])
    if torch.is_inference_mode_enabled():
        raise RuntimeError(f"{method} needs gradients: call it outside torch.inference_mode()")
    capture = ("attention",) if attention or plain else ()
    with torch.enable_grad():
        x_in = (x.clone() if x.is_inference() else x.detach()).requires_grad_(True)
        with record(model, lrp=rules, capture=capture, detach=False, eval_mode=True) as rec:
            logits = _logits(model(x_in))
            t = resolve_target(target, logits)
            y = logits.gather(1, t[:, None])[:, 0]
            e, x0 = rec.patch_tokens[-1], rec.first_block_inputs[-1]
            attn = list(rec.attentions) if capture else []
            if attention == "last":
                attn = attn[-1:]
            wanted = ([e, x0] if tokens else []) + attn
            grads = list(torch.autograd.grad(y.sum(), wanted, retain_graph=plain))
            plain_grads = []
            if plain:
                with rec.plain_gradients():
                    plain_grads = [g.detach() for g in torch.autograd.grad(y.sum(), attn)]
    if tokens:
        R_e = (e.detach() * grads.pop(0)).sum(-1)  # B x P
        R_x0 = (x0.detach() * grads.pop(0)).sum(-1)  # B x N
    else:
        R_e = R_x0 = torch.empty(x.shape[0], 0, dtype=y.dtype, device=y.device)
    R_A = [a.detach() * g for a, g in zip(attn, grads)]
    return LRPPass(R_e, R_x0, R_A, plain_grads, y.detach(), t)


def _grid_map(method, model, x, target, kwargs, compute):
    """Shared steps of the map methods: input checks, chunking, then ``compute(model, x, target)``."""
    layout = checked_layout(model, x, method.__name__)
    chunked = _in_chunks(method, model, x, layout, gradients=True, target=target, **kwargs)
    if chunked is not None:  # a batch larger than vitlab.attention.MEMORY_BUDGET allows
        return chunked
    return layout.patches_to_grid(compute())


def lrp(model, x: torch.Tensor, target=None) -> torch.Tensor:
    """Full LRP to the patch tokens (Bach et al. 2015, "On Pixel-Wise Explanations for
    Non-Linear Classifier Decisions by Layer-Wise Relevance Propagation", eq. 60 for the
    alpha-beta rule; the transformer rules of Chefer, Gur & Wolf's reference code):
    ``B x gh x gw``, each patch's relevance ``sum_d e ⊙ gbar_e`` of the target logit, in logit
    units (signed; the patches' sum is the logit minus the shares of the position embedding
    and the prefix tokens, see the module docstring).

    Args:
        model: a timm or Hugging Face ViT classifier (run in eval mode, its mode put back).
        x: ``B x 3 x H x W`` input batch.
        target: int, one class per sample (sequence / 1-D tensor), or None (predicted).
    """
    return _grid_map(lrp, model, x, target, {}, lambda: lrp_pass(
        model, x, target, rules="chefer", method="lrp").patch_relevance)


def attn_lrp(model, x: torch.Tensor, target=None) -> torch.Tensor:
    """AttnLRP (Achtibat et al., ICML 2024, "AttnLRP: Attention-Aware Layer-Wise Relevance
    Propagation for Transformers": the softmax rule, the uniform rule for the attention
    matmuls (eq. 7), the identity rule for GELU (eq. 9) and the LayerNorm rule, the epsilon rule
    elsewhere) to the patch tokens: ``B x gh x gw`` in logit units, signed. One forward and
    one backward (the rules in :mod:`vitlab.record.lrp`, ``lrp="attnlrp"``).

    Args: as :func:`lrp`.
    """
    return _grid_map(attn_lrp, model, x, target, {}, lambda: lrp_pass(
        model, x, target, rules="attnlrp", method="attn_lrp").patch_relevance)


def partial_lrp(model, x: torch.Tensor, target=None) -> torch.Tensor:
    """Partial LRP (Voita et al., ACL 2019, "Analyzing Multi-Head Self-Attention", Sec. 4.1:
    heads weighed by their LRP relevance), as Chefer et al. (CVPR 2021) use it as a baseline:
    the LRP relevance of the last block's attention maps, ``R^A = A ⊙ gbar_A``, clamped at 0
    per head and averaged over heads, CLS row, patch columns (the reference's
    ``method="last_layer"``). A head whose output carries more of the logit's relevance
    contributes more: that is the weighting by head relevance. ``B x gh x gw``.

    Args: as :func:`lrp`.
    """
    def compute():
        p = lrp_pass(model, x, target, rules="chefer", attention="last", tokens=False, method="partial_lrp")
        return p.attention_relevance[-1].clamp(min=0).mean(dim=1)[:, 0, :]  # B x N
    return _grid_map(partial_lrp, model, x, target, {}, compute)


def transformer_attribution(model, x: torch.Tensor, target=None, start_layer: int = 0) -> torch.Tensor:
    """Transformer attribution (Chefer, Gur & Wolf, CVPR 2021, "Transformer Interpretability
    Beyond Attention Visualization", eq. 13): per block ``Abar_b = E_h[(grad A_b ⊙ R^{A_b})^+]``,
    with ``grad A_b`` the ordinary gradient of the target logit and ``R^{A_b}`` the attention
    map's LRP relevance (the reference's relprop rules, ``lrp="chefer"``), propagated as the
    reference does from relevance 1 on the target class (not from the logit's value: eq. 13's
    product is not invariant to that scale); then
    ``C = (I + Abar_1) · ... · (I + Abar_B)`` (eq. 13's product, no row normalisation, as in
    ``ViT_LRP.compute_rollout_attention``), map = ``C[CLS, patches]``. ``B x gh x gw``.

    The 2021 follow-up (:func:`vitlab.relevance.chefer_relevance`) is this with ``A`` in place
    of ``R^A``: no LRP pass at all.

    Args:
        model, x, target: as :func:`lrp`.
        start_layer: first block in the product (0: every block, eq. 13; the reference's
            perturbation script uses 1).
    """
    def compute():
        p = lrp_pass(model, x, target, rules="chefer", plain=True, tokens=False,
                     method="transformer_attribution")
        L = len(p.attention_relevance)
        if isinstance(start_layer, bool) or not isinstance(start_layer, int) or not 0 <= start_layer < L:
            raise ValueError(f"start_layer must be an int in [0, {L}), got {start_layer!r}")
        # the reference's relprop starts from relevance 1 on the target (its one-hot vector), not
        # from y_t: the rules are linear in the starting relevance, so R^A / y_t per sample
        R_A = [a / p.logit.to(a.dtype)[:, None, None, None] for a in p.attention_relevance]
        G = p.attention_grads
        r = torch.zeros(R_A[0].shape[0], R_A[0].shape[-1], dtype=R_A[0].dtype, device=R_A[0].device)
        r[:, 0] = 1  # e_CLS (I + Abar_B) ... (I + Abar_start), from the last block down
        for b in range(L - 1, start_layer - 1, -1):
            r = r + (r.unsqueeze(1) @ head_averaged_relevance(R_A[b], G[b])).squeeze(1)
        return r
    if isinstance(start_layer, bool) or not isinstance(start_layer, int) or start_layer < 0:
        raise ValueError(f"start_layer must be a non-negative int, got {start_layer!r}")
    return _grid_map(transformer_attribution, model, x, target, {"start_layer": start_layer}, compute)


def lrp_conservation(model, x: torch.Tensor, target=None, rules: str = "chefer") -> dict[str, torch.Tensor]:
    """Where the explained logit's relevance ends up, per sample (each ``(B,)``): ``"logit"``;
    ``"tokens"`` (every token entering the first block); ``"patches"`` (the patch tokens of
    the map); ``"absorbed"`` = logit - tokens (kept by biases, and with ``"attnlrp"`` by the
    softmax's bias term); ``"position and prefix"`` = tokens - patches."""
    p = lrp_pass(model, x, target, rules=rules, method="lrp_conservation")
    tokens, patches = p.token_relevance.sum(-1), p.patch_relevance.sum(-1)
    return {"logit": p.logit, "tokens": tokens, "patches": patches, "absorbed": p.logit - tokens,
            "position and prefix": tokens - patches}
