"""Validate the throughput model's threshold choice against measured throughput over a threshold sweep.

For each latency setting (the seed's R2R GPU figures; our measured CPU step latencies) and concurrency 4, 8, 16,
with R2R synthetic routing (switch probability 0.35 per small-model step, large model regenerates the dropped token
and hands back after one token):

  1. the Markov chain predicts committed tokens/s for every feasible (T_small, T_large) with T <= max_t and
     choose_thresholds picks the argmax;
  2. "des": the discrete-event simulator (continuous latencies, long horizon) measures the full sweep;
  3. "runtime": the real multi-process runtime (tokenplane.route.runtime, one process per model, ZeroMQ handoffs)
     with the latency-model backend, closed-loop clients, measures T_small = 1 x T_large in a grid (+ the choices),
     each configuration `--repeats` times (median and P90 reported, load average recorded);
  4. the runtime's own busy time per step outside the runner (scheduling, sampling, routing, messages), measured in
     the (1, 1) runs' steady-state window, is added to each model's step latency and the chain chooses again: the
     "overhead-aware" choice (the chain's documented assumption is zero overhead unless folded into L_m);
  5. reported: measured (median) throughput of each choice / best measured median (target >= 95%).
  6. "torch" (setting torch-measured only): the same runtime with REAL engines, the torch ModelRunner on the
     tiny-small / tiny-large checkpoints, 1 thread per sub-server, one core each (real_engines.py); the chain's
     inputs are those engines' own step latencies measured the same way (cpu_latency_torch.json). Measured: (1, 1),
     the chain's choice, its feasible neighbours and (1, b) for b in --torch-large, alternated in one runtime per
     concurrency; reported also measured / predicted per configuration (target: within 5% at the choice).

    python benchmarks/routing/threshold_validation.py [--backend des runtime] [--settings seed-r2r cpu-measured]
    python benchmarks/routing/threshold_validation.py --settings torch-measured --backend des torch --merge
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    RESULTS,
    TORCH_LATENCY_ISOLATED,
    chain_latency_fns,
    closed_loop,
    latency_setting,
    loadavg,
    md_table,
    runtime_overhead_s,
    summarize,
    torch_fits,
    write_outputs,
)
from real_engines import EngineRunSpec, ensure_model_dirs, measure_grid, runner_ms_per_step  # noqa: E402

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
        load = loadavg()
        res = closed_loop(rt, concurrency, duration_s=duration_s, warmup_s=0.5, max_tokens=max_tokens,
                          prompt_len=prompt_len)
        try:
            res["model_stats"] = rt.stats()
        except Exception as exc:  # stats are diagnostics; a slow reply must not lose the measurement
            res["model_stats"] = f"unavailable: {exc}"
    res["loadavg_before"], res["loadavg_after"] = load, loadavg()
    return res


def runtime_repeats(fits, ts, C, dur, args) -> list[dict]:
    runs = []
    for i in range(args.repeats):
        r = runtime_measure(fits, ts, C, dur, args.max_tokens, args.prompt_len)
        print(f"   runtime {ts} #{i + 1}: {r['throughput']:.1f} tok/s (load {r['loadavg_before'][0]})", flush=True)
        runs.append(r)
    return runs


def torch_grid(chain: dict, chosen: tuple[int, int], large: list[int]) -> list[tuple[int, int]]:
    """Configurations the torch backend measures: (1, 1), the chain's choice, its feasible neighbours (one
    threshold one step up or down) and (1, b) for b in `large`; each once, in that order."""
    a, b = chosen
    cands = [(1, 1), chosen, (a, b - 1), (a, b + 1), (a - 1, b), (a + 1, b)] + [(1, x) for x in large]
    grid: list[tuple[int, int]] = []
    for ts in cands:
        if ts in chain and ts not in grid:
            grid.append(ts)
    return grid


def torch_calibrate(entry: dict, fits: list, rm, context: float, C: int, combos) -> None:
    """The chain again with each engine's step cost as the (1, 1) runs saw it inside the runtime: fit m scaled by
    kappa_m = the runner's measured time per step / the isolated fit at the same mean batch (median over the (1, 1)
    runs; the fit at the mean batch stands in for the mean over the batch mix), plus the measured busy time outside
    the runner. Not an independent prediction for (1, 1) (its step costs come from those runs); for the other
    configurations it tests the chain's batching dynamics given the engines' speed under this machine's load."""
    import statistics
    kappa: dict[int, list[float]] = {}
    for r in entry["torch_raw"]["1,1"]:
        for w in r.get("window_counters") or []:
            if w["steps"] > 0:
                fit_s = fits[w["model"]](w["mean_batch"], context)
                kappa.setdefault(w["model"], []).append(w["runner_ms_per_step"] / 1e3 / fit_s)
    if len(kappa) != len(fits):
        return
    k = [statistics.median(kappa[m]) for m in range(len(fits))]
    fns = chain_latency_fns([f.scaled(x) for f, x in zip(fits, k)], rm, context, entry.get("torch_overhead_s"))
    chain = {ts: solve_chain(ts, C, rm, fns) for ts in combos}
    entry.update(torch_kappa=k, torch_chain_calibrated={_key(ts): r.to_dict() for ts, r in chain.items()},
                 torch_chosen_calibrated=list(_choose(chain)))
    if TORCH_LATENCY_ISOLATED.exists():   # the same engines measured alone, for comparison
        iso, _ = torch_fits(TORCH_LATENCY_ISOLATED)
        fns = chain_latency_fns(iso, rm, context)
        entry["torch_chain_isolated"] = {_key(ts): solve_chain(ts, C, rm, fns).to_dict() for ts in combos}
    print(f"   torch engines' step cost in the runtime / the setting's fit: {[round(x, 3) for x in k]} -> calibrated "
          f"choice {tuple(entry['torch_chosen_calibrated'])}", flush=True)


