"""Session repair latency and state size: tokenplane Session.append / sync / edit vs full re-encode peers, same inputs.

Synthetic long sessions are cut from real text (../shared/tools/build_corpus.py corpus): a context of 100K, 1M or 4M
characters (for NFC families it starts with a decomposed "cafe\u0301": the raw text differs from the normalized
one, the case that used to renormalize everything), then appends of either the flat 1.4K-character shape or sizes
drawn from real Claude Code sessions (../shared/data/traces/claude-code-shapes.jsonl). Per step, engines run
interleaved in rotating order on the same text:

  tokenplane       Session.append(chunk), then the full IDs as an array (np.asarray(session.ids))
  tokenplane_alone the same appends on a third session afterwards, with no other work between steps (the
                   interleaved steps build context-sized strings that evict the encoder tables from the CPU caches)
  tokenplane_flushed  the same appends on a fourth session, each after a write of FLUSH_MB MB that evicts every
                   cache level: a cold append whose eviction is the same at every size (the interleaved steps evict
                   in proportion to the context, so their 4M / 100K ratio mixes the append's cost with theirs)
  tokenplane_same  (flat1400 only) the same number of appends, but of one fixed text for every size, each replay
                   starting from one piece-map state (the thread's piece caches emptied after the context's sync,
                   then one fixed text encoded): the context's length is then the only thing that differs between
                   sizes, so its 4M / 100K ratio is the append's own growth with the context. The columns above
                   append the text that follows each context and start from whatever its sync left in the piece
                   map, so their ratios also carry how many new pieces each size's appended text happens to hold.
  tokenplane_same_flushed  the same, each append after the FLUSH_MB sweep
  tokenplane_sync  a second session: Session.sync(whole text) (the server's path: the client resends everything)
  memcmp           raw compare of the whole resent text with an equal copy (`text == copy`: one memcmp of the
                   str buffer), the floor of any prefix check
  reference        full re-encode with the reference engine (tiktoken or HF tokenizers), subsampled when slow
  fastokens/gigatoken/toktier  peers, when installed (recorded as not installed otherwise)

Then mid-context edits at each size, session state bytes per token (tracemalloc, RSS, nbytes; also a small session)
and every family's replay of the real mini-swe-agent trajectories through Session.sync with the per-call fixed cost
(benchmarks/session_costs.py). Every cell's IDs are checked against the reference. JSON + Markdown + PNG in
benchmarks/results/.

  flock /tmp/bench.lock python benchmarks/session_repair.py --family all --corpus /tmp/corpus
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import random
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from full_encode import TOKTIER_FAMILIES, ensure_corpus, fresh_copies, load_toktier  # noqa: E402
from session_costs import edits, memory, ms, trace_sync  # noqa: E402

SIZES = {"100K": 100_000, "1M": 1_000_000, "4M": 4_000_000}
ALL_FAMILIES = "cl100k_base,o200k_base,llama3,qwen3,deepseek_v4,smollm2"
NFC_SEED = "cafe\u0301 "     # a decomposed character at the context start: raw != NFC for NFC families
SHAPES_FILE = ROOT.parent / "shared" / "data" / "traces" / "claude-code-shapes.jsonl"


def _l3_mb() -> int:
    try:
        size = Path("/sys/devices/system/cpu/cpu0/cache/index3/size").read_text().strip()
        return int(size[:-1]) >> 10 if size.endswith("K") else int(size[:-1]) if size.endswith("M") else 0
    except (OSError, ValueError):
        return 0


# The cache sweep written before each flushed append: the last-level cache's size as the OS reports it, rounded up
# to 64 MB, at least 128 MB and at most 1 GB (one fixed size at every context size is what makes the cells comparable).
FLUSH_MB = min(1024, max(128, -(-_l3_mb() // 64) * 64))


def pct(values, q):
    return float(np.percentile(np.asarray(values, dtype=float), q)) if len(values) else None


def corpus_pool(corpus: Path) -> str:
    docs = []
    with open(corpus / "mixed.jsonl", encoding="utf-8") as f:
        for line in f:
            docs.append(json.loads(line)["text"])
    random.Random(0).shuffle(docs)   # interleave kinds so a 4M context is not all man pages
    return "\n".join(docs)


def claude_code_appends(n: int, cap_chars: int, rng: random.Random) -> list[int]:
    rows = []
    with open(SHAPES_FILE, encoding="utf-8") as f:
        for line in f:
            r = json.loads(line)
            if r["reused_prefix_tokens"] > 0 and r["append_tokens"] > 0:
                rows.append(r["append_tokens"])
    return [min(cap_chars, 4 * rng.choice(rows)) for _ in range(n)]


class Engines:
    """Full-text encoders for one family, built once; peers that are not installed are listed in `missing`."""

    def __init__(self, family: str, tok, wanted: set[str]):
        from tokenplane.tokenize.spec.artifacts import artifact_file

        self.family, self.tok = family, tok
        is_tt = tok.family.engine == "tiktoken"
        path = artifact_file(family)
        self.full: dict = {"reference": lambda t: tok.encode(t, path="reference")}
        self.missing: list[str] = []
        if "fastokens" in wanted:
            try:
                import fastokens
            except ImportError:
                self.missing.append("fastokens")
            else:
                try:
                    ft = (fastokens.Tokenizer.from_tiktoken(str(path), pattern=tok.family.patterns[0],
                                                            special_tokens=dict(tok.family.specials)) if is_tt
                          else fastokens.Tokenizer.from_file(str(path)))
                except (ValueError, RuntimeError) as exc:      # a file this peer cannot load: reported, not timed
                    self.missing.append(f"fastokens (fails to load: {str(exc)[:120]})")
                else:
                    self.full["fastokens"] = lambda t: ft.encode(t).ids
        if "gigatoken" in wanted:
            try:
                import gigatoken
            except ImportError:
                self.missing.append("gigatoken")
            else:
                try:
                    gt = gigatoken.Tokenizer.from_tiktoken(str(path)) if is_tt else gigatoken.Tokenizer(str(path))
                except (ValueError, RuntimeError) as exc:
                    self.missing.append(f"gigatoken (fails to load: {str(exc)[:120]})")
                else:
                    self.full["gigatoken"] = gt.encode
        self.toktier = None
        if "toktier" in wanted and family in TOKTIER_FAMILIES:
            try:
                self.toktier = load_toktier(family)
            except ImportError:
                self.missing.append("toktier")


def replay_appends(tok, session_path: str, context: str, chunks: list[str], before=None,
                   start=None) -> tuple[Any, list[float]]:
    """A new session synced to `context`, then each chunk appended and the full IDs taken as an array, timed per
    step; `before()` runs untimed ahead of each step, `start()` once after the sync."""
    session = tok.session(encode_path=session_path)
    session.sync(context)
    if start is not None:
        start()
    times = []
    for chunk in chunks:
        if before is not None:
            before()
        t0 = time.perf_counter()
        session.append(chunk)
        np.asarray(session.ids)
        times.append(time.perf_counter() - t0)
    return session, times


class SameAppends:
    """One family's fixed appended text (`steps` chunks of 1,400 characters from a fixed place in the pool) and the
    piece-map state each `tokenplane_same` replay starts from (see the module docstring)."""

    def __init__(self, tok, session_path: str, pool: str, steps: int):
        from tokenplane.tokenize.router import segment_encoder

        at = len(pool) // 2
        self.chunks = [pool[at + 1400 * i:at + 1400 * (i + 1)] for i in range(steps)]
        self.warm_text = pool[at - 500_000:at]
        self.encoder = segment_encoder(tok.path(session_path), 1400)     # the CPU encoder the windows run on

    def reset(self) -> None:
        if self.encoder is not None:
            self.encoder.bpe.clear_caches()
            # on this thread alone (the one the session's windows run on): a chunk-parallel encode would share the
            # text between the threads' maps as its timing falls
            self.encoder.encode(self.warm_text, parallel=False)


def run_synthetic(args, tok, engines: Engines, pool: str, size_name: str, shape: str, rng: random.Random,
                  fixed: SameAppends | None = None) -> dict:
    size = SIZES[size_name]
    offset = rng.randrange(0, max(1, len(pool) - size - 2_000_000))
    seed = NFC_SEED if tok.family.normalizer is not None else ""
    context = seed + pool[offset:offset + size - len(seed)]
    if len(context) < size:
        context = (pool * (size // len(pool) + 1))[:size]
    if shape == "flat1400":
        lengths = [1400] * args.steps
    else:
        lengths = claude_code_appends(args.steps, args.append_cap, rng)
    cursor = offset + size
    chunks = []
    for n in lengths:
        if cursor + n > len(pool):
            cursor = 0
        chunks.append(pool[cursor:cursor + n])
        cursor += n

    times: dict[str, list[float]] = {"tokenplane": [], "tokenplane_sync": [], "memcmp": []}
    session = tok.session(encode_path=args.session_path)
    t0 = time.perf_counter()
    session.sync(context)
    np.asarray(session.ids)
    bootstrap_ms = (time.perf_counter() - t0) * 1e3
    resent = tok.session(encode_path=args.session_path)
    resent.sync(context)
    stats_before = session.stats.to_dict()
    tt_session = tt_cm = None
    if engines.toktier is not None:
        tt_cm = engines.toktier.session()
        tt_session = tt_cm.__enter__()
        tt_session.append(context)
        times["toktier"] = []
    for name, fn in engines.full.items():
        if name != "reference":
            fn(context)   # prewarm: the context was seen before, as in a serving process
        times[name] = []
    # Slow full re-encoders are timed on a subsample of steps (their cost is O(N) with little variance).
    ref_every = max(1, int(np.ceil(args.steps / max(1, args.ref_steps.get(size_name, args.steps)))))
    text = context
    for k, chunk in enumerate(chunks):
        text = text + chunk
        copy = (text + "x")[:-1]      # an equal str in its own buffer, for the memcmp floor
        order = list(times)
        rot = k % len(order)
        for name in order[rot:] + order[:rot]:
            if name == "tokenplane":
                t0 = time.perf_counter()
                session.append(chunk)
                np.asarray(session.ids)
                times[name].append(time.perf_counter() - t0)
            elif name == "tokenplane_sync":
                t0 = time.perf_counter()
                resent.sync(text)
                np.asarray(resent.ids)
                times[name].append(time.perf_counter() - t0)
            elif name == "memcmp":
                t0 = time.perf_counter()
                same = text == copy
                times[name].append(time.perf_counter() - t0)
                assert same
            elif name == "toktier":
                t0 = time.perf_counter()
                tt_session.append_patch(chunk)
                times[name].append(time.perf_counter() - t0)
            elif name == "reference" and k % ref_every != 0:
                continue
            else:
                own, = fresh_copies([text])     # no UTF-8 form cached in it by another peer before
                t0 = time.perf_counter()
                engines.full[name](own)
                times[name].append(time.perf_counter() - t0)
    # The same appends with nothing between them: the interleaved steps above build and compare several
    # context-sized strings per step, which evicts the encoder's tables from the CPU caches at 1M-4M characters.
    alone, times["tokenplane_alone"] = replay_appends(tok, args.session_path, context, chunks)
    # The same appends with every cache level evicted before each by one fixed-size write (not timed).
    sweep = np.ones(FLUSH_MB << 17, np.float64)
    evict = functools.partial(np.add, sweep, 1.0, out=sweep)
    flushed, times["tokenplane_flushed"] = replay_appends(tok, args.session_path, context, chunks, evict)
    same_sessions = {}
    if fixed is not None and shape == "flat1400":
        same_sessions["tokenplane_same"], times["tokenplane_same"] = replay_appends(
            tok, args.session_path, context, fixed.chunks, start=fixed.reset)
        same_sessions["tokenplane_same_flushed"], times["tokenplane_same_flushed"] = replay_appends(
            tok, args.session_path, context, fixed.chunks, evict, start=fixed.reset)
    del sweep, evict
    # Exactness: every engine's final IDs vs one reference encode of the final text.
    ref = tok.encode(text, path="reference").astype(np.int64)
    exact = {"tokenplane": bool(np.array_equal(np.asarray(session.ids, dtype=np.int64), ref)),
             "tokenplane_sync": bool(np.array_equal(np.asarray(resent.ids, dtype=np.int64), ref)),
             "tokenplane_alone": bool(np.array_equal(np.asarray(alone.ids, dtype=np.int64), ref)),
             "tokenplane_flushed": bool(np.array_equal(np.asarray(flushed.ids, dtype=np.int64), ref))}
    if fixed is not None and same_sessions:
        same_ref = tok.encode(context + "".join(fixed.chunks), path="reference").astype(np.int64)
        for name, sess in same_sessions.items():
            exact[name] = bool(np.array_equal(np.asarray(sess.ids, dtype=np.int64), same_ref))
    for name, fn in engines.full.items():
        if name != "reference":
            exact[name] = bool(np.array_equal(np.asarray(fn(text), dtype=np.int64), ref))
    if tt_session is not None:
        exact["toktier"] = bool(np.array_equal(np.asarray(tt_session.ids, dtype=np.int64), ref))
        tt_cm.__exit__(None, None, None)
    stats = diff_stats(session.stats.to_dict(), stats_before)
    out = {"size": size_name, "shape": shape, "context_chars": len(context), "steps": len(chunks),
           "append_chars_p50": pct(lengths, 50), "append_chars_max": max(lengths), "final_chars": len(text),
           "final_tokens": int(len(ref)), "bootstrap_ms": bootstrap_ms,
           "bytes_per_token": session.nbytes / max(1, len(ref)), "exact": exact, "session_stats": stats,
           "latency_ms": {name: ms(v) for name, v in times.items()}}
    if shape == "flat1400":
        out["edits"] = edits(tok, context, pool, args.edit_steps, rng, args.session_path)
        out["memory"] = memory(tok, context, chunks[:10], args.session_path)
    print(json.dumps({k: out.get(k) for k in ("size", "shape", "latency_ms", "exact", "edits", "memory")}),
          flush=True)
    return out


def diff_stats(after: dict, before: dict) -> dict:
    return {k: (v - before.get(k, 0) if isinstance(v, (int, float)) and not isinstance(v, bool) else v)
            for k, v in after.items() if not k.startswith("last_")}


def run_traces(args, tok, engines: Engines) -> dict | None:
    from tokenplane.tokenize.evidence.traces import DEFAULT_TRACES_DIR

    directory = Path(args.traces) if args.traces else DEFAULT_TRACES_DIR
    if directory is None or not directory.exists():
        return None
    peers = {name: fn for name, fn in engines.full.items() if name != "reference"}
    out = trace_sync(tok, directory, args.trace_count, args.session_path, args.trace_ref_count, peers)
    if peers:   # the same replay with nothing between the calls: the peers' full encodes evict the CPU caches
        alone = trace_sync(tok, directory, args.trace_count, args.session_path, 0)
        out["sync_alone_ms"], out["fixed_alone_ms"] = alone["sync_ms"], alone["fixed_ms"]
    print(json.dumps({"traces": {k: out[k] for k in ("sync_ms", "fixed_ms", "reference_ms", "exact", "peers_ms")}}),
          flush=True)
    return out


def acceptance(stats: dict) -> float | None:
    first = stats.get("first_window_accepts")
    total = stats.get("repairs")
    return first / total if (first is not None and total) else None


def markdown(full: dict) -> str:
    meta = full["meta"]
    head = [f"# Session repair latency ({', '.join(full['families'])})\n",
            f"Machine: {meta['machine']}, {meta['cpus']} CPUs, load average {meta['loadavg']} at start, "
            f"{meta['loadavg_end']} at end; wall {meta['wall_s']} s. Command: `{meta['command']}`.\n"]
    return "\n".join(head) + "\n" + "\n".join(markdown_family(fam, res) for fam, res in full["families"].items())


ENGINES = ["tokenplane", "tokenplane_alone", "tokenplane_flushed", "tokenplane_same", "tokenplane_same_flushed",
           "tokenplane_sync", "memcmp", "reference", "fastokens", "gigatoken", "toktier"]


def _cell(v: dict) -> str:
    return f"{v['p50']:.3f} / {v['p90']:.3f} (n={v['n']})" if v.get("n") else "-"


def markdown_family(family: str, res: dict) -> str:
    lines = [f"## {family}\n"]
    if "meta" in res:
        m = res["meta"]
        lines.append(f"Measured by an earlier run: `{m['command']}` ({m['started']}, load average {m['loadavg']} at "
                     f"start, {m.get('loadavg_end', '?')} at end, wall {m.get('wall_s', '?')} s).\n")
    if res.get("peers_missing"):
        lines.append(f"Peers not timed (not installed here, or failing to load this file): "
                     f"{', '.join(res['peers_missing'])}.\n")
    lines += [
        "Latency per step in ms, P50 / P90. tokenplane = Session.append + full IDs as an array; tokenplane_sync = "
        "a second session fed the whole text by Session.sync; memcmp = `text == copy` of the whole text (one "
        f"memcmp, the floor of a prefix check); windows encoded with the `{res.get('session_path', 'cpu')}` path; "
        "reference/peers = full re-encode (subsampled). Edits: 20 characters replaced at 20-80% of the text.\n"]
    engines = [e for e in ENGINES if any(e in r["latency_ms"] for r in res["synthetic"])]
    lines.append("| size | shape | " + " | ".join(engines) + " | sync - append - 1.5 memcmp | edit P50 / P90 | "
                 "exact | first-window | fallbacks |")
    lines.append("|---|---|" + "---:|" * len(engines) + "---:|---:|---|---:|---:|")
    for r in res["synthetic"]:
        lat = r["latency_ms"]
        cells = [_cell(lat[e]) if e in lat else "-" for e in engines]
        slack = lat["tokenplane_sync"]["p50"] - lat["tokenplane"]["p50"] - 1.5 * lat["memcmp"]["p50"]
        ed = r.get("edits")
        edit = f"{_cell(ed['ms'])}, renorm {ed['renormalizations']}" if ed else "-"
        exact = ", ".join(f"{k}{'' if v else ' ✗'}" for k, v in r["exact"].items())
        exact += "" if not ed else (", edits" if ed["exact"] else ", edits ✗")
        acc = acceptance(r["session_stats"])
        lines.append(f"| {r['size']} | {r['shape']} | " + " | ".join(cells) + f" | {slack:+.3f} | {edit} | {exact} | "
                     f"{'-' if acc is None else f'{acc:.4%}'} | {r['session_stats'].get('full_fallbacks', '-')} |")
    mem = [(r["size"], r["memory"]) for r in res["synthetic"] if "memory" in r]
    if res.get("small_memory"):
        mem.insert(0, ("small", res["small_memory"]))
    if mem:
        lines += ["\nSession state, bytes per token (after the context and 10 appends):\n",
                  "| size | chars | tokens | tracemalloc | RSS delta | nbytes |", "|---|---:|---:|---:|---:|---:|"]
        lines += [f"| {k} | {m['chars']:,} | {m['tokens']:,} | {m['tracemalloc_b_per_token']:.2f} | "
                  f"{m['rss_b_per_token']:.2f} | {m['nbytes_b_per_token']:.2f} |" for k, m in mem]
    t = res.get("traces")
    if t:
        lines.append(f"\n### Real mini-swe-agent traces ({family}): Session.sync of every call's whole prompt\n\n"
                     f"{t['trajectories']} trajectories, {t['continuations']} continuations; context P50 "
                     f"{t['context_chars_p50']:,.0f} chars, max {t['context_chars_max']:,} chars; final IDs exact vs "
                     f"reference {t['exact']}. `sync + IDs` is timed interleaved with each installed peer's full "
                     f"re-encode of the same prompt (order rotated per call), then the replay is repeated alone.\n")
        lines.append("| what | P50 ms | P90 ms | P99 ms | n |")
        lines.append("|---|---:|---:|---:|---:|")
        for label, key in [("sync + IDs", "sync_ms"), ("per-call fixed cost (all but the window encode)", "fixed_ms"),
                           ("sync + IDs, replayed alone (no peer between calls)", "sync_alone_ms"),
                           ("per-call fixed cost, replayed alone", "fixed_alone_ms"),
                           (f"reference full re-encode (first {t['reference_on_first_trajectories']} trajectories)",
                            "reference_ms")]:
            v = t.get(key, {})
            if v.get("n"):
                lines.append(f"| {label} | {v['p50']:.3f} | {v['p90']:.3f} | {v['p99']:.3f} | {v['n']} |")
        for name, v in t.get("peers_ms", {}).items():
            if v.get("n"):
                lines.append(f"| {name} full re-encode (every call, interleaved; final IDs exact "
                             f"{t['peers_exact'][name]}) | {v['p50']:.3f} | {v['p90']:.3f} | {v['p99']:.3f} | "
                             f"{v['n']} |")
        acc = acceptance(t["session_stats"])
        lines.append(f"\nFirst-window acceptance {'-' if acc is None else f'{acc:.4%}'}; full fallbacks "
                     f"{t['session_stats'].get('full_fallbacks', 0)}.")
    lines.append(f"\n### Targets ({family}; reported, not asserted)\n")
    lines += [f"- {k}: {v}" for k, v in res["targets"].items()]
    return "\n".join(lines) + "\n"


def _met(ok: bool) -> str:
    return "met" if ok else "NOT met"


def targets(res: dict) -> dict:
    flat = {r["size"]: r for r in res["synthetic"] if r["shape"] == "flat1400"}
    out = {}
    if flat:
        p50 = {k: r["latency_ms"]["tokenplane"]["p50"] for k, r in flat.items()}
        out["append P50 <= 0.3 ms at every size (1.4K appends)"] = (
            f"{_met(all(v <= 0.3 for v in p50.values()))}: " + ", ".join(f"{k} {v:.3f} ms" for k, v in p50.items()))
        if "4M" in p50 and "100K" in p50:
            ratio = p50["4M"] / p50["100K"]
            out["append flat: P50(4M) / P50(100K) <= 1.2"] = f"{_met(ratio <= 1.2)}: {ratio:.2f}"
        sweep = f"appends after a {FLUSH_MB} MB cache sweep"
        same = "appends of one fixed text from one piece-map state"
        for column, label, short in (("tokenplane_alone", "appends alone (no interleaved full-text work)",
                                      "appends alone"), ("tokenplane_flushed", sweep, sweep),
                                     ("tokenplane_same", same, same),
                                     ("tokenplane_same_flushed", f"{same}, after the sweep", f"{same}, after the sweep")):
            col = {k: r["latency_ms"][column]["p50"] for k, r in flat.items() if column in r["latency_ms"]}
            if not col:
                continue
            out[f"{label}: P50 <= 0.3 ms"] = (f"{_met(all(v <= 0.3 for v in col.values()))}: "
                                              + ", ".join(f"{k} {v:.3f} ms" for k, v in col.items()))
            if "4M" in col and "100K" in col:
                ratio = col["4M"] / col["100K"]
                out[f"{short} flat: P50(4M) / P50(100K) <= 1.2"] = f"{_met(ratio <= 1.2)}: {ratio:.2f}"
        cells = []
        ok = True
        for k, r in flat.items():
            lat = r["latency_ms"]
            bound = lat["tokenplane"]["p50"] + 1.5 * lat["memcmp"]["p50"]
            ok &= lat["tokenplane_sync"]["p50"] <= bound
            cells.append(f"{k} sync {lat['tokenplane_sync']['p50']:.3f} vs bound {bound:.3f} ms")
        out["sync P50 <= append P50 + 1.5 x memcmp P50"] = f"{_met(ok)}: " + ", ".join(cells)
        ed = {k: r["edits"]["ms"]["p50"] for k, r in flat.items() if "edits" in r}
        if ed:
            out["mid-context edit P50 <= 0.5 ms at every size"] = (
                f"{_met(all(v <= 0.5 for v in ed.values()))}: " + ", ".join(f"{k} {v:.3f} ms" for k, v in ed.items()))
        mem = {k: r["memory"] for k, r in flat.items() if "memory" in r}
        if res.get("small_memory"):
            mem = {"small": res["small_memory"], **mem}
        if mem:
            worst = max(max(m["tracemalloc_b_per_token"], m["rss_b_per_token"]) for m in mem.values())
            out["state <= 8 bytes/token at every size (tracemalloc and RSS)"] = (
                f"{_met(worst <= 8)}: " + ", ".join(f"{k} {m['tracemalloc_b_per_token']:.1f} / "
                                                    f"{m['rss_b_per_token']:.1f}" for k, m in mem.items()))
    t = res.get("traces")
    if t and t["sync_ms"].get("n"):
        v = t["sync_ms"]
        out["real traces: sync P50 <= 0.15 ms"] = f"{_met(v['p50'] <= 0.15)}: {v['p50']:.3f} ms"
        out["real traces: sync P99 <= 1 ms"] = f"{_met(v['p99'] <= 1.0)}: {v['p99']:.3f} ms"
        va = t.get("sync_alone_ms", {})
        if va.get("n"):
            out["real traces, replayed alone: sync P50 <= 0.15 ms"] = f"{_met(va['p50'] <= 0.15)}: {va['p50']:.3f} ms"
            out["real traces, replayed alone: sync P99 <= 1 ms"] = f"{_met(va['p99'] <= 1.0)}: {va['p99']:.3f} ms"
        out["real traces: per-call fixed cost P50 (reported)"] = f"{t['fixed_ms']['p50']:.3f} ms"
        for name, pv in t.get("peers_ms", {}).items():
            if pv.get("n"):
                out[f"real traces: sync P50 below {name}'s full re-encode P50 (same run)"] = (
                    f"{_met(v['p50'] < pv['p50'])}: {v['p50']:.3f} vs {pv['p50']:.3f} ms")
        out["real traces: exact"] = t["exact"]
    return out


def plot(full: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fams = list(full["families"])
    shapes = sorted({r["shape"] for res in full["families"].values() for r in res["synthetic"]})
    fig, axes = plt.subplots(len(fams), len(shapes), figsize=(6 * len(shapes), 4 * len(fams)), squeeze=False)
    for i, fam in enumerate(fams):
        for ax, shape in zip(axes[i], shapes):
            rows = [r for r in full["families"][fam]["synthetic"] if r["shape"] == shape]
            for eng in [*ENGINES, "edit"]:
                lat = [(r, r["edits"]["ms"] if eng == "edit" and "edits" in r else r["latency_ms"].get(eng, {}))
                       for r in rows]
                pts = [(SIZES[r["size"]], v["p50"], v["p90"]) for r, v in lat if v.get("n")]
                if pts:
                    pts.sort()
                    line, = ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{eng} P50")
                    ax.plot([p[0] for p in pts], [p[2] for p in pts], ls=":", color=line.get_color())
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_xlabel("context characters")
            ax.set_ylabel("ms per step (solid P50, dotted P90)")
            ax.set_title(f"{fam}: {shape} appends")
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--family", default="all", help=f"comma list or all ({ALL_FAMILIES})")
    p.add_argument("--trace-families", default=None, help="families that replay the real traces (default: all run)")
    p.add_argument("--corpus", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "tokenplane_corpus"))
    p.add_argument("--sizes", default="100K,1M,4M")
    p.add_argument("--shapes", default="flat1400", help="flat1400 and/or claude-code")
    p.add_argument("--steps", type=int, default=30, help="append steps per size and shape")
    p.add_argument("--edit-steps", type=int, default=30, help="mid-context edits per size")
    p.add_argument("--append-cap", type=int, default=100_000, help="cap on a drawn append, characters")
    p.add_argument("--ref-steps", default="100K:10,1M:3,4M:2", help="timed steps of the reference re-encode")
    p.add_argument("--engines", default="fastokens,gigatoken,toktier")
    p.add_argument("--session-path", default="cpu", choices=["cpu", "reference"],
                   help="engine the session encodes its repair windows with (cpu = tokenplane's exact fast path)")
    p.add_argument("--traces", default=str(ROOT.parent / "shared" / "data" / "traces" / "mini-swe-agent"),
                   help="mini-swe-agent directory")
    p.add_argument("--trace-count", type=int, default=100)
    p.add_argument("--trace-ref-count", type=int, default=5, help="trajectories also re-encoded by the reference")
    p.add_argument("--no-traces", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--merge-from", default=None, help="earlier session_repair.json whose other families to keep")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = p.parse_args()
    args.ref_steps = {k: int(v) for k, v in (x.split(":") for x in args.ref_steps.split(","))}
    import tokenplane

    t_start = time.time()
    meta = {"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
            "loadavg": " ".join(f"{x:.2f}" for x in os.getloadavg()), "command": " ".join(sys.argv),
            "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    pool = corpus_pool(ensure_corpus(Path(args.corpus)))
    full: dict = {"meta": meta, "families": {}}
    families = (ALL_FAMILIES if args.family == "all" else args.family).split(",")
    trace_families = set(args.trace_families.split(",")) if args.trace_families else set(families)
    for family in families:
        tok = tokenplane.load(family)
        if args.session_path == "cpu":
            tok.encode("build the tables 123", path="cpu")   # one-time table build, not part of any timing
        warm = tok.session(encode_path=args.session_path)     # load (or compile) the splice kernels once
        warm.sync("warm up the kernels, 123. " * 200)
        warm.sync("warm up the kernels, 123. " * 201)
        warm.edit(10, 20, "x")
        warm.sync(warm.text + "\u4e2d")                      # a cross-kind prefix compare (its kernel)
        engines = Engines(family, tok, set(args.engines.split(",")) - {""})
        rng = random.Random(args.seed)
        res: dict = {"synthetic": [], "session_path": args.session_path, "peers_missing": engines.missing}
        seed = NFC_SEED if tok.family.normalizer is not None else ""
        res["small_memory"] = memory(tok, seed + pool[:6000], [], args.session_path)
        same = SameAppends(tok, args.session_path, pool, args.steps)
        for size_name in args.sizes.split(","):
            for shape in args.shapes.split(","):
                res["synthetic"].append(run_synthetic(args, tok, engines, pool, size_name, shape, rng, same))
        if not args.no_traces and family in trace_families:
            res["traces"] = run_traces(args, tok, engines)
        res["targets"] = targets(res)
        full["families"][family] = res
    meta["wall_s"] = round(time.time() - t_start, 1)
    meta["loadavg_end"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    if args.merge_from:
        # Keep families measured by an earlier run (its own meta travels with them).
        old = json.loads(Path(args.merge_from).read_text())
        for fam, res in old.get("families", {}).items():
            if fam not in full["families"]:
                res["meta"] = old["meta"]
                full["families"] = {fam: res, **full["families"]}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "session_repair.json").write_text(json.dumps(full, indent=1, default=str))
    (out / "session_repair.md").write_text(markdown(full))
    plot(full, out / "session_repair.png")
    print(markdown(full))
    return 0


if __name__ == "__main__":
    sys.exit(main())
