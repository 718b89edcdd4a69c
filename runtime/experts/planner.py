"""Per layer: which active experts are hits, which misses are filled (q), which run on the CPU.

The split follows the fill fraction, q* = m * f with f = B_P / B_H (the profile's
`Bandwidths.ratio`): filling and CPU work then finish together when DMA and CPU reads share
host memory bandwidth. At least one miss is filled whenever there is one, so the
cache keeps warming even when the CPU takes most misses.

The fraction starts from the profile and is then corrected from the runtime's own clock: a smoothed
(EWMA) per-byte time of fills and of CPU experts, each measured while the other branch runs.
Fills and CPU work balance when q * t_fill = (m - q) * t_cpu, so q / m = t_cpu / (t_fill + t_cpu).
A profile that is wrong for this machine or workload therefore costs a few layers, not the run.

With `shared` (hybrid on the native CPU runner, CUDA without Triton) no fraction decides: every miss is left
for the store to split while both branches run (`ExpertStore._share`). On a GPU the split is
decided up front (the host must not wait on either branch), and from outcomes rather than rates
(`balance`): rates leave out when each branch starts (the CPU call is put together after the first
fill is queued) and flatter whichever branch runs alone at the end; with the split from rates the
CPU took ~63% of an extend's misses and the device waited for it every layer. The rates' fraction
(`rate_fraction`) still serves graph decode as its start. Graph decode corrects its own fractions
by the same rule (`rebalanced`, DevicePlanner.adapt).
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


def hybrid_fill_count(m: int, fill_fraction: float) -> int:
    """q = round(m * fill_fraction), within 1..m when m >= 1."""
    return 0 if m == 0 else min(m, max(1, round(m * fill_fraction)))


def rebalanced(fill_fraction: float, device_seconds: float, cpu_seconds: float, gain: float,
               floor: float = 0.0) -> float:
    """The one rule that corrects a hybrid fill fraction from how its two branches ended: it
    moves by `gain` times their relative difference, toward the device when the CPU ended
    later, within floor..1. Both branches counted: one given nothing took 0 s."""
    err = (cpu_seconds - device_seconds) / (cpu_seconds + device_seconds)
    return min(1.0, max(floor, fill_fraction + gain * err))


class Planner:
    def __init__(self, strategy: str, fill_fraction: float | None = None, adapt: bool = True,
                 smoothing: float = 0.2):
        """`fill_fraction`: the profile's (Bandwidths.ratio); `adapt`: correct it from
        measured branch times; `smoothing`: the EWMA weight of each new measurement."""
        if strategy not in (FUSED, OFFLOAD, CPU, HYBRID):
            raise ValueError(f"strategy must be resolved before planning, got {strategy}")
        if strategy == HYBRID and not fill_fraction:
            raise ValueError("hybrid needs a bandwidth ratio B_P / B_H (a profile with PCIe figures, "
                             "or --bandwidth-ratio)")
        self.strategy, self.start_fraction, self.adapt, self.smoothing = strategy, fill_fraction, adapt, smoothing
        self.fill_s_per_byte: float | None = None  # EWMA of measured fill time per byte
        self.cpu_s_per_byte: float | None = None  # EWMA of measured CPU-expert time per byte
        self.fill_fraction: float | None = None  # what `balance` corrects; over `rate_fraction` once set

    @property
    def rate_fraction(self) -> float | None:
        """The fill fraction from the rates: measured once both branches have been timed, else
        the start (the profile's)."""
        if self.adapt and self.fill_s_per_byte and self.cpu_s_per_byte:
            return self.cpu_s_per_byte / (self.fill_s_per_byte + self.cpu_s_per_byte)
        return self.start_fraction

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
        f = self.fill_fraction if self.fill_fraction is not None else self.rate_fraction or 0.5
        self.fill_fraction = rebalanced(f, fill_seconds, cpu_seconds, gain)

    def fill_count(self, misses: int) -> int:
        """How many of `misses` to fill; the rest run on the CPU."""
        if self.strategy in (OFFLOAD, FUSED):
            return misses
        if self.strategy == CPU:
            return 0
        return hybrid_fill_count(misses, self.fill_fraction if self.fill_fraction is not None else self.rate_fraction)

    def plan(self, cache: SlotCache, rows: list[int], fill_all: bool = False, shared: bool = False) -> LayerPlan:
        """`rows`: the layer's distinct active experts, most-used first (they are filled first);
        `fill_all`: fill every miss a slot can take (prefill-sized batches of hybrid, or of the
        cpu strategy with its staging slots: the CPU branch is compute-bound there, a copy costs
        the same for one token or thousands); the cpu strategy otherwise fills none, and uses
        the rows such a batch left resident; `shared`: hybrid
        leaves every miss in `cpu`, most-used first, for the store to split while both branches
        run (`ExpertStore._share`), so no rate estimate decides it."""
        plan = LayerPlan()
        misses = []
        for row in rows:
            slot = cache.lookup(row)
            if slot is None:
                misses.append(row)
            else:
                plan.hits.append((row, slot))
        q = len(misses) if fill_all else 0 if shared else self.fill_count(len(misses))
        slots = cache.claim_many(misses[:q], {r for r, _ in plan.hits})
        plan.fills = list(zip(misses[: len(slots)], slots, strict=True))
        plan.cpu = misses[len(slots):]  # not chosen, or no slot left that this step is not using
        return plan
