"""Where one LLMEngine decode step's time goes at small batch: scheduler, runner input prep, each GEMM kind, attention
(KV write + paged kernel), norms, rope/qk-norm, SwiGLU, vocabulary projection, sampling, postprocess.

The engine is built as engine_vs_vllm.py's worker builds it (1 thread; pin it with taskset). A prompt of P tokens is
prefilled, then `--steps` greedy decode steps run twice: bare (the step time) and with perf_counter wrappers around
the parts (the split; the wrappers add ~0.3 us a call, reported as the difference). GEMMs are also set against their
weight-stream time at `--gbps` (a measured plain-sum bandwidth, printed by this script: `--measure-bw`).

    PYTHONPATH=. taskset -c 1 python benchmarks/peers/decode_breakdown.py --model /tmp/tokenplane-peer-models/tiny-small
"""
from __future__ import annotations

import argparse
import resource
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

from tokenplane.engine import LLMEngine, SamplingParams, layers
from tokenplane.engine import attention as attention_mod
from tokenplane.engine import engine as engine_mod
from tokenplane.engine.models import qwen3

TIMES: dict[str, float] = defaultdict(float)
COUNTS: dict[str, int] = defaultdict(int)
BYTES: dict[str, int] = defaultdict(int)


def timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*a: Any, **k: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            TIMES[name] += time.perf_counter() - t0
            COUNTS[name] += 1
    return wrapper


