"""Real text for the default test suite: the shipped fixtures (tests/fixtures/), or the full data when asked for.

`TOKENPLANE_CORPUS=DIR` (a corpus built by ../shared/tools/build_corpus.py) and `TOKENPLANE_DATA=DIR` (a data folder
holding traces/mini-swe-agent/) replace the fixtures; without them every real-text test runs on the fixtures, so a
fresh clone tests what CI tests.
"""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

FIXTURES = Path(__file__).resolve().parent / "fixtures"


def corpus_dir() -> Path:
    env = os.environ.get("TOKENPLANE_CORPUS")
    return Path(env) if env else FIXTURES / "realtext"


def traces_dir() -> Path:
    env = os.environ.get("TOKENPLANE_DATA")
    return Path(env) / "traces" / "mini-swe-agent" if env else FIXTURES / "traces"


def conversations(limit: int) -> list[list[dict]]:
    """Messages of the first `limit` agent trajectories (fixtures, or TOKENPLANE_DATA's)."""
    from tokenplane.tokenize.evidence.traces import load_trajectories
    return load_trajectories(traces_dir(), limit)


def corpus_lines(name: str) -> list[str]:
    """Lines of `name`.jsonl (or .jsonl.gz) in the corpus folder; a missing file is an error, not a skip."""
    base = corpus_dir()
    plain, packed = base / f"{name}.jsonl", base / f"{name}.jsonl.gz"
    if plain.exists():
        return plain.read_text(encoding="utf-8").splitlines()
    if packed.exists():
        return gzip.decompress(packed.read_bytes()).decode("utf-8").splitlines()
    raise FileNotFoundError(f"no {name}.jsonl(.gz) in {base} (TOKENPLANE_CORPUS={os.environ.get('TOKENPLANE_CORPUS')})")


def corpus_texts(name: str) -> list[str]:
    return [json.loads(line)["text"] for line in corpus_lines(name) if line]
