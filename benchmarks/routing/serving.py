"""Serving benchmarks of the token-level routing runtime (issue 5, point 5). Every system is a flag setting of the
same runtime (tokenplane.route.runtime): ours = delayed_async + pending_return + model-chosen thresholds; baselines =
standard_serving (external single-token scheduler, every step re-admitted), stepwise_sync, model_sync; ablation
steps in between.

Parts (run all, or pick with --parts):
  algos      throughput (committed tok/s) and end-to-end latency at concurrency 4, five algorithms, ours vs each
             baseline, latency-model backend at the seed's scale (6.0 / 27.9 ms steps)
  greedy     real tiny models on this CPU (torch runner): outputs of ours and of standard serving equal the
             sequential single-request reference under greedy, for all five algorithms; plus their throughput
  length     max output short vs 4x longer (CPU analogue of 2048 vs 8192): ours vs standard serving
  scaling    concurrency 1 -> 16 (ours): throughput growth and single-user decode speed kept
  ablation   concurrency 8, R2R: base (step-wise sync, no pending return) -> +async -> +pending return -> +delayed batching
  breakdown  one standard-serving small-model step split into model time, prefix matching, allocation, cache updates,
             scheduler bookkeeping and message encoding (in-process, the runtime's own Scheduler and BlockManager)

Outputs: benchmarks/routing/results/serving.{json,md,png}.   python benchmarks/routing/serving.py [--parts ...]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import RESULTS, chain_latency_fns, closed_loop, latency_setting, loadavg, prompt_for, summarize  # noqa: E402
from serving_report import fmt, plot, report  # noqa: E402

from tokenplane.engine.latency_runner import LatencyFit, LatencyModelRunner  # noqa: E402
from tokenplane.route.throughput_model import RoutingModel, choose_thresholds  # noqa: E402

ALGOS = ["r2r", "citer", "co_llm", "r_stitch", "ensemble"]
# Synthetic routing rates (counter RNG, identical in every process): R2R at the seed's 0.35; the others at their
# defaults. The throughput model gets the matching per-step routing matrix.
RATES = {"r2r": {"switch": 0.35}, "citer": {"switch": 0.1}, "co_llm": {"switch": 0.1},
         "r_stitch": {"switch": 0.1, "return": 0.5}, "ensemble": {"gate": 0.2}}


def routing_model(alg: str) -> RoutingModel:
    r = RATES[alg]
    if alg == "r_stitch":   # stays on the large model until its return gate fires (geometric run, mean 2)
        return RoutingModel.star([r["switch"]], [r["return"]])
    p = r.get("switch", r.get("gate"))
    return RoutingModel.star([p], [1.0])   # one large-model token (or score visit) then back


SEGMENT_ALGOS = {"r_stitch"}   # routing signals a stock server's streamed logprobs carry (R-Stitch's entropy)
SYSTEMS = {   # name -> runtime flags
    "ours": dict(mode="delayed_async", pending_return=True, standard_serving=False),
    "standard": dict(mode="immediate_async", pending_return=False, standard_serving=True),
    # stock servers composed per segment (stream one model, abort at the switch): only where logprobs suffice
    "standard_segment": dict(mode="immediate_async", pending_return=False, standard_serving=True,
                             standard_unit="segment"),
    "stepwise_sync": dict(mode="stepwise_sync", pending_return=True, standard_serving=False),
    "model_sync": dict(mode="model_sync", pending_return=True, standard_serving=False),
}
ABLATION = [
    ("base (step-wise sync)", dict(mode="stepwise_sync", pending_return=False)),
    ("+ async", dict(mode="immediate_async", pending_return=False)),
    ("+ pending return", dict(mode="immediate_async", pending_return=True)),
    ("+ delayed batching", dict(mode="delayed_async", pending_return=True)),
]


def make_runtime(models: list, alg: str, flags: dict, concurrency: int, thresholds=None, *, runner="latency-model",
                 dtype="float32", num_blocks=2048):
    from tokenplane.route.runtime import Runtime, RuntimeConfig
    kw = {"mode": "synthetic", "rates": RATES[alg], "seed": 0}
    cfg = RuntimeConfig(models=models, algorithm=alg, algorithm_kwargs=kw, runner=runner, dtype=dtype,
                        concurrency=concurrency, thresholds=thresholds, num_blocks=num_blocks, **flags)
    return Runtime(cfg)


def seed_models(fits: list[LatencyFit]) -> list[dict]:
    return [{"latency": f.to_dict()} for f in fits]


# Per-step runtime overhead (busy time outside the runner, seconds per model) by concurrency, measured by
# threshold_validation.py in its (1, 1) runs (seed-r2r setting); None = the chain's zero-overhead assumption.
_OVERHEAD: dict[int, list[float]] | None = None


def measured_overhead(concurrency: int) -> list[float] | None:
    global _OVERHEAD
    if _OVERHEAD is None:
        _OVERHEAD = {}
        path = RESULTS / "threshold_validation.json"
        if path.exists():
            for C, e in json.loads(path.read_text())["settings"].get("seed-r2r", {}).get("by_concurrency",
                                                                                         {}).items():
                if e.get("overhead_s"):
                    _OVERHEAD[int(C)] = list(e["overhead_s"])
    if not _OVERHEAD:
        return None
    return _OVERHEAD[min(_OVERHEAD, key=lambda c: (abs(c - concurrency), c))]   # nearest measured concurrency


THRESHOLD_MODEL = {"value": "overhead"}   # "overhead" (measured runtime overhead folded into L_m) or "ideal"


def chosen_thresholds(alg: str, fits: list[LatencyFit], concurrency: int, context: float) -> list[int]:
    rm = routing_model(alg)
    oh = measured_overhead(concurrency) if THRESHOLD_MODEL["value"] == "overhead" else None
    return choose_thresholds(concurrency, rm, chain_latency_fns(fits, rm, context, oh), max_t=8)


def run_closed(alg: str, system: str, flags: dict, C: int, fits, args, *, max_tokens: int, duration: float,
               prompt_len: int | None = None) -> dict:
    prompt_len = args.prompt_len if prompt_len is None else prompt_len
    ctx = prompt_len + max_tokens / 2
    ts = chosen_thresholds(alg, fits, C, ctx) if flags.get("mode") == "delayed_async" else None
    t = time.time()
    load = loadavg()
    with make_runtime(seed_models(fits), alg, flags, C, ts) as rt:
        res = closed_loop(rt, C, duration_s=duration, warmup_s=args.warmup, max_tokens=max_tokens,
                          prompt_len=prompt_len)
        try:   # per-model step launches, and those below threshold (delayed batching only; whole run incl. warm-up)
            stats = rt.stats()
            pol = [r["counters"].get("policy") for r in stats]
            backstop = [int(r["counters"].get("backstop_launches", 0)) for r in stats]
        except Exception as exc:   # stats are a diagnostic: never lose the measured run over them
            pol, backstop = [{"error": f"{type(exc).__name__}: {exc}"}], []
        if all(p and "launches" in p for p in pol):   # each model's policy counts only its own launches
            res.update(launches=[p["launches"][m] for m, p in enumerate(pol)],
                       forced_launches=[p["forced_launches"][m] for m, p in enumerate(pol)],
                       backstop_launches=backstop)
    res.update(system=system, algorithm=alg, concurrency=C, thresholds=ts, wall_s=time.time() - t, prompt_len=prompt_len,
               loadavg_before=load, loadavg_after=loadavg())
    print(f"  {alg:>9} {system:>24} C={C:2d} T={ts}: {res['throughput']:7.1f} tok/s, latency "
          f"{fmt(res['latency_mean_s'])} s, user speed {fmt(res['user_speed'])} tok/s ({res['wall_s']:.0f} s)",
          flush=True)
    return res


def repeated(configs: list[tuple[str, tuple]], args) -> dict:
    """Run every config `args.repeats` times, in rounds (config order inside a round), so slow drifts of the shared
    machine's load hit every system alike. Each result: the median run's fields, with throughput / latency / user
    speed replaced by their medians, plus `runs` and `summary` (median, P90, min, max, n) and the load average."""
    runs: dict[str, list[dict]] = {k: [] for k, _ in configs}
    for i in range(args.repeats):
        print(f" -- round {i + 1}/{args.repeats}", flush=True)
        for key, call in configs:
            runs[key].append(run_closed(*call[0], **call[1]))
    out = {}
    for key, rs in runs.items():
        tp = summarize([r["throughput"] for r in rs])
        med = sorted(rs, key=lambda r: r["throughput"])[(len(rs) - 1) // 2]
        res = {k: v for k, v in med.items() if k != "window_counters"}
        res.update(throughput=tp["median"], latency_mean_s=summarize([r["latency_mean_s"] for r in rs])["median"],
                   user_speed=summarize([r["user_speed"] for r in rs])["median"],
                   summary={"throughput": tp, "latency_mean_s": summarize([r["latency_mean_s"] for r in rs]),
                            "user_speed": summarize([r["user_speed"] for r in rs]),
                            "load1": summarize([r["loadavg_before"][0] for r in rs])},
                   runs=rs)
        out[key] = res
    return out



# -- parts ----------------------------------------------------------------------------------------------------------
def part_algos(args, fits, prompt_len: int | None = None) -> dict:
    out, configs = {}, []
    kw = dict(max_tokens=args.max_tokens, duration=args.duration, prompt_len=prompt_len)
    for alg in args.algos:
        for system in args.systems:
            if system == "standard_segment" and alg not in SEGMENT_ALGOS:
                continue   # the router reads hidden states: a stock composition must call per token
            if alg == "ensemble" and system.startswith("standard"):
                out[f"{alg}/{system}"] = {"skipped": "ensemble score visits need retained state; the standard "
                                                     "serving baseline cannot run them (runtime raises)"}
                continue
            configs.append((f"{alg}/{system}", ((alg, system, SYSTEMS[system], 4, fits, args), kw)))
    out.update(repeated(configs, args))
    return {k: out[k] for k in sorted(out, key=lambda k: (ALGOS.index(k.split("/")[0]),
                                                          list(SYSTEMS).index(k.split("/")[1])))}


def part_scaling(args, fits) -> dict:
    kw = dict(max_tokens=args.max_tokens, duration=args.duration)
    return repeated([(str(C), (("r2r", "ours", SYSTEMS["ours"], C, fits, args), kw)) for C in args.scaling_c], args)


def part_ablation(args, fits) -> dict:
    kw = dict(max_tokens=args.max_tokens, duration=args.duration)
    return repeated([(name, (("r2r", name, flags, 8, fits, args), kw)) for name, flags in ABLATION], args)


def part_length(args, fits) -> dict:
    """Fixed batch of C=4 requests run to completion per output limit; throughput = tokens / makespan."""
    out = {}
    for system in ("ours", "standard"):
        for L in args.lengths:
            flags = SYSTEMS[system]
            ts = chosen_thresholds("r2r", fits, 4, args.prompt_len + L / 2) if system == "ours" else None
            res = run_batch_to_completion(seed_models(fits), "r2r", flags, ts, 4, L, args.prompt_len, n=4)
            res.update(system=system, max_tokens=L, thresholds=ts)
            out[f"{system}/{L}"] = res
            print(f"  length {system:>9} L={L:5d}: {res['throughput']:7.1f} tok/s, latency "
                  f"{res['latency_mean_s']:.2f} s", flush=True)
    return out


def run_batch_to_completion(models, alg, flags, ts, C, max_tokens, prompt_len, n, *, runner="latency-model",
                            dtype="float32", prompts=None, num_blocks=2048) -> dict:
    from tokenplane.engine.sampler import SamplingParams
    prompts = prompts or [prompt_for(i, prompt_len) for i in range(n)]
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    with make_runtime(models, alg, flags, C, ts, runner=runner, dtype=dtype, num_blocks=num_blocks) as rt:
        t = time.monotonic()
        outs = rt.run_batch(prompts, params, concurrency=C)
        wall = time.monotonic() - t
    tokens = sum(len(o.token_ids) for o in outs)
    lats = [o.stats.get("latency_s") for o in outs if o.stats.get("latency_s") is not None]
    return {"throughput": tokens / wall, "tokens": tokens, "makespan_s": wall,
            "latency_mean_s": statistics.fmean(lats) if lats else wall,
            "outputs": [o.token_ids for o in outs], "models": [o.token_models for o in outs]}


def part_greedy(args) -> dict:
    """Real tiny models on the CPU: runtime outputs vs the sequential reference under greedy, ours and standard."""
    from tokenplane.engine.sampler import SamplingParams
    from tokenplane.route.algorithms import make_algorithm
    from tokenplane.route.reference import run_sequential
    models = list(args.real_models)
    prompts = [prompt_for(i, args.real_prompt_len, 1000) for i in range(args.real_n)]
    params = SamplingParams(max_tokens=args.real_max_tokens, ignore_eos=True)
    out = {"models": models, "dtype": args.real_dtype, "prompts": len(prompts), "max_tokens": args.real_max_tokens}
    import torch
    torch.set_num_threads(1)
    for alg in args.algos:
        a = make_algorithm(alg, mode="synthetic", rates=RATES[alg], seed=0)
        t = time.time()
        ref = run_sequential(a, models, prompts, params, dtype=getattr(torch, args.real_dtype), num_blocks=256)
        ref_wall = time.time() - t
        entry = {"reference_wall_s": ref_wall}
        for system in ("ours", "standard", "standard_segment"):
            if system == "standard_segment" and alg not in SEGMENT_ALGOS:
                continue   # the router reads hidden states: a stock composition must call per token
            if alg == "ensemble" and system.startswith("standard"):
                entry[system] = {"skipped": "standard serving cannot run ensemble score visits"}
                continue
            ts = [1, 2] if system == "ours" else None   # CPU steps grow ~linearly past batch 2; see threshold_validation
            res = run_batch_to_completion(models, alg, SYSTEMS[system], ts, 4, args.real_max_tokens, 0, len(prompts),
                                          runner="torch", dtype=args.real_dtype, prompts=prompts, num_blocks=256)
            same = [o == r.token_ids for o, r in zip(res["outputs"], ref)]
            same_models = [m == r.token_models for m, r in zip(res["models"], ref)]
            res.update(identical=all(same), identical_count=sum(same), models_identical=all(same_models),
                       thresholds=ts)
            entry[system] = {k: v for k, v in res.items() if k not in ("outputs", "models")}
            print(f"  greedy {alg:>9} {system:>9}: identical {sum(same)}/{len(same)} "
                  f"(model sequence identical {all(same_models)}), {res['throughput']:.1f} tok/s", flush=True)
        out[alg] = entry
    return out


class _Prof:
    """Exclusive time per category for nested instrumented calls."""

    def __init__(self):
        self.total: dict[str, float] = {}
        self.stack: list[list] = []

    def wrap(self, obj, name: str, cat: str) -> None:
        fn = getattr(obj, name)

        def timed(*a, **k):
            self.stack.append([cat, 0.0])
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                el = time.perf_counter() - t
                c, child = self.stack.pop()
                self.total[c] = self.total.get(c, 0.0) + el - child
                if self.stack:
                    self.stack[-1][1] += el
        setattr(obj, name, timed)


def part_breakdown(args, fits) -> dict:
    """Drive two of the runtime's Schedulers in standard-serving mode in-process, with the front end's Yield ->
    AddRequest re-submission, and time the small model's steps by category."""
    from tokenplane.engine.sampler import SamplingParams
    from tokenplane.route.algorithms import make_algorithm
    from tokenplane.route.messages import AddRequest, Yield, decode, encode, params_to_wire
    from tokenplane.route.route_request import FRONTEND
    from tokenplane.route.scheduler import Scheduler
    out = {}
    backends = [("latency-model (seed scale)", None)] + [("torch " + args.real_models[0], args.real_models)]
    for label, real in backends:
        for ctx in (args.breakdown_contexts if real is None else args.breakdown_torch_contexts):
            prof = _Prof()
            runners = []
            for m in range(2):
                if real is None:
                    runners.append(LatencyModelRunner(fits[m], num_blocks=4096, seed=m))
                else:
                    from tokenplane.engine.loader import load_model
                    from tokenplane.engine.model_runner import ModelRunner
                    cfg, model = load_model(real[m], seed=0)
                    runners.append(ModelRunner(model, cfg, num_blocks=1024, block_size=16))
            scheds = [Scheduler(m, 2, runners[m].block_manager, make_algorithm("r2r", mode="synthetic",
                                                                               rates=RATES["r2r"], seed=0),
                                pending_return=False, standard_serving=True) for m in range(2)]
            s0, bm0, r0 = scheds[0], runners[0].block_manager, runners[0]
            prof.wrap(bm0, "_cache_hits", "prefix matching")
            for n in ("allocate", "append_slots", "can_allocate", "can_append"):
                prof.wrap(bm0, n, "KV allocation")
            for n in ("cache_blocks", "free"):
                prof.wrap(bm0, n, "cache updates (hash insert, release)")
            prof.wrap(r0, "run", "model forward")
            prof.wrap(s0, "sample_fn", "sampling")
            for n in ("add_request", "schedule", "update_from_output"):
                prof.wrap(s0, n, "scheduler bookkeeping + routing")
            params = params_to_wire(SamplingParams(max_tokens=args.breakdown_steps * 4, ignore_eos=True))
            n_req = 4
            inbox = [[], []]
            for i in range(n_req):
                inbox[0].append(AddRequest(f"b{i}", prompt_for(i, ctx), params))
            small_steps = warm = 0
            t_small = 0.0
            while small_steps < args.breakdown_steps:
                for m in range(2):
                    s = scheds[m]
                    t0 = time.perf_counter()
                    for msg in inbox[m]:
                        if m == 0:
                            t_enc = time.perf_counter()
                            msg = decode(encode(msg))   # the wire hop the front end adds per token
                            prof.total["message encode/decode"] = (prof.total.get("message encode/decode", 0.0)
                                                                   + time.perf_counter() - t_enc)
                        s.add_request(msg)
                    inbox[m] = []
                    batch = s.schedule()
                    if not batch:
                        continue
                    o = runners[m].run([r.seq for r in batch])
                    sends = s.update_from_output(batch, o)
                    for ob in sends:
                        y = ob.msg
                        if ob.dest == FRONTEND and isinstance(y, Yield) and y.finish_reason is None:
                            inbox[y.next_model].append(AddRequest(y.request_id, y.prompt, y.params, y.output,
                                                                  y.models, y.state, y.num_handoffs, y.handoff))
                    if m == 0:
                        warm += 1
                        if warm <= 4:   # the prompt prefill and first re-admissions are not steady state
                            prof.total.clear()
                            continue
                        small_steps += 1
                        t_small += time.perf_counter() - t0
            total = t_small
            cats = dict(sorted(prof.total.items(), key=lambda kv: -kv[1]))
            other = max(0.0, total - sum(cats.values()))
            cats["other (front-end loop)"] = other
            key = f"{label} / context {ctx}"
            out[key] = {"steps": small_steps, "mean_step_ms": 1e3 * total / small_steps,
                        "share": {k: v / total for k, v in cats.items()},
                        "ms_per_step": {k: 1e3 * v / small_steps for k, v in cats.items()}}
            print(f"  breakdown {key}: step {1e3 * total / small_steps:.2f} ms; " + ", ".join(
                f"{k} {v / total:.1%}" for k, v in cats.items()), flush=True)
    return out



