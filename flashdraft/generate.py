"""THE speculative loop: one loop for every drafter (``none``, ``dflash``, ``draft``, ``ngram``).

    prefill target ─► first token ─► loop:
        controller picks the depth ─► drafter.propose ─► target verify [anchor, drafts]
        ─► accept prefix + bonus token
        ─► rollback target cache, drafter.commit ─► stops (EOS, stop strings, max_tokens)

Read top to bottom in :class:`Sequence` (``prepare`` -> the target forward -> ``finish``,
numbered 1-5); :meth:`SpeculativeGenerator.generate` steps one sequence with its own
forward, the server's parallel slots step several with one packed forward
(:mod:`flashdraft.batch`).
"""

from __future__ import annotations

import copy
import logging
import random
import time
from dataclasses import dataclass, field, fields
from typing import Callable, Iterator

import torch

from flashdraft.adaptive import ProfitController, SourcedController
from flashdraft.device import HOST
from flashdraft.drafters.base import Drafter, NoDrafter
from flashdraft.kv_cache import KVCacheSpec
from flashdraft.sampling import SamplingParams, choose_token, filtered_probs, verify_greedy, verify_sampling
from flashdraft.stops import TextStream
from flashdraft.synthetic import verify_synthetic
from flashdraft.targets.torch import Target

log = logging.getLogger(__name__)


class ContextOverflowError(ValueError):
    """The prompt does not fit the context window (``-c/--ctx-size``)."""

    def __init__(self, n_prompt: int, ctx_size: int):
        super().__init__(f"the prompt has {n_prompt} tokens but the context size is {ctx_size} "
                         f"(at least 1 position must stay free for the answer); shorten the prompt "
                         f"or raise -c/--ctx-size")
        self.n_prompt, self.ctx_size = n_prompt, ctx_size


class Cancelled(Exception):
    """Raised inside the loop when the caller's cancel check returns True."""


@dataclass
class Timings:
    """llama-server's ``timings`` object plus speculative counters (vLLM spec_decode style).

    Times are milliseconds. ``prompt_n``: prompt tokens run through the target;
    ``cache_n``: prompt tokens reused from the prompt cache instead (llama-server's meaning:
    the whole prompt is ``prompt_n + cache_n``). ``predicted_n`` counts only tokens that are returned.
    ``draft_n``: drafted tokens; ``draft_n_accepted``: accepted ones that were produced (returned,
    or the accepted end-of-sequence token that ended the answer; never those after a stop);
    ``accepted_per_position[k]``: drafts accepted at position k+1; ``drafted_per_position[k]``:
    drafts proposed at position k+1; ``n_drafts``: verify steps that carried a draft.
    ``draft_depth_sum``: draft tokens asked for, summed over verify steps (the depth chosen by
    the controller or the fixed ``--spec-draft-n-max``, before the cut at ``max_tokens`` and
    the context); ``draft_depth_last``: the standing depth after the last step, probes aside
    (the depth the next request starts from; 0 = drafting off).
    ``verify_n``: tokens the verify steps produced, each step counted up to and including the
    token that ended the sequence (an end-of-sequence token that is not returned counts, as
    does the token that completed a stop string or reached ``max_tokens``; tokens after the
    end do not), so every verify step counts at least 1; ``step_hist[j]``: verify steps that
    produced ``j + 1`` tokens by that rule (``sum(step_hist) == n_steps - 1``).
    """

    prompt_n: int = 0
    cache_n: int = 0
    prompt_ms: float = 0.0
    predicted_n: int = 0
    predicted_ms: float = 0.0
    draft_n: int = 0
    draft_n_accepted: int = 0
    n_steps: int = 0
    n_drafts: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    drafted_per_position: list[int] = field(default_factory=list)
    draft_depth_sum: int = 0
    draft_depth_last: int = 0
    verify_n: int = 0
    #: ms inside the drafter's ``propose`` (the draft cost; not in the server's ``timings``)
    draft_ms: float = 0.0
    step_hist: list[int] = field(default_factory=list)
    #: the context was shifted, or the answer ended at the context's end (llama-server's ``truncated``)
    truncated: bool = False

    @property
    def acceptance_length(self) -> float:
        """τ: mean tokens produced per verify step (accepted drafts + bonus), the step that
        ended the sequence counted through its last token (see :attr:`verify_n`). The prefill's
        first token is not a verify step, so plain decoding reads exactly 1.0, and τ ≥ 1.0
        always; 1.0 when no verify step ran (nothing was drafted)."""
        return self.verify_n / (self.n_steps - 1) if self.n_steps > 1 else 1.0

    def count_step(self, produced: int) -> None:
        """Count one verify step that produced ``produced >= 1`` tokens (:attr:`verify_n`)."""
        self.n_steps += 1
        self.verify_n += produced
        self.step_hist.extend([0] * (produced - len(self.step_hist)))
        self.step_hist[produced - 1] += 1

    def count_draft(self, n: int, n_acc: int) -> None:
        """Count one verify step's draft of ``n >= 1`` tokens, the first ``n_acc`` of them
        accepted and produced (:attr:`draft_n_accepted`)."""
        self.n_drafts += 1
        self.draft_n += n
        self.draft_n_accepted += n_acc
        _add_counts(self.drafted_per_position, [1] * n)
        _add_counts(self.accepted_per_position, [1] * n_acc + [0] * (n - n_acc))

    def add(self, other: Timings) -> None:
        """Add ``other``'s counts and times to these (a sum over requests, lists element by
        element); ``draft_depth_last`` becomes ``other``'s."""
        for f in fields(self):
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            if isinstance(mine, list):
                _add_counts(mine, theirs)
            elif isinstance(mine, bool):
                setattr(self, f.name, mine or theirs)
            else:
                setattr(self, f.name, theirs if f.name == "draft_depth_last" else mine + theirs)

    @property
    def draft_depth(self) -> float:
        """Mean draft tokens asked for per verify step (the first token's step excluded)."""
        return self.draft_depth_sum / (self.n_steps - 1) if self.n_steps > 1 else 0.0

    def to_dict(self, drafting: bool) -> dict:
        # times rounded to the microsecond, rates derived from the rounded times (unrounded),
        # so a client recomputing a rate from the reported fields gets the same number
        prompt_ms, predicted_ms = round(self.prompt_ms, 3), round(self.predicted_ms, 3)
        n_decoded = self.predicted_n - 1  # the first token came from the prefill (llama-server's rate)
        d = {
            "cache_n": self.cache_n,
            "prompt_n": self.prompt_n,
            "prompt_ms": prompt_ms,
            "prompt_per_token_ms": prompt_ms / self.prompt_n if self.prompt_n else 0.0,
            "prompt_per_second": 1e3 * self.prompt_n / prompt_ms if prompt_ms else 0.0,
            "predicted_n": self.predicted_n,
            "predicted_ms": predicted_ms,
            "predicted_per_token_ms": predicted_ms / n_decoded if n_decoded > 0 else 0.0,
            "predicted_per_second": 1e3 * n_decoded / predicted_ms if predicted_ms and n_decoded > 0 else 0.0,
        }
        if drafting:
            d.update(draft_n=self.draft_n, draft_n_accepted=self.draft_n_accepted,
                     acceptance_length=round(self.acceptance_length, 4),
                     draft_depth=round(self.draft_depth, 3), draft_depth_last=self.draft_depth_last)
        return d


