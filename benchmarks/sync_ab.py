"""Real-trace `Session.sync` of two git revisions, side by side in alternating processes (before/after a change).

On a shared host two runs minutes apart differ by more than a per-call change of tens of microseconds; alternating
short processes puts both revisions under the same drift. Each process loads one revision (exported with
`git archive` into a temporary folder and put first on PYTHONPATH), replays the real mini-swe-agent trajectories
through `Session.sync` exactly as benchmarks/session_repair.py does (session_costs.trace_sync of the revision
itself: every call's whole prompt, the installed peers' full re-encodes of the same prompt interleaved in rotating
order, then the same replay alone), and prints every call's time. The parent pools the calls of all rounds per
(revision, family) and reports P50 / P90 / P99 of sync, of its per-call fixed cost (all but the window encoder),
and of each peer, with the after / before ratio of the medians. Every trajectory's final IDs are checked against
the reference in every process. Processes run under the caller's `flock /tmp/bench.lock`.

    flock /tmp/bench.lock python benchmarks/sync_ab.py --revs fa2af3a HEAD --family all --rounds 2
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
ALL_FAMILIES = "cl100k_base,o200k_base,llama3,qwen3,deepseek_v4,smollm2"

_CHILD = r"""
import json, sys
root, family, traces, count, engines = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]
sys.path.insert(0, root + "/benchmarks")
import tokenplane
assert tokenplane.__file__.startswith(root), tokenplane.__file__
from pathlib import Path
from tokenplane.tokenize.cpu import kernels
import session_costs
from session_repair import Engines
tok = tokenplane.load(family)
tok.encode("build the tables 123", path="cpu")
warm = tok.session(encode_path="cpu")
warm.sync("warm up the kernels, 123. " * 200)
warm.sync("warm up the kernels, 123. " * 201)
times = {}
orig_ms = session_costs.ms
session_costs.ms = lambda values: {"raw": [float(v) for v in values], **orig_ms(values)}
eng = Engines(family, tok, set(engines.split(",")) - {""})
peers = {k: v for k, v in eng.full.items() if k != "reference"}
mixed = session_costs.trace_sync(tok, Path(traces), count, "cpu", 0, peers)
alone = session_costs.trace_sync(tok, Path(traces), count, "cpu", 0)
out = {"kernels": kernels.get().kind, "exact": mixed["exact"], "exact_alone": alone["exact"],
       "peers_exact": mixed["peers_exact"], "peers_missing": eng.missing,
       "sync": mixed["sync_ms"]["raw"], "fixed": mixed["fixed_ms"]["raw"],
       "sync_alone": alone["sync_ms"]["raw"], "fixed_alone": alone["fixed_ms"]["raw"],
       "peers": {k: v["raw"] for k, v in mixed["peers_ms"].items()},
       "stats": {k: v for k, v in mixed["session_stats"].items() if k in ("first_window_accepts", "repairs",
                                                                          "full_fallbacks")}}
