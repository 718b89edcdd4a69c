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
    """Picks tokens where the logits are, with no host round trip on a GPU: `sample` returns a
    device tensor that graph decode can feed to the next step before anyone reads it.

    The draw is an exponential race: argmax of p_i / E_i with E_i ~ Exp(1) picks i with
    probability p_i, so top-k and top-p need only the few candidates they keep (torch.topk, or
    one sort on a GPU) and no multinomial over the vocabulary. Reproducible under a seed on one
    device; each device gets its own generator, seeded alike."""

    CPU_WINDOW = 256  # top-p on the CPU: the first window of candidates, grown 8x until it holds top_p

    def __init__(self, params: SamplingParams):
        self.params = params
        self.gens: dict[torch.device, torch.Generator] = {}

    def __call__(self, logits: torch.Tensor) -> int:
        return int(self.sample(logits))

    def sample(self, logits: torch.Tensor) -> torch.Tensor:
        """The next token id for `logits` [V] or [1, V], as a one-element tensor on their device."""
        p = self.params
        logits = logits.reshape(-1)
        if p.temperature == 0:
            return logits.argmax().reshape(1)
        logits = logits.float() / p.temperature
        if not p.top_k and p.top_p == 1:
            return self._race(torch.softmax(logits, 0)).reshape(1)
        vals, idx = self._candidates(logits)
        probs = torch.softmax(vals, 0) if p.top_k else (vals - torch.logsumexp(logits, 0)).exp()
        if p.top_p < 1:  # keep the smallest prefix that reaches top_p (always the top token)
            probs = probs * (probs.cumsum(0) - probs < p.top_p)
        return idx.gather(0, self._race(probs).reshape(1))

    def draws(self) -> dict[torch.device, torch.Tensor]:
        """Where each generator stands (no device sync): `rewind` undoes the draws made since."""
        return {d: g.get_state() for d, g in self.gens.items()}

    def rewind(self, draws: dict[torch.device, torch.Tensor]) -> None:
        for d in list(self.gens):
            if d in draws:
                self.gens[d].set_state(draws[d])
            else:  # created since: made again, seeded alike, on the next draw
                del self.gens[d]

    def _candidates(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The top logits, descending, and their ids: the top_k, else enough to hold top_p."""
        p, n = self.params, logits.numel()
        if p.top_k:
            return torch.topk(logits, min(p.top_k, n))
        if logits.is_cuda:  # one sort; growing a window would read its mass back to the host
            return torch.sort(logits, descending=True)
        lse, k = torch.logsumexp(logits, 0), min(self.CPU_WINDOW, n)
        while True:
            vals, idx = torch.topk(logits, k)
            if k == n or float((vals - lse).exp().sum()) >= p.top_p:
                return vals, idx
            k = min(8 * k, n)

    def _race(self, probs: torch.Tensor) -> torch.Tensor:
        # -log U ~ Exp(1); torch's exponential_ is several times slower on the CPU
        u = torch.rand(probs.shape, generator=self._generator(probs.device), device=probs.device)
        return (probs / u.log_().neg_().clamp_min_(torch.finfo(probs.dtype).tiny)).argmax()

    def _generator(self, device: torch.device) -> torch.Generator:
        gen = self.gens.get(device)
        if gen is None:
            gen = self.gens[device] = torch.Generator(device)
            if self.params.seed is None:
                gen.seed()
            else:
                gen.manual_seed(self.params.seed)
        return gen
