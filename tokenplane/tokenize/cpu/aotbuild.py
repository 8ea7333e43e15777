"""Build the ahead-of-time kernel module (kernels.py) with numba.pycc: `python -m tokenplane.tokenize.cpu.aotbuild`.

Every export of `kernels.EXPORTS` is compiled from the very Python function the JIT kernel is made of (its
`py_func`), with its explicit signature, for the host CPU, into one extension module, with the packed form of each
export of `kernels.PACKED` (packed.py); callee kernels are compiled into it (numba resolves them from the
materialized JIT dispatchers). pycc's Python wrappers hold the GIL by default; the build compiles them with
`release_gil` exactly where the JIT kernel is `nogil=True` (every export but `kernels.HOLDS_GIL`), so chunk threads
still overlap, and boxes returned arrays without a per-call unpickle (`_array_type_from_environment`). The module and
its record (key, SHA-256 of the module's bytes, exports) are written to a temporary folder and renamed into place,
under a file lock, so a reader sees a complete folder or none. ~1-2 min on one core.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import shutil
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from . import kernels


@contextmanager
def _array_type_from_environment() -> Iterator[None]:
    """Returned arrays boxed with their Python type read from the function's environment, as their dtype is.

    numba's array boxer embeds the array's Python type (np.ndarray) as a pickle that the wrapper unpickles on every
    call; JIT code memoizes that, but a pycc module's `numba_unpickle` is a bare `pickle.loads`: ~1.6 us on every
    call of an export that returns an array (a raw call of `false_at` on one character: 1.97 us, of `codepoints`,
    which returns an int, 0.37). The environment's constants are unpickled once, when the module is imported. The
    same C call with the same arguments otherwise."""
    from llvmlite import ir
    from numba import types
    from numba.core import boxing, cgutils, pythonapi
    from numba.np import numpy_support

    assert boxing.box_array is pythonapi._boxers.functions[types.Array]    # (importing boxing registers it)

    original = boxing.box_array

    def box_array(typ: Any, val: Any, c: Any) -> Any:
        if not c.context.enable_nrt:
            return original(typ, val, c)
        dtypeptr = c.env_manager.read_const(c.env_manager.add_const(numpy_support.as_dtype(typ.dtype)))
        pytype = c.env_manager.read_const(c.env_manager.add_const(typ.box_type))
        api, i32 = c.pyapi, ir.IntType(32)
        fnty = ir.FunctionType(api.pyobj, [api.voidptr, api.pyobj, i32, i32, api.pyobj])
        fn = api._get_function(fnty, name="NRT_adapt_ndarray_to_python_acqref")
        ndim = c.context.get_constant(types.int32, typ.ndim)
        writable = c.context.get_constant(types.int32, int(typ.mutable))
        aryptr = cgutils.alloca_once_value(c.builder, val)
        boxed = c.builder.call(fn, [c.builder.bitcast(aryptr, api.voidptr), pytype, ndim, writable, dtypeptr])
        c.context.nrt.decref(c.builder, typ, val)      # the boxed array steals the native reference
        return boxed

    pythonapi._boxers.functions[types.Array] = box_array
    try:
        yield
    finally:
        pythonapi._boxers.functions[types.Array] = original


def _compile(folder: Path) -> None:
    import llvmlite.binding as llvm

    with warnings.catch_warnings():     # pycc is "pending deprecation" (numba 0.57+); without it: the JIT fallback
        warnings.simplefilter("ignore")
        import numba.pycc.compiler as pycc_compiler
        from numba.pycc import CC

    from .lazyjit import materialize
    from .packed import wrapper

    materialize()
    funcs = {}
    for name in kernels.EXPORTS:
        obj = kernels._jit_kernel(name)
        funcs[name] = getattr(obj, "py_func", obj)
    for name in kernels.PACKED:
        funcs[kernels.packed_name(name)] = wrapper(name)
    holds_gil = {id(funcs[n]) for n in kernels.HOLDS_GIL}
    real_compile_extra = pycc_compiler.compile_extra

    def compile_extra(typingctx: Any, targetctx: Any, func: Any, args: Any, return_type: Any, flags: Any,
                      **kw: Any) -> Any:
        flags = flags.copy()
        flags.release_gil = id(func) not in holds_gil      # the JIT kernels' nogil=True
        return real_compile_extra(typingctx, targetctx, func, args, return_type, flags, **kw)

    cc = CC(kernels.MODULE_NAME)
    cc.output_dir = str(folder)
    cc.target_cpu = llvm.get_host_cpu_name()
    for name in kernels.module_exports():
        cc.export(name, kernels.numba_signature(name))(funcs[name])
    pycc_compiler.compile_extra = compile_extra     # type: ignore[assignment]  # same call, flags adjusted
    try:
        with _array_type_from_environment():
            cc.compile()
    finally:
        pycc_compiler.compile_extra = real_compile_extra


def build(root: Path | None = None, *, force: bool = False) -> Path:
    """Build the module for the current key under `root` (default: kernels.aot_root()) unless a valid one is
    there; returns its folder. Raises what the compiler raises (the caller falls back to JIT)."""
    dest = kernels.module_folder(root)
    dest.parent.mkdir(parents=True, exist_ok=True)
    with open(dest.parent / ".build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not force:
            try:
                kernels.load_module(dest)
                return dest
            except kernels.AotUnavailable:
                pass
        tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=dest.parent))
        os.chmod(tmp, 0o755)     # mkdtemp makes it private; the cache is shared like the tables
        try:
            _compile(tmp)
            so = kernels.module_file(tmp)
            meta = {"key": kernels.cache_key(), "fields": kernels.key_fields(), "sha256": kernels.file_digest(so),
                    "exports": sorted(kernels.module_exports()),
                    "built": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                    "signatures": {n: kernels.numba_signature(n) for n in kernels.module_exports()}}
            (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
            if dest.exists():
                shutil.rmtree(dest)
            os.replace(tmp, dest)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return dest


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--root", default=None, help="folder of AOT modules (default: TOKENPLANE_AOT_DIR or the cache's)")
    p.add_argument("--force", action="store_true")
    p.add_argument("--quiet", action="store_true")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    root = Path(args.root) if args.root else None
    marker = kernels.failure_marker(root)
    try:
        folder = build(root, force=args.force)
    except Exception:
        # recorded, so that processes falling back to JIT stop starting builds that fail the same way
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text(traceback.format_exc())
        raise
    marker.unlink(missing_ok=True)
    if not args.quiet:
        print(f"AOT kernels: {folder} ({time.perf_counter() - t0:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
