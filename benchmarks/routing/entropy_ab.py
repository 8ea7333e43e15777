"""R-Stitch's entropy signal (route/entropy.py `entropy`, float32 rows) at two git revisions, in alternating processes.

Each process loads one revision (a git worktree on PYTHONPATH), builds the same seeded rows of V = 151,936 float32
logits (near-uniform as the tiny pair's, wide, one peak, a third masked, and one of 1,001 entries for the lanes'
tail), and reports per shape the median and best time of `entropy(row)` over `--reps` calls per row (the row max,
the kernel and the wrapper, as StepResult.normalized_entropy runs them) in ns an entry, and the largest difference of
the normalized entropy from a float64 log_softmax of the same logits. Rounds alternate A and B, so host drift hits
both alike; the processes are pinned to one core when the host allows it.

    flock /tmp/bench.lock env PYTHONPATH=. python benchmarks/routing/entropy_ab.py --revs A B \\
        --out benchmarks/routing/results/entropy_ab_zen3
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

from worktrees import worktrees  # noqa: E402

_CHILD = r"""
import json, math, statistics, sys, time
import numpy as np, torch
import tokenplane
assert tokenplane.__file__.startswith(sys.argv[1]), tokenplane.__file__
from tokenplane.route.entropy import entropy
reps = int(sys.argv[2])
g = torch.Generator().manual_seed(0)
V = 151936
rows = {"near-uniform": torch.randn(8, V, generator=g) * 0.05, "wide": torch.randn(8, V, generator=g) * 5,
        "peaked": torch.randn(8, V, generator=g) * 0.05, "masked": torch.randn(8, V, generator=g),
        "tail (1,001)": torch.randn(8, 1001, generator=g)}
rows["peaked"][:, 11] = 30.0
rows["masked"][:, ::3] = -math.inf
out = {}
for name, x in rows.items():
    n = x.shape[1]
    f64 = torch.log_softmax(x.double(), 1)
    want = -(f64.exp() * torch.nan_to_num(f64, neginf=0.0)).sum(1) / math.log(n)
    err = max(abs(entropy(x[i]) / math.log(n) - float(want[i])) for i in range(x.shape[0]))
    ts = []
    for _ in range(reps):
        for i in range(x.shape[0]):
            t0 = time.perf_counter()
            entropy(x[i])
            ts.append((time.perf_counter() - t0) / n * 1e9)
    out[name] = {"median_ns": statistics.median(ts), "best_ns": min(ts), "max_abs_err": err}
print(json.dumps(out))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--revs", nargs=2, required=True, help="two git revisions (A B)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", help="write OUT.json, OUT.md and OUT.png")
    args = ap.parse_args()
    load_start = os.getloadavg()
    pin = ["taskset", "-c", "1"] if hasattr(os, "sched_getaffinity") and 1 in os.sched_getaffinity(0) else []
    with worktrees(ROOT, args.revs) as trees:
        def run(tree: Path, reps: int) -> dict:
            env = dict(os.environ, PYTHONPATH=str(tree))
            out = subprocess.run([*pin, sys.executable, "-c", _CHILD, str(tree), str(reps)], env=env, cwd=tree,
                                 check=True, capture_output=True, text=True)
            return json.loads(out.stdout.strip().splitlines()[-1])
        for tree in trees:      # numba compiles into each tree's cache first
            run(tree, 1)
        rounds = []
        for r in range(args.rounds):
            got: dict[int, dict] = {}
            for k in ((0, 1) if r % 2 == 0 else (1, 0)):
                got[k] = run(trees[k], args.reps)
            rounds.append([got[0], got[1]])
            print(f"round {r}: " + ", ".join(f"{s} {got[0][s]['median_ns']:.3f} -> {got[1][s]['median_ns']:.3f}"
                                             for s in got[0]), flush=True)
    record = {"revs": args.revs, "rounds": rounds, "reps": args.reps, "load_start": load_start,
              "load_end": os.getloadavg(), "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]])}
    print(json.dumps(record))
    if args.out:
        _write(Path(args.out), record)


def _write(out: Path, record: dict) -> None:
    out.with_suffix(".json").write_text(json.dumps(record, indent=1))
    a, b = record["revs"]
    shapes = list(record["rounds"][0][0])
    lines = [f"# R-Stitch entropy signal, float32 rows: {a} vs {b}", "",
             f"Command: `{record['command']}`  ",
             f"Load average {' '.join(f'{x:.2f}' for x in record['load_start'])} (start), "
             f"{' '.join(f'{x:.2f}' for x in record['load_end'])} (end). {len(record['rounds'])} rounds of "
             f"alternating processes (one core), each the median over {record['reps']} calls a row, 8 rows a shape; "
             "ns an entry of `entropy(row)` (row max + kernel + wrapper). Error: the largest |normalized entropy - "
             "float64 log_softmax's| over the shape's rows.", "",
             f"| shape | {a} ns/entry (median of rounds) | {b} | {a} / {b} | rounds ({a} -> {b}) | error {a} | "
             f"error {b} |", "|---|---:|---:|---:|---|---:|---:|"]
    medians = {}
    for s in shapes:
        pa = [r[0][s]["median_ns"] for r in record["rounds"]]
        pb = [r[1][s]["median_ns"] for r in record["rounds"]]
        ma, mb = statistics.median(pa), statistics.median(pb)
        medians[s] = (ma, mb)
        ea, eb = record["rounds"][0][0][s]["max_abs_err"], record["rounds"][0][1][s]["max_abs_err"]
        lines.append(f"| {s} | {ma:.3f} | {mb:.3f} | {ma / mb:.2f} | "
                     + ", ".join(f"{x:.3f} -> {y:.3f}" for x, y in zip(pa, pb)) + f" | {ea:.1e} | {eb:.1e} |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 3.2))
    xs = range(len(shapes))
    ax.bar([x - 0.2 for x in xs], [medians[s][0] for s in shapes], 0.4, label=a)
    ax.bar([x + 0.2 for x in xs], [medians[s][1] for s in shapes], 0.4, label=b)
    ax.set_xticks(list(xs), shapes, fontsize=8)
    ax.set_ylabel("ns per logit (median)")
    ax.set_title("entropy(row), float32 logits, one core")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=110)


if __name__ == "__main__":
    main()
