"""RuntimeOptions -> Resolved: every choice the options leave open, made once, for one model on
one machine, before any weight is read.

The device (cuda when a GPU is present), the bandwidth profile (ft-calibrate's for this GPU when
none is given), the ratio hybrid starts from, the strategy (`auto`: fused when every expert fits
the device, hybrid with a ratio, else cpu on the CPU and offload on a GPU), the compute dtype and
the device memory plan, whose expert slots are the cache's size. What resolving asks of the
machine comes in as a `Machine`, so tests pass their own GPU, free memory and profile folder.
"""

from __future__ import annotations

import platform
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ftkit.kernels.cpu import int8_activations, load
from ftkit.kernels.triton import optional
from ftkit.vocab import (
    AUTO,
    BLOCK_FORMATS,
    CPU,
    FUSED,
    HYBRID,
    OFFLOAD,
    STRATEGIES,
    human_bytes,
    storage_dtype,
)

from ..experts.cpu import CPUExecutor
from ..ftw.reader import FTWModel
from ..models.layers import flash_behind_cache
from ..models.stored import stored_family
from ..profile import GPU, Profile, default_path, gpu_identity, load_profile, profiles_dir
from ..spec import ModelSpec
from .memory import MemoryPlan, base_plan, dense_device_bytes, device_blocks

if TYPE_CHECKING:
    from .loader import RuntimeOptions


def note(line: str) -> None:
    """A line about a choice made for the user: stderr, so that `--json` output stays clean."""
    print(f"ftkit: {line}", file=sys.stderr)


@dataclass(frozen=True)
class Machine:
    """What resolving asks of the machine it runs on."""

    device: torch.device
    gpu: GPU | None = None  # the CUDA device's identity, which its profile is found by
    free_bytes: int | None = None  # device memory free now: VRAM, or available RAM on cpu (None: unknown)
    host: str = field(default_factory=platform.node)
    profiles: Path = field(default_factory=profiles_dir)  # where ft-calibrate saves profiles

    @classmethod
    def detect(cls, device: str | None) -> Machine:
        """The machine at hand running on `device` (None: cuda when a GPU is present, else cpu)."""
        dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if dev.type != "cuda":
            return cls(dev, free_bytes=_available_ram())
        if not torch.cuda.is_available():
            raise ValueError("--device cuda, but no CUDA device is available")
        return cls(dev, gpu_identity(dev.index), torch.cuda.mem_get_info(dev)[0])


def _available_ram() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


@dataclass(frozen=True)
class Resolved:
    """A runtime's options with every choice made: what `Runtime` is built from."""

    options: RuntimeOptions  # as given (kv_tokens: what this resolution planned for)
    device: torch.device
    strategy: str  # never auto
    ratio: float | None  # B_P / B_H the hybrid planner starts from
    profile: Profile | None  # the profile the ratio came from
    threads: int  # CPU expert threads (the profile row the ratio was read from)
    dtype: torch.dtype  # compute dtype
    memory: MemoryPlan  # the device memory plan; its expert slots are the cache's size
    blocks: dict[str, str] = field(default_factory=dict)  # dense tensors kept in GGUF blocks (memory.device_blocks)
    cpu_products: bool = False  # a 16-bit CPU run with the compiled CPU kernel: its dense products on the kernel

    @property
    def cache_slots(self) -> int:
        return self.memory.expert_slots

    @property
    def kv_tokens(self) -> int:
        return self.memory.kv_tokens


@dataclass(frozen=True)
class Fit:
    """How many expert slots the device budget holds beside the rest of the plan."""

    slots: int
    rows: int
    where: str  # the budget, for people: "the GPU's 139.00 GiB free"

    @property
    def all(self) -> bool:
        return self.slots >= self.rows

    def __str__(self) -> str:
        share = f"all {self.rows} experts" if self.all else f"{self.slots / self.rows:.0%} of experts"
        return f"{share} fit {self.where}"


def resolve_strategy(strategy: str, ratio: float | None, ratio_said: str, device: torch.device,
                     fit: Fit | None, smaller_cache: str | None = None) -> tuple[str, str | None]:
    """The concrete strategy and, for `auto`, why: `fused` when every expert fits the GPU
    (`fit`; None: its memory is unknown) and no smaller cache was asked for (`smaller_cache`
    says by which flag; on a CPU the device tier is host memory: a second copy of every expert
    there would buy nothing over `cpu`); else `hybrid` when a ratio is known (`ratio_said`: where from), `cpu`
    when it is 0 (a profile measured without a GPU); else `cpu` when the device tier is host
    memory (copying slots within RAM buys nothing) and `offload` on a GPU."""
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; choose from {', '.join(STRATEGIES)}")
    if strategy != AUTO:
        return strategy, None
    room = str(fit) if fit is not None else "the device's free memory is unknown"
    if fit is not None and fit.all and smaller_cache is None and device.type != "cpu":
        return FUSED, room
    room = f"{smaller_cache}; {room}" if smaller_cache else room
    if ratio is not None:
        return HYBRID if ratio > 0 else CPU, f"{ratio_said}; {room}"
    if device.type == "cpu":
        return CPU, f"the device tier is host memory; {room}"
    return OFFLOAD, f"no profile for this GPU (run ft-calibrate) and no --bandwidth-ratio; {room}"


