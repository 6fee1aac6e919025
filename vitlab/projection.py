"""Reading a ViT in its class-embedding space (Vilas, Schaumlöffel & Roig, NeurIPS 2023,
"Analyzing Vision Transformers for Image Classification in Class Embedding Space").

Any hidden state ``h`` of a ViT classifier, of any token, can be read as class logits by
sending it through the model's own final norm and head: ``proj(h) = head(norm(h))``
(timm: ``model.norm``, then ``model.fc_norm`` where it is not the identity, then
``model.head``; Hugging Face ViT / DeiT: ``layernorm`` then ``classifier``). For the CLS
token after the last block this is exactly what the model outputs; earlier blocks and other
tokens show what each token "already thinks it is".

- :func:`project` -- one forward; the projection of the residual stream after every block
  (or the ``blocks`` / ``tokens`` asked for) and of what each attention and MLP sublayer adds
  to it (a :class:`Projection`; one class's logit alone with :meth:`Projection.class_logit`).
- :func:`identifiability`, :func:`identifiable_share`, :func:`class_identifiability` --
  r = 1 - rank(c) / C (rank 0 = top), per token and block; the share of tokens whose top-1 is c.
- :func:`sublayer_contributions` -- how much each attention and MLP sublayer raises or
  lowers the target's projected logit, per token.
- :func:`value_projection`, :func:`unit_top_classes`, :func:`memory_agreement` -- the MLP as
  key-value memories (paper Sec. 5): each hidden unit's value vector in class space;
  :func:`attention_value_projection`, :func:`attention_coefficients` and
  ``memory_agreement(..., sublayer="attention")`` -- the same for self-attention (the paper's
  Fig. 1b): keys matched with the attended tokens' states, weighted by attention.
- :func:`agreement_by_group` -- :func:`memory_agreement` of every block averaged over groups of
  tokens (class token, object, background), with chance per sample; read with ``.table()``.
- :func:`projection_map` -- the paper's explanation map, ``B x gh x gw``.
- :func:`context_intervention` -- the paper's RQ5: image tokens attend only to themselves, or
  not to CLS, from a chosen block on (an attention edit through :func:`vitlab.record`).
- :func:`linear_probes`, :func:`probe_logits`, :func:`token_removal` -- the paper's RQ4:
  per-block linear probes to compare with the projection, and accuracy with the tokens a
  ranking puts highest (or lowest) removed from attention; :func:`ridge_probes` -- the
  paper's own probe design (a ridge regression per block and token position).
- :func:`remove_tokens` -- the same removal for an explicit set of tokens per sample (e.g. an
  object's tokens, grown by one patch to close what leaks through a wide patch embedding).
- :func:`output_similarity` -- a class-free counterpart for models without a class head: each
  token's cosine similarity, block by block, with the final class-token state.
- :func:`removal_curve`, :func:`removal_test` (its table's intervals: :mod:`vitlab.stats`) -- the paper's
  token-removal test: accuracy as a ranking's top (positive) or bottom (negative) tokens are
  removed, its AUC against random removal, with bootstrap intervals over the images.

Models: timm and Hugging Face ViT / DeiT classifiers whose head reads the CLS token. Refused
with a ``ValueError`` that says why: models without a class head (timm ``num_classes=0``,
Hugging Face base models), heads that pool the patch tokens (timm ``global_pool="avg"``,
``"map"``, ...; Hugging Face Dinov2, whose classifier reads CLS and the patch mean) -- there
no single token's projection is the output -- and distilled DeiTs, whose output averages two
heads on two tokens, so no one token's projection reproduces it.

Nothing here hooks or edits a model: :func:`vitlab.record` does, and leaves it as it was.
"""
from __future__ import annotations

import copy
import numbers
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Callable, NamedTuple

import numpy as np
import torch
from torch import nn

from vitlab.compat import renamed_arguments, replaced_names
from vitlab.attention import run_images
from vitlab.inputs import check_images, gradient_leaf, positive_int, require_gradients
from vitlab.layout import TokenLayout, is_hf_model, is_timm_vit, token_layout
from vitlab.record import blocks as record_blocks, record
from vitlab.targets import check_target, logits_of, require_class_head, resolve_target

INTERVENTIONS = ("self_only", "no_cls")


# --------------------------------------------------------------------------------------
# The model's own norm + head
# --------------------------------------------------------------------------------------
def _head_parts(model: nn.Module, layout: TokenLayout, method: str) -> tuple[list[nn.Module], nn.Linear]:
    """(norms applied in order, the linear head) that turn a CLS state into the model's logits.
    Raises ``ValueError`` for models whose output is not one token's projection."""
    require_class_head(model, method)
    # timm's distilled DeiT; Hugging Face's DeiT...WithTeacher (its DeiTForImageClassification
    # holds a distillation token too, but its classifier reads CLS alone, so it is projected)
    distilled = hasattr(model, "distillation_classifier") if is_hf_model(model) else layout.has_distillation
    if distilled:
        raise ValueError(
            f"{method}: this model is a distilled DeiT, whose output averages two heads on two tokens "
            "(head on CLS, head_dist on the distillation token), so no single token's projection "
            "reproduces it; use a model with one class head (e.g. deit_tiny_patch16_224, not the distilled one)"
        )
    if not layout.has_class_token:
        raise ValueError(f"{method}: this model has no class token, so no token's projection is its output")
    if layout.pool == "class_attention":
        raise ValueError(
            f"{method}: this model is CaiT: its class token joins the patch tokens only in the class-attention "
            "blocks, so the states of the self-attention blocks have no class token to project"
        )
    if layout.pool == "token_avg":
        raise ValueError(
            f"{method}: {type(model).__name__}'s classifier reads the class token next to the mean of the patches "
            "(the two concatenated), so no single token's projection is its output; the projection needs a linear "
            "head on one token (a ViT or DeiT classifier reading its class token)"
        )
    if layout.pool != "token":
        raise ValueError(
            f"{method}: this model's head does not read the class token: it pools the patch tokens "
            f"(pool {layout.pool!r}{': their mean' if layout.pool == 'avg' else ''}), "
            "so projecting one token through norm + head would read features as classes the model never "
            "scores that way; use a model whose head reads the class token (timm global_pool='token')"
        )
    if is_timm_vit(model):
        norms = [m for m in (getattr(model, "norm", None), getattr(model, "fc_norm", None))
                 if isinstance(m, nn.Module) and not isinstance(m, nn.Identity)]
        head = getattr(model, "head", None)
    elif is_hf_model(model):
        head = getattr(model, "classifier", None)
        base = getattr(model, getattr(model, "base_model_prefix", ""), None)
        norm = getattr(base, "layernorm", None)
        if not isinstance(head, nn.Linear):
            raise ValueError(
                f"{method}: {type(model).__name__} has no class head (a base model, or num_labels=0): its "
                "hidden states have no class space to be projected into; use a ...ForImageClassification model"
            )
        hidden = getattr(getattr(model, "config", None), "hidden_size", None)
        if hidden is not None and head.in_features != hidden:
            raise ValueError(
                f"{method}: {type(model).__name__}'s classifier reads {head.in_features} features, not one "
                f"token's {hidden} (Dinov2 reads CLS and the mean of the patches), so no single token's "
                "projection is its output"
            )
        if not isinstance(norm, nn.Module):
            raise ValueError(f"{method}: {type(model).__name__} has no final layernorm vitlab can find")
        norms = [norm]
    else:
        raise TypeError(f"{method}: {type(model).__name__} is not a timm or Hugging Face ViT classifier")
    if not isinstance(head, nn.Linear):
        raise ValueError(f"{method}: {type(model).__name__}'s head is {type(head).__name__}, not a linear class head")
    return norms, head


class ClassHead(nn.Module):
    """A frozen copy of a model's final norm(s) and head: ``forward(h) = head(norm(h))`` on any
    ``... x D`` states (every token). A copy, so a :class:`Projection` computed later still
    uses the weights the forward ran with."""

    def __init__(self, norms: list[nn.Module], head: nn.Linear):
        super().__init__()
        self.norms = nn.ModuleList(copy.deepcopy(norms))
        self.head = copy.deepcopy(head)
        self.requires_grad_(False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        for norm in self.norms:
            h = norm(h)
        return self.head(h)

    def class_logit(self, h: torch.Tensor, classes: torch.Tensor) -> torch.Tensor:
        """``B x ... x D`` states -> ``B x ...``: the logit of class ``classes[b]`` for sample b,
        ``forward(h)[b, ..., classes[b]]``, from that class's row of the head alone (a dot
        product per state instead of a product with all C rows)."""
        for norm in self.norms:
            h = norm(h)
        w = self.head.weight[classes]  # B x D
        out = torch.bmm(h.reshape(h.shape[0], -1, h.shape[-1]), w.unsqueeze(-1)).squeeze(-1)  # B x M
        if self.head.bias is not None:
            out = out + self.head.bias[classes].unsqueeze(-1)
        return out.reshape(h.shape[:-1])


# --------------------------------------------------------------------------------------
# project
# --------------------------------------------------------------------------------------
FIELDS = ("residual", "mid", "attention", "mlp", "entering", "embedding")


def _indices(value, size: int, name: str, what: str) -> tuple[int, ...] | None:
    """``value`` (None, an int, or a sequence / 1-D integer tensor of ints; negative from the
    end) as a tuple of indices in ``0 .. size - 1``, in the order given; None stays None.
    Raises ``ValueError`` for empty, out-of-range, repeated or non-integer entries."""
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        if value.ndim > 1 or value.dtype == torch.bool or value.is_floating_point() or value.is_complex():
            raise ValueError(f"{name} must be None, an int or a 1-D sequence of ints, got a tensor of "
                             f"dtype {value.dtype}, shape {tuple(value.shape)}")
        value = value.tolist()
    if isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_)):
        items = [value]
    elif isinstance(value, (Sequence, range, np.ndarray)) and not isinstance(value, (str, bytes)):
        items = list(value)
    else:
        raise ValueError(f"{name} must be None (all {what}s), an int or a sequence of ints, got {value!r}")
    if not items:
        raise ValueError(f"{name} is empty: ask for at least one {what} (or None for all {size})")
    out: list[int] = []
    for item in items:
        if isinstance(item, (bool, np.bool_)) or not isinstance(item, numbers.Integral):
            raise ValueError(f"{name} must hold ints, got {item!r}")
        if not -size <= item < size:
            raise ValueError(f"{name}: {what} {item} does not exist; this model has {size} {what}s "
                             f"(0 .. {size - 1}, or negative from the end)")
        index = int(item) % size
        if index in out:
            raise ValueError(f"{name} asks for {what} {index} twice (given {items!r}); each {what} once")
        out.append(index)
    return tuple(out)


