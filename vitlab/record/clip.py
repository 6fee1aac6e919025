"""Adapter for Hugging Face CLIP: the image tower's and the text tower's self-attention as two streams.

A ``transformers.CLIPModel`` (Radford et al. 2021) is two Transformers side by side: a ViT over
the image (``vision_model``: patch embedding, CLS token, ``pre_layrnorm``, a stack of
``CLIPEncoderLayer``, ``post_layernorm`` on the CLS token) and a causal Transformer over the
text (``text_model``: token and position embeddings, the same layers with a causal mask,
``final_layer_norm``, read at the end-of-text token). Neither tower attends to the other: the
two meet only in the score ``logit_scale.exp() * cos(image_embeds, text_embeds)``. The
recording therefore has two streams (:data:`CLIP_STREAMS`): ``"image"`` (query and key modality
``image``) and ``"text"`` (``text``), one capture per layer of each, in ``rec.events`` in the
order the model ran them (``CLIPModel.forward``: the image tower first). A tower alone
(``CLIPVisionModel``, ``CLIPTextModel``, ``...WithProjection``) records its one stream, which is
then the default (``rec.attentions`` etc. read it); the vision tower alone is a ViT to vitlab's
methods (one stack of blocks over the image's tokens, with its token layout).

What each capture (:class:`ClipCapture`) holds, per ``capture`` field of :func:`vitlab.record`:

- ``"attention"``: ``attention`` (``B x heads x N x N``, post-softmax, the matrix the layer
  multiplies with V: after attention dropout, the probabilities themselves in eval mode; the
  text tower's causal and padding masks give exact zeros above the diagonal and in padded
  columns) and, with ``gradients=True``, ``grad`` = d(output)/d(attention);
- ``"query"``, ``"key"``, ``"value"``: ``B x heads x N x head_dim`` (the projections' outputs,
  biases included); with ``"value"`` also ``context`` (``B x N x D``): the heads' outputs
  ``A_h V_h`` side by side, what ``out_proj`` reads (graph-attached with ``gradients=True``,
  so d(score)/d(context) is one ``torch.autograd.grad`` away -- Grad-ECLIP's channel weights);
- ``"hidden"``: the residual stream ``block_input`` (entering the layer; for layer 0 of the
  image tower that is ``pre_layrnorm``'s output), ``mid`` (after the attention sublayer, what
  ``layer_norm2`` reads) and ``hidden`` (leaving the layer), each ``B x N x D``.

Attention path: CLIP defaults to SDPA, which materialises no attention matrix. While a
recording that reads or edits the attention is open, every configuration in the model is
switched to ``"eager"`` (the same computation, returning the weights) and put back exactly on
exit, as for the Hugging Face ViTs; the text tower then builds its causal mask in the eager
format. Nothing else about the model changes: hooks are removed, flags restored, modes put back,
also when the forward raises.

Gradients. With ``gradients=True`` (or ``detach=False``: graph-attached captures) the output of
each tower's embeddings is made to require a gradient when it does not (every parameter frozen):
a detached copy with the same values, so that the attention of a frozen CLIP can still be
differentiated; parameters are never touched.
An attention the differentiated output does not depend on (the text tower's, when only the image
embedding is differentiated) gets a zero gradient, as for LXMERT and DETR.

Token layout: ``rec.layout`` is the image tower's :class:`~vitlab.layout.TokenLayout` -- one
prefix token (CLS), and the patch grid read from the output of ``embeddings.patch_embedding``
(``B x D x gh x gw``) in the forward itself, so a convolutional stem of any stride in place of
the patchify convolution (vitlab's ``shapes-clip``) gives its true grid; before any forward, the
grid the configuration implies (``image_size // patch_size``).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
from torch import nn

from vitlab.layout import TokenLayout, token_layout
from vitlab.record._session import AttentionCapture, _Session, _attach_qkv
from vitlab.record.vit import _hf_configs, _hf_heads, _prefixed

#: CLIP's streams: each tower's self-attention, with its (query, key) modality.
CLIP_STREAMS = {"image": ("image", "image"), "text": ("text", "text")}


@dataclass
class ClipCapture(AttentionCapture):
    """One CLIP encoder layer's forward: :class:`AttentionCapture` plus what the layer adds to
    the residual stream (fields the recording did not ``capture`` stay None)."""

    context: torch.Tensor | None = None      # B x N x D: [A_1 V_1, ..., A_H V_H], out_proj's input ("value")
    block_input: torch.Tensor | None = None  # B x N x D: the residual stream entering the layer ("hidden")
    mid: torch.Tensor | None = None          # B x N x D: after the attention sublayer ("hidden")
    hidden: torch.Tensor | None = None       # B x N x D: leaving the layer ("hidden")


def _is_image_tower(m: nn.Module) -> bool:
    emb = getattr(m, "embeddings", None)
    return isinstance(emb, nn.Module) and hasattr(emb, "patch_embedding") and hasattr(emb, "class_embedding")


def _is_text_tower(m: nn.Module) -> bool:
    emb = getattr(m, "embeddings", None)
    return isinstance(emb, nn.Module) and hasattr(emb, "token_embedding")


def _clip_towers(model: nn.Module) -> list[tuple[str, str, nn.Module]] | None:
    """``(stream, name, tower)`` of each CLIP tower in ``model`` -- the module holding
    ``embeddings`` and ``encoder.layers`` (``vision_model`` / ``text_model``) --, the image tower
    first; None when there is none."""
    found: dict[str, tuple[str, str, nn.Module]] = {}
    for name, m in model.named_modules():
        if not isinstance(getattr(getattr(m, "encoder", None), "layers", None), nn.ModuleList):
            continue
        for stream, is_tower in (("image", _is_image_tower), ("text", _is_text_tower)):
            if stream not in found and is_tower(m):
                found[stream] = (stream, name, m)
    return [found[s] for s in CLIP_STREAMS if s in found] or None


def _first(args, kwargs, name: str):
    return args[0] if args else kwargs[name]


def _attach_clip(model: nn.Module, s: _Session, mlp: bool, towers) -> None:
    want = s.capture
    s.zero_unreached = True
    if "attention" in want:  # SDPA returns no attention weights: eager while the recording is open
        for config in _hf_configs(model):
            s.set_attr(config, "_attn_implementation_internal", "eager")
    streams = [stream for stream, _, _ in towers]
    s.rec.modalities = tuple(streams)
    if len(streams) == 1:  # a tower alone: its stream is the default one
        s.rec.default_stream = streams[0]
    if s.gradients:
        _attach_finish(s, [model] + [tower for _, _, tower in towers if tower is not model])
    for stream, tower_name, tower in towers:
        s.rec.streams.setdefault(stream, [])
        if s.gradients or not s.detach:  # the recorded tensors are to be differentiated
            def require_grad(mod, args, out):
                # a frozen tower: the same values, made to require grad so the attention can be differentiated
                if torch.is_grad_enabled() and isinstance(out, torch.Tensor) and not out.requires_grad:
                    return out.detach().requires_grad_(True)
                return None

            s.hook(tower.embeddings, require_grad)
        if stream == "image":
            _attach_layout(s, tower)
        for i, layer in enumerate(tower.encoder.layers):
            _attach_layer(s, stream, _prefixed(tower_name, f"encoder.layers.{i}"), i, layer)


def _attach_finish(s: _Session, outer: list[nn.Module]) -> None:
    """``finish_forward`` when the outermost of ``outer`` (the model, or a tower called on its own,
    e.g. by ``get_image_features``) returns: the attentions of that whole forward form one group,
    so an attention the differentiated output does not reach gets zeros."""
    stack: list[nn.Module] = []

    def enter(mod, args, kwargs):
        if any(m is mod for m in stack):  # left over from a forward that raised: start afresh
            stack.clear()
            s._pending.clear()
        stack.append(mod)

    def leave(mod, args, kwargs, out):
        if stack and stack[-1] is mod:
            stack.pop()
        if not stack:
            s.finish_forward()

    for m in outer:
        s.hook(m, enter, pre=True, with_kwargs=True)
        # called also when the forward raises, so that no half-run forward is left on the stack
        handle = m.register_forward_hook(
            lambda *a, thread=s.thread: leave(*a) if threading.get_ident() == thread else None,
            with_kwargs=True, always_call=True)
        s._undo.append(handle.remove)


def _attach_layout(s: _Session, tower: nn.Module) -> None:
    """``rec.layout``: CLS + the grid of the patch embedding's output in each forward."""
    try:
        s.rec.layout = token_layout(tower)
    except (TypeError, ValueError, AttributeError):
        s.rec.layout = None

    def on_patches(mod, args, out):
        if isinstance(out, torch.Tensor) and out.ndim == 4:  # B x D x gh x gw, flattened row-major by CLIP
            s.rec.layout = TokenLayout(num_prefix=1, grid=(int(out.shape[-2]), int(out.shape[-1])))

    s.hook(tower.embeddings.patch_embedding, on_patches)


