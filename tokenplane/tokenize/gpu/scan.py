"""Device prefix scans (sum and max) whose length lives in device memory.

Three phases, the classic tile decomposition: reduce each tile of `tpb * items` elements (each thread folds
`items` consecutive elements serially, as CUB does), scan the tile totals in one block,
then scan inside each tile and add the tile's prefix. The element count is read from `meta[n_idx]` on the device, and
every loop is grid-stride with block-uniform trip counts, so the launch geometry depends only on buffer capacity: the
same launches serve any input in a bucket and can be captured once into a CUDA graph.
"""

from __future__ import annotations

from functools import cache
from typing import Any, Callable

OP_ADD = 0
OP_MAX = 1


@cache
def make_scan(tpb: int, items: int) -> tuple[Callable, Callable, Callable]:
    # kernels must see `cuda` as a module global: the simulator swaps it in the function's globals
    global cuda, int32
    from numba import cuda, int32

    @cuda.jit(device=True)
    def combine(a, b, op):
        if op == 0:
            return a + b
        return a if a > b else b

    @cuda.jit(device=True)
    def identity(op):
        return int32(0) if op == 0 else int32(-1)

    @cuda.jit(device=True)
    def block_inclusive(sh, tid, op):
        d = 1
        while d < tpb:
            t = sh[tid]
            if tid >= d:
                t = combine(sh[tid - d], t, op)
            cuda.syncthreads()
            sh[tid] = t
            cuda.syncthreads()
            d *= 2

    tile = tpb * items

    @cuda.jit
    def scan_tiles(src, sums, meta, n_idx, op):
        # each thread folds `items` consecutive elements, then the block folds the thread totals
        sh = cuda.shared.array(tpb, dtype=int32)
        tid = cuda.threadIdx.x
        n = meta[n_idx]
        ntiles = (n + tile - 1) // tile
        t = cuda.blockIdx.x
        while t < ntiles:
            acc = identity(op)
            i = t * tile + tid * items
            for j in range(items):
                if i + j < n:
                    acc = combine(acc, src[i + j], op)
            sh[tid] = acc
            cuda.syncthreads()
            block_inclusive(sh, tid, op)
            if tid == 0:
                sums[t] = sh[tpb - 1]
            cuda.syncthreads()
            t += cuda.gridDim.x

    @cuda.jit
    def scan_sums(sums, meta, n_idx, op, total_idx):
        # one block: exclusive scan of the tile totals in place, carrying across chunks
        sh = cuda.shared.array(tpb, dtype=int32)
        tid = cuda.threadIdx.x
        n = meta[n_idx]
        ntiles = (n + tile - 1) // tile
        carry = identity(op)
        base = 0
        while base < ntiles:
            i = base + tid
            v = sums[i] if i < ntiles else identity(op)
            sh[tid] = v
            cuda.syncthreads()
            block_inclusive(sh, tid, op)
            excl = sh[tid - 1] if tid > 0 else identity(op)
            if i < ntiles:
                sums[i] = combine(carry, excl, op)
            carry = combine(carry, sh[tpb - 1], op)
            cuda.syncthreads()
            base += tpb
        if tid == 0 and total_idx >= 0:
            meta[total_idx] = carry

    @cuda.jit
    def scan_apply(src, dst, sums, meta, n_idx, op, exclusive):
        sh = cuda.shared.array(tpb, dtype=int32)
        tid = cuda.threadIdx.x
        n = meta[n_idx]
        ntiles = (n + tile - 1) // tile
        t = cuda.blockIdx.x
        while t < ntiles:
            acc = identity(op)
            i = t * tile + tid * items
            for j in range(items):
                if i + j < n:
                    acc = combine(acc, src[i + j], op)
            sh[tid] = acc
            cuda.syncthreads()
            block_inclusive(sh, tid, op)
            run = combine(sums[t], sh[tid - 1] if tid > 0 else identity(op), op)
            cuda.syncthreads()
            for j in range(items):
                if i + j < n:
                    v = src[i + j]
                    nxt = combine(run, v, op)
                    dst[i + j] = run if exclusive else nxt
                    run = nxt
            t += cuda.gridDim.x

    return scan_tiles, scan_sums, scan_apply


def launch_scan(kernels: tuple[Callable, Callable, Callable], grid: int, tpb: int, stream: Any, src: Any, dst: Any,
                sums: Any, meta: Any, n_idx: int, op: int,
                exclusive: bool, total_idx: int = -1) -> None:
    """dst = scan(src[:meta[n_idx]]); src and dst may alias. With total_idx >= 0, meta[total_idx] = the total."""
    scan_tiles, scan_sums, scan_apply = kernels
    scan_tiles[grid, tpb, stream](src, sums, meta, n_idx, op)
    scan_sums[1, tpb, stream](sums, meta, n_idx, op, total_idx)
    scan_apply[grid, tpb, stream](src, dst, sums, meta, n_idx, op, 1 if exclusive else 0)
