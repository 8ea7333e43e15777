"""Where the runtime loses against the throughput model: one closed-loop run, traced.

For one configuration (algorithm, concurrency, thresholds) of the latency-model backend this measures, in the
steady-state window:
  - CPU utilisation of every process (front end + client, each sub-server) and of the front end's threads, from
    /proc, so "is the 2-core machine saturated?" has a number;
  - per model: share of wall time inside the runner (the modeled step), in the rest of a step (schedule, sample,
    route, send), idle, and elsewhere in the loop (from the sub-servers' counters);
  - from a per-event trace (TOKENPLANE_TRACE_DIR; sub-servers record steps, admissions and handoff receipts with
    CLOCK_MONOTONIC stamps): the mean number of requests in each state (executing / queued on each model, in transit
    between models, at the front end), which sums to the concurrency (Little's law), and the delivery delay of a
    handoff to a receiver that is not inside a step (transport + wake-up);
  - with --profile, a cProfile of each sub-server (TOKENPLANE_PROFILE_DIR), top functions by own time.

    python benchmarks/routing/overhead.py --concurrency 16 --thresholds 1 1 [--profile]
Outputs: benchmarks/routing/results/overhead.{json,md} (one section per run key, merged).
"""
from __future__ import annotations

import argparse
import bisect
import glob
import json
import os
import re
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import RESULTS, closed_loop, latency_setting, loadavg, md_table  # noqa: E402
from serving import SYSTEMS, chosen_thresholds, make_runtime, seed_models  # noqa: E402


def _cpu_s(pid: int, tid: int | None = None) -> float:
    path = f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat"
    f = open(path).read().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


def trace_occupancy(trace_dir: str, t0: float, t1: float) -> dict:
    """Mean requests per state over [t0, t1] (perf_counter seconds), from the sub-servers' traces."""
    events: dict[str, list] = {}
    steps: dict[int, list] = {}
    for f in sorted(glob.glob(f"{trace_dir}/model*.json")):
        m = int(re.search(r"model(\d+)", f).group(1))
        tr = json.load(open(f))
        steps[m] = [e for e in tr if e[0] == "step"]
        for e in tr:
            if e[0] == "add":
                events.setdefault(e[2].split("-")[0], []).append((e[1], "add", m, None))
            elif e[0] == "recv":
                events.setdefault(e[2].split("-")[0], []).append((e[1], "final" if e[3] else "recv", m, None))
            elif e[0] == "step":
                for rid in e[5]:
                    events.setdefault(rid.split("-")[0], []).append((e[1], "step", m, e[4]))
    tot: Counter = Counter()

    def acc(a: float, b: float, state: str) -> None:
        a, b = max(a, t0), min(b, t1)
        if b > a:
            tot[state] += b - a
    busy = {m: [(s[1], s[4]) for s in S] for m, S in steps.items()}
    starts = {m: [a for a, _ in iv] for m, iv in busy.items()}

    def busy_overlap(m: int, a: float, b: float) -> float:
        iv, i, o = busy[m], max(0, bisect.bisect_right(starts[m], a) - 1), 0.0
        while i < len(iv) and iv[i][0] < b:
            o += max(0.0, min(b, iv[i][1]) - max(a, iv[i][0]))
            i += 1
        return o
    free_delays = []
    for ev in events.values():   # one client's successive requests
        ev.sort()
        for i, (t, kind, m, te) in enumerate(ev):
            nxt = ev[i + 1] if i + 1 < len(ev) else None
            tn = nxt[0] if nxt else t1
            if kind == "add":
                acc(t, tn, f"queued on model {m}")
            elif kind == "recv":
                acc(t, tn, f"queued on model {m}")
            elif kind == "final":
                acc(t, tn, "front end (finished -> next request)")
            else:
                acc(t, te, f"executing on model {m}")
                if nxt is None:
                    continue
                if nxt[1] == "step" and nxt[2] == m:
                    acc(te, tn, f"queued on model {m}")
                elif nxt[1] in ("recv", "final"):
                    ob = busy_overlap(nxt[2], te, tn)
                    acc(te, te + ob, "in transit, receiver inside a step")
                    acc(te + ob, tn, "in transit, receiver not inside a step")
                    if t0 <= te and tn <= t1:
                        free_delays.append(1e3 * ((tn - te) - ob))
                else:
                    acc(te, tn, "front end (finished -> next request)")
    w = t1 - t0
    free_delays.sort()
    q = (lambda f: free_delays[min(len(free_delays) - 1, int(f * len(free_delays)))]) if free_delays else None
    return {"window_s": w, "mean_requests": {k: v / w for k, v in sorted(tot.items())},
            "sum": sum(tot.values()) / w,
            "handoff_delay_to_free_receiver_ms": None if q is None else
            {"p50": q(0.5), "p90": q(0.9), "max": free_delays[-1], "n": len(free_delays)}}


