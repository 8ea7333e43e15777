"""The kernels of the default encode path: ahead-of-time compiled when that module is built, numba JIT otherwise.

A fresh process spends ~0.45 s importing numba and loading its cached kernels before the first useful instruction
(benchmarks/results/cold_start.md, `numba-floor`). aotbuild.py compiles the same kernel functions (the `_impl` /
`py_func` of strbuf, pretokenize, bpe, merge, boundary, segments, and the session kernels of records, splice and
textstore) with explicit signatures into one extension module (numba.pycc), stored in the on-disk cache under a key
of everything that decides its code: the kernel sources, the numba / numpy / Python versions and the machine (the
module is compiled for the host CPU). Loading it is a dlopen (~1 ms) and needs numpy only; this module never imports
numba.

`get()` answers, once per process, the kernel set every caller uses: the AOT module when its folder for the current
key holds a module whose bytes still hash to what the builder recorded, else the JIT kernels (lazyjit.py: numba
is imported on their first call). When the AOT module is absent, a detached build is started (`tokenplane warmup`
builds it ahead; TOKENPLANE_AOT_BUILD=0 stops the background build, TOKENPLANE_AOT=0 disables the AOT path,
TOKENPLANE_AOT_DIR moves the modules out of the cache).

A compiled kernel trusts its arguments' dtypes and layout (a mismatch is a crash or a wrong answer, not an error),
so every AOT call goes through a guard that checks each array's dtype, rank and C-contiguity and each str argument's
type, and hands anything else to the JIT kernel: same answer, never a crash.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import json
import os
import platform
import re
import subprocess
import sys
import threading
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

import numpy as np

from ..spec.artifacts import cache_dir

MODULE_NAME = "tokenplane_kernels"      # the extension's PyInit_ name: fixed, the folder carries the key
KEY_VERSION = 1                         # bump when what goes into the module changes outside the hashed sources
_HERE = Path(__file__).resolve().parent
# The modules whose source decides the compiled code: the kernels, this table of signatures, the lazy decorator.
SOURCES = ("strbuf.py", "pretokenize.py", "o200k_rescan.py", "runbits.py", "startbits.py", "maskbits.py",
           "deepseekbits.py", "o200kbits.py", "simdbits.py", "borrow.py", "unaligned.py", "prefetch.py", "bpe.py",
           "merge.py", "backtrack.py", "boundary.py", "segments.py", "window.py", "piecemap.py", "fullencode.py",
           "fullbatch.py", "packed.py", "../appendwin.py", "../records.py", "../splice.py", "../textstore.py",
           "../packedrun.py", "lazyjit.py", "kernels.py", "aotbuild.py")

# -- the export table: name -> (module, attribute, return type, argument types) ------------------------------------
# Argument types: "str" (a Python str, numba unicode_type), "int64", "boolean", or (dtype, ndim) for a C-contiguous
# array. Every signature is the one the callers pass (tests/test_aot_kernels.py runs each through both paths).
S, I, B = "str", "int64", "boolean"  # noqa: E741  (I: int64, as in a signature)


def A(dtype: str, ndim: int = 1) -> tuple[str, int]:
    return (dtype, ndim)


REC = (A("uint32"), A("int64"), A("uint16"), A("int64"), A("int64"))    # records.Records.kernel_args()[:5]
# the BPE tables and one thread's piece cache, in encode_pieces' order (after its buf and bounds)
BPE_ARGS = (A("int32"), A("uint64", 2), B, B, A("uint64"), A("int32"), A("uint8"), A("int64"), A("uint64", 2),
            A("uint32", 2), A("uint8", 2), A("int32"), A("int32", 2), A("int32"))
# the fused window kernels (window.py): text, lo, hi, spans, shift | family tables | WINDOW_TAIL
WINDOW_HEAD = (S, I, I, A("int64", 2), I)
WINDOW_RET = "Tuple((uint32[::1], int64[::1], int64[::1], int64))"
# the fused full-encode block kernels (fullencode.py): text, a, b, lookahead, scratch (code points, classes, starts,
# UTF-8, bounds) | family tables | missing bytes, BPE tables, the small whole-token map (piecemap.whole_map),
# backtrack.py's tables, the thread's piece map (piecemap.py: slots, arena, state) and its pair-validity memo
FULL_HEAD = (S, I, I, S, A("uint32"))
FULL_SCRATCH = (A("boolean"), A("uint8"), A("int64"))
FULL_TAIL = (B, A("boolean"), *BPE_ARGS[:8], A("uint64", 2), A("uint64"), A("int64", 2), A("uint64", 2), A("uint32"),
             A("int64"), A("uint64"))
FULL_RET = "Tuple((int32[::1], int64))"
# a window's tail: token_chars, then the walk's (piecemap.walk_tail: the thread's piece map, as a full encode)
WINDOW_TAIL = (A("uint16"), *FULL_TAIL, A("uint8"))     # + the window's scratch (window.py `_take`)
BATCH_HEAD = (S, A("int64", 2), A("uint32"))
BATCH_RET = "Tuple((int32[::1], int64[::1], int64))"
# the fused append window (tokenize/appendwin.py): text, base, d, w, the records (no tc), commit flag | NFC flag and
# inert table, the splice search's tables and limits | family tables | the window tail
APPEND_HEAD = (S, I, I, I, A("uint32"), A("int64"), A("int64"), A("int64"), I, B)
APPEND_MID = (B, A("boolean"), A("boolean"), A("uint8"), A("uint8", 2), B, I, I, I)
APPEND_RET = "UniTuple(int64, 3)"
APPEND_OUT = (A("uint32"), A("int64"))       # the thread's scratch for the new records


EXPORTS: dict[str, tuple[str, str, str, tuple[Any, ...]]] = {
    # strbuf: code points / UTF-8 straight from the str's buffer
    "codepoints": ("strbuf", "_codepoints", "int64", (S, I, I, A("uint32"))),
    "sampled_sizes": ("strbuf", "_sampled_sizes", "void", (S, I, A("int64"))),
    "false_at": ("strbuf", "_false_at", "int64[::1]", (S, I, I, A("boolean"))),
    "utf8_and_bounds": ("strbuf", "_utf8_and_bounds", "UniTuple(int64, 2)",
                        (A("uint32"), I, A("boolean"), A("uint8"), A("int64"))),
    # pretokenize: per-code-point feature gathers (one per table dtype) and the family loops
    "gather_i8": ("pretokenize", "_gather", "int8[::1]", (A("int8"), A("uint32"))),
    "gather_u8": ("pretokenize", "_gather", "uint8[::1]", (A("uint8"), A("uint32"))),
    "gpt4_loop": ("pretokenize", "_gpt4_loop", "void", (A("int32"), A("int8"), I, B, A("boolean"))),
    "o200k_loop": ("pretokenize", "_o200k_loop", "int64", (A("int32"), A("uint8"), A("boolean"), A("int64"))),
    "deepseek_loop": ("pretokenize", "_deepseek_loop", "void", (A("int32"), A("uint8"), A("boolean"))),
    "smollm2_loop": ("pretokenize", "_smollm2_loop", "void", (A("int32"), A("int8"), A("boolean"))),
    # bpe
    "encode_pieces": ("bpe", "_encode_pieces", "int32[::1]", (A("uint8"), A("int64"), *BPE_ARGS)),
    "any_of": ("bpe", "_any_of", "boolean", (A("uint8"), A("boolean"))),
    # boundary: the chunk-cut search (holds the GIL, as the JIT kernel does: see boundary.py)
    "scan_first_stable": ("boundary", "_scan_first_stable", "int64",
                          (S, I, I, A("uint8"), A("uint8", 2), A("boolean"), B)),
    # segments: many ordinary segments in one BPE call (allowed specials, session repair)
    "seg_gather": ("segments", "_gather", "void", (A("uint32"), I, A("int64", 2), A("uint32"))),
    "token_ends": ("segments", "_token_ends", "void",
                   (A("uint32"), A("int64"), A("uint32"), A("int64", 2), A("int64"), A("int64"))),
    "spans_gpt4": ("segments", "_spans_gpt4", "void", (A("int32"), A("int8"), I, B, A("boolean"), A("int64"))),
    "spans_deepseek": ("segments", "_spans_deepseek", "void", (A("int32"), A("uint8"), A("boolean"), A("int64"))),
    "spans_smollm2": ("segments", "_spans_smollm2", "void", (A("int32"), A("int8"), A("boolean"), A("int64"))),
    "interleave": ("segments", "_interleave", "void",
                   (A("uint32"), A("int64"), A("int64"), A("uint32"), A("int64"), A("uint32"), A("int64"))),
    # the fused window encode (window.py): one call per session repair window
    "window_gpt4": ("window", "_window_gpt4", WINDOW_RET, (*WINDOW_HEAD, A("int8"), I, B, *WINDOW_TAIL)),
    "window_o200k": ("window", "_window_o200k", WINDOW_RET, (*WINDOW_HEAD, A("uint8"), A("uint16"), *WINDOW_TAIL)),
    "window_deepseek": ("window", "_window_deepseek", WINDOW_RET, (*WINDOW_HEAD, A("uint8"), *WINDOW_TAIL)),
    "window_smollm2": ("window", "_window_smollm2", WINDOW_RET, (*WINDOW_HEAD, A("int8"), *WINDOW_TAIL)),
    # the fused first window of an append (../appendwin.py): start, encode, splice search, kept-token compare
    "append_gpt4": ("..appendwin", "_append_gpt4", APPEND_RET,
                    (*APPEND_HEAD, *APPEND_MID, A("int8"), I, B, *WINDOW_TAIL, *APPEND_OUT)),
    "append_o200k": ("..appendwin", "_append_o200k", APPEND_RET,
                     (*APPEND_HEAD, *APPEND_MID, A("uint8"), A("uint16"), *WINDOW_TAIL, *APPEND_OUT)),
    "append_deepseek": ("..appendwin", "_append_deepseek", APPEND_RET,
                        (*APPEND_HEAD, *APPEND_MID, A("uint8"), *WINDOW_TAIL, *APPEND_OUT)),
    "append_smollm2": ("..appendwin", "_append_smollm2", APPEND_RET,
                       (*APPEND_HEAD, *APPEND_MID, A("int8"), *WINDOW_TAIL, *APPEND_OUT)),
    # the fused full-encode block (fullencode.py): one call per block of a full encode
    "full_gpt4": ("fullencode", "_full_gpt4", FULL_RET,
                  (*FULL_HEAD, A("uint8"), *FULL_SCRATCH, A("uint8"), I, B, *FULL_TAIL)),
    "full_deepseek": ("fullencode", "_full_deepseek", FULL_RET,
                      (*FULL_HEAD, A("uint8"), *FULL_SCRATCH, A("uint8"), *FULL_TAIL)),
    "full_smollm2": ("fullencode", "_full_smollm2", FULL_RET,
                     (*FULL_HEAD, A("uint8"), *FULL_SCRATCH, A("uint8"), *FULL_TAIL)),
    "full_walk": ("fullencode", "_finish", FULL_RET, (A("uint32"), I, *FULL_SCRATCH, *FULL_TAIL)),
    "full_o200k": ("fullencode", "_full_o200k", FULL_RET,
                   (*FULL_HEAD, A("uint8"), *FULL_SCRATCH, A("uint8"), A("uint16"), *FULL_TAIL)),
    # many short texts in one call (fullbatch.py): text, spans | scratch | form and the union of the family tables
    # (feature table, o200k's class table, gpt4's two flags) | the block kernels' tail
    "batch": ("fullbatch", "_batch", BATCH_RET,
              (*BATCH_HEAD, A("uint8"), *FULL_SCRATCH, I, A("uint8"), A("uint16"), I, B, *FULL_TAIL)),
    # session records (..records: IDs, checkpoints ck, token characters tc, end exceptions ex_i / ex_v)
    "rec_end_at": ("..records", "end_at", "int64", (*REC, I)),
    "rec_locate": ("..records", "locate", "UniTuple(int64, 2)", (*REC, I, I)),
    "rec_fill_checkpoints": ("..records", "_fill_checkpoints", "void", (*REC, I, I)),
    "rec_moved_checkpoints": ("..records", "_moved_checkpoints", "void", (*REC, I, I, I, I, A("int64"))),
    "rec_mid_extras": ("..records", "_mid_extras", "int64",
                       (A("uint32"), A("int64"), I, A("uint16"), A("int64"), A("int64"), I)),
    "rec_append_tail": ("..records", "_append_tail", "boolean",
                        (A("uint32"), A("int64"), A("uint16"), I, I, A("uint32"), A("int64"))),
    # the certified splice-point search (..splice) and the text store's compares (..textstore: cross-kind prefix,
    # common prefix and suffix)
    "splice_search": ("..splice", "_search", "UniTuple(int64, 3)",
                      (S, I, I, I, A("int64"), A("uint8"), A("uint8", 2), B, *REC, I, A("uint32"), A("int64"), I,
                       A("boolean"), I, B, I, I, I, I)),
    "splice_clean_before": ("..splice", "_clean_before", "UniTuple(int64, 2)", (*REC, I, A("boolean"), I, I)),
    "text_match_at": ("..textstore", "_match_at", "int64", (S, S, I)),
    "text_common_prefix": ("..textstore", "_common_prefix", "int64", (S, I, S, I, I)),
    "text_common_suffix": ("..textstore", "_common_suffix", "int64", (S, I, S, I, I)),
    "packed_match_at": ("..packedrun", "_match_at", "int64", (A("uint8"), A("uint32"), S, I)),
}
HOLDS_GIL = frozenset({"scan_first_stable"})
# Exports the encoder binds (Kernels.bind) with their head argument count: the AOT module also exports each as
# `<name>_packed` (packed.py: the bound tail as one int64 array of addresses and shapes, unboxed as one argument).
PACKED = {**{f"full_{loop}": 4 for loop in ("gpt4", "deepseek", "smollm2", "o200k")}, "full_walk": 5, "batch": 7,
          **{f"window_{loop}": 5 for loop in ("gpt4", "o200k", "deepseek", "smollm2")},
          **{f"append_{loop}": 10 for loop in ("gpt4", "o200k", "deepseek", "smollm2")}}


def packed_name(name: str) -> str:
    return f"{name}_packed"


def module_exports() -> list[str]:
    """Every export of the AOT module: EXPORTS and the packed forms of PACKED."""
    return [*EXPORTS, *(packed_name(n) for n in PACKED)]


def numba_signature(name: str) -> str:
    """The numba signature string of one export of the module (aotbuild.py compiles with it)."""
    packed = {packed_name(n): n for n in PACKED}.get(name)
    if packed is not None:
        _, _, ret, args = EXPORTS[packed]
        args = (*args[:PACKED[packed]], A("int64"))
    else:
        _, _, ret, args = EXPORTS[name]

    def one(t: Any) -> str:
        if t == S:
            return "unicode_type"
        if isinstance(t, tuple):
            return f"{t[0]}[{':, ' * (t[1] - 1)}::1]"
        return str(t)

    return f"{ret}({', '.join(one(t) for t in args)})"


# -- the cache key ----------------------------------------------------------------------------------------------------
def _numba_version() -> str:
    """numba's version read from its _version.py without importing numba (find_spec executes nothing)."""
    spec = importlib.util.find_spec("numba")
    if spec is None or spec.origin is None:
        return "absent"
    try:
        text = (Path(spec.origin).parent / "_version.py").read_text()
    except OSError:
        return "unknown"
    m = re.search(r'"version":\s*"([^"]+)"', text)
    return m.group(1) if m else "unknown"


