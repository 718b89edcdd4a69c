"""ft-bench soak: `ft-run serve` under agent-style sessions for a while, through the official
openai and anthropic SDKs, then whether anything was lost, what the server's memory did, and
whether greedy replies under load equal the same requests sent alone.

Each session is an agent: a system prompt, tool definitions, and a history that grows every
turn with the model's reply and then either a user follow-up or a tool call with its result.
A bench model has random weights and never writes a real tool call, so the calls in the history
are the client's (as an agent's harness would append after a call the model made); the server
still renders and tokenizes every one. Half the sessions speak OpenAI chat, half Anthropic
Messages; every other turn streams, and a share of the streams is dropped by the client after
a few chunks (counted apart: the server must free them, not answer them). Every `rebuild_every`
completed requests the expert cache is rebuilt, alternating between the start-up size and
half of it. A session whose prompt passes half the context starts over, as agents compact.

Replies are greedy (temperature 0). At the end a sample of completed requests is sent again one
at a time and compared: batched decoding agrees with a lone request to float32 rounding, not
bitwise (docs/api.md), so a rare difference is a near-tie, not a lost request.
"""

from __future__ import annotations

import json
import random
import re
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ftkit.runtime.engine.loader import RuntimeOptions
from ftkit.runtime.server.client import call

from . import serve as serve_bench

TOOLS = [("read_file", "Read a file of the repository", {"path": {"type": "string"}}),
         ("run_shell", "Run a shell command in the repository", {"command": {"type": "string"}}),
         ("search", "Search the repository for a pattern", {"pattern": {"type": "string"}})]
TASKS = ["Fix the failing test in tests/test_io.py.", "Add a --verbose flag to the CLI.",
         "Why is the parser slow on long inputs?", "Rename the Config class to Settings everywhere.",
         "Write a docstring for every public function in utils.py."]
FOLLOW_UPS = ["Go on.", "Now run the tests.", "That did not work; look again.", "Explain what you changed."]
RSS_EVERY_S = 10
WORDS = "def class return import self value path line error test file module state index".split()


@dataclass(frozen=True)
class Workload:
    sessions: int = 8
    minutes: float = 30.0
    turns: int | None = None  # at most this many turns a session (None: until the time is up)
    max_tokens: int = 24
    disconnect: float = 0.15  # share of the streamed turns the client drops after a few chunks
    rebuild_every: int = 50  # completed requests between cache rebuilds (0: none)
    replay: int = 16  # completed requests sent again alone at the end
    seed: int = 0


class Incomplete(Exception):
    """A stream that ended, without an error, before its last event: a lost reply."""


@dataclass
class Tally:
    """What happened to every request; thread-safe."""

    counts: Counter = field(default_factory=Counter)
    samples: list[tuple[str, dict, str]] = field(default_factory=list)  # (api, request, reply): completed, greedy
    errors: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, what: str, error: str | None = None) -> None:
        with self.lock:
            self.counts[what] += 1
            if error and len(self.errors) < 20:
                self.errors.append(error)

    def done(self, api: str, request: dict, reply: str) -> int:
        with self.lock:
            self.counts["completed"] += 1
            self.samples.append((api, request, reply))
            return self.counts["completed"]