def _attach_layer(s: _Session, stream: str, name: str, index: int, layer: nn.Module) -> None:
    want = s.capture
    attn = layer.self_attn
    current: dict[str, ClipCapture] = {}
    modality = CLIP_STREAMS[stream][0]

    def open_capture(mod, args, kwargs):
        cap = current["cap"] = ClipCapture(name=f"{name}.self_attn", stream=stream, query_modality=modality,
                                           key_modality=modality, layer=index)
        s.rec.streams[stream].append(cap)
        s.rec.events.append(cap)
        if "hidden" in want:
            cap.block_input = s.keep(_first(args, kwargs, "hidden_states"))

    if want:
        s.hook(layer, open_capture, pre=True, with_kwargs=True)
    _attach_qkv(s, attn, current, ("q_proj", "k_proj", "v_proj"), _hf_heads_clip(attn))
    if "value" in want:
        def on_context(mod, args, kwargs):
            current["cap"].context = s.keep(_first(args, kwargs, "input"))

        s.hook(attn.out_proj, on_context, pre=True, with_kwargs=True)
    if "attention" in want:
        def on_attn(mod, inp, out):
            weights = out[1] if isinstance(out, tuple) and len(out) > 1 else None
            if weights is None:
                raise RuntimeError(f"{name}.self_attn ({type(mod).__name__}) returned no attention weights in eager mode")
            # eager_attention_forward returns the (post-dropout) matrix it multiplied with V
            s.capture_attention(current["cap"], weights, weights)

        s.hook(attn, on_attn)
    if "hidden" in want:
        def on_mid(mod, args, kwargs):
            current["cap"].mid = s.keep(_first(args, kwargs, "input"))

        def on_out(mod, args, out):
            cap = current["cap"]
            cap.hidden = s.keep(out[0] if isinstance(out, tuple) else out)
            if s.rec.default_stream == stream:  # a tower alone: rec.hidden_states too, as for a ViT
                s.rec._hidden_states.append(cap.hidden)

        s.hook(layer.layer_norm2, on_mid, pre=True, with_kwargs=True)
        s.hook(layer, on_out)


def _hf_heads_clip(attn: nn.Module) -> int:
    heads = getattr(attn, "num_heads", None)
    return int(heads) if heads is not None else _hf_heads(attn)
