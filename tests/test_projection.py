"""vitlab.projection against hand-written forwards and invariants (Vilas et al. 2023)."""
import copy
import types

import pytest
import torch
import torch.nn.functional as F
from timm.models.deit import VisionTransformerDistilled
from timm.models.vision_transformer import VisionTransformer

from conftest import (
    assert_model_unchanged, f32_tol, f64_tol, model_snapshot, module_depth, randomize, TINY, TINY_DEPTH, TINY_GRAD_DEPTH,
)
from vitlab import projection as P
from references import hand_states

pytestmark = pytest.mark.usefixtures("one_thread")


# The tiny ViT and its inputs in float64 here (conftest's in float32): the projections are checked
# against hand-written forwards and against their own items, and several results are ranks, top-k
# units, argmaxes and removed tokens, equal across two arithmetic paths only away from rounding ties.
@pytest.fixture(scope="module")
def vit():
    return randomize(VisionTransformer(**TINY), 0).double()


@pytest.fixture(scope="module")
def x():
    return torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(7), dtype=torch.float64)


def close(got, want, depth=TINY_DEPTH):
    """float64 results of the tiny ViT's reductions (a forward to the logits: TINY_DEPTH)."""
    torch.testing.assert_close(got, want, **f64_tol(want, depth))


def close32(got, want, model, tokens=17, depth=None):
    """float32 results of a model's forward: its summed reductions (module_depth)."""
    depth = module_depth(model, tokens=tokens) if depth is None else depth
    torch.testing.assert_close(got, want, **f32_tol(want, depth))


def tiny_hf(seed: int = 2):
    from transformers import ViTConfig, ViTForImageClassification

    cfg = ViTConfig(image_size=32, patch_size=8, hidden_size=48, num_hidden_layers=3, num_attention_heads=3,
                    intermediate_size=96, num_labels=5)
    torch.manual_seed(seed)
    return randomize(ViTForImageClassification(cfg), seed)


def hand_head(model, h):
    return model.head(model.fc_norm(model.norm(h)))


# ------------------------------------------------------------------------ step 1: project
def test_project_matches_hand_forward(vit, x):
    before = model_snapshot(vit)
    with torch.no_grad():
        h0, states = hand_states(vit, x)
        logits = vit(x)
    proj = P.project(vit, x)
    B, L, N, C = x.shape[0], TINY["depth"], 17, TINY["num_classes"]
    for name in ("residual", "attention", "mlp", "mid"):
        assert getattr(proj, name).shape == (B, L, N, C)
    assert proj.logits.shape == (B, C) and proj.layout.grid == (4, 4)
    for l, (h_in, mid, out) in enumerate(states):
        close(proj.residual[:, l], hand_head(vit, out))
        close(proj.mid[:, l], hand_head(vit, mid))
        close(proj.attention[:, l], hand_head(vit, mid - h_in))
        close(proj.mlp[:, l], hand_head(vit, out - mid))
    close(proj.embedding, hand_head(vit, h0))
    # the sanity check of the paper: the last CLS state projects to the logits
    close(proj.residual[:, -1, 0], logits)
    assert_model_unchanged(vit, before)


def test_project_in_float32_is_float64_to_rounding(vit, x):
    """The float32 path a user runs: within the rounding of its reductions of the float64 projection."""
    exact = P.project(vit, x)
    got = P.project(copy.deepcopy(vit).float(), x.float())
    assert got.residual.dtype == torch.float32
    for name in ("residual", "attention", "mlp", "mid"):
        torch.testing.assert_close(getattr(got, name).double(), getattr(exact, name),
                                   **f32_tol(getattr(exact, name), TINY_DEPTH))


def test_project_hf_last_cls_is_logits(x):
    model, x = tiny_hf(), x.float()
    model.train()  # project runs in eval mode and puts the mode back
    before = model_snapshot(model)
    proj = P.project(model, x)
    assert_model_unchanged(model, before)  # (HF keeps hooks of its own after output_hidden_states)
    model.eval()
    with torch.no_grad():
        out = model(x, output_hidden_states=True)
    close32(proj.residual[:, -1, 0], out.logits, model)
    close32(proj.logits, out.logits, model)
    head = lambda h: model.classifier(model.vit.layernorm(h))  # noqa: E731
    for l in range(3):  # hidden_states[0] = embeddings, [l + 1] = after block l
        close32(proj.residual[:, l], head(out.hidden_states[l + 1]), model)
    close32(proj.embedding, head(out.hidden_states[0]), model)


def test_project_batch_is_items(vit, x):
    whole = P.project(vit, x)
    for b in range(x.shape[0]):
        one = P.project(vit, x[b:b + 1])
        for name in ("residual", "attention", "mlp"):
            close(getattr(whole, name)[b], getattr(one, name)[0])


def test_project_fc_norm_model(x):
    # a timm model whose final norm is fc_norm (applied after pooling): still head(fc_norm(norm(h)))
    model = randomize(VisionTransformer(**TINY, fc_norm=True), 3)
    assert not isinstance(model.fc_norm, torch.nn.Identity)
    x = x.float()
    proj = P.project(model, x)
    close32(proj.residual[:, -1, 0], model(x), model)


def test_project_refuses_models_it_cannot_read(x):
    x = x.float()
    with pytest.raises(ValueError, match="no class head"):
        P.project(randomize(VisionTransformer(**{**TINY, "num_classes": 0}), 0), x)
    with pytest.raises(ValueError, match="pools the patch tokens"):
        P.project(randomize(VisionTransformer(**TINY, global_pool="avg"), 0), x)
    with pytest.raises(ValueError, match="pools the patch tokens"):
        P.project(randomize(VisionTransformer(**TINY, global_pool="map"), 0), x)
    with pytest.raises(ValueError, match="distilled"):
        P.project(randomize(VisionTransformerDistilled(**TINY), 0), x)
    from transformers import ViTConfig, ViTModel

    base = ViTModel(ViTConfig(image_size=32, patch_size=8, hidden_size=48, num_hidden_layers=2,
                              num_attention_heads=3, intermediate_size=96)).eval()
    with pytest.raises(ValueError, match="no class head"):
        P.project(base, x)


# ------------------------------------------------------------------ step 2: identifiability
def test_identifiability_known_answers():
    scores = torch.tensor([[3.0, 1.0, 2.0, 0.0], [0.0, 1.0, 2.0, 3.0]])
    torch.testing.assert_close(P.identifiability(scores, 0), torch.tensor([1.0, 0.25]))
    torch.testing.assert_close(P.identifiability(scores, torch.tensor([2, 2])), torch.tensor([0.75, 0.75]))
    assert P.class_rank(scores, 3).tolist() == [3, 0]
    # share of tokens for which the class is top-1: B x N x C -> B
    tokens = torch.stack([scores, scores.flip(0)])  # 2 x 2 x 4
    torch.testing.assert_close(P.identifiable_share(tokens, torch.tensor([0, 3])), torch.tensor([0.5, 0.5]))
    torch.testing.assert_close(P.identifiable_share(tokens, 0, tokens=[0]), torch.tensor([1.0, 0.0]))


