"""Can R-Stitch's entropy signal be computed faster without changing a routing decision? (issue 16, runtime side)

"reference" here is the runtime's signal until session 28: float32 log_softmax, exp, product and sum over the
vocabulary (~0.4-0.8 ms per row at V = 151,936 on one core). A one-pass kernel (max, then exp by a float32 polynomial
with float64 sums; here, not in tokenplane) is far more accurate, but a decision may use a value that differs from the
reference only where it is certainly on the same side of the threshold: farther than the reference's own float32
error. (Session 28 replaced the signal itself instead: StepResult.normalized_entropy is now route/entropy.py's
compiled pass (float64 sums), row "runtime", used by the reference router and the runtime alike.) This measures:
  1. per-row cost: reference, the same ops with the product in place (bit-identical), the one-pass kernel;
  2. the reference's error against float64 on random rows (scales 0.01-100) and on structured rows (k tied maxima over
     a flat tail: the float32 sums' rounding errors all point the same way), and the kernel's;
  3. the spread of calibrated R-Stitch signals on the tiny pair (warm-up of the reference router), and the share of
     rows that would fall within a margin of the thresholds (and so need the reference anyway).

    flock /tmp/bench.lock env PYTHONPATH=. python benchmarks/peers/entropy_signal.py \\
        --thresholds '{"switch": 0.9956967256402198, "return": 0.9911598401890372}' \\
        --out benchmarks/routing/results/entropy_signal
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from numba import njit

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

V = 151936
_CHUNK = 512
_LO = -87.33654      # exp underflows float32 below this


@njit(cache=True, nogil=True, fastmath={"reassoc", "contract"})
def _block(x, start, end, m, d, p, bits):  # noqa: ANN001
    """(sum e, sum e * d) over x[start:end] in float64, e = exp(d), d = x - m (float32, Cephes expf polynomial)."""
    n = end - start
    for i in range(n):
        di = x[start + i] - m
        d[i] = di
        dc = max(di, np.float32(_LO))
        k = np.floor(dc * np.float32(1.4426950408889634) + np.float32(0.5))
        r = dc - k * np.float32(0.693359375) - k * np.float32(-2.12194440e-4)
        q = ((((np.float32(1.9875691500e-4) * r + np.float32(1.3981999507e-3)) * r
               + np.float32(8.3334519073e-3)) * r + np.float32(4.1665795894e-2)) * r
             + np.float32(1.6666665459e-1)) * r + np.float32(5.0000001201e-1)
        p[i] = q * r * r + r + np.float32(1.0)
        bits[i] = (np.int32(k) + np.int32(127)) << np.int32(23)
    scale = bits.view(np.float32)
    s = 0.0
    t = 0.0
    for i in range(n):
        di = d[i]
        e = np.float32(0.0) if di < np.float32(_LO) else p[i] * scale[i]
        s += np.float64(e)
        t += np.float64(e) * np.float64(di)
    return s, t


@njit(cache=True, nogil=True)
def _entropy(x, m):  # noqa: ANN001
    d = np.empty(_CHUNK, np.float32)
    p = np.empty(_CHUNK, np.float32)
    bits = np.empty(_CHUNK, np.int32)
    s = 0.0
    t = 0.0
    for start in range(0, x.shape[0], _CHUNK):
        bs, bt = _block(x, start, min(start + _CHUNK, x.shape[0]), m, d, p, bits)
        s += bs
        t += bt
    return math.log(s) - t / s


def one_pass(x: torch.Tensor) -> float:
    return float(_entropy(x.numpy(), np.float32(float(x.max())))) / math.log(x.shape[0])


def reference(x: torch.Tensor) -> float:
    """The runtime's signal until session 28 (torch, float32): what the results before then call the reference."""
    logp = torch.log_softmax(x, dim=-1)
    return float(-(logp.exp() * logp).sum()) / math.log(x.shape[0])


def runtime(x: torch.Tensor) -> float:
    """StepResult.normalized_entropy today: tokenplane/route/entropy.py's compiled pass (float32 exponentials for float32 logits, float64 sums)."""
    from tokenplane.route.api import StepResult
    return StepResult("r", 0, 0, 0, x).normalized_entropy()


def in_place(x: torch.Tensor) -> float:
    logp = torch.log_softmax(x, dim=-1)
    p = logp.exp()
    return float(-p.mul_(logp).sum()) / math.log(x.shape[0])


def float64(x: torch.Tensor) -> float:
    logp = torch.log_softmax(x.double(), -1)
    return float(-(logp.exp() * logp).sum()) / math.log(x.shape[0])


