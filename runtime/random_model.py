"""Random-weight FTW written straight from a ModelSpec: the built-in demo model and benchmarks.

One tensor (or one expert slot) is generated at a time, so the shapes can be realistic.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from ftkit import __version__
from ftkit.vocab import slot_layout, storage_dtype

from .ftw.manifest import DENSE_FILE, MANIFEST, Manifest, write_json_atomic
from .ftw.writer import BankWriter, DenseWriter, atomic_dir, rows_per_bank, sha256_file
from .models import FAMILIES
from .spec import FULL_ATTENTION, QK_NORM_HEAD, ModelSpec


def demo_spec(vocab_size: int) -> ModelSpec:
    """The built-in model: a small Qwen3-MoE (4 layers, 16 experts, top-4)."""
    return ModelSpec(
        family="qwen3_moe", architecture="Qwen3MoeForCausalLM", vocab_size=vocab_size,
        hidden_size=128, num_layers=4, num_heads=8, num_kv_heads=2, head_dim=16,
        intermediate_size=256, moe_intermediate_size=128, num_experts=16, top_k=4,
        moe_layers=(0, 1, 2, 3), layer_kinds=(FULL_ATTENTION,) * 4, norm_topk_prob=True,
        qk_norm=QK_NORM_HEAD, max_position_embeddings=2048,
    )


def _random(name: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    if name.endswith("norm.weight"):
        return 1 + 0.1 * torch.randn(shape, generator=gen)
    std = 0.5 if name.endswith("router.weight") else shape[-1] ** -0.5
    return std * torch.randn(shape, generator=gen)


def write_random_ftw(
    out: Path,
    spec: ModelSpec,
    dtype: str = "float32",
    seed: int = 0,
    side_files: Callable[[Path], None] | None = None,
    force: bool = False,
    distinct_experts: int | None = None,
    on_bytes: Callable[[int], None] = lambda n: None,
) -> Manifest:
    """Write a random-weight FTW for `spec`; `side_files(dir)` may add a tokenizer and such.

    `distinct_experts=N` draws only N random experts and cycles them over the rows: speed does
    not depend on expert values (routing depends on the router alone), and drawing tens of GB
    of random numbers would dominate writing a benchmark model.
    """
    gen = torch.Generator().manual_seed(seed)
    tdt = storage_dtype(dtype)
    shapes = FAMILIES[spec.family].dense_shapes(spec)
    layout = slot_layout(spec, dtype)
    with atomic_dir(out, force) as tmp:
        entries = [(n, dtype, s) for n, s in shapes.items()]
        dense = DenseWriter(tmp / DENSE_FILE, entries)
        for name, shape in shapes.items():
            dense.write(name, _random(name, shape, gen).to(tdt))
        dense_sha = dense.close()
        banks = BankWriter(tmp, layout, spec.num_expert_rows, rows_per_bank(layout.slot_bytes, spec.num_experts, 4 << 30))
        cycle: list[dict[str, torch.Tensor]] = []
        for row in range(spec.num_expert_rows):
            if distinct_experts is None or len(cycle) < distinct_experts:
                parts = {p.name: _random(p.name, p.shape, gen).to(storage_dtype(p.dtype)) for p in layout.parts}
                if distinct_experts is not None:
                    cycle.append(parts)
            else:
                parts = cycle[row % distinct_experts]
            banks.write_slot(row, parts)
            on_bytes(layout.slot_bytes)
        files = {}
        if side_files:
            side_files(tmp)
            files = {p.name: sha256_file(p) for p in sorted(tmp.iterdir())
                     if p.is_file() and p.name != DENSE_FILE and p.suffix != ".ftwb"}
        manifest = Manifest(
            spec=spec, layout=layout, banks=banks.close(),
            dense={"file": DENSE_FILE, "sha256": dense_sha,
                   "tensors": {n: {"dtype": dtype, "shape": list(s)} for n, s in shapes.items()}},
            files=files, writer=f"ftkit {__version__}", source={"kind": "random", "seed": seed},
        )
        write_json_atomic(tmp / MANIFEST, manifest.to_dict())
    return manifest
