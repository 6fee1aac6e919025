"""vitlab.record against independent eager computations, on random-initialised real
architectures (timm with fused attention on, DeiT-distilled, DINOv2 with registers, and
Hugging Face ViT / Dinov2 under SDPA)."""
import copy
import threading
import types

import pytest
import timm
import torch
import torch.nn.functional as F

import vitlab
from conftest import assert_model_unchanged, f32_tol, f32_tol_deep, model_snapshot, module_depth
from tiny_models import dropout_vit, tiny_vit
from vitlab.inputs import MEMORY_BUDGET
from vitlab.models import load_model
from vitlab.record import CAPTURE_FIELDS, NotRecordedError, attention_size
from vitlab.relevance import chefer_relevance
from vitlab.rollout import grad_rollout, rollout


# ----------------------------------------------------------------------------- timm
def eager_reference(model, x):
    """Independent eager forward of a timm ViT: a deep copy whose attention modules run a
    hand-written softmax attention that keeps the attention tensors (with their grads)."""
    ref = copy.deepcopy(model)
    kept = []

    def forward(self, x, attn_mask=None, is_causal=False):
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        q, k = self.q_norm(q), self.k_norm(k)
        a = torch.softmax((q * self.scale) @ k.transpose(-2, -1), dim=-1)
        if a.requires_grad:
            a.retain_grad()
        kept.append((a, q, k, v))
        out = (a @ v).transpose(1, 2).reshape(B, N, -1)
        return self.proj(self.norm(out))

    for blk in ref.blocks:
        blk.attn.forward = types.MethodType(forward, blk.attn)
    return ref, kept


TIMM_CASES = [
    ("deit_tiny_patch16_224", {}, 1, (14, 14)),
    ("deit_tiny_distilled_patch16_224", {}, 2, (14, 14)),
    ("vit_small_patch14_reg4_dinov2", {"img_size": 126}, 5, (9, 9)),
]


@pytest.mark.slow
@pytest.mark.parametrize("name,kwargs,prefix,grid", TIMM_CASES)
def test_timm_attention_and_gradients_equal_eager(name, kwargs, prefix, grid):
    model = timm.create_model(name, pretrained=False, **kwargs).eval()
    assert all(blk.attn.fused_attn for blk in model.blocks)  # the hard case: fused on
    before = model_snapshot(model)
    x = torch.randn(2, 3, *model.patch_embed.img_size)
    with torch.no_grad():
        plain = model(x)

    with vitlab.record(model, gradients=True) as rec:
        logits = model(x)
        logits[:, 1].sum().backward()
    model.zero_grad(set_to_none=True)

    ref, kept = eager_reference(model, x)
    ref_logits = ref(x)
    ref_logits[:, 1].sum().backward()

    layout = vitlab.token_layout(model)
    assert (layout.num_prefix, layout.grid) == (prefix, grid)
    assert rec.layout == layout
    n = layout.num_tokens
    assert len(rec.attentions) == len(model.blocks) == len(rec.attention_grads) == len(rec.hidden_states)
    # real-size models (12 blocks): fused vs eager kernels within the random-walk bound of their reductions
    depth = module_depth(model, tokens=n)
    close = lambda got, want, d=depth: torch.testing.assert_close(got, want, **f32_tol_deep(want, d))  # noqa: E731
    close(logits.detach(), plain)
    for l, (a, q, k, v) in enumerate(kept):
        assert rec.attentions[l].shape == (2, model.blocks[l].attn.num_heads, n, n)
        close(rec.attentions[l].detach(), a.detach())
        close(rec.queries[l].detach(), q.detach())
        close(rec.keys[l].detach(), k.detach())
        close(rec.values[l].detach(), v.detach())
        # gradients in the same (forward) order as the attentions
        close(rec.attention_grads[l], a.grad, 2 * depth)
    # rows are probability distributions: a softmax's sum, then this sum, over n tokens
    torch.testing.assert_close(rec.attentions[0].sum(-1), torch.ones(2, model.blocks[0].attn.num_heads, n),
                               **f32_tol(1.0, 2 * n))
    # the residual stream after the last block is what the final norm sees
    close(model.norm(rec.hidden_states[-1]).detach(), model.forward_features(x).detach())
    assert_model_unchanged(model, before)