def test_class_identifiability(vit, x):
    proj = P.project(vit, x)
    pred = proj.logits.argmax(-1)
    r = P.class_identifiability(vit, x)  # predicted class
    assert r.shape == (3, TINY["depth"], 17)
    assert torch.all(r[:, -1, 0] == 1)  # the last CLS state ranks its prediction first
    # against an independent rank by sorting
    order = proj.residual.argsort(dim=-1, descending=True)
    rank = (order == pred[:, None, None, None]).to(r.dtype).argmax(-1)
    torch.testing.assert_close(r, 1 - rank.to(r.dtype) / TINY["num_classes"], rtol=0, atol=0)  # ranks: exact
    r2 = P.class_identifiability(vit, x, target=[1, 2, 3])
    for b, t in enumerate([1, 2, 3]):
        torch.testing.assert_close(r2[b], P.class_identifiability(vit, x[b:b + 1], target=t)[0])
    with pytest.raises(ValueError, match="target"):
        P.class_identifiability(vit, x, target=[1, 2])


# ------------------------------------------------------------ step 3: sublayer contributions
def test_sublayer_contributions(vit, x):
    c = P.sublayer_contributions(vit, x, target=2)
    assert c.attention.shape == c.mlp.shape == (3, TINY["depth"], 17)
    with torch.no_grad():
        h0, states = hand_states(vit, x)
        first, last = hand_head(vit, h0)[..., 2], hand_head(vit, states[-1][2])[..., 2]
        for l, (h_in, mid, out) in enumerate(states):
            ref_a = hand_head(vit, mid)[..., 2] - hand_head(vit, h_in)[..., 2]
            ref_m = hand_head(vit, out)[..., 2] - hand_head(vit, mid)[..., 2]
            close(c.attention[:, l], ref_a)
            close(c.mlp[:, l], ref_m)
    # telescoping: the contributions add up to the change from h_0 to h_L
    close((c.attention + c.mlp).sum(1), last - first)
    assert c.target.tolist() == [2, 2, 2]


def test_sublayer_contributions_hf_telescopes(x):
    model, x = tiny_hf(), x.float()
    c = P.sublayer_contributions(model, x)
    proj = P.project(model, x)
    t = proj.logits.argmax(-1)
    idx = t[:, None].expand(-1, 17)[..., None]
    total = proj.residual[:, -1].gather(-1, idx)[..., 0] - proj.embedding.gather(-1, idx)[..., 0]
    # float32 sums of 2 x 3 block contributions, each a difference of two projections (of logits)
    close32((c.attention + c.mlp).sum(1), total, model, depth=2 * 3 * module_depth(model, tokens=17))


# --------------------------------------------------------------- step 4: key-value memories
def test_value_projection_by_hand(vit):
    fc2, E, gamma = vit.blocks[1].mlp.fc2.weight, vit.head.weight, vit.norm.weight
    v = fc2.T  # hidden x D
    ref = ((v - v.mean(-1, keepdim=True)) * gamma) @ E.T
    close(P.value_projection(vit, 1), ref, depth=3 * 48)  # a mean, a centring, a product over 48
    cos = torch.stack([F.cosine_similarity(v, e[None], dim=-1) for e in E], dim=-1)
    close(P.value_projection(vit, -2, mode="cosine"), cos, depth=3 * 48)  # a dot product and two norms
    top = P.unit_top_classes(vit, 1, k=2)
    assert top.shape == (v.shape[0], 2)
    assert torch.equal(top[:, 0], ref.argmax(-1))
    with pytest.raises(ValueError, match="block"):
        P.value_projection(vit, 3)


def test_memory_agreement_by_hand(vit, x):
    before = model_snapshot(vit)
    res = P.memory_agreement(vit, x, block=2, target=[0, 1, 4], k=4)
    assert res.agreement.shape == (3, 17) and res.units.shape == (3, 17, 4)
    with torch.no_grad():
        _, states = hand_states(vit, x)
        mlp = vit.blocks[2].mlp
        acts = mlp.act(mlp.fc1(vit.blocks[2].norm2(states[2][1])))  # B x N x hidden
    units = acts.topk(4, dim=-1).indices
    assert torch.equal(res.units, units)
    top = P.value_projection(vit, 2).argmax(-1)
    ref = (top[units] == torch.tensor([0, 1, 4])[:, None, None]).to(res.agreement.dtype).mean(-1)
    torch.testing.assert_close(res.agreement, ref)  # shares of 4 units: exact
    assert_model_unchanged(vit, before)


# ------------------------------------------------------------------ step 5: projection map
def test_projection_map_by_hand(vit, x):
    t = torch.tensor([1, 3, 0])
    m = P.projection_map(vit, x, target=t)
    assert m.shape == (3, 4, 4)
    # hand-written forward whose attention matrices are kept with their gradients
    kept = []
    h = vit.norm_pre(vit._pos_embed(vit.patch_embed(x)))
    loss = 0
    for b in vit.blocks:
        a_in, attn = b.norm1(h), b.attn
        B, N, D = a_in.shape
        q, k, v = attn.qkv(a_in).reshape(B, N, 3, attn.num_heads, -1).permute(2, 0, 3, 1, 4)
        A = ((q * attn.scale) @ k.transpose(-2, -1)).softmax(-1)
        A.retain_grad()
        kept.append(A)
        h = h + attn.proj((A @ v).transpose(1, 2).reshape(B, N, D))
        h = h + b.mlp(b.norm2(h))
        loss = loss + F.cross_entropy(hand_head(vit, h[:, 0]), t, reduction="sum")
    loss.backward()
    vit.zero_grad(set_to_none=True)
    ref = -sum(A.grad[:, :, 0, 1:].sum(1) for A in kept).reshape(3, 4, 4)
    close(m, ref, depth=3 * TINY_GRAD_DEPTH)  # a loss on each of the 3 blocks' CLS state, backward
    # batch = items
    for b in range(3):
        close(P.projection_map(vit, x[b:b + 1], target=int(t[b]))[0], m[b], depth=3 * TINY_GRAD_DEPTH)


