"""Cold start: import + load(name) + first encode of 1M characters of real agent text, in a fresh process.

Every sample is its own subprocess (nothing of an earlier sample survives but the on-disk caches, which the target
allows: `tokenplane warmup` builds them, and it runs once first). Phases, timed inside the child:
  import   `import tokenplane` (or `import gigatoken`)
  load     `tokenplane.load(name)` (gigatoken: constructing its tokenizer from the same pinned file)
  encode1  the first `encode` of the text (default path "auto"); `cold` = import + load + encode1, the target
tokenplane runs twice per repeat: with its ahead-of-time kernel module (cpu/kernels.py; `tokenplane warmup` builds
it) and as `tokenplane-jit` with TOKENPLANE_AOT=0 (the numba JIT kernels loaded from numba's cache: the fallback).
  encode2  a second encode of the same text (warm)
`tokenplane-session` is the server's path in the same shape: encode1 = a new `Session` and its first `sync` of the
text (what a fresh server does with a conversation's first request), encode2 = another new session's sync (warm).
  interp   interpreter start until the child's first line (from /proc, 10 ms resolution; not part of `cold`)
Systems alternate within each repeat (tokenplane, gigatoken, then the other order on the next repeat). A third
child, `numba-floor`, imports numpy + numba and calls one trivial `cache=True` kernel (with tokenplane's BLAS-probe
skip): the cost any numba-kernel path pays before its first useful instruction. Every encode is compared with the
reference IDs (tiktoken / HF tokenizers through tokenplane's reference engine, computed once up front): `exact`.
The tokenplane child also records the router's stats: `reference` calls on the default path must be 0.

  flock /tmp/bench.lock python benchmarks/cold_start.py --repeats 5 [--peer-python /path/to/venv/bin/python]
Text: the first 1M characters of ../shared/data/traces/mini-swe-agent (every message, in order), else the
trajectories shipped in tests/fixtures/traces (tiled). Writes benchmarks/results/cold_start.{json,md,png}.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FAMILIES = ("cl100k_base", "o200k_base", "llama3", "qwen3", "deepseek_v4", "smollm2")
TARGET_S = 0.3
DATA = Path(os.environ.get("TOKENPLANE_SHARED", ROOT.parent / "shared")) / "data" / "traces" / "mini-swe-agent"
FIXTURE_TRACES = ROOT / "tests" / "fixtures" / "traces"


# -- children -------------------------------------------------------------------------------------------------------
def _interp_s() -> float:
    """Seconds since this process started (clock ticks from /proc; ~10 ms resolution), or -1 off Linux."""
    try:
        ticks = os.sysconf("SC_CLK_TCK")
        start = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19]) / ticks
        return float(Path("/proc/uptime").read_text().split()[0]) - start
    except (OSError, ValueError, IndexError):
        return -1.0


def _same_ids(ids, ref_path: str) -> bool:
    from array import array

    ref = array("I")
    with open(ref_path, "rb") as f:
        ref.frombytes(f.read())
    return len(ref) == len(ids) and all(int(a) == b for a, b in zip(ids, ref))


def _timed(out: dict, imported, encode):
    """Import (`imported()` returns the loader), load, and two encodes, each timed into `out`."""
    t0 = time.perf_counter()
    load = imported()
    t1 = time.perf_counter()
    obj = load()
    t2 = time.perf_counter()
    ids = encode(obj)
    t3 = time.perf_counter()
    ids2 = encode(obj)
    t4 = time.perf_counter()
    out.update(import_s=t1 - t0, load_s=t2 - t1, encode1_s=t3 - t2, encode2_s=t4 - t3)
    return obj, ids, ids2


def child(args: argparse.Namespace) -> None:
    interp = _interp_s()
    text = Path(args.text).read_bytes().decode("utf-8")   # bytes: no newline translation (the text holds \r)
    system = args.child
    if system == "tokenplane" and os.environ.get("TOKENPLANE_AOT") == "0":
        system = "tokenplane-jit"       # the numba JIT kernels (the fallback), side by side with the AOT module
    out: dict = {"system": system, "family": args.family, "interp_s": interp}
    if args.child == "numba-floor":
        import importlib.util

        t0 = time.perf_counter()
        import numba  # noqa: F401
        import numpy as np
        spec = importlib.util.spec_from_file_location("numbastart", ROOT / "tokenplane/tokenize/cpu/numbastart.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        mod.skip_blas_probe()
        t1 = time.perf_counter()
        sys.path.insert(0, args.floor_dir)
        import floor_kernel  # type: ignore[import-not-found]
        floor_kernel.first(np.arange(3, dtype=np.int64))
        t2 = time.perf_counter()
        out.update(import_s=t1 - t0, load_s=0.0, encode1_s=t2 - t1, encode2_s=0.0, exact=True)
    elif args.child in ("tokenplane", "tokenplane-session"):
        def load_tokenplane():
            import tokenplane
            return lambda: tokenplane.load(args.family)

        def first_sync(t):
            session = t.session()
            session.sync(text)
            return session.ids

        if args.child == "tokenplane-session":
            out["system"] = system.replace("tokenplane", "tokenplane-session")
        tok, ids, ids2 = _timed(out, load_tokenplane,
                                first_sync if args.child == "tokenplane-session" else (lambda t: t.encode(text)))
        numba_imported = "numba" in sys.modules      # before anything below could import it
        from tokenplane.tokenize.cpu import kernels
        auto = tok.path("auto")
        out.update(kernels=kernels.get().kind, numba_imported=numba_imported)
        out.update(router_stats=dict(getattr(auto, "stats", {})), reference_built=tok._reference is not None,
                   exact=_same_ids(ids.tolist(), args.ref) and _same_ids(ids2.tolist(), args.ref))
    else:   # gigatoken, from the same pinned file
        def load_gigatoken():
            import gigatoken
            if args.family == "llama3":     # a .tiktoken file names no splitter; gigatoken's cl100k-style one
                return lambda: gigatoken.Tokenizer.from_tiktoken(args.file, pretokenizer="gpt4")
            if args.file.endswith(".tiktoken"):
                return lambda: gigatoken.Tokenizer.from_tiktoken(args.file)
            return lambda: gigatoken.Tokenizer(args.file)

        _, ids, ids2 = _timed(out, load_gigatoken, lambda gt: gt.encode(text))
        out.update(exact=_same_ids(list(ids), args.ref) and _same_ids(list(ids2), args.ref))
    print("RESULT " + json.dumps(out))


# -- parent ---------------------------------------------------------------------------------------------------------
def real_text(n_chars: int) -> tuple[str, str]:
    """The first n_chars of every message of the agent trajectories, in order (data folder, else the fixtures)."""
    folder = DATA if DATA.is_dir() else FIXTURE_TRACES
    parts, total = [], 0
    for path in sorted(folder.glob("*.traj.json*")):
        raw = path.read_bytes()
        if path.suffix == ".gz":
            import gzip
            raw = gzip.decompress(raw)
        for m in json.loads(raw).get("messages", []):
            c = m.get("content")
            if isinstance(c, list):
                c = "".join(x.get("text", "") for x in c if isinstance(x, dict))
            if isinstance(c, str):
                parts.append(c)
                total += len(c) + 1
        if total > n_chars:
            break
    text = "\n".join(parts)
    if len(text) < n_chars:
        text = (text + "\n") * (n_chars // (len(text) + 1) + 1)
    return text[:n_chars], str(folder)


def run_child(python: str, extra: list[str], env: dict) -> dict:
    cmd = [python, str(Path(__file__).resolve()), "--child-of", *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if proc.returncode != 0 or line is None:
        return {"error": (proc.stderr or proc.stdout)[-800:]}
    return json.loads(line[len("RESULT "):])


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def summarize(samples: list[dict], n_bytes: int) -> list[dict]:
    rows = []
    keys = sorted({(s["system"], s["family"]) for s in samples if "error" not in s})
    for system, family in keys:
        ss = [s for s in samples if s.get("system") == system and s.get("family") == family]
        row: dict = {"system": system, "family": family, "n": len(ss), "exact": all(s["exact"] for s in ss)}
        for ph in ("interp_s", "import_s", "load_s", "encode1_s", "encode2_s"):
            vals = [s[ph] for s in ss]
            row[ph] = {"median": statistics.median(vals), "p90": pct(vals, 0.9)}
        cold = [s["import_s"] + s["load_s"] + s["encode1_s"] for s in ss]
        row["cold_s"] = {"median": statistics.median(cold), "p90": pct(cold, 0.9)}
        row["cold_mbps"] = n_bytes / 1e6 / statistics.median(cold) if system != "numba-floor" else None
        if system.startswith("tokenplane"):
            row["reference_calls"] = sum(s.get("router_stats", {}).get("reference", 0) for s in ss)
            row["reference_built"] = sum(bool(s.get("reference_built")) for s in ss)
            row["met"] = row["cold_s"]["median"] <= TARGET_S
            row["kernels"] = "/".join(sorted({s.get("kernels", "?") for s in ss}))
            row["numba_imported"] = sum(bool(s.get("numba_imported")) for s in ss)
        rows.append(row)
    return rows


def markdown(rows: list[dict], meta: dict) -> str:
    ms = lambda d: f"{1000 * d['median']:.0f} / {1000 * d['p90']:.0f}"  # noqa: E731
    out = ["# Cold start: import + load + first 1M-char encode, fresh process per sample", "",
           f"Command: `{meta['command']}`  ", f"Load average: {meta['loadavg']} (start), {meta['loadavg_end']} (end); "
           f"{meta['cpus']} CPUs; {meta['repeats']} repeats per cell; text: {meta['text_chars']:,} chars "
           f"({meta['text_bytes']:,} UTF-8 bytes) of {meta['text_source']}; "
           f"gigatoken: {meta['peer']}; started {meta['started']}", "",
           "ms, median / P90. cold = import + load + encode1 (the target: <= 300 ms for every family); "
           "interp (interpreter start) is not in cold. kernels: `aot` (the ahead-of-time module, cpu/kernels.py) or "
           "`jit` (numba); in parentheses, samples whose process had imported numba by the end of encode2.", "",
           "| family | system | interp | import | load | encode1 | cold | target | cold MB/s | encode2 | exact | "
           "reference calls / built | kernels (numba imported) |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["family"], r["system"])):
        target = ("met" if r["met"] else "NOT met") if "met" in r else ""
        ref = f"{r['reference_calls']} / {r['reference_built']}" if "reference_calls" in r else ""
        kern = f"{r['kernels']} ({r['numba_imported']}/{r['n']})" if "kernels" in r else ""
        mbps = f"{r['cold_mbps']:.2f}" if r["cold_mbps"] else ""
        out.append(f"| {r['family']} | {r['system']} | {ms(r['interp_s'])} | {ms(r['import_s'])} | {ms(r['load_s'])} "
                   f"| {ms(r['encode1_s'])} | {ms(r['cold_s'])} | {target} | {mbps} | {ms(r['encode2_s'])} "
                   f"| {r['exact']} | {ref} | {kern} |")
    out += ["", "Cold throughput vs gigatoken cold (same run, same text, alternating):", ""]
    by = {(r["system"], r["family"]): r for r in rows}
    for fam in meta["families"]:
        ours, peer = by.get(("tokenplane", fam)), by.get(("gigatoken", fam))
        if ours and peer:
            verdict = "met" if ours["cold_mbps"] >= peer["cold_mbps"] else "NOT met"
            out.append(f"- {fam}: tokenplane {ours['cold_mbps']:.2f} MB/s vs gigatoken {peer['cold_mbps']:.2f} MB/s "
                       f"({verdict})")
        elif ours:
            out.append(f"- {fam}: gigatoken not measured ({meta['peer']})")
    errors = meta.get("errors") or []
    if errors:
        out += ["", "Failed samples:", ""] + [f"- {e}" for e in errors[:20]]
    return "\n".join(out) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = sorted(rows, key=lambda r: (r["family"], r["system"]))
    labels = [f"{r['family']}\n{r['system']}" for r in rows]
    fig, ax = plt.subplots(figsize=(max(8, 0.9 * len(rows)), 4.5))
    bottom = [0.0] * len(rows)
    for ph, color in (("import_s", "#8da0cb"), ("load_s", "#66c2a5"), ("encode1_s", "#fc8d62")):
        vals = [1000 * r[ph]["median"] for r in rows]
        ax.bar(range(len(rows)), vals, bottom=bottom, color=color, label=ph[:-2])
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.axhline(1000 * TARGET_S, color="red", ls="--", lw=1, label="target 300 ms")
    ax.set_xticks(range(len(rows)), labels, fontsize=6, rotation=90)
    ax.set_ylabel("ms (median), fresh process")
    ax.set_title("cold start: import + load + first 1M-char encode")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--families", default=",".join(FAMILIES))
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--chars", type=int, default=1_000_000)
    p.add_argument("--peer-python", default=os.environ.get("TOKENPLANE_GIGATOKEN_PYTHON", ""),
                   help="python of an environment with gigatoken (default: this one, if it has gigatoken)")
    p.add_argument("--no-floor", action="store_true")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    p.add_argument("--name", default="cold_start")
    p.add_argument("--child-of", action="store_true", help=argparse.SUPPRESS)
    for flag in ("--child", "--family", "--text", "--ref", "--file", "--floor-dir"):
        p.add_argument(flag, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child_of:
        child(args)
        return 0
    sys.path.insert(0, str(ROOT))
    from tokenplane.tokenize.spec.artifacts import artifact_file

    families = args.families.split(",")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("TOKENPLANE_AOT", None)
    env_jit = dict(env, TOKENPLANE_AOT="0")
    peer = args.peer_python
    if not peer and subprocess.run([sys.executable, "-c", "import gigatoken"], capture_output=True).returncode == 0:
        peer = sys.executable
    peer_note = "not installed"
    if peer:
        probe = "import importlib.metadata as m; print(m.version('gigatoken'))"
        version = subprocess.run([peer, "-c", probe], capture_output=True, text=True).stdout.strip()
        peer_note = f"gigatoken {version} ({peer})"
    work = Path(tempfile.mkdtemp(prefix="cold_start_"))
    text, source = real_text(args.chars)
    text_path = work / "text.txt"
    text_path.write_bytes(text.encode("utf-8"))
    # Warm the on-disk caches the target allows (tables, vocab records, numba kernels): the README's set-up step.
    warm = subprocess.run([sys.executable, "-m", "tokenplane.cli", "warmup", "--families", ",".join(families)],
                          capture_output=True, text=True, env=env)
    print(warm.stdout.strip() or warm.stderr[-2000:])
    refs, files = {}, {}
    import numpy as np

    import tokenplane
    for fam in families:
        tok = tokenplane.load(fam)
        refs[fam] = work / f"{fam}.ids"
        refs[fam].write_bytes(np.asarray(tok.reference.encode_ordinary(text), dtype=np.uint32).tobytes())
        files[fam] = str(artifact_file(fam))
    floor_dir = work / "floor"
    floor_dir.mkdir()
    (floor_dir / "floor_kernel.py").write_text(
        "from numba import njit\n\n\n@njit(cache=True, nogil=True)\ndef first(a):\n    s = 0\n"
        "    for x in a:\n        s += x\n    return s\n")
    env_note = [f"{k}={os.environ[k]}" for k in ("TOKENPLANE_SHARED", "TOKENPLANE_CACHE", "TOKENPLANE_AOT",
                                                "PYTHONDONTWRITEBYTECODE") if k in os.environ]
    meta = {"command": " ".join([*env_note, Path(sys.executable).name, *sys.argv]), "cpus": os.cpu_count(),
            "machine": platform.machine(), "loadavg": " ".join(f"{x:.2f}" for x in os.getloadavg()),
            "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "repeats": args.repeats,
            "families": families, "text_chars": len(text), "text_bytes": len(text.encode("utf-8")),
            "text_source": source, "peer": peer_note, "warmup": warm.stdout.strip()[-2000:]}
    samples: list[dict] = []
    errors: list[str] = []

    def take(python: str, extra: list[str], repeat: int, child_env: dict | None = None) -> None:
        got = run_child(python, extra, child_env or env)
        if "error" in got:
            errors.append(f"{extra[1]} {extra[3] if len(extra) > 3 else ''}: {got['error'][-300:]}")
        else:
            got["repeat"] = repeat
            samples.append(got)

    for fam in families:     # one discarded run of each system: first-ever process effects (page cache, pyc)
        for kind, child_env in (("tokenplane", env), ("tokenplane", env_jit), ("tokenplane-session", env)):
            run_child(sys.executable, ["--child", kind, "--family", fam, "--text", str(text_path),
                                       "--ref", str(refs[fam])], child_env)
        if peer:
            run_child(peer, ["--child", "gigatoken", "--family", fam, "--text", str(text_path), "--ref",
                             str(refs[fam]), "--file", files[fam]], env)
    if not args.no_floor:
        run_child(sys.executable, ["--child", "numba-floor", "--family", "-", "--text", str(text_path),
                                   "--floor-dir", str(floor_dir)], env)
    for r in range(args.repeats):
        for fam in families:
            order = ["tokenplane", "tokenplane-jit", "tokenplane-session", "gigatoken"]
            for system in (order if r % 2 == 0 else order[::-1]):
                if system.startswith("tokenplane"):
                    kind = "tokenplane-session" if system == "tokenplane-session" else "tokenplane"
                    take(sys.executable, ["--child", kind, "--family", fam, "--text", str(text_path),
                                          "--ref", str(refs[fam])], r, env_jit if system == "tokenplane-jit" else env)
                elif peer:
                    take(peer, ["--child", "gigatoken", "--family", fam, "--text", str(text_path),
                                "--ref", str(refs[fam]), "--file", files[fam]], r)
        if not args.no_floor:
            take(sys.executable, ["--child", "numba-floor", "--family", "-", "--text", str(text_path),
                                  "--floor-dir", str(floor_dir)], r)
    meta["loadavg_end"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    meta["errors"] = errors
    rows = summarize(samples, meta["text_bytes"])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.json").write_text(json.dumps({"meta": meta, "rows": rows, "samples": samples}, indent=1))
    (out / f"{args.name}.md").write_text(markdown(rows, meta))
    plot(rows, out / f"{args.name}.png")
    print(markdown(rows, meta))
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