def _tool_output(rng: random.Random, most: int) -> str:
    """A tool's result (a file, a listing) of `most` / 4 to `most` characters."""
    size, words = rng.randint(most // 4, most), []
    while sum(len(w) + 1 for w in words) < size:
        words.append(rng.choice(WORDS))
    return " ".join(words)


class Session:
    """One agent conversation, restarted when its prompt nears the context."""

    def __init__(self, index: int, api: str, clients: dict[str, Any], model: str, context: int, work: Workload,
                 tally: Tally, on_done: Callable[[int], None]):
        self.api, self.clients, self.model, self.context, self.work = api, clients, model, context, work
        self.tally, self.on_done = tally, on_done
        self.rng = random.Random(work.seed * 1000 + index)
        self.index, self.calls = index, 0
        # A character is a token at most, so a tool result stays within a quarter of the context;
        # 16k characters is a big file already.
        self.tool_chars = min(context // 4, 16_000)
        self.history: list[dict] = []
        self.restart()

    def restart(self) -> None:
        self.history = [{"role": "user", "content": self.rng.choice(TASKS)}]

    def run(self, deadline: float) -> None:
        turn = 0
        while time.time() < deadline and (self.work.turns is None or turn < self.work.turns):
            stream = turn % 2 == 1
            drop = stream and self.rng.random() < self.work.disconnect
            self.turn(stream, drop)
            turn += 1

    def turn(self, stream: bool, drop: bool) -> None:
        import anthropic
        import openai

        request = self.request()
        self.tally.add("sent")
        try:
            reply, prompt_tokens = (self.openai if self.api == "openai" else self.anthropic)(request, stream, drop)
        except (openai.APIStatusError, anthropic.APIStatusError) as e:
            self.tally.add("5xx" if e.status_code >= 500 else "4xx", f"{self.api}: {e.status_code}: {e.message}")
            self.restart()
            return
        except (openai.APIConnectionError, anthropic.APIConnectionError, Incomplete) as e:  # timeouts included
            self.tally.add("lost", f"{self.api}: {type(e).__name__}: {e}")
            self.restart()
            return
        except (openai.APIError, anthropic.APIError) as e:  # a stream's error event: the generation failed
            self.tally.add("5xx", f"{self.api}: error event: {e}")
            self.restart()
            return
        if reply is None:
            self.tally.add("disconnected")
            return
        self.on_done(self.tally.done(self.api, request, reply))
        self.grow(reply)
        if prompt_tokens > self.context // 2:  # the next turn adds at most a quarter (see tool_chars)
            self.restart()

    def request(self) -> dict:
        system = "You are a coding agent working in a Python repository. Use the tools."
        if self.api == "openai":
            tools = [{"type": "function", "function": {"name": n, "description": d, "parameters": {
                "type": "object", "properties": p, "required": list(p)}}} for n, d, p in TOOLS]
            return {"model": self.model, "messages": [{"role": "system", "content": system}, *self.history],
                    "tools": tools, "max_tokens": self.work.max_tokens, "temperature": 0}
        tools = [{"name": n, "description": d, "input_schema": {"type": "object", "properties": p, "required": list(p)}}
                 for n, d, p in TOOLS]
        return {"model": self.model, "system": system, "messages": list(self.history), "tools": tools,
                "max_tokens": self.work.max_tokens, "temperature": 0}

    def grow(self, reply: str) -> None:
        """The reply, then (one time in two) a user follow-up, else a tool call and its result."""
        name, _, params = self.rng.choice(TOOLS)
        args = {next(iter(params)): self.rng.choice(WORDS) + ".py"}
        self.calls += 1
        call_id = f"call_{self.index}_{self.calls}"
        if self.rng.random() < 0.5:
            self.history.append({"role": "assistant", "content": reply})
            self.history.append({"role": "user", "content": self.rng.choice(FOLLOW_UPS)})
        elif self.api == "openai":
            self.history.append({"role": "assistant", "content": reply, "tool_calls": [
                {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}]})
            self.history.append({"role": "tool", "tool_call_id": call_id,
                                 "content": _tool_output(self.rng, self.tool_chars)})
        else:
            self.history.append({"role": "assistant", "content": [
                *([{"type": "text", "text": reply}] if reply else []),
                {"type": "tool_use", "id": call_id, "name": name, "input": args}]})
            self.history.append({"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": call_id, "content": _tool_output(self.rng, self.tool_chars)}
            ]})

    def openai(self, request: dict, stream: bool, drop: bool) -> tuple[str | None, int]:
        """The reply's text and prompt tokens; (None, 0) when the client dropped the stream."""
        client = self.clients["openai"]
        if not stream:
            r = client.chat.completions.create(**request)
            return r.choices[0].message.content or "", r.usage.prompt_tokens
        chunks = client.chat.completions.create(**request, stream=True, stream_options={"include_usage": True})
        text, usage, finished = [], None, False
        for i, chunk in enumerate(chunks):
            if drop and i == 3:
                chunks.close()
                return None, 0
            if chunk.choices:
                text.append(chunk.choices[0].delta.content or "")
                finished = finished or chunk.choices[0].finish_reason is not None
            usage = chunk.usage or usage
        if not finished or usage is None:
            raise Incomplete("the stream ended without its last chunk")
        return "".join(text), usage.prompt_tokens

    def anthropic(self, request: dict, stream: bool, drop: bool) -> tuple[str | None, int]:
        client = self.clients["anthropic"]
        if not stream:
            r = client.messages.create(**_anthropic_args(request))
            return "".join(b.text for b in r.content if b.type == "text"), r.usage.input_tokens + \
                r.usage.cache_read_input_tokens
        with client.messages.stream(**_anthropic_args(request)) as s:
            for i, _ in enumerate(s):
                if drop and i == 3:
                    return None, 0
            final = s.get_final_message()
        if final.stop_reason is None:
            raise Incomplete("the stream ended without message_stop")
        return "".join(b.text for b in final.content if b.type == "text"), final.usage.input_tokens + \
            final.usage.cache_read_input_tokens


