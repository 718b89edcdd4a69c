"""/openapi.json through the real server: it needs the key, it describes the bodies the official
SDKs send, and requests generated from it (schemathesis, valid and invalid ones) get no 5xx
and no dropped connection, and every body it calls invalid gets a 4xx.

The generated run is seeded and bounded (FTKIT_SCHEMA_EXAMPLES per operation and mode, 10 in
CI); the model is a one-layer one with a 128-token context, so that what a generated request
may ask to generate stays short. A long run (its figures: docs/benchmarks.md):
    FTKIT_SCHEMA_EXAMPLES=200 python -m pytest -q tests/test_server_schema.py -k generated -s
"""

from __future__ import annotations

import json
import os
from collections import Counter
from dataclasses import replace

import anthropic
import httpx2 as httpx
import jsonschema_rs
import openai
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode
from test_server import KEY as SERVER_KEY
from test_server import MODEL, server  # noqa: F401  (the real server, module-scoped)

from ftkit.runtime.random_model import demo_spec
from ftkit.runtime.spec import FULL_ATTENTION
from serving import served, write_model

KEY, NAME = "schema-key", "tiny"
AUTH = {"authorization": f"Bearer {KEY}"}
EXAMPLES = int(os.environ.get("FTKIT_SCHEMA_EXAMPLES", "10"))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    spec = replace(demo_spec(512), num_layers=1, moe_layers=(0,), layer_kinds=(FULL_ATTENTION,),
                   max_position_embeddings=128)
    with served(write_model(tmp_path_factory.mktemp("schema") / "tiny.ftw", spec), NAME, KEY) as srv:
        yield srv


@pytest.fixture(scope="module")
def doc(tiny):
    r = httpx.get(tiny.url + "/openapi.json", headers=AUTH)
    assert r.status_code == 200, r.text
    return r.json()


def test_openapi_json_needs_the_key_and_describes_each_body(tiny, doc):
    r = httpx.get(tiny.url + "/openapi.json")
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(tiny.url + "/docs", headers=AUTH).status_code == 404  # no UI: its scripts come from a CDN
    schemas = doc["components"]["schemas"]
    bodies = {path: op["requestBody"]["content"]["application/json"]["schema"]["$ref"].rpartition("/")[2]
              for path, ops in doc["paths"].items() for op in ops.values() if "requestBody" in op}
    assert bodies == {"/v1/chat/completions": "ChatCompletionRequest", "/v1/completions": "CompletionRequest",
                      "/v1/responses": "ResponsesRequest", "/v1/messages": "MessagesRequest",
                      "/v1/messages/count_tokens": "CountTokensRequest", "/v1/cache/rebuild": "RebuildRequest"}
    chat = schemas["ChatCompletionRequest"]
    assert {"model", "messages"} <= set(chat["required"]) and chat["properties"]["model"]["enum"] == [NAME]
    assert chat["properties"]["temperature"]["anyOf"][0] == {"type": "number", "minimum": 0, "maximum": 2}
    assert "max_tokens" in schemas["MessagesRequest"]["required"]
    assert doc["paths"]["/v1/messages"]["post"]["responses"]["4XX"]["content"]["application/json"]["schema"] \
        == {"$ref": "#/components/schemas/AnthropicError"}
    assert set(doc["components"]["securitySchemes"]) == {"bearer", "x-api-key"}
    assert doc["paths"]["/health"]["get"]["security"] == []


