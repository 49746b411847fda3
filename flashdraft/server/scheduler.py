"""One worker thread owns the generator; HTTP handlers talk to it through a queue.

    handler (event loop) ──submit(job)──► queue ──► worker thread: generator.generate(...)
    handler ◄── Ticket.events() ◄── EventChannel (call_soon_threadsafe) ◄── each Step

Why one thread: the target, the drafter and their caches are not shareable between
concurrent sequences yet (batched slots are later work), and torch already uses every
core inside one forward.

Cancellation: a :class:`Ticket` carries a ``threading.Event``. The handler sets it when its
client disconnects; the loop's ``cancelled`` callback reads it before every verify step, so
the slot frees within one step; a ticket cancelled while still queued never runs.
The worker survives any exception raised by one request and reports it on that request's
channel.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from dataclasses import dataclass
from typing import AsyncIterator

from flashdraft.generate import Cancelled, SpeculativeGenerator, Step
from flashdraft.sampling import SamplingParams
from flashdraft.server.metrics import ServerMetrics

log = logging.getLogger(__name__)


@dataclass
class GenerationJob:
    """One generation request, already validated and tokenised.

    Attributes:
        prompt_ids: prompt token ids (non-empty, shorter than the context).
        max_tokens: most tokens to return (>= 1).
        params: sampling settings.
        stop: stop strings.
        ignore_eos: keep generating past EOS.
    """

    prompt_ids: list[int]
    max_tokens: int
    params: SamplingParams
    stop: list[str]
    ignore_eos: bool = False


class JobFailed(Exception):
    """The generation raised; ``error`` is the original exception, ``after_output`` says
    whether any step had been delivered before it."""

    def __init__(self, error: BaseException, after_output: bool):
        super().__init__(str(error))
        self.error, self.after_output = error, after_output


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
    """A submitted job: its events and its cancel flag."""

    def __init__(self, job: GenerationJob, channel: EventChannel):
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
        """
        while True:
            item = await self.channel.get()
            if item is _CANCELLED:
                raise Cancelled()
            if isinstance(item, JobFailed):
                raise item
            yield item
            if item.finish_reason is not None:
                return


class Scheduler:
    """Owns ``generator`` on one worker thread and runs submitted jobs one at a time (FIFO).

    Args:
        generator: the loaded speculative generator.
        metrics: counters to update, or None.
    """

    def __init__(self, generator: SpeculativeGenerator, metrics: ServerMetrics | None = None):
        self.generator = generator
        self.metrics = metrics
        self._queue: queue.Queue[Ticket | None] = queue.Queue()
        self._current: Ticket | None = None
        self._thread = threading.Thread(target=self._run, name="flashdraft-worker", daemon=True)

    def start(self) -> None:
        """Start the worker thread."""
        self._thread.start()

    def submit(self, job: GenerationJob) -> Ticket:
        """Queue ``job``; call from the event loop that will consume its events."""
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
    def busy(self) -> bool:
        """Whether a job is running now."""
        return self._current is not None

    def stop(self, timeout: float = 5.0) -> None:
        """Cancel the running and queued jobs and end the worker (waits up to ``timeout`` s)."""
        if self._current is not None:
            self._current.cancel()
        while True:
            try:
                ticket = self._queue.get_nowait()
            except queue.Empty:
                break
            if ticket is not None:
                ticket.cancel()
                ticket.channel.put(_CANCELLED)
        self._queue.put(None)
        if self._thread.is_alive():
            self._thread.join(timeout)

    # -- worker thread ---------------------------------------------------------------
    def _run(self) -> None:
        while True:
            ticket = self._queue.get()
            if ticket is None:
                return
            if self.metrics:
                self.metrics.deferred.dec()
            if ticket.cancelled:  # its client left while it waited: never run it
                ticket.channel.put(_CANCELLED)
                continue
            self._current = ticket
            if self.metrics:
                self.metrics.processing.inc()
            try:
                self._run_one(ticket)
            finally:
                self._current = None
                if self.metrics:
                    self.metrics.processing.dec()

    def _run_one(self, ticket: Ticket) -> None:
        job, delivered = ticket.job, False
        try:
            for step in self.generator.generate(job.prompt_ids, job.max_tokens, job.params, stop=job.stop,
                                                ignore_eos=job.ignore_eos, cancelled=lambda: ticket.cancelled):
                if step.finish_reason is not None and self.metrics and step.timings is not None:
                    self.metrics.observe_generation(step.timings)
                if not ticket.channel.put(step):
                    ticket.cancel()
                delivered = True
        except Cancelled:
            ticket.channel.put(_CANCELLED)
        except Exception as e:  # one bad request must never kill the worker
            log.exception("generation failed")
            ticket.channel.put(JobFailed(e, after_output=delivered))
