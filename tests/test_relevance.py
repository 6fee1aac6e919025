"""vitlab.relevance: Chefer, Gur & Wolf (ICCV 2021) eq. 1-11, against hand-built cases and loops.

The end-to-end check on a Hugging Face ViT takes its attentions from the model's own eager
``output_attentions`` and its gradients from autograd, independent of vitlab.record.
"""
from __future__ import annotations

import numpy as np
import pytest
import timm
import torch
from timm.models.deit import VisionTransformerDistilled

from vitlab.attention import attention_gradients
from vitlab.relevance import (
    AttentionEvent,
    Relevances,
    bimodal_rule,
    chefer_relevance,
    head_averaged_relevance,
    initial_relevances,
    normalized_self_relevance,
    propagate,
    read_rows,
    relevance_matrix,
    relevance_row,
    self_attention_events,
    self_attention_rule,
)

from conftest import (
    EPS64, TINY, TINY_DEPTH, TINY_GRAD_DEPTH, decided_argmax, f32_rel, f32_tol, f32_tol_deep, f64_tol, module_depth,
    randomize as _randomize,
)
from references import loop_propagate
pytestmark = pytest.mark.usefixtures("one_thread")

# Chefer relevance of the tiny ViT: its forward and backward, then per block a mean over 3 heads
# and a product over 17 tokens
MAP_DEPTH = TINY_GRAD_DEPTH + 3 * (3 + 17)


def np_relevance(attentions, gradients, prefix, grid, rows=(0,)):
    """Eq. 5-6 with explicit loops over samples, heads and blocks: R[CLS, patches] on the grid (the
    mean of the given rows: a distilled DeiT's two heads read rows 0 and 1)."""
    A = [a.double().numpy() for a in attentions]
    G = [g.double().numpy() for g in gradients]
    B, H, N, _ = A[0].shape
    maps = []
    for b in range(B):
        R = np.eye(N)
        for l in range(len(A)):
            Abar = np.zeros((N, N))
            for h in range(H):
                Abar += np.maximum(G[l][b, h] * A[l][b, h], 0) / H
            R = R + Abar @ R
        maps.append((sum(R[i, prefix:] for i in rows) / len(rows)).reshape(grid))
    return np.stack(maps)


# --- the update rules -----------------------------------------------------------------------
def test_eq5_clamps_each_head_before_averaging():
    A = torch.tensor([[[[0.5, 0.5]], [[0.5, 0.5]]]])  # B=1, H=2, 1 x 2
    G = torch.tensor([[[[2.0, -1]], [[-2, 1]]]])
    # head 0: [1, -0.5] -> [1, 0]; head 1: [-1, 0.5] -> [0, 0.5]; mean: [0.5, 0.25]
    assert torch.allclose(head_averaged_relevance(A, G), torch.tensor([[[0.5, 0.25]]]))
    # averaging first would cancel to [0, 0]: the order matters
    assert torch.allclose((G * A).mean(dim=1).clamp(min=0), torch.zeros(1, 1, 2))


def test_eq6_two_blocks_by_hand():
    A1 = torch.tensor([[0.0, 1], [0, 0]])
    A2 = torch.tensor([[0.5, 0], [0, 0]])
    R1 = self_attention_rule(torch.eye(2), A1)
    assert R1.tolist() == [[1.0, 1.0], [0.0, 1.0]]
    R2 = self_attention_rule(R1, A2)  # R1 + A2 @ R1
    assert R2.tolist() == [[1.5, 1.5], [0.0, 1.0]]
    # eq. 7: the same rule on a non-square R^{sq} (2 tokens s x 3 tokens q), batched
    Rsq = torch.arange(12.0).reshape(2, 2, 3)
    Abar = torch.tensor([[[1.0, 0], [0, 0]], [[0, 0], [1, 0]]])
    out = self_attention_rule(Rsq, Abar)
    assert out[0].tolist() == [[0.0, 2, 4], [3, 4, 5]]  # s0 gains its own row again
    assert out[1].tolist() == [[6.0, 7, 8], [9 + 6, 10 + 7, 11 + 8]]  # s1 gains s0's row


def test_relevance_matrix_equals_the_loop():
    g = torch.Generator().manual_seed(0)
    A = [torch.rand(2, 3, 5, 5, generator=g).softmax(-1) for _ in range(3)]
    G = [torch.randn(2, 3, 5, 5, generator=g) for _ in range(3)]
    R = relevance_matrix(A, G)
    assert R.shape == (2, 5, 5)
    # sums of non-negative terms: each entry to its own digits (3 blocks: 3 heads, products over 5)
    assert np.allclose(R[:, 0, 2:].numpy(), np_relevance(A, G, 2, (3,)), **f32_rel(3 * (3 + 5)))
    assert torch.all(torch.diagonal(R, dim1=-2, dim2=-1) >= 1)  # I plus non-negative terms
    for i in (0, 4):
        assert torch.allclose(relevance_row(A, G, index=i), R[:, i], **f32_rel(3 * (3 + 5)))


# --- chefer_relevance on models ----------------------------------------------------------------
def test_chefer_relevance_equals_the_formula(vit, x):
    target = [3, 3, 0]
    ag = attention_gradients(vit, x, target)
    out = chefer_relevance(vit, x, target)
    assert out.shape == (3, 4, 4)
    expected = np_relevance(ag.attentions, ag.gradients, 1, (4, 4))
    assert np.allclose(out.numpy(), expected, **f32_tol(expected, MAP_DEPTH))
    assert (out > 0).any()


