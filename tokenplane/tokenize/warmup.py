"""`tokenplane warmup`: build every on-disk cache a fresh process's first encode reads, ahead of that process.

First the ahead-of-time kernel module of the default encode path (cpu/aotbuild.py: a fresh process then encodes
without importing numba). Then per registered tokenizer: the verified (converted) file, its vocabulary record and
the per-token facts sessions read (spec/vocabmeta.py), the BPE tables (cpu/bpetables.py), the per-code-point tables
the pre-tokenizer and the cut search derive (charclass.derived_table), and every numba kernel of the CPU path and of
sessions, serial and chunk-parallel (compiled once per machine into numba's cache: the JIT fallback when the AOT
module is absent or stale). Nothing depends on it having run: each cache is built on demand when absent, at the
cost of that first process (the AOT module by a detached build, cpu/kernels.py). The README's set-up runs it after
`pip install`.
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


def main_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--families", default="all", help="comma list of registered tokenizers, or all")


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
    return 0
