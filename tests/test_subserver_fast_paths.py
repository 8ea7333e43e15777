"""The runtime's sub-servers build their model through route/subserver.build_runner: on CPU fp32 that runner must take
the engine's fast paths (panel-packed linears for cpu_small_gemm, the compiled decode-attention kernel, the fused add+RMSNorm, glibc
keeping freed memory), the same ones the engine benchmarks measure, so routing benchmarks measure the current engine;
and the routers' own logit kernel (R-Stitch's entropy) is compiled before the first request."""
from __future__ import annotations

import torch

from tokenplane.engine import cpu_malloc
from tokenplane.engine.cpu_fused_norm import fused_norm_applies
from tokenplane.route.subserver_spec import SubServerSpec, build_runner


def test_subserver_runner_takes_the_cpu_fast_paths(monkeypatch) -> None:
    from tokenplane.route import subserver_spec
    warmed: list[bool] = []
    real_warm = subserver_spec.warm_signal_kernels
    monkeypatch.setattr(subserver_spec, "warm_signal_kernels", lambda: warmed.append(True) or real_warm())
    spec = SubServerSpec(model=0, num_models=2, source="tiny-small", frontend="", generation="", dtype="float32",
                         num_blocks=16)
    runner, model = build_runner(spec)
    assert warmed == [True]
    assert runner.cpu_packed is True
    linears = [m for m in model.modules() if getattr(m, "cpu_panels", None) is not None]   # fp32: the kernel's copy
    assert len(linears) == 4 * len(model.model.layers)   # qkv, o, gate_up, down per layer
    assert runner.decode_kernel == "cpu"
    inner = model.model
    assert inner.fused_norm and fused_norm_applies(torch.zeros(2, inner.norm.weight.shape[0]), inner.norm.weight)
    assert cpu_malloc._applied is not None   # retain_freed_memory ran in this process (a no-op off glibc)
    from tokenplane.route import entropy as entropy_module
    # the routers' logit kernel for the steps' float32 logits is ready before the first request (the float64 kernel,
    # `_entropy`, is compiled only if another test in this process used it: not this test's concern)
    assert entropy_module._entropy32.signatures
