"""A graph decode step's small launches, each timed inside a CUDA graph:
`python -m ftkit.tools.bench.dense_kernels --json OUT`.

Past the expert traffic, a hybrid decode token on the qwen3-30b-a3b shape spends about 0.6 ms
in a dozen small launches per layer (docs/benchmarks.md). This times them one by one, as a
captured step runs them (back to back in one graph, so each figure includes the gap between
two launches), at that shape:
- `noop`: a Triton kernel that stores one word: the floor of any launch;
- the dense products of one token (Q/K/V, output projection, router, lm_head) through cuBLAS
  (`F.linear`) and through the Triton GEMV (kernels/triton/gemv.py) at several tile shapes,
  each over enough distinct copies of the weight that nothing is served from the GPU's L2, and
  through the block GEMV on the weight in Q4_K, Q6_K and Q8_0 blocks (split into planes) at a
  sweep of its tiles;
- the router's softmax-top-k, the device planner's `plan` (8 misses, half filled, so 4 victim
  passes: every layer's rows are cycled through a cache that cannot hold them) and the merge,
  at several warp counts;
- `plan` and `plan_tokens` (a 32-token extend) against the cache's size, up to a whole
  qwen3-next-80b-a3b's 8601 slots, hybrid and offload (every miss a victim pass);
- the step's attention (`attention.decode_attention`) at several positions behind a 32k-token
  cache: the time a long agent context adds to every token.
Needs CUDA. `--only attention` (or small, plan, linear) runs one part.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from rich.console import Console
from rich.table import Table

from ftkit.kernels.dequant import dequantize
from ftkit.kernels.quantize import quantize
from ftkit.kernels.triton import attention, zero_copy
from ftkit.kernels.triton import plan as dplan
from ftkit.kernels.triton.block_gemv import block_gemv, block_tiles, pack
from ftkit.kernels.triton.gemv import gemv, tiles
from ftkit.kernels.triton.norm import add_rms_norm
from ftkit.kernels.triton.router import softmax_topk
from ftkit.vocab import PLANE_FORMATS

from .presets import PRESETS, preset_spec

COLD_BYTES = 256 << 20  # weights cycled per replay: past the H200's 50 MB L2


@triton.jit
def _noop(p):
    tl.store(p, 1)


def _us_per_call(calls: list, replays: int = 20) -> float:
    """Microseconds per call of `calls` (zero-argument functions), captured back to back in one
    graph and replayed."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: compiles, cuBLAS heuristics
        for f in calls:
            f()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in calls:
            f()
    g.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        g.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / (replays * len(calls))


