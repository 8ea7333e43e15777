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
