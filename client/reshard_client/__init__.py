"""reshard_client: the HTTP client and the ``reshard`` command line."""

from reshard_client.client import AsyncReshardClient, ReshardClient
from reshard_client.errors import (
    APIError,
    Conflict,
    Forbidden,
    Invalid,
    NotFound,
    QueueFull,
    ReshardClientError,
    ServerError,
    TransportError,
    Unauthorized,
)
from reshard_client.export import ExportOnCommit

__all__ = [
    "APIError",
    "AsyncReshardClient",
    "Conflict",
    "ExportOnCommit",
    "Forbidden",
    "Invalid",
    "NotFound",
    "QueueFull",
    "ReshardClient",
    "ReshardClientError",
    "ServerError",
    "TransportError",
    "Unauthorized",
]
