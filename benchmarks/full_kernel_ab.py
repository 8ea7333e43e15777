"""The fused block kernel against the staged chain it replaced, the same encoder on both sides (CpuEncoder's
`full_kernel` flag: on, one GIL-free call per block, fullencode.py; off, the run-loop pre-tokenizer with bool starts
and, for o200k, the Python rescan of its rare shapes, then the same piece-map walk), one core, in one process.

For each family and category of benchmarks/full_encode.py (same corpus, same 1M-character documents, same warm-up
region): two encoders, one per setting, each warmed on the warm-up region; every round restores each encoder's piece
map to its post-warm-up snapshot and times one encode of the document (warm: the pieces the warm-up did not hold are
new to it, as in full_encode.py's warm figure), then the same document again (repeat); the two settings alternate
and swap order every round. Reported: medians, P90 and the per-round ratio (staged / fused) median with P10-P90;
every output checked against the reference IDs. Writes JSON + Markdown + PNG.

  PYTHONPATH=. flock /tmp/bench.lock python benchmarks/full_kernel_ab.py --corpus /tmp/corpus \\
      --families o200k_base --out benchmarks/results/full_kernel_ab_zen3_o200k
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


def _cell(family: str, doc: str, warm: str, rounds: int) -> dict[str, float]:
    import tokenplane
    from tokenplane.tokenize.cpu.parallel import CpuEncoder
    from tokenplane.tokenize.spec.artifacts import artifact_bytes
    from tokenplane.tokenize.tokenizer import Tokenizer

    tok = tokenplane.load(family)
    ref = tok.reference.encode_ordinary(doc)
    encs = {}
    for name, flag in (("staged", False), ("fused", True)):
        enc = CpuEncoder(Tokenizer(family, tok.family, artifact_bytes(family)), workers=1)
        enc.full_kernel = flag
        enc.encode(warm, parallel=False)
        pm = enc.bpe.thread_cache().pmap
        encs[name] = (enc, pm, (pm.slots.copy(), pm.arena.copy(), pm.state.copy()))
    t: dict[str, list[float]] = {}
    for r in range(rounds):
        order = list(encs.items())
        for name, (enc, pm, snap) in (order if r % 2 == 0 else order[::-1]):
            np.copyto(pm.slots, snap[0])
            np.copyto(pm.arena, snap[1])
            np.copyto(pm.state, snap[2])
            t0 = time.thread_time()
            ids = enc.encode(doc, parallel=False)
            t.setdefault(f"{name}_warm", []).append(time.thread_time() - t0)
            t0 = time.thread_time()
            again = enc.encode(doc, parallel=False)
            t.setdefault(f"{name}_repeat", []).append(time.thread_time() - t0)
            if r == 0 and not (np.array_equal(ids, ref) and np.array_equal(again, ref)):
                raise AssertionError(f"{family} {name}: IDs differ from the reference")
    out: dict[str, float] = {"chars": len(doc), "bytes": len(doc.encode("utf-8"))}
    for k, v in t.items():
        out[f"{k}_ms"] = statistics.median(v) * 1e3
        out[f"{k}_p90_ms"] = float(np.percentile(v, 90)) * 1e3
    for kind in ("warm", "repeat"):
        ratio = [a / b for a, b in zip(t[f"staged_{kind}"], t[f"fused_{kind}"])]
        out[f"{kind}_ratio"] = statistics.median(ratio)
        out[f"{kind}_ratio_p10"] = float(np.percentile(ratio, 10))
        out[f"{kind}_ratio_p90"] = float(np.percentile(ratio, 90))
    return out


def main() -> int:
    from full_encode import stage_meta, stage_setup

    from tokenplane.tokenize.cpu import kernels

    args, jobs = stage_setup(__doc__ or "", "o200k_base", 15)
    load0 = os.getloadavg()
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    rows = []
    for family, cat, doc, warm in jobs:
        r = _cell(family, doc, warm, args.rounds)
        rows.append({"family": family, "category": cat, **r})
        print(f"{family} {cat}: warm staged {r['staged_warm_ms']:.2f} fused {r['fused_warm_ms']:.2f} ms "
              f"({r['warm_ratio']:.2f}x), repeat {r['repeat_ratio']:.2f}x", flush=True)
    meta = {**stage_meta(args, started, load0, rows), "kernels": kernels.get().kind}
    lines = ["# Fused block kernel vs the staged chain (CpuEncoder.full_kernel), one core, one process", "",
             f"Command: `{meta['command']}`; started {started}; load average {load0[0]:.2f} {load0[1]:.2f} "
             f"{load0[2]:.2f} (start), {meta['load_end'][0]:.2f} (end); CPU {args.cpu}; kernels {meta['kernels']}; "
             f"{args.rounds} alternated rounds per cell; every output equal to the reference IDs. warm: each round "
             "restores the encoder's piece map to its state after the warm-up region; repeat: the same document "
             "again. Ratio: staged / fused per round, median [P10-P90].", "",
             "| family | category | MB | staged warm ms (P90) | fused warm ms (P90) | warm ratio | staged repeat ms | "
             "fused repeat ms | repeat ratio |", "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['family']} | {r['category']} | {r['bytes'] / 1e6:.2f} | {r['staged_warm_ms']:.2f} "
                     f"({r['staged_warm_p90_ms']:.2f}) | {r['fused_warm_ms']:.2f} ({r['fused_warm_p90_ms']:.2f}) | "
                     f"{r['warm_ratio']:.2f}x [{r['warm_ratio_p10']:.2f}-{r['warm_ratio_p90']:.2f}] | "
                     f"{r['staged_repeat_ms']:.2f} | {r['fused_repeat_ms']:.2f} | {r['repeat_ratio']:.2f}x "
                     f"[{r['repeat_ratio_p10']:.2f}-{r['repeat_ratio_p90']:.2f}] |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out + ".json").write_text(json.dumps(meta, indent=1))
        Path(args.out + ".md").write_text(text)
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3))
        labels = [f"{r['family'].split('_')[0]} {r['category']}" for r in rows]
        x = np.arange(len(rows))
        ax.bar(x - 0.2, [r["bytes"] / 1e3 / r["staged_warm_ms"] for r in rows], 0.4, label="staged")
        ax.bar(x + 0.2, [r["bytes"] / 1e3 / r["fused_warm_ms"] for r in rows], 0.4, label="fused")
        ax.set_xticks(x, labels, fontsize=7)
        ax.set_ylabel("warm MB/s, one core")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(args.out + ".png", dpi=120)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
