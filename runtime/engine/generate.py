"""The generation loop: prefill the prompt, then decode one token at a time until a stop."""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field

import torch

from ..prefix_cache.prefill import CPU_EXPERT_BATCH, prefill_many
from .loader import Runtime
from .sampling import Sampler, SamplingParams
from .tokenizer import StreamDecoder


@dataclass
class Generation:
    prompt_tokens: int
    cached_tokens: int = 0  # prompt tokens whose K/V (and state) came from the prefix cache
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None  # "stop" | "length"
    stop_string: str | None = None  # the stop string that ended it, if one did
    prefill_seconds: float = 0.0  # resume + forward + insert: the time to the first token's logits
    decode_seconds: float = 0.0
    # where the prefill's time went: the cached rows and state restored, the rows computed, the
    # prefix cache's copy of the new rows; and the wait in the scheduler's queue before it
    resume_seconds: float = 0.0
    insert_seconds: float = 0.0
    queue_seconds: float = 0.0
    ttft_seconds: float | None = None  # the scheduler's: submitted to the first token handed out

    def stats(self) -> dict:
        n = len(self.token_ids)
        return {
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "completion_tokens": n,
            "prefill_seconds": round(self.prefill_seconds, 4),
            "decode_seconds": round(self.decode_seconds, 4),
            "queue_seconds": round(self.queue_seconds, 4),
            "resume_seconds": round(self.resume_seconds, 4),
            "insert_seconds": round(self.insert_seconds, 4),
            "ttft_seconds": None if self.ttft_seconds is None else round(self.ttft_seconds, 4),
            "prefill_tok_s": round((self.prompt_tokens - self.cached_tokens) / self.prefill_seconds, 2) if self.prefill_seconds else None,
            "decode_tok_s": round((n - 1) / self.decode_seconds, 2) if n > 1 and self.decode_seconds else None,
        }


