"""vitlab.projection.remove_tokens (an explicit set of tokens removed, Vilas et al. 2023 RQ3) and
output_similarity (the class-free counterpart of the projection): against hand-written forwards
in float64, known answers and invariants."""
import copy

import pytest
import torch
import torch.nn.functional as F
from timm.models.vision_transformer import VisionTransformer

from conftest import assert_model_unchanged, f32_tol, f64_tol, model_snapshot, randomize, TINY, TINY_DEPTH
from vitlab import projection as P
from vitlab.localization import grow_masks
from references import hand_states

pytestmark = pytest.mark.usefixtures("one_thread")


def _vit64(vit):
    return copy.deepcopy(vit).double()


# ------------------------------------------------------------------ remove_tokens
def test_remove_tokens_equals_hand_masked_forward(vit, x):
    """The logits equal a float64 hand forward whose CLS and tokens may not attend to the
    removed tokens (an additive -inf on their keys), sample by sample."""
    g = torch.Generator().manual_seed(3)
    removed = torch.rand(x.shape[0], 16, generator=g) < 0.4
    out = P.remove_tokens(vit, x, removed, target=0)
    m64 = _vit64(vit)
    for b in range(x.shape[0]):
        allowed = torch.ones(17, 17, dtype=torch.bool)
        allowed[:, 1:] = ~removed[b]
        with torch.no_grad():
            h, _ = None, None
            _, states = hand_states(m64, x[b:b + 1].double(), [allowed] * TINY["depth"])
            ref = m64.head(m64.fc_norm(m64.norm(states[-1][2][:, 0])))
        torch.testing.assert_close(out.logits[b:b + 1].double(), ref, **f32_tol(ref, TINY_DEPTH))
    assert out.removed.shape == (x.shape[0], 16) and torch.equal(out.removed, removed)


def test_remove_tokens_equals_token_removal_on_its_choice(vit, x):
    """token_removal is remove_tokens on the tokens its ranking puts first (the same forward)."""
    ranking = torch.randn(x.shape[0], 16, generator=torch.Generator().manual_seed(5))
    by_rank = P.token_removal(vit, x, ranking, 0.3, target=1)
    by_set = P.remove_tokens(vit, x, by_rank.removed.cpu(), target=1)
    assert int(by_rank.removed[0].sum()) == 5
    torch.testing.assert_close(by_set.logits, by_rank.logits, rtol=0, atol=0)
    assert torch.equal(by_set.correct, by_rank.correct)


def test_remove_tokens_nothing_and_grid_shape(vit, x):
    none = P.remove_tokens(vit, x, torch.zeros(x.shape[0], 4, 4, dtype=torch.bool))
    with torch.no_grad():
        logits = vit(x)
    torch.testing.assert_close(none.logits, logits, **f32_tol(logits, TINY_DEPTH))
    assert torch.equal(none.target, logits.argmax(-1)) and bool(none.correct.all())


def test_removed_patch_pixels_no_longer_matter_on_a_patchify_stem(vit, x):
    """With a one-convolution (patchify) stem a token reads only its own patch: once token 5 is
    removed, the output ignores that patch's pixels (and does not when it is kept)."""
    removed = torch.zeros(x.shape[0], 16, dtype=torch.bool)
    removed[:, 5] = True                                     # patch row 1, column 1: pixels 8..15
    x2 = x.clone()
    x2[:, :, 8:16, 8:16] = torch.randn(x.shape[0], 3, 8, 8, generator=torch.Generator().manual_seed(9))
    a, b = P.remove_tokens(vit, x, removed, 0), P.remove_tokens(vit, x2, removed, 0)
    torch.testing.assert_close(a.logits, b.logits, **f32_tol([a.logits, b.logits], TINY_DEPTH))
    kept = torch.zeros_like(removed)
    c, d = P.remove_tokens(vit, x, kept, 0), P.remove_tokens(vit, x2, kept, 0)
    assert float((c.logits - d.logits).abs().max()) > 1e-2