class Projection:
    """What :func:`project` returns: the recorded states of the asked blocks and tokens, and
    their class logits, each computed on first access of its field (then kept), so reading
    only ``residual`` costs one projection, not four.

    Fields are ``B x L' x N' x C``: dim 1 runs over :attr:`blocks` (the asked blocks, in the
    order asked; all ``L`` blocks by default), dim 2 over :attr:`tokens` (all ``N`` tokens by
    default). ``project(model, x, blocks=b, tokens=t).residual`` equals
    ``project(model, x).residual[:, b][:, :, t]`` for lists ``b``, ``t`` (to float rounding).

    Attributes:
        residual: projection of the residual stream after block l, ``proj(h_l)``.
        attention: projection of what block l's attention sublayer adds to the residual
            stream (after any layer scale), ``proj(a_l)``.
        mlp: projection of what block l's MLP sublayer adds, ``proj(m_l)``.
        mid: projection of the residual stream between the two sublayers, ``proj(h_{l-1} + a_l)``.
        entering: projection of the residual stream entering block l, ``proj(h_{l-1})`` (for
            block 0 the embedding; for block l > 0 it equals ``residual`` of block l - 1).
        embedding: ``B x N' x C`` projection of the tokens entering block 0, ``proj(h_0)``
            (whichever blocks were asked).
        logits: ``B x C`` the model's output (``residual[:, -1, 0]`` equals it when the last
            block and the CLS token are among those asked, last and first).
        blocks: the block indices of dim 1 (non-negative), ``num_blocks``: the model's L.
        tokens: the token indices of dim 2 (non-negative; ``0`` is CLS).
        layout: the :class:`~vitlab.layout.TokenLayout` of the whole token sequence.
        block_inputs, mid_states, block_outputs: the states ``B x L' x N' x D``; stacked on
            first access (``embedding_state``: ``B x N' x D``).
        head: the :class:`ClassHead` that projects a state.

    :meth:`class_logit` gives one class per sample of any field without projecting onto every
    class (what :func:`sublayer_contributions` reads): C times less work than the field.
    """

    def __init__(self, *, inputs: list[torch.Tensor], mids: list[torch.Tensor], outputs: list[torch.Tensor],
                 embedding_state: torch.Tensor, logits: torch.Tensor, layout: TokenLayout, head: ClassHead,
                 blocks: tuple[int, ...], tokens: tuple[int, ...], num_blocks: int):
        self._lists = {"block_inputs": inputs, "mid_states": mids, "block_outputs": outputs}
        self.embedding_state = embedding_state
        self.logits = logits
        self.layout = layout
        self.head = head
        self.blocks = blocks
        self.tokens = tokens
        self.num_blocks = num_blocks

    def __repr__(self) -> str:
        B, N = self.logits.shape[0], len(self.tokens)
        return (f"Projection(batch={B}, blocks={self.blocks}, tokens={N} of {self.layout.num_tokens}, "
                f"classes={self.logits.shape[-1]})")

    # the states, stacked on first access; the per-block list is dropped once stacked
    def _stacked(self, name: str) -> torch.Tensor:
        if name not in self.__dict__:
            self.__dict__[name] = torch.stack(self._lists.pop(name), dim=1)
        return self.__dict__[name]

    def _per_block(self, name: str) -> list[torch.Tensor]:
        """The ``B x N' x D`` states of each asked block (without stacking them)."""
        return self._lists[name] if name in self._lists else list(self.__dict__[name].unbind(1))

    @property
    def block_inputs(self) -> torch.Tensor:
        return self._stacked("block_inputs")

    @property
    def mid_states(self) -> torch.Tensor:
        return self._stacked("mid_states")

    @property
    def block_outputs(self) -> torch.Tensor:
        return self._stacked("block_outputs")

    def states(self, field: str) -> torch.Tensor:
        """The ``B x L' x N' x D`` states whose projection is ``field`` (``B x N' x D`` for
        ``"embedding"``)."""
        if field == "residual":
            return self.block_outputs
        if field == "mid":
            return self.mid_states
        if field == "entering":
            return self.block_inputs
        if field == "attention":
            return self.mid_states - self.block_inputs
        if field == "mlp":
            return self.block_outputs - self.mid_states
        if field == "embedding":
            return self.embedding_state
        raise ValueError(f"field must be one of {FIELDS}, got {field!r}")

    @torch.no_grad()
    def _apply(self, h: torch.Tensor) -> torch.Tensor:
        return self.head(h)

    @cached_property
    def residual(self) -> torch.Tensor:
        return self._apply(self.states("residual"))

    @cached_property
    def mid(self) -> torch.Tensor:
        return self._apply(self.states("mid"))

    @cached_property
    def attention(self) -> torch.Tensor:
        return self._apply(self.states("attention"))

    @cached_property
    def mlp(self) -> torch.Tensor:
        return self._apply(self.states("mlp"))

    @cached_property
    def entering(self) -> torch.Tensor:
        return self._apply(self.states("entering"))

    @cached_property
    def embedding(self) -> torch.Tensor:
        return self._apply(self.states("embedding"))

    @torch.no_grad()
    def class_logit(self, field: str, target) -> torch.Tensor:
        """The projected logit of one class per sample in ``field`` (one of :data:`FIELDS`):
        ``B x L' x N'`` (``B x N'`` for ``"embedding"``), equal to
        ``getattr(self, field)[b, ..., target[b]]`` but computed from that class's row of the
        head alone. ``target``: an int or one class per sample (not None: resolve the
        predicted class from :attr:`logits` first)."""
        if target is None:
            raise ValueError("class_logit needs target: an int or one class per sample "
                             "(e.g. proj.logits.argmax(-1) for the predicted classes)")
        t = resolve_target(check_target(target, self.logits.shape[0]), self.logits)
        if field == "embedding":
            return self.head.class_logit(self.embedding_state, t)
        # block by block, from the recorded states (no stacked copy of them)
        return torch.stack([self.head.class_logit(h, t) for h in self._block_states(field)], dim=1)

    def _block_states(self, field: str) -> Iterable[torch.Tensor]:
        """The ``B x N' x D`` states of each asked block whose projection is ``field``."""
        if field not in FIELDS or field == "embedding":
            raise ValueError(f"field must be one of {FIELDS}, got {field!r}")
        if field in ("residual", "mid", "entering"):
            return self._per_block({"residual": "block_outputs", "mid": "mid_states", "entering": "block_inputs"}[field])
        inputs, mids, outputs = (self._per_block(n) for n in ("block_inputs", "mid_states", "block_outputs"))
        if field == "attention":
            return (m - i for m, i in zip(mids, inputs))  # one difference at a time
        return (o - m for o, m in zip(outputs, mids))

    def identifiability(self, target) -> torch.Tensor:
        """``B x L' x N'``: :func:`identifiability` of each sample's ``target`` (int or one per
        sample; not None) in ``residual``, computed block by block without keeping the
        ``B x L' x N' x C`` logits (the same numbers as ``identifiability(self.residual, t)``;
        that field is used if it has already been read)."""
        t = resolve_target(check_target(target, self.logits.shape[0]), self.logits)
        if "residual" in self.__dict__:
            return identifiability(self.residual, t)
        return torch.stack([_identifiability_in_place(self._apply(h), t) for h in self._per_block("block_outputs")],
                           dim=1)


def _check_head_agrees(cls_logits: torch.Tensor, logits: torch.Tensor, model, method: str) -> None:
    """Guard: the last CLS state through the found norm + head must give the model's logits."""
    tol = 1e-3 if logits.dtype == torch.float32 or logits.dtype == torch.float64 else 5e-2
    scale = 1 + float(logits.detach().abs().max())
    if not torch.allclose(cls_logits.float(), logits.detach().float(), rtol=tol, atol=tol * scale):
        raise RuntimeError(
            f"{method}: projecting the last CLS state through {type(model).__name__}'s final norm and head "
            "does not reproduce its logits, so this model's head is not the one vitlab found; it cannot be "
            "projected"
        )


def _project(model, x: torch.Tensor, method: str, attention_edit: Callable | None = None,
             blocks=None, tokens=None, images_checked: bool = False) -> Projection:
    if not images_checked:  # (a pass over every pixel: callers that checked already say so)
        check_images(x, method)
    layout = token_layout(model, x)
    norms, head = _head_parts(model, layout, method)
    L = len(record_blocks(model))
    block_index = _indices(blocks, L, "blocks", "block")
    token_index = _indices(tokens, layout.num_tokens, "tokens", "token")
    # the residual stream alone: no attention matrices, Q, K, V held, and the model stays on its
    # fused attention path (unless attention_edit edits it)
    with torch.no_grad(), record(model, eval_mode=True, residual=True, attention_edit=attention_edit,
                                 capture=("hidden",)) as rec:
        logits = logits_of(run_images(model, x))
        class_head = ClassHead(norms, head)
        _check_head_agrees(class_head(rec.hidden_states[-1][:, 0]), logits, model, method)
        if len(rec.hidden_states) != L or len(rec.block_inputs) != L or len(rec.mid_states) != L:
            raise RuntimeError(f"{method}: the forward ran {len(rec.hidden_states)} blocks, not the model's {L}")
        chosen = range(L) if block_index is None else block_index
        if token_index is None:
            pick = lambda h: h  # noqa: E731  (the recorded tensors themselves, no copy)
        else:
            where = torch.tensor(token_index, device=x.device)
            pick = lambda h: h.index_select(1, where)  # noqa: E731  (a copy: the rest is freed)
        proj = Projection(
            inputs=[pick(rec.block_inputs[l]) for l in chosen],
            mids=[pick(rec.mid_states[l]) for l in chosen],
            outputs=[pick(rec.hidden_states[l]) for l in chosen],
            embedding_state=pick(rec.block_inputs[0]),
            logits=logits, layout=rec.layout, head=class_head,
            blocks=tuple(chosen), tokens=tuple(range(layout.num_tokens)) if token_index is None else token_index,
            num_blocks=L,
        )
    return proj  # the recording, and with it the states of the blocks not asked for, is dropped here


def project(model, x: torch.Tensor, blocks=None, tokens=None) -> Projection:
    """Every token's state, block by block, read as class logits (Vilas et al. 2023, Sec. 3).

    One forward pass in eval mode (the model's mode comes back); the residual stream entering
    each block, after its attention sublayer and after the block are recorded by
    :func:`vitlab.record` (``residual=True``) and projected with the model's own final
    norm and head (:class:`ClassHead`) on first access of each field of the returned
    :class:`Projection`. ``residual[:, -1, 0]`` (the last CLS state) equals the logits.

    Args:
        blocks: which blocks to keep and project: None (all L), an int, or a sequence of
            ints (negative from the end; in the order given, each once). The fields are then
            ``B x L' x N x C`` over these blocks (an int gives L' = 1), ``Projection.blocks``
            says which they are, and only their states are kept once ``project`` returns.
            ``project(m, x, blocks=b).residual`` equals ``project(m, x).residual[:, b]``.
        tokens: which tokens to keep and project, the same way (None: all N; ``0`` is CLS,
            ``Projection.tokens`` lists them); the fields are ``B x L' x N' x C``.

    The cost beyond the forward is the head applied to every kept state: ``L' x N'`` products
    of a ``D``-vector with the ``C x D`` head per sample and field. For all 12 blocks and 197
    tokens of a DeiT-tiny over 1000 classes that is about a third of the forward itself;
    restrict ``blocks`` / ``tokens``, or read one class with :meth:`Projection.class_logit`.

    Raises:
        ValueError: a bad input, ``blocks`` / ``tokens`` empty, out of range, repeated or not
            ints, or a model whose output is not one token's projection: no class head (timm
            ``num_classes=0``, Hugging Face base models), a head pooling the patch tokens
            (timm ``global_pool`` "avg"/"map"/..., Hugging Face Dinov2), a distilled DeiT
            (two heads on two tokens).
    """
    return _project(model, x, "project", blocks=blocks, tokens=tokens)


