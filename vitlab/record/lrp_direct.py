"""Chefer's LRP rules for a plain timm ViT as a hand-written pass: no autograd graph.

:mod:`vitlab.record.lrp` gets every relevance from one forward and one autograd backward whose
backward functions are the rules. For the commonest model, a plain timm ``VisionTransformer``
(ViT, DeiT, the embedded shapes model: class token, position embedding, pre-LN blocks of
``Attention`` and ``Mlp`` with GELU, a linear head on the class token), this module runs the
same forward with plain tensor ops, keeps the activations the rules read, and applies the same
rule functions layer by layer, last block first: the alpha-beta rule at every linear layer
(:func:`vitlab.record.lrp.alpha1_beta0_rule`), the identity rule at GELU, LayerNorm and softmax
(the softmax's divided by the scores from their terms, :func:`~vitlab.record.lrp.product_from_terms`),
the halved gradient x input split at the attention products, the residual rule at each addition,
the gradient at the position sum. Each rule is called on the very tensors the autograd pass hands
it (the same values, in the same layout, each sum of two gradients made as autograd makes it), so
the relevances are those of the autograd pass bit for bit (``tests/test_lrp_direct.py`` checks
it), at the cost of the rules' arithmetic alone: no graph is recorded, no view's backward copies
a gradient, no rule runs where its result is not read (partial LRP stops at the last attention
map, Transformer attribution's plain backward at the first block's), and the last block's linear
layers compute the class token's rows only.

:func:`plan` says whether a model is covered: it must be exactly that architecture (the classes
checked by name and type, no forward hooks anywhere, no torch function mode open, the image size
the model was built for, parameters in the input's dtype and device); every other model, and
AttnLRP, takes the autograd pass.

What it costs and gives (``benchmarks/bench_lrp.py``, CPU, one thread, DeiT-tiny): the same maps;
on a batch of 16 about the autograd pass's time (the rules' matmuls, 3.05x a forward for full LRP,
and their element-wise steps, one pass over memory each, are the same work; autograd's own overhead
is small; 3-4% less), one image at a time 10-25% less; the activations of each block are let go as soon as
both backwards have passed it. :func:`compiled_kernels` (``vitlab.lrp.COMPILE``) fuses the
alpha-beta rule's element-wise steps into one loop each (``torch.compile``), the same values:
3-8% less on a batch.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from vitlab.record.lrp import EXACT_BELOW, _by_rows, _live_rows, identity_rule, linear_vjp, residual_add_rule


class Saved(NamedTuple):
    """One block's activations, as the autograd pass's forward computes them."""

    h: torch.Tensor      # block input (the residual stream)
    n1: torch.Tensor     # norm1(h)
    qkv: torch.Tensor    # qkv(n1), B x N x 3D
    qs: torch.Tensor     # q * scale, B x H x N x hd
    kT: torch.Tensor     # k transposed, B x H x hd x N
    v: torch.Tensor      # B x H x N x hd
    S: torch.Tensor      # the scores qs @ kT
    A: torch.Tensor      # softmax(S)
    O: torch.Tensor      # the heads' outputs merged, B x N x D
    P: torch.Tensor      # proj(O)
    mid: torch.Tensor    # h + P
    n2: torch.Tensor     # norm2(mid)
    f1: torch.Tensor     # fc1(n2)
    g: torch.Tensor      # gelu(f1)
    f2: torch.Tensor     # fc2(g)
    out: torch.Tensor    # mid + f2


class Forward(NamedTuple):
    e: torch.Tensor       # patch tokens, B x P x D
    x0: torch.Tensor      # tokens entering the first block
    blocks: list          # Saved per block
    h: torch.Tensor       # last block's output
    nf: torch.Tensor      # final norm(h)
    cls: torch.Tensor     # nf[:, 0]
    logits: torch.Tensor


def _exact_type(m, module: str, name: str) -> bool:
    return type(m).__module__ == module and type(m).__name__ == name


def _no_hooks(model: nn.Module) -> bool:
    from torch.nn.modules import module as M

    if any(getattr(M, t, None) for t in ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
                                          "_global_backward_pre_hooks")):
        return False
    for m in model.modules():
        for t in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks"):
            if getattr(m, t, None):
                return False
    return True


def _layer_norm(m) -> bool:
    """torch's LayerNorm or timm's (``F.layer_norm`` unless its fast norm is on)."""
    return type(m) is nn.LayerNorm or (_exact_type(m, "timm.layers.norm", "LayerNorm")
                                       and not getattr(m, "_fast_norm", True))


def _drop(m) -> bool:  # off in eval mode, as the pass runs the model
    return isinstance(m, nn.Identity) or type(m) is nn.Dropout or (
        type(m).__name__ == "DropPath" and type(m).__module__ == "timm.layers.drop")


def plan(model: nn.Module, x: torch.Tensor) -> bool:
    """Whether the hand-written pass covers ``model`` on ``x`` exactly (module docstring); else the
    autograd pass runs."""
    if not _exact_type(model, "timm.models.vision_transformer", "VisionTransformer"):
        return False
    if torch._C._len_torch_function_stack() > 0 or not _no_hooks(model):
        return False
    pe = model.patch_embed
    if not (_exact_type(pe, "timm.layers.patch_embed", "PatchEmbed") and type(pe.proj) is nn.Conv2d
            and isinstance(pe.norm, nn.Identity) and getattr(pe, "flatten", False)
            and str(getattr(pe, "output_fmt", "NCHW")).endswith("NCHW")
            and not getattr(pe, "dynamic_img_pad", False)):
        return False
    if pe.img_size is None or tuple(x.shape[-2:]) != tuple(pe.img_size) or x.ndim != 4:
        return False
    if (model.cls_token is None or model.reg_token is not None or getattr(model, "num_prefix_tokens", 1) != 1
            or model.no_embed_class or model.pos_embed is None or model.dynamic_img_size
            or model.global_pool != "token" or model.attn_pool is not None
            or model.pos_embed.shape[1] != pe.num_patches + 1):
        return False
    if not (_drop(model.pos_drop) and isinstance(model.patch_drop, nn.Identity)
            and isinstance(model.norm_pre, nn.Identity)
            and _layer_norm(model.norm) and isinstance(model.fc_norm, nn.Identity)
            and _drop(model.head_drop) and type(model.head) is nn.Linear):
        return False
    dtype = model.head.weight.dtype
    if x.dtype != dtype or any(p.dtype != dtype or p.device != x.device for p in model.parameters()):
        return False
    for blk in model.blocks:
        if not _exact_type(blk, "timm.models.vision_transformer", "Block"):
            return False
        a, m = blk.attn, blk.mlp
        if not (_layer_norm(blk.norm1) and _layer_norm(blk.norm2)
                and isinstance(blk.ls1, nn.Identity) and isinstance(blk.ls2, nn.Identity)
                and _drop(blk.drop_path1) and _drop(blk.drop_path2)
                and _exact_type(a, "timm.layers.attention", "Attention") and type(a.qkv) is nn.Linear
                and type(a.proj) is nn.Linear and isinstance(a.q_norm, nn.Identity)
                and isinstance(a.k_norm, nn.Identity)
                and isinstance(a.norm, nn.Identity) and getattr(a, "gate", None) is None and _drop(a.attn_drop)
                and _drop(a.proj_drop)
                and _exact_type(m, "timm.layers.mlp", "Mlp") and type(m.fc1) is nn.Linear and type(m.fc2) is nn.Linear
                and type(m.act) is nn.GELU and _drop(m.drop1) and _drop(m.drop2) and isinstance(m.norm, nn.Identity)):
            return False
    return True


def _ln(t: torch.Tensor, norm: nn.LayerNorm) -> torch.Tensor:
    w = None if norm.weight is None else norm.weight.detach()
    b = None if norm.bias is None else norm.bias.detach()
    return F.layer_norm(t, norm.normalized_shape, w, b, norm.eps)


def _lin(t: torch.Tensor, layer: nn.Linear) -> torch.Tensor:
    return F.linear(t, layer.weight.detach(), None if layer.bias is None else layer.bias.detach())


@torch.no_grad()
def forward(model: nn.Module, x: torch.Tensor) -> Forward:
    """The model's eval forward with the autograd pass's operations (its attention written out as
    matmul - softmax - matmul), keeping what the rules read."""
    e = model.patch_embed(x)
    B = e.shape[0]
    x0 = torch.cat([model.cls_token.detach().expand(B, -1, -1), e], dim=1) + model.pos_embed.detach()
    h, blocks = x0, []
    for blk in model.blocks:
        a = blk.attn
        n1 = _ln(h, blk.norm1)
        N, D = n1.shape[1], a.head_dim * a.num_heads
        qkv = _lin(n1, a.qkv)
        q, k, v = qkv.reshape(B, N, 3, a.num_heads, a.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        if a.fused_attn:  # the rules' scaled_dot_product_attention (vitlab.record.lrp._LRPMode.sdpa)
            scale = q.shape[-1] ** -0.5
            k, v = k.contiguous(), v.contiguous()
        else:
            scale = a.scale
        qs = q * scale
        kT = k.transpose(-2, -1)
        S = torch.matmul(qs, kT)
        A = torch.softmax(S, dim=-1)
        O = torch.matmul(A, v).transpose(1, 2).reshape(B, N, D)
        P = _lin(O, a.proj)
        mid = torch.add(h, P)
        n2 = _ln(mid, blk.norm2)
        f1 = _lin(n2, blk.mlp.fc1)
        g = F.gelu(f1, approximate=blk.mlp.act.approximate)
        f2 = _lin(g, blk.mlp.fc2)
        out = torch.add(mid, f2)
        blocks.append(Saved(h, n1, qkv, qs, kT, v, S, A, O, P, mid, n2, f1, g, f2, out))
        h = out
    nf = _ln(h, model.norm)
    cls = nf[:, 0]
    return Forward(e, x0, blocks, h, nf, cls, _lin(cls, model.head))


# --- the element-wise steps of the rules: eager (the autograd pass's own operations) or compiled ---------
def _share_eager(z0, out, grad):
    """Alpha-beta's ``S / 2 = R_y / Z`` from ``z0 = |x| |W|^T - b`` (``Z = z0 + y``), 0 where ``Z <= 0``:
    the operations of :func:`vitlab.record.lrp.alpha1_beta0_rule`."""
    z = z0.add_(out)
    return (out * grad).div_(z).masked_fill_(z <= 0, 0.0)


def _pick_eager(P, N, x):
    """``P`` where x > 0, ``N`` where x < 0, 0 where x == 0, as :func:`~vitlab.record.lrp.alpha1_beta0_rule`
    makes it (0/1 masks)."""
    sign = x.sign()
    g = P.mul_(sign.clamp(min=0))
    return g.addcmul_(N, sign.clamp_(max=0), value=-1)


def _identity_eager(grad, out, x):
    return identity_rule(grad, out, x)[0]


def _small_eager(o, na, nb):
    """Where ``|o_ij| < na_i nb_j`` (:func:`~vitlab.record.lrp.product_from_terms`'s test, ``na``
    carrying ``EXACT_BELOW``)."""
    return torch.lt(o.abs(), na.unsqueeze(-1) * nb.unsqueeze(-2))


def _qkv_eager(gqs, scale, gkT, gv):
    """The gradient of ``qkv`` (B x N x 3D) from those of ``q * scale``, k^T and v, as the views'
    backwards give it."""
    B, H, N, hd = gv.shape
    return torch.stack([gqs * scale, gkT.transpose(-2, -1), gv]).permute(1, 3, 0, 2, 4).reshape(B, N, 3 * H * hd)


def _share_fused(z0, out, grad):
    z = z0 + out
    return torch.where(z <= 0, 0.0, (out * grad) / z)


def _pick_fused(P, N, x):
    return torch.where(x > 0, P, torch.where(x < 0, N, 0.0))


class Kernels(NamedTuple):
    """The element-wise steps the pass runs, each a function of tensors (``share`` and ``pick`` of
    tensors of one shape, which the compiled forms take flattened)."""

    share: object
    pick: object
    identity: object
    small: object
    qkv: object


EAGER = Kernels(_share_eager, _pick_eager, _identity_eager, _small_eager, _qkv_eager)
_COMPILED: list = []   # the compiled kernels, made once
#: Tensors below this many entries take the eager steps even with the compiled kernels: there the
#: compiled call's own overhead exceeds what fusing saves (one image of DeiT-tiny: its 197 x 768 MLP
#: activation, 151k entries, ran 7% slower compiled).
COMPILED_FROM = 2 ** 18
_FAILED: list = []     # why compiling failed, once it has


def compiled_kernels() -> Kernels:
    """The element-wise steps compiled by ``torch.compile`` (inductor: each step one fused loop over
    its tensors instead of one pass per operation; the same operations in the same order, so the
    same values, see :data:`vitlab.lrp.COMPILE`). Compiling happens at the first call of each and
    needs a C++ compiler on a CPU (Triton on a GPU); where it fails the step falls back to its eager
    form with a warning, once, and every later call runs eager."""
    if _COMPILED:
        return _COMPILED[0]

    def guarded(fused, eager):
        fn = torch.compile(fused, dynamic=True, fullgraph=True)

        def run(*args):
            if _FAILED or args[0].numel() < COMPILED_FROM:
                return eager(*args)
            try:  # flat: one compiled loop per dtype, whatever the shapes and layouts
                return fn(*(t.reshape(-1) for t in args)).view(args[0].shape)
            except Exception as err:  # no compiler, an unsupported backend: run as before
                import warnings

                _FAILED.append(err)
                warnings.warn(f"vitlab.lrp.COMPILE: torch.compile failed ({type(err).__name__}: "
                              f"{str(err).splitlines()[0] if str(err) else ''}); the LRP rules run eager (same values)",
                              RuntimeWarning, stacklevel=3)
                return eager(*args)
        return run

    # compiled where it pays (measured, 1 thread, DeiT-tiny batch 16): alpha-beta's share (5 passes
    # in eager, 10.9 ms -> 2.2 ms for fc1's) and pick (4.1 -> 1.9 ms); the identity rule (3 passes)
    # and the qkv gradient's copy are as fast eager, the scores' test 7x slower compiled (a broadcast
    # that inductor's dynamic-shape loop does not vectorise)
    _COMPILED.append(EAGER._replace(share=guarded(_share_fused, _share_eager), pick=guarded(_pick_fused, _pick_eager)))
    return _COMPILED[0]


def _dense_rule(K: Kernels, w, w_abs, w_pos2, w_neg2, b, grad, out, x):
    """:func:`vitlab.record.lrp.alpha1_beta0_rule`'s dense form with the element-wise steps of ``K``."""
    z0 = F.linear(x.abs(), w_abs, None if b is None else -b)
    s = K.share(z0, out, grad)
    return K.pick(s @ w_pos2, s @ w_neg2, x)


