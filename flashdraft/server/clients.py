"""Who sent a request: a key of the API key it presented, for drafters that learn per client.

The server knows clients only by the credential a request carries (``Authorization: Bearer
KEY`` or ``X-Api-Key: KEY``, as :class:`~flashdraft.server.app.APIKeyMiddleware` reads them;
with ``--api-key`` set, only requests carrying that key get this far). Its SHA-256 is the
request's *client* (:func:`flashdraft.drafters.suffix.client_key`): the suffix drafter's
past answers are kept per client and never drafted for another. Requests without a key are
one client, None.

The endpoint sets :data:`REQUEST_CLIENT` once it has the request; the job builder
(:meth:`~flashdraft.server.state.ServerState.make_job`), which runs in the same handler
task, reads it, so the key needs no extra argument through the request pipeline.
"""

from __future__ import annotations

from contextvars import ContextVar

from flashdraft.drafters.suffix import client_key

#: the client of the request the current handler task serves (None = no key)
REQUEST_CLIENT: ContextVar[str | None] = ContextVar("flashdraft_request_client", default=None)


def client_of(headers) -> str | None:
    """The client key of a request's headers (a Starlette ``Headers`` or a ``{name: value}`` dict)."""
    auth = headers.get("authorization") or ""
    token = auth[7:].strip() if auth[:7].lower() == "bearer " else (headers.get("x-api-key") or "")
    return client_key(token)