def test_chefer_relevance_of_a_hugging_face_vit_matches_its_own_eager_attentions():
    from transformers import ViTConfig, ViTForImageClassification

    cfg = ViTConfig(image_size=32, patch_size=8, hidden_size=48, num_hidden_layers=2, num_attention_heads=3,
                    intermediate_size=96, num_labels=5)
    model = _randomize(ViTForImageClassification(cfg), 5)  # default SDPA attention
    eager = ViTForImageClassification._from_config(cfg, attn_implementation="eager").eval()
    eager.load_state_dict(model.state_dict())
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    out = eager(x, output_attentions=True)
    grads = torch.autograd.grad(out.logits[0, 1] + out.logits[1, 4], out.attentions)
    expected = np_relevance([a.detach() for a in out.attentions], grads, 1, (4, 4))
    assert np.allclose(chefer_relevance(model, x, [1, 4]).numpy(), expected,
                       **f32_tol(expected, module_depth(model, tokens=17, grad=True) + 2 * (3 + 17)))


def test_chefer_relevance_reads_prefix_and_grid_from_the_model():
    model = _randomize(VisionTransformerDistilled(**{**TINY, "img_size": (48, 32)}), 3)  # CLS + dist, 6 x 4
    x = torch.randn(2, 3, 48, 32)
    ag = attention_gradients(model, x, 2)
    out = chefer_relevance(model, x, 2)
    assert out.shape == (2, 6, 4)
    # its logits average a head on the CLS token and one on the distillation token: both rows, halved
    expected = np_relevance(ag.attentions, ag.gradients, 2, (6, 4), rows=(0, 1))
    assert np.allclose(out.numpy(), expected, **f32_tol(expected, module_depth(model, tokens=26, grad=True) + 3 * (3 + 26)))


def test_chefer_relevance_on_deit_tiny():
    model = timm.create_model("deit_tiny_patch16_224", pretrained=False).eval()
    x = torch.randn(2, 3, 224, 224, generator=torch.Generator().manual_seed(2))
    ag = attention_gradients(model, x, [10, 999])
    out = chefer_relevance(model, x, [10, 999])
    assert out.shape == (2, 14, 14)
    expected = np_relevance(ag.attentions, ag.gradients, 1, (14, 14))
    # real-size (12 blocks over 197 tokens): the random-walk bound
    assert np.allclose(out.numpy(), expected,
                       **f32_tol_deep(expected, module_depth(model, tokens=197, grad=True) + 12 * (3 + 197)))


def test_chefer_relevance_batch_equals_items_and_none_is_the_predicted_class(vit, x):
    batch = chefer_relevance(vit, x, target=[4, 1, 2])
    tol = f32_tol(batch, MAP_DEPTH)
    for b, t in enumerate([4, 1, 2]):
        assert torch.allclose(batch[b], chefer_relevance(vit, x[b : b + 1], t)[0], **tol)
    with torch.no_grad():
        logits = vit(x)
    predicted = decided_argmax(logits, f32_tol(logits, TINY_DEPTH)["atol"])  # the method's forward picks it too
    assert torch.equal(chefer_relevance(vit, x), chefer_relevance(vit, x, predicted))  # the same computation
    assert not torch.allclose(chefer_relevance(vit, x, 0), chefer_relevance(vit, x, 1), **tol)


@pytest.mark.parametrize("target, message", [
    (5, r"target 5 is outside the model's classes: allowed 0 .. 4 \(5 classes\)"),
    (torch.tensor([0, 1, 2, 3]), "target has 4 classes but the batch has 3 samples"),
    (2.0, "target must be"),
])
def test_chefer_relevance_rejects_bad_targets(vit, x, target, message):
    with pytest.raises(ValueError, match=message):
        chefer_relevance(vit, x, target)


# --- the generic engine (eq. 1-11) -------------------------------------------------------------------
def event(query, key, abar, heads=1):
    """An event whose eq. 5 average is exactly ``abar`` (float64, batch 1): head 0 carries
    ``2 * abar`` with gradient 1, any further head has gradient -1 (clamped to 0 by eq. 5),
    so the head average is ``2 * abar / heads``; the attention is scaled by ``heads / 2``."""
    abar = torch.tensor(abar, dtype=torch.float64)
    A = abar.expand(1, heads, *abar.shape).clone() * heads
    G = -torch.ones_like(A)
    G[:, 0] = 1
    return AttentionEvent(query, key, A, G)


def random_event(g, query, key, sizes, batch=(2,), heads=2, dtype=torch.float32):
    A = torch.rand(*batch, heads, sizes[query], sizes[key], generator=g, dtype=dtype).softmax(-1)
    G = torch.randn(*batch, heads, sizes[query], sizes[key], generator=g, dtype=dtype)
    return AttentionEvent(query, key, A, G)


def lxmert_like(g, sizes, batch=(2,), dtype=torch.float32):
    """LXMERT's order: language layers, vision layers, then per cross-modality layer the two
    co-attention directions together, then each modality's self-attention."""
    e = lambda q, k: random_event(g, q, k, sizes, batch, dtype=dtype)  # noqa: E731
    steps = [e("text", "text") for _ in range(2)] + [e("image", "image") for _ in range(2)]
    for _ in range(2):
        steps += [(e("text", "image"), e("image", "text")), e("text", "text"), e("image", "image")]
    return steps


def detr_like(g, sizes, batch=(2,)):
    """DETR's order: encoder self-attention, then per decoder layer query self-attention and
    query <- image cross-attention."""
    e = lambda q, k: random_event(g, q, k, sizes, batch)  # noqa: E731
    steps = [e("image", "image") for _ in range(2)]
    for _ in range(3):
        steps += [e("query", "query"), e("query", "image")]
    return steps


def as_steps(events):
    return [list(s) if isinstance(s, tuple) else [s] for s in events]


def item(events, b):
    """The same events for batch item b alone (batch shape (1,))."""
    pick = lambda e: AttentionEvent(e.query, e.key, e.attention[b : b + 1], e.grad[b : b + 1])  # noqa: E731
    return [tuple(pick(e) for e in s) if isinstance(s, tuple) else pick(s) for s in events]


