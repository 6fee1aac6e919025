"""Timing helpers shared by the benchmark scripts.

The benchmarks are scripts (``python benchmarks/bench_x.py``), so their own folder is first on
``sys.path`` and they import this module as ``from _timing import ...``. Every benchmark reports
ratios (a method's time over a reference's, timed in the same round), never absolute times alone.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

#: ``--clock`` choices: elapsed time, or this process's CPU time (steadier on a busy machine).
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def add_timing_arguments(parser: argparse.ArgumentParser, *, batch: int = 16, rounds: int = 7,
                         threads: int | None = None, clock: str | None = "wall") -> None:
    """Add ``--batch``, ``--rounds``, ``--threads`` and (unless ``clock`` is None) ``--clock`` with
    these defaults."""
    parser.add_argument("--batch", type=int, default=batch)
    parser.add_argument("--rounds", type=int, default=rounds)
    parser.add_argument("--threads", type=int, default=threads,
                        help="torch CPU threads" + (" (default: torch's)" if threads is None else ""))
    if clock is not None:
        parser.add_argument("--clock", choices=sorted(CLOCKS), default=clock,
                            help="wall: elapsed time; cpu: this process's CPU time (steadier on a busy machine)")


def stopwatch(clock: str = "wall"):
    """``seconds(fn)``: runs ``fn()`` and returns the time it took on ``clock`` ("wall" or "cpu")."""
    now = CLOCKS[clock]

    def seconds(fn) -> float:
        start = now()
        fn()
        return now() - start

    return seconds


def random_deit_tiny(batch: int, threads: int | None = None):
    """Random-initialised timm ``deit_tiny_patch16_224`` (no download) and a random batch, seeded
    with 0, after setting torch's CPU threads when ``threads`` is given: ``(model, x, forward)``,
    ``forward()`` being a plain forward of ``x`` under ``torch.no_grad()``."""
    import timm

    if threads:
        torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = timm.create_model("deit_tiny_patch16_224", pretrained=False).eval()
    x = torch.randn(batch, 3, 224, 224)

    def forward():
        with torch.no_grad():
            model(x)

    return model, x, forward


def setup_line(batch: int, clock: str, rounds: int) -> str:
    """The first line a deit-tiny benchmark prints: model, batch, threads, clock, rounds."""
    return (f"deit_tiny_patch16_224 (random init), batch {batch}, CPU, {torch.get_num_threads()} threads, "
            f"{clock}, median of {rounds} rounds")


def ratios_to_forward(forward, methods: dict, rounds: int, seconds):
    """Warm every callable up once, then time each method against a plain forward timed just
    before it, ``rounds`` times: ``({name: [ratio, ...]}, [forward seconds, ...])``."""
    forward()  # warm-up
    for fn in methods.values():
        fn()
    ratios = {name: [] for name in methods}
    forward_times = []
    for _ in range(rounds):
        for name, fn in methods.items():
            t_fwd = seconds(forward)
            forward_times.append(t_fwd)
            ratios[name].append(seconds(fn) / t_fwd)
    return ratios, forward_times


def interleaved_times(variants: dict, rounds: int, seconds) -> dict[str, list[float]]:
    """Warm every variant up once, then time them all in turn, ``rounds`` times:
    ``{name: [seconds per round]}``."""
    for fn in variants.values():  # warm-up
        fn()
    times = {name: [] for name in variants}
    for _ in range(rounds):
        for name, fn in variants.items():
            times[name].append(seconds(fn))
    return times


def median_ratio(times: list[float], reference: list[float]) -> float:
    """The median over rounds of ``times / reference`` of the same round."""
    return statistics.median(t / r for t, r in zip(times, reference))


def median_ratios(variants: dict, rounds: int, reference: str, seconds) -> dict[str, tuple[float, float]]:
    """:func:`interleaved_times`, summed up: ``{name: (median seconds, median ratio to the
    reference's time in the same round)}``."""
    times = interleaved_times(variants, rounds, seconds)
    return {name: (statistics.median(ts), median_ratio(ts, times[reference])) for name, ts in times.items()}


def print_forward_and_backward_ratios(forward, forward_backward, methods: dict, calls: dict, rounds: int,
                                      seconds, width: int, lead: str = "") -> dict:
    """Time ``methods`` (which include ``"forward + backward"``) against a plain forward and against
    one forward and one backward, and print a table: per method the forwards and backwards it
    calls (``calls[name]``), and the median of each ratio. ``lead`` starts the first line. Returns
    the ratios to forward + backward, ``{name: [ratio per round]}``."""
    to_forward, forward_times = ratios_to_forward(forward, methods, rounds, seconds)
    others = {k: v for k, v in methods.items() if k != "forward + backward"}
    to_fwd_bwd, fwd_bwd_times = ratios_to_forward(forward_backward, others, rounds, seconds)
    print(f"{lead}plain forward {statistics.median(forward_times) * 1e3:.1f} ms, forward + backward "
          f"{statistics.median(fwd_bwd_times) * 1e3:.1f} ms (medians)")
    print(f"    {'':<{width}}{'forwards':>9}{'backwards':>10}{'/ forward':>11}{'/ fwd+bwd':>11}")
    for name in methods:
        f, b = calls[name]
        ratio_bwd = f"{statistics.median(to_fwd_bwd[name]):>10.2f}x" if name in to_fwd_bwd else f"{'1.00x':>11}"
        print(f"    {name:<{width}}{f:>9}{b:>10}{statistics.median(to_forward[name]):>10.2f}x{ratio_bwd}")
    return to_fwd_bwd
