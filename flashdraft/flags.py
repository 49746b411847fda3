"""The flags several commands share (llama-server names) and the help formatter of every
``flashdraft`` parser; :meth:`flashdraft.engine.EngineConfig.from_args` turns them into a config."""

from __future__ import annotations

import argparse

from flashdraft.adaptive import CONTROLLERS
from flashdraft.argtypes import non_negative_int
from flashdraft.device import add_device_argument
from flashdraft.engine import LOOKUPS, SPEC_TYPES
from flashdraft.kv_codecs import CACHE_TYPES
from flashdraft.targets.load import BACKENDS


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """argparse's defaults formatter that adds ``(default: X)`` only where the help text does
    not already say its default, and not to on/off switches (off unless given)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text.lower() or action.nargs == 0:
            return text
        return super()._get_help_string(action)


WEIGHTS_CHOICES = ("fp32", "bf16", "q4")
WEIGHTS_HELP = ("target weights (default: fp32); bf16 halves the bytes a decode step reads but is "
                "fast only on a CPU with AVX512-BF16 or AMX (slower than fp32 elsewhere); q4 runs a GGUF's "
                "Q4_0/Q4_1 projections on the int4 kernel, bf16 activations (docs/performance.md)")


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """Model-selection flags shared by generate/eval/bench (llama-server names), ``--device`` included."""
    p.add_argument("-m", "--model", default=None,
                   help="target model: .gguf file, HF directory or hub id (default: packaged SmolLM2-135M-Instruct)")
    p.add_argument("-md", "--spec-draft-model", default=None,
                   help="drafter: DFlash SpecForge dir/GGUF (or random[:LAYERS]); draft model path (or 'target')")
    p.add_argument("--spec-type", default=None, choices=SPEC_TYPES,
                   help="drafting method (default: dflash with -md, else none; dflash/hybrid without -md "
                        "use the shipped drafter of the packaged model)")
    p.add_argument("--spec-draft-n-max", type=int, default=16, help="max draft tokens per step (default: 16)")
    p.add_argument("--spec-dm-controller", choices=CONTROLLERS, default="profit",
                   help="draft length: cost = the depth with the most expected tokens per ms by the cost of a "
                        "k-row verify measured at load, each draft cut where the drafter's own confidence "
                        "stops paying; profit = the same by online step times only; both turn drafting off "
                        "when it does not pay; off = always --spec-draft-n-max (default: profit)")
    p.add_argument("--spec-dflash-cross-ctx", type=int, default=None,
                   help="DFlash drafter attends to at most N recent positions")
    add_drafter_arguments(p)
    add_synth_arguments(p)
    add_suffix_arguments(p)
    p.add_argument("-c", "--ctx-size", type=non_negative_int, default=4096,
                   help="context size in tokens; 0 = the model's training context (default: 4096)")
    p.add_argument("--weights", choices=WEIGHTS_CHOICES, default="fp32", help=WEIGHTS_HELP)
    add_backend_argument(p)
    p.add_argument("-t", "--threads", type=int, default=None, help="CPU threads for the target and drafter (default: 1 on machines with up to 2 cores, else cores - 1; printed at startup, docs/performance.md)")
    add_device_argument(p)
    add_cache_arguments(p)


BACKEND_HELP = ("engine that runs the target: llama = llama.cpp's kernels (GGUF on the CPU), torch = the "
                "PyTorch reference (GPUs, --weights, compressed KV caches, training), auto = llama for a GGUF "
                "target on the CPU when llama.cpp is installed and passes its probe, else torch; the choice "
                "and why are printed at startup (default: auto)")


def add_drafter_arguments(p) -> None:
    """The drafter network's flags, shared by serve and generate/eval/bench (``p`` a parser or group)."""
    p.add_argument("--spec-draft-p-min", "--draft-p-min", dest="spec_draft_p_min", type=float, default=0.0,
                   metavar="P", help="cut each DFlash block before the first draft the drafter gives a probability "
                                     "below P (0 = never; default: 0)")
    p.add_argument("--spec-draft-dtype", choices=("auto", "f32", "bf16"), default="auto",
                   help="dtype the drafter network and its LM head run in: auto = bf16 on a CPU where a measured "
                        "bf16 matmul beats f32 (AVX512-BF16/AMX), else f32; output is the target's either way "
                        "(default: auto; the startup log says which)")


