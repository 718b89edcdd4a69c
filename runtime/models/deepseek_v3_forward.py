"""DeepSeek-V3's forward pass: multi-head latent attention over a cache of latents (the config side
and the weights' layout are deepseek_v3.py); the routing is GLM-4.5's (Glm4MoeDecoder).

A position's cache row is the normed kv latent then the rotated rope key. Queries attend to it in
one of two forms, equal up to rounding:
- expanded (transformers' own): kv_b turns every cached latent into each head's nope key and
  value, and attention runs over those heads;
- absorbed: kv_b's key half folds into the queries (q_nope W_uk: a query in latent width), so
  the latent row is itself the one key head (and its latent part the value) of multi-query
  attention, and kv_b's value half maps the output back per head. A step reads the cache rows
  only, expanding nothing.
A piece takes the form with fewer multiplies (deepseek_v3.absorbs): absorbed for decode and short
extends, expanded for long prompt pieces. The form depends on the piece's length only, so a
piece gives the same bits whether its prefix came from a prefill or from the prefix cache.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..spec import ModelSpec
from .decoder import Experts, KVAttend
from .deepseek_v3 import LORA_NORM_EPS, absorbs, softmax_scale
from .glm4_moe_forward import Glm4MoeDecoder
from .kv import KVCache
from .layers import apply_rope, rms_norm


def latent_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offset: int, scale: float) -> torch.Tensor:
    """Causal attention of q [T, H, D] at positions offset..offset+T over k [S, KH, D] and
    v [S, KH, Dv] (positions 0..S; KH divides H, each key head serving H / KH query heads) with
    softmax scale `scale`: [T, H, Dv]."""
    t, s = q.shape[0], k.shape[0]
    mask = None
    if offset and t > 1:
        mask = torch.arange(s, device=q.device)[None] <= torch.arange(offset, offset + t, device=q.device)[:, None]
    out = F.scaled_dot_product_attention(*(a.transpose(0, 1)[None] for a in (q, k, v)), attn_mask=mask,
                                         is_causal=offset == 0 and t > 1, scale=scale,
                                         enable_gqa=k.shape[1] != q.shape[1])
    return out[0].transpose(0, 1)


class DeepseekV3Decoder(Glm4MoeDecoder):
    def __init__(self, spec: ModelSpec, weights: dict[str, torch.Tensor], experts: Experts):
        super().__init__(spec, weights, experts)
        self.scale = softmax_scale(spec)

    def attention(self, i: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache,
                  kv: KVAttend | None = None) -> torch.Tensor:
        """MLA over `cache`'s latent rows (`kv` is the graph paths', which this family does not
        take: Family.graphs_unsupported)."""
        s, e, p, t = self.spec, self.spec.extra, f"layers.{i}.attn.", x.shape[0]
        nope, rope, latent = e["qk_nope_head_dim"], s.head_dim, e["kv_lora_rank"]
        if e["q_lora_rank"]:
            q = self.linear(p + "q_b", rms_norm(self.linear(p + "q_a", x), self.w[p + "q_a_norm.weight"], LORA_NORM_EPS))
        else:
            q = self.linear(p + "q", x)
        q_nope, q_pe = q.view(t, s.num_heads, nope + rope).split([nope, rope], dim=-1)
        c, k_pe = self.linear(p + "kv_a", x).split([latent, rope], dim=-1)
        row = torch.cat([rms_norm(c, self.w[p + "kv_a_norm.weight"], LORA_NORM_EPS),
                         self.rotate(k_pe[:, None], cos, sin)[:, 0]], dim=-1)
        offset = cache.length
        rows = cache.append(i, row[:, None], row[:, None, :0])[0]  # [S, 1, latent + rope]; V rows are empty
        q_pe = self.rotate(q_pe, cos, sin)
        w_uk, w_uv = self.kv_b(i)
        if self.absorbs(t):
            q_latent = torch.einsum("thn,hnr->thr", q_nope, w_uk)
            out = latent_attention(torch.cat([q_latent, q_pe], dim=-1), rows, rows[..., :latent], offset, self.scale)
            out = torch.einsum("thr,hvr->thv", out, w_uv)
        else:
            c, k_pe = rows[:, 0].split([latent, rope], dim=-1)
            k = torch.cat([torch.einsum("sr,hnr->shn", c, w_uk), k_pe[:, None].expand(-1, s.num_heads, -1)], dim=-1)
            v = torch.einsum("sr,hvr->shv", c, w_uv)
            out = latent_attention(torch.cat([q_nope, q_pe], dim=-1), k, v, offset, self.scale)
        return self.linear(p + "o", out.reshape(t, -1))

    def absorbs(self, t: int) -> bool:
        """Whether t queries take the absorbed form (deepseek_v3.absorbs: the fewer multiplies)."""
        return absorbs(self.spec, t)

    def kv_b(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i's kv_b per head as views: W_uk [H, nope, latent] (the keys' half), W_uv
        [H, v, latent] (the values'), from the whole projection or llama.cpp's split halves."""
        e, p, heads = self.spec.extra, f"layers.{i}.attn.", self.spec.num_heads
        if e["kv_b_split"]:
            return self.w[p + "k_b.weight"].transpose(1, 2), self.w[p + "v_b.weight"]
        w = self.w[p + "kv_b.weight"].view(heads, e["qk_nope_head_dim"] + e["v_head_dim"], -1)
        return w.split([e["qk_nope_head_dim"], e["v_head_dim"]], dim=1)

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """RoPE on x [T, heads, rope]. DeepSeek's weights rotate interleaved pairs (x0, x1), (x2,
        x3), ...: with `rope_interleave` (transformers' default) the evens then the odds, rotated
        as halves, which is transformers' apply_rotary_pos_emb_interleave bit for bit."""
        if self.spec.extra["rope_interleave"]:
            x = torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)
        return apply_rope(x, cos, sin)
