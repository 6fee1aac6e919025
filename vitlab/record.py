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
``"self"``. Hugging Face LXMERT and DETR (chapter 5) have several, named for a reader
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
import threading
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch
from torch import nn

from vitlab.layout import TokenLayout, is_hf_model, is_timm_vit, token_layout

SUPPORTED = (
    "timm VisionTransformer models (ViT, DeiT, DeiT-distilled, DINOv2, DINOv2 with registers, "
    "and vitlab's embedded models), Hugging Face ViT, DeiT and Dinov2 models, and Hugging Face "
    "LXMERT (LxmertModel, LxmertForQuestionAnswering, ...) and DETR (DetrModel, DetrForObjectDetection, ...)"
)


#: What ``record(model, capture=...)`` can keep, per attention module / block.
CAPTURE_FIELDS = ("attention", "query", "key", "value", "hidden")

# The Recording property that reads each field.
_FIELD_LISTS = {"attention": "attentions", "query": "queries", "key": "keys", "value": "values",
                "hidden": "hidden_states"}


class NotRecordedError(RuntimeError):
    """A field of a :class:`Recording` was read that its ``record(..., capture=...)`` did not keep."""


def check_capture(capture) -> frozenset[str]:
    """``capture`` (None: every field of :data:`CAPTURE_FIELDS`; a name; or an iterable of
    names) as a frozenset, or ``ValueError`` naming the bad entries and the valid ones."""
    if capture is None:
        return frozenset(CAPTURE_FIELDS)
    if isinstance(capture, str):
        capture = (capture,)
    try:
        names = list(capture)
    except TypeError:
        raise ValueError(
            f"capture must be None or an iterable of field names from {CAPTURE_FIELDS}, got {capture!r}"
        ) from None
    bad = [n for n in names if not isinstance(n, str) or n not in CAPTURE_FIELDS]
    if bad:
        raise ValueError(
            f"capture: unknown field name{'s' if len(bad) > 1 else ''} {', '.join(map(repr, bad))}; "
            f"choose from {CAPTURE_FIELDS} (e.g. capture=('attention',))"
        )
    return frozenset(names)


@dataclass
class AttentionCapture:
    """What one attention module computed in one forward pass (fields the recording did not
    ``capture`` stay None)."""

    name: str                                  # module path in the model
    stream: str = "self"                       # the stream it belongs to (see Recording.streams)
    query_modality: str = "image"              # whose tokens ask (rows of the attention) ...
    key_modality: str = "image"                # ... and whose tokens answer (columns)
    layer: int = 0                             # its index in its stream's stack of modules
    attention: torch.Tensor | None = None      # B x heads x Nq x Nk, post-softmax
    query: torch.Tensor | None = None          # B x heads x Nq x head_dim
    key: torch.Tensor | None = None            # B x heads x Nk x head_dim
    value: torch.Tensor | None = None          # B x heads x Nk x head_dim
    grad: torch.Tensor | None = None           # d(output)/d(attention), filled by backward


