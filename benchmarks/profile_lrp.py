"""Where the LRP family's time goes, rule by rule, in units of a plain forward.

Random-initialised timm ``deit_tiny_patch16_224`` (no download), batch 16, CPU, as
``benchmarks/bench_lrp.py``. Each rule of :mod:`vitlab.record.lrp` is wrapped in a timer for the
run (the wrappers are taken off afterwards): per method the process CPU time spent inside each
rule's backward, divided by a plain forward (``torch.no_grad()``) timed just before, median over
rounds. "rest" is everything outside the rules: the forward with the rules attached (the eager
attention in place of the fused one, the recordings), autograd's engine (gradient sums where a
tensor feeds two operations, the views' backwards), the method's own steps. The matmuls inside a
rule are counted in the rule: the linear rule does 3 per layer (``|x| |W|^T``, ``S W^+``,
``S W^-``), the attention matmul rule 2, the plain vector-Jacobian product of a linear layer 1.

Measured (``--threads 1``, the shared 2-core machine, whose ratios vary by about 0.3x from run to
run): full LRP 6.36x a forward = the linear alpha-beta rule 2.95x (its 3 matmuls about 1.7x: the
forward's linear layers are ~55% of a forward) + rest 1.97x + the attention scores recomputed from
their terms (``product_from_terms``, ~11,500 of 1.86M scores per block below ``EXACT_BELOW``)
0.55x + the attention matmul rule 0.39x + identity rules 0.18x + residual rule 0.15x + the
softmax rule's division 0.11x. Transformer attribution 6.89x: the same, plus the plain backward
(linear 0.57x, GELU 0.15x, softmax 0.05x, the attention matmuls' share of 0.79x).

The rule-by-rule breakdown above is of the autograd pass (``--path autograd``, the default here:
the wrappers time the rules of :mod:`vitlab.record.lrp` that its backward calls). ``--path direct``
and ``--path compiled`` profile the hand-written pass (:mod:`vitlab.record.lrp_direct`, which the
package runs on this model) with torch.profiler, split by operation kind. Measured (``--threads
1``): full LRP 6.07x = matmuls 3.05x + the rest 3.01x (compiled: 5.54x = matmuls 3.08x + compiled
kernels 0.30x + rest 2.17x); Transformer attribution 7.26x = 3.87x + 3.39x (compiled 6.60x = 3.84x +
0.28x + 2.48x); partial LRP 1.43x = 0.86x + 0.57x; AttnLRP (the autograd pass) 3.11x = 1.83x + 1.28x.
"matmuls" are the forward's and the rules' ``addmm``, ``mm`` and ``bmm``; "rest" the forward's and
the rules' element-wise steps, copies (``addmm``'s bias broadcast among them), the scores' float64
sums.

    python benchmarks/profile_lrp.py [--batch 16] [--rounds 3] [--threads N] [--path autograd|direct|compiled]
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import statistics
import time
from collections import defaultdict

from vitlab.lrp import attn_lrp, lrp, partial_lrp, transformer_attribution

from _timing import add_timing_arguments, random_deit_tiny, setup_line, stopwatch

RULES = importlib.import_module("vitlab.record.lrp")


@contextlib.contextmanager
def timed_rules(spent: dict):
    """Wrap the rules of :mod:`vitlab.record.lrp` so that ``spent[name]`` adds up the CPU seconds
    inside each (``product_from_terms`` apart from the softmax rule that calls it); put back after."""
    def timer(name, fn, inner=None):
        def run(*args, **kwargs):
            before = spent.get(inner, 0.0) if inner else 0.0
            start = time.process_time()
            out = fn(*args, **kwargs)
            spent[name] += time.process_time() - start - ((spent.get(inner, 0.0) - before) if inner else 0.0)
            return out
        return run

    saved = {name: getattr(RULES, name) for name in (
        "alpha1_beta0_rule", "identity_rule", "identity_rule_over", "residual_add_rule", "product_from_terms",
        "linear_vjp", "gelu_vjp", "softmax_vjp")}
    half_backward = RULES._HalfMatmul.backward
    softmax_rule, scores = "softmax rule (the division)", "product_from_terms (scores from their terms)"
    try:
        linear = "linear rule (alpha-beta, 3 matmuls)"
        RULES.alpha1_beta0_rule = lambda *a: timer(linear, saved["alpha1_beta0_rule"](*a))
        RULES.identity_rule = timer("identity rule (GELU, LayerNorm)", saved["identity_rule"])
        RULES.identity_rule_over = lambda d: timer(softmax_rule, saved["identity_rule_over"](d), scores)
        RULES.product_from_terms = timer(scores, saved["product_from_terms"])
        RULES.residual_add_rule = timer("residual rule", saved["residual_add_rule"])
        RULES.linear_vjp = lambda *a: timer("plain backward: linear (1 matmul)", saved["linear_vjp"](*a))
        RULES.gelu_vjp = lambda *a: timer("plain backward: GELU", saved["gelu_vjp"](*a))
        RULES.softmax_vjp = lambda *a: timer("plain backward: softmax", saved["softmax_vjp"](*a))
        RULES._HalfMatmul.backward = staticmethod(timer("attention matmuls (2 bmm each)", half_backward))
        yield
    finally:
        for name, fn in saved.items():
            setattr(RULES, name, fn)
        RULES._HalfMatmul.backward = staticmethod(half_backward)


MATMULS = ("aten::addmm", "aten::mm", "aten::bmm")


def by_kind(model, x, forward, methods, rounds: int) -> None:
    """Per method, its time in forwards split into the matmuls (``addmm``, ``mm``, ``bmm``: the
    forward's, the rules'), the compiled kernels (with ``--path compiled``) and the rest (element-wise
    steps, copies, the scores' float64 sums), from torch.profiler's self CPU times, median over rounds."""
    from torch.profiler import profile

    for name, method in methods.items():
        method(model, x)  # warm-up (and compiling)
        parts = defaultdict(list)
        for _ in range(rounds):
            start = time.process_time()
            forward()
            f = time.process_time() - start
            with profile() as prof:
                method(model, x)
            kinds = defaultdict(float)
            for e in prof.key_averages():
                kind = ("matmuls" if e.key in MATMULS else "compiled kernels" if "CompiledFxGraph" in e.key
                        else "rest")
                kinds[kind] += e.self_cpu_time_total / 1e6
            for kind, value in kinds.items():
                parts[kind].append(value / f)
            parts["total"].append(sum(kinds.values()) / f)
        print(f"{name}: " + ", ".join(f"{k} {statistics.median(v):.2f}x" for k, v in sorted(parts.items())))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_timing_arguments(parser, batch=16, rounds=3, clock=None)
    parser.add_argument("--path", choices=("autograd", "direct", "compiled"), default="autograd",
                        help="autograd: rule by rule (vitlab.lrp.DIRECT = False); direct / compiled: the hand-written "
                             "pass (COMPILE off / on), split by operation kind with torch.profiler")
    args = parser.parse_args()
    import vitlab.lrp as L

    L.DIRECT, L.COMPILE = args.path != "autograd", args.path == "compiled"
    seconds = stopwatch("cpu")
    model, x, forward = random_deit_tiny(args.batch, args.threads)

    methods = {"lrp": lrp, "transformer_attribution": transformer_attribution, "partial_lrp": partial_lrp,
               "attn_lrp": attn_lrp}
    print(setup_line(args.batch, "process CPU time", args.rounds) + ", x a plain forward")
    if args.path != "autograd":
        by_kind(model, x, forward, methods, args.rounds)
        return
    spent: dict = defaultdict(float)
    with timed_rules(spent):
        for name, method in methods.items():
            method(model, x)  # warm-up
            shares, totals = defaultdict(list), []
            for _ in range(args.rounds):
                f = seconds(forward)
                spent.clear()
                total = seconds(lambda: method(model, x))
                totals.append(total / f)
                for key, value in spent.items():
                    shares[key].append(value / f)
                shares["rest (forward with the rules, autograd, the method's steps)"].append(
                    (total - sum(spent.values())) / f)
            print(f"{name}: {statistics.median(totals):.2f}x")
            for key, values in sorted(shares.items(), key=lambda kv: -statistics.median(kv[1])):
                print(f"    {key:62s} {statistics.median(values):5.2f}x")


if __name__ == "__main__":
    main()
