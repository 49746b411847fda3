"""Request bodies as strict pydantic models.

Strict: a string where a number belongs, ``1.0`` where an integer belongs, or ``"yes"``
for a boolean is an error, never a silent coercion. NaN and infinities are rejected.
Unknown fields are accepted (llama-server accepts them too; OpenAI SDKs send fields this
engine has no use for) and logged by the app as ignored — they are not swallowed silently.

:func:`parse_request` turns a raw body into a model or raises :class:`APIError` (400) in
OpenAI's error shape, with ``param`` naming the field at fault.
"""

from __future__ import annotations

import json
import math
from typing import Annotated, Literal, TypeVar

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, field_validator

from flashdraft.server.errors import APIError, bad_request

#: seeds are passed to ``torch.Generator.manual_seed`` (unsigned 64-bit)
MAX_SEED = 2**64 - 1
#: most choices (``n``) in one request: each is a job of its own
MAX_CHOICES = 16
# counts and sizes (stop strings, batch prompts, n_probs, grammar size...) are the server's
# limits, checked after parsing against its --max-* flags (:mod:`.limits`)

#: one prompt, normalised: text, or token ids mixed with text pieces
OnePrompt = str | list[int | str]

M = TypeVar("M", bound=BaseModel)


def _limit_not_zero(v: int) -> int:
    if v == 0:
        raise ValueError("must be -1 (until a stop or the context end) or at least 1")
    return v


#: a limit on new tokens (``max_tokens`` and its names in every API): -1 = until a stop or the
#: context's end, as llama-server (the server's ``-n`` still applies when set); 0 is refused
TokenLimit = Annotated[int, Field(ge=-1), AfterValidator(_limit_not_zero)]


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)


class SamplingFields(_Strict):
    """Sampling settings a request may set; None = the server's default (``--temp``...)."""

    temperature: float | None = Field(None, ge=0.0)
    top_k: int | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    #: -1 means "random" as in llama-server
    seed: int | None = Field(None, ge=-1, le=MAX_SEED)
    stop: str | list[str] | None = None
    stream: bool = False
    #: None = the server's default (``--ignore-eos``)
    ignore_eos: bool | None = None
    model: str | None = None
    #: llama-server's prompt cache: reuse the slot's caches for the common prefix (None =
    #: the server's default, on unless ``--no-cache-prompt``)
    cache_prompt: bool | None = None
    #: OpenAI ``{"token_id": bias}`` or llama-server's ``[[id or text, bias or false], ...]``
    logit_bias: dict | list | None = None
    #: llama-server's constraints: a JSON schema, or a GBNF grammar
    json_schema: dict | None = None
    grammar: str | None = None
    #: OpenAI's: ``{"type": "text" | "json_object" | "json_schema", "json_schema": {"schema": ...}}``
    response_format: dict | None = None
    #: llama-server: every streamed chunk carries the timings so far
    timings_per_token: bool = False
    #: llama-server: a stream reports the prefill's progress (``prompt_progress`` chunks)
    return_progress: bool = False
    #: llama-server's context shift (``--context-shift``): prompt tokens a shift keeps
    #: (-1 = the whole prompt) and tokens it drops (0 = half of the rest)
    n_keep: int | None = Field(None, ge=-1)
    n_discard: int = Field(0, ge=0)
    #: llama-server's per-request draft settings: ``n_max`` caps the draft tokens per step
    #: (at the server's ``--spec-draft-n-max``); ``n_min`` and ``p_min`` tune how much is
    #: drafted, which verification makes answer-neutral: accepted, the depth controller decides
    spec_n_max: int | None = Field(None, alias="speculative.n_max", ge=0)
    spec_n_min: int | None = Field(None, alias="speculative.n_min", ge=0)
    spec_p_min: float | None = Field(None, alias="speculative.p_min", ge=0.0, le=1.0)
    #: llama-server: probabilities from the sampling distribution (after temperature and
    #: the top-k / top-p / min-p filters) instead of the full softmax
    post_sampling_probs: bool = False

    @field_validator("response_format")
    @classmethod
    def _response_format(cls, v):
        response_constraint(v)
        return v

    def constraint_spec(self) -> tuple[str, object] | None:
        """``(kind, source)`` for :func:`flashdraft.constraints.compile_grammar`, or None.

        Raises:
            APIError: 400 when more than one of ``grammar``, ``json_schema`` and a
                constraining ``response_format`` is given.
        """
        given = [(name, spec) for name, spec in (
            ("grammar", None if self.grammar is None else ("gbnf", self.grammar)),
            ("json_schema", None if self.json_schema is None else ("json_schema", self.json_schema)),
            ("response_format", response_constraint(self.response_format))) if spec is not None]
        if len(given) > 1:
            raise bad_request(f"give one constraint, not {' and '.join(n for n, _ in given)}", param=given[1][0])
        return given[0][1] if given else None

    @field_validator("logit_bias")
    @classmethod
    def _bias_shape(cls, v):
        bias_entries(v)
        return v

    def stop_list(self) -> list[str]:
        """``stop`` as a list (a single string becomes a one-item list)."""
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


