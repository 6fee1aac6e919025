"""Independent computations shared by several test files (written from the papers and the weights,
not from vitlab): the float64 CLIP forward, Chefer et al.'s bi-modal rules as loops, a timm ViT
written out block by block, the text-and-image deletion loop, a forward counter. Test files import
from here, from tiny_models and from conftest, never from one another."""
from __future__ import annotations

import contextlib
from types import SimpleNamespace

import numpy as np
import torch
import torch.nn.functional as F

from conftest import f32_tol, module_depth
from tiny_models import tiny_clip
from vitlab import bimodal_faithfulness as bf


def end_of_text(model, ids):
    """Hugging Face's pooling position, written out: legacy configs pool at the largest id, others at the first eos."""
    if model.config.text_config.eos_token_id == 2:
        return ids.argmax(dim=-1)
    return torch.tensor([int((row == model.config.text_config.eos_token_id).nonzero()[0]) for row in ids])


def _ln(x, prefix, sd, eps=1e-5):
    mu, var = x.mean(-1, keepdim=True), x.var(-1, unbiased=False, keepdim=True)
    return (x - mu) / torch.sqrt(var + eps) * sd[prefix + ".weight"] + sd[prefix + ".bias"]


def _lin(x, prefix, sd):
    out = x @ sd[prefix + ".weight"].T
    return out + sd[prefix + ".bias"] if prefix + ".bias" in sd else out