def instrument(eng: LLMEngine) -> None:
    model = eng.runner.model
    for name, mod in model.named_modules():
        if isinstance(mod, layers.Linear):
            kind = name.rsplit(".", 1)[-1]
            if mod is model.lm_head:
                continue
            mod.forward = timed(f"gemm {kind}", mod.forward)   # type: ignore[method-assign]
            BYTES[f"gemm {kind}"] += mod.weight.numel() * mod.weight.element_size()
    if model.vocab_projection is not None:
        vp = model.vocab_projection
        vp.__class__ = type("TimedProjection", (type(vp),), {"__call__": timed("gemm lm_head", type(vp).__call__)})
        if hasattr(model, "greedy_tokens"):   # the greedy screen replaces the projection on greedy steps
            model.greedy_tokens = timed("gemm lm_head (greedy screen)", model.greedy_tokens)
        BYTES["gemm lm_head"] += model.vocab_weight().numel() * 4
    # the compiled decode stack (cpu_decode_stack): its kernels are module globals there
    from tokenplane.engine import cpu_decode_stack as cds
    stack = cds.stack_for(model.model)
    if stack is not None:
        names = {}
        for L in stack.layers:
            for kind, lin in (("qkv_proj", L.qkv), ("o_proj", L.o), ("gate_up_proj", L.gate_up), ("down_proj", L.down)):
                names[id(lin)] = f"gemm {kind}"
        matmul = cds._matmul

        def kinded(x: Any, lin: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return matmul(x, lin)
            finally:
                TIMES[names[id(lin)]] += time.perf_counter() - t0
                COUNTS[names[id(lin)]] += 1
        cds._matmul = kinded
        stack.qkv_rope = timed("qk-norm+rope+kv write (fused)", stack.qkv_rope)
        cds._add_rms_norm = timed("norm (fused add+rms)", cds._add_rms_norm)
        cds._silu_mul = timed("swiglu silu*mul (silu)", cds._silu_mul)
        # the stack takes the bf16 kernels from io_kernels (AVX-512 or AMX panels): time the SwiGLU of either
        io_kernels = cds.cpu_bf16_gemv.io_kernels
        swiglu_timed = {amx: timed("gemm gate_up_proj + silu*mul (bf16 panels)", io_kernels(amx)[1])
                        for amx in (False, True)}
        cds.cpu_bf16_gemv.io_kernels = lambda amx: (io_kernels(amx)[0], swiglu_timed[amx])   # type: ignore[assignment]
        kernel_for = cds.decode_kernel
        cds.decode_kernel = lambda *a: timed("attention kernel", kernel_for(*a))   # type: ignore[assignment]
        cds.DecodeStack.forward = timed("decoder stack (compiled path)", cds.DecodeStack.forward)
    model.compute_logits = timed("logits (compute_logits)", model.compute_logits)   # type: ignore[method-assign]
    qwen3.add_rms_norm_ = timed("norm (fused add+rms)", qwen3.add_rms_norm_)
    qwen3.rms_norm = timed("qk rms_norm", qwen3.rms_norm)
    qwen3.apply_rope = timed("rope apply", qwen3.apply_rope)
    qwen3.cpu_qkv_rope.qkv_rope_write = timed("qk-norm+rope+kv write (fused)", qwen3.cpu_qkv_rope.qkv_rope_write)
    layers.F.silu = timed("swiglu silu*mul (silu)", layers.F.silu)
    attention_mod.paged_decode = timed("attention kernel", attention_mod.paged_decode)
    model.model.rotary.forward = timed("rope cos/sin", model.model.rotary.forward)
    model.model.embed_tokens.forward = timed("embedding", model.model.embed_tokens.forward)
    for layer in model.model.layers:
        layer.self_attn.attn.forward = timed("attention total (kv write+kernel)", layer.self_attn.attn.forward)
        layer.self_attn.attn.attend = timed("attention read (attend)", layer.self_attn.attn.attend)
    model.forward = timed("model forward", model.forward)
    eng.runner._metadata = timed("runner metadata", eng.runner._metadata)   # type: ignore[method-assign]
    eng.runner.run = timed("runner.run", eng.runner.run)   # type: ignore[method-assign]
    eng.scheduler.schedule = timed("scheduler.schedule", eng.scheduler.schedule)   # type: ignore[method-assign]
    eng.scheduler.postprocess = timed("scheduler.postprocess", eng.scheduler.postprocess)   # type: ignore
    engine_mod.sample = timed("sample", engine_mod.sample)


def measure_bw(mb: int = 256) -> float:
    x = torch.ones(mb * 2**20 // 4)
    best = 1e9
    for _ in range(5):
        t0 = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t0)
    return x.numel() * 4 / best / 1e9


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--batch", type=int, default=1, help="concurrent requests decoding together (N)")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--bare", action="store_true", help="step times only (runs on any tree: no instrumentation)")
    ap.add_argument("--ab", action="store_true", help="also time steps with the model's decode_stack off, alternated")
    ap.add_argument("--gbps", type=float, default=0.0, help="0: measure the plain-sum bandwidth here")
    args = ap.parse_args()
    n_req = args.batch
    # Prefill is chunked at 2,048 tokens a step, and a request decodes while the ones after it are prefilled: at
    # P = 2048 the first of N gets ~N tokens before the last is prefilled. Room for those, so no request finishes
    # (and the batch shrinks) before the measured steps end.
    max_tokens = 4 * args.steps + 8 + n_req * max(1, -(-args.prompt_len // 2048))
    eng = LLMEngine(args.model, dtype=getattr(torch, args.dtype),
                    num_blocks=n_req * (-(-(args.prompt_len + max_tokens + 64) // 16) + 1) + 8,
                    block_size=16, max_num_seqs=n_req, max_num_batched_tokens=2048, enforce_eager=True, num_threads=1)
    gbps = args.gbps or (1.0 if args.bare else measure_bw())
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for r in range(n_req):
        eng.add_request([(7 * t + 13 * r) % 30000 + 10 for t in range(args.prompt_len)], params)
    while any(s.num_output_tokens < 4 for s in eng.scheduler.running) or eng.scheduler.waiting:
        eng.step()   # prefill (chunked at 2,048 tokens a step) and a few decode steps
    bare, bare_cpu, faults = [], [], []
    for _ in range(args.steps):
        t0, c0, f0 = time.perf_counter(), time.process_time(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        eng.step()
        bare.append((time.perf_counter() - t0) * 1e3)
        bare_cpu.append((time.process_time() - c0) * 1e3)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
    if args.bare:
        print(f"bare {args.model} P={args.prompt_len} N={n_req}: step median {statistics.median(bare):.3f} ms, P90 "
              f"{sorted(bare)[int(0.9 * (len(bare) - 1))]:.3f} ms, cpu median {statistics.median(bare_cpu):.3f} ms")
        return
    if args.ab:
        inner = eng.runner.model.model
        ab: dict[bool, list[float]] = {True: [], False: []}
        ab_cpu: dict[bool, list[float]] = {True: [], False: []}
        for i in range(2 * args.steps):
            flag = (i // 5) % 2 == 0
            inner.decode_stack = flag
            t0, c0 = time.perf_counter(), time.process_time()
            eng.step()
            ab[flag].append((time.perf_counter() - t0) * 1e3)
            ab_cpu[flag].append((time.process_time() - c0) * 1e3)
        inner.decode_stack = True
        for flag in (False, True):
            print(f"A/B decode_stack={flag}: step median {statistics.median(ab[flag]):.3f} ms, cpu "
                  f"{statistics.median(ab_cpu[flag]):.3f} ms")
    instrument(eng)
    TIMES.clear()
    COUNTS.clear()
    wrapped = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        eng.step()
        wrapped.append((time.perf_counter() - t0) * 1e3)
    n = args.steps
    step = statistics.median(bare)
    print(f"model {args.model}  P={args.prompt_len}  N={n_req} (rows in the last step: "
          f"{len(eng.scheduler.running)})  plain-sum bandwidth {gbps:.1f} GB/s")
    print(f"step (bare) median {step:.3f} ms  cpu {statistics.median(bare_cpu):.3f} ms  minor page faults "
          f"{statistics.median(faults):.0f}   wrapped median {statistics.median(wrapped):.3f} ms "
          f"(mean {statistics.mean(wrapped):.3f})")
    print(f"{'part':40s} {'ms/step':>8s} {'calls':>6s} {'share':>6s} {'stream ms':>9s}")
    total = statistics.mean(wrapped)
    for k in sorted(TIMES, key=lambda k: -TIMES[k]):
        ms = TIMES[k] / n * 1e3
        roof = f"{BYTES[k] / gbps / 1e6:9.3f}" if k in BYTES else ""
        print(f"{k:40s} {ms:8.3f} {COUNTS[k] // n:6d} {ms / total:6.1%} {roof}")
    gemm = sum(v for k, v in TIMES.items() if k.startswith("gemm")) / n * 1e3
    print(f"{'all GEMMs':40s} {gemm:8.3f}        {gemm / total:6.1%} {sum(BYTES.values()) / gbps / 1e6:9.3f}")


if __name__ == "__main__":
    main()
