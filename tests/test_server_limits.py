"""What a request body may be before any route reads it, through the real server and the
official SDKs: its size (413 in each API's error shape, whether the client declares a length or
streams the body chunked), its JSON nesting (400, brackets inside strings are text), and its
fields' types and bounds as the published schema states them (400 naming the field)."""

from __future__ import annotations

import http.client
import json
import socket

import anthropic
import httpx2 as httpx
import openai
import pytest
from test_server import KEY, MODEL, ant, hello, oai, server  # noqa: F401  (the real server, module-scoped)

from ftkit.runtime.server.limits import DEFAULT_MAX_BODY, MAX_DEPTH, too_deep

AUTH = {"authorization": f"Bearer {KEY}", "content-type": "application/json"}
OVER = "x" * (DEFAULT_MAX_BODY + 1)  # a message this long makes a body past the limit


def padded(body: dict, size: int) -> bytes:
    """`body` as JSON of exactly `size` bytes (trailing whitespace, which JSON ignores)."""
    raw = json.dumps(body).encode()
    return raw + b" " * (size - len(raw))


# ---- size -----------------------------------------------------------------------------------
def test_a_body_past_the_limit_is_a_413_in_each_apis_shape(oai, ant):  # noqa: F811
    with pytest.raises(openai.APIStatusError) as e:
        oai.chat.completions.create(model=MODEL, messages=hello(OVER), max_tokens=1)
    assert e.value.status_code == 413
    error = e.value.response.json()["error"]
    assert error["code"] == "request_too_large" and "32.00 MiB" in error["message"]
    with pytest.raises(openai.APIStatusError) as e:
        oai.completions.create(model=MODEL, prompt=OVER, max_tokens=1)
    assert e.value.status_code == 413
    with pytest.raises(openai.APIStatusError) as e:
        oai.responses.create(model=MODEL, input=OVER)
    assert e.value.status_code == 413
    with pytest.raises(anthropic.ContentTooLargeError) as e:
        ant.messages.create(model=MODEL, max_tokens=1, messages=hello(OVER))
    assert e.value.response.json()["error"]["type"] == "request_too_large"
    with pytest.raises(anthropic.ContentTooLargeError):
        ant.messages.count_tokens(model=MODEL, messages=hello(OVER))
    # and the server goes on serving
    assert oai.chat.completions.create(model=MODEL, messages=hello(), max_tokens=1).usage.completion_tokens == 1


def test_the_limit_is_exact_and_holds_for_chunked_bodies(server):  # noqa: F811
    url = server.url + "/v1/messages/count_tokens"
    body = {"model": MODEL, "messages": hello("count me")}
    at = httpx.post(url, content=padded(body, DEFAULT_MAX_BODY), headers=AUTH, timeout=120)
    assert at.status_code == 200 and at.json()["input_tokens"] > 0
    past = httpx.post(url, content=padded(body, DEFAULT_MAX_BODY + 1), headers=AUTH, timeout=120)
    assert past.status_code == 413 and past.json()["type"] == "error"

    def chunks(raw: bytes):  # no Content-Length: the server counts what arrives
        for i in range(0, len(raw), 1 << 20):
            yield raw[i:i + (1 << 20)]

    chunked = httpx.post(url, content=chunks(padded(body, DEFAULT_MAX_BODY + 1)), headers=AUTH, timeout=120)
    assert chunked.status_code == 413 and chunked.json()["error"]["type"] == "request_too_large"
    assert httpx.post(url, content=chunks(padded(body, 4096)), headers=AUTH).status_code == 200


def test_a_client_that_asks_first_is_refused_before_it_uploads(server):  # noqa: F811
    """`Expect: 100-continue` (curl's way for bodies over 1 MiB): the 413 comes instead of the
    go-ahead, and no byte of the body is sent."""
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=60) as s:
        s.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {KEY}\r\n"
                  f"Content-Type: application/json\r\nContent-Length: {DEFAULT_MAX_BODY + 1}\r\n"
                  f"Expect: 100-continue\r\n\r\n".encode())
        r = http.client.HTTPResponse(s)
        r.begin()
        assert r.status == 413 and json.loads(r.read())["error"]["code"] == "request_too_large"


