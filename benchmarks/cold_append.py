"""Where a cold session append's time goes: its code coming back, or its data.

An agent's next call reaches a server after other work. For each family, one session synced to a context of ASCII
corpus text, then 1,400-character ASCII appends (the path tokenize/asciiappend.py takes), each timed as
`session.append(chunk); np.asarray(session.ids)` with the append kernel's own time read from the session's stats,
in four states rotated step by step:

  cold        after a sweep that writes --flush-mb of memory (every cache level evicted)
  cold+code   after the same sweep, then a 2-character append to a second session of the same tokenizer (the
              code paths and the interpreter's objects come back; the context's and the chunk's table entries do not)
  warm        after a 1,400-character append of other text to that second session (code and the tables' hot parts)
  alone       nothing between steps

and the Python steps the append path is made of, each timed alone after the same sweep: two clock reads with nothing
between them (the timer's floor), an empty function call, a numpy slice, the same slice plus `setflags`, and the
kernel guard's argument checks (kernels._guarded around a function that does nothing). Every session's IDs are
checked against the reference at the end.

    python benchmarks/cold_append.py --corpus /tmp/corpus --out benchmarks/results/cold_append
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from record_files import RunMeta, save_figure, write_record  # noqa: E402

import tokenplane  # noqa: E402
from tokenplane.tokenize.cpu import kernels  # noqa: E402

STATES = ("cold", "cold+code", "warm", "alone")


def ascii_pool(corpus: Path) -> str:
    with open(corpus / "mixed.jsonl", encoding="utf-8") as f:
        text = "".join(json.loads(line)["text"] for line in f)
    return text.encode("ascii", "replace").decode()


def run_family(family: str, pool: str, size: int, steps: int, evict: Callable[[], Any]) -> dict[str, Any]:
    tok = tokenplane.load(family)
    session = tok.session()
    session.sync(pool[:size])
    other = tok.session()
    other.sync(pool[-200_000:-100_000])
    cursor, far = size, len(pool) - 100_000
    times: dict[str, list[tuple[float, float]]] = {s: [] for s in STATES}
    for k in range(steps * len(STATES)):
        state = STATES[k % len(STATES)]
        chunk = pool[cursor:cursor + 1400]
        cursor += 1400
        if state in ("cold", "cold+code"):
            evict()
        if state == "cold+code":
            other.append(" x")
        elif state == "warm":
            other.append(pool[far:far + 1400])
            far += 1400
        t0 = time.perf_counter()
        session.append(chunk)
        np.asarray(session.ids)
        times[state].append((time.perf_counter() - t0, session.stats.last_encode_s))
    exact = bool(np.array_equal(np.asarray(session.ids), tok.encode(session.text, path="reference")))
    row: dict[str, Any] = {"family": family, "context_chars": size, "steps": steps, "exact": exact,
                           "path": session.stats.last_path}
    for state, vals in times.items():
        total = [v[0] * 1e6 for v in vals[2:]]      # (the first steps of each state warm the rotation up)
        kern = [v[1] * 1e6 for v in vals[2:]]
        row[state] = {"p50_us": statistics.median(total), "p90_us": float(np.percentile(total, 90)),
                      "kernel_p50_us": statistics.median(kern)}
    return row


def python_steps(evict: Callable[[], Any], steps: int) -> list[dict[str, Any]]:
    """Each step of the append path's kind alone, after the sweep (median over `steps`)."""
    buf = np.zeros(1 << 20, np.uint32)
    ck, ex = np.zeros(1 << 12, np.int64), np.zeros(0, np.int64)
    text = "x" * 2000

    def empty() -> None:
        return None

    def nothing(*args: Any) -> tuple[int, int, int]:
        return 0, 0, 0

    tail = len(kernels.EXPORTS["append_gpt4"][3]) - 10
    guarded = kernels._guarded("append_gpt4", nothing, (0,) * tail)    # the head's checks; the kernel is `nothing`

    def sliced() -> None:
        buf[:500_000]

    def flagged() -> None:
        buf[:500_000].setflags(write=False)

    cases: list[tuple[str, Callable[[], Any]]] = [
        ("two clock reads (floor)", lambda: None), ("empty function call", empty), ("numpy slice", sliced),
        ("numpy slice + setflags", flagged),
        ("kernel guard checks (10 arguments)", lambda: guarded(text, 0, 1, 2, buf, ck, ex, ex, 5, True)),
        ("a function taking the same arguments", lambda: nothing(text, 0, 1, 2, buf, ck, ex, ex, 5, True)),
    ]
    out: dict[str, list[float]] = {name: [] for name, _ in cases}
    clock = time.perf_counter_ns
    for _ in range(steps):
        for name, fn in cases:
            evict()
            if name == "two clock reads (floor)":
                t0 = clock()
                t1 = clock()
            else:
                t0 = clock()
                fn()
                t1 = clock()
            out[name].append((t1 - t0) / 1e3)
    return [{"step": name, "cold_p50_us": statistics.median(v[2:])} for name, v in out.items()]


