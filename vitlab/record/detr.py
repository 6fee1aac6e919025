"""Adapter for Hugging Face DETR: encoder, decoder and encoder-decoder attention as streams."""
from __future__ import annotations


from torch import nn

from vitlab.record._session import AttentionCapture, _Session, _attach_qkv
from vitlab.record.vit import _attach_backbone, _hf_configs, _prefixed


#: DETR's streams: ``encoder`` (self-attention over the flattened backbone feature map, the
#: ``image`` tokens), then per decoder layer ``decoder`` (self-attention of the object
#: ``queries``) and ``cross`` (object queries attending to the encoder's image tokens). A
#: backbone that is a supported ViT (a DETR whose backbone module was replaced by one) adds
#: ``backbone`` first: the ViT's own self-attention over its tokens (modality ``backbone``,
#: laid out by ``rec.layout``, the ViT's token layout).
DETR_STREAMS = {
    "encoder": ("image", "image"),
    "decoder": ("queries", "queries"),
    "cross": ("queries", "image"),
}


def _detr_core(model: nn.Module) -> tuple[str, nn.Module] | None:
    """(name, module) of DETR's transformer: the module holding ``encoder``, ``decoder`` and
    ``input_projection`` (``DetrModel``; ``DetrForObjectDetection.model``)."""
    for name, m in model.named_modules():
        if all(isinstance(getattr(m, a, None), nn.Module) for a in ("encoder", "decoder", "input_projection")):
            return name, m
    return None


def _attach_detr(model: nn.Module, s: _Session, mlp: bool, found) -> None:
    core_name, core = found
    s.zero_unreached = True
    if "attention" in s.capture:  # DETR defaults to SDPA, which returns no attention weights
        for config in _hf_configs(model):
            s.set_attr(config, "_attn_implementation_internal", "eager")
    _attach_backbone(s, core.backbone, _prefixed(core_name, "backbone"))
    for stream in DETR_STREAMS:
        s.rec.streams.setdefault(stream, [])

    def on_features(mod, inp, out):
        s.rec.feature_grid = (int(out.shape[-2]), int(out.shape[-1]))  # B x d_model x h x w

    s.hook(core.input_projection, on_features)

    def attach(attn: nn.Module, name: str, layer: int, stream: str) -> None:
        """``attn``: a ``DetrSelfAttention`` / ``DetrCrossAttention`` (q/k/v_proj, returns weights in eager)."""
        current: dict[str, AttentionCapture] = {}
        heads = int(attn.q_proj.out_features // attn.head_dim)

        def open_capture(mod, args, kwargs):
            current["cap"] = s.open_capture(stream, name, *DETR_STREAMS[stream], layer=layer)

        def on_attn(mod, inp, out):
            weights = out[1] if isinstance(out, tuple) and len(out) > 1 else None
            if weights is None:
                raise RuntimeError(f"{name} ({type(mod).__name__}) returned no attention weights in eager mode")
            # eager_attention_forward returns the (post-dropout) matrix it multiplied with V
            s.capture_attention(current["cap"], weights, weights)

        if s.capture:
            s.hook(attn, open_capture, pre=True, with_kwargs=True)
        _attach_qkv(s, attn, current, ("q_proj", "k_proj", "v_proj"), heads)
        if "attention" in s.capture:
            s.hook(attn, on_attn)

    for i, layer in enumerate(core.encoder.layers):
        attach(layer.self_attn, _prefixed(core_name, f"encoder.layers.{i}.self_attn"), i, "encoder")
    for i, layer in enumerate(core.decoder.layers):
        attach(layer.self_attn, _prefixed(core_name, f"decoder.layers.{i}.self_attn"), i, "decoder")
        attach(layer.encoder_attn, _prefixed(core_name, f"decoder.layers.{i}.encoder_attn"), i, "cross")
    if s.gradients:
        s.hook(core, lambda mod, args, kwargs, out: s.finish_forward(), with_kwargs=True)
