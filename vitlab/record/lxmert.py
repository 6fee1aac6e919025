"""Adapter for Hugging Face LXMERT: language, vision and cross-modality attention as streams."""
from __future__ import annotations

from typing import Callable

from torch import nn

from vitlab.record._session import AttentionCapture, _Session, _attach_bert_attention
from vitlab.record.vit import _attach_backbone, _prefixed


# --------------------------------------------------------------------------------------
# Bi-modal (LXMERT) and encoder-decoder (DETR) models: several streams, ordered events.
# --------------------------------------------------------------------------------------
#: LXMERT's streams: (query modality, key modality) of each. ``lang``: the language encoder's
#: self-attention layers; ``vision``: the object-relationship encoder's; in every
#: cross-modality layer, first ``lang->vision`` (text queries, image keys) and
#: ``vision->lang`` (image queries, text keys) -- one module called twice --, then the
#: self-attention of the text (``cross.lang``) and of the image (``cross.vision``) tokens.
LXMERT_STREAMS = {
    "lang": ("lang", "lang"),
    "vision": ("vision", "vision"),
    "lang->vision": ("lang", "vision"),
    "vision->lang": ("vision", "lang"),
    "cross.lang": ("lang", "lang"),
    "cross.vision": ("vision", "vision"),
}


def _lxmert_encoder(model: nn.Module) -> tuple[str, nn.Module] | None:
    """(name, module) of LXMERT's encoder: the module holding ``layer``, ``r_layers`` and ``x_layers``."""
    for name, m in model.named_modules():
        if all(isinstance(getattr(m, a, None), nn.ModuleList) for a in ("layer", "r_layers", "x_layers")):
            return name, m
    return None


def _attach_lxmert(model: nn.Module, s: _Session, mlp: bool, found) -> None:
    enc_name, enc = found
    s.zero_unreached = True
    _attach_backbone(s, model, "")  # a ViT giving the region features (vitlab's shapes-lxmert)
    for stream in LXMERT_STREAMS:
        s.rec.streams.setdefault(stream, [])

    def attach(attn: nn.Module, name: str, layer: int, stream_of: Callable[[], str]) -> None:
        """``attn``: an ``LxmertAttention`` (query/key/value linears, dropout on the probabilities)."""
        current: dict[str, AttentionCapture] = {}

        def open_capture(mod, args):
            stream = stream_of()
            current["cap"] = s.open_capture(stream, name, *LXMERT_STREAMS[stream], layer=layer)

        _attach_bert_attention(s, attn, current, open_capture)

    for i, layer in enumerate(enc.layer):
        attach(layer.attention.self, _prefixed(enc_name, f"layer.{i}.attention.self"), i, lambda: "lang")
    for i, layer in enumerate(enc.r_layers):
        attach(layer.attention.self, _prefixed(enc_name, f"r_layers.{i}.attention.self"), i, lambda: "vision")
    for i, layer in enumerate(enc.x_layers):
        name = _prefixed(enc_name, f"x_layers.{i}")
        calls = [0]

        def reset(mod, args, calls=calls):
            calls[0] = 0

        def direction(calls=calls, name=name) -> str:
            # LxmertXLayer.cross_att calls its one visual_attention module twice: text queries over
            # the image first, then image queries over the text. Told apart by call, not by shape
            # (a question as long as the image has regions would have the same shapes both ways).
            calls[0] += 1
            if calls[0] > 2:
                raise RuntimeError(
                    f"{name}.visual_attention ran more than twice in one call of its cross-modality layer; "
                    "vitlab.record expects LXMERT's order (text->image, then image->text)"
                )
            return "lang->vision" if calls[0] == 1 else "vision->lang"

        s.hook(layer, reset, pre=True)
        attach(layer.visual_attention.att, f"{name}.visual_attention.att", i, direction)
        attach(layer.lang_self_att.self, f"{name}.lang_self_att.self", i, lambda: "cross.lang")
        attach(layer.visn_self_att.self, f"{name}.visn_self_att.self", i, lambda: "cross.vision")
    if s.gradients:
        s.hook(enc, lambda mod, args, out: s.finish_forward())
