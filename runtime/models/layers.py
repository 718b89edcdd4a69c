"""Functional pieces of a Llama-style decoder, numerically mirroring transformers.

Activations are [T, ...] (one sequence, no batch dimension). Where transformers computes in
float32 and casts back (RMSNorm, RoPE tables, the attention softmax), so do we, so that float32
runs agree to rounding and bf16 runs to bf16 rounding.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.backends.cuda import SDPAParams
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import CausalBias, causal_lower_right

from ftkit.errors import shown
from ftkit.kernels.cpu import load as load_cpu_kernel
from ftkit.kernels.triton import optional

from ..spec import ModelSpec
from .block_table import BlockLinear, PlaneLinear
from .rope import rotary_dim


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: bool = False,
             float32: bool = False) -> torch.Tensor:
    """RMSNorm over the last dim, computed in float32; the weight multiplies the cast-back value.
    `offset` (Qwen3-Next, transformers' Qwen3NextRMSNorm): the float32 value times (1 + weight),
    then the cast. `float32` (gpt-oss, transformers' GptOssRMSNorm, its weights kept float32):
    the float32 value times the weight, then the cast. On CUDA one Triton launch does the same
    (see kernels/triton/norm.py)."""
    if x.is_cuda and optional("norm") is not None and x.shape[-1] <= 16384 and weight.shape == x.shape[-1:]:
        return optional("norm").rms_norm(x, weight, eps, offset, float32)
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if offset:
        return (h * (1.0 + weight.float())).to(x.dtype)
    if float32:
        return (weight.float() * h).to(x.dtype)
    return weight * h.to(x.dtype)


def linear(x: torch.Tensor, weight: torch.Tensor | BlockLinear | PlaneLinear,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear. One token on CUDA goes through the Triton GEMV instead (kernels/triton/gemv.py):
    inside a CUDA graph cuBLAS took 5.1 us for a router's 128 x 2048 product, the GEMV 1.7. A
    weight kept in its GGUF blocks on a CPU (`BlockLinear`) is multiplied by the CPU kernel, one
    on a GPU (`PlaneLinear`) by the block GEMV."""
    if isinstance(weight, BlockLinear | PlaneLinear):
        y = weight.product(x)
        return y if bias is None else y + bias
    if (x.is_cuda and weight.dim() == 2 and x.numel() == weight.shape[1] and x.is_contiguous()
            and weight.is_contiguous() and optional("gemv") is not None):
        return optional("gemv").gemv(x, weight, bias)
    return F.linear(x, weight, bias)


def softmax_topk(logits: torch.Tensor, k: int, renorm: bool, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [T, k], weights [T, k] as `dtype`): softmax over all experts in float32, the k
    largest (descending, as torch.topk), optionally renormalised to sum to one. On CUDA one
    Triton launch does the same (kernels/triton/router.py)."""
    if logits.is_cuda and optional("router") is not None and logits.shape[-1] <= 4096:
        return optional("router").softmax_topk(logits, k, renorm, dtype)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, k, dim=-1)
    if renorm:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids, weights.to(dtype)


def topk_softmax(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [T, k], weights [T, k] in the logits' dtype): the k largest logits (descending, as
    torch.topk), softmaxed over those k (gpt-oss's router). On CUDA one Triton launch does the
    same (kernels/triton/router.py), in float32 before the cast."""
    if logits.is_cuda and optional("router") is not None and logits.shape[-1] <= 4096:
        return optional("router").softmax_topk(logits, k, False, logits.dtype, top_first=True)
    top, ids = torch.topk(logits, k, dim=-1)
    return ids, torch.softmax(top, dim=-1, dtype=top.dtype)


def swiglu(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """down(silu(gate x) * up x); gate/up [I, H], down [H, I]."""
    return F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)


# ---- rotary embeddings ---------------------------------------------------------------------
def rope_frequencies(spec: ModelSpec, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
    """(inv_freq [rotary_dim/2] float32, attention_factor): transformers' ROPE_INIT_FUNCTIONS
    maths for the default, linear, dynamic, yarn and llama3 rope types. `seq_len` matters only
    for dynamic NTK scaling (the length the sequence will have after this step)."""
    s = spec.rope_scaling or {}
    kind = s.get("rope_type", "default")
    dim, base, factor = rotary_dim(spec), spec.rope_theta, s.get("factor")
    exponents = torch.arange(0, dim, 2, dtype=torch.float32) / dim
    if kind == "default":
        return 1.0 / (base**exponents), 1.0
    if kind == "linear":
        return 1.0 / (base**exponents) / factor, 1.0
    if kind == "dynamic":
        max_pos = spec.max_position_embeddings
        seq = max(seq_len or 0, max_pos)
        base = base * ((factor * seq / max_pos) - (factor - 1)) ** (dim / (dim - 2))
        return 1.0 / (base**exponents), 1.0
    if kind == "llama3":
        return _llama3(1.0 / (base**exponents), s, factor), 1.0
    if kind == "yarn":
        return _yarn(spec, s, dim, base, exponents)
    raise ValueError(f"rope type {shown(kind)} is not supported (default, linear, dynamic, yarn, llama3)")


def _llama3(inv_freq: torch.Tensor, s: dict, factor: float) -> torch.Tensor:
    old_len = s["original_max_position_embeddings"]
    low, high = s["low_freq_factor"], s["high_freq_factor"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
    return torch.where(medium, smoothed, scaled)


def _yarn(spec: ModelSpec, s: dict, dim: int, base: float, exponents: torch.Tensor) -> tuple[torch.Tensor, float]:
    orig = s.get("original_max_position_embeddings") or spec.max_position_embeddings
    factor = s.get("factor") or spec.max_position_embeddings / orig

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = s.get("attention_factor")
    if attention_factor is None:
        m, m_all = s.get("mscale"), s.get("mscale_all_dim")
        attention_factor = float(mscale(factor, m) / mscale(factor, m_all)) if m and m_all else mscale(factor)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(s.get("beta_fast") or 32), correction_dim(s.get("beta_slow") or 1)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoids a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base**exponents
    extrapolation = 1 - ramp  # 1: keep the original frequency, 0: interpolate by `factor`
    inv_freq = 1.0 / (factor * pos_freqs) * (1 - extrapolation) + 1.0 / pos_freqs * extrapolation
    return inv_freq, attention_factor


class Rope:
    """cos/sin tables for a run of positions (float32 maths, cast to the activations' dtype)."""

    def __init__(self, spec: ModelSpec, device: str | torch.device = "cpu"):
        self.spec, self.device = spec, device
        self.dynamic = (spec.rope_scaling or {}).get("rope_type") == "dynamic"
        inv_freq, self.attention_factor = rope_frequencies(spec)
        self.inv_freq = inv_freq.to(device)

    def __call__(self, start: int, length: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Tables [length, rotary_dim] for positions start..start+length."""
        inv_freq = self.inv_freq
        if self.dynamic and start + length > self.spec.max_position_embeddings:
            # Dynamic NTK stretches the base with the sequence length. transformers keeps the
            # largest length seen so far; we use this call's, which is the same while a
            # sequence only grows.
            inv_freq = rope_frequencies(self.spec, start + length)[0].to(self.device)
        positions = torch.arange(start, start + length, device=self.device, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq[None]
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.attention_factor).to(dtype), (emb.sin() * self.attention_factor).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first rotary_dim channels of x [T, heads, D] (rotate-half layout)."""
    d = cos.shape[-1]
    rot = x[..., :d]
    cos, sin = cos[:, None], sin[:, None]
    half = torch.cat((-rot[..., d // 2 :], rot[..., : d // 2]), dim=-1)
    out = rot * cos + half * sin
    return out if d == x.shape[-1] else torch.cat((out, x[..., d:]), dim=-1)


# ---- attention -----------------------------------------------------------------------------
SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offset: int, window: int | None = None
) -> torch.Tensor:
    """Causal GQA attention. q [T, H, D] holds positions offset..offset+T; k, v [S, KvH, D]
    hold positions 0..S with S = offset + T (relative positions: a sliding layer's keys start at
    its first query's window). Returns [T, H, D]."""
    t, s = q.shape[0], k.shape[0]
    mask, causal, gqa = None, False, True
    if t == 1 and not q.is_cuda:  # a CPU decode step: SDPA's CPU kernels took 0.2 / 2.1 / 17.7 ms
        # for one bf16 query behind 40 / 500 / 4000 keys (32 heads of 128, 2 cores), 0.05 / 0.27 /
        # 3.0 ms in float32. The CPU kernel reads the cache's rows as they are, 1.3-8x faster than
        # torch's products over float32 copies of K and V (decode_attention), which remain for
        # shapes it declines (figures: kernels/cpu/decode_attention.h, docs/benchmarks.md)
        kernel = load_cpu_kernel()
        lo = 0 if window is None else max(0, offset - window + 1)
        out = kernel.attention(q, k, v, lo, torch.get_num_threads()) if kernel is not None else None
        return out if out is not None else decode_attention(q, k, v, None if window is None else torch.arange(s) >= lo)
    if window is None and offset == 0:
        causal = True  # plain prefill: let SDPA pick its fused causal kernel
    elif window is not None or t > 1:
        few = optional("attention") if q.is_cuda else None
        if few is not None and t <= few.MAX_QUERIES:  # an extend behind a long cache
            return few.few_query_attention(q, k, v, offset, window)
        if window is None and _flash_lower_right(q, k, v):
            return _sdpa(q, k, v, causal_lower_right(t, s), False, True)
        fused = q.is_cuda and k.shape[1] != q.shape[1]
        # The efficient kernel wants the bias rows 16-element aligned: build them padded.
        width = -(-s // 16) * 16 if fused else s
        q_pos = torch.arange(offset, offset + t, device=q.device)[:, None]
        k_pos = torch.arange(width, device=q.device)[None]
        mask = k_pos <= q_pos
        if window is not None:
            mask &= k_pos > q_pos - window  # transformers' sliding-window overlay
        if fused:
            # (Sliding windows, float32, GPUs without flash.) A mask rules out flash attention
            # and SDPA's memory-efficient kernel takes no GQA, so SDPA would fall to its math
            # path: float32 upcasts and every score materialised (0.8 ms per layer for a 32-token
            # extend behind 8k tokens, gigabytes for a second 8k chunk). Repeating the K/V heads
            # costs one copy of them.
            mask = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill_(~mask, float("-inf"))
            mask = mask[:, :s]
            k, v = (a.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for a in (k, v))
            gqa = False
    return _sdpa(q, k, v, mask, causal, gqa)


def _heads_first(*xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """[T, heads, D] -> [1, heads, T, D]: with 3-D inputs SDPA always takes its unfused math path."""
    return tuple(x.transpose(0, 1)[None] for x in xs)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | CausalBias | None,
          causal: bool, gqa: bool) -> torch.Tensor:
    # Not cuDNN: it builds a new plan for every KV length, milliseconds per decode step.
    with sdpa_kernel(SDPA_BACKENDS):
        out = F.scaled_dot_product_attention(*_heads_first(q, k, v), attn_mask=mask, is_causal=causal,
                                             scale=q.shape[-1] ** -0.5, enable_gqa=gqa)
    return out[0].transpose(0, 1)


def flash_behind_cache(dtype: torch.dtype, head_dim: int, device: torch.device | str) -> bool:
    """Whether a chunk behind cached keys can run flash attention with the causal diagonal at the
    last key (torch's causal_lower_right), materialising neither a mask nor repeated K/V heads:
    half precision, head_dim a multiple of 8 up to 256, an sm80+ GPU. The memory plan sizes the
    prefill workspace by this."""
    dev = torch.device(device)
    return (dev.type == "cuda" and torch.cuda.is_available() and dtype in (torch.float16, torch.bfloat16)
            and head_dim % 8 == 0 and head_dim <= 256 and torch.cuda.get_device_capability(dev) >= (8, 0))


def _flash_lower_right(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """flash_behind_cache, confirmed by torch for these tensors: the lower-right bias falls back to
    the memory-efficient kernel otherwise, which takes no GQA."""
    if not flash_behind_cache(q.dtype, q.shape[-1], q.device):
        return False
    return torch.backends.cuda.can_use_flash_attention(SDPAParams(*_heads_first(q, k, v), None, 0.0, False, True))


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """One query's GQA attention over a fixed-size key range: q [1, H, D]; k [S, KvH, D], v [S,
    KvH, Dv]; mask [S] bool (True: attend), or None: every key. Shapes do not depend on the
    position, so a CUDA graph captured for S serves every position below S. Scores and softmax
    in float32."""
    heads, d = q.shape[1], q.shape[2]
    kv_heads = k.shape[1]
    qf = q[0].view(kv_heads, heads // kv_heads, d).float()
    scores = torch.einsum("hgd,shd->hgs", qf, k.float()) * d**-0.5
    probs = torch.softmax(scores if mask is None else scores.masked_fill(~mask, float("-inf")), dim=-1)
    return torch.einsum("hgs,shd->hgd", probs, v.float()).to(q.dtype).reshape(1, heads, v.shape[-1])
