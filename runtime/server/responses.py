"""OpenAI Responses API (`POST /v1/responses`), as Codex uses it: string or item input, function
tools (other tool kinds are ignored, not refused), streaming events, the model's reasoning as a
`reasoning` output item. Responses are not stored, so `previous_response_id` is refused with a
clear error; an empty input is answered at once."""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from .core import Job, Reply, ServerState, read_json, sampling, sse, text_of
from .errors import ApiError
from .reasoning import openai_effort
from .schemas import (
    FunctionCallItem,
    FunctionCallOutput,
    InputMessage,
    ResponsesFunctionTool,
    ResponsesRequest,
    request_body,
)
from .toolcalls import Item, Reasoning, ToolCall


def input_messages(req: ResponsesRequest) -> list[dict[str, Any]]:
    """`instructions` + `input` -> the chat template's messages."""
    out: list[dict[str, Any]] = [{"role": "system", "content": req.instructions}] if req.instructions else []
    if isinstance(req.input, str):
        return out + ([{"role": "user", "content": req.input}] if req.input else [])
    for item in req.input:
        if isinstance(item, InputMessage):
            out.append({"role": "system" if item.role == "developer" else item.role, "content": text_of(item.content)})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments or "{}"}}
            if out and out[-1]["role"] == "assistant":  # calls after the text belong to the same turn
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutput):
            out.append({"role": "tool", "content": text_of(item.output)})
        # reasoning items and outputs of tool kinds we do not run carry nothing the template renders
    return out


def function_tools(req: ResponsesRequest) -> list[dict] | None:
    """Function tools in the chat template's shape; other kinds (web_search, custom...) ignored."""
    if req.tool_choice == "none":
        return None
    out = [{"type": "function", "function": {"name": t.name, "description": t.description or "",
                                             "parameters": t.parameters or {}}}
           for t in req.tools or [] if isinstance(t, ResponsesFunctionTool)]
    return out or None


# The output items text streams into: a message's output_text, a reasoning item's reasoning_text
# (the Responses API's full reasoning, not a summary), each with its id prefix and event names.
TEXT_KINDS = {"message": ("msg_", "output_text"), "reasoning": ("rs_", "reasoning_text")}


class Builder:
    """Reply items -> output items and the stream events that build them."""

    def __init__(self, head: dict[str, Any]):
        self.head, self.output, self.seq = head, [], 0
        self.open: dict[str, Any] | None = None  # the message or reasoning item text streams into, if any

    def event(self, kind: str, **data: Any) -> dict[str, Any]:
        self.seq += 1
        return {"type": kind, "sequence_number": self.seq - 1, **data}

    def response(self, status: str, usage: dict | None = None, incomplete: str | None = None) -> dict:
        return {**self.head, "status": status, "output": self.output, "usage": usage,
                "incomplete_details": {"reason": incomplete} if incomplete else None}

    def add(self, item: Item) -> Iterator[dict]:
        if isinstance(item, ToolCall):
            yield from self.close()
            fc = {"type": "function_call", "id": "fc_" + secrets.token_hex(12), "call_id": item.id,
                  "name": item.name, "arguments": "", "status": "in_progress"}
            idx = len(self.output)
            self.output.append(fc)
            yield self.event("response.output_item.added", output_index=idx, item=dict(fc))
            yield self.event("response.function_call_arguments.delta", item_id=fc["id"], output_index=idx,
                             delta=item.arguments)
            fc.update(arguments=item.arguments, status="completed")
            yield self.event("response.function_call_arguments.done", item_id=fc["id"], output_index=idx,
                             arguments=item.arguments)
            yield self.event("response.output_item.done", output_index=idx, item=fc)
            return
        kind, delta = ("reasoning", item.text) if isinstance(item, Reasoning) else ("message", item)
        if self.open is not None and self.open["type"] != kind:
            yield from self.close()
        if self.open is None:
            yield from self._start(kind)
        m = self.open
        m["content"][0]["text"] += delta
        yield self.event(f"response.{m['content'][0]['type']}.delta", item_id=m["id"],
                         output_index=self.output.index(m), content_index=0, delta=delta)

    def _start(self, kind: str) -> Iterator[dict]:
        prefix, part_type = TEXT_KINDS[kind]
        item: dict[str, Any] = {"type": kind, "id": prefix + secrets.token_hex(12), "status": "in_progress"}
        item.update({"role": "assistant", "content": []} if kind == "message" else {"summary": [], "content": []})
        self.open = item
        self.output.append(item)
        idx = len(self.output) - 1
        yield self.event("response.output_item.added", output_index=idx, item={**item, "content": []})
        part = {"type": part_type, "text": "", **({"annotations": []} if kind == "message" else {})}
        item["content"].append(part)
        yield self.event("response.content_part.added", item_id=item["id"], output_index=idx, content_index=0,
                         part=dict(part))

    def close(self) -> Iterator[dict]:
        """Finish the open message or reasoning item, if any."""
        if self.open is None:
            return
        m, self.open = self.open, None
        idx, part = self.output.index(m), m["content"][0]
        m["status"] = "completed"
        yield self.event(f"response.{part['type']}.done", item_id=m["id"], output_index=idx, content_index=0,
                         text=part["text"])
        yield self.event("response.content_part.done", item_id=m["id"], output_index=idx, content_index=0,
                         part=part)
        yield self.event("response.output_item.done", output_index=idx, item=m)


