"""The LRP family on the model as it is: full LRP, partial LRP, Transformer attribution, AttnLRP.

Every method is ``(model, x, target=None, ...) -> B x gh x gw`` and costs one forward and
one backward for the whole batch (Transformer attribution: one more backward, for the
ordinary attention gradient). The rules live in :mod:`vitlab.record.lrp`, attached and
removed by ``vitlab.record(model, lrp=...)``; nothing here touches the model (the methods with
Chefer's rules run a float64 copy of it, see Precision below).

Relevance is what LRP conserves: the explained logit ``y_t`` is divided among the inputs of
each layer, layer by layer, down to the patch tokens. What a rule gives to a bias (and to
the position embedding added after the patch embedding, and to the CLS token) stays there:
the patch map sums to ``y_t`` minus those shares (:func:`lrp_conservation` measures them).

Precision. Chefer's rules pass relevance through the softmax and every LayerNorm unchanged
(the identity rule), and the operation before each then splits it over the terms of a sum by
their share of it: an attention score ``q·k`` over its ``q_d k_d``, a residual stream ``a + b``
and the position sum ``e + p`` over their parts (the z-rule). Exact, but with a pole: where a
sum ``s`` is small against its terms (``rho = |s| / sum |terms|``) each term receives about
``R / rho``, terms of opposite signs nearly cancelling, and ``rho`` is known only as well as the
forward computed ``s``. A float32 forward computes ``s`` with an error of about ``1e-7 sum
|terms|``, so a sum with ``rho`` of 1e-6 .. 1e-4 that carries relevance gives the float32 map
another value than the rule's (scene 15 of ``make_scenes(30, 80_001, 2)`` on
``shapes-vit-tiny``: a block-0 score with ``rho = 7e-7``, computed as 1e-8 instead of 6.6e-7,
puts -401 on a patch where the rule gives -6.2). No computation order of the rules avoids it:
the error is in the forward's values, which the rules leave as the model computes them. Nor
does a stabiliser: ``s / (s^2 + (k sum |terms|)^2)`` in place of ``1 / s`` at the three sums,
in both dtypes, needs ``k = 1e-4`` to bring float32 within 2% of float64 on those 30 scenes,
and at ``k = 1e-4`` the float64 maps themselves move by a median 15% (max 238%) of their
maximum; ``k = 1e-5`` moves them up to 103% and leaves float32 21% away. So the methods with
these rules (:func:`lrp`, :func:`partial_lrp`, :func:`transformer_attribution`, and
:func:`lrp_pass` / :func:`lrp_conservation` with ``rules="chefer"``) run a float64 copy of a
model in another dtype by default (``precision="float64"``: :func:`at_precision`, made fresh
per call by :func:`vitlab.record.lrp.working_copy`; the model itself is not touched) and return
the maps in ``x``'s dtype: the rule's value to float32 rounding (``benchmarks/
check_lrp_float32.py``: within 1e-6 of the map's max on every scene of both seeds), for 2.2x
the CPU time of a float32 pass (measured on ``shapes-vit-tiny``, 30 scenes, one thread) and
twice its activation memory plus the copy's parameters. ``precision="model"`` runs the model
as it is; what float32 then costs against the float64 pass, as % of the map's max |value| on
30 two-object scenes of seeds 29_017 / 80_001: full LRP max 64.6% / 6364%, median 0.19% /
0.16%, 4 / 10 of the 30 scenes over 2%; Transformer attribution max 11.9% / 1.6%; partial LRP
max 0.17% / 0.01%. AttnLRP's rules divide by no sum (the plain gradient at linear layers and
the softmax, the LayerNorm rule holds sigma constant, GELU's ``gelu(x) / x`` is bounded):
float32 is within 0.001% there, and :func:`attn_lrp` runs at the model's precision unless
asked.

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
- Transformer attribution starts at block 0 (``start_block=0``): eq. 13 multiplies over
  every block; the reference's perturbation script passes ``start_layer=1`` (``start_block=1`` here).
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from vitlab.compat import renamed_arguments
from vitlab.inputs import check_images, check_input_dtype, checked_layout, in_chunks, require_gradients
from vitlab.record import record
from vitlab.record.lrp import working_copy
from vitlab.relevance.engine import head_averaged_relevance
from vitlab.targets import check_target, logits_of, require_class_head, resolve_target


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


#: What ``precision=`` takes: ``"float64"`` runs a float64 copy of a model in another dtype,
#: ``"model"`` runs the model in its own dtype (see the module docstring).
PRECISIONS = ("float64", "model")

#: The precision each rule set runs at unless asked: Chefer's rules have poles (module docstring).
DEFAULT_PRECISION = {"chefer": "float64", "attnlrp": "model"}


def at_precision(model, x: torch.Tensor, precision: str, method: str):
    """``(model, x)`` as the pass runs them: with ``precision="float64"`` a float64 copy of the
    model (:func:`vitlab.record.lrp.working_copy`; none when it is float64 already) and ``x`` in
    float64; with ``"model"`` the model and ``x`` as they are, ``x`` in the model's dtype (else
    ``ValueError`` with the remedy). Checks ``x`` first."""
    check_images(x, method)
    if precision not in PRECISIONS:
        raise ValueError(f"{method}: precision must be one of {PRECISIONS}, got {precision!r}")
    if precision == "model":
        check_input_dtype(model, x, method)  # x in the model's dtype, or the remedy
        return model, x
    dtype = next((t.dtype for t in model.parameters() if t.is_floating_point()), torch.float64)
    return (model if dtype == torch.float64 else working_copy(model, torch.float64)), x.to(torch.float64)


def lrp_pass(model, x: torch.Tensor, target=None, rules: str = "chefer", attention: bool = False,
             plain: bool = False, tokens: bool = True, method: str = "lrp_pass",
             precision: str | None = None) -> LRPPass:
    """One forward with the LRP rules ``rules`` attached and one LRP backward of the target
    logits (their sum over the batch: samples do not interact), plus with ``plain`` one
    ordinary backward for the attention gradients. ``attention``: also the relevance of every
    attention map (``attention="last"``: the last block's only); ``tokens=False`` leaves the
    token relevances out (empty tensors), so the backward stops at the first attention map it
    needs. ``precision``: ``"float64"`` or ``"model"`` (:data:`PRECISIONS`; None: the rule set's
    :data:`DEFAULT_PRECISION`, float64 for ``"chefer"``); the results come in ``x``'s dtype.
    Checks the input before the forward."""
    precision = DEFAULT_PRECISION.get(rules, "model") if precision is None else precision
    run_model, run_x = at_precision(model, x, precision, method)
    p = _lrp_pass(run_model, run_x, target, rules, attention, plain, tokens, method)
    like = x.dtype
    return LRPPass(p.patch_relevance.to(like), p.token_relevance.to(like), [a.to(like) for a in p.attention_relevance],
                   [g.to(like) for g in p.attention_grads], p.logit.to(like), p.target)


def _lrp_pass(model, x: torch.Tensor, target, rules: str, attention, plain: bool, tokens: bool, method: str,
              unit: bool = False) -> LRPPass:
    """:func:`lrp_pass` at the model's own precision; ``unit``: the backward starts from relevance
    1 on each target logit instead of the logit's value (``ValueError`` where a logit is exactly 0:
    relevance 1 on it is no gradient)."""
    checked_layout(model, x, method)
    require_class_head(model, method)
    target = check_target(target, x.shape[0])
    require_gradients(method)
    capture = ("attention",) if attention or plain else ()
    with torch.enable_grad():
        x_in = (x.clone() if x.is_inference() else x.detach()).requires_grad_(True)
        with record(model, lrp=rules, capture=capture, detach=False, eval_mode=True) as rec:
            logits = logits_of(model(x_in))
            t = resolve_target(target, logits)
            y = logits.gather(1, t[:, None])[:, 0]
            start = torch.ones_like(y)
            if unit:
                zero = (y.detach() == 0).nonzero()
                if zero.numel():
                    raise ValueError(
                        f"{method}: the explained logit is exactly 0 for sample {int(zero[0])} (class "
                        f"{int(t[zero[0]])}); the LRP pass starts from relevance 1 on it, which a gradient "
                        "cannot express there (relevance = logit x gradient): explain another class (target=...)")
                start = 1 / y.detach()  # relevance y_t * (1 / y_t) = 1 (the reference's relprop(one_hot))
            e, x0 = rec.patch_tokens[-1], rec.first_block_inputs[-1]
            attn = list(rec.attentions) if capture else []
            if attention == "last":
                attn = attn[-1:]
            wanted = ([e, x0] if tokens else []) + attn
            grads = list(torch.autograd.grad(y, wanted, grad_outputs=start, retain_graph=plain))
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


def _grid_map(method, model, x, target, kwargs, compute, precision: str):
    """Shared steps of the map methods: input checks, the precision (:func:`at_precision`),
    chunking, then ``compute(model, x, target)`` at that precision; the map in ``x``'s dtype."""
    run_model, run_x = at_precision(model, x, precision, method.__name__)
    layout = checked_layout(run_model, run_x, method.__name__)
    chunked = in_chunks(method, run_model, run_x, layout, gradients=True, target=target, precision=precision,
                         **kwargs)
    if chunked is not None:  # a batch larger than vitlab.inputs.MEMORY_BUDGET allows
        return chunked.to(x.dtype)
    return layout.patches_to_grid(compute(run_model, run_x)).to(x.dtype)


