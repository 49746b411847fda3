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
    i = 0
    while i < len(argv):
        arg = argv[i]
        name, eq, value = arg.partition("=") if arg.startswith("--") else (arg, "", "")
        if name in MODEL_FLAGS:
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
    return out


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
