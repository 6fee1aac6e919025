"""``shapes-lxmert`` and ``shapes-detr``: Hugging Face LXMERT and DETR on the frozen ``shapes-vit-tiny``.

No pretrained LXMERT or DETR can be downloaded here, so vitlab trains two tiny models of these
architectures on its own scenes, with the shipped ViT (:mod:`vitlab.shapes.model`) as their
frozen visual backbone. The ViT's last-block patch tokens (after its final LayerNorm), a
7 x 7 grid of 192-d vectors, are what each model sees of the image:

- :class:`ShapesLxmertForQuestionAnswering` is a :class:`transformers.LxmertForQuestionAnswering`
  whose 49 "regions" (``visual_feats``) are those tokens and whose region boxes (``visual_pos``)
  are the tokens' grid cells, normalised to [0, 1] (:func:`grid_boxes`). Given ``pixel_values``
  it computes both itself; given ``visual_feats`` / ``visual_pos`` it is plain LXMERT. Questions
  are encoded by its word-level tokenizer (:class:`vitlab.shapes.qa.WordTokenizer`,
  ``model.tokenizer``), answers are ``model.config.id2label`` (:data:`vitlab.shapes.qa.ANSWERS`).
- ``shapes-detr`` is a plain :class:`transformers.DetrForObjectDetection` whose backbone module
  (``model.model.backbone``, a ResNet in the original) is replaced by :class:`ViTFeatureMap`:
  the tokens as a ``192 x 7 x 7`` feature map. Its classes are the shapes
  (``config.id2label``); boxes are ``(cx, cy, w, h)`` normalised to [0, 1], as in DETR.

Both keep the backbone in eval mode and its parameters frozen (``requires_grad=False``); the
backbone is part of the forward pass, so gradients still flow through its activations (for
relevance through the ViT's own attention, ask for gradients of the input or hook it).

Weight files (:func:`save_bimodal`) hold everything *but* the backbone, plus the architecture,
vocabulary and labels in the safetensors metadata and the SHA-256 of the ``shapes-vit-tiny``
file they were trained on; loading rebuilds the backbone from that shipped file and refuses a
different one (the heads would be meaningless on other features).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn
from transformers import DetrConfig, DetrForObjectDetection, LxmertConfig, LxmertForQuestionAnswering

from vitlab.models import WEIGHTS_DIR
from vitlab.models import file_sha256 as _file_sha256
from vitlab.shapes.data import CLASSES
from vitlab.shapes.model import MEAN, STD, refuse_arch
from vitlab.shapes.model import WEIGHTS_PATH as BACKBONE_PATH
from vitlab.shapes.qa import ANSWERS, WordTokenizer

__all__ = [
    "DETR_ARCH",
    "DETR_PATH",
    "LXMERT_ARCH",
    "LXMERT_PATH",
    "ShapesLxmertForQuestionAnswering",
    "ViTFeatureMap",
    "backbone_tokens",
    "build_shapes_detr",
    "build_shapes_lxmert",
    "grid_boxes",
    "load_shapes_detr",
    "load_shapes_lxmert",
    "save_bimodal",
]

#: Where the shipped weights live (inside the installed package).
LXMERT_PATH = WEIGHTS_DIR / "shapes-lxmert.safetensors"
DETR_PATH = WEIGHTS_DIR / "shapes-detr.safetensors"

#: LXMERT size of ``shapes-lxmert`` (``LxmertConfig`` keywords; vocabulary, answers and the
#: visual feature width come from the tokenizer, :data:`ANSWERS` and the backbone). Weights are
#: initialised with std 0.2, not BERT's 0.02: with 0.02 the attention starts uniform and, in
#: the pilots, the answers stayed at their prior for 750+ steps (see the model card).
LXMERT_ARCH: dict = dict(
    hidden_size=64, num_attention_heads=4, intermediate_size=256,
    l_layers=2, x_layers=2, r_layers=2, max_position_embeddings=16,
    hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, initializer_range=0.2,
)

#: DETR size of ``shapes-detr`` (``DetrConfig`` keywords; classes from :data:`CLASSES`). Linear
#: layers start with std 0.1 rather than 0.02 (lower loss in the pilots, see the model card).
DETR_ARCH: dict = dict(
    d_model=128, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
    encoder_ffn_dim=512, decoder_ffn_dim=512, num_queries=6, dropout=0.0, auxiliary_loss=True, init_std=0.1,
)

_RETRAIN = {
    "shapes-lxmert": "python -m vitlab.shapes.train_lxmert",
    "shapes-detr": "python -m vitlab.shapes.train_detr",
}


# ---------------------------------------------------------------------------- backbone
def _load_backbone(path: Path | None = None) -> nn.Module:
    from vitlab.shapes.model import load_shapes_vit

    vit = load_shapes_vit(weights_path=path)
    vit.requires_grad_(False)
    return vit.eval()


def backbone_tokens(vit: nn.Module, pixel_values: torch.Tensor) -> torch.Tensor:
    """The ViT's last-block patch tokens after its final LayerNorm: ``B x (gh*gw) x C``."""
    feats = vit.forward_features(pixel_values)          # B x (prefix + gh*gw) x C
    return feats[:, vit.num_prefix_tokens :]


