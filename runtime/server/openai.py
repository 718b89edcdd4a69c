"""OpenAI API: `GET /v1/models`, `POST /v1/chat/completions`, `POST /v1/completions`."""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from . import fields
from .core import Job, Reply, ServerState, read_json, sampling, sse, text_of
from .errors import ApiError
from .toolcalls import ToolCall

ROLES = {"system", "developer", "user", "assistant", "tool"}


def usage(prompt: int, gen: Any) -> dict[str, Any]:
    completion = len(gen.token_ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": gen.cached_tokens}}


def chat_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """OpenAI messages -> the chat template's messages (developer is system; text parts joined)."""
    raw = fields.get(body, "messages", list)
    if not raw:
        raise ApiError(400, "'messages' must not be empty", param="messages")
    out = []
    for i, m in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or m["role"] not in ROLES:
            raise ApiError(400, f"{where} must be an object with a role in {sorted(ROLES)}", param=where)
        msg: dict[str, Any] = {"role": "system" if m["role"] == "developer" else m["role"],
                               "content": text_of(m.get("content"), where)}
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls = m["tool_calls"]
            if not isinstance(calls, list) or not all(isinstance(c, dict) and isinstance(c.get("function"), dict)
                                                      for c in calls):
                raise ApiError(400, f"{where}.tool_calls must be an array of function calls", param=where)
            msg["tool_calls"] = calls
        out.append(msg)
    return out


def chat_tools(body: dict[str, Any]) -> list[dict] | None:
    """Function tools for the template, or None when there are none or tool_choice is 'none'."""
    tools = fields.get(body, "tools", list, [])
    if fields.get(body, "tool_choice", (str, dict), "auto") == "none":
        return None
    funcs = [t for t in tools if isinstance(t, dict) and t.get("type") == "function"]
    for t in funcs:
        if not isinstance(t.get("function"), dict) or not isinstance(t["function"].get("name"), str):
            raise ApiError(400, "each function tool needs function.name", param="tools")
    return funcs or None


def _tool_call(call: ToolCall, index: int | None = None) -> dict[str, Any]:
    out = {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
    return out if index is None else {"index": index, **out}


def _common(state: ServerState, body: dict[str, Any]) -> tuple[bool, bool]:
    state.check_model(body)
    if fields.get(body, "n", int, 1) != 1:
        raise ApiError(400, "only n=1 is supported", param="n")
    stream = fields.get(body, "stream", bool, False)
    opts = fields.get(body, "stream_options", dict, {})
    return stream, bool(opts.get("include_usage"))


def router(state: ServerState) -> APIRouter:
    r = APIRouter()

    @r.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": state.model_name, "object": "model", "created": 0,
                                            "owned_by": "ftkit"}]}

    @r.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        body = await read_json(request)
        stream, include_usage = _common(state, body)
        messages, tools = chat_messages(body), chat_tools(body)
        ids = await asyncio.to_thread(state.encode_chat, messages, tools)  # off the event loop
        name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        limit = state.max_tokens(body, name, state.context)
        job = Job(state, ids, sampling(body, limit, fields.stop_list(body, "stop")))
        head = {"id": "chatcmpl-" + secrets.token_hex(12), "created": int(time.time()), "model": state.model_name}
        reply = Reply(state, tools is not None)
        if stream:
            return StreamingResponse(_chat_stream(job, reply, head, include_usage), media_type="text/event-stream")
        text, calls, gen = [], [], None
        async for ev in job.events(request):
            gen = ev.gen
            items = reply.finish() if ev.done else reply.feed(ev.delta)
            text += [i for i in items if isinstance(i, str)]
            calls += [i for i in items if isinstance(i, ToolCall)]
        if gen is None:
            raise ApiError(499, "the client went away")
        content = "".join(text).strip() if calls else "".join(text)  # newlines around calls are layout
        message: dict[str, Any] = {"role": "assistant", "content": content or (None if calls else "")}
        if calls:
            message["tool_calls"] = [_tool_call(c) for c in calls]
        finish = "tool_calls" if calls and gen.finish_reason == "stop" else gen.finish_reason
        return {**head, "object": "chat.completion",
                "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None}],
                "usage": usage(job.prompt_tokens, gen)}

    @r.post("/v1/completions")
    async def completions(request: Request) -> Any:
        body = await read_json(request)
        stream, include_usage = _common(state, body)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if not isinstance(prompt, (str, list)):
            raise ApiError(400, "'prompt' must be a string or an array of token ids", param="prompt")
        ids = await asyncio.to_thread(state.encode_text, prompt)
        limit = state.max_tokens(body, "max_tokens", 16)
        job = Job(state, ids, sampling(body, limit, fields.stop_list(body, "stop")))
        head = {"id": "cmpl-" + secrets.token_hex(12), "object": "text_completion", "created": int(time.time()),
                "model": state.model_name}
        if stream:
            return StreamingResponse(_completion_stream(job, head, include_usage), media_type="text/event-stream")
        text, gen = [], None
        async for ev in job.events(request):
            gen = ev.gen
            text.append(ev.delta)
        if gen is None:
            raise ApiError(499, "the client went away")
        return {**head, "choices": [{"index": 0, "text": "".join(text), "logprobs": None,
                                     "finish_reason": gen.finish_reason}],
                "usage": usage(job.prompt_tokens, gen)}

    return r


async def _chat_stream(job: Job, reply: Reply, head: dict, include_usage: bool) -> AsyncIterator[str]:
    def chunk(delta: dict, finish: str | None = None) -> str:
        return sse({**head, "object": "chat.completion.chunk",
                    "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]})

    yield chunk({"role": "assistant", "content": ""})
    calls = 0
    try:
        async for ev in job.events():
            for item in reply.finish() if ev.done else reply.feed(ev.delta):
                if isinstance(item, ToolCall):
                    yield chunk({"tool_calls": [_tool_call(item, calls)]})
                    calls += 1
                else:
                    yield chunk({"content": item})
            if ev.done:
                gen = ev.gen
                yield chunk({}, "tool_calls" if calls and gen.finish_reason == "stop" else gen.finish_reason)
                if include_usage:
                    yield sse({**head, "object": "chat.completion.chunk", "choices": [],
                               "usage": usage(job.prompt_tokens, gen)})
    except ApiError as e:
        yield sse({"error": {"message": e.message, "type": "server_error"}})
    yield sse("[DONE]")


async def _completion_stream(job: Job, head: dict, include_usage: bool) -> AsyncIterator[str]:
    try:
        async for ev in job.events():
            finish = ev.gen.finish_reason if ev.done else None
            # a chunk for every token, its text empty where none is shown yet (a partial
            # character or stop string, a model without a tokenizer): clients see each token come
            yield sse({**head, "choices": [{"index": 0, "text": ev.delta, "logprobs": None,
                                            "finish_reason": finish}]})
            if ev.done and include_usage:
                yield sse({**head, "choices": [], "usage": usage(job.prompt_tokens, ev.gen)})
    except ApiError as e:
        yield sse({"error": {"message": e.message, "type": "server_error"}})
    yield sse("[DONE]")

