"""What the attention itself shows: class-token attention, Q/K sign patterns, two baselines.

- :func:`cls_attention` -- row 0 (CLS) of the post-softmax attention, patch columns, for
  every layer and head (chapter 2 of the notebooks; Gildenblat 2020, "Exploring
  Explainability for Vision Transformers").
- :func:`qk_maps`, :func:`qk_channel_scores`, :func:`rank_qk_channels` -- the Q/K sign
  images of the same blog: the attention logit between tokens i and j is
  ``sum_c q_ic k_jc``, so where channel c of the query (at i) and of the key (at j) share a
  sign, that channel raises i's attention to j. Shown through a sigmoid (bright = positive).
- :func:`raw_attention` and :func:`attention_gradcam` -- the "raw attention" and "GradCAM on
  the last attention map" baselines of Chefer, Gur & Wolf (ICCV 2021, "Generic
  Attention-model Explainability", Sec. 4) and Chefer et al. (CVPR 2021).
- :func:`attention_gradients` -- every layer's attention with d(target logit)/d(attention),
  from one forward and one backward for the whole batch; the gradient methods of
  :mod:`vitlab.rollout` and :mod:`vitlab.relevance` build on it.
- :func:`cls_attention_profile` -- chapter 2's measurement: per scene, block and head, the
  share of the class token's attention on the object and its entropy (graded with
  :mod:`vitlab.localization`), one forward per batch.

Every map is per sample, on the patch grid read from :func:`vitlab.token_layout`, and
nothing here hooks or patches the model: :func:`vitlab.record` does that and restores it.
Every method runs the model in eval mode (``record(..., eval_mode=True)``: dropout off, the
maps deterministic) and puts each module's mode back, so a model in train mode gives the
same maps as in eval mode and is left in train mode. A batch whose recorded attention would
exceed :data:`vitlab.inputs.MEMORY_BUDGET` runs in chunks of samples, with the same maps.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from vitlab.compat import moved_names, renamed_arguments
from vitlab.inputs import (
    batches, check_images, check_input_dtype, checked_layout, gradient_leaf, gradient_target, in_chunks, positive_int,
    readout_weights,
)
from vitlab.layout import TokenLayout
from vitlab.record import record
from vitlab.targets import function_scores, is_function_target, is_multi_label, logits_of, resolve_target, target_score

QK_PATTERNS = ("one_way", "two_flow", "exchange", "same_region")

class AttentionGradients(NamedTuple):
    """Attention of every block and its gradient, from :func:`attention_gradients`.

    Attributes:
        attentions: one ``B x heads x N x N`` post-softmax tensor per block, in order.
        gradients: d(sum over samples of the target logit)/d(attention), same order and
            shapes; since samples are independent in eval mode, ``gradients[l][b]`` is the
            gradient of sample b's own target logit.
        target: ``(B,)`` the class explained for each sample; None for a function target.
        logits: ``B x num_classes`` the model's logits; for a function target, its scores
            (``B x 1``).
        layout: the model's :class:`~vitlab.layout.TokenLayout`.
    """

    attentions: list[torch.Tensor]
    gradients: list[torch.Tensor]
    target: torch.Tensor
    logits: torch.Tensor
    layout: TokenLayout


class QKMaps(NamedTuple):
    """Sigmoid images of the query and key of one head, from :func:`qk_maps`.

    ``query`` and ``key`` are ``B x gh x gw`` for one channel, ``B x head_dim x gh x gw``
    for all channels; values in (0, 1), above 0.5 where the channel is positive.
    """

    query: torch.Tensor
    key: torch.Tensor


class QKChannel(NamedTuple):
    """One ranked channel: ``block``, ``head``, ``channel`` and its pattern ``score``."""

    block: int
    head: int
    channel: int
    score: float


def recorded_attentions(model, x: torch.Tensor) -> tuple[list[torch.Tensor], TokenLayout]:
    """Attention of every block (``B x heads x N x N`` each), one forward without gradients."""
    with torch.no_grad(), record(model, eval_mode=True, capture=("attention",)) as rec:
        run_images(model, x)
    attentions, layout = list(rec.attentions), rec.layout
    if layout is not None and layout.pool == "map":
        attentions.append(_probe(rec))
        attentions, _, layout = probe_sequence(attentions, None, layout)
    return full_sequence(attentions, layout), layout


def _probe(rec):
    caps = rec.streams.get("pool") or []
    if not caps or caps[-1].attention is None:
        raise ValueError(
            "this model's head pools the tokens with an attention probe that vitlab could not record (it records "
            "timm's AttentionPoolLatent and SigLIP's pooling head); no row stands for the pooled output"
        )
    return caps[-1].attention


def probe_sequence(attentions: list, gradients, layout: TokenLayout):
    """An attention-pool head's probe as token 0 of the sequence, so the maps read its row as they
    read a CLS token's: ``(attentions, gradients, layout)`` over ``N + 1`` tokens. ``attentions[-1]``
    (and ``gradients[-1]``) is the probe's ``B x heads x 1 x M`` attention over the last block's last
    M tokens (timm: the patches; SigLIP: all of them); every block before it gets a zero row and column 0 (the probe is not in the blocks: rollout's
    ``A + I`` and relevance's ``R + Abar R`` leave it as it is), and the probe's own step has row 0 = its
    attention. The pooled output is made of the probe's attention over the tokens alone (no residual
    of the probe: its own column is dropped with the prefix), so its row of the propagated matrix is
    the probe's attention times the tokens' rows -- the first step of the row. The layout gains the
    probe as a prefix token and reads it (``pool="token"``)."""
    N = attentions[0].shape[-1]

    def pad(m, probe=False):
        if m is None:
            return None
        full = m.new_zeros(*m.shape[:-2], N + 1, N + 1)
        if probe:  # the probe attends to the last M tokens (timm: the patches, unless pool_include_prefix)
            full[..., :1, N + 1 - m.shape[-1]:] = m
        else:
            full[..., 1:, 1:] = m
        return full
    n = len(attentions)
    out_a = [pad(a, probe=i == n - 1) for i, a in enumerate(attentions)]
    out_g = None if gradients is None else [pad(g, probe=i == n - 1) for i, g in enumerate(gradients)]
    probed = TokenLayout(layout.num_prefix + 1, layout.grid, layout.num_registers, layout.has_distillation, "token")
    return out_a, out_g, probed


def full_sequence(matrices: list, layout: TokenLayout) -> list:
    """Recorded attentions (or their gradients) as ``B x heads x N x N`` over the model's whole
    sequence ``[CLS, patches]``. The identity for every model but CaiT (``layout.pool ==
    "class_attention"``), whose self-attention blocks run over the P patch tokens alone (the class
    token is not there yet: its row and column are 0, so rollout's ``A + I`` and relevance's
    ``R + Abar R`` leave it as it is) and whose class-attention blocks update the class token alone
    (``1 x N``: its row; the patch tokens' rows are 0, they pass unchanged). Entries None stay None."""
    if layout is None or layout.pool != "class_attention":
        return matrices
    P, N = layout.num_patches, layout.num_tokens
    out = []
    for m in matrices:
        if m is None or m.shape[-2:] == (N, N):
            out.append(m)
            continue
        full = m.new_zeros(*m.shape[:-2], N, N)
        if m.shape[-2:] == (P, P):            # self-attention over the patches
            full[..., N - P:, N - P:] = m
        elif m.shape[-2:] == (1, N):          # class attention: the class token's row
            full[..., :1, :] = m
        else:
            raise ValueError(f"an attention of shape {tuple(m.shape)} fits neither CaiT's self-attention "
                             f"({P} x {P}) nor its class attention (1 x {N})")
        out.append(full)
    return out


def run_images(model, x: torch.Tensor):
    """``model``'s output for the image batch ``x``: ``model(x)``, with
    ``interpolate_pos_encoding=True`` for a Hugging Face ViT whose position embedding was made
    for another image size and whose forward can interpolate it (ViT, DeiT, BEiT, Dinov2 always
    interpolate; CLIP, SigLIP: :func:`vitlab.layout.hf_needs_interpolation`)."""
    from vitlab.layout import hf_needs_interpolation

    if hf_needs_interpolation(model, x):
        return model(x, interpolate_pos_encoding=True)
    return model(x)




def attention_gradients_for_blocks(model, x: torch.Tensor, target, layers: list[int] | None,
                         score: str = "logit", method: str = "attention_gradients") -> AttentionGradients:
    """:func:`attention_gradients`, with gradients only for block indices ``layers``
    (None: all); the other entries of ``gradients`` are None. Fewer blocks, shorter backward.
    ``method``: the name the errors give. Checks the input, then :func:`recorded_gradients`."""
    check_images(x, method)
    check_input_dtype(model, x, method)
    target = gradient_target(model, target, x.shape[0], score, method)
    return recorded_gradients(model, x, target, layers, score, method)


def recorded_gradients(model, x: torch.Tensor, target, layers: list[int] | None, score: str = "logit",
                       method: str = "attention_gradients") -> AttentionGradients:
    """The forward and backward of :func:`attention_gradients_for_blocks`, without its checks: for a
    method that checked ``x`` and ``target`` itself (``target`` as
    :func:`vitlab.inputs.gradient_target` returned it), e.g. per chunk of a batch
    (:func:`vitlab.inputs.in_chunks`)."""
    function = is_function_target(target)
    with torch.enable_grad():
        # A leaf that requires grad keeps the graph alive even if every parameter is frozen.
        x_in = gradient_leaf(x)
        # graph-attached attentions, nothing else kept
        with record(model, detach=False, eval_mode=True, capture=("attention",)) as rec:
            output = run_images(model, x_in)
            if function:
                scores = function_scores(target, output, x.shape[0], method)
                t, logits = None, scores[:, None]
                total = scores.sum()
            else:
                logits = logits_of(output)
                t = resolve_target(target, logits)
                total = target_score(logits, t, score, is_multi_label(model)).sum()
            attentions = list(rec.attentions)
            probed = rec.layout is not None and rec.layout.pool == "map"
            if probed:  # the head's probe: one more attention, the last the output passes through
                attentions.append(_probe(rec))
            wanted = range(len(attentions)) if layers is None else layers
            grads = torch.autograd.grad(total, [attentions[l] for l in wanted])
    gradients: list[torch.Tensor | None] = [None] * len(attentions)
    for l, g in zip(wanted, grads):
        gradients[l] = g.detach()
    attentions, layout = [a.detach() for a in attentions], rec.layout
    if probed:
        attentions, gradients, layout = probe_sequence(attentions, gradients, layout)
    return AttentionGradients(
        attentions=full_sequence(attentions, layout),
        gradients=full_sequence(gradients, layout),
        target=t,
        logits=logits.detach(),
        layout=layout,
    )


def attention_gradients(model, x: torch.Tensor, target=None, score: str = "logit") -> AttentionGradients:
    """Every block's attention and d(target score)/d(attention): one forward, one backward.

    The score is the sum over the batch of each sample's target logit (or log-probability);
    ViT samples do not interact in eval mode, so each sample's gradient is that of its own
    score, exactly.
    Gradients are taken with :func:`torch.autograd.grad` with respect to the recorded
    attention tensors only, so no parameter's ``.grad`` is touched and no weight gradients
    are computed. Works under a caller's ``torch.no_grad()``; ``x`` needs no gradient.

    Args:
        model: a timm or Hugging Face ViT classifier (run in eval mode, its mode put back).
        x: ``B x 3 x H x W`` input batch.
        target: int, one class per sample (sequence / 1-D tensor), None (predicted), or a
            function of the model's output returning one score per sample (a model without a
            class head; see :mod:`vitlab.targets`), e.g.
            ``target=lambda out: out.pooler_output @ direction``.
        score: ``"logit"`` (the papers') or ``"log_probability"`` (log-softmax, or log-sigmoid
            for a multi-label head; see :data:`vitlab.targets.SCORES`).

    Raises:
        ValueError: a bad input (:func:`vitlab.inputs.check_images`) or target, or a model without a class
            head (timm ``num_classes=0``, a Hugging Face base model): its output channels are
            not classes.
        RuntimeError: called inside ``torch.inference_mode()``, where no gradient exists.
    """
    return attention_gradients_for_blocks(model, x, target, layers=None, score=score)


def cls_attention(model, x: torch.Tensor) -> torch.Tensor:
    """Class-token attention to every patch, per layer and head (Gildenblat 2020).

    Returns ``B x L x heads x gh x gw``: entry ``[b, l, h]`` is row 0 (CLS) of block l's
    post-softmax attention for head h, patch columns only, on the patch grid. Prefix
    columns (CLS, distillation, registers) are left out, so a map need not sum to 1.
    """
    def compute(x):
        attentions, layout = recorded_attentions(model, x)
        cls_rows = torch.stack([A[:, :, 0, :] for A in attentions], dim=1)  # B x L x H x N
        return layout.patches_to_grid(cls_rows)  # B x L x H x gh x gw
    return in_chunks(compute, model, x, checked_layout(model, x, "cls_attention"))


def raw_attention(model, x: torch.Tensor) -> torch.Tensor:
    """Raw-attention baseline (Chefer et al. 2021): last block, CLS row, mean over heads.

    Returns ``B x gh x gw``: ``mean_h A_L[h, CLS, patches]``. For a mean-pooled head (timm
    ``global_pool="avg"``, BEiT, EVA-02) the row of the pooled token instead: ``w · mean_h A_L``
    with ``w`` = 1/P on the patch tokens (:func:`vitlab.inputs.readout_weights`), the mean of the
    patch tokens' rows; for an attention-pool head, its probe's attention (:func:`probe_sequence`);
    for a head on two tokens (a distilled DeiT, Hugging Face Dinov2's classifier) the mean of their rows.
    """
    def compute(x):
        attentions, layout = recorded_attentions(model, x)
        A = attentions[-1].mean(dim=1)  # B x N x N
        w = readout_weights(layout, "raw_attention", A.dtype, A.device)
        return layout.patches_to_grid(w @ A)  # B x gh x gw
    return in_chunks(compute, model, x, checked_layout(model, x, "raw_attention", pooled=True))


def gradcam_cls_row(attn_row: torch.Tensor, grad_row: torch.Tensor) -> torch.Tensor:
    """GradCAM on one attention row: ``(mean_h w_h * A_h)^+`` with ``w_h = mean_j grad_h[j]``.

    ``attn_row``, ``grad_row``: ``B x heads x P`` (CLS row, patch columns). Per head the
    weight is the gradient averaged over the patches (GradCAM's spatial average), as in
    the reference implementation of Chefer et al.'s baseline. Returns ``B x P``.
    """
    w = grad_row.mean(dim=-1, keepdim=True)  # B x H x 1
    return (w * attn_row).mean(dim=1).clamp(min=0)  # B x P


def attention_gradcam(model, x: torch.Tensor, target=None, score: str = "logit") -> torch.Tensor:
    """GradCAM on the last attention map: the baseline of Chefer, Gur & Wolf (ICCV 2021).

    With A = the last block's attention and G = d(target logit)/dA, restricted to the CLS
    row and patch columns: per head ``w_h = mean_j G[h, CLS, j]``, map
    ``= (mean_h w_h * A[h, CLS, patches])^+``. Returns ``B x gh x gw`` (not rescaled).
    ``score="log_probability"`` differentiates the target's log-probability instead.
    """
    method = "attention_gradcam"
    layout = checked_layout(model, x, method)
    target = gradient_target(model, target, x.shape[0], score, method)

    def compute(x, target):
        ag = recorded_gradients(model, x, target, layers=[-1], score=score, method=method)  # the last block only
        P = ag.layout.num_prefix
        A = ag.attentions[-1][:, :, 0, P:]  # B x H x num_patches
        G = ag.gradients[-1][:, :, 0, P:]  # B x H x num_patches
        return ag.layout.patches_to_grid(gradcam_cls_row(A, G))  # B x gh x gw
    return in_chunks(compute, model, x, layout, gradients=True, target=target)


def _check_index(name: str, value: int, size: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not -size <= value < size:
        raise ValueError(f"{name} must be an int in [0, {size}) (or negative from the end), got {value!r}")
    return value % size


@renamed_arguments(layer="block")
def qk_maps(model, x: torch.Tensor, block: int, head: int, channel: int | None = None) -> QKMaps:
    """Sigmoid images of the query and key of one head over the patch grid (Gildenblat 2020).

    ``q[b, head, patch, channel]`` and ``k[...]`` of block ``block`` (after any q/k norm,
    before the 1/sqrt(d) scale), patch tokens only, through a sigmoid: bright (> 0.5) where
    positive, dark where negative. Returns :class:`QKMaps` with ``B x gh x gw`` images for
    one ``channel``, ``B x head_dim x gh x gw`` when ``channel`` is None (all channels).
    """
    checked_layout(model, x, "qk_maps", cls_row=False)
    # queries and keys only: the model keeps its fused attention path
    with torch.no_grad(), record(model, eval_mode=True, capture=("query", "key")) as rec:
        model(x)
    layout = rec.layout
    L = len(rec.queries)
    block = _check_index("block", block, L)
    q, k = rec.queries[block], rec.keys[block]  # B x H x N x D
    head = _check_index("head", head, q.shape[1])
    q, k = q[:, head], k[:, head]  # B x N x D
    if channel is not None:
        channel = _check_index("channel", channel, q.shape[-1])
        q, k = q[..., channel], k[..., channel]  # B x N
    else:
        q, k = q.transpose(1, 2), k.transpose(1, 2)  # B x D x N
    return QKMaps(layout.patches_to_grid(q).sigmoid(), layout.patches_to_grid(k).sigmoid())


def same_region_score(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Same-region pattern score per channel: Pearson correlation of the q and k maps.

    ``q``, ``k``: ``... x P x D`` (patch tokens x channels). Returns ``... x D`` in [-1, 1].
    Near 1: query and key are positive on the same patches and negative on the same
    others, so each region attends to itself (and the rest to the rest). A constant map
    (zero variance) scores 0. Blind to offset: a key of one sign almost everywhere can still
    correlate with the query through its small variations.
    """
    qc = q - q.mean(dim=-2, keepdim=True)
    kc = k - k.mean(dim=-2, keepdim=True)
    cov = (qc * kc).sum(dim=-2)
    norm = (qc.square().sum(dim=-2) * kc.square().sum(dim=-2)).sqrt()
    return torch.where(norm > 0, cov / norm.clamp_min(torch.finfo(norm.dtype).tiny), torch.zeros_like(cov))


def one_way_score(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """One-way pattern score per channel: broad query times selective key.

    ``q``, ``k``: ``... x P x D`` (patch tokens x channels). With ``s = sign(sum_i q_i)``,
    the sign most queries share:

    - query agreement ``u_q = |sum_i q_i| / sum_i |q_i|`` in [0, 1] (1: every patch's query
      has sign s, so every patch listens to the same keys);
    - key fraction ``f_k`` = share of patches whose key has sign s (the patches every query
      is drawn to);
    - score ``= u_q * (1 - f_k)`` if ``f_k > 0``, else 0 (a key that picks no patch).

    Near 1: queries agree everywhere and the key picks out few patches -- "found the
    object, tell everyone". Returns ``... x D`` in [0, 1).
    """
    q_sum = q.sum(dim=-2)  # ... x D
    u_q = q_sum.abs() / q.abs().sum(dim=-2).clamp_min(torch.finfo(q.dtype).tiny)
    s = q_sum.sign().unsqueeze(-2)  # ... x 1 x D
    f_k = (k * s > 0).to(q.dtype).mean(dim=-2)  # ... x D
    return torch.where(f_k > 0, u_q * (1 - f_k), torch.zeros_like(u_q))




def qk_channel_scores(model, x: torch.Tensor, pattern: str = "one_way") -> torch.Tensor:
    """Pattern score of every channel of every head and layer: ``L x heads x head_dim``.

    Each sample's score over its patch tokens (``pattern``: ``"one_way"``
    :func:`one_way_score`, ``"two_flow"`` :func:`two_flow_score`, ``"exchange"``
    :func:`exchange_score` or ``"same_region"`` :func:`same_region_score`), averaged over the
    batch. One forward pass.
    """
    if pattern not in _SCORES:
        raise ValueError(f"pattern must be one of {QK_PATTERNS}, got {pattern!r}")
    checked_layout(model, x, "qk_channel_scores", cls_row=False)
    # queries and keys only: the model keeps its fused attention path
    with torch.no_grad(), record(model, eval_mode=True, capture=("query", "key")) as rec:
        model(x)
    P = rec.layout.num_prefix
    score = _SCORES[pattern]
    return torch.stack(
        [score(q[:, :, P:], k[:, :, P:]).mean(dim=0) for q, k in zip(rec.queries, rec.keys)]
    )  # L x H x D


def rank_qk_channels(model, x: torch.Tensor, pattern: str = "one_way", top: int = 10) -> list[QKChannel]:
    """The ``top`` channels with the highest :func:`qk_channel_scores`, best first."""
    positive_int("top", top)
    scores = qk_channel_scores(model, x, pattern)  # L x H x D
    L, H, D = scores.shape
    values, flat = scores.flatten().topk(min(top, scores.numel()))
    return [
        QKChannel(int(i) // (H * D), int(i) // D % H, int(i) % D, float(v))
        for v, i in zip(values.tolist(), flat.tolist())
    ]


def exchange_score(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Exchange pattern score per channel: two regions, each drawn to the other.

    ``q``, ``k``: ``... x P x D`` (patch tokens x channels). Returns ``... x D`` in [-1, 1]:
    minus the Pearson correlation, over the patches, of the query's *sign* ``s_i = sign(q_i)``
    with the key ``k_i``.

    Why these two: channel c adds ``q_ic k_jc`` to the logit from patch i to patch j. Within
    row i the softmax ignores what every key shares, so the channel favours the keys with
    ``sign(q_ic) * (k_jc - mean_j k_jc) > 0``: the query's sign picks the direction, only the
    key's contrast counts. Split the patches by the query's sign, A (positive) and B
    (negative). Score near 1: the key is low on A and high on B, so A's queries favour B's
    keys and B's queries favour A's keys -- the two regions exchange information. Near -1:
    each region favours its own keys (the pattern :func:`same_region_score` looks for, here
    without being fooled by a query or key offset). A query of one sign everywhere (every row
    favours the same keys: the one-way pattern) or a constant key scores 0.
    """
    s = q.sign()
    sc = s - s.mean(dim=-2, keepdim=True)
    kc = k - k.mean(dim=-2, keepdim=True)
    cov = (sc * kc).sum(dim=-2)
    norm = (sc.square().sum(dim=-2) * kc.square().sum(dim=-2)).sqrt()
    return torch.where(norm > 0, -cov / norm.clamp_min(torch.finfo(norm.dtype).tiny), torch.zeros_like(cov))


def two_flow_score(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Two-flow pattern score per channel: the blog's second pattern (Gildenblat 2020).

    The blog's block 11, channel 59 of DeiT-tiny: the query is positive mainly on the plane's
    lower part and negative on the rest; the key is negative on the plane's upper part and
    positive around it. A channel sends each query to the keys of its own sign, so one channel
    carries two flows: the plane's top (few keys of the sign most queries have) to the whole
    image, and the surroundings (the other keys) to the plane's bottom (the few queries of the
    other sign). Written with ``m``, the sign most queries share (by sum, as in
    :func:`one_way_score`), ``Q = {i: sign(q_i) = -m}`` (the minority queries, which gather)
    and ``S = {j: sign(k_j) = m}`` (the keys every majority query is drawn to, which
    broadcast)::

        score = one_way(q, k) * 2 |Q| / P * (1 - |Q & S| / |Q|)

    - ``one_way(q, k)`` (:func:`one_way_score`): most queries agree and few keys answer them
      (the broadcast flow);
    - ``2 |Q| / P``: a second group of queries exists (0 for a pure one-way channel; at most 1,
      since ``Q`` is the minority);
    - ``1 - |Q & S| / |Q|``: the gathering queries are not where the broadcasting keys are (0
      when the two regions coincide: that is :func:`exchange_score`'s pattern).

    ``q``, ``k``: ``... x P x D``. Returns ``... x D`` in [0, 1).
    """
    one = one_way_score(q, k)
    regions = two_flow_regions(q, k)
    gather, broadcast = regions.gather.to(q.dtype), regions.broadcast.to(q.dtype)
    n_gather = gather.sum(dim=-2)
    overlap = (gather * broadcast).sum(dim=-2) / n_gather.clamp_min(1)
    P = q.shape[-2]
    return torch.where(n_gather > 0, one * (2 * n_gather / P) * (1 - overlap), torch.zeros_like(one))


class TwoFlowRegions(NamedTuple):
    """The two groups of :func:`two_flow_score`, per patch and channel (``... x P x D`` bool):
    ``gather``, the queries of the minority sign (``sign(q_i) = -m``), and ``broadcast``, the
    keys of the majority's sign (``sign(k_j) = m``), with ``m`` the sign most queries share."""

    gather: torch.Tensor
    broadcast: torch.Tensor


def two_flow_regions(q: torch.Tensor, k: torch.Tensor) -> TwoFlowRegions:
    """Where the two-flow pattern's gathering queries and broadcasting keys lie (see
    :func:`two_flow_score`): ``q``, ``k`` ``... x P x D`` -> two ``... x P x D`` bool masks.
    The blog's pattern places them in different parts of the image (the plane's lower and
    upper part); how far they overlap compared with random placement
    (:func:`vitlab.stats.hypergeometric_cdf`) tests that, whatever their sizes."""
    if q.ndim < 2 or k.ndim < 2 or q.shape[-2] != k.shape[-2]:
        raise ValueError(f"q and k must be ... x P x D over the same P patches, got {tuple(q.shape)} and {tuple(k.shape)}")
    m = q.sum(dim=-2, keepdim=True).sign()                       # ... x 1 x D
    return TwoFlowRegions(q * m < 0, k * m > 0)


_SCORES = {"one_way": one_way_score, "two_flow": two_flow_score, "exchange": exchange_score,
           "same_region": same_region_score}


class TokenNorms(NamedTuple):
    """Residual-stream norms of the patch tokens, from :func:`token_norms`.

    Attributes:
        norms: ``B x K x gh x gw``: the L2 norm (over the model width) of the residual stream
            leaving block ``blocks[i]``, at every patch token.
        high: ``B x K x gh x gw`` bool: ``norms > ratio x`` the median patch norm of the same
            image and block (the high-norm rule of :func:`token_norms`).
        blocks: the K block indices, counted from 0.
        ratio: the factor of the rule.
    """

    norms: torch.Tensor
    high: torch.Tensor
    blocks: list[int]
    ratio: float


def token_norms(model, x: torch.Tensor, blocks=None, ratio: float = 3.0) -> TokenNorms:
    """L2 norm of every patch token's residual stream after each block, and which are outliers.

    Darcet, Oquab, Mairal & Bojanowski (ICLR 2024, "Vision Transformers Need Registers",
    Sec. 2) find, in large DINOv2 and other ViTs, a few patch tokens -- mostly in redundant
    background -- whose output norm is far above all others; the CLS token's attention
    gathers on them, and extra "register" tokens appended to the input remove them. This
    measures that norm: ``||h_l[b, i]||`` of the hidden state leaving block l
    (``rec.hidden_states`` of :func:`vitlab.record`), patch tokens only, on the patch grid.

    High-norm rule: a patch is flagged when its norm exceeds ``ratio`` times the median
    patch norm of the same image and block. The median makes the rule scale-free (norms grow
    with depth) and unmoved by a few outliers; ``ratio=3`` is a choice: in the paper the
    outliers form a separate mode far above the bulk, while ordinary patches vary by far less.

    Args:
        model: a timm or Hugging Face ViT (run in eval mode, its mode put back).
        x: ``B x 3 x H x W`` input batch.
        blocks: block indices to keep (negative from the end); None: every block.
        ratio: the factor of the high-norm rule, > 1.
    """
    check_images(x, "token_norms")
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not ratio > 1:
        raise ValueError(f"ratio must be a number > 1 (a multiple of the median norm), got {ratio!r}")
    with torch.no_grad(), record(model, eval_mode=True, capture=("hidden",)) as rec:
        model(x)
    L = len(rec.hidden_states)
    if blocks is None:
        blocks = list(range(L))
    elif isinstance(blocks, int):
        raise ValueError(f"blocks must be a list of block indices (or None for all), got the int {blocks}; "
                         f"write [{blocks}]")
    blocks = [_check_index("block", b, L) for b in blocks]
    P = rec.layout.num_prefix
    norms = torch.stack([rec.hidden_states[l][:, P:].norm(dim=-1) for l in blocks], dim=1)  # B x K x patches
    high = norms > ratio * norms.median(dim=-1, keepdim=True).values
    grid = rec.layout.patches_to_grid
    return TokenNorms(grid(norms), grid(high), blocks, float(ratio))


# ---------------------------------------------------------------------------------------------
# Graded against masks: the class token's attention, block by block and head by head
# ---------------------------------------------------------------------------------------------


class CLSProfile(NamedTuple):
    """Where the class token looks, layer by layer, from :func:`cls_attention_profile`.

    Attributes:
        mass: ``B x layers x heads`` share of each head's CLS-to-patch attention on the object.
        entropy: ``B x layers x heads`` normalised entropy of the same maps (1 = uniform).
        area: ``B`` object area share (the chance level of ``mass``).
    """

    mass: torch.Tensor
    entropy: torch.Tensor
    area: torch.Tensor


def cls_attention_profile(model, x: torch.Tensor, masks, batch_size: int = 50) -> CLSProfile:
    """Per sample, layer and head: the class token's attention share on the object and its entropy.

    ``x``: ``B x 3 x H x W`` inputs; ``masks``: ``B x H' x W'`` object masks at the model's
    input resolution (or any multiple of the patch grid). One forward per batch of
    ``batch_size`` (:func:`vitlab.attention.cls_attention`).
    """
    from vitlab.localization import as_cpu_tensor, attention_entropy, layer_mass_on_object, object_area

    masks = as_cpu_tensor(masks)
    if masks.ndim != 3 or masks.shape[0] != x.shape[0]:
        raise ValueError(f"need one B x H x W mask per input: {x.shape[0]} inputs, masks {tuple(masks.shape)}")
    mass, entropy = [], []
    for s in batches(x.shape[0], batch_size):
        cls = cls_attention(model, x[s])  # b x L x heads x gh x gw
        mass.append(layer_mass_on_object(cls, masks[s]))
        entropy.append(attention_entropy(cls))
    return CLSProfile(torch.cat(mass), torch.cat(entropy), object_area(masks))


# names that moved to vitlab.inputs (vitlab 0.2): reading them here raises an error that says where they are
__getattr__ = moved_names('vitlab.attention', dict.fromkeys(("check_batch_values", "require_cls", "CLS_POOLS", "MEMORY_BUDGET", "chunk_size"), 'vitlab.inputs'))
