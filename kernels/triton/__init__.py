"""Triton kernels of the runtime. With TRITON_INTERPRET=1 (CPU tests) they run on CPU tensors."""

import os


def interpreting() -> bool:
    """Whether Triton runs kernels in its interpreter: no GPU clock there, and 16-bit `tl.dot`
    is wrong in it (Triton 3.9), so kernels that need either take another branch."""
    return os.environ.get("TRITON_INTERPRET") == "1"
