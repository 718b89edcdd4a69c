"""Hugging Face ids as checkpoint paths: `Qwen/Qwen3-30B-A3B` found in the local hub cache, offline.

The cache layout is read directly (it is documented for reimplementation: huggingface.co/docs/hub/
local-cache), so nothing is imported and nothing goes to the network:
`<cache>/models--<org>--<name>/refs/<revision>` holds a commit hash, and
`<cache>/models--<org>--<name>/snapshots/<hash>/` the repository's files as of that commit.
The cache is `$HF_HUB_CACHE`, else `$HF_HOME/hub`, else `$XDG_CACHE_HOME/huggingface/hub`, else
`~/.cache/huggingface/hub`, as huggingface_hub places it.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from ftkit.errors import InputError

# org/name, each of letters, digits, '-', '_' and '.' (the Hub's repository names); no '..'
_REPO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")
_COMMIT = re.compile(r"[0-9a-f]{40}")


class HubError(InputError):
    """A Hugging Face id that names nothing in the local cache."""


def is_repo_id(text: str) -> bool:
    return bool(_REPO_ID.fullmatch(text)) and ".." not in text


def hub_cache() -> Path:
    if cache := os.environ.get("HF_HUB_CACHE"):
        return Path(cache).expanduser()
    if home := os.environ.get("HF_HOME"):
        return Path(home).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "huggingface" / "hub"


def snapshot(repo: str, revision: str = "main") -> Path:
    """The cached snapshot directory of model repository `repo` at `revision` (a branch or tag the
    cache has a ref for, or a commit hash it holds)."""
    root = hub_cache() / ("models--" + repo.replace("/", "--"))
    ref = root / "refs" / revision
    commit = ref.read_text().strip() if ref.is_file() else revision
    path = root / "snapshots" / commit
    if _COMMIT.fullmatch(commit) and path.is_dir():
        return path
    raise HubError(f"{repo}: no such path, and not in the Hugging Face cache {hub_cache()} (download it with "
                   f"`hf download {repo}`, or give a path)")


def local_path(src: str) -> Path:
    """SRC as a command names it: a path that exists (always first), else a Hugging Face id found
    in the local cache. Neither: FileNotFoundError, one line."""
    path = Path(src).expanduser()
    if path.exists():
        return path
    if is_repo_id(src):
        return snapshot(src)
    raise FileNotFoundError(f"{src}: no such file or directory")
