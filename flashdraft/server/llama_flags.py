"""llama-server's flags that ``flashdraft serve`` does not implement itself, so that any
llama-server command line starts this server with only the model paths changed.

Two kinds, both parsed (with llama-server's arity) so no command line ends the process:

- **ignored**: flags about hardware, memory, threads or features of the C++ server that
  change no answer here (GPU layers, batch sizes, mmap, CPU masks, the web UI's agent
  tools...). Listed once in the startup log.
- **refused unless neutral**: flags that would change what the model answers (LoRA
  adapters, extra samplers and penalties, RoPE scaling, a hub download). Serving without
  them would return other text than the user asked for, so the server refuses to start
  and names the flag, unless the value given is the one that changes nothing (e.g.
  ``--repeat-penalty 1.0``).

Flags ``flashdraft serve`` implements are defined in :mod:`flashdraft.server.cli`.
"""

from __future__ import annotations

import argparse

#: ``names : arity`` per line; arity ``b`` = a switch, ``v`` = one value, ``v2`` = two values.
#: The first name is the one the log shows.
IGNORED = """
-ngl --gpu-layers --n-gpu-layers : v
--spec-draft-ngl -ngld --gpu-layers-draft --n-gpu-layers-draft : v
--flash-attn -fa : ?
--kv-unified -kvu : b
--no-kv-unified -no-kvu : b
--kv-unified-per-slot : v
--cache-idle-slots --no-cache-idle-slots : b
--ctx-checkpoints -ctxcp --swa-checkpoints : v
--checkpoint-min-step -cms : v
--no-mmap --mmap : b
--load-mode -lm : v
--lazy-mode -lzm : v
--mlock : b
--no-host : b
--repack --no-repack -nr : b
--cont-batching -cb --no-cont-batching -nocb : b
--warmup --no-warmup : b
--threads-batch -tb : v
-C --cpu-mask : v
-Cr --cpu-range : v
--cpu-strict : v
--prio : v
--poll : v
-Cb --cpu-mask-batch : v
-Crb --cpu-range-batch : v
--cpu-strict-batch : v
--prio-batch : v
--poll-batch : v
--ctx-size-draft -cd : v
--spec-draft-n-min --draft-min --draft-n-min : v
--spec-draft-p-split --draft-p-split : v
--spec-draft-threads -td --threads-draft : v
--spec-draft-threads-batch -tbd --threads-batch-draft : v
--spec-draft-cpu-mask -Cd --cpu-mask-draft : v
--spec-draft-cpu-range -Crd --cpu-range-draft : v
--spec-draft-cpu-strict --cpu-strict-draft : v
--spec-draft-prio --prio-draft : v
--spec-draft-poll --poll-draft : v
--spec-draft-cpu-mask-batch -Cbd --cpu-mask-batch-draft : v
--spec-draft-cpu-strict-batch --cpu-strict-batch-draft : v
--spec-draft-prio-batch --prio-batch-draft : v
--spec-draft-poll-batch --poll-batch-draft : v
--spec-draft-override-tensor -otd --override-tensor-draft : v
--spec-draft-cpu-moe -cmoed --cpu-moe-draft : b
--spec-draft-n-cpu-moe --spec-draft-ncmoe -ncmoed --n-cpu-moe-draft : v
--spec-draft-backend-sampling --no-spec-draft-backend-sampling : b
--spec-draft-device -devd --device-draft : v
--spec-ngram-mod-n-min : v
--spec-ngram-mod-n-max : v
--spec-ngram-mod-n-match : v
--spec-ngram-simple-size-n : v
--spec-ngram-simple-size-m : v
--spec-ngram-simple-min-hits : v
--spec-ngram-map-k-size-n : v
--spec-ngram-map-k-size-m : v
--spec-ngram-map-k-min-hits : v
--spec-ngram-map-k4v-size-n : v
--spec-ngram-map-k4v-size-m : v
--spec-ngram-map-k4v-min-hits : v
--spec-ngram-size-n : v
--spec-ngram-size-m : v
--spec-ngram-min-hits : v
--lookup-cache-static -lcs : v
--lookup-cache-dynamic -lcd : v
--list-devices : b
--split-mode -sm : v
--tensor-split -ts : v
--main-gpu -mg : v
--fit -fit : v
--fit-target -fitt : v
--fit-ctx -fitc : v
--override-tensor -ot : v
--cpu-moe -cmoe : b
--n-cpu-moe -ncmoe : v
--n-cpu-ffn -ncffn : v
--op-offload --no-op-offload : b
--no-kv-offload -nkvo --kv-offload -kvo : b
--numa : v
--check-tensors : b
--defrag-thold -dt : v
--swa-full : b
--cache-reuse : v
--perf --no-perf : b
--escape -e --no-escape : b
--log-colors : ?
--log-jsonl --no-log-jsonl : b
--no-log-prefix : b
--no-log-timestamps : b
--verbosity -lv --log-verbosity : v
--offline : b
--backend-sampling --backend_sampling -bs : b
--reuse-port : b
--path : v
--api-prefix : v
--ui-config --webui-config : v
--ui-config-file --webui-config-file : v
--ui-mcp-proxy --webui-mcp-proxy --no-ui-mcp-proxy --no-webui-mcp-proxy : b
--tools : v
--tools-runtime : v
--mcp-servers-config : v
--mcp-servers-json : v
--agent -ag --no-agent -no-ag : b
--embedding --embeddings : b
--rerank --reranking : b
--pooling : v
--embd-normalize : v
--timeout -to : v
--threads-http : v
--props : b
--slot-save-path : v
--media-path : v
--models-dir : v
--models-preset : v
--models-max : v
--models-autoload --no-models-autoload : b
--reasoning-format : v
--reasoning-budget-message : v
--reasoning-preserve --no-reasoning-preserve : b
--skip-chat-parsing --no-skip-chat-parsing : b
--prefill-assistant --no-prefill-assistant : b
--slot-prompt-similarity -sps : v
--sleep-idle-seconds : v
--log-prompts-dir : v
--lora-init-without-apply : b
--special -sp : b
--spm-infill : b
--ssl-key-file : v
--ssl-cert-file : v
--cache-list -cl : b
--completion-bash : b
--image-min-tokens : v
--image-max-tokens : v
--mtmd-batch-max-tokens : v
--video-fps : v
--video-timestamp-interval : v
--video-ffmpeg-dir : v
--mmproj-auto --no-mmproj --no-mmproj-auto : b
--mmproj-offload --no-mmproj-offload : b
--mmproj-device -mmdev : v
"""