def _usage(prompt: int, completion: int, cached: int = 0, reasoning: int = 0) -> dict[str, Any]:
    return {"input_tokens": prompt, "output_tokens": completion, "total_tokens": prompt + completion,
            "input_tokens_details": {"cached_tokens": cached}, "output_tokens_details": {"reasoning_tokens": reasoning}}


def router(state: ServerState) -> APIRouter:
    r = APIRouter()

    @r.post("/v1/responses", openapi_extra=request_body(ResponsesRequest))
    async def responses(request: Request) -> Any:
        req = await read_json(request, ResponsesRequest)
        state.check_model(req.model)
        if req.previous_response_id:
            raise ApiError(400, "previous_response_id is not supported: this server does not store responses; "
                                "send the whole conversation in 'input'", param="previous_response_id")
        stream = bool(req.stream)
        messages, tools = input_messages(req), function_tools(req)
        echo = req.model_dump(include={"tools", "tool_choice", "metadata"}, exclude_unset=True)
        head = {"id": "resp_" + secrets.token_hex(12), "object": "response", "created_at": int(time.time()),
                "model": state.model_name, "error": None, "instructions": req.instructions,
                "tools": echo.get("tools") or [], "tool_choice": echo.get("tool_choice") or "auto",
                "parallel_tool_calls": True, "store": False, "metadata": echo.get("metadata") or {},
                "temperature": req.temperature, "top_p": req.top_p,
                "text": {"format": {"type": "text"}}, "truncation": "disabled"}
        b = Builder(head)
        if not any(m["role"] != "system" for m in messages):  # a probe: nothing to answer
            done = b.response("completed", _usage(0, 0))
            if stream:
                events = [b.event("response.created", response=b.response("in_progress")),
                          b.event("response.completed", response=done)]
                return StreamingResponse(iter(sse(e, e["type"]) for e in events), media_type="text/event-stream")
            return done
        effort = openai_effort(req.reasoning.effort if req.reasoning else None)
        ids = await asyncio.to_thread(state.encode_chat, messages, tools, effort=effort)  # off the event loop
        limit = state.max_tokens(req.max_output_tokens, "max_output_tokens", state.context)
        job = Job(state, ids, sampling(req, limit, None))
        reply = Reply(state, tools is not None)
        if stream:
            return StreamingResponse(_stream(job, reply, b), media_type="text/event-stream")
        final = None
        async for e in _events(job, reply, b, request):
            final = e
        if final is None or final["type"] not in ("response.completed", "response.incomplete"):
            raise ApiError(499, "the client went away")
        return final["response"]

    return r


async def _events(job: Job, reply: Reply, b: Builder, http_request: Any = None) -> AsyncIterator[dict]:
    yield b.event("response.created", response=b.response("in_progress"))
    yield b.event("response.in_progress", response=b.response("in_progress"))
    async for ev in job.events(http_request):
        for item in reply.finish() if ev.done else reply.feed(ev.delta):
            for e in b.add(item):
                yield e
        if ev.done:
            for e in b.close():
                yield e
            length = ev.gen.finish_reason == "length"
            kind = "response.incomplete" if length else "response.completed"
            usage = _usage(job.prompt_tokens, len(ev.gen.token_ids), ev.gen.cached_tokens, reply.reasoning_tokens)
            yield b.event(kind, response=b.response("incomplete" if length else "completed", usage,
                                                    "max_output_tokens" if length else None))


async def _stream(job: Job, reply: Reply, b: Builder) -> AsyncIterator[str]:
    try:
        async for e in _events(job, reply, b):
            yield sse(e, e["type"])
    except ApiError as e:
        yield sse(b.event("error", message=e.message, code="server_error"), "error")
