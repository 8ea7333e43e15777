"""Markdown and PNG of benchmarks/routing/serving.py's results (one JSON, parts merged over runs)."""
from __future__ import annotations

from pathlib import Path

from common import md_table


def _spread(r: dict) -> list:
    """P90, min-max and n of a repeated configuration's throughput ('' for a single legacy run)."""
    t = (r.get("summary") or {}).get("throughput")
    if not t:
        return ["", "", 1]
    return [t["p90"], f"{t['min']:.0f}-{t['max']:.0f}", t["n"]]


def fmt(x, nd=2):
    return "n/a" if x is None else f"{x:.{nd}f}"


# -- report -----------------------------------------------------------------------------------------------------------
def report(res: dict, algos: list[str], systems: list[str]) -> str:
    md = ["# Token-level routing serving benchmarks\n\n",
          f"Machine: {res['machine']}. Latency-model backend: {res['latency_provenance']}. Throughput = committed "
          "tokens/s streamed to clients (dropped tokens never count); latency = mean end-to-end request time.\n"]
    if res.get("notes"):
        md.append(f"\n{res['notes']}\n")
    legacy = [p for p in ("greedy", "length", "breakdown", "algos", "algos_long", "scaling", "ablation")
              if p in res and p not in res.get("part_meta", {})]
    if legacy and (res.get("commands") or res.get("load_note")):
        md.append(f"\nParts {', '.join(legacy)} come from an earlier session (single runs):\n")
        for cmd in res.get("commands", []):
            md.append(f"\nRun: `{cmd}`\n")
        if res.get("load_note"):
            md.append(f"\n{res['load_note']}\n")

    def meta(part: str) -> None:
        m = res.get("part_meta", {}).get(part)
        if m:
            md.append(f"Run: `{m['command']}` ({m['started']}, {m['wall_s']:.0f} s; load average at start "
                      f"{m['load_before']}, at end {m['load_after']}; ours' thresholds: {m['threshold_model']}). "
                      f"{m.get('note', '')}\n\n")
    for part, title in (("algos", "Concurrency 4: ours vs baselines (latency-model backend, seed scale)"),
                        ("algos_long", "Concurrency 4, prompts at the fits' anchor context: ours vs baselines "
                                       "(latency-model backend, seed scale)")):
        if part not in res:
            continue
        a = res[part]
        plen = next((r.get("prompt_len") for r in a.values() if r.get("prompt_len")), None)
        md.append(f"\n## {title}\n\n")
        if plen:
            md.append(f"Prompt {plen} tokens, max_tokens {res['args'].get('max_tokens')}.\n\n")
        meta(part)
        rows = []
        for alg in algos:
            o = a.get(f"{alg}/ours")
            if not o:
                continue
            for system in systems:
                r = a.get(f"{alg}/{system}")
                if r is None:
                    continue
                if "skipped" in r:
                    rows.append([alg, system, "n/a", "", "", "", "n/a", "n/a", "n/a", r["skipped"]])
                    continue
                lat = r["latency_mean_s"]
                speedup = o["throughput"] / r["throughput"] if r["throughput"] else float("nan")
                lat_gain = (lat / o["latency_mean_s"]) if lat and o["latency_mean_s"] else None
                rows.append([alg, system, r["throughput"], *_spread(r), fmt(lat), f"{speedup:.2f}x",
                             "n/a" if lat_gain is None else f"{lat_gain:.2f}x", str(r.get("thresholds") or "")])
        md.append(md_table(["algorithm", "system", "tok/s (median)", "tok/s P90", "min-max", "n", "latency s",
                            "ours / system (tok/s)", "system / ours (latency)", "thresholds / note"], rows))
    if "greedy" in res:
        g = res["greedy"]
        md.append(f"\n## Real tiny models on the CPU ({' + '.join(g['models'])}, {g['dtype']}, {g['prompts']} "
                  f"prompts x {g['max_tokens']} tokens, concurrency 4)\n\n")
        rows = []
        for alg in algos:
            e = g.get(alg)
            if not e:
                continue
            for system in ("ours", "standard", "standard_segment"):
                if system not in e:
                    continue
                r = e[system]
                if "skipped" in r:
                    rows.append([alg, system, "n/a", "n/a", r["skipped"]])
                else:
                    rows.append([alg, system, f"{r['identical_count']}/{g['prompts']}", r["throughput"],
                                 f"models identical: {r['models_identical']}"])
        md.append(md_table(["algorithm", "system", "outputs == sequential reference", "tok/s", "note"], rows))
    if "length" in res:
        L = res["length"]
        md.append("\n## Output limit: short vs 4x longer (R2R, concurrency 4, batch run to completion)\n\n")
        rows = []
        lens = sorted({v["max_tokens"] for v in L.values()})
        for system in ("ours", "standard"):
            base = L.get(f"{system}/{lens[0]}")
            for n in lens:
                r = L.get(f"{system}/{n}")
                rows.append([system, n, r["throughput"], r["latency_mean_s"],
                             f"{r['throughput'] / base['throughput'] - 1:+.1%}"])
        md.append(md_table(["system", "max tokens", "tok/s", "latency s", "throughput vs short"], rows))
    if "scaling" in res:
        S = res["scaling"]
        md.append("\n## Concurrency scaling (ours, R2R, latency-model backend)\n\n")
        meta("scaling")
        c1 = S.get("1")
        rows = []
        for c, r in S.items():
            rows.append([c, r["throughput"], *_spread(r), fmt(r["user_speed"], 1), str(r["thresholds"]),
                         f"{r['throughput'] / c1['throughput']:.2f}x" if c1 else "",
                         f"{r['user_speed'] / c1['user_speed']:.1%}" if c1 and r["user_speed"] and c1["user_speed"]
                         else ""])
        md.append(md_table(["concurrency", "tok/s (median)", "tok/s P90", "min-max", "n",
                            "single-user tok/s (median)", "thresholds", "growth vs C=1 (medians)",
                            "user speed kept (medians)"], rows))
    for key, title in (("ablation", "Ablation (R2R, concurrency 8, latency-model backend)"),
                       ("ablation_before_fix", "Ablation before the count-based launch fix (commit 453ed5a, same "
                                               "settings, for comparison)")):
        if key not in res:
            continue
        A = res[key]
        md.append(f"\n## {title}\n\n")
        meta(key)
        base = next(iter(A.values()))
        md.append(md_table(["configuration", "tok/s (median)", "tok/s P90", "min-max", "n", "vs base", "latency s",
                            "thresholds",
                            "launches per model (forced below threshold; of which max_delay backstop), median run"],
                           [[k, r["throughput"], *_spread(r), f"{r['throughput'] / base['throughput']:.2f}x",
                             fmt(r["latency_mean_s"]), r.get("thresholds") or "",
                             ", ".join(f"{n} ({f}; {b})" for n, f, b in zip(r["launches"], r["forced_launches"],
                                                                             r.get("backstop_launches") or ["?"] * 9))
                             if "launches" in r else ""] for k, r in A.items()]))
    if "breakdown" in res:
        md.append("\n## One standard-serving small-model step, by category (R2R, 4 requests)\n\n")
        rows = []
        for k, r in res["breakdown"].items():
            top = ", ".join(f"{c} {s:.1%}" for c, s in r["share"].items())
            rows.append([k, r["mean_step_ms"], top])
        md.append(md_table(["backend / context", "step ms", "share of step time"], rows))
    return "".join(md)


