"""`ft-diagnose --remote REPO`: a Hugging Face repository's header-only stub, fetched with HTTP range
requests, so its verdict costs a few KB to a few MB instead of the weights.

What is fetched of a safetensors repository, as the README's curl recipe does: `config.json` and
`model.safetensors.index.json` whole (without an index, the one `model.safetensors`), and of each
shard its 8-byte header length n, then bytes 8 .. 8+n-1.

A GGUF repository (no `config.json`, or `REPO:TAG` / `REPO/FILE.gguf` given) holds one model per
quantization: its file list comes from the hub's model-info API, `:TAG` picks the file whose name
ends in the tag (`unsloth/Qwen3-30B-A3B-GGUF:Q4_K_M`, as llama.cpp's `-hf` takes it; without one,
the only model, else Q4_K_M as llama.cpp picks), and each file of it (all of a split model) is
read from its start in ranges that double until its header ends (a few MB: mostly the
vocabulary). A server that ignores the range answers 200 with the whole file; only the bytes
asked for are read before the connection is closed. `HF_ENDPOINT` names another hub (default
https://huggingface.co) and `HF_TOKEN` is sent for gated and private repositories.
"""

from __future__ import annotations

import json
import os
import re
import struct
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from ftkit.errors import InputError, shown
from ftkit.runtime.checkpoint.base import CheckpointError, inside
from ftkit.runtime.checkpoint.gguf import MAX_HEADER_BYTES as MAX_GGUF_HEADER
from ftkit.runtime.checkpoint.gguf import READ_CHUNK, SPLIT_NAME, header_length

DEFAULT_ENDPOINT = "https://huggingface.co"
CONFIG, INDEX, SINGLE = "config.json", "model.safetensors.index.json", "model.safetensors"
MAX_JSON = 64 << 20  # config and index, as the local readers bound them
MAX_HEADER = 256 << 20  # a safetensors header (checkpoint/safetensors.py's bound)
TIMEOUT_S = 60
FIRST_RANGE = 1 << 20  # a GGUF header's first request; each next one asks for as much as came before
DEFAULT_TAG = "Q4_K_M"  # llama.cpp's -hf default


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
    sizes: dict[str, int] = field(default_factory=dict)  # a file's whole size, as its replies said

    @classmethod
    def from_env(cls, repo: str, revision: str = "main") -> Fetcher:
        return cls(repo, revision, os.environ.get("HF_ENDPOINT", DEFAULT_ENDPOINT).rstrip("/"),
                   os.environ.get("HF_TOKEN") or None)

    def url(self, name: str) -> str:
        return f"{self.endpoint}/{self.repo}/resolve/{urllib.parse.quote(self.revision, safe='')}/" \
               + urllib.parse.quote(name)

    def get(self, name: str, start: int = 0, length: int | None = None, limit: int = MAX_JSON) -> bytes:
        """Bytes start .. start+length-1 of `name` (fewer only where the file ends; the whole file up
        to `limit` bytes without a length); `_Missing` on a 404."""
        return self._read(self.url(name), name, start, length, limit)

    def listing(self) -> list[str]:
        """The repository's file names, from the hub's model-info API (`siblings`)."""
        url = f"{self.endpoint}/api/models/{self.repo}/revision/{urllib.parse.quote(self.revision, safe='')}"
        try:
            info = json.loads(self._read(url, "the model-info API", 0, None, MAX_JSON))
            names = [s["rfilename"] for s in info["siblings"]]
        except _Missing:
            raise RemoteError(f"{url}: not found (HTTP 404): no such repository or revision") from None
        except (ValueError, KeyError, TypeError):
            raise RemoteError(f"{url}: not the hub's model info (a JSON object with a siblings list)") from None
        if not all(isinstance(n, str) and inside(n) for n in names):
            raise RemoteError(f"{url}: a file name that is not a path inside the repository")
        return names

    def _read(self, url: str, name: str, start: int, length: int | None, limit: int) -> bytes:
        req = urllib.request.Request(url)
        if length is not None:
            req.add_header("Range", f"bytes={start}-{start + length - 1}")
        if self.token:
            req.add_header("Authorization", f"Bearer {self.token}")
        try:
            with urllib.request.urlopen(req, timeout=TIMEOUT_S) as resp:
                skip = start if length is not None and resp.status == 200 else 0  # range ignored
                size = _size(resp.headers.get("content-range") if resp.status == 206 else resp.headers.get("content-length"))
                if size is not None:
                    self.sizes[name] = size
                want = (length if length is not None else limit + 1) + skip
                data = resp.read(want)
        except urllib.error.HTTPError as e:
            if e.code == 404:
                raise _Missing(name) from None
            hint = " (a gated or private repository: set HF_TOKEN)" if e.code in (401, 403) else ""
            raise RemoteError(f"{url}: HTTP {e.code} {e.reason}{hint}") from None
        except (urllib.error.URLError, OSError) as e:
            reason = getattr(e, "reason", e)
            raise RemoteError(f"{self.endpoint}: cannot fetch {name} ({reason})") from None
        self.fetched += len(data)
        data = data[skip:]
        if length is None and len(data) > limit:
            raise RemoteError(f"{url}: larger than {limit} bytes")
        if length is not None and len(data) != length and start + len(data) != self.sizes.get(name):
            raise RemoteError(f"{url}: {len(data)} bytes where {length} were asked for (a truncated file)")
        return data

    def header(self, name: str) -> bytes:
        """A shard's stub: its header length and header."""
        head = self.get(name, 0, 8)
        if len(head) < 8:
            return head  # the local reader names a file too short for its header length
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER:
            raise RemoteError(f"{self.url(name)}: safetensors header length {n} is above {MAX_HEADER} bytes")
        return head + self.get(name, 8, n) if n else head


