"""Warp intrinsics for numba-cuda's CUDA simulator.

The simulator runs every CUDA thread of a block as a Python thread and models `syncthreads`, shared memory and
atomics, but it has no warp-level intrinsics (`shfl_*_sync`, `ballot_sync`, `syncwarp`). The warp-per-piece BPE
kernel needs them, so this module adds them to the simulator's fake `cuda` module: each warp gets a barrier of its
lanes and a slot per lane; an intrinsic writes its lane's value, waits for the whole warp, reads, and waits again so
that no lane overwrites a slot before every lane has read it. Like the hardware `*_sync` forms with a full mask,
every lane of the warp must reach the same sequence of intrinsics (the kernels keep warps converged there).

Only imported when `NUMBA_ENABLE_CUDASIM=1`; never touches a real GPU.
"""

from __future__ import annotations

import threading

_installed = False
_state_lock = threading.Lock()


def _warp_state(module) -> tuple[threading.Barrier, list]:
    thread = threading.current_thread()
    block = (thread.blockIdx.x, thread.blockIdx.y, thread.blockIdx.z)
    warp = thread.thread_id // 32
    with _state_lock:
        states = module.__dict__.setdefault("_tokenplane_warps", {})
        key = (block, warp)
        state = states.get(key)
        if state is None:
            bdim = module.blockDim
            nthreads = bdim.x * bdim.y * bdim.z
            lanes = min(32, nthreads - warp * 32)
            state = (threading.Barrier(lanes), [None] * 32)
            states[key] = state
    return state


def _exchange(module, value):
    barrier, slots = _warp_state(module)
    lane = threading.current_thread().thread_id % 32
    slots[lane] = value
    barrier.wait()
    snapshot = list(slots)
    barrier.wait()
    return lane, snapshot


def install() -> None:
    """Add shfl_sync / shfl_down_sync / shfl_xor_sync / ballot_sync / syncwarp to the simulator (idempotent)."""
    global _installed
    if _installed:
        return
    from numba.cuda.simulator.kernelapi import FakeCUDAModule

    def shfl_sync(self, mask, value, src_lane):
        _, snap = _exchange(self, value)
        return snap[int(src_lane) % 32]

    def shfl_xor_sync(self, mask, value, lane_mask):
        lane, snap = _exchange(self, value)
        src = lane ^ int(lane_mask)
        return snap[src] if src < 32 and snap[src] is not None else value

    def shfl_down_sync(self, mask, value, delta):
        lane, snap = _exchange(self, value)
        src = lane + int(delta)
        return snap[src] if src < 32 and snap[src] is not None else value

    def ballot_sync(self, mask, predicate):
        _, snap = _exchange(self, bool(predicate))
        bits = 0
        for lane, p in enumerate(snap):
            if p:
                bits |= 1 << lane
        return bits

    def syncwarp(self, mask=0xFFFFFFFF):
        _exchange(self, None)

    FakeCUDAModule.shfl_sync = shfl_sync
    FakeCUDAModule.shfl_xor_sync = shfl_xor_sync
    FakeCUDAModule.shfl_down_sync = shfl_down_sync
    FakeCUDAModule.ballot_sync = ballot_sync
    FakeCUDAModule.syncwarp = syncwarp
    _installed = True
