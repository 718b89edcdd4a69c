"""ft-bench serve: `ft-run serve` driven as a user drives it, each figure beside the engine's own.

The server runs as its own process (the command a user types), the client is the official
openai SDK streaming `/v1/completions` with token-id prompts (random ids: bench models have no
tokenizer), sampled at temperature 1 so replies route like fresh text rather than like a greedy
loop on random weights. The scenarios, in order:
- first: the first request after start-up, then one of the same shape (no prefix in common);
- single: one stream at each prompt length, TTFT and decode tok/s;
- agent: for each of `suffixes`, a session of turns, each resending the previous prompt plus
  that many new tokens (the reply and a tool result; a completion's reply ids are not returned,
  so new ids stand in), so every turn after the first is a prefix hit;
- concurrent: one stream alone (after an untimed one of the same shape), then N at once, each a
  shared prefix plus its own tokens.
Then the engine runs the same work in this process once the server is gone (`run.prefill`:
a warm chunk of each length, each suffix's extend behind the agent's prompt; `run.decode` at
each length).
"""

from __future__ import annotations

import gc
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from ftkit.runtime.cli import runtime_argv
from ftkit.runtime.engine.loader import Runtime, RuntimeOptions

from . import run

NAME = "bench"
SCENARIOS = ("first", "single", "agent", "concurrent")
KEY = "ft-bench"


@dataclass(frozen=True)
class Workload:
    """What to send: prompt lengths, tokens a reply, agent turns and their new tokens (one
    session each), concurrent sessions and the prefix they share."""

    lengths: tuple[int, ...] = (1024, 3000, 8000)
    tokens: int = 64
    turns: int = 4
    suffixes: tuple[int, ...] = (32, 300)
    concurrent: int = 4
    shared: int = 1024
    own: int = 512
    first: int = 512
    scenarios: tuple[str, ...] = SCENARIOS

    @property
    def agent_length(self) -> int:
        """The agent session's first prompt: the longest of `lengths` up to 4096 (an agent's
        system prompt and tools), else the shortest."""
        return max((n for n in self.lengths if n <= 4096), default=min(self.lengths))

    def check_fits(self, context: int, engine: bool) -> None:
        """ValueError naming the option whose prompts (and replies) overrun the model's context,
        of the scenarios that run (and every length where the engine's figures are measured too)."""
        sizes = {"--lengths": max(self.lengths) if engine or "single" in self.scenarios else 0,
                 "--first": self.first if engine or "first" in self.scenarios else 0,
                 "--shared + --own": self.shared + self.own if engine or "concurrent" in self.scenarios else 0,
                 "--turns x --suffixes": self.agent_length + (self.turns - 1) * max(self.suffixes)
                 if "agent" in self.scenarios else 0}
        for option, prompt in sizes.items():
            if prompt and prompt + self.tokens > context:
                raise ValueError(f"{option}: a {prompt}-token prompt and {self.tokens} --tokens overrun this "
                                 f"model's context of {context} tokens")


class Server:
    """`ft-run serve` in its own process on a free loopback port, its output in `log`."""

    def __init__(self, model: Path, opts: RuntimeOptions, serve_args: list[str], log: Path,
                 say: Callable[[str], None], startup_timeout: float = 1800.0):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        argv = [sys.executable, "-m", "ftkit.runtime.cli", "serve", "-m", str(model), "--port", str(self.port),
                "--served-model-name", NAME, "--api-key", KEY, *runtime_argv(opts), *serve_args]
        self.log, self.out = log, log.open("w")
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(argv, stdout=self.out, stderr=subprocess.STDOUT,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})
        while not self._healthy():
            if self.proc.poll() is not None:
                self.stop()
                raise ValueError(f"ft-run serve exited ({self.proc.returncode}): {self.tail()}")
            if time.perf_counter() - t0 > startup_timeout:
                self.stop()
                raise ValueError(f"ft-run serve did not answer within {startup_timeout:.0f} s: {self.tail()}")
            time.sleep(0.2)
        self.startup_seconds = time.perf_counter() - t0
        say(f"server up in {self.startup_seconds:.1f} s: {self.tail()}")

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def tail(self) -> str:
        lines = [line for line in self.log.read_text(errors="replace").splitlines() if line.strip()]
        return lines[-1] if lines else "(no output)"

    def stats(self) -> dict:
        req = urllib.request.Request(self.url + "/v1/stats", headers={"authorization": f"Bearer {KEY}"})
        with urllib.request.urlopen(req, timeout=30) as r:
            return json.loads(r.read())

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.out.close()