def _size(value: str | None) -> int | None:
    """A file's whole size from a 206's Content-Range (`bytes a-b/N`) or a 200's Content-Length."""
    m = re.fullmatch(r"(?:bytes \d+-\d+/)?(\d+)", (value or "").strip())
    return int(m[1]) if m else None


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


class _RemoteFile:
    """A file on the hub read front to back, as the GGUF header reader reads it (`seek`, `read`),
    from ranges that double: a header of a few MB costs a handful of requests and at most twice
    its bytes."""

    def __init__(self, fetcher: Fetcher, name: str):
        self.fetcher, self.name, self.pos = fetcher, name, 0
        self.data = fetcher.get(name, 0, FIRST_RANGE)
        if name not in fetcher.sizes:
            raise RemoteError(f"{fetcher.url(name)}: the reply gives no file size (Content-Range or Content-Length)")
        self.size = fetcher.sizes[name]

    def seek(self, pos: int) -> None:
        self.pos = pos

    def read(self, n: int) -> bytes:
        end = min(self.pos + n, self.size)
        while len(self.data) < end:  # end is within the reader's bound on a header
            have = len(self.data)
            step = max(end - have, min(have, MAX_GGUF_HEADER + READ_CHUNK - have))
            self.data += self.fetcher.get(self.name, have, min(step, self.size - have))
        out = self.data[self.pos:end]
        self.pos = end
        return out


def _gguf_stub(f: Fetcher, name: str, out: Path) -> Path:
    """`name`'s GGUF header, fetched as far as it goes, written as a stub into `out`."""
    remote = _RemoteFile(f, name)
    base = PurePosixPath(name).name
    try:
        end = header_length(remote, remote.size, base)
    except CheckpointError:
        end = len(remote.data)  # the local reader names what is wrong with the bytes fetched
    _write(out / base, remote.data[:end])
    return out / base


def _gguf_models(names: list[str]) -> dict[str, list[str]]:
    """The GGUF models among a repository's files: each model's first file -> all its files (the
    files of a split model; projector files for vision, `mmproj`, left out)."""
    models: dict[str, list[str]] = {}
    for name in names:
        path = PurePosixPath(name)
        if path.suffix.lower() != ".gguf" or "mmproj" in path.name.lower():
            continue
        m = SPLIT_NAME.fullmatch(path.name)
        first = str(path.with_name(f"{m[1]}-00001-of-{m[3]}.gguf")) if m else name
        models.setdefault(first, []).append(name)
    return {first: sorted(files) for first, files in sorted(models.items())}


