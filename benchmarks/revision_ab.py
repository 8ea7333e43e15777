"""One-core encode throughput (or the chunk-parallel speedup) of two git revisions, in alternating processes.

On a shared host two separate runs minutes apart differ by more than most kernel changes; alternating short
processes puts both revisions under the same drift. Each process loads one revision (a git worktree on PYTHONPATH),
encodes one text with a fresh 1-thread CpuEncoder, cold piece caches, and prints the best of `--reps` encodes in
MB/s (best, not median: interference only ever slows a CPU-bound loop down). `--mode parallel` prints instead the
median over `--reps` pairs of serial time / chunk-parallel time (all cores, cold caches, order alternating, 60 ms of
untimed parallel encodes before each pair, as benchmarks/parallel_speedup.py). `--mode warm` times full_encode.py's
warm cell instead (each pass a new instance that first encoded the pool's last 1M characters, then the text), and
`--mode repeat` that instance's second pass over the same text; a case `family:category@size` (e.g.
`qwen3:code@4M`) takes full_encode.py's cell itself (its document, its warm-up region). `--out` writes JSON +
Markdown. Used for the BPE layout figures in docs/pretokenizer.md:

    python benchmarks/revision_ab.py --revs a27fdcd HEAD --cases cl100k_base:mixed qwen3:cjk cl100k_base:cjk4 \\
        --rounds 3 --corpus /tmp/corpus
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from worktrees import worktrees  # noqa: E402

_CHILD = r"""
import json, sys, time
import tokenplane
from tokenplane.tokenize.cpu.parallel import CpuEncoder
root, family, kind, corpus, reps = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5])
assert tokenplane.__file__.startswith(root), tokenplane.__file__
warm = None
if "@" in kind:     # category@size: full_encode.py's cell (its document and its warm-up region), from this tree
    from pathlib import Path
    sys.path.insert(0, root + "/benchmarks")
    import full_encode
    category, size_name = kind.split("@")
    cell = next(c for c in full_encode.cells(Path(corpus), [size_name], 1_000_000) if c[0] == category)
    assert len(cell[2]) == 1 and len(cell[4]) == 1, "one document and one warm-up region"
    text, warm = cell[2][0], cell[4][0]
elif kind.startswith("mixed"):
    pool = "".join(json.loads(l)["text"] for l in open(corpus + "/mixed.jsonl", encoding="utf-8"))
else:
    docs = [json.loads(l) for l in open(corpus + "/nonen.jsonl", encoding="utf-8")]
    pool = "".join(d["text"] for d in docs if d["kind"] in ("man-cjk", "cpython-cjkencodings", "mo-nonlatin"))