def test_what_the_sdks_send_fits_the_schema(server):  # noqa: F811  (a model with room for tool prompts)
    """The bodies of real SDK calls (tools, tool results, streaming, system blocks) validate
    against the published schema, each against its route's body."""
    doc = httpx.get(server.url + "/openapi.json", headers={"authorization": f"Bearer {SERVER_KEY}"}).json()
    sent: list[tuple[str, dict]] = []

    def record(request) -> None:
        sent.append((request.url.path, json.loads(request.content)))

    hooks = {"request": [record]}
    oai = openai.OpenAI(base_url=server.url + "/v1", api_key=SERVER_KEY, max_retries=0,
                        http_client=openai.DefaultHttpxClient(event_hooks=hooks))
    ant = anthropic.Anthropic(base_url=server.url, api_key=SERVER_KEY, max_retries=0,
                              http_client=anthropic.DefaultHttpxClient(event_hooks=hooks))
    fn = {"name": "ls", "description": "list files", "parameters": {"type": "object", "properties": {}}}
    call = {"id": "c1", "type": "function", "function": {"name": "ls", "arguments": "{}"}}
    oai.chat.completions.create(model=MODEL, max_tokens=1, temperature=0, stop=["\n"], seed=1, messages=[
        {"role": "developer", "content": "Be brief."}, {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
        {"role": "assistant", "content": None, "tool_calls": [call]}, {"role": "tool", "tool_call_id": "c1",
                                                                        "content": "a.py"}],
        tools=[{"type": "function", "function": fn}], tool_choice="auto", stream=True,
        stream_options={"include_usage": True}).close()
    oai.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=1)
    oai.responses.create(model=MODEL, instructions="Be brief.", max_output_tokens=1, tools=[
        {"type": "function", **fn}, {"type": "web_search"}], input=[
        {"role": "user", "content": "Hi"}, {"type": "function_call", "call_id": "c1", "name": "ls", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "a.py"}])
    history = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "t", "signature": "s"}, {"type": "tool_use", "id": "t1", "name": "ls", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "a.py"}]}]
    tools = [{"name": "ls", "description": "list files", "input_schema": {"type": "object"}}]
    ant.messages.create(model=MODEL, max_tokens=1, system=[{"type": "text", "text": "Be brief."}], messages=history,
                        tools=tools, tool_choice={"type": "auto"}, stop_sequences=["\n"])
    ant.messages.count_tokens(model=MODEL, messages=history, tools=tools)
    bodies = {path: op["requestBody"]["content"]["application/json"]["schema"]
              for path, ops in doc["paths"].items() for op in ops.values() if "requestBody" in op}
    assert len({path for path, _ in sent}) == 5
    for path, body in sent:
        validator = jsonschema_rs.validator_for({**bodies[path], "components": doc["components"]})
        assert validator.is_valid(body), (path, [e.message for e in validator.iter_errors(body)])


class Tally:
    """Each generated request's outcome: counts by operation, mode and status class, and the
    failures (a 5xx, or a connection dropped or reset) with a curl line to replay them."""

    def __init__(self):
        self.counts: Counter = Counter()
        self.failures: list[str] = []

    def add(self, label: str, mode: str, case, outcome: requests.Response | Exception) -> None:
        if isinstance(outcome, Exception):
            self.failures.append(f"{label} ({mode}): {type(outcome).__name__}: {outcome}\n{case.as_curl_command()}")
            return
        self.counts[(label, mode, f"{outcome.status_code // 100}xx")] += 1
        if outcome.status_code >= 500:
            self.failures.append(f"{label} ({mode}): {outcome.status_code} {outcome.text[:300]}\n"
                                 f"{case.as_curl_command()}")

    def report(self) -> str:
        lines = [f"{sum(self.counts.values())} generated requests, {len(self.failures)} failed:"]
        lines += [f"  {label:36} {mode:8} {status}: {n}" for (label, mode, status), n in sorted(self.counts.items())]
        return "\n".join(lines)


def fuzz(url: str, op, mode: GenerationMode, tally: Tally, after=lambda r: None) -> None:
    """EXAMPLES requests of `mode` for the operation `op`, seeded (the same ones every run)."""

    @settings(max_examples=EXAMPLES, derandomize=True, database=None, deadline=None,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    @given(case=op.as_strategy(generation_mode=mode))
    def send(case) -> None:
        # An invalid case may be invalid only in the API key's header, which the test sets itself:
        # counted by its body's mode.
        kind = case.meta.components.get("body", case.meta.generation).mode.value
        try:
            r = case.call(base_url=url, headers=AUTH, timeout=300)
        except requests.RequestException as e:
            tally.add(op.label, kind, case, e)
            return
        tally.add(op.label, kind, case, r)
        after(r)

    send()


def test_generated_requests_get_no_server_error(tiny, doc):
    """Every operation, valid and invalid requests generated from the schema: each answered, none
    with a 5xx. A rebuild that applies is undone at once, so the next requests meet the start-up
    memory split. Prints the tally (run with -s to see it)."""
    start = tiny.state.scheduler.plan

    def undo_rebuild(r: requests.Response) -> None:
        if r.status_code == 200:
            undo = httpx.post(tiny.url + "/v1/cache/rebuild", headers=AUTH, timeout=60,
                              json={"experts": start.expert_slots, "kv_tokens": start.kv_tokens})
            assert undo.status_code == 200, undo.text

    tally = Tally()
    for result in schemathesis.openapi.from_dict(doc).get_all_operations():
        op = result.ok()
        # an operation without a body has nothing invalid to send but the API key's header
        for mode in GenerationMode if "requestBody" in op.definition.raw else [GenerationMode.POSITIVE]:
            fuzz(tiny.url, op, mode, tally, undo_rebuild if op.path == "/v1/cache/rebuild" else lambda r: None)
    print("\n" + tally.report())
    assert not tally.failures, "\n\n".join(tally.failures[:5])
    by_mode = Counter()
    for (_, mode, status), n in tally.counts.items():
        by_mode[mode, status] += n
    assert by_mode["positive", "2xx"] > 0
    assert by_mode["negative", "2xx"] == 0  # the schema is the rule: a body it refuses, the server refuses