def test_grown_removal_set_is_the_neighbourhood():
    """grow_masks on the token grid with margin 1 adds the 8 neighbours (clipped at the edge)."""
    m = torch.zeros(1, 4, 4)
    m[0, 0, 0] = 1
    m[0, 2, 2] = 1
    grown = grow_masks(m, 1).bool()
    expected = torch.zeros(1, 4, 4, dtype=torch.bool)
    expected[0, 0:2, 0:2] = True
    expected[0, 1:4, 1:4] = True
    assert torch.equal(grown, expected)


def test_remove_tokens_refusals(vit, x):
    with pytest.raises(ValueError, match="bool tensor"):
        P.remove_tokens(vit, x, torch.zeros(x.shape[0], 16))                  # not bool
    with pytest.raises(ValueError, match="bool tensor"):
        P.remove_tokens(vit, x, torch.zeros(x.shape[0], 15, dtype=torch.bool))
    bad = x.clone()
    bad[0, 0, 0, 0] = float("nan")
    with pytest.raises(ValueError):
        P.remove_tokens(vit, bad, torch.zeros(x.shape[0], 16, dtype=torch.bool))
    no_cls = randomize(VisionTransformer(**{**TINY, "class_token": False, "global_pool": "avg"}), 1)
    with pytest.raises(ValueError, match="prefix token"):
        P.remove_tokens(no_cls, x, torch.zeros(x.shape[0], 16, dtype=torch.bool))


def test_remove_tokens_leaves_the_model_as_it_was(x):
    vit = randomize(VisionTransformer(**TINY), 0).train()
    before = model_snapshot(vit)
    P.remove_tokens(vit, x, torch.ones(x.shape[0], 16, dtype=torch.bool))
    assert_model_unchanged(vit, before)
    assert vit.training


# ------------------------------------------------------------------ output_similarity
def test_output_similarity_equals_hand_cosine_in_float64(vit, x):
    m64, x64 = _vit64(vit), x.double()
    sim = P.output_similarity(m64, x64)
    with torch.no_grad():
        _, states = hand_states(m64, x64)
        h = torch.stack([m64.norm(s[2]) for s in states], 1)                 # B x L x N x D
        ref = torch.empty(h.shape[:3], dtype=torch.float64)
        for b in range(h.shape[0]):
            final = h[b, -1, 0]
            for l in range(h.shape[1]):
                for n in range(h.shape[2]):
                    v = h[b, l, n]
                    ref[b, l, n] = (v @ final) / (v.norm() * final.norm())
    assert sim.shape == (x.shape[0], TINY["depth"], 17)
    torch.testing.assert_close(sim, ref, **f64_tol(1.0, TINY_DEPTH))
    torch.testing.assert_close(sim[:, -1, 0], torch.ones(x.shape[0], dtype=torch.float64), rtol=0, atol=1e-12)
    # the float32 model: same numbers to float32 rounding
    torch.testing.assert_close(P.output_similarity(vit, x).double(), ref, **f32_tol(1.0, TINY_DEPTH))


def test_output_similarity_batch_equals_items_and_needs_no_head(x):
    headless = randomize(VisionTransformer(**{**TINY, "num_classes": 0}), 4)
    sim = P.output_similarity(headless, x)
    for b in range(x.shape[0]):
        one = P.output_similarity(headless, x[b:b + 1])
        torch.testing.assert_close(sim[b:b + 1], one, **f32_tol(1.0, TINY_DEPTH))
    assert bool((sim.abs() <= 1 + 1e-5).all())


def test_output_similarity_refusals_and_model_unchanged(x):
    pooled = randomize(VisionTransformer(**{**TINY, "global_pool": "avg"}), 1)
    with pytest.raises(ValueError, match="pools the patch tokens"):
        P.output_similarity(pooled, x)
    vit = randomize(VisionTransformer(**TINY), 0).train()
    before = model_snapshot(vit)
    bad = x.clone()
    bad[1, 2, 3, 4] = float("inf")
    with pytest.raises(ValueError):
        P.output_similarity(vit, bad)
    P.output_similarity(vit, x)
    assert_model_unchanged(vit, before)
    assert vit.training