def _linears(rows: list, shapes: dict[str, tuple[int, int]]) -> None:
    x = torch.randn(1, 4096 * 4, dtype=torch.bfloat16, device="cuda")
    for name, (n, k) in shapes.items():
        nbytes = n * k * 2
        copies = max(1, min(64, math.ceil(COLD_BYTES / nbytes)))
        ws = [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * 0.02 for _ in range(copies)]
        xk = x[:, :k].contiguous()
        ref = F.linear(xk, ws[0]).float()
        variants = {"cublas": lambda w, xk=xk: F.linear(xk, w)}
        bn0 = tiles(n, k)[0]
        variants["gemv (tiles)"] = lambda w, xk=xk: gemv(xk, w)
        sweep = [(bn, bk, warps) for bn in sorted({max(1, bn0 // 2), bn0, min(16, bn0 * 2)})
                 for bk in (512, 1024, 2048, 4096) if bk <= k for warps in (4, 8)]
        for bn, bk, warps in sweep if n <= 16384 else []:  # lm_head: `tiles` ties cuBLAS; no sweep
            variants[f"gemv bn={bn} bk={bk} w={warps}"] = (
                lambda w, xk=xk, bn=bn, bk=bk, warps=warps: gemv(xk, w, bn=bn, bk=bk, num_warps=warps))
        for label, fn in variants.items():
            err = (fn(ws[0]).float() - ref).abs().max().item()
            us = _us_per_call([lambda w=w, fn=fn: fn(w) for w in ws])
            rows.append(dict(kernel=name, variant=label, us=us, gbps=nbytes / us / 1e3, max_err=err))
        if n >= 1024:  # a router's weight stays float in GGUF files
            _block_linears(rows, name, xk, ws[0])
        del ws


def _block_linears(rows: list, name: str, x: torch.Tensor, w: torch.Tensor) -> None:
    """The same product with the weight kept in GGUF blocks (what a Q4_K_M file stores for
    attention and lm_head), split into planes (kernels/triton/block_gemv.py): the block GEMV at
    its tiles and a sweep of them, its error against the product with the dequantized weight,
    GB/s of block bytes."""
    n, k = w.shape
    for fmt in PLANE_FORMATS:
        raw = quantize(w.float().cpu(), fmt).cuda()
        ref = F.linear(x.float(), dequantize(raw, fmt))
        planes = pack(raw, fmt, n, k)
        copies = max(1, min(64, math.ceil(COLD_BYTES / raw.numel())))
        ps = [planes] + [pack(raw.clone(), fmt, n, k) for _ in range(copies - 1)]
        bn0, c0, w0 = block_tiles(n, k)
        sweep = {(bn0, c0, w0)} | ({(bn, c, warps) for bn in {bn0, min(32, bn0 * 2)} for c in (4, 8, 16)
                                    if c * 64 <= k for warps in (4, 8)} if fmt != "q8_0" else set())
        for bn, c, warps in sorted(sweep):
            calls = [lambda p=p, bn=bn, c=c, warps=warps: block_gemv(x, p, bn=bn, chunks=c, num_warps=warps)
                     for p in ps]
            err = (calls[0]().float() - ref).abs().max().item()
            us = _us_per_call(calls)
            tag = " (tiles)" if (bn, c, warps) == (bn0, c0, w0) else ""
            rows.append(dict(kernel=name, variant=f"block gemv {fmt} bn={bn} c={c} w={warps}{tag}", us=us,
                             gbps=raw.numel() / us / 1e3, max_err=err))


def _small(rows: list, spec) -> None:
    k, e, h = spec.top_k, spec.num_experts, spec.hidden_size
    logits = torch.randn(1, e, dtype=torch.bfloat16, device="cuda")
    for warps in (1, 2, 4):
        us = _us_per_call([lambda warps=warps: softmax_topk(logits, k, True, torch.bfloat16, num_warps=warps)] * 16)
        rows.append(dict(kernel="softmax_topk", variant=f"w={warps}", us=us))
    host = torch.zeros(h + 4 * k + 1, dtype=torch.float32, pin_memory=True)  # alive while mapped
    payload = zero_copy.Mapped(host)
    x = torch.randn(h, dtype=torch.bfloat16, device="cuda")
    ids = torch.randperm(e, device="cuda")[:k].contiguous()
    w = torch.rand(k, dtype=torch.bfloat16, device="cuda")
    for warps in (1, 2, 4, 8):
        rows.append(dict(kernel="plan (4 fills)", variant=f"w={warps}",
                         us=_plan_us(ids, w, x, e, 537, payload, dplan.HYBRID_MODE, warps)))
    dev = torch.randn(k, h, dtype=torch.bfloat16, device="cuda")
    gpos = torch.tensor([0, -1, 1, 2, -1, 3, 4, 5], dtype=torch.int32, device="cuda")[:k]
    rows.append(dict(kernel="merge", variant="as is",
                     us=_us_per_call([lambda: dplan.merge(dev, payload, gpos, h, torch.bfloat16)] * 16)))
    r, d, nw = (torch.randn(1, h, dtype=torch.bfloat16, device="cuda") for _ in range(3))
    rows.append(dict(kernel="add_rms_norm", variant="as is",
                     us=_us_per_call([lambda: add_rms_norm(r, d, nw, 1e-6)] * 16)))


def _cache(layers: int, e: int, cap: int) -> tuple:
    """An empty cache of `cap` slots for `layers` layers of `e` experts: table, owner, stamps,
    clock, counters and a hybrid split of one half."""
    i32, i64 = dict(dtype=torch.int32, device="cuda"), dict(dtype=torch.int64, device="cuda")
    return (torch.full((layers * e,), -1, **i32), torch.full((cap,), -1, **i32), torch.full((cap,), -1, **i64),
            torch.zeros((), **i64), torch.tensor(0.5, device="cuda"), torch.zeros(3, **i64))


def _plan_us(ids, w, x, e: int, cap: int, payload, mode: int, warps: int = 8) -> float:
    """`plan`'s microseconds for one token (k misses) on a cache of `cap` slots: the layers'
    rows are cycled through a cache that cannot hold them, so every fill is a victim pass."""
    k = ids.numel()
    layers = max(200, -(-3 * cap // k))
    table, owner, stamp, clock, ratio, counts = _cache(layers, e, cap)
    out = dplan.LayerBuffers(k, torch.device("cuda"), w.dtype)
    return _us_per_call([lambda b=b: dplan.plan(ids, w, x, b * e, table, owner, stamp, clock, ratio, counts, out,
                                                payload, cap, mode, num_warps=warps) for b in range(layers)], replays=3)


def _plan_tokens_us(ids, w, x, e: int, cap: int, payload) -> float:
    """`plan_tokens`' microseconds for one layer of T tokens [T, k] (hybrid), as `_plan_us`."""
    t, k = ids.shape
    layers = max(50, -(-3 * cap // e))
    table, owner, stamp, clock, ratio, counts = _cache(layers, e, cap)
    out = dplan.TokenBuffers(e, t * k, torch.device("cuda"))
    return _us_per_call([lambda b=b: dplan.plan_tokens(ids, w, x, b * e, e, table, owner, stamp, clock, ratio, counts,
                                                       16, out, payload, cap, dplan.HYBRID_MODE, t)
                         for b in range(layers)], replays=3)


def _planning(rows: list, caps=(537, 2150, 8601), tokens: int = 32) -> None:
    """`plan` and `plan_tokens` against the cache's size: 537 slots is the 12-layer bench
    model's, 2150 the whole qwen3-30b-a3b's and 8601 the whole qwen3-next-80b-a3b's at 35% (the
    whole DeepSeek-V3's 5196 and Kimi-K2's 8063 are below it), at each preset's expert count."""
    for name in ("qwen3-30b-a3b", "qwen3-next-80b-a3b", "deepseek-v3", "kimi-k2"):
        spec = PRESETS[name]  # the whole model: only its expert count, top-k and width are used
        k, e, h = spec.top_k, spec.num_experts, spec.hidden_size
        x = torch.randn(tokens, h, dtype=torch.bfloat16, device="cuda")
        ids = torch.stack([torch.randperm(e, device="cuda")[:k] for _ in range(tokens)])
        w = torch.rand(tokens, k, dtype=torch.bfloat16, device="cuda")
        host = torch.zeros(tokens * h + 4 * tokens * k + 1, dtype=torch.float32, pin_memory=True)
        payload = zero_copy.Mapped(host)
        for cap in caps:
            for mode, label in ((dplan.HYBRID_MODE, "hybrid"), (dplan.OFFLOAD_MODE, "offload")):
                rows.append(dict(kernel=f"plan {name} k={k}", variant=f"{cap} slots, {label}",
                                 us=_plan_us(ids[0], w[0], x[0], e, cap, payload, mode)))
            rows.append(dict(kernel=f"plan_tokens {name} {tokens} tokens", variant=f"{cap} slots, hybrid",
                             us=_plan_tokens_us(ids, w, x, e, cap, payload)))


def _attention(rows: list, spec, positions=(64, 1024, 8192, 32767), capacity: int = 32768) -> None:
    heads, kv_heads, d = spec.num_heads, spec.num_kv_heads, spec.head_dim
    q = torch.randn(1, heads, d, dtype=torch.bfloat16, device="cuda")
    copies = 4  # 64 MB of K/V each: the 50 MB L2 serves none of them
    kv = [[torch.randn(capacity, kv_heads, d, dtype=torch.bfloat16, device="cuda") for _ in range(2)]
          for _ in range(copies)]
    pos = torch.zeros(1, dtype=torch.int64, device="cuda")
    for p in positions:
        pos.fill_(p)  # read by the kernel at replay, as in a captured decode step
        us = _us_per_call([lambda k=k, v=v: attention.decode_attention(q, k, v, pos, None) for k, v in kv] * 4)
        rows.append(dict(kernel=f"attention at {p}", variant="split keys", us=us,
                         gbps=2 * (p + 1) * kv_heads * d * 2 / us / 1e3))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--only", choices=("small", "plan", "linear", "attention"), help="run one part")
    args = ap.parse_args()
    spec = preset_spec("qwen3-30b-a3b", 1)
    h, d = spec.hidden_size, spec.head_dim
    flag = torch.zeros(1, dtype=torch.int32, device="cuda")
    rows = [dict(kernel="noop", variant="triton", us=_us_per_call([lambda: _noop[(1,)](flag)] * 64))]
    if args.only in (None, "small"):
        _small(rows, spec)
    if args.only in (None, "plan"):
        _planning(rows)
    if args.only in (None, "linear"):
        _linears(rows, {"qkv": ((spec.num_heads + 2 * spec.num_kv_heads) * d, h), "o": (h, spec.num_heads * d),
                        "router": (spec.num_experts, h), "lm_head": (spec.vocab_size, h)})
    if args.only in (None, "attention"):
        _attention(rows, spec)
    table = Table(title="a decode step's launches, each inside a CUDA graph (us per launch, gap included)")
    for c in ("kernel", "variant", "us", "GB/s", "max err"):
        table.add_column(c, justify="left" if c in ("kernel", "variant") else "right")
    for r in rows:
        table.add_row(r["kernel"], r["variant"], f"{r['us']:.2f}", f"{r['gbps']:.0f}" if "gbps" in r else "",
                      f"{r['max_err']:.1e}" if "max_err" in r else "")
    Console().print(table)
    if args.json:
        args.json.write_text(json.dumps(dict(device=torch.cuda.get_device_name(), rows=rows), indent=1))


if __name__ == "__main__":
    main()
