"""Where a two-thread encode loses against twice the one-thread speed: glue, imbalance, or the threads slowing each
other down. For each cell (full_encode.py's documents), one encoder with two workers, pieces cached (the `warm`
rows of parallel_speedup.py), alternating in rounds:

  serial      CpuEncoder.encode(text, parallel=False)
  one thread  the spans of the parallel encode's own chunks (its chunk trace), encoded one after another on the
              calling thread: the work of the chunks with no second thread running
  parallel    CpuEncoder.encode(text, parallel=True), with each chunk's thread and start/end (`chunk_trace`)

and from the trace: the threads' busy time (sum of their chunks) against `one thread` (> 1: the same chunks took
longer with both threads running), the time before the first chunk starts and after the last ends (the serial
glue), and the idle time of the thread that finished first (imbalance). Then the same two-threads-at-once question
without tokenplane: numba loops that read random entries of a table of the piece map's size (one table per thread)
or compute in registers only, run on one thread and on two at once. Every output is checked against the reference.

    python benchmarks/parallel_contention.py --corpus /tmp/corpus --out benchmarks/results/parallel_contention
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from full_encode import cells  # noqa: E402
from record_files import RunMeta, cell_label, ratio_bars, save_figure, write_record  # noqa: E402


def _median(xs: list[float]) -> float:
    return float(statistics.median(xs))


def run_cell(family: str, doc: str, rounds: int, warmup: int, warmup_s: float) -> dict[str, Any]:
    import tokenplane
    from tokenplane.tokenize.cpu.parallel import CpuEncoder

    tok = tokenplane.load(family)
    enc = CpuEncoder(tok, workers=2)
    ref = np.asarray(tok.encode(doc, path="reference"))
    for _ in range(warmup):     # both threads' piece maps hold the text's pieces; both cores busy
        enc.encode(doc, parallel=True)
        enc.encode(doc, parallel=False)
    serial, one, par, busy, start, tail, idle, chunks = [], [], [], [], [], [], [], []
    for _ in range(rounds):
        # warmup_s of untimed parallel encodes first (parallel_speedup.py's warm-up: a vCPU idle for a while runs
        # the encoder slowly for its first ~40 ms)
        end = time.perf_counter() + warmup_s
        while time.perf_counter() < end:
            enc.encode(doc, parallel=True)
        trace: list[tuple[int, int, int, float, float]] = []
        enc.chunk_trace = trace
        x = (doc + "\0")[:-1]
        t0 = time.perf_counter()
        ids = enc.encode(x, parallel=True)
        t1 = time.perf_counter()
        enc.chunk_trace = None
        if not np.array_equal(ids, ref):
            raise AssertionError(f"{family}: parallel encode differs from the reference")
        spans = sorted((a, b) for _, a, b, _, _ in trace)
        x = (doc + "\0")[:-1]
        raw_chunks = enc._nfc_inert is not None and not x.isascii()     # as CpuEncoder.encode_parallel cuts them
        t2 = time.perf_counter()
        s = x if raw_chunks else tok.normalize(x)
        for a, b in spans:      # the chunks' own work (parallel._encode_parallel's encode_span), on this thread
            chunk = enc._chunk_nfc(s, a, b) if raw_chunks else None
            if chunk is not None:
                enc._encode_blocks(chunk, 0, len(chunk), s[b:b + 1])
            else:
                enc._encode_blocks(s, a, b, s[b:b + 1])
        t3 = time.perf_counter()
        x = (doc + "\0")[:-1]
        t4 = time.perf_counter()
        enc.encode(x, parallel=False)
        t5 = time.perf_counter()
        threads = sorted({th for th, *_ in trace})
        per = [sum(e - s for th, _, _, s, e in trace if th == t) for t in threads]
        ends = [max(e for th, _, _, _, e in trace if th == t) for t in threads]
        par.append(t1 - t0)
        one.append(t3 - t2)
        serial.append(t5 - t4)
        busy.append(sum(per))
        start.append(min(s for *_, s, _ in trace) - t0)
        tail.append(t1 - max(ends))
        idle.append(max(ends) - min(ends) if len(ends) > 1 else 0.0)
        chunks.append(len(trace))
    return {"family": family, "serial_ms": _median(serial) * 1e3, "one_thread_ms": _median(one) * 1e3,
            "parallel_ms": _median(par) * 1e3, "speedup": _median([s / p for s, p in zip(serial, par)]),
            "busy_ms": _median(busy) * 1e3, "inflation": _median([b / o for b, o in zip(busy, one)]),
            "start_ms": _median(start) * 1e3, "tail_ms": _median(tail) * 1e3, "idle_ms": _median(idle) * 1e3,
            "chunks": int(_median([float(c) for c in chunks])), "rounds": rounds}


def synthetic(table_mb: list[int], rounds: int) -> list[dict[str, Any]]:
    from numba import njit

    @njit(nogil=True, cache=False)
    def reads(tab: np.ndarray, n: int, seed: int) -> int:
        x = np.uint64(seed)
        acc = np.uint64(0)
        mask = np.uint64(tab.shape[0] - 1)
        for _ in range(n):
            x = x * np.uint64(6364136223846793005) + np.uint64(1442695040888963407)
            acc += tab[np.int64((x >> np.uint64(33)) & mask)]
        return int(acc)

    @njit(nogil=True, cache=False)
    def registers(n: int, seed: int) -> int:
        x = np.uint64(seed)
        for _ in range(n):
            x = x * np.uint64(6364136223846793005) + np.uint64(1442695040888963407)
            x ^= x >> np.uint64(13)
        return int(x)

    def timed(fn: Callable[..., int], args: list[tuple[Any, ...]]) -> float:
        """The slowest thread's time when len(args) threads run fn at once."""
        times = [0.0] * len(args)

        def work(i: int) -> None:
            t0 = time.perf_counter()
            fn(*args[i])
            times[i] = time.perf_counter() - t0
        threads = [threading.Thread(target=work, args=(i,)) for i in range(len(args))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return max(times)

    out = []
    n = 3_000_000
    for mb in table_mb:
        tabs = [np.ones((mb << 20) // 8, np.uint64) for _ in range(2)]
        reads(tabs[0], 10, 1)
        one, two = [], []
        for _ in range(rounds):
            one.append(timed(reads, [(tabs[0], n, 1)]))
            two.append(timed(reads, [(tabs[0], n, 1), (tabs[1], n, 2)]))
        out.append({"loop": f"random reads, {mb} MB table a thread", "one_ms": _median(one) * 1e3,
                    "two_ms": _median(two) * 1e3, "slowdown": _median([b / a for a, b in zip(one, two)])})
    registers(10, 1)
    one, two = [], []
    for _ in range(rounds):
        one.append(timed(registers, [(20_000_000, 1)]))
        two.append(timed(registers, [(20_000_000, 1), (20_000_000, 2)]))
    out.append({"loop": "registers only", "one_ms": _median(one) * 1e3, "two_ms": _median(two) * 1e3,
                "slowdown": _median([b / a for a, b in zip(one, two)])})
    return out


def markdown(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    lines = ["# Two-thread encode: glue, imbalance, or contention\n",
             f"Command: `{meta['command']}`  ",
             f"Machine: {meta['machine']}; load average {meta['load_start']} (start), {meta['load_end']} (end); "
             f"started {meta['started']}, {meta['wall_s']:.0f} s.\n",
             "One encoder with two workers, pieces cached (after untimed parallel and serial encodes of the text), "
             f"medians over rounds; each round's parallel encode follows {meta['warmup_ms']:.0f} ms of untimed "
             "parallel encodes (as parallel_speedup.py's warm-up rows). one thread: the parallel encode's own chunks encoded one after another on one "
             "thread. inflation: the two threads' busy time (their chunks) / one thread: above 1, the same chunks "
             "ran slower with both threads at work. start: before the first chunk starts; tail: after the last "
             "ends; idle: the first thread to finish waits this long.\n",
             "| cell | serial ms | one thread ms | parallel ms | speedup | busy ms | inflation | start ms | tail ms "
             "| idle ms | chunks |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if "loop" in r:
            continue
        lines.append(f"| {r['family']} {r['category']} {r['size']} | {r['serial_ms']:.2f} | {r['one_thread_ms']:.2f} "
                     f"| {r['parallel_ms']:.2f} | {r['speedup']:.2f}x | {r['busy_ms']:.2f} | {r['inflation']:.2f} "
                     f"| {r['start_ms']:.3f} | {r['tail_ms']:.3f} | {r['idle_ms']:.3f} | {r['chunks']} |")
    lines += ["", "The same question without tokenplane: numba loops on one thread, then on two at once (each its own "
              "table), the slower thread's time.\n", "| loop | one thread ms | two at once ms | slowdown |",
              "|---|---:|---:|---:|"]
    for r in rows:
        if "loop" in r:
            lines.append(f"| {r['loop']} | {r['one_ms']:.1f} | {r['two_ms']:.1f} | {r['slowdown']:.2f}x |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    enc = [r for r in rows if "loop" not in r]
    syn = [r for r in rows if "loop" in r]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    labels = [cell_label(r) for r in enc]
    ratio_bars(axes[0], labels, [r["inflation"] for r in enc], "busy time with two threads / one thread", "tab:orange")
    ratio_bars(axes[1], [r["loop"] for r in syn], [r["slowdown"] for r in syn], "two threads at once / one thread",
               "tab:gray")
    save_figure(fig, path)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--corpus", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "tokenplane_corpus"))
    p.add_argument("--out", default="benchmarks/results/parallel_contention")
    p.add_argument("--families", default="cl100k_base,o200k_base,qwen3,deepseek_v4")
    p.add_argument("--categories", default="english,code")
    p.add_argument("--sizes", default="1M,4M")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--warmup", type=int, default=10, help="untimed parallel + serial encode pairs before a cell")
    p.add_argument("--warmup-ms", type=float, default=60.0,
                   help="untimed parallel encodes right before each round's timed one (0: a second vCPU that idled)")
    p.add_argument("--tables-mb", default="2,4,8,16", help="table sizes of the synthetic random-read loop")
    args = p.parse_args()
    run = RunMeta()
    rows: list[dict[str, Any]] = []
    for cat, size, docs, _, _ in cells(Path(args.corpus), args.sizes.split(","), 1_000_000):
        if cat not in args.categories.split(","):
            continue
        for family in args.families.split(","):
            row = {"category": cat, "size": size, **run_cell(family, docs[0], args.rounds, args.warmup, args.warmup_ms / 1e3)}
            rows.append(row)
            print(f"{family} {cat} {size}: speedup {row['speedup']:.2f}x, inflation {row['inflation']:.2f}, "
                  f"start {row['start_ms']:.3f} ms, tail {row['tail_ms']:.3f} ms, idle {row['idle_ms']:.3f} ms",
                  flush=True)
    rows += synthetic([int(x) for x in args.tables_mb.split(",")], args.rounds)
    meta = run.meta(warmup_ms=args.warmup_ms)
    print(write_record(Path(args.out), meta, rows, markdown, plot))
    return 0


if __name__ == "__main__":
    sys.exit(main())
