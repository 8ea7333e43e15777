"""Session state size: bytes per token of a live Session for every family, from a small session (~1.5K tokens) to
4M characters, against the target of <= 8 bytes/token (issue 17).

Each cell is `session_costs.memory`: a session holding a context cut from real text (the corpus of
../shared/tools/build_corpus.py, as benchmarks/session_repair.py; NFC families start with a decomposed "cafe\u0301"
so raw != normalized text) plus ten 1.4K-character appends, measured three ways: tracemalloc (every Python/numpy
allocation the session made and still holds, text included), the process RSS delta of a second, untraced session
(freed heap trimmed first), and the session's own `nbytes`. Beside it, the floor of the layout: the text's own
size (sum of its chunks' str sizes) and the 4 bytes/token of uint32 IDs, so a cell that misses says by how much
and why. Every session's IDs are checked against the reference encode of its text.

  flock /tmp/bench.lock python benchmarks/session_memory.py --family all --corpus /tmp/corpus
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from full_encode import ensure_corpus  # noqa: E402
from session_costs import memory  # noqa: E402
from session_repair import ALL_FAMILIES, NFC_SEED, corpus_pool  # noqa: E402

SIZES = {"small": 6_000, "100K": 100_000, "1M": 1_000_000, "4M": 4_000_000}
TARGET = 8.0


def cell(tok, pool: str, size: int, offset: int, session_path: str) -> dict:
    seed = NFC_SEED if tok.family.normalizer is not None else ""
    context = seed + pool[offset:offset + size - len(seed)]
    appends = [pool[offset + size + 1400 * k:offset + size + 1400 * (k + 1)] for k in range(10)] if size > 6000 else []
    out = memory(tok, context, appends, session_path)
    # the same session once more for its composition and exactness (not timed, not traced)
    sess = tok.session(encode_path=session_path)
    sess.sync(context)
    for a in appends:
        sess.append(a)
    n = len(sess)
    text_bytes = sess._raw.nbytes(set()) + (sess._nmap.nbytes() if sess._nmap is not None else 0)
    out.update({"chars_per_token": out["chars"] / n, "text_b_per_token": text_bytes / n,
                "records_b_per_token": sess.array_nbytes / n, "text_chunks": len(sess._raw.chunks),
                "exact": bool(np.array_equal(np.asarray(sess.ids, dtype=np.int64),
                                             tok.encode(sess.text, path="reference").astype(np.int64)))})
    out["met"] = max(out["tracemalloc_b_per_token"], out["rss_b_per_token"]) <= TARGET
    return out


def markdown(full: dict) -> str:
    m = full["meta"]
    lines = [f"# Session state, bytes per token (target <= {TARGET:g} at every size)\n",
             f"Machine: {m['machine']}, {m['cpus']} CPUs, load average {m['loadavg']} at start, {m['loadavg_end']} at "
             f"end; wall {m['wall_s']} s. Command: `{m['command']}`.\n",
             "Context cut from real text plus ten 1.4K-character appends (small: 6,000 characters, no appends). "
             "tracemalloc = every allocation the session holds; RSS = process RSS delta of a second session "
             "(untraced, heap trimmed); nbytes = the session's own count. text = its chunks' str sizes (and the NFC "
             "map), records = IDs + checkpoints (allocated capacity). met = tracemalloc and RSS both <= the target.\n",
             "| family | size | chars | tokens | chars/token | tracemalloc | RSS | nbytes | text | records | exact | "
             "met |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|"]
    for fam, rows in full["families"].items():
        for size, r in rows.items():
            lines.append(f"| {fam} | {size} | {r['chars']:,} | {r['tokens']:,} | {r['chars_per_token']:.2f} | "
                         f"{r['tracemalloc_b_per_token']:.2f} | {r['rss_b_per_token']:.2f} | "
                         f"{r['nbytes_b_per_token']:.2f} | {r['text_b_per_token']:.2f} | "
                         f"{r['records_b_per_token']:.2f} | {r['exact']} | {'met' if r['met'] else 'NOT met'} |")
    cells = [r for rows in full["families"].values() for r in rows.values()]
    met = sum(r["met"] for r in cells)
    lines.append(f"\n{met}/{len(cells)} cells meet <= {TARGET:g} bytes/token on both tracemalloc and RSS.")
    return "\n".join(lines) + "\n"


def plot(full: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fams = list(full["families"])
    fig, ax = plt.subplots(figsize=(12, 4.5))
    width = 0.8 / len(SIZES)
    for k, size in enumerate(SIZES):
        xs = [i + k * width for i in range(len(fams))]
        tm = [full["families"][f].get(size, {}).get("tracemalloc_b_per_token", np.nan) for f in fams]
        rss = [full["families"][f].get(size, {}).get("rss_b_per_token", np.nan) for f in fams]
        ax.bar(xs, tm, width * 0.9, label=f"{size} tracemalloc")
        ax.scatter(xs, rss, color="black", marker="_", s=120, zorder=3, label="RSS" if k == 0 else None)
    ax.axhline(TARGET, color="red", ls="--", label=f"target {TARGET:g}")
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(fams))], fams)
    ax.set_ylabel("bytes per token")
    ax.set_title("Session state per token (bars: tracemalloc, ticks: RSS delta)")
    ax.legend(fontsize=7, ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--family", default="all", help=f"comma list or all ({ALL_FAMILIES})")
    p.add_argument("--corpus", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "tokenplane_corpus"))
    p.add_argument("--sizes", default=",".join(SIZES))
    p.add_argument("--session-path", default="cpu", choices=["cpu", "reference"])
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = p.parse_args()
    import tokenplane

    t_start = time.time()
    meta = {"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
            "loadavg": " ".join(f"{x:.2f}" for x in os.getloadavg()), "command": " ".join(sys.argv),
            "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    pool = corpus_pool(ensure_corpus(Path(args.corpus)))
    full: dict = {"meta": meta, "target_b_per_token": TARGET, "families": {}}
    for family in (ALL_FAMILIES if args.family == "all" else args.family).split(","):
        tok = tokenplane.load(family)
        if args.session_path == "cpu":
            tok.encode("build the tables 123", path="cpu")
        rows = {}
        for k, size_name in enumerate(args.sizes.split(",")):
            rows[size_name] = cell(tok, pool, SIZES[size_name], 0 if size_name == "small" else 7_919 * (k + 1),
                                   args.session_path)
            print(family, size_name, json.dumps(rows[size_name]), flush=True)
        full["families"][family] = rows
    meta["wall_s"] = round(time.time() - t_start, 1)
    meta["loadavg_end"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "session_memory.json").write_text(json.dumps(full, indent=1))
    (out / "session_memory.md").write_text(markdown(full))
    plot(full, out / "session_memory.png")
    print(markdown(full))
    return 0


if __name__ == "__main__":
    sys.exit(main())
