"""FTW bank read throughput: `python -m ftkit.tools.bench.ftw_read DIR [--gib N]`.

Writes a random-weight FTW of about N GiB of experts (once), then reads its banks with the
runtime's reader: O_DIRECT (page cache bypassed) and the mmap fallback.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import ftkit.runtime.ftw.reader as reader
from ftkit.runtime.ftw.reader import FTWModel
from ftkit.runtime.random_model import demo_spec, write_random_ftw


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("dir", type=Path)
    ap.add_argument("--gib", type=float, default=3.0)
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--pin", action="store_true", help="page-lock each bank after reading (needs CUDA)")
    args = ap.parse_args()
    path = args.dir / "read-bench.ftw"
    if not (path / "manifest.json").is_file():
        base = dataclasses.replace(demo_spec(512), hidden_size=2048, moe_intermediate_size=768, num_experts=128)
        layers = max(1, round(args.gib * 2**30 / (128 * 3 * 2048 * 768 * 2)))
        spec = dataclasses.replace(base, num_layers=layers, moe_layers=tuple(range(layers)),
                                   layer_kinds=("full_attention",) * layers, num_heads=16, head_dim=128)
        write_random_ftw(path, spec, dtype="bfloat16")
    model = FTWModel(path)
    direct = reader.probe_odirect(path / model.manifest.banks[0].file)
    for label, use_direct in (("O_DIRECT", True), ("mmap", False)):
        if use_direct and not direct:
            print("O_DIRECT: refused by this filesystem")
            continue
        reader.probe_odirect = (lambda p: True) if use_direct else (lambda p: False)
        banks = model.read_banks(threads=args.threads, pin=args.pin)
        gb = banks.nbytes / 1e9
        print(f"{label}: {gb:.2f} GB in {banks.seconds:.2f} s = {gb / banks.seconds:.2f} GB/s "
              f"({args.threads} threads{', pinned' if banks.pinned else ''})")
        del banks


if __name__ == "__main__":
    main()
