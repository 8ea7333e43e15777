"""Measure real ModelRunner decode-step latency on this CPU over batch x context, and fit LatencyFit per model.

The fits feed the latency-model backend ("cpu-measured" latencies in threshold_validation.py / serving.py) and the
throughput model. Each point: `batch` sequences of `context` prompt tokens are prefilled, then `--steps` decode
steps (one new token per sequence) are timed; the MINIMUM is kept: the machine is shared (2 cores, other jobs), and
contention only ever adds time, so the minimum is the best estimate of an uncontended step (the median is recorded).

    python benchmarks/routing/cpu_latency.py [--models tiny-small tiny-large] [--quick]
    python benchmarks/routing/cpu_latency.py --mixed [--models tiny-small tiny-large smollm2-135m-instruct]

--core N pins the process to one core (what each runtime sub-server gets in the real-engine runs of
threshold_validation.py --backend torch); with --threads 1 the fit is the latency of one pinned single-thread
sub-server. Fits written to another --out than cpu_latency.json carry `d` (per catch-up token) and `mixed` from
cpu_latency.json's --mixed measurement of the same model (measured on the same engine, thread CPU time), since
decode-only steps cannot measure them.

--background (with --core and two --models): while one model is measured, the other runs decode steps
(--background-batch sequences, 1 thread) on the next core, as the runtime's two sub-servers run side by side. On this
machine decode is bound by memory bandwidth (tiny-large's lm_head alone is 311 MB fp32 per step), which the two
cores share, so a model measured alone is faster than the same model in the runtime.

--mixed measures the mixed-batch penalty the latency model's `mixed` factor stands for: a batch of b sequences where
one sequence computes k > 1 tokens (a catch-up or re-admission) against a decode-only batch of the same b, on the
same sequences, the three kinds (decode, k = 2, k = 10) interleaved in rotating order so drift and contention hit
each alike, 1 thread, timed in thread CPU time (the box is shared; CPU time of a single-threaded step is what an idle
machine's wall time would be). Per b: d = (L(k=10) - L(k=2)) / 8 per extra token, mixed = (L(k=2) - d) / L(decode):
the fixed penalty of leaving the decode-only path, separated from the per-token cost. The fits in cpu_latency.json
get the median over b of `mixed` (and SmolLM2 a decode fit of its own from the same steps).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tokenplane.engine.latency_runner import LatencyFit  # noqa: E402

OUT = Path(__file__).resolve().parent / "results"


def measure(model_name: str, batches: list[int], contexts: list[int], steps: int) -> list[dict]:
    from tokenplane.engine.loader import load_model
    from tokenplane.engine.model_runner import ModelRunner
    from tokenplane.engine.sequence import Sequence

    cfg, model = load_model(model_name, seed=0)
    need = max(batches) * (max(contexts) + steps + 16) // 16 + 8
    runner = ModelRunner(model, cfg, num_blocks=need, block_size=16)
    out = []
    for ctx in contexts:
        for b in batches:
            seqs = [Sequence(f"{model_name}-{ctx}-{b}-{i}", [(31 * i + 7 * j) % 1000 + 1 for j in range(ctx)])
                    for i in range(b)]
            for s in seqs:
                assert runner.prepare(s)
            runner.run(seqs)  # prefill, not timed
            times = []
            for k in range(steps):
                for s in seqs:
                    s.append_token(5 + k)
                    runner.prepare(s)
                t = time.perf_counter()
                runner.run(seqs)
                times.append(time.perf_counter() - t)
            for s in seqs:
                runner.free(s)
            med = statistics.median(times)
            out.append({"model": model_name, "batch": b, "context": ctx, "latency_s": min(times),
                        "median_s": med, "steps": steps})
            print(f"{model_name:>11} ctx {ctx:5d} batch {b:3d}: min {min(times) * 1e3:8.2f} ms, "
                  f"median {med * 1e3:8.2f} ms", flush=True)
    return out


def _background(model_name: str, core: int, batch: int, ready, stop) -> None:
    """Child process: decode steps of `batch` sequences of `model_name` on `core`, 1 thread, until `stop` is set."""
    import os
    os.sched_setaffinity(0, {core})
    torch.set_num_threads(1)
    from tokenplane.engine.loader import load_model
    from tokenplane.engine.model_runner import ModelRunner
    from tokenplane.engine.sequence import Sequence
    cfg, model = load_model(model_name, seed=0)
    runner = ModelRunner(model, cfg, num_blocks=batch * 24 + 8, block_size=16)
    ready.set()
    while not stop.is_set():
        seqs = [Sequence(f"bg-{i}", [(13 * i + 5 * j) % 1000 + 1 for j in range(64)]) for i in range(batch)]
        for s in seqs:
            runner.prepare(s)
        runner.run(seqs)
        for k in range(256):   # contexts 64..320, the range the measured model sees
            if stop.is_set():
                break
            for s in seqs:
                s.append_token(5 + k % 50)
                runner.prepare(s)
            runner.run(seqs)
        for s in seqs:
            runner.free(s)


class Background:
    """The other model stepping on another core while `with` runs (None model: nothing)."""

    def __init__(self, model_name: str | None, core: int, batch: int) -> None:
        self.model_name, self.core, self.batch, self.proc = model_name, core, batch, None

    def __enter__(self) -> Background:
        if self.model_name is not None:
            import multiprocessing as mp
            ctx = mp.get_context("spawn")
            self.ready, self.stop = ctx.Event(), ctx.Event()
            self.proc = ctx.Process(target=_background, args=(self.model_name, self.core, self.batch, self.ready,
                                                              self.stop), daemon=True)
            self.proc.start()
            if not self.ready.wait(300):
                raise RuntimeError("background model did not start")
            time.sleep(0.5)   # its first steps (kernel compilation) before the timed ones
        return self

    def __exit__(self, *exc) -> None:
        if self.proc is not None:
            self.stop.set()
            self.proc.join(30)
            if self.proc.is_alive():
                self.proc.kill()


MIXED_KS = (2, 10)


def measure_mixed(model_name: str, batches: list[int], context: int, reps: int) -> list[dict]:
    """Per batch size: thread-CPU-time medians of decode-only steps and of steps where sequence 0 computes k
    tokens (k in MIXED_KS), interleaved; see the module docstring."""
    from tokenplane.engine.loader import load_model
    from tokenplane.engine.model_runner import ModelRunner
    from tokenplane.engine.sequence import Sequence

    cfg, model = load_model(model_name, seed=0)
    grow = reps * (1 + sum(MIXED_KS)) + 16
    runner = ModelRunner(model, cfg, num_blocks=max(batches) * ((context + grow) // 16 + 2) + 8, block_size=16)
    kinds = ["decode"] + [f"k{k}" for k in MIXED_KS]
    out = []
    for b in batches:
        seqs = [Sequence(f"mx-{model_name}-{b}-{i}", [(31 * i + 7 * j) % 1000 + 1 for j in range(context)])
                for i in range(b)]
        for s in seqs:
            assert runner.prepare(s)
        runner.run(seqs)   # prefill, not timed
        runner.run([s for s in seqs if (s.append_token(3) or True) and runner.prepare(s)])   # warm the decode path
        times: dict[str, list[float]] = {k: [] for k in kinds}
        for r in range(reps):
            for j in range(len(kinds)):
                kind = kinds[(r + j) % len(kinds)]   # rotating order
                k0 = 1 if kind == "decode" else int(kind[1:])
                for i, s in enumerate(seqs):
                    for t in range(k0 if i == 0 else 1):
                        s.append_token(5 + (r + t) % 50)
                    runner.prepare(s)
                t0 = time.thread_time()
                runner.run(seqs)
                times[kind].append(time.thread_time() - t0)
        for s in seqs:
            runner.free(s)
        med = {k: statistics.median(v) for k, v in times.items()}
        k_lo, k_hi = MIXED_KS
        d = max(0.0, (med[f"k{k_hi}"] - med[f"k{k_lo}"]) / (k_hi - k_lo))
        mixed = (med[f"k{k_lo}"] - d * (k_lo - 1)) / med["decode"]
        rec = {"model": model_name, "batch": b, "context": context, "reps": reps,
               "decode_s": med["decode"], **{f"k{k}_s": med[f"k{k}"] for k in MIXED_KS},
               "decode_min_s": min(times["decode"]), "d_s_per_token": d, "mixed": mixed,
               "raw_ratio_k2": med[f"k{k_lo}"] / med["decode"]}
        out.append(rec)
        print(f"{model_name:>22} b={b:2d} ctx {context}: decode {med['decode'] * 1e3:7.2f} ms, k={k_lo} "
              f"{med[f'k{k_lo}'] * 1e3:7.2f}, k={k_hi} {med[f'k{k_hi}'] * 1e3:7.2f} -> d {d * 1e3:.3f} ms/token, "
              f"mixed {mixed:.3f}", flush=True)
    return out


def main_mixed(args) -> dict:
    import os

    from tokenplane.engine.latency_runner import LatencyFit
    torch.set_num_threads(1)
    load_before = [round(x, 2) for x in os.getloadavg()]
    t = time.time()
    points = []
    for m in args.models:
        points += measure_mixed(m, args.batches, args.mixed_context, args.mixed_reps)
    res = json.loads(args.out.read_text()) if args.out.exists() else {"device": "cpu", "fits": {}}
    summary = {}
    for m in args.models:
        pts = [p for p in points if p["model"] == m]
        mixed = statistics.median(p["mixed"] for p in pts)
        d = statistics.median(p["d_s_per_token"] for p in pts)
        summary[m] = {"mixed": mixed, "mixed_by_batch": {p["batch"]: p["mixed"] for p in pts}, "d_s_per_token": d}
        if m in res["fits"]:
            res["fits"][m]["mixed"] = mixed
        else:   # a model without an engine_decode fit: knots from these decode-only steps, c and d as measured
            fit = LatencyFit(0.0, 0.0, 0.0, d, f"cpu-{m}", tuple((p["batch"], p["decode_s"]) for p in pts), mixed)
            res["fits"][m] = fit.to_dict() | {"max_rel_error": 0.0, "source": "mixed measurement's decode steps "
                                              f"at context {args.mixed_context} (c not measured: 0)"}
        res["fits"][m]["mixed_source"] = "cpu_latency.py --mixed (median over batch sizes)"
    import platform
    res["mixed"] = {"points": points, "summary": summary, "threads": 1, "timer": "thread CPU time",
                    "command": "python benchmarks/routing/cpu_latency.py " + " ".join(sys.argv[1:]),
                    "loadavg_before": load_before, "loadavg_after": [round(x, 2) for x in os.getloadavg()],
                    "wall_s": round(time.time() - t, 1), "torch": torch.__version__, "machine": platform.machine()}
    args.out.write_text(json.dumps(res, indent=1))
    (args.out.parent / "cpu_mixed.md").write_text(render_mixed(res["mixed"]))
    plot_mixed(res["mixed"], args.out.parent / "cpu_mixed.png")
    return res


def plot_mixed(mx: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.0, 3.8))
    for m in mx["summary"]:
        pts = [p for p in mx["points"] if p["model"] == m]
        ax.plot([p["batch"] for p in pts], [p["mixed"] for p in pts], "o-",
                label=f"{m} (median {mx['summary'][m]['mixed']:.2f})")
    ax.axhline(1.0, color="gray", lw=1)
    ax.axhline(1.71, color="C3", ls=":", lw=1, label="seed preset 1.71 (GPU ablation figure)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size")
    ax.set_ylabel("mixed = (L(k=2) - d) / L(decode)")
    ax.set_title("mixed-batch penalty, this machine's engine (CPU, 1 thread)", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def render_mixed(mx: dict) -> str:
    lines = ["# Mixed-batch penalty on this machine's engine (CPU)\n\n",
             f"Command: `{mx['command']}`; load average before {mx['loadavg_before']}, after {mx['loadavg_after']}; "
             f"{mx['threads']} thread, {mx['timer']}, medians of {mx['points'][0]['reps']} steps per kind, "
             f"kinds interleaved. mixed = (L(k=2) - d) / L(decode), d = (L(k=10) - L(k=2)) / 8.\n\n",
             "| model | batch | context | decode ms | k=2 ms | k=10 ms | d ms/token | mixed | raw k=2 / decode |\n",
             "|---|---|---|---|---|---|---|---|---|\n"]
    for p in mx["points"]:
        lines.append(f"| {p['model']} | {p['batch']} | {p['context']} | {p['decode_s'] * 1e3:.2f} | "
                     f"{p['k2_s'] * 1e3:.2f} | {p['k10_s'] * 1e3:.2f} | {p['d_s_per_token'] * 1e3:.3f} | "
                     f"{p['mixed']:.3f} | {p['raw_ratio_k2']:.3f} |\n")
    lines.append("\nStored in cpu_latency.json fits (`mixed`, median over batch sizes):\n\n| model | mixed |\n|---|---|\n")
    for m, s in mx["summary"].items():
        lines.append(f"| {m} | {s['mixed']:.3f} |\n")
    return "".join(lines)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["tiny-small", "tiny-large"])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--contexts", type=int, nargs="+", default=[128, 512])
    ap.add_argument("--steps", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--core", type=int, default=None, help="pin this process to one core (sched_setaffinity)")
    ap.add_argument("--background", action="store_true", help="the other of two --models steps on the next core "
                    "while one is measured (see module docstring); needs --core")
    ap.add_argument("--background-batch", type=int, default=4)
    ap.add_argument("--fit-stat", choices=["min", "median"], default="min",
                    help="fit the steps' minimum (an uncontended step) or median (the typical step a busy runtime "
                         "sees on a shared machine: what throughput depends on)")
    ap.add_argument("--refit", action="store_true", help="fit --out's stored points again (with --fit-stat)")
    ap.add_argument("--out", type=Path, default=OUT / "cpu_latency.json")
    ap.add_argument("--from-engine", type=Path, default=None,
                    help="fit from the engine helper's engine_decode.json (single-thread CPU-time medians) instead "
                         "of measuring; on a loaded shared machine wall-clock steps are 3-10x inflated")
    ap.add_argument("--mixed", action="store_true", help="measure the mixed-batch penalty (see module docstring) "
                    "and store it in the fits of --out")
    ap.add_argument("--mixed-context", type=int, default=128)
    ap.add_argument("--mixed-reps", type=int, default=9)
    args = ap.parse_args(argv)
    if args.mixed:
        return main_mixed(args)
    if args.from_engine is not None:
        return from_engine(args.from_engine, args.out)
    cmd = "python benchmarks/routing/cpu_latency.py " + " ".join(argv if argv is not None else sys.argv[1:])
    if args.refit:   # the stored points of --out, fitted again with --fit-stat; the measurement's record is kept
        res = json.loads(args.out.read_text())
        res["refit_command"] = cmd
    else:
        res = measure_points(args, cmd)
    res["fit_stat"] = args.fit_stat
    res["fits"] = fit_points(res["points"], args.models, args.out, args.fit_stat)
    res["note"] = ("ModelRunner decode steps (the runtime's torch runner defaults), random-weight presets, "
                   f"wall-clock min (latency_s) and median (median_s) of steps; fitted on the {args.fit_stat}; "
                   "piecewise fit base(batch) + c*batch*context")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1))
    return res


def measure_points(args, cmd: str) -> dict:
    import os
    import platform
    if args.core is not None:
        os.sched_setaffinity(0, {args.core})
    torch.set_num_threads(args.threads)
    load_before, t0 = [round(x, 2) for x in os.getloadavg()], time.time()
    points = []
    background = None
    if args.background:
        if args.core is None or len(args.models) != 2:
            raise SystemExit("--background needs --core and exactly two --models")
        cores = sorted(os.sched_getaffinity(0) | set(range(os.cpu_count() or 1)))
        bg_core = cores[(cores.index(args.core) + 1) % len(cores)]
        background = {"core": bg_core, "batch": args.background_batch,
                      "what": "the other model's decode steps, 1 thread, contexts 64-320"}
    for m in args.models:
        other = next(x for x in args.models if x != m) if background else None
        with Background(other, background["core"] if background else 0, args.background_batch):
            points += measure(m, args.batches, args.contexts, args.steps)
    return {"device": "cpu", "threads": args.threads, "dtype": "float32", "points": points,
            "core": args.core, "background": background, "command": cmd,
            "loadavg_before": load_before, "loadavg_after": [round(x, 2) for x in os.getloadavg()],
            "wall_s": round(time.time() - t0, 1), "torch": torch.__version__, "machine": platform.machine(),
            "measured_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def fit_points(points: list[dict], models: list[str], out: Path, stat: str) -> dict:
    """Piecewise fits per model on the steps' min (latency_s) or median (median_s); d and mixed carried over from
    cpu_latency.json's --mixed measurement when writing another file (decode-only steps cannot measure them)."""
    import dataclasses
    key = "latency_s" if stat == "min" else "median_s"
    carried = {}
    default_out = OUT / "cpu_latency.json"
    if out.resolve() != default_out.resolve() and default_out.exists():
        carried = json.loads(default_out.read_text()).get("mixed", {}).get("summary", {})
    fits = {}
    for m in models:
        pts = [p | {"latency_s": p[key]} for p in points if p["model"] == m]
        fit = LatencyFit.fit_piecewise(pts, name=f"cpu-{m}")
        extra = {}
        if m in carried:
            fit = dataclasses.replace(fit, d=float(carried[m]["d_s_per_token"]), mixed=float(carried[m]["mixed"]))
            extra = {"d_mixed_source": f"{default_out.name} --mixed summary (thread CPU time, same engine)"}
        worst = max(abs(fit(p["batch"], p["context"]) / p["latency_s"] - 1) for p in pts)
        fits[m] = fit.to_dict() | {"max_rel_error": worst} | extra
        knots = ", ".join(f"{k}:{v * 1e3:.1f}" for k, v in fit.knots)
        print(f"fit {m} ({stat}): base ms by batch {{{knots}}} c={fit.c * 1e6:.3f} us/(seq*token) "
              f"d={fit.d * 1e3:.3f} ms/token mixed={fit.mixed:.3f}, max rel err {worst:.1%}")
    return fits


