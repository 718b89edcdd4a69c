"""Where the host expert pool's pages live: huge or base pages, and which NUMA nodes.

The CPU branch streams the pool at DRAM speed; base (4 KiB) pages cost it a page walk every
4 KiB and stop the hardware prefetchers at every page boundary, and pages on a remote node cost
it the socket link. Benchmarks record both beside each decode figure, so a slow run can be told
apart from a slow kernel. Linux only (/proc/self/smaps and numa_maps); None elsewhere.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

_RANGE = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) ")
_NODE = re.compile(r"\bN(\d+)=(\d+)")
_PAGE = re.compile(r"\bkernelpagesize_kB=(\d+)")


def _overlaps(start: int, end: int, spans: list[tuple[int, int]]) -> bool:
    return any(start < e and s < end for s, e in spans)


def pool_pages(buffers: list[torch.Tensor], proc: Path = Path("/proc/self")) -> dict | None:
    """For the mappings that hold `buffers`: resident GiB, the share of it in transparent huge
    pages, and GiB per NUMA node. None where /proc does not say."""
    spans = [(b.data_ptr(), b.data_ptr() + b.numel() * b.element_size()) for b in buffers if b.numel()]
    try:
        smaps = (proc / "smaps").read_text().splitlines()
    except OSError:
        return None
    rss = huge = 0
    inside, starts = False, set()  # the mappings over the buffers, by start (numa_maps names them so)
    for line in smaps:
        if m := _RANGE.match(line):
            inside = _overlaps(int(m[1], 16), int(m[2], 16), spans)
            if inside:
                starts.add(int(m[1], 16))
        elif inside and line.startswith(("Rss:", "AnonHugePages:")):
            kib = int(line.split()[1])
            if line.startswith("Rss:"):
                rss += kib
            else:
                huge += kib
    nodes: dict[str, float] = {}
    try:
        for line in (proc / "numa_maps").read_text().splitlines():
            if int(line.split(" ", 1)[0], 16) not in starts:
                continue
            page = int(m[1]) if (m := _PAGE.search(line)) else 4
            for node, pages in _NODE.findall(line):
                nodes[f"N{node}"] = nodes.get(f"N{node}", 0.0) + int(pages) * page / 2**20
    except OSError:
        pass
    return {"resident_gib": rss / 2**20, "huge_fraction": huge / rss if rss else 0.0,
            "numa_gib": {n: round(g, 2) for n, g in sorted(nodes.items())}}


def main() -> None:
    """`python -m ftkit.tools.bench.hostmem -m MODEL.ftw`: load the pool as ft-run does
    (pinned where CUDA is), then the read rate of each GiB of it on the CPU kernel, and where
    its pages are. Parts of one process's pool reading at different rates point below the
    kernel: at the memory those pages landed on."""
    import argparse
    import json

    from ftkit.kernels.cpu import load
    from ftkit.runtime.ftw.reader import FTWModel
    from ftkit.tools.calibrate.measure import dram_read_gbps

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("-m", "--model", type=Path, required=True)
    ap.add_argument("--threads", type=int, default=15)
    ap.add_argument("--seconds", type=float, default=0.3, help="per GiB")
    args = ap.parse_args()
    kernel = load()
    if kernel is None:
        raise SystemExit("the CPU kernel cannot be built here")
    banks = FTWModel(args.model).read_banks()
    parts = [p for b in banks.buffers for p in b.split(2**30)]
    rates = [round(dram_read_gbps(kernel, p, args.threads, args.seconds), 1) for p in parts]
    print(json.dumps({"pinned": banks.pinned, "gib_read_gbps": rates, "pages": pool_pages(banks.buffers)}))


if __name__ == "__main__":
    main()
