"""ft-run: generate, chat and the built-in demo, thin over ftkit.runtime.engine."""

from __future__ import annotations

import functools
import inspect
import json
import math
import os
import re
import shlex
import tempfile
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from ftkit.vocab import DENSE_FORMATS, STRATEGIES, human_bytes

from .console import PlainUsage, Version, err_console, fail, guarded, listed, parse_bytes, printable
from .engine.generate import Generation, generate
from .engine.loader import Runtime, RuntimeOptions
from .engine.sampling import SamplingParams
from .server.limits import DEFAULT_MAX_BODY

console = Console()
app = typer.Typer(add_completion=False, pretty_exceptions_show_locals=False, no_args_is_help=True, help="Run an FTW model.")

@app.callback()
def _root(version: Version = False) -> None:
    pass


Model = Annotated[Path, typer.Option("--model", "-m", help="FTW directory (from ftw-convert)")]
Strategy = Annotated[str, typer.Option(help="fused | offload | cpu | hybrid | auto (fused when every expert fits "
                                            "the device; else hybrid with a profile or --bandwidth-ratio; else "
                                            "cpu on the CPU, offload on a GPU)")]
CacheExperts = Annotated[int | None, typer.Option(help="device expert cache size in slots")]
CacheBytes = Annotated[str | None, typer.Option(help="device expert cache size in bytes, e.g. 8G")]
Device = Annotated[str | None, typer.Option(help="cpu or cuda (default: cuda when a GPU is present, else cpu)")]
Threads = Annotated[int | None, typer.Option(help="CPU expert threads (default: cores - 1)")]
Profile = Annotated[Path | None, typer.Option(help="bandwidth profile JSON (default: the one ft-calibrate wrote "
                                                   "for this GPU, if any)")]
NoProfile = Annotated[bool, typer.Option("--no-profile", help="without --profile: leave ft-calibrate's profile "
                                                              "for this GPU unused")]
Ratio = Annotated[float | None, typer.Option(help="B_P / B_H for hybrid without a profile (ft-calibrate's for "
                                                  "this GPU is then not looked up)")]
GpuBudget = Annotated[str | None, typer.Option(help="device bytes for everything ftkit places there, e.g. 8G; the expert cache gets what the rest of the memory plan leaves")]
Verify = Annotated[bool, typer.Option("--verify", help="check every FTW checksum before loading")]
Dtype = Annotated[str | None, typer.Option(help="compute dtype (default: the weights' dtype; GGUF blocks: bfloat16, int8 activations in the CPU kernel; float32: the exact reference)")]
NoPrefix = Annotated[bool, typer.Option("--no-prefix-cache", help="no K/V reuse across requests (A/B runs)")]
NoAnchors = Annotated[bool, typer.Option("--no-anchors", help="hybrid models: save recurrent state at prompt tails only")]
PrefixTokens = Annotated[int | None, typer.Option(help="prefix cache budget in tokens (default: the context)")]
NoGraphs = Annotated[bool, typer.Option("--no-graphs", help="CUDA: decode eagerly, no graphs and no device-side planning (A/B runs)")]
AnchorSlots = Annotated[int, typer.Option(help="recurrent-state anchors kept (hybrid models)")]
PrefillChunk = Annotated[int, typer.Option(help="GPU: prompt tokens a prefill runs through a layer at once (their "
                                                "activations are reserved; each layer's experts cross PCIe once a "
                                                "prompt whatever the size)")]
MaxTokens = Annotated[int, typer.Option(help="tokens to generate at most (at least 1)")]
KvTokens = Annotated[int, typer.Option(help="KV tokens a request may reach (prompt + max tokens); reserved by "
                                            "--gpu-budget; on CUDA the graph decode capacity (longer: eager)")]


