"""Full-encode throughput: tokenplane's CPU path vs tiktoken, HF tokenizers, fastokens, gigatoken and toktier.

MB/s of UTF-8 input, one core and all cores, at 1K / 100K / 1M / 4M characters of English, code and CJK-heavy real
text (corpus from ../shared/tools/build_corpus.py). Every engine is measured the same way, per cell:

  setup   constructing a new instance (ms; not part of any MB/s figure)
  cold    that new instance's first encode of the cell's documents (any lazy build the engine does on first use is
          in it: no engine gets a private warm-up call)
  warm    the figure the targets use: a new instance first encodes *other* documents of the same category (a disjoint
          region of the corpus, `--warmup-chars` characters: caches, pools and lazily built tables are warm, as in a
          server that has served other requests), then encodes the cell's documents, which it has never seen.
          Median [best] over `--warm-runs` instances.
  repeat  the last warm instance encodes the same documents again (the same text twice: every internal piece/word
          cache hits; what a server does not see, reported separately)
Every engine's output on the cold and the warm pass is compared with the reference IDs (`exact`). Every timed pass
encodes new str objects equal to the documents (`fresh_copies`): a server decodes a new str per request, and CPython
would otherwise hand an engine that reads UTF-8 the form it cached in the object on an earlier pass.

Each (family, cores) configuration runs in its own subprocess so thread-count environment variables take effect
before the engines load, and no engine's caches leak into another configuration. Peers that live in another
environment (gigatoken, fastokens: benchmarks/peers/build_tokenizer_peers.sh) run in a second worker under
`--peer-python`, which imports nothing of tokenplane: the first worker writes the reference IDs and the peers'
tokenizer spec to a work folder; both workers cut the same documents from the corpus.

  flock /tmp/bench.lock python benchmarks/full_encode.py --families all --sizes 1M,4M --corpus /tmp/corpus \\
      --peer-python /tmp/tokenplane-peers/bin/python
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
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FAMILIES = ("cl100k_base", "o200k_base", "llama3", "qwen3", "deepseek_v4", "smollm2")
SIZES = {"1K": 1_000, "100K": 100_000, "1M": 1_000_000, "4M": 4_000_000}
DOCS_PER_SIZE = {"1K": 200, "100K": 4, "1M": 1, "4M": 1}
CATEGORIES = {"english": ("mixed", ("doc", "man-en")), "code": ("mixed", ("python",)),
              "cjk": ("nonen", ("man-cjk", "cpython-cjkencodings", "mo-nonlatin"))}
BUILD_CORPUS = Path(os.environ.get("TOKENPLANE_SHARED", ROOT.parent / "shared")) / "tools" / "build_corpus.py"
PEER_ENGINES = ("fastokens", "gigatoken")
OURS_SERIAL, OURS_PARALLEL = "tokenplane-cpu", "tokenplane-cpu-parallel"


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


def split_pool(pool: str, warmup_chars: int) -> tuple[str, str]:
    """(timed region, warm-up region): the warm-up text is the pool's tail, at most half of it, so the documents
    a warm instance is timed on are never among those it warmed up on."""
    w = min(warmup_chars, len(pool) // 2)
    return pool[:len(pool) - w], pool[len(pool) - w:]


def cut_docs(pool: str, size: int, count: int) -> tuple[list[str], bool]:
    """`count` slices of `size` characters at spread-out offsets; tiles the pool when it is shorter (reported)."""
    tiled = len(pool) < size
    if tiled:
        pool = pool * (size // len(pool) + 1)
    step = max(1, (len(pool) - size) // max(1, count))
    return [pool[i * step:i * step + size] for i in range(count)], tiled


def cells(corpus: Path, sizes: list[str], warmup_chars: int):
    """(category, size name, timed docs, tiled, warm-up docs) for every cell, the same in both workers."""
    for cat, pool in category_pools(corpus).items():
        timed, warm = split_pool(pool, warmup_chars)
        warm_docs = [warm]     # one document: a chunk-parallel encoder spreads it over its threads' caches
        for size_name, size in SIZES.items():
            if size_name in sizes:
                docs, tiled = cut_docs(timed, size, DOCS_PER_SIZE[size_name])
                yield cat, size_name, docs, tiled, warm_docs


def stage_setup(description: str, families: str, rounds: int) -> tuple[argparse.Namespace, list[tuple[str, ...]]]:
    """The set-up of the one-core A/B benchmarks that run on these cells' 1M-character documents
    (pretokenizer_bits.py, full_kernel_ab.py): their arguments (corpus, families, categories, rounds, the CPU this
    process is pinned to, out) and the (family, category, document, warm-up region) of each cell."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--corpus", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "tokenplane_corpus"))
    p.add_argument("--families", default=families)
    p.add_argument("--categories", default="english,code,cjk")
    p.add_argument("--rounds", type=int, default=rounds)
    p.add_argument("--cpu", type=int, default=1)
    p.add_argument("--out", default=None, help="path prefix for .json / .md / .png")
    args = p.parse_args()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {args.cpu})
    docs = {cat: (d[0], w[0]) for cat, size, d, _, w in cells(Path(args.corpus), ["1M"], 1_000_000)}
    cats = [c for c in args.categories.split(",") if c in docs]
    return args, [(fam, cat, *docs[cat]) for fam in args.families.split(",") for cat in cats]


