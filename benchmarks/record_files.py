"""A benchmark record's three files: <out>.json (meta and rows), <out>.md and <out>.png."""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any, Callable


class RunMeta:
    """A record's run facts: made when the run starts, `meta(**extra)` when it ends (the command, the machine, the
    start time and wall time, the load average at both ends, and the benchmark's own fields)."""

    def __init__(self) -> None:
        self.started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        self.t0, self.load0 = time.time(), os.getloadavg()

    def meta(self, **extra: Any) -> dict[str, Any]:
        return {"command": "python " + " ".join(sys.argv), "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
                "started": self.started, "wall_s": time.time() - self.t0,
                "load_start": " ".join(f"{x:.2f}" for x in self.load0),
                "load_end": " ".join(f"{x:.2f}" for x in os.getloadavg()), **extra}


def write_record(out: Path, meta: dict[str, Any], rows: list[dict[str, Any]],
                 markdown: Callable[[list[dict[str, Any]], dict[str, Any]], str],
                 plot: Callable[[list[dict[str, Any]], Path], None]) -> str:
    """Write the record's JSON, Markdown and PNG beside each other; returns the Markdown."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    text = markdown(rows, meta)
    out.with_suffix(".md").write_text(text)
    plot(rows, out.with_suffix(".png"))
    return text


def ratio_bars(ax: Any, labels: list[str], values: list[float], ylabel: str, color: Any) -> None:
    """One bar a cell against a line at 1.0 (a ratio's break-even), labels under the bars."""
    ax.bar(range(len(values)), values, color=color)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(range(len(values)), labels, rotation=90, fontsize=7)
    ax.set_ylabel(ylabel)


def cell_label(row: dict[str, Any]) -> str:
    """A full_encode cell's axis label: family, then category and size."""
    return f"{row['family']}\n{row['category']} {row['size']}"


def save_figure(fig: Any, path: Path) -> None:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
