"""The one error shape of every route on the port: OpenAI's {"error": {"message", "type", "param", "code"}}.

Every failure a handler can see becomes an `APIError` (or a subclass fixing its status) before it leaves the app, so
clients get the same body for a bad field, an unknown session, a crashed model or an overloaded queue, and an error
never closes a keep-alive connection.
"""

from __future__ import annotations

import json
from typing import Any

# OpenAI's `type` values by status (the client libraries map the status; `type` is for humans and logs).
_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
          405: "invalid_request_error", 409: "conflict_error", 413: "invalid_request_error",
          422: "invalid_request_error", 429: "rate_limit_error", 499: "client_closed_request",
          500: "server_error", 503: "service_unavailable", 504: "timeout_error"}


class APIError(Exception):
    """An HTTP error with an OpenAI-shaped body. `headers` carries e.g. Retry-After; `extra` adds fields beside
    message/type/param/code inside "error" (the tokenize service's 409 reports the current revision there)."""

    status: int = 400

    def __init__(self, message: str, *, status: int | None = None, param: str | None = None,
                 code: str | None = None, type_: str | None = None, headers: dict[str, str] | None = None,
                 **extra: Any) -> None:
        super().__init__(message)
        if status is not None:
            self.status = status
        self.message, self.param, self.code = message, param, code
        self.type = type_ or _TYPES.get(self.status, "server_error" if self.status >= 500 else "invalid_request_error")
        self.headers = dict(headers or {})
        self.extra = extra

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code,
                          **self.extra}}

    def encode(self) -> bytes:
        return json.dumps(self.body()).encode()


class InvalidRequest(APIError):
    status = 400


class Unauthorized(APIError):
    status = 401


class NotFound(APIError):
    status = 404


class Conflict(APIError):
    status = 409


class PayloadTooLarge(APIError):
    status = 413


class TooManyRequests(APIError):
    status = 429


class ServiceUnavailable(APIError):
    status = 503


class InternalError(APIError):
    status = 500


def retry_headers(seconds: float) -> dict[str, str]:
    return {"Retry-After": str(max(1, int(seconds + 0.999)))}


__all__ = ["APIError", "Conflict", "InternalError", "InvalidRequest", "NotFound", "PayloadTooLarge",
           "ServiceUnavailable", "TooManyRequests", "Unauthorized", "retry_headers"]
