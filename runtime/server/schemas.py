"""Request bodies as pydantic models. A route validates its body against one before reading it
(types, numeric bounds, roles, content kinds), and /openapi.json publishes the same models, so
the schema a client reads is the rule the server applies. Fields the server does not read are
let through (clients send many); types are strict ("2" is no integer, true no token id; 2.0 is
2, as in JSON Schema).

The served model's facts (its name, context, vocabulary, expert rows) are published in
/openapi.json too (openapi_doc.py) and checked where they are used: an unknown model is a 404,
`max_tokens` past the context or a token id past the vocabulary a 400. No schema can say how
many tokens a prompt is, or whether the chat template accepts the messages: those are 400s
from the routes."""

from __future__ import annotations

from typing import Annotated, Any, Literal, TypeVar

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    WithJsonSchema,
    model_validator,
)
from pydantic.json_schema import models_json_schema

from .errors import ApiError


class Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)


def served(fact: str) -> dict[str, Any]:
    """A bound that is a fact of the served model (`context`, `last_token_id`, `expert_rows`):
    /openapi.json states it as the field's `maximum` (openapi_doc.py), the route checks it."""
    return {"x-maximum": fact}


def _integral(value: Any) -> Any:
    """2.0 is the integer 2, as JSON Schema counts integers (strict validation would refuse it)."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def integer(**bounds: Any) -> Any:
    """An integer field's type with its bounds (the converter comes after them, or the schema
    would lose them)."""
    return Annotated[int, Field(**bounds), BeforeValidator(_integral)]


# ---- shared ---------------------------------------------------------------------------------
MaxTokens = integer(ge=1, json_schema_extra=served("context"))
Seed = integer(ge=-(2**63), le=2**64 - 1)  # what a torch generator takes
TokenId = integer(ge=0, json_schema_extra=served("last_token_id"))
Stop = str | list[str]
# OpenAI's reasoning efforts (reasoning.py maps them onto the template's low / medium / high)
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]


class Sampling(Body):
    temperature: Annotated[float, Field(ge=0, le=2)] | None = Field(None, description="0: greedy")
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    seed: Seed | None = Field(None, description="reproducible on one device and build")
    ignore_eos: bool | None = Field(None, description="vLLM extension: decode through end-of-sequence tokens")


def _kind(default: str | None, known: tuple[str, ...]) -> Discriminator:
    """A discriminator over `type` (`default` when absent): a known kind, else 'other'."""

    def tag(value: Any) -> str:
        kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
        kind = default if kind is None else kind
        return kind if kind in known else "other"

    return Discriminator(tag)


def _not(*kinds: str) -> Any:
    """The `type` of an ignored kind: any name but `kinds` (so the schema's oneOf is exact)."""
    return Field(json_schema_extra={"not": {"enum": list(kinds)}})


# ---- OpenAI chat and completions ------------------------------------------------------------
class TextPart(Body):
    type: Literal["text", "input_text", "output_text"]
    text: str


Content = str | list[TextPart]


class FunctionCall(Body):
    name: str
    arguments: str = Field(description="the arguments as a JSON text")


class AssistantToolCall(Body):
    id: str | None = None
    type: str | None = None
    function: FunctionCall


class ChatMessage(Body):
    role: Literal["system", "developer", "user", "assistant", "tool"] = Field(description="developer is system")
    content: Content | None = None
    tool_calls: list[AssistantToolCall] | None = Field(None, description="an assistant's earlier calls")


class FunctionDef(Body):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class FunctionTool(Body):
    type: Literal["function"]
    function: FunctionDef


class OtherTool(Body):
    """A tool kind the server does not run: ignored."""

    type: str = _not("function")


ChatTool = Annotated[Annotated[FunctionTool, Tag("function")] | Annotated[OtherTool, Tag("other")],
                     _kind(None, ("function",))]
ToolChoice = Literal["none", "auto", "required"] | dict[str, Any]


class StreamOptions(Body):
    include_usage: bool | None = None


class OpenAIRequest(Sampling):
    model: str
    stop: Stop | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    n: integer(ge=1, le=1) | None = Field(None, description="only 1")


class ChatCompletionRequest(OpenAIRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: MaxTokens | None = None
    max_completion_tokens: MaxTokens | None = None
    tools: list[ChatTool] | None = None
    tool_choice: ToolChoice | None = Field(None, description="none disables the tools; other choices offer them")
    reasoning_effort: ReasoningEffort | None = Field(None, description="the chat template's reasoning_effort: "
                                                     "none and minimal are low, xhigh and max high")


TokenIds = Annotated[list[TokenId], Field(min_length=1)]
OneText = Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1, max_length=1)]
OneTokenIds = Annotated[list[TokenIds], Field(min_length=1, max_length=1)]