def stage_meta(args: argparse.Namespace, started: str, load0: tuple[float, float, float], rows: list[dict]) -> dict:
    """The JSON record of a stage_setup benchmark: command, start, load averages, CPU, rounds, rows."""
    return {"command": "python " + " ".join(sys.argv), "started": started, "load_start": load0,
            "load_end": os.getloadavg(), "cpu": args.cpu, "rounds": args.rounds, "rows": rows}


# -- engines (worker side) -------------------------------------------------------------------------------------
def our_factories(family: str, threads: int | None):
    """name -> factory() -> encode(texts) -> list of id sequences, for the engines of this environment."""
    import tokenplane
    from tokenplane.tokenize.spec.artifacts import artifact_bytes

    tok = tokenplane.load(family)
    is_tiktoken = tok.family.engine == "tiktoken"
    out: dict = {}
    nthreads = threads or os.cpu_count() or 1

    def ours(mode: str):
        def factory():
            from tokenplane.tokenize.cpu.parallel import CpuEncoder
            from tokenplane.tokenize.tokenizer import Tokenizer

            fresh = Tokenizer(family, tok.family, artifact_bytes(family))   # new instance: nothing cached
            enc = CpuEncoder(fresh, workers=nthreads)
            if mode == "serial":
                return lambda texts: [enc.encode(t, parallel=False) for t in texts]
            return lambda texts: [enc.encode(t) for t in texts]   # chunk-parallel from 256K chars on
        return factory

    if _cpu_path_available(tok):
        out[OURS_SERIAL] = ours("serial")
        if threads is None:
            out[OURS_PARALLEL] = ours("auto")

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

    if family in TOKTIER_FAMILIES and _importable("toktier"):
        def toktier_factory():
            tt = load_toktier(family)
            return lambda texts: [tt.encode(t, lookup="off").ids for t in texts]
        out["toktier"] = toktier_factory
    return tok, out