def _machine() -> str:
    """The machine the module was compiled for: architecture plus the CPU's model and feature flags (the build
    targets the host CPU, so another CPU model gets its own build)."""
    parts = [platform.machine()]
    try:
        info = Path("/proc/cpuinfo").read_text()
        for field in ("model name", "flags", "Features", "CPU part"):
            m = re.search(rf"^{field}\s*:\s*(.*)$", info, re.M)
            if m:
                parts.append(m.group(1).strip())
    except OSError:
        parts.append(platform.processor())
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


@cache
def key_fields() -> dict[str, str]:
    src = hashlib.sha256()
    for name in SOURCES:
        src.update(name.encode() + b"\0" + (_HERE / name).read_bytes())
    return {"key_version": str(KEY_VERSION), "sources": src.hexdigest()[:20], "numba": _numba_version(),
            "numpy": np.__version__, "python": sys.implementation.cache_tag + "-" + platform.python_version(),
            "machine": _machine()}


def cache_key() -> str:
    return hashlib.sha256(json.dumps(key_fields(), sort_keys=True).encode()).hexdigest()[:24]


def aot_root() -> Path:
    """Where AOT modules live: TOKENPLANE_AOT_DIR, else `aot/` in the tokenplane cache."""
    env = os.environ.get("TOKENPLANE_AOT_DIR")
    return Path(env) if env else cache_dir() / "aot"