# ------------------------------------------------------------ step 6: context interventions
@pytest.mark.parametrize("mode", ["self_only", "no_cls"])
@pytest.mark.parametrize("start_block", [0, 1])
def test_context_intervention_matches_masked_copy(vit, x, mode, start_block):
    before = model_snapshot(vit)
    params = [p.detach().clone() for p in vit.parameters()]
    proj = P.context_intervention(vit, x, mode, start_block=start_block)
    N = 17
    allowed = torch.ones(N, N, dtype=torch.bool)
    if mode == "self_only":
        allowed[1:] = torch.eye(N, dtype=torch.bool)[1:]
    else:
        allowed[1:, 0] = False
    masked = copy.deepcopy(vit)
    with torch.no_grad():
        _, states = hand_states(masked, x, allowed=[None if l < start_block else allowed for l in range(3)])
        for l, (_, mid, out) in enumerate(states):
            close(proj.residual[:, l], hand_head(masked, out))
            close(proj.mid[:, l], hand_head(masked, mid))
    torch.testing.assert_close(proj.logits, proj.residual[:, -1, 0])  # the same numbers
    assert_model_unchanged(vit, before)
    assert all(torch.equal(p, q) for p, q in zip(vit.parameters(), params))
    # the unedited model still gives its own logits
    with torch.no_grad():
        close(P.project(vit, x).logits, vit(x))


def test_context_intervention_hf_matches_model_mask(x):
    model, x = tiny_hf(), x.float()
    before = model_snapshot(model)
    proj = P.context_intervention(model, x, "self_only")
    assert_model_unchanged(model, before)
    mask = P.intervention_mask("self_only", proj.layout)
    bias = torch.zeros(1, 1, 17, 17).masked_fill(~mask, float("-inf"))
    eager = copy.deepcopy(model)
    eager.config._attn_implementation = "eager"
    with torch.no_grad():
        ref = eager(x, attention_mask=bias).logits
    close32(proj.logits, ref, model)
    assert not torch.allclose(proj.logits, model(x).logits, **f32_tol(ref, module_depth(model, tokens=17)))


def test_attention_edit_model_unchanged_when_forward_raises(vit, x):
    import vitlab

    before = model_snapshot(vit)
    expected = vit(x)

    def broken(layer, n):
        if layer == 1:
            raise ZeroDivisionError("edit failed")
        return torch.ones(n, n, dtype=torch.bool)

    with pytest.raises(ZeroDivisionError):
        with vitlab.record(vit, attention_edit=broken, residual=True):
            vit(x)
    assert_model_unchanged(vit, before)
    torch.testing.assert_close(vit(x), expected)
    # a mask that allows everything changes nothing; a query with no key is refused
    with torch.no_grad(), vitlab.record(vit, attention_edit=lambda l, n: torch.ones(n, n, dtype=torch.bool)):
        close(vit(x), expected)
    with pytest.raises(ValueError, match="no key"):
        with vitlab.record(vit, attention_edit=lambda l, n: torch.zeros(n, n, dtype=torch.bool)):
            vit(x)
    assert_model_unchanged(vit, before)
    with pytest.raises(ValueError, match="mode"):
        P.context_intervention(vit, x, "nothing")


def test_exported():
    import vitlab

    assert vitlab.project is P.project and vitlab.projection is P
    assert "project" in vitlab.__all__ and "projection" in vitlab.__all__


def test_hf_deit_projected_and_teacher_refused(x):
    from transformers import DeiTConfig, DeiTForImageClassification, DeiTForImageClassificationWithTeacher

    cfg = DeiTConfig(image_size=32, patch_size=8, hidden_size=48, num_hidden_layers=2, num_attention_heads=3,
                     intermediate_size=96, num_labels=5)
    torch.manual_seed(4)
    deit = randomize(DeiTForImageClassification(cfg), 4)  # CLS + distillation token, classifier on CLS
    x = x.float()
    proj = P.project(deit, x)
    assert proj.residual.shape == (3, 2, 18, 5)
    with torch.no_grad():
        close32(proj.residual[:, -1, 0], deit(x).logits, deit, tokens=18)
    with pytest.raises(ValueError, match="distilled"):
        P.project(randomize(DeiTForImageClassificationWithTeacher(cfg), 4), x)


def test_hf_dinov2_classifier_refused(x):
    x = x.float()
    from transformers import Dinov2Config, Dinov2ForImageClassification

    cfg = Dinov2Config(image_size=32, patch_size=8, hidden_size=48, num_hidden_layers=2, num_attention_heads=3,
                       mlp_ratio=2, num_labels=5)
    with pytest.raises(ValueError, match="mean of the patches"):
        P.project(Dinov2ForImageClassification(cfg).eval(), x)


# ------------------------------------------------------- step 7: linear probes (paper RQ4)
def test_train_probe_separable_reaches_full_accuracy():
    g = torch.Generator().manual_seed(11)
    centres = torch.randn(4, 16, generator=g) * 5
    labels = torch.arange(4).repeat_interleave(50)
    states = centres[labels] + torch.randn(200, 16, generator=g) * 0.5 + 100  # far from 0, large offset
    assert (torch.cdist(centres, centres) + torch.eye(4) * 1e3).min() > 4  # well apart: linearly separable
    weight, bias, acc, loss = P.train_probe(states, labels, num_classes=6, epochs=200, lr=0.05)
    assert weight.shape == (6, 16) and bias.shape == (6,)
    assert acc == 1.0 and loss < 0.1
    # the folded standardisation: raw states through weight, bias classify them all
    assert torch.equal((states @ weight.T + bias).argmax(-1), labels)
    with pytest.raises(ValueError, match="labels"):
        P.train_probe(states, labels.float(), 4)
    with pytest.raises(ValueError, match="classes in 0 .. 2"):
        P.train_probe(states, labels, 3)
    with pytest.raises(ValueError, match="epochs"):
        P.train_probe(states, labels, 4, epochs=0)
    with pytest.raises(ValueError, match="lr"):
        P.train_probe(states, labels, 4, lr=-1.0)