@dataclass
class Recording:
    """Everything recorded inside one ``with vitlab.record(model)`` block.

    Lists are in the order the modules ran (block order for a ViT). Tensors stay attached
    to the autograd graph when ``gradients=True`` (or ``detach=False``), so they can be
    differentiated; otherwise they are detached.

    ``streams`` holds each stream's captures; ``events`` holds every capture of every
    stream in the order the model computed them, each knowing its stream and its query and
    key modality (what a relevance engine walks through). A ViT has one stream, ``"self"``,
    with the ``"image"`` modality; see :data:`LXMERT_STREAMS` and :data:`DETR_STREAMS` for
    the bi-modal and encoder-decoder models.
    """

    layout: TokenLayout | None = None
    streams: dict[str, list[AttentionCapture]] = field(default_factory=dict)
    # the per-block fields of CAPTURE_FIELDS this recording keeps (record's ``capture``)
    captured: frozenset[str] = frozenset(CAPTURE_FIELDS)
    _hidden_states: list[torch.Tensor] = field(default_factory=list, repr=False)
    mlp_activations: list[torch.Tensor] = field(default_factory=list)
    # with residual=True: the residual stream entering each block, and after its attention sublayer
    block_inputs: list[torch.Tensor] = field(default_factory=list)
    mid_states: list[torch.Tensor] = field(default_factory=list)
    default_stream: str | None = "self"    # what rec.attentions etc. read (None: several streams)
    events: list[AttentionCapture] = field(default_factory=list)
    family: str = "vit"                     # "vit", "lxmert" or "detr"
    modalities: tuple[str, ...] = ("image",)
    # DETR: (h, w) of the feature map the encoder tokens were flattened from (row-major), so
    # ``attention[..., k]`` of an encoder key k reshapes to h x w; None for other models
    feature_grid: tuple[int, int] | None = None
    # why attention gradients cannot arrive, when a forward already showed it (see attention_grads)
    _no_grad_reason: str | None = field(default=None, repr=False)

    def stream(self, name: str | None = None) -> list[AttentionCapture]:
        """The captures of stream ``name`` (default: the ViT's ``"self"``), in the order they ran."""
        if name is None:
            self._single_stream()
            name = self.default_stream
        if name not in self.streams:
            raise KeyError(f"no attention stream {name!r} was recorded; recorded: {sorted(self.streams)}")
        return self.streams[name]

    def _require(self, name: str) -> None:
        if name not in self.captured:
            asked = tuple(f for f in CAPTURE_FIELDS if f in self.captured or f == name)
            raise NotRecordedError(
                f"rec.{_FIELD_LISTS[name]} was not recorded: this recording captured only "
                f"{tuple(f for f in CAPTURE_FIELDS if f in self.captured)}; ask for {name!r} with "
                f"vitlab.record(model, capture={asked!r}) (or leave capture out to record every field)"
            )

    def _single_stream(self) -> None:
        if self.default_stream is None:
            raise NotRecordedError(
                f"this {self.family} recording has several attention streams {tuple(self.streams)}: read one "
                "with rec.stream(name) (each capture has .attention, .grad, .query, ...) or all of them, in "
                "the order the model computed them, with rec.events"
            )

    def _field(self, attr: str) -> list[torch.Tensor]:
        if attr != "grad":
            self._require(attr)
        self._single_stream()
        return [getattr(c, attr) for c in self.streams.get(self.default_stream, [])]

    @property
    def hidden_states(self) -> list[torch.Tensor]:
        """The residual stream leaving each block, B x N x D (``capture`` with ``"hidden"``)."""
        self._require("hidden")
        return self._hidden_states

    @property
    def attentions(self) -> list[torch.Tensor]:
        return self._field("attention")

    @property
    def queries(self) -> list[torch.Tensor]:
        return self._field("query")

    @property
    def keys(self) -> list[torch.Tensor]:
        return self._field("key")

    @property
    def values(self) -> list[torch.Tensor]:
        return self._field("value")

    @property
    def attention_grads(self) -> list[torch.Tensor]:
        """d(output)/d(attention) of each block (``gradients=True``, after ``backward()``)."""
        return self.grads()

    def grads(self, stream: str | None = None) -> list[torch.Tensor]:
        """The attention gradients of ``stream``'s captures (default: the ViT's ``"self"``;
        ``"events"``: every capture in ``rec.events``), or ``RuntimeError`` saying why they
        are missing."""
        self._require("attention")
        caps = self.events if stream == "events" else self.stream(stream)
        grads = [c.grad for c in caps]
        if any(g is None for g in grads):
            if self._no_grad_reason is not None:
                raise RuntimeError(f"attention gradients are missing: {self._no_grad_reason}")
            raise RuntimeError(
                "attention gradients are missing: use vitlab.record(model, gradients=True) and call "
                "backward() on the output inside the with-block"
            )
        return grads

    @property
    def attention_outputs(self) -> list[torch.Tensor]:
        """What each block's attention sublayer added to the residual stream (``residual=True``):
        ``mid_states[l] - block_inputs[l]``, B x N x D (after any layer scale)."""
        return [m - i for m, i in zip(self.mid_states, self.block_inputs)]

    @property
    def mlp_outputs(self) -> list[torch.Tensor]:
        """What each block's MLP sublayer added to the residual stream (``residual=True``):
        ``hidden_states[l] - mid_states[l]``, B x N x D."""
        return [h - m for h, m in zip(self.hidden_states, self.mid_states)]

    def clear(self) -> None:
        """Forget what was recorded (the hooks stay): the next forward starts fresh lists.

        For loops that keep one recording open around many forwards (activation
        maximisation), instead of entering ``record`` every step."""
        self._hidden_states.clear()
        self.mlp_activations.clear()
        self.block_inputs.clear()
        self.mid_states.clear()
        self._no_grad_reason = None
        self.events.clear()
        for stream in self.streams.values():
            stream.clear()

    @property
    def num_layers(self) -> int:
        """Attention calls recorded in the default stream (blocks, for one ViT forward); with
        no attention field captured, the hidden states recorded; with several streams, every
        attention call recorded (``len(events)``)."""
        if self.default_stream is None:
            return len(self.events)
        if self.captured & {"attention", "query", "key", "value"}:
            return len(self.streams.get(self.default_stream, []))
        return len(self._hidden_states)