class Decoding:
    """One request's generation as explicit steps, so a scheduler can batch the decode forwards
    of several requests: `prefill()`, then repeatedly `emit()` a token and, unless `done`,
    `accept()` the logits of a forward over `next_input`."""

    def __init__(self, rt: Runtime, prompt_ids: list[int], params: SamplingParams,
                 should_stop: Callable[[], bool] = lambda: False, keep_special: frozenset[int] = frozenset()):
        if not prompt_ids:
            raise ValueError("empty prompt")
        limit = rt.spec.max_position_embeddings
        if len(prompt_ids) >= limit:
            raise ValueError(f"prompt of {len(prompt_ids)} tokens does not fit the context of {limit}")
        if bad := [t for t in prompt_ids if not 0 <= t < rt.spec.vocab_size]:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary (0..{rt.spec.vocab_size - 1})")
        self.rt, self.prompt_ids, self.params, self.should_stop = rt, prompt_ids, params, should_stop
        self.max_new = min(params.max_tokens, limit - len(prompt_ids))
        self.gen = Generation(len(prompt_ids))
        self.sampler = Sampler(params)
        self.stops = set(params.stop_token_ids) | (set() if params.ignore_eos else rt.eos_ids)
        self.detok = StreamDecoder(rt.tokenizer, keep=keep_special) if rt.tokenizer else None
        self.kv = rt.new_kv(len(prompt_ids) + self.max_new)
        self.logits: torch.Tensor | None = None
        self.cuts: list[int] = []  # set by `resume`: the prompt's cuts and those to snapshot at
        self.points: Collection[int] = ()
        self.started = 0.0
        self.done = self.max_new <= 0
        self.decode_started = 0.0

    def prefill(self) -> None:
        """The prompt through the prefix cache: the first token's logits."""
        self.resume()
        prefill_group([self])

    def resume(self) -> None:
        """Restore the longest cached prefix (rows and state) and find where the rest must
        snapshot; `prefill_group` computes the rest."""
        rt, ids = self.rt, self.prompt_ids
        self.started = time.perf_counter()
        with torch.inference_mode():
            self.cuts, cache = rt.grid.scan(ids), rt.prefix_cache
            self.gen.cached_tokens = cache.resume(ids, self.cuts, self.kv) if cache else 0
            self.points = cache.snapshot_points(ids, self.cuts) if cache else {}
        self.gen.resume_seconds = time.perf_counter() - self.started

    @property
    def remaining(self) -> int:
        """Prompt tokens left to compute after `resume`."""
        return len(self.prompt_ids) - self.kv.length

    def joins(self) -> bool:
        """After `resume`: whether the rest may share a forward with other prompts'
        (`prefill_group`): no snapshot inside it, and a forward the decoder runs anyway."""
        start, n = self.kv.length, len(self.prompt_ids)
        return not any(start < p < n for p in self.points) and self.rt.step.joins(n - start)

    def remember(self) -> bool:
        """Put the reply's decoded K/V rows into the prefix cache after the prompt's, for the
        next turn that resends them; True where they are as good as a prefill's rows: on a GPU
        (whose contract is rounding, not bits) for a family without recurrent state (none was
        saved inside the reply; sliding windows are, at its end: `PrefixCache.remember`).
        Elsewhere the scheduler prefills prompt + reply in idle time instead, which costs the GPU
        an extend per reply."""
        rt, cache = self.rt, self.rt.prefix_cache
        if cache is None or rt.device.type == "cpu":
            return False
        ids = self.prompt_ids + self.gen.token_ids[:-1]  # the last token was picked, never fed
        if self.kv.length != len(ids):
            return False
        with torch.inference_mode():
            return cache.remember(ids, rt.grid.scan(ids), self.kv)

    def emit(self, token: int | None = None) -> tuple[int, str, Generation]:
        """Sample the next token from the current logits, or take `token` (chosen on the
        device): (token, text delta, generation)."""
        gen, params, detok = self.gen, self.params, self.detok
        if token is None:
            token = self.sampler(self.logits)
        gen.token_ids.append(token)
        last = token in self.stops or len(gen.token_ids) == self.max_new or self.should_stop()
        if token in self.stops:
            gen.finish_reason = "stop"
        elif detok:
            detok.push(token)
        full = detok.text if detok else ""
        hit = _stop_string(full, params.stop)
        if hit is not None:
            gen.stop_string = next(s for s in params.stop if s and full.startswith(s, hit))
            full, last, gen.finish_reason = full[:hit], True, "stop"
        # Hold back a tail that may be the start of a stop string, unless this is the end.
        shown = full if last else full[: len(full) - _partial_stop(full, params.stop)]
        delta, gen.text = shown[len(gen.text):], shown
        gen.decode_seconds = time.perf_counter() - self.decode_started
        if last:
            self.done = True
            gen.finish_reason = gen.finish_reason or "length"
        return token, delta, gen

    @property
    def next_input(self) -> int:
        return self.gen.token_ids[-1]

    def pipelined(self) -> bool:
        """Decoding through CUDA graphs, the tokens picked on the device: the next step can be
        queued before a token is read."""
        return not self.done and self.rt.step.pipelines(self.kv)

    def burst(self, interrupt: Callable[[], bool] = lambda: False) -> Iterator[tuple[int, str, Generation]]:
        """`emit` each token as GraphDecode.pipeline produces it (the GPU never waits for the host
        between tokens), until done or `interrupt()`; decoding can go on step by step after."""
        sampler = self.sampler if self.params.temperature else None  # None: the graphs' own argmax
        steps = self.rt.step.pipeline(self.next_input, self.kv, self.max_new - len(self.gen.token_ids), sampler)
        try:
            for token in steps:
                self.rt.store.stats.new_step()
                yield self.emit(token)
                if self.done or interrupt():
                    return
        finally:
            steps.close()

    def accept(self, logits: torch.Tensor) -> None:
        self.logits = logits


