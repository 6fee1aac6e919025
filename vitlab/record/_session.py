"""The recording engine: what a :class:`Recording` holds, and the session that attaches hooks,
flips flags and puts every one of them back (shared by every family's adapter)."""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from vitlab.layout import TokenLayout




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
    # with lrp=...: the patch embedding's output of each forward (B x P x D, graph-attached)
    patch_tokens: list[torch.Tensor] = field(default_factory=list)
    # with lrp=...: the tokens entering the first block (B x N x D: patches + position, prefix)
    first_block_inputs: list[torch.Tensor] = field(default_factory=list)
    _lrp_state: object | None = field(default=None, repr=False)

    def plain_gradients(self):
        """Inside a ``record(model, lrp=...)`` block: a context in which every backward uses
        the model's own derivatives instead of the LRP rules (for methods that need both,
        e.g. Transformer attribution's ``grad A ⊙ R^A``)."""
        if self._lrp_state is None:
            raise RuntimeError("rec.plain_gradients() is for recordings opened with record(model, lrp=...)")
        return self._lrp_state.plain_gradients()

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
        self._single_stream()  # CLIP's two towers: rec.stream(name)[l].hidden
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
        self.patch_tokens.clear()
        self.first_block_inputs.clear()
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
                elif name in obj.__dict__:  # set on the instance over a class attribute: remove it again
                    del obj.__dict__[name]
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


def _split_heads(t: torch.Tensor, num_heads: int) -> torch.Tensor:
    B, N, D = t.shape
    return t.reshape(B, N, num_heads, D // num_heads).transpose(1, 2)
# what these adapters record; hidden states come from the model itself (output_hidden_states=True)
_MULTI_FIELDS = frozenset({"attention", "query", "key", "value"})


def _attach_bert_attention(s: _Session, attn: nn.Module, current: dict, open_capture) -> None:
    """The hooks of a BERT-style self- or cross-attention module (LXMERT's, VisualBERT's): ``open_capture``
    before each call (it puts the call's capture in ``current["cap"]``), Q, K, V from ``query``, ``key``,
    ``value``, and as the attention the output of its dropout: what multiplies V (the probabilities
    themselves in eval mode)."""
    def on_probs(mod, inp, out):
        s.capture_attention(current["cap"], out, out)

    if s.capture:
        s.hook(attn, open_capture, pre=True)
    _attach_qkv(s, attn, current, ("query", "key", "value"), int(attn.num_attention_heads))
    if "attention" in s.capture:
        s.hook(attn.dropout, on_probs)


def _attach_qkv(s: _Session, attn: nn.Module, current: dict, projections: tuple[str, str, str], heads: int) -> None:
    """Hooks storing the asked ones of Q, K, V (``B x heads x N x head_dim``) of each call of
    ``attn`` in ``current["cap"]``, from its three projections (named in ``projections``)."""
    for field_name, proj in zip(("query", "key", "value"), projections):
        if field_name in s.capture:
            def on_proj(mod, inp, out, field_name=field_name):
                setattr(current["cap"], field_name, s.keep(_split_heads(out, heads)))
            s.hook(getattr(attn, proj), on_proj)
