"""z-lab's reference DFlash loop as a bench peer: ``zlab`` (its loop, no drafts) and ``zlab-dflash``.

z-lab's package ``dflash`` 0.1.0 (PyPI; the reference the paper's numbers come from and the
format vLLM and SGLang read) ships ``dflash.model.DFlashDraftModel`` (a transformers
``Qwen3PreTrainedModel``) and ``dflash_generate(model, target, input_ids, max_new_tokens,
stop_token_ids, temperature, block_size=None)``, which drives a transformers target: prefill,
then per step draft ``block_size - 1`` tokens, verify them in one target forward, accept the
matching prefix and the target's bonus token. ``block_size=1`` is its loop without drafting.

Our drafter in its format (:func:`export_zlab`): ``config.json`` with ``architectures:
["DFlashDraftModel"]``, ``model_type: qwen3``, ``block_size``, ``num_target_layers``,
``dflash_config: {mask_token_id, target_layer_ids}`` and the weights without embedding or LM
head, as written by ``flashdraft convert --to specforge``. What its class cannot express
(:func:`zlab_limits`), so the export is the nearest faithful variant:

- **reduced draft vocabulary** (``d2t``): ``compute_logits`` projects with the target's whole
  LM head and takes the argmax over all 49,152 tokens; our engine takes it over the ``d2t``
  rows only. ``d2t`` is left out, so drafts may pick tokens the drafter was never trained to
  rank (their logits come from the same head rows, untrained as draft targets).
- **n-gram seeding** (``dflash_config.ngram_seeded``): the block's mask positions always start
  as the mask token; ours start from the prompt-lookup continuation where the context has one.
- **draft length**: always ``block_size - 1`` drafts per step (no depth controller).

Counters: ``dflash_generate`` reports acceptance only with ``return_stats``, which calls
``torch.cuda.synchronize()`` (no CPU path), so the steps are read from the target's forwards:
a forward pre-hook records each verify block's first position; tokens per step are the
differences. Timing: the first verify forward starts the decode clock.
"""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path

import torch

from flashdraft.bench.contender import DESCRIPTIONS, BenchPrompt, Contender, Unavailable
from flashdraft.bench.measure import Generation, SpecCounts
from flashdraft.sampling import SamplingParams

ZLAB_PEERS = ("zlab", "zlab-dflash")
#: transformers targets loaded for z-lab's loop when the bench's target runs on llama.cpp, by ``-m``
_OWN_TARGETS: dict[str | None, torch.nn.Module] = {}
ZLAB_INSTALL = "pip install --no-deps dflash==0.1.0 (the `zlab` extra; --no-deps keeps torch and transformers)"


def zlab_limits(config: dict, has_d2t: bool) -> list[str]:
    """What of a drafter with ``config`` (our config.json dict) z-lab's class cannot express."""
    out = []
    if has_d2t:
        out.append("reduced draft vocabulary (d2t) dropped: drafts over the full vocabulary")
    if (config.get("dflash_config") or {}).get("ngram_seeded"):
        out.append("n-gram seeding dropped: blocks start as mask tokens")
    return out


def export_zlab(src: str | Path, out: str | Path) -> tuple[Path, list[str]]:
    """Write the drafter at ``src`` (SpecForge dir or GGUF) in z-lab's format at ``out``.

    Returns ``(out, limits)``: the directory (``config.json`` + ``model.safetensors``, fp32)
    and what was left out (:func:`zlab_limits`). Raises as ``load_dflash_checkpoint``.
    """
    from flashdraft.drafters.dflash_format import load_dflash_checkpoint, save_specforge

    config, state = load_dflash_checkpoint(src)
    limits = zlab_limits(config, "d2t" in state)
    state = {k: v for k, v in state.items() if k != "d2t"}
    config["dflash_config"] = {k: v for k, v in config["dflash_config"].items() if k != "ngram_seeded"}
    save_specforge(out, config, state, dtype=torch.float32)
    return Path(out), limits


def load_zlab_drafter(directory: str | Path):
    """``dflash.model.DFlashDraftModel.from_pretrained(directory)`` (``DFlash2DraftModel`` for
    a DFlash2 drafter) in fp32, eval mode. Raises ImportError when the ``dflash`` package is
    missing."""
    import json

    from dflash.model import DFlash2DraftModel, DFlashDraftModel

    config = json.loads((Path(directory) / "config.json").read_text())
    cls = DFlash2DraftModel if "DFlash2DraftModel" in config.get("architectures", []) else DFlashDraftModel
    return cls.from_pretrained(str(directory), dtype=torch.float32).eval()


class _VerifyStarts:
    """Forward pre-hook on the target: (perf_counter s, first position) of every forward."""

    def __init__(self, model: torch.nn.Module):
        self.model, self.starts, self._hook = model, [], None

    def _record(self, _module, args, kwargs) -> None:
        pos = kwargs.get("position_ids")
        self.starts.append((time.perf_counter(), int(pos[0, 0]) if pos is not None else 0))

    def __enter__(self) -> "_VerifyStarts":
        self._hook = self.model.register_forward_pre_hook(self._record, with_kwargs=True)
        return self

    def __exit__(self, *exc) -> None:
        self._hook.remove()


