"""`ft-diagnose --remote REPO`: headers fetched with HTTP range requests from a hub, here a real HTTP
server on loopback serving a fixture repository the way the Hub's `resolve` URLs do, counting the
bytes it sends. The verdict and memory plan equal the local checkpoint's, for a small fraction
of its bytes."""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from ftkit.tools.diagnose.cli import app
from ftkit.tools.diagnose.report import diagnose

REPO = "tiny-org/Tiny-MoE"


class Hub(BaseHTTPRequestHandler):
    """GET /<repo>/resolve/main/<file> from `root`, honouring one `Range: bytes=a-b` (unless
    `ignore_range`), as the Hub does; counts the body bytes sent."""

    root: Path
    sent: list[int]
    requests: list[str]
    ignore_range = False
    token: str | None = None

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        self.requests.append(self.path)
        prefix = f"/{REPO}/resolve/main/"
        if self.token and self.headers.get("authorization") != f"Bearer {self.token}":
            return self._reply(401, b"")
        path = self.root / self.path.removeprefix(prefix)
        if not self.path.startswith(prefix) or not path.is_file():
            return self._reply(404, b"Entry not found")
        data = path.read_bytes()
        m = re.fullmatch(r"bytes=(\d+)-(\d+)", self.headers.get("range", ""))
        if m and not self.ignore_range:
            start, end = int(m.group(1)), min(int(m.group(2)), len(data) - 1)
            return self._reply(206, data[start:end + 1], {"content-range": f"bytes {start}-{end}/{len(data)}"})
        self._reply(200, data)

    def _reply(self, status: int, body: bytes, headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        for k, v in {"content-length": str(len(body)), **(headers or {})}.items():
            self.send_header(k, v)
        self.end_headers()
        try:
            self.wfile.write(body)
            self.sent.append(len(body))
        except (BrokenPipeError, ConnectionResetError):  # a client that read what it asked for
            pass

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def hub(hf_checkpoint, monkeypatch: pytest.MonkeyPatch) -> Iterator[SimpleNamespace]:
    root = hf_checkpoint("qwen3_moe", sharded=True)
    handler = type("FixtureHub", (Hub,), {"root": root, "sent": [], "requests": []})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{server.server_address[1]}")
    monkeypatch.delenv("HF_TOKEN", raising=False)
    try:
        yield SimpleNamespace(root=root, handler=handler)
    finally:
        server.shutdown()
        server.server_close()


def run(*args: str) -> tuple[int, dict]:
    result = CliRunner().invoke(app, ["--remote", *args, "--json"])
    assert "Traceback" not in result.output
    return result.exit_code, json.loads(result.stdout)


def test_the_verdict_from_headers_alone(hub) -> None:
    code, r = run(REPO)
    local = diagnose(hub.root)
    assert (code, r["verdict"], r["path"], r["header_only"]) == (0, "PASS", REPO, True)
    assert (r["family"], r["files"], r["tensors"], r["memory"]) == (
        local["family"], local["files"], local["tensors"], local["memory"])
    total = sum(f.stat().st_size for f in hub.root.iterdir() if f.suffix == ".safetensors")
    sent = sum(hub.handler.sent)
    assert 0 < sent < total / 10, (sent, total)
    shards = {f.name for f in hub.root.glob("*.safetensors")}
    asked = {p.rsplit("/", 1)[1] for p in hub.handler.requests}
    assert asked == shards | {"config.json", "model.safetensors.index.json"}  # no tokenizer, nothing else


def test_a_server_that_ignores_ranges(hub) -> None:
    hub.handler.ignore_range = True
    code, r = run(REPO)
    assert (code, r["verdict"], r["header_only"]) == (0, "PASS", True)


def _without_shard_2(hub, tmp_path: Path) -> Path:
    """Serve the repository from `tmp_path`, all but its second shard linked there; that shard."""
    shard = next(hub.root.glob("model-00002-*.safetensors"))
    hub.handler.root = tmp_path
    for f in hub.root.iterdir():
        if f != shard:
            (tmp_path / f.name).symlink_to(f)
    return shard


def test_a_missing_shard_is_named(hub, tmp_path: Path) -> None:
    shard = _without_shard_2(hub, tmp_path)
    code, r = run(REPO)
    assert code == 1 and any(shard.name in p and "missing shard" in p for p in r["problems"])


def test_a_shard_shorter_than_its_header_length_fails_as_locally(hub, tmp_path: Path) -> None:
    shard = _without_shard_2(hub, tmp_path)
    (tmp_path / shard.name).write_bytes(b"\x05\x00\x00")
    code, r = run(REPO)
    assert code == 1 and r["problems"] == diagnose(tmp_path)["problems"] and shard.name in r["problems"][0], r


def test_a_gated_repository_asks_for_a_token(hub, monkeypatch: pytest.MonkeyPatch) -> None:
    hub.handler.token = "secret"
    code, r = run(REPO)
    assert code == 2 and "HTTP 401" in r["problems"][0] and "HF_TOKEN" in r["problems"][0]
    monkeypatch.setenv("HF_TOKEN", "secret")
    assert run(REPO)[0] == 0


def test_no_such_repository_is_one_line(hub) -> None:
    result = CliRunner().invoke(app, ["--remote", "nobody/Nothing"])
    lines = result.output.strip().splitlines()
    assert result.exit_code == 2 and len(lines) == 1 and "config.json: not found (HTTP 404)" in lines[0]