def grid_boxes(grid: tuple[int, int]) -> torch.Tensor:
    """Boxes of the cells of a ``gh x gw`` patch grid, ``(gh*gw) x 4`` as ``(x0, y0, x1, y1)``
    normalised to [0, 1], row by row (token order) — LXMERT's ``visual_pos`` for patch tokens."""
    gh, gw = grid
    ys, xs = torch.meshgrid(torch.arange(gh, dtype=torch.float32), torch.arange(gw, dtype=torch.float32), indexing="ij")
    xs, ys = xs.reshape(-1), ys.reshape(-1)
    return torch.stack([xs / gw, ys / gh, (xs + 1) / gw, (ys + 1) / gh], dim=1)


def _data_config(vit: nn.Module) -> dict:
    """The backbone's preprocessing, as a timm data config (for :func:`vitlab.preprocess`)."""
    cfg = vit.pretrained_cfg
    return {k: cfg[k] for k in ("input_size", "mean", "std", "interpolation", "crop_pct", "crop_mode")}


# ---------------------------------------------------------------------------- LXMERT
class FrozenBackbone:
    """What the shapes question-answering models share: a frozen ViT (``self.backbone``, kept in
    eval mode whatever ``train`` is asked), its question tokenizer, its data config and the boxes of
    its patch grid (``patch_boxes``)."""

    def _attach_backbone(self, backbone: nn.Module, tokenizer: WordTokenizer) -> None:
        backbone.requires_grad_(False)
        self.backbone = backbone.eval()
        self.tokenizer = tokenizer
        self.vitlab_data_config = _data_config(backbone)
        self.register_buffer("patch_boxes", grid_boxes(tuple(backbone.patch_embed.grid_size)), persistent=False)

    def train(self, mode: bool = True):
        super().train(mode)
        self.backbone.eval()  # frozen: its BatchNorm statistics must not move
        return self


