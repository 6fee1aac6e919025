"""Generated scenes with known object masks, and ``shapes-vit-tiny``, the ViT trained on them.

- :func:`make_scenes` — scenes, class labels and exact object masks (:mod:`vitlab.shapes.data`);
  :func:`remove_objects` — the same scenes with an object taken out; :func:`centres_per_patch` —
  where on a patch grid the objects' centres fall
- :func:`load_shapes_vit` — the embedded model (:mod:`vitlab.shapes.model`)
- ``python -m vitlab.shapes.train`` retrains it; ``python -m vitlab.shapes.evaluate`` measures it.
- questions (:mod:`vitlab.shapes.qa`) and captions (:mod:`vitlab.shapes.captions`) about the scenes, for the
  image-text models that vitlab trains on them: ``shapes-lxmert``, ``shapes-detr``, ``shapes-visualbert``
  (:mod:`vitlab.shapes.bimodal`, :mod:`vitlab.shapes.visualbert`) and ``shapes-clip``
  (:mod:`vitlab.shapes.clip_model`, a Hugging Face ``CLIPModel``; ``python -m vitlab.shapes.train_clip``).
"""
from __future__ import annotations

from vitlab.shapes.data import (
    CLASSES, DEFAULT_SIZE, Scenes, centres_per_patch, make_scenes, remove_objects, scenes_to_tensor,
)

__all__ = [
    "CLASSES", "DEFAULT_SIZE", "Scenes", "centres_per_patch", "load_shapes_vit", "make_scenes", "remove_objects",
    "scenes_to_tensor",
]


def load_shapes_vit(pretrained: bool = True, **kwargs):
    """The ``shapes-vit-tiny`` model in eval mode; see :func:`vitlab.shapes.model.load_shapes_vit`.

    (Imported lazily, so that generating scenes does not import torch and timm.)
    """
    from vitlab.shapes.model import load_shapes_vit as _load

    return _load(pretrained=pretrained, **kwargs)
