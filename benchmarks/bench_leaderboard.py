"""Time of the full leaderboard (``python -m vitlab.evaluate``'s table) on held-out shapes scenes.

    python benchmarks/bench_leaderboard.py [--samples 500] [--threads 2] [--k 5,10,20]

Every method of :data:`vitlab.evaluate.METHODS` x every measure (SaCo at each K, the
positive and negative perturbation curves, pointing, mass on object) on ``shapes-vit-tiny``,
one process. Prints the wall time, the time per scene, the number of model forwards the
measures need per scene, and the forwards per second that implies. Run it on an otherwise
idle machine: a second job on 2 cores roughly halves the speed.
"""
from __future__ import annotations

import argparse
import time

import torch

import vitlab
from vitlab import evaluate as ev


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=500)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--k", default="5,10,20")
    ap.add_argument("--chunk", type=int, default=20)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ks = [int(k) for k in args.k.split(",")]
    model = vitlab.load_model("shapes-vit-tiny")
    data = ev.ShapesData(model, args.samples)
    t0 = time.perf_counter()
    board = ev.leaderboard(model, data, ks=ks, chunk=args.chunk)
    seconds = time.perf_counter() - t0
    M = len(board.methods)
    curve_points = 2 * 10                                   # positive and negative, fractions 0 .. 0.9
    forwards = 1 + M * (sum(k + 1 for k in ks) + curve_points)  # per scene; the maps' own passes not counted
    print(board.format())
    print(f"\n{args.samples} scenes, {M} methods, K = {ks}, {args.threads} threads: {seconds:.1f} s "
          f"({seconds / args.samples:.2f} s per scene); {forwards} measure forwards per scene, "
          f"{forwards * args.samples / seconds:.0f} forwards/s overall")


if __name__ == "__main__":
    main()
