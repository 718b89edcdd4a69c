"""Limits a request body meets before it is parsed: its size (an ASGI middleware that stops
reading at the limit and answers 413 in the called API's shape) and its JSON nesting (a scan
of the raw bytes, so no parser ever recurses into a hostile body)."""

from __future__ import annotations

import re

import numpy as np

from ftkit.vocab import human_bytes

from .errors import ApiError, send_error

# Coding agents resend their whole history each turn: a 200k-token context of code and tool
# output is about 1 MB of text, a few MiB as JSON with its tool schemas; 32 MiB leaves room.
DEFAULT_MAX_BODY = 32 << 20
# Real bodies nest a dozen levels (a tool's JSON schema the deepest); 128 stays far below the
# interpreter's recursion limit that json, jinja and pydantic would otherwise meet.
MAX_DEPTH = 128
# Past the limit the rest of an honest client's upload is still read (and dropped) so that it
# sees the 413 rather than a connection reset; a body past this many times the limit is not.
DRAIN_FACTOR = 4

_STRING = re.compile(rb'"[^"]*"')
_NOT_STRUCTURE = bytes(range(256)).translate(None, b'"[]{}')
_STEP = np.zeros(256, np.int8)
_STEP[[ord("["), ord("{")]] = 1
_STEP[[ord("]"), ord("}")]] = -1
_CHUNK = 1 << 20


def too_deep(raw: bytes, limit: int = MAX_DEPTH) -> bool:
    """Whether the JSON text `raw` nests arrays and objects deeper than `limit`, without parsing
    it: escaped backslashes and quotes are dropped, then everything but quotes and brackets,
    then the strings (brackets inside them are text), and the running depth is summed."""
    if raw.count(b"[") + raw.count(b"{") <= limit:  # most small bodies: cannot nest that deep
        return False
    structure = _STRING.sub(b"", raw.replace(b"\\\\", b"").replace(b'\\"', b"").translate(None, _NOT_STRUCTURE))
    depth = 0
    for start in range(0, len(structure), _CHUNK):  # in pieces: a body of brackets is 32M steps
        steps = _STEP[np.frombuffer(structure, np.uint8, min(_CHUNK, len(structure) - start), start)]
        running = np.cumsum(steps, dtype=np.int64) + depth
        if running.max() > limit:
            return True
        depth = int(running[-1])
    return False


class BodyLimit:
    """ASGI middleware: a request whose body passes `max_bytes` (by its Content-Length, or as it
    arrives when chunked) gets a 413 in the API's error shape and never reaches a route.

    The body is read here, up to the limit, and handed on in one piece: every route reads its
    whole body anyway, so this holds nothing a route would not."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        declared = headers.get(b"content-length", b"")
        over = declared.isdigit() and int(declared) > self.max_bytes
        if over and headers.get(b"expect", b"").lower() == b"100-continue":
            await self._refuse(scope, send)  # the client waits for a go-ahead: it never sends the body
            return
        chunks, size, more = [], 0, True
        while more and size <= DRAIN_FACTOR * self.max_bytes:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client is gone: nobody to answer
            chunk, more = message.get("body", b""), message.get("more_body", False)
            size += len(chunk)
            over = over or size > self.max_bytes
            if not over:
                chunks.append(chunk)
        if over:
            await self._refuse(scope, send)
            return
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:  # then what the server says next (a disconnect, for streaming routes)
                return await receive()
            replayed = True
            return {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        await self.app(scope, replay, send)

    async def _refuse(self, scope, send) -> None:
        await send_error(scope, send, ApiError(
            413, f"the request body is over this server's limit of {human_bytes(self.max_bytes)} "
                 f"(ft-run serve --max-body)", code="request_too_large"))
