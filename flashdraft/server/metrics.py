"""Prometheus metrics of the server (``GET /metrics`` with ``--metrics``).

Glossary (vLLM spec_decode / llama-server conventions):

- ``llamacpp:prompt_tokens_total`` / ``llamacpp:prompt_seconds_total``: prompt tokens
  prefilled and the time spent on them (llama-server's names, so its dashboards work).
- ``llamacpp:tokens_predicted_total`` / ``llamacpp:tokens_predicted_seconds_total``:
  returned output tokens (``predicted_n``: nothing after a stop) and decode time.
- ``spec_decode_num_drafts_total``: verify steps that carried at least one draft token.
- ``spec_decode_num_draft_tokens_total``: draft tokens proposed (``draft_n``).
- ``spec_decode_num_accepted_tokens_total``: draft tokens accepted and returned
  (``draft_n_accepted``).
- ``spec_decode_num_accepted_tokens_per_pos_total{position="k"}``: accepted drafts at
  draft position k (1-based); divided by ``num_drafts`` it is the per-position acceptance.
- ``flashdraft_spec_draft_depth``: the draft depth the controller (``--spec-dm-controller``)
  stands at after the latest finished request, probes aside (0 = drafting off; with the
  controller off, ``--spec-draft-n-max``): ``timings.draft_depth_last``.
- ``flashdraft_spec_draft_depth_mean``: mean draft tokens asked for per verify step in the
  latest finished request (``timings.draft_depth``).
- ``flashdraft_requests_total{endpoint, status}``: finished requests by outcome
  (``ok``, ``cancelled``, ``client_error``, ``server_error``).
- ``llamacpp:requests_processing`` / ``llamacpp:requests_deferred``: running / queued.

Each :class:`ServerMetrics` has its own registry, so several apps in one process (tests)
never share counters.
"""

from __future__ import annotations

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
        self.prompt_tokens = Counter("llamacpp:prompt_tokens", "Prompt tokens processed", registry=r)
        self.prompt_seconds = Counter("llamacpp:prompt_seconds", "Prompt processing time (s)", registry=r)
        self.predicted_tokens = Counter("llamacpp:tokens_predicted", "Returned output tokens", registry=r)
        self.predicted_seconds = Counter("llamacpp:tokens_predicted_seconds", "Decode time (s)", registry=r)
        self.num_drafts = Counter("spec_decode_num_drafts", "Verify steps that carried a draft", registry=r)
        self.num_draft_tokens = Counter("spec_decode_num_draft_tokens", "Draft tokens proposed", registry=r)
        self.num_accepted_tokens = Counter("spec_decode_num_accepted_tokens", "Draft tokens accepted",
                                           registry=r)
        self.accepted_per_pos = Counter("spec_decode_num_accepted_tokens_per_pos",
                                        "Draft tokens accepted at each draft position (1-based)",
                                        ["position"], registry=r)
        self.draft_depth = Gauge("flashdraft_spec_draft_depth",
                                 "Draft depth the controller stands at (0 = drafting off)", registry=r)
        self.draft_depth_mean = Gauge("flashdraft_spec_draft_depth_mean",
                                      "Mean draft tokens asked for per verify step, latest request", registry=r)
        self.requests = Counter("flashdraft_requests", "Finished requests by endpoint and outcome",
                                ["endpoint", "status"], registry=r)
        self.processing = Gauge("llamacpp:requests_processing", "Requests being generated", registry=r)
        self.deferred = Gauge("llamacpp:requests_deferred", "Requests waiting in the queue", registry=r)

    def observe_generation(self, t: Timings) -> None:
        """Add one finished generation's timings (milliseconds in, seconds out)."""
        self.prompt_tokens.inc(t.prompt_n)
        self.prompt_seconds.inc(t.prompt_ms / 1e3)
        self.predicted_tokens.inc(t.predicted_n)
        self.predicted_seconds.inc(t.predicted_ms / 1e3)
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

    def render(self) -> bytes:
        """Prometheus text exposition of every metric."""
        return generate_latest(self.registry)
