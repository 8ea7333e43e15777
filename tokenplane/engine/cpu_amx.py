"""bfloat16 products on Intel AMX tiles (TDPBF16PS) for numba kernels: the few-row linears of a bf16 model's decode.

Why: at 1-16 rows a bf16 linear is a weight stream. oneDNN's bf16 linear (what vLLM's CPU backend and torch run)
streams SmolLM2-135M's four linear shapes x 30 layers at ~6.7 GB/s on a Sapphire Rapids core, 1-32 rows alike
(F.linear, 29.5-33 ms a pass); the AVX-512 panel kernel (cpu_bf16_gemv) reaches ~15 GB/s at 1-8 rows but is
FMA-bound past 8 (28.7 ms at 16 rows). Tiles do 16 rows x 32 columns x 32 k in two instructions, so the stream
stays the bound at every row count up to 16: 14.0-14.9 ms for the same pass at 1 / 4 / 8 / 16 rows, measured
side by side (/tmp/exp40/amx/bench.py in stop 40's note).

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
TILE_ROWS = 16                 # rows of an A or C tile
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


# tiles 0, 1: C (r rows x 16 float32); 2: A (r rows x 32 bf16); 3, 4: B (16 pair rows x 16 columns)
_zero0, _zero1 = _tile_zero(0), _tile_zero(1)
_load_a, _load_b0, _load_b1 = (_tile_memory(t, "llvm.x86.tileloadd64") for t in (2, 3, 4))
_store_c0, _store_c1 = (_tile_memory(t, "llvm.x86.tilestored64") for t in (0, 1))
_dot0, _dot1 = _tile_dot(0, 2, 3), _tile_dot(1, 2, 4)


@njit(cache=True, nogil=True)
def _configure(cfg, rows):  # noqa: ANN001
    """Palette 1: tiles 0-2 `rows` rows, 3-4 16 rows, 64 bytes a row each."""
    for i in range(64):
        cfg[i] = 0
    cfg[0] = 1
    for t in range(5):
        cfg[16 + 2 * t] = 64
        cfg[48 + t] = rows if t < 3 else 16


@njit(cache=True, nogil=True)
def sums(x, rows, k_dim, wp, panels, out):  # noqa: ANN001
    """out [rows, panels * 16] float32 (flat) = x [rows, k_dim] (bf16 bits, flat) @ the packed weight (`pack`, flat)^T,
    16 rows a pass (each pass streams the weight once); k_dim a multiple of 32."""
    n_out = panels * PANEL
    panel = k_dim * PANEL            # bf16 values per panel
    cfg = np.empty(64, np.uint8)
    for m in range(0, rows, TILE_ROWS):
        r = min(TILE_ROWS, rows - m)
        _configure(cfg, r)
        _tile_config(cfg)
        xa = m * k_dim
        for p in range(0, panels - 1, 2):
            _zero0()
            _zero1()
            b = p * panel
            for k in range(0, k_dim, TILE_K):
                _load_a(x, xa + k, np.int64(2 * k_dim))
                _load_b0(wp, b + k * PANEL, np.int64(64))
                _dot0()
                _load_b1(wp, b + panel + k * PANEL, np.int64(64))
                _dot1()
            _store_c0(out, m * n_out + p * PANEL, np.int64(4 * n_out))
            _store_c1(out, m * n_out + (p + 1) * PANEL, np.int64(4 * n_out))
        if panels % 2:
            p = panels - 1
            _zero0()
            b = p * panel
            for k in range(0, k_dim, TILE_K):
                _load_a(x, xa + k, np.int64(2 * k_dim))
                _load_b0(wp, b + k * PANEL, np.int64(64))
                _dot0()
            _store_c0(out, m * n_out + p * PANEL, np.int64(4 * n_out))
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
