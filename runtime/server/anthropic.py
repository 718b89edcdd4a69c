"""Anthropic Messages API: `POST /v1/messages` (plain and streaming) and `/v1/messages/count_tokens`."""

from __future__ import annotations

import asyncio
import json
import secrets
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from . import fields
from .core import Job, Reply, ServerState, read_json, sampling, sse, text_of
from .errors import ApiError, anthropic_body
from .toolcalls import ToolCall

IGNORED_BLOCKS = {"thinking", "redacted_thinking"}  # earlier reasoning: not re-rendered


def _system(body: dict[str, Any]) -> str:
    system = fields.get(body, "system", (str, list), "")
    return text_of(system, "system")


def chat_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """Anthropic messages -> the chat template's messages: tool_use blocks become the assistant's
    tool calls, tool_result blocks become tool messages ahead of the user's text."""
    raw = fields.get(body, "messages", list)
    if not raw:
        raise ApiError(400, "messages: at least one message is required")
    out = [{"role": "system", "content": s}] if (s := _system(body)) else []
    for i, m in enumerate(raw):
        where = f"messages.{i}"
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            raise ApiError(400, f"{where}: role must be 'user' or 'assistant'")
        content = m.get("content")
        if isinstance(content, str):
            out.append({"role": m["role"], "content": content})
            continue
        if not isinstance(content, list):
            raise ApiError(400, f"{where}.content: must be a string or an array of blocks")
        text, calls = [], []
        for j, block in enumerate(content):
            kind = block.get("type") if isinstance(block, dict) else None
            kind = kind if isinstance(kind, str) else None  # an object is no type name
            if kind == "text" and isinstance(block.get("text"), str):
                text.append(block["text"])
            elif kind == "tool_use" and m["role"] == "assistant":
                calls.append({"id": block.get("id"), "type": "function",
                              "function": {"name": block.get("name"), "arguments": json.dumps(block.get("input", {}))}})
            elif kind == "tool_result" and m["role"] == "user":
                out.append({"role": "tool", "content": text_of(block.get("content"), f"{where}.content.{j}")})
            elif kind not in IGNORED_BLOCKS:
                raise ApiError(400, f"{where}.content.{j}: block type {kind!r} is not supported here")
        if text or calls or m["role"] == "assistant":
            msg: dict[str, Any] = {"role": m["role"], "content": "".join(text)}
            if calls:
                msg["tool_calls"] = calls
            out.append(msg)
    return out


def chat_tools(body: dict[str, Any]) -> list[dict] | None:
    """Client tools in the template's shape; server tools (with a versioned `type`) are ignored."""
    tools = fields.get(body, "tools", list, [])
    choice = fields.get(body, "tool_choice", dict, {})
    if choice.get("type") == "none":
        return None
    out = [{"type": "function", "function": {"name": t["name"], "description": t.get("description", ""),
                                             "parameters": t.get("input_schema") or {}}}
           for t in tools if isinstance(t, dict) and t.get("type") in (None, "custom") and isinstance(t.get("name"), str)]
    return out or None


def _tool_use(call: ToolCall) -> dict[str, Any]:
    return {"type": "tool_use", "id": "toolu_" + call.id.removeprefix("call_"), "name": call.name,
            "input": json.loads(call.arguments)}


def _stop_reason(gen: Any, calls: bool) -> str:
    if calls and gen.finish_reason == "stop":
        return "tool_use"
    if gen.finish_reason == "length":
        return "max_tokens"
    return "stop_sequence" if gen.stop_string else "end_turn"


def _usage(prompt: int, completion: int, cached: int = 0) -> dict[str, int]:
    """`input_tokens` counts only the prompt tokens the prefix cache did not supply."""
    return {"input_tokens": prompt - cached, "output_tokens": completion, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached}


def router(state: ServerState) -> APIRouter:
    r = APIRouter()

    @r.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request) -> dict:
        body = await read_json(request)
        state.check_model(body)
        ids = await asyncio.to_thread(state.encode_chat, chat_messages(body), chat_tools(body), False)
        return {"input_tokens": len(ids)}

    @r.post("/v1/messages")
    async def messages(request: Request) -> Any:
        body = await read_json(request)
        state.check_model(body)
        tools = chat_tools(body)
        ids = await asyncio.to_thread(state.encode_chat, chat_messages(body), tools)  # off the event loop
        stops = fields.stop_list(body, "stop_sequences")
        job = Job(state, ids, sampling(body, state.max_tokens(body, "max_tokens", None), stops, top_k=True))
        head = {"id": "msg_" + secrets.token_hex(12), "type": "message", "role": "assistant",
                "model": state.model_name}
        reply = Reply(state, tools is not None)
        if fields.get(body, "stream", bool, False):
            return StreamingResponse(_stream(job, reply, head), media_type="text/event-stream")
        text, calls, gen = [], [], None
        async for ev in job.events(request):
            gen = ev.gen
            for item in reply.finish() if ev.done else reply.feed(ev.delta):
                (calls if isinstance(item, ToolCall) else text).append(item)
        if gen is None:
            raise ApiError(499, "the client went away")
        joined = "".join(text).strip() if calls else "".join(text)  # newlines around calls are layout
        content = ([{"type": "text", "text": joined}] if joined else []) + [_tool_use(c) for c in calls]
        return {**head, "content": content, "stop_reason": _stop_reason(gen, bool(calls)),
                "stop_sequence": gen.stop_string, "usage": _usage(job.prompt_tokens, len(gen.token_ids), gen.cached_tokens)}

    return r


async def _stream(job: Job, reply: Reply, head: dict) -> AsyncIterator[str]:
    def event(kind: str, **data: Any) -> str:
        return sse({"type": kind, **data}, kind)

    def start(cached: int) -> str:  # sent with the first event, once the prefix cache has answered
        return event("message_start", message={**head, "content": [], "stop_reason": None, "stop_sequence": None,
                                               "usage": _usage(job.prompt_tokens, 0, cached)})

    index, text_open, calls, started = 0, False, 0, False
    try:
        async for ev in job.events():
            if not started:
                yield start(ev.gen.cached_tokens)
                started = True
            for item in reply.finish() if ev.done else reply.feed(ev.delta):
                if isinstance(item, ToolCall):
                    if text_open:
                        yield event("content_block_stop", index=index)
                        index, text_open = index + 1, False
                    block = _tool_use(item)
                    yield event("content_block_start", index=index, content_block={**block, "input": {}})
                    yield event("content_block_delta", index=index,
                                delta={"type": "input_json_delta", "partial_json": item.arguments})
                    yield event("content_block_stop", index=index)
                    index, calls = index + 1, calls + 1
                    continue
                if not text_open:
                    yield event("content_block_start", index=index, content_block={"type": "text", "text": ""})
                    text_open = True
                yield event("content_block_delta", index=index, delta={"type": "text_delta", "text": item})
            if ev.done:
                if text_open:
                    yield event("content_block_stop", index=index)
                gen = ev.gen
                yield event("message_delta", delta={"stop_reason": _stop_reason(gen, calls > 0),
                                                    "stop_sequence": gen.stop_string},
                            usage=_usage(job.prompt_tokens, len(gen.token_ids), gen.cached_tokens))
                yield event("message_stop")
    except ApiError as e:
        if not started:
            yield start(0)
        yield sse(anthropic_body(ApiError(500, e.message)), "error")