# The runtime flags every model-running command takes, once: `runtime_flags` adds them to a
# command's signature and hands the command a RuntimeOptions instead.
RUNTIME_FLAGS: list[tuple[str, object, object]] = [
    ("strategy", Strategy, "auto"), ("cache_experts", CacheExperts, None), ("cache_bytes", CacheBytes, None),
    ("gpu_budget", GpuBudget, None), ("device", Device, None), ("threads", Threads, None),
    ("profile", Profile, None), ("no_profile", NoProfile, False), ("bandwidth_ratio", Ratio, None),
    ("dtype", Dtype, None), ("verify", Verify, False), ("no_graphs", NoGraphs, False),
    ("prefill_chunk", PrefillChunk, RuntimeOptions.prefill_chunk),
]
PREFIX_FLAGS: list[tuple[str, object, object]] = [("no_prefix_cache", NoPrefix, False), ("no_anchors", NoAnchors, False)]
KV_FLAGS: list[tuple[str, object, object]] = [("kv_tokens", KvTokens, RuntimeOptions.kv_tokens)]
SERVE_FLAGS: list[tuple[str, object, object]] = [("prefix_cache_tokens", PrefixTokens, None), ("anchor_slots", AnchorSlots, 32)]
DEFAULTS = {name: default for name, _, default in RUNTIME_FLAGS + PREFIX_FLAGS + KV_FLAGS + SERVE_FLAGS}


def _at_least(f: dict, name: str, low: int) -> None:
    if f[name] is not None and f[name] < low:
        raise ValueError(f"--{name.replace('_', '-')} must be at least {low}, got {f[name]}")


def check_flags(f: dict) -> None:
    """Refuse, in one line naming the accepted values, a runtime flag no command could run with."""
    if f["strategy"] not in STRATEGIES:
        raise ValueError(f"--strategy must be one of {', '.join(STRATEGIES)}, got {f['strategy']!r}")
    if f["dtype"] is not None and f["dtype"] not in DENSE_FORMATS:
        raise ValueError(f"--dtype must be one of {', '.join(DENSE_FORMATS)}, got {f['dtype']!r}")
    if f["device"] is not None and not re.fullmatch(r"cpu|cuda(:\d+)?", f["device"]):
        raise ValueError(f"--device must be cpu, cuda or cuda:N, got {f['device']!r}")
    for name, low in (("cache_experts", 0), ("threads", 1), ("prefill_chunk", 1), ("kv_tokens", 1),
                      ("prefix_cache_tokens", 0), ("anchor_slots", 0)):
        _at_least(f, name, low)
    ratio = f["bandwidth_ratio"]
    if ratio is not None and not (math.isfinite(ratio) and ratio > 0):
        raise ValueError(f"--bandwidth-ratio must be a positive number (B_P / B_H), got {ratio}")


def _to_options(f: dict) -> RuntimeOptions:
    """`f`: a value for every flag of DEFAULTS (a command's own, or the default of one it lacks);
    a bad value is a ValueError of one line."""
    check_flags(f)
    return RuntimeOptions(
        strategy=f["strategy"], cache_experts=f["cache_experts"],
        cache_bytes=parse_bytes(f["cache_bytes"], "--cache-bytes") if f["cache_bytes"] else None,
        gpu_budget=parse_bytes(f["gpu_budget"], "--gpu-budget") if f["gpu_budget"] else None,
        device=f["device"], threads=f["threads"], profile=f["profile"], find_profile=not f["no_profile"],
        bandwidth_ratio=f["bandwidth_ratio"], dtype=f["dtype"], verify=f["verify"],
        prefix_cache=not f["no_prefix_cache"], anchors=not f["no_anchors"],
        prefix_cache_tokens=f["prefix_cache_tokens"], anchor_slots=f["anchor_slots"], graphs=not f["no_graphs"],
        kv_tokens=f["kv_tokens"], prefill_chunk=f["prefill_chunk"],
    )


def runtime_argv(opts: RuntimeOptions) -> list[str]:
    """The ft-run flags that give `opts` back through `_to_options` (ft-bench serve starts the
    server with them); `kv_tokens` is left to the command (serve sizes its own budget)."""
    d = DEFAULTS
    values = [("--strategy", opts.strategy, d["strategy"]), ("--cache-experts", opts.cache_experts, None),
              ("--cache-bytes", opts.cache_bytes, None), ("--gpu-budget", opts.gpu_budget, None),
              ("--device", opts.device, d["device"]), ("--threads", opts.threads, None),
              ("--profile", opts.profile, None), ("--bandwidth-ratio", opts.bandwidth_ratio, None),
              ("--dtype", opts.dtype, None), ("--prefill-chunk", opts.prefill_chunk, d["prefill_chunk"]),
              ("--prefix-cache-tokens", opts.prefix_cache_tokens, None),
              ("--anchor-slots", opts.anchor_slots, d["anchor_slots"])]
    argv = [a for flag, v, default in values if v != default for a in (flag, str(v))]
    switches = [("--no-profile", not opts.find_profile), ("--verify", opts.verify), ("--no-graphs", not opts.graphs),
                ("--no-prefix-cache", not opts.prefix_cache), ("--no-anchors", not opts.anchors)]
    return argv + [flag for flag, on in switches if on]


