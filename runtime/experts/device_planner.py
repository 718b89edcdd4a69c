"""Device-side planning for decode and short extends: hits, fills, victims and the CPU set decided on the GPU.

The host planner (`planner.py`) reads each layer's routing back to the host, which costs a
synchronisation per layer and keeps the host on the critical path. Here every decision is made
on the device, with fixed shapes, so a whole decode step can be captured in a CUDA graph. State:
a residency table (row -> slot), each slot's owner row and last-use stamp (LRU), a clock. Per
MoE layer, six launches and no host work:
- `plan` (one Triton program, kernels/triton/plan.py): hits, q fills, victims, table updates,
  the device work list and the CPU payload in mapped memory;
- `ring`: the doorbell the C++ worker polls; it runs the CPU set from the host pool meanwhile
  (a layer that gives the CPU nothing rings no bell and waits for none);
- the grouped GEMV over hits and fills (two kernels): hits read their slots, fills read the
  mapped host pool (zero-copy) and write their victim slots as they go;
- `wait_done`, then `merge`: one row per routed item, summed in top-k order.
A short extend (a few tokens after a prefix hit, GraphDecode.extend) runs the same way, eagerly:
`plan_tokens` decides per expert across the tokens, and a grouped GEMM (one tile per device
expert, fills read through from mapped memory) replaces the GEMV; the host never waits for a
layer's routing, so it queues the whole forward pass ahead of the GPU.

The host `SlotCache` stays the state of record between decode runs: `to_device()` loads it
before graph decode and `to_host()` writes the device state back before the host planner runs
again (prefill), so the two planners never disagree about what a slot holds.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from ftkit.kernels.cpu import worker_payload
from ftkit.kernels.triton import plan, zero_copy
from ftkit.kernels.triton.experts import GEMM_M, grouped_expert_gemm, grouped_expert_gemv
from ftkit.vocab import CPU, FUSED, HYBRID, OFFLOAD

from ..spec import ModelSpec
from .cache import SlotCache
from .planner import CPU_MAX_TOKENS, rebalanced
from .pool import HostPool
from .stats import ExpertStats

MODES = {FUSED: plan.OFFLOAD_MODE, OFFLOAD: plan.OFFLOAD_MODE, CPU: plan.CPU_MODE, HYBRID: plan.HYBRID_MODE}
MAX_TOKENS = min(64, GEMM_M)  # tokens of a device-planned extend (as measured; its pinned worker buffers follow): one GEMM tile an expert


class _FillFraction:
    """A hybrid fill fraction and its device copy, adapted from the counters of the layers that
    gave the CPU work: one for decode tokens, one for extends (the CPU's cost per expert
    grows with its tokens, the GPU's hardly)."""

    def __init__(self, fraction: float, device: torch.device):
        self.fraction = fraction  # host copy: adapting never synchronises
        self.tensor = torch.tensor(fraction, dtype=torch.float32, device=device)
        self.seen = (0, 0, 0)  # (gpu ns, cpu ns, layers) at the last update


class DevicePlanner:
    def __init__(self, spec: ModelSpec, pool: HostPool, cache: SlotCache, strategy: str, fill_fraction: float | None,
                 kernel, threads: int, stats: ExpertStats, int8: bool = False):
        """`kernel`: the loaded CPU kernel (its doorbell worker runs the CPU set, on the int8
        path where `int8`)."""
        if strategy not in (FUSED, OFFLOAD, CPU, HYBRID):
            raise ValueError(f"device planning needs a resolved strategy, not {strategy}")
        k, cap = spec.top_k, cache.capacity
        if strategy != CPU and cap < 2 * k:
            raise ValueError(f"device planning needs at least {2 * k} cache slots (2 x top-k), got {cap}")
        self.spec, self.pool, self.cache, self.strategy, self.stats = spec, pool, cache, strategy, stats
        dev = cache.device
        self.rows = spec.num_expert_rows
        self.table = torch.full((self.rows,), -1, dtype=torch.int32, device=dev)  # row -> slot
        self.owner = torch.full((cap,), -1, dtype=torch.int32, device=dev)  # slot -> row
        self.stamp = torch.full((cap,), -1, dtype=torch.int64, device=dev)  # slot -> last use (-1: free)
        self.clock = torch.zeros((), dtype=torch.int64, device=dev)
        self.counts = torch.zeros((spec.num_moe_layers, 3), dtype=torch.int64, device=dev)  # hits, fills, cpu
        self.start_fraction = fill_fraction or 1.0
        # decode's, extends'
        self.fractions = (_FillFraction(self.start_fraction, dev), _FillFraction(self.start_fraction, dev))
        host_addr = torch.tensor([pool.slot(r).data_ptr() for r in range(self.rows)], dtype=torch.int64)
        mapped = dev.type == "cuda"
        self.addr = (torch.tensor([zero_copy.device_pointer(a) for a in host_addr.tolist()], dtype=torch.int64)
                     if mapped else host_addr).to(dev)
        self.tokens = torch.zeros(k, dtype=torch.int32, device=dev)  # batch 1: every item is token 0
        self.extend_buffers = plan.TokenBuffers(spec.num_experts, MAX_TOKENS * k, dev)  # serve every extend layer
        self.on_device = False
        self.worker = None
        if strategy in (CPU, HYBRID):
            if kernel is None:
                raise ValueError("the CPU branch of device planning needs the compiled CPU kernel")
            h = spec.hidden_size
            pin = dict(pin_memory=mapped)
            self.ctrl = torch.zeros(32, dtype=torch.int32, **pin)
            self.payload = torch.zeros(worker_payload(MAX_TOKENS, k, h), dtype=torch.float32, **pin)
            self.out = torch.zeros((MAX_TOKENS * k, h), dtype=torch.float32, **pin)
            # device time and layers (those with CPU items), for decode then for extends
            self.gpu_ns = torch.zeros(4, dtype=torch.int64, **pin)
            self.busy_ns = torch.zeros(4, dtype=torch.int64)  # the worker's compute time, layers (same)
            self.rung = torch.zeros(1, dtype=torch.int64, device=dev)  # GPU clock at the ring
            total = torch.zeros(4, dtype=torch.int64, device=dev)  # gpu_ns's values, kept on the device
            self.gpu_total = (total[:2], total[2:])
            view = (lambda t, off=0: zero_copy.Mapped(t, off)) if mapped else (lambda t, off=0: t[off:])
            self.d_bell, self.d_done = view(self.ctrl, zero_copy.BELL), view(self.ctrl, zero_copy.DONE)
            self.d_payload, self.d_out = view(self.payload), view(self.out)
            self.d_gpu_ns = (view(self.gpu_ns), view(self.gpu_ns, 2))
            self.worker = kernel.start_worker(pool.layout, host_addr, MAX_TOKENS, k, self.ctrl, self.payload,
                                              self.out, self.busy_ns, threads, int8)

    # ---- host <-> device state ---------------------------------------------------------------
    @torch.inference_mode()
    def to_device(self) -> None:
        """Load the host cache's residency and LRU order (before graph decode)."""
        if self.on_device:
            return
        c, cap = self.cache, self.cache.capacity
        owner, stamp = [-1] * cap, [-1] * cap
        for age, (row, slot) in enumerate(c.lru.items()):  # least recent first
            owner[slot], stamp[slot] = row, age
        self.table.copy_(c.table)
        self.owner.copy_(torch.tensor(owner, dtype=torch.int32))
        self.stamp.copy_(torch.tensor(stamp, dtype=torch.int64))
        self.clock.fill_(len(c.lru))
        self.on_device = True

    @torch.inference_mode()
    def to_host(self) -> None:
        """Write the device residency back into the host cache (before the host planner runs)."""
        if not self.on_device:
            return
        self.flush_stats()
        c = self.cache
        owner, stamp = self.owner.tolist(), self.stamp.tolist()
        c.table.copy_(self.table.cpu())
        used = sorted((s for s, row in enumerate(owner) if row >= 0), key=stamp.__getitem__)  # oldest first
        c.lru = OrderedDict((owner[s], s) for s in used)
        c.free = [s for s in reversed(range(len(owner))) if owner[s] < 0]
        self.on_device = False

    @torch.inference_mode()
    def flush_stats(self) -> None:
        """Move the device counters into the store's ExpertStats (synchronises)."""
        snap = self.counts.clone()
        self.counts.sub_(snap)  # stream-ordered: steps queued after the snapshot keep their counts
        counts = snap.cpu()
        if counts.any():
            for moe, (hits, fills, cpu) in enumerate(counts.tolist()):
                self.stats.add(self.spec.moe_layers[moe], hits, fills, cpu)

    @property
    def fill_fraction(self) -> float:
        """Decode's hybrid fill fraction."""
        return self.fractions[0].fraction

    @torch.inference_mode()
    def adapt(self, extend: bool = False, step: float = 0.02, gain: float = 0.5) -> None:
        """Between steps (or extends: `extend`), move that kind's fill fraction toward balance.
        Over its layers that gave the CPU work since the last call, the GPU's time for its share
        (ring to wait, GPU clock) against the worker's busy time: the fraction moves by `gain`
        times their relative difference (a slower CPU side gets fewer experts). When no layer
        gave the CPU work, it steps down to offer some again. Without a GPU clock (the
        interpreter) it stays put."""
        if self.strategy != HYBRID:
            return
        split, i = self.fractions[extend], 2 * extend
        gpu, cpu, layers = int(self.gpu_ns[i]), int(self.busy_ns[i]), int(self.busy_ns[i + 1])
        d_gpu, d_cpu, d_layers = gpu - split.seen[0], cpu - split.seen[1], layers - split.seen[2]
        split.seen = (gpu, cpu, layers)
        if d_layers and not d_gpu:
            return
        if d_layers:
            split.fraction = rebalanced(split.fraction, d_gpu, d_cpu, gain, floor=0.05)
        else:
            split.fraction = max(0.05, split.fraction - step)
        split.tensor.fill_(split.fraction)

    def rebase(self) -> None:
        """Forget the split counters so far (call after a sync): the next `adapt` sees only the
        steps after this. A graph's warm-up step compiles kernels between the doorbell and the
        wait, and its GPU side, seconds long, would push the fraction to its floor."""
        if self.strategy != HYBRID:
            return
        for i, split in enumerate(self.fractions):
            split.seen = (int(self.gpu_ns[2 * i]), int(self.busy_ns[2 * i]), int(self.busy_ns[2 * i + 1]))

    def restart(self) -> None:
        """Both fill fractions back to where they started, the counters forgotten (after a
        sync): what start-up's warm-up measured, compile time above all, steers nothing."""
        for split in self.fractions:
            split.fraction = self.start_fraction
            split.tensor.fill_(split.fraction)
        self.rebase()

    def takes(self, tokens: int) -> bool:
        """Whether `run` plans layers of this many tokens: one, or up to MAX_TOKENS. Offload only
        where a layer's experts all fit the cache at once (nothing else could run a miss that
        finds no free slot); the others send such misses to the CPU (fused holds every expert)."""
        if tokens == 1:
            return True
        experts = min(tokens * self.spec.top_k, self.spec.num_experts)
        return tokens <= MAX_TOKENS and (self.strategy != OFFLOAD or experts <= self.cache.capacity)

    # ---- one MoE layer, graph-safe ------------------------------------------------------------
    def run(self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
            final: bool = True) -> torch.Tensor:
        """Gate-weighted sum of the routed experts for x [T, H] (no host sync): one decode
        token, or a few (`takes`) planned as one layer (an Experts; `final` does not
        matter here: nothing is streamed)."""
        if x.shape[0] > 1:
            return self._extend(self.spec.moe_index(layer), x, ids, weights)
        s, k, cap = self.spec, self.spec.top_k, self.cache.capacity
        moe = s.moe_index(layer)
        out = plan.LayerBuffers(k, x.device, weights.dtype)
        plan.plan(ids.reshape(-1), weights.reshape(-1), x.reshape(-1), moe * s.num_experts, self.table, self.owner,
                  self.stamp, self.clock, self.fractions[0].tensor, self.counts[moe], out,
                  self.d_payload if self.worker is not None else None, cap, MODES[self.strategy], MAX_TOKENS)
        if self.worker is not None:  # the CPU set starts first and runs while the GPU computes
            zero_copy.ring(self.d_bell, moe + 1, self.rung, out.gcount)
        dev = None
        if cap:
            dev = grouped_expert_gemv(x, self.cache.slots, self.pool.layout.for_layer(moe), out.gslot, self.tokens,
                                      out.gw, out.gcount, self._fills(out.gfill, out.grow))
        return plan.merge(dev, self._cpu_rows(moe, out.gcount, 0), out.gpos, s.hidden_size, x.dtype)

    def _extend(self, moe: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """A few tokens' layer: experts deduplicated across the tokens, one grouped GEMM tile per
        device expert (fills read through), the CPU experts on the worker."""
        s, cap = self.spec, self.cache.capacity
        t, k = ids.shape
        out, x = self.extend_buffers, x.contiguous()
        plan.plan_tokens(ids, weights, x, moe * s.num_experts, s.num_experts, self.table, self.owner, self.stamp,
                         self.clock, self.fractions[1].tensor, self.counts[moe], CPU_MAX_TOKENS, out,
                         self.d_payload if self.worker is not None else None, cap, MODES[self.strategy], MAX_TOKENS)
        if self.worker is not None:
            zero_copy.ring(self.d_bell, moe + 1, self.rung, out.gcount)
        dev = None
        if cap:
            dev = torch.empty((MAX_TOKENS * k, s.hidden_size), dtype=x.dtype, device=x.device)
            grouped_expert_gemm(x, self.cache.slots, self.pool.layout.for_layer(moe), out.tiles, out.tokens, out.dst,
                                out.weights, dev, count=out.gcount, fills=self._fills(out.tfill, out.trow))
        return plan.merge(dev, self._cpu_rows(moe, out.gcount, 1), out.gpos, s.hidden_size, x.dtype, t, k)

    def _fills(self, flags: torch.Tensor, rows: torch.Tensor):
        """The device kernels' fill-through arguments (none where nothing is filled)."""
        return (flags, rows, self.addr) if self.strategy in (OFFLOAD, HYBRID) else None

    def _cpu_rows(self, moe: int, count: torch.Tensor, kind: int):
        """After the device work: wait for the worker (if rung) and give its mapped output rows."""
        if self.worker is None:
            return None
        zero_copy.wait_done(self.d_done, moe + 1, self.rung, count, self.gpu_total[kind], self.d_gpu_ns[kind])
        return self.d_out

    def close(self) -> None:
        if self.worker is not None:
            self.worker.stop()
            self.worker = None