def peer_factories(spec: dict, threads: int | None, engines: tuple[str, ...]):
    """fastokens and gigatoken from the spec the first worker wrote (no tokenplane import: another environment)."""
    out: dict = {}
    path, is_tiktoken = spec["file"], spec["engine"] == "tiktoken"

    def fastokens_factory():
        import fastokens

        if is_tiktoken:
            ft = fastokens.Tokenizer.from_tiktoken(path, pattern=spec["pattern"], special_tokens=spec["specials"])
        else:
            ft = fastokens.Tokenizer.from_file(path)
        if threads is None and hasattr(ft, "encode_batch"):
            return lambda texts: ([e.ids for e in ft.encode_batch(texts, add_special_tokens=False)]
                                  if len(texts) > 1 else [ft.encode(texts[0], add_special_tokens=False).ids])
        return lambda texts: [ft.encode(t, add_special_tokens=False).ids for t in texts]

    def gigatoken_factory():
        import gigatoken

        if is_tiktoken:
            try:
                gt = gigatoken.Tokenizer.from_tiktoken(path)
            except BaseException:   # noqa: BLE001 - it panics (pyo3) on an unknown file; then give the pattern
                gt = gigatoken.Tokenizer.from_tiktoken(path, pretokenizer=spec["pattern"])
        else:
            gt = gigatoken.Tokenizer(path)
        if threads is None and hasattr(gt, "encode_batch_list"):
            return lambda texts: gt.encode_batch_list(texts) if len(texts) > 1 else [gt.encode(texts[0])]
        return lambda texts: [gt.encode(t) for t in texts]

    for name, factory in (("fastokens", fastokens_factory), ("gigatoken", gigatoken_factory)):
        if name in engines and _importable(name):
            out[name] = factory
    return out


def _importable(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


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


def _ref_file(work: Path, family: str, cat: str, size: str) -> Path:
    return work / f"ref-{family}-{cat}-{size}.npz"


def fresh_copies(texts: list[str]) -> list[str]:
    """Equal strs that are new objects. CPython keeps a str's UTF-8 form inside the object once an extension asks for
    it (PyUnicode_AsUTF8AndSize, which pyo3's &str extraction calls), so an engine that reads UTF-8 pays the encode of
    a non-ASCII str on its first call only and every later pass over the same object gets it free: gigatoken's repeat
    of cl100k english 1M (a 2-byte str) measured 2.19 ms on the same object vs 2.87 on a copy, CJK 7.78 vs 9.23, ASCII
    code 2.18 vs 2.22 (the UTF-8 is the buffer itself). A server decodes a new str per request, so every timed pass of
    every engine gets copies made outside the timer (same kind, no cached UTF-8)."""
    return [(t + "\x00")[:-1] for t in texts]


def measure(factory, docs: list[str], warm_docs: list[str], reference, args) -> dict:
    """One engine on one cell: setup, cold, warm (new instances warmed on other documents), repeat (same text)."""
    import numpy as np

    def same(out) -> bool | None:
        if reference is None:
            return None
        return all(np.array_equal(np.asarray(o, dtype=np.int64), np.asarray(r, dtype=np.int64))
                   for o, r in zip(out, reference))

    nbytes = sum(len(d.encode("utf-8")) for d in docs)
    t0 = time.perf_counter()
    enc = factory()
    setup = time.perf_counter() - t0
    texts = fresh_copies(docs)
    t0 = time.perf_counter()
    out = enc(texts)
    cold = time.perf_counter() - t0
    exact = same(out)
    warm: list[float] = []
    for _ in range(args.warm_runs):
        enc = factory()
        enc(fresh_copies(warm_docs))
        texts = fresh_copies(docs)
        t0 = time.perf_counter()
        out = enc(texts)
        warm.append(time.perf_counter() - t0)
        if len(warm) == 1:
            exact = exact if exact is False else same(out)
        if warm[-1] > args.slow_pass_s:
            break
    repeat: list[float] = []
    for _ in range(args.repeat_runs):
        texts = fresh_copies(docs)
        t0 = time.perf_counter()
        enc(texts)
        repeat.append(time.perf_counter() - t0)
        if repeat[-1] > args.slow_pass_s:
            break
    cell = {"setup_ms": setup * 1e3, "cold_mbps": nbytes / cold / 1e6,
            "warm_mbps": nbytes / statistics.median(warm) / 1e6, "warm_best_mbps": nbytes / min(warm) / 1e6,
            "warm_runs": len(warm), "exact": exact}
    if repeat:
        cell.update(repeat_mbps=nbytes / statistics.median(repeat) / 1e6, repeat_runs=len(repeat))
    return cell


def worker(args) -> None:
    threads = None if args.threads == "all" else int(args.threads)
    if threads is not None and hasattr(os, "sched_setaffinity"):
        # Pin the whole process (every engine's thread pool) to `threads` CPUs: a true single-core measurement.
        os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:threads])
    import numpy as np

    work = Path(args.work)
    peer_side = args.side == "peer"
    if peer_side:
        spec = json.loads((work / f"spec-{args.family}.json").read_text())
        factories = peer_factories(spec, threads, tuple(args.peer_engines.split(",")))
        tok = None
    else:
        tok, factories = our_factories(args.family, threads)
        from tokenplane.tokenize.spec.artifacts import artifact_file

        spec = {"family": args.family, "engine": tok.family.engine, "file": str(artifact_file(args.family)),
                "pattern": tok.family.patterns[0], "specials": dict(tok.family.specials)}
        (work / f"spec-{args.family}.json").write_text(json.dumps(spec))
    budget_end = time.monotonic() + args.budget_s
    results = []
    for cat, size_name, docs, tiled, warm_docs in cells(Path(args.corpus), args.sizes.split(","), args.warmup_chars):
        nbytes = sum(len(d.encode("utf-8")) for d in docs)
        ref_path = _ref_file(work, args.family, cat, size_name)
        reference = None
        if peer_side:
            if ref_path.exists():
                with np.load(ref_path) as z:
                    reference = [z[f"a{i}"] for i in range(len(docs))]
        elif time.monotonic() < budget_end:
            reference = reference_ids(tok, docs)
            np.savez(ref_path, **{f"a{i}": a for i, a in enumerate(reference)})
        for name, factory in factories.items():
            cell = {"family": args.family, "cores": args.threads, "category": cat, "size": size_name,
                    "docs": len(docs), "bytes": nbytes, "tiled": tiled, "engine": name,
                    "warmup_chars": sum(len(d) for d in warm_docs)}
            if time.monotonic() > budget_end:
                cell["skipped"] = "time budget"
            elif name == "hf-tokenizers" and SIZES[size_name] >= 1_000_000 and not args.slow_hf:
                cell["skipped"] = "HF at >= 1M chars takes 3-20 s a pass here (--slow-hf to run it)"
            else:
                try:
                    cell.update(measure(factory, docs, warm_docs, reference, args))
                except BaseException as exc:   # noqa: BLE001 - a peer that fails (or panics) is reported, not fatal
                    if isinstance(exc, KeyboardInterrupt):
                        raise
                    cell["error"] = f"{type(exc).__name__}: {exc}"[:300]
            results.append(cell)
            print(json.dumps(cell), file=sys.stderr, flush=True)
    json.dump(results, sys.stdout)