def _anthropic_args(request: dict) -> dict:
    """The SDK takes no `temperature` for every model it knows: sent as an extra field."""
    args = {k: v for k, v in request.items() if k != "temperature"}
    return {**args, "extra_body": {"temperature": request["temperature"]}}


def rss_bytes(pid: int) -> int | None:
    """The resident set of process `pid` (Linux /proc), None where it cannot be read."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def served_facts(url: str, key: str | None) -> tuple[str, int]:
    """The served model's id and context, from /openapi.json (the bound it states for max_tokens)."""
    doc = call(url, "GET", "/openapi.json", key)
    chat = doc["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    return chat["model"]["enum"][0], next(b["maximum"] for b in chat["max_tokens"]["anyOf"] if "maximum" in b)


def soak(url: str, key: str | None, work: Workload, pid: int | None = None, say: Callable[[str], None] = print) -> dict:
    """Run `work` against the server at `url` (its process `pid`, for RSS) and report."""
    import anthropic
    import openai

    model, context = served_facts(url, key)
    clients = {"openai": openai.OpenAI(base_url=url + "/v1", api_key=key or "none", max_retries=0, timeout=1800),
               "anthropic": anthropic.Anthropic(base_url=url, api_key=key or "none", max_retries=0, timeout=1800)}
    start = call(url, "GET", "/v1/stats", key)["memory"]["expert_slots"]
    tally, rss = Tally(), {"start": rss_bytes(pid) if pid else None}

    def maybe_rebuild(completed: int) -> None:
        """Half the start-up expert cache, then the start-up size again, and so on."""
        if work.rebuild_every and start and completed % work.rebuild_every == 0:  # start 0: no cache to resize
            experts = max(1, start // 2) if completed // work.rebuild_every % 2 else start
            try:
                call(url, "POST", "/v1/cache/rebuild", key, {"experts": experts})
                tally.add("rebuilds applied")
            except ValueError as e:  # an HTTP error: a refused rebuild is a 409 (reported), a 5xx a failure
                status = re.search(r"HTTP (\d{3})", str(e))
                kind = "5xx" if status is None or status[1] >= "500" else "rebuilds refused" if status[1] == "409" else "4xx"
                tally.add(kind, str(e))

    sessions = [Session(i, "openai" if i % 2 == 0 else "anthropic", clients, model, context, work, tally,
                        maybe_rebuild) for i in range(work.sessions)]
    deadline = time.time() + work.minutes * 60
    t0 = time.time()
    threads = [threading.Thread(target=s.run, args=(deadline,), daemon=True) for s in sessions]
    for t in threads:
        t.start()
    def held() -> dict:  # the prefix cache's rows held and budget: it grows to its budget by design
        return call(url, "GET", "/v1/stats", key).get("prefix_cache") or {}

    samples: list[tuple[float, int | None, int | None]] = []  # (seconds, server RSS, prefix rows), every RSS_EVERY_S
    prefix: dict[str, int | None] = {}
    while any(t.is_alive() for t in threads):
        time.sleep(1)
        elapsed = time.time() - t0
        if "warm" not in rss and tally.counts["completed"] >= work.sessions:  # every path has run about once
            rss["warm"], prefix["warm"] = rss_bytes(pid) if pid else None, held().get("tokens")
            say(f"warm after {elapsed:.0f} s: server RSS {_mib(rss['warm'])}")
        if not samples or elapsed - samples[-1][0] >= RSS_EVERY_S:
            samples.append((round(elapsed, 1), rss_bytes(pid) if pid else None, held().get("tokens")))
    seconds = time.time() - t0
    end = held()
    rss["end"], prefix["end"] = rss_bytes(pid) if pid else None, end.get("tokens")
    # Half way through: allocators and caches grow to their working size early and stay there;
    # a leak goes on growing in the second half too.
    _, rss["mid"], prefix["mid"] = min(samples, key=lambda s: abs(s[0] - seconds / 2))
    say(f"sessions done after {seconds:.0f} s: {dict(tally.counts)}; replaying {work.replay} alone")
    replayed = replay(clients, tally.samples, work.replay)
    stats = call(url, "GET", "/v1/stats", key)["requests"]
    c = tally.counts
    return {"workload": vars(work), "seconds": round(seconds, 1), "model": model, "context": context,
            "sent": c["sent"], "completed": c["completed"], "disconnected": c["disconnected"],
            "lost": c["lost"], "4xx": c["4xx"], "5xx": c["5xx"],
            "rebuilds": {"applied": c["rebuilds applied"], "refused": c["rebuilds refused"]},
            "rss_bytes": rss, "rss_samples": samples, "prefix_tokens": prefix,
            "prefix_max_tokens": end.get("max_tokens"),
            "rss_growth": _growth(rss.get("warm"), rss["end"]),
            "rss_growth_second_half": _growth(rss["mid"], rss["end"]), "replay": replayed,
            "server": {k: stats[k] for k in ("completed", "cancelled", "failed")}, "errors": tally.errors}


def replay(clients: dict[str, Any], samples: list[tuple[str, dict, str]], n: int) -> dict:
    """`n` completed requests, spread over the run, sent again one at a time: do the replies match?"""
    picked = samples[:: max(1, len(samples) // n)][:n] if n else []
    diffs = []
    for api, request, reply in picked:
        if api == "openai":
            alone = clients["openai"].chat.completions.create(**request).choices[0].message.content or ""
        else:
            r = clients["anthropic"].messages.create(**_anthropic_args(request))
            alone = "".join(b.text for b in r.content if b.type == "text")
        if alone != reply:
            diffs.append({"api": api, "under_load": reply, "alone": alone})
    return {"sent": len(picked), "equal": len(picked) - len(diffs), "differ": diffs}


def _growth(before: int | None, after: int | None) -> float | None:
    return round(after / before - 1, 4) if before and after else None


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:+.1%}"


def _mib(n: int | None) -> str:
    return "n/a" if n is None else f"{n / 2**20:.1f} MiB"


def measure(model: Path, opts: RuntimeOptions, serve_args: list[str], work: Workload, log: Path,
            say: Callable[[str], None] = print) -> dict:
    """`ft-run serve` started for `model` (serve.Server), soaked, stopped."""
    server = serve_bench.Server(model, opts, serve_args, log, say)
    try:
        return soak(server.url, serve_bench.KEY, work, server.proc.pid, say)
    finally:
        server.stop()


def rows(result: dict) -> list[tuple[str, str]]:
    """(what, figure) lines of the report."""
    rss, rep = result["rss_bytes"], result["replay"]
    return [("duration", f"{result['seconds']:.0f} s, {result['workload']['sessions']} sessions"),
            ("requests sent", str(result["sent"])), ("completed", str(result["completed"])),
            ("dropped by the client (by design)", str(result["disconnected"])), ("lost", str(result["lost"])),
            ("4xx", str(result["4xx"])), ("5xx", str(result["5xx"])),
            ("cache rebuilds: applied / refused", f"{result['rebuilds']['applied']} / {result['rebuilds']['refused']}"),
            ("server RSS: start / warm / half way / end",
             " / ".join(_mib(rss.get(k)) for k in ("start", "warm", "mid", "end"))),
            ("RSS growth since warm (target within 5%)", _pct(result["rss_growth"])),
            ("RSS growth over the second half", _pct(result["rss_growth_second_half"])),
            (f"prefix cache rows held: warm / half way / end (of {result['prefix_max_tokens']})",
             " / ".join(str(result["prefix_tokens"].get(k)) for k in ("warm", "mid", "end"))),
            ("greedy replies equal alone", f"{rep['equal']} of {rep['sent']}"),
            ("server: completed / cancelled / failed", " / ".join(str(result["server"][k])
                                                                  for k in ("completed", "cancelled", "failed")))]
