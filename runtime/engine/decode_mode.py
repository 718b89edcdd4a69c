"""How concurrent requests decode: one batched step for them all, or each in turn as a pipelined
burst of graph steps; whichever the scheduler measured faster.

A batched step shares each layer's expert reads among the requests (only the experts their
tokens have in common: under uniform routing 4 tokens of top-8 over 128 experts touch 29 a
layer, not 32), while a burst replays one request's CUDA graphs with the next step always
queued. On the GPU machine (the qwen3-30b-a3b shape cut to 12 layers, hybrid) 4 sequences'
captured batched step made 271.6 tok/s together against 229.5 for one stream's bursts. Which
wins moves with the model, the cache and the load, so the rates are measured, not assumed;
without graphs (a CPU) batching is the only way.
"""

from __future__ import annotations

BATCH, TURNS = "batch", "turns"
SLICE = 32  # tokens a request decodes in its turn (the step in flight at a switch is redone: 1 in 33)
PROBE = 64  # passes after which the mode not in use is measured again
SMOOTHING = 0.3  # weight of a pass's rate in the running figure


class DecodeMode:
    """The decode rate (tokens/s over all running requests) of each mode, and the pick."""

    def __init__(self) -> None:
        self.rate: dict[str, float | None] = {BATCH: None, TURNS: None}
        self.passes = 0

    def pick(self, pipelined: bool) -> str:
        """The mode for a pass over several running requests; `pipelined`: every one of them
        decodes through graphs (else only a batch steps them)."""
        if not pipelined:
            return BATCH
        self.passes += 1
        for mode, rate in self.rate.items():
            if rate is None:
                return mode
        best = max(self.rate, key=lambda m: self.rate[m])
        if self.passes % PROBE == 0:  # the other one again: the load or the requests changed
            return TURNS if best == BATCH else BATCH
        return best

    def observe(self, mode: str, tokens: int, seconds: float) -> None:
        if tokens <= 0 or seconds <= 0:
            return
        rate, old = tokens / seconds, self.rate[mode]
        self.rate[mode] = rate if old is None else (1 - SMOOTHING) * old + SMOOTHING * rate

    def observe_alone(self, tokens: int, seconds: float) -> None:
        """A lone request's burst, timed from its first token (which may wait for queued
        prefill work): turns run such bursts one after another, so this is their rate too, and
        the first requests to run together need no pass in turns to measure it. That pass cost
        the GPU machine 128 of four streams' 1024 tokens at the lone rate (379.6 tok/s where
        their batched steps made 566). Shorter bursts, cut by an arrival, say little."""
        if tokens >= SLICE:
            self.observe(TURNS, tokens, seconds)