def default_dtype(embed: str, device: torch.device) -> str:
    """The compute dtype without --dtype: the weights' own float; for GGUF blocks bfloat16, where
    the CPU kernel multiplies experts, attention and lm_head on int8 activations as llama.cpp's
    CPU path does (a 3-layer Q4_K_M on the dev box's 2 cores decoded 34.6 tok/s at float32, 88 at
    bfloat16) and a GPU reads half the dense bytes with flash prefill; float32 only on a CPU
    without the compiled kernel (the torch path gains nothing from 16 bits there). `--dtype
    float32` stays the exact reference: blocks dequantize exactly to float32."""
    if embed not in BLOCK_FORMATS:
        return embed
    return "bfloat16" if device.type == "cuda" or load() is not None else "float32"


def cache_capacity(strategy: str, cache_slots: int | None, rows: int, staging: int = 0) -> int:
    """Device cache slots a resolved strategy uses for a requested size (None: all rows); the
    cpu strategy's are `staging` (`prefill_staging`) whatever the size asked."""
    if strategy == FUSED:
        return rows
    if strategy == CPU:
        return staging
    capacity = rows if cache_slots is None else min(cache_slots, rows)
    if capacity < 1:
        raise ValueError(f"strategy {strategy} needs a cache of at least one expert slot")
    return capacity


def prefill_staging(spec: ModelSpec, plan: MemoryPlan, budget: int | None, stream_prefill: bool | None) -> int:
    """The cpu strategy's device slots on a GPU: two layers' experts, where long prompts stream
    whole layers through and run on the GPU (what llama.cpp does with a big batch whose experts
    live in host memory), while decode and short extends compute on the CPU. A 4096-token
    prompt ran at 630 tok/s on the CPU kernel (q4km, BV), hybrid's streamed at 36.3k. 0 where
    streaming is off (`stream_prefill=False`) or the budget leaves less room (said in one line)."""
    staging = min(spec.num_expert_rows, 2 * spec.num_experts)
    if stream_prefill is False:
        return 0
    if budget is not None and plan.slots_fitting(budget) < staging:
        note(f"strategy cpu: no room for two layers of experts ({human_bytes(staging * plan.slot_bytes)}) "
             "beside the rest of the plan: long prompts run on the CPU too")
        return 0
    return staging


def _profile(opts: RuntimeOptions, machine: Machine) -> Profile | None:
    """`--profile`, read; without it (nor a --bandwidth-ratio), ft-calibrate's profile for this
    GPU when there is one and it was measured here. Says which in one line, or why not."""
    if opts.profile is not None:
        profile = load_profile(opts.profile)
        if why := profile.mismatch(machine.gpu, machine.host):
            note(f"profile {_shown(opts.profile)} {why}: its figures are only a start")
        return profile
    if not opts.find_profile or opts.bandwidth_ratio is not None or machine.gpu is None or not machine.gpu.uuid:
        return None
    path = default_path(machine.gpu, machine.profiles)
    if not path.is_file():
        return None
    try:
        profile = load_profile(path)
        profile.bandwidths()  # has figures: a profile nobody asked for must not stop the run
    except ValueError as e:
        note(f"not using {_shown(path)}: {e}")
        return None
    if why := profile.mismatch(machine.gpu, machine.host):
        note(f"not using profile {_shown(path)}: it {why} (run ft-calibrate here)")
        return None
    note(f"profile {_shown(path)}" + (f" (calibrated {profile.created[:10]})" if profile.created else ""))
    return profile


def _ratio_said(ratio: float | None, profile: Profile | None) -> str:
    if profile is None:
        return f"--bandwidth-ratio {ratio}"
    return f"profile ratio {ratio:.2f}" if ratio else "the profile has no PCIe figures (measured without a GPU)"


def _fit(plan: MemoryPlan, rows: int, gpu_budget: int | None, budget: int | None, given: bool,
         device: torch.device) -> Fit | None:
    """What the device holds of the experts: within --gpu-budget, else within `budget` (`given`
    by the caller, else what is free)."""
    if gpu_budget is not None:
        return Fit(plan.slots_fitting(gpu_budget), rows, f"--gpu-budget {human_bytes(gpu_budget)}")
    if budget is None:
        return None
    if given:
        where = f"the device budget of {human_bytes(budget)}"
    elif device.type == "cuda":
        where = f"the GPU's {human_bytes(budget)} free"
    else:
        where = f"the {human_bytes(budget)} of host memory free beside the host pool"
    return Fit(plan.slots_fitting(budget), rows, where)


