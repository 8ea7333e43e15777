"""A session's append of ASCII text in the fewest Python steps: the same fused call and commit as
Session._fast_append (appendwin.py's kernel, WindowRepair.append_commit), reached without the layers between.

An append that arrives after other work has pushed the process out of the caches (a server between an agent's
calls; the peers' re-encodes interleaved in benchmarks/session_repair.py; a 128 MB sweep) pays for every Python
step it runs with its code and data coming back from memory (benchmarks/cold_append.py, AMD EPYC VM, 128 MB
sweep: an empty call ~2-5 us, a numpy slice ~6-14, `setflags` on it as much again, the kernel guard's checks
~21-29, against well under 1 us each warm). The general path made ~30 calls around one ~90-110 us kernel call
(validation, the plan's helpers, the encoder lookups of the router and the thread cache, the text store's width
runs); this one makes a handful. About half of a cold append is its code and the interpreter's coming back, not the
tables: 1.4K-character appends to 1M-character sessions measured 110-171 us P50 after the sweep and 71-84 when a
2-character append to another session came first (warm 37-50).

It answers only the common case and declines (None, nothing changed) everything else, which the general path then
takes with its checks and errors: text that is not ASCII, a session with allowed literals or a normalized text of
its own, an NFC region within two windows of the end, an empty session, the reference path, a window a GPU would
take, a kernel that declines.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any

from . import appendwin
from .cpu import kernels
from .router import SEGMENTS_MAX_CHARS, Router, segment_encoder
from .textstore import CHUNK_MERGE

if TYPE_CHECKING:
    from .nfcmap import NfcMap
    from .records import Records
    from .repair import SessionStats, WindowRepair
    from .textstore import TextStore

_local = threading.local()      # this thread's bindings: (repairer, path) -> (bound kernel, its BPE, router, repairer)


def _bind(rep: WindowRepair, path: str) -> tuple[appendwin._Bound, Any, Router | None, WindowRepair] | None:
    """This thread's fused append kernel for `rep` and `path` (appendwin.append_encoder, made once a thread and kept
    in `_local.bindings`), the BPE it was bound with, the router of the path, if it is one (a window over its GPU
    size may go to its GPU), and `rep`. `append_ascii` checks a kept entry inline (a call is a cost cold)."""
    encoder = rep.tokenizer.path(path)
    cpu = segment_encoder(encoder, 0)
    if cpu is None:
        return None
    bound = appendwin.append_encoder(cpu.bpe, rep.family, rep.token_chars, rep.search, rep.inert())
    router = encoder if isinstance(encoder, Router) else None
    cache = getattr(_local, "bindings", None)
    if cache is None:
        cache = _local.bindings = {}
    entry = cache[(id(rep), path)] = (bound, cpu.bpe, router, rep)
    return entry


def append_ascii(rep: WindowRepair, raw: TextStore, rec: Records, nmap: NfcMap | None, path: str, text: str,
                 stats: SessionStats, whole: str | None = None) -> int | None:
    """Append `text` (an ASCII str) to a session with no allowed literals and no normalized text of its own: the
    kept record count, with the records, the text store and `stats` updated as Session._fast_append updates them;
    None, with nothing changed, where this path does not apply. `whole`: the whole new text as one ASCII str (sync's
    resent text; `text` is then its new part): read in place by the kernel and adopted by the store, as
    `_fast_append` does.

    An NFC map (regions where the raw text differs from its NFC) is left as it is: ASCII text composes with nothing
    before it, so NFC(raw + text) == NFC(raw) + text (Session._append_committed). The window is then read from the
    raw text shifted by the regions' length change, where no region reaches into it; else this path declines."""
    raw_end = end = raw.length
    n = rec.n
    added = len(text)
    if (not n or not text or not rep.fused or path == "reference" or raw_end + added > rep.tokenizer.max_chars
            or added > CHUNK_MERGE):
        return None
    w = rep.window
    shift = 0
    if nmap is not None and nmap.texts:
        k = len(nmap.texts) - 1
        shift = nmap.nb(k) - nmap.rb(k)
        end = raw_end + shift       # the normalized text's length: the kernel's offsets are normalized ones
        if whole is not None or nmap.nb(k) > end - 2 * w:
            return None
    base = end - 2 * w if end > 2 * w else 0
    span = end + added - base       # (WindowRepair._fused_append's window and its limits)
    if span >= SEGMENTS_MAX_CHARS:
        return None
    cache = getattr(_local, "bindings", None)
    b = cache.get((id(rep), path)) if cache is not None else None
    if (b is None or b[3] is not rep or b[0].kernels is not kernels._active or b[0].batch != b[1].batch
            or b[0].whole != b[1].whole):
        b = _bind(rep, path)
        if b is None:
            return None
    bound, router = b[0], b[2]
    if router is not None and span > router.gpu_min_chars and router.gpu() is not None:
        return None
    t0 = time.perf_counter()
    if whole is not None:
        new, base = whole, 0
    else:
        new = raw.slice(base - shift, raw_end) + text
    need = n + (added * n) // end + (added >> 4) + 32      # (WindowRepair.append_commit's reservation)
    if need > len(rec.buf):
        rec.reserve(need)
    rec.detach()        # the kernel may write over records an exported view shows
    t1 = time.perf_counter()
    # unguarded (kernels.bind_unchecked): `new` is a str, the rest ints and the records' arrays
    status, keep, count = bound.raw(new, base, end, w, rec.buf, rec.ck, rec.ex_i, rec.ex_v, n, True, *bound.raw_tail)
    if status == appendwin.SCRATCH:     # `keep`: the records the window needs (once per larger window)
        bound.grow(keep)
        status, keep, count = bound.raw(new, base, end, w, rec.buf, rec.ck, rec.ex_i, rec.ex_v, n, True,
                                        *bound.raw_tail)
    stats.last_encode_s = time.perf_counter() - t1
    if status == appendwin.COMMITTED:
        rec.n = keep + count
    elif status == appendwin.OK:
        rec.splice(keep, bound.out_ids[:count], bound.out_ends[:count], n, added)
    else:
        return None
    if whole is not None:
        raw.adopt(whole)
    else:
        raw.append(text)
    stats.repairs += 1
    stats.first_window_accepts += 1
    stats.windows_tried += 1
    stats.last_path = "window"
    dt = time.perf_counter() - t0
    stats.last_repair_s = dt
    stats.total_repair_s += dt
    return keep