# --------------------------------------------------------------------------------------
# Adapters: each knows one family's modules. They return the restore actions they need.
# --------------------------------------------------------------------------------------
# Flags changed by open recordings: (id(obj), name) -> [had_own, original value, open count].
# Recordings of one model may overlap (nested, or closed out of order): the flag keeps its
# recording value while any of them is open, and gets its original back when the last closes.
_PATCHES: dict[tuple[int, str], list] = {}
_PATCH_LOCK = threading.Lock()


class _Session:
    """Hooks and flag changes of one recording; ``close()`` undoes all of them.

    The hooks capture only the forward passes of the thread that opened the recording
    (``thread``): another thread's forward through the same model, plain or inside its own
    recording, runs past them, so concurrent recordings of one model stay apart.
    """

    def __init__(self, rec: Recording, gradients: bool, detach: bool, residual: bool = False,
                 attention_edit: Callable | None = None):
        self.rec = rec
        self.capture = rec.captured
        self.gradients = gradients
        self.detach = detach
        self.residual = residual
        self.attention_edit = attention_edit
        self.thread = threading.get_ident()
        self._undo: list[Callable[[], None]] = []
        # bi-modal / encoder-decoder models: a capture whose attention cannot reach the
        # differentiated output gets a zero gradient (see finish_forward)
        self.zero_unreached = False
        self._pending: list[tuple[AttentionCapture, torch.Tensor]] = []

    def open_capture(self, stream: str, name: str, query_modality: str = "image", key_modality: str = "image",
                     layer: int = 0) -> AttentionCapture:
        """A new capture at the end of ``stream`` and of ``rec.events``."""
        cap = AttentionCapture(name=name, stream=stream, query_modality=query_modality,
                               key_modality=key_modality, layer=layer)
        self.rec.streams.setdefault(stream, []).append(cap)
        self.rec.events.append(cap)
        return cap

    def keep(self, t: torch.Tensor) -> torch.Tensor:
        return t.detach() if self.detach else t

    def hook(self, module: nn.Module, fn, pre: bool = False, with_kwargs: bool = False) -> None:
        """Call ``fn`` on ``module``'s forwards run by this recording's thread (until ``close()``)."""
        def own_thread_only(*args, fn=fn, thread=self.thread):
            if threading.get_ident() == thread:
                return fn(*args)
            return None

        if pre:
            handle = module.register_forward_pre_hook(own_thread_only, with_kwargs=with_kwargs)
        elif with_kwargs:
            handle = module.register_forward_hook(own_thread_only, with_kwargs=True)
        else:
            handle = module.register_forward_hook(own_thread_only)
        self._undo.append(handle.remove)

    def set_attr(self, obj, name: str, value) -> None:
        """Set ``obj.name = value`` until ``close()``; the original comes back when the last
        open recording that set it closes (see ``_PATCHES``)."""
        key = (id(obj), name)
        with _PATCH_LOCK:
            entry = _PATCHES.get(key)
            if entry is None:
                had_own = name in obj.__dict__
                entry = _PATCHES[key] = [had_own, obj.__dict__[name] if had_own else getattr(obj, name), 0]
            entry[2] += 1
            setattr(obj, name, value)

        def restore(obj=obj, name=name, key=key):
            with _PATCH_LOCK:
                entry = _PATCHES[key]
                entry[2] -= 1
                if entry[2] > 0:
                    return
                del _PATCHES[key]
                had_own, old, _ = entry
                if had_own:
                    obj.__dict__[name] = old
                else:
                    setattr(obj, name, old)

        self._undo.append(restore)

    def capture_attention(self, cap: AttentionCapture, probs: torch.Tensor, used: torch.Tensor) -> None:
        """``probs``: the post-softmax matrix; ``used``: the tensor multiplied with V."""
        cap.attention = self.keep(probs)
        if self.gradients and used.requires_grad and self.zero_unreached:
            self._pending.append((cap, used))  # its gradient arrives through finish_forward's hook
        elif self.gradients and used.requires_grad:
            def on_grad(g, cap=cap):
                cap.grad = g.detach()
            used.register_hook(on_grad)
        elif self.gradients and self.rec._no_grad_reason is None:
            self.rec._no_grad_reason = (
                f"nothing in the forward required a gradient up to the attention of {cap.name} (the parameters "
                "up to there are frozen and the input does not require grad): call x.requires_grad_(True) on "
                "the input before the forward"
            )

    def finish_forward(self) -> None:
        """At the end of a forward of a model with ``zero_unreached`` (of its encoder or
        transformer, after any backbone): one hook on the attention tensors captured since,
        called once a backward has computed every gradient it will compute. Each capture gets
        its gradient, or zeros where the differentiated output does not depend on that
        attention at all (e.g. the last layer's vision self-attention of LXMERT, whose output
        no answer reads). Attentions outside the graph of the backward get zeros too: call
        ``backward()`` on the score (``torch.autograd.grad`` with a subset of the attentions
        as inputs leaves the others at zero)."""
        pending, self._pending = self._pending, []
        if not pending:
            return
        caps = [cap for cap, _ in pending]
        shapes = [(used.shape, used.dtype, used.device) for _, used in pending]

        def on_grads(grads, caps=caps, shapes=shapes):
            for cap, g, (shape, dtype, device) in zip(caps, grads, shapes):
                cap.grad = g.detach() if g is not None else torch.zeros(shape, dtype=dtype, device=device)

        torch.autograd.graph.register_multi_grad_hook([used for _, used in pending], on_grads, mode="all")

    def close(self) -> None:
        while self._undo:
            self._undo.pop()()


