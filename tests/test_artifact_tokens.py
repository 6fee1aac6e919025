"""token_norms (high-norm "artifact" tokens, Darcet et al. 2024) and exchange_score (Q/K).

The norms are checked against a hook-free forward through ``model.blocks``; the cross-region
score against hand-built channels and numpy's correlation.
"""
import numpy as np
import pytest
import torch
from timm.models.vision_transformer import VisionTransformer

from conftest import TINY_DEPTH, f32_tol, f64_tol

# a norm (over 48 channels) of the tiny ViT's residual stream
NORM_DEPTH = TINY_DEPTH + 48
from vitlab.attention import TokenNorms, exchange_score, token_norms
from tiny_models import tiny_vit

pytestmark = pytest.mark.usefixtures("one_thread")


def manual_hidden_states(model: VisionTransformer, x: torch.Tensor) -> list[torch.Tensor]:
    """The residual stream leaving each block, by running timm's layers one by one (no hooks)."""
    with torch.no_grad():
        h = model.norm_pre(model.patch_drop(model._pos_embed(model.patch_embed(x))))
        out = []
        for block in model.blocks:
            h = block(h)
            out.append(h)
    return out


@pytest.mark.parametrize("kw", [{}, dict(reg_tokens=2, img_size=(32, 48))])
def test_norms_equal_a_manual_forward_through_the_blocks(kw):
    # float64: the flags compare norms with 3 x the median, exact only away from rounding ties
    model = tiny_vit(3, **kw).double()
    x = torch.randn(2, 3, *model.patch_embed.img_size, dtype=torch.float64)
    tn = token_norms(model, x)
    P = model.num_prefix_tokens
    gh, gw = model.patch_embed.grid_size
    hidden = manual_hidden_states(model, x)
    expected = torch.stack([h[:, P:].norm(dim=-1).reshape(2, gh, gw) for h in hidden], dim=1)
    assert isinstance(tn, TokenNorms) and tn.blocks == [0, 1, 2] and tn.ratio == 3.0
    assert tn.norms.shape == (2, 3, gh, gw)
    torch.testing.assert_close(tn.norms, expected, **f64_tol(expected, NORM_DEPTH))
    # the rule, computed independently with numpy: norm > ratio * the image's median in that block
    e = expected.numpy().reshape(2, 3, -1)
    flags = e > 3.0 * np.median(e, axis=-1, keepdims=True)
    assert np.array_equal(tn.high.numpy().reshape(2, 3, -1), flags)


def test_a_planted_bright_patch_is_the_one_flagged():
    model = tiny_vit(4)
    x = torch.randn(1, 3, 32, 32) * 0.1
    x[0, :, 8:16, 16:24] = 50.0  # patch (row 1, column 2) of the 4 x 4 grid
    tn = token_norms(model, x, blocks=[-1])
    assert tn.blocks == [2]
    high = tn.high[0, 0]
    assert high[1, 2] and int(high.sum()) == 1
    assert tn.norms[0, 0].flatten().argmax() == 1 * 4 + 2


def test_block_selection_and_ratio():
    model = tiny_vit(5)
    x = torch.randn(2, 3, 32, 32)
    everything = token_norms(model, x)
    some = token_norms(model, x, blocks=[-1, 0], ratio=1.5)
    assert some.blocks == [2, 0]
    torch.testing.assert_close(some.norms, everything.norms[:, [2, 0]], **f32_tol(everything.norms, NORM_DEPTH))
    median = everything.norms[:, [2, 0]].flatten(2).median(-1).values[..., None, None]
    assert torch.equal(some.high, everything.norms[:, [2, 0]] > 1.5 * median)
    with pytest.raises(ValueError, match="ratio must be a number > 1"):
        token_norms(model, x, ratio=1.0)
    with pytest.raises(ValueError, match=r"blocks must be a list .* write \[1\]"):
        token_norms(model, x, blocks=1)
    with pytest.raises(ValueError, match=r"block must be an int in \[0, 3\)"):
        token_norms(model, x, blocks=[3])


