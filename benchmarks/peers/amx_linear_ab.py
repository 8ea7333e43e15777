"""bf16 linears at decode and prefill row counts: cpu_amx's tile kernel vs oneDNN's packed linear (the engine's path
past cpu_bf16_gemv.MAX_ROWS), SmolLM2-135M's four linear shapes x L layers of random weights, alternated in one
process, medians of 5. Needs a host with AMX-BF16 (cpu_amx.HOST_AMX).

    PYTHONPATH=. taskset -c 1 python benchmarks/peers/amx_linear_ab.py 30 1 16 32 64 256
(first argument: layers; the rest: row counts)
"""
from __future__ import annotations

import sys
import time

import numpy as np
import torch

from tokenplane.engine import cpu_amx
from tokenplane.engine.layers import cpu_pack

SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)]     # (K, N): qkv, o, gate_up, down


def main() -> None:
    torch.set_num_threads(1)
    if not cpu_amx.HOST_AMX:
        sys.exit("no AMX-BF16 on this host (or TOKENPLANE_AMX=0)")
    layers = int(sys.argv[1]) if len(sys.argv) > 1 else 30
    row_counts = [int(a) for a in sys.argv[2:]] or [1, 16, 17, 32, 48, 64, 256, 512]
    weights = [[torch.randn(n, k).bfloat16() for _ in range(layers)] for k, n in SHAPES]
    packed = [[cpu_pack(w) for w in ws] for ws in weights]
    tiles = [[cpu_amx.pack(w).reshape(-1) for w in ws] for ws in weights]
    wbytes = sum(w.numel() * 2 for ws in weights for w in ws)
    for m in row_counts:
        xs = {k: torch.randn(m, k).bfloat16() for k, _ in SHAPES}
        xa = {k: v.view(torch.int16).numpy().view(np.uint16).reshape(-1) for k, v in xs.items()}
        outs = {n: np.empty(m * n, np.float32) for _, n in SHAPES}

        def onednn() -> None:
            for (k, _), ps in zip(SHAPES, packed):
                for p in ps:
                    torch.ops.mkldnn._linear_pointwise(xs[k], p, None, "none", [], "")

        def amx() -> None:
            for (k, n), wps in zip(SHAPES, tiles):
                for wp in wps:
                    cpu_amx.sums(xa[k], m, k, wp, n // 16, outs[n])

        onednn()
        amx()
        pairs = []
        for _ in range(5):
            t = time.perf_counter()
            onednn()
            a = time.perf_counter() - t
            t = time.perf_counter()
            amx()
            pairs.append((a, time.perf_counter() - t))
        a = float(np.median([p[0] for p in pairs]))
        b = float(np.median([p[1] for p in pairs]))
        print(f"rows={m:4d}  oneDNN packed {1e3 * a:7.2f} ms  AMX tiles {1e3 * b:7.2f} ms  oneDNN / AMX {a / b:.2f}  "
              f"AMX {m * wbytes / b / 1e9:6.0f} GFLOP/s  weights {wbytes / 1e6:.0f} MB", flush=True)


if __name__ == "__main__":
    main()