def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", nargs="+", default=["algos", "greedy", "length", "scaling", "ablation", "breakdown"])
    ap.add_argument("--algos", nargs="+", default=ALGOS)
    ap.add_argument("--systems", nargs="+", default=list(SYSTEMS))
    ap.add_argument("--latency", default="seed-r2r")
    ap.add_argument("--duration", type=float, default=4.0)
    ap.add_argument("--warmup", type=float, default=1.0)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--lengths", type=int, nargs="+", default=[128, 512])
    ap.add_argument("--long-prompt-len", type=int, default=1024,
                    help="algos_long: prompt length at the latency fits' anchor context (1024)")
    ap.add_argument("--scaling-c", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--real-models", nargs=2, default=["tiny-small", "tiny-large"])
    ap.add_argument("--real-dtype", default="float32")
    ap.add_argument("--real-n", type=int, default=4)
    ap.add_argument("--real-max-tokens", type=int, default=24)
    ap.add_argument("--real-prompt-len", type=int, default=16)
    ap.add_argument("--breakdown-contexts", type=int, nargs="+", default=[512, 4096])
    ap.add_argument("--breakdown-torch-contexts", type=int, nargs="*", default=[512])
    ap.add_argument("--breakdown-steps", type=int, default=60)
    ap.add_argument("--repeats", type=int, default=3, help="closed-loop runs per configuration (median reported)")
    ap.add_argument("--threshold-model", choices=["overhead", "ideal"], default="overhead",
                    help="ours' thresholds: chain with the measured runtime overhead folded into L_m, or without")
    ap.add_argument("--note", default="", help="a sentence on the conditions of this run, stored with it")
    ap.add_argument("--out", default="serving")
    ap.add_argument("--merge", action="store_true", help="update parts in an existing results JSON")
    args = ap.parse_args(argv)
    THRESHOLD_MODEL["value"] = args.threshold_model
    fits, provenance = latency_setting(args.latency)
    path = RESULTS / f"{args.out}.json"
    res: dict[str, Any] = json.loads(path.read_text()) if args.merge and path.exists() else {}
    res.update(machine="2 vCPU (shared), CPU only", latency_provenance=provenance,
               fits=[f.to_dict() for f in fits], args={k: v for k, v in vars(args).items()})
    parts = {"algos": lambda: part_algos(args, fits),
             "algos_long": lambda: part_algos(args, fits, prompt_len=args.long_prompt_len),
             "greedy": lambda: part_greedy(args),
             "length": lambda: part_length(args, fits), "scaling": lambda: part_scaling(args, fits),
             "ablation": lambda: part_ablation(args, fits), "breakdown": lambda: part_breakdown(args, fits)}
    for p in args.parts:
        print(f"== {p}", flush=True)
        t = time.time()
        started, load = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), loadavg()
        res[p] = parts[p]()
        res.setdefault("part_wall_s", {})[p] = time.time() - t
        res.setdefault("part_meta", {})[p] = {
            "command": "python benchmarks/routing/serving.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "started": started, "wall_s": time.time() - t, "load_before": load, "load_after": loadavg(),
            "threshold_model": ("chain + measured runtime overhead (threshold_validation.json)"
                                if args.threshold_model == "overhead" and measured_overhead(4) else
                                "chain, zero overhead"), "note": args.note, "repeats": args.repeats}
        RESULTS.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(res, indent=1, default=str))
        (RESULTS / f"{args.out}.md").write_text(report(res, ALGOS, list(SYSTEMS)))   # after every part: partial runs stay readable
    plot(res, RESULTS / f"{args.out}.png", ALGOS, list(SYSTEMS))
    return res


if __name__ == "__main__":
    main()
