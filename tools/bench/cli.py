"""ft-bench: write a synthetic model at realistic shapes, measure decode and prefill beside bounds."""

from __future__ import annotations

import dataclasses
import json
import platform
import subprocess
import sys
from pathlib import Path
from typing import Annotated

import torch
import typer
from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TransferSpeedColumn
from rich.table import Table

from ftkit import __version__
from ftkit.errors import InputError
from ftkit.runtime.checkpoint.quant_presets import PRESETS as QUANT_PRESETS
from ftkit.runtime.checkpoint.quant_presets import expert_formats
from ftkit.runtime.cli import PREFIX_FLAGS, SERVE_FLAGS, runtime_flags
from ftkit.runtime.console import Version, err_console, guarded, listed
from ftkit.runtime.engine.loader import Runtime, RuntimeOptions
from ftkit.runtime.engine.sampling import Sampler, SamplingParams
from ftkit.runtime.ftw.manifest import write_json_atomic
from ftkit.runtime.profile import cache_dir
from ftkit.runtime.random_model import preset_dense_formats, write_random_ftw, write_random_gguf
from ftkit.vocab import expert_layout, human_bytes

from . import agent_trace, hostmem, run, soak
from . import serve as serve_bench
from . import sweep as sweep_bench
from .presets import PRESETS, preset_spec
from .routing import Recorder, Replayer, RoutingOverride, Synthetic

console = Console()
app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_show_locals=False,
                  help="Reproducible benchmarks of ftkit's runtime.")


@app.callback()
def _root(version: Version = False) -> None:
    pass


PIPE_WIDTH = 1000  # columns a table may take when printed to a pipe or a file


def show(table: Table) -> None:
    """A table at its natural width where stdout is not a terminal (rich would fold it to 80
    columns there), so a log keeps every column whole."""
    (console if console.is_terminal else Console(width=PIPE_WIDTH, stderr=console.stderr)).print(table)


# --json and --out as every ftkit tool has them: a flag for one JSON object on stdout (the tables
# and progress lines then go to stderr), a path for a file
JsonFlag = Annotated[bool, typer.Option("--json", help="print the results as one JSON object on stdout "
                                                       "(tables and progress on stderr)")]
JsonOut = Annotated[Path | None, typer.Option("--out", "-o", help="also write the results as JSON to this file")]


def to_stderr(as_json: bool) -> None:
    """With --json, stdout carries the JSON alone."""
    console.stderr = as_json


def report(results: dict, as_json: bool, out: Path | None) -> None:
    """The results as --json and --out ask (the file written atomically)."""
    results = json.loads(json.dumps(results, default=str))
    if out is not None:
        write_json_atomic(out, results)
    if as_json:
        print(json.dumps(results, indent=1))


@app.command()
def write(
    out: Annotated[Path, typer.Option("--out", "-o", help="FTW directory to write")],
    preset: Annotated[str, typer.Option(help=f"one of {', '.join(PRESETS)}")] = "qwen3-30b-a3b",
    layers: Annotated[int | None, typer.Option(help="keep the first N layers (fit the disk)")] = None,
    dtype: Annotated[str, typer.Option(help="expert and dense dtype: bfloat16, float16, float32 (q8_0: experts only)")] = "bfloat16",
    distinct_experts: Annotated[int, typer.Option(help="random experts drawn, then cycled")] = 64,
    quant: Annotated[str | None, typer.Option(
        help=f"experts (and a qwen3_moe's attention, embedding and lm_head) in GGUF blocks, laid out as "
             f"llama-quantize's preset lays them: {', '.join(QUANT_PRESETS)}"
    )] = None,
    gguf: Annotated[bool, typer.Option(
        help="write OUT as one GGUF file instead (bfloat16 or float32, a generated vocabulary), as llama.cpp's "
             "converter would: what llama-quantize quantizes and llama.cpp runs beside ftkit"
    )] = False,
    force: Annotated[bool, typer.Option(help="replace OUT if it exists")] = False,
) -> None:
    """Write a random-weight FTW at a preset's shapes (its experts quantized with --quant), or a
    GGUF file of it (--gguf)."""

    def body() -> None:
        spec = preset_spec(preset, layers)
        if gguf:
            if quant:
                raise InputError("--gguf writes floats; quantize the file with llama-quantize")
            with console.status(f"writing {out}"):
                write_random_gguf(out, spec, force=force, dtype=dtype, vocab=True, distinct_experts=distinct_experts)
            console.print(f"wrote {out}: {spec.num_layers} layers x {spec.num_experts} experts ({preset}), {dtype}, "
                          f"{human_bytes(out.stat().st_size)}")
            return
        formats = expert_formats(spec, quant) if quant else None
        layout = expert_layout(spec, formats or dtype)
        with Progress("writing", BarColumn(), DownloadColumn(), TransferSpeedColumn(), console=console) as bar:
            task = bar.add_task("", total=spec.num_expert_rows * layout.slot_bytes)
            write_random_ftw(out, spec, dtype, force=force, distinct_experts=distinct_experts,
                             on_bytes=lambda n: bar.advance(task, n), expert_formats=formats,
                             dense_formats=preset_dense_formats(spec, quant) if quant else None)
        console.print(f"wrote {out}: {spec.num_layers} layers x {spec.num_experts} experts ({preset}), "
                      f"experts {layout.describe()}, {human_bytes(spec.num_expert_rows * layout.slot_bytes)}")

    guarded(body)