def costs(reps: int) -> dict[str, dict[str, float]]:
    rows = list(torch.randn(16, V, generator=torch.Generator().manual_seed(0)) * 0.05)
    for x in rows:
        assert in_place(x) == reference(x)
        one_pass(x)   # compiles (or loads) the kernels before any timing
        runtime(x)
    fns = {"reference": reference, "in_place": in_place, "one_pass": one_pass, "runtime": runtime}
    got: dict[str, list[float]] = {k: [] for k in fns}
    for r in range(reps):
        for name in (list(fns) if r % 2 else list(fns)[::-1]):   # alternated
            t = time.perf_counter()
            for x in rows:
                fns[name](x)
            got[name].append((time.perf_counter() - t) / len(rows) * 1e3)
    return {k: {"min_ms": min(v), "median_ms": statistics.median(v)} for k, v in got.items()}


def errors() -> dict[str, Any]:
    g = torch.Generator().manual_seed(1)
    random = []
    for scale in (0.01, 0.1, 0.3, 1, 2, 3, 4, 5, 8, 20, 100):
        x = torch.randn(V, generator=g) * scale
        t = float64(x)
        random.append({"scale": scale, "h": t, "reference_err": abs(reference(x) - t), "one_pass_err": abs(one_pass(x) - t),
                       "runtime_err": abs(runtime(x) - t)})
    tied = []
    for k in (1, 2, 10, 100, 1000):
        for c in (1.0, 3.0, 5.0, 6.5, 8.0, 12.0):
            x = torch.zeros(V)
            x[:k] = c
            t = float64(x)
            tied.append({"k": k, "c": c, "h": t, "reference_err": abs(reference(x) - t),
                         "one_pass_err": abs(one_pass(x) - t), "runtime_err": abs(runtime(x) - t)})
    return {"random": random, "tied": tied}


def spread(thresholds: dict[str, float], prompts_n: int, tokens: int, models_dir: str) -> dict[str, Any]:
    from routing_vs_vllm import PAIRS, load_prompts

    from tokenplane.engine.sampler import SamplingParams
    from tokenplane.route.algorithms import make_algorithm
    from tokenplane.route.reference import warmup_signals
    dirs = [str(Path(models_dir) / m) for m in PAIRS["tiny"][0]]
    alg = make_algorithm("r_stitch", mode="calibrated")
    sig = warmup_signals(alg, dirs, load_prompts(600, 256)[100:100 + prompts_n],
                         SamplingParams(max_tokens=tokens, ignore_eos=True), dtype=torch.float32, num_blocks=512)
    out = {}
    for gate, t in thresholds.items():
        v = sig[gate]
        out[gate] = {"n": len(v), "min": min(v), "max": max(v), "threshold": t,
                     "within": {str(m): sum(abs(x - t) <= m for x in v) / len(v) for m in (1e-6, 1e-5, 1e-4, 1e-3)}}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--thresholds", type=json.loads, required=True, help="calibrated R-Stitch thresholds, JSON")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--models-dir", default="/tmp/tokenplane-peer-models")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)
    load = os.getloadavg()
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    res = {"command": "python " + " ".join(sys.argv), "started": started, "load_before": load,
           "costs": costs(args.reps), "errors": errors(),
           "spread": spread(args.thresholds, args.prompts, args.tokens, args.models_dir), "load_after": os.getloadavg()}
    Path(f"{args.out}.json").write_text(json.dumps(res, indent=1))
    c, e, s = res["costs"], res["errors"], res["spread"]
    ref_rand = max(r["reference_err"] for r in e["random"])
    ref_tied = max(r["reference_err"] for r in e["tied"])
    one = max(r["one_pass_err"] for r in e["random"] + e["tied"])
    rt = max(r["runtime_err"] for r in e["random"] + e["tied"])
    lines = ["# R-Stitch entropy signal: cost, the reference's float32 error, calibrated signal spread", "",
             f"Command: `{res['command']}`  ", f"{started}; load average before {[round(x, 2) for x in load]}, after "
             f"{[round(x, 2) for x in res['load_after']]}; 1 thread; V = {V}.", "",
             "| computation | ms per row (min / median of alternated reps, 16 rows each) |", "|---|---:|"]
    lines += [f"| {k} | {v['min_ms']:.3f} / {v['median_ms']:.3f} |" for k, v in c.items()]
    lines += ["", f"Error against float64 (normalized entropy): reference up to {ref_rand:.2e} on random rows, up to "
              f"{ref_tied:.2e} on tied-maxima rows; one-pass kernel up to {one:.2e} on all of them; the runtime's "
              f"(route/entropy.py) up to {rt:.2e}.", "",
              "| gate | warm-up signals | min | max | threshold | share within 1e-6 / 1e-5 / 1e-4 / 1e-3 |",
              "|---|---:|---:|---:|---:|---|"]
    for gate, d in s.items():
        w = " / ".join(f"{x:.2f}" for x in d["within"].values())
        lines.append(f"| {gate} | {d['n']} | {d['min']:.6f} | {d['max']:.6f} | {d['threshold']:.6f} | {w} |")
    Path(f"{args.out}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
