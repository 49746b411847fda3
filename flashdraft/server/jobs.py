"""Step 3 of every generation route: a validated :class:`GenRequest` -> scheduler jobs.

Here the request meets the model: chat messages are rendered by the chat template (with the
tool list in the system turn), prompts are tokenised and checked against the context, the
constraint (grammar, JSON schema, tool calls) is compiled, and the sampling settings are
laid over the server's defaults. One job (the engine's
:class:`~flashdraft.generate.GenerationRequest`) per prompt and choice.
"""

from __future__ import annotations

from dataclasses import replace

from flashdraft.constraints import Constraint, GrammarError, TokenizerInfo, compile_grammar
from flashdraft.generate import ContextOverflowError, GenerationRequest
from flashdraft.sampling import SamplingParams
from flashdraft.server.errors import APIError, bad_request
from flashdraft.server.limits import over
from flashdraft.server.request import GenRequest
from flashdraft.server.tools import tool_grammar, tool_prompt

#: smaller positive temperatures are run as greedy (see :func:`sampling`)
MIN_TEMPERATURE = 1e-6
#: smaller top_p values are raised to this: still only the top token (any vocabulary < 10^6)
MIN_TOP_P = 1e-6


def build(req: GenRequest, state) -> list[GenerationRequest]:
    """The request's jobs, in answer order (the choices of a prompt next to each other, as
    OpenAI orders them).

    Args:
        req: a request that passed :func:`~flashdraft.server.validate.validate`.
        state: the ready :class:`~flashdraft.server.state.ServerState` (model, prompts, settings).
    Raises:
        APIError: 400 for a prompt too long for the context (``context_length_exceeded``;
            a limit on new tokens beyond the context is capped, not refused), a chat the
            template rejects, a grammar that does
            not compile, ids outside the vocabulary, or sampling settings the engine refuses.
    """
    if req.messages is not None:
        prompts = [(prompt_ids(req, state), "messages")]
    else:
        many = len(req.prompts) > 1
        prompts = [(state.prompts.prompt(p, f"prompt[{i}]" if many else "prompt"), f"prompt[{i}]" if many else "prompt")
                   for i, p in enumerate(req.prompts)]
    spec = tool_grammar(req.tools.active, req.tools.must_call, parallel_calls(req, state)) if req.tools.active else None
    return [make_job(state, ids, req, prompt_param=param, constraint_spec=spec, choice=k)
            for ids, param in prompts for k in range(req.n_choices)]


def parallel_calls(req: GenRequest, state) -> bool:
    """Whether one answer may hold several tool calls: the request's choice, else (as
    llama-server) whether the chat template can write several."""
    return state.prompts.parallel_tool_calls if req.tools.parallel is None else req.tools.parallel


def segments(req: GenRequest, state):
    """A chat request rendered by the template: the tool list (if any) in the system turn,
    the template's rules for the end of the conversation (prefill, no generation prompt).

    Raises:
        APIError: 400 as :meth:`PromptBuilder.render`.
    """
    tools = req.tools
    system = tool_prompt(tools.listed) if tools.active else None
    return state.prompts.render(req.messages, req.template_kwargs, system=system,
                                add_generation_prompt=req.add_generation_prompt,
                                continue_final_message=req.continue_final_message)


def prompt_ids(req: GenRequest, state) -> list[int]:
    """Token ids of a chat request's prompt (see :func:`segments`)."""
    return state.prompts.encode_segments(segments(req, state))


