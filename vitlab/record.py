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
``"self"``; chapter 5's LXMERT and DETR adapters add streams for language, vision and
cross-attention through the same :class:`Recording`.
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
    "and vitlab's embedded models) and Hugging Face ViT, DeiT and Dinov2 models"
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
    default_stream: str = "self"
    # why attention gradients cannot arrive, when a forward already showed it (see attention_grads)
    _no_grad_reason: str | None = field(default=None, repr=False)

    def stream(self, name: str | None = None) -> list[AttentionCapture]:
        name = self.default_stream if name is None else name
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

    def _field(self, attr: str) -> list[torch.Tensor]:
        if attr != "grad":
            self._require(attr)
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
        self._require("attention")
        grads = self._field("grad")
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
        for stream in self.streams.values():
            stream.clear()

    @property
    def num_layers(self) -> int:
        """Attention calls recorded in the default stream (blocks, for one ViT forward); with
        no attention field captured, the hidden states recorded."""
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
        if self.gradients and used.requires_grad:
            def on_grad(g, cap=cap):
                cap.grad = g.detach()
            used.register_hook(on_grad)
        elif self.gradients and self.rec._no_grad_reason is None:
            self.rec._no_grad_reason = (
                "nothing in the forward required a gradient (every parameter is frozen and the input does "
                "not require grad): call x.requires_grad_(True) on the input before the forward"
            )

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


def _attach_timm(model: nn.Module, s: _Session, mlp: bool, blocks) -> None:
    want = s.capture
    # the eager path only where the attention matrix is read or edited; Q, K, V and hidden
    # states are the same on the fused path, which materialises no N x N matrix
    eager = "attention" in want or s.attention_edit is not None
    qkv_fields = want & {"query", "key", "value"}
    stream = s.rec.streams.setdefault("self", [])
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

        def new_capture(current=current, block_name=block_name) -> AttentionCapture:
            cap = AttentionCapture(name=f"{block_name}.attn")
            current["cap"] = cap
            stream.append(cap)
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


def _attach_hf(model: nn.Module, s: _Session, mlp: bool, layers) -> None:
    want = s.capture
    if "attention" in want or s.attention_edit is not None:  # SDPA returns no attention weights
        for config in _hf_configs(model):
            # set the internal attribute directly: no recursion, exact restore
            s.set_attr(config, "_attn_implementation_internal", "eager")
    qkv_fields = want & {"query", "key", "value"}
    stream = s.rec.streams.setdefault("self", [])
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

        def new_capture(current=current, layer_name=layer_name) -> AttentionCapture:
            cap = AttentionCapture(name=f"{layer_name}.attention")
            current["cap"] = cap
            stream.append(cap)
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


def _adapter_for(model: nn.Module):
    """``(attach, modules)``: the family's adapter and its ``(name, block, attention)`` list."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"vitlab.record expects a torch.nn.Module, got {type(model).__name__}")
    if is_timm_vit(model):
        found = _timm_attention_modules(model)
        if found:
            return _attach_timm, found
    if is_hf_model(model):
        found = _hf_attention_modules(model)
        if found:
            return _attach_hf, found
    raise TypeError(
        f"{type(model).__name__} has no attention blocks vitlab can record. Supported: {SUPPORTED}."
    )


def blocks(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks of a supported ViT, in the order they run (one per recorded layer)."""
    return [block for _, block, _ in _adapter_for(model)[1]]


def attention_size(model: nn.Module, num_tokens: int) -> int:
    """Entries of one sample's attention that a forward inside :func:`record` keeps: the sum
    over blocks of ``heads x N x N``, for ``N = num_tokens``. Methods size their chunks by it."""
    attach, found = _adapter_for(model)
    if attach is _attach_timm:
        heads = sum(int(attn.num_heads) for _, _, attn in found)
    else:
        heads = sum(_hf_heads(attn) for _, _, attn in found)
    return heads * int(num_tokens) ** 2


@contextlib.contextmanager
def record(
    model: nn.Module, gradients: bool = False, mlp: bool = False, detach: bool | None = None,
    eval_mode: bool = False, residual: bool = False, attention_edit: Callable | None = None,
    capture=None,
) -> Iterator[Recording]:
    """Record every attention block of ``model`` during the forward passes in the block.

    Args:
        model: a supported ViT (see ``SUPPORTED``); left exactly as it was on exit.
        capture: which per-block fields to keep, names from :data:`CAPTURE_FIELDS`:
            ``"attention"`` (``rec.attentions``), ``"query"``, ``"key"``, ``"value"``
            (``rec.queries`` / ``keys`` / ``values``, B x heads x N x head_dim) and
            ``"hidden"`` (``rec.hidden_states``); None (default) keeps all five. Ask for what
            you read: each field left out is a hook fewer per block and memory not held, and
            without ``"attention"`` (and without ``attention_edit``) the model keeps its
            fused attention path. Reading a field left out raises :class:`NotRecordedError`.
            ``residual=True`` adds ``"hidden"``.
        gradients: also record ``d(output)/d(attention)`` per layer (needs ``"attention"``
            in ``capture``); call ``backward()`` inside the with-block.
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

    Recordings of one model may overlap (nested, or closed in any order): each removes its
    own hooks, and a flag gets its original value back when the last of them closes.
    A recording captures the forward passes of the thread that opened it, and only those:
    threads may record (and run vitlab's methods on) one model at the same time, each
    getting its own forwards. While any recording is open the model runs its eager
    attention path (the same numbers), and with ``eval_mode`` in eval mode, in every thread.

    Raises:
        ValueError: ``capture`` names an unknown field, or ``gradients=True`` without
            ``"attention"`` in it.
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
    rec = Recording(layout=None, captured=captured)
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
        x = args[0] if args else next(iter(kwargs.values()), None)
        if isinstance(x, torch.Tensor) and x.ndim == 4:
            rec.layout = token_layout(model, x)

    try:
        session.hook(model, on_input, pre=True, with_kwargs=True)
        attach(model, session, mlp, found)
        if eval_mode:
            for module in model.modules():
                session.set_attr(module, "training", False)
        if rec.layout is None:
            rec.layout = token_layout(model)
        yield rec
    finally:
        session.close()