if warm is None:
    size = 4_000_000 if kind.endswith("4") else 1_000_000
    text = (pool * (1 + size // max(1, len(pool))))[:size]
mode = sys.argv[6]
if mode in ("warm", "repeat"):   # full_encode.py's warm cell: new instances warmed on 1M other characters
    if warm is None:
        warm = pool[-1_000_000:] if len(pool) >= size + 1_000_000 else None
    assert warm is not None, "the pool is too short for a disjoint warm-up region"
    best = float("inf")
    for _ in range(reps):
        enc = CpuEncoder(tokenplane.load(family), workers=1)
        enc.encode(warm, parallel=False)
        t = time.perf_counter()
        enc.encode(text, parallel=False)
        if mode == "repeat":     # the same text again: every piece cached
            t = time.perf_counter()
            enc.encode(text, parallel=False)
        best = min(best, time.perf_counter() - t)
    print(len(text.encode()) / 1e6 / best)
elif mode == "serial":
    enc = CpuEncoder(tokenplane.load(family), workers=1)
    enc.encode(text, parallel=False)
    best = float("inf")
    for _ in range(reps):
        enc.bpe.clear_caches()
        t = time.perf_counter()
        enc.encode(text, parallel=False)
        best = min(best, time.perf_counter() - t)
    print(len(text.encode()) / 1e6 / best)
else:   # parallel: median over pairs of serial / parallel time, cold caches, 60 ms of parallel encodes before each
    import statistics
    enc = CpuEncoder(tokenplane.load(family))
    ratios = []
    for i in range(reps):
        end = time.perf_counter() + 0.06
        while time.perf_counter() < end:
            enc.encode(text, parallel=True)
        times = {}
        for parallel in ((False, True) if i % 2 else (True, False)):
            enc.bpe.clear_caches()
            t = time.perf_counter()
            enc.encode(text, parallel=parallel)
            times[parallel] = time.perf_counter() - t
        ratios.append(times[False] / times[True])
    print(statistics.median(ratios))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--revs", nargs=2, required=True, help="two git revisions (A B)")
    ap.add_argument("--cases", nargs="+", default=["cl100k_base:mixed", "qwen3:cjk"],
                    help="family:text with text one of mixed, cjk (1M characters), mixed4, cjk4 (4M, tiled), or "
                         "category@size: full_encode.py's cell (e.g. code@4M: its document and warm-up region)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--corpus", default=os.environ.get("TOKENPLANE_CORPUS", "/tmp/corpus"))
    ap.add_argument("--mode", choices=("serial", "warm", "repeat", "parallel"), default="serial",
                    help="serial: one-core MB/s, cold piece caches (best of reps); warm: one-core MB/s of new "
                         "instances that first encoded the pool's last 1M characters (full_encode.py's warm cell, "
                         "best of reps); repeat: the same text a second time; parallel: median serial/parallel "
                         "speedup")
    ap.add_argument("--out", help="also write the rows as JSON and Markdown to OUT.json / OUT.md")
    args = ap.parse_args()
    load_start = os.getloadavg()
    with worktrees(ROOT, args.revs) as trees:
        def run(tree: Path, family: str, kind: str) -> float:
            env = dict(os.environ, PYTHONPATH=str(tree))
            out = subprocess.run([sys.executable, "-c", _CHILD, str(tree), family, kind, args.corpus,
                                  str(args.reps), args.mode], env=env, cwd=tree, check=True, capture_output=True,
                                 text=True)   # cwd: `-c` puts it first on sys.path
            return float(out.stdout.strip().splitlines()[-1])
        for case in args.cases:     # one untimed pass per tree: numba compiles into each tree's cache
            for tree in trees:
                run(tree, *case.split(":"))
        rows = []
        for case in args.cases:
            family, kind = case.split(":")
            pairs = [(run(trees[0], family, kind), run(trees[1], family, kind)) for _ in range(args.rounds)]
            rows.append({"case": case, "speedup" if args.mode == "parallel" else "mb_s": pairs})
            print(f"{case:>20}: " + ", ".join(f"{a:.2f} -> {b:.2f}" for a, b in pairs), flush=True)
    record = {"revs": args.revs, "mode": args.mode, "reps": args.reps, "rounds": args.rounds, "rows": rows,
              "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]), "load_end": os.getloadavg(),
              "load_start": load_start}
    print(json.dumps(record))
    if args.out:
        _write(Path(args.out), record)


def _write(out: Path, record: dict) -> None:
    """OUT.json (the record), OUT.md (a table: per case every round's A -> B, the median of each side and B/A)."""
    import statistics

    out.with_suffix(".json").write_text(json.dumps(record, indent=1))
    key = "speedup" if record["mode"] == "parallel" else "mb_s"
    a, b = record["revs"]
    lines = [f"# revision A/B ({record['mode']})", "",
             f"Command: `{record['command']}`  ",
             f"Load average: {' '.join(f'{x:.2f}' for x in record['load_start'])} (start), "
             f"{' '.join(f'{x:.2f}' for x in record['load_end'])} (end). Alternating processes, each the best of "
             f"{record['reps']} passes; {record['rounds']} rounds.", "",
             f"| case | {a} (median) | {b} (median) | {b} / {a} | rounds (A -> B) |", "|---|---:|---:|---:|---|"]
    for row in record["rows"]:
        pairs = row[key]
        ma, mb = statistics.median(p[0] for p in pairs), statistics.median(p[1] for p in pairs)
        lines.append(f"| {row['case']} | {ma:.1f} | {mb:.1f} | {mb / ma:.2f} | "
                     + ", ".join(f"{x:.1f} -> {y:.1f}" for x, y in pairs) + " |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
