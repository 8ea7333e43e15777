"""`tokenplane demo`: replay one real agent session through a tokenizer Session and check every step.

Each LLM call of the trajectory is rendered to its full prompt (all messages before it) and handed to
`Session.sync(prompt)`, which repairs the token state from the previous call instead of re-encoding everything. Every
step is then checked against a full reference encode of the same prompt, and both are timed. The table shows
exactness, our latency vs full re-encode, first-window acceptance, fallbacks and state size. Exit status 1 on any
mismatch.

Default session: the mini-swe-agent trajectory django__django-13512 from ../shared/data when present, else the same
trajectory bundled in the package (tokenplane/data/demo_session.json.gz, MIT, see NOTICE.md), so it runs offline.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
import time
from importlib import resources
from pathlib import Path

import numpy as np

DEFAULT_INSTANCE = "django__django-13512"


def main_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--family", default="qwen3",
                        help="tokenizer: cl100k_base, o200k_base, llama3, qwen3, deepseek_v4, smollm2 (default qwen3)")
    parser.add_argument("--trace", default=None,
                        help="a mini-swe-agent .traj.json file (default: django__django-13512 from the shared data "
                             "dir, else the bundled copy)")
    parser.add_argument("--traces-dir", default=None, help="directory of .traj.json files to pick the default from")
    parser.add_argument("--json", default=None, help="also write the per-step measurements to this JSON file")
    parser.add_argument("--quiet", action="store_true", help="print only the summary table")
    parser.add_argument("--session-path", default="cpu", choices=["cpu", "reference"],
                        help="engine the session encodes its repair windows with (default: the exact CPU fast path "
                             "when the family has one)")


def load_bundled() -> dict:
    with resources.files("tokenplane.data").joinpath("demo_session.json.gz").open("rb") as f:
        return json.loads(gzip.decompress(f.read()))


def find_trajectory(trace: str | None, traces_dir: str | None) -> tuple[list[dict], str]:
    """Messages of the session to replay and a description of where they came from."""
    from .tokenize.evidence.traces import DEFAULT_TRACES_DIR, load_trajectory

    if trace:
        return load_trajectory(trace), trace
    directory = Path(traces_dir) if traces_dir else DEFAULT_TRACES_DIR
    candidate = directory / f"{DEFAULT_INSTANCE}.traj.json" if directory is not None else None
    if candidate is not None and candidate.exists():
        return load_trajectory(candidate), str(candidate)
    return load_bundled()["messages"], "bundled tokenplane/data/demo_session.json.gz (MIT, mini-swe-agent)"


def percentile(values, q: float) -> float:
    return float(np.percentile(np.asarray(values, dtype=float), q)) if len(values) else float("nan")


def fast_path(tok, wanted: str) -> str:
    """The window-encode path to give sessions: "cpu" when the family has the fast CPU path, else "reference"."""
    if wanted != "cpu":
        return wanted
    if "cpu" not in tok.fast_paths:
        return "reference"
    tok.encode("build the tables once 123", path="cpu")   # one-time table build, outside every timing
    return "cpu"


def replay(tok, prompts: list[str], verbose: bool = True, session_path: str = "reference") -> dict:
    """Sync the session to each prompt in turn; time it and a full reference encode; compare."""
    session = tok.session(encode_path=session_path)
    steps = []
    for k, prompt in enumerate(prompts):
        t0 = time.perf_counter()
        session.sync(prompt)
        ids = np.asarray(session.ids)
        ours = time.perf_counter() - t0
        t0 = time.perf_counter()
        ref = tok.encode(prompt, path="reference")
        full = time.perf_counter() - t0
        exact = bool(np.array_equal(ids.astype(np.int64), ref.astype(np.int64)))
        steps.append({"step": k, "chars": len(prompt), "tokens": int(len(ref)), "ours_ms": ours * 1e3,
                      "full_ms": full * 1e3, "exact": exact})
        if verbose:
            print(f"  step {k:3d}  {len(prompt):>9,} chars  {len(ref):>8,} tokens  ours {ours * 1e3:8.2f} ms  "
                  f"full {full * 1e3:8.2f} ms  {'ok' if exact else 'MISMATCH'}", flush=True)
        if not exact:
            diff = np.flatnonzero(ids[:min(len(ids), len(ref))] != ref[:min(len(ids), len(ref))])
            first = int(diff[0]) if diff.size else min(len(ids), len(ref))
            steps[-1]["first_difference"] = first
    return {"steps": steps, "stats": session.stats.to_dict(), "nbytes": int(session.nbytes),
            "final_tokens": int(len(np.asarray(session.ids)))}


def summarize(result: dict) -> dict:
    steps = result["steps"]
    cont = steps[1:]   # step 0 is the session's first sight of the text: a full encode for everyone
    ours = [s["ours_ms"] for s in cont]
    full = [s["full_ms"] for s in cont]
    stats = result["stats"]
    repairs = stats.get("repairs", 0)
    first = stats.get("first_window_accepts")
    out = {
        "steps": len(steps), "exact": sum(s["exact"] for s in steps),
        "ours_p50_ms": percentile(ours, 50), "ours_p90_ms": percentile(ours, 90),
        "full_p50_ms": percentile(full, 50), "full_p90_ms": percentile(full, 90),
        "final_chars": steps[-1]["chars"] if steps else 0, "final_tokens": result["final_tokens"],
        "bytes_per_token": result["nbytes"] / max(1, result["final_tokens"]),
        "fallbacks": stats.get("full_fallbacks"),
        "widenings": stats.get("widenings", None),
    }
    out["speedup_p50"] = out["full_p50_ms"] / out["ours_p50_ms"] if out["ours_p50_ms"] > 0 else float("nan")
    out["repairs"] = repairs
    out["first_window_acceptance"] = (first / repairs) if (first is not None and repairs) else None
    out["session_stats"] = stats
    return out


def render_table(s: dict, family: str, source: str) -> str:
    acc = s["first_window_acceptance"]
    rows = [
        ("session", source),
        ("tokenizer", f"{family} (session windows: {s.get('session_path', 'reference')} path)"),
        ("steps (LLM calls)", f"{s['steps']}"),
        ("exact matches", f"{s['exact']} / {s['steps']}"),
        ("final prompt", f"{s['final_chars']:,} chars, {s['final_tokens']:,} tokens"),
        ("session sync  P50 / P90", f"{s['ours_p50_ms']:.3f} / {s['ours_p90_ms']:.3f} ms"),
        ("full re-encode P50 / P90", f"{s['full_p50_ms']:.3f} / {s['full_p90_ms']:.3f} ms"),
        ("speedup at P50", f"{s['speedup_p50']:.1f}x"),
        ("first-window acceptance", "n/a" if acc is None else f"{acc:.2%} of {s['repairs']} repairs"),
        ("fallbacks to full encode", f"{s['fallbacks']}"),
        ("widened windows", f"{s['widenings']}"),
        ("session state", f"{s['bytes_per_token']:.1f} bytes/token"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)


def main(args: argparse.Namespace) -> int:
    from .tokenize import load
    from .tokenize.evidence.traces import render_prompts

    messages, source = find_trajectory(args.trace, args.traces_dir)
    prompts = render_prompts(messages)
    if not prompts:
        print("the trajectory has no LLM calls to replay", file=sys.stderr)
        return 2
    tok = load(args.family)
    if not args.quiet:
        print(f"replaying {len(prompts)} calls of {source} through a {args.family} session", flush=True)
    session_path = fast_path(tok, args.session_path)
    result = replay(tok, prompts, verbose=not args.quiet, session_path=session_path)
    summary = summarize(result)
    summary["session_path"] = session_path
    print(render_table(summary, args.family, source))
    if args.json:
        Path(args.json).write_text(json.dumps({"summary": summary, **result}, indent=1, default=str))
    mismatches = summary["steps"] - summary["exact"]
    if mismatches:
        bad = next(s for s in result["steps"] if not s["exact"])
        print(f"MISMATCH at step {bad['step']} (first differing token {bad.get('first_difference')}); "
              f"{mismatches} of {summary['steps']} steps differ", file=sys.stderr)
        return 1
    return 0
