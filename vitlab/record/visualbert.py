"""Adapters for the single-stream vision-and-language models of Hugging Face: VisualBERT and ViLT.

Both concatenate the question's tokens and the image's tokens into one sequence and run it
through one stack of BERT self-attention layers (Chefer, Gur & Wolf 2021 call VisualBERT their
"pure self-attention" bi-modal case): every layer is one self-attention event over the joint
sequence, recorded as the stream :data:`VISUALBERT_STREAMS` / :data:`VILT_STREAMS` ``"joint"``,
whose query and key modality are both ``"text+image"``. The joint sequence is laid out as the
models build it: the text tokens first (``input_ids``' order, ``[CLS]`` first), then the image
tokens -- VisualBERT's ``visual_embeds`` in their order; ViLT's image ``[CLS]`` token, then the
patches in the order ``ViltEmbeddings.visual_embed`` selected them (a random order, see
:mod:`vitlab.relevance.visualbert`). A ViT inside the model that gives it its image tokens
(vitlab's ``shapes-visualbert``) is recorded first as the ``backbone`` stream, as for LXMERT.

Neither model has an SDPA path (``VisualBertSelfAttention`` and ``ViltSelfAttention`` compute
the softmax themselves), so no flag is switched: the adapter hooks each layer's attention
module (its pre-hook opens the capture), its ``query`` / ``key`` / ``value`` linears and the
dropout on the probabilities, whose output is what multiplies V (the probabilities themselves in
eval mode). A VisualBERT with ``bypass_transformer=True`` (text-only layers, then one joint
layer) is refused: its layers are not one stack over the joint sequence.
"""
from __future__ import annotations

from torch import nn

from vitlab.record._session import AttentionCapture, _Session, _attach_bert_attention
from vitlab.record.vit import _attach_backbone, _prefixed

#: VisualBERT's one stream: every layer's self-attention over text and image tokens together.
VISUALBERT_STREAMS = {"joint": ("text+image", "text+image")}
#: ViLT's one stream, as VisualBERT's.
VILT_STREAMS = {"joint": ("text+image", "text+image")}


def _single_stream_encoder(model: nn.Module, embeddings_attr: str) -> tuple[str, nn.Module] | None:
    """(name, module) of the model whose ``encoder.layer`` is the joint stack (``VisualBertModel`` /
    ``ViltModel``: the module holding ``embeddings`` with ``embeddings_attr`` and ``encoder``)."""
    for name, m in model.named_modules():
        emb, enc = getattr(m, "embeddings", None), getattr(m, "encoder", None)
        if (isinstance(emb, nn.Module) and hasattr(emb, embeddings_attr) and isinstance(enc, nn.Module)
                and isinstance(getattr(enc, "layer", None), nn.ModuleList)):
            return name, m
    return None


def _visualbert_encoder(model: nn.Module) -> tuple[str, nn.Module] | None:
    """(name, ``VisualBertModel``) of a VisualBERT model; TypeError for ``bypass_transformer``."""
    found = _single_stream_encoder(model, "visual_projection")
    if found is not None and getattr(found[1], "bypass_transformer", False):
        raise TypeError(
            f"{type(model).__name__} has bypass_transformer=True (text-only layers, then one joint layer); "
            "vitlab.record records VisualBERT's one stack over text and image tokens (bypass_transformer=False, "
            "as in uclanlp/visualbert-vqa)")
    return found


def _vilt_encoder(model: nn.Module) -> tuple[str, nn.Module] | None:
    """(name, ``ViltModel``) of a ViLT model."""
    return _single_stream_encoder(model, "visual_embed")


def _attach_joint(model: nn.Module, s: _Session, found, self_attention: str, streams: dict) -> None:
    """Hooks on every layer's self-attention module ``layer.attention.<self_attention>``."""
    base_name, base = found
    _attach_backbone(s, model, "")  # a ViT giving the image tokens (vitlab's shapes-visualbert)
    stream = "joint"
    s.rec.streams.setdefault(stream, [])
    for i, layer in enumerate(base.encoder.layer):
        attn = getattr(layer.attention, self_attention)
        name = _prefixed(base_name, f"encoder.layer.{i}.attention.{self_attention}")
        current: dict[str, AttentionCapture] = {}

        def open_capture(mod, args, current=current, name=name, i=i):
            current["cap"] = s.open_capture(stream, name, *streams[stream], layer=i)

        _attach_bert_attention(s, attn, current, open_capture)


def _attach_visualbert(model: nn.Module, s: _Session, mlp: bool, found) -> None:
    _attach_joint(model, s, found, "self", VISUALBERT_STREAMS)


def _attach_vilt(model: nn.Module, s: _Session, mlp: bool, found) -> None:
    _attach_joint(model, s, found, "attention", VILT_STREAMS)
