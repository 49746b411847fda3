"""The one internal request every API's parser produces (:class:`GenRequest`).

A route's body is parsed by its API's parser (:mod:`.parse_openai`, :mod:`.parse_anthropic`,
:mod:`.parse_responses`) into a :class:`GenRequest`; from there every API takes the same
path (:mod:`.pipeline`): validate (:mod:`.validate`), build the jobs (:mod:`.jobs`), run them
(:mod:`.run`), render the answer in the route's wire format (``render_*``). Nothing after the
parser reads the wire body, except the renderer through :attr:`GenRequest.wire`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

#: one prompt of a text API: text, or token ids mixed with text pieces
OnePrompt = str | list[int | str]


@dataclass
class Sampling:
    """Sampling fields a request set; None = the server's default (``--temp``...)."""

    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    #: -1 = random, as llama-server
    seed: int | None = None
    #: None = the server's default (``--ignore-eos``)
    ignore_eos: bool | None = None
    #: None = the server's default (``--no-cache-prompt`` turns it off)
    cache_prompt: bool | None = None
    #: llama-server's: log-probabilities from the sampling distribution, not the full softmax
    post_sampling_probs: bool = False


@dataclass
class Tools:
    """The tools a chat-like request offers the model.

    Attributes:
        listed: ``[{"name", "description", "parameters"}]``, every tool given, checked: what
            the prompt's preamble lists (:func:`flashdraft.server.tools.active_tools`).
        active: those the answer may call (a named tool choice keeps one); empty = no tools.
        must_call: the answer must be a call (``required`` / ``any`` / a named tool).
        parallel: several calls in one answer; None = what the chat template supports.
        param: the request field that holds them (for error messages).
        offered: how many tools the request listed (``--max-tools`` counts these).
        namespaced: ``{name the model sees: (namespace, name)}`` for the functions of a
            Responses ``namespace`` tool, so their calls are answered with both.
    """

    listed: list[dict] = field(default_factory=list)
    active: list[dict] = field(default_factory=list)
    must_call: bool = False
    parallel: bool | None = None
    param: str = "tools"
    offered: int = 0
    namespaced: dict[str, tuple[str, str]] = field(default_factory=dict)


@dataclass
class GenRequest:
    """A generation request in no API's shape.

    Exactly one of :attr:`messages` (chat-like APIs) and :attr:`prompts` (text APIs) is set.

    Attributes:
        api: the route's API, for metrics and logs: ``chat``, ``completions``,
            ``completion``, ``messages``, ``responses``.
        model: the model name asked for (any is accepted; see :meth:`ServerState.check_model`).
        messages: chat messages (:class:`~flashdraft.server.schemas.ChatMessage`), first to last.
        prompts: text prompts, one job (and one result) each.
        max_tokens: the request's limit on new tokens; None or -1 = until a stop or the
            context's end (the server's ``-n`` is then the default).
        limit_param: the field that set it, for error messages.
        n_choices: answers per prompt (OpenAI's ``n``).
        stream: answer as server-sent events.
        sampling: temperature, top-k/p, seed...
        stop: stop strings.
        logit_bias: ``[(token id or text, bias)]``; ``-inf`` bans.
        n_probs: alternatives per token in the answer's log-probabilities (0 = none).
        n_probs_param: the field that asked for them.
        constraint: ``(kind, source)`` for :func:`flashdraft.constraints.compile_grammar`, or None.
        constraint_param: the field that gave it.
        tools: the tools on offer (chat-like APIs).
        template_kwargs / add_generation_prompt / continue_final_message: how the chat
            template renders :attr:`messages` (:meth:`PromptBuilder.render`).
        extra: body fields no parser took: checked by :func:`.validate.check_extra_fields`.
        timings_per_token: llama-server's: every streamed event carries the timings so far.
        return_progress: llama-server's: a stream reports the prefill's progress.
        n_draft: llama-server's ``speculative.n_max``: most draft tokens per step (None = the server's).
        n_keep / n_discard: llama-server's context shift settings (:class:`GenerationRequest`).
        verbose: llama-server's ``__verbose`` (the prompt as text) in a non-streamed answer.
        wire: the parsed body, for the renderer only (``response_fields``, ``return_tokens``...).
        client: the request's client, a hash of its API key (:mod:`.clients`; None = no
            key): the suffix drafter keeps each client's past answers apart.
    """

    api: str
    model: str | None = None
    messages: list | None = None
    prompts: list[OnePrompt] | None = None
    max_tokens: int | None = None
    limit_param: str = "max_tokens"
    n_choices: int = 1
    stream: bool = False
    sampling: Sampling = field(default_factory=Sampling)
    stop: list[str] = field(default_factory=list)
    logit_bias: list[tuple[int | str, float]] = field(default_factory=list)
    n_probs: int = 0
    n_probs_param: str = "n_probs"
    constraint: tuple[str, object] | None = None
    constraint_param: str = "response_format"
    tools: Tools = field(default_factory=Tools)
    template_kwargs: dict | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    extra: dict = field(default_factory=dict)
    timings_per_token: bool = False
    return_progress: bool = False
    n_draft: int | None = None
    n_keep: int | None = None
    n_discard: int = 0
    verbose: bool = False
    wire: object = None
    client: str | None = None
