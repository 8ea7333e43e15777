"""From the packed qkv projection to attention inputs on CPU in one compiled pass: per-head q/k RMSNorm (Qwen3;
skipped for Llama), rotary embedding on q and k, K and V written into their paged-cache slots, q into a fresh buffer.

Why: in PyTorch ops this is ~20 dispatched ops per layer (views, a cat of the two norm weights, six for the norm, four
for the rope, two index_copy_ with their transposes, slices), each a few microseconds whatever the size. A decode step
at one row is all overhead there: SmolLM2-135M (30 layers) spent ~3 ms of a ~75 ms step in the rope and the KV writes
alone (benchmarks/peers/decode_breakdown.py). Compiled, it is one call per layer.

Numerics: the rope is transformers' x * cos + rotate_half(x) * sin as `layers.apply_rope` computes it (the sign folded
into the sin), the same two rounded products and one sum per element with no fused multiply-add (numba does not
contract without fastmath), so it is bit-identical to apply_rope. The norm sums the squares in another order than
torch's mean (reassociated into vector lanes) and uses 1 / sqrt instead of rsqrt, so normed values can differ from
`layers.rms_norm`'s in the last bit, as cpu_fused_norm's do. bfloat16 rounds where PyTorch's bf16 ops round (each
norm step, each rope product and the sum; cpu_elements), so its rope is bit-identical to apply_rope in bf16 too.
"""
from __future__ import annotations

import math
from functools import cache

import numpy as np
import torch

from tokenplane.engine.cpu_elements import _cast, _load, _narrow, _round, _store, as_array
from tokenplane.engine.cpu_simd import (
    HOST_AVX512,
    _add16,
    _fma16,
    _load16,
    _load16_bf16,
    _mul16,
    _round16_bf16,
    _splat16,
    _store16,
    _store16_bf16,
    _zero16,
)
from tokenplane.engine.numbacache import njit

DTYPES = (torch.float32, torch.float64, torch.bfloat16)
VECTOR = [True]   # the 16-lane kernel where it applies; a list so tests and benchmarks can compare both kernels


@njit(cache=True, nogil=True, fastmath={"reassoc"})
def _sum_squares(qkv, t, base, d, like):  # noqa: ANN001, ANN202
    """sum of qkv[t, base + j]^2 over j < d in the compute type. Reassociation only (no contraction): LLVM sums in
    vector lanes, then across them; the norm's order differs from torch's anyway (see the module docstring)."""
    s = _cast(0.0, like)
    for j in range(d):
        v = _load(qkv[t, base + j])
        s += v * v
    return s


@njit(inline="always")
def _rope_row(out, buf, cos, sin, half, like):  # noqa: ANN001
    """out[j] = buf[j] * cos[j] + rotate_half(buf)[j] * sin[j] over one head (1-D views), each product and the sum
    rounded as PyTorch's ops round (`layers.apply_rope`'s values); the halves are two loops, so each vectorizes."""
    for j in range(half):
        out[j] = _store(_round(buf[j] * _load(cos[j]), like) + _round(buf[j + half] * _load(sin[j]), like), like)
    for j in range(half, 2 * half):
        out[j] = _store(_round(buf[j] * _load(cos[j]), like) + _round(buf[j - half] * _load(sin[j]), like), like)


@njit(cache=True, nogil=True)
def _qkv_rope(qkv, heads, kv_heads, d, q_w, k_w, eps, use_norm, cos, sin, k_cache, v_cache, slots, q_out, buf):  # noqa: ANN001
    """qkv [T, (heads + 2 kv_heads) d]; q_w, k_w [d]; cos, sin [T, d] (sin with its first half negated);
    k/v_cache [kv_heads, slots, d]; slots [T]; q_out [T, heads, d]; buf [d] in the compute type (cpu_elements).
    No branch and no loop-carried sum inside the per-element loops (the norm's sum is `_sum_squares`, the rope's
    two halves are two loops since rotate_half reads the other half), so LLVM vectorizes them: SmolLM2's shape,
    256 rows, 1 thread, here: bf16 858 -> 641 us a layer, fp32 456 -> 305."""
    half = d // 2
    for t in range(qkv.shape[0]):
        slot = slots[t]
        like = qkv[t, 0]
        for hh in range(heads + kv_heads):
            base = hh * d
            if use_norm:
                w = q_w if hh < heads else k_w
                s = _sum_squares(qkv, t, base, d, like)
                r = _narrow(_cast(1.0, like) / math.sqrt(s / d + _cast(eps, like)), like)
                for j in range(d):
                    buf[j] = _round(_load(w[j]) * _round(_load(qkv[t, base + j]) * r, like), like)
            else:
                for j in range(d):
                    buf[j] = _load(qkv[t, base + j])
            _rope_row(q_out[t, hh] if hh < heads else k_cache[hh - heads, slot], buf, cos[t], sin[t], half, like)
        vbase = (heads + kv_heads) * d
        for hv in range(kv_heads):
            for j in range(d):
                v_cache[hv, slot, j] = qkv[t, vbase + hv * d + j]