def test_batch_equals_items_one_by_one():
    model = tiny_vit(6).double()  # float64: the flags are thresholds (see above)
    x = torch.randn(3, 3, 32, 32, dtype=torch.float64)
    batch = token_norms(model, x, ratio=1.2)
    for b in range(3):
        item = token_norms(model, x[b:b + 1], ratio=1.2)
        torch.testing.assert_close(batch.norms[b:b + 1], item.norms, **f64_tol(batch.norms, NORM_DEPTH))
        assert torch.equal(batch.high[b:b + 1], item.high)


def test_the_model_is_left_unchanged_and_train_mode_gives_the_eval_norms():
    model = tiny_vit(7)
    model.blocks[1].train()  # an odd mix of modes, with dropout that would change the norms
    model.blocks[1].attn.attn_drop.p = 0.5
    model.blocks[1].attn.proj_drop.p = 0.5
    x = torch.randn(2, 3, 32, 32)
    params = [p.detach().clone() for p in model.parameters()]
    modes = [(n, m.training) for n, m in model.named_modules()]
    fused = [(n, m.fused_attn) for n, m in model.named_modules() if hasattr(m, "fused_attn")]
    tn = token_norms(model, x)
    assert [(n, m.training) for n, m in model.named_modules()] == modes
    assert [(n, m.fused_attn) for n, m in model.named_modules() if hasattr(m, "fused_attn")] == fused
    assert all(torch.equal(a, b) for a, b in zip(params, model.parameters()))
    assert sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules()) == 0
    assert not tn.norms.requires_grad
    model.eval()
    expected = torch.stack([h[:, 1:].norm(dim=-1).reshape(2, 4, 4) for h in manual_hidden_states(model, x)], 1)
    torch.testing.assert_close(tn.norms, expected, **f32_tol(expected, NORM_DEPTH))


# --- exchange_score -----------------------------------------------------------------
def test_exchange_score_on_hand_built_channels():
    # 4 patches x 5 channels; the query is positive on patches 0, 1 (region A), negative on 2, 3 (B)
    q = torch.tensor([[1.0, 1, 1, 1, 2], [2, 2, 1, 1, 3], [-1, -1, 1, 1, 1], [-3, -3, 1, 1, 4]])
    k = torch.tensor([[4.0, 6, -1, 2, 5], [4, 6, -2, 2, 5], [6, 4, 3, 2, 5], [6, 4, 4, 2, 5]])
    s = exchange_score(q, k)
    assert s[0].item() == pytest.approx(1.0)  # key low on A, high on B (an offset of 5 changes nothing)
    assert s[1].item() == pytest.approx(-1.0)  # key high on A: each region attends to itself
    assert s[2].item() == pytest.approx(0.0)  # query of one sign everywhere: one-way, not two regions
    assert s[3].item() == pytest.approx(0.0)  # constant key: changes no attention weight
    assert s[4].item() == pytest.approx(0.0)  # both


def test_exchange_score_is_minus_numpys_correlation_of_the_query_sign_with_the_key():
    g = torch.Generator().manual_seed(3)
    q, k = torch.randn(2, 3, 50, 7, generator=g), torch.randn(2, 3, 50, 7, generator=g)
    s = exchange_score(q, k)
    assert s.shape == (2, 3, 7)
    for idx in np.ndindex(2, 3, 7):
        a, b, c = idx
        r = np.corrcoef(np.sign(q[a, b, :, c].numpy()), k[a, b, :, c].numpy())[0, 1]
        # a float32 correlation over 50 patches (means, products, norms) against numpy's float64
        assert s[idx].item() == pytest.approx(-r, abs=f32_tol(1.0, 4 * 50)["atol"])
    # invariant: rescaling the query per patch by positive factors, or shifting the key, changes nothing
    # (the shift rounds k + 3, ~4x the key's own rounding)
    torch.testing.assert_close(exchange_score(q * (torch.rand(q.shape, generator=g) + 0.1), k + 3.0), s,
                               **f32_tol(1.0, 4 * 50 * 4))