def test_eq1_2_initial_relevances():
    R = initial_relevances({"text": 2, "image": 3}, (4,), torch.float64)
    assert set(R) == {("text", "text"), ("text", "image"), ("image", "text"), ("image", "image")}
    assert torch.equal(R["text", "text"], torch.eye(2, dtype=torch.float64).expand(4, 2, 2))
    assert torch.equal(R["image", "image"], torch.eye(3, dtype=torch.float64).expand(4, 3, 3))
    assert R["text", "image"].shape == (4, 2, 3) and not R["text", "image"].any()
    assert R["image", "text"].shape == (4, 3, 2) and not R["image", "text"].any()


def test_hand_built_co_attention_graph():
    """2 text + 3 image tokens, one head (two in the first event), worked out by hand:

    1. image self-attention, i0 -> i1:  R^{ii} = I + A = [[1,1,0],[0,1,0],[0,0,1]]
    2. one step: text <- image [[.5,0,.5],[0,0,1]] and image <- text (i1 -> t0), both read
       the state before the step. Rbar^{tt} = I (R^{tt} - I has no entries: identity rows,
       not 0/0); Rbar^{ii} = [[1,1,0],[0,1,0],[0,0,1]] (row 0 of R - I already sums to 1).
       R^{ti} = I^T A Rbar^{ii} = [[.5,.5,.5],[0,0,1]]; R^{it} = (Rbar^{ii})^T A I: row 1 =
       Rbar^{ii}[0,1] A[0] + Rbar^{ii}[1,1] A[1] = [1, 0], rows 0 and 2 zero. Eq. 11 adds
       A R^{it} = 0 and A R^{ti} = 0 (both 0 before the step).
    3. text <- image, t0 -> i1: R^{ti} += e0 ⊗ Rbar^{ii}[1] = [0,1,0] in row 0 -> [[.5,1.5,.5],
       [0,0,1]]; eq. 11: R^{tt} += A R^{it}, row 0 gains R^{it}[1] = [1, 0] -> [[2,0],[0,1]].
    4. text self-attention, t0 -> t1: R^{tt} += A R^{tt} -> [[2,1],[0,1]]; eq. 7: R^{ti} +=
       A R^{ti}, row 0 gains row 1 [0,0,1] -> [[.5,1.5,1.5],[0,0,1]].
    5. text <- image, t0 -> i0: R^{tt} - I = [[1,1],[0,0]] -> Rbar^{tt} = [[1.5,.5],[0,1]];
       A Rbar^{ii} = [[1,1,0],[0,0,0]]; (Rbar^{tt})^T puts t0's row, times 1.5 and 0.5, into
       rows 0 and 1: R^{ti} += [[1.5,1.5,0],[.5,.5,0]] -> [[2,3,1.5],[.5,.5,1]].
    """
    events = [
        event("image", "image", [[0, 1, 0], [0, 0, 0], [0, 0, 0]], heads=2),
        (event("text", "image", [[.5, 0, .5], [0, 0, 1]]), event("image", "text", [[0, 0], [1, 0], [0, 0]])),
        event("text", "image", [[0, 1, 0], [0, 0, 0]]),
        event("text", "text", [[0, 1], [0, 0]]),
        event("text", "image", [[1, 0, 0], [0, 0, 0]]),
    ]
    R = propagate(events, {"text": 2, "image": 3})
    assert isinstance(R, Relevances) and R.sizes == {"text": 2, "image": 3}
    assert R["text", "text"][0].tolist() == [[2, 1], [0, 1]]
    assert R["text", "image"][0].tolist() == [[2, 3, 1.5], [.5, .5, 1]]
    assert R["image", "text"][0].tolist() == [[0, 0], [1, 0], [0, 0]]
    assert R["image", "image"][0].tolist() == [[1, 1, 0], [0, 1, 0], [0, 0, 1]]
    # the LXMERT readouts: CLS = first text token
    assert R.rows("text", "image", 0).tolist() == [[2, 3, 1.5]]
    assert R.rows("text", "text", 0).tolist() == [[2, 1]]
    assert R.rows("text", "text", 0, drop_self=True).tolist() == [[0, 1]]
    # the loop implementation agrees
    loop = loop_propagate(as_steps(events), R.sizes)
    for pair, M in R.matrices.items():
        assert np.array_equal(M[0].numpy(), loop[pair]), pair


def test_one_step_reads_the_state_before_it():
    """Step 2 of the hand-built graph run as two consecutive events: image <- text then reads
    the new R^{ti} through eq. 11, R^{ii} += A R^{ti}: i1 gains t0's row [.5,.5,.5]."""
    t_i = event("text", "image", [[.5, 0, .5], [0, 0, 1]])
    i_t = event("image", "text", [[0, 0], [1, 0], [0, 0]])
    first = event("image", "image", [[0, 1, 0], [0, 0, 0], [0, 0, 0]])
    together = propagate([first, (t_i, i_t)], {"text": 2, "image": 3})
    in_turn = propagate([first, t_i, i_t], {"text": 2, "image": 3})
    assert together["image", "image"][0].tolist() == [[1, 1, 0], [0, 1, 0], [0, 0, 1]]
    assert in_turn["image", "image"][0].tolist() == [[1, 1, 0], [.5, 1.5, .5], [0, 0, 1]]
    # the other order: text <- image reads R^{it} = [[0,0],[1,0],[0,0]] through eq. 11 (t0 -> i0: row 0 of R^{it} is 0;
    # t1 -> i2: row 2 is 0) and R^{ii} through eq. 10 -- R^{tt} stays I, R^{ti} is the same.
    reverse = propagate([first, i_t, t_i], {"text": 2, "image": 3})
    assert torch.equal(reverse["text", "image"], together["text", "image"])
    # a step's events are summed: two identical self events in one step add twice A R
    a = event("text", "text", [[0, 1], [0, 0]])
    assert propagate([(a, a)], {"text": 2})["text", "text"][0].tolist() == [[1, 2], [0, 1]]