# --------------------------------------------------------------------------------------
# Identifiability
# --------------------------------------------------------------------------------------
def _broadcast_target(scores: torch.Tensor, target, method: str = "identifiability") -> torch.Tensor:
    """``target`` (int, ``(B,)`` along dim 0, or ``scores.shape[:-1]``) as a long tensor of
    ``scores.shape[:-1]``. Raises ``ValueError`` for scores that are not a finite ``... x C``
    tensor (a NaN would rank no class above the target and read as top-1) and for a target
    of any other shape (which would be broadcast into the wrong entries, or fail later)."""
    if not isinstance(scores, torch.Tensor) or scores.ndim < 1 or scores.shape[-1] < 1:
        raise ValueError(f"{method}: scores must be a ... x C tensor of class scores (C >= 1), got "
                         f"{getattr(scores, 'shape', type(scores).__name__)}")
    if scores.is_complex() or scores.dtype == torch.bool:
        raise ValueError(f"{method}: scores must be real numbers, got dtype {scores.dtype}")
    if not bool(torch.isfinite(scores).all()):
        bad = int((~torch.isfinite(scores)).sum())
        raise ValueError(f"{method}: scores hold {bad} non-finite value(s) (NaN or inf), where no class rank "
                         "is defined (a NaN target score would read as top-1); check the model's input and "
                         "pass finite scores")
    if isinstance(target, (bool, np.bool_)):
        raise ValueError(f"{method}: target must hold integer class indices, got a bool ({target})")
    t = torch.as_tensor(target, device=scores.device)
    if t.dtype == torch.bool or t.is_floating_point() or t.is_complex():
        raise ValueError(f"{method}: target must hold integer class indices, got dtype {t.dtype}")
    t = t.long()
    lead = tuple(scores.shape[:-1])
    if t.ndim == 1 and scores.ndim > 2 and t.shape[0] == scores.shape[0]:
        t = t.reshape(-1, *([1] * (scores.ndim - 2)))
    elif t.ndim != 0 and tuple(t.shape) != lead:
        per_sample = f", ({scores.shape[0]},) (one per entry of dim 0)" if scores.ndim > 2 else ""
        raise ValueError(f"{method}: target has shape {tuple(t.shape)}, but scores of shape {tuple(scores.shape)} "
                         f"take one int{per_sample} or {lead} (one class per score vector)")
    C = scores.shape[-1]
    if t.numel() and bool(((t < 0) | (t >= C)).any()):
        raise ValueError(f"{method}: target must be a class in 0 .. {C - 1}, got {t.min().item()} .. "
                         f"{t.max().item()}")
    return t.expand(lead)


def class_rank(scores: torch.Tensor, target) -> torch.Tensor:
    """Rank of the target class among the last dim of ``scores`` (0 = top): how many classes
    score strictly higher (ties count in the target's favour). Shape ``scores.shape[:-1]``.
    ``target`` as in :func:`identifiability`; non-finite scores are refused (``ValueError``)."""
    return _class_rank(scores, target, "class_rank")


def _class_rank(scores: torch.Tensor, target, method: str) -> torch.Tensor:
    t = _broadcast_target(scores, target, method)
    own = scores.gather(-1, t.unsqueeze(-1))
    # counted in int32 (exact, and a few times faster than summing the booleans as int64)
    return (scores > own).sum(dim=-1, dtype=torch.int32).long()


def _identifiability_in_place(scores: torch.Tensor, target) -> torch.Tensor:
    """:func:`identifiability` of a ``scores`` tensor that is then thrown away: the comparison
    is written over it (no boolean copy), the count is exact in float (at most C)."""
    t = _broadcast_target(scores, target)
    own = scores.gather(-1, t.unsqueeze(-1))
    return 1 - scores.gt_(own).sum(dim=-1) / scores.shape[-1]


def identifiability(scores: torch.Tensor, target) -> torch.Tensor:
    """Class identifiability ``r = 1 - rank(target) / C`` over the last dim (Vilas et al. 2023).

    ``scores``: ``... x C`` class scores (e.g. ``Projection.residual``). ``target``: an int,
    a ``(B,)`` tensor (one class per entry of dim 0, broadcast over the rest) or one class
    per entry of ``scores.shape[:-1]``. Returns ``scores.shape[:-1]`` in ``(0, 1]``; 1 when the
    target is top-1, chance level about 0.5. Raises ``ValueError`` for non-finite scores (a
    NaN would rank no class above the target, so it would read as top-1) and for a target of
    any other shape.
    """
    return 1 - _class_rank(scores, target, "identifiability").to(scores.dtype) / scores.shape[-1]


def identifiable_share(scores: torch.Tensor, target, tokens=None) -> torch.Tensor:
    """Share of tokens for which ``target`` is the top-1 class: ``scores`` ``... x N x C`` ->
    ``...`` (e.g. ``B x L`` from ``B x L x N x C``). ``tokens``: which of the N tokens count
    (indices or a boolean mask over N; e.g. ``slice(layout.num_prefix, None)`` for the image
    tokens); all when None."""
    top1 = (_class_rank(scores, target, "identifiable_share") == 0).to(scores.dtype)  # ... x N
    if tokens is not None:
        top1 = top1[..., tokens]
    return top1.mean(dim=-1)


def _target_for(target, logits: torch.Tensor) -> torch.Tensor:
    return resolve_target(check_target(target, logits.shape[0]), logits)


def class_identifiability(model, x: torch.Tensor, target=None, blocks=None, tokens=None) -> torch.Tensor:
    """``B x L x N``: identifiability of each sample's target in every token's residual-stream
    projection after every block. ``target``: int, one per sample, or None (predicted).
    ``blocks`` / ``tokens`` as in :func:`project` (``B x L' x N'`` over those). Computed block
    by block (:meth:`Projection.identifiability`): the ``B x L x N x C`` logits are never held."""
    check_images(x, "class_identifiability")
    check_target(target, x.shape[0])
    proj = _project(model, x, "class_identifiability", blocks=blocks, tokens=tokens, images_checked=True)
    return proj.identifiability(_target_for(target, proj.logits))


# --------------------------------------------------------------------------------------
# Sublayer contributions
# --------------------------------------------------------------------------------------
class Contributions(NamedTuple):
    """Per-token change of the target's projected logit, from :func:`sublayer_contributions`.

    Attributes:
        attention: ``B x L x N``: ``proj(h_{l-1} + a_l)[t] - proj(h_{l-1})[t]``.
        mlp: ``B x L x N``: ``proj(h_{l-1} + a_l + m_l)[t] - proj(h_{l-1} + a_l)[t]``.
        target: ``(B,)`` the class per sample.
    """

    attention: torch.Tensor
    mlp: torch.Tensor
    target: torch.Tensor


def sublayer_contributions(model, x: torch.Tensor, target=None, blocks=None, tokens=None) -> Contributions:
    """How much each block's attention and MLP sublayer raise or lower the target's projected
    logit, per token (``h_0`` = the tokens entering block 0). Because the norm sits inside
    ``proj``, these are differences of projections, not projections of the sublayer outputs;
    they telescope: summed over blocks, both give ``proj(h_L)[t] - proj(h_0)[t]``.

    Only the target's row of the head is applied (:meth:`Projection.class_logit`), so this
    costs little beyond the forward. ``blocks`` / ``tokens`` as in :func:`project`: the
    ``B x L' x N'`` contributions of those blocks and tokens (the same numbers as their
    entries in the full result)."""
    check_images(x, "sublayer_contributions")
    check_target(target, x.shape[0])
    proj = _project(model, x, "sublayer_contributions", blocks=blocks, tokens=tokens, images_checked=True)
    t = _target_for(target, proj.logits)
    before, mid, after = (proj.class_logit(f, t) for f in ("entering", "mid", "residual"))
    return Contributions(attention=mid - before, mlp=after - mid, target=t)


# --------------------------------------------------------------------------------------
# Key-value memories (paper Sec. 5)
# --------------------------------------------------------------------------------------
VALUE_MODES = ("norm", "cosine")
SUBLAYERS = ("mlp", "attention")


def _block(model, block: int) -> nn.Module:
    all_blocks = record_blocks(model)
    if isinstance(block, bool) or not isinstance(block, int) or not -len(all_blocks) <= block < len(all_blocks):
        raise ValueError(f"block must be an int in [0, {len(all_blocks)}) (or negative from the end), got {block!r}")
    return all_blocks[block]


def value_projection(model, block: int, mode: str = "norm") -> torch.Tensor:
    """Each MLP hidden unit's value vector of ``block`` in class space: ``hidden x C``.

    Unit i writes ``act_i * v_i`` into the residual stream, ``v_i`` = column i of ``fc2``'s
    weight (times the block's layer scale, where it has one). Its class scores:

    - ``mode="norm"`` (default): ``W_head (gamma * (v_i - mean(v_i)))`` -- through the linear
      part of the model's final LayerNorm(s) (centering and gain, not the division by the
      token's std, which only scales by a positive per-token factor, nor the biases) and the
      head's weight (no bias): the direction in which the unit moves every class logit.
    - ``mode="cosine"``: the paper's code: cosine similarity of ``v_i`` with each class
      embedding (row of the head's weight), no norm.
    """
    b = _block(model, block)
    fc2 = getattr(getattr(b, "mlp", None), "fc2", None)
    if not isinstance(fc2, nn.Linear):
        raise TypeError(f"value_projection: block {block} has no mlp.fc2 linear layer")
    return _values_in_class_space(model, fc2, getattr(b, "ls2", None), mode, "value_projection")


def attention_value_projection(model, block: int, mode: str = "norm") -> torch.Tensor:
    """The attention sublayer of ``block`` as key-value memories (Vilas et al. 2023, Fig. 1b,
    after Geva et al. 2021): each memory's value vector in class space, ``D x C``.

    The sublayer adds ``W_O c + b_O`` to the residual stream, ``c`` = the heads' outputs
    concatenated (``D`` entries; entry ``j = f * d_head + i`` is ``sum_m A_f[n, m] V_f[m, i]``
    for head f). Column j of ``W_O`` (``attn.proj``'s weight, times the layer scale where
    there is one) is memory j's **value**; its **key** is column i of head f's value
    projection, matched with the hidden state of every attended token m and weighted by the
    attention ``A_f[n, m]``: the memory coefficient ``c_j`` (:func:`attention_coefficients`).
    Class scores of each value as in :func:`value_projection` (``mode="norm"``: through the
    final LayerNorms' centering and gain and the head's weight; ``"cosine"``: the paper's
    code, cosine with each class embedding).
    """
    b = _block(model, block)
    proj = getattr(getattr(b, "attn", None), "proj", None)
    if not isinstance(proj, nn.Linear):
        raise TypeError(f"attention_value_projection: block {block} has no attn.proj linear layer")
    return _values_in_class_space(model, proj, getattr(b, "ls1", None), mode, "attention_value_projection")


