"""Seed-scale routing results across the mixed-batch penalty instead of at one assumed point.

The seed-scale latency preset (tokenplane.engine.latency_runner.seed_r2r) anchors the cited GPU step levels (6.0 /
27.9 ms) and multiplies a step's base cost by `mixed` whenever some sequence in it computes more than one token.
1.71 is the seed's CUDA-graph ablation (a GPU throughput ratio standing in for a per-step cost ratio); this machine's
engine measures ~1.0 on CPU (cpu_latency.py --mixed). Standard serving pays `mixed` on nearly every re-admission and
the runtime's small-model steps almost never do, so the ratio between them depends on it: this script runs the
serving comparison (serving.py's closed loop, concurrency 4, same flags) at each value, all configurations
interleaved in rounds so load drift hits every value alike.

    python benchmarks/routing/mixed_sensitivity.py [--mixed 1.0 1.2 1.45 1.71] [--repeats 2] [--duration 3]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import serving  # noqa: E402
from common import RESULTS, loadavg, md_table, write_outputs  # noqa: E402

from tokenplane.engine.latency_runner import SEED_R2R_PROVENANCE, seed_r2r  # noqa: E402


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mixed", type=float, nargs="+", default=[1.0, 1.2, 1.45, 1.71])
    ap.add_argument("--algos", nargs="+", default=serving.ALGOS)
    ap.add_argument("--systems", nargs="+", default=["ours", "standard", "standard_segment"])
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--duration", type=float, default=3.0)
    ap.add_argument("--warmup", type=float, default=1.0)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default="mixed_sensitivity")
    args = ap.parse_args(argv)
    cmd = "python benchmarks/routing/mixed_sensitivity.py " + " ".join(argv if argv is not None else sys.argv[1:])
    t0, load0 = time.time(), loadavg()
    configs = []
    kw = dict(max_tokens=args.max_tokens, duration=args.duration, prompt_len=args.prompt_len)
    for mx in args.mixed:
        fits = list(seed_r2r(mx))
        for alg in args.algos:
            for system in args.systems:
                if system == "standard_segment" and alg not in serving.SEGMENT_ALGOS:
                    continue
                if alg == "ensemble" and system.startswith("standard"):
                    continue
                configs.append((f"{mx}/{alg}/{system}",
                                ((alg, system, serving.SYSTEMS[system], args.concurrency, fits, args), kw)))
    runs = serving.repeated(configs, args)
    result = {"command": cmd, "loadavg_before": load0, "loadavg_after": loadavg(), "wall_s": time.time() - t0,
              "concurrency": args.concurrency, "max_tokens": args.max_tokens, "prompt_len": args.prompt_len,
              "duration_s": args.duration, "repeats": args.repeats, "rates": serving.RATES,
              "constants": {str(mx): [f.to_dict() for f in seed_r2r(mx)] for mx in args.mixed},
              "provenance": SEED_R2R_PROVENANCE,
              "runs": {k: {kk: vv for kk, vv in v.items() if kk != "runs"} | {"raw": v["runs"]}
                       for k, v in runs.items()}}
    write_outputs(args.out, result, render(result))
    plot(result, RESULTS / f"{args.out}.png")
    return result


def _ratios(result: dict) -> dict[tuple[str, str], dict[str, float]]:
    """(algorithm, baseline) -> {mixed: ours / baseline throughput (medians)}."""
    out: dict[tuple[str, str], dict[str, float]] = {}
    R = result["runs"]
    for key, r in R.items():
        mx, alg, system = key.split("/")
        if system == "ours":
            continue
        ours = R.get(f"{mx}/{alg}/ours")
        if ours and r["throughput"]:
            out.setdefault((alg, system), {})[mx] = ours["throughput"] / r["throughput"]
    return out


def render(result: dict) -> str:
    mixes = list(result["constants"])
    md = ["# Seed-scale routing across the mixed-batch penalty\n\n",
          f"Command: `{result['command']}`; load average before {result['loadavg_before']}, after "
          f"{result['loadavg_after']}; concurrency {result['concurrency']}, prompt {result['prompt_len']}, "
          f"max_tokens {result['max_tokens']}, {result['duration_s']} s window per run, {result['repeats']} runs per "
          "configuration (median; all configurations interleaved in rounds). Latency-model backend at the seed's "
          "scale; `ours` = delayed_async + pending return + the chain's thresholds, `standard` = per-token stock "
          "composition, `standard_segment` = per-segment stock composition (stream one model, abort at the switch; "
          "R-Stitch only, whose router reads logprobs).\n\n",
          *([f"Note: {result['note']}\n\n"] if result.get("note") else []),
          "## ours / baseline throughput by mixed\n\n"]
    rows = [[alg, system] + [f"{v[m]:.2f}x" if m in v else "" for m in mixes]
            for (alg, system), v in sorted(_ratios(result).items())]
    md.append(md_table(["algorithm", "baseline"] + [f"mixed {m}" for m in mixes], rows))
    md.append("\n## Throughput (committed tok/s: median, P90, n, load average at start)\n\n")
    rows = []
    for key, r in result["runs"].items():
        mx, alg, system = key.split("/")
        s = r["summary"]["throughput"]
        rows.append([mx, alg, system, s["median"], s["p90"], s["n"], r["summary"]["load1"]["median"],
                     str(r.get("thresholds") or "")])
    md.append(md_table(["mixed", "algorithm", "system", "tok/s median", "tok/s P90", "n", "load1", "thresholds"],
                       rows))
    md.append("\n## Constants used (LatencyFit per model: small, large)\n\n")
    rows = [[m, f["name"], f"{f['a'] * 1e3:.3f}", f"{f['b'] * 1e3:.3f}", f"{f['c']:.2e}", f"{f['d']:.1e}",
             f["mixed"]] for m, fs in result["constants"].items() for f in fs]
    md.append(md_table(["mixed", "model", "a ms", "b ms/seq", "c s/(seq*tok)", "d s/tok", "mixed"], rows))
    md.append("\nProvenance of each constant:\n\n")
    md.append(md_table(["constant", "source"], [[k, v] for k, v in result["provenance"].items()]))
    return "".join(md)


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for (alg, system), v in sorted(_ratios(result).items()):
        xs = sorted(v, key=float)
        ax.plot([float(x) for x in xs], [v[x] for x in xs], "o-" if system == "standard" else "s--",
                label=f"{alg} vs {system}")
    ax.axhline(2.0, color="gray", ls=":", lw=1)
    ax.axhline(1.0, color="gray", lw=1)
    ax.set_xlabel("mixed-batch penalty of the latency model (seed scale)")
    ax.set_ylabel("ours / baseline throughput")
    ax.set_title(f"concurrency {result['concurrency']}", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def rerender(path: Path, note: str | None = None) -> None:
    """Markdown and PNG again from the stored JSON (optionally adding a note on the run's conditions)."""
    import json
    result = json.loads(path.read_text())
    if note:
        result["note"] = note
    write_outputs(path.stem, result, render(result))
    plot(result, path.with_suffix(".png"))


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "--rerender":
        rerender(Path(sys.argv[2]), " ".join(sys.argv[3:]) or None)
    else:
        main()
