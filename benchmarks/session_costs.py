"""Measurements of benchmarks/session_repair.py beyond append latency: real-trace `Session.sync` per family with its
per-call fixed cost, mid-context edits, and session state bytes per token (tracemalloc and RSS).

Per-call fixed cost = wall time of `sync` + `np.asarray(session.ids)` minus the time spent inside the window encoder
(`SessionStats.last_encode_s`): Python, numpy, the splice search, bookkeeping and returning the IDs.
"""

from __future__ import annotations

import ctypes
import gc
import random
import time
import tracemalloc
from pathlib import Path

import numpy as np
from full_encode import fresh_copies  # benchmarks/ is on the path of session_repair.py, which imports this


def pct(values, q):
    return float(np.percentile(np.asarray(values, dtype=float), q)) if len(values) else None


def ms(values) -> dict:
    return {"p50": pct(values, 50) * 1e3, "p90": pct(values, 90) * 1e3, "p99": pct(values, 99) * 1e3,
            "n": len(values)} if values else {"n": 0}


def trace_sync(tok, directory: Path, count: int, session_path: str, ref_trajectories: int,
               peers: dict | None = None) -> dict:
    """Replay `count` mini-swe-agent trajectories through Session.sync (every call's whole prompt); the reference
    full re-encode of the same prompt is timed, interleaved, on the first `ref_trajectories`. `peers` (name -> full
    encode) are timed on every call, interleaved with the sync (the order rotates per call); a peer with a cache
    has seen the previous call's prompt, as in a serving process. Every trajectory's final IDs are checked against
    the reference, the session's and each peer's."""
    from tokenplane.tokenize.evidence.traces import load_trajectories, render_prompts

    peers = peers or {}
    trajectories = load_trajectories(directory, limit=count)
    total, fixed, ref, ctx = [], [], [], []
    peer_times: dict[str, list[float]] = {name: [] for name in peers}
    peer_exact = {name: 0 for name in peers}
    exact = checked = 0
    stats: dict = {}
    for i, traj in enumerate(trajectories):
        prompts = render_prompts(traj)
        session = tok.session(encode_path=session_path)
        for k, prompt in enumerate(prompts):
            order = ["tokenplane", *peers]
            rot = k % len(order)
            for name in order[rot:] + order[:rot]:
                if name != "tokenplane":
                    own, = fresh_copies([prompt])   # no UTF-8 form another peer made CPython cache in it
                    t0 = time.perf_counter()
                    peers[name](own)
                    if k:
                        peer_times[name].append(time.perf_counter() - t0)
                    continue
                t0 = time.perf_counter()
                session.sync(prompt)
                np.asarray(session.ids)
                dt = time.perf_counter() - t0
                if k:                   # a session's first call is a full encode
                    total.append(dt)
                    fixed.append(dt - session.stats.last_encode_s)
                    ctx.append(len(prompt))
            if k and i < ref_trajectories:
                t0 = time.perf_counter()
                tok.encode(prompt, path="reference")
                ref.append(time.perf_counter() - t0)
        if prompts:
            checked += 1
            want = tok.encode(prompts[-1], path="reference").astype(np.int64)
            exact += bool(np.array_equal(np.asarray(session.ids, dtype=np.int64), want))
            for name, fn in peers.items():
                peer_exact[name] += bool(np.array_equal(np.asarray(fn(prompts[-1]), dtype=np.int64), want))
        for key, v in session.stats.to_dict().items():
            if isinstance(v, (int, float)) and not isinstance(v, bool) and not key.startswith("last_"):
                stats[key] = stats.get(key, 0) + v
    return {"trajectories": len(trajectories), "continuations": len(total), "context_chars_p50": pct(ctx, 50),
            "context_chars_max": max(ctx) if ctx else None, "exact": f"{exact}/{checked}", "session_stats": stats,
            "sync_ms": ms(total), "fixed_ms": ms(fixed), "reference_ms": ms(ref),
            "reference_on_first_trajectories": ref_trajectories,
            "peers_ms": {name: ms(v) for name, v in peer_times.items()},
            "peers_exact": {name: f"{v}/{checked}" for name, v in peer_exact.items()}}


