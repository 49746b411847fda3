"""Request fields outside the schemas (:mod:`.schemas`): accepted only when they cannot change
the answer, so nothing a client asks for is silently dropped.

- :data:`HARMLESS`: client metadata and knobs that only matter together with another field
  (``dry_base`` without ``dry_multiplier``...) or that change nothing here (``id_slot``).
- :data:`NEUTRAL`: fields accepted only with the value that turns them off (``repeat_penalty``
  1.0, ``tools`` empty...); any other value is a 400 naming the field.
- Anything else is a 400 naming the field: the engine does not implement it.
"""

from __future__ import annotations

from flashdraft.server.errors import bad_request

HARMLESS = frozenset({
    # OpenAI client metadata
    "user", "metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key",
    # llama-server knobs that need another field to do anything, or that change no answer here
    "id_slot", "min_keep", "dry_base", "dry_allowed_length", "dry_penalty_last_n",
    "dry_sequence_breakers", "mirostat_tau", "mirostat_eta", "xtc_threshold", "repeat_last_n", "penalty_last_n",
    "dynatemp_exponent", "penalize_nl", "samplers", "t_max_prompt_ms",
    # where llama-server samples (on the GPU backend or the CPU): the same distribution either way
    "backend_sampling",
})

#: field -> the values that change nothing (compared after JSON decoding; 1 == 1.0)
NEUTRAL: dict[str, tuple] = {
    "frequency_penalty": (0,), "presence_penalty": (0,), "repeat_penalty": (1,), "typical_p": (1,),
    "tfs_z": (1,), "top_a": (0,), "mirostat": (0,), "dry_multiplier": (0,), "xtc_probability": (0,),
    "top_n_sigma": (-1, 0), "dynatemp_range": (0,), "n_cmpl": (1,), "n_indent": (0,),
    "t_max_predict_ms": (0,),
    "lora": ([],), "functions": (None, []), "function_call": (None, "none", "auto"),
    "modalities": (None, ["text"]), "reasoning_effort": (None,), "prediction": (None,), "audio": (None,),
    "web_search_options": (None,), "add_generation_prompt": (True,), "continue_final_message": (False,),
    "include_stop_str_in_output": (False,), "skip_special_tokens": (True,),
}

#: fields whose 400 says what to use instead
HINTS = {
    "functions": "use tools (the newer form)",
}


def check_extra_fields(extra: dict | None) -> None:
    """Refuse fields that would change the answer but are not implemented.

    Args:
        extra: the request's fields that no schema field took (pydantic's ``model_extra``).
    Raises:
        APIError: 400 naming the first such field (``param`` set to it) and the value
            that would be accepted, if any.
    """
    for name, value in (extra or {}).items():
        if name in HARMLESS:
            continue
        if name in NEUTRAL:
            if any(_same(value, ok) for ok in NEUTRAL[name]):
                continue
            allowed = " or ".join(repr(v) for v in NEUTRAL[name] if v is not None)
            hint = HINTS.get(name, "this server does not implement it")
            raise bad_request(f"{name}={value!r} is not supported: {hint} (only {allowed} is accepted)", param=name,
                              code="unsupported_field")
        raise bad_request(f"unknown request field {name!r}: this server does not implement it", param=name,
                          code="unsupported_field")


def _same(value: object, neutral: object) -> bool:
    if isinstance(neutral, bool) or isinstance(value, bool):
        return value is neutral
    return value == neutral
