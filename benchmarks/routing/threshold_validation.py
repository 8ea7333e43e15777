"""Validate the throughput model's threshold choice against measured throughput over a threshold sweep.

For each latency setting (the seed's R2R GPU figures; our measured CPU step latencies) and concurrency 4, 8, 16,
with R2R synthetic routing (switch probability 0.35 per small-model step, large model regenerates the dropped token
and hands back after one token):

  1. the Markov chain predicts committed tokens/s for every feasible (T_small, T_large) with T <= max_t and
     choose_thresholds picks the argmax;
  2. "des": the discrete-event simulator (continuous latencies, long horizon) measures the full sweep;
  3. "runtime": the real multi-process runtime (tokenplane.route.runtime, one process per model, ZeroMQ handoffs)
     with the latency-model backend, closed-loop clients, measures T_small = 1 x T_large in a grid (+ the choice);
  4. reported: measured throughput of the chosen thresholds / best measured throughput (target >= 95%).

    python benchmarks/routing/threshold_validation.py [--backend des runtime] [--settings seed-r2r cpu-measured]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import RESULTS, chain_latency_fns, closed_loop, latency_setting, md_table, write_outputs  # noqa: E402

from tokenplane.route.batching import feasible_thresholds  # noqa: E402
from tokenplane.route.throughput_model import RoutingModel, simulate, solve_chain  # noqa: E402

P_SWITCH = 0.35
REL_TOL = 0.01   # choose_thresholds' default tie tolerance


def runtime_measure(fits, ts, concurrency: int, duration_s: float, max_tokens: int, prompt_len: int) -> dict:
    from tokenplane.route.runtime import Runtime, RuntimeConfig
    cfg = RuntimeConfig(models=[{"latency": f.to_dict()} for f in fits], algorithm="r2r",
                        algorithm_kwargs={"mode": "synthetic", "rates": {"switch": P_SWITCH}, "seed": 0},
                        runner="latency-model", mode="delayed_async", pending_return=True, thresholds=list(ts),
                        concurrency=concurrency, num_blocks=2048)
    with Runtime(cfg) as rt:
        res = closed_loop(rt, concurrency, duration_s=duration_s, warmup_s=0.5, max_tokens=max_tokens,
                          prompt_len=prompt_len)
        try:
            res["model_stats"] = rt.stats()
        except Exception as exc:  # stats are diagnostics; a slow reply must not lose the measurement
            res["model_stats"] = f"unavailable: {exc}"
    return res


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", nargs="+", default=["des", "runtime"], choices=["des", "runtime"])
    ap.add_argument("--settings", nargs="+", default=["seed-r2r", "cpu-measured"])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[4, 8, 16])
    ap.add_argument("--max-t", type=int, default=8)
    ap.add_argument("--runtime-large", type=int, nargs="+", default=[1, 2, 4, 6, 8],
                    help="T_large values measured on the runtime (T_small = 1), plus the model's choice")
    ap.add_argument("--duration", type=float, default=3.0, help="runtime window per config, seconds (seed scale)")
    ap.add_argument("--cpu-duration", type=float, default=8.0, help="runtime window per config at CPU latencies")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--des-steps", type=int, default=60_000)
    ap.add_argument("--out", default="threshold_validation")
    args = ap.parse_args(argv)

    context = args.prompt_len + args.max_tokens / 2  # mean context of a request in the closed loop
    rm = RoutingModel.r2r(P_SWITCH)
    result = {"p_switch": P_SWITCH, "context": context, "settings": {}}
    for setting in args.settings:
        fits, provenance = latency_setting(setting)
        fns = chain_latency_fns(fits, rm, context)
        sres = {"provenance": provenance, "fits": [f.to_dict() for f in fits], "by_concurrency": {}}
        for C in args.concurrency:
            t = time.time()
            combos = feasible_thresholds(2, C, args.max_t)
            chain = {ts: solve_chain(ts, C, rm, fns) for ts in combos}
            best_pred = max(chain.values(), key=lambda r: r.throughput).throughput
            chosen = min((ts for ts, r in chain.items() if r.throughput >= best_pred * (1 - REL_TOL)),
                         key=lambda ts: (sum(ts), ts))   # the choose_thresholds rule
            entry = {"chosen": list(chosen), "chain_s": time.time() - t,
                     "chain": {f"{a},{b}": r.to_dict() for (a, b), r in chain.items()}}
            print(f"[{setting} C={C}] chain over {len(combos)} combos in {entry['chain_s']:.1f} s: "
                  f"choice {chosen} predicts {chain[chosen].throughput:.1f} tok/s", flush=True)
            for backend in args.backend:
                if backend == "des":
                    measured = {ts: simulate(ts, C, rm, fns, horizon_steps=args.des_steps, seed=7).throughput
                                for ts in combos}
                else:
                    dur = args.duration if setting == "seed-r2r" else args.cpu_duration
                    grid = [(1, b) for b in args.runtime_large if (1, b) in chain and b <= C]
                    if chosen not in grid:
                        grid.append(chosen)
                    measured, raw = {}, {}
                    for ts in grid:
                        r = runtime_measure(fits, ts, C, dur, args.max_tokens, args.prompt_len)
                        measured[ts], raw[f"{ts[0]},{ts[1]}"] = r["throughput"], r
                        print(f"   runtime {ts}: {r['throughput']:.1f} tok/s (chain {chain[ts].throughput:.1f})",
                              flush=True)
                    entry["runtime_raw"] = raw
                best_ts = max(measured, key=measured.get)
                ratio = measured[chosen] / measured[best_ts]
                entry[backend] = {"measured": {f"{a},{b}": v for (a, b), v in measured.items()},
                                  "best": list(best_ts), "best_throughput": measured[best_ts],
                                  "chosen_throughput": measured[chosen], "ratio": ratio,
                                  "all_ones": measured.get((1, 1))}
                print(f"   {backend}: best {best_ts} {measured[best_ts]:.1f}, chosen {chosen} "
                      f"{measured[chosen]:.1f} -> {ratio:.1%}", flush=True)
            sres["by_concurrency"][C] = entry
        result["settings"][setting] = sres
    result["prompt_len"], result["max_tokens"] = args.prompt_len, args.max_tokens
    write_outputs(args.out, result, render(result))
    plot(result, RESULTS / f"{args.out}.png")
    return result


def _key(ts) -> str:
    return f"{ts[0]},{ts[1]}"


def _runtime_diag(raw: dict) -> str:
    """Mean batch per model and forced (below-threshold) launches, from the sub-servers' counters."""
    ms = raw.get("model_stats")
    if not isinstance(ms, list):
        return ""
    parts = []
    for m in ms:
        c = m.get("counters", {})
        pol = c.get("policy") or {}
        steps = c.get("steps") or 0
        forced = (pol.get("forced_launches") or [0] * 2)[m.get("model", 0)] if pol else 0
        parts.append(f"m{m.get('model')}: batch {c.get('batched_seqs', 0) / steps:.2f}, forced {forced}/{steps}"
                     if steps else f"m{m.get('model')}: idle")
    return "; ".join(parts)