def test_linear_probes_on_vit(vit, x):
    before = model_snapshot(vit)
    params = [p.detach().clone() for p in vit.parameters()]
    target = [1, 4, 1]
    probes = P.linear_probes(vit, x, target, epochs=50)
    L, C, D = TINY["depth"], TINY["num_classes"], TINY["embed_dim"]
    assert probes.weight.shape == (L, C, D) and probes.bias.shape == (L, C)
    assert probes.train_accuracy.shape == probes.train_loss.shape == (L,)
    assert_model_unchanged(vit, before)
    assert all(torch.equal(p, q) for p, q in zip(vit.parameters(), params))
    # train accuracy recomputed from the probes on the image tokens' states, by hand
    states = P.project(vit, x).block_outputs  # B x L x N x D
    by_hand = torch.einsum("blnd,lcd->blnc", states, probes.weight) + probes.bias[None, :, None]
    close(P.probe_logits(probes, states), by_hand, depth=48 + 1)  # a dot product over 48, a bias
    close(probes.logits(states[:, 1], block=1), states[:, 1] @ probes.weight[1].T + probes.bias[1], depth=48 + 1)
    close(P.probe_logits(probes, states[0, 2, 3], block=-1), states[0, 2, 3] @ probes.weight[2].T + probes.bias[2],
          depth=48 + 1)
    hits = by_hand[:, :, 1:].argmax(-1) == torch.tensor(target)[:, None, None]
    # shares of 48 hits, each side rounded once to the accuracy's dtype
    torch.testing.assert_close(probes.train_accuracy, hits.to(probes.train_accuracy.dtype).mean(dim=(0, 2)),
                               **f32_tol(1.0, 1))
    # cls / all tokens; one int for every sample
    cls = P.linear_probes(vit, x, 2, tokens="cls", epochs=50)
    assert cls.train_accuracy.tolist() == [1.0] * L and cls.tokens == "cls"
    with pytest.raises(ValueError, match="states must be B x 3 x N x 48"):
        P.probe_logits(probes, states[:, :2])
    with pytest.raises(ValueError, match="block"):
        P.probe_logits(probes, states[:, 0], block=3)
    with pytest.raises(ValueError, match="needs target"):
        P.linear_probes(vit, x, None)
    with pytest.raises(ValueError, match="target"):
        P.linear_probes(vit, x, [1, 2])
    with pytest.raises(ValueError, match="outside the model's classes"):
        P.linear_probes(vit, x, [1, 2, 5])
    with pytest.raises(ValueError, match="tokens"):
        P.linear_probes(vit, x, 1, tokens="patches")
    with pytest.raises(ValueError, match="lr"):
        P.linear_probes(vit, x, 1, lr=0)
    with pytest.raises(ValueError, match="seed"):
        P.linear_probes(vit, x, 1, seed=1.5)
    assert_model_unchanged(vit, before)


def test_linear_probes_deterministic_per_seed(vit, x):
    a = P.linear_probes(vit, x, [0, 1, 2], epochs=20, seed=3)
    b = P.linear_probes(vit, x, [0, 1, 2], epochs=20, seed=3)
    c = P.linear_probes(vit, x, [0, 1, 2], epochs=20, seed=4)
    assert torch.equal(a.weight, b.weight) and torch.equal(a.bias, b.bias)
    assert torch.equal(a.train_accuracy, b.train_accuracy)
    assert not torch.equal(a.weight, c.weight)
    with torch.inference_mode():  # trains with gradients anyway, to the same probes
        d = P.linear_probes(vit, x, [0, 1, 2], epochs=20, seed=3)
    torch.testing.assert_close(d.weight, a.weight)


# ------------------------------------------------------------ step 8: token removal (RQ4)
def test_token_removal_matches_masked_copy(vit, x):
    before = model_snapshot(vit)
    params = [p.detach().clone() for p in vit.parameters()]
    ranking = torch.randn(3, 16, generator=torch.Generator().manual_seed(5))
    target = torch.tensor([0, 3, 1])
    for remove in ("highest", "lowest"):
        res = P.token_removal(vit, x, ranking, 0.25, target=target, remove=remove)
        # by hand: the 4 tokens per sample with the highest / lowest scores
        idx = ranking.topk(4, dim=-1, largest=remove == "highest").indices
        gone = torch.zeros(3, 16, dtype=torch.bool).scatter(1, idx, True)
        assert torch.equal(res.removed, gone)
        allowed = torch.ones(3, 1, 17, 17, dtype=torch.bool)
        allowed[..., 1:] = ~gone[:, None, None, :]
        masked = copy.deepcopy(vit)
        with torch.no_grad():
            _, states = hand_states(masked, x, allowed=[allowed] * 3)
            ref = hand_head(masked, states[-1][2][:, 0])
        close(res.logits, ref)
        assert torch.equal(res.predicted, ref.argmax(-1)) and torch.equal(res.target, target)
        assert torch.equal(res.correct, ref.argmax(-1) == target)
        assert res.accuracy == pytest.approx(float((ref.argmax(-1) == target).float().mean()))
        # batch = items
        for b in range(3):
            one = P.token_removal(vit, x[b:b + 1], ranking[b:b + 1], 0.25, target=int(target[b]), remove=remove)
            close(one.logits[0], res.logits[b])
            assert torch.equal(one.removed[0], res.removed[b])
    with torch.no_grad():
        plain = vit(x)
    assert not torch.allclose(res.logits, plain, **f64_tol(plain, TINY_DEPTH))  # it did remove something
    assert_model_unchanged(vit, before)
    assert all(torch.equal(p, q) for p, q in zip(vit.parameters(), params))
    close(P.project(vit, x).logits, plain)


def test_token_removal_edges(vit, x):
    with torch.no_grad():
        plain = vit(x)
    ranking = torch.arange(48.0).reshape(3, 4, 4)  # a B x gh x gw map works too
    none = P.token_removal(vit, x, ranking, 0.0)
    close(none.logits, plain)
    assert not none.removed.any() and none.correct.all()  # target None: the unedited prediction
    assert torch.equal(none.target, plain.argmax(-1))
    # everything removed: only CLS is left to read, identical whichever way the tokens are ranked
    everything = P.token_removal(vit, x, ranking, 1.0, remove="lowest")
    assert everything.removed.all()
    close(everything.logits, P.token_removal(vit, x, -ranking, 1.0).logits)
    # ties go to the earlier token
    tied = P.token_removal(vit, x, torch.zeros(3, 16), 2 / 16)
    assert tied.removed[:, :2].all() and not tied.removed[:, 2:].any()
    with pytest.raises(ValueError, match="fraction"):
        P.token_removal(vit, x, ranking, 1.5)
    with pytest.raises(ValueError, match="ranking"):
        P.token_removal(vit, x, torch.zeros(3, 17), 0.5)
    with pytest.raises(ValueError, match="ranking must be finite"):
        P.token_removal(vit, x, torch.full((3, 16), float("nan")), 0.5)
    with pytest.raises(ValueError, match="remove"):
        P.token_removal(vit, x, ranking, 0.5, remove="top")
    with pytest.raises(ValueError, match="target"):
        P.token_removal(vit, x, ranking, 0.5, target=[1, 2])


# ------------------------------------------------- step 9: blocks= / tokens= / one class (speed)
FIELDS = ("residual", "mid", "attention", "mlp", "entering")


