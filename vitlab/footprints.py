"""What a patch token reads: its footprint on the input pixels (chapter 03a).

A patch token stands for more pixels than its patch: :func:`token_footprints` measures how
strongly each token's vector depends on each input pixel (its input-gradient footprint), and
:func:`footprint_extent` summarises it per token (centre, the share inside its own patch, and
the area and centred square holding a given share of it; :func:`footprint_regions` draws those
regions). Maps over the patch grid are graded against patches; these say what a patch's token
actually read, and :func:`object_read`, :func:`footprint_pointing` and :func:`footprint_mass`
grade a map by that instead. :func:`token_centres` gives the centre of each token's receptive field after
the patch embedding (a convolutional stem moves it off the patch centre, :func:`patch_centres`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from vitlab.inputs import positive_int, seed_int
from vitlab.layout import token_layout
from vitlab.record import blocks, record


# ---------------------------------------------------------------------------------------------
# Which pixels does a patch token read? Its input-gradient footprint.
# ---------------------------------------------------------------------------------------------


def token_footprints(model: nn.Module, x: torch.Tensor, block: int | None = None, probes: int | None = 1,
                     seed: int = 0, batch_size: int = 32) -> torch.Tensor:
    """How strongly each patch token depends on each input pixel: ``gh x gw x H x W``.

    For the patch token at grid cell ``(r, c)`` and the input pixel ``p``: the length of the
    gradient of the token's vector ``h`` (``D`` numbers) with respect to the pixel, summed over
    the colour channels, ``F[r, c, p] = sum_ch ||d h / d x[ch, p]||_2``, averaged over the images
    of ``x`` (``B x 3 x H x W``). This is the "effective receptive field" of Luo et al. (NeurIPS
    2016, *Understanding the Effective Receptive Field in Deep Convolutional Neural Networks*)
    for one token: where it is large, the token's vector changes with the pixel.

    ``block=None``: ``h`` is the vector entering block 0 (the patch embedding plus its position
    embedding; before any attention, so only the patch embedding's own window counts);
    ``block=l``: the vector leaving block ``l`` (attention has mixed the tokens by then).

    ``probes=None`` computes the norm exactly, one backward pass per embedding dimension.
    ``probes=k`` estimates it from ``k`` random directions ``u ~ N(0, I_D)`` per image and token:
    ``E |u . g| = sqrt(2 / pi) ||g||_2`` for any vector ``g``, so ``sqrt(pi / 2)`` times the mean
    of ``|u . (d h / d x[ch, p])|`` is an unbiased estimate at the cost of ``k`` backward passes
    per token (the directions are drawn from a generator seeded with ``seed``, the same whatever
    ``batch_size``). Recorded with :func:`vitlab.record.record` (eval mode); the model is left as
    it was.

    With ``block=None`` and a stem whose windows :func:`stem_windows` can prove (timm's patch
    embedding of convolutions and per-cell layers), tokens whose windows do not overlap share
    their backward passes (9 groups instead of 49 tokens for ``shapes-vit-tiny``'s stem): each
    pixel's gradient then holds one token's alone, so the result is the same to the bit.
    """
    if not isinstance(x, torch.Tensor) or x.ndim != 4 or x.shape[0] == 0:
        raise ValueError("token_footprints needs a non-empty image batch B x C x H x W, got "
                         f"{type(x).__name__ if not isinstance(x, torch.Tensor) else tuple(x.shape)}")
    if not bool(torch.isfinite(x).all()):
        raise ValueError("token_footprints got an input with NaN or inf values; pass finite images")
    if probes is not None and (isinstance(probes, bool) or not isinstance(probes, int) or probes < 1):
        raise ValueError(f"probes must be a positive int (random directions per image) or None (exact), got {probes!r}")
    positive_int("batch_size", batch_size)
    seed = seed_int("seed", seed)
    layout = token_layout(model, x)
    if block is not None:
        depth = len(blocks(model))
        if isinstance(block, bool) or not isinstance(block, int) or not -depth <= block < depth:
            raise ValueError(f"block must be None (the input of block 0) or an int in [{-depth}, {depth}), got {block!r}")
    B, T, P = x.shape[0], layout.num_patches, layout.num_prefix
    H, W = x.shape[-2:]
    # Entering block 0, a token depends on the pixels of its stem's window only. Where the stem is
    # provably local (stem_windows), tokens whose windows do not overlap share one backward: each
    # pixel's gradient then comes from the one token whose window holds it, the others adding exact
    # zeros, so every token's footprint is the one its own backward gives, to the bit.
    windows = stem_windows(model, layout, (H, W)) if block is None else None
    groups = [[t] for t in range(T)] if windows is None else _disjoint_groups(windows, layout.grid)
    directions = None
    out = torch.zeros(T, H, W, dtype=torch.float64)
    for start in range(0, B, batch_size):
        xb = x[start:start + batch_size].detach().clone().requires_grad_(True)
        with torch.enable_grad(), record(model, detach=False, eval_mode=True, residual=True) as rec:
            model(xb)
        h = (rec.block_inputs[0] if block is None else rec.hidden_states[block])[:, P:]   # b x T x D
        D = h.shape[-1]
        if probes is not None and directions is None:
            g = torch.Generator().manual_seed(seed)
            directions = torch.randn(T, B, probes, D, generator=g, dtype=torch.float64)
        for gi, group in enumerate(groups):
            last_g = gi == len(groups) - 1
            if probes is None:
                sq = torch.zeros(xb.shape, dtype=torch.float64)
                for d in range(D):
                    (grad,) = torch.autograd.grad(h[:, group, d].sum(), xb, retain_graph=not (last_g and d == D - 1))
                    sq += grad.double() ** 2
                mag = sq.sqrt()
            else:
                u = directions[group, start:start + xb.shape[0]].transpose(0, 1).to(h.dtype)   # b x tokens x probes x D
                mag = torch.zeros(xb.shape, dtype=torch.float64)
                for k in range(probes):
                    (grad,) = torch.autograd.grad((h[:, group] * u[:, :, k]).sum(), xb,
                                                  retain_graph=not (last_g and k == probes - 1))
                    mag += grad.double().abs()
                mag *= (torch.pi / 2) ** 0.5 / probes
            per_pixel = mag.sum(dim=(0, 1))
            if windows is None:
                out[group[0]] += per_pixel
            else:
                for t in group:
                    rows, cols = windows[t]
                    out[t, rows, cols] += per_pixel[rows, cols]
        del rec, h
    return (out / B).to(torch.float32).reshape(*layout.grid, H, W)


#: Modules a stem may hold and stay local: each output cell computed from a window of its input
#: (zero-padded convolutions) or from its own cell alone (per-channel affine BatchNorm in eval
#: mode, elementwise activations).
_POINTWISE = (nn.BatchNorm2d, nn.ReLU, nn.ReLU6, nn.GELU, nn.SiLU, nn.LeakyReLU, nn.Tanh, nn.Sigmoid, nn.Identity)


def _stem_layers(module: nn.Module) -> list[nn.Module] | None:
    """The layers of a stem run in order (a convolution, or nested ``nn.Sequential`` of them), or
    None where it holds anything else."""
    if isinstance(module, nn.Sequential):
        layers = []
        for child in module:
            inner = _stem_layers(child)
            if inner is None:
                return None
            layers += inner
        return layers
    return [module] if isinstance(module, (nn.Conv2d, *_POINTWISE)) else None


def stem_windows(model: nn.Module, layout, size: tuple[int, int]) -> list[tuple[slice, slice]] | None:
    """Per patch token (row-major over the grid), the rows and columns of the ``size`` image its
    vector entering block 0 can depend on, or None where that cannot be proven from the model's
    structure.

    Proven for a timm ``VisionTransformer`` with timm's own embedding path (``patch_embed``, then
    ``_pos_embed``, ``patch_drop`` and ``norm_pre``, per token), whose ``patch_embed`` is a timm
    ``PatchEmbed`` (or a subclass with its forward) projecting with zero-padded, undilated
    convolutions and per-cell layers only (:data:`_POINTWISE`) and normalising per token. A chain
    of convolutions with kernels ``k_i``, strides ``s_i`` and paddings ``p_i`` computes output
    cell ``o`` from input pixels ``o J - sum_i p_i j_i`` to that plus ``sum_i (k_i - 1) j_i``,
    where ``j_i`` is the product of the strides before layer ``i`` and ``J`` of all of them.
    """
    try:
        from timm.layers import PatchEmbed, PatchDropout
        from timm.models.vision_transformer import VisionTransformer
    except ImportError:  # pragma: no cover - timm is a dependency
        return None
    V = VisionTransformer
    pe = getattr(model, "patch_embed", None)
    if not (isinstance(model, V) and all(getattr(type(model), n, None) is getattr(V, n) for n in ("forward_features", "_pos_embed"))
            and isinstance(pe, PatchEmbed) and type(pe).forward is PatchEmbed.forward
            and isinstance(getattr(pe, "norm", None), (nn.Identity, nn.LayerNorm))
            and isinstance(getattr(model, "patch_drop", None), (nn.Identity, PatchDropout))
            and isinstance(getattr(model, "norm_pre", None), (nn.Identity, nn.LayerNorm))):
        return None
    layers = _stem_layers(pe.proj)
    if not layers:
        return None
    start, window, jump = [0, 0], [1, 1], [1, 1]
    for layer in layers:
        if not isinstance(layer, nn.Conv2d):
            continue
        if (layer.padding_mode != "zeros" or isinstance(layer.padding, str)
                or tuple(layer.dilation) != (1, 1)):
            return None
        for a in range(2):
            start[a] -= layer.padding[a] * jump[a]
            window[a] += (layer.kernel_size[a] - 1) * jump[a]
            jump[a] *= layer.stride[a]
    gh, gw = layout.grid
    H, W = size
    return [(slice(max(0, r * jump[0] + start[0]), min(H, r * jump[0] + start[0] + window[0])),
             slice(max(0, c * jump[1] + start[1]), min(W, c * jump[1] + start[1] + window[1])))
            for r in range(gh) for c in range(gw)]


def _disjoint_groups(windows: list[tuple[slice, slice]], grid: tuple[int, int]) -> list[list[int]]:
    """The tokens in groups whose :func:`stem_windows` do not overlap: in row-major order, each
    token joins the first group none of whose windows meets its own (a new group if none)."""
    def meet(u, v):
        return all(u[a].start < v[a].stop and v[a].start < u[a].stop for a in range(2))
    groups: list[list[int]] = []
    for t, w in enumerate(windows):
        for group in groups:
            if not any(meet(w, windows[o]) for o in group):
                group.append(t)
                break
        else:
            groups.append([t])
    return groups


@dataclass(frozen=True)
class FootprintExtent:
    """Where a token's footprint (:func:`token_footprints`) lies and how far it reaches, per token.

    Attributes:
        centre: ``gh x gw x 2``, the footprint's centroid (row, column, in pixels).
        offset: ``gh x gw x 2``, ``centre`` minus the centre of the token's own patch.
        own_patch: ``gh x gw``, the share of the footprint inside the token's own patch.
        area: ``gh x gw x Q``, pixels in the smallest set of pixels holding ``mass[q]`` of the
            footprint (the largest values first).
        side: ``gh x gw x Q``, side in pixels of the smallest square centred on the token's
            patch that holds ``mass[q]`` of the footprint (the patch itself is ``patch`` wide).
        mass: the shares asked for, e.g. ``(0.5, 0.9)``.
        patch: ``(ph, pw)``, the patch size in pixels.
    """

    centre: torch.Tensor
    offset: torch.Tensor
    own_patch: torch.Tensor
    area: torch.Tensor
    side: torch.Tensor
    mass: tuple
    patch: tuple

    def margin(self, q: int = 0) -> torch.Tensor:
        """``gh x gw``: how far, in pixels beyond its patch's edge, the square holding
        ``mass[q]`` reaches (0 where that square fits inside the patch)."""
        return ((self.side[..., q] - self.patch[0]) / 2).clamp_min(0)


def footprint_extent(footprints, mass=(0.5, 0.9)) -> FootprintExtent:
    """Centre and extent of every token's footprint (``gh x gw x H x W``, from
    :func:`token_footprints`; any non-negative weights over the pixels). See
    :class:`FootprintExtent`."""
    f = torch.as_tensor(footprints).detach().double()
    if f.ndim != 4:
        raise ValueError(f"footprints must be gh x gw x H x W, got shape {tuple(f.shape)}")
    gh, gw, H, W = f.shape
    if H % gh or W % gw:
        raise ValueError(f"the image ({H} x {W}) is not a whole number of patches of the {gh} x {gw} grid")
    if not bool(torch.isfinite(f).all()) or bool((f < 0).any()):
        raise ValueError("footprints must be finite and non-negative")
    q = tuple(float(m) for m in (mass if isinstance(mass, (tuple, list)) else (mass,)))
    if not q or any(not 0.0 < m <= 1.0 for m in q):
        raise ValueError(f"mass must hold shares in (0, 1], got {mass!r}")
    flat = f.reshape(gh * gw, H * W)
    total = flat.sum(1, keepdim=True)
    if bool((total <= 0).any()):
        raise ValueError("a token's footprint is zero everywhere; it has no centre or extent")
    w = flat / total
    ph, pw = H // gh, W // gw
    ys = torch.arange(H, dtype=torch.float64)[:, None].expand(H, W).reshape(-1)
    xs = torch.arange(W, dtype=torch.float64)[None, :].expand(H, W).reshape(-1)
    centre = torch.stack([(w * ys).sum(1), (w * xs).sum(1)], 1)                     # T x 2
    r, c = torch.meshgrid(torch.arange(gh), torch.arange(gw), indexing="ij")
    patch_centre = torch.stack([r.reshape(-1) * ph + (ph - 1) / 2, c.reshape(-1) * pw + (pw - 1) / 2], 1).double()
    own = torch.stack([w[t].reshape(H, W)[ri * ph:(ri + 1) * ph, ci * pw:(ci + 1) * pw].sum()
                       for t, (ri, ci) in enumerate(zip(r.reshape(-1).tolist(), c.reshape(-1).tolist()))])
    ranked = w.sort(1, descending=True).values.cumsum(1)                            # T x HW
    cheb = torch.maximum((ys[None] - patch_centre[:, :1]).abs(), (xs[None] - patch_centre[:, 1:]).abs())
    order = cheb.argsort(1)
    ring = cheb.gather(1, order)
    cum = w.gather(1, order).cumsum(1)
    area, side = [], []
    for m in q:
        tol = 1e-9
        area.append((ranked < m - tol).sum(1) + 1)
        first = (cum < m - tol).sum(1).clamp_max(H * W - 1)                           # the pixel that reaches m
        side.append(2 * ring.gather(1, first[:, None])[:, 0] + 1)
    grid = (gh, gw)
    return FootprintExtent(centre=centre.reshape(*grid, 2).float(), offset=(centre - patch_centre).reshape(*grid, 2).float(),
                           own_patch=own.reshape(grid).float(), area=torch.stack(area, -1).reshape(*grid, len(q)).float(),
                           side=torch.stack(side, -1).reshape(*grid, len(q)).float(), mass=q, patch=(ph, pw))


def footprint_regions(footprints, mass=(0.5, 0.9), shape: str = "pixels") -> torch.Tensor:
    """``gh x gw x Q x H x W`` booleans: for every token and share ``mass[q]``, the region holding
    that share of its footprint. ``shape="pixels"``: the smallest set of pixels that does (the
    largest values first; its size is :attr:`FootprintExtent.area`); ``"square"``: the smallest
    square centred on the token's patch that does (its side is :attr:`FootprintExtent.side`,
    cut off at the image's edge). For drawing where a token's input gradient lies."""
    if shape not in ("pixels", "square"):
        raise ValueError(f"shape must be 'pixels' or 'square', got {shape!r}")
    f = torch.as_tensor(footprints).detach().double()
    if f.ndim != 4:
        raise ValueError(f"footprints must be gh x gw x H x W, got shape {tuple(f.shape)}")
    ext = footprint_extent(f, mass)                                   # checks the values and shares
    gh, gw, H, W = f.shape
    Q = len(ext.mass)
    if shape == "square":
        ph, pw = ext.patch
        r, c = torch.meshgrid(torch.arange(gh), torch.arange(gw), indexing="ij")
        cy, cx = r * ph + (ph - 1) / 2, c * pw + (pw - 1) / 2                 # gh x gw
        ys, xs = torch.arange(H, dtype=torch.float64), torch.arange(W, dtype=torch.float64)
        dy = (ys[None, None, :] - cy[..., None]).abs()                        # gh x gw x H
        dx = (xs[None, None, :] - cx[..., None]).abs()                        # gh x gw x W
        cheb = torch.maximum(dy[..., :, None], dx[..., None, :])              # gh x gw x H x W
        half = (ext.side.double() - 1) / 2                                    # gh x gw x Q
        return cheb[:, :, None] <= half[..., None, None] + 1e-9
    flat = f.reshape(gh * gw, H * W)
    order = flat.argsort(1, descending=True)
    rank = torch.empty_like(order)
    rank.scatter_(1, order, torch.arange(H * W).expand(gh * gw, -1))  # 0 = the largest value
    area = ext.area.reshape(gh * gw, -1).long()                       # T x Q
    out = rank[:, None, :] < area[:, :, None]
    return out.reshape(gh, gw, Q, H, W)


def object_read(footprints, masks) -> torch.Tensor:
    """``B x gh x gw``: the share of each token's footprint that lies on the object, per mask.

    ``footprints``: ``gh x gw x H x W`` non-negative weights over the pixels
    (:func:`token_footprints`); ``masks``: ``B x H x W`` (object pixels non-zero). Each token's
    footprint is divided by its sum, so the share is in [0, 1]: 1 when everything the token read
    is object, 0 when none of it is. Grading a map by what its tokens read rather than by their
    patches: see :func:`footprint_pointing` and :func:`footprint_mass`.
    """
    f = torch.as_tensor(footprints).detach().double()
    m = torch.as_tensor(masks).detach()
    if f.ndim != 4:
        raise ValueError(f"footprints must be gh x gw x H x W, got shape {tuple(f.shape)}")
    if m.ndim != 3 or tuple(m.shape[-2:]) != tuple(f.shape[-2:]):
        raise ValueError(f"masks must be B x H x W with the footprints' image size {tuple(f.shape[-2:])}, "
                         f"got shape {tuple(m.shape)}")
    if not bool(torch.isfinite(f).all()) or bool((f < 0).any()):
        raise ValueError("footprints must be finite and non-negative")
    gh, gw, H, W = f.shape
    w = f.reshape(gh * gw, H * W)
    total = w.sum(1, keepdim=True)
    if bool((total <= 0).any()):
        raise ValueError("a token's footprint is zero everywhere: it read nothing to grade against")
    share = (m.reshape(m.shape[0], H * W) != 0).double() @ (w / total).T            # B x T
    return share.reshape(-1, gh, gw).float()


def footprint_pointing(maps, read, min_share: float = 0.5) -> torch.Tensor:
    """Per sample: did the map's highest token read mostly object? (bool ``B``)

    The pointing game counted by what a token reads instead of by its patch: a hit when at least
    ``min_share`` of the top token's footprint lies on the object (``read``, ``B x gh x gw``, from
    :func:`object_read`). Ties for the highest value are a hit only if every tied token is, as in
    :func:`vitlab.localization.pointing_game`. The hit rate of a map whose top token is drawn at
    random is ``(read >= min_share)`` averaged over the tokens.
    """
    maps, read = torch.as_tensor(maps).detach(), torch.as_tensor(read).detach()
    if maps.ndim != 3 or tuple(maps.shape) != tuple(read.shape):
        raise ValueError(f"maps and read must both be B x gh x gw, got {tuple(maps.shape)} and {tuple(read.shape)}")
    if not 0.0 < min_share <= 1.0:
        raise ValueError(f"min_share must be in (0, 1], got {min_share}")
    if not bool(torch.isfinite(maps).all()):
        raise ValueError("maps hold NaN or inf values; pass finite maps")
    flat, on = maps.flatten(1), read.flatten(1) >= min_share - 1e-9
    top = flat == flat.max(dim=1, keepdim=True).values
    return (top & ~on).sum(1) == 0


def footprint_mass(maps, read) -> torch.Tensor:
    """Per sample (any leading dimensions ``... x gh x gw``, ``read`` broadcast against them): the
    share of a map's mass that reaches the object through what its tokens read,
    ``sum_t map_t * read_t / sum_t map_t`` -- :func:`vitlab.localization.mass_on_object` with each
    token counted by the share of its footprint on the object instead of by its patch's cover. A
    flat map scores the mean of ``read`` over the tokens (its chance level)."""
    maps, read = torch.as_tensor(maps).detach().double(), torch.as_tensor(read).detach().double()
    if maps.ndim < 2 or read.ndim < 2 or maps.shape[-2:] != read.shape[-2:]:
        raise ValueError(f"maps and read must end in the same gh x gw grid, got {tuple(maps.shape)} and {tuple(read.shape)}")
    if not bool(torch.isfinite(maps).all()) or bool((maps < 0).any()):
        raise ValueError("maps must be finite and non-negative (a share of mass needs a non-negative map)")
    total = maps.sum((-2, -1))
    if bool((total <= 0).any()):
        raise ValueError("a map is zero everywhere: it has no mass to share out")
    return ((maps * read).sum((-2, -1)) / total).float()


# ---------------------------------------------------------------------------------------------
# Which pixels does a token stand for? Its receptive-field centre
# ---------------------------------------------------------------------------------------------


def token_centres(model, x: torch.Tensor) -> torch.Tensor:
    """Receptive-field centre of every patch token after the patch embedding: ``gh x gw x 2``.

    For token t, the centroid (row, column in input pixels) of ``|d embed_t / d x|`` summed
    over channels, embedding dimensions and the batch ``x`` (``B x 3 x H x W``). With a
    plain patchify convolution it is the patch centre; a convolutional stem can move it
    (e.g. stride-2 3x3 convolutions with padding 1 centre a token on its patch's top-left
    corner). Maps over the patch grid are graded against patches, so an offset here shifts
    every map relative to what its tokens saw. timm ViTs only (``model.patch_embed``).
    """
    pe = getattr(model, "patch_embed", None)
    if pe is None or not hasattr(pe, "grid_size"):
        raise ValueError("token_centres needs a timm ViT (a model with patch_embed.grid_size)")
    gh, gw = (int(g) for g in pe.grid_size)
    H, W = x.shape[-2:]
    with torch.enable_grad():
        xin = x.detach().clone().requires_grad_(True)
        emb = pe(xin)  # B x N x C (timm flattens) or B x C x gh x gw
        if emb.ndim == 4:
            emb = emb.flatten(2).transpose(1, 2)
        ys = torch.arange(H, dtype=torch.float32)[:, None].expand(H, W)
        xs = torch.arange(W, dtype=torch.float32)[None, :].expand(H, W)
        out = torch.empty(gh * gw, 2)
        for t in range(gh * gw):
            (g,) = torch.autograd.grad(emb[:, t].sum(), xin, retain_graph=t < gh * gw - 1)
            w = g.abs().sum(dim=(0, 1)).float()  # H x W
            total = w.sum().clamp_min(torch.finfo(w.dtype).tiny)
            out[t, 0], out[t, 1] = (w * ys).sum() / total, (w * xs).sum() / total
    return out.reshape(gh, gw, 2)


def patch_centres(grid: tuple[int, int], size: tuple[int, int]) -> torch.Tensor:
    """Centre (row, column in pixels) of every patch of a ``grid`` over an image of ``size``."""
    (gh, gw), (H, W) = grid, size
    ph, pw = H / gh, W / gw
    cy = torch.arange(gh, dtype=torch.float32) * ph + (ph - 1) / 2
    cx = torch.arange(gw, dtype=torch.float32) * pw + (pw - 1) / 2
    return torch.stack(torch.meshgrid(cy, cx, indexing="ij"), dim=-1)