def run_config(args, family: str, threads: str, side: str, budget_s: float, work: Path) -> list[dict]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    if threads != "all":
        env.update(RAYON_NUM_THREADS=threads, FASTOKENS_BPE_THREADS=threads, TOKENIZERS_PARALLELISM="false",
                   OMP_NUM_THREADS=threads, TOKENPLANE_CPU_THREADS=threads)
    else:
        for k in ("RAYON_NUM_THREADS", "FASTOKENS_BPE_THREADS", "OMP_NUM_THREADS", "TOKENPLANE_CPU_THREADS"):
            env.pop(k, None)
        env["TOKENIZERS_PARALLELISM"] = "true"
    python = args.peer_python if side == "peer" else sys.executable
    cmd = [python, __file__, "--worker", "--side", side, "--family", family, "--threads", threads,
           "--corpus", args.corpus, "--sizes", args.sizes, "--budget-s", str(budget_s), "--work", str(work),
           "--warm-runs", str(args.warm_runs), "--repeat-runs", str(args.repeat_runs),
           "--warmup-chars", str(args.warmup_chars), "--slow-pass-s", str(args.slow_pass_s),
           "--peer-engines", args.peer_engines] + (["--slow-hf"] if args.slow_hf else [])
    proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        return [{"family": family, "cores": threads, "error": f"{side} worker exited {proc.returncode}"}]
    return json.loads(proc.stdout)


