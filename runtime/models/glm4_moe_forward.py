"""GLM-4.5 MoE's forward pass: sigmoid routing over expert groups with a score-correction bias
(the config side is glm4_moe.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .decoder import MoEDecoder


class Glm4MoeDecoder(MoEDecoder):
    cast_router_weights = False  # transformers hands the experts float32 weights

    def route(self, i: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        s, p, t = self.spec, f"layers.{i}.router.", x.shape[0]
        groups, keep = s.extra["n_group"], s.extra["topk_group"]
        scores = F.linear(x.float(), self.w[p + "weight"].float()).sigmoid()
        choice = (scores + self.w[p + "bias"].float()).view(t, groups, -1)
        best = choice.topk(2, dim=-1)[0].sum(dim=-1).topk(keep, dim=-1)[1]
        kept = torch.zeros(t, groups, dtype=torch.bool, device=x.device).scatter_(1, best, True)
        choice = choice.masked_fill(~kept[..., None], float("-inf")).view(t, -1)
        ids = choice.topk(s.top_k, dim=-1)[1]
        weights = scores.gather(1, ids)
        if s.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return ids, weights * s.extra["routed_scaling_factor"]
