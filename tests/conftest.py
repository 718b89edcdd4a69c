"""Session-wide fixtures: each tiny checkpoint is built once and shared by every test file.

Shared checkpoints must not be modified; the damage builders in `fixtures` work on copies.
Without CUDA, Triton kernels run in its interpreter (set before anything imports triton), so
the device-side decode path is tested on CPU too.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

# `python -m pytest` puts the repository root on sys.path, where the source folder `kernels/`
# shadows the hub's `kernels` package that transformers >= 5.25 imports (an ImportError in every
# reference check). The code runs installed as `ftkit.*`, so the root is never needed on the path.
_ROOT = Path(__file__).resolve().parent.parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _ROOT]

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from fixtures import make_hf_checkpoint  # noqa: E402 (after the path fix above)


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """`hf_checkpoint(name, sharded=False, stacked=False, dtype=torch.float32) -> Path`, cached."""
    built: dict[tuple[str, bool, bool, torch.dtype], Path] = {}

    def get(
        name: str,
        *,
        sharded: bool = False,
        stacked: bool = False,
        dtype: torch.dtype = torch.float32,
    ) -> Path:
        key = (name, sharded, stacked, dtype)
        if key not in built:
            label = "-".join(
                [
                    name,
                    *(["sharded"] if sharded else []),
                    *(["stacked"] if stacked else []),
                    str(dtype)[6:],
                ]
            )
            built[key] = make_hf_checkpoint(
                name, tmp_path_factory.mktemp(label), sharded=sharded, stacked=stacked, dtype=dtype
            )
        return built[key]

    return get
