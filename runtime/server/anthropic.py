"""Anthropic Messages API: `POST /v1/messages` (plain and streaming) and `/v1/messages/count_tokens`."""

from __future__ import annotations

import asyncio
import json
import secrets
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from .core import Job, Reply, ServerState, read_json, sampling, sse, text_of
from .errors import ApiError, anthropic_body
from .reasoning import anthropic_effort
from .schemas import (
    ClientTool,
    CountTokensRequest,
    MessagesRequest,
    TextBlock,
    ToolResultBlock,
    ToolUseBlock,
    request_body,
)
from .toolcalls import Reasoning, ToolCall


def chat_messages(req: CountTokensRequest) -> list[dict[str, Any]]:
    """Anthropic messages -> the chat template's messages: tool_use blocks become the assistant's
    tool calls, tool_result blocks become tool messages ahead of the user's text (thinking
    blocks, earlier reasoning, are not re-rendered)."""
    system = text_of(req.system)
    out = [{"role": "system", "content": system}] if system else []
    for m in req.messages:
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
            continue
        text, calls = [], []
        for block in m.content:
            if isinstance(block, TextBlock):
                text.append(block.text)
            elif isinstance(block, ToolUseBlock):
                calls.append({"id": block.id, "type": "function",
                              "function": {"name": block.name, "arguments": json.dumps(block.input)}})
            elif isinstance(block, ToolResultBlock):
                out.append({"role": "tool", "content": text_of(block.content)})
        if text or calls or m.role == "assistant":
            msg: dict[str, Any] = {"role": m.role, "content": "".join(text)}
            if calls:
                msg["tool_calls"] = calls
            out.append(msg)
    return out


def chat_tools(req: CountTokensRequest) -> list[dict] | None:
    """Client tools in the template's shape; server tools (with a versioned `type`) are ignored."""
    if req.tool_choice is not None and req.tool_choice.type == "none":
        return None
    out = [{"type": "function", "function": {"name": t.name, "description": t.description or "",
                                             "parameters": t.input_schema or {}}}
           for t in req.tools or [] if isinstance(t, ClientTool)]
    return out or None


def _tool_use(call: ToolCall) -> dict[str, Any]:
    return {"type": "tool_use", "id": "toolu_" + call.id.removeprefix("call_"), "name": call.name,
            "input": json.loads(call.arguments)}


def _thinking(text: str) -> dict[str, Any]:
    """A thinking block; its signature is empty, as nothing here can verify one sent back."""
    return {"type": "thinking", "thinking": text, "signature": ""}


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

    @r.post("/v1/messages/count_tokens", openapi_extra=request_body(CountTokensRequest))
    async def count_tokens(request: Request) -> dict:
        req = await read_json(request, CountTokensRequest)
        state.check_model(req.model)
        ids = await asyncio.to_thread(state.encode_chat, chat_messages(req), chat_tools(req), False,
                                      effort=anthropic_effort(req.thinking))
        return {"input_tokens": len(ids)}

    @r.post("/v1/messages", openapi_extra=request_body(MessagesRequest))
    async def messages(request: Request) -> Any:
        req = await read_json(request, MessagesRequest)
        state.check_model(req.model)
        tools = chat_tools(req)
        ids = await asyncio.to_thread(state.encode_chat, chat_messages(req), tools,  # off the event loop
                                      effort=anthropic_effort(req.thinking))
        limit = state.max_tokens(req.max_tokens, "max_tokens", state.context)
        job = Job(state, ids, sampling(req, limit, req.stop_sequences, req.top_k))
        head = {"id": "msg_" + secrets.token_hex(12), "type": "message", "role": "assistant",
                "model": state.model_name}
        reply = Reply(state, tools is not None)
        if req.stream:
            return StreamingResponse(_stream(job, reply, head), media_type="text/event-stream")
        text, calls, thought, gen = [], [], [], None
        async for ev in job.events(request):
            gen = ev.gen
            for item in reply.finish() if ev.done else reply.feed(ev.delta):
                if isinstance(item, Reasoning):
                    thought.append(item.text)
                else:
                    (calls if isinstance(item, ToolCall) else text).append(item)
        if gen is None:
            raise ApiError(499, "the client went away")
        joined = "".join(text).strip() if calls else "".join(text)  # newlines around calls are layout
        content = ([_thinking("".join(thought))] if thought else []) + \
            ([{"type": "text", "text": joined}] if joined else []) + [_tool_use(c) for c in calls]
        return {**head, "content": content, "stop_reason": _stop_reason(gen, bool(calls)),
                "stop_sequence": gen.stop_string, "usage": _usage(job.prompt_tokens, len(gen.token_ids), gen.cached_tokens)}

    return r


async def _stream(job: Job, reply: Reply, head: dict) -> AsyncIterator[str]:
    def event(kind: str, **data: Any) -> str:
        return sse({"type": kind, **data}, kind)

    def start(cached: int) -> str:  # sent with the first event, once the prefix cache has answered
        return event("message_start", message={**head, "content": [], "stop_reason": None, "stop_sequence": None,
                                               "usage": _usage(job.prompt_tokens, 0, cached)})

    # `open_kind`: the text or thinking block being streamed into, if any
    index, open_kind, calls, started = 0, None, 0, False
    try:
        async for ev in job.events():
            if not started:
                yield start(ev.gen.cached_tokens)
                started = True
            for item in reply.finish() if ev.done else reply.feed(ev.delta):
                kind = "tool_use" if isinstance(item, ToolCall) else "thinking" if isinstance(item, Reasoning) else "text"
                if open_kind and open_kind != kind:
                    yield event("content_block_stop", index=index)
                    index, open_kind = index + 1, None
                if isinstance(item, ToolCall):
                    block = _tool_use(item)
                    yield event("content_block_start", index=index, content_block={**block, "input": {}})
                    yield event("content_block_delta", index=index,
                                delta={"type": "input_json_delta", "partial_json": item.arguments})
                    yield event("content_block_stop", index=index)
                    index, calls = index + 1, calls + 1
                    continue
                if open_kind is None:
                    block = _thinking("") if kind == "thinking" else {"type": "text", "text": ""}
                    yield event("content_block_start", index=index, content_block=block)
                    open_kind = kind
                delta = {"type": "thinking_delta", "thinking": item.text} if kind == "thinking" \
                    else {"type": "text_delta", "text": item}
                yield event("content_block_delta", index=index, delta=delta)
            if ev.done:
                if open_kind:
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
