"""Time of the full leaderboard (``python -m vitlab.evaluate``'s table) on held-out shapes scenes.

    python benchmarks/bench_leaderboard.py [--samples 500] [--threads 2] [--k 5,10,20]

Every method of :data:`vitlab.evaluate.METHODS` x every measure (SaCo at each K, the
positive and negative perturbation curves, pointing, mass on object) on ``shapes-vit-tiny``,
one process. Prints the wall time, the time per scene, the number of model forwards the
measures need per scene, and the forwards per second that implies. Run it on an otherwise
idle machine: a second job on 2 cores roughly halves the speed.

Measured 2026-12-01 (2 cores, 2 threads, a machine shared with other jobs):
- ``--samples 100`` (K = 5, 10, 20; 581 measure forwards per scene): 352.5 s, 3.53 s per
  scene, 165 forwards/s; the load average rose from 0.3 to 5 during the run. At that rate
  500 scenes take about 29 minutes.
- The chapter-7 notebook's table (K = 10 only, 311 measure forwards per scene): 500 scenes in
  1528 s at load 4-8; 40 scenes in about 30 s on the idle machine (0.75 s per scene), which
  puts 500 scenes at K = 10 near 6 minutes and the full K = 5, 10, 20 table near 12 minutes
  when the cores are free.
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