def run(args) -> dict:
    fits, _ = latency_setting(args.latency)
    flags = SYSTEMS[args.system]
    ts = (list(args.thresholds) if args.thresholds else
          chosen_thresholds(args.algorithm, fits, args.concurrency, args.prompt_len + args.max_tokens / 2)) \
        if flags["mode"] == "delayed_async" else None
    trace_dir = tempfile.mkdtemp(prefix="tp-trace-")
    os.environ["TOKENPLANE_TRACE_DIR"] = trace_dir
    prof_dir = None
    if args.profile:
        prof_dir = tempfile.mkdtemp(prefix="tp-prof-")
        os.environ["TOKENPLANE_PROFILE_DIR"] = prof_dir
    out: dict = {"algorithm": args.algorithm, "system": args.system, "concurrency": args.concurrency,
                 "thresholds": ts, "latency": args.latency, "profiled": bool(args.profile),
                 "loadavg_before": loadavg()}
    try:
        with make_runtime(seed_models(fits), args.algorithm, flags, args.concurrency, ts) as rt:
            pids = {"front end + clients": os.getpid()} | {f"model {m}": p for m, p in enumerate(rt.pids)}
            cpu: dict = {}
            window: list[float] = []

            def sampler() -> None:
                time.sleep(args.warmup + 0.2)
                window.append(time.perf_counter())
                t = time.monotonic()
                c0 = {k: _cpu_s(p) for k, p in pids.items()}
                me = os.getpid()
                th0 = {tid: _cpu_s(me, int(tid)) for tid in os.listdir(f"/proc/{me}/task")}
                time.sleep(max(0.5, args.duration - 0.4))
                dt = time.monotonic() - t
                window.append(time.perf_counter())
                cpu["process_cores"] = {k: (_cpu_s(p) - c0[k]) / dt for k, p in pids.items()}
                threads = {}
                for tid, c in th0.items():
                    try:
                        name = open(f"/proc/{me}/task/{tid}/comm").read().strip()
                        threads[f"{name}:{tid}"] = (_cpu_s(me, int(tid)) - c) / dt
                    except OSError:
                        pass
                cpu["front_end_thread_cores"] = {k: v for k, v in threads.items() if v > 0.001}
            th = threading.Thread(target=sampler)
            th.start()
            res = closed_loop(rt, args.concurrency, duration_s=args.duration, warmup_s=args.warmup,
                              max_tokens=args.max_tokens, prompt_len=args.prompt_len)
            th.join()
        # the sub-servers dump their traces (and profiles) when they exit
        out.update(throughput=res["throughput"], user_speed=res["user_speed"], latency_mean_s=res["latency_mean_s"],
                   window_counters=res["window_counters"], cpu=cpu, loadavg_after=loadavg())
        out["occupancy"] = trace_occupancy(trace_dir, window[0], window[1])
        if prof_dir:
            import io
            import pstats
            out["profile_top"] = {}
            for f in sorted(glob.glob(f"{prof_dir}/*.prof")):
                s = io.StringIO()
                pstats.Stats(f, stream=s).sort_stats("tottime").print_stats(12)
                out["profile_top"][Path(f).stem] = s.getvalue().split("\n", 6)[-1]
    finally:
        os.environ.pop("TOKENPLANE_TRACE_DIR", None)
        os.environ.pop("TOKENPLANE_PROFILE_DIR", None)
    return out