def lrp(model, x: torch.Tensor, target=None, precision: str = "float64") -> torch.Tensor:
    """Full LRP to the patch tokens (Bach et al. 2015, "On Pixel-Wise Explanations for
    Non-Linear Classifier Decisions by Layer-Wise Relevance Propagation", eq. 60 for the
    alpha-beta rule; the transformer rules of Chefer, Gur & Wolf's reference code):
    ``B x gh x gw``, each patch's relevance ``sum_d e ⊙ gbar_e`` of the target logit, in logit
    units (signed; the patches' sum is the logit minus the shares of the position embedding
    and the prefix tokens, see the module docstring; a target logit of 0 has nothing to
    distribute: a map of 0). Computed in float64 unless asked (``precision``): these rules'
    relevance is decided by sums that float32 cannot resolve (the module docstring measures
    what float32 costs).

    Args:
        model: a timm or Hugging Face ViT classifier (run in eval mode, its mode put back).
        x: ``B x 3 x H x W`` input batch.
        target: int, one class per sample (sequence / 1-D tensor), or None (predicted).
        precision: ``"float64"`` (default: a float64 copy of a model in another dtype; the map
            is returned in ``x``'s dtype) or ``"model"`` (the model's own dtype; ``x`` must be
            in it).
    """
    return _grid_map(lrp, model, x, target, {}, lambda m, xx: _lrp_pass(
        m, xx, target, "chefer", False, False, True, "lrp").patch_relevance, precision)


