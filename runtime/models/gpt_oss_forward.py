"""gpt-oss's forward pass: attention with a learned sink logit per head (a sliding layer's over the
window's keys its ring keeps, kv.KVCache), float32 RMSNorm weights, the biased router whose top-k
logits are softmaxed.
The experts' biases and clamped SwiGLU are the slot layout's (ftkit.vocab.ClampedSwiGLU)."""

from __future__ import annotations

import torch

from .decoder import KVAttend, MoEDecoder
from .gpt_oss import SCORES_PER_BLOCK
from .kv import KVCache
from .layers import topk_softmax


def sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offset: int, window: int | None,
                   sinks: torch.Tensor) -> torch.Tensor:
    """Causal GQA attention whose softmax also counts one sink logit per head: q [T, H, D] at
    positions offset..offset+T over k, v [S, KvH, D] (positions 0..S, relative: a sliding
    layer's start at its window); `window`: keys within the last `window` positions only. transformers' eager gpt-oss attention, op for op (scores in the
    activations' dtype, the max subtracted, the sink's column dropped after the softmax); queries
    run in blocks so the scores stay SCORES_PER_BLOCK at most."""
    t, heads, d = q.shape
    s, kv_heads = k.shape[0], k.shape[1]
    rep = heads // kv_heads
    kh, vh = k.transpose(0, 1), v.transpose(0, 1)  # [KvH, S, D]
    k_pos = torch.arange(s, device=q.device)[None]
    out = torch.empty_like(q)
    block = max(1, SCORES_PER_BLOCK // (heads * s))
    for a in range(0, t, block):
        b = min(t, a + block)
        # the query heads of one kv head together: [KvH, rep * Tb, D], no repeated K/V
        qg = q[a:b].transpose(0, 1).reshape(kv_heads, rep * (b - a), d)
        scores = (qg @ kh.transpose(1, 2)).view(heads, b - a, s) * d**-0.5
        q_pos = torch.arange(offset + a, offset + b, device=q.device)[:, None]
        visible = k_pos <= q_pos
        if window is not None:
            visible &= k_pos > q_pos - window
        scores = scores + torch.where(visible, 0.0, torch.finfo(scores.dtype).min).to(scores.dtype)
        logits = torch.cat([scores, sinks.to(scores.dtype).view(heads, 1, 1).expand(heads, b - a, 1)], dim=-1)
        logits = logits - logits.max(dim=-1, keepdim=True).values
        probs = torch.softmax(logits, dim=-1, dtype=logits.dtype)[..., :-1].to(v.dtype)
        pg = probs.reshape(kv_heads, rep * (b - a), s)
        out[a:b] = (pg @ vh).view(heads, b - a, d).transpose(0, 1)
    return out


class GptOssDecoder(MoEDecoder):
    norm_float32 = True  # transformers keeps these weights float32 and multiplies before the cast back

    def cached(self, cache: KVCache) -> KVAttend:
        def kv(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return sink_attention(q, *cache.append(i, k, v), self.window(i), self.w[f"layers.{i}.attn.sinks"])
        return kv

    def route(self, i: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The top-k of the biased router logits, softmaxed over those k (in the logits' dtype);
        on CUDA a token's are a Triton GEMV and one launch (graph decode's router)."""
        return topk_softmax(self.linear(f"layers.{i}.router", x), self.spec.top_k)
