"""One worker thread owns the generator; HTTP handlers talk to it through a queue.

    handler (event loop) ──submit(job)──► queue ──► worker thread: generator.generate(job)
    handler ◄── Ticket.events() ◄── EventChannel (call_soon_threadsafe) ◄── each Step

Why one thread: torch already uses every core inside one forward, and the target's
weights are the shared resource: with ``-np N > 1`` the worker decodes up to N requests
together, packing their verify (and prefill) rows into one target forward per step
(:mod:`flashdraft.batch`); new requests join free slots between steps. With ``-np 1`` (the
default) it runs one request at a time through ``generator.generate``, exactly as before.

Cancellation: a :class:`Ticket` carries a ``threading.Event``. The handler sets it when its
client disconnects; the worker reads it before every step (``-np 1``: every verify step),
so the slot frees within one step; a ticket cancelled while still queued never runs.
Delivering a step never waits for the client (events go into an unbounded asyncio queue),
so a slow reader never stalls the other slots.
The worker survives any exception raised by one request and reports it on that request's
channel.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from typing import AsyncIterator

from flashdraft import batch
from flashdraft.generate import Cancelled, GenerationRequest, SpeculativeGenerator, Step
from flashdraft.server import request_log
from flashdraft.server.metrics import ServerMetrics

log = logging.getLogger(__name__)


class JobFailed(Exception):
    """The generation raised; ``error`` is the original exception, ``after_output`` says
    whether any step had been delivered before it."""

    def __init__(self, error: BaseException, after_output: bool):
        super().__init__(str(error))
        self.error, self.after_output = error, after_output


class ServerShuttingDown(Exception):
    """The server is stopping: the job was refused, or ended after the grace period."""

    def __init__(self, message: str = "the server is shutting down; retry on another instance or later"):
        super().__init__(message)


_CANCELLED = object()  # end marker: the job was cancelled


class EventChannel:
    """Delivers events from the worker thread to one asyncio consumer.

    ``put`` is safe from any thread; ``get`` must be awaited on the loop that created it.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = loop
        self._queue: asyncio.Queue = asyncio.Queue()

    def put(self, item: object) -> bool:
        """Hand ``item`` to the consumer; False when its event loop is gone."""
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
            return True
        except RuntimeError:  # loop closed (server shutting down)
            return False

    async def get(self) -> object:
        """Next event, waiting for it."""
        return await self._queue.get()


class Ticket:
    """A submitted job (one validated, tokenised request): its events and its cancel flag."""

    def __init__(self, job: GenerationRequest, channel: EventChannel):
        self.job = job
        self.channel = channel
        self._cancel = threading.Event()

    def cancel(self) -> None:
        """Ask the worker to stop this job (or never start it); safe from any thread."""
        self._cancel.set()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    async def events(self) -> AsyncIterator[Step]:
        """The job's steps, the last one with ``finish_reason`` set.

        Raises:
            Cancelled: the job was cancelled before finishing.
            JobFailed: the generation raised.
            ServerShuttingDown: the server stopped before the job finished.
        """
        while True:
            item = await self.channel.get()
            if item is _CANCELLED:
                raise Cancelled()
            if isinstance(item, (JobFailed, ServerShuttingDown)):
                raise item
            yield item
            if item.finish_reason is not None:
                return