# Blocks whose second norm does not read the residual stream after the attention sublayer
# (post-norm, parallel attention + MLP): their residual states are not recorded.
_NOT_PRE_NORM = ("ResPostBlock", "ParallelScalingBlock", "ParallelThingsBlock")


def _attach_residual(s: _Session, block: nn.Module, block_name: str) -> None:
    """Hooks for ``residual=True``: the block's input and the input of its second norm (the
    residual stream after the attention sublayer, in a pre-norm block)."""
    norm2 = next((getattr(block, n) for n in ("norm2", "layernorm_after") if isinstance(getattr(block, n, None), nn.Module)), None)
    if norm2 is None or type(block).__name__ in _NOT_PRE_NORM:
        raise TypeError(
            f"block {block_name} ({type(block).__name__}) is not a pre-norm block with a second norm "
            "(norm2 / layernorm_after) reading the residual stream, so its residual states cannot be recorded"
        )

    def first_arg(args, kwargs):
        return args[0] if args else next(iter(kwargs.values()))

    s.hook(block, lambda mod, args, kwargs: s.rec.block_inputs.append(s.keep(first_arg(args, kwargs))),
           pre=True, with_kwargs=True)
    s.hook(norm2, lambda mod, args, kwargs: s.rec.mid_states.append(s.keep(first_arg(args, kwargs))),
           pre=True, with_kwargs=True)


def _edit_bias(s: _Session, layer: int, hidden: torch.Tensor, existing: torch.Tensor | None) -> torch.Tensor | None:
    """The additive attention bias for block ``layer`` under ``s.attention_edit`` (None: no edit).

    The edit returns a boolean mask of allowed query -> key pairs, ``N x N`` or anything that
    broadcasts to ``B x heads x N x N`` (True = allowed), or None for no edit in this block;
    disallowed pairs get -inf added to their logits before the softmax, on top of any mask
    the caller passed (``existing``)."""
    B, N = hidden.shape[0], hidden.shape[1]
    allowed = s.attention_edit(layer, N)
    if allowed is None:
        return existing
    allowed = torch.as_tensor(allowed, device=hidden.device)
    if allowed.dtype != torch.bool:
        raise TypeError(f"attention_edit must return a boolean mask (True = allowed), got dtype {allowed.dtype}")
    if allowed.shape[-2:] != (N, N):
        raise ValueError(f"attention_edit returned a mask of shape {tuple(allowed.shape)}; its last two dims must be {N} x {N}")
    if not bool(allowed.any(dim=-1).all()):
        raise ValueError(f"attention_edit: block {layer} has a query allowed to attend to no key (its softmax is undefined)")
    while allowed.ndim < 4:
        allowed = allowed.unsqueeze(0)
    bias = torch.zeros(allowed.shape, dtype=hidden.dtype, device=hidden.device).masked_fill(~allowed, float("-inf"))
    if existing is not None:
        if existing.dtype == torch.bool:
            existing = torch.zeros_like(existing, dtype=hidden.dtype).masked_fill(~existing, float("-inf"))
        bias = bias + existing
    return bias


