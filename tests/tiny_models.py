"""Tiny random models of the real architectures, and inputs for them, shared by the test files
(test files import from here and from conftest, never from one another). All are built offline
from configs, seeded, in eval mode."""
from __future__ import annotations

import socket

import pytest
import torch
from timm.models.vision_transformer import VisionTransformer
from transformers import (
    CLIPConfig, CLIPModel, DetrConfig, DetrForObjectDetection, LxmertConfig, LxmertForQuestionAnswering, ResNetConfig,
    ViltConfig, ViltForQuestionAnswering, VisualBertConfig, VisualBertForQuestionAnswering,
)

import vitlab

from conftest import TINY, randomize


def randomize_biases(model, seed=0):
    """Hugging Face initialises biases to zero; random ones make every attention matter
    (with zero value biases, DETR's first decoder self-attention would get a zero gradient)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.Linear) and m.bias is not None:
                m.bias.copy_(torch.rand(m.bias.shape, generator=g) * 0.2 - 0.1)
    return model


def tiny_lxmert(cls=LxmertForQuestionAnswering, l_layers=2, x_layers=2, r_layers=1, **kw):
    torch.manual_seed(0)
    cfg = LxmertConfig(vocab_size=50, hidden_size=32, num_attention_heads=4, intermediate_size=64,
                       l_layers=l_layers, x_layers=x_layers, r_layers=r_layers, visual_feat_dim=16,
                       visual_pos_dim=4, num_qa_labels=7, num_object_labels=5, num_attr_labels=5, **kw)
    return randomize_biases(cls(cfg).eval())


def lxmert_inputs(batch=2, words=6, regions=9, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 50, (batch, words), generator=g)
    mask = torch.ones(batch, words, dtype=torch.long)
    mask[-1, -2:] = 0  # padding in the last sample
    return dict(input_ids=ids, attention_mask=mask, visual_feats=torch.randn(batch, regions, 16, generator=g),
                visual_pos=torch.rand(batch, regions, 4, generator=g))


def tiny_detr(cls=DetrForObjectDetection, **kw):
    torch.manual_seed(0)
    cfg = DetrConfig(use_timm_backbone=False, use_pretrained_backbone=False,
                     backbone_config=ResNetConfig(num_channels=3, embedding_size=8, hidden_sizes=[8, 16],
                                                  depths=[1, 1], out_features=["stage2"]),
                     d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
                     decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, num_queries=5,
                     num_labels=3, **kw)
    return randomize_biases(cls(cfg).eval())


class ViTBackbone(torch.nn.Module):
    """A DETR backbone made of a timm ViT: its patch tokens, on the patch grid, are the feature
    map (as for a DETR trained on a ViT's tokens)."""

    def __init__(self, vit):
        super().__init__()
        self.vit = vit

    def forward(self, pixel_values, pixel_mask):
        layout = vitlab.token_layout(self.vit, pixel_values)
        tokens = self.vit.forward_features(pixel_values)[:, layout.num_prefix:]  # B x P x D
        fmap = tokens.transpose(1, 2).reshape(tokens.shape[0], tokens.shape[2], *layout.grid)
        mask = torch.nn.functional.interpolate(pixel_mask[None].float(), size=layout.grid).bool()[0]
        return [(fmap, mask)]


def vit_detr():
    from timm.models.vision_transformer import VisionTransformer

    model = tiny_detr()
    torch.manual_seed(1)
    vit = VisionTransformer(img_size=32, patch_size=8, embed_dim=24, depth=2, num_heads=3, num_classes=0).eval()
    model.model.backbone = ViTBackbone(vit)
    model.model.input_projection = torch.nn.Conv2d(24, 32, kernel_size=1)
    return model, vit


class ViTLxmert(LxmertForQuestionAnswering):
    """LXMERT whose regions are a timm ViT's patch tokens (as vitlab's shapes-lxmert)."""

    def __init__(self, config, vit):
        super().__init__(config)
        self.backbone = vit
        self.register_buffer("boxes", torch.rand(16, 4, generator=torch.Generator().manual_seed(3)))

    def forward(self, input_ids, pixel_values, **kwargs):
        feats = self.backbone.forward_features(pixel_values)[:, 1:]
        return super().forward(input_ids=input_ids, visual_feats=feats,
                               visual_pos=self.boxes.expand(feats.shape[0], -1, -1), **kwargs)


def tiny_vit_lxmert(x_layers: int = 1) -> tuple[ViTLxmert, VisionTransformer]:
    """``(model, vit)``: a :class:`ViTLxmert` (1 language, ``x_layers`` cross-modality, 1 vision layer,
    width 32, 7 answers, random biases) on a 2-block timm ViT (32 px, 8 px patches, width 16)."""
    torch.manual_seed(0)
    vit = VisionTransformer(img_size=32, patch_size=8, embed_dim=16, depth=2, num_heads=2, num_classes=0).eval()
    cfg = LxmertConfig(vocab_size=50, hidden_size=32, num_attention_heads=4, intermediate_size=64, l_layers=1,
                       x_layers=x_layers, r_layers=1, visual_feat_dim=16, visual_pos_dim=4, num_qa_labels=7)
    return randomize_biases(ViTLxmert(cfg, vit).eval()), vit


def tiny_visualbert(cls=VisualBertForQuestionAnswering, **kw):
    torch.manual_seed(0)
    cfg = VisualBertConfig(vocab_size=40, hidden_size=24, num_hidden_layers=3, num_attention_heads=3,
                           intermediate_size=48, visual_embedding_dim=10, num_labels=6, max_position_embeddings=16,
                           initializer_range=0.3, **kw)
    return randomize_biases(cls(cfg).eval())


def tiny_vilt(cls=ViltForQuestionAnswering):
    torch.manual_seed(0)
    cfg = ViltConfig(vocab_size=40, hidden_size=24, num_hidden_layers=3, num_attention_heads=3, intermediate_size=48,
                     image_size=64, patch_size=16, num_labels=6, max_position_embeddings=16, initializer_range=0.3)
    return randomize_biases(cls(cfg).eval())


def peaked(model, std=0.3, seed=0):
    """Weights of std ``std`` (LayerNorms kept): gradients large enough that float32 keeps the
    relevance's digits. With Hugging Face's 0.02 init the attention gradients are ~1e-5, and
    eq. 8's ``R - I`` of an ``R`` that close to I loses ~4% in float32 against float64 loops."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "LayerNorm" not in name:
                p.copy_(torch.randn(p.shape, generator=g) * std)
    return model


def vb_items(words=(6, 4, 5), regions=(5, 3, 4), seed=1, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(1, 40, (1, w), generator=g), torch.randn(1, r, 10, generator=g).to(dtype))
            for w, r in zip(words, regions)]


def vb_batch(items):
    W, R = max(i.shape[1] for i, _ in items), max(f.shape[1] for _, f in items)
    ids = torch.zeros(len(items), W, dtype=torch.long)
    mask = torch.zeros(len(items), W, dtype=torch.long)
    feats = torch.zeros(len(items), R, 10, dtype=items[0][1].dtype)
    vmask = torch.zeros(len(items), R, dtype=torch.long)
    for b, (i, f) in enumerate(items):
        ids[b, : i.shape[1]], mask[b, : i.shape[1]] = i[0], 1
        feats[b, : f.shape[1]], vmask[b, : f.shape[1]] = f[0], 1
    return dict(input_ids=ids, attention_mask=mask, visual_embeds=feats, visual_attention_mask=vmask)


def peaked_lxmert():
    """A tiny LXMERT (width 24, 3 heads, 12-dim regions) with weights of std 0.3 (the LRP tests')."""
    torch.manual_seed(0)
    cfg = LxmertConfig(vocab_size=50, hidden_size=24, num_attention_heads=3, intermediate_size=48, l_layers=2,
                       x_layers=1, r_layers=1, visual_feat_dim=12, visual_pos_dim=4, num_qa_labels=6,
                       initializer_range=0.3)
    return randomize_biases(LxmertForQuestionAnswering(cfg).eval())


def lx_items(words=(6, 4, 5), regions=(5, 5, 5), seed=2):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(1, 50, (1, w), generator=g), torch.randn(1, r, 12, generator=g),
             torch.rand(1, r, 4, generator=g)) for w, r in zip(words, regions)]