# ---- nesting --------------------------------------------------------------------------------
def nested_schema(depth: int) -> dict:
    """A tool's input schema that makes its request body nest `depth` levels (the body's own
    object, its tools, the tool and the schema are four of them)."""
    schema: dict = {}
    for _ in range(depth - 4):
        schema = {"items": schema}
    return schema


def test_nesting_past_the_limit_is_a_400(server, ant):  # noqa: F811
    tool = lambda depth: {"name": "deep", "description": "d", "input_schema": nested_schema(depth)}  # noqa: E731
    ok = ant.messages.count_tokens(model=MODEL, messages=hello(), tools=[tool(MAX_DEPTH)])
    assert ok.input_tokens > 0
    with pytest.raises(anthropic.BadRequestError, match=f"deeper than {MAX_DEPTH} levels"):
        ant.messages.count_tokens(model=MODEL, messages=hello(), tools=[tool(MAX_DEPTH + 1)])
    # brackets and escaped quotes inside strings are text, not structure
    text = '\\"[{' * 5000 + "\\" + "]" * 3
    r = httpx.post(server.url + "/v1/messages/count_tokens", headers=AUTH,
                   json={"model": MODEL, "messages": hello(text)})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("raw, deep", [
    (b'{"a": ' + b"[" * 129 + b"]" * 129 + b"}", True),
    (b'{"a": ' + b"[" * 127 + b"]" * 127 + b"}", False),
    (b'{"a": "' + b"[" * 500 + b'"}', False),  # inside a string
    (b'{"a": "\\\\", "b": ' + b"{" * 200, True),  # an escaped backslash ends no string early...
    (b'{"a": "\\"' + b"[" * 200 + b'"}', False),  # ...an escaped quote ends none
    (b"[]" * 10_000, False),  # many, none deep
])
def test_too_deep_reads_structure_not_text(raw, deep):
    assert too_deep(raw) is deep


# ---- types and bounds -----------------------------------------------------------------------
def test_fields_out_of_their_schema_are_400s_naming_the_field(server, oai, ant):  # noqa: F811
    chat = dict(model=MODEL, messages=hello(), max_tokens=1)
    cases = [
        (dict(temperature=2.5), "temperature"), (dict(top_p=0), "top_p"), (dict(n=2), "n"),
        (dict(extra_body={"ignore_eos": "yes"}), "ignore_eos"), (dict(stop=["a", 3]), "stop.1"),
        (dict(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
         "messages.0.content.0.type"),
        (dict(tools=[{"type": "function", "function": {"description": "no name"}}]), "tools.0.function.name"),
    ]
    for change, field in cases:
        with pytest.raises(openai.BadRequestError) as e:
            oai.chat.completions.create(**{**chat, **change})
        assert e.value.response.json()["error"]["param"] == field, e.value.response.text
    with pytest.raises(anthropic.BadRequestError, match="top_k"):
        ant.messages.create(model=MODEL, max_tokens=1, messages=hello(), extra_body={"top_k": -1})
    with pytest.raises(anthropic.BadRequestError, match="messages.0.content.0"):
        ant.messages.create(model=MODEL, max_tokens=1, messages=[  # a tool call is the assistant's, not the user's
            {"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}])
    with pytest.raises(anthropic.BadRequestError, match="no text, tool call or tool result"):
        ant.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": []}])  # renders to nothing
    for body in ({}, {"experts": 0}, {"kv_tokens": True}):
        r = httpx.post(server.url + "/v1/cache/rebuild", json=body, headers=AUTH)
        assert r.status_code == 400 and r.json()["error"]["message"], r.text
    # what the server does not run is still ignored, not refused
    r = oai.chat.completions.create(**chat, tools=[{"type": "custom", "custom": {"name": "shell"}}],
                                    extra_body={"logit_bias": {}, "user": "u"})
    assert r.usage.completion_tokens == 1
