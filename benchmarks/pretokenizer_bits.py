"""The bitmap pre-tokenizers (tokenize/cpu/startbits.py) against the run loops they replace in the full encode
(pretokenize._gpt4_loop, _smollm2_loop, _deepseek_loop, _o200k_loop), the stage alone, one core.

For each family and category of benchmarks/full_encode.py (same corpus, same 1M-character documents), in this
process, pinned to one CPU: the run loop (its bool start mask cleared first, as the fused path did) and the bitmap
kernel (which clears its bitmap) on the same code points, alternated `--rounds` times; every bitmap is checked equal
to the loop's starts before timing (o200k: its rare positions too; the rescan around them is not timed). Medians and P90 of wall time; both forms run through the numba JIT (the bitmap
kernels are compiled into the fused AOT exports only). Writes JSON + Markdown + PNG.

  PYTHONPATH=. flock /tmp/bench.lock python benchmarks/pretokenizer_bits.py --corpus /tmp/corpus \\
      --out benchmarks/results/pretokenizer_bits_zen3
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))     # full_encode's corpus cells; tokenplane: PYTHONPATH


def _cell(family: str, text: str, rounds: int) -> dict[str, float]:
    from tokenplane.tokenize.cpu import pretokenize as pt
    from tokenplane.tokenize.cpu import startbits

    loop, args = pt.loop_tables(family)
    table, run_bitmap = startbits.bitmap_form(family)
    cps = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
    n = cps.shape[0]
    c = cps.view(np.int32)
    kind = args[0][cps]
    starts = np.zeros(n, dtype=np.bool_)
    feat = np.zeros(n + startbits.PAD, dtype=np.uint8)
    feat[:n] = table[cps]
    bitmap = np.empty((n >> 6) + 1, dtype=np.uint64)

    rare = np.empty(n + 1, dtype=np.int64)
    found: list[np.ndarray | None] = [None, None]     # o200k's rare positions: the loop's, the bitmap form's

    def run_loop() -> None:
        starts[:] = False
        if loop == "gpt4":
            pt._gpt4_loop(c, kind, args[1], args[2], starts)
        elif loop == "smollm2":
            pt._smollm2_loop(c, kind, starts)
        elif loop == "o200k":
            found[0] = np.sort(rare[:pt._o200k_loop(c, kind, starts, rare)])
        else:
            pt._deepseek_loop(c, kind, starts)

    def run_bits() -> None:
        found[1] = run_bitmap(c, feat, bitmap)

    run_loop()
    run_bits()
    got = np.unpackbits(bitmap.view(np.uint8), bitorder="little")[:n].astype(np.bool_)
    if not np.array_equal(got, starts):
        raise AssertionError(f"{family}: bitmap starts differ from the loop's at {int(np.flatnonzero(got != starts)[0])}")
    if loop == "o200k" and not np.array_equal(found[0], found[1]):
        raise AssertionError(f"{family}: the bitmap form's rare positions differ from the loop's")
    times: dict[str, list[float]] = {"loop": [], "bits": []}
    for r in range(rounds):
        for name, fn in ((("loop", run_loop), ("bits", run_bits)) if r % 2 else (("bits", run_bits), ("loop", run_loop))):
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    out: dict[str, float] = {"chars": n, "pieces": int(starts.sum())}
    for name, v in times.items():
        out[f"{name}_ms"] = statistics.median(v) * 1e3
        out[f"{name}_p90_ms"] = float(np.percentile(v, 90)) * 1e3
    out["speedup"] = out["loop_ms"] / out["bits_ms"]
    return out


def main() -> int:
    from full_encode import stage_meta, stage_setup

    args, jobs = stage_setup(__doc__ or "", "cl100k_base,llama3,qwen3,smollm2,deepseek_v4,o200k_base", 21)
    load0 = os.getloadavg()
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    rows = []
    for family, cat, doc, _ in jobs:
        r = _cell(family, doc, args.rounds)
        rows.append({"family": family, "category": cat, **r})
        print(f"{family} {cat}: loop {r['loop_ms']:.3f} ms, bits {r['bits_ms']:.3f} ms, {r['speedup']:.2f}x",
              flush=True)
    meta = stage_meta(args, started, load0, rows)
    lines = ["# Bitmap pre-tokenizers vs the run loops (the stage alone, one core)", "",
             f"Command: `{meta['command']}`; started {started}; load average {load0[0]:.2f} {load0[1]:.2f} "
             f"{load0[2]:.2f} (start), {meta['load_end'][0]:.2f} (end); CPU {args.cpu}; {args.rounds} alternated "
             "rounds per cell; every bitmap equal to the loop's starts.", "",
             "| family | category | chars | pieces | loop ms (P90) | bits ms (P90) | speedup |",
             "|---|---|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['family']} | {r['category']} | {r['chars']:,} | {r['pieces']:,} | {r['loop_ms']:.3f} "
              f"({r['loop_p90_ms']:.3f}) | {r['bits_ms']:.3f} ({r['bits_p90_ms']:.3f}) | {r['speedup']:.2f}x |"
              for r in rows]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out + ".json").write_text(json.dumps(meta, indent=1))
        Path(args.out + ".md").write_text(text)
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(10, 4))
        labels = [f"{r['family']}\n{r['category']}" for r in rows]
        x = np.arange(len(rows))
        ax.bar(x - 0.2, [r["loop_ms"] for r in rows], 0.4, label="run loop")
        ax.bar(x + 0.2, [r["bits_ms"] for r in rows], 0.4, label="bitmap")
        ax.set_xticks(x, labels, fontsize=7)
        ax.set_ylabel("ms per 1M characters")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.out + ".png", dpi=120)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
