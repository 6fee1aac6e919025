"""``shapes-clip``: a Hugging Face CLIP that vitlab trains itself on generated scenes and captions.

The model is a :class:`transformers.CLIPModel` (Radford et al. 2021, "Learning Transferable
Visual Models From Natural Language Supervision") — both towers are Hugging Face's own classes
(``CLIPVisionTransformer`` / ``CLIPTextTransformer``, ``CLIPEncoderLayer``, ``CLIPAttention``),
so everything that runs on a real checkpoint such as ``openai/clip-vit-base-patch32`` runs on it
unchanged. :class:`ShapesCLIPModel` subclasses it only to carry its tokenizer (``model.encode``)
and its preprocessing (``vitlab.preprocess``); its ``forward`` is ``CLIPModel.forward``.

- **Image tower**: the blocks of ``shapes-vit-tiny`` (:mod:`vitlab.shapes.model`: 6 blocks of
  width 192, 3 heads, 112 x 112 px in 16-px patches, a 7 x 7 grid + CLS), with that model's
  convolutional stem (Xiao et al. 2021) as ``vision_model.embeddings.patch_embedding``
  (:class:`ConvStemPatchEmbedding`: stride-2 4x4 convolutions, its BatchNorm folded into them,
  then a 1x1 convolution; ``B x 3 x H x W -> B x 192 x H/16 x W/16``, the shape the patchify
  convolution it replaces gives, so ``CLIPVisionEmbeddings.forward`` and its
  ``interpolate_pos_encoding`` path work unchanged). :func:`build_shapes_clip` starts it from the
  shipped ``shapes-vit-tiny`` weights (:func:`vision_from_vit`). The image embedding is the CLS
  token after ``post_layernorm``, projected by ``visual_projection``.
- **Text tower**: a small causal Transformer over the caption vocabulary of
  :mod:`vitlab.shapes.captions` (:class:`~vitlab.shapes.captions.CaptionTokenizer`:
  ``<start> words <end>``, padded on the right with ``<pad>`` = 0 and an attention mask). The text
  embedding is the ``<end>`` token after ``final_layer_norm``: ``text_config.eos_token_id`` is its
  id, so ``CLIPTextTransformer`` pools at the first ``<end>``; it is also the largest id, so
  ``input_ids.argmax(-1)`` (the original CLIP code's rule) finds the same position.
- Score: ``logits_per_image = logit_scale.exp() * cos(image_embed, text_embed)``.

Attention is ``eager`` in both towers (``config._attn_implementation``), so attention weights
exist to be recorded. Weight files (:func:`save_shapes_clip`) hold the whole model (the image
tower included) in fp16, with the ``CLIPConfig`` and the vocabulary in the safetensors metadata.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from torch import nn
from transformers import CLIPConfig, CLIPModel

from vitlab.models import WEIGHTS_DIR
from vitlab.shapes.captions import CaptionTokenizer, zero_shot_prompts
from vitlab.shapes.data import CLASSES
from vitlab.shapes.model import MEAN, STD, refuse_arch

__all__ = [
    "CLIP_ARCH",
    "CLIP_PATH",
    "ConvStemPatchEmbedding",
    "ShapesCLIPModel",
    "build_shapes_clip",
    "clip_config",
    "load_shapes_clip",
    "save_shapes_clip",
    "vision_from_vit",
]

#: Where the shipped weights live (inside the installed package).
CLIP_PATH = WEIGHTS_DIR / "shapes-clip.safetensors"
_RETRAIN = "python -m vitlab.shapes.train_clip"

#: Architecture of ``shapes-clip`` (keywords of :func:`clip_config`). The vision part is
#: ``shapes-vit-tiny``'s (:data:`vitlab.shapes.model.DEFAULT_CONFIG`); the text tower is small:
#: the captions have 22 words and at most 6 of them at a time.
CLIP_ARCH: dict = dict(
    image_size=112, patch_size=16, stem_widths=(16, 32, 64, 128), stem_kernel=4,
    vision_hidden_size=192, vision_layers=6, vision_heads=3, vision_intermediate_size=768,
    text_hidden_size=128, text_layers=3, text_heads=4, text_intermediate_size=512, max_text_length=16,
    projection_dim=128, logit_scale_init=math.log(1 / 0.07),
)


class ConvStemPatchEmbedding(nn.Module):
    """A convolutional stem in the place of CLIP's patchify convolution (``patch_embedding``).

    ``len(widths)`` stride-2 convolutions (``kernel_size`` x ``kernel_size``, padding
    ``(kernel_size - 1) // 2``, bias) each followed by a ReLU halve the resolution, then a 1x1
    convolution maps to ``embed_dim``: ``B x C x H x W -> B x embed_dim x H / 2**k x W / 2**k``
    (floors), the output of a patchify convolution with ``patch_size = 2**k`` — the "early
    convolutions" of Xiao et al. (2021). With ``kernel_size`` 4, every output cell's receptive
    field is centred on the input cells it covers (see :class:`vitlab.shapes.model.ConvStemPatchEmbed`,
    whose layers this is with its BatchNorm folded in: :meth:`from_timm`).

    ``weight`` is the last convolution's weight: ``CLIPVisionEmbeddings.forward`` reads
    ``patch_embedding.weight.dtype`` to cast the pixels.
    """

    def __init__(self, in_channels: int = 3, embed_dim: int = 192, widths=(16, 32, 64, 128), kernel_size: int = 4):
        super().__init__()
        widths = [int(w) for w in widths]
        if not widths or min(widths) < 1 or kernel_size < 2:
            raise ValueError(f"the stem needs at least one layer of positive width and kernel_size >= 2, got "
                             f"widths={widths}, kernel_size={kernel_size}")
        layers: list[nn.Module] = []
        c_in = in_channels
        for w in widths:
            layers += [nn.Conv2d(c_in, w, kernel_size=kernel_size, stride=2, padding=(kernel_size - 1) // 2),
                       nn.ReLU()]
            c_in = w
        layers.append(nn.Conv2d(c_in, embed_dim, kernel_size=1))
        self.proj = nn.Sequential(*layers)
        self.patch_size = 2 ** len(widths)

    @property
    def weight(self) -> torch.Tensor:
        return self.proj[-1].weight

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.proj(pixel_values)

    @classmethod
    @torch.no_grad()
    def from_timm(cls, patch_embed: nn.Module) -> "ConvStemPatchEmbedding":
        """The stem of a :class:`vitlab.shapes.model.ConvStemPatchEmbed` (conv-BN-ReLU layers, then a
        1x1 conv), with each BatchNorm's eval-mode affine map folded into the convolution before it:
        ``W' = W * g / sqrt(v + eps)``, ``b' = beta - m * g / sqrt(v + eps)``; equal outputs."""
        mods = list(patch_embed.proj)
        convs = [m for m in mods if isinstance(m, nn.Conv2d)]
        bns = [m for m in mods if isinstance(m, nn.BatchNorm2d)]
        if len(convs) != len(bns) + 1 or not bns:
            raise ValueError("expected a conv stem of conv-BN-ReLU layers and a final 1x1 convolution")
        stem = cls(convs[0].in_channels, convs[-1].out_channels, [c.out_channels for c in convs[:-1]],
                   convs[0].kernel_size[0]).to(convs[0].weight)     # folded in the source's precision
        new_convs = [m for m in stem.proj if isinstance(m, nn.Conv2d)]
        for old, bn, new in zip(convs[:-1], bns, new_convs[:-1]):
            if old.padding != new.padding or old.stride != new.stride:
                raise ValueError(f"stem layer {old} does not match {new}")
            g = bn.weight / torch.sqrt(bn.running_var + bn.eps)
            new.weight.copy_(old.weight * g[:, None, None, None])
            bias = old.bias if old.bias is not None else torch.zeros_like(bn.bias)
            new.bias.copy_(bn.bias + (bias - bn.running_mean) * g)
        new_convs[-1].weight.copy_(convs[-1].weight)
        new_convs[-1].bias.copy_(convs[-1].bias)
        return stem


def clip_config(arch: dict | None = None, *, vocab_size: int | None = None, eos_token_id: int | None = None,
                pad_token_id: int = 0, bos_token_id: int = 2) -> CLIPConfig:
    """The ``CLIPConfig`` of a shapes CLIP: :data:`CLIP_ARCH` with ``arch`` overriding it, and the
    caption tokenizer's vocabulary size and special ids (default: :class:`CaptionTokenizer.for_captions`).
    Both towers use exact GELU, LayerNorm eps 1e-6 (timm's, so the ViT's blocks carry over) and
    eager attention; the stem is stored as ``vision_config.vitlab_stem``."""
    a = {**CLIP_ARCH, **(arch or {})}
    unknown = set(a) - set(CLIP_ARCH)
    if unknown:
        raise ValueError(f"unknown architecture argument(s) {sorted(unknown)}; expected some of {sorted(CLIP_ARCH)}")
    if 2 ** len(a["stem_widths"]) != a["patch_size"]:
        raise ValueError(f"a stem of {len(a['stem_widths'])} stride-2 layers makes {2 ** len(a['stem_widths'])}-px "
                         f"patches, but patch_size is {a['patch_size']}")
    if vocab_size is None or eos_token_id is None:
        tok = CaptionTokenizer.for_captions()
        vocab_size, eos_token_id = len(tok), tok.end_id
    if eos_token_id == 2:
        raise ValueError("eos_token_id 2 makes CLIPTextTransformer pool at input_ids.argmax(-1) (its legacy rule); "
                         "give the end-of-text token another id")
    text = dict(vocab_size=vocab_size, hidden_size=a["text_hidden_size"], num_hidden_layers=a["text_layers"],
                num_attention_heads=a["text_heads"], intermediate_size=a["text_intermediate_size"],
                max_position_embeddings=a["max_text_length"], hidden_act="gelu", layer_norm_eps=1e-6,
                attention_dropout=0.0, pad_token_id=pad_token_id, bos_token_id=bos_token_id,
                eos_token_id=eos_token_id, projection_dim=a["projection_dim"])
    vision = dict(hidden_size=a["vision_hidden_size"], num_hidden_layers=a["vision_layers"],
                  num_attention_heads=a["vision_heads"], intermediate_size=a["vision_intermediate_size"],
                  image_size=a["image_size"], patch_size=a["patch_size"], num_channels=3, hidden_act="gelu",
                  layer_norm_eps=1e-6, attention_dropout=0.0, projection_dim=a["projection_dim"],
                  vitlab_stem=dict(widths=list(a["stem_widths"]), kernel_size=int(a["stem_kernel"])))
    cfg = CLIPConfig(text_config=text, vision_config=vision, projection_dim=a["projection_dim"],
                     logit_scale_init_value=float(a["logit_scale_init"]))
    _set_eager(cfg)
    return cfg


def _set_eager(cfg: CLIPConfig) -> None:
    for c in (cfg, cfg.text_config, cfg.vision_config):
        c._attn_implementation = "eager"


class ShapesCLIPModel(CLIPModel):
    """``transformers.CLIPModel`` whose image tower embeds patches with a convolutional stem.

    ``vision_model.embeddings.patch_embedding`` is a :class:`ConvStemPatchEmbedding` built from
    ``config.vision_config.vitlab_stem``; everything else, ``forward`` included, is ``CLIPModel``'s.
    ``model.tokenizer`` is the caption tokenizer, ``model.encode(texts)`` gives
    ``(input_ids, attention_mask)``, ``model.classes`` the shape names and
    ``model.zero_shot_prompts()`` their prompts ``"a {shape}"``.
    """

    def __init__(self, config: CLIPConfig, tokenizer: CaptionTokenizer | None = None):
        _set_eager(config)
        super().__init__(config)
        vc = config.vision_config
        stem = getattr(vc, "vitlab_stem", None)
        if not stem:
            raise ValueError("a shapes CLIP's vision_config needs vitlab_stem (widths, kernel_size); build the "
                             "config with vitlab.shapes.clip_model.clip_config")
        self.vision_model.embeddings.patch_embedding = ConvStemPatchEmbedding(
            vc.num_channels, vc.hidden_size, stem["widths"], stem["kernel_size"])
        self.tokenizer = CaptionTokenizer.for_captions() if tokenizer is None else tokenizer
        tc = config.text_config
        if len(self.tokenizer) != tc.vocab_size or self.tokenizer.end_id != tc.eos_token_id:
            raise ValueError(f"the tokenizer ({len(self.tokenizer)} ids, <end> = {self.tokenizer.end_id}) does not fit "
                             f"the text tower ({config.text_config.vocab_size} ids, eos_token_id = "
                             f"{config.text_config.eos_token_id})")
        self.classes = list(CLASSES)
        s = int(vc.image_size)
        self.vitlab_data_config = dict(input_size=(3, s, s), mean=MEAN, std=STD, interpolation="bilinear",
                                       crop_pct=1.0, crop_mode="center")

    def encode(self, texts) -> tuple[torch.Tensor, torch.Tensor]:
        """``(input_ids, attention_mask)`` (``n x L`` int64, on the model's device) for a caption or a
        list of captions: ``<start> words <end>``, right-padded with ``<pad>`` = 0. A text longer than
        ``max_position_embeddings`` tokens is refused with a ``ValueError``."""
        ids, mask = self.tokenizer.encode(texts, max_length=self.config.text_config.max_position_embeddings)
        dev = self.logit_scale.device
        return torch.from_numpy(ids).to(dev), torch.from_numpy(mask).to(dev)

    def zero_shot_prompts(self) -> list[str]:
        """``"a {shape}"`` for every class, in label order (:func:`vitlab.shapes.captions.zero_shot_prompts`)."""
        return zero_shot_prompts(self.classes)


@torch.no_grad()
def vision_from_vit(model: ShapesCLIPModel, vit: nn.Module, *, calibration: torch.Tensor | None = None) -> dict:
    """Copy a timm shapes ViT (:func:`vitlab.shapes.model.load_shapes_vit`) into ``model``'s image tower.

    The mapping is exact for the stem (BatchNorm folded, :meth:`ConvStemPatchEmbedding.from_timm`),
    the CLS token (``class_embedding``), the position embeddings (CLS first, then the patches in
    row order in both), every block (timm's fused ``qkv`` split into ``q_proj`` / ``k_proj`` /
    ``v_proj``; ``proj`` -> ``out_proj``; ``norm1`` / ``norm2`` -> ``layer_norm1`` / ``layer_norm2``;
    ``mlp.fc1`` / ``fc2``) and the final norm (``norm`` -> ``post_layernorm``, which CLIP applies to
    the CLS token only, as timm's token pooling reads only it).

    CLIP has one LayerNorm more: ``pre_layrnorm``, on the embeddings before the first block, where
    timm's ViT has none. A LayerNorm removes each token's mean over the channels, which changes
    nothing downstream (every later read of the residual stream goes through a LayerNorm, which is
    blind to a constant added to all channels); what it does change is each token's scale. Its
    weight is set to the embeddings' median per-token standard deviation over ``calibration``
    (pixel batches; default: 256 generated scenes), so that a token of typical scale passes
    through unchanged, and its bias to zero. Returns ``{"pre_layrnorm_scale": ...,
    "token_std_quartiles": [...]}``.
    """
    vm = model.vision_model
    emb = vm.embeddings
    pe = vit.patch_embed
    if tuple(pe.grid_size) != (emb.image_size // emb.patch_size,) * 2 or vit.embed_dim != emb.embed_dim:
        g = emb.image_size // emb.patch_size
        raise ValueError(f"the ViT (grid {tuple(pe.grid_size)}, width {vit.embed_dim}) does not fit the CLIP image "
                         f"tower ({g} x {g}, width {emb.embed_dim})")
    if len(vit.blocks) != len(vm.encoder.layers) or vit.num_prefix_tokens != 1:
        raise ValueError(f"the ViT has {len(vit.blocks)} blocks and {vit.num_prefix_tokens} prefix tokens; the CLIP "
                         f"image tower has {len(vm.encoder.layers)} layers and one CLS token")
    emb.patch_embedding = ConvStemPatchEmbedding.from_timm(pe).to(emb.class_embedding)
    emb.class_embedding.copy_(vit.cls_token.reshape(-1))
    emb.position_embedding.weight.copy_(vit.pos_embed[0])
    c = vit.embed_dim
    for blk, layer in zip(vit.blocks, vm.encoder.layers):
        q, k, v = blk.attn.qkv.weight.split(c, dim=0)
        qb, kb, vb = blk.attn.qkv.bias.split(c, dim=0)
        att = layer.self_attn
        for lin, w, b in ((att.q_proj, q, qb), (att.k_proj, k, kb), (att.v_proj, v, vb)):
            lin.weight.copy_(w)
            lin.bias.copy_(b)
        pairs = ((layer.self_attn.out_proj, blk.attn.proj), (layer.layer_norm1, blk.norm1),
                 (layer.layer_norm2, blk.norm2), (layer.mlp.fc1, blk.mlp.fc1), (layer.mlp.fc2, blk.mlp.fc2))
        for dst, src in pairs:
            dst.weight.copy_(src.weight)
            dst.bias.copy_(src.bias)
    vm.post_layernorm.weight.copy_(vit.norm.weight)
    vm.post_layernorm.bias.copy_(vit.norm.bias)

    if calibration is None:
        from vitlab.shapes.data import make_scenes, scenes_to_tensor

        s = emb.image_size
        calibration = scenes_to_tensor(make_scenes(256, 77, 1).images, (3, s, s), MEAN, STD)
    was = emb.training
    emb.eval()
    tokens = emb(calibration.to(emb.class_embedding.device))                 # B x N x C
    emb.train(was)
    std = tokens.double().var(-1, unbiased=False).add(vm.pre_layrnorm.eps).sqrt().flatten()
    scale = float(std.median())
    vm.pre_layrnorm.weight.fill_(scale)
    vm.pre_layrnorm.bias.zero_()
    return {"pre_layrnorm_scale": scale,
            "token_std_quartiles": [float(q) for q in torch.quantile(std, std.new_tensor([0.25, 0.5, 0.75]))]}


def build_shapes_clip(arch: dict | None = None, *, vit: nn.Module | str | None = "shapes-vit-tiny",
                      tokenizer: CaptionTokenizer | None = None) -> ShapesCLIPModel:
    """A ``shapes-clip`` to train (train mode): :func:`clip_config` with ``arch``; the image tower
    copied from ``vit`` (:func:`vision_from_vit`; ``"shapes-vit-tiny"``: the shipped weights, or a
    timm shapes ViT; ``None``: random, as Hugging Face initialises a CLIP), the text tower random.
    The numbers of the copy are in ``model.vitlab_init``."""
    tokenizer = CaptionTokenizer.for_captions() if tokenizer is None else tokenizer
    cfg = clip_config(arch, vocab_size=len(tokenizer), eos_token_id=tokenizer.end_id,
                      pad_token_id=tokenizer.pad_id, bos_token_id=tokenizer.start_id)
    model = ShapesCLIPModel(cfg, tokenizer)
    model.vitlab_init = {"vision": None}
    if vit is not None:
        if isinstance(vit, str):
            if vit != "shapes-vit-tiny":
                raise ValueError(f"vit must be 'shapes-vit-tiny', a timm shapes ViT or None, got {vit!r}")
            from vitlab.shapes.model import load_shapes_vit

            vit = load_shapes_vit()
        model.vitlab_init = {"vision": "shapes-vit-tiny", **vision_from_vit(model, vit)}
    return model.train()


def save_shapes_clip(model: ShapesCLIPModel, path: str | Path, *, arch: dict, extra: dict | None = None,
                     half: bool = True) -> None:
    """Write the whole model (fp16 by default) with its ``CLIPConfig``, architecture and vocabulary in
    the safetensors metadata (``extra``: more JSON-able metadata, e.g. the training facts)."""
    from safetensors.torch import save_file

    if not isinstance(model, ShapesCLIPModel):
        raise TypeError(f"expected a shapes-clip model (ShapesCLIPModel), got {type(model).__name__}")
    state = {k: (v.detach().half() if half and v.is_floating_point() else v.detach()).contiguous().cpu()
             for k, v in model.state_dict().items()}
    meta = {"format": "pt", "vitlab_model": "shapes-clip", "arch": json.dumps(_jsonable(arch)),
            "clip_config": model.config.to_json_string(use_diff=False),
            "vocabulary": json.dumps(model.tokenizer.words), "label_names": json.dumps(list(model.classes))}
    meta.update({k: json.dumps(v) for k, v in (extra or {}).items()})
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    save_file(state, str(path), metadata=meta)


def _jsonable(arch: dict) -> dict:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in arch.items()}


def load_shapes_clip(pretrained: bool = True, *, weights_path: str | Path | None = None, **arch) -> ShapesCLIPModel:
    """``shapes-clip`` in eval mode (``vitlab.load_model("shapes-clip")``).

    Args:
        pretrained: load the trained weights (``vitlab/weights/shapes-clip.safetensors`` unless
            ``weights_path`` is given); ``False``: the same architecture with Hugging Face's random
            initialisation (both towers; ``arch`` overrides :data:`CLIP_ARCH`, e.g. ``text_layers=1``).

    Raises:
        FileNotFoundError: the weights file is missing, with the command that trains it.
        ValueError: the file was not written for this model, or architecture keywords with
            ``pretrained=True``.
    """
    if not pretrained:
        return build_shapes_clip(arch, vit=None).eval()
    from safetensors import safe_open
    from safetensors.torch import load_file

    refuse_arch(arch)
    path = Path(weights_path) if weights_path is not None else CLIP_PATH
    if not path.is_file():
        raise FileNotFoundError(f"shapes-clip weights not found at {path}; train them with `{_RETRAIN} --out {path}` "
                                "(at most 30 minutes on 2 CPU cores), or use pretrained=False for random weights")
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
    if meta.get("vitlab_model") != "shapes-clip":
        raise ValueError(f"{path} is not a shapes-clip weights file (its metadata names "
                         f"{meta.get('vitlab_model')!r}); write it with `{_RETRAIN}`")
    cfg = CLIPConfig.from_dict(json.loads(meta["clip_config"]))
    model = ShapesCLIPModel(cfg, CaptionTokenizer(json.loads(meta["vocabulary"])))
    state = {k: v.float() if v.is_floating_point() else v for k, v in load_file(str(path)).items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"{path} does not fit the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
    if "training" in meta:
        model.vitlab_training = json.loads(meta["training"])
    return model.eval()
