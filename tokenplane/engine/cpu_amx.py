"""bfloat16 products on Intel AMX tiles (TDPBF16PS) for numba kernels: the few-row linears of a bf16 model's decode.

Why: at decode sizes a bf16 linear is a weight stream. oneDNN's packed bf16 linear (the engine's path past these
rows; vLLM's CPU backend runs oneDNN too) streams SmolLM2-135M's four linear shapes x 30 layers in 21.2 ms at 1 row
on a Sapphire Rapids core (~10 GB/s; F.linear: 29.5 ms), and the AVX-512 panels (cpu_bf16_gemv) are FMA-bound past
8 rows. A pass here puts 32 rows in two A tiles against two B tiles of 32 columns, so the weight streams once at any
row count: 14.7 / 15.1 / 18.3 / 25.2 / 61.6 ms at 1 / 16 / 32 / 64 / 256 rows against oneDNN's 21.2 / 22.0 / 24.9 /
29.0 / 51.6, measured alternately in one process (benchmarks/peers/amx_linear_ab.py). The pass's sums leave the tiles
through an L1 scratch into the caller's form: float32 sums, a bf16 linear (bias, one rounding, 16 lanes at a time),
or a SwiGLU (gate and up panels paired in one pass, the swish product written from it): writing float32 sums and
converting them after cost 151936 x 512 at 32 rows 15.6 -> 19.1 ms against oneDNN's 16.4; written as bf16 from the
scratch, 14.2. cpu_bf16_gemv takes this path up to 32 rows (oneDNN ahead from 64 on the vocabulary projections) and
streams 1-4 rows through vectors over the same copy.

Layout (`pack`): the weight [N, K] in 16-column panels, each panel K/2 rows of 16 (k, k+1) pairs ("VNNI"): panel p
row r = W[16p + j, 2r], W[16p + j, 2r + 1] for j = 0..15, 64 bytes; a B tile is 16 such rows (32 k x 16 columns,
1 KiB, contiguous). The input rows are an A tile as they lie ([rows, K] bf16, stride 2K bytes). N must be a multiple
of 16 (padded) and K of 32 (`fits`); other inner sizes keep the AVX-512 panels.

Numerics: every output is a float32 sum of exact bf16 x bf16 products (TDPBF16PS: round to nearest even, bf16
denormal inputs read as zero, float32 denormal results flushed), summed in the tile's order; results differ from
oneDNN's (also float32 sums) only by summation order, as the AVX-512 panels' do.

Use: the Linux kernel hands AMX state to a process only on request (arch_prctl ARCH_REQ_XCOMP_PERM); `HOST_AMX` is
true only where the CPU has AMX-BF16 and that request succeeded. TOKENPLANE_AMX=0 turns it off. A kernel loads its
tile configuration itself and releases the tiles before it returns, so oneDNN (which configures its own on every
call) never finds ours.
"""
from __future__ import annotations

import ctypes
import os
import platform
from functools import cache
from typing import Any

import llvmlite.binding as llvm
import numpy as np
import torch
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from tokenplane.engine.cpu_decode_paging import _exp16_shifted
from tokenplane.engine.cpu_elements import _store
from tokenplane.engine.cpu_malloc import huge_page_empty
from tokenplane.engine.cpu_simd import _add16, _load16, _mul16, _round16_bf16, _store16, _store16_bf16, _zero16
from tokenplane.engine.numbacache import njit

_I8 = ir.IntType(8)
_I64 = ir.IntType(64)
_I8P = _I8.as_pointer()
_SYS_ARCH_PRCTL = 158          # x86-64
_ARCH_REQ_XCOMP_PERM = 0x1023
_XFEATURE_XTILEDATA = 18
TILE_ROWS = 16                 # rows of an A or C tile (a pass takes two: 32 rows)
TILE_K = 32                    # bf16 k values in an A tile row (64 bytes)
PANEL = 16                     # output columns per panel (a C tile row)


def _request_tiles() -> bool:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA) == 0
    except (OSError, AttributeError):   # pragma: no cover - not Linux
        return False


def _host_amx() -> bool:
    if os.environ.get("TOKENPLANE_AMX") == "0" or platform.machine() != "x86_64":
        return False
    try:
        feats = llvm.get_host_cpu_features()
    except RuntimeError:    # pragma: no cover
        return False
    return bool(feats.get("amx-bf16") and feats.get("amx-tile")) and _request_tiles()


HOST_AMX = _host_amx()