def test_eq10_uses_the_transpose_of_rbar_ss():
    """(Rbar^{ss})^T, as in the paper and its code: t0's cross-attention lands in the rows of
    the tokens t0 is relevant to -- here t1 (t1 attended to t0), not t0 itself."""
    events = [event("text", "text", [[0, 0], [1, 0]]), event("text", "image", [[1, 0], [0, 0]])]
    R = propagate(events, {"text": 2, "image": 2})
    # t1 attended to t0: R^{tt} = Rbar^{tt} = [[1,0],[1,1]]; ((Rbar^{tt})^T A)[k] = sum_i Rbar[i,k] A[i]:
    # k = 0: Rbar[0,0] A[0] + Rbar[1,0] A[1] = [1,0]; k = 1: Rbar[0,1] A[0] + Rbar[1,1] A[1] = 0
    assert R["text", "image"][0].tolist() == [[1, 0], [0, 0]]
    events = [event("text", "text", [[0, 1], [0, 0]]), event("text", "image", [[1, 0], [0, 0]])]
    R = propagate(events, {"text": 2, "image": 2})
    # t0 attended to t1: Rbar^{tt} = [[1,1],[0,1]], and k = 1 gains Rbar[0,1] A[0] = [1,0]
    # (without the transpose it would be the other way round: t0 would gain, t1 not)
    assert R["text", "image"][0].tolist() == [[1, 0], [1, 0]]


def test_eq7_updates_every_other_modality():
    """Self-attention in a carries a's rows of R^{ab} and R^{ac} along, and leaves b's and c's rows alone."""
    sizes = {"a": 2, "b": 1, "c": 3}
    events = [event("a", "b", [[1], [0]]), event("a", "c", [[0, 0, 0], [0, 2, 0]]), event("a", "a", [[0, 1], [0, 0]])]
    R = propagate(events, sizes)
    assert R["a", "b"][0].tolist() == [[1], [0]]  # row 0 gains row 1 = 0
    assert R["a", "c"][0].tolist() == [[0, 2, 0], [0, 2, 0]]  # row 0 gains row 1
    assert R["a", "a"][0].tolist() == [[1, 1], [0, 1]]
    for pair in [("b", "b"), ("c", "c")]:
        assert torch.equal(R[pair][0], torch.eye(sizes[pair[0]], dtype=torch.float64))
    for pair in [("b", "a"), ("c", "a"), ("b", "c"), ("c", "b")]:
        assert not R[pair].any()
    loop = loop_propagate(as_steps(events), sizes)
    for pair, M in R.matrices.items():
        assert np.allclose(M[0].numpy(), loop[pair], rtol=0, atol=1e-15), pair


# float32 propagation of lxmert_like / detr_like events against float64 loops: at most 10 steps, each a
# mean over 2 heads, eq. 8's row sums and division, and two products over at most 4 tokens; every
# term non-negative, so each entry is good to its own digits (f32_rel)
PROPAGATE_DEPTH = 10 * (2 + 4 + 1 + 2 * 4)


@pytest.mark.parametrize("build, sizes", [
    (lxmert_like, {"text": 3, "image": 4}),
    (detr_like, {"image": 4, "query": 3}),
])
@pytest.mark.parametrize("normalize", [True, False])
def test_propagate_equals_the_loop_implementation(build, sizes, normalize):
    g = torch.Generator().manual_seed(11)
    events = build(g, sizes)
    R = propagate(events, sizes, normalize=normalize)
    for b in range(2):
        loop = loop_propagate(as_steps(item(events, b)), sizes, normalize=normalize)
        for pair, M in R.matrices.items():
            assert M.shape == (2, sizes[pair[0]], sizes[pair[1]])
            assert np.allclose(M[b].double().numpy(), loop[pair], **f32_rel(PROPAGATE_DEPTH)), (pair, b)
    # every entry non-negative, every self-relevance at least I on the diagonal
    for pair, M in R.matrices.items():
        assert (M >= 0).all() and torch.isfinite(M).all()
        if pair[0] == pair[1]:
            assert (torch.diagonal(M, dim1=-2, dim2=-1) >= 1).all()


def test_eq8_9_normalisation_makes_a_difference():
    g = torch.Generator().manual_seed(3)
    sizes = {"text": 3, "image": 4}
    events = lxmert_like(g, sizes, dtype=torch.float64)
    assert not torch.allclose(propagate(events, sizes)["text", "image"],
                              propagate(events, sizes, normalize=False)["text", "image"])


def test_detr_rows_of_every_detected_query_at_once():
    g = torch.Generator().manual_seed(5)
    sizes = {"image": 6, "query": 4}
    R = propagate(detr_like(g, sizes, batch=(3,)), sizes)
    Rqi = R["query", "image"]
    detected = torch.tensor([[0, 2], [3, 1], [1, 1]])  # B x K
    rows = R.rows("query", "image", detected)
    assert rows.shape == (3, 2, 6)
    for b in range(3):
        for k in range(2):
            assert torch.equal(rows[b, k], Rqi[b, detected[b, k]])
    assert torch.equal(R.rows("query", "image", [2, 0, 3]), torch.stack([Rqi[0, 2], Rqi[1, 0], Rqi[2, 3]]))
    assert torch.equal(R.rows("query", "image", 1), Rqi[:, 1])
    # eq. 11 never fires in DETR: image tokens do not attend to queries, so R^{iq} stays 0 and R^{qq} has only self terms
    assert not R["image", "query"].any()


def test_read_rows_with_two_batch_dimensions_and_drop_self():
    R = torch.arange(2 * 3 * 4 * 4, dtype=torch.float32).reshape(2, 3, 4, 4)
    idx = torch.tensor([[0, 1, 2], [3, 3, 0]])
    rows = read_rows(R, idx, drop_self=True)
    assert rows.shape == (2, 3, 4)
    for a in range(2):
        for b in range(3):
            expected = R[a, b, idx[a, b]].clone()
            expected[idx[a, b]] = 0
            assert torch.equal(rows[a, b], expected)
    many = read_rows(R, torch.tensor([[[0, 3]] * 3] * 2))
    assert many.shape == (2, 3, 2, 4) and torch.equal(many[1, 2, 1], R[1, 2, 3])
    assert torch.equal(read_rows(R, 2), R[:, :, 2])