def numba_cache_dir() -> Path:
    """The JIT kernels' numba cache for this key (lazyjit._keyed_cache): TOKENPLANE_NUMBA_CACHE_DIR, else `numba/`
    in the tokenplane cache, then the key."""
    env = os.environ.get("TOKENPLANE_NUMBA_CACHE_DIR")
    return (Path(env) if env else cache_dir() / "numba") / cache_key()


def module_folder(root: Path | None = None) -> Path:
    return (root or aot_root()) / cache_key()


def failure_marker(root: Path | None = None) -> Path:
    """Written by a failed background build (its traceback): no further background build for this key."""
    return (root or aot_root()) / f"{cache_key()}.failed"


def module_file(folder: Path) -> Path:
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    return folder / f"{MODULE_NAME}{suffix}"


def file_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# -- loading ----------------------------------------------------------------------------------------------------------
class AotUnavailable(RuntimeError):
    """The AOT module for this key is absent, stale or damaged (the reason is the message)."""


def load_module(folder: Path) -> ModuleType:
    """The AOT module in `folder`, after checking its record: same key, same bytes as built, every export present."""
    meta_path, so = folder / "meta.json", module_file(folder)
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, ValueError) as exc:
        raise AotUnavailable(f"no readable record in {folder}: {exc}") from None
    if meta.get("key") != cache_key() or meta.get("fields") != key_fields():
        raise AotUnavailable(f"record in {folder} is for another key")
    if sorted(meta.get("exports", [])) != sorted(module_exports()):
        raise AotUnavailable("record lists other exports")
    try:
        if file_digest(so) != meta.get("sha256"):
            raise AotUnavailable(f"{so.name} does not hash to its record (damaged or replaced)")
    except OSError as exc:
        raise AotUnavailable(f"cannot read {so}: {exc}") from None
    spec = importlib.util.spec_from_file_location(MODULE_NAME, so)
    if spec is None or spec.loader is None:
        raise AotUnavailable(f"cannot load {so}")
    try:
        mod = importlib.util.module_from_spec(spec)     # the dlopen: a broken file fails here
        spec.loader.exec_module(mod)
    except ImportError as exc:
        raise AotUnavailable(f"import of {so} failed: {exc}") from None
    missing = [n for n in module_exports() if not callable(getattr(mod, n, None))]
    if missing:
        raise AotUnavailable(f"{so.name} lacks {missing}")
    return mod