def _linear_rule(K: Kernels, layer: nn.Linear, grad, out, x):
    w = layer.weight.detach()
    b = None if layer.bias is None else layer.bias.detach()
    w_abs = w.abs()
    dense = lambda g, o, xx: _dense_rule(K, w, w_abs, w_abs + w, w - w_abs, b, g, o, xx)  # noqa: E731
    index = _live_rows(grad)
    return dense(grad, out, x) if index is None else _by_rows(grad, x, index, dense, out, x)


def _scores_from_terms(K: Kernels, a, b, out):
    """:func:`vitlab.record.lrp.product_from_terms` with the test of ``K``, fixing ``out`` in place
    (the pass reads the forward's scores nowhere else)."""
    batch = out.shape[:-2]
    n, k, m = a.shape[-2], a.shape[-1], b.shape[-1]
    a3 = a.expand(*batch, n, k).reshape(-1, n, k)
    b3 = b.expand(*batch, k, m).reshape(-1, k, m)
    o3 = out.reshape(-1, n, m)
    which, i, j = K.small(o3, a3.norm(dim=-1) * EXACT_BELOW, b3.norm(dim=-2)).nonzero(as_tuple=True)
    if which.numel():
        terms = a3[which, i, :].double() * b3[which, :, j].double()
        fixed = o3 if o3.data_ptr() == out.data_ptr() else o3.clone()
        fixed[which, i, j] = terms.sum(-1).to(out.dtype)
        return fixed.reshape(out.shape)
    return out


