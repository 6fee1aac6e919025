"""Record what a Vision Transformer computes: attention (and its gradient), queries, keys,
values, hidden states and MLP activations of every block, without changing the model.

This is the only module in vitlab that registers hooks or flips a model's flags. Methods
(rollout, relevance, projection, ...) read a :class:`Recording`.

Why it is needed: timm's ``Attention`` computes attention with
``F.scaled_dot_product_attention`` when ``attn.fused_attn`` is True (the default), and
Hugging Face ViTs run SDPA by default; in both the softmax matrix is never materialised, so
a hook sees nothing. While recording, vitlab switches every attention module to its eager
path (mathematically the same computation), hooks the post-softmax matrix the model
really multiplies with the values, and on exit — also when the forward raises — puts every
flag back and removes every hook.

Mode: ``record`` leaves the model in its mode unless asked (``eval_mode=True``, which every
vitlab method uses: the maps are defined in eval mode, with dropout off and BatchNorm
statistics read, not updated; each module's mode comes back on exit). A model recorded in
train mode gives the matrix after attention dropout for timm and Hugging Face alike: the
one multiplied with the values (Hugging Face returns no other).

Usage::

    with vitlab.record(model, gradients=True) as rec:
        logits = model(x)
        logits[:, 3].sum().backward()
    rec.attentions[l]       # B x heads x N x N, post-softmax
    rec.attention_grads[l]  # B x heads x N x N, d(output)/d(attention), same order

Record only what you read: ``record(model, capture=("attention",))`` keeps the attention
alone (no Q, K, V, hidden states: fewer hooks, less memory), ``capture=("query", "key")``
keeps the queries and keys and leaves the model on its fused attention path (no matrix is
materialised). Reading a field that was not captured raises :class:`NotRecordedError`,
which says how to ask for it.

Each attention module feeds one *stream* of captures. ViTs have a single stream,
``"self"``. Hugging Face LXMERT and DETR (chapter 9) have several, named for a reader
(:data:`LXMERT_STREAMS`: ``lang``, ``vision``, ``lang->vision``, ``vision->lang``,
``cross.lang``, ``cross.vision``; :data:`DETR_STREAMS`: ``encoder``, ``decoder``, ``cross``),
and ``rec.events`` lists every capture of every stream in the order the model computed
them, each with its query and key modality -- what a relevance engine walks through::

    with vitlab.record(lxmert, gradients=True) as rec:
        out = lxmert(input_ids=ids, visual_feats=feats, visual_pos=boxes)
        out.question_answering_score[:, answer].sum().backward()
    for e in rec.events:    # lang x9, vision x5, then per cross-modality layer:
        e.stream, e.query_modality, e.key_modality   # lang->vision, vision->lang, cross.lang, cross.vision
        e.attention, e.grad                          # B x heads x Nq x Nk each

There a capture whose attention cannot reach the differentiated output (LXMERT's last
image->text attention and image self-attention: the answer reads the text side only) gets
a zero gradient, not an error. LXMERT runs eager attention only; DETR runs SDPA, switched to
eager while the recording is open and put back exactly. DETR's encoder tokens are its
backbone's feature map flattened row-major: ``rec.feature_grid`` is its ``(h, w)``. These
models have no ViT token layout: ``rec.layout`` is None.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
from torch import nn

from vitlab.layout import is_hf_model, is_timm_vit, token_layout
from vitlab.record._session import (  # noqa: F401  (the public names, and the engine's for adapters)
    CAPTURE_FIELDS, AttentionCapture, NotRecordedError, Recording, _MULTI_FIELDS, _Session,
    check_capture,
)
from vitlab.record.clip import CLIP_STREAMS, ClipCapture, _attach_clip, _clip_towers  # noqa: F401
from vitlab.record.detr import DETR_STREAMS, _attach_detr, _detr_core
from vitlab.record.lrp import BERT_LIKE, LRP_RULES, attach_lrp  # noqa: F401
from vitlab.record.swin import SwinCapture, attach_swin, swin_blocks  # noqa: F401
from vitlab.record.lxmert import LXMERT_STREAMS, _attach_lxmert, _lxmert_encoder
from vitlab.record.visualbert import (
    VILT_STREAMS, VISUALBERT_STREAMS, _attach_vilt, _attach_visualbert, _vilt_encoder, _visualbert_encoder,
)
from vitlab.record.vit import (
    _attach_hf, _attach_timm, _hf_attention_modules, _hf_heads, _timm_attention_modules,
)


@dataclass(frozen=True)
class Adapter:
    """One family of models :func:`record` can hook, declared once in :data:`ADAPTERS`.

    ``find(model)`` returns what ``attach`` hooks (a ViT's ``(name, block, attention)`` list, an
    encoder, a pair of towers), or None / an empty list when ``model`` is not of this family;
    ``attach(model, session, mlp, found)`` registers the hooks. ``streams`` (multi-stream families
    only: stream -> (query modality, key modality)) makes the recording per stream;
    ``records_hidden``: such a family records hidden states per capture (the others read them
    from the model's own output); ``models``: the models it covers, for messages."""

    family: str
    find: Callable
    attach: Callable
    models: str
    streams: dict | None = None
    records_hidden: bool = False


def _hf_type(model_types: tuple[str, ...], find: Callable) -> Callable:
    """A finder that answers only for Hugging Face models whose ``config.model_type`` is in ``model_types``."""
    def found(model: nn.Module):
        if is_hf_model(model) and getattr(model.config, "model_type", None) in model_types:
            return find(model)
        return None
    return found


def _timm_vit_blocks(model: nn.Module):
    return _timm_attention_modules(model) if is_timm_vit(model) else None


def _hf_vit_blocks(model: nn.Module):
    return _hf_attention_modules(model) if is_hf_model(model) else None


#: Every family :func:`record` can hook, tried in this order (the first whose ``find`` answers
#: wins). A new family is one adapter module in ``vitlab/record/`` and one line here.
ADAPTERS = (
    Adapter("swin", swin_blocks, attach_swin, "timm and Hugging Face Swin (windowed attention, stages)",
            {"self": ("image", "image")}, records_hidden=True),
    Adapter("vit", _timm_vit_blocks, _attach_timm,
            "timm VisionTransformer models (ViT, DeiT, DeiT-distilled, DINOv2, DINOv2 with registers, FlexiViT, "
            "and vitlab's embedded models), timm BEiT, EVA-02 and CaiT"),
    Adapter("lxmert", _hf_type(("lxmert",), _lxmert_encoder), _attach_lxmert,
            "Hugging Face LXMERT (LxmertModel, LxmertForQuestionAnswering, ...)", LXMERT_STREAMS),
    Adapter("detr", _hf_type(("detr",), _detr_core), _attach_detr,
            "Hugging Face DETR (DetrModel, DetrForObjectDetection, ...)", DETR_STREAMS),
    Adapter("visual_bert", _hf_type(("visual_bert",), _visualbert_encoder), _attach_visualbert,
            "Hugging Face VisualBERT", VISUALBERT_STREAMS),
    Adapter("vilt", _hf_type(("vilt",), _vilt_encoder), _attach_vilt, "Hugging Face ViLT", VILT_STREAMS),
    Adapter("clip", _hf_type(("clip", "clip_vision_model", "clip_text_model"), _clip_towers), _attach_clip,
            "Hugging Face CLIP (CLIPModel, CLIPVisionModel, CLIPTextModel, ...)", CLIP_STREAMS, records_hidden=True),
    Adapter("vit", _hf_vit_blocks, _attach_hf, "Hugging Face ViT, DeiT, BEiT, Dinov2 and SigLIP vision models"),
)

#: The models :func:`record` supports, in words (for messages).
SUPPORTED = "; ".join(a.models for a in ADAPTERS)

# multi-stream families: attach function -> (family, streams)
_MULTI = {a.attach: (a.family, a.streams) for a in ADAPTERS if a.streams is not None}
# multi-stream families that record hidden states per capture (the others: from the model itself)
_HIDDEN_FAMILIES = tuple(a.family for a in ADAPTERS if a.records_hidden)


def _found(found) -> bool:
    return found is not None and not (isinstance(found, (list, tuple)) and len(found) == 0)


def _adapter_for(model: nn.Module):
    """``(attach, found)``: the family's adapter and what it attaches to (for a ViT, its
    ``(name, block, attention)`` list): the first of :data:`ADAPTERS` whose ``find`` answers."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"vitlab.record expects a torch.nn.Module, got {type(model).__name__}")
    for adapter in ADAPTERS:
        found = adapter.find(model)
        if _found(found):
            return adapter.attach, found
    raise TypeError(
        f"{type(model).__name__} has no attention blocks vitlab can record. Supported: {SUPPORTED}."
    )


def require_materialized(model: nn.Module, method: str) -> None:
    """Raise ``ValueError`` when a parameter or buffer of ``model`` is on PyTorch's ``meta``
    device (a shape without values: the model was made under ``torch.device("meta")`` or an
    empty-weights context and its weights never loaded), before any forward -- which would
    otherwise fail inside torch with a device error. :func:`record` and every method's input
    check (:func:`vitlab.inputs.check_input_dtype`, the CLIP and faithfulness checks) call it."""
    if not isinstance(model, nn.Module):
        return
    meta = next((name for name, t in (*model.named_parameters(), *model.named_buffers()) if t.is_meta), None)
    if meta is not None:
        raise ValueError(f"{method}: {type(model).__name__} is on the 'meta' device ({meta} has a shape but no "
                         "values: the model was built without its weights); load the weights first, e.g. "
                         "vitlab.load_model(name), or model.to_empty(device='cpu') then model.load_state_dict(...)")


def model_family(model: nn.Module) -> str:
    """The family of ``model`` as vitlab records it: ``"vit"`` (timm and Hugging Face ViTs),
    ``"lxmert"``, ``"visualbert"``, ``"vilt"``, ``"detr"``, ``"clip"`` or ``"swin"`` (:func:`vitlab.explain`
    dispatches on it). TypeError, naming what is supported, for a model vitlab cannot record."""
    attach, _ = _adapter_for(model)
    family = _MULTI.get(attach)
    return "vit" if family is None else family[0].replace("_", "")


def _vit_only(model: nn.Module, what: str):
    attach, found = _adapter_for(model)
    if attach is attach_swin:
        raise TypeError(
            f"{type(model).__name__} is a Swin transformer (windowed attention in stages joined by patch merging, "
            "a mean-pooled head): the ViT methods do not apply to it. Use vitlab.hierarchical: swin_relevance, "
            "swin_rollout, swin_raw_attention, swin_gradcam")
    if _vision_tower_alone(attach, found):  # CLIP's vision tower alone: one stack of blocks over image tokens
        return attach, found
    if attach in _MULTI:
        family = _MULTI[attach][0]
        raise TypeError(
            f"{what} is defined for ViTs (one stack of blocks over one image's tokens), not for "
            f"{type(model).__name__}, a {family} model with several attention streams; explain it with the "
            f"{family} methods of vitlab.relevance (e.g. clip_relevance for CLIP's image-text score), or pass "
            "its vision tower alone"
        )
    return attach, found


@contextlib.contextmanager
def eval_mode(model: nn.Module) -> Iterator[nn.Module]:
    """Run ``model`` with every module in eval mode inside the block; each module's own mode
    comes back on exit, also when the block raises. For code that only runs forwards (no
    hooks, no recording): the measures of :mod:`vitlab.faithfulness`, input x gradient."""
    modes = [(m, m.training) for m in model.modules()]
    try:
        model.eval()
        yield model
    finally:
        for m, mode in modes:
            m.training = mode


def _vision_tower_alone(attach, found) -> bool:
    """Whether a CLIP recording has the image tower alone (``CLIPVisionModel``): a ViT to the methods."""
    return attach is _attach_clip and [stream for stream, _, _ in found] == ["image"]


def blocks(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks of a supported ViT, in the order they run (one per recorded layer)."""
    attach, found = _vit_only(model, "this method")
    if _vision_tower_alone(attach, found):
        return list(found[0][2].encoder.layers)
    return [block for _, block, _ in found]


def attention_size(model: nn.Module, num_tokens: int) -> int:
    """Entries of one sample's attention that a forward inside :func:`record` keeps: the sum
    over blocks of ``heads x N x N``, for ``N = num_tokens``. Methods size their chunks by it."""
    attach, found = _vit_only(model, "this method")
    if _vision_tower_alone(attach, found):
        heads = sum(_hf_heads(layer.self_attn) for layer in found[0][2].encoder.layers)
    elif attach is _attach_timm:
        heads = sum(int(attn.num_heads) for _, _, attn in found)
    else:
        heads = sum(_hf_heads(attn) for _, _, attn in found)
    return heads * int(num_tokens) ** 2




@contextlib.contextmanager
def record(
    model: nn.Module, gradients: bool = False, mlp: bool = False, detach: bool | None = None,
    eval_mode: bool = False, residual: bool = False, attention_edit: Callable | None = None,
    capture=None, lrp: str | None = None,
) -> Iterator[Recording]:
    """Record every attention block of ``model`` during the forward passes in the block.

    Args:
        model: a supported ViT, or a Hugging Face LXMERT, DETR or CLIP model (see ``SUPPORTED``;
            CLIP: :mod:`vitlab.record.clip`); left exactly as it was on exit.
        capture: which per-block fields to keep, names from :data:`CAPTURE_FIELDS`:
            ``"attention"`` (``rec.attentions``), ``"query"``, ``"key"``, ``"value"``
            (``rec.queries`` / ``keys`` / ``values``, B x heads x N x head_dim) and
            ``"hidden"`` (``rec.hidden_states``); None (default) keeps all five. Ask for what
            you read: each field left out is a hook fewer per block and memory not held, and
            without ``"attention"`` (and without ``attention_edit``) the model keeps its
            fused attention path. Reading a field left out raises :class:`NotRecordedError`.
            ``residual=True`` adds ``"hidden"``. LXMERT and DETR: attention, query, key and
            value (the default), no hidden states (the model's ``output_hidden_states=True``
            gives them). CLIP: all five, per capture of each tower's stream
            (:class:`vitlab.record.clip.ClipCapture`).
        gradients: also record ``d(output)/d(attention)`` per layer (needs ``"attention"``
            in ``capture``); call ``backward()`` inside the with-block. LXMERT / DETR: an
            attention the output does not depend on gets zeros.
        mlp: also record each block's MLP hidden activation (after the non-linearity),
            ``rec.mlp_activations[l]`` of shape B x N x hidden.
        detach: store detached tensors (default: detached unless ``gradients``).
        eval_mode: run every module in eval mode inside the block (dropout off, BatchNorm
            statistics frozen) and put each module's mode back on exit; vitlab's methods do.
        residual: also record the residual stream of every (pre-norm) block:
            ``rec.block_inputs[l]`` (entering block l) and ``rec.mid_states[l]`` (after its
            attention sublayer, what the second norm reads), B x N x D; with
            ``rec.hidden_states[l]`` (leaving it) they give ``rec.attention_outputs`` and
            ``rec.mlp_outputs``, what each sublayer adds to the stream.
        attention_edit: edit the attention of the forwards in the block (cut query -> key
            pairs, for all heads or per head): ``attention_edit(layer, num_tokens)`` is called in every block
            and returns a boolean mask of allowed query -> key pairs (``N x N``, or anything
            broadcasting to ``B x heads x N x N``; True = allowed) or None (no edit there).
            Disallowed pairs get -inf added to their attention logits before the softmax, so
            each query's attention is renormalised over the keys it may see. The edit lasts
            only while the recording is open; the model itself is not changed.
        lrp: ``"attnlrp"`` or ``"chefer"`` (:data:`vitlab.record.lrp.LRP_RULES`): the
            backward of every forward in the block runs the LRP rules of that set (see
            :mod:`vitlab.record.lrp`), so ``x ⊙ grad`` of any tensor is its LRP relevance;
            ``rec.patch_tokens`` holds the patch embedding's output of each forward, and
            ``with rec.plain_gradients():`` gives the model's own gradients for the
            backwards inside it. The forward's values are the model's; the rules go with the
            recording (a thread-local torch function mode, active only inside the model's
            forward in the recording's thread).
        (``mlp``, ``residual``, ``attention_edit`` and ``lrp`` are for ViTs: LXMERT and DETR refuse them;
        ``lrp`` also works on VisualBERT and LXMERT, :data:`vitlab.record.lrp.BERT_LIKE`.)

    Recordings of one model may overlap (nested, or closed in any order): each removes its
    own hooks, and a flag gets its original value back when the last of them closes.
    A recording captures the forward passes of the thread that opened it, and only those:
    threads may record (and run vitlab's methods on) one model at the same time, each
    getting its own forwards. While any recording is open the model runs its eager
    attention path (the same numbers), and with ``eval_mode`` in eval mode, in every thread.

    Raises:
        ValueError: ``capture`` names an unknown field, or ``gradients=True`` without
            ``"attention"`` in it, or a ViT-only option for LXMERT / DETR.
        TypeError: the model has no attention blocks of a supported family.
        RuntimeError: with ``gradients=True``, a forward inside the block ran with gradients
            disabled (``torch.no_grad()`` / ``torch.inference_mode()``).
    """
    require_materialized(model, "record")
    captured = check_capture(capture)
    if residual:
        captured |= {"hidden"}
    if gradients and "attention" not in captured:
        raise ValueError(
            f"record(gradients=True) records the gradient of the attention, but capture={tuple(sorted(captured))!r} "
            "leaves the attention out; add 'attention' to capture"
        )
    attach, found = _adapter_for(model)
    family = _MULTI.get(attach)
    if family is not None:
        name = type(model).__name__
        if capture is None:
            captured = frozenset(CAPTURE_FIELDS) if family[0] in _HIDDEN_FAMILIES else _MULTI_FIELDS
        elif "hidden" in captured and family[0] not in _HIDDEN_FAMILIES:
            raise ValueError(
                f"record(capture=...) of {name} records attention, query, key and value; its hidden states "
                "come from the model itself: call it with output_hidden_states=True"
            )
        unsupported = [arg for arg, on in (("mlp", mlp), ("residual", residual), ("attention_edit", attention_edit),
                                           ("lrp", lrp is not None and family[0] not in BERT_LIKE)) if on]
        if unsupported:
            raise ValueError(f"record({', '.join(unsupported)}=...) is defined for ViTs, not for {name}")
    rec = Recording(layout=None, captured=captured)
    if family is not None:
        rec.family, rec.default_stream = family[0], None
        rec.modalities = tuple(dict.fromkeys(m for pair in family[1].values() for m in pair))
    session = _Session(rec, gradients=gradients, detach=(not gradients) if detach is None else detach,
                       residual=residual, attention_edit=attention_edit)

    def on_input(mod, args, kwargs):
        if gradients and not torch.is_grad_enabled():
            raise RuntimeError(
                "vitlab.record(model, gradients=True): the forward ran with gradients disabled (inside "
                "torch.no_grad() or torch.inference_mode()), so no gradient can reach the attention; run the "
                "forward and backward outside no_grad or inside torch.enable_grad() (inference_mode cannot "
                "be switched off from inside: leave it first)"
            )
        if family is not None:  # not a ViT: no token layout
            return
        x = args[0] if args else next(iter(kwargs.values()), None)
        if isinstance(x, torch.Tensor) and x.ndim == 4:
            rec.layout = token_layout(model, x)

    try:
        session.hook(model, on_input, pre=True, with_kwargs=True)
        attach(model, session, mlp, found)
        if lrp is not None:
            attach_lrp(model, session, lrp, found)
        if eval_mode:
            for module in model.modules():
                session.set_attr(module, "training", False)
        if rec.layout is None and family is None:
            rec.layout = token_layout(model)
        yield rec
    finally:
        session.close()
