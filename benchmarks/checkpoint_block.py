"""Records' checkpoint block size (records.SHIFT) of two git revisions, in alternating processes.

An edit that changes a session's token count moves every checkpoint right of it (records._moved_checkpoints: one
record read per block, a cache miss each on IDs the previous edit's memmove pushed out), so fewer, larger blocks
make the edit cheaper; a search by position (records.locate) then scans a longer block. Each process loads one
revision (a git worktree on PYTHONPATH; JIT kernels in both, TOKENPLANE_AOT=0, so neither side runs a module built
for the other's sources) and prints, as medians over `--reps`:

- `moved_cold_ms`: the moved checkpoints of a 1.42M-record array (qwen3 IDs of real text) for an edit at a random
  20-80% position that adds one token, after a 64 MB write evicted the caches; `moved_warm_ms`: the same call again;
- `moved_exceptions_ms`: the same call (warm) on the same records with 200 end exceptions spread over them;
- `locate_us`: one position search at a random character offset;
- `edit_ms`: a real session edit (20 characters replaced by 20 others at 20-80% of a 4M-character qwen3 context,
  then the IDs read), the records' whole cost in place, with its exactness checked against the reference at the end;
  it runs after the eviction and the calls above, so it is a cold edit (session_repair.py times warm ones).

    python benchmarks/checkpoint_block.py --revs f36cb0f HEAD --rounds 4 --out benchmarks/results/checkpoint_block
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from worktrees import worktrees  # noqa: E402

_CHILD = r"""
import json, random, statistics, sys, time
import numpy as np
import tokenplane
from tokenplane.tokenize import records
from tokenplane.tokenize.cpu import kernels
root, corpus, reps = sys.argv[1], sys.argv[2], int(sys.argv[3])
assert tokenplane.__file__.startswith(root), tokenplane.__file__
k = kernels.get()
tok = tokenplane.load("qwen3")
pool = "".join(json.loads(l)["text"] for l in open(corpus + "/mixed.jsonl", encoding="utf-8"))
context = ("cafe\u0301 " + pool)[:4_000_000]
session = tok.session(encode_path="cpu")
session.sync(context)
ids = np.ascontiguousarray(session.ids)
n, tc, S = len(ids), tok.vocab_facts.token_chars, records.SHIFT
ends = np.cumsum(tc[ids].astype(np.int64))
ck = np.zeros((n >> S) + 2, np.int64)
ck[1:((n - 1) >> S) + 1] = ends[(np.arange(1, ((n - 1) >> S) + 1) << S) - 1]
none = np.zeros(0, np.int64)
# the same records with 200 exceptions (smollm2 on text holding a byte it lacks, e.g. a stray control character)
ex_i = np.sort(np.random.default_rng(0).choice(n, 200, replace=False)).astype(np.int64)
ex_v = np.ones(200, np.int64)
steps = tc[ids].astype(np.int64)
steps[ex_i] += ex_v
ends_x = np.cumsum(steps)
ck_x = np.zeros_like(ck)
ck_x[1:((n - 1) >> S) + 1] = ends_x[(np.arange(1, ((n - 1) >> S) + 1) << S) - 1]
sweep = np.ones(8 << 20)
rng = random.Random(1)
cold, warm, locate, edit, exc = [], [], [], [], []
for _ in range(reps):
    keep = rng.randrange(n // 5, 4 * n // 5)
    j_first = (keep >> S) + 1
    out = np.empty((n >> S) - j_first + 1, np.int64)
    np.add(sweep, 1.0, out=sweep)
    t = time.perf_counter(); k.rec_moved_checkpoints(ids, ck, tc, none, none, n, 1, 3, j_first, out)
    cold.append(time.perf_counter() - t)
    t = time.perf_counter(); k.rec_moved_checkpoints(ids, ck, tc, none, none, n, 1, 3, j_first, out)
    warm.append(time.perf_counter() - t)
    t = time.perf_counter(); k.rec_moved_checkpoints(ids, ck_x, tc, ex_i, ex_v, n, 1, 3, j_first, out)
    exc.append(time.perf_counter() - t)
    xs = [rng.randrange(0, int(ends[-1])) for _ in range(100)]
    t = time.perf_counter()
    for x in xs:
        k.rec_locate(ids, ck, tc, none, none, n, x)
    locate.append((time.perf_counter() - t) / len(xs))
    a, src = rng.randrange(len(context) // 5, 4 * len(context) // 5), rng.randrange(0, len(pool) - 20)
    t = time.perf_counter()
    session.edit(a, a + 20, pool[src:src + 20])
    np.asarray(session.ids)
    edit.append(time.perf_counter() - t)
exact = bool(np.array_equal(np.asarray(session.ids, np.int64), tok.encode(session.text).astype(np.int64)))
med = lambda v: statistics.median(v)
print(json.dumps({"shift": S, "moved_cold_ms": med(cold) * 1e3, "moved_warm_ms": med(warm) * 1e3,
                  "locate_us": med(locate) * 1e6, "moved_exceptions_ms": med(exc) * 1e3, "edit_ms": med(edit) * 1e3, "exact": exact}))
"""

METRICS = ("moved_cold_ms", "moved_warm_ms", "moved_exceptions_ms", "locate_us", "edit_ms")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--revs", nargs=2, required=True, help="two git revisions (A B)")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--corpus", default=os.environ.get("TOKENPLANE_CORPUS", "/tmp/corpus"))
    ap.add_argument("--out", help="write OUT.json, OUT.md and OUT.png")
    args = ap.parse_args()
    load_start = os.getloadavg()
    args.revs = [subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", rev], check=True, capture_output=True,
                                text=True).stdout.strip() for rev in args.revs]
    with worktrees(ROOT, args.revs) as trees:
        def run(tree: Path, reps: int) -> dict:
            env = dict(os.environ, PYTHONPATH=str(tree), TOKENPLANE_AOT="0")
            out = subprocess.run([sys.executable, "-c", _CHILD, str(tree), args.corpus, str(reps)], env=env,
                                 cwd=tree, capture_output=True, text=True)
            if out.returncode:
                raise SystemExit(f"{tree}: the child failed:\n{out.stderr[-3000:]}")
            return json.loads(out.stdout.strip().splitlines()[-1])
        for tree in trees:      # one untimed pass per tree: numba compiles into each tree's cache
            run(tree, 2)
        rounds = []
        for r in range(args.rounds):
            order = (0, 1) if r % 2 == 0 else (1, 0)
            got = {i: run(trees[i], args.reps) for i in order}
            rounds.append([got[0], got[1]])
            print(json.dumps(rounds[-1]), flush=True)
    record = {"revs": args.revs, "rounds": rounds, "reps": args.reps, "load_start": load_start,
              "load_end": os.getloadavg(), "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]])}
    if args.out:
        write(Path(args.out), record)


def write(out: Path, record: dict) -> None:
    out.with_suffix(".json").write_text(json.dumps(record, indent=1))
    a, b = record["revs"]
    sa, sb = record["rounds"][0][0]["shift"], record["rounds"][0][1]["shift"]
    lines = ["# Checkpoint block size: moved checkpoints, position search, edits", "",
             f"Command: `{record['command']}`  ",
             f"Load average {' '.join(f'{x:.2f}' for x in record['load_start'])} at start, "
             f"{' '.join(f'{x:.2f}' for x in record['load_end'])} at end. Alternating processes (order swapped "
             f"each round), each cell the median of {record['reps']} calls; {len(record['rounds'])} rounds. "
             f"A = {a} (blocks of {1 << sa} records), B = {b} (blocks of {1 << sb}).", "",
             "| metric | A median of rounds | B median of rounds | B / A | rounds (A -> B) |",
             "|---|---:|---:|---:|---|"]
    for m in METRICS:
        if any(m not in side for r in record["rounds"] for side in r):
            continue        # a record made before the metric existed
        va = [r[0][m] for r in record["rounds"]]
        vb = [r[1][m] for r in record["rounds"]]
        ma, mb = statistics.median(va), statistics.median(vb)
        lines.append(f"| {m} | {ma:.3f} | {mb:.3f} | {mb / ma:.2f} | "
                     + ", ".join(f"{x:.3f} -> {y:.3f}" for x, y in zip(va, vb)) + " |")
    exact = all(side["exact"] for r in record["rounds"] for side in r)
    lines += ["", f"Edited sessions' final IDs equal the reference's in every process: {exact}."]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:     # pragma: no cover - the figure is optional
        return
    fig, axes = plt.subplots(1, len(METRICS), figsize=(3.2 * len(METRICS), 3))
    for ax, m in zip(axes, METRICS):
        if any(m not in side for r in record["rounds"] for side in r):
            continue
        for side, label in ((0, f"A {1 << sa}"), (1, f"B {1 << sb}")):
            ax.plot(range(1, len(record["rounds"]) + 1), [r[side][m] for r in record["rounds"]], "o-", label=label)
        ax.set_title(m)
        ax.set_xlabel("round")
        ax.set_ylim(bottom=0)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=110)


if __name__ == "__main__":
    main()