class ShapesLxmertForQuestionAnswering(FrozenBackbone, LxmertForQuestionAnswering):
    """LXMERT question answering over the patch tokens of a frozen shapes ViT.

    ``forward(pixel_values=..., input_ids=..., attention_mask=...)`` runs the backbone
    (:func:`backbone_tokens`) and passes its tokens as ``visual_feats`` with their grid boxes
    as ``visual_pos``; every other argument is :meth:`LxmertForQuestionAnswering.forward`'s.
    ``model.backbone`` is the ViT; ``model.tokenizer`` encodes questions.
    """

    def __init__(self, config: LxmertConfig, backbone: nn.Module, tokenizer: WordTokenizer):
        super().__init__(config)
        self._attach_backbone(backbone, tokenizer)

    def visual_inputs(self, pixel_values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(visual_feats B x N x C, visual_pos B x N x 4)`` for images ``B x 3 x H x W``."""
        feats = backbone_tokens(self.backbone, pixel_values)
        return feats, self.patch_boxes.to(feats.dtype).expand(feats.shape[0], -1, -1)

    def forward(self, input_ids=None, visual_feats=None, visual_pos=None, attention_mask=None, *args,
                pixel_values: torch.Tensor | None = None, **kwargs):
        if pixel_values is not None:
            if visual_feats is not None or visual_pos is not None:
                raise ValueError("give pixel_values or visual_feats / visual_pos, not both")
            visual_feats, visual_pos = self.visual_inputs(pixel_values)
        elif visual_feats is None:
            raise ValueError("shapes-lxmert needs pixel_values (images) or visual_feats and visual_pos")
        if input_ids is not None and input_ids.shape[0] != visual_feats.shape[0]:
            raise ValueError(f"{input_ids.shape[0]} questions for {visual_feats.shape[0]} images: "
                             "give one question per image (repeat the images to ask several)")
        return super().forward(input_ids, visual_feats, visual_pos, attention_mask, *args, **kwargs)

    def encode(self, questions) -> tuple[torch.Tensor, torch.Tensor]:
        """``(input_ids, attention_mask)`` tensors for a question or a list of questions."""
        ids, mask = self.tokenizer.encode(questions, max_length=self.config.max_position_embeddings)
        dev = self.patch_boxes.device
        return torch.from_numpy(ids).to(dev), torch.from_numpy(mask).to(dev)

    @torch.no_grad()
    def answer(self, pixel_values: torch.Tensor, questions) -> list[str]:
        """The answer to each question about the matching image (one question per image).
        Non-finite, empty or integer pixels and questions longer than the model reads are refused
        before the forward."""
        from vitlab.inputs import check_images

        check_images(pixel_values, "answer")
        ids, mask = self.encode(questions)
        scores = self(pixel_values=pixel_values, input_ids=ids, attention_mask=mask).question_answering_score
        return [self.config.id2label[int(i)] for i in scores.argmax(-1)]


def _lxmert_config(arch: dict, vocab_size: int, visual_feat_dim: int) -> LxmertConfig:
    return LxmertConfig(
        vocab_size=vocab_size, visual_feat_dim=visual_feat_dim, visual_pos_dim=4,
        num_qa_labels=len(ANSWERS), id2label=dict(enumerate(ANSWERS)), label2id={a: i for i, a in enumerate(ANSWERS)},
        task_matched=False, task_mask_lm=False, task_obj_predict=False, visual_obj_loss=False,
        visual_attr_loss=False, visual_feat_loss=False, **arch,
    )


def build_shapes_lxmert(arch: dict | None = None, *, backbone: nn.Module | None = None,
                        tokenizer: WordTokenizer | None = None) -> ShapesLxmertForQuestionAnswering:
    """A randomly initialised ``shapes-lxmert`` (train mode) on the shipped, frozen ``shapes-vit-tiny``.

    Args:
        arch: ``LxmertConfig`` keywords overriding :data:`LXMERT_ARCH` (sizes, layers).
        backbone: the visual backbone (default: the shipped ``shapes-vit-tiny``).
        tokenizer: default :meth:`WordTokenizer.for_templates`.
    """
    backbone = _load_backbone() if backbone is None else backbone
    tokenizer = WordTokenizer.for_templates() if tokenizer is None else tokenizer
    cfg = _lxmert_config({**LXMERT_ARCH, **(arch or {})}, len(tokenizer), backbone.embed_dim)
    return ShapesLxmertForQuestionAnswering(cfg, backbone, tokenizer).train()


def load_shapes_lxmert(pretrained: bool = True, *, weights_path: str | Path | None = None,
                       **arch) -> ShapesLxmertForQuestionAnswering:
    """``shapes-lxmert`` in eval mode (``vitlab.load_model("shapes-lxmert")``).

    Args:
        pretrained: load the trained weights (``vitlab/weights/shapes-lxmert.safetensors`` unless
            ``weights_path`` is given); ``False``: the same architecture, randomly initialised
            (on the trained backbone), with ``arch`` overriding :data:`LXMERT_ARCH`.

    Raises:
        FileNotFoundError: the weights file (or the backbone's) is missing, with the command to
            retrain it.
        ValueError: the file was not written for this model, or for another backbone.
    """
    if not pretrained:
        return build_shapes_lxmert(arch).eval()
    path, meta, state = _read_weights("shapes-lxmert", weights_path, LXMERT_PATH)
    refuse_arch(arch, path)
    backbone = _load_backbone()
    tokenizer = WordTokenizer(json.loads(meta["vocabulary"]))
    cfg = _lxmert_config(json.loads(meta["arch"]), len(tokenizer), backbone.embed_dim)
    model = ShapesLxmertForQuestionAnswering(cfg, backbone, tokenizer)
    _load_state(model, state, path)
    return model.eval()


# ---------------------------------------------------------------------------- DETR
class ViTFeatureMap(nn.Module):
    """A DETR backbone made of a ViT: its last-block patch tokens as a ``C x gh x gw`` map.

    Takes the place of ``DetrConvEncoder`` (``DetrModel.backbone``): ``forward(pixel_values,
    pixel_mask)`` returns ``[(feature_map B x C x gh x gw, mask B x gh x gw)]``, and
    ``intermediate_channel_sizes`` / ``model`` (the ViT) are where DETR looks for them.
    """

    def __init__(self, vit: nn.Module):
        super().__init__()
        vit.requires_grad_(False)
        self.model = vit.eval()
        self.grid = tuple(vit.patch_embed.grid_size)
        self.intermediate_channel_sizes = [vit.embed_dim]

    def train(self, mode: bool = True):
        super().train(mode)
        self.model.eval()  # frozen: its BatchNorm statistics must not move
        return self

    def forward(self, pixel_values: torch.Tensor, pixel_mask: torch.Tensor | None = None):
        tokens = backbone_tokens(self.model, pixel_values)         # B x N x C
        b, _, c = tokens.shape
        feature_map = tokens.transpose(1, 2).reshape(b, c, *self.grid)
        if pixel_mask is None:
            mask = torch.ones(b, *self.grid, dtype=torch.bool, device=tokens.device)
        else:
            mask = nn.functional.interpolate(pixel_mask[None].float(), size=self.grid).to(torch.bool)[0]
        return [(feature_map, mask)]


def _detr_config(arch: dict) -> DetrConfig:
    from transformers import ResNetConfig

    # DetrModel builds its backbone from the config before we replace it: give it the smallest
    # ResNet (thrown away at once) rather than ResNet-50.
    tiny = ResNetConfig(embedding_size=8, hidden_sizes=[8, 8, 8, 8], depths=[1, 1, 1, 1], out_features=["stage4"])
    return DetrConfig(
        use_timm_backbone=False, backbone_config=tiny, use_pretrained_backbone=False,
        num_labels=len(CLASSES), id2label=dict(enumerate(CLASSES)), label2id={c: i for i, c in enumerate(CLASSES)},
        **arch,
    )


def _assemble_detr(cfg: DetrConfig, backbone: nn.Module) -> DetrForObjectDetection:
    model = DetrForObjectDetection(cfg)
    model.model.backbone = ViTFeatureMap(backbone)
    model.model.input_projection = nn.Conv2d(backbone.embed_dim, cfg.d_model, kernel_size=1)
    model.vitlab_data_config = _data_config(backbone)
    return model


def build_shapes_detr(arch: dict | None = None, *, backbone: nn.Module | None = None) -> DetrForObjectDetection:
    """A randomly initialised ``shapes-detr`` (train mode): ``DetrForObjectDetection`` with
    :class:`ViTFeatureMap` over the shipped, frozen ``shapes-vit-tiny`` as its backbone.

    ``arch``: ``DetrConfig`` keywords overriding :data:`DETR_ARCH`.
    """
    backbone = _load_backbone() if backbone is None else backbone
    return _assemble_detr(_detr_config({**DETR_ARCH, **(arch or {})}), backbone).train()


def load_shapes_detr(pretrained: bool = True, *, weights_path: str | Path | None = None,
                     **arch) -> DetrForObjectDetection:
    """``shapes-detr`` in eval mode (``vitlab.load_model("shapes-detr")``); arguments and errors
    as :func:`load_shapes_lxmert`."""
    if not pretrained:
        return build_shapes_detr(arch).eval()
    path, meta, state = _read_weights("shapes-detr", weights_path, DETR_PATH)
    refuse_arch(arch, path)
    model = _assemble_detr(_detr_config(json.loads(meta["arch"])), _load_backbone())
    _load_state(model, state, path)
    return model.eval()


# ---------------------------------------------------------------------------- files
def _backbone_prefix(model: nn.Module) -> str:
    return "backbone." if isinstance(model, ShapesLxmertForQuestionAnswering) else "model.backbone."


def _model_name(model: nn.Module) -> str:
    if isinstance(model, ShapesLxmertForQuestionAnswering):
        return "shapes-lxmert"
    if isinstance(model, DetrForObjectDetection) and isinstance(model.model.backbone, ViTFeatureMap):
        return "shapes-detr"
    raise TypeError(f"expected a shapes-lxmert or shapes-detr model, got {type(model).__name__}")


def save_bimodal(model: nn.Module, path: str | Path, *, arch: dict, extra: dict | None = None,
                 backbone_path: str | Path = BACKBONE_PATH) -> None:
    """Write a ``shapes-lxmert`` / ``shapes-detr`` model's weights (fp32) without its backbone.

    ``arch`` is the architecture dict it was built with (the full :data:`LXMERT_ARCH` /
    :data:`DETR_ARCH` with overrides); ``backbone_path`` the ``shapes-vit-tiny`` file whose
    SHA-256 is stored, so that loading can check the backbone is the one trained on.
    """
    from safetensors.torch import save_file

    name = _model_name(model)
    prefix = _backbone_prefix(model)
    state = {k: v.detach().float().contiguous().cpu() if v.is_floating_point() else v.detach().contiguous().cpu()
             for k, v in model.state_dict().items() if not k.startswith(prefix)}
    meta = {
        "format": "pt",
        "vitlab_model": name,
        "arch": json.dumps(arch),
        "backbone": "shapes-vit-tiny",
        "backbone_sha256": _file_sha256(Path(backbone_path)),
    }
    if name == "shapes-lxmert":
        meta["vocabulary"] = json.dumps(model.tokenizer.vocab[len(WordTokenizer.SPECIALS):])
        meta["answers"] = json.dumps(ANSWERS)
    else:
        meta["label_names"] = json.dumps(list(CLASSES))
    if extra:
        meta.update({k: json.dumps(v) for k, v in extra.items()})
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    save_file(state, str(path), metadata=meta)


def _read_weights(name: str, weights_path, default: Path):
    from safetensors import safe_open
    from safetensors.torch import load_file

    path = Path(weights_path) if weights_path is not None else default
    if not path.is_file():
        raise FileNotFoundError(
            f"{name} weights not found at {path}; train them with `{_RETRAIN[name]} --out {path}` "
            f"(at most 15 minutes on 2 CPU cores), or use pretrained=False for random weights"
        )
    if not BACKBONE_PATH.is_file():
        raise FileNotFoundError(f"{name} runs on shapes-vit-tiny, whose weights are missing at {BACKBONE_PATH}; "
                                "retrain them with `python -m vitlab.shapes.train`")
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
    if meta.get("vitlab_model") != name:
        raise ValueError(f"{path} is not a {name} weights file (its metadata names "
                         f"{meta.get('vitlab_model')!r}); write it with `{_RETRAIN[name]}`")
    if meta.get("backbone_sha256") != _file_sha256(BACKBONE_PATH):
        raise ValueError(
            f"{path} was trained on another shapes-vit-tiny than the one at {BACKBONE_PATH} (SHA-256 differs); "
            f"its heads do not fit these features: retrain it with `{_RETRAIN[name]}`")
    return path, meta, load_file(str(path))


def _load_state(model: nn.Module, state: dict, path: Path) -> None:
    prefix = _backbone_prefix(model)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.startswith(prefix)]
    if missing or unexpected:
        raise ValueError(f"{path} does not fit the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