def _values_in_class_space(model, out_layer: nn.Linear, layer_scale, mode: str, method: str) -> torch.Tensor:
    """``memories x C``: the columns of ``out_layer``'s weight (times ``layer_scale.gamma``)
    in class space, as :func:`value_projection` describes."""
    if mode not in VALUE_MODES:
        raise ValueError(f"mode must be one of {VALUE_MODES}, got {mode!r}")
    norms, head = _head_parts(model, token_layout(model), method)
    with torch.no_grad():
        values = out_layer.weight.T.clone()  # memories x D
        scale = getattr(layer_scale, "gamma", None)
        if isinstance(scale, torch.Tensor):
            values = values * scale
        E = head.weight  # C x D
        if mode == "cosine":
            return nn.functional.normalize(values, dim=-1) @ nn.functional.normalize(E, dim=-1).T
        for norm in norms:
            if not isinstance(norm, nn.LayerNorm):
                raise TypeError(f"{method}: mode='norm' reads LayerNorms, got {type(norm).__name__}")
            values = values - values.mean(dim=-1, keepdim=True)
            if norm.weight is not None:
                values = values * norm.weight
        return values @ E.T  # memories x C


def unit_top_classes(model, block: int, k: int = 5, mode: str = "norm", sublayer: str = "mlp") -> torch.Tensor:
    """``memories x k``: the k classes each memory's value promotes most (best first): the MLP
    units (``sublayer="mlp"``, :func:`value_projection`, ``hidden x k``) or the attention
    memories (``sublayer="attention"``, :func:`attention_value_projection`, ``D x k``)."""
    positive_int("k", k)
    if sublayer not in SUBLAYERS:
        raise ValueError(f"sublayer must be one of {SUBLAYERS}, got {sublayer!r}")
    scores = (value_projection if sublayer == "mlp" else attention_value_projection)(model, block, mode)
    return scores.topk(min(k, scores.shape[-1]), dim=-1).indices


class MemoryAgreement(NamedTuple):
    """From :func:`memory_agreement`.

    Attributes:
        agreement: ``B x N`` share of the token's k most active units whose value's top class
            is the sample's target.
        units: ``B x N x k`` those units (most active first).
        target: ``(B,)`` the class per sample.
    """

    agreement: torch.Tensor
    units: torch.Tensor
    target: torch.Tensor


def attention_coefficients(model, x: torch.Tensor, block: int) -> torch.Tensor:
    """``B x N x D``: the memory coefficients of ``block``'s attention sublayer per token
    (Vilas et al. 2023, Fig. 1b): entry ``j = f * d_head + i`` is ``sum_m A_f[n, m] V_f[m, i]``,
    the match of key i of head f with the hidden state of every token m, weighted by how much
    token n attends to m -- the input of ``attn.proj``, so the sublayer's output is
    ``coefficients @ W_O.T + b_O`` (times the layer scale). One forward, eval mode; the
    attention and values are recorded by :func:`vitlab.record`, the model is unchanged."""
    check_images(x, "attention_coefficients")
    index = record_blocks(model).index(_block(model, block))
    with torch.no_grad(), record(model, eval_mode=True, capture=("attention", "value")) as rec:
        run_images(model, x)
    return _coefficients(rec.attentions[index], rec.values[index])


