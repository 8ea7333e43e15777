"""Residual add + RMSNorm in one pass over the rows on CPU (what vLLM's CPU backend runs as fused_add_rms_norm).

Why: in PyTorch ops the pre-norm residual step is six passes over a [T, hidden] buffer (the add, pow, mean, the
rsqrt product, the weight product, plus a temporary for each); a prefill step of 2048 tokens makes that buffer a few
MB, larger than L2, twice per layer. Compiled (numba), each row is added, reduced and scaled while it is in L1.

Numerics: the residual sum `a + x` is the same IEEE add as PyTorch's (bit-identical residual stream). The mean of
squares is summed in a different order (vectorized by LLVM), so the normed rows differ from `rms_norm`'s in the last
bits; the scale is applied as (x * r) * w, transformers' order. bfloat16 follows transformers' bf16 RMSNorm: the
residual sum rounded to bf16, the norm in float32, x * r rounded to bf16, then the weight product rounded to bf16.
"""
from __future__ import annotations

import math

import torch

from tokenplane.engine.cpu_elements import _cast, _load, _narrow, _round, _store, as_array
from tokenplane.engine.numbacache import njit

DTYPES = (torch.float32, torch.float64, torch.bfloat16)


@njit(cache=True, nogil=True, fastmath={"reassoc", "contract", "nsz"})
def _sum_squares(row):  # noqa: ANN001
    s = _cast(0.0, row[0])
    for j in range(row.shape[0]):
        v = _load(row[j])
        s += v * v
    return s


@njit(cache=True, nogil=True)
def _add_rms_norm(a, x, w, eps, out, add):  # noqa: ANN001
    """out[i] = (a[i] (+ x[i] into a[i] when add)) * rsqrt(mean(a[i]^2) + eps) * w; every array 2-D contiguous but
    w (1-D). bf16 (uint16 bits): each step rounded as PyTorch's bf16 ops round it (cpu_elements)."""
    n = a.shape[1]
    for i in range(a.shape[0]):
        ai = a[i]
        like = ai[0]
        if add:
            xi = x[i]
            for j in range(n):
                ai[j] = _store(_load(ai[j]) + _load(xi[j]), like)
        r = _narrow(_cast(1.0, like) / math.sqrt(_sum_squares(ai) / n + _cast(eps, like)), like)
        oi = out[i]
        for j in range(n):
            oi[j] = _store(_load(w[j]) * _round(_load(ai[j]) * r, like), like)


def fused_norm_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (x.device.type == "cpu" and x.dtype in DTYPES and weight.dtype == x.dtype and x.dim() == 2
            and x.is_contiguous() and weight.is_contiguous() and not x.requires_grad)


def add_rms_norm_(a: torch.Tensor, x: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """a += x in place (a becomes the residual stream; skipped when x is None), returns rms_norm(a) * weight in a
    fresh tensor. a, x: [T, hidden] contiguous; check `fused_norm_applies` first."""
    out = torch.empty_like(a)
    an = as_array(a)
    _add_rms_norm(an, an if x is None else as_array(x), as_array(weight.detach()), eps, as_array(out), x is not None)
    return out
