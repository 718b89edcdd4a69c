"""What both APIs share: the served model, prompt encoding and limits, sampling fields, and a
generation job that bridges the scheduler thread to asyncio and cancels on disconnect."""

from __future__ import annotations

import asyncio
import contextvars
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from ..engine.loader import Runtime
from ..engine.sampling import SamplingParams
from ..engine.scheduler import Event, Request, Scheduler
from . import limits, quirks, schemas
from .errors import ApiError
from .toolcalls import Item, Parser, ToolCall, parser_for, tag_tokens

# How often a non-streaming request checks whether its client is still there.
DISCONNECT_POLL_S = 0.5
# The request's `Scheduler.arrival` release, set for the request's task by the app's `Arrivals`
# middleware and called once its Job is submitted.
ARRIVAL: contextvars.ContextVar[Callable[[], None] | None] = contextvars.ContextVar("ftkit_arrival", default=None)


@dataclass
class ServerState:
    rt: Runtime
    scheduler: Scheduler
    model_name: str
    api_key: str | None = None
    max_body: int = limits.DEFAULT_MAX_BODY  # request body bytes (a larger one is a 413)

    @property
    def context(self) -> int:
        return self.rt.spec.max_position_embeddings

    @property
    def template(self) -> str | None:
        """The chat template's text: its tool-call format picks the parser."""
        tok = self.rt.tokenizer
        return tok.template_source if tok else None

    @property
    def keep_special(self) -> frozenset[int]:
        """Token ids of the tool-call tags, kept in the text so the parser can see them."""
        tok = self.rt.tokenizer
        ids = (tok.token_id(t) for t in tag_tokens(self.template)) if tok else ()
        return frozenset(i for i in ids if i is not None)

    def tool_parser(self, tools_on: bool = True) -> Parser | None:
        """A parser of the template's format for a reply: when tools are on, or, for a format
        that frames every reply (harmony's channels), always."""
        cls = parser_for(self.template)
        return cls() if cls and (tools_on or cls.FRAMES_EVERY_REPLY) else None

    def check_model(self, model: str) -> None:
        if model != self.model_name:
            raise ApiError(404, f"model '{model}' not found; this server serves '{self.model_name}'",
                           param="model", code="model_not_found")

    def encode_chat(self, messages: list[dict[str, Any]], tools: list[dict] | None, check: bool = True,
                    effort: str | None = None) -> list[int]:
        """The prompt's ids; `effort` is the template's `reasoning_effort` (reasoning.py), left
        undefined when None so that the template's own default applies."""
        tok = self.rt.tokenizer
        if tok is None or tok.template is None:
            raise ApiError(400, "this model has no chat template; use /v1/completions")
        if not messages:  # Anthropic user turns of thinking blocks or empty content render to nothing
            raise ApiError(400, "the messages hold no text, tool call or tool result to render")
        try:
            extra = {"reasoning_effort": effort} if effort else {}
            text = tok.chat(quirks.normalise(messages), tools=tools or None, **extra)
        except Exception as e:  # a template's raise_exception() or a message it cannot render
            raise ApiError(400, f"the chat template rejected the messages: {e}") from None
        ids = tok.encode(text)
        return self.check_prompt(ids) if check else ids

    def encode_text(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, list):
            vocab = self.rt.spec.vocab_size
            if not prompt or not all(type(t) is int and 0 <= t < vocab for t in prompt):  # not bools
                raise ApiError(400, "'prompt' token ids must be a non-empty array of ids in the vocabulary",
                               param="prompt")
            return self.check_prompt(prompt)
        if self.rt.tokenizer is None:
            raise ApiError(400, "this model has no tokenizer; send 'prompt' as token ids", param="prompt")
        return self.check_prompt(self.rt.tokenizer.encode(prompt))

    def check_prompt(self, ids: list[int]) -> list[int]:
        if not ids:
            raise ApiError(400, "the prompt is empty")
        if len(ids) >= self.context:
            raise ApiError(400, f"the prompt is {len(ids)} tokens; this model's context is {self.context} "
                                f"tokens, and at least one must be left to generate", code="context_length_exceeded")
        return ids

    def max_tokens(self, value: int | None, name: str, default: int) -> int:
        """A `max_tokens` field (at least 1 by its schema): at most the context (the reply is
        also cut where the context ends)."""
        value = default if value is None else value
        if value > self.context:
            raise ApiError(400, f"'{name}' must be between 1 and the context length {self.context}, got {value}",
                           param=name)
        return value