@pytest.mark.parametrize("index, error, message", [
    (4, ValueError, r"row index 4 is outside 0 \.\. 3 \(4 tokens\)"),
    (-1, ValueError, r"row index -1 is outside"),
    ([0, 1], ValueError, r"index must be an int, one row per item \(shape \(3,\)\)"),
    (1.0, TypeError, "index must be an int"),
    (torch.tensor([0.0, 1, 2]), TypeError, "index must hold integers"),
])
def test_read_rows_rejects_bad_indices(index, error, message):
    with pytest.raises(error, match=message):
        read_rows(torch.zeros(3, 4, 5), index)


def test_read_rows_drop_self_needs_a_square_matrix():
    with pytest.raises(ValueError, match="drop_self needs a square"):
        read_rows(torch.zeros(3, 4, 5), 0, drop_self=True)


# --- eq. 8-9 ----------------------------------------------------------------------------------------
def test_eq8_9_by_hand_with_an_empty_row():
    R = torch.tensor([[3.0, 1, 1], [0, 1, 0], [0, 2, 1]])
    # R - I = [[2,1,1],[0,0,0],[0,2,0]] -> rows / 4, / (nothing: stays 0), / 2 -> + I
    assert normalized_self_relevance(R).tolist() == [[1.5, .25, .25], [0, 1, 0], [0, 1, 1]]


def test_eq8_9_identity_stays_identity_without_nan():
    R = torch.eye(4).expand(2, 3, 4, 4)
    out = normalized_self_relevance(R)
    assert torch.equal(out, R)
    # the literal formula divides 0 by 0
    assert torch.isnan((R - torch.eye(4)) / (R - torch.eye(4)).sum(-1, keepdim=True)).all()


def test_eq8_9_rows_of_rbar_minus_i_sum_to_one_or_zero():
    g = torch.Generator().manual_seed(4)
    added = torch.rand(5, 6, 6, generator=g, dtype=torch.float64)
    added[:, 2] = 0  # an empty row in every item
    added[3] = 0  # an item with nothing added at all
    Rbar = normalized_self_relevance(added + torch.eye(6, dtype=torch.float64))
    sums = (Rbar - torch.eye(6, dtype=torch.float64)).sum(-1)
    expected = torch.ones(5, 6, dtype=torch.float64)
    expected[:, 2] = 0
    expected[3] = 0
    assert torch.allclose(sums, expected, **f64_tol(1.0, 2 * 6))  # a row sum, a division, a row sum
    # the non-empty rows are the plain formula
    assert torch.allclose(Rbar[0, 0], added[0, 0] / added[0, 0].sum() + torch.eye(6, dtype=torch.float64)[0],
                          **f64_tol(1.0, 6 + 2))


def test_bimodal_rule_is_eq10_11():
    g = torch.Generator().manual_seed(8)
    R_ss, R_qq = (torch.eye(n, dtype=torch.float64) + torch.rand(2, n, n, generator=g, dtype=torch.float64) for n in (2, 3))
    R_sq, R_qs = torch.rand(2, 2, 3, generator=g, dtype=torch.float64), torch.rand(2, 3, 2, generator=g, dtype=torch.float64)
    Abar = torch.rand(2, 2, 3, generator=g, dtype=torch.float64)
    new_ss, new_sq = bimodal_rule(R_ss, R_sq, R_qq, R_qs, Abar)
    for b in range(2):
        Rs = (R_ss[b] - torch.eye(2, dtype=torch.float64))
        Rs = Rs / Rs.sum(1, keepdim=True) + torch.eye(2, dtype=torch.float64)
        Rq = (R_qq[b] - torch.eye(3, dtype=torch.float64))
        Rq = Rq / Rq.sum(1, keepdim=True) + torch.eye(3, dtype=torch.float64)
        # float64: row sums over 2 and 3, products over 2 and 3
        want_sq, want_ss = R_sq[b] + Rs.T @ Abar[b] @ Rq, R_ss[b] + Abar[b] @ R_qs[b]
        assert torch.allclose(new_sq[b], want_sq, **f64_tol(want_sq, 2 * (2 + 3) + 2))
        assert torch.allclose(new_ss[b], want_ss, **f64_tol(want_ss, 3 + 1))
    plain_ss, plain_sq = bimodal_rule(R_ss, R_sq, R_qq, R_qs, Abar, normalize=False)
    want_sq = R_sq + R_ss.mT @ Abar @ R_qq
    assert torch.allclose(plain_sq, want_sq, **f64_tol(want_sq, 2 + 3 + 1)) and torch.equal(plain_ss, new_ss)


# --- batches, missing gradients, errors ------------------------------------------------------------------
def test_batch_equals_items_with_two_batch_dimensions():
    g = torch.Generator().manual_seed(9)
    sizes = {"text": 3, "image": 4}
    events = lxmert_like(g, sizes, batch=(2, 3))
    R = propagate(events, sizes)
    assert R["text", "image"].shape == (2, 3, 3, 4)
    flat = [AttentionEvent(e.query, e.key, e.attention.flatten(0, 1), e.grad.flatten(0, 1))
            for s in events for e in (s if isinstance(s, tuple) else (s,))]
    # rebuild the steps over a flat batch of 6, then each of the 6 alone
    it = iter(flat)
    flat_steps = [tuple(next(it) for _ in s) if isinstance(s, tuple) else next(it) for s in events]
    for b in range(6):
        one = propagate(item(flat_steps, b), sizes)
        for pair, M in R.matrices.items():
            assert torch.allclose(M.flatten(0, 1)[b], one[pair][0], **f32_rel(PROPAGATE_DEPTH)), (pair, b)


