"""The request scheduler: one thread steps a bounded set of running generations in turn.

Every pass of the loop prefills the new requests (several prompts in one forward, which reads each
layer's experts once for all of them; it waits briefly for requests still on their way, `arrival`,
so that those sent together join), then advances the others: by one
token each in one batched forward (attention per sequence, everything else, the experts above
all, once for the batch: concurrent requests share each layer's expert fills and CPU work), or,
where that measured slower (`decode_mode`), each in turn by a burst of pipelined graph steps. A
lone request bursts until something needs the loop. Between passes no forward is in flight: that
is the safe point where waiting requests are admitted, cancelled ones dropped and cache rebuilds
applied (and `forget`), so a rebuild never loses or disturbs a request.

Admission is bounded twice: at most `max_running` requests, and their KV reservations
(prompt + the tokens they may still generate) within the KV budget in tokens.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from .decode_mode import SLICE, TURNS, DecodeMode
from .generate import Decoding, Generation, batch_burst, prefill_group, prefill_groups
from .loader import Runtime
from .memory import MemoryPlan
from .sampling import SamplingParams

REPLIES_KEPT = 8  # finished conversations waiting for idle time to be prefilled into the cache
# Idle this long before a finished reply is prefilled: an agent's next turn often follows at once,
# and a request that arrives while a reply is being prefilled waits for it (0.34-9.6 s of queue on
# the GPU machine before; the GPU keeps decoded rows instead, `Decoding.remember`).
REPLY_GRACE_S = 0.25
RECENT_KEPT = 32  # finished requests whose timings /v1/stats shows (ft-bench serve reads them)
# A pass about to prefill new requests waits at most this long while others are on their way
# (`arrival`: read, parsed, tokenized), so that prompts sent together share one forward, which
# reads each layer's experts once. Host CI (an H200, q4km): of four 1536-token requests sent at once
# the first was prefilled alone (TTFT 0.12 s) and the other three waited for it (0.28 s). A lone
# request never waits: nothing else is on its way.
ARRIVAL_WAIT_S = 0.01


@dataclass
class Event:
    """One generated token (`token`, `delta`), or the end: `done` with `gen` final or `error`."""

    gen: Generation | None
    token: int | None = None
    delta: str = ""
    done: bool = False
    error: str | None = None
    status: int = 500  # with `error`: 400 where the request itself can no longer be served


class Request:
    def __init__(self, prompt_ids: list[int], params: SamplingParams, sink: Callable[[Event], None],
                 keep_special: frozenset[int] = frozenset(), context: int | None = None):
        self.prompt_ids, self.params, self.sink, self.keep_special = prompt_ids, params, sink, keep_special
        new = params.max_tokens if context is None else min(params.max_tokens, context - len(prompt_ids))
        self.kv_tokens = len(prompt_ids) + max(0, new)
        self.cancelled = threading.Event()
        self.submitted = time.perf_counter()
        self.decoding: Decoding | None = None  # set on admission
        self.prefilled = False
        self.gen: Generation | None = None

    def cancel(self) -> None:
        """Safe from any thread; the scheduler drops the request at its next safe point."""
        self.cancelled.set()


class RebuildError(Exception):
    """A rebuild that was refused or rolled back; the old split is in force."""


def _new_counts() -> dict:
    return {"submitted": 0, "completed": 0, "cancelled": 0, "failed": 0,
            "prompt_tokens": 0, "generated_tokens": 0,
            "decode_forwards": 0, "decode_batched_tokens": 0,  # how much decode was batched
            "decode_batches": 0, "decode_batch_tokens": 0,  # the batched steps (of several), their tokens
            "decode_batch_seconds": 0.0,  # ... and their time
            "prefill_forwards": 0,  # the forwards that prefilled the requests (several in one where they join)
            "replies_cached": 0}


class Scheduler:
    def __init__(self, rt: Runtime, plan: MemoryPlan, max_running: int = 4):
        if max_running < 1:
            raise ValueError("max_running must be >= 1")
        self.rt, self.plan, self.max_running = rt, plan, max_running
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.at_safe_point: deque[Callable[[], None]] = deque()  # rebuilds, forget: run between passes
        # Finished prompt + reply token lists to prefill into the prefix cache when idle: the
        # next agent turn resends them, and decoded K/V rows are not the ones a prefill computes.
        self.replies: deque[list[int]] = deque(maxlen=REPLIES_KEPT)
        self.recent: deque[dict] = deque(maxlen=RECENT_KEPT)  # the last finished requests' timings
        self.cond = threading.Condition()
        self.closed = False
        self.arriving = 0  # requests on their way to `submit` (`arrival`)
        self.counts = _new_counts()
        self.busy_seconds = 0.0
        self.mode = DecodeMode()  # batched steps or bursts in turn, for several running requests
        self.started = time.time()
        self.thread = threading.Thread(target=self._loop, name="ftkit-scheduler", daemon=True)
        self.thread.start()

    @property
    def context(self) -> int:
        return self.rt.spec.max_position_embeddings

    def submit(self, req: Request) -> None:
        """Queue a request; raises ValueError when it could never be admitted."""
        if req.kv_tokens > self.plan.kv_tokens:
            raise ValueError(f"the request needs {req.kv_tokens} KV tokens (prompt + max_tokens), more "
                             f"than the server's KV budget of {self.plan.kv_tokens}; lower max_tokens")
        with self.cond:
            if self.closed:
                raise RuntimeError("the scheduler is closed")
            self.waiting.append(req)
            self.counts["submitted"] += 1
            self.cond.notify()

    def arrival(self) -> Callable[[], None]:
        """Count a request on its way to `submit` until the returned call (the first; later
        ones do nothing): a pass about to prefill waits for it, up to ARRIVAL_WAIT_S."""
        with self.cond:
            self.arriving += 1
        left = [True]

        def arrived() -> None:
            with self.cond:
                if left:
                    left.clear()
                    self.arriving -= 1
                    self.cond.notify()
        return arrived

    def rebuild(self, expert_slots: int | None, kv_tokens: int | None) -> Future:
        """Ask for a new expert cache / KV budget at the next safe point; the future gives the
        new plan or raises RebuildError (the old split stays)."""
        fut: Future = Future()
        self._at_safe_point(lambda: self._apply_rebuild(expert_slots, kv_tokens, fut))
        return fut

    def forget(self) -> Future:
        """Drop, at the next safe point, what the requests so far left behind: the counters and
        timings, the replies waiting to be cached and the prefix cache (the start-up's own
        requests: server/warm.py); the future is done then."""
        fut: Future = Future()

        def drop() -> None:
            self.counts = _new_counts()
            self.recent.clear()
            self.replies.clear()
            self.busy_seconds = 0.0
            self.rt.store.stats.reset()
            if self.rt.prefix_cache is not None:
                self.rt.prefix_cache.clear()
            fut.set_result(None)

        self._at_safe_point(drop)
        return fut

    def _at_safe_point(self, action: Callable[[], None]) -> None:
        with self.cond:
            self.at_safe_point.append(action)
            self.cond.notify()

    def stats(self) -> dict:
        with self.cond:
            c = dict(self.counts)
            kv_used = sum(r.kv_tokens for r in self.running)
            c.update(running=len(self.running), waiting=len(self.waiting), max_running=self.max_running,
                     kv_tokens_reserved=kv_used, uptime_seconds=round(time.time() - self.started, 1),
                     decode_tok_s=round(c["generated_tokens"] / self.busy_seconds, 2) if self.busy_seconds else None,
                     recent=list(self.recent))
        return c

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify()
        self.thread.join(timeout=10)

    # ---- the loop (scheduler thread only) ---------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self.cond:
                while not (self.waiting or self.running or self.at_safe_point or self.closed or self.replies):
                    self.cond.wait()
                if self.closed:
                    break
                while self.at_safe_point:
                    self.at_safe_point.popleft()()
                self._admit()
                if self.arriving and any(not r.prefilled for r in self.running):  # let them join
                    self.cond.wait_for(lambda: not self.arriving or self.closed, ARRIVAL_WAIT_S)
                    self._admit()
                batch = list(self.running)
                idle_reply = None
                if not batch and not self.waiting and self.replies:
                    if self.cond.wait_for(lambda: self.waiting or self.at_safe_point or self.closed, REPLY_GRACE_S):
                        continue  # a request came: it goes first
                    idle_reply = self.replies.popleft()
            if idle_reply is not None:
                self._cache_reply(idle_reply)
                continue
            t0 = time.perf_counter()
            self._pass(batch)
            self.busy_seconds += time.perf_counter() - t0
        for req in [*self.running, *self.waiting]:
            self._finish(req, "cancelled", error="the server is shutting down")

    def _admit(self) -> None:
        used = sum(r.kv_tokens for r in self.running)
        while self.waiting and len(self.running) < self.max_running:
            req = self.waiting[0]
            if req.cancelled.is_set():
                self.waiting.popleft()
                self._finish(req, "cancelled")
                continue
            if req.kv_tokens > self.plan.kv_tokens:  # a rebuild shrank the budget below it: never fits
                self.waiting.popleft()
                self._finish(req, "failed", status=400, error=(
                    f"the request needs {req.kv_tokens} KV tokens (prompt + max_tokens), more than the server's "
                    f"KV budget of {self.plan.kv_tokens} since a cache rebuild; lower max_tokens"))
                continue
            if used + req.kv_tokens > self.plan.kv_tokens:
                break  # first come, first served: wait for KV to free up
            self.waiting.popleft()
            try:
                req.decoding = Decoding(self.rt, req.prompt_ids, req.params, keep_special=req.keep_special)
            except ValueError as e:
                self._finish(req, "failed", error=str(e))
                continue
            self.running.append(req)
            self.counts["prompt_tokens"] += len(req.prompt_ids)
            used += req.kv_tokens

    def _pass(self, batch: list[Request]) -> None:
        """Prefill the new requests, then decode the others: batched, or in turns."""
        live, new = [], []
        for req in batch:
            if req.cancelled.is_set():
                self._finish(req, "cancelled")  # dropping its Decoding frees its KV cache
            elif req.decoding.done:
                self._finish(req, "completed")
            elif not req.prefilled:
                new.append(req)
            else:
                live.append(req)
        self._prefill(new)
        if not live:
            return
        if len(batch) == 1 and live[0].decoding.pipelined():  # alone: nobody waits on its steps
            self._burst(live[0])
            return
        if len(live) == 1:  # the others are being prefilled: a step, which measures no batch
            self._step(live)
            return
        mode = self.mode.pick(all(r.decoding.pipelined() for r in live))
        t0 = time.perf_counter()
        tokens = sum(self._burst(req, SLICE) for req in live) if mode == TURNS else self._batched(live)
        if not new:  # a pass that prefilled also waited for the prefill's GPU work: no rate of a mode
            self.mode.observe(mode, tokens, time.perf_counter() - t0)

    def _prefill(self, new: list[Request]) -> None:
        """Resume each new request from the prefix cache, then compute the rest of the prompts,
        several in one forward where they join (`prefill_groups`): four 1.5k-token prompts
        arriving together cost about one prefill's expert reads, not four."""
        resumed: dict[Decoding, Request] = {}
        for req in new:
            req.decoding.gen.queue_seconds = time.perf_counter() - req.submitted
            if self._run([req], req.decoding.resume):
                resumed[req.decoding] = req
        for group in prefill_groups(list(resumed)):
            reqs = [resumed[d] for d in group]
            self.counts["prefill_forwards"] += 1
            if self._run(reqs, lambda group=group: prefill_group(group)):
                for req in reqs:
                    req.prefilled = True
                    self._emit(req)

    def _batched(self, live: list[Request]) -> int:
        """Batched steps of the live requests, up to SLICE (a burst's length, so both modes are
        measured over as many tokens), until one of them ends or the safe point is needed; the
        tokens made. (One step a pass measured a batch by its first step after a prefill, which
        waits for that prefill's queued GPU work: batching lost to turns on one slow sample.)"""
        if self.rt.step.pipelines_batch([r.decoding.kv for r in live]):
            return self._batch_burst(live)
        made = 0
        for _ in range(SLICE):
            step = self._step(live)
            made += step
            if (not step or any(r.decoding.done or r.cancelled.is_set() for r in live)
                    or self.at_safe_point or self._admissible()):
                break
        return made

    def _batch_burst(self, live: list[Request]) -> int:
        """Up to SLICE captured batched steps of the live requests with the next always queued
        (generate.batch_burst), until one of them ends or the safe point is needed; the tokens
        made."""
        made = 0

        def interrupt() -> bool:
            return any(r.cancelled.is_set() for r in live) or bool(self.at_safe_point) or self._admissible()

        def run() -> None:
            nonlocal made
            t0 = time.perf_counter()
            for outs in batch_burst([r.decoding for r in live], SLICE, interrupt):
                for req, out in zip(live, outs, strict=True):
                    self._send(req, out)
                made += len(live)
                self.counts["decode_forwards"] += 1
                self.counts["decode_batched_tokens"] += len(live)
                self.counts["decode_batches"] += 1
                self.counts["decode_batch_tokens"] += len(live)
            self.counts["decode_batch_seconds"] += time.perf_counter() - t0

        if self._run(live, run):
            for req in live:
                if req.decoding.done:
                    self._finish(req, "completed")
        return made

    def _step(self, live: list[Request]) -> int:
        """One batched decode step of the live requests; the tokens it made."""
        try:
            t0 = time.perf_counter()
            self.rt.store.stats.new_step()
            tokens = torch.tensor([r.decoding.next_input for r in live], device=self.rt.device)
            with torch.inference_mode():
                logits = self.rt.step.batch(tokens, [r.decoding.kv for r in live])
            self.counts["decode_forwards"] += 1
            self.counts["decode_batched_tokens"] += len(live)
            if len(live) > 1:
                self.counts["decode_batches"] += 1
                self.counts["decode_batch_tokens"] += len(live)
                self.counts["decode_batch_seconds"] += time.perf_counter() - t0
        except Exception as e:  # a failed step fails its requests, not the server
            for req in live:
                self._finish(req, "failed", error=f"{type(e).__name__}: {e}")
            return 0
        for req, row in zip(live, logits, strict=True):
            req.decoding.accept(row)
            self._emit(req)
        return len(live)

    def _burst(self, req: Request, limit: int | None = None) -> int:
        """Decode `req` with the next step always queued (Decoding.burst) until it ends, has
        made `limit` tokens (its turn among several), or a waiting request that can be admitted,
        a cancel or a rebuild needs the loop's safe point; the tokens it made. A lone request's
        burst is also the rate of turns (`DecodeMode.observe_alone`)."""
        made, first_at, last_at = 0, 0.0, 0.0

        def interrupt() -> bool:
            return (req.cancelled.is_set() or bool(self.at_safe_point) or self._admissible()
                    or (limit is not None and made >= limit))

        def run() -> None:
            nonlocal made, first_at, last_at
            for out in req.decoding.burst(interrupt):
                made += 1
                self.counts["decode_forwards"] += 1
                self.counts["decode_batched_tokens"] += 1
                self._send(req, out)
                last_at = time.perf_counter()
                first_at = first_at or last_at

        if self._run([req], run) and req.decoding.done:
            self._finish(req, "completed")
        if limit is None:  # alone: the rate of turns
            self.mode.observe_alone(made - 1, last_at - first_at)
        return made

    def _admissible(self) -> bool:
        """A waiting request that the next safe point would admit (or drop, cancelled): one that
        must wait for a slot or for KV does not stop the running ones' bursts."""
        if not self.waiting:
            return False
        head = self.waiting[0]
        used = sum(r.kv_tokens for r in self.running)
        return head.cancelled.is_set() or (len(self.running) < self.max_running
                                           and used + head.kv_tokens <= self.plan.kv_tokens)

    def _run(self, reqs: list[Request], fn: Callable[[], None]) -> bool:
        try:
            fn()
            return True
        except Exception as e:  # a failed request must not take the others down
            for req in reqs:
                self._finish(req, "failed", error=f"{type(e).__name__}: {e}")
            return False

    def _emit(self, req: Request) -> None:
        if self._run([req], lambda: self._send(req, req.decoding.emit())) and req.decoding.done:
            self._finish(req, "completed")

    def _send(self, req: Request, out: tuple[int, str, Generation]) -> None:
        token, delta, req.gen = out
        if req.gen.ttft_seconds is None:
            req.gen.ttft_seconds = time.perf_counter() - req.submitted
        self.counts["generated_tokens"] += 1
        req.sink(Event(req.gen, token, delta))

    def _cache_reply(self, ids: list[int]) -> None:
        """Prefill a finished conversation (prompt + reply) through the prefix cache."""
        try:
            Decoding(self.rt, ids, SamplingParams(max_tokens=1)).prefill()
        except ValueError:  # e.g. it fills the context: nothing a next turn could extend
            return
        self.counts["replies_cached"] += 1

    def _finish(self, req: Request, outcome: str, error: str | None = None, status: int = 500) -> None:
        reply = outcome == "completed" and self.rt.prefix_cache is not None and req.gen and req.gen.token_ids
        kept = False
        if reply:
            try:
                kept = req.decoding.remember()
            except Exception:  # the reply is then prefilled in idle time instead
                pass
        with self.cond:
            if req in self.running:
                self.running.remove(req)
            self.counts[outcome] += 1
            if req.gen is not None:
                self.recent.append({"outcome": outcome, **req.gen.stats()})
            if reply and not kept:
                self.replies.append(req.prompt_ids + req.gen.token_ids)
            elif kept:
                self.counts["replies_cached"] += 1
        if req.gen is None:
            req.gen = Generation(len(req.prompt_ids), finish_reason="length")
        req.gen.finish_reason = req.gen.finish_reason or "length"
        req.sink(Event(req.gen, done=True, error=error, status=status))

    def _apply_rebuild(self, expert_slots: int | None, kv_tokens: int | None, fut: Future) -> None:
        rows = self.rt.spec.num_expert_rows
        new = self.plan.with_sizes(expert_slots, kv_tokens)
        try:
            if new.kv_tokens < 1 or (expert_slots is not None and expert_slots < 1):
                raise RebuildError("expert slots and KV tokens must be >= 1")
            if expert_slots is not None and expert_slots > rows:
                raise RebuildError(f"the model has {rows} expert rows: at most {rows} slots hold them all")
            if not new.fits:
                raise RebuildError(new.advice())
            if expert_slots is not None and expert_slots != self.rt.store.cache.capacity:
                try:
                    self.rt.store.rebuild(expert_slots)
                except (ValueError, MemoryError) as e:
                    raise RebuildError(str(e)) from e
            self.plan = new.with_sizes(expert_slots=self.rt.store.cache.capacity)
        except RebuildError as e:
            fut.set_exception(e)
        else:
            fut.set_result(self.plan)
