"""Swin transformers (timm and Hugging Face): windowed attention recorded into each stage's token
matrix, rollout / Chefer relevance through the stages, raw attention and the stage-aware GradCAM
(:mod:`vitlab.record.swin`, :mod:`vitlab.hierarchical`), each against a from-scratch computation
written here without vitlab's helpers: dense per-stage logits with the relative position bias and
the shift mask placed by token coordinates, merges built by loops over the 2 x 2 groups, the
full-network matrices multiplied out. Float64 where exactness is the point."""
from __future__ import annotations

import copy
import math

import pytest
import timm
import torch
import transformers

from conftest import f32_tol, f64_tol, module_depth, randomize
from vitlab.hierarchical import (
    merge_matrix, swin_asked_object_maps, swin_attention_gradients, swin_gradcam, swin_maps_from_gradients,
    swin_raw_attention, swin_relevance, swin_rollout,
)
from vitlab.record import record

pytestmark = pytest.mark.usefixtures("one_thread")

# 64 px in 4-px patches: stages at 16 x 16 (16 windows of 4 x 4, shifted by 2 in the second block),
# 8 x 8 (4 windows, shifted) and 4 x 4 (one window: no shift), joined by two merges.
IMG, PATCH, WIN, DIM, DEPTHS, HEADS, CLASSES = 64, 4, 4, 16, (2, 2, 2), (1, 2, 2), 5


def _timm_swin():
    m = timm.create_model("swin_tiny_patch4_window7_224", pretrained=False, img_size=IMG, patch_size=PATCH,
                          embed_dim=DIM, depths=DEPTHS, num_heads=HEADS, window_size=WIN, num_classes=CLASSES)
    return randomize(m, 1).double()


def _hf_swin():
    cfg = transformers.SwinConfig(image_size=IMG, patch_size=PATCH, embed_dim=DIM, depths=list(DEPTHS),
                                  num_heads=list(HEADS), window_size=WIN, num_labels=CLASSES)
    return randomize(transformers.SwinForImageClassification(cfg), 2).double()


@pytest.fixture(scope="module", params=["timm", "hf"])
def swin(request):
    return _timm_swin() if request.param == "timm" else _hf_swin()


