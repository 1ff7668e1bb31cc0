"""Errors the client raises, by HTTP status::

ReshardClientError
├── TransportError        the server could not be reached
└── APIError              the server answered with an error status (``status``, ``detail``)
    ├── Unauthorized      401: missing or wrong token (RESHARD_TOKEN)
    ├── Forbidden         403: a URI outside the server's roots
    ├── NotFound          404
    ├── Conflict          409: Idempotency-Key reused with another spec
    ├── Invalid           422: the spec names a bad field
    ├── QueueFull         429: retry later
    └── ServerError       5xx
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "APIError",
    "Conflict",
    "Forbidden",
    "Invalid",
    "NotFound",
    "QueueFull",
    "ReshardClientError",
    "ServerError",
    "TransportError",
    "Unauthorized",
    "error_for",
]


class ReshardClientError(Exception):
    """Base of the client's errors."""


class TransportError(ReshardClientError):
    """The request never got an HTTP answer."""


class APIError(ReshardClientError):
    def __init__(self, status: int, detail: Any) -> None:
        self.status = status
        self.detail = detail
        super().__init__(f"HTTP {status}: {_text(detail)}")


class Unauthorized(APIError):
    pass


class Forbidden(APIError):
    pass


class NotFound(APIError):
    pass


class Conflict(APIError):
    pass


class Invalid(APIError):
    pass


class QueueFull(APIError):
    pass


class ServerError(APIError):
    pass


_BY_STATUS: dict[int, type[APIError]] = {
    401: Unauthorized,
    403: Forbidden,
    404: NotFound,
    409: Conflict,
    422: Invalid,
    429: QueueFull,
}


def error_for(status: int, detail: Any) -> APIError:
    if status >= 500:
        return ServerError(status, detail)
    return _BY_STATUS.get(status, APIError)(status, detail)


def _text(detail: Any) -> str:
    if isinstance(detail, list):  # FastAPI validation errors: name each field
        parts = []
        for d in detail:
            if isinstance(d, dict):
                loc = ".".join(str(x) for x in d.get("loc", ()) if x != "body")
                parts.append(f"{loc}: {d.get('msg')}")
            else:
                parts.append(str(d))
        return "; ".join(parts)
    return str(detail)
