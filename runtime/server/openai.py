"""OpenAI API: `GET /v1/models`, `POST /v1/chat/completions`, `POST /v1/completions`."""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from .core import Job, Reply, ServerState, read_json, sampling, sse, text_of
from .errors import ApiError
from .reasoning import openai_effort
from .schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    FunctionTool,
    OpenAIRequest,
    request_body,
)
from .toolcalls import Reasoning, ToolCall


def usage(prompt: int, gen: Any, reasoning: int = 0) -> dict[str, Any]:
    completion = len(gen.token_ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": gen.cached_tokens},
            "completion_tokens_details": {"reasoning_tokens": reasoning}}


def chat_messages(req: ChatCompletionRequest) -> list[dict[str, Any]]:
    """OpenAI messages -> the chat template's messages (developer is system; text parts joined;
    an assistant's earlier `reasoning_content` is not re-rendered)."""
    out = []
    for m in req.messages:
        msg: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": text_of(m.content)}
        if m.role == "assistant" and m.tool_calls:
            msg["tool_calls"] = [c.model_dump(exclude_unset=True) for c in m.tool_calls]
        out.append(msg)
    return out


def chat_tools(req: ChatCompletionRequest) -> list[dict] | None:
    """Function tools for the template, or None when there are none or tool_choice is 'none'."""
    if req.tool_choice == "none":
        return None
    funcs = [t.model_dump(exclude_unset=True) for t in req.tools or [] if isinstance(t, FunctionTool)]
    return funcs or None


def _tool_call(call: ToolCall, index: int | None = None) -> dict[str, Any]:
    out = {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
    return out if index is None else {"index": index, **out}


def _common(state: ServerState, req: OpenAIRequest) -> tuple[bool, bool]:
    state.check_model(req.model)
    return bool(req.stream), bool(req.stream_options and req.stream_options.include_usage)


def router(state: ServerState) -> APIRouter:
    r = APIRouter()

    @r.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": state.model_name, "object": "model", "created": 0,
                                            "owned_by": "ftkit"}]}

    @r.post("/v1/chat/completions", openapi_extra=request_body(ChatCompletionRequest))
    async def chat_completions(request: Request) -> Any:
        req = await read_json(request, ChatCompletionRequest)
        stream, include_usage = _common(state, req)
        messages, tools = chat_messages(req), chat_tools(req)
        ids = await asyncio.to_thread(state.encode_chat, messages, tools,  # off the event loop
                                      effort=openai_effort(req.reasoning_effort))
        if req.max_completion_tokens is not None:
            limit = state.max_tokens(req.max_completion_tokens, "max_completion_tokens", state.context)
        else:
            limit = state.max_tokens(req.max_tokens, "max_tokens", state.context)
        job = Job(state, ids, sampling(req, limit, req.stop))
        head = {"id": "chatcmpl-" + secrets.token_hex(12), "created": int(time.time()), "model": state.model_name}
        reply = Reply(state, tools is not None)
        if stream:
            return StreamingResponse(_chat_stream(job, reply, head, include_usage), media_type="text/event-stream")
        text, calls, thought, gen = [], [], [], None
        async for ev in job.events(request):
            gen = ev.gen
            items = reply.finish() if ev.done else reply.feed(ev.delta)
            text += [i for i in items if isinstance(i, str)]
            calls += [i for i in items if isinstance(i, ToolCall)]
            thought += [i.text for i in items if isinstance(i, Reasoning)]
        if gen is None:
            raise ApiError(499, "the client went away")
        content = "".join(text).strip() if calls else "".join(text)  # newlines around calls are layout
        message: dict[str, Any] = {"role": "assistant", "content": content or (None if calls else "")}
        if thought:
            message["reasoning_content"] = "".join(thought)
        if calls:
            message["tool_calls"] = [_tool_call(c) for c in calls]
        finish = "tool_calls" if calls and gen.finish_reason == "stop" else gen.finish_reason
        return {**head, "object": "chat.completion",
                "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None}],
                "usage": usage(job.prompt_tokens, gen, reply.reasoning_tokens)}

    @r.post("/v1/completions", openapi_extra=request_body(CompletionRequest))
    async def completions(request: Request) -> Any:
        req = await read_json(request, CompletionRequest)
        stream, include_usage = _common(state, req)
        prompt = req.prompt
        if isinstance(prompt, list) and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        ids = await asyncio.to_thread(state.encode_text, prompt)
        limit = state.max_tokens(req.max_tokens, "max_tokens", 16)
        job = Job(state, ids, sampling(req, limit, req.stop))
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
                elif isinstance(item, Reasoning):
                    yield chunk({"reasoning_content": item.text})
                else:
                    yield chunk({"content": item})
            if ev.done:
                gen = ev.gen
                yield chunk({}, "tool_calls" if calls and gen.finish_reason == "stop" else gen.finish_reason)
                if include_usage:
                    yield sse({**head, "object": "chat.completion.chunk", "choices": [],
                               "usage": usage(job.prompt_tokens, gen, reply.reasoning_tokens)})
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

