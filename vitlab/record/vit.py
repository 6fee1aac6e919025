"""Adapters for ViTs: timm ``VisionTransformer`` models and Hugging Face ViT, DeiT and Dinov2
(and a ViT backbone inside a bimodal or detection model)."""
from __future__ import annotations

import math
import threading

import torch
import torch.nn.functional as F
from torch import nn

from vitlab.layout import is_hf_model, is_timm_vit, token_layout
from vitlab.record._session import AttentionCapture, _Session, _split_heads


# Blocks whose second norm does not read the residual stream after the attention sublayer
# (post-norm, parallel attention + MLP): their residual states are not recorded.
_NOT_PRE_NORM = ("ResPostBlock", "ParallelScalingBlock", "ParallelThingsBlock")


def _attach_residual(s: _Session, block: nn.Module, block_name: str) -> None:
    """Hooks for ``residual=True``: the block's input and the input of its second norm (the
    residual stream after the attention sublayer, in a pre-norm block)."""
    norm2 = next((getattr(block, n) for n in ("norm2", "layernorm_after", "layer_norm2")
                  if isinstance(getattr(block, n, None), nn.Module)), None)
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


def _timm_attention_modules(model: nn.Module) -> list[tuple[str, nn.Module, nn.Module]]:
    """(block name, block, attention module) for every timm Attention-like block, in the order
    the model runs them (CaiT: its self-attention blocks, then its class-attention blocks)."""
    found = []
    for name, block in model.named_modules():
        attn = getattr(block, "attn", None)
        if (
            isinstance(attn, nn.Module)
            and isinstance(getattr(attn, "attn_drop", None), nn.Module)
            and hasattr(attn, "num_heads")
            and (hasattr(attn, "fused_attn") or isinstance(getattr(attn, "qkv", None), nn.Linear))
        ):
            found.append((name, block, attn))
    return found


def _hookable(attn: nn.Module) -> bool:
    """Whether hooks on ``attn``'s submodules see its Q, K and V as the attention uses them:
    timm's ``Attention`` (one ``qkv`` Linear called as a module, then ``q_norm`` / ``k_norm``)
    and CaiT's talking-heads attention (``qkv`` alone, no fused path). Others -- EVA-02 (RoPE
    rotates q and k inside the forward; a qkv bias goes through ``F.linear`` past the module),
    BEiT (``F.linear`` with its q / v bias), CaiT's class attention (separate q, k, v) -- are
    recorded at their ``F.scaled_dot_product_attention`` call (:func:`_attach_sdpa`)."""
    if not hasattr(attn, "fused_attn"):
        return True
    return (type(attn).__name__ == "Attention" and isinstance(getattr(attn, "qkv", None), nn.Linear)
            and hasattr(attn, "q_norm") and hasattr(attn, "k_norm") and getattr(attn, "q_bias", None) is None)


# --- recording at F.scaled_dot_product_attention ---------------------------------------------
# While a recording routes an attention module here, torch.nn.functional.scaled_dot_product_attention
# is replaced by _routed_sdpa (a flag of _Session.set_attr: reference-counted, restored when the last
# recording closes). It hands the call to the handler the module's pre-hook pushed for this thread,
# and passes every other call (other modules, other threads) to the original unchanged.
_SDPA_ORIGINAL = F.scaled_dot_product_attention
_SDPA_LOCAL = threading.local()


def _routed_sdpa(query, key, value, *args, **kwargs):
    handlers = getattr(_SDPA_LOCAL, "handlers", None)
    if handlers:
        return handlers[-1](query, key, value, *args, **kwargs)
    return _SDPA_ORIGINAL(query, key, value, *args, **kwargs)


