"""Building blocks shared by the model files: RMSNorm, rotary embedding (default and llama3), SwiGLU."""
from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from tokenplane.engine import cpu_bf16_gemv, cpu_small_gemm
from tokenplane.engine.cpu_silu_mul import silu_mul_flat

CPU_PACK_DTYPES = (torch.float32, torch.bfloat16)
# Rows past cpu_small_gemm's limits (prefill), fp32: F.linear, transformers' own call, so the same summation order
# (SmolLM2-135M shapes, 1 thread, here: 6-12% faster than oneDNN's packed path at 128-2048 rows, GEMMs alone, and
# oneDNN's one chain over k sits 2x further from float64); bf16: oneDNN's packed path (`cpu_pack`).

def cpu_packing_available(weight: torch.Tensor) -> bool:
    """oneDNN packs fp32 on any x86 CPU, bf16 only where the CPU has bf16 conversion instructions (AVX-512 BW/VL/DQ
    or AVX-NE-CONVERT): on an AVX2-only CPU its reorder raises, and bf16 layers stay on F.linear."""
    return (weight.device.type == "cpu" and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight") and cpu_packing_supported(weight.dtype))


@functools.cache
def cpu_packing_supported(dtype: torch.dtype) -> bool:
    """Whether this CPU's oneDNN packs weights of `dtype` (fp32 always; bf16 per the CPU's instructions)."""
    if dtype != torch.bfloat16:
        return dtype in CPU_PACK_DTYPES
    probe = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return bool(probe is not None and probe())


def cpu_pack(weight: torch.Tensor, batch_hint: int = 16) -> torch.Tensor:
    """oneDNN's prepacked copy of a [out, in] weight for `cpu_packed_linear` (what vLLM's CPU backend and inductor's
    freezing use). Measured here, 1 thread, fp32 (thread CPU time): 1.2-2.7x faster than F.linear from 4 rows on
    (151936 x 256: 31 -> 8 ms at 4 rows, 41 -> 16 ms at 16; 3072 x 512: 1.17 -> 0.63 ms at 16), about equal at 1 and
    at 256 rows. The hint is the row count it is tuned for; any row count works."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), batch_hint)


def cpu_packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def packed_rows(m: int) -> int:
    """The row count a packed GEMM of m rows runs at (`cpu_bucketed_linear`): m up to 16, then the next multiple of
    an eighth of m's power of two (8 buckets an octave: under 12.5% padded rows). oneDNN builds a primitive for each
    new (weight shape, row count) on its first call: measured here (bf16, 1 thread, AMX) ~1-2 ms a call on top of
    the GEMM, so a step whose token count is new paid a few ms per layer shape (4 x 256-token prefill, tiny-small:
    78 ms the first time, 35 after), and up to 2,048 distinct counts would overflow oneDNN's primitive cache (1,024
    entries). The buckets bound the distinct counts (72 up to 2,048 rows), which `warm_packed` builds ahead."""
    if m <= 16:
        return m
    step = 1 << (m.bit_length() - 4)
    return -(-m // step) * step


def _padded_to_bucket(x: torch.Tensor) -> torch.Tensor:
    """x with zero rows appended up to `packed_rows` (a 2-D input whose row count is not a bucket), else x."""
    m = x.shape[0]
    rows = packed_rows(m) if x.dim() == 2 else m
    if rows == m:
        return x
    padded = x.new_empty(rows, x.shape[1])
    padded[:m] = x
    padded[m:].zero_()
    return padded


def cpu_bucketed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """cpu_packed_linear at `packed_rows` rows: a 2-D input is padded with zero rows and the product cut back."""
    m = x.shape[0]
    y = cpu_packed_linear(_padded_to_bucket(x), packed, bias)
    return y if y.shape[0] == m else y[:m]


def cpu_swiglu(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, gate_bias: torch.Tensor | None,
               up_bias: torch.Tensor | None) -> torch.Tensor:
    """silu(x @ gate^T) * (x @ up^T) as two oneDNN-packed GEMMs whose output stages apply the activation: silu
    (oneDNN's swish, alpha 1) on the gate's fp32 accumulator, then the up GEMM's accumulator times that gate. One
    rounding to the model dtype per GEMM instead of four (transformers rounds the gate, the up, the silu and the
    product), and no separate elementwise passes over the [rows, 2 x ffn] product: SmolLM2-135M bf16, 1 x 256-token
    prefill, 1 thread, here: 114-122 -> 104-112 ms a step (silu and mul on the halves of one packed product spent
    ~15 ms of it). Rows are padded to `packed_rows` buckets as in `cpu_bucketed_linear`."""
    m = x.shape[0]
    xp = _padded_to_bucket(x)
    g = torch.ops.mkldnn._linear_pointwise(xp, gate, gate_bias, "swish", [], "")
    h = torch.ops.mkldnn._linear_pointwise.binary(xp, g, up, up_bias, "mul")
    return h if h.shape[0] == m else h[:m]


def warm_packed(layers: list[tuple[torch.Tensor, torch.Tensor | None, int]], max_rows: int,
                swiglus: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None, int]]
                | None = None) -> int:
    """Runs each distinct packed GEMM (packed weight, bias, input width) once at every `packed_rows` bucket up to
    `max_rows`, and each `cpu_swiglu` pair (gate, up, biases, input width): its post-op primitives are keyed apart.
    So no serving step pays oneDNN's primitive creation (see `packed_rows`). One weight per shape suffices:
    primitives are keyed by shapes, not values. Returns the number of calls."""
    buckets = sorted({packed_rows(m) for m in range(1, max_rows + 1)})
    calls = 0
    for packed, bias, width in layers:
        x = torch.zeros(buckets[-1], width, dtype=packed.dtype)
        for rows in buckets:
            cpu_packed_linear(x[:rows], packed, bias)
            calls += 1
    for gate, up, gate_bias, up_bias, width in swiglus or ():
        x = torch.zeros(buckets[-1], width, dtype=gate.dtype)
        for rows in buckets:
            cpu_swiglu(x[:rows], gate, up, gate_bias, up_bias)
            calls += 2
    return calls


class Linear(nn.Linear):
    """nn.Linear without its random init: every weight comes from the loader, and skipping the init keeps building a
    151k-vocabulary model (or an 8B one on a GPU) to allocation cost.

    On CPU the ModelRunner packs the weight for oneDNN (`pack_cpu`); the packed copy is a snapshot, so code that
    changes the weight afterwards must call `pack_cpu` again (or `unpack_cpu`)."""

    # Plain attributes, not buffers: state_dict() stays the weights only.
    cpu_packed: torch.Tensor | None = None   # bf16: oneDNN's packed copy
    cpu_panels: torch.Tensor | None = None   # fp32: cpu_small_gemm's copy, for 1-256 row inputs (decode)
    cpu_bf16_panels: np.ndarray | None = None   # bf16: cpu_bf16_gemv's copy, for decode-sized inputs

    def reset_parameters(self) -> None:
        pass

    def pack_cpu(self) -> None:
        w = self.weight
        if not cpu_packing_available(w):
            self.unpack_cpu()
            return
        # Decode-sized fp32 inputs (1-256 rows, 1 thread) stream the weight through cpu_small_gemm's panel copy:
        # 1.15x (8 rows) to 2x+ (1 row) faster than oneDNN's packed path on the layer shapes measured there, and
        # ahead of F.linear up to 256 rows, in F.linear's summation order. Larger fp32 inputs take F.linear itself
        # (see CPU_PACK_DTYPES), so fp32 keeps no oneDNN copy.
        if cpu_small_gemm.available(w):
            self.cpu_panels, self.cpu_packed = cpu_small_gemm.pack(w), None
        else:
            self.cpu_panels, self.cpu_packed = None, cpu_pack(w)
            self.cpu_bf16_panels = cpu_bf16_gemv.decode_panels_for(w)

    def unpack_cpu(self) -> None:
        self.cpu_packed = self.cpu_panels = self.cpu_bf16_panels = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == self.weight.dtype and x.device.type == "cpu":
            if self.cpu_panels is not None and cpu_small_gemm.applies(x):
                return cpu_small_gemm.linear(x, self.cpu_panels, self.out_features, self.bias)
            bp = self.cpu_bf16_panels
            if bp is not None and cpu_bf16_gemv.applies(x):
                return cpu_bf16_gemv.linear_bf16_io(x, bp, self.out_features, self.bias)
            p = self.cpu_packed
            if p is not None:
                return cpu_bucketed_linear(x, p, self.bias)
        return F.linear(x, self.weight, self.bias)


class VocabProjection:
    """hidden [B, H] -> logits [B, V] on CPU, the step's largest GEMM for small models. Decode-sized fp32 batches
    (1-256 rows, 1 thread): cpu_small_gemm's panel copy streams the matrix at memory speed (151936 x 512 fp32: 11-14 ms
    at 1-4 rows, vs 15-20 ms on oneDNN's packed copy and 16 ms for x @ W^T over a transposed copy at one row) and
    stays ahead of F.linear up to 256 rows (64 rows: 135 vs 183 ms; cpu_small_gemm's docstring), in F.linear's
    summation order; more fp32 rows or more threads: F.linear (transformers' call); bf16: oneDNN's packed copy (see
    `cpu_pack`), and at 1-8 rows on 1 thread cpu_bf16_gemv's panel copy as the bf16 linears (151936 x 512, one row,
    timed in tiny-large's decode step: 12.4 -> 9.8 ms). Holds one copy of the matrix beside the weight (bf16: two)."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.out_features = weight.shape[0]
        self.weight = weight
        self.panels = cpu_small_gemm.pack(weight) if cpu_small_gemm.available(weight) else None
        self.packed = None if self.panels is not None else cpu_pack(weight)
        self.bf16_panels = cpu_bf16_gemv.decode_panels_for(weight)

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.panels is not None and cpu_small_gemm.applies(hidden, cpu_small_gemm.VOCAB_MAX_ROWS):
            return cpu_small_gemm.linear(hidden, self.panels, self.out_features)
        if self.bf16_panels is not None and cpu_bf16_gemv.applies(hidden):
            return cpu_bf16_gemv.linear_bf16_io(hidden, self.bf16_panels, self.out_features)
        if self.packed is not None:
            return cpu_bucketed_linear(hidden, self.packed, None)
        return F.linear(hidden, self.weight)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Same op order as transformers (upcast, mean of squares, rsqrt, downcast, scale), but float64 stays float64:
    transformers rounds to float32 here, which would make float64 batched == unbatched checks flaky. The casts are
    skipped where they are no-ops (fp32/fp64): same values, fewer dispatched ops per layer."""
    dtype = x.dtype
    if dtype == torch.float32 or dtype == torch.float64:
        # in place on the fresh product: the same values as weight * (...) (IEEE products commute), one buffer fewer
        return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)).mul_(weight)
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Inverse frequencies in float32, computed exactly as transformers does (checkpoints were trained with these)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim))
    if not scaling or scaling.get("rope_type", scaling.get("type")) in (None, "default"):
        return inv_freq
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """cos/sin for a flat list of positions. Computed in float32 per call (T x head_dim/2 values, cheap) rather than
    cached in a buffer, so `.to(dtype)` can never round the frequencies."""

    def __init__(self, head_dim: int, theta: float, scaling: dict[str, Any] | None) -> None:
        super().__init__()
        # Explicit CPU: models are built under a torch.device(target) context and this is not a parameter.
        self._inv_freq_cpu = rope_inv_freq(head_dim, theta, scaling)
        self._inv_freq: dict[torch.device, torch.Tensor] = {}

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, signed sin) [T, 1, head_dim] for `apply_rope`; the sin's first half is negated."""
        inv_freq = self._inv_freq.get(positions.device)
        if inv_freq is None:
            inv_freq = self._inv_freq[positions.device] = self._inv_freq_cpu.to(positions.device)
        freqs = positions[:, None].float() * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]  # [T, 1, head_dim], broadcast over heads
        sin = emb.sin()
        sin[..., :freqs.shape[-1]].neg_()
        return emb.cos().to(dtype), sin.to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """transformers' x * cos + rotate_half(x) * sin, bit for bit: rotate_half(x) * sin = [-x2 * s, x1 * s] =
    roll(x, half) * [-s, s], with the sign folded into the sin once per step instead of a negation per layer."""
    # in place on fresh temporaries: the same two rounded products and one sum per element, two buffers fewer
    return (x * cos).add_(x.roll(x.shape[-1] // 2, -1).mul_(signed_sin))


class SwiGLU(nn.Module):
    """gate_proj and up_proj packed into one GEMM (the loader splits HF's two tensors into it).

    Where the CPU path packs the weights for oneDNN (bf16), `pack_cpu` packs the gate and up halves apart instead,
    for `cpu_swiglu` (activation and product in the GEMMs' output stages): the same weights, packed once."""

    # Plain attributes, not buffers (see Linear): oneDNN's packed gate / up halves and their biases.
    cpu_gate: torch.Tensor | None = None
    cpu_up: torch.Tensor | None = None
    cpu_biases: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None)

    def __init__(self, hidden: int, ffn: int, bias: bool) -> None:
        super().__init__()
        self.ffn = ffn
        self.gate_up_proj = Linear(hidden, 2 * ffn, bias=bias)
        self.down_proj = Linear(ffn, hidden, bias=bias)

    def pack_cpu(self) -> None:
        """After `gate_up_proj.pack_cpu()`: where it took a oneDNN copy, replace it by the two halves."""
        lin = self.gate_up_proj
        if lin.cpu_packed is None:
            self.unpack_cpu()
            return
        w, b, f = lin.weight.detach(), lin.bias, self.ffn
        self.cpu_gate, self.cpu_up = cpu_pack(w[:f].contiguous()), cpu_pack(w[f:].contiguous())
        self.cpu_biases = (None, None) if b is None else (b.detach()[:f].contiguous(), b.detach()[f:].contiguous())
        lin.cpu_packed = None

    def unpack_cpu(self) -> None:
        self.cpu_gate = self.cpu_up = None
        self.cpu_biases = (None, None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_w, up_w = self.cpu_gate, self.cpu_up
        if gate_w is not None and up_w is not None and x.dtype == gate_w.dtype and x.device.type == "cpu":
            bp = self.gate_up_proj.cpu_bf16_panels
            if bp is not None and cpu_bf16_gemv.applies(x):
                return self.down_proj(cpu_bf16_gemv.swiglu_bf16_io(x, bp, self.ffn, self.gate_up_proj.bias))
            return self.down_proj(cpu_swiglu(x, gate_w, up_w, *self.cpu_biases))
        gu = self.gate_up_proj(x)
        if gu.dtype == torch.float32 and gu.device.type == "cpu" and torch.get_num_threads() == 1:
            # cpu_silu_mul: one vectorized pass, ~1.6x torch's silu and product on one core (and the decode stack's
            # values); torch's silu spreads over the threads where there are more
            rows = gu.numel() // (2 * self.ffn)
            act = torch.empty(*gu.shape[:-1], self.ffn, dtype=gu.dtype)
            silu_mul_flat(gu.detach().contiguous().numpy().reshape(-1), rows, 2 * self.ffn, self.ffn,
                          act.numpy().reshape(-1))
            return self.down_proj(act)
        gate, up = gu.split(self.ffn, dim=-1)
        return self.down_proj(F.silu(gate).mul_(up))   # in place on silu's fresh output: same values, one buffer fewer
