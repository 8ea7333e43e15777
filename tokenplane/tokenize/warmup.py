"""`tokenplane warmup`: build every on-disk cache a fresh process's first encode reads, ahead of that process.

Per registered tokenizer: the verified (converted) file, its vocabulary record (spec/vocabmeta.py), the BPE tables
(cpu/bpetables.py) and every numba kernel of the CPU path, serial and chunk-parallel (compiled once per machine into
numba's cache, then only loaded). Nothing depends on it having run: each cache is built on demand when absent, at
the cost of that first process. The README's set-up runs it after `pip install`.
"""

from __future__ import annotations

import argparse
import time

from .errors import ArtifactError
from .registry import load
from .spec.artifacts import ARTIFACTS


def warm(names: list[str]) -> list[tuple[str, float, str]]:
    """(name, seconds, outcome) per tokenizer; a tokenizer whose package is not installed is skipped, not an error."""
    out = []
    for name in names:
        t0 = time.perf_counter()
        try:
            tok = load(name)
        except ArtifactError as exc:
            out.append((name, time.perf_counter() - t0, f"skipped: {exc}"))
            continue
        cpu = tok.path("cpu")
        get = getattr(cpu, "get", None)
        if get is not None:
            get()       # tables + every kernel of the serial and parallel paths (router.fast_paths' build)
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
    for name, seconds, outcome in warm(names):
        print(f"{name:12s} {seconds:6.2f} s  {outcome}")
    return 0