class CompletionRequest(OpenAIRequest):
    prompt: Annotated[str, Field(min_length=1)] | TokenIds | OneText | OneTokenIds = Field(
        description="text, token ids (below the vocabulary size), or a batch of one of either")
    max_tokens: MaxTokens | None = Field(None, description="default 16")


# ---- OpenAI Responses -----------------------------------------------------------------------
class InputMessage(Body):
    type: Literal["message"] | None = None
    role: Literal["user", "assistant", "system", "developer"]
    content: Content | None = None


class FunctionCallItem(Body):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str | None = None


class FunctionCallOutput(Body):
    type: Literal["function_call_output"]
    call_id: str
    output: Content


class OtherItem(Body):
    """Reasoning, or a call of a tool kind the server does not run: skipped."""

    type: str = _not("message", "function_call", "function_call_output")


InputItem = Annotated[Annotated[InputMessage, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
                      | Annotated[FunctionCallOutput, Tag("function_call_output")] | Annotated[OtherItem, Tag("other")],
                      _kind("message", ("message", "function_call", "function_call_output"))]


class ResponsesFunctionTool(Body):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


ResponsesTool = Annotated[Annotated[ResponsesFunctionTool, Tag("function")] | Annotated[OtherTool, Tag("other")],
                          _kind(None, ("function",))]


class ReasoningOptions(Body):
    effort: ReasoningEffort | None = Field(None, description="as chat's reasoning_effort")


class ResponsesRequest(Sampling):
    model: str
    input: str | list[InputItem]
    instructions: str | None = None
    tools: list[ResponsesTool] | None = None
    tool_choice: ToolChoice | None = None
    stream: bool | None = None
    max_output_tokens: MaxTokens | None = None
    # Typed as a string so that an id gets the route's own 400 (which says what to send instead);
    # published as null only, which is all that is served.
    previous_response_id: Annotated[str | None, WithJsonSchema(
        {"type": "null", "description": "an id is refused: responses are not stored"})] = None
    metadata: dict[str, Any] | None = None
    reasoning: ReasoningOptions | None = None


# ---- Anthropic Messages ---------------------------------------------------------------------
class TextBlock(Body):
    type: Literal["text"]
    text: str


class ThinkingBlock(Body):
    """Earlier reasoning: skipped, not re-rendered."""

    type: Literal["thinking", "redacted_thinking"]


class ToolUseBlock(Body):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(Body):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] | None = None


class UserMessage(Body):
    role: Literal["user"]
    content: str | list[Annotated[TextBlock | ToolResultBlock | ThinkingBlock, Field(discriminator="type")]]


class AssistantMessage(Body):
    role: Literal["assistant"]
    content: str | list[Annotated[TextBlock | ToolUseBlock | ThinkingBlock, Field(discriminator="type")]]


class ClientTool(Body):
    type: Literal["custom"] | None = None
    name: str
    description: str | None = None
    input_schema: dict[str, Any] | None = None


class ServerTool(Body):
    """A server tool (a versioned `type`): ignored."""

    type: str = _not("custom")