def _choose(chain: dict) -> tuple[int, int]:
    best_pred = max(chain.values(), key=lambda r: r.throughput).throughput
    return min((ts for ts, r in chain.items() if r.throughput >= best_pred * (1 - REL_TOL)),
               key=lambda ts: (sum(ts), ts))   # the choose_thresholds rule


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", nargs="+", default=["des", "runtime"], choices=["des", "runtime", "torch"])
    ap.add_argument("--settings", nargs="+", default=["seed-r2r", "cpu-measured"],
                    choices=["seed-r2r", "cpu-measured", "torch-measured"])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[4, 8, 16])
    ap.add_argument("--max-t", type=int, default=8)
    ap.add_argument("--runtime-large", type=int, nargs="+", default=[1, 2, 4, 6, 8],
                    help="T_large values measured on the runtime (T_small = 1), plus the model's choice")
    ap.add_argument("--duration", type=float, default=3.0, help="runtime window per config, seconds (seed scale)")
    ap.add_argument("--cpu-duration", type=float, default=8.0, help="runtime window per config at CPU latencies")
    ap.add_argument("--torch-duration", type=float, default=8.0, help="torch backend window per config, seconds")
    ap.add_argument("--torch-large", type=int, nargs="*", default=[2, 4],
                    help="torch backend: (1, b) measured besides (1, 1), the choice and its neighbours")
    ap.add_argument("--models-dir", type=Path, default=Path("/tmp/tokenplane-peer-models"),
                    help="torch backend: where the tiny-small / tiny-large checkpoints live (written if missing)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--des-steps", type=int, default=60_000)
    ap.add_argument("--repeats", type=int, default=3, help="runtime runs per configuration (median reported)")
    ap.add_argument("--out", default="threshold_validation")
    ap.add_argument("--merge", action="store_true", help="keep the settings not run now from the existing JSON")
    args = ap.parse_args(argv)

    context = args.prompt_len + args.max_tokens / 2  # mean context of a request in the closed loop
    rm = RoutingModel.r2r(P_SWITCH)
    result = {"p_switch": P_SWITCH, "context": context, "settings": {}}
    path = RESULTS / f"{args.out}.json"
    if args.merge and path.exists():
        import json
        old = json.loads(path.read_text())
        result["settings"] = old.get("settings", {})
        result["commands"] = old.get("commands", [])
        if old.get("notes"):
            result["notes"] = old["notes"]
    result.setdefault("commands", []).append("python benchmarks/routing/threshold_validation.py " +
                                             " ".join(argv if argv is not None else sys.argv[1:]))
    for setting in args.settings:
        fits, provenance = latency_setting(setting)
        fns = chain_latency_fns(fits, rm, context)
        sres = {"provenance": provenance, "fits": [f.to_dict() for f in fits],
                "by_concurrency": dict(result["settings"].get(setting, {}).get("by_concurrency", {}))}
        for C in args.concurrency:
            t = time.time()
            combos = feasible_thresholds(2, C, args.max_t)
            chain = {ts: solve_chain(ts, C, rm, fns) for ts in combos}
            chosen = _choose(chain)
            entry = {"chosen": list(chosen), "chain_s": time.time() - t,
                     "chain": {f"{a},{b}": r.to_dict() for (a, b), r in chain.items()}}
            print(f"[{setting} C={C}] chain over {len(combos)} combos in {entry['chain_s']:.1f} s: "
                  f"choice {chosen} predicts {chain[chosen].throughput:.1f} tok/s", flush=True)
            for backend in args.backend:
                if backend == "des":
                    measured = {ts: simulate(ts, C, rm, fns, horizon_steps=args.des_steps, seed=7).throughput
                                for ts in combos}
                else:
                    if backend == "runtime":
                        dur = args.duration if setting == "seed-r2r" else args.cpu_duration
                        runs = {(1, 1): runtime_repeats(fits, (1, 1), C, dur, args)}
                    else:   # torch: real engines, whose own measured latencies are this setting's chain inputs
                        if setting != "torch-measured":
                            raise SystemExit("--backend torch measures the torch engines: use it with --settings "
                                             "torch-measured (their own latency fits)")
                        spec = EngineRunSpec(ensure_model_dirs(args.models_dir), P_SWITCH, C,
                                             duration_s=args.torch_duration, max_tokens=args.max_tokens,
                                             prompt_len=args.prompt_len)
                        runs = measure_grid(spec, torch_grid(chain, chosen, args.torch_large), args.repeats)
                        entry["torch_runner"] = {_key(ts): runner_ms_per_step(rs) for ts, rs in runs.items()}
                    overhead = runtime_overhead_s(runs[(1, 1)])
                    t = time.time()
                    fns_oh = chain_latency_fns(fits, rm, context, overhead)
                    chain_oh = {ts: solve_chain(ts, C, rm, fns_oh) for ts in combos}
                    chosen_oh = _choose(chain_oh)
                    entry.update({_bk(backend, "overhead_s"): overhead, _bk(backend, "chosen_overhead"): list(chosen_oh),
                                  _bk(backend, "chain_overhead"): {_key(ts): r.to_dict() for ts, r in chain_oh.items()}})
                    print(f"   measured {backend} overhead per step {[round(1e3 * o, 2) for o in overhead or []]} ms "
                          f"-> overhead-aware choice {chosen_oh} ({time.time() - t:.1f} s)", flush=True)
                    if backend == "runtime":
                        grid = [(1, b) for b in args.runtime_large if (1, b) in chain and b <= C]
                        for ts in (chosen, chosen_oh):
                            if ts not in grid:
                                grid.append(ts)
                        for ts in grid:
                            if ts not in runs:
                                runs[ts] = runtime_repeats(fits, ts, C, dur, args)
                    measured = {ts: summarize([r["throughput"] for r in rs])["median"] for ts, rs in runs.items()}
                    entry[f"{backend}_raw"] = {_key(ts): rs for ts, rs in runs.items()}
                    entry[f"{backend}_summary"] = {_key(ts): summarize([r["throughput"] for r in rs])
                                                   for ts, rs in runs.items()}
                    entry[f"{backend}_load"] = summarize([r["loadavg_before"][0] for rs in runs.values() for r in rs])
                    if backend == "torch":   # needs entry["torch_raw"] and the overhead
                        torch_calibrate(entry, fits, rm, context, C, combos)
                best_ts = max(measured, key=measured.get)
                ratio = measured[chosen] / measured[best_ts]
                entry[backend] = {"measured": {f"{a},{b}": v for (a, b), v in measured.items()},
                                  "best": list(best_ts), "best_throughput": measured[best_ts],
                                  "chosen_throughput": measured[chosen], "ratio": ratio,
                                  "all_ones": measured.get((1, 1)),
                                  "predicted_chosen": chain[chosen].throughput,
                                  "measured_over_predicted": measured[chosen] / chain[chosen].throughput}
                print(f"   {backend}: best {best_ts} {measured[best_ts]:.1f}, chosen {chosen} "
                      f"{measured[chosen]:.1f} -> {ratio:.1%}; measured / predicted at the choice "
                      f"{measured[chosen] / chain[chosen].throughput:.1%}", flush=True)
                if backend in ("runtime", "torch"):
                    got = measured.get(tuple(entry[_bk(backend, "chosen_overhead")]))
                    if got is not None:
                        entry[backend].update(chosen_overhead_throughput=got, ratio_overhead=got / measured[best_ts])
                        print(f"   {backend}: overhead-aware choice {tuple(entry[_bk(backend, 'chosen_overhead')])} "
                              f"{got:.1f} -> {got / measured[best_ts]:.1%}", flush=True)
            # --merge: a backend not run now keeps its earlier measurement of this concurrency
            for backend, old_m in sres["by_concurrency"].get(str(C), {}).items():
                if backend in ("des",) and backend not in args.backend:
                    entry.setdefault(backend, old_m)
            sres["by_concurrency"][str(C)] = entry
            result["settings"][setting] = sres
            write_outputs(args.out, result, render(result))   # partial results stay readable
        result["settings"][setting] = sres
    result["prompt_len"], result["max_tokens"] = args.prompt_len, args.max_tokens
    write_outputs(args.out, result, render(result))
    plot(result, RESULTS / f"{args.out}.png")
    return result


