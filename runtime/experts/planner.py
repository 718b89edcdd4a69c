"""Per layer: which active experts are hits, which misses are filled (q), which run on the CPU.

The split follows q* = m * B_P / B_H: filling and CPU work then finish together when DMA and
CPU reads share host memory bandwidth. At least one miss is filled whenever there is one, so the
cache keeps warming even when the CPU takes most misses.

The ratio starts from the profile and is then corrected from the runtime's own clock: a smoothed
(EWMA) per-byte time of fills and of CPU experts, each measured while the other branch runs.
Fills and CPU work balance when q * t_fill = (m - q) * t_cpu, so q / m = t_cpu / (t_fill + t_cpu).
A profile that is wrong for this machine or workload therefore costs a few layers, not the run.

With `shared` (hybrid on the native CPU runner, host slots) no ratio decides: every miss is left
for the store to split while both branches run (`ExpertStore._share`). On a GPU the split is
decided up front (the host must not wait on either branch), and from outcomes rather than rates
(`balance`): rates leave out when each branch starts (the CPU call is put together after the first
fill is queued) and flatter whichever branch runs alone at the end; with the split from rates the
CPU took ~63% of an extend's misses and the device waited for it every layer. The rate ratio still
serves graph decode as its starting fill fraction.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ftkit.vocab import CPU, FUSED, HYBRID, OFFLOAD

from .cache import SlotCache

CPU_MAX_TOKENS = 16  # routed tokens per active expert above which hybrid fills every miss


@dataclass
class LayerPlan:
    hits: list[tuple[int, int]] = field(default_factory=list)  # (row, slot) already resident
    fills: list[tuple[int, int]] = field(default_factory=list)  # (row, slot) to copy in, then run on device
    cpu: list[int] = field(default_factory=list)  # rows run on the CPU from the host pool

    @property
    def misses(self) -> int:
        return len(self.fills) + len(self.cpu)


def hybrid_fill_count(m: int, ratio: float) -> int:
    """q = round(m * B_P / B_H), within 1..m when m >= 1."""
    return 0 if m == 0 else min(m, max(1, round(m * ratio)))


class Planner:
    def __init__(self, strategy: str, ratio: float | None = None, adapt: bool = True, smoothing: float = 0.2):
        """`ratio`: the profile's fill fraction; `adapt`: correct it from measured branch times;
        `smoothing`: the EWMA weight of each new measurement."""
        if strategy not in (FUSED, OFFLOAD, CPU, HYBRID):
            raise ValueError(f"strategy must be resolved before planning, got {strategy}")
        if strategy == HYBRID and not ratio:
            raise ValueError("hybrid needs a bandwidth ratio B_P / B_H (a profile with PCIe figures, "
                             "or --bandwidth-ratio)")
        self.strategy, self.prior, self.adapt, self.smoothing = strategy, ratio, adapt, smoothing
        self.fill_s_per_byte: float | None = None  # EWMA of measured fill time per byte
        self.cpu_s_per_byte: float | None = None  # EWMA of measured CPU-expert time per byte
        self.split: float | None = None  # the fill fraction `balance` corrects; over `ratio` once set

    @property
    def ratio(self) -> float | None:
        """The fill fraction in use: measured once both branches have been timed, else the prior."""
        if self.adapt and self.fill_s_per_byte and self.cpu_s_per_byte:
            return self.cpu_s_per_byte / (self.fill_s_per_byte + self.cpu_s_per_byte)
        return self.prior

    def _ewma(self, old: float | None, new: float) -> float:
        return new if old is None else old + self.smoothing * (new - old)

    def observe_fill(self, nbytes: int, seconds: float) -> None:
        if nbytes > 0 and seconds > 0:
            self.fill_s_per_byte = self._ewma(self.fill_s_per_byte, seconds / nbytes)

    def observe_cpu(self, nbytes: int, seconds: float) -> None:
        if nbytes > 0 and seconds > 0:
            self.cpu_s_per_byte = self._ewma(self.cpu_s_per_byte, seconds / nbytes)

    def balance(self, fill_seconds: float, cpu_seconds: float, gain: float = 0.3) -> None:
        """Correct the fill fraction from one layer's outcome: when its fills and its CPU branch
        ended, both counted from the first fill's start (the CPU's from its own later start plus
        that lead). The fraction moves by `gain` times the relative difference, toward the fills
        when the CPU ended later, so the two end together whatever the rates. A branch given
        nothing counts 0 s: without that, a split that once gave every miss to the fills would
        never hear from the CPU again."""
        if fill_seconds < 0 or cpu_seconds < 0 or fill_seconds + cpu_seconds <= 0:
            return
        f = self.split if self.split is not None else self.ratio or 0.5
        err = (cpu_seconds - fill_seconds) / (cpu_seconds + fill_seconds)
        self.split = min(1.0, max(0.0, f + gain * err))

    def fill_count(self, misses: int) -> int:
        """How many of `misses` to fill; the rest run on the CPU."""
        if self.strategy in (OFFLOAD, FUSED):
            return misses
        if self.strategy == CPU:
            return 0
        return hybrid_fill_count(misses, self.split if self.split is not None else self.ratio)

    def plan(self, cache: SlotCache, rows: list[int], fill_all: bool = False, shared: bool = False) -> LayerPlan:
        """`rows`: the layer's distinct active experts, most-used first (they are filled first);
        `fill_all`: hybrid fills every miss (prefill-sized batches: the CPU branch is
        compute-bound there, a copy costs the same for one token or thousands); `shared`: hybrid
        leaves every miss in `cpu`, most-used first, for the store to split while both branches
        run (`ExpertStore._share`), so no rate estimate decides it."""
        plan = LayerPlan()
        if self.strategy == CPU:
            plan.cpu = list(rows)
            return plan
        misses = []
        for row in rows:
            slot = cache.lookup(row)
            if slot is None:
                misses.append(row)
            else:
                plan.hits.append((row, slot))
        q = len(misses) if fill_all else 0 if shared else self.fill_count(len(misses))
        protected = {r for r, _ in plan.hits}
        for i, row in enumerate(misses):
            slot = cache.claim(row, protected) if i < q else None
            if slot is None:  # not chosen, or no slot left that this step is not using
                plan.cpu.append(row)
            else:
                plan.fills.append((row, slot))
                protected.add(row)
        return plan