@pytest.mark.slow
def test_batch_equals_items_one_by_one():
    model = timm.create_model("deit_tiny_patch16_224", pretrained=False).eval()
    x = torch.randn(3, 3, 224, 224)
    with torch.no_grad(), vitlab.record(model) as rec:
        model(x)
    for i in range(3):
        with torch.no_grad(), vitlab.record(model) as one:
            model(x[i:i + 1])
        for l in (0, 5, 11):  # attention weights (<= 1) of a real-size model: random-walk bound
            torch.testing.assert_close(rec.attentions[l][i:i + 1], one.attentions[l],
                                       **f32_tol_deep(1.0, module_depth(model, tokens=197)))


@pytest.mark.slow
def test_mlp_activations_are_gelu_of_fc1():
    model = timm.create_model("deit_tiny_patch16_224", pretrained=False).eval()
    x = torch.randn(1, 3, 224, 224)
    with torch.no_grad(), vitlab.record(model, mlp=True) as rec:
        model(x)
    blk = model.blocks[3]
    h = rec.hidden_states[2]
    h = h + blk.ls1(blk.attn(blk.norm1(h)))
    expect = F.gelu(F.linear(blk.norm2(h), blk.mlp.fc1.weight, blk.mlp.fc1.bias))
    assert rec.mlp_activations[3].shape == (1, 197, 768)
    # from the same recorded state: one block's reductions (its attention, norm2, fc1)
    torch.testing.assert_close(rec.mlp_activations[3], expect, **f32_tol(expect, module_depth(blk, tokens=197)))


@pytest.mark.slow
def test_state_restored_after_exception_in_forward_and_in_block():
    model = timm.create_model("deit_tiny_patch16_224", pretrained=False).eval()
    for p in model.blocks[0].parameters():
        p.requires_grad_(False)
    before = model_snapshot(model)
    with pytest.raises(Exception):
        with vitlab.record(model, gradients=True):
            model(torch.randn(1, 3, 100, 100))  # wrong size: timm raises inside the forward
    assert_model_unchanged(model, before)
    with pytest.raises(KeyError):
        with vitlab.record(model):
            model(torch.randn(1, 3, 224, 224))
            raise KeyError("user code failed")
    assert_model_unchanged(model, before)
    model.train()
    before = model_snapshot(model)
    with vitlab.record(model):
        model(torch.randn(1, 3, 224, 224))
    assert_model_unchanged(model, before)


def test_non_vit_model_gets_type_error():
    resnet = timm.create_model("resnet18", pretrained=False)
    with pytest.raises(TypeError, match="timm VisionTransformer"):
        with vitlab.record(resnet):
            pass
    with pytest.raises(TypeError, match="torch.nn.Module"):
        with vitlab.record("deit_tiny_patch16_224"):
            pass


def test_missing_gradients_are_explained():
    model = timm.create_model("deit_tiny_patch16_224", pretrained=False).eval()
    with torch.no_grad(), vitlab.record(model) as rec:
        model(torch.randn(1, 3, 224, 224))
    with pytest.raises(RuntimeError, match="gradients=True"):
        rec.attention_grads


