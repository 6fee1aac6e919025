import os

# Tests never touch the network: hub lookups fail fast instead of retrying.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


# Tiny random ViTs shared by the method tests: fast, with attention peaked enough to matter.
TINY = dict(img_size=32, patch_size=8, embed_dim=48, depth=3, num_heads=3, num_classes=5)


def randomize(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Weights large enough for peaked attention and distinct logits (timm's init is tiny)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model.eval()


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models gain nothing from threads, and a busy machine makes them spin-wait.
    Modules opt in with ``pytestmark = pytest.mark.usefixtures("one_thread")``; restored after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def vit():
    """A tiny random ViT (3 blocks, 3 heads, 4 x 4 patches, 5 classes) in eval mode."""
    from timm.models.vision_transformer import VisionTransformer

    return randomize(VisionTransformer(**TINY), 0)


@pytest.fixture(scope="module")
def x():
    """Three 32 x 32 inputs for :func:`vit`."""
    return torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(7))
