"""bfloat16 products on Intel AMX tiles (TDPBF16PS) for numba kernels: the few-row linears of a bf16 model's decode.

Why: at decode sizes a bf16 linear is a weight stream. oneDNN's packed bf16 linear (the engine's path past these
rows; vLLM's CPU backend runs oneDNN too) streams SmolLM2-135M's four linear shapes x 30 layers in 21.2 ms at 1 row
on a Sapphire Rapids core (~10 GB/s; F.linear: 29.5 ms), and the AVX-512 panels (cpu_bf16_gemv) are FMA-bound past
8 rows. A pass here puts 32 rows in two A tiles against two B tiles of 32 columns, so the weight streams once at any
row count: 14.7 / 15.1 / 18.3 / 25.2 / 61.6 ms at 1 / 16 / 32 / 64 / 256 rows against oneDNN's 21.2 / 22.0 / 24.9 /
29.0 / 51.6, measured alternately in one process (benchmarks/peers/amx_linear_ab.py). Past 64 rows (prefill)
oneDNN's blocking wins and keeps those.

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
from functools import cache
from typing import Any

import llvmlite.binding as llvm
import numpy as np
import torch
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from tokenplane.engine.cpu_malloc import huge_page_empty

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
    if os.environ.get("TOKENPLANE_AMX") == "0" or os.uname().machine != "x86_64":
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


@njit(cache=True, nogil=True)
def sums(x, rows, k_dim, wp, panels, out):  # noqa: ANN001
    """out [rows, panels * 16] float32 (flat) = x [rows, k_dim] (bf16 bits, flat) @ the packed weight (`pack`, flat)^T;
    k_dim a multiple of 32. Panel pairs outside, passes of 32 rows inside: the weight streams once whatever the row
    count, and a pair's 2 x K x 32 bytes stay in cache for its further passes."""
    n_out = panels * PANEL
    panel = k_dim * PANEL            # bf16 values per panel
    xs = np.int64(2 * k_dim)
    os_ = np.int64(4 * n_out)
    cfg = np.empty(64, np.uint8)
    shape = -1
    for p in range(0, panels, 2):
        two = p + 1 < panels
        b = p * panel
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
                _load_b0(wp, b + k * PANEL, np.int64(64))
                _dot00()
                if two:
                    _load_b1(wp, b + panel + k * PANEL, np.int64(64))
                    _dot01()
                if rb:
                    _load_a1(x, xa + TILE_ROWS * k_dim + k, xs)
                    _dot10()
                    if two:
                        _dot11()
            o = m * n_out + p * PANEL
            _store0(out, o, os_)
            if two:
                _store1(out, o + PANEL, os_)
            if rb:
                _store2(out, o + TILE_ROWS * n_out, os_)
                if two:
                    _store3(out, o + TILE_ROWS * n_out + PANEL, os_)
    _tile_release()


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


__all__ = ["HOST_AMX", "PANEL", "TILE_K", "TILE_ROWS", "fits", "pack", "sums"]