def test_an_event_without_gradient_changes_nothing():
    g = torch.Generator().manual_seed(10)
    sizes = {"text": 3, "image": 4}
    events = lxmert_like(g, sizes)
    silent = AttentionEvent("image", "text", events[4][1].attention, None)
    zero = AttentionEvent("image", "text", events[4][1].attention, torch.zeros_like(events[4][1].attention))
    a = propagate(events[:4] + [(events[4][0], silent)] + events[5:], sizes)
    b = propagate(events[:4] + [(events[4][0], zero)] + events[5:], sizes)
    for pair in a.matrices:
        assert torch.equal(a[pair], b[pair])
    loop = loop_propagate(as_steps(item(events[:4], 0)) + [[item([events[4][0]], 0)[0]]]
                          + as_steps(item(events[5:], 0)), sizes)
    assert np.allclose(a["text", "image"][0].numpy(), loop["text", "image"], **f32_rel(PROPAGATE_DEPTH))


def test_dtypes_are_promoted():
    e32 = event("text", "text", [[0, 1], [0, 0]])
    e32 = AttentionEvent("text", "text", e32.attention.float(), e32.grad.float())
    e64 = event("text", "image", [[1.0], [0.0]])
    R = propagate([e32, e64], {"text": 2, "image": 1})
    assert R["text", "text"].dtype == torch.float64
    # Rbar^{tt} = R^{tt} = [[1,1],[0,1]]; its transpose carries t0's attention into t1's row too
    assert R["text", "image"][0].tolist() == [[1], [1]]


def test_attention_event_rejects_bad_tensors():
    A = torch.rand(1, 2, 3, 4)
    with pytest.raises(ValueError, match=r"attention 'text' <- 'image': grad must have the attention's shape "
                                         r"\(1, 2, 3, 4\), got \(1, 2, 4, 3\)"):
        AttentionEvent("text", "image", A, torch.rand(1, 2, 4, 3))
    with pytest.raises(ValueError, match=r"attention must be a tensor \.\.\. x heads x Nq x Nk .*got \(3, 4\)"):
        AttentionEvent("text", "image", torch.rand(3, 4), None)
    with pytest.raises(TypeError, match="AttentionEvent.key must be a modality name"):
        AttentionEvent("text", "", A, None)
    with pytest.raises(ValueError, match="grad must have the attention's shape .* got ndarray"):
        AttentionEvent("text", "image", A, np.zeros((1, 2, 3, 4)))


def test_propagate_errors_say_which_event_and_why():
    sizes = {"text": 3, "image": 4}
    ok = AttentionEvent("text", "image", torch.rand(2, 1, 3, 4), torch.rand(2, 1, 3, 4))
    with pytest.raises(ValueError, match=r"events\[1\] \(attention 'text' <- 'img'\): unknown modality 'img'; "
                                         r"sizes has \['image', 'text'\]"):
        propagate([ok, AttentionEvent("text", "img", torch.rand(2, 1, 3, 4), None)], sizes)
    with pytest.raises(ValueError, match=r"events\[0\] \(self-attention 'image'\): attention is \(2, 1, 3, 3\), its last "
                                         r"two dimensions must be 4 x 4 \('image' tokens x 'image' tokens\)"):
        propagate([AttentionEvent("image", "image", torch.rand(2, 1, 3, 3), None)], sizes)
    with pytest.raises(ValueError, match=r"events\[0\]\[1\] \(attention 'image' <- 'text'\): attention is \(2, 1, 3, 4\), "
                                         r"its last two dimensions must be 4 x 3"):
        propagate([(ok, AttentionEvent("image", "text", torch.rand(2, 1, 3, 4), None))], sizes)
    with pytest.raises(ValueError, match=r"events\[1\] \(attention 'text' <- 'image'\): batch shape \(3,\) differs "
                                         r"from the first event's \(2,\)"):
        propagate([ok, AttentionEvent("text", "image", torch.rand(3, 1, 3, 4), None)], sizes)
    with pytest.raises(ValueError, match="propagate needs at least one AttentionEvent"):
        propagate([], sizes)
    with pytest.raises(TypeError, match=r"events\[1\] must be an AttentionEvent or a non-empty tuple of them"):
        propagate([ok, ()], sizes)
    with pytest.raises(TypeError, match=r"events\[0\] must be an AttentionEvent"):
        propagate([torch.rand(2, 1, 3, 3)], sizes)
    with pytest.raises(ValueError, match=r"sizes must map modality names \(str\) to token counts >= 1, got 'text': 0"):
        propagate([ok], {"text": 0, "image": 4})
    with pytest.raises(ValueError, match="sizes must map each modality to its number of tokens"):
        propagate([ok], {})
    with pytest.raises(KeyError, match=r"no relevance \('text', 'img'\)"):
        propagate([ok], sizes)["text", "img"]


# --- the ViT case: the engine with one modality --------------------------------------------------
def legacy_relevance_matrix(attentions, gradients):
    """relevance_matrix as it was before the engine: R = I, then R + Abar @ R per block."""
    B, _, N, _ = attentions[0].shape
    R = torch.eye(N, dtype=attentions[0].dtype).expand(B, N, N)
    for A, G in zip(attentions, gradients):
        R = R + head_averaged_relevance(A, G) @ R
    return R


def test_vit_is_the_engine_with_one_modality(vit, x):
    target = [1, 4, 0]
    ag = attention_gradients(vit, x, target)
    N = ag.attentions[0].shape[-1]
    R = propagate(self_attention_events("image", ag.attentions, ag.gradients), {"image": N})
    assert torch.equal(R["image", "image"], relevance_matrix(ag.attentions, ag.gradients))
    # the engine accumulates R - I (exact in float32), the legacy loop R: float32 rounding apart, entry by
    # entry (non-negative terms: 3 blocks of a mean over 3 heads and a product over 17 tokens)
    depth = 3 * (3 + N)
    assert torch.allclose(R["image", "image"], legacy_relevance_matrix(ag.attentions, ag.gradients), **f32_rel(depth))
    cls_row = R.rows("image", "image", 0)[:, 1:].reshape(3, 4, 4)
    # chefer_relevance multiplies row vectors from the last block down: same maths, float32 rounding apart
    assert torch.allclose(chefer_relevance(vit, x, target), cls_row, **f32_rel(depth))
    # in float64 the two orders agree to rounding
    A64, G64 = [a.double() for a in ag.attentions], [g.double() for g in ag.gradients]
    R64 = propagate(self_attention_events("image", A64, G64), {"image": N})
    assert torch.allclose(relevance_row(A64, G64, index=0), R64.rows("image", "image", 0), rtol=2 * depth * EPS64, atol=0)
    assert torch.allclose(R64["image", "image"], legacy_relevance_matrix(A64, G64), rtol=2 * depth * EPS64, atol=0)