# -- report ---------------------------------------------------------------------------------------------------------
def _fmt(r: dict | None) -> str:
    if r is None or "skipped" in r:
        return "skip"
    if "error" in r:
        return "error"
    mark = "" if r["exact"] else (" ?" if r["exact"] is None else " ✗")
    rep = f" / {r['repeat_mbps']:.1f}" if "repeat_mbps" in r else ""
    return f"{r['cold_mbps']:.1f} / **{r['warm_mbps']:.1f}** [{r['warm_best_mbps']:.1f}]{rep}{mark}"


def markdown(results: list[dict], meta: dict) -> str:
    lines = ["# Full-encode throughput (MB/s of UTF-8 input)\n",
             f"Command: `{meta['command']}`  ",
             f"Machine: {meta['machine']}; {meta['cpus']} CPUs; load average {meta['loadavg']} (start), "
             f"{meta.get('loadavg_end', '?')} (end); started {meta['started']}, {meta.get('wall_s', '?')} s. "
             f"Peers: {meta.get('peers', '-')}.\n",
             "Cells: cold / **warm** [warm best] / repeat. cold = a new instance's first encode; **warm** = a new "
             f"instance that first encoded {meta.get('warmup_chars', '?'):,} characters of *other* documents of the "
             "category, then the cell's documents (never seen by it), median of "
             f"{meta.get('warm_runs', '?')} instances [best]; repeat = that instance encoding the same documents "
             "again (every internal cache hits: not a server's case). Setup (construction) is timed separately "
             "(JSON `setup_ms`) and in no MB/s figure, for every engine alike. ✗ = an output differs from the "
             "reference IDs (? = no reference). Every timed pass of every engine encodes new str objects equal to the "
             "documents (made outside the timer): CPython caches a str's UTF-8 inside the object for engines that "
             "read UTF-8, which would make every pass after an engine's first skip the encode. A `*` marks text tiled to reach the size (the CJK pool is ~2.3 M "
             "characters, so its 4M text repeats itself and its warm figure includes self-hits).\n"]
    keys = sorted({(r["family"], r["cores"]) for r in results if "category" in r},
                  key=lambda k: (FAMILIES.index(k[0]) if k[0] in FAMILIES else 99, k[1]))
    for family, cores in keys:
        rows = [r for r in results if r.get("family") == family and r.get("cores") == cores and "category" in r]
        cs = sorted({(r["category"], r["size"]) for r in rows}, key=lambda c: (list(CATEGORIES).index(c[0]),
                                                                               list(SIZES).index(c[1])))
        engines = list(dict.fromkeys(r["engine"] for r in rows))
        lines.append(f"\n## {family}, {'1 core' if cores == '1' else 'all cores'}\n")
        tiled = {(r["category"], r["size"]) for r in rows if r["tiled"]}
        lines.append("| engine | " + " | ".join(f"{c} {s}{'*' if (c, s) in tiled else ''}" for c, s in cs) + " |")
        lines.append("|---|" + "---:|" * len(cs))
        for eng in engines:
            vals = [_fmt(next((r for r in rows if r["engine"] == eng and (r["category"], r["size"]) == c), None))
                    for c in cs]
            lines.append(f"| {eng} | " + " | ".join(vals) + " |")
    lines.append("\n## Targets (issue 17; reported, not asserted)\n")
    lines += [f"- {t}" for t in targets(results)]
    errs: dict[tuple, list[str]] = {}
    for r in results:
        if "error" in r:   # one line per (family, engine, message): a peer that cannot load fails every cell alike
            msg = " ".join(r["error"].split())
            errs.setdefault((r.get("family"), r.get("engine", ""), msg), []).append(
                f"{r.get('cores')} {r.get('category', '')} {r.get('size', '')}".strip())
    if errs:
        lines.append("\n## Errors\n")
        lines += [f"- {fam} {eng} ({len(where)} cells: {', '.join(where)}): {msg}"
                  for (fam, eng, msg), where in errs.items()]
    return "\n".join(lines) + "\n"