def float_list(text: str) -> tuple[float, ...]:
    """``P0,P1,...`` as floats. Raises ArgumentTypeError."""
    try:
        return tuple(float(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of numbers") from None


def add_synth_arguments(p) -> None:
    """llama-server's synthetic-acceptance flags (benchmarking only; ``p`` a parser or group)."""
    p.add_argument("--spec-synth-rates", type=float_list, default=None, metavar="P0,P1,...",
                   help="benchmarking only: accept draft position i with unconditional probability Pi whatever "
                        "the target says (--spec-draft-n-max values, non-increasing); the output is NOT the "
                        "model's. The drafting depth is then fixed at --spec-draft-n-max")
    p.add_argument("--spec-synth-len", type=float, default=None, metavar="L",
                   help="benchmarking only: as --spec-synth-rates with every position accepted at the rate "
                        "that gives a mean acceptance length of L tokens (the target's own included)")


def add_suffix_arguments(p) -> None:
    """Flags of the suffix drafter and of the hybrid's lookup source (``p`` a parser or group)."""
    p.add_argument("--spec-lookup", choices=LOOKUPS, default="ngram",
                   help="the hybrid's lookup source: ngram = prompt lookup, suffix = SuffixDecoding over the "
                        "prompt, the answer so far and the client's past answers (default: ngram)")
    p.add_argument("--spec-suffix-cache", type=int, default=256, metavar="N",
                   help="suffix drafter: past answers kept over all API keys, oldest dropped first; each key "
                        "drafts from its own answers only (0 = none; default: 256)")
    p.add_argument("--spec-suffix-factor", type=float, default=4.0, metavar="F",
                   help="suffix drafter: at most F draft tokens per matched token (default: 4.0)")
    p.add_argument("--spec-suffix-min-prob", type=float, default=0.1, metavar="P",
                   help="suffix drafter: stop a draft where its estimated probability falls below P (default: 0.1)")


def add_backend_argument(p) -> None:
    """``--backend auto|torch|llama`` (``p`` a parser or argument group)."""
    p.add_argument("--backend", choices=BACKENDS, default="auto", help=BACKEND_HELP)


def add_cache_arguments(p) -> None:
    """KV cache flags (llama.cpp names; ``p`` a parser or argument group)."""
    kinds = ", ".join(CACHE_TYPES)
    p.add_argument("-ctk", "--cache-type-k", default=None, choices=CACHE_TYPES, metavar="TYPE",
                   help=f"target K cache type: {kinds} (default: f32 on the torch backend, f16 on llama, "
                        "as llama.cpp; docs/kv-cache.md)")
    p.add_argument("-ctv", "--cache-type-v", default=None, choices=CACHE_TYPES, metavar="TYPE",
                   help="target V cache type (default: as -ctk's)")
    p.add_argument("-ctkd", "--cache-type-k-draft", default="f32", choices=CACHE_TYPES, metavar="TYPE",
                   help="DFlash drafter context K cache type (default: f32)")
    p.add_argument("-ctvd", "--cache-type-v-draft", default="f32", choices=CACHE_TYPES, metavar="TYPE",
                   help="DFlash drafter context V cache type (default: f32)")
    p.add_argument("--kv-sink-tokens", type=int, default=0, metavar="N",
                   help="compressed caches keep the first N positions exact (default: 0)")
    p.add_argument("--kv-tail-tokens", type=int, default=0, metavar="N",
                   help="compressed caches keep each token's N most recent positions exact (default: 0)")
