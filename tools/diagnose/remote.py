"""`ft-diagnose --remote REPO`: a Hugging Face repository's header-only stub, fetched with HTTP range
requests, so its verdict costs a few KB to a few MB instead of the weights.

What is fetched, as the README's curl recipe does: `config.json` and `model.safetensors.index.json`
whole (without an index, the one `model.safetensors`), and of each shard its 8-byte header length
n, then bytes 8 .. 8+n-1. A server that ignores the range answers 200 with the whole file; only
the bytes asked for are read before the connection is closed. `HF_ENDPOINT` names another hub
(default https://huggingface.co) and `HF_TOKEN` is sent for gated and private repositories.
"""

from __future__ import annotations

import json
import os
import struct
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from ftkit.errors import InputError, shown
from ftkit.runtime.checkpoint.base import inside

DEFAULT_ENDPOINT = "https://huggingface.co"
CONFIG, INDEX, SINGLE = "config.json", "model.safetensors.index.json", "model.safetensors"
MAX_JSON = 64 << 20  # config and index, as the local readers bound them
MAX_HEADER = 256 << 20  # a safetensors header (checkpoint/safetensors.py's bound)
TIMEOUT_S = 60


class RemoteError(InputError):
    """A repository whose headers cannot be fetched: one line naming the file and why."""


class _Missing(Exception):
    """A 404: the file is not in the repository."""


@dataclass
class Fetcher:
    repo: str
    revision: str = "main"
    endpoint: str = DEFAULT_ENDPOINT
    token: str | None = None
    fetched: int = 0  # bytes received

    @classmethod
    def from_env(cls, repo: str, revision: str = "main") -> Fetcher:
        return cls(repo, revision, os.environ.get("HF_ENDPOINT", DEFAULT_ENDPOINT).rstrip("/"),
                   os.environ.get("HF_TOKEN") or None)

    def url(self, name: str) -> str:
        return f"{self.endpoint}/{self.repo}/resolve/{urllib.parse.quote(self.revision, safe='')}/" \
               + urllib.parse.quote(name)

    def get(self, name: str, start: int = 0, length: int | None = None, limit: int = MAX_JSON) -> bytes:
        """Bytes start .. start+length-1 of `name` (the whole file up to `limit` bytes without a
        length); `_Missing` on a 404."""
        req = urllib.request.Request(self.url(name))
        if length is not None:
            req.add_header("Range", f"bytes={start}-{start + length - 1}")
        if self.token:
            req.add_header("Authorization", f"Bearer {self.token}")
        try:
            with urllib.request.urlopen(req, timeout=TIMEOUT_S) as resp:
                skip = start if length is not None and resp.status == 200 else 0  # range ignored
                want = (length if length is not None else limit + 1) + skip
                data = resp.read(want)
        except urllib.error.HTTPError as e:
            if e.code == 404:
                raise _Missing(name) from None
            hint = " (a gated or private repository: set HF_TOKEN)" if e.code in (401, 403) else ""
            raise RemoteError(f"{self.url(name)}: HTTP {e.code} {e.reason}{hint}") from None
        except (urllib.error.URLError, OSError) as e:
            reason = getattr(e, "reason", e)
            raise RemoteError(f"{self.endpoint}: cannot fetch {name} ({reason})") from None
        self.fetched += len(data)
        data = data[skip:]
        if length is None and len(data) > limit:
            raise RemoteError(f"{self.url(name)}: larger than {limit} bytes")
        if length is not None and len(data) != length:
            raise RemoteError(f"{self.url(name)}: {len(data)} bytes where {length} were asked for (a truncated file)")
        return data

    def header(self, name: str) -> bytes:
        """A shard's stub: its header length and header."""
        head = self.get(name, 0, 8)
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER:
            raise RemoteError(f"{self.url(name)}: safetensors header length {n} is above {MAX_HEADER} bytes")
        return head + self.get(name, 8, n) if n else head


def _shards(index: bytes, where: str) -> list[str]:
    try:
        names = json.loads(index)["weight_map"].values()
    except (ValueError, KeyError, TypeError, AttributeError):
        raise RemoteError(f"{where}: not an index with a weight_map object") from None
    shards = sorted(set(names), key=str)
    for name in shards:
        if not inside(name) or not str(name).endswith(".safetensors"):
            raise RemoteError(f"{where}: shard name {shown(name)} is not a .safetensors file inside the repository")
    return shards


def _write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


def fetch_stub(repo: str, out: Path, fetcher: Fetcher | None = None) -> Fetcher:
    """Write the header-only stub of Hugging Face model repository `repo` into directory `out`
    (a scratch directory: the caller removes it); the fetcher counts the bytes received."""
    f = fetcher or Fetcher.from_env(repo)
    try:
        _write(out / CONFIG, f.get(CONFIG))
    except _Missing:
        raise RemoteError(f"{f.url(CONFIG)}: not found (HTTP 404): no such repository or revision, or it has "
                          f"no config.json") from None
    try:
        index = f.get(INDEX)
    except _Missing:
        shards = [SINGLE]
    else:
        _write(out / INDEX, index)
        shards = _shards(index, f.url(INDEX))
    for name in shards:
        try:
            _write(out / name, f.header(name))
        except _Missing:
            pass  # the verdict names it, as for a local directory: a missing shard
    return f
