"""Entropy of a next-token distribution from its logits (R-Stitch's signal), one compiled pass per row.

Why a kernel: the routing runtime computes this for every small-model row of every step (R-Stitch), and torch's
`-(log_softmax(x).exp() * log_softmax(x)).sum()` makes five passes over the vocabulary with two exponentials per
entry: 0.37 ms per 151936-entry row on one core of this machine, ~4.4 ms of a C=16 step's ~12 rows. These kernels
make one exponential per entry: float32 logits (what every engine step produces) 8-wide in float32 with float64
sums, in one pass that keeps the exponentials, their widening and both sums in registers (`_exp_sum8`): 0.61 ns an
entry on a Zen 3 core (~0.09 ms a row; 0.91 ns for the previous form, three passes over 1,024-entry scratch blocks),
`entropy()` with the row max and the wrapper 0.86-0.90 ns against 1.13-1.18 (benchmarks/routing/results/
entropy_ab_zen3.md); float64 logits 4-wide in float64, ~0.2 ms a row.

Numerics: with m = max(x), d = x - m, S = sum exp(d), T = sum exp(d) * d, the entropy is log S - T / S. exp(d) is
2^n * p(r) with n = round(d / ln 2) and r = d - n ln 2 (|r| <= ln 2 / 2), p a Taylor polynomial; S and T are summed
in float64 either way.
- float32 rows: d in float32, p of degree 7 (relative error < 2e-8 on that range, below float32's own rounding),
  terms below exp(-87) clamped there (they stay normal floats and are under float64's resolution of S). Against a
  float64 log_softmax of the same logits the normalized entropy was within 4e-9 on 151936-entry rows (random,
  near-uniform, tied maxima, masked, scaled, peaked): well inside the float32 logits' own rounding, and 2,000x closer
  than torch's float32 formula above (off by up to 9e-6, 4.8e-4 on rows with many tied maxima:
  benchmarks/routing/results/entropy_signal.md).
- float64 rows: d exact, p of degree 10 (relative error < 3e-13), clamp at exp(-700): within ~3e-12.
Masked logits (-inf) count as probability 0 (at most exp(-87) each, float32); a NaN or +inf logit gives NaN.

Determinism: each row is summed in one fixed order by the calling thread alone, so a row's value does not depend on
the batch it came in, on torch's thread count, or on the process: the runtime's batched rows and the sequential
reference (tokenplane.route.reference) decide from the same bits for the same logits.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic, models, register_model

from tokenplane.engine.cpu_simd import _pointer
from tokenplane.engine.numbacache import njit

_BLOCK = 1024                        # entries per block: the three float64 scratch rows stay in L1
_MAGIC = 6755399441055744.0          # 1.5 * 2**52: adding it rounds a double to an integer kept in the low mantissa
_LOG2E = 1.4426950408889634
_LN2HI = 0.6931471803691238          # ln 2 = _LN2HI + _LN2LO (fdlibm's split: n * _LN2HI is exact)
_LN2LO = 1.9082149292705877e-10
_FLOOR = -700.0                      # exp(-700) ~ 1e-304: below double's resolution of S; keeps 2^n normal
# Taylor coefficients 1/k! of exp's degree-10 polynomial (Estrin's scheme: short dependency chains)
_C2, _C3, _C4, _C5, _C6, _C7, _C8, _C9, _C10 = (1.0 / math.factorial(k) for k in range(2, 11))


# No reassociation here: it would fold (k + _MAGIC) - _MAGIC away. Contraction (FMA) only sharpens r.
@njit(cache=True, nogil=True, fastmath={"contract"})
def _exp_block(x, start, n, m, d, p, kf):  # noqa: ANN001
    """d = max(x - m, _FLOOR); p = p(r) (the mantissa part of exp(d)); kf holds n in its low mantissa bits."""
    for j in range(n):
        dj = max(np.float64(x[start + j]) - m, _FLOOR)
        d[j] = dj
        k = dj * _LOG2E + _MAGIC
        kf[j] = k
        t = k - _MAGIC
        r = dj - t * _LN2HI - t * _LN2LO
        r2 = r * r
        r4 = r2 * r2
        r8 = r4 * r4
        p[j] = (((1.0 + r) + r2 * (_C2 + r * _C3)) + r4 * ((_C4 + r * _C5) + r2 * (_C6 + r * _C7))
                + r8 * ((_C8 + r * _C9) + r2 * _C10))


# float32 rows: the exponentials in float32 (8 lanes on AVX2); the sums in float64 either way (_sum_block)
_MAGIC32 = np.float32(12582912.0)         # 1.5 * 2**23: adding it rounds a float32 to an integer in the low mantissa
_LOG2E32 = np.float32(_LOG2E)
_LN2HI32 = np.float32(0.693359375)        # ln 2 = _LN2HI32 + _LN2LO32 (Cephes' split: n * _LN2HI32 is exact)
_LN2LO32 = np.float32(-2.12194440e-4)
_FLOOR32 = np.float32(-87.0)              # exp(-87) ~ 1.6e-38: 2^n stays a normal float32
_D2, _D3, _D4, _D5, _D6, _D7 = (np.float32(1.0 / math.factorial(k)) for k in range(2, 8))


_VF = ir.VectorType(ir.FloatType(), 8)
_VD = ir.VectorType(ir.DoubleType(), 8)
_VI = ir.VectorType(ir.IntType(32), 8)


class _Vec8d(types.Type):
    """Eight float64 lanes held as one LLVM vector value (two ymm registers on AVX2, one zmm on AVX-512)."""

    def __init__(self) -> None:
        super().__init__(name="Vec8f64")


_vec8d = _Vec8d()


@register_model(_Vec8d)
class _Vec8dModel(models.PrimitiveModel):
    def __init__(self, dmm, fe_type) -> None:  # noqa: ANN001
        super().__init__(dmm, fe_type, _VD)


def _splat(value: float, vt: ir.VectorType) -> ir.Constant:
    return ir.Constant(vt, [value] * vt.count)


@intrinsic
def _zero8d(typingctx):  # noqa: ANN001
    def codegen(context, builder, signature, args):  # noqa: ANN001
        return _splat(0.0, _VD)
    return _vec8d(), codegen


@intrinsic
def _exp_sum8(typingctx, flat, index, m, s, t):  # noqa: ANN001
    """(s + p, t + p * d) lane-wise for the 8 float32 logits flat[index : index + 8]: d = max(x - m, _FLOOR32),
    p = exp(d) = 2^n * p(r) (n rounded by adding _MAGIC32 in a fused multiply-add, r by Cody-Waite's split of ln 2,
    p of degree 7 by Estrin's scheme, n added to p's exponent field), p and d widened to float64 for the sums (one
    add and one fused multiply-add a lane)."""
    def codegen(context, builder, signature, args):  # noqa: ANN001
        def fma(a, b, c, vt=_VF):  # noqa: ANN001, ANN202
            fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vt, [vt, vt, vt]),
                                                "llvm.fma.v8f32" if vt is _VF else "llvm.fma.v8f64")
            return builder.call(fn, [a, b, c])
        ptr = builder.bitcast(_pointer(context, builder, signature.args[0], args[0], args[1]), _VF.as_pointer())
        x = builder.load(ptr, align=4)
        mv = builder.insert_element(ir.Constant(_VF, ir.Undefined), args[2], ir.Constant(ir.IntType(32), 0))
        mv = builder.shuffle_vector(mv, mv, ir.Constant(_VI, [0] * 8))
        d = builder.fsub(x, mv)
        floor = _splat(float(_FLOOR32), _VF)
        d = builder.select(builder.fcmp_ordered(">", d, floor), d, floor)   # -inf (masked) -> the floor
        k = fma(d, _splat(float(_LOG2E32), _VF), _splat(float(_MAGIC32), _VF))
        n = builder.fsub(k, _splat(float(_MAGIC32), _VF))
        neg = builder.fneg(n)
        r = fma(neg, _splat(float(_LN2HI32), _VF), d)
        r = fma(neg, _splat(float(_LN2LO32), _VF), r)
        r2 = builder.fmul(r, r)
        r4 = builder.fmul(r2, r2)
        lo = fma(r2, fma(r, _splat(float(_D3), _VF), _splat(float(_D2), _VF)),
                 builder.fadd(r, _splat(1.0, _VF)))
        hi = fma(r2, fma(r, _splat(float(_D7), _VF), _splat(float(_D6), _VF)),
                 fma(r, _splat(float(_D5), _VF), _splat(float(_D4), _VF)))
        p = fma(r4, hi, lo)
        bits = builder.add(builder.bitcast(p, _VI), builder.shl(builder.bitcast(k, _VI), ir.Constant(_VI, [23] * 8)))
        pd = builder.fpext(builder.bitcast(bits, _VF), _VD)
        s = builder.fadd(args[3], pd)
        t = fma(pd, builder.fpext(d, _VD), args[4], _VD)
        return context.make_tuple(builder, signature.return_type, (s, t))
    return types.UniTuple(_vec8d, 2)(flat, index, m, _vec8d, _vec8d), codegen


@intrinsic
def _hsum8d(typingctx, v):  # noqa: ANN001
    """The 8 lanes' sum in one fixed order: ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7))."""
    def codegen(context, builder, signature, args):  # noqa: ANN001
        def half(w, lanes):  # noqa: ANN001, ANN202
            return builder.shuffle_vector(w, w, ir.Constant(ir.VectorType(ir.IntType(32), len(lanes)), lanes))
        a = builder.fadd(half(args[0], [0, 1, 2, 3]), half(args[0], [4, 5, 6, 7]))
        b = builder.fadd(half(a, [0, 1]), half(a, [2, 3]))
        return builder.fadd(builder.extract_element(b, ir.Constant(ir.IntType(32), 0)),
                            builder.extract_element(b, ir.Constant(ir.IntType(32), 1)))
    return types.float64(_vec8d), codegen