def attn_lrp(model, x: torch.Tensor, target=None, precision: str = "model") -> torch.Tensor:
    """AttnLRP (Achtibat et al., ICML 2024, "AttnLRP: Attention-Aware Layer-Wise Relevance
    Propagation for Transformers": the softmax rule, the uniform rule for the attention
    matmuls (eq. 7), the identity rule for GELU (eq. 9) and the LayerNorm rule, the epsilon rule
    elsewhere) to the patch tokens: ``B x gh x gw`` in logit units, signed. One forward and
    one backward (the rules in :mod:`vitlab.record.lrp`, ``lrp="attnlrp"``). Its rules divide by
    no sum, so it runs at the model's precision (float32 within 0.001% of float64).

    Args: as :func:`lrp`, with ``precision`` defaulting to ``"model"``.
    """
    return _grid_map(attn_lrp, model, x, target, {}, lambda m, xx: _lrp_pass(
        m, xx, target, "attnlrp", False, False, True, "attn_lrp").patch_relevance, precision)


def partial_lrp(model, x: torch.Tensor, target=None, precision: str = "float64") -> torch.Tensor:
    """Partial LRP (Voita et al., ACL 2019, "Analyzing Multi-Head Self-Attention", Sec. 4.1:
    heads weighed by their LRP relevance), as Chefer et al. (CVPR 2021) use it as a baseline:
    the LRP relevance of the last block's attention maps, ``R^A = A ⊙ gbar_A``, clamped at 0
    per head and averaged over heads, CLS row, patch columns (the reference's
    ``method="last_layer"``). A head whose output carries more of the logit's relevance
    contributes more: that is the weighting by head relevance. ``B x gh x gw``.

    Args: as :func:`lrp`.
    """
    def compute(m, xx):
        p = _lrp_pass(m, xx, target, "chefer", "last", False, False, "partial_lrp")
        return p.attention_relevance[-1].clamp(min=0).mean(dim=1)[:, 0, :]  # B x N
    return _grid_map(partial_lrp, model, x, target, {}, compute, precision)


