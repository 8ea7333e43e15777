"""Same-process A/B of two builds of the AOT kernel module on the one-core full encode (warm and repeat).

A shared machine's load moves every engine's MB/s between two benchmark runs by more than a kernel change does (a
peer measured 87.6 and 142.9 MB/s on the same cell in back-to-back runs), so this compares two kernel modules in one
process, alternating them run by run on the same inputs, in CPU time (time.thread_time). Both modules must have the
same export signatures (kernels.EXPORTS); the tables, corpus cells and Python glue are this checkout's. Per family
and category: a new piece map filled by encoding the warm-up region, then the document (warm), then the document
again (repeat), through `full_<loop>` (cl100k lineage) or codepoints + gather + `o200k_loop` + rescan + `full_walk`
(o200k, as parallel.CpuEncoder runs it). Every output is checked against the reference IDs.

  PYTHONPATH=. python benchmarks/kernel_ab.py --a-dir ~/.cache/tokenplane/aot/<main key> --corpus /tmp/corpus
(--b-dir defaults to this checkout's module folder, kernels.module_folder()).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))     # full_encode's corpus cells; tokenplane: PYTHONPATH


def load(folder: Path) -> Any:
    from tokenplane.tokenize.cpu import kernels

    so = kernels.module_file(folder)
    spec = importlib.util.spec_from_file_location(kernels.MODULE_NAME, so)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def encoder(mod: Any, family: str, bpe: Any) -> Any:
    """fn(text) -> IDs through `mod`'s kernels with a new piece map (bound like fullencode.full_encoder)."""
    from tokenplane.tokenize.cpu import pretokenize as pt
    from tokenplane.tokenize.cpu.o200k_rescan import _o200k_rescan_local
    from tokenplane.tokenize.cpu.piecemap import PieceMap
    from tokenplane.tokenize.spec.families import FAMILIES

    pm = PieceMap()
    missing = bpe.missing if bpe.missing is not None else np.zeros(256, np.bool_)
    tail = (bpe.missing is not None, missing, bpe.byte_ids, bpe.ptab, bpe.batch, bpe.whole, bpe.wkeys, bpe.wids,
            bpe.tok_flat, bpe.tok_off, bpe.wmap, bpe.btda, bpe.btrec, pm.slots, pm.arena, pm.state, pm.valid)
    loop, fam_args = pt.loop_tables(family)
    engine = FAMILIES[family].engine

    def run(text: str) -> np.ndarray:
        n = len(text)
        cps = np.empty(n + 2, np.uint32)
        kind = np.empty(n + 2, fam_args[0].dtype)
        starts = np.empty(n + 2, np.bool_)
        buf = np.empty(4 * n + 32, np.uint8)
        bounds = np.empty(n + 2, np.int64)
        if loop != "o200k":
            ids, status = getattr(mod, f"full_{loop}")(text, 0, n, "", cps, kind, starts, buf, bounds, *fam_args,
                                                         *tail)
        else:
            mod.codepoints(text, 0, n, cps)
            c = cps[:n]
            feat = mod.gather_u8(fam_args[0], c)
            st = starts[:n]
            st[:] = False
            rare = np.empty(n, np.int64)
            nr = mod.o200k_loop(c.view(np.int32), feat, st, rare)
            if nr:
                _o200k_rescan_local(c, pt._table(engine), c.view(np.int32), np.sort(rare[:nr]), st)
            ids, status = mod.full_walk(c, n, st, buf, bounds, *tail)
        assert status == 0
        return ids

    return run


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--a-dir", required=True, help="folder of module A (the baseline)")
    p.add_argument("--b-dir", default=None, help="folder of module B (default: this checkout's)")
    p.add_argument("--families", default="cl100k_base,o200k_base")
    p.add_argument("--categories", default="english,code,cjk")
    p.add_argument("--corpus", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "tokenplane_corpus"))
    p.add_argument("--runs", type=int, default=9)
    p.add_argument("--cpu", type=int, default=None)
    args = p.parse_args()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, [args.cpu if args.cpu is not None else sorted(os.sched_getaffinity(0))[0]])
    from full_encode import cells

    import tokenplane
    from tokenplane.tokenize.cpu import kernels
    from tokenplane.tokenize.cpu.bpe import BPE
    from tokenplane.tokenize.cpu.bpetables import load as load_tables

    b_dir = Path(args.b_dir) if args.b_dir else kernels.module_folder()
    mods = {"A": load(Path(args.a_dir)), "B": load(b_dir)}
    print(f"A {args.a_dir}\nB {b_dir}\nload average {' '.join(f'{x:.2f}' for x in os.getloadavg())}; CPU time, ms "
          f"(median [min] of {args.runs} alternated runs)\n")
    print("| family | category | MB | A warm | B warm | B/A warm | A repeat | B repeat | B/A repeat |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    docs = {cat: (d[0], w[0]) for cat, size, d, _, w in cells(Path(args.corpus), ["1M"], 1_000_000)}
    for fam in args.families.split(","):
        tok = tokenplane.load(fam)
        bpe = BPE(load_tables(fam, tok.content_hash, lambda: tok.reference))
        for cat in args.categories.split(","):
            ref = tok.reference.encode_ordinary(docs[cat][0])
            doc, warm = (tok.normalize(x) for x in docs[cat])     # the kernels take normalized text
            t: dict[str, dict[str, list[float]]] = {k: {"warm": [], "repeat": []} for k in mods}
            for r in range(args.runs):
                for name in (("A", "B") if r % 2 == 0 else ("B", "A")):
                    run = encoder(mods[name], fam, bpe)
                    run(warm)
                    for phase in ("warm", "repeat"):
                        t0 = time.thread_time()
                        ids = run(doc)
                        t[name][phase].append(time.thread_time() - t0)
                        assert np.array_equal(ids, ref), (name, fam, cat, phase)
            mb = len(doc.encode("utf-8")) / 1e6

            def fmt(v: list[float]) -> str:
                return f"{statistics.median(v) * 1e3:.2f} [{min(v) * 1e3:.2f}]"

            ratio = {ph: statistics.median(t["B"][ph]) / statistics.median(t["A"][ph]) for ph in ("warm", "repeat")}
            print(f"| {fam} | {cat} | {mb:.2f} | {fmt(t['A']['warm'])} | {fmt(t['B']['warm'])} | "
                  f"{ratio['warm']:.3f} | {fmt(t['A']['repeat'])} | {fmt(t['B']['repeat'])} | {ratio['repeat']:.3f} |",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
