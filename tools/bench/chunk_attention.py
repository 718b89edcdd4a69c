"""A prefill chunk's attention behind cached keys: `python -m ftkit.tools.bench.chunk_attention`.

A long prompt is prefilled in chunks (8192 tokens on a GPU); every chunk after the first attends
to the keys cached before it. For the qwen3-30b-a3b attention shape (32 query heads, 4 K/V heads,
head size 128, bf16) this times one layer's attention of such a chunk, and the device memory it
allocates, two ways: flash attention with a lower-right causal mask (what models/layers.py runs
where flash applies) and SDPA's memory-efficient kernel with the materialised mask and the K/V
heads repeated (what it runs otherwise). Needs CUDA.
"""

from __future__ import annotations

import argparse
import contextlib
import json
from pathlib import Path
from unittest import mock

import torch
from rich.console import Console
from rich.table import Table

from ftkit.runtime.models import layers

from .presets import preset_spec


def measure(chunk: int, context: int, flash: bool, heads: int, kv_heads: int, head_dim: int,
            repeats: int = 5) -> tuple[float, int]:
    """Milliseconds per call and the peak bytes allocated beyond the inputs."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(n, h, head_dim, device="cuda", dtype=torch.bfloat16, generator=gen)
               for n, h in ((chunk, heads), (context, kv_heads), (context, kv_heads)))
    masked = mock.patch.object(layers, "_flash_lower_right", lambda *a: False)
    with contextlib.nullcontext() if flash else masked:
        layers.attention(q, k, v, context - chunk)  # first call: kernel choice, allocator
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            layers.attention(q, k, v, context - chunk)
        end.record()
        torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats, torch.cuda.max_memory_allocated() - base


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chunk", type=int, default=8192)
    ap.add_argument("--contexts", default="16384,32768,40960", help="keys after the chunk (chunk included)")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    spec = preset_spec("qwen3-30b-a3b")
    shape = dict(heads=spec.num_heads, kv_heads=spec.num_kv_heads, head_dim=spec.head_dim)
    table = Table(title=f"one layer's attention, a {a.chunk}-token chunk behind cached keys (bf16)")
    for col in ("keys", "flash ms", "flash MiB", "masked ms", "masked MiB"):
        table.add_column(col, justify="right")
    rows = []
    for context in (int(c) for c in a.contexts.split(",")):
        (fm, fb), (mm, mb) = (measure(a.chunk, context, flash, **shape) for flash in (True, False))
        rows.append({"chunk": a.chunk, "context": context, "flash_ms": fm, "flash_bytes": fb,
                     "masked_ms": mm, "masked_bytes": mb})
        table.add_row(str(context), f"{fm:.2f}", f"{fb / 2**20:.0f}", f"{mm:.2f}", f"{mb / 2**20:.0f}")
    Console().print(table)
    if a.json:
        a.json.write_text(json.dumps({"device": torch.cuda.get_device_name(), **shape, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