def targets(results: list[dict]) -> list[str]:
    """Warm full encode, one thread, >= the best exact peer (fastokens or gigatoken) in every cell >= 1M; two
    threads >= 1.8x one (the parallel encoder vs the serial one in the same all-cores process, both warm)."""
    ok = [r for r in results if "warm_mbps" in r]
    out = []
    for fam in sorted({r["family"] for r in ok}, key=lambda f: FAMILIES.index(f) if f in FAMILIES else 99):
        one = {(r["category"], r["size"], r["engine"]): r for r in ok if r["family"] == fam and r["cores"] == "1"}
        parts, met, any_cell = [], True, False
        for c, s in sorted({(c, s) for c, s, e in one if e == OURS_SERIAL and SIZES[s] >= 1_000_000},
                           key=lambda x: (list(CATEGORIES).index(x[0]), list(SIZES).index(x[1]))):
            ours = one[(c, s, OURS_SERIAL)]
            peers = [(one[(c, s, p)]["warm_mbps"], p) for p in PEER_ENGINES
                     if (c, s, p) in one and one[(c, s, p)]["exact"]]
            if not peers:
                parts.append(f"{c} {s} {ours['warm_mbps']:.1f} (no exact peer)")
                continue
            any_cell = True
            best, who = max(peers)
            good = bool(ours["exact"]) and ours["warm_mbps"] >= best
            met &= good
            parts.append(f"{c} {s} {ours['warm_mbps']:.1f} vs {who} {best:.1f}{'' if good else ' (miss)'}")
        if parts:
            out.append(f"{fam}: one core, warm, exact, >= best peer: "
                       f"{('met' if met else 'NOT met') if any_cell else 'no peer measured'} (" + "; ".join(parts) + ")")
        allc = {(r["category"], r["size"], r["engine"]): r for r in ok if r["family"] == fam and r["cores"] == "all"}
        parts, met, any_cell = [], True, False
        for (c, s, e), r in sorted(allc.items()):
            if e != OURS_PARALLEL or SIZES[s] < 1_000_000 or (c, s, OURS_SERIAL) not in allc:
                continue
            any_cell = True
            ratio = r["warm_mbps"] / allc[(c, s, OURS_SERIAL)]["warm_mbps"]
            met &= ratio >= 1.8 and bool(r["exact"])
            parts.append(f"{c} {s} {ratio:.2f}x")
        if any_cell:
            out.append(f"{fam}: two threads >= 1.8x one (parallel vs serial, same process, warm): "
                       f"{'met' if met else 'NOT met'} (" + "; ".join(parts) + "); a ratio of two medians of a few "
                       "passes run one after the other; the paired, gated measurement is benchmarks/parallel_speedup.py")
    return out


