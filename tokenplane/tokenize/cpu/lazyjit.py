"""`njit` without importing numba until a JIT kernel actually runs.

`import numba` costs ~0.25 s and loading its cached kernels ~0.2 s more: most of a cold start. When the
ahead-of-time kernel module (kernels.py, built by aotbuild.py) is present the default encode path never needs
numba, so the kernel modules (strbuf, pretokenize, bpe, boundary, segments) declare their kernels through this
module: `njit(...)(f)` returns a `LazyKernel` that remembers f and the options. The first call of any lazy kernel
(the JIT fallback, sessions, tests, the AOT builder) *materializes* all of them at once: numba is imported, every
LazyKernel gets its real dispatcher (`njit(**options)(f)`: same function, same on-disk cache as a plain decorator),
and every tokenplane module global bound to a LazyKernel or to a `numba_global` placeholder is rebound to the real
object. Nested kernels therefore see real dispatchers when numba types them (a kernel calling another resolves the
callee from its module globals at compile time), and Python callers that kept the proxy still work (it forwards).
"""

from __future__ import annotations

import importlib
import sys
import threading
from contextlib import AbstractContextManager
from typing import Any, Callable

_lock = threading.RLock()
_materialized = False
_kernels: list[LazyKernel] = []
_placeholders: list[NumbaGlobal] = []


class LazyKernel:
    """A kernel declared with `njit(**options)` whose dispatcher is made on first use (see the module docstring)."""

    def __init__(self, func: Callable[..., Any], options: dict[str, Any]):
        self.py_func = func
        self.options = options
        self.real: Any = None

    def dispatcher(self) -> Any:
        if self.real is None:
            materialize()
        return self.real

    def __call__(self, *args: Any) -> Any:
        return self.dispatcher()(*args)

    def __getattr__(self, name: str) -> Any:       # signatures, inspect_types, ... of the real dispatcher
        if name in ("py_func", "options", "real"):   # not set yet (copy/unpickle): no recursion through dispatcher
            raise AttributeError(name)
        return getattr(self.dispatcher(), name)


class NumbaGlobal:
    """Stands for a numba object a kernel calls (e.g. `_get_code_point`) until materialization rebinds it."""

    def __init__(self, module: str, name: str):
        self.module, self.name = module, name

    def resolve(self) -> Any:
        return getattr(importlib.import_module(self.module), self.name)

    def __call__(self, *args: Any) -> Any:
        materialize()
        return self.resolve()(*args)


def njit(**options: Any) -> Callable[[Callable[..., Any]], Any]:
    """numba.njit(**options), deferred: a LazyKernel before materialization, the real dispatcher after."""
    def wrap(func: Callable[..., Any]) -> Any:
        with _lock:
            if _materialized:
                from numba import njit as real_njit
                with _keyed_cache():
                    return real_njit(**options)(func)
            k = LazyKernel(func, options)
            _kernels.append(k)
            return k
    return wrap


def _keyed_cache() -> AbstractContextManager[None]:
    """numba's on-disk cache in a folder keyed like the AOT module (kernels.cache_key: every kernel source, the numba,
    numpy and Python versions, the machine) while the dispatchers are made (why: ../../kernel_cache.py)."""
    from ...kernel_cache import cached_under
    from .kernels import numba_cache_dir

    return cached_under(numba_cache_dir())


def numba_global(module: str, name: str) -> Any:
    """`from module import name` for a numba object used inside kernels, deferred like `njit`."""
    with _lock:
        if _materialized:
            return getattr(importlib.import_module(module), name)
        p = NumbaGlobal(module, name)
        _placeholders.append(p)
        return p


def materialize() -> None:
    """Import numba (without its BLAS probe's scipy import) and give every lazy kernel its dispatcher; idempotent."""
    global _materialized
    with _lock:
        if _materialized:
            return
        from .numbastart import skip_blas_probe

        skip_blas_probe()
        from numba import njit as real_njit

        with _keyed_cache():
            for k in _kernels:
                k.real = real_njit(**k.options)(k.py_func)
        real_of = {id(k): k.real for k in _kernels}
        real_of.update({id(p): p.resolve() for p in _placeholders})
        for name, mod in list(sys.modules.items()):
            if mod is None or not name.startswith("tokenplane."):
                continue
            for attr, value in list(vars(mod).items()):
                if isinstance(value, (LazyKernel, NumbaGlobal)) and id(value) in real_of:
                    setattr(mod, attr, real_of[id(value)])
        _materialized = True


def materialized() -> bool:
    return _materialized