def test_project_blocks_tokens_are_slices_of_the_full_projection(vit, x):
    before = model_snapshot(vit)
    full = P.project(vit, x)
    assert full.blocks == (0, 1, 2) and full.tokens == tuple(range(17)) and full.num_blocks == 3
    # entering: the embedding, then the residual stream of the block before
    close(full.entering[:, 0], full.embedding)
    close(full.entering[:, 1:], full.residual[:, :-1])
    cases = [(None, None, (0, 1, 2), tuple(range(17))), (-1, None, (2,), tuple(range(17))),
             ([2, 0], None, (2, 0), tuple(range(17))), (range(1, 3), 0, (1, 2), (0,)),
             ((0, -2), [16, 0, 5], (0, 1), (16, 0, 5)), (torch.tensor([1]), torch.tensor([-1, 3]), (1,), (16, 3)),
             (None, [0], (0, 1, 2), (0,))]
    for blocks, tokens, b, t in cases:
        sub = P.project(vit, x, blocks=blocks, tokens=tokens)
        assert sub.blocks == b and sub.tokens == t
        rows = full.block_outputs[:, list(b)][:, :, list(t)]
        assert torch.equal(sub.block_outputs, rows)  # the recorded states themselves
        for name in FIELDS:
            got = getattr(sub, name)
            assert got.shape == (3, len(b), len(t), TINY["num_classes"])
            close(got, getattr(full, name)[:, list(b)][:, :, list(t)])
        close(sub.embedding, full.embedding[:, list(t)])
        close(sub.logits, full.logits)
    # against the hand-written forward, not only the full projection: blocks 2 and 0, tokens 0 and 9
    with torch.no_grad():
        _, states = hand_states(vit, x)
        sub = P.project(vit, x, blocks=[2, 0], tokens=[0, 9])
        for i, l in enumerate((2, 0)):
            h_in, mid, out = (s[:, [0, 9]] for s in states[l])
            close(sub.residual[:, i], hand_head(vit, out))
            close(sub.mlp[:, i], hand_head(vit, out - mid))
            close(sub.entering[:, i], hand_head(vit, h_in))
        # the last block's CLS state alone still reproduces the logits
        last = P.project(vit, x, blocks=-1, tokens=0)
        close(last.residual[:, 0, 0], vit(x))
    assert_model_unchanged(vit, before)


def test_project_blocks_tokens_refused(vit, x):
    before = model_snapshot(vit)
    bad = [(dict(blocks=3), "block 3 does not exist; this model has 3 blocks"),
           (dict(blocks=[0, -4]), "block -4 does not exist"),
           (dict(blocks=[]), "blocks is empty"),
           (dict(blocks=range(0)), "blocks is empty"),
           (dict(blocks=[1, 1]), "asks for block 1 twice"),
           (dict(blocks=[2, -1]), "asks for block 2 twice"),
           (dict(blocks=1.0), "blocks must be None"),
           (dict(blocks=[0, 1.5]), "blocks must hold ints"),
           (dict(blocks=[True]), "blocks must hold ints"),
           (dict(blocks="0"), "blocks must be None"),
           (dict(blocks=torch.tensor([[0]])), "1-D"),
           (dict(tokens=17), "token 17 does not exist; this model has 17 tokens"),
           (dict(tokens=[0, 0]), "asks for token 0 twice"),
           (dict(tokens=torch.tensor([], dtype=torch.long)), "tokens is empty")]
    for kwargs, message in bad:
        with pytest.raises(ValueError, match=message):
            P.project(vit, x, **kwargs)
    with pytest.raises(ValueError, match="blocks is empty"):
        P.class_identifiability(vit, x, blocks=[])
    with pytest.raises(ValueError, match="block 5 does not exist"):
        P.sublayer_contributions(vit, x, blocks=5)
    with pytest.raises(ValueError, match="asks for block 0 twice"):
        P.context_intervention(vit, x, "no_cls", blocks=[0, -3])
    with pytest.raises(ValueError, match="block 3 does not exist"):
        P.linear_probes(vit, x, 1, epochs=5, blocks=[3])
    nan = x.clone()
    nan[1, 0, 0, 0] = float("nan")
    for fn in (P.project, P.class_identifiability, P.sublayer_contributions):
        with pytest.raises(ValueError, match="NaN"):
            fn(vit, nan, blocks=-1)
    assert_model_unchanged(vit, before)


def test_project_blocks_batch_is_items(vit, x):
    whole = P.project(vit, x, blocks=[2, 0], tokens=[0, 7, 16])
    for b in range(x.shape[0]):
        one = P.project(vit, x[b:b + 1], blocks=[2, 0], tokens=[0, 7, 16])
        for name in FIELDS + ("embedding",):
            close(getattr(whole, name)[b], getattr(one, name)[0])


def test_project_blocks_hf(x):
    model, x = tiny_hf(), x.float()
    model.train()
    before = model_snapshot(model)
    full = P.project(model, x)
    sub = P.project(model, x, blocks=[-1, 0], tokens=0)
    assert_model_unchanged(model, before)
    close32(sub.residual[:, 0, 0], full.logits, model)
    for name in FIELDS:
        close32(getattr(sub, name), getattr(full, name)[:, [2, 0]][:, :, [0]], model)


def test_class_logit_is_the_fields_column(vit, x):
    proj = P.project(vit, x, blocks=[0, 2])
    t = torch.tensor([4, 0, 2])
    for name in FIELDS + ("embedding",):
        got = proj.class_logit(name, t)
        full = getattr(proj, name)  # B x L' x N x C (B x N x C for the embedding)
        ref = torch.stack([full[b, ..., t[b]] for b in range(3)])
        close(got, ref)
    close(proj.class_logit("residual", 1), proj.residual[..., 1])
    with pytest.raises(ValueError, match="needs target"):
        proj.class_logit("residual", None)
    with pytest.raises(ValueError, match="outside the model's classes"):
        proj.class_logit("residual", 5)
    with pytest.raises(ValueError, match="field must be one of"):
        proj.class_logit("logits", 1)