@njit(cache=True, nogil=True)
def _entropy32(x, m):  # noqa: ANN001
    """log S - T / S of a float32 row, 8 lanes at a time (`_exp_sum8`); the last n % 8 logits through the same lane
    code from an 8-entry copy padded with -inf, which counts exp(-87) a pad: below float64's resolution of S >= 1."""
    n = x.shape[0]
    full = n - n % 8
    s = _zero8d()   # type: ignore[call-arg,var-annotated]  # (numba intrinsics: typed by numba)
    t = _zero8d()
    for j in range(0, full, 8):
        s, t = _exp_sum8(x, j, m, s, t)
    if full < n:
        tail = np.full(8, -np.inf, np.float32)
        tail[:n - full] = x[full:]
        s, t = _exp_sum8(tail, 0, m, s, t)
    ss = _hsum8d(s)
    return math.log(ss) - _hsum8d(t) / ss


@njit(cache=True, nogil=True)
def _scale_block(n, pbits, kbits):  # noqa: ANN001
    """p *= 2^n by adding n << 52 to the exponent field (in two's complement: the magic's own bits shift out)."""
    for j in range(n):
        pbits[j] += kbits[j] << 52


@njit(cache=True, nogil=True, fastmath={"reassoc", "contract"})
def _sum_block(n, p, d):  # noqa: ANN001
    """(sum p, sum p * d)."""
    s = 0.0
    t = 0.0
    for j in range(n):
        s += p[j]
        t += p[j] * d[j]
    return s, t