def _tagged(first: str, tag: str) -> bool:
    """Whether a model's file name (less `.gguf` and a split suffix) ends in `tag`, case aside."""
    base = PurePosixPath(first).name
    m = SPLIT_NAME.fullmatch(base)
    stem = m[1] if m else base[: -len(".gguf")]
    return re.search(rf"(^|[-_.]){re.escape(tag)}$", stem, re.IGNORECASE) is not None


def pick_gguf(repo: str, names: list[str], tag: str | None) -> list[str]:
    """The files of the one GGUF model `tag` names among a repository's `names` (without a tag:
    the only model, else the Q4_K_M one); RemoteError listing the models otherwise."""
    models = _gguf_models(names)
    if not models:
        raise RemoteError(f"{repo}: no GGUF file in the repository")
    if tag is None and len(models) == 1:
        return next(iter(models.values()))
    found = [first for first in models if _tagged(first, tag or DEFAULT_TAG)]
    if len(found) == 1:
        return models[found[0]]
    shown_ = ", ".join(list(models)[:12]) + (f" and {len(models) - 12} more" if len(models) > 12 else "")
    which = f"no file ends in {tag}" if tag and not found else f"{len(found)} files end in {tag}" if tag \
        else f"{len(models)} models"
    raise RemoteError(f"{repo}: {which}; name one as {repo}:TAG or {repo}/FILE.gguf ({shown_})")


def parse_remote(spec: str) -> tuple[str, str | None, str | None]:
    """`org/name`, `org/name:TAG` or `org/name/path/FILE.gguf` -> (repository, file, tag)."""
    head, colon, tag = spec.partition(":")
    parts = head.split("/")
    ok = len(parts) >= 2 and all(re.fullmatch(r"[\w.-]+", p) for p in parts[:2]) and inside("/".join(parts)) \
        and all(p not in ("", ".") for p in parts) and (len(parts) == 2 or (
        head.lower().endswith(".gguf") and not colon))
    if not ok or (colon and not re.fullmatch(r"[\w.-]+", tag)):
        raise RemoteError(f"{shown(spec)} is not a Hugging Face repository (org/name), org/name:TAG or "
                          "org/name/FILE.gguf")
    return "/".join(parts[:2]), "/".join(parts[2:]) or None, tag or None


def _fetch_gguf(f: Fetcher, file: str | None, tag: str | None, out: Path, names: list[str] | None = None) -> Path:
    """The stubs of the GGUF model `file` or `tag` names (`pick_gguf`), all its files; the
    path of the one to open."""
    names = f.listing() if names is None else names
    if file is None:
        files = pick_gguf(f.repo, names, tag)
        file = files[0]
    elif file in names:
        files = next((fs for fs in _gguf_models(names).values() if file in fs), [file])
    else:
        raise RemoteError(f"{f.url(file)}: not in the repository")
    for name in files:
        try:
            path = _gguf_stub(f, name, out)
        except _Missing:
            raise RemoteError(f"{f.url(name)}: not found (HTTP 404), though the repository lists it") from None
        if name == file:
            target = path
    return target


def fetch_stub(spec: str, out: Path, fetcher: Fetcher | None = None) -> tuple[Fetcher, Path]:
    """Write the header-only stub of the Hugging Face repository `spec` names (see
    `parse_remote`) into directory `out` (a scratch directory: the caller removes it): the
    fetcher, which counts the bytes received, and what to diagnose there."""
    repo, file, tag = parse_remote(spec)
    f = fetcher or Fetcher.from_env(repo)
    if file or tag:
        return f, _fetch_gguf(f, file, tag, out)
    try:
        _write(out / CONFIG, f.get(CONFIG))
    except _Missing:
        try:
            names = f.listing()
        except RemoteError:
            names = []
        if not _gguf_models(names):
            raise RemoteError(f"{f.url(CONFIG)}: not found (HTTP 404): no such repository or revision, or it has "
                              f"no config.json (nor a GGUF file)") from None
        return f, _fetch_gguf(f, None, None, out, names)
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
    return f, out