def _half_matmul_grads(grad, a, b, need_b: bool = True, plain: bool = False):
    """:class:`vitlab.record.lrp._HalfMatmul`'s backward for ``a @ b``, the same operations."""
    half_out = not plain and grad.numel() <= a.numel() + b.numel()
    if half_out:
        grad = torch.mul(grad, 0.5, out=torch.empty_like(grad, memory_format=torch.contiguous_format))
    ga = torch.matmul(grad, b.transpose(-2, -1))
    gb = torch.matmul(a.transpose(-2, -1), grad) if need_b else None
    if not plain and not half_out:
        ga = ga.mul_(0.5)
        gb = None if gb is None else gb.mul_(0.5)
    return ga, gb


def _ln_vjp(grad, x, norm: nn.LayerNorm):
    """LayerNorm's plain gradient with respect to its input."""
    w = None if norm.weight is None else norm.weight.detach()
    b = None if norm.bias is None else norm.bias.detach()
    _, mean, rstd = torch.native_layer_norm(x, norm.normalized_shape, w, b, norm.eps)
    return torch.ops.aten.native_layer_norm_backward(grad, x, norm.normalized_shape, mean, rstd, w, b,
                                                     [True, False, False])[0]


def _linear_vjp(layer: nn.Linear, grad, out, x):
    return linear_vjp(layer.weight.detach())(grad, out, x)[0]