# ----------------------------------------------------------------------------- Hugging Face
@pytest.mark.slow
@pytest.mark.parametrize("repo", ["google/vit-base-patch16-224", "facebook/dinov2-small"])
def test_hf_sdpa_attention_and_gradients_equal_eager(repo):
    model = load_model(repo, pretrained=False)
    if repo.startswith("google"):  # a smaller copy of the same architecture keeps the test fast
        model = type(model)(model.config.__class__(**{**model.config.to_dict(), "num_hidden_layers": 4})).eval()
    assert model.config._attn_implementation == "sdpa"
    before = model_snapshot(model)
    x = torch.randn(2, 3, 224, 224)

    def out_of(o):
        return o.logits if hasattr(o, "logits") else o.last_hidden_state[:, 0]

    with torch.no_grad():
        plain = out_of(model(x))
    with vitlab.record(model, gradients=True) as rec:
        y = out_of(model(x))
        y[:, 0].sum().backward()
    model.zero_grad(set_to_none=True)
    assert_model_unchanged(model, before)
    depth = module_depth(model, tokens=(224 // model.config.patch_size) ** 2 + 1)  # real-size: random-walk bound
    torch.testing.assert_close(y.detach(), plain, **f32_tol_deep(plain, depth))

    # independent: Hugging Face's own eager path with output_attentions on a copy
    ref = copy.deepcopy(model)
    ref.set_attn_implementation("eager")
    out = ref(x, output_attentions=True, output_hidden_states=True)
    for a in out.attentions:
        a.retain_grad()
    out_of(out)[:, 0].sum().backward()
    assert len(rec.attentions) == len(out.attentions) == model.config.num_hidden_layers
    grid = (224 // model.config.patch_size,) * 2
    assert rec.layout.grid == grid and rec.layout.num_prefix == 1
    for l, a in enumerate(out.attentions):
        torch.testing.assert_close(rec.attentions[l].detach(), a.detach(), **f32_tol_deep(a, depth))
        torch.testing.assert_close(rec.attention_grads[l], a.grad, **f32_tol_deep(a.grad, 2 * depth))
        torch.testing.assert_close(rec.hidden_states[l].detach(), out.hidden_states[l + 1].detach(),
                                   **f32_tol_deep(out.hidden_states[l + 1], depth))


def test_qk_norm_models_record_normalised_queries_and_keys():
    from timm.models.vision_transformer import VisionTransformer

    model = VisionTransformer(img_size=32, patch_size=8, embed_dim=48, depth=2, num_heads=3,
                              qk_norm=True, num_classes=4).eval()
    with torch.no_grad():  # make the norms matter
        for blk in model.blocks:
            blk.attn.q_norm.weight.uniform_(0.5, 2.0)
            blk.attn.k_norm.bias.uniform_(-1.0, 1.0)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad(), vitlab.record(model) as rec:
        model(x)
    ref, kept = eager_reference(model, x)
    with torch.no_grad():
        ref(x)
    depth = module_depth(model, tokens=17)
    for l, (a, q, k, v) in enumerate(kept):
        torch.testing.assert_close(rec.queries[l], q, **f32_tol(q, depth))
        torch.testing.assert_close(rec.keys[l], k, **f32_tol(k, depth))
        torch.testing.assert_close(rec.attentions[l], a, **f32_tol(a, depth))


@pytest.mark.slow
def test_clear_keeps_hooks_and_starts_fresh_lists():
    model = timm.create_model("deit_tiny_patch16_224", pretrained=False).eval()
    x = torch.randn(1, 3, 224, 224)
    with torch.no_grad(), vitlab.record(model, mlp=True) as rec:
        model(x)
        first = rec.attentions[4].clone()
        model(x)
        assert rec.num_layers == 2 * len(model.blocks)   # each forward appends
        rec.clear()
        assert rec.num_layers == 0 and not rec.hidden_states and not rec.mlp_activations
        model(x)
        assert rec.num_layers == len(model.blocks) == len(rec.mlp_activations)
        torch.testing.assert_close(rec.attentions[4], first, rtol=0, atol=0)  # the same forward again: bit for bit


# ----------------------------------------------------------------------------- capture=
def tiny_models():
    """A timm ViT with q/k norms (the hooked-norm path), one without, and a Hugging Face ViT."""
    from timm.models.vision_transformer import VisionTransformer
    from transformers import ViTConfig, ViTForImageClassification

    torch.manual_seed(0)
    plain = VisionTransformer(img_size=32, patch_size=8, embed_dim=48, depth=3, num_heads=3, num_classes=5).eval()
    qk_norm = VisionTransformer(img_size=32, patch_size=8, embed_dim=48, depth=2, num_heads=3, num_classes=5,
                                qk_norm=True).eval()
    with torch.no_grad():
        for blk in qk_norm.blocks:
            blk.attn.q_norm.weight.uniform_(0.5, 2.0)
            blk.attn.k_norm.bias.uniform_(-1.0, 1.0)
    hf = ViTForImageClassification(ViTConfig(image_size=32, patch_size=8, hidden_size=48, num_hidden_layers=2,
                                             num_attention_heads=3, intermediate_size=96, num_labels=5)).eval()
    return {"timm": plain, "timm_qk_norm": qk_norm, "hf": hf}


def _out(o):
    return o.logits if hasattr(o, "logits") else o


FIELDS = {"attention": "attentions", "query": "queries", "key": "keys", "value": "values",
          "hidden": "hidden_states"}
CAPTURES = [("attention",), ("query", "key"), ("value",), ("hidden",), ("query",), ("key", "hidden"),
            ("attention", "value"), ()]


@pytest.mark.parametrize("kind", ["timm", "timm_qk_norm", "hf"])
def test_capture_keeps_the_asked_fields_equal_to_the_full_recording_and_refuses_the_others(kind):
    model = tiny_models()[kind]
    x = torch.randn(2, 3, 32, 32)
    before = model_snapshot(model)
    with torch.no_grad(), vitlab.record(model) as full:
        model(x)
    assert full.captured == set(CAPTURE_FIELDS)
    L = len(full.attentions)
    for capture in CAPTURES:
        with torch.no_grad(), vitlab.record(model, capture=capture) as rec:
            model(x)
        assert_model_unchanged(model, before)
        assert rec.captured == set(capture)
        assert rec.layout == full.layout
        for name, prop in FIELDS.items():
            if name in capture:
                got, ref = getattr(rec, prop), getattr(full, prop)
                assert len(got) == L
                for g, r in zip(got, ref):
                    # fused and eager paths agree to float rounding; the eager one exactly
                    tol = dict(rtol=0, atol=0) if "attention" in capture else f32_tol(r, module_depth(model, tokens=17))
                    torch.testing.assert_close(g, r, **tol)
            else:
                msg = (rf"rec\.{prop} was not recorded: this recording captured only .*; ask for '{name}' with "
                       rf"vitlab\.record\(model, capture=\(.*'{name}'.*\)\)")
                with pytest.raises(NotRecordedError, match=msg):
                    getattr(rec, prop)
                attr = name if name != "hidden" else None
                if attr is not None:
                    assert all(getattr(c, attr) is None for c in rec.stream())
        if set(capture) & {"attention", "query", "key", "value"}:
            assert rec.num_layers == len(rec.stream()) == L
        else:
            assert rec.stream() == []
            assert rec.num_layers == (L if "hidden" in capture else 0)


def hooks_inside(model):
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


@pytest.mark.parametrize("kind", ["timm", "hf"])
def test_capture_without_attention_keeps_the_fused_path_and_hooks_less(kind):
    model = tiny_models()[kind]
    x = torch.randn(1, 3, 32, 32)

    def fused_state():
        if kind == "timm":
            return [blk.attn.fused_attn for blk in model.blocks]
        return model.config._attn_implementation

    start = fused_state()
    assert start in ([True] * 3, "sdpa")
    L = 3 if kind == "timm" else 2
    seen = {}
    for capture in [None, ("attention",), ("query", "key"), ("hidden",)]:
        with torch.no_grad(), vitlab.record(model, capture=capture) as rec:
            seen[capture] = (fused_state(), hooks_inside(model))
            model(x)
        assert fused_state() == start
    eager = [False] * 3 if kind == "timm" else "eager"
    assert seen[None][0] == seen[("attention",)][0] == eager
    assert seen[("query", "key")][0] == seen[("hidden",)][0] == start
    # one pre-hook on the model (input checks, layout) plus what each field needs per block
    if kind == "timm":  # qkv + attn_drop + block
        assert [seen[c][1] for c in seen] == [1 + 3 * L, 1 + L, 1 + L, 1 + L]
    else:  # capture opener + q/k/v projections + attention + layer
        assert [seen[c][1] for c in seen] == [1 + 6 * L, 1 + L, 1 + 3 * L, 1 + L]


def test_capture_names_are_checked():
    model = tiny_models()["timm"]
    before = model_snapshot(model)
    with pytest.raises(ValueError, match=r"capture: unknown field name 'queries'; choose from \('attention', "
                                         r"'query', 'key', 'value', 'hidden'\)"):
        with vitlab.record(model, capture=("attention", "queries")):
            pass
    with pytest.raises(ValueError, match=r"unknown field names 'attn', 3"):
        with vitlab.record(model, capture=["attn", 3]):
            pass
    with pytest.raises(ValueError, match="capture must be None or an iterable"):
        with vitlab.record(model, capture=7):
            pass
    with pytest.raises(ValueError, match=r"gradients=True\) records the gradient of the attention, but "
                                         r"capture=\('key', 'query'\) leaves the attention out"):
        with vitlab.record(model, gradients=True, capture=("query", "key")):
            pass
    assert_model_unchanged(model, before)
    with torch.no_grad(), vitlab.record(model, capture="attention") as rec:  # one name as a string
        model(torch.randn(1, 3, 32, 32))
    assert rec.captured == {"attention"} and len(rec.attentions) == 3
    with torch.no_grad(), vitlab.record(model, capture=(), residual=True) as rec:  # residual brings hidden
        model(torch.randn(1, 3, 32, 32))
    assert rec.captured == {"hidden"} and len(rec.mlp_outputs) == 3
    assert_model_unchanged(model, before)


@pytest.mark.parametrize("kind", ["timm", "hf"])
def test_attention_only_gradients_equal_the_full_recording(kind):
    model = tiny_models()[kind]
    x = torch.randn(2, 3, 32, 32)
    got = {}
    for capture in (None, ("attention",)):
        with vitlab.record(model, gradients=True, capture=capture) as rec:
            _out(model(x))[:, 2].sum().backward()
        got[capture] = rec
    model.zero_grad(set_to_none=True)
    for a, b in zip(got[None].attention_grads, got[("attention",)].attention_grads, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("kind", ["timm", "hf"])
def test_methods_give_the_maps_of_the_full_recording(kind):
    from vitlab.attention import attention_gradients, cls_attention, qk_channel_scores, qk_maps, raw_attention
    from vitlab.rollout import fuse_heads, fused_rollout_row, grad_rollout, rollout

    model = tiny_models()[kind]
    x = torch.randn(3, 3, 32, 32)
    with torch.no_grad(), vitlab.record(model) as full:
        model(x)
    with vitlab.record(model, gradients=True) as graded:
        _out(model(x))[:, 1].sum().backward()
    model.zero_grad(set_to_none=True)
    layout, P = full.layout, full.layout.num_prefix
    A = full.attentions
    assert torch.equal(cls_attention(model, x), layout.patches_to_grid(torch.stack([a[:, :, 0] for a in A], 1)))
    assert torch.equal(raw_attention(model, x), layout.patches_to_grid(A[-1][:, :, 0].mean(1)))
    row = fused_rollout_row([fuse_heads(a) for a in A])
    expect = layout.patches_to_grid(row)
    # another recording of the same forward (capture sets may differ: fused vs eager kernels)
    depth = module_depth(model, tokens=17)
    torch.testing.assert_close(rollout(model, x), expect / expect.flatten(1).amax(1)[:, None, None],
                               **f32_tol(1.0, depth + 3 * 17))  # rollout: L products over 17, scaled to max 1
    ag = attention_gradients(model, x, target=1)
    for g, ref in zip(ag.gradients, graded.attention_grads, strict=True):
        torch.testing.assert_close(g, ref, **f32_tol(ref, 2 * depth))
    assert grad_rollout(model, x, target=1).shape == (3, 4, 4)
    maps = qk_maps(model, x, block=1, head=2, channel=3)
    torch.testing.assert_close(maps.query, layout.patches_to_grid(full.queries[1][:, 2, :, 3]).sigmoid(),
                               **f32_tol(1.0, depth))  # sigmoids (< 1) of queries: at most the queries' error
    torch.testing.assert_close(maps.key, layout.patches_to_grid(full.keys[1][:, 2, :, 3]).sigmoid(),
                               **f32_tol(1.0, depth))
    q, k = full.queries[0][:, :, P:], full.keys[0][:, :, P:]
    from vitlab.attention import same_region_score
    torch.testing.assert_close(qk_channel_scores(model, x, "same_region")[0], same_region_score(q, k).mean(0),
                               **f32_tol(1.0, depth + 2 * 16))  # a correlation (|.| <= 1) over 16 patches


def test_record_takes_an_empty_batch_like_the_model():
    model = tiny_vit()
    with torch.no_grad(), vitlab.record(model) as rec:
        out = model(torch.zeros(0, 3, 32, 32))
    assert out.shape == (0, 5)
    assert [tuple(a.shape) for a in rec.attentions] == [(0, 3, 17, 17)] * 3


# --- cryptic 1: gradients under no_grad / inference_mode --------------------------------------------
def test_record_with_gradients_under_no_grad_says_so():
    model = tiny_vit()
    before = model_snapshot(model)
    with pytest.raises(RuntimeError, match=r"gradients=True\): the forward ran with gradients disabled \(inside "
                                           r"torch.no_grad\(\) or torch.inference_mode\(\)\)"):
        with torch.no_grad(), vitlab.record(model, gradients=True):
            model(torch.zeros(1, 3, 32, 32))
    assert_model_unchanged(model, before)
    with torch.no_grad(), vitlab.record(model, gradients=True) as rec:  # enable_grad inside: fine
        with torch.enable_grad():
            model(torch.zeros(1, 3, 32, 32))[:, 0].sum().backward()
    assert len(rec.attention_grads) == 3
    for p in model.parameters():
        p.grad = None


def test_missing_gradients_of_a_frozen_model_name_the_cause():
    model = tiny_vit().requires_grad_(False)
    with vitlab.record(model, gradients=True) as rec:
        model(torch.zeros(1, 3, 32, 32))
    with pytest.raises(RuntimeError, match=r"nothing in the forward required a gradient .*x.requires_grad_\(True\)"):
        rec.attention_grads


# --- silent wrong 5: overlapping recordings closed out of order -------------------------------------
def test_overlapping_recordings_closed_out_of_order_keep_recording_and_restore_the_flags():
    model = tiny_vit()
    fused = [b.attn.fused_attn for b in model.blocks]
    before = model_snapshot(model)
    first, second = vitlab.record(model), vitlab.record(model)
    rec1 = first.__enter__()
    rec2 = second.__enter__()
    first.__exit__(None, None, None)  # closed before the second
    with torch.no_grad():
        model(torch.zeros(1, 3, 32, 32))
    assert len(rec2.attentions) == 3 and rec1.attentions == []
    assert [b.attn.fused_attn for b in model.blocks] == [False] * 3  # still recording
    second.__exit__(None, None, None)
    assert [b.attn.fused_attn for b in model.blocks] == fused
    assert_model_unchanged(model, before)


def test_timm_and_hugging_face_record_the_attention_after_dropout_in_train_mode():
    from transformers import ViTConfig, ViTModel

    timm_model = dropout_vit().train()
    cfg = ViTConfig(image_size=32, patch_size=8, hidden_size=48, num_hidden_layers=2, num_attention_heads=3,
                    intermediate_size=96, attention_probs_dropout_prob=0.5)
    hf_model = ViTModel(cfg, add_pooling_layer=False).train()
    for model in (timm_model, hf_model):
        with torch.no_grad(), vitlab.record(model) as rec:
            model(torch.randn(2, 3, 32, 32))
        A = rec.attentions[0]  # post-dropout: a share of entries zeroed, the rest scaled by 1 / (1 - p)
        assert 0.3 < float((A == 0).float().mean()) < 0.7
        assert not torch.allclose(A.sum(-1), torch.ones_like(A.sum(-1)))
        assert model.training


# --- silent wrong 4: two threads on one model ----------------------------------------------------------
def test_a_recording_captures_only_the_forwards_of_its_own_thread():
    model = tiny_vit()
    xa, xb = torch.randn(1, 3, 32, 32), torch.randn(2, 3, 32, 32)
    with torch.no_grad(), vitlab.record(model) as alone:
        model(xa)
    before = model_snapshot(model)
    seen = {}

    def other_thread():  # a plain forward and a method of its own, while the main thread records
        with torch.no_grad():
            model(xb)
        seen["rollout"] = rollout(model, xb)

    with torch.no_grad(), vitlab.record(model) as rec:
        worker = threading.Thread(target=other_thread)
        worker.start()
        worker.join()
        model(xa)
    assert [tuple(A.shape) for A in rec.attentions] == [(1, 3, 17, 17)] * 3
    assert all(torch.equal(a, b) for a, b in zip(rec.attentions, alone.attentions))
    assert torch.equal(seen["rollout"], rollout(model, xb))
    assert_model_unchanged(model, before)


def test_a_method_of_another_thread_midway_through_a_forward_gets_its_own_map():
    """Thread a pauses inside its forward (in block 1) until thread b has run two methods on the
    same model: neither recording may take in the other's forward, and the flags come back."""
    model = tiny_vit()
    xa, xb = torch.randn(2, 3, 32, 32), torch.randn(3, 3, 32, 32)
    expected = {"a": chefer_relevance(model, xa, target=[1, 2]), "b": rollout(model, xb),
                "b_grad": grad_rollout(model, xb, target=0)}
    before = model_snapshot(model)
    got = {}

    def run_b():
        got["b"] = rollout(model, xb)
        got["b_grad"] = grad_rollout(model, xb, target=0)

    def pause_a(mod, args):
        if threading.current_thread().name == "a" and "b" not in got:
            b = threading.Thread(target=run_b, name="b")
            b.start()
            b.join()

    def run_a():
        got["a"] = chefer_relevance(model, xa, target=[1, 2])

    handle = model.blocks[1].register_forward_pre_hook(pause_a)
    try:
        a = threading.Thread(target=run_a, name="a")
        a.start()
        a.join()
    finally:
        handle.remove()
    assert sorted(got) == ["a", "b", "b_grad"]
    for key, value in expected.items():
        assert torch.equal(got[key], value), key
    assert_model_unchanged(model, before)


def test_two_threads_running_methods_on_one_model_each_get_their_single_threaded_maps():
    model = tiny_vit()
    inputs = {"rollout": torch.randn(2, 3, 32, 32), "chefer": torch.randn(3, 3, 32, 32)}
    methods = {"rollout": lambda x: rollout(model, x, "max", 0.3), "chefer": lambda x: chefer_relevance(model, x)}
    expected = {k: methods[k](inputs[k]) for k in methods}
    before = model_snapshot(model)
    start, results, errors = threading.Barrier(2), {k: [] for k in methods}, []

    def loop(key):
        try:
            start.wait()
            for _ in range(15):
                results[key].append(methods[key](inputs[key]))
        except Exception as e:  # noqa: BLE001 -- reported below, with the thread's name
            errors.append((key, e))

    threads = [threading.Thread(target=loop, args=(k,)) for k in methods]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    for key in methods:
        assert len(results[key]) == 15
        assert all(torch.equal(r, expected[key]) for r in results[key]), key
    assert_model_unchanged(model, before)


def test_attention_size_is_what_a_recording_keeps_per_sample():
    from transformers import ViTConfig, ViTModel

    hf = ViTModel(ViTConfig(image_size=32, patch_size=8, hidden_size=48, num_hidden_layers=2, num_attention_heads=3,
                            intermediate_size=96), add_pooling_layer=False).eval()
    for model in (tiny_vit(), tiny_vit(reg_tokens=2, num_heads=4, embed_dim=64), hf):
        with torch.no_grad(), vitlab.record(model) as rec:
            model(torch.randn(1, 3, 32, 32))
        assert attention_size(model, rec.layout.num_tokens) == sum(A.numel() for A in rec.attentions)
    assert MEMORY_BUDGET == 1 << 30
