"""Batch encode throughput: `Tokenizer.encode_batch` against the batch APIs users run (tiktoken's
`encode_ordinary_batch`, HF tokenizers' `encode_batch`), on 1 and 2 threads, alternated in one process.

A batch is `--docs` real documents of the benchmark corpus (benchmarks/full_encode.py's categories: english, code,
cjk; documents above 1,000 characters), different documents for every repeat of a cell (no engine sees a batch
twice, so caches only help across documents, as in a server). Before timing, every engine encodes one batch of other
documents with the thread count of the cell (tokenplane's threads keep their piece caches warm from batch to batch;
the others' caches, where they have any, warm up the same way). Each repeat runs every engine once, in a rotated
order; MB/s of UTF-8 input, median and P90 over repeats; every output is compared with the reference IDs
(tokenplane's reference engine: tiktoken for the tiktoken families, HF tokenizers for the others).

  PYTHONPATH=. flock /tmp/bench.lock python benchmarks/encode_batch.py --families cl100k_base,qwen3 \\
      --corpus /tmp/corpus --repeats 7
Writes benchmarks/results/encode_batch.{json,md,png} (`--out` prefix).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))


def _docs(corpus: Path, category: str, max_chars: int = 20_000) -> list[str]:
    """The category's documents (full_encode.CATEGORIES: file and kinds) above 1,000 characters, each cut to at
    most `max_chars` (a batch of prompts, not of whole books)."""
    from full_encode import CATEGORIES

    fname, kinds = CATEGORIES[category]
    out = []
    with open(corpus / f"{fname}.jsonl", encoding="utf-8") as f:
        for line in f:
            d = json.loads(line)
            if d["kind"] in kinds and len(d["text"]) > 1000:
                out.append(d["text"][:max_chars])
    return out


def engines(family: str, threads: int) -> dict[str, Callable[[list[str]], list]]:
    import tokenplane

    tok = tokenplane.load(family)
    out: dict[str, Callable[[list[str]], list]] = {
        "tokenplane": lambda texts: tok.encode_batch(texts, num_threads=threads)}
    ref = tok.reference
    if tok.family.engine == "tiktoken":
        enc = ref.encoding
        out["tiktoken"] = lambda texts: enc.encode_ordinary_batch(texts, num_threads=threads)
    else:
        hf = ref.full
        if threads == 1:    # encode is single-threaded; encode_batch runs on rayon's pool (every CPU)
            out["hf-tokenizers"] = lambda texts: [hf.encode(t, add_special_tokens=False).ids for t in texts]
        elif threads == os.cpu_count():
            out["hf-tokenizers"] = lambda texts: [e.ids for e in hf.encode_batch(texts, add_special_tokens=False)]
    return out


def run_cell(family: str, docs: list[str], threads: int, batch: int, repeats: int) -> dict:
    import tokenplane

    tok = tokenplane.load(family)
    eng = engines(family, threads)
    batches = [docs[i * batch:(i + 1) * batch] for i in range(repeats + 1)]
    batches = [b for b in batches if len(b) == batch]
    if len(batches) < 2:
        raise SystemExit(f"{family}: not enough documents for batches of {batch}")
    warm, timed = batches[0], batches[1:]
    for fn in eng.values():
        fn(warm)
    times: dict[str, list[float]] = {name: [] for name in eng}
    exact: dict[str, bool] = {name: True for name in eng}
    for r, texts in enumerate(timed):
        ref = [tok.encode(t, path="reference") for t in texts]
        names = list(eng)
        names = names[r % len(names):] + names[:r % len(names)]
        for name in names:
            t0 = time.perf_counter()
            got = eng[name](texts)
            times[name].append(time.perf_counter() - t0)
            exact[name] &= all(np.array_equal(np.asarray(g, dtype=np.int64), np.asarray(e, dtype=np.int64))
                               for g, e in zip(got, ref))
    mb = [sum(len(t.encode("utf-8")) for t in texts) / 1e6 for texts in timed]
    out = {"threads": threads, "batch": batch, "repeats": len(timed), "mb_per_batch": statistics.median(mb),
           "engines": {}}
    for name, ts in times.items():
        rates = sorted(m / t for m, t in zip(mb, ts))
        out["engines"][name] = {"mb_s_p50": statistics.median(rates), "mb_s_p10": rates[len(rates) // 10],
                                "ms_p50": statistics.median(ts) * 1e3, "exact": exact[name]}
    return out


def write(results: dict, prefix: Path) -> None:
    prefix.parent.mkdir(parents=True, exist_ok=True)
    prefix.with_suffix(".json").write_text(json.dumps(results, indent=1))
    meta = results["meta"]
    lines = ["# Batch encode throughput (MB/s of UTF-8 input)", "",
             f"Command: `{meta['command']}`  ",
             f"Machine: {meta['machine']}, {meta['cpus']} CPUs; load average {meta['load_start']} (start), "
             f"{meta['load_end']} (end); {meta['when']}.", "",
             "Each cell: batches of real documents (different ones per repeat), engines alternated within a repeat; "
             "median MB/s [P10 MB/s], every output compared with the reference IDs (✗ = a mismatch). tiktoken: "
             "`encode_ordinary_batch(num_threads=k)`; HF tokenizers: `encode` per text on 1 thread, `encode_batch` "
             "(rayon, every CPU) when k is the CPU count.", "",
             "| family | category | threads | docs x MB | " + " | ".join(meta["engine_names"]) + " | tokenplane / best peer |",
             "|---|---|---:|---|" + "---:|" * (len(meta["engine_names"]) + 1)]
    for c in results["cells"]:
        row = []
        best = 0.0
        for name in meta["engine_names"]:
            e = c["engines"].get(name)
            if e is None:
                row.append("-")
                continue
            row.append(f"{e['mb_s_p50']:.1f} [{e['mb_s_p10']:.1f}]" + ("" if e["exact"] else " ✗"))
            if name != "tokenplane":
                best = max(best, e["mb_s_p50"])
        ratio = c["engines"]["tokenplane"]["mb_s_p50"] / best if best else float("nan")
        lines.append(f"| {c['family']} | {c['category']} | {c['threads']} | {c['batch']} x {c['mb_per_batch']:.2f} | "
                     + " | ".join(row) + f" | {ratio:.2f} |")
    prefix.with_suffix(".md").write_text("\n".join(lines) + "\n")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    cells = results["cells"]
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(cells)), 4))
    width = 0.8 / len(meta["engine_names"])
    for k, name in enumerate(meta["engine_names"]):
        xs = [i + k * width for i, c in enumerate(cells) if name in c["engines"]]
        ys = [c["engines"][name]["mb_s_p50"] for c in cells if name in c["engines"]]
        ax.bar(xs, ys, width, label=name)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(cells))])
    ax.set_xticklabels([f"{c['family']}\n{c['category']} x{c['threads']}" for c in cells], fontsize=7)
    ax.set_ylabel("MB/s (median)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(prefix.with_suffix(".png"), dpi=110)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--families", default="cl100k_base,qwen3")
    p.add_argument("--categories", default="english,code,cjk")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--corpus", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "tokenplane_corpus"))
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "encode_batch"))
    args = p.parse_args()
    meta = {"command": "python " + " ".join(sys.argv), "machine": platform.machine(), "cpus": os.cpu_count(),
            "load_start": " ".join(f"{x:.2f}" for x in os.getloadavg()),
            "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    cells = []
    names: list[str] = []
    for cat in args.categories.split(","):
        docs = _docs(Path(args.corpus), cat)
        for fam in args.families.split(","):
            for threads in (int(t) for t in args.threads.split(",")):
                res = run_cell(fam, docs, threads, args.batch, args.repeats)
                res.update(family=fam, category=cat)
                cells.append(res)
                names += [n for n in res["engines"] if n not in names]
                print(json.dumps({k: v for k, v in res.items()}), flush=True)
    meta.update(load_end=" ".join(f"{x:.2f}" for x in os.getloadavg()), engine_names=names)
    write({"meta": meta, "cells": cells}, Path(args.out))
    print(Path(args.out).with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
