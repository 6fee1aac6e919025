"""``shapes-visualbert``: Hugging Face VisualBERT on the frozen ``shapes-vit-tiny``.

VisualBERT (Li et al. 2019, "VisualBERT: A Simple and Performant Baseline for Vision and
Language") is the *single-stream* model of Chefer, Gur & Wolf (2021): the question's tokens and
the image's tokens are concatenated into one sequence and run through one BERT stack of
self-attention layers, where every token attends to every other, text or image.

:class:`ShapesVisualBertForQuestionAnswering` is a :class:`transformers.VisualBertForQuestionAnswering`
whose visual embeddings (``visual_embeds``) are, per image, the 49 last-block patch tokens of
the frozen ``shapes-vit-tiny`` (192-d, after its final LayerNorm; :func:`vitlab.shapes.bimodal.backbone_tokens`),
each with its grid cell ``(x0, y0, x1, y1)`` in [0, 1] and (``config.patch_onehot``, the shipped
model) its patch index as a one-hot vector appended (192 + 4 + 49 = 245-d), both multiplied by
``config.position_scale`` (8 for the shipped model, so that a token's position weighs about as
much as its 192 unit-scale features): VisualBERT gives its
visual tokens no position of their own (its visual position ids are all 0 without a text
alignment), so these play the part of LXMERT's ``visual_pos``. Given ``pixel_values`` it
computes them itself; ``visual_feats`` (the 192-d tokens) get them appended; given
``visual_embeds`` it is plain VisualBERT. Questions are encoded by the same word-level tokenizer
as ``shapes-lxmert`` (``model.encode``), answers are ``model.config.id2label``
(:data:`vitlab.shapes.qa.ANSWERS`), and, as in Hugging Face's VisualBERT VQA head and the
original code, the answer is read off the last question token before ``[SEP]`` (index
``attention_mask.sum(1) - 2``; here the ``?``), not off ``[CLS]``.

Weight files hold everything but the backbone (as :func:`vitlab.shapes.bimodal.save_bimodal`
does for the other two bimodal models), with the architecture, vocabulary, answers and the
SHA-256 of the backbone file in the metadata; loading refuses another backbone.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn
from transformers import VisualBertConfig, VisualBertForQuestionAnswering

from vitlab.models import WEIGHTS_DIR
from vitlab.shapes.bimodal import (
    BACKBONE_PATH, FrozenBackbone, ShapesLxmertForQuestionAnswering, _file_sha256, _load_backbone,
)
from vitlab.shapes.model import refuse_arch
from vitlab.shapes.qa import ANSWERS, WordTokenizer

__all__ = [
    "VISUALBERT_ARCH", "VISUALBERT_PATH", "ShapesVisualBertForQuestionAnswering", "answer_index",
    "build_shapes_visualbert", "load_shapes_visualbert", "save_shapes_visualbert",
]

#: Where the shipped weights live (inside the installed package).
VISUALBERT_PATH = WEIGHTS_DIR / "shapes-visualbert.safetensors"
_RETRAIN = "python -m vitlab.shapes.train_visualbert"

#: VisualBERT size of ``shapes-visualbert`` (``VisualBertConfig`` keywords; vocabulary, answers
#: and the visual embedding width come from the tokenizer, :data:`ANSWERS` and the backbone).
#: Weights start with std 0.2, not BERT's 0.02, as for ``shapes-lxmert`` (whose pilots stayed at
#: the answers' prior with 0.02 and 0.1; see its model card).
VISUALBERT_ARCH: dict = dict(
    hidden_size=64, num_attention_heads=4, intermediate_size=256, num_hidden_layers=4,
    max_position_embeddings=16, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    initializer_range=0.2, patch_onehot=True, position_scale=8.0,
)


def answer_index(attention_mask: torch.Tensor) -> torch.Tensor:
    """The token VisualBERT's question-answering head reads, per sample: ``attention_mask.sum(1) - 2``
    (the last text token before ``[SEP]``), as ``VisualBertForQuestionAnswering.forward`` computes it."""
    return attention_mask.sum(1).long() - 2


class ShapesVisualBertForQuestionAnswering(FrozenBackbone, VisualBertForQuestionAnswering):
    """VisualBERT question answering over the patch tokens of a frozen shapes ViT.

    ``forward(pixel_values=..., input_ids=..., attention_mask=...)`` runs the backbone and passes
    its tokens, each with its grid cell appended, as ``visual_embeds``; ``visual_feats`` (the
    backbone's tokens, ``B x 49 x 192``) instead of ``pixel_values`` skips the backbone; every
    other argument is :meth:`VisualBertForQuestionAnswering.forward`'s. ``model.backbone`` is the
    ViT; ``model.tokenizer`` encodes questions. ``attention_mask`` is required (the head reads the
    token at ``attention_mask.sum(1) - 2``).
    """

    def __init__(self, config: VisualBertConfig, backbone: nn.Module, tokenizer: WordTokenizer):
        super().__init__(config)
        self._attach_backbone(backbone, tokenizer)

    # ``(tokens B x N x C, cells B x N x 4)`` for images, and ``(input_ids, attention_mask)`` for
    # questions: the same as shapes-lxmert's (the same backbone, grid and tokenizer)
    visual_inputs = ShapesLxmertForQuestionAnswering.visual_inputs
    encode = ShapesLxmertForQuestionAnswering.encode

    def visual_embeddings(self, feats: torch.Tensor) -> torch.Tensor:
        """``visual_embeds`` for backbone tokens ``B x N x C``: each token with its cell (4) and, with
        ``config.patch_onehot``, its patch index one-hot (N), both times ``config.position_scale``
        (1 when absent): ``B x N x (C + 4 [+ N])``."""
        B, N, _ = feats.shape
        scale = float(getattr(self.config, "position_scale", 1.0))
        parts = [feats, scale * self.patch_boxes.to(feats.dtype).expand(B, -1, -1)]
        if getattr(self.config, "patch_onehot", False):
            parts.append(scale * torch.eye(N, dtype=feats.dtype, device=feats.device).expand(B, -1, -1))
        return torch.cat(parts, dim=-1)

    def forward(self, input_ids=None, attention_mask=None, *args, pixel_values: torch.Tensor | None = None,
                visual_feats: torch.Tensor | None = None, **kwargs):
        given = [name for name, v in (("pixel_values", pixel_values), ("visual_feats", visual_feats),
                                      ("visual_embeds", kwargs.get("visual_embeds"))) if v is not None]
        if len(given) != 1:
            raise ValueError("shapes-visualbert takes one of pixel_values (images), visual_feats (the backbone's "
                             f"tokens) or visual_embeds; got {given or 'none'}")
        if pixel_values is not None:
            visual_feats = self.visual_inputs(pixel_values)[0]
        if visual_feats is not None:
            kwargs["visual_embeds"] = self.visual_embeddings(visual_feats)
        if attention_mask is None:
            raise ValueError("shapes-visualbert needs the questions' attention_mask (model.encode gives it): its "
                             "answer is read off token attention_mask.sum(1) - 2")
        n_images = kwargs["visual_embeds"].shape[0]
        if input_ids is not None and input_ids.shape[0] != n_images:
            raise ValueError(f"{input_ids.shape[0]} questions for {n_images} images: "
                             "give one question per image (repeat the images to ask several)")
        return super().forward(input_ids, attention_mask, *args, **kwargs)

    @torch.no_grad()
    def answer(self, pixel_values: torch.Tensor, questions) -> list[str]:
        """The answer to each question about the matching image (one question per image)."""
        ids, mask = self.encode(questions)
        logits = self(pixel_values=pixel_values, input_ids=ids, attention_mask=mask).logits
        return [self.config.id2label[int(i)] for i in logits.argmax(-1)]


def _patches(backbone: nn.Module) -> int:
    gh, gw = backbone.patch_embed.grid_size
    return int(gh) * int(gw)


def _config(arch: dict, vocab_size: int, feat_dim: int, n_patches: int) -> VisualBertConfig:
    extra = n_patches if arch.get("patch_onehot", False) else 0
    return VisualBertConfig(
        vocab_size=vocab_size, visual_embedding_dim=feat_dim + 4 + extra, num_labels=len(ANSWERS),
        id2label=dict(enumerate(ANSWERS)), label2id={a: i for i, a in enumerate(ANSWERS)}, **arch,
    )


def build_shapes_visualbert(arch: dict | None = None, *, backbone: nn.Module | None = None,
                            tokenizer: WordTokenizer | None = None) -> ShapesVisualBertForQuestionAnswering:
    """A randomly initialised ``shapes-visualbert`` (train mode) on the shipped, frozen ``shapes-vit-tiny``.

    ``arch``: ``VisualBertConfig`` keywords overriding :data:`VISUALBERT_ARCH`.
    """
    backbone = _load_backbone() if backbone is None else backbone
    tokenizer = WordTokenizer.for_templates() if tokenizer is None else tokenizer
    cfg = _config({**VISUALBERT_ARCH, **(arch or {})}, len(tokenizer), backbone.embed_dim, _patches(backbone))
    return ShapesVisualBertForQuestionAnswering(cfg, backbone, tokenizer).train()


def save_shapes_visualbert(model: ShapesVisualBertForQuestionAnswering, path: str | Path, *, arch: dict,
                           extra: dict | None = None, backbone_path: str | Path = BACKBONE_PATH) -> None:
    """Write the model's weights (fp32) without its backbone; metadata as the module docstring says."""
    from safetensors.torch import save_file

    if not isinstance(model, ShapesVisualBertForQuestionAnswering):
        raise TypeError(f"expected a shapes-visualbert model, got {type(model).__name__}")
    state = {k: v.detach().float().contiguous().cpu() if v.is_floating_point() else v.detach().contiguous().cpu()
             for k, v in model.state_dict().items() if not k.startswith("backbone.")}
    meta = {
        "format": "pt", "vitlab_model": "shapes-visualbert", "arch": json.dumps(arch),
        "backbone": "shapes-vit-tiny", "backbone_sha256": _file_sha256(Path(backbone_path)),
        "vocabulary": json.dumps(model.tokenizer.vocab[len(WordTokenizer.SPECIALS):]),
        "answers": json.dumps(ANSWERS),
    }
    meta.update({k: json.dumps(v) for k, v in (extra or {}).items()})
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    save_file(state, str(path), metadata=meta)


def load_shapes_visualbert(pretrained: bool = True, *, weights_path: str | Path | None = None,
                           **arch) -> ShapesVisualBertForQuestionAnswering:
    """``shapes-visualbert`` in eval mode (``vitlab.load_model("shapes-visualbert")``).

    Args:
        pretrained: load the trained weights (``vitlab/weights/shapes-visualbert.safetensors`` unless
            ``weights_path`` is given); ``False``: the same architecture, randomly initialised (on
            the trained backbone), with ``arch`` overriding :data:`VISUALBERT_ARCH`.

    Raises:
        FileNotFoundError: the weights file (or the backbone's) is missing, with the command to retrain it.
        ValueError: the file was not written for this model, or for another backbone.
    """
    from safetensors import safe_open
    from safetensors.torch import load_file

    if not pretrained:
        return build_shapes_visualbert(arch).eval()
    refuse_arch(arch)
    path = Path(weights_path) if weights_path is not None else VISUALBERT_PATH
    if not path.is_file():
        raise FileNotFoundError(f"shapes-visualbert weights not found at {path}; train them with `{_RETRAIN} --out "
                                f"{path}` (at most 15 minutes on 2 CPU cores), or use pretrained=False for random weights")
    if not BACKBONE_PATH.is_file():
        raise FileNotFoundError(f"shapes-visualbert runs on shapes-vit-tiny, whose weights are missing at "
                                f"{BACKBONE_PATH}; retrain them with `python -m vitlab.shapes.train`")
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
    if meta.get("vitlab_model") != "shapes-visualbert":
        raise ValueError(f"{path} is not a shapes-visualbert weights file (its metadata names "
                         f"{meta.get('vitlab_model')!r}); write it with `{_RETRAIN}`")
    if meta.get("backbone_sha256") != _file_sha256(BACKBONE_PATH):
        raise ValueError(f"{path} was trained on another shapes-vit-tiny than the one at {BACKBONE_PATH} (SHA-256 "
                         f"differs); its weights do not fit these features: retrain it with `{_RETRAIN}`")
    backbone = _load_backbone()
    tokenizer = WordTokenizer(json.loads(meta["vocabulary"]))
    model = ShapesVisualBertForQuestionAnswering(_config(json.loads(meta["arch"]), len(tokenizer), backbone.embed_dim,
                                                         _patches(backbone)),
                                                 backbone, tokenizer)
    missing, unexpected = model.load_state_dict(load_file(str(path)), strict=False)
    missing = [k for k in missing if not k.startswith("backbone.")]
    if missing or unexpected:
        raise ValueError(f"{path} does not fit the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
    return model.eval()