@cache
def _vector_kernel(bf16: bool):  # noqa: ANN202
    """`_qkv_rope` on explicit 16-float vectors (AVX-512 hosts, head size a multiple of 32, float32 or bf16: see
    `_vector_applies`): the same products, roundings and sums per element as the scalar kernel's rope, so the rope
    stays bit-identical to apply_rope; the norm's sum of squares is a 16-lane sum (another order again) and its
    scale is computed in float32 as torch's. LLVM's own vectorization of the scalar loops stays partial (bf16's
    rounding and the 2-D indexing): SmolLM2's shape, 256 rows, 1 thread, here, against the scalar kernel: bf16
    303 -> 133 us a layer without the norm, 644 -> 270 with it; fp32 138 -> 75 and 267 -> 94."""
    load = _load16_bf16 if bf16 else _load16
    store_out = _store16_bf16 if bf16 else _store16

    @njit(cache=True, nogil=True)
    def _qkv_rope16(qkv, heads, kv_heads, d, q_w, k_w, eps, use_norm, cos, sin, k_cache, v_cache, slots, q_out,  # noqa: ANN001
                    buf):
        half = d // 2
        width = qkv.shape[1]
        n_slots = k_cache.shape[1]
        x = qkv.reshape(-1)
        qf = q_out.reshape(-1)
        kf = k_cache.reshape(-1)
        vf = v_cache.reshape(-1)
        cf = cos.reshape(-1)
        sf = sin.reshape(-1)
        rb = np.empty(16, dtype=np.float32)
        for t in range(qkv.shape[0]):
            slot = slots[t]
            cb = t * d
            for hh in range(heads + kv_heads):
                base = t * width + hh * d
                if use_norm:
                    w = q_w if hh < heads else k_w
                    acc = _zero16()
                    for c in range(0, d, 16):
                        v = load(x, base + c)
                        acc = _fma16(v, v, acc)
                    _store16(rb, 0, acc)
                    s = np.float32(0.0)
                    for i in range(16):
                        s += rb[i]
                    rb[0] = np.float32(1.0) / np.float32(math.sqrt(s / np.float32(d) + np.float32(eps)))
                    r = _splat16(rb, 0)
                    for c in range(0, d, 16):
                        v = _mul16(load(x, base + c), r)
                        if bf16:
                            v = _round16_bf16(v)
                        v = _mul16(load(w, c), v)
                        if bf16:
                            v = _round16_bf16(v)
                        _store16(buf, c, v)
                else:
                    for c in range(0, d, 16):
                        _store16(buf, c, load(x, base + c))
                if hh < heads:
                    out, o = qf, (t * heads + hh) * d
                else:
                    out, o = kf, ((hh - heads) * n_slots + slot) * d
                for c in range(0, half, 16):
                    a = _mul16(_load16(buf, c), load(cf, cb + c))
                    b = _mul16(_load16(buf, c + half), load(sf, cb + c))
                    a2 = _mul16(_load16(buf, c + half), load(cf, cb + c + half))
                    b2 = _mul16(_load16(buf, c), load(sf, cb + c + half))
                    if bf16:
                        a, b = _round16_bf16(a), _round16_bf16(b)
                        a2, b2 = _round16_bf16(a2), _round16_bf16(b2)
                    store_out(out, o + c, _add16(a, b))
                    store_out(out, o + c + half, _add16(a2, b2))
            vbase = t * width + (heads + kv_heads) * d
            for hv in range(kv_heads):
                o = (hv * n_slots + slot) * d
                for j in range(d):
                    vf[o + j] = x[vbase + hv * d + j]
    return _qkv_rope16


def _vector_applies(dtype: torch.dtype, head_dim: int) -> bool:
    return HOST_AVX512 and head_dim % 32 == 0 and dtype in (torch.float32, torch.bfloat16)


def applies(qkv: torch.Tensor, k_cache: torch.Tensor | None) -> bool:
    return (qkv.device.type == "cpu" and qkv.dtype in DTYPES and qkv.dim() == 2 and qkv.is_contiguous()
            and k_cache is not None and k_cache.dtype == qkv.dtype and k_cache.device.type == "cpu")


def kernel_for(dtype: torch.dtype, head_dim: int):  # noqa: ANN201
    """The compiled `_qkv_rope` (arrays in, as `qkv_rope_write` passes them) for this dtype and head size."""
    return _vector_kernel(dtype == torch.bfloat16) if VECTOR[0] and _vector_applies(dtype, head_dim) else _qkv_rope


def qkv_rope_write(qkv: torch.Tensor, heads: int, kv_heads: int, head_dim: int, q_norm: torch.Tensor | None,
                   k_norm: torch.Tensor | None, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                   k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Writes each row's roped (and normed, with q_norm/k_norm given) k and its v into k/v_cache[:, slots[t]], and
    returns the roped (normed) q as [T, heads, head_dim]. qkv [T, (heads + 2 kv_heads) head_dim] contiguous (check
    `applies`); cos/sin as layers.RotaryEmbedding gives them ([T, 1, head_dim], or [T, head_dim])."""
    T = qkv.shape[0]
    q = torch.empty(T, heads, head_dim, dtype=qkv.dtype)
    norm = q_norm is not None and k_norm is not None
    qw = as_array(q_norm.detach()) if norm else _EMPTY[qkv.dtype]   # type: ignore[union-attr]
    kw = as_array(k_norm.detach()) if norm else _EMPTY[qkv.dtype]   # type: ignore[union-attr]
    buf = np.empty(head_dim, np.float64 if qkv.dtype == torch.float64 else np.float32)
    kernel_for(qkv.dtype, head_dim)(as_array(qkv), heads, kv_heads, head_dim, qw, kw, eps, norm,
                                    as_array(cos.reshape(T, head_dim).contiguous()),
                                    as_array(sin.reshape(T, head_dim).contiguous()),
                                    as_array(k_cache), as_array(v_cache), slots.numpy(), as_array(q), buf)
    return q


_EMPTY = {torch.float32: np.empty(0, np.float32), torch.float64: np.empty(0, np.float64),
          torch.bfloat16: np.empty(0, np.uint16)}