def spec_counts(starts: list[int], end: int, drafts: int) -> SpecCounts:
    """Counters of one ``dflash_generate`` call from its target forwards.

    Args:
        starts: first position of every target forward (the prefill's is 0).
        end: the position of the last token of its output (the next step's anchor).
        drafts: drafts per verify step (``block_size - 1``).
    The prefill is one step that yields one token; verify step k (anchored at ``starts[k]``)
    yields ``starts[k+1] - starts[k]`` tokens (the last one ``end - starts[-1]``): accepted
    drafts + the bonus token.
    """
    counts = SpecCounts(steps=0)
    counts.add_step(0, 0)
    bounds = starts[1:] + [end]
    for a, b in zip(bounds, bounds[1:]):
        counts.add_step(drafts, b - a - 1)
    return counts


class ZLabContender(Contender):
    """``dflash_generate`` on a transformers target with z-lab's drafter object ``drafter``:
    drafting (``zlab-dflash``) or not (``zlab``: ``block_size=1``, where the loop only reads
    the drafter's mask id). Greedy and sampled (its own sampler)."""

    kind = "peer"
    constraint_note = "z-lab's dflash_generate takes no grammar"

    def __init__(self, name: str, hf_model, eos_ids: set[int], decode, drafter, drafting: bool,
                 note: str | None = None, shared_target=None):
        self.name, self.hf_model, self.eos_ids, self.decode = name, hf_model, eos_ids, decode
        self.drafter, self.drafting, self.shared_target = drafter, drafting, shared_target
        self.block_size = int(drafter.block_size) if drafting else 1
        self.description = DESCRIPTIONS[name] + (f"; {note}" if note else "")

    def activate(self) -> None:
        # on the torch backend the model is our engine's too: its feature hooks would only add work
        if self.shared_target is not None:
            self.shared_target.set_feature_layers(None)

    def run(self, prompt: BenchPrompt, params: SamplingParams) -> Generation:
        from dflash.model import dflash_generate

        if params.seed is not None:
            torch.manual_seed(params.seed)
        input_ids = torch.tensor([prompt.ids], dtype=torch.long)
        n_prompt = len(prompt.ids)
        with _VerifyStarts(self.hf_model) as hook:
            t0 = time.perf_counter()
            out = dflash_generate(self.drafter, self.hf_model, input_ids, prompt.max_tokens,
                                  sorted(self.eos_ids), temperature=params.temperature,
                                  top_p=params.top_p if not params.greedy else 1.0,
                                  top_k=params.top_k if not params.greedy else 0, block_size=self.block_size)
            t_end = time.perf_counter()
        ids = out[0, n_prompt:].tolist()
        finish = "length"
        cut = next((i for i, t in enumerate(ids) if t in self.eos_ids), None)
        if cut is not None:
            ids, finish = ids[:cut], "stop"
        # the first forward after the prefill starts the decode phase (the first token is known then)
        first = hook.starts[1][0] if len(hook.starts) > 1 else t_end
        spec = None
        if self.drafting:
            spec = spec_counts([p for _, p in hook.starts], out.shape[1] - 1, self.block_size - 1)
        return Generation(text=self.decode(ids), token_ids=ids, prompt_tokens=n_prompt, completion_tokens=len(ids),
                          ttft_ms=1e3 * (first - t0), total_ms=1e3 * (t_end - t0), finish_reason=finish, spec=spec)


def build_zlab(name: str, target, model: str | None, dflash_path: str | None, work_dir: Path) -> Contender | Unavailable:
    """z-lab configuration ``name``, or why it cannot run.

    Uses the target's transformers model when the bench runs on torch, else loads one from the
    same GGUF (fp32). ``work_dir`` receives the exported drafter.
    """
    if importlib.util.find_spec("dflash") is None:
        return Unavailable(name, "peer", f"z-lab's package is not installed ({ZLAB_INSTALL})")
    if dflash_path is None:
        return Unavailable(name, "peer", "no DFlash drafter for this target: pass -md PATH")
    if not Path(dflash_path).exists():  # e.g. -md random:1
        return Unavailable(name, "peer", f"z-lab's loop loads a drafter checkpoint from disk; {dflash_path!r} is none")
    from flashdraft.targets.torch import load_hf_model

    out, limits = export_zlab(dflash_path, work_dir / "zlab-drafter")
    drafter = load_zlab_drafter(out)
    hf_model, shared = target.model, target
    if hf_model is None:  # the llama backend: z-lab's loop needs a transformers target
        if model not in _OWN_TARGETS:  # one copy for zlab and zlab-dflash
            _OWN_TARGETS[model] = load_hf_model(model, torch.float32)[0].eval()
        hf_model, shared = _OWN_TARGETS[model], None
    eos, drafting = set(target.eos_token_ids), name == "zlab-dflash"
    note = "; ".join(limits) if drafting else "block_size=1: the target alone in z-lab's loop"
    return ZLabContender(name, hf_model, eos, target.decode, drafter, drafting, note or None, shared_target=shared)
