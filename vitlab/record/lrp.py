"""LRP as a modified backward pass, attached by :func:`vitlab.record` (``record(model, lrp=...)``).

Layer-wise relevance propagation (Bach et al. 2015) sends the explained logit back through
the network layer by layer, each layer dividing the relevance of its outputs among its
inputs by a *rule*. For the rules used here the relevance of any tensor ``h`` is
``h ⊙ gbar_h``, where ``gbar`` is a gradient whose backward has been changed at a few
operations (Ali et al. 2022, "XAI for Transformers: Better Explanations through Conservative
Propagation"; Achtibat et al. 2024, Sec. 3, and their lxt library's "efficient" mode). So one
forward and one backward give every relevance: the rules only change the backward functions
of the operations below; every value of the forward stays exactly the model's.

While a recording with ``lrp=`` is open, a :class:`torch.overrides.TorchFunctionMode` of the
recording's thread gives the operations run *inside the model's forward* these backwards
(nothing outside the model's forward is touched; the model's modules, parameters and flags
are not changed, and the mode is gone when the recording closes, also on exceptions). LRP
recordings of one model may overlap and close in any order: each takes its own mode off the
stack wherever it sits; while several are inside a forward of one thread, the newest one's
rules apply (an older one lets through what the newest passes on):

``"attnlrp"`` (Achtibat et al., ICML 2024, "AttnLRP: Attention-Aware Layer-Wise Relevance
Propagation for Transformers"; equation numbers as lxt's code names them):

- linear layers (``F.linear``): the epsilon rule with epsilon -> 0, which in this form *is*
  the plain gradient (the bias keeps its share ``b ⊙ gbar``);
- GELU and SiLU: the identity rule (eq. 9), ``gbar_x = gbar_y ⊙ gelu(x) / x``;
- the gate of a SwiGLU MLP (timm's ``SwiGLU`` / ``GluMlp``, EVA-02), ``act(x W_g) * (x W)``, a
  product of two activations: the uniform rule, as the attention matmuls below (each operand
  gets half the gradient; in the ``"chefer"`` set too);
- LayerNorm: the identity rule on the division by the standard deviation, i.e. the
  standard deviation is held constant in the backward (the mean-centring is linear and
  keeps its gradient), ``gbar_x = (g' - mean(g')) / sigma`` with ``g' = w ⊙ gbar_y``;
- softmax: its AttnLRP rule (a Taylor expansion at the input, with the bias term absorbing
  what is not passed on), which in this form is the plain gradient of the softmax;
- the two attention matmuls (``Q K^T`` and ``A V``, any matmul of two activations): the
  uniform rule (eq. 7), each operand gets half the gradient, so the two halves of the
  relevance add up to the product's.

``"chefer"``, the relprop rules of Chefer, Gur & Wolf's reference code
(hila-chefer/Transformer-Explainability, ``modules/layers_ours.py``, used by its
``baselines/ViT/ViT_LRP.py``):

- linear layers: alpha-beta with alpha = 1, beta = 0 (Bach et al. 2015): output unit j's
  relevance goes to the inputs in proportion to their positive contributions
  ``(x_i w_ji)^+`` over ``sum_i (x_i w_ji)^+`` (the bias gets nothing);
- GELU, LayerNorm and softmax: the identity (each input gets its output's relevance);
- the attention matmuls: each operand gets the gradient x input share of the product's
  relevance, halved (the reference's ``cam /= 2``), as above;
- each residual addition ``a + b`` of a block (the reference's ``Add.relprop``): the z-rule
  split ``a ⊙ R / (a + b)``, ``b ⊙ R / (a + b)``, then each part rescaled so that the two
  parts' sums are ``|sum_a| / (|sum_a| + |sum_b|)`` and ``|sum_b| / (...)`` of the block's
  relevance (sums per sample: the reference, written for one image, sums over the tensor).

Both sets also compute ``F.scaled_dot_product_attention`` (timm's fused path, Hugging Face
SDPA) as its eager matmul - softmax - matmul with these rules, so a fused model needs no flag
switched. ``rec.patch_tokens`` keeps the patch embedding's output of each forward (graph-
attached): its relevance, ``e ⊙ gbar_e``, is "LRP to the patch tokens";
``rec.first_block_inputs`` the tokens entering the first block (all of them, position
embedding added).

Hugging Face VisualBERT and LXMERT (:data:`BERT_LIKE`, post-LN BERT layers) take the same
rules: there the residual addition of each block is the one inside its ``*Output`` module
(``LayerNorm(dense(h) + input_tensor)``), a pooler's tanh gets the identity rule, and what is
read is the relevance of the attention maps (:mod:`vitlab.bimodal_lrp`); there is no patch
embedding to keep.

For Transformer attribution (eq. 13 of Chefer et al., CVPR 2021), which weighs each
attention's relevance by the attention's *ordinary* gradient, ``with rec.plain_gradients():``
makes every backward inside the block use the model's own derivatives: one forward, one LRP
backward and one plain backward.

Numerics. The rules run in the dtype of the model they are attached to. The ``"chefer"`` set's
identity rules divide by the input (``gbar_x = R / x``), and the gradient x input split of the
sum before (a score ``q·k``, a residual ``a + b``, the position sum ``e + p``) then gives each
term ``t`` the share ``t / x``: the z-rule, with a pole where ``x`` is small against its terms.
The split conserves relevance only if ``x`` is the sum of those terms. A residual addition and the
position sum are one correctly rounded addition each: their value is that sum to one rounding.
An attention score is a matmul of two activations, which a float32 forward gives to
``k u sum |terms|`` only (``k`` terms, unit roundoff ``u``): the softmax's rule divides by the
scores the forward computed from their terms, each small one recomputed in float64
(:func:`product_from_terms`; the mode follows the matmul's output through a scaling and an added
mask to the softmax). What is left is the conditioning of the rules themselves: near a pole the
relevance changes fast with the network's values, which :mod:`vitlab.lrp` measures. The rules' own
steps are written not to add cancellation of their own: alpha-beta picks ``S W^+`` or ``S W^-`` by
the input's sign (never the difference of two large products), the residual rule's rescaling is
``sign(s_a) T / (|s_a| + |s_b|)`` (no division by a sum that cancelled), the identity rule's
``0 / 0`` is 0. The ``"attnlrp"`` set divides by no sum of the forward and is as accurate as the
model's dtype.
"""
from __future__ import annotations

