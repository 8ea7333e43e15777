"""Where one chat turn's prepare phase goes, in process, turn after turn with an idle gap between them.

The tier's prepare phase (tokenization.phases_ms: prepared - received) is ProxyServer._chat_work: parse the body
(through the conversation's kept body), validate, render the new messages, repair the session, write the upstream
body. This runs exactly that (the same branches as chat_completions takes on the loop), on the workloads of
benchmarks/tier_overhead.py (real mini-swe-agent trajectories, a synthetic 100K-character conversation), with an idle
gap before every turn (an agent's pace: the caches go cold between turns, which in this tier roughly triples the
per-turn cost against back-to-back turns), and times each piece with perf_counter spans (inclusive; nested pieces
are indented). Pieces a tree does not have are left out, so that two trees can be profiled by the same script:

    env PYTHONPATH=TREE python benchmarks/tier_prepare_profile.py [--gap-ms 30] [--trajectories 12]
        [--sizes 100000] [--out FILE.json]

Prints a table of P50 ms per piece and workload (and writes it as JSON with --out).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from serve_agent import load_trajectories, real_text  # noqa: E402
from tier_overhead import chat_body, synthetic  # noqa: E402

# (label, owner path from the server, attribute): inclusive spans; a label's indent shows what it sits inside
PIECES = [
    ("parse (kept body)", "deltas", "fast"),
    ("parse (full)", "deltas", "full"),
    ("validate", "", "_validated"),
    ("upstream fields", "", "_fields"),
    ("tokenize (chat_ids)", "", "chat_ids"),
    ("  control-token scan", "chat", "quotes_specials"),
    ("  render new messages", "chat", "extend"),
    ("  render all", "chat", "render"),
    ("  session append (+ body)", "chat_sessions", "append_on"),
    ("  session sync (+ body)", "chat_sessions", "encode_on"),
    ("  session lookup+sync (+ body)", "chat_sessions", "encode"),
    ("    Session.append", "@session", "append"),
    ("      plan (literals, NFC, repair)", "@session", "_plan_append"),
    ("        repair", "@repair", "repair"),
    ("          window encode", "@repair", "encode_window"),
    ("            BPE kernel", "@repair", "_ordinary_records"),
    ("          splice search (left)", "@repair", "_find_left"),
    ("      commit", "@session", "_commit"),
    ("    upstream body JSON", "bodies", "chunks"),
    ("keep body state", "deltas", "keep"),
]


def _owner(server: Any, path: str) -> Any:
    if path == "@session":
        from tokenplane.tokenize import session
        return session.Session
    if path == "@repair":
        from tokenplane.tokenize import repair
        return repair.WindowRepair
    return getattr(server, path) if path else server


def instrument(server: Any, spans: dict[str, list[float]]) -> None:
    for label, path, attr in PIECES:
        owner = _owner(server, path)
        fn = getattr(owner, attr, None)
        if fn is None:
            continue

        def wrap(fn: Callable[..., Any], label: str) -> Callable[..., Any]:
            @functools.wraps(fn)
            def timed(*a: Any, **k: Any) -> Any:
                t = time.perf_counter()
                try:
                    return fn(*a, **k)
                finally:
                    spans.setdefault(label, []).append((time.perf_counter() - t) * 1e3)
            return timed
        setattr(owner, attr, wrap(fn, label))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gap-ms", type=float, default=30.0)
    p.add_argument("--trajectories", type=int, default=12)
    p.add_argument("--sizes", type=int, nargs="*", default=[100_000])
    p.add_argument("--turns", type=int, default=30)
    p.add_argument("--out", default=None)
    args = p.parse_args()

    from starlette.requests import Request

    import tokenplane
    from tokenplane.serve import proxy_routes
    from tokenplane.serve.app import create_app
    from tokenplane.serve.config import Limits
    from tokenplane.serve.upstream import UpstreamPool

    tok = tokenplane.load("qwen3")
    app = create_app(None, tok, model_name="stub", upstream=UpstreamPool(["http://127.0.0.1:9"]),
                     limits=Limits(max_prompt_chars=1 << 24))
    server = app.state.server
    asyncio.run(server.warm_up())
    request = Request({"type": "http", "headers": [], "method": "POST", "path": "/v1/chat/completions"})

    def turn(raw: bytes) -> Any:   # the branches of ProxyServer.chat_completions, all on this thread
        if len(raw) <= proxy_routes._INLINE_CHAT_BYTES:
            return server._chat_work(request, raw)
        parsed = server.deltas.fast(raw) if len(raw) <= proxy_routes._INLINE_DELTA_BYTES else None
        if parsed is not None and parsed.new_bytes <= proxy_routes._INLINE_CHAT_BYTES:
            return server._chat_work(request, raw, parsed)
        return server._chat_work(request, raw, parsed, parsed is None and len(raw) <= proxy_routes._INLINE_DELTA_BYTES)

    workloads: dict[str, list[list[list[dict[str, str]]]]] = {}
    trajectories = load_trajectories(ROOT / "tests" / "fixtures" / "traces", args.trajectories)
    workloads["real trajectories"] = [[conv[:n] for n in range(2, len(conv) + 1) if conv[n - 1]["role"] == "user"]
                                      for conv in trajectories]
    corpus = real_text()
    for size in args.sizes:
        workloads[f"{size // 1000}K"] = [synthetic(size, args.turns, random.Random(0), corpus)]
    spans: dict[str, list[float]] = {}
    instrument(server, spans)
    out: dict[str, Any] = {"gap_ms": args.gap_ms, "tree": str(Path(tokenplane.__file__).parent.parent),
                           "workloads": {}}
    for name, conversations in workloads.items():
        totals: list[float] = []
        per: dict[str, list[float]] = {}
        for ci, calls in enumerate(conversations):
            for ti, messages in enumerate(calls):
                raw = chat_body(messages, f"{name}-{ci}")
                time.sleep(args.gap_ms / 1e3)
                spans.clear()
                t = time.perf_counter()
                _, _, report, _ = turn(raw)
                dt = (time.perf_counter() - t) * 1e3
                server._answer_out(report.session if report is not None else None)
                if ti == 0:
                    continue   # the conversation's first turn builds its session
                totals.append(dt)
                for label, got in spans.items():
                    per.setdefault(label, []).append(sum(got))
        n = len(totals)
        # P50 over the turns that ran the piece, and how many did
        out["workloads"][name] = {"turns": n, "prepare_ms_p50": round(statistics.median(totals), 4),
                                  "pieces": {label: {"p50_ms": round(statistics.median(v), 4), "turns": len(v)}
                                             for label, v in per.items()}}
    print(f"tree {out['tree']}, idle gap {args.gap_ms} ms before each turn; P50 ms (turns that ran the piece)")
    for name, w in out["workloads"].items():
        print(f"\n{name}: {w['turns']} turns, prepare P50 {w['prepare_ms_p50']:.3f} ms")
        for label, _, _ in PIECES:
            if label in w["pieces"]:
                c = w["pieces"][label]
                print(f"  {label:34s} {c['p50_ms']:7.3f}  ({c['turns']})")
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
