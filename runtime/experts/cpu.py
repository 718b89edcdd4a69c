"""A persistent CPU worker pool: the CPU branch's threads where the compiled kernel is missing
(with the kernel, one native `Runner` thread runs each layer's call; see kernels/cpu).

Each job computes one expert for its tokens and writes its own rows of the per-assignment
buffer, so jobs never touch the same memory and need no locks; torch releases the GIL inside
the matrix products, so the threads really run in parallel.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor


class CPUExecutor:
    def __init__(self, threads: int | None = None):
        self.threads = threads or self.default_threads()
        self.pool = ThreadPoolExecutor(max_workers=self.threads, thread_name_prefix="ftkit-cpu")

    @staticmethod
    def default_threads() -> int:
        return max(1, (os.cpu_count() or 2) - 1)  # leave a core for the GPU driver

    def start(self, jobs: list[Callable[[], None]]) -> list[Future]:
        """Start the jobs now; the caller goes on with the device branch and waits later."""
        return [self.pool.submit(job) for job in jobs]

    @staticmethod
    def wait(futures: list[Future]) -> None:
        for f in futures:
            f.result()

    def close(self) -> None:
        self.pool.shutdown(wait=True)