def sampling(req: schemas.Sampling, max_tokens: int, stop: schemas.Stop | None, top_k: int | None = None
             ) -> SamplingParams:
    """The engine's parameters; the bounds were the schema's (`temperature` 0..2, `top_p` in (0, 1],
    `seed` what a torch generator takes)."""
    stops = [stop] if isinstance(stop, str) else stop or []
    return SamplingParams(
        max_tokens=max_tokens, temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p, top_k=top_k or 0, seed=req.seed,
        stop=[s for s in stops if s], ignore_eos=bool(req.ignore_eos))


class Job:
    """One request in the scheduler, its events as an async stream."""

    def __init__(self, state: ServerState, prompt_ids: list[int], params: SamplingParams):
        loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[Event] = asyncio.Queue()
        # The sink holds the queue, not `self`: the request holds the sink, so a sink holding the
        # job made a cycle (job -> request -> sink -> job) that kept every finished request, its
        # KV cache with it, until one of the cyclic collector's rare full passes (42 finished
        # requests' KV alive after a 3-minute soak; the 20-minute soak's server RSS grew 48%).
        queue = self.queue

        def sink(ev: Event) -> None:
            try:
                loop.call_soon_threadsafe(queue.put_nowait, ev)
            except RuntimeError:  # the event loop is gone (shutdown): nobody is listening
                pass

        self.req = Request(prompt_ids, params, sink, state.keep_special, state.context)
        self.prompt_tokens = len(prompt_ids)
        try:
            state.scheduler.submit(self.req)
        except ValueError as e:
            raise ApiError(400, str(e)) from None
        finally:
            if (arrived := ARRIVAL.get()) is not None:
                arrived()

    async def events(self, http_request: Any = None) -> AsyncIterator[Event]:
        """Token events then the final one; the request is cancelled if the consumer stops
        early (a streaming client went away) or `http_request` reports a disconnect."""
        try:
            while True:
                if http_request is None:
                    ev = await self.queue.get()
                else:
                    try:
                        ev = await asyncio.wait_for(self.queue.get(), DISCONNECT_POLL_S)
                    except asyncio.TimeoutError:
                        if await http_request.is_disconnected():
                            return
                        continue
                if ev.done and ev.error:
                    raise ApiError(ev.status, ev.error if ev.status < 500 else f"generation failed: {ev.error}")
                yield ev
                if ev.done:
                    return
        finally:
            self.req.cancel()


def sse(data: Any, event: str | None = None) -> str:
    head = f"event: {event}\n" if event else ""
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"{head}data: {payload}\n\n"


class Reply:
    """Generated text -> items (text pieces, tool calls, reasoning pieces); parsed when tools are
    on, or when the format frames every reply (`ServerState.tool_parser`)."""

    def __init__(self, state: ServerState, tools_on: bool):
        self.parser = state.tool_parser(tools_on)
        self.calls = 0
        self.reasoning_tokens = 0  # tokens fed while the parser was inside reasoning

    def feed(self, delta: str) -> list[Item]:
        """The items one generated token's `delta` completes."""
        if self.parser:
            items = self._layout(self.parser.feed(delta))
            self.reasoning_tokens += self.parser.in_reasoning
            return items
        return [delta] if delta else []

    def finish(self) -> list[Item]:
        return self._layout(self.parser.finish()) if self.parser else []

    def _layout(self, items: list[Item]) -> list[Item]:
        """Drop whitespace-only text once calls have started: it is the newlines between them."""
        out = []
        for item in items:
            if isinstance(item, str):
                if self.calls and not item.strip():
                    continue
            elif isinstance(item, ToolCall):
                self.calls += 1
            out.append(item)
        return out


async def read_json(request: Any, model: type[schemas.B]) -> schemas.B:
    """The request body as `model`, or a 400 (its size was checked on the way in: limits.BodyLimit)."""
    raw = await request.body()
    if limits.too_deep(raw):
        raise ApiError(400, f"the request body nests arrays and objects deeper than {limits.MAX_DEPTH} levels")
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:  # bad JSON, or an integer of more digits than Python parses
        raise ApiError(400, f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    if b"\\ud" in raw.lower():  # an escaped surrogate: a lone one is no text a tokenizer takes
        try:
            json.dumps(body, ensure_ascii=False).encode()
        except UnicodeEncodeError:
            raise ApiError(400, "the request body holds a lone UTF-16 surrogate (\\ud800-\\udfff)") from None
    return schemas.parse(model, body)


def text_of(content: str | list[schemas.TextPart] | list[schemas.TextBlock] | None) -> str:
    """Message content as text: a string, or its text parts joined (the schema admits no others)."""
    if content is None or isinstance(content, str):
        return content or ""
    return "".join(part.text for part in content)
