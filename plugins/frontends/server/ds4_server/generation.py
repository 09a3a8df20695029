"""Session slots, the request queue and the generation loop that runs on worker threads.

Each slot owns one :class:`~ds4_core.engine.Session`. A request takes the free slot whose live tokens
(or whose snapshot at the end of its last prompt) the new prompt extends furthest, or waits in a FIFO
queue; past the queue limit it is refused with 503 and ``Retry-After``. Generation runs in a thread
pool and hands events to the event loop through an ``asyncio.Queue``; closing the consumer cancels the
generation and frees the slot.
"""

from __future__ import annotations

import asyncio
import collections
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import attrs

from ds4_core.chat import ContentDelta, StreamEvent, StreamParser
from ds4_core.engine import Engine, Snapshot
from ds4_core.sampling import SamplingParams
from ds4_core.stops import StopScanner

from .errors import ApiError
from .trace import Tracer

#: Tokens prefilled between two cancellation checks.
PREFILL_STEP = 128


@attrs.frozen
class GenRequest:
    """One generation: prompt token ids, budget, sampling, stop strings and the reply parser (None: raw text)."""

    prompt: list[int]
    max_tokens: int
    sampling: SamplingParams
    stop: tuple[str, ...] = ()
    parser: StreamParser | None = None


@attrs.frozen
class Usage:
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    prompt_ms: float
    predicted_ms: float

    def timings(self) -> dict[str, Any]:
        """llama-server style ``timings`` object."""
        prompt_n = self.prompt_tokens - self.cached_tokens
        return {"cache_n": self.cached_tokens, "prompt_n": prompt_n, "prompt_ms": round(self.prompt_ms, 3),
                "prompt_per_second": round(prompt_n / max(self.prompt_ms / 1000, 1e-9), 2),
                "predicted_n": self.completion_tokens, "predicted_ms": round(self.predicted_ms, 3),
                "predicted_per_second": round(self.completion_tokens / max(self.predicted_ms / 1000, 1e-9), 2)}


@attrs.frozen
class Finished:
    """End of a generation: ``reason`` is ``stop`` (EOS), ``stop_sequence``, ``length`` or ``cancelled``."""

    reason: str
    usage: Usage
    stop_sequence: str | None = None


class Ping:
    """Nothing happened for a keep-alive interval."""


PING = Ping()


@attrs.define(eq=False)
class Slot:
    index: int
    session: Any
    empty: Snapshot
    prompt_snapshot: Snapshot | None = None


