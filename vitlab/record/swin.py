"""Adapter for Swin transformers (Liu et al. 2021): timm ``SwinTransformer`` and Hugging Face
``SwinModel`` / ``SwinForImageClassification``.

A Swin block attends inside windows: its tokens (a stage's ``h x w`` grid) are cyclically
shifted by the block's shift (0 in every other block), cut into ``ws x ws`` windows, and each
window runs softmax attention over its own ``ws^2`` tokens, with a learned relative position
bias and, in shifted blocks, a mask of ``-100`` between tokens that the cyclic shift brought
together from opposite borders. The model computes one ``ws^2 x ws^2`` matrix per window
(``B * windows x heads x ws^2 x ws^2``).

What is recorded per block is that matrix scattered into the stage's full token-token
matrix, ``B x heads x N x N`` with ``N = h * w`` tokens in row-major order of the *unshifted*
grid: entry ``[b, head, i, j]`` is the softmax weight query token i gave key token j when the
two shared a window in that block (bias and shift mask included, exactly as the model
computed it), and 0 when they did not. Every row sums to 1. Its gradient (``gradients=True``)
is the gradient of the window matrices scattered the same way: a pair that shared no window
has no weight to differentiate and gets 0.

Each capture is a :class:`SwinCapture`: the :class:`~vitlab.record.AttentionCapture` fields
plus the block's geometry (``stage``, ``grid``, ``window``, ``shift``), the window matrices as
the model used them (``window_attention``, graph-attached while gradients are recorded) and
the flat index that scatters them (``index``). Consecutive stages are joined by patch merging;
:mod:`vitlab.hierarchical` carries maps across it (:func:`vitlab.hierarchical.merge_matrix`).

Refused (``ValueError`` in the forward, naming what to change): a grid that the windows do not
tile (the model pads it with tokens that are not part of the image).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from vitlab.record._session import AttentionCapture, _Session


@dataclass
class SwinCapture(AttentionCapture):
    """One Swin block's recorded attention (``attention``: ``B x heads x N x N`` on the stage's
    unshifted ``grid``, row-major) with its geometry."""

    stage: int = 0                               # index of the stage (grid) the block works on
    grid: tuple[int, int] = (0, 0)               # (h, w) tokens of that stage
    window: tuple[int, int] = (0, 0)             # window size the block used (after any clamp)
    shift: tuple[int, int] = (0, 0)              # its cyclic shift (0, 0: none)
    window_attention: torch.Tensor | None = None  # B*windows x heads x T x T, what multiplied V
    index: torch.Tensor | None = None            # windows*T*T flat indices into N*N (see scatter_windows)
    hidden: torch.Tensor | None = None           # the block's output as the model passes it on (capture
                                                 # "hidden"): timm B x h x w x C, Hugging Face B x N x C


def window_token_index(grid: tuple[int, int], window: tuple[int, int], shift: tuple[int, int],
                       device=None) -> torch.Tensor:
    """``windows x T`` (``T = ws_h * ws_w``): the unshifted row-major token index of position
    ``t`` of window ``w``, for a grid cyclically shifted by ``-shift`` then cut into windows
    in row-major order (timm's and Hugging Face's ``window_partition``)."""
    h, w = grid
    wh, ww = window
    r = torch.arange(h, device=device)
    c = torch.arange(w, device=device)
    # position (r, c) of the shifted grid holds the token at ((r + sh) % h, (c + sw) % w)
    tok = ((r[:, None] + shift[0]) % h) * w + (c[None, :] + shift[1]) % w      # h x w
    return tok.reshape(h // wh, wh, w // ww, ww).permute(0, 2, 1, 3).reshape(-1, wh * ww)


def pair_index(grid, window, shift, device=None) -> torch.Tensor:
    """Flat indices into ``N x N`` (``N = h * w``) of every (query, key) pair of every window,
    ``windows * T * T`` long, in the order of ``B x heads x windows x T x T`` flattened."""
    tok = window_token_index(grid, window, shift, device)   # nW x T
    N = grid[0] * grid[1]
    return (tok[:, :, None] * N + tok[:, None, :]).reshape(-1)


def scatter_windows(windows: torch.Tensor, index: torch.Tensor, batch: int, num_tokens: int) -> torch.Tensor:
    """``B*nW x heads x T x T`` window matrices -> ``B x heads x N x N`` (0 off the windows),
    differentiable in ``windows``."""
    BW, H, T, _ = windows.shape
    src = windows.reshape(batch, BW // batch, H, T * T).transpose(1, 2).reshape(batch, H, -1)
    out = windows.new_zeros(batch, H, num_tokens * num_tokens)
    out = out.scatter(2, index.expand(batch, H, -1), src)
    return out.reshape(batch, H, num_tokens, num_tokens)


# --- finding the blocks ---------------------------------------------------------------------------
def _is_timm_swin(model: nn.Module) -> bool:
    try:
        from timm.models.swin_transformer import SwinTransformer
    except ImportError:  # pragma: no cover
        return False
    return isinstance(model, SwinTransformer)


def swin_blocks(model: nn.Module):
    """``[(stage, name, block, attention)]`` of a timm or Hugging Face Swin model, in the order
    the blocks run; None when ``model`` is not a Swin transformer (the record dispatch)."""
    if _is_timm_swin(model):
        return [(s, f"layers.{s}.blocks.{i}", b, b.attn) for s, stage in enumerate(model.layers)
                for i, b in enumerate(stage.blocks)]
    config = getattr(model, "config", None)
    if getattr(config, "model_type", None) == "swin":
        encoder = next((m for m in model.modules() if type(m).__name__ == "SwinEncoder"), None)
        if encoder is None:
            return None
        prefix = next(n for n, m in model.named_modules() if m is encoder)
        return [(s, f"{prefix}.layers.{s}.blocks.{i}", b, b.attention) for s, stage in enumerate(encoder.layers)
                for i, b in enumerate(stage.blocks)]
    return None


def _refuse_padding(name: str, grid, window) -> None:
    if grid[0] % window[0] or grid[1] % window[1]:
        raise ValueError(
            f"Swin block {name} works on a {grid[0]} x {grid[1]} token grid that its {window[0]} x {window[1]} "
            "windows do not tile, so the model pads it with tokens that are not part of the image and their "
            "attention has no place in the image's token matrix; vitlab records Swin models whose every stage "
            "grid is a multiple of its window: choose an image size accordingly (e.g. the model's own img_size)"
        )


# --- the adapter ------------------------------------------------------------------------------------
def attach_swin(model: nn.Module, s: _Session, mlp: bool, found) -> None:
    """Record every block of a Swin model (see the module docstring); ``found`` is
    :func:`swin_blocks`'s list. The recording's stream ``"self"`` holds one :class:`SwinCapture`
    per block run."""
    rec = s.rec
    rec.family, rec.default_stream = "swin", "self"
    rec.streams.setdefault("self", [])
    want = s.capture
    hf = not _is_timm_swin(model)
    if hf and ("attention" in want):
        from vitlab.record.vit import _hf_configs

        for config in _hf_configs(model):  # SDPA returns no attention weights
            s.set_attr(config, "_attn_implementation_internal", "eager")
    for layer, (stage, name, block, attn) in enumerate(found):
        current: dict = {}
        if not hf and "attention" in want:
            s.set_attr(attn, "fused_attn", False)

        def open_capture(mod, args, kwargs, name=name, layer=layer, stage=stage, current=current, block=block):
            x = args[0] if args else next(iter(kwargs.values()))
            if hf:
                dims = args[1] if len(args) > 1 else kwargs["input_dimensions"]
                grid = (int(dims[0]), int(dims[1]))
            else:
                grid = (int(x.shape[1]), int(x.shape[2]))
            cap = SwinCapture(name=f"{name}.attn" if not hf else f"{name}.attention", layer=layer, stage=stage,
                              grid=grid)
            rec.streams["self"].append(cap)
            rec.events.append(cap)
            current["cap"] = cap

        s.hook(block, open_capture, pre=True, with_kwargs=True)

        def geometry(cap: SwinCapture, block=block) -> None:
            _geometry(cap, block, hf)

        def keep_windows(cap: SwinCapture, used: torch.Tensor, geometry=geometry) -> None:
            geometry(cap)
            _keep_windows(s, cap, used)

        if "attention" in want:
            if hf:
                def on_attn(mod, inp, out, current=current, keep_windows=keep_windows):
                    weights = out[1] if isinstance(out, tuple) and len(out) > 1 else None
                    if weights is None:
                        raise RuntimeError(f"{type(mod).__name__} returned no attention weights in eager mode")
                    keep_windows(current["cap"], weights)
                s.hook(attn, on_attn)
            else:
                # after dropout (the identity in eval mode): the matrix that multiplies V
                s.hook(attn.attn_drop, lambda mod, inp, out, current=current, keep_windows=keep_windows:
                       keep_windows(current["cap"], out))
        if want & {"query", "key", "value"}:
            def qkv_fields(cap: SwinCapture, q, k, v, geometry=geometry) -> None:
                geometry(cap)
                for field_name, t in (("query", q), ("key", k), ("value", v)):
                    if field_name in want:
                        setattr(cap, field_name, s.keep(_unwindow(t, cap)))
            if hf:
                H = int(attn.num_attention_heads)
                parts: dict = {}

                def on_proj(mod, inp, out, field_name, current=current, parts=parts, H=H, qkv_fields=qkv_fields):
                    parts[field_name] = out.reshape(*out.shape[:2], H, -1).transpose(1, 2)
                    if len(parts) == 3:
                        qkv_fields(current["cap"], parts.pop("q"), parts.pop("k"), parts.pop("v"))
                for field_name in "qkv":
                    s.hook(getattr(attn, f"{field_name}_proj"),
                           lambda mod, inp, out, field_name=field_name, on_proj=on_proj: on_proj(mod, inp, out, field_name))
            else:
                def on_qkv(mod, inp, out, current=current, H=int(attn.num_heads), qkv_fields=qkv_fields):
                    BW, T, C3 = out.shape
                    q, k, v = out.reshape(BW, T, 3, H, -1).permute(2, 0, 3, 1, 4).unbind(0)
                    qkv_fields(current["cap"], q, k, v)
                s.hook(attn.qkv, on_qkv)
        if "hidden" in want:
            def on_out(mod, inp, out, current=current):
                # the tensor itself (not a reshaped view), so it can be differentiated
                current["cap"].hidden = s.keep(out[0] if isinstance(out, tuple) else out)
                rec._hidden_states.append(current["cap"].hidden)
            s.hook(block, on_out)


def _geometry(cap: SwinCapture, block: nn.Module, hf: bool) -> None:
    """The window and shift ``block`` uses in this forward (read inside it: Hugging Face clamps
    them to the grid in its forward), checked to tile the grid."""
    if hf:
        ws = int(block.window_size)
        window, shift = (ws, ws), (int(block.shift_size),) * 2
    else:
        window, shift = tuple(int(v) for v in block.window_size), tuple(int(v) for v in block.shift_size)
    _refuse_padding(cap.name, cap.grid, window)
    cap.window, cap.shift = window, shift


def _keep_windows(s: _Session, cap: SwinCapture, used: torch.Tensor) -> None:
    """Store the block's window matrices (``used``: what multiplied V) and their scatter into the
    stage's token matrix; with gradients, scatter the window gradient the same way when it arrives."""
    rec = s.rec
    B = used.shape[0] // ((cap.grid[0] // cap.window[0]) * (cap.grid[1] // cap.window[1]))
    N = cap.grid[0] * cap.grid[1]
    cap.index = pair_index(cap.grid, cap.window, cap.shift, device=used.device)
    cap.window_attention = s.keep(used)
    cap.attention = s.keep(scatter_windows(used, cap.index, B, N))
    if s.gradients and used.requires_grad:
        def on_grad(g, cap=cap, B=B, N=N):
            cap.grad = scatter_windows(g.detach(), cap.index, B, N)
        used.register_hook(on_grad)
    elif s.gradients and rec._no_grad_reason is None:
        rec._no_grad_reason = (
            f"nothing in the forward required a gradient up to the attention of {cap.name} (the parameters "
            "up to there are frozen and the input does not require grad): call x.requires_grad_(True) on "
            "the input before the forward")


def _unwindow(t: torch.Tensor, cap: SwinCapture) -> torch.Tensor:
    """``B*nW x heads x T x d`` per-window tensors -> ``B x heads x N x d`` in unshifted row-major
    token order."""
    tok = window_token_index(cap.grid, cap.window, cap.shift, device=t.device).reshape(-1)  # nW*T
    BW, H, T, d = t.shape
    nW = tok.numel() // T
    flat = t.reshape(BW // nW, nW, H, T, d).transpose(1, 2).reshape(BW // nW, H, nW * T, d)
    out = torch.empty_like(flat)
    out[:, :, tok] = flat
    return out
