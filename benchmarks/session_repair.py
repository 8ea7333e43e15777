"""Session repair latency: tokenplane Session.append vs full re-encode peers and toktier's session, same inputs.

Synthetic long sessions are cut from real text (../shared/tools/build_corpus.py corpus): a context of 100K, 1M or 4M
characters, then appends of either the flat 1.4K-character shape or sizes drawn from real Claude Code sessions
(../shared/data/traces/claude-code-shapes.jsonl, continuation rows, append_tokens x 4 characters, capped). Per step,
engines run interleaved in rotating order on the same text:

  tokenplane       Session.append(chunk), then the full IDs as an array (np.asarray(session.ids))
  reference        full re-encode with the reference engine (tiktoken or HF tokenizers), subsampled when slow
  fastokens        full re-encode, instance prewarmed on the same context
  gigatoken        full re-encode, instance prewarmed on the same context
  toktier          toktier 0.3.0 Python session, Session.append_patch(chunk) (its cheapest Python append path)

The real mini-swe-agent trajectories are replayed too (every LLM call's prompt through Session.sync); peers re-encode
a subset of them. Outputs: P50/P90 per size and shape, ratios, first-window acceptance, fallbacks, bytes/token, and
an exactness check of every engine's final IDs against the reference. JSON + Markdown + PNG in benchmarks/results/.

  python benchmarks/session_repair.py --family qwen3
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from full_encode import TOKTIER_FAMILIES, ensure_corpus, load_toktier  # noqa: E402

SIZES = {"100K": 100_000, "1M": 1_000_000, "4M": 4_000_000}
SHAPES_FILE = ROOT.parent / "shared" / "data" / "traces" / "claude-code-shapes.jsonl"


def pct(values, q):
    return float(np.percentile(np.asarray(values, dtype=float), q)) if len(values) else None


def corpus_pool(corpus: Path) -> str:
    docs = []
    with open(corpus / "mixed.jsonl", encoding="utf-8") as f:
        for line in f:
            docs.append(json.loads(line)["text"])
    random.Random(0).shuffle(docs)   # interleave kinds so a 4M context is not all man pages
    return "\n".join(docs)


def claude_code_appends(n: int, cap_chars: int, rng: random.Random) -> list[int]:
    rows = []
    with open(SHAPES_FILE, encoding="utf-8") as f:
        for line in f:
            r = json.loads(line)
            if r["reused_prefix_tokens"] > 0 and r["append_tokens"] > 0:
                rows.append(r["append_tokens"])
    return [min(cap_chars, 4 * rng.choice(rows)) for _ in range(n)]


class Engines:
    """Full-text encoders for one family, built once; `prewarm(text)` encodes once to fill caches."""

    def __init__(self, family: str, tok, wanted: set[str]):
        from tokenplane.tokenize.spec.artifacts import artifact_file

        self.family, self.tok = family, tok
        is_tt = tok.family.engine == "tiktoken"
        path = artifact_file(family)
        self.full: dict = {"reference": lambda t: tok.encode(t, path="reference")}
        if "fastokens" in wanted:
            import fastokens

            ft = (fastokens.Tokenizer.from_tiktoken(str(path), pattern=tok.family.patterns[0],
                                                    special_tokens=dict(tok.family.specials)) if is_tt
                  else fastokens.Tokenizer.from_file(str(path)))
            self.full["fastokens"] = lambda t: ft.encode(t).ids
        if "gigatoken" in wanted:
            import gigatoken

            gt = gigatoken.Tokenizer.from_tiktoken(str(path)) if is_tt else gigatoken.Tokenizer(str(path))
            self.full["gigatoken"] = gt.encode
        self.toktier = load_toktier(family) if ("toktier" in wanted and family in TOKTIER_FAMILIES) else None


def run_synthetic(args, tok, engines: Engines, pool: str, size_name: str, shape: str, rng: random.Random) -> dict:
    size = SIZES[size_name]
    offset = rng.randrange(0, max(1, len(pool) - size - 2_000_000))
    context = pool[offset:offset + size]
    if len(context) < size:
        context = (pool * (size // len(pool) + 1))[:size]
    if shape == "flat1400":
        lengths = [1400] * args.steps
    else:
        lengths = claude_code_appends(args.steps, args.append_cap, rng)
    cursor = offset + size
    chunks = []
    for n in lengths:
        if cursor + n > len(pool):
            cursor = 0
        chunks.append(pool[cursor:cursor + n])
        cursor += n

    times: dict[str, list[float]] = {"tokenplane": []}
    session = tok.session(encode_path=args.session_path)
    t0 = time.perf_counter()
    session.sync(context)
    np.asarray(session.ids)
    bootstrap_ms = (time.perf_counter() - t0) * 1e3
    stats_before = session.stats.to_dict()
    tt_session = tt_cm = None
    if engines.toktier is not None:
        tt_cm = engines.toktier.session()
        tt_session = tt_cm.__enter__()
        tt_session.append(context)
        times["toktier"] = []
    for name, fn in engines.full.items():
        if name != "reference":
            fn(context)   # prewarm: the context was seen before, as in a serving process
        times[name] = []
    # Slow full re-encoders are timed on a subsample of steps (their cost is O(N) with little variance).
    ref_every = max(1, int(np.ceil(args.steps / max(1, args.ref_steps.get(size_name, args.steps)))))
    text = context
    for k, chunk in enumerate(chunks):
        text += chunk
        order = list(times)
        rot = k % len(order)
        for name in order[rot:] + order[:rot]:
            if name == "tokenplane":
                t0 = time.perf_counter()
                session.append(chunk)
                np.asarray(session.ids)
                times[name].append(time.perf_counter() - t0)
            elif name == "toktier":
                t0 = time.perf_counter()
                tt_session.append_patch(chunk)
                times[name].append(time.perf_counter() - t0)
            elif name == "reference" and k % ref_every != 0:
                continue
            else:
                t0 = time.perf_counter()
                engines.full[name](text)
                times[name].append(time.perf_counter() - t0)
    # Exactness: every engine's final IDs vs one reference encode of the final text.
    ref = tok.encode(text, path="reference").astype(np.int64)
    exact = {"tokenplane": bool(np.array_equal(np.asarray(session.ids, dtype=np.int64), ref))}
    for name, fn in engines.full.items():
        if name != "reference":
            exact[name] = bool(np.array_equal(np.asarray(fn(text), dtype=np.int64), ref))
    if tt_session is not None:
        exact["toktier"] = bool(np.array_equal(np.asarray(tt_session.ids, dtype=np.int64), ref))
        tt_cm.__exit__(None, None, None)
    stats = diff_stats(session.stats.to_dict(), stats_before)
    out = {"size": size_name, "shape": shape, "context_chars": len(context), "steps": len(chunks),
           "append_chars_p50": pct(lengths, 50), "append_chars_max": max(lengths), "final_chars": len(text),
           "final_tokens": int(len(ref)), "bootstrap_ms": bootstrap_ms,
           "bytes_per_token": session.nbytes / max(1, len(ref)), "exact": exact, "session_stats": stats,
           "latency_ms": {name: {"p50": pct(v, 50) and pct(v, 50) * 1e3, "p90": pct(v, 90) and pct(v, 90) * 1e3,
                                 "n": len(v)} for name, v in times.items()}}
    print(json.dumps({k: out[k] for k in ("size", "shape", "latency_ms", "exact")}), flush=True)
    return out


def diff_stats(after: dict, before: dict) -> dict:
    return {k: (v - before.get(k, 0) if isinstance(v, (int, float)) and not isinstance(v, bool) else v)
            for k, v in after.items() if not k.startswith("last_")}


def add_stats(total: dict, more: dict) -> None:
    for k, v in more.items():
        if isinstance(v, (int, float)) and not isinstance(v, bool) and not k.startswith("last_"):
            total[k] = total.get(k, 0) + v


def run_traces(args, tok, engines: Engines) -> dict | None:
    from tokenplane.tokenize.evidence.traces import DEFAULT_TRACES_DIR, load_trajectories, render_prompts

    directory = Path(args.traces) if args.traces else DEFAULT_TRACES_DIR
    if directory is None or not directory.exists():
        return None
    trajectories = load_trajectories(directory)[:args.trace_count]
    ours, peers, totals = [], {n: [] for n in list(engines.full) + (["toktier"] if engines.toktier else [])}, {}
    exact_checked = exact_ok = 0
    n_calls = 0
    ctx_chars = []
    for i, traj in enumerate(trajectories):
        prompts = render_prompts(traj)
        session = tok.session(encode_path=args.session_path)
        with_peers = i < args.trace_peer_count
        tt_cm = engines.toktier.session() if (with_peers and engines.toktier) else None
        tt = tt_cm.__enter__() if tt_cm else None
        for k, prompt in enumerate(prompts):
            n_calls += 1
            t0 = time.perf_counter()
            session.sync(prompt)
            np.asarray(session.ids)
            dt = time.perf_counter() - t0
            if k == 0:
                continue   # a session's first call is a full encode for every engine
            ours.append(dt)
            ctx_chars.append(len(prompt))
            if with_peers:
                for name, fn in engines.full.items():
                    if name == "reference" and k % args.trace_ref_every:
                        continue
                    t0 = time.perf_counter()
                    fn(prompt)
                    peers[name].append(time.perf_counter() - t0)
                if tt is not None:
                    if prompt.startswith(tt.text):
                        t0 = time.perf_counter()
                        tt.append_patch(prompt[len(tt.text):])
                        peers["toktier"].append(time.perf_counter() - t0)
                    else:   # not an append (history rewritten): toktier re-encodes by its own rule
                        tt_cm.__exit__(None, None, None)
                        tt_cm = engines.toktier.session()
                        tt = tt_cm.__enter__()
                        tt.append(prompt)
        if tt_cm:
            tt_cm.__exit__(None, None, None)
        if i % args.trace_exact_every == 0 and prompts:
            exact_checked += 1
            exact_ok += bool(np.array_equal(np.asarray(session.ids, dtype=np.int64),
                                            tok.encode(prompts[-1], path="reference").astype(np.int64)))
        add_stats(totals, session.stats.to_dict())
    out = {"trajectories": len(trajectories), "calls": n_calls, "continuations": len(ours),
           "context_chars_p50": pct(ctx_chars, 50), "context_chars_max": max(ctx_chars) if ctx_chars else None,
           "final_prompt_exact": f"{exact_ok}/{exact_checked}", "session_stats": totals,
           "latency_ms": {"tokenplane": {"p50": pct(ours, 50) * 1e3, "p90": pct(ours, 90) * 1e3, "n": len(ours)}}}
    for name, v in peers.items():
        if v:
            out["latency_ms"][name] = {"p50": pct(v, 50) * 1e3, "p90": pct(v, 90) * 1e3, "n": len(v),
                                       "on_first_trajectories": args.trace_peer_count}
    print(json.dumps({"traces": out["latency_ms"], "stats": totals}), flush=True)
    return out


def acceptance(stats: dict) -> float | None:
    first = stats.get("first_window_accepts")
    total = stats.get("repairs")
    return first / total if (first is not None and total) else None


def markdown(full: dict) -> str:
    meta = full["meta"]
    head = [f"# Session repair latency ({', '.join(full['families'])})\n",
            f"Machine: {meta['machine']}, {meta['cpus']} CPUs, load average {meta['loadavg']} at start, "
            f"{meta['loadavg_end']} at end; wall {meta['wall_s']} s. Command: `{meta['command']}`.\n"]
    return "\n".join(head) + "\n" + "\n".join(markdown_family(fam, res) for fam, res in full["families"].items())


def markdown_family(family: str, res: dict) -> str:
    lines = [f"## {family}\n"]
    if "meta" in res:
        m = res["meta"]
        lines.append(f"Measured by an earlier run: `{m['command']}` ({m['started']}, load average {m['loadavg']} at "
                     f"start, {m.get('loadavg_end', '?')} at end, wall {m.get('wall_s', '?')} s).\n")
    lines += [
             "Latency per append step in ms, P50 / P90. tokenplane = Session.append + full IDs as an array "
             f"(repair windows encoded with the `{res.get('session_path', 'reference')}` path); "
             "reference/fastokens/gigatoken = full re-encode of the whole text (fastokens/gigatoken prewarmed on the "
             "context); toktier = toktier 0.3.0 Python Session.append_patch. `n` = timed steps (slow full "
             "re-encoders are subsampled). Ratio = peer P50 / tokenplane P50.\n"]
    engines = ["tokenplane", "reference", "fastokens", "gigatoken", "toktier"]
    lines.append("| size | shape | append P50 chars | " + " | ".join(engines) + " | ratios (P50) | exact | "
                 "first-window | fallbacks | B/token |")
    lines.append("|---|---|---:|" + "---:|" * len(engines) + "---|---|---:|---:|---:|")
    for r in res["synthetic"]:
        lat = r["latency_ms"]
        cells = [f"{lat[e]['p50']:.3f} / {lat[e]['p90']:.3f} (n={lat[e]['n']})" if e in lat and lat[e]["n"] else "-"
                 for e in engines]
        ours = lat["tokenplane"]["p50"]
        ratios = ", ".join(f"{e} {lat[e]['p50'] / ours:.1f}x" for e in engines[1:] if e in lat and lat[e]["n"])
        exact = ", ".join(f"{k}{'' if v else ' ✗'}" for k, v in r["exact"].items())
        acc = acceptance(r["session_stats"])
        lines.append(f"| {r['size']} | {r['shape']} | {r['append_chars_p50']:.0f} | " + " | ".join(cells)
                     + f" | {ratios} | {exact} | {'-' if acc is None else f'{acc:.4%}'} | "
                     f"{r['session_stats'].get('full_fallbacks', '-')} | {r['bytes_per_token']:.1f} |")
    t = res.get("traces")
    if t:
        lines.append(f"\n### Real mini-swe-agent traces ({family})\n\n{t['trajectories']} trajectories, {t['calls']} calls, "
                     f"{t['continuations']} continuations; context P50 {t['context_chars_p50']:,.0f} chars, max "
                     f"{t['context_chars_max']:,} chars; final prompt exact vs reference {t['final_prompt_exact']}.\n")
        lines.append("| engine | P50 ms | P90 ms | n |")
        lines.append("|---|---:|---:|---:|")
        for e, v in t["latency_ms"].items():
            lines.append(f"| {e} | {v['p50']:.3f} | {v['p90']:.3f} | {v['n']} |")
        acc = acceptance(t["session_stats"])
        lines.append(f"\nSession stats summed over trajectories: `{json.dumps(t['session_stats'])}`; first-window "
                     f"acceptance {'-' if acc is None else f'{acc:.4%}'}.")
    lines.append(f"\n### Targets ({family}; reported, not asserted)\n")
    lines += [f"- {k}: {v}" for k, v in res["targets"].items()]
    return "\n".join(lines) + "\n"


def targets(res: dict) -> dict:
    flat = {r["size"]: r for r in res["synthetic"] if r["shape"] == "flat1400"}
    out = {}
    if flat:
        p50 = {k: r["latency_ms"]["tokenplane"]["p50"] for k, r in flat.items()}
        out["P50 <= 1 ms at every size (1.4K appends)"] = (
            f"{'met' if all(v <= 1.0 for v in p50.values()) else 'NOT met'}: "
            + ", ".join(f"{k} {v:.3f} ms" for k, v in p50.items()))
        if "4M" in p50 and "100K" in p50:
            ratio = p50["4M"] / p50["100K"]
            out["P50(4M) / P50(100K) <= 1.5"] = f"{'met' if ratio <= 1.5 else 'NOT met'}: {ratio:.2f}"
        if "1M" in flat and "toktier" in flat["1M"]["latency_ms"]:
            r = flat["1M"]["latency_ms"]["toktier"]["p50"] / p50["1M"]
            out[">= 8x faster than toktier Python session at 1M"] = f"{'met' if r >= 8 else 'NOT met'}: {r:.1f}x"
    t = res.get("traces")
    if t:
        acc = acceptance(t["session_stats"])
        out[">= 99.99% first-window acceptance on real traces"] = (
            "unknown (session stats carry no first-window count)" if acc is None
            else f"{'met' if acc >= 0.9999 else 'NOT met'}: {acc:.4%}")
    return out


def plot(full: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fams = list(full["families"])
    shapes = sorted({r["shape"] for res in full["families"].values() for r in res["synthetic"]})
    fig, axes = plt.subplots(len(fams), len(shapes), figsize=(6 * len(shapes), 4 * len(fams)), squeeze=False)
    for i, fam in enumerate(fams):
        for ax, shape in zip(axes[i], shapes):
            rows = [r for r in full["families"][fam]["synthetic"] if r["shape"] == shape]
            for eng in ["tokenplane", "reference", "fastokens", "gigatoken", "toktier"]:
                pts = [(SIZES[r["size"]], r["latency_ms"][eng]["p50"], r["latency_ms"][eng]["p90"]) for r in rows
                       if eng in r["latency_ms"] and r["latency_ms"][eng]["n"]]
                if pts:
                    pts.sort()
                    line, = ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{eng} P50")
                    ax.plot([p[0] for p in pts], [p[2] for p in pts], ls=":", color=line.get_color())
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_xlabel("context characters")
            ax.set_ylabel("ms per append (solid P50, dotted P90)")
            ax.set_title(f"{fam}: {shape} appends")
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--family", default="qwen3", help="comma list; toktier runs for qwen3 / deepseek_v4")
    p.add_argument("--trace-families", default=None, help="families that replay the real traces (default: first)")
    p.add_argument("--corpus", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "tokenplane_corpus"))
    p.add_argument("--sizes", default="100K,1M,4M")
    p.add_argument("--shapes", default="flat1400,claude-code")
    p.add_argument("--steps", type=int, default=30, help="append steps per size and shape")
    p.add_argument("--append-cap", type=int, default=100_000, help="cap on a drawn append, characters")
    p.add_argument("--ref-steps", default="100K:10,1M:3,4M:2", help="timed steps of the reference re-encode")
    p.add_argument("--engines", default="fastokens,gigatoken,toktier")
    p.add_argument("--session-path", default="cpu", choices=["cpu", "reference"],
                   help="engine the session encodes its repair windows with (cpu = tokenplane's exact fast path)")
    p.add_argument("--traces", default=None, help="mini-swe-agent directory (default: "
                   "$TOKENPLANE_DATA/traces/mini-swe-agent)")
    p.add_argument("--trace-count", type=int, default=250)
    p.add_argument("--trace-peer-count", type=int, default=20, help="trajectories also re-encoded by peers")
    p.add_argument("--trace-ref-every", type=int, default=8, help="time the reference on every k-th call")
    p.add_argument("--trace-exact-every", type=int, default=5, help="check the final prompt of every k-th "
                                                                     "trajectory against the reference")
    p.add_argument("--no-traces", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--merge-from", default=None, help="earlier session_repair.json whose other families to keep")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = p.parse_args()
    args.ref_steps = {k: int(v) for k, v in (x.split(":") for x in args.ref_steps.split(","))}
    import tokenplane

    t_start = time.time()
    meta = {"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
            "loadavg": " ".join(f"{x:.2f}" for x in os.getloadavg()), "command": " ".join(sys.argv),
            "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    pool = corpus_pool(ensure_corpus(Path(args.corpus)))
    full: dict = {"meta": meta, "families": {}}
    trace_families = set(args.trace_families.split(",")) if args.trace_families else {args.family.split(",")[0]}
    for family in args.family.split(","):
        tok = tokenplane.load(family)
        if args.session_path == "cpu":
            tok.encode("build the tables 123", path="cpu")   # one-time table build, not part of any timing
        engines = Engines(family, tok, set(args.engines.split(",")) - {""})
        rng = random.Random(args.seed)
        res: dict = {"synthetic": [], "session_path": args.session_path}
        for size_name in args.sizes.split(","):
            for shape in args.shapes.split(","):
                res["synthetic"].append(run_synthetic(args, tok, engines, pool, size_name, shape, rng))
        if not args.no_traces and family in trace_families:
            res["traces"] = run_traces(args, tok, engines)
        res["targets"] = targets(res)
        full["families"][family] = res
    meta["wall_s"] = round(time.time() - t_start, 1)
    meta["loadavg_end"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    if args.merge_from:
        # Keep families measured by an earlier run (its own meta travels with them).
        old = json.loads(Path(args.merge_from).read_text())
        if "families" not in old:   # single-family layout of the first version of this script
            old = {"meta": old["meta"], "families": {old["meta"]["family"]: {
                k: old[k] for k in ("synthetic", "traces", "targets") if k in old}}}
        for fam, res in old["families"].items():
            if fam not in full["families"]:
                res["meta"] = old["meta"]
                full["families"] = {fam: res, **full["families"]}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "session_repair.json").write_text(json.dumps(full, indent=1, default=str))
    (out / "session_repair.md").write_text(markdown(full))
    plot(full, out / "session_repair.png")
    print(markdown(full))
    return 0


if __name__ == "__main__":
    sys.exit(main())