class SlotPool:
    """``n`` sessions on one engine, a bounded FIFO of waiting requests and the worker threads."""

    def __init__(self, engine: Engine, n: int, queue_limit: int, kv_store: Any = None, kv_min_tokens: int = 0,
                 tracer: Tracer | None = None):
        self.engine = engine
        self.slots = []
        for i in range(n):
            session = engine.new_session()
            self.slots.append(Slot(i, session, session.snapshot()))
        self.free: list[Slot] = list(self.slots)
        self.waiters: collections.deque[asyncio.Future] = collections.deque()
        self.reserved = 0  # free slots promised to woken waiters
        self.queue_limit = queue_limit
        self.kv_store = kv_store
        self.kv_min_tokens = kv_min_tokens
        self.tracer = tracer or Tracer(None)
        self.executor = ThreadPoolExecutor(max_workers=n, thread_name_prefix="ds4-slot")

    @property
    def busy(self) -> int:
        return len(self.slots) - len(self.free)

    async def acquire(self, prompt: Sequence[int]) -> Slot:
        """A free slot (the best prefix match), waiting in line if needed; 503 when the line is full."""
        if len(self.free) > self.reserved:
            return self._take(prompt)
        if len(self.waiters) >= self.queue_limit:
            raise ApiError(503, f"all {len(self.slots)} session slots are busy and {len(self.waiters)} requests "
                                "are queued; retry shortly", headers={"Retry-After": "1"})
        waiter = asyncio.get_running_loop().create_future()
        self.waiters.append(waiter)
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self.reserved -= 1  # we were woken but will not take the slot: wake the next request
                self._wake()
            else:
                self.waiters.remove(waiter)
            raise
        self.reserved -= 1
        return self._take(prompt)

    def _take(self, prompt: Sequence[int]) -> Slot:
        best = max(self.free, key=lambda s: _reuse(s, prompt))
        self.free.remove(best)
        return best

    def release(self, slot: Slot) -> None:
        self.free.append(slot)
        self._wake()

    def _wake(self) -> None:
        while self.waiters and len(self.free) > self.reserved:
            waiter = self.waiters.popleft()
            if not waiter.done():
                self.reserved += 1
                waiter.set_result(None)

    async def start(self, req: GenRequest, *, ping_s: float = 30.0) -> AsyncIterator[StreamEvent | Finished | Ping]:
        """Queue for a slot, start ``req`` on it and return its events, ending with :class:`Finished`.

        PING items mark ``ping_s`` seconds without an event. Closing the iterator (or dropping it)
        cancels the generation; the slot is freed when the worker thread returns.
        """
        slot = await self.acquire(req.prompt)
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        cancel = threading.Event()

        def emit(item: Any) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, item)

        def done() -> None:
            loop.call_soon_threadsafe(self.release, slot)

        try:
            loop.run_in_executor(self.executor, self._run, slot, req, emit, done, cancel)
        except BaseException:
            self.release(slot)
            raise
        events = _events(queue, cancel, ping_s)
        await anext(events)  # arms the iterator's finally, which cancels the worker
        # Also cancel when the request's task ends: a stream body that was never iterated (the client left
        # between this return and the first chunk) would otherwise only be closed by the garbage collector.
        task = asyncio.current_task()
        if task is not None:
            task.add_done_callback(lambda _: cancel.set())
        return events

    # ---- worker thread ----------------------------------------------------------------------------------------

    def _run(self, slot: Slot, req: GenRequest, emit: Callable[[Any], None], done: Callable[[], None],
             cancel: threading.Event) -> None:
        try:
            result: Any = self._generate(slot, req, emit, cancel)
        except BaseException as exc:  # surfaced to the request by the consumer
            result = exc
        done()  # free the slot before the client can see the end and send its next turn
        emit(result)

    def _prefill(self, slot: Slot, prompt: list[int], cancel: threading.Event) -> int:
        """Bring the slot's session to ``prompt`` reusing the longest cached prefix; return its length."""
        session = slot.session
        cached, source = _reuse(slot, prompt), "live"
        if slot.prompt_snapshot is not None and cached == len(slot.prompt_snapshot.tokens) != _live(slot, prompt):
            source = "slot-snapshot"
        if self.kv_store is not None and cached < len(prompt):
            hit = self.kv_store.lookup(prompt)
            if hit is not None and len(hit.tokens) > cached:
                cached, source = len(hit.tokens), "disk"
                session.restore(hit)
        if source == "slot-snapshot":
            session.restore(slot.prompt_snapshot)
        elif source == "live" and cached != len(session.tokens):
            session.restore(slot.empty)
        if cached == len(prompt) and not session.has_logits:
            cached = 0  # nothing to sample from: rebuild
            session.restore(slot.empty)
        self.tracer.write("cache", slot=slot.index, source=source if cached else "none", cached=cached,
                          prompt=len(prompt))
        for start in range(cached, len(prompt), PREFILL_STEP):
            if cancel.is_set():
                break
            session.feed(prompt[start:start + PREFILL_STEP], logits="last")
        if not cancel.is_set():
            slot.prompt_snapshot = session.snapshot()
        return cached

    def _generate(self, slot: Slot, req: GenRequest, emit: Callable[[Any], None], cancel: threading.Event) -> Finished:
        engine, tok = self.engine, self.engine.tokenizer
        t0 = time.perf_counter()
        cached = self._prefill(slot, req.prompt, cancel)
        t1 = time.perf_counter()
        session = slot.session
        sampler = engine.sampler(req.sampling)
        decoder = tok.incremental_decoder()
        stops = tuple(s for s in (*req.stop, *getattr(engine.chat_format, "stop_strings", ())) if s)
        reason, hit, n, text_out = "length", None, 0, []
        scanner = StopScanner(stops)

        def push(text: str) -> None:
            if text:
                text_out.append(text)
                for event in req.parser.feed(text) if req.parser else [ContentDelta(text)]:
                    emit(event)

        while n < req.max_tokens and session.remaining > 0:
            if cancel.is_set():
                reason = "cancelled"
                break
            token = session.sample(sampler)  # on the device where the backend samples: no logit row crosses
            if token == tok.eos_id:
                reason = "stop"
                break
            n += 1
            text, hit = scanner.push(decoder.push(token))
            push(text)
            if hit is not None:
                reason = "stop" if hit not in req.stop else "stop_sequence"
                break
            session.feed([token], logits="none")
        if reason != "cancelled":
            text, _ = scanner.push(decoder.flush())
            push(text + scanner.flush())
            for event in req.parser.finish() if req.parser else ():
                emit(event)
        t2 = time.perf_counter()
        usage = Usage(len(req.prompt), cached, n, (t1 - t0) * 1000, (t2 - t1) * 1000)
        self.tracer.write("generated", slot=slot.index, reason=reason, tokens=n, text="".join(text_out))
        if (self.kv_store is not None and slot.prompt_snapshot is not None and reason != "cancelled"
                and len(req.prompt) >= max(self.kv_min_tokens, 1) and cached < len(req.prompt)):
            saved = self.kv_store.save(slot.prompt_snapshot)
            self.tracer.write("kv-save", tokens=len(req.prompt), saved=saved)
        return Finished(reason, usage, hit if reason == "stop_sequence" else None)


async def _events(queue: asyncio.Queue, cancel: threading.Event, ping_s: float) -> AsyncIterator[Any]:
    try:
        yield None
        while True:
            try:  # not asyncio.wait_for: on 3.11 it swallows a cancel that lands as an item arrives
                async with asyncio.timeout(ping_s):
                    item = await queue.get()
            except TimeoutError:
                yield PING
                continue
            if isinstance(item, BaseException):
                raise item
            yield item
            if isinstance(item, Finished):
                return
    finally:
        cancel.set()


def _live(slot: Slot, prompt: Sequence[int]) -> int:
    """Tokens of ``prompt`` the slot's live session already holds (0 unless the prompt extends them all)."""
    tokens = slot.session.tokens
    n = len(tokens)
    return n if 0 < n <= len(prompt) and list(prompt[:n]) == tokens else 0


def _reuse(slot: Slot, prompt: Sequence[int]) -> int:
    """Longest prefix of ``prompt`` the slot can resume from (live tokens or its last prompt snapshot)."""
    best = _live(slot, prompt)
    snap = slot.prompt_snapshot
    if snap is not None and best < len(snap.tokens) <= len(prompt) and tuple(prompt[:len(snap.tokens)]) == snap.tokens:
        best = len(snap.tokens)
    return best