def _tower(h, prefix, sd, heads, allowed):
    """Pre-norm blocks. ``allowed``: B x N x N booleans (query may see key). Every attention and
    every context (the heads' outputs side by side) gets a zero leaf added, so autograd gives
    d(score)/d(attention) and d(score)/d(context) exactly."""
    layers = []
    l = 0
    while f"{prefix}.encoder.layers.{l}.layer_norm1.weight" in sd:
        p = f"{prefix}.encoder.layers.{l}"
        B, N, D = h.shape
        x = _ln(h, p + ".layer_norm1", sd)
        q, k, v = (_lin(x, f"{p}.self_attn.{n}_proj", sd).view(B, N, heads, D // heads).transpose(1, 2)
                   for n in "qkv")
        logits = (q @ k.transpose(-1, -2)) * (D // heads) ** -0.5
        A = logits.masked_fill(~allowed[:, None], float("-inf")).softmax(dim=-1)
        dA = torch.zeros_like(A, requires_grad=True)
        A = A + dA
        ctx = (A @ v).transpose(1, 2).reshape(B, N, D)
        dctx = torch.zeros_like(ctx, requires_grad=True)
        ctx = ctx + dctx
        mid = h + _lin(ctx, f"{p}.self_attn.out_proj", sd)
        z = _lin(_ln(mid, p + ".layer_norm2", sd), p + ".mlp.fc1", sd)
        out = mid + _lin(z * torch.sigmoid(1.702 * z), p + ".mlp.fc2", sd)  # quick_gelu
        layers.append(SimpleNamespace(attention=A, dA=dA, context=ctx, dctx=dctx, q=q, k=k, v=v, block_input=h,
                                      mid=mid, hidden=out))
        h, l = out, l + 1
    return layers


def clip_reference(model, pixel_values, input_ids, attention_mask=None):
    """The CLIP forward from the weights in float64: per tower its layers (attention, contexts,
    q / k / v, residual stream), the embeddings, the cosine and the score of each pair."""
    sd = {k: v.detach().double() for k, v in model.state_dict().items()}
    vc, tc = model.config.vision_config, model.config.text_config
    x = pixel_values.double()
    B = x.shape[0]
    w = sd["vision_model.embeddings.patch_embedding.weight"]
    patches = torch.nn.functional.conv2d(x, w, stride=vc.patch_size).flatten(2).transpose(1, 2)
    cls = sd["vision_model.embeddings.class_embedding"].expand(B, 1, -1)
    h = torch.cat([cls, patches], 1) + sd["vision_model.embeddings.position_embedding.weight"]
    h = _ln(h, "vision_model.pre_layrnorm", sd)
    N = h.shape[1]
    image_layers = _tower(h, "vision_model", sd, vc.num_attention_heads, torch.ones(B, N, N, dtype=torch.bool))
    pooled = _ln(image_layers[-1].hidden[:, 0], "vision_model.post_layernorm", sd)
    image_embeds = pooled @ sd["visual_projection.weight"].T

    T = input_ids.shape[1]
    t = sd["text_model.embeddings.token_embedding.weight"][input_ids] + sd["text_model.embeddings.position_embedding.weight"][:T]
    mask = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    allowed = causal[None] & mask[:, None, :]
    text_layers = _tower(t, "text_model", sd, tc.num_attention_heads, allowed)
    final = _ln(text_layers[-1].hidden, "text_model.final_layer_norm", sd)
    eos = end_of_text(model, input_ids)
    text_embeds = final[torch.arange(B), eos] @ sd["text_projection.weight"].T
    cosine = (torch.nn.functional.normalize(image_embeds, dim=-1) * torch.nn.functional.normalize(text_embeds, dim=-1)).sum(-1)
    score = cosine * sd["logit_scale"].exp()
    return SimpleNamespace(image=image_layers, text=text_layers, image_embeds=image_embeds, text_embeds=text_embeds,
                           cosine=cosine, score=score, eos=eos, sd=sd)


#: conftest.module_depth of every tiny_clip (same architecture), forward and backward, over its
#: largest token count (the image tower's 4 x 4 patches + CLS; captions are at most 12 tokens)
CLIP_DEPTH = module_depth(tiny_clip(), tokens=17, grad=True)


def clip_close(a, b) -> bool:
    """``a`` and ``b`` (tensors of the same shape) equal within ``f32_tol([a, b], CLIP_DEPTH)``: the
    allowance ``2 * CLIP_DEPTH * eps32 * max(|a|, |b|)`` for every entry (why: test_record_clip's
    docstring)."""
    a, b = a.detach().double(), b.detach().double()
    return a.shape == b.shape and torch.allclose(a, b, **f32_tol([a, b], CLIP_DEPTH))


def loop_propagate(steps, sizes, normalize=True):
    """Eq. 1-11 for one sample (index 0 of every batch dimension), with explicit loops over
    tokens and heads in float64 numpy: an independent dense implementation. ``steps``: lists
    of events whose additions are computed from the state before the step."""
    names = list(sizes)
    R = {(s, q): (np.eye(sizes[s]) if s == q else np.zeros((sizes[s], sizes[q]))) for s in names for q in names}

    def abar_of(e):
        A = e.attention.double().numpy().reshape(-1, *e.attention.shape[-3:])[0]
        G = e.grad.double().numpy().reshape(-1, *e.grad.shape[-3:])[0]
        H, n, m = A.shape
        out = np.zeros((n, m))
        for i in range(n):
            for j in range(m):
                out[i, j] = sum(max(A[h, i, j] * G[h, i, j], 0.0) for h in range(H)) / H
        return out

    def rbar(M):
        n = M.shape[0]
        out = np.eye(n)
        for i in range(n):
            row = [M[i, j] - (1.0 if i == j else 0.0) for j in range(n)]
            total = sum(row)
            for j in range(n):
                out[i, j] += row[j] / total if total > 0 else 0.0
        return out

    def matmul(X, Y):
        out = np.zeros((X.shape[0], Y.shape[1]))
        for i in range(X.shape[0]):
            for k in range(Y.shape[1]):
                out[i, k] = sum(X[i, j] * Y[j, k] for j in range(X.shape[1]))
        return out

    for step in steps:
        adds = []
        for e in step:
            if e.grad is None:
                continue
            Ab, s, q = abar_of(e), e.query, e.key
            if s == q:
                adds += [((s, x), matmul(Ab, R[s, x])) for x in names]
            else:
                Rs, Rq = (rbar(R[s, s]), rbar(R[q, q])) if normalize else (R[s, s], R[q, q])
                adds.append(((s, q), matmul(Rs.T, matmul(Ab, Rq))))
                adds.append(((s, s), matmul(Ab, R[q, s])))
        new = {k: v.copy() for k, v in R.items()}
        for k, v in adds:
            new[k] += v
        R = new
    return R


def hand_states(model, x, allowed=None):
    """timm ViT written out block by block: (h_0, [(input, mid, output)] per block), the
    attention optionally restricted to ``allowed[l]`` (N x N bool, or None) with a hand-written
    softmax over the allowed keys."""
    h = model.norm_pre(model.patch_drop(model._pos_embed(model.patch_embed(x))))
    h0, states = h, []
    for l, b in enumerate(model.blocks):
        a_in = b.norm1(h)
        attn = b.attn
        B, N, D = a_in.shape
        q, k, v = attn.qkv(a_in).reshape(B, N, 3, attn.num_heads, -1).permute(2, 0, 3, 1, 4)
        logits = (q * attn.scale) @ k.transpose(-2, -1)
        if allowed is not None and allowed[l] is not None:
            logits = logits.masked_fill(~allowed[l], float("-inf"))
        a = attn.proj((logits.softmax(-1) @ v).transpose(1, 2).reshape(B, N, D))
        mid = h + b.ls1(a)
        out = mid + b.ls2(b.mlp(b.norm2(mid)))
        states.append((h, mid, out))
        h = out
    return h0, states


def as64(model, inputs):
    """Model and inputs in float64. Answers (argmaxes) of a padded batch against a question-by-question
    loop are an exact claim only where no two logits lie within rounding of each other; in float64
    that is ~1e-12 of the logits instead of float32's ~1e-4."""
    return model.double(), {k: v.double() if v.is_floating_point() else v for k, v in inputs.items()}


def answer_logits(out):
    return out.question_answering_score if hasattr(out, "question_answering_score") else out.logits


def loop_predictions(model, inputs, maps, modality, positive, keep_end=1, steps=bf.PERTURBATION_STEPS):
    """Question by question, unpadded: delete the tokens (plain Python sort, ties to the earlier
    token) and rerun the model; returns B x S predictions and kept counts."""
    B = inputs["input_ids"].shape[0]
    preds, kept = np.zeros((B, len(steps)), int), np.zeros((B, len(steps)), int)
    for b in range(B):
        n = int(inputs["attention_mask"][b].sum())
        one = {k: v[b : b + 1, :n] if k in bf.TEXT_KEYS else v[b : b + 1] for k, v in inputs.items()}
        for j, step in enumerate(steps):
            if modality == "image":
                cand = list(range(maps.shape[1]))
            else:
                cand = list(range(1, n - keep_end))
            ranked = sorted(cand, key=lambda i: (-float(maps[b, i]), i))      # most relevant first
            k = int((1 - step) * len(cand))
            keep = sorted(ranked[len(ranked) - k:] if positive else ranked[:k])
            x = dict(one)
            if modality == "image":
                for key in bf.IMAGE_KEYS:
                    if key in x:
                        x[key] = x[key][:, keep] if keep else torch.zeros_like(x[key][:, :1])
                kept[b, j] = len(keep)
            else:
                keep = [0] + keep + list(range(n - keep_end, n))
                for key in bf.TEXT_KEYS:
                    if key in x:
                        x[key] = x[key][:, keep]
                kept[b, j] = len(keep)
            with torch.no_grad():
                preds[b, j] = int(answer_logits(model(**x)).argmax(-1))
    return preds, kept


@contextlib.contextmanager
def forwards_counted(model):
    """Counts the model's forward passes (the test's own hook, removed on exit)."""
    calls = []
    handle = model.register_forward_pre_hook(lambda mod, args: calls.append(1))
    try:
        yield calls
    finally:
        handle.remove()


@contextlib.contextmanager
def passes_counted(model, head):
    """``{"forward": n, "backward": n}`` while open: the model's forward calls and the backward passes
    through ``head`` (the test's own hooks, removed on exit)."""
    calls = {"forward": 0, "backward": 0}
    hooks = [model.register_forward_pre_hook(lambda *a: calls.__setitem__("forward", calls["forward"] + 1)),
             head.register_full_backward_hook(lambda *a: calls.__setitem__("backward", calls["backward"] + 1))]
    try:
        yield calls
    finally:
        for h in hooks:
            h.remove()


def relative_error(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per sample, ``max |a - b| / max |b|`` (float64)."""
    a, b = a.double().flatten(1), b.double().flatten(1)
    return (a - b).abs().max(1).values / b.abs().max(1).values


# --- LRP of a timm ViT written out: explicit contributions, no autograd (test_lrp, test_lrp_precision) ---
def ln(h, mod):
    """``mod`` (a LayerNorm) applied to ``h`` with its own parameters."""
    return F.layer_norm(h, mod.normalized_shape, mod.weight, mod.bias, mod.eps)


def linear_relprop(x, W, b, R, rules, absorbed):
    """Explicit contributions c[..., j, i] = x_i W_ji."""
    c = x.unsqueeze(-2) * W  # ... x out x in
    if rules == "chefer":  # alpha 1, beta 0: positive contributions over their sum
        pos = c.clamp(min=0)
        return (pos / pos.sum(-1, keepdim=True) * R.unsqueeze(-1)).sum(-2)
    y = c.sum(-1) + b  # epsilon -> 0: the z-rule, the bias keeps b / y of R
    absorbed += (b / y * R).flatten(1).sum(-1)
    return (c / y.unsqueeze(-1) * R.unsqueeze(-1)).sum(-2)


def ln_relprop(x, mod, R, rules, absorbed):
    if rules == "chefer":
        return R  # identity
    D = x.shape[-1]
    sigma = (x.var(-1, unbiased=False, keepdim=True) + mod.eps).sqrt()
    n = (x - x.mean(-1, keepdim=True)) / sigma
    y = n * mod.weight + mod.bias
    absorbed += (mod.bias / y * R).flatten(1).sum(-1)
    R_n = n * mod.weight / y * R  # the bias's z-rule share removed; times weight: identity
    C = (torch.eye(D, dtype=x.dtype) - 1.0 / D) / sigma.unsqueeze(-1)  # ... x D x D, n = C x
    c = C * x.unsqueeze(-2)  # c[..., i, j] = C_ij x_j, sums to n_i over j
    return (c / n.unsqueeze(-1) * R_n.unsqueeze(-1)).sum(-2)


def add_relprop(a, b, R, rules):
    z = a + b
    Ra, Rb = a / z * R, b / z * R
    if rules == "chefer":  # the reference's rescaling, per sample
        sa, sb, s = (t.flatten(1).sum(-1)[:, None, None] for t in (Ra, Rb, R))
        share = sa.abs() / (sa.abs() + sb.abs())
        Ra, Rb = Ra * (share * s / sa), Rb * ((1 - share) * s / sb)
    return Ra, Rb


def matmul_relprop(a, b, R):
    """z = a @ b over the last two dims: contributions a_ik b_kj, half of each to each side."""
    c = a.unsqueeze(-1) * b.unsqueeze(-3)  # ... x i x k x j
    share = c / c.sum(-2, keepdim=True) * R.unsqueeze(-2) / 2
    return share.sum(-1), share.sum(-3)


def vit_forward(model, x: torch.Tensor):
    """A timm ViT's forward written out block by block with the model's own weights (the operations
    of its modules): ``(e, x0, saved, h)``, the patch embeddings, the first block's input, per block a
    dict of every intermediate (``h n1 qkv qs k v S A O P mid n2 f1 g f2``) and the last block's
    output, before the final norm. A distilled DeiT's distillation token follows the class token.
    Runs under the caller's grad mode."""
    B = x.shape[0]
    e = model.patch_embed.proj(x).flatten(2).transpose(1, 2)
    prefix = [model.cls_token] + ([model.dist_token] if getattr(model, "dist_token", None) is not None else [])
    x0 = torch.cat([t.expand(B, -1, -1) for t in prefix] + [e], 1) + model.pos_embed
    h, saved = x0, []
    for blk in model.blocks:
        at = blk.attn
        H = at.num_heads
        n1 = ln(h, blk.norm1)
        qkv = F.linear(n1, at.qkv.weight, at.qkv.bias)
        N, D = qkv.shape[1], qkv.shape[2] // 3
        q, k, v = qkv.reshape(B, N, 3, H, D // H).permute(2, 0, 3, 1, 4)
        qs = q * at.scale
        S = qs @ k.transpose(-2, -1)
        A = S.softmax(-1)
        O = (A @ v).transpose(1, 2).reshape(B, N, D)
        P = F.linear(O, at.proj.weight, at.proj.bias)
        mid = h + P
        n2 = ln(mid, blk.norm2)
        f1 = F.linear(n2, blk.mlp.fc1.weight, blk.mlp.fc1.bias)
        g = F.gelu(f1)
        f2 = F.linear(g, blk.mlp.fc2.weight, blk.mlp.fc2.bias)
        saved.append(dict(h=h, n1=n1, qkv=qkv, qs=qs, k=k, v=v, S=S, A=A, O=O, P=P, mid=mid, n2=n2, f1=f1, g=g,
                          f2=f2))
        h = mid + f2
    return e, x0, saved, h


def eager_vit_forward(model, x, deltas=None):
    """Eager forward of a timm ViT written out from its weights: (logits, attentions, q, k).

    ``deltas[l]`` (optional) is added to block l's post-softmax attention, for finite
    differences with respect to the attention.
    """
    h = model.norm_pre(model._pos_embed(model.patch_embed(x)))
    attentions, queries, keys = [], [], []
    for l, blk in enumerate(model.blocks):
        a = blk.attn
        y = blk.norm1(h)
        B, N, _ = y.shape
        qkv = F.linear(y, a.qkv.weight, a.qkv.bias).reshape(B, N, 3, a.num_heads, -1).permute(2, 0, 3, 1, 4)
        q, k, v = a.q_norm(qkv[0]), a.k_norm(qkv[1]), qkv[2]  # B x H x N x D
        A = ((q @ k.transpose(-1, -2)) * a.scale).softmax(dim=-1)  # B x H x N x N
        if deltas is not None:
            A = A + deltas[l]
        attentions.append(A)
        queries.append(q)
        keys.append(k)
        o = (A @ v).transpose(1, 2).reshape(B, N, -1)
        h = h + blk.ls1(a.proj(a.norm(o)))
        h = h + blk.ls2(blk.mlp(blk.norm2(h)))
    return model.forward_head(model.norm(h)), attentions, queries, keys


def scene_pixels64(scenes) -> torch.Tensor:
    """The shapes scenes as the shipped models' float64 pixel values (112 x 112, their mean and std)."""
    from vitlab.shapes import scenes_to_tensor
    from vitlab.shapes.model import MEAN, STD

    return scenes_to_tensor(scenes.images, (3, 112, 112), MEAN, STD).double()


def on_object(grid_map: torch.Tensor, mask: np.ndarray, min_coverage: float) -> bool:
    """The pointing game written out: every top patch covered at least min_coverage (1e-9 below it
    still counts: the cover is a float32 share of a patch's pixels, exact for these patch sizes)."""
    from vitlab.localization import mask_to_grid

    cover = mask_to_grid(torch.as_tensor(mask[None], dtype=torch.float32), tuple(grid_map.shape))[0]
    top = grid_map == grid_map.max()
    return bool((cover[top] >= min_coverage - 1e-9).all())
