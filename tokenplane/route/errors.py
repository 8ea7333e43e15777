"""The routing runtime's exception types (bottom of the package: imports nothing of ours).

    RouteError                      base of everything below
    ├── RequestFailed               a registered request could not complete (routing error, timeout, shutdown)
    │   └── ModelUnavailable        a model process died under the request, or is down / restarting now
    ├── Overloaded                  too many live requests; nothing was registered (retry after retry_after_s)
    └── RequestRejected (+ValueError)  the request itself is invalid or can never fit; nothing was registered

Where they are raised (the HTTP layer maps them): `Runtime.generate` raises RequestRejected, Overloaded and
ModelUnavailable before its first chunk and before anything is registered; RequestFailed / ModelUnavailable may also
come out of the iteration, mid-stream.
"""

from __future__ import annotations


class RouteError(Exception):
    """Base of the routing runtime's errors."""


class RequestFailed(RouteError):
    """A request could not complete (sub-server died, routing error, timeout, shutdown)."""


class ModelUnavailable(RequestFailed):
    """Model `model` is down or restarting (or died while serving the request). Retry after `retry_after_s`."""

    def __init__(self, message: str, *, model: int, retry_after_s: float = 1.0):
        super().__init__(message)
        self.model = int(model)
        self.retry_after_s = float(retry_after_s)


class Overloaded(RouteError):
    """More live requests than max_num_seqs + max_queued: refused before registration. Retry after retry_after_s."""

    def __init__(self, message: str, *, retry_after_s: float = 1.0):
        super().__init__(message)
        self.retry_after_s = float(retry_after_s)


class RequestRejected(RouteError, ValueError):
    """The request is invalid (a sampling field out of range, an empty or too long prompt) or can never fit the KV
    pools. `param` names the offending field ("temperature", "top_p", "max_tokens", "seed", "prompt", ...)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


__all__ = ["ModelUnavailable", "Overloaded", "RequestFailed", "RequestRejected", "RouteError"]