#: flags that change answers: ``names : arity : neutral values`` (comma-separated; the
#: flag is accepted only with one of them; none listed = always refused).
REFUSED = """
--lora : v :
--lora-scaled : v :
--control-vector : v :
--control-vector-scaled : v :
--control-vector-layer-range : v2 :
--override-kv : v :
-hf -hfr --hf-repo : v :
-hff --hf-file : v :
-hft --hf-token : v :
-mu --model-url : v :
-dr --docker-repo : v :
--spec-draft-hf -hfd -hfrd --hf-repo-draft : v :
-mm --mmproj : v :
-mmu --mmproj-url : v :
--rope-scaling : v : none
--rope-scale : v : 1,1.0
--rope-freq-base : v : 0,0.0
--rope-freq-scale : v : 0,0.0,1,1.0
--yarn-orig-ctx : v : 0
--yarn-ext-factor : v : -1,-1.0
--yarn-attn-factor : v : -1,-1.0,1,1.0
--yarn-beta-slow : v : -1,-1.0
--yarn-beta-fast : v : -1,-1.0
--samplers : v :
--sampler-seq --sampling-seq : v :
--top-nsigma --top-n-sigma : v : -1,-1.0
--xtc-probability : v : 0,0.0
--xtc-threshold : v : 0.1,0.10
--typical --typical-p : v : 1,1.0
--repeat-last-n : v : 64,0
--repeat-penalty : v : 1,1.0,1.00
--presence-penalty : v : 0,0.0
--frequency-penalty : v : 0,0.0
--dry-multiplier : v : 0,0.0
--dry-base : v : 1.75
--dry-allowed-length : v : 2
--dry-penalty-last-n : v : -1
--dry-sequence-breaker : v :
--adaptive-target : v :
--adaptive-decay : v :
--dynatemp-range : v : 0,0.0
--dynatemp-exp : v : 1,1.0
--mirostat : v : 0
--mirostat-lr : v : 0.1
--mirostat-ent : v : 5,5.0
-l --logit-bias : v :
--grammar : v :
--grammar-file : v :
-j --json-schema : v :
-jf --json-schema-file : v :
--reasoning-effort : v :
--reasoning-budget : v : -1
-r --reverse-prompt : v :
"""


