"""Parsers of the OpenAI-shaped and llama-server routes: a body -> one :class:`GenRequest`.

- :func:`chat`: ``POST /v1/chat/completions`` (OpenAI chat completions)
- :func:`completions`: ``POST /v1/completions`` (OpenAI text completions)
- :func:`completion`: ``POST /completion`` (llama-server's native endpoint)

Each validates the body against its strict pydantic model (:mod:`.schemas`; 400 naming the
field at fault) and copies what the engine needs into the internal request.
"""

from __future__ import annotations

from flashdraft.server.errors import bad_request
from flashdraft.server.request import GenRequest, Sampling, Tools
from flashdraft.server.schemas import (ChatCompletionRequest, CompletionRequest, LlamaCompletionRequest,
                                       SamplingFields, bias_entries, parse_request)
from flashdraft.server.tools import active_tools


def common(api: str, req: SamplingFields, **fields) -> GenRequest:
    """The fields every API shares (sampling, stop, bias, constraint, extras).

    Raises:
        APIError: 400 for more than one constraint (``grammar``, ``json_schema``,
            ``response_format``).
    """
    constraint = req.constraint_spec()
    param = "grammar" if req.grammar is not None else (
        "json_schema" if req.json_schema is not None else "response_format")
    sampling = Sampling(temperature=req.temperature, top_k=req.top_k, top_p=req.top_p, min_p=req.min_p,
                        seed=req.seed, ignore_eos=req.ignore_eos, cache_prompt=req.cache_prompt,
                        post_sampling_probs=req.post_sampling_probs)
    return GenRequest(api=api, model=req.model, stream=req.stream, sampling=sampling, stop=req.stop_list(),
                      logit_bias=bias_entries(req.logit_bias), constraint=constraint, constraint_param=param,
                      extra=dict(req.model_extra or {}), timings_per_token=req.timings_per_token,
                      return_progress=req.return_progress, n_draft=req.spec_n_max, wire=req,
                      n_keep=req.n_keep, n_discard=req.n_discard,
                      **fields)


def chat_tools(req: ChatCompletionRequest) -> Tools:
    """The request's tools, filtered by ``tool_choice``.

    Raises:
        APIError: 400 for a malformed tool or a ``tool_choice`` naming no given tool.
    """
    must_call = req.tool_choice == "required" or isinstance(req.tool_choice, dict)
    listed, active = active_tools(req.tools, req.tool_choice)
    return Tools(listed=listed, active=active, must_call=must_call,
                 parallel=req.parallel_tool_calls, offered=len(req.tools or []))


def chat_request(req: ChatCompletionRequest, api: str = "chat") -> GenRequest:
    """A parsed chat body as the internal request (also ``/apply-template`` and the token count).

    Raises:
        APIError: 400 as :func:`common`, :func:`chat_tools`, ``n`` with ``stream``, or
            ``top_logprobs`` without ``logprobs``.
    """
    limit_param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    return common(api, req, messages=req.messages, max_tokens=req.max_new_tokens(), limit_param=limit_param,
                  n_choices=req.choices(), n_probs=req.logprob_count(), n_probs_param="top_logprobs",
                  tools=chat_tools(req), template_kwargs=req.chat_template_kwargs,
                  add_generation_prompt=req.add_generation_prompt,
                  continue_final_message=req.continue_final_message, verbose=req.verbose)


def chat(body: bytes) -> GenRequest:
    """``POST /v1/chat/completions``. Raises APIError 400 (see :func:`chat_request`)."""
    return chat_request(parse_request(body, ChatCompletionRequest))


def completions(body: bytes) -> GenRequest:
    """``POST /v1/completions``: one prompt or a batch, ``n`` choices each.

    Raises:
        APIError: 400 for a bad body, or ``stream`` with several prompts or choices.
    """
    req = parse_request(body, CompletionRequest)
    return common("completions", req, prompts=_prompts(req), max_tokens=req.max_tokens, n_choices=req.choices(),
                  n_probs=req.logprob_count(), n_probs_param="logprobs", verbose=req.verbose)


def completion(body: bytes) -> GenRequest:
    """``POST /completion`` (llama-server's native endpoint; ``n_predict`` -1 = no limit).

    Raises:
        APIError: 400 for a bad body, or ``stream`` with several prompts.
    """
    req = parse_request(body, LlamaCompletionRequest)
    return common("completion", req, prompts=_prompts(req), max_tokens=req.n_predict, limit_param="n_predict",
                  n_probs=req.n_probs, n_probs_param="n_probs")


def _prompts(req) -> list:
    prompts = req.prompts()
    if req.stream and len(prompts) > 1:
        raise bad_request(f"stream: true takes one prompt, got {len(prompts)}; send one request per prompt "
                          "or stream: false for a batch", param="prompt")
    return prompts
