"""Typed domain errors and their mapping to gRPC status codes.

Domain code (pool, index, embedder...) raises these and never imports grpc; the server adapter
turns them into a status with a message that names the offending field.
"""

from __future__ import annotations


class TierCacheError(Exception):
    """Base class; `code` is the grpc.StatusCode name the adapter uses."""

    code = "INTERNAL"


class InvalidArgument(TierCacheError):
    """A request field is malformed. The message starts with the field name."""

    code = "INVALID_ARGUMENT"

    def __init__(self, field: str, why: str) -> None:
        super().__init__(f"{field}: {why}")
        self.field = field


class NotFound(TierCacheError):
    code = "NOT_FOUND"


class ResourceExhausted(TierCacheError):
    code = "RESOURCE_EXHAUSTED"


class FailedPrecondition(TierCacheError):
    code = "FAILED_PRECONDITION"


class Unavailable(TierCacheError):
    code = "UNAVAILABLE"


class DeadlineExceeded(TierCacheError):
    code = "DEADLINE_EXCEEDED"


class Unauthenticated(TierCacheError):
    code = "UNAUTHENTICATED"


class PermissionDenied(TierCacheError):
    code = "PERMISSION_DENIED"


class Cancelled(TierCacheError):
    code = "CANCELLED"