def _coefficients(attention: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``B x H x N x N`` attention, ``B x H x N x d`` values -> ``B x N x H*d``."""
    B, H, N, d = values.shape
    return (attention @ values).transpose(1, 2).reshape(B, N, H * d)


def memory_agreement(model, x: torch.Tensor, block: int | None, target=None, k: int = 10,
                     mode: str = "norm", sublayer: str = "mlp") -> MemoryAgreement:
    """Do the memories that are most active on a token promote its class? (Vilas et al. 2023,
    key-value memories, Sec. 5 and Fig. 1b)

    Per token: the ``k`` memories of ``block`` with the largest coefficient, and the share of
    them whose value vector's top class (:func:`unit_top_classes`, ``k=1``) is the sample's
    target (None: the predicted class). ``sublayer="mlp"``: the MLP's hidden units, the
    coefficient being the activation after the non-linearity (recorded by
    :func:`vitlab.record` with ``mlp=True``); ``sublayer="attention"``: the attention
    sublayer's D memories, the coefficient being :func:`attention_coefficients`. One forward
    pass, eval mode. ``block=None``: every block from the same forward, the fields then
    ``B x L x N`` and ``B x L x N x k`` (entry l equal to ``block=l``'s). (The paper's code
    scores a token as agreeing when any of its 5 most active memories is among the 5
    memories whose values promote the class most.)
    """
    check_images(x, "memory_agreement")
    check_target(target, x.shape[0])
    positive_int("k", k)
    if sublayer not in SUBLAYERS:
        raise ValueError(f"sublayer must be one of {SUBLAYERS}, got {sublayer!r}")
    all_blocks = record_blocks(model)
    chosen = range(len(all_blocks)) if block is None else [all_blocks.index(_block(model, block))]
    tops = [unit_top_classes(model, b, 1, mode, sublayer)[:, 0] for b in chosen]  # memories, per block
    if sublayer == "mlp":
        with torch.no_grad(), record(model, eval_mode=True, mlp=True, capture=()) as rec:
            logits = logits_of(run_images(model, x))
        acts = [rec.mlp_activations[b] for b in chosen]  # B x N x hidden
    else:
        with torch.no_grad(), record(model, eval_mode=True, capture=("attention", "value")) as rec:
            logits = logits_of(run_images(model, x))
        acts = [_coefficients(rec.attentions[b], rec.values[b]) for b in chosen]  # B x N x D
    t = _target_for(target, logits)
    units = [a.topk(min(k, a.shape[-1]), dim=-1).indices for a in acts]  # B x N x k
    agreement = [(top.to(u.device)[u] == t[:, None, None]).to(a.dtype).mean(-1)
                 for top, u, a in zip(tops, units, acts)]
    if block is None:
        return MemoryAgreement(agreement=torch.stack(agreement, 1), units=torch.stack(units, 1), target=t)
    return MemoryAgreement(agreement=agreement[0], units=units[0], target=t)


# --------------------------------------------------------------------------------------
# Explanation map (paper RQ3)
# --------------------------------------------------------------------------------------
def projection_map(model, x: torch.Tensor, target=None) -> torch.Tensor:
    """The paper's explanation map from the projection, ``B x gh x gw``.

    ``loss = sum_l CE(proj(h_l[CLS]), t)``: the cross-entropy (softmax) of the target in the
    projected CLS state after each block l, summed over blocks (and samples, each sample's
    gradient being its own). The map is ``-sum_l sum_heads d loss / d A_l[CLS, patches]``,
    the gradient with respect to each block's post-softmax CLS -> patch attention: positive
    where attending more to a patch would make the CLS token more identifiable as t. Because
    the per-block losses are summed, block l's gradient also counts the losses of later
    blocks it feeds. One forward and one backward (``torch.autograd.grad`` on the recorded
    attention; no parameter gradients). ``target``: int, one per sample, None (predicted).
    """
    check_images(x, "projection_map")
    layout = token_layout(model, x)
    norms, head = _head_parts(model, layout, "projection_map")
    target = check_target(target, x.shape[0])
    require_gradients("projection_map")
    class_head = ClassHead(norms, head)
    with torch.enable_grad():
        x_in = gradient_leaf(x)
        with record(model, detach=False, eval_mode=True, capture=("attention", "hidden")) as rec:
            logits = logits_of(run_images(model, x_in))
            t = resolve_target(target, logits)
            cls_states = torch.stack([h[:, 0] for h in rec.hidden_states], dim=1)  # B x L x D
            projected = class_head(cls_states)  # B x L x C
            loss = nn.functional.cross_entropy(
                projected.flatten(0, 1), t.repeat_interleave(projected.shape[1]), reduction="sum")
            attentions = list(rec.attentions)
            grads = torch.autograd.grad(loss, attentions)
    P = rec.layout.num_prefix
    cls_grad = sum(g[:, :, 0, P:].sum(dim=1) for g in grads)  # B x num_patches
    return rec.layout.patches_to_grid(-cls_grad.detach())


# --------------------------------------------------------------------------------------
# Context interventions (paper RQ5)
# --------------------------------------------------------------------------------------
def intervention_mask(mode: str, layout: TokenLayout) -> torch.Tensor:
    """``N x N`` boolean mask of allowed query -> key pairs for a context intervention:

    - ``"self_only"``: each image (patch) token attends only to itself;
    - ``"no_cls"``: image tokens may not attend to the CLS token (token 0).

    Prefix tokens (CLS, distillation, registers) keep attending to every token."""
    if mode not in INTERVENTIONS:
        raise ValueError(f"mode must be one of {INTERVENTIONS}, got {mode!r}")
    N, P = layout.num_tokens, layout.num_prefix
    allowed = torch.ones(N, N, dtype=torch.bool)
    if mode == "self_only":
        allowed[P:] = False
        allowed[P:, P:] |= torch.eye(N - P, dtype=torch.bool)
    else:
        allowed[P:, 0] = False
    return allowed


@renamed_arguments(from_block="start_block")
def context_intervention(model, x: torch.Tensor, mode: str, start_block: int = 0, blocks=None,
                         tokens=None) -> Projection:
    """:func:`project` with image tokens cut off from context in blocks ``start_block`` on
    (paper RQ5): ``mode="self_only"`` (each image token attends only to itself) or
    ``"no_cls"`` (image tokens do not attend to CLS); see :func:`intervention_mask`. The edit
    masks the attention logits before the softmax through ``vitlab.record(attention_edit=...)``
    for the one forward; the model is left exactly as it was, also when the forward raises.
    ``logits`` are the edited model's output. ``blocks`` / ``tokens``: which blocks' and
    tokens' states to keep and project, as in :func:`project` (the edit still applies from
    ``start_block`` on, whichever blocks are kept)."""
    check_images(x, "context_intervention")
    layout = token_layout(model, x)
    allowed = intervention_mask(mode, layout).to(x.device)
    L = len(record_blocks(model))
    if isinstance(start_block, bool) or not isinstance(start_block, int) or not 0 <= start_block <= L:
        raise ValueError(f"start_block must be an int in [0, {L}], got {start_block!r}")

    def edit(block: int, num_tokens: int):
        return allowed if block >= start_block else None

    return _project(model, x, "context_intervention", attention_edit=edit, blocks=blocks, tokens=tokens,
                    images_checked=True)


# --------------------------------------------------------------------------------------
# Linear probes and token removal (paper RQ4)
# --------------------------------------------------------------------------------------
PROBE_TOKENS = ("image", "cls", "all")
REMOVE = ("highest", "lowest")


@dataclass(eq=False)
class Probes:
    """What :func:`linear_probes` returns: one linear classifier per block, ``logits = h @ W.T + b``.

    Attributes:
        weight: ``L' x C x D``, probe l reads the residual stream after block ``blocks[l]``.
        bias: ``L' x C``.
        blocks: the model blocks the probes read (all L by default, then probe l reads block l).
        train_accuracy: ``(L',)`` share of the training tokens whose top-1 probe class is their
            image's class.
        train_loss: ``(L',)`` the final mean cross-entropy on the training tokens.
        tokens: which tokens were trained on (``"image"``, ``"cls"`` or ``"all"``).
        epochs, lr, seed: how they were trained.
    """

    weight: torch.Tensor
    bias: torch.Tensor
    train_accuracy: torch.Tensor
    train_loss: torch.Tensor
    tokens: str
    epochs: int
    lr: float
    seed: int
    blocks: tuple[int, ...]

    def logits(self, states: torch.Tensor, block: int | None = None) -> torch.Tensor:
        """:func:`probe_logits` of these probes."""
        return probe_logits(self, states, block)


def _check_fit(epochs, lr, seed) -> None:
    positive_int("epochs", epochs)
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not 0 < lr < float("inf"):
        raise ValueError(f"lr must be a positive finite number, got {lr!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed must be an int, got {seed!r}")


def train_probe(states: torch.Tensor, labels: torch.Tensor, num_classes: int, epochs: int = 300,
                lr: float = 0.05, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, float, float]:
    """One softmax linear classifier on ``M x D`` states with ``(M,)`` labels in ``0 .. C - 1``.

    Full-batch Adam (``epochs`` steps, learning rate ``lr``) on the mean cross-entropy, on
    features standardised with the states' own per-dimension mean and std; the standardisation
    is folded into the returned weights, so ``logits = states @ weight.T + bias`` on raw states.
    Initial weights ``N(0, 0.01^2)`` from a generator seeded with ``seed`` (bias 0): the same
    inputs and seed give the same probe. Returns ``(weight C x D, bias C, train accuracy,
    final loss)``; runs with gradients even under ``torch.no_grad()``/``inference_mode()``.
    """
    if not isinstance(states, torch.Tensor) or states.ndim != 2 or states.shape[0] == 0:
        raise ValueError(f"states must be a non-empty M x D tensor, got {getattr(states, 'shape', type(states))}")
    labels = torch.as_tensor(labels)
    if labels.dtype == torch.bool or labels.is_floating_point() or labels.shape != states.shape[:1]:
        raise ValueError(f"labels must be {states.shape[0]} integer classes (one per state), "
                         f"got dtype {labels.dtype}, shape {tuple(labels.shape)}")
    C = positive_int("num_classes", num_classes)
    if bool(((labels < 0) | (labels >= C)).any()):
        raise ValueError(f"labels must be classes in 0 .. {C - 1}, got {labels.min().item()} .. {labels.max().item()}")
    _check_fit(epochs, lr, seed)
    with torch.inference_mode(False), torch.enable_grad():
        h = states.detach().clone().float()  # a normal tensor even if states came from inference mode
        y = labels.detach().clone().long().to(h.device)
        if not bool(torch.isfinite(h).all()):
            raise ValueError("states must be finite (no NaN or inf)")
        mu, sigma = h.mean(0), h.std(0, unbiased=False).clamp_min(1e-6)
        z = (h - mu) / sigma
        g = torch.Generator().manual_seed(seed)
        W = (torch.randn(C, h.shape[1], generator=g) * 0.01).to(h.device).requires_grad_(True)
        b = torch.zeros(C, device=h.device, requires_grad=True)
        opt = torch.optim.Adam([W, b], lr=float(lr))
        for _ in range(epochs):
            opt.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(z @ W.T + b, y).backward()
            opt.step()
        with torch.no_grad():
            out = z @ W.T + b
            loss = float(nn.functional.cross_entropy(out, y))
            accuracy = float((out.argmax(-1) == y).float().mean())
            weight = W / sigma  # h @ (W / sigma).T + (b - (W / sigma) @ mu) = z @ W.T + b
            bias = b - weight @ mu
    return weight.to(states.dtype), bias.to(states.dtype), accuracy, loss


def linear_probes(model, x: torch.Tensor, target, tokens: str = "image", epochs: int = 300,
                  lr: float = 0.05, seed: int = 0, blocks=None) -> Probes:
    """Per-block linear probes on the residual stream (Vilas et al. 2023, RQ4).

    For every block l, :func:`train_probe` fits a ``D -> C`` softmax classifier (C = the
    model's classes) on the states after block l (``project(model, x).block_outputs``) of the
    chosen ``tokens`` of every image, each token labelled with its image's class ``target``
    (one class per sample, or one int for all): ``"image"`` (the patch tokens), ``"cls"`` or
    ``"all"``. Full-batch Adam, deterministic given ``seed``. One forward pass of the whole
    batch (its states, ``B x L x N x D`` three times, are held in memory); the model is
    unchanged. Score states with :func:`probe_logits`. ``blocks``: train probes for these
    blocks only (as in :func:`project`; ``Probes.blocks`` lists them): each probe is the one
    the full call trains for its block, and only those blocks' states are held.
    """
    check_images(x, "linear_probes")
    if target is None:
        raise ValueError("linear_probes needs target: the true class of each image (one int per sample, or one for all)")
    t = check_target(target, x.shape[0])
    if tokens not in PROBE_TOKENS:
        raise ValueError(f"tokens must be one of {PROBE_TOKENS}, got {tokens!r}")
    _check_fit(epochs, lr, seed)  # before the forward
    proj = _project(model, x, "linear_probes", blocks=blocks, images_checked=True)
    t = resolve_target(t, proj.logits)
    states = proj.block_outputs  # B x L x N x D
    P = proj.layout.num_prefix
    states = {"image": states[:, :, P:], "cls": states[:, :, :1], "all": states}[tokens]
    B, L, T, D = states.shape
    labels = t.repeat_interleave(T)  # token-major within each sample, as states[:, l].reshape(B * T, D)
    C = proj.logits.shape[-1]
    fits = [train_probe(states[:, l].reshape(B * T, D), labels, C, epochs, lr, seed) for l in range(L)]
    return Probes(
        weight=torch.stack([f[0] for f in fits]), bias=torch.stack([f[1] for f in fits]),
        train_accuracy=torch.tensor([f[2] for f in fits]), train_loss=torch.tensor([f[3] for f in fits]),
        tokens=tokens, epochs=epochs, lr=float(lr), seed=seed, blocks=proj.blocks,
    )


def probe_logits(probes: Probes, states: torch.Tensor, block: int | None = None) -> torch.Tensor:
    """Class scores of the probes: ``states @ W_l.T + b_l``.

    ``block=None``: ``states`` is ``B x L' x N x D``, one entry per probe (as
    ``Projection.block_outputs`` of a projection of the same ``blocks``, all by default) and
    entry l is scored by probe l -> ``B x L' x N x C`` (then e.g. :func:`identifiability`
    ranks the class in them, like the projection's). ``block=l``: any ``... x D`` states
    scored by probe l (the probe of model block ``probes.blocks[l]``) -> ``... x C``.
    """
    L, C, D = probes.weight.shape
    if not isinstance(states, torch.Tensor) or states.ndim < 1 or states.shape[-1] != D:
        raise ValueError(f"states must be a ... x {D} tensor, got {getattr(states, 'shape', type(states))}")
    W, b = probes.weight.to(states.device, states.dtype), probes.bias.to(states.device, states.dtype)
    if block is None:
        if states.ndim != 4 or states.shape[1] != L:
            raise ValueError(f"with block=None, states must be B x {L} x N x {D} (one entry per probe's block), "
                             f"got {tuple(states.shape)}; pass block=l to score ... x D states with one probe")
        return torch.einsum("blnd,lcd->blnc", states, W) + b[None, :, None]
    if isinstance(block, bool) or not isinstance(block, int) or not -L <= block < L:
        raise ValueError(f"block must be an int in [0, {L}) (or negative from the end), got {block!r}")
    return states @ W[block].T + b[block]


class TokenRemoval(NamedTuple):
    """From :func:`token_removal`.

    Attributes:
        logits: ``B x C`` the model's output with the tokens removed.
        predicted: ``(B,)`` its top-1 class.
        target: ``(B,)`` the class each prediction is checked against.
        correct: ``(B,)`` bool, ``predicted == target``.
        removed: ``B x num_patches`` bool, the removed image tokens.
    """

    logits: torch.Tensor
    predicted: torch.Tensor
    target: torch.Tensor
    correct: torch.Tensor
    removed: torch.Tensor

    @property
    def accuracy(self) -> float:
        """Share of samples still predicted as their target."""
        return float(self.correct.float().mean())


def token_removal(model, x: torch.Tensor, ranking: torch.Tensor, fraction: float, target=None,
                  remove: str = "highest") -> TokenRemoval:
    """The model's predictions with a share of each image's tokens removed (paper RQ4).

    Per sample, the ``round(fraction * num_patches)`` image tokens with the highest (or, with
    ``remove="lowest"``, lowest) score in ``ranking`` (``B x num_patches`` or a ``B x gh x gw``
    map; ties go to the earlier token) are removed from every block: no query (CLS, the other
    tokens, the token itself) may attend to them, through a per-sample ``B x 1 x N x N``
    attention mask (:func:`vitlab.record`, ``attention_edit``). Removed tokens still compute
    their own states but nothing reads them; prefix tokens are never removed. Rank by, e.g.,
    the identifiability of the target in the projection or in :func:`probe_logits`: tokens
    whose removal hurts accuracy hold features the model uses. ``target``: int, one per
    sample, or None (the model's prediction without removal). One forward pass (two when
    ``target`` is None), eval mode; the model is unchanged.
    """
    check_images(x, "token_removal")
    t = check_target(target, x.shape[0])
    if remove not in REMOVE:
        raise ValueError(f"remove must be one of {REMOVE}, got {remove!r}")
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 <= fraction <= 1:
        raise ValueError(f"fraction must be a number in [0, 1], got {fraction!r}")
    layout = token_layout(model, x)
    scores = _ranking_scores(ranking, x.shape[0], layout)
    return _remove_tokens(model, x, _removed_by_rank(scores, fraction, remove), t, layout, "token_removal")


def _ranking_scores(ranking, B: int, layout: TokenLayout) -> torch.Tensor:
    """``ranking`` checked (``B x num_patches`` or ``B x gh x gw``, finite) -> ``B x num_patches`` float."""
    Pn = layout.num_patches
    if not isinstance(ranking, torch.Tensor) or ranking.shape not in ((B, Pn), (B, *layout.grid)):
        raise ValueError(f"ranking must be a B x num_patches ({B} x {Pn}) or B x gh x gw ({B} x {layout.grid[0]} x "
                         f"{layout.grid[1]}) tensor of scores, got {getattr(ranking, 'shape', type(ranking))}")
    scores = ranking.detach().reshape(B, Pn).float()
    if not bool(torch.isfinite(scores).all()):
        raise ValueError("ranking must be finite (no NaN or inf)")
    return scores


def _removed_by_rank(scores: torch.Tensor, fraction: float, remove: str) -> torch.Tensor:
    """``B x num_patches`` bool (CPU): per sample the ``round(fraction * num_patches)`` tokens
    with the highest (``remove="highest"``) or lowest scores, ties to the earlier token."""
    B, Pn = scores.shape
    k = int(fraction * Pn + 0.5)
    order = scores.argsort(dim=-1, descending=remove == "highest", stable=True)[:, :k].cpu()
    removed = torch.zeros(B, Pn, dtype=torch.bool)
    removed.scatter_(1, order, True)
    return removed


def remove_tokens(model, x: torch.Tensor, removed: torch.Tensor, target=None) -> TokenRemoval:
    """The model's predictions with the image tokens marked in ``removed`` (``B x num_patches``
    or ``B x gh x gw`` bool, e.g. every token touching an object, or that set grown by one
    patch) removed from every block, as in :func:`token_removal` (Vilas et al. 2023, RQ3): no
    query may attend to them. Unlike :func:`token_removal`, each sample may lose a different
    number of tokens. A removed token's own *pixels* are still read by its neighbours where
    the patch embedding's window is wider than a patch (a convolutional stem); removing a
    grown set (:func:`vitlab.localization.grow_masks` on the grid) measures how much leaks so.
    ``target``: int, one per sample, or None (the prediction with nothing removed). One
    forward (two when ``target`` is None), eval mode; the model is unchanged."""
    check_images(x, "remove_tokens")
    t = check_target(target, x.shape[0])
    layout = token_layout(model, x)
    B, Pn = x.shape[0], layout.num_patches
    if (not isinstance(removed, torch.Tensor) or removed.dtype != torch.bool
            or removed.shape not in ((B, Pn), (B, *layout.grid))):
        raise ValueError(f"removed must be a bool tensor B x num_patches ({B} x {Pn}) or B x gh x gw ({B} x "
                         f"{layout.grid[0]} x {layout.grid[1]}), got "
                         f"{getattr(removed, 'dtype', type(removed))} {tuple(getattr(removed, 'shape', ()))}")
    return _remove_tokens(model, x, removed.reshape(B, Pn).cpu(), t, layout, "remove_tokens")


def _remove_tokens(model, x: torch.Tensor, removed: torch.Tensor, t, layout: TokenLayout, method: str) -> TokenRemoval:
    B, P, N = x.shape[0], layout.num_prefix, layout.num_tokens
    if P == 0:
        raise ValueError(f"{method}: this model has no prefix token, so removing every image token would "
                         "leave queries with nothing to attend to; it needs a CLS token")
    allowed = torch.ones(B, 1, N, N, dtype=torch.bool)
    allowed[:, :, :, P:] = ~removed[:, None, None, :]
    allowed = allowed.to(x.device)
    with torch.no_grad():
        if t is None:
            with record(model, eval_mode=True, capture=()):
                t = logits_of(run_images(model, x)).argmax(-1)
        with record(model, eval_mode=True, capture=(), attention_edit=lambda layer, num_tokens: allowed):
            logits = logits_of(run_images(model, x))
    t = resolve_target(t, logits)
    predicted = logits.argmax(-1)
    return TokenRemoval(logits=logits, predicted=predicted, target=t, correct=predicted == t,
                        removed=removed.to(x.device))


# --------------------------------------------------------------------------------------
# A class-free reading: how close each token is to what the model outputs
# --------------------------------------------------------------------------------------
def _final_norms(model: nn.Module, method: str) -> list[nn.Module]:
    """The norm(s) a ViT applies to its last block's output before any head (timm: ``norm``,
    then ``fc_norm`` where it is not the identity; Hugging Face: the base model's
    ``layernorm``)."""
    if is_timm_vit(model):
        return [m for m in (getattr(model, "norm", None), getattr(model, "fc_norm", None))
                if isinstance(m, nn.Module) and not isinstance(m, nn.Identity)]
    if is_hf_model(model):
        base = getattr(model, getattr(model, "base_model_prefix", ""), None) or model
        norm = getattr(base, "layernorm", None)
        if not isinstance(norm, nn.Module):
            raise ValueError(f"{method}: {type(model).__name__} has no final layernorm vitlab can find")
        return [norm]
    raise TypeError(f"{method}: {type(model).__name__} is not a timm or Hugging Face ViT")


def output_similarity(model, x: torch.Tensor) -> torch.Tensor:
    """A class-free counterpart of the projection (after Vilas et al. 2023, Sec. 3): the cosine
    similarity between every token's state after every block and the class token's state after
    the last block, both through the model's final norm. ``B x L x N`` (block, token; token 0 is
    CLS, so ``[:, -1, 0]`` is 1). The last CLS state is what any head on the class token reads,
    so a token near 1 already points where the model's output will; it needs no class head
    (e.g. a self-supervised or saliency model). Refuses models without a class token, or whose
    output pools the patch tokens (timm ``global_pool`` other than "token"). One forward in eval
    mode; the model is unchanged."""
    check_images(x, "output_similarity")
    layout = token_layout(model, x)
    if not layout.has_class_token:
        raise ValueError("output_similarity: this model has no class token to compare the tokens with")
    if layout.pool in ("token_distillation", "token_avg"):
        raise ValueError("output_similarity: this model's output reads the class token together with "
                         + ("the distillation token (a distilled DeiT's two heads)" if layout.pool == "token_distillation"
                            else "the mean of the patch tokens (Dinov2's classifier)")
                         + "; there is no one state its output reads")
    if is_timm_vit(model) and layout.pool != "token":
        raise ValueError(f"output_similarity: this model's output pools the patch tokens (global_pool="
                         f"{layout.pool!r}), not the class token; there is no one state its output reads")
    norms = _final_norms(model, "output_similarity")
    with torch.no_grad(), record(model, eval_mode=True, capture=("hidden",)) as rec:
        run_images(model, x)
        h = torch.stack(list(rec.hidden_states), dim=1)                   # B x L x N x D
        for norm in norms:
            h = norm(h)
    return torch.nn.functional.cosine_similarity(h, h[:, -1:, :1], dim=-1)


# --------------------------------------------------------------------------------------
# The token-removal test of a ranking against random removal (paper RQ3 / RQ4)
# --------------------------------------------------------------------------------------
#: Fractions of the image tokens removed along a curve: 0 (nothing) to 0.9 in steps of 0.1.
REMOVAL_FRACTIONS = tuple(round(0.1 * i, 1) for i in range(10))


def _check_fractions(fractions) -> torch.Tensor:
    try:
        f = torch.as_tensor(fractions, dtype=torch.float64)
    except (TypeError, ValueError, RuntimeError):
        raise ValueError(f"fractions must be a 1-D sequence of numbers in [0, 1], got {fractions!r}") from None
    if f.ndim != 1 or f.numel() < 2:
        raise ValueError(f"fractions must be a 1-D sequence of at least two numbers in [0, 1], got {fractions!r}")
    if not bool(torch.isfinite(f).all()) or bool(((f < 0) | (f > 1)).any()) or bool((f[1:] <= f[:-1]).any()):
        raise ValueError(f"fractions must be increasing numbers in [0, 1] (finite, no repeats), got {f.tolist()}")
    return f


def _auc(y: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
    """Trapezoid area under ``y`` (``... x F``) over the fractions ``f``, divided by their
    span: the mean accuracy along the curve, in [0, 1]."""
    y = y.double()
    return ((y[..., 1:] + y[..., :-1]) / 2 * (f[1:] - f[:-1])).sum(-1) / (f[-1] - f[0])


class RemovalCurve(NamedTuple):
    """From :func:`removal_curve`.

    Attributes:
        fractions: ``(F,)`` the shares of image tokens removed.
        correct: ``B x F`` bool, whether sample b is still predicted as its target with
            ``fractions[i]`` of its tokens removed (:func:`token_removal`).
        target: ``(B,)`` the class checked.
        remove: ``"highest"`` (the ranking's top tokens first: the paper's *positive*
            perturbation) or ``"lowest"`` (its bottom tokens first: *negative*).
    """

    fractions: torch.Tensor
    correct: torch.Tensor
    target: torch.Tensor
    remove: str

    @property
    def accuracy(self) -> torch.Tensor:
        """``(F,)`` the share of samples still correct at each fraction."""
        return self.correct.double().mean(0)

    @property
    def sample_auc(self) -> torch.Tensor:
        """``(B,)`` each sample's area under its correct / not correct curve (over the
        fractions' span); their mean is :attr:`auc`."""
        return _auc(self.correct, self.fractions)

    @property
    def auc(self) -> float:
        """The area under the accuracy curve, divided by the fractions' span (1: the model
        stays right whatever is removed; a faithful ranking gives a low AUC removing its top
        tokens first and a high one removing its bottom tokens first)."""
        return float(_auc(self.accuracy, self.fractions))


