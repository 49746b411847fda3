"""Step 2 of every generation route: check a parsed request once, before anything is built.

What is checked here does not need the model: fields outside the API's schema that would
change the answer (:mod:`.request_fields`) and the ``--max-*`` limits (:mod:`.limits`).
What needs the model (the prompt against the context, a grammar that must compile, token
ids in the vocabulary) is checked where it is built, in :mod:`.jobs`, with the same 400s.
"""

from __future__ import annotations

from flashdraft.server.limits import Limits, check_request
from flashdraft.server.request import GenRequest
from flashdraft.server.request_fields import check_extra_fields


def validate(req: GenRequest, limits: Limits) -> GenRequest:
    """Check ``req``; returns it unchanged.

    Raises:
        APIError: 400 naming the first unsupported field (``unsupported_field``) or the
            first limit exceeded (``limit_exceeded``, naming the ``--max-*`` flag).
    """
    check_extra_fields(req.extra)
    check_request(req, limits)
    return req