@njit(cache=True, nogil=True)
def _entropy(x, m):  # noqa: ANN001
    """log S - T / S of a float64 row, in blocks of _BLOCK entries."""
    d, p, kf = np.empty(_BLOCK, np.float64), np.empty(_BLOCK, np.float64), np.empty(_BLOCK, np.float64)
    pbits, kbits = p.view(np.int64), kf.view(np.int64)
    s = 0.0
    t = 0.0
    size = x.shape[0]
    for start in range(0, size, _BLOCK):
        n = min(_BLOCK, size - start)
        _exp_block(x, start, n, m, d, p, kf)
        _scale_block(n, pbits, kbits)
        bs, bt = _sum_block(n, p, d)
        s += bs
        t += bt
    return math.log(s) - t / s


def entropy(logits: torch.Tensor) -> float:
    """Shannon entropy (nats) of softmax(logits), logits [V] of any float dtype on any device."""
    x = logits.detach()
    if x.dim() != 1 or x.numel() == 0:
        raise ValueError(f"entropy needs one non-empty row of logits, got shape {tuple(x.shape)}")
    if x.device.type != "cpu" or x.dtype not in (torch.float32, torch.float64):
        x = x.to(device="cpu", dtype=torch.float64 if x.dtype == torch.float64 else torch.float32)
    a = x.contiguous().numpy()
    m = float(a.max())
    if math.isnan(m) or m == math.inf:
        return math.nan
    if m == -math.inf:   # every token masked: no distribution
        return math.nan
    if a.dtype == np.float32:
        return float(_entropy32(a, np.float32(m)))
    return float(_entropy(a, m))


def normalized_entropy(logits: torch.Tensor) -> float:
    """entropy / log V, in [0, 1] (R-Stitch's signal)."""
    return entropy(logits) / math.log(logits.shape[-1])


__all__ = ["entropy", "normalized_entropy"]
