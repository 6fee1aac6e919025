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
the model was built for); every other model, and AttnLRP, takes the autograd pass.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from vitlab.record.lrp import (
    _by_rows, _live_rows, alpha1_beta0_rule, identity_rule, linear_vjp, product_from_terms, residual_add_rule,
)


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


def _identity(m) -> bool:
    return isinstance(m, nn.Identity) or (type(m).__name__ in ("Dropout", "DropPath") and type(m).__module__ in (
        "torch.nn.modules.dropout", "timm.layers.drop"))


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
    if not (_drop(model.pos_drop) and isinstance(model.patch_drop, nn.Identity) and isinstance(model.norm_pre, nn.Identity)
            and type(model.norm) is nn.LayerNorm and isinstance(model.fc_norm, nn.Identity)
            and _drop(model.head_drop) and type(model.head) is nn.Linear):
        return False
    dtype = model.head.weight.dtype
    if x.dtype != dtype or any(p.dtype != dtype or p.device != x.device for p in model.parameters()):
        return False
    for blk in model.blocks:
        if not _exact_type(blk, "timm.models.vision_transformer", "Block"):
            return False
        a, m = blk.attn, blk.mlp
        if not (type(blk.norm1) is nn.LayerNorm and type(blk.norm2) is nn.LayerNorm
                and isinstance(blk.ls1, nn.Identity) and isinstance(blk.ls2, nn.Identity)
                and _drop(blk.drop_path1) and _drop(blk.drop_path2)
                and _exact_type(a, "timm.layers.attention", "Attention") and type(a.qkv) is nn.Linear
                and type(a.proj) is nn.Linear and isinstance(a.q_norm, nn.Identity) and isinstance(a.k_norm, nn.Identity)
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


def _linear_rule(layer: nn.Linear, grad, out, x):
    w = layer.weight.detach()
    return alpha1_beta0_rule(w, None if layer.bias is None else layer.bias.detach())(grad, out, x)[0]


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


def _qkv_grad(gq, gk_T, gv, B, N, D):
    """The gradient of ``qkv`` (B x N x 3D) from those of q, k^T and v, as the views' backwards give it."""
    return torch.stack([gq, gk_T.transpose(-2, -1), gv]).permute(1, 3, 0, 2, 4).reshape(B, N, 3 * D)


def _ln_vjp(grad, x, norm: nn.LayerNorm):
    """LayerNorm's plain gradient with respect to its input."""
    w = None if norm.weight is None else norm.weight.detach()
    b = None if norm.bias is None else norm.bias.detach()
    _, mean, rstd = torch.native_layer_norm(x, norm.normalized_shape, w, b, norm.eps)
    return torch.ops.aten.native_layer_norm_backward(grad, x, norm.normalized_shape, mean, rstd, w, b,
                                                     [True, False, False])[0]


def _linear_vjp(layer: nn.Linear, grad, out, x):
    return linear_vjp(layer.weight.detach())(grad, out, x)[0]


def relevance(model: nn.Module, fw: Forward, start: torch.Tensor, attention, tokens: bool):
    """Chefer's rules from the relevance ``start`` on the logits (``B x C``, as the gradient the
    autograd pass starts from) down: ``(g_e, g_x0, [gbar_A per block wanted])``, the changed
    gradients of the patch tokens and of the tokens entering the first block (None without
    ``tokens``) and of the attention maps (``attention``: True every block, ``"last"`` the last
    block's, False none; listed first block first)."""
    L = len(fw.blocks)
    wanted = set(range(L)) if attention is True else ({L - 1} if attention == "last" else set())
    lowest = 0 if tokens else (min(wanted) if wanted else L)
    g_A = {}
    g_cls = _linear_rule(model.head, start, fw.logits, fw.cls)
    grad = torch.zeros_like(fw.nf)
    grad[:, 0] = g_cls
    grad = identity_rule(grad, fw.nf, fw.h)[0]
    for b in range(L - 1, lowest - 1, -1):
        s, blk = fw.blocks[b], model.blocks[b]
        a = blk.attn
        B, N, D = s.O.shape
        g_mid, g_f2 = residual_add_rule(grad, s.out, s.mid, s.f2)
        g_g = _linear_rule(blk.mlp.fc2, g_f2, s.f2, s.g)
        g_f1 = identity_rule(g_g, s.g, s.f1)[0]
        g_n2 = _linear_rule(blk.mlp.fc1, g_f1, s.f1, s.n2)
        g_mid = g_mid + identity_rule(g_n2, s.n2, s.mid)[0]
        g_h, g_P = residual_add_rule(g_mid, s.mid, s.h, s.P)
        g_O = _linear_rule(a.proj, g_P, s.P, s.O)
        g_Oh = g_O.reshape(B, N, a.num_heads, a.head_dim).transpose(1, 2)
        last_needed = b == lowest and not tokens
        gA, gv = _half_matmul_grads(g_Oh, s.A, s.v, need_b=not last_needed)
        if b in wanted:
            g_A[b] = gA
        if last_needed:
            break
        if s.S.dtype != torch.float64:  # the softmax's rule divides by the scores from their terms
            S_exact = product_from_terms(s.qs, s.kT, s.S)
            g_S = (gA * s.A).div_(S_exact.to(s.S.dtype)).nan_to_num_(0.0, 0.0, 0.0)
        else:
            g_S = identity_rule(gA, s.A, s.S)[0]
        g_qs, g_kT = _half_matmul_grads(g_S, s.qs, s.kT)
        scale = s.qs.shape[-1] ** -0.5 if a.fused_attn else a.scale
        g_qkv = _qkv_grad(g_qs * scale, g_kT, gv, B, N, D)
        g_n1 = _linear_rule(a.qkv, g_qkv, s.qkv, s.n1)
        grad = g_h + identity_rule(g_n1, s.n1, s.h)[0]
    g_x0 = grad if tokens else None
    g_e = grad[:, 1:] if tokens else None
    return g_e, g_x0, [g_A[b] for b in sorted(g_A)]


def plain_attention_grads(model: nn.Module, fw: Forward, g: torch.Tensor) -> list:
    """The ordinary gradient of ``sum(logits * g)`` with respect to every block's attention map
    (first block first), by the model's own derivatives, as the autograd pass's plain backward."""
    L = len(fw.blocks)
    out = [None] * L
    g_cls = _linear_vjp(model.head, g, fw.logits, fw.cls)
    grad = torch.zeros_like(fw.nf)
    grad[:, 0] = g_cls
    grad = _ln_vjp(grad, fw.h, model.norm)
    for b in range(L - 1, -1, -1):
        s, blk = fw.blocks[b], model.blocks[b]
        a = blk.attn
        B, N, D = s.O.shape
        g_g = _linear_vjp(blk.mlp.fc2, grad, s.f2, s.g)
        g_f1 = torch.ops.aten.gelu_backward(g_g, s.f1, approximate=blk.mlp.act.approximate)
        g_n2 = _linear_vjp(blk.mlp.fc1, g_f1, s.f1, s.n2)
        g_mid = grad + _ln_vjp(g_n2, s.mid, blk.norm2)
        g_O = _linear_vjp(a.proj, g_mid, s.P, s.O)
        g_Oh = g_O.reshape(B, N, a.num_heads, a.head_dim).transpose(1, 2)
        gA, gv = _half_matmul_grads(g_Oh, s.A, s.v, need_b=b > 0, plain=True)
        out[b] = gA
        if b == 0:
            break
        g_S = torch._softmax_backward_data(gA, s.A, -1, s.S.dtype)
        g_qs, g_kT = _half_matmul_grads(g_S, s.qs, s.kT, plain=True)
        scale = s.qs.shape[-1] ** -0.5 if a.fused_attn else a.scale
        g_qkv = _qkv_grad(g_qs * scale, g_kT, gv, B, N, D)
        g_n1 = _linear_vjp(a.qkv, g_qkv, s.qkv, s.n1)
        grad = g_mid + _ln_vjp(g_n1, s.h, blk.norm1)
    return out