def test_functions_pass_blocks_through(vit, x):
    full = P.project(vit, x)
    pred = full.logits.argmax(-1)
    # identifiability, block by block, against the rank of the full projection's logits
    r = P.class_identifiability(vit, x, blocks=[2, 1], tokens=[0, 3])
    torch.testing.assert_close(r, P.identifiability(full.residual[:, [2, 1]][:, :, [0, 3]], pred))
    torch.testing.assert_close(P.class_identifiability(vit, x, target=[1, 2, 3]),
                               P.identifiability(full.residual, torch.tensor([1, 2, 3])))
    sub = P.project(vit, x, blocks=0)
    r0 = sub.identifiability(2)  # block by block, before .residual is read
    torch.testing.assert_close(r0, P.identifiability(sub.residual, 2))
    torch.testing.assert_close(sub.identifiability(2), r0)  # and from the field once it is read
    # contributions of the asked blocks equal the full ones
    c = P.sublayer_contributions(vit, x, target=2)
    s = P.sublayer_contributions(vit, x, target=2, blocks=[2, 0], tokens=[5, 0])
    close(s.attention, c.attention[:, [2, 0]][:, :, [5, 0]])
    close(s.mlp, c.mlp[:, [2, 0]][:, :, [5, 0]])
    # context intervention: the kept blocks of the full intervention
    ci = P.context_intervention(vit, x, "self_only", start_block=1)
    cs = P.context_intervention(vit, x, "self_only", start_block=1, blocks=[-1], tokens=[0, 1])
    close(cs.residual, ci.residual[:, [2]][:, :, [0, 1]])
    close(cs.logits, ci.logits)
    # probes of two blocks: the full call's probes for those blocks
    probes = P.linear_probes(vit, x, [1, 4, 1], epochs=20)
    two = P.linear_probes(vit, x, [1, 4, 1], epochs=20, blocks=[2, 0])
    assert probes.blocks == (0, 1, 2) and two.blocks == (2, 0)
    # probes trained on the same states: the same SGD steps (20 epochs over sums of 48 products)
    close(two.weight, probes.weight[[2, 0]], depth=20 * TINY_DEPTH)
    close(two.bias, probes.bias[[2, 0]], depth=20 * TINY_DEPTH)
    torch.testing.assert_close(two.train_accuracy, probes.train_accuracy[[2, 0]])
    states = P.project(vit, x, blocks=[2, 0]).block_outputs
    close(P.probe_logits(two, states), P.probe_logits(probes, full.block_outputs)[:, [2, 0]], depth=21 * TINY_DEPTH)


# ------------------------------------------ identifiability: NaN scores, targets of the wrong shape
def test_identifiability_refuses_nan_scores_instead_of_calling_them_top1():
    scores = torch.tensor([[float("nan"), 1.0, 2.0], [0.0, 1.0, 2.0]])
    for fn in (P.identifiability, P.class_rank, P.identifiable_share):
        with pytest.raises(ValueError, match="non-finite"):
            fn(scores, 0)
    with pytest.raises(ValueError, match="non-finite"):
        P.identifiability(torch.tensor([[float("inf"), 0.0]]), 1)


def test_identifiability_refuses_a_target_of_the_wrong_shape():
    scores = torch.randn(2, 3, 4, 5, generator=torch.Generator().manual_seed(0))  # B x L x N x C
    ok = P.identifiability(scores, torch.tensor([1, 2]))  # one per sample, broadcast
    torch.testing.assert_close(ok, P.identifiability(scores, torch.tensor([1, 2])[:, None, None].expand(2, 3, 4)))
    torch.testing.assert_close(P.identifiability(scores, 3), P.identifiability(scores, torch.full((2, 3, 4), 3)))
    for bad in (torch.tensor([1, 2, 3]), torch.zeros(2, 3, dtype=torch.long), torch.zeros(3, 4, dtype=torch.long),
                torch.zeros(2, 1, dtype=torch.long)):
        with pytest.raises(ValueError, match=r"target has shape .* take one int"):
            P.identifiability(scores, bad)
    with pytest.raises(ValueError, match="target has shape"):
        P.class_rank(torch.randn(3, 5), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="integer class"):
        P.identifiability(scores, 1.0)
    with pytest.raises(ValueError, match="class in 0 .. 4"):
        P.identifiability(scores, 5)


# ------------------------------------------------ attention as key-value memories (Fig. 1b)
def test_attention_coefficients_rebuild_the_attention_sublayer(vit, x):
    before = model_snapshot(vit)
    coeff = P.attention_coefficients(vit, x, block=1)
    assert coeff.shape == (3, 17, TINY["embed_dim"])
    with torch.no_grad():
        _, states = hand_states(vit, x)
        b = vit.blocks[1]
        a_in = b.norm1(states[1][0])
        B, N, D = a_in.shape
        q, k, v = b.attn.qkv(a_in).reshape(B, N, 3, b.attn.num_heads, -1).permute(2, 0, 3, 1, 4)
        A = ((q * b.attn.scale) @ k.transpose(-2, -1)).softmax(-1)
        ref = torch.einsum("bfnm,bfmi->bnfi", A, v).reshape(B, N, D)  # sum_m A_f[n, m] V_f[m, i]
    close(coeff, ref)
    # coefficients times the values (columns of W_O), plus b_O: what the sublayer adds
    added = states[1][1] - states[1][0]
    close(coeff @ b.attn.proj.weight.T + b.attn.proj.bias, added, depth=TINY_DEPTH + 48)
    for i in range(3):  # batch = items
        close(P.attention_coefficients(vit, x[i:i + 1], 1)[0], coeff[i])
    assert_model_unchanged(vit, before)


def test_attention_value_projection_by_hand(vit):
    W_O, E, gamma = vit.blocks[2].attn.proj.weight, vit.head.weight, vit.norm.weight
    v = W_O.T  # memory j's value = column j of W_O
    D = v.shape[1]
    centre = torch.eye(D, dtype=W_O.dtype) - torch.full((D, D), 1 / D, dtype=W_O.dtype)  # LayerNorm's centering
    ref = E @ torch.diag(gamma) @ centre @ W_O  # C x memories
    close(P.attention_value_projection(vit, 2), ref.T, depth=3 * 48)  # three products over 48
    cos = F.normalize(v, dim=-1) @ F.normalize(E, dim=-1).T
    close(P.attention_value_projection(vit, 2, mode="cosine"), cos, depth=3 * 48)
    assert torch.equal(P.unit_top_classes(vit, 2, 1, sublayer="attention")[:, 0], ref.T.argmax(-1))
    with pytest.raises(ValueError, match="sublayer"):
        P.unit_top_classes(vit, 2, sublayer="mha")
    with pytest.raises(ValueError, match="mode"):
        P.attention_value_projection(vit, 2, mode="dot")


def test_attention_memory_agreement_by_hand(vit, x):
    before = model_snapshot(vit)
    res = P.memory_agreement(vit, x, block=1, target=[0, 1, 4], k=5, sublayer="attention")
    assert res.agreement.shape == (3, 17) and res.units.shape == (3, 17, 5)
    coeff = P.attention_coefficients(vit, x, 1)
    units = coeff.topk(5, dim=-1).indices
    assert torch.equal(res.units, units)
    top = P.attention_value_projection(vit, 1).argmax(-1)
    ref = (top[units] == torch.tensor([0, 1, 4])[:, None, None]).to(res.agreement.dtype).mean(-1)
    torch.testing.assert_close(res.agreement, ref)  # shares of 5 units: exact
    for i in range(3):  # batch = items
        one = P.memory_agreement(vit, x[i:i + 1], 1, target=[0, 1, 4][i], k=5, sublayer="attention")
        assert torch.equal(one.units[0], res.units[i])
    every = P.memory_agreement(vit, x, None, target=[0, 1, 4], k=5, sublayer="attention")  # all blocks at once
    assert every.agreement.shape == (3, TINY["depth"], 17)
    torch.testing.assert_close(every.agreement[:, 1], res.agreement)
    for sub in ("mlp", "attention"):
        every = P.memory_agreement(vit, x, None, target=2, k=3, sublayer=sub)
        for b in range(TINY["depth"]):
            one = P.memory_agreement(vit, x, b, target=2, k=3, sublayer=sub)
            assert torch.equal(every.units[:, b], one.units) and torch.equal(every.agreement[:, b], one.agreement)
    assert_model_unchanged(vit, before)


