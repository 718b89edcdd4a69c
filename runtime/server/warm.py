"""The HTTP path's first-request costs, paid at start-up: one streamed completion through the
app itself (no socket) before the port is served, then the scheduler forgets it.

On an H100 host the first request through a server whose API-key check had become plain ASGI
middleware waited 33-35 ms in the scheduler's queue (CE, q4km, 512 tokens; the tree before it
1.0-1.4 ms): the likeliest reading, not traced, is the first use of the route and the streaming
response and what they load on demand, now after the request was submitted. With this request
at start-up: 0.9 ms of queue, and the first request 1.15x the next (CF, docs/benchmarks.md)."""

from __future__ import annotations

import asyncio
import json

from .core import ServerState

PROMPT = 16  # tokens of the request
TOKENS = 2  # tokens it decodes: the first comes from the prefill, the second from a decode step


def warm_http(app, state: ServerState) -> None:
    """Send `app` a streamed /v1/completions request in-process, read its whole reply, then
    have the scheduler forget it; ValueError where the reply is not a 200."""
    vocab = state.rt.spec.vocab_size
    n = min(PROMPT, state.context - TOKENS - 1, state.scheduler.plan.kv_tokens - TOKENS)  # one that fits
    if n < 1:
        return
    body = json.dumps({"model": state.model_name, "prompt": [i % vocab for i in range(n)],
                       "max_tokens": TOKENS, "stream": True, "ignore_eos": True}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if state.api_key:
        headers.append((b"authorization", b"Bearer " + state.api_key.encode()))
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/v1/completions", "raw_path": b"/v1/completions", "root_path": "", "query_string": b"",
             "headers": headers, "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 0)}
    status: list[int] = []
    chunks: list[bytes] = []

    async def run() -> None:
        sent = asyncio.Event()

        async def receive() -> dict:
            if not sent.is_set():
                sent.set()
                return {"type": "http.request", "body": body, "more_body": False}
            await asyncio.Event().wait()  # the client never leaves: the reply ends the request
            return {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            if message["type"] == "http.response.start":
                status.append(message["status"])
            elif message["type"] == "http.response.body":
                chunks.append(message.get("body", b""))

        await app(scope, receive, send)

    asyncio.run(run())
    if status != [200]:
        raise ValueError(f"the server's start-up request failed ({status[0] if status else 'no answer'}): "
                         f"{b''.join(chunks)[:300].decode(errors='replace')}")
    state.scheduler.forget().result()
