"""Where delayed batching pays: the throughput model's map of its predicted gain, and runtime checks of the best cells.

Map: two models, R2R routing (small -> large with probability p per small step, the switching token dropped, one
large-model token, then back). Step latency L_m(b) = s_m * (1 - beta + beta * b): s_small = 6 ms, s_large = rho *
s_small, beta = the marginal cost of one more sequence relative to a batch-1 step (0: perfectly flat, memory-bound
decode; 1: linear), and a step where some sequence computes extra tokens costs `mixed` x (the catch-up mixture of
common.chain_latency_fns). For each (rho, beta, mixed, p, concurrency C) the chain (throughput_model.solve_chain)
predicts committed tokens/s at thresholds (1, 1) and at the best feasible (T_small, T_large), T_small in {1, 2},
T_large <= min(C, 8); the gain = best / (1, 1) - 1. The gain is scale-free (a uniform time scale divides every
throughput alike), so the map holds at GPU and CPU step levels alike.

Validation (--validate K): the K cells with the largest predicted gain (mixed 1.0, the figure this machine's engine
measures) run on the multi-process runtime with the latency-model backend, scaled so a small step lasts
--small-ms (large steps make the runtime's ~1 ms per-step cost a small share), at (1, 1) and at the chain's choice,
closed loop, --repeats runs each (median): measured vs predicted throughput and gain, plus the chain's prediction with
the runtime's measured per-step busy time folded into L_m (common.runtime_overhead_s).

    python benchmarks/routing/regime_map.py [--validate 3] [--repeats 3]
"""
from __future__ import annotations

import argparse
import itertools
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    RESULTS,
    chain_latency_fns,
    closed_loop,
    loadavg,
    md_table,
    runtime_overhead_s,
    summarize,
    write_outputs,
)

from tokenplane.engine.latency_runner import LatencyFit  # noqa: E402
from tokenplane.route.batching import is_feasible  # noqa: E402
from tokenplane.route.throughput_model import RoutingModel, solve_chain  # noqa: E402

SMALL_S = 6e-3
GAIN = 0.10   # the bar: delayed batching "pays" at >= 10% predicted


def fits_for(rho: float, beta: float, mixed: float, small_s: float = SMALL_S) -> list[LatencyFit]:
    return [LatencyFit(s * (1 - beta), s * beta, 0.0, 0.0, name, (), mixed)
            for s, name in ((small_s, "small"), (small_s * rho, "large"))]


def candidates(C: int) -> list[tuple[int, int]]:
    ts_small = (1, 2) if C <= 8 else (1,)
    return [(a, b) for a in ts_small for b in range(1, min(C, 8) + 1) if is_feasible((a, b), C)]


def cell(rho: float, beta: float, mixed: float, p: float, C: int, small_s: float = SMALL_S,
         overhead_s: list[float] | None = None) -> dict:
    rm = RoutingModel.r2r(p)
    fns = chain_latency_fns(fits_for(rho, beta, mixed, small_s), rm, 0.0, overhead_s)
    res = {ts: solve_chain(ts, C, rm, fns) for ts in candidates(C)}
    base = res[(1, 1)].throughput
    best_t = max(res.values(), key=lambda r: r.throughput).throughput
    # the choose_thresholds rule: smallest thresholds within 1% of the best
    choice = min((ts for ts, r in res.items() if r.throughput >= best_t * 0.99), key=lambda ts: (sum(ts), ts))
    return {"rho": rho, "beta": beta, "mixed": mixed, "p": p, "C": C, "all_ones": base,
            "best": list(max(res, key=lambda ts: res[ts].throughput)), "best_throughput": best_t,
            "choice": list(choice), "choice_throughput": res[choice].throughput, "gain": best_t / base - 1,
            "util_all_ones": res[(1, 1)].utilization, "batch_all_ones": res[(1, 1)].mean_batch}


def build_map(args) -> list[dict]:
    out = []
    grid = list(itertools.product(args.rho, args.beta, args.mixed, args.p, args.concurrency))
    t = time.time()
    for i, (rho, beta, mixed, p, C) in enumerate(grid):
        out.append(cell(rho, beta, mixed, p, C))
        if i % 40 == 0:
            print(f"  map {i + 1}/{len(grid)} ({time.time() - t:.0f} s)", flush=True)
    return out