def test_a_exchange_channel_routes_each_region_to_the_other():
    # one channel on its own: softmax_j(q_i k_j) must put most of row i on the other region
    q = torch.tensor([[2.0], [1.5], [-1.0], [-2.5], [-0.5]])
    k = torch.tensor([[-1.0], [-2.0], [1.5], [1.0], [2.0]])
    assert exchange_score(q, k).item() > 0.9
    rows = (q @ k.T).softmax(-1)
    region = q[:, 0] > 0
    other = (rows * (region[None, :] != region[:, None])).sum(-1)
    assert bool((other > 0.5).all())


# --- two_flow_score (the blog's second pattern) -------------------------------------------
def _two_flow_by_hand(q: list[float], k: list[float]) -> float:
    """The score's definition, one channel, in plain Python."""
    P = len(q)
    m = 1.0 if sum(q) > 0 else -1.0
    u_q = abs(sum(q)) / sum(abs(v) for v in q)
    f_k = sum(1 for v in k if v * m > 0) / P
    one_way = u_q * (1 - f_k) if f_k > 0 else 0.0
    gather = [i for i, v in enumerate(q) if v * m < 0]
    if not gather:
        return 0.0
    overlap = sum(1 for i in gather if k[i] * m > 0) / len(gather)
    return one_way * 2 * len(gather) / P * (1 - overlap)


def test_two_flow_score_separates_the_blogs_pattern_from_one_way_exchange_and_same_region():
    from vitlab.attention import one_way_score, same_region_score, two_flow_score
    # 10 patches: 0-1 the plane's top, 2-3 its bottom, 4-9 the surroundings
    blog_q = [-1.0, -1, 1, 1, -1, -1, -1, -1, -1, -1]     # positive on the bottom
    blog_k = [-1.0, -1, 0.2, 0.1, 1, 1, 1, 1, 1, 1]      # negative on the top, positive around
    region = [1.0, 1, 1, 1, -1, -1, -1, -1, -1, -1]
    cases = {"blog": (blog_q, blog_k), "exchange": (region, [-v for v in region]),
             "one_way": ([1.0] * 10, [1.0, 1] + [-1.0] * 8), "same_region": (region, region)}
    q = torch.tensor([c[0] for c in cases.values()]).T          # P x D
    k = torch.tensor([c[1] for c in cases.values()]).T
    s = dict(zip(cases, two_flow_score(q, k).tolist()))
    tol = f32_tol(1.0, 4 * 10)["atol"]  # float32 sums, counts and ratios over 10 patches
    for name, (qq, kk) in cases.items():
        assert s[name] == pytest.approx(_two_flow_by_hand(qq, kk), abs=tol)
    assert s["blog"] == pytest.approx((6 / 10) * (1 - 2 / 10) * (2 * 2 / 10), abs=tol)  # u_q 0.6, f_k 0.2, |Q| = 2
    assert s["one_way"] == 0.0 and s["exchange"] == 0.0     # no gathering queries / they sit on the broadcasting keys
    assert s["blog"] > s["same_region"] and exchange_score(q, k)[1].item() == pytest.approx(1.0, abs=tol)
    # the broadcast part is the one-way score, and a same-region channel correlates instead
    assert one_way_score(q, k)[0].item() == pytest.approx(0.48, abs=tol)
    assert same_region_score(q, k)[3].item() == pytest.approx(1.0, abs=tol)


def test_two_flow_score_matches_the_definition_on_random_channels_with_batch_dims():
    from vitlab.attention import two_flow_score
    g = torch.Generator().manual_seed(5)
    q, k = torch.randn(2, 3, 12, 4, generator=g, dtype=torch.float64), torch.randn(2, 3, 12, 4, generator=g, dtype=torch.float64)
    s = two_flow_score(q, k)
    assert s.shape == (2, 3, 4) and (s >= 0).all() and (s < 1).all()
    for idx in np.ndindex(2, 3, 4):
        a, b, c = idx
        assert s[idx].item() == pytest.approx(_two_flow_by_hand(q[a, b, :, c].tolist(), k[a, b, :, c].tolist()),
                                              abs=f64_tol(1.0, 4 * 12)["atol"])  # float64 over 12 patches
