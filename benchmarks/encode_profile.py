"""Where a one-core full encode spends its time, stage by stage (the fused path's kernels called one at a time).

For each family and category of benchmarks/full_encode.py (same corpus, same 1M-character documents, same warm-up
region), in this process, pinned to one CPU, times each stage of the CPU path with the process's kernel set:

  codepoints   the str's code points (strbuf)
  classes      the feature byte of each code point (the gather of the family's bitmap-form table)
  pretokenize  the family's pre-tokenizer as the fused encode runs it (startbits' bitmap forms, JIT; o200k: plus the
               compiled rescan of its rare shapes, shown apart)
  utf8+bounds  UTF-8 of the block and the byte offset of every piece (strbuf, from the bool starts)
  walk hits    the piece-map walk when every piece is in the map (the 'repeat' case)
  encode       CpuEncoder.encode of the document, warm (new encoder, warm-up region first) and repeat
  misses       encode warm - encode repeat: the BPE of the pieces the warm-up region did not hold (whole-vocabulary
               lookup, merges) and their insertion into the map (`misses` column: pieces inserted)
  glue         encode repeat minus the stages: Python between the kernels, allocation, the scratch set-up

Times are CPU time of the thread (time.thread_time: a shared machine's other processes do not count), median of
`--runs` runs, each stage alternated with the others. Prints a Markdown table; `--out FILE` writes it too.

  PYTHONPATH=. flock /tmp/bench.lock python benchmarks/encode_profile.py --families cl100k_base,o200k_base \\
      --corpus /tmp/corpus
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))     # full_encode's corpus cells; tokenplane: PYTHONPATH


def _cpu(fn, runs: int) -> float:
    ts = []
    for _ in range(runs):
        t0 = time.thread_time()
        fn()
        ts.append(time.thread_time() - t0)
    return statistics.median(ts) * 1e3


def profile(family: str, doc: str, warm: str, runs: int) -> dict[str, float]:
    import tokenplane
    from tokenplane.tokenize.cpu import fullencode, kernels, o200k_rescan, startbits
    from tokenplane.tokenize.cpu import pretokenize as pt
    from tokenplane.tokenize.cpu.parallel import CpuEncoder
    from tokenplane.tokenize.spec.artifacts import artifact_bytes
    from tokenplane.tokenize.tokenizer import Tokenizer

    k = kernels.get()
    tok = tokenplane.load(family)
    raw = doc
    doc = tok.normalize(raw)    # the stages run on what the encoder's kernels see (qwen3: NFC; the CJK pool is not NFC)

    def new_encoder() -> CpuEncoder:
        return CpuEncoder(Tokenizer(family, tok.family, artifact_bytes(family)), workers=1)

    n = len(doc)
    nbytes = len(doc.encode("utf-8"))
    cps = np.empty(n, np.uint32)
    k.codepoints(doc, 0, n, cps)
    c = cps.view(np.int32)
    # the fused encode's pre-tokenizer (JIT: it is compiled into the fused AOT exports only)
    feat_table, run_bits = startbits.bitmap_form(family)
    feat = np.zeros(n + startbits.PAD, np.uint8)
    feat[:n] = feat_table[cps]
    bitmap = np.empty((n >> 6) + 1, np.uint64)
    cls_table = pt._table(tok.family.engine)
    found = run_bits(c, feat, bitmap)       # (o200k: its rare positions, sorted; every other family: None)
    nrare = 0 if found is None else int(found.shape[0])
    if nrare:       # o200k's rare shapes: the compiled rescan, as the fused call runs it
        o200k_rescan._rescan_bits(cps, cls_table, found, bitmap)
    rescued = np.unpackbits(bitmap.view(np.uint8), bitorder="little")[:n].astype(np.bool_)
    buf = np.empty(4 * n + 16, np.uint8)
    bounds = np.empty(n + 1, np.int64)

    enc = new_encoder()
    enc.encode(warm, parallel=False)
    walk = fullencode.walk_encoder(enc.bpe)
    pm = enc.bpe.thread_cache().pmap
    before = int(pm.state[0])
    ids, status = walk(cps, n, rescued, buf, bounds)
    assert status == fullencode.OK and np.array_equal(ids, tok.reference.encode_ordinary(raw)), "walk != reference"
    inserted = int(pm.state[0]) - before

    def encode_warm() -> None:
        e = new_encoder()
        e.encode(warm, parallel=False)
        t0 = time.thread_time()
        e.encode(raw, parallel=False)
        enc_warm.append(time.thread_time() - t0)

    enc_warm: list[float] = []
    samples: dict[str, list[float]] = {}
    stages = (("codepoints", lambda: k.codepoints(doc, 0, n, cps)),
              ("classes", lambda: k.gather_u8(feat_table, cps)),
              ("pretokenize", lambda: run_bits(c, feat, bitmap)),      # (the kernel clears its bitmap)
              ("rescan", lambda: o200k_rescan._rescan_bits(cps, cls_table, found, bitmap.copy()) if nrare else None),
              ("utf8+bounds", lambda: k.utf8_and_bounds(cps, n, rescued, buf, bounds)),
              ("walk+utf8 hits", lambda: walk(cps, n, rescued, buf, bounds)),
              ("encode repeat", lambda: enc.encode(raw, parallel=False)))
    for _ in range(runs):       # the stages alternate
        for name, fn in stages:
            samples.setdefault(name, []).append(_cpu(fn, 1))
        encode_warm()
    out = {name: statistics.median(v) for name, v in samples.items()}
    out["walk hits"] = out.pop("walk+utf8 hits") - out["utf8+bounds"]
    out["encode warm"] = statistics.median(enc_warm) * 1e3
    out["misses"] = out["encode warm"] - out["encode repeat"]
    fixed = sum(out[s] for s in ("codepoints", "classes", "pretokenize", "rescan", "utf8+bounds", "walk hits"))
    out["glue repeat"] = out["encode repeat"] - fixed
    out.update(bytes=nbytes, pieces=int(rescued.sum()), tokens=len(ids), misses_inserted=inserted, rare=nrare)
    return out


COLS = ("codepoints", "classes", "pretokenize", "rescan", "utf8+bounds", "walk hits", "glue repeat", "encode repeat",
        "misses", "encode warm")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--families", default="cl100k_base,o200k_base")
    p.add_argument("--categories", default="english,code")
    p.add_argument("--corpus", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "tokenplane_corpus"))
    p.add_argument("--runs", type=int, default=7)
    p.add_argument("--cpu", type=int, default=None, help="CPU to pin to (default: the first allowed)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if hasattr(os, "sched_setaffinity"):
        cpus = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, [args.cpu if args.cpu is not None else cpus[0]])
    from full_encode import cells

    import tokenplane
    from tokenplane.tokenize.cpu import kernels

    docs = {cat: (d[0], w[0]) for cat, size, d, _, w in cells(Path(args.corpus), ["1M"], 1_000_000)}
    lines = [f"Stage CPU times, ms per 1M-character document (median of {args.runs}); kernels: {kernels.get().kind}; "
             f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}; code: {Path(tokenplane.__file__).parent}",
             "",
             "| family | category | " + " | ".join(COLS) + " | warm MB/s | repeat MB/s | pieces | misses |",
             "|---|---|" + "---:|" * (len(COLS) + 4)]
    for fam in args.families.split(","):
        for cat in args.categories.split(","):
            doc, warm = docs[cat]
            r = profile(fam, doc, warm, args.runs)
            lines.append(f"| {fam} | {cat} | " + " | ".join(f"{r[c]:.2f}" for c in COLS)
                         + f" | {r['bytes'] / r['encode warm'] / 1e3:.1f} | {r['bytes'] / r['encode repeat'] / 1e3:.1f}"
                         + f" | {r['pieces']} | {r['misses_inserted']} |")
            print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    if args.out:
        Path(args.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