class Relevance(NamedTuple):
    """What :func:`relevance` gives: the changed gradients of the patch tokens and of the tokens
    entering the first block (None without ``tokens``), the relevance ``A ⊙ gbar_A`` of each attention
    map asked for and the ordinary gradients of the maps (with ``plain``), first block first."""

    g_e: torch.Tensor | None
    g_x0: torch.Tensor | None
    attention_relevance: list
    attention_grads: list


def relevance(model: nn.Module, fw: Forward, start: torch.Tensor, attention, tokens: bool,
              plain: torch.Tensor | None = None, K: Kernels = EAGER) -> Relevance:
    """Chefer's rules from the relevance ``start`` on the logits (``B x C``, the gradient the autograd
    pass starts from) down, block by block, last first (``attention``: the relevance of every block's
    map with True, of the last block's with ``"last"``, none with False); with ``plain`` (``B x C``)
    also the ordinary gradient of ``sum(logits * plain)`` with respect to every map, by the model's own
    derivatives, in the same loop. Each block's activations are let go once both backwards have
    passed it (``fw.blocks`` is emptied), so memory is reused as the autograd engine reuses it."""
    L = len(fw.blocks)
    wanted = set(range(L)) if attention is True else ({L - 1} if attention == "last" else set())
    stop = 0 if tokens else min(wanted | {L})  # the relevance pass's last block
    lowest = 0 if plain is not None else stop
    R_A, G_A = [None] * L, [None] * L
    nf, h, cls, logits = fw.nf, fw.h, fw.cls, fw.logits
    grad = torch.zeros_like(nf)
    grad[:, 0] = _linear_rule(K, model.head, start, logits, cls)
    grad = K.identity(grad, nf, h)
    if plain is not None:
        pgrad = torch.zeros_like(nf)
        pgrad[:, 0] = _linear_vjp(model.head, plain, logits, cls)
        pgrad = _ln_vjp(pgrad, h, model.norm)
    for b in range(L - 1, lowest - 1, -1):
        s, blk = fw.blocks[b], model.blocks[b]
        fw.blocks[b] = None
        if b >= stop:
            kept = [] if b in wanted else None
            grad = _relevance_block(K, s, blk, grad, b == stop and not tokens, kept)
            if kept:
                R_A[b] = kept[0]
        if plain is not None:
            pgrad = _plain_block(s, blk, pgrad, b, G_A)
        del s
    fw.blocks.clear()
    g_x0 = grad if tokens else None
    g_e = grad[:, 1:] if tokens else None
    return Relevance(g_e, g_x0, [r for r in R_A if r is not None], [g for g in G_A if g is not None])