def _smaller_cache(opts: RuntimeOptions, requested: int | None, rows: int) -> str | None:
    """The flag that asked for a cache smaller than every expert row, as given."""
    if requested is None or requested >= rows:
        return None
    return f"--cache-bytes {human_bytes(opts.cache_bytes)} asked" if opts.cache_bytes is not None else \
        f"--cache-experts {requested} asked"


def _shown(path: Path) -> str:
    """`path` with the home folder as ~."""
    home = str(Path.home())
    text = str(path)
    return "~" + text[len(home):] if text.startswith(home + "/") else text


def resolve(ftw: FTWModel, opts: RuntimeOptions, machine: Machine | None = None,
            budget: int | None = None, sequences: int = 1) -> Resolved:
    """`opts` resolved for `ftw` on `machine` (default: this one, on `opts.device`). `budget`: the device bytes
    the plan must fit (ft-run serve's --device-memory); default: what the device has free, less
    the host pool on the CPU, where both share the RAM (None where unknown: not checked).
    `sequences`: how many sequences run at once (ft-run serve's --max-running), each with its
    own sliding-layer rings."""
    if sum(x is not None for x in (opts.cache_experts, opts.cache_bytes, opts.gpu_budget)) > 1:
        raise ValueError("give one of --cache-experts, --cache-bytes and --gpu-budget")
    if opts.prefill_chunk < 1:
        raise ValueError(f"--prefill-chunk must be at least 1 token, got {opts.prefill_chunk}")
    family = stored_family(ftw)  # the spec read below, checked by its family as loading checks it
    machine = machine or Machine.detect(opts.device)
    device, spec, slot_bytes = machine.device, ftw.spec, ftw.layout.slot_bytes
    rows = spec.num_expert_rows
    threads = opts.threads or CPUExecutor.default_threads()
    profile = _profile(opts, machine)
    ratio = profile.bandwidths(threads).ratio if profile is not None else opts.bandwidth_ratio
    dense = ftw.manifest.dense["tensors"]
    dtype = storage_dtype(opts.dtype or default_dtype(dense["embed.weight"]["dtype"], device))
    given = budget is not None
    if budget is None and machine.free_bytes is not None:
        budget = max(0, machine.free_bytes - (rows * slot_bytes if device.type == "cpu" else 0))
    prefix = (opts.prefix_cache_tokens or spec.max_position_embeddings) if opts.prefix_cache else 0
    shapes = {name: t["shape"] for name, t in dense.items()}
    cpu_products = device.type == "cpu" and int8_activations(dtype) and load() is not None
    blocks = device_blocks({name: t["dtype"] for name, t in dense.items()}, device.type == "cuda",
                           cpu_products=cpu_products,
                           gpu_products=device.type == "cuda" and dtype != torch.float32
                           and optional("block_gemv") is not None, shapes=shapes)
    plan = base_plan(spec, dense_device_bytes(shapes, dtype, spec.family, blocks),
                     slot_bytes, dtype, opts.kv_tokens, budget, prefix, cuda=device.type == "cuda",
                     graphs=opts.graphs and family.graphs_unsupported(spec) is None, chunk=opts.prefill_chunk,
                     flash=flash_behind_cache(dtype, spec.head_dim, "cuda"), sequences=sequences,
                     prefix_windows=opts.anchor_slots)
    requested = opts.cache_experts if opts.cache_bytes is None else opts.cache_bytes // slot_bytes
    strategy, why = resolve_strategy(opts.strategy, ratio, _ratio_said(ratio, profile), device,
                                     _fit(plan, rows, opts.gpu_budget, budget, given, device),
                                     _smaller_cache(opts, requested, rows))
    if why:
        note(f"strategy {strategy} (auto: {why})")
    if opts.gpu_budget is not None and strategy not in (CPU, FUSED):
        requested = plan.slots_within(opts.gpu_budget, spec.top_k)
    elif requested is None and strategy not in (CPU, FUSED) and device.type == "cuda" and budget is not None:
        # no size asked: the cache takes what the GPU holds beside the rest (every expert row
        # would not fit, or auto would have chosen fused)
        requested = min(rows, plan.slots_fitting(budget))
        note(f"expert cache {requested} of {rows} slots ({human_bytes(requested * slot_bytes)}): what the GPU holds")
    staging = prefill_staging(spec, plan, budget, opts.stream_prefill) if strategy == CPU and device.type == "cuda" else 0
    memory = plan.with_sizes(expert_slots=cache_capacity(strategy, requested, rows, staging))
    return Resolved(opts, device, strategy, ratio, profile, threads, dtype, memory, blocks, cpu_products)
