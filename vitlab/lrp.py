"""The LRP family on the model as it is: full LRP, partial LRP, Transformer attribution, AttnLRP.

Every method is ``(model, x, target=None, ...) -> B x gh x gw`` and costs one forward and
one backward for the whole batch (Transformer attribution: one more backward, for the
ordinary attention gradient). The rules live in :mod:`vitlab.record.lrp`, attached and
removed by ``vitlab.record(model, lrp=...)``; nothing here touches the model (``precision=
"float64"`` runs a float64 copy of it, see Precision below).

Relevance is what LRP conserves: the explained score's relevance on the logits (``score=``: the
logit ``y_t``, or the log-probability's gradient x input ``y_j ds/dy_j``) is divided among the
inputs of each layer, layer by layer, down to the patch tokens. What a rule gives to a bias (and
to the position embedding added after the patch embedding, and to the CLS token) stays there:
the patch map sums to the start (``y_t`` for the logit) minus those shares
(:func:`lrp_conservation` measures them).

Precision. Chefer's rules pass relevance through the softmax and every LayerNorm unchanged
(the identity rule), and the operation before each then splits it over the terms of a sum by
their share of it: an attention score ``q·k`` over its ``q_d k_d``, a residual stream ``a + b``
and the position sum ``e + p`` over their parts (the z-rule). Each share ``t / s`` has a pole
where the sum ``s`` is small against its terms, with two consequences:

- Conservation needs the very sum of the terms split. A residual addition and the position sum
  are one floating-point addition each, correctly rounded: the forward's value is their sum to
  one rounding. An attention score is a matmul, off by up to ``k u sum |terms|`` (inner length
  ``k``, unit roundoff ``u``), which is large against a score whose terms cancel; the softmax's
  rule therefore divides by each small score recomputed from its terms in float64
  (:func:`vitlab.record.lrp.product_from_terms`). So at the model's own precision the pass hands
  the relevance it starts with to the tokens up to the rounding of its own arithmetic, for the
  network as it computes.
- Near a pole the map is ill-conditioned in the network's values: a sum ``h_d = a_d + b_d`` that
  crosses 0 swaps the signs of two large shares. Moving the input by one float32 rounding moves
  the float64 map of a few scenes by tens of percent of its maximum, and a float32 forward rounds
  every layer by at least that much, so on those scenes the float32 model's map and its float64
  copy's map are the rules' values for two networks that differ by rounding, and differ as much;
  neither explains the float32 model better. ``benchmarks/check_lrp_float32.py`` prints, scene by
  scene, both distances and the conservation.

``precision="model"`` (the default) runs the model as it is: no copy, the rules in its dtype, plus
per attention map in the backward a norm per row and a float64 sum for the scores below ``2^-10`` of
their bound.
``precision="float64"`` runs a float64 copy of a model in another dtype (made per call by
:func:`vitlab.record.lrp.working_copy`; the model itself is not touched) and returns the maps in
``x``'s dtype: the float64 network's values, the same on every machine to float32 rounding, for
the copy (the parameters twice), activations of twice the size and float64 arithmetic: on a CPU
about twice the float32 pass (``benchmarks/bench_lrp.py`` times both; its docstring gives the
figures measured for this package), on a GPU as much more as the card's float64 throughput is
below its float32 one (1/2 to 1/64, by card). AttnLRP's rules divide by no sum
of the forward (the plain gradient at linear layers and the softmax, the LayerNorm rule holds
sigma constant, GELU's ``gelu(x) / x`` is bounded): its float32 maps are the float64 ones to a
few roundings.

What the float32 pass is exact against: the float32 network's own conservation. With Chefer's
rules the relevance the pass starts with reaches the tokens to float32 rounding (``|tokens - start|
/ |start|`` at most 3.2e-6 on 60 held-out shapes scenes and 8 random DeiT-tiny inputs, measured by
``benchmarks/check_lrp_float32.py``), and each map is the rules' value for the float32 network
(``tests/test_lrp_precision.py`` recomputes it in float64 from the float32 activations). It is not
within 2% of the float64 copy's map on every scene, and no float32 computation can be: the float64
map itself moves by up to 22.9%, 1.8% and 16.6% of its maximum (shapes seeds 29017 and 80001, DeiT)
when the input moves by one float32 rounding, and the float32 forward rounds every layer; the two
maps differ by up to 68%, 3825% and 337% there (full LRP; Transformer attribution 12.2%, 2.4%,
0.14%; partial LRP 0.13% at most; AttnLRP 0.0003%).

Paths. For a plain timm ``VisionTransformer`` (class token, position embedding, pre-LN blocks
of ``Attention`` and ``Mlp`` with GELU, a linear head; no hooks; the image size it was built for)
Chefer's rules run as a hand-written pass (:mod:`vitlab.record.lrp_direct`, :data:`DIRECT`): the
same rule functions on the same tensors as the autograd pass, so the same values bit for bit,
without an autograd graph and with each block's activations let go as the pass leaves it. Every
other model, and AttnLRP, takes the autograd pass. Measured (``benchmarks/bench_lrp.py --threads 1
--clock cpu``, random DeiT-tiny, batch 16, x a plain forward, autograd -> hand pass): full LRP
5.83x -> 5.62x batched (7.38x -> 6.34x one image at a time), Transformer attribution 7.31x -> 7.12x
(9.07x -> 7.94x), partial LRP 1.45x -> 1.42x (2.41x -> 1.82x): the gain is autograd's per-operation
overhead, which matters most for one image. ``COMPILE = True`` (opt-in) compiles the alpha-beta
rule's element-wise steps with ``torch.compile`` (the same values bit for bit): full LRP 5.16x,
Transformer attribution 6.93x batched, after 11 s of compiling at the first call (a C++ compiler
needed on a CPU; without one, or on any failure, a warning and the eager steps). The
matmuls alone (the forward's and the rules': three per linear layer for alpha-beta) are 3.05x a
forward for full LRP and 3.87x for Transformer attribution (``benchmarks/profile_lrp.py --path
direct``), so 3.8x and 4.8x would leave 0.75x and 0.93x for the forward's own element-wise work and
every rule's, which take 3.0x in eager PyTorch (one pass over memory per operation) and 2.5x with
the compiled steps: out of reach without fusing the rules into the matmuls themselves.

Choices where the papers leave room:

- Where the maps stop: at the patch embedding's output tokens ``e`` (``R = sum_d e ⊙
  gbar_e``, one value per patch), not at the pixels. The rule at the patch embedding only
  redistributes a token's relevance over its own pixels (the reference's z^B rule conserves
  it exactly, bias excluded), so on the patch grid every conservative pixel rule gives this
  map; the choice of pixel rule is left out rather than made.
- The position embedding, where ``lrp="chefer"``'s rule departs from the reference's. At the
  first block's input ``x_0 = a + p`` (``a`` the class token and the patch tokens ``e``, ``p`` the
  position embedding) both of vitlab's rule sets use the plain z-rule: ``a ⊙ R / x_0`` to the tokens,
  ``p ⊙ R / x_0`` to the position. The reference adds ``p`` with its ``Add``
  (``baselines/ViT/ViT_LRP.py``: ``x = self.add([x, self.pos_embed])``), whose ``relprop``
  (``modules/layers_ours.py``) rescales the two z-rule parts (sums ``s_a``, ``s_p``) as at a residual,
  to ``|s_a| / (|s_a| + |s_p|)`` and ``|s_p| / (...)`` of ``T = sum R``. So the reference's patch map
  is vitlab's times one factor per image, ``sign(s_a) T / (|s_a| + |s_p|)``
  (:func:`reference_position_factor`): 1 where ``s_a`` and ``s_p`` both have ``T``'s sign, between 0
  and 1 where only ``s_a`` has it, and negative where ``s_a`` has the other sign, which reverses the
  map's order (chapter 06 counts such scenes). Only full LRP's map changes (partial LRP and
  Transformer attribution read relevance above this addition). The shares :func:`lrp_conservation`
  reports are vitlab's z-rule ones; the reference's rescaling would make ``a``'s a share in [0, 1]
  of ``T``.
- Rules for full and partial LRP and Transformer attribution: ``lrp="chefer"``, those of the
  reference code used for Transformer attribution (``modules/layers_ours.py``: alpha = 1,
  beta = 0 at linear layers, identity at GELU / LayerNorm / softmax, halved attention
  matmuls, rescaled residual additions). The reference's baselines for full and partial LRP
  use ``modules/layers_lrp.py`` instead, whose linear rule (``Linear.relprop`` at commit
  3c9da22) divides the positive contributions of positive inputs and those of negative inputs
  each by its own sum (so a linear layer hands on up to twice its relevance: 2R where an output
  has both) and whose additions are not rescaled; vitlab uses the one conservative set.
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
from vitlab.attention import run_images
from vitlab.inputs import (
    check_images, check_input_dtype, gradient_leaf, in_chunks, readout_weights, require_gradients, require_logit_start,
)
from vitlab.layout import token_layout
from vitlab.record import record, require_materialized
from vitlab.record import lrp_direct
from vitlab.record.lrp import working_copy
from vitlab.relevance.engine import head_averaged_relevance
from vitlab.targets import (check_score, check_target, is_multi_label, logits_of, require_class_head,
                            resolve_target, target_score)


class LRPPass(NamedTuple):
    """What one LRP forward + backward gives (:func:`lrp_pass`).

    Attributes:
        patch_relevance: ``B x P`` relevance of each patch token (summed over channels).
        token_relevance: ``B x N`` relevance of every token entering the first block (patch
            embedding + position, CLS and other prefix tokens included).
        attention_relevance: per block ``B x heads x N x N``, ``R^A = A ⊙ gbar_A`` (with
            ``attention=True`` or ``plain=True``; ``attention="last"``: the last block's only).
        attention_grads: per block the ordinary gradient of the explained score with respect to
            ``A`` (with ``plain=True``; else empty).
        logit: ``(B,)`` the explained class's logit ``y_t``.
        target: ``(B,)`` the explained class.
        start: ``(B,)`` the relevance the pass started with, summed over the logits: the score's
            gradient x input ``sum_j y_j ds/dy_j`` (``y_t`` for ``score="logit"``); 1 with the unit
            start of Transformer attribution.
        entries: with ``entries=True`` (internal), ``(e, x0, gbar_e, gbar_x0)`` per entry
            (``B x P x D`` and ``B x N x D``): the patch tokens, the tokens entering the first block
            and their changed gradients; else empty.
    """

    patch_relevance: torch.Tensor
    token_relevance: torch.Tensor
    attention_relevance: list[torch.Tensor]
    attention_grads: list[torch.Tensor]
    logit: torch.Tensor
    target: torch.Tensor
    start: torch.Tensor
    entries: tuple = ()


#: What ``precision=`` takes. ``"model"`` (the default) runs the model as it is, in its own dtype:
#: no copy, the rules' arithmetic in that dtype (each attention score the softmax's rule divides by
#: is taken from its terms, see :mod:`vitlab.record.lrp`). ``"float64"`` runs a float64 copy of a
#: model in another dtype (:func:`vitlab.record.lrp.working_copy`, made per call): the rules' value
#: for the float64 network, at the price of the copy (twice the parameter memory), activations of
#: twice the size and float64 arithmetic (on a CPU about 2x the float32 pass, as
#: ``benchmarks/bench_lrp.py`` measures; on a GPU float64 runs at 1/2 to 1/64 of float32, by card). The maps of the two are the rules' values for two networks that
#: differ by float32 rounding; where Chefer's rules pass relevance through a pole (module docstring)
#: those values differ, and neither is the "true" one.
PRECISIONS = ("model", "float64")

#: Whether Chefer's rules on a plain timm ViT take the hand-written pass of
#: :mod:`vitlab.record.lrp_direct` (the same values as the autograd pass, bit for bit, without its
#: graph: on a CPU 10-25% faster one image at a time, 3-4% on a batch; module docstring);
#: False: every model takes the autograd pass of :mod:`vitlab.record.lrp`.
DIRECT = True

#: Opt-in: the hand-written pass's alpha-beta steps compiled by ``torch.compile``
#: (:func:`vitlab.record.lrp_direct.compiled_kernels`; the same values bit for bit): on a CPU 3-8%
#: off a batch's full LRP and Transformer attribution, after about 11 s of compiling at the first call
#: (inductor caches it on disk: 2 s in later sessions); nothing one image at a time. Needs a C++ compiler
#: (CPU) or Triton (GPU); where compiling fails, a warning and the eager steps.
COMPILE = False


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
    require_materialized(model, method)  # a model without weights has nothing to copy
    dtype = next((t.dtype for t in model.parameters() if t.is_floating_point()), torch.float64)
    return (model if dtype == torch.float64 else working_copy(model, torch.float64)), x.to(torch.float64)


def lrp_pass(model, x: torch.Tensor, target=None, rules: str = "chefer", attention: bool = False,
             plain: bool = False, tokens: bool = True, method: str = "lrp_pass",
             precision: str = "model", score: str = "logit") -> LRPPass:
    """One forward with the LRP rules ``rules`` attached and one LRP backward of the target
    scores (their sum over the batch: samples do not interact), plus with ``plain`` one
    ordinary backward for the attention gradients. ``attention``: also the relevance of every
    attention map (``attention="last"``: the last block's only); ``tokens=False`` leaves the
    token relevances out (empty tensors), so the backward stops at the first attention map it
    needs. ``precision``: ``"model"`` or ``"float64"`` (:data:`PRECISIONS`); the results come in
    ``x``'s dtype. ``score``: what is explained (:data:`vitlab.targets.SCORES`); the pass starts
    from the score's gradient x input on the logits, ``R_j = y_j ds/dy_j`` (module docstring).
    Checks the input before the forward."""
    run_model, run_x, _, target = checked_pass(model, x, target, precision, score, method)
    p = _lrp_pass(run_model, run_x, target, rules, attention, plain, tokens, method, score=score)
    like = x.dtype
    return LRPPass(p.patch_relevance.to(like), p.token_relevance.to(like), [a.to(like) for a in p.attention_relevance],
                   [g.to(like) for g in p.attention_grads], p.logit.to(like), p.target, p.start.to(like))


def checked_pass(model, x: torch.Tensor, target, precision: str, score: str, method: str):
    """Every check of an LRP pass, once, before the forward: ``score``, the images and ``precision``
    (:func:`at_precision`), a class token the output reads (alone, or with a second token:
    :func:`vitlab.inputs.require_logit_start`), a class head, ``target``, gradients being possible. Returns ``(model, x)`` as the pass runs them, their token layout and the
    target as :func:`vitlab.targets.check_target` returned it."""
    check_score(score)
    run_model, run_x = at_precision(model, x, precision, method)
    layout = token_layout(run_model, run_x)
    require_logit_start(layout, method)
    require_class_head(model, method)
    target = check_target(target, x.shape[0])
    require_gradients(method)
    return run_model, run_x, layout, target


def score_gradient(model, logits: torch.Tensor, t: torch.Tensor, score: str) -> torch.Tensor:
    """``B x C``: the gradient of each sample's score (:func:`vitlab.targets.target_score`, the
    model's head deciding softmax or sigmoid) with respect to its logits, computed on a detached
    copy of them: one-hot for ``"logit"``, ``onehot - softmax(y)`` (or ``(1 - sigmoid(y_t))
    onehot`` for a multi-label head) for ``"log_probability"``."""
    if score == "logit":
        return torch.zeros_like(logits).scatter_(1, t[:, None], 1.0)
    with torch.enable_grad():
        leaf = logits.detach().requires_grad_(True)
        s = target_score(leaf, t, score, is_multi_label(model))
        return torch.autograd.grad(s.sum(), leaf)[0]


def _lrp_pass(model, x: torch.Tensor, target, rules: str, attention, plain: bool, tokens: bool, method: str,
              unit: bool = False, score: str = "logit", entries: bool = False) -> LRPPass:
    """:func:`lrp_pass` at the model's own precision; ``unit``: the backward starts from relevance
    ``y_j ds/dy_j / sum_k y_k ds/dy_k``, 1 in total (for the logit: 1 on the target, the reference's
    ``relprop(one_hot)``), instead of ``y_j ds/dy_j`` (``ValueError`` where the sum is exactly 0,
    e.g. a target logit of 0: no gradient scales it to 1). Checks nothing: ``model``, ``x`` and
    ``target`` as :func:`checked_pass` returned them (or a chunk of them). ``entries`` (with
    ``tokens``): also keep the token entries and their changed gradients (:class:`LRPPass`)."""
    if DIRECT and rules == "chefer" and lrp_direct.plan(model, x):
        return _direct_pass(model, x, target, attention, plain, tokens, method, unit, score, entries)
    capture = ("attention",) if attention or plain else ()
    with torch.enable_grad():
        x_in = gradient_leaf(x)
        with record(model, lrp=rules, capture=capture, detach=False, eval_mode=True) as rec:
            logits = logits_of(run_images(model, x_in))  # interpolate_pos_encoding where a HF ViT needs it
            t = resolve_target(target, logits)
            y = logits.gather(1, t[:, None])[:, 0]
            g = score_gradient(model, logits, t, score)  # ds/dy, B x C
            held = logits.detach()
            total = (held * g).sum(1)  # the score's gradient x input on the logits, summed
            start, total = _start(g, total, t, unit, score, method)
            e, x0 = rec.patch_tokens[-1], rec.first_block_inputs[-1]
            attn = list(rec.attentions) if capture else []
            if attention == "last":
                attn = attn[-1:]
            wanted = ([e, x0] if tokens else []) + attn
            grads = list(torch.autograd.grad(logits, wanted, grad_outputs=start, retain_graph=plain))
            plain_grads = []
            if plain:
                with rec.plain_gradients():
                    plain_grads = [d.detach() for d in torch.autograd.grad(logits, attn, grad_outputs=g)]
    kept = ()
    if tokens:
        g_e, g_x0 = grads.pop(0), grads.pop(0)
        R_e = (e.detach() * g_e).sum(-1)  # B x P
        R_x0 = (x0.detach() * g_x0).sum(-1)  # B x N
        if entries:
            kept = (e.detach(), x0.detach(), g_e, g_x0)
    else:
        R_e = R_x0 = torch.empty(x.shape[0], 0, dtype=y.dtype, device=y.device)
    R_A = [a.detach() * d for a, d in zip(attn, grads)]
    return LRPPass(R_e, R_x0, R_A, plain_grads, y.detach(), t, total, kept)


def _start(g: torch.Tensor, total: torch.Tensor, t: torch.Tensor, unit: bool, score: str, method: str):
    """The gradient the pass starts from on the logits and the relevance it starts with (module
    docstring): ``g`` itself (relevance ``y ⊙ ds/dy``) and ``total``, or with ``unit`` both scaled
    to relevance 1 in total (``ValueError`` where ``total`` is exactly 0)."""
    if not unit:
        return g, total
    zero = (total == 0).nonzero()
    if zero.numel():
        what = ("explained logit is" if score == "logit"
                else "score's gradient x input on the logits sums to")
        raise ValueError(
            f"{method}: the {what} exactly 0 for sample {int(zero[0])} (class {int(t[zero[0]])}); the "
            "LRP pass starts from relevance 1 in total, which a gradient cannot scale it to there "
            "(relevance = logit x gradient): explain another class (target=...)")
    return g / total[:, None], torch.ones_like(total)  # relevance y ⊙ ds/dy, 1 in total


def _direct_pass(model, x: torch.Tensor, target, attention, plain: bool, tokens: bool, method: str,
                 unit: bool, score: str, entries: bool) -> LRPPass:
    """:func:`_lrp_pass` by the hand-written pass of :mod:`vitlab.record.lrp_direct` (Chefer's
    rules on a plain timm ViT): the same values, without an autograd graph."""
    with torch.no_grad():
        fw = lrp_direct.forward(model, x)
        logits = fw.logits
        t = resolve_target(target, logits)
        y = logits.gather(1, t[:, None])[:, 0]
        g = score_gradient(model, logits, t, score)  # ds/dy, B x C
        total = (logits * g).sum(1)
        start, total = _start(g, total, t, unit, score, method)
        kernels = lrp_direct.compiled_kernels() if COMPILE else lrp_direct.EAGER
        e, x0 = fw.e, fw.x0
        r = lrp_direct.relevance(model, fw, start, attention or plain, tokens, g if plain else None, kernels)
        del fw  # its activations went block by block
        R_A, plain_grads = r.attention_relevance, r.attention_grads
        if attention == "last" and plain:
            plain_grads = plain_grads[-1:]
        kept = ()
        if tokens:
            R_e = (e * r.g_e).sum(-1)
            R_x0 = (x0 * r.g_x0).sum(-1)
            if entries:
                kept = (e, x0, r.g_e, r.g_x0)
        else:
            R_e = R_x0 = torch.empty(x.shape[0], 0, dtype=y.dtype, device=y.device)
    return LRPPass(R_e, R_x0, R_A, plain_grads, y, t, total, kept)


def _grid_map(method: str, model, x, target, compute, precision: str, score: str):
    """Shared steps of the map methods: every check once (:func:`checked_pass`), then
    ``compute(model, x, target)`` at that precision (``B x N`` or ``B x P``), over chunks of a batch
    over the memory budget (:func:`vitlab.inputs.in_chunks`); the map on the grid in ``x``'s dtype."""
    run_model, run_x, layout, target = checked_pass(model, x, target, precision, score, method)
    return in_chunks(lambda xc, tc: layout.patches_to_grid(compute(run_model, xc, tc)), run_model, run_x, layout,
                     gradients=True, target=target).to(x.dtype)


def lrp(model, x: torch.Tensor, target=None, precision: str = "model", score: str = "logit") -> torch.Tensor:
    """Full LRP to the patch tokens (Bach et al. 2015, "On Pixel-Wise Explanations for
    Non-Linear Classifier Decisions by Layer-Wise Relevance Propagation"; the alpha-beta rule as
    Chefer, Gur & Wolf's reference code writes it, ``modules/layers_ours.py`` ``Linear.relprop``,
    and that code's transformer rules):
    ``B x gh x gw``, each patch's relevance ``sum_d e ⊙ gbar_e`` of the target score, in the
    score's units (signed; the patches' sum is the relevance started, ``y_t`` for the logit, minus
    the shares of the position embedding and the prefix tokens, see the module docstring; a target
    logit of 0 has nothing to distribute: a map of 0).

    Args:
        model: a timm or Hugging Face ViT classifier (run in eval mode, its mode put back).
        x: ``B x 3 x H x W`` input batch.
        target: int, one class per sample (sequence / 1-D tensor), or None (predicted).
        precision: ``"model"`` (default: the model as it is, ``x`` in its dtype) or ``"float64"``
            (a float64 copy of a model in another dtype, made per call, the map returned in ``x``'s
            dtype); what each costs and gives: :data:`PRECISIONS`.
        score: ``"logit"`` (default) or ``"log_probability"`` (:data:`vitlab.targets.SCORES`): the
            relevance starts as the score's gradient x input on the logits, ``R_j = y_j ds/dy_j``
            (for the logit: ``y_t`` on the target; for the log-probability of a softmax head
            ``y_j (δ_jt - p_j)`` on every class, summing to ``y_t - sum_j p_j y_j``).
    """
    return _grid_map("lrp", model, x, target, lambda m, xx, t: _lrp_pass(
        m, xx, t, "chefer", False, False, True, "lrp", score=score).patch_relevance, precision, score)


def attn_lrp(model, x: torch.Tensor, target=None, precision: str = "model", score: str = "logit") -> torch.Tensor:
    """AttnLRP (Achtibat et al., ICML 2024, "AttnLRP: Attention-Aware Layer-Wise Relevance
    Propagation for Transformers": the softmax rule, the uniform rule for the attention
    matmuls (eq. 7), the identity rule for GELU (eq. 9) and the LayerNorm rule, the epsilon rule
    elsewhere) to the patch tokens: ``B x gh x gw`` in the score's units, signed. One forward and
    one backward (the rules in :mod:`vitlab.record.lrp`, ``lrp="attnlrp"``). Its rules divide by
    no sum of the forward, so float32 gives the float64 maps to a few float32 roundings.

    Args: as :func:`lrp`.
    """
    return _grid_map("attn_lrp", model, x, target, lambda m, xx, t: _lrp_pass(
        m, xx, t, "attnlrp", False, False, True, "attn_lrp", score=score).patch_relevance, precision, score)


def partial_lrp(model, x: torch.Tensor, target=None, precision: str = "model", score: str = "logit") -> torch.Tensor:
    """Partial LRP (Voita et al., ACL 2019, "Analyzing Multi-Head Self-Attention", Sec. 4.1:
    heads weighed by their LRP relevance), as Chefer et al. (CVPR 2021) use it as a baseline:
    the LRP relevance of the last block's attention maps, ``R^A = A ⊙ gbar_A``, clamped at 0
    per head and averaged over heads, CLS row, patch columns (the reference's
    ``method="last_layer"``). A head whose output carries more of the score's relevance
    contributes more: that is the weighting by head relevance. ``B x gh x gw``. For a head on two
    tokens (a distilled DeiT, Hugging Face Dinov2's classifier) the row of the tokens it reads,
    ``w R^A`` (:func:`vitlab.inputs.readout_weights`), as :func:`vitlab.relevance.last_block_relevance`.

    Args: as :func:`lrp`.
    """
    def compute(m, xx, t):
        p = _lrp_pass(m, xx, t, "chefer", "last", False, False, "partial_lrp", score=score)
        heads = p.attention_relevance[-1].clamp(min=0).mean(dim=1)  # B x N x N
        w = readout_weights(token_layout(m, xx), "partial_lrp", heads.dtype, heads.device)  # e_CLS, or two tokens
        return w @ heads  # B x N
    return _grid_map("partial_lrp", model, x, target, compute, precision, score)


@renamed_arguments(start_layer="start_block")
def transformer_attribution(model, x: torch.Tensor, target=None, start_block: int = 0,
                            precision: str = "model", score: str = "logit") -> torch.Tensor:
    """Transformer attribution (Chefer, Gur & Wolf, CVPR 2021, "Transformer Interpretability
    Beyond Attention Visualization", eq. 13): per block ``Abar_b = E_h[(grad A_b ⊙ R^{A_b})^+]``,
    with ``grad A_b`` the ordinary gradient of the target score and ``R^{A_b}`` the attention
    map's LRP relevance (the reference's relprop rules, ``lrp="chefer"``), propagated as the
    reference does from relevance 1 (on the target class for the logit; not from the logit's
    value: eq. 13's product is not invariant to that scale); then
    ``C = (I + Abar_1) · ... · (I + Abar_B)`` (eq. 13's product, no row normalisation, as in
    ``ViT_LRP.compute_rollout_attention``), map = ``C[CLS, patches]``. ``B x gh x gw``. For a head
    on two tokens (a distilled DeiT, Hugging Face Dinov2's classifier) the row ``w C`` of the tokens
    it reads (:func:`vitlab.inputs.readout_weights`), as :func:`vitlab.relevance.chefer_relevance`.
    With ``score="log_probability"`` the LRP pass starts from the score's gradient x input on the
    logits scaled to 1 in total, ``y_j ds/dy_j / sum_k y_k ds/dy_k`` (the one-hot of the logit
    generalised; ``ds/dy_j`` alone sums to 0 for a softmax head, and Chefer's residual rule would
    scale every relevance to that 0), and ``grad A`` is the log-probability's gradient. A start whose
    sum is exactly 0 (a target logit of 0) is refused (``ValueError``): no gradient scales it to 1.

    The 2021 follow-up (:func:`vitlab.relevance.chefer_relevance`) is this with ``A`` in place
    of ``R^A``: no LRP pass at all.

    Args:
        model, x, target, precision, score: as :func:`lrp`.
        start_block: first block in the product (0: every block, eq. 13; the reference's
            perturbation script uses 1).
    """
    def compute(m, xx, t):
        p = _lrp_pass(m, xx, t, "chefer", False, True, False, "transformer_attribution", unit=True,
                      score=score)
        L = len(p.attention_relevance)
        if isinstance(start_block, bool) or not isinstance(start_block, int) or not 0 <= start_block < L:
            raise ValueError(f"start_block must be an int in [0, {L}), got {start_block!r}")
        R_A, G = p.attention_relevance, p.attention_grads
        w = readout_weights(token_layout(m, xx), "transformer_attribution", R_A[0].dtype, R_A[0].device)
        r = w.expand(R_A[0].shape[0], -1)  # e_CLS (or two tokens) (I + Abar_B) ... (I + Abar_start), last block first
        for b in range(L - 1, start_block - 1, -1):
            r = r + (r.unsqueeze(1) @ head_averaged_relevance(R_A[b], G[b])).squeeze(1)
        return r
    if isinstance(start_block, bool) or not isinstance(start_block, int) or start_block < 0:
        raise ValueError(f"start_block must be a non-negative int, got {start_block!r}")
    return _grid_map("transformer_attribution", model, x, target, compute, precision, score)


def lrp_conservation(model, x: torch.Tensor, target=None, rules: str = "chefer", precision: str = "model",
                     score: str = "logit", cancel: float | None = None) -> dict[str, torch.Tensor]:
    """Where the relevance started on the logits ends up, per sample (each ``(B,)``): ``"logit"``
    (the target's); ``"start"`` (the relevance started: the score's gradient x input summed over
    the logits, ``y_t`` for ``score="logit"``); ``"tokens"`` (every token entering the first
    block); ``"patches"`` (the patch tokens of the map); ``"absorbed"`` = start - tokens (kept by
    biases, and with ``"attnlrp"`` by the softmax's bias term); ``"position and prefix"`` = tokens -
    patches. ``precision``, ``score``: as :func:`lrp_pass` (the sums are taken at that precision,
    returned in ``x``'s dtype).

    ``cancel`` (a number in (0, 1)): also where the patch tokens' share comes from. At the patch
    tokens the first block's input is the sum ``x0 = e + p`` of the patch embedding and the position
    embedding, and both rule sets split an entry's relevance ``R`` over it by the z-rule, ``e R / x0``
    to the patch and ``p R / x0`` to the position: shares whose size is ``|e| / |x0|`` and
    ``|p| / |x0|`` times ``R``, large where ``e`` and ``p`` nearly cancel. The entries (token,
    channel) of the patch tokens where ``|e + p| < cancel (|e| + |p|)`` are the *cancelling* ones;
    the keys: ``"cancelling"`` (their fraction of the patch tokens' entries), ``"x0 cancelling"``
    (the relevance of ``x0`` on them), ``"patches cancelling"`` and ``"position cancelling"`` (its
    z-rule shares to ``e`` and to ``p`` there; they add up to ``"x0 cancelling"``). The patches'
    share on the other entries is ``"patches"`` - ``"patches cancelling"``."""
    if cancel is not None and (isinstance(cancel, bool) or not isinstance(cancel, (int, float))
                               or not 0 < cancel < 1):
        raise ValueError(f"lrp_conservation: cancel must be a number in (0, 1) (the share |e + p| / (|e| + |p|) "
                         f"below which an entry counts as cancelling) or None, got {cancel!r}")
    run_model, run_x, layout, target = checked_pass(model, x, target, precision, score, "lrp_conservation")
    p = _lrp_pass(run_model, run_x, target, rules, False, False, True, "lrp_conservation", score=score,
                  entries=cancel is not None)
    tokens, patches = p.token_relevance.sum(-1), p.patch_relevance.sum(-1)
    out = {"logit": p.logit, "start": p.start, "tokens": tokens, "patches": patches, "absorbed": p.start - tokens,
           "position and prefix": tokens - patches}
    if cancel is not None:
        e, x0, g_e, g_x0 = p.entries
        x0, g_x0 = x0[:, layout.num_prefix:], g_x0[:, layout.num_prefix:]  # the patch tokens' x0 = e + p
        if x0.shape != e.shape or not torch.equal(g_e, g_x0):  # an addition passes its gradient on as it is
            raise ValueError("lrp_conservation: this model's first block does not take the patch embedding plus a "
                             "position embedding (a layer lies between them, e.g. a norm before the blocks), so "
                             "there is no position sum to split: leave cancel=None")
        pos = x0 - e
        cancelling = (x0.abs() < cancel * (e.abs() + pos.abs())).to(x0.dtype)
        R_e, R_x0 = e * g_e * cancelling, x0 * g_x0 * cancelling
        out |= {"cancelling": cancelling.mean((1, 2)), "x0 cancelling": R_x0.sum((1, 2)),
                "patches cancelling": R_e.sum((1, 2)), "position cancelling": (R_x0 - R_e).sum((1, 2))}
    return {k: v.to(x.dtype) for k, v in out.items()}


def reference_position_factor(model, x: torch.Tensor, target=None, precision: str = "model",
                              score: str = "logit") -> dict[str, torch.Tensor]:
    """What Chefer et al.'s reference code would multiply the ``"chefer"`` patch map by, per sample
    (each ``(B,)``), at the one addition where vitlab departs from it: the position embedding's.

    The reference (``baselines/ViT/ViT_LRP.py``: ``x = self.add([x, self.pos_embed])``, the class
    token already concatenated to the patch tokens) passes the relevance ``R`` of the first block's
    input ``x0 = a + p`` back through ``Add.relprop`` of ``modules/layers_ours.py``: the z-rule parts
    ``a ⊙ R / x0`` and ``p ⊙ R / x0`` (sums ``s_a``, ``s_p``), each then rescaled so that its sum is
    ``|s_a| / (|s_a| + |s_p|)`` and ``|s_p| / (...)`` of ``T = sum R``. vitlab keeps the z-rule parts
    (the module docstring), so the reference's map is vitlab's times ``factor = sign(s_a) T / (|s_a| +
    |s_p|)``: 1 where ``s_a`` and ``s_p`` both have ``T``'s sign, between 0 and 1 where only ``s_a``
    has it, negative (the map's signs, and so its order, reversed) where ``s_a`` has the other sign.

    Keys: ``"tokens"`` (``T``, :func:`lrp_conservation`'s), ``"patches and prefix"`` (``s_a``: the
    patch tokens' share, its ``"patches"``, plus the class token's), ``"position"`` (``s_p``) and
    ``"factor"``. ``precision``, ``score``: as :func:`lrp_pass`. Needs a timm ViT whose position
    embedding is added to every token, class token included, as the reference's is (``ValueError``
    otherwise)."""
    run_model, run_x, layout, target = checked_pass(model, x, target, precision, score, "reference_position_factor")
    pos = getattr(run_model, "pos_embed", None)
    p = _lrp_pass(run_model, run_x, target, "chefer", False, False, True, "reference_position_factor", score=score,
                  entries=True)
    e, x0, g_e, g_x0 = p.entries
    prefix = layout.num_prefix
    if (not isinstance(pos, torch.Tensor) or getattr(run_model, "no_embed_class", False)
            or tuple(pos.shape[1:]) != tuple(x0.shape[1:]) or x0[:, prefix:].shape != e.shape
            or not torch.equal(g_e, g_x0[:, prefix:])):
        raise ValueError("reference_position_factor: needs a timm ViT whose first block takes the class token and "
                         "the patch embedding plus a position embedding on every token (the reference's layout); "
                         "this model has no such sum")
    pos = pos.detach().to(x0.dtype)
    a = torch.cat([x0[:, :prefix] - pos[:, :prefix], e], 1)  # the reference's first branch: prefix and patches
    s_a, s_p = (a * g_x0).sum((1, 2)), (pos * g_x0).sum((1, 2))
    total = (x0 * g_x0).sum((1, 2))
    factor = torch.where(s_a.abs() + s_p.abs() > 0, torch.sign(s_a) * total / (s_a.abs() + s_p.abs()),
                         torch.zeros_like(total))
    out = {"tokens": total, "patches and prefix": s_a, "position": s_p, "factor": factor}
    return {k: v.to(x.dtype) for k, v in out.items()}
