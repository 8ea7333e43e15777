"""How much of a request body uvicorn buffers before it stops reading the socket (its flow control).

uvicorn pauses reading a connection once 64 KB of body wait for the app (flow_control.HIGH_WATER_LIMIT) and resumes
when the app takes them: a 5.7 MB agent body (a 4M-character context) arrives in ~90 pause/take/resume round trips
through the event loop, each a copy of the buffer and a loop wake-up. Measured with uvicorn 0.54 (httptools + uvloop)
and an httpx client on 2 shared CPUs (/work/notes/h22/recv.py): receiving 5.7 MB took 11.3 ms P50 at 64 KB against
4.4 ms at 8 MB, 1.4 MB took 2.1 against 1.0 ms.

The limit is a module constant with no setting, read by the protocol at each body event, so the server sets it
before it starts (cli.py). It stays a bound: a connection whose app does not read holds at most this much plus one
socket read before reading pauses, as before, and the body limit (middleware.py) still counts every byte the app
takes. The servers read every body they accept at once, so the memory a request can hold is its body limit either way.
"""

from __future__ import annotations

import importlib

BODY_HIGH_WATER = 8 << 20


def raise_body_high_water(limit: int = BODY_HIGH_WATER) -> list[str]:
    """Set uvicorn's body flow-control limit to `limit` (never lower than uvicorn's own) in each HTTP protocol it
    has; returns the protocols changed."""
    changed = []
    for name in ("httptools_impl", "h11_impl"):
        try:
            module = importlib.import_module(f"uvicorn.protocols.http.{name}")
        except ImportError:   # that protocol's parser (httptools or h11) is not installed
            continue
        current = getattr(module, "HIGH_WATER_LIMIT", None)
        if isinstance(current, int) and current < limit:
            setattr(module, "HIGH_WATER_LIMIT", limit)   # noqa: B010 - a module constant, by name
            changed.append(name)
    return changed


__all__ = ["BODY_HIGH_WATER", "raise_body_high_water"]