def _figures(rt: Runtime, pcie: float | None, cpu: float | None) -> run.Figures:
    """The bound's bandwidths: those given, else the runtime's profile's (--profile, or the one
    ft-calibrate wrote for this GPU)."""
    pcie_solo, cpu_solo = pcie, cpu
    if (profile := rt.resolved.profile) is not None:
        threads = rt.store.cpu.threads
        both, alone = profile.bandwidths(threads), profile.bandwidths(threads, overlapped=False)
        pcie, cpu = pcie or both.pcie_gbps, cpu or both.cpu_gbps
        pcie_solo, cpu_solo = pcie_solo or alone.pcie_gbps, cpu_solo or alone.cpu_gbps
    return run.Figures(pcie, cpu, run.hbm_gbps(rt.device), pcie_solo, cpu_solo)


def _routing(rt: Runtime, routing: str, tokens: int) -> RoutingOverride | None:
    """`tokens`: how many tokens the run routes (a synthetic sequence is drawn that long)."""
    kind, _, arg = routing.partition(":")
    if kind == "real":
        return None
    if kind == "trace":
        return Replayer(rt.decoder, Path(arg))
    if kind == "reuse":
        return Synthetic(rt.decoder, float(arg), tokens)
    raise ValueError(f"--routing must be real, trace:FILE or reuse:P, got {routing!r}")


