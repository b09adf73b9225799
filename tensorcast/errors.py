"""One error tree for the SDK, the services and the CLI.

Each class is named for what the caller can do about it. `ERROR_TABLE` maps each to a gRPC status
code name and a CLI exit code; services and clients translate through it and nowhere else.
"""

from __future__ import annotations


class TensorcastError(Exception):
    """Root of every error TensorCast raises on purpose."""

    grpc_code = "INTERNAL"
    exit_code = 1
    retryable = False


class InvalidArgument(TensorcastError):
    """The request is malformed: fix the input and retry."""

    grpc_code = "INVALID_ARGUMENT"
    exit_code = 3


class NotFound(TensorcastError):
    """The named artifact, worker or record does not exist."""

    grpc_code = "NOT_FOUND"
    exit_code = 4


class AlreadyExists(TensorcastError):
    """The id is taken by different content; artifacts are immutable, pick another id."""

    grpc_code = "ALREADY_EXISTS"
    exit_code = 5


class ResourceExhausted(TensorcastError):
    """No room (pool full, request too large): free space or add capacity."""

    grpc_code = "RESOURCE_EXHAUSTED"
    exit_code = 6


class Unavailable(TensorcastError):
    """A component cannot be reached right now; retrying later may succeed."""

    grpc_code = "UNAVAILABLE"
    exit_code = 7
    retryable = True


class DeadlineExceeded(TensorcastError):
    """The operation did not finish within its deadline."""

    grpc_code = "DEADLINE_EXCEEDED"
    exit_code = 8
    retryable = True


class IntegrityError(TensorcastError):
    """Bytes did not match their checksum; nothing corrupt was stored or served."""

    grpc_code = "DATA_LOSS"
    exit_code = 9


class FencingError(TensorcastError):
    """A stale fencing token was used; refresh the lease table and retry."""

    grpc_code = "FAILED_PRECONDITION"
    exit_code = 10


class Unauthenticated(TensorcastError):
    """The cluster token is missing or wrong: pass --token / TC_TOKEN."""

    grpc_code = "UNAUTHENTICATED"
    exit_code = 11


ERROR_TABLE: tuple[type[TensorcastError], ...] = (
    TensorcastError,
    InvalidArgument,
    NotFound,
    AlreadyExists,
    ResourceExhausted,
    Unavailable,
    DeadlineExceeded,
    IntegrityError,
    FencingError,
    Unauthenticated,
)

_BY_GRPC_CODE = {cls.grpc_code: cls for cls in ERROR_TABLE}
_BY_NAME = {cls.__name__: cls for cls in ERROR_TABLE}


def public_class(error: TensorcastError) -> type[TensorcastError]:
    """The class to send an error as: its own, or the nearest public class it derives from (a
    private subclass such as the RPC client's Unreachable travels as Unavailable)."""
    return next(c for c in type(error).__mro__ if _BY_NAME.get(c.__name__) is c)


def public_name(error: TensorcastError) -> str:
    """The name to send an error by (see `public_class`); `error_named` rebuilds it."""
    return public_class(error).__name__


def error_named(name: str, message: str) -> TensorcastError:
    """Rebuild an error sent by class name (local socket, attach stream, plan results, HTTP);
    an unknown name becomes a plain TensorcastError."""
    return _BY_NAME.get(name, TensorcastError)(message)


def error_for_grpc_code(code_name: str) -> type[TensorcastError]:
    """The error class for a gRPC status code name ("NOT_FOUND"); unknown codes are internal."""
    if code_name in ("CANCELLED", "UNKNOWN", "ABORTED"):
        return Unavailable
    return _BY_GRPC_CODE.get(code_name, TensorcastError)