def _eager_sdpa(s: _Session, cap: AttentionCapture, index: int, q, k, v, attn_mask=None, dropout_p=0.0,
                is_causal=False, scale=None, enable_gqa=False):
    """What ``F.scaled_dot_product_attention`` computes, with its softmax matrix materialised and
    captured: ``softmax(q k^T * scale + mask) @ v``."""
    if enable_gqa or k.shape[-3] != q.shape[-3]:
        raise TypeError(
            "this attention is grouped-query attention (fewer key / value heads than query heads); "
            "recording its attention matrix is not supported"
        )
    N, M = q.shape[-2], k.shape[-2]
    logits = (q * (q.shape[-1] ** -0.5 if scale is None else scale)) @ k.transpose(-2, -1)
    if is_causal:
        causal = torch.ones(N, M, dtype=torch.bool, device=q.device).tril()
        logits = logits.masked_fill(~causal, float("-inf"))
    if attn_mask is not None:
        logits = (logits.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool
                  else logits + attn_mask)
    if s.attention_edit is not None and N == M:
        bias = _edit_bias(s, index, q[:, 0], None)
        if bias is not None:
            logits = logits + bias
    attn = logits.softmax(dim=-1)
    if dropout_p > 0:
        attn = F.dropout(attn, dropout_p)
    s.capture_attention(cap, attn, attn)
    return attn @ v


def _attach_sdpa(s: _Session, attn: nn.Module, index: int, new_capture, fused_flag: bool = True) -> None:
    """Record ``attn`` at its ``F.scaled_dot_product_attention`` call (its fused path, switched on
    while the recording is open): Q, K, V exactly as the attention uses them (after q / k norms
    and RoPE, before the scale), and -- when the attention is asked for or edited -- the call
    computed eagerly with the softmax matrix captured."""
    want = s.capture
    eager = "attention" in want or s.attention_edit is not None
    if fused_flag:
        s.set_attr(attn, "fused_attn", True)
    s.set_attr(F, "scaled_dot_product_attention", _routed_sdpa)

    calls = [0]

    def handler(q, k, v, *args, **kwargs):
        calls[0] += 1
        cap = new_capture()
        for name, t in (("query", q), ("key", k), ("value", v)):
            if name in want:
                setattr(cap, name, s.keep(t))
        if eager or s.rec._lrp_state is not None:  # LRP: its rules act on the eager matmuls and softmax
            return _eager_sdpa(s, cap, index, q, k, v, *args, **kwargs)
        return _SDPA_ORIGINAL(q, k, v, *args, **kwargs)

    def push(mod, args, kwargs):
        if not hasattr(_SDPA_LOCAL, "handlers"):
            _SDPA_LOCAL.handlers = []
        _SDPA_LOCAL.handlers.append(handler)
        calls[0] = 0

    def pop(mod, args, kwargs, out):
        if _SDPA_LOCAL.handlers and _SDPA_LOCAL.handlers[-1] is handler:
            _SDPA_LOCAL.handlers.pop()
        if calls[0] == 0:  # never silently without a capture
            raise RuntimeError(
                f"vitlab.record: {type(attn).__name__} computed its attention without calling "
                "torch.nn.functional.scaled_dot_product_attention, where vitlab records attention modules of "
                "its kind, so its attention, queries and keys cannot be recorded; this attention module is "
                "not supported"
            )

    s.hook(attn, push, pre=True, with_kwargs=True)
    s.hook(attn, pop, with_kwargs=True)
    thread = s.thread

    def forget():  # a forward that raised inside the module left its handler on the stack
        if threading.get_ident() == thread and getattr(_SDPA_LOCAL, "handlers", None):
            _SDPA_LOCAL.handlers[:] = [h for h in _SDPA_LOCAL.handlers if h is not handler]
    s._undo.append(forget)


def _mlp_activation_module(block: nn.Module) -> nn.Module | None:
    mlp = getattr(block, "mlp", None)
    if mlp is None:
        return None
    for attr in ("act", "activation", "activation_fn", "intermediate_act_fn"):
        m = getattr(mlp, attr, None)
        if isinstance(m, nn.Module):
            return m
    return None


#: the stream of an attention-pool head's probe (timm global_pool='map', SigLIP's pooling head): one
#: ``B x heads x 1 x N`` capture per forward, the probe's attention over the last block's tokens
POOL_STREAM = "pool"


