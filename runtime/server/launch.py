"""`ft-run serve`: take the port, resolve the options (the memory plan with them), refuse with
advice if it cannot fit, load, run uvicorn on the port taken."""

from __future__ import annotations

import errno
import gc
import ipaddress
import socket
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from ..engine.loader import Runtime, RuntimeOptions
from ..engine.resolve import Resolved, resolve
from ..engine.warmup import warm_up
from ..ftw.reader import FTWModel
from .limits import DEFAULT_MAX_BODY

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8741


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def listen(host: str, port: int) -> socket.socket:
    """The server's socket, bound and listening before the model loads, so that a port in use is
    one line at once rather than after the load (and no one takes the port meanwhile)."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
    except (OSError, UnicodeError) as e:
        raise ValueError(f"cannot listen on {host}:{port}: {getattr(e, 'strerror', None) or e}") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does: restarts at once
        sock.bind(addr)
        sock.listen(2048)
    except OSError as e:
        sock.close()
        hint = (f" (another ft-run serve? `ft-run ctl stats --url http://{host}:{port}` asks it; or choose "
                f"another --port)") if e.errno == errno.EADDRINUSE else ""
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror or e}{hint}") from None
    return sock


def resolve_serve(ftw: FTWModel, opts: RuntimeOptions, max_running: int, kv_tokens: int | None,
                  device_memory: int | None) -> Resolved:
    """The options resolved for the server's KV budget (default: a full context for each running
    request), which the runtime is sized for too: a --gpu-budget gives the expert cache what
    that budget leaves, and on CUDA the graph K/V holds the longest request it admits (with
    opts.kv_tokens alone, a request longer than 8192 tokens, prompt plus max_tokens, as an
    agent's usually is, would decode without graphs). `device_memory`: the budget the plan
    must fit (default: what the device has free)."""
    if kv_tokens is None:
        kv_tokens = max_running * ftw.spec.max_position_embeddings
    if kv_tokens < 1:
        raise ValueError("--kv-tokens must be >= 1")
    return resolve(ftw, replace(opts, kv_tokens=kv_tokens), budget=device_memory, sequences=max_running)


def serve(model: Path, opts: RuntimeOptions, *, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT,
          api_key: str | None = None, max_running: int = 4, kv_tokens: int | None = None,
          device_memory: int | None = None, served_name: str | None = None, max_body: int = DEFAULT_MAX_BODY,
          say: Callable[[str], None] = print) -> None:
    import uvicorn

    from ..engine.scheduler import Scheduler
    from .app import create_app
    from .core import ServerState
    from .warm import warm_http

    if max_body < 1:
        raise ValueError("--max-body must be at least 1 byte")
    if api_key and not (api_key.isascii() and api_key.isprintable()):  # HTTP headers carry no other
        raise ValueError("--api-key must be printable ASCII: clients send it in an HTTP header")
    with listen(host, port) as sock:
        ftw = FTWModel(model)
        resolved = resolve_serve(ftw, opts, max_running, kv_tokens, device_memory)
        plan = resolved.memory
        say(plan.describe())
        if not plan.fits:
            raise ValueError(plan.advice())
        if not is_loopback(host) and not api_key:
            say(f"WARNING: serving on {host}, reachable from other machines, with no --api-key: anyone who can "
                f"reach it can use it")
        rt = Runtime(ftw, resolved)
        if rt.device.type == "cuda":
            say("warming up: compiling the GPU kernels (kept in Triton's disk cache) and capturing the decode graphs")
        warm = warm_up(rt)
        scheduler = Scheduler(rt, plan, max_running)
        try:
            state = ServerState(rt, scheduler, served_name or Path(model).name, api_key, max_body)
            app = create_app(state)
            warm_http(app, state)
            # Every object so far (torch's, the tokenizer's, the app's) lives as long as the
            # server: frozen, the collector never walks them again. Unfrozen, a full collection
            # on the dev box's tiny model took 161 ms, inside the first request's prefill (on an
            # H100 host no difference showed above its spread, CC).
            gc.collect()
            gc.freeze()
            say(f"serving {state.model_name} on http://{host}:{port} (OpenAI /v1/chat/completions, Anthropic "
                f"/v1/messages, control /v1/stats)" + (f"; warm-up took {warm:.1f} s" if warm is not None else ""))
            uvicorn.Server(uvicorn.Config(app, log_level="warning")).run(sockets=[sock])
        finally:
            scheduler.close()
            rt.close()