def _relevance_block(K, s: Saved, blk, grad, last_needed: bool, keep: list | None):
    """One block of the relevance pass: the changed gradient of the block's input (None where its
    attention map is the last thing needed); the map's relevance ``A ⊙ gbar_A`` appended to ``keep``
    where given."""
    a = blk.attn
    B, N, D = s.O.shape
    g_mid, g_f2 = residual_add_rule(grad, s.out, s.mid, s.f2)
    g_g = _linear_rule(K, blk.mlp.fc2, g_f2, s.f2, s.g)
    g_f1 = K.identity(g_g, s.g, s.f1)
    del g_g
    g_n2 = _linear_rule(K, blk.mlp.fc1, g_f1, s.f1, s.n2)
    del g_f1
    g_mid = g_mid.add_(K.identity(g_n2, s.n2, s.mid))
    g_h, g_P = residual_add_rule(g_mid, s.mid, s.h, s.P)
    g_O = _linear_rule(K, a.proj, g_P, s.P, s.O)
    g_Oh = g_O.reshape(B, N, a.num_heads, a.head_dim).transpose(1, 2)
    gA, gv = _half_matmul_grads(g_Oh, s.A, s.v, need_b=not last_needed)
    if keep is not None:
        keep.append(s.A * gA)
    if last_needed:
        return None
    if s.S.dtype != torch.float64:  # the softmax's rule divides by the scores from their terms
        g_S = K.identity(gA, s.A, _scores_from_terms(K, s.qs, s.kT, s.S))
    else:
        g_S = K.identity(gA, s.A, s.S)
    del gA
    g_qs, g_kT = _half_matmul_grads(g_S, s.qs, s.kT)
    del g_S
    scale = s.qs.shape[-1] ** -0.5 if a.fused_attn else a.scale
    g_qkv = K.qkv(g_qs, scale, g_kT, gv)
    g_n1 = _linear_rule(K, a.qkv, g_qkv, s.qkv, s.n1)
    return g_h.add_(K.identity(g_n1, s.n1, s.h))


