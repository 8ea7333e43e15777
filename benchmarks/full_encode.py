"""Full-encode throughput: tokenplane's CPU path vs tiktoken, HF tokenizers, fastokens, gigatoken and toktier.

MB/s of UTF-8 input, single core and all cores, cold (a new engine instance per run, construction not timed) and
warm (repeat passes on one instance; the best case for caching engines), at 1K / 100K / 1M / 4M characters of
English, code and CJK-heavy real text (corpus from ../shared/tools/build_corpus.py). Every engine's first output on
every cell is compared with the reference IDs; the `exact` column says whether it matched.

Each (family, cores) configuration runs in its own subprocess so thread-count environment variables take effect
before the engines load, and no engine's caches leak into another configuration.

  python benchmarks/full_encode.py --families qwen3,cl100k_base --corpus /tmp/tokenplane_corpus
Writes benchmarks/results/full_encode.{json,md,png}.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SIZES = {"1K": 1_000, "100K": 100_000, "1M": 1_000_000, "4M": 4_000_000}
DOCS_PER_SIZE = {"1K": 200, "100K": 4, "1M": 1, "4M": 1}
CATEGORIES = {"english": ("mixed", ("doc", "man-en")), "code": ("mixed", ("python",)),
              "cjk": ("nonen", ("man-cjk", "cpython-cjkencodings", "mo-nonlatin"))}
BUILD_CORPUS = Path(os.environ.get("TOKENPLANE_SHARED", ROOT.parent / "shared")) / "tools" / "build_corpus.py"


def ensure_corpus(corpus: Path) -> Path:
    if not (corpus / "mixed.jsonl").exists():
        if not BUILD_CORPUS.exists():
            raise SystemExit(f"no corpus at {corpus} and no {BUILD_CORPUS} to build one")
        subprocess.run([sys.executable, str(BUILD_CORPUS), str(corpus)], check=True)
    return corpus


def category_pools(corpus: Path) -> dict[str, str]:
    pools: dict[str, list[str]] = {c: [] for c in CATEGORIES}
    for cat, (fname, kinds) in CATEGORIES.items():
        with open(corpus / f"{fname}.jsonl", encoding="utf-8") as f:
            for line in f:
                d = json.loads(line)
                if d["kind"] in kinds:
                    pools[cat].append(d["text"])
    return {c: "\n".join(docs) for c, docs in pools.items()}


def cut_docs(pool: str, size: int, count: int) -> tuple[list[str], bool]:
    """`count` slices of `size` characters at spread-out offsets; tiles the pool when it is shorter (reported)."""
    tiled = len(pool) < size
    if tiled:
        pool = pool * (size // len(pool) + 1)
    step = max(1, (len(pool) - size) // max(1, count))
    return [pool[i * step:i * step + size] for i in range(count)], tiled


# -- engines (worker side) -------------------------------------------------------------------------------------
def engine_factories(family: str, threads: int | None):
    """name -> factory() -> encode(texts) -> list of id sequences. `threads` None = all cores."""
    import tokenplane
    from tokenplane.tokenize.spec.artifacts import artifact_bytes, artifact_file

    tok = tokenplane.load(family)
    is_tiktoken = tok.family.engine == "tiktoken"
    path = artifact_file(family)
    out: dict = {}
    nthreads = threads or os.cpu_count() or 1

    def ours(mode: str):
        def factory():
            from tokenplane.tokenize.cpu.parallel import CpuEncoder
            from tokenplane.tokenize.tokenizer import Tokenizer

            fresh = Tokenizer(family, tok.family, artifact_bytes(family))   # new instance: nothing cached
            enc = CpuEncoder(fresh, workers=nthreads)
            enc.encode("warm up the lazily built tables 123")   # construction, not timed (as for the peers)
            if mode == "serial":
                return lambda texts: [enc.encode(t, parallel=False) for t in texts]
            return lambda texts: [enc.encode(t) for t in texts]   # chunk-parallel from 256K chars on
        return factory

    if _cpu_path_available(tok):
        if threads is None:
            out["tokenplane-cpu-serial"] = ours("serial")
            out["tokenplane-cpu-parallel"] = ours("auto")
        else:
            out["tokenplane-cpu"] = ours("serial")

    if is_tiktoken:
        def tiktoken_factory():
            import tiktoken

            from tokenplane.tokenize.reference import parse_tiktoken

            enc = tiktoken.Encoding(name=f"bench-{family}-{time.perf_counter_ns()}", pat_str=tok.family.patterns[0],
                                    mergeable_ranks=parse_tiktoken(artifact_bytes(family)),
                                    special_tokens=dict(tok.family.specials))
            if threads is None:
                return lambda texts: enc.encode_ordinary_batch(texts, num_threads=nthreads)
            return lambda texts: [enc.encode_ordinary(t) for t in texts]
        out["tiktoken"] = tiktoken_factory
    else:
        def hf_factory():
            from tokenizers import Tokenizer as HF

            cfg = json.loads(artifact_bytes(family))
            cfg["added_tokens"] = []
            hf = HF.from_str(json.dumps(cfg))
            if threads is None:
                return lambda texts: [e.ids for e in hf.encode_batch(texts, add_special_tokens=False)]
            return lambda texts: [hf.encode(t, add_special_tokens=False).ids for t in texts]
        out["hf-tokenizers"] = hf_factory

    def fastokens_factory():
        import fastokens

        if is_tiktoken:
            ft = fastokens.Tokenizer.from_tiktoken(str(path), pattern=tok.family.patterns[0],
                                                   special_tokens=dict(tok.family.specials))
        else:
            ft = fastokens.Tokenizer.from_file(str(path))
        if threads is None and hasattr(ft, "encode_batch"):
            return lambda texts: ([e.ids for e in ft.encode_batch(texts)] if len(texts) > 1
                                  else [ft.encode(texts[0]).ids])
        return lambda texts: [ft.encode(t).ids for t in texts]
    out["fastokens"] = fastokens_factory

    def gigatoken_factory():
        import gigatoken

        gt = gigatoken.Tokenizer.from_tiktoken(str(path)) if is_tiktoken else gigatoken.Tokenizer(str(path))
        if threads is None and hasattr(gt, "encode_batch_list"):
            return lambda texts: gt.encode_batch_list(texts) if len(texts) > 1 else [gt.encode(texts[0])]
        return lambda texts: [gt.encode(t) for t in texts]
    out["gigatoken"] = gigatoken_factory

    if family in TOKTIER_FAMILIES:
        def toktier_factory():
            tt = load_toktier(family)
            return lambda texts: [tt.encode(t, lookup="off").ids for t in texts]
        out["toktier"] = toktier_factory
    return tok, out


TOKTIER_FAMILIES = {"qwen3": "qwen3_8b", "deepseek_v4": "deepseek_v4_flash"}


def load_toktier(family: str):
    """toktier 0.3.0 offline: its shipped manifest entry for the certified tokenizer.json (same sha256 as ours),
    narrowed to that one file, with the verified file placed in its cache; `offline=True` forbids any fetch."""
    import toktier
    from toktier.artifacts.manifest import ArtifactManifest
    from toktier.config import Config

    from tokenplane.tokenize.spec.artifacts import artifact_bytes

    theirs = TOKTIER_FAMILIES[family]
    shipped = json.loads((Path(toktier.__file__).parent / "artifacts/tables/artifact_manifest.v1.json").read_text())
    entry = dict(shipped[theirs])
    entry["files"] = {"tokenizer.json": entry["files"]["tokenizer.json"]}
    manifest = ArtifactManifest.from_mapping({theirs: entry})
    cfg = Config(home=Path(os.environ.get("TMPDIR", "/tmp")) / "tokenplane_toktier_home", offline=True)
    target = cfg.cache_dir / "artifacts" / manifest.get(theirs).directory_name / "tokenizer.json"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(artifact_bytes(family))
    return toktier.load(theirs, config=cfg, manifest=manifest, device="cpu")


def _cpu_path_available(tok) -> bool:
    try:
        from tokenplane.tokenize.cpu import pretokenize

        return bool(pretokenize.supported(tok.family))
    except ImportError:
        return False


def reference_ids(tok, docs: list[str]) -> list:
    """Reference IDs, cached on disk across the per-configuration subprocesses (HF takes ~10 s per 4M chars)."""
    import hashlib

    import numpy as np

    key = hashlib.sha256(("\x00".join(docs) + tok.content_hash).encode("utf-8", "surrogatepass")).hexdigest()[:24]
    path = Path(os.environ.get("TMPDIR", "/tmp")) / "tokenplane_bench_files" / f"ref-{tok.name}-{key}.npz"
    if path.exists():
        with np.load(path) as z:
            return [z[f"a{i}"] for i in range(len(docs))]
    ids = [tok.encode(d, path="reference") for d in docs]
    path.parent.mkdir(parents=True, exist_ok=True)   # a fresh machine has no cache folder yet
    np.savez(path, **{f"a{i}": a for i, a in enumerate(ids)})
    return ids


def worker(args) -> None:
    threads = None if args.threads == "all" else int(args.threads)
    if threads is not None and hasattr(os, "sched_setaffinity"):
        # Pin the whole process (every engine's thread pool) to `threads` CPUs: a true single-core measurement.
        os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:threads])
    import numpy as np

    pools = category_pools(Path(args.corpus))
    tok, factories = engine_factories(args.family, threads)
    budget_end = time.monotonic() + args.budget_s
    results = []
    for cat, pool in pools.items():
        for size_name, size in SIZES.items():
            if size_name not in args.sizes.split(","):
                continue
            docs, tiled = cut_docs(pool, size, DOCS_PER_SIZE[size_name])
            nbytes = sum(len(d.encode("utf-8")) for d in docs)
            reference = reference_ids(tok, docs) if time.monotonic() < budget_end else None
            for name, factory in factories.items():
                cell = {"family": args.family, "cores": args.threads, "category": cat, "size": size_name,
                        "docs": len(docs), "bytes": nbytes, "tiled": tiled, "engine": name}
                if time.monotonic() > budget_end:
                    cell["skipped"] = "time budget"
                    results.append(cell)
                    continue
                if name == "hf-tokenizers" and size >= 1_000_000 and not args.slow_hf:
                    cell["skipped"] = "HF at >= 1M chars takes 3-20 s a pass here (--slow-hf to run it)"
                    results.append(cell)
                    continue
                try:
                    cold, warm, exact = [], [], True
                    for run in range(args.cold_runs):
                        enc = factory()
                        t0 = time.perf_counter()
                        out = enc(docs)
                        cold.append(time.perf_counter() - t0)
                        if run == 0:
                            exact = all(np.array_equal(np.asarray(o, dtype=np.int64), r.astype(np.int64))
                                        for o, r in zip(out, reference))
                        if cold[-1] > args.slow_pass_s:
                            break
                    for _ in range(args.warm_runs):   # `enc` is the last cold instance: its caches are warm now
                        t0 = time.perf_counter()
                        enc(docs)
                        warm.append(time.perf_counter() - t0)
                        if warm[-1] > args.slow_pass_s:
                            break
                    cell.update(cold_mbps=nbytes / statistics.median(cold) / 1e6,
                                warm_mbps=nbytes / statistics.median(warm) / 1e6,
                                warm_best_mbps=nbytes / min(warm) / 1e6, cold_runs=len(cold), warm_runs=len(warm),
                                exact=exact)
                except Exception as exc:   # a peer that fails on some input is reported, not fatal
                    cell["error"] = f"{type(exc).__name__}: {exc}"[:300]
                results.append(cell)
                print(json.dumps(cell), file=sys.stderr, flush=True)
    json.dump(results, sys.stdout)


def run_config(args, family: str, threads: str, budget_s: float) -> list[dict]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    if threads != "all":
        env.update(RAYON_NUM_THREADS=threads, FASTOKENS_BPE_THREADS=threads, TOKENIZERS_PARALLELISM="false",
                   OMP_NUM_THREADS=threads, TOKENPLANE_CPU_THREADS=threads)
    else:
        for k in ("RAYON_NUM_THREADS", "FASTOKENS_BPE_THREADS", "OMP_NUM_THREADS", "TOKENPLANE_CPU_THREADS"):
            env.pop(k, None)
        env["TOKENIZERS_PARALLELISM"] = "true"
    cmd = [sys.executable, __file__, "--worker", "--family", family, "--threads", threads, "--corpus", args.corpus,
           "--sizes", args.sizes, "--budget-s", str(budget_s),
           "--cold-runs", str(args.cold_runs), "--warm-runs", str(args.warm_runs),
           "--slow-pass-s", str(args.slow_pass_s)] + (["--slow-hf"] if args.slow_hf else [])
    proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        return [{"family": family, "cores": threads, "error": f"worker exited {proc.returncode}"}]
    return json.loads(proc.stdout)


def markdown(results: list[dict], meta: dict) -> str:
    lines = ["# Full-encode throughput (MB/s of UTF-8 input)\n",
             f"Machine: {meta['machine']}; {meta['cpus']} CPUs; load average at start {meta['loadavg']}. "
             "Cold = fresh instance per run (construction not timed), warm = median of repeat passes on one instance "
             "[best]. `exact` = first output equals the reference IDs on every document of the cell. "
             "A `*` marks text tiled to reach the size (the CJK pool is ~2.3 M chars).\n"]
    if meta.get("merged_from"):
        m = meta["merged_from"]
        lines.append(f"Cells not measured by this run come from an earlier run: `{m['command']}` ({m['started']}, "
                     f"load average {m['loadavg']}).\n")
    keys = sorted({(r["family"], r["cores"]) for r in results if "category" in r})
    for family, cores in keys:
        rows = [r for r in results if r.get("family") == family and r.get("cores") == cores and "category" in r]
        cells = sorted({(r["category"], r["size"]) for r in rows}, key=lambda c: (list(CATEGORIES).index(c[0]),
                                                                                  list(SIZES).index(c[1])))
        engines = list(dict.fromkeys(r["engine"] for r in rows))
        lines.append(f"\n## {family}, {'1 core' if cores == '1' else 'all cores'}\n")
        tiled = {(r["category"], r["size"]) for r in rows if r["tiled"]}
        lines.append("| engine | " + " | ".join(f"{c} {s}{'*' if (c, s) in tiled else ''}" for c, s in cells) + " |")
        lines.append("|---|" + "---:|" * len(cells))
        for eng in engines:
            vals = []
            for c, s in cells:
                r = next((r for r in rows if r["engine"] == eng and (r["category"], r["size"]) == (c, s)), None)
                if r is None or "skipped" in r:
                    vals.append("skip")
                elif "error" in r:
                    vals.append("error")
                else:
                    mark = "" if r["exact"] else " ✗"
                    vals.append(f"{r['cold_mbps']:.1f} / {r['warm_mbps']:.1f} [{r['warm_best_mbps']:.1f}]{mark}")
            lines.append(f"| {eng} | " + " | ".join(vals) + " |")
        lines.append("\nCells: cold / warm median [warm best]; ✗ = output differs from the reference.")
    lines.append("\n## Targets (reported, not asserted)\n")
    lines += [f"- {t}" for t in targets(results)]
    errs = [r for r in results if "error" in r]
    if errs:
        lines.append("\n## Errors\n")
        lines += [f"- {r.get('family')} {r.get('cores')} {r.get('engine', '')} {r.get('category', '')} "
                  f"{r.get('size', '')}: {r['error']}" for r in errs]
    return "\n".join(lines) + "\n"


def targets(results: list[dict]) -> list[str]:
    ok = [r for r in results if "cold_mbps" in r]
    out = []
    for fam in sorted({r["family"] for r in ok}):
        one = {(r["category"], r["size"], r["engine"]): r for r in ok if r["family"] == fam and r["cores"] == "1"}
        cells = sorted({(c, s) for c, s, e in one if e == "tokenplane-cpu"})
        if cells:
            parts, met = [], True
            for c, s in cells:
                ours, ft = one[(c, s, "tokenplane-cpu")], one.get((c, s, "fastokens"))
                if ft is None:
                    continue
                good = ours["exact"] and ours["cold_mbps"] >= ft["cold_mbps"]
                met &= good
                parts.append(f"{c} {s} {ours['cold_mbps']:.1f} vs {ft['cold_mbps']:.1f}{'' if good else ' (miss)'}")
            out.append(f"{fam}: one core, exact, cold >= fastokens cold: {'met' if met else 'NOT met'} ("
                       + "; ".join(parts) + ")")
        allc = {(r["category"], r["size"], r["engine"]): r for r in ok if r["family"] == fam and r["cores"] == "all"}
        parts, met, any_cell = [], True, False
        for (c, s, e), r in sorted(allc.items()):
            if e != "tokenplane-cpu-parallel" or s not in ("1M", "4M") or (c, s, "tokenplane-cpu-serial") not in allc:
                continue
            any_cell = True
            ratio = r["warm_mbps"] / allc[(c, s, "tokenplane-cpu-serial")]["warm_mbps"]
            met &= ratio >= 1.7 and r["exact"]
            parts.append(f"{c} {s} {ratio:.2f}x")
        if any_cell:
            out.append(f"{fam}: chunk-parallel on all cores >= 1.7x serial (same process, warm) at >= 1M chars: "
                       f"{'met' if met else 'NOT met'} (" + "; ".join(parts) + "); a ratio of two medians of "
                       "a few passes run one after the other, neither paired nor gated on an idle host: the "
                       "paired, gated measurement of this target is benchmarks/parallel_speedup.py")
    return out


ENGINE_COLORS = {"tokenplane-cpu": "tab:blue", "tokenplane-cpu-serial": "tab:blue", "tokenplane-cpu-parallel": "navy",
                 "tiktoken": "tab:orange", "hf-tokenizers": "tab:orange", "fastokens": "tab:green",
                 "gigatoken": "tab:red", "toktier": "tab:purple"}


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = sorted({(r["family"], r["cores"]) for r in results if "cold_mbps" in r})
    fig, axes = plt.subplots(len(keys), len(CATEGORIES), figsize=(5 * len(CATEGORIES), 3.6 * max(1, len(keys))),
                             squeeze=False)
    for i, (family, cores) in enumerate(keys):
        for j, cat in enumerate(CATEGORIES):
            ax = axes[i][j]
            rows = [r for r in results if r.get("family") == family and r.get("cores") == cores
                    and r.get("category") == cat and "cold_mbps" in r]
            for eng in dict.fromkeys(r["engine"] for r in rows):
                pts = [(list(SIZES).index(r["size"]), r["cold_mbps"], r["warm_mbps"]) for r in rows
                       if r["engine"] == eng]
                pts.sort()
                color = ENGINE_COLORS.get(eng, "black")
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", color=color, label=eng)
                ax.plot([p[0] for p in pts], [p[2] for p in pts], marker="x", ls="--", color=color)
            ax.set_xticks(range(len(SIZES)), list(SIZES))
            ax.set_yscale("log")
            ax.set_title(f"{family} {cat} ({'1 core' if cores == '1' else 'all cores'})", fontsize=9)
            ax.set_ylabel("MB/s (solid cold, dashed warm)")
            if rows:
                ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--families", default="qwen3,cl100k_base")
    p.add_argument("--cores", default="1,all", help="comma list of 1 and/or all")
    p.add_argument("--corpus", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "tokenplane_corpus"))
    p.add_argument("--sizes", default="1K,100K,1M,4M")
    p.add_argument("--budget-s", type=float, default=480.0, help="total seconds across configurations")
    p.add_argument("--cold-runs", type=int, default=2)
    p.add_argument("--warm-runs", type=int, default=2)
    p.add_argument("--slow-pass-s", type=float, default=1.5, help="stop repeating a cell after a pass this long")
    p.add_argument("--slow-hf", action="store_true")
    p.add_argument("--merge-from", default=None, help="earlier full_encode.json whose other cells to keep")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    # worker mode
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--family", help=argparse.SUPPRESS)
    p.add_argument("--threads", help=argparse.SUPPRESS)
    p.add_argument("--render-only", action="store_true", help="re-render md/png from the existing JSON in --out")
    args = p.parse_args()
    if args.worker:
        worker(args)
        return 0
    if args.render_only:
        data = json.loads((Path(args.out) / "full_encode.json").read_text())
        (Path(args.out) / "full_encode.md").write_text(markdown(data["results"], data["meta"]))
        plot(data["results"], Path(args.out) / "full_encode.png")
        return 0
    ensure_corpus(Path(args.corpus))
    args.configs = [(f, c) for f in args.families.split(",") for c in args.cores.split(",")]
    meta = {"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
            "loadavg": " ".join(f"{x:.2f}" for x in os.getloadavg()), "started": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                                                                 time.gmtime()),
            "command": " ".join(sys.argv)}
    t0 = time.time()
    results: list[dict] = []
    for i, (family, cores) in enumerate(args.configs):
        left = args.budget_s - (time.time() - t0)
        results += run_config(args, family, cores, max(30.0, left / (len(args.configs) - i)))
    meta["wall_s"] = round(time.time() - t0, 1)
    meta["loadavg_end"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    if args.merge_from:
        # Keep cells an earlier run measured and this one did not (tagged with that run's command).
        old = json.loads(Path(args.merge_from).read_text())
        key = lambda r: (r.get("family"), r.get("cores"), r.get("category"), r.get("size"), r.get("engine"))  # noqa
        measured = {key(r) for r in results if "cold_mbps" in r}
        kept = [dict(r, run=old["meta"]["command"]) for r in old["results"]
                if "cold_mbps" in r and key(r) not in measured]
        kept_keys = {key(r) for r in kept}
        results = [r for r in results if key(r) not in kept_keys] + kept
        meta["merged_from"] = old["meta"]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "full_encode.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    (out / "full_encode.md").write_text(markdown(results, meta))
    plot(results, out / "full_encode.png")
    print((out / "full_encode.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