AnthropicTool = Annotated[Annotated[ClientTool, Tag("custom")] | Annotated[ServerTool, Tag("other")],
                          _kind("custom", ("custom",))]


class AnthropicToolChoice(Body):
    type: Literal["auto", "any", "tool", "none"] = Field(description="none disables the tools; the others offer them")
    name: str | None = None


class ThinkingConfig(Body):
    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    budget_tokens: integer(ge=1) | None = Field(None, description="enabled: below 4096 low, below 16384 medium, "
                                                                   "else high; none given: medium")


class CountTokensRequest(Body):
    model: str
    messages: list[Annotated[UserMessage | AssistantMessage, Field(discriminator="role")]] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None
    thinking: ThinkingConfig | None = Field(None, description="the chat template's reasoning_effort: disabled is "
                                                              "low, adaptive medium, enabled by budget_tokens")


class MessagesRequest(CountTokensRequest, Sampling):
    max_tokens: MaxTokens
    top_k: integer(ge=0) | None = Field(None, description="0: no top-k cut")
    stop_sequences: Stop | None = None
    stream: bool | None = None


# ---- control --------------------------------------------------------------------------------
class RebuildRequest(Body):
    model_config = ConfigDict(json_schema_extra={"anyOf": [  # one of them, not null
        {"required": [name], "properties": {name: {"type": "integer"}}} for name in ("experts", "kv_tokens")]})
    experts: integer(ge=1, json_schema_extra=served("expert_rows")) | None = Field(None, description="expert cache slots")
    kv_tokens: integer(ge=1) | None = Field(None, description="KV budget in tokens (one that does not fit the "
                                                               "memory budget is a 409)")

    @model_validator(mode="after")
    def _either(self) -> RebuildRequest:
        if self.experts is None and self.kv_tokens is None:
            raise ValueError("give 'experts' and/or 'kv_tokens'")
        return self


BODIES: tuple[type[Body], ...] = (ChatCompletionRequest, CompletionRequest, ResponsesRequest, MessagesRequest,
                                  CountTokensRequest, RebuildRequest)


B = TypeVar("B", bound=Body)


def parse(model: type[B], body: dict[str, Any]) -> B:
    """`body` as `model`, or a 400 naming the fields that are wrong."""
    try:
        return model.model_validate(body)
    except ValidationError as e:
        errors = list(dict.fromkeys((_where(body, err["loc"]), err["msg"].removeprefix("Value error, "))
                                    for err in e.errors(include_url=False)))
        # A union's members fail at different depths ('stop' is no string, 'stop.1' no string in
        # a list): the deepest failure is the one that tells the client what to fix.
        paths = {where for where, _ in errors}
        errors = [(w, m) for w, m in errors if not any(p.startswith(f"{w}.") for p in paths)]
        more = f" (and {len(errors) - 3} more)" if len(errors) > 3 else ""
        message = "; ".join(f"'{where}': {msg}" if where else msg for where, msg in errors[:3]) + more
        raise ApiError(400, message, param=errors[0][0] or None) from None


def _where(body: Any, loc: tuple) -> str:
    """An error's location as the field path in the body: pydantic's location also names the
    union member it tried ('str', a tag), which is no part of the body and is dropped."""
    path, value = [], body
    for i, part in enumerate(loc):
        if isinstance(value, dict) and part in value or isinstance(value, list) and isinstance(part, int) \
                and 0 <= part < len(value):
            path.append(str(part))
            value = value[part]
        elif i == len(loc) - 1 and isinstance(value, dict):  # a missing field
            path.append(str(part))
    return ".".join(path)


def components() -> dict[str, Any]:
    """The JSON schemas of every body and of what they refer to, as OpenAPI components."""
    _, top = models_json_schema([(m, "validation") for m in BODIES], ref_template="#/components/schemas/{model}")
    return top["$defs"]


def request_body(model: type[Body]) -> dict[str, Any]:
    """A route's `openapi_extra`: its body is `model` (the route reads the body itself)."""
    ref = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}
