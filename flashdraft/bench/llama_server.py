"""Bench peers that run llama.cpp's own server: ``llama-server``, ``-lookup`` and ``-dflash``.

The engine a user would otherwise pick is llama-server, so these peers start it as a child
process on a free loopback port, on the same GGUF with the same threads and context, and send
each prompt's **token ids** to its native ``POST /completion`` (``return_tokens``, no prompt
cache), so the answer is compared token by token and nothing depends on a chat template.
Speeds and counters are llama-server's own ``timings``: decode = ``predicted_n /
predicted_ms`` (its definition), ``draft_n`` / ``draft_n_accepted``; TTFT is its
``prompt_ms`` (the prefill, measured by the server; the answer is not streamed).

- ``llama-server``: plain decoding.
- ``llama-server-lookup``: ``--spec-type`` :data:`LOOKUP_TYPE` (prompt lookup). The variants
  were each tried once on these prompts (docs/benchmarks.md, "llama-server's n-gram modes");
  the one kept is the fastest there.
- ``llama-server-dflash``: ``--spec-type draft-dflash -md`` our DFlash drafter, converted by
  ``flashdraft convert --arch dflash --target`` (the target's tokenizer and LM head rows go in,
  see ``flashdraft.drafters.dflash_format`` note 6), drafting the whole block
  (``--spec-draft-n-max`` = block size - 1).

The binary is built by ``make llama-peer`` from the llama.cpp sources vendored in
llama-cpp-python 0.3.36 (the same sources the llama backend runs), into
:func:`default_binary`; ``$FLASHDRAFT_LLAMA_SERVER`` points at another one.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from flashdraft.bench.contender import DESCRIPTIONS, BenchPrompt, Contender, Unavailable
from flashdraft.bench.measure import Generation, SpecCounts
from flashdraft.bench.remote import open_json
from flashdraft.sampling import SamplingParams
from flashdraft.targets.binding import child_env

LLAMA_SERVER_PEERS = ("llama-server", "llama-server-lookup", "llama-server-dflash")
#: llama-cpp-python release whose vendored llama.cpp ``make llama-peer`` builds
LLAMA_CPP_PYTHON_VERSION = "0.3.36"
BINARY_ENV = "FLASHDRAFT_LLAMA_SERVER"
INSTALL_HINT = ("make llama-peer: builds llama-server from llama-cpp-python "
                f"{LLAMA_CPP_PYTHON_VERSION}'s llama.cpp (~13 min on 2 cores), or set ${BINARY_ENV}")
#: llama-server's n-gram mode kept for ``llama-server-lookup`` (see the module docstring)
LOOKUP_TYPE = "ngram-simple"
#: seconds to wait for the server to load the model and answer ``/health``
START_TIMEOUT_S = 180.0


class LlamaServerError(RuntimeError):
    """llama-server did not start, exited, or answered with an error (the message says which)."""


def default_binary() -> Path:
    """Where ``make llama-peer`` puts the binary: ``$FLASHDRAFT_CACHE`` (default
    ``~/.cache/flashdraft``) ``/llama-server/<llama-cpp-python version>/bin/llama-server``."""
    cache = Path(os.environ.get("FLASHDRAFT_CACHE", Path.home() / ".cache" / "flashdraft"))
    return cache / "llama-server" / LLAMA_CPP_PYTHON_VERSION / "bin" / "llama-server"


def find_binary() -> Path | None:
    """``$FLASHDRAFT_LLAMA_SERVER`` if set, else :func:`default_binary`; None when not executable."""
    path = Path(os.environ.get(BINARY_ENV) or default_binary())
    return path if path.is_file() and os.access(path, os.X_OK) else None


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LlamaServerProcess:
    """One llama-server child process on a free loopback port.

    Args:
        binary: the llama-server executable.
        model: the target GGUF.
        threads: ``-t`` and ``-tb`` (generation and batch threads).
        ctx_size: ``-c``.
        extra: more command-line arguments (the speculative mode).
        owned_dir: a directory deleted with the process (the converted drafter).
    Raises:
        LlamaServerError: the process exited before ``/health`` answered, or did not answer
            within :data:`START_TIMEOUT_S`; the message ends with the tail of its log.
    """

    def __init__(self, binary: Path, model: Path, threads: int, ctx_size: int, extra: list[str],
                 owned_dir: Path | None = None):
        self.port, self.owned_dir = free_port(), owned_dir
        self.base = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(tempfile.mkstemp(prefix="llama-server-", suffix=".log")[1])
        # one slot: requests run one at a time, as every other configuration's
        self.argv = [str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(self.port),
                     "-t", str(threads), "-tb", str(threads), "-c", str(ctx_size), "-np", "1", *extra]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=child_env())
        atexit.register(self.close)  # no server outlives the bench, even when it fails
        try:
            self._wait_healthy()
        except BaseException:
            self.close()
            raise

    def log_tail(self, lines: int = 12) -> str:
        """The last ``lines`` lines of the server's log (stdout and stderr)."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise LlamaServerError(f"llama-server exited with code {self.proc.returncode} while loading:\n"
                                       f"{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.base + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass  # still loading (503) or not listening yet
            time.sleep(0.2)
        raise LlamaServerError(f"llama-server did not answer /health within {START_TIMEOUT_S:.0f} s:\n{self.log_tail()}")

    def post(self, path: str, body: dict, timeout: float = 1800.0) -> dict:
        """POST ``body`` as JSON, return the JSON answer. Raises LlamaServerError on an HTTP error."""
        with open_json("POST", self.base + path, body, timeout, LlamaServerError, unreachable=self.log_tail) as r:
            return json.load(r)

    def close(self) -> None:
        """Stop the process (terminate, then kill after 10 s); delete its log and ``owned_dir``."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log_path.unlink(missing_ok=True)
        if self.owned_dir is not None:
            shutil.rmtree(self.owned_dir, ignore_errors=True)


def completion_body(prompt: BenchPrompt, params: SamplingParams) -> dict:
    """The ``/completion`` request for ``prompt``: its token ids, no prompt cache (but for a
    conversation's later turn), the same sampling filters as ours at T > 0 (temperature,
    top-k, top-p, min-p, seed)."""
    body = {"prompt": list(prompt.ids), "n_predict": prompt.max_tokens, "cache_prompt": prompt.cache_prompt,
            "return_tokens": True, "stream": False, "temperature": params.temperature}
    if not params.greedy:
        body.update(top_k=params.top_k, top_p=params.top_p, min_p=params.min_p)
        if params.seed is not None:
            body["seed"] = params.seed
    return body


def parse_completion(answer: dict, eos_ids: set[int], decode, wall_ms: float) -> Generation:
    """A llama-server ``/completion`` answer (``return_tokens``) -> :class:`Generation`.

    Args:
        answer: the JSON answer: ``tokens``, ``content``, ``stop_type`` (``eos`` | ``limit`` |
            ``word``), ``tokens_evaluated`` and ``timings`` (``prompt_n``, ``prompt_ms``,
            ``predicted_n``, ``predicted_ms``, and ``draft_n`` / ``draft_n_accepted`` when it drafted).
        eos_ids: end-of-generation ids, dropped from the tokens if the server returned one.
        decode: token ids -> text (the target's detokenizer, the same for every configuration).
        wall_ms: the request's wall time on the client (ms), the total time.
    Raises:
        LlamaServerError: the answer has no ``tokens`` or no ``timings``.
    """
    if "tokens" not in answer or "timings" not in answer:
        raise LlamaServerError(f"not a /completion answer with tokens and timings: keys {sorted(answer)}")
    ids = [int(t) for t in answer["tokens"]]
    cut = next((i for i, t in enumerate(ids) if t in eos_ids), None)
    if cut is not None:
        ids = ids[:cut]
    t = answer["timings"]
    finish = {"eos": "stop", "word": "stop", "limit": "length"}.get(answer.get("stop_type"))
    gen = Generation(text=decode(ids), token_ids=ids,
                     prompt_tokens=int(answer.get("tokens_evaluated", t.get("prompt_n", 0))),
                     completion_tokens=len(ids), ttft_ms=float(t.get("prompt_ms", 0.0)), total_ms=wall_ms,
                     finish_reason=finish, cached_tokens=t.get("cache_n", answer.get("tokens_cached")))
    if t.get("predicted_n") and t.get("predicted_ms"):
        gen.decode_ms, gen.decode_tokens = float(t["predicted_ms"]), int(t["predicted_n"])
        gen.decode_source = "server"
    if "draft_n" in t:
        # llama-server counts drafts and accepted drafts only; τ = tokens per verify step is
        # not derivable from them without the number of steps
        gen.spec = SpecCounts(steps=None, draft_n=int(t["draft_n"]), draft_n_accepted=int(t.get("draft_n_accepted", 0)))
    return gen


def tau_fixed_drafts(draft_n: int, draft_n_accepted: int, per_step: int) -> float:
    """τ (tokens per verify step) of a mode that drafts exactly ``per_step`` tokens every step.

    llama-server reports only ``draft_n`` and ``draft_n_accepted``; ``draft-dflash`` with
    ``--spec-draft-p-min 0`` (its default) drafts the whole block each step, so the steps are
    ``draft_n / per_step`` and τ = 1 + accepted / steps. Approximate when the last step was cut
    short by ``n_predict``.
    """
    return 1.0 + draft_n_accepted * per_step / draft_n


class LlamaServerContender(Contender):
    """One llama-server process, kept for the whole bench run.

    ``kind = "peer"``; JSON-schema prompts are skipped (the grammar is not passed yet).
    """

    kind = "peer"
    constraint_note = "the bench does not pass a grammar to llama-server's /completion yet"

    def __init__(self, name: str, server: LlamaServerProcess, eos_ids: set[int], decode, note: str | None = None,
                 fixed_drafts: int | None = None):
        self.name, self.server, self.eos_ids, self.decode = name, server, eos_ids, decode
        self.fixed_drafts = fixed_drafts
        self.description = DESCRIPTIONS[name] + (f"; {note}" if note else "")

    def run(self, prompt: BenchPrompt, params: SamplingParams) -> Generation:
        t0 = time.perf_counter()
        answer = self.server.post("/completion", completion_body(prompt, params))
        wall_ms = 1e3 * (time.perf_counter() - t0)
        gen = parse_completion(answer, self.eos_ids, self.decode, wall_ms)
        if gen.spec is not None and self.fixed_drafts and gen.spec.draft_n:
            gen.spec.acceptance_length = tau_fixed_drafts(gen.spec.draft_n, gen.spec.draft_n_accepted,
                                                          self.fixed_drafts)
        return gen

    def close(self) -> None:
        """Stop the server."""
        self.server.close()


def dflash_gguf(drafter: str, target_gguf: Path, out_dir: Path) -> tuple[Path, int]:
    """Convert the DFlash drafter at ``drafter`` for llama.cpp; ``(path, block_size)``.

    The same code as ``flashdraft convert DRAFTER OUT.gguf --arch dflash --target TARGET``
    (f16 weights: the shipped drafter is stored in fp16). Raises as ``export.convert``.
    """
    from flashdraft.drafters.dflash_format import load_dflash_checkpoint
    from flashdraft.train.export import convert

    out = out_dir / "drafter-dflash.gguf"
    convert(drafter, out, fmt="gguf", arch="dflash", target_gguf=target_gguf)
    config, _ = load_dflash_checkpoint(out)
    return out, int(config["block_size"])


def build_llama_server(name: str, target, model: str | None, threads: int, ctx_size: int,
                       dflash_path: str | None) -> Contender | Unavailable:
    """llama-server configuration ``name`` on the target's GGUF, or why it cannot run.

    A binary that is missing, a drafter that does not convert, or a server that does not
    start or load becomes :class:`Unavailable` with the error (never dropped).

    Args:
        target: the loaded target (its EOS ids and detokenizer).
        model: ``-m`` (None = the packaged default GGUF).
        dflash_path: our DFlash drafter for ``llama-server-dflash`` (None = none for this target).
    """
    from flashdraft.targets.torch import default_model_path

    binary = find_binary()
    if binary is None:
        return Unavailable(name, "peer", f"no llama-server binary ({INSTALL_HINT})")
    gguf = Path(model) if model is not None else default_model_path()
    if gguf.suffix != ".gguf":
        return Unavailable(name, "peer", "needs a GGUF target (-m FILE.gguf)")
    extra, note, out_dir, fixed = [], None, None, None
    try:
        if name == "llama-server-lookup":
            extra, note = ["--spec-type", LOOKUP_TYPE], f"--spec-type {LOOKUP_TYPE}"
        elif name == "llama-server-dflash":
            if dflash_path is None:
                return Unavailable(name, "peer", "no DFlash drafter for this target: pass -md PATH")
            out_dir = Path(tempfile.mkdtemp(prefix="flashdraft-llama-dflash-"))
            path, block = dflash_gguf(dflash_path, gguf, out_dir)
            extra = ["--spec-type", "draft-dflash", "-md", str(path), "--spec-draft-n-max", str(block - 1)]
            note = f"our drafter converted with --arch dflash --target, {block - 1} drafts per step"
            fixed = block - 1
        server = LlamaServerProcess(binary, gguf, threads, ctx_size, extra, owned_dir=out_dir)
    except Exception as e:  # noqa: BLE001 - the row must say why this peer did not run
        if out_dir is not None:
            shutil.rmtree(out_dir, ignore_errors=True)
        return Unavailable(name, "peer", f"failed to start: {type(e).__name__}: {e}")
    return LlamaServerContender(name, server, set(target.eos_token_ids), target.decode, note, fixed_drafts=fixed)
