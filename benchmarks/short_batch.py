"""Batches of short texts (chat messages, tool results: 20-300 characters each): microseconds per text.

The texts are cut from the real-text corpus (benchmarks/full_encode.py's pools, english + code, or the CJK pool with
`--category cjk`), a new set of texts for every round. Per round, alternating: tokenplane in this process
(`encode_batch` on 1 and 2 threads, and one `encode` per text), tiktoken's `encode_ordinary_batch` where the family
is a tiktoken one, then gigatoken (`encode_batch_list`, `encode` per text) and fastokens (`encode_batch`) in the
peer environment (`--peer-python`, a child process given the same texts). The peers' batch calls run on their
default thread pools (rayon: every core), their per-text loops on one thread: compare a batch call with tokenplane's
batch on as many threads, a one-thread figure with their per-text loop. Every engine's IDs are compared with the
reference engine's; µs per text: median and P90 over rounds (each round the best of `--reps` passes). Writes
OUT.json / OUT.md / OUT.png.

  flock /tmp/bench.lock python benchmarks/short_batch.py --families cl100k_base,qwen3 --corpus /tmp/corpus \\
      --peer-python /work/peers/tokpeers-sys/bin/python --out benchmarks/results/short_batch
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

_PEER = r"""
import json, sys, time
spec, texts_file, reps = json.loads(sys.argv[1]), sys.argv[2], int(sys.argv[3])
texts = json.load(open(texts_file))
out = {}
def best(fn):
    fn()
    ts = []
    for _ in range(reps):
        t = time.perf_counter(); r = fn(); ts.append(time.perf_counter() - t)
    return min(ts), r
try:
    import gigatoken
    gt = (gigatoken.Tokenizer.from_tiktoken(spec["file"]) if spec["engine"] == "tiktoken"
          else gigatoken.Tokenizer(spec["file"]))
    t, ids = best(lambda: gt.encode_batch_list(texts))
    out["gigatoken encode_batch_list"] = [t, [list(map(int, x)) for x in ids]]
    t, ids = best(lambda: [gt.encode(x) for x in texts])
    out["gigatoken encode per text"] = [t, [list(map(int, x)) for x in ids]]
except Exception as exc:
    out["gigatoken"] = repr(exc)[:200]
try:
    import fastokens
    ft = (fastokens.Tokenizer.from_tiktoken(spec["file"], pattern=spec["pattern"], special_tokens=spec["specials"])
          if spec["engine"] == "tiktoken" else fastokens.Tokenizer.from_file(spec["file"]))
    t, enc = best(lambda: ft.encode_batch(texts, add_special_tokens=False))
    out["fastokens encode_batch"] = [t, [list(e.ids) for e in enc]]
except Exception as exc:
    out["fastokens"] = repr(exc)[:200]
