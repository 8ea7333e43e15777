"""Compile every device kernel to PTX without a GPU (numba-cuda + NVVM from the nvidia-nvvm / nvidia-cuda-nvrtc
wheels). The simulator executes kernels as Python, so it cannot catch what nopython CUDA typing rejects; this does.

    python -m tokenplane.tokenize.gpu.ptxcheck        # prints one line per kernel, exit 1 on any failure
"""

from __future__ import annotations

import sys

# argument kinds: u8/i4/i8 = 1-D C-contiguous arrays, n = int64 scalar
SIGNATURES = {
    "k_lead": "u8 i4 i4 i4", "k_decode": "u8 i4 i4 i4 i4 i4", "k_docs": "i4 i4 i4 i4",
    "k_classify": "i4 u8 i4 i4 n u8 i4 i4 i4 i4 i4 i4 i4 i4 i4",
    "k_aggregate": "i4 u8 i4 n i4 i4 i4 i4 i4 i4 i4 i4",
    "k_predicate": "i4 u8 i4 i4 n i4 i4 i4 i4 i4 i4 i4 i4 i4",
    "k_pieces": "i4 i4 i4 i4 i4", "k_dispatch": "i4 i4 n n i4 i4 i4",
    "k_bpe_thread": "u8 i4 i4 i4 i4 i4 i4 u8 i8 i4 n i4 i4",
    "k_bpe_warp": "u8 i4 i4 i4 i4 i4 i4 u8 i8 i4 n i4 i4 i4 i4 i4 i4",
    "k_bpe_block": "u8 i4 i4 i4 i4 i4 i4 u8 i8 i4 n i4 i4 i4 i4 i4 i4",
    "k_emit": "i4 i4 i4 i4 i4 i4 i4 i4 i4 i4",
    "scan_tiles": "i4 i4 i4 n n", "scan_sums": "i4 i4 n n n", "scan_apply": "i4 i4 i4 i4 n n n",
}


def compile_all(cc: tuple[int, int] = (9, 0), small_max: int = 32, tpb: int = 256, items: int = 8,
                block_tpb: int = 256) -> dict[str, tuple[bool, str]]:
    from numba import cuda, types

    from .bpe import make_bpe
    from .pretokenize import make_pretokenize
    from .pretokenize_deepseek import make_pretokenize_deepseek
    from .pretokenize_smollm2 import make_pretokenize_smollm2
    from .scan import make_scan

    kinds = {"u8": types.Array(types.uint8, 1, "C"), "i4": types.Array(types.int32, 1, "C"),
             "i8": types.Array(types.int64, 1, "C"), "n": types.int64}
    kernels = dict(make_pretokenize())
    kernels.update({f"{name}_deepseek": k for name, k in make_pretokenize_deepseek().items()})
    kernels.update({f"{name}_smollm2": k for name, k in make_pretokenize_smollm2().items()})
    kernels.update(make_bpe(small_max, block_tpb))
    kernels.update(zip(("scan_tiles", "scan_sums", "scan_apply"), make_scan(tpb, items)))
    # device functions are compiled for "the current device"; without a GPU, name the target explicitly
    import numba.cuda.dispatcher as dispatcher

    class _Target:
        compute_capability = cc

    saved = dispatcher.get_current_device
    dispatcher.get_current_device = lambda: _Target
    results = {}
    try:
        _compile_each(cuda, kernels, kinds, cc, results)
    finally:
        dispatcher.get_current_device = saved
    return results


def _compile_each(cuda, kernels, kinds, cc, results):
    for name, disp in kernels.items():
        sig = tuple(kinds[k] for k in SIGNATURES[name.removesuffix("_deepseek").removesuffix("_smollm2")].split())
        try:
            ptx, _ = cuda.compile_ptx(disp.py_func, sig, cc=cc)
            results[name] = (True, len(ptx))
        except Exception as exc:  # noqa: BLE001 - report every kernel, not just the first failure
            results[name] = (False, f"{type(exc).__name__}: {str(exc)[:600]}")


def main() -> int:
    results = compile_all()
    for name, (ok, info) in results.items():
        print(f"{'ok  ' if ok else 'FAIL'} {name}: {info}")
    return 0 if all(ok for ok, _ in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