class Scheduler:
    """Owns ``generator`` on one worker thread and runs submitted jobs (FIFO admission).

    Args:
        generator: the loaded speculative generator.
        metrics: counters to update, or None.
        n_slots: requests decoded together (``-np``); 1 = one at a time.
        prefill_chunk: most prompt tokens a prefill forward takes (``-b``; None = whole
            prompts). With ``n_slots`` > 1 every prompt is chunked, so a long one does not
            stall the other slots; with one slot only a request that asks for
            ``return_progress`` is (there is no other slot to wait, and no chunk to report).
    Raises:
        ValueError: ``n_slots < 1`` or ``prefill_chunk < 1``.
    """

    def __init__(self, generator: SpeculativeGenerator, metrics: ServerMetrics | None = None, n_slots: int = 1,
                 prefill_chunk: int | None = None):
        if n_slots < 1:
            raise ValueError(f"n_slots must be >= 1, got {n_slots}")
        if prefill_chunk is not None and prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        self.prefill_chunk = prefill_chunk
        self.generator = generator
        self.metrics = metrics
        self.n_slots = n_slots
        self._queue: queue.Queue[Ticket | None] = queue.Queue()
        self._current: Ticket | None = None
        self._held = False  # -np 1: the running job is in the processing count
        self._running: set[Ticket] = set()  # -np > 1: tickets holding a slot
        self._slots: list[batch.Slot] = []  # -np > 1: made by the worker thread
        #: set by begin_shutdown: no new jobs; the running one must end by ``_deadline``
        self._closing = False
        self._deadline: float | None = None
        self._thread = threading.Thread(target=self._run if n_slots == 1 else self._run_slots,
                                        name="flashdraft-worker", daemon=True)

    def start(self) -> None:
        """Start the worker thread."""
        self._thread.start()

    def submit(self, job: GenerationRequest) -> Ticket:
        """Queue ``job``; call from the event loop that will consume its events.

        Raises:
            ServerShuttingDown: after :meth:`begin_shutdown`.
        """
        if self._closing:
            raise ServerShuttingDown()
        ticket = Ticket(job, EventChannel(asyncio.get_running_loop()))
        if self.metrics:
            self.metrics.deferred.inc()
        self._queue.put(ticket)
        return ticket

    @property
    def queued(self) -> int:
        """Jobs waiting (not counting the running one)."""
        return self._queue.qsize()

    @property
    def waiting(self) -> int:
        """Queued jobs whose client is still there: a ticket cancelled while queued stays in
        the queue until the worker skips it, but holds no place against ``--max-queue``."""
        with self._queue.mutex:
            return sum(1 for t in self._queue.queue if t is not None and not t.cancelled)

    @property
    def busy(self) -> bool:
        """Whether a job is running now."""
        return self._current is not None or bool(self._running)

    @property
    def slots_busy(self) -> int:
        """Slots decoding a request now."""
        return len(self._running) if self.n_slots > 1 else int(self._current is not None)

    def slot_states(self) -> list[dict]:
        """Per slot, for ``GET /slots``: ``id``, ``is_processing`` and ``n_cached`` (tokens
        whose K/V its prompt cache holds for the next request; 0 while it decodes). Read
        from another thread without a lock: a snapshot that may be one step old."""
        if self.n_slots == 1:
            cached = self.generator.prompt_cache
            return [{"id": 0, "is_processing": self._current is not None,
                     "n_cached": 0 if cached is None else len(cached.tokens)}]
        slots = list(self._slots) or [batch.Slot(i, None, None) for i in range(self.n_slots)]
        return [{"id": s.index, "is_processing": not s.free,
                 "n_cached": 0 if s.prompt_cache is None else len(s.prompt_cache.tokens)} for s in slots]

    def begin_shutdown(self, grace_s: float) -> None:
        """Stop taking jobs: queued ones get :class:`ServerShuttingDown` now, the running one
        may finish within ``grace_s`` seconds, then gets it too. Safe from any thread (the
        server calls it from its SIGTERM handler); calling it again keeps the first deadline."""
        if self._closing:
            return
        self._deadline = time.monotonic() + max(0.0, grace_s)
        self._closing = True
        self._reject_queued(ServerShuttingDown())

    def _past_deadline(self) -> bool:
        return self._deadline is not None and time.monotonic() >= self._deadline

    def _reject_queued(self, end: object) -> None:
        """Empty the queue, ending each waiting ticket with ``end``."""
        while True:
            try:
                ticket = self._queue.get_nowait()
            except queue.Empty:
                return
            if ticket is None:  # a stop() marker: keep it for the worker
                self._queue.put(None)
                return
            if self.metrics:
                self.metrics.deferred.dec()
            ticket.cancel()
            ticket.channel.put(end)

    def stop(self, timeout: float = 5.0) -> None:
        """Cancel the running and queued jobs and end the worker (waits up to ``timeout`` s)."""
        self._closing = True
        if self._current is not None:
            self._current.cancel()
        for ticket in list(self._running):
            ticket.cancel()
        self._reject_queued(_CANCELLED)
        self._queue.put(None)
        if self._thread.is_alive():
            self._thread.join(timeout)

    # -- worker thread ---------------------------------------------------------------
    def _accept(self, ticket) -> bool:
        """A ticket just taken off the queue: False (and its client told) when it must not run."""
        if self.metrics:
            self.metrics.deferred.dec()
        if ticket.cancelled:  # its client left while it waited: never run it
            ticket.channel.put(_CANCELLED)
            return False
        if self._closing:  # raced with begin_shutdown: refuse rather than start
            ticket.channel.put(ServerShuttingDown())
            return False
        return True

    def _run(self) -> None:
        while True:
            ticket = self._queue.get()
            if ticket is None:
                return
            if not self._accept(ticket):
                continue
            self._current = ticket
            if self.metrics:
                self.metrics.processing.inc()
            self._held = True
            try:
                self._run_one(ticket)
            finally:
                self._current = None
                self._release()

    def _release(self) -> None:
        """``-np 1``: leave the running count, once per job, before the job's last event is
        delivered, so ``requests_processing`` reads 0 by the time its client has the answer."""
        if self._held:
            self._held = False
            self._current = None
            if self.metrics:
                self.metrics.processing.dec()

    def _run_one(self, ticket: Ticket) -> None:
        job, delivered = ticket.job, False

        def stopped() -> bool:  # read by the loop before every verify step
            return ticket.cancelled or self._past_deadline()

        try:
            chunk = self.prefill_chunk if job.return_progress else None
            for step in self.generator.generate(job, cancelled=stopped, prefill_chunk=chunk):
                p = step.prompt_progress  # the 0% report comes before any forward
                if self.metrics and not (step.only_progress and p.processed == p.cache):
                    self.metrics.observe_decode(1)
                if step.finish_reason is not None:
                    if self.metrics and step.timings is not None:
                        self.metrics.observe_generation(step.timings)
                    if step.timings is not None:  # the request log: the response's own timings
                        request_log.generation(step.timings.to_dict(self.generator.drafting), 0, step.finish_reason)
                    self._release()
                if not ticket.channel.put(step):
                    ticket.cancel()
                delivered = True
        except Cancelled:
            # the client left (nobody reads this), or shutdown's grace period ran out
            self._release()
            ticket.channel.put(_CANCELLED if ticket.cancelled else ServerShuttingDown())
        except Exception as e:  # one bad request must never kill the worker
            log.exception("generation failed")
            self._release()
            ticket.channel.put(JobFailed(e, after_output=delivered))

    # -- worker thread, -np > 1 ------------------------------------------------------
    def _run_slots(self) -> None:
        """Admit queued jobs into free slots, step every busy slot together, repeat."""
        slots = self._slots = batch.make_slots(self.generator, self.n_slots)
        while True:
            if not self._admit(slots):
                for slot in slots:
                    if not slot.free:
                        self._end(slot, _CANCELLED)
                return
            for slot in slots:  # a client that left (or the shutdown deadline) frees its slot now
                if not slot.free and (slot.owner.cancelled or self._past_deadline()):
                    self._end(slot, _CANCELLED if slot.owner.cancelled else ServerShuttingDown())
            busy = [slot for slot in slots if not slot.free]
            if not busy:
                continue
            if self.metrics:
                self.metrics.observe_decode(len(busy))
            for slot, result in zip(busy, batch.step_together(self.generator.target, [s.seq for s in busy])):
                ticket = slot.owner
                if isinstance(result, Exception):  # one bad request must never kill the worker
                    log.error("generation failed", exc_info=result)
                    self._end(slot, JobFailed(result, after_output=slot.delivered))
                    continue
                if result.finish_reason is not None and self.metrics and result.timings is not None:
                    self.metrics.observe_generation(result.timings)
                if result.finish_reason is not None and result.timings is not None:  # the request log
                    request_log.generation(result.timings.to_dict(self.generator.drafting), slot.index,
                                           result.finish_reason)
                if slot.seq.done:  # out of the running count before the client gets its answer
                    self._end(slot, result)
                    continue
                if not slot.seq.prefilled and result.prompt_progress is None:
                    continue  # a chunk of a long prompt: nothing to hand out yet
                if not ticket.channel.put(result):
                    ticket.cancel()
                slot.delivered = True

    def _admit(self, slots: list[batch.Slot]) -> bool:
        """Start queued jobs in free slots; waits for one only when every slot is free.

        Returns:
            False when the stop marker came (the worker must end).
        """
        free = [slot for slot in slots if slot.free]
        while free:
            try:
                ticket = self._queue.get(block=len(free) == len(slots))
            except queue.Empty:
                return True
            if ticket is None:
                return False
            if not self._accept(ticket):
                continue
            job = ticket.job
            slot = batch.best_slot(free, job.prompt_ids, reuse=job.cache_prompt)
            try:
                batch.start(self.generator, slot, job, self.prefill_chunk)
            except Exception as e:  # e.g. a prompt longer than the context: that request fails
                log.error("generation failed", exc_info=e)
                ticket.channel.put(JobFailed(e, after_output=False))
                continue
            free.remove(slot)
            slot.owner = ticket
            if job.return_progress:  # before any forward: llama-server's 0% report
                ticket.channel.put(slot.seq.progress_step())
            self._running.add(ticket)
            if self.metrics:
                self.metrics.processing.inc()
        return True

    def _end(self, slot: batch.Slot, end: object | None) -> None:
        """Free ``slot``; ``end`` (if not None) is the last event its ticket gets, delivered
        after the slot has left the running count."""
        ticket = slot.owner
        # a finished or cancelled sequence is between steps: its caches serve the next prompt;
        # after a failure they may be half-written, so the slot starts afresh
        slot.prompt_cache = None if isinstance(end, (JobFailed, ServerShuttingDown)) else slot.seq.leftover()
        slot.seq, slot.owner = None, None
        self._running.discard(ticket)
        if self.metrics:
            self.metrics.processing.dec()
        if end is not None:
            ticket.channel.put(end)
