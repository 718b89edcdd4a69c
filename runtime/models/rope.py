"""RoPE settings as a spec gives them: the rotary width, and which settings the forward pass
(`layers.rope_frequencies`) can compute from. No torch: a header-only check runs these."""

from __future__ import annotations

from ftkit.errors import shown

from ..spec import ModelSpec, SpecError, real


def rotary_dim(spec: ModelSpec) -> int:
    return int(spec.head_dim * spec.partial_rotary_factor)


ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")
_POSITIVE = 1e30  # upper bound of the positive rope parameters: any finite size will do


def check_rope(spec: ModelSpec) -> None:
    """Refuse (SpecError) rope settings `rope_frequencies` cannot compute from: an unknown type,
    a parameter it needs missing or not a positive number, an odd rotary width."""
    dim, s = rotary_dim(spec), spec.rope_scaling or {}
    if dim < 2 or dim % 2:
        raise SpecError(f"rotary width {dim} (head_dim x partial_rotary_factor) is not a positive even number")
    kind = s.get("rope_type", "default")
    if kind not in ROPE_TYPES:
        raise SpecError(f"rope type {shown(kind)} is not supported ({', '.join(ROPE_TYPES)})")
    needed = {"linear": ("factor",), "dynamic": ("factor",),
              "llama3": ("factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor")}
    for key in needed.get(kind, ()):
        real(s.get(key), f"rope_scaling {key}", 0.0, _POSITIVE, open_lo=True)
    optional = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow") if kind == "yarn" else ()
    for key in optional:
        if s.get(key) is not None:
            real(s[key], f"rope_scaling {key}", 0.0, _POSITIVE, open_lo=True)
    if kind == "yarn":
        for key in ("attention_factor", "mscale", "mscale_all_dim"):  # mscale >= 0: never a zero divisor
            if s.get(key) is not None:
                real(s[key], f"rope_scaling {key}", -_POSITIVE if key == "attention_factor" else 0.0, _POSITIVE)
        if spec.rope_theta <= 1:
            raise SpecError(f"yarn rope needs rope_theta above 1, got {spec.rope_theta}")
    if kind == "llama3" and s["low_freq_factor"] == s["high_freq_factor"]:
        raise SpecError("llama3 rope: low_freq_factor equals high_freq_factor")
    if kind == "dynamic" and dim <= 2:
        raise SpecError("dynamic rope needs a rotary width above 2")