def lx_batch(items):
    W = max(i.shape[1] for i, _, _ in items)
    ids = torch.zeros(len(items), W, dtype=torch.long)
    mask = torch.zeros(len(items), W, dtype=torch.long)
    for b, (i, _, _) in enumerate(items):
        ids[b, : i.shape[1]], mask[b, : i.shape[1]] = i[0], 1
    return dict(input_ids=ids, attention_mask=mask, visual_feats=torch.cat([f for _, f, _ in items]),
                visual_pos=torch.cat([p for _, _, p in items]))


def no_network(*args, **kwargs):
    raise AssertionError("load_model(..., pretrained=False) tried to open a network connection")


def offline_build(name):
    """load_model(name, pretrained=False) with every socket connection failing the test."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setattr(socket, "create_connection", no_network)
        mp.setattr(socket.socket, "connect", no_network)
        return vitlab.load_model(name, pretrained=False)


VOCAB, EOS, BOS, PAD = 40, 39, 38, 0  # tiny_clip's vocabulary: 40 ids, end 39, start 38, pad 0


def tiny_clip(legacy: bool = True, attn: str = "eager", seed: int = 0, dtype=torch.float64,
              vision_layers: int = 3, text_layers: int = 3) -> CLIPModel:
    """A random CLIPModel: 32 x 32 images in 8 x 8 patches (4 x 4 grid + CLS), 4 heads, width 32;
    texts of at most 12 tokens over 40 ids (start 38, end 39, pad 0). ``legacy``: the original
    OpenAI configs' ``eos_token_id = 2`` (pool at ``input_ids.argmax``), else ``eos_token_id = 39``
    (pool at the first 39). Weights of std 0.3 (LayerNorm gains 1 + 0.3 noise): peaked attention."""
    text = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=text_layers,
                num_attention_heads=4, max_position_embeddings=12, eos_token_id=2 if legacy else EOS,
                bos_token_id=0 if legacy else BOS, pad_token_id=1 if legacy else PAD)
    vision = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=vision_layers, num_attention_heads=4,
                  image_size=32, patch_size=8)
    cfg = CLIPConfig(text_config=text, vision_config=vision, projection_dim=16)
    model = CLIPModel._from_config(cfg, attn_implementation=attn)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g) * 0.3
            p.copy_(noise + 1 if ("layer_norm" in name or "layrnorm" in name) and name.endswith("weight") else noise)
    return model.to(dtype).eval()


def captions(lengths, pad_to=None, seed=1):
    """``<start> words <end>`` of ``lengths`` words, padded with 0 (mask 0) to the longest (or ``pad_to``)."""
    g = torch.Generator().manual_seed(seed)
    T = pad_to or max(lengths) + 2
    ids = torch.full((len(lengths), T), PAD, dtype=torch.long)
    mask = torch.zeros(len(lengths), T, dtype=torch.long)
    for b, n in enumerate(lengths):
        ids[b, 0], ids[b, 1:n + 1], ids[b, n + 1] = BOS, torch.randint(1, 38, (n,), generator=g), EOS
        mask[b, :n + 2] = 1
    return ids, mask


def pairs(lengths=(3, 1, 5), seed=2, dtype=torch.float64):
    ids, mask = captions(lengths, seed=seed)
    x = torch.randn(len(lengths), 3, 32, 32, generator=torch.Generator().manual_seed(seed), dtype=dtype)
    return dict(pixel_values=x, input_ids=ids, attention_mask=mask)


def tiny_vit(seed: int = 0, **kw) -> VisionTransformer:
    """conftest's TINY ViT (3 blocks, 3 heads, 4 x 4 patches, 5 classes) with ``kw`` changed, weights
    of ``randomize(seed)``, in eval mode."""
    return randomize(VisionTransformer(**{**TINY, **kw}), seed)


def dropout_vit(seed: int = 5) -> VisionTransformer:
    """:func:`tiny_vit` with attention, projection and head dropout (for train-mode tests)."""
    return randomize(tiny_vit(seed, attn_drop_rate=0.5, proj_drop_rate=0.3, drop_rate=0.3), seed)
