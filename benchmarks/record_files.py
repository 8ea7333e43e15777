"""A benchmark record's three files: <out>.json (meta and rows), <out>.md and <out>.png."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable


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