def _key(ts) -> str:
    return f"{ts[0]},{ts[1]}"


def _bk(backend: str, name: str) -> str:
    """Per-backend entry keys: the latency-model runtime keeps its original names, the torch backend prefixes."""
    return name if backend == "runtime" else f"{backend}_{name}"


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
        lag = c.get("forced_status_lag_s")
        lag_s = f" (idle news {1e3 * lag / forced:.2f} ms late per forced)" if lag is not None and forced else ""
        parts.append(f"m{m.get('model')}: batch {c.get('batched_seqs', 0) / steps:.2f}, forced {forced}/{steps}{lag_s}"
                     if steps else f"m{m.get('model')}: idle")
    return "; ".join(parts)


def render(result: dict) -> str:
    """Markdown from the JSON (re-derives the choices with REL_TOL from the stored chain predictions)."""
    md = ["# Delayed-batching thresholds: throughput model vs measured\n\n",
          f"R2R synthetic routing, p = {result['p_switch']}; closed loop, prompt {result.get('prompt_len', 32)}, "
          f"max_tokens {result.get('max_tokens', 128)}; latency evaluated at mean context {result['context']:.0f}. "
          "Throughput = committed tokens/s. The model's choice = smallest thresholds predicted within "
          f"{REL_TOL:.0%} of the chain's best. `des` = discrete-event simulation of the same assumptions (a "
          "consistency check, not an independent measurement); `runtime` = the real multi-process runtime with the "
          "latency-model backend (measured on a shared 2-core machine under other jobs' load). `runtime, "
          "overhead-aware` = the same measurements judged against the chain's choice when each model's step latency "
          "includes the runtime's measured busy time per step outside the runner (from the (1, 1) runs). `torch` = "
          "the same runtime with real engines (torch ModelRunner on the tiny-small / tiny-large checkpoints, 1 "
          "thread and one core per sub-server), judged against the chain on those engines' own measured step "
          "latencies (setting torch-measured).\n"]
    for cmd in result.get("commands", []):
        md.append(f"\nRun: `{cmd}`\n")
    if result.get("notes"):
        md.append(f"\n{result['notes']}\n")
    for setting, sres in result["settings"].items():
        md.append(f"\n## {setting}\n\n{sres['provenance']}.\n\n")
        rows, diag = [], []
        for C, e in sorted(sres["by_concurrency"].items(), key=lambda kv: int(kv[0])):
            chain = {tuple(map(int, k.split(","))): v["throughput"] for k, v in e["chain"].items()}
            chosen = _choose_pred(chain)
            e["chosen"] = list(chosen)
            for backend in ("des", "runtime", "torch"):
                b = e.get(backend)
                if not b:
                    continue
                meas = {tuple(map(int, k.split(","))): v for k, v in b["measured"].items()}
                best_ts = max(meas, key=meas.get)
                summ = e.get(f"{backend}_summary", {}) if backend != "des" else {}
                n = f" (n={summ[_key(best_ts)]['n']})" if summ else ""
                choices = [(backend, chosen, chain)]
                if backend != "des" and _bk(backend, "chain_overhead") in e:
                    ch_oh = {tuple(map(int, k.split(","))): v["throughput"]
                             for k, v in e[_bk(backend, "chain_overhead")].items()}
                    choices.append((f"{backend}, overhead-aware", _choose_pred(ch_oh), ch_oh))
                for label, ch, pred in choices:
                    got = meas.get(ch)
                    ratio = None if got is None else got / meas[best_ts]
                    if label == backend:
                        b.update(chosen=list(ch), chosen_throughput=got, ratio=ratio, best=list(best_ts),
                                 best_throughput=meas[best_ts])
                    else:
                        b.update(chosen_overhead=list(ch), chosen_overhead_throughput=got, ratio_overhead=ratio)
                    rows.append([C, label, str(ch), pred[ch], "not measured" if got is None else got,
                                 str(best_ts), f"{meas[best_ts]:.3g}{n}", "n/a" if ratio is None else f"{ratio:.1%}",
                                 meas.get((1, 1), float("nan")), len(meas)])
            for k, raw in (e.get("runtime_raw") or {}).items():
                ts = tuple(map(int, k.split(",")))
                runs = raw if isinstance(raw, list) else [raw]
                sm = summarize([r["throughput"] for r in runs])
                load = summarize([r.get("loadavg_before", [None])[0] for r in runs])
                oh = e.get("chain_overhead", {}).get(k, {}).get("throughput")
                diag.append([C, f"({k})", sm["median"], sm["p90"], sm["n"], chain[ts],
                             "" if oh is None else oh, "" if load["median"] is None else load["median"],
                             _runtime_diag(runs[len(runs) // 2])])
        md.append(md_table(["C", "measured on", "model's choice (T_s, T_l)", "predicted tok/s",
                            "measured tok/s (choice, median)", "best measured (T_s, T_l)", "best tok/s",
                            "choice / best", "(1,1) tok/s", "configs"], rows))
        oh_rows = [[C, backend, ", ".join(f"m{m}: {1e3 * o:.2f} ms" for m, o in enumerate(e[_bk(backend, "overhead_s")]))]
                   for C, e in sorted(sres["by_concurrency"].items(), key=lambda kv: int(kv[0]))
                   for backend in ("runtime", "torch") if e.get(_bk(backend, "overhead_s"))]
        if oh_rows:
            md.append("\nMeasured runtime busy time per step outside the runner ((1, 1) runs, median), added to L_m "
                      "for the overhead-aware choice:\n\n")
            md.append(md_table(["C", "backend", "per model"], oh_rows))
        if diag:
            md.append("\nRuntime runs (tok/s median and P90 over n repeats; load average at start, median; counters "
                      "of the median run: mean batch per model, launches forced below threshold / steps):\n\n")
            md.append(md_table(["C", "thresholds", "tok/s median", "tok/s P90", "n", "predicted tok/s",
                                "predicted with overhead", "load avg", "runtime counters"], diag))
        md.append(render_torch(sres, result["context"]))
    return "".join(md)


def render_torch(sres: dict, ctx: float) -> str:
    """The torch backend's per-configuration table and its two targets, per concurrency."""
    from tokenplane.engine.latency_runner import LatencyFit
    fits = [LatencyFit.from_dict(f) for f in sres["fits"]]
    rows, targets = [], []
    for C, e in sorted(sres["by_concurrency"].items(), key=lambda kv: int(kv[0])):
        raw = e.get("torch_raw")
        if not raw:
            continue
        chain = {tuple(map(int, k.split(","))): v["throughput"] for k, v in e["chain"].items()}
        ch_oh = {k: v["throughput"] for k, v in (e.get("torch_chain_overhead") or {}).items()}
        ch_cal = {k: v["throughput"] for k, v in (e.get("torch_chain_calibrated") or {}).items()}
        ch_iso = {k: v["throughput"] for k, v in (e.get("torch_chain_isolated") or {}).items()}
        chosen = _choose_pred(chain)
        for k, runs in raw.items():
            ts = tuple(map(int, k.split(",")))
            sm = summarize([r["throughput"] for r in runs])
            load = summarize([r["loadavg_before"][0] for r in runs])
            eng = "; ".join(f"m{m}: batch {x['mean_batch']:.2f}, runner {x['runner_ms']:.1f} ms "
                            f"(fit {1e3 * fits[m](x['mean_batch'], ctx):.1f})"
                            for m, x in enumerate((e.get("torch_runner") or {}).get(k, [])))
            mark = " (choice)" if ts == chosen else ""
            cal = ch_cal.get(k)
            rows.append([C, f"({k}){mark}", sm["median"], sm["p90"], sm["n"], chain[ts], f"{sm['median'] / chain[ts]:.1%}",
                         ch_oh.get(k, ""), ch_iso.get(k, ""), "" if cal is None else cal,
                         "" if cal is None else f"{sm['median'] / cal:.1%}", load["median"], eng])
        t = e["torch"]
        err = t["chosen_throughput"] / chain[chosen] - 1
        targets.append([C, str(chosen), chain[chosen], t["chosen_throughput"], f"{err:+.1%}",
                        "met" if abs(err) <= 0.05 else "NOT met", str(tuple(t["best"])), t["best_throughput"],
                        f"{t['ratio']:.1%}", "met" if t["ratio"] >= 0.95 else "NOT met", t.get("all_ones"),
                        _calibrated_note(e, ch_cal)])
    if not rows:
        return ""
    # the step shape in regime_map.py's terms: rho = large / small at batch 1, beta = the mean marginal cost of one
    # more sequence (batch 1 -> 16) relative to a batch-1 step
    lat = [[f(b, ctx) for b in (1, 4, 16)] for f in fits]
    shape = (f"Step shape of these engines at context {ctx:.0f} (the setting's fits): small {lat[0][0] * 1e3:.1f} / "
             f"{lat[0][1] * 1e3:.1f} / {lat[0][2] * 1e3:.1f} ms, large {lat[1][0] * 1e3:.1f} / {lat[1][1] * 1e3:.1f} / "
             f"{lat[1][2] * 1e3:.1f} ms at batch 1 / 4 / 16: rho = {lat[1][0] / lat[0][0]:.2f}, beta = "
             f"{(lat[0][2] / lat[0][0] - 1) / 15:.3f} (small), {(lat[1][2] / lat[1][0] - 1) / 15:.3f} (large). "
             "regime_map.md: delayed batching gains >= 10% only at rho >= 4.65 with beta <= 0.05.\n")
    return ("\n" + shape + "\nTorch engines: targets per concurrency (measured within 5% of predicted at the chain's choice; the "
            "choice >= 95% of the best measured):\n\n"
            + md_table(["C", "choice", "predicted tok/s", "measured tok/s", "measured - predicted", "within 5%",
                        "best measured", "best tok/s", "choice / best", ">= 95%", "(1,1) tok/s",
                        "engines' in-runtime speed: kappa, choice, measured - predicted"], targets)
            + "\nTorch engine runs (tok/s median and P90 over n repeats, configurations alternated in one runtime; "
            "predicted = the chain on the setting's fits; with overhead = plus the runtime's measured busy "
            "time per step outside the runner; isolated fit = the chain on the engines measured alone "
            "(cpu_latency_torch_isolated.json, min of steps); calibrated = the chain with each engine's step cost as the (1, 1) "
            "runs measured it inside the runtime (fit x kappa, plus that overhead: see torch_calibrate); per "
            "model: mean batch and the runner's own ms per step in the runtime, next to the setting's fit at that "
            "mean batch and the mean context):\n\n"
            + md_table(["C", "thresholds", "tok/s median", "tok/s P90", "n", "predicted tok/s", "measured / predicted",
                        "predicted with overhead", "predicted, isolated fit", "predicted, calibrated",
                        "measured / calibrated", "load avg",
                        "engines in the runtime"], rows))


def _calibrated_note(e: dict, ch_cal: dict) -> str:
    if not ch_cal or not e.get("torch_kappa"):
        return ""
    ch = _choose_pred({tuple(map(int, k.split(","))): v for k, v in ch_cal.items()})
    meas = {tuple(map(int, k.split(","))): v for k, v in e["torch"]["measured"].items()}
    got = meas.get(ch)
    diff = "not measured" if got is None else f"{got / ch_cal[_key(ch)] - 1:+.1%}"
    return f"{', '.join(f'{x:.2f}' for x in e['torch_kappa'])}; {ch}; {diff}"


def _choose_pred(chain: dict) -> tuple[int, int]:
    best_pred = max(chain.values())
    return min((ts for ts, v in chain.items() if v >= best_pred * (1 - REL_TOL)), key=lambda ts: (sum(ts), ts))


def rechain(path: Path, settings: list[str] | None, des_steps: int = 60_000) -> dict:
    """Recompute the model side (chain, overhead-aware chain, DES) of stored results with the current
    chain_latency_fns, keeping the runtime measurements, which do not depend on the model."""
    import json
    result = json.loads(path.read_text())
    context = result["context"]
    rm = RoutingModel.r2r(result["p_switch"])
    only = {}   # "setting" or "setting@4,8" (only those concurrencies)
    for x in settings or []:
        name, _, cs = x.partition("@")
        only[name] = {int(c) for c in cs.split(",")} if cs else None
    for setting, sres in result["settings"].items():
        if only and setting not in only:
            continue
        fits, _ = latency_setting(setting)
        for C, e in sres["by_concurrency"].items():
            C = int(C)
            if only and only[setting] is not None and C not in only[setting]:
                continue
            combos = feasible_thresholds(2, C, 8)
            fns = chain_latency_fns(fits, rm, context)
            chain = {ts: solve_chain(ts, C, rm, fns) for ts in combos}
            e["chain"] = {_key(ts): r.to_dict() for ts, r in chain.items()}
            e["chosen"] = list(_choose(chain))
            for backend in ("runtime", "torch"):
                if e.get(_bk(backend, "overhead_s")):
                    fns_oh = chain_latency_fns(fits, rm, context, e[_bk(backend, "overhead_s")])
                    ch = {ts: solve_chain(ts, C, rm, fns_oh) for ts in combos}
                    e[_bk(backend, "chain_overhead")] = {_key(ts): r.to_dict() for ts, r in ch.items()}
                    e[_bk(backend, "chosen_overhead")] = list(_choose(ch))
            if e.get("torch_raw"):
                torch_calibrate(e, fits, rm, context, C, combos)
            # the DES depends on the model inputs alone: always recomputed
            meas = {ts: simulate(ts, C, rm, fns, horizon_steps=des_steps, seed=7).throughput for ts in combos}
            best = max(meas, key=meas.get)
            e["des"] = {"measured": {_key(ts): v for ts, v in meas.items()}, "best": list(best),
                        "best_throughput": meas[best]}
            print(f"[{setting} C={C}] rechained: choice {e['chosen']}, overhead-aware "
                  f"{e.get('chosen_overhead') or e.get('torch_chosen_overhead')}", flush=True)
    result.setdefault("commands", []).append(f"python benchmarks/routing/threshold_validation.py --rechain "
                                             f"{path.name} {' '.join(settings or [])}".strip())
    write_outputs(path.stem, result, render(result))
    plot(result, path.with_suffix(".png"))
    return result


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
            for backend, style in (("des", "s--"), ("runtime", "^-"), ("torch", "v-")):
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
    elif len(sys.argv) >= 3 and sys.argv[1] == "--rechain":
        rechain(Path(sys.argv[2]), sys.argv[3:] or None)
    else:
        main()