# ------------------------------------------------- the token-removal test against random removal
def test_removal_curve_is_token_removal_at_each_fraction(vit, x):
    before = model_snapshot(vit)
    ranking = torch.randn(3, 16, generator=torch.Generator().manual_seed(3))
    target = torch.tensor([0, 3, 1])
    fractions = (0.0, 0.25, 0.5, 1.0)
    curve = P.removal_curve(vit, x, ranking, target, "lowest", fractions)
    assert curve.correct.shape == (3, 4) and curve.remove == "lowest"
    for i, f in enumerate(fractions):
        assert torch.equal(curve.correct[:, i], P.token_removal(vit, x, ranking, f, target, remove="lowest").correct)
    acc = curve.correct.double().mean(0).numpy()
    span = fractions[-1] - fractions[0]
    trapezoid = sum((acc[i] + acc[i + 1]) / 2 * (fractions[i + 1] - fractions[i]) for i in range(3))
    assert curve.auc == pytest.approx(trapezoid / span)
    assert float(curve.sample_auc.mean()) == pytest.approx(curve.auc)  # the mean of the samples' AUCs
    for b in range(3):  # batch = items
        one = P.removal_curve(vit, x[b:b + 1], ranking[b:b + 1], int(target[b]), "lowest", fractions)
        assert torch.equal(one.correct[0], curve.correct[b])
    predicted = P.removal_curve(vit, x, ranking, None, "highest", fractions)
    assert predicted.correct[:, 0].all()  # nothing removed: the model's own prediction
    for bad in ((0.5,), (0.0, float("nan")), (0.5, 0.2), (0.0, 1.5)):
        with pytest.raises(ValueError, match="fractions"):
            P.removal_curve(vit, x, ranking, target, fractions=bad)
    assert_model_unchanged(vit, before)


def test_removal_table_intervals_are_the_stats_modules():
    from vitlab.stats import mean_interval, paired_difference

    correct = lambda rows: torch.tensor(rows, dtype=torch.bool)  # noqa: E731
    f = torch.tensor([0.0, 0.5, 1.0])
    curve = lambda rows: P.RemovalCurve(f, correct(rows), torch.zeros(len(rows), dtype=torch.long), "highest")  # noqa: E731
    top = curve([[1, 0, 0]] * 5 + [[1, 1, 0]] * 3)
    rand = [curve([[1, 1, 0]] * 4 + [[1, 1, 1]] * 4), curve([[1, 1, 1]] * 6 + [[1, 0, 0]] * 2)]
    test = P.RemovalTest({"map": top}, {}, rand)
    rows = test.table(n_boot=500, seed=3)
    random_auc = test.random_sample_auc
    assert rows[0]["AUC 95% interval"] == mean_interval(random_auc, 0.95, 500, 3)[1:3]
    assert rows[1]["AUC 95% interval"] == mean_interval(top.sample_auc, 0.95, 500, 3)[1:3]
    diff = paired_difference(top.sample_auc, random_auc, 0.95, 500, 3)
    assert rows[1]["AUC - random"] == diff.value and rows[1]["difference 95% interval"] == (diff.low, diff.high)
    with pytest.raises(AttributeError, match="bootstrap_interval was replaced by vitlab.stats.mean_interval"):
        P.bootstrap_interval


def test_removal_test_directions_and_paired_differences(vit, x):
    ranking = torch.randn(3, 16, generator=torch.Generator().manual_seed(4))
    fractions = (0.0, 0.5, 1.0)
    res = P.removal_test(vit, x, {"r": ranking}, target=[0, 3, 1], fractions=fractions, n_random=2, seed=1)
    # removing the lowest of r first is removing the highest of -r first
    flipped = P.removal_curve(vit, x, -ranking, [0, 3, 1], "highest", fractions)
    assert torch.equal(res.negative["r"].correct, flipped.correct)
    assert len(res.random) == 2
    rows = {(row["ranking"], row["removed first"]): row for row in res.table(n_boot=200)}
    rand = float(res.random_sample_auc.mean())
    assert rows[("random", "random")]["AUC"] == pytest.approx(rand)
    for direction, curve in (("highest", res.positive["r"]), ("lowest", res.negative["r"])):
        row = rows[("r", direction)]
        assert row["AUC"] == pytest.approx(curve.auc)
        assert row["AUC - random"] == pytest.approx(curve.auc - rand)
        low, high = row["difference 95% interval"]
        assert low <= row["AUC - random"] + 1e-12 and row["AUC - random"] <= high + 1e-12
    again = P.removal_test(vit, x, {"r": ranking}, target=[0, 3, 1], fractions=fractions, n_random=2, seed=1)
    assert all(torch.equal(a.correct, b.correct) for a, b in zip(res.random, again.random))  # seeded
    with pytest.raises(ValueError, match="rankings"):
        P.removal_test(vit, x, {}, fractions=fractions)


def test_ridge_probes_solve_the_ridge_problem_per_block_and_token():
    g = torch.Generator().manual_seed(0)
    M, L, N, D, C = 12, 2, 3, 5, 4
    states = torch.randn(M, L, N, D, generator=g)
    labels = torch.arange(M) % C
    probes = P.ridge_probes(states, labels, C, alpha=0.7)
    assert probes.weight.shape == (L, N, C, D) and probes.bias.shape == (L, N, C)
    Y = -torch.ones(M, C, dtype=torch.float64)
    Y[torch.arange(M), labels] = 1
    for l in range(L):
        for n in range(N):
            # independently: least squares on [X 1; sqrt(alpha) I 0] (intercept not penalised)
            X = states[:, l, n].double()
            A = torch.cat([torch.cat([X, torch.ones(M, 1, dtype=torch.float64)], 1),
                           torch.cat([0.7 ** 0.5 * torch.eye(D, dtype=torch.float64),
                                      torch.zeros(D, 1, dtype=torch.float64)], 1)])
            sol = torch.linalg.lstsq(A, torch.cat([Y, torch.zeros(D, C, dtype=torch.float64)])).solution
            # solved in float64 (to ~kappa^2 * 1e-16), returned in float32: one rounding
            torch.testing.assert_close(probes.weight[l, n].double(), sol[:D].T, **f32_tol(sol, 1))
            torch.testing.assert_close(probes.bias[l, n].double(), sol[D], **f32_tol(sol, 1))
    scores = probes.scores(states)
    tol = f32_tol(scores, D + 1)  # float32 dot products over 5 and a bias
    torch.testing.assert_close(scores[:, 1, 2], states[:, 1, 2] @ probes.weight[1, 2].T + probes.bias[1, 2], **tol)
    for i in range(3):  # a batch scores as its items
        torch.testing.assert_close(probes.scores(states[i:i + 1])[0], scores[i], **tol)
    with pytest.raises(ValueError, match="labels"):
        P.ridge_probes(states, labels[:-1], C)
    with pytest.raises(ValueError, match="finite"):
        P.ridge_probes(states.clone().fill_(float("nan")), labels, C)
    with pytest.raises(ValueError, match="states must be B x 2 x 3 x 5"):
        probes.scores(states[:, :1])