def _split_heads(t: torch.Tensor, num_heads: int) -> torch.Tensor:
    B, N, D = t.shape
    return t.reshape(B, N, num_heads, D // num_heads).transpose(1, 2)


def _timm_attention_modules(model: nn.Module) -> list[tuple[str, nn.Module, nn.Module]]:
    """(block name, block, attention module) for every timm Attention-like block."""
    found = []
    for name, block in model.named_modules():
        attn = getattr(block, "attn", None)
        if (
            isinstance(attn, nn.Module)
            and hasattr(attn, "fused_attn")
            and isinstance(getattr(attn, "attn_drop", None), nn.Module)
            and hasattr(attn, "qkv")
            and hasattr(attn, "num_heads")
        ):
            found.append((name, block, attn))
    return found


def _mlp_activation_module(block: nn.Module) -> nn.Module | None:
    mlp = getattr(block, "mlp", None)
    if mlp is None:
        return None
    for attr in ("act", "activation", "activation_fn", "intermediate_act_fn"):
        m = getattr(mlp, attr, None)
        if isinstance(m, nn.Module):
            return m
    return None


def _attach_timm(model: nn.Module, s: _Session, mlp: bool, blocks, stream: str = "self",
                 modality: str = "image") -> None:
    want = s.capture
    # the eager path only where the attention matrix is read or edited; Q, K, V and hidden
    # states are the same on the fused path, which materialises no N x N matrix
    eager = "attention" in want or s.attention_edit is not None
    qkv_fields = want & {"query", "key", "value"}
    s.rec.streams.setdefault(stream, [])
    for index, (block_name, block, attn) in enumerate(blocks):
        if eager:
            s.set_attr(attn, "fused_attn", False)
        if s.residual:
            _attach_residual(s, block, block_name)
        if s.attention_edit is not None:
            def edit(mod, args, kwargs, index=index):
                kwargs = dict(kwargs)
                kwargs["attn_mask"] = _edit_bias(s, index, args[0] if args else kwargs["x"], kwargs.get("attn_mask"))
                return args, kwargs
            s.hook(attn, edit, pre=True, with_kwargs=True)
        current: dict[str, AttentionCapture] = {}
        H = attn.num_heads

        # Q and K as the attention uses them: after q_norm / k_norm. When those are identities
        # (most ViTs) they are read straight from the qkv output, with two hooks fewer per block.
        q_plain = isinstance(attn.q_norm, nn.Identity) and isinstance(attn.k_norm, nn.Identity)

        def new_capture(current=current, block_name=block_name, index=index) -> AttentionCapture:
            cap = current["cap"] = s.open_capture(stream, f"{block_name}.attn", modality, modality, layer=index)
            return cap

        # timm calls qkv, then q_norm / k_norm, then attn_drop: the first hooked one opens the capture
        def on_qkv(mod, inp, out, H=H, q_plain=q_plain, new_capture=new_capture):
            cap = new_capture()
            B, N, C3 = out.shape
            # qkv: B x N x (3 * heads * head_dim) -> 3 x B x heads x N x head_dim
            q, k, v = out.reshape(B, N, 3, H, C3 // (3 * H)).permute(2, 0, 3, 1, 4).unbind(0)
            if "value" in want:
                cap.value = s.keep(v)
            if q_plain:
                if "query" in want:
                    cap.query = s.keep(q)
                if "key" in want:
                    cap.key = s.keep(k)

        def on_q(mod, inp, out, current=current):
            current["cap"].query = s.keep(out)

        def on_k(mod, inp, out, current=current):
            current["cap"].key = s.keep(out)

        def on_drop(mod, inp, out, current=current, new_capture=new_capture):
            cap = current["cap"] if qkv_fields else new_capture()
            # after dropout (the identity in eval mode): what multiplies V, as Hugging Face records
            s.capture_attention(cap, out, out)

        if qkv_fields:
            s.hook(attn.qkv, on_qkv)
            if not q_plain and "query" in want:
                s.hook(attn.q_norm, on_q)
            if not q_plain and "key" in want:
                s.hook(attn.k_norm, on_k)
        if "attention" in want:
            s.hook(attn.attn_drop, on_drop)
        if "hidden" in want:
            s.hook(block, lambda mod, inp, out: s.rec._hidden_states.append(s.keep(out)))
        if mlp:
            act = _mlp_activation_module(block)
            if act is None:
                raise TypeError(f"block {block_name} has no MLP activation module to record")
            s.hook(act, lambda mod, inp, out: s.rec.mlp_activations.append(s.keep(out)))


def _hf_attention_modules(model: nn.Module) -> list[tuple[str, nn.Module, nn.Module]]:
    """(layer name, layer, attention) for HF ViT-family layers (q_proj/k_proj/v_proj style)."""
    found = []
    for name, layer in model.named_modules():
        attn = getattr(layer, "attention", None)
        if isinstance(attn, nn.Module) and all(hasattr(attn, p) for p in ("q_proj", "k_proj", "v_proj")):
            found.append((name, layer, attn))
    return found


def _hf_configs(model: nn.Module) -> list:
    seen, configs = set(), []
    todo = [m.config for m in model.modules() if hasattr(m, "config") and hasattr(m.config, "_attn_implementation")]
    while todo:
        c = todo.pop()
        if id(c) in seen:
            continue
        seen.add(id(c))
        configs.append(c)
        for key in getattr(c, "sub_configs", {}) or {}:
            sub = getattr(c, key, None)
            if sub is not None:
                todo.append(sub)
    return configs


def _hf_heads(attn: nn.Module) -> int:
    return int(attn.num_attention_heads if hasattr(attn, "num_attention_heads") else attn.config.num_attention_heads)


def _attach_hf(model: nn.Module, s: _Session, mlp: bool, layers, stream: str = "self",
               modality: str = "image") -> None:
    want = s.capture
    if "attention" in want or s.attention_edit is not None:  # SDPA returns no attention weights
        for config in _hf_configs(model):
            # set the internal attribute directly: no recursion, exact restore
            s.set_attr(config, "_attn_implementation_internal", "eager")
    qkv_fields = want & {"query", "key", "value"}
    s.rec.streams.setdefault(stream, [])
    for index, (layer_name, layer, attn) in enumerate(layers):
        H = _hf_heads(attn)
        if s.residual:
            _attach_residual(s, layer, layer_name)
        if s.attention_edit is not None:
            def edit(mod, args, kwargs, index=index):
                hidden = args[0] if args else kwargs["hidden_states"]
                if len(args) > 1:
                    args = (args[0], _edit_bias(s, index, hidden, args[1]), *args[2:])
                else:
                    kwargs = dict(kwargs)
                    kwargs["attention_mask"] = _edit_bias(s, index, hidden, kwargs.get("attention_mask"))
                return args, kwargs
            s.hook(attn, edit, pre=True, with_kwargs=True)
        current: dict[str, AttentionCapture] = {}

        def new_capture(current=current, layer_name=layer_name, index=index) -> AttentionCapture:
            cap = current["cap"] = s.open_capture(stream, f"{layer_name}.attention", modality, modality,
                                                  layer=index)
            return cap

        def on_q(mod, inp, out, current=current, H=H):
            current["cap"].query = s.keep(_split_heads(out, H))

        def on_k(mod, inp, out, current=current, H=H):
            current["cap"].key = s.keep(_split_heads(out, H))

        def on_v(mod, inp, out, current=current, H=H):
            current["cap"].value = s.keep(_split_heads(out, H))

        def on_attn(mod, inp, out, current=current, new_capture=new_capture):
            weights = out[1] if isinstance(out, tuple) and len(out) > 1 else None
            if weights is None:
                raise RuntimeError(f"{type(mod).__name__} returned no attention weights in eager mode")
            # eager_attention_forward returns the (post-dropout) matrix it multiplied with V;
            # in eval mode that is the post-softmax attention itself.
            s.capture_attention(current["cap"] if qkv_fields else new_capture(), weights, weights)

        if qkv_fields:  # the capture opens when the attention module is entered
            def open_capture(mod, args, new_capture=new_capture):
                new_capture()  # and return None: a pre-hook's return value would replace the input

            s.hook(attn, open_capture, pre=True)
            for name, fn in (("query", on_q), ("key", on_k), ("value", on_v)):
                if name in want:
                    s.hook(getattr(attn, name[0] + "_proj"), fn)
        if "attention" in want:
            s.hook(attn, on_attn)
        if "hidden" in want:
            s.hook(layer, lambda mod, inp, out: s.rec._hidden_states.append(
                s.keep(out[0] if isinstance(out, tuple) else out)))
        if mlp:
            act = _mlp_activation_module(layer)
            if act is None:
                raise TypeError(f"layer {layer_name} has no MLP activation module to record")
            s.hook(act, lambda mod, inp, out: s.rec.mlp_activations.append(s.keep(out)))


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
# what these adapters record; hidden states come from the model itself (output_hidden_states=True)
_MULTI_FIELDS = frozenset({"attention", "query", "key", "value"})


def _lxmert_encoder(model: nn.Module) -> tuple[str, nn.Module] | None:
    """(name, module) of LXMERT's encoder: the module holding ``layer``, ``r_layers`` and ``x_layers``."""
    for name, m in model.named_modules():
        if all(isinstance(getattr(m, a, None), nn.ModuleList) for a in ("layer", "r_layers", "x_layers")):
            return name, m
    return None


def _detr_core(model: nn.Module) -> tuple[str, nn.Module] | None:
    """(name, module) of DETR's transformer: the module holding ``encoder``, ``decoder`` and
    ``input_projection`` (``DetrModel``; ``DetrForObjectDetection.model``)."""
    for name, m in model.named_modules():
        if all(isinstance(getattr(m, a, None), nn.Module) for a in ("encoder", "decoder", "input_projection")):
            return name, m
    return None


def _prefixed(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _attach_qkv(s: _Session, attn: nn.Module, current: dict, projections: tuple[str, str, str], heads: int) -> None:
    """Hooks storing the asked ones of Q, K, V (``B x heads x N x head_dim``) of each call of
    ``attn`` in ``current["cap"]``, from its three projections (named in ``projections``)."""
    for field_name, proj in zip(("query", "key", "value"), projections):
        if field_name in s.capture:
            def on_proj(mod, inp, out, field_name=field_name):
                setattr(current["cap"], field_name, s.keep(_split_heads(out, heads)))
            s.hook(getattr(attn, proj), on_proj)


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

        def on_probs(mod, inp, out):
            # the dropout's output is what multiplies V (the probabilities themselves in eval mode)
            s.capture_attention(current["cap"], out, out)

        if s.capture:
            s.hook(attn, open_capture, pre=True)
        _attach_qkv(s, attn, current, ("query", "key", "value"), int(attn.num_attention_heads))
        if "attention" in s.capture:
            s.hook(attn.dropout, on_probs)

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


def _backbone_vit(where: nn.Module, prefix: str):
    """``(vit, attach, found)`` for the first supported ViT inside ``where`` (whose path in
    the model is ``prefix``), block names given from the model's root; or None."""
    for name, m in where.named_modules():
        for is_family, modules, attach in ((is_timm_vit, _timm_attention_modules, _attach_timm),
                                           (is_hf_model, _hf_attention_modules, _attach_hf)):
            found = modules(m) if is_family(m) else []
            if found:
                root = _prefixed(prefix, name)
                return m, attach, [(_prefixed(root, n), block, attn) for n, block, attn in found]
    return None


def _attach_backbone(s: _Session, where: nn.Module, prefix: str) -> None:
    """Record the self-attention of a supported ViT inside ``where`` (a backbone feeding the
    model its image tokens) as the ``backbone`` stream, modality ``backbone``; ``rec.layout``
    becomes that ViT's token layout. Nothing when there is none."""
    vit = _backbone_vit(where, prefix)
    if vit is None:
        return
    vit_module, attach_vit, found_vit = vit
    attach_vit(vit_module, s, False, found_vit, stream="backbone", modality="backbone")
    s.rec.modalities = (*s.rec.modalities, "backbone")

    def on_vit_input(mod, args, kwargs):
        x = args[0] if args else next(iter(kwargs.values()), None)
        s.rec.layout = token_layout(vit_module, x if isinstance(x, torch.Tensor) and x.ndim == 4 else None)

    s.hook(vit_module, on_vit_input, pre=True, with_kwargs=True)
    s.rec.layout = token_layout(vit_module)


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


_MULTI = {}  # filled below: attach function -> (family, streams)


def _adapter_for(model: nn.Module):
    """``(attach, found)``: the family's adapter and what it attaches to (for a ViT, its
    ``(name, block, attention)`` list)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"vitlab.record expects a torch.nn.Module, got {type(model).__name__}")
    if is_timm_vit(model):
        found = _timm_attention_modules(model)
        if found:
            return _attach_timm, found
    if is_hf_model(model):
        model_type = getattr(model.config, "model_type", None)
        finders = {"lxmert": (_lxmert_encoder, _attach_lxmert), "detr": (_detr_core, _attach_detr)}
        if model_type in finders:
            find, attach = finders[model_type]
            found = find(model)
            if found is not None:
                return attach, found
        found = _hf_attention_modules(model)
        if found:
            return _attach_hf, found
    raise TypeError(
        f"{type(model).__name__} has no attention blocks vitlab can record. Supported: {SUPPORTED}."
    )


def _vit_only(model: nn.Module, what: str):
    attach, found = _adapter_for(model)
    if attach in _MULTI:
        raise TypeError(f"{what} is defined for ViTs (one stack of blocks), not for {type(model).__name__}")
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


def blocks(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks of a supported ViT, in the order they run (one per recorded layer)."""
    return [block for _, block, _ in _vit_only(model, "vitlab.record.blocks")[1]]


def attention_size(model: nn.Module, num_tokens: int) -> int:
    """Entries of one sample's attention that a forward inside :func:`record` keeps: the sum
    over blocks of ``heads x N x N``, for ``N = num_tokens``. Methods size their chunks by it."""
    attach, found = _vit_only(model, "vitlab.record.attention_size")
    if attach is _attach_timm:
        heads = sum(int(attn.num_heads) for _, _, attn in found)
    else:
        heads = sum(_hf_heads(attn) for _, _, attn in found)
    return heads * int(num_tokens) ** 2


_MULTI.update({_attach_lxmert: ("lxmert", LXMERT_STREAMS), _attach_detr: ("detr", DETR_STREAMS)})


@contextlib.contextmanager
def record(
    model: nn.Module, gradients: bool = False, mlp: bool = False, detach: bool | None = None,
    eval_mode: bool = False, residual: bool = False, attention_edit: Callable | None = None,
    capture=None,
) -> Iterator[Recording]:
    """Record every attention block of ``model`` during the forward passes in the block.

    Args:
        model: a supported ViT, or a Hugging Face LXMERT or DETR model (see ``SUPPORTED``);
            left exactly as it was on exit.
        capture: which per-block fields to keep, names from :data:`CAPTURE_FIELDS`:
            ``"attention"`` (``rec.attentions``), ``"query"``, ``"key"``, ``"value"``
            (``rec.queries`` / ``keys`` / ``values``, B x heads x N x head_dim) and
            ``"hidden"`` (``rec.hidden_states``); None (default) keeps all five. Ask for what
            you read: each field left out is a hook fewer per block and memory not held, and
            without ``"attention"`` (and without ``attention_edit``) the model keeps its
            fused attention path. Reading a field left out raises :class:`NotRecordedError`.
            ``residual=True`` adds ``"hidden"``. LXMERT and DETR: attention, query, key and
            value (the default), no hidden states (the model's ``output_hidden_states=True``
            gives them).
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
        (``mlp``, ``residual`` and ``attention_edit`` are for ViTs: LXMERT and DETR refuse them.)

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
            captured = _MULTI_FIELDS
        elif "hidden" in captured:
            raise ValueError(
                f"record(capture=...) of {name} records attention, query, key and value; its hidden states "
                "come from the model itself: call it with output_hidden_states=True"
            )
        unsupported = [arg for arg, on in (("mlp", mlp), ("residual", residual), ("attention_edit", attention_edit))
                       if on]
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
        if eval_mode:
            for module in model.modules():
                session.set_attr(module, "training", False)
        if rec.layout is None and family is None:
            rec.layout = token_layout(model)
        yield rec
    finally:
        session.close()
