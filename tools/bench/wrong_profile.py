"""A wrong profile cannot make hybrid slow: `python -m ftkit.tools.bench.wrong_profile DIR --profile P`.

Decodes the same tokens with `offload`, `cpu`, `hybrid` on the calibrated profile P and `hybrid` on
a copy of P whose CPU figures are ten times too high, on a random qwen3-30b-a3b-shaped model (bf16
experts, H=2048, I=768, 128 experts) written once under DIR. Prints ms per token and the token from
which the wrong-profile run stays within 10% of the best strategy (the planner corrects its ratio
from measured branch times). Meaningful on a GPU (`--device cuda`, the default).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import torch

from ftkit.runtime.engine.loader import Runtime, RuntimeOptions
from ftkit.runtime.profile import load_profile
from ftkit.runtime.random_model import demo_spec, write_random_ftw


def model(root: Path, layers: int) -> Path:
    path = root / f"wrong-profile-{layers}l.ftw"
    if not (path / "manifest.json").is_file():
        base = dataclasses.replace(demo_spec(4096), hidden_size=2048, moe_intermediate_size=768, num_experts=128,
                                   top_k=8, num_heads=16, head_dim=128)
        spec = dataclasses.replace(base, num_layers=layers, moe_layers=tuple(range(layers)),
                                   layer_kinds=base.layer_kinds[:1] * layers)
        write_random_ftw(path, spec, dtype="bfloat16", distinct_experts=16)
    return path


def wrong_copy(profile: Path, out: Path) -> Path:
    """The profile with every CPU figure ten times too high."""
    p = load_profile(profile)
    rows = tuple(dataclasses.replace(r, **{k: getattr(r, k) * 10 for k in ("cpu_gbps", "cpu_overlapped_gbps")
                                           if getattr(r, k)}) for r in p.rows)
    dataclasses.replace(p, rows=rows).save(out)
    return out


def token_times(path: Path, tokens: list[int], **opts) -> list[float]:
    rt = Runtime(path, RuntimeOptions(**opts))
    kv = rt.new_kv(len(tokens))
    times = []
    with torch.inference_mode():
        for tok in tokens:
            t0 = time.perf_counter()
            rt.step.forward(torch.tensor([tok], device=rt.device), kv)
            if rt.device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
    rt.close()
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dir", type=Path)
    ap.add_argument("--profile", type=Path, required=True, help="a profile from ft-calibrate on this machine")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--cache-fraction", type=float, default=0.25, help="device cache, as a fraction of all experts")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    path = model(args.dir, args.layers)
    wrong = wrong_copy(args.profile, args.dir / "wrong-profile.json")
    tokens = torch.randint(0, 4096, (args.tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    cache = max(1, int(args.layers * 128 * args.cache_fraction))
    common = dict(device=args.device, threads=args.threads, cache_experts=cache, dtype="bfloat16")
    runs = {
        "offload": token_times(path, tokens, strategy="offload", **common),
        "cpu": token_times(path, tokens, strategy="cpu", **{**common, "cache_experts": None}),
        "hybrid": token_times(path, tokens, strategy="hybrid", profile=args.profile, **common),
        "hybrid-wrong": token_times(path, tokens, strategy="hybrid", profile=wrong, **common),
    }
    tail = args.tokens // 2
    steady = {k: sum(v[-tail:]) / tail for k, v in runs.items()}
    best = min(steady[k] for k in ("offload", "cpu", "hybrid"))
    window = 4  # a token's time is noisy: judge a short moving average
    avg = [sum(runs["hybrid-wrong"][i : i + window]) / window for i in range(args.tokens - window + 1)]
    within = next((i for i in range(len(avg)) if all(a <= 1.1 * best for a in avg[i:])), None)
    for k, v in steady.items():
        print(f"{k:>13}: {v * 1e3:8.2f} ms/token (last {tail} tokens), first token {runs[k][0] * 1e3:.1f} ms")
    print(f"hybrid-wrong within 10% of the best ({best * 1e3:.2f} ms) from token {within} on"
          if within is not None else "hybrid-wrong never settles within 10% of the best strategy")
    if args.json:
        args.json.write_text(json.dumps({"ms_per_token": {k: [t * 1e3 for t in v] for k, v in runs.items()},
                                         "steady_ms": {k: v * 1e3 for k, v in steady.items()},
                                         "within_10pct_from_token": within}, indent=1) + "\n")


if __name__ == "__main__":
    main()
