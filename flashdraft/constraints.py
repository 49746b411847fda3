"""Grammar constraints on the target (JSON schema, GBNF, any JSON object), with llguidance.

Why llguidance: measured on this CPU (``scripts/grammar_mask_cost.py``,
``docs/structured-output.md``) its next-token mask costs about 0.1-0.2 ms on a JSON schema
and under 3 ms on a GBNF grammar, against ≈ 60 ms for a decode step; xgrammar was faster on
JSON schemas but took ≈ 50 ms per mask on GBNF and pulls triton into a CPU install.
llguidance reads llama.cpp's GBNF directly, and its matcher rolls back, which speculative
decoding needs.

Speculative decoding under a constraint (lossless): the verify forward gives target logits
at [anchor, draft_1..draft_n]; row i is masked with the grammar state after the drafts
before it (the matcher advances along the draft, then rolls back), so the accepted prefix
and the bonus token are exactly what the constrained target alone would produce; at T>0
the acceptance rule reads the masked, renormalised target distribution. Drafts are cut at
the first token the grammar refuses (they would be rejected anyway), and the DFlash
drafter picks its tokens among the allowed ones (:meth:`Constraint.draft_masks`).
"""

from __future__ import annotations

import json
import threading

import torch

#: grammar kinds accepted by :func:`compile_grammar`
KINDS = ("json_schema", "json_object", "gbnf", "lark", "regex")


class GrammarError(ValueError):
    """The schema or grammar is invalid (the message says where)."""


class TokenizerInfo:
    """llguidance's view of one tokenizer (built once per target: ≈ 1-2 s for 50k tokens).

    Args:
        hf_tokenizer: the target's transformers tokenizer.
        vocab_size: rows of the target's LM head (masks have this many entries).
        eos_ids: the target's end-of-sequence ids (allowed once the grammar is complete).
    """

    _lock = threading.Lock()

    def __init__(self, hf_tokenizer, vocab_size: int, eos_ids: set[int]):
        import llguidance.hf

        self.vocab_size = vocab_size
        self.eos_ids = sorted(eos_ids)
        self.tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size,
                                                      eos_token=sorted(eos_ids) or None)

    @classmethod
    def for_target(cls, target) -> "TokenizerInfo":
        """The target's (cached on it; thread-safe)."""
        with cls._lock:
            info = getattr(target, "_grammar_tokenizer", None)
            if info is None:
                info = cls(target.tokenizer, target.vocab_size, target.eos_token_ids)
                target._grammar_tokenizer = info
            return info


#: schema keywords whose values are schemas (or maps / lists of them) that close_objects walks
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")
_SUBSCHEMA_ONE = ("items", "additionalItems", "not", "if", "then", "else", "contains", "additionalProperties")


