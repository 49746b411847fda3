"""Renderer of llama-server's native ``/completion`` answers."""

from __future__ import annotations

from flashdraft.generate import Step
from flashdraft.server.render_base import Completion, Logprobs, RenderContext, StreamFormat, sse, stop_details


class LlamaRenderer:
    """``/completion`` bodies: one object, or (several prompts) a list of them with ``index``."""

    def __init__(self, ctx: RenderContext):
        self.ctx = ctx
        self.wire = ctx.req.wire
        self.lps = ctx.logprobs()

    def final(self, c: Completion, prompt_ids: list[int]) -> dict:
        """A whole answer (also the last streamed event): text, counts, settings, timings;
        ``tokens`` empty unless ``return_tokens``; ``completion_probabilities`` with ``n_probs``;
        ``prompt``: the prompt as the model saw it (special tokens as text)."""
        ctx, job = self.ctx, self.ctx.jobs[0]
        prompts = ctx.prompts
        stop_type, word = stop_details(prompts.decode, c, job.stop)
        p = job.params
        settings = {"n_predict": self.wire.n_predict, "temperature": p.temperature, "top_k": p.top_k,
                    "top_p": p.top_p, "min_p": p.min_p, "seed": -1 if p.seed is None else p.seed,
                    "stop": job.stop, "ignore_eos": job.ignore_eos, "n_ctx": ctx.n_ctx}
        extra = {"completion_probabilities": self.lps.llama(c.logprobs)} if self.lps else {}
        body = {**extra,
                "content": c.text, "tokens": c.token_ids if self.wire.return_tokens else [], "id_slot": 0,
                "stop": True, "model": ctx.model, "tokens_predicted": c.timings.predicted_n,
                "tokens_evaluated": len(prompt_ids), "generation_settings": settings,
                "prompt": prompts.decode(prompt_ids, skip_special=False), "has_new_line": "\n" in c.text,
                "truncated": c.timings.truncated, "stop_type": stop_type, "stopping_word": word,
                "tokens_cached": c.timings.cache_n, "timings": ctx.timings(c)}
        return self.wire.pick_fields(body)

    def body(self, results: list[Completion]) -> dict | list:
        jobs = self.ctx.jobs
        if len(results) == 1:
            return self.final(results[0], jobs[0].prompt_ids)
        # several prompts: one result object each, in order (llama-server's array)
        return [{"index": i, **self.final(c, j.prompt_ids)} for i, (c, j) in enumerate(zip(results, jobs))]

    def stream(self) -> StreamFormat:
        return LlamaStream(self, self.wire.return_tokens, self.lps)


class LlamaStream(StreamFormat):
    """llama-server ``/completion`` events: ``{"content", "tokens", "stop": false}`` chunks,
    then the full final object with ``stop: true`` (no ``[DONE]``, as llama-server)."""

    def __init__(self, renderer: LlamaRenderer, return_tokens: bool = False, logprobs: Logprobs | None = None):
        self.renderer, self.return_tokens, self.logprobs = renderer, return_tokens, logprobs

    def _probs(self, step: Step) -> dict:
        return {"completion_probabilities": self.logprobs.llama(step.logprobs or [])} if self.logprobs else {}

    def progress(self, step: Step) -> bytes | None:
        chunk = {"content": "", "tokens": [], "stop": False, "id_slot": 0,
                 "prompt_progress": step.prompt_progress.to_dict()}
        return sse(self.tag(chunk, step))

    def delta(self, step: Step) -> bytes | None:
        if not (step.text or step.token_ids):
            return None
        chunk = {"content": step.text, "tokens": step.token_ids if self.return_tokens else [], "stop": False,
                 "id_slot": 0}
        return sse(self.tag({**chunk, **self._probs(step)}, step))

    def end(self, step: Step, c: Completion) -> list[bytes]:
        # the last event carries only its own piece of text (and probabilities), like every other event
        tokens = step.token_ids if self.return_tokens else []
        final = self.renderer.final(c, self.renderer.ctx.jobs[0].prompt_ids)
        return [sse({**final, "content": step.text, "tokens": tokens, **self._probs(step)})]