def markdown(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    lines = ["# Cold session appends: code or data (1,400-character ASCII appends)", "",
             f"Command: `{meta['command']}`  ", f"Machine: {meta['machine']}; load average {meta['load_start']} "
             f"(start), {meta['load_end']} (end); started {meta['started']}, {meta['wall_s']:.0f} s; "
             f"sweep {meta['flush_mb']} MB; kernels: {meta['kernels']}; "
             f"{'each family in its own process' if meta['own_process'] else 'the families in this order, one process'}.",
             "",
             "Each step `session.append(chunk); np.asarray(session.ids)`, P50 [P90] us, and in parentheses the append "
             "kernel's own P50 (the session's `last_encode_s`). cold: after the sweep; cold+code: after the sweep "
             "and a 2-character append to another session of the tokenizer (the code comes back, not this text's "
             "table entries); warm: after a 1,400-character append to that session; alone: nothing between steps.",
             "", "| family | context | " + " | ".join(STATES) + " | exact |", "|---|---:|" + "---:|" * len(STATES) + "---|"]
    for r in rows:
        if "family" not in r:
            continue
        cells = [f"{r[s]['p50_us']:.0f} [{r[s]['p90_us']:.0f}] ({r[s]['kernel_p50_us']:.0f})" for s in STATES]
        lines.append(f"| {r['family']} | {r['context_chars']:,} | " + " | ".join(cells) + f" | {r['exact']} |")
    lines += ["", "One step of each kind alone after the sweep (P50 us, the timer's floor included):", "",
              "| step | cold P50 us |", "|---|---:|"]
    lines += [f"| {r['step']} | {r['cold_p50_us']:.1f} |" for r in rows if "step" in r]
    return "\n".join(lines) + "\n"


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fam = [r for r in rows if "family" in r]
    fig, ax = plt.subplots(figsize=(10, 4))
    width = 0.2
    for i, state in enumerate(STATES):
        xs = [k + (i - 1.5) * width for k in range(len(fam))]
        ax.bar(xs, [r[state]["p50_us"] for r in fam], width, label=f"{state} (total)")
        ax.bar(xs, [r[state]["kernel_p50_us"] for r in fam], width * 0.5, color="k", alpha=0.35)
    ax.set_xticks(range(len(fam)), [r["family"] for r in fam])
    ax.set_ylabel("append + IDs, P50 us (dark: the kernel)")
    ax.legend(fontsize=8)
    save_figure(fig, path)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--corpus", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "tokenplane_corpus"))
    p.add_argument("--out", default="benchmarks/results/cold_append")
    p.add_argument("--families", default="cl100k_base,o200k_base,llama3,qwen3,deepseek_v4,smollm2")
    p.add_argument("--context", type=int, default=1_000_000, help="characters in each session before the appends")
    p.add_argument("--steps", type=int, default=40, help="timed appends per state")
    p.add_argument("--flush-mb", type=int, default=128)
    p.add_argument("--cpu", type=int, default=None, help="pin to this CPU")
    p.add_argument("--own-process", action="store_true",
                   help="each family in a process of its own (a server loads one tokenizer; after other families' "
                        "work in the same process, cold appends measured up to 2x slower)")
    p.add_argument("--python-steps", type=int, default=1, help="0: skip the single-step timings")
    args = p.parse_args()
    if args.cpu is not None:
        os.sched_setaffinity(0, {args.cpu})
    run = RunMeta()
    pool = ascii_pool(Path(args.corpus))
    sweep = np.ones(args.flush_mb << 17, np.float64)
    evict = functools.partial(np.add, sweep, 1.0, out=sweep)
    rows: list[dict[str, Any]] = []
    for family in args.families.split(","):
        if args.own_process:    # this script again for one family: nothing of the other tokenizers in its process
            cmd = [sys.executable, __file__, "--corpus", args.corpus, "--families", family, "--context",
                   str(args.context), "--steps", str(args.steps), "--flush-mb", str(args.flush_mb), "--python-steps",
                   "0", "--out", f"{args.out}.{family}.tmp"]
            if args.cpu is not None:
                cmd += ["--cpu", str(args.cpu)]
            subprocess.run(cmd, check=True, capture_output=True)
            tmp = Path(f"{args.out}.{family}.tmp")
            row = json.loads(tmp.with_suffix(".json").read_text())["rows"][0]
            for suffix in (".json", ".md", ".png"):
                tmp.with_suffix(suffix).unlink()
        else:
            row = run_family(family, pool, args.context, args.steps, evict)
        rows.append(row)
        print(family, {s: round(row[s]["p50_us"]) for s in STATES}, "exact" if row["exact"] else "NOT EXACT", flush=True)
    if args.python_steps:
        rows += python_steps(evict, args.steps)
    meta = run.meta(flush_mb=args.flush_mb, kernels=kernels.get().kind, own_process=args.own_process)
    print(write_record(Path(args.out), meta, rows, markdown, plot))
    return 0 if all(r.get("exact", True) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
