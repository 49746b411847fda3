#!/usr/bin/env python3
"""Stand-in for the ``llama-server`` binary, for llama.cpp's own server test suite.

llama.cpp's ``tools/server/tests/utils.py`` starts ``$LLAMA_SERVER_BIN_PATH`` with
llama-server flags. This script turns that command line into
``python -m flashdraft.server.cli ...`` and replaces itself with it (exec, so the test
harness's SIGTERM reaches the server directly):

- the flags that name a model file or a model download are dropped, so the packaged
  default model (SmolLM2-135M-Instruct) is served whatever model the test asked for:
  ``-m/--model``, ``-mu/--model-url``, ``-md/--model-draft/--spec-draft-model``,
  ``-hf/-hfr/--hf-repo``, ``-hff/--hf-file``, ``-hft/--hf-token``,
  ``-hfd/-hfrd/--hf-repo-draft/--spec-draft-hf``, ``-hffd/--hf-file-draft``,
  ``-dr/--docker-repo``;
- a draft model the test names (``-md``, with ``--spec-type draft-simple`` or none) becomes
  the packaged model's shipped DFlash drafter (``--spec-type dflash``): a test that drafts
  with a small model of its own still drafts, with the drafter this model has;
- ``-t 1`` is put first (``$FLASHDRAFT_SHIM_THREADS`` changes it; a ``--threads`` the
  test gives comes later and wins);
- every other flag is passed through unchanged, except that the values of flags naming a
  file or folder are made absolute: the server runs in the flashdraft checkout, the tests
  give paths relative to their own folder.

Environment: ``FLASHDRAFT_ROOT`` (default: the checkout this script is in),
``FLASHDRAFT_PYTHON`` (default: ``$FLASHDRAFT_ROOT/.venv/bin/python``),
``FLASHDRAFT_SHIM_LOG`` (a file to append each translated command line to).
"""

from __future__ import annotations

import os
import sys

#: model-file flags, all taking one value: dropped with their value
MODEL_FLAGS = {
    "-m", "--model",
    "-mu", "--model-url",
    "-md", "--model-draft", "--spec-draft-model",
    "-hf", "-hfr", "--hf-repo",
    "-hff", "--hf-file",
    "-hft", "--hf-token",
    "-hfd", "-hfrd", "--hf-repo-draft", "--spec-draft-hf",
    "-hffd", "--hf-file-draft",
    "-dr", "--docker-repo",
}

#: the draft-model flags among them: the test drafts, so the stand-in does too
DRAFT_FLAGS = {"-md", "--model-draft", "--spec-draft-model", "-hfd", "-hfrd", "--hf-repo-draft", "--spec-draft-hf"}

#: flags whose value is a path (relative to the test's cwd): made absolute
PATH_FLAGS = {
    "--chat-template-file", "--api-key-file", "--log-file", "--slot-save-path", "--media-path",
    "--models-dir", "--models-preset", "--lora", "--lora-scaled", "--grammar-file", "-jf",
    "--json-schema-file", "--mcp-servers-config", "--ssl-key-file", "--ssl-cert-file",
    "--webui-config-file", "--ui-config-file", "--log-prompts-dir", "--control-vector",
    "--lookup-cache-static", "-lcs", "--lookup-cache-dynamic", "-lcd", "-mm", "--mmproj",
}


def translate(argv: list[str], cwd: str) -> list[str]:
    """The flashdraft arguments for a llama-server argument list."""
    out = ["-t", os.environ.get("FLASHDRAFT_SHIM_THREADS", "1")]
    drafts = False
    i = 0
    while i < len(argv):
        arg = argv[i]
        name, eq, value = arg.partition("=") if arg.startswith("--") else (arg, "", "")
        if name in MODEL_FLAGS:
            drafts = drafts or name in DRAFT_FLAGS
            i += 1 if eq else 2
            continue
        if name in PATH_FLAGS:
            if eq:
                out.append(f"{name}={os.path.join(cwd, value)}")
            elif i + 1 < len(argv):
                out += [arg, os.path.join(cwd, argv[i + 1])]
                i += 1
            else:
                out.append(arg)
            i += 1
            continue
        out.append(arg)
        i += 1
    if drafts:
        out = _draft_with_dflash(out)
    return out


def _draft_with_dflash(args: list[str]) -> list[str]:
    """``--spec-type draft-simple`` (or none given) -> ``dflash``: the dropped draft model's
    stand-in is the shipped drafter. Other methods the test names stay as they are."""
    for i, arg in enumerate(args):
        if arg == "--spec-type" and i + 1 < len(args):
            if args[i + 1] in ("draft-simple", "draft"):
                return args[: i + 1] + ["dflash"] + args[i + 2:]
            return args
        if arg.startswith("--spec-type="):
            return args if arg.split("=", 1)[1] not in ("draft-simple", "draft") else \
                args[:i] + ["--spec-type=dflash"] + args[i + 1:]
    return args + ["--spec-type", "dflash"]


def main() -> None:
    root = os.environ.get("FLASHDRAFT_ROOT") or os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    python = os.environ.get("FLASHDRAFT_PYTHON") or os.path.join(root, ".venv", "bin", "python")
    args = [python, "-m", "flashdraft.server.cli", *translate(sys.argv[1:], os.getcwd())]
    log = os.environ.get("FLASHDRAFT_SHIM_LOG")
    if log:
        with open(log, "a", encoding="utf-8") as f:
            f.write(" ".join(sys.argv[1:]) + "\n  -> " + " ".join(args[3:]) + "\n")
    print("llama_server_shim: " + " ".join(args), file=sys.stderr, flush=True)
    os.chdir(root)
    os.execv(python, args)


if __name__ == "__main__":
    main()