def from_engine(path: Path, out: Path) -> dict:
    """Piecewise fits from engine_decode.json's CPU-time medians; d (per catch-up token) from its catch-up table."""
    import dataclasses

    from tokenplane.engine.latency_runner import fit_from_engine_decode
    data = json.loads(path.read_text())
    fits = fit_from_engine_decode(path, piecewise=True)
    res = {"device": "cpu", "source": str(path), "threads": data.get("meta", {}).get("threads"),
           "note": "piecewise fit base(batch) + c*batch*context of engine_decode.json cpu_median_ms (single-thread "
                   "process CPU time per ModelRunner decode step); d = slope of its catch-up table", "fits": {}}
    for m, fit in fits.items():
        cu = sorted((r["new_tokens"], r["cpu_median_ms"] / 1e3) for r in data.get("catch_up", [])
                    if r.get("model") == m and "cpu_median_ms" in r)
        d = max(0.0, (cu[-1][1] - cu[0][1]) / (cu[-1][0] - cu[0][0])) if len(cu) >= 2 else 0.0
        fit = dataclasses.replace(fit, d=d, name=f"cpu-{m}")
        pts = [r for r in data["results"] if r.get("model") == m]
        worst = max(abs(fit(r["batch"], r["context"]) / (r["cpu_median_ms"] / 1e3) - 1) for r in pts)
        res["fits"][m] = fit.to_dict() | {"max_rel_error": worst}
        knots = ", ".join(f"{k}:{v * 1e3:.1f}" for k, v in fit.knots)
        print(f"fit {m}: base ms by batch {{{knots}}} c={fit.c * 1e6:.3f} us/(seq*token) d={d * 1e3:.3f} ms/token, "
              f"max rel err {worst:.1%}")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
