"""Constants, clocks and percentiles shared by the fault run's parts."""

from __future__ import annotations

import os
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
PHASES = ("load", "kill", "disconnects", "sessions", "schemathesis")
MAX_REQUESTS_PER_CLIENT = 20_000          # hard bound on every request loop, whatever the durations say
ERROR_BACKOFF_S = 0.05                    # after a failed request, so a server answering errors at once is not spun

PROMPTS = [
    "Explain why the sky is blue in two sentences.",
    "Write a Python function that reverses a linked list.",
    "What is 17 * 23? Think step by step.",
    "Summarize the plot of Hamlet.",
    "List three differences between TCP and UDP.",
    "Translate 'good morning, how are you?' into French and German.",
    "Give me a haiku about garbage collection.",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
]



class Served:
    """The model name requests carry: the config's default until the server reports its own (a --config may name it
    differently)."""
    model = "tokenplane-router"


def now() -> float:
    return time.monotonic()


def pct(values: list[float], q: float) -> float | None:
    v = sorted(x for x in values if x is not None)
    if not v:
        return None
    k = (len(v) - 1) * q / 100.0
    lo, hi = int(k), min(len(v) - 1, int(k) + 1)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]