def _parse(table: str, with_neutral: bool) -> list[tuple[tuple[str, ...], str, tuple[str, ...]]]:
    out = []
    for line in table.strip().splitlines():
        parts = [p.strip() for p in line.split(":")]
        names, arity = tuple(parts[0].split()), parts[1]
        neutral = tuple(v for v in parts[2].split(",") if v) if with_neutral else ()
        out.append((names, arity, neutral))
    return out


IGNORED_FLAGS = _parse(IGNORED, with_neutral=False)
REFUSED_FLAGS = _parse(REFUSED, with_neutral=True)


def _dest(kind: str, names: tuple[str, ...]) -> str:
    return f"{kind}_" + names[0].lstrip("-").replace("-", "_")


class _Given(argparse.Action):
    """Stores ``(spelling used, value)``: a pair such as ``--warmup/--no-warmup`` shares one
    entry, and the log must show the one the user wrote."""

    def __call__(self, parser, namespace, values, option_string=None):
        value = " ".join(values) if isinstance(values, list) else (values or "")
        setattr(namespace, self.dest, (option_string, value))


def describe() -> str:
    """The help text of the compatibility group: every flag named, one line per kind (the
    flags themselves are hidden from ``--help``, one line each would bury the rest)."""
    ignored = ", ".join(names[0] for names, _, _ in IGNORED_FLAGS)
    refused = ", ".join(names[0] for names, _, _ in REFUSED_FLAGS)
    return ("llama-server flags this engine does not implement, parsed with llama-server's arity so its "
            "command lines start this server. Ignored (hardware and memory settings that change no answer "
            f"here; listed once in the log): {ignored}. Refused, stopping the start with a message, unless given "
            f"the value that changes nothing (they would change the answers): {refused}.")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ignored and refused flags to ``parser``, hidden from ``--help`` (``parser``'s
    description, :func:`describe`, names them all)."""
    for kind, flags in (("ignored", IGNORED_FLAGS), ("refused", REFUSED_FLAGS)):
        for names, arity, _ in flags:
            nargs = {"b": 0, "?": "?", "v2": 2}.get(arity)  # "?": newer llama.cpp a value, older a switch
            parser.add_argument(*names, action=_Given, nargs=nargs, dest=_dest(kind, names), default=None,
                                metavar="V", help=argparse.SUPPRESS)


def ignored(args: argparse.Namespace) -> list[str]:
    """The ignored flags given, as ``"-ngl all"`` strings (spelled as given)."""
    out = []
    for names, _, _ in IGNORED_FLAGS:
        given = getattr(args, _dest("ignored", names), None)
        if given is not None:
            out.append(f"{given[0]} {given[1]}".strip())
    return out


def refused(args: argparse.Namespace) -> list[str]:
    """One message per answer-changing flag given with a value that is not neutral."""
    out = []
    for names, _, neutral in REFUSED_FLAGS:
        given = getattr(args, _dest("refused", names), None)
        if given is None or given[1] in neutral:
            continue
        hint = f" (only {' or '.join(neutral)} is accepted: the value that changes nothing)" if neutral else ""
        out.append(f"{given[0]} {given[1]}: not supported by this engine, and serving without it would change "
                   f"the answers{hint}")
    return out