def runtime_flags(*groups: list[tuple[str, object, object]], without: tuple[str, ...] = ()
                  ) -> Callable[[Callable], Callable]:
    """Add the runtime flags and `groups` to a command, less those `without` names (ft-bench
    decode sweeps strategies and graph modes with flags of its own); the command gets `opts`."""
    flags = [flag for group in (RUNTIME_FLAGS, *groups) for flag in group if flag[0] not in without]

    def wrap(command: Callable) -> Callable:
        sig = inspect.signature(command, eval_str=True)  # typer reads real annotations
        own = [p for p in sig.parameters.values() if p.name != "opts"]
        added = [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, annotation=a, default=d) for n, a, d in flags]

        @functools.wraps(command)
        def run(**kwargs: object) -> None:
            given = {n: kwargs.pop(n) for n, _, _ in flags}
            try:
                opts = _to_options({**DEFAULTS, **given})
            except ValueError as e:  # parsed outside the command's own one-line handler: the same line
                fail(str(e))
            command(opts=opts, **kwargs)

        run.__signature__ = sig.replace(parameters=own + added)  # what typer reads
        return run

    return wrap


def check_max_tokens(n: int) -> None:
    if n < 1:
        raise ValueError(f"--max-tokens must be at least 1, got {n}")


def _echo(delta: str) -> None:
    console.print(printable(delta), end="", markup=False, highlight=False)


def _prompt_ids(rt: Runtime, prompt: str | None, prompt_ids: str | None, chat: bool) -> list[int]:
    if (prompt is None) == (prompt_ids is None):
        raise ValueError("give exactly one of --prompt and --prompt-ids")
    if prompt_ids is not None:
        try:
            return [int(t) for t in prompt_ids.split(",") if t.strip()]
        except ValueError:
            raise ValueError(f"--prompt-ids must be comma-separated integers, got {prompt_ids!r}") from None
    if rt.tokenizer is None:
        raise ValueError(f"{rt.path} has no tokenizer.json; use --prompt-ids")
    text = rt.tokenizer.chat([{"role": "user", "content": prompt}]) if chat else prompt
    return rt.tokenizer.encode(text)


def stats_table(rt: Runtime) -> Table:
    s = rt.store.stats
    t = Table(title=f"experts ({rt.store.strategy}, cache {rt.store.cache.capacity} slots)")
    for col in ("layer", "active", "hits", "fills", "cpu", "miss rate"):
        t.add_column(col, justify="right")
    for layer, c in sorted(s.per_layer().items()):
        t.add_row(str(layer), str(c.active), str(c.hits), str(c.fills), str(c.cpu),
                  f"{c.misses / c.active:.1%}" if c.active else "-")
    tot = s.totals()
    t.add_row("all", str(tot.active), str(tot.hits), str(tot.fills), str(tot.cpu), f"{s.miss_rate:.1%}")
    return t


def _report(rt: Runtime, gen: Generation, as_json: bool, show_stats: bool) -> None:
    if as_json:
        out = {"token_ids": gen.token_ids, "text": gen.text, "finish_reason": gen.finish_reason,
               "stats": {**gen.stats(), "load_seconds": round(rt.load_seconds, 3), "strategy": rt.store.strategy, "experts": rt.store.stats.to_dict()}}
        print(json.dumps(out))
        return
    if show_stats:
        console.print(stats_table(rt))
    st = gen.stats()
    console.print(f"[dim]{st['prompt_tokens']} prompt + {st['completion_tokens']} generated tokens; "
                  f"prefill {_rate(st['prefill_tok_s'])}, decode {_rate(st['decode_tok_s'])}; "
                  f"strategy {rt.store.strategy}[/]")


def _rate(tok_s: float | None) -> str:
    """A rate, or '-' where there was nothing to time (all cached, or a single token)."""
    return "-" if tok_s is None else f"{tok_s} tok/s"