def _machine() -> dict:

    out = {"cpu": platform.processor() or platform.machine(), "python": platform.python_version(),
           "torch": torch.__version__, "ftkit": __version__}
    try:
        out["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                       text=True, cwd=Path(__file__).parent).stdout.strip()
    except OSError:
        pass
    if torch.cuda.is_available():
        out["gpu"] = torch.cuda.get_device_name()
    return out


@app.command()
@runtime_flags(without=("strategy", "no_graphs"))
def decode(
    model: Annotated[Path, typer.Option("--model", "-m", help="FTW directory (e.g. from ft-bench write)")],
    strategies: Annotated[str, typer.Option(help="comma-separated strategies")] = "offload,cpu,hybrid",
    cache_fraction: Annotated[float | None, typer.Option(help="cacheable share of the expert pool")] = None,
    tokens: Annotated[int, typer.Option(help="decode steps timed per strategy")] = 64,
    prompt: Annotated[int, typer.Option(help="prompt tokens prefilled before the timed decode")] = 16,
    chunks: Annotated[str, typer.Option(help="prompts to prefill and time, in tokens, e.g. 4096,8192 ('' = none)")] = "",
    routing: Annotated[str, typer.Option(help="real | reuse:P | trace:FILE")] = "real",
    record: Annotated[Path | None, typer.Option(help="save the real routing of the run")] = None,
    pcie_gbps: Annotated[float | None, typer.Option(help="B_P for the bounds, GB/s (default: the profile's)")] = None,
    cpu_gbps: Annotated[float | None, typer.Option(help="B_H for the bounds, GB/s (default: the profile's)")] = None,
    as_json: JsonFlag = False,
    out: JsonOut = None,
    trace_dir: Annotated[Path | None, typer.Option(help="write a torch.profiler table per strategy")] = None,
    graphs: Annotated[str, typer.Option(help="CUDA graph decode: on | off | both (A/B rows)")] = "on",
    stream_prefill: Annotated[str, typer.Option(help="prefill layer double buffering: auto | on | off")] = "auto",
    extend: Annotated[int, typer.Option(help="after each prefill chunk and its answer, time this many more "
                                        "tokens (the next agent turn after a prefix hit)")] = 0,
    answer: Annotated[int, typer.Option(help="decode steps before each timed chunk and between it and its "
                                        "extend (a turn's reply)")] = 32,
    temperature: Annotated[float, typer.Option(help="timed decode steps sample at this temperature (0: argmax)")] = 0.0,
    top_p: Annotated[float, typer.Option(help="with --temperature: the top-p cut")] = 1.0,
    repeat: Annotated[int, typer.Option(help="timed prefill turns (answer, chunk, answer, extend) per chunk "
                                        "size: medians reported")] = 1,
    anchors_every: Annotated[int, typer.Option(help="--chunks prompts snapshot their recurrent state every this "
                                               "many tokens, as a hybrid model's turn boundaries do (0: none)")] = 0,
    batch: Annotated[int, typer.Option(help="also time this many sequences decoding together in batched steps, "
                                       "as concurrent requests in ft-run serve (1: none)")] = 1,
    opts: RuntimeOptions = None,
) -> None:
    """Decode tok/s (batch 1, and with --batch of several sequences together) and prefill per
    strategy, each beside its bound (ft-run's runtime flags but --strategy and --no-graphs,
    which --strategies and --graphs sweep)."""
    if graphs not in ("on", "off", "both"):
        raise typer.BadParameter("--graphs takes on, off or both")
    if stream_prefill not in ("auto", "on", "off"):
        raise typer.BadParameter("--stream-prefill takes auto, on or off")
    if repeat < 1:
        raise typer.BadParameter("--repeat takes 1 or more")
    if anchors_every < 0:
        raise typer.BadParameter("--anchors-every takes 0 (none) or a token count")
    if batch < 1:
        raise typer.BadParameter("--batch takes 1 (none) or a number of sequences")
    if batch > 1 and (routing != "real" or record):
        raise typer.BadParameter("--batch times real routing only (the overrides route one token a step)")
    modes = {"on": [True], "off": [False], "both": [False, True]}[graphs]
    if (routing.startswith("trace:") or record) and True in modes:
        # recording and replaying go through host lists; a captured graph would freeze its first answer
        print("ft-bench: recorded and replayed routing run without CUDA graphs", file=sys.stderr)
        modes = [False]

    def body() -> None:
        to_stderr(as_json)
        results = {"machine": _machine(), "model": str(model), "runs": []}
        if trace_dir:
            trace_dir.mkdir(parents=True, exist_ok=True)
        table = Table(title=f"ft-bench decode: {model}")
        for col in ("strategy", "graphs", "cache slots", "tok/s", "bound tok/s", "of bound", "overhead ms/tok",
                    "miss rate", *([f"batch {batch} tok/s (ms/step)"] if batch > 1 else []), "prefill"):
            table.add_column(col, justify="right")
        longest = max([run.decode_length(prompt, tokens)]
                      + [run.prefill_length(int(c), answer, extend) for c in chunks.split(",") if c])
        sized = _sized(opts, model, cache_fraction, longest)
        try:
            each_run(results, table, sized, strategies, modes)
        finally:  # a strategy that cannot run (hybrid without a ratio) still shows the ones that ran
            if results["runs"]:
                show(table)
                report(results, as_json, out)

    def each_run(results: dict, table: Table, sized: RuntimeOptions, strategies: str, modes: list[bool]) -> None:
        for strategy, graphs_on in ((s, g) for s in strategies.split(",") for g in modes):
            rt = Runtime(model, dataclasses.replace(
                sized, strategy=strategy, graphs=graphs_on, stream_prefill={"on": True, "off": False}.get(stream_prefill),
                bandwidth_ratio=sized.bandwidth_ratio or _ratio(pcie_gbps, cpu_gbps, sized.profile, strategy)))
            try:
                figs = _figures(rt, pcie_gbps, cpu_gbps)
                routed = prompt + tokens + 8 + sum(2 * (int(c) + extend + answer) + 1 for c in chunks.split(",") if c)
                override = Recorder(rt.decoder) if record else _routing(rt, routing, routed)
                trace = trace_dir / f"profile-{rt.store.strategy}-graphs-{'on' if graphs_on else 'off'}.txt" if trace_dir else None
                sampler = Sampler(SamplingParams(temperature=temperature, top_p=top_p, seed=0)) if temperature else None
                r = run.decode(rt, tokens, prompt, override, figs, trace, sampler=sampler)
                if record:
                    override.save(record)
                together = run.decode_batch(rt, tokens, prompt, batch, figs, trace.with_name(
                    f"profile-{rt.store.strategy}-batch{batch}.txt") if trace else None) if batch > 1 else None
                pre = [run.prefill(rt, int(c), figs, trace_dir / f"prefill-{c}-{rt.store.strategy}.txt"
                                   if trace_dir else None, extend, answer, repeat, anchors_every)
                       for c in chunks.split(",") if c]
                results["runs"].append({"strategy": rt.store.strategy, "cache_slots": rt.store.cache.capacity,
                                        "threads": rt.store.cpu.threads, "routing": routing,
                                        "figures": vars(figs), "decode": r, "decode_batch": together, "prefill": pre,
                                        "host_pool": hostmem.pool_pages(rt.store.pool.banks.buffers)})
                table.add_row(rt.store.strategy, "on" if r["graphs"] else "off", str(rt.store.cache.capacity),
                              f"{r['tok_s']:.1f}", _fmt(r["bound_tok_s"]), _of_bound(r),
                              _fmt(r["overhead_ms_per_token"]), f"{r['miss_rate']:.1%}",
                              *([_batch_cell(together)] if together else []), " ".join(_prefill_cell(p) for p in pre))
            finally:
                rt.close()

    guarded(body)


@app.command("serve")
@runtime_flags(PREFIX_FLAGS, SERVE_FLAGS)
def serve_cmd(
    model: Annotated[Path, typer.Option("--model", "-m", help="FTW directory to serve")],
    lengths: Annotated[str, typer.Option(help="single-stream prompt lengths in tokens")] = "1024,3000,8000",
    tokens: Annotated[int, typer.Option(help="tokens each reply decodes")] = 64,
    turns: Annotated[int, typer.Option(help="turns of the agent session")] = 4,
    suffixes: Annotated[str, typer.Option(help="new tokens each agent turn adds (reply and tool result); "
                                          "a session for each")] = "32,300",
    concurrent: Annotated[int, typer.Option(help="streams started at once")] = 4,
    shared: Annotated[int, typer.Option(help="prompt tokens the concurrent streams share")] = 1024,
    own: Annotated[int, typer.Option(help="prompt tokens of each concurrent stream's own")] = 512,
    first: Annotated[int, typer.Option(help="prompt tokens of the first request after start-up")] = 512,
    scenarios: Annotated[str, typer.Option(help=f"which to run, of {','.join(serve_bench.SCENARIOS)}")] = ",".join(
        serve_bench.SCENARIOS),
    max_running: Annotated[int, typer.Option(help="ft-run serve --max-running")] = 4,
    kv_tokens: Annotated[int | None, typer.Option(help="ft-run serve --kv-tokens (default: its own)")] = None,
    engine: Annotated[bool, typer.Option(help="also measure the engine's own figures for the same work")] = True,
    pcie_gbps: Annotated[float | None, typer.Option(help="B_P for the bounds, GB/s (default: the profile's)")] = None,
    cpu_gbps: Annotated[float | None, typer.Option(help="B_H for the bounds, GB/s (default: the profile's)")] = None,
    log: Annotated[Path, typer.Option(help="the server's output")] = Path("ft-bench-serve.log"),
    as_json: JsonFlag = False,
    out: JsonOut = None,
    opts: RuntimeOptions = None,
) -> None:
    """Drive the real `ft-run serve` with the official openai SDK (first request, prompt lengths,
    an agent session, concurrent streams), each figure beside the engine's own for the same work."""

    def body() -> None:
        to_stderr(as_json)
        work = serve_bench.Workload(tuple(int(n) for n in lengths.split(",") if n), tokens, turns,
                                tuple(int(n) for n in suffixes.split(",") if n), concurrent, shared, own, first,
                                tuple(n for n in scenarios.split(",") if n))
        if unknown := set(work.scenarios) - set(serve_bench.SCENARIOS):
            raise ValueError(f"--scenarios: unknown {', '.join(sorted(unknown))} (of {', '.join(serve_bench.SCENARIOS)})")
        if not work.lengths or min(work.lengths) < 2 or not work.suffixes or min(
                tokens, turns, *work.suffixes, concurrent, first) < 1:
            raise ValueError("lengths need 2 or more tokens; tokens, turns, suffixes, concurrent and first 1 or more")
        serve_args = ["--max-running", str(max_running)] + (["--kv-tokens", str(kv_tokens)] if kv_tokens else [])
        figures = (lambda rt: _figures(rt, pcie_gbps, cpu_gbps)) if engine else None
        result = serve_bench.measure(model, opts, serve_args, work, log, figures,
                                     say=lambda line: console.print(line, markup=False, highlight=False))
        table = Table(title=f"ft-bench serve: {model}")
        for col in ("what", "through the server", "the engine", "server / engine"):
            table.add_column(col, justify="right")
        for row in serve_bench.rows(result, work):
            table.add_row(*row)
        show(table)
        report({"machine": _machine(), "model": str(model), "workload": dataclasses.asdict(work),
                "options": {k: str(v) for k, v in vars(opts).items()}, "serve_args": serve_args, **result}, as_json, out)

    guarded(body)


@app.command("soak")
@runtime_flags(PREFIX_FLAGS, SERVE_FLAGS)
def soak_cmd(
    model: Annotated[Path | None, typer.Option("--model", "-m", help="start ft-run serve for this FTW")] = None,
    url: Annotated[str | None, typer.Option(help="or soak a running server (its RSS with --pid)")] = None,
    api_key: Annotated[str | None, typer.Option(envvar="FTKIT_API_KEY", help="with --url: its key")] = None,
    pid: Annotated[int | None, typer.Option(help="with --url: the server's process, for its RSS")] = None,
    minutes: Annotated[float, typer.Option(help="how long the sessions run")] = soak.Workload.minutes,
    sessions: Annotated[int, typer.Option(help="concurrent agent sessions (half OpenAI, half Anthropic)")] = soak.Workload.sessions,
    turns: Annotated[int | None, typer.Option(help="at most this many turns a session (default: until the time is up)")] = None,
    max_tokens: Annotated[int, typer.Option(help="tokens a reply decodes at most")] = soak.Workload.max_tokens,
    disconnect: Annotated[float, typer.Option(help="share of the streamed turns the client drops mid-stream")] = soak.Workload.disconnect,
    rebuild_every: Annotated[int, typer.Option(help="completed requests between expert-cache rebuilds (0: none)")] = soak.Workload.rebuild_every,
    replay: Annotated[int, typer.Option(help="completed requests sent again alone at the end and compared")] = soak.Workload.replay,
    seed: Annotated[int, typer.Option(help="seed of the sessions' scripts")] = soak.Workload.seed,
    max_running: Annotated[int, typer.Option(help="ft-run serve --max-running")] = 4,
    log: Annotated[Path, typer.Option(help="the server's output")] = Path("ft-bench-soak.log"),
    as_json: JsonFlag = False,
    out: JsonOut = None,
    opts: RuntimeOptions = None,
) -> None:
    """Agent-style sessions against ft-run serve (multi-turn, tools, streaming, clients that drop
    streams, cache rebuilds) through the openai and anthropic SDKs: requests lost, 5xx, the
    server's RSS at start and end, greedy replies under load against the same requests alone."""

    def body() -> None:
        to_stderr(as_json)
        if (model is None) == (url is None):
            raise ValueError("give --model (a server is started) or --url (a running one)")
        if min(minutes, sessions, max_tokens) <= 0 or not 0 <= disconnect <= 1 or min(rebuild_every, replay) < 0:
            raise ValueError("minutes, sessions and max-tokens must be positive, disconnect 0..1, "
                             "rebuild-every and replay 0 or more")
        work = soak.Workload(sessions, minutes, turns, max_tokens, disconnect, rebuild_every, replay, seed)
        say = lambda line: console.print(line, markup=False, highlight=False)  # noqa: E731
        if model is not None:
            result = soak.measure(model, opts, ["--max-running", str(max_running)], work, log, say)
        else:
            result = soak.soak(url.rstrip("/"), api_key, work, pid, say)
        table = Table(title=f"ft-bench soak: {model or url}")
        table.add_column("what")
        table.add_column("figure", justify="right")
        for row in soak.rows(result):
            table.add_row(*row)
        show(table)
        for d in result["replay"]["differ"]:
            console.print(f"differs alone ({d['api']}): {d['under_load']!r} under load, {d['alone']!r} alone",
                          markup=False, highlight=False)
        report({"machine": _machine(), **result}, as_json, out)

    guarded(body)


@app.command("agent-trace")
def agent_trace_cmd(
    model: Annotated[str, typer.Option(help="next (a tiny Qwen3-Next: hybrid attention) or demo (the built-in Qwen3-MoE)")] = "next",
    out: Annotated[Path | None, typer.Option(help="where the random-weight model is written (reused if there; "
                                                 "default: ~/.cache/ftkit/agent-trace/MODEL.ftw)")] = None,
    turns: Annotated[int, typer.Option(help="turns of each scripted session")] = 8,
    harness: Annotated[list[str] | None, typer.Option(help="openclaw, opencode, sweagent (repeatable; default all)")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print the rows and summary as JSON")] = False,
) -> None:
    """Replay scripted agent sessions (three harness styles) with anchors on, anchors off and no
    prefix cache: per turn prompt, changed, reused and recomputed tokens, TTFT and the ideal TTFT."""

    def body() -> None:
        if model not in ("next", "demo"):
            raise ValueError("--model must be next or demo")
        path = agent_trace.write_model(model, out or cache_dir() / "agent-trace" / f"{model}.ftw")
        rows = agent_trace.run(path, tuple(harness or agent_trace.HARNESSES), turns,
                               progress=lambda line: err_console.print(f"ft-bench: {line}", highlight=False))
        if as_json:
            print(json.dumps({"machine": _machine(), "model": model, "rows": agent_trace.as_dicts(rows),
                              "summary": agent_trace.summary(rows)}, indent=1))
            return
        print(agent_trace.table(rows))
        print(json.dumps(agent_trace.summary(rows), indent=1))

    guarded(body)


@app.command()
@runtime_flags(without=("strategy", "cache_experts", "cache_bytes", "gpu_budget"))
def sweep(
    model: Annotated[Path, typer.Option("--model", "-m", help="FTW directory (e.g. from ft-bench write)")],
    strategies: Annotated[str, typer.Option(help="comma-separated strategies")] = "offload,hybrid,cpu",
    fractions: Annotated[str, typer.Option(help="cacheable shares of the expert pool")] = "0.1,0.2,0.35,0.5,0.6",
    threads_sweep: Annotated[str, typer.Option("--thread-counts", help="CPU threads for the CPU-side sweep ('' = none)")] = "",
    thread_strategy: Annotated[str, typer.Option(help="the strategy the thread sweep runs")] = "cpu",
    tokens: Annotated[int, typer.Option(help="decode steps timed at each point")] = 32,
    prompt: Annotated[int, typer.Option(help="prompt tokens prefilled before the timed decode")] = 16,
    chunk: Annotated[int, typer.Option(help="also time a prefill of this many tokens at each point (0: none)")] = 0,
    routing: Annotated[str, typer.Option(help="real | reuse:P (uniform: reuse:0, the headline)")] = "reuse:0",
    pcie_gbps: Annotated[float | None, typer.Option(help="B_P for the bounds, GB/s (default: the profile's)")] = None,
    cpu_gbps: Annotated[float | None, typer.Option(help="B_H for the bounds, GB/s (default: the profile's)")] = None,
    out: Annotated[Path, typer.Option(help="directory for sweep.json and the SVG charts")] = Path("ft-bench-sweep"),
    opts: RuntimeOptions = None,
) -> None:
    """Decode (and prefill with --chunk) for each strategy at each expert-cache fraction, and the
    CPU side at each thread count, beside their bounds: sweep.json and SVG charts of tok/s
    against the cache's device bytes and against threads."""

    def body() -> None:
        shares = [float(f) for f in fractions.split(",") if f]
        counts = [int(t) for t in threads_sweep.split(",") if t]
        if not shares or not all(0 < f <= 1 for f in shares) or any(t < 1 for t in counts):
            raise ValueError("--fractions must be shares in (0, 1], --thread-counts 1 or more")
        if min(tokens, prompt) < 1 or chunk < 0:
            raise ValueError("--tokens and --prompt must be 1 or more, --chunk 0 or more")
        out.mkdir(parents=True, exist_ok=True)
        longest = max(run.decode_length(prompt, tokens), run.prefill_length(chunk, 32, 0) if chunk else 0)
        base = dataclasses.replace(opts, kv_tokens=longest)

        def figures(rt: Runtime) -> run.Figures:
            return _figures(rt, pcie_gbps, cpu_gbps)

        def routed(rt: Runtime, n: int):
            return _routing(rt, routing, n)

        def ratio(s: str) -> RuntimeOptions:
            return dataclasses.replace(base, bandwidth_ratio=base.bandwidth_ratio or _ratio(pcie_gbps, cpu_gbps, base.profile, s))

        say = lambda line: console.print(line, markup=False, highlight=False)  # noqa: E731
        cache = [p for s in strategies.split(",") if s
                 for p in sweep_bench.cache_sweep(model, ratio(s), [s], shares, figures, routed, tokens, prompt, chunk, say)]
        cpu = (sweep_bench.thread_sweep(model, ratio(thread_strategy), thread_strategy, counts, figures, routed,
                                        tokens, prompt, say) if counts else [])
        title = f"{model.name}, routing {routing}"
        (out / "cache.svg").write_text(sweep_bench.cache_chart(cache, title))
        if cpu:
            (out / "threads.svg").write_text(sweep_bench.thread_chart(cpu, title))
        (out / "sweep.json").write_text(json.dumps({"machine": _machine(), "model": str(model), "routing": routing,
                                                    "cache": cache, "threads": cpu}, indent=1))
        table = Table(title=f"ft-bench sweep: {model}")
        for col in ("strategy", "cache", "threads", "tok/s", "bound tok/s", *(["prefill tok/s"] if chunk else [])):
            table.add_column(col, justify="right")
        for p in cache + cpu:
            table.add_row(p["strategy"], f"{p['cache_slots']} ({p['cache_bytes'] / 1e9:.2f} GB)", str(p["threads"]),
                          f"{p['tok_s']:.1f}", _fmt(p["bound_tok_s"]),
                          *([_fmt(p.get("prefill_tok_s"))] if chunk else []))
        show(table)
        console.print(f"wrote {out / 'sweep.json'} and its charts ({out / 'cache.svg'}"
                      + (f", {out / 'threads.svg'})" if cpu else ")"), markup=False, highlight=False)

    guarded(body)


def _ratio(pcie, cpu, profile, strategy) -> float | None:
    if strategy not in ("hybrid", "auto") or profile is not None:
        return None
    return pcie / cpu if pcie and cpu else None


def _sized(opts: RuntimeOptions, model: Path, fraction: float | None, kv_tokens: int) -> RuntimeOptions:
    """Expert cache slots from a pool fraction (else as the runtime flags size them);
    `kv_tokens`: the run's longest sequence (so it decodes through graphs, as a server sized for
    it does)."""
    from ftkit.runtime.ftw.reader import FTWModel

    if fraction is None:
        return dataclasses.replace(opts, kv_tokens=kv_tokens)
    if any(x is not None for x in (opts.cache_experts, opts.cache_bytes, opts.gpu_budget)):
        raise ValueError("give one of --cache-fraction, --cache-experts, --cache-bytes and --gpu-budget")
    rows = FTWModel(model).spec.num_expert_rows
    return dataclasses.replace(opts, kv_tokens=kv_tokens, cache_experts=max(1, int(rows * fraction)))


def _of_bound(r: dict) -> str:
    """Of the profile's bound, and in brackets of the bound at the worker's own faster rate."""
    cell, tight = _pct(r["of_bound"]), r.get("of_bound_at_worker")
    return cell + (f" ({_pct(tight)})" if tight is not None and tight != r["of_bound"] else "")


def _prefill_cell(p: dict) -> str:
    pieces = f"/{p['pieces']}" if p.get("pieces", 1) > 1 else ""  # a prompt run in several pieces a layer
    cell = f"{p['chunk']}{pieces}: {p['seconds']:.3f}s ({_pct(p['of_bound'])})"
    return cell + (f" +{p['extend']}: {p['extend_seconds']:.3f}s" if p.get("extend") else "")


def _batch_cell(b: dict) -> str:
    """tok/s over the batch, ms a step and the share of the bound, marked where the steps ran
    eagerly, not captured."""
    bound = f", {b['of_bound']:.0%} of {b['bound_tok_s']:.0f}" if b["bound_tok_s"] else ""
    return f"{b['tok_s']:.1f} ({b['ms_per_step']:.1f}{bound})" + ("" if b["graphs"] else " eager")


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.0%}"


def main() -> None:
    listed(app)
    app()


if __name__ == "__main__":
    main()