def removal_curve(model, x: torch.Tensor, ranking: torch.Tensor, target=None, remove: str = "highest",
                  fractions=REMOVAL_FRACTIONS) -> RemovalCurve:
    """The model's accuracy as a growing share of each image's tokens is removed in the order
    of ``ranking`` (Vilas et al. 2023, RQ3 and RQ4: their positive / negative perturbation).

    At each fraction, what :func:`token_removal` computes: the ``round(f * num_patches)``
    image tokens ranked highest (``remove="highest"``, positive perturbation) or lowest
    (``"lowest"``, negative) are removed from every block (nothing attends to them; one forward
    per fraction, the nothing-removed one shared). ``ranking``: ``B x
    num_patches`` or ``B x gh x gw`` scores; ``target``: int, one per sample, or None (the
    model's prediction with nothing removed). ``fractions``: increasing, in [0, 1]. The
    model is unchanged."""
    check_images(x, "removal_curve")
    t = check_target(target, x.shape[0])
    f = _check_fractions(fractions)
    if remove not in REMOVE:
        raise ValueError(f"remove must be one of {REMOVE}, got {remove!r}")
    layout = token_layout(model, x)
    scores = _ranking_scores(ranking, x.shape[0], layout)
    t, (correct,) = _removal_curves(model, x, t, layout, [(scores, remove)], f)
    return RemovalCurve(fractions=f, correct=correct, target=t, remove=remove)