def runtime_run(fits: list[LatencyFit], p: float, ts: tuple[int, int], C: int, args) -> dict:
    from tokenplane.route.runtime import Runtime, RuntimeConfig
    cfg = RuntimeConfig(models=[{"latency": f.to_dict()} for f in fits], algorithm="r2r",
                        algorithm_kwargs={"mode": "synthetic", "rates": {"switch": p}, "seed": 0},
                        runner="latency-model", mode="delayed_async", pending_return=True, thresholds=list(ts),
                        concurrency=C, num_blocks=2048)
    load = loadavg()
    with Runtime(cfg) as rt:
        res = closed_loop(rt, C, duration_s=args.duration, warmup_s=1.0, max_tokens=args.max_tokens,
                          prompt_len=args.prompt_len)
        try:
            stats = rt.stats()
            res["forced_launches"] = [s["counters"].get("policy", {}).get("forced_launches", [0, 0])[s["model"]]
                                      for s in stats]
            res["backstop_launches"] = [int(s["counters"].get("backstop_launches", 0)) for s in stats]
            res["steps"] = [int(s["counters"].get("steps", 0)) for s in stats]
            # forced launches' total lag behind the idle report that allowed them (the status hop)
            res["forced_status_lag_s"] = [float(s["counters"].get("forced_status_lag_s", 0.0)) for s in stats]
        except Exception as exc:   # diagnostics only
            res["stats_error"] = f"{type(exc).__name__}: {exc}"
    res["loadavg_before"] = load
    print(f"   runtime {ts}: {res['throughput']:.1f} tok/s (load {load[0]})", flush=True)
    return res


