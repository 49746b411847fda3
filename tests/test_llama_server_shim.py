"""scripts/llama_server_shim.py: the llama-server command lines of llama.cpp's server tests,
turned into ``flashdraft serve`` ones (docs/llama-server-tests.md)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from flashdraft.server.cli import build_parser

spec = importlib.util.spec_from_file_location("shim", Path(__file__).parents[1] / "scripts" / "llama_server_shim.py")
shim = importlib.util.module_from_spec(spec)
spec.loader.exec_module(shim)


def test_model_files_go_and_paths_become_absolute():
    out = shim.translate(["-m", "x.gguf", "--hf-repo=a/b", "--chat-template-file", "t.jinja", "-c", "256"], "/w")
    assert out == ["-t", "1", "--chat-template-file", "/w/t.jinja", "-c", "256"]


def test_a_draft_model_becomes_the_shipped_drafter():
    assert shim.translate(["-md", "d.gguf", "--spec-type", "draft-simple", "--spec-draft-n-max", "8"], "/w") == \
        ["-t", "1", "--spec-type", "dflash", "--spec-draft-n-max", "8"]
    assert shim.translate(["--model-draft", "d.gguf"], "/w") == ["-t", "1", "--spec-type", "dflash"]
    # another method the test names stays; no draft model, no drafting added
    assert shim.translate(["-md", "d.gguf", "--spec-type", "ngram-simple"], "/w")[-1] == "ngram-simple"
    assert "--spec-type" not in shim.translate(["-m", "x.gguf"], "/w")
    args = build_parser().parse_args(shim.translate(["-md", "d", "--spec-type", "draft-simple",
                                                     "--spec-synth-rates", "0,0"], "/w") + ["--spec-draft-n-max", "2"])
    assert args.spec_type == "dflash" and args.spec_synth_rates == (0.0, 0.0)