class RemovalTest(NamedTuple):
    """From :func:`removal_test`.

    Attributes:
        positive: ``{name: RemovalCurve}``, each ranking's top tokens removed first.
        negative: ``{name: RemovalCurve}``, its bottom tokens removed first.
        random: the curves of ``n_random`` random orders (a fresh order per sample and repeat).
    """

    positive: dict
    negative: dict
    random: list

    @property
    def random_sample_auc(self) -> torch.Tensor:
        """``(B,)`` each sample's AUC under random removal, averaged over the repeats."""
        return torch.stack([c.sample_auc for c in self.random]).mean(0)

    def table(self, n_boot: int = 2000, level: float = 0.95, seed: int = 0) -> list[dict]:
        """One row per ranking and direction, plus one for random removal: the AUC with its
        bootstrap interval over the samples (:func:`vitlab.stats.mean_interval`), and the paired
        difference from random removal (the same samples) with its interval
        (:func:`vitlab.stats.paired_difference`)."""
        from vitlab.stats import mean_interval, paired_difference

        rand = self.random_sample_auc
        pct = f"{level:.0%}"
        low, high = mean_interval(rand, level, n_boot, seed)[1:3]
        rows = [{"ranking": "random", "removed first": "random", "AUC": float(rand.mean()),
                 f"AUC {pct} interval": (low, high), "AUC - random": 0.0, f"difference {pct} interval": (0.0, 0.0)}]
        for direction, curves in (("highest", self.positive), ("lowest", self.negative)):
            for name, curve in curves.items():
                auc = curve.sample_auc
                diff = paired_difference(auc, rand, level, n_boot, seed)
                rows.append({"ranking": name, "removed first": direction, "AUC": float(auc.mean()),
                             f"AUC {pct} interval": tuple(mean_interval(auc, level, n_boot, seed)[1:3]),
                             "AUC - random": diff.value, f"difference {pct} interval": (diff.low, diff.high)})
        return rows


def removal_test(model, x: torch.Tensor, rankings: dict, target=None, fractions=REMOVAL_FRACTIONS,
                 n_random: int = 2, seed: int = 0) -> RemovalTest:
    """The token-removal test of Vilas et al. 2023 (RQ3, RQ4): for each ranking in
    ``rankings`` (``{name: B x num_patches or B x gh x gw scores}``), :func:`removal_curve`
    removing its top tokens first (positive perturbation) and its bottom tokens first
    (negative), and ``n_random`` curves removing tokens in random order (a fresh permutation
    per sample and repeat, from a generator seeded with ``seed``; the paper's code draws 10
    permutations shared by all images). ``target``: int, one per sample, or None
    (predicted). Each curve is what :func:`removal_curve` computes; a (sample, removed set) that
    several curves share (every curve's first point, with nothing removed) runs once. Read the
    result with :meth:`RemovalTest.table`."""
    check_images(x, "removal_test")
    if not isinstance(rankings, dict) or not rankings:
        raise ValueError("rankings must be a non-empty dict {name: B x num_patches scores}")
    positive_int("n_random", n_random)
    t = check_target(target, x.shape[0])
    f = _check_fractions(fractions)
    layout = token_layout(model, x)
    scores = {n: _ranking_scores(r, x.shape[0], layout) for n, r in rankings.items()}
    g = torch.Generator().manual_seed(seed)
    shuffles = [torch.rand(x.shape[0], layout.num_patches, generator=g) for _ in range(n_random)]
    orders = ([(s, "highest") for s in scores.values()] + [(s, "lowest") for s in scores.values()]
              + [(s, "highest") for s in shuffles])
    t, correct = _removal_curves(model, x, t, layout, orders, f)
    curves = [RemovalCurve(fractions=f, correct=c, target=t, remove=r) for c, (_, r) in zip(correct, orders)]
    R = len(scores)
    return RemovalTest(positive=dict(zip(scores, curves[:R])), negative=dict(zip(scores, curves[R:2 * R])),
                       random=curves[2 * R:])


def _removal_curves(model, x: torch.Tensor, t, layout: TokenLayout, orders: list, fractions: torch.Tensor):
    """For each ``(scores, remove)`` in ``orders``: ``B x F`` bool, whether each sample is still
    predicted as its target with ``fractions[i]`` of its tokens removed in that order (what
    :func:`token_removal` computes, fraction by fraction). Returns ``(target, [B x F, ...])``.

    Every (sample, removed set) is run once, however many orders and fractions share it (with
    nothing removed, every order does). Where removing a token cannot change anything but what
    attends to it (:func:`_drops_removed_tokens`), the removed tokens are left out of the
    sequence instead of masked: the model then computes the kept tokens only, from a patch
    embedding computed once per sample. Both ways nothing reads a removed token."""
    B, Pn = x.shape[0], layout.num_patches
    removed = torch.stack([torch.stack([_removed_by_rank(s, float(v), r) for v in fractions.tolist()])
                           for s, r in orders])                                  # orders x F x B x Pn
    rows = torch.cat([torch.arange(B).expand(*removed.shape[:3])[..., None], removed.long()], -1)
    unique, inverse = torch.unique(rows.reshape(-1, Pn + 1), dim=0, return_inverse=True)
    scene, gone = unique[:, 0], unique[:, 1:].bool()
    with torch.no_grad():
        if t is None:
            with record(model, eval_mode=True, capture=()):
                t = logits_of(run_images(model, x)).argmax(-1)
        t = t.cpu()
        if _drops_removed_tokens(model, layout):
            logits = _kept_token_logits(model, x, scene, gone, layout)
        else:
            logits = torch.cat([_remove_tokens(model, x[scene[i:i + B]], gone[i:i + B], t[scene[i:i + B]], layout,
                                               "removal_curve").logits.cpu() for i in range(0, len(scene), B)])
    t = resolve_target(t, logits[:B]).cpu()
    correct = (logits.argmax(-1) == t[scene])[inverse].reshape(removed.shape[:3])   # orders x F x B
    return t, list(correct.transpose(1, 2))


def _drops_removed_tokens(model, layout: TokenLayout) -> bool:
    """Whether removing image tokens from attention is the same as leaving them out of the
    sequence: a timm ``VisionTransformer`` of plain ``Block`` / ``ResPostBlock`` blocks (their
    tokens meet only in self-attention), whose output reads the class token alone (``global_pool
    = "token"``, no attention pool), all with timm's own forward. A removed token then only
    computes states that nothing reads."""
    try:
        from timm.layers import Attention
        from timm.models.vision_transformer import Block, ResPostBlock, VisionTransformer
    except ImportError:  # pragma: no cover - timm is a dependency
        return False
    V = VisionTransformer
    return (isinstance(model, V) and layout.num_prefix > 0 and model.num_prefix_tokens == layout.num_prefix
            and all(getattr(type(model), name, None) is getattr(V, name, None)
                    for name in ("forward_features", "forward_head", "pool", "_pos_embed", "forward"))
            and getattr(model, "global_pool", None) == "token" and getattr(model, "attn_pool", None) is None
            and all(type(b) in (Block, ResPostBlock) and type(b.attn) is Attention for b in model.blocks))


