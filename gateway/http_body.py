"""Reading and validating a request body: size limit, UTF-8, strict JSON, then the pydantic model.

Everything that can go wrong here is the client's fault and becomes a 4xx
APIError with a message saying what is wrong; nothing raises past it.
"""

from __future__ import annotations

import json
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect, Request

from splitserve.gateway.errors import APIError, bad_request

M = TypeVar("M", bound=BaseModel)


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The raw body; 413 past `max_bytes` (by Content-Length, or while streaming a chunked body)."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise bad_request(f"invalid Content-Length header {declared!r}")
        if int(declared) > max_bytes:
            raise _too_large(int(declared), max_bytes)
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_bytes:
                raise _too_large(size, max_bytes)
            chunks.append(chunk)
    except ClientDisconnect:
        raise APIError(400, "the client disconnected while sending the body") from None
    return b"".join(chunks)


def parse_json_object(body: bytes) -> dict[str, Any]:
    """The body as a JSON object; 400 for invalid UTF-8, malformed JSON, NaN/Infinity, lone surrogates."""
    if not body.strip():
        raise bad_request("the request body is empty; send a JSON object")
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise bad_request(f"the request body is not valid UTF-8 (byte {e.start}: {body[e.start:e.start + 1]!r})") from None
    try:
        value = json.loads(text, parse_constant=_reject_constant)
    except json.JSONDecodeError as e:
        raise bad_request(f"the request body is not valid JSON: {e.msg} (line {e.lineno}, column {e.colno})") from None
    except RecursionError:
        raise bad_request("the request body is nested too deeply") from None
    except ValueError as e:  # _reject_constant
        raise bad_request(str(e)) from None
    if not isinstance(value, dict):
        kind = {list: "array", str: "string", bool: "boolean", int: "number", float: "number"}.get(type(value), "null")
        raise bad_request(f"the request body must be a JSON object, got a JSON {kind}")
    try:
        _check_strings(value)
    except RecursionError:
        raise bad_request("the request body is nested too deeply") from None
    return value


def validate(model: type[M], body: dict[str, Any]) -> M:
    """The body as `model`; 400 naming the first bad fields."""
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise _validation_error(e) from None
    except RecursionError:
        raise bad_request("the request body is nested too deeply") from None


def _validation_error(error: ValidationError) -> APIError:
    problems = []
    first_param = None
    for item in error.errors(include_url=False)[:3]:
        loc = ".".join(str(part) for part in item["loc"])
        first_param = first_param or loc or None
        message = item["msg"].removeprefix("Value error, ")
        if item["type"] == "missing":
            problems.append(f"{loc} is required")
        elif "input" in item and item["type"] not in ("extra_forbidden",):
            problems.append(f"{loc}: {message}, got {_show(item['input'])}")
        else:
            problems.append(f"{loc}: {message}")
    more = len(error.errors()) - len(problems)
    text = "; ".join(problems) + (f" (and {more} more)" if more > 0 else "")
    return bad_request(f"invalid request: {text}", first_param)


def _reject_constant(name: str) -> None:
    raise ValueError(f"the request body is not valid JSON: {name} is not a JSON number")


def _check_strings(value: Any) -> None:
    """Lone UTF-16 surrogates (from \\ud800-style escapes) cannot be tokenized or sent over gRPC."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise bad_request("the request contains an invalid unicode escape (a lone surrogate)") from None
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_strings(key)
            _check_strings(item)
    elif isinstance(value, list):
        for item in value:
            _check_strings(item)


def _too_large(size: int, limit: int) -> APIError:
    return APIError(413, f"the request body is {size} bytes or more; the limit is {limit} bytes", code="body_too_large")


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
