"""API errors in each API's own shape: OpenAI `{"error": {...}}`, Anthropic `{"type": "error", ...}`."""

from __future__ import annotations

import json
from typing import Any

# HTTP status -> Anthropic error type (OpenAI uses the `type` field more loosely)
ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                   409: "invalid_request_error", 413: "request_too_large", 422: "invalid_request_error",
                   429: "rate_limit_error", 503: "overloaded_error"}
OPENAI_TYPES = {401: "authentication_error", 404: "not_found_error", 503: "server_error"}


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def openai_body(e: ApiError) -> dict[str, Any]:
    kind = OPENAI_TYPES.get(e.status, "invalid_request_error" if e.status < 500 else "server_error")
    return {"error": {"message": e.message, "type": kind, "param": e.param, "code": e.code}}


def anthropic_body(e: ApiError) -> dict[str, Any]:
    kind = ANTHROPIC_TYPES.get(e.status, "invalid_request_error" if e.status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": e.message}}


def is_anthropic(path: str) -> bool:
    """Whether `path` is Anthropic's API (its error shape); every other path uses OpenAI's."""
    return path.startswith("/v1/messages")


def body_for(path: str, e: ApiError) -> dict[str, Any]:
    """The error shape the API at `path` uses."""
    return anthropic_body(e) if is_anthropic(path) else openai_body(e)


async def send_error(scope: dict, send: Any, e: ApiError) -> None:
    """Answer `e` from ASGI middleware, before any route: in the shape of the API at the path."""
    payload = json.dumps(body_for(scope["path"], e)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    await send({"type": "http.response.start", "status": e.status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})
