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


def _interpreter_patches_once_per_launch() -> None:
    """Triton's interpreter (3.9) re-patches triton.language for every call of a @jit helper
    inside a kernel (`tl.sort`, a block decoder...): a scan of every member of the language
    modules, about a third of the CPU tests' interpreter time, that changes nothing while the launch's own
    patches, made from the same modules, stand (their builtins are already replaced, and the
    rest is set to equal wrappers the launch's scope restores anyway). Here a helper's call
    patches only modules the running launch has not; the kernels' code and semantics are those
    of the interpreter as shipped."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    try:
        import inspect
        import threading

        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return
    original, empty = getattr(interpreter, "_patch_lang", None), getattr(interpreter, "_LangPatchScope", None)
    if original is None or empty is None or getattr(original, "once_per_launch", False):
        return
    launch = threading.local()  # per thread: the lang modules the running launch patched

    def langs(fn) -> frozenset[int]:
        return frozenset(id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core))

    def patch_lang(fn):
        patched = getattr(launch, "langs", None)
        if patched is None:  # a launch (GridExecutor): patch, and forget the modules when it restores
            scope = original(fn)
            launch.langs = set(langs(fn))
            restore = scope.restore

            def restored() -> None:
                launch.langs = None
                restore()

            scope.restore = restored
            return scope
        if langs(fn) <= patched:  # a helper's call inside the launch: its modules are patched
            return empty()  # nothing to restore (3.9's caller drops a helper's scope anyway)
        patched |= langs(fn)
        return original(fn)

    patch_lang.once_per_launch = True
    interpreter._patch_lang = patch_lang


_interpreter_patches_once_per_launch()

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