@dataclass
class PromptCache:
    """What a sequence leaves behind for the next request of the same slot (``cache_prompt``).

    Attributes:
        tokens: ``[L]`` ids whose K/V ``cache`` holds, in order (the prompt and the answer,
            the last anchor excluded); the drafter that served the sequence holds the same
            context.
        cache: the target cache (any kind with ``length`` and ``rollback``).
    """

    tokens: list[int]
    cache: object

    def reusable(self, prompt_ids: list[int]) -> int:
        """Leading prompt tokens whose K/V can be reused: the longest common prefix, less
        one when it covers the whole prompt (the last prompt token must run through the
        target to give the first token's logits)."""
        n = shared_prefix(self.tokens, prompt_ids)
        # a cache can hold less than its tokens say: the llama backend evicts idle ones
        return min(n, len(prompt_ids) - 1, getattr(self.cache, "length", n))


def shared_prefix(a: list[int], b: list[int]) -> int:
    """How many leading ids ``a`` and ``b`` share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def common_prefix(cached: PromptCache | None, prompt_ids: list[int]) -> int:
    """:meth:`PromptCache.reusable`, 0 without a cache."""
    return 0 if cached is None else cached.reusable(prompt_ids)


@dataclass
class TokenLogprob:
    """A returned token's log-probability under the target, and the most likely alternatives.

    From the target's logits at that position (the verify forward's row when the token came
    from a draft, the prefill's or the bonus row otherwise) after ``logit_bias``, before
    temperature and the sampling filters: the same numbers whichever drafter ran.

    Attributes:
        token_id: the returned token.
        logprob: its natural log-probability.
        top: ``[(token_id, logprob)]``, the ``n_probs`` most likely tokens, most likely first.
    """

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass
class PromptProgress:
    """llama-server's ``prompt_progress``: how far the prefill of a prompt has come.

    ``total``: prompt tokens; ``cache``: those the prompt cache held (not prefilled);
    ``processed``: those whose K/V the target cache holds now (``cache <= processed <=
    total``); ``time_ms``: milliseconds since the prefill began.
    """

    total: int
    cache: int
    processed: int
    time_ms: int

    def to_dict(self) -> dict:
        return {"total": self.total, "cache": self.cache, "processed": self.processed, "time_ms": self.time_ms}


@dataclass
class Step:
    """One increment of output.

    ``text``: new stream-safe text; ``token_ids``: newly returned tokens; ``finish_reason``
    is set ("stop" | "length") only on the last step, which also carries final timings.
    ``logprobs``: one :class:`TokenLogprob` per token of ``token_ids`` when asked for (``n_probs``).
    ``progress``: the timings so far, a copy taken at this step (llama-server's
    ``timings_per_token`` streams them with every chunk).
    ``prompt_progress``: set when the request asked for it (``return_progress``): on the
    step before the first forward, on each prefill chunk (no text, no tokens) and on the
    first token's step (``processed == total``).
    """

    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    timings: Timings | None = None
    logprobs: list[TokenLogprob] | None = None
    progress: Timings | None = None
    prompt_progress: PromptProgress | None = None

    @property
    def only_progress(self) -> bool:
        """A prefill report with no output (the stream sends it as llama-server's progress chunk)."""
        return self.prompt_progress is not None and not self.token_ids and self.finish_reason is None


@dataclass
class GenerationRequest:
    """One request to the engine: the prompt, the limit and every option of the answer.

    Attributes:
        prompt_ids: ``[L]`` prompt token ids (non-empty, shorter than the context).
        max_tokens: most tokens to return (>= 1).
        params: sampling settings (temperature, top-k/p, min-p, seed).
        stop: stop strings: the text ends before the first one it contains.
        n_draft: draft tokens per step; None = the generator's (``--spec-draft-n-max``).
        ignore_eos: keep generating past end-of-sequence tokens.
        cache_prompt: start from the caches the previous request left and prefill only
            what follows the common prefix (llama-server's ``cache_prompt``).
        logit_bias: ``{token_id: bias}`` added to the target's logits at every position
            before anything reads them (``-inf`` bans a token). Verification then accepts
            exactly what the biased target would produce, at T=0 and T>0 alike.
        n_probs: return the log-probabilities of each returned token and of the
            ``n_probs`` most likely tokens at its position (:class:`TokenLogprob`); 0 = none.
        post_sampling_probs: take those from the sampling distribution of ``params``
            (:func:`token_logprobs`), not the target's full softmax (llama-server's flag).
        constraint: a :class:`~flashdraft.constraints.Constraint` (JSON schema, grammar):
            every target row is masked with the grammar state it follows, so the output is
            exactly the constrained target's; drafts are cut at the first refused token.
        client: who sent the request (:func:`flashdraft.drafters.suffix.client_key` of its API
            key, None = none): drafters that learn from past answers keep each client's apart.
        return_progress: report the prefill's progress (:class:`PromptProgress` on the
            steps, llama-server's ``return_progress``); the prompt is then prefilled in
            chunks (the server's ``-b``) so there is progress to report between them.
        n_keep: with the generator's :attr:`~SpeculativeGenerator.context_shift`, prompt
            tokens a shift keeps (-1 = the whole prompt; llama-server's ``n_keep``).
        n_discard: tokens a shift drops (0 = half of those after ``n_keep``, llama-server's).
    """

    prompt_ids: list[int]
    max_tokens: int
    params: SamplingParams = field(default_factory=SamplingParams)
    stop: list[str] | tuple[str, ...] = ()
    n_draft: int | None = None
    ignore_eos: bool = False
    cache_prompt: bool = False
    logit_bias: dict[int, float] | None = None
    n_probs: int = 0
    post_sampling_probs: bool = False
    constraint: object = None
    client: str | None = None
    return_progress: bool = False
    n_keep: int = 0
    n_discard: int = 0


class SpeculativeGenerator:
    """Owns a target, a drafter and the per-request caches.

    Args:
        target: the target model.
        drafter: any :class:`Drafter`; ``NoDrafter`` gives the baseline.
        ctx_size: maximum positions per sequence (prompt + output).
        n_draft: default draft tokens per step (``--spec-draft-n-max``); the most a
            controller may choose.
        controller: picks the depth of each step (``--spec-dm-controller profit``); None =
            always ``n_draft`` (``off``). Its estimates persist across requests; it only
            chooses how many tokens to draft, so outputs stay lossless.
        kv: the target's KV cache types (``--cache-type-k/-v``, :mod:`flashdraft.kv_cache`);
            None = plain cache in the model's dtype.
        synth_accept: benchmarking only: ``[n_draft]`` conditional probabilities with which
            each draft position is accepted whatever the target says
            (:mod:`flashdraft.synthetic`; the output is then not the model's). None = real verify.
        reproducible_seeds: a seeded request at T > 0 gets plain decoding's tokens for its
            seed, drafting or not (drafts are the drafter's argmax, as llama-server's; the
            server turns it on); False: drafts are sampled whatever the seed (Leviathan's
            rule, which accepts more of a flat distribution; the same distribution).

    Attributes:
        context_shift: a sequence that fills the context drops the older half of what it
            holds after ``n_keep`` tokens and goes on (llama-server's ``--context-shift``;
            only on a target whose ``can_shift``); False: the answer ends there ("length").
    """

    def __init__(self, target: Target, drafter: Drafter | None = None, ctx_size: int = 4096,
                 n_draft: int = 16, controller: ProfitController | None = None, kv: KVCacheSpec | None = None,
                 synth_accept: list[float] | None = None, reproducible_seeds: bool = False):
        self.target = target
        self.synth_accept = synth_accept
        self.reproducible_seeds = reproducible_seeds
        self.drafter = drafter or NoDrafter()
        self.ctx_size = ctx_size
        self.n_draft = n_draft
        self.controller = controller
        self.kv = kv
        self.target.set_feature_layers(self.drafter.feature_layer_ids)
        #: left by the last :meth:`generate` for the next one (the generator's drafter holds
        #: the matching context); None after a failure
        self.prompt_cache: PromptCache | None = None
        #: host-RAM copies of earlier prompt caches (:class:`flashdraft.prompt_store.PromptStore`,
        #: the server's ``--cache-ram``); None = only the last one is kept
        self.prompt_store = None
        self.context_shift = False

    @property
    def drafting(self) -> bool:
        return not isinstance(self.drafter, NoDrafter)

    def enable_context_shift(self) -> None:
        """Turn :attr:`context_shift` on (the server's ``--context-shift``).

        Raises:
            ValueError: the target cannot move cached positions (``can_shift`` False: the
                torch backend, or a llama.cpp context that cannot shift).
        """
        if not self.target.can_shift:
            raise ValueError(f"--context-shift needs a target whose cached positions can move (the llama backend); "
                             f"this {self.target.backend} target ends an answer at the context's end")
        self.context_shift = True

    def check_prompt(self, n_prompt: int) -> None:
        """Raises ContextOverflowError when ``n_prompt`` tokens leave no room to answer."""
        if n_prompt == 0:
            raise ValueError("the prompt is empty")
        if n_prompt >= self.ctx_size:
            raise ContextOverflowError(n_prompt, self.ctx_size)

    def warmup(self) -> None:
        """One short greedy generation through target and drafter (results discarded)."""
        ids = self.target.encode("Hello, hello, hello") or [0]
        for _ in self.generate(GenerationRequest(ids[: self.ctx_size // 2], 4, ignore_eos=True)):
            pass
        if self.controller is not None:  # first forwards are slow (kernel setup): not real step costs
            self.controller.reset()

    @torch.inference_mode()
    def generate(self, request: GenerationRequest | list[int], *args,
                 cancelled: Callable[[], bool] | None = None, prefill_chunk: int | None = None,
                 **kw) -> Iterator[Step]:
        """Answer ``request``; yields :class:`Step`, the last with ``finish_reason`` set.

        One :class:`Sequence` stepped on its own: each step is one target forward (the
        prefill, then one verify per step). The server's parallel slots step several
        sequences with one packed forward instead (:mod:`flashdraft.batch`). ``request``
        may also be given as :class:`GenerationRequest`'s own arguments
        (``generate(prompt_ids, max_tokens, params, stop=...)``).

        With ``request.cache_prompt`` the sequence starts from :attr:`prompt_cache`, the
        target and drafter caches of the previous call, and prefills only what follows the
        longest common prefix (multi-turn chat then prefills the new turn only). Whatever
        the flag, a call that ends (finished or cancelled) leaves its caches there.

        ``prefill_chunk``: most prompt tokens per prefill forward (None = the whole prompt
        in one). Between chunks the call may be cancelled, and a cancelled prefill leaves
        the part it did as the prompt cache, so the same prompt sent again starts there.

        Raises:
            ContextOverflowError: prompt too long for ``ctx_size``.
            ValueError: ``max_tokens < 1`` or an empty prompt.
            Cancelled: when ``cancelled()`` turns True (checked before each forward after
                the first).
        """
        if not isinstance(request, GenerationRequest):
            request = GenerationRequest(request, *args, **kw)
        cached, self.prompt_cache = self.prompt_cache, None  # a failure below leaves none
        if self.prompt_store is not None:  # save what this request would overwrite; load a better match
            cached = self.prompt_store.swap(cached, request.prompt_ids, self.target, self.drafter,
                                            reuse=request.cache_prompt)
        seq = Sequence(self, request, reuse=cached)
        cached = None  # the sequence owns the reused cache now; a dropped one is freed at once
        seq.prefill_chunk = prefill_chunk
        if request.return_progress:  # before any forward: llama-server's 0% report
            yield seq.progress_step()
        while not seq.done:
            if seq.started and cancelled is not None and cancelled():
                self.prompt_cache = seq.leftover()  # between steps: caches and drafter agree
                raise Cancelled()
            logits, features = self.target.forward(*seq.prepare())
            step = seq.finish(logits, features)
            if seq.done:
                self.prompt_cache = seq.leftover()
            yield step


class Sequence:
    """One request's state in the speculative loop, stepped by whoever owns the target forward.

    A step is ``prepare()`` -> one target forward over its result -> ``finish(logits,
    features)``: the first step is the prefill, every later one drafts, verifies and
    accepts. Splitting the loop at the forward is what lets the server pack the forwards of
    several sequences into one (:meth:`flashdraft.targets.torch.Target.forward_packed`) while each
    keeps its own cache, drafter state, sampling generator, stops and timings.

    Args:
        generator: target, context size and default depth (its drafter and controller
            unless ``drafter`` / ``controller`` are given).
        request: what to answer and how (:class:`GenerationRequest`).
        drafter: this sequence's drafter (a parallel slot's own, see :meth:`Drafter.fork`);
            it is ``reset()`` here.
        controller: this sequence's depth controller (a slot's own); None = the generator's.
        reuse: the caches the previous sequence of this drafter left (:meth:`leftover`);
            with ``request.cache_prompt`` the prompt's longest common prefix with them is
            not prefilled again. None = fresh caches.
    Raises:
        ContextOverflowError: prompt too long for ``ctx_size``.
        ValueError: ``max_tokens < 1`` or an empty prompt.
    """

    def __init__(self, generator: SpeculativeGenerator, request: GenerationRequest,
                 drafter: Drafter | None = None, controller: ProfitController | None = None,
                 reuse: PromptCache | None = None):
        r = self.request = request
        prompt_ids, params = r.prompt_ids, r.params
        generator.check_prompt(len(prompt_ids))
        if r.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {r.max_tokens}")
        target = generator.target
        self.target, self.ctx_size, self.max_tokens, self.params = target, generator.ctx_size, r.max_tokens, params
        self.n_draft = generator.n_draft if r.n_draft is None else r.n_draft
        self.drafter = generator.drafter if drafter is None else drafter
        self.controller = generator.controller if controller is None else controller
        self.drafting = not isinstance(self.drafter, NoDrafter)
        self.gen = params.make_generator(target.device)  # sampled where the logits are
        # a seeded request at T > 0 gets plain decoding's tokens for its seed, drafting or not
        # (llama-server's rule): the drafter proposes its argmax, drawing nothing from the
        # request's stream, and verify samples the target in order (verify_sampling). Unseeded,
        # drafts are sampled and checked by Leviathan's rule, which accepts more of a flat
        # distribution; both give exactly the target's distribution
        self.synth = generator.synth_accept
        # synthetic acceptance takes the argmax too: rate 0 is then plain decoding's tokens
        seeded = params.seed is not None and generator.reproducible_seeds or self.synth is not None
        self.draft_params = SamplingParams() if seeded and not params.greedy else params
        self.coin = random.Random(params.seed) if self.synth is not None else None
        self.eos = set() if r.ignore_eos else target.eos_token_ids
        self.context_shift = generator.context_shift
        self.stream = TextStream(target.decode, r.stop)
        # committed ids (the last: the anchor), host-side: stops, prompt lookup and the
        # grammar read them; the forward copies only each step's few new ids to the device
        self.tokens = torch.tensor(prompt_ids, dtype=torch.long, device=HOST)
        self.prefilled = False
        self.finish_reason: str | None = None
        # prompt cache: the drafter keeps the shared prefix's context (as much as it can),
        # the target cache is rolled back to the same point; else both start empty
        n_cached = common_prefix(reuse, prompt_ids) if r.cache_prompt else 0
        n_cached = self.drafter.rewind(n_cached) if n_cached else 0
        if n_cached:
            self.cache = reuse.cache
            self.cache.rollback(n_cached)
        else:
            self.drafter.reset()
            self.cache = target.new_cache(kv=generator.kv)
        self.n_cached = n_cached
        self.n_prompt = len(prompt_ids)
        #: most prompt tokens one prefill forward takes (None: the whole prompt in one); the
        #: server's parallel slots set it (``-b``), so a long prompt is prefilled over several
        #: packed steps and the other slots' answers keep coming in between
        self.prefill_chunk: int | None = None
        self._prefill_at = n_cached  # prompt positions whose K/V the target cache holds
        self._chunk = 0  # tokens of the prefill chunk in flight when it is not the last one
        self.drafter.start_request(r.client)
        self.t = Timings(prompt_n=len(prompt_ids) - n_cached, cache_n=n_cached)
        self.bias = None
        if r.logit_bias:
            self.bias = (torch.tensor(list(r.logit_bias), dtype=torch.long, device=target.device),
                         torch.tensor(list(r.logit_bias.values()), dtype=torch.float32, device=target.device))
        self.constraint = r.constraint
        if self.controller is not None:
            self.controller.start_request()
        # filled by prepare() for finish(): this step's drafts, depth and start time
        self._draft = None
        self._drafts = torch.empty(0, dtype=torch.long, device=HOST)
        self._depth = self._standing = 0
        self._t0 = self._t1 = 0.0
        self._ctrl = None  # the controller that chose this step's depth (per source for a hybrid)
        self._shifted_off = False  # a context shift took the drafter's context features away

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def started(self) -> bool:
        """Whether a forward of this sequence has run (the first prefill chunk at least)."""
        return self.prefilled or self._prefill_at > self.n_cached

    def leftover(self) -> PromptCache | None:
        """The caches for the next request of this drafter; call between steps only (after
        a ``finish``), when the target cache holds exactly ``tokens[:-1]``, or, part way
        through a chunked prefill, the prompt's first chunks. None when it holds nothing."""
        if not self.prefilled:
            if self._prefill_at == 0:
                return None
            return PromptCache(self.tokens[: self._prefill_at].tolist(), self.cache)
        return PromptCache(self.tokens[:-1].tolist(), self.cache)

    def progress_step(self) -> Step:
        """A step with no output that reports the prefill so far (:class:`PromptProgress`),
        with timings whose ``prompt_n`` / ``prompt_ms`` count what was prefilled."""
        return Step("", [], progress=self._prefill_timings(), prompt_progress=self._prompt_progress())

    def _prompt_progress(self) -> PromptProgress:
        elapsed = time.perf_counter() - self._t0 if self.started else 0.0
        return PromptProgress(self.n_prompt, self.n_cached, self._prefill_at, int(1e3 * elapsed))

    def _prefill_timings(self) -> Timings:
        t = copy.copy(self.t)
        t.prompt_n = self._prefill_at - self.n_cached
        t.prompt_ms = 1e3 * (time.perf_counter() - self._t0) if self.started else 0.0
        return t

    def prepare(self) -> tuple[torch.Tensor, object, int]:
        """This step's target input: ``(token_ids [T], cache, logits_from)`` for ``Target.forward``."""
        if not self.prefilled:
            # 1. prefill: one target forward over the prompt (logits of the last row only)
            #    (after the cached prefix: its K/V are in the cache already), or over its next
            #    chunk of at most prefill_chunk tokens (no logits before the last chunk)
            if self._prefill_at == self.n_cached:
                self._t0 = time.perf_counter()
            todo = self.tokens[self._prefill_at:]
            if self.prefill_chunk is not None and todo.shape[0] > self.prefill_chunk:
                todo = todo[: self.prefill_chunk]
                self._chunk = todo.shape[0]
                return todo, self.cache, todo.shape[0]
            return todo, self.cache, todo.shape[0] - 1
        if self.context_shift and self.tokens.shape[0] >= self.ctx_size:
            self._shift()
        # 2. draft: depth from the controller (or fixed); never past max_tokens (the bonus
        #    token adds one) or the context (with context shift, never past the length where
        #    plain decoding shifts, so both shift at the same token and stay identical)
        t = self.t
        self._depth, self._standing = self._choose_depth()
        room = min(self._depth, self.max_tokens - t.predicted_n - 1,
                   self.ctx_size - self.tokens.shape[0] - int(self.context_shift))
        self._t0 = time.perf_counter()
        # the constraint goes only to drafters of a constrained request: a drafter written
        # against the older four-argument propose() keeps working everywhere else
        extra = {} if self.constraint is None else {"constraint": self.constraint}
        self._draft = (self.drafter.propose(self.tokens, room, self.draft_params, self.gen, **extra)
                       if room > 0 else None)
        t.draft_ms += 1e3 * (time.perf_counter() - self._t0)
        self._drafts = (self._draft.tokens[:room] if self._draft is not None
                        else torch.empty(0, dtype=torch.long, device=HOST))
        if self._ctrl is not None and self._draft is not None and self._draft.confidence is not None:
            # the drafter's own confidence says where this draft stops paying (adaptive.py, cut)
            self._drafts = self._drafts[: self._ctrl.cut(self._draft.confidence[: self._drafts.shape[0]])]
        if self.constraint is not None and self._drafts.numel():
            self._drafts = self._drafts[: self._grammar_prefix(self._drafts.tolist())]
        # 3. verify: one target forward over [anchor, drafts]
        return torch.cat([self.tokens[-1:], self._drafts]), self.cache, 0

    def finish(self, logits: torch.Tensor, features: torch.Tensor | None) -> Step:
        """Consume the forward of :meth:`prepare`'s input: ``logits [T - logits_from, V]``,
        ``features [T, F]`` or None. Returns the step's output (``finish_reason`` set on the last);
        a chunk of the prompt before its last returns an empty step (:attr:`prefilled` still False)."""
        if self._chunk:  # an early chunk of a long prompt: its K/V are in, nothing to sample
            n, self._chunk = self._chunk, 0
            self._prefill_at += n
            self.drafter.commit(self._prefill_at, features)
            return self.progress_step() if self.request.return_progress else Step("", [])
        if self.bias is not None:  # before the first read: every rule sees the biased target
            ids, values = self.bias
            logits[:, ids] += values
        if self.constraint is not None:  # row i: the grammar after the drafts before it
            self.constraint.apply(logits, self._drafts.tolist() if self.prefilled else [])
        step = self._finish_prefill(logits, features) if not self.prefilled else self._finish_verify(logits, features)
        if self.constraint is not None and not step.finish_reason:
            self.constraint.advance(step.token_ids)
        if step.finish_reason and not self.t.truncated:  # the answer is whole: a drafter may keep it
            self.drafter.finish_request(self.tokens, self.n_prompt)
        if self.request.n_probs and step.token_ids:
            # row i of the forward chose returned token i (prefill: its one row; verify: the
            # anchor's row, then one per accepted draft, the last giving the bonus token)
            step.logprobs = token_logprobs(logits[: len(step.token_ids)], step.token_ids, self.request.n_probs,
                                           self.params if self.request.post_sampling_probs else None)
        return step

    def _finish_prefill(self, logits: torch.Tensor, features: torch.Tensor | None) -> Step:
        # the first token; the prompt's features become the drafter's context
        first = choose_token(logits[-1], self.params, self.gen)
        self.drafter.commit(self.tokens.shape[0], features)
        self._prefill_at = self.tokens.shape[0]
        self.tokens = torch.cat([self.tokens, torch.tensor([first], device=HOST)])
        self.prefilled = True
        self._t1 = time.perf_counter()
        t = self.t
        t.prompt_ms = 1e3 * (self._t1 - self._t0)
        finish, kept, _ = _emit(self.stream, [first], self.eos, self.max_tokens, t)
        t.n_steps = 1
        self.finish_reason = finish
        report = None
        if self.request.return_progress:  # the whole prompt is in: the 100% report
            report = PromptProgress(self.n_prompt, self.n_cached, self.n_prompt, int(t.prompt_ms))
        return Step(self.stream.delta(finish is not None), kept, finish, t if finish else None,
                    progress=copy.copy(t), prompt_progress=report)

    def _finish_verify(self, logits: torch.Tensor, features: torch.Tensor | None) -> Step:
        t, drafts, draft, params = self.t, self._drafts, self._draft, self.params
        n = drafts.shape[0]
        # accept the longest prefix equal to the target's argmax (T=0) or by speculative
        # sampling (T>0); logits are [n+1, V]
        if self.synth is not None:  # benchmarking: a coin accepts, not the target
            n_acc, bonus = verify_synthetic(drafts, logits, params, self.gen, self.synth, self.coin, self.eos)
        elif params.greedy:
            n_acc, bonus = verify_greedy(drafts, logits)
        else:
            q = draft.probs[:n] if draft is not None and draft.probs is not None else None
            n_acc, bonus = verify_sampling(drafts, q, filtered_probs(logits, params), self.gen)

        # 4. rollback: keep K/V of the anchor and the accepted drafts only
        anchor_at = self.tokens.shape[0] - 1
        self.cache.rollback(anchor_at + n_acc + 1)
        new = drafts[:n_acc].tolist() + [bonus]
        self.tokens = torch.cat([self.tokens, torch.tensor(new, dtype=torch.long, device=HOST)])
        if not self._shifted_off:
            self.drafter.commit(anchor_at + n_acc + 1, None if features is None else features[: n_acc + 1])
        if self._ctrl is not None:  # what this depth cost: draft + verify + rollback [s]
            self._ctrl.update(n, n_acc, time.perf_counter() - self._t0)

        # 5. stops; count only what is returned
        finish, kept, produced = _emit(self.stream, new, self.eos, self.max_tokens, t)
        if finish is None and not self.context_shift and self.tokens.shape[0] >= self.ctx_size:
            finish = "length"
        if finish == "length" and self.tokens.shape[0] >= self.ctx_size:
            t.truncated = True  # the context is full (a limit capped to it ends here too)
        t.count_step(produced)
        t.draft_depth_sum += self._depth
        t.draft_depth_last = self._standing
        if n:  # an accepted draft counts if it was produced (an accepted end of sequence too)
            t.count_draft(n, min(n_acc, produced))
        t.predicted_ms = 1e3 * (time.perf_counter() - self._t1)
        self.finish_reason = finish
        return Step(self.stream.delta(finish is not None), kept, finish, t if finish else None,
                    progress=copy.copy(t))

    def _shift(self) -> None:
        """llama-server's context shift (``--context-shift``): the cache is full, so keep the
        first ``n_keep`` tokens (+ a BOS), drop the next ``n_discard`` (half of the rest by
        default) and move the later ones down; the answer goes on with what is left.

        A drafter that copies from the ids (prompt lookup, suffix) re-reads them; one that
        needs the target's context features (DFlash, the hybrid) keeps the first ``n_keep``
        positions' context and drafts no more in this answer (the moved positions' features
        are not recomputed). Either way the tokens are the target's.
        """
        r, n_past = self.request, self.tokens.shape[0] - 1  # positions in the cache
        n_keep = self.n_prompt if r.n_keep < 0 else r.n_keep
        bos = getattr(self.target.tokenizer, "bos_token_id", None)
        if bos is not None and int(self.tokens[0]) == bos:
            n_keep += 1
        n_keep = min(self.ctx_size - 4, n_keep)
        n_left = n_past - n_keep
        n_discard = min(max(r.n_discard or n_left // 2, 0), max(0, n_left - 1))
        self.cache.shift(n_keep, n_discard)
        self.tokens = torch.cat([self.tokens[:n_keep], self.tokens[n_keep + n_discard:]])
        self.t.truncated = True
        if self.drafter.feature_layer_ids:
            self.drafter.rewind(n_keep)
            self._shifted_off = True
        log.debug("context shift: kept %d, dropped %d of %d cached positions", n_keep, n_discard, n_past)

    def _grammar_prefix(self, drafts: list[int]) -> int:
        """Drafts kept under the grammar: those it accepts, through the first end of
        sequence (nothing after an end is ever returned)."""
        n = self.constraint.valid_prefix(drafts)
        for i, t in enumerate(drafts[:n]):
            if t in self.target.eos_token_ids:
                return i + 1
        return n

    def _choose_depth(self) -> tuple[int, int]:
        """``(depth, standing)``: draft tokens to ask for this step, and the controller's
        standing depth (probes aside); both ``n_draft`` with the controller off, both at most
        ``n_draft`` and the drafter's longest draft, ``(0, 0)`` without a drafter."""
        if not self.drafting or self._shifted_off:
            return 0, 0
        n_draft = self.n_draft
        cap = n_draft if self.drafter.max_draft is None else min(n_draft, self.drafter.max_draft)
        if self.controller is None:
            return cap, cap
        ctrl = self.controller
        if isinstance(ctrl, SourcedController):  # a mixed-source drafter: that source's estimates
            ctrl = ctrl.for_source(self.drafter.next_source(self.tokens, ctrl.pick))
        self._ctrl = ctrl
        depth = min(cap, ctrl.choose())  # choose() first: it may move the standing depth
        if self.drafter.free_drafts and getattr(ctrl, "verify_costs", None) is not None and not ctrl.probing:
            # a free draft (prompt lookup): ask for the longest every step and let the cost
            # table and the draft's confidence cut it (prepare); a copy that starts after
            # a failed probe is then not missed until the next probe
            depth = cap
        return depth, min(cap, ctrl.depth)


def token_logprobs(logits: torch.Tensor, token_ids: list[int], n_top: int,
                   sampling: SamplingParams | None = None) -> list[TokenLogprob]:
    """:class:`TokenLogprob` of ``token_ids[i]`` from row i of ``logits [len(token_ids), V]``.

    ``sampling``: take the log-probabilities from that sampling distribution instead of the
    full softmax (llama-server's ``post_sampling_probs``): greedy is all mass on the argmax;
    tokens the filters removed (probability 0) are left out of ``top``.
    """
    if sampling is None:
        lp = torch.log_softmax(logits.float(), dim=-1)
    elif sampling.greedy:
        lp = torch.full_like(logits, float("-inf"), dtype=torch.float32)
        lp.scatter_(1, logits.argmax(-1, keepdim=True), 0.0)
    else:
        lp = filtered_probs(logits, sampling).log()
    chosen = lp.gather(1, torch.tensor(token_ids, device=lp.device)[:, None])[:, 0].tolist()
    top_v, top_i = lp.topk(min(n_top, lp.shape[-1]), dim=-1)
    keep = sampling is not None
    return [TokenLogprob(tok, c, [(i, v) for i, v in zip(ids, vals) if not keep or v > float("-inf")])
            for tok, c, ids, vals in zip(token_ids, chosen, top_i.tolist(), top_v.tolist())]


def _add_counts(dst: list[int], src: list[int]) -> None:
    """``dst[k] += src[k]`` for every k, ``dst`` grown with zeros to ``src``'s length."""
    dst.extend([0] * (len(src) - len(dst)))
    for k, n in enumerate(src):
        dst[k] += n


def _emit(stream: TextStream, new: list[int], eos: set[int], max_tokens: int,
          t: Timings) -> tuple[str | None, list[int], int]:
    """Feed new tokens through the stop rules; returns (finish_reason, tokens kept, tokens
    produced): produced counts the kept tokens plus an end-of-sequence token that ended them
    (the target produced it; it is not returned), the rule of :attr:`Timings.verify_n`."""
    kept = []
    for tok in new:
        if tok in eos:
            return "stop", kept, len(kept) + 1
        kept.append(tok)
        t.predicted_n += 1
        if stream.add(tok):
            return "stop", kept, len(kept)
        if t.predicted_n >= max_tokens:
            return "length", kept, len(kept)
    return None, kept, len(kept)


def generate_text(generator: SpeculativeGenerator, prompt_ids: list[int], max_tokens: int,
                  params: SamplingParams, **kw) -> tuple[str, list[int], str, Timings]:
    """Run :meth:`SpeculativeGenerator.generate` to the end: ``(text, token_ids, finish, timings)``."""
    text, ids, finish, timings = [], [], None, None
    for step in generator.generate(GenerationRequest(prompt_ids, max_tokens, params, **kw)):
        text.append(step.text)
        ids.extend(step.token_ids)
        finish, timings = step.finish_reason, step.timings
    return "".join(text), ids, finish, timings