def split_prompts(v: object) -> list[OnePrompt]:
    """llama-server's prompt forms, as a list of single prompts (one result each).

    One prompt: a string, ``{"prompt_string": ...}``, a token id list, or ids mixed with
    strings (``[12, " and ", 34]``). Several: a list of those (a list of strings is a batch,
    as in OpenAI's API).

    Raises:
        ValueError: an empty prompt list, an element of another type, or an object
            without ``prompt_string`` / with media.
    """
    if isinstance(v, (str, dict)):
        return [_one_prompt(v, "prompt")]
    if not isinstance(v, list) or not v:
        raise ValueError("prompt must be a string, token ids, or a non-empty list of prompts")
    if any(_is_id(x) for x in v):  # ids, maybe mixed with text: one prompt
        return [_one_prompt(v, "prompt")]
    return [_one_prompt(x, f"prompt[{i}]") for i, x in enumerate(v)]


def _is_id(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _one_prompt(x: object, where: str) -> OnePrompt:
    if isinstance(x, str):
        return x
    if isinstance(x, dict):
        extra = set(x) - {"prompt_string", "multimodal_data"}
        if not isinstance(x.get("prompt_string"), str) or extra:
            raise ValueError(f"{where}: a prompt object needs a string 'prompt_string' (and nothing else"
                             f"{', got ' + ', '.join(sorted(extra)) if extra else ''})")
        if x.get("multimodal_data"):
            raise ValueError(f"{where}: multimodal_data is not supported: this server serves text models only")
        return x["prompt_string"]
    if isinstance(x, list) and x and all(_is_id(t) or isinstance(t, str) for t in x):
        return list(x)
    raise ValueError(f"{where} must be a string, a prompt object, or a non-empty list of token ids and strings")


def bias_entries(v: dict | list | None) -> list[tuple[int | str, float]]:
    """``logit_bias`` as ``[(token id or text, bias)]``; ``false`` = never (``-inf``).

    Raises:
        ValueError: a list entry that is not a ``[token id or text, bias]`` pair, a bias that
            is not a finite number or ``false``.
    """
    if v is None:
        return []
    pairs = list(v.items()) if isinstance(v, dict) else v
    out = []
    for i, pair in enumerate(pairs):
        if isinstance(v, list) and not (isinstance(pair, list) and len(pair) == 2):
            raise ValueError(f"logit_bias[{i}] must be a [token, bias] pair")
        key, bias = pair
        if isinstance(v, dict):  # JSON object keys are strings: OpenAI sends ids as "50256"; any
            # other key is a text whose tokens get the bias (llama-server's object form)
            key = int(key) if key.lstrip("-").isdigit() else key
        elif not (_is_id(key) or isinstance(key, str)):
            raise ValueError(f"logit_bias[{i}][0] must be a token id or a text")
        if bias is False:
            bias = -math.inf
        elif isinstance(bias, bool) or not isinstance(bias, (int, float)) or not math.isfinite(bias):
            raise ValueError(f"logit_bias for {key!r} must be a finite number or false, got {bias!r}")
        out.append((key, float(bias)))
    return out


def response_constraint(v: dict | None) -> tuple[str, object] | None:
    """OpenAI ``response_format`` as ``(kind, source)``; None for ``text`` or absent.

    Raises:
        ValueError: an unknown type, or ``json_schema`` without a schema object.
    """
    if v is None:
        return None
    kind = v.get("type")
    if kind == "text":
        return None
    if kind == "json_object":  # llama-server also takes a schema here
        schema = v.get("schema")
        return ("json_schema", schema) if isinstance(schema, dict) else ("json_object", None)
    if kind == "json_schema":
        spec = v.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise ValueError("response_format json_schema needs json_schema.schema, a JSON schema object")
        return ("json_schema", schema)
    raise ValueError(f"response_format type {kind!r} is not one of text, json_object, json_schema")


class StreamOptions(_Strict):
    """OpenAI ``stream_options``."""

    include_usage: bool = False


class _OpenAIFields(SamplingFields):
    """Fields shared by ``/v1/chat/completions`` and ``/v1/completions``."""

    max_tokens: TokenLimit | None = None
    #: choices per request, each decoded as a job of its own (non-streamed only)
    n: int | None = Field(None, ge=1, le=MAX_CHOICES)
    stream_options: StreamOptions | None = None
    #: llama-server: add a ``__verbose`` object (the prompt as text) to a non-streamed answer
    verbose: bool = False

    def choices(self) -> int:
        """Choices asked for; more than one needs ``stream: false``.

        Raises:
            APIError: 400 for ``n > 1`` with ``stream: true``.
        """
        n = self.n or 1
        if n > 1 and self.stream:
            raise bad_request(f"n={n} needs stream: false (one choice per stream); send n requests to stream them",
                              param="n")
        return n


class TextPart(_Strict):
    """A content part; only text is supported by this engine."""

    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    """One chat message. ``developer`` is OpenAI's newer name for ``system``."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    #: an assistant turn's calls (OpenAI shape), written back into the prompt
    tool_calls: list[dict] | None = None
    #: a ``tool`` turn: the call this result answers
    tool_call_id: str | None = None

    def text(self, sep: str = "") -> str:
        """The content as one string (text parts joined with ``sep``)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return sep.join(p.text for p in self.content)


class ChatCompletionRequest(_OpenAIFields):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: TokenLimit | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0)
    #: OpenAI function tools (see :mod:`flashdraft.server.tools`)
    tools: list | None = None
    tool_choice: str | dict | None = None
    #: None = what the chat template can write (:func:`~flashdraft.server.tools.supports_parallel_tool_calls`)
    parallel_tool_calls: bool | None = None
    #: extra variables for the chat template (e.g. ``enable_thinking``)
    chat_template_kwargs: dict | None = None
    #: false: render without the assistant prefix (llama-server, vLLM)
    add_generation_prompt: bool = True
    #: continue the last (assistant) message; needs ``add_generation_prompt: false`` (vLLM's name
    #: for llama-server's prefill of a trailing assistant message)
    continue_final_message: bool = False

    @field_validator("messages")
    @classmethod
    def _one_assistant_at_the_end(cls, v):
        if len(v) >= 2 and v[-1].role == v[-2].role == "assistant":
            raise ValueError("cannot have 2 or more assistant messages at the end of the list")
        return v

    def logprob_count(self) -> int:
        """Alternatives per token to return; 0 = no logprobs. ``logprobs: true`` alone
        returns each token's own log-probability (a top list of one)."""
        if not self.logprobs:
            if self.top_logprobs:
                raise bad_request("top_logprobs needs logprobs: true", param="top_logprobs")
            return 0
        return max(1, self.top_logprobs or 0)

    def max_new_tokens(self) -> int | None:
        """``max_completion_tokens`` (the newer name) or ``max_tokens``; None = unset."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class _PromptForms(_Strict):
    """``prompt`` in any of :func:`split_prompts`' forms (``/v1/completions``, ``/completion``)."""

    prompt: str | dict | list

    @field_validator("prompt")
    @classmethod
    def _prompt_forms(cls, v):
        split_prompts(v)
        return v

    def prompts(self) -> list[OnePrompt]:
        """The request's prompts (one result each)."""
        return split_prompts(self.prompt)