def close_objects(schema: object) -> object:
    """A copy of a JSON schema in which an object schema that names ``properties`` but says
    nothing of ``additionalProperties`` (nor ``patternProperties``) admits only those keys.

    Why: JSON Schema allows any extra key by default, so a grammar built to the letter lets a
    model invent keys (seen: ``get_weather`` arguments running on with ``"type"``,
    ``"properties"``, ``"temperature_fahrenheit"``). llama.cpp's json-schema-to-grammar
    generates extra keys only where ``additionalProperties`` allows them; this does the same.
    ``{"type": "object"}`` without ``properties`` stays open (any object), as there. Members
    of ``allOf`` are left open: each names only part of the keys the whole object may have.

    ``propertyNames``, which llguidance does not implement, is rewritten on the way
    (:func:`property_names`).
    """
    if isinstance(schema, list):
        return [close_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = property_names(schema)
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {k: close_objects(v) for k, v in out[key].items()}
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [close_objects(v) for v in out[key]]
    for key in _SUBSCHEMA_ONE:
        if isinstance(out.get(key), (dict, list)):
            out[key] = close_objects(out[key])
    if isinstance(out.get("allOf"), list):
        out["allOf"] = [_close_inside(v) for v in out["allOf"]]
    if "properties" in out and "additionalProperties" not in out and "patternProperties" not in out \
            and "unevaluatedProperties" not in out:
        out["additionalProperties"] = False
    return out


def property_names(schema: dict) -> dict:
    """A copy of one object schema with ``propertyNames`` (a schema every key must match)
    turned into keywords llguidance compiles, where they say the same; the rest is relaxed.

    Coding agents' tool schemas carry it (zod's records: ``"propertyNames": {"type":
    "string"}``), and llguidance refuses the whole schema for it ("Unimplemented keys").

    - ``{"type": "string"}``, ``{}`` or ``true``: no constraint on a JSON key; dropped.
    - ``enum`` / ``const`` of strings: each such key becomes a property taking the
      ``additionalProperties`` schema, and no other key is allowed.
    - ``pattern``: ``patternProperties`` with that pattern and the ``additionalProperties``
      schema, and no other key is allowed.
    - anything else (``maxLength``, ``format``..., or a ``pattern`` beside existing
      ``patternProperties``) is relaxed: dropped, so keys are generated unconstrained by it.
      Keys listed in ``properties`` stay allowed whatever ``propertyNames`` says of them;
      with ``additionalProperties: false`` only those keys exist and nothing is lost.
    """
    if "propertyNames" not in schema:
        return dict(schema)
    out = dict(schema)
    names = out.pop("propertyNames")
    if names is False:  # no key at all: as an empty enum
        names = {"enum": []}
    extra = out.get("additionalProperties", True)
    if not isinstance(names, dict) or extra is False:
        return out
    value = extra if isinstance(extra, dict) else {}
    keys = names.get("enum", [names["const"]] if "const" in names else None)
    if isinstance(keys, list) and all(isinstance(k, str) for k in keys):
        out["properties"] = {**{k: value for k in keys}, **(out.get("properties") or {})}
        out["additionalProperties"] = False
    elif isinstance(names.get("pattern"), str) and "patternProperties" not in out:
        out["patternProperties"] = {names["pattern"]: value}
        out["additionalProperties"] = False
    return out


def _close_inside(schema: object) -> object:
    """:func:`close_objects` on what ``schema`` contains, leaving ``schema`` itself open."""
    if not isinstance(schema, dict):
        return schema
    closed = close_objects(schema)
    if "additionalProperties" not in schema and isinstance(closed, dict):
        closed.pop("additionalProperties", None)
    return closed


def compile_grammar(kind: str, text: str | dict) -> str:
    """A grammar definition for :class:`Constraint` from a request's constraint.

    Args:
        kind: one of :data:`KINDS` (``json_object`` takes no text).
        text: the JSON schema (dict or JSON text; objects closed by :func:`close_objects`),
            GBNF, Lark or regex source.
    Raises:
        GrammarError: an unknown kind, or a schema / grammar that does not compile
            (with llguidance's message: the rule, line or keyword at fault).
    """
    import llguidance

    if kind == "json_object":
        kind, text = "json_schema", {"type": "object"}
    if kind not in KINDS:
        raise GrammarError(f"unknown grammar kind {kind!r}; choose from {', '.join(KINDS)}")
    if kind == "json_schema":  # only the keys a schema names, unless it allows more (close_objects)
        try:
            schema = json.loads(text) if isinstance(text, str) else text
        except ValueError as e:
            raise GrammarError(f"the JSON schema is not JSON: {e}") from None
        text = json.dumps(close_objects(schema))
    try:
        grammar = llguidance.grammar_from("grammar" if kind == "gbnf" else kind, text)
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    except (ValueError, TypeError) as e:
        raise GrammarError(str(e)) from None
    if is_error:
        raise GrammarError("; ".join(messages) or "the grammar does not compile")
    return grammar


class Constraint:
    """One sequence's grammar state over the target's vocabulary.

    Args:
        info: the target's :class:`TokenizerInfo`.
        grammar: from :func:`compile_grammar`.
    Raises:
        GrammarError: the grammar fails to start (e.g. an empty language).
    """

    def __init__(self, info: TokenizerInfo, grammar: str):
        import llguidance

        self.info = info
        self.matcher = llguidance.LLMatcher(info.tokenizer, grammar)
        if self.matcher.is_error():
            raise GrammarError(self.matcher.get_error())
        self._bits = torch.arange(32, dtype=torch.int32)
        self.eos = set(info.eos_ids)

    # -- masks -------------------------------------------------------------------------
    def _bitmask(self, rows: int) -> torch.Tensor:
        import llguidance.torch as lt

        return lt.allocate_token_bitmask(rows, self.info.vocab_size)

    def _fill(self, bitmask: torch.Tensor, row: int) -> None:
        import llguidance.torch as lt

        lt.fill_next_token_bitmask(self.matcher, bitmask, row)

    def apply(self, logits: torch.Tensor, drafts: list[int]) -> None:
        """Mask ``logits [len(drafts)+1, V]`` in place: row i gets ``-inf`` wherever the
        grammar, after ``drafts[:i]``, refuses the token. The matcher ends where it began.

        Raises:
            RuntimeError: a draft token the grammar refuses (drafts must be cut first, see
                :meth:`valid_prefix`).
        """
        bitmask = self._bitmask(len(drafts) + 1)
        done = 0
        try:
            for i in range(len(drafts) + 1):
                self._fill(bitmask, i)
                if i == len(drafts) or drafts[i] in self.eos:
                    # an end of sequence is never consumed tentatively (llguidance cannot roll
                    # a stopped matcher back); rows after it stay empty, filled in below
                    break
                if not self.matcher.consume_token(drafts[i]):
                    raise RuntimeError(f"draft token {drafts[i]} is not allowed here: {self.matcher.get_error()}")
                done += 1
        finally:
            if done:
                self.matcher.rollback(done)
        allowed = self.unpack(bitmask)  # [rows, V]
        # a row with nothing allowed (after a drafted end of sequence): only the end again,
        # so a sampled bonus token never draws from an empty distribution
        empty = ~allowed.any(dim=1)
        if empty.any():
            allowed[empty.nonzero()[:, 0][:, None], torch.tensor(self.info.eos_ids)] = True
        # (llguidance's own apply helper compiles a kernel with torch.compile: seconds per shape here)
        logits.masked_fill_(~allowed.to(logits.device), float("-inf"))

    def allowed(self, drafts: list[int]) -> torch.Tensor:
        """``[V]`` bool: tokens the grammar allows after ``drafts`` (the matcher ends where it began)."""
        bitmask = self._bitmask(1)
        done = 0
        try:
            for t in drafts:
                if not self.matcher.consume_token(t):
                    raise RuntimeError(f"token {t} is not allowed here")
                done += 1
            self._fill(bitmask, 0)
        finally:
            if done:
                self.matcher.rollback(done)
        return self.unpack(bitmask[0])

    def here(self) -> torch.Tensor:
        """``[V]`` bool: tokens allowed at the matcher's current state."""
        bitmask = self._bitmask(1)
        self._fill(bitmask, 0)
        return self.unpack(bitmask[0])

    def push(self, token: int) -> bool:
        """Consume one token tentatively (undo with :meth:`rollback`); False if refused or an
        end of sequence (never consumed tentatively: a stopped matcher does not roll back)."""
        return token not in self.eos and self.matcher.consume_token(token)

    def rollback(self, n: int) -> None:
        """Undo the last ``n`` consumed tokens."""
        if n:
            self.matcher.rollback(n)

    def unpack(self, words: torch.Tensor) -> torch.Tensor:
        """Bitmask rows (int32 words, bit j of word w = token 32w+j) as bool: ``[W]`` ->
        ``[V]``, ``[R, W]`` -> ``[R, V]``."""
        bits = (words[..., None] >> self._bits) & 1
        return bits.flatten(-2)[..., : self.info.vocab_size].bool()

    # -- moving along ------------------------------------------------------------------
    def valid_prefix(self, tokens: list[int]) -> int:
        """How many leading ``tokens`` the grammar accepts from here (nothing consumed);
        an accepted end of sequence counts and ends the prefix."""
        return self.matcher.validate_tokens(tokens) if tokens else 0

    def advance(self, tokens: list[int]) -> None:
        """Consume returned tokens. Raises RuntimeError on a token the grammar refuses."""
        for t in tokens:
            if not self.matcher.consume_token(t):
                raise RuntimeError(f"token {t} broke the grammar: {self.matcher.get_error()}")

    @property
    def done(self) -> bool:
        """The grammar admits nothing more (only the end of the sequence)."""
        return self.matcher.is_stopped()