def test_permutation_test_against_exact_enumeration():
    import itertools

    first, second = [3.0, 4.0, 5.5], [1.0, 2.0, 3.5, 0.5]
    pooled = first + second
    observed = sum(first) / 3 - sum(second) / 4
    diffs = []
    for pick in itertools.combinations(range(7), 3):  # every split of the 7 values into 3 + 4
        a = [pooled[i] for i in pick]
        b = [pooled[i] for i in range(7) if i not in pick]
        diffs.append(sum(a) / 3 - sum(b) / 4)
    exact_greater = sum(d >= observed - 1e-12 for d in diffs) / len(diffs)
    exact_two = sum(abs(d) >= abs(observed) - 1e-12 for d in diffs) / len(diffs)
    res = P.permutation_test(first, second, n_perm=20000, seed=3)
    assert res.difference == pytest.approx(observed)
    assert res.p_greater == pytest.approx(exact_greater, abs=0.01)
    assert res.p_two_sided == pytest.approx(exact_two, abs=0.01)
    exact_less = sum(d <= observed + 1e-12 for d in diffs) / len(diffs)
    assert res.p_less == pytest.approx(exact_less, abs=0.01) and res.p_less > 0.9  # first is the higher group
    flipped = P.permutation_test(second, first, n_perm=20000, seed=3)
    assert flipped.difference == pytest.approx(-observed) and flipped.p_less == pytest.approx(exact_greater, abs=0.01)
    with pytest.raises(ValueError, match="both groups"):
        P.permutation_test([], [1.0])
    with pytest.raises(ValueError, match="finite"):
        P.permutation_test([1.0, float("nan")], [1.0])


def test_removal_curves_leave_removed_tokens_out_as_the_mask_does(vit, x):
    """The removal test runs a timm ViT that reads its class token on the kept tokens only
    (nothing reads a removed one): the logits are the masked forward's, at every fraction, for
    every order, a (sample, removed set) shared by several curves runs once, and the model is
    left as it was. Models where a removed token still counts (an average-pooled output) keep
    the masked forward."""
    before = model_snapshot(vit)
    layout = P.token_layout(vit, x)
    assert P._drops_removed_tokens(vit, layout)
    ranking = torch.randn(3, 16, generator=torch.Generator().manual_seed(11), dtype=torch.float64)
    for f in (0.0, 0.25, 0.5, 15 / 16, 1.0):
        for remove in ("highest", "lowest"):
            gone = P._removed_by_rank(ranking.float(), f, remove)
            want = P.remove_tokens(vit, x, gone, target=0).logits
            got = P._kept_token_logits(vit, x, torch.arange(3), gone, layout)
            close(got.double(), want)
            # the rows in another order, each sample's twice: the same logits
            rows = torch.tensor([2, 0, 1, 2])
            close(P._kept_token_logits(vit, x, rows, gone[rows], layout).double(), want[rows])
    fractions = (0.0, 0.25, 0.5, 1.0)
    t, curves = P._removal_curves(vit, x, torch.tensor([0, 3, 1]), layout,
                                  [(ranking.float(), "highest"), (ranking.float(), "highest"), (-ranking.float(), "lowest")],
                                  torch.tensor(fractions, dtype=torch.float64))
    assert torch.equal(curves[0], curves[1]) and torch.equal(curves[0], curves[2]) and torch.equal(t, torch.tensor([0, 3, 1]))
    for i, f in enumerate(fractions):
        assert torch.equal(curves[0][:, i], P.token_removal(vit, x, ranking, f, [0, 3, 1]).correct)
    assert_model_unchanged(vit, before)

    pooled = randomize(VisionTransformer(**TINY, global_pool="avg"), 0).double()
    assert not P._drops_removed_tokens(pooled, P.token_layout(pooled, x))
    curve = P.removal_curve(pooled, x, ranking, None, "highest", fractions)
    for i, f in enumerate(fractions):
        assert torch.equal(curve.correct[:, i], P.token_removal(pooled, x, ranking, f).correct)


@pytest.mark.parametrize("arch", ["post-norm blocks", "layer scale and registers"])
def test_kept_token_logits_in_chunks_and_block_kinds_equal_the_masked_forward(x, arch):
    """Leaving removed tokens out (the last block's MLP run for the prefix tokens only, rows cut
    into chunks of at most ``max_tokens`` tokens) gives the masked forward's logits, for timm's
    post-norm ``ResPostBlock`` and for pre-norm blocks with layer scale and register tokens
    (three prefix tokens); the last block's prefix rows are the block's own output rows."""
    from timm.models.vision_transformer import ResPostBlock

    kwargs = dict(block_fn=ResPostBlock) if arch == "post-norm blocks" else dict(init_values=0.5, reg_tokens=2)
    model = randomize(VisionTransformer(**TINY, **kwargs), 4).double()
    before = model_snapshot(model)
    layout = P.token_layout(model, x)
    assert P._drops_removed_tokens(model, layout)
    ranking = torch.randn(3, 16, generator=torch.Generator().manual_seed(5))
    gone = torch.cat([P._removed_by_rank(ranking, f, "highest") for f in (0.0, 0.25, 0.5, 0.75)])   # 12 rows
    rows = torch.arange(3).repeat(4)
    want = P.remove_tokens(model, x[rows], gone, target=0).logits
    for max_tokens in (8192, 40, 1):   # one chunk; a few rows a chunk; one row a chunk
        close(P._kept_token_logits(model, x, rows, gone, layout, max_tokens=max_tokens).double(), want)
    with torch.no_grad():
        h = torch.randn(2, 9, TINY["embed_dim"], generator=torch.Generator().manual_seed(6), dtype=torch.float64)
        last = model.blocks[-1]
        close(P._prefix_rows_of_block(last, h, layout.num_prefix), last(h)[:, :layout.num_prefix])
    assert_model_unchanged(model, before)