class CompletionRequest(_OpenAIFields, _PromptForms):
    """``POST /v1/completions``: ``prompt`` in any of :func:`split_prompts`' forms."""
    echo: bool = False
    best_of: int | None = Field(None, ge=1)
    logprobs: int | None = Field(None, ge=0)
    suffix: str | None = None

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, v):
        if v:
            raise ValueError("echo is not supported by this server")
        return v

    @field_validator("best_of")
    @classmethod
    def _no_best_of(cls, v):
        if v is not None and v > 1:
            raise ValueError("best_of > 1 is not supported by this server")
        return v

    def logprob_count(self) -> int:
        """Alternatives per token to return (OpenAI's ``logprobs: N``); 0 = none."""
        return self.logprobs or 0

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v):
        if v:
            raise ValueError("suffix (insertion) is not supported by this server")
        return v



class LlamaCompletionRequest(SamplingFields, _PromptForms):
    """``POST /completion`` (llama-server's native endpoint).

    ``n_predict``: -1 = until EOS, a stop or the end of the context; otherwise >= 1.
    """

    n_predict: int = Field(-1, ge=-1)
    #: put the generated token ids in ``tokens`` (llama-server: off by default)
    return_tokens: bool = False
    #: return the top ``n_probs`` tokens' probabilities at each position (0 = none)
    n_probs: int = Field(0, ge=0)
    #: keep only these fields of the final answer; ``a/b`` names a nested one and becomes a
    #: top-level key of that name (llama-server's ``response_fields``)
    response_fields: list[str] | None = None

    def logprob_count(self) -> int:
        """Alternatives per token to return; 0 = none."""
        return self.n_probs

    def pick_fields(self, body: dict) -> dict:
        """``body`` reduced to :attr:`response_fields` (paths that do not exist are left out);
        the whole body when none are given."""
        if not self.response_fields:
            return body
        out = {}
        for path in self.response_fields:
            value, found = body, True
            for key in path.split("/"):
                if isinstance(value, dict) and key in value:
                    value = value[key]
                else:
                    found = False
                    break
            if found:
                out[path] = value
        return out

    @field_validator("n_predict")
    @classmethod
    def _not_zero(cls, v):
        if v == 0:
            raise ValueError("n_predict must be -1 (no limit) or >= 1")
        return v


