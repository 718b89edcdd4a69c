"""The real `ft-run serve` app for tests: a random-weight model on CPU behind uvicorn on an
ephemeral loopback port, in a thread of the test process (so tests can reach its state)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import uvicorn

from ftkit.runtime.engine.loader import Runtime, RuntimeOptions
from ftkit.runtime.engine.scheduler import Scheduler
from ftkit.runtime.ftw.reader import FTWModel
from ftkit.runtime.random_model import write_random_ftw
from ftkit.runtime.server.app import create_app
from ftkit.runtime.server.core import ServerState
from ftkit.runtime.server.launch import resolve_serve
from ftkit.runtime.spec import ModelSpec
from ftkit.runtime.synthetic import write_tokenizer


def write_model(path: Path, spec: ModelSpec) -> Path:
    """A random-weight FTW of `spec` with the generated tokenizer and chat template."""
    write_random_ftw(path, spec, side_files=lambda d: write_tokenizer(d, spec.vocab_size))
    return path


@contextmanager
def served(model: Path, name: str, api_key: str, max_running: int = 4) -> Iterator[SimpleNamespace]:
    """The server for `model` while the block runs: `.url`, `.state` (its ServerState), `.model`."""
    opts = RuntimeOptions(strategy="hybrid", cache_experts=24, bandwidth_ratio=0.5, threads=1)
    ftw = FTWModel(model)
    resolved = resolve_serve(ftw, opts, max_running=max_running, kv_tokens=None, device_memory=256 << 20)
    rt = Runtime(ftw, resolved)
    scheduler = Scheduler(rt, resolved.memory, max_running=max_running)
    state = ServerState(rt, scheduler, name, api_key)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    srv = uvicorn.Server(uvicorn.Config(create_app(state), log_level="warning"))
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        while not srv.started:
            time.sleep(0.02)
        yield SimpleNamespace(url=f"http://127.0.0.1:{sock.getsockname()[1]}", state=state, model=model)
    finally:
        srv.should_exit = True
        thread.join(10)
        scheduler.close()
        rt.close()