def stream(client, ids: list[int], tokens: int, seed: int) -> dict:
    """One streamed completion: TTFT, decode tok/s after the first token, cached prompt tokens.
    A refused or failed request is a ValueError with the server's answer."""
    import openai

    try:
        return _stream(client, ids, tokens, seed)
    except openai.APIStatusError as e:
        raise ValueError(f"a {len(ids)}-token request: the server answered {e.status_code}: {e.message}") from e
    except openai.APIError as e:
        raise ValueError(f"a {len(ids)}-token request failed: {e}") from e


def _stream(client, ids: list[int], tokens: int, seed: int) -> dict:
    t0 = time.perf_counter()
    times, usage = [], None
    # The ids go in extra_body: the SDK's `prompt` parameter walks a token list element by element
    # in Python (`maybe_transform`), 1.6 s for 8000 ids on the dev box, which is the client's time,
    # not the server's; the request on the wire is the same.
    for chunk in client.completions.create(model=NAME, prompt="", max_tokens=tokens, stream=True, temperature=1.0,
                                           seed=seed, stream_options={"include_usage": True},
                                           extra_body={"ignore_eos": True, "prompt": ids}):
        if chunk.choices and chunk.choices[0].finish_reason is None:  # a token (the last chunk ends it)
            times.append(time.perf_counter())
        if chunk.usage is not None:
            usage = chunk.usage
    if not times or usage is None:
        raise ValueError(f"the server streamed {len(times)} tokens and {'no' if usage is None else 'a'} usage")
    details = usage.prompt_tokens_details
    return {"prompt": len(ids), "cached": details.cached_tokens if details else 0, "tokens": len(times),
            "ttft_s": times[0] - t0, "first_at": times[0], "last_at": times[-1], "times": times,
            "decode_tok_s": (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 else None}


class Driver:
    """The scenarios against one server; every request also gets the server's own account of it
    (queue, resume, prefill, insert seconds from /v1/stats)."""

    def __init__(self, server: Server, vocab: int, seed: int = 0):
        import openai

        self.server = server
        self.client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=1800)
        gc.collect()  # the client's own full collections (torch's objects) would land inside a timed request
        gc.freeze()
        self.gen = torch.Generator().manual_seed(seed)
        self.vocab, self.seed = vocab, seed

    def ids(self, n: int) -> list[int]:
        return torch.randint(0, self.vocab, (n,), generator=self.gen).tolist()

    def one(self, ids: list[int], tokens: int) -> dict:
        self.seed += 1
        out = stream(self.client, ids, tokens, self.seed)
        out.pop("times")
        stats = self.server.stats()
        out["server"] = _server_side(stats["requests"]["recent"][-1])
        out["counts"] = {k: stats["requests"][k] for k in ("decode_forwards", "decode_batched_tokens", "replies_cached")}
        out["experts"] = stats["experts"]
        return out

    def first(self, work: Workload) -> list[dict]:
        return [self.one(self.ids(work.first), work.tokens) for _ in range(2)]

    def single(self, work: Workload) -> list[dict]:
        return [self.one(self.ids(n), work.tokens) for n in work.lengths]

    def agent(self, work: Workload, suffix: int) -> list[dict]:
        prompt, turns = self.ids(work.agent_length), []
        for _ in range(work.turns):
            turns.append(self.one(prompt, work.tokens))
            prompt = prompt + self.ids(suffix)
        return turns

    def concurrent(self, work: Workload) -> dict:
        shared = self.ids(work.shared)
        prompts = [shared + self.ids(work.own) for _ in range(work.concurrent + 2)]
        # untimed: a concurrent-only run starts with a cold expert cache, which made its lone
        # stream 10-20% slower than the streams after it found the cache (BV, H100 host)
        self.one(prompts[0], work.tokens)
        alone = self.one(prompts[1], work.tokens)
        results: dict[int, dict] = {}
        start = threading.Barrier(work.concurrent)
        before = self.server.stats()["requests"]

        def go(i: int) -> None:
            start.wait()
            try:
                results[i] = stream(self.client, prompts[i + 2], work.tokens, 10_000 + i)
            except Exception as e:  # reported below, not lost in a thread
                results[i] = {"error": f"{type(e).__name__}: {e}"}

        threads = [threading.Thread(target=go, args=(i,)) for i in range(work.concurrent)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        streams = [results[i] for i in range(work.concurrent)]
        if errors := [s["error"] for s in streams if "error" in s]:
            raise ValueError(f"a concurrent stream failed: {errors[0]}")
        begin, end = min(s["first_at"] for s in streams), max(s["last_at"] for s in streams)
        decoded = sum(s["tokens"] - 1 for s in streams)
        # While every stream decodes (from the last first token to the first last one): the
        # batched rate itself, without the later prompts' prefill or the last stream's tail.
        lo, hi = max(s["first_at"] for s in streams), min(s["last_at"] for s in streams)
        times = [t for s in streams for t in s.pop("times")]
        overlap = sum(lo < t <= hi for t in times) / (hi - lo) if hi > lo else None
        after = self.server.stats()["requests"]  # the streams' own counts: what changed while they ran
        counts = {k: after[k] - before[k] for k in ("prefill_forwards", "decode_forwards", "decode_batched_tokens",
                                                    "decode_batches", "decode_batch_tokens", "decode_batch_seconds")}
        # the batched steps' own rate: without the scheduler's passes in turns (a lone burst each)
        batched = counts["decode_batch_tokens"] / counts["decode_batch_seconds"] if counts["decode_batch_seconds"] else None
        return {"alone": alone, "streams": streams, "aggregate_tok_s": decoded / (end - begin), "overlap_tok_s": overlap,
                "batched_tok_s": batched, "ttft_s": [s["ttft_s"] for s in streams], **counts}


def _server_side(recent: dict) -> dict:
    keys = ("queue_seconds", "resume_seconds", "prefill_seconds", "insert_seconds", "ttft_seconds", "cached_tokens",
            "decode_tok_s")
    return {k: recent.get(k) for k in keys}


def uncached(result: dict, work: Workload) -> dict[int, int]:
    """Per suffix, the tokens the agent's turns after a hit computed, as the server counted them:
    the suffix and the part of the last prompt past the prefix cache's last page boundary (3000
    + 32: 2992 cached, 40 computed). Where several, the median; the suffix where none ran."""
    out = {}
    for s in work.suffixes:
        counts = [t["prompt"] - t["cached"] for t in result.get("agent", {}).get(s, [])[1:]]
        out[s] = statistics.median_low(counts) if counts else s
    return out


def engine(model: Path, opts: RuntimeOptions, work: Workload, figures: Callable[[Runtime], run.Figures],
           extends: dict[int, int] | None = None) -> dict:
    """The engine's own figures for the same work: each prompt length's warm prefill (as ft-run
    runs it), an extend behind the agent's prompt for each suffix (of `extends[suffix]` tokens:
    what the server's turns computed, `uncached`), and batch-1 decode at that context."""
    longest = max(work.lengths) + work.turns * max(work.suffixes) + 2 * work.tokens + 64
    rt = Runtime(model, replace(opts, kv_tokens=max(opts.kv_tokens, longest)))
    try:
        figs = figures(rt)
        out: dict = {"extend_s": {}, "extend_tokens": {}}
        for n in sorted({*work.lengths, work.shared + work.own, work.first}):
            pre = run.prefill(rt, n, figs, repeat=3)
            dec = run.decode(rt, work.tokens, n, None, figs)
            out[n] = {"prefill_s": pre["seconds"], "prefill_tok_s": pre["tok_s"], "decode_tok_s": dec["tok_s"],
                      "decode_bound_tok_s": dec["bound_tok_s"]}
        if "concurrent" in work.scenarios:  # the streams' decode as one batched step each token
            out["batch"] = run.decode_batch(rt, work.tokens, work.shared + work.own, work.concurrent, figs)
        for s in work.suffixes:  # behind the agent's first prompt
            n = (extends or {}).get(s, s)
            out["extend_s"][s] = run.prefill(rt, work.agent_length, figs, extend=n, answer=32, repeat=3)["extend_seconds"]
            out["extend_tokens"][s] = n
        return out
    finally:
        rt.close()


def measure(model: Path, opts: RuntimeOptions, serve_args: list[str], work: Workload, log: Path,
            figures: Callable[[Runtime], run.Figures] | None, say: Callable[[str], None] = print) -> dict:
    """Every scenario through the server, then (with `figures`) the engine's figures."""
    from ftkit.runtime.ftw.reader import FTWModel

    spec = FTWModel(model).spec
    work.check_fits(spec.max_position_embeddings, figures is not None)
    vocab = spec.vocab_size
    server = Server(model, opts, serve_args, log, say)
    try:
        d = Driver(server, vocab)
        out = {"startup_s": server.startup_seconds}
        if "first" in work.scenarios:
            out["first"] = d.first(work)
            say(f"first request: TTFT {out['first'][0]['ttft_s']:.2f} s, then {out['first'][1]['ttft_s']:.2f} s")
        if "single" in work.scenarios:
            out["single"] = d.single(work)
        if "agent" in work.scenarios:
            out["agent"] = {s: d.agent(work, s) for s in work.suffixes}
        if "concurrent" in work.scenarios:
            out["concurrent"] = d.concurrent(work)
        out["stats"] = server.stats()
    finally:
        server.stop()
    if figures is not None:
        say("engine figures (the same work in this process)")
        out["engine"] = engine(model, opts, work, figures, uncached(out, work))
    return out


def rows(result: dict, work: Workload) -> list[tuple[str, str, str, str]]:
    """(what, through the server, the engine's figure, server / engine) for the table."""
    eng = result.get("engine", {})

    def pair(label: str, server: float | None, engine_: float | None, unit: str, fmt: str = "{:.3f}"):
        ratio = f"{server / engine_:.2f}x" if server and engine_ else "-"
        return (label, (fmt.format(server) + unit) if server is not None else "-",
                (fmt.format(engine_) + unit) if engine_ is not None else "-", ratio)

    out = []
    if "first" in result:
        f0, f1 = result["first"]
        out.append(pair(f"first request TTFT ({work.first} tok; beside: the next)", f0["ttft_s"], f1["ttft_s"], " s"))
    for r in result.get("single", []):
        e = eng.get(r["prompt"], {})
        out.append(pair(f"{r['prompt']} tok prompt TTFT", r["ttft_s"], e.get("prefill_s"), " s"))
        # from the request's submission to the scheduler to its first token handed out: the
        # client's and HTTP's time left out (30-66 ms of a 1.5k-3k-token prompt's TTFT, BM)
        out.append(pair(f"{r['prompt']} tok prompt TTFT, the scheduler's account", r["server"]["ttft_seconds"],
                        e.get("prefill_s"), " s"))
        out.append(pair(f"{r['prompt']} tok prompt decode", r["decode_tok_s"], e.get("decode_tok_s"), " tok/s", "{:.1f}"))
    e = eng.get(work.agent_length, {})
    for s, session in result.get("agent", {}).items():
        for k, r in enumerate(session, 1):
            label = f"+{s} turn {k} ({r['cached']}/{r['prompt']} cached)"
            ref = eng.get("extend_s", {}).get(s) if k > 1 else e.get("prefill_s")
            n = eng.get("extend_tokens", {}).get(s)
            out.append(pair(label + " TTFT" + (f" (beside: a {n}-token extend)" if k > 1 and n else ""),
                            r["ttft_s"], ref, " s"))
            out.append(pair(label + " decode", r["decode_tok_s"], e.get("decode_tok_s"), " tok/s", "{:.1f}"))
    if "concurrent" not in result:
        return out
    c = result["concurrent"]
    e = eng.get(work.shared + work.own, {})
    alone = c["alone"]["decode_tok_s"]
    out.append(pair("one stream alone, decode", alone, e.get("decode_tok_s"), " tok/s", "{:.1f}"))
    out.append(pair(f"{work.concurrent} streams together (beside: alone)", c["aggregate_tok_s"], alone,
                    " tok/s", "{:.1f}"))
    out.append(pair(f"{work.concurrent} streams while all decode (beside: the engine's batched steps)",
                    c.get("overlap_tok_s"), eng.get("batch", {}).get("tok_s"), " tok/s", "{:.1f}"))
    out.append(pair(f"{work.concurrent} streams' batched steps (beside: alone)", c.get("batched_tok_s"), alone,
                    " tok/s", "{:.1f}"))
    # what batching can win at this routing: the bound of the engine's batched steps (the
    # distinct experts they touched) over one stream's
    out.append(pair(f"{work.concurrent} streams' bound (beside: one stream's)", eng.get("batch", {}).get("bound_tok_s"),
                    e.get("decode_bound_tok_s"), " tok/s", "{:.1f}"))
    per = statistics.median(s["decode_tok_s"] for s in c["streams"] if s["decode_tok_s"])
    out.append(pair(f"{work.concurrent} streams, each (median)", per, alone, " tok/s", "{:.1f}"))
    out.append(pair(f"{work.concurrent} streams, worst TTFT (beside: alone)", max(c["ttft_s"]),
                    c["alone"]["ttft_s"], " s"))
    return out
