"""Prometheus metrics of the server (``GET /metrics`` with ``--metrics``).

Glossary (vLLM spec_decode / llama-server conventions):

- ``llamacpp:prompt_tokens_total`` / ``llamacpp:prompt_seconds_total``: prompt tokens
  prefilled and the time spent on them (llama-server's names, so its dashboards work).
- ``llamacpp:prompt_tokens_cached_total``: prompt tokens reused from the prompt cache
  instead (``cache_n``).
- ``llamacpp:tokens_predicted_total`` / ``llamacpp:tokens_predicted_seconds_total``:
  returned output tokens (``predicted_n``: nothing after a stop) and decode time.
- ``llamacpp:prompt_tokens_seconds`` / ``llamacpp:predicted_tokens_seconds``: the two
  totals' ratios, tokens per second.
- ``llamacpp:n_decode_total``: target forwards (prefills and verify steps; with ``-np N`` one
  packed forward for all busy slots counts once); ``llamacpp:n_busy_slots_per_decode``:
  busy slots per forward, on average; ``llamacpp:n_tokens_max``: the longest sequence
  (prompt + answer) seen.
- ``llamacpp:spec_decode_num_drafts_total``: verify steps that carried at least one draft token.
- ``llamacpp:spec_decode_num_draft_tokens_total``: draft tokens proposed (``draft_n``).
- ``llamacpp:spec_decode_num_accepted_tokens_total``: draft tokens accepted and returned
  (``draft_n_accepted``).
- ``llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position="k"}``: accepted drafts at
  draft position k (1-based); divided by ``num_drafts`` it is the per-position acceptance.
- ``llamacpp:spec_draft_depth``: the draft depth the controller (``--spec-dm-controller``)
  stands at after the latest finished request, probes aside (0 = drafting off; with the
  controller off, ``--spec-draft-n-max``): ``timings.draft_depth_last``.
- ``llamacpp:spec_draft_depth_mean``: mean draft tokens asked for per verify step in the
  latest finished request (``timings.draft_depth``).
- ``flashdraft_requests_total{endpoint, status}``: finished requests by outcome
  (``ok``, ``cancelled``, ``client_error``, ``server_error``).
- ``llamacpp:requests_processing`` / ``llamacpp:requests_deferred``: running / queued.

Each :class:`ServerMetrics` has its own registry, so several apps in one process (tests)
never share counters.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, disable_created_metrics, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from flashdraft.generate import Timings

CONTENT_TYPE = CONTENT_TYPE_LATEST

# the ``*_created`` timestamp series double the output and no llama-server dashboard reads them
disable_created_metrics()


class ServerMetrics:
    """Counters and gauges of one server; thread-safe (prometheus-client locks)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.started = int(time.time())
        self.prompt_tokens = Counter("llamacpp:prompt_tokens", "Prompt tokens processed", registry=r)
        self.prompt_seconds = Counter("llamacpp:prompt_seconds", "Prompt processing time (s)", registry=r)
        self.prompt_cached = Counter("llamacpp:prompt_tokens_cached", "Prompt tokens reused from the prompt cache",
                                     registry=r)
        self.predicted_tokens = Counter("llamacpp:tokens_predicted", "Returned output tokens", registry=r)
        self.predicted_seconds = Counter("llamacpp:tokens_predicted_seconds", "Decode time (s)", registry=r)
        Gauge("llamacpp:prompt_tokens_seconds", "Average prompt throughput (tokens/s)", registry=r).set_function(
            lambda: _ratio(self.prompt_tokens, self.prompt_seconds))
        Gauge("llamacpp:predicted_tokens_seconds", "Average generation throughput (tokens/s)",
              registry=r).set_function(lambda: _ratio(self.predicted_tokens, self.predicted_seconds))
        self.n_decode = Counter("llamacpp:n_decode", "Target forwards (prefills and verify steps)", registry=r)
        self._busy_slot_steps = 0
        Gauge("llamacpp:n_busy_slots_per_decode", "Average busy slots per target forward", registry=r).set_function(
            lambda: self._busy_slot_steps / max(1.0, self.n_decode._value.get()))
        self.n_tokens_max = Gauge("llamacpp:n_tokens_max", "Longest sequence seen (prompt + answer tokens)",
                                  registry=r)
        self.num_drafts = Counter("llamacpp:spec_decode_num_drafts", "Verify steps that carried a draft", registry=r)
        self.num_draft_tokens = Counter("llamacpp:spec_decode_num_draft_tokens", "Draft tokens proposed", registry=r)
        self.num_accepted_tokens = Counter("llamacpp:spec_decode_num_accepted_tokens", "Draft tokens accepted",
                                           registry=r)
        self.accepted_per_pos = Counter("llamacpp:spec_decode_num_accepted_tokens_per_pos",
                                        "Draft tokens accepted at each draft position (1-based)",
                                        ["position"], registry=r)
        self.draft_depth = Gauge("llamacpp:spec_draft_depth",
                                 "Draft depth the controller stands at (0 = drafting off)", registry=r)
        self.draft_depth_mean = Gauge("llamacpp:spec_draft_depth_mean",
                                      "Mean draft tokens asked for per verify step, latest request", registry=r)
        self.requests = Counter("flashdraft_requests", "Finished requests by endpoint and outcome",
                                ["endpoint", "status"], registry=r)
        self.processing = Gauge("llamacpp:requests_processing", "Requests being generated", registry=r)
        self.deferred = Gauge("llamacpp:requests_deferred", "Requests waiting in the queue", registry=r)

    def observe_decode(self, busy_slots: int) -> None:
        """One target forward that served ``busy_slots`` sequences."""
        self.n_decode.inc()
        self._busy_slot_steps += busy_slots

    def observe_generation(self, t: Timings) -> None:
        """Add one finished generation's timings (milliseconds in, seconds out)."""
        self.prompt_tokens.inc(t.prompt_n)
        self.prompt_seconds.inc(t.prompt_ms / 1e3)
        self.prompt_cached.inc(t.cache_n)
        self.predicted_tokens.inc(t.predicted_n)
        self.predicted_seconds.inc(t.predicted_ms / 1e3)
        n_tokens = t.prompt_n + t.cache_n + t.predicted_n
        if n_tokens > self.n_tokens_max._value.get():
            self.n_tokens_max.set(n_tokens)
        self.num_drafts.inc(t.n_drafts)
        self.num_draft_tokens.inc(t.draft_n)
        self.num_accepted_tokens.inc(t.draft_n_accepted)
        for k, n in enumerate(t.accepted_per_position):
            if n:
                self.accepted_per_pos.labels(position=str(k + 1)).inc(n)
        if t.n_steps > 1:  # a request that ended at its first token chose no depth
            self.draft_depth.set(t.draft_depth_last)
            self.draft_depth_mean.set(t.draft_depth)

    def observe_request(self, endpoint: str, status: str) -> None:
        """Count one finished request. ``status``: ok | cancelled | client_error | server_error."""
        self.requests.labels(endpoint=endpoint, status=status).inc()

    def headers(self) -> dict[str, str]:
        """Response headers of ``/metrics`` (llama-server sends the process start time)."""
        return {"Process-Start-Time-Unix": str(self.started)}

    def render(self) -> bytes:
        """Prometheus text exposition of every metric.

        ``llamacpp:n_tokens_max`` is declared a counter, as llama-server declares it (it only
        ever grows); prometheus-client would name a counter's sample ``..._total``, so it is
        kept as a gauge inside and only its ``# TYPE`` line says counter.
        """
        return generate_latest(self.registry).replace(b"# TYPE llamacpp:n_tokens_max gauge",
                                                      b"# TYPE llamacpp:n_tokens_max counter")


def _ratio(num: Counter, den: Counter) -> float:
    d = den._value.get()
    return num._value.get() / d if d > 0 else 0.0