def test_vit_engine_equivalence_on_deit_tiny():
    model = timm.create_model("deit_tiny_patch16_224", pretrained=False).eval()
    x = torch.randn(1, 3, 224, 224, generator=torch.Generator().manual_seed(12))
    ag = attention_gradients(model, x, [7])
    R = propagate(self_attention_events("image", ag.attentions, ag.gradients), {"image": 197})
    depth = 12 * (3 + 197)  # 12 blocks: a mean over 3 heads, a product over 197 tokens; non-negative terms
    assert torch.allclose(R["image", "image"], legacy_relevance_matrix(ag.attentions, ag.gradients), **f32_rel(depth))
    cls_row = R.rows("image", "image", 0)[:, 1:].reshape(1, 14, 14)
    assert torch.allclose(chefer_relevance(model, x, [7]), cls_row, **f32_rel(depth))


# --- precision: eq. 8's R - I kept exact (float32 against float64) -------------------------------
def test_eq8_9_kept_exact_when_r_stays_close_to_the_identity():
    """Additions of ~1e-7 to I: R - I formed from R in float32 keeps about one digit; propagate
    keeps R - I itself, so its eq. 10 result matches float64 to float32 rounding."""
    g = torch.Generator().manual_seed(5)
    sizes = {"text": 5, "image": 7}
    steps = [random_event(g, "text", "text", sizes, dtype=torch.float64),
             random_event(g, "image", "image", sizes, dtype=torch.float64)]
    steps = [AttentionEvent(e.query, e.key, e.attention, e.grad.abs() * 1e-6) for e in steps]
    steps.append(random_event(g, "text", "image", sizes, dtype=torch.float64))
    R64 = propagate(steps, sizes)
    as32 = [AttentionEvent(e.query, e.key, e.attention.float(), e.grad.float()) for e in steps]
    R32 = propagate(as32, sizes)
    exact = R64["text", "image"]
    # non-negative terms, entry by entry: a mean over 2 heads, eq. 8's sums over 5 and 7 and divisions,
    # eq. 10's products over 5 and 7
    torch.testing.assert_close(R32["text", "image"].double(), exact, **f32_rel(2 * (2 + 7 + 1) + 2 + 5 + 7))
    # R^{ss} - I is kept: its float32 value is the float64 one to rounding, diagonal included
    for s in sizes:
        torch.testing.assert_close(R32.added[s].double(), R64.added[s], **f32_rel(2 + 7 + 1))
        torch.testing.assert_close(R32[s, s].double(), R64[s, s], **f32_rel(2 + 7 + 1))
    # the formula from R in float32 loses the additions' digits (what the engine avoids)
    naive = normalized_self_relevance(R32["text", "text"]).double()
    assert (naive - normalized_self_relevance(R64["text", "text"])).abs().max() > 1e-3


def chefer_reference_lxmert(model, inputs: dict, target: int, amplification: bool = False):
    """Chefer et al.'s LXMERT algorithm for one unpadded sample, written from the description
    of the reference (hila-chefer/Transformer-MM-Explainability, lxmert/lxmert/src/
    ExplanationGenerator.py, ``GeneratorOurs.generate_ours`` with ``use_lrp=False``), with
    its own recording and backward: R^{tt} = I, R^{ii} = I, R^{ti} = R^{it} = 0; each
    language layer, then each vision layer (eq. 6-7); per cross-modality layer but the last
    both co-attention directions computed from the same state (eq. 10-11 with eq. 8-9's
    handle_residual) and added together, then the layer's text and image self-attention; the
    last layer only its text co-attention and text self-attention. Returns (R^{ti}[0],
    R^{tt}[0] with entry 0 set to 0), and with ``amplification`` the largest |R| / (row sum of
    R - I) over eq. 8's uses: how much R - I formed from R amplifies R's rounding."""
    import vitlab

    with vitlab.record(model, gradients=True) as rec:
        score = model(**inputs).question_answering_score
        score[0, target].backward()
    model.zero_grad(set_to_none=True)

    def cam(c):  # eq. 5 for one sample
        return (c.grad[0] * c.attention.detach()[0]).clamp(min=0).mean(dim=0)

    amp = [1.0]

    def residual(M):  # eq. 8-9
        eye = torch.eye(M.shape[0], dtype=M.dtype)
        hat = M - eye
        sums = hat.sum(dim=-1)
        amp.append(float((M.abs().amax(-1)[sums > 0] / sums[sums > 0]).max()) if (sums > 0).any() else 1.0)
        return hat / hat.sum(dim=-1, keepdim=True) + eye

    lv = rec.stream("lang->vision")
    Nt, Ni = lv[0].attention.shape[-2:]
    Rtt, Rii = torch.eye(Nt, dtype=torch.float64), torch.eye(Ni, dtype=torch.float64)
    Rti, Rit = torch.zeros(Nt, Ni, dtype=torch.float64), torch.zeros(Ni, Nt, dtype=torch.float64)
    for c in rec.stream("lang"):
        A = cam(c)
        Rtt, Rti = Rtt + A @ Rtt, Rti + A @ Rti
    for c in rec.stream("vision"):
        A = cam(c)
        Rii, Rit = Rii + A @ Rii, Rit + A @ Rit
    layers = list(zip(lv, rec.stream("vision->lang"), rec.stream("cross.lang"), rec.stream("cross.vision")))
    for k, (t_i, i_t, t_t, i_i) in enumerate(layers):
        A_ti = cam(t_i)
        add_ti, add_tt = residual(Rtt).T @ A_ti @ residual(Rii), A_ti @ Rit
        if k == len(layers) - 1:
            Rti, Rtt = Rti + add_ti, Rtt + add_tt
            A = cam(t_t)
            Rtt, Rti = Rtt + A @ Rtt, Rti + A @ Rti
            break
        A_it = cam(i_t)
        add_it, add_ii = residual(Rii).T @ A_it @ residual(Rtt), A_it @ Rti
        Rti, Rtt, Rit, Rii = Rti + add_ti, Rtt + add_tt, Rit + add_it, Rii + add_ii
        A = cam(t_t)
        Rtt, Rti = Rtt + A @ Rtt, Rti + A @ Rti
        A = cam(i_i)
        Rii, Rit = Rii + A @ Rii, Rit + A @ Rit
    text = Rtt[0].clone()
    text[0] = 0
    return (Rti[0], text, max(amp)) if amplification else (Rti[0], text)


