"""Turn device-run JSON (gpu_tokenize.json, engine_latency.json) brought back from the H200 into results files.

    python benchmarks/device/report.py --tokenize RUN.json [RUN2.json ...] --engine RUN.json [...] --name h200

Later files win per family (a rerun after a fix replaces that family's rows); engine files are concatenated. Writes
benchmarks/results/{name}_gpu_tokenize.{json,md,png} and {name}_engine_latency.{json,md,png}: the raw JSON kept
as measured (with the file each family came from), a Markdown table, and a plot.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[1] / "results"


def tokenize_report(paths: list[Path], name: str) -> None:
    families: dict[str, dict] = {}
    runs = []
    for p in paths:
        d = json.loads(p.read_text())
        runs.append({k: v for k, v in d.items() if k != "families"} | {"file": str(p)})
        for fam, row in d["families"].items():
            if row.get("latency"):
                families[fam] = row | {"run_started": d["started"]}
    (RESULTS / f"{name}_gpu_tokenize.json").write_text(json.dumps({"runs": runs, "families": families}, indent=1))
    lines = ["| family | run | chars | graph p50 ms | graph p90 ms | eager p50 ms | readback p50 ms | graph + tolist p50 ms"
             " | tiktoken 1 core p50 ms | speed-up (graph) | exact |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for fam, row in families.items():
        for r in row["latency"]:
            lines.append(f"| {fam} | {row['run_started']} | {r['chars']:,} | {r['graph_array_ms_p50']:.3f} | "
                         f"{r['graph_array_ms_p90']:.3f} | {r['eager_array_ms_p50']:.3f} | "
                         f"{r['readback_array_ms_p50']:.3f} | {r['graph_list_ms_p50']:.3f} | "
                         f"{r['cpu_reference_ms_p50']:.3f} | {r['cpu_reference_ms_p50'] / r['graph_array_ms_p50']:.1f}x"
                         f" | {r['graph_exact'] and r['eager_exact'] and r['readback_exact']} |")
    lines += ["", "| family | bulk bytes | GPU GB/s (best of 3) | tiktoken 1 core GB/s | exact docs | fallback docs |"
              " exact |", "|---|---:|---:|---:|---:|---:|---|"]
    for fam, row in families.items():
        b = row["bulk"]
        lines.append(f"| {fam} | {b['bytes']:,} | {b['GB_s']:.3f} | {b['cpu_reference_GB_s_1core']:.4f} | "
                     f"{row['exact_docs']} | {row['fallback_docs']} | {row['exact']} |")
    (RESULTS / f"{name}_gpu_tokenize.md").write_text("\n".join(lines) + "\n")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for fam, row in families.items():
        xs = [r["chars"] for r in row["latency"]]
        ax.plot(xs, [r["graph_array_ms_p50"] for r in row["latency"]], "o-", label=f"{fam} GPU (graph)")
        ax.plot(xs, [r["cpu_reference_ms_p50"] for r in row["latency"]], "x--", alpha=0.5, label=f"{fam} tiktoken/HF")
    ax.set(xscale="log", yscale="log", xlabel="characters per request", ylabel="p50 ms",
           title="Single-request encode on the H200 vs the CPU reference (one core)")
    ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(RESULTS / f"{name}_gpu_tokenize.png", dpi=120)


def engine_report(paths: list[Path], name: str) -> None:
    runs = [json.loads(p.read_text()) | {"file": str(p)} for p in paths]
    (RESULTS / f"{name}_engine_latency.json").write_text(json.dumps(runs, indent=1))
    lines = ["| model | dtype | mode | batch | context | median ms | p90 ms | max abs logit diff vs varlen | argmax agree |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for run in runs:
        for r in run["results"]:
            c = r["check_vs_varlen"]
            lines.append(f"| {r['model']} | {run['meta']['dtype']} | {r['mode']} | {r['batch']} | {r['context']} | "
                         f"{r['median_ms']:.3f} | {r['p90_ms']:.3f} | {c['max_abs_logit_diff']:.3g} | "
                         f"{c['argmax_agree']:.3f} |")
    (RESULTS / f"{name}_engine_latency.md").write_text("\n".join(lines) + "\n")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for run in runs:
        keys = sorted({(r["model"], r["mode"]) for r in run["results"]})
        for model, mode in keys:
            rows = [r for r in run["results"] if r["model"] == model and r["mode"] == mode]
            ax.plot([r["batch"] for r in rows], [r["median_ms"] for r in rows], "o-",
                    label=f"{model} {run['meta']['dtype']} {mode}")
    ax.set(xscale="log", yscale="log", xlabel="batch (one-token sequences)", ylabel="median ms per decode step",
           title="Decode step on the H200 (random weights, context 512)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(RESULTS / f"{name}_engine_latency.png", dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokenize", nargs="*", type=Path, default=[])
    ap.add_argument("--engine", nargs="*", type=Path, default=[])
    ap.add_argument("--name", default="h200")
    args = ap.parse_args()
    if args.tokenize:
        tokenize_report(args.tokenize, args.name)
    if args.engine:
        engine_report(args.engine, args.name)


if __name__ == "__main__":
    main()
