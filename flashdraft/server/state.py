"""Server settings and the state shared by the routes (loading status, generator, queue)."""

from __future__ import annotations


import logging
import time
from dataclasses import dataclass, field
from typing import Callable

from flashdraft.constraints import TokenizerInfo
from flashdraft.generate import GenerationRequest, SpeculativeGenerator
from flashdraft.prompt_store import PromptStore
from flashdraft.server.errors import APIError
from flashdraft.server.limits import Limits, over
from flashdraft.server.metrics import ServerMetrics
from flashdraft.server.prompting import PromptBuilder
from flashdraft.server.scheduler import Scheduler, ServerShuttingDown, Ticket

log = logging.getLogger(__name__)


@dataclass
class CorsSettings:
    """``--cors-origins/-methods/-headers/-credentials`` (Starlette's CORS middleware), with
    llama-server's defaults: any origin, credentials allowed (the Origin is then echoed)."""

    origins: list[str] = field(default_factory=lambda: ["*"])
    methods: list[str] = field(default_factory=lambda: ["GET", "POST", "DELETE", "OPTIONS"])
    headers: list[str] = field(default_factory=lambda: ["*"])
    credentials: bool = True

    #: what ``--cors-origins localhost`` allows (llama-server's special value)
    LOCALHOST = r"https?://(localhost|127\.0\.0\.1|\[::1\])(:[0-9]+)?"

    def origin_regex(self) -> str | None:
        """The pattern for ``localhost`` among the origins, else None."""
        return self.LOCALHOST if "localhost" in self.origins else None

    def listed_origins(self) -> list[str]:
        """The origins given literally (``localhost`` is :meth:`origin_regex`)."""
        return [o for o in self.origins if o != "localhost"]


@dataclass
class ServerSettings:
    """Server-wide defaults and switches (from ``flashdraft serve`` flags).

    Sampling defaults are llama-server's (``--temp 0.8 --top-k 40 --top-p 0.95
    --min-p 0.05``) so a client that sends no sampling fields sees the same behaviour as
    with llama-server; any field a request sends overrides them.

    Attributes:
        alias: ``--alias``: model names, comma-separated; the model id is the first in
            sorted order (llama-server keeps them in a sorted set); None = the model's name.
        tags: ``--tags``: listed by ``/v1/models``, informational.
        model_path: ``-m`` as given (also accepted as a request ``model``).
        spec_type: drafter kind, for ``/props``.
        n_predict: new tokens for requests that set no limit (``-n``); -1 = until EOS or the
            context end. A request's own limit wins, as in llama-server.
        metrics: expose ``/metrics``.
        api_key: required Bearer token, or None.
        reasoning: ``on`` | ``off`` | ``auto``: ``enable_thinking`` for chat templates.
        n_parallel: ``-np``: requests decoded together (one packed target forward per step).
        batch_size: ``-b``: with ``-np`` > 1, most prompt tokens a slot prefills in one packed
            step (a longer prompt takes several, and the other slots step in between); with
            one slot, the prefill chunk of a request that asks for ``return_progress``.
        limits: the ``--max-*`` limits (:class:`~flashdraft.server.limits.Limits`).
        webui: serve the chat page at ``/`` (llama-server's ``--no-webui`` turns it off).
        slots_endpoint: serve ``GET /slots`` (``--no-slots`` turns it off).
        cache_prompt: the prompt cache for requests that do not say (``--no-cache-prompt``: off).
        cache_ram_mib: ``--cache-ram``: MiB of host RAM for saved prompt caches
            (:mod:`flashdraft.prompt_store`); -1 = no limit, 0 = none.
        ignore_eos: the default of the request field (``--ignore-eos``).
        n_keep: ``--keep``: prompt tokens a context shift keeps, for requests that give no ``n_keep``.
        chat_template_kwargs: template variables for every request (``--chat-template-kwargs``).
        cors: CORS answers for browsers on other origins.
        chat_template: ``(kind, value)`` from ``--jinja/--no-jinja/--chat-template(-file)``
            (:func:`~flashdraft.server.chat_templates.resolve_template`).
        shutdown_grace_s: after SIGTERM, how long the running request may go on before it
            is ended with a 503 / an ``error`` event; kept below uvicorn's graceful-shutdown
            timeout (5 s in ``flashdraft serve``) so the clean end wins over a cut connection.
        verbose: ``-v``: every non-streamed answer carries ``__verbose`` (the prompt as
            text), as llama-server's debug mode.
        sse_ping_interval: ``--sse-ping-interval``, seconds: a stream whose first token has
            not come by then gets its headers and a keep-alive ping, and another ping every
            interval until it does (a long prefill); <= 0 = wait silently (llama-server's -1).
    """

    alias: str | None = None
    tags: list[str] = field(default_factory=list)
    model_path: str | None = None
    spec_type: str = "dflash"
    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    seed: int | None = None
    n_predict: int = -1
    metrics: bool = False
    api_key: str | None = None
    reasoning: str = "auto"
    n_parallel: int = 1
    batch_size: int = 256
    limits: Limits = field(default_factory=Limits)
    webui: bool = True
    slots_endpoint: bool = True
    chat_template: tuple = ("jinja", None)
    cache_prompt: bool = True
    cache_ram_mib: int = 0
    ignore_eos: bool = False
    n_keep: int = 0
    chat_template_kwargs: dict = field(default_factory=dict)
    cors: CorsSettings = field(default_factory=CorsSettings)
    shutdown_grace_s: float = 3.0
    verbose: bool = False
    sse_ping_interval: float = 30.0

    def aliases(self) -> list[str]:
        """``--alias`` split at commas, sorted (the first is the model id)."""
        return sorted({a.strip() for a in (self.alias or "").split(",") if a.strip()})

    def template_kwargs(self) -> dict:
        """Chat-template variables from ``--chat-template-kwargs`` and ``--reasoning``."""
        reasoning = {} if self.reasoning == "auto" else {"enable_thinking": self.reasoning == "on"}
        return {**self.chat_template_kwargs, **reasoning}