def edits(tok, context: str, pool: str, steps: int, rng: random.Random, session_path: str) -> dict:
    """Mid-context edits (20 characters replaced by 20 others, at 20%-80% of the text) on a session holding
    `context`; the final IDs are checked against the reference."""
    session = tok.session(encode_path=session_path)
    session.sync(context)
    times = []
    n = len(context)         # 20 characters replace 20: the length stays (reading session.text would join it)
    for _ in range(steps):
        a = rng.randrange(n // 5, 4 * n // 5)
        src = rng.randrange(0, len(pool) - 20)
        t0 = time.perf_counter()
        session.edit(a, a + 20, pool[src:src + 20])
        np.asarray(session.ids)
        times.append(time.perf_counter() - t0)
    ok = bool(np.array_equal(np.asarray(session.ids, dtype=np.int64),
                             tok.encode(session.text, path="reference").astype(np.int64)))
    return {"ms": ms(times), "exact": ok, "renormalizations": session.stats.renormalizations,
            "raw_differs_from_normalized": session._norm is not None}


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def _trim() -> None:
    """Hand freed heap back to the OS (glibc), so an RSS delta is not hidden by reused free memory."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:     # pragma: no cover - not glibc
        pass


def _fill(tok, context: str, appends: list[str], session_path: str):
    """A session holding fresh copies of the texts (allocated here, so whatever the session keeps is counted and
    whatever it drops is freed)."""
    session = tok.session(encode_path=session_path)
    text = (context + "x")[:-1]
    session.sync(text)
    del text
    for a in appends:
        session.append((a + "x")[:-1])
    return session


def memory(tok, context: str, appends: list[str], session_path: str, copies: int | None = None) -> dict:
    """Bytes per token of a session holding `context` plus `appends`: tracemalloc (every Python/numpy allocation
    the session made and still holds, text included) and the process RSS delta (separate sessions, no tracing,
    freed heap trimmed first), beside the session's own `nbytes`. The tokenizer first serves one identical session
    (dropped before measuring), so what it keeps for every session (piece caches, which grow with new text; the
    parallel encoder's per-thread scratch, sized by the largest text it encoded) is not counted as session state.
    Sessions are measured as `copies` live sessions (default: enough for ~8M characters of text, at least 2, at most
    1,000) and divided, as a server holding many of them sees it: RSS moves in 4 KB pages, a ~16 KB session alone
    would read 0, 4 or 8 KB of it, and one 1M-character session's RSS delta moves by a few hundred KB run to run
    with where the allocator's free pages happen to lie."""
    # first-session allocations (masks, kernels loaded on the first repair, caches, scratch) are shared
    _fill(tok, context[:2000], [context[2000:2400], context[2400:2500]], session_path)
    _fill(tok, context, appends, session_path)
    if copies is None:
        copies = max(2, min(1000, 8_000_000 // max(1, len(context) + sum(map(len, appends)))))
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    sessions = [_fill(tok, context, appends, session_path) for _ in range(copies)]
    gc.collect()
    traced = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    n = len(sessions[0])
    nbytes = sessions[0].nbytes
    del sessions
    gc.collect()
    _trim()
    rss0 = _rss()
    sessions = [_fill(tok, context, appends, session_path) for _ in range(copies)]
    gc.collect()
    _trim()
    rss = _rss() - rss0
    del sessions
    n_all = n * copies
    return {"chars": len(context) + sum(map(len, appends)), "tokens": n, "copies": copies,
            "tracemalloc_b_per_token": traced / n_all, "rss_b_per_token": rss / n_all, "nbytes_b_per_token": nbytes / n}