def _pointer(context: Any, builder: Any, aryty: Any, ary: Any, index: Any) -> Any:
    a = context.make_array(aryty)(context, builder, ary)
    p = cgutils.get_item_pointer(context, builder, aryty, a, [index], wraparound=False)
    return builder.bitcast(p, _I8P)


def _call(builder: Any, name: str, args: list[Any]) -> None:
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [a.type for a in args]), name)
    builder.call(fn, args)


@intrinsic
def _tile_config(typingctx, cfg):  # noqa: ANN001, ANN202
    """ldtilecfg from cfg (64 bytes, `_configure`)."""
    def codegen(context, builder, sig, args):  # noqa: ANN001, ANN202
        _call(builder, "llvm.x86.ldtilecfg", [_pointer(context, builder, sig.args[0], args[0], ir.Constant(_I64, 0))])
        return context.get_dummy_value()
    return types.void(cfg), codegen


@intrinsic
def _tile_release(typingctx):  # noqa: ANN001, ANN202
    def codegen(context, builder, sig, args):  # noqa: ANN001, ANN202
        _call(builder, "llvm.x86.tilerelease", [])
        return context.get_dummy_value()
    return types.void(), codegen


# Tile numbers are instruction immediates: one intrinsic per tile (numba passes literal ints as plain int64).
@cache
def _tile_zero(tile: int):  # noqa: ANN202
    @intrinsic
    def zero(typingctx):  # noqa: ANN001, ANN202
        def codegen(context, builder, sig, args):  # noqa: ANN001, ANN202
            _call(builder, "llvm.x86.tilezero", [ir.Constant(_I8, tile)])
            return context.get_dummy_value()
        return types.void(), codegen
    return zero


@cache
def _tile_memory(tile: int, name: str):  # noqa: ANN202
    @intrinsic
    def move(typingctx, flat, index, stride):  # noqa: ANN001, ANN202
        """tileloadd / tilestored of tile at flat[index], rows `stride` bytes apart."""
        def codegen(context, builder, sig, args):  # noqa: ANN001, ANN202
            _call(builder, name, [ir.Constant(_I8, tile), _pointer(context, builder, sig.args[0], args[0], args[1]),
                                  args[2]])
            return context.get_dummy_value()
        return types.void(flat, index, types.int64), codegen
    return move


@cache
def _tile_dot(c: int, a: int, b: int):  # noqa: ANN202
    @intrinsic
    def dot(typingctx):  # noqa: ANN001, ANN202
        """tile c += tile a (bf16 rows) . tile b (bf16 pairs), float32."""
        def codegen(context, builder, sig, args):  # noqa: ANN001, ANN202
            _call(builder, "llvm.x86.tdpbf16ps", [ir.Constant(_I8, c), ir.Constant(_I8, a), ir.Constant(_I8, b)])
            return context.get_dummy_value()
        return types.void(), codegen
    return dot


# A pass: rows m..m+ra of x in tile A0 (4), the next rb rows in A1 (5); two panels in B0, B1 (6, 7); C tiles
# (rows x 16 float32): 0 = A0.B0, 1 = A0.B1, 2 = A1.B0, 3 = A1.B1. Each B tile loaded serves up to 32 rows.
_zero = [_tile_zero(t) for t in range(4)]
_zero0, _zero1, _zero2, _zero3 = _zero
_load_a0, _load_a1, _load_b0, _load_b1 = (_tile_memory(t, "llvm.x86.tileloadd64") for t in (4, 5, 6, 7))
_store0, _store1, _store2, _store3 = (_tile_memory(t, "llvm.x86.tilestored64") for t in range(4))
_dot00, _dot01, _dot10, _dot11 = _tile_dot(0, 4, 6), _tile_dot(1, 4, 7), _tile_dot(2, 5, 6), _tile_dot(3, 5, 7)


@njit(cache=True, nogil=True)
def _configure(cfg, ra, rb):  # noqa: ANN001
    """Palette 1 for a pass of ra + rb rows (rb = 0: tiles 2, 3 and 5 unused), 64 bytes a row."""
    for i in range(64):
        cfg[i] = 0
    cfg[0] = 1
    for t, r in ((0, ra), (1, ra), (2, rb), (3, rb), (4, ra), (5, rb), (6, 16), (7, 16)):
        if r:
            cfg[16 + 2 * t] = 64
            cfg[48 + t] = r


SUMS, LINEAR, SWIGLU = 0, 1, 2     # what a pass writes (`_passes`)


