"""`tokenplane warmup`: build every on-disk cache a fresh process's first encode reads, ahead of that process.

First the ahead-of-time kernel module of the default encode path (cpu/aotbuild.py: a fresh process then encodes
without importing numba). Then per registered tokenizer: the verified (converted) file, its vocabulary record and
the per-token facts sessions read (spec/vocabmeta.py), the BPE tables (cpu/bpetables.py), the per-code-point tables
the pre-tokenizer and the cut search derive (charclass.derived_table), and every numba kernel of the CPU path and of
sessions, serial and chunk-parallel (compiled once per machine into numba's cache: the JIT fallback when the AOT
module is absent or stale). Nothing depends on it having run: each cache is built on demand when absent, at the
cost of that first process (the AOT module by a detached build, cpu/kernels.py). The README's set-up runs it after
`pip install`. Last, the kernel caches earlier versions of the sources left behind are removed, but the most recent
few (../kernel_cache.py's `prune`; `--keep-caches`).
"""

from __future__ import annotations

import argparse
import time

from .errors import ArtifactError
from .registry import load
from .router import _WARM_TEXT
from .spec.artifacts import ARTIFACTS


def warm_bytecode() -> tuple[float, str]:
    """(seconds, outcome) of byte-compiling the package, as a wheel install does (an editable install does not, and
    under PYTHONDONTWRITEBYTECODE every fresh process would recompile tokenplane's sources: ~40 ms of a cold start)."""
    import compileall
    from pathlib import Path

    t0 = time.perf_counter()
    ok = compileall.compile_dir(str(Path(__file__).resolve().parents[1]), quiet=1)
    return time.perf_counter() - t0, "ready" if ok else "some files did not compile (see above)"


def warm_aot() -> tuple[float, str]:
    """(seconds, outcome) of building the AOT kernel module (a no-op when a valid one is there)."""
    from .cpu import aotbuild, kernels

    t0 = time.perf_counter()
    try:
        folder = aotbuild.build()
    except Exception as exc:    # noqa: BLE001 - any compiler failure: the JIT kernels serve, say why
        return time.perf_counter() - t0, f"not built ({type(exc).__name__}: {exc}); the numba JIT kernels serve"
    kernels.failure_marker().unlink(missing_ok=True)
    kernels.reset()
    return time.perf_counter() - t0, f"ready ({folder})"


def warm(names: list[str]) -> list[tuple[str, float, str]]:
    """(name, seconds, outcome) per tokenizer; a tokenizer whose package is not installed is skipped, not an error."""
    from .cpu import kernels

    out = []
    for name in names:
        t0 = time.perf_counter()
        try:
            tok = load(name)
        except ArtifactError as exc:
            out.append((name, time.perf_counter() - t0, f"skipped: {exc}"))
            continue
        _ = tok.vocab_facts     # what a session reads instead of building the reference engine (spec/vocabmeta.py)
        cpu = tok.path("cpu")
        get = getattr(cpu, "get", None)
        if get is not None:
            enc = get()     # tables + every kernel of the serial and parallel paths (router.fast_paths' build)
            chosen = kernels.get()
            kernels.reset(kernels.jit_kernels())     # the same encodes on the JIT kernels: numba's cache
            try:
                enc.encode(_WARM_TEXT, parallel=False)
                enc.encode_parallel(_WARM_TEXT * 8, n_chunks=2)
                session = tok.session(encode_path="cpu")       # the session kernels (records, splice search)
                for text in (_WARM_TEXT * 4, _WARM_TEXT * 5, "x" + _WARM_TEXT[1:] + _WARM_TEXT * 4):
                    session.sync(text)
            finally:
                kernels.reset(chosen)
        out.append((name, time.perf_counter() - t0, "ready" if cpu is not None else "no fast path (reference only)"))
    return out


def prune_caches(keep_recent: int) -> tuple[float, str]:
    """(seconds, outcome) of removing the tokenizer's and the engine's kernel caches of other source versions but the
    `keep_recent` most recent of each kind (kernel_cache.prune); the engine's are kept when it is not installed."""
    from .. import kernel_cache
    from .cpu import kernels

    t0 = time.perf_counter()
    current = {kernels.cache_key()}
    roots = {kernels.aot_root(), kernels.numba_cache_dir().parent}
    try:
        from ..engine.numbacache import cache_dir as engine_cache_dir
    except ImportError:     # no engine extra (torch) here: its key is unknown, so none of its folders is touched
        for root in roots:
            current |= {p.name for p in root.glob("engine-*")}
    else:
        current.add(engine_cache_dir().name)
        roots.add(engine_cache_dir().parent)
    removed = [r for root in sorted(roots) for r in kernel_cache.prune(root, current, keep_recent)]
    mb = sum(size for _, size in removed) / 1e6
    return time.perf_counter() - t0, f"removed {len(removed)} folders of other source versions ({mb:.0f} MB)"


def main_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--families", default="all", help="comma list of registered tokenizers, or all")
    from ..kernel_cache import KEEP_RECENT

    p.add_argument("--keep-caches", type=int, default=KEEP_RECENT, metavar="N",
                   help=f"kernel caches of other source versions to keep, most recent first (default {KEEP_RECENT}; "
                        "-1 keeps them all)")


def main(args: argparse.Namespace) -> int:
    names = list(ARTIFACTS) if args.families == "all" else args.families.split(",")
    unknown = [n for n in names if n not in ARTIFACTS]
    if unknown:
        print(f"unknown tokenizers: {unknown}; known: {sorted(ARTIFACTS)}")
        return 2
    for label, step in (("bytecode", warm_bytecode), ("AOT kernels", warm_aot)):
        seconds, outcome = step()
        print(f"{label:12s} {seconds:6.2f} s  {outcome}")
    for name, seconds, outcome in warm(names):
        print(f"{name:12s} {seconds:6.2f} s  {outcome}")
    if args.keep_caches >= 0:
        seconds, outcome = prune_caches(args.keep_caches)
        print(f"{'old caches':12s} {seconds:6.2f} s  {outcome}")
    return 0