def _jit_kernel(name: str) -> Any:
    module, attr = EXPORTS[name][0], EXPORTS[name][1]
    return getattr(importlib.import_module(module if module.startswith(".") else "." + module, __package__), attr)


# calls the guard sent to the JIT kernel, per export (tests assert the default paths never need it)
guard_fallbacks: dict[str, int] = {}


def _checks(types: tuple[Any, ...], names: list[str], env: dict[str, Any]) -> str:
    """The straight-line test that arguments `names` match `types` (arrays: dtype, rank, C order; str: type)."""
    tests = []
    for i, t in enumerate(types):
        a = names[i]
        if t == S:
            tests.append(f"type({a}) is str")
        elif isinstance(t, tuple):
            dt = np.dtype("bool" if t[0] == "boolean" else t[0])
            env[f"d{i}"] = dt
            # dtype identity first (builtin dtypes are singletons); an equal dtype object of a loaded table next
            tests.append(f"type({a}) is ndarray and ({a}.dtype is d{i} or {a}.dtype == d{i}) and {a}.ndim == {t[1]} "
                         f"and {a}.flags.c_contiguous")
    return " and ".join(tests) or "True"


def _guarded(name: str, fn: Callable[..., Any], bound: tuple[Any, ...] = (),
             keep: tuple[Any, ...] | None = None) -> Callable[..., Any]:
    """fn with its arguments checked against the export's signature; a mismatch goes to the JIT kernel. `bound`:
    trailing arguments already checked (Kernels.bind), passed after the caller's; `keep`: the arguments they stand
    for (a packed tail's arrays: kept alive with the call, and what a mismatch passes to the JIT kernel).

    The check is generated as straight-line code per export (a session's sync makes ~10 kernel calls, and a
    generic loop over the signature cost ~2.5 us per call)."""
    keep = bound if keep is None else keep
    types = EXPORTS[name][3][:len(EXPORTS[name][3]) - len(keep)]
    names = [f"a{i}" for i in range(len(types))]
    env: dict[str, Any] = {"fn": fn, "ndarray": np.ndarray, "mismatch": _mismatch, "name": name, "bound": bound,
                           "keep": keep}
    body = _checks(types, names, env)
    args = ", ".join(names)
    tail = ", *bound" if bound else ""
    src = (f"def call({args}):\n"
           f"    if {body}:\n"
           f"        return fn({args}{tail})\n"
           f"    return mismatch(name, ({args}{',' if len(names) == 1 else ''}){' + keep' if keep else ''})\n")
    exec(compile(src, f"<kernel guard {name}>", "exec"), env)
    call = env["call"]
    call.__name__ = name
    return call