@app.command("generate")
@runtime_flags(KV_FLAGS)
def generate_cmd(
    model: Model,
    prompt: Annotated[str | None, typer.Option(help="prompt text")] = None,
    prompt_ids: Annotated[str | None, typer.Option(help="prompt token ids, e.g. 1,2,3")] = None,
    chat: Annotated[bool, typer.Option(help="wrap --prompt in the chat template")] = False,
    max_tokens: MaxTokens = 64,
    temperature: Annotated[float, typer.Option(help="0 = greedy")] = 0.0,
    top_p: Annotated[float, typer.Option(help="nucleus sampling: keep the likeliest tokens up to this mass")] = 1.0,
    top_k: Annotated[int, typer.Option(help="sample among the k likeliest tokens (0 = all)")] = 0,
    seed: Annotated[int | None, typer.Option(help="seed of the sampler (same seed, same device: same tokens)")] = None,
    stop: Annotated[list[str] | None, typer.Option(help="stop string (repeatable)")] = None,
    ignore_eos: Annotated[bool, typer.Option(help="go on past the end-of-sequence token")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="print one JSON object")] = False,
    stats: Annotated[bool, typer.Option("--stats", help="per-layer expert hits/misses/fills/CPU")] = False,
    opts: RuntimeOptions = None,
) -> None:
    """Generate a completion for one prompt."""

    def run() -> None:
        check_max_tokens(max_tokens)
        rt = Runtime(model, replace(opts, prefix_cache=False))  # one prompt: nothing to reuse
        try:
            ids = _prompt_ids(rt, prompt, prompt_ids, chat)
            params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                                    seed=seed, stop=stop or [], ignore_eos=ignore_eos)
            gen = generate(rt, ids, params, on_text=None if as_json else _echo)
            if not as_json:
                console.print()
            _report(rt, gen, as_json, stats)
        finally:
            rt.close()

    guarded(run)


@app.command("chat")
@runtime_flags(PREFIX_FLAGS, KV_FLAGS)
def chat_cmd(
    model: Model,
    max_tokens: MaxTokens = 256,
    temperature: Annotated[float, typer.Option(help="0 = greedy")] = 0.7,
    system: Annotated[str | None, typer.Option(help="system prompt")] = None,
    stats: Annotated[bool, typer.Option("--stats", help="per-layer expert hits/misses/fills/CPU after each reply")] = False,
    opts: RuntimeOptions = None,
) -> None:
    """Chat interactively (empty line or Ctrl-D to quit); tokens stream as they come. Each turn
    reuses the previous turns' K/V through the prefix cache."""

    def run() -> None:
        check_max_tokens(max_tokens)
        rt = Runtime(model, opts)
        if rt.tokenizer is None or rt.tokenizer.template is None:
            raise ValueError(f"{model} has no tokenizer or chat template; use ft-run generate --prompt-ids")
        messages = [{"role": "system", "content": system}] if system else []
        try:
            while True:
                try:
                    user = console.input("[bold cyan]you>[/] ")
                except EOFError:
                    break
                if not user.strip():
                    break
                messages.append({"role": "user", "content": user})
                ids = rt.tokenizer.encode(rt.tokenizer.chat(messages))
                console.print("[bold green]model>[/] ", end="")
                gen = generate(rt, ids, SamplingParams(max_tokens=max_tokens, temperature=temperature), _echo)
                console.print()
                messages.append({"role": "assistant", "content": gen.text})
                _report(rt, gen, False, stats)
        finally:
            rt.close()

    guarded(run)


