"""Wait for an idle machine before a timed repetition (shared 2-core box: a parallel-speedup ratio taken while
another job holds a core measures that job, not the code).

`wait_for_idle` samples /proc/stat and returns once the whole machine was at least `idle_cores` cores idle over a
`window_s` window, or after `timeout_s` (then the repetition runs anyway and is counted as not quiet). Linux only;
elsewhere it returns immediately.
"""

from __future__ import annotations

import os
import time


def _cpu_times() -> tuple[int, int] | None:
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except OSError:
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return idle, sum(fields)


def idle_cores(window_s: float = 0.2) -> float | None:
    a = _cpu_times()
    time.sleep(window_s)
    b = _cpu_times()
    if a is None or b is None or b[1] == a[1]:
        return None
    return (os.cpu_count() or 1) * (b[0] - a[0]) / (b[1] - a[1])


def wait_for_idle(idle_needed: float | None = None, window_s: float = 0.2, timeout_s: float = 60.0) -> bool:
    """True when an idle window was seen before the timeout."""
    need = idle_needed if idle_needed is not None else (os.cpu_count() or 1) - 0.15
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        idle = idle_cores(window_s)
        if idle is None or idle >= need:
            return True
    return False