print(json.dumps(out))
"""


def short_texts(pool: str, count: int, rng: random.Random) -> list[str]:
    out = []
    for _ in range(count):
        n = rng.randint(20, 300)
        a = rng.randrange(0, len(pool) - n)
        out.append(pool[a:a + n])
    return out


def best_of(fn, reps: int) -> tuple[float, object]:
    result = fn()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        result = fn()
        ts.append(time.perf_counter() - t)
    return min(ts), result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--families", default="cl100k_base,o200k_base,qwen3,deepseek_v4")
    p.add_argument("--category", default="mixed", choices=("mixed", "cjk"))
    p.add_argument("--corpus", default="/tmp/corpus")
    p.add_argument("--texts", type=int, default=10_000)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--peer-python", default=os.environ.get("TOKENPLANE_PEERS_PYTHON", ""))
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "short_batch"))
    args = p.parse_args()

    import numpy as np
    from full_encode import category_pools, ensure_corpus

    import tokenplane
    from tokenplane.tokenize.spec.artifacts import artifact_file

    pools = category_pools(ensure_corpus(Path(args.corpus)))
    pool = pools["cjk"] if args.category == "cjk" else pools["english"] + pools["code"]
    started, load0, t_start = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), os.getloadavg(), time.time()
    rows = []
    for fam in args.families.split(","):
        tok = tokenplane.load(fam)
        is_tt = tok.family.engine == "tiktoken"
        spec = {"file": str(artifact_file(fam)), "engine": tok.family.engine, "pattern": tok.family.patterns[0],
                "specials": dict(tok.family.specials)}
        samples: dict[str, list[float]] = {}
        exact: dict[str, bool] = {}
        notes: dict[str, str] = {}
        rng = random.Random(fam)
        for r in range(args.rounds):
            texts = short_texts(pool, args.texts, rng)
            ref = [tok.encode(t, path="reference").tolist() for t in texts]
            engines = {"tokenplane encode_batch (1 thread)": lambda: tok.encode_batch(texts, num_threads=1),
                       "tokenplane encode_batch (2 threads)": lambda: tok.encode_batch(texts, num_threads=2),
                       "tokenplane encode per text": lambda: [tok.encode(t) for t in texts]}
            if is_tt:
                engines["tiktoken encode_ordinary_batch"] = \
                    lambda: tok.reference.encoding.encode_ordinary_batch(texts, num_threads=1)
            names = list(engines) if r % 2 == 0 else list(engines)[::-1]
            for name in names:
                t, got = best_of(engines[name], args.reps)
                samples.setdefault(name, []).append(t / len(texts) * 1e6)
                ok = all(np.array_equal(np.asarray(g, dtype=np.int64), np.asarray(x, dtype=np.int64))
                         for g, x in zip(got, ref))
                exact[name] = exact.get(name, True) and ok
            if args.peer_python:
                with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
                    json.dump(texts, f)
                res = subprocess.run([args.peer_python, "-c", _PEER, json.dumps(spec), f.name, str(args.reps)],
                                     capture_output=True, text=True, timeout=900)
                os.unlink(f.name)
                peer = json.loads(res.stdout.strip().splitlines()[-1]) if res.returncode == 0 else {}
                if res.returncode:
                    notes["peers"] = res.stderr.strip().splitlines()[-1][:200] if res.stderr.strip() else "failed"
                for name, val in peer.items():
                    if isinstance(val, str):
                        notes[name] = val
                        continue
                    samples.setdefault(name, []).append(val[0] / len(texts) * 1e6)
                    exact[name] = exact.get(name, True) and val[1] == ref
        for name, us in samples.items():
            s = sorted(us)
            rows.append({"family": fam, "engine": name, "us_per_text_median": statistics.median(s),
                         "us_per_text_p90": s[min(len(s) - 1, (9 * len(s)) // 10)], "rounds": len(s),
                         "exact": exact[name]})
            print(json.dumps(rows[-1]), flush=True)
        for name, why in notes.items():
            rows.append({"family": fam, "engine": name, "error": why})
    meta = {"command": "python " + " ".join(sys.argv), "started": started, "load_start": load0,
            "load_end": os.getloadavg(), "wall_s": time.time() - t_start, "machine": platform.machine(),
            "cpus": os.cpu_count(), "texts": args.texts, "category": args.category, "rows": rows}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(meta, indent=1))
    lines = ["# Batches of short texts (20-300 characters), µs per text", "",
             f"Command: `{meta['command']}`  ",
             f"Machine: {meta['machine']}, {meta['cpus']} CPUs; load average {' '.join(f'{x:.2f}' for x in load0)} "
             f"(start), {' '.join(f'{x:.2f}' for x in meta['load_end'])} (end); started {started}, "
             f"{meta['wall_s']:.0f} s. {args.texts:,} texts a round, new ones every round; each engine's figure a "
             "round is the best of its passes; median [P90] over rounds; ✗: IDs differ from the reference. The "
             "peers' batch calls use their default thread pools (every core); their per-text loops one thread.", "",
             "| family | engine | µs per text | exact |", "|---|---|---:|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['family']} | {r['engine']} | error: {r['error']} | |")
        else:
            lines.append(f"| {r['family']} | {r['engine']} | {r['us_per_text_median']:.2f} "
                         f"[{r['us_per_text_p90']:.2f}] | {'yes' if r['exact'] else '✗'} |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        ok = [r for r in rows if "error" not in r]
        fig, ax = plt.subplots(figsize=(9, 0.28 * len(ok) + 1.2))
        ax.barh(range(len(ok)), [r["us_per_text_median"] for r in ok],
                color=["tab:blue" if r["engine"].startswith("tokenplane") else "tab:gray" for r in ok])
        ax.set_yticks(range(len(ok)), [f"{r['family']}: {r['engine']}" for r in ok], fontsize=6)
        ax.set_xlabel("µs per text (lower is better)")
        ax.invert_yaxis()
        fig.tight_layout()
        fig.savefig(out.with_suffix(".png"), dpi=120)
    except ImportError:
        pass
    print("\n".join(lines))


if __name__ == "__main__":
    main()
