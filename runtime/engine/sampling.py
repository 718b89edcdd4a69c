"""Next-token choice: greedy, or temperature with top-k and top-p, reproducible under a seed."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class SamplingParams:
    max_tokens: int = 128
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k cut
    seed: int | None = None
    stop: list[str] = field(default_factory=list)  # stop strings (not included in the output)
    stop_token_ids: list[int] = field(default_factory=list)  # in addition to the model's EOS ids
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.max_tokens < 0:
            raise ValueError("max_tokens must be >= 0")
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0")


class Sampler:
    def __init__(self, params: SamplingParams):
        self.params = params
        self.gen = torch.Generator()
        if params.seed is not None:
            self.gen.manual_seed(params.seed)
        else:
            self.gen.seed()

    def __call__(self, logits: torch.Tensor) -> int:
        p = self.params
        if p.temperature == 0:  # where the logits are: one index crosses, not the vocabulary
            return int(torch.argmax(logits))
        logits = logits.float().cpu()
        logits = logits / p.temperature
        if p.top_k:
            kth = torch.topk(logits, min(p.top_k, logits.numel())).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if p.top_p < 1:
            sorted_p, idx = torch.sort(probs, descending=True)
            keep = torch.cumsum(sorted_p, 0) - sorted_p < p.top_p  # always keeps the top token
            probs = torch.zeros_like(probs).scatter(0, idx[keep], sorted_p[keep])
        return int(torch.multinomial(probs, 1, generator=self.gen))