@app.command("demo")
def demo_cmd(
    out: Annotated[Path, typer.Option(help="where to write the built-in model")] = Path("demo"),
    prompt: Annotated[str, typer.Option(help="what the built-in model is asked")] = "Write a haiku about experts.",
    max_tokens: MaxTokens = 32,
    threads: Threads = None,
    hf: Annotated[bool, typer.Option("--hf", help="also write it as an HF safetensors directory, OUT/demo-hf "
                                                  "(an input for ftw-convert and ft-diagnose)")] = False,
    gguf: Annotated[bool, typer.Option("--gguf", help="also write it as a GGUF file, OUT/demo.gguf")] = False,
) -> None:
    """Write the built-in small random-weight MoE (once) and generate from it with `hybrid`
    and an expert cache smaller than the pool."""
    from .random_model import demo_spec, write_random_ftw, write_random_gguf, write_random_hf
    from .synthetic import write_tokenizer

    def sources(vocab: int) -> None:
        """The first pipeline step's inputs, without a download."""
        if hf and not (out / "demo-hf" / "config.json").is_file():
            write_random_hf(out / "demo-hf", demo_spec(vocab), side_files=lambda d: write_tokenizer(d, vocab))
        if gguf and not (out / "demo.gguf").is_file():
            write_random_gguf(out / "demo.gguf", demo_spec(vocab))
        for path in [out / "demo-hf"] * hf + [out / "demo.gguf"] * gguf:
            console.print(f"wrote {path}: try `ft-diagnose {path}` and `ftw-convert {path} -o "
                          f"{path.with_name(path.stem + '-converted.ftw')}`", markup=False, highlight=False,
                          soft_wrap=True)

    def run() -> None:
        check_max_tokens(max_tokens)
        out.mkdir(parents=True, exist_ok=True)
        vocab = 512  # the built-in model's vocabulary (its generated tokenizer's)
        sources(vocab)
        model = out / "demo.ftw"
        if not (model / "manifest.json").is_file():
            console.print(f"writing the built-in model to {model} ...")
            write_random_ftw(model, demo_spec(vocab), side_files=lambda d: write_tokenizer(d, vocab))
        rt = Runtime(model, RuntimeOptions(strategy="hybrid", cache_experts=24, bandwidth_ratio=0.5,
                                           threads=threads, trace_stats=True))
        try:
            pool = rt.pool.nbytes
            console.print(
                f"[bold yellow]The built-in model has RANDOM weights: its text is gibberish.[/] It shows the "
                f"pipeline: {rt.spec.num_expert_rows} experts in a {human_bytes(pool)} host pool, a device "
                f"cache of {rt.store.cache.capacity} slots "
                f"({rt.store.cache.capacity / rt.spec.num_expert_rows:.0%} of the pool), strategy hybrid."
            )
            ids = rt.tokenizer.encode(rt.tokenizer.chat([{"role": "user", "content": prompt}]))
            console.print(f"[bold cyan]prompt>[/] {prompt}\n[bold green]model>[/] ", end="")
            gen = generate(rt, ids, SamplingParams(max_tokens=max_tokens, ignore_eos=True), _echo)
            console.print()
            _report(rt, gen, False, True)
        finally:
            rt.close()

    guarded(run)


