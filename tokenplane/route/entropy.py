"""Entropy of a next-token distribution from its logits (R-Stitch's signal), one compiled pass per row.

Why a kernel: the routing runtime computes this for every small-model row of every step (R-Stitch), and torch's
`-(log_softmax(x).exp() * log_softmax(x)).sum()` makes five passes over the vocabulary with two exponentials per
entry: 0.37 ms per 151936-entry row on one core of this machine, ~4.4 ms of a C=16 step's ~12 rows. These kernels
make one exponential per entry: float32 logits (what every engine step produces) 8-wide in float32 with float64
sums, ~0.12 ms per row on a Zen 3 core; float64 logits 4-wide in float64, ~0.2 ms.

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
from numba import njit

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
_ONE32 = np.float32(1.0)


@njit(cache=True, nogil=True, fastmath={"contract"})
def _exp_block32(x, start, n, m, d, p, kf):  # noqa: ANN001
    """_exp_block in float32: d = max(x - m, _FLOOR32), p = p(r), kf holds n in its low mantissa bits."""
    for j in range(n):
        dj = max(x[start + j] - m, _FLOOR32)
        d[j] = dj
        k = dj * _LOG2E32 + _MAGIC32
        kf[j] = k
        t = k - _MAGIC32
        r = dj - t * _LN2HI32 - t * _LN2LO32
        r2 = r * r
        r4 = r2 * r2
        p[j] = ((_ONE32 + r) + r2 * (_D2 + r * _D3)) + r4 * ((_D4 + r * _D5) + r2 * (_D6 + r * _D7))


@njit(cache=True, nogil=True)
def _scale_block(n, pbits, kbits, shift):  # noqa: ANN001
    """p *= 2^n by adding n to the exponent field (n << 52 for float64, << 23 for float32, in two's complement: the
    magic's own bits shift out)."""
    for j in range(n):
        pbits[j] += kbits[j] << shift


@njit(cache=True, nogil=True, fastmath={"reassoc", "contract"})
def _sum_block(n, p, d):  # noqa: ANN001
    """(sum p, sum p * d) in float64, whatever p's and d's float width."""
    s = 0.0
    t = 0.0
    for j in range(n):
        pj = np.float64(p[j])
        s += pj
        t += pj * np.float64(d[j])
    return s, t


@njit(cache=True, nogil=True)
def _blocks(x, m, d, p, kf, pbits, kbits, shift):  # noqa: ANN001
    """log S - T / S over x in blocks of _BLOCK entries; shift 23: float32 scratch and exponentials, 52: float64."""
    s = 0.0
    t = 0.0
    size = x.shape[0]
    for start in range(0, size, _BLOCK):
        n = min(_BLOCK, size - start)
        if shift == 23:
            _exp_block32(x, start, n, m, d, p, kf)
        else:
            _exp_block(x, start, n, m, d, p, kf)
        _scale_block(n, pbits, kbits, shift)
        bs, bt = _sum_block(n, p, d)
        s += bs
        t += bt
    return math.log(s) - t / s


@njit(cache=True, nogil=True)
def _entropy(x, m):  # noqa: ANN001
    d, p, kf = np.empty(_BLOCK, np.float64), np.empty(_BLOCK, np.float64), np.empty(_BLOCK, np.float64)
    return _blocks(x, m, d, p, kf, p.view(np.int64), kf.view(np.int64), 52)


@njit(cache=True, nogil=True)
def _entropy32(x, m):  # noqa: ANN001
    d, p, kf = np.empty(_BLOCK, np.float32), np.empty(_BLOCK, np.float32), np.empty(_BLOCK, np.float32)
    return _blocks(x, m, d, p, kf, p.view(np.int32), kf.view(np.int32), 23)


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
