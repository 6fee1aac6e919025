"""vitlab.projection against hand-written forwards and invariants (Vilas et al. 2023)."""
import copy
import types

import pytest
import torch
import torch.nn.functional as F
from timm.models.deit import VisionTransformerDistilled
from timm.models.vision_transformer import VisionTransformer

from conftest import TINY, randomize
from test_record import model_state
from vitlab import projection as P

pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_hf(seed: int = 2):
    from transformers import ViTConfig, ViTForImageClassification

    cfg = ViTConfig(image_size=32, patch_size=8, hidden_size=48, num_hidden_layers=3, num_attention_heads=3,
                    intermediate_size=96, num_labels=5)
    torch.manual_seed(seed)
    return randomize(ViTForImageClassification(cfg), seed)


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


def hand_head(model, h):
    return model.head(model.fc_norm(model.norm(h)))


# ------------------------------------------------------------------------ step 1: project
def test_project_matches_hand_forward(vit, x):
    before = model_state(vit)
    with torch.no_grad():
        h0, states = hand_states(vit, x)
        logits = vit(x)
    proj = P.project(vit, x)
    B, L, N, C = x.shape[0], TINY["depth"], 17, TINY["num_classes"]
    for name in ("residual", "attention", "mlp", "mid"):
        assert getattr(proj, name).shape == (B, L, N, C)
    assert proj.logits.shape == (B, C) and proj.layout.grid == (4, 4)
    for l, (h_in, mid, out) in enumerate(states):
        torch.testing.assert_close(proj.residual[:, l], hand_head(vit, out), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(proj.mid[:, l], hand_head(vit, mid), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(proj.attention[:, l], hand_head(vit, mid - h_in), atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(proj.mlp[:, l], hand_head(vit, out - mid), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(proj.embedding, hand_head(vit, h0), atol=1e-5, rtol=1e-5)
    # the sanity check of the paper: the last CLS state projects to the logits
    torch.testing.assert_close(proj.residual[:, -1, 0], logits, atol=1e-5, rtol=1e-5)
    assert model_state(vit) == before


def test_project_hf_last_cls_is_logits(x):
    model = tiny_hf()
    model.train()  # project runs in eval mode and puts the mode back
    before = model_state(model)
    proj = P.project(model, x)
    assert model_state(model) == before  # (HF keeps hooks of its own after output_hidden_states)
    model.eval()
    with torch.no_grad():
        out = model(x, output_hidden_states=True)
    torch.testing.assert_close(proj.residual[:, -1, 0], out.logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(proj.logits, out.logits, atol=1e-5, rtol=1e-5)
    head = lambda h: model.classifier(model.vit.layernorm(h))  # noqa: E731
    for l in range(3):  # hidden_states[0] = embeddings, [l + 1] = after block l
        torch.testing.assert_close(proj.residual[:, l], head(out.hidden_states[l + 1]), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(proj.embedding, head(out.hidden_states[0]), atol=1e-5, rtol=1e-5)


def test_project_batch_is_items(vit, x):
    whole = P.project(vit, x)
    for b in range(x.shape[0]):
        one = P.project(vit, x[b:b + 1])
        for name in ("residual", "attention", "mlp"):
            torch.testing.assert_close(getattr(whole, name)[b], getattr(one, name)[0], atol=1e-5, rtol=1e-5)


def test_project_fc_norm_model(x):
    # a timm model whose final norm is fc_norm (applied after pooling): still head(fc_norm(norm(h)))
    model = randomize(VisionTransformer(**TINY, fc_norm=True), 3)
    assert not isinstance(model.fc_norm, torch.nn.Identity)
    proj = P.project(model, x)
    torch.testing.assert_close(proj.residual[:, -1, 0], model(x), atol=1e-5, rtol=1e-5)


def test_project_refuses_models_it_cannot_read(x):
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
    rank = (order == pred[:, None, None, None]).float().argmax(-1)
    torch.testing.assert_close(r, 1 - rank / TINY["num_classes"])
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
            torch.testing.assert_close(c.attention[:, l], ref_a, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(c.mlp[:, l], ref_m, atol=1e-4, rtol=1e-4)
    # telescoping: the contributions add up to the change from h_0 to h_L
    torch.testing.assert_close((c.attention + c.mlp).sum(1), last - first, atol=1e-4, rtol=1e-4)
    assert c.target.tolist() == [2, 2, 2]


def test_sublayer_contributions_hf_telescopes(x):
    model = tiny_hf()
    c = P.sublayer_contributions(model, x)
    proj = P.project(model, x)
    t = proj.logits.argmax(-1)
    idx = t[:, None].expand(-1, 17)[..., None]
    total = proj.residual[:, -1].gather(-1, idx)[..., 0] - proj.embedding.gather(-1, idx)[..., 0]
    torch.testing.assert_close((c.attention + c.mlp).sum(1), total, atol=1e-4, rtol=1e-4)