def batch_burst(decodings: list[Decoding], limit: int,
                interrupt: Callable[[], bool] = lambda: False) -> Iterator[list[tuple[int, str, Generation]]]:
    """`Decoding.burst` for several sequences at once (Step.pipeline_batch, where
    `pipelines_batch`): each step's `emit`s, until one of them is done, `interrupt()` or `limit`
    steps; decoding can go on step by step after."""
    rt = decodings[0].rt
    samplers = [d.sampler if d.params.temperature else None for d in decodings]
    limit = min(limit, *(d.max_new - len(d.gen.token_ids) for d in decodings))
    steps = rt.step.pipeline_batch([d.next_input for d in decodings], [d.kv for d in decodings], limit, samplers)
    try:
        for tokens in steps:
            rt.store.stats.new_step()
            yield [d.emit(t) for d, t in zip(decodings, tokens, strict=True)]
            if any(d.done for d in decodings) or interrupt():
                return
    finally:
        steps.close()


def prefill_group(group: list[Decoding]) -> None:
    """Compute the rest of each resumed prompt, several in one forward (`prefill_many`: every
    layer's experts read once for all of them), and put each into the prefix cache."""
    rt = group[0].rt
    rt.store.stats.new_step()
    t1 = time.perf_counter()
    with torch.inference_mode():
        out = prefill_many(rt.step, [(d.prompt_ids, d.kv, d.cuts, d.points) for d in group], rt.prefill_chunk)
        t2 = time.perf_counter()
        for d, (d.logits, snaps) in zip(group, out, strict=True):
            if rt.prefix_cache:
                rt.prefix_cache.insert(d.prompt_ids, d.cuts, d.kv, snaps, d.points)
    done = time.perf_counter()
    for d in group:
        d.gen.prefill_seconds = d.gen.resume_seconds + done - t1
        d.gen.insert_seconds = done - t2
        d.decode_started = done


def prefill_groups(resumed: list[Decoding]) -> list[list[Decoding]]:
    """The resumed prompts in forwards: those that join (`Decoding.joins`) packed in arrival
    order into groups of up to a prefill chunk of new tokens (a piece's activations, which the
    memory plan reserves), the others alone."""
    if not resumed:
        return []
    limit = resumed[0].rt.prefill_chunk or CPU_EXPERT_BATCH
    groups: list[list[Decoding]] = []
    open_group: list[Decoding] = []
    size = 0
    for d in resumed:
        if not d.joins() or d.remaining >= limit:
            groups.append([d])
            continue
        if open_group and size + d.remaining > limit:
            groups.append(open_group)
            open_group, size = [], 0
        open_group.append(d)
        size += d.remaining
    if open_group:
        groups.append(open_group)
    return groups


def stream(rt: Runtime, prompt_ids: list[int], params: SamplingParams,
           should_stop: Callable[[], bool] = lambda: False,
           keep_special: frozenset[int] = frozenset()) -> Iterator[tuple[int, str, Generation]]:
    """Yield (token, text delta, generation so far) per generated token. `keep_special`: special
    token ids whose text stays in the output (see StreamDecoder)."""
    d = Decoding(rt, prompt_ids, params, should_stop, keep_special)
    if not d.done:
        yield from drive(d)


def drive(d: Decoding) -> Iterator[tuple[int, str, Generation]]:
    """Prefill `d`, then `emit` each token until done: in bursts where the graphs pipeline them,
    else a forward a token."""
    rt = d.rt
    d.prefill()
    while True:
        yield d.emit()
        if d.done:
            return
        if d.pipelined():
            yield from d.burst()
            return
        rt.store.stats.new_step()
        with torch.inference_mode():
            d.accept(rt.step.forward(torch.tensor([d.next_input], device=rt.device), d.kv)[-1])


def _partial_stop(text: str, stops: list[str]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of a stop string."""
    return max((n for s in stops for n in range(1, len(s)) if text.endswith(s[:n])), default=0)


def _stop_string(text: str, stops: list[str]) -> int | None:
    found = [text.find(s) for s in stops if s and s in text]
    return min(found) if found else None


def generate(rt: Runtime, prompt_ids: list[int], params: SamplingParams,
             on_text: Callable[[str], None] | None = None) -> Generation:
    """Run to completion; `on_text` receives each text delta as it is produced."""
    gen = Generation(len(prompt_ids), finish_reason="length")  # what zero tokens asked for returns
    for _token, delta, latest in stream(rt, prompt_ids, params):
        if on_text is not None:
            on_text(delta)
        gen = latest
    return gen
