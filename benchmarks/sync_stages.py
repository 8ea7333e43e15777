"""Where one real-trace `Session.sync` spends its time, stage by stage, per family (median microseconds per call).

Replays mini-swe-agent trajectories through Session.sync (as session_costs.trace_sync does, no peers) with a timer
wrapped around each stage function, and prints one Markdown row per family:

  prefix       TextStore.is_prefix_of: the resent text against the stored chunks
  validate     validate_text of the new tail
  plan_glue    Session._plan_append minus the repair (plan values, NFC split and map for qwen3)
  kernel       the window encoder's time (SessionStats.last_encode_s; with the fused append window this includes its
               splice search and kept-token compare, and on the committed path its write of the records)
  repair_glue  WindowRepair.repair or .append_commit minus the kernel and the records (window start, window text,
               search, compare, Python between)
  records      Records.splice and Records.reserve (the ID buffer's growth; the append kernel where the fused call
               did not write the records itself)
  text_apply   TextStore.apply or .adopt (the appended chunk; adopting the resent str)
  commit_glue  Session._commit minus records and text, or Session._fast_append minus its repair and text (the
               committed append: Session._fast_append, appendwin.COMMITTED)
  sync_glue    the rest of sync + returning the IDs (np.asarray(session.ids))

Each wrapper adds ~0.3 us to its stage, and the stages' medians do not add up to the median total. Light (a few
seconds a family at the default 12 trajectories); run the two trees to compare:

    PYTHONPATH=. python benchmarks/sync_stages.py --family all --trace-count 12 \\
        --traces /work/shared/data/traces/mini-swe-agent
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
ALL = "cl100k_base,o200k_base,llama3,qwen3,deepseek_v4,smollm2"
COLS = ["TOTAL", "prefix", "validate", "plan_glue", "kernel", "repair_glue", "records", "text_apply", "commit_glue",
        "sync_glue"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--family", default="all")
    p.add_argument("--trace-count", type=int, default=12)
    p.add_argument("--traces", default=str(ROOT.parent / "shared" / "data" / "traces" / "mini-swe-agent"))
    args = p.parse_args()
    import tokenplane
    from tokenplane.tokenize import records, repair, session, textstore
    from tokenplane.tokenize.evidence.traces import load_trajectories, render_prompts

    cur: dict[str, float] = {}

    def wrap(obj, name: str, label: str) -> None:
        f = getattr(obj, name, None)
        if f is None:       # a tree without that stage (an older revision run for comparison)
            return

        def timed(*a, **k):
            t0 = time.perf_counter()
            r = f(*a, **k)
            cur[label] = cur.get(label, 0.0) + time.perf_counter() - t0
            return r

        setattr(obj, name, staticmethod(timed) if isinstance(obj.__dict__.get(name), staticmethod) else timed)

    wrap(textstore.TextStore, "is_prefix_of", "prefix")
    wrap(session, "validate_text", "validate")
    wrap(repair.WindowRepair, "repair", "repair")
    wrap(session.Session, "_plan_append", "plan")
    wrap(session.Session, "_commit", "commit")
    wrap(repair.WindowRepair, "append_commit", "repair")
    wrap(session.Session, "_fast_append", "commit")
    wrap(records.Records, "splice", "records")
    wrap(records.Records, "reserve", "records")
    wrap(textstore.TextStore, "apply", "text_apply")
    wrap(textstore.TextStore, "adopt", "text_apply")
    prompts_all = [render_prompts(t) for t in load_trajectories(Path(args.traces), limit=args.trace_count)]
    if not prompts_all:
        p.error(f"no trajectories in {args.traces}")
    print(f"tree {tokenplane.__file__}, {len(prompts_all)} trajectories; median us per sync call\n")
    print("| family | " + " | ".join(COLS) + " |\n|---|" + "---:|" * len(COLS))
    for fam in (ALL if args.family == "all" else args.family).split(","):
        tok = tokenplane.load(fam)
        tok.encode("build the tables 123", path="cpu")
        for prompts in prompts_all[:3]:        # warm: kernels loaded, piece caches filled as in a serving process
            s = tok.session(encode_path="cpu")
            for prompt in prompts:
                s.sync(prompt)
        acc: dict[str, list[float]] = {c: [] for c in COLS}
        for prompts in prompts_all:
            s = tok.session(encode_path="cpu")
            for k, prompt in enumerate(prompts):
                cur.clear()
                t0 = time.perf_counter()
                s.sync(prompt)
                np.asarray(s.ids)
                dt = time.perf_counter() - t0
                if not k:                       # a session's first call is a full encode
                    continue
                g, kern = cur.get, s.stats.last_encode_s
                plan, rep, recs, text = g("plan", 0.0), g("repair", 0.0), g("records", 0.0), g("text_apply", 0.0)
                # the committed append (no plan) splices its records inside the repair; the general one at commit
                in_repair = recs if not plan else 0.0
                row = {"TOTAL": dt, "prefix": g("prefix", 0.0), "validate": g("validate", 0.0),
                       "plan_glue": plan - rep if plan else 0.0, "kernel": kern,
                       "repair_glue": rep - kern - in_repair, "records": recs, "text_apply": text,
                       "commit_glue": g("commit", 0.0) - (rep if not plan else recs) - text}
                row["sync_glue"] = dt - g("prefix", 0.0) - g("validate", 0.0) - plan - g("commit", 0.0)
                for c in COLS:
                    acc[c].append(row[c])
        print(f"| {fam} | " + " | ".join(f"{np.median(acc[c]) * 1e6:.1f}" for c in COLS) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
