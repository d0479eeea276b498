"""Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.

Every failure the gateway answers goes through `APIError`, so clients (the
official `openai` package included) see the status and message they expect:

    400 invalid_request_error   bad JSON / types / values, prompt too long
    401 authentication_error    missing or wrong API key
    404 not_found_error         unknown model or path
    413 invalid_request_error   body over --max-body-bytes
    429 rate_limit_error        the cluster refuses work for now (router RESOURCE_EXHAUSTED)
    503 service_unavailable     no worker / router unreachable
    504 timeout                 the request ran past its deadline
"""

from __future__ import annotations

from http import HTTPStatus

from starlette.responses import JSONResponse

from splitserve.client import errors as sdk_errors


class APIError(Exception):
    """An error answered to the HTTP client."""

    def __init__(
        self, status: int, message: str, *, type: str | None = None, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or _default_type(status)
        self.param = param
        self.code = code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = None
        if self.status == 401:
            headers = {"WWW-Authenticate": "Bearer"}
        elif self.status in (429, 503):  # the cluster is full or starting: say when to come back
            headers = {"Retry-After": "1"}
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def _default_type(status: int) -> str:
    if status == 401:
        return "authentication_error"
    if status == 403:
        return "permission_error"
    if status == 404:
        return "not_found_error"
    if status == 429:
        return "rate_limit_error"
    if status == 504:
        return "timeout"
    if status >= 500:
        return "server_error" if status != 503 else "service_unavailable"
    return "invalid_request_error"


def from_sdk_error(error: sdk_errors.SplitserveError) -> APIError:
    """The HTTP answer for a router failure (the status says whether retrying may help)."""
    if isinstance(error, sdk_errors.InvalidRequestError):
        return APIError(400, error.details or str(error))
    if isinstance(error, sdk_errors.OverloadedError):
        return APIError(429, f"the cluster is at capacity, retry later: {error.details}", code="overloaded")
    if isinstance(error, sdk_errors.DeadlineExceededError):
        return APIError(504, f"the request did not finish in time: {error.details}")
    if isinstance(error, sdk_errors.UnavailableError | sdk_errors.FailedPreconditionError):
        # the router's own (no routable worker, a worker failed) or the router unreachable: the
        # details say which; "no worker" would blame the workers for a router that is down
        return APIError(503, f"the cluster could not serve the request now (a retry may): {error.details or error}")
    return APIError(500, f"the router failed: {error}", code="router_error")


def status_phrase(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return "Error"