def make_job(state, prompt_ids: list[int], req: GenRequest, prompt_param: str = "prompt",
             constraint_spec: tuple[str, object] | None = None, choice: int = 0) -> GenerationRequest:
    """One job: the prompt checked against the context, the limit, sampling and constraint.

    Args:
        prompt_param: the request field of this prompt, for error messages.
        constraint_spec: the tool-call grammar, when the request offers tools.
        choice: the choice's index (``n``): choice k of a seeded request samples with
            ``seed + k``, so the choices differ and each is reproducible.
    Raises:
        APIError: as :func:`build`.
    """
    gen, settings = state.generator, state.settings
    try:
        gen.check_prompt(len(prompt_ids))
    except ContextOverflowError as e:
        raise APIError(400, str(e), type="exceed_context_size_error", param=prompt_param,
                       code="context_length_exceeded",
                       extra={"n_prompt_tokens": e.n_prompt, "n_ctx": e.ctx_size}) from None
    except ValueError as e:
        raise bad_request(str(e), param=prompt_param) from None
    cap = settings.limits.prompt_tokens
    if cap and len(prompt_ids) > cap:
        raise over("prompt_tokens", cap, len(prompt_ids), prompt_param)
    max_tokens = req.max_tokens
    # the request's limit wins; -n/--n-predict is only the default for requests that give
    # none (llama-server); "none" still ends at the context end (the loop stops there). A
    # limit beyond what the context holds is capped to it, not refused, as llama-server does
    # (agents ask for max_tokens 32000 whatever the context). With --context-shift a given
    # limit stands (the context shifts to make room), and "none" is still one context's worth
    room = gen.ctx_size - len(prompt_ids)
    if max_tokens is None or max_tokens < 0:
        max_tokens = settings.n_predict
    given = max_tokens is not None and max_tokens > 0
    limit = (max_tokens if gen.context_shift else min(max_tokens, room)) if given else room
    params = sampling(req, settings)
    if choice and params.seed is not None:
        params = replace(params, seed=(params.seed + choice) % 2**64)
    s = req.sampling
    return GenerationRequest(prompt_ids, limit, params, req.stop,
                             ignore_eos=settings.ignore_eos if s.ignore_eos is None else s.ignore_eos,
                             cache_prompt=settings.cache_prompt if s.cache_prompt is None else s.cache_prompt,
                             logit_bias=logit_bias(req, state), n_probs=req.n_probs,
                             post_sampling_probs=s.post_sampling_probs,
                             constraint=constraint(req, state, constraint_spec), client=req.client,
                             return_progress=req.stream and req.return_progress,
                             n_draft=None if req.n_draft is None else min(req.n_draft, gen.n_draft),
                             n_keep=settings.n_keep if req.n_keep is None else req.n_keep, n_discard=req.n_discard)


def constraint(req: GenRequest, state, spec: tuple[str, object] | None = None):
    """The request's grammar constraint (its own, or ``spec``: the tool calls'), compiled, or None.

    Raises:
        APIError: 400 for tools with another constraint, or a schema or grammar that does
            not compile (``invalid_grammar``) or cannot run on this tokenizer.
    """
    if spec is not None and req.constraint is not None:
        raise bad_request("tools cannot be combined with response_format, json_schema or grammar",
                          param=req.tools.param)
    spec = spec or req.constraint
    if spec is None:
        return None
    param = req.constraint_param if spec is req.constraint else req.tools.param
    try:
        grammar = compile_grammar(*spec)
    except GrammarError as e:
        raise bad_request(f"invalid {param}: {e}", param=param, code="invalid_grammar") from None
    try:
        info = TokenizerInfo.for_target(state.generator.target)
    except Exception as e:  # noqa: BLE001 - llguidance cannot read this tokenizer (e.g. word-level)
        raise bad_request(f"{param}: grammar constraints are not available for this model's tokenizer ({e})",
                          param=param, code="grammar_unsupported") from None
    try:
        return Constraint(info, grammar)
    except GrammarError as e:
        raise bad_request(f"invalid {param}: {e}", param=param, code="invalid_grammar") from None


def logit_bias(req: GenRequest, state) -> dict[int, float] | None:
    """``logit_bias`` as ``{token_id: bias}``: a text key biases each of its tokens.

    Raises:
        APIError: 400 for an id outside the vocabulary.
    """
    if not req.logit_bias:
        return None
    out: dict[int, float] = {}
    for key, bias in req.logit_bias:
        ids = state.prompts.encode(key) if isinstance(key, str) else state.prompts.check_ids([key], "logit_bias")
        for token in ids:
            out[token] = bias
    return out


def sampling(req: GenRequest, settings) -> SamplingParams:
    """Request sampling fields over the server defaults.

    Two float32 edges, found by the fuzz test (each was a 500 before): a temperature in
    (0, :data:`MIN_TEMPERATURE`) runs as greedy (its limit; ``logits / 1e-300``
    overflows to inf and the distribution turns NaN), and a top_p below
    :data:`MIN_TOP_P` is raised to it (the same single top token; a top_p that rounds to
    0 in float32 would drop every token).

    Raises:
        APIError: 400 for settings :class:`SamplingParams` refuses.
    """
    r = req.sampling
    seed = r.seed if r.seed is not None else settings.seed
    temperature = float(settings.temperature if r.temperature is None else r.temperature)
    if 0.0 < temperature < MIN_TEMPERATURE:
        temperature = 0.0
    top_p = float(settings.top_p if r.top_p is None else r.top_p)
    if 0.0 < top_p < MIN_TOP_P:
        top_p = MIN_TOP_P
    try:
        return SamplingParams(temperature=temperature, top_k=settings.top_k if r.top_k is None else r.top_k,
                              top_p=top_p, min_p=float(settings.min_p if r.min_p is None else r.min_p),
                              seed=None if seed is None or seed < 0 else seed)
    except ValueError as e:
        raise bad_request(str(e)) from None
