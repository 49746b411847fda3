"""Per-request limits, each set by a ``--max-*`` flag of ``flashdraft serve``.

A request over a limit is refused before it is tokenised or queued, with a 4xx in OpenAI's
error shape whose message names the flag, plus ``limit`` (the flag) and ``limit_value``
fields: 413 for the body size, 400 for the rest, and 503 ``queue_full`` (a retryable
overload answer, not the client's fault) when ``--max-queue`` requests already wait.

Why each limit exists: the body is read into memory; every prompt of a batch becomes a job
of its own; ``n_probs`` alternatives are sorted out of the vocabulary at every token; each
``logit_bias`` entry is a column write per step; tools and grammars are compiled per request;
stop strings are compared with the text's tail after every token.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields

from flashdraft.argtypes import non_negative_int
from flashdraft.server.errors import APIError

MIB = 1024 * 1024


@dataclass(frozen=True)
class Limits:
    """The limits; 0 turns ``prompt_tokens`` and ``queue`` off (the context, no cap).

    Attributes:
        body_bytes: request body size (413 beyond).
        prompt_tokens: prompt tokens per request, below the context size.
        batch_prompts: prompts in one batched ``/v1/completions`` or ``/completion`` request.
        n_probs: alternatives per token (``n_probs``, ``top_logprobs``, ``logprobs: N``).
        logit_bias: ``logit_bias`` entries.
        tools: entries of ``tools``.
        grammar_chars: characters of a GBNF grammar or of a JSON schema's JSON text.
        stop_strings: stop strings per request.
        stop_length: characters per stop string.
        queue: requests waiting for a slot (503 ``queue_full`` beyond).
    """

    body_bytes: int = 8 * MIB
    prompt_tokens: int = 0
    batch_prompts: int = 64
    n_probs: int = 20
    logit_bias: int = 1024
    tools: int = 64
    grammar_chars: int = 64 * 1024
    stop_strings: int = 16
    stop_length: int = 512
    queue: int = 0


#: what each limit counts, for help texts and messages
WHAT = {
    "body_bytes": "bytes of request body", "prompt_tokens": "prompt tokens (0 = the context size)",
    "batch_prompts": "prompts per batched request", "n_probs": "n_probs / top_logprobs / logprobs per token",
    "logit_bias": "logit_bias entries", "tools": "tools per request",
    "grammar_chars": "characters of grammar or JSON schema", "stop_strings": "stop strings per request",
    "stop_length": "characters per stop string", "queue": "requests waiting for a slot (0 = no cap)",
}


def flag(name: str) -> str:
    """The ``flashdraft serve`` flag of limit ``name``: ``n_probs`` -> ``--max-n-probs``."""
    return "--max-" + name.replace("_", "-")


def add_arguments(group) -> None:
    """Add one ``--max-*`` flag per limit to an argparse group (dest ``max_<name>``)."""
    for f in fields(Limits):
        group.add_argument(flag(f.name), dest=f"max_{f.name}", type=non_negative_int, default=f.default,
                           metavar="N", help=f"most {WHAT[f.name]} (default: {f.default})")


def from_args(args) -> Limits:
    """:class:`Limits` from the parsed ``--max-*`` flags (defaults where absent)."""
    return Limits(**{f.name: getattr(args, f"max_{f.name}", f.default) for f in fields(Limits)})


def over(name: str, limit: int, got: int, param: str | None, status: int = 400) -> APIError:
    """The error for ``got`` over limit ``name``: the message names the flag."""
    return APIError(status, f"{param or 'request'}: {got} {WHAT[name].split(' (')[0]}, over the limit of "
                            f"{limit} ({flag(name)})", param=param, code="limit_exceeded",
                    extra={"limit": flag(name), "limit_value": limit})


def check_request(req, limits: Limits) -> None:
    """Refuse a parsed generation request (:class:`~flashdraft.server.request.GenRequest`)
    over any limit but the body's, prompt's and queue's.

    Raises:
        APIError: 400 ``limit_exceeded`` naming the field (``param``) and the flag.
    """
    if req.n_probs > limits.n_probs:
        raise over("n_probs", limits.n_probs, req.n_probs, req.n_probs_param)
    if len(req.stop) > limits.stop_strings:
        raise over("stop_strings", limits.stop_strings, len(req.stop), "stop")
    for s in req.stop:
        if len(s) > limits.stop_length:
            raise over("stop_length", limits.stop_length, len(s), "stop")
    if len(req.logit_bias) > limits.logit_bias:
        raise over("logit_bias", limits.logit_bias, len(req.logit_bias), "logit_bias")
    if req.tools.offered > limits.tools:
        raise over("tools", limits.tools, req.tools.offered, req.tools.param)
    for param, size in _grammar_sizes(req):
        if size > limits.grammar_chars:
            raise over("grammar_chars", limits.grammar_chars, size, param)
    if req.prompts is not None and len(req.prompts) > limits.batch_prompts:
        raise over("batch_prompts", limits.batch_prompts, len(req.prompts), "prompt")


def _grammar_sizes(req) -> list[tuple[str, int]]:
    """``(param, characters)`` of the request's grammar or schema and of each tool's parameters."""
    out = []
    if req.constraint is not None and req.constraint[1] is not None:
        source = req.constraint[1]
        out.append((req.constraint_param, len(source) if isinstance(source, str) else len(json.dumps(source))))
    for i, tool in enumerate(req.tools.active):
        out.append((f"{req.tools.param}.{i}", len(json.dumps(tool["parameters"]))))
    return out