class TokenizeRequest(_Strict):
    """``POST /tokenize``."""

    content: str
    add_special: bool = False
    with_pieces: bool = False


class DetokenizeRequest(_Strict):
    """``POST /detokenize``."""

    tokens: list[int]


def parse_json(body: bytes) -> object:
    """Decode a request body as JSON (UTF-8).

    Raises:
        APIError: 400 for invalid UTF-8, malformed JSON, nesting too deep for the parser,
            or a ``\\uD800``-style escape of a lone UTF-16 surrogate (valid JSON, but not
            text: the tokenizer could not encode it).
    """
    try:
        data = json.loads(body)  # bytes: json detects UTF-8/16/32 and rejects invalid bytes
    except UnicodeDecodeError as e:
        raise bad_request(f"the request body is not valid UTF-8: {e}", code="invalid_json") from None
    except ValueError as e:
        raise bad_request(f"the request body is not valid JSON: {e}", code="invalid_json") from None
    except RecursionError:
        raise bad_request("the request body is nested too deeply", code="invalid_json") from None
    # only a \u escape can produce a surrogate (raw surrogate bytes fail UTF-8 decoding above)
    if b"\\u" in body:
        try:
            json.dumps(data, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError as e:
            raise bad_request(f"the request body escapes a lone UTF-16 surrogate, which is not text: {e}",
                              code="invalid_json") from None
        except RecursionError:
            raise bad_request("the request body is nested too deeply", code="invalid_json") from None
    return data


def parse_request(body: bytes, model: type[M]) -> M:
    """Validate a raw body against ``model``.

    Raises:
        APIError: 400 ``invalid_request_error`` naming the first bad field in ``param``.
    """
    data = parse_json(body)
    if not isinstance(data, dict):
        raise bad_request(f"the request body must be a JSON object, got {type(data).__name__}")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise validation_error(e) from None


def validation_error(e: ValidationError) -> APIError:
    """400 from pydantic's most specific error: ``"invalid 'messages.0.role': Input should be ..."``."""
    errors = e.errors(include_url=False)
    # the deepest location is the most specific one (for a union, the branch that got furthest)
    err = max(errors, key=lambda x: len(x["loc"]))
    # union branches add their type name to loc ("str", "list[int]"); drop those
    loc = [str(p) for p in err["loc"] if not (isinstance(p, str) and ("[" in p or p in _TYPE_NAMES))]
    param = ".".join(loc) or None
    msg = err["msg"].removeprefix("Value error, ")
    if err["type"] == "missing":
        message = f"missing required field '{param}'"
    elif err["type"] == "value_error":
        message = f"invalid '{param}': {msg}" if param else msg
    else:
        message = f"invalid '{param}': {msg} (got {_short(err.get('input'))})" if param else msg
    return bad_request(message, param=param)


_TYPE_NAMES = {"str", "int", "float", "bool", "dict", "list", "none", "function-after", "function-before"}


def _short(value: object, limit: int = 80) -> str:
    text = json.dumps(value) if isinstance(value, (str, int, float, bool, list, dict, type(None))) else repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