def render(result: dict) -> str:
    """Markdown from the JSON (re-derives the choice with REL_TOL from the stored chain predictions)."""
    md = ["# Delayed-batching thresholds: throughput model vs measured\n\n",
          f"R2R synthetic routing, p = {result['p_switch']}; closed loop, prompt {result.get('prompt_len', 32)}, "
          f"max_tokens {result.get('max_tokens', 128)}; latency evaluated at mean context {result['context']:.0f}. "
          "Throughput = committed tokens/s. The model's choice = smallest thresholds predicted within "
          f"{REL_TOL:.0%} of the chain's best. `des` = discrete-event simulation of the same assumptions (a "
          "consistency check, not an independent measurement); `runtime` = the real multi-process runtime with the "
          "latency-model backend (measured on a shared 2-core machine under other jobs' load).\n"]
    for setting, sres in result["settings"].items():
        md.append(f"\n## {setting}\n\n{sres['provenance']}.\n\n")
        rows, diag = [], []
        for C, e in sres["by_concurrency"].items():
            chain = {tuple(map(int, k.split(","))): v["throughput"] for k, v in e["chain"].items()}
            best_pred = max(chain.values())
            chosen = min((ts for ts, v in chain.items() if v >= best_pred * (1 - REL_TOL)),
                         key=lambda ts: (sum(ts), ts))
            e["chosen"] = list(chosen)
            for backend in ("des", "runtime"):
                b = e.get(backend)
                if not b:
                    continue
                meas = {tuple(map(int, k.split(","))): v for k, v in b["measured"].items()}
                best_ts = max(meas, key=meas.get)
                got = meas.get(chosen)
                ratio = None if got is None else got / meas[best_ts]
                b.update(chosen=list(chosen), chosen_throughput=got, ratio=ratio, best=list(best_ts),
                         best_throughput=meas[best_ts])
                rows.append([C, backend, str(chosen), chain[chosen], "not measured" if got is None else got,
                             str(best_ts), meas[best_ts], "n/a" if ratio is None else f"{ratio:.1%}",
                             meas.get((1, 1), float("nan")), len(meas)])
            if "runtime_raw" in e:
                for k, raw in e["runtime_raw"].items():
                    diag.append([C, f"({k})", raw["throughput"], chain[tuple(map(int, k.split(",")))],
                                 _runtime_diag(raw)])
        md.append(md_table(["C", "measured on", "model's choice (T_s, T_l)", "predicted tok/s",
                            "measured tok/s (choice)", "best measured (T_s, T_l)", "best tok/s", "choice / best",
                            "(1,1) tok/s", "configs"], rows))
        if diag:
            md.append("\nRuntime runs (mean batch per model; launches forced below threshold / steps):\n\n")
            md.append(md_table(["C", "thresholds", "measured tok/s", "predicted tok/s", "runtime counters"], diag))
    return "".join(md)