def validate(cells: list[dict], args) -> list[dict]:
    out = []
    for c in cells:
        fits = fits_for(c["rho"], c["beta"], c["mixed"], args.small_ms / 1e3)
        pred = cell(c["rho"], c["beta"], c["mixed"], c["p"], c["C"], args.small_ms / 1e3)
        choice = tuple(pred["choice"])
        print(f"[validate rho={c['rho']} beta={c['beta']} p={c['p']} C={c['C']}] choice {choice}, predicted gain "
              f"{pred['gain']:.1%}", flush=True)
        runs: dict[tuple[int, int], list[dict]] = {(1, 1): [], choice: []}
        for _ in range(args.repeats):   # alternate the two systems so drift hits both alike
            for ts in runs:
                runs[ts].append(runtime_run(fits, c["p"], ts, c["C"], args))
        oh = runtime_overhead_s(runs[(1, 1)])
        pred_oh = cell(c["rho"], c["beta"], c["mixed"], c["p"], c["C"], args.small_ms / 1e3, oh)
        rm = RoutingModel.r2r(c["p"])
        fns_oh = chain_latency_fns(fits, rm, 0.0, oh)
        choice_oh_tp = solve_chain(choice, c["C"], rm, fns_oh).throughput
        meas = {ts: summarize([r["throughput"] for r in rs]) for ts, rs in runs.items()}
        m1, mc = meas[(1, 1)]["median"], meas[choice]["median"]
        entry = {"cell": c, "small_ms": args.small_ms, "choice": list(choice),
                 "predicted": {"all_ones": pred["all_ones"], "choice": pred["choice_throughput"],
                               "gain": pred["choice_throughput"] / pred["all_ones"] - 1},
                 "predicted_overhead": {"overhead_s": oh, "all_ones": pred_oh["all_ones"], "choice": choice_oh_tp,
                                        "gain": choice_oh_tp / pred_oh["all_ones"] - 1},
                 "measured": {"all_ones": meas[(1, 1)], "choice": meas[choice], "gain": mc / m1 - 1},
                 "raw": {f"{a},{b}": [{k: v for k, v in r.items() if k != "window_counters"} for r in rs]
                         for (a, b), rs in runs.items()}}
        out.append(entry)
        print(f"   measured (1,1) {m1:.1f} vs predicted {pred['all_ones']:.1f} (with overhead "
              f"{pred_oh['all_ones']:.1f}); {choice} {mc:.1f} vs {pred['choice_throughput']:.1f} ({choice_oh_tp:.1f}); "
              f"gain measured {mc / m1 - 1:.1%} vs predicted {entry['predicted']['gain']:.1%}", flush=True)
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rho", type=float, nargs="+", default=[2.0, 4.65, 10.0])
    ap.add_argument("--beta", type=float, nargs="+", default=[0.0, 0.05, 0.2, 0.5])
    ap.add_argument("--mixed", type=float, nargs="+", default=[1.0, 1.71])
    ap.add_argument("--p", type=float, nargs="+", default=[0.05, 0.1, 0.2, 0.35, 0.5])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[4, 8, 16])
    ap.add_argument("--validate", type=int, default=0, help="runtime checks of the K best mixed-1.0 cells")
    ap.add_argument("--validate-c", type=int, nargs="+", default=[4, 8],
                    help="concurrencies eligible for validation (runs stay short)")
    ap.add_argument("--small-ms", type=float, default=20.0)
    ap.add_argument("--duration", type=float, default=6.0)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cells", nargs="*", default=[],
                    help="extra cells to validate, each rho,beta,mixed,p,C (e.g. the seed's shape 4.65,0.05,1.0,0.35,4)")
    ap.add_argument("--reuse-map", action="store_true", help="take the map from the existing JSON (same grid)")
    ap.add_argument("--note", default="", help="a sentence on the conditions of this run, stored with it")
    ap.add_argument("--out", default="regime_map")
    args = ap.parse_args(argv)
    cmd = "python benchmarks/routing/regime_map.py " + " ".join(argv if argv is not None else sys.argv[1:])
    t0, load0 = time.time(), loadavg()
    old = RESULTS / f"{args.out}.json"
    if args.reuse_map and old.exists():
        import json
        cells = json.loads(old.read_text())["cells"]
    else:
        cells = build_map(args)
    result: dict = {"note": args.note, "command": cmd, "loadavg_before": load0, "small_step_s": SMALL_S, "gain_bar": GAIN,
                    "latency_form": "L_m(b) = s_m * (1 - beta + beta * b), s_small = 6 ms, s_large = rho * s_small; "
                                    "steps with catch-up tokens x mixed (chain_latency_fns mixture); c = d = 0",
                    "cells": cells}
    eligible = sorted((c for c in cells if c["mixed"] == 1.0 and c["C"] in args.validate_c and c["gain"] >= GAIN),
                      key=lambda c: -c["gain"])
    picked: list[dict] = []
    for c in eligible:   # distinct (rho, beta, C) so the checks cover different shapes
        if len(picked) < args.validate and all((c["rho"], c["beta"], c["C"]) != (q["rho"], q["beta"], q["C"])
                                               for q in picked):
            picked.append(c)
    for spec in args.cells:
        rho, beta, mixed, p, C = (float(x) for x in spec.split(","))
        picked.append(cell(rho, beta, mixed, p, int(C)))
    result["validation"] = validate(picked, args) if picked else []
    result["loadavg_after"], result["wall_s"] = loadavg(), time.time() - t0
    write_outputs(args.out, result, render(result))
    plot(result, RESULTS / f"{args.out}.png")
    return result


