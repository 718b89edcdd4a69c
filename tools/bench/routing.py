"""Routing overrides for benchmarks: record a run's routing, replay it, or synthesise it.

Random weights route almost uniformly, so the cache hit rate sits near the cached fraction;
real models reuse experts from token to token. A trace recorded from a real run, or the
synthetic generator's `reuse` knob (the chance that each of a token's k experts repeats one of
the previous token's in that layer), measures cache policy on realistic reuse.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
import triton
import triton.language as tl

from ftkit.runtime.models.decoder import MoEDecoder


class RoutingOverride:
    """Replaces `decoder.route` for the duration of a benchmark."""

    graph_safe = False  # whether a captured decode step may replay it (no host state per call)

    def __init__(self, decoder: MoEDecoder):
        self.decoder = decoder
        self.real_route = decoder.route
        self.trace: list[dict[int, list[list[int]]]] = []  # per forward: layer -> ids per token
        self.step = -1
        decoder.route = self._route  # type: ignore[method-assign]

    def next_step(self) -> None:
        self.step += 1

    def _route(self, i: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.real_route(i, x)

    def close(self) -> None:
        self.decoder.route = self.real_route  # type: ignore[method-assign]


class Recorder(RoutingOverride):
    def _route(self, i: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ids, w = self.real_route(i, x)
        while len(self.trace) <= self.step:
            self.trace.append({})
        self.trace[self.step][i] = ids.tolist()
        return ids, w

    def save(self, path: Path) -> None:
        Path(path).write_text(json.dumps({"steps": [{str(k): v for k, v in s.items()} for s in self.trace]}))


def _uniform(ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    return ids, torch.full(ids.shape, 1.0 / ids.shape[-1], dtype=dtype, device=ids.device)


class Replayer(RoutingOverride):
    """Replays a recorded trace (cycling when the run is longer than the trace)."""

    def __init__(self, decoder: MoEDecoder, path: Path):
        super().__init__(decoder)
        steps = json.loads(Path(path).read_text())["steps"]
        self.trace = [{int(k): v for k, v in s.items()} for s in steps]
        if not self.trace:
            raise ValueError(f"{path}: empty routing trace")

    def _route(self, i: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows = self.trace[self.step % len(self.trace)].get(i)
        if rows is None or len(rows) != x.shape[0]:  # shape differs from the recording: route for real
            return self.real_route(i, x)
        return _uniform(torch.tensor(rows, device=x.device), x.dtype)


class Synthetic(RoutingOverride):
    """Each token keeps each of the previous token's experts in that layer with probability
    `reuse` and draws the rest uniformly from the others. The sequence is drawn up front,
    `tokens` per layer (then cycled), so drawing never counts in a timed run and a prefill
    chunk or an extend gets the same locality as decode steps. The position in the sequence is a
    device counter, so a CUDA graph replays the draw as an eager step makes it. The router still
    runs and its choice is replaced, so a step costs what a real model's does, plus one launch
    (`pick`) on CUDA: picked by six torch ops instead of the router, a cpu-strategy decode layer
    spent ~10 us on them where the router takes ~5 (H100 trace, q4km)."""

    graph_safe = True

    def __init__(self, decoder: MoEDecoder, reuse: float, tokens: int = 4096, seed: int = 0):
        super().__init__(decoder)
        if not 0 <= reuse <= 1:
            raise ValueError("reuse must be within 0..1")
        spec = decoder.spec
        rng = np.random.default_rng(seed)
        self.rows = {i: _markov(rng, tokens, spec.num_experts, spec.top_k, reuse) for i in spec.moe_layers}
        self.cursor: dict[int, torch.Tensor] = {}  # layer -> int64 [] on the device

    def _route(self, i: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.real_route(i, x)  # paid for as a real model pays it; its choice is replaced below
        rows, t = self.rows[i], x.shape[0]
        if i not in self.cursor:  # once (an eager call): picking then stays on the device
            rows = self.rows[i] = rows.to(x.device)
            self.cursor[i] = torch.zeros((), dtype=torch.int64, device=x.device)
        return pick(rows, self.cursor[i], t, x.dtype, kernel=x.is_cuda and t <= PICK_TOKENS)


PICK_TOKENS = 64  # a decode step's or an extend's tokens: one program picks them (a prompt's: torch)


def pick(rows: torch.Tensor, cursor: torch.Tensor, t: int, dtype: torch.dtype,
         kernel: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [t, k], weights 1 / k as `dtype`): rows[(cursor + j) % len(rows)] for j < t, then
    cursor += t (int64 [] on rows' device); in one launch where `kernel` (t <= PICK_TOKENS)."""
    if not kernel:
        picked = rows[(cursor + torch.arange(t, device=rows.device)) % rows.shape[0]]
        cursor.add_(t)
        return _uniform(picked, dtype)
    n, k = rows.shape
    ids = torch.empty((t, k), dtype=rows.dtype, device=rows.device)
    weights = torch.empty((t, k), dtype=dtype, device=rows.device)
    w = torch.tensor(1.0 / k, dtype=dtype).item()  # 1 / k as `dtype` rounds it (exact in float32)
    _pick[(1,)](rows, cursor, ids, weights, t, n, k, w, BT=triton.next_power_of_2(t), BK=triton.next_power_of_2(k),
                num_warps=1)
    return ids, weights


@triton.jit
def _pick(rows_ptr, cursor_ptr, ids_ptr, w_ptr, T, N, K, W, BT: tl.constexpr, BK: tl.constexpr):
    """ids[t] = rows[(cursor + t) % N], weights W, cursor += T: one program, one warp."""
    c = tl.load(cursor_ptr)
    t, k = tl.arange(0, BT), tl.arange(0, BK)
    m = (t[:, None] < T) & (k[None, :] < K)
    src = ((c + t) % N)[:, None] * K + k[None, :]
    tl.store(ids_ptr + t[:, None] * K + k[None, :], tl.load(rows_ptr + src, mask=m), mask=m)
    tl.store(w_ptr + t[:, None] * K + k[None, :], tl.full([BT, BK], W, tl.float32), mask=m)
    tl.debug_barrier()  # every lane has read the cursor
    tl.store(cursor_ptr, c + T)


def _markov(rng: np.random.Generator, tokens: int, experts: int, k: int, reuse: float) -> torch.Tensor:
    out = np.empty((tokens, k), dtype=np.int64)
    row = list(rng.choice(experts, k, replace=False))
    for t in range(tokens):
        keep = [e for e, r in zip(row, rng.random(k), strict=True) if r < reuse]
        fresh = [e for e in rng.permutation(experts)[: 2 * k] if e not in keep]  # >= k - len(keep) left
        row = keep + fresh[: k - len(keep)]
        out[t] = row
    return torch.from_numpy(out)