def _attach_probe(s: _Session, pool: nn.Module, name: str, modality: str) -> None:
    """Record the attention of an attention-pool head (its probe's softmax over the tokens) as a
    capture of :data:`POOL_STREAM`, at its ``F.scaled_dot_product_attention`` call. timm's
    ``AttentionPoolLatent`` has a fused path; torch's ``nn.MultiheadAttention`` (SigLIP's head)
    calls SDPA when asked for no weights, which it is while the recording is open."""
    if "attention" not in s.capture:
        return
    s.rec.streams.setdefault(POOL_STREAM, [])
    if isinstance(pool, nn.MultiheadAttention):
        original = type(pool).forward

        def without_weights(*args, **kwargs):
            kwargs["need_weights"] = False
            return original(pool, *args, **kwargs)
        s.set_attr(pool, "forward", without_weights)

    def new_capture():
        return s.open_capture(POOL_STREAM, name, modality, modality, layer=0)
    _attach_sdpa(s, pool, -1, new_capture, fused_flag=hasattr(pool, "fused_attn"))


def _attach_timm(model: nn.Module, s: _Session, mlp: bool, blocks, stream: str = "self",
                 modality: str = "image") -> None:
    want = s.capture
    pool = getattr(model, "attn_pool", None)
    if isinstance(pool, nn.Module) and hasattr(pool, "fused_attn") and stream == "self":
        _attach_probe(s, pool, "attn_pool", modality)
    # the eager path only where the attention matrix is read or edited; Q, K, V and hidden
    # states are the same on the fused path, which materialises no N x N matrix
    eager = "attention" in want or s.attention_edit is not None
    qkv_fields = want & {"query", "key", "value"}
    s.rec.streams.setdefault(stream, [])
    for index, (block_name, block, attn) in enumerate(blocks):
        if s.residual:
            _attach_residual(s, block, block_name)
        if "hidden" in want:
            s.hook(block, lambda mod, inp, out: s.rec._hidden_states.append(s.keep(out)))
        if mlp:
            act = _mlp_activation_module(block)
            if act is None:
                raise TypeError(f"block {block_name} has no MLP activation module to record")
            s.hook(act, lambda mod, inp, out: s.rec.mlp_activations.append(s.keep(out)))
        if not _hookable(attn):
            if qkv_fields or eager:
                _attach_sdpa(s, attn, index, lambda block_name=block_name, index=index: s.open_capture(
                    stream, f"{block_name}.attn", modality, modality, layer=index))
            continue
        if eager and hasattr(attn, "fused_attn"):
            s.set_attr(attn, "fused_attn", False)
        if s.attention_edit is not None and not hasattr(attn, "fused_attn"):
            raise TypeError(
                f"attention_edit adds a mask to the attention logits, but {block_name} ({type(attn).__name__}, "
                "CaiT's talking-heads attention, which mixes the heads before and after the softmax) takes no mask"
            )
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
        q_plain = (isinstance(getattr(attn, "q_norm", nn.Identity()), nn.Identity)
                   and isinstance(getattr(attn, "k_norm", nn.Identity()), nn.Identity))

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


# Hugging Face vision towers whose layers call their attention ``self_attn`` (the ViT family's is
# ``attention``): SigLIP's (CLIP's towers have their own adapter, record/clip.py)
_SELF_ATTN_TYPES = ("siglip", "siglip_vision_model")


def _hf_attention_modules(model: nn.Module) -> list[tuple[str, nn.Module, nn.Module]]:
    """(layer name, layer, attention) for HF ViT-family layers (q_proj/k_proj/v_proj style)."""
    names = ("attention", "self_attn") if getattr(getattr(model, "config", None), "model_type", None) in _SELF_ATTN_TYPES \
        else ("attention",)
    found = []
    for name, layer in model.named_modules():
        for attr in names:
            attn = getattr(layer, attr, None)
            if isinstance(attn, nn.Module) and all(hasattr(attn, p) for p in ("q_proj", "k_proj", "v_proj")):
                found.append((name, layer, attn))
                break
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
    for head_name, head in model.named_modules():  # SigLIP's attention-pool head: a probe and an nn.MultiheadAttention
        if (isinstance(getattr(head, "attention", None), nn.MultiheadAttention)
                and isinstance(getattr(head, "probe", None), nn.Parameter) and stream == "self"):
            _attach_probe(s, head.attention, f"{head_name}.attention", modality)
            break
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


def _prefixed(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


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
