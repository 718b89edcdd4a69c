"""A checkpoint's tensors seen through its family: what is there, what is missing, what is wrong.

Built from headers only; `ftw-convert` refuses a checkpoint with problems, `ft-diagnose`
reports them all.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import islice

from ftkit.vocab import (
    BLOCK_FORMATS,
    DENSE_FORMATS,
    EXPERT_FORMATS,
    EXPERT_PARTS,
    STORED_DENSE_FORMATS,
)

from ..checkpoint.base import CheckpointError, Source
from ..spec import ModelSpec
from . import Family, Mapped, config_name, resolve

PER_EXPERT, STACKED = "per-expert", "stacked"
# Stacked tensors that hold two slot parts: gate's rows, then up's (their biases alike).
FUSED_INTO = {"gate": "gate_up", "up": "gate_up", "gate_bias": "gate_up_bias", "up_bias": "gate_up_bias"}
FUSED_FROM = {"gate_up": "gate", "gate_up_bias": "gate_bias"}  # a fused tensor's first part


@dataclass
class LayerExperts:
    stacked: dict[str, str] = field(default_factory=dict)  # part -> source name
    per: dict[tuple[int, str], str] = field(default_factory=dict)  # (expert, part) -> source name


@dataclass
class Inventory:
    source: Source
    family: Family
    spec: ModelSpec
    dense: dict[str, tuple[str, Mapped]] = field(default_factory=dict)  # canonical -> (source name, mapped)
    experts: dict[int, LayerExperts] = field(default_factory=dict)  # model layer -> its expert tensors
    missing: list[str] = field(default_factory=list)
    mismatched: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # left out by the family's design (Family.skips)
    unsupported: list[str] = field(default_factory=list)
    expert_dtypes: set[str] = field(default_factory=set)
    part_formats: dict[tuple[int, str], set[str]] = field(default_factory=dict)  # (layer, part) -> stored formats
    layouts: set[str] = field(default_factory=set)

    @property
    def gguf(self) -> bool:
        return self.source.kind == "gguf"

    @property
    def problems(self) -> list[str]:
        """Everything that keeps this checkpoint from converting: ftw-convert refuses on the
        first, ft-diagnose lists them all."""
        out = [f"unsupported: {u}" for u in self.unsupported]
        out += [f"missing tensor: {m}" for m in self.missing]
        out += [f"wrong shape: {m}" for m in self.mismatched]
        out += self._dtype_problems()
        # a slot layout gives each layer's part one format: its experts must agree on it
        for (layer, part), formats in sorted(self.part_formats.items()):
            if len(formats) > 1:
                out.append(f"layer {layer} experts' {part} projections mix formats {sorted(formats)}; "
                           f"convert with --dtype to unify them")
        return out

    def _dtype_problems(self) -> list[str]:
        """Stored dtypes the runtime cannot take: dense ones it cannot cast from, expert ones it
        cannot put in a slot."""
        tensors = self.source.tensors
        dense_ok = STORED_DENSE_FORMATS if self.gguf else DENSE_FORMATS
        out = [f"wrong dtype: {name} is {tensors[name].dtype}, expected one of {', '.join(dense_ok)}"
               for name, _ in self.dense.values() if tensors[name].dtype not in dense_ok]
        bad = self.expert_dtypes - set(EXPERT_FORMATS)
        for le in self.experts.values():
            for name in (*le.stacked.values(), *le.per.values()):
                if tensors[name].dtype in bad:
                    bad.discard(tensors[name].dtype)
                    out.append(f"wrong dtype: experts stored as {tensors[name].dtype} (e.g. {name}), "
                               f"expected one of {', '.join(EXPERT_FORMATS)}")
        return out

    def layer_formats(self, layer: int) -> tuple[str, ...]:
        """The stored format of model layer `layer`'s gate, up and down, which slots keep (GGUF's
        blocks and an HF checkpoint's MXFP4 as ggml's blocks; call only without problems, when
        each part has one)."""
        return tuple(next(iter(self.part_formats[(layer, part)])) for part in EXPERT_PARTS)

    def dense_note(self, dtype: str | None = None) -> str | None:
        """The one line that says what becomes of the dense tensors stored in GGUF blocks: kept
        in FTW as stored (on a GPU the embedding table stays so, on a 16-bit run lm_head too where
        its format is Q4_K, Q6_K or Q8_0, on a 16-bit CPU run the attention and lm_head too, the
        rest is dequantized exactly to float32 when loaded), or dequantized to
        `dtype` while converting; None where none are."""
        blocks = sorted({self.source.tensors[name].dtype for name, _ in self.dense.values()} & set(BLOCK_FORMATS))
        if not blocks:
            return None
        if dtype:
            return f"dense tensors stored as {'/'.join(blocks)} are dequantized to {dtype}"
        return (f"dense tensors stored as {'/'.join(blocks)} stay in those blocks (FTW v3): a GPU keeps the "
                f"embedding table in them (and lm_head in q4_k, q6_k or q8_0 at 16 bits), a CPU computing in 16 "
                f"bits its attention and lm_head too, the rest is dequantized exactly to float32 when loaded")

    def skipped_note(self) -> str | None:
        """The family's line on the tensors it skips by design (models/base.py), or None."""
        return self.family.skipped_note(self.skipped) if self.skipped else None

    @property
    def expert_layout(self) -> str:
        return "+".join(sorted(self.layouts)) or "none"


