"""Triton kernels of the runtime. With TRITON_INTERPRET=1 (CPU tests) they run on CPU tensors."""

import functools
import importlib
import os
from types import ModuleType


def interpreting() -> bool:
    """Whether Triton runs kernels in its interpreter: no GPU clock there, and 16-bit `tl.dot`
    is wrong in it (Triton 3.9), so kernels that need either take another branch."""
    return os.environ.get("TRITON_INTERPRET") == "1"


@functools.cache
def optional(name: str) -> ModuleType | None:
    """The kernel module `ftkit.kernels.triton.<name>`, or None where Triton is not installed
    (the callers' torch paths run then). The one place that import may fail."""
    try:
        return importlib.import_module(f"{__name__}.{name}")
    except ImportError:
        return None