def _kept_token_logits(model, x: torch.Tensor, scene: torch.Tensor, gone: torch.Tensor, layout: TokenLayout,
                       max_tokens: int = 8192) -> torch.Tensor:
    """Logits of ``model`` (see :func:`_drops_removed_tokens`) on ``x[scene[i]]`` with the image
    tokens ``gone[i]`` left out, for every row i (rows with as many tokens removed run together,
    at most ``max_tokens`` tokens a forward: on a CPU, chunks whose activations stay in the cache
    run faster than larger ones). The attention is computed eagerly, as under a mask. The last
    block computes its MLP for the prefix tokens only: the output reads the class token, and
    after the last attention no token reads another."""
    P = layout.num_prefix
    out = None
    *first, last = model.blocks
    with torch.no_grad(), record(model, eval_mode=True, capture=(), attention_edit=lambda layer, num_tokens: None):
        tokens = model.norm_pre(model.patch_drop(model._pos_embed(model.patch_embed(x))))   # B x N x D, once
        counts = gone.sum(1)
        for k in counts.unique().tolist():
            rows = torch.nonzero(counts == k)[:, 0]
            kept = torch.nonzero(~gone[rows])[:, 1].view(len(rows), gone.shape[1] - k) + P   # ascending
            index = torch.cat([torch.arange(P).expand(len(rows), P), kept], 1)
            step = max(1, max_tokens // index.shape[1])
            for i in range(0, len(rows), step):
                r = rows[i:i + step]
                h = tokens[scene[r].to(tokens.device)[:, None], index[i:i + step].to(tokens.device)]
                for blk in first:
                    h = blk(h)
                logits = model.forward_head(model.norm(_prefix_rows_of_block(last, h, P))).cpu()
                if out is None:
                    out = logits.new_empty(len(scene), logits.shape[-1])
                out[r] = logits
    return out


def _prefix_rows_of_block(block: nn.Module, h: torch.Tensor, P: int) -> torch.Tensor:
    """What timm's ``Block`` / ``ResPostBlock`` ``block`` outputs for the first ``P`` tokens of
    ``h`` (``B x N x D``): its attention over every token, then the residual additions and the
    MLP for those ``P`` rows only (both are per token). ``B x P x D``."""
    from timm.models.vision_transformer import ResPostBlock

    if isinstance(block, ResPostBlock):   # x + norm1(attn(x)), then x + norm2(mlp(x))
        h = h[:, :P] + block.drop_path1(block.norm1(block.attn(h)[:, :P]))
        return h + block.drop_path2(block.norm2(block.mlp(h)))
    h = h[:, :P] + block.drop_path1(block.ls1(block.attn(block.norm1(h))[:, :P]))   # pre-norm Block
    return h + block.drop_path2(block.ls2(block.mlp(block.norm2(h))))


# --------------------------------------------------------------------------------------
# The paper's probes: one ridge regression per block and token position (RQ4)
# --------------------------------------------------------------------------------------
@dataclass(eq=False)
class TokenProbes:
    """What :func:`ridge_probes` returns: one linear readout per block and token position,
    ``scores = h @ weight[l, n].T + bias[l, n]``.

    Attributes:
        weight: ``L x N x C x D``; bias: ``L x N x C``; alpha: the ridge penalty.
    """

    weight: torch.Tensor
    bias: torch.Tensor
    alpha: float

    def scores(self, states: torch.Tensor) -> torch.Tensor:
        """``B x L x N x D`` states (as ``Projection.block_outputs``) -> ``B x L x N x C``."""
        L, N, C, D = self.weight.shape
        if not isinstance(states, torch.Tensor) or states.ndim != 4 or tuple(states.shape[1:]) != (L, N, D):
            raise ValueError(f"states must be B x {L} x {N} x {D} (blocks x tokens x features, as the probes "
                             f"were fitted), got {tuple(getattr(states, 'shape', ()))}")
        W, b = self.weight.to(states.device, states.dtype), self.bias.to(states.device, states.dtype)
        return torch.einsum("blnd,lncd->blnc", states, W) + b


def ridge_probes(states: torch.Tensor, labels, num_classes: int, alpha: float = 1.0) -> TokenProbes:
    """The linear probes of Vilas et al. 2023 (RQ4, their ``linear_probing/prober.py``): for
    every block l and token position n its own ridge regression from the ``D`` features of
    that token to ``C`` targets, +1 for the image's class and -1 for every other, with an
    intercept (features and targets centred, the intercept not penalised), penalty ``alpha``
    (the paper's: 1.0, fitted on 10 images per class). ``states``: ``M x L x N x D`` (the
    training images' ``Projection.block_outputs``), ``labels``: ``(M,)`` classes. Solved in
    closed form, ``w = (Xc^T Xc + alpha I)^-1 Xc^T Yc``, in float64."""
    if not isinstance(states, torch.Tensor) or states.ndim != 4 or states.shape[0] < 2:
        raise ValueError(f"states must be an M x L x N x D tensor with M >= 2 images, got "
                         f"{tuple(getattr(states, 'shape', ()))}")
    if not bool(torch.isfinite(states).all()):
        raise ValueError("states must be finite (no NaN or inf)")
    C = positive_int("num_classes", num_classes)
    y = torch.as_tensor(labels)
    if y.dtype == torch.bool or y.is_floating_point() or tuple(y.shape) != (states.shape[0],):
        raise ValueError(f"labels must be {states.shape[0]} integer classes (one per image), got dtype {y.dtype}, "
                         f"shape {tuple(y.shape)}")
    if bool(((y < 0) | (y >= C)).any()):
        raise ValueError(f"labels must be classes in 0 .. {C - 1}, got {int(y.min())} .. {int(y.max())}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 < alpha < float("inf"):
        raise ValueError(f"alpha must be a positive finite number, got {alpha!r}")
    X = states.detach().double().permute(1, 2, 0, 3)  # L x N x M x D
    Y = -torch.ones(states.shape[0], C, dtype=torch.float64)
    Y[torch.arange(states.shape[0]), y.long().cpu()] = 1.0
    Y = Y.to(X.device)
    x_mean, y_mean = X.mean(2, keepdim=True), Y.mean(0)
    Xc, Yc = X - x_mean, Y - y_mean
    D = X.shape[-1]
    gram = Xc.transpose(-1, -2) @ Xc + alpha * torch.eye(D, dtype=torch.float64, device=X.device)
    W = torch.linalg.solve(gram, Xc.transpose(-1, -2) @ Yc)  # L x N x D x C
    bias = y_mean - (x_mean @ W).squeeze(-2)  # L x N x C
    return TokenProbes(weight=W.transpose(-1, -2).to(states.dtype), bias=bias.to(states.dtype), alpha=float(alpha))


# --------------------------------------------------------------------------------------
# Tokens on and off the object: the paper's permutation test (Sec. 4, ImageNet-S masks)
# --------------------------------------------------------------------------------------
class PermutationTest(NamedTuple):
    """From :func:`permutation_test`.

    Attributes:
        difference: ``mean(first) - mean(second)``.
        p_greater: share of label permutations whose difference is at least as large
            (one-sided: is ``first`` higher?), with the +1 correction ``(1 + k) / (1 + n)``.
        p_less: the same for "at least as small" (is ``first`` lower?).
        p_two_sided: for ``|difference|`` at least as large.
        n_perm: the number of permutations.
    """

    difference: float
    p_greater: float
    p_less: float
    p_two_sided: float
    n_perm: int


def permutation_test(first, second, n_perm: int = 300, seed: int = 0) -> PermutationTest:
    """Does the mean of ``first`` differ from that of ``second``? A permutation test on the
    pooled values (Vilas et al. 2023, their ``compute_context_diff``: class- vs context-labelled
    image tokens' identifiability, 300 shuffles; they report the share of shuffles whose
    difference exceeds the observed one, without the +1 correction used here). ``first``,
    ``second``: 1-D values (e.g. every object token's and every background token's
    identifiability in one block, pooled over images); shuffles from a generator seeded with
    ``seed``."""
    a = torch.as_tensor(first, dtype=torch.float64).flatten()
    b = torch.as_tensor(second, dtype=torch.float64).flatten()
    if a.numel() == 0 or b.numel() == 0:
        raise ValueError(f"permutation_test needs values in both groups, got {a.numel()} and {b.numel()}")
    if not bool(torch.isfinite(a).all() and torch.isfinite(b).all()):
        raise ValueError("permutation_test: the values must be finite (no NaN or inf)")
    positive_int("n_perm", n_perm)
    observed = float(a.mean() - b.mean())
    pooled, n = torch.cat([a, b]), a.numel()
    g = torch.Generator().manual_seed(seed)
    diffs = torch.empty(n_perm, dtype=torch.float64)
    for i in range(n_perm):
        shuffled = pooled[torch.randperm(pooled.numel(), generator=g)]
        diffs[i] = shuffled[:n].mean() - shuffled[n:].mean()
    eps = 1e-12 * max(1.0, abs(observed))  # a shuffle that reproduces the split counts as "as large"
    share = lambda hits: (1 + int(hits.sum())) / (1 + n_perm)  # noqa: E731
    return PermutationTest(difference=observed, p_greater=share(diffs >= observed - eps),
                           p_less=share(diffs <= observed + eps),
                           p_two_sided=share(diffs.abs() >= abs(observed) - eps), n_perm=n_perm)


# --------------------------------------------------------------------------------------
# Memory agreement per group of tokens, over a set of samples (a table per block)
# --------------------------------------------------------------------------------------
class GroupAgreement(NamedTuple):
    """From :func:`agreement_by_group`.

    Attributes:
        groups: ``{name: B x L}`` each sample's mean :func:`memory_agreement` over the group's
            tokens, per block (NaN where the sample has no token of the group).
        chance: ``B x L`` the share of the block's memories whose value's top class is the
            sample's target: what a token's ``k`` memories agree on when drawn at random.
        target: ``(B,)`` the class per sample.
        k: the memories counted per token.
        sublayer: ``"mlp"`` or ``"attention"``.
    """

    groups: dict
    chance: torch.Tensor
    target: torch.Tensor
    k: int
    sublayer: str

    def table(self, difference: dict | None = None, spec: str = ".2f", level: float = 0.95,
              n_boot: int = 2000, seed: int = 0) -> list[dict]:
        """One row per block: each group's mean over the samples that have its tokens with the
        bootstrap interval (:func:`vitlab.stats.mean_interval`), ``"chance"`` (the mean of
        :attr:`chance`), and for each ``{column: (group_a, group_b)}`` of ``difference`` the
        paired difference a - b over the samples that have both (:func:`vitlab.stats.paired_difference`).
        Numbers formatted with ``spec`` (differences signed); ``"-"`` where no sample has the group."""
        from vitlab.stats import mean_interval, paired_difference, where_defined

        difference = {} if difference is None else difference
        if not isinstance(difference, dict) or any(
                not isinstance(p, (tuple, list)) or len(p) != 2 or any(g not in self.groups for g in p)
                for p in difference.values()):
            raise ValueError(f"difference must be {{column: (group_a, group_b)}} with groups among "
                             f"{list(self.groups)}, got {difference!r}")
        rows = []
        for b in range(self.chance.shape[1]):
            row = {"block": b}
            for name, v in self.groups.items():
                (defined,) = where_defined(v[:, b])
                row[name] = mean_interval(defined, level, n_boot, seed).format(spec) if defined.size else "-"
            row["chance"] = f"{float(self.chance[:, b].mean()):{spec}}"
            for column, (a, c) in difference.items():
                pa, pc = where_defined(self.groups[a][:, b], self.groups[c][:, b])
                row[column] = paired_difference(pa, pc, level, n_boot, seed).format("+" + spec) if pa.size else "-"
            rows.append(row)
        return rows


def _group_weights(selection, name: str, B: int, layout: TokenLayout) -> torch.Tensor:
    """A group of tokens as a ``B x N`` 0/1 float tensor over all tokens (prefix first)."""
    N = layout.num_tokens
    if isinstance(selection, numbers.Integral) and not isinstance(selection, (bool, np.bool_)):
        if not -N <= int(selection) < N:
            raise ValueError(f"group {name!r}: token index {int(selection)} is outside 0 .. {N - 1}")
        w = torch.zeros(B, N)
        w[:, int(selection)] = 1.0
        return w
    m = torch.as_tensor(selection) if isinstance(selection, (torch.Tensor, np.ndarray)) else None
    if (m is None or m.dtype != torch.bool or m.ndim != 2 or m.shape[0] != B
            or m.shape[1] not in (N, layout.num_patches)):
        raise ValueError(f"group {name!r} must be a token index (int) or a bool mask of B x {layout.num_patches} "
                         f"image tokens or B x {N} tokens (B = {B}), got "
                         f"{type(selection).__name__} {tuple(getattr(selection, 'shape', ()))} "
                         f"{getattr(selection, 'dtype', '')}".rstrip())
    w = torch.zeros(B, N)
    w[:, N - m.shape[1]:] = m.cpu().float()
    return w


def agreement_by_group(model, x: torch.Tensor, groups: dict, target=None, k: int = 10, mode: str = "norm",
                       sublayer: str = "mlp", batch_size: int = 100) -> GroupAgreement:
    """:func:`memory_agreement` of every block, averaged per sample over each group of tokens
    (Vilas et al. 2023, key-value memories, Sec. 5 and Fig. 1b: do the memories most active on
    a token write its class?), with the chance level per sample and block.

    ``groups``: ``{name: tokens}``, each a token index (``0``: the class token, in every sample)
    or a bool mask, ``B x num_patches`` (image tokens, e.g. those on an object) or ``B x N``
    (all tokens, prefix first). ``target``: int, one per sample, or None (the predicted class).
    Run in batches of ``batch_size`` samples (one forward each; the result does not depend on
    it). Read the result with :meth:`GroupAgreement.table`. The model is unchanged."""
    check_images(x, "agreement_by_group")
    t = check_target(target, x.shape[0])
    positive_int("k", k)
    positive_int("batch_size", batch_size)
    if sublayer not in SUBLAYERS:
        raise ValueError(f"sublayer must be one of {SUBLAYERS}, got {sublayer!r}")
    if not isinstance(groups, dict) or not groups:
        raise ValueError("groups must be a non-empty dict {name: token index or bool mask of tokens}")
    layout = token_layout(model, x)
    weights = {name: _group_weights(sel, name, x.shape[0], layout) for name, sel in groups.items()}
    parts = [memory_agreement(model, x[i:i + batch_size], None, None if t is None else t[i:i + batch_size],
                              k, mode, sublayer) for i in range(0, x.shape[0], batch_size)]
    agreement = torch.cat([p.agreement.cpu() for p in parts])  # B x L x N
    target_used = torch.cat([p.target.cpu() for p in parts])
    by_group = {name: (agreement * w[:, None]).sum(-1) / w.sum(-1, keepdim=True)  # NaN: no token
                for name, w in weights.items()}
    tops = [unit_top_classes(model, b, 1, mode, sublayer)[:, 0].cpu() for b in range(agreement.shape[1])]
    chance = torch.stack([(top[None, :] == target_used[:, None]).to(agreement.dtype).mean(-1) for top in tops], 1)
    return GroupAgreement(groups=by_group, chance=chance, target=target_used, k=k, sublayer=sublayer)


__getattr__ = replaced_names("vitlab.projection", {"bootstrap_interval": "vitlab.stats.mean_interval"})
