"""Who sent a request: a key of the API key it presented, for drafters that learn per client.

The server knows clients only by the credential a request carries (``Authorization: Bearer
KEY`` or ``X-Api-Key: KEY``, as :class:`~flashdraft.server.app.APIKeyMiddleware` reads them;
with ``--api-key`` set, only requests carrying that key get this far). Its SHA-256 is the
request's *client* (:func:`flashdraft.drafters.suffix.client_key`): the suffix drafter's
past answers are kept per client and never drafted for another. Requests without a key are
one client, None.

The request pipeline (:func:`flashdraft.server.pipeline.handle`) puts it in the internal
request (``GenRequest.client``); the job builder hands it to the scheduler's job.
"""

from __future__ import annotations

from flashdraft.drafters.suffix import client_key


def client_of(headers) -> str | None:
    """The client key of a request's headers (a Starlette ``Headers`` or a ``{name: value}`` dict)."""
    auth = headers.get("authorization") or ""
    token = auth[7:].strip() if auth[:7].lower() == "bearer " else (headers.get("x-api-key") or "")
    return client_key(token)