import contextlib
import inspect
import threading

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd import Function
from torch.overrides import TorchFunctionMode

#: The rule sets ``record(model, lrp=...)`` knows (see the module docstring).
LRP_RULES = ("attnlrp", "chefer")


def safe_divide(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a / b`` where ``b != 0``, 0 where ``b == 0`` (a relevance with no contribution to share)."""
    return torch.where(b != 0, a / b, 0.0)  # the inf / nan of a division by 0 is never picked


class LRPState:
    """What the rules of one recording read: the rule set, whether a backward is plain, and
    whether the recording's thread is inside the model's forward (``depth``)."""

    def __init__(self, rules: str):
        if rules not in LRP_RULES:
            raise ValueError(f"lrp must be one of {LRP_RULES} (or None), got {rules!r}")
        self.rules = rules
        self.plain = False
        self.depth = 0
        self.thread = threading.get_ident()
        self.stream: torch.Tensor | None = None  # the residual stream of the block being run ("chefer")
        self.gated = 0  # > 0 inside a gated MLP (SwiGLU): its product of two activations takes the uniform rule
        #: products of two activations in the running forward ("chefer", below float64), the value the
        #: softmax's rule divides by: id(tensor) -> (tensor, function giving it from its terms)
        self.exact: dict = {}

    @contextlib.contextmanager
    def plain_gradients(self):
        """Backwards inside the block use the model's own derivatives (no rule)."""
        self.plain = True
        try:
            yield
        finally:
            self.plain = False


# --- rules as autograd functions: the forward is the model's op, the backward the rule ------------
class _Ruled(Function):
    """``op(*inputs)`` in the forward; in the backward ``rule(grad, output, *inputs)``, or when
    ``state.plain`` the op's own vector-Jacobian product: ``vjp(grad, output, *inputs)`` where the
    caller gives it (no recomputation), else autograd through ``op`` run again. Non-tensor
    arguments and parameters are bound into ``op``, ``rule`` and ``vjp``: they get no gradient."""

    @staticmethod
    def forward(ctx, state, op, rule, vjp, *inputs):
        with torch.no_grad():
            out = op(*inputs)
        ctx.state, ctx.op, ctx.rule, ctx.vjp = state, op, rule, vjp
        ctx.save_for_backward(*inputs, out)
        return out

    @staticmethod
    def backward(ctx, grad):
        *inputs, out = ctx.saved_tensors
        if not ctx.state.plain:
            grads = ctx.rule(grad, out, *inputs)
        elif ctx.vjp is not None:
            grads = ctx.vjp(grad, out, *inputs)
        else:
            with torch.enable_grad():
                leaves = [t.detach().requires_grad_(True) for t in inputs]
                grads = torch.autograd.grad(ctx.op(*leaves), leaves, grad, allow_unused=True)
        return (None, None, None, None, *grads)


class _HalfMatmul(Function):
    """``a @ b`` (batched) in the forward; in an LRP backward the gradient x input rule with each
    operand's share halved (the uniform rule): ``gbar_a = (gbar/2) b^T``, ``gbar_b = a^T (gbar/2)``,
    the halving done on the smaller of the output gradient and the operand gradients. A plain
    backward gives the matmul's own gradients."""

    @staticmethod
    def forward(ctx, state, func, a, b):
        with torch.no_grad():
            out = func(a, b)
        ctx.state = state
        ctx.save_for_backward(a, b)
        return out

    @staticmethod
    def backward(ctx, grad):
        a, b = ctx.saved_tensors
        need_a, need_b = ctx.needs_input_grad[2], ctx.needs_input_grad[3]
        half_out = not ctx.state.plain and grad.numel() <= a.numel() * need_a + b.numel() * need_b
        if half_out:  # halved into a contiguous tensor: the batched matmuls below then copy nothing
            grad = torch.mul(grad, 0.5, out=torch.empty_like(grad, memory_format=torch.contiguous_format))
        ga = torch.matmul(grad, b.transpose(-2, -1)) if need_a else None
        gb = torch.matmul(a.transpose(-2, -1), grad) if need_b else None
        if not ctx.state.plain and not half_out:
            ga = None if ga is None else ga.mul_(0.5)
            gb = None if gb is None else gb.mul_(0.5)
        # broadcast operands (a batch dim of 1 or a missing one) get their gradient summed back
        ga = None if ga is None else _sum_to(ga, a.shape)
        gb = None if gb is None else _sum_to(gb, b.shape)
        return None, None, ga, gb


def _sum_to(g: torch.Tensor, shape) -> torch.Tensor:
    return g if g.shape == shape else g.sum_to_size(shape)


class _ScaleGrad(Function):
    """The identity in the forward; the gradient times ``factor`` in an LRP backward."""

    @staticmethod
    def forward(ctx, state, x, factor):
        ctx.state, ctx.factor = state, factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return None, (grad if ctx.state.plain else grad * ctx.factor), None


def identity_rule(grad: torch.Tensor, out: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor]:
    """Identity rule for an element-wise op ``out = f(x)``: ``R_x = R_out``, i.e.
    ``gbar_x = gbar_out ⊙ out / x`` (0 where ``x == 0``)."""
    return ((grad * out).div_(x).nan_to_num_(0.0, 0.0, 0.0),)  # a / 0 -> 0


#: Where :func:`product_from_terms` recomputes an entry of ``a @ b``: where it is below this fraction
#: of ``|a_i| |b_j|``, which bounds the sum of its terms' magnitudes.
EXACT_BELOW = 2.0 ** -10


def product_from_terms(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out = a @ b`` (batched matmul, as the forward computed it) with every entry that is small
    against its terms recomputed from them, summed in float64 and rounded once: the entries with
    ``|out_ij| < EXACT_BELOW |a_i| |b_j|``. A float32 matmul gives entry ``ij`` with an error up to
    ``k u sum_l |a_il b_lj| <= k u |a_i| |b_j|`` (``k`` the inner length, ``u = 2^-24``), which is
    large against the entry where its terms cancel; after this, every entry is within ``k u /
    EXACT_BELOW`` of itself (a head width of 64: ``2^-8``; typically ``sqrt(k) u / EXACT_BELOW``,
    ``2^-11``), and the recomputed ones within ``u``. The threshold trades that bound against the
    cost of the float64 sums, which grows with the share of near-orthogonal ``q``, ``k`` (large in a
    random-initialised model; ``benchmarks/bench_lrp.py`` measures the methods' cost)."""
    batch = out.shape[:-2]
    n, k, m = a.shape[-2], a.shape[-1], b.shape[-1]
    a3 = a.expand(*batch, n, k).reshape(-1, n, k)
    b3 = b.expand(*batch, k, m).reshape(-1, k, m)
    o3 = out.reshape(-1, n, m)
    # EXACT_BELOW |a_i| |b_j| (>= EXACT_BELOW sum_l |a_il b_lj|), the power of 2 put on the short factor
    small = (a3.norm(dim=-1) * EXACT_BELOW).unsqueeze(-1) * b3.norm(dim=-2).unsqueeze(-2)
    which, i, j = torch.lt(o3.abs(), small).nonzero(as_tuple=True)
    if which.numel() == 0:
        return out
    terms = a3[which, i, :].double() * b3[which, :, j].double()
    fixed = o3.clone()
    fixed[which, i, j] = terms.sum(-1).to(out.dtype)
    return fixed.reshape(out.shape)


def identity_rule_over(denominator):
    """:func:`identity_rule` dividing by ``denominator()`` (the input's value computed from its terms,
    in the input's dtype; computed in the backward, so a backward that stops above the rule costs
    nothing) instead of the input as the forward rounded it."""
    def rule(grad, out, x):
        return ((grad * out).div_(denominator().to(x.dtype)).nan_to_num_(0.0, 0.0, 0.0),)
    return rule


def layer_norm_rule(normalized_shape, weight, eps):
    """AttnLRP's LayerNorm rule: the standard deviation held constant in the backward."""
    dims = tuple(range(-len(normalized_shape), 0))

    def rule(grad, out, x):
        sigma = (x.var(dim=dims, unbiased=False, keepdim=True) + eps).sqrt()
        g = grad * weight if weight is not None else grad
        return ((g - g.mean(dim=dims, keepdim=True)) / sigma,)
    return rule


def _live_rows(grad: torch.Tensor) -> torch.Tensor | None:
    """The index of the rows of ``grad`` (last dim = features) that are not all 0, when they are at
    most half of them (the last block, where only the CLS token carries relevance); None when
    more are live (then every row is computed). Rows with no gradient give none."""
    rows = grad.reshape(-1, grad.shape[-1])
    if rows.shape[0] < 2 or int(rows[:, 0].ne(0).sum()) * 2 > rows.shape[0]:
        return None  # cheap screen: more than half the rows are live
    live = rows.ne(0).any(1)
    if int(live.sum()) * 2 > rows.shape[0]:
        return None
    return live.nonzero()[:, 0]


def _by_rows(grad, x, index, compute, *row_tensors):
    """``compute(grad rows, *row tensors' rows)`` scattered back into zeros shaped like ``x``."""
    g = torch.zeros(grad[..., :1].numel(), x.shape[-1], dtype=grad.dtype, device=grad.device)
    if index.numel():
        picked = [t.reshape(-1, t.shape[-1])[index] for t in (grad, *row_tensors)]
        g[index] = compute(*picked)
    return g.reshape(x.shape)


def alpha1_beta0_rule(weight: torch.Tensor, bias: torch.Tensor | None = None):
    """Alpha-beta (alpha = 1, beta = 0) for ``y = x W^T + b``: ``R_x = x^+ ⊙ (S W^+) + x^- ⊙ (S W^-)``
    with ``S = R_y / (x^+ W^{+T} + x^- W^{-T})``, so ``gbar_x = S W^+`` where x > 0, ``S W^-`` where x < 0.

    The denominator with one matmul instead of two: ``(x_i w_ji)^+ = (|x_i| |w_ji| + x_i w_ji) / 2``,
    so ``Z = |x| |W|^T + (y - b)`` (the forward's ``y`` reused) is twice it and ``S = 2 R_y / Z``
    (0 where ``Z <= 0``: no positive contribution, nothing to share). The two products ``S W^+``
    and ``S W^-`` (with ``2 W^+ = |W| + W`` and ``2 W^- = W - |W|``, both exact, made in the
    backward, not kept) are picked by the sign of x (multiplied by 0/1 masks from ``sign(x)``,
    the same values as a select at a third of its cost), and ``gbar_x = 0`` where x = 0, which holds no relevance to pass on: an input's share of a unit is
    its own positive contribution, exactly 0 where it has none, so no rounding (as of ``S W``
    against ``S |W|``) hands a unit's relevance to inputs that did not contribute to it. What
    rounding leaves: ``Z`` carries an absolute error of about ``u sum_i |x_i w_ji|`` (``u`` the
    dtype's unit roundoff), so a unit whose positive contributions are a fraction ``f`` of all
    its contributions passes on its relevance scaled by ``1 + O(u / f)`` (float64: below 1e-12
    for ``f > 1e-4``). Rows of ``gbar_y`` that are all 0 (the last block, where only the CLS
    token carries relevance) are skipped: they give 0."""
    def dense(grad, out, x):
        w_abs = weight.abs()
        z = F.linear(x.abs(), w_abs, None if bias is None else -bias).add_(out)  # 2 sum_i (x_i w_ji)^+ >= 0
        s = (out * grad).div_(z).masked_fill_(z <= 0, 0.0)  # S / 2; the inf / nan of z <= 0 replaced by 0
        # 2 W^+ = |W| + W and 2 W^- = W - |W|, both exact; the product for x's sign picked by float masks
        # (1 where x > 0, resp. x < 0, else 0: x == 0 gets 0), a multiply-add instead of a select
        sign = x.sign()
        g = (s @ (w_abs + weight)).mul_(sign.clamp(min=0))
        return g.addcmul_(s @ (weight - w_abs), sign.clamp_(max=0), value=-1)

    def rule(grad, out, x):
        index = _live_rows(grad)
        return (dense(grad, out, x) if index is None else _by_rows(grad, x, index, dense, out, x),)
    return rule


def linear_vjp(weight: torch.Tensor):
    """The plain gradient of ``x W^T + b`` with respect to ``x``: ``gbar W`` (rows of 0 skipped)."""
    def vjp(grad, out, x):
        index = _live_rows(grad)
        return (grad @ weight if index is None else _by_rows(grad, x, index, lambda g: g @ weight),)
    return vjp


def gelu_vjp(approximate: str = "none"):
    """The plain gradient of GELU, from its input (no recomputation)."""
    return lambda grad, out, x: (torch.ops.aten.gelu_backward(grad, x, approximate=approximate),)


def silu_vjp(grad, out, x):
    """The plain gradient of SiLU, from its input (no recomputation)."""
    return (torch.ops.aten.silu_backward(grad, x),)


def softmax_vjp(dim: int):
    """The plain gradient of a softmax, from its output: ``p ⊙ (gbar - sum(gbar ⊙ p))``."""
    return lambda grad, out, x: (torch._softmax_backward_data(grad, out, dim, x.dtype),)


def residual_add_rule(grad, out, a, b):
    """The reference's ``Add.relprop`` for a residual ``a + b``, per sample (see the module docstring):
    the parts ``a ⊙ gbar`` and ``b ⊙ gbar`` (sums ``s_a``, ``s_b``) rescaled to ``|s_a| / (|s_a| + |s_b|)``
    and ``|s_b| / (...)`` of the relevance ``T = sum (a + b) ⊙ gbar``. The factor on ``a``'s part,
    ``|s_a| / (|s_a| + |s_b|) * T / s_a``, is computed as ``sign(s_a) T / (|s_a| + |s_b|)``: no
    division by a sum that may have cancelled to nearly 0 (0 where both sums are 0)."""
    dims = tuple(range(1, out.ndim))
    total = (out * grad).sum(dim=dims, keepdim=True)
    sa, sb = (a * grad).sum(dim=dims, keepdim=True), (b * grad).sum(dim=dims, keepdim=True)
    scale = safe_divide(total, sa.abs() + sb.abs())
    return grad * (torch.sign(sa) * scale), grad * (torch.sign(sb) * scale)


def tanh_vjp(grad, out, x):
    """The plain gradient of tanh, from its output: ``gbar (1 - tanh^2)``."""
    return (grad * (1 - out * out),)


def add_vjp(grad, out, a, b):
    """The plain gradient of ``a + b``."""
    return grad, grad


# --- the mode: which operations get which rule -----------------------------------------------------
_MATMULS = {torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.bmm, torch.Tensor.bmm}
_SOFTMAXES = {F.softmax, torch.softmax, torch.Tensor.softmax}
_ADDS = {torch.add, torch.Tensor.add, torch.Tensor.__add__, torch.Tensor.__radd__}
_TANHS = {torch.tanh, torch.Tensor.tanh, F.tanh}
_MULS = {torch.mul, torch.Tensor.mul, torch.Tensor.__mul__, torch.Tensor.__rmul__}
_SCALINGS = {torch.mul, torch.Tensor.mul, torch.Tensor.__mul__, torch.Tensor.__rmul__, torch.div, torch.Tensor.div,
             torch.Tensor.__truediv__, *_ADDS}



def _tensor(t) -> bool:
    return isinstance(t, torch.Tensor) and not isinstance(t, nn.Parameter)


#: The states of the open LRP recordings, oldest first (every thread's; each state knows its own).
#: Where two are inside a forward of their thread at once, the newest one's rules apply: its mode
#: is above the others on the thread's mode stack, and the older modes let through what it passes
#: on (an op it leaves alone, or the op its rule runs in the forward) instead of ruling it too.
_OPEN_STATES: list[LRPState] = []
_OPEN_LOCK = threading.Lock()


def _overruled(state: LRPState) -> bool:
    """Whether a newer open LRP recording of ``state``'s thread is inside a forward now."""
    newer = False
    for other in tuple(_OPEN_STATES):
        if other is state:
            newer = True
        elif newer and other.depth > 0 and other.thread == state.thread:
            return True
    return False


class _LRPMode(TorchFunctionMode):
    def __init__(self, state: LRPState):
        super().__init__()
        self.state = state

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        st = self.state
        if st.depth <= 0 or threading.get_ident() != st.thread or _overruled(st):
            return func(*args, **kwargs)
        if st.exact and func in _SCALINGS and len(args) == 2 and not kwargs and _tensor(args[0]):
            # attention scores scaled or given a mask on their way to the softmax: the same op on their
            # value from the terms (a scaling or a constant added rounds relative to the result)
            entry = st.exact.get(id(args[0]))
            other = args[1]
            if entry is not None and entry[0] is args[0] and (
                    isinstance(other, (int, float)) or (_tensor(other) and not other.requires_grad)):
                out = func(*args)
                value = entry[1]
                st.exact[id(out)] = (out, lambda: func(value(), other))
                return out
        if func in _MATMULS and len(args) == 2 and _tensor(args[0]) and _tensor(args[1]):
            return self.matmul(func, *args)
        if func in _SOFTMAXES:
            return self.softmax(func, args, kwargs)
        if func is F.gelu:
            x = args[0]
            approximate = kwargs.get("approximate", args[1] if len(args) > 1 else "none")
            return _Ruled.apply(st, lambda t: F.gelu(t, *args[1:], **kwargs), identity_rule,
                                gelu_vjp(approximate), x)
        if func is F.silu:  # AttnLRP: SiLU, like GELU, takes the identity rule (eq. 9)
            inplace = kwargs.get("inplace", args[1] if len(args) > 1 else False)
            if inplace:
                raise ValueError("LRP cannot put its rule on an in-place SiLU; build the model with inplace=False")
            return _Ruled.apply(st, F.silu, identity_rule, silu_vjp, args[0])
        if (func in _MULS and st.gated > 0 and len(args) == 2 and not kwargs and _tensor(args[0])
                and _tensor(args[1]) and args[0].shape == args[1].shape):
            # SwiGLU's gate act(x W_g) * (x W): a product of two activations, AttnLRP's uniform rule
            # (eq. 7, as for the attention matmuls): each operand gets half the product's relevance
            return func(_ScaleGrad.apply(st, args[0], 0.5), _ScaleGrad.apply(st, args[1], 0.5))
        if func is F.layer_norm:
            return self.layer_norm(*args, **kwargs)
        if func in _TANHS and len(args) == 1 and not kwargs:  # a pooler's tanh: the identity rule
            return _Ruled.apply(st, torch.tanh, identity_rule, tanh_vjp, args[0])
        if func is F.linear and st.rules == "chefer":
            x = args[0] if args else kwargs["input"]
            weight = args[1] if len(args) > 1 else kwargs["weight"]  # EVA-02 / BEiT pass weight= by keyword
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            w, b = weight.detach(), None if bias is None else bias.detach()
            return _Ruled.apply(st, lambda t: F.linear(t, w, b), alpha1_beta0_rule(w, b), linear_vjp(w), x)
        if func is F.scaled_dot_product_attention:
            return self.sdpa(*args, **kwargs)
        if (func in _ADDS and st.rules == "chefer" and st.stream is not None and len(args) == 2
                and not kwargs and _tensor(args[0]) and _tensor(args[1])
                and any(a is st.stream for a in args) and args[0].shape == args[1].shape):
            stream, branch = (args[0], args[1]) if args[0] is st.stream else (args[1], args[0])
            out = _Ruled.apply(st, torch.add, residual_add_rule, add_vjp, stream, branch)
            st.stream = out
            return out
        return func(*args, **kwargs)

    # each handler runs the op as the model asked, with the rule's backward
    def matmul(self, func, a, b):
        if a.ndim >= 2 and b.ndim >= 2:
            out = _HalfMatmul.apply(self.state, func, a, b)
            if self.state.rules == "chefer" and out.dtype != torch.float64:  # the softmax's rule may need it
                a0, b0 = a.detach(), b.detach()
                self.state.exact[id(out)] = (out, lambda: product_from_terms(a0, b0, out.detach()))
            return out
        half_a = _ScaleGrad.apply(self.state, a, 0.5)
        half_b = _ScaleGrad.apply(self.state, b, 0.5)
        return func(half_a, half_b)

    def softmax(self, func, args, kwargs):
        if self.state.rules == "attnlrp":  # AttnLRP's softmax rule is the softmax's own gradient
            return func(*args, **kwargs)
        x = args[0]
        dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
        # the plain gradient without recomputation where the output keeps the input's dtype
        vjp = softmax_vjp(dim) if isinstance(dim, int) and len(args) <= 2 and kwargs.get("dtype") is None else None
        entry = self.state.exact.pop(id(x), None)
        rule = identity_rule
        if entry is not None and entry[0] is x:  # scores of a matmul: divide by them as their terms sum
            rule = identity_rule_over(entry[1])
        return _Ruled.apply(self.state, lambda t: func(t, *args[1:], **kwargs), rule, vjp, x)

    def layer_norm(self, x, normalized_shape, weight=None, bias=None, eps=1e-5):
        w = None if weight is None else weight.detach()
        b = None if bias is None else bias.detach()

        def op(t):
            return F.layer_norm(t, normalized_shape, w, b, eps)
        rule = layer_norm_rule(normalized_shape, w, eps) if self.state.rules == "attnlrp" else identity_rule
        return _Ruled.apply(self.state, op, rule, None, x)

    def sdpa(self, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if is_causal or enable_gqa:
            raise TypeError("vitlab's LRP rules cover non-causal ViT attention only (is_causal and enable_gqa are not "
                            "ViT attention); use chefer_relevance for other transformers")
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        # k and v contiguous once: the batched matmuls of the forward and the backward then copy neither
        k, v = k.contiguous(), v.contiguous()
        scores = self.matmul(torch.matmul, q * scale, k.transpose(-2, -1))
        if attn_mask is not None:
            scores = (scores.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool
                      else scores + attn_mask)
        attn = self.softmax(torch.softmax, (scores,), {"dim": -1})
        if dropout_p > 0:
            attn = F.dropout(attn, p=dropout_p)
        return self.matmul(torch.matmul, attn, v)


def _recording_hook(fn) -> bool:
    """Whether ``fn`` is a hook of a vitlab recording (:meth:`vitlab.record._session._Session.hook`)."""
    return (getattr(fn, "__module__", None) == "vitlab.record._session"
            and getattr(fn, "__qualname__", "").startswith("_Session.hook."))


def working_copy(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """A copy of ``model`` with its floating-point parameters and buffers in ``dtype``, for a pass
    that must run at another precision than the model's (:mod:`vitlab.lrp`: the Chefer rules in
    float64). The copy runs without the hooks of recordings open on ``model`` (they would record
    the copy's forwards into them); other hooks come along. No ``.grad`` is copied; ``model``
    itself is not touched."""
    import copy

    try:
        twin = copy.deepcopy(model)
    except Exception as err:  # a module holding something that cannot be copied
        raise TypeError(f"a {dtype} copy of {type(model).__name__} could not be made (copy.deepcopy failed: "
                        f"{err}); pass the model in {dtype} yourself (e.g. model.double())") from err
    for m in twin.modules():
        for table in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks"):
            hooks = getattr(m, table, None) or {}
            for key in [k for k, fn in hooks.items() if _recording_hook(fn)]:
                del hooks[key]
                for extra in ("_forward_hooks_with_kwargs", "_forward_hooks_always_called",
                              "_forward_pre_hooks_with_kwargs"):
                    getattr(m, extra, {}).pop(key, None)
    for t in twin.parameters():
        t.grad = None
    return twin.to(dtype)


def _remove_mode(mode: TorchFunctionMode) -> None:
    """Take ``mode`` off this thread's torch function mode stack wherever it sits, the modes above
    it staying in their order. (``mode.__exit__`` pops the top of the stack, which is another
    recording's mode when recordings of one model close out of order: that one would lose its
    rules and this one's stay, inert.) Nothing happens if the mode is not on the stack."""
    above = []
    while torch._C._len_torch_function_stack() > 0:
        top = torch._C._pop_torch_function_stack()
        if top is mode:
            break
        above.append(top)
    for m in reversed(above):
        torch._C._push_on_torch_function_stack(m)


def _patch_embedding(model: nn.Module) -> nn.Module | None:
    """The module making the patch tokens: timm's ``patch_embed``, Hugging Face's ``patch_embeddings``."""
    for name, m in model.named_modules():
        if name.rsplit(".", 1)[-1] in ("patch_embed", "patch_embeddings"):
            return m
    return None


#: Hugging Face models whose residual additions are found by their ``*Output`` modules
#: (``LayerNorm(dense(h) + input_tensor)``, BERT's post-LN layers): VisualBERT and LXMERT.
BERT_LIKE = ("visual_bert", "lxmert")


# Non-linear layers the rule sets have no rule for: their backward would stay the plain gradient,
# so LRP through them would silently not be LRP. Refused by name (module class names, timm's and
# Hugging Face's activation classes included).
_UNRULED_ACTIVATIONS = {
    "QuickGELUActivation": "QuickGELU (x * sigmoid(1.702 x))", "QuickGELU": "QuickGELU (x * sigmoid(1.702 x))",
    "NewGELUActivation": "the tanh form of GELU written out elementwise",
    "FastGELUActivation": "the tanh form of GELU written out elementwise",
    "ReLU": "ReLU", "Sigmoid": "sigmoid", "Hardswish": "hard swish", "Mish": "Mish", "ELU": "ELU",
    "LeakyReLU": "leaky ReLU", "Softplus": "softplus", "GELUTanh": None, "PytorchGELUTanh": None,
}
_GATED = ("GatedMlp",)          # gMLP's spatial gating unit: no rule here
_GLU = ("SwiGLU", "GluMlp")      # act(x W_g) * (x W): the product takes the uniform rule (_LRPMode)


def unruled_layer(model: nn.Module) -> str | None:
    """The first layer of ``model`` whose non-linearity the LRP rules do not cover, described, or
    None. SiLU takes the identity rule and SwiGLU's product of two activations the uniform rule
    (AttnLRP, Achtibat et al. 2024); the activations listed in ``_UNRULED_ACTIVATIONS`` have no
    rule here, nor gMLP's gating or EVA-02's attention output gate (``sigmoid(x W) *``). The patch embedding is not looked into: LRP stops at its
    output, the patch tokens (a hybrid ViT's ResNet stem with its ReLUs is fine)."""
    embed = _patch_embedding(model)
    skip = set() if embed is None else {id(m) for m in embed.modules()}
    for name, m in model.named_modules():
        if id(m) in skip:
            continue
        kind = type(m).__name__
        if kind in _GATED:
            return (f"layer {name} ({kind}) is a gated MLP with a spatial gating unit (gMLP), whose gating has no "
                    "LRP rule here")
        if _UNRULED_ACTIVATIONS.get(kind):
            return f"layer {name} ({kind}) is a {_UNRULED_ACTIVATIONS[kind]} non-linearity with no LRP rule here"
        if isinstance(getattr(m, "gate", None), nn.Module) and hasattr(m, "num_heads"):
            return f"layer {name} ({kind}) gates its attention output with a sigmoid, which has no LRP rule here"
    return None


def _attach_vit_stream(model: nn.Module, session, state: LRPState, blocks) -> None:
    """ViT: the patch embedding's tokens kept, each block's input is the residual stream."""
    unruled = unruled_layer(model)
    if unruled is not None:
        raise ValueError(
            f"LRP on {type(model).__name__}: {unruled}, so its backward would be the plain gradient there, "
            "not LRP. The rules cover Linear, GELU, SiLU, LayerNorm, softmax, the attention products and SwiGLU's "
            "gate (ViT, DeiT, DINOv2, BEiT, EVA-02); use a model built from those"
        )
    rec = session.rec
    embed = _patch_embedding(model)
    if embed is None:
        raise TypeError(f"{type(model).__name__} has no patch embedding (patch_embed / patch_embeddings) "
                        "whose tokens LRP could explain")

    def keep_tokens(mod, args, out):
        tokens = out[0] if isinstance(out, tuple) else out
        if tokens.ndim != 4:
            rec.patch_tokens.append(tokens)
            return None
        # a patch embedding that does not flatten (timm's dynamic_img_size: B x gh x gw x D; else B x D x gh x
        # gw): the tokens kept are B x P x D, and the model goes on with the same values viewed back from
        # them, so the pass's gradient reaches the tensor kept
        channels_last = str(getattr(mod, "output_fmt", "NCHW")).endswith("NHWC")
        flat = tokens.flatten(1, 2) if channels_last else tokens.flatten(2).transpose(1, 2)
        rec.patch_tokens.append(flat)
        back = flat.unflatten(1, tokens.shape[1:3]) if channels_last else flat.transpose(1, 2).unflatten(2, tokens.shape[2:])
        return (back, *out[1:]) if isinstance(out, tuple) else back

    session.hook(embed, keep_tokens)
    for m in model.modules():
        if type(m).__name__ in _GLU:
            def enter_glu(mod, args, kwargs):
                state.gated += 1

            def leave_glu(mod, args, out):
                state.gated -= 1
            session.hook(m, enter_glu, pre=True, with_kwargs=True)
            session.hook(m, leave_glu)
    for index, (_, block, _) in enumerate(blocks):
        def block_in(mod, args, kwargs, first=index == 0):
            x = args[0] if args else next(iter(kwargs.values()), None)
            state.stream = x if isinstance(x, torch.Tensor) else None
            if first and state.stream is not None:
                rec.first_block_inputs.append(x)

        def block_out(mod, args, out):
            state.stream = None

        session.hook(block, block_in, pre=True, with_kwargs=True)
        session.hook(block, block_out)


def _attach_bert_stream(model: nn.Module, session, state: LRPState) -> None:
    """BERT-style post-LN layers (VisualBERT, LXMERT): in every ``*Output`` module (``dense``,
    ``LayerNorm``, ``forward(hidden_states, input_tensor)``) the addition of ``input_tensor`` is
    the residual one."""
    found = 0
    for m in model.modules():
        if not (isinstance(getattr(m, "dense", None), nn.Module) and isinstance(getattr(m, "LayerNorm", None), nn.Module)):
            continue
        names = list(inspect.signature(m.forward).parameters)
        if "input_tensor" not in names:
            continue
        where = names.index("input_tensor")

        def output_in(mod, args, kwargs, where=where):
            x = args[where] if len(args) > where else kwargs.get("input_tensor")
            state.stream = x if isinstance(x, torch.Tensor) else None

        def output_out(mod, args, out):
            state.stream = None

        session.hook(m, output_in, pre=True, with_kwargs=True)
        session.hook(m, output_out)
        found += 1
    if not found:
        raise TypeError(f"{type(model).__name__} has no BERT output modules (dense, LayerNorm, input_tensor) "
                        "whose residual additions the rules could find")


def attach_lrp(model: nn.Module, session, rules: str, found) -> LRPState:
    """Put the rules of ``rules`` on the backward of ``model``'s forwards in the recording's
    thread until ``session.close()``. ``found``: what the family's adapter attached to (a ViT's
    ``(name, block, attention)`` list; VisualBERT's and LXMERT's encoder). For a ViT fills
    ``session.rec.patch_tokens`` and ``first_block_inputs``; for VisualBERT and LXMERT
    (:data:`BERT_LIKE`) the relevance of the attention maps is what is read."""
    state = LRPState(rules)
    if getattr(getattr(model, "config", None), "model_type", None) in BERT_LIKE:
        _attach_bert_stream(model, session, state)
    else:
        _attach_vit_stream(model, session, state, found)

    def enter(mod, args, kwargs):
        if state.depth <= 0:
            state.gated = 0  # a forward that raised inside a gated MLP left it raised
        state.depth += 1

    def leave(mod, args, out):
        state.depth -= 1
        if state.depth <= 0:
            state.exact.clear()

    session.hook(model, enter, pre=True, with_kwargs=True)
    session.hook(model, leave)
    mode = _LRPMode(state)
    with _OPEN_LOCK:
        _OPEN_STATES.append(state)
    mode.__enter__()

    def close():
        state.depth = 0
        state.gated = 0
        state.exact.clear()
        _remove_mode(mode)
        with _OPEN_LOCK:
            _OPEN_STATES.remove(state)
    session._undo.append(close)
    session.rec._lrp_state = state
    return state