def _x(n=3, seed=0):
    return torch.randn(n, 3, IMG, IMG, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _logits(model, x):
    out = model(x)
    return out if isinstance(out, torch.Tensor) else out.logits


def _is_hf(model):
    return hasattr(model, "config")


def _blocks(model):
    """(stage, block, attention, window-norm, bias table) per block, from the model's own modules."""
    if _is_hf(model):
        return [(s, b, b.attention, b.layernorm_before, b.attention.relative_position_bias.relative_position_bias_table)
                for s, st in enumerate(model.swin.encoder.layers) for b in st.blocks]
    return [(s, b, b.attn, b.norm1, b.attn.relative_position_bias_table)
            for s, st in enumerate(model.layers) for b in st.blocks]


def _depth(model, tokens=256):
    return module_depth(model, tokens=tokens, grad=True) + 6 * 3 * tokens


# Hugging Face's eager Swin attention takes its softmax in float32 (``softmax(..., dtype=float32)``)
# even in a float64 model: what it computes, and vitlab records, is one float32 softmax of T = 16
# keys away from the float64 reference (depth 4 T: the logits' cast, exp, the sum of T terms, the
# division). Maps built from it through the 6 blocks of up to N = 256 tokens: depth 6 (4 T + N).
HF_SOFTMAX_DEPTH, HF_MAP_DEPTH = 4 * WIN ** 2, 6 * (4 * WIN ** 2 + 256)


def _ref_tol(model, values, hf_depth):
    """Tolerance against the float64 from-scratch reference: float64 for timm, float32 rounding of
    the softmax (``hf_depth``) for Hugging Face."""
    return f32_tol(values, hf_depth) if _is_hf(model) else f64_tol(values, _depth(model))


# --- from scratch -------------------------------------------------------------------------------------
def _reference_attention(model, x):
    """Every block's attention as an N x N softmax over the stage's unshifted grid, computed densely:
    q and k of every token from the block's normed input, logits q.k / sqrt(d) + relative position
    bias (from the two tokens' coordinates inside the shifted window) + -100 where the cyclic shift
    joined tokens from different regions, and no weight at all (-inf) for pairs in different windows."""
    inputs = []
    handles = [norm.register_forward_hook(lambda m, i, o: inputs.append(o)) for _, _, _, norm, _ in _blocks(model)]
    try:
        with torch.no_grad():
            model(x)
    finally:
        for h in handles:
            h.remove()
    out = []
    grid = IMG // PATCH
    for l, (stage, block, attn, _, table) in enumerate(_blocks(model)):
        g = grid // 2 ** stage
        ws = min(WIN, g)
        shift = WIN // 2 if (l % 2 == 1 and g > WIN) else 0
        h = inputs[l].reshape(x.shape[0], g * g, -1)
        heads = HEADS[stage]
        if _is_hf(model):
            q, k = attn.q_proj(h), attn.k_proj(h)
        else:
            q, k, _ = attn.qkv(h).chunk(3, dim=-1)
        d = q.shape[-1] // heads
        q = q.reshape(x.shape[0], -1, heads, d).transpose(1, 2)
        k = k.reshape(x.shape[0], -1, heads, d).transpose(1, 2)
        logits = q @ k.transpose(-1, -2) / math.sqrt(d)
        N = g * g
        bias = torch.zeros(heads, N, N, dtype=torch.float64)
        allowed = torch.zeros(N, N, dtype=torch.bool)
        for i in range(N):
            for j in range(N):
                # coordinates in the cyclically shifted grid (token (r, c) sits at (r - shift) mod g)
                ri, ci = (i // g - shift) % g, (i % g - shift) % g
                rj, cj = (j // g - shift) % g, (j % g - shift) % g
                if (ri // ws, ci // ws) != (rj // ws, cj // ws):
                    continue
                allowed[i, j] = True
                dy, dx = ri % ws - rj % ws, ci % ws - cj % ws
                bias[:, i, j] = table[(dy + ws - 1) * (2 * ws - 1) + (dx + ws - 1)]
                if shift:
                    def region(v):
                        return 0 if v < g - ws else (1 if v < g - shift else 2)
                    if (region(ri), region(ci)) != (region(rj), region(cj)):
                        bias[:, i, j] -= 100.0
        full = (logits + bias).masked_fill(~allowed, float("-inf"))
        out.append(torch.softmax(full, dim=-1))
    return out


def _merge_by_loops(g):
    P = torch.zeros((g // 2) ** 2, g * g, dtype=torch.float64)
    for m in range((g // 2) ** 2):
        mr, mc = divmod(m, g // 2)
        for a in range(2):
            for b in range(2):
                P[m, (2 * mr + a) * g + 2 * mc + b] = 0.25
    return P


def _window_grads(model, x, target):
    """d(target logit)/d(each block's window softmax), read by hooks of this test on the modules
    (timm: the softmax module; Hugging Face: the attention weights it returns), scattered into
    N x N by loops over windows and positions."""
    model = copy.deepcopy(model)  # switched to eager attention here, the caller's model untouched
    kept = []
    if _is_hf(model):
        model.set_attn_implementation("eager")
        hooks = [attn.register_forward_hook(lambda m, i, o: kept.append(o[1])) for _, _, attn, _, _ in _blocks(model)]
    else:
        for _, _, attn, _, _ in _blocks(model):
            attn.fused_attn = False
        hooks = [attn.softmax.register_forward_hook(lambda m, i, o: kept.append(o)) for _, _, attn, _, _ in _blocks(model)]
    logits = _logits(model, x)
    grads = torch.autograd.grad(logits.gather(1, target[:, None]).sum(), kept)
    for h in hooks:
        h.remove()
    dense = []
    grid = IMG // PATCH
    for l, (stage, *_rest) in enumerate(_blocks(model)):
        g = grid // 2 ** stage
        ws = min(WIN, g)
        shift = WIN // 2 if (l % 2 == 1 and g > WIN) else 0
        B = x.shape[0]
        nw = (g // ws) ** 2
        G = torch.zeros(B, grads[l].shape[1], g * g, g * g, dtype=torch.float64)
        for b in range(B):
            for w in range(nw):
                wr, wc = divmod(w, g // ws)
                for p in range(ws * ws):
                    for q in range(ws * ws):
                        # position p of window w in the shifted grid holds the token at +shift
                        ti = ((wr * ws + p // ws + shift) % g) * g + (wc * ws + p % ws + shift) % g
                        tj = ((wr * ws + q // ws + shift) % g) * g + (wc * ws + q % ws + shift) % g
                        G[b, :, ti, tj] = grads[l][b * nw + w, :, p, q]
        dense.append(G)
    return dense


# --- recording ------------------------------------------------------------------------------------------
def _eager_copy(model):
    """The model on its eager attention path (Hugging Face: set_attn_implementation; timm Swin
    computes eager attention unless fused_attn was switched on)."""
    model = copy.deepcopy(model)
    if _is_hf(model):
        model.set_attn_implementation("eager")
    else:
        for _, _, attn, _, _ in _blocks(model):
            attn.fused_attn = False
    return model


def test_logits_unchanged_under_record(swin):
    """Recording runs the model's own eager path: the logits are those of that path. (Hugging Face's
    eager Swin attention takes its softmax in float32 even for a float64 model, so it differs from
    its SDPA path by float32 rounding: that is the model's, compared below with its own tolerance.)"""
    x = _x()
    plain = _logits(_eager_copy(swin), x)
    with record(swin) as rec:
        recorded = _logits(swin, x)
    torch.testing.assert_close(recorded, plain, **f64_tol(plain, _depth(swin)))
    assert [tuple(a.shape) for a in rec.attentions] == [(3, HEADS[s], (16 // 2 ** s) ** 2, (16 // 2 ** s) ** 2)
                                                        for s in range(3) for _ in range(2)]
    assert [c.shift for c in rec.stream()] == [(0, 0), (2, 2), (0, 0), (2, 2), (0, 0), (0, 0)]
    sdpa = _logits(swin, x)
    torch.testing.assert_close(recorded, sdpa, **(f32_tol(sdpa, _depth(swin)) if _is_hf(swin) else
                                                   f64_tol(sdpa, _depth(swin))))


def test_scattered_attention_equals_dense_windowed_softmax(swin):
    x = _x()
    with torch.no_grad(), record(swin, capture=("attention",)) as rec:
        swin(x)
    ref = _reference_attention(swin, x)
    for got, want in zip(rec.attentions, ref, strict=True):
        torch.testing.assert_close(got, want, **_ref_tol(swin, want, HF_SOFTMAX_DEPTH))
        ones = torch.ones_like(got.sum(-1))
        torch.testing.assert_close(got.sum(-1), ones, **_ref_tol(swin, ones, HF_SOFTMAX_DEPTH))


def test_recorded_gradient_is_the_window_gradient_scattered(swin):
    x, t = _x(2), torch.tensor([1, 3])
    want = _window_grads(swin, x, t)
    g = swin_attention_gradients(swin, x, t)
    for got, w in zip(g.gradients, want, strict=True):
        torch.testing.assert_close(got, w, **f64_tol(w, _depth(swin)))
    with record(swin, gradients=True) as rec:  # the record(gradients=True) path scatters the same way
        _logits(swin, x.clone().requires_grad_(True)).gather(1, t[:, None]).sum().backward()
    for got, w in zip(rec.attention_grads, want, strict=True):
        torch.testing.assert_close(got, w, **f64_tol(w, _depth(swin)))


# --- maps through the stages -------------------------------------------------------------------------
def _dense_network(mats, residual):
    """The full-network matrix S_3 P_2 S_2 P_1 S_1 (N_3 x N_1) multiplied out, per sample."""
    total = None
    for s in range(3):
        g = 16 // 2 ** s
        S = torch.eye(g * g, dtype=torch.float64).expand(mats[0].shape[0], -1, -1)
        for M in mats[2 * s: 2 * s + 2]:
            S = ((torch.eye(g * g, dtype=torch.float64) + M) if residual else M) @ S
        total = S if total is None else S @ _merge_by_loops(2 * g) @ total
    return total


def test_rollout_and_relevance_equal_the_dense_network_product(swin):
    x, t = _x(2), torch.tensor([0, 4])
    A = _reference_attention(swin, x)
    G = _window_grads(swin, x, t)
    roll = [(0.5 * a.mean(1) + 0.5 * torch.eye(a.shape[-1], dtype=torch.float64)) for a in A]
    roll = [r / r.sum(-1, keepdim=True) for r in roll]
    want_roll = _dense_network(roll, residual=False).mean(1).reshape(2, 16, 16)
    abar = [(g * a).clamp(min=0).mean(1) for a, g in zip(A, G)]
    want_rel = _dense_network(abar, residual=True).mean(1).reshape(2, 16, 16)
    got_roll, got_rel = swin_rollout(swin, x), swin_relevance(swin, x, t)
    torch.testing.assert_close(got_roll, want_roll, **_ref_tol(swin, want_roll, HF_MAP_DEPTH))
    torch.testing.assert_close(got_rel, want_rel, **_ref_tol(swin, want_rel, HF_MAP_DEPTH))
    torch.testing.assert_close(got_roll.sum((1, 2)), torch.ones(2, dtype=torch.float64), **f64_tol(1.0, 2000))


def test_raw_attention_and_gradcam_from_scratch(swin):
    x, t = _x(2), torch.tensor([2, 1])
    A = _reference_attention(swin, x)
    want_raw = A[-1].mean(1).mean(1).reshape(2, 4, 4)
    torch.testing.assert_close(swin_raw_attention(swin, x), want_raw, **_ref_tol(swin, want_raw, HF_SOFTMAX_DEPTH))
    # GradCAM on stage 1 and 2 outputs: hooks of this test on the last block of the stage, on the
    # model's eager path (the one a recording runs)
    eager = _eager_copy(swin)
    for stage in (1, 2):
        block = [b for s, b, *_ in _blocks(eager) if s == stage][-1]
        kept = []
        h = block.register_forward_hook(lambda m, i, o: kept.append(o[0] if isinstance(o, tuple) else o))
        try:
            score = _logits(eager, x).gather(1, t[:, None]).sum()
        finally:
            h.remove()
        F = kept[0].reshape(2, -1, kept[0].shape[-1])
        dF = torch.autograd.grad(score, kept[0])[0].reshape(F.shape)
        g = 16 // 2 ** stage
        want = torch.relu((F * dF.mean(1, keepdim=True)).sum(-1)).reshape(2, g, g)
        got = swin_gradcam(swin, x, t, stage=stage)
        torch.testing.assert_close(got, want, **f64_tol(want, _depth(swin)))


def test_merge_matrix_is_the_mean_of_the_two_by_two_group():
    torch.testing.assert_close(merge_matrix((8, 8), dtype=torch.float64), _merge_by_loops(8))
    P = merge_matrix((3, 5), dtype=torch.float64)   # odd borders: fewer children, still rows of mean
    assert P.shape == (2 * 3, 15) and torch.allclose(P.sum(1), torch.ones(6, dtype=torch.float64))
    assert P[5].nonzero().flatten().tolist() == [14]  # the corner token alone


def test_batch_equals_items(swin):
    x, t = _x(3), torch.tensor([0, 2, 4])
    g = swin_attention_gradients(swin, x, t)
    batch = swin_maps_from_gradients(g)
    for i in range(3):
        item = swin_maps_from_gradients(swin_attention_gradients(swin, x[i:i + 1], t[i:i + 1]))
        for name, m in batch.items():
            torch.testing.assert_close(m[i:i + 1], item[name], **f64_tol(m, _depth(swin)), msg=name)
    asked = swin_asked_object_maps(swin, x, torch.tensor([[0, 1], [2, 3], [4, 0]]), batch_size=2)
    one = swin_maps_from_gradients(swin_attention_gradients(swin, x[2:3], torch.tensor([0])))
    for name in one:
        torch.testing.assert_close(asked[name][2, 1], one[name][0], **f64_tol(one[name], _depth(swin)), msg=name)


def _state(model):
    return {
        "params": {k: v.clone() for k, v in model.state_dict().items()},
        "grad": [(n, p.requires_grad, p.grad) for n, p in model.named_parameters()],
        "modes": [m.training for m in model.modules()],
        "hooks": [(len(m._forward_hooks), len(m._forward_pre_hooks), len(m._backward_hooks)) for m in model.modules()],
        "fused": [getattr(m, "fused_attn", None) for m in model.modules()],
        "impl": [getattr(m.config, "_attn_implementation", None) for m in model.modules() if hasattr(m, "config")],
    }


def test_model_left_unchanged(swin):
    swin.train()
    try:
        before = _state(swin)
        x, t = _x(2), torch.tensor([1, 1])
        swin_relevance(swin, x, t)
        swin_rollout(swin, x)
        swin_gradcam(swin, x, t)
        swin_raw_attention(swin, x)
        after = _state(swin)
    finally:
        swin.eval()
    assert before["params"].keys() == after["params"].keys()
    assert all(torch.equal(before["params"][k], after["params"][k]) for k in before["params"])
    for key in ("grad", "modes", "hooks", "fused", "impl"):
        assert before[key] == after[key], key


@pytest.mark.parametrize("method", [swin_relevance, swin_rollout, swin_gradcam, swin_raw_attention])
def test_bad_input_refused_before_the_forward(swin, method):
    calls = []
    h = swin.register_forward_pre_hook(lambda *a: calls.append(1))
    try:
        bad = _x(2)
        bad[1, 0, 3, 3] = float("nan")
        with pytest.raises(ValueError, match="NaN or infinite"):
            method(swin, bad)
        with pytest.raises(ValueError, match="empty batch"):
            method(swin, _x(1)[:0])
    finally:
        h.remove()
    assert not calls


def test_not_a_swin_and_untiled_grid_refused():
    vit = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, num_classes=3).eval()
    with pytest.raises(TypeError, match="Swin transformers"):
        swin_relevance(vit, torch.zeros(1, 3, 32, 32))
    # 48 px in 4-px patches: a 12 x 12 first stage that 8 x 8 windows do not tile (the model pads it)
    m = timm.create_model("swin_tiny_patch4_window7_224", pretrained=False, img_size=48, embed_dim=16,
                          depths=(2, 2), num_heads=(1, 2), window_size=8, num_classes=3).eval()
    before = _state(m)
    with pytest.raises(ValueError, match="do not tile"):
        swin_rollout(m, torch.zeros(1, 3, 48, 48))
    after = _state(m)
    for key in ("grad", "modes", "hooks", "fused"):
        assert before[key] == after[key], key


def test_vit_methods_point_a_swin_to_vitlab_hierarchical():
    from vitlab.rollout import rollout

    with pytest.raises(TypeError, match="vitlab.hierarchical"):
        rollout(_hf_swin(), _x(1))


def test_queries_keys_values_in_unshifted_token_order(swin):
    """rec.queries / keys / values: B x heads x N x d in the stage's row-major token order (the
    window partition and the shift undone), against q, k, v computed from the block's normed input."""
    x = _x(2)
    inputs = []
    hooks = [norm.register_forward_hook(lambda m, i, o: inputs.append(o)) for _, _, _, norm, _ in _blocks(swin)]
    try:
        with torch.no_grad(), record(swin, capture=("query", "key", "value")) as rec:
            swin(x)
    finally:
        for h in hooks:
            h.remove()
    for l, (stage, _, attn, _, _) in enumerate(_blocks(swin)):
        h = inputs[l].reshape(2, -1, inputs[l].shape[-1])
        if _is_hf(swin):
            q, k, v = attn.q_proj(h), attn.k_proj(h), attn.v_proj(h)
        else:
            q, k, v = attn.qkv(h).chunk(3, dim=-1)
        for got, want in zip((rec.queries[l], rec.keys[l], rec.values[l]), (q, k, v)):
            want = want.reshape(2, h.shape[1], HEADS[stage], -1).transpose(1, 2)
            torch.testing.assert_close(got, want, **f64_tol(want, _depth(swin)))


def test_shapes_swin_loads_offline_and_records():
    import vitlab

    model = vitlab.load_model("shapes-swin")
    assert not model.training and model.pretrained_cfg["multi_label"]
    scenes = vitlab.shapes.make_scenes(2, seed=3, n_objects=2)
    x = vitlab.shapes.scenes_to_tensor(scenes.images, model.pretrained_cfg["input_size"],
                                       model.pretrained_cfg["mean"], model.pretrained_cfg["std"])
    rel = swin_relevance(model, x, torch.as_tensor(scenes.labels[:, 0]))
    assert rel.shape == (2, 14, 14) and torch.isfinite(rel).all()