def render(all_runs: dict) -> str:
    md = ["# Runtime overhead against the throughput model (latency-model backend, seed scale)\n\n",
          "One traced closed-loop run per configuration; numbers are for the steady-state window (after warm-up, "
          "before the drain). CPU = cores used (1.0 = one full core of the 2). Occupancy = mean number of requests "
          "in each state (sums to the concurrency). A handoff sent to a model that is inside a step waits for the "
          "step to end (the throughput model counts that as queueing); the delay to a receiver that is NOT inside a "
          "step is transport plus wake-up, which the model assumes to be zero.\n"]
    for key, r in all_runs.items():
        md.append(f"\n## {key}\n\n")
        md.append(f"{r['throughput']:.0f} committed tok/s, single-user {r['user_speed']:.1f} tok/s, thresholds "
                  f"{r['thresholds']}, load average {r['loadavg_before']} -> {r.get('loadavg_after')}"
                  f"{', under cProfile (slower)' if r.get('profiled') else ''}.\n\n")
        md.append(md_table(["process", "CPU cores"], [[k, f"{v:.3f}"] for k, v in r["cpu"]["process_cores"].items()]))
        md.append("\n")
        md.append(md_table(["model", "steps", "mean batch", "runner", "rest of step", "idle", "loop elsewhere",
                            "runner ms/step", "busy outside runner ms/step"],
                           [[w["model"], w["steps"], f"{w['mean_batch']:.2f}", f"{w['runner_share']:.1%}",
                             f"{w['step_overhead_share']:.1%}", f"{w['idle_share']:.1%}", f"{w['other_share']:.1%}",
                             f"{w['runner_ms_per_step']:.2f}", f"{w['busy_outside_runner_ms_per_step']:.2f}"]
                            for w in r["window_counters"] or []]))
        occ = r["occupancy"]
        md.append("\n")
        md.append(md_table(["request state", "mean requests"],
                           [[k, f"{v:.2f}"] for k, v in occ["mean_requests"].items()] + [["sum", f"{occ['sum']:.2f}"]]))
        d = occ.get("handoff_delay_to_free_receiver_ms")
        if d:
            md.append(f"\nHandoff delivery delay to a receiver not inside a step: P50 {d['p50']:.2f} ms, P90 "
                      f"{d['p90']:.2f} ms, max {d['max']:.2f} ms (n = {d['n']}).\n")
        for name, txt in (r.get("profile_top") or {}).items():
            md.append(f"\n<details><summary>cProfile {name}</summary>\n\n```\n{txt}\n```\n</details>\n")
    return "".join(md)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--algorithm", default="r2r")
    ap.add_argument("--system", default="ours", choices=list(SYSTEMS))
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--thresholds", type=int, nargs="*", default=None)
    ap.add_argument("--latency", default="seed-r2r")
    ap.add_argument("--duration", type=float, default=4.0)
    ap.add_argument("--warmup", type=float, default=0.5)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--out", default="overhead")
    args = ap.parse_args(argv)
    r = run(args)
    r["command"] = "python benchmarks/routing/overhead.py " + " ".join(argv if argv is not None else sys.argv[1:])
    path = RESULTS / f"{args.out}.json"
    all_runs = json.loads(path.read_text()) if path.exists() else {}
    key = f"{args.algorithm} / {args.system} / C={args.concurrency} / T={r['thresholds']}" + (
        " / cProfile" if args.profile else "")
    all_runs[key] = r
    path.write_text(json.dumps(all_runs, indent=1))
    (RESULTS / f"{args.out}.md").write_text(render(all_runs))
    print(render({key: r}))
    return r


if __name__ == "__main__":
    main()