def _args_match(types: tuple[Any, ...], values: tuple[Any, ...]) -> bool:
    env: dict[str, Any] = {"ndarray": np.ndarray}
    names = [f"a{i}" for i in range(len(types))]
    env.update(zip(names, values))
    return bool(eval(_checks(types, names, env), env))


def _mismatch(name: str, args: tuple[Any, ...]) -> Any:
    """A call whose arguments failed the generated check: counted, and answered by the JIT kernel."""
    guard_fallbacks[name] = guard_fallbacks.get(name, 0) + 1
    return _jit_kernel(name)(*args)


class Kernels:
    """The kernel set one process uses: `kind` is "aot" or "jit", each export an attribute."""

    def __init__(self, kind: str, funcs: dict[str, Callable[..., Any]], note: str = "",
                 raw: dict[str, Callable[..., Any]] | None = None):
        self.kind = kind
        self.note = note
        self._raw = raw or {}
        for name, fn in funcs.items():
            setattr(self, name, fn)

    def bind(self, name: str, n_head: int, *tail: Any) -> Callable[..., Any]:
        """Export `name` with its arguments after the first `n_head` fixed to `tail` (tables that stay the same
        across calls): checked once here, so each call's guard checks only the head. Tail arguments that do not
        match the signature bind the JIT kernel (counted in guard_fallbacks)."""
        fn, rest = self.bind_unchecked(name, n_head, *tail)
        if fn is not _jit_kernel(name):     # the module's export (or its packed form): the head checked per call
            return _guarded(name, fn, rest, keep=tail)

        def call(*head: Any) -> Any:
            return fn(*head, *tail)

        return call

    def bind_unchecked(self, name: str, n_head: int, *tail: Any) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        """`bind` without the per-call guard: (fn, rest), called as fn(*head, *rest). The tail is checked here as
        `bind` checks it; the head is not, so only for callers whose head arguments are always of the export's
        types by construction (a session's records: records.py allocates them), where a mismatch would be a crash
        and not a fallback. The guard's checks cost ~12 us a call with the process's caches cold (~20 us with
        its frame), against ~0.5 us warm. The caller keeps `tail` alive (a packed tail holds its addresses)."""
        if len(tail) != len(EXPORTS[name][3]) - n_head:
            raise TypeError(f"{name}: {n_head} head arguments + {len(tail)} bound != its signature")
        raw = self._raw.get(name)
        if raw is not None and _args_match(EXPORTS[name][3][n_head:], tail):
            packed = self._raw.get(packed_name(name))
            if packed is not None and PACKED.get(name) == n_head:
                return packed, (pack_tail(tail),)
            return raw, tail
        if raw is not None:
            guard_fallbacks[name] = guard_fallbacks.get(name, 0) + 1
        return _jit_kernel(name), tail

    def __getattr__(self, name: str) -> Any:    # only for exports missing from funcs: never on the AOT path
        raise AttributeError(name)


