"""The host planner's cost per MoE layer at each preset's whole size: `python -m
ftkit.tools.bench.planner [--fraction 0.35] [--steps 200]`.

Host-planned decode (eager, and every prefill and batch) plans each MoE layer on the CPU: hits
looked up, the fills' victims taken least recently used first, the rest left to the CPU branch.
This times `Planner.plan` on a `SlotCache` of the whole model's experts at `--fraction` under
uniform routing, so the figure is what 256-384 experts x 58-61 layers (DeepSeek-V3, Kimi-K2) cost
against 128 x 48 (Qwen3-30B-A3B). The cache holds no weights here: only the decisions are timed.
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from ftkit.runtime.experts.cache import SlotCache
from ftkit.runtime.experts.planner import Planner

from .presets import PRESETS


def layer_us(layers: int, experts: int, k: int, fraction: float, steps: int, seed: int = 0) -> float:
    """Microseconds `Planner.plan` takes for one MoE layer of one decode token (k routed experts)."""
    rows = layers * experts
    cache = SlotCache(int(rows * fraction), 1, rows, torch.device("cpu"))
    planner, rng = Planner("hybrid", 0.5, adapt=False), random.Random(seed)
    routed = [[layer * experts + e for e in rng.sample(range(experts), k)] for _ in range(steps) for layer in range(layers)]
    t0 = time.perf_counter()
    for active in routed:
        planner.plan(cache, active)
    return (time.perf_counter() - t0) / len(routed) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fraction", type=float, default=0.35, help="share of the model's experts the cache holds")
    ap.add_argument("--steps", type=int, default=200, help="decode tokens planned per preset")
    args = ap.parse_args()
    for name in ("qwen3-30b-a3b", "qwen3-next-80b-a3b", "deepseek-v3", "kimi-k2"):
        spec = PRESETS[name]
        layers = len(spec.moe_layers)
        us = layer_us(layers, spec.num_experts, spec.top_k, args.fraction, args.steps)
        print(f"{name}: {layers} MoE layers x {spec.num_experts} experts, top-{spec.top_k}, "
              f"{int(layers * spec.num_experts * args.fraction)} slots: {us:.1f} us a layer, "
              f"{us * layers / 1e3:.2f} ms a token")


if __name__ == "__main__":
    main()