def render(result: dict) -> str:
    cells = result["cells"]
    md = ["# Where delayed batching pays: the throughput model's map\n\n",
          f"Command: `{result['command']}`; load average before {result['loadavg_before']}, after "
          f"{result.get('loadavg_after')}. Latency: {result['latency_form']}. R2R routing (switch p per small step, "
          "switching token dropped, one large-model token). gain = chain's best thresholds / thresholds (1, 1) - 1 "
          f"(T_small in {{1, 2}} up to C = 8, else 1; T_large <= min(C, 8)). Bar: {GAIN:.0%}.\n\n",
          *([f"Note: {result['note']}\n\n"] if result.get("note") else [])]
    n_pay = sum(c["gain"] >= GAIN for c in cells)
    md.append(f"{n_pay} of {len(cells)} cells reach the bar.\n\n## Largest predicted gain per latency shape "
              "(over p and C)\n\n")
    rows = []
    for (rho, beta, mixed), grp in itertools.groupby(sorted(cells, key=lambda c: (c["mixed"], c["rho"], c["beta"])),
                                                     key=lambda c: (c["rho"], c["beta"], c["mixed"])):
        g = list(grp)
        top = max(g, key=lambda c: c["gain"])
        rows.append([mixed, rho, beta, f"{top['gain']:.1%}", top["p"], top["C"], str(tuple(top["best"])),
                     sum(c["gain"] >= GAIN for c in g), len(g)])
    md.append(md_table(["mixed", "rho (large/small)", "beta (marginal/batch-1)", "max gain", "at p", "at C",
                        "best (T_s, T_l)", "cells >= bar", "cells"], rows))
    md.append("\n## Gain by switching rate and concurrency (rho 4.65, the seed's large/small ratio)\n\n")
    for mixed in sorted({c["mixed"] for c in cells}):
        rows = []
        for beta in sorted({c["beta"] for c in cells}):
            for C in sorted({c["C"] for c in cells}):
                g = {c["p"]: c for c in cells if c["mixed"] == mixed and c["beta"] == beta and c["C"] == C
                     and abs(c["rho"] - 4.65) < 1e-9}
                if g:
                    rows.append([beta, C] + [f"{g[p]['gain']:.1%}" for p in sorted(g)])
        ps = sorted({c["p"] for c in cells})
        md.append(f"mixed {mixed}:\n\n" + md_table(["beta", "C"] + [f"p={p}" for p in ps], rows) + "\n")
    if result.get("validation"):
        md.append("## Runtime checks (latency-model backend, multi-process runtime)\n\n")
        rows = []
        for v in result["validation"]:
            c, pr, po, me = v["cell"], v["predicted"], v["predicted_overhead"], v["measured"]
            for label, key in (("(1, 1)", "all_ones"), (str(tuple(v["choice"])), "choice")):
                m = me[key]["median"]
                rows.append([f"rho {c['rho']}, beta {c['beta']}, p {c['p']}, C {c['C']}", label, pr[key], po[key],
                             m, me[key]["p90"], me[key]["n"], f"{m / pr[key] - 1:+.1%}", f"{m / po[key] - 1:+.1%}"])
            rows.append(["", "gain", f"{pr['gain']:.1%}", f"{po['gain']:.1%}", f"{me['gain']:.1%}", "", "",
                         f"{me['gain'] - pr['gain']:+.1%} pts", f"{me['gain'] - po['gain']:+.1%} pts"])
        md.append(f"Small step {result['validation'][0]['small_ms']} ms at batch 1 (large = rho x). Predicted with "
                  "overhead = the chain with each model's measured busy time per step outside the runner ((1, 1) "
                  "runs) added to L_m.\n\n")
        md.append(md_table(["cell", "thresholds", "predicted tok/s", "predicted with overhead", "measured median",
                            "measured P90", "n", "measured vs predicted", "measured vs predicted with overhead"],
                           rows))
    return "".join(md)


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    cells = result["cells"]
    mixes, Cs = sorted({c["mixed"] for c in cells}), sorted({c["C"] for c in cells})
    fig, axes = plt.subplots(len(mixes), len(Cs), figsize=(4.2 * len(Cs), 3.3 * len(mixes)), squeeze=False)
    for i, mx in enumerate(mixes):
        for j, C in enumerate(Cs):
            ax = axes[i][j]
            for rho in sorted({c["rho"] for c in cells}):
                for k, beta in enumerate(sorted({c["beta"] for c in cells})):
                    g = sorted((c for c in cells if c["mixed"] == mx and c["C"] == C and c["rho"] == rho
                                and c["beta"] == beta), key=lambda c: c["p"])
                    if rho == 4.65 or beta == 0.0:
                        ax.plot([c["p"] for c in g], [100 * c["gain"] for c in g], ["o-", "s--", "^:", "x-."][k % 4],
                                label=f"rho {rho}, beta {beta}", lw=1)
            ax.axhline(100 * GAIN, color="red", lw=1, ls=":")
            ax.set_title(f"mixed {mx}, C = {C}", fontsize=9)
            ax.set_xlabel("switch probability p")
            ax.set_ylabel("predicted gain %")
            if i == 0 and j == 0:
                ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    main()
