"""Real agent sessions as text: load mini-swe-agent trajectories and render the prompt of every model call.

The prompt of call k is every message before assistant message k, rendered with a chat template as ordinary text,
so consecutive prompts of one trajectory are (almost always) extensions of each other: the session-append workload.
"""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path


def _default_traces_dir() -> Path | None:
    """$TOKENPLANE_DATA/traces/mini-swe-agent when TOKENPLANE_DATA is set; otherwise callers pass a folder."""
    env = os.environ.get("TOKENPLANE_DATA")
    return Path(env) / "traces" / "mini-swe-agent" if env else None


DEFAULT_TRACES_DIR: Path | None = _default_traces_dir()

TEMPLATES = {
    "chatml": "<|im_start|>{role}\n{content}<|im_end|>\n",
    "plain": "{role}: {content}\n\n",
}


def _content_text(content) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):   # OpenAI-style parts
        return "".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in content)
    return "" if content is None else str(content)


def load_trajectory(path: str | Path) -> list[dict]:
    """Messages [{role, content}] of one *.traj.json (or *.traj.json.gz) file."""
    raw = Path(path).read_bytes()
    data = json.loads(gzip.decompress(raw) if str(path).endswith(".gz") else raw)
    messages = data["messages"] if isinstance(data, dict) else data
    return [{"role": str(m.get("role", "user")), "content": _content_text(m.get("content"))} for m in messages]


def trajectory_files(directory: str | Path | None = None) -> list[Path]:
    """*.traj.json and *.traj.json.gz files of `directory` (default: DEFAULT_TRACES_DIR) by name; [] if absent."""
    d = Path(directory) if directory is not None else DEFAULT_TRACES_DIR
    if d is None or not d.is_dir():
        return []
    return sorted([*d.glob("*.traj.json"), *d.glob("*.traj.json.gz")], key=lambda p: p.name)


def load_trajectories(directory: str | Path | None = None, limit: int | None = None) -> list[list[dict]]:
    """Messages of every trajectory in `directory` (sorted by file name); [] when the directory is absent."""
    files = trajectory_files(directory)
    if limit is not None:
        files = files[:limit]
    return [load_trajectory(f) for f in files]


def render_prompts(messages: list[dict], template: str = "chatml") -> list[str]:
    """The prompt text of each model call: all messages before assistant message k, rendered with `template`."""
    fmt = TEMPLATES.get(template, template)
    prompts, rendered = [], []
    for m in messages:
        if m["role"] == "assistant" and rendered:
            prompts.append("".join(rendered))
        rendered.append(fmt.format(role=m["role"], content=m["content"]))
    return prompts
