"""Real agent sessions as text: load mini-swe-agent trajectories and render the prompt of every model call.

The prompt of call k is every message before assistant message k, rendered with a chat template as ordinary text,
so consecutive prompts of one trajectory are (almost always) extensions of each other: the session-append workload.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

_REPO_ROOT = Path(__file__).resolve().parents[2]


def _default_traces_dir() -> Path:
    env = os.environ.get("TOKENPLANE_DATA")
    base = Path(env) if env else _REPO_ROOT.parent / "shared" / "data"
    return base / "traces" / "mini-swe-agent"


# ../shared/data/traces/mini-swe-agent relative to the repository root, or $TOKENPLANE_DATA/traces/mini-swe-agent.
DEFAULT_TRACES_DIR = _default_traces_dir()

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
    """Messages [{role, content}] of one *.traj.json file."""
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    messages = data["messages"] if isinstance(data, dict) else data
    return [{"role": str(m.get("role", "user")), "content": _content_text(m.get("content"))} for m in messages]


def trajectory_files(directory: str | Path | None = None) -> list[Path]:
    d = Path(directory) if directory is not None else DEFAULT_TRACES_DIR
    return sorted(d.glob("*.traj.json")) if d.is_dir() else []


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