def test_lxmert_relevance_float32_is_float64_and_the_reference_algorithm_on_a_2_2_3_layer_model():
    """Random-initialised LxmertForQuestionAnswering, 2 language / 2 vision / 3 cross-modality
    layers, Hugging Face's initialisation (std 0.02: attention gradients ~1e-5, R close to I).
    float64: equal to the reference algorithm per unpadded item (to its rounding, amplified where it
    forms R - I from R). float32: within f32_rel of the model's depth (2.4e-3 relative, per entry:
    non-negative terms; measured 5e-7) of float64; forming R - I from R instead gave 4.3e-2."""
    import copy

    from transformers import LxmertConfig, LxmertForQuestionAnswering

    from vitlab.relevance import lxmert_relevance

    torch.manual_seed(0)
    cfg = LxmertConfig(vocab_size=50, hidden_size=32, num_attention_heads=4, intermediate_size=64, l_layers=2,
                       r_layers=2, x_layers=3, visual_feat_dim=16, visual_pos_dim=4, num_qa_labels=7,
                       num_object_labels=5, num_attr_labels=5)
    m32 = LxmertForQuestionAnswering(cfg).eval()
    m64 = copy.deepcopy(m32).double()
    g = torch.Generator().manual_seed(1)
    B, T, V = 3, 7, 10
    ids = torch.randint(0, 50, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.long)
    mask[-1, -2:] = 0  # the last question is two tokens shorter
    feats, pos = torch.randn(B, V, 16, generator=g), torch.rand(B, V, 4, generator=g)
    target = [1, 2, 3]
    inputs = dict(input_ids=ids, attention_mask=mask, visual_feats=feats, visual_pos=pos)
    out32 = lxmert_relevance(m32, inputs, target=target)
    depth = module_depth(m32, tokens=T + V, grad=True)
    out64 = lxmert_relevance(m64, {**inputs, "visual_feats": feats.double(), "visual_pos": pos.double()}, target=target)
    for b in range(B):
        n = int(mask[b].sum())
        one = dict(input_ids=ids[b : b + 1, :n], attention_mask=mask[b : b + 1, :n],
                   visual_feats=feats[b : b + 1].double(), visual_pos=pos[b : b + 1].double())
        image, text, amplification = chefer_reference_lxmert(m64, one, target[b], amplification=True)
        # the reference forms R - I from R: its float64 rounding, relative to |R|, is amplified by
        # |R| / |R - I| (~1e5 here: measured 1e-10 relative)
        rtol = 2 * depth * EPS64 * amplification
        torch.testing.assert_close(out64.image[b], image, rtol=rtol, atol=0)
        torch.testing.assert_close(out64.text[b, :n], text, rtol=rtol, atol=1e-30)
    assert out64.text[-1, -2:].abs().max() == 0                      # padding gets no relevance
    for name in ("image", "text"):
        x, y = getattr(out32, name).double(), getattr(out64, name)
        rel = (x - y).abs() / y.abs().clamp(min=1e-30)
        assert rel.max() <= f32_rel(depth)["rtol"], (name, rel.max().item())
        assert y.abs().max() < 1e-2        # the regime where eq. 8 cancels: R stays close to I


def test_rows_of_an_empty_list_is_refused_clearly():
    from vitlab.relevance.engine import AttentionEvent, propagate, read_rows

    sizes = {"text": 2, "image": 3}
    g = torch.Generator().manual_seed(0)
    A = torch.softmax(torch.randn(2, 1, 2, 5, generator=g), -1)
    events = [AttentionEvent("text", "text", A[..., :2], torch.randn(2, 1, 2, 2, generator=g)),
              AttentionEvent("text", "image", A[..., 2:], torch.randn(2, 1, 2, 3, generator=g))]
    R = propagate(events, sizes)
    assert R.rows("text", "image", [1, 0]).shape == (2, 3)
    for empty in ([], (), torch.zeros(0, dtype=torch.long), torch.zeros(2, 0, dtype=torch.long)):
        with pytest.raises(ValueError, match=r"no rows asked for"):
            R.rows("text", "image", empty)
    with pytest.raises(ValueError, match=r"no rows asked for"):
        read_rows(torch.zeros(3, 4, 5), [])


# --- smaller silent ones --------------------------------------------------------------------------
def test_propagate_gives_every_item_its_own_identity():
    A = torch.rand(3, 2, 4, 4).softmax(-1)
    R = propagate([AttentionEvent("a", "a", A, torch.rand(3, 2, 4, 4))], {"a": 4, "b": 2})
    for M in (R["b", "b"], initial_relevances({"b": 2}, (3,))["b", "b"]):
        M[0, 0, 1] = 5.0  # editing one item's relevance in place...
        assert M[1, 0, 1] == 0 and M[2, 0, 1] == 0  # ...edits that item only
        assert torch.equal(M[1], torch.eye(2))