print("@@RESULT " + json.dumps(out))
"""


def export(rev: str, dest: Path) -> Path:
    """The tree of `rev` (a commit, or "WORKTREE" for the files as they are now) in dest."""
    dest.mkdir(parents=True)
    if rev == "WORKTREE":
        files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, check=True,
                               capture_output=True, text=True).stdout.split("\n")
        for f in filter(None, files):
            src = ROOT / f
            if src.is_file():
                (dest / f).parent.mkdir(parents=True, exist_ok=True)
                (dest / f).write_bytes(src.read_bytes())
        return dest
    archive = subprocess.run(["git", "archive", rev], cwd=ROOT, check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    return dest


def child(tree: Path, family: str, args: argparse.Namespace) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree), TOKENPLANE_AOT_BUILD="0")
    res = subprocess.run([sys.executable, "-c", _CHILD, str(tree), family, args.traces, str(args.trace_count),
                          args.engines], env=env, cwd=tree, capture_output=True, text=True, timeout=1800)
    for line in res.stdout.splitlines():
        if line.startswith("@@RESULT "):
            return json.loads(line[len("@@RESULT "):])
    raise RuntimeError(f"child failed ({tree}, {family}): {res.stderr[-2000:]}")


def stats(values: list[float]) -> dict:
    a = np.asarray(values, dtype=float) * 1e3
    return {"p50": float(np.percentile(a, 50)), "p90": float(np.percentile(a, 90)),
            "p99": float(np.percentile(a, 99)), "n": int(a.size)} if a.size else {"n": 0}


def summarize(pooled: dict) -> dict:
    out: dict = {}
    for fam, by_rev in pooled.items():
        out[fam] = {}
        for rev, runs in by_rev.items():
            cell: dict = {k: stats([v for r in runs for v in r[k]])
                          for k in ("sync", "fixed", "sync_alone", "fixed_alone")}
            cell["peers"] = {p: stats([v for r in runs for v in r["peers"].get(p, [])])
                             for p in runs[0]["peers"]}
            cell["exact"] = [r["exact"] for r in runs] + [r["exact_alone"] for r in runs]
            cell["peers_exact"] = [r["peers_exact"] for r in runs]
            cell["kernels"] = sorted({r["kernels"] for r in runs})
            cell["stats"] = runs[-1]["stats"]
            cell["peers_missing"] = runs[0]["peers_missing"]
            out[fam][rev] = cell
    return out


def markdown(full: dict) -> str:
    m = full["meta"]
    a, b = m["revs"]
    lines = [f"# Real-trace Session.sync: {a} (before) vs {b} (after), alternating processes", "",
             f"Machine: {m['machine']}, {m['cpus']} CPUs, load average {m['loadavg']} at start, {m['loadavg_end']} at "
             f"end; wall {m['wall_s']} s. Command: `{m['command']}`. {m['rounds']} rounds, order alternating per "
             f"round; each process replays {m['trace_count']} mini-swe-agent trajectories (session_costs.trace_sync:"
             " peers interleaved, then alone); P50 / P90 / P99 in ms over the pooled calls of all rounds.", ""]
    lines += ["| family | what | before | after | after / before (P50) |", "|---|---|---:|---:|---:|"]
    for fam, cells in full["families"].items():
        x, y = cells[a], cells[b]
        rows = [("sync + IDs (peers interleaved)", "sync"), ("per-call fixed cost (interleaved)", "fixed"),
                ("sync + IDs, alone", "sync_alone"), ("per-call fixed cost, alone", "fixed_alone")]
        for label, key in rows:
            lines.append(f"| {fam} | {label} | {_cell(x[key])} | {_cell(y[key])} | "
                         f"{y[key]['p50'] / x[key]['p50']:.2f} |")
        for p in y["peers"]:
            lines.append(f"| {fam} | {p} full re-encode (same run) | {_cell(x['peers'][p])} | "
                         f"{_cell(y['peers'][p])} | |")
        peer_p50 = {p: v["p50"] for p, v in y["peers"].items() if v.get("n")}
        verdict = ", ".join(f"{'below' if y['sync']['p50'] < v else 'NOT below'} {p} ({v:.3f})"
                            for p, v in peer_p50.items())
        lines.append(f"| {fam} | after: sync P50 <= 0.15 ms: {'met' if y['sync']['p50'] <= 0.15 else 'NOT met'}"
                     f"{'; ' + verdict if verdict else ''}; exact {', '.join(x['exact'] + y['exact'])} | | | |")
    return "\n".join(lines) + "\n"


def _cell(v: dict) -> str:
    return f"{v['p50']:.3f} / {v['p90']:.3f} / {v['p99']:.3f}" if v.get("n") else "-"


def plot(full: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    a, b = full["meta"]["revs"]
    fams = list(full["families"])
    x = np.arange(len(fams))
    fig, ax = plt.subplots(figsize=(9, 4))
    for i, (rev, key, label) in enumerate([(a, "sync", "before"), (b, "sync", "after"),
                                           (a, "sync_alone", "before, alone"), (b, "sync_alone", "after, alone")]):
        ax.bar(x + (i - 1.5) * 0.2, [full["families"][f][rev][key]["p50"] for f in fams], 0.2, label=label)
    ax.axhline(0.15, color="k", lw=0.8, ls="--", label="target 0.15 ms")
    ax.set_xticks(x, fams, rotation=20)
    ax.set_ylabel("sync P50, ms")
    ax.set_title("Real-trace Session.sync, before vs after")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--revs", nargs=2, required=True, metavar=("BEFORE", "AFTER"),
                   help="git revisions (WORKTREE: the files as they are now)")
    p.add_argument("--family", default="all")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--trace-count", type=int, default=100)
    p.add_argument("--traces", default=str(ROOT.parent / "shared" / "data" / "traces" / "mini-swe-agent"))
    p.add_argument("--engines", default="gigatoken", help="peers interleaved with the sync (session_repair.Engines)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    p.add_argument("--name", default="sync_ab")
    args = p.parse_args()
    families = (ALL_FAMILIES if args.family == "all" else args.family).split(",")
    t0 = time.time()
    meta = {"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
            "loadavg": " ".join(f"{x:.2f}" for x in os.getloadavg()), "command": " ".join(sys.argv),
            "revs": args.revs, "rounds": args.rounds, "trace_count": args.trace_count,
            "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    pooled: dict = {f: {r: [] for r in args.revs} for f in families}
    with tempfile.TemporaryDirectory(prefix="sync_ab_") as tmp:
        trees = {rev: export(rev, Path(tmp) / f"t{i}") for i, rev in enumerate(args.revs)}
        for rnd in range(args.rounds):
            for k, fam in enumerate(families):
                order = args.revs if (rnd + k) % 2 == 0 else args.revs[::-1]
                for rev in order:
                    r = child(trees[rev], fam, args)
                    if not r["sync"]:
                        raise RuntimeError(f"no calls replayed ({rev}, {fam}): is {args.traces} there?")
                    pooled[fam][rev].append(r)
                    print(json.dumps({"round": rnd, "family": fam, "rev": rev, "kernels": r["kernels"],
                                      "sync_p50": stats(r["sync"])["p50"], "exact": r["exact"]}), flush=True)
    meta["wall_s"] = round(time.time() - t0, 1)
    meta["loadavg_end"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    full = {"meta": meta, "families": summarize(pooled)}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.json").write_text(json.dumps(full, indent=1))
    (out / f"{args.name}.md").write_text(markdown(full))
    plot(full, out / f"{args.name}.png")
    print(markdown(full))
    return 0


if __name__ == "__main__":
    sys.exit(main())