@njit(cache=True, nogil=True)
def _passes(x, rows, k_dim, wp, panels, mode, bias, out):  # noqa: ANN001
    """The tile passes over x [rows, k_dim] (bf16 bits, flat) and the packed weight (`pack`, flat), k_dim a multiple
    of 32. Panel pairs outside, passes of 32 rows inside: the weight streams once whatever the row count, and a pair's
    2 x K x 32 bytes stay in cache for its further passes. Each pass's 32 x 32 float32 sums land in an L1 scratch
    and go out by `mode`:
      SUMS: out float32 [rows, panels * 16] = the sums (bias unused);
      LINEAR: out bf16 bits [rows, n], n = bias.shape[0] = the sums + bias, rounded once (bias zeros for none);
      SWIGLU: the weight is [2F, K] (gate rows, then up rows; F % 16 == 0) and a pass pairs gate panel i with up panel
        i + F / 16; out bf16 bits [rows, F] = bf16(up * bf16(swish(gate))) (layers.cpu_swiglu's two rounding
        points; swish from exp(-|gate|), 16 lanes at a time), bias [2F] added to both first."""
    panel = k_dim * PANEL            # bf16 values per panel
    xs = np.int64(2 * k_dim)
    ss = np.int64(4 * 2 * PANEL)     # scratch row stride: 32 float32
    cfg = np.empty(64, np.uint8)
    scratch = np.empty(2 * TILE_ROWS * 2 * PANEL, np.float32)
    t = np.zeros(2 * TILE_ROWS * PANEL, np.float32)
    e = np.empty(2 * TILE_ROWS * PANEL, np.float32)
    z = _zero16()
    one = np.float32(1.0)
    n = bias.shape[0]
    half = panels // 2
    if mode == SWIGLU:
        n = half * PANEL
    like = out[0]
    shape = -1
    steps = half if mode == SWIGLU else (panels + 1) // 2
    for q in range(steps):
        if mode == SWIGLU:
            p0 = q
            p1 = q + half
        else:
            p0 = 2 * q
            p1 = 2 * q + 1
        two = p1 < panels
        b0 = p0 * panel
        b1 = p1 * panel
        for m in range(0, rows, 2 * TILE_ROWS):
            ra = min(TILE_ROWS, rows - m)
            rb = min(TILE_ROWS, rows - m - ra)
            if ra * 32 + rb != shape:   # the last pass of a row count off a multiple of 32 has its own shape
                shape = ra * 32 + rb
                _configure(cfg, ra, rb)
                _tile_config(cfg)
            _zero0()    # only configured tiles: touching an unconfigured one faults (#UD)
            if two:
                _zero1()
            if rb:
                _zero2()
                if two:
                    _zero3()
            xa = m * k_dim
            for k in range(0, k_dim, TILE_K):
                _load_a0(x, xa + k, xs)
                _load_b0(wp, b0 + k * PANEL, np.int64(64))
                _dot00()
                if two:
                    _load_b1(wp, b1 + k * PANEL, np.int64(64))
                    _dot01()
                if rb:
                    _load_a1(x, xa + TILE_ROWS * k_dim + k, xs)
                    _dot10()
                    if two:
                        _dot11()
            _store0(scratch, 0, ss)
            if two:
                _store1(scratch, PANEL, ss)
            if rb:
                _store2(scratch, TILE_ROWS * 2 * PANEL, ss)
                if two:
                    _store3(scratch, TILE_ROWS * 2 * PANEL + PANEL, ss)
            r_all = ra + rb
            if mode == SUMS:
                n_out = panels * PANEL
                for r in range(r_all):
                    for c in range(PANEL):
                        out[(m + r) * n_out + p0 * PANEL + c] = scratch[r * 2 * PANEL + c]
                    if two:
                        for c in range(PANEL):
                            out[(m + r) * n_out + p1 * PANEL + c] = scratch[r * 2 * PANEL + PANEL + c]
            elif mode == LINEAR:
                w0 = min(PANEL, n - p0 * PANEL)
                w1 = min(PANEL, n - p1 * PANEL) if two else 0
                for r in range(r_all):
                    o = (m + r) * n
                    if w0 == PANEL:     # a whole panel: one vector of 16 (rounded as cpu_elements' `_store`)
                        _store16_bf16(out, o + p0 * PANEL, _add16(_load16(scratch, r * 2 * PANEL),
                                                                  _load16(bias, p0 * PANEL)))
                    else:
                        for c in range(w0):
                            out[o + p0 * PANEL + c] = _store(scratch[r * 2 * PANEL + c] + bias[p0 * PANEL + c], like)
                    if w1 == PANEL:
                        _store16_bf16(out, o + p1 * PANEL, _add16(_load16(scratch, r * 2 * PANEL + PANEL),
                                                                  _load16(bias, p1 * PANEL)))
                    else:
                        for c in range(w1):
                            out[o + p1 * PANEL + c] = _store(scratch[r * 2 * PANEL + PANEL + c]
                                                             + bias[p1 * PANEL + c], like)
            else:
                col = p0 * PANEL
                bg = _load16(bias, col)
                bu = _load16(bias, n + col)
                for r in range(r_all):
                    g = _add16(_load16(scratch, r * 2 * PANEL), bg)
                    _store16(scratch, r * 2 * PANEL, g)
                    _store16(scratch, r * 2 * PANEL + PANEL, _add16(_load16(scratch, r * 2 * PANEL + PANEL), bu))
                    for c in range(PANEL):
                        t[r * PANEL + c] = -abs(scratch[r * 2 * PANEL + c])
                    _store16(e, r * PANEL, _exp16_shifted(t, r * PANEL, z))
                for r in range(r_all):
                    for c in range(PANEL):
                        g = scratch[r * 2 * PANEL + c]
                        num = one if g >= np.float32(0.0) else e[r * PANEL + c]
                        e[r * PANEL + c] = g * (num / (one + e[r * PANEL + c]))
                    # swish rounded to bf16, times up, rounded again (layers.cpu_swiglu's two oneDNN stages). The
                    # arithmetic of cpu_bf16_gemv._swiglu_out, kept inline over the pass's rows: a shared per-row
                    # helper called here measured 11.3-11.6 -> 12.9-15.3 ms for SmolLM2's 30 gate_up at 16 rows
                    _store16_bf16(out, (m + r) * n + col,
                                  _mul16(_load16(scratch, r * 2 * PANEL + PANEL), _round16_bf16(_load16(e, r * PANEL))))
    _tile_release()