def plot(res: dict, path: Path, algos: list[str], systems: list[str]) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    panels = [p for p in ("algos", "algos_long", "scaling", "ablation", "length", "breakdown") if p in res]
    if not panels:
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(4.6 * len(panels), 3.8), squeeze=False)
    for ax, p in zip(axes[0], panels):
        if p in ("algos", "algos_long"):
            a = res[p]
            systems = list(systems)
            w = 0.8 / len(systems)
            for j, s in enumerate(systems):
                ys = [a.get(f"{alg}/{s}", {}).get("throughput", 0) or 0 for alg in algos]
                ax.bar([i + j * w for i in range(len(algos))], ys, w, label=s)
            ax.set_xticks([i + 0.4 - w / 2 for i in range(len(algos))], algos, fontsize=7)
            ax.set_ylabel("committed tok/s")
            plen = next((r.get("prompt_len") for r in a.values() if r.get("prompt_len")), None)
            ax.set_title(f"concurrency 4, prompt {plen}" if plen else "concurrency 4", fontsize=9)
            ax.legend(fontsize=7)
        elif p == "scaling":
            S = res["scaling"]
            cs = [int(c) for c in S]
            ax.plot(cs, [S[str(c)]["throughput"] for c in cs], "o-", label="throughput")
            ax.set_xscale("log", base=2)
            ax.set_xlabel("concurrency")
            ax.set_ylabel("tok/s")
            ax2 = ax.twinx()
            ax2.plot(cs, [S[str(c)]["user_speed"] or 0 for c in cs], "s--", color="C1", label="single-user tok/s")
            ax2.set_ylabel("single-user tok/s")
            ax.set_title("scaling (ours)", fontsize=9)
        elif p == "ablation":
            A = res["ablation"]
            ax.bar(range(len(A)), [r["throughput"] for r in A.values()])
            ax.set_xticks(range(len(A)), list(A), rotation=20, fontsize=7)
            ax.set_ylabel("tok/s")
            ax.set_title("ablation, C=8", fontsize=9)
        elif p == "length":
            L = res["length"]
            lens = sorted({v["max_tokens"] for v in L.values()})
            for j, s in enumerate(("ours", "standard")):
                ax.bar([i + 0.4 * j for i in range(len(lens))], [L[f"{s}/{n}"]["throughput"] for n in lens], 0.4,
                       label=s)
            ax.set_xticks([i + 0.2 for i in range(len(lens))], [f"max {n}" for n in lens])
            ax.set_ylabel("tok/s")
            ax.legend(fontsize=7)
            ax.set_title("output limit", fontsize=9)
        elif p == "breakdown":
            B = res["breakdown"]
            cats = sorted({c for r in B.values() for c in r["share"]})
            bottom = [0.0] * len(B)
            for c in cats:
                vals = [r["share"].get(c, 0.0) for r in B.values()]
                ax.bar(range(len(B)), vals, bottom=bottom, label=c)
                bottom = [b + v for b, v in zip(bottom, vals)]
            ax.set_xticks(range(len(B)), [k.replace(" / ", "\n") for k in B], fontsize=6)
            ax.set_ylabel("share of step")
            ax.legend(fontsize=5)
            ax.set_title("standard-serving step", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
