"""The SDK's exceptions, one per kind of failure, mapped from gRPC status codes.

    try:
        client.generate("hi", params)
    except OverloadedError:          # RESOURCE_EXHAUSTED: back off and retry later
        ...
    except InvalidRequestError as e: # INVALID_ARGUMENT / OUT_OF_RANGE: fix the request
        print(e.details)

Every exception is a `SplitserveError`; `code` is the gRPC status (None for
errors raised before any call, such as a text prompt without a tokenizer).
"""

from __future__ import annotations

import grpc


class SplitserveError(Exception):
    """Base of every SDK error."""

    def __init__(self, message: str, code: grpc.StatusCode | None = None, details: str = "") -> None:
        super().__init__(message)
        self.code = code
        """The gRPC status code of the failed call, if one failed."""
        self.details = details
        """The server's own words (the status details)."""


class InvalidRequestError(SplitserveError, ValueError):
    """The request is malformed (INVALID_ARGUMENT, OUT_OF_RANGE, or refused before sending)."""


class OverloadedError(SplitserveError):
    """The cluster refuses work for now (RESOURCE_EXHAUSTED): retry later with backoff."""


class UnavailableError(SplitserveError):
    """No server answered, or no worker could run the request (UNAVAILABLE), after the retries."""


class DeadlineExceededError(SplitserveError, TimeoutError):
    """The call ran past its deadline (DEADLINE_EXCEEDED)."""


class FailedPreconditionError(SplitserveError):
    """The cluster is not in a state that allows the call (FAILED_PRECONDITION), e.g. a bad lifecycle step."""


class AlreadyExistsError(SplitserveError):
    """A request with this id is already running (ALREADY_EXISTS)."""


class NotFoundError(SplitserveError):
    """NOT_FOUND."""


class AuthenticationError(SplitserveError):
    """UNAUTHENTICATED or PERMISSION_DENIED."""


class RequestCancelledError(SplitserveError):
    """The call was cancelled (CANCELLED)."""


class InternalError(SplitserveError):
    """Any other status: a server-side bug or an unexpected reply."""


_BY_CODE: dict[grpc.StatusCode, type[SplitserveError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidRequestError,
    grpc.StatusCode.OUT_OF_RANGE: InvalidRequestError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: OverloadedError,
    grpc.StatusCode.UNAVAILABLE: UnavailableError,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceededError,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPreconditionError,
    grpc.StatusCode.ALREADY_EXISTS: AlreadyExistsError,
    grpc.StatusCode.NOT_FOUND: NotFoundError,
    grpc.StatusCode.UNAUTHENTICATED: AuthenticationError,
    grpc.StatusCode.PERMISSION_DENIED: AuthenticationError,
    grpc.StatusCode.CANCELLED: RequestCancelledError,
}


def error_from_rpc(error: grpc.RpcError, what: str) -> SplitserveError:
    """The SDK exception for a failed call; `what` names the call ("Generate on 127.0.0.1:50061")."""
    code = error.code() if hasattr(error, "code") else None
    details = (error.details() if hasattr(error, "details") else None) or ""
    kind = _BY_CODE.get(code, InternalError)
    name = code.name if code is not None else "UNKNOWN"
    return kind(f"{what} failed: {name}: {details}", code, details)