def _same_shape(have: tuple[int, ...], want: tuple[int, ...]) -> bool:
    # A [1, H] gate stored as [H] is the same tensor; squeeze before comparing.
    return have == want or tuple(d for d in have if d != 1) == tuple(d for d in want if d != 1)


def take_inventory(source: Source) -> Inventory:
    family, spec = resolve(source)
    stored = len(source.tensors) + len(getattr(source, "unsupported", {}))
    if spec.num_layers > stored:  # every layer has tensors of its own: the count is corrupt
        raise CheckpointError(f"{config_name(source)}: {spec.num_layers} layers, but the weights hold only "
                              f"{stored} tensors")
    inv = Inventory(source, family, spec)
    unsupported = getattr(source, "unsupported", {})  # GGUF tensors of types we cannot read
    inv.unsupported = [f"GGUF type {t} for tensor {n}" for n, t in unsupported.items()]
    # What those tensors would have been: reported as unsupported, so not again as missing.
    unreadable = [m for m in (family.map_name(n, inv.gguf) for n in unsupported) if m is not None]
    want_dense = family.dense_shapes(spec)
    for name, ref in source.tensors.items():
        if family.skips(name, spec):
            inv.skipped.append(name)
            continue
        mapped = family.map_name(name, inv.gguf)
        if mapped is None:
            inv.unexpected.append(name)
        elif mapped.canonical is not None:
            if mapped.canonical not in want_dense:
                inv.unexpected.append(name)
                continue
            inv.dense[mapped.canonical] = (name, mapped)
            if not _same_shape(ref.shape, want_dense[mapped.canonical]):
                inv.mismatched.append(f"{name} is {list(ref.shape)}, expected {list(want_dense[mapped.canonical])}")
        elif not spec.is_moe(mapped.layer):
            inv.unexpected.append(name)
        else:
            _add_expert(inv, name, mapped, ref.shape, ref.dtype)
    unreadable_dense = {m.canonical for m in unreadable}
    inv.missing += [c for c in want_dense if c not in inv.dense and c not in unreadable_dense]
    for layer in spec.moe_layers:
        _check_layer(inv, layer, {m.part for m in unreadable if m.canonical is None and m.layer == layer})
    return inv


def _add_expert(inv: Inventory, name: str, m: Mapped, shape: tuple[int, ...], dtype: str) -> None:
    spec = inv.spec
    le = inv.experts.setdefault(m.layer, LayerExperts())
    part_shapes = spec.expert_part_shapes()
    if not m.part.endswith("_bias"):  # biases are kept float32 in every slot (ftkit.vocab.BIAS_DTYPE)
        inv.expert_dtypes.add(dtype)
        for part in (("gate", "up") if m.part == "gate_up" else (m.part,)):
            inv.part_formats.setdefault((m.layer, part), set()).add(dtype)
    if m.expert is None:
        inv.layouts.add(STACKED)
        one = part_shapes.get(FUSED_FROM.get(m.part, m.part))  # a gate_up tensor: gate's rows, then up's
        if one is not None:
            want = (spec.num_experts, 2 * one[0], *one[1:]) if m.part in FUSED_FROM else (spec.num_experts, *one)
            if m.transposed:
                want = (*want[:-2], want[-1], want[-2])
        le.stacked[m.part] = name
    else:
        inv.layouts.add(PER_EXPERT)
        one = want = part_shapes.get(m.part)
        if m.expert >= spec.num_experts:
            inv.unexpected.append(name)
            return
        le.per[(m.expert, m.part)] = name
    if one is None:  # a part these experts do not have (a bias where they have none)
        inv.unexpected.append(name)
        le.stacked.pop(m.part, None)
        le.per.pop((m.expert, m.part), None)
        return
    if tuple(shape) != want:
        inv.mismatched.append(f"{name} is {list(shape)}, expected {list(want)}")


def _check_layer(inv: Inventory, layer: int, unreadable: set[str]) -> None:
    le = inv.experts.get(layer, LayerExperts())
    have = set(le.stacked) | unreadable
    for part in inv.spec.expert_part_shapes():
        if part in have or FUSED_INTO.get(part) in have:
            continue
        present = sum((e, part) in le.per for e in {e for e, _ in le.per})
        if present == 0:
            inv.missing.append(f"layer {layer} experts' {part} projection")
        elif present < inv.spec.num_experts:
            # The first few missing ones: a scan that stops there, however many experts there are.
            shown = list(islice((e for e in range(inv.spec.num_experts) if (e, part) not in le.per), 9))
            inv.missing.append(f"layer {layer} {part} projection of expert(s) "
                               + ", ".join(map(str, shown[:8])) + (" ..." if len(shown) > 8 else ""))
