"""The one interface every benchmarked configuration implements."""

from __future__ import annotations

from dataclasses import dataclass

from flashdraft.bench.measure import Generation
from flashdraft.sampling import SamplingParams

#: every configuration ``--configs`` accepts, in report order
ALL_CONFIGS = ("none", "default", "dflash", "dflash-adaptive", "dflash-cost", "ngram", "ngram-adaptive", "ngram-cost",
               "ngram-standing-cost", "ngram-latest-cost", "ngram-fullprobe-cost",
               "suffix", "suffix-adaptive", "hybrid", "hybrid-adaptive", "hybrid-cost", "hybrid-suffix", "hybrid-suffix-adaptive", "dflash-gated-adaptive",
               "hybrid-gated-adaptive", "draft", "draft-adaptive", "self-draft", "self-draft-adaptive", "hf", "hf-lookup", "hf-dflash", "hf-draft",
               "llamacpp", "llamacpp-lookup", "llama-server", "llama-server-lookup", "llama-server-dflash",
               "zlab", "zlab-dflash")

#: a peer's own plain decoding: its greedy text is compared with that configuration's too
OWN_PLAIN = {"llamacpp-lookup": "llamacpp", "llama-server-lookup": "llama-server",
             "llama-server-dflash": "llama-server", "zlab-dflash": "zlab", "hf-lookup": "hf", "hf-dflash": "hf",
             "hf-draft": "hf"}

#: what ``make serve`` runs (the Makefile's serve line passes these flags; a test holds them equal):
#: the ``default`` configuration of the bench
SERVE_DEFAULT = "ngram-cost"

DESCRIPTIONS = {
    "none": "flashdraft, no drafter (baseline)",
    "default": f"flashdraft as `make serve` runs it ({SERVE_DEFAULT})",
    "dflash-cost": "flashdraft, DFlash drafter, cost controller (measured verify costs, drafts cut by confidence)",
    "ngram-cost": "flashdraft, prompt lookup, cost controller (measured verify costs; every step's copy cut by "
                  "its match length)",
    "ngram-standing-cost": "flashdraft, prompt lookup, cost controller drafting only at its standing depth "
                           "(no per-step cut: the rule before it, for comparison)",
    "ngram-latest-cost": "flashdraft, ngram-cost copying from each n-gram's latest occurrence (not the "
                         "best-matching of its 8 latest: the rule before it, for comparison)",
    "ngram-fullprobe-cost": "flashdraft, ngram-cost whose probes verify the whole copy (not 2 tokens past the "
                            "cut: the rule before it, for comparison)",
    "hybrid-cost": "flashdraft, hybrid, cost controller (measured verify costs, DFlash drafts cut by confidence)",
    "dflash": "flashdraft, DFlash block-diffusion drafter, fixed draft length",
    "dflash-adaptive": "flashdraft, DFlash drafter with the adaptive draft-length controller",
    "ngram": "flashdraft, prompt-lookup (n-gram) drafter, fixed draft length",
    "ngram-adaptive": "flashdraft, prompt lookup with the adaptive draft-length controller",
    "hybrid": "flashdraft, prompt lookup where it has a match and pays, else the DFlash drafter; fixed draft length",
    "hybrid-adaptive": "flashdraft, hybrid with the adaptive draft-length controller",
    "suffix": "flashdraft, SuffixDecoding (suffix trees over the request and the client's past answers), fixed draft length",
    "suffix-adaptive": "flashdraft, SuffixDecoding with the adaptive draft-length controller",
    "hybrid-suffix": "flashdraft, hybrid with SuffixDecoding as its lookup source; fixed draft length",
    "hybrid-suffix-adaptive": "flashdraft, hybrid with SuffixDecoding as its lookup source, adaptive controller",
    "dflash-gated-adaptive": "flashdraft, DFlash drafter, adaptive controller, blocks cut below the drafter's p_min",
    "hybrid-gated-adaptive": "flashdraft, hybrid, adaptive controller, DFlash blocks cut below the drafter's p_min",
    "draft": "flashdraft, autoregressive draft model (AR assistant drafter), fixed draft length",
    "draft-adaptive": "flashdraft, AR assistant drafter with the adaptive draft-length controller",
    "self-draft": "flashdraft, the target's first N layers and head as an untrained AR drafter (-md self:N)",
    "self-draft-adaptive": "flashdraft, self-draft (-md self:N) with the adaptive draft-length controller",
    "hf": "transformers generate()",
    "hf-lookup": "transformers generate(prompt_lookup_num_tokens=...)",
    "hf-dflash": "transformers generate(assistant_model=<our drafter>, speculation_type='dflash')",
    "hf-draft": "transformers generate(assistant_model=<draft model>)",
    "llamacpp": "llama.cpp (llama-cpp-python) on the same GGUF",
    "llamacpp-lookup": "llama.cpp (llama-cpp-python) with LlamaPromptLookupDecoding",
    "llama-server": "llama.cpp's llama-server on the same GGUF, plain decoding",
    "llama-server-lookup": "llama-server with its prompt-lookup (n-gram) speculative mode",
    "llama-server-dflash": "llama-server --spec-type draft-dflash with our DFlash drafter",
    "zlab": "z-lab's dflash_generate (dflash 0.1.0) on the transformers target, block_size=1 (no drafts)",
    "zlab-dflash": "z-lab's dflash_generate (dflash 0.1.0) with our drafter in its DFlashDraftModel",
}