@renamed_arguments(start_layer="start_block")
def transformer_attribution(model, x: torch.Tensor, target=None, start_block: int = 0,
                            precision: str = "float64") -> torch.Tensor:
    """Transformer attribution (Chefer, Gur & Wolf, CVPR 2021, "Transformer Interpretability
    Beyond Attention Visualization", eq. 13): per block ``Abar_b = E_h[(grad A_b ⊙ R^{A_b})^+]``,
    with ``grad A_b`` the ordinary gradient of the target logit and ``R^{A_b}`` the attention
    map's LRP relevance (the reference's relprop rules, ``lrp="chefer"``), propagated as the
    reference does from relevance 1 on the target class (not from the logit's value: eq. 13's
    product is not invariant to that scale); then
    ``C = (I + Abar_1) · ... · (I + Abar_B)`` (eq. 13's product, no row normalisation, as in
    ``ViT_LRP.compute_rollout_attention``), map = ``C[CLS, patches]``. ``B x gh x gw``.
    A target logit of exactly 0 is refused (``ValueError``): relevance 1 on it cannot be
    written as a gradient (the LRP pass's relevance is logit x gradient).

    The 2021 follow-up (:func:`vitlab.relevance.chefer_relevance`) is this with ``A`` in place
    of ``R^A``: no LRP pass at all.

    Args:
        model, x, target, precision: as :func:`lrp`.
        start_block: first block in the product (0: every block, eq. 13; the reference's
            perturbation script uses 1).
    """
    def compute(m, xx):
        p = _lrp_pass(m, xx, target, "chefer", False, True, False, "transformer_attribution", unit=True)
        L = len(p.attention_relevance)
        if isinstance(start_block, bool) or not isinstance(start_block, int) or not 0 <= start_block < L:
            raise ValueError(f"start_block must be an int in [0, {L}), got {start_block!r}")
        R_A, G = p.attention_relevance, p.attention_grads
        r = torch.zeros(R_A[0].shape[0], R_A[0].shape[-1], dtype=R_A[0].dtype, device=R_A[0].device)
        r[:, 0] = 1  # e_CLS (I + Abar_B) ... (I + Abar_start), from the last block down
        for b in range(L - 1, start_block - 1, -1):
            r = r + (r.unsqueeze(1) @ head_averaged_relevance(R_A[b], G[b])).squeeze(1)
        return r
    if isinstance(start_block, bool) or not isinstance(start_block, int) or start_block < 0:
        raise ValueError(f"start_block must be a non-negative int, got {start_block!r}")
    return _grid_map(transformer_attribution, model, x, target, {"start_block": start_block}, compute, precision)


def lrp_conservation(model, x: torch.Tensor, target=None, rules: str = "chefer",
                     precision: str | None = None) -> dict[str, torch.Tensor]:
    """Where the explained logit's relevance ends up, per sample (each ``(B,)``): ``"logit"``;
    ``"tokens"`` (every token entering the first block); ``"patches"`` (the patch tokens of
    the map); ``"absorbed"`` = logit - tokens (kept by biases, and with ``"attnlrp"`` by the
    softmax's bias term); ``"position and prefix"`` = tokens - patches. ``precision``: as
    :func:`lrp_pass` (the sums are taken at that precision, returned in ``x``'s dtype)."""
    precision = DEFAULT_PRECISION.get(rules, "model") if precision is None else precision
    run_model, run_x = at_precision(model, x, precision, "lrp_conservation")
    p = _lrp_pass(run_model, run_x, target, rules, False, False, True, "lrp_conservation")
    tokens, patches = p.token_relevance.sum(-1), p.patch_relevance.sum(-1)
    out = {"logit": p.logit, "tokens": tokens, "patches": patches, "absorbed": p.logit - tokens,
           "position and prefix": tokens - patches}
    return {k: v.to(x.dtype) for k, v in out.items()}