@njit(cache=True, nogil=True)
def sums(x, rows, k_dim, wp, panels, out):  # noqa: ANN001
    """out [rows, panels * 16] float32 (flat) = x [rows, k_dim] (bf16 bits, flat) @ the packed weight^T."""
    _passes(x, rows, k_dim, wp, panels, SUMS, np.empty(0, np.float32), out)


@njit(cache=True, nogil=True)
def linear(x, rows, k_dim, wp, panels, bias, out):  # noqa: ANN001
    """out bf16 bits [rows, n] = x @ W^T + bias, n = bias.shape[0] (zeros for no bias), float32 sums rounded once."""
    _passes(x, rows, k_dim, wp, panels, LINEAR, bias, out)


@njit(cache=True, nogil=True)
def swiglu(x, rows, k_dim, wp, panels, bias, out):  # noqa: ANN001
    """out bf16 bits [rows, F] = bf16(up * bf16(swish(gate))) for a packed gate_up weight [2F, K], F % 16 == 0; bias
    [2F] (zeros for no bias)."""
    _passes(x, rows, k_dim, wp, panels, SWIGLU, bias, out)


def fits(k: int) -> bool:
    """Inner sizes `pack` takes: a multiple of 32 (N is padded to whole panels)."""
    return k % TILE_K == 0


def pack(weight: torch.Tensor) -> np.ndarray:
    """The bf16 copy of a weight [N, K] in VNNI panels (module docstring): uint16 [ceil(N / 16), K / 2, 16, 2],
    zero columns past N, on 2 MiB pages (a decode step streams it end to end)."""
    n, k = weight.shape
    if not fits(k):
        raise ValueError(f"AMX panels need K % 32 == 0, got K = {k}")
    w = weight.detach().to(torch.bfloat16)
    panels = -(-n // PANEL)
    if n % PANEL:
        w = torch.cat([w, w.new_zeros(panels * PANEL - n, k)])
    src = w.view(torch.int16).reshape(panels, PANEL, k // 2, 2).transpose(1, 2)
    out = huge_page_empty(src.numel(), torch.int16).view(src.shape).copy_(src)
    return out.numpy().view(np.uint16)


__all__ = ["HOST_AMX", "LINEAR", "PANEL", "SUMS", "SWIGLU", "TILE_K", "TILE_ROWS", "fits", "linear", "pack", "sums",
           "swiglu"]