@dataclass
class ServerState:
    """What the routes share. ``status``: ``loading`` -> ``ready`` | ``failed``; ``stopping``
    after SIGTERM (every route but the running requests then answers 503)."""

    settings: ServerSettings
    on_load_failed: Callable[[BaseException], None] | None = None
    metrics: ServerMetrics = field(default_factory=ServerMetrics)
    status: str = "loading"
    error: str | None = None
    generator: SpeculativeGenerator | None = None
    scheduler: Scheduler | None = None
    prompts: PromptBuilder | None = None
    model_id: str = ""
    started: int = field(default_factory=lambda: int(time.time()))

    # -- loading -------------------------------------------------------------------
    def load(self, loader: Callable[[], SpeculativeGenerator]) -> None:
        """Run ``loader`` (on a background thread) and become ready, or ``failed``."""
        t0 = time.perf_counter()
        try:
            generator = loader()
        except BaseException as e:  # report every failure, then let the CLI exit
            self.error = f"{type(e).__name__}: {e}"
            self.status = "failed"
            log.error("model loading failed: %s", self.error)
            if self.on_load_failed is not None:
                self.on_load_failed(e)
            return
        try:  # the grammar engine's view of the vocabulary (≈ 2 s), before the first request needs it
            TokenizerInfo.for_target(generator.target)
        except Exception as e:  # noqa: BLE001 - constrained requests will report it themselves
            log.warning("grammar constraints unavailable: %s", e)
        self.set_ready(generator)
        log.info("model loaded in %.1f s; serving %r", time.perf_counter() - t0, self.model_id)

    def set_ready(self, generator: SpeculativeGenerator) -> None:
        """Start the worker on ``generator`` and accept requests."""
        self.generator = generator
        generator.reproducible_seeds = True  # llama-server's rule: a seed gives the same tokens, drafting or not
        mib = self.settings.cache_ram_mib
        if mib != 0 and generator.prompt_store is None and hasattr(generator.target, "save_cache"):
            generator.prompt_store = PromptStore(None if mib < 0 else mib * 2**20)
        self.prompts = PromptBuilder(generator.target, self.settings.template_kwargs(), self.settings.chat_template)
        self.model_id = (self.settings.aliases() or [generator.target.name])[0]
        self.scheduler = Scheduler(generator, self.metrics, n_slots=self.settings.n_parallel,
                                   prefill_chunk=self.settings.batch_size)
        self.scheduler.start()
        if self.status == "stopping":  # SIGTERM came while loading: stay stopping
            self.scheduler.begin_shutdown(0.0)
            return
        self.status = "ready"  # last: routes check it before touching the fields above

    def begin_shutdown(self) -> None:
        """SIGTERM: answer 503 from now on, reject queued jobs, give the running one
        ``shutdown_grace_s`` to finish. Idempotent; safe from a signal handler."""
        if self.status in ("stopping", "failed"):
            return
        self.status = "stopping"
        log.info("shutting down: queued requests are rejected, the running one has %.1f s to finish",
                 self.settings.shutdown_grace_s)
        if self.scheduler is not None:
            self.scheduler.begin_shutdown(self.settings.shutdown_grace_s)

    def shutdown(self) -> None:
        """Cancel queued and running jobs and stop the worker."""
        if self.scheduler is not None:
            self.scheduler.stop()

    def require_ready(self) -> None:
        """Raises APIError 503 while loading or stopping (500 if loading failed)."""
        if self.status == "ready":
            return
        if self.status == "failed":
            raise APIError(500, f"model loading failed: {self.error}", type="server_error", code="load_failed")
        if self.status == "stopping":
            raise APIError(503, "the server is shutting down", type="unavailable_error",
                           code="server_shutting_down")
        raise APIError(503, "Loading model", type="unavailable_error", code="model_loading")

    def submit(self, job: GenerationRequest) -> Ticket:
        """Queue ``job`` on the worker. Raises APIError 503 once shutdown has begun, or when
        ``--max-queue`` requests already wait (code ``queue_full``)."""
        return self.submit_all([job])[0]

    def submit_all(self, jobs: list[GenerationRequest]) -> list[Ticket]:
        """Queue every job of a request, or none: ``--max-queue`` caps the jobs that would
        wait for a slot (those queued plus these, less the free slots), checked for all of
        them first (the event loop runs no other handler in between)."""
        cap, sched = self.settings.limits.queue, self.scheduler
        waiting = sched.waiting + len(jobs) - max(0, sched.n_slots - sched.slots_busy) if cap else 0
        if cap and waiting > cap:
            err = over("queue", cap, waiting, None, status=503)
            err.type, err.code = "unavailable_error", "queue_full"
            err.message = f"the server is busy: {sched.waiting} requests wait for a slot (--max-queue {cap}); retry later"
            raise err
        try:
            return [self.scheduler.submit(job) for job in jobs]
        except ServerShuttingDown as e:
            raise APIError(503, str(e), type="unavailable_error", code="server_shutting_down") from None

    # -- request checks --------------------------------------------------------------
    def check_model(self, requested: str | None) -> str:
        """The model id to report. Any requested name is accepted: llama-server serving one
        model ignores the field, and tools written for it send names of their own (the seed
        guide's script sends ``"local-gemma"``). ``/v1/models`` still names the alias."""
        return self.model_id