def jit_kernels(note: str = "") -> Kernels:
    return Kernels("jit", {name: _jit_kernel(name) for name in EXPORTS}, note)


def pack_tail(tail: tuple[Any, ...]) -> np.ndarray:
    """The handle of a bound tail (packed.py): (address, shape 0, shape 1) per array, (value, 0, 0) per scalar. The
    arrays must outlive every call made with it (the binding keeps them)."""
    h = np.zeros(3 * len(tail), dtype=np.int64)
    for k, v in enumerate(tail):
        if isinstance(v, np.ndarray):
            h[3 * k] = v.ctypes.data
            h[3 * k + 1:3 * k + 1 + v.ndim] = v.shape
        else:
            h[3 * k] = int(v)
    return h


def aot_kernels(folder: Path) -> Kernels:
    mod = load_module(folder)
    raw = {name: getattr(mod, name) for name in module_exports()}
    return Kernels("aot", {name: _guarded(name, raw[name]) for name in EXPORTS}, str(folder), raw)


_lock = threading.Lock()
_active: Kernels | None = None
_build_started = False


def get() -> Kernels:
    """The process's kernel set (decided on the first call; see the module docstring)."""
    global _active
    k = _active
    if k is not None:
        return k
    with _lock:
        if _active is None:
            _active = _choose()
        return _active