def adaptive_base(name: str) -> str | None:
    """The spec type of an ``X-adaptive`` (X under the ``profit`` controller) or ``X-cost``
    configuration (the ``cost`` controller), else None."""
    name = SERVE_DEFAULT if name == "default" else name
    for suffix in ("-adaptive", "-cost"):
        head, sep, rest = name.rpartition(suffix)
        if sep and not rest and head in ("dflash", "ngram", "ngram-standing", "ngram-latest", "ngram-fullprobe", "hybrid", "suffix", "hybrid-suffix", "dflash-gated",
                                         "hybrid-gated", "draft", "self-draft"):
            return head
    return None


def controller_of(name: str) -> str:
    """The depth controller of configuration ``name``: ``cost``, ``profit`` or ``off``."""
    name = SERVE_DEFAULT if name == "default" else name
    if adaptive_base(name) is None:
        return "off"
    return "cost" if name.endswith("-cost") else "profit"


def fixed_depth(name: str) -> int | None:
    """N for a ``dflash@N`` configuration (DFlash at a fixed depth of N drafts), else None."""
    head, _, n = name.partition("@")
    return int(n) if head == "dflash" and n.isdigit() and int(n) >= 1 else None


def describe(name: str) -> str:
    """One-line description of configuration ``name``."""
    n = fixed_depth(name)
    if n is not None:
        return f"flashdraft, DFlash drafter, fixed draft length {n}"
    head, sep, threads = name.rpartition(" -t")  # a peer run at another thread count (--peer-threads)
    if sep and threads.isdigit():
        return f"{DESCRIPTIONS[head]}, {threads} thread(s)"
    return DESCRIPTIONS[name]


@dataclass
class BenchPrompt:
    """One prompt as every configuration receives it.

    Attributes:
        id: prompt id from its set (``seed/0``, ``HumanEval/3``, ...).
        set: prompt-set name as given to ``--prompts``.
        text: the user message.
        ids: token ids of the chat-formatted prompt (None in ``--url`` mode, where the
            server applies its own template).
        max_tokens: generation cap for this prompt's set.
        schema: the JSON schema the answer must satisfy (the ``json-schema`` set, or a
            ``.jsonl`` line with a ``schema``); None = free text.
        grammar: ``schema`` compiled for :class:`~flashdraft.constraints.Constraint`.
        turn: the turn of a multi-turn conversation (the ``replay`` set), None elsewhere. A
            turn after the first reuses the prompt cache its conversation's previous turn
            left in the same configuration (``cache_prompt``); a first turn prefills afresh.
    """

    id: str
    set: str
    text: str
    ids: list[int] | None
    max_tokens: int
    schema: dict | None = None
    grammar: str | None = None
    turn: int | None = None
    #: the chat messages of a multi-turn prompt (``replay``), None = one user message, ``text``
    messages: list | None = None

    @property
    def cache_prompt(self) -> bool:
        """Whether this run may start from the prompt cache (a conversation's later turn)."""
        return self.turn is not None and self.turn > 1


class Contender:
    """A configuration that can generate for a :class:`BenchPrompt`.

    Subclasses set ``name``, ``kind`` (``ours`` | ``peer`` | ``server``) and ``description``,
    and ``takes_constraint = True`` when :meth:`run` holds the answer to ``prompt.schema``;
    the others are skipped on constrained prompts, for the reason in ``constraint_note``.
    """

    name = "?"
    kind = "ours"
    description = ""
    takes_constraint = False
    constraint_note = "cannot hold its answer to a JSON schema"

    def activate(self) -> None:
        """Called before each of this configuration's runs (configurations share one target)."""

    def run(self, prompt: BenchPrompt, params: SamplingParams) -> Generation:
        """Generate once, timed. Raises whatever the underlying engine raises."""
        raise NotImplementedError


@dataclass
class Unavailable:
    """A configuration that was asked for (or is in the default list) but cannot run here."""

    name: str
    kind: str
    reason: str