ENGINE_COLORS = {OURS_SERIAL: "tab:blue", OURS_PARALLEL: "navy", "tiktoken": "tab:orange", "hf-tokenizers": "tab:orange",
                 "fastokens": "tab:green", "gigatoken": "tab:red", "toktier": "tab:purple"}


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = sorted({(r["family"], r["cores"]) for r in results if "warm_mbps" in r})
    fig, axes = plt.subplots(len(keys), len(CATEGORIES), figsize=(5 * len(CATEGORIES), 3.2 * max(1, len(keys))),
                             squeeze=False)
    for i, (family, cores) in enumerate(keys):
        for j, cat in enumerate(CATEGORIES):
            ax = axes[i][j]
            rows = [r for r in results if r.get("family") == family and r.get("cores") == cores
                    and r.get("category") == cat and "warm_mbps" in r]
            for eng in dict.fromkeys(r["engine"] for r in rows):
                pts = sorted((list(SIZES).index(r["size"]), r["cold_mbps"], r["warm_mbps"]) for r in rows
                             if r["engine"] == eng)
                color = ENGINE_COLORS.get(eng, "black")
                ax.plot([p[0] for p in pts], [p[2] for p in pts], marker="o", color=color, label=eng)
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="x", ls=":", color=color)
            ax.set_xticks(range(len(SIZES)), list(SIZES))
            ax.set_yscale("log")
            ax.set_title(f"{family} {cat} ({'1 core' if cores == '1' else 'all cores'})", fontsize=9)
            ax.set_ylabel("MB/s (solid warm, dotted cold)", fontsize=7)
            if rows:
                ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--families", default="all", help="comma list, or all")
    p.add_argument("--cores", default="1,all", help="comma list of 1 and/or all")
    p.add_argument("--corpus", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "tokenplane_corpus"))
    p.add_argument("--sizes", default="1M,4M")
    p.add_argument("--budget-s", type=float, default=1500.0, help="total seconds across configurations")
    p.add_argument("--warm-runs", type=int, default=3, help="new instances per cell for the warm figure")
    p.add_argument("--repeat-runs", type=int, default=1)
    p.add_argument("--warmup-chars", type=int, default=1_000_000,
                   help="characters of other documents each warm instance encodes first")
    p.add_argument("--slow-pass-s", type=float, default=3.0, help="stop repeating a cell after a pass this long")
    p.add_argument("--slow-hf", action="store_true")
    p.add_argument("--peer-python", default=os.environ.get("TOKENPLANE_PEERS_PYTHON", ""),
                   help="python of the environment with fastokens and gigatoken "
                        "(benchmarks/peers/build_tokenizer_peers.sh); default: this one")
    p.add_argument("--peer-engines", default=",".join(PEER_ENGINES))
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    p.add_argument("--render-only", action="store_true", help="re-render md/png from the existing JSON in --out")
    # worker mode
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    for flag in ("--side", "--family", "--threads", "--work"):
        p.add_argument(flag, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return 0
    if args.render_only:
        data = json.loads((Path(args.out) / "full_encode.json").read_text())
        (Path(args.out) / "full_encode.md").write_text(markdown(data["results"], data["meta"]))
        plot(data["results"], Path(args.out) / "full_encode.png")
        return 0
    args.peer_python = args.peer_python or sys.executable
    ensure_corpus(Path(args.corpus))
    families = FAMILIES if args.families == "all" else tuple(args.families.split(","))
    configs = [(f, c) for f in families for c in args.cores.split(",")]
    probe = (f"import importlib.metadata as m\nfor n in {PEER_ENGINES!r}:\n"
             "  try: print(n, m.version(n))\n  except Exception: pass")
    peers = subprocess.run([args.peer_python, "-c", probe], capture_output=True, text=True).stdout.split("\n")
    meta = {"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
            "loadavg": " ".join(f"{x:.2f}" for x in os.getloadavg()),
            "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "command": " ".join([Path(sys.executable).name, *sys.argv]), "warm_runs": args.warm_runs,
            "warmup_chars": args.warmup_chars,
            "peers": ", ".join(x for x in peers if x) + f" ({args.peer_python})"}
    t0 = time.time()
    results: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="full_encode_") as tmp:
        work = Path(tmp)
        for i, (family, cores) in enumerate(configs):
            left = args.budget_s - (time.time() - t0)
            share = max(60.0, left / (len(configs) - i))
            # ours first (it writes the references and the peers' spec), then the peers, in the same minute
            t_ours = time.time()
            results += run_config(args, family, cores, "ours", share * 0.6, work)
            results += run_config(args, family, cores, "peer", max(30.0, share - (time.time() - t_ours)), work)
    meta["wall_s"] = round(time.time() - t0, 1)
    meta["loadavg_end"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "full_encode.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    (out / "full_encode.md").write_text(markdown(results, meta))
    plot(results, out / "full_encode.png")
    print((out / "full_encode.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
