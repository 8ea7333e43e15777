"""Warm one-core full encode, tokenplane and the peers alternated pass by pass in one process (full_encode.py's cells).

full_encode.py measures each engine in its own worker, one after the other, so on a host whose speed drifts over
minutes (the shared VMs these records come from) a cell's ratio carries the drift between the workers. Here one
process, pinned to one CPU, runs every engine on the same cell in rotating order, `--rounds` times: each pass is a
new instance that encodes full_encode.py's warm-up region of the category, then the cell's document (its "warm"
figure), then the same document again ("repeat"); every timed pass gets a new str equal to the text
(full_encode.fresh_copies). Every warm output is compared with the reference IDs. Reported per cell: each engine's
median and P90 MB/s, and the per-round ratio tokenplane / best peer (median, and how many rounds tokenplane won).

Runs in the peers' environment (benchmarks/peers/build_tokenizer_peers.sh with --system-site-packages, so tokenplane
imports there too):

  /work/peers/tokpeers-sys/bin/python benchmarks/full_encode_paired.py --families all --sizes 1M,4M \\
      --corpus /tmp/corpus --out benchmarks/results/full_encode_paired
Writes <out>.json, <out>.md and <out>.png.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from full_encode import FAMILIES, OURS_SERIAL, cells, fresh_copies, our_factories, peer_factories  # noqa: E402
from record_files import RunMeta, cell_label, ratio_bars, save_figure, write_record  # noqa: E402

PEERS = ("gigatoken", "fastokens")


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs), q))


def run_cell(factories: dict, doc: str, warm: str, reference: np.ndarray, rounds: int) -> dict:
    nbytes = len(doc.encode("utf-8"))
    names = list(factories)
    warm_s: dict[str, list[float]] = {n: [] for n in names}
    repeat_s: dict[str, list[float]] = {n: [] for n in names}
    exact = {n: True for n in names}
    failed: dict[str, str] = {}
    for r in range(rounds):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            if name in failed:
                continue
            try:
                enc = factories[name]()
                enc(fresh_copies([warm]))
                texts = fresh_copies([doc])
                t0 = time.perf_counter()
                out = enc(texts)[0]
                t1 = time.perf_counter()
                texts = fresh_copies([doc])
                t2 = time.perf_counter()
                enc(texts)
                t3 = time.perf_counter()
            except Exception as exc:  # noqa: BLE001 - a peer that cannot load this file: reported, not timed
                failed[name] = f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:160]}"
                continue
            warm_s[name].append(t1 - t0)
            repeat_s[name].append(t3 - t2)
            exact[name] = exact[name] and bool(np.array_equal(np.asarray(out, dtype=np.int64), reference))
    row: dict = {"bytes": nbytes, "rounds": rounds, "engines": {}, "failed": failed}
    for name in names:
        if name in failed or not warm_s[name]:
            continue
        mbps = [nbytes / t / 1e6 for t in warm_s[name]]
        rep = [nbytes / t / 1e6 for t in repeat_s[name]]
        row["engines"][name] = {"warm_p50": statistics.median(mbps), "warm_p10": pct(mbps, 10),
                                "repeat_p50": statistics.median(rep), "exact": exact[name]}
    exact_peers = [n for n in names if n != OURS_SERIAL and n in row["engines"] and row["engines"][n]["exact"]]
    if OURS_SERIAL in row["engines"] and exact_peers:
        # per round: ours / the fastest exact peer of that round
        ratios = [min(warm_s[p][i] for p in exact_peers) / warm_s[OURS_SERIAL][i]
                  for i in range(min(len(warm_s[OURS_SERIAL]), *(len(warm_s[p]) for p in exact_peers)))]
        best = max(exact_peers, key=lambda p: row["engines"][p]["warm_p50"])
        row.update(best_peer=best, ratio_p50=statistics.median(ratios), ratio_p10=pct(ratios, 10),
                   wins=sum(x >= 1.0 for x in ratios), pairs=len(ratios))
    return row


def markdown(rows: list[dict], meta: dict) -> str:
    lines = ["# Warm one-core full encode, engines alternated in one process (MB/s of UTF-8 input)\n",
             f"Command: `{meta['command']}`  ",
             f"Machine: {meta['machine']}; pinned to CPU {meta['cpu']}; load average {meta['load_start']} (start), "
             f"{meta['load_end']} (end); started {meta['started']}, {meta['wall_s']:.0f} s.\n",
             "Each round: every engine (rotating order) builds a new instance, encodes the category's warm-up region, "
             "then the cell's document (warm, timed) and the document again (repeat, timed); new str objects each "
             "pass. ratio = tokenplane / the fastest exact peer, per round: median [P10], rounds tokenplane was "
             "ahead. MB/s: median [P10] over rounds. ✗: an output differs from the reference.\n",
             "| family | cell | tokenplane warm | gigatoken warm | fastokens warm | tokenplane repeat | "
             "gigatoken repeat | ratio (vs best peer) | target |",
             "|---|---|---:|---:|---:|---:|---:|---|---|"]
    for r in rows:
        e = r["engines"]

        def cell(name: str, key: str) -> str:
            if name not in e:
                return "error" if name in r["failed"] else "-"
            v = e[name]
            mark = "" if v["exact"] else " ✗"
            return (f"{v[key]:.1f} [{v['warm_p10']:.1f}]{mark}" if key == "warm_p50" else f"{v[key]:.1f}{mark}")
        ratio = (f"{r['ratio_p50']:.3f} [{r['ratio_p10']:.3f}], {r['wins']}/{r['pairs']} ({r['best_peer']})"
                 if "ratio_p50" in r else "no exact peer")
        target = ("-" if "ratio_p50" not in r else "met" if r["ratio_p50"] >= 1.0 else "NOT met")
        lines.append(f"| {r['family']} | {r['category']} {r['size']} | {cell(OURS_SERIAL, 'warm_p50')} | "
                     f"{cell('gigatoken', 'warm_p50')} | {cell('fastokens', 'warm_p50')} | "
                     f"{cell(OURS_SERIAL, 'repeat_p50')} | {cell('gigatoken', 'repeat_p50')} | {ratio} | {target} |")
    errors = sorted({f"{r['family']} {n}: {msg}" for r in rows for n, msg in r["failed"].items()})
    if errors:
        lines += ["", "Errors:", *(f"- {m}" for m in errors)]
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rs = [r for r in rows if "ratio_p50" in r]
    if not rs:
        return
    fig, ax = plt.subplots(figsize=(max(6, 0.45 * len(rs)), 4))
    labels = [cell_label(r) for r in rs]
    ratio_bars(ax, labels, [r["ratio_p50"] for r in rs], "tokenplane / fastest exact peer (warm, one core)",
               ["tab:blue" if r["ratio_p50"] >= 1 else "tab:gray" for r in rs])
    save_figure(fig, path)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--families", default="all")
    p.add_argument("--categories", default="english,code,cjk")
    p.add_argument("--sizes", default="1M,4M")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--corpus", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "tokenplane_corpus"))
    p.add_argument("--cpu", type=int, default=1)
    p.add_argument("--out", default="benchmarks/results/full_encode_paired")
    args = p.parse_args()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {args.cpu})
    import tokenplane

    families = FAMILIES if args.families == "all" else tuple(args.families.split(","))
    run = RunMeta()
    rows = []
    for family in families:
        tok, ours = our_factories(family, 1)
        from tokenplane.tokenize.spec.artifacts import artifact_file

        spec = {"file": str(artifact_file(family)), "engine": tok.family.engine, "pattern": tok.family.patterns[0],
                "specials": dict(tok.family.specials)}
        factories = {OURS_SERIAL: ours[OURS_SERIAL], **peer_factories(spec, 1, PEERS)}
        for cat, size, docs, tiled, warm_docs in cells(Path(args.corpus), args.sizes.split(","), 1_000_000):
            if cat not in args.categories.split(","):
                continue
            from full_encode import reference_ids

            reference = np.asarray(reference_ids(tok, docs[:1])[0], dtype=np.int64)
            row = {"family": family, "category": cat, "size": size, "tiled": tiled,
                   **run_cell(factories, docs[0], warm_docs[0], reference, args.rounds)}
            rows.append(row)
            print(json.dumps({k: row[k] for k in ("family", "category", "size", "ratio_p50", "wins", "pairs")
                              if k in row}), flush=True)
    meta = run.meta(cpu=args.cpu, tokenplane=tokenplane.__file__)
    print(write_record(Path(args.out), meta, rows, markdown, plot))
    return 0


if __name__ == "__main__":
    sys.exit(main())