def reanalyze(path: Path) -> dict:
    import json
    result = json.loads(path.read_text())
    write_outputs(path.stem, result, render(result))
    plot(result, path.with_suffix(".png"))
    return result


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    settings = list(result["settings"])
    concs = sorted({int(c) for s in settings for c in result["settings"][s]["by_concurrency"]})
    fig, axes = plt.subplots(len(settings), len(concs), figsize=(4.2 * len(concs), 3.4 * len(settings)),
                             squeeze=False)
    for i, s in enumerate(settings):
        for j, C in enumerate(concs):
            ax = axes[i][j]
            e = result["settings"][s]["by_concurrency"].get(C) or result["settings"][s]["by_concurrency"].get(str(C))
            if e is None:
                continue
            chain = {tuple(map(int, k.split(","))): v["throughput"] for k, v in e["chain"].items()}
            xs = sorted(b for a, b in chain if a == 1)
            ax.plot(xs, [chain[(1, b)] for b in xs], "o-", label="chain (predicted)")
            for backend, style in (("des", "s--"), ("runtime", "^-")):
                if backend in e:
                    m = {tuple(map(int, k.split(","))): v for k, v in e[backend]["measured"].items()}
                    bx = sorted(b for a, b in m if a == 1)
                    ax.plot(bx, [m[(1, b)] for b in bx], style, label=f"measured ({backend})")
            ch = e["chosen"]
            ax.axvline(ch[1], color="gray", ls=":", lw=1)
            ax.set_title(f"{s}, C={C}, choice T={tuple(ch)}", fontsize=9)
            ax.set_xlabel("T_large (T_small = 1)")
            ax.set_ylabel("committed tok/s")
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--reanalyze":
        reanalyze(Path(sys.argv[2]))
    else:
        main()
