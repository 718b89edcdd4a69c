"""/openapi.json: FastAPI's document of the routes, completed with what FastAPI cannot see
there: the request bodies (routes read their own, see schemas.py), the served model's facts
(its name, context, vocabulary, expert rows), the error shape of each API and, when the server
has one, the API key."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from .core import ServerState
from .errors import is_anthropic
from .schemas import components

_ERROR = {"type": "object", "required": ["message"],
          "properties": {"message": {"type": "string"}, "type": {"type": "string"}}}
ERROR_SCHEMAS = {
    "OpenAIError": {"type": "object", "required": ["error"], "properties": {"error": {
        **_ERROR, "properties": {**_ERROR["properties"], "param": {"type": ["string", "null"]},
                                 "code": {"type": ["string", "null"]}}}}},
    "AnthropicError": {"type": "object", "required": ["type", "error"],
                       "properties": {"type": {"const": "error"}, "error": _ERROR}},
}
_KEY_SCHEMES = {"bearer": {"type": "http", "scheme": "bearer"},
                "x-api-key": {"type": "apiKey", "in": "header", "name": "x-api-key"}}


def document(app: FastAPI, state: ServerState, open_paths: set[str]) -> dict[str, Any]:
    """The OpenAPI 3.1 document of `app` serving `state`; with an API key, every path but
    `open_paths` needs it."""
    doc = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
    found = doc.setdefault("components", {}).setdefault("schemas", {})
    found.update(_bounded(components(), {"context": state.context, "last_token_id": state.rt.spec.vocab_size - 1,
                                         "expert_rows": state.rt.spec.num_expert_rows}))
    found.update(ERROR_SCHEMAS)
    for schema in found.values():
        if "model" in schema.get("properties", {}):  # any other name is a 404
            schema["properties"]["model"].update(enum=[state.model_name], description="the served model's id")
    for path, operations in doc["paths"].items():
        error = {"$ref": f"#/components/schemas/{'AnthropicError' if is_anthropic(path) else 'OpenAIError'}"}
        for op in operations.values():
            op["responses"]["4XX"] = {"description": "a bad request, in this API's error shape",
                                      "content": {"application/json": {"schema": error}}}
            if "stream" in _body_properties(op, found):  # `"stream": true` answers server-sent events
                op["responses"]["200"]["content"]["text/event-stream"] = {"schema": {"type": "string"}}
            if state.api_key and path in open_paths:
                op["security"] = []
    if state.api_key:
        doc["components"]["securitySchemes"] = _KEY_SCHEMES
        doc["security"] = [{name: []} for name in _KEY_SCHEMES]
    return doc


def _bounded(schema: Any, facts: dict[str, int]) -> Any:
    """`schema` with each `x-maximum` marker (schemas.served) replaced by that fact's value."""
    if isinstance(schema, list):
        return [_bounded(s, facts) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _bounded(v, facts) for k, v in schema.items() if k != "x-maximum"}
    if "x-maximum" in schema:
        out["maximum"] = facts[schema["x-maximum"]]
    return out


def _body_properties(op: dict[str, Any], found: dict[str, Any]) -> dict[str, Any]:
    """The top-level properties of an operation's JSON request body, if it has one."""
    ref = op.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema", {}).get("$ref", "")
    return found.get(ref.rpartition("/")[2], {}).get("properties", {})