def _choose() -> Kernels:
    if os.environ.get("TOKENPLANE_AOT", "1") == "0":
        return jit_kernels("TOKENPLANE_AOT=0")
    folder = module_folder()
    try:
        return aot_kernels(folder)
    except AotUnavailable as exc:
        start_background_build()
        return jit_kernels(str(exc))


def reset(kernels: Kernels | None = None) -> None:
    """Forget the decision, or replace it with `kernels` (tests; warmup, which runs the JIT set to fill numba's
    cache for the fallback)."""
    global _active
    with _lock:
        _active = kernels


def start_background_build() -> bool:
    """Start `python -m tokenplane.tokenize.cpu.aotbuild` detached (once per process) so the next process finds the
    module; the build takes its own lock and is a no-op when another build is running or done. Not after a failed
    build for this key (`failure_marker`; `tokenplane warmup` retries and says why)."""
    global _build_started
    if _build_started or os.environ.get("TOKENPLANE_AOT_BUILD", "1") == "0" or failure_marker().exists():
        return False
    _build_started = True
    root = str(Path(__file__).resolve().parents[3])
    env = dict(os.environ)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    try:
        subprocess.Popen([sys.executable, "-m", f"{__package__}.aotbuild", "--quiet"], env=env,
                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         start_new_session=True)
    except OSError:
        return False
    return True