def _plain_block(s: Saved, blk, grad, b: int, G_A):
    """One block of the plain backward: the gradient of the block's input (None at block 0, where
    the map's gradient is the last one asked for); ``G_A[b]`` set."""
    a = blk.attn
    B, N, D = s.O.shape
    g_g = _linear_vjp(blk.mlp.fc2, grad, s.f2, s.g)
    g_f1 = torch.ops.aten.gelu_backward(g_g, s.f1, approximate=blk.mlp.act.approximate)
    g_n2 = _linear_vjp(blk.mlp.fc1, g_f1, s.f1, s.n2)
    g_mid = grad + _ln_vjp(g_n2, s.mid, blk.norm2)
    g_O = _linear_vjp(a.proj, g_mid, s.P, s.O)
    g_Oh = g_O.reshape(B, N, a.num_heads, a.head_dim).transpose(1, 2)
    G_A[b], gv = _half_matmul_grads(g_Oh, s.A, s.v, need_b=b > 0, plain=True)
    if b == 0:
        return None
    g_S = torch._softmax_backward_data(G_A[b], s.A, -1, s.S.dtype)
    g_qs, g_kT = _half_matmul_grads(g_S, s.qs, s.kT, plain=True)
    scale = s.qs.shape[-1] ** -0.5 if a.fused_attn else a.scale
    g_qkv = _qkv_eager(g_qs, scale, g_kT, gv)
    g_n1 = _linear_vjp(a.qkv, g_qkv, s.qkv, s.n1)
    return g_mid.add_(_ln_vjp(g_n1, s.h, blk.norm1))
