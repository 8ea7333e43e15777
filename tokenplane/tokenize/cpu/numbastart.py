"""Numba's first kernel load in a process, without the BLAS probe's scipy import.

The first cached kernel a process loads makes numba import its implementation registries; one of them,
`numba.np.arraymath`, probes for BLAS at import time by importing `scipy.linalg.cython_blas`, and on this stack that
import (scipy.linalg, its array-API shim, numpy.f2py, cffi's parser) is ~0.3-0.5 s of a ~1 s cold start. The
probe's only use is `_HAVE_BLAS`, which picks BLAS over a plain loop for float `np.convolve`/`np.correlate` inside
jitted code; no tokenplane kernel calls them, and `np.dot`/`np.linalg` check BLAS again when they compile (their own
`ensure_blas`), so they are unaffected. `skip_blas_probe` imports arraymath once with that single module masked,
then unmasks it: everything else in the process imports scipy as usual.
"""

from __future__ import annotations

import sys

_BLAS = "scipy.linalg.cython_blas"


def skip_blas_probe() -> None:
    """Import numba's arraymath registry with its BLAS probe failing fast (see the module docstring). A no-op when
    arraymath or scipy.linalg is already imported (nothing left to save) or TOKENPLANE_NUMBA_BLAS_PROBE=1."""
    import os

    if "numba.np.arraymath" in sys.modules or "scipy.linalg" in sys.modules \
            or os.environ.get("TOKENPLANE_NUMBA_BLAS_PROBE") == "1":
        return
    had = _BLAS in sys.modules
    saved = sys.modules.get(_BLAS)
    sys.modules[_BLAS] = None   # type: ignore[assignment]  # None in sys.modules: that import raises ImportError
    try:
        import numba.np.arraymath  # noqa: F401
    finally:
        if had:
            sys.modules[_BLAS] = saved  # type: ignore[assignment]
        else:
            sys.modules.pop(_BLAS, None)
