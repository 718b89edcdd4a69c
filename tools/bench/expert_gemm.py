"""Prefill's grouped expert GEMM alone: `python -m ftkit.tools.bench.expert_gemm --formats bfloat16,mxfp4`.

One MoE layer of a preset's shape at prefill: `--tokens` tokens routed uniformly (each to top-k
distinct experts), every expert resident in its slot, the slots random bytes of the format (bf16
slots random normal values), timed with `triton.testing.do_bench` around
`kernels.triton.experts.grouped_expert_gemm`. Milliseconds a layer and TFLOP/s of the SwiGLU's
6 H I flops per (token, expert) item, per preset and format; `q4_k_m` is llama-quantize's mix
(gate and up q4_k, down q6_k). Formats whose blocks do not divide a preset's widths are skipped
with a line. Needs CUDA.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from ftkit.runtime.spec import ModelSpec
from ftkit.vocab import FormatError, slot_layout

from .cpu_experts import MIXES
from .presets import preset_spec


def measure(spec: ModelSpec, formats: tuple[str, ...], tokens: int, seed: int = 0) -> float:
    """Milliseconds of one grouped GEMM over a MoE layer of `spec` with experts in `formats`."""
    import triton

    from ftkit.kernels.triton.experts import gemm_tiles, grouped_expert_gemm

    layout = slot_layout(spec, formats)
    e, k, h = spec.num_experts, spec.top_k, spec.hidden_size
    g = torch.Generator().manual_seed(seed)
    slots = torch.randint(0, 256, (e, layout.slot_bytes), dtype=torch.uint8, generator=g)
    if formats[0] == "bfloat16":  # finite values, not random bit patterns
        slots.view(torch.bfloat16).copy_(torch.randn(e, layout.slot_bytes // 2, generator=g) * 0.02)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(tokens)]).reshape(-1)
    order = torch.argsort(ids, stable=True)
    i32 = dict(dtype=torch.int32, device="cuda")
    tiles = torch.tensor(gemm_tiles(list(enumerate(torch.bincount(ids, minlength=e).tolist()))), **i32)
    tok, dst = (order // k).to(**i32), order.to(**i32)
    wt = torch.rand(tokens * k, generator=g)[order].cuda()
    x = torch.randn((tokens, h), generator=g).to("cuda", torch.bfloat16)
    y = torch.zeros((tokens * k, h), dtype=torch.bfloat16, device="cuda")
    slots = slots.cuda()
    return triton.testing.do_bench(lambda: grouped_expert_gemm(x, slots, layout, tiles, tok, dst, wt, y),
                                   warmup=5, rep=40)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", default="gpt-oss-20b,qwen3-30b-a3b")
    ap.add_argument("--formats", default="bfloat16,q8_0,q4_k_m,mxfp4,iq4_xs", help="a format, or q4_k_m")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--json", type=Path, help="also write the results here")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("expert_gemm needs CUDA")
    console = Console()
    table = Table(title=f"grouped expert GEMM, {a.tokens} tokens through one layer, uniform routing")
    for col in ("preset", "formats", "ms", "TFLOP/s"):
        table.add_column(col, justify="right")
    rows = []
    for preset in a.presets.split(","):
        spec = preset_spec(preset, 2)
        inter = spec.moe_intermediate_size
        for name in a.formats.split(","):
            formats = MIXES.get(name, (name,) * 3)
            try:
                ms = measure(spec, formats, a.tokens)
            except FormatError as e:
                console.print(f"{preset} {name}: skipped ({e})")
                continue
            tflops = 6 * a.tokens * spec.top_k * spec.hidden_size * inter / ms / 1e9
            rows.append({"preset": preset, "formats": "-".join(formats), "ms": ms, "tflops": tflops})
            table.add_row(preset, name, f"{ms:.3f}", f"{tflops:.1f}")
    console.print(table)
    if a.json:
        a.json.write_text(json.dumps({"device": torch.cuda.get_device_name(), "tokens": a.tokens, "rows": rows},
                                     indent=1))


if __name__ == "__main__":
    main()