@app.command("serve")
@runtime_flags(PREFIX_FLAGS, SERVE_FLAGS)
def serve_cmd(
    model: Model,
    host: Annotated[str, typer.Option(help="bind address (non-loopback without --api-key warns)")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port")] = 8741,
    api_key: Annotated[str | None, typer.Option(envvar="FTKIT_API_KEY", help="required key (Bearer or x-api-key)")] = None,
    served_model_name: Annotated[str | None, typer.Option(help="model id clients send (default: the directory name)")] = None,
    max_running: Annotated[int, typer.Option(help="requests decoded concurrently; more wait in a queue")] = 4,
    kv_tokens: Annotated[int | None, typer.Option(help="KV budget in tokens over all running requests (default: max-running x context)")] = None,
    device_memory: Annotated[str | None, typer.Option(help="device memory budget, e.g. 20G (default: free VRAM, or available RAM on cpu)")] = None,
    max_body: Annotated[str, typer.Option(help="largest request body, e.g. 64M (a larger one gets a 413)")] = f"{DEFAULT_MAX_BODY >> 20}M",
    opts: RuntimeOptions = None,
) -> None:
    """Serve the model over OpenAI- and Anthropic-compatible HTTP APIs (default 127.0.0.1:8741)."""
    from .server.launch import serve

    def run() -> None:
        serve(model, opts, host=host, port=port, api_key=api_key, max_running=max_running, kv_tokens=kv_tokens,
              device_memory=parse_bytes(device_memory, "--device-memory") if device_memory else None, served_name=served_model_name,
              max_body=parse_bytes(max_body, "--max-body"), say=lambda line: console.print(line, markup=False, highlight=False))

    guarded(run)


@app.command("launch", cls=PlainUsage)
@runtime_flags(PREFIX_FLAGS, SERVE_FLAGS)
def launch_cmd(
    agent: Annotated[str, typer.Argument(metavar="AGENT", help="claude | codex | opencode", show_default=False)],
    agent_args: Annotated[list[str] | None, typer.Argument(metavar="[-- ARGS]", show_default=False,
                                                          help="passed to the agent")] = None,
    model: Annotated[Path | None, typer.Option("--model", "-m", help="FTW directory to serve when no server "
                                                                    "answers on the port")] = None,
    host: Annotated[str, typer.Option(help="the server's address")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="the server's TCP port")] = 8741,
    api_key: Annotated[str | None, typer.Option(envvar="FTKIT_API_KEY", help="the server's key (given to "
                                                                            "the agent, and to a server it starts)")] = None,
    served_model_name: Annotated[str | None, typer.Option(help="model id of a server it starts (default: the "
                                                               "directory name)")] = None,
    print_only: Annotated[bool, typer.Option("--print", help="print what the agent would be given; start "
                                                             "nothing")] = False,
    opts: RuntimeOptions = None,
) -> None:
    """Run a coding agent against ft-run serve: the server on --port if one answers, else one
    started from -m (stopped when the agent exits); the agent's settings go to a temporary
    place (environment, command-line overrides, a config file), never over the user's own."""
    from .server import agents

    def say(line: str) -> None:
        err_console.print(f"ftkit: {line}", markup=False, highlight=False, soft_wrap=True)

    def run() -> int:
        url = f"http://{agents.client_host(host)}:{port}"
        name = agents.served_model(url)
        argv = ["-m", str(model), "--host", host, "--port", str(port), *runtime_argv(opts),
                *(["--served-model-name", served_model_name] if served_model_name else [])]
        if name is None and model is None:
            raise ValueError(f"no ft-run serve answers on {url}; give -m MODEL to start one")
        with tempfile.TemporaryDirectory(prefix="ft-run-launch-") as tmp:
            if print_only:
                setup = agents.setup_for(agent, url, name or served_model_name or model.name, api_key, Path(tmp))
                print(f"# the ft-run serve on {url}" if name else f"# ft-run serve {shlex.join(argv)}")
                print(setup.describe(agent, api_key))
                return 0
            exe = agents.executable(agent)
            if name is not None:
                say(f"using the ft-run serve on {url} ({name})")
                return agents.run(exe, agents.setup_for(agent, url, name, api_key, Path(tmp)), agent_args or [])
            env = {**os.environ, **({"FTKIT_API_KEY": api_key} if api_key else {})}  # not in argv: ps shows it
            with agents.server(argv, url, Path(tmp) / "serve.log", env, say) as name:
                return agents.run(exe, agents.setup_for(agent, url, name, api_key, Path(tmp)), agent_args or [])

    code: list[int] = []
    guarded(lambda: code.append(run()))
    raise typer.Exit(code[0])


ctl = typer.Typer(no_args_is_help=True, help="Talk to a running `ft-run serve`.")
app.add_typer(ctl, name="ctl")
Url = Annotated[str, typer.Option(help="server address")]
Key = Annotated[str | None, typer.Option(envvar="FTKIT_API_KEY", help="the server's --api-key")]


@ctl.command("stats")
def ctl_stats(url: Url = "http://127.0.0.1:8741", api_key: Key = None) -> None:
    """Print the server's /v1/stats as JSON."""
    from .server.client import call

    guarded(lambda: print(json.dumps(call(url, "GET", "/v1/stats", api_key), indent=2)))


@ctl.command("cache")
def ctl_cache(
    experts: Annotated[int | None, typer.Option(help="new expert cache size in slots")] = None,
    kv: Annotated[int | None, typer.Option(help="new KV budget in tokens")] = None,
    url: Url = "http://127.0.0.1:8741",
    api_key: Key = None,
) -> None:
    """Rebuild the expert cache / KV budget of a running server (no restart, no request lost)."""
    from .server.client import call

    body = {k: v for k, v in (("experts", experts), ("kv_tokens", kv)) if v is not None}
    guarded(lambda: print(json.dumps(call(url, "POST", "/v1/cache/rebuild", api_key, body), indent=2)))


def main() -> None:
    listed(app)
    listed(ctl)
    app()
if __name__ == "__main__":
    main()
